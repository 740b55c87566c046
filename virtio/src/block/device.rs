//! [`Block`]: the virtio-blk [`VirtioDevice`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk::{
    virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;

use super::backend::IoUringBackend;
use super::config::{BlockConfig, IoEngine};
use super::disk::Disk;
use super::handler::{quiesce_channel, BlockHandler, IoResources, QuiesceRequest};
use super::{
    BlockError, DRAIN_TIMEOUT, MAX_DISCARD_SECTORS, MAX_DISCARD_SEGMENTS, QUEUE_SIZE, SECTOR_SIZE,
    SEG_MAX,
};
use crate::device::{
    ActivateError, Activation, ActiveQueue, DeviceState, DeviceStateError, QueuePosition,
    VirtioDevice,
};
use crate::rate_limiter::{
    RateLimiter, RateLimiterConfig, RateLimiterState, RateLimiterStateError,
};
use crate::worker::{ChangeError, DeviceWorker, Held, NotIdle};
use crate::VirtioInterrupt;
use gpuvm_devices::Persist;

const DEVICE: &str = "virtio-blk";
/// Hole-punching granularity advertised to the guest, in sectors (4 KiB: the usual
/// file-system block; smaller discards still work, they just free less).
const DISCARD_SECTOR_ALIGNMENT: u32 = 8;

static IO_URING_FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// What a snapshot keeps of a drive, and checks against on restore.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockState {
    pub drive_id: String,
    pub path: PathBuf,
    pub read_only: bool,
    pub serial: Option<String>,
    pub capacity_sectors: u64,
    /// The rate limiter's buckets at the pause (absent in version-1 state files: they
    /// start full).
    #[serde(default)]
    pub buckets: RateLimiterState,
}

/// Why a drive's state was refused.
#[derive(Debug, thiserror::Error)]
pub enum BlockStateError {
    #[error("{device}: the snapshot's drive was {}, this one is {}", mode(*saved), mode(*now))]
    Mode {
        device: String,
        saved: bool,
        now: bool,
    },
    #[error(
        "{device}: {} has {now} sectors, the snapshot's drive ({}) had {saved}: the image changed since the snapshot",
        path.display(),
        saved_path.display()
    )]
    Capacity {
        device: String,
        path: PathBuf,
        now: u64,
        saved_path: PathBuf,
        saved: u64,
    },
    #[error("{device}: the saved serial: {source}")]
    Serial { device: String, source: BlockError },
    #[error("{device}: cannot load its state: {source}")]
    Unavailable { device: String, source: BlockError },
    #[error("{device}: {source}")]
    Buckets {
        device: String,
        source: RateLimiterStateError,
    },
}

fn mode(read_only: bool) -> &'static str {
    if read_only {
        "read-only"
    } else {
        "read-write"
    }
}

/// A virtio-blk device over a raw image.
pub struct Block {
    config: BlockConfig,
    name: String,
    capacity_sectors: u64,
    engine: IoEngine,
    /// The disk waits as its idle resources; if the worker thread panicked or could not
    /// start, the disk is gone with it.
    worker: DeviceWorker<IoResources, BlockHandler>,
    /// The transport's interrupt while active (for configuration changes).
    interrupt: Option<Arc<dyn VirtioInterrupt>>,
    quiesce: QuiesceRequest,
    /// The rate limiter's buckets as the last pause found them (what a snapshot saves).
    buckets_at_pause: RateLimiterState,
}

/// How long the device waits for its worker to quiesce: the drain, and a synchronous
/// request that may be under way.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(DRAIN_TIMEOUT.as_secs() + 5);

impl Block {
    /// Opens and locks the image, and sets up the I/O engine (io_uring falls back to
    /// synchronous I/O where it cannot be set up, with a log line).
    pub fn new(config: BlockConfig) -> Result<Block, BlockError> {
        config.validate()?;
        let disk = Disk::open(&config.path, config.read_only, config.direct)?;
        Block::over(config, disk)
    }

    /// Takes `image`, the drive's image another gpuvm process had open and locked (a live
    /// update), instead of opening the path again: it must be that file, opened as the
    /// configuration says ([`Disk::adopt`]).
    pub fn adopt(config: BlockConfig, image: std::fs::File) -> Result<Block, BlockError> {
        config.validate()?;
        let disk = Disk::adopt(image, &config.path, config.read_only, config.direct)?;
        Block::over(config, disk)
    }

