//! Model-specific registers every vCPU starts with.

use kvm_bindings::{kvm_msr_entry, Msrs};

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back: without this Linux maps RAM uncached.
const MTRR_ENABLE_WRITEBACK: u64 = (1 << 11) | 6;

/// The boot-time MSR values (what a BIOS would leave behind).
pub fn boot_msrs() -> Msrs {
    let entry = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    let entries = [
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        entry(MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WRITEBACK),
    ];
    // The entry count is far below the FAM wrapper's limit.
    Msrs::from_entries(&entries).expect("boot MSR list fits in a kvm_msrs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enables_writeback_mtrr() {
        let msrs = boot_msrs();
        let mtrr = msrs
            .as_slice()
            .iter()
            .find(|e| e.index == MSR_MTRR_DEF_TYPE)
            .unwrap();
        assert_eq!(mtrr.data & 0xff, 6);
        assert_ne!(mtrr.data & (1 << 11), 0);
    }
}
