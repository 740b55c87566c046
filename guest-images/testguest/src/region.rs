//! The data region of memtest/memloop/zerofill: e820 RAM at or above 16 MiB (and below the
//! mapped 64 GiB), 4 KiB aligned, ascending, overlaps removed, the first SIZE bytes
//! (SIZE rounded down to 4 KiB).

use crate::bootinfo::{MemmapEntry, E820_RAM, MAX_MEMMAP};

pub const REGION_START: u64 = 16 << 20;
pub const PAGE_SIZE: u64 = 4096;

#[derive(Clone, Copy)]
pub struct Region {
    ranges: [(u64, u64); MAX_MEMMAP],
    count: usize,
    /// Bytes in the region (a multiple of PAGE_SIZE).
    pub size: u64,
}

pub struct NotEnoughRam;

impl Region {
    pub const EMPTY: Region = Region {
        ranges: [(0, 0); MAX_MEMMAP],
        count: 0,
        size: 0,
    };

    pub fn new(memmap: &[MemmapEntry], size: u64) -> Result<Region, NotEnoughRam> {
        let wanted = size & !(PAGE_SIZE - 1);
        let mut ram = [(0u64, 0u64); MAX_MEMMAP];
        let mut n = 0;
        for entry in memmap.iter().filter(|e| e.kind == E820_RAM) {
            let start = entry.addr.max(REGION_START);
            let end = entry
                .addr
                .saturating_add(entry.size)
                .min(crate::boot::MAPPED_LIMIT);
            let start = start.saturating_add(PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
            let end = end & !(PAGE_SIZE - 1);
            if start < end {
                ram[n] = (start, end);
                n += 1;
            }
        }
        let ram = &mut ram[..n];
        // Insertion sort by start: few entries, no allocator.
        for i in 1..ram.len() {
            let mut j = i;
            while j > 0 && ram[j - 1].0 > ram[j].0 {
                ram.swap(j - 1, j);
                j -= 1;
            }
        }
        let mut region = Region::EMPTY;
        let mut covered = REGION_START;
        for &(start, end) in ram.iter() {
            let start = start.max(covered);
            if start >= end || region.size == wanted {
                continue;
            }
            let len = (end - start).min(wanted - region.size);
            region.ranges[region.count] = (start, len);
            region.count += 1;
            region.size += len;
            covered = end;
        }
        if region.size < wanted {
            return Err(NotEnoughRam);
        }
        Ok(region)
    }

    /// (start, len) ranges in ascending order.
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges[..self.count]
    }

    pub fn pages(&self) -> u64 {
        self.size / PAGE_SIZE
    }

    /// Calls `f(start, len)` for the parts of the region holding pages `first..end` (page
    /// indices counted over the whole region).
    pub fn for_each_in_pages(&self, first: u64, end: u64, mut f: impl FnMut(u64, u64)) {
        let mut page = 0u64;
        for &(start, len) in self.ranges() {
            let pages = len / PAGE_SIZE;
            let lo = first.max(page);
            let hi = end.min(page + pages);
            if lo < hi {
                f(start + (lo - page) * PAGE_SIZE, (hi - lo) * PAGE_SIZE);
            }
            page += pages;
        }
    }
}
