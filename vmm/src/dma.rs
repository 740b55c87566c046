//! Guest RAM's DMA mapping for passthrough devices, in the background while the guest
//! boots: the chunks to map, the test hooks that slow or break the mapper, how long a
//! guest's Bus Master write may wait for it, and where each mapping stands (for the API).
//! The mapper itself is gpuvm_vfio::dma; the devices are plugged by [`crate::pci`], and
//! [`crate::devices::MachineDevices::dma_mapping_status`] reports on them.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use gpuvm_memory::GuestRam;
use gpuvm_vfio::dma::{plan_chunks, BackgroundMapping, DmaMapper, DmaProgress, MapOptions};
use gpuvm_vfio::{DmaRegion, VfioError};

/// Guest RAM is DMA-mapped in chunks of this size (1 GiB: a 1 GiB page is never split,
/// and each chunk is one VFIO_IOMMU_MAP_DMA / IOMMU_IOAS_MAP call).
const DMA_CHUNK: u64 = 1 << 30;
/// Test hook: `GPUVM_TEST_DMA_MAP_DELAY_MS=<ms>` holds each mapping that long before its
/// first chunk (the guest boots meanwhile; Bus Master waits).
pub const DMA_DELAY_HOOK: &str = "GPUVM_TEST_DMA_MAP_DELAY_MS";
/// Test hook: `GPUVM_TEST_DMA_MAP_FAIL=1` makes every chunk's map fail (after the delay).
pub const DMA_FAIL_HOOK: &str = "GPUVM_TEST_DMA_MAP_FAIL";
/// Test hook: `GPUVM_TEST_DMA_CHUNK_MIB=<MiB>` (a power of two) maps RAM in smaller chunks,
/// so that a small guest exercises the parallel mapper that large ones use.
pub const DMA_CHUNK_HOOK: &str = "GPUVM_TEST_DMA_CHUNK_MIB";
/// The least time a guest write setting Bus Master waits for the mapping before it is
/// refused; more for large RAM (see [`bus_master_wait_limit`]).
const BUS_MASTER_MIN_WAIT: Duration = Duration::from_secs(600);

/// How long a guest write setting Bus Master may wait for the mapping of `total` bytes:
/// 10 minutes, or 1 s per 128 MiB (about 16 minutes per TiB) for larger RAM.
pub fn bus_master_wait_limit(total: u64) -> Duration {
    BUS_MASTER_MIN_WAIT.max(Duration::from_secs(total / (128 << 20)))
}

/// The test hooks, read once per VM: the delay before each mapping, and whether maps fail.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DmaTestHooks {
    delay: Duration,
    fail: bool,
}

impl DmaTestHooks {
    pub(crate) fn from_env() -> Self {
        let delay = match std::env::var(DMA_DELAY_HOOK) {
            Err(_) => Duration::ZERO,
            Ok(text) => match text.parse::<u64>() {
                Ok(ms) => {
                    log::warn!("{DMA_DELAY_HOOK}: each DMA mapping starts {ms} ms late");
                    Duration::from_millis(ms)
                }
                Err(_) => {
                    log::warn!(
                        "{DMA_DELAY_HOOK}={text:?} is not a number of milliseconds; ignored"
                    );
                    Duration::ZERO
                }
            },
        };
        let fail = std::env::var_os(DMA_FAIL_HOOK).is_some_and(|v| v != "0");
        if fail {
            log::warn!("{DMA_FAIL_HOOK}: every DMA map fails");
        }
        DmaTestHooks { delay, fail }
    }
}

/// A mapper whose maps all fail ([`DMA_FAIL_HOOK`]).
struct FailingMapper(Arc<dyn DmaMapper>);

impl DmaMapper for FailingMapper {
    fn name(&self) -> String {
        self.0.name()
    }
    fn max_parallel(&self) -> usize {
        self.0.max_parallel()
    }
    fn unmap(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        self.0.unmap(guest_addr, size)
    }
    unsafe fn map(&self, _chunk: &DmaRegion) -> std::io::Result<()> {
        Err(std::io::Error::other(format!(
            "injected failure ({DMA_FAIL_HOOK})"
        )))
    }
}

/// Guest RAM as chunks to map, and what keeps its mappings alive.
pub(crate) struct RamChunks {
    chunks: Vec<DmaRegion>,
    total: u64,
    /// A handle on guest RAM's mappings (and the memfd they map) that the mapper thread
    /// holds until it ends.
    memory: vm_memory::GuestMemoryMmap,
    /// The same for RAM hot-plugged since ([`RamChunks::add`]), by its first guest address.
    added: Vec<(u64, vm_memory::GuestMemoryMmap)>,
}

/// [`DMA_CHUNK`], or what [`DMA_CHUNK_HOOK`] asks for when it is a power of two of at
/// least one page and at most [`DMA_CHUNK`].
fn chunk_size_from_env(page_size: u64) -> u64 {
    let Ok(text) = std::env::var(DMA_CHUNK_HOOK) else {
        return DMA_CHUNK;
    };
    match text
        .parse::<u64>()
        .ok()
        .and_then(|mib| mib.checked_mul(1 << 20))
    {
        Some(bytes) if bytes.is_power_of_two() && bytes >= page_size && bytes <= DMA_CHUNK => {
            log::warn!("{DMA_CHUNK_HOOK}: guest RAM is DMA-mapped in {text} MiB chunks");
            bytes
        }
        _ => {
            log::warn!("{DMA_CHUNK_HOOK}={text:?} is not a power-of-two MiB count of at least a page and at most 1024; ignored");
            DMA_CHUNK
        }
    }
}

