//! The `edu` workload: drives QEMU's educational PCI device (1234:11e8, docs/specs/edu.rst),
//! passed through to the guest by the kernel's VFIO, the way a driver would.
//!
//! 1. Find it on bus 0 (configuration mechanism #1), size BAR0 (1 MiB, 32-bit MMIO), turn on
//!    memory decoding and Bus Master.
//! 2. Identification (low byte 0xed), liveness (reads back the complement), factorial of 10.
//! 3. DMA: a pattern from RAM buffer A into the device's buffer (device address 0x40000), then
//!    from there into RAM buffer B, compared byte for byte. Both buffers are below 256 MiB
//!    (the device's DMA mask is 28 bits); at most 2048 bytes (QEMU 7.2's range check is off
//!    by one and aborts QEMU on a transfer of its whole 4 KiB buffer).
//! 4. MSI (the device has an MSI capability, no MSI-X): a DMA that raises interrupt 0x100 when
//!    done, a factorial that raises 0x1, and a raise through register 0x60. The device keeps
//!    its interrupt status until acknowledged (0x64); for MSI the workload acknowledges from
//!    ring 3 after each interrupt.
//! 5. INTx (MSI off): a raise through 0x60 must arrive as a level-triggered interrupt on the
//!    IOAPIC pin the VMM wired (the Interrupt Line register). The ring-0 handler reads the
//!    device's interrupt status and writes it back to 0x64 (deasserting the line) before the
//!    EOI; each raise must bring exactly one interrupt. Twice, so the line must have been
//!    unmasked again after the first.
//!
//! `edu: PASS` and exit status 0, or `edu: FAIL <what>` and 1. Every wait is bounded (TSC
//! deadline plus an iteration cap for polls, a one-shot local APIC timer for interrupts).
//! `edu hold` idles after the checks until the VMM ends the run.
//!
//! `edu loop` (for live updates: the device must keep working while the VMM process that
//! owns it changes) runs steps 1 to 4, leaves MSI on and then loops until the VMM ends the
//! run: each round a DMA round trip RAM -> device -> RAM with a pattern of its own (checked
//! byte for byte) and one MSI through the raise register (waited for, its status checked,
//! acknowledged). `edu: loop N ok` every LOOP_REPORT_ROUNDS rounds (N: rounds done); a lost
//! interrupt, a failed DMA or a stale buffer ends it with `edu: FAIL loop round N: ...`.
//!
//! Interrupts are only delivered in ring 0 on the CI hypervisor: as in the `pci` workload,
//! the workload installs IDT gates for its vectors and executes `hlt`, which faults in ring 3;
//! the #GP handler (boot.rs) waits in ring 0 with `sti; hlt`.

use core::ptr::addr_of;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::arch::{rdtsc, tsc_hz};
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::console::exit;
use crate::lapic;
use crate::pci::{
    config_read, config_write, find_capability, install_gate, mmio_read, mmio_write, size_bar,
};
use crate::println;

const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;

const VENDOR_QEMU: u32 = 0x1234;
const DEVICE_EDU: u32 = 0x11e8;
const CAP_ID_MSI: u8 = 0x05;
const COMMAND_MEMORY: u32 = 1 << 1;
const COMMAND_BUS_MASTER: u32 = 1 << 2;
const COMMAND_INTX_DISABLE: u32 = 1 << 10;
const STATUS_INTERRUPT: u32 = 1 << 3;
const MSI_CONTROL_ENABLE: u32 = 1 << 0;
const MSI_CONTROL_MME: u32 = 0x7 << 4;
const MSI_CONTROL_64BIT: u32 = 1 << 7;
const BAR0_SIZE: u64 = 1 << 20;

