//! The machine's devices ([`MachineDevices`]: the buses and the devices the VMM thread
//! reaches) and, as one snapshot component, the one list of the devices whose state a
//! snapshot holds.
//!
//! Components without state of their own are not in the list: the i8042 (it only
//! forwards the guest's reset command), the ACPI sleep control register (it only forwards
//! a power-off), the exit port and the legacy sinks. The PCI root saves only its
//! allocations (slots, BAR ranges, windows); each function's configuration state is its
//! own: a virtio transport saves its BAR, command register and MSI-X table; a hot-plugged
//! passthrough device's state comes from the device itself, through VFIO migration: see
//! crate::hotplug::migration.
//!
//! Adding a device to snapshots: implement [`Persist`] in the device's own file (its
//! `State` type beside it), then add one field to [`DeviceStates`] and one line to each
//! of `save` and `restore` below. Nothing else changes.

use std::sync::{Arc, Mutex};

use event_manager::MutEventSubscriber;
use gpuvm_devices::{Bus, ExitStatus, Persist, SerialDevice, SerialError, SerialState};
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::lock;
use crate::virtio::VirtioDeviceState;

/// Devices the VMM thread itself needs to reach.
pub struct MachineDevices {
    /// Guest RAM being DMA-mapped for passthrough devices in the background (first, so
    /// the mapper threads stop before the devices and RAM go).
    pub dma_mappings: Vec<gpuvm_vfio::dma::BackgroundMapping>,
    /// PCI hot-plug of passthrough devices (PUT/DELETE /gpus/{id} while running): its
    /// devices and their mappings; None until PCI is attached.
    pub pci_hotplug: Option<crate::hotplug::PciHotplug>,
    /// The ACPI CPU hot-plug register block (vm.resize), when the VM may have more vCPUs
    /// than it booted with; also on the port-I/O bus.
    pub cpu_hotplug: Option<Arc<Mutex<gpuvm_devices::CpuHotplug>>>,
    /// The ACPI memory hot-plug register block (vm.resize desired_ram), when the VM has
    /// room for hot-plugged RAM; also on the port-I/O bus.
    pub memory_hotplug: Option<Arc<Mutex<gpuvm_devices::MemoryHotplug>>>,
    pub io_bus: Arc<Bus>,
    pub mmio_bus: Arc<Bus>,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub reset_evt: EventFd,
    /// Signalled when the guest powers off through the ACPI sleep control register.
    pub poweroff_evt: EventFd,
    pub exit_evt: EventFd,
    pub exit_status: ExitStatus,
    /// Names of passthrough devices: their state lives in the hardware, so a VM with any
    /// cannot be snapshotted.
    pub passthrough: Vec<String>,
    /// Device event sources the run loop watches (e.g. INTx resample eventfds).
    pub event_sources: Vec<Arc<Mutex<dyn MutEventSubscriber + Send>>>,
    /// The virtio devices, in bus order (their state is in snapshots).
    pub virtio: Vec<crate::virtio::VirtioHandle>,
    /// GPUs the guest released for a snapshot and waits to get back (a PUT /gpus with
    /// one of these ids resumes it in the guest; see [`crate::gpu_release`]).
    pub released_gpus: Vec<crate::action::ReleasedGpu>,
    /// The cold-plugged vfio-user devices as a live update hands them over, and where a
    /// new process plugs them (crate::update::passthrough).
    pub handover: crate::update::handed_over::PassthroughHandOver,
    /// The configuration as the VM's client gave it, each device under the id the client
    /// knows it by (see [`crate::action::ClientRecord`]). Not a device's state: the API's
    /// controller keeps it up to date here so that whatever saves and restores the devices
    /// (a snapshot, a live update) carries it with them. None when no client recorded one.
    pub client_record: Option<crate::action::ClientRecord>,
    /// The ids of the passthrough devices plugged at start, by backend (host PCI address
    /// or socket path), as the API names them: kept here, as the record is, so that a live
    /// update's new process names them the same.
    pub cold_plugged_ids: std::collections::BTreeMap<String, String>,
}

