//! virtio-pci (spec 4.1), modern only: the vendor capabilities that place the common, notify,
//! ISR and device configuration structures in BARs, device status, feature negotiation and
//! queue setup.

use super::pci;
use super::queue::{SplitQueue, MAX_QUEUE_SIZE};
use super::{fail, fail_setup, Deadline, Dma};
use crate::println;

pub const VIRTIO_VENDOR: u16 = 0x1af4;
/// Modern device IDs are 0x1040 + the virtio device type.
pub const MODERN_DEVICE_BASE: u16 = 0x1040;

pub const TYPE_NET: u16 = 1;
pub const TYPE_BLOCK: u16 = 2;
pub const TYPE_ENTROPY: u16 = 4;
pub const TYPE_VSOCK: u16 = 19;

/// VIRTIO_F_VERSION_1: the only feature every device here must offer and the driver acks.
pub const F_VERSION_1: u64 = 1 << 32;

const CFG_COMMON: u8 = 1;
const CFG_NOTIFY: u8 = 2;
const CFG_ISR: u8 = 3;
const CFG_DEVICE: u8 = 4;

pub(crate) const STATUS_ACKNOWLEDGE: u8 = 1;
pub(crate) const STATUS_DRIVER: u8 = 2;
pub(crate) const STATUS_DRIVER_OK: u8 = 4;
pub(crate) const STATUS_FEATURES_OK: u8 = 8;
pub(crate) const STATUS_NEEDS_RESET: u8 = 0x40;
const STATUS_FAILED: u8 = 0x80;

/// Common configuration (struct virtio_pci_common_cfg) offsets.
pub(crate) const COMMON_DEVICE_FEATURE_SELECT: u64 = 0x00;
pub(crate) const COMMON_DEVICE_FEATURE: u64 = 0x04;
pub(crate) const COMMON_DRIVER_FEATURE_SELECT: u64 = 0x08;
pub(crate) const COMMON_DRIVER_FEATURE: u64 = 0x0c;
pub(crate) const COMMON_CONFIG_MSIX_VECTOR: u64 = 0x10;
pub(crate) const COMMON_NUM_QUEUES: u64 = 0x12;
pub(crate) const COMMON_DEVICE_STATUS: u64 = 0x14;
const COMMON_CONFIG_GENERATION: u64 = 0x15;
pub(crate) const COMMON_QUEUE_SELECT: u64 = 0x16;
pub(crate) const COMMON_QUEUE_SIZE: u64 = 0x18;
pub(crate) const COMMON_QUEUE_MSIX_VECTOR: u64 = 0x1a;
pub(crate) const COMMON_QUEUE_ENABLE: u64 = 0x1c;
pub(crate) const COMMON_QUEUE_NOTIFY_OFF: u64 = 0x1e;
pub(crate) const COMMON_QUEUE_DESC: u64 = 0x20;
pub(crate) const COMMON_QUEUE_DRIVER: u64 = 0x28;
pub(crate) const COMMON_QUEUE_DEVICE: u64 = 0x30;
/// The fields up to queue_device (virtio 1.0's structure).
const COMMON_MIN_LEN: u32 = 0x38;

pub const NO_VECTOR: u16 = 0xffff;

/// One virtio structure: its address (identity mapped) and length.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    pub addr: u64,
    pub len: u32,
}

/// The virtio structures a device's vendor capabilities place (spec 4.1.4): the first one of
/// each type, and the notify offset multiplier.
pub(crate) struct Structures {
    pub common: Option<Region>,
    pub notify: Option<Region>,
    pub isr: Option<Region>,
    pub device: Option<Region>,
    pub notify_multiplier: u32,
}