/// edu BAR0 registers (QEMU docs/specs/edu.rst). Below 0x80 only 32-bit accesses count;
/// the DMA registers take 32- or 64-bit ones (a 32-bit write sets the whole 64-bit value).
const REG_IDENT: u64 = 0x00;
const REG_LIVENESS: u64 = 0x04;
const REG_FACTORIAL: u64 = 0x08;
const REG_STATUS: u64 = 0x20;
const REG_IRQ_STATUS: u64 = 0x24;
const REG_IRQ_RAISE: u64 = 0x60;
const REG_IRQ_ACK: u64 = 0x64;
const REG_DMA_SRC: u64 = 0x80;
const REG_DMA_DST: u64 = 0x88;
const REG_DMA_COUNT: u64 = 0x90;
const REG_DMA_CMD: u64 = 0x98;
const STATUS_COMPUTING: u32 = 0x01;
const STATUS_IRQ_FACTORIAL: u32 = 0x80;
const DMA_START: u32 = 0x1;
const DMA_TO_RAM: u32 = 0x2;
const DMA_IRQ: u32 = 0x4;
/// Interrupt status bits the device sets itself: factorial done, DMA done.
const IRQ_FACTORIAL: u32 = 0x1;
const IRQ_DMA: u32 = 0x100;
/// Bits this workload raises through REG_IRQ_RAISE (not used by the device itself).
const IRQ_MSI_TEST: u32 = 0x0001_0000;
const IRQ_INTX_TEST: u32 = 0x0002_0000;
/// The device's own buffer (device addresses 0x40000..0x41000).
const DEVICE_BUFFER: u64 = 0x40000;

/// RAM buffers for DMA: free RAM above the image (the `pci` workload uses 32 MiB), below the
/// device's 28-bit DMA mask.
const BUFFER_A: u64 = 40 << 20;
const BUFFER_B: u64 = 41 << 20;
const DMA_LEN: u64 = 2048;
const DMA_SEED: u64 = 0xed0d_3a5e;
const DMA_MASK_LIMIT: u64 = 1 << 28;

/// Vectors of our own (pci: 0x40/0x41, virtio: 0x52/0x53, whose timeout timer edu shares).
const MSI_VECTOR: u8 = 0x48;
const INTX_VECTOR: u8 = 0x49;

const IOAPIC_BASE: u64 = 0xfec0_0000;
const IOAPIC_WINDOW: u64 = 0x10;
const IOAPIC_REDIRECTION: u32 = 0x10;
const IOAPIC_LEVEL: u32 = 1 << 15;
const IOAPIC_MASKED: u32 = 1 << 16;
/// gpuvm routes INTx of bus-0 device d, pin p (0 = INTA) to GSI 16 + (d + p) % 8.
const FIRST_INTX_GSI: u32 = 16;

/// Bounds of a register poll: whichever comes first.
const POLL_SECONDS: u64 = 20;
const POLL_ITERATIONS: u64 = 20_000_000;
/// How long to wait for an interrupt, and how long to watch for extra ones afterwards.
const INTERRUPT_TIMEOUT_MS: u64 = 10_000;
const SETTLE_MS: u64 = 200;
/// `edu loop` reports every this many rounds: about twice a second (QEMU's edu finishes
/// each DMA on a 100 ms timer, so a round takes at least 200 ms), little next to the round.
const LOOP_REPORT_ROUNDS: u64 = 2;

/// Interrupts taken on the MSI and INTx vectors (ring-0 handlers below).
#[no_mangle]
static TG_EDU_MSI_COUNT: AtomicU64 = AtomicU64::new(0);
#[no_mangle]
static TG_EDU_INTX_COUNT: AtomicU64 = AtomicU64::new(0);
/// Addresses of the device's interrupt status and acknowledge registers, for the INTx handler.
#[no_mangle]
static TG_EDU_IRQ_STATUS_REG: AtomicU64 = AtomicU64::new(0);
#[no_mangle]
static TG_EDU_IRQ_ACK_REG: AtomicU64 = AtomicU64::new(0);
/// Every interrupt status the INTx handler read (ORed), and how often it read zero (an
/// interrupt the device had not raised: a line that fired again after its acknowledgement).
#[no_mangle]
static TG_EDU_INTX_SEEN: AtomicU64 = AtomicU64::new(0);
#[no_mangle]
static TG_EDU_INTX_EMPTY: AtomicU64 = AtomicU64::new(0);

