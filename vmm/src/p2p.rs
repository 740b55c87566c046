//! Peer-to-peer DMA: each passthrough device's mmapped BAR parts are DMA-mapped at their
//! guest addresses in every *other* device's IOMMU context, so that one GPU's DMA to a
//! peer's guest BAR address reaches that BAR (what NCCL's P2P transport needs).
//!
//! - A *context* is where DMA mappings live: the one type1 container of the cold-plugged
//!   kernel VFIO devices (one mapping serves them all), a hot-plugged kernel VFIO
//!   device's own container, or one vfio-user device's connection (DMA_MAP with the peer
//!   BAR's file and offset). An iommufd IOAS cannot map BAR (PFNMAP) memory on current
//!   kernels: its context is kept without a mapper and said so once.
//! - A *peer* is a plugged device: its context, whether it shares its BARs (`p2p=off`
//!   says no), the files behind its BARs, and where the guest has each mmapped BAR part
//!   now (told by `VfioPciDevice` through [`BarPlacementWatch`] on every BAR move and
//!   memory-decoding change, and unplaced when the device goes).
//!
//! After every change the wanted mappings are worked out again from scratch (a handful of
//! devices, a few windows each) and compared with those made: stale ones are unmapped
//! first (a moved BAR, decoding off, a device gone), then new ones mapped.
//!
//! A live update hands the table of made mappings to the new process
//! ([`HandedOverPeerMapping`]): the vfio-user devices keep theirs (their connections are
//! handed over), and the new process adopts each as its devices are plugged back and report
//! their BARs where the old one had them ([`PeerDma::adopt`]), so it maps nothing again and
//! unmaps them when the guest moves a BAR later.
//!
//! The map and unmap calls run on a `p2p-map` thread of their own (under the VMM's
//! seccomp filter, which allows VFIO_IOMMU_MAP_DMA): BAR moves arrive on vCPU threads,
//! whose filter does not. The vCPU waits for the thread, so when its config write
//! returns the peers' mappings already follow the BAR.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};

use gpuvm_vfio::dma::{BarPlacementWatch, BarWindow, PeerMapper, PeerMappingUnsupported};
use gpuvm_vfio::pci::VfioPciDevice;
use gpuvm_vfio::{DmaRegion, VfioError};
use serde::{Deserialize, Serialize};

use crate::config::PassthroughTuning;
use crate::pci::PciSetupError;

/// The BAR indices a PCI function may have memory BARs at.
const BAR_INDICES: std::ops::Range<u8> = 0..6;

/// Why a peer mapping could not be made or removed (logged; the guest sees a DMA that
/// does not reach the peer).
#[derive(Debug, thiserror::Error)]
pub enum PeerDmaError {
    #[error("p2p: {context}: DMA-mapping {peer}'s BAR{bar} +{offset:#x} at {guest_addr:#x} ({size:#x} bytes): {source}")]
    Map {
        context: String,
        peer: String,
        bar: u8,
        offset: u64,
        guest_addr: u64,
        size: u64,
        source: std::io::Error,
    },
    #[error("p2p: {context}: removing the DMA mapping of {peer}'s BAR{bar} +{offset:#x} at {guest_addr:#x}: {source}")]
    Unmap {
        context: String,
        peer: String,
        bar: u8,
        offset: u64,
        guest_addr: u64,
        source: std::io::Error,
    },
    #[error("p2p: cannot start the p2p-map thread: {0}")]
    Thread(std::io::Error),
    #[error("p2p: the p2p-map thread is gone; peer mappings no longer follow the BARs")]
    ThreadGone,
}

impl From<PeerDmaError> for PciSetupError {
    fn from(error: PeerDmaError) -> Self {
        PciSetupError::Device(VfioError::Io(std::io::Error::other(error.to_string())))
    }
}

/// A DMA context's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ContextId(u32);

/// A peer device's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerId(u32);

/// What the registry needs to know about a device's BARs before it is plugged.
pub struct PeerBars {
    name: String,
    /// False with `p2p=off`: its BARs are mapped for nobody.
    shares_bars: bool,
    /// The file behind each mmappable BAR and the BAR's offset in it.
    files: BTreeMap<u8, (OwnedFd, u64)>,
}

impl PeerBars {
    /// `files(index)` gives the file and offset of BAR `index`, if it can be mmapped.
    pub fn new(
        name: String,
        tuning: &PassthroughTuning,
        mut files: impl FnMut(u32) -> Option<(OwnedFd, u64)>,
    ) -> Self {
        let files = BAR_INDICES
            .filter_map(|bar| files(u32::from(bar)).map(|file| (bar, file)))
            .collect();
        if !tuning.p2p {
            log::info!("p2p: {name}: p2p=off, its BARs are not DMA-mapped for its peers");
        }
        PeerBars {
            name,
            shares_bars: tuning.p2p,
            files,
        }
    }
}

