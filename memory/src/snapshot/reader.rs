//! Opening and validating memory files, and resolving a diff chain into one plan of which
//! file holds each page.
//!
//! Everything here runs before guest memory is touched: a file that opens is structurally
//! sound (magic, version, CRCs, lengths, index consistency), and a chain that opens matches
//! the configured guest and is complete.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::bits::Bitmap;
use super::format::{
    computed_header_crc, decode_region, get_u32, stored_header_crc, Extent, ExtentKind, Header,
    SnapshotId, DATA_ALIGN, EXTENT_ENTRY_LEN, FLAG_PAGE_CRCS_CHECKED_ON_LOAD, FORMAT_VERSION,
    HEADER_LEN, KNOWN_FLAGS, MAGIC, PAGE_CRC_LEN, REGION_ENTRY_LEN,
};
use super::layout::RamLayout;
use super::writer::SnapshotInfo;
use super::{Result, SnapshotError};
use crate::anon::AnonMap;
use crate::RamRegion;

/// More regions than any sane layout has; bounds what a corrupt header can make us do.
const MAX_REGIONS: u32 = 4096;
/// Bytes per read when verifying all data.
const VERIFY_CHUNK: usize = 8 << 20;

/// An opened, structurally validated memory file.
#[derive(Debug)]
pub struct MemoryFile {
    path: PathBuf,
    file: File,
    header: Header,
    layout: RamLayout,
    extents: Vec<Extent>,
    /// Linear page index of each extent's first page.
    extent_linear: Vec<u64>,
    /// Index into the page CRCs of each extent's first page (data extents).
    extent_crc_index: Vec<u64>,
    /// The file's metadata as read: region table and extent index, and in files whose
    /// index CRC covers it, the page CRC table.
    metadata: Metadata,
    page_crcs: PageCrcs,
}

/// Where a memory file's page CRCs are.
#[derive(Debug)]
enum PageCrcs {
    /// The file has none.
    Absent,
    /// In the metadata, words `start..start + count`: files whose index CRC covers the
    /// table, which is therefore read and checked whole when the file is opened.
    InMetadata { start: usize, count: usize },
    /// Read from the file a block at a time when first needed
    /// (`FLAG_PAGE_CRCS_CHECKED_ON_LOAD`).
    OnLoad(LazyCrcTable),
    /// Held in memory, read from elsewhere: a raw image's table, indexed by flat page
    /// (see [`super::raw::RawPageCrcs`]).
    Table(Vec<u32>),
}

/// Page CRCs per block read on demand: 16 KiB, covering 64 MiB of 4 KiB pages.
const CRC_BLOCK_ENTRIES: u64 = 4096;

/// A page CRC table read a block at a time, by whichever thread (loader, fault handler,
/// eager restore) first needs an entry of the block. The entries are checked together
/// with their pages: a damaged entry fails its page's load like damaged data does.
struct LazyCrcTable {
    /// File offset of entry 0.
    offset: u64,
    count: u64,
    blocks: Box<[OnceLock<Box<[u32]>>]>,
}

impl LazyCrcTable {
    fn new(offset: u64, count: u64) -> LazyCrcTable {
        LazyCrcTable {
            offset,
            count,
            blocks: (0..count.div_ceil(CRC_BLOCK_ENTRIES))
                .map(|_| OnceLock::new())
                .collect(),
        }
    }

    /// Entry `index`, reading its block from `file` if no thread has yet.
    fn get(&self, file: &File, path: &Path, index: u64) -> Result<Option<u32>> {
        if index >= self.count {
            return Ok(None);
        }
        let (block, within) = (
            index / CRC_BLOCK_ENTRIES,
            (index % CRC_BLOCK_ENTRIES) as usize,
        );
        let slot = &self.blocks[block as usize];
        if let Some(entries) = slot.get() {
            return Ok(Some(entries[within]));
        }
        let first = block * CRC_BLOCK_ENTRIES;
        let len = CRC_BLOCK_ENTRIES.min(self.count - first) as usize;
        let mut bytes = vec![0u8; len * PAGE_CRC_LEN];
        file.read_exact_at(&mut bytes, self.offset + first * PAGE_CRC_LEN as u64)
            .map_err(|e| SnapshotError::io("read page CRCs of", path, e))?;
        let entries: Box<[u32]> = bytes
            .chunks_exact(PAGE_CRC_LEN)
            .map(|entry| get_u32(entry, 0))
            .collect();
        let stored = entries[within];
        // Another thread may have read the same block meanwhile; either copy will do.
        let _ = slot.set(entries);
        Ok(Some(stored))
    }
}

impl std::fmt::Debug for LazyCrcTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyCrcTable")
            .field("offset", &self.offset)
            .field("count", &self.count)
            .field(
                "blocks_read",
                &self.blocks.iter().filter(|b| b.get().is_some()).count(),
            )
            .finish()
    }
}

