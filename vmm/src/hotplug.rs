//! PCI hot-plug of passthrough devices into a running VM (PUT and DELETE /gpus/{id} after
//! start), through ACPI PCI hot-plug on bus 0: the register block of
//! gpuvm_devices::pci::hotplug, described in the DSDT (arch/src/x86_64/acpi.rs) and raised
//! on its Generic Event Device's GSI.
//!
//! ```text
//! PUT /gpus/{id}     connect (vfio-user) or open (kernel VFIO) the device, plug it as
//!                    cold-plug does (pci::Plug::open: reset, MSI/MSI-X vectors, BARs as KVM
//!                    slots, Bus Master gated by the DMA mapping), start DMA-mapping guest
//!                    RAM in the background, set its PCIU bit and raise the GSI; answers
//!                    {"id", "bdf": "0000:00:XX.0"} at once
//! DELETE /gpus/{id}  set its PCID bit and raise the GSI; the guest releases the device and
//!                    writes B0EJ (the slot leaves the bus then); the VMM thread then stops
//!                    the mapping, drops the device (BAR slots unmapped, MSI-X off, device
//!                    reset, vfio-user connection or VFIO container closed: their DMA
//!                    mappings go with them) and its MSI routes
//! ```
//!
//! A VM with empty PCIe root ports (`--pcie-root-ports N`, crate::pci_topology) plugs
//! into them instead, through PCIe native hot-plug (gpuvm_devices::pci::bridge: each
//! port's slot):
//!
//! ```text
//! PUT /gpus/{id}     as above, but the device goes on a free port's secondary bus with its
//!                    BARs inside the port's windows; the slot's presence detect is set
//!                    (changed), and its attention button pressed for a guest that
//!                    listens only to the button (Linux's pciehp); the link comes up when
//!                    the guest powers the slot on.
//!                    Answers the device's BDF on that bus. No free port left: 409.
//! DELETE /gpus/{id}  press the slot's attention button; the guest turns the slot's power
//!                    off when it let the device go (Slot Control, Power Controller
//!                    Control); the VMM thread then takes the device down as above and
//!                    clears presence detect. The same eject timeout bounds the wait.
//! ```
//!
//! A device asked for on another PCI segment (`pci_segment`, Cloud Hypervisor's; a NUMA
//! node's segment holds that node's GPUs) goes on that segment's bus 0, through the
//! segment's own ACPI hot-plug register block and slots (`\_SB.PC0N`, raising the same
//! GSI): the root ports for hot-plug are segment 0's.
//!
//! INTx is not wired for hot-plugged devices (guests use MSI/MSI-X for GPUs).
//!
//! A vfio-user device whose process dies while plugged (a crash, `kill -9`) is noticed by
//! its socket's hang-up (or its first failed request), which wakes the VMM thread:
//! [`PciHotplug::check_backends`] marks it gone (its registers read all ones from then on,
//! see gpuvm_vfio::user) and asks the guest to eject it; the slot is freed once the guest
//! ejects it or the eject timeout passes ([`PciHotplug::free_gone`]). The VM keeps running.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuvm_devices::pci::hotplug::{HotplugState, HOTPLUG_GSI};
use gpuvm_devices::pci::{GuestMemoryMapper, HotplugController, PciBdf, PciRoot};
use gpuvm_devices::Persist;
use gpuvm_memory::GuestRam;
use gpuvm_vfio::dma::BackgroundMapping;
use gpuvm_vfio::kernel::KernelVfio;
use gpuvm_vfio::user::{BackendHealth, HangupWatch, VfioUserDevice};
use gpuvm_vfio::PassthroughDevice;
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::action::GpuBody;
use crate::dma::{DmaTestHooks, RamChunks};
use crate::interrupts::{duplicate_vm, MsiRouter};
use crate::lock;
use crate::p2p::{PeerBars, PeerDma, PeerId};
use crate::pci::{PciSetupError, Plug};
use crate::pci_topology::{bars_in_port, HotplugPort};
use crate::virtio::VirtioHandle;

mod handover;
pub(crate) mod migration;
mod virtio;
pub use migration::{MigratedGpu, DEVICE_FILE_PREFIX};

/// How long DELETE /gpus/{id} waits for the guest to eject, unless
/// [`EJECT_TIMEOUT_VAR`] says otherwise.
pub const EJECT_TIMEOUT: Duration = Duration::from_secs(20);
/// `GPUVM_HOTPLUG_EJECT_TIMEOUT_MS=<ms>`: the eject timeout.
pub const EJECT_TIMEOUT_VAR: &str = "GPUVM_HOTPLUG_EJECT_TIMEOUT_MS";

/// The eject timeout in effect.
pub fn eject_timeout() -> Duration {
    std::env::var(EJECT_TIMEOUT_VAR)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(EJECT_TIMEOUT, Duration::from_millis)
}

/// Why a hot-plug operation was refused; each maps to an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    #[error("no hot-plugged device has id {0:?}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("cannot hot-plug {id} on PCI segment {segment}: the VM has {count} segment(s), numbered from 0")]
    NoSegment {
        id: String,
        segment: u16,
        count: u16,
    },
    #[error("cannot hot-plug {id}: {source}")]
    Device {
        id: String,
        #[source]
        source: PciSetupError,
    },
}

