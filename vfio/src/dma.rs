//! DMA mapping of guest RAM in the background, while the guest already runs.
//!
//! Pinning and IOMMU-mapping all of guest RAM is the long part of starting a GPU VM (tens
//! of seconds to minutes for tens of GiB with 4 KiB pages). Nothing but the device's own
//! DMA needs it, and a PCI device cannot DMA before the guest sets Bus Master in its
//! command register, so gpuvm starts the vCPUs at once and maps in the background:
//!
//! - [`plan_chunks`] splits RAM into large chunks aligned to the backing page size;
//! - [`BackgroundMapping::start`] maps them on a thread of its own (`dma-map`), with up to
//!   [`DmaMapper::max_parallel`] chunks in flight: 1 for VFIO type1, whose
//!   `vfio_dma_do_map` pins and maps under the container's `iommu->lock`; several for
//!   iommufd, whose `iopt_map_pages` pins under read locks only; 1 for vfio-user, whose
//!   requests share one socket;
//! - [`DmaProgress`] records bytes mapped, the outcome and the time, for the log and the
//!   API, and is the gate the device model waits on before it lets Bus Master through
//!   (see `VfioPciDevice::gate_bus_master`).
//!
//! Lazy restore (not done yet: VMs with passthrough devices cannot be snapshotted): pinning
//! a userfaultfd-registered range faults every page in and would turn a lazy restore
//! into an eager one. The mapper therefore asks a [`ChunkReady`] source before each chunk;
//! a restore would pass one that blocks until its loader has filled the chunk (and order
//! the loader's work so that chunks complete whole). Boots pass [`AllReady`].

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::DmaRegion;

/// Maps guest RAM for one device or for every device of one IOMMU context.
pub trait DmaMapper: Send + Sync {
    /// For logs and the API: the device, or the kernel interface for kernel VFIO.
    fn name(&self) -> String;
    /// How many chunks may be mapped at once with a gain (1 where the kernel or the
    /// transport serializes the requests anyway).
    fn max_parallel(&self) -> usize;
    /// Makes `chunk` visible to the device(s) at I/O virtual address `chunk.guest_addr`.
    ///
    /// # Safety
    /// The host range must stay mapped (and never be referenced as Rust data the device
    /// could race with) for as long as the IOMMU mapping exists.
    unsafe fn map(&self, chunk: &DmaRegion) -> std::io::Result<()>;
    /// Removes the mapping [`DmaMapper::map`] made at `guest_addr` with `size` bytes (RAM
    /// the guest gave back: only once this returns may its host pages be freed).
    fn unmap(&self, guest_addr: u64, size: u64) -> std::io::Result<()>;
}

/// Says when a chunk of guest RAM holds what the guest should see, so it may be pinned.
pub trait ChunkReady: Send + Sync {
    /// Blocks until `chunk` is filled; false gives up (the mapping then fails).
    fn wait_ready(&self, chunk: &DmaRegion) -> bool;
}

/// Every chunk is ready at once: RAM of a booting VM, or RAM restored eagerly.
pub struct AllReady;

impl ChunkReady for AllReady {
    fn wait_ready(&self, _chunk: &DmaRegion) -> bool {
        true
    }
}

/// Splits `regions` into chunks of at most `chunk` bytes whose boundaries are multiples of
/// `align` (the RAM page size, so a huge page is never split across two mappings).
pub fn plan_chunks(regions: &[DmaRegion], chunk: u64, align: u64) -> Vec<DmaRegion> {
    let align = align.max(4096);
    let chunk = chunk.max(align) / align * align;
    let mut chunks = Vec::new();
    for region in regions {
        let mut offset = 0;
        while offset < region.size {
            let size = chunk.min(region.size - offset);
            chunks.push(DmaRegion {
                guest_addr: region.guest_addr + offset,
                size,
                host_addr: region.host_addr + offset,
                fd: region.fd,
                fd_offset: region.fd_offset + offset,
            });
            offset += size;
        }
    }
    chunks
}

