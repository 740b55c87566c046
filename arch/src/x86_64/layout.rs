//! Guest-physical memory layout of an x86_64 gpuvm guest.
//!
//! ```text
//! 0x0000_0000  real-mode IVT / BDA (BDA word 0x40e points at the EBDA)
//! 0x0000_0500  boot GDT (64-bit boot protocol and PVH)
//! 0x0000_6000  PVH start_info, then its memory map and module list
//! 0x0000_7000  Linux boot_params (the "zero page")
//! 0x0000_9000  boot page tables (PML4, PDPT, 4 PDs identity-mapping 4 GiB)
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  EBDA: MP floating pointer           (reserved in the e820 map)
//! 0x000a_0000  ACPI tables                          (reserved in the e820 map)
//! 0x000e_0000  ACPI: RSDP                           (reserved in the e820 map)
//! 0x000f_0000  MP configuration table              (reserved in the e820 map)
//! 0x0010_0000  kernel / test guest, then RAM
//! 0xc000_0000  32-bit MMIO hole: PCI BARs up to 0xe000_0000, then the PCI ECAM window
//!              0xe000_0000..0xe010_0000 (reserved in the e820 map; 1 MiB per bus: more
//!              with root ports or switches); with more PCI segments, their ECAM windows
//!              one after another (segment N's at 0xe000_0000 + N MiB when each covers
//!              one bus), then from 0xe100_0000 (or the end of the ECAM windows, if
//!              later) their 32-bit BARs, 16 MiB each or as much as the devices placed
//!              there need, up to 0xf000_0000; IOAPIC 0xfec0_0000, LAPIC 0xfee0_0000
//! 0x1_0000_0000 RAM above 4 GiB, then the 64-bit MMIO window (PCI BARs; 1 GiB aligned,
//!              sized from the passthrough devices' BARs: see address_space), then 64 GiB
//!              of 64-bit BARs for each segment N > 0 (more where its devices need it,
//!              aligned to their largest BAR); all below the guest's physical
//!              address width, and on AMD hosts clear of 0xfd_0000_0000..0x100_0000_0000
//! ```

use gpuvm_memory::RamRegion;

pub const BDA_EBDA_POINTER: u64 = 0x40e;
pub const BOOT_GDT_START: u64 = 0x500;
pub const PVH_INFO_START: u64 = 0x6000;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const PML4_START: u64 = 0x9000;
pub const PDPT_START: u64 = 0xa000;
/// Four page directories (0xb000..0xf000) map the first 4 GiB with 2 MiB pages.
pub const PD_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x20000;
pub const CMDLINE_MAX_SIZE: usize = 4096;
pub const EBDA_START: u64 = 0x9fc00;
/// ACPI tables fill `[ACPI_START, ACPI_RSDP)`, the RSDP sits at [`ACPI_RSDP`] (where
/// guests scan for it), and `[ACPI_START, ACPI_END)` is theirs. 256 KiB for the tables: a
/// DSDT with hot-plug slots on 16 PCI segments and 255 hot-pluggable vCPUs takes ~90 KiB.
pub const ACPI_START: u64 = 0xa0000;
pub const ACPI_RSDP: u64 = 0xe0000;
pub const ACPI_END: u64 = MPTABLE_CONFIG_START;
pub const MPTABLE_CONFIG_START: u64 = 0xf0000;
pub const BIOS_AREA_END: u64 = 0x10_0000;
/// Where kernels and the test guest are loaded; also the start of "high" memory.
pub const HIMEM_START: u64 = 0x10_0000;
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// PCI memory-mapped configuration space (ECAM) for bus 0; the 32-bit BAR window ends here.
pub const PCI_ECAM_START: u64 = 0xe000_0000;
pub const PCI_ECAM_SIZE: u64 = gpuvm_devices::pci::PciRootConfig::ECAM_SIZE;
/// The 32-bit PCI BAR window: the MMIO hole below the ECAM window.
pub const PCI_MMIO32_START: u64 = MMIO_HOLE_START;
pub const PCI_MMIO32_END: u64 = PCI_ECAM_START;
/// The 64-bit PCI BAR window starts above RAM on this boundary; each BAR in it is aligned
/// to its own size.
pub const PCI_MMIO64_ALIGN: u64 = 1 << 30;
/// Least size of the 64-bit PCI BAR window where the host's address width allows (the
/// whole window of a VM created without passthrough devices, as Kata creates one before it
/// hot-plugs GPUs): room for eight GPUs with 256 GiB BAR1s (H200, B200) hot-plugged one
/// by one, each BAR1 aligned to its size, and their 64-bit companions. Only addresses:
/// nothing is allocated or registered for the empty part. With devices the window is
/// planned from their BARs ([`super::address_space`]) and is at least this.
pub const PCI_MMIO64_DEFAULT_SIZE: u64 = 4 << 40;
pub const FOUR_GIB: u64 = 0x1_0000_0000;
/// Most PCI segment groups a VM may have (segment 0 included); their ECAM windows fill
/// `[PCI_ECAM_START, PCI_ECAM_START + MAX_PCI_SEGMENTS MiB)`.
pub const MAX_PCI_SEGMENTS: u16 = 16;
/// Where the 32-bit BAR windows of segments 1.. start, each [`PCI_SEGMENT_MMIO32_SIZE`]
/// long (segment 0 keeps `[PCI_MMIO32_START, PCI_MMIO32_END)`).
pub const PCI_SEGMENTS_MMIO32_START: u64 = PCI_ECAM_START + MAX_PCI_SEGMENTS as u64 * PCI_ECAM_SIZE;
pub const PCI_SEGMENT_MMIO32_SIZE: u64 = 16 << 20;
/// Where the 32-bit BAR windows of segments 1.. end: room for each to have 16 MiB, shared
/// as the devices on them need (address_space sizes them).
pub const PCI_SEGMENTS_MMIO32_END: u64 =
    PCI_SEGMENTS_MMIO32_START + (MAX_PCI_SEGMENTS as u64 - 1) * PCI_SEGMENT_MMIO32_SIZE;