impl HotplugError {
    pub fn status(&self) -> u16 {
        match self {
            HotplugError::NotFound(_) => 404,
            HotplugError::Conflict(_) => 409,
            HotplugError::Device { .. } | HotplugError::NoSegment { .. } => 400,
        }
    }
}

/// A device plugged at runtime.
struct HotDevice {
    bdf: PciBdf,
    label: String,
    /// Stopped (between chunks) before the device goes.
    mapping: Option<BackgroundMapping>,
    /// Whether a vfio-user device's process is still there, and the thread watching.
    health: Option<Arc<BackendHealth>>,
    _watch: Option<HangupWatch>,
    /// Set once the device process went away.
    gone: Option<GoneDevice>,
    device: Arc<Mutex<gpuvm_vfio::pci::VfioPciDevice>>,
    /// A kernel VFIO device's own context (container or iommufd), dropped after it.
    _vfio: Option<KernelVfio>,
    gsis: Vec<u32>,
    ejecting: bool,
    /// What it was plugged from (a snapshot records it, to find the device again).
    source: GpuBody,
    /// Stopped by a snapshot that saved its state (VFIO migration), until it runs again.
    stopped: bool,
    /// A restored device not running yet: guest RAM is still being DMA-mapped for it.
    held_for_dma: Arc<std::sync::atomic::AtomicBool>,
    /// A vfio-user device's connection, as a live update hands it over (None: kernel VFIO).
    connection: Option<gpuvm_vfio::user::UserConnection>,
    /// A kernel VFIO device's context as a live update hands it over (its own, with this
    /// one device; None: vfio-user).
    kernel: Option<crate::update::handed_over::PluggedKernelContext>,
}

/// A device opened for plugging, with what goes with it.
struct OpenedBackend {
    backend: Box<dyn PassthroughDevice>,
    mapper: Arc<dyn gpuvm_vfio::dma::DmaMapper>,
    health: Option<Arc<BackendHealth>>,
    watch: Option<HangupWatch>,
    vfio: Option<KernelVfio>,
    /// Its DMA context's mapper for peers' BARs (or why there is none) and its own BARs.
    peer: (PeerMapperChoice, PeerBars),
    /// A vfio-user device's connection (for a live update).
    connection: Option<gpuvm_vfio::user::UserConnection>,
    /// A kernel VFIO device's host address, a duplicate of its file (or why there is
    /// none) and its mark (for a live update).
    kernel_handle: Option<KernelHandle>,
}

/// A kernel VFIO device's host address, a duplicate of its file and its mark.
type KernelHandle = (
    String,
    Result<std::os::fd::OwnedFd, String>,
    Arc<gpuvm_vfio::kernel::HandOverMark>,
);

/// A context's mapper for peers' BARs, or why it cannot have one.
type PeerMapperChoice =
    Result<Arc<dyn gpuvm_vfio::dma::PeerMapper>, gpuvm_vfio::dma::PeerMappingUnsupported>;

/// A device whose process went away: waiting for the guest to eject it, or the deadline.
struct GoneDevice {
    reason: String,
    deadline: Instant,
}

/// Where an eject request stands.
#[derive(Debug, PartialEq, Eq)]
pub enum EjectState {
    /// The guest has not ejected it yet.
    Waiting,
    /// The guest ejected it and the VMM took it down; its "BDF name".
    Removed(String),
}

/// ACPI hot-plug on the bus 0 of a PCI segment other than 0: its root and register block.
struct SegmentSlots {
    root: Arc<PciRoot>,
    controller: Arc<Mutex<HotplugController>>,
}

/// The VM's hot-plug state, owned by the VMM thread (in `MachineDevices`).
pub struct PciHotplug {
    /// Segment 0's register block and root.
    controller: Arc<Mutex<HotplugController>>,
    root: Arc<PciRoot>,
    /// Segments 1.. (index: segment - 1).
    segments: Vec<SegmentSlots>,
    router: Arc<MsiRouter>,
    slots: Arc<dyn GuestMemoryMapper>,
    vm: VmFd,
    ram: RamChunks,
    hooks: DmaTestHooks,
    devices: BTreeMap<String, HotDevice>,
    /// The VMM thread's wake-up eventfd: guest ejects and dead device processes write it.
    wake: Option<EventFd>,
    /// What virtio devices plugged at runtime are built with.
    virtio: virtio::VirtioPlugContext,
    /// The hot-plug GSI's irqfd, kept registered (every segment's block raises it).
    interrupt: EventFd,
    /// Peer-to-peer DMA: every device's BARs mapped for the others.
    peers: Arc<PeerDma>,
    /// The VM's KVM VFIO device, which each hot-plugged kernel VFIO context shares with
    /// the others.
    pub(crate) kvm_vfio: Arc<crate::pci::SharedKvmVfio>,
    /// The hot-plugged devices' places among the peers, by id.
    peer_ids: BTreeMap<String, PeerId>,
    /// GPUDirect cliques, numbered on from the cold-plugged devices'.
    cliques: gpuvm_vfio::topology::CliqueAssigner,
    /// Empty root ports with hot-plug slots; when there are any, devices go there.
    ports: Vec<HotplugPort>,
    /// The port (index into `ports`) each device plugged into one is in, by id; a device
    /// not listed is on bus 0, in an ACPI slot.
    port_of: BTreeMap<String, usize>,
}