/// Where one background mapping stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DmaStatus {
    pub name: String,
    pub mapped_bytes: u64,
    pub total_bytes: u64,
    pub done: bool,
    /// Why the mapping failed, if it did.
    pub error: Option<String>,
    /// From the start (including any test delay) to the end; the time so far while it runs.
    pub elapsed: Duration,
    /// Chunks mapped at once, at most.
    pub parallel: usize,
    /// Guest writes setting Bus Master that were refused because the mapping failed or
    /// took too long.
    pub bus_master_refused: u32,
}

#[derive(Debug)]
enum Outcome {
    Running,
    Done,
    Failed(String),
}

#[derive(Debug)]
struct State {
    outcome: Outcome,
    started: Instant,
    finished: Option<Instant>,
    parallel: usize,
    refused: u32,
}

/// Progress of one mapping, shared by the mapper thread, the device models it gates and
/// the API.
#[derive(Debug)]
pub struct DmaProgress {
    name: String,
    total: u64,
    mapped: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
}

impl DmaProgress {
    pub fn new(name: impl Into<String>, total: u64) -> Arc<Self> {
        Arc::new(DmaProgress {
            name: name.into(),
            total,
            mapped: AtomicU64::new(0),
            state: Mutex::new(State {
                outcome: Outcome::Running,
                started: Instant::now(),
                finished: None,
                parallel: 0,
                refused: 0,
            }),
            changed: Condvar::new(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    pub fn mapped_bytes(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed)
    }

    /// Whether every chunk is mapped.
    pub fn is_done(&self) -> bool {
        matches!(self.state().outcome, Outcome::Done)
    }

    pub fn status(&self) -> DmaStatus {
        let state = self.state();
        DmaStatus {
            name: self.name.clone(),
            mapped_bytes: self.mapped_bytes(),
            total_bytes: self.total,
            done: matches!(state.outcome, Outcome::Done),
            error: match &state.outcome {
                Outcome::Failed(error) => Some(error.clone()),
                _ => None,
            },
            elapsed: state
                .finished
                .unwrap_or_else(Instant::now)
                .duration_since(state.started),
            parallel: state.parallel,
            bus_master_refused: state.refused,
        }
    }

    /// Waits until the mapping is complete (Ok), failed (Err with why) or `limit` has
    /// passed (Err): the gate in front of a device's Bus Master bit.
    pub fn wait(&self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        let mut state = self.state();
        loop {
            match &state.outcome {
                Outcome::Done => return Ok(()),
                Outcome::Failed(error) => return Err(error.clone()),
                Outcome::Running => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "not mapped after {limit:?} ({} of {} MiB)",
                    self.mapped_bytes() >> 20,
                    self.total >> 20
                ));
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Counts a refused Bus Master write (reported in the API).
    pub fn note_bus_master_refused(&self) {
        self.state().refused += 1;
    }

    fn set_parallel(&self, parallel: usize) {
        self.state().parallel = parallel;
    }

    fn add(&self, bytes: u64) -> u64 {
        self.mapped.fetch_add(bytes, Ordering::Relaxed) + bytes
    }

    fn finish(&self, result: Result<(), String>) {
        let mut state = self.state();
        if !matches!(state.outcome, Outcome::Running) {
            return;
        }
        state.outcome = match result {
            Ok(()) => Outcome::Done,
            Err(error) => Outcome::Failed(error),
        };
        state.finished = Some(Instant::now());
        drop(state);
        self.changed.notify_all();
    }
}

/// A hook run first thing on the mapper thread (the VMM installs its seccomp filter).
pub type ThreadStartHook = Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// How a background mapping runs.
pub struct MapOptions {
    /// Waited before the first chunk (a test hook: `GPUVM_TEST_DMA_MAP_DELAY_MS`).
    pub delay: Duration,
    /// Asked before each chunk; [`AllReady`] for a boot.
    pub ready: Arc<dyn ChunkReady>,
    pub on_thread_start: Option<ThreadStartHook>,
    /// Kept alive until the thread ends: what owns the host mappings being pinned.
    pub keepalive: Option<Box<dyn std::any::Any + Send>>,
}

impl Default for MapOptions {
    fn default() -> Self {
        MapOptions {
            delay: Duration::ZERO,
            ready: Arc::new(AllReady),
            on_thread_start: None,
            keepalive: None,
        }
    }
}

/// A mapping in progress on its own thread; dropping it stops the mapping between chunks
/// and waits for the thread.
pub struct BackgroundMapping {
    progress: Arc<DmaProgress>,
    /// The mapper, for RAM added later (memory hot-plug maps it synchronously).
    mapper: Arc<dyn DmaMapper>,
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl BackgroundMapping {
    /// Starts mapping `chunks` with `mapper`, recording into `progress` (whose total
    /// must be the chunks' sum).
    pub fn start(
        progress: Arc<DmaProgress>,
        mapper: Arc<dyn DmaMapper>,
        chunks: Vec<DmaRegion>,
        options: MapOptions,
    ) -> std::io::Result<Self> {
        let cancel = Arc::new(AtomicBool::new(false));
        let kept_mapper = mapper.clone();
        let thread = std::thread::Builder::new().name("dma-map".into()).spawn({
            let progress = progress.clone();
            let cancel = cancel.clone();
            move || {
                let MapOptions {
                    delay,
                    ready,
                    on_thread_start,
                    keepalive,
                } = options;
                let result = match on_thread_start.map_or(Ok(()), |hook| hook()) {
                    Ok(()) => {
                        wait_cancellable(delay, &cancel);
                        map_chunks(mapper.as_ref(), &chunks, &progress, ready.as_ref(), &cancel)
                    }
                    Err(error) => Err(format!("cannot set up the mapper thread: {error}")),
                };
                if let Err(error) = &result {
                    log::error!("DMA map {}: {error}", progress.name());
                }
                progress.finish(result);
                drop(keepalive);
            }
        })?;
        Ok(BackgroundMapping {
            progress,
            mapper: kept_mapper,
            cancel,
            thread: Some(thread),
        })
    }

    pub fn progress(&self) -> &Arc<DmaProgress> {
        &self.progress
    }

    /// The mapper this mapping uses: RAM hot-plugged later is mapped through it too.
    pub fn mapper(&self) -> &Arc<dyn DmaMapper> {
        &self.mapper
    }

    /// Waits for the thread to end (tests, and callers that want the old synchronous map).
    pub fn join(mut self) -> DmaStatus {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.progress.status()
    }
}

impl Drop for BackgroundMapping {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // A thread that panicked never finished: say so to anyone still waiting.
        self.progress.finish(Err("the mapping was stopped".into()));
    }
}

fn wait_cancellable(delay: Duration, cancel: &AtomicBool) {
    let until = Instant::now() + delay;
    while !cancel.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= until {
            return;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(20)));
    }
}

/// Maps `chunks` in order with up to `mapper.max_parallel()` threads; the first failure
/// stops the rest. Logs the start, every ~10% and the end with the rate.
pub fn map_chunks(
    mapper: &dyn DmaMapper,
    chunks: &[DmaRegion],
    progress: &DmaProgress,
    ready: &dyn ChunkReady,
    cancel: &AtomicBool,
) -> Result<(), String> {
    let total: u64 = chunks.iter().map(|c| c.size).sum();
    let threads = mapper.max_parallel().clamp(1, chunks.len().max(1));
    progress.set_parallel(threads);
    let started = Instant::now();
    log::info!(
        "DMA map {}: start, {} MiB in {} chunk(s), {threads} at a time",
        mapper.name(),
        total >> 20,
        chunks.len()
    );
    let next = AtomicUsize::new(0);
    let reported_decile = AtomicU64::new(0);
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let failed = || failure.lock().unwrap_or_else(|e| e.into_inner()).is_some();
    let fail = |error: String| {
        failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(error);
    };
    let work = || loop {
        if failed() {
            return;
        }
        if cancel.load(Ordering::Relaxed) {
            return fail("the mapping was stopped".into());
        }
        let Some(chunk) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) else {
            return;
        };
        if !ready.wait_ready(chunk) {
            return fail(format!(
                "guest RAM at {:#x}+{:#x} never became ready",
                chunk.guest_addr, chunk.size
            ));
        }
        // SAFETY: the chunks lie inside guest RAM mappings that the VM keeps for its whole
        // life, longer than the devices and their IOMMU mappings (the caller's keepalive).
        if let Err(error) = unsafe { mapper.map(chunk) } {
            return fail(format!(
                "DMA-mapping guest RAM at {:#x}+{:#x}: {error}",
                chunk.guest_addr, chunk.size
            ));
        }
        let done = progress.add(chunk.size);
        let decile = done * 10 / total.max(1);
        if reported_decile.fetch_max(decile, Ordering::Relaxed) < decile && decile < 10 {
            log::info!(
                "DMA map {}: {} of {} MiB ({}%) in {:?}",
                mapper.name(),
                done >> 20,
                total >> 20,
                decile * 10,
                started.elapsed()
            );
        }
    };
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(work);
            }
        });
    }
    if let Some(error) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(error);
    }
    let elapsed = started.elapsed();
    let since_start = progress.status().elapsed;
    log::info!(
        "DMA map {}: done, {} MiB in {elapsed:?} ({:.0} MiB/s), {since_start:?} after the device was attached",
        mapper.name(),
        total >> 20,
        (total as f64 / (1 << 20) as f64) / elapsed.as_secs_f64().max(1e-6),
    );
    Ok(())
}

