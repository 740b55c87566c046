//! virtio-blk: a raw disk image (a regular file or a host block device) as the guest's
//! `/dev/vdX`.
//!
//! - [`config`]: [`BlockConfig`] (what the VMM's API and config file give) and [`IoEngine`].
//! - `disk`: opening the backing file with its checks (file type, size, lock) and the
//!   operations that do not go through a backend (discard, write zeroes).
//! - `request`: a descriptor chain parsed and checked into a request.
//! - `backend`: reads, writes and flushes, synchronous (`backend::sync`) or through io_uring
//!   (`backend::io_uring`).
//! - `handler`: the worker thread's side: pops the queue, charges the rate limiter, runs
//!   requests and completes them.
//! - [`device`]: [`Block`], the [`crate::VirtioDevice`] (features, configuration space,
//!   activation, pause/resume, snapshot state, hot-swap of the backing file).
//!
//! The VMM builds a [`Block`] with [`Block::new`] from a [`BlockConfig`] (this opens and locks
//! the image, so a bad path fails before the VM starts), puts it behind the virtio-pci
//! transport, and forwards `PATCH /drives/{id}` to [`Block::update_backing`] and
//! [`Block::update_rate_limiter`].

mod backend;
pub mod config;
pub mod device;
mod disk;
mod handler;
mod request;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use config::{BlockConfig, IoEngine};
pub use device::{Block, BlockState, BlockStateError};

use crate::rate_limiter::RateLimiterError;

/// The size of a virtio-blk sector: capacities, request sectors and lengths count in it,
/// whatever the host's block size.
pub const SECTOR_SIZE: u64 = 512;
/// The one queue's largest size.
pub const QUEUE_SIZE: u16 = 256;
/// The most data segments a request may have (the queue size less the header and the
/// status descriptors), advertised as `seg_max`.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// The most segments one discard or write-zeroes request may carry (bounds what the
/// device reads for one request).
pub const MAX_DISCARD_SEGMENTS: u32 = 32;
/// The most sectors one discard or write-zeroes segment may cover (128 MiB): bounds the
/// time one request holds the worker when zeroes have to be written out.
pub const MAX_DISCARD_SECTORS: u32 = 1 << 18;
/// How long pause, reset and a hot-swap wait for io_uring requests in flight. A request
/// still in flight after it (a hung NFS server, a dying disk) completes after resume; a
/// snapshot taken meanwhile records the queue without its completion, and the restored
/// guest waits for that request forever, so the pause logs it as an error.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The longest drive ID (VIRTIO_BLK_ID_BYTES) a GET_ID request returns.
pub const ID_BYTES: usize = virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES as usize;

/// Checks the image `config` names as the device opens it at start (it exists, is a
/// regular file or a block device, opens with the drive's mode, read-only or not, and
/// direct I/O, and no other process holds its lock), then closes it: a drive configured
/// before boot is refused when it is added, not when the VM starts. Returns its capacity
/// in sectors (an empty file is a placeholder disk of 0 sectors, with a warning; a file
/// of 1 to 511 bytes is refused).
pub fn check_image(config: &BlockConfig) -> Result<u64, BlockError> {
    config.validate()?;
    let disk = disk::Disk::open_with_lock(&config.path, config.read_only, config.direct, true)?;
    Ok(disk.capacity_sectors())
}

/// Why a block device could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("drive {drive_id}: serial {serial:?} is {len} bytes, the most is {ID_BYTES}")]
    SerialTooLong {
        drive_id: String,
        serial: String,
        len: usize,
    },
    #[error("{}: no such file", path.display())]
    Missing { path: PathBuf },
    #[error(
        "{}: cannot open read-write: {source}; is the image read-only? (set read_only)",
        path.display()
    )]
    OpenReadWrite {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{}: the filesystem refuses direct I/O (O_DIRECT): {source}; leave direct off",
        path.display()
    )]
    DirectUnsupported {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot open: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: is {kind}, not a disk image (a regular file or a block device)", path.display())]
    NotADisk { path: PathBuf, kind: &'static str },
    #[error(
        "{}: {size} bytes is less than one sector ({SECTOR_SIZE} bytes): not a disk image (an empty file is taken as a placeholder disk of 0 sectors)",
        path.display()
    )]
    LessThanASector { path: PathBuf, size: u64 },
    #[error("{}: cannot read its size or type: {source}", path.display())]
    Stat {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{}: is in use by another process (another VM?): cannot take {wanted} lock on it",
        path.display()
    )]
    Locked { path: PathBuf, wanted: &'static str },
    #[error("{}: the handed-over image descriptor is not this drive's image: {reason}", path.display())]
    AdoptedMismatch { path: PathBuf, reason: String },
    #[error("{}: cannot lock it: {source}", path.display())]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("drive {drive_id}: rate limiter: {source}")]
    RateLimiter {
        drive_id: String,
        source: RateLimiterError,
    },
    #[error("drive {drive_id}: the device failed earlier (its I/O thread panicked) and cannot be changed")]
    Failed { drive_id: String },
    #[error("drive {drive_id}: cannot restart its I/O thread: {source}")]
    Thread {
        drive_id: String,
        source: std::io::Error,
    },
}