/// Opens `path` for reading if it is a regular file of at most `max_len` bytes, and
/// returns it with its length. Anything else is refused before a byte is read: a FIFO
/// (opened with `O_NONBLOCK`, so that the open itself cannot wait for a writer), a device
/// such as /dev/zero (endless), a directory or socket, a file larger than the caller can
/// hold. Symbolic links are followed; what they lead to is what is checked.
///
/// Callers reading the whole file still bound the read (see [`read_regular_file`]): a
/// regular file can grow after the check, and some (in /proc) say they are empty.
pub fn open_regular_file(path: &Path, max_len: u64) -> std::io::Result<(File, u64)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    checked_regular_file(file, max_len)
}

/// Whether `name` names a file directly inside a directory: one path component, not `.`
/// or `..`, no `/` and no NUL.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

/// The one way to open a file a snapshot's state names: `name` in the snapshot
/// directory `dir`, and nowhere else. `name` must be a plain file name
/// ([`is_plain_file_name`]: no path, no `..`), the file must not be a symbolic link
/// (`O_NOFOLLOW`: a link could lead anywhere, so none is followed), and it must be a
/// regular file of at most `max_len` bytes (as [`open_regular_file`] checks). Returns it
/// open, with its length, so that what was checked is what is read.
pub fn open_in_dir(dir: &Path, name: &str, max_len: u64) -> std::io::Result<(File, u64)> {
    if !is_plain_file_name(name) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{name:?} is not a file name inside the snapshot directory {}",
                dir.display()
            ),
        ));
    }
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(dir.join(name));
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "it is a symbolic link, not a regular file: a snapshot's files must be \
                 regular files inside its directory, and no link is followed",
            ))
        }
        Err(e) => return Err(e),
    };
    checked_regular_file(file, max_len)
}

/// Reads the whole of `name` in `dir` as [`open_in_dir`] opens it, never more than
/// `max_len` bytes.
pub fn read_in_dir(dir: &Path, name: &str, max_len: u64) -> std::io::Result<Vec<u8>> {
    let (file, len) = open_in_dir(dir, name, max_len)?;
    read_bounded(file, len, max_len)
}

/// `file`, just opened, if it is a regular file of at most `max_len` bytes (with
/// `O_NONBLOCK` cleared); its length.
fn checked_regular_file(file: File, max_len: u64) -> std::io::Result<(File, u64)> {
    let metadata = file.metadata()?;
    let file_type = metadata.file_type();
    if !file_type.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if file_type.is_fifo() {
            "a FIFO (named pipe)"
        } else if file_type.is_char_device() {
            "a character device"
        } else if file_type.is_block_device() {
            "a block device"
        } else if file_type.is_dir() {
            "a directory"
        } else if file_type.is_socket() {
            "a socket"
        } else {
            "a special file"
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is {what}, not a regular file"),
        ));
    }
    let len = metadata.len();
    if len > max_len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("it is too large: {len} bytes, at most {max_len} expected"),
        ));
    }
    // Regular files ignore O_NONBLOCK; clear it anyway so the descriptor is an ordinary one.
    // SAFETY: fcntl on a descriptor this function owns; no memory is passed.
    let cleared = unsafe {
        let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        flags >= 0 && libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) >= 0
    };
    if !cleared {
        return Err(std::io::Error::last_os_error());
    }
    Ok((file, len))
}

/// Reads the whole of `path`, a regular file of at most `max_len` bytes (see
/// [`open_regular_file`]); never reads more than `max_len` bytes, even from a file that
/// grows meanwhile.
pub fn read_regular_file(path: &Path, max_len: u64) -> std::io::Result<Vec<u8>> {
    let (file, len) = open_regular_file(path, max_len)?;
    read_bounded(file, len, max_len)
}

/// The rest of `file` (`len` bytes as it was checked), never more than `max_len` bytes.
fn read_bounded(file: File, len: u64, max_len: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(max_len.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("it is too large: it grew past {max_len} bytes while being read"),
        ));
    }
    Ok(bytes)
}

impl MemoryFile {
    /// Opens `path` and validates it: file type, magic, version, header CRC, lengths,
    /// index CRC and index consistency, and that the file ends where its page data does.
    /// Page data is not read (see [`MemoryFile::verify_data`]).
    pub fn open(path: impl AsRef<Path>) -> Result<MemoryFile> {
        let path = path.as_ref().to_path_buf();
        let (file, file_len) = open_regular_file(&path, u64::MAX)
            .map_err(|e| SnapshotError::io("open memory file", &path, e))?;
        Self::from_opened(path, file, file_len)
    }

    /// As [`MemoryFile::open`], for the file `name` of the snapshot directory `dir`, opened
    /// the one way a snapshot's files are ([`open_in_dir`]: inside `dir`, no link).
    pub fn open_in_dir(dir: &Path, name: &str) -> Result<MemoryFile> {
        let path = dir.join(name);
        let (file, file_len) = open_in_dir(dir, name, u64::MAX)
            .map_err(|e| SnapshotError::io("open memory file", &path, e))?;
        Self::from_opened(path, file, file_len)
    }

