//! Hot-plugged vfio-user GPUs across a live update, handed over as the cold-plugged ones
//! are (crate::update::passthrough): the connection goes over as it is, with the layout
//! its client learnt, the PCI state gpuvm emulates for the device and the guest RAM it has
//! DMA-mapped. The new process plugs the device back into its hot-plug slot (bus 0's ACPI
//! slot, or its root port's) without a reset or a DMA map, loads the PCI state (which
//! gives the device that process's MSI-X eventfds) and keeps it a hot-plugged device:
//! DELETE /gpus/{id} ejects it there, and it is a peer of the GPUs plugged after.
//!
//! Hot-plugged kernel VFIO devices go over the same way, each with its own context (an
//! iommufd or a type1 container holding that one device) handed over as the cold-plugged
//! context is (crate::update::kernel_vfio): the new process adopts the context and the
//! device's file, moves the type1 mappings' host addresses to its own, and plugs the
//! device back into its hot-plug slot.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::PciBdf;
use gpuvm_devices::Persist;
use gpuvm_vfio::dma::DmaMapper;
use gpuvm_vfio::pci::VfioPciDevice;
use gpuvm_vfio::user::{UserConnection, VfioUserDevice};
use gpuvm_vfio::{DmaRegion, PassthroughDevice};

use super::{HotDevice, PciHotplug};
use crate::lock;
use crate::p2p::PeerBars;
use crate::update::handed_over::{
    HandedOverHotKernelVfio, HandedOverVfioUser, HotPluggedGpu, OfferedKernelVfio, OfferedVfioUser,
    PluggedKernelContext, PluggedKernelVfio,
};
use crate::update::kernel_vfio;
use crate::update::passthrough::AlreadyMapped;
use crate::update::UpdateError;

impl PciHotplug {
    /// The hot-plugged vfio-user GPUs (by id) and their connections.
    fn vfio_user_devices(&self) -> impl Iterator<Item = (&str, &HotDevice, &UserConnection)> {
        (self.devices.iter())
            .filter_map(|(id, hot)| Some((id.as_str(), hot, hot.connection.as_ref()?)))
    }

    /// The hot-plugged kernel VFIO devices (by id) and their own contexts.
    fn kernel_devices(&self) -> impl Iterator<Item = (&str, &HotDevice, &PluggedKernelContext)> {
        (self.devices.iter()).filter_map(|(id, hot)| Some((id.as_str(), hot, hot.kernel.as_ref()?)))
    }

    /// The hot-plugged kernel VFIO devices' own contexts (memory hot-plug notes the RAM it
    /// maps in them).
    pub(crate) fn kernel_contexts(&self) -> impl Iterator<Item = &PluggedKernelContext> {
        self.kernel_devices().map(|(_, _, context)| context)
    }

    /// Why a hot-plugged GPU cannot be handed over now, the first such one.
    pub(crate) fn handover_refusal(&self) -> Option<String> {
        let kernel = self.kernel_devices().count();
        if kernel > crate::update::protocol::MAX_HOT_KERNEL_VFIO_DEVICES {
            return Some(format!(
                "{kernel} hot-plugged kernel VFIO devices: at most {} are handed over",
                crate::update::protocol::MAX_HOT_KERNEL_VFIO_DEVICES
            ));
        }
        for (id, hot, context) in self.kernel_devices() {
            let reason = self
                .place_refusal(id, hot)
                .or_else(|| kernel_vfio::context_refusal(context, &|_| None));
            if let Some(reason) = reason {
                return Some(format!("hot-plugged {id} ({}): {reason}", hot.label));
            }
        }
        for (id, hot, connection) in self.vfio_user_devices() {
            let reason = if hot.gone.is_some() {
                Some("its device process is gone".to_string())
            } else if let Some(reason) = self.place_refusal(id, hot) {
                Some(reason)
            } else if let Some(reason) = connection.refusal() {
                Some(reason)
            } else if !(hot.mapping.as_ref()).is_some_and(|m| m.progress().is_done()) {
                Some("guest RAM is still being DMA-mapped for it; retry once it is".to_string())
            } else {
                None
            };
            if let Some(reason) = reason {
                return Some(format!("hot-plugged {id} ({}): {reason}", hot.label));
            }
        }
        None
    }

