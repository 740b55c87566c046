//! Memory snapshots: a sparse file format holding only non-zero pages, full and diff
//! writers, a validating reader that understands diff chains, and eager restore.
//!
//! Lazy restore (userfaultfd) lives in [`crate::uffd`] and uses the reader from here.
//! Firecracker-shaped raw guest-RAM images (flat, sparse) are written and read as a
//! chain's source by [`raw`].
//!
//! Typical use by the VMM:
//! - save: pause vCPUs and devices, then [`write_full`] or [`write_diff`] (with the KVM dirty
//!   log) to a path; the file replaces the old one atomically ([`write_atomically`]).
//! - restore: [`SnapshotChain::open`] (validates every file against the configured guest
//!   before anything touches guest memory), create fresh guest RAM, then either
//!   [`restore_eager`] or [`crate::uffd::LazyRestore`].
//!
//! The format is documented in `docs/memory-file-format.md`.

mod atomic;
mod background;
pub(crate) mod bits;
mod eager;
pub mod format;
mod layout;
mod raw;
mod reader;
mod scan;
mod writer;

#[cfg(test)]
mod bench;
#[cfg(test)]
pub(crate) mod test_util;
#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;

pub use atomic::{
    flock, is_gpuvm_file, remove_abandoned_temp_file, remove_logged, temp_file_target,
    write_atomically, FRAMED_FILE_MAGIC, MEMORY_FILE_MAGIC, RAW_CRCS_MAGIC,
};
pub use background::{
    background_unsupported, BackgroundStats, WriteProtectedRam, MAX_BACKGROUND_PAGE_SIZE,
};
pub use eager::{restore_eager, EagerOptions, RestoreStats};
pub use format::{ExtentKind, SnapshotId};
pub use layout::{RamLayout, RamMappings};
pub use raw::{write_raw, RawContent, RawPageCrcs, RawWriteStats};
pub use reader::{
    is_plain_file_name, open_in_dir, open_regular_file, read_in_dir, read_regular_file, MemoryFile,
    PlanRun, SnapshotChain,
};
pub use writer::{write_diff, write_full, SnapshotInfo, WriteOptions, WriteStats};

use crate::RamRegion;

/// Errors from writing, reading, validating and restoring memory snapshots.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// An I/O operation on a snapshot file failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file does not start with the memory-file magic.
    #[error("{path}: not a gpuvm memory file (magic {found:02x?}, expected \"GPUVMMEM\")")]
    BadMagic { path: PathBuf, found: [u8; 8] },
    /// The file was written by a format version this build does not read.
    #[error("{path}: unsupported memory file format version {found} (this build reads version {supported})")]
    UnsupportedVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    /// The fixed header is corrupt.
    #[error("{path}: header CRC mismatch (stored {stored:#010x}, computed {computed:#010x}): the header is corrupt")]
    HeaderCrcMismatch {
        path: PathBuf,
        stored: u32,
        computed: u32,
    },
    /// The region table, extent index or page-CRC table is corrupt.
    #[error("{path}: index CRC mismatch (stored {stored:#010x}, computed {computed:#010x}): the region table or page index is corrupt")]
    IndexCrcMismatch {
        path: PathBuf,
        stored: u32,
        computed: u32,
    },
    /// The file goes on after the end of its page data, where the format ends it.
    #[error("{path}: {} bytes after the end of the page data at {data_end:#x} (the file has {actual}): the format ends the file there", actual - data_end)]
    TrailingData {
        path: PathBuf,
        data_end: u64,
        actual: u64,
    },
    /// The file is shorter than its header and index say.
    #[error("{path}: file is truncated: {needed} bytes needed for {what}, file has {actual}")]
    Truncated {
        path: PathBuf,
        what: &'static str,
        needed: u64,
        actual: u64,
    },
    /// A header field has an impossible value (with a valid CRC: a writer bug).
    #[error("{path}: invalid header: {reason}")]
    InvalidHeader { path: PathBuf, reason: String },
    /// An index entry is inconsistent (with a valid CRC: a writer bug).
    #[error("{path}: invalid index entry {entry}: {reason}")]
    InvalidIndex {
        path: PathBuf,
        entry: u64,
        reason: String,
    },
    /// The snapshot was taken with a different page size than the configured guest uses.
    #[error("{path}: page size mismatch: snapshot has {file} bytes, guest RAM uses {guest}")]
    PageSizeMismatch {
        path: PathBuf,
        file: u64,
        guest: u64,
    },
    /// The snapshot's total RAM differs from the configured guest's.
    #[error("{path}: guest RAM size mismatch: snapshot has {file} bytes, guest is configured with {guest}")]
    RamSizeMismatch {
        path: PathBuf,
        file: u64,
        guest: u64,
    },
    /// Same total size, different guest-physical layout.
    #[error("{path}: RAM region {index} mismatch: snapshot has {file:x?}, guest has {guest:x?}")]
    RegionMismatch {
        path: PathBuf,
        index: usize,
        file: Option<RamRegion>,
        guest: Option<RamRegion>,
    },
    /// The files given as a chain do not form one (wrong order, missing or foreign diff).
    #[error("snapshot chain broken at {path}: {reason}")]
    BrokenChain { path: PathBuf, reason: String },
    /// A stored page does not match its CRC.
    #[error("{path}: data CRC mismatch for the page at guest address {guest_addr:#x} (stored {stored:#010x}, computed {computed:#010x})")]
    DataCrcMismatch {
        path: PathBuf,
        guest_addr: u64,
        stored: u32,
        computed: u32,
    },
    /// A guest RAM description is unusable.
    #[error("invalid guest RAM layout: {0}")]
    InvalidLayout(String),
    /// A dirty bitmap is too short for its region.
    #[error("dirty bitmap for region {region} has {got} words, {needed} needed for {size} bytes")]
    DirtyBitmapTooShort {
        region: usize,
        needed: usize,
        got: usize,
        size: u64,
    },
    /// The number of dirty bitmaps differs from the number of regions.
    #[error("{got} dirty bitmaps given for {regions} RAM regions")]
    DirtyBitmapCount { regions: usize, got: usize },
    /// A worker thread panicked.
    #[error("snapshot worker thread panicked")]
    WorkerPanicked,
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, SnapshotError>;

impl SnapshotError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        SnapshotError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Number of worker threads to use when the caller does not say: one per CPU.
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
