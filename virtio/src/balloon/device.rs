//! [`Balloon`]: the virtio memory balloon [`VirtioDevice`].

use std::sync::{Arc, Mutex};

use vmm_sys_util::timerfd::TimerFd;

use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;

use super::handler::{BalloonHandler, Shared};
use super::{
    BalloonConfig, BalloonError, GuestStats, DEVICE_NAME, QUEUE_MAX_SIZE, THREAD_NAME,
    VIRTIO_BALLOON_F_DEFLATE_ON_OOM, VIRTIO_BALLOON_F_STATS_VQ,
};
use crate::device::{
    ActivateError, Activation, DeviceState, DeviceStateError, QueuePosition, VirtioDevice,
    VirtioInterrupt,
};
use crate::worker::{duplicate_timer, ChangeError, DeviceWorker, Held};
use gpuvm_devices::Persist;

/// Bytes of the configuration space served: num_pages and actual (the free-page-hint and
/// poison fields belong to features not offered).
const CONFIG_SIZE: usize = 8;

/// The device's own snapshot state; the acked features are the transport's.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonState {
    pub target_pages: u32,
    pub actual_pages: u32,
    pub stats_polling_interval_s: u16,
    #[serde(default, with = "stats_by_tag_text")]
    pub stats: Option<GuestStats>,
    /// The statistics buffer the device held for its next request (the guest waits for it).
    #[serde(default)]
    pub held_stats_head: Option<u16>,
    #[serde(default)]
    pub counters: BalloonCounters,
}

/// The statistics as a JSON object keyed by tag: written as serde writes any map (tags as
/// text), read through text keys, because the state file's device list is read through a
/// flattened struct whose buffering cannot turn a text key back into a number.
mod stats_by_tag_text {
    use std::collections::BTreeMap;

    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::GuestStats;

    pub fn serialize<S: Serializer>(stats: &Option<GuestStats>, out: S) -> Result<S::Ok, S::Error> {
        stats.serialize(out)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        input: D,
    ) -> Result<Option<GuestStats>, D::Error> {
        let Some(text) = Option::<BTreeMap<String, u64>>::deserialize(input)? else {
            return Ok(None);
        };
        text.into_iter()
            .map(|(tag, value)| {
                tag.parse::<u16>().map(|tag| (tag, value)).map_err(|_| {
                    D::Error::custom(format!("balloon statistic tag {tag:?} is not a number"))
                })
            })
            .collect::<Result<GuestStats, _>>()
            .map(Some)
    }
}

/// Why a balloon's state was refused.
#[derive(Debug, thiserror::Error)]
pub enum BalloonStateError {
    #[error("{DEVICE_NAME}: the saved state has statistics {} but the device was built with them {}", on_off(*saved), on_off(*built))]
    Statistics { saved: bool, built: bool },
    #[error("{DEVICE_NAME}: the saved statistics buffer {head} is past the queue's end")]
    StatsHead { head: u16 },
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// What the device did with the guest's requests since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BalloonCounters {
    /// Pages the guest inflated and the host freed.
    pub inflated_pages: u64,
    pub deflated_pages: u64,
    /// PFNs refused for not being guest RAM.
    pub refused_pfns: u64,
    /// Buffers refused whole (too large, not whole PFNs or stats entries, unreadable).
    pub refused_buffers: u64,
    /// Runs whose host memory could not be freed (madvise failed).
    pub discard_errors: u64,
}

/// What GET /balloon/statistics reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalloonReport {
    pub target_pages: u32,
    pub actual_pages: u32,
    /// The last statistics the guest sent (None before the first).
    pub stats: Option<GuestStats>,
    pub counters: BalloonCounters,
}

/// The virtio memory balloon.
pub struct Balloon {
    config: BalloonConfig,
    target_pages: u32,
    actual_pages: u32,
    shared: Arc<Mutex<Shared>>,
    /// The transport's interrupt while active: a new target raises a configuration change.
    interrupt: Option<Arc<dyn VirtioInterrupt>>,
    /// A restored statistics buffer the next activation holds.
    restored_stats_head: Option<u16>,
    /// The statistics timer, created with the device (activation runs on a vCPU thread,
    /// which may not create timers); each activation's handler gets a duplicate.
    stats_timer: TimerFd,
    worker: DeviceWorker<(), BalloonHandler>,
}

