//! Unprivileged x86 helpers used from ring 3 (port I/O works there because IOPL=3).

use core::arch::asm;

/// 32-bit port write. Where the hypervisor drops IOPL=3 on the way to ring 3, this faults and
/// the #GP handler does it in ring 0 (see boot.rs); either way the VMM sees the same access.
pub fn outl(port: u16, value: u32) {
    // SAFETY: port I/O to an emulated device touches no memory.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack, preserves_flags))
    }
}

/// 32-bit port read (through the #GP handler where IOPL is dropped, as for [`outl`]).
pub fn inl(port: u16) -> u32 {
    let value: u32;
    // SAFETY: port I/O to an emulated device touches no memory.
    unsafe {
        asm!("in eax, dx", in("dx") port, out("eax") value, options(nomem, nostack, preserves_flags))
    }
    value
}

pub struct CpuidResult {
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

pub fn cpuid(leaf: u32, subleaf: u32) -> CpuidResult {
    let r = core::arch::x86_64::__cpuid_count(leaf, subleaf);
    CpuidResult {
        eax: r.eax,
        ebx: r.ebx,
        ecx: r.ecx,
        edx: r.edx,
    }
}

/// CPUID 0x80000001 EDX bit 26 (pdpe1gb): 1 GiB pages.
pub fn has_gib_pages() -> bool {
    cpuid(0x8000_0000, 0).eax >= 0x8000_0001 && cpuid(0x8000_0001, 0).edx & (1 << 26) != 0
}

pub fn rdtsc() -> u64 {
    // SAFETY: CR4.TSD is clear, so rdtsc is allowed in ring 3; it only reads the counter.
    unsafe { core::arch::x86_64::_rdtsc() }
}

pub fn pause() {
    core::hint::spin_loop();
}

/// Best-effort TSC frequency: CPUID 0x15, 0x16, the hypervisor timing leaf, else 3 GHz
/// (only used to bound waits, so a rough value is fine).
pub fn tsc_hz() -> u64 {
    let max_leaf = cpuid(0, 0).eax;
    if max_leaf >= 0x15 {
        let r = cpuid(0x15, 0);
        if r.eax != 0 && r.ebx != 0 && r.ecx != 0 {
            return r.ecx as u64 * r.ebx as u64 / r.eax as u64;
        }
    }
    if max_leaf >= 0x16 {
        let mhz = cpuid(0x16, 0).eax & 0xffff;
        if mhz != 0 {
            return mhz as u64 * 1_000_000;
        }
    }
    let hypervisor = cpuid(1, 0).ecx & (1 << 31) != 0;
    if hypervisor && cpuid(0x4000_0000, 0).eax >= 0x4000_0010 {
        let khz = cpuid(0x4000_0010, 0).eax;
        if khz != 0 {
            return khz as u64 * 1000;
        }
    }
    3_000_000_000
}

/// Busy-waits `micros` microseconds (approximately, see [`tsc_hz`]).
pub fn delay_us(tsc_hz: u64, micros: u64) {
    let start = rdtsc();
    let ticks = tsc_hz / 1_000_000 * micros;
    while rdtsc().wrapping_sub(start) < ticks {
        pause();
    }
}

/// Resets x87 and MXCSR to their defaults (unprivileged; saves ring-0 instructions).
pub fn init_fpu() {
    let mxcsr: u32 = 0x1f80;
    // SAFETY: fninit and ldmxcsr only change this CPU's FPU state to the ABI defaults.
    unsafe {
        asm!("fninit", "ldmxcsr [{}]", in(reg) &mxcsr, options(nostack, preserves_flags));
    }
}

/// Current privilege level (CS.RPL).
pub fn cpl() -> u16 {
    let cs: u16;
    // SAFETY: reads CS only.
    unsafe { asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags)) };
    cs & 3
}