core::arch::global_asm!(
    r#"
    .section .text, "ax", @progbits
    .p2align 4
    .globl tg_edu_msi_entry
tg_edu_msi_entry:
    pushq %rax
    incq TG_EDU_MSI_COUNT(%rip)
    call tg_lapic_eoi
    popq %rax
    iretq

    .p2align 4
    .globl tg_edu_intx_entry
tg_edu_intx_entry:
    pushq %rax
    pushq %rcx
    incq TG_EDU_INTX_COUNT(%rip)
    /* Read the device's interrupt status and write it back to its acknowledge register,
       which deasserts the level-triggered line, before the EOI. */
    movq TG_EDU_IRQ_STATUS_REG(%rip), %rax
    movl (%rax), %ecx
    orq %rcx, TG_EDU_INTX_SEEN(%rip)
    testl %ecx, %ecx
    jnz 1f
    incq TG_EDU_INTX_EMPTY(%rip)
1:  movq TG_EDU_IRQ_ACK_REG(%rip), %rax
    movl %ecx, (%rax)
    call tg_lapic_eoi
    popq %rcx
    popq %rax
    iretq
"#,
    options(att_syntax)
);

extern "C" {
    static tg_edu_msi_entry: u8;
    static tg_edu_intx_entry: u8;
}

fn fail(what: core::fmt::Arguments) -> ! {
    println!("edu: FAIL {what}");
    exit(EXIT_FAIL)
}

/// Writes the command register (the status half of the dword is written as zeros: its
/// error bits are write-1-to-clear).
fn write_command(slot: u8, command: u32) {
    config_write(slot, 0x04, command & 0xffff);
}

/// Polls until `done` holds; false after POLL_SECONDS (TSC) or POLL_ITERATIONS polls.
fn poll(mut done: impl FnMut() -> bool) -> bool {
    let start = rdtsc();
    let limit = tsc_hz().saturating_mul(POLL_SECONDS);
    for _ in 0..POLL_ITERATIONS {
        if done() {
            return true;
        }
        if rdtsc().wrapping_sub(start) >= limit {
            break;
        }
        for _ in 0..16 {
            core::hint::spin_loop();
        }
    }
    done()
}

/// Local APIC on, with the virtio workloads' timeout timer (virtio/irq.rs), and our gates.
fn enable_lapic() {
    crate::virtio::irq::enable_lapic();
    install_gate(MSI_VECTOR, addr_of!(tg_edu_msi_entry) as u64);
    install_gate(INTX_VECTOR, addr_of!(tg_edu_intx_entry) as u64);
}

/// Lets `ms` pass in ring 0 (interrupts delivered meanwhile).
fn settle(ms: u64) {
    crate::virtio::irq::wait(ms, || false);
}

struct Edu {
    slot: u8,
    bar0: u64,
}

impl Edu {
    fn read(&self, register: u64) -> u32 {
        mmio_read(self.bar0 + register)
    }

    fn write(&self, register: u64, value: u32) {
        mmio_write(self.bar0 + register, value)
    }

    fn identification(&self) {
        let ident = self.read(REG_IDENT);
        if ident & 0xff != 0xed {
            fail(format_args!(
                "identification {ident:#010x}: low byte is not 0xed"
            ));
        }
        println!(
            "edu: identification {ident:#010x} (version {}.{})",
            ident >> 24,
            ident >> 16 & 0xff
        );
    }

    fn liveness(&self) {
        for value in [0x1234_5678u32, 0xa5a5_0ff0] {
            self.write(REG_LIVENESS, value);
            let got = self.read(REG_LIVENESS);
            if got != !value {
                fail(format_args!(
                    "liveness: wrote {value:#010x}, read {got:#010x} (expected {:#010x})",
                    !value
                ));
            }
        }
        println!("edu: liveness ok");
    }

