//! [`Net`]: the virtio-net device the transport drives.

use std::sync::Arc;

use serde::Deserialize as _;
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
use crate::device::{ActivateError, Activation, QueuePosition, VirtioDevice};
use crate::rate_limiter::{RateLimiter, RateLimiterConfig};
use crate::worker::Worker;

/// The I/O thread's name (at most 15 bytes show in /proc).
pub const WORKER_NAME: &str = "virtio-net";
/// The control queue's size: the driver sends one command at a time.
pub const CONTROL_QUEUE_SIZE: u16 = 64;
const CONFIG_LEN: usize = std::mem::size_of::<virtio_net_config>();

enum State {
    /// Not activated (or reset): the taps and limiters wait here.
    Idle {
        taps: Vec<Tap>,
        rx_limiter: RateLimiter,
        tx_limiter: RateLimiter,
    },
    Active(Worker<NetHandler>),
    Paused(NetHandler),
    /// The I/O thread panicked or could not start and took the taps with it.
    Broken,
}

/// What a snapshot keeps of the device (the taps are the VMM's to give again on restore).
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NetState {
    mac: MacAddr,
    num_queue_pairs: u16,
    /// Set by the driver with VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET.
    active_queue_pairs: u16,
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
    state: State,
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
        Ok(Net {
            name: format!("virtio-net {}", config.iface_id),
            mac: config.mac(),
            config,
            counters: Arc::new(NetCounters::default()),
            active_pairs: 1,
            state: State::Idle {
                taps,
                rx_limiter,
                tx_limiter,
            },
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
        match std::mem::replace(&mut self.state, State::Broken) {
            State::Idle {
                taps,
                mut rx_limiter,
                mut tx_limiter,
            } => {
                let result = update(&mut rx_limiter, &mut tx_limiter);
                self.state = State::Idle {
                    taps,
                    rx_limiter,
                    tx_limiter,
                };
                result?;
            }
            State::Paused(mut handler) => {
                let result = update(&mut handler.rx_limiter, &mut handler.tx_limiter);
                self.state = State::Paused(handler);
                result?;
            }
            State::Active(worker) => {
                // The worker owns the limiters: stop it, update, start it again (it resumes
                // every queue where it stood).
                let Some(mut handler) = worker.stop() else {
                    return Err(NetError::Broken(self.name.clone()));
                };
                let result = update(&mut handler.rx_limiter, &mut handler.tx_limiter);
                self.state =
                    State::Active(Worker::spawn(WORKER_NAME, handler).map_err(NetError::Thread)?);
                result?;
            }
            State::Broken => return Err(NetError::Broken(self.name.clone())),
        }
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
            device: "virtio-net",
            message: format!("{}: {message}", self.name),
        }
    }

    /// Takes the handler back from wherever it is, for a reset.
    fn stop(&mut self) -> Option<NetHandler> {
        match std::mem::replace(&mut self.state, State::Broken) {
            State::Active(worker) => {
                let handler = worker.stop();
                if handler.is_none() {
                    log::error!("{}: its I/O thread panicked; the taps are gone", self.name);
                }
                handler
            }
            State::Paused(handler) => Some(handler),
            idle @ State::Idle { .. } => {
                self.state = idle;
                None
            }
            State::Broken => None,
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
        data.fill(0);
        let space = self.config_space();
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        if let Some(bytes) = space.get(start..) {
            let n = bytes.len().min(data.len());
            data[..n].copy_from_slice(&bytes[..n]);
        }
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
        let (taps, rx_limiter, tx_limiter) =
            match std::mem::replace(&mut self.state, State::Broken) {
                State::Idle {
                    taps,
                    rx_limiter,
                    tx_limiter,
                } => (taps, rx_limiter, tx_limiter),
                State::Broken => {
                    return Err(self
                        .error("its taps were lost with its I/O thread; re-add the device".into()))
                }
                other => {
                    self.state = other;
                    return Err(self.error("activated twice without a reset".into()));
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
            self.state = State::Idle {
                taps,
                rx_limiter,
                tx_limiter,
            };
            return Err(ActivateError::QueueCount {
                device: "virtio-net",
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
        let queue_pairs: Vec<QueuePair> = taps
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
                QueuePair::new(tap, index, rx, tx)
            })
            .collect();
        let mut handler = NetHandler::new(
            &self.name,
            memory,
            interrupt,
            queue_pairs,
            ctrl,
            queue_count,
            (rx_limiter, tx_limiter),
            Arc::clone(&self.counters),
        );
        if !handler.set_active_pairs(self.active_pairs.min(usable_pairs)) {
            handler.set_active_pairs(1);
        }
        match Worker::spawn(WORKER_NAME, handler) {
            Ok(worker) => {
                self.state = State::Active(worker);
                Ok(())
            }
            Err(source) => {
                log::error!(
                    "{}: cannot start its I/O thread; the taps are closed",
                    self.name
                );
                Err(ActivateError::Thread {
                    device: "virtio-net",
                    source: source.into(),
                })
            }
        }
    }

    fn reset(&mut self) {
        let Some(handler) = self.stop() else {
            return;
        };
        let NetHandler {
            pairs,
            rx_limiter,
            tx_limiter,
            ..
        } = handler;
        self.state = State::Idle {
            taps: pairs.into_iter().map(|pair| pair.tap).collect(),
            rx_limiter,
            tx_limiter,
        };
        self.active_pairs = 1;
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        match std::mem::replace(&mut self.state, State::Broken) {
            State::Active(worker) => {
                let Some(mut handler) = worker.stop() else {
                    log::error!("{}: its I/O thread panicked", self.name);
                    return Vec::new();
                };
                handler.release_held_frames();
                self.active_pairs = handler.active_pairs();
                let positions = handler.positions();
                self.state = State::Paused(handler);
                positions
            }
            State::Paused(handler) => {
                let positions = handler.positions();
                self.state = State::Paused(handler);
                positions
            }
            other => {
                self.state = other;
                Vec::new()
            }
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        match std::mem::replace(&mut self.state, State::Broken) {
            State::Paused(handler) => {
                let worker = Worker::spawn(WORKER_NAME, handler).map_err(|source| {
                    ActivateError::Thread {
                        device: "virtio-net",
                        source: source.into(),
                    }
                })?;
                self.state = State::Active(worker);
                Ok(())
            }
            other => {
                self.state = other;
                Ok(())
            }
        }
    }

    fn save_state(&self) -> serde_json::Value {
        let active_queue_pairs = match &self.state {
            State::Paused(handler) => handler.active_pairs(),
            _ => self.active_pairs,
        };
        let state = NetState {
            mac: self.mac,
            num_queue_pairs: self.queue_pairs(),
            active_queue_pairs,
        };
        serde_json::to_value(state).unwrap_or_default()
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), String> {
        let state = NetState::deserialize(state)
            .map_err(|error| format!("{}: bad state: {error}", self.name))?;
        if state.num_queue_pairs != self.queue_pairs() {
            return Err(format!(
                "{}: the snapshot has {} queue pairs, this device {}",
                self.name,
                state.num_queue_pairs,
                self.queue_pairs()
            ));
        }
        if !(1..=state.num_queue_pairs).contains(&state.active_queue_pairs) {
            return Err(format!(
                "{}: the snapshot's {} active queue pairs are not within 1..={}",
                self.name, state.active_queue_pairs, state.num_queue_pairs
            ));
        }
        // The guest knows the device by the MAC it read before the snapshot.
        self.mac = state.mac;
        self.active_pairs = state.active_queue_pairs;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixDatagram;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use virtio_bindings::virtio_net::{
        VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, VIRTIO_NET_ERR, VIRTIO_NET_OK,
    };
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    use super::super::datapath::tests::{
        active_queue, add_chain, descriptor, frame, memory, used, DATA,
    };
    use super::super::VNET_HDR_LEN;
    use crate::device::ActiveQueue;
    use crate::{GuestMemory, VirtioInterrupt};

    #[derive(Default)]
    pub(crate) struct Signals(pub Mutex<Vec<u16>>);

    impl VirtioInterrupt for Signals {
        fn signal_queue(&self, queue_index: u16) -> std::io::Result<()> {
            self.0.lock().unwrap().push(queue_index);
            Ok(())
        }
        fn signal_config(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn stand_in_taps(count: usize) -> (Vec<Tap>, Vec<UnixDatagram>) {
        (0..count)
            .map(|_| {
                let (ours, peer) = UnixDatagram::pair().unwrap();
                peer.set_nonblocking(true).unwrap();
                (Tap::stand_in(OwnedFd::from(ours)), peer)
            })
            .unzip()
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn mac_of(net: &Net) -> [u8; 6] {
        let mut mac = [0u8; 6];
        net.read_config(0, &mut mac);
        mac
    }

    #[test]
    fn config_space_layout() {
        let mut config = NetConfig::new("eth0", None);
        config.guest_mac = Some("06:11:22:33:44:55".parse().unwrap());
        config.num_queue_pairs = 3;
        let (taps, _peers) = stand_in_taps(3);
        let net = Net::new(config, taps).unwrap();
        let mut space = [0xffu8; 12];
        net.read_config(0, &mut space);
        assert_eq!(
            space,
            [0x06, 0x11, 0x22, 0x33, 0x44, 0x55, 1, 0, 3, 0, 0, 0],
            "mac, status LINK_UP (le16), max_virtqueue_pairs (le16), mtu"
        );
        let mut status = [0u8; 2];
        net.read_config(6, &mut status);
        assert_eq!(u16::from_le_bytes(status), VIRTIO_NET_S_LINK_UP as u16);
        let mut past = [0xffu8; 4];
        net.read_config(CONFIG_LEN as u64 - 2, &mut past);
        assert_eq!(past, [0; 4], "bytes past the end read as zero");
        net.read_config(u64::MAX, &mut past);
        assert_eq!(past, [0; 4]);
        assert_eq!(net.device_type(), 1);
        assert_eq!(
            net.queue_max_sizes(),
            vec![256, 256, 256, 256, 256, 256, CONTROL_QUEUE_SIZE]
        );
        let features = net.device_features();
        for feature in [
            VIRTIO_NET_F_MAC,
            VIRTIO_NET_F_STATUS,
            VIRTIO_NET_F_MQ,
            VIRTIO_NET_F_CTRL_VQ,
        ] {
            assert_ne!(features & (1 << feature), 0, "feature {feature}");
        }
    }

    #[test]
    fn single_pair_offers_no_control_queue_and_ignores_config_writes() {
        let (taps, _peers) = stand_in_taps(1);
        let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
        assert_eq!(net.queue_max_sizes(), vec![256, 256]);
        assert_eq!(
            net.device_features(),
            (1 << VIRTIO_NET_F_MAC) | (1 << VIRTIO_NET_F_STATUS)
        );
        let before = mac_of(&net);
        assert_eq!(before, MacAddr::derived_from("eth0").bytes());
        net.write_config(0, &[0x02, 0, 0, 0, 0, 1]);
        assert_eq!(mac_of(&net), before);
    }

    #[test]
    fn new_refuses_the_wrong_number_of_taps() {
        let mut config = NetConfig::new("eth0", None);
        config.num_queue_pairs = 2;
        let (taps, _peers) = stand_in_taps(1);
        assert!(matches!(
            Net::new(config, taps),
            Err(NetError::TapCount {
                expected: 2,
                given: 1,
                ..
            })
        ));
        assert!(matches!(
            Net::open(NetConfig::new("eth0", None)),
            Err(NetError::NoTapName { .. })
        ));
    }

    fn activation(
        memory: &GuestMemory,
        queues: Vec<Option<ActiveQueue>>,
        features: u64,
        signals: &Arc<Signals>,
    ) -> Activation {
        Activation {
            memory: memory.clone(),
            acked_features: features,
            queues,
            interrupt: signals.clone(),
        }
    }

    #[test]
    fn serves_frames_on_its_thread_pauses_resumes_and_resets() {
        let memory = memory();
        let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
        let txq = MockSplitQueue::create(&memory, GuestAddress(0x8000), 16);
        let (taps, peers) = stand_in_taps(1);
        let peer = &peers[0];
        let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
        let signals = Arc::new(Signals::default());

        // A frame the tap has before the guest posts any buffer waits in the tap.
        let mut datagram = vec![0u8; VNET_HDR_LEN];
        datagram.extend(frame(90, 4));
        peer.send(&datagram).unwrap();

        let rx = active_queue(&rxq);
        let rx_kick = rx.kick.try_clone().unwrap();
        let tx = active_queue(&txq);
        let tx_kick = tx.kick.try_clone().unwrap();
        net.activate(activation(&memory, vec![Some(rx), Some(tx)], 0, &signals))
            .unwrap();
        assert!(
            net.activate(activation(&memory, vec![], 0, &signals))
                .is_err(),
            "twice"
        );

        add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
        rx_kick.write(1).unwrap();
        wait_until("the RX frame", || used(&rxq).len() == 1);
        assert_eq!(used(&rxq)[0], (0, (VNET_HDR_LEN + 90) as u32));
        assert!(signals.0.lock().unwrap().contains(&0));

        memory
            .write_slice(&[0u8; VNET_HDR_LEN], GuestAddress(DATA + 0x1000))
            .unwrap();
        memory
            .write_slice(
                &frame(70, 8),
                GuestAddress(DATA + 0x1000 + VNET_HDR_LEN as u64),
            )
            .unwrap();
        add_chain(
            &txq,
            0,
            &[descriptor(DATA + 0x1000, (VNET_HDR_LEN + 70) as u32, false)],
        );
        tx_kick.write(1).unwrap();
        wait_until("the TX frame", || used(&txq).len() == 1);
        let mut buf = vec![0u8; 200];
        let n = peer.recv(&mut buf).unwrap();
        assert_eq!(&buf[VNET_HDR_LEN..n], &frame(70, 8)[..]);

        let positions = net.pause();
        assert_eq!(
            positions,
            vec![
                Some(QueuePosition {
                    next_avail: 1,
                    next_used: 1
                }),
                Some(QueuePosition {
                    next_avail: 1,
                    next_used: 1
                })
            ]
        );
        // Nothing is served while paused; everything is after resume, with no new kick.
        add_chain(&rxq, 1, &[descriptor(DATA + 0x2000, 2000, true)]);
        peer.send(&datagram).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(used(&rxq).len(), 1);
        let state = net.save_state();
        assert_eq!(state["active_queue_pairs"], 1);
        net.resume().unwrap();
        wait_until("the RX frame after resume", || used(&rxq).len() == 2);

        let stats = net.stats();
        assert_eq!(
            (
                stats.rx_packets,
                stats.rx_bytes,
                stats.tx_packets,
                stats.tx_bytes
            ),
            (2, 180, 1, 70)
        );

        // A reset gives the taps back: the device activates again.
        net.reset();
        assert!(net.pause().is_empty(), "not active");
        let rxq2 = MockSplitQueue::create(&memory, GuestAddress(0x10000), 16);
        let txq2 = MockSplitQueue::create(&memory, GuestAddress(0x18000), 16);
        let rx2 = active_queue(&rxq2);
        let rx2_kick = rx2.kick.try_clone().unwrap();
        net.activate(activation(
            &memory,
            vec![Some(rx2), Some(active_queue(&txq2))],
            0,
            &signals,
        ))
        .unwrap();
        add_chain(&rxq2, 0, &[descriptor(DATA + 0x3000, 2000, true)]);
        peer.send(&datagram).unwrap();
        rx2_kick.write(1).unwrap();
        wait_until("the RX frame after reset", || used(&rxq2).len() == 1);
        net.reset();
    }

    #[test]
    fn activation_without_the_first_pair_is_refused_and_keeps_the_taps() {
        let memory = memory();
        let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
        let (taps, _peers) = stand_in_taps(1);
        let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
        let signals = Arc::new(Signals::default());
        let error = net
            .activate(activation(
                &memory,
                vec![Some(active_queue(&rxq)), None],
                0,
                &signals,
            ))
            .unwrap_err();
        assert!(
            matches!(
                error,
                ActivateError::QueueCount {
                    given: 1,
                    needed: 2,
                    ..
                }
            ),
            "{error}"
        );
        net.activate(activation(
            &memory,
            vec![Some(active_queue(&rxq)), Some(active_queue(&rxq))],
            0,
            &signals,
        ))
        .unwrap();
        net.reset();
    }

    fn control_chain(
        memory: &GuestMemory,
        mock: &MockSplitQueue<GuestMemory>,
        slot: u16,
        addr: u64,
        command: &[u8],
    ) {
        memory.write_slice(command, GuestAddress(addr)).unwrap();
        memory
            .write_slice(&[0xaa], GuestAddress(addr + 0x100))
            .unwrap();
        add_chain(
            mock,
            slot,
            &[
                descriptor(addr, command.len() as u32, false),
                descriptor(addr + 0x100, 1, true),
            ],
        );
    }

    fn ack(memory: &GuestMemory, addr: u64) -> u8 {
        memory.read_obj(GuestAddress(addr + 0x100)).unwrap()
    }

    #[test]
    fn control_queue_sets_queue_pairs_and_refuses_the_rest() {
        let memory = memory();
        let mocks: Vec<_> = (0..5u64)
            .map(|i| MockSplitQueue::create(&memory, GuestAddress(i * 0x4000), 16))
            .collect();
        let (taps, _peers) = stand_in_taps(2);
        let mut config = NetConfig::new("eth0", None);
        config.num_queue_pairs = 2;
        let mut net = Net::new(config, taps).unwrap();
        net.restore_state(&serde_json::json!({
            "mac": "06:00:00:00:00:09", "num_queue_pairs": 2, "active_queue_pairs": 1
        }))
        .unwrap();
        assert_eq!(mac_of(&net), [6, 0, 0, 0, 0, 9]);

        let mq = 1u64 << VIRTIO_NET_F_MQ;
        let ctrl_vq = 1u64 << VIRTIO_NET_F_CTRL_VQ;
        let signals = Arc::new(Signals::default());
        let queues = mocks.iter().map(|m| Some(active_queue(m))).collect();
        net.activate(activation(&memory, queues, mq | ctrl_vq, &signals))
            .unwrap();
        let ctrl = &mocks[4];
        let (mq_class, set) = (
            VIRTIO_NET_CTRL_MQ as u8,
            VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8,
        );
        let base = DATA;
        control_chain(&memory, ctrl, 0, base, &[mq_class, set, 2, 0]);
        control_chain(&memory, ctrl, 2, base + 0x1000, &[mq_class, set, 3, 0]);
        control_chain(&memory, ctrl, 4, base + 0x2000, &[mq_class, set, 0, 0]);
        control_chain(&memory, ctrl, 6, base + 0x3000, &[0 /* RX mode */, 0, 1]);
        control_chain(&memory, ctrl, 8, base + 0x4000, &[mq_class]);
        // No writable byte for the ack at all.
        memory
            .write_slice(&[mq_class, set, 1, 0], GuestAddress(base + 0x5000))
            .unwrap();
        add_chain(ctrl, 10, &[descriptor(base + 0x5000, 4, false)]);
        // The worker makes a first pass over every queue when it starts; kick anyway.
        net.pause();
        net.resume().unwrap();
        wait_until("the control commands", || used(ctrl).len() == 6);
        assert_eq!(ack(&memory, base), VIRTIO_NET_OK as u8);
        for addr in [base + 0x1000, base + 0x2000, base + 0x3000, base + 0x4000] {
            assert_eq!(
                ack(&memory, addr),
                VIRTIO_NET_ERR as u8,
                "command at {addr:#x}"
            );
        }
        assert_eq!(used(ctrl)[0], (0, 1));
        assert_eq!(used(ctrl)[5], (10, 0));
        net.pause();
        assert_eq!(net.save_state()["active_queue_pairs"], 2);
        assert_eq!(net.pause().len(), 5);
        net.reset();
        assert_eq!(
            net.save_state()["active_queue_pairs"],
            1,
            "a reset goes back to one pair"
        );
    }

    #[test]
    fn control_queue_is_queue_two_without_mq() {
        let memory = memory();
        let mocks: Vec<_> = (0..3u64)
            .map(|i| MockSplitQueue::create(&memory, GuestAddress(i * 0x4000), 16))
            .collect();
        let (taps, _peers) = stand_in_taps(2);
        let mut config = NetConfig::new("eth0", None);
        config.num_queue_pairs = 2;
        let mut net = Net::new(config, taps).unwrap();
        let signals = Arc::new(Signals::default());
        let queues = mocks.iter().map(|m| Some(active_queue(m))).collect();
        net.activate(activation(
            &memory,
            queues,
            1 << VIRTIO_NET_F_CTRL_VQ,
            &signals,
        ))
        .unwrap();
        let set = [
            VIRTIO_NET_CTRL_MQ as u8,
            VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8,
            2,
            0,
        ];
        control_chain(&memory, &mocks[2], 0, DATA, &set);
        net.pause();
        net.resume().unwrap();
        wait_until("the control command", || used(&mocks[2]).len() == 1);
        assert_eq!(
            ack(&memory, DATA),
            VIRTIO_NET_ERR as u8,
            "pair 1 has no queues without MQ"
        );
        net.reset();
    }

    #[test]
    fn restore_refuses_state_that_does_not_fit() {
        let (taps, _peers) = stand_in_taps(1);
        let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
        let saved = net.save_state();
        assert_eq!(saved["mac"], MacAddr::derived_from("eth0").to_string());
        net.restore_state(&saved).unwrap();
        for bad in [
            serde_json::json!({"mac": "06:00:00:00:00:01", "num_queue_pairs": 2, "active_queue_pairs": 1}),
            serde_json::json!({"mac": "06:00:00:00:00:01", "num_queue_pairs": 1, "active_queue_pairs": 0}),
            serde_json::json!({"mac": "01:00:00:00:00:01", "num_queue_pairs": 1, "active_queue_pairs": 1}),
            serde_json::json!({"mac": "06:00:00:00:00:01", "num_queue_pairs": 1, "active_queue_pairs": 1, "x": 1}),
            serde_json::json!("nonsense"),
        ] {
            assert!(net.restore_state(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rate_limiters_update_while_running() {
        let memory = memory();
        let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
        let txq = MockSplitQueue::create(&memory, GuestAddress(0x8000), 16);
        let (taps, peers) = stand_in_taps(1);
        let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
        let signals = Arc::new(Signals::default());
        let rx = active_queue(&rxq);
        let rx_kick = rx.kick.try_clone().unwrap();
        net.activate(activation(
            &memory,
            vec![Some(rx), Some(active_queue(&txq))],
            0,
            &signals,
        ))
        .unwrap();
        let limited = RateLimiterConfig {
            bandwidth: None,
            ops: Some(crate::rate_limiter::TokenBucketConfig {
                size: 1,
                one_time_burst: 0,
                refill_time_ms: 100,
            }),
        };
        net.update_rate_limiters(limited, RateLimiterConfig::default())
            .unwrap();
        assert_eq!(net.config().rx_rate_limiter, limited);
        for slot in 0..3 {
            add_chain(
                &rxq,
                slot,
                &[descriptor(DATA + u64::from(slot) * 0x1000, 2000, true)],
            );
        }
        let mut datagram = vec![0u8; VNET_HDR_LEN];
        datagram.extend(frame(64, 1));
        let start = Instant::now();
        for _ in 0..3 {
            peers[0].send(&datagram).unwrap();
        }
        rx_kick.write(1).unwrap();
        wait_until("three rate-limited frames", || used(&rxq).len() == 3);
        // One op per 100 ms: the second and third frames wait about 100 ms each.
        assert!(
            start.elapsed() >= Duration::from_millis(150),
            "{:?}",
            start.elapsed()
        );
        net.reset();
    }
}
