//! [`Net`]: the virtio-net device the transport drives.

use std::sync::Arc;

use gpuvm_devices::Persist;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{
    virtio_net_config, VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ,
    VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP,
};

use super::config::{MacAddr, NetConfig};
use super::datapath::{NetCounters, NetStats, QueuePair};
use super::handler::{ControlQueue, NetHandler};
use super::tap::Tap;
use super::NetError;
use crate::device::{
    ActivateError, Activation, DeviceState, DeviceStateError, QueuePosition, VirtioDevice,
};
use crate::rate_limiter::{
    RateLimiter, RateLimiterConfig, RateLimiterState, RateLimiterStateError,
};
use crate::worker::{ChangeError, DeviceWorker, Held, NotIdle};

const DEVICE: &str = "virtio-net";
/// The I/O thread's name (at most 15 bytes show in /proc).
pub const WORKER_NAME: &str = "virtio-net";
/// The control queue's size: the driver sends one command at a time.
pub const CONTROL_QUEUE_SIZE: u16 = 64;
const CONFIG_LEN: usize = std::mem::size_of::<virtio_net_config>();

/// What waits for the driver while the device is not active.
struct IdleResources {
    taps: Vec<Tap>,
    rx_limiter: RateLimiter,
    tx_limiter: RateLimiter,
}

impl From<NetHandler> for IdleResources {
    fn from(handler: NetHandler) -> Self {
        let NetHandler {
            pairs,
            rx_limiter,
            tx_limiter,
            ..
        } = handler;
        IdleResources {
            taps: pairs.into_iter().map(|pair| pair.tap).collect(),
            rx_limiter,
            tx_limiter,
        }
    }
}

/// What a snapshot keeps of the device (the taps are the VMM's to give again on restore).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {
    pub mac: MacAddr,
    pub num_queue_pairs: u16,
    /// Set by the driver with VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET.
    pub active_queue_pairs: u16,
    /// The receive limiter's buckets at the pause (absent in version-1 state files:
    /// they start full).
    #[serde(default)]
    pub rx_buckets: RateLimiterState,
    /// The transmit limiter's.
    #[serde(default)]
    pub tx_buckets: RateLimiterState,
}

/// Why a network device's state was refused.
#[derive(Debug, thiserror::Error)]
pub enum NetStateError {
    #[error("{device}: the snapshot has {saved} queue pairs, this device {now}")]
    QueuePairs {
        device: String,
        saved: u16,
        now: u16,
    },
    #[error("{device}: the snapshot's {active} active queue pairs are not within 1..={pairs}")]
    ActivePairs {
        device: String,
        active: u16,
        pairs: u16,
    },
    #[error("{device}: {direction}: {source}")]
    Buckets {
        device: String,
        direction: &'static str,
        source: RateLimiterStateError,
    },
    #[error("{0}: its I/O thread died and took its taps and limiters")]
    Broken(String),
    #[error("{device}: cannot restart its I/O thread: {source}")]
    Thread {
        device: String,
        source: crate::worker::WorkerError,
    },
}

/// A virtio-net device (type 1) over tap queues.
///
/// Features: VIRTIO_NET_F_MAC and VIRTIO_NET_F_STATUS (link always up); with more than one
/// queue pair also VIRTIO_NET_F_MQ and the VIRTIO_NET_F_CTRL_VQ it needs, whose only command
/// is VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET. No checksum or segmentation offloads and no
/// VIRTIO_NET_F_MRG_RXBUF: every frame fits one RX chain (the Linux driver then posts
/// buffers for a 1500-byte MTU, which is what a tap has unless told otherwise).
///
/// Queues: RX and TX of pair 0, of pair 1, ..., then the control queue.
pub struct Net {
    name: String,
    config: NetConfig,
    mac: MacAddr,
    counters: Arc<NetCounters>,
    /// The pairs the driver uses, kept across pause and snapshots; 1 after a reset.
    active_pairs: u16,
    /// The taps and limiters wait as its idle resources; if the I/O thread panicked or
    /// could not start, the taps are gone with it.
    worker: DeviceWorker<IdleResources, NetHandler>,
    /// The limiters' buckets (receive, transmit) as the last pause found them.
    buckets_at_pause: (RateLimiterState, RateLimiterState),
    /// The VM's MMDS, given by the VMM that built this device: at each activation its
    /// configuration says whether this interface answers MMDS.
    mmds: Option<Arc<gpuvm_mmds::Mmds>>,
}