    /// Starts a factorial of `n` and waits for it; returns n!.
    fn factorial(&self, n: u32) -> u32 {
        self.write(REG_FACTORIAL, n);
        self.factorial_result(n)
    }

    /// Waits until the factorial of `n` is no longer computing (polling the status
    /// register); returns the result.
    fn factorial_result(&self, n: u32) -> u32 {
        if !poll(|| self.read(REG_STATUS) & STATUS_COMPUTING == 0) {
            fail(format_args!(
                "factorial of {n} still computing (status {:#x})",
                self.read(REG_STATUS)
            ));
        }
        self.read(REG_FACTORIAL)
    }

    /// Programs a DMA of `len` bytes from `src` to `dst` (device addresses on the device's
    /// side, guest physical ones on RAM's) and starts it.
    fn start_dma(&self, src: u64, dst: u64, len: u64, command: u32) {
        // 32-bit writes: each sets the whole 64-bit register (all addresses are below 4 GiB).
        self.write(REG_DMA_SRC, src as u32);
        self.write(REG_DMA_DST, dst as u32);
        self.write(REG_DMA_COUNT, len as u32);
        self.write(REG_DMA_CMD, command | DMA_START);
    }

    fn wait_dma(&self, what: &str) {
        if !poll(|| self.read(REG_DMA_CMD) & DMA_START == 0) {
            fail(format_args!(
                "DMA {what} did not finish (command {:#x})",
                self.read(REG_DMA_CMD)
            ));
        }
    }

    /// Acknowledges `bits` and checks the interrupt status is then clear.
    fn acknowledge(&self, bits: u32, what: &str) {
        self.write(REG_IRQ_ACK, bits);
        let left = self.read(REG_IRQ_STATUS);
        if left != 0 {
            fail(format_args!(
                "{what}: interrupt status {left:#x} after acknowledging {bits:#x}"
            ));
        }
    }
}

/// Whether [start, start + len) is inside one e820 RAM range.
fn is_ram(info: &BootInfo, start: u64, len: u64) -> bool {
    info.memmap().iter().any(|entry| {
        entry.kind == E820_RAM
            && entry.addr <= start
            && start + len <= entry.addr.saturating_add(entry.size)
    })
}

/// Compares buffer B with buffer A; the first differing offset, if any, with both bytes.
fn compare_buffers() -> Option<(u64, u8, u8)> {
    (0..DMA_LEN).find_map(|offset| {
        // SAFETY: both buffers are guest RAM (checked against the e820 map), identity
        // mapped, and only this workload and the device (finished) use them.
        let (a, b) = unsafe {
            (
                ((BUFFER_A + offset) as *const u8).read_volatile(),
                ((BUFFER_B + offset) as *const u8).read_volatile(),
            )
        };
        (a != b).then_some((offset, a, b))
    })
}

fn check_buffers(what: &str) {
    if let Some((offset, a, b)) = compare_buffers() {
        fail(format_args!(
            "{what}: buffers differ at offset {offset:#x} (A {a:#04x}, B {b:#04x}; {DMA_LEN} bytes, A at {BUFFER_A:#x}, B at {BUFFER_B:#x})"
        ));
    }
}

fn find_edu() -> u8 {
    let mut found = None;
    for slot in 0..32u8 {
        let ids = config_read(slot, 0);
        if ids & 0xffff == 0xffff || ids & 0xffff == 0 {
            continue;
        }
        println!(
            "edu: 00:{slot:02x}.0 vendor={:#06x} device={:#06x}",
            ids & 0xffff,
            ids >> 16
        );
        if found.is_none() && ids & 0xffff == VENDOR_QEMU && ids >> 16 == DEVICE_EDU {
            found = Some(slot);
        }
    }
    found.unwrap_or_else(|| {
        fail(format_args!(
            "no edu device ({VENDOR_QEMU:04x}:{DEVICE_EDU:04x}) on bus 0"
        ))
    })
}

