//! Initial register state of the boot vCPU for each boot protocol.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::gdt::{boot_gdt, kvm_segment_from_gdt};
use super::layout::{
    BOOT_GDT_START, PDPT_START, PD_START, PML4_START, PVH_INFO_START, ZERO_PAGE_START,
};

const X86_CR0_PE: u64 = 1;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// Bit 1 of RFLAGS is reserved and always set.
const RFLAGS_RESERVED: u64 = 1 << 1;
/// Stack for the 64-bit boot protocol: below the boot page tables, above the zero page.
const BOOT_STACK_POINTER: u64 = 0x8ff0;

/// How the boot vCPU enters the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryPoint {
    /// Xen PVH: 32-bit protected mode, paging off, %ebx = start_info.
    Pvh { entry: u64 },
    /// Linux 64-bit boot protocol: long mode, identity-mapped, %rsi = boot_params.
    Linux64 { entry: u64 },
}

impl EntryPoint {
    pub fn address(&self) -> u64 {
        match self {
            EntryPoint::Pvh { entry } | EntryPoint::Linux64 { entry } => *entry,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("failed to write boot structures (GDT, page tables) into guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
}

pub fn boot_regs(entry: EntryPoint) -> kvm_regs {
    match entry {
        EntryPoint::Pvh { entry } => kvm_regs {
            rflags: RFLAGS_RESERVED,
            rip: entry,
            rbx: PVH_INFO_START,
            ..Default::default()
        },
        EntryPoint::Linux64 { entry } => kvm_regs {
            rflags: RFLAGS_RESERVED,
            rip: entry,
            rsp: BOOT_STACK_POINTER,
            rbp: BOOT_STACK_POINTER,
            rsi: ZERO_PAGE_START,
            ..Default::default()
        },
    }
}

pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// Writes the boot GDT (and, for long mode, identity page tables for the first 4 GiB)
/// into guest memory and returns segment/control registers to match, starting from the
/// vCPU's current `sregs` (which carry KVM's defaults for everything else).
pub fn setup_boot_sregs(
    mem: &GuestMemoryMmap,
    entry: EntryPoint,
    mut sregs: kvm_sregs,
) -> Result<kvm_sregs, RegsError> {
    let long_mode = matches!(entry, EntryPoint::Linux64 { .. });
    let gdt = boot_gdt(long_mode);
    for (index, descriptor) in gdt.iter().enumerate() {
        mem.write_obj(*descriptor, GuestAddress(BOOT_GDT_START + index as u64 * 8))?;
    }
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;

    let code = kvm_segment_from_gdt(gdt[2], 2);
    let data = kvm_segment_from_gdt(gdt[3], 3);
    let tss = kvm_segment_from_gdt(gdt[4], 4);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
    sregs.cr4 = 0;
    sregs.efer = 0;
    if long_mode {
        write_identity_page_tables(mem)?;
        sregs.cr3 = PML4_START;
        sregs.cr4 |= X86_CR4_PAE;
        sregs.cr0 |= X86_CR0_PG;
        sregs.efer |= EFER_LME | EFER_LMA;
    }
    Ok(sregs)
}

/// PML4 -> one PDPT -> four PDs of 2 MiB pages: the first 4 GiB identity-mapped, which
/// covers the kernel, boot_params, command line and initrd wherever they were placed.
fn write_identity_page_tables(mem: &GuestMemoryMmap) -> Result<(), RegsError> {
    const PRESENT_WRITABLE: u64 = 0x3;
    const HUGE_PAGE: u64 = 0x80;
    mem.write_obj(PDPT_START | PRESENT_WRITABLE, GuestAddress(PML4_START))?;
    for pd in 0..4u64 {
        let pd_addr = PD_START + pd * 0x1000;
        mem.write_obj(
            pd_addr | PRESENT_WRITABLE,
            GuestAddress(PDPT_START + pd * 8),
        )?;
        let mut table = [0u8; 4096];
        for (index, slot) in table.chunks_exact_mut(8).enumerate() {
            let address = ((pd << 9) + index as u64) << 21;
            slot.copy_from_slice(&(address | PRESENT_WRITABLE | HUGE_PAGE).to_le_bytes());
        }
        mem.write_slice(&table, GuestAddress(pd_addr))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn pvh_starts_in_flat_protected_mode() {
        let mem = memory();
        let sregs = setup_boot_sregs(
            &mem,
            EntryPoint::Pvh { entry: 0x10_0000 },
            Default::default(),
        )
        .unwrap();
        assert_eq!(sregs.cr0 & X86_CR0_PG, 0);
        assert_eq!(sregs.cr0 & X86_CR0_PE, 1);
        assert_eq!(sregs.efer, 0);
        assert_eq!(sregs.cs.l, 0);
        assert_eq!(sregs.cs.db, 1);
        let regs = boot_regs(EntryPoint::Pvh { entry: 0x10_0000 });
        assert_eq!(regs.rbx, PVH_INFO_START);
    }

    #[test]
    fn linux64_starts_in_long_mode_with_identity_map() {
        let mem = memory();
        let sregs = setup_boot_sregs(
            &mem,
            EntryPoint::Linux64 { entry: 0x100_0200 },
            Default::default(),
        )
        .unwrap();
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_ne!(sregs.cr0 & X86_CR0_PG, 0);
        assert_eq!(sregs.cr3, PML4_START);
        assert_eq!(sregs.cs.l, 1);
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4 & !0xfff, PDPT_START);
        // Last 2 MiB page of the fourth GiB maps to itself.
        let last: u64 = mem
            .read_obj(GuestAddress(PD_START + 3 * 0x1000 + 511 * 8))
            .unwrap();
        assert_eq!(last & !0xfff, 0xffe0_0000);
        let gdt_cs: u64 = mem.read_obj(GuestAddress(BOOT_GDT_START + 16)).unwrap();
        assert_eq!(gdt_cs, 0x00af_9b00_0000_ffff);
        assert_eq!(
            boot_regs(EntryPoint::Linux64 { entry: 1 }).rsi,
            ZERO_PAGE_START
        );
    }
}