    /// The device over an open disk; sets up the I/O engine.
    fn over(config: BlockConfig, disk: Disk) -> Result<Block, BlockError> {
        let rate_limiter =
            RateLimiter::new(config.rate_limiter).map_err(|source| BlockError::RateLimiter {
                drive_id: config.drive_id.clone(),
                source,
            })?;
        let ring = match config.io_engine {
            IoEngine::Sync => None,
            IoEngine::Async => match IoUringBackend::new(QUEUE_SIZE) {
                Ok(ring) => Some(ring),
                Err(error) => {
                    let message = format!(
                        "virtio-blk {}: io_uring unavailable ({error}), using synchronous I/O",
                        config.drive_id
                    );
                    if IO_URING_FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                        log::debug!("{message}");
                    } else {
                        log::warn!("{message}");
                    }
                    None
                }
            },
        };
        let engine = if ring.is_some() {
            IoEngine::Async
        } else {
            IoEngine::Sync
        };
        let name = format!("{DEVICE} {}", config.drive_id);
        let capacity_sectors = disk.capacity_sectors();
        let (quiesce, quiesce_reply) = quiesce_channel().map_err(|source| BlockError::Thread {
            drive_id: config.drive_id.clone(),
            source,
        })?;
        let io = IoResources::new(
            name.clone(),
            disk,
            ring,
            rate_limiter,
            config.device_id(),
            quiesce_reply,
        );
        let worker = DeviceWorker::new(name.clone(), thread_name(&config.drive_id), io);
        Ok(Block {
            config,
            name,
            capacity_sectors,
            engine,
            worker,
            interrupt: None,
            quiesce,
            buckets_at_pause: RateLimiterState::default(),
        })
    }

    /// The drive's configuration as it stands (after hot-swaps and rate-limiter updates).
    pub fn config(&self) -> &BlockConfig {
        &self.config
    }

    /// The engine actually in use ([`IoEngine::Sync`] after a fallback).
    pub fn io_engine(&self) -> IoEngine {
        self.engine
    }

    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_sectors
    }

    /// Swaps the backing file (Firecracker's `PATCH /drives/{id}` with a new `path_on_host`):
    /// opens `path` with the same checks and lock as [`Block::new`], swaps it in between
    /// requests (the worker stops, requests in flight complete, the worker restarts), and
    /// tells the driver the capacity may have changed. The old file stays in use if the new
    /// one is refused. `path` may be the file already in use (to pick up a new size).
    pub fn update_backing(&mut self, path: PathBuf) -> Result<(), BlockError> {
        let (read_only, direct) = (self.config.read_only, self.config.direct);
        let new_path = path.clone();
        let capacity = self.with_resources(move |io| {
            let same_file = io.disk.is_same_file(&new_path);
            // The file already in use is locked by our own descriptor: lock the new one
            // once the old one is closed.
            let disk = Disk::open_with_lock(&new_path, read_only, direct, !same_file)?;
            let old = std::mem::replace(&mut io.disk, disk);
            if same_file {
                drop(old);
                if let Err(error) = io.disk.lock() {
                    log::error!("{}: after swapping in the same file: {error}", io.name);
                }
            }
            Ok(io.disk.capacity_sectors())
        })??;
        log::info!(
            "{}: backing file now {} ({capacity} sectors)",
            self.name,
            path.display()
        );
        self.capacity_sectors = capacity;
        self.config.path = path;
        if let Some(interrupt) = &self.interrupt {
            if let Err(error) = interrupt.signal_config() {
                log::warn!(
                    "{}: cannot signal the configuration change: {error}",
                    self.name
                );
            }
        }
        Ok(())
    }

    /// A second descriptor of the image in use (the same open file description, so the
    /// same lock), to hand the drive to another gpuvm process (a live update). The worker
    /// stops between requests meanwhile, as for a hot-swap.
    pub fn image_descriptor(&mut self) -> Result<std::fs::File, BlockError> {
        let path = self.config.path.clone();
        self.with_resources(|io| io.disk.file().try_clone())?
            .map_err(|source| BlockError::Stat { path, source })
    }

    /// Replaces the rate limiter's buckets (`PATCH /drives/{id}` with a `rate_limiter`).
    pub fn update_rate_limiter(&mut self, config: RateLimiterConfig) -> Result<(), BlockError> {
        let drive_id = self.config.drive_id.clone();
        self.with_resources(move |io| io.rate_limiter.update(config))?
            .map_err(|source| BlockError::RateLimiter { drive_id, source })?;
        self.config.rate_limiter = config;
        Ok(())
    }

    /// Requests that went through the bounce buffer (O_DIRECT with unaligned guest buffers).
    #[cfg(test)]
    pub(crate) fn bounced_requests(&mut self) -> u64 {
        self.with_resources(|io| io.bounced).unwrap_or(0)
    }

    /// Runs `change` on the disk and backends: directly when idle or paused, between two
    /// requests when running (the worker stops, the ring drains, the worker restarts).
    fn with_resources<T>(
        &mut self,
        change: impl FnOnce(&mut IoResources) -> T,
    ) -> Result<T, BlockError> {
        self.quiesce_worker();
        self.worker
            .change(|held| match held {
                Held::Idle(io) => change(io),
                Held::Handler(handler) => change(&mut handler.io),
            })
            .map_err(|error| {
                let drive_id = self.config.drive_id.clone();
                match error {
                    ChangeError::Failed => BlockError::Failed { drive_id },
                    ChangeError::Restart(source) => BlockError::Thread {
                        drive_id,
                        source: source.into(),
                    },
                }
            })
    }

    fn config_space(&self) -> virtio_blk_config {
        let writable = !self.config.read_only;
        // Discard and write zeroes are only offered to a writable drive.
        let if_writable = |value: u32| if writable { value.to_le() } else { 0 };
        virtio_blk_config {
            capacity: self.capacity_sectors.to_le(),
            seg_max: SEG_MAX.to_le(),
            blk_size: (SECTOR_SIZE as u32).to_le(),
            max_discard_sectors: if_writable(MAX_DISCARD_SECTORS),
            max_discard_seg: if_writable(MAX_DISCARD_SEGMENTS),
            discard_sector_alignment: if_writable(DISCARD_SECTOR_ALIGNMENT),
            max_write_zeroes_sectors: if_writable(MAX_DISCARD_SECTORS),
            max_write_zeroes_seg: if_writable(MAX_DISCARD_SEGMENTS),
            write_zeroes_may_unmap: u8::from(writable),
            ..Default::default()
        }
    }

    /// Asks a running worker to finish (or give up on, see [`DRAIN_TIMEOUT`]) the requests
    /// in flight and take no new ones, before it is stopped.
    fn quiesce_worker(&self) {
        if self.worker.is_running() {
            self.quiesce.quiesce(&self.name, QUIESCE_TIMEOUT);
        }
    }
}