    /// Why hot-plugged device `id` cannot be handed over as it stands (being ejected, not
    /// running yet) or where it sits, if it cannot.
    fn place_refusal(&self, id: &str, hot: &HotDevice) -> Option<String> {
        if hot.ejecting {
            Some("it is being hot-unplugged; retry once it is gone".to_string())
        } else if hot.stopped || hot.held_for_dma.load(std::sync::atomic::Ordering::Acquire) {
            Some("it was restored and does not run yet; retry once it runs".to_string())
        } else if hot.bdf.bus != 0 && !self.port_of.contains_key(id) {
            // Neither in an ACPI slot nor in a root port for hot-plug: behind the ports
            // of a host-mirroring layout (crate::pci_topology).
            Some(format!(
                "it sits at {} behind the VM's PCIe ports; only GPUs on bus 0 or in a root \
                 port for hot-plug are handed over",
                hot.bdf
            ))
        } else {
            None
        }
    }

    /// The offer's part for the hot-plugged kernel VFIO devices: each one's own context
    /// and its descriptors (as a cold-plugged context's), in id order.
    pub(crate) fn handover_offer_kernel(
        &self,
    ) -> Result<(Vec<OfferedKernelVfio>, Vec<OwnedFd>), UpdateError> {
        let mut offered = Vec::new();
        let mut fds = Vec::new();
        for (_, _, context) in self.kernel_devices() {
            let (offer, files) = kernel_vfio::offer_context(context)?;
            offered.push(offer);
            fds.extend(files);
        }
        Ok((offered, fds))
    }

    /// The paused state's part for the hot-plugged kernel VFIO devices, in the offer's
    /// order: each context's device and mapped RAM (`ram`: the VM's RAM as DMA regions,
    /// hot-plugged RAM included), and what makes it a hot-plugged GPU again.
    pub(crate) fn handover_save_kernel(
        &self,
        ram: &[DmaRegion],
    ) -> Result<Vec<HandedOverHotKernelVfio>, UpdateError> {
        let shares_bars = |name: &str| self.peers.shares_bars(name);
        (self.kernel_devices())
            .map(|(id, hot, context)| {
                let context = kernel_vfio::save_context(context, ram, &|_| None, &shares_bars)?;
                let port = (self.port_of.get(id)).and_then(|&i| self.ports.get(i));
                Ok(HandedOverHotKernelVfio {
                    context,
                    hot: HotPluggedGpu {
                        source: hot.source.clone(),
                        port: port.map(|port| port.slot),
                    },
                })
            })
            .collect()
    }

    /// With the vCPUs paused: each hot-plugged type1 context's mappings lose this
    /// process's host addresses (`ram`: where it maps guest RAM), recorded in `saved` (its
    /// entries matched by id) for the new process to give its own.
    pub(crate) fn handover_move_addresses_away(
        &self,
        saved: &mut [HandedOverHotKernelVfio],
        ram: &[DmaRegion],
    ) -> Result<(), UpdateError> {
        for (id, _, context) in self.kernel_devices() {
            let entry = (saved.iter_mut())
                .find(|entry| entry.hot.source.gpu_id == id)
                .ok_or_else(|| {
                    UpdateError::Save(format!("hot-plugged {id} is not in the state"))
                })?;
            entry.context.type1_vaddr = kernel_vfio::move_context_addresses_away(context, ram)?;
        }
        Ok(())
    }

    /// After a failed update: the hot-plugged type1 contexts' mappings take this process's
    /// host addresses again.
    pub(crate) fn handover_take_addresses_back(&self, ram: &[DmaRegion]) {
        for (_, _, context) in self.kernel_devices() {
            kernel_vfio::take_context_addresses_back(context, ram);
        }
    }

    /// The new process runs the hot-plugged kernel VFIO devices: this one leaves them
    /// alone from now on.
    pub(crate) fn handover_release_kernel(&self, to_pid: u32) {
        for (_, _, context) in self.kernel_devices() {
            kernel_vfio::release_context(context, to_pid);
        }
    }