/// One mmapped part of a passthrough device's BAR, and where the guest has it now.
///
/// Peer-to-peer DMA maps these into the other devices' IOMMU contexts at `guest_addr`,
/// so that one device's DMA to another's guest BAR address reaches that BAR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarWindow {
    pub bar: u8,
    /// Offset of this part in the BAR (and in the region).
    pub offset: u64,
    pub size: u64,
    /// Where the VMM mmapped it.
    pub host_addr: u64,
    /// Its guest-physical address while the BAR is placed and memory decoding is on.
    pub guest_addr: Option<u64>,
}

/// Told where a device's mmapped BAR parts are each time the guest moves a BAR or turns
/// memory decoding on or off (and once more, all unplaced, when the device goes).
pub trait BarPlacementWatch: Send + Sync {
    fn placed(&self, windows: &[BarWindow]);

    /// The device is being dropped (`windows` placed nowhere): by default, as unplaced.
    fn gone(&self, windows: &[BarWindow]) {
        self.placed(windows);
    }
}

/// Why an IOMMU context cannot map peer BAR memory.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{context} cannot DMA-map other devices' BARs: {reason}")]
pub struct PeerMappingUnsupported {
    pub context: String,
    pub reason: String,
}

/// Maps other devices' BAR memory into one IOMMU context (one device's, for vfio-user;
/// a container's, for kernel VFIO): the peer-to-peer DMA mappings.
pub trait PeerMapper: Send + Sync {
    /// For logs: the device or the kernel interface.
    fn name(&self) -> String;
    /// Makes `window` (a peer's BAR part: its host address, and its file and offset)
    /// reachable at I/O virtual address `window.guest_addr`.
    ///
    /// # Safety
    /// The host range must stay mapped until [`PeerMapper::unmap_peer`] removes it.
    unsafe fn map_peer(&self, window: &DmaRegion) -> std::io::Result<()>;
    /// Removes the mapping made at `guest_addr` with `size` bytes.
    fn unmap_peer(&self, guest_addr: u64, size: u64) -> std::io::Result<()>;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// How many calls of a fake ran at once, at the most.
    #[derive(Default)]
    pub(crate) struct Overlap {
        active: AtomicUsize,
        most: AtomicUsize,
    }

