//! Guest RAM backing: one memfd (plain shmem or hugetlb), one `MAP_SHARED` mapping per
//! guest-physical RAM region.
//!
//! Everything is validated before any memory is allocated, so a bad size or an empty
//! huge page pool is reported as a sentence the user can act on rather than as a failed
//! `mmap`.

use std::ffi::CStr;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use log::{debug, info, warn};
use vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionCollectionError};
use vm_memory::{GuestRegionMmap, MmapRegion};

use crate::RamRegion;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Pages of this size back the host mappings when the backing is a plain memfd.
const BASE_PAGE_SIZE: u64 = 4 * KIB;

/// mincore() is called on at most this many bytes at a time, to bound its result vector.
const MINCORE_CHUNK: usize = GIB as usize;

/// What kind of memory backs guest RAM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backing {
    /// A shmem memfd with 4 KiB pages (transparent huge pages if the host allows them).
    #[default]
    Memfd,
    /// A hugetlb memfd with 2 MiB pages from the host's reserved pool.
    Hugetlb2M,
    /// A hugetlb memfd with 1 GiB pages from the host's reserved pool.
    Hugetlb1G,
}

impl Backing {
    /// The page size guest RAM is allocated in; sizes and region boundaries must be
    /// multiples of it.
    pub fn page_size(self) -> u64 {
        match self {
            Backing::Memfd => BASE_PAGE_SIZE,
            Backing::Hugetlb2M => 2 * MIB,
            Backing::Hugetlb1G => GIB,
        }
    }

    /// Whether the pages come from the hugetlb pool.
    pub fn is_hugetlb(self) -> bool {
        !matches!(self, Backing::Memfd)
    }

    fn memfd_flags(self) -> libc::c_uint {
        match self {
            Backing::Memfd => libc::MFD_CLOEXEC,
            Backing::Hugetlb2M => libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            Backing::Hugetlb1G => libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_1GB,
        }
    }

    /// The sysfs directory describing the hugetlb pool for this page size.
    fn hugetlb_pool_dir(self) -> PathBuf {
        PathBuf::from(format!(
            "/sys/kernel/mm/hugepages/hugepages-{}kB",
            self.page_size() / KIB
        ))
    }

    /// The command that sets the pool to `pages` pages.
    fn reserve_hint(self, pages: u64) -> String {
        match self {
            Backing::Hugetlb2M => format!("sysctl vm.nr_hugepages={pages}"),
            _ => format!(
                "echo {pages} > {}/nr_hugepages",
                self.hugetlb_pool_dir().display()
            ),
        }
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backing::Memfd => "memfd",
            Backing::Hugetlb2M => "hugetlb-2m",
            Backing::Hugetlb1G => "hugetlb-1g",
        })
    }
}

impl FromStr for Backing {
    type Err = RamError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "memfd" => Ok(Backing::Memfd),
            "hugetlb-2m" => Ok(Backing::Hugetlb2M),
            "hugetlb-1g" => Ok(Backing::Hugetlb1G),
            other => Err(RamError::UnknownBacking(other.to_string())),
        }
    }
}

/// A byte count printed the way people read sizes: "64 GiB", "2 MiB", "23.4 GiB".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        let Some(&(unit, name)) = [(GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")]
            .iter()
            .find(|(unit, _)| bytes >= *unit)
        else {
            return write!(f, "{bytes} bytes");
        };
        if bytes.is_multiple_of(unit) {
            write!(f, "{} {name}", bytes / unit)
        } else {
            write!(f, "{:.1} {name}", bytes as f64 / unit as f64)
        }
    }
}

/// Errors from creating or inspecting guest RAM.
#[derive(Debug, thiserror::Error)]
pub enum RamError {
    #[error("unknown memory backing '{0}' (expected memfd, hugetlb-2m or hugetlb-1g)")]
    UnknownBacking(String),
    #[error("guest memory size is 0")]
    ZeroSize,
    #[error(
        "guest memory size {size} bytes is not a multiple of {} (the page size of {backing} backing)",
        ByteSize(.backing.page_size())
    )]
    SizeNotPageMultiple { size: u64, backing: Backing },
    #[error(
        "guest memory {} is larger than this host's {} allows: {}",
        ByteSize(*.size),
        ByteSize(*.host),
        if *.sparse {
            "a memfd guest may be up to 64 times host RAM (untouched RAM costs nothing, but \
             a Linux guest's page array alone takes 1/64 of its RAM)"
        } else {
            "huge-page backed and prefaulted guests use all of their RAM"
        }
    )]
    TooLargeForHost {
        size: u64,
        host: u64,
        /// Whether the limit was the sparse memfd's ([`SPARSE_RAM_PER_HOST_RAM`] times
        /// host RAM) rather than host RAM itself.
        sparse: bool,
    },
    #[error("no guest RAM regions were given")]
    NoRegions,
    #[error(
        "guest RAM region {index} (guest {:#x}, {}, memfd offset {:#x}) is invalid: {reason}",
        .region.guest_addr, ByteSize(.region.size), .region.file_offset
    )]
    InvalidRegion {
        index: usize,
        region: RamRegion,
        reason: String,
    },
    #[error("guest RAM regions add up to {} but guest memory size is {}", ByteSize(*.regions), ByteSize(*.size))]
    RegionSizeMismatch { regions: u64, size: u64 },
    #[error("this host has no {} huge pages ({} is missing)", ByteSize(.backing.page_size()), .path.display())]
    HugePageSizeUnsupported { backing: Backing, path: PathBuf },
    #[error("cannot read the huge page pool from {}: {source}", .path.display())]
    HugePoolRead { path: PathBuf, source: io::Error },
    #[error(
        "{backing} backing needs {needed} huge pages of {} for {} of guest memory, but only {available} \
         are free (the pool has {pool}); reserve more with `{hint}`",
        ByteSize(.backing.page_size()), ByteSize(*.size)
    )]
    NotEnoughHugePages {
        backing: Backing,
        size: u64,
        needed: u64,
        available: u64,
        pool: u64,
        hint: String,
    },
    #[error("cannot create the guest RAM memfd ({backing}): {source}")]
    MemfdCreate { backing: Backing, source: io::Error },
    #[error("cannot size the guest RAM memfd to {}: {source}", ByteSize(*.size))]
    MemfdResize { size: u64, source: io::Error },
    #[error("the guest RAM file handed over {reason}")]
    HandedOver { reason: String },
    #[error("cannot map guest RAM region {index}: {source}")]
    Map {
        index: usize,
        source: MmapRegionError,
    },
    #[error("cannot assemble guest memory: {0}")]
    GuestMemory(#[from] GuestRegionCollectionError),
    #[error("mincore on guest RAM failed: {0}")]
    Mincore(io::Error),
    #[error(
        "invalid KVM memory slot size {} ({bytes} bytes): it must be a non-zero multiple of {} and at most {}",
        ByteSize(*.bytes), ByteSize(SLOT_SLICE_GRANULE), ByteSize(MAX_SLOT_BYTES)
    )]
    InvalidSlotSlice { bytes: u64 },
}

/// How much guest RAM to create and what backs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestRamConfig {
    /// Total guest RAM in bytes (the sum of the region sizes).
    pub size: u64,
    pub backing: Backing,
    /// Ask for transparent huge pages (`MADV_HUGEPAGE`) on memfd mappings. Ignored for
    /// hugetlb; harmless where the host's shmem THP policy is `never`.
    pub thp: bool,
}

impl GuestRamConfig {
    /// A memfd-backed configuration with THP requested.
    pub fn new(size: u64) -> Self {
        GuestRamConfig {
            size,
            backing: Backing::Memfd,
            thp: true,
        }
    }
}

/// All guest RAM: one memfd, mapped once per region into this process.
pub struct GuestRam {
    memfd: Arc<File>,
    memory: GuestMemoryMmap,
    regions: Vec<RamRegion>,
    /// Host address of each region's mapping, in `regions` order (kept as integers so
    /// `GuestRam` stays `Send + Sync`; the mappings live as long as `memory`).
    host_addrs: Vec<usize>,
    backing: Backing,
    /// Whether `memfd` is a file on a private huge-page tmpfs instead of a memfd.
    huge_tmpfs: bool,
    size: u64,
    /// For a [`GuestRam::view`]: the RAM whose mapping it is, kept mapped while it lives.
    _parent: Option<GuestMemoryMmap>,
}

