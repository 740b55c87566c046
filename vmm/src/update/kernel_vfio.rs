//! Cold-plugged kernel VFIO devices (`--gpu BDF`, opened through iommufd) across a live
//! update: the device never stops and guest RAM is never unmapped or pinned again.
//!
//! The old process hands over its iommufd (whose IOAS holds every mapping and pin of guest
//! RAM) and each device's cdev (bound to that iommufd, attached to the IOAS), and, with the
//! paused state, each device's PCI state (as for a vfio-user device) and the RAM its
//! context has mapped. The new process builds its context and devices over those
//! descriptors ([`gpuvm_vfio::kernel::KernelVfio::adopt`]), adds the cdevs to its own KVM
//! VFIO pseudo-device and plugs each device back into its slot: no reset, no DMA map, no
//! attach. Its interrupts change as a vfio-user device's do: loading the PCI state arms
//! MSI/MSI-X (or INTx) with the new VM's eventfds (VFIO_DEVICE_SET_IRQS swaps the
//! triggers), and a failed update re-arms the old process's.
//!
//! Whichever process does not run the VM marks the devices handed over
//! ([`gpuvm_vfio::kernel::HandOverMark`]): its teardown then neither resets them nor
//! detaches them from the IOAS (which vfio-ioctls' drop would do to the shared cdev).
//! The container/group API is refused with the reason (see gpuvm_vfio::kernel).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use gpuvm_vfio::dma::DmaMapper;
use gpuvm_vfio::kernel::{HandOverMark, KernelVfio};
use gpuvm_vfio::DmaRegion;

use super::handed_over::{
    HandedOverKernelContext, HandedOverKernelVfio, OfferedKernelVfio, PassthroughHandOver,
    PluggedKernelContext, PluggedKernelVfio,
};
use super::passthrough::{plug_back, AlreadyMapped, SavedPlace};
use super::UpdateError;
use crate::lock;
use crate::p2p::PeerBars;

/// Why the VM's cold-plugged kernel VFIO devices cannot be handed over now, if they cannot.
pub(super) fn refusal(handover: &PassthroughHandOver) -> Option<String> {
    let context = handover.kernel.as_ref()?;
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
        if device.bdf.segment != 0 || device.bdf.bus != 0 {
            return Some(format!(
                "{} sits at {} (behind a bridge or on another PCI segment); only devices on \
                 bus 0 of segment 0 are handed over",
                device.host_bdf, device.bdf
            ));
        }
    }
    None
}

/// The offer's part: the context's IOAS and devices, and their descriptors (the iommufd,
/// then each device's cdev). None without kernel VFIO devices.
pub(super) fn offer(
    handover: &PassthroughHandOver,
) -> Result<(Option<OfferedKernelVfio>, Vec<OwnedFd>), UpdateError> {
    let Some(context) = &handover.kernel else {
        return Ok((None, Vec::new()));
    };
    let duplicate = |fd: &OwnedFd, what: &str| {
        fd.try_clone()
            .map_err(|e| UpdateError::Save(format!("cannot duplicate {what}: {e}")))
    };
    let (iommufd, ioas_id) =
        (context.hand_over.as_ref()).map_err(|e| UpdateError::Save(e.clone()))?;
    let mut fds = vec![duplicate(iommufd, "the iommufd")?];
    for device in &context.devices {
        let cdev = (device.cdev.as_ref()).map_err(|e| UpdateError::Save(e.clone()))?;
        fds.push(duplicate(cdev, &format!("{}'s cdev", device.host_bdf))?);
    }
    let offered = OfferedKernelVfio {
        ioas_id: *ioas_id,
        devices: (context.devices.iter())
            .map(|d| d.host_bdf.clone())
            .collect(),
    };
    Ok((Some(offered), fds))
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
                slot: plugged.bdf.device,
                vendor_id,
                device_id,
                pci,
                intx_gsi: device.intx_gsi(),
                p2p: shares_bars(&plugged.host_bdf),
            })
        })
        .collect::<Result<Vec<_>, UpdateError>>()?;
    Ok(Some(HandedOverKernelContext {
        dma_mapped: (ram.iter())
            .map(|r| (r.guest_addr, r.size, r.fd_offset))
            .collect(),
        devices,
    }))
}

/// The new process has the devices: this one leaves them alone from now on.
pub(super) fn release(handover: &PassthroughHandOver, to_pid: u32) {
    for device in handover.kernel.iter().flat_map(|c| &c.devices) {
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

/// The kernel VFIO devices from the offer, until they are plugged: the iommufd and the
/// cdevs, and their marks (provisional: left alone here unless this process commits).
pub struct IncomingKernelVfio {
    pub offered: OfferedKernelVfio,
    iommufd: OwnedFd,
    cdevs: Vec<OwnedFd>,
    pub marks: Vec<Arc<HandOverMark>>,
}

impl IncomingKernelVfio {
    pub fn new(offered: OfferedKernelVfio, iommufd: OwnedFd, cdevs: Vec<OwnedFd>) -> Self {
        let marks = (cdevs.iter())
            .map(|_| {
                let mark = Arc::new(HandOverMark::default());
                mark.mark_provisional();
                mark
            })
            .collect();
        IncomingKernelVfio {
            offered,
            iommufd,
            cdevs,
            marks,
        }
    }
}

/// Plugs the handed-over kernel VFIO devices (`saved`, from the paused state, `incoming`,
/// from the offer) back into their slots of segment 0 over the old process's iommufd and
/// cdevs: no reset, no DMA map, the saved PCI state loaded. Runs with the old process's
/// vCPUs paused.
pub(crate) fn plug_handed_over(
    vm: &kvm_ioctls::VmFd,
    ram: &gpuvm_memory::GuestRam,
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
    let hosts: Vec<&str> = (saved.devices.iter())
        .map(|d| d.host_bdf.as_str())
        .collect();
    if hosts != incoming.offered.devices || incoming.cdevs.len() != hosts.len() {
        return Err(format!(
            "the state has kernel VFIO devices {hosts:?}, the offer {:?}",
            incoming.offered.devices
        ));
    }
    let kvm_vfio = crate::pci::create_kvm_vfio_device(vm).map_err(|e| e.to_string())?;
    let vfio = KernelVfio::adopt(
        incoming.iommufd,
        incoming.offered.ioas_id,
        Some(Arc::new(kvm_vfio)),
    )
    .map_err(|e| e.to_string())?;
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
    let pairs = saved.devices.iter().zip(incoming.cdevs).zip(incoming.marks);
    for ((device, cdev), mark) in pairs {
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
            path: None,
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
            "live update: kernel VFIO {} at {bdf} taken over from the old process (no reset, \
             no DMA map, no attach; interrupts on this VM's eventfds)",
            device.host_bdf
        );
        plugged.push(PluggedKernelVfio {
            host_bdf: device.host_bdf.clone(),
            bdf,
            device: pci_device,
            cdev,
            mark,
        });
    }
    let mapping = chunks
        .start(
            progress.clone(),
            mapper,
            crate::dma::DmaTestHooks::default(),
        )
        .map_err(|e| format!("cannot account for the kernel VFIO DMA mappings: {e}"))?;
    devices.dma_mappings.push(mapping);
    devices.handover.kernel = Some(PluggedKernelContext {
        hand_over: vfio.hand_over(),
        dma: progress,
        devices: plugged,
    });
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
