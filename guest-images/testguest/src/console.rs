//! Serial output (16550 THR at 0x3f8, written directly) and the exit port (0xf4).

use crate::arch::{outl, pause};
use core::fmt::{self, Write};
use core::sync::atomic::{AtomicBool, Ordering};

const SERIAL_THR: u16 = 0x3f8;
const EXIT_PORT: u16 = 0xf4;

/// Serialises whole lines between CPUs (ring-3 spinlock).
static SERIAL_LOCK: AtomicBool = AtomicBool::new(false);

/// Collects a line so it goes out in one go: where ring-3 port I/O traps (see the #GP handler in
/// boot.rs), one `rep outsb` is one trap per line instead of one per byte. Either way the VMM
/// sees one single-byte write to the THR per character.
struct LineBuffer {
    bytes: [u8; 256],
    len: usize,
}

impl LineBuffer {
    fn flush(&mut self) {
        write_serial(&self.bytes[..self.len]);
        self.len = 0;
    }

    fn push(&mut self, byte: u8) {
        if self.len == self.bytes.len() {
            self.flush();
        }
        self.bytes[self.len] = byte;
        self.len += 1;
    }
}

impl Write for LineBuffer {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        s.bytes().for_each(|byte| self.push(byte));
        Ok(())
    }
}

/// Whether this CPU really runs ring 3 with IOPL=3 (hardware KVM). Under kvm_pvm the emulated
/// iretq drops IOPL, so I/O instructions fault and the ring-0 #GP handler performs them.
fn native_port_io() -> bool {
    let rflags: u64;
    // SAFETY: reads RFLAGS through the stack only.
    unsafe { core::arch::asm!("pushfq", "pop {}", out(reg) rflags, options(preserves_flags)) };
    rflags & 0x3000 == 0x3000
}

fn write_serial(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    if native_port_io() {
        // Single-byte writes: a native `rep outsb` would reach the VMM as one string I/O exit.
        for &byte in bytes {
            // SAFETY: port I/O to the emulated serial port touches no memory.
            unsafe {
                core::arch::asm!("out dx, al", in("dx") SERIAL_THR, in("al") byte,
                    options(nomem, nostack, preserves_flags));
            }
        }
        return;
    }
    // SAFETY: reads `bytes` only, writes them to the serial port; DF is clear per the ABI.
    unsafe {
        core::arch::asm!("rep outsb",
            inout("rcx") bytes.len() => _, inout("rsi") bytes.as_ptr() => _, in("dx") SERIAL_THR,
            options(nostack, preserves_flags, readonly));
    }
}

/// Writes one line (the arguments plus "\n") while holding the serial lock.
pub fn print_line(args: fmt::Arguments) {
    while SERIAL_LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        pause();
    }
    print_line_unlocked(args);
    SERIAL_LOCK.store(false, Ordering::Release);
}

/// For the exception/panic path, which must not wait for a lock the faulting code may hold.
pub fn print_line_unlocked(args: fmt::Arguments) {
    let mut line = LineBuffer {
        bytes: [0; 256],
        len: 0,
    };
    let _ = line.write_fmt(args);
    line.push(b'\n');
    line.flush();
}

#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => { $crate::console::print_line(format_args!($($arg)*)) };
}

/// Reports `status` to the VMM and stops this CPU (spins in case the exit is not immediate).
pub fn exit(status: u32) -> ! {
    outl(EXIT_PORT, status);
    loop {
        pause();
    }
}

/// Parks this CPU forever.
pub fn halt_forever() -> ! {
    loop {
        pause();
    }
}