struct Context {
    name: String,
    /// None where the context cannot map peers' BARs (iommufd).
    mapper: Option<Arc<dyn PeerMapper>>,
    members: BTreeSet<PeerId>,
}

struct Peer {
    bars: PeerBars,
    context: ContextId,
    windows: Vec<BarWindow>,
}

/// One peer mapping: in which context, whose BAR part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct MappingKey {
    context: ContextId,
    peer: PeerId,
    bar: u8,
    offset: u64,
}

/// Where a peer mapping was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapped {
    guest_addr: u64,
    size: u64,
}

/// A peer mapping a live update hands over: in the context of `context_device` (a
/// vfio-user device's own), `peer_device`'s BAR part, where the old process mapped it.
/// Devices are named as [`PeerBars`] names them (the backend's name).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedOverPeerMapping {
    pub context_device: String,
    pub peer_device: String,
    pub bar: u8,
    pub offset: u64,
    pub guest_addr: u64,
    pub size: u64,
}

#[derive(Default)]
struct Registry {
    next_id: u32,
    contexts: BTreeMap<ContextId, Context>,
    peers: BTreeMap<PeerId, Peer>,
    mapped: BTreeMap<MappingKey, Mapped>,
    /// Contexts that cannot map peer BARs, and why (said once each).
    limits: Vec<String>,
    /// Mappings handed over by a live update's old process that no plugged device has
    /// claimed yet ([`Registry::claim_adopted`]).
    adopted: Vec<HandedOverPeerMapping>,
    /// How many handed-over mappings were claimed.
    claimed: usize,
}