/// Fills buffer A with pattern `seed`, zeroes B and has edu copy A into its buffer and back
/// into B, waiting for each transfer; the caller compares the buffers.
fn round_trip(edu: &Edu, seed: u64) {
    crate::pattern::fill(BUFFER_A, DMA_LEN, seed);
    crate::pattern::zero(BUFFER_B, DMA_LEN);
    core::sync::atomic::fence(Ordering::SeqCst);
    edu.start_dma(BUFFER_A, DEVICE_BUFFER, DMA_LEN, 0);
    edu.wait_dma("RAM to device");
    edu.start_dma(DEVICE_BUFFER, BUFFER_B, DMA_LEN, DMA_TO_RAM);
    edu.wait_dma("device to RAM");
    core::sync::atomic::fence(Ordering::SeqCst);
}

fn dma(edu: &Edu) {
    round_trip(edu, DMA_SEED);
    check_buffers("dma");
    println!("edu: dma ok {DMA_LEN} bytes");
}

fn msi(edu: &Edu, apic_id: u32) -> u8 {
    let slot = edu.slot;
    let Some(cap) = find_capability(slot, CAP_ID_MSI) else {
        fail(format_args!("no MSI capability"));
    };
    let header = config_read(slot, cap);
    let control = header >> 16;
    let is_64bit = control & MSI_CONTROL_64BIT != 0;
    let data_register = if is_64bit { cap + 0xc } else { cap + 0x8 };
    config_write(slot, cap + 4, lapic::BASE as u32 | apic_id << 12);
    if is_64bit {
        config_write(slot, cap + 8, 0);
    }
    // The data register is 16 bits; keep what follows it.
    let data = config_read(slot, data_register);
    config_write(
        slot,
        data_register,
        data & 0xffff_0000 | u32::from(MSI_VECTOR),
    );
    // One vector (Multiple Message Enable 0), enabled.
    config_write(
        slot,
        cap,
        (header & 0xffff) | (control & !MSI_CONTROL_MME | MSI_CONTROL_ENABLE) << 16,
    );
    if config_read(slot, cap) >> 16 & MSI_CONTROL_ENABLE == 0 {
        fail(format_args!("MSI did not enable"));
    }
    println!(
        "edu: msi cap at {cap:#x} ({}-bit address), vector {MSI_VECTOR:#x} to APIC {apic_id}",
        if is_64bit { 64 } else { 32 }
    );
    TG_EDU_MSI_COUNT.store(0, Ordering::Release);

    let wait = |expected: u64, what: &str| {
        wait_for_msi(edu, expected, |taken, status| {
            fail(format_args!(
                "no MSI for {what} within {INTERRUPT_TIMEOUT_MS} ms (interrupt status {status:#x}, {taken} taken)"
            ))
        })
    };
    let expect_status = |bits: u32, what: &str| {
        let status = edu.read(REG_IRQ_STATUS);
        if status != bits {
            fail(format_args!(
                "{what}: interrupt status {status:#x}, expected {bits:#x}"
            ));
        }
    };

    // A DMA (device to RAM) that raises 0x100 when done.
    crate::pattern::zero(BUFFER_B, DMA_LEN);
    core::sync::atomic::fence(Ordering::SeqCst);
    edu.start_dma(DEVICE_BUFFER, BUFFER_B, DMA_LEN, DMA_TO_RAM | DMA_IRQ);
    wait(1, "the DMA");
    edu.wait_dma("with interrupt");
    expect_status(IRQ_DMA, "MSI after DMA");
    edu.acknowledge(IRQ_DMA, "MSI after DMA");
    core::sync::atomic::fence(Ordering::SeqCst);
    check_buffers("dma with MSI");
    println!("edu: msi after dma ok");

    // A factorial that raises 0x1 when done.
    edu.write(REG_STATUS, STATUS_IRQ_FACTORIAL);
    edu.write(REG_FACTORIAL, 5);
    wait(2, "the factorial");
    let result = edu.factorial_result(5);
    edu.write(REG_STATUS, 0);
    expect_status(IRQ_FACTORIAL, "MSI after factorial");
    edu.acknowledge(IRQ_FACTORIAL, "MSI after factorial");
    if result != 120 {
        fail(format_args!("factorial of 5 with MSI: {result}"));
    }
    println!("edu: msi after factorial ok");

    // A raise through the interrupt raise register.
    edu.write(REG_IRQ_RAISE, IRQ_MSI_TEST);
    wait(3, "the raise register");
    expect_status(IRQ_MSI_TEST, "MSI after raise");
    edu.acknowledge(IRQ_MSI_TEST, "MSI after raise");

    settle(SETTLE_MS);
    let taken = TG_EDU_MSI_COUNT.load(Ordering::Acquire);
    if taken != 3 {
        fail(format_args!("{taken} MSIs for 3 interrupts"));
    }
    println!("edu: msi ok");
    cap
}

