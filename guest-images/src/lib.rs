//! Guest images embedded in gpuvm.
//!
//! [`TEST_GUEST_ELF`] is the freestanding test guest built from `testguest/` by `build.rs`: a
//! PVH ELF (Xen note XEN_ELFNOTE_PHYS32_ENTRY) linked at 1 MiB that does its setup in as few
//! ring-0 instructions as possible and runs its workloads in ring 3. Its I/O contract (serial
//! lines, exit port, command line, workloads) is described in `README.md` next to this crate.
//!
//! This crate also has an independent host-side reference of the guest's memory pattern and
//! checksums ([`pattern`], [`memtest_checksum`], [`memloop_checksum`]), so tests can check what a
//! guest prints without trusting the guest's own arithmetic.

/// The test guest ELF (PVH boot protocol, load address 1 MiB).
pub static TEST_GUEST_ELF: &[u8] = include_bytes!(env!("GPUVM_TEST_GUEST_ELF"));

/// Where `build.rs` left the same ELF on the build machine, for tools that want a file (e.g.
/// `qemu-system-x86_64 -kernel`). Only valid on the machine and in the tree that built this crate.
pub const TEST_GUEST_ELF_PATH: &str = env!("GPUVM_TEST_GUEST_ELF");

/// The test guest's fixed protocol: ports, lines and exit statuses.
pub mod protocol {
    /// 16550 transmit register: the guest writes each character as a 1-byte `out` (one exit each).
    pub const SERIAL_PORT: u16 = 0x3f8;
    /// The guest writes its exit status here as a 32-bit `out`.
    pub const EXIT_PORT: u16 = 0xf4;
    /// First line, printed as soon as the guest runs in ring 3.
    pub const READY_LINE: &str = "testguest: ready";
    /// Printed by the `hello` workload (also the empty command line).
    pub const HELLO_LINE: &str = "testguest: hello from ring 3";
    /// Workload succeeded.
    pub const EXIT_OK: u32 = 0;
    /// memtest/memloop found a word that did not hold the expected pattern.
    pub const EXIT_MISMATCH: u32 = 1;
    /// Bad usage, unknown workload, not enough RAM, or not every CPU came online.
    pub const EXIT_SETUP_FAILED: u32 = 2;
    /// A CPU exception ("testguest: exception <vec> err=<hex> rip=<hex>").
    pub const EXIT_EXCEPTION: u32 = 3;
    /// A Rust panic in the guest ("testguest: panic: ...").
    pub const EXIT_PANIC: u32 = 4;
    /// The data region of memtest/memloop/zerofill starts at this guest-physical address.
    pub const DATA_REGION_START: u64 = 16 << 20;
    /// The guest identity-maps guest-physical memory below this address.
    pub const MAPPED_LIMIT: u64 = 64 << 30;
    /// The data region is made of whole pages of this size.
    pub const PAGE_SIZE: u64 = 4096;
}

use protocol::{DATA_REGION_START, MAPPED_LIMIT, PAGE_SIZE};