impl Balloon {
    pub fn new(config: BalloonConfig) -> Result<Balloon, BalloonError> {
        let stats_timer = TimerFd::new().map_err(|e| BalloonError::Timer(e.into()))?;
        Ok(Balloon {
            target_pages: config.target_pages(),
            actual_pages: 0,
            shared: Arc::new(Mutex::new(Shared::new(config.stats_polling_interval_s))),
            interrupt: None,
            restored_stats_head: None,
            stats_timer,
            worker: DeviceWorker::new(DEVICE_NAME, THREAD_NAME, ()),
            config,
        })
    }

    /// The configuration, with the target and polling interval in force.
    pub fn config(&self) -> &BalloonConfig {
        &self.config
    }

    fn stats_offered(&self) -> bool {
        self.config.stats_polling_interval_s > 0
    }

    /// A new target; a driver that is running is told through a configuration change.
    pub fn set_target_mib(&mut self, amount_mib: u32) {
        self.config.amount_mib = amount_mib;
        self.target_pages = self.config.target_pages();
        if let Some(interrupt) = &self.interrupt {
            if let Err(error) = interrupt.signal_config() {
                log::error!("{DEVICE_NAME}: cannot signal the new target: {error}");
            }
        }
    }

    /// A new statistics polling interval; statistics cannot be turned on or off (the stats
    /// queue is offered, or not, when the device is built).
    pub fn set_stats_interval(&mut self, interval_s: u16) -> Result<(), BalloonError> {
        match (self.stats_offered(), interval_s > 0) {
            (false, true) => {
                return Err(BalloonError::StatsToggle {
                    state: "off",
                    wanted: "on",
                })
            }
            (true, false) => {
                return Err(BalloonError::StatsToggle {
                    state: "on",
                    wanted: "off",
                })
            }
            _ => {}
        }
        crate::lock(&self.shared).interval_s = interval_s;
        let changed = self.worker.change(|held| {
            if let Held::Handler(handler) = held {
                handler.rearm_stats_timer(true);
            }
        });
        match changed {
            Ok(()) => {}
            Err(ChangeError::Failed) => return Err(BalloonError::Failed),
            Err(ChangeError::Restart(error)) => return Err(BalloonError::Thread(error)),
        }
        self.config.stats_polling_interval_s = interval_s;
        Ok(())
    }

    /// Target, actual, the guest's last statistics and the device's counters.
    pub fn report(&self) -> BalloonReport {
        let shared = crate::lock(&self.shared);
        BalloonReport {
            target_pages: self.target_pages,
            actual_pages: self.actual_pages,
            stats: shared.stats.clone(),
            counters: shared.counters,
        }
    }

    fn config_bytes(&self) -> [u8; CONFIG_SIZE] {
        let mut bytes = [0u8; CONFIG_SIZE];
        bytes[..4].copy_from_slice(&self.target_pages.to_le_bytes());
        bytes[4..].copy_from_slice(&self.actual_pages.to_le_bytes());
        bytes
    }
}

impl VirtioDevice for Balloon {
    fn name(&self) -> &str {
        DEVICE_NAME
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        let queues = if self.stats_offered() { 3 } else { 2 };
        vec![QUEUE_MAX_SIZE; queues]
    }

