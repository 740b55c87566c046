//! Guest RAM as the snapshot code sees it: the layout (page size + regions) and, for code
//! that reads or writes guest memory, where each region is mapped in this process.

use std::marker::PhantomData;
use std::os::fd::{AsFd, BorrowedFd};

use super::{Result, SnapshotError};
use crate::RamRegion;

/// Smallest page size the format supports (the x86 base page).
pub const MIN_PAGE_SIZE: u64 = 4096;
/// Largest page size the format supports (x86 1 GiB huge pages).
pub const MAX_PAGE_SIZE: u64 = 1 << 30;

/// Page size and guest-physical RAM regions.
///
/// Pages are numbered two ways: the *guest page number* (`guest_addr / page_size`, what the
/// file stores) and the *linear page index* (0.. over all regions in order, what bitmaps
/// and the loader use).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamLayout {
    page_size: u64,
    regions: Vec<RamRegion>,
    /// Linear index of each region's first page.
    first_linear: Vec<u64>,
    total_pages: u64,
}

impl RamLayout {
    /// Checks and builds a layout: a power-of-two page size in 4 KiB..=1 GiB; at least one
    /// region; regions sorted by guest address, non-overlapping, page-aligned and sized in
    /// whole pages.
    pub fn new(page_size: u64, regions: Vec<RamRegion>) -> Result<RamLayout> {
        let invalid = |reason: String| Err(SnapshotError::InvalidLayout(reason));
        if !page_size.is_power_of_two() || !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size) {
            return invalid(format!(
                "page size {page_size} is not a power of two between 4 KiB and 1 GiB"
            ));
        }
        if regions.is_empty() {
            return invalid("no RAM regions".into());
        }
        let mut first_linear = Vec::with_capacity(regions.len());
        let mut total_pages = 0u64;
        let mut prev_end = 0u64;
        for (i, r) in regions.iter().enumerate() {
            if r.size == 0 || r.size % page_size != 0 {
                return invalid(format!(
                    "region {i} size {:#x} is not a non-zero multiple of the page size {page_size:#x}",
                    r.size
                ));
            }
            if r.guest_addr % page_size != 0 || r.file_offset % page_size != 0 {
                return invalid(format!(
                    "region {i} (guest {:#x}, memfd offset {:#x}) is not aligned to the page size {page_size:#x}",
                    r.guest_addr, r.file_offset
                ));
            }
            let Some(end) = r.guest_addr.checked_add(r.size) else {
                return invalid(format!("region {i} wraps the address space"));
            };
            if i > 0 && r.guest_addr < prev_end {
                return invalid(format!(
                    "region {i} at {:#x} overlaps or precedes the previous region ending at {prev_end:#x}",
                    r.guest_addr
                ));
            }
            prev_end = end;
            first_linear.push(total_pages);
            total_pages += r.size / page_size;
        }
        Ok(RamLayout {
            page_size,
            regions,
            first_linear,
            total_pages,
        })
    }

    /// Page size in bytes.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The RAM regions, sorted by guest address.
    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// Total guest RAM in bytes.
    pub fn ram_size(&self) -> u64 {
        self.total_pages * self.page_size
    }

    /// Total number of pages.
    pub fn total_pages(&self) -> u64 {
        self.total_pages
    }

    /// Linear index of region `region`'s first page.
    pub(crate) fn region_first_linear(&self, region: usize) -> u64 {
        self.first_linear[region]
    }

    /// Number of pages in region `region`.
    pub(crate) fn region_pages(&self, region: usize) -> u64 {
        self.regions[region].size / self.page_size
    }

    /// The region holding guest page number `guest_page`, and the page's linear index.
    pub(crate) fn locate_guest_page(&self, guest_page: u64) -> Option<(usize, u64)> {
        let gpa = guest_page.checked_mul(self.page_size)?;
        let idx = self.regions.partition_point(|r| r.end() <= gpa);
        let r = self.regions.get(idx)?;
        if gpa < r.guest_addr {
            return None;
        }
        Some((
            idx,
            self.first_linear[idx] + (gpa - r.guest_addr) / self.page_size,
        ))
    }

    /// The region holding linear page `linear`.
    pub(crate) fn region_of_linear(&self, linear: u64) -> usize {
        self.first_linear.partition_point(|&f| f <= linear) - 1
    }

    /// Guest-physical address of linear page `linear` (which must be in range).
    pub(crate) fn linear_to_gpa(&self, linear: u64) -> u64 {
        let region = self.region_of_linear(linear);
        self.regions[region].guest_addr + (linear - self.first_linear[region]) * self.page_size
    }

    /// Guest page number of linear page `linear`.
    pub(crate) fn linear_to_guest_page(&self, linear: u64) -> u64 {
        self.linear_to_gpa(linear) / self.page_size
    }
}