impl PciHotplug {
    pub(crate) fn new(
        kvm: &Kvm,
        vm: &VmFd,
        ram: &GuestRam,
        device_memory: &vm_memory::GuestMemoryMmap,
        root: Arc<PciRoot>,
        router: Arc<MsiRouter>,
        slots: Arc<dyn GuestMemoryMapper>,
    ) -> Result<Self, PciSetupError> {
        let interrupt = EventFd::new(EFD_NONBLOCK).map_err(PciSetupError::Intx)?;
        vm.register_irqfd(&interrupt, HOTPLUG_GSI)
            .map_err(|e| PciSetupError::Intx(std::io::Error::from_raw_os_error(e.errno())))?;
        let controller = HotplugController::new(
            root.clone(),
            Some(interrupt.try_clone().map_err(PciSetupError::Intx)?),
        );
        Ok(PciHotplug {
            controller: Arc::new(Mutex::new(controller)),
            root,
            segments: Vec::new(),
            router,
            slots,
            vm: duplicate_vm(kvm, vm).map_err(PciSetupError::VmFd)?,
            ram: RamChunks::new(ram),
            hooks: DmaTestHooks::from_env(),
            devices: BTreeMap::new(),
            wake: None,
            virtio: virtio::VirtioPlugContext {
                memory: device_memory.clone(),
                ioevents: Arc::new(crate::interrupts::KvmIoEvents::new(
                    duplicate_vm(kvm, vm).map_err(PciSetupError::VmFd)?,
                )),
                ejecting: Default::default(),
            },
            interrupt,
            peers: PeerDma::new(),
            kvm_vfio: Arc::default(),
            peer_ids: BTreeMap::new(),
            cliques: Default::default(),
            ports: Vec::new(),
            port_of: BTreeMap::new(),
        })
    }

    /// Gives the next PCI segment's bus 0 (`root`, segment 1 first) ACPI hot-plug; returns
    /// its register block, for the port-I/O bus at its segment's ports
    /// (gpuvm_devices::pci::hotplug::hotplug_port).
    pub(crate) fn add_segment(
        &mut self,
        root: Arc<PciRoot>,
    ) -> Result<Arc<Mutex<HotplugController>>, PciSetupError> {
        debug_assert_eq!(usize::from(root.segment()), self.segments.len() + 1);
        let interrupt = self.interrupt.try_clone().map_err(PciSetupError::Intx)?;
        let controller = Arc::new(Mutex::new(HotplugController::new(
            root.clone(),
            Some(interrupt),
        )));
        self.segments.push(SegmentSlots {
            root,
            controller: controller.clone(),
        });
        Ok(controller)
    }

    /// Segment `segment`'s root, if the VM has that segment.
    fn root_of(&self, segment: u16) -> Option<&Arc<PciRoot>> {
        match segment {
            0 => Some(&self.root),
            n => Some(&self.segments.get(usize::from(n) - 1)?.root),
        }
    }

    /// The register block of the segment `bdf` is on (segment 0's for a segment the VM
    /// lacks: no device is ever plugged there).
    fn controller_of(&self, bdf: PciBdf) -> &Arc<Mutex<HotplugController>> {
        match bdf.segment {
            0 => &self.controller,
            n => self
                .segments
                .get(usize::from(n) - 1)
                .map_or(&self.controller, |s| &s.controller),
        }
    }

    /// Adds `count` empty root ports on segment 0 (see
    /// crate::pci_topology::add_hotplug_ports), each with an MSI: devices are hot-plugged
    /// into them from now on.
    pub(crate) fn add_root_ports(
        &mut self,
        count: u8,
    ) -> Result<(), crate::pci_topology::PciTopologyError> {
        self.ports = crate::pci_topology::add_hotplug_ports(&self.root, count, Some(&self.router))?;
        Ok(())
    }

    /// Rebuilds the root ports for hot-plug of a snapshot (`saved`, see
    /// crate::pci_topology::restore_hotplug_ports), before the devices in them are
    /// restored: devices are hot-plugged into them from now on.
    pub(crate) fn restore_root_ports(
        &mut self,
        saved: &[crate::pci_topology::SavedHotplugPort],
    ) -> Result<(), crate::pci_topology::PciTopologyError> {
        if saved.is_empty() {
            return Ok(());
        }
        self.ports =
            crate::pci_topology::restore_hotplug_ports(&self.root, saved, Some(&self.router))?;
        Ok(())
    }

    /// The root ports for hot-plug as a snapshot keeps them (their slots, windows and
    /// registers; the devices in them save their own state).
    pub fn save_root_ports(&self) -> Vec<crate::pci_topology::SavedHotplugPort> {
        self.ports.iter().map(HotplugPort::save).collect()
    }

    /// Each segment's bus-0 slots that hold a PCI bridge (root ports, cold-plugged or for
    /// hot-plug), segment 0's first: the ACPI tables leave them out of ACPI hot-plug.
    pub fn bridge_slots(&self) -> Vec<Vec<u8>> {
        std::iter::once(&self.root)
            .chain(self.segments.iter().map(|s| &s.root))
            .map(|root| crate::pci_topology::bridge_slots(root))
            .collect()
    }

