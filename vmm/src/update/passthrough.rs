//! Cold-plugged vfio-user devices (`--vfio-user`, the emulated GPU) across a live update:
//! the GPU never stops.
//!
//! The old process hands over the device's connection (its socket, SCM_RIGHTS, with the
//! other descriptors of the offer), what its client learnt when it connected (the region
//! layout and region files: [`gpuvm_vfio::user_handover`]) and, with the paused state, the
//! PCI state gpuvm emulates for it (`VfioPciDevice`'s `Persist`: BAR placement, MSI-X
//! table, INTx wiring) and the guest RAM ranges it has DMA-mapped. The layout is handed
//! over rather than queried again: the crate's client can only learn it by connecting, and
//! a new connection is exactly what the device must not see.
//!
//! The new process's client takes the connection over while the guest still runs (that
//! sends nothing to the device), but plugs the device back into its slot only once the old
//! one has paused the vCPUs (before that, the old process speaks on the connection for the
//! guest),
//! without a reset and without a DMA map: the device keeps its own mmaps of the RAM memfd,
//! which the new process maps too. Its interrupts are the one thing that changes: loading
//! the PCI state enables MSI-X (and wires INTx) with the new process's irqfd eventfds, so
//! the device gets SET_IRQS with those. Sending SET_IRQS rather than handing the old
//! eventfds over keeps the new VM's interrupt routing exactly as a restore builds it
//! (each eventfd is registered by the VM's MSI router as it allocates the GSI); the price
//! is one request to the device, while the vCPUs are paused. If the update fails after
//! that, the old process gives the device its own eventfds back before it resumes
//! ([`rearm`]).
//!
//! Whichever process does not run the VM marks the connection handed over: it never speaks
//! on it again, and its teardown neither resets the device nor shuts the connection down.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use gpuvm_devices::Persist;
use gpuvm_vfio::dma::DmaMapper;
use gpuvm_vfio::pci::VfioPciDevice;
use gpuvm_vfio::user::{BackendHealth, VfioUserDevice};
use gpuvm_vfio::{DmaRegion, PassthroughDevice};

pub use super::handed_over::{
    HandedOverVfioUser, OfferedVfioUser, PassthroughHandOver, PlugParts, PluggedVfioUser,
};
use super::UpdateError;
use crate::lock;
use crate::p2p::PeerBars;

/// Why the VM's cold-plugged vfio-user devices cannot be handed over now, if they cannot.
pub(super) fn refusal(handover: &PassthroughHandOver) -> Option<String> {
    for plugged in &handover.vfio_user {
        let name = plugged.connection.name();
        if let Some(reason) = plugged.connection.refusal() {
            return Some(format!("{name}: {reason}"));
        }
        if !plugged.dma.is_done() {
            return Some(format!(
                "{name}: guest RAM is still being DMA-mapped for it; retry once it is"
            ));
        }
        let behind_ports = (handover.plug.as_ref()).and_then(|parts| parts.path_of(plugged.bdf));
        if plugged.bdf.bus != 0 && behind_ports.is_none() {
            return Some(format!(
                "{name} sits at {} behind a bridge that is not a port of gpuvm's PCIe topology",
                plugged.bdf
            ));
        }
    }
    None
}

/// The offer's part: each device's socket and layout, and its descriptors (connection,
/// then region files), in device order.
pub(super) fn offer(
    handover: &PassthroughHandOver,
) -> Result<(Vec<OfferedVfioUser>, Vec<OwnedFd>), UpdateError> {
    let mut offered = Vec::new();
    let mut fds = Vec::new();
    for plugged in &handover.vfio_user {
        let (layout, socket, files) = plugged
            .connection
            .hand_over()
            .map_err(|e| UpdateError::Save(format!("{}: {e}", plugged.connection.name())))?;
        fds.push(socket);
        fds.extend(files);
        offered.push(OfferedVfioUser {
            socket: plugged.socket.clone(),
            layout,
        });
    }
    Ok((offered, fds))
}

