//! Register attacks every device gets: bad queue sizes and ring addresses, DRIVER_OK on rings
//! outside RAM, status written out of order, queue registers rewritten on a live device,
//! every width at every offset, BAR0 outside the registers, garbage MSI-X vectors.

use core::fmt::Write;
use core::sync::atomic::{fence, Ordering};

use super::memory::{
    get16, mmio_read, mmio_write, peek64_low, poke16_low, poke64_low, put16, put32, put64,
};
use super::session::Session;
use super::{fail, Outcome, OUTSIDE};
use crate::virtio::pci;
use crate::virtio::transport::{
    COMMON_CONFIG_MSIX_VECTOR, COMMON_QUEUE_DESC, COMMON_QUEUE_DEVICE, COMMON_QUEUE_DRIVER,
    COMMON_QUEUE_ENABLE, COMMON_QUEUE_MSIX_VECTOR, COMMON_QUEUE_SIZE, F_VERSION_1,
    STATUS_ACKNOWLEDGE, STATUS_DRIVER, STATUS_DRIVER_OK, STATUS_FEATURES_OK, STATUS_NEEDS_RESET,
};

/// Register attacks every device gets.
pub(super) fn attacks(s: &mut Session, n: &mut u32) {
    s.attack(n, "queue size not a power of two", |s| {
        s.renegotiate(false);
        let queue = s.kind().attack_queue();
        s.dev.select(queue);
        let max = get16(s.dev.common + COMMON_QUEUE_SIZE);
        let mut reads = [0u16; 3];
        for (i, size) in [0u16, 100, 0xffff].into_iter().enumerate() {
            put16(s.dev.common + COMMON_QUEUE_SIZE, size);
            reads[i] = get16(s.dev.common + COMMON_QUEUE_SIZE);
        }
        // Leave the size as the last write left it and go on to DRIVER_OK.
        if let Err(err) = s.setup_queues(Some(100)) {
            return Outcome::broken(text!("size writes 0/100/0xffff read back {reads:?}; {err}"));
        }
        let status = s.dev.driver_ok();
        let size = s.attack_ring().size;
        let mut text = if reads.iter().all(|&r| r == max) && size == max {
            text!("refused (size stays {max})")
        } else {
            text!("size writes 0/100/0xffff read back {reads:?}, {size} at DRIVER_OK")
        };
        if let Err(err) = s.after_driver_ok() {
            let _ = write!(text, "; {err}");
            return Outcome::broken(text);
        }
        if !size.is_power_of_two() {
            let _ = write!(text, "; status {status:#x}");
            return Outcome::broken(text);
        }
        Outcome::fine(text)
    });
    for (label, which) in [
        ("descriptor table outside RAM, then DRIVER_OK", 0),
        ("used ring outside RAM, then DRIVER_OK", 1),
        (
            "descriptor table straddling the end of RAM, then DRIVER_OK",
            2,
        ),
    ] {
        s.attack(n, label, |s| {
            s.renegotiate(true);
            let ring = s.attack_ring();
            s.dev.select(ring.queue);
            let (register, addr) = match which {
                0 => (COMMON_QUEUE_DESC, OUTSIDE),
                1 => (COMMON_QUEUE_DEVICE, OUTSIDE),
                _ => (COMMON_QUEUE_DESC, s.ram_end - 8 * u64::from(ring.size)),
            };
            put32(s.dev.common + register, addr as u32);
            put32(s.dev.common + register + 4, (addr >> 32) as u32);
            let status = s.dev.driver_ok();
            // Kicks for a device that could not start go nowhere.
            ring.notify();
            if status & STATUS_NEEDS_RESET == 0 {
                fail(format_args!(
                    "{} {label}: status {status:#x} after DRIVER_OK, DEVICE_NEEDS_RESET expected",
                    s.kind().name()
                ));
            }
            Outcome::broken(text!("needs reset (status {status:#x})"))
        });
    }
    s.attack(n, "available ring at guest-physical 0", |s| {
        s.renegotiate(true);
        let ring = s.attack_ring();
        s.dev.select(ring.queue);
        put32(s.dev.common + COMMON_QUEUE_DRIVER, 0);
        put32(s.dev.common + COMMON_QUEUE_DRIVER + 4, 0);
        let status = s.dev.driver_ok();
        if status & STATUS_NEEDS_RESET != 0 {
            return Outcome::broken(text!("needs reset (status {status:#x})"));
        }
        // Keep what low memory held (the real-mode vector table, unused here).
        let low_len = 4 + 2 * u64::from(ring.size) + 2;
        let mut saved = [0u64; 72];
        for (i, word) in saved.iter_mut().enumerate() {
            *word = peek64_low(8 * i as u64);
        }
        for i in 0..low_len.div_ceil(8) {
            poke64_low(8 * i, 0);
        }
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(ring.desc, i as u32, entry);
        }
        let since = ring.used_index();
        poke16_low(4, 0);
        fence(Ordering::SeqCst);
        poke16_low(2, 1);
        s.arm();
        ring.notify();
        let outcome = s.classify(since, 0);
        // Reset while the ring is still there: a device that spins on it never lets the
        // reset finish (putting low memory back first would hide that).
        s.dev.reset();
        for (i, word) in saved.iter().enumerate() {
            poke64_low(8 * i as u64, *word);
        }
        Outcome::broken(outcome.text)
    });
    s.attack(n, "notify of queues that do not exist", |s| {
        let queues = s.dev.num_queues();
        let multiplier = u64::from(s.dev.notify_multiplier.max(2));
        s.arm();
        // Past the notify area, at its end, a bogus index at queue 0's address, every width.
        put16(s.dev.notify + u64::from(queues) * multiplier, queues);
        put16(s.dev.notify + 0xffe, 0xffff);
        put16(s.dev.notify, 0xffff);
        for width in [1, 2, 4, 8] {
            mmio_write(s.dev.notify + 1, width.min(2), 0xffff);
            mmio_write(s.dev.notify, width, u64::MAX);
        }
        Outcome::fine(text!("ignored (status {:#x})", s.dev.status()))
    });
    s.attack(n, "device status out of order", |s| {
        s.dev.reset();
        s.dev.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_DRIVER_OK);
        let early = s.dev.status();
        s.dev.reset();
        s.dev.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        let offered = s.dev.offered_features();
        s.dev.write_driver_features(offered | 1 << 63 | F_VERSION_1);
        s.dev.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
        let unoffered = s.dev.status();
        if let Err(err) = s.bring_up() {
            fail(format_args!("{}: {err}", s.kind().name()));
        }
        // Live device: features again, bits cleared without a reset, FAILED.
        s.dev.write_driver_features(u64::MAX);
        s.dev.set_status(STATUS_ACKNOWLEDGE);
        let cleared = s.dev.status();
        let mut text = text!(
            "DRIVER_OK without FEATURES_OK reads {early:#x}, unoffered feature reads {unoffered:#x}, clearing bits reads {cleared:#x}"
        );
        if early & STATUS_DRIVER_OK != 0 || unoffered & STATUS_FEATURES_OK != 0 {
            let _ = write!(text, " (accepted!)");
        }
        Outcome::fine(text)
    });
    s.attack(n, "queue registers rewritten after DRIVER_OK", |s| {
        let ring = s.attack_ring();
        s.dev.select(ring.queue);
        put16(s.dev.common + COMMON_QUEUE_SIZE, 100);
        put64(s.dev.common + COMMON_QUEUE_DESC, OUTSIDE);
        put64(s.dev.common + COMMON_QUEUE_DEVICE, 0);
        put16(s.dev.common + COMMON_QUEUE_ENABLE, 0);
        let size = get16(s.dev.common + COMMON_QUEUE_SIZE);
        let desc = mmio_read(s.dev.common + COMMON_QUEUE_DESC, 8);
        if size == ring.size && desc == ring.desc {
            Outcome::fine(text!("refused"))
        } else {
            Outcome::fine(text!("size reads {size}, desc {desc:#x}"))
        }
    });
    s.attack(n, "every width at every common configuration offset", |s| {
        for value in [u64::MAX, 0x8000_0001_8000_0001, 0x0000_0004_0000_0101] {
            for width in [1u32, 2, 4, 8] {
                for offset in 0..0x48u64 {
                    mmio_write(s.dev.common + offset, width, value);
                    let _ = mmio_read(s.dev.common + offset, width);
                }
            }
        }
        Outcome::broken(text!("survived (status {:#x})", s.dev.status()))
    });
    s.attack(n, "every width at every device configuration offset", |s| {
        if s.dev.device_config == 0 {
            return Outcome::fine(text!("no device configuration"));
        }
        let len = u64::from(s.dev.device_config_len).min(0x100);
        for value in [u64::MAX, 0] {
            for width in [1u32, 2, 4, 8] {
                for offset in 0..len {
                    mmio_write(s.dev.device_config + offset, width, value);
                    let _ = mmio_read(s.dev.device_config + offset, width);
                }
            }
        }
        Outcome::fine(text!("survived (status {:#x})", s.dev.status()))
    });
    s.attack(n, "BAR0 accesses outside every register", |s| {
        for offset in [
            0x40u64,
            0x48,
            0x800,
            0xff8,
            0x1004,
            0x1ff8,
            0x3ff8,
            0x4000 + 16 * 2047,
            0xbff8,
            0xc100,
            0xfff8,
        ] {
            for width in [1u32, 2, 4, 8] {
                if offset + u64::from(width) > 0x1_0000 {
                    continue;
                }
                mmio_write(s.dev.bar0 + offset, width, u64::MAX);
                let _ = mmio_read(s.dev.bar0 + offset, width);
            }
        }
        Outcome::broken(text!("ignored (status {:#x})", s.dev.status()))
    });
    s.attack(n, "MSI-X vectors with garbage addresses and data", |s| {
        let Some(msix) = pci::Msix::find(s.dev.pci_device) else {
            return Outcome::fine(text!("no MSI-X capability"));
        };
        let Ok(table_bar) = pci::bar_address(s.dev.pci_device, msix.table_bar) else {
            return Outcome::fine(text!("MSI-X table BAR unassigned"));
        };
        let table = table_bar + u64::from(msix.table_offset);
        let entries = u64::from(msix.table_size);
        let garbage = [
            (0xffff_ffffu32, 0xdead_beefu32, 0xffff_ffffu32),
            (0, 0, 0),
            (0xfee0_0000, 0, 0x0e),
            (0x1000, 0xffff_ffff, 0x4_00ff),
        ];
        // Every entry, and one past the table.
        for entry in 0..=entries {
            let (low, high, data) = garbage[(entry % 4) as usize];
            let at = table + 16 * entry;
            put32(at, low);
            put32(at + 4, high);
            put32(at + 8, data);
            put32(at + 12, 0);
        }
        let pointer = msix.pointer();
        let control = pci::config_read(s.dev.pci_device, pointer);
        msix.enable();
        // Config vector and every queue's: in range, out of range, NO_VECTOR.
        put16(s.dev.common + COMMON_CONFIG_MSIX_VECTOR, 0);
        let queue = s.kind().attack_queue();
        s.dev.select(queue);
        put16(s.dev.common + COMMON_QUEUE_MSIX_VECTOR, 0x7ff);
        let out_of_range = get16(s.dev.common + COMMON_QUEUE_MSIX_VECTOR);
        put16(
            s.dev.common + COMMON_QUEUE_MSIX_VECTOR,
            (queue + 1) % (entries as u16),
        );
        // Requests now signal through the garbage routes (RFLAGS.IF is clear in ring 3, so
        // whatever arrives stays pending).
        let served = s.good();
        // Masks flipping while the device signals.
        for _ in 0..64 {
            pci::config_write(s.dev.pci_device, pointer, control | 1 << 31 | 1 << 30);
            pci::config_write(s.dev.pci_device, pointer, control | 1 << 31);
        }
        pci::config_write(s.dev.pci_device, pointer, control & !(1 << 31));
        for entry in 0..entries {
            put32(table + 16 * entry + 12, 1);
        }
        let mut text = text!("vector 0x7ff reads back {out_of_range:#x}");
        match served {
            Ok(()) => {
                let _ = write!(text, ", requests served");
            }
            Err(err) => {
                let _ = write!(text, ", request failed: {err}");
            }
        }
        Outcome::broken(text)
    });
}