    /// A free root port (no device of ours in it, no card present), if the VM has ports;
    /// Ok(None) when it has none (bus 0 then).
    fn free_port(&self) -> Result<Option<usize>, HotplugError> {
        if self.ports.is_empty() {
            return Ok(None);
        }
        let taken: Vec<&usize> = self.port_of.values().collect();
        (0..self.ports.len())
            .find(|i| !taken.contains(&i) && !lock(&self.ports[*i].bridge).slot_occupied())
            .map(Some)
            .ok_or_else(|| {
                HotplugError::Conflict(format!(
                    "no free PCIe root port: all {} root ports for hot-plug hold a device \
                     (DELETE one, or start the VM with more --pcie-root-ports)",
                    self.ports.len()
                ))
            })
    }

    /// The root port `id`'s device is in; None for a device on bus 0.
    fn port_holding(&self, id: &str) -> Option<&HotplugPort> {
        self.port_of.get(id).and_then(|&i| self.ports.get(i))
    }

    /// Asks the guest to give up `id`'s device at `bdf`: its root port's attention button
    /// is pressed, or (bus 0) its ACPI slot's eject is requested.
    fn ask_eject(&self, id: &str, bdf: PciBdf) {
        match self.port_holding(id) {
            Some(port) => lock(&port.bridge).press_attention_button(),
            None => lock(self.controller_of(bdf)).request_eject(bdf.device),
        }
    }

    /// Whether the guest let `id`'s device at `bdf` go: it turned its root port's slot
    /// off, or (bus 0) ejected its ACPI slot.
    fn let_go(&self, id: &str, bdf: PciBdf) -> bool {
        match self.port_holding(id) {
            Some(port) => lock(&port.bridge).take_powered_off(),
            None => lock(self.controller_of(bdf)).take_ejected(bdf.device),
        }
    }

    /// Withdraws the request of [`PciHotplug::ask_eject`].
    fn withdraw_eject(&self, id: &str, bdf: PciBdf) {
        match self.port_holding(id) {
            Some(port) => lock(&port.bridge).release_attention_button(),
            None => lock(self.controller_of(bdf)).cancel_eject(bdf.device),
        }
    }

    /// Takes the device at `bdf` (in root port `port`, else on bus 0) off its bus.
    fn off_the_bus(&self, port: Option<usize>, bdf: PciBdf) {
        match port.and_then(|i| self.ports.get(i)) {
            Some(port) => {
                self.root.remove_behind(&[port.slot, bdf.device]);
            }
            None => {
                if let Some(root) = self.root_of(bdf.segment) {
                    root.remove_device(bdf);
                }
            }
        }
    }

    /// Takes over the cold-plugged devices' clique numbering.
    pub(crate) fn set_cliques(&mut self, cliques: gpuvm_vfio::topology::CliqueAssigner) {
        self.cliques = cliques;
    }

    /// The DMA contexts that cannot map peers' BARs (iommufd), and why.
    pub fn peer_dma_limits(&self) -> Vec<String> {
        self.peers.limits()
    }

    /// Shares the cold-plugged devices' peer-to-peer DMA mappings with the devices
    /// hot-plugged from now on.
    pub(crate) fn set_peer_dma(&mut self, peers: Arc<PeerDma>) {
        self.peers = peers;
    }

    /// Shares the VM's KVM VFIO device (the cold-plugged devices' too) with the kernel
    /// VFIO devices hot-plugged from now on.
    pub(crate) fn set_kvm_vfio(&mut self, kvm_vfio: Arc<crate::pci::SharedKvmVfio>) {
        self.kvm_vfio = kvm_vfio;
    }

    /// RAM hot-plugged into the VM (vm.resize): devices plugged from now on map it too.
    pub(crate) fn add_ram(&mut self, ram: &GuestRam) {
        self.ram.add(ram);
    }

    /// Hot-plugged RAM the guest gave back: devices plugged from now on leave it out.
    pub(crate) fn remove_ram(&mut self, guest_addr: u64, size: u64) {
        self.ram.remove(guest_addr, size);
    }

    /// The register block, for the port-I/O bus.
    pub fn controller(&self) -> Arc<Mutex<HotplugController>> {
        self.controller.clone()
    }

    /// Segment 0's 64-bit BAR window (start, size), where devices are hot-plugged.
    pub fn mmio64_window(&self) -> (u64, u64) {
        let config = self.root.config();
        (config.mmio64_start, config.mmio64_size)
    }

    /// Segment 0's allocations for a snapshot. The root ports for hot-plug are left out
    /// of its slots ([`PciHotplug::save_root_ports`] keeps them, and a restore rebuilds
    /// them in those slots); the ranges of the root's windows they hold stay taken in its
    /// windows' bookkeeping.
    pub fn save_root(
        &self,
    ) -> Result<gpuvm_devices::pci::PciRootState, gpuvm_devices::pci::PciError> {
        let mut state = self.root.save()?;
        state
            .slots
            .retain(|saved| !self.ports.iter().any(|port| port.slot == saved.slot));
        Ok(state)
    }

    /// Ends a restore of the roots' allocations (segment 0's; a live update's segments
    /// 1.. too): every saved function must be back.
    pub fn finish_root_restore(&self) -> Result<(), gpuvm_devices::pci::PciError> {
        self.root.finish_restore()?;
        self.segments
            .iter()
            .try_for_each(|segment| segment.root.finish_restore())
    }