/// Each device's PCI state, saved as a snapshot saves a restored device's, with the guest
/// RAM it has mapped (`ram`: the VM's RAM as DMA regions).
pub(super) fn save(
    handover: &PassthroughHandOver,
    ram: &[DmaRegion],
) -> Result<Vec<HandedOverVfioUser>, UpdateError> {
    handover
        .vfio_user
        .iter()
        .map(|plugged| {
            // Behind the ports of a host-mirroring layout: its path through them.
            let path = (handover.plug.as_ref()).and_then(|parts| parts.path_of(plugged.bdf));
            let place = (plugged.socket.clone(), plugged.bdf, path);
            HandedOverVfioUser::of(&lock(&plugged.device), place, ram, None)
                .map_err(UpdateError::Save)
        })
        .collect()
}

/// A live update failed after the new process may have given the devices its interrupt
/// eventfds: gives them this process's again (before the vCPUs run).
pub(super) fn rearm(handover: &PassthroughHandOver) {
    let kernel = super::kernel_vfio::devices(handover).map(|plugged| &plugged.device);
    for device in handover.vfio_user.iter().map(|p| &p.device).chain(kernel) {
        let mut device = lock(device);
        match device.rearm_interrupts() {
            Ok(()) => log::info!(
                "{}: interrupts re-armed with this process's eventfds",
                device.name()
            ),
            Err(error) => log::error!(
                "{}: cannot give the device this process's interrupts back: {error}",
                device.name()
            ),
        }
    }
}

/// The new process has the devices: this one never speaks on their connections again.
pub(super) fn release(handover: &PassthroughHandOver, to_pid: u32) {
    for plugged in &handover.vfio_user {
        plugged
            .connection
            .release(&format!("gpuvm process {to_pid}"));
    }
    // Nor does it remove the peer mappings the devices keep for the new process.
    if let Some(parts) = &handover.plug {
        parts.peers.handed_over_elsewhere();
    }
}

/// A handed-over device from the offer, until it is plugged: its descriptors, then the
/// client that took its connection over.
pub struct IncomingVfioUser {
    pub offered: OfferedVfioUser,
    /// The connection and the region files, until [`IncomingVfioUser::take_over`].
    descriptors: Option<(OwnedFd, Vec<OwnedFd>)>,
    backend: Option<VfioUserDevice>,
    /// Shared with the device: marked handed over (back to the old process) if this
    /// process does not run the VM.
    pub health: Arc<BackendHealth>,
}

impl IncomingVfioUser {
    /// The device of `offered` over `connection`, provisionally this process's: until
    /// the old process commits, dropping it leaves the device as it is.
    pub fn new(offered: OfferedVfioUser, connection: OwnedFd, files: Vec<OwnedFd>) -> Self {
        let health = Arc::new(BackendHealth::default());
        health.mark_provisional();
        IncomingVfioUser {
            offered,
            descriptors: Some((connection, files)),
            backend: None,
            health,
        }
    }

    /// Gives the connection a client here. Nothing reaches the device (the client learns
    /// the layout from the offer), so this runs while the old process still runs the
    /// guest, outside the pause.
    pub fn take_over(&mut self) -> Result<(), String> {
        let (connection, files) = self
            .descriptors
            .take()
            .ok_or("its connection was taken over already")?;
        let backend = VfioUserDevice::adopt(
            &self.offered.socket,
            connection,
            &self.offered.layout,
            &files,
            gpuvm_vfio::user::answer_timeout(),
            self.health.clone(),
        )
        .map_err(|e| format!("{}: {e}", self.offered.socket.display()))?;
        self.backend = Some(backend);
        Ok(())
    }

    /// The client that took the connection over ([`IncomingVfioUser::take_over`]).
    pub(crate) fn into_backend(self) -> Result<VfioUserDevice, String> {
        self.backend
            .ok_or_else(|| "its connection was not taken over".to_string())
    }
}

/// Maps nothing that the device has mapped already (the old process's table): only RAM
/// outside it goes to the device.
pub(crate) struct AlreadyMapped {
    inner: Arc<dyn DmaMapper>,
    mapped: Vec<(u64, u64, u64)>,
}