    /// Validates `file`, opened from `path`, `file_len` bytes long.
    fn from_opened(path: PathBuf, file: File, file_len: u64) -> Result<MemoryFile> {
        let header_bytes = read_header_bytes(&file, &path, file_len)?;
        let header = Header::decode(&header_bytes);
        check_header(&path, &header, file_len)?;

        let metadata_len = header.metadata_len().unwrap_or(u64::MAX);
        let index_len = header.index_len().unwrap_or(u64::MAX);
        // Newer files leave the page CRC table out of the index CRC and out of this read.
        let read_len = if header.page_crcs_checked_on_load() {
            index_len
        } else {
            metadata_len
        };
        // check_header made sure the metadata fits in the file, so this is bounded.
        let mut metadata = Metadata::new(read_len as usize);
        file.read_exact_at(metadata.bytes_mut(), HEADER_LEN as u64)
            .map_err(|e| SnapshotError::io("read index of", &path, e))?;
        let computed = crc32fast::hash(metadata.bytes());
        if computed != header.index_crc {
            return Err(SnapshotError::IndexCrcMismatch {
                path,
                stored: header.index_crc,
                computed,
            });
        }

        let (layout, rest) = parse_regions(&path, &header, metadata.bytes())?;
        let extent_bytes = header.extent_count as usize * EXTENT_ENTRY_LEN;
        let extents = parse_extents(&path, &rest[..extent_bytes])?;
        // The CRC table follows the 24-byte region and extent entries, so it starts on a
        // 4-byte boundary.
        debug_assert_eq!(index_len as usize % PAGE_CRC_LEN, 0);
        let page_crcs = if !header.has_page_crcs() {
            PageCrcs::Absent
        } else if header.page_crcs_checked_on_load() {
            PageCrcs::OnLoad(LazyCrcTable::new(
                HEADER_LEN as u64 + index_len,
                header.data_page_count,
            ))
        } else {
            PageCrcs::InMetadata {
                start: index_len as usize / PAGE_CRC_LEN,
                count: header.data_page_count as usize,
            }
        };
        let (extent_linear, extent_crc_index) = check_extents(&path, &header, &layout, &extents)?;

        let data_end = header.data_offset + header.data_len().unwrap_or(u64::MAX);
        if data_end > file_len {
            return Err(SnapshotError::Truncated {
                path,
                what: "page data",
                needed: data_end,
                actual: file_len,
            });
        }
        // The format ends the file with the last data page: anything after it is not
        // something gpuvm wrote (another file's tail, a concatenation, a bad copy).
        if data_end < file_len {
            return Err(SnapshotError::TrailingData {
                path,
                data_end,
                actual: file_len,
            });
        }
        // The data is read mostly front to back; a larger readahead window helps.
        // SAFETY: plain syscall on an fd we own.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };

        Ok(MemoryFile {
            path,
            file,
            header,
            layout,
            extents,
            extent_linear,
            extent_crc_index,
            metadata,
            page_crcs,
        })
    }

