//! The hostile driver's own small driver: the devices it attacks, their virtio-pci structures
//! (found through the transport's capability walk), raw status and feature registers, split
//! rings it writes descriptor by descriptor, and the descriptors themselves.

use core::sync::atomic::{fence, Ordering};

use super::memory::{get16, get32, get8, put16, put32, put64, put8};
use super::{fail, Text, ATTACK_WAIT_MS, NAME};
use crate::println;
use crate::virtio::pci;
use crate::virtio::queue::{DESC_F_NEXT, DESC_F_WRITE};
use crate::virtio::transport::{
    self, COMMON_DEVICE_STATUS, COMMON_NUM_QUEUES, COMMON_QUEUE_SELECT, F_VERSION_1,
    MODERN_DEVICE_BASE, STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FEATURES_OK,
    TYPE_BLOCK, TYPE_ENTROPY, TYPE_NET, TYPE_VSOCK, VIRTIO_VENDOR,
};
use crate::virtio::Deadline;

/// VIRTIO_F_INDIRECT_DESC.
pub(super) const F_INDIRECT_DESC: u64 = 1 << 28;
pub(super) const DESC_F_INDIRECT: u16 = 4;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Blk,
    Rng,
    Vsock,
    Net,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Blk => "blk",
            Kind::Rng => "rng",
            Kind::Vsock => "vsock",
            Kind::Net => "net",
        }
    }

    pub(super) fn device_type(self) -> u16 {
        match self {
            Kind::Net => TYPE_NET,
            Kind::Blk => TYPE_BLOCK,
            Kind::Rng => TYPE_ENTROPY,
            Kind::Vsock => TYPE_VSOCK,
        }
    }

    /// Queues the driver sets up: block and entropy 1, net rx + tx, vsock rx, tx, event.
    pub(super) fn queues(self) -> u16 {
        match self {
            Kind::Blk | Kind::Rng => 1,
            Kind::Net => 2,
            Kind::Vsock => 3,
        }
    }

    /// The queue the chain attacks go to (net and vsock: transmit).
    pub(super) fn attack_queue(self) -> u16 {
        match self {
            Kind::Blk | Kind::Rng => 0,
            Kind::Net | Kind::Vsock => 1,
        }
    }

    /// Optional features acked besides VERSION_1.
    pub(super) fn features(self) -> u64 {
        match self {
            Kind::Rng => F_INDIRECT_DESC,
            _ => 0,
        }
    }
}

#[derive(Clone, Copy)]
pub(super) struct Dev {
    pub(super) kind: Kind,
    pub(super) pci_device: u8,
    pub(super) bar0: u64,
    pub(super) common: u64,
    pub(super) notify: u64,
    pub(super) notify_multiplier: u32,
    pub(super) notify_len: u32,
    pub(super) device_config: u64,
    pub(super) device_config_len: u32,
}

impl Dev {
    /// The first modern virtio device of `kind` on bus 0, with memory decoding and bus
    /// mastering on; `None` when there is none.
    pub(super) fn find(kind: Kind) -> Option<Dev> {
        let device_id = MODERN_DEVICE_BASE + kind.device_type();
        let device = pci::find(VIRTIO_VENDOR, device_id)?;
        pci::enable_memory_and_bus_master(device);
        let structures = transport::structures(NAME, device);
        let (Some(common), Some(notify)) = (structures.common, structures.notify) else {
            fail(format_args!(
                "{}: virtio device at 00:{device:02x}.0 lacks its common or notify structure",
                kind.name()
            ));
        };
        let bar0 = pci::bar_address(device, 0).unwrap_or(common.addr);
        let device_config = structures
            .device
            .map_or((0, 0), |region| (region.addr, region.len));
        println!(
            "{NAME}: {} at 00:{device:02x}.0, BAR0 {bar0:#x}, common {:#x}, notify {:#x}",
            kind.name(),
            common.addr,
            notify.addr
        );
        Some(Dev {
            kind,
            pci_device: device,
            bar0,
            common: common.addr,
            notify: notify.addr,
            notify_multiplier: structures.notify_multiplier,
            notify_len: notify.len,
            device_config: device_config.0,
            device_config_len: device_config.1,
        })
    }

    pub(super) fn status(&self) -> u8 {
        get8(self.common + COMMON_DEVICE_STATUS)
    }

    pub(super) fn set_status(&self, status: u8) {
        put8(self.common + COMMON_DEVICE_STATUS, status);
    }

    /// Writes 0 to device_status and waits for it to read 0 (a device that does not reset
    /// within a second is a failure).
    pub(super) fn reset(&self) {
        self.set_status(0);
        let deadline = Deadline::after_ms(ATTACK_WAIT_MS);
        while self.status() != 0 {
            if deadline.expired() {
                fail(format_args!(
                    "{}: device status still {:#x} a second after a reset",
                    self.kind.name(),
                    self.status()
                ));
            }
            crate::arch::pause();
        }
    }