/// The 64-bit BAR window of each segment 1.., after segment 0's.
pub const PCI_SEGMENT_MMIO64_SIZE: u64 = 64 << 30;
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
pub const APIC_ADDR: u64 = 0xfee0_0000;
/// KVM needs three pages for the TSS on Intel hosts; put them just below the IOAPIC.
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;

/// Where hot-pluggable RAM goes, `(start, size)`: right after boot RAM whose highest
/// address is `boot_ram_top` (never below 4 GiB), on a [`PCI_MMIO64_ALIGN`] boundary so
/// that the 64-bit BAR window after it keeps its alignment. `size` is rounded up to it.
pub fn ram_hotplug_area(boot_ram_top: u64, hotplug_size: u64) -> (u64, u64) {
    let start = boot_ram_top
        .max(FOUR_GIB)
        .next_multiple_of(PCI_MMIO64_ALIGN);
    (start, hotplug_size.next_multiple_of(PCI_MMIO64_ALIGN))
}

/// Segment `segment`'s ECAM window when every segment covers one bus (bus 0).
pub const fn pci_segment_ecam(segment: u16) -> u64 {
    PCI_ECAM_START + segment as u64 * PCI_ECAM_SIZE
}

/// Where the ECAM window of each of `segments` segments starts, segment 0's first, given
/// how many buses each covers (`buses[segment]`; missing or 0 count as one): one after
/// another from [`PCI_ECAM_START`], so that with a bus each, segment N's is at
/// [`pci_segment_ecam`] as it has always been (snapshots and live updates of such VMs keep
/// their tables), and a segment with root ports or switches (more buses) moves the
/// windows after it up. Returns the bases and where the last window ends.
pub fn pci_ecam_bases(segments: u16, buses: &[u16]) -> (Vec<u64>, u64) {
    let mut bases = Vec::with_capacity(usize::from(segments));
    let mut next = PCI_ECAM_START;
    for segment in 0..segments.max(1) {
        bases.push(next);
        let count = buses.get(usize::from(segment)).copied().unwrap_or(1);
        next += u64::from(count.clamp(1, 256)) * PCI_ECAM_SIZE;
    }
    (bases, next)
}

/// Segment `segment`'s (1..) 32-bit BAR window, `[start, end)`.
pub const fn pci_segment_mmio32(segment: u16) -> (u64, u64) {
    let start = PCI_SEGMENTS_MMIO32_START + (segment as u64 - 1) * PCI_SEGMENT_MMIO32_SIZE;
    (start, start + PCI_SEGMENT_MMIO32_SIZE)
}

