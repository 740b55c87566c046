//! Finding the pages a snapshot must record: a word-wise zero check over guest RAM (all
//! pages for a full snapshot, dirty pages for a diff), split across threads.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::format::ExtentKind;
use super::layout::RamMappings;
use super::{Result, SnapshotError};

/// Bytes of guest RAM per scan task: big enough to amortise scheduling, small enough to
/// balance threads.
const TASK_BYTES: u64 = 32 << 20;
/// The dirty log tracks 4 KiB pages.
pub(crate) const DIRTY_LOG_PAGE: u64 = 4096;

/// Which pages to look at.
#[derive(Clone, Copy)]
pub(crate) enum Selection<'b> {
    /// Every page (full snapshot).
    All,
    /// Pages with a bit set in the region's dirty bitmap (diff snapshot).
    Dirty(&'b [&'b [u64]]),
}

/// Consecutive pages of one region with the same fate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScanRun {
    pub region: usize,
    /// Linear index of the first page.
    pub start: u64,
    pub count: u64,
    pub kind: ExtentKind,
}

/// What scanning found: runs in address order, and the CRC of every data page (in the
/// same order) when asked for.
#[derive(Default)]
pub(crate) struct ScanResult {
    pub runs: Vec<ScanRun>,
    pub page_crcs: Vec<u32>,
    pub pages_examined: u64,
}

impl ScanResult {
    pub fn data_pages(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.kind == ExtentKind::Data)
            .map(|r| r.count)
            .sum()
    }

    pub fn zero_pages(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.kind == ExtentKind::Zero)
            .map(|r| r.count)
            .sum()
    }

    /// Appends a page, extending the last run when it continues it.
    pub(super) fn push(&mut self, region: usize, linear: u64, kind: ExtentKind) {
        if let Some(last) = self.runs.last_mut() {
            if last.region == region && last.kind == kind && last.start + last.count == linear {
                last.count += 1;
                return;
            }
        }
        self.runs.push(ScanRun {
            region,
            start: linear,
            count: 1,
            kind,
        });
    }

    /// Appends another result that follows this one in address order.
    fn append(&mut self, other: ScanResult) {
        let mut runs = other.runs.into_iter();
        if let (Some(last), Some(first)) = (self.runs.last_mut(), runs.as_slice().first()) {
            if last.region == first.region
                && last.kind == first.kind
                && last.start + last.count == first.start
            {
                last.count += first.count;
                runs.next();
            }
        }
        self.runs.extend(runs);
        self.page_crcs.extend(other.page_crcs);
        self.pages_examined += other.pages_examined;
    }
}

/// Checks the dirty bitmaps' shape against the layout.
pub(crate) fn check_dirty_bitmaps(ram: &RamMappings<'_>, dirty: &[&[u64]]) -> Result<()> {
    let regions = ram.layout().regions();
    if dirty.len() != regions.len() {
        return Err(SnapshotError::DirtyBitmapCount {
            regions: regions.len(),
            got: dirty.len(),
        });
    }
    for (i, (r, bitmap)) in regions.iter().zip(dirty).enumerate() {
        let needed = (r.size / DIRTY_LOG_PAGE).div_ceil(64) as usize;
        if bitmap.len() < needed {
            return Err(SnapshotError::DirtyBitmapTooShort {
                region: i,
                needed,
                got: bitmap.len(),
                size: r.size,
            });
        }
    }
    Ok(())
}