impl Registry {
    fn next(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    /// The peer mappings the current placement asks for.
    fn wanted(&self) -> BTreeMap<MappingKey, DmaRegion> {
        let mut wanted = BTreeMap::new();
        for (&context, ctx) in &self.contexts {
            if ctx.mapper.is_none() {
                continue;
            }
            for (&peer, device) in &self.peers {
                // Only for the context's other devices: a context holding just this
                // device needs no mapping of its own BARs.
                if !device.bars.shares_bars || !ctx.members.iter().any(|&m| m != peer) {
                    continue;
                }
                for window in &device.windows {
                    let (Some(guest_addr), Some((file, base))) =
                        (window.guest_addr, device.bars.files.get(&window.bar))
                    else {
                        continue;
                    };
                    let key = MappingKey {
                        context,
                        peer,
                        bar: window.bar,
                        offset: window.offset,
                    };
                    wanted.insert(
                        key,
                        DmaRegion {
                            guest_addr,
                            size: window.size,
                            host_addr: window.host_addr,
                            fd: file.as_raw_fd(),
                            fd_offset: base + window.offset,
                        },
                    );
                }
            }
        }
        wanted
    }

    fn peer_named(&self, name: &str) -> Option<PeerId> {
        (self.peers.iter())
            .find(|(_, peer)| peer.bars.name == name)
            .map(|(&id, _)| id)
    }

    /// The key under which a handed-over mapping is made here, once its devices are
    /// plugged and its peer reports the BAR part where the old process had it mapped
    /// (until then the mapping is neither wanted nor stale).
    fn adopted_key(&self, record: &HandedOverPeerMapping) -> Option<MappingKey> {
        let peer = self.peer_named(&record.peer_device)?;
        let context = self
            .peers
            .get(&self.peer_named(&record.context_device)?)?
            .context;
        let placed = self.peers.get(&peer)?.windows.iter().any(|w| {
            w.bar == record.bar
                && w.offset == record.offset
                && w.guest_addr == Some(record.guest_addr)
                && w.size == record.size
        });
        placed.then_some(MappingKey {
            context,
            peer,
            bar: record.bar,
            offset: record.offset,
        })
    }

    /// Takes the handed-over mappings whose devices are here and placed as they were as
    /// made: the device has them already.
    fn claim_adopted(&mut self) {
        for record in std::mem::take(&mut self.adopted) {
            match self.adopted_key(&record) {
                Some(key) => {
                    self.mapped.insert(
                        key,
                        Mapped {
                            guest_addr: record.guest_addr,
                            size: record.size,
                        },
                    );
                    self.claimed += 1;
                }
                None => self.adopted.push(record),
            }
        }
    }

    fn peer_name(&self, peer: PeerId) -> String {
        self.peers
            .get(&peer)
            .map_or_else(|| "a removed device".into(), |p| p.bars.name.clone())
    }

    /// Brings the made mappings in line with the wanted ones: stale ones unmapped first,
    /// then the missing ones mapped. Returns what failed.
    fn reconcile(&mut self) -> Vec<PeerDmaError> {
        self.claim_adopted();
        let wanted = self.wanted();
        let mut errors = Vec::new();
        let stale: Vec<(MappingKey, Mapped)> = self
            .mapped
            .iter()
            .filter(|(key, made)| {
                wanted
                    .get(key)
                    .is_none_or(|w| w.guest_addr != made.guest_addr || w.size != made.size)
            })
            .map(|(key, made)| (*key, *made))
            .collect();
        for (key, made) in stale {
            // Forgotten whether or not the unmap worked: a failed unmap means the context
            // no longer has it (a device gone), and retrying would fail the same way.
            self.mapped.remove(&key);
            let Some(ctx) = self.contexts.get(&key.context) else {
                continue;
            };
            let Some(mapper) = &ctx.mapper else {
                continue;
            };
            match mapper.unmap_peer(made.guest_addr, made.size) {
                Ok(()) => log::info!(
                    "p2p: {}: {}'s BAR{} +{:#x} unmapped at {:#x}",
                    ctx.name,
                    self.peer_name(key.peer),
                    key.bar,
                    key.offset,
                    made.guest_addr
                ),
                Err(source) => errors.push(PeerDmaError::Unmap {
                    context: ctx.name.clone(),
                    peer: self.peer_name(key.peer),
                    bar: key.bar,
                    offset: key.offset,
                    guest_addr: made.guest_addr,
                    source,
                }),
            }
        }
        for (key, window) in wanted {
            if self.mapped.contains_key(&key) {
                continue;
            }
            let Some(ctx) = self.contexts.get(&key.context) else {
                continue;
            };
            let Some(mapper) = &ctx.mapper else {
                continue;
            };
            // SAFETY: the window is a peer's BAR mmap, which stays mapped until the peer's
            // VfioPciDevice is dropped; its drop reports the window unplaced first, and the
            // unmap above runs before the mmap goes.
            match unsafe { mapper.map_peer(&window) } {
                Ok(()) => {
                    log::info!(
                        "p2p: {}: {}'s BAR{} +{:#x} ({} MiB) mapped at {:#x}",
                        ctx.name,
                        self.peer_name(key.peer),
                        key.bar,
                        key.offset,
                        window.size >> 20,
                        window.guest_addr
                    );
                    self.mapped.insert(
                        key,
                        Mapped {
                            guest_addr: window.guest_addr,
                            size: window.size,
                        },
                    );
                }
                Err(source) => errors.push(PeerDmaError::Map {
                    context: ctx.name.clone(),
                    peer: self.peer_name(key.peer),
                    bar: key.bar,
                    offset: key.offset,
                    guest_addr: window.guest_addr,
                    size: window.size,
                    source,
                }),
            }
        }
        errors
    }
}

/// A change to the registry, run where mapping calls are allowed.
type Job = Box<dyn FnOnce(&mut Registry) -> Vec<PeerDmaError> + Send>;

/// The `p2p-map` thread: runs each job and answers when it is done.
struct Worker {
    jobs: mpsc::Sender<(Job, mpsc::Sender<Vec<PeerDmaError>>)>,
}

/// The VM's peer-to-peer DMA mappings.
pub struct PeerDma {
    registry: Arc<Mutex<Registry>>,
    /// None until a device needs it: jobs then run on the caller's thread (the tests).
    worker: Mutex<Option<Worker>>,
}

fn lock(registry: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    registry.lock().unwrap_or_else(|e| e.into_inner())
}

impl PeerDma {
    /// An empty registry; [`PeerDma::ensure_worker`] starts its thread.
    pub fn new() -> Arc<Self> {
        Arc::new(PeerDma {
            registry: Arc::new(Mutex::new(Registry::default())),
            worker: Mutex::new(None),
        })
    }

