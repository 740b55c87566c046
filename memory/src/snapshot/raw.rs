//! Raw guest-RAM images: Firecracker's memory-file layout.
//!
//! A raw image is guest RAM written flat: region `i`'s bytes lie at file offset
//! `regions[i].file_offset` (the region's offset in the guest RAM memfd, which is the
//! `offset` gpuvm's userfaultfd handshake sends), and the file is exactly the guest's RAM
//! size. Only non-zero pages are written; everything else is a hole. There is no header,
//! no index and no CRC: an external page-fault handler that knows nothing of gpuvm reads
//! it at the offsets the handshake gives.
//!
//! Writing ([`write_raw`]) converts a validated [`SnapshotChain`] (gpuvm's own format,
//! which the snapshot wrote first; the VMM then frees the converted file's data with
//! [`MemoryFile::drop_page_data`], so that guest memory is kept on disk once); reading
//! ([`SnapshotChain::open_raw`]) presents a raw image as a one-file chain, so that eager
//! restore and the lazy (userfaultfd) loader take it as their source unchanged. The holes
//! the file system reports (`SEEK_DATA` / `SEEK_HOLE`) are the zero pages; a file system
//! that reports none makes every page data, which is slower but the same guest.
//!
//! The image itself has nowhere to hold a checksum, so gpuvm keeps one beside it: a
//! [`RawPageCrcs`] table, one CRC32 per page of guest RAM in flat order (zero pages
//! included), written with the image and given to [`SnapshotChain::open_raw`] on load.
//! Then every page that loads (eagerly or on fault) is checked against its entry before
//! the guest can see it, exactly as the page CRCs of gpuvm's own format are, and a page
//! the table says holds data is loaded (and checked) even where the file now has a hole.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::bits::Bitmap;
use super::format::{
    get_u32, Extent, ExtentKind, Header, SnapshotId, FLAG_PAGE_CRCS, FORMAT_VERSION, HEADER_LEN,
    MAGIC,
};
use super::layout::RamLayout;
#[cfg(test)]
use super::reader::open_regular_file;
use super::reader::{open_in_dir, MemoryFile, SnapshotChain};
use super::{write_atomically, Result, SnapshotError, RAW_CRCS_MAGIC};

/// Bytes per read and write while converting.
const CHUNK: usize = 8 << 20;
/// Pages per extent of a raw image's synthesized index (the index counts pages in u32).
const MAX_EXTENT_PAGES: u64 = 1 << 20;

/// Which pages of a chain a raw image holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawContent {
    /// All of guest RAM as the chain restores it: a full image.
    Full,
    /// Only the pages the newest file of the chain records (a diff's dirty pages), at
    /// their flat offsets; its zero pages are written as zeros (allocated, not holes), so
    /// that a tool merging the image onto its base by `SEEK_DATA` copies them too.
    /// Everything else is a hole. This is Firecracker's Diff memory file.
    NewestOnly,
}

/// What [`write_raw`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawWriteStats {
    /// The file's size: the guest's RAM size.
    pub file_len: u64,
    /// Pages written with data (the rest are holes).
    pub pages_written: u64,
    /// The CRC of every page of guest RAM as the chain restores it (for a
    /// [`RawContent::NewestOnly`] image: once merged onto its base's image), to be kept
    /// beside the image ([`RawPageCrcs::write`]).
    pub page_crcs: RawPageCrcs,
}

const RAW_CRCS_VERSION: u32 = 1;
/// magic, version, CRC of the entries, page size, page count.
const RAW_CRCS_HEADER_LEN: usize = 32;

/// One CRC32 (IEEE) per page of a raw guest-RAM image, in flat order (entry `i` is the
/// page at file offset `i * page_size`), zero pages included. Kept in a file of its own
/// beside the image (gpuvm's own directory), laid out as (little-endian):
///
/// ```text
/// offset 0   8 bytes  magic "GPUVMRCT"
/// offset 8   u32      version (1)
/// offset 12  u32      CRC32 of the entries (also what [`RawPageCrcs::digest`] gives)
/// offset 16  u64      page size
/// offset 24  u64      page count (the image's size / page size)
/// offset 32  u32 x page count: the entries
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawPageCrcs {
    page_size: u64,
    crcs: Vec<u32>,
}

/// CRC32 of a page of `page_size` zero bytes (without a page-sized buffer: 1 GiB pages).
fn zero_page_crc(page_size: u64) -> u32 {
    const CHUNK: u64 = 64 << 10;
    let zeros = [0u8; CHUNK as usize];
    let mut hasher = crc32fast::Hasher::new();
    let mut left = page_size;
    while left > 0 {
        let n = left.min(CHUNK);
        hasher.update(&zeros[..n as usize]);
        left -= n;
    }
    hasher.finalize()
}

