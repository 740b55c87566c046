//! virtio-balloon, the memory balloon (virtio 1.x section 5.5): the host sets a target
//! (`num_pages` in the configuration space), the guest's driver gives that many 4 KiB pages
//! back through the inflate queue (arrays of little-endian u32 page frame numbers) and takes
//! them again through the deflate queue, and writes how many it holds into `actual`.
//!
//! Inflated pages are freed on the host: the device checks each PFN lies in guest RAM,
//! merges neighbouring PFNs into runs and `madvise(MADV_REMOVE)`s each run of the shared
//! (memfd) mapping, which punches the hole in the memfd. A deflated page needs nothing: it
//! faults back in as zeros on its next touch. With VIRTIO_BALLOON_F_STATS_VQ the guest keeps
//! one statistics buffer in the third queue; the device keeps the last statistics it read and
//! returns the buffer every polling interval, asking for fresh ones.
//!
//! - [`device`]: [`Balloon`], the [`VirtioDevice`](crate::VirtioDevice).
//! - `handler`: the worker thread's side: the three queues and the polling timer.

pub mod device;
mod handler;

use std::collections::BTreeMap;

use vm_memory::{GuestAddress, GuestMemoryBackend as _, GuestMemoryRegion, MemoryRegionAddress};

pub use device::{Balloon, BalloonState, BalloonStateError};

use crate::GuestMemory;

const DEVICE_NAME: &str = "virtio-balloon";
/// The worker thread's name (at most 15 bytes show in /proc).
const THREAD_NAME: &str = "virtio-balloon";
pub const QUEUE_MAX_SIZE: u16 = 256;
/// The balloon's page size: PFNs count 4 KiB pages whatever the guest's page size.
pub const PAGE_SIZE: u64 = 4096;
pub const PAGES_PER_MIB: u32 = 256;
/// The most PFNs one inflate or deflate buffer may carry (Linux sends at most 256): a
/// chain that claims more is refused, so a guest cannot make the device allocate or walk
/// unbounded lists.
pub const MAX_PFNS_PER_REQUEST: usize = 4096;
/// Statistics are (u16 tag, u64 value) pairs, packed.
pub const STAT_ENTRY_SIZE: usize = 10;
/// The most statistics entries one buffer may carry (Linux sends 10 to 16).
pub const MAX_STAT_ENTRIES: usize = 64;

/// Feature bits (virtio 1.x 5.5.3).
pub const VIRTIO_BALLOON_F_STATS_VQ: u64 = 1;
pub const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u64 = 2;

/// Queue indices.
pub const INFLATE_QUEUE: u16 = 0;
pub const DEFLATE_QUEUE: u16 = 1;
pub const STATS_QUEUE: u16 = 2;

/// How the balloon is built (Firecracker's PUT /balloon body).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonConfig {
    /// The target size of the balloon, in MiB.
    pub amount_mib: u32,
    /// Offer VIRTIO_BALLOON_F_DEFLATE_ON_OOM: the guest may take pages back under memory
    /// pressure.
    pub deflate_on_oom: bool,
    /// Seconds between statistics requests; 0 turns statistics off (the stats queue is not
    /// offered). Can be changed after boot, but not turned on or off.
    #[serde(default)]
    pub stats_polling_interval_s: u16,
}

impl BalloonConfig {
    pub fn target_pages(&self) -> u32 {
        self.amount_mib.saturating_mul(PAGES_PER_MIB)
    }
}