    /// A raw guest-RAM image (see [`super::raw`]) as a memory file: a synthesized header
    /// and one data extent per run of pages to load, at their flat offsets. With `crcs`
    /// (one per flat page, the header's `FLAG_PAGE_CRCS` set), each extent's CRCs start at
    /// its flat page number; without, pages are not checked.
    pub(super) fn from_raw_image(
        path: PathBuf,
        file: File,
        header: Header,
        layout: RamLayout,
        extents: Vec<Extent>,
        extent_linear: Vec<u64>,
        crcs: Option<Vec<u32>>,
    ) -> MemoryFile {
        let page_size = header.page_size;
        MemoryFile {
            path,
            file,
            header,
            layout,
            extent_crc_index: extents.iter().map(|e| e.data_offset / page_size).collect(),
            extents,
            extent_linear,
            metadata: Metadata::new(0),
            page_crcs: crcs.map_or(PageCrcs::Absent, PageCrcs::Table),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Identity, generation, page size and RAM size.
    pub fn info(&self) -> SnapshotInfo {
        SnapshotInfo {
            id: self.header.snapshot_id,
            base_id: self.header.is_diff().then_some(self.header.base_id),
            generation: self.header.generation,
            page_size: self.header.page_size,
            ram_size: self.header.ram_size,
        }
    }

    /// The guest RAM layout recorded in the file.
    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    /// The extent index.
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }

    /// Number of pages stored with data.
    pub fn data_pages(&self) -> u64 {
        self.header.data_page_count
    }

    /// Whether the file has a CRC per data page.
    pub fn has_page_crcs(&self) -> bool {
        self.header.has_page_crcs()
    }

    /// Checks that the file was taken from a guest laid out like `guest`.
    pub fn check_layout(&self, guest: &RamLayout) -> Result<()> {
        if self.layout.page_size() != guest.page_size() {
            return Err(SnapshotError::PageSizeMismatch {
                path: self.path.clone(),
                file: self.layout.page_size(),
                guest: guest.page_size(),
            });
        }
        if self.layout.ram_size() != guest.ram_size() {
            return Err(SnapshotError::RamSizeMismatch {
                path: self.path.clone(),
                file: self.layout.ram_size(),
                guest: guest.ram_size(),
            });
        }
        let (ours, theirs) = (self.layout.regions(), guest.regions());
        for index in 0..ours.len().max(theirs.len()) {
            let (a, b) = (ours.get(index), theirs.get(index));
            let same = matches!((a, b), (Some(a), Some(b)) if a.guest_addr == b.guest_addr && a.size == b.size);
            if !same {
                return Err(SnapshotError::RegionMismatch {
                    path: self.path.clone(),
                    index,
                    file: a.copied(),
                    guest: b.copied(),
                });
            }
        }
        Ok(())
    }

    /// Reads every data page and checks its CRC (a full scrub; restores check the pages
    /// they load anyway). Without page CRCs this only checks that the data is readable.
    pub fn verify_data(&self) -> Result<()> {
        let page_size = self.layout.page_size() as usize;
        let mut buf = vec![0u8; VERIFY_CHUNK.max(page_size)];
        for (i, e) in self.extents.iter().enumerate() {
            if e.kind != ExtentKind::Data {
                continue;
            }
            let pages_per_read = (buf.len() / page_size) as u64;
            let mut done = 0u64;
            while done < u64::from(e.page_count) {
                let n = pages_per_read.min(u64::from(e.page_count) - done);
                let bytes = &mut buf[..(n as usize * page_size)];
                self.read_data(e.data_offset + done * page_size as u64, bytes)?;
                for (p, page) in bytes.chunks_exact(page_size).enumerate() {
                    let linear = self.extent_linear[i] + done + p as u64;
                    self.check_page(self.extent_crc_index[i] + done + p as u64, linear, page)?;
                }
                done += n;
            }
        }
        Ok(())
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Frees the disk blocks of this file's page data and keeps the rest: its length, and
    /// its header, index and page CRC table, which all lie before the data. The data then
    /// reads as zeros. For a file whose pages are kept elsewhere (the raw guest-RAM image
    /// gpuvm converts it to for Firecracker's layout): what a later Diff's conversion reads
    /// of it (its index and stored page CRCs, see [`super::RawPageCrcs::of_chain`]) stays.
    /// Refused for a file without page CRCs (those would have to be read from the data).
    /// Returns the bytes the file system freed.
    ///
    /// The blocks go by cutting the file to the start of its data and growing it back (a
    /// hole), not with `fallocate`, which the VMM thread's seccomp filter does not allow.
    pub fn drop_page_data(&self) -> Result<u64> {
        use std::os::unix::fs::MetadataExt;
        let fail = |e| SnapshotError::io("free page data of", &self.path, e);
        if !self.has_page_crcs() {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "it stores no page CRCs, so its data is needed to check its pages",
            )));
        }
        let opened = self.file.metadata().map_err(fail)?;
        let writable = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&self.path)
            .map_err(fail)?;
        let meta = writable.metadata().map_err(fail)?;
        // Only the file validated when this one was opened (not one renamed over it since).
        if (meta.dev(), meta.ino()) != (opened.dev(), opened.ino()) {
            return Err(fail(std::io::Error::other(
                "it was replaced after it was opened",
            )));
        }
        let len = meta.len();
        let data_offset = self.header.data_offset.min(len);
        writable.set_len(data_offset).map_err(fail)?;
        writable.set_len(len).map_err(fail)?;
        let after = writable.metadata().map_err(fail)?;
        Ok((meta.blocks() * 512).saturating_sub(after.blocks() * 512))
    }

    /// Reads stored data at `offset` into `buf`.
    pub(crate) fn read_data(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| SnapshotError::io("read page data from", &self.path, e))
    }

    /// CRC number `crc_index` as stored; `None` without CRCs.
    pub(super) fn stored_page_crc(&self, crc_index: u64) -> Result<Option<u32>> {
        match &self.page_crcs {
            PageCrcs::Absent => Ok(None),
            PageCrcs::InMetadata { start, count } => Ok(self.metadata.words()
                [*start..*start + *count]
                .get(crc_index as usize)
                .map(|&word| u32::from_le(word))),
            PageCrcs::OnLoad(table) => table.get(&self.file, &self.path, crc_index),
            PageCrcs::Table(crcs) => Ok(crcs.get(crc_index as usize).copied()),
        }
    }

    /// Checks one page against CRC number `crc_index` (no-op without CRCs).
    pub(crate) fn check_page(&self, crc_index: u64, linear: u64, page: &[u8]) -> Result<()> {
        let Some(stored) = self.stored_page_crc(crc_index)? else {
            return Ok(());
        };
        let computed = crc32fast::hash(page);
        if computed != stored {
            return Err(SnapshotError::DataCrcMismatch {
                path: self.path.clone(),
                guest_addr: self.layout.linear_to_gpa(linear),
                stored,
                computed,
            });
        }
        Ok(())
    }
}