/// Guest RAM mapped in this process: a layout plus the host address of each region.
///
/// Borrowing for `'a` ties it to whatever owns the mappings (a
/// [`GuestRam`](crate::GuestRam)), so they cannot be unmapped while in use.
///
/// Writing a snapshot reads this memory and restoring writes it; the caller keeps vCPUs and
/// DMA-capable devices quiet meanwhile (a racing writer cannot cause memory unsafety here,
/// since guest memory is only touched through raw pointers and the kernel, but it can make
/// the snapshot torn).
#[derive(Debug)]
pub struct RamMappings<'a> {
    layout: RamLayout,
    host_addrs: Vec<usize>,
    /// The memfd behind the mappings, for finding holes without touching them.
    memfd: Option<BorrowedFd<'a>>,
    _mapping: PhantomData<&'a [u8]>,
}

impl<'a> RamMappings<'a> {
    /// Describes mapped guest RAM from raw host addresses, one per region of `layout`.
    ///
    /// # Safety
    /// `host_addrs[i]` must be the start of a readable and writable mapping of at least
    /// `layout.regions()[i].size` bytes that stays mapped for `'a`.
    pub unsafe fn new(layout: RamLayout, host_addrs: Vec<*mut u8>) -> Result<RamMappings<'a>> {
        if host_addrs.len() != layout.regions().len() {
            return Err(SnapshotError::InvalidLayout(format!(
                "{} host addresses for {} regions",
                host_addrs.len(),
                layout.regions().len()
            )));
        }
        if let Some(i) = host_addrs
            .iter()
            .position(|&a| a.is_null() || !(a as u64).is_multiple_of(MIN_PAGE_SIZE))
        {
            return Err(SnapshotError::InvalidLayout(format!(
                "host address {:p} of region {i} is null or not page aligned",
                host_addrs[i]
            )));
        }
        Ok(RamMappings {
            layout,
            host_addrs: host_addrs.into_iter().map(|a| a as usize).collect(),
            memfd: None,
            _mapping: PhantomData,
        })
    }

    /// Names the memfd the regions are mapped from (at their `file_offset`s). Snapshot
    /// writing then asks it where the holes are (`SEEK_HOLE`) and never reads them:
    /// reading a never-touched shmem page would allocate it.
    pub fn with_memfd(mut self, memfd: BorrowedFd<'a>) -> RamMappings<'a> {
        self.memfd = Some(memfd);
        self
    }

    /// The memfd, if known.
    pub(crate) fn memfd(&self) -> Option<BorrowedFd<'a>> {
        self.memfd
    }

    /// Describes a [`GuestRam`](crate::GuestRam)'s mappings.
    pub fn from_guest_ram(ram: &'a crate::GuestRam) -> Result<RamMappings<'a>> {
        let (regions, host_addrs): (Vec<RamRegion>, Vec<*mut u8>) = ram.host_regions().unzip();
        let layout = RamLayout::new(ram.page_size(), regions)?;
        // SAFETY: `GuestRam` maps each region whole, readable and writable, at the address
        // it reports, for as long as it lives; borrowing it for 'a keeps it alive.
        let mappings = unsafe { RamMappings::new(layout, host_addrs) }?;
        Ok(mappings.with_memfd(ram.memfd().as_fd()))
    }

    /// Describes guest RAM made of several [`GuestRam`](crate::GuestRam)s in one file: boot
    /// RAM first, then RAM plugged into its hot-plug area (views that share its file), in
    /// guest-address order. Refuses RAM of another file or page size.
    pub fn from_guest_rams(rams: &[&'a crate::GuestRam]) -> Result<RamMappings<'a>> {
        let Some(first) = rams.first() else {
            return Err(SnapshotError::InvalidLayout("no guest RAM".into()));
        };
        if let Some(other) = rams
            .iter()
            .find(|ram| !first.shares_file_with(ram) || ram.page_size() != first.page_size())
        {
            return Err(SnapshotError::InvalidLayout(format!(
                "guest RAM at {:#x} is not in the boot RAM's file or pages",
                other.regions().first().map_or(0, |r| r.guest_addr)
            )));
        }
        let mut regions: Vec<(RamRegion, *mut u8)> =
            rams.iter().flat_map(|ram| ram.host_regions()).collect();
        regions.sort_by_key(|(region, _)| region.guest_addr);
        let (regions, host_addrs): (Vec<RamRegion>, Vec<*mut u8>) = regions.into_iter().unzip();
        let layout = RamLayout::new(first.page_size(), regions)?;
        // SAFETY: each `GuestRam` maps each of its regions whole, readable and writable, at
        // the address it reports, for as long as it lives; borrowing them for 'a keeps
        // them alive.
        let mappings = unsafe { RamMappings::new(layout, host_addrs) }?;
        Ok(mappings.with_memfd(first.memfd().as_fd()))
    }

    /// The layout.
    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    /// Host address of region `region`'s first byte.
    pub fn host_addr(&self, region: usize) -> *mut u8 {
        self.host_addrs[region] as *mut u8
    }

    /// Host address of linear page `linear` (which must be in range).
    pub(crate) fn linear_page_ptr(&self, linear: u64) -> *mut u8 {
        let region = self.layout.region_of_linear(linear);
        let offset = (linear - self.layout.region_first_linear(region)) * self.layout.page_size();
        // Inside the region's mapping, as `linear` belongs to `region`.
        self.host_addr(region).wrapping_add(offset as usize)
    }

    /// Offset of linear page `linear` (which must be in range) in the memfd.
    pub(crate) fn memfd_offset(&self, linear: u64) -> u64 {
        let region = self.layout.region_of_linear(linear);
        self.layout.regions()[region].file_offset
            + (linear - self.layout.region_first_linear(region)) * self.layout.page_size()
    }

    /// The host address of every region, for registering with userfaultfd.
    pub fn host_addrs(&self) -> Vec<u64> {
        self.host_addrs.iter().map(|&a| a as u64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(guest_addr: u64, size: u64, file_offset: u64) -> RamRegion {
        RamRegion {
            guest_addr,
            size,
            file_offset,
        }
    }

    #[test]
    fn page_numbering_across_a_hole() {
        let layout = RamLayout::new(
            4096,
            vec![
                region(0, 0x10_0000, 0),
                region(0x1_0000_0000, 0x2000, 0x10_0000),
            ],
        )
        .unwrap();
        assert_eq!(layout.total_pages(), 258);
        assert_eq!(layout.locate_guest_page(0), Some((0, 0)));
        assert_eq!(layout.locate_guest_page(255), Some((0, 255)));
        assert_eq!(layout.locate_guest_page(256), None);
        assert_eq!(layout.locate_guest_page(0x10_0000), Some((1, 256)));
        assert_eq!(layout.locate_guest_page(0x10_0002), None);
        assert_eq!(layout.linear_to_gpa(257), 0x1_0000_1000);
        assert_eq!(layout.linear_to_guest_page(256), 0x10_0000);
    }

    #[test]
    fn bad_layouts_are_rejected() {
        assert!(RamLayout::new(3000, vec![region(0, 0x1000, 0)]).is_err());
        assert!(RamLayout::new(4096, vec![]).is_err());
        assert!(RamLayout::new(4096, vec![region(0, 0x1800, 0)]).is_err());
        assert!(
            RamLayout::new(4096, vec![region(0x2000, 0x1000, 0), region(0, 0x1000, 0)]).is_err()
        );
        assert!(RamLayout::new(1 << 21, vec![region(0x1000, 1 << 21, 0)]).is_err());
    }
}