/// The saved state of every emulated device, one field each. Flattened into the state
/// file's top level (a device's state is a key there, e.g. `serial`), so a field added
/// here needs `#[serde(default)]` for state files written before it.
#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceStates {
    pub serial: SerialState,
    /// The virtio devices, in bus order, each with its configuration (a restore rebuilds
    /// them from it). Absent in state files written before virtio devices existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub virtio: Vec<VirtioDeviceState>,
    /// The PCI hot-plug register block (whether the guest enabled its interrupt).
    /// Absent in state files written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_hotplug: Option<gpuvm_devices::pci::hotplug::HotplugState>,
    /// The ACPI hot-plug register blocks of PCI segments 1.., segment 1's first. Absent for
    /// VMs with one segment and in state files written before other segments had them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pci_segment_hotplug: Vec<gpuvm_devices::pci::hotplug::HotplugState>,
    /// The CPU hot-plug register block: the possible and present CPUs. Absent for VMs
    /// without vCPU hot-plug (and in state files written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_hotplug: Option<gpuvm_devices::CpuHotplugState>,
    /// GPUs released by the guest for the snapshot (absent when there were none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub released_gpus: Vec<crate::action::ReleasedGpu>,
    /// Hot-plugged passthrough devices whose own state the snapshot holds (VFIO
    /// migration; each one's data is a file beside the memory files). Filled by the
    /// snapshot itself, which writes those files ([`crate::hotplug::PciHotplug::save_migrated`]);
    /// a restore plugs them back after this state is loaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub migrated_gpus: Vec<crate::hotplug::MigratedGpu>,
    /// Segment 0's 64-bit PCI BAR window (start, size), as the guest's ACPI tables have it
    /// (planned from the devices at boot): a restore puts it back there. Absent in state
    /// files written before it was planned, when it was the default one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_mmio64_window: Option<(u64, u64)>,
    /// Segment 0's slot and BAR allocations and its windows' bookkeeping: a restore puts
    /// every function back exactly there. Absent in state files written before it was
    /// saved: the allocations are rebuilt from each device's own place then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_root: Option<gpuvm_devices::pci::PciRootState>,
    /// The root ports for hot-plug (`--pcie-root-ports`): their slots (not among
    /// `pci_root`'s), windows and registers; a restore rebuilds them before the devices in
    /// them. Absent for VMs without them and in state files written before they were saved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pcie_root_ports: Vec<crate::pci_topology::SavedHotplugPort>,
    /// The ports of a host-mirroring layout (`--pci-topology host`: root ports, switch
    /// upstream and downstream ports), parents first: their places, registers and (root
    /// ports) their ranges of the root's windows, which leave `pci_root`'s slots. A restore
    /// rebuilds them before the devices behind them. Absent for VMs without them and in
    /// state files written before they were saved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pci_topology_ports: Vec<crate::pci_topology::SavedTopologyPort>,
    /// Memory hot-plug: the room the VM was made with and the register block, whose slots
    /// say which RAM was plugged where (that RAM is in the memory file, after boot RAM).
    /// Filled by the snapshot (the room is the machine's, not a device's). Absent for VMs
    /// without memory hot-plug and in state files written before it was saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_hotplug: Option<SavedRamHotplug>,
    /// A live update's cold-plugged vfio-user devices (their PCI state; their connections
    /// go as descriptors). Filled by the live update only; absent elsewhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_over_vfio_user: Vec<crate::update::handed_over::HandedOverVfioUser>,
    /// A live update's peer-to-peer DMA mappings between its vfio-user devices, which the
    /// devices keep ([`crate::p2p::PeerDma::adopt`]). Filled by the live update only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_over_peer_mappings: Vec<crate::p2p::HandedOverPeerMapping>,
    /// A live update's cold-plugged kernel VFIO devices (iommufd): their PCI state and
    /// the RAM their context has mapped (the iommufd and cdevs go as descriptors). Filled
    /// by the live update only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_over_kernel_vfio: Option<crate::update::handed_over::HandedOverKernelContext>,
    /// A live update's hot-plugged kernel VFIO devices, each in a context of its own: as
    /// `handed_over_kernel_vfio`, with what makes it a hot-plugged GPU again. Filled by the
    /// live update only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_over_hot_kernel_vfio: Vec<crate::update::handed_over::HandedOverHotKernelVfio>,
    /// A live update's PCI segments beyond 0, as the old process built them (their
    /// windows were planned from its devices, which the new process does not plan from):
    /// the new process builds them so, its handed-over devices back in their places on
    /// them. Filled by the live update only (a restore plans segments from its command
    /// line as a boot does).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_over_pci_segments: Vec<crate::pci::SavedPciSegment>,
    /// A live update's MMDS (Firecracker's metadata service): its configuration, data
    /// store and live tokens, which the new process's interfaces and API serve. Filled by
    /// the live update only, and only where the VM's MMDS is not as a new VM's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_over_mmds: Option<gpuvm_mmds::MmdsState>,
    /// A live update's vsock connections and waiting host clients (their sockets come
    /// beside the paused state), which the new process's vsock device serves on. Filled by
    /// the live update only: a snapshot cannot keep host connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_over_vsock: Option<gpuvm_virtio::vsock::VsockLiveState>,
    /// The client's record of the VM's configuration ([`MachineDevices::client_record`]):
    /// a restore gives it back to the API, so the client finds its devices under its ids.
    /// Absent when no client recorded one, and in state files written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_record: Option<crate::action::ClientRecord>,
    /// [`MachineDevices::cold_plugged_ids`]. Absent when there are none, and in state files
    /// written before it was kept.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub cold_plugged_ids: std::collections::BTreeMap<String, String>,
}