    impl Overlap {
        /// One call, taking `delay`.
        pub fn call(&self, delay: Duration) {
            let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(delay);
            self.active.fetch_sub(1, Ordering::SeqCst);
        }

        pub fn most(&self) -> usize {
            self.most.load(Ordering::SeqCst)
        }
    }

    /// Records each call and how many ran at once; can be slowed, and can fail at one IOVA.
    #[derive(Default)]
    pub(crate) struct FakeMapper {
        pub parallel: usize,
        pub delay: Duration,
        pub fail_iova: Option<u64>,
        pub calls: Mutex<Vec<u64>>,
        pub overlap: Overlap,
    }

    impl DmaMapper for FakeMapper {
        fn name(&self) -> String {
            "fake".into()
        }
        fn max_parallel(&self) -> usize {
            self.parallel
        }
        unsafe fn map(&self, chunk: &DmaRegion) -> std::io::Result<()> {
            self.overlap.call(self.delay);
            if Some(chunk.guest_addr) == self.fail_iova {
                return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
            }
            self.calls.lock().unwrap().push(chunk.guest_addr);
            Ok(())
        }
        fn unmap(&self, guest_addr: u64, _size: u64) -> std::io::Result<()> {
            self.calls
                .lock()
                .unwrap()
                .retain(|&iova| iova != guest_addr);
            Ok(())
        }
    }