/// Scans guest RAM with `threads` threads.
pub(crate) fn scan(
    ram: &RamMappings<'_>,
    selection: Selection<'_>,
    page_crcs: bool,
    threads: usize,
) -> Result<ScanResult> {
    let layout = ram.layout();
    let page_size = layout.page_size();
    let task_pages = (TASK_BYTES / page_size).max(1);

    // Tasks never span regions, so each task's runs stay inside one region.
    let mut tasks = Vec::new();
    for region in 0..layout.regions().len() {
        let pages = layout.region_pages(region);
        let mut first = 0;
        while first < pages {
            let count = task_pages.min(pages - first);
            tasks.push((region, first, count));
            first += count;
        }
    }

    let memfd = ram.memfd().and_then(private_description);
    let results: Vec<Mutex<Option<ScanResult>>> = tasks.iter().map(|_| Mutex::new(None)).collect();
    let next_task = AtomicUsize::new(0);
    let threads = threads.clamp(1, tasks.len().max(1));
    let worker = || {
        let mut scratch = vec![0u8; if page_crcs { page_size as usize } else { 0 }];
        loop {
            let t = next_task.fetch_add(1, Ordering::Relaxed);
            let Some(&(region, first, count)) = tasks.get(t) else {
                break;
            };
            let result = scan_task(
                ram,
                selection,
                memfd.as_ref(),
                region,
                first,
                count,
                &mut scratch,
            );
            *results[t].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        }
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads).map(|_| s.spawn(worker)).collect();
        worker();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| SnapshotError::WorkerPanicked))
    })?;

    let mut total = ScanResult::default();
    for slot in results {
        let part = slot
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .ok_or(SnapshotError::WorkerPanicked)?;
        total.append(part);
    }
    Ok(total)
}

/// Scans `count` pages of `region` starting at its page `first`.
fn scan_task(
    ram: &RamMappings<'_>,
    selection: Selection<'_>,
    memfd: Option<&File>,
    region: usize,
    first: u64,
    count: u64,
    scratch: &mut [u8],
) -> ScanResult {
    let layout = ram.layout();
    let page_size = layout.page_size();
    let region_linear = layout.region_first_linear(region);
    let base = ram.host_addr(region);
    let mut out = ScanResult::default();
    for (span_start, span_end, maybe_data) in spans(ram, memfd, region, first, first + count) {
        let mut page = span_start;
        while page < span_end {
            if let Selection::Dirty(bitmaps) = selection {
                match next_dirty_page(bitmaps[region], page, span_end, page_size / DIRTY_LOG_PAGE) {
                    Some(p) => page = p,
                    None => break,
                }
            }
            let zero = !maybe_data || {
                let ptr = base.wrapping_add((page * page_size) as usize);
                // SAFETY: `page` < the region's page count, so the page lies inside the
                // region's mapping, which `RamMappings` guarantees is readable.
                let zero = unsafe { page_is_zero(ptr, page_size as usize) };
                if !zero && !scratch.is_empty() {
                    // SAFETY: as above the page is readable; `scratch` is page_size bytes
                    // and does not overlap guest memory. Copying first means the CRC is
                    // computed over a stable buffer even if something races with us.
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, scratch.as_mut_ptr(), scratch.len())
                    };
                    out.page_crcs.push(crc32fast::hash(scratch));
                }
                zero
            };
            out.pages_examined += 1;
            if !zero {
                out.push(region, region_linear + page, ExtentKind::Data);
            } else if matches!(selection, Selection::Dirty(_)) {
                // Untouched zero pages are simply left out of a full snapshot; a dirty
                // page that is now zero must be recorded so it overrides the base.
                out.push(region, region_linear + page, ExtentKind::Zero);
            }
            page += 1;
        }
    }
    out
}

/// Splits the region's pages `first..end` into spans that may hold data (`true`) and
/// holes of the memfd (`false`, zero without reading: touching them would allocate them).
/// Without a memfd, or if it cannot tell, everything may hold data.
pub(super) fn spans(
    ram: &RamMappings<'_>,
    memfd: Option<&File>,
    region: usize,
    first: u64,
    end: u64,
) -> Vec<(u64, u64, bool)> {
    let page_size = ram.layout().page_size();
    let all = vec![(first, end, true)];
    let Some(memfd) = memfd else {
        return all;
    };
    let file_base = ram.layout().regions()[region].file_offset;
    let (start_byte, end_byte) = (file_base + first * page_size, file_base + end * page_size);
    let to_page = |byte: u64| (byte - file_base) / page_size;
    let mut out = Vec::new();
    let mut pos = start_byte;
    while pos < end_byte {
        let data = match seek(memfd, pos, libc::SEEK_DATA) {
            Ok(d) => d.min(end_byte),
            // ENXIO: no data after `pos`.
            Err(libc::ENXIO) => end_byte,
            Err(_) => return all,
        };
        let hole = match seek(memfd, data, libc::SEEK_HOLE) {
            Ok(h) => h.min(end_byte),
            Err(libc::ENXIO) => end_byte,
            Err(_) => return all,
        };
        // Round outwards: a partly allocated page may hold data.
        let (data_page, hole_page) = (to_page(data), to_page(hole + page_size - 1));
        if data_page > to_page(pos) {
            out.push((to_page(pos), data_page, false));
        }
        if hole_page > data_page {
            out.push((data_page, hole_page, true));
        }
        pos = (file_base + hole_page * page_size).max(pos + 1);
    }
    out
}