    /// Starts the `p2p-map` thread unless it runs already. `on_thread_start` installs the
    /// VMM's seccomp filter on it (the build's call); None where the caller's thread is
    /// under that filter already, which the new thread inherits (hot-plug).
    pub fn ensure_worker(
        &self,
        on_thread_start: Option<gpuvm_vfio::dma::ThreadStartHook>,
    ) -> Result<(), PeerDmaError> {
        let mut worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if worker.is_some() {
            return Ok(());
        }
        let (jobs, queue) = mpsc::channel::<(Job, mpsc::Sender<Vec<PeerDmaError>>)>();
        let registry = self.registry.clone();
        std::thread::Builder::new()
            .name("p2p-map".into())
            .spawn(move || {
                if let Some(hook) = on_thread_start {
                    if let Err(error) = hook() {
                        log::error!("p2p: cannot set up the p2p-map thread: {error}");
                        return;
                    }
                }
                for (job, done) in queue {
                    let errors = job(&mut lock(&registry));
                    let _ = done.send(errors);
                }
            })
            .map_err(PeerDmaError::Thread)?;
        *worker = Some(Worker { jobs });
        Ok(())
    }

    /// Runs `job` and logs what failed; returns the failures too.
    fn run(&self, job: Job) -> Vec<PeerDmaError> {
        let jobs = (self.worker.lock().unwrap_or_else(|e| e.into_inner()))
            .as_ref()
            .map(|worker| worker.jobs.clone());
        let errors = match jobs {
            None => job(&mut lock(&self.registry)),
            Some(jobs) => {
                let (done, answer) = mpsc::channel();
                let sent = jobs.send((job, done));
                match sent.ok().and_then(|()| answer.recv().ok()) {
                    Some(errors) => errors,
                    None => vec![PeerDmaError::ThreadGone],
                }
            }
        };
        for error in &errors {
            log::warn!("{error}");
        }
        errors
    }

    /// Adds a DMA context: `mapper`, or why it cannot map peers' BARs (said once, here;
    /// the VM goes on without peer mappings there).
    pub fn add_context(
        &self,
        name: String,
        mapper: Result<Arc<dyn PeerMapper>, PeerMappingUnsupported>,
    ) -> ContextId {
        let mut registry = lock(&self.registry);
        let id = ContextId(registry.next());
        let mapper = match mapper {
            Ok(mapper) => Some(mapper),
            Err(unsupported) => {
                log::warn!("p2p: {unsupported}; peer-to-peer DMA into its devices is off");
                registry.limits.push(unsupported.to_string());
                None
            }
        };
        registry.contexts.insert(
            id,
            Context {
                name,
                mapper,
                members: BTreeSet::new(),
            },
        );
        id
    }

    /// Adds a plugged device in `context`; its BARs are mapped for its peers (and theirs
    /// for it) as soon as the returned watch reports where the guest has them
    /// (`VfioPciDevice::watch_bar_placement`).
    pub fn add_device(
        self: &Arc<Self>,
        context: ContextId,
        bars: PeerBars,
    ) -> (PeerId, Arc<dyn BarPlacementWatch>) {
        let id = {
            let mut registry = lock(&self.registry);
            let id = PeerId(registry.next());
            if let Some(ctx) = registry.contexts.get_mut(&context) {
                ctx.members.insert(id);
            }
            registry.peers.insert(
                id,
                Peer {
                    bars,
                    context,
                    windows: Vec::new(),
                },
            );
            id
        };
        // Existing peers' BARs go into the new device's context now.
        self.run(Box::new(Registry::reconcile));
        let watch = Arc::new(PeerWatch {
            dma: Arc::downgrade(self),
            peer: id,
        });
        (id, watch)
    }

    /// Adds the plugged `device` in `context` and has it report its BAR placement from
    /// now on (its current placement at once).
    pub fn plugged(
        self: &Arc<Self>,
        context: ContextId,
        bars: PeerBars,
        device: &Mutex<VfioPciDevice>,
    ) -> PeerId {
        let (id, watch) = self.add_device(context, bars);
        device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .watch_bar_placement(watch);
        id
    }

    /// Removes a device (before it is dropped): its BARs are unmapped everywhere, and its
    /// context's mappings of the others too when it was the context's last device.
    pub fn remove_device(&self, peer: PeerId) -> Vec<PeerDmaError> {
        self.run(Box::new(move |registry: &mut Registry| {
            let Some(device) = registry.peers.remove(&peer) else {
                return Vec::new();
            };
            if let Some(ctx) = registry.contexts.get_mut(&device.context) {
                ctx.members.remove(&peer);
            }
            let errors = registry.reconcile();
            registry.contexts.retain(|_, ctx| !ctx.members.is_empty());
            errors
        }))
    }

    /// Where `peer`'s BAR windows are now.
    fn placed(&self, peer: PeerId, windows: Vec<BarWindow>) -> Vec<PeerDmaError> {
        self.run(Box::new(move |registry: &mut Registry| {
            match registry.peers.get_mut(&peer) {
                Some(device) if device.windows != windows => device.windows = windows,
                _ => return Vec::new(),
            }
            registry.reconcile()
        }))
    }