/// SplitMix64 output for state `z` (the state is advanced first, as in the reference generator).
pub fn splitmix64(z: u64) -> u64 {
    let mut x = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The 64-bit word the guest writes at guest-physical address `addr` for `seed`.
pub fn pattern(seed: u64, addr: u64) -> u64 {
    splitmix64(seed.wrapping_add(addr))
}

/// The data region the guest uses for `size` bytes, as ascending `(start, len)` ranges.
///
/// `ranges` are the e820 RAM ranges `(start, len)` (any order). The region is the RAM at or above
/// [`DATA_REGION_START`] and below [`MAPPED_LIMIT`], each range shrunk to whole 4 KiB pages,
/// overlaps counted once, in ascending address order, truncated to `size` rounded down to 4 KiB.
/// `None` when the RAM cannot hold that much (the guest then fails with "not enough RAM").
pub fn data_region(ranges: &[(u64, u64)], size: u64) -> Option<Vec<(u64, u64)>> {
    let mut pages: Vec<(u64, u64)> = ranges
        .iter()
        .filter_map(|&(start, len)| {
            let end = start.saturating_add(len).min(MAPPED_LIMIT) / PAGE_SIZE * PAGE_SIZE;
            let start = start.max(DATA_REGION_START).div_ceil(PAGE_SIZE) * PAGE_SIZE;
            (start < end).then_some((start, end))
        })
        .collect();
    pages.sort_unstable();

    // Union of the intervals, ascending.
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(pages.len());
    for (start, end) in pages {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }

    let mut remaining = size / PAGE_SIZE * PAGE_SIZE;
    let mut region = Vec::new();
    for (start, end) in merged {
        if remaining == 0 {
            break;
        }
        let len = (end - start).min(remaining);
        region.push((start, len));
        remaining -= len;
    }
    (remaining == 0).then_some(region)
}

/// Wrapping sum of `pattern(seed, a)` over every 8-byte word `a` of a set of ranges.
fn pattern_sum(region: &[(u64, u64)], seed: u64) -> u64 {
    region
        .iter()
        .flat_map(|&(start, len)| (start..start + len).step_by(8))
        .fold(0u64, |sum, addr| sum.wrapping_add(pattern(seed, addr)))
}

/// The checksum `memtest SIZE SEED` prints for a guest whose e820 RAM ranges are `ranges`.
///
/// If the RAM cannot hold `size` (see [`data_region`]), the guest fails instead; this then
/// returns the checksum over all the RAM the region could use.
pub fn memtest_checksum(ranges: &[(u64, u64)], size: u64, seed: u64) -> u64 {
    let region = data_region(ranges, size)
        .unwrap_or_else(|| data_region(ranges, u64::MAX / 2).unwrap_or_default());
    pattern_sum(&region, seed)
}

/// The checksum `memloop SIZE SEED ITERS` prints for iteration `iter` (it writes
/// `pattern(SEED + iter, a)` over the same region as memtest).
pub fn memloop_checksum(ranges: &[(u64, u64)], size: u64, seed: u64, iter: u64) -> u64 {
    memtest_checksum(ranges, size, seed.wrapping_add(iter))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// e820 RAM of `qemu-system-x86_64 -M microvm -m 512M` (as the guest's `info` prints it).
    const QEMU_512M_RAM: &[(u64, u64)] = &[(0, 0x9fc00), (0x10_0000, 0x2000_0000 - 0x10_0000)];
    /// e820 RAM of `-M microvm -m 6G`: 3 GiB below the PCI hole, 3 GiB from 4 GiB.
    const QEMU_6G_RAM: &[(u64, u64)] = &[
        (0, 0x9fc00),
        (0x10_0000, 0xC000_0000 - 0x10_0000),
        (0x1_0000_0000, 0xC000_0000),
    ];

    #[test]
    fn splitmix64_matches_the_reference_generator() {
        // SplitMix64 seeded with 0: first two outputs of the published reference generator.
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(pattern(0x9E37_79B9_7F4A_7C15 - 8, 8), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn data_region_skips_low_memory_holes_and_partial_pages() {
        let ram = [
            (0x2_0000_0000, 0x1000_0000), // listed first: order must not matter
            (0, 0x9fc00),
            (0x10_0000, 0x1100_0000 - 0x10_0000 + 0x800), // ends 2 KiB into a page
        ];
        let region = data_region(&ram, 0x2000_0000).expect("enough RAM");
        assert_eq!(
            region,
            vec![(0x100_0000, 0x1000_0000), (0x2_0000_0000, 0x1000_0000)]
        );
        // Size rounds down to whole pages.
        assert_eq!(
            data_region(&ram, 0x1fff).expect("enough RAM"),
            vec![(0x100_0000, 0x1000)]
        );
        assert_eq!(data_region(&ram, 0), Some(vec![]));
    }

    #[test]
    fn data_region_counts_overlaps_once_and_reports_too_little_ram() {
        let ram = [(0x100_0000, 0x20_0000), (0x110_0000, 0x20_0000)];
        assert_eq!(
            data_region(&ram, 0x30_0000),
            Some(vec![(0x100_0000, 0x30_0000)])
        );
        assert_eq!(data_region(&ram, 0x30_1000), None);
        assert_eq!(data_region(QEMU_512M_RAM, 512 << 20), None);
    }

    #[test]
    fn data_region_stops_at_the_mapped_limit() {
        let ram = [(MAPPED_LIMIT - 0x1000, 0x10_0000)];
        assert_eq!(
            data_region(&ram, 0x1000),
            Some(vec![(MAPPED_LIMIT - 0x1000, 0x1000)])
        );
        assert_eq!(data_region(&ram, 0x2000), None);
    }

    /// Printed by the guest under QEMU:
    /// `-M microvm -m 512M -append "memtest 256M 42"` ->
    /// `memtest: size=268435456 seed=42 checksum=0x95db182dab19d5e5`.
    #[test]
    fn memtest_checksum_matches_the_guest_under_qemu() {
        assert_eq!(
            memtest_checksum(QEMU_512M_RAM, 256 << 20, 42),
            0x95db_182d_ab19_d5e5
        );
    }

    /// Printed by the guest under gpuvm (`run --memory 256M --cmdline "memtest 64M 42"`, whose
    /// e820 RAM is 0..0x9fc00 and 1 MiB..256 MiB): checksum=0xb40cd1244ca9a8d0.
    #[test]
    fn memtest_checksum_matches_the_guest_under_gpuvm() {
        let gpuvm_256m_ram = [(0, 0x9fc00), (0x10_0000, 0x1000_0000 - 0x10_0000)];
        assert_eq!(
            memtest_checksum(&gpuvm_256m_ram, 64 << 20, 42),
            0xb40c_d124_4ca9_a8d0
        );
    }

    /// Printed by the guest under QEMU (`-m 512M`, 1 and 2 vCPUs) and gpuvm (2 vCPUs):
    /// `memloop 64M 7 3` ->
    /// iter 0 0x41110f19a8b06877, iter 1 0xa22c4e61262138a7, iter 2 0xe61c711a0fe953a6.
    #[test]
    fn memloop_checksums_match_the_guest_under_qemu() {
        let expected = [
            0x4111_0f19_a8b0_6877,
            0xa22c_4e61_2621_38a7,
            0xe61c_711a_0fe9_53a6,
        ];
        for (iter, want) in expected.into_iter().enumerate() {
            assert_eq!(
                memloop_checksum(QEMU_512M_RAM, 64 << 20, 7, iter as u64),
                want,
                "iteration {iter}"
            );
        }
    }

    /// `-m 6G -append "memtest 5G 1"` -> checksum=0x701cc3fbdd9e1cec; the region crosses the
    /// 3..4 GiB hole. 640 Mi words: run with `cargo test --release -- --ignored`.
    #[test]
    #[ignore = "slow without optimisation; run with --release -- --ignored"]
    fn memtest_checksum_across_the_pci_hole_matches_the_guest_under_qemu() {
        assert_eq!(
            memtest_checksum(QEMU_6G_RAM, 5 << 30, 1),
            0x701c_c3fb_dd9e_1cec
        );
    }

    fn read_u16(bytes: &[u8], offset: usize) -> u16 {
        u16::from_le_bytes(bytes[offset..offset + 2].try_into().unwrap())
    }

    fn read_u32(bytes: &[u8], offset: usize) -> u32 {
        u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap())
    }

    fn read_u64(bytes: &[u8], offset: usize) -> u64 {
        u64::from_le_bytes(bytes[offset..offset + 8].try_into().unwrap())
    }

    struct Segment {
        kind: u32,
        offset: usize,
        paddr: u64,
        filesz: u64,
        memsz: u64,
    }

    const PT_LOAD: u32 = 1;
    const PT_NOTE: u32 = 4;
    const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

    fn segments(elf: &[u8]) -> Vec<Segment> {
        let phoff = read_u64(elf, 32) as usize;
        let phentsize = read_u16(elf, 54) as usize;
        let phnum = read_u16(elf, 56) as usize;
        (0..phnum)
            .map(|i| {
                let ph = phoff + i * phentsize;
                Segment {
                    kind: read_u32(elf, ph),
                    offset: read_u64(elf, ph + 8) as usize,
                    paddr: read_u64(elf, ph + 24),
                    filesz: read_u64(elf, ph + 32),
                    memsz: read_u64(elf, ph + 40),
                }
            })
            .collect()
    }

    /// The PVH entry from the Xen notes of the PT_NOTE segments.
    fn pvh_entry(elf: &[u8], segments: &[Segment]) -> Option<u64> {
        let align4 = |n: usize| n.div_ceil(4) * 4;
        for note_segment in segments.iter().filter(|s| s.kind == PT_NOTE) {
            let data =
                &elf[note_segment.offset..note_segment.offset + note_segment.filesz as usize];
            let mut at = 0;
            while at + 12 <= data.len() {
                let namesz = read_u32(data, at) as usize;
                let descsz = read_u32(data, at + 4) as usize;
                let kind = read_u32(data, at + 8);
                let name = &data[at + 12..at + 12 + namesz];
                let desc = at + 12 + align4(namesz);
                if name == b"Xen\0" && kind == XEN_ELFNOTE_PHYS32_ENTRY {
                    return match descsz {
                        4 => Some(read_u32(data, desc) as u64),
                        8 => Some(read_u64(data, desc)),
                        _ => None,
                    };
                }
                at = desc + align4(descsz);
            }
        }
        None
    }

    #[test]
    fn embedded_guest_is_an_x86_64_pvh_elf() {
        let elf = TEST_GUEST_ELF;
        assert!(elf.len() > 64, "ELF is {} bytes", elf.len());
        assert_eq!(&elf[..4], b"\x7fELF");
        assert_eq!(elf[4], 2, "not ELFCLASS64");
        assert_eq!(elf[5], 1, "not little endian");
        assert_eq!(read_u16(elf, 16), 2, "not ET_EXEC");
        assert_eq!(read_u16(elf, 18), 62, "not EM_X86_64");

        let segments = segments(elf);
        let entry = pvh_entry(elf, &segments).expect("no Xen PVH entry note");
        let loads: Vec<&Segment> = segments.iter().filter(|s| s.kind == PT_LOAD).collect();
        assert!(
            loads
                .iter()
                .any(|s| s.paddr <= entry && entry < s.paddr + s.filesz),
            "PVH entry {entry:#x} is in no PT_LOAD segment"
        );
        // Linked at 1 MiB, and the whole image (bss included) below the data region.
        assert_eq!(loads.iter().map(|s| s.paddr).min(), Some(0x10_0000));
        for load in loads {
            assert!(load.paddr + load.memsz <= DATA_REGION_START);
        }
        // The entry is 32-bit code reachable from PVH's 32-bit protected mode.
        assert!(entry < 1 << 32);
    }

    #[test]
    fn elf_path_points_at_the_embedded_bytes() {
        let on_disk = std::fs::read(TEST_GUEST_ELF_PATH).expect("built ELF is readable");
        assert_eq!(on_disk, TEST_GUEST_ELF);
    }
}