/// Buffers at least this large are anonymous mappings with huge pages requested (small
/// in unit tests, so that their files take this path too).
#[cfg(not(test))]
const METADATA_MAP_MIN: usize = 1 << 20;
#[cfg(test)]
const METADATA_MAP_MIN: usize = 4096;

/// A memory file's metadata, read once into 4-byte aligned memory and kept (page CRCs
/// read with it are looked up in place rather than copied out). Large ones (a file
/// without `FLAG_PAGE_CRCS_CHECKED_ON_LOAD` of an 8 GiB guest carries 8 MiB of page
/// CRCs here) live in an anonymous mapping with transparent huge pages requested: a
/// handful of huge-page faults instead of one fault per 4 KiB page, which is what
/// reading them costs most on hosts with shadow paging.
enum Metadata {
    Heap { words: Vec<u32>, len: usize },
    Mapped(AnonMap),
}

impl Metadata {
    fn new(len: usize) -> Metadata {
        if len >= METADATA_MAP_MIN {
            match AnonMap::with_huge_pages(len) {
                Ok(map) => return Metadata::Mapped(map),
                Err(e) => log::debug!(
                    "cannot map {len} bytes for memory-file metadata ({e}); using the heap"
                ),
            }
        }
        Metadata::Heap {
            words: vec![0u32; len.div_ceil(4)],
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: the vector holds at least `len` initialised bytes; u8 has no
            // alignment or validity requirements.
            Metadata::Heap { words, len } => unsafe {
                std::slice::from_raw_parts(words.as_ptr().cast(), *len)
            },
            Metadata::Mapped(map) => map.as_slice(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: as in `bytes`, and `&mut self` gives exclusive access.
            Metadata::Heap { words, len } => unsafe {
                std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), *len)
            },
            Metadata::Mapped(map) => map.as_mut_slice(),
        }
    }

    /// The metadata as little-endian 32-bit words (the last partial word, if any, is
    /// left out).
    fn words(&self) -> &[u32] {
        match self {
            Metadata::Heap { words, len } => &words[..len / 4],
            Metadata::Mapped(map) => map.words(),
        }
    }
}

impl std::fmt::Debug for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metadata")
            .field("len", &self.bytes().len())
            .finish()
    }
}