/// Walks the vendor capabilities of `device` (memory decoding on). A malformed capability (too
/// short, a BAR without an address, a structure above the mapped range) fails with EXIT_FAIL;
/// reserved BAR values and unknown types are skipped.
pub(crate) fn structures(workload: &str, device: u8) -> Structures {
    let mut found: [Option<Region>; 5] = [None; 5];
    let mut notify_multiplier = 0;
    for (pointer, id) in pci::capabilities(device) {
        if id != pci::CAP_VENDOR {
            continue;
        }
        let header = pci::config_read(device, pointer);
        let cap_len = (header >> 16) as u8;
        let cfg_type = (header >> 24) as u8;
        if !(CFG_COMMON..=CFG_DEVICE).contains(&cfg_type) || found[cfg_type as usize].is_some() {
            continue;
        }
        if cap_len < 16 || (cfg_type == CFG_NOTIFY && cap_len < 20) {
            fail(
                workload,
                format_args!(
                    "virtio capability type {cfg_type} at {pointer:#x} is {cap_len} bytes long"
                ),
            );
        }
        let bar = pci::config_read(device, pointer + 4) as u8;
        if bar > 5 {
            // Reserved BAR values: the driver must ignore the structure (spec 4.1.4).
            continue;
        }
        let offset = pci::config_read(device, pointer + 8);
        let len = pci::config_read(device, pointer + 12);
        let base = pci::bar_address(device, bar).unwrap_or_else(|err| {
            fail(
                workload,
                format_args!("virtio capability type {cfg_type}: BAR {bar} {err}"),
            )
        });
        let addr = base + u64::from(offset);
        if !crate::boot::is_mapped(addr, u64::from(len)) {
            fail(
                workload,
                format_args!(
                    "virtio capability type {cfg_type} at {addr:#x} is above the mapped range"
                ),
            );
        }
        if cfg_type == CFG_NOTIFY {
            notify_multiplier = pci::config_read(device, pointer + 16);
        }
        found[cfg_type as usize] = Some(Region { addr, len });
    }
    Structures {
        common: found[CFG_COMMON as usize],
        notify: found[CFG_NOTIFY as usize],
        isr: found[CFG_ISR as usize],
        device: found[CFG_DEVICE as usize],
        notify_multiplier,
    }
}

/// The feature bits the device offers (device_feature, both halves).
pub(crate) fn device_features(common: u64) -> u64 {
    write32(common + COMMON_DEVICE_FEATURE_SELECT, 0);
    let low = read32(common + COMMON_DEVICE_FEATURE);
    write32(common + COMMON_DEVICE_FEATURE_SELECT, 1);
    let high = read32(common + COMMON_DEVICE_FEATURE);
    u64::from(high) << 32 | u64::from(low)
}

/// Writes both halves of driver_feature.
pub(crate) fn write_driver_features(common: u64, features: u64) {
    write32(common + COMMON_DRIVER_FEATURE_SELECT, 0);
    write32(common + COMMON_DRIVER_FEATURE, features as u32);
    write32(common + COMMON_DRIVER_FEATURE_SELECT, 1);
    write32(common + COMMON_DRIVER_FEATURE, (features >> 32) as u32);
}

pub struct VirtioPci {
    pub workload: &'static str,
    /// PCI device number on bus 0.
    pub device: u8,
    common: u64,
    notify: Region,
    notify_multiplier: u32,
    device_config: Option<Region>,
    /// Features both sides agreed on (after FEATURES_OK).
    pub features: u64,
}

fn read8(addr: u64) -> u8 {
    // SAFETY: `addr` lies in a virtio structure inside a memory BAR in a mapped range
    // (checked in `find`), identity mapped and user accessible; the access traps to the VMM.
    unsafe { (addr as *const u8).read_volatile() }
}

fn read16(addr: u64) -> u16 {
    // SAFETY: as in `read8`.
    unsafe { (addr as *const u16).read_volatile() }
}

fn read32(addr: u64) -> u32 {
    // SAFETY: as in `read8`.
    unsafe { (addr as *const u32).read_volatile() }
}

fn write8(addr: u64, value: u8) {
    // SAFETY: as in `read8`.
    unsafe { (addr as *mut u8).write_volatile(value) }
}

fn write16(addr: u64, value: u16) {
    // SAFETY: as in `read8`.
    unsafe { (addr as *mut u16).write_volatile(value) }
}

fn write32(addr: u64, value: u32) {
    // SAFETY: as in `read8`.
    unsafe { (addr as *mut u32).write_volatile(value) }
}

/// 64-bit fields as two 32-bit writes, low half first (spec 4.1.3.1 allows it; no 64-bit MMIO).
fn write64(addr: u64, value: u64) {
    write32(addr, value as u32);
    write32(addr + 4, (value >> 32) as u32);
}

impl VirtioPci {
    /// Finds the modern virtio device of `device_type` on bus 0, turns on memory decoding and
    /// bus mastering, and locates its virtio structures. A missing device fails with
    /// EXIT_SETUP; a malformed capability with EXIT_FAIL.
    pub fn find(workload: &'static str, device_type: u16) -> VirtioPci {
        let device_id = MODERN_DEVICE_BASE + device_type;
        let Some(device) = pci::find(VIRTIO_VENDOR, device_id) else {
            fail_setup(
                workload,
                format_args!("no virtio device {VIRTIO_VENDOR:04x}:{device_id:04x} on bus 0"),
            );
        };
        VirtioPci::at(workload, device, device_type)
    }