    /// Segments 1..'s windows, allocations and host-mirroring ports, for a live update,
    /// segment 1's first.
    pub fn save_segments(
        &self,
    ) -> Result<Vec<crate::pci::SavedPciSegment>, gpuvm_devices::pci::PciError> {
        (self.segments.iter())
            .map(|segment| {
                let mut root = segment.root.save()?;
                let topology_ports =
                    crate::pci_topology::save_topology_ports(&segment.root, &mut root);
                Ok(crate::pci::SavedPciSegment {
                    config: segment.root.config(),
                    root,
                    topology_ports,
                })
            })
            .collect()
    }

    /// Segment 0's register block's state for a snapshot.
    pub fn save_controller(&self) -> HotplugState {
        let Ok(state) = lock(&self.controller).save();
        state
    }

    /// Loads segment 0's register block's saved state (a restore).
    pub fn restore_controller(&self, state: &HotplugState) {
        let Ok(()) = lock(&self.controller).restore(state);
    }

    /// The register blocks of segments 1.. for a snapshot, segment 1's first.
    pub fn save_segment_controllers(&self) -> Vec<HotplugState> {
        (self.segments.iter())
            .map(|s| {
                let Ok(state) = lock(&s.controller).save();
                state
            })
            .collect()
    }

    /// Loads the saved states of segments 1..'s register blocks (a restore); a state for a
    /// segment the VM lacks is refused.
    pub fn restore_segment_controllers(&self, states: &[HotplugState]) -> Result<(), String> {
        if states.len() > self.segments.len() {
            return Err(format!(
                "the snapshot has PCI hot-plug state for {} further segment(s), the VM {}",
                states.len(),
                self.segments.len()
            ));
        }
        for (segment, state) in self.segments.iter().zip(states) {
            let Ok(()) = lock(&segment.controller).restore(state);
        }
        Ok(())
    }

    /// Where the guest's ejects are signalled (the VMM thread's wake-up eventfd).
    pub fn set_wake(&mut self, wake: EventFd) {
        if self.wake.is_some() {
            return;
        }
        let controllers =
            std::iter::once(&self.controller).chain(self.segments.iter().map(|s| &s.controller));
        for controller in controllers {
            match wake.try_clone() {
                Ok(copy) => lock(controller).set_wake(copy),
                Err(error) => log::warn!("hot-plug: cannot share the wake-up eventfd: {error}"),
            }
        }
        // The root ports' slots report the guest turning them off to it.
        for port in &self.ports {
            match wake.try_clone() {
                Ok(copy) => lock(&port.bridge).set_power_off_notice(copy),
                Err(error) => log::warn!("hot-plug: cannot share the wake-up eventfd: {error}"),
            }
        }
        // Devices plugged before there was a run loop (a restore's) report to it too.
        for health in self.devices.values().filter_map(|d| d.health.as_ref()) {
            if let Ok(copy) = wake.try_clone() {
                health.set_wake(copy);
            }
        }
        self.wake = Some(wake);
    }

    /// The background DMA mappings of the hot-plugged devices.
    pub fn dma_mappings(&self) -> impl Iterator<Item = &BackgroundMapping> {
        self.devices.values().filter_map(|d| d.mapping.as_ref())
    }

    /// Vendor and device id of the hot-plugged device `id`.
    pub fn pci_ids(&self, id: &str) -> Option<(u16, u16)> {
        Some(lock(&self.devices.get(id)?.device).pci_ids())
    }

    /// What device `id` was plugged with (as saved, for a device a restore or a live
    /// update brought back).
    pub fn plug_body(&self, id: &str) -> Option<GpuBody> {
        Some(self.devices.get(id)?.source.clone())
    }

    /// The ids and bus addresses of the hot-plugged devices.
    pub fn attached(&self) -> impl Iterator<Item = (&str, PciBdf)> {
        self.devices.iter().map(|(id, d)| (id.as_str(), d.bdf))
    }