    /// The offer's part: each hot-plugged GPU's socket and layout, and its descriptors
    /// (connection, then region files), in id order.
    pub(crate) fn handover_offer(&self) -> Result<(Vec<OfferedVfioUser>, Vec<OwnedFd>), String> {
        let mut offered = Vec::new();
        let mut fds = Vec::new();
        for (id, hot, connection) in self.vfio_user_devices() {
            let socket = (hot.source.vfio_user_socket.clone())
                .ok_or_else(|| format!("hot-plugged {id}: no vfio-user socket"))?;
            let (layout, connection, files) = connection
                .hand_over()
                .map_err(|e| format!("hot-plugged {id}: {e}"))?;
            fds.push(connection);
            fds.extend(files);
            offered.push(OfferedVfioUser { socket, layout });
        }
        Ok((offered, fds))
    }

    /// Each hot-plugged GPU's PCI state and place, in the offer's order, with the guest
    /// RAM it has mapped (`ram`: the VM's RAM as DMA regions, hot-plugged RAM included).
    pub(crate) fn handover_save(
        &self,
        ram: &[DmaRegion],
    ) -> Result<Vec<HandedOverVfioUser>, String> {
        let port_slot = |id: &str| Some(self.ports.get(*self.port_of.get(id)?)?.slot);
        self.vfio_user_devices()
            .map(|(id, hot, _)| {
                let socket = (hot.source.vfio_user_socket.clone())
                    .ok_or_else(|| format!("hot-plugged {id}: no vfio-user socket"))?;
                let hot_plugged = HotPluggedGpu {
                    source: hot.source.clone(),
                    port: port_slot(id),
                };
                HandedOverVfioUser::of(
                    &lock(&hot.device),
                    (socket, hot.bdf, None),
                    ram,
                    Some(hot_plugged),
                )
                .map_err(|e| format!("hot-plugged {id}: {e}"))
            })
            .collect()
    }

    /// A live update failed after the new process may have given the hot-plugged GPUs its
    /// interrupt eventfds: gives them this process's again (before the vCPUs run).
    pub(crate) fn handover_rearm(&self) {
        let vfio_user = self.vfio_user_devices().map(|(id, hot, _)| (id, hot));
        let kernel = self.kernel_devices().map(|(id, hot, _)| (id, hot));
        for (id, hot) in vfio_user.chain(kernel) {
            match lock(&hot.device).rearm_interrupts() {
                Ok(()) => log::info!("{id}: interrupts re-armed with this process's eventfds"),
                Err(error) => log::error!(
                    "{id}: cannot give the device this process's interrupts back: {error}"
                ),
            }
        }
    }

    /// The new process has the hot-plugged GPUs: this one never speaks on their
    /// connections again (nor resets them or closes the connections as its VM goes).
    pub(crate) fn handover_release(&self, to: &str) {
        for (_, _, connection) in self.vfio_user_devices() {
            connection.release(to);
        }
    }

    /// Plugs a hot-plugged GPU the old process handed over (`saved`, `hot`) back into its
    /// slot over `backend`, the client that took its connection over: no reset, no DMA map
    /// (`saved.dma_mapped` is mapped already), its PCI state loaded. It is a hot-plugged
    /// device from then on. Returns its "BDF name" label.
    pub(crate) fn adopt_handed_over(
        &mut self,
        saved: &HandedOverVfioUser,
        hot: &HotPluggedGpu,
        backend: VfioUserDevice,
    ) -> Result<String, String> {
        let health = backend.health();
        if let Some(wake) = self.wake.as_ref().and_then(|w| w.try_clone().ok()) {
            health.set_wake(wake);
        }
        let watch = backend.watch_hang_up();
        let connection = backend.connection();
        let bars = PeerBars::new(backend.name(), &hot.source.tuning(), |i| {
            backend.region_file(i)
        });
        let peer = (Ok(backend.peer_mapper()), bars);
        let mapper: Arc<dyn DmaMapper> = Arc::new(AlreadyMapped::new(
            backend.dma_mapper(),
            saved.dma_mapped.clone(),
        ));
        let place = SavedHotPlace {
            segment: saved.segment,
            slot: saved.slot,
            ids: (saved.vendor_id, saved.device_id),
            pci: &saved.pci,
            intx_gsi: saved.intx_gsi,
        };
        let kept = Kept {
            health: Some(health),
            watch,
            vfio: None,
            connection: Some(connection),
        };
        self.adopt(
            hot,
            place,
            (Box::new(backend), mapper, peer),
            kept,
            |_, _, _| None,
        )
    }