/// Why a balloon could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    #[error("statistics were {state} when the balloon was configured; they cannot be turned {wanted} after boot")]
    StatsToggle {
        state: &'static str,
        wanted: &'static str,
    },
    #[error("virtio-balloon: cannot create its statistics timer: {0}")]
    Timer(#[source] std::io::Error),
    #[error("virtio-balloon: cannot restart its I/O thread: {0}")]
    Thread(#[source] crate::worker::WorkerError),
    #[error("virtio-balloon: its I/O thread failed and took its queues")]
    Failed,
}

/// The statistics tags Linux sends (include/uapi/linux/virtio_balloon.h), by their
/// Firecracker names.
pub const STAT_NAMES: [&str; 16] = [
    "swap_in",
    "swap_out",
    "major_faults",
    "minor_faults",
    "free_memory",
    "total_memory",
    "available_memory",
    "disk_caches",
    "hugetlb_allocations",
    "hugetlb_failures",
    "oom_kill",
    "alloc_stall",
    "async_scan",
    "direct_scan",
    "async_reclaim",
    "direct_reclaim",
];

/// The last statistics the guest sent, by tag (unknown tags are dropped).
pub type GuestStats = BTreeMap<u16, u64>;

/// Parses one statistics buffer: whole 10-byte entries, at most [`MAX_STAT_ENTRIES`].
pub fn parse_stats(bytes: &[u8]) -> Result<GuestStats, String> {
    if !bytes.len().is_multiple_of(STAT_ENTRY_SIZE)
        || bytes.len() > MAX_STAT_ENTRIES * STAT_ENTRY_SIZE
    {
        return Err(format!(
            "a {}-byte statistics buffer is not a whole number (at most {MAX_STAT_ENTRIES}) of {STAT_ENTRY_SIZE}-byte entries",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(STAT_ENTRY_SIZE)
        .filter_map(|entry| {
            let tag = u16::from_le_bytes([entry[0], entry[1]]);
            let mut value = [0u8; 8];
            value.copy_from_slice(&entry[2..]);
            (usize::from(tag) < STAT_NAMES.len()).then_some((tag, u64::from_le_bytes(value)))
        })
        .collect())
}

/// A run of contiguous guest pages: the first PFN and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    pub first_pfn: u64,
    pub pages: u64,
}

/// Sorts and de-duplicates `pfns`, then merges neighbours into runs.
pub fn coalesce(pfns: &mut Vec<u32>) -> Vec<PageRun> {
    pfns.sort_unstable();
    pfns.dedup();
    let mut runs: Vec<PageRun> = Vec::new();
    for &pfn in pfns.iter() {
        let pfn = u64::from(pfn);
        match runs.last_mut() {
            Some(run) if run.first_pfn + run.pages == pfn => run.pages += 1,
            _ => runs.push(PageRun {
                first_pfn: pfn,
                pages: 1,
            }),
        }
    }
    runs
}

/// Whether the whole page `pfn` lies in one guest RAM region.
pub fn pfn_is_ram(memory: &GuestMemory, pfn: u32) -> bool {
    let start = u64::from(pfn) * PAGE_SIZE;
    memory
        .find_region(GuestAddress(start))
        .is_some_and(|region| {
            let offset = start - region.start_addr().0;
            offset + PAGE_SIZE <= region.len()
        })
}

/// Gives the host memory behind `run` back (MADV_REMOVE punches the hole in the memfd, so
/// the pages read as zero afterwards). The run must be guest RAM ([`pfn_is_ram`] of each
/// page); a run that spans two regions is split.
pub fn discard(memory: &GuestMemory, run: PageRun) -> std::io::Result<()> {
    let mut start = run.first_pfn * PAGE_SIZE;
    let end = start + run.pages * PAGE_SIZE;
    while start < end {
        let region = memory
            .find_region(GuestAddress(start))
            .ok_or_else(|| std::io::Error::other(format!("{start:#x} is not guest RAM")))?;
        let offset = start - region.start_addr().0;
        let len = (end - start).min(region.len() - offset);
        let host = region
            .get_host_address(MemoryRegionAddress(offset))
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: `host..host + len` lies inside this region's mapping (offset + len is at
        // most the region's length). The mapping stays valid (only its contents are
        // dropped): the guest gave these pages up, and they read as zeros from now on.
        let result = unsafe { libc::madvise(host.cast(), len as usize, libc::MADV_REMOVE) };
        if result != 0 {
            return Err(std::io::Error::last_os_error());
        }
        start += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