    /// The peer mappings made now, for a live update's new process: each in the context
    /// of its (first) device.
    pub fn handed_over(&self) -> Vec<HandedOverPeerMapping> {
        let registry = lock(&self.registry);
        let context_device = |context: &ContextId| {
            let ctx = registry.contexts.get(context)?;
            let first = ctx.members.iter().next()?;
            Some(registry.peers.get(first)?.bars.name.clone())
        };
        (registry.mapped.iter())
            .filter_map(|(key, made)| {
                Some(HandedOverPeerMapping {
                    context_device: context_device(&key.context)?,
                    peer_device: registry.peers.get(&key.peer)?.bars.name.clone(),
                    bar: key.bar,
                    offset: key.offset,
                    guest_addr: made.guest_addr,
                    size: made.size,
                })
            })
            .collect()
    }

    /// Whether the device named `name` shares its BARs with its peers (false when no
    /// such device is plugged).
    pub fn shares_bars(&self, name: &str) -> bool {
        let registry = lock(&self.registry);
        (registry.peers.values()).any(|peer| peer.bars.name == name && peer.bars.shares_bars)
    }

    /// A live update's new process, before it plugs the handed-over devices: the
    /// mappings the old process made, which the devices keep. Each is taken as made here
    /// once its devices are plugged and placed as they were; none is mapped again.
    pub fn adopt(&self, mappings: Vec<HandedOverPeerMapping>) {
        let mut registry = lock(&self.registry);
        registry.adopted.extend(mappings);
    }

    /// After the handed-over devices are plugged: a handed-over mapping no device claimed
    /// (its peer placed elsewhere than the old process had it mapped, which a restored
    /// PCI state should not allow) is removed from its context, so no stale mapping is
    /// left behind in a device. Says how many were taken over.
    pub fn finish_adoption(&self) -> Vec<PeerDmaError> {
        self.run(Box::new(|registry: &mut Registry| {
            registry.claim_adopted();
            let mut errors = Vec::new();
            for record in std::mem::take(&mut registry.adopted) {
                let context = (registry.peer_named(&record.context_device))
                    .and_then(|id| registry.peers.get(&id))
                    .and_then(|peer| registry.contexts.get(&peer.context));
                let Some(mapper) = context.and_then(|ctx| ctx.mapper.as_ref()) else {
                    log::warn!(
                        "p2p: a handed-over mapping of {}'s BAR{} at {:#x} has no context \
                         here ({} is not plugged); left as the old process made it",
                        record.peer_device,
                        record.bar,
                        record.guest_addr,
                        record.context_device
                    );
                    continue;
                };
                let name = mapper.name();
                match mapper.unmap_peer(record.guest_addr, record.size) {
                    Ok(()) => log::warn!(
                        "p2p: {name}: {}'s BAR{} +{:#x} was handed over mapped at {:#x}, where \
                         it no longer is: unmapped",
                        record.peer_device,
                        record.bar,
                        record.offset,
                        record.guest_addr
                    ),
                    Err(source) => errors.push(PeerDmaError::Unmap {
                        context: name,
                        peer: record.peer_device.clone(),
                        bar: record.bar,
                        offset: record.offset,
                        guest_addr: record.guest_addr,
                        source,
                    }),
                }
            }
            if registry.claimed > 0 {
                log::info!(
                    "p2p: {} peer mapping(s) taken over from the old process (none mapped again)",
                    registry.claimed
                );
            }
            errors.extend(registry.reconcile());
            errors
        }))
    }

    /// A live update's old process once the new one has the devices: the mappings are
    /// theirs now, so taking this VM's devices down unmaps nothing.
    pub fn handed_over_elsewhere(&self) {
        let mut registry = lock(&self.registry);
        registry.mapped.clear();
        registry
            .contexts
            .values_mut()
            .for_each(|ctx| ctx.mapper = None);
    }

    /// The contexts that cannot map peers' BARs, and why.
    pub fn limits(&self) -> Vec<String> {
        lock(&self.registry).limits.clone()
    }
}

/// A device's [`BarPlacementWatch`]: forwards its windows to the registry.
struct PeerWatch {
    dma: Weak<PeerDma>,
    peer: PeerId,
}

impl BarPlacementWatch for PeerWatch {
    fn placed(&self, windows: &[BarWindow]) {
        if let Some(dma) = self.dma.upgrade() {
            dma.placed(self.peer, windows.to_vec());
        }
    }

