//! Memory and MMIO access of every width, and the guard: the watched area is copied before
//! each attack and compared afterwards, leaving out the used rings and the buffers the device
//! was allowed to write.

use core::sync::atomic::{fence, Ordering};

use super::driver::{Kind, D, DESC_F_INDIRECT};
use super::session::Session;
use super::vsock::rx_buffer;
use super::{fail, AREA_LEN, AREA_START, MAX_QUEUES, RINGS, RING_STRIDE, RX, RX_BUFFERS, SHADOW};
use crate::virtio::queue::DESC_F_WRITE;

pub(super) fn mmio_read(addr: u64, width: u32) -> u64 {
    // SAFETY: `addr` is in a BAR of a virtio device (in a mapped range, identity mapped,
    // user accessible) or guest RAM of the driver's area; the access touches nothing else.
    unsafe {
        match width {
            1 => u64::from((addr as *const u8).read_volatile()),
            2 => u64::from((addr as *const u16).read_volatile()),
            4 => u64::from((addr as *const u32).read_volatile()),
            _ => (addr as *const u64).read_volatile(),
        }
    }
}

pub(super) fn mmio_write(addr: u64, width: u32, value: u64) {
    // SAFETY: as in `mmio_read`.
    unsafe {
        match width {
            1 => (addr as *mut u8).write_volatile(value as u8),
            2 => (addr as *mut u16).write_volatile(value as u16),
            4 => (addr as *mut u32).write_volatile(value as u32),
            _ => (addr as *mut u64).write_volatile(value),
        }
    }
}

pub(super) fn put8(addr: u64, value: u8) {
    mmio_write(addr, 1, u64::from(value));
}
pub(super) fn put16(addr: u64, value: u16) {
    mmio_write(addr, 2, u64::from(value));
}
pub(super) fn put32(addr: u64, value: u32) {
    mmio_write(addr, 4, u64::from(value));
}
pub(super) fn put64(addr: u64, value: u64) {
    mmio_write(addr, 8, value);
}
pub(super) fn get8(addr: u64) -> u8 {
    mmio_read(addr, 1) as u8
}
pub(super) fn get16(addr: u64) -> u16 {
    mmio_read(addr, 2) as u16
}
pub(super) fn get32(addr: u64) -> u32 {
    mmio_read(addr, 4) as u32
}

/// A 16-bit store to low guest-physical memory (address 0 included), where a Rust pointer
/// may not go.
pub(super) fn poke16_low(addr: u64, value: u16) {
    // SAFETY: guest-physical memory below 1 MiB is identity mapped, user writable RAM; the
    // caller saved what it overwrites and puts it back.
    unsafe {
        core::arch::asm!("mov word ptr [{a}], {v:x}", a = in(reg) addr, v = in(reg) value,
            options(nostack, preserves_flags));
    }
}

pub(super) fn peek64_low(addr: u64) -> u64 {
    let value: u64;
    // SAFETY: as in `poke16_low`; a read.
    unsafe {
        core::arch::asm!("mov {v}, qword ptr [{a}]", a = in(reg) addr, v = out(reg) value,
            options(nostack, preserves_flags, readonly));
    }
    value
}

pub(super) fn poke64_low(addr: u64, value: u64) {
    // SAFETY: as in `poke16_low`.
    unsafe {
        core::arch::asm!("mov qword ptr [{a}], {v}", a = in(reg) addr, v = in(reg) value,
            options(nostack, preserves_flags));
    }
}

pub(super) fn fill(addr: u64, len: u64, byte: u8) {
    // SAFETY: the range lies in the driver's area (identity mapped RAM it owns).
    unsafe { core::ptr::write_bytes(addr as *mut u8, byte, len as usize) };
    fence(Ordering::SeqCst);
}

pub(super) fn copy(to: u64, from: u64, len: u64) {
    fence(Ordering::SeqCst);
    // SAFETY: both ranges lie in the driver's area and do not overlap.
    unsafe { core::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, len as usize) };
    fence(Ordering::SeqCst);
}

impl Session {
    /// The device may write `[addr, addr + len)` during this attack.
    pub(super) fn allow(&mut self, addr: u64, len: u64) {
        let area_end = AREA_START + AREA_LEN;
        let start = addr.max(AREA_START);
        let end = addr.saturating_add(len).min(area_end);
        if start >= end {
            return;
        }
        if self.writable[..self.writable_len].contains(&(start, end)) {
            return;
        }
        if self.writable_len == self.writable.len() {
            let last = &mut self.writable[self.writable_len - 1];
            *last = (last.0.min(start), last.1.max(end));
            return;
        }
        self.writable[self.writable_len] = (start, end);
        self.writable_len += 1;
    }

    /// Writes descriptor `index` of `table`, allowing the device to write its buffer.
    pub(super) fn desc(&mut self, table: u64, index: u32, d: D) {
        if d.flags & DESC_F_WRITE != 0 && d.flags & DESC_F_INDIRECT == 0 {
            self.allow(d.addr, u64::from(d.len));
        }
        self.attack_ring().set_desc(table, index, d);
    }

    /// Copies the area: from now on only the allowed ranges and the used rings may change.
    pub(super) fn arm(&mut self) {
        copy(SHADOW, AREA_START, AREA_LEN);
        self.armed = true;
    }

    /// Compares the area with its copy (FAIL on a byte the device had no business writing).
    pub(super) fn check(&mut self) {
        if !core::mem::replace(&mut self.armed, false) {
            return;
        }
        fence(Ordering::SeqCst);
        let mut addr = AREA_START;
        let end = AREA_START + AREA_LEN;
        while addr < end {
            if let Some(skip_to) = self.skip(addr) {
                addr = skip_to;
                continue;
            }
            // SAFETY: both words lie in the driver's area (identity mapped RAM).
            let (now, before) = unsafe {
                (
                    (addr as *const u64).read_volatile(),
                    ((SHADOW + addr - AREA_START) as *const u64).read_volatile(),
                )
            };
            if now != before {
                fail(format_args!(
                    "{} {}: guest memory at {addr:#x} changed from {before:#018x} to {now:#018x}, outside every device-writable buffer",
                    self.kind().name(),
                    self.current
                ));
            }
            addr += 8;
        }
    }

    /// Where the excluded range containing `addr` ends (used rings, allowed buffers).
    fn skip(&self, addr: u64) -> Option<u64> {
        for queue in 0..MAX_QUEUES as u64 {
            let used = RINGS + queue * RING_STRIDE + 8192;
            if (used..used + 4096).contains(&addr) {
                return Some(used + 4096);
            }
        }
        if self.kind() == Kind::Vsock {
            let rx_end = rx_buffer(RX_BUFFERS);
            if (RX..rx_end).contains(&addr) {
                return Some(rx_end);
            }
        }
        self.writable[..self.writable_len]
            .iter()
            .find(|(start, end)| *start <= addr && addr < *end)
            .map(|&(_, end)| (end + 7) & !7)
    }
}