impl AlreadyMapped {
    /// `inner`, skipping the RAM of `mapped` (guest address, size, offset in the RAM file).
    pub(crate) fn new(inner: Arc<dyn DmaMapper>, mapped: Vec<(u64, u64, u64)>) -> Self {
        AlreadyMapped { inner, mapped }
    }

    fn covers(&self, chunk: &DmaRegion) -> bool {
        self.mapped.iter().any(|&(guest, size, offset)| {
            chunk.guest_addr >= guest
                && chunk.guest_addr + chunk.size <= guest + size
                && chunk.fd_offset == offset + (chunk.guest_addr - guest)
        })
    }
}

impl DmaMapper for AlreadyMapped {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn max_parallel(&self) -> usize {
        self.inner.max_parallel()
    }

    unsafe fn map(&self, chunk: &DmaRegion) -> std::io::Result<()> {
        if self.covers(chunk) {
            return Ok(());
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.inner.map(chunk) }
    }

    fn unmap(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        self.inner.unmap(guest_addr, size)
    }
}

/// Plugs the handed-over devices (`saved`, from the paused state, and `incoming`, from the
/// offer, in the same order) back into their slots of `devices`' segment 0, over the
/// connections the old process used: no reset, no DMA map, the saved PCI state loaded
/// (which gives the device this VM's interrupt eventfds). Hot-plugged GPUs go back to PCI
/// hot-plug (crate::hotplug::PciHotplug::adopt_handed_over), which can eject them later.
/// Each joins the VM's peers again; the `peer_mappings` the old process made between them
/// are taken as made (the devices keep them), none mapped again ([`finish_peer_adoption`]
/// once the kernel VFIO devices are plugged too).
/// Runs with the old process's vCPUs paused, before this VM's root leaves its restore mode.
pub(crate) fn plug_handed_over(
    vm: &kvm_ioctls::VmFd,
    ram: &gpuvm_memory::GuestRam,
    devices: &mut crate::devices::MachineDevices,
    (saved, peer_mappings): (&[HandedOverVfioUser], &[crate::p2p::HandedOverPeerMapping]),
    incoming: Vec<IncomingVfioUser>,
) -> Result<(), String> {
    if saved.len() != incoming.len() {
        return Err(format!(
            "the state has {} vfio-user devices, the offer {}",
            saved.len(),
            incoming.len()
        ));
    }
    let peers = (devices.handover.plug.as_ref()).map(|parts| parts.peers.clone());
    if let Some(peers) = &peers {
        peers.adopt(peer_mappings.to_vec());
    }
    for (saved, incoming) in saved.iter().zip(incoming) {
        let plugged = match &saved.hot_plugged {
            None => plug_one(vm, ram, devices, saved, incoming),
            Some(hot) => adopt_hot_plugged(devices, saved, hot, incoming),
        };
        plugged.map_err(|reason| format!("{}: {reason}", saved.socket.display()))?;
    }
    Ok(())
}

/// After every handed-over device is plugged (vfio-user and kernel VFIO: a type1 context's
/// peer mappings are claimed by its devices too): the peer mappings no device claimed are
/// removed ([`crate::p2p::PeerDma::finish_adoption`]).
pub(crate) fn finish_peer_adoption(devices: &crate::devices::MachineDevices) {
    if let Some(parts) = &devices.handover.plug {
        // Errors are logged: a stale mapping left in a device is not worth the VM.
        parts.peers.finish_adoption();
    }
}