    /// Plugs a hot-plugged kernel VFIO device the old process handed over (`saved`; its
    /// context's descriptors in `incoming`) back into its slot over its own context: no
    /// reset, no DMA map, its type1 mappings given this process's addresses (`all_ram`:
    /// boot and hot-plugged RAM here), its PCI state loaded. It is a hot-plugged device
    /// from then on, which a later update hands over again. Returns its label.
    pub(crate) fn adopt_handed_over_kernel(
        &mut self,
        saved: &HandedOverHotKernelVfio,
        incoming: crate::update::kernel_vfio::IncomingKernelVfio,
        all_ram: &[DmaRegion],
    ) -> Result<String, String> {
        let id = &saved.hot.source.gpu_id;
        let [device] = saved.context.devices.as_slice() else {
            return Err(format!(
                "{id}: a hot-plugged kernel VFIO context holds one device, the state {}",
                saved.context.devices.len()
            ));
        };
        let (vfio, handles) = incoming.adopt((&self.vm, &self.kvm_vfio), &saved.context)?;
        let Some((file, mark)) = handles.into_iter().next() else {
            return Err(format!("{id}: the offer brings no device file"));
        };
        let backend = (vfio.adopt_device(file, &device.host_bdf, mark.clone()))
            .map_err(|e| format!("{id} ({}): {e}", device.host_bdf))?;
        let cdev = backend.hand_over().map_err(|e| e.to_string());
        crate::update::kernel_vfio::take_type1_mappings(&vfio, &saved.context.type1_vaddr, all_ram)
            .map_err(|e| format!("{id}: {e}"))?;
        let bars = PeerBars::new(device.host_bdf.clone(), &saved.hot.source.tuning(), |i| {
            backend.region_file(i)
        });
        let peer = (vfio.peer_mapper(), bars);
        let mapper: Arc<dyn DmaMapper> = Arc::new(AlreadyMapped::new(
            vfio.dma_mapper(),
            saved.context.dma_mapped.clone(),
        ));
        let place = SavedHotPlace {
            segment: device.segment,
            slot: device.slot,
            ids: (device.vendor_id, device.device_id),
            pci: &device.pci,
            intx_gsi: device.intx_gsi,
        };
        let hand_over = vfio.hand_over();
        let kept = Kept {
            health: None,
            watch: None,
            vfio: Some(vfio),
            connection: None,
        };
        let host_bdf = device.host_bdf.clone();
        let type1_vaddr = saved.context.type1_vaddr.clone();
        let context = move |bdf, pci_device: &Arc<Mutex<VfioPciDevice>>, dma| {
            let device = PluggedKernelVfio {
                host_bdf,
                bdf,
                device: pci_device.clone(),
                cdev,
                mark,
            };
            // The type1 mappings the old process made and moved here.
            Some(PluggedKernelContext::new(
                hand_over,
                type1_vaddr,
                dma,
                vec![device],
            ))
        };
        self.adopt(
            &saved.hot,
            place,
            (Box::new(backend), mapper, peer),
            kept,
            context,
        )
    }

