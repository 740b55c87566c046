//! Writing full and diff memory files.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use log::debug;

use super::atomic::write_atomically;
use super::format::{
    align_up, encode_region, Extent, ExtentKind, Header, SnapshotId, DATA_ALIGN, FLAG_DIFF,
    FLAG_PAGE_CRCS, FLAG_PAGE_CRCS_CHECKED_ON_LOAD, FORMAT_VERSION, HEADER_LEN,
};
use super::layout::RamMappings;
use super::scan::{check_dirty_bitmaps, scan, ScanResult, Selection};
use super::{default_threads, Result, SnapshotError};

/// Most iovecs per `pwritev` (the kernel's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;
/// Bytes per `pwritev` call: large sequential writes, below the kernel's 2 GiB cap.
const WRITE_BATCH_BYTES: usize = 64 << 20;

/// How to write a memory file.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Store a CRC32 per data page so restores can detect corrupted data.
    pub page_crcs: bool,
    /// Threads for scanning guest RAM.
    pub threads: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            page_crcs: true,
            threads: default_threads(),
        }
    }
}

/// Identity of a written (or opened) snapshot; a diff needs its base's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// This snapshot's random id.
    pub id: SnapshotId,
    /// For a diff, the id of the snapshot it applies on top of.
    pub base_id: Option<SnapshotId>,
    /// 0 for a full snapshot, base generation + 1 for a diff.
    pub generation: u64,
    /// Page size of the guest RAM it was taken from.
    pub page_size: u64,
    /// Total guest RAM in bytes.
    pub ram_size: u64,
}

impl SnapshotInfo {
    /// Whether this is a diff snapshot.
    pub fn is_diff(&self) -> bool {
        self.base_id.is_some()
    }
}

/// What a write did.
#[derive(Clone, Debug)]
pub struct WriteStats {
    /// Identity of the new file (pass it as the base of the next diff).
    pub info: SnapshotInfo,
    /// Pages whose contents were checked (all pages, or the dirty ones).
    pub pages_examined: u64,
    /// Pages stored with their contents.
    pub data_pages: u64,
    /// Pages recorded as zero (diffs only).
    pub zero_pages: u64,
    /// Entries in the extent index.
    pub extents: u64,
    /// Size of the file.
    pub file_len: u64,
    /// Time spent finding non-zero pages.
    pub scan_time: Duration,
    /// Time spent writing, including fsync and rename.
    pub write_time: Duration,
}

/// Writes a full snapshot of `ram` to `path`, replacing any file there atomically.
///
/// Only non-zero pages are stored. vCPUs and devices must be paused.
pub fn write_full(path: &Path, ram: &RamMappings<'_>, opts: &WriteOptions) -> Result<WriteStats> {
    let layout = ram.layout();
    let info = SnapshotInfo {
        id: new_id(path)?,
        base_id: None,
        generation: 0,
        page_size: layout.page_size(),
        ram_size: layout.ram_size(),
    };
    write_snapshot(path, ram, Selection::All, info, opts)
}

/// Writes a diff against `base` holding the pages marked in `dirty` (one bitmap per
/// region, bit `i` of word `w` = the region's 4 KiB page `64 * w + i`, as
/// `KVM_GET_DIRTY_LOG` returns it). Dirty pages that are now zero are recorded as zero.
pub fn write_diff(
    path: &Path,
    ram: &RamMappings<'_>,
    dirty: &[&[u64]],
    base: &SnapshotInfo,
    opts: &WriteOptions,
) -> Result<WriteStats> {
    let layout = ram.layout();
    if base.page_size != layout.page_size() {
        return Err(SnapshotError::PageSizeMismatch {
            path: path.into(),
            file: base.page_size,
            guest: layout.page_size(),
        });
    }
    if base.ram_size != layout.ram_size() {
        return Err(SnapshotError::RamSizeMismatch {
            path: path.into(),
            file: base.ram_size,
            guest: layout.ram_size(),
        });
    }
    check_dirty_bitmaps(ram, dirty)?;
    let info = SnapshotInfo {
        id: new_id(path)?,
        base_id: Some(base.id),
        generation: base.generation + 1,
        page_size: layout.page_size(),
        ram_size: layout.ram_size(),
    };
    write_snapshot(path, ram, Selection::Dirty(dirty), info, opts)
}