/// The device over a handed-over backend (a vfio-user connection, a kernel VFIO cdev), as
/// the old process left it (no reset): built with its vectors from `router`, checked to be
/// the model `ids` (vendor, device) the old process had, its BARs mapped into the guest
/// through `slots` and its Bus Master held until `progress` is done. Returns it with its
/// vectors' GSIs; on an error they are released.
pub(crate) fn take_over(
    backend: Box<dyn PassthroughDevice>,
    router: &Arc<crate::interrupts::MsiRouter>,
    slots: &Arc<dyn gpuvm_devices::pci::GuestMemoryMapper>,
    progress: &Arc<gpuvm_vfio::dma::DmaProgress>,
    ids: (u16, u16),
) -> Result<(VfioPciDevice, Vec<u32>), String> {
    let mut gsis = Vec::new();
    let built = {
        let mut allocate = |count| {
            let vectors = router.allocate(count)?;
            gsis.extend(vectors.iter().map(|(gsi, _)| *gsi));
            Ok(vectors)
        };
        VfioPciDevice::over_running(backend, &mut allocate, router.clone())
    };
    let checked = built
        .map_err(|e| format!("cannot take the device over: {e}"))
        .and_then(|mut device| {
            if device.pci_ids() != ids {
                let (vendor, model) = device.pci_ids();
                return Err(format!(
                    "the device is a {vendor:04x}:{model:04x}; the old process had a {:04x}:{:04x}",
                    ids.0, ids.1
                ));
            }
            device
                .map_bars(slots.clone())
                .map_err(|e| format!("cannot map its BARs: {e}"))?;
            device.gate_bus_master(
                progress.clone(),
                crate::dma::bus_master_wait_limit(progress.total_bytes()),
            );
            Ok(device)
        });
    match checked {
        Ok(device) => Ok((device, gsis)),
        Err(error) => {
            router.release(&gsis);
            Err(error)
        }
    }
}

/// Checks that the connection the offer brought at `saved`'s place is `saved`'s device's.
fn same_socket(incoming: &IncomingVfioUser, saved: &HandedOverVfioUser) -> Result<(), String> {
    if incoming.offered.socket == saved.socket {
        Ok(())
    } else {
        Err(format!(
            "the offer brings the connection of {}",
            incoming.offered.socket.display()
        ))
    }
}

/// A hot-plugged GPU back into PCI hot-plug, in its slot (or its root port's).
fn adopt_hot_plugged(
    devices: &mut crate::devices::MachineDevices,
    saved: &HandedOverVfioUser,
    hot: &super::handed_over::HotPluggedGpu,
    incoming: IncomingVfioUser,
) -> Result<(), String> {
    same_socket(&incoming, saved)?;
    let hotplug = (devices.pci_hotplug.as_mut()).ok_or("this VM has no PCI hot-plug")?;
    let label = hotplug.adopt_handed_over(saved, hot, incoming.into_backend()?)?;
    devices.passthrough.push(label);
    Ok(())
}

fn plug_one(
    vm: &kvm_ioctls::VmFd,
    ram: &gpuvm_memory::GuestRam,
    devices: &mut crate::devices::MachineDevices,
    saved: &HandedOverVfioUser,
    incoming: IncomingVfioUser,
) -> Result<(), String> {
    same_socket(&incoming, saved)?;
    let backend = incoming
        .backend
        .ok_or("its connection was not taken over")?;
    let connection = backend.connection();
    let tuning = crate::config::PassthroughTuning {
        p2p: saved.p2p,
        ..Default::default()
    };
    let bars = PeerBars::new(backend.name(), &tuning, |i| backend.region_file(i));
    let peer_mapper = backend.peer_mapper();
    let chunks = crate::dma::RamChunks::new(ram);
    let mapper: Arc<dyn DmaMapper> = Arc::new(AlreadyMapped {
        inner: backend.dma_mapper(),
        mapped: saved.dma_mapped.clone(),
    });
    let progress = chunks.progress(mapper.name());
    let place = SavedPlace {
        segment: saved.segment,
        slot: saved.slot,
        path: saved.path.as_deref(),
        ids: (saved.vendor_id, saved.device_id),
        pci: &saved.pci,
        intx_gsi: saved.intx_gsi,
    };
    let (device, bdf) = plug_back(vm, devices, Box::new(backend), &place, &progress)?;
    let mapping = chunks
        .start(
            progress.clone(),
            mapper,
            crate::dma::DmaTestHooks::default(),
        )
        .map_err(|e| format!("cannot account for its DMA mappings: {e}"))?;
    devices.dma_mappings.push(mapping);
    let parts = (devices.handover.plug.as_ref()).ok_or("this VM has no PCI bus")?;
    match parts
        .peers
        .ensure_worker(crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm))
    {
        Ok(()) => {
            let context = parts.peers.add_context(peer_mapper.name(), Ok(peer_mapper));
            parts.peers.plugged(context, bars, &device);
        }
        Err(error) => log::warn!("{bdf}: {error}; no peer-to-peer DMA mappings for it"),
    }
    log::info!(
        "live update: {} {} taken over from the old process (no reset, no DMA map; \
         interrupts on this VM's eventfds)",
        bdf.shown(),
        lock(&device).name()
    );
    devices.handover.vfio_user.push(PluggedVfioUser {
        socket: saved.socket.clone(),
        bdf,
        device,
        connection,
        dma: progress,
    });
    Ok(())
}