impl RawPageCrcs {
    /// A table for `layout` with every page zero.
    fn zeros(layout: &RamLayout) -> RawPageCrcs {
        let zero = zero_page_crc(layout.page_size());
        RawPageCrcs {
            page_size: layout.page_size(),
            crcs: vec![zero; (layout.ram_size() / layout.page_size()) as usize],
        }
    }

    /// The table of guest RAM as `chain` restores it, from the page CRCs its files store
    /// (pages of files without them are read).
    pub fn of_chain(chain: &SnapshotChain) -> Result<RawPageCrcs> {
        let layout = chain.layout();
        let offsets = checked_flat_offsets(layout, chain.layers()[0].path())?;
        let page_size = layout.page_size();
        let mut table = RawPageCrcs::zeros(layout);
        let mut page = vec![0u8; page_size as usize];
        for run in chain.plan() {
            let file = &chain.layers()[run.layer];
            for k in 0..run.count {
                let (flat, _) = flat_offset(layout, &offsets, run.start + k);
                let crc = match file.stored_page_crc(run.crc_index + k)? {
                    Some(crc) => crc,
                    None => {
                        file.read_data(run.file_offset + k * page_size, &mut page)?;
                        crc32fast::hash(&page)
                    }
                };
                table.crcs[(flat / page_size) as usize] = crc;
            }
        }
        Ok(table)
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Pages covered: the image's size / the page size.
    pub fn pages(&self) -> u64 {
        self.crcs.len() as u64
    }

    /// CRC32 of the entries (little-endian), by which a state binds its table.
    pub fn digest(&self) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        // Hashing never fails.
        let _ = self.for_each_entry_chunk(|bytes| {
            hasher.update(bytes);
            Ok(())
        });
        hasher.finalize()
    }

    /// The entries as little-endian bytes, a chunk at a time (no copy of the whole table).
    fn for_each_entry_chunk(
        &self,
        mut each: impl FnMut(&[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(64 << 10);
        for chunk in self.crcs.chunks(16 << 10) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|c| c.to_le_bytes()));
            each(&bytes)?;
        }
        Ok(())
    }

    /// Writes the table to `path` (atomically).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut header = Vec::with_capacity(RAW_CRCS_HEADER_LEN);
        header.extend_from_slice(RAW_CRCS_MAGIC);
        header.extend_from_slice(&RAW_CRCS_VERSION.to_le_bytes());
        header.extend_from_slice(&self.digest().to_le_bytes());
        header.extend_from_slice(&self.page_size.to_le_bytes());
        header.extend_from_slice(&self.pages().to_le_bytes());
        write_atomically(path, |file: &mut File| -> io::Result<()> {
            use std::io::Write;
            let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
            out.write_all(&header)?;
            self.for_each_entry_chunk(|bytes| out.write_all(bytes))?;
            out.flush()
        })
        .map_err(|e| SnapshotError::io("write page CRC table", path, e))
    }

    /// Reads the table `name` in the snapshot directory `dir` (opened as every file a
    /// snapshot names is, [`open_in_dir`]) for an image of a guest laid out like `guest`:
    /// its magic, version, own CRC, page size and page count must all be right.
    pub fn read_in_dir(dir: &Path, name: &str, guest: &RamLayout) -> Result<RawPageCrcs> {
        let path = dir.join(name);
        let pages = guest.ram_size() / guest.page_size();
        let expected_len = RAW_CRCS_HEADER_LEN as u64 + pages * 4;
        let bytes = super::reader::read_in_dir(dir, name, expected_len)
            .map_err(|e| SnapshotError::io("open page CRC table", &path, e))?;
        let invalid = |reason: String| SnapshotError::InvalidHeader {
            path: path.clone(),
            reason: format!("page CRC table of a raw memory image: {reason}"),
        };
        if bytes.len() < RAW_CRCS_HEADER_LEN || &bytes[..8] != RAW_CRCS_MAGIC {
            return Err(invalid("not one (bad magic or too short)".into()));
        }
        let version = get_u32(&bytes, 8);
        if version != RAW_CRCS_VERSION {
            return Err(invalid(format!("unsupported version {version}")));
        }
        let u64_at = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let (page_size, count) = (u64_at(16), u64_at(24));
        if page_size != guest.page_size() || count != pages {
            return Err(invalid(format!(
                "it covers {count} pages of {page_size} bytes, the guest has {pages} of {}",
                guest.page_size()
            )));
        }
        if bytes.len() as u64 != expected_len {
            return Err(invalid(format!(
                "{} bytes, {expected_len} expected",
                bytes.len()
            )));
        }
        let entries = &bytes[RAW_CRCS_HEADER_LEN..];
        let (stored, computed) = (get_u32(&bytes, 12), crc32fast::hash(entries));
        if stored != computed {
            return Err(invalid(format!(
                "CRC mismatch (stored {stored:#010x}, computed {computed:#010x}): it is damaged"
            )));
        }
        Ok(RawPageCrcs {
            page_size,
            crcs: entries
                .chunks_exact(4)
                .map(|entry| get_u32(entry, 0))
                .collect(),
        })
    }
}

