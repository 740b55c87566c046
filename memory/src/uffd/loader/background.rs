//! The background loader: which chunk to load next (faulted chunks, then the working
//! set, then the front-to-back sweep) and loading a chunk with large reads, readahead of
//! the next one, and one `UFFDIO_COPY` per run of missing pages.

use std::os::unix::io::AsRawFd;
use std::sync::atomic::Ordering;

use log::debug;

use super::{Shared, CHUNK_CLAIMED, CHUNK_PENDING};
use crate::snapshot::PlanRun;
use crate::uffd::ops::{self, AlignedBuf};
use crate::uffd::{io_err, lock, UffdError};

/// Why the background loader took a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// A vCPU faulted in it.
    Faulted,
    /// It holds part of the recorded working set.
    WorkingSet,
    /// Its turn in the front-to-back sweep.
    Sweep,
}

impl Shared {
    /// Moves chunk `c` to the front of the background queue.
    pub(super) fn prioritise(&self, c: usize) {
        if self.chunk_state[c].load(Ordering::Acquire) != CHUNK_PENDING {
            return;
        }
        let mut queues = lock(&self.queues);
        if !queues.faulted.contains(&c) {
            queues.faulted.push_back(c);
        }
    }

    /// Claims the next chunk to load: faulted chunks, then the working set, then the
    /// in-order sweep. `None` once every chunk is claimed.
    /// While `held`, only working-set chunks.
    fn next_chunk(&self, held: bool) -> Option<(usize, Source)> {
        let mut queues = lock(&self.queues);
        loop {
            // Once everything is loaded the remaining chunks hold nothing new.
            if self.stop.load(Ordering::SeqCst) || self.is_done() {
                return None;
            }
            let faulted = if held {
                None
            } else {
                queues.faulted.pop_front()
            };
            let (candidate, source) = if let Some(c) = faulted {
                (c, Source::Faulted)
            } else if let Some(c) = queues.working_set.pop_front() {
                (c, Source::WorkingSet)
            } else if held {
                return None;
            } else if queues.cursor < self.chunk_state.len() {
                queues.cursor += 1;
                (queues.cursor - 1, Source::Sweep)
            } else {
                return None;
            };
            if self.chunk_state[candidate]
                .compare_exchange(
                    CHUNK_PENDING,
                    CHUNK_CLAIMED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                return Some((candidate, source));
            }
        }
    }
}

/// Background thread: load chunks, queued ones first, until all are claimed.
pub(super) fn background_thread(shared: &Shared) -> Result<(), UffdError> {
    let mut buf = AlignedBuf::new((shared.chunk_pages * shared.page_size) as usize)
        .map_err(io_err("map the loader buffer"))?;
    // While held, only the recorded working set: the guest is about to need it, so it is
    // worth a CPU even before the vCPUs run (after, the guest would fault on it first and
    // the working set would save nothing). Prefetching around faults and the
    // front-to-back sweep wait for the release.
    while let Some((c, source)) = shared.next_chunk(true) {
        load_chunk(shared, c, source, &mut buf)?;
    }
    if !shared.wait_for_background_release() {
        return Ok(());
    }
    while let Some((c, source)) = shared.next_chunk(false) {
        load_chunk(shared, c, source, &mut buf)?;
    }
    Ok(())
}

/// A piece of a plan run inside one chunk.
struct Piece {
    start: u64,
    end: u64,
    run: PlanRun,
}

/// The parts of plan runs that fall in `chunk`.
fn chunk_pieces(shared: &Shared, chunk: usize) -> Vec<Piece> {
    let total = shared.chain.layout().total_pages();
    let first = chunk as u64 * shared.chunk_pages;
    let end = (first + shared.chunk_pages).min(total);
    let plan = shared.chain.plan();
    let mut idx = plan.partition_point(|r| r.start + r.count <= first);
    let mut pieces = Vec::new();
    while let Some(run) = plan.get(idx).filter(|r| r.start < end) {
        pieces.push(Piece {
            start: run.start.max(first),
            end: (run.start + run.count).min(end),
            run: *run,
        });
        idx += 1;
    }
    pieces
}

