//! Guest RAM for gpuvm.
//!
//! All guest RAM lives in one memfd (optionally hugetlb-backed). Each guest-physical RAM
//! region is a `MAP_SHARED` mapping of a slice of that memfd, so the same pages can be
//! handed to KVM, to a vfio-user device process (DMA through the shared fd), and to the
//! snapshot code, without copies.
//!
//! Modules:
//! - [`backing`]: creating the memfd, mapping regions, THP/hugetlb policy, host checks.
//! - [`huge_tmpfs`]: shared RAM with huge pages from a private tmpfs (the default).
//! - [`prefault`]: populating guest RAM with several threads before boot.
//! - [`snapshot`]: the memory file format (non-zero pages only), writing, diff chains,
//!   eager restore.
//! - [`uffd`]: lazy restore with userfaultfd (in-process loader and the external-handler
//!   handshake).

mod anon;
pub mod backing;
pub mod huge_tmpfs;
pub mod numa;
pub mod prefault;
pub mod snapshot;
pub mod uffd;

pub use backing::{
    check_fits_host, host_memory_total, slot_slices, Backing, ByteSize, GuestRam, GuestRamConfig,
    RamError, SlotSlice, SlotSliceSize, MAX_SLOT_BYTES, SLOT_SLICE_GRANULE,
    SPARSE_RAM_PER_HOST_RAM,
};
pub use prefault::{prefault, PrefaultError, PrefaultStats};

/// One contiguous range of guest-physical RAM and where it lives in the RAM memfd.
///
/// The VMM's memory layout produces these (RAM is split around the 32-bit MMIO hole);
/// everything that needs to find guest pages in the memfd or the memory file uses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRegion {
    /// Guest-physical start address.
    pub guest_addr: u64,
    /// Length in bytes (a multiple of the backing page size).
    pub size: u64,
    /// Offset of the region's first byte in the RAM memfd.
    pub file_offset: u64,
}

impl RamRegion {
    /// One past the last guest-physical address of the region.
    pub fn end(&self) -> u64 {
        self.guest_addr + self.size
    }
}
