//! On-disk layout of a gpuvm memory file (see `docs/memory-file-format.md`).
//!
//! Everything is little-endian. The file is:
//!
//! ```text
//! [header: 128 B][region table: 24 B each][extent index: 24 B each][page CRCs: 4 B each]
//! [zero padding up to data_offset (a multiple of 4096)][data pages, in index order]
//! ```
//!
//! This module only encodes and decodes bytes; the reader checks what the values mean.

use std::fmt;

use crate::RamRegion;

/// First eight bytes of every memory file.
pub const MAGIC: [u8; 8] = *b"GPUVMMEM";
/// The format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Length of the fixed header.
pub const HEADER_LEN: usize = 128;
/// Length of one region-table entry.
pub const REGION_ENTRY_LEN: usize = 24;
/// Length of one extent-index entry.
pub const EXTENT_ENTRY_LEN: usize = 24;
/// Length of one page-CRC entry.
pub const PAGE_CRC_LEN: usize = 4;
/// Data starts at a multiple of this, so every stored page is 4 KiB aligned in the file
/// (mmap-able, and usable as a `UFFDIO_COPY` source straight from a mapping of the file).
pub const DATA_ALIGN: u64 = 4096;

/// Header flag: the file is a diff against `base_id` (otherwise a full snapshot).
pub const FLAG_DIFF: u32 = 1 << 0;
/// Header flag: a CRC32 per data page follows the extent index.
pub const FLAG_PAGE_CRCS: u32 = 1 << 1;
/// Header flag (only with `FLAG_PAGE_CRCS`): the index CRC leaves the page CRC table out.
/// Each entry is checked with its page when that page is loaded instead, so opening a
/// file reads the (small) region table and extent index and not the table of one CRC
/// per page (8 MiB for 8 GiB of guest RAM).
pub const FLAG_PAGE_CRCS_CHECKED_ON_LOAD: u32 = 1 << 2;
/// All flags this version knows.
pub const KNOWN_FLAGS: u32 = FLAG_DIFF | FLAG_PAGE_CRCS | FLAG_PAGE_CRCS_CHECKED_ON_LOAD;

/// Byte offset of the index CRC inside the header.
const INDEX_CRC_AT: usize = 120;
/// Byte offset of the header CRC inside the header; it covers bytes `0..HEADER_CRC_AT`.
pub const HEADER_CRC_AT: usize = 124;

/// Random 128-bit identity of one snapshot; diffs name their base by it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SnapshotId(pub [u8; 16]);

impl SnapshotId {
    /// The all-zero id, used as "no base" in full snapshots.
    pub const NONE: SnapshotId = SnapshotId([0; 16]);

    /// A fresh random id from the kernel's CSPRNG.
    pub fn random() -> std::io::Result<SnapshotId> {
        let mut bytes = [0u8; 16];
        let mut filled = 0;
        while filled < bytes.len() {
            // SAFETY: the pointer and length describe the unfilled tail of `bytes`, which
            // lives for the whole call; getrandom writes at most that many bytes.
            let ret = unsafe {
                libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0)
            };
            if ret < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            filled += ret as usize;
        }
        Ok(SnapshotId(bytes))
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SnapshotId({self})")
    }
}

/// The decoded fixed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub header_len: u32,
    pub flags: u32,
    pub region_count: u32,
    pub page_size: u64,
    pub ram_size: u64,
    pub snapshot_id: SnapshotId,
    pub base_id: SnapshotId,
    pub generation: u64,
    pub extent_count: u64,
    pub data_page_count: u64,
    pub data_offset: u64,
    pub index_crc: u32,
}

impl Header {
    /// Encodes the header, computing its own CRC.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut b, 8, self.version);
        put_u32(&mut b, 12, self.header_len);
        put_u32(&mut b, 16, self.flags);
        put_u32(&mut b, 20, self.region_count);
        put_u64(&mut b, 24, self.page_size);
        put_u64(&mut b, 32, self.ram_size);
        b[40..56].copy_from_slice(&self.snapshot_id.0);
        b[56..72].copy_from_slice(&self.base_id.0);
        put_u64(&mut b, 72, self.generation);
        put_u64(&mut b, 80, self.extent_count);
        put_u64(&mut b, 88, self.data_page_count);
        put_u64(&mut b, 96, self.data_offset);
        // 104..120 reserved, zero.
        put_u32(&mut b, INDEX_CRC_AT, self.index_crc);
        let crc = crc32fast::hash(&b[..HEADER_CRC_AT]);
        put_u32(&mut b, HEADER_CRC_AT, crc);
        b
    }

    /// Decodes the fields after the magic and version, which the caller has checked.
    /// Returns the header and the CRC stored in it; CRC checking is the caller's job so it
    /// can report the exact error.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Header {
        let mut snapshot_id = [0u8; 16];
        snapshot_id.copy_from_slice(&b[40..56]);
        let mut base_id = [0u8; 16];
        base_id.copy_from_slice(&b[56..72]);
        Header {
            version: get_u32(b, 8),
            header_len: get_u32(b, 12),
            flags: get_u32(b, 16),
            region_count: get_u32(b, 20),
            page_size: get_u64(b, 24),
            ram_size: get_u64(b, 32),
            snapshot_id: SnapshotId(snapshot_id),
            base_id: SnapshotId(base_id),
            generation: get_u64(b, 72),
            extent_count: get_u64(b, 80),
            data_page_count: get_u64(b, 88),
            data_offset: get_u64(b, 96),
            index_crc: get_u32(b, INDEX_CRC_AT),
        }
    }

    /// Whether this file is a diff.
    pub fn is_diff(&self) -> bool {
        self.flags & FLAG_DIFF != 0
    }

    /// Whether the file carries a CRC per data page.
    pub fn has_page_crcs(&self) -> bool {
        self.flags & FLAG_PAGE_CRCS != 0
    }

    /// Whether the index CRC leaves the page CRC table out (see
    /// [`FLAG_PAGE_CRCS_CHECKED_ON_LOAD`]).
    pub fn page_crcs_checked_on_load(&self) -> bool {
        self.has_page_crcs() && self.flags & FLAG_PAGE_CRCS_CHECKED_ON_LOAD != 0
    }

    /// Bytes of the region table and extent index. `None` on overflow.
    pub fn index_len(&self) -> Option<u64> {
        let regions = u64::from(self.region_count).checked_mul(REGION_ENTRY_LEN as u64)?;
        let extents = self.extent_count.checked_mul(EXTENT_ENTRY_LEN as u64)?;
        regions.checked_add(extents)
    }

    /// Bytes of metadata after the header: region table, extent index and page CRCs.
    /// `None` on overflow (only possible with a corrupt header, which the CRC catches first).
    pub fn metadata_len(&self) -> Option<u64> {
        let crcs = if self.has_page_crcs() {
            self.data_page_count.checked_mul(PAGE_CRC_LEN as u64)?
        } else {
            0
        };
        self.index_len()?.checked_add(crcs)
    }

    /// Bytes of page data.
    pub fn data_len(&self) -> Option<u64> {
        self.data_page_count.checked_mul(self.page_size)
    }
}

