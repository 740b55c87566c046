//! The transport driven through its registers the way Linux's virtio_pci_modern does,
//! with a fake device that records what it is handed.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::{config, MsiMessage, PciDevice, RecordedRoutes};
use gpuvm_devices::Persist;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::common_config::offsets::*;
use super::layout::*;
use super::*;
use crate::{ActivateError, Activation, QueuePosition, VirtioDevice, VirtioInterrupt};

const ACK: u8 = VIRTIO_CONFIG_S_ACKNOWLEDGE as u8;
const DRIVER: u8 = VIRTIO_CONFIG_S_DRIVER as u8;
const FEATURES_OK: u8 = VIRTIO_CONFIG_S_FEATURES_OK as u8;
const DRIVER_OK: u8 = VIRTIO_CONFIG_S_DRIVER_OK as u8;
const NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;
const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
/// Device-specific bits the fake device offers.
const FAKE_FEATURES: u64 = 1 << 0 | 1 << 5 | EVENT_IDX;
const MAX_SIZES: [u16; 3] = [256, 64, 16];
const BAR: u64 = 0xe000_0000;
const RAM: u64 = 0x10_0000;
const FIRST_GSI: u32 = 40;
const MSIX_ENABLE: u16 = 1 << 15;
const MSIX_FUNCTION_MASK: u16 = 1 << 14;

/// A queue as the device got it: size, desc, avail, used, next_avail, next_used, event_idx.
type QueueSeen = (u16, u64, u64, u64, u16, u16, bool);
/// Spoils a saved state in one way.
type Damage = Box<dyn Fn(&mut VirtioPciState)>;

/// One activation as the fake device saw it.
struct Activated {
    acked_features: u64,
    queues: Vec<Option<QueueSeen>>,
    kicks: Vec<Option<EventFd>>,
    interrupt: Arc<dyn VirtioInterrupt>,
}

#[derive(Default)]
struct Record {
    activations: Vec<Activated>,
    resets: usize,
    pauses: usize,
    resumes: usize,
    config: [u8; 8],
    restored: Option<crate::DeviceState>,
    /// How far the fake device "served" each queue before pausing.
    served: u16,
}

struct FakeDevice {
    record: Arc<Mutex<Record>>,
    fail_activate: bool,
    active: bool,
}

impl VirtioDevice for FakeDevice {
    fn name(&self) -> &str {
        "fake"
    }
    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        MAX_SIZES.to_vec()
    }
    fn device_features(&self) -> u64 {
        FAKE_FEATURES
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let record = self.record.lock().unwrap();
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = record.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut record = self.record.lock().unwrap();
        for (i, byte) in data.iter().enumerate() {
            if let Some(slot) = record.config.get_mut(offset as usize + i) {
                *slot = *byte;
            }
        }
    }
    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        if self.fail_activate {
            return Err(ActivateError::Device {
                device: "fake",
                message: "told to fail".into(),
            });
        }
        let queues = activation
            .queues
            .iter()
            .map(|q| {
                q.as_ref().map(|q| {
                    let queue = &q.queue;
                    (
                        queue.size(),
                        queue.desc_table(),
                        queue.avail_ring(),
                        queue.used_ring(),
                        queue.next_avail(),
                        queue.next_used(),
                        queue.event_idx_enabled(),
                    )
                })
            })
            .collect();
        let kicks = activation
            .queues
            .into_iter()
            .map(|q| q.map(|q| q.kick))
            .collect();
        self.record.lock().unwrap().activations.push(Activated {
            acked_features: activation.acked_features,
            queues,
            kicks,
            interrupt: activation.interrupt,
        });
        self.active = true;
        Ok(())
    }
    fn reset(&mut self) {
        self.active = false;
        self.record.lock().unwrap().resets += 1;
    }
    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        let mut record = self.record.lock().unwrap();
        record.pauses += 1;
        if !self.active {
            return Vec::new();
        }
        let served = record.served;
        let last = record.activations.last().unwrap();
        last.queues
            .iter()
            .map(|q| {
                q.map(|(_, _, _, _, avail, used, _)| QueuePosition {
                    next_avail: avail.wrapping_add(served),
                    next_used: used.wrapping_add(served),
                })
            })
            .collect()
    }
    fn resume(&mut self) -> Result<(), ActivateError> {
        self.record.lock().unwrap().resumes += 1;
        Ok(())
    }
    /// The fake keeps its 8 configuration bytes in a vsock state's one field.
    fn save_state(&self) -> Result<crate::DeviceState, crate::DeviceStateError> {
        Ok(crate::DeviceState::Vsock(crate::vsock::VsockState {
            guest_cid: u64::from_le_bytes(self.record.lock().unwrap().config),
        }))
    }
    fn restore_state(&mut self, state: &crate::DeviceState) -> Result<(), crate::DeviceStateError> {
        let crate::DeviceState::Vsock(fields) = state else {
            return Err(crate::DeviceStateError::wrong_kind("fake", "vsock", state));
        };
        let mut record = self.record.lock().unwrap();
        record.config = fields.guest_cid.to_le_bytes();
        record.restored = Some(state.clone());
        Ok(())
    }
}

/// ioeventfds as KVM would hold them: address → fd.
#[derive(Default)]
struct RecordedIoEvents {
    /// Address → (the registered descriptor's number, a clone to signal it as KVM would).
    fds: Mutex<BTreeMap<u64, (i32, EventFd)>>,
    refuse: Mutex<bool>,
}

impl RecordedIoEvents {
    fn signal(&self, address: u64) {
        self.fds.lock().unwrap()[&address].1.write(1).unwrap();
    }

    fn addresses(&self) -> Vec<u64> {
        self.fds.lock().unwrap().keys().copied().collect()
    }
}