    fn device_features(&self) -> u64 {
        let mut features = 0;
        if self.stats_offered() {
            features |= 1 << VIRTIO_BALLOON_F_STATS_VQ;
        }
        if self.config.deflate_on_oom {
            features |= 1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM;
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::read_config_bytes(&self.config_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` (bytes 4..8) is the driver's; writes elsewhere are ignored.
        let mut bytes = self.config_bytes();
        let Some(end) = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(data.len()))
        else {
            return;
        };
        if offset < 4 || end > CONFIG_SIZE {
            log::debug!(
                "{DEVICE_NAME}: ignoring a {}-byte write at {offset:#x} of its configuration space",
                data.len()
            );
            return;
        }
        bytes[offset as usize..end].copy_from_slice(data);
        let mut actual = [0u8; 4];
        actual.copy_from_slice(&bytes[4..]);
        self.actual_pages = u32::from_le_bytes(actual);
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        self.reset();
        let stats_acked = activation.acked_features & (1 << VIRTIO_BALLOON_F_STATS_VQ) != 0;
        let given = activation.queues.iter().filter(|q| q.is_some()).count();
        let needed = if stats_acked { 3 } else { 2 };
        let mut queues = activation.queues.into_iter();
        let (Some(Some(inflate)), Some(Some(deflate))) = (queues.next(), queues.next()) else {
            return Err(ActivateError::QueueCount {
                device: DEVICE_NAME,
                given,
                needed,
            });
        };
        let stats = if stats_acked {
            match queues.next() {
                Some(Some(stats)) => Some(stats),
                _ => {
                    return Err(ActivateError::QueueCount {
                        device: DEVICE_NAME,
                        given,
                        needed,
                    })
                }
            }
        } else {
            None
        };
        let stats_timer =
            duplicate_timer(&self.stats_timer).map_err(|error| ActivateError::Device {
                device: DEVICE_NAME,
                message: format!("cannot use its statistics timer: {error}"),
            })?;
        let _ = self.worker.take_idle();
        let handler = BalloonHandler::new(
            [Some(inflate), Some(deflate), stats],
            activation.memory,
            activation.interrupt.clone(),
            self.shared.clone(),
            stats_timer,
            self.restored_stats_head.take(),
        );
        self.interrupt = Some(activation.interrupt);
        self.worker
            .start(handler)
            .map_err(|error| ActivateError::thread(DEVICE_NAME, error))
    }

    fn reset(&mut self) {
        self.interrupt = None;
        self.worker.reset(|_| ());
        // A device whose thread failed comes back idle: it holds nothing it could lose.
        let _ = self.worker.take_idle();
        self.worker.set_idle(());
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        let was_running = self.worker.is_running();
        match self.worker.pause() {
            Some(handler) => handler.positions(),
            None if was_running => vec![None; 3],
            None => Vec::new(),
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        self.worker
            .resume()
            .map_err(|error| ActivateError::thread(DEVICE_NAME, error))
    }

    fn save_state(&self) -> Result<DeviceState, DeviceStateError> {
        Ok(DeviceState::Balloon(Persist::save(self)?))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            DeviceState::Balloon(state) => Ok(Persist::restore(self, state)?),
            other => Err(DeviceStateError::wrong_kind(DEVICE_NAME, "balloon", other)),
        }
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl Persist for Balloon {
    type State = BalloonState;
    type Error = BalloonStateError;

    fn save(&self) -> Result<BalloonState, BalloonStateError> {
        let shared = crate::lock(&self.shared);
        Ok(BalloonState {
            target_pages: self.target_pages,
            actual_pages: self.actual_pages,
            stats_polling_interval_s: self.config.stats_polling_interval_s,
            stats: shared.stats.clone(),
            held_stats_head: self.worker.paused().and_then(|h| h.held_stats_head()),
            counters: shared.counters,
        })
    }

    fn restore(&mut self, state: &BalloonState) -> Result<(), BalloonStateError> {
        if (state.stats_polling_interval_s > 0) != self.stats_offered() {
            return Err(BalloonStateError::Statistics {
                saved: state.stats_polling_interval_s > 0,
                built: self.stats_offered(),
            });
        }
        if let Some(head) = state.held_stats_head.filter(|&head| head >= QUEUE_MAX_SIZE) {
            return Err(BalloonStateError::StatsHead { head });
        }
        self.target_pages = state.target_pages;
        self.config.amount_mib = state.target_pages / super::PAGES_PER_MIB;
        self.actual_pages = state.actual_pages;
        self.config.stats_polling_interval_s = state.stats_polling_interval_s;
        self.restored_stats_head = state.held_stats_head;
        let mut shared = crate::lock(&self.shared);
        shared.interval_s = state.stats_polling_interval_s;
        shared.stats = state.stats.clone();
        shared.counters = state.counters;
        Ok(())
    }
}