fn intx(edu: &Edu, msi_cap: u8, apic_id: u32) {
    let slot = edu.slot;
    // MSI off: gpuvm switches the device back to INTx.
    let header = config_read(slot, msi_cap);
    config_write(slot, msi_cap, header & !(MSI_CONTROL_ENABLE << 16));
    if config_read(slot, msi_cap) >> 16 & MSI_CONTROL_ENABLE != 0 {
        fail(format_args!("MSI did not disable"));
    }
    let register = config_read(slot, 0x3c);
    let (line, pin) = (register & 0xff, register >> 8 & 0xff);
    if !(1..=4).contains(&pin) {
        fail(format_args!("INTx: interrupt pin {pin}"));
    }
    let expected = FIRST_INTX_GSI + (u32::from(slot) + pin - 1) % 8;
    if line != expected {
        fail(format_args!(
            "INTx: pin {pin} line {line}, expected GSI {expected}"
        ));
    }
    TG_EDU_IRQ_STATUS_REG.store(edu.bar0 + REG_IRQ_STATUS, Ordering::Release);
    TG_EDU_IRQ_ACK_REG.store(edu.bar0 + REG_IRQ_ACK, Ordering::Release);
    TG_EDU_INTX_COUNT.store(0, Ordering::Release);
    TG_EDU_INTX_SEEN.store(0, Ordering::Release);
    TG_EDU_INTX_EMPTY.store(0, Ordering::Release);
    // Level-triggered, active high, fixed delivery to this CPU (as the `pci` workload).
    let entry = IOAPIC_REDIRECTION + 2 * line;
    mmio_write(IOAPIC_BASE, entry + 1);
    mmio_write(IOAPIC_BASE + IOAPIC_WINDOW, apic_id << 24);
    mmio_write(IOAPIC_BASE, entry);
    mmio_write(
        IOAPIC_BASE + IOAPIC_WINDOW,
        u32::from(INTX_VECTOR) | IOAPIC_LEVEL,
    );
    // An interrupt still pending on the line from before (none expected) shows up now.
    settle(SETTLE_MS);
    let stale = TG_EDU_INTX_COUNT.load(Ordering::Acquire);
    if stale != 0 {
        println!("edu: note: {stale} INTx interrupt(s) before the first raise");
    }
    println!("edu: intx pin {pin} line {line}, raising");

    for round in 1..=2u64 {
        edu.write(REG_IRQ_RAISE, IRQ_INTX_TEST);
        let target = stale + round;
        let arrived = crate::virtio::irq::wait(INTERRUPT_TIMEOUT_MS, || {
            TG_EDU_INTX_COUNT.load(Ordering::Acquire) >= target
        });
        if !arrived {
            fail(format_args!(
                "no INTx interrupt for raise {round} within {INTERRUPT_TIMEOUT_MS} ms (interrupt status {:#x}, PCI status {:#06x})",
                edu.read(REG_IRQ_STATUS),
                config_read(slot, 0x04) >> 16
            ));
        }
        // Any extra interrupt (a line not deasserted by the acknowledgement) shows up here.
        settle(SETTLE_MS);
        let taken = TG_EDU_INTX_COUNT.load(Ordering::Acquire) - stale;
        let empty = TG_EDU_INTX_EMPTY.load(Ordering::Acquire);
        let seen = TG_EDU_INTX_SEEN.load(Ordering::Acquire);
        let status = edu.read(REG_IRQ_STATUS);
        let pci_status = config_read(slot, 0x04) >> 16;
        if taken != round
            || empty > stale
            || seen != u64::from(IRQ_INTX_TEST)
            || status != 0
            || pci_status & STATUS_INTERRUPT != 0
        {
            fail(format_args!(
                "INTx raise {round}: {taken} interrupts ({empty} with nothing to acknowledge), handler saw status {seen:#x}, now interrupt status {status:#x}, PCI status {pci_status:#06x}"
            ));
        }
    }
    // The entry masked again: the device is left quiet.
    mmio_write(IOAPIC_BASE, entry);
    mmio_write(
        IOAPIC_BASE + IOAPIC_WINDOW,
        u32::from(INTX_VECTOR) | IOAPIC_LEVEL | IOAPIC_MASKED,
    );
    println!("edu: intx ok");
}