impl IoEventRegistrar for RecordedIoEvents {
    fn register(&self, address: u64, fd: &EventFd) -> io::Result<()> {
        if *self.refuse.lock().unwrap() {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let mut fds = self.fds.lock().unwrap();
        if fds.contains_key(&address) {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        fds.insert(address, (fd.as_raw_fd(), fd.try_clone()?));
        Ok(())
    }
    fn unregister(&self, address: u64, fd: &EventFd) -> io::Result<()> {
        let mut fds = self.fds.lock().unwrap();
        match fds.get(&address) {
            Some((registered, _)) if *registered == fd.as_raw_fd() => {
                fds.remove(&address);
                Ok(())
            }
            _ => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        }
    }
}

struct Harness {
    transport: VirtioPciDevice,
    record: Arc<Mutex<Record>>,
    irqfds: Vec<EventFd>,
    routes: Arc<RecordedRoutes>,
    ioevents: Arc<RecordedIoEvents>,
}

fn memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap()
}

fn harness_with(fail_activate: bool) -> Harness {
    let record = Arc::new(Mutex::new(Record {
        config: [1, 2, 3, 4, 5, 6, 7, 8],
        ..Record::default()
    }));
    let device = FakeDevice {
        record: record.clone(),
        fail_activate,
        active: false,
    };
    harness_around(Box::new(device), record)
}

/// A transport around `device`, plugged at [`BAR`] and decoding; `record` is what a
/// [`FakeDevice`] writes to (left empty by another device).
fn harness_around(device: Box<dyn VirtioDevice>, record: Arc<Mutex<Record>>) -> Harness {
    let routes = Arc::new(RecordedRoutes::default());
    let ioevents = Arc::new(RecordedIoEvents::default());
    let mut irqfds = Vec::new();
    let mut allocate = |count: u32| -> io::Result<Vec<(u32, EventFd)>> {
        (0..count)
            .map(|i| {
                let fd = EventFd::new(EFD_NONBLOCK)?;
                irqfds.push(fd.try_clone()?);
                Ok((FIRST_GSI + i, fd))
            })
            .collect()
    };
    let mut transport = VirtioPciDevice::new(
        device,
        memory(),
        &mut allocate,
        routes.clone(),
        ioevents.clone(),
    )
    .unwrap();
    // What the root does at plug time.
    transport.set_bar_address(BAR_INDEX, BAR);
    transport.enable_memory_decoding();
    Harness {
        transport,
        record,
        irqfds,
        routes,
        ioevents,
    }
}

fn harness() -> Harness {
    harness_with(false)
}

/// Ring addresses of queue `q` in the 1 MiB of test RAM.
fn rings(queue: u16) -> (u64, u64, u64) {
    let base = 0x1_0000 * (u64::from(queue) + 1);
    (base, base + 0x4000, base + 0x8000)
}

impl Harness {
    fn read(&mut self, offset: u64, len: usize) -> u64 {
        let mut data = vec![0u8; len];
        self.transport.bar_read(BAR_INDEX, offset, &mut data);
        gpuvm_devices::pci::le_value(&data)
    }

    fn write(&mut self, offset: u64, value: u64, len: usize) {
        self.transport
            .bar_write(BAR_INDEX, offset, &value.to_le_bytes()[..len]);
    }

    fn config_read(&mut self, offset: u16, len: usize) -> u64 {
        let mut data = vec![0u8; len];
        self.transport.config_read(offset, &mut data);
        gpuvm_devices::pci::le_value(&data)
    }

    fn config_write(&mut self, offset: u16, value: u64, len: usize) {
        self.transport
            .config_write(offset, &value.to_le_bytes()[..len]);
    }

    fn status(&mut self) -> u8 {
        self.read(DEVICE_STATUS, 1) as u8
    }

    fn set_status(&mut self, status: u8) {
        self.write(DEVICE_STATUS, status.into(), 1);
    }

    fn device_features(&mut self) -> u64 {
        self.write(DEVICE_FEATURE_SELECT, 0, 4);
        let low = self.read(DEVICE_FEATURE, 4);
        self.write(DEVICE_FEATURE_SELECT, 1, 4);
        low | self.read(DEVICE_FEATURE, 4) << 32
    }

    fn write_driver_features(&mut self, features: u64) {
        self.write(DRIVER_FEATURE_SELECT, 0, 4);
        self.write(DRIVER_FEATURE, features & 0xffff_ffff, 4);
        self.write(DRIVER_FEATURE_SELECT, 1, 4);
        self.write(DRIVER_FEATURE, features >> 32, 4);
    }

    /// Reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK; returns whether it stuck.
    fn negotiate(&mut self, features: u64) -> bool {
        self.set_status(0);
        assert_eq!(self.status(), 0);
        self.set_status(ACK);
        self.set_status(ACK | DRIVER);
        self.write_driver_features(features);
        self.set_status(ACK | DRIVER | FEATURES_OK);
        self.status() & FEATURES_OK != 0
    }

    /// MSI-X on: entry i → data 0x40 + i, unmasked.
    fn enable_msix(&mut self) {
        for vector in 0..MAX_SIZES.len() as u64 + 1 {
            let entry = MSIX_TABLE_OFFSET + vector * 16;
            self.write(entry, 0xfee0_0000, 4);
            self.write(entry + 4, 0, 4);
            self.write(entry + 8, 0x40 + vector, 4);
            self.write(entry + 12, 0, 4);
        }
        self.config_write(CAP_MSIX_AT + 2, MSIX_ENABLE.into(), 2);
    }

    /// Queue `queue` at its rings with `size`, vector queue + 1.
    fn setup_queue(&mut self, queue: u16, size: u16) {
        let (desc, avail, used) = rings(queue);
        self.write(QUEUE_SELECT, queue.into(), 2);
        self.write(QUEUE_SIZE, size.into(), 2);
        self.write(QUEUE_MSIX_VECTOR, u64::from(queue) + 1, 2);
        // Linux writes the 64-bit addresses as two 32-bit halves.
        for (offset, address) in [
            (QUEUE_DESC, desc),
            (QUEUE_DRIVER, avail),
            (QUEUE_DEVICE, used),
        ] {
            self.write(offset, address & 0xffff_ffff, 4);
            self.write(offset + 4, address >> 32, 4);
        }
        self.write(QUEUE_ENABLE, 1, 2);
    }