    /// What the adoptions share: `backend` (with its RAM `mapper`, mapped already, and its
    /// peer mapper and BARs) plugged back at `place` in the slot `hot` says, its PCI state
    /// loaded, the mapping accounted for, a peer of the others again; then a hot-plugged
    /// device holding `kept` and the kernel VFIO context `context` makes for it.
    fn adopt(
        &mut self,
        hot: &HotPluggedGpu,
        place: SavedHotPlace<'_>,
        (backend, mapper, (peer_mapper, bars)): (
            Box<dyn PassthroughDevice>,
            Arc<dyn DmaMapper>,
            (super::PeerMapperChoice, PeerBars),
        ),
        kept: Kept,
        context: impl FnOnce(
            PciBdf,
            &Arc<Mutex<VfioPciDevice>>,
            Arc<gpuvm_vfio::dma::DmaProgress>,
        ) -> Option<PluggedKernelContext>,
    ) -> Result<String, String> {
        let id = hot.source.gpu_id.clone();
        if self.devices.contains_key(&id) {
            return Err(format!("the state names the GPU {id} twice"));
        }
        if place.intx_gsi.is_some() {
            return Err(format!("{id}: a hot-plugged GPU has no INTx wired"));
        }
        let port = match hot.port {
            None => None,
            Some(slot) => Some(
                (self.ports.iter())
                    .position(|port| port.slot == slot)
                    .ok_or_else(|| {
                        format!("{id}: no root port for hot-plug in slot {slot:#04x}")
                    })?,
            ),
        };
        let progress = self.ram.progress(mapper.name());
        let (device, gsis) = crate::update::passthrough::take_over(
            backend,
            &self.router,
            &self.slots,
            &progress,
            place.ids,
        )
        .map_err(|e| format!("{id}: {e}"))?;
        let release = |gsis: &[u32], error: String| {
            self.router.release(gsis);
            format!("{id}: {error}")
        };
        let name = device.name().to_string();
        let device = Arc::new(Mutex::new(device));
        let as_pci: Arc<Mutex<dyn gpuvm_devices::pci::PciDevice>> = device.clone();
        let bars_at = place.pci.bars.as_slice();
        let added = match (hot.port, self.root_of(place.segment)) {
            (None, Some(root)) => root.add_device_at(place.slot, as_pci, bars_at),
            (Some(port), _) if place.segment == 0 => {
                (self.root).add_behind(&[port, place.slot], as_pci, bars_at, false)
            }
            (Some(_), _) => Err(gpuvm_devices::pci::PciError::SavedState(format!(
                "it is in a root port for hot-plug on PCI segment {}; those are segment 0's",
                place.segment
            ))),
            (None, None) => Err(gpuvm_devices::pci::PciError::SavedState(format!(
                "the VM has no PCI segment {}",
                place.segment
            ))),
        };
        let bdf = added.map_err(|e| {
            release(
                &gsis,
                format!("cannot plug it back into slot {:#04x}: {e}", place.slot),
            )
        })?;
        let loaded = lock(&device)
            .restore(place.pci)
            .map_err(|e| format!("its PCI state does not fit: {e}"))
            .and_then(|()| {
                self.ram
                    .start_with(
                        progress.clone(),
                        mapper,
                        self.hooks,
                        crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
                    )
                    .map_err(|e| format!("cannot account for its DMA mappings: {e}"))
            });
        let mapping = match loaded {
            Ok(mapping) => mapping,
            Err(error) => {
                self.off_the_bus(port, bdf);
                return Err(release(&gsis, error));
            }
        };
        match port {
            // The port's restored registers show the card present already.
            Some(port) => {
                self.port_of.insert(id.clone(), port);
            }
            None => lock(self.controller_of(bdf)).device_restored(bdf.device),
        }
        // A peer of the GPUs hot-plugged from now on. Alone (or with p2p off on every
        // device, which the old process checked) it maps nothing now.
        self.join_peers(
            &id,
            (peer_mapper, bars),
            &device,
            crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
        );
        let label = format!("{} {name}", bdf.shown());
        log::info!(
            "live update: hot-plugged {id} ({label}) taken over from the old process (no \
             reset, no DMA map; interrupts on this VM's eventfds)"
        );
        let kernel = context(bdf, &device, progress);
        self.devices.insert(
            id,
            HotDevice {
                bdf,
                label: label.clone(),
                mapping: Some(mapping),
                health: kept.health,
                _watch: kept.watch,
                gone: None,
                device,
                _vfio: kept.vfio,
                gsis,
                ejecting: false,
                source: hot.source.clone(),
                stopped: false,
                held_for_dma: Arc::default(),
                connection: kept.connection,
                kernel,
            },
        );
        Ok(label)
    }
}

/// A handed-over hot-plugged device's place and PCI state in the paused state.
struct SavedHotPlace<'a> {
    /// Its PCI segment: its slot is one of that segment's ACPI hot-plug slots (root ports
    /// for hot-plug are segment 0's).
    segment: u16,
    slot: u8,
    ids: (u16, u16),
    pci: &'a gpuvm_vfio::pci::VfioPciState,
    intx_gsi: Option<u32>,
}

/// What an adopted hot-plugged device keeps that depends on its kind.
struct Kept {
    health: Option<Arc<gpuvm_vfio::user::BackendHealth>>,
    watch: Option<gpuvm_vfio::user::HangupWatch>,
    vfio: Option<gpuvm_vfio::kernel::KernelVfio>,
    connection: Option<UserConnection>,
}