/// Waits up to [`INTERRUPT_TIMEOUT_MS`] until `expected` MSIs have arrived; else calls
/// `missing` with how many did and the device's interrupt status.
fn wait_for_msi(edu: &Edu, expected: u64, missing: impl Fn(u64, u32)) {
    let arrived = crate::virtio::irq::wait(INTERRUPT_TIMEOUT_MS, || {
        TG_EDU_MSI_COUNT.load(Ordering::Acquire) >= expected
    });
    if !arrived {
        missing(
            TG_EDU_MSI_COUNT.load(Ordering::Acquire),
            edu.read(REG_IRQ_STATUS),
        );
    }
}

/// `edu loop`: DMA round trips and MSIs, round after round, until the VMM ends the run. MSI
/// must be on (as [`msi`] leaves it).
fn run_loop(edu: &Edu) -> ! {
    println!("edu: loop: a DMA round trip and an MSI per round");
    let mut expected_msis = TG_EDU_MSI_COUNT.load(Ordering::Acquire);
    let mut extra_msis = 0u64;
    let mut round = 0u64;
    loop {
        round += 1;
        let fail_round =
            |what: core::fmt::Arguments| -> ! { fail(format_args!("loop round {round}: {what}")) };

        // A pattern of this round's own: a transfer that did not happen leaves buffer B
        // zero, one that moved an earlier round's data leaves that round's pattern.
        round_trip(edu, DMA_SEED ^ round.rotate_left(17));
        if let Some((offset, a, b)) = compare_buffers() {
            fail_round(format_args!(
                "DMA round trip: buffers differ at offset {offset:#x} (A {a:#04x}, B {b:#04x})"
            ));
        }

        expected_msis += 1;
        edu.write(REG_IRQ_RAISE, IRQ_MSI_TEST);
        wait_for_msi(edu, expected_msis, |taken, status| {
            fail_round(format_args!(
                "no MSI within {INTERRUPT_TIMEOUT_MS} ms (interrupt status {status:#x}, {taken} of {expected_msis} taken)"
            ))
        });
        let status = edu.read(REG_IRQ_STATUS);
        if status != IRQ_MSI_TEST {
            fail_round(format_args!(
                "interrupt status {status:#x} after the MSI, expected {IRQ_MSI_TEST:#x}"
            ));
        }
        edu.write(REG_IRQ_ACK, IRQ_MSI_TEST);
        let left = edu.read(REG_IRQ_STATUS);
        if left != 0 {
            fail_round(format_args!(
                "interrupt status {left:#x} after acknowledging {IRQ_MSI_TEST:#x}"
            ));
        }
        // An interrupt more than raised (one delivered twice, say across a change of VMM
        // process) is noted, not fatal: a driver sees it as spurious. A lost one is fatal.
        let taken = TG_EDU_MSI_COUNT.load(Ordering::Acquire);
        if taken > expected_msis {
            extra_msis += taken - expected_msis;
            println!(
                "edu: loop note: round {round}: {} MSI(s) more than raised ({extra_msis} so far)",
                taken - expected_msis
            );
            expected_msis = taken;
        }

        if round.is_multiple_of(LOOP_REPORT_ROUNDS) {
            println!("edu: loop {round} ok");
        }
    }
}