    /// As [`VirtioPci::find`], for the device in slot `device` (a hot-plugged one), which
    /// must be of `device_type`.
    pub fn at(workload: &'static str, device: u8, device_type: u16) -> VirtioPci {
        let device_id = MODERN_DEVICE_BASE + device_type;
        let ids = pci::config_read(device, 0);
        if ids != u32::from(VIRTIO_VENDOR) | u32::from(device_id) << 16 {
            fail(
                workload,
                format_args!(
                    "00:{device:02x}.0 is {ids:#010x}, not virtio device {VIRTIO_VENDOR:04x}:{device_id:04x}"
                ),
            );
        }
        pci::enable_memory_and_bus_master(device);
        let command = pci::command(device);
        if command & 0x6 != 0x6 {
            fail(
                workload,
                format_args!(
                    "memory decoding or bus mastering did not turn on (command {command:#x})"
                ),
            );
        }

        let structures = structures(workload, device);
        let notify_multiplier = structures.notify_multiplier;
        let required = |region: Option<Region>, cfg_type: u8, name: &str| -> Region {
            match region {
                Some(region) => region,
                None => fail(
                    workload,
                    format_args!("no virtio {name} capability (cfg_type {cfg_type})"),
                ),
            }
        };
        let common = required(structures.common, CFG_COMMON, "common configuration");
        let notify = required(structures.notify, CFG_NOTIFY, "notification");
        let isr = required(structures.isr, CFG_ISR, "ISR");
        if common.len < COMMON_MIN_LEN {
            fail(
                workload,
                format_args!(
                    "common configuration is {} bytes, expected at least {COMMON_MIN_LEN}",
                    common.len
                ),
            );
        }
        let device_config = structures.device;
        println!(
            "{workload}: 00:{device:02x}.0 {VIRTIO_VENDOR:04x}:{device_id:04x} common {:#x} notify {:#x} (multiplier {notify_multiplier}) isr {:#x} device {:#x}",
            common.addr,
            notify.addr,
            isr.addr,
            device_config.map_or(0, |region| region.addr)
        );
        VirtioPci {
            workload,
            device,
            common: common.addr,
            notify,
            notify_multiplier,
            device_config,
            features: 0,
        }
    }

    /// Its slot on bus 0.
    pub fn slot(&self) -> u8 {
        self.device
    }

    /// Writes 0 to the device status: the device stops using its queues (spec 2.4).
    pub fn reset(&self) {
        self.set_status(0);
    }

    pub fn status(&self) -> u8 {
        read8(self.common + COMMON_DEVICE_STATUS)
    }

    fn set_status(&self, status: u8) {
        write8(self.common + COMMON_DEVICE_STATUS, status);
    }

    /// Marks the device FAILED and reports `what` (EXIT_FAIL).
    pub fn fail(&self, what: core::fmt::Arguments) -> ! {
        self.set_status(self.status() | STATUS_FAILED);
        fail(self.workload, what)
    }

    /// Reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK (spec 3.1.1 steps 1-6). Acks
    /// VERSION_1 and whatever of `optional` the device offers; returns the accepted set.
    pub fn initialize(&mut self, optional: u64) -> u64 {
        self.set_status(0);
        let deadline = Deadline::after_ms(super::REQUEST_TIMEOUT_MS);
        while self.status() != 0 {
            if deadline.expired() {
                fail(
                    self.workload,
                    format_args!("device status still {:#x} after reset", self.status()),
                );
            }
            crate::arch::pause();
        }
        self.set_status(STATUS_ACKNOWLEDGE);
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);