    /// A whole Linux-like probe: queues 0 and 1 enabled, queue 2 left off.
    fn bring_up(&mut self, features: u64) {
        assert!(self.negotiate(features));
        self.enable_msix();
        self.write(MSIX_CONFIG, 0, 2);
        self.setup_queue(0, 128);
        self.setup_queue(1, 64);
        self.set_status(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    }

    fn activations(&self) -> usize {
        self.record.lock().unwrap().activations.len()
    }

    fn readable(&self) -> Vec<usize> {
        self.irqfds
            .iter()
            .enumerate()
            .filter(|(_, fd)| fd.read().is_ok())
            .map(|(i, _)| i)
            .collect()
    }

    fn signal_queue(&self, queue: u16) {
        let record = self.record.lock().unwrap();
        record
            .activations
            .last()
            .unwrap()
            .interrupt
            .signal_queue(queue)
            .unwrap();
    }
}

#[test]
fn configuration_space_identifies_a_modern_virtio_device() {
    let mut h = harness();
    assert_eq!(h.config_read(config::VENDOR_ID, 2), 0x1af4);
    assert_eq!(
        h.config_read(config::DEVICE_ID, 2),
        0x1042,
        "0x1040 + block"
    );
    assert_eq!(h.config_read(config::CLASS_REVISION, 4), 0x0180_0001);
    assert_eq!(h.config_read(0x2c, 4), 0x1100_1af4);
    assert_eq!(h.config_read(config::INTERRUPT_PIN, 1), 0, "no INTx");
    assert_ne!(
        h.config_read(config::STATUS, 2) as u16 & config::STATUS_CAPABILITIES,
        0
    );
    // BAR0: 64-bit memory, not prefetchable, at the address the root gave it.
    assert_eq!(h.config_read(config::BAR0, 4), BAR | 0b100);
    assert_eq!(h.config_read(config::BAR0 + 4, 4), 0);
    h.config_write(config::BAR0, 0xffff_ffff, 4);
    let size = !(h.config_read(config::BAR0, 4) & !0xf) as u32 + 1;
    assert_eq!(u64::from(size), BAR_SIZE);
    // MSI-X: queues + 1 vectors, off until the driver enables it.
    assert_eq!(
        h.config_read(CAP_MSIX_AT, 1),
        u64::from(config::CAP_ID_MSIX)
    );
    assert_eq!(h.config_read(CAP_MSIX_AT + 2, 2), MAX_SIZES.len() as u64);
    // Writes to read-only registers change nothing.
    h.config_write(config::VENDOR_ID, 0, 4);
    h.config_write(CAP_NOTIFY_AT + 16, 0, 4);
    assert_eq!(h.config_read(config::VENDOR_ID, 4), 0x1042_1af4);
    assert_eq!(h.config_read(CAP_NOTIFY_AT + 16, 4), 4);
    // Past the emulated header: zero, even across the end.
    assert_eq!(h.config_read(0xffc, 4), 0);
    assert_eq!(h.config_read(0xfe, 2), 0);
}

#[test]
fn feature_negotiation_refuses_what_was_not_offered() {
    let mut h = harness();
    assert_eq!(h.device_features(), FAKE_FEATURES | VERSION_1);
    assert!(!h.negotiate(VERSION_1 | 1 << 7), "bit 7 was not offered");
    assert!(
        !h.negotiate(VERSION_1 | 1 << 33),
        "ACCESS_PLATFORM is never offered"
    );
    assert!(!h.negotiate(1 << 5), "legacy driver without VERSION_1");
    assert!(h.negotiate(VERSION_1 | 1 << 5));
    assert_eq!(h.status(), ACK | DRIVER | FEATURES_OK);
    // Features are frozen after FEATURES_OK.
    h.write(DRIVER_FEATURE_SELECT, 0, 4);
    h.write(DRIVER_FEATURE, 1, 4);
    assert_eq!(h.read(DRIVER_FEATURE, 4), 1 << 5);
    // DRIVER_OK without FEATURES_OK never activates.
    h.negotiate(1 << 7);
    h.set_status(ACK | DRIVER | DRIVER_OK);
    assert_eq!(h.status() & DRIVER_OK, 0);
    assert_eq!(h.activations(), 0);
}

#[test]
fn driver_ok_activates_with_the_enabled_queues() {
    let mut h = harness();
    assert_eq!(h.read(NUM_QUEUES, 2), 3);
    h.write(QUEUE_SELECT, 2, 2);
    assert_eq!(h.read(QUEUE_SIZE, 2), 16, "size defaults to the maximum");
    assert_eq!(h.read(QUEUE_NOTIFY_OFF, 2), 2);
    h.bring_up(VERSION_1 | EVENT_IDX | 1);
    assert_eq!(h.status(), ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert!(h.transport.is_active());
    let record = h.record.lock().unwrap();
    assert_eq!(record.activations.len(), 1);
    let activation = &record.activations[0];
    assert_eq!(activation.acked_features, VERSION_1 | EVENT_IDX | 1);
    let (desc, avail, used) = rings(0);
    assert_eq!(
        activation.queues[0],
        Some((128, desc, avail, used, 0, 0, true))
    );
    let (desc, avail, used) = rings(1);
    assert_eq!(
        activation.queues[1],
        Some((64, desc, avail, used, 0, 0, true))
    );
    assert_eq!(activation.queues[2], None);
    assert!(activation.kicks[2].is_none());
    drop(record);
    // Queue setup is frozen once the device runs.
    h.write(QUEUE_SELECT, 0, 2);
    h.write(QUEUE_SIZE, 32, 2);
    assert_eq!(h.read(QUEUE_SIZE, 2), 128);
}

#[test]
fn notify_write_kicks_the_queue() {
    let mut h = harness();
    h.bring_up(VERSION_1);
    let record = h.record.lock().unwrap();
    let kicks = &record.activations[0].kicks;
    let kick1 = kicks[1].as_ref().unwrap().try_clone().unwrap();
    let kick0 = kicks[0].as_ref().unwrap().try_clone().unwrap();
    drop(record);
    assert!(kick1.read().is_err());
    h.write(NOTIFY_OFFSET + 4, 1, 2);
    assert_eq!(kick1.read().unwrap(), 1);
    assert!(kick0.read().is_err(), "only queue 1 was notified");
    h.write(NOTIFY_OFFSET, 0, 2);
    assert_eq!(kick0.read().unwrap(), 1);
    // Past the last queue's notify register: nothing to kick.
    h.write(NOTIFY_OFFSET + 4 * MAX_SIZES.len() as u64, 3, 2);
    assert!(kick0.read().is_err() && kick1.read().is_err());
}

#[test]
fn signal_queue_fires_the_queue_vector_and_isr_reads_clear() {
    let mut h = harness();
    h.bring_up(VERSION_1);
    // Routes for every vector the driver unmasked.
    let routes = h.routes.routes();
    assert_eq!(routes.len(), 4);
    assert_eq!(
        routes.get(&(FIRST_GSI + 2)),
        Some(&MsiMessage {
            address: 0xfee0_0000,
            data: 0x42
        })
    );
    h.signal_queue(1);
    assert_eq!(h.readable(), [2], "queue 1 uses vector 2");
    h.signal_queue(0);
    assert_eq!(h.readable(), [1]);
    assert_eq!(h.read(ISR_OFFSET, 1), 1);
    assert_eq!(h.read(ISR_OFFSET, 1), 0, "reading clears");
    // A config change: vector 0, ISR bit 1, a new generation.
    let generation = h.read(CONFIG_GENERATION, 1);
    h.record.lock().unwrap().activations[0]
        .interrupt
        .signal_config()
        .unwrap();
    assert_eq!(h.readable(), [0]);
    assert_eq!(h.read(CONFIG_GENERATION, 1), generation + 1);
    assert_eq!(h.read(ISR_OFFSET, 4), 2);
    // Queue 2 has no vector: nothing fires.
    h.signal_queue(2);
    assert!(h.readable().is_empty());
}

#[test]
fn masked_vectors_hold_interrupts_pending() {
    let mut h = harness();
    h.bring_up(VERSION_1);
    h.write(MSIX_TABLE_OFFSET + 2 * 16 + 12, 1, 4);
    assert!(!h.routes.routes().contains_key(&(FIRST_GSI + 2)));
    h.signal_queue(1);
    assert!(h.readable().is_empty());
    assert_eq!(h.read(MSIX_PBA_OFFSET, 8), 0b100, "vector 2 pending");
    h.write(MSIX_TABLE_OFFSET + 2 * 16 + 12, 0, 4);
    assert_eq!(h.readable(), [2], "delivered on unmask");
    assert_eq!(h.read(MSIX_PBA_OFFSET, 8), 0);
    // The function mask holds everything back the same way.
    h.config_write(
        CAP_MSIX_AT + 2,
        u64::from(MSIX_ENABLE | MSIX_FUNCTION_MASK),
        2,
    );
    h.signal_queue(0);
    assert!(h.readable().is_empty());
    h.config_write(CAP_MSIX_AT + 2, MSIX_ENABLE.into(), 2);
    assert_eq!(h.readable(), [1]);
    // MSI-X disabled: no INTx fallback, only the ISR bit.
    h.config_write(CAP_MSIX_AT + 2, 0, 2);
    h.read(ISR_OFFSET, 1);
    h.signal_queue(0);
    assert!(h.readable().is_empty());
    assert_eq!(h.read(ISR_OFFSET, 1), 1);
}

#[test]
fn reset_stops_the_device_and_restores_defaults() {
    let mut h = harness();
    h.bring_up(VERSION_1 | 1);
    let kick = h.record.lock().unwrap().activations[0].kicks[0]
        .as_ref()
        .unwrap()
        .try_clone()
        .unwrap();
    h.set_status(0);
    assert_eq!(h.record.lock().unwrap().resets, 1);
    assert!(!h.transport.is_active());
    assert_eq!(h.status(), 0);
    assert_eq!(h.read(MSIX_CONFIG, 2), u64::from(NO_VECTOR));
    h.write(DRIVER_FEATURE_SELECT, 0, 4);
    assert_eq!(h.read(DRIVER_FEATURE, 4), 0);
    h.write(QUEUE_SELECT, 0, 2);
    assert_eq!(h.read(QUEUE_SIZE, 2), 256);
    assert_eq!(h.read(QUEUE_ENABLE, 2), 0);
    assert_eq!(h.read(QUEUE_MSIX_VECTOR, 2), u64::from(NO_VECTOR));
    assert_eq!(h.read(QUEUE_DESC, 8), 0);
    assert_eq!(h.read(QUEUE_DEVICE, 8), 0);
    // The driver can start over; the device gets the same kick eventfds.
    h.bring_up(VERSION_1);
    assert_eq!(h.activations(), 2);
    h.write(NOTIFY_OFFSET, 0, 2);
    assert_eq!(kick.read().unwrap(), 1);
}

#[test]
fn hostile_register_values_are_dropped() {
    let mut h = harness();
    assert!(h.negotiate(VERSION_1));
    // A queue that does not exist reads as unavailable and takes no setup.
    h.write(QUEUE_SELECT, 3, 2);
    assert_eq!(h.read(QUEUE_SIZE, 2), 0);
    h.write(QUEUE_SIZE, 16, 2);
    h.write(QUEUE_ENABLE, 1, 2);
    h.write(QUEUE_MSIX_VECTOR, 1, 2);
    h.write(QUEUE_SELECT, 0xffff, 2);
    h.write(QUEUE_DESC, 0x1000, 8);
    assert_eq!(h.read(QUEUE_SIZE, 2), 0);
    assert_eq!(h.read(QUEUE_MSIX_VECTOR, 2), 0);
    // Sizes: not a power of two, above the maximum, zero.
    h.write(QUEUE_SELECT, 2, 2);
    for size in [3, 32, 0] {
        h.write(QUEUE_SIZE, size, 2);
        assert_eq!(h.read(QUEUE_SIZE, 2), 16, "size {size}");
    }
    h.write(QUEUE_SIZE, 8, 2);
    assert_eq!(h.read(QUEUE_SIZE, 2), 8);
    // Vectors the function does not have read back as NO_VECTOR.
    h.write(QUEUE_MSIX_VECTOR, 4, 2);
    assert_eq!(h.read(QUEUE_MSIX_VECTOR, 2), u64::from(NO_VECTOR));
    h.write(MSIX_CONFIG, 0x7ff, 2);
    assert_eq!(h.read(MSIX_CONFIG, 2), u64::from(NO_VECTOR));
    // queue_enable takes only 1.
    h.write(QUEUE_ENABLE, 2, 2);
    assert_eq!(h.read(QUEUE_ENABLE, 2), 0);
    // Odd widths and alignments: writes dropped, reads harmless.
    h.write(QUEUE_SELECT, 1, 1);
    h.write(DEVICE_FEATURE_SELECT, 1, 2);
    h.write(QUEUE_SIZE - 1, 0x0100, 2);
    h.write(DEVICE_STATUS, 0x0f0f, 2);
    assert_eq!(h.read(QUEUE_SELECT, 2), 2);
    assert_eq!(h.read(DEVICE_FEATURE_SELECT, 4), 0);
    assert_eq!(h.status(), ACK | DRIVER | FEATURES_OK);
    let status = u64::from(ACK | DRIVER | FEATURES_OK);
    assert_eq!(
        h.read(0x13, 4),
        status << 8 | 2 << 24,
        "num_queues' high byte, status, …"
    );
    assert_eq!(
        h.read(COMMON_LEN - 2, 8),
        0,
        "straddling the end of common cfg"
    );
    // Clearing status bits without a reset is ignored.
    h.set_status(ACK);
    assert_eq!(h.status(), ACK | DRIVER | FEATURES_OK);
    // Accesses past the BAR, or at absurd offsets, or on a BAR that does not exist.
    assert_eq!(h.read(BAR_SIZE - 2, 4), 0xffff_ffff);
    assert_eq!(h.read(u64::MAX - 1, 4), 0xffff_ffff);
    h.write(u64::MAX, 1, 8);
    let mut data = [0u8; 4];
    h.transport.bar_read(2, 0, &mut data);
    assert_eq!(data, [0xff; 4]);
    h.transport.bar_write(5, DEVICE_STATUS, &[0]);
    assert_eq!(h.status(), ACK | DRIVER | FEATURES_OK);
    // Gaps inside the BAR read zero; the PBA and ISR ignore writes.
    assert_eq!(h.read(0x800, 4), 0);
    h.write(MSIX_PBA_OFFSET, u64::MAX, 8);
    h.write(ISR_OFFSET, 0xff, 1);
    assert_eq!(h.read(MSIX_PBA_OFFSET, 8), 0);
    assert_eq!(h.read(ISR_OFFSET, 1), 0);
    assert_eq!(h.activations(), 0);
}

#[test]
fn rings_outside_memory_refuse_activation_with_needs_reset() {
    let mut h = harness();
    assert!(h.negotiate(VERSION_1));
    h.enable_msix();
    h.write(MSIX_CONFIG, 0, 2);
    h.setup_queue(0, 256);
    // The used ring runs past the end of RAM.
    h.write(QUEUE_DEVICE, RAM - 8, 8);
    h.set_status(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert_eq!(h.activations(), 0);
    assert!(!h.transport.is_active());
    assert_ne!(h.status() & NEEDS_RESET, 0);
    assert_eq!(h.readable(), [0], "config change interrupt");
    assert_eq!(h.read(ISR_OFFSET, 1), 2);
    // The driver cannot clear DEVICE_NEEDS_RESET itself; a reset can.
    let status = h.status();
    h.set_status(status & !NEEDS_RESET);
    assert_ne!(h.status() & NEEDS_RESET, 0);
    h.set_status(0);
    assert_eq!(h.status(), 0);
    // Misaligned rings are refused the same way.
    assert!(h.negotiate(VERSION_1));
    h.setup_queue(0, 256);
    h.write(QUEUE_DESC, 0x1008, 8);
    h.set_status(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert_ne!(h.status() & NEEDS_RESET, 0);
    assert_eq!(h.activations(), 0);
}

#[test]
fn device_activation_failure_sets_needs_reset() {
    let mut h = harness_with(true);
    h.bring_up(VERSION_1);
    assert_eq!(
        h.status(),
        ACK | DRIVER | FEATURES_OK | DRIVER_OK | NEEDS_RESET
    );
    assert!(!h.transport.is_active());
    assert_eq!(h.readable(), [0]);
}

#[test]
fn device_config_and_pci_cfg_window_reach_the_bar() {
    let mut h = harness();
    assert_eq!(h.read(DEVICE_OFFSET + 2, 2), 0x0403);
    h.write(DEVICE_OFFSET + 4, 0xaa, 1);
    assert_eq!(h.record.lock().unwrap().config[4], 0xaa);
    // VIRTIO_PCI_CAP_PCI_CFG: num_queues through configuration space.
    h.config_write(PCI_CFG_BAR, 0, 1);
    h.config_write(PCI_CFG_OFFSET, NUM_QUEUES, 4);
    h.config_write(PCI_CFG_LENGTH, 2, 4);
    assert_eq!(h.config_read(PCI_CFG_DATA, 4), 3);
    assert_eq!(h.config_read(PCI_CFG_OFFSET, 4), NUM_QUEUES);
    // A write through the window.
    h.config_write(PCI_CFG_OFFSET, DEVICE_FEATURE_SELECT, 4);
    h.config_write(PCI_CFG_LENGTH, 4, 4);
    h.config_write(PCI_CFG_DATA, 1, 4);
    assert_eq!(h.read(DEVICE_FEATURE_SELECT, 4), 1);
    // Bad windows read zero and write nothing.
    h.config_write(PCI_CFG_LENGTH, 3, 4);
    assert_eq!(h.config_read(PCI_CFG_DATA, 4), 0);
    h.config_write(PCI_CFG_DATA, 0, 4);
    assert_eq!(h.read(DEVICE_FEATURE_SELECT, 4), 1);
    h.config_write(PCI_CFG_LENGTH, 4, 4);
    h.config_write(PCI_CFG_OFFSET, BAR_SIZE as u32 as u64, 4);
    assert_eq!(h.config_read(PCI_CFG_DATA, 4), 0);
    h.config_write(PCI_CFG_BAR, 1, 1);
    h.config_write(PCI_CFG_OFFSET, DEVICE_FEATURE_SELECT, 4);
    h.config_write(PCI_CFG_DATA, 0, 4);
    assert_eq!(h.read(DEVICE_FEATURE_SELECT, 4), 1);
}

#[test]
fn ioeventfds_follow_the_bar() {
    let mut h = harness();
    let notify = |base: u64| -> Vec<u64> {
        (0..MAX_SIZES.len() as u64)
            .map(|q| base + NOTIFY_OFFSET + 4 * q)
            .collect()
    };
    assert_eq!(h.ioevents.addresses(), notify(BAR));
    assert_eq!(h.transport.notify_address(1), Some(BAR + NOTIFY_OFFSET + 4));
    h.bring_up(VERSION_1);
    // Linux turns decoding off to move or size a BAR: the ioeventfds go away.
    h.config_write(config::COMMAND, 0, 2);
    assert!(h.ioevents.addresses().is_empty());
    assert_eq!(h.transport.notify_address(0), None);
    let moved = 0x8_0000_0000u64;
    h.config_write(config::BAR0, moved & 0xffff_ffff, 4);
    h.config_write(config::BAR0 + 4, moved >> 32, 4);
    assert!(h.ioevents.addresses().is_empty(), "still not decoding");
    h.config_write(config::COMMAND, u64::from(config::COMMAND_MEMORY | 4), 2);
    assert_eq!(h.ioevents.addresses(), notify(moved));
    assert_eq!(h.config_read(config::COMMAND, 2), 6);
    // The root moving it (a restore or re-plug) re-registers as well.
    h.transport.set_bar_address(BAR_INDEX, BAR);
    assert_eq!(h.ioevents.addresses(), notify(BAR));
    // The registered fds are the transport's kicks: what KVM would signal, the device sees.
    let kick = h.record.lock().unwrap().activations[0].kicks[2]
        .as_ref()
        .map(|k| k.try_clone().unwrap());
    assert!(kick.is_none(), "queue 2 was not enabled");
    let kick = h.record.lock().unwrap().activations[0].kicks[1]
        .as_ref()
        .unwrap()
        .try_clone()
        .unwrap();
    h.ioevents.signal(BAR + NOTIFY_OFFSET + 4);
    assert_eq!(kick.read().unwrap(), 1);
    // Dropping the transport removes them.
    drop(h.transport);
    assert!(h.ioevents.addresses().is_empty());
}

#[test]
fn failed_ioeventfd_registration_falls_back_to_exits() {
    let mut h = harness();
    h.config_write(config::COMMAND, 0, 2);
    *h.ioevents.refuse.lock().unwrap() = true;
    h.enable_memory_decoding_again();
    assert!(h.ioevents.addresses().is_empty());
    h.bring_up(VERSION_1);
    let kick = h.record.lock().unwrap().activations[0].kicks[1]
        .as_ref()
        .unwrap()
        .try_clone()
        .unwrap();
    h.write(NOTIFY_OFFSET + 4, 1, 2);
    assert_eq!(kick.read().unwrap(), 1);
    // Nothing was registered, so nothing is unregistered on a move.
    *h.ioevents.refuse.lock().unwrap() = false;
    h.transport.set_bar_address(BAR_INDEX, BAR + BAR_SIZE);
    assert_eq!(h.ioevents.addresses().len(), MAX_SIZES.len());
}

impl Harness {
    fn enable_memory_decoding_again(&mut self) {
        self.transport.enable_memory_decoding();
    }
}

#[test]
fn snapshot_round_trips_into_a_fresh_transport() {
    let mut h = harness();
    h.bring_up(VERSION_1 | EVENT_IDX | 1);
    h.write(DEVICE_OFFSET, 0x77, 1);
    // Vector 3 masked with an interrupt pending.
    h.write(MSIX_TABLE_OFFSET + 3 * 16 + 12, 1, 4);
    h.write(QUEUE_SELECT, 2, 2);
    h.write(QUEUE_MSIX_VECTOR, 3, 2);
    h.config_write(config::INTERRUPT_LINE, 11, 1);
    h.signal_queue(2);
    assert!(h.readable().is_empty());
    h.record.lock().unwrap().served = 5;
    // Saving a running device is refused.
    assert!(matches!(
        h.transport.save(),
        Err(SnapshotError::NotPaused { .. })
    ));
    h.transport.pause();
    let state = h.transport.save().unwrap();
    assert_eq!(
        state.queues[0].position,
        Some(QueuePosition {
            next_avail: 5,
            next_used: 5
        })
    );
    assert_eq!(state.queues[2].position, None);
    assert!(state.msix_entries[3].pending && state.msix_entries[3].masked);
    assert_eq!(state.isr, 1);
    let json = serde_json::to_string(&state).unwrap();
    let loaded: VirtioPciState = serde_json::from_str(&json).unwrap();
    assert_eq!(loaded, state);
    h.transport.resume().unwrap();
    assert_eq!(h.record.lock().unwrap().resumes, 1);

    let mut fresh = harness();
    // The fresh one was placed elsewhere by the root; the snapshot moves it back.
    fresh.transport.set_bar_address(BAR_INDEX, 0xd000_0000);
    fresh.transport.restore(&loaded).unwrap();
    {
        let record = fresh.record.lock().unwrap();
        assert_eq!(record.restored.as_ref(), Some(&state.device));
        assert_eq!(record.config[0], 0x77);
        assert_eq!(record.activations.len(), 1);
        let activation = &record.activations[0];
        assert_eq!(activation.acked_features, VERSION_1 | EVENT_IDX | 1);
        let (desc, avail, used) = rings(0);
        assert_eq!(
            activation.queues[0],
            Some((128, desc, avail, used, 5, 5, true))
        );
        assert_eq!(activation.queues[2], None);
        // Each enabled queue was kicked once so the device looks at its rings.
        assert_eq!(activation.kicks[1].as_ref().unwrap().read().unwrap(), 1);
    }
    // Saving the restored transport gives the same state back.
    fresh.record.lock().unwrap().served = 0;
    fresh.transport.pause();
    assert_eq!(fresh.transport.save().unwrap(), state);
    fresh.transport.resume().unwrap();

    assert!(fresh.transport.is_active());
    assert_eq!(fresh.status(), ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert_eq!(fresh.ioevents.addresses(), h.ioevents.addresses());
    assert_eq!(fresh.routes.routes(), h.routes.routes());
    assert_eq!(fresh.config_read(config::INTERRUPT_LINE, 1), 11);
    fresh.write(QUEUE_SELECT, 1, 2);
    assert_eq!(fresh.read(QUEUE_MSIX_VECTOR, 2), 2);
    assert_eq!(fresh.read(QUEUE_DESC, 8), rings(1).0);
    // Interrupts reach the same vectors; the one pending on masked vector 3 comes
    // through when the driver unmasks it.
    fresh.signal_queue(1);
    assert_eq!(fresh.readable(), [2]);
    assert_eq!(fresh.read(MSIX_PBA_OFFSET, 1), 0b1000);
    fresh.write(MSIX_TABLE_OFFSET + 3 * 16 + 12, 0, 4);
    assert_eq!(fresh.readable(), [3]);
    // A second restore into a used transport is refused.
    assert!(matches!(
        fresh.transport.restore(&state),
        Err(SnapshotError::NotFresh { .. })
    ));
}

#[test]
fn inactive_transport_saves_without_pause_and_restores_idle() {
    let mut h = harness();
    assert!(h.negotiate(VERSION_1));
    h.setup_queue(0, 32);
    let state = h.transport.save().unwrap();
    let mut fresh = harness();
    fresh.transport.restore(&state).unwrap();
    assert_eq!(fresh.activations(), 0);
    assert_eq!(fresh.status(), ACK | DRIVER | FEATURES_OK);
    fresh.write(QUEUE_SELECT, 0, 2);
    assert_eq!(fresh.read(QUEUE_SIZE, 2), 32);
    // The driver carries on where it was.
    fresh.set_status(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert_eq!(fresh.activations(), 1);
}

#[test]
fn restore_refuses_states_that_do_not_fit() {
    let mut h = harness();
    h.bring_up(VERSION_1);
    h.transport.pause();
    let good = h.transport.save().unwrap();
    let cases: Vec<(&str, Damage)> = vec![
        (
            "queue count",
            Box::new(|s| {
                s.queues.pop();
            }),
        ),
        (
            "vector count",
            Box::new(|s| {
                s.msix_entries.push(MsixEntryState::default());
            }),
        ),
        ("unknown feature", Box::new(|s| s.acked_features |= 1 << 40)),
        ("queue size", Box::new(|s| s.queues[1].size = 128)),
        ("queue vector", Box::new(|s| s.queues[0].msix_vector = 9)),
        ("rings outside RAM", Box::new(|s| s.queues[0].desc = RAM)),
        (
            "device state",
            Box::new(|s| s.device = crate::DeviceState::Rng(crate::rng::RngState::default())),
        ),
    ];
    for (what, damage) in cases {
        let mut state = good.clone();
        damage(&mut state);
        let mut fresh = harness();
        assert!(fresh.transport.restore(&state).is_err(), "{what}");
        assert_eq!(fresh.status(), 0, "{what}: left fresh");
        assert_eq!(fresh.activations(), 0, "{what}");
        assert_eq!(fresh.ioevents.addresses().len(), MAX_SIZES.len(), "{what}");
        // And it still restores the good state afterwards.
        fresh.transport.restore(&good).unwrap();
        assert_eq!(fresh.activations(), 1, "{what}");
    }
}

#[test]
fn failed_reactivation_rolls_back() {
    let mut h = harness();
    h.bring_up(VERSION_1);
    h.transport.pause();
    let state = h.transport.save().unwrap();
    let mut fresh = harness_with(true);
    fresh.transport.set_bar_address(BAR_INDEX, 0xd000_0000);
    assert!(matches!(
        fresh.transport.restore(&state),
        Err(SnapshotError::Activate { .. })
    ));
    assert_eq!(fresh.status(), 0);
    assert!(fresh.routes.routes().is_empty());
    assert_eq!(
        fresh.ioevents.addresses()[0],
        0xd000_0000 + NOTIFY_OFFSET,
        "BAR back where the root put it"
    );
}

#[test]
fn constructor_refuses_bad_devices() {
    struct Broken(Vec<u16>);
    impl VirtioDevice for Broken {
        fn name(&self) -> &str {
            "broken"
        }
        fn device_type(&self) -> u32 {
            4
        }
        fn queue_max_sizes(&self) -> Vec<u16> {
            self.0.clone()
        }
        fn device_features(&self) -> u64 {
            0
        }
        fn read_config(&self, _: u64, _: &mut [u8]) {}
        fn write_config(&mut self, _: u64, _: &[u8]) {}
        fn activate(&mut self, _: Activation) -> Result<(), ActivateError> {
            Ok(())
        }
        fn reset(&mut self) {}
        fn pause(&mut self) -> Vec<Option<QueuePosition>> {
            Vec::new()
        }
        fn resume(&mut self) -> Result<(), ActivateError> {
            Ok(())
        }
        fn save_state(&self) -> Result<crate::DeviceState, crate::DeviceStateError> {
            Ok(crate::DeviceState::Rng(crate::rng::RngState::default()))
        }
        fn restore_state(&mut self, _: &crate::DeviceState) -> Result<(), crate::DeviceStateError> {
            Ok(())
        }
    }
    let build = |sizes: Vec<u16>, vectors_short: bool| {
        let mut allocate = |count: u32| -> io::Result<Vec<(u32, EventFd)>> {
            let count = if vectors_short { count - 1 } else { count };
            (0..count)
                .map(|i| Ok((i, EventFd::new(EFD_NONBLOCK)?)))
                .collect()
        };
        VirtioPciDevice::new(
            Box::new(Broken(sizes)),
            memory(),
            &mut allocate,
            Arc::new(RecordedRoutes::default()),
            Arc::new(RecordedIoEvents::default()),
        )
    };
    assert!(matches!(
        build(vec![], false),
        Err(TransportError::QueueCount { .. })
    ));
    assert!(matches!(
        build(vec![2; MAX_QUEUES + 1], false),
        Err(TransportError::QueueCount { .. })
    ));
    assert!(matches!(
        build(vec![256, 100], false),
        Err(TransportError::QueueMaxSize { queue: 1, .. })
    ));
    assert!(matches!(
        build(vec![0], false),
        Err(TransportError::QueueMaxSize { .. })
    ));
    assert!(matches!(
        build(vec![8], true),
        Err(TransportError::VectorCount { .. })
    ));
    let ok = build(vec![8], false).unwrap();
    let mut ok = ok;
    let mut class = [0u8; 4];
    ok.config_read(config::CLASS_REVISION, &mut class);
    assert_eq!(
        u32::from_le_bytes(class) >> 8,
        0xff_0000,
        "rng: other class"
    );
}

/// virtio-balloon behind the transport, driven the way Linux's virtio_balloon and
/// virtio_pci_modern drive it: STATS_VQ and VERSION_1, one MSI-X vector per queue, a buffer
/// of PFNs on the inflate queue, a 16-bit write of the queue index at the notify address the
/// capabilities give (through the ioeventfd as KVM would signal it, then through the MMIO
/// exit path), and then sleep until the queue's vector fires. Linux never polls the used
/// ring: a buffer returned without that interrupt leaves its balloon stuck forever.
#[test]
fn balloon_returns_pages_with_the_queues_own_vector() {
    use crate::balloon::{Balloon, BalloonConfig, VIRTIO_BALLOON_F_STATS_VQ};
    use crate::test_util::wait_until;
    use vm_memory::Bytes;

    /// Where the driver keeps its array of PFNs (clear of the rings).
    const PFNS_AT: u64 = 0x8_0000;
    let balloon = Balloon::new(BalloonConfig {
        amount_mib: 0,
        deflate_on_oom: false,
        stats_polling_interval_s: 60,
    })
    .unwrap();
    let mut h = harness_around(Box::new(balloon), Arc::default());
    let memory = h.transport.memory.clone();
    assert_eq!(h.read(NUM_QUEUES, 2), 3, "inflate, deflate, stats");
    assert!(h.negotiate(VERSION_1 | 1 << VIRTIO_BALLOON_F_STATS_VQ));
    // Config changes on vector 0, queue q on vector q + 1.
    h.enable_msix();
    h.write(MSIX_CONFIG, 0, 2);
    for queue in 0..3 {
        h.setup_queue(queue, 256);
    }
    h.set_status(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    assert!(h.transport.is_active());

    // vp_modern_map_vq_notify: the notify capability's offset + queue_notify_off times
    // notify_off_multiplier.
    let notify_offset = h.config_read(CAP_NOTIFY_AT + 8, 4);
    let multiplier = h.config_read(CAP_NOTIFY_AT + 16, 4);
    let notify_address = |h: &mut Harness, queue: u16| {
        h.write(QUEUE_SELECT, queue.into(), 2);
        notify_offset + h.read(QUEUE_NOTIFY_OFF, 2) * multiplier
    };
    let pfns: Vec<u32> = (0xc0..0xd0).collect();
    for (i, pfn) in pfns.iter().enumerate() {
        memory
            .write_obj(*pfn, GuestAddress(PFNS_AT + 4 * i as u64))
            .unwrap();
    }
    // virtqueue_add_outbuf of the PFN array: descriptor `slot`, device-readable, alone.
    let offer = |queue: u16, slot: u16| {
        let (desc, avail, _) = rings(queue);
        let at = desc + 16 * u64::from(slot);
        memory.write_obj(PFNS_AT, GuestAddress(at)).unwrap();
        memory
            .write_obj(4 * pfns.len() as u32, GuestAddress(at + 8))
            .unwrap();
        memory.write_obj(0u32, GuestAddress(at + 12)).unwrap();
        memory
            .write_obj(slot, GuestAddress(avail + 4 + 2 * u64::from(slot)))
            .unwrap();
        memory.write_obj(slot + 1, GuestAddress(avail + 2)).unwrap();
    };
    // The used ring's index, and the id of its entry `slot`.
    let used = |queue: u16, slot: u16| -> (u16, u32) {
        let (_, _, used) = rings(queue);
        (
            memory.read_obj(GuestAddress(used + 2)).unwrap(),
            memory
                .read_obj(GuestAddress(used + 4 + 8 * u64::from(slot)))
                .unwrap(),
        )
    };
    let fired = |h: &Harness, vector: usize, what: &str| {
        wait_until(what, || h.irqfds[vector].read().is_ok());
    };

    // Inflate, kicked through the ioeventfd (KVM signals the registered kick).
    offer(0, 0);
    let inflate = notify_address(&mut h, 0);
    h.ioevents.signal(BAR + inflate);
    fired(&h, 1, "the inflate queue's vector after an ioeventfd kick");
    assert_eq!(used(0, 0), (1, 0));
    // Inflate again, kicked through the MMIO exit path (vp_notify writes the queue index).
    offer(0, 1);
    h.write(inflate, 0, 2);
    fired(&h, 1, "the inflate queue's vector after a notify write");
    assert_eq!(used(0, 1), (2, 1));
    // Deflate: its own vector.
    offer(1, 0);
    let deflate = notify_address(&mut h, 1);
    h.write(deflate, 1, 2);
    fired(&h, 2, "the deflate queue's vector");
    assert_eq!(used(1, 0), (1, 0));
    assert_eq!(h.read(ISR_OFFSET, 1) & 1, 1, "ISR says a queue interrupted");
    // Nothing for the configuration or the stats queue (it holds no buffer).
    assert!(h.readable().is_empty());

    let report = h
        .transport
        .device_mut()
        .as_any_mut()
        .and_then(|any| any.downcast_mut::<Balloon>())
        .unwrap()
        .report();
    assert_eq!(report.counters.inflated_pages, 2 * pfns.len() as u64);
    assert_eq!(report.counters.deflated_pages, pfns.len() as u64);
    assert_eq!(report.counters.refused_buffers, 0);
    assert_eq!(report.counters.refused_pfns, 0);
}