/// Segment `segment`'s (1..) 64-bit BAR window start, given where segment 0's ends.
pub fn pci_segment_mmio64_start(segment0_end: u64, segment: u16) -> u64 {
    segment0_end.next_multiple_of(PCI_MMIO64_ALIGN)
        + (u64::from(segment) - 1) * PCI_SEGMENT_MMIO64_SIZE
}

/// e820 entry types.
pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

/// AMD's HyperTransport reserved range (1012 GiB to 1 TiB): no RAM and no BARs there.
pub const AMD_HT_HOLE_START: u64 = 0xfd_0000_0000;
pub const AMD_HT_HOLE_END: u64 = 0x100_0000_0000;

/// Whether `size` bytes of guest RAM, laid out by [`ram_regions`], reach the AMD
/// HyperTransport range: only then does the host's CPU vendor change the layout.
pub fn ram_reaches_ht_hole(size: u64) -> bool {
    FOUR_GIB.saturating_add(size.saturating_sub(MMIO_HOLE_START)) > AMD_HT_HOLE_START
}

/// Splits `size` bytes of guest RAM around the 32-bit MMIO hole and, where `ht_hole` (an
/// AMD host), around the HyperTransport range: RAM that would reach it goes on at 1 TiB,
/// in a third region (as the PC layout of QEMU and of AMD's firmware has it).
pub fn ram_regions_around(size: u64, ht_hole: bool) -> Vec<RamRegion> {
    let mut regions = ram_regions(size);
    let Some(high) = regions.get_mut(1) else {
        return regions;
    };
    if !ht_hole || high.end() <= AMD_HT_HOLE_START {
        return regions;
    }
    let below = AMD_HT_HOLE_START - high.guest_addr;
    let above = RamRegion {
        guest_addr: AMD_HT_HOLE_END,
        size: high.size - below,
        file_offset: high.file_offset + below,
    };
    high.size = below;
    regions.push(above);
    regions
}

/// Splits `size` bytes of guest RAM around the 32-bit MMIO hole (a host without the AMD
/// HyperTransport range, or RAM that does not reach it: [`ram_regions_around`]).
pub fn ram_regions(size: u64) -> Vec<RamRegion> {
    let low = size.min(MMIO_HOLE_START);
    let mut regions = vec![RamRegion {
        guest_addr: 0,
        size: low,
        file_offset: 0,
    }];
    if size > low {
        regions.push(RamRegion {
            guest_addr: FOUR_GIB,
            size: size - low,
            file_offset: low,
        });
    }
    regions
}

/// One e820 entry as gpuvm reports it to guests (PVH memmap and boot_params).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