/// Where and how a handed-over device was plugged in the old process.
pub(crate) struct SavedPlace<'a> {
    /// Its PCI segment.
    pub segment: u16,
    /// Its slot on the segment's bus 0.
    pub slot: u8,
    /// Or its path from the segment's bus 0 behind the ports of a host-mirroring layout.
    pub path: Option<&'a [u8]>,
    /// (vendor, device) as the old process saw them.
    pub ids: (u16, u16),
    pub pci: &'a gpuvm_vfio::pci::VfioPciState,
    pub intx_gsi: Option<u32>,
}

/// Plugs a handed-over `backend` back into its place (segment, slot or path) as `place` says: taken
/// over without a reset ([`take_over`]), INTx wired, the saved PCI state loaded (which
/// gives the device this VM's interrupt eventfds). Its Bus Master waits for `progress`.
/// Listed among the VM's passthrough devices. Returns the device and where it is.
pub(crate) fn plug_back(
    vm: &kvm_ioctls::VmFd,
    devices: &mut crate::devices::MachineDevices,
    backend: Box<dyn PassthroughDevice>,
    place: &SavedPlace<'_>,
    progress: &Arc<gpuvm_vfio::dma::DmaProgress>,
) -> Result<(Arc<Mutex<VfioPciDevice>>, gpuvm_devices::pci::PciBdf), String> {
    let parts = (devices.handover.plug.as_ref()).ok_or("this VM has no PCI bus")?;
    let root = parts.root_of(place.segment).ok_or_else(|| {
        format!(
            "its PCI segment {} is not among the VM's {}",
            place.segment,
            parts.segments.len() + 1
        )
    })?;
    let (device, gsis) = take_over(backend, &parts.router, &parts.slots, progress, place.ids)?;
    let name = device.name().to_string();
    let device = Arc::new(Mutex::new(device));
    let as_pci: Arc<Mutex<dyn gpuvm_devices::pci::PciDevice>> = device.clone();
    // Its BARs where the guest had them (behind ports: inside their windows, rebuilt
    // before); its own restored state says whether they decode.
    let added = match place.path {
        Some(path) => (root.add_behind(path, as_pci, &place.pci.bars, false))
            .map_err(|e| format!("cannot plug it back at {path:?} (path from bus 0): {e}")),
        None => (root.add_device_at(place.slot, as_pci, &place.pci.bars))
            .map_err(|e| format!("cannot plug it back into slot {:#04x}: {e}", place.slot)),
    };
    let bdf = added.inspect_err(|_| parts.router.release(&gsis))?;
    let plug = crate::pci::Plug {
        vm,
        root,
        router: &parts.router,
        slots: &parts.slots,
    };
    let unplug = |error: String| {
        root.remove_device(bdf);
        parts.router.release(&gsis);
        error
    };
    // The PCI state before INTx: a device running with MSI or MSI-X keeps them (its
    // triggers swapped for this VM's), and INTx is armed only where the guest uses it (a
    // kernel VFIO device refuses an INTx trigger while its MSI is on).
    lock(&device)
        .restore(place.pci)
        .map_err(|e| unplug(format!("its PCI state does not fit: {e}")))?;
    if let Some(gsi) = place.intx_gsi {
        match plug.intx(&device, gsi) {
            Ok(Some(resample)) => devices.event_sources.push(resample),
            Ok(None) => {}
            Err(error) => return Err(unplug(format!("cannot wire its INTx: {error}"))),
        }
        lock(&device).restore_intx_line(place.pci);
    }
    devices.passthrough.push(format!("{} {name}", bdf.shown()));
    Ok((device, bdf))
}
