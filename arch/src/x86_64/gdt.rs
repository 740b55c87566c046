//! Flat GDT used to enter the guest (64-bit boot protocol and PVH 32-bit entry).

use kvm_bindings::kvm_segment;

/// Builds a GDT descriptor from flags, base and limit (the x86 bit layout).
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((flags as u64 & 0x0000_f0ff) << 40)
}

// Flags: granularity 4K | size/long bits | present | DPL 0 | type.
const CODE64: u16 = 0xa09b; // G, L, P, S, execute/read, accessed
const CODE32: u16 = 0xc09b; // G, D/B, P, S, execute/read, accessed
const DATA: u16 = 0xc093; // G, D/B, P, S, read/write, accessed
const TSS: u16 = 0x808b; // G, P, 64-bit busy TSS

/// Selector values: Linux expects __BOOT_CS = 0x10 and __BOOT_DS = 0x18.
pub const CODE_SELECTOR: u16 = 0x10;
pub const DATA_SELECTOR: u16 = 0x18;
pub const TSS_SELECTOR: u16 = 0x20;

/// The boot GDT: null, null, code, data, TSS.
pub fn boot_gdt(long_mode: bool) -> [u64; 5] {
    [
        0,
        0,
        gdt_entry(if long_mode { CODE64 } else { CODE32 }, 0, 0xfffff),
        gdt_entry(DATA, 0, 0xfffff),
        gdt_entry(TSS, 0, 0xfffff),
    ]
}

/// Decodes a descriptor into the segment-cache form KVM_SET_SREGS takes.
pub fn kvm_segment_from_gdt(entry: u64, table_index: u8) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let limit_raw = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let granularity = ((entry >> 55) & 1) as u8;
    // With 4K granularity the effective limit covers whole pages.
    let limit = if granularity == 1 {
        (limit_raw << 12) | 0xfff
    } else {
        limit_raw
    };
    kvm_segment {
        base,
        limit,
        selector: u16::from(table_index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granularity,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: if (entry >> 47) & 1 == 0 { 1 } else { 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code64_descriptor_round_trips() {
        let gdt = boot_gdt(true);
        let seg = kvm_segment_from_gdt(gdt[2], 2);
        assert_eq!(seg.selector, CODE_SELECTOR);
        assert_eq!(seg.l, 1);
        assert_eq!(seg.db, 0);
        assert_eq!(seg.present, 1);
        assert_eq!(seg.type_, 0xb);
        assert_eq!(seg.limit, 0xffff_ffff);
        assert_eq!(seg.base, 0);
    }

    #[test]
    fn code32_descriptor_is_not_long() {
        let seg = kvm_segment_from_gdt(boot_gdt(false)[2], 2);
        assert_eq!(seg.l, 0);
        assert_eq!(seg.db, 1);
    }

    #[test]
    fn known_encoding() {
        // A flat 64-bit code segment as every x86 OS writes it.
        assert_eq!(gdt_entry(0xa09b, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(0xc093, 0, 0xfffff), 0x00cf_9300_0000_ffff);
    }
}