impl fmt::Debug for GuestRam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestRam")
            .field("backing", &self.backing)
            .field("huge_tmpfs", &self.huge_tmpfs)
            .field("size", &self.size)
            .field("regions", &self.regions)
            .finish_non_exhaustive()
    }
}

impl GuestRam {
    /// Creates the memfd and maps every region of `regions` (the guest-physical layout,
    /// sorted by address, with file offsets packed contiguously from 0).
    pub fn create(config: &GuestRamConfig, regions: &[RamRegion]) -> Result<GuestRam, RamError> {
        Self::create_with(config, regions, None, 0, FileState::New)
    }

    /// An empty memfd of `backing`'s kind, for [`GuestRam::create_in`] later: a process
    /// whose seccomp filter forbids memfd_create (gpuvm's VMM thread, once the VM runs)
    /// makes the memfds of hot-pluggable RAM ahead of time.
    pub fn spare_memfd(backing: Backing) -> Result<File, RamError> {
        create_memfd(backing)
    }

    /// As [`GuestRam::create`], in `memfd` (empty, from [`GuestRam::spare_memfd`] with the
    /// same backing) instead of a new one: memory hot-plug's further RAM.
    pub fn create_in(
        memfd: File,
        config: &GuestRamConfig,
        regions: &[RamRegion],
    ) -> Result<GuestRam, RamError> {
        Self::create_with(config, regions, Some(memfd), 0, FileState::New)
    }

    /// Guest RAM over `memfd`, a file that already holds a running guest's pages (a live
    /// update hands the old process's over): mapped, nothing copied, truncated or touched.
    /// The file holds boot RAM (`config.size` bytes) and then `room` bytes of room for
    /// hot-plugged RAM (made again over the same bytes by [`GuestRam::hotplug_area`]).
    /// `huge_tmpfs` says whether it is a file on gpuvm's private huge-page tmpfs. Hugetlb
    /// RAM must be a hugetlbfs file of the backing's page size; the pool is not checked:
    /// the pages are the guest's already, and mapping the file again takes none (a shared
    /// mapping's reservations belong to the file, which the old process reserved whole).
    pub fn adopt(
        memfd: File,
        config: &GuestRamConfig,
        regions: &[RamRegion],
        huge_tmpfs: bool,
        room: u64,
    ) -> Result<GuestRam, RamError> {
        check_handed_over_file(&memfd, config.backing, config.size.saturating_add(room))?;
        Self::create_with(
            config,
            regions,
            Some(memfd),
            0,
            FileState::HandedOver { huge_tmpfs },
        )
    }

    /// As [`GuestRam::create`], with `room` bytes more in its file for RAM hot-plugged later
    /// ([`GuestRam::hotplug_area`]): the private huge-page tmpfs is sized for both.
    pub fn create_with_hotplug_room(
        config: &GuestRamConfig,
        regions: &[RamRegion],
        room: u64,
    ) -> Result<GuestRam, RamError> {
        Self::create_with(config, regions, None, room, FileState::New)
    }