    /// Guest RAM in two regions, below and above a 1 GiB hole at 3 GiB.
    pub(crate) fn ram() -> Vec<DmaRegion> {
        vec![
            DmaRegion {
                guest_addr: 0,
                size: 3 << 30,
                host_addr: 0x7f00_0000_0000,
                fd: -1,
                fd_offset: 0,
            },
            DmaRegion {
                guest_addr: 4 << 30,
                size: (5 << 30) + (6 << 20),
                host_addr: 0x7f10_0000_0000,
                fd: -1,
                fd_offset: 3 << 30,
            },
        ]
    }

    fn start(mapper: Arc<FakeMapper>, options: MapOptions) -> BackgroundMapping {
        let chunks = plan_chunks(&ram(), 1 << 30, 2 << 20);
        let total = chunks.iter().map(|c| c.size).sum();
        BackgroundMapping::start(DmaProgress::new("fake", total), mapper, chunks, options).unwrap()
    }

    #[test]
    fn chunks_are_aligned_and_cover_ram_once() {
        let chunks = plan_chunks(&ram(), 1 << 30, 2 << 20);
        assert_eq!(chunks.len(), 3 + 6);
        let mut next = [0u64, 4 << 30];
        for chunk in &chunks {
            assert_eq!(chunk.guest_addr % (2 << 20), 0);
            assert!(chunk.size <= 1 << 30);
            let region = usize::from(chunk.guest_addr >= 4 << 30);
            assert_eq!(chunk.guest_addr, next[region]);
            next[region] += chunk.size;
            let base = ram()[region];
            let offset = chunk.guest_addr - base.guest_addr;
            assert_eq!(chunk.host_addr, base.host_addr + offset);
            assert_eq!(chunk.fd_offset, base.fd_offset + offset);
        }
        assert_eq!(next, [3 << 30, (9 << 30) + (6 << 20)]);
        // A chunk size that is not a page multiple rounds down to one.
        let chunks = plan_chunks(&ram()[..1], (1 << 30) + 12345, 1 << 30);
        assert!(chunks.iter().all(|c| c.size == 1 << 30));
    }

    #[test]
    fn one_at_a_time_maps_in_order() {
        let fake = Arc::new(FakeMapper {
            parallel: 1,
            delay: Duration::from_millis(2),
            ..Default::default()
        });
        let status = start(fake.clone(), MapOptions::default()).join();
        assert!(status.done && status.error.is_none(), "{status:?}");
        assert_eq!(status.mapped_bytes, (8 << 30) + (6 << 20));
        assert_eq!(status.mapped_bytes, status.total_bytes);
        assert_eq!(status.parallel, 1);
        assert_eq!(fake.overlap.most(), 1);
        let calls = fake.calls.lock().unwrap().clone();
        let expected: Vec<u64> = plan_chunks(&ram(), 1 << 30, 2 << 20)
            .iter()
            .map(|c| c.guest_addr)
            .collect();
        assert_eq!(calls, expected, "type1/vfio-user order: chunk by chunk");
    }