pub(super) fn new_id(path: &Path) -> Result<SnapshotId> {
    SnapshotId::random().map_err(|e| SnapshotError::io("generate snapshot id for", path, e))
}

fn write_snapshot(
    path: &Path,
    ram: &RamMappings<'_>,
    selection: Selection<'_>,
    info: SnapshotInfo,
    opts: &WriteOptions,
) -> Result<WriteStats> {
    let scan_start = Instant::now();
    let scanned = scan(ram, selection, opts.page_crcs, opts.threads)?;
    let scan_time = scan_start.elapsed();

    let (metadata, extents, data_offset) = build_metadata(ram, &scanned, &info, opts.page_crcs);
    let data_pages = scanned.data_pages();
    let file_len = data_offset + data_pages * info.page_size;

    let write_start = Instant::now();
    write_atomically(path, |file| -> std::io::Result<()> {
        // The header first: a file cut short by a kill then still starts with the magic,
        // which is how a later snapshot knows the leftover temp file as gpuvm's own.
        write_all_at(file, &metadata, 0)?;
        file.set_len(file_len)?;
        write_data(file, ram, &scanned, data_offset)
    })
    .map_err(|e| SnapshotError::io("write memory file", path, e))?;
    let write_time = write_start.elapsed();

    debug!(
        "memory file {}: {} data pages, {} zero pages, {} extents, {} bytes, scan {:?}, write {:?}",
        path.display(),
        data_pages,
        scanned.zero_pages(),
        extents,
        file_len,
        scan_time,
        write_time
    );
    Ok(WriteStats {
        info,
        pages_examined: scanned.pages_examined,
        data_pages,
        zero_pages: scanned.zero_pages(),
        extents,
        file_len,
        scan_time,
        write_time,
    })
}

/// Encodes header, region table, extent index and page CRCs, padded to the data start.
/// Returns the bytes, the number of extents and the data offset.
pub(super) fn build_metadata(
    ram: &RamMappings<'_>,
    scanned: &ScanResult,
    info: &SnapshotInfo,
    page_crcs: bool,
) -> (Vec<u8>, u64, u64) {
    let layout = ram.layout();
    let page_size = layout.page_size();

    let mut index = Vec::new();
    for region in layout.regions() {
        encode_region(region, &mut index);
    }
    let mut extents = Vec::new();
    for run in &scanned.runs {
        let mut start = run.start;
        let mut left = run.count;
        while left > 0 {
            // page_count is 32 bits in the index; split longer runs.
            let count = left.min(u64::from(u32::MAX));
            extents.push(Extent {
                first_page: layout.linear_to_guest_page(start),
                page_count: count as u32,
                kind: run.kind,
                data_offset: 0,
            });
            start += count;
            left -= count;
        }
    }
    let data_pages = scanned.data_pages();
    let crc_bytes = if page_crcs { data_pages * 4 } else { 0 };
    let metadata_len = HEADER_LEN as u64
        + index.len() as u64
        + extents.len() as u64 * super::format::EXTENT_ENTRY_LEN as u64
        + crc_bytes;
    let data_offset = align_up(metadata_len, DATA_ALIGN);

    let mut next_data = data_offset;
    for e in &mut extents {
        if e.kind == ExtentKind::Data {
            e.data_offset = next_data;
            next_data += u64::from(e.page_count) * page_size;
        }
        e.encode(&mut index);
    }
    // The index CRC covers the region table and extent index only: each page CRC is
    // checked with its page on load (FLAG_PAGE_CRCS_CHECKED_ON_LOAD).
    let index_crc = crc32fast::hash(&index);
    if page_crcs {
        for crc in &scanned.page_crcs {
            index.extend_from_slice(&crc.to_le_bytes());
        }
    }

    let mut flags = 0;
    if info.is_diff() {
        flags |= FLAG_DIFF;
    }
    if page_crcs {
        flags |= FLAG_PAGE_CRCS | FLAG_PAGE_CRCS_CHECKED_ON_LOAD;
    }
    let header = Header {
        version: FORMAT_VERSION,
        header_len: HEADER_LEN as u32,
        flags,
        region_count: layout.regions().len() as u32,
        page_size,
        ram_size: layout.ram_size(),
        snapshot_id: info.id,
        base_id: info.base_id.unwrap_or(SnapshotId::NONE),
        generation: info.generation,
        extent_count: extents.len() as u64,
        data_page_count: data_pages,
        data_offset,
        index_crc,
    };
    let mut bytes = Vec::with_capacity(data_offset as usize);
    bytes.extend_from_slice(&header.encode());
    bytes.extend_from_slice(&index);
    bytes.resize(data_offset as usize, 0);
    (bytes, extents.len() as u64, data_offset)
}