/// "virtio-blk" and up to four letters or digits of the drive ID (15 bytes at most).
fn thread_name(drive_id: &str) -> String {
    let suffix: String = drive_id
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(4)
        .collect();
    if suffix.is_empty() {
        DEVICE.to_string()
    } else {
        format!("{DEVICE}-{suffix}")
    }
}

impl Drop for Block {
    /// Quiesces the worker first, so requests in flight finish on its thread (the thread
    /// that drops the device may not be allowed io_uring system calls).
    fn drop(&mut self) {
        self.reset();
    }
}

impl VirtioDevice for Block {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }

    fn device_features(&self) -> u64 {
        let mut features = (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_RING_F_EVENT_IDX);
        if self.config.read_only {
            features |= 1u64 << VIRTIO_BLK_F_RO;
        } else {
            features |= (1u64 << VIRTIO_BLK_F_DISCARD) | (1u64 << VIRTIO_BLK_F_WRITE_ZEROES);
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_space();
        // SAFETY: virtio_blk_config is repr(C, packed) with integer fields only: no padding,
        // every byte initialised; the slice lives no longer than `config`.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&config as *const virtio_blk_config).cast::<u8>(),
                std::mem::size_of::<virtio_blk_config>(),
            )
        };
        crate::read_config_bytes(bytes, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Nothing is writable: WCE (writeback toggling) is not offered.
        log::debug!(
            "{}: ignored a {}-byte configuration write at {offset}",
            self.name,
            data.len()
        );
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        let Activation {
            memory,
            acked_features,
            mut queues,
            interrupt,
        } = activation;
        let given = queues.iter().filter(|q| q.is_some()).count();
        let Some(Some(ActiveQueue { mut queue, kick })) =
            (queues.len() == 1).then(|| queues.pop()).flatten()
        else {
            return Err(ActivateError::QueueCount {
                device: DEVICE,
                given,
                needed: 1,
            });
        };
        let io = match self.worker.take_idle() {
            Ok(io) => io,
            Err(NotIdle::Failed) => {
                return Err(ActivateError::Device {
                    device: DEVICE,
                    message: format!("{}: failed earlier, cannot serve", self.name),
                })
            }
            Err(NotIdle::Active) => {
                return Err(ActivateError::Device {
                    device: DEVICE,
                    message: format!("{}: already active", self.name),
                })
            }
        };
        queue.set_event_idx(acked_features & (1u64 << VIRTIO_RING_F_EVENT_IDX) != 0);
        // The worker serves what a restored driver already made available as it starts.
        let handler = BlockHandler::new(io, memory, queue, kick, Arc::clone(&interrupt));
        self.worker
            .start(handler)
            .map_err(|error| ActivateError::thread(DEVICE, error))?;
        self.interrupt = Some(interrupt);
        Ok(())
    }

    fn reset(&mut self) {
        self.quiesce_worker();
        self.worker.reset(BlockHandler::into_resources);
        self.interrupt = None;
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        self.quiesce_worker();
        let positions = match self.worker.pause() {
            Some(handler) => vec![Some(handler.position())],
            None => Vec::new(),
        };
        // Paused or idle: read directly, no thread is stopped. A failed device's limiter
        // is gone with its thread: its buckets restore full.
        self.buckets_at_pause = self
            .worker
            .change(|held| match held {
                Held::Idle(io) => io.rate_limiter.save(),
                Held::Handler(handler) => handler.io.rate_limiter.save(),
            })
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        positions
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        self.worker
            .resume()
            .map_err(|error| ActivateError::thread(DEVICE, error))
    }

    fn save_state(&self) -> Result<DeviceState, DeviceStateError> {
        Ok(DeviceState::Block(Persist::save(self)?))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            DeviceState::Block(state) => Ok(Persist::restore(self, state)?),
            other => Err(DeviceStateError::wrong_kind(&self.name, "block", other)),
        }
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl Persist for Block {
    type State = BlockState;
    type Error = BlockStateError;

    fn save(&self) -> Result<BlockState, BlockStateError> {
        Ok(BlockState {
            drive_id: self.config.drive_id.clone(),
            path: self.config.path.clone(),
            read_only: self.config.read_only,
            serial: self.config.serial.clone(),
            capacity_sectors: self.capacity_sectors,
            buckets: self.buckets_at_pause,
        })
    }

    /// The device keeps the file it was built with (the VMM may point a restored drive at a
    /// copy of the image); it must have the snapshot's size and mode. The guest-visible ID
    /// is the snapshot's, and the rate limiter's buckets go on where they stood.
    fn restore(&mut self, state: &BlockState) -> Result<(), BlockStateError> {
        let name = self.name.clone();
        let device = || name.clone();
        if state.read_only != self.config.read_only {
            return Err(BlockStateError::Mode {
                device: device(),
                saved: state.read_only,
                now: self.config.read_only,
            });
        }
        if state.capacity_sectors != self.capacity_sectors {
            return Err(BlockStateError::Capacity {
                device: device(),
                path: self.config.path.clone(),
                now: self.capacity_sectors,
                saved_path: state.path.clone(),
                saved: state.capacity_sectors,
            });
        }
        state
            .buckets
            .check()
            .map_err(|source| BlockStateError::Buckets {
                device: device(),
                source,
            })?;
        let mut config = self.config.clone();
        config.serial = state.serial.clone();
        config
            .validate()
            .map_err(|source| BlockStateError::Serial {
                device: device(),
                source,
            })?;
        if state.path != self.config.path {
            log::info!(
                "{}: restoring with {} (the snapshot's drive was {})",
                self.name,
                self.config.path.display(),
                state.path.display()
            );
        }
        let id = config.device_id();
        let buckets = state.buckets;
        self.with_resources(|io| {
            io.device_id = id;
            io.rate_limiter.restore(&buckets)
        })
        .map_err(|source| BlockStateError::Unavailable {
            device: device(),
            source,
        })?
        .map_err(|source| BlockStateError::Buckets {
            device: device(),
            source,
        })?;
        self.config.serial = state.serial.clone();
        Ok(())
    }
}