    #[test]
    fn a_parallel_mapper_maps_several_chunks_at_once() {
        let fake = Arc::new(FakeMapper {
            parallel: 4,
            delay: Duration::from_millis(30),
            ..Default::default()
        });
        let status = start(fake.clone(), MapOptions::default()).join();
        assert!(status.done, "{status:?}");
        assert_eq!(status.parallel, 4);
        let most = fake.overlap.most();
        assert!((2..=4).contains(&most), "{most} chunks at once");
        let mut calls = fake.calls.lock().unwrap().clone();
        calls.sort();
        calls.dedup();
        assert_eq!(calls.len(), 9, "every chunk once");
    }

    #[test]
    fn the_gate_opens_only_when_every_chunk_is_mapped() {
        let fake = Arc::new(FakeMapper {
            parallel: 1,
            ..Default::default()
        });
        let options = MapOptions {
            delay: Duration::from_millis(300),
            ..Default::default()
        };
        let started = Instant::now();
        let mapping = start(fake.clone(), options);
        let progress = mapping.progress().clone();
        assert!(!progress.is_done());
        assert_eq!(progress.mapped_bytes(), 0);
        progress.wait(Duration::from_secs(30)).expect("mapped");
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(fake.calls.lock().unwrap().len(), 9);
        assert!(progress.status().elapsed >= Duration::from_millis(300));
        drop(mapping);
        // Done stays done after the thread is gone.
        assert!(progress.wait(Duration::ZERO).is_ok());
    }

    #[test]
    fn a_failure_stops_the_rest_and_opens_the_gate_with_the_error() {
        let fake = Arc::new(FakeMapper {
            parallel: 1,
            fail_iova: Some(4 << 30),
            ..Default::default()
        });
        let mapping = start(fake.clone(), MapOptions::default());
        let error = mapping
            .progress()
            .wait(Duration::from_secs(30))
            .unwrap_err();
        assert!(
            error.contains("DMA-mapping guest RAM at 0x100000000"),
            "{error}"
        );
        let status = mapping.join();
        assert!(!status.done);
        assert_eq!(status.mapped_bytes, 3 << 30, "the chunks before it");
        assert_eq!(fake.calls.lock().unwrap().len(), 3, "none after it");
    }

    #[test]
    fn a_wait_that_runs_out_says_how_far_the_map_got() {
        let fake = Arc::new(FakeMapper {
            parallel: 1,
            ..Default::default()
        });
        let options = MapOptions {
            delay: Duration::from_secs(60),
            ..Default::default()
        };
        let mapping = start(fake, options);
        let error = mapping
            .progress()
            .wait(Duration::from_millis(50))
            .unwrap_err();
        assert!(error.contains("not mapped after"), "{error}");
        // Dropping it cancels the delay and ends the thread promptly.
        let started = Instant::now();
        let progress = mapping.progress().clone();
        drop(mapping);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(progress.wait(Duration::ZERO).is_err());
    }