/// Writes every data page straight from guest memory, in index order, with large
/// vectored writes (no intermediate copy).
fn write_data(
    file: &File,
    ram: &RamMappings<'_>,
    scanned: &ScanResult,
    data_offset: u64,
) -> std::io::Result<()> {
    let page_size = ram.layout().page_size() as usize;
    let mut batch: Vec<libc::iovec> = Vec::with_capacity(MAX_IOVECS);
    let mut batch_bytes = 0usize;
    let mut offset = data_offset;
    for run in scanned.runs.iter().filter(|r| r.kind == ExtentKind::Data) {
        let mut ptr = ram.linear_page_ptr(run.start);
        let mut left = run.count as usize * page_size;
        while left > 0 {
            let len = left.min(WRITE_BATCH_BYTES - batch_bytes);
            batch.push(libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            });
            batch_bytes += len;
            ptr = ptr.wrapping_add(len);
            left -= len;
            if batch.len() == MAX_IOVECS || batch_bytes == WRITE_BATCH_BYTES {
                pwritev_all(file, &mut batch, offset)?;
                start_writeback(file, offset, batch_bytes);
                offset += batch_bytes as u64;
                batch.clear();
                batch_bytes = 0;
            }
        }
    }
    if !batch.is_empty() {
        pwritev_all(file, &mut batch, offset)?;
    }
    Ok(())
}

/// Asks the kernel to start writing back what was just written, so the final fsync has
/// less left to do and dirty page cache stays bounded. Best effort.
pub(super) fn start_writeback(file: &File, offset: u64, len: usize) {
    // SAFETY: plain syscall on an fd we own; no memory is passed.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// `pwritev` until every byte of `iovecs` is written.
fn pwritev_all(file: &File, iovecs: &mut [libc::iovec], mut offset: u64) -> std::io::Result<()> {
    let mut first = 0;
    while first < iovecs.len() {
        let pending = &iovecs[first..];
        // SAFETY: every iovec points into guest RAM mappings that `RamMappings` keeps mapped
        // (or into a live buffer); the kernel only reads them.
        let written = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                pending.as_ptr(),
                pending.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if written < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let mut written = written as usize;
        offset += written as u64;
        while written > 0 {
            let iov = &mut iovecs[first];
            if written >= iov.iov_len {
                written -= iov.iov_len;
                first += 1;
            } else {
                iov.iov_base = iov.iov_base.cast::<u8>().wrapping_add(written).cast();
                iov.iov_len -= written;
                written = 0;
            }
        }
    }
    Ok(())
}

pub(super) fn write_all_at(file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(buf, offset)
}