    /// The device leaves the registry while its context still works: its BARs leave its
    /// peers' contexts, and its context (when it was the last device there) drops its
    /// mappings of theirs now, not when a peer goes after its connection has closed.
    fn gone(&self, _windows: &[BarWindow]) {
        if let Some(dma) = self.dma.upgrade() {
            dma.remove_device(self.peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the mappings a context holds, as a vfio-user device or a container would.
    #[derive(Default)]
    struct FakeMapper {
        name: String,
        /// guest address -> (size, fd offset)
        held: Mutex<BTreeMap<u64, (u64, u64)>>,
        calls: Mutex<Vec<String>>,
    }

    impl FakeMapper {
        fn new(name: &str) -> Arc<Self> {
            Arc::new(FakeMapper {
                name: name.into(),
                ..Default::default()
            })
        }
        fn held(&self) -> Vec<u64> {
            self.held.lock().unwrap().keys().copied().collect()
        }
    }

    impl PeerMapper for FakeMapper {
        fn name(&self) -> String {
            self.name.clone()
        }
        unsafe fn map_peer(&self, window: &DmaRegion) -> std::io::Result<()> {
            let mut held = self.held.lock().unwrap();
            if held.contains_key(&window.guest_addr) {
                return Err(std::io::Error::from_raw_os_error(libc::EEXIST));
            }
            held.insert(window.guest_addr, (window.size, window.fd_offset));
            self.calls
                .lock()
                .unwrap()
                .push(format!("map {:#x}", window.guest_addr));
            Ok(())
        }
        fn unmap_peer(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
            let mut held = self.held.lock().unwrap();
            match held.get(&guest_addr) {
                Some((held_size, _)) if *held_size == size => {
                    held.remove(&guest_addr);
                    self.calls
                        .lock()
                        .unwrap()
                        .push(format!("unmap {guest_addr:#x}"));
                    Ok(())
                }
                _ => Err(std::io::Error::from_raw_os_error(libc::ENOENT)),
            }
        }
    }

    fn memfd() -> OwnedFd {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"p2p-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
    }

    /// A device with one mmappable BAR1 at file offset 0x1000.
    fn bars(name: &str, p2p: bool) -> PeerBars {
        let tuning = PassthroughTuning {
            p2p,
            ..Default::default()
        };
        PeerBars::new(name.into(), &tuning, |index| {
            (index == 1).then(|| (memfd(), 0x1000))
        })
    }

    fn bar1_at(guest_addr: Option<u64>) -> Vec<BarWindow> {
        vec![BarWindow {
            bar: 1,
            offset: 0,
            size: 1 << 20,
            host_addr: 0x7f00_0000_0000,
            guest_addr,
        }]
    }

    /// The registry, A's and B's contexts, their watches and their ids.
    type TwoDevices = (
        Arc<PeerDma>,
        [Arc<FakeMapper>; 2],
        [Arc<dyn BarPlacementWatch>; 2],
        [PeerId; 2],
    );

    /// Two vfio-user devices, each its own context.
    fn two_devices(b_shares: bool) -> TwoDevices {
        let dma = PeerDma::new();
        let (ma, mb) = (FakeMapper::new("A"), FakeMapper::new("B"));
        let ca = dma.add_context("A".into(), Ok(ma.clone()));
        let (a, wa) = dma.add_device(ca, bars("A", true));
        wa.placed(&bar1_at(Some(0x100_0000_0000)));
        let cb = dma.add_context("B".into(), Ok(mb.clone()));
        let (b, wb) = dma.add_device(cb, bars("B", b_shares));
        wb.placed(&bar1_at(Some(0x200_0000_0000)));
        (dma, [ma, mb], [wa, wb], [a, b])
    }

    /// A live update's new process over the same devices (`mappers`: they keep what the old
    /// process mapped): A and B plugged back, B's BAR1 placed at `b_at`, after adopting
    /// `handed_over`. Returns the registry and B's watch.
    fn adopted_by_a_new_process(
        mappers: &[Arc<FakeMapper>; 2],
        handed_over: Vec<HandedOverPeerMapping>,
        b_at: u64,
    ) -> (Arc<PeerDma>, Arc<dyn BarPlacementWatch>) {
        let dma = PeerDma::new();
        dma.adopt(handed_over);
        let ca = dma.add_context("A".into(), Ok(mappers[0].clone()));
        let (_, wa) = dma.add_device(ca, bars("A", true));
        wa.placed(&bar1_at(Some(0x100_0000_0000)));
        let cb = dma.add_context("B".into(), Ok(mappers[1].clone()));
        let (_, wb) = dma.add_device(cb, bars("B", true));
        wb.placed(&bar1_at(Some(b_at)));
        assert!(dma.finish_adoption().is_empty());
        (dma, wb)
    }

    /// A live update: the old process's table names each mapping by its devices; the new
    /// one takes them as made (the devices kept them: nothing is mapped again, which the
    /// fake device would refuse) and, when the guest moves B's BAR1 afterwards, unmaps
    /// the handed-over mapping at the old address before it maps the new one.
    #[test]
    fn handed_over_mappings_are_taken_as_made_and_follow_the_bar_after() {
        let (old, mappers, _, _) = two_devices(true);
        let handed_over = old.handed_over();
        assert_eq!(handed_over.len(), 2, "{handed_over:?}");
        let a_maps_b = (handed_over.iter())
            .find(|m| m.context_device == "A")
            .unwrap();
        assert_eq!(
            (
                a_maps_b.peer_device.as_str(),
                a_maps_b.bar,
                a_maps_b.guest_addr
            ),
            ("B", 1, 0x200_0000_0000)
        );
        drop(old);
        for mapper in &mappers {
            mapper.calls.lock().unwrap().clear();
        }
        let (_new, wb) = adopted_by_a_new_process(&mappers, handed_over, 0x200_0000_0000);
        for mapper in &mappers {
            assert!(mapper.calls.lock().unwrap().is_empty(), "{}", mapper.name);
        }
        wb.placed(&bar1_at(Some(0x300_0000_0000)));
        assert_eq!(
            *mappers[0].calls.lock().unwrap(),
            ["unmap 0x20000000000", "map 0x30000000000"]
        );
        assert_eq!(mappers[0].held(), [0x300_0000_0000]);
    }

    /// A handed-over mapping whose peer is not where the old process had it mapped is not
    /// left behind in the device: it is unmapped, and the mapping at the peer's place made.
    #[test]
    fn a_handed_over_mapping_of_a_bar_placed_elsewhere_is_unmapped() {
        let (old, mappers, _, _) = two_devices(true);
        let handed_over = old.handed_over();
        drop(old);
        let (_new, _) = adopted_by_a_new_process(&mappers, handed_over, 0x300_0000_0000);
        assert_eq!(mappers[0].held(), [0x300_0000_0000]);
        assert_eq!(mappers[1].held(), [0x100_0000_0000]);
    }

    /// The old process, once the new one has the devices, takes its own down without
    /// removing the mappings the devices keep for the new one.
    #[test]
    fn after_a_hand_over_taking_a_device_down_unmaps_nothing() {
        let (dma, mappers, _, [_, b]) = two_devices(true);
        dma.handed_over_elsewhere();
        assert!(dma.remove_device(b).is_empty());
        assert_eq!(mappers[0].held(), [0x200_0000_0000]);
        assert_eq!(mappers[1].held(), [0x100_0000_0000]);
    }

    #[test]
    fn each_device_gets_the_others_bars_at_their_guest_addresses() {
        let (_dma, [ma, mb], _, _) = two_devices(true);
        assert_eq!(ma.held(), [0x200_0000_0000], "B's BAR1 in A's context");
        assert_eq!(mb.held(), [0x100_0000_0000], "A's BAR1 in B's context");
        // The file offset is the region's in its file plus the window's.
        assert_eq!(ma.held.lock().unwrap()[&0x200_0000_0000], (1 << 20, 0x1000));
    }

    #[test]
    fn a_moved_bar_is_unmapped_at_the_old_address_then_mapped_at_the_new() {
        let (_dma, [ma, _mb], [_, wb], _) = two_devices(true);
        ma.calls.lock().unwrap().clear();
        wb.placed(&bar1_at(Some(0x300_0000_0000)));
        assert_eq!(ma.held(), [0x300_0000_0000]);
        assert_eq!(
            *ma.calls.lock().unwrap(),
            ["unmap 0x20000000000", "map 0x30000000000"]
        );
        // The same placement again changes nothing.
        wb.placed(&bar1_at(Some(0x300_0000_0000)));
        assert_eq!(ma.calls.lock().unwrap().len(), 2);
    }

    #[test]
    fn decoding_off_unmaps_and_on_maps_again() {
        let (_dma, [ma, _mb], [_, wb], _) = two_devices(true);
        wb.placed(&bar1_at(None));
        assert!(ma.held().is_empty());
        wb.placed(&bar1_at(Some(0x200_0000_0000)));
        assert_eq!(ma.held(), [0x200_0000_0000]);
    }

    #[test]
    fn p2p_off_keeps_a_devices_bars_out_but_it_still_sees_its_peers() {
        let (_dma, [ma, mb], _, _) = two_devices(false);
        assert!(ma.held().is_empty(), "B's BARs are not mapped for A");
        assert_eq!(mb.held(), [0x100_0000_0000], "A's BARs are mapped for B");
    }

    #[test]
    fn unplug_removes_the_devices_bars_everywhere_and_its_context() {
        let (dma, [ma, mb], [_, wb], [_, b]) = two_devices(true);
        assert!(dma.remove_device(b).is_empty());
        assert!(ma.held().is_empty(), "B's BAR gone from A's context");
        assert!(mb.held().is_empty(), "B's context emptied before it closes");
        assert!(lock(&dma.registry).contexts.len() == 1);
        // The dropped device's last report (all unplaced) is for a peer that is gone.
        wb.placed(&bar1_at(None));
        assert!(ma.held().is_empty());
    }

    #[test]
    fn a_hot_plugged_device_gets_the_peers_and_they_get_it() {
        let (dma, [ma, mb], _, _) = two_devices(true);
        let mc = FakeMapper::new("C");
        let cc = dma.add_context("C".into(), Ok(mc.clone()));
        let (_c, wc) = dma.add_device(cc, bars("C", true));
        assert_eq!(mc.held(), [0x100_0000_0000, 0x200_0000_0000]);
        wc.placed(&bar1_at(Some(0x400_0000_0000)));
        assert_eq!(ma.held(), [0x200_0000_0000, 0x400_0000_0000]);
        assert_eq!(mb.held(), [0x100_0000_0000, 0x400_0000_0000]);
    }

    /// One container for two kernel VFIO devices: each BAR mapped once, for the other.
    #[test]
    fn a_shared_context_maps_each_bar_once() {
        let dma = PeerDma::new();
        let container = FakeMapper::new("type1");
        let context = dma.add_context("type1".into(), Ok(container.clone()));
        let (_a, wa) = dma.add_device(context, bars("A", true));
        wa.placed(&bar1_at(Some(0x100_0000_0000)));
        assert!(container.held().is_empty(), "alone: nothing to map");
        let (b, wb) = dma.add_device(context, bars("B", true));
        wb.placed(&bar1_at(Some(0x200_0000_0000)));
        assert_eq!(container.held(), [0x100_0000_0000, 0x200_0000_0000]);
        dma.remove_device(b);
        assert!(container.held().is_empty(), "A alone again");
    }

    #[test]
    fn a_context_that_cannot_map_device_memory_is_said_once_and_skipped() {
        let dma = PeerDma::new();
        let context = dma.add_context(
            "iommufd".into(),
            Err(PeerMappingUnsupported {
                context: "kernel VFIO (iommufd IOAS)".into(),
                reason: "no PFNMAP".into(),
            }),
        );
        let mb = FakeMapper::new("B");
        let cb = dma.add_context("B".into(), Ok(mb.clone()));
        let (_a, wa) = dma.add_device(context, bars("A", true));
        let (_b, wb) = dma.add_device(cb, bars("B", true));
        wa.placed(&bar1_at(Some(0x100_0000_0000)));
        wb.placed(&bar1_at(Some(0x200_0000_0000)));
        assert_eq!(mb.held(), [0x100_0000_0000], "A's BAR still goes to B");
        assert_eq!(dma.limits().len(), 1);
        assert!(dma.limits()[0].contains("iommufd"), "{:?}", dma.limits());
    }

    #[test]
    fn a_failed_map_is_reported_and_retried_on_the_next_change() {
        let (dma, [ma, _mb], [_, wb], [_, b]) = two_devices(true);
        // Something else holds the address B moves to: the map fails with a clear error.
        // SAFETY: a fake mapper; nothing is mapped.
        unsafe {
            ma.map_peer(&DmaRegion {
                guest_addr: 0x300_0000_0000,
                size: 1 << 20,
                host_addr: 0,
                fd: -1,
                fd_offset: 0,
            })
        }
        .unwrap();
        let errors = dma.placed(b, bar1_at(Some(0x300_0000_0000)));
        assert_eq!(errors.len(), 1, "{errors:?}");
        let message = errors[0].to_string();
        assert!(message.contains("DMA-mapping B's BAR1"), "{message}");
        wb.placed(&bar1_at(Some(0x500_0000_0000)));
        assert!(ma.held().contains(&0x500_0000_0000));
    }
}
