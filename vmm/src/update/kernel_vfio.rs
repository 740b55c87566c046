//! Kernel VFIO devices (cold-plugged with `--gpu BDF`, through iommufd or a type1
//! container; hot-plugged ones each in a context of their own, crate::hotplug's hand-over
//! using the per-context functions here) across a live update: the device never stops and
//! guest RAM is never unmapped or pinned again.
//!
//! iommufd: the old process hands over its iommufd (whose IOAS holds every mapping and pin
//! of guest RAM) and each device's cdev (bound to that iommufd, attached to the IOAS).
//! type1: the container (holding every mapping and pin), each group's file and each
//! device's file; once its vCPUs are paused the old process invalidates the mappings' host
//! addresses and the new one gives its own (gpuvm_vfio::type1; a failed update gives the
//! old ones back). With the paused state go each device's PCI state (as for a vfio-user
//! device) and the RAM its context has mapped. The new process builds its context and
//! devices over those descriptors ([`gpuvm_vfio::kernel::KernelVfio::adopt`],
//! [`gpuvm_vfio::kernel::KernelVfio::adopt_container`]), adds the cdevs or groups to its
//! own KVM VFIO pseudo-device and plugs each device back into its slot: no reset, no DMA
//! map, no attach. Its interrupts change as a vfio-user device's do: loading the PCI state arms
//! MSI/MSI-X (or INTx) with the new VM's eventfds (VFIO_DEVICE_SET_IRQS swaps the
//! triggers), and a failed update re-arms the old process's.
//!
//! Whichever process does not run the VM marks the devices handed over
//! ([`gpuvm_vfio::kernel::HandOverMark`]): its teardown then neither resets them nor
//! detaches them from the IOAS or group (which vfio-ioctls' drop would do to the shared
//! file).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;

use gpuvm_vfio::dma::DmaMapper;
use gpuvm_vfio::kernel::{ContextHandOver, HandOverMark, KernelVfio};
use gpuvm_vfio::DmaRegion;

use super::handed_over::{
    HandedOverKernelContext, HandedOverKernelVfio, OfferedKernelVfio, PassthroughHandOver,
    PluggedKernelContext, PluggedKernelVfio,
};
use super::passthrough::{plug_back, AlreadyMapped, SavedPlace};
use super::UpdateError;
use crate::lock;
use crate::p2p::PeerBars;
use gpuvm_devices::pci::PciBdf;

/// Why the VM's cold-plugged kernel VFIO devices cannot be handed over now, if they cannot.
pub(super) fn refusal(handover: &PassthroughHandOver) -> Option<String> {
    let context = handover.kernel.as_ref()?;
    context_refusal(context, &|device| {
        if device.bdf.bus != 0 && path_behind_ports(handover, device.bdf).is_none() {
            return Some(format!(
                "{} sits at {} behind a bridge that is not a port of gpuvm's PCIe topology",
                device.host_bdf, device.bdf
            ));
        }
        None
    })
}

