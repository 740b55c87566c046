//! Intel MultiProcessor Specification 1.4 tables, so SMP guests find every vCPU and the
//! IOAPIC without ACPI.
//!
//! The 16-byte floating pointer goes in the EBDA (where Linux and the test guest scan
//! for it); the configuration table it points at goes in the reserved BIOS area, which
//! has room for the largest vCPU count the xAPIC can address.

use super::layout::{APIC_ADDR, EBDA_START, IOAPIC_ADDR, MPTABLE_CONFIG_START};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// xAPIC ids are 8 bits and 0xff is the broadcast id; the IOAPIC takes the id after the last CPU.
pub const MAX_MPTABLE_CPUS: u8 = 254;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const ISA_IRQS: u8 = 16;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit in an MP table (at most {MAX_MPTABLE_CPUS})")]
    TooManyCpus(u8),
    #[error("failed to write the MP table into guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

/// The IOAPIC's id: the one after the last CPU's APIC id (the ACPI MADT uses the same).
pub fn ioapic_id(num_cpus: u8) -> u8 {
    num_cpus
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b)))
}

/// Builds the configuration table (header and entries) for `num_cpus` vCPUs.
pub fn build_config_table(num_cpus: u8) -> Result<Vec<u8>, MpTableError> {
    if num_cpus == 0 || num_cpus > MAX_MPTABLE_CPUS {
        return Err(MpTableError::TooManyCpus(num_cpus));
    }
    let ioapic_id = ioapic_id(num_cpus);
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BSP } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        // CPU signature (family 6) and feature flags (FPU, APIC): informational only.
        entries.extend_from_slice(&0x600u32.to_le_bytes());
        entries.extend_from_slice(&0x201u32.to_le_bytes());
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&(IOAPIC_ADDR as u32).to_le_bytes());
    count += 1;
    // ISA IRQ n is wired to IOAPIC pin n, matching KVM's default GSI routing.
    for irq in 0..ISA_IRQS {
        entries.extend_from_slice(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            0,
            0,
            0,
            irq,
            ioapic_id,
            irq,
        ]);
        count += 1;
    }
    // LINT0 takes the legacy PIC (ExtINT), LINT1 NMIs, on every local APIC.
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let length = 44 + entries.len();
    let mut table = Vec::with_capacity(length);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&(length as u16).to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, filled below
    table.extend_from_slice(b"GPUVM   ");
    table.extend_from_slice(b"GPUVM-MPTBL ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&(APIC_ADDR as u32).to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // extended table length
    table.push(0); // extended table checksum
    table.push(0);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);
    Ok(table)
}

/// Builds the 16-byte floating pointer structure that points at the configuration table.
pub fn build_floating_pointer(config_table_addr: u32) -> [u8; 16] {
    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&config_table_addr.to_le_bytes());
    fp[8] = 1; // length in 16-byte units
    fp[9] = 4; // spec revision 1.4
    fp[10] = checksum(&fp);
    fp
}

/// Writes both structures into guest memory.
pub fn setup_mptable(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MpTableError> {
    let table = build_config_table(num_cpus)?;
    mem.write_slice(&table, GuestAddress(MPTABLE_CONFIG_START))?;
    let fp = build_floating_pointer(MPTABLE_CONFIG_START as u32);
    mem.write_slice(&fp, GuestAddress(EBDA_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn checksums_are_valid() {
        for cpus in [1u8, 4, 64, MAX_MPTABLE_CPUS] {
            let table = build_config_table(cpus).unwrap();
            assert_eq!(sum(&table), 0, "{cpus} cpus");
            assert_eq!(
                u16::from_le_bytes([table[4], table[5]]) as usize,
                table.len()
            );
        }
        assert_eq!(sum(&build_floating_pointer(0xf0000)), 0);
    }

    #[test]
    fn lists_every_cpu_once_with_one_bsp() {
        let table = build_config_table(4).unwrap();
        let count = u16::from_le_bytes([table[34], table[35]]);
        let mut offset = 44;
        let mut cpus = Vec::new();
        for _ in 0..count {
            let len = if table[offset] == ENTRY_PROCESSOR {
                20
            } else {
                8
            };
            if table[offset] == ENTRY_PROCESSOR {
                cpus.push((table[offset + 1], table[offset + 3]));
            }
            offset += len;
        }
        assert_eq!(offset, table.len());
        assert_eq!(cpus.len(), 4);
        assert_eq!(cpus.iter().filter(|(_, f)| f & CPU_BSP != 0).count(), 1);
        assert_eq!(
            cpus.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
    }

    #[test]
    fn rejects_impossible_counts() {
        assert!(build_config_table(0).is_err());
        assert!(build_config_table(255).is_err());
    }
}