impl RamChunks {
    pub(crate) fn new(ram: &GuestRam) -> Self {
        let regions: Vec<DmaRegion> = ram
            .host_regions()
            .map(|(region, host)| DmaRegion {
                guest_addr: region.guest_addr,
                size: region.size,
                host_addr: host as u64,
                fd: ram.memfd().as_raw_fd(),
                fd_offset: region.file_offset,
            })
            .collect();
        let chunk = chunk_size_from_env(ram.page_size());
        let chunks = plan_chunks(&regions, chunk, ram.page_size());
        RamChunks {
            total: chunks.iter().map(|c| c.size).sum(),
            chunks,
            memory: ram.memory().clone(),
            added: Vec::new(),
        }
    }

    /// Guest RAM as DMA regions (one per region of `ram`).
    pub(crate) fn regions_of(ram: &GuestRam) -> Vec<DmaRegion> {
        ram.host_regions()
            .map(|(region, host)| DmaRegion {
                guest_addr: region.guest_addr,
                size: region.size,
                host_addr: host as u64,
                fd: ram.memfd().as_raw_fd(),
                fd_offset: region.file_offset,
            })
            .collect()
    }

    /// Boot RAM `ram` and the hot-plugged RAM `plugged` as DMA regions.
    pub(crate) fn regions_of_all<'a>(
        ram: &GuestRam,
        plugged: impl Iterator<Item = &'a GuestRam>,
    ) -> Vec<DmaRegion> {
        let mut regions = Self::regions_of(ram);
        for ram in plugged {
            regions.extend(Self::regions_of(ram));
        }
        regions
    }

    /// Adds hot-plugged RAM: devices plugged from now on map it with the rest.
    pub(crate) fn add(&mut self, ram: &GuestRam) {
        let chunk = chunk_size_from_env(ram.page_size());
        let chunks = plan_chunks(&Self::regions_of(ram), chunk, ram.page_size());
        self.total += chunks.iter().map(|c| c.size).sum::<u64>();
        self.chunks.extend(chunks);
        let start = ram.regions().first().map_or(0, |r| r.guest_addr);
        self.added.push((start, ram.memory().clone()));
    }

    /// Drops hot-plugged RAM the guest gave back (`guest_addr`, `size` bytes): devices
    /// plugged from now on do not map it.
    pub(crate) fn remove(&mut self, guest_addr: u64, size: u64) {
        let end = guest_addr.saturating_add(size);
        self.chunks.retain(|chunk| {
            let inside = chunk.guest_addr >= guest_addr && chunk.guest_addr + chunk.size <= end;
            if inside {
                self.total -= chunk.size;
            }
            !inside
        });
        self.added.retain(|(start, _)| *start != guest_addr);
    }

    /// Starts mapping all chunks with `mapper` on a thread (under the VMM's seccomp
    /// filter); `progress` was made by [`RamChunks::progress`].
    pub(crate) fn start(
        &self,
        progress: Arc<DmaProgress>,
        mapper: Arc<dyn DmaMapper>,
        hooks: DmaTestHooks,
    ) -> Result<BackgroundMapping, VfioError> {
        self.start_with(
            progress,
            mapper,
            hooks,
            crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
        )
    }

    /// As [`RamChunks::start`], with `on_thread_start` (None when started from a thread
    /// already under the VMM filter, which the mapper thread inherits: hot-plug).
    pub(crate) fn start_with(
        &self,
        progress: Arc<DmaProgress>,
        mapper: Arc<dyn DmaMapper>,
        hooks: DmaTestHooks,
        on_thread_start: Option<gpuvm_vfio::dma::ThreadStartHook>,
    ) -> Result<BackgroundMapping, VfioError> {
        let ready: Arc<dyn gpuvm_vfio::dma::ChunkReady> = Arc::new(gpuvm_vfio::dma::AllReady);
        self.start_when_ready(progress, mapper, hooks, on_thread_start, ready)
    }

    /// As [`RamChunks::start_with`], mapping each chunk once `ready` says RAM there is
    /// filled (a restore's RAM still being loaded).
    pub(crate) fn start_when_ready(
        &self,
        progress: Arc<DmaProgress>,
        mapper: Arc<dyn DmaMapper>,
        hooks: DmaTestHooks,
        on_thread_start: Option<gpuvm_vfio::dma::ThreadStartHook>,
        ready: Arc<dyn gpuvm_vfio::dma::ChunkReady>,
    ) -> Result<BackgroundMapping, VfioError> {
        let mapper: Arc<dyn DmaMapper> = if hooks.fail {
            Arc::new(FailingMapper(mapper))
        } else {
            mapper
        };
        let options = MapOptions {
            delay: hooks.delay,
            on_thread_start,
            keepalive: Some(Box::new((self.memory.clone(), self.added.clone()))),
            ready,
        };
        BackgroundMapping::start(progress, mapper, self.chunks.clone(), options)
            .map_err(VfioError::Io)
    }

    /// The chunks, each one DMA map call of a context that maps them all.
    /// Each chunk's (IOVA, size): the DMA map calls a mapping of these chunks makes.
    pub(crate) fn map_calls(&self) -> Vec<(u64, u64)> {
        (self.chunks.iter())
            .map(|c| (c.guest_addr, c.size))
            .collect()
    }

    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    pub(crate) fn progress(&self, name: String) -> Arc<DmaProgress> {
        DmaProgress::new(name, self.total)
    }
}