    /// The room for RAM hot-plugged later: `size` bytes at `guest_addr`, in this RAM's own
    /// file right after it (so every consumer that shares guest RAM by its file, a
    /// snapshot, vfio-user, a live update, sees one file), mapped whole and reserving
    /// nothing: hugetlb pages are checked per range by [`GuestRam::view`] when a range is
    /// plugged. Device emulation gets this mapping with boot RAM from the start, so RAM
    /// plugged later is already in every device's memory map; KVM and the IOMMU get only
    /// the plugged views. Made from RAM created with room for it
    /// ([`GuestRam::create_with_hotplug_room`]) when that RAM is on the huge-page tmpfs.
    pub fn hotplug_area(&self, guest_addr: u64, size: u64) -> Result<GuestRam, RamError> {
        let page_size = self.page_size();
        let file_offset = self
            .regions
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0);
        let region = RamRegion {
            guest_addr,
            size,
            file_offset,
        };
        if size == 0 || !size.is_multiple_of(page_size) || !guest_addr.is_multiple_of(page_size) {
            return Err(RamError::InvalidRegion {
                index: 0,
                region,
                reason: format!(
                    "its address and size must be non-zero multiples of the {} page size",
                    ByteSize(page_size)
                ),
            });
        }
        if let Some(ram) = self
            .regions
            .iter()
            .find(|r| r.guest_addr < guest_addr.saturating_add(size) && guest_addr < r.end())
        {
            return Err(RamError::InvalidRegion {
                index: 0,
                region,
                reason: format!("it overlaps RAM at {:#x}..{:#x}", ram.guest_addr, ram.end()),
            });
        }
        // Sparse whatever the backing: nothing of it is allocated until plugged and used.
        check_fits_host(file_offset + size, true)?;
        self.memfd
            .set_len(file_offset + size)
            .map_err(|source| RamError::MemfdResize {
                size: file_offset + size,
                source,
            })?;
        let mapping = map_region_unreserved(&self.memfd, &region, self.backing)
            .map_err(|source| RamError::Map { index: 0, source })?;
        let host_addr = mapping.as_ptr();
        advise(
            host_addr,
            mapping.size(),
            libc::MADV_DONTDUMP,
            "MADV_DONTDUMP",
        );
        if !self.backing.is_hugetlb() {
            advise(
                host_addr,
                mapping.size(),
                libc::MADV_HUGEPAGE,
                "MADV_HUGEPAGE",
            );
        }
        let area = self.in_same_file(mapping, region, None)?;
        info!(
            "room for hot-plugged RAM: {} at {guest_addr:#x}, in guest RAM's file at {:#x}, \
             nothing allocated until plugged",
            ByteSize(size),
            file_offset
        );
        Ok(area)
    }

    /// RAM of `mapping`, the one region `region` of this RAM's file (the hot-plug area, or
    /// a view kept alive by `parent`).
    fn in_same_file(
        &self,
        mapping: MmapRegion,
        region: RamRegion,
        parent: Option<GuestMemoryMmap>,
    ) -> Result<GuestRam, RamError> {
        let host_addr = mapping.as_ptr() as usize;
        let guest_region = GuestRegionMmap::new(mapping, GuestAddress(region.guest_addr))
            .ok_or_else(|| RamError::InvalidRegion {
                index: 0,
                region,
                reason: "it wraps around the address space".to_string(),
            })?;
        Ok(GuestRam {
            memfd: Arc::clone(&self.memfd),
            memory: GuestMemoryMmap::from_regions(vec![guest_region])?,
            regions: vec![region],
            host_addrs: vec![host_addr],
            backing: self.backing,
            huge_tmpfs: self.huge_tmpfs,
            size: region.size,
            _parent: parent,
        })
    }

    /// Whether `other` is RAM in this RAM's file (its hot-plug area or a view of it).
    pub fn shares_file_with(&self, other: &GuestRam) -> bool {
        Arc::ptr_eq(&self.memfd, &other.memfd)
    }

    /// `[guest_addr, guest_addr + size)` of this RAM as RAM of its own: one hot-plugged
    /// range of a [`GuestRam::hotplug_area`], for KVM's slot and the IOMMU.
    /// It is the area's own mapping (same host addresses, one VMA for KVM, devices and a
    /// lazy restore's userfaultfd alike), kept alive by the view. With hugetlb the pool is
    /// checked for the range first, so a short pool is an error here rather than a SIGBUS
    /// in the guest later (the area reserves nothing).
    pub fn view(&self, guest_addr: u64, size: u64) -> Result<GuestRam, RamError> {
        self.view_of(guest_addr, size, FileState::New)
    }

    /// As [`GuestRam::view`], for a range whose pages the guest holds already (hot-plugged
    /// RAM a live update handed over): the hugetlb pool is not checked, it would count
    /// them as missing.
    pub fn held_view(&self, guest_addr: u64, size: u64) -> Result<GuestRam, RamError> {
        self.view_of(
            guest_addr,
            size,
            FileState::HandedOver {
                huge_tmpfs: self.huge_tmpfs,
            },
        )
    }

    fn view_of(&self, guest_addr: u64, size: u64, state: FileState) -> Result<GuestRam, RamError> {
        let page_size = self.page_size();
        let outside = |reason: String| RamError::InvalidRegion {
            index: 0,
            region: RamRegion {
                guest_addr,
                size,
                file_offset: 0,
            },
            reason,
        };
        if size == 0 || !guest_addr.is_multiple_of(page_size) || !size.is_multiple_of(page_size) {
            return Err(outside(format!(
                "its address and size must be non-zero multiples of the {} page size",
                ByteSize(page_size)
            )));
        }
        let within = self.host_regions().find(|(region, _)| {
            guest_addr >= region.guest_addr
                && guest_addr
                    .checked_add(size)
                    .is_some_and(|end| end <= region.end())
        });
        let Some((outer, outer_host)) = within else {
            return Err(outside(
                "it is not inside one region of this RAM".to_string(),
            ));
        };
        let offset = guest_addr - outer.guest_addr;
        let region = RamRegion {
            guest_addr,
            size,
            file_offset: outer.file_offset + offset,
        };
        if self.backing.is_hugetlb() && state == FileState::New {
            check_hugetlb_pool(self.backing, size)?;
        }
        let host_addr = outer_host.wrapping_add(offset as usize);
        let len = usize::try_from(size).map_err(|_| outside("it is too large".to_string()))?;
        // SAFETY: [host_addr, host_addr + len) lies inside this RAM's mapping of `outer`
        // (checked above), which the view keeps alive (`_parent`) and does not unmap.
        let mapping = unsafe {
            MmapRegionBuilder::new(len)
                .with_raw_mmap_pointer(host_addr)
                .with_file_offset(FileOffset::from_arc(
                    Arc::clone(&self.memfd),
                    region.file_offset,
                ))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED)
                .with_hugetlbfs(self.backing.is_hugetlb())
                .build()
        }
        .map_err(|source| RamError::Map { index: 0, source })?;
        self.in_same_file(mapping, region, Some(self.memory.clone()))
    }

    /// This RAM's memory with `other`'s regions added (boot RAM and the hot-plug area:
    /// what device emulation reads and writes). The regions are shared, not mapped again.
    pub fn memory_with(&self, other: &GuestRam) -> Result<GuestMemoryMmap, RamError> {
        let mut memory = self.memory.clone();
        for region in &other.regions {
            let (_, shared) = other
                .memory
                .remove_region(GuestAddress(region.guest_addr), region.size)?;
            memory = memory.insert_region(shared)?;
        }
        Ok(memory)
    }

    fn create_with(
        config: &GuestRamConfig,
        regions: &[RamRegion],
        memfd: Option<File>,
        room: u64,
        state: FileState,
    ) -> Result<GuestRam, RamError> {
        let backing = config.backing;
        let page_size = backing.page_size();
        let size = config.size;

        if size == 0 {
            return Err(RamError::ZeroSize);
        }
        if !size.is_multiple_of(page_size) {
            return Err(RamError::SizeNotPageMultiple { size, backing });
        }
        // What this host can back first: a size past it says so, whatever else is wrong.
        check_fits_host(size, !backing.is_hugetlb())?;
        validate_regions(regions, size, page_size)?;
        // A handed-over file's pages are the guest's already: the pool would count them
        // as missing.
        if backing.is_hugetlb() && state == FileState::New {
            check_hugetlb_pool(backing, size)?;
        }

        // A handed-over file is on the private tmpfs if the old process made it there.
        let mut huge_tmpfs = matches!(state, FileState::HandedOver { huge_tmpfs: true });
        let memfd = Arc::new(match memfd {
            Some(memfd) => memfd,
            None if backing == Backing::Memfd && config.thp => {
                match crate::huge_tmpfs::create_file(size + room) {
                    Ok(file) => {
                        huge_tmpfs = true;
                        file
                    }
                    Err(why) => {
                        note_memfd_fallback(&why);
                        create_memfd(backing)?
                    }
                }
            }
            None => create_memfd(backing)?,
        });
        // A handed-over file is sized already, and may hold hot-plugged RAM after boot
        // RAM, which setting its length to boot RAM's would throw away.
        if state == FileState::New {
            memfd
                .set_len(size)
                .map_err(|source| RamError::MemfdResize { size, source })?;
        }

        let mut mapped = Vec::with_capacity(regions.len());
        let mut host_addrs = Vec::with_capacity(regions.len());
        for (index, region) in regions.iter().enumerate() {
            let mapping = map_region(&memfd, region, backing)
                .map_err(|source| RamError::Map { index, source })?;
            let host_addr = mapping.as_ptr();
            // The madvise hints are best effort: guest RAM works without them.
            advise(
                host_addr,
                mapping.size(),
                libc::MADV_DONTDUMP,
                "MADV_DONTDUMP",
            );
            if config.thp && !backing.is_hugetlb() {
                // On the huge tmpfs this is what makes pages huge; its first MiBs stay
                // small (huge_tmpfs::SMALL_PAGE_PREFIX says why).
                let small = if huge_tmpfs {
                    crate::huge_tmpfs::SMALL_PAGE_PREFIX
                        .saturating_sub(region.file_offset)
                        .min(region.size) as usize
                } else {
                    0
                };
                if small < mapping.size() {
                    advise(
                        host_addr.wrapping_add(small),
                        mapping.size() - small,
                        libc::MADV_HUGEPAGE,
                        "MADV_HUGEPAGE",
                    );
                }
            }
            debug!(
                "guest RAM region {index}: guest {:#x}..{:#x} ({}), memfd offset {:#x}, host {host_addr:p}",
                region.guest_addr,
                region.end(),
                ByteSize(region.size),
                region.file_offset,
            );
            host_addrs.push(host_addr as usize);
            // Cannot fail: validate_regions() ruled out address wrap-around.
            let guest_region = GuestRegionMmap::new(mapping, GuestAddress(region.guest_addr))
                .ok_or_else(|| RamError::InvalidRegion {
                    index,
                    region: *region,
                    reason: "it wraps around the address space".to_string(),
                })?;
            mapped.push(guest_region);
        }
        let memory = GuestMemoryMmap::from_regions(mapped)?;
        info!(
            "guest RAM: {} {} ({}), {} region(s), all in it",
            ByteSize(size),
            if huge_tmpfs {
                "shmem on a private huge-page tmpfs".to_string()
            } else {
                backing.to_string()
            },
            if huge_tmpfs {
                format!(
                    "2 MiB pages, 4 KiB in the first {}",
                    ByteSize(crate::huge_tmpfs::SMALL_PAGE_PREFIX)
                )
            } else if config.thp && !backing.is_hugetlb() {
                format!("{} pages, THP requested", ByteSize(page_size))
            } else {
                format!("{} pages", ByteSize(page_size))
            },
            regions.len()
        );

        Ok(GuestRam {
            memfd,
            memory,
            regions: regions.to_vec(),
            host_addrs,
            backing,
            huge_tmpfs,
            size,
            _parent: None,
        })
    }

    /// Whether guest RAM is a file on gpuvm's private `huge=advise` tmpfs (see
    /// [`crate::huge_tmpfs`]) rather than a memfd: shmem either way, but with transparent
    /// huge pages whatever the host's shmem THP policy.
    pub fn huge_tmpfs(&self) -> bool {
        self.huge_tmpfs
    }

    /// Guest memory for device emulation and loaders (file-backed, `MAP_SHARED`).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// The guest-physical layout, in address order.
    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// The memfd holding all guest RAM (to share with other processes or snapshot).
    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// The backing page size: 4 KiB, 2 MiB or 1 GiB.
    pub fn page_size(&self) -> u64 {
        self.backing.page_size()
    }

    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Total guest RAM in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Host address where region `index` is mapped, or `None` past the last region.
    /// Valid for as long as this `GuestRam` lives.
    pub fn host_address(&self, index: usize) -> Option<*mut u8> {
        self.host_addrs.get(index).map(|&addr| addr as *mut u8)
    }

    /// Every region with the host address of its mapping (for KVM memslots and uffd).
    pub fn host_regions(&self) -> impl Iterator<Item = (RamRegion, *mut u8)> + '_ {
        self.regions
            .iter()
            .zip(&self.host_addrs)
            .map(|(region, &addr)| (*region, addr as *mut u8))
    }

    /// Bytes of guest RAM that are resident now (allocated in the memfd and visible
    /// through our mappings), measured with mincore().
    pub fn resident_bytes(&self) -> Result<u64, RamError> {
        let base_page = host_base_page_size();
        let mut resident = 0u64;
        let mut vec = Vec::new();
        for (region, addr) in self.host_regions() {
            let len = region.size as usize;
            let mut done = 0;
            while done < len {
                let chunk = (len - done).min(MINCORE_CHUNK);
                vec.resize(chunk.div_ceil(base_page), 0u8);
                // SAFETY: [addr + done, +chunk) lies inside one of our live mappings and
                // `vec` has one byte per base page of that range, as mincore requires.
                let ret = unsafe {
                    libc::mincore(
                        addr.add(done).cast::<libc::c_void>(),
                        chunk,
                        vec.as_mut_ptr(),
                    )
                };
                if ret != 0 {
                    return Err(RamError::Mincore(io::Error::last_os_error()));
                }
                let pages = vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
                resident += pages * base_page as u64;
                done += chunk;
            }
        }
        Ok(resident)
    }
}

