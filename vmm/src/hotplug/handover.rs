//! Hot-plugged vfio-user GPUs across a live update, handed over as the cold-plugged ones
//! are (crate::update::passthrough): the connection goes over as it is, with the layout
//! its client learnt, the PCI state gpuvm emulates for the device and the guest RAM it has
//! DMA-mapped. The new process plugs the device back into its hot-plug slot (bus 0's ACPI
//! slot, or its root port's) without a reset or a DMA map, loads the PCI state (which
//! gives the device that process's MSI-X eventfds) and keeps it a hot-plugged device:
//! DELETE /gpus/{id} ejects it there, and it is a peer of the GPUs plugged after.
//!
//! Kernel VFIO devices are not handed over (their DMA mappings would need the VFIO vaddr
//! update or iommufd's process change): the old process refuses a VM with one.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use gpuvm_devices::Persist;
use gpuvm_vfio::dma::DmaMapper;
use gpuvm_vfio::user::{UserConnection, VfioUserDevice};
use gpuvm_vfio::{DmaRegion, PassthroughDevice};

use super::{HotDevice, PciHotplug};
use crate::lock;
use crate::p2p::PeerBars;
use crate::update::handed_over::{HandedOverVfioUser, HotPluggedGpu, OfferedVfioUser};
use crate::update::passthrough::AlreadyMapped;

impl PciHotplug {
    /// The hot-plugged vfio-user GPUs (by id) and their connections.
    fn vfio_user_devices(&self) -> impl Iterator<Item = (&str, &HotDevice, &UserConnection)> {
        (self.devices.iter())
            .filter_map(|(id, hot)| Some((id.as_str(), hot, hot.connection.as_ref()?)))
    }

    /// The labels of the hot-plugged kernel VFIO devices, which a live update does not
    /// carry.
    pub(crate) fn kernel_vfio_labels(&self) -> Vec<String> {
        (self.devices.values())
            .filter(|hot| hot.connection.is_none())
            .map(|hot| hot.label.clone())
            .collect()
    }

    /// Why a hot-plugged vfio-user GPU cannot be handed over now, the first such one.
    pub(crate) fn handover_refusal(&self) -> Option<String> {
        for (id, hot, connection) in self.vfio_user_devices() {
            let reason = if hot.gone.is_some() {
                Some("its device process is gone".to_string())
            } else if hot.ejecting {
                Some("it is being hot-unplugged; retry once it is gone".to_string())
            } else if hot.stopped || hot.held_for_dma.load(std::sync::atomic::Ordering::Acquire) {
                Some("it was restored and does not run yet; retry once it runs".to_string())
            } else if hot.bdf.segment != 0 {
                Some(format!(
                    "it sits at {} on PCI segment {}; only devices of segment 0 are handed over",
                    hot.bdf.full(),
                    hot.bdf.segment
                ))
            } else if hot.bdf.bus != 0 && !self.port_of.contains_key(id) {
                // Neither in an ACPI slot nor in a root port for hot-plug: behind the
                // ports of a host-mirroring layout (crate::pci_topology).
                Some(format!(
                    "it sits at {} behind the VM's PCIe ports; only GPUs on bus 0 or in a \
                     root port for hot-plug are handed over",
                    hot.bdf
                ))
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
                    (socket, hot.bdf.device, None),
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
        for (id, hot, _) in self.vfio_user_devices() {
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
        let id = hot.source.gpu_id.clone();
        if self.devices.contains_key(&id) {
            return Err(format!("the state names the GPU {id} twice"));
        }
        if saved.intx_gsi.is_some() {
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
        let health = backend.health();
        if let Some(wake) = self.wake.as_ref().and_then(|w| w.try_clone().ok()) {
            health.set_wake(wake);
        }
        let watch = backend.watch_hang_up();
        let connection = backend.connection();
        let bars = PeerBars::new(backend.name(), &hot.source.tuning(), |i| {
            backend.region_file(i)
        });
        let peer_mapper = backend.peer_mapper();
        let mapper: Arc<dyn DmaMapper> = Arc::new(AlreadyMapped::new(
            backend.dma_mapper(),
            saved.dma_mapped.clone(),
        ));
        let progress = self.ram.progress(mapper.name());
        let (device, gsis) = crate::update::passthrough::take_over(
            Box::new(backend),
            &self.router,
            &self.slots,
            &progress,
            (saved.vendor_id, saved.device_id),
        )
        .map_err(|e| format!("{id}: {e}"))?;
        let release = |gsis: &[u32], error: String| {
            self.router.release(gsis);
            format!("{id}: {error}")
        };
        let name = device.name().to_string();
        let device = Arc::new(Mutex::new(device));
        let as_pci: Arc<Mutex<dyn gpuvm_devices::pci::PciDevice>> = device.clone();
        let bars_at = saved.pci.bars.as_slice();
        let added = match hot.port {
            None => self.root.add_device_at(saved.slot, as_pci, bars_at),
            Some(port) => self
                .root
                .add_behind(&[port, saved.slot], as_pci, bars_at, false),
        };
        let bdf = added.map_err(|e| {
            release(
                &gsis,
                format!("cannot plug it back into slot {:#04x}: {e}", saved.slot),
            )
        })?;
        let loaded = lock(&device)
            .restore(&saved.pci)
            .map_err(|e| format!("its PCI state does not fit: {e}"))
            .and_then(|()| {
                self.ram
                    .start_with(
                        progress,
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
            (Ok(peer_mapper), bars),
            &device,
            crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
        );
        let label = format!("{bdf} {name}");
        log::info!(
            "live update: hot-plugged {id} ({label}) taken over from the old process (no \
             reset, no DMA map; interrupts on this VM's eventfds)"
        );
        self.devices.insert(
            id,
            HotDevice {
                bdf,
                label: label.clone(),
                mapping: Some(mapping),
                health: Some(health),
                _watch: watch,
                gone: None,
                device,
                _vfio: None,
                gsis,
                ejecting: false,
                source: hot.source.clone(),
                stopped: false,
                held_for_dma: Arc::default(),
                connection: Some(connection),
            },
        );
        Ok(label)
    }
}
