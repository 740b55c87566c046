//! Ring-3 side of exception reporting and the panic handler.

use crate::console::{exit, print_line_unlocked};
use core::sync::atomic::{AtomicBool, Ordering};

/// Exit status after a CPU exception.
pub const EXCEPTION_EXIT_STATUS: u32 = 3;
/// Exit status after a Rust panic.
pub const PANIC_EXIT_STATUS: u32 = 4;

static REPORTING: AtomicBool = AtomicBool::new(false);

/// Entered by `iretq` from the ring-0 exception stub (see boot.rs), on the CPU's report stack.
#[no_mangle]
pub extern "sysv64" fn tg_exception_report(vector: u64, error: u64, rip: u64, cr2: u64) -> ! {
    // A fault while reporting (or on a second CPU) must not loop or interleave: exit directly.
    if REPORTING.swap(true, Ordering::AcqRel) {
        exit(EXCEPTION_EXIT_STATUS);
    }
    print_line_unlocked(format_args!(
        "testguest: exception {vector} err={error:#x} rip={rip:#x}"
    ));
    if vector == 14 {
        print_line_unlocked(format_args!("testguest: page fault address cr2={cr2:#x}"));
    }
    exit(EXCEPTION_EXIT_STATUS)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    if !REPORTING.swap(true, Ordering::AcqRel) {
        print_line_unlocked(format_args!("testguest: panic: {info}"));
    }
    exit(PANIC_EXIT_STATUS)
}