        let offered = device_features(self.common);
        if offered & F_VERSION_1 == 0 {
            self.fail(format_args!(
                "device does not offer VIRTIO_F_VERSION_1 (features {offered:#x})"
            ));
        }
        let accepted = offered & (F_VERSION_1 | optional);
        write_driver_features(self.common, accepted);
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
        let status = self.status();
        if status & STATUS_FEATURES_OK == 0 {
            self.fail(format_args!(
                "device did not accept features {accepted:#x} (status {status:#x})"
            ));
        }
        println!(
            "{}: features offered {offered:#x} accepted {accepted:#x}",
            self.workload
        );
        self.features = accepted;
        accepted
    }

    /// Sets up queue `index` (spec 4.1.5.1.3) with at most [`MAX_QUEUE_SIZE`] entries and
    /// enables it; `msix_vector` is written to queue_msix_vector and must read back.
    pub fn setup_queue(&self, dma: &mut Dma, index: u16, msix_vector: Option<u16>) -> SplitQueue {
        let queues = read16(self.common + COMMON_NUM_QUEUES);
        if index >= queues {
            self.fail(format_args!(
                "device has {queues} queues, needs queue {index}"
            ));
        }
        write16(self.common + COMMON_QUEUE_SELECT, index);
        let max = read16(self.common + COMMON_QUEUE_SIZE);
        if max == 0 {
            self.fail(format_args!("queue {index} is not available (size 0)"));
        }
        // The largest power of two the device allows, at most MAX_QUEUE_SIZE.
        let limit = max.min(MAX_QUEUE_SIZE);
        let size = 1u16 << (15 - limit.leading_zeros());
        if read16(self.common + COMMON_QUEUE_ENABLE) != 0 {
            self.fail(format_args!("queue {index} is enabled right after reset"));
        }
        let notify_off = read16(self.common + COMMON_QUEUE_NOTIFY_OFF);
        let notify_offset = u64::from(notify_off) * u64::from(self.notify_multiplier);
        if notify_offset + 2 > u64::from(self.notify.len) {
            self.fail(format_args!(
                "queue {index} notify offset {notify_offset:#x} lies outside the {}-byte notify region",
                self.notify.len
            ));
        }
        let queue = SplitQueue::new(dma, index, size, self.notify.addr + notify_offset);
        write16(self.common + COMMON_QUEUE_SIZE, size);
        write64(self.common + COMMON_QUEUE_DESC, queue.desc);
        write64(self.common + COMMON_QUEUE_DRIVER, queue.avail);
        write64(self.common + COMMON_QUEUE_DEVICE, queue.used);
        if let Some(vector) = msix_vector {
            write16(self.common + COMMON_QUEUE_MSIX_VECTOR, vector);
            let got = read16(self.common + COMMON_QUEUE_MSIX_VECTOR);
            if got != vector {
                self.fail(format_args!(
                    "queue {index} MSI-X vector reads back {got:#x} after writing {vector}"
                ));
            }
        }
        write16(self.common + COMMON_QUEUE_ENABLE, 1);
        if read16(self.common + COMMON_QUEUE_ENABLE) != 1 {
            self.fail(format_args!("queue {index} did not enable"));
        }
        queue
    }

    /// The configuration-change interrupt vector (NO_VECTOR: none).
    pub fn set_config_vector(&self, vector: u16) {
        write16(self.common + COMMON_CONFIG_MSIX_VECTOR, vector);
    }

    /// DRIVER_OK: the device is live (spec 3.1.1 step 8).
    pub fn driver_ok(&self) {
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK);
        let status = self.status();
        if status & STATUS_DRIVER_OK == 0 || status & STATUS_NEEDS_RESET != 0 {
            fail(
                self.workload,
                format_args!("device status {status:#x} after DRIVER_OK"),
            );
        }
    }

    /// The address of device-specific configuration bytes `[offset, offset + len)`.
    fn device_config(&self, offset: u32, len: u32) -> u64 {
        match self.device_config {
            Some(region) if offset + len <= region.len => region.addr + u64::from(offset),
            Some(region) => self.fail(format_args!(
                "device configuration is {} bytes, needs {}",
                region.len,
                offset + len
            )),
            None => self.fail(format_args!("no device configuration capability")),
        }
    }

    /// Reads device configuration with `read` until config_generation is the same before and
    /// after (spec 4.1.4.3.1: a multi-byte read may see a change half done).
    pub fn read_config<T>(&self, read: impl Fn(&Self) -> T) -> T {
        for _ in 0..100 {
            let before = read8(self.common + COMMON_CONFIG_GENERATION);
            let value = read(self);
            if read8(self.common + COMMON_CONFIG_GENERATION) == before {
                return value;
            }
        }
        self.fail(format_args!("config_generation keeps changing"))
    }

    pub fn config8(&self, offset: u32) -> u8 {
        read8(self.device_config(offset, 1))
    }

    pub fn config32(&self, offset: u32) -> u32 {
        read32(self.device_config(offset, 4))
    }

    /// Writes a 32-bit device configuration field the driver owns (the balloon's `actual`).
    pub fn write_config32(&self, offset: u32, value: u32) {
        write32(self.device_config(offset, 4), value);
    }

    /// A 64-bit field as two 32-bit reads (call inside [`VirtioPci::read_config`]).
    pub fn config64(&self, offset: u32) -> u64 {
        let addr = self.device_config(offset, 8);
        u64::from(read32(addr)) | u64::from(read32(addr + 4)) << 32
    }
}