impl Net {
    /// A device over `taps`, one queue each per pair (opened by [`Tap::open_queues`] or
    /// received as descriptors and checked by [`Tap::from_fd`]).
    pub fn new(config: NetConfig, taps: Vec<Tap>) -> Result<Net, NetError> {
        config.validate()?;
        if taps.len() != usize::from(config.num_queue_pairs) {
            return Err(NetError::TapCount {
                iface_id: config.iface_id.clone(),
                expected: config.num_queue_pairs,
                given: taps.len(),
            });
        }
        let rx_limiter = RateLimiter::new(config.rx_rate_limiter)?;
        let tx_limiter = RateLimiter::new(config.tx_rate_limiter)?;
        let name = format!("{DEVICE} {}", config.iface_id);
        let idle = IdleResources {
            taps,
            rx_limiter,
            tx_limiter,
        };
        Ok(Net {
            worker: DeviceWorker::new(name.clone(), WORKER_NAME, idle),
            name,
            mac: config.mac(),
            config,
            counters: Arc::new(NetCounters::default()),
            active_pairs: 1,
            buckets_at_pause: Default::default(),
            mmds: None,
        })
    }

    /// This device with the VM's MMDS (see [`gpuvm_mmds::Mmds::stack_for`]).
    pub fn with_mmds(mut self, mmds: Arc<gpuvm_mmds::Mmds>) -> Net {
        self.mmds = Some(mmds);
        self
    }

    /// A second descriptor of each tap queue, in queue-pair order, to hand the interface to
    /// another gpuvm process (a live update): the taps stay attached while both hold them,
    /// so a tap gpuvm created, or one a container runtime passed, goes on existing. The
    /// I/O thread stops between frames meanwhile, as for a rate-limit change.
    pub fn tap_descriptors(&mut self) -> Result<Vec<std::os::fd::OwnedFd>, NetError> {
        let clone = |taps: &mut dyn Iterator<Item = &Tap>| -> std::io::Result<Vec<_>> {
            taps.map(Tap::try_clone_fd).collect()
        };
        let cloned = self
            .worker
            .change(|held| match held {
                Held::Idle(idle) => clone(&mut idle.taps.iter()),
                Held::Handler(handler) => clone(&mut handler.pairs.iter().map(|pair| &pair.tap)),
            })
            .map_err(|error| match error {
                ChangeError::Failed => NetError::Broken(self.name.clone()),
                ChangeError::Restart(error) => NetError::Thread(error),
            })?;
        cloned.map_err(|source| NetError::Duplicate {
            iface_id: self.config.iface_id.clone(),
            source,
        })
    }

    /// A device over the tap `host_dev_name` names (created if missing and allowed).
    pub fn open(config: NetConfig) -> Result<Net, NetError> {
        config.validate()?;
        let Some(name) = config.host_dev_name.as_deref() else {
            return Err(NetError::NoTapName {
                iface_id: config.iface_id.clone(),
            });
        };
        let taps = Tap::open_queues(name, config.num_queue_pairs)?;
        Net::new(config, taps)
    }

    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    /// The MAC the guest sees.
    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    /// Frame, byte and drop counts so far.
    pub fn stats(&self) -> NetStats {
        self.counters.snapshot()
    }

    /// Changes the rate limits of a device, running or not (an API PATCH).
    pub fn update_rate_limiters(
        &mut self,
        rx: RateLimiterConfig,
        tx: RateLimiterConfig,
    ) -> Result<(), NetError> {
        rx.validate()?;
        tx.validate()?;
        let update = |rx_limiter: &mut RateLimiter, tx_limiter: &mut RateLimiter| {
            rx_limiter.update(rx)?;
            tx_limiter.update(tx)
        };
        // A running worker owns the limiters: it stops, they change, it starts again (and
        // resumes every queue where it stood).
        let updated = self
            .worker
            .change(|held| match held {
                Held::Idle(idle) => update(&mut idle.rx_limiter, &mut idle.tx_limiter),
                Held::Handler(handler) => update(&mut handler.rx_limiter, &mut handler.tx_limiter),
            })
            .map_err(|error| match error {
                ChangeError::Failed => NetError::Broken(self.name.clone()),
                ChangeError::Restart(error) => NetError::Thread(error),
            })?;
        updated?;
        self.config.rx_rate_limiter = rx;
        self.config.tx_rate_limiter = tx;
        Ok(())
    }