/// Starts asynchronous readahead of `chunk`'s data, so the disk works on the next chunk
/// while this thread copies the current one into guest memory.
fn prefetch(shared: &Shared, chunk: usize) {
    if chunk >= shared.chunk_state.len()
        || shared.chunk_state[chunk].load(Ordering::Acquire) != CHUNK_PENDING
    {
        return;
    }
    let pieces = chunk_pieces(shared, chunk);
    for (layer_idx, layer) in shared.chain.layers().iter().enumerate() {
        let ranges = pieces.iter().filter(|p| p.run.layer == layer_idx).map(|p| {
            let start = piece_file_offset(p, shared.page_size);
            (start, start + (p.end - p.start) * shared.page_size)
        });
        let (Some(lo), Some(hi)) = (ranges.clone().map(|r| r.0).min(), ranges.map(|r| r.1).max())
        else {
            continue;
        };
        // SAFETY: plain syscall on the layer's fd; no memory is passed.
        unsafe {
            libc::posix_fadvise(
                layer.file().as_raw_fd(),
                lo as libc::off_t,
                (hi - lo) as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
    }
}

fn load_chunk(
    shared: &Shared,
    chunk: usize,
    source: Source,
    buf: &mut AlignedBuf,
) -> Result<(), UffdError> {
    let pieces = chunk_pieces(shared, chunk);
    prefetch(shared, chunk + 1);

    // One read per stretch of pieces stored back to back in the same file.
    let page_size = shared.page_size;
    let mut i = 0;
    while i < pieces.len() {
        let group_start = i;
        let file_start = piece_file_offset(&pieces[i], page_size);
        let layer = pieces[i].run.layer;
        let mut file_end = file_start + (pieces[i].end - pieces[i].start) * page_size;
        i += 1;
        while i < pieces.len()
            && pieces[i].run.layer == layer
            && piece_file_offset(&pieces[i], page_size) == file_end
        {
            file_end += (pieces[i].end - pieces[i].start) * page_size;
            i += 1;
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Skip the read when faults already brought everything in.
        if pieces[group_start..i]
            .iter()
            .all(|p| shared.loaded.next(false, p.start, p.end) == p.end)
        {
            continue;
        }
        let len = (file_end - file_start) as usize;
        shared.chain.layers()[layer].read_data(file_start, &mut buf.as_mut_slice()[..len])?;
        let mut buf_offset = 0usize;
        for piece in &pieces[group_start..i] {
            copy_piece(shared, piece, source, buf, buf_offset)?;
            buf_offset += ((piece.end - piece.start) * page_size) as usize;
        }
    }
    Ok(())
}

fn piece_file_offset(piece: &Piece, page_size: u64) -> u64 {
    piece.run.file_offset + (piece.start - piece.run.start) * page_size
}

/// Verifies and copies the not-yet-loaded pages of `piece`, whose data is at
/// `buf[buf_offset..]`.
fn copy_piece(
    shared: &Shared,
    piece: &Piece,
    source: Source,
    buf: &AlignedBuf,
    buf_offset: usize,
) -> Result<(), UffdError> {
    let page_size = shared.page_size;
    let data =
        &buf.as_slice()[buf_offset..buf_offset + ((piece.end - piece.start) * page_size) as usize];
    let mut at = shared.loaded.next(false, piece.start, piece.end);
    while at < piece.end {
        let run_end = shared.loaded.next(true, at, piece.end);
        let rel = ((at - piece.start) * page_size) as usize;
        let len = ((run_end - at) * page_size) as usize;
        let bytes = &data[rel..rel + len];
        if shared.opts.verify_data {
            for (k, page) in bytes.chunks_exact(page_size as usize).enumerate() {
                shared.chain.check_page(&piece.run, at + k as u64, page)?;
            }
        }
        let dst = shared.host_addr_of(at);
        // SAFETY: `bytes` is inside `buf`, readable for `len` bytes.
        let filled = match unsafe {
            ops::copy(&shared.uffd, bytes.as_ptr(), dst, len, page_size as usize)
        } {
            Ok(filled) => filled,
            // The fault thread loaded the last missing pages (these among them) and the
            // ranges were unregistered before this copy: nothing is left to do.
            Err(e) if shared.is_done() => {
                debug!("background copy after completion at {dst:#x}: {e}");
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        shared.note_fill(filled);
        let copied = len as u64 - filled.existed * page_size;
        shared
            .counters
            .bytes_background
            .fetch_add(copied, Ordering::Relaxed);
        if source == Source::WorkingSet {
            shared
                .counters
                .bytes_working_set
                .fetch_add(copied, Ordering::Relaxed);
        }
        shared.mark_loaded(at, run_end, true);
        at = shared.loaded.next(false, run_end, piece.end);
    }
    Ok(())
}