    /// The "BDF name" labels of the hot-plugged devices.
    pub fn labels(&self) -> impl Iterator<Item = String> + '_ {
        self.devices.values().map(|d| d.label.clone())
    }

    /// Whether `id` is a hot-plugged device.
    pub fn contains(&self, id: &str) -> bool {
        self.devices.contains_key(id)
    }

    /// Plugs the device of `body` into a free slot and tells the guest; returns its
    /// bus address and its "BDF name" label.
    pub fn plug(&mut self, body: &GpuBody) -> Result<(PciBdf, String), HotplugError> {
        self.plug_expecting(body, None)
    }

    /// As [`PciHotplug::plug`], refusing (before the guest hears of it) a device whose
    /// vendor and device id are not `expected`: a GPU given back to a guest that released
    /// one of that model for a snapshot.
    pub fn plug_expecting(
        &mut self,
        body: &GpuBody,
        expected: Option<(u16, u16)>,
    ) -> Result<(PciBdf, String), HotplugError> {
        let id = body.gpu_id.clone();
        if self.devices.contains_key(&id) {
            return Err(HotplugError::Conflict(format!(
                "a device with id {id:?} is already attached"
            )));
        }
        let device_error = |source: PciSetupError| HotplugError::Device {
            id: id.clone(),
            source,
        };
        // Another segment's devices go on its bus 0 (the root ports are segment 0's).
        let segment = body.pci_segment.unwrap_or(0);
        if self.root_of(segment).is_none() {
            return Err(HotplugError::NoSegment {
                id,
                segment,
                count: self.segments.len() as u16 + 1,
            });
        }
        let port = if segment == 0 {
            self.free_port()?
        } else {
            None
        };
        let opened = self.open_backend(body).map_err(device_error)?;
        let plug = self.plugger(segment);
        let progress = self.ram.progress(opened.mapper.name());
        let port_place = port.map(|i| (self.ports[i].slot, self.ports[i].bridge.clone()));
        let open = |backend| match &port_place {
            None => plug.open(backend, &progress),
            Some((slot, bridge)) => plug.open_with(backend, &progress, |root, device| {
                let (memory, prefetchable) = {
                    let bridge = lock(bridge);
                    (bridge.memory_window(), bridge.prefetchable_window())
                };
                let specs = lock(&device).bar_specs();
                let bars = bars_in_port(&specs, memory, prefetchable).map_err(|why| {
                    log::error!("hot-plug: root port 00:{slot:02x}.0: {why}");
                    gpuvm_devices::pci::PciError::Layout(
                        "the device's BARs do not fit the root port's windows (see the log)",
                    )
                })?;
                root.add_behind(&[*slot, 0], device, &bars, true)
            }),
        };
        // vfio-user: plugging resets the device, so map after that. Kernel VFIO: the
        // container maps for every device in it, and pinning takes longest: start first.
        let (plugged, mapping) = if opened.vfio.is_none() {
            let plugged = open(opened.backend).map_err(device_error)?;
            let mapping = self
                .ram
                .start_with(progress.clone(), opened.mapper, self.hooks, None)
                .map_err(|e| {
                    self.off_the_bus(port, plugged.bdf);
                    device_error(e.into())
                })?;
            (plugged, mapping)
        } else {
            let mapping = self
                .ram
                .start_with(progress.clone(), opened.mapper, self.hooks, None)
                .map_err(|e| device_error(e.into()))?;
            let plugged = open(opened.backend).map_err(device_error)?;
            (plugged, mapping)
        };
        let (health, watch, vfio) = (opened.health, opened.watch, opened.vfio);
        let connection = opened.connection;
        let bdf = plugged.bdf;
        let kernel = self.kernel_context(
            opened.kernel_handle,
            vfio.as_ref(),
            (bdf, &plugged.device),
            &progress,
        );
        let ids = lock(&plugged.device).pci_ids();
        if let Some(expected) = expected.filter(|expected| *expected != ids) {
            self.off_the_bus(port, bdf);
            drop(mapping);
            drop(plugged.device);
            self.router.release(&plugged.gsis);
            return Err(HotplugError::Conflict(format!(
                "{id} is a {:04x}:{:04x} device; the guest released a {:04x}:{:04x} and resumes only on that model",
                ids.0, ids.1, expected.0, expected.1
            )));
        }
        // Before the guest hears of it: an explicit clique, else the host device's.
        let host = body.host_bdf.as_deref();
        let clique = body.gpudirect_clique;
        (self.cliques).apply(&mut lock(&plugged.device), clique, host);
        // Under the VMM thread's filter already: the p2p-map thread inherits it.
        self.join_peers(&id, opened.peer, &plugged.device, None);
        match port {
            Some(i) => lock(&self.ports[i].bridge).card_inserted(),
            None => lock(self.controller_of(bdf)).device_added(bdf.device),
        }
        log::info!("hot-plug: {id} is {} ({})", plugged.label, bdf.full());
        let label = plugged.label.clone();
        if let Some(port) = port {
            self.port_of.insert(id.clone(), port);
        }
        self.devices.insert(
            id,
            HotDevice {
                bdf,
                label: plugged.label,
                mapping: Some(mapping),
                health,
                _watch: watch,
                gone: None,
                device: plugged.device,
                _vfio: vfio,
                gsis: plugged.gsis,
                ejecting: false,
                source: body.clone(),
                stopped: false,
                held_for_dma: Arc::default(),
                connection,
                kernel,
            },
        );
        Ok((bdf, label))
    }

    /// What a live update hands over of a kernel VFIO device's own context (`vfio`, with
    /// the device `handle` names, plugged at `bdf`): the RAM chunks its mapping (`progress`)
    /// maps, one DMA map call each. None for a vfio-user device.
    fn kernel_context(
        &self,
        handle: Option<KernelHandle>,
        vfio: Option<&KernelVfio>,
        (bdf, device): (PciBdf, &Arc<Mutex<gpuvm_vfio::pci::VfioPciDevice>>),
        progress: &Arc<gpuvm_vfio::dma::DmaProgress>,
    ) -> Option<crate::update::handed_over::PluggedKernelContext> {
        let ((host_bdf, cdev, mark), vfio) = handle.zip(vfio)?;
        let device = crate::update::handed_over::PluggedKernelVfio {
            host_bdf,
            bdf,
            device: device.clone(),
            cdev,
            mark,
        };
        Some(crate::update::handed_over::PluggedKernelContext::new(
            vfio.hand_over(),
            self.ram.map_calls(),
            progress.clone(),
            vec![device],
        ))
    }

    /// Makes the plugged device `id` a peer of the others: their BARs are DMA-mapped in
    /// its context, and its BARs in theirs wherever the guest has them now and later.
    /// `on_thread_start` confines the p2p-map thread if it starts now (None: the caller's
    /// thread is confined already). A failure is logged: the device works without peers.
    fn join_peers(
        &mut self,
        id: &str,
        (mapper, bars): (PeerMapperChoice, PeerBars),
        device: &Mutex<gpuvm_vfio::pci::VfioPciDevice>,
        on_thread_start: Option<gpuvm_vfio::dma::ThreadStartHook>,
    ) {
        if let Err(error) = self.peers.ensure_worker(on_thread_start) {
            log::warn!("hot-plug: {id}: {error}; no peer-to-peer DMA mappings for it");
            return;
        }
        let name = mapper
            .as_ref()
            .map_or_else(|u| u.context.clone(), |m| m.name());
        let context = self.peers.add_context(name, mapper);
        let peer = self.peers.plugged(context, bars, device);
        self.peer_ids.insert(id.to_string(), peer);
    }

    /// What plugs a device into this VM's segment `segment` (the cold-plug path); segment
    /// 0's for a segment the VM lacks (callers check it first).
    fn plugger(&self, segment: u16) -> Plug<'_> {
        Plug {
            vm: &self.vm,
            root: self.root_of(segment).unwrap_or(&self.root),
            router: &self.router,
            slots: &self.slots,
        }
    }

    /// Connects (vfio-user) or opens (kernel VFIO) the device `body` names, with the DMA
    /// mapper for it; nothing is on the bus yet.
    fn open_backend(&self, body: &GpuBody) -> Result<OpenedBackend, PciSetupError> {
        if let Some(socket) = &body.vfio_user_socket {
            let backend = VfioUserDevice::connect(socket)?;
            let health = backend.health();
            if let Some(wake) = self.wake.as_ref().and_then(|w| w.try_clone().ok()) {
                health.set_wake(wake);
            }
            let bars = PeerBars::new(backend.name(), &body.tuning(), |i| backend.region_file(i));
            Ok(OpenedBackend {
                peer: (Ok(backend.peer_mapper()), bars),
                connection: Some(backend.connection()),
                watch: backend.watch_hang_up(),
                mapper: backend.dma_mapper(),
                health: Some(health),
                backend: Box::new(backend),
                vfio: None,
                kernel_handle: None,
            })
        } else if let Some(bdf) = &body.host_bdf {
            let vfio = KernelVfio::open(bdf, Some(self.kvm_vfio.get(&self.vm)?))?;
            let device = vfio.open_device(bdf)?;
            let bars = PeerBars::new(bdf.clone(), &body.tuning(), |i| device.region_file(i));
            let kernel_handle = (
                bdf.clone(),
                device.hand_over().map_err(|e| e.to_string()),
                device.hand_over_mark(),
            );
            let backend: Box<dyn PassthroughDevice> = Box::new(device);
            gpuvm_vfio::host::check_memlock(self.ram_size())?;
            Ok(OpenedBackend {
                peer: (vfio.peer_mapper(), bars),
                mapper: vfio.dma_mapper(),
                backend,
                health: None,
                watch: None,
                vfio: Some(vfio),
                connection: None,
                kernel_handle: Some(kernel_handle),
            })
        } else {
            Err(PciSetupError::Device(gpuvm_vfio::VfioError::NotPci(
                "the body names no device".into(),
            )))
        }
    }

    fn ram_size(&self) -> u64 {
        self.ram.total()
    }

    /// Asks the guest to eject `id`'s device (a passthrough device, or one of the
    /// hot-plugged virtio devices among `virtio`).
    pub fn request_eject(
        &mut self,
        virtio: &[VirtioHandle],
        id: &str,
    ) -> Result<PciBdf, HotplugError> {
        if !self.devices.contains_key(id) {
            if let Some(result) = self.request_virtio_eject(virtio, id) {
                return result;
            }
        }
        // A device restored behind the switch ports of a host-mirroring layout
        // (crate::pci_topology) has neither an ACPI slot nor a hot-plug slot.
        if self.devices.get(id).is_some_and(|d| d.bdf.bus != 0) && !self.port_of.contains_key(id) {
            return Err(HotplugError::Conflict(format!(
                "{id} sits behind a port of the VM's PCIe topology, which has no hot-plug slot: \
                 it cannot be removed"
            )));
        }
        let device = self
            .devices
            .get_mut(id)
            .ok_or_else(|| HotplugError::NotFound(id.to_string()))?;
        if device.gone.is_some() {
            // Already asked when it went; the DELETE waits for the same eject.
            return Ok(device.bdf);
        }
        if device.ejecting {
            return Err(HotplugError::Conflict(format!(
                "{id} is already being removed"
            )));
        }
        device.ejecting = true;
        let bdf = device.bdf;
        self.ask_eject(id, bdf);
        log::info!("hot-unplug: asked the guest to eject {id} ({})", bdf.full());
        Ok(bdf)
    }

    /// Takes `id`'s device down if the guest ejected it (a virtio device's handle leaves
    /// `virtio`).
    pub fn poll_eject(
        &mut self,
        virtio: &mut Vec<VirtioHandle>,
        id: &str,
    ) -> Result<EjectState, HotplugError> {
        if !self.devices.contains_key(id) {
            if let Some(state) = self.poll_virtio_eject(virtio, id) {
                return Ok(state);
            }
        }
        let device = self
            .devices
            .get(id)
            .ok_or_else(|| HotplugError::NotFound(id.to_string()))?;
        if !self.let_go(id, device.bdf) {
            return Ok(EjectState::Waiting);
        }
        let label = self.remove(id).unwrap_or_default();
        Ok(EjectState::Removed(label))
    }

    /// The guest did not eject `id` in time: withdraw the request, keep the device. A
    /// gone device is taken down instead (nothing is left to keep); returns its label then.
    pub fn cancel_eject(&mut self, virtio: &[VirtioHandle], id: &str) -> Option<String> {
        if !self.devices.contains_key(id) && self.cancel_virtio_eject(virtio, id) {
            return None;
        }
        if self.devices.get(id).is_some_and(|d| d.gone.is_some()) {
            log::warn!(
                "hot-unplug: the guest did not eject {id}, whose process is gone; freeing its slot"
            );
            return self.remove(id);
        }
        if let Some(device) = self.devices.get_mut(id) {
            device.ejecting = false;
            let bdf = device.bdf;
            self.withdraw_eject(id, bdf);
        }
        None
    }

    /// Why `id`'s device is gone, if its process went away.
    pub fn gone_reason(&self, id: &str) -> Option<&str> {
        Some(self.devices.get(id)?.gone.as_ref()?.reason.as_str())
    }

    /// Marks the devices whose process went away as gone and asks the guest to eject
    /// them; returns the deadlines of the newly gone ones (the slot is freed then at the
    /// latest, see [`PciHotplug::free_gone`]).
    pub fn check_backends(&mut self) -> Vec<Instant> {
        let mut deadlines = Vec::new();
        let mut asks = Vec::new();
        for (id, device) in &mut self.devices {
            if device.gone.is_some() {
                continue;
            }
            let Some(health) = device.health.as_ref().filter(|h| h.is_gone()) else {
                continue;
            };
            let reason = health
                .reason()
                .unwrap_or_else(|| "the device process went away".into());
            let deadline = Instant::now() + eject_timeout();
            log::error!(
                "hot-plug: {id} ({}) is gone: {reason}; asking the guest to eject it",
                device.bdf.full()
            );
            if !device.ejecting {
                device.ejecting = true;
                asks.push((id.clone(), device.bdf));
            }
            device.gone = Some(GoneDevice { reason, deadline });
            deadlines.push(deadline);
        }
        for (id, bdf) in asks {
            self.ask_eject(&id, bdf);
        }
        deadlines
    }

    /// Frees the slots of gone devices that the guest ejected, or whose eject deadline
    /// passed, unless `skip` (a pending DELETE answers for those); returns their labels.
    pub fn free_gone(&mut self, skip: &[&str]) -> Vec<String> {
        let now = Instant::now();
        let due: Vec<String> = self
            .devices
            .iter()
            .filter(|(id, _)| !skip.contains(&id.as_str()))
            .filter_map(|(id, device)| {
                let gone = device.gone.as_ref()?;
                let ejected = self.let_go(id, device.bdf);
                if !ejected && now < gone.deadline {
                    return None;
                }
                if !ejected {
                    log::warn!("hot-unplug: the guest did not eject {id}, whose process is gone; freeing its slot");
                }
                Some(id.clone())
            })
            .collect();
        due.iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Each hot-plugged device: id, address, and whether it is attached, being ejected
    /// or gone (with why), for GET / and GET /metrics.
    pub fn describe(&self) -> Vec<serde_json::Value> {
        self.devices
            .iter()
            .map(|(id, device)| {
                let state = match (&device.gone, device.ejecting) {
                    (Some(_), _) => "gone",
                    (None, true) => "ejecting",
                    (None, false) => "attached",
                };
                serde_json::json!({
                    "id": id,
                    "bdf": device.bdf.full(),
                    "device": device.label,
                    "state": state,
                    "error": device.gone.as_ref().map(|g| g.reason.clone()),
                })
            })
            .collect()
    }

    /// Takes `id`'s device off the bus (if the guest has not) and tears it down: the DMA
    /// mapping stops, BAR slots are unmapped, MSI-X goes off, the device is reset and its
    /// connection or VFIO context closed; its MSI routes are dropped. Returns its label.
    fn remove(&mut self, id: &str) -> Option<String> {
        let mut device = self.devices.remove(id)?;
        // Its BARs leave the peers' contexts before its BAR mmaps go.
        if let Some(peer) = self.peer_ids.remove(id) {
            self.peers.remove_device(peer);
        }
        match self.port_of.remove(id) {
            Some(port) => {
                self.off_the_bus(Some(port), device.bdf);
                if let Some(port) = self.ports.get(port) {
                    lock(&port.bridge).card_removed();
                }
            }
            None => {
                lock(self.controller_of(device.bdf)).forget(device.bdf.device);
                self.off_the_bus(None, device.bdf);
            }
        }
        drop(device.mapping.take());
        // The hand-over's record of its context holds the device too.
        drop(device.kernel.take());
        let gsis = std::mem::take(&mut device.gsis);
        let label = device.label.clone();
        if Arc::strong_count(&device.device) > 1 {
            log::warn!("hot-unplug: {label} is still referenced; it is reset when released");
        }
        drop(device);
        self.router.release(&gsis);
        log::info!("hot-unplug: {id} ({label}) removed and reset");
        Some(label)
    }
}