    fn queue_pairs(&self) -> u16 {
        self.config.num_queue_pairs
    }

    fn multi_queue(&self) -> bool {
        self.queue_pairs() > 1
    }

    fn config_space(&self) -> [u8; CONFIG_LEN] {
        let mut bytes = [0u8; CONFIG_LEN];
        let mut put = |offset: usize, value: &[u8]| {
            bytes[offset..offset + value.len()].copy_from_slice(value);
        };
        put(
            std::mem::offset_of!(virtio_net_config, mac),
            &self.mac.bytes(),
        );
        put(
            std::mem::offset_of!(virtio_net_config, status),
            &(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes(),
        );
        put(
            std::mem::offset_of!(virtio_net_config, max_virtqueue_pairs),
            &self.queue_pairs().to_le_bytes(),
        );
        bytes
    }

    fn error(&self, message: String) -> ActivateError {
        ActivateError::Device {
            device: DEVICE,
            message: format!("{}: {message}", self.name),
        }
    }
}

impl VirtioDevice for Net {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        let mut sizes = vec![self.config.queue_size; usize::from(self.queue_pairs()) * 2];
        if self.multi_queue() {
            sizes.push(CONTROL_QUEUE_SIZE);
        }
        sizes
    }

    fn device_features(&self) -> u64 {
        let mut features = (1u64 << VIRTIO_NET_F_MAC) | (1u64 << VIRTIO_NET_F_STATUS);
        if self.multi_queue() {
            features |= (1u64 << VIRTIO_NET_F_CTRL_VQ) | (1u64 << VIRTIO_NET_F_MQ);
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::read_config_bytes(&self.config_space(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Every field is read-only for a VERSION_1 driver (the MAC included: changing it
        // takes VIRTIO_NET_F_CTRL_MAC_ADDR, not offered).
        log::debug!(
            "{}: ignored a {}-byte config write at {offset:#x}",
            self.name,
            data.len()
        );
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        let idle = match self.worker.take_idle() {
            Ok(idle) => idle,
            Err(NotIdle::Failed) => {
                return Err(
                    self.error("its taps were lost with its I/O thread; re-add the device".into())
                )
            }
            Err(NotIdle::Active) => {
                return Err(self.error("activated twice without a reset".into()))
            }
        };
        let Activation {
            memory,
            acked_features,
            mut queues,
            interrupt,
        } = activation;
        let pairs_count = self.queue_pairs();
        let acked = |feature: u32| self.multi_queue() && acked_features & (1u64 << feature) != 0;
        let mq = acked(VIRTIO_NET_F_MQ);
        // Without MQ the driver uses pair 0 only and the control queue (if any) is queue 2.
        let usable_pairs = if mq { pairs_count } else { 1 };
        let enabled = (0..2)
            .filter(|&i| matches!(queues.get(i), Some(Some(_))))
            .count();
        if enabled < 2 {
            self.worker.set_idle(idle);
            return Err(ActivateError::QueueCount {
                device: DEVICE,
                given: enabled,
                needed: 2,
            });
        }
        let queue_count = queues.len();
        let mut take = |index: usize| queues.get_mut(index).and_then(Option::take);
        let ctrl = if acked(VIRTIO_NET_F_CTRL_VQ) {
            let index = usable_pairs * 2;
            take(usize::from(index)).map(|queue| ControlQueue { index, queue })
        } else {
            None
        };
        let queue_pairs: Vec<QueuePair> = idle
            .taps
            .into_iter()
            .enumerate()
            .map(|(index, tap)| {
                let index = index as u16;
                let (rx, tx) = if index < usable_pairs {
                    (
                        take(usize::from(index) * 2),
                        take(usize::from(index) * 2 + 1),
                    )
                } else {
                    (None, None)
                };
                let mut pair = QueuePair::new(tap, index, rx, tx);
                if index == 0 {
                    pair.mmds = self
                        .mmds
                        .as_ref()
                        .and_then(|mmds| mmds.stack_for(&self.config.iface_id));
                }
                pair
            })
            .collect();
        let mut handler = NetHandler::new(
            &self.name,
            memory,
            interrupt,
            queue_pairs,
            ctrl,
            queue_count,
            (idle.rx_limiter, idle.tx_limiter),
            Arc::clone(&self.counters),
        );
        if !handler.set_active_pairs(self.active_pairs.min(usable_pairs)) {
            handler.set_active_pairs(1);
        }
        self.worker.start(handler).map_err(|error| {
            log::error!(
                "{}: cannot start its I/O thread; the taps are closed",
                self.name
            );
            ActivateError::thread(DEVICE, error)
        })
    }

    fn reset(&mut self) {
        // A device that was not active keeps the pairs a restore asked for.
        if let Some(handler) = self.worker.stop() {
            self.worker.set_idle(handler.into());
            self.active_pairs = 1;
        }
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        let positions = match self.worker.pause() {
            Some(handler) => {
                handler.release_held_frames();
                self.active_pairs = handler.active_pairs();
                handler.positions()
            }
            None => Vec::new(),
        };
        // Paused or idle: read directly, no thread is stopped. A failed device's limiters
        // are gone with its thread: their buckets restore full.
        let save = |rx: &RateLimiter, tx: &RateLimiter| {
            (rx.save().unwrap_or_default(), tx.save().unwrap_or_default())
        };
        self.buckets_at_pause = self
            .worker
            .change(|held| match held {
                Held::Idle(idle) => save(&idle.rx_limiter, &idle.tx_limiter),
                Held::Handler(handler) => save(&handler.rx_limiter, &handler.tx_limiter),
            })
            .unwrap_or_default();
        positions
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        self.worker
            .resume()
            .map_err(|error| ActivateError::thread(DEVICE, error))
    }

    fn save_state(&self) -> Result<DeviceState, DeviceStateError> {
        Ok(DeviceState::Net(Persist::save(self)?))
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            DeviceState::Net(state) => Ok(Persist::restore(self, state)?),
            other => Err(DeviceStateError::wrong_kind(&self.name, "net", other)),
        }
    }
}

impl Persist for Net {
    type State = NetState;
    type Error = NetStateError;

    fn save(&self) -> Result<NetState, NetStateError> {
        let active_queue_pairs = self
            .worker
            .paused()
            .map_or(self.active_pairs, NetHandler::active_pairs);
        Ok(NetState {
            mac: self.mac,
            num_queue_pairs: self.queue_pairs(),
            active_queue_pairs,
            rx_buckets: self.buckets_at_pause.0,
            tx_buckets: self.buckets_at_pause.1,
        })
    }

    fn restore(&mut self, state: &NetState) -> Result<(), NetStateError> {
        if state.num_queue_pairs != self.queue_pairs() {
            return Err(NetStateError::QueuePairs {
                device: self.name.clone(),
                saved: state.num_queue_pairs,
                now: self.queue_pairs(),
            });
        }
        if !(1..=state.num_queue_pairs).contains(&state.active_queue_pairs) {
            return Err(NetStateError::ActivePairs {
                device: self.name.clone(),
                active: state.active_queue_pairs,
                pairs: state.num_queue_pairs,
            });
        }
        for (direction, buckets) in [("rx", &state.rx_buckets), ("tx", &state.tx_buckets)] {
            buckets.check().map_err(|source| NetStateError::Buckets {
                device: self.name.clone(),
                direction,
                source,
            })?;
        }
        let (rx, tx) = (state.rx_buckets, state.tx_buckets);
        let load = |rx_limiter: &mut RateLimiter, tx_limiter: &mut RateLimiter| {
            rx_limiter.restore(&rx).map_err(|source| ("rx", source))?;
            tx_limiter.restore(&tx).map_err(|source| ("tx", source))
        };
        let loaded = self
            .worker
            .change(|held| match held {
                Held::Idle(idle) => load(&mut idle.rx_limiter, &mut idle.tx_limiter),
                Held::Handler(handler) => load(&mut handler.rx_limiter, &mut handler.tx_limiter),
            })
            .map_err(|error| match error {
                ChangeError::Failed => NetStateError::Broken(self.name.clone()),
                ChangeError::Restart(source) => NetStateError::Thread {
                    device: self.name.clone(),
                    source,
                },
            })?;
        loaded.map_err(|(direction, source)| NetStateError::Buckets {
            device: self.name.clone(),
            direction,
            source,
        })?;
        // The guest knows the device by the MAC it read before the snapshot.
        self.mac = state.mac;
        self.active_pairs = state.active_queue_pairs;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
