//! The local APIC registers both interrupt-taking workloads use (`pci` and the virtio ones in
//! virtio/irq.rs), and the end-of-interrupt stub their ring-0 handlers call.

pub const BASE: u64 = 0xfee0_0000;
pub const ID: u64 = 0x20;
pub const EOI: u64 = 0xb0;
pub const SVR: u64 = 0xf0;

// `tg_lapic_eoi`: ends the interrupt in service. For ring-0 handlers (`call tg_lapic_eoi`);
// it clobbers %rax, which they save. The EOI register's address is 32 bits, loaded
// zero-extended (a disp32 would sign-extend).
core::arch::global_asm!(
    r#"
    .section .text, "ax", @progbits
    .p2align 4
    .globl tg_lapic_eoi
tg_lapic_eoi:
    movl ${eoi}, %eax
    movl $0, (%rax)
    ret
"#,
    eoi = const BASE + EOI,
    options(att_syntax)
);

pub fn read(register: u64) -> u32 {
    // SAFETY: the local APIC page is identity mapped and user accessible; the access traps.
    unsafe { ((BASE + register) as *const u32).read_volatile() }
}

pub fn write(register: u64, value: u32) {
    // SAFETY: as in `read`.
    unsafe { ((BASE + register) as *mut u32).write_volatile(value) }
}

/// This CPU's local APIC ID.
pub fn id() -> u32 {
    read(ID) >> 24
}