/// Reads the fixed header, checking magic, version and header CRC in that order so each
/// failure gets its own error.
fn read_header_bytes(file: &File, path: &Path, file_len: u64) -> Result<[u8; HEADER_LEN]> {
    let mut bytes = [0u8; HEADER_LEN];
    let available = file_len.min(HEADER_LEN as u64) as usize;
    file.read_exact_at(&mut bytes[..available], 0)
        .map_err(|e| SnapshotError::io("read header of", path, e))?;
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&bytes[..8]);
    if available < MAGIC.len() || magic != MAGIC {
        return Err(SnapshotError::BadMagic {
            path: path.into(),
            found: magic,
        });
    }
    if available < HEADER_LEN {
        return Err(SnapshotError::Truncated {
            path: path.into(),
            what: "header",
            needed: HEADER_LEN as u64,
            actual: file_len,
        });
    }
    let version = get_u32(&bytes, 8);
    if version != FORMAT_VERSION {
        return Err(SnapshotError::UnsupportedVersion {
            path: path.into(),
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let (stored, computed) = (stored_header_crc(&bytes), computed_header_crc(&bytes));
    if stored != computed {
        return Err(SnapshotError::HeaderCrcMismatch {
            path: path.into(),
            stored,
            computed,
        });
    }
    Ok(bytes)
}

/// Checks header fields (CRC already verified) and that the index fits in the file.
fn check_header(path: &Path, h: &Header, file_len: u64) -> Result<()> {
    let invalid = |reason: String| {
        Err(SnapshotError::InvalidHeader {
            path: path.into(),
            reason,
        })
    };
    if h.header_len as usize != HEADER_LEN {
        return invalid(format!(
            "header length {} (expected {HEADER_LEN})",
            h.header_len
        ));
    }
    if h.flags & !KNOWN_FLAGS != 0 {
        return invalid(format!("unknown flags {:#x}", h.flags & !KNOWN_FLAGS));
    }
    if h.flags & FLAG_PAGE_CRCS_CHECKED_ON_LOAD != 0 && !h.has_page_crcs() {
        return invalid("page CRCs checked on load, but the file has none".into());
    }
    if h.region_count == 0 || h.region_count > MAX_REGIONS {
        return invalid(format!("{} RAM regions", h.region_count));
    }
    if h.snapshot_id == SnapshotId::NONE {
        return invalid("snapshot id is zero".into());
    }
    if h.is_diff() {
        if h.base_id == SnapshotId::NONE || h.generation == 0 {
            return invalid("diff without a base id or with generation 0".into());
        }
    } else if h.base_id != SnapshotId::NONE || h.generation != 0 {
        return invalid("full snapshot with a base id or a non-zero generation".into());
    }
    let (Some(metadata_len), Some(data_len)) = (h.metadata_len(), h.data_len()) else {
        return invalid("index or data size overflows".into());
    };
    let metadata_end = HEADER_LEN as u64 + metadata_len;
    if !h.data_offset.is_multiple_of(DATA_ALIGN) || h.data_offset < metadata_end {
        return invalid(format!(
            "data offset {:#x} is unaligned or inside the index (ending at {metadata_end:#x})",
            h.data_offset
        ));
    }
    if h.data_offset.checked_add(data_len).is_none() {
        return invalid("data end overflows".into());
    }
    if metadata_end > file_len {
        return Err(SnapshotError::Truncated {
            path: path.into(),
            what: "region table and page index",
            needed: metadata_end,
            actual: file_len,
        });
    }
    Ok(())
}

/// Parses the region table into a layout; returns it and the bytes after the table.
fn parse_regions<'m>(path: &Path, h: &Header, metadata: &'m [u8]) -> Result<(RamLayout, &'m [u8])> {
    let table_len = h.region_count as usize * REGION_ENTRY_LEN;
    let regions: Vec<RamRegion> = metadata[..table_len]
        .chunks_exact(REGION_ENTRY_LEN)
        .map(decode_region)
        .collect();
    let layout =
        RamLayout::new(h.page_size, regions).map_err(|e| SnapshotError::InvalidHeader {
            path: path.into(),
            reason: format!("region table: {e}"),
        })?;
    if layout.ram_size() != h.ram_size {
        return Err(SnapshotError::InvalidHeader {
            path: path.into(),
            reason: format!(
                "RAM size {:#x} differs from the regions' total {:#x}",
                h.ram_size,
                layout.ram_size()
            ),
        });
    }
    Ok((layout, &metadata[table_len..]))
}

fn parse_extents(path: &Path, bytes: &[u8]) -> Result<Vec<Extent>> {
    bytes
        .chunks_exact(EXTENT_ENTRY_LEN)
        .enumerate()
        .map(|(i, b)| {
            Extent::decode(b).map_err(|code| SnapshotError::InvalidIndex {
                path: path.into(),
                entry: i as u64,
                reason: format!("unknown extent kind {code}"),
            })
        })
        .collect()
}

/// Checks the extents: sorted, non-overlapping, each inside one region, data stored
/// contiguously in index order from the data offset. Returns each extent's linear page
/// index and first CRC index.
fn check_extents(
    path: &Path,
    h: &Header,
    layout: &RamLayout,
    extents: &[Extent],
) -> Result<(Vec<u64>, Vec<u64>)> {
    let mut linear_starts = Vec::with_capacity(extents.len());
    let mut crc_starts = Vec::with_capacity(extents.len());
    let mut next_free_linear = 0u64;
    let mut data_pages = 0u64;
    for (i, e) in extents.iter().enumerate() {
        let invalid = |reason: String| {
            Err(SnapshotError::InvalidIndex {
                path: path.into(),
                entry: i as u64,
                reason,
            })
        };
        if e.page_count == 0 {
            return invalid("empty extent".into());
        }
        let Some((region, linear)) = layout.locate_guest_page(e.first_page) else {
            return invalid(format!(
                "guest page {:#x} is outside guest RAM",
                e.first_page
            ));
        };
        let region_end = layout.region_first_linear(region) + layout.region_pages(region);
        if linear + u64::from(e.page_count) > region_end {
            return invalid(format!(
                "{} pages from guest page {:#x} run past the end of RAM region {region}",
                e.page_count, e.first_page
            ));
        }
        if i > 0 && linear < next_free_linear {
            return invalid("extents overlap or are not sorted".into());
        }
        next_free_linear = linear + u64::from(e.page_count);
        match e.kind {
            ExtentKind::Data => {
                let expected = h.data_offset + data_pages * h.page_size;
                if e.data_offset != expected {
                    return invalid(format!(
                        "data offset {:#x}, expected {expected:#x} (data is stored in index order)",
                        e.data_offset
                    ));
                }
                crc_starts.push(data_pages);
                data_pages += u64::from(e.page_count);
            }
            ExtentKind::Zero => {
                if !h.is_diff() {
                    return invalid("zero extent in a full snapshot".into());
                }
                crc_starts.push(data_pages);
            }
        }
        linear_starts.push(linear);
    }
    if data_pages != h.data_page_count {
        return Err(SnapshotError::InvalidHeader {
            path: path.into(),
            reason: format!(
                "header says {} data pages, index has {data_pages}",
                h.data_page_count
            ),
        });
    }
    Ok((linear_starts, crc_starts))
}

/// A run of pages to restore, all stored contiguously in one file of a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanRun {
    /// Linear page index (0.. over all regions) of the first page.
    pub start: u64,
    /// Number of pages.
    pub count: u64,
    /// Which file of the chain holds the data.
    pub layer: usize,
    /// File offset of the first page's data.
    pub file_offset: u64,
    /// Index of the first page's CRC in that file.
    pub(crate) crc_index: u64,
}