/// Where region `region` of `layout` starts in a raw image, checked to lie within the
/// image (`file_offset + size <= ram_size`) and not to overlap another region's bytes.
fn checked_flat_offsets(layout: &RamLayout, path: &Path) -> Result<Vec<u64>> {
    let ram_size = layout.ram_size();
    let mut spans: Vec<(u64, u64)> = layout
        .regions()
        .iter()
        .map(|r| (r.file_offset, r.file_offset.saturating_add(r.size)))
        .collect();
    let offsets = spans.iter().map(|s| s.0).collect();
    spans.sort_unstable();
    let overlaps = spans.windows(2).any(|w| w[1].0 < w[0].1);
    if overlaps || spans.iter().any(|s| s.1 > ram_size) {
        return Err(SnapshotError::InvalidLayout(format!(
            "{}: the guest RAM regions' memfd offsets do not tile a flat image of {ram_size} bytes",
            path.display()
        )));
    }
    Ok(offsets)
}

/// Flat (raw-image) offset of linear page `linear`, and how many pages from it on stay in
/// its region.
fn flat_offset(layout: &RamLayout, offsets: &[u64], linear: u64) -> (u64, u64) {
    let region = layout.region_of_linear(linear);
    let within = linear - layout.region_first_linear(region);
    (
        offsets[region] + within * layout.page_size(),
        layout.region_pages(region) - within,
    )
}

/// Failures while filling the temporary file: its own I/O or reading the chain.
enum Failure {
    Io(io::Error),
    Snapshot(SnapshotError),
}

impl From<io::Error> for Failure {
    fn from(error: io::Error) -> Self {
        Failure::Io(error)
    }
}

/// Writes `chain` to `path` as a raw image (atomically: a temporary file renamed over
/// `path`). Pages whose bytes are all zero are left as holes (except a diff's recorded
/// zero pages with [`RawContent::NewestOnly`]).
pub fn write_raw(path: &Path, chain: &SnapshotChain, content: RawContent) -> Result<RawWriteStats> {
    let layout = chain.layout();
    let offsets = checked_flat_offsets(layout, path)?;
    let page_size = layout.page_size();
    // (linear start, pages, layer or None for explicit zeros, file offset)
    let mut runs: Vec<(u64, u64, Option<usize>, u64)> = Vec::new();
    match content {
        RawContent::Full => runs.extend(
            chain
                .plan()
                .iter()
                .map(|r| (r.start, r.count, Some(r.layer), r.file_offset)),
        ),
        RawContent::NewestOnly => {
            let head = chain.layers().len() - 1;
            let file = &chain.layers()[head];
            for extent in file.extents() {
                let Some((_, linear)) = layout.locate_guest_page(extent.first_page) else {
                    continue;
                };
                let count = u64::from(extent.page_count);
                match extent.kind {
                    ExtentKind::Data => runs.push((linear, count, Some(head), extent.data_offset)),
                    ExtentKind::Zero => runs.push((linear, count, None, 0)),
                }
            }
        }
    }
    let ram_size = layout.ram_size();
    // A Full image's table comes from the bytes written; a Diff's is of the merged image,
    // all of the chain, from its stored CRCs.
    let mut table = match content {
        RawContent::Full => RawPageCrcs::zeros(layout),
        RawContent::NewestOnly => RawPageCrcs::of_chain(chain)?,
    };
    let written = write_atomically(
        path,
        |out: &mut File| -> std::result::Result<u64, Failure> {
            let mut buf = vec![0u8; CHUNK.max(page_size as usize)];
            let pages_per_chunk = (buf.len() as u64 / page_size).max(1);
            let mut pages_written = 0u64;
            for &(start, count, layer, file_offset) in &runs {
                let mut done = 0u64;
                while done < count {
                    let (flat, left_in_region) = flat_offset(layout, &offsets, start + done);
                    let n = pages_per_chunk.min(count - done).min(left_in_region);
                    let bytes = &mut buf[..(n * page_size) as usize];
                    match layer {
                        Some(layer) => chain.layers()[layer]
                            .read_data(file_offset + done * page_size, bytes)
                            .map_err(Failure::Snapshot)?,
                        None => bytes.fill(0),
                    }
                    if content == RawContent::Full {
                        let first = (flat / page_size) as usize;
                        for (i, page) in bytes.chunks_exact(page_size as usize).enumerate() {
                            table.crcs[first + i] = crc32fast::hash(page);
                        }
                    }
                    pages_written +=
                        write_pages(out, flat, bytes, page_size as usize, layer.is_none())?;
                    done += n;
                }
            }
            out.set_len(ram_size)?;
            Ok(pages_written)
        },
    );
    match written {
        Ok(pages_written) => Ok(RawWriteStats {
            file_len: ram_size,
            pages_written,
            page_crcs: table,
        }),
        Err(Failure::Io(e)) => Err(SnapshotError::io("write raw memory image", path, e)),
        Err(Failure::Snapshot(e)) => Err(e),
    }
}

