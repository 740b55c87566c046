//! Waiting for an MSI-X interrupt. Interrupts are only delivered in ring 0 on the CI
//! hypervisor (and ring 3 runs with IF=0 anyway), so, as in the `pci` workload, the workload
//! installs IDT gates and executes `hlt`: that faults in ring 3 and the #GP handler (boot.rs)
//! waits in ring 0 with `sti; hlt`. A one-shot local APIC timer bounds the wait.
//!
//! While the local APIC is software-disabled (its state at reset) KVM drops fixed interrupts,
//! so completions before [`enable_lapic`] leave nothing pending that a later wait could
//! mistake for a new interrupt.

use core::ptr::addr_of;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::lapic;
use crate::pci::install_gate;

const LAPIC_LVT_TIMER: u64 = 0x320;
const LAPIC_LVT_LINT0: u64 = 0x350;
const LAPIC_TIMER_INITIAL: u64 = 0x380;
const LAPIC_TIMER_CURRENT: u64 = 0x390;
const LAPIC_TIMER_DIVIDE: u64 = 0x3e0;
const SVR_ENABLE: u32 = 1 << 8;
const SPURIOUS_VECTOR: u32 = 0xff;
const LVT_MASKED: u32 = 1 << 16;
/// Divide configuration 0b0011: divide by 16.
const DIVIDE_BY_16: u32 = 0x3;
/// KVM's APIC bus runs at 1 GHz, so the timer counts 1e9 / 16 per second there (other hosts
/// differ; the timer only bounds a wait).
const TIMER_TICKS_PER_MS: u64 = 1_000_000 / 16;

/// Vectors distinct from the `pci` workload's (0x40, 0x41).
pub const MSI_VECTOR: u8 = 0x52;
const TIMEOUT_VECTOR: u8 = 0x53;

/// Interrupts taken on [`MSI_VECTOR`] and on the timeout vector (ring-0 handlers below).
#[no_mangle]
static TG_VIRTIO_MSI_COUNT: AtomicU64 = AtomicU64::new(0);
#[no_mangle]
static TG_VIRTIO_TIMER_COUNT: AtomicU64 = AtomicU64::new(0);

core::arch::global_asm!(
    r#"
    .section .text, "ax", @progbits
    .p2align 4
    .globl tg_virtio_msi_entry
tg_virtio_msi_entry:
    pushq %rax
    incq TG_VIRTIO_MSI_COUNT(%rip)
    call tg_lapic_eoi
    popq %rax
    iretq

    .p2align 4
    .globl tg_virtio_timer_entry
tg_virtio_timer_entry:
    pushq %rax
    incq TG_VIRTIO_TIMER_COUNT(%rip)
    call tg_lapic_eoi
    popq %rax
    iretq
"#,
    options(att_syntax)
);

extern "C" {
    static tg_virtio_msi_entry: u8;
    static tg_virtio_timer_entry: u8;
}

/// The MSI address that targets this CPU (physical destination, fixed delivery).
pub fn msi_address() -> u32 {
    lapic::BASE as u32 | lapic::id() << 12
}

/// Software-disables the local APIC: fixed interrupts sent to it are dropped.
pub fn disable_lapic() {
    lapic::write(lapic::SVR, lapic::read(lapic::SVR) & !SVR_ENABLE);
}

/// Software-enables the local APIC and installs the gates for [`MSI_VECTOR`] and the timer.
/// LINT0 is masked: the legacy PIC's interrupts (ExtINT) would arrive on whatever vectors it
/// was programmed with (after SeaBIOS: 8, an exception gate).
pub fn enable_lapic() {
    install_gate(MSI_VECTOR, addr_of!(tg_virtio_msi_entry) as u64);
    install_gate(TIMEOUT_VECTOR, addr_of!(tg_virtio_timer_entry) as u64);
    lapic::write(LAPIC_LVT_TIMER, LVT_MASKED | u32::from(TIMEOUT_VECTOR));
    lapic::write(LAPIC_LVT_LINT0, lapic::read(LAPIC_LVT_LINT0) | LVT_MASKED);
    lapic::write(
        lapic::SVR,
        lapic::read(lapic::SVR) | SVR_ENABLE | SPURIOUS_VECTOR,
    );
}

pub fn msi_count() -> u64 {
    TG_VIRTIO_MSI_COUNT.load(Ordering::Acquire)
}

/// Waits in ring 0 until `done()` holds or about `timeout_ms` passed (local APIC timer);
/// returns whether `done()` held. [`enable_lapic`] must have run.
pub fn wait(timeout_ms: u64, mut done: impl FnMut() -> bool) -> bool {
    let ticks = (timeout_ms * TIMER_TICKS_PER_MS).min(u64::from(u32::MAX)) as u32;
    let mut timer_seen = TG_VIRTIO_TIMER_COUNT.load(Ordering::Acquire);
    lapic::write(LAPIC_TIMER_DIVIDE, DIVIDE_BY_16);
    lapic::write(LAPIC_LVT_TIMER, u32::from(TIMEOUT_VECTOR));
    lapic::write(LAPIC_TIMER_INITIAL, ticks);
    // Every hlt ends with an interrupt (the device's or the timer's), so this bound is only a
    // guard against a storm of unrelated ones.
    let mut result = false;
    for _ in 0..10_000 {
        if done() {
            result = true;
            break;
        }
        let timer = TG_VIRTIO_TIMER_COUNT.load(Ordering::Acquire);
        if timer != timer_seen {
            // Ours has expired only when the one-shot count reads zero; otherwise this was a
            // late tick of an earlier wait.
            if lapic::read(LAPIC_TIMER_CURRENT) == 0 {
                result = done();
                break;
            }
            timer_seen = timer;
        }
        // SAFETY: hlt faults in ring 3; the #GP handler waits for an interrupt in ring 0 and
        // returns after the hlt.
        // Not `nomem`: the handlers change the counters while it waits.
        unsafe { core::arch::asm!("hlt", options(nostack)) };
    }
    lapic::write(LAPIC_TIMER_INITIAL, 0);
    lapic::write(LAPIC_LVT_TIMER, LVT_MASKED | u32::from(TIMEOUT_VECTOR));
    result
}