    pub(super) fn num_queues(&self) -> u16 {
        get16(self.common + COMMON_NUM_QUEUES)
    }

    pub(super) fn select(&self, queue: u16) {
        put16(self.common + COMMON_QUEUE_SELECT, queue);
    }

    pub(super) fn offered_features(&self) -> u64 {
        transport::device_features(self.common)
    }

    pub(super) fn write_driver_features(&self, features: u64) {
        transport::write_driver_features(self.common, features);
    }

    /// ACKNOWLEDGE, DRIVER, VERSION_1 plus `optional` where offered, FEATURES_OK.
    pub(super) fn negotiate(&self, optional: u64) -> Result<u64, Text> {
        self.set_status(STATUS_ACKNOWLEDGE);
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        let offered = self.offered_features();
        if offered & F_VERSION_1 == 0 {
            return Err(text!("VERSION_1 not offered (features {offered:#x})"));
        }
        let accepted = offered & (F_VERSION_1 | optional);
        self.write_driver_features(accepted);
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
        let status = self.status();
        if status & STATUS_FEATURES_OK == 0 {
            return Err(text!(
                "features {accepted:#x} not accepted (status {status:#x})"
            ));
        }
        Ok(accepted)
    }

    pub(super) fn driver_ok(&self) -> u8 {
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK);
        self.status()
    }

    pub(super) fn config64(&self, offset: u64) -> u64 {
        if self.device_config == 0 {
            return 0;
        }
        let low = get32(self.device_config + offset);
        let high = get32(self.device_config + offset + 4);
        u64::from(high) << 32 | u64::from(low)
    }
}

/// One split virtqueue as the driver wrote it.
#[derive(Clone, Copy, Default)]
pub(super) struct Ring {
    pub(super) queue: u16,
    pub(super) size: u16,
    pub(super) desc: u64,
    pub(super) avail: u64,
    pub(super) used: u64,
    pub(super) notify: u64,
    /// The available index the driver publishes next.
    pub(super) next_avail: u16,
}

impl Ring {
    pub(super) fn set_desc(&self, table: u64, index: u32, d: D) {
        let entry = table + 16 * u64::from(index);
        put64(entry, d.addr);
        put32(entry + 8, d.len);
        put16(entry + 12, d.flags);
        put16(entry + 14, d.next);
    }

    /// Puts `head` in the available ring and publishes it.
    pub(super) fn offer(&mut self, head: u16) {
        put16(
            self.avail + 4 + 2 * u64::from(self.next_avail % self.size),
            head,
        );
        fence(Ordering::SeqCst);
        self.next_avail = self.next_avail.wrapping_add(1);
        put16(self.avail + 2, self.next_avail);
    }

    pub(super) fn notify(&self) {
        fence(Ordering::SeqCst);
        put16(self.notify, self.queue);
    }

    pub(super) fn used_index(&self) -> u16 {
        get16(self.used + 2)
    }

    /// The used element at index `at` (id, len).
    pub(super) fn used_element(&self, at: u16) -> (u32, u32) {
        fence(Ordering::SeqCst);
        let element = self.used + 4 + 8 * u64::from(at % self.size);
        (get32(element), get32(element + 4))
    }

    /// The first used element after `since`, waiting at most `ms`.
    pub(super) fn wait_used(&self, since: u16, ms: u64) -> Option<(u32, u32)> {
        let deadline = Deadline::after_ms(ms);
        loop {
            if self.used_index() != since {
                return Some(self.used_element(since));
            }
            if deadline.expired() {
                return None;
            }
            crate::arch::pause();
        }
    }
}

/// A descriptor as the attack writes it.
#[derive(Clone, Copy)]
pub(super) struct D {
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) flags: u16,
    pub(super) next: u16,
}

impl D {
    pub(super) fn r(addr: u64, len: u32) -> D {
        D {
            addr,
            len,
            flags: 0,
            next: 0,
        }
    }

    pub(super) fn w(addr: u64, len: u32) -> D {
        D {
            addr,
            len,
            flags: DESC_F_WRITE,
            next: 0,
        }
    }

    pub(super) fn to(mut self, next: u16) -> D {
        self.flags |= DESC_F_NEXT;
        self.next = next;
        self
    }

    pub(super) fn flag(mut self, flag: u16) -> D {
        self.flags |= flag;
        self
    }
}

/// A well-formed request for the attacked queue, which the chain attacks bend: up to four
/// descriptors, and the one whose address and length the attacks change (`payload`).
#[derive(Clone, Copy)]
pub(super) struct Template {
    pub(super) d: [D; 4],
    pub(super) n: usize,
    pub(super) payload: usize,
}

impl Template {
    /// The descriptors chained 0 -> 1 -> ... in table order.
    pub(super) fn linked(&self) -> [D; 4] {
        let mut d = self.d;
        for (i, entry) in d.iter_mut().enumerate().take(self.n - 1) {
            *entry = entry.to(i as u16 + 1);
        }
        d
    }
}