pub fn run(info: &BootInfo, mode: Option<&str>) -> ! {
    #[derive(PartialEq)]
    enum Mode {
        Check,
        Hold,
        Loop,
    }
    let mode = match mode {
        None => Mode::Check,
        Some("hold") => Mode::Hold,
        Some("loop") => Mode::Loop,
        Some(other) => {
            println!("edu: unknown argument '{other}'; usage: edu [hold|loop]");
            exit(EXIT_USAGE)
        }
    };
    let slot = find_edu();
    let (bar0, size, flags) = size_bar(slot, 0);
    println!("edu: found at 00:{slot:02x}.0 BAR0 {bar0:#x} size {size:#x}");
    if flags != 0 || size != BAR0_SIZE || bar0 == 0 {
        fail(format_args!(
            "BAR0 is not a 1 MiB 32-bit memory BAR (address {bar0:#x}, size {size:#x}, flags {flags:#x})"
        ));
    }
    for (name, start) in [("A", BUFFER_A), ("B", BUFFER_B)] {
        if !is_ram(info, start, DMA_LEN) || start + DMA_LEN > DMA_MASK_LIMIT {
            fail(format_args!(
                "DMA buffer {name} at {start:#x} is not guest RAM below 256 MiB (give the guest more memory)"
            ));
        }
    }

    // Memory decoding and Bus Master on, INTx not disabled. gpuvm holds this write back
    // until guest RAM is DMA-mapped and refuses Bus Master if that failed: read it back.
    let command = config_read(slot, 0x04) & 0xffff;
    write_command(
        slot,
        command & !COMMAND_INTX_DISABLE | COMMAND_MEMORY | COMMAND_BUS_MASTER,
    );
    let command = config_read(slot, 0x04) & 0xffff;
    if command & (COMMAND_MEMORY | COMMAND_BUS_MASTER) != COMMAND_MEMORY | COMMAND_BUS_MASTER {
        fail(format_args!(
            "memory decoding or bus master refused (command {command:#06x})"
        ));
    }
    println!("edu: memory decoding and bus master on");

    let edu = Edu { slot, bar0 };
    // The device keeps its state across VFIO opens: no interrupt after factorials, and
    // nothing left pending from an earlier run.
    edu.write(REG_STATUS, 0);
    edu.write(REG_IRQ_ACK, u32::MAX);

    edu.identification();
    edu.liveness();
    let result = edu.factorial(10);
    if result != 3_628_800 {
        fail(format_args!("factorial of 10: {result}, expected 3628800"));
    }
    println!("edu: factorial ok 10! = {result}");
    dma(&edu);

    let apic_id = lapic::id();
    enable_lapic();
    let msi_cap = msi(&edu, apic_id);
    if mode == Mode::Loop {
        run_loop(&edu);
    }
    intx(&edu, msi_cap, apic_id);

    println!("edu: PASS");
    if mode == Mode::Hold {
        println!("edu: holding until the VMM ends the run");
        crate::console::halt_forever();
    }
    exit(0)
}