/// Where the stored header CRC is, and what it covers.
pub fn stored_header_crc(b: &[u8; HEADER_LEN]) -> u32 {
    get_u32(b, HEADER_CRC_AT)
}

/// CRC32 of the part of the header that the header CRC protects.
pub fn computed_header_crc(b: &[u8; HEADER_LEN]) -> u32 {
    crc32fast::hash(&b[..HEADER_CRC_AT])
}

/// What an extent says about its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtentKind {
    /// The pages' contents are stored in the data section.
    Data,
    /// The pages are all zero (only in diffs: they were dirty and are now zero).
    Zero,
}

impl ExtentKind {
    fn code(self) -> u32 {
        match self {
            ExtentKind::Data => 0,
            ExtentKind::Zero => 1,
        }
    }

    fn from_code(code: u32) -> Option<ExtentKind> {
        match code {
            0 => Some(ExtentKind::Data),
            1 => Some(ExtentKind::Zero),
            _ => None,
        }
    }
}

/// One run of pages in the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Guest page number of the first page (guest-physical address / page size).
    pub first_page: u64,
    /// Number of pages.
    pub page_count: u32,
    /// Data or zero.
    pub kind: ExtentKind,
    /// File offset of the first page's data (0 for zero extents).
    pub data_offset: u64,
}

impl Extent {
    /// Encodes into a 24-byte index entry.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.first_page.to_le_bytes());
        out.extend_from_slice(&self.page_count.to_le_bytes());
        out.extend_from_slice(&self.kind.code().to_le_bytes());
        out.extend_from_slice(&self.data_offset.to_le_bytes());
    }

    /// Decodes a 24-byte index entry; `Err(code)` for an unknown kind.
    pub fn decode(b: &[u8]) -> Result<Extent, u32> {
        let code = get_u32(b, 12);
        let kind = ExtentKind::from_code(code).ok_or(code)?;
        Ok(Extent {
            first_page: get_u64(b, 0),
            page_count: get_u32(b, 8),
            kind,
            data_offset: get_u64(b, 16),
        })
    }
}

/// Encodes one region-table entry.
pub fn encode_region(region: &RamRegion, out: &mut Vec<u8>) {
    out.extend_from_slice(&region.guest_addr.to_le_bytes());
    out.extend_from_slice(&region.size.to_le_bytes());
    out.extend_from_slice(&region.file_offset.to_le_bytes());
}

/// Decodes one region-table entry.
pub fn decode_region(b: &[u8]) -> RamRegion {
    RamRegion {
        guest_addr: get_u64(b, 0),
        size: get_u64(b, 8),
        file_offset: get_u64(b, 16),
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two).
pub fn align_up(value: u64, align: u64) -> u64 {
    (value + align - 1) & !(align - 1)
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_crc() {
        let h = Header {
            version: FORMAT_VERSION,
            header_len: HEADER_LEN as u32,
            flags: FLAG_DIFF | FLAG_PAGE_CRCS,
            region_count: 2,
            page_size: 4096,
            ram_size: 1 << 30,
            snapshot_id: SnapshotId([7; 16]),
            base_id: SnapshotId([9; 16]),
            generation: 3,
            extent_count: 17,
            data_page_count: 99,
            data_offset: 8192,
            index_crc: 0xdead_beef,
        };
        let bytes = h.encode();
        assert_eq!(&bytes[..8], &MAGIC);
        assert_eq!(Header::decode(&bytes), h);
        assert_eq!(stored_header_crc(&bytes), computed_header_crc(&bytes));
        let mut flipped = bytes;
        flipped[33] ^= 1;
        assert_ne!(stored_header_crc(&flipped), computed_header_crc(&flipped));
    }

    #[test]
    fn extent_round_trip_and_unknown_kind() {
        let e = Extent {
            first_page: 0x1_0000_0000,
            page_count: 12,
            kind: ExtentKind::Zero,
            data_offset: 0,
        };
        let mut buf = Vec::new();
        e.encode(&mut buf);
        assert_eq!(buf.len(), EXTENT_ENTRY_LEN);
        assert_eq!(Extent::decode(&buf), Ok(e));
        buf[12] = 5;
        assert_eq!(Extent::decode(&buf), Err(5));
    }
}