/// A new open file description of `memfd` (via /proc), so seeking in it does not move
/// the file position shared with every other holder of the memfd. `None` if that fails
/// (the scan then reads every page).
pub(super) fn private_description(memfd: BorrowedFd<'_>) -> Option<File> {
    match File::open(format!("/proc/self/fd/{}", memfd.as_raw_fd())) {
        Ok(f) => Some(f),
        Err(e) => {
            log::warn!("cannot reopen the guest RAM memfd ({e}); scanning holes too");
            None
        }
    }
}

fn seek(fd: &File, offset: u64, whence: i32) -> std::result::Result<u64, i32> {
    // SAFETY: lseek on a valid fd; no memory is passed. The fd is our private open file
    // description, so the position it moves is nobody else's.
    let ret = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, whence) };
    if ret < 0 {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO))
    } else {
        Ok(ret as u64)
    }
}

/// The first page in `from..end` with any dirty bit set (`bits_per_page` bits per page).
fn next_dirty_page(bitmap: &[u64], from: u64, end: u64, bits_per_page: u64) -> Option<u64> {
    let mut bit = from * bits_per_page;
    let end_bit = end * bits_per_page;
    while bit < end_bit {
        let word_idx = (bit / 64) as usize;
        let word = bitmap.get(word_idx).copied().unwrap_or(0) >> (bit % 64);
        if word != 0 {
            let found = bit + u64::from(word.trailing_zeros());
            return (found < end_bit).then_some(found / bits_per_page);
        }
        bit = (bit / 64 + 1) * 64;
    }
    None
}

/// Whether `len` bytes at `ptr` (8-byte aligned, `len` a multiple of 64) are all zero.
///
/// Volatile word reads: guest memory may be shared with other processes, and the reads
/// must really happen. Checking 8 words per step and stopping at the first non-zero block
/// keeps this at memory bandwidth for zero pages and near-free for data pages.
///
/// # Safety
/// `ptr..ptr + len` must be mapped and readable.
pub(crate) unsafe fn page_is_zero(ptr: *const u8, len: usize) -> bool {
    let words = ptr.cast::<u64>();
    let mut i = 0;
    while i < len / 8 {
        let mut acc = 0u64;
        for j in 0..8 {
            // SAFETY: i + j < len / 8, inside the readable range the caller vouches for;
            // page-aligned pointers are 8-byte aligned.
            acc |= unsafe { std::ptr::read_volatile(words.add(i + j)) };
        }
        if acc != 0 {
            return false;
        }
        i += 8;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_page_search() {
        let bitmap = [0u64, 1 << 5, 0, 1 << 63];
        assert_eq!(next_dirty_page(&bitmap, 0, 256, 1), Some(69));
        assert_eq!(next_dirty_page(&bitmap, 70, 256, 1), Some(255));
        assert_eq!(next_dirty_page(&bitmap, 70, 255, 1), None);
        // 2 MiB pages: 512 bits each; bit 69 lies in page 0.
        assert_eq!(next_dirty_page(&bitmap, 0, 1, 512), Some(0));
        assert_eq!(next_dirty_page(&[0u64; 8], 0, 1, 512), None);
    }

    #[test]
    fn zero_check() {
        let mut page = vec![0u64; 512];
        // SAFETY: the vector is 4096 bytes and alive for the call.
        assert!(unsafe { page_is_zero(page.as_ptr().cast(), 4096) });
        page[511] = 1 << 60;
        // SAFETY: as above.
        assert!(!unsafe { page_is_zero(page.as_ptr().cast(), 4096) });
    }
}