/// Writes `bytes` at `offset`, page by page runs: non-zero pages only, unless `zeros_too`.
/// Returns the number of pages written.
fn write_pages(
    out: &File,
    offset: u64,
    bytes: &[u8],
    page_size: usize,
    zeros_too: bool,
) -> io::Result<u64> {
    let pages: Vec<bool> = bytes
        .chunks_exact(page_size)
        .map(|p| zeros_too || p.iter().any(|&b| b != 0))
        .collect();
    let mut written = 0u64;
    let mut at = 0usize;
    while at < pages.len() {
        if !pages[at] {
            at += 1;
            continue;
        }
        let end = pages[at..]
            .iter()
            .position(|&w| !w)
            .map_or(pages.len(), |p| at + p);
        out.write_all_at(
            &bytes[at * page_size..end * page_size],
            offset + (at * page_size) as u64,
        )?;
        written += (end - at) as u64;
        at = end;
    }
    Ok(written)
}

/// `lseek(fd, offset, whence)`; `None` where the file has no more of what is asked for
/// (`ENXIO`).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let Ok(offset) = libc::off_t::try_from(offset) else {
        return Ok(None);
    };
    // SAFETY: lseek on a descriptor we own changes only its file position.
    let at = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if at < 0 {
        let error = io::Error::last_os_error();
        return match error.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(error),
        };
    }
    Ok(Some(at as u64))
}