/// Why the kernel VFIO `context` (the cold-plugged devices', or a hot-plugged device's own)
/// cannot be handed over now, if it cannot; `placed` says why a device's place cannot.
pub(crate) fn context_refusal(
    context: &PluggedKernelContext,
    placed: &dyn Fn(&PluggedKernelVfio) -> Option<String>,
) -> Option<String> {
    let names = || {
        (context.devices.iter())
            .map(|d| d.host_bdf.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Err(reason) = &context.hand_over {
        return Some(format!("kernel VFIO devices ({}): {reason}", names()));
    }
    if !context.dma.is_done() {
        return Some(format!(
            "kernel VFIO devices ({}): guest RAM is still being DMA-mapped for them; retry \
             once it is",
            names()
        ));
    }
    if let Some(reason) = context_container(context)
        .and_then(|container| gpuvm_vfio::type1::vaddr_update_refusal(container.as_fd()))
    {
        return Some(format!("kernel VFIO devices ({}): {reason}", names()));
    }
    if context.devices.len() > super::protocol::MAX_KERNEL_VFIO_DEVICES {
        return Some(format!(
            "{} kernel VFIO devices: at most {} are handed over",
            context.devices.len(),
            super::protocol::MAX_KERNEL_VFIO_DEVICES
        ));
    }
    for device in &context.devices {
        if let Err(reason) = &device.cdev {
            return Some(format!(
                "{}: no descriptor to hand over: {reason}",
                device.host_bdf
            ));
        }
        if let Some(reason) = placed(device) {
            return Some(reason);
        }
    }
    None
}

/// The offer's part: the context's IOAS or container and devices, and their descriptors
/// (the iommufd, or the container and each group's file; then each device's file). None
/// without kernel VFIO devices.
pub(super) fn offer(
    handover: &PassthroughHandOver,
) -> Result<(Option<OfferedKernelVfio>, Vec<OwnedFd>), UpdateError> {
    let Some(context) = &handover.kernel else {
        return Ok((None, Vec::new()));
    };
    let (offered, fds) = offer_context(context)?;
    Ok((Some(offered), fds))
}

/// The offer's part of one kernel VFIO context: its IOAS or container and devices, and
/// their descriptors (as [`offer`] says).
pub(crate) fn offer_context(
    context: &PluggedKernelContext,
) -> Result<(OfferedKernelVfio, Vec<OwnedFd>), UpdateError> {
    let duplicate = |fd: &OwnedFd, what: &str| {
        fd.try_clone()
            .map_err(|e| UpdateError::Save(format!("cannot duplicate {what}: {e}")))
    };
    let hosts: Vec<&str> = (context.devices.iter())
        .map(|d| d.host_bdf.as_str())
        .collect();
    let (mut fds, ioas_id, type1_groups) = match (context.hand_over.as_ref())
        .map_err(|e| UpdateError::Save(e.clone()))?
    {
        ContextHandOver::Iommufd { iommufd, ioas_id } => {
            (vec![duplicate(iommufd, "the iommufd")?], *ioas_id, None)
        }
        ContextHandOver::Container { container } => {
            let groups = gpuvm_vfio::type1::group_files(&hosts)
                .map_err(|e| UpdateError::Save(format!("the type1 devices' group files: {e}")))?;
            let (ids, files): (Vec<u32>, Vec<OwnedFd>) = groups.into_iter().unzip();
            let mut fds = vec![duplicate(container, "the type1 container")?];
            fds.extend(files);
            (fds, 0, Some(ids))
        }
    };
    for device in &context.devices {
        let file = (device.cdev.as_ref()).map_err(|e| UpdateError::Save(e.clone()))?;
        fds.push(duplicate(
            file,
            &format!("{}'s device file", device.host_bdf),
        )?);
    }
    let offered = OfferedKernelVfio {
        ioas_id,
        devices: hosts.iter().map(|h| h.to_string()).collect(),
        type1_groups,
    };
    Ok((offered, fds))
}

/// `mappings` (IOVA, size) at this process's addresses of the same guest RAM (`ram`: boot
/// and hot-plugged RAM as this process maps it).
fn own_mappings(mappings: &[(u64, u64)], ram: &[DmaRegion]) -> Result<Vec<DmaRegion>, String> {
    gpuvm_vfio::type1::own_chunks(mappings, ram).map_err(|e| format!("kernel VFIO (type1): {e}"))
}

/// The path from its segment's bus 0 through the VM's PCIe ports (`--pci-topology host`)
/// of the device at `bdf`; None on bus 0.
fn path_behind_ports(handover: &PassthroughHandOver, bdf: PciBdf) -> Option<Vec<u8>> {
    (handover.plug.as_ref()).and_then(|parts| parts.path_of(bdf))
}

/// The type1 container of the context, if that is what it is.
fn context_container(context: &PluggedKernelContext) -> Option<&OwnedFd> {
    match context.hand_over.as_ref().ok()? {
        ContextHandOver::Container { container } => Some(container),
        ContextHandOver::Iommufd { .. } => None,
    }
}

/// With the vCPUs paused: a type1 context's mappings of guest RAM, boot and hot-plugged
/// (`ram`: where this process maps it), lose their host addresses here, for the new
/// process to give its own; they are returned for the paused state. Nothing for iommufd
/// or without kernel VFIO.
pub(super) fn move_addresses_away(
    handover: &PassthroughHandOver,
    ram: &[DmaRegion],
) -> Result<Vec<(u64, u64)>, UpdateError> {
    match &handover.kernel {
        Some(context) => move_context_addresses_away(context, ram),
        None => Ok(Vec::new()),
    }
}

/// [`move_addresses_away`] for one kernel VFIO context.
pub(crate) fn move_context_addresses_away(
    context: &PluggedKernelContext,
    ram: &[DmaRegion],
) -> Result<Vec<(u64, u64)>, UpdateError> {
    let Some(container) = context_container(context) else {
        return Ok(Vec::new());
    };
    let mappings = context.ram_mappings();
    let own = own_mappings(&mappings, ram).map_err(UpdateError::Save)?;
    gpuvm_vfio::type1::invalidate_vaddr(container.as_fd(), &mappings, &own)
        .map_err(|e| UpdateError::Save(format!("kernel VFIO (type1): {e}")))?;
    context.addresses_away.store(true, Ordering::Release);
    log::info!(
        "kernel VFIO (type1): {} DMA mappings' host addresses invalidated for the new process \
         (VFIO_DMA_UNMAP_FLAG_VADDR; the device's DMA goes on)",
        mappings.len()
    );
    Ok(mappings)
}

/// After a failed update: a type1 context's mappings take this process's host addresses
/// again (the new process may have given its own already).
pub(super) fn take_addresses_back(handover: &PassthroughHandOver, ram: &[DmaRegion]) {
    if let Some(context) = &handover.kernel {
        take_context_addresses_back(context, ram);
    }
}

/// [`take_addresses_back`] for one kernel VFIO context.
pub(crate) fn take_context_addresses_back(context: &PluggedKernelContext, ram: &[DmaRegion]) {
    let Some(container) = context_container(context) else {
        return;
    };
    if !context.addresses_away.swap(false, Ordering::AcqRel) {
        return;
    }
    let mappings = context.ram_mappings();
    let restored = own_mappings(&mappings, ram).and_then(|own| {
        gpuvm_vfio::type1::restore_vaddr(container.as_fd(), &own).map_err(|e| e.to_string())
    });
    match restored {
        Ok(()) => log::info!(
            "kernel VFIO (type1): {} DMA mappings back on this process's addresses",
            mappings.len()
        ),
        Err(error) => log::error!(
            "kernel VFIO (type1): the DMA mappings cannot take this process's addresses back \
             ({error}): the device's DMA goes on, but the kernel cannot pin through them again"
        ),
    }
}

/// Each device's PCI state and the RAM the context has mapped (`ram`: the VM's RAM as DMA
/// regions, all mapped once the context's mapping is done, which the refusal checked).
pub(super) fn save(
    handover: &PassthroughHandOver,
    ram: &[DmaRegion],
) -> Result<Option<HandedOverKernelContext>, UpdateError> {
    let Some(context) = &handover.kernel else {
        return Ok(None);
    };
    let shares_bars = |host_bdf: &str| {
        (handover.plug.as_ref()).is_some_and(|parts| parts.peers.shares_bars(host_bdf))
    };
    let path = |device: &PluggedKernelVfio| path_behind_ports(handover, device.bdf);
    save_context(context, ram, &path, &shares_bars).map(Some)
}

/// [`save`] for one kernel VFIO context: `path` gives a device's path behind the VM's
/// PCIe ports, `shares_bars` whether it shares its BARs with its peers.
pub(crate) fn save_context(
    context: &PluggedKernelContext,
    ram: &[DmaRegion],
    path: &dyn Fn(&PluggedKernelVfio) -> Option<Vec<u8>>,
    shares_bars: &dyn Fn(&str) -> bool,
) -> Result<HandedOverKernelContext, UpdateError> {
    let devices = (context.devices.iter())
        .map(|plugged| {
            use gpuvm_devices::Persist;
            let device = lock(&plugged.device);
            let pci = device
                .save()
                .map_err(|e| UpdateError::Save(format!("{}: {e}", plugged.host_bdf)))?;
            let (vendor_id, device_id) = device.pci_ids();
            Ok(HandedOverKernelVfio {
                host_bdf: plugged.host_bdf.clone(),
                segment: plugged.bdf.segment,
                slot: plugged.bdf.device,
                path: path(plugged),
                vendor_id,
                device_id,
                pci,
                intx_gsi: device.intx_gsi(),
                p2p: shares_bars(&plugged.host_bdf),
            })
        })
        .collect::<Result<Vec<_>, UpdateError>>()?;
    Ok(HandedOverKernelContext {
        dma_mapped: (ram.iter())
            .map(|r| (r.guest_addr, r.size, r.fd_offset))
            .collect(),
        type1_vaddr: Vec::new(),
        devices,
    })
}

/// The new process has the devices: this one leaves them alone from now on.
pub(super) fn release(handover: &PassthroughHandOver, to_pid: u32) {
    if let Some(context) = &handover.kernel {
        release_context(context, to_pid);
    }
}

/// [`release`] for one kernel VFIO context.
pub(crate) fn release_context(context: &PluggedKernelContext, to_pid: u32) {
    for device in &context.devices {
        device.mark.mark_handed_over();
        log::info!(
            "kernel VFIO: {} is run by gpuvm process {to_pid} now",
            device.host_bdf
        );
    }
}

/// The devices whose interrupts a failed update gives back ([`super::passthrough::rearm`]).
pub(super) fn devices(handover: &PassthroughHandOver) -> impl Iterator<Item = &PluggedKernelVfio> {
    handover.kernel.iter().flat_map(|context| &context.devices)
}

/// The kernel VFIO devices from the offer, until they are plugged: the iommufd or the
/// type1 container (`context`) and groups, the device files (`cdevs`), and their marks
/// (provisional: left alone here unless this process commits).
pub struct IncomingKernelVfio {
    pub offered: OfferedKernelVfio,
    context: OwnedFd,
    groups: Vec<OwnedFd>,
    cdevs: Vec<OwnedFd>,
    pub marks: Vec<Arc<HandOverMark>>,
}

/// A handed-over type1 context's mappings (`type1_vaddr`, as the old process made them)
/// take this process's host addresses (`all_ram`: boot and hot-plugged RAM here).
/// Nothing for iommufd.
pub(crate) fn take_type1_mappings(
    vfio: &KernelVfio,
    type1_vaddr: &[(u64, u64)],
    all_ram: &[DmaRegion],
) -> Result<(), String> {
    let Some(container) = vfio.container() else {
        return Ok(());
    };
    let own = own_mappings(type1_vaddr, all_ram)?;
    let moved = gpuvm_vfio::type1::set_vaddr(container, &own)
        .map_err(|e| format!("kernel VFIO (type1): {e}"))?;
    log::info!(
        "kernel VFIO (type1): {moved} DMA mappings now use this process's addresses \
         (VFIO_DMA_MAP_FLAG_VADDR; nothing unmapped or pinned again)"
    );
    Ok(())
}

/// A handed-over device's file and its mark, as [`IncomingKernelVfio::adopt`] gives them.
pub(crate) type AdoptedDeviceFile = (OwnedFd, Arc<HandOverMark>);

impl IncomingKernelVfio {
    /// The context the old process handed over, rebuilt here over its iommufd or its type1
    /// container and groups (which join this VM's KVM VFIO device), and each device's
    /// file and mark, in `saved`'s order (checked against the offer).
    pub(crate) fn adopt(
        self,
        (vm, kvm_vfio): (&kvm_ioctls::VmFd, &crate::pci::SharedKvmVfio),
        saved: &HandedOverKernelContext,
    ) -> Result<(KernelVfio, Vec<AdoptedDeviceFile>), String> {
        let hosts: Vec<&str> = (saved.devices.iter())
            .map(|d| d.host_bdf.as_str())
            .collect();
        if hosts != self.offered.devices || self.cdevs.len() != hosts.len() {
            return Err(format!(
                "the state has kernel VFIO devices {hosts:?}, the offer {:?}",
                self.offered.devices
            ));
        }
        let vfio = match &self.offered.type1_groups {
            None => {
                let kvm_vfio = kvm_vfio.get(vm).map_err(|e| e.to_string())?;
                KernelVfio::adopt(self.context, self.offered.ioas_id, Some(kvm_vfio))
                    .map_err(|e| e.to_string())?
            }
            Some(ids) => {
                let kvm_vfio = kvm_vfio.with_groups(vm, &self.groups)?;
                let groups = ids.iter().copied().zip(self.groups).collect();
                KernelVfio::adopt_container(self.context, groups, kvm_vfio)
            }
        };
        Ok((vfio, self.cdevs.into_iter().zip(self.marks).collect()))
    }

    pub fn new(
        offered: OfferedKernelVfio,
        context: OwnedFd,
        groups: Vec<OwnedFd>,
        cdevs: Vec<OwnedFd>,
    ) -> Self {
        let marks = (cdevs.iter())
            .map(|_| {
                let mark = Arc::new(HandOverMark::default());
                mark.mark_provisional();
                mark
            })
            .collect();
        IncomingKernelVfio {
            offered,
            context,
            groups,
            cdevs,
            marks,
        }
    }
}

/// Plugs the handed-over kernel VFIO devices (`saved`, from the paused state, `incoming`,
/// from the offer) back into their places on segment 0 (bus 0, or behind the VM's PCIe
/// ports, rebuilt before) over the old process's iommufd and cdevs: no reset, no DMA map, the saved PCI state loaded. `ram` is boot RAM, `all_ram`
/// boot and hot-plugged RAM as DMA regions at this process's addresses. Runs with the old
/// process's vCPUs paused.
pub(crate) fn plug_handed_over(
    vm: &kvm_ioctls::VmFd,
    (ram, all_ram): (&gpuvm_memory::GuestRam, &[DmaRegion]),
    devices: &mut crate::devices::MachineDevices,
    saved: Option<&HandedOverKernelContext>,
    incoming: Option<IncomingKernelVfio>,
) -> Result<(), String> {
    let (saved, incoming) = match (saved, incoming) {
        (None, None) => return Ok(()),
        (Some(saved), Some(incoming)) => (saved, incoming),
        (saved, _) => {
            return Err(format!(
                "the state {} kernel VFIO devices and the offer {}",
                if saved.is_some() { "has" } else { "has no" },
                if saved.is_some() {
                    "none"
                } else {
                    "brings some"
                }
            ))
        }
    };
    let kvm_vfio = (devices.handover.plug.as_ref())
        .map(|parts| parts.kvm_vfio.clone())
        .ok_or("this VM has no PCI bus")?;
    let (vfio, handles) = incoming.adopt((vm, &kvm_vfio), saved)?;
    let chunks = crate::dma::RamChunks::new(ram);
    let mapper: Arc<dyn DmaMapper> = Arc::new(AlreadyMapped::new(
        vfio.dma_mapper(),
        saved.dma_mapped.clone(),
    ));
    let progress = chunks.progress(mapper.name());
    // Peers' mappings follow BAR moves on the p2p-map thread, never on a vCPU's.
    let peers = (devices.handover.plug.as_ref())
        .map(|parts| parts.peers.clone())
        .filter(|peers| {
            let thread = crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm);
            peers
                .ensure_worker(thread)
                .inspect_err(|e| log::warn!("kernel VFIO: {e}; no peer-to-peer DMA mappings"))
                .is_ok()
        });
    let context = peers
        .as_ref()
        .map(|peers| peers.add_context(progress.name().to_string(), vfio.peer_mapper()));
    let mut plugged = Vec::new();
    for (device, (cdev, mark)) in saved.devices.iter().zip(handles) {
        let backend = vfio
            .adopt_device(cdev, &device.host_bdf, mark.clone())
            .map_err(|e| format!("{}: {e}", device.host_bdf))?;
        let cdev = backend.hand_over().map_err(|e| e.to_string());
        let tuning = crate::config::PassthroughTuning {
            p2p: device.p2p,
            ..Default::default()
        };
        let bars = PeerBars::new(device.host_bdf.clone(), &tuning, |i| backend.region_file(i));
        let place = SavedPlace {
            segment: device.segment,
            path: device.path.as_deref(),
            slot: device.slot,
            ids: (device.vendor_id, device.device_id),
            pci: &device.pci,
            intx_gsi: device.intx_gsi,
        };
        let (pci_device, bdf) = plug_back(vm, devices, Box::new(backend), &place, &progress)
            .map_err(|e| format!("{}: {e}", device.host_bdf))?;
        if let (Some(peers), Some(context)) = (&peers, context) {
            peers.plugged(context, bars, &pci_device);
        }
        log::info!(
            "live update: kernel VFIO {} at {} taken over from the old process (no reset, \
             no DMA map, no attach; interrupts on this VM's eventfds)",
            device.host_bdf,
            bdf.shown()
        );
        plugged.push(PluggedKernelVfio {
            host_bdf: device.host_bdf.clone(),
            bdf,
            device: pci_device,
            cdev,
            mark,
        });
    }
    take_type1_mappings(&vfio, &saved.type1_vaddr, all_ram)?;
    let mapping = chunks
        .start(
            progress.clone(),
            mapper,
            crate::dma::DmaTestHooks::default(),
        )
        .map_err(|e| format!("cannot account for the kernel VFIO DMA mappings: {e}"))?;
    devices.dma_mappings.push(mapping);
    // The type1 mappings the old process made and moved here (none for iommufd, whose
    // mappings have no host address to move).
    devices.handover.kernel = Some(PluggedKernelContext::new(
        vfio.hand_over(),
        saved.type1_vaddr.clone(),
        progress,
        plugged,
    ));
    Ok(())
}

/// Plugs the hot-plugged kernel VFIO devices the old process handed over (`saved`, from
/// the paused state, `incoming`, from the offer, in the same order) back into their
/// hot-plug slots, each over its own context (`all_ram`: boot and hot-plugged RAM here):
/// no reset, no DMA map. They stay hot-plugged devices, which DELETE /gpus/{id} ejects.
pub(crate) fn plug_hot_handed_over(
    devices: &mut crate::devices::MachineDevices,
    all_ram: &[DmaRegion],
    saved: &[super::handed_over::HandedOverHotKernelVfio],
    incoming: Vec<IncomingKernelVfio>,
) -> Result<(), String> {
    if saved.len() != incoming.len() {
        return Err(format!(
            "the state has {} hot-plugged kernel VFIO devices, the offer {}",
            saved.len(),
            incoming.len()
        ));
    }
    if saved.is_empty() {
        return Ok(());
    }
    let hotplug = (devices.pci_hotplug.as_mut())
        .ok_or("the state has hot-plugged kernel VFIO devices and this VM no PCI hot-plug")?;
    for (saved, incoming) in saved.iter().zip(incoming) {
        hotplug.adopt_handed_over_kernel(saved, incoming, all_ram)?;
    }
    Ok(())
}

/// Whether `label` (an entry of `MachineDevices::passthrough`) is a cold-plugged kernel
/// VFIO device the hand-over carries.
pub(super) fn carries(handover: &PassthroughHandOver, label: &str) -> bool {
    devices(handover).any(|device| label.ends_with(&device.host_bdf))
        && handover
            .kernel
            .as_ref()
            .is_some_and(|c| c.hand_over.is_ok())
}