    /// The emulated GPU's DMA engine writes through whatever file a mapping came with: a
    /// peer's BAR file as well as guest RAM; a mapping past its file's end is refused, and
    /// a job outside every mapping reports status 1.
    #[test]
    fn the_emulated_engine_writes_into_a_peer_bar_file() {
        use crate::emu::{pattern, regs, EmuGpu, EmuGpuOptions};
        use std::os::fd::FromRawFd;
        use std::os::unix::fs::FileExt;
        use vfio_user::{DmaMapFlags, ServerBackend};

        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"peer-bar".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let peer_bar = unsafe { std::fs::File::from_raw_fd(fd) };
        peer_bar.set_len(2 << 20).unwrap();
        let mut gpu = EmuGpu::new(EmuGpuOptions::default()).unwrap();
        let map = |gpu: &mut EmuGpu, offset: u64, address: u64, size: u64| {
            gpu.dma_map(
                DmaMapFlags::READ_WRITE,
                offset,
                address,
                size,
                Some(peer_bar.try_clone().unwrap()),
            )
        };
        assert!(
            map(&mut gpu, 1 << 20, 0x2_0000_0000, 2 << 20).is_err(),
            "past the file's end"
        );
        // The peer's BAR from 1 MiB into its file, at guest address 8 GiB.
        map(&mut gpu, 1 << 20, 0x2_0000_0000, 1 << 20).unwrap();
        assert!(
            map(&mut gpu, 0, 0x2_0008_0000, 4096).is_err(),
            "overlaps the mapping"
        );
        let write = |gpu: &mut EmuGpu, region: u32, offset: u64, value: u32| {
            gpu.region_write(region, offset, &value.to_le_bytes())
                .unwrap()
        };
        let status = |gpu: &mut EmuGpu| {
            let mut value = [0u8; 4];
            gpu.region_read(0, regs::DMA_STATUS, &mut value).unwrap();
            u32::from_le_bytes(value)
        };
        write(&mut gpu, crate::region::CONFIG, 4, 0x6); // memory and Bus Master on
        let target = 0x2_0000_1000u64;
        write(&mut gpu, 0, regs::DMA_ADDR_LO, target as u32);
        write(&mut gpu, 0, regs::DMA_ADDR_HI, (target >> 32) as u32);
        write(&mut gpu, 0, regs::DMA_LEN, 4096);
        write(&mut gpu, 0, regs::DMA_SEED, 7);
        write(&mut gpu, 0, regs::DOORBELL, 0);
        assert_eq!(status(&mut gpu), 0);
        let mut word = [0u8; 8];
        peer_bar
            .read_exact_at(&mut word, (1 << 20) + 0x1000)
            .unwrap();
        assert_eq!(u64::from_le_bytes(word), pattern(7, target));
        peer_bar
            .read_exact_at(&mut word, (1 << 20) + 0x1ff8)
            .unwrap();
        assert_eq!(u64::from_le_bytes(word), pattern(7, target + 0xff8));
        // Past the mapping's end: not mapped.
        write(&mut gpu, 0, regs::DMA_ADDR_LO, 0x000f_f000);
        write(&mut gpu, 0, regs::DMA_LEN, 0x2000);
        write(&mut gpu, 0, regs::DOORBELL, 0);
        assert_eq!(status(&mut gpu), 1);
    }

    struct Gate(Mutex<u64>, Condvar);

    impl ChunkReady for Gate {
        fn wait_ready(&self, chunk: &DmaRegion) -> bool {
            let mut filled = self.0.lock().unwrap();
            while *filled < chunk.guest_addr + chunk.size {
                filled = self.1.wait(filled).unwrap();
            }
            true
        }
    }

    /// The lazy-restore hook: a chunk is mapped only once its source says it is filled.
    #[test]
    fn chunks_wait_for_their_ready_source() {
        let fake = Arc::new(FakeMapper {
            parallel: 1,
            ..Default::default()
        });
        let gate = Arc::new(Gate(Mutex::new(0), Condvar::new()));
        let options = MapOptions {
            ready: gate.clone(),
            ..Default::default()
        };
        let mapping = start(fake.clone(), options);
        std::thread::sleep(Duration::from_millis(50));
        assert!(fake.calls.lock().unwrap().is_empty());
        *gate.0.lock().unwrap() = 2 << 30;
        gate.1.notify_all();
        let wait_for = |n: usize| {
            for _ in 0..500 {
                if fake.calls.lock().unwrap().len() >= n {
                    return;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        wait_for(2);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            *fake.calls.lock().unwrap(),
            [0, 1 << 30],
            "only filled chunks"
        );
        assert!(!mapping.progress().is_done());
        *gate.0.lock().unwrap() = u64::MAX;
        gate.1.notify_all();
        assert!(mapping.join().done);
    }
}