/// A full snapshot plus zero or more diffs on top, validated together, resolved into the
/// set of pages to load (pages in no run are zero).
#[derive(Debug)]
pub struct SnapshotChain {
    layers: Vec<MemoryFile>,
    layout: RamLayout,
    plan: Vec<PlanRun>,
}

impl SnapshotChain {
    /// Opens `paths` (full snapshot first, then diffs in order) and checks that each file
    /// matches the configured guest `guest` and that they form a chain.
    pub fn open<P: AsRef<Path>>(paths: &[P], guest: &RamLayout) -> Result<SnapshotChain> {
        let layers = paths
            .iter()
            .map(MemoryFile::open)
            .collect::<Result<Vec<_>>>()?;
        Self::from_files(layers, guest)
    }

    /// As [`SnapshotChain::open`], for the files `names` of the snapshot directory `dir`
    /// (each opened with [`MemoryFile::open_in_dir`]).
    pub fn open_in_dir(dir: &Path, names: &[String], guest: &RamLayout) -> Result<SnapshotChain> {
        let layers = names
            .iter()
            .map(|name| MemoryFile::open_in_dir(dir, name))
            .collect::<Result<Vec<_>>>()?;
        Self::from_files(layers, guest)
    }

    /// Like [`SnapshotChain::open`], taking the guest layout from the first file (for a
    /// page-fault handler process that has no guest configuration of its own).
    pub fn open_with_file_layout<P: AsRef<Path>>(paths: &[P]) -> Result<SnapshotChain> {
        let layers = paths
            .iter()
            .map(MemoryFile::open)
            .collect::<Result<Vec<_>>>()?;
        let Some(first) = layers.first() else {
            return Err(empty_chain());
        };
        let layout = first.layout().clone();
        Self::from_files(layers, &layout)
    }

    /// Validates already opened files as a chain for `guest`.
    pub fn from_files(layers: Vec<MemoryFile>, guest: &RamLayout) -> Result<SnapshotChain> {
        let Some(first) = layers.first() else {
            return Err(empty_chain());
        };
        if first.header.is_diff() {
            return Err(SnapshotError::BrokenChain {
                path: first.path.clone(),
                reason: format!(
                    "the first file must be a full snapshot, this is a diff (generation {}) of {}",
                    first.header.generation, first.header.base_id
                ),
            });
        }
        for layer in &layers {
            layer.check_layout(guest)?;
        }
        for pair in layers.windows(2) {
            let (base, diff) = (&pair[0], &pair[1]);
            let reason = if !diff.header.is_diff() {
                Some("a full snapshot cannot follow another file in a chain".to_string())
            } else if diff.header.base_id != base.header.snapshot_id {
                Some(format!(
                    "its base is snapshot {}, but the previous file {} is snapshot {}",
                    diff.header.base_id,
                    base.path.display(),
                    base.header.snapshot_id
                ))
            } else if diff.header.generation != base.header.generation + 1 {
                Some(format!(
                    "generation {} does not follow its base's generation {}",
                    diff.header.generation, base.header.generation
                ))
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(SnapshotError::BrokenChain {
                    path: diff.path.clone(),
                    reason,
                });
            }
        }
        let plan = build_plan(&layers, guest);
        Ok(SnapshotChain {
            layers,
            layout: guest.clone(),
            plan,
        })
    }

    /// The files, full snapshot first.
    pub fn layers(&self) -> &[MemoryFile] {
        &self.layers
    }

    /// The guest layout the chain was validated against.
    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    /// What to load, sorted by page: newest data for every page that has non-zero content.
    pub fn plan(&self) -> &[PlanRun] {
        &self.plan
    }

    /// Pages that hold data after restore.
    pub fn data_pages(&self) -> u64 {
        self.plan.iter().map(|r| r.count).sum()
    }

    /// Info of the newest file (base for the next diff after restoring).
    pub fn head(&self) -> SnapshotInfo {
        self.layers[self.layers.len() - 1].info()
    }

    /// Checks the page at linear index `linear`, taken from `run`, against its CRC.
    pub(crate) fn check_page(&self, run: &PlanRun, linear: u64, page: &[u8]) -> Result<()> {
        self.layers[run.layer].check_page(run.crc_index + (linear - run.start), linear, page)
    }
}