/// Memory hot-plug in a snapshot ([`DeviceStates::ram_hotplug`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedRamHotplug {
    /// `memory.hotplug_size`: the most RAM the VM may be given.
    pub hotplug_size: u64,
    pub block: gpuvm_devices::memory_hotplug::MemoryHotplugState,
}

/// A device refused its saved state (or could not give its own).
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error(transparent)]
    Serial(#[from] SerialError),
    #[error(transparent)]
    Virtio(#[from] gpuvm_virtio::transport::SnapshotError),
    #[error("the snapshot has {saved} virtio devices, the restored VM was built with {built}")]
    VirtioCount { saved: usize, built: usize },
    #[error(transparent)]
    CpuHotplug(#[from] gpuvm_devices::cpu_hotplug::CpuHotplugStateError),
    #[error(transparent)]
    PciRoot(#[from] gpuvm_devices::pci::PciError),
    #[error(transparent)]
    MemoryHotplug(#[from] gpuvm_devices::memory_hotplug::MemoryHotplugStateError),
    #[error(
        "the snapshot has memory hot-plug and the restored VM has none, or the other way round"
    )]
    MemoryHotplugMismatch,
    #[error("{0}")]
    PciSegments(String),
}

/// A passthrough device plugged when the VM was built (cold-plugged): its backend as
/// configured, and where the guest has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColdPlugged {
    /// A kernel VFIO device's host PCI address, a vfio-user device's socket path: the
    /// key the configuration names the device by
    /// ([`crate::action::GpuBody::backend_key`]).
    pub backend: String,
    /// Whether it is a vfio-user device (else kernel VFIO).
    pub vfio_user: bool,
    pub bdf: gpuvm_devices::pci::PciBdf,
}

impl MachineDevices {
    /// The cold-plugged passthrough devices, kernel VFIO devices first, each kind in plug
    /// order. Read from what a live update hands over ([`Self::handover`]), which the
    /// build fills and a live update's new process fills again as it plugs the old
    /// process's devices back, so both list them.
    pub fn cold_plugged(&self) -> Vec<ColdPlugged> {
        let kernel = (self.handover.kernel.iter())
            .flat_map(|context| &context.devices)
            .map(|device| ColdPlugged {
                backend: device.host_bdf.clone(),
                vfio_user: false,
                bdf: device.bdf,
            });
        let vfio_user = self.handover.vfio_user.iter().map(|device| ColdPlugged {
            backend: device.socket.display().to_string(),
            vfio_user: true,
            bdf: device.bdf,
        });
        kernel.chain(vfio_user).collect()
    }

    /// Waits, `limit` at most in all, until every background DMA mapping of guest RAM
    /// (cold- and hot-plugged devices') is done: a live update hands over only mappings
    /// that are. Ok(None) when none was running, Ok(Some(waited)) after waiting; Err says
    /// which one is not done (or failed).
    pub fn finish_dma_mappings(
        &self,
        limit: std::time::Duration,
    ) -> Result<Option<std::time::Duration>, String> {
        let started = std::time::Instant::now();
        let mut waited = false;
        for mapping in self.background_mappings() {
            let progress = mapping.progress();
            if progress.is_done() {
                continue;
            }
            waited = true;
            // Err for a mapping that failed (before or while waiting) or is not done in time.
            progress
                .wait(limit.saturating_sub(started.elapsed()))
                .map_err(|error| match progress.status().error {
                    Some(failed) => {
                        format!("the DMA mapping for {} failed: {failed}", progress.name())
                    }
                    None => format!(
                        "guest RAM is still being DMA-mapped for {} ({error}); retry once it is",
                        progress.name()
                    ),
                })?;
        }
        Ok(waited.then(|| started.elapsed()))
    }

    /// The background DMA mappings of guest RAM of every passthrough device, cold- and
    /// hot-plugged.
    pub(crate) fn background_mappings(
        &self,
    ) -> impl Iterator<Item = &gpuvm_vfio::dma::BackgroundMapping> {
        let hot = self.pci_hotplug.iter().flat_map(|h| h.dma_mappings());
        self.dma_mappings.iter().chain(hot)
    }

    /// Where each background DMA mapping of the passthrough devices stands, cold- and
    /// hot-plugged (for the API).
    pub fn dma_mapping_status(&self) -> Vec<gpuvm_vfio::dma::DmaStatus> {
        self.background_mappings()
            .map(|m| m.progress().status())
            .collect()
    }
}

impl Persist for MachineDevices {
    type State = DeviceStates;
    type Error = DeviceStateError;

    fn save(&self) -> Result<DeviceStates, DeviceStateError> {
        let mut saved = DeviceStates {
            serial: lock(&self.serial).save()?,
            virtio: crate::virtio::save_all(&self.virtio)?,
            pci_hotplug: self.pci_hotplug.as_ref().map(|h| h.save_controller()),
            pci_segment_hotplug: (self.pci_hotplug.as_ref())
                .map(|h| h.save_segment_controllers())
                .unwrap_or_default(),
            cpu_hotplug: self
                .cpu_hotplug
                .as_ref()
                .map(|block| lock(block).save())
                .transpose()?,
            released_gpus: self.released_gpus.clone(),
            migrated_gpus: Vec::new(),
            pci_mmio64_window: self.pci_hotplug.as_ref().map(|h| h.mmio64_window()),
            pci_root: self
                .pci_hotplug
                .as_ref()
                .map(|h| h.save_root())
                .transpose()?,
            pcie_root_ports: (self.pci_hotplug.as_ref())
                .map(|h| h.save_root_ports())
                .unwrap_or_default(),
            pci_topology_ports: Vec::new(),
            ram_hotplug: None,
            handed_over_vfio_user: Vec::new(),
            handed_over_peer_mappings: Vec::new(),
            handed_over_kernel_vfio: None,
            handed_over_hot_kernel_vfio: Vec::new(),
            handed_over_pci_segments: Vec::new(),
            handed_over_mmds: None,
            handed_over_vsock: None,
            client_record: self.client_record.clone(),
            cold_plugged_ids: self.cold_plugged_ids.clone(),
        };
        // The host-mirroring layout's ports, with their slots out of the root's.
        if let (Some(state), Some(plug)) = (saved.pci_root.as_mut(), &self.handover.plug) {
            saved.pci_topology_ports = crate::pci_topology::save_topology_ports(&plug.root, state);
        }
        Ok(saved)
    }

    fn restore(&mut self, state: &DeviceStates) -> Result<(), DeviceStateError> {
        lock(&self.serial).restore(&state.serial)?;
        if state.virtio.len() != self.virtio.len() {
            return Err(DeviceStateError::VirtioCount {
                saved: state.virtio.len(),
                built: self.virtio.len(),
            });
        }
        crate::virtio::restore_all(&self.virtio, &state.virtio)?;
        if let (Some(hotplug), Some(saved)) = (&self.pci_hotplug, &state.pci_hotplug) {
            hotplug.restore_controller(saved);
            hotplug
                .restore_segment_controllers(&state.pci_segment_hotplug)
                .map_err(DeviceStateError::PciSegments)?;
            hotplug.virtio_restored(&self.virtio);
        }
        if let (Some(block), Some(saved)) = (&self.cpu_hotplug, &state.cpu_hotplug) {
            lock(block).restore(saved)?;
        }
        match (&self.memory_hotplug, &state.ram_hotplug) {
            (Some(block), Some(saved)) => lock(block).restore(&saved.block)?,
            (None, None) => {}
            _ => return Err(DeviceStateError::MemoryHotplugMismatch),
        }
        self.released_gpus = state.released_gpus.clone();
        self.client_record = state.client_record.clone();
        self.cold_plugged_ids = state.cold_plugged_ids.clone();
        Ok(())
    }
}
