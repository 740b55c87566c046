//! Eager restore: load every stored page into guest RAM before the guest runs, with large
//! reads spread over several threads.

use std::ops::Range;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::layout::{RamMappings, MIN_PAGE_SIZE as BASE_PAGE_SIZE};
use super::reader::{PlanRun, SnapshotChain};
use super::{default_threads, Result, SnapshotError};

/// Runs smaller than this are copied through the mapping rather than written to the
/// memfd (a system call per run costs more than the page faults it saves).
const PWRITE_MIN_BYTES: usize = 64 << 10;

/// How to restore eagerly.
#[derive(Clone, Debug)]
pub struct EagerOptions {
    /// Reader threads.
    pub threads: usize,
    /// Check page CRCs (when the files have them) before the data reaches guest memory.
    pub verify_data: bool,
    /// Bytes per read (and per work item).
    pub chunk_bytes: usize,
}

impl Default for EagerOptions {
    fn default() -> Self {
        EagerOptions {
            threads: default_threads(),
            verify_data: true,
            chunk_bytes: 8 << 20,
        }
    }
}

/// What an eager restore did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreStats {
    /// Pages loaded.
    pub pages: u64,
    /// Bytes loaded.
    pub bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
}

/// Loads the chain into `ram`, which must be fresh (all zero): pages the chain does not
/// store are left alone. On error guest memory may be partly written; do not run the guest.
pub fn restore_eager(
    chain: &SnapshotChain,
    ram: &RamMappings<'_>,
    opts: &EagerOptions,
) -> Result<RestoreStats> {
    let start = Instant::now();
    chain.layers()[0].check_layout(ram.layout())?;
    let page_size = ram.layout().page_size();
    let chunk_pages = (opts.chunk_bytes as u64 / page_size).max(1);

    // Work items: stretches of runs stored back to back in one file, at most a chunk
    // each, so scattered pages still make large reads and threads share the work evenly.
    let mut pieces = Vec::new();
    let mut groups: Vec<Range<usize>> = Vec::new();
    let mut group_pages = 0u64;
    for run in chain.plan() {
        let mut done = 0;
        while done < run.count {
            let count = chunk_pages.min(run.count - done);
            let piece = PlanRun {
                start: run.start + done,
                count,
                layer: run.layer,
                file_offset: run.file_offset + done * page_size,
                crc_index: run.crc_index + done,
            };
            let extends = pieces.last().is_some_and(|last: &PlanRun| {
                last.layer == piece.layer
                    && last.file_offset + last.count * page_size == piece.file_offset
                    && group_pages + count <= chunk_pages
            });
            match groups.last_mut() {
                Some(group) if extends => {
                    group.end += 1;
                    group_pages += count;
                }
                _ => {
                    groups.push(pieces.len()..pieces.len() + 1);
                    group_pages = count;
                }
            }
            pieces.push(piece);
            done += count;
        }
    }

    let next = AtomicUsize::new(0);
    let worker = || -> Result<()> {
        let mut buf = Vec::new();
        while let Some(group) = groups.get(next.fetch_add(1, Ordering::Relaxed)) {
            load_group(
                chain,
                ram,
                &pieces[group.clone()],
                opts.verify_data,
                &mut buf,
            )?;
        }
        Ok(())
    };
    let threads = opts.threads.clamp(1, groups.len().max(1));
    std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads).map(|_| s.spawn(worker)).collect();
        let mut result = worker();
        for h in handles {
            let r = h.join().map_err(|_| SnapshotError::WorkerPanicked)?;
            result = result.and(r);
        }
        result
    })?;

    let pages = chain.data_pages();
    Ok(RestoreStats {
        pages,
        bytes: pages * page_size,
        elapsed: start.elapsed(),
    })
}

/// Loads pieces stored back to back in one file with one read.
fn load_group(
    chain: &SnapshotChain,
    ram: &RamMappings<'_>,
    pieces: &[PlanRun],
    verify: bool,
    buf: &mut Vec<u8>,
) -> Result<()> {
    let first = &pieces[0];
    let layer = &chain.layers()[first.layer];
    let page_size = ram.layout().page_size() as usize;
    let len: usize = pieces.iter().map(|p| p.count as usize * page_size).sum();
    let verify = verify && layer.has_page_crcs();
    // Writing shmem through the memfd allocates its pages without a page fault per page
    // (about 1.5x faster here than filling them through the mapping), but costs a system
    // call per run, so small runs are copied through the mapping. hugetlbfs has no
    // write(): huge pages always go through the mapping.
    let memfd = ram.memfd().filter(|_| page_size as u64 == BASE_PAGE_SIZE);
    if !verify && memfd.is_none() && pieces.len() == 1 {
        // Straight into guest memory: one copy (plan runs never cross regions, so the
        // destination is contiguous).
        let dst = ram.linear_page_ptr(first.start);
        return pread_into(layer.file().as_raw_fd(), dst, len, first.file_offset)
            .map_err(|e| SnapshotError::io("read page data from", layer.path(), e));
    }
    buf.resize(len, 0);
    layer.read_data(first.file_offset, buf)?;
    let mut at = 0usize;
    for piece in pieces {
        let bytes = &buf[at..at + piece.count as usize * page_size];
        at += bytes.len();
        if verify {
            for (i, page) in bytes.chunks_exact(page_size).enumerate() {
                chain.check_page(piece, piece.start + i as u64, page)?;
            }
        }
        match memfd {
            Some(fd) if bytes.len() >= PWRITE_MIN_BYTES => {
                pwrite_all(fd.as_raw_fd(), bytes, ram.memfd_offset(piece.start)).map_err(|e| {
                    SnapshotError::io("write guest RAM restored from", layer.path(), e)
                })?;
            }
            _ => {
                let dst = ram.linear_page_ptr(piece.start);
                // SAFETY: `dst..dst + bytes.len()` is inside one region's mapping (plan
                // runs never cross regions; `RamMappings` keeps it mapped and writable);
                // `bytes` is in a separate allocation.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
            }
        }
    }
    Ok(())
}

/// `pread` exactly `len` bytes at `offset` into raw memory at `dst`.
fn pread_into(fd: i32, dst: *mut u8, len: usize, offset: u64) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < len {
        // SAFETY: `dst + done .. dst + len` is writable memory owned by guest RAM (see
        // caller); the kernel writes at most `len - done` bytes there.
        let n = unsafe {
            libc::pread(
                fd,
                dst.wrapping_add(done).cast(),
                len - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        done += n as usize;
    }
    Ok(())
}

/// `pwrite` all of `buf` at `offset`.
fn pwrite_all(fd: i32, buf: &[u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        // SAFETY: the kernel reads at most `buf.len() - done` bytes from inside `buf`.
        let n = unsafe {
            libc::pwrite(
                fd,
                buf[done..].as_ptr().cast(),
                buf.len() - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        done += n as usize;
    }
    Ok(())
}