/// The memory map the guest sees: low RAM below the EBDA, the BIOS area (MP and ACPI
/// tables) reserved, then RAM from 1 MiB, split around the MMIO hole, with the PCI ECAM
/// window reserved in the hole (firmware reserves it so the OS trusts the MCFG table).
pub fn e820_map(regions: &[RamRegion]) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        E820Entry {
            addr: EBDA_START,
            size: BIOS_AREA_END - EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for region in regions {
        let start = region.guest_addr.max(HIMEM_START);
        if region.end() > start {
            map.push(E820Entry {
                addr: start,
                size: region.end() - start,
                kind: E820_RAM,
            });
        }
    }
    map.push(E820Entry {
        addr: PCI_ECAM_START,
        size: PCI_ECAM_SIZE,
        kind: E820_RESERVED,
    });
    map.sort_by_key(|e| e.addr);
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amd_ram_goes_on_past_the_hypertransport_range() {
        const GIB: u64 = 1 << 30;
        // Below the hole, the AMD layout is the usual one.
        assert!(!ram_reaches_ht_hole(1008 * GIB));
        assert_eq!(
            ram_regions_around(1008 * GIB, true),
            ram_regions(1008 * GIB)
        );
        // 1.5 TiB: 3 GiB low, 4 GiB..1012 GiB, then the rest from 1 TiB, the file in order.
        let size = 1536 * GIB;
        assert!(ram_reaches_ht_hole(size));
        let regions = ram_regions_around(size, true);
        assert_eq!(regions.len(), 3);
        assert_eq!(regions[1].guest_addr, FOUR_GIB);
        assert_eq!(regions[1].end(), AMD_HT_HOLE_START);
        assert_eq!(regions[2].guest_addr, AMD_HT_HOLE_END);
        assert_eq!(regions.iter().map(|r| r.size).sum::<u64>(), size);
        for pair in regions.windows(2) {
            assert_eq!(pair[0].file_offset + pair[0].size, pair[1].file_offset);
        }
        // The e820 map has RAM on both sides of the hole and none in it.
        let map = e820_map(&regions);
        assert!(map.iter().all(|e| e.kind != E820_RAM
            || e.addr + e.size <= AMD_HT_HOLE_START
            || e.addr >= AMD_HT_HOLE_END));
        let ram: u64 = map
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum();
        assert_eq!(ram, size - (HIMEM_START - EBDA_START));
        // Other hosts keep one high region.
        assert_eq!(ram_regions_around(size, false).len(), 2);
    }

    #[test]
    fn every_segment_window_fits_below_the_ioapic_without_overlap() {
        let mut ranges = vec![
            (PCI_MMIO32_START, PCI_MMIO32_END),
            (pci_segment_ecam(0), pci_segment_ecam(0) + PCI_ECAM_SIZE),
        ];
        for segment in 1..MAX_PCI_SEGMENTS {
            let ecam = pci_segment_ecam(segment);
            ranges.push((ecam, ecam + PCI_ECAM_SIZE));
            ranges.push(pci_segment_mmio32(segment));
        }
        ranges.sort();
        for pair in ranges.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "{pair:x?}");
        }
        assert!(ranges.last().unwrap().1 <= IOAPIC_ADDR);
        assert_eq!(pci_segment_ecam(1), PCI_ECAM_START + (1 << 20));
        let end0 = FOUR_GIB + PCI_MMIO64_DEFAULT_SIZE + 5;
        let one = pci_segment_mmio64_start(end0, 1);
        assert!(one >= end0 && one.is_multiple_of(PCI_MMIO64_ALIGN));
        assert_eq!(
            pci_segment_mmio64_start(end0, 2),
            one + PCI_SEGMENT_MMIO64_SIZE
        );
    }

    #[test]
    fn small_guest_has_one_region() {
        let regions = ram_regions(512 << 20);
        assert_eq!(regions.len(), 1);
        assert_eq!(regions[0].size, 512 << 20);
    }

    #[test]
    fn large_guest_is_split_around_the_hole() {
        let regions = ram_regions(8 << 30);
        assert_eq!(regions.len(), 2);
        assert_eq!(regions[0].end(), MMIO_HOLE_START);
        assert_eq!(regions[1].guest_addr, FOUR_GIB);
        assert_eq!(regions[0].size + regions[1].size, 8 << 30);
        assert_eq!(regions[1].file_offset, regions[0].size);
    }

    #[test]
    fn e820_reserves_bios_area_and_covers_ram() {
        let regions = ram_regions(6 << 30);
        let map = e820_map(&regions);
        let ram: u64 = map
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum();
        assert_eq!(ram, (6 << 30) - (HIMEM_START - EBDA_START));
        assert!(map
            .iter()
            .any(|e| e.kind == E820_RESERVED && e.addr == EBDA_START));
        // Sorted and non-overlapping.
        for pair in map.windows(2) {
            assert!(pair[0].addr + pair[0].size <= pair[1].addr);
        }
    }

    #[test]
    fn e820_reserves_acpi_tables_and_ecam() {
        for size in [64 << 20, 6 << 30] {
            let map = e820_map(&ram_regions(size));
            let reserved = |start: u64, end: u64| {
                map.iter()
                    .any(|e| e.kind == E820_RESERVED && e.addr <= start && end <= e.addr + e.size)
            };
            assert!(reserved(ACPI_START, ACPI_END), "{map:?}");
            assert!(reserved(PCI_ECAM_START, PCI_ECAM_START + PCI_ECAM_SIZE));
            // No RAM entry overlaps the ECAM window.
            assert!(!map.iter().any(|e| e.kind == E820_RAM
                && e.addr < PCI_ECAM_START + PCI_ECAM_SIZE
                && PCI_ECAM_START < e.addr + e.size));
            for pair in map.windows(2) {
                assert!(pair[0].addr + pair[0].size <= pair[1].addr);
            }
        }
    }
}