/// How many times host RAM a sparse (memfd, not prefaulted) guest may have: pages the
/// guest never touches cost nothing, but a Linux guest touches 64 bytes of `struct page`
/// per 4 KiB page at boot, so a guest beyond 64 times host RAM could not even boot.
pub const SPARSE_RAM_PER_HOST_RAM: u64 = 64;

/// Refuses `size` bytes of guest RAM this host cannot hold: more than host RAM where all
/// of it gets populated (huge pages, prefault), more than [`SPARSE_RAM_PER_HOST_RAM`]
/// times host RAM where only touched pages cost (`sparse`).
pub fn check_fits_host(size: u64, sparse: bool) -> Result<(), RamError> {
    let host = host_memory_total();
    if host == 0 {
        warn!("cannot determine host memory size; not checking guest memory against it");
        return Ok(());
    }
    let limit = if sparse {
        host.saturating_mul(SPARSE_RAM_PER_HOST_RAM)
    } else {
        host
    };
    if size > limit {
        return Err(RamError::TooLargeForHost { size, host, sparse });
    }
    if size > host {
        info!(
            "guest memory {} is larger than this host's {}: only the pages the guest touches \
             are allocated",
            ByteSize(size),
            ByteSize(host)
        );
    }
    Ok(())
}

/// Total host RAM in bytes (`MemTotal` in /proc/meminfo, else sysinfo(2); 0 if neither
/// can be read).
pub fn host_memory_total() -> u64 {
    if let Some(total) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| parse_meminfo_total(&text))
    {
        return total;
    }
    // SAFETY: sysinfo only writes into the zero-initialised struct we pass.
    unsafe {
        let mut info: libc::sysinfo = std::mem::zeroed();
        if libc::sysinfo(&mut info) == 0 {
            return (info.totalram as u64).saturating_mul(u64::from(info.mem_unit.max(1)));
        }
    }
    0
}

fn parse_meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut fields = line["MemTotal:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => value.checked_mul(KIB),
        None => Some(value),
        Some(_) => None,
    }
}

/// The kernel's base page size (the granularity of mincore and of MADV_POPULATE).
pub(crate) fn host_base_page_size() -> usize {
    // SAFETY: sysconf has no side effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        BASE_PAGE_SIZE as usize
    }
}

/// The most one KVM memory slot maps on x86-64 (KVM_MEM_MAX_NR_PAGES, 2^31 - 1 pages of
/// 4 KiB: 8 TiB less a page). A RAM region larger than a slot is registered as several
/// ([`slot_slices`]).
pub const MAX_SLOT_BYTES: u64 = ((1 << 31) - 1) * 4096;

/// Slice sizes are multiples of this, and so are the offsets of the cuts in a region: a
/// slice's dirty log (one bit per 4 KiB page, in u64 words) is then a whole number of
/// words (512 pages, 8 words), so a region's log is its slices' logs joined, and no 2 MiB
/// huge page straddles two slots.
pub const SLOT_SLICE_GRANULE: u64 = 2 * MIB;

/// How large the KVM memory slots of one RAM region may be: a region up to this size is
/// one slot, a larger one is cut into slots of this size (the last holds the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSliceSize(u64);

impl SlotSliceSize {
    /// The largest multiple of 1 GiB one slot holds (8 TiB - 1 GiB). A multiple of 1 GiB
    /// keeps every 1 GiB huge page in one slot; the largest one keeps the slot count low
    /// (33 for the 256 TiB a 48-bit guest addresses, against 64 with 4 TiB slices) and every
    /// region that fits it in one slot, as it always was.
    pub const KVM: SlotSliceSize = SlotSliceSize(MAX_SLOT_BYTES / GIB * GIB);

    /// A slice size of `bytes`: a non-zero multiple of [`SLOT_SLICE_GRANULE`] that one slot
    /// holds.
    pub fn new(bytes: u64) -> Result<SlotSliceSize, RamError> {
        if bytes == 0 || !bytes.is_multiple_of(SLOT_SLICE_GRANULE) || bytes > MAX_SLOT_BYTES {
            return Err(RamError::InvalidSlotSlice { bytes });
        }
        Ok(SlotSliceSize(bytes))
    }

    pub const fn bytes(self) -> u64 {
        self.0
    }

    /// How many slots `regions` take.
    pub fn slot_count(self, regions: &[RamRegion]) -> u64 {
        regions.iter().map(|r| r.size.div_ceil(self.0)).sum()
    }
}

/// One KVM memory slot's part of a RAM region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSlice {
    /// Index of its region in the layout.
    pub region: usize,
    /// Guest-physical start address.
    pub guest_addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// Offset of its first byte from its region's start (in the region's host mapping and in
    /// the RAM file alike).
    pub region_offset: u64,
}

/// The KVM memory slots of `regions`, in order: each region whole when it fits `slice`,
/// else cut every `slice` bytes from its start. Every slot but a region's last is a
/// multiple of [`SLOT_SLICE_GRANULE`] long, so the slots' dirty logs join into the region's.
pub fn slot_slices(regions: &[RamRegion], slice: SlotSliceSize) -> Vec<SlotSlice> {
    let mut slices = Vec::new();
    for (index, region) in regions.iter().enumerate() {
        let mut region_offset = 0;
        while region_offset < region.size {
            let size = (region.size - region_offset).min(slice.0);
            slices.push(SlotSlice {
                region: index,
                guest_addr: region.guest_addr + region_offset,
                size,
                region_offset,
            });
            region_offset += size;
        }
    }
    slices
}

fn validate_regions(regions: &[RamRegion], size: u64, page_size: u64) -> Result<(), RamError> {
    if regions.is_empty() {
        return Err(RamError::NoRegions);
    }
    let invalid = |index: usize, reason: String| RamError::InvalidRegion {
        index,
        region: regions[index],
        reason,
    };
    let page = ByteSize(page_size);
    let mut expected_offset = 0u64;
    let mut previous_end = 0u64;
    for (index, region) in regions.iter().enumerate() {
        if region.size == 0 {
            return Err(invalid(index, "it is empty".to_string()));
        }
        if region.guest_addr % page_size != 0 || region.size % page_size != 0 {
            return Err(invalid(
                index,
                format!("its address and size must be multiples of the {page} page size"),
            ));
        }
        let Some(end) = region.guest_addr.checked_add(region.size) else {
            return Err(invalid(
                index,
                "it wraps around the address space".to_string(),
            ));
        };
        if index > 0 && region.guest_addr < previous_end {
            return Err(invalid(
                index,
                format!("it starts below the end of region {} ({previous_end:#x}): regions must be sorted and disjoint", index - 1),
            ));
        }
        if region.file_offset != expected_offset {
            return Err(invalid(
                index,
                format!("its memfd offset should be {expected_offset:#x} (regions are packed contiguously in the memfd)"),
            ));
        }
        previous_end = end;
        expected_offset = expected_offset.saturating_add(region.size);
    }
    if expected_offset != size {
        return Err(RamError::RegionSizeMismatch {
            regions: expected_offset,
            size,
        });
    }
    Ok(())
}

fn read_pool_counter(dir: &Path, name: &str) -> Result<u64, RamError> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).map_err(|source| RamError::HugePoolRead {
        path: path.clone(),
        source,
    })?;
    text.trim().parse().map_err(|_| RamError::HugePoolRead {
        path,
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a number: {text:?}"),
        ),
    })
}

/// Fails unless the hugetlb pool has `size` bytes of pages free and unreserved.
fn check_hugetlb_pool(backing: Backing, size: u64) -> Result<(), RamError> {
    let dir = backing.hugetlb_pool_dir();
    if !dir.is_dir() {
        return Err(RamError::HugePageSizeUnsupported { backing, path: dir });
    }
    let pool = read_pool_counter(&dir, "nr_hugepages")?;
    let free = read_pool_counter(&dir, "free_hugepages")?;
    // Reserved pages are free but already promised to other mappings.
    let reserved = read_pool_counter(&dir, "resv_hugepages")?;
    let available = free.saturating_sub(reserved);
    let needed = size / backing.page_size();
    debug!("{backing} pool: {pool} pages, {free} free, {reserved} reserved; need {needed}");
    if available < needed {
        return Err(RamError::NotEnoughHugePages {
            backing,
            size,
            needed,
            available,
            pool,
            hint: backing.reserve_hint(pool + (needed - available)),
        });
    }
    Ok(())
}