/// The byte ranges of `[start, end)` that hold data, rounded out to whole pages. A file
/// system without `SEEK_DATA` reports the whole range.
fn data_ranges(file: &File, start: u64, end: u64, page_size: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut at = start;
    while at < end {
        let data = match seek(file, at, libc::SEEK_DATA) {
            Ok(Some(data)) => data,
            Ok(None) => break,
            // No SEEK_DATA on this file system: all of it is data.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(vec![(start, end)]),
            Err(e) => return Err(e),
        };
        if data >= end {
            break;
        }
        let hole = seek(file, data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        let last_end = ranges.last().map_or(start, |r| r.1);
        let from = (data / page_size * page_size).max(last_end);
        let to = hole.div_ceil(page_size).saturating_mul(page_size).min(end);
        match ranges.last_mut() {
            Some(last) if last.1 == from => last.1 = last.1.max(to),
            _ if from < to => ranges.push((from, to)),
            _ => {}
        }
        // SEEK_HOLE from data answers past it: this always advances.
        at = hole.max(data + 1);
    }
    Ok(ranges)
}

impl MemoryFile {
    /// As [`MemoryFile::open_raw_in_dir`], for any path: the unit tests' way in (gpuvm
    /// itself opens raw images only inside a snapshot directory).
    #[cfg(test)]
    pub(crate) fn open_raw(
        path: impl AsRef<Path>,
        guest: &RamLayout,
        id: SnapshotId,
        crcs: Option<RawPageCrcs>,
    ) -> Result<MemoryFile> {
        let path: PathBuf = path.as_ref().to_path_buf();
        let (file, file_len) = open_regular_file(&path, u64::MAX)
            .map_err(|e| SnapshotError::io("open raw memory image", &path, e))?;
        Self::raw_from_opened(path, file, file_len, guest, id, crcs)
    }

    /// Opens the image `name` of the snapshot directory `dir` (as every file a snapshot
    /// names is opened, [`open_in_dir`]) as a raw image of a guest laid out like `guest`: a
    /// regular file (a FIFO, a device or a directory is refused before a byte is read) of
    /// exactly the guest's RAM size, and not one of gpuvm's own memory files. `id` is the
    /// id its snapshot's state records (a raw image has nowhere to hold one). With `crcs`,
    /// the table kept beside the image, every page loaded is checked against it, and pages
    /// it says hold data are loaded even where the file has a hole; without, the pages
    /// are taken as they are.
    pub fn open_raw_in_dir(
        dir: &Path,
        name: &str,
        guest: &RamLayout,
        id: SnapshotId,
        crcs: Option<RawPageCrcs>,
    ) -> Result<MemoryFile> {
        let path = dir.join(name);
        let (file, file_len) = open_in_dir(dir, name, u64::MAX)
            .map_err(|e| SnapshotError::io("open raw memory image", &path, e))?;
        Self::raw_from_opened(path, file, file_len, guest, id, crcs)
    }

    fn raw_from_opened(
        path: PathBuf,
        file: File,
        file_len: u64,
        guest: &RamLayout,
        id: SnapshotId,
        crcs: Option<RawPageCrcs>,
    ) -> Result<MemoryFile> {
        let mut magic = [0u8; 8];
        if file_len >= magic.len() as u64 {
            file.read_exact_at(&mut magic, 0)
                .map_err(|e| SnapshotError::io("read raw memory image", &path, e))?;
            if magic == MAGIC {
                return Err(SnapshotError::InvalidHeader {
                    path,
                    reason: "this is a gpuvm-format memory file, but the snapshot's state \
                             says its memory is a raw guest-RAM image"
                        .into(),
                });
            }
        }
        if file_len != guest.ram_size() {
            return Err(SnapshotError::RamSizeMismatch {
                path,
                file: file_len,
                guest: guest.ram_size(),
            });
        }
        let offsets = checked_flat_offsets(guest, &path)?;
        let page_size = guest.page_size();
        if let Some(table) = &crcs {
            if table.page_size != page_size || table.pages() != guest.ram_size() / page_size {
                return Err(SnapshotError::InvalidHeader {
                    path,
                    reason: format!(
                        "its page CRC table covers {} pages of {} bytes, the guest has {} of {page_size}",
                        table.pages(),
                        table.page_size,
                        guest.ram_size() / page_size
                    ),
                });
            }
        }
        let zero_crc = zero_page_crc(page_size);
        let mut extents = Vec::new();
        let mut extent_linear = Vec::new();
        for (region_index, region) in guest.regions().iter().enumerate() {
            let start = offsets[region_index];
            let region_pages = region.size / page_size;
            // The pages to load: what the file holds, and what the table says held data
            // (read as zeros where the file has a hole, and caught by the check).
            let mut load = Bitmap::new(region_pages);
            let ranges = data_ranges(&file, start, start + region.size, page_size)
                .map_err(|e| SnapshotError::io("find the data in raw memory image", &path, e))?;
            for (from, to) in ranges {
                load.set_range((from - start) / page_size, (to - start) / page_size);
            }
            if let Some(table) = &crcs {
                let first_flat = (start / page_size) as usize;
                for (i, &crc) in table.crcs[first_flat..first_flat + region_pages as usize]
                    .iter()
                    .enumerate()
                {
                    if crc != zero_crc {
                        load.set_range(i as u64, i as u64 + 1);
                    }
                }
            }
            let mut at = load.next(true, 0, region_pages);
            while at < region_pages {
                let end = load.next(false, at, region_pages);
                let pages = (end - at).min(MAX_EXTENT_PAGES);
                extents.push(Extent {
                    first_page: region.guest_addr / page_size + at,
                    page_count: pages as u32,
                    kind: ExtentKind::Data,
                    data_offset: start + at * page_size,
                });
                extent_linear.push(guest.region_first_linear(region_index) + at);
                at = load.next(true, at + pages, region_pages);
            }
        }
        let header = Header {
            version: FORMAT_VERSION,
            header_len: HEADER_LEN as u32,
            flags: if crcs.is_some() { FLAG_PAGE_CRCS } else { 0 },
            region_count: guest.regions().len() as u32,
            page_size,
            ram_size: guest.ram_size(),
            snapshot_id: id,
            base_id: SnapshotId::NONE,
            generation: 0,
            extent_count: extents.len() as u64,
            data_page_count: extents.iter().map(|e| u64::from(e.page_count)).sum(),
            data_offset: 0,
            index_crc: 0,
        };
        Ok(MemoryFile::from_raw_image(
            path,
            file,
            header,
            guest.clone(),
            extents,
            extent_linear,
            crcs.map(|table| table.crcs),
        ))
    }
}

impl SnapshotChain {
    /// As [`SnapshotChain::open_raw_in_dir`], for any path (unit tests only).
    #[cfg(test)]
    pub(crate) fn open_raw(
        path: impl AsRef<Path>,
        guest: &RamLayout,
        id: SnapshotId,
        crcs: Option<RawPageCrcs>,
    ) -> Result<SnapshotChain> {
        let file = MemoryFile::open_raw(path, guest, id, crcs)?;
        SnapshotChain::from_files(vec![file], guest)
    }

    /// A raw image, the file `name` of the snapshot directory `dir` (see
    /// [`MemoryFile::open_raw_in_dir`]), as a one-file chain for `guest`: what eager restore
    /// and the lazy loader read from.
    pub fn open_raw_in_dir(
        dir: &Path,
        name: &str,
        guest: &RamLayout,
        id: SnapshotId,
        crcs: Option<RawPageCrcs>,
    ) -> Result<SnapshotChain> {
        let file = MemoryFile::open_raw_in_dir(dir, name, guest, id, crcs)?;
        SnapshotChain::from_files(vec![file], guest)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::snapshot::test_util::{
        assert_ram_eq, fill_ram, guest_ram, two_regions, PageFill, Rng, TempDir,
    };
    use crate::snapshot::{
        restore_eager, write_diff, write_full, EagerOptions, RamMappings, WriteOptions,
    };
    use crate::Backing;

    const MIB: u64 = 1 << 20;
    const PAGE: usize = 4096;

    /// Every 13th page random, every 29th only its last byte set, the rest untouched.
    fn sparse(linear: u64) -> PageFill {
        if linear.is_multiple_of(13) {
            PageFill::Random
        } else if linear % 29 == 5 {
            PageFill::LastByte
        } else {
            PageFill::Untouched
        }
    }

    /// Guest RAM in two regions filled `sparse`ly, its gpuvm-format full snapshot, and the
    /// expected flat contents.
    struct Fixture {
        dir: TempDir,
        regions: Vec<crate::RamRegion>,
        ram: crate::GuestRam,
        expected: Vec<u8>,
        full: PathBuf,
    }

    fn fixture(tag: &str) -> Fixture {
        let dir = TempDir::new(tag);
        let regions = two_regions(2 * MIB, 3 * MIB, MIB);
        let ram = guest_ram(&regions, Backing::Memfd);
        let expected = fill_ram(&ram, &mut Rng::new(7), sparse);
        let full = dir.path().join("full");
        let mappings = RamMappings::from_guest_ram(&ram).unwrap();
        write_full(&full, &mappings, &WriteOptions::default()).unwrap();
        Fixture {
            dir,
            regions,
            ram,
            expected,
            full,
        }
    }

    fn layout_of(f: &Fixture) -> RamLayout {
        RamLayout::new(PAGE as u64, f.regions.clone()).unwrap()
    }

    #[test]
    fn a_full_raw_image_is_flat_sparse_and_restores_the_same_guest() {
        let f = fixture("raw-full");
        let chain = SnapshotChain::open_with_file_layout(&[&f.full]).unwrap();
        let raw = f.dir.path().join("raw");
        let stats = write_raw(&raw, &chain, RawContent::Full).unwrap();
        let non_zero = f
            .expected
            .chunks_exact(PAGE)
            .filter(|p| p.iter().any(|&b| b != 0))
            .count() as u64;
        assert_eq!(stats.pages_written, non_zero);

        // Flat: the file is the guest RAM, region by region at their memfd offsets (the
        // two regions are contiguous in the memfd), and exactly that long.
        let bytes = std::fs::read(&raw).unwrap();
        assert_eq!(bytes.len() as u64, 3 * MIB);
        assert!(
            bytes == f.expected,
            "the raw image is not the flat guest RAM"
        );
        // Sparse: only the written pages have blocks (a little slack for the file system).
        let meta = std::fs::metadata(&raw).unwrap();
        assert!(
            meta.blocks() * 512 <= (non_zero + 16) * PAGE as u64,
            "{} bytes allocated for {non_zero} data pages",
            meta.blocks() * 512
        );

        // Read back as a chain: its data pages are exactly the non-zero ones, and an eager
        // restore gives the same guest.
        let chain = SnapshotChain::open_raw(&raw, &layout_of(&f), SnapshotId::NONE, None).unwrap();
        assert!(chain.data_pages() >= non_zero && chain.data_pages() <= non_zero + 16);
        let fresh = guest_ram(&f.regions, Backing::Memfd);
        let mappings = RamMappings::from_guest_ram(&fresh).unwrap();
        restore_eager(&chain, &mappings, &EagerOptions::default()).unwrap();
        assert_ram_eq(&fresh, &f.expected);
        drop(f.ram);
    }

    #[test]
    fn a_diff_raw_image_holds_only_the_dirty_pages_zeros_included() {
        let f = fixture("raw-diff");
        let base = SnapshotChain::open_with_file_layout(&[&f.full]).unwrap();
        // Dirty two pages: one with new data, one zeroed (it had data in the base).
        let mut data = vec![0u8; PAGE];
        Rng::new(3).fill(&mut data);
        crate::snapshot::test_util::write_page(&f.ram, 1, &data);
        crate::snapshot::test_util::write_page(&f.ram, 13, &[0u8; PAGE]);
        let pages = (3 * MIB / PAGE as u64) as usize;
        let mut dirty: Vec<Vec<u64>> = f
            .regions
            .iter()
            .map(|r| vec![0u64; (r.size / PAGE as u64).div_ceil(64) as usize])
            .collect();
        dirty[0][0] |= (1 << 1) | (1 << 13);
        let dirty_refs: Vec<&[u64]> = dirty.iter().map(|d| d.as_slice()).collect();
        let diff = f.dir.path().join("diff");
        let mappings = RamMappings::from_guest_ram(&f.ram).unwrap();
        write_diff(
            &diff,
            &mappings,
            &dirty_refs,
            &base.head(),
            &WriteOptions::default(),
        )
        .unwrap();
        let chain = SnapshotChain::open_with_file_layout(&[&f.full, &diff]).unwrap();
        let raw = f.dir.path().join("raw-diff");
        let stats = write_raw(&raw, &chain, RawContent::NewestOnly).unwrap();
        assert_eq!(stats.pages_written, 2);
        let bytes = std::fs::read(&raw).unwrap();
        assert_eq!(bytes.len(), pages * PAGE);
        assert_eq!(&bytes[PAGE..2 * PAGE], data.as_slice());
        assert!(bytes[13 * PAGE..14 * PAGE].iter().all(|&b| b == 0));
        // Page 0 had data in the base but is not dirty: a hole, not the base's bytes.
        assert!(bytes[..PAGE].iter().all(|&b| b == 0));
        // The zeroed page is allocated (a merge by SEEK_DATA copies it); page 0 is not.
        let file = File::open(&raw).unwrap();
        let ranges = data_ranges(&file, 0, 3 * MIB, PAGE as u64).unwrap();
        let covers = |page: u64| {
            ranges
                .iter()
                .any(|&(a, b)| a <= page * PAGE as u64 && page * PAGE as u64 + PAGE as u64 <= b)
        };
        assert!(covers(1) && covers(13), "{ranges:?}");
        assert!(!covers(0) && !covers(2), "{ranges:?}");
    }

    #[test]
    fn bad_raw_images_are_refused_with_a_clear_error() {
        let f = fixture("raw-bad");
        let layout = layout_of(&f);
        let chain = SnapshotChain::open_with_file_layout(&[&f.full]).unwrap();
        let raw = f.dir.path().join("raw");
        write_raw(&raw, &chain, RawContent::Full).unwrap();

        // Truncated, and grown: the size must be the guest's RAM size.
        let short = f.dir.path().join("short");
        std::fs::copy(&raw, &short).unwrap();
        File::options()
            .write(true)
            .open(&short)
            .unwrap()
            .set_len(MIB)
            .unwrap();
        match SnapshotChain::open_raw(&short, &layout, SnapshotId::NONE, None).unwrap_err() {
            SnapshotError::RamSizeMismatch { file, guest, .. } => {
                assert_eq!((file, guest), (MIB, 3 * MIB))
            }
            other => panic!("{other}"),
        }
        File::options()
            .write(true)
            .open(&short)
            .unwrap()
            .set_len(4 * MIB)
            .unwrap();
        let error = SnapshotChain::open_raw(&short, &layout, SnapshotId::NONE, None).unwrap_err();
        assert!(
            error.to_string().contains("guest RAM size mismatch"),
            "{error}"
        );

        // gpuvm's own format where a raw image is expected.
        let error = SnapshotChain::open_raw(&f.full, &layout, SnapshotId::NONE, None).unwrap_err();
        assert!(
            error.to_string().contains("gpuvm-format memory file"),
            "{error}"
        );

        // Not regular files: refused without reading (a FIFO would block, /dev/zero is endless).
        let fifo = f.dir.path().join("fifo");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let error = SnapshotChain::open_raw(&fifo, &layout, SnapshotId::NONE, None).unwrap_err();
        assert!(error.to_string().contains("FIFO"), "{error}");
        let error =
            SnapshotChain::open_raw("/dev/zero", &layout, SnapshotId::NONE, None).unwrap_err();
        assert!(error.to_string().contains("not a regular file"), "{error}");

        // A file that shrinks after it was opened: the read fails, it does not hang or
        // return short pages.
        let shrinking = f.dir.path().join("shrinking");
        std::fs::copy(&raw, &shrinking).unwrap();
        let chain = SnapshotChain::open_raw(&shrinking, &layout, SnapshotId::NONE, None).unwrap();
        File::options()
            .write(true)
            .open(&shrinking)
            .unwrap()
            .set_len(0)
            .unwrap();
        let fresh = guest_ram(&f.regions, Backing::Memfd);
        let mappings = RamMappings::from_guest_ram(&fresh).unwrap();
        assert!(restore_eager(&chain, &mappings, &EagerOptions::default()).is_err());
    }

    /// The page CRC table kept beside a raw image: an undamaged image restores the same
    /// guest with every page checked; a byte changed in a data page or in a hole, or a
    /// data page turned into zeros, fails the restore (eager and lazy) instead of reaching
    /// the guest; a damaged or foreign table is refused when it is read.
    #[test]
    fn a_raw_image_with_its_page_crc_table_loads_only_unchanged_pages() {
        let f = fixture("raw-crcs");
        let layout = layout_of(&f);
        let chain = SnapshotChain::open_with_file_layout(&[&f.full]).unwrap();
        let raw = f.dir.path().join("raw");
        let written = write_raw(&raw, &chain, RawContent::Full).unwrap();
        let table_name = "raw.crcs";
        written
            .page_crcs
            .write(&f.dir.path().join(table_name))
            .unwrap();
        let table = RawPageCrcs::read_in_dir(f.dir.path(), table_name, &layout).unwrap();
        assert_eq!(table, written.page_crcs);
        assert_eq!(table.pages(), 3 * MIB / PAGE as u64);
        // The Diff path's table (from the chain's stored CRCs) is the same.
        assert_eq!(RawPageCrcs::of_chain(&chain).unwrap(), table);

        let restore = |image: &Path, lazy: bool| -> Result<()> {
            let chain =
                SnapshotChain::open_raw(image, &layout, SnapshotId::NONE, Some(table.clone()))?;
            let fresh = guest_ram(&f.regions, Backing::Memfd);
            let mappings = RamMappings::from_guest_ram(&fresh).unwrap();
            if lazy {
                let restore = crate::uffd::start_lazy_restore(
                    std::sync::Arc::new(chain),
                    &mappings,
                    crate::uffd::LazyOptions::default(),
                )
                .unwrap();
                let waited = restore
                    .wait_timeout(Some(std::time::Duration::from_secs(60)))
                    .map(|_| ());
                let _ = restore.shutdown();
                waited.map_err(|e| SnapshotError::InvalidLayout(e.to_string()))?;
            } else {
                restore_eager(&chain, &mappings, &EagerOptions::default())?;
            }
            assert_ram_eq(&fresh, &f.expected);
            Ok(())
        };
        restore(&raw, false).unwrap();
        restore(&raw, true).unwrap();

        let data_page = f
            .expected
            .chunks_exact(PAGE)
            .position(|p| p.iter().any(|&b| b != 0))
            .unwrap() as u64;
        let hole_page = f
            .expected
            .chunks_exact(PAGE)
            .position(|p| p.iter().all(|&b| b == 0))
            .unwrap() as u64;
        let damaged = |tag: &str, page: u64, bytes: &[u8]| -> PathBuf {
            let path = f.dir.path().join(tag);
            std::fs::copy(&raw, &path).unwrap();
            let file = File::options().write(true).open(&path).unwrap();
            file.write_all_at(bytes, page * PAGE as u64 + 1234 % PAGE as u64)
                .unwrap();
            path
        };
        let mut flipped = f.expected[data_page as usize * PAGE + 1234] ^ 0x01;
        if flipped == 0 {
            flipped = 0x80;
        }
        let cases = [
            damaged("flip-data", data_page, &[flipped]),
            damaged("flip-hole", hole_page, &[0x5a]),
            damaged("zeroed-data", data_page, &vec![0u8; PAGE - 1234]),
        ];
        for image in &cases {
            for lazy in [false, true] {
                let error = restore(image, lazy).unwrap_err();
                assert!(
                    error.to_string().contains("data CRC mismatch"),
                    "{} (lazy {lazy}): {error}",
                    image.display()
                );
            }
        }
        // A data page punched out to a hole is loaded anyway (the table says it has data),
        // and fails its check.
        let punched = f.dir.path().join("punched");
        std::fs::copy(&raw, &punched).unwrap();
        let file = File::options().write(true).open(&punched).unwrap();
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        let ret = unsafe {
            libc::fallocate(
                std::os::unix::io::AsRawFd::as_raw_fd(&file),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                (data_page * PAGE as u64) as libc::off_t,
                PAGE as libc::off_t,
            )
        };
        if ret == 0 {
            let error = restore(&punched, false).unwrap_err();
            assert!(error.to_string().contains("data CRC mismatch"), "{error}");
        }

        // The table itself: damaged, cut, or of another guest.
        let table_path = f.dir.path().join(table_name);
        let mut bytes = std::fs::read(&table_path).unwrap();
        bytes[40] ^= 1;
        std::fs::write(f.dir.path().join("damaged.crcs"), &bytes).unwrap();
        let error = RawPageCrcs::read_in_dir(f.dir.path(), "damaged.crcs", &layout).unwrap_err();
        assert!(error.to_string().contains("CRC mismatch"), "{error}");
        bytes.truncate(100);
        std::fs::write(f.dir.path().join("cut.crcs"), &bytes).unwrap();
        assert!(RawPageCrcs::read_in_dir(f.dir.path(), "cut.crcs", &layout).is_err());
        let bigger = RamLayout::new(PAGE as u64, two_regions(4 * MIB, 3 * MIB, 2 * MIB)).unwrap();
        let error = RawPageCrcs::read_in_dir(f.dir.path(), table_name, &bigger).unwrap_err();
        assert!(error.to_string().contains("covers 768 pages"), "{error}");
        // Read only inside its directory.
        assert!(RawPageCrcs::read_in_dir(f.dir.path(), "../raw.crcs", &layout).is_err());
    }

    #[test]
    fn regions_that_do_not_tile_a_flat_image_are_refused() {
        let overlapping = vec![
            crate::RamRegion {
                guest_addr: 0,
                size: MIB,
                file_offset: 0,
            },
            crate::RamRegion {
                guest_addr: 2 * MIB,
                size: MIB,
                file_offset: MIB / 2,
            },
        ];
        let layout = RamLayout::new(PAGE as u64, overlapping).unwrap();
        let dir = TempDir::new("raw-tile");
        let path = dir.path().join("raw");
        File::create(&path).unwrap().set_len(2 * MIB).unwrap();
        let error = SnapshotChain::open_raw(&path, &layout, SnapshotId::NONE, None).unwrap_err();
        assert!(error.to_string().contains("do not tile"), "{error}");
    }
}