fn empty_chain() -> SnapshotError {
    SnapshotError::BrokenChain {
        path: PathBuf::new(),
        reason: "no memory files given".into(),
    }
}

/// Resolves which layer provides each page: newest first, a page mentioned by a newer file
/// (data or zero) hides older ones.
fn build_plan(layers: &[MemoryFile], layout: &RamLayout) -> Vec<PlanRun> {
    let page_size = layout.page_size();
    let mut covered = Bitmap::new(layout.total_pages());
    let mut plan = Vec::new();
    for (layer_idx, layer) in layers.iter().enumerate().rev() {
        for (i, e) in layer.extents.iter().enumerate() {
            let start = layer.extent_linear[i];
            let end = start + u64::from(e.page_count);
            if e.kind == ExtentKind::Data {
                let mut at = covered.next(false, start, end);
                while at < end {
                    let run_end = covered.next(true, at, end);
                    plan.push(PlanRun {
                        start: at,
                        count: run_end - at,
                        layer: layer_idx,
                        file_offset: e.data_offset + (at - start) * page_size,
                        crc_index: layer.extent_crc_index[i] + (at - start),
                    });
                    at = covered.next(false, run_end, end);
                }
            }
            covered.set_range(start, end);
        }
    }
    plan.sort_unstable_by_key(|r| r.start);
    plan
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::snapshot::test_util::{fill_ram, guest_ram, two_regions, PageFill, Rng, TempDir};
    use crate::snapshot::{write_diff, write_full, RamMappings, WriteOptions};
    use crate::Backing;

    const MIB: u64 = 1 << 20;

    fn mkfifo(path: &Path) {
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn only_regular_files_within_the_limit_are_opened() {
        let dir = TempDir::new("regular");
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let started = Instant::now();
        let error = open_regular_file(&fifo, u64::MAX).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the open waited"
        );
        assert!(error.to_string().contains("FIFO"), "{error}");
        let error = read_regular_file(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("character device, not a regular file"),
            "{error}"
        );
        let error = open_regular_file(dir.path(), u64::MAX).unwrap_err();
        assert!(error.to_string().contains("directory"), "{error}");

        let file = dir.path().join("file");
        std::fs::write(&file, b"twelve bytes").unwrap();
        assert_eq!(read_regular_file(&file, 12).unwrap(), b"twelve bytes");
        let error = read_regular_file(&file, 11).unwrap_err();
        assert!(error.to_string().contains("too large: 12 bytes"), "{error}");
        // A link is followed, and what it leads to is checked.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert!(open_regular_file(&link, u64::MAX).is_err());

        let error = MemoryFile::open(&fifo).unwrap_err();
        assert!(
            matches!(&error, SnapshotError::Io { path, .. } if *path == fifo),
            "{error}"
        );
    }

    #[test]
    fn bytes_after_the_page_data_are_refused_and_written_files_end_there() {
        let dir = TempDir::new("trailing");
        let regions = two_regions(2 * MIB, MIB, MIB);
        let ram = guest_ram(&regions, Backing::Memfd);
        let mappings = RamMappings::from_guest_ram(&ram).unwrap();
        // Sparse memory (holes between written pages), a full file, then a diff.
        let expected = fill_ram(&ram, &mut Rng::new(9), |linear| {
            if linear % 7 == 0 {
                PageFill::Random
            } else {
                PageFill::Untouched
            }
        });
        assert!(expected.iter().any(|&b| b != 0));
        let full = dir.path().join("full");
        let stats = write_full(&full, &mappings, &WriteOptions::default()).unwrap();
        let all_dirty: Vec<Vec<u64>> = mappings
            .layout()
            .regions()
            .iter()
            .map(|r| vec![u64::MAX; (r.size / 4096).div_ceil(64) as usize])
            .collect();
        let dirty: Vec<&[u64]> = all_dirty.iter().map(|d| d.as_slice()).collect();
        let diff = dir.path().join("diff");
        write_diff(
            &diff,
            &mappings,
            &dirty,
            &stats.info,
            &WriteOptions::default(),
        )
        .unwrap();
        for path in [&full, &diff] {
            MemoryFile::open(path).unwrap();
            let appended = dir.path().join("appended");
            std::fs::copy(path, &appended).unwrap();
            let len = std::fs::metadata(&appended).unwrap().len();
            std::fs::OpenOptions::new()
                .append(true)
                .open(&appended)
                .unwrap()
                .write_all(b"x")
                .unwrap();
            match MemoryFile::open(&appended).unwrap_err() {
                SnapshotError::TrailingData {
                    data_end, actual, ..
                } => assert_eq!((data_end, actual), (len, len + 1)),
                other => panic!("{other}"),
            }
        }
        SnapshotChain::open(&[&full, &diff], mappings.layout()).unwrap();
    }
}