/// The one line saying guest RAM fell back to a memfd and what that costs: a warning
/// where the host's shmem THP policy then gives 4 KiB pages, a note where it does not.
fn note_memfd_fallback(why: &crate::huge_tmpfs::HugeTmpfsError) {
    const PATH: &str = crate::huge_tmpfs::SHMEM_ENABLED;
    let policy = std::fs::read_to_string(PATH).unwrap_or_default();
    let small_pages = policy.contains("[never]") || policy.contains("[deny]");
    if small_pages {
        warn!(
            "guest RAM: no private huge-page tmpfs ({why}); a plain memfd with 4 KiB pages \
             instead ({PATH} is {})",
            policy.trim()
        );
    } else {
        info!(
            "guest RAM: no private huge-page tmpfs ({why}); a plain memfd with the host's \
             shmem THP policy ({})",
            if policy.is_empty() {
                "unknown"
            } else {
                policy.trim()
            }
        );
    }
}

/// Whether guest RAM's file is new (sized and, for hugetlb, checked against the pool
/// here) or handed over with the guest's pages in it (taken as it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileState {
    New,
    /// A file that holds a running guest's pages already; `huge_tmpfs`: on gpuvm's private
    /// huge-page tmpfs.
    HandedOver {
        huge_tmpfs: bool,
    },
}

/// hugetlbfs's `f_type` (linux/magic.h); memfds made with MFD_HUGETLB are on it.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Checks that `file`, handed over as guest RAM of `backing`, is `len` bytes long and of
/// that kind: a hugetlbfs file of its page size for hugetlb, anything else for shmem
/// (memfd or the private tmpfs). A mismatch would map the wrong pages, or fail with
/// SIGBUS in the guest.
fn check_handed_over_file(file: &File, backing: Backing, len: u64) -> Result<(), RamError> {
    use std::os::fd::AsRawFd;
    let refuse = |reason: String| RamError::HandedOver { reason };
    let found = file
        .metadata()
        .map_err(|e| refuse(format!("cannot be read: {e}")))?
        .len();
    if found != len {
        return Err(refuse(format!(
            "is {found} bytes; the VM's RAM (and room for hot-plugged RAM) is {len}"
        )));
    }
    // SAFETY: fstatfs writes one statfs into `stat`, a zeroed local; the descriptor is
    // `file`'s, live for the call.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut stat) } != 0 {
        return Err(refuse(format!(
            "cannot be examined (fstatfs): {}",
            io::Error::last_os_error()
        )));
    }
    #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every libc
    let hugetlbfs = stat.f_type as i64 == HUGETLBFS_MAGIC;
    let page = stat.f_bsize as u64;
    match (backing.is_hugetlb(), hugetlbfs) {
        (true, true) if page == backing.page_size() => Ok(()),
        (true, true) => Err(refuse(format!(
            "has {} huge pages; the VM's RAM is {backing}",
            ByteSize(page)
        ))),
        (true, false) => Err(refuse(format!(
            "is not on hugetlbfs; the VM's RAM is {backing}"
        ))),
        (false, true) => Err(refuse(format!(
            "is a hugetlbfs file; the VM's RAM is {backing}"
        ))),
        (false, false) => Ok(()),
    }
}

fn create_memfd(backing: Backing) -> Result<File, RamError> {
    const NAME: &CStr = c"gpuvm-guest-ram";
    // SAFETY: NAME is a valid NUL-terminated string; the flags are plain integers.
    let fd = unsafe { libc::memfd_create(NAME.as_ptr(), backing.memfd_flags()) };
    if fd < 0 {
        return Err(RamError::MemfdCreate {
            backing,
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: fd is a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// As [`map_region`], never reserving hugetlb pages (MAP_NORESERVE).
fn map_region_unreserved(
    memfd: &Arc<File>,
    region: &RamRegion,
    backing: Backing,
) -> Result<MmapRegion, MmapRegionError> {
    let len = usize::try_from(region.size).map_err(|_| MmapRegionError::InvalidOffsetLength)?;
    MmapRegionBuilder::new(len)
        .with_file_offset(FileOffset::from_arc(Arc::clone(memfd), region.file_offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .with_hugetlbfs(backing.is_hugetlb())
        .build()
}

fn map_region(
    memfd: &Arc<File>,
    region: &RamRegion,
    backing: Backing,
) -> Result<MmapRegion, MmapRegionError> {
    let len = usize::try_from(region.size).map_err(|_| MmapRegionError::InvalidOffsetLength)?;
    // hugetlb pages are reserved at mmap time so a shortage fails here rather than as
    // SIGBUS later; shmem is allocated lazily either way.
    let flags = if backing.is_hugetlb() {
        libc::MAP_SHARED
    } else {
        libc::MAP_SHARED | libc::MAP_NORESERVE
    };
    MmapRegionBuilder::new(len)
        .with_file_offset(FileOffset::from_arc(Arc::clone(memfd), region.file_offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(flags)
        .with_hugetlbfs(backing.is_hugetlb())
        .build()
}

fn advise(addr: *mut u8, len: usize, advice: libc::c_int, name: &str) {
    // SAFETY: [addr, addr + len) is a mapping we just created; these advices only change
    // how the kernel treats it, not its contents.
    let ret = unsafe { libc::madvise(addr.cast::<libc::c_void>(), len, advice) };
    if ret != 0 {
        debug!(
            "{name} on guest RAM at {addr:p} failed: {}",
            io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::sync::Mutex;
    use vm_memory::{Bytes, GuestMemoryBackend};

    /// Serialises tests that read or change the hugetlb pool.
    pub(crate) static HUGETLB_POOL: Mutex<()> = Mutex::new(());

    /// Two regions with a hole between them, packed contiguously in the memfd.
    pub(crate) fn two_regions(first: u64, hole: u64, second: u64) -> Vec<RamRegion> {
        vec![
            RamRegion {
                guest_addr: 0,
                size: first,
                file_offset: 0,
            },
            RamRegion {
                guest_addr: first + hole,
                size: second,
                file_offset: first,
            },
        ]
    }

    fn one_region(size: u64) -> Vec<RamRegion> {
        vec![RamRegion {
            guest_addr: 0,
            size,
            file_offset: 0,
        }]
    }

    #[test]
    fn guest_ram_can_be_shared_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<GuestRam>();
    }

    #[test]
    fn backing_parses_and_prints() {
        for backing in [Backing::Memfd, Backing::Hugetlb2M, Backing::Hugetlb1G] {
            assert_eq!(backing.to_string().parse::<Backing>().unwrap(), backing);
        }
        assert_eq!(Backing::Memfd.page_size(), 4096);
        assert_eq!(Backing::Hugetlb2M.page_size(), 2 << 20);
        assert_eq!(Backing::Hugetlb1G.page_size(), 1 << 30);
        let err = "hugetlb".parse::<Backing>().unwrap_err();
        assert!(err.to_string().contains("'hugetlb'"), "{err}");
    }

    #[test]
    fn byte_sizes_read_naturally() {
        assert_eq!(ByteSize(64 * GIB).to_string(), "64 GiB");
        assert_eq!(ByteSize(2 * MIB).to_string(), "2 MiB");
        assert_eq!(ByteSize(GIB + GIB / 2).to_string(), "1.5 GiB");
        assert_eq!(ByteSize(100).to_string(), "100 bytes");
    }

    #[test]
    fn meminfo_total_is_parsed() {
        let text = "MemFree:  10 kB\nMemTotal:       24576000 kB\n";
        assert_eq!(parse_meminfo_total(text), Some(24576000 * 1024));
        assert_eq!(parse_meminfo_total("MemTotal: x kB"), None);
        assert!(host_memory_total() > 0);
    }

    #[test]
    fn memfd_ram_is_shared_with_the_memfd() {
        let regions = two_regions(8 * MIB, 8 * MIB, 4 * MIB);
        let ram = GuestRam::create(&GuestRamConfig::new(12 * MIB), &regions).unwrap();
        assert_eq!(ram.size(), 12 * MIB);
        assert_eq!(ram.page_size(), 4096);
        assert_eq!(ram.backing(), Backing::Memfd);
        assert_eq!(ram.regions(), &regions[..]);
        assert_eq!(ram.memfd().metadata().unwrap().len(), 12 * MIB);
        assert_eq!(ram.memory().num_regions(), 2);

        // Write through guest memory in both regions, read back through the memfd.
        let second = regions[1];
        ram.memory()
            .write_slice(b"first", GuestAddress(0x1234))
            .unwrap();
        ram.memory()
            .write_slice(b"second", GuestAddress(second.guest_addr + 0x100))
            .unwrap();
        let mut buf = [0u8; 6];
        ram.memfd().read_exact_at(&mut buf[..5], 0x1234).unwrap();
        assert_eq!(&buf[..5], b"first");
        ram.memfd()
            .read_exact_at(&mut buf, second.file_offset + 0x100)
            .unwrap();
        assert_eq!(&buf, b"second");
        // The hole is not guest memory.
        assert!(ram
            .memory()
            .write_slice(b"x", GuestAddress(9 * MIB))
            .is_err());

        // And the other way: a write to the memfd shows up in guest memory.
        ram.memfd().write_all_at(b"fd", second.file_offset).unwrap();
        let mut two = [0u8; 2];
        ram.memory()
            .read_slice(&mut two, GuestAddress(second.guest_addr))
            .unwrap();
        assert_eq!(&two, b"fd");

        let hosts: Vec<_> = ram.host_regions().collect();
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1].0, second);
        assert_eq!(Some(hosts[1].1), ram.host_address(1));
        assert_eq!(ram.host_address(2), None);
        // SAFETY: the mapping of region 1 is live and at least 2 bytes long.
        let direct = unsafe { std::slice::from_raw_parts(hosts[1].1, 2) };
        assert_eq!(direct, b"fd");
    }

    #[test]
    fn fresh_ram_is_not_resident() {
        let ram = GuestRam::create(&GuestRamConfig::new(4 * MIB), &one_region(4 * MIB)).unwrap();
        assert_eq!(ram.resident_bytes().unwrap(), 0);
        ram.memory()
            .write_slice(&[1], GuestAddress(3 * 4096))
            .unwrap();
        assert_eq!(ram.resident_bytes().unwrap(), 4096);
    }

    #[test]
    fn bad_sizes_are_rejected() {
        let err = GuestRam::create(&GuestRamConfig::new(0), &one_region(0)).unwrap_err();
        assert!(matches!(err, RamError::ZeroSize), "{err}");

        let err =
            GuestRam::create(&GuestRamConfig::new(MIB + 1), &one_region(MIB + 1)).unwrap_err();
        assert!(matches!(err, RamError::SizeNotPageMultiple { .. }), "{err}");
        assert!(err.to_string().contains("4 KiB"), "{err}");

        let config = GuestRamConfig {
            size: 3 * MIB,
            backing: Backing::Hugetlb2M,
            thp: false,
        };
        let err = GuestRam::create(&config, &one_region(3 * MIB)).unwrap_err();
        assert!(err.to_string().contains("2 MiB"), "{err}");

        let host = host_memory_total();
        let too_big = (host * SPARSE_RAM_PER_HOST_RAM / GIB + 1) * GIB;
        let err =
            GuestRam::create(&GuestRamConfig::new(too_big), &one_region(too_big)).unwrap_err();
        assert!(
            matches!(err, RamError::TooLargeForHost { sparse: true, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("larger than this host's"), "{err}");
        // Populated RAM must fit host RAM itself; sparse RAM may be larger.
        let above_host = (host / GIB + 1) * GIB;
        let err = check_fits_host(above_host, false).unwrap_err();
        assert!(
            matches!(err, RamError::TooLargeForHost { sparse: false, .. }),
            "{err}"
        );
        check_fits_host(above_host, true).unwrap();
    }

    #[test]
    fn inconsistent_regions_are_rejected() {
        let config = GuestRamConfig::new(8 * MIB);
        let check = |regions: &[RamRegion], what: &str| {
            let err = GuestRam::create(&config, regions).unwrap_err();
            assert!(err.to_string().contains(what), "{what}: {err}");
        };
        check(&[], "no guest RAM regions");
        check(&two_regions(4 * MIB, 0, 2 * MIB), "add up to 6 MiB");
        let mut r = two_regions(4 * MIB, 0, 4 * MIB);
        r[1].file_offset = 0;
        check(&r, "memfd offset should be 0x400000");
        let mut r = two_regions(4 * MIB, 0, 4 * MIB);
        r[1].guest_addr = MIB;
        check(&r, "sorted and disjoint");
        let mut r = two_regions(4 * MIB, 0, 4 * MIB);
        r[1].guest_addr = u64::MAX - 4095;
        check(&r, "wraps");
        let mut r = two_regions(4 * MIB, 0, 4 * MIB);
        r[1].guest_addr += 512;
        check(&r, "multiples of the 4 KiB page size");
        check(&two_regions(8 * MIB, 0, 0), "empty");
        // A region past KVM's per-slot maximum is fine: it is registered as several slots.
        let huge = (MAX_SLOT_BYTES / MIB + 1) * MIB;
        validate_regions(&one_region(huge), huge, 4096).unwrap();
        validate_regions(&one_region(MAX_SLOT_BYTES), MAX_SLOT_BYTES, 4096).unwrap();
    }

    const TIB: u64 = 1 << 40;

    fn region(guest_addr: u64, size: u64, file_offset: u64) -> RamRegion {
        RamRegion {
            guest_addr,
            size,
            file_offset,
        }
    }

    /// `(guest_addr, size, region_offset)` of each slice of `regions`, and its region.
    fn slices(regions: &[RamRegion], slice: SlotSliceSize) -> Vec<(usize, u64, u64, u64)> {
        let slices = slot_slices(regions, slice);
        assert_eq!(slices.len() as u64, slice.slot_count(regions));
        slices
            .iter()
            .map(|s| (s.region, s.guest_addr, s.size, s.region_offset))
            .collect()
    }

    #[test]
    fn a_region_one_slot_holds_is_one_slice() {
        let kvm = SlotSliceSize::KVM;
        assert_eq!(kvm.bytes(), 8 * TIB - GIB);
        assert!(kvm.bytes() <= MAX_SLOT_BYTES && kvm.bytes().is_multiple_of(GIB));
        let at_limit = [region(4 * GIB, kvm.bytes(), 0)];
        assert_eq!(slices(&at_limit, kvm), [(0, 4 * GIB, kvm.bytes(), 0)]);
        let small = [region(0, 2 * GIB, 0)];
        assert_eq!(slices(&small, kvm), [(0, 0, 2 * GIB, 0)]);
        assert!(slices(&[], kvm).is_empty());
    }

    #[test]
    fn a_region_past_the_slot_limit_is_cut_at_gib_multiples() {
        let kvm = SlotSliceSize::KVM;
        let slice = kvm.bytes();
        // One page over: a second slot of one page.
        let over = [region(4 * GIB, slice + 4096, 0)];
        assert_eq!(
            slices(&over, kvm),
            [(0, 4 * GIB, slice, 0), (0, 4 * GIB + slice, 4096, slice)]
        );
        // KVM's own maximum (8 TiB less a page) no longer fits one slice of 8 TiB - 1 GiB.
        let kvm_max = [region(4 * GIB, MAX_SLOT_BYTES, 0)];
        assert_eq!(slices(&kvm_max, kvm).len(), 2);
        // 20 TiB: two full slices and the rest, every cut 1 GiB aligned.
        let twenty = [region(4 * GIB, 20 * TIB, 0)];
        let cut = slices(&twenty, kvm);
        assert_eq!(
            cut,
            [
                (0, 4 * GIB, slice, 0),
                (0, 4 * GIB + slice, slice, slice),
                (0, 4 * GIB + 2 * slice, 20 * TIB - 2 * slice, 2 * slice),
            ]
        );
        assert!(cut.iter().all(|&(_, addr, _, _)| addr.is_multiple_of(GIB)));
        assert_eq!(cut.iter().map(|c| c.2).sum::<u64>(), 20 * TIB);
    }

    #[test]
    fn slices_of_several_regions_follow_each_other_in_region_order() {
        // An AMD layout of 9 TiB: below the 32-bit hole, up to the HyperTransport range,
        // and past it at 1 TiB (8201 GiB: one slot of 8191 GiB and one of 10 GiB).
        let low = region(0, 3 * GIB, 0);
        let below_ht = region(4 * GIB, 1012 * GIB, 3 * GIB);
        let above_ht = region(TIB, 9 * TIB - 1015 * GIB, 1015 * GIB);
        let kvm = SlotSliceSize::KVM;
        let slice = kvm.bytes();
        let cut = slices(&[low, below_ht, above_ht], kvm);
        assert_eq!(
            cut,
            [
                (0, 0, 3 * GIB, 0),
                (1, 4 * GIB, 1012 * GIB, 0),
                (2, TIB, slice, 0),
                (2, TIB + slice, 10 * GIB, slice),
            ]
        );
        // A test-sized slice cuts every region, the last slice of each holding the rest.
        let gib = SlotSliceSize::new(GIB).unwrap();
        let cut = slices(
            &[region(0, 3 * GIB, 0), region(4 * GIB, 2 * GIB + 2 * MIB, 0)],
            gib,
        );
        assert_eq!(
            cut,
            [
                (0, 0, GIB, 0),
                (0, GIB, GIB, GIB),
                (0, 2 * GIB, GIB, 2 * GIB),
                (1, 4 * GIB, GIB, 0),
                (1, 5 * GIB, GIB, GIB),
                (1, 6 * GIB, 2 * MIB, 2 * GIB),
            ]
        );
    }

    #[test]
    fn a_slice_size_must_be_whole_dirty_log_words_within_one_slot() {
        for bad in [0, 4096, MIB, 3 * MIB, MAX_SLOT_BYTES, 8 * TIB] {
            let err = SlotSliceSize::new(bad).unwrap_err();
            assert!(
                matches!(err, RamError::InvalidSlotSlice { bytes } if bytes == bad),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains("multiple of 2 MiB"), "{err}");
        }
        for good in [2 * MIB, GIB, 8 * TIB - 2 * MIB] {
            assert_eq!(SlotSliceSize::new(good).unwrap().bytes(), good);
        }
        assert_eq!(
            SlotSliceSize::new(SlotSliceSize::KVM.bytes()).unwrap(),
            SlotSliceSize::KVM
        );
    }

    #[test]
    fn short_hugetlb_pool_says_how_to_reserve() {
        let _pool = HUGETLB_POOL.lock().unwrap_or_else(|e| e.into_inner());
        let dir = Backing::Hugetlb2M.hugetlb_pool_dir();
        if !dir.is_dir() {
            eprintln!("skipped: no 2 MiB huge pages on this host");
            return;
        }
        let free = read_pool_counter(&dir, "free_hugepages").unwrap();
        let reserved = read_pool_counter(&dir, "resv_hugepages").unwrap();
        let size = (free.saturating_sub(reserved) + 1) * 2 * MIB;
        if size > host_memory_total() {
            eprintln!("skipped: the free pool is as large as host memory");
            return;
        }
        let config = GuestRamConfig {
            size,
            backing: Backing::Hugetlb2M,
            thp: false,
        };
        let err = GuestRam::create(&config, &one_region(size)).unwrap_err();
        let RamError::NotEnoughHugePages {
            needed, available, ..
        } = &err
        else {
            panic!("unexpected error: {err}");
        };
        assert_eq!(*needed, available + 1);
        assert!(err.to_string().contains("sysctl vm.nr_hugepages="), "{err}");
    }

    /// Restores `vm.nr_hugepages` when dropped, whatever the test did.
    pub(crate) struct NrHugepagesGuard {
        old: u64,
    }

    const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

    impl NrHugepagesGuard {
        /// Grows the default-size pool by `extra` pages; `Err` says why it could not.
        pub(crate) fn reserve(extra: u64) -> Result<Self, String> {
            let old: u64 = std::fs::read_to_string(NR_HUGEPAGES)
                .map_err(|e| format!("cannot read {NR_HUGEPAGES}: {e}"))?
                .trim()
                .parse()
                .map_err(|e| format!("cannot parse {NR_HUGEPAGES}: {e}"))?;
            let guard = NrHugepagesGuard { old };
            std::fs::write(NR_HUGEPAGES, (old + extra).to_string())
                .map_err(|e| format!("cannot write {NR_HUGEPAGES}: {e}"))?;
            Ok(guard)
        }
    }

    impl Drop for NrHugepagesGuard {
        fn drop(&mut self) {
            if let Err(e) = std::fs::write(NR_HUGEPAGES, self.old.to_string()) {
                eprintln!("could not restore {NR_HUGEPAGES} to {}: {e}", self.old);
            }
        }
    }

    #[test]
    fn hugetlb_2m_ram_works_with_a_reserved_pool() {
        let _pool = HUGETLB_POOL.lock().unwrap_or_else(|e| e.into_inner());
        let dir = Backing::Hugetlb2M.hugetlb_pool_dir();
        let default_is_2m = std::fs::read_to_string("/proc/meminfo")
            .map(|m| m.contains("Hugepagesize:       2048 kB"))
            .unwrap_or(false);
        if !dir.is_dir() || !default_is_2m {
            eprintln!("skipped: 2 MiB is not this host's default huge page size");
            return;
        }
        let size = 16 * MIB;
        let needed = size / (2 * MIB);
        let _guard = match NrHugepagesGuard::reserve(needed) {
            Ok(guard) => guard,
            Err(why) => {
                eprintln!("skipped: {why}");
                return;
            }
        };
        let free = read_pool_counter(&dir, "free_hugepages").unwrap();
        let reserved = read_pool_counter(&dir, "resv_hugepages").unwrap();
        if free.saturating_sub(reserved) < needed {
            eprintln!("skipped: the kernel could only make {free} huge pages free");
            return;
        }

        let config = GuestRamConfig {
            size,
            backing: Backing::Hugetlb2M,
            thp: true,
        };
        let regions = two_regions(4 * MIB, 2 * MIB, 12 * MIB);
        // Dropped before the guard, so the pool shrinks back with no pages in use.
        let ram = GuestRam::create(&config, &regions).unwrap();
        assert_eq!(ram.page_size(), 2 * MIB);
        assert_eq!(ram.backing(), Backing::Hugetlb2M);
        ram.memory()
            .write_slice(b"huge", GuestAddress(regions[1].guest_addr + 3 * MIB))
            .unwrap();
        let mut buf = [0u8; 4];
        ram.memfd()
            .read_exact_at(&mut buf, regions[1].file_offset + 3 * MIB)
            .unwrap();
        assert_eq!(&buf, b"huge");
        assert_eq!(ram.resident_bytes().unwrap(), 2 * MIB);

        let stats = crate::prefault::prefault(&ram, 2).unwrap();
        assert_eq!(stats.bytes, size);
        assert_eq!(ram.resident_bytes().unwrap(), size);
        ram.memory()
            .read_slice(&mut buf, GuestAddress(regions[1].guest_addr + 3 * MIB))
            .unwrap();
        assert_eq!(&buf, b"huge");
    }

    /// Memory hot-plug's further RAM: a spare memfd made ahead of time holds a region far
    /// from 0, reachable at its guest address and in the memfd from offset 0.
    #[test]
    fn a_spare_memfd_holds_a_further_region() {
        let memfd = GuestRam::spare_memfd(Backing::Memfd).unwrap();
        let region = RamRegion {
            guest_addr: 5 * GIB,
            size: 128 * MIB,
            file_offset: 0,
        };
        let ram = GuestRam::create_in(memfd, &GuestRamConfig::new(region.size), &[region]).unwrap();
        assert_eq!(ram.size(), 128 * MIB);
        assert_eq!(ram.regions(), [region]);
        ram.memory()
            .write_slice(b"more", GuestAddress(region.end() - 4))
            .unwrap();
        let mut buf = [0u8; 4];
        ram.memfd()
            .read_exact_at(&mut buf, region.size - 4)
            .unwrap();
        assert_eq!(&buf, b"more");
        assert!(ram.memory().read_slice(&mut buf, GuestAddress(0)).is_err());
        // The same checks as a new memfd's: a size the region list does not add up to.
        let memfd = GuestRam::spare_memfd(Backing::Memfd).unwrap();
        assert!(matches!(
            GuestRam::create_in(memfd, &GuestRamConfig::new(2 * region.size), &[region]),
            Err(RamError::RegionSizeMismatch { .. })
        ));
    }
}

#[cfg(test)]
mod adopt_tests {
    use std::os::unix::fs::FileExt;

    use vm_memory::Bytes;

    use super::tests::{NrHugepagesGuard, HUGETLB_POOL};
    use super::*;

    fn region(size: u64) -> Vec<RamRegion> {
        vec![RamRegion {
            guest_addr: 0,
            size,
            file_offset: 0,
        }]
    }

    /// A live update's RAM: the file of RAM made with room for hot-plug, adopted whole,
    /// keeps what boot RAM and the hot-plugged range hold (nothing truncated), and a file
    /// of another size or kind is refused by what is wrong.
    #[test]
    fn adopted_ram_keeps_boot_and_hot_plugged_pages() {
        let config = GuestRamConfig {
            thp: false,
            ..GuestRamConfig::new(16 * MIB)
        };
        let old = GuestRam::create_with_hotplug_room(&config, &region(16 * MIB), 0).unwrap();
        let area = old.hotplug_area(GIB, 8 * MIB).unwrap();
        old.memory()
            .write_slice(b"boot", GuestAddress(MIB))
            .unwrap();
        area.memory()
            .write_slice(b"plug", GuestAddress(GIB + 3 * MIB))
            .unwrap();
        let file = || old.memfd().try_clone().unwrap();
        let error = GuestRam::adopt(file(), &config, &region(16 * MIB), false, 0)
            .unwrap_err()
            .to_string();
        assert!(error.contains("is 25165824 bytes"), "{error}");
        let hugetlb = GuestRamConfig {
            backing: Backing::Hugetlb2M,
            ..config.clone()
        };
        let error = GuestRam::adopt(file(), &hugetlb, &region(16 * MIB), false, 8 * MIB)
            .unwrap_err()
            .to_string();
        assert!(error.contains("is not on hugetlbfs"), "{error}");

        let new = GuestRam::adopt(file(), &config, &region(16 * MIB), false, 8 * MIB).unwrap();
        let new_area = new.hotplug_area(GIB, 8 * MIB).unwrap();
        let plugged = new_area.held_view(GIB + 2 * MIB, 2 * MIB).unwrap();
        let mut buf = [0u8; 4];
        new.memory()
            .read_slice(&mut buf, GuestAddress(MIB))
            .unwrap();
        assert_eq!(&buf, b"boot");
        plugged
            .memory()
            .read_slice(&mut buf, GuestAddress(GIB + 3 * MIB))
            .unwrap();
        assert_eq!(&buf, b"plug");
        assert_eq!(new.memfd().metadata().unwrap().len(), 24 * MIB);
        // One file: what the new mapping writes, the old one reads.
        new.memory()
            .write_slice(b"new!", GuestAddress(MIB))
            .unwrap();
        old.memory()
            .read_slice(&mut buf, GuestAddress(MIB))
            .unwrap();
        assert_eq!(&buf, b"new!");
    }

    /// Hugetlb RAM adopted by a second mapping takes no page from the pool (free and
    /// reserved counts unchanged) and sees the first one's pages; a shmem file is refused
    /// as hugetlb RAM and the other way round.
    #[test]
    fn adopted_hugetlb_ram_takes_no_new_pages() {
        let _pool = HUGETLB_POOL.lock().unwrap_or_else(|e| e.into_inner());
        let dir = Backing::Hugetlb2M.hugetlb_pool_dir();
        let size = 8 * MIB;
        let needed = size / (2 * MIB);
        if !dir.is_dir() {
            eprintln!("skipped: no 2 MiB huge pages on this host");
            return;
        }
        let default_is_2m = std::fs::read_to_string("/proc/meminfo")
            .is_ok_and(|m| m.contains("Hugepagesize:       2048 kB"));
        let available = || {
            read_pool_counter(&dir, "free_hugepages")
                .unwrap()
                .saturating_sub(read_pool_counter(&dir, "resv_hugepages").unwrap())
        };
        // Dropped last: the pool shrinks back once no page is in use.
        let _guard = match available() {
            enough if enough >= needed => None,
            _ if !default_is_2m => {
                eprintln!("skipped: 2 MiB is not this host's default huge page size");
                return;
            }
            short => match NrHugepagesGuard::reserve(needed - short) {
                Ok(guard) => Some(guard),
                Err(why) => {
                    eprintln!("skipped: {why}");
                    return;
                }
            },
        };
        if available() < needed {
            eprintln!("skipped: the kernel could not make {needed} huge pages free");
            return;
        }
        let config = GuestRamConfig {
            size,
            backing: Backing::Hugetlb2M,
            thp: false,
        };
        let old = GuestRam::create(&config, &region(size)).unwrap();
        old.memory()
            .write_slice(b"huge", GuestAddress(5 * MIB))
            .unwrap();
        let counters = || {
            (
                read_pool_counter(&dir, "free_hugepages").unwrap(),
                read_pool_counter(&dir, "resv_hugepages").unwrap(),
            )
        };
        let before = counters();
        let file = old.memfd().try_clone().unwrap();
        let new = GuestRam::adopt(file, &config, &region(size), false, 0).unwrap();
        assert_eq!(counters(), before, "adopting took pages");
        let mut buf = [0u8; 4];
        new.memory()
            .read_slice(&mut buf, GuestAddress(5 * MIB))
            .unwrap();
        assert_eq!(&buf, b"huge");
        drop(old);
        assert_eq!(
            counters(),
            before,
            "the first mapping's end gave pages back"
        );
        let shmem = GuestRamConfig {
            backing: Backing::Memfd,
            ..config
        };
        let error = GuestRam::adopt(
            new.memfd().try_clone().unwrap(),
            &shmem,
            &region(size),
            false,
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("is a hugetlbfs file"), "{error}");
        let mut written = [0u8; 4];
        new.memfd().read_exact_at(&mut written, 5 * MIB).unwrap();
        assert_eq!(&written, b"huge");
    }
}

#[cfg(test)]
mod hotplug_area_tests {
    use vm_memory::{Bytes, GuestMemoryBackend};

    use super::*;

    #[test]
    fn a_view_is_the_area_s_own_memory_and_devices_see_both() {
        let boot_ram = || {
            GuestRam::create_with_hotplug_room(
                &GuestRamConfig::new(64 * MIB),
                &[RamRegion {
                    guest_addr: 0,
                    size: 64 * MIB,
                    file_offset: 0,
                }],
                GIB,
            )
            .unwrap()
        };
        let boot = boot_ram();
        let area = boot.hotplug_area(4 * GIB, GIB).unwrap();
        // One file: the area right after boot RAM in it.
        assert!(boot.shares_file_with(&area));
        assert_eq!(area.regions()[0].file_offset, 64 * MIB);
        assert_eq!(boot.memfd().metadata().unwrap().len(), 64 * MIB + GIB);
        let view = area.view(4 * GIB + 128 * MIB, 128 * MIB).unwrap();
        assert!(view.shares_file_with(&boot));
        assert_eq!(view.size(), 128 * MIB);
        assert_eq!(view.regions()[0].file_offset, 64 * MIB + 128 * MIB);
        assert_eq!(
            view.host_address(0).unwrap() as usize,
            area.host_address(0).unwrap() as usize + (128 * MIB) as usize
        );
        // What KVM writes through the view, a device reads through the area, and back.
        let devices = boot.memory_with(&area).unwrap();
        assert_eq!(devices.num_regions(), 2);
        let at = GuestAddress(4 * GIB + 128 * MIB + 4096);
        view.memory().write_obj(0x1234_5678_u64, at).unwrap();
        assert_eq!(devices.read_obj::<u64>(at).unwrap(), 0x1234_5678);
        devices
            .write_obj(0xfeed_u64, GuestAddress(at.0 + 8))
            .unwrap();
        assert_eq!(
            view.memory()
                .read_obj::<u64>(GuestAddress(at.0 + 8))
                .unwrap(),
            0xfeed
        );
        // The view outlives the area's own handle and keeps the mapping.
        drop(area);
        assert_eq!(view.memory().read_obj::<u64>(at).unwrap(), 0x1234_5678);

        let boot = boot_ram();
        // Not over boot RAM, not unaligned, not empty.
        for (start, size) in [
            (0, GIB),
            (32 * MIB, 64 * MIB),
            (4 * GIB + 1, GIB),
            (4 * GIB, 0),
        ] {
            assert!(
                matches!(
                    boot.hotplug_area(start, size),
                    Err(RamError::InvalidRegion { .. })
                ),
                "area {start:#x}+{size:#x}"
            );
        }
        let area = boot.hotplug_area(4 * GIB, GIB).unwrap();
        for (start, size) in [
            (4 * GIB - 4096, 8192),
            (5 * GIB - 4096, 8192),
            (4 * GIB + 1, 4096),
            (4 * GIB, 0),
            (u64::MAX - 4095, 4096),
        ] {
            assert!(
                matches!(area.view(start, size), Err(RamError::InvalidRegion { .. })),
                "view {start:#x}+{size:#x}"
            );
        }
        // Nothing of the area is allocated until used.
        assert_eq!(area.resident_bytes().unwrap(), 0);
    }
}
