//! The one action type between the front ends (the API server's routes, later other
//! VMMs' APIs) and the VMM thread's [`crate::controller`], and the JSON bodies the actions
//! carry. Bodies reject unknown fields.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use gpuvm_arch::x86_64::boot::{BootSource, KernelSource};
use gpuvm_arch::x86_64::cpuid::CpuidMask;
pub use gpuvm_arch::x86_64::layout::MAX_PCI_SEGMENTS;
use gpuvm_memory::Backing;
use serde::{Deserialize, Serialize};

use gpuvm_virtio::balloon::BalloonConfig;
use gpuvm_virtio::block::BlockConfig;
use gpuvm_virtio::net::NetConfig;
use gpuvm_virtio::rng::RngConfig;
use gpuvm_virtio::vhost_user::{FsConfig, VhostUserBlockConfig};
use gpuvm_virtio::vsock::VsockConfig;

use crate::config::{MachineConfig, NumaMode, NumaNodeSpec, NumaOptions};

/// Largest guest memory the API accepts, in MiB (keeps `mem_size_mib << 20` in range;
/// the host's own limits are checked when the VM is built).
pub const MAX_MEM_SIZE_MIB: u64 = 1 << 24;
/// Hot-plugged RAM comes in whole memory blocks of this size (see
/// gpuvm_devices::memory_hotplug).
pub use gpuvm_devices::memory_hotplug::MEMORY_BLOCK_SIZE;

/// Most vCPUs a VM may have (booted or hot-plugged): every one has a local APIC entry in
/// the MADT and the MP table, whose 8-bit ids leave room for the IOAPIC's.
pub const MAX_VCPUS: u8 = gpuvm_arch::x86_64::mptable::MAX_MPTABLE_CPUS;

/// What the API thread asks the VMM thread to do.
#[derive(Debug)]
pub enum VmmAction {
    GetInstanceInfo,
    GetMachineConfig,
    PutMachineConfig(MachineConfigBody),
    /// PATCH /machine-config (Firecracker's): the given fields over the configuration the
    /// VMM thread holds, read and replaced in one step.
    PatchMachineConfig(MachineConfigPatch),
    PutBootSource(BootSourceBody),
    /// PUT /gpus/{id}: a passthrough device for the VM being configured, or hot-plugged
    /// into the running VM.
    PutGpu(GpuBody),
    /// DELETE /gpus/{id}: drop a configured device, or hot-unplug it from the running VM
    /// (the guest is asked to eject it first).
    DeleteGpu(String),
    /// Ask the guest to eject a hot-plugged device (a GPU or a virtio device) and answer
    /// at once (Cloud Hypervisor's vm.remove-device after boot): the device goes when the
    /// guest ejects it. Before start it drops any configured device of that id: a
    /// passthrough device, a drive, a network interface, a share (by tag), vsock, rng.
    RemoveDevice(String),
    /// A virtio device hot-plugged into the running VM (Cloud Hypervisor's vm.add-disk,
    /// add-net, add-vsock after vm.boot; vhost-user devices are refused); answers `{id, bdf}`.
    HotplugVirtio(VirtioHotplug),
    /// PUT /drives/{id}: a virtio block device for the VM being configured.
    PutDrive(DriveBody),
    /// PUT /fs/{tag}: a virtio-fs share served by virtiofsd, before start.
    PutFs(FsConfig),
    /// PATCH /drives/{id}: a new backing file or rate limit for a running VM's drive.
    PatchDrive(DrivePatchBody),
    /// PUT /network-interfaces/{id}: a virtio network interface before start.
    PutNetworkInterface(NetConfig),
    /// A virtio network interface before start whose tap queues came as descriptors
    /// (Cloud Hypervisor's vm.add-net passes them with SCM_RIGHTS): one per queue pair,
    /// checked (TUNGETIFF) by the controller at once; `config.host_dev_name` is ignored.
    PutNetworkInterfaceFds {
        config: NetConfig,
        fds: Vec<OwnedFd>,
    },
    /// Tap queues for a network interface of the snapshot about to be loaded that came
    /// as descriptors (Cloud Hypervisor's vm.restore `net_fds`): one per queue pair.
    PassTaps {
        iface_id: String,
        fds: Vec<OwnedFd>,
    },
    /// PUT /vsock: the vsock device before start.
    PutVsock(VsockConfig),
    /// PUT /entropy: the entropy device before start.
    PutEntropy(RngConfig),
    /// The VM's PCI segment groups and which virtio device goes on which, before start.
    PutPciSegments(PciSegmentsBody),
    /// PUT /balloon: the memory balloon before start (refused with passthrough devices).
    PutBalloon(BalloonConfig),
    /// PATCH /balloon: a new target (before start, or for the running guest's driver).
    PatchBalloon(BalloonUpdateBody),
    /// GET /balloon: the balloon's configuration, with the target in force.
    GetBalloon,
    /// GET /balloon/statistics: target, actual and the guest's last statistics.
    GetBalloonStats,
    /// PATCH /balloon/statistics: a new statistics polling interval.
    PatchBalloonStats(BalloonStatsUpdateBody),
    StartInstance,
    /// The test guest has no keyboard: this ends the run as a guest reset would.
    SendCtrlAltDel,
    Pause,
    Resume,
    CreateSnapshot(SnapshotCreateBody),
    /// PUT /vmm/update: hand the running VM to the new gpuvm listening on a socket
    /// (crate::update; `gpuvm update` starts that one and asks for this).
    LiveUpdate {
        body: LiveUpdateBody,
        /// A duplicate of the API server's listening socket, which has stopped accepting
        /// for the update: it goes to the new process with `Commit`, so the socket keeps
        /// its path and answers throughout (None where the API has none to give).
        api_listener: Option<OwnedFd>,
    },
    LoadSnapshot(SnapshotLoadBody),
    /// A load that changes the restored VM (Firecracker's `track_dirty_pages`,
    /// `network_overrides` and `vsock_override`).
    LoadSnapshotWith {
        load: SnapshotLoadBody,
        overrides: LoadOverrides,
    },
    GetMetrics,
    /// Several pre-boot actions carried out as one unit (Cloud Hypervisor's vm.create):
    /// all of them apply, or none (the configuration is as it was). Only configuration
    /// actions (Put*); refused once the VM started.
    Batch(Vec<VmmAction>),
    /// End the VMM (Cloud Hypervisor's vmm.shutdown and vm.shutdown): before start the
    /// process ends without running a VM; while running, the run ends as
    /// SendCtrlAltDel's does.
    ShutdownVmm,
    /// Log lines also to a file or FIFO (Firecracker's PUT /logger), any time.
    PutLogger(LoggerConfig),
    /// The metrics output (Firecracker's PUT /metrics), any time.
    PutMetrics(MetricsConfig),
    /// Write the counters to the metrics output (Firecracker's FlushMetrics).
    FlushMetrics,
    /// Change the VM's vCPU count or memory size (Cloud Hypervisor's vm.resize). vCPUs
    /// come and go by ACPI hot-plug, between 1 and the machine's `max_vcpus`; before
    /// start the count to boot with changes. Memory cannot change yet: only the current
    /// size (or none) is accepted. A resize to what the VM has is a no-op.
    Resize {
        desired_vcpus: Option<u8>,
        desired_ram: Option<u64>,
    },
    /// Create the VM from a whole configuration (Cloud Hypervisor's vm.create): the
    /// configuration actions as one unit (as [`VmmAction::Batch`]), after which the VM is
    /// `Created`; the controller keeps `record`, the configuration as the client gave it,
    /// for the client to read back. Refused (409) when the VM exists.
    CreateVm {
        actions: Vec<VmmAction>,
        record: ClientRecord,
    },
    /// Boot the VM [`VmmAction::CreateVm`] made (Cloud Hypervisor's vm.boot): 404 when
    /// none was created, 409 once booted.
    BootCreated,
    /// A device added to a created VM (Cloud Hypervisor's vm.add-*): the client's request,
    /// turned into an [`AddDevice`] against the client's record as it stands when the
    /// controller takes it (so the peer's own rules see the configuration the device
    /// joins), configured before boot (answers Empty) or hot-plugged after (answers
    /// `{id, bdf}`; a hot-plug the VM cannot take now is a bad request naming the
    /// device's kind), its id made up when the client gave none: checked and carried out
    /// as one step.
    AddDevice(AddDeviceRequest),
    /// A restore whose snapshot's network interfaces take tap queues passed as
    /// descriptors (Cloud Hypervisor's vm.restore `net_fds`), as one step; the restored
    /// VM counts as created.
    RestoreWithTaps {
        load: SnapshotLoadBody,
        taps: Vec<(String, Vec<OwnedFd>)>,
    },
    /// A configuration request whose body the client reads back later (Firecracker's
    /// GET /vm/config): `action`, and once it succeeded `entry` in the client's record
    /// (replacing an entry of the same section and id).
    Recorded {
        action: Box<VmmAction>,
        entry: ClientDevice,
    },
    /// Bodies the client's record keeps that took effect without an action of their own
    /// (a Firecracker config file's sections, carried out by their actions already).
    Remember(Vec<ClientDevice>),
    /// Replace the VM's MMDS data store (Firecracker's PUT /mmds), any time. A store over
    /// its size limit is refused with status 413 (Payload Too Large), others with 400.
    PutMmds(serde_json::Value),
    /// A JSON merge patch over the MMDS data store (PATCH /mmds), any time; refused as
    /// [`VmmAction::PutMmds`] is.
    PatchMmds(serde_json::Value),
    /// The MMDS data store (GET /mmds), answered as JSON.
    GetMmds,
    /// Which network interfaces answer MMDS, with its version and address (PUT
    /// /mmds/config): before start only, and each interface it names must be configured.
    PutMmdsConfig(gpuvm_mmds::MmdsConfig),
    /// The MMDS data store's limit in bytes (Firecracker's `--mmds-size-limit`), any
    /// time: later PUTs and PATCHes that make the store larger are refused.
    SetMmdsSizeLimit(usize),
}

/// What a client that configures its VM as one document (Cloud Hypervisor) gave: the
/// document without its devices, and each device as the client named it. The
/// controller keeps it, adds and drops devices as they come and go, and returns it
/// in GetInstanceInfo's `client_record`; the front end puts the document back together.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientRecord {
    pub document: serde_json::Value,
    pub devices: Vec<ClientDevice>,
}

/// One device of a [`ClientRecord`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClientDevice {
    /// The id the client knows it by (given, or made up for it).
    pub client_id: String,
    /// The id gpuvm's actions name it by (a share's tag, `vsock`, else the same).
    pub device_id: String,
    /// Where in the document it goes back (the client's section name).
    pub section: String,
    /// The client's body for it, with its id filled in.
    pub body: serde_json::Value,
}

/// How a client's device request becomes an [`AddDevice`]: given the client's record as
/// the controller holds it when it takes the action.
type DeviceTranslation = Box<dyn FnOnce(&ClientRecord) -> Result<AddDevice, ActionError> + Send>;

/// The request of [`VmmAction::AddDevice`]: the front end's translation of the client's
/// body, run by the controller so that the check and the add are one step (a second add
/// between them cannot change what was checked).
pub struct AddDeviceRequest(DeviceTranslation);

impl AddDeviceRequest {
    pub fn new(
        translate: impl FnOnce(&ClientRecord) -> Result<AddDevice, ActionError> + Send + 'static,
    ) -> Self {
        AddDeviceRequest(Box::new(translate))
    }

    /// A device already in gpuvm's terms, whatever the record holds.
    pub fn ready(add: AddDevice) -> Self {
        AddDeviceRequest::new(move |_| Ok(add))
    }

    pub fn translate(self, record: &ClientRecord) -> Result<AddDevice, ActionError> {
        (self.0)(record)
    }
}

impl std::fmt::Debug for AddDeviceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AddDeviceRequest")
    }
}

/// A device for [`VmmAction::AddDevice`].
#[derive(Debug)]
pub struct AddDevice {
    /// The pre-boot action that configures the device (PutDrive, PutNetworkInterface,
    /// PutNetworkInterfaceFds, PutFs, PutVsock, PutGpu); the controller sets its id.
    pub action: Box<VmmAction>,
    /// The id the client gave; None makes one up: `id_prefix` and the first number no
    /// device of the VM has.
    pub client_id: Option<String>,
    pub id_prefix: String,
    /// Whether gpuvm names the device by the client's id (false for a share, named by
    /// its tag, and vsock).
    pub named_by_client_id: bool,
    /// The PCI segment the client asked for a device other than a GPU (a GPU's is its
    /// body's `pci_segment`); such devices are hot-plugged on segment 0 only.
    pub segment: u16,
    /// What the client calls this kind of device ("disk", "GPU"), for a refused hot-plug.
    pub noun: String,
    /// Where the client's body goes in its [`ClientRecord`], and the body.
    pub section: String,
    pub body: serde_json::Value,
}

impl VmmAction {
    /// The id of the device a pre-boot device action configures.
    pub fn device_id(&self) -> Option<String> {
        Some(match self {
            VmmAction::PutDrive(body) => body.drive_id().to_string(),
            VmmAction::PutNetworkInterface(config)
            | VmmAction::PutNetworkInterfaceFds { config, .. } => config.iface_id.clone(),
            VmmAction::PutGpu(body) => body.gpu_id.clone(),
            VmmAction::PutFs(body) => body.tag.clone(),
            VmmAction::PutVsock(_) => "vsock".to_string(),
            _ => return None,
        })
    }

    /// Names the device a pre-boot device action configures `id` (drives, network
    /// interfaces and passthrough devices; a share keeps its tag, vsock its name).
    pub fn set_device_id(&mut self, id: &str) {
        match self {
            VmmAction::PutDrive(DriveBody::Local(config)) => config.drive_id = id.to_string(),
            VmmAction::PutDrive(DriveBody::VhostUser(config)) => config.drive_id = id.to_string(),
            VmmAction::PutNetworkInterface(config)
            | VmmAction::PutNetworkInterfaceFds { config, .. } => config.iface_id = id.to_string(),
            VmmAction::PutGpu(body) => body.gpu_id = id.to_string(),
            _ => {}
        }
    }
}

/// A virtio device to hot-plug: the body of the pre-boot action that configures its kind.
#[derive(Debug)]
pub enum VirtioHotplug {
    Drive(DriveBody),
    Fs(FsConfig),
    Net(NetConfig),
    /// An interface whose tap queues came as descriptors (one per queue pair).
    NetFds {
        config: NetConfig,
        fds: Vec<OwnedFd>,
    },
    Vsock(VsockConfig),
}

impl VirtioHotplug {
    /// The hot-plug of the device a pre-boot `action` configures; None when its kind
    /// cannot be hot-plugged.
    pub fn from_action(action: VmmAction) -> Option<Self> {
        Some(match action {
            VmmAction::PutDrive(body) => VirtioHotplug::Drive(body),
            VmmAction::PutFs(body) => VirtioHotplug::Fs(body),
            VmmAction::PutNetworkInterface(body) => VirtioHotplug::Net(body),
            VmmAction::PutNetworkInterfaceFds { config, fds } => {
                VirtioHotplug::NetFds { config, fds }
            }
            VmmAction::PutVsock(body) => VirtioHotplug::Vsock(body),
            _ => return None,
        })
    }
}

/// One action on its way to the VMM thread, with where to send the answer. Every front
/// end (the API server's routes, the CLI's config file) sends these.
pub struct ActionRequest {
    pub action: VmmAction,
    pub reply: std::sync::mpsc::Sender<ActionResult>,
}

/// A successful answer.
#[derive(Debug, PartialEq)]
pub enum VmmData {
    Empty,
    Json(serde_json::Value),
}

/// A failed action: the HTTP status and the fault message.
#[derive(Debug, PartialEq, Eq)]
pub struct ActionError {
    pub status: u16,
    pub message: String,
}

impl ActionError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ActionError {
            status: 400,
            message: message.into(),
        }
    }

    /// The request is valid but not in the VM's current state.
    pub fn wrong_state(message: impl Into<String>) -> Self {
        ActionError {
            status: 409,
            message: message.into(),
        }
    }
}

pub type ActionResult = Result<VmmData, ActionError>;

/// Where the VM is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum InstanceState {
    NotStarted,
    /// Configured as a whole by [`VmmAction::CreateVm`], not booted yet.
    Created,
    Running,
    Paused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum BackingKind {
    #[default]
    #[serde(rename = "memfd")]
    Memfd,
    #[serde(rename = "hugetlb-2m")]
    Hugetlb2M,
    #[serde(rename = "hugetlb-1g")]
    Hugetlb1G,
}

impl From<BackingKind> for Backing {
    fn from(kind: BackingKind) -> Backing {
        match kind {
            BackingKind::Memfd => Backing::Memfd,
            BackingKind::Hugetlb2M => Backing::Hugetlb2M,
            BackingKind::Hugetlb1G => Backing::Hugetlb1G,
        }
    }
}

impl From<Backing> for BackingKind {
    fn from(backing: Backing) -> BackingKind {
        match backing {
            Backing::Memfd => BackingKind::Memfd,
            Backing::Hugetlb2M => BackingKind::Hugetlb2M,
            Backing::Hugetlb1G => BackingKind::Hugetlb1G,
        }
    }
}

fn yes() -> bool {
    true
}

/// PUT/GET /machine-config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineConfigBody {
    pub vcpu_count: u8,
    pub mem_size_mib: u64,
    #[serde(default)]
    pub track_dirty_pages: bool,
    #[serde(default)]
    pub backing: BackingKind,
    /// Ask for transparent huge pages (memfd backing).
    #[serde(default = "yes")]
    pub thp: bool,
    #[serde(default)]
    pub prefault: bool,
    /// CPUID features to hide: names (popcnt, xsave, ...) or LEAF[.SUB]:REG:BIT.
    #[serde(default)]
    pub cpuid_masks: Vec<String>,
    /// vCPUs the VM may grow to by hot-plug (Cloud Hypervisor's `cpus.max_vcpus`); at
    /// least `vcpu_count`. Absent: `vcpu_count` (no hot-plug).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_vcpus: Option<u8>,
    /// Bytes of RAM the VM may grow by with ACPI memory hot-plug (Cloud Hypervisor's
    /// `memory.hotplug_size`), in whole memory blocks. Absent or 0: no memory hot-plug.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_hotplug_size: Option<u64>,
    /// Guest NUMA nodes (`--numa`). Absent: the nodes already configured stay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<NumaBody>,
    /// Empty PCIe root ports for hot-plug (`--pcie-root-ports`), each with its own slot
    /// and windows; 0 turns them off. Absent: those already configured stay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root_ports: Option<u8>,
}

/// The `numa` of PUT /machine-config: `auto`, explicit `nodes`, or neither (no NUMA nodes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaBody {
    /// One guest node per host node holding a GPU of this VM (`--numa auto`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub auto: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NumaNodeBody>,
    /// The SLIT's `distances[from][to]` between guest nodes, in place of gpuvm's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distances: Option<Vec<Vec<u8>>>,
    /// Pin each vCPU thread to the host CPUs of its node's host node.
    #[serde(default, skip_serializing_if = "is_false")]
    pub pin_vcpus: bool,
}

/// One guest node of [`NumaBody`], as `--numa node=..` gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaNodeBody {
    pub node: u32,
    pub cpus: Vec<u8>,
    pub mem_mib: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
    /// PCI segments whose host bridge is on this node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pci_segments: Vec<u16>,
}

fn is_false(value: &bool) -> bool {
    !value
}

impl NumaBody {
    /// The options the builder plans from; the nodes themselves are checked against the
    /// machine when it is built (crate::numa::plan).
    pub fn to_options(&self) -> Result<NumaOptions, ActionError> {
        let mode = match (self.auto, self.nodes.is_empty()) {
            (true, false) => {
                return Err(ActionError::bad_request(
                    "numa: auto and nodes cannot be combined",
                ))
            }
            (true, true) => NumaMode::Auto,
            (false, true) => NumaMode::Off,
            (false, false) => {
                let mut specs = Vec::with_capacity(self.nodes.len());
                for node in &self.nodes {
                    let mem_size = node.mem_mib.checked_mul(1 << 20).ok_or_else(|| {
                        ActionError::bad_request(format!(
                            "numa: node {}: mem_mib = {} is too large",
                            node.node, node.mem_mib
                        ))
                    })?;
                    specs.push(NumaNodeSpec {
                        node: node.node,
                        cpus: node.cpus.clone(),
                        mem_size,
                        host_node: node.host_node,
                        pci_segments: node.pci_segments.clone(),
                    });
                }
                NumaMode::Nodes(specs)
            }
        };
        if self.distances.is_some() && mode == NumaMode::Off {
            return Err(ActionError::bad_request(
                "numa: distances need nodes (or auto)",
            ));
        }
        Ok(NumaOptions {
            mode,
            pin_vcpus: self.pin_vcpus,
            distances: self.distances.clone(),
        })
    }

    /// The body that shows `options` (None: no NUMA nodes).
    pub fn from_options(options: &NumaOptions) -> Option<Self> {
        let (auto, nodes) = match &options.mode {
            NumaMode::Off => return None,
            NumaMode::Auto => (true, Vec::new()),
            NumaMode::Nodes(specs) => (
                false,
                specs
                    .iter()
                    .map(|spec| NumaNodeBody {
                        node: spec.node,
                        cpus: spec.cpus.clone(),
                        mem_mib: spec.mem_size >> 20,
                        host_node: spec.host_node,
                        pci_segments: spec.pci_segments.clone(),
                    })
                    .collect(),
            ),
        };
        Some(NumaBody {
            auto,
            nodes,
            distances: options.distances.clone(),
            pin_vcpus: options.pin_vcpus,
        })
    }
}

/// The fields a PATCH /machine-config changes; the others keep their values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MachineConfigPatch {
    pub vcpu_count: Option<u8>,
    pub mem_size_mib: Option<u64>,
    pub track_dirty_pages: Option<bool>,
    pub backing: Option<BackingKind>,
    pub thp: Option<bool>,
    pub prefault: Option<bool>,
    pub cpuid_masks: Option<Vec<String>>,
}

impl MachineConfigPatch {
    /// `body` with the given fields changed.
    pub fn apply(&self, body: &mut MachineConfigBody) {
        if let Some(v) = self.vcpu_count {
            body.vcpu_count = v;
        }
        if let Some(v) = self.mem_size_mib {
            body.mem_size_mib = v;
        }
        if let Some(v) = self.track_dirty_pages {
            body.track_dirty_pages = v;
        }
        if let Some(v) = self.backing {
            body.backing = v;
        }
        if let Some(v) = self.thp {
            body.thp = v;
        }
        if let Some(v) = self.prefault {
            body.prefault = v;
        }
        if let Some(v) = &self.cpuid_masks {
            body.cpuid_masks = v.clone();
        }
    }
}

impl MachineConfigBody {
    pub fn from_config(config: &MachineConfig) -> Self {
        MachineConfigBody {
            vcpu_count: config.vcpus,
            mem_size_mib: config.memory_size >> 20,
            track_dirty_pages: config.track_dirty_pages,
            backing: config.backing.into(),
            thp: config.thp,
            prefault: config.prefault,
            cpuid_masks: config.cpuid_masks.iter().map(|m| m.to_string()).collect(),
            max_vcpus: None,
            ram_hotplug_size: None,
            numa: None,
            pcie_root_ports: None,
        }
    }

    /// The root ports asked for, checked against what gpuvm offers; None: keep those
    /// configured.
    pub fn checked_pcie_root_ports(&self) -> Result<Option<u8>, ActionError> {
        match self.pcie_root_ports {
            Some(ports) if ports > crate::pci_topology::MAX_HOTPLUG_PORTS => {
                Err(ActionError::bad_request(format!(
                    "pcie_root_ports = {ports}: at most {} root ports for hot-plug",
                    crate::pci_topology::MAX_HOTPLUG_PORTS
                )))
            }
            ports => Ok(ports),
        }
    }

    /// The room for hot-plugged RAM, checked: whole memory blocks, within what guests can
    /// address next to the 64-bit BAR window. 0: none.
    pub fn checked_ram_hotplug_size(&self) -> Result<u64, ActionError> {
        let size = self.ram_hotplug_size.unwrap_or(0);
        if !size.is_multiple_of(MEMORY_BLOCK_SIZE) {
            return Err(ActionError::bad_request(format!(
                "hotplug_size = {size} is not a multiple of the {} MiB memory block size",
                MEMORY_BLOCK_SIZE >> 20
            )));
        }
        if size > MAX_MEM_SIZE_MIB << 20 {
            return Err(ActionError::bad_request(format!(
                "hotplug_size = {size} is above {MAX_MEM_SIZE_MIB} MiB"
            )));
        }
        Ok(size)
    }

    /// The body for `config` with `max_vcpus` (shown only when above the vCPU count).
    pub fn with_max_vcpus(mut self, max_vcpus: u8) -> Self {
        self.max_vcpus = (max_vcpus > self.vcpu_count).then_some(max_vcpus);
        self
    }

    /// The vCPUs the VM may grow to: `max_vcpus`, checked against `vcpu_count` and
    /// [`MAX_VCPUS`], and lowered to the host's KVM limit (vCPUs beyond it could never be
    /// added; Cloud Hypervisor's clients ask for as many as the host has CPUs). Asks KVM:
    /// for the VMM thread, not the API thread.
    pub fn checked_max_vcpus(&self) -> Result<u8, ActionError> {
        let Some(max_vcpus) = self.max_vcpus else {
            return Ok(self.vcpu_count);
        };
        if max_vcpus < self.vcpu_count {
            return Err(ActionError::bad_request(format!(
                "max_vcpus ({max_vcpus}) must be at least vcpu_count ({})",
                self.vcpu_count
            )));
        }
        if max_vcpus > MAX_VCPUS {
            return Err(ActionError::bad_request(format!(
                "max_vcpus ({max_vcpus}) must be at most {MAX_VCPUS}"
            )));
        }
        match crate::host::host_max_vcpus() {
            Some(host) if max_vcpus > host && host >= self.vcpu_count => {
                log::info!("max_vcpus {max_vcpus} lowered to {host}, this host's KVM limit");
                Ok(host)
            }
            _ => Ok(max_vcpus),
        }
    }

    /// Checks the values and turns them into a configuration.
    pub fn to_config(&self) -> Result<MachineConfig, ActionError> {
        if self.vcpu_count == 0 {
            return Err(ActionError::bad_request("vcpu_count must be at least 1"));
        }
        if let Some(max) = crate::host::host_max_vcpus() {
            if self.vcpu_count > max {
                let error = crate::Error::VcpuCount {
                    requested: self.vcpu_count,
                    max,
                };
                return Err(ActionError::bad_request(error.to_string()));
            }
        }
        if self.mem_size_mib == 0 || self.mem_size_mib > MAX_MEM_SIZE_MIB {
            return Err(ActionError::bad_request(format!(
                "mem_size_mib must be between 1 and {MAX_MEM_SIZE_MIB}"
            )));
        }
        let cpuid_masks = self
            .cpuid_masks
            .iter()
            .map(|m| m.parse::<CpuidMask>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ActionError::bad_request(e.to_string()))?;
        Ok(MachineConfig {
            vcpus: self.vcpu_count,
            memory_size: self.mem_size_mib << 20,
            backing: self.backing.into(),
            thp: self.thp,
            prefault: self.prefault,
            cpuid_masks,
            track_dirty_pages: self.track_dirty_pages,
        })
    }
}

/// PUT /boot-source. Without a kernel, the embedded test guest boots.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BootSourceBody {
    pub kernel_image_path: Option<PathBuf>,
    pub initrd_path: Option<PathBuf>,
    pub boot_args: Option<String>,
}

impl BootSourceBody {
    /// What to boot: the kernel named, else the embedded test guest, whose workload
    /// defaults to `hello` (a kernel's command line defaults to empty).
    pub fn into_boot_source(self) -> BootSource {
        let (kernel, default_cmdline) = match self.kernel_image_path {
            Some(path) => (KernelSource::File(path), ""),
            None => (
                KernelSource::Embedded(gpuvm_guest_images::TEST_GUEST_ELF),
                "hello",
            ),
        };
        BootSource {
            kernel,
            initrd: self.initrd_path,
            cmdline: self
                .boot_args
                .unwrap_or_else(|| default_cmdline.to_string()),
        }
    }
}

/// Longest GPU id the API accepts.
pub const MAX_GPU_ID_LEN: usize = 64;

/// Largest GPUDirect clique id: NVIDIA's capability holds it in 4 bits.
pub const MAX_GPUDIRECT_CLIQUE: u8 = 15;

/// PUT /gpus/{id}: one passthrough device, either a host GPU bound to vfio-pci or a
/// device served over vfio-user.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuBody {
    pub gpu_id: String,
    /// PCI address of a host device bound to vfio-pci, e.g. "0000:41:00.0".
    pub host_bdf: Option<String>,
    /// Unix socket of a vfio-user device process (absolute path).
    pub vfio_user_socket: Option<PathBuf>,
    /// GPUDirect clique id (0 to 15) the guest's driver is told; default: derived from
    /// the host's PCIe topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpudirect_clique: Option<u8>,
    /// Whether peers may DMA into this device's BARs (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p2p: Option<bool>,
    /// The PCI segment it goes on (Cloud Hypervisor's `pci_segment`), at start or by
    /// hot-plug (onto that segment's bus 0); default: segment 0, or at start its NUMA
    /// node's segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_segment: Option<u16>,
}

impl GpuBody {
    /// A device with every choice left to its default.
    pub fn new(
        gpu_id: impl Into<String>,
        host_bdf: Option<String>,
        vfio_user_socket: Option<PathBuf>,
    ) -> Self {
        GpuBody {
            gpu_id: gpu_id.into(),
            host_bdf,
            vfio_user_socket,
            gpudirect_clique: None,
            p2p: None,
            pci_segment: None,
        }
    }

    /// The key [`crate::config::PciOptions::tuning`] knows this device by.
    pub fn backend_key(&self) -> Option<String> {
        (self.host_bdf.clone())
            .or_else(|| (self.vfio_user_socket.as_ref()).map(|s| s.display().to_string()))
    }

    /// This device's choices as the builder takes them.
    pub fn tuning(&self) -> crate::config::PassthroughTuning {
        crate::config::PassthroughTuning {
            clique: self.gpudirect_clique,
            p2p: self.p2p.unwrap_or(true),
            topology_bdf: None,
            segment: self.pci_segment,
        }
    }

    /// Checks the id (against the one in the URL when given) and that exactly one
    /// backend is named.
    pub fn validate(&self, path_id: Option<&str>) -> Result<(), ActionError> {
        let id = &self.gpu_id;
        if id.is_empty()
            || id.len() > MAX_GPU_ID_LEN
            || !id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(ActionError::bad_request(format!(
                "gpu_id must be 1 to {MAX_GPU_ID_LEN} characters of A-Z, a-z, 0-9, _ and -"
            )));
        }
        if let Some(path_id) = path_id {
            if path_id != id {
                return Err(ActionError::bad_request(format!(
                    "gpu_id {id:?} does not match the id in the path ({path_id:?})"
                )));
            }
        }
        if let Some(clique) = self.gpudirect_clique {
            if clique > MAX_GPUDIRECT_CLIQUE {
                return Err(ActionError::bad_request(format!(
                    "gpudirect_clique {clique}: a clique id is 0 to {MAX_GPUDIRECT_CLIQUE}"
                )));
            }
        }
        if let Some(segment) = self.pci_segment.filter(|&s| s >= MAX_PCI_SEGMENTS) {
            return Err(ActionError::bad_request(format!(
                "pci_segment {segment}: a VM has PCI segments 0 to {}",
                MAX_PCI_SEGMENTS - 1
            )));
        }
        match (&self.host_bdf, &self.vfio_user_socket) {
            (Some(bdf), None) => parse_bdf(bdf).map(|_| ()),
            (None, Some(socket)) => absolute_path(socket, "vfio_user_socket"),
            _ => Err(ActionError::bad_request(
                "give exactly one of host_bdf and vfio_user_socket",
            )),
        }
    }
}

/// Checks a PCI address as sysfs spells it: DDDD:BB:DD.F (the domain may be left out).
pub fn parse_bdf(bdf: &str) -> Result<(), ActionError> {
    let bad = || {
        ActionError::bad_request(format!(
            "host_bdf {bdf:?} is not a PCI address like 0000:41:00.0"
        ))
    };
    let parts: Vec<&str> = bdf.split([':', '.']).collect();
    let widths: &[usize] = match parts.len() {
        4 => &[4, 2, 2, 1],
        3 => &[2, 2, 1],
        _ => return Err(bad()),
    };
    let hex = parts
        .iter()
        .zip(widths)
        .all(|(part, &width)| part.len() == width && part.bytes().all(|b| b.is_ascii_hexdigit()));
    let device = parts[parts.len() - 2];
    let function = parts[parts.len() - 1];
    let in_range = u8::from_str_radix(device, 16).is_ok_and(|d| d < 32)
        && u8::from_str_radix(function, 16).is_ok_and(|f| f < 8);
    if hex && in_range {
        Ok(())
    } else {
        Err(bad())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActionType {
    InstanceStart,
    SendCtrlAltDel,
}

/// PUT /actions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionBody {
    pub action_type: ActionType,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmStateRequest {
    Paused,
    Resumed,
}

/// PATCH /vm.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStateBody {
    pub state: VmStateRequest,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum SnapshotType {
    #[default]
    Full,
    /// Only pages dirtied since the last snapshot into the same directory (needs
    /// track_dirty_pages).
    Diff,
}

/// PUT /vmm/update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LiveUpdateBody {
    /// Where the new gpuvm (`gpuvm update-receive`) listens for the hand-over (absolute).
    pub handover_socket: PathBuf,
    /// How long to wait for the new gpuvm at each step before taking the VM back
    /// (default: 30 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// The process that must be listening on `handover_socket` (`gpuvm update` gives the
    /// pid it spawned): the VM is offered to no other. Without it, any process of root or
    /// of this process's user may take it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receiver_pid: Option<u32>,
    /// For a new gpuvm in another pid namespace than this process's (one started for a
    /// gpuvm that is its own namespace's init), whose pid reads 0 here: a secret `gpuvm
    /// update` gave it alone, which goes with the offer so that it knows the offer comes
    /// from this process (16 to 64 bytes, in hex). The listener's uid is checked as
    /// without `receiver_pid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_token: Option<String>,
}

/// PUT /snapshot/create.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreateBody {
    /// The snapshot directory (absolute).
    pub snapshot_path: PathBuf,
    #[serde(default)]
    pub snapshot_type: SnapshotType,
    /// Firecracker's layout: with it, `snapshot_path` is the state FILE and this the
    /// memory file (see [`crate::snapshot::files`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_file_path: Option<PathBuf>,
    /// What happens to hot-plugged GPUs (see [`crate::gpu_release`]).
    #[serde(default)]
    pub passthrough: PassthroughPolicy,
    /// With `guest_release`: plug the GPUs back and resume them after the snapshot (the
    /// default), or leave the VM running without them (e.g. before it is stopped).
    #[serde(default = "yes")]
    pub reattach: bool,
    /// Set by the VMM, never by a client: the GPUs the guest released for this snapshot.
    #[serde(skip)]
    pub released_gpus: Vec<ReleasedGpu>,
}

impl SnapshotCreateBody {
    /// A full snapshot into the directory `snapshot_path`.
    pub fn full(snapshot_path: PathBuf) -> Self {
        SnapshotCreateBody {
            snapshot_path,
            snapshot_type: SnapshotType::Full,
            mem_file_path: None,
            passthrough: PassthroughPolicy::Migrate,
            reattach: true,
            released_gpus: Vec::new(),
        }
    }
}

/// What a snapshot does with passthrough devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PassthroughPolicy {
    /// Each hot-plugged device saves its own state into the snapshot (VFIO migration);
    /// a VM with a device that cannot is refused, naming it and what it lacks. (Called
    /// `refuse` before devices could be saved; that name is still accepted.)
    #[default]
    #[serde(alias = "refuse")]
    Migrate,
    /// The guest's agent releases each hot-plugged GPU, which is ejected; the snapshot
    /// records them, and a restored guest resumes on any GPU of the same model.
    GuestRelease,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum RestoreModeBody {
    Eager,
    #[default]
    Lazy,
    External,
}

/// PUT /snapshot/load.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotLoadBody {
    pub snapshot_path: PathBuf,
    #[serde(default)]
    pub restore_mode: RestoreModeBody,
    /// The external page-fault handler's socket (restore_mode External).
    pub uffd_socket_path: Option<PathBuf>,
    /// Run the VM right away; otherwise it stays paused until PATCH /vm Resumed.
    #[serde(default)]
    pub resume_vm: bool,
    /// Lazy restores: record the guest's working set for later restores of the same
    /// snapshot (as `gpuvm restore --record-working-set`).
    #[serde(default)]
    pub record_working_set: bool,
    /// Firecracker's layout: with it, `snapshot_path` is the state FILE and this the
    /// memory file (see [`crate::snapshot::files`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_file_path: Option<PathBuf>,
    /// GPUs whose state the snapshot holds (VFIO migration): where each device is now,
    /// by `gpu_id`. A GPU not named here is opened where the snapshot says it was.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuBody>,
}

/// What a snapshot load changes in the VM it restores (Firecracker's PUT /snapshot/load
/// `track_dirty_pages`, `network_overrides`, `vsock_override`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadOverrides {
    /// Track dirty pages in the restored VM, so Diff snapshots can follow.
    #[serde(default)]
    pub track_dirty_pages: bool,
    /// New taps for the snapshot's network interfaces, by `iface_id`.
    #[serde(default)]
    pub network_overrides: Vec<NetworkOverride>,
    /// A new host socket path for the snapshot's vsock device.
    #[serde(default)]
    pub vsock_uds_path: Option<PathBuf>,
}

/// One network interface of a snapshot given a new tap on load.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkOverride {
    pub iface_id: String,
    pub host_dev_name: String,
}

/// `--config-file`: the pre-boot configuration in one JSON document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(rename = "machine-config")]
    pub machine_config: Option<MachineConfigBody>,
    #[serde(rename = "boot-source")]
    pub boot_source: Option<BootSourceBody>,
    /// Passthrough devices, as PUT /gpus/{id} bodies.
    #[serde(default)]
    pub gpus: Vec<GpuBody>,
    /// Block devices, as PUT /drives/{id} bodies.
    #[serde(default)]
    pub drives: Vec<DriveBody>,
    /// virtio-fs shares, as PUT /fs/{tag} bodies.
    #[serde(default)]
    pub fs: Vec<FsConfig>,
    /// Network interfaces, as PUT /network-interfaces/{id} bodies.
    #[serde(default, rename = "network-interfaces")]
    pub network_interfaces: Vec<NetConfig>,
    /// The vsock device, as the PUT /vsock body.
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// The entropy device, as the PUT /entropy body.
    #[serde(default)]
    pub entropy: Option<RngConfig>,
    /// PCI segment groups and the virtio devices not on segment 0.
    #[serde(default, rename = "pci-segments")]
    pub pci_segments: Option<PciSegmentsBody>,
}

impl ConfigFile {
    /// The actions the file stands for, in the order its routes would take them (the
    /// machine, the boot source, devices, then their PCI segments): a config file is a
    /// list of requests, carried out by the controller as one unit.
    pub fn into_actions(self) -> Vec<VmmAction> {
        let mut actions = Vec::new();
        actions.extend(self.machine_config.map(VmmAction::PutMachineConfig));
        actions.extend(self.boot_source.map(VmmAction::PutBootSource));
        actions.extend(self.gpus.into_iter().map(VmmAction::PutGpu));
        actions.extend(self.drives.into_iter().map(VmmAction::PutDrive));
        actions.extend(self.fs.into_iter().map(VmmAction::PutFs));
        actions.extend((self.network_interfaces.into_iter()).map(VmmAction::PutNetworkInterface));
        actions.extend(self.vsock.map(VmmAction::PutVsock));
        actions.extend(self.entropy.map(VmmAction::PutEntropy));
        actions.extend(self.pci_segments.map(VmmAction::PutPciSegments));
        actions
    }
}

/// A PUT /drives/{id} body: an image gpuvm opens (`path`) or a vhost-user backend that
/// serves the disk (`socket`, e.g. qemu-storage-daemon).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum DriveBody {
    Local(BlockConfig),
    VhostUser(VhostUserBlockConfig),
}

impl DriveBody {
    pub fn drive_id(&self) -> &str {
        match self {
            DriveBody::Local(config) => &config.drive_id,
            DriveBody::VhostUser(config) => &config.drive_id,
        }
    }
}

impl<'de> Deserialize<'de> for DriveBody {
    /// Chosen by the `socket` field, so each kind's own errors (unknown or missing
    /// fields) reach the client instead of a generic "no variant matched".
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let value = serde_json::Value::deserialize(deserializer)?;
        if value.get("socket").is_some() {
            VhostUserBlockConfig::deserialize(value)
                .map(DriveBody::VhostUser)
                .map_err(D::Error::custom)
        } else {
            BlockConfig::deserialize(value)
                .map(DriveBody::Local)
                .map_err(D::Error::custom)
        }
    }
}

/// PATCH /drives/{id} (Firecracker's shape): swap the image under a running drive, or
/// change its rate limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrivePatchBody {
    pub drive_id: String,
    #[serde(default, alias = "path_on_host")]
    pub path: Option<PathBuf>,
    #[serde(default)]
    pub rate_limiter: Option<gpuvm_virtio::rate_limiter::RateLimiterConfig>,
}

/// PATCH /balloon (Firecracker's BalloonUpdate).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonUpdateBody {
    pub amount_mib: u32,
}

/// PATCH /balloon/statistics (Firecracker's BalloonStatsUpdate).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonStatsUpdateBody {
    pub stats_polling_interval_s: u16,
}

/// The PCI segment groups of the VM being configured (Cloud Hypervisor's
/// `platform.num_pci_segments` and each device's `pci_segment`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciSegmentsBody {
    /// 1 to [`MAX_PCI_SEGMENTS`]; absent keeps the number already set (1 at first).
    #[serde(default)]
    pub num_pci_segments: Option<u16>,
    /// Virtio devices' segments by device id (a drive or interface id, a share's tag,
    /// `vsock`, `rng`); added to those already set. Devices not named are on segment 0.
    #[serde(default)]
    pub devices: std::collections::BTreeMap<String, u16>,
}

impl PciSegmentsBody {
    /// Applies the body to the configured PCI devices, or refuses it (nothing changed)
    /// when a count is out of range or a device names a segment the VM will not have.
    pub fn apply(&self, pci: &mut crate::config::PciOptions) -> Result<(), ActionError> {
        let count = self.num_pci_segments.unwrap_or(pci.num_pci_segments.max(1));
        if count == 0 || count > MAX_PCI_SEGMENTS {
            return Err(ActionError::bad_request(format!(
                "num_pci_segments = {count}: a VM has 1 to {MAX_PCI_SEGMENTS} PCI segments"
            )));
        }
        let mut segments = pci.virtio.pci_segments.clone();
        for (id, &segment) in &self.devices {
            if segment == 0 {
                segments.remove(id);
            } else {
                segments.insert(id.clone(), segment);
            }
        }
        if let Some((id, segment)) = segments.iter().find(|(_, &s)| s >= count) {
            return Err(ActionError::bad_request(format!(
                "pci_segment = {segment} of device {id:?}: the VM has {count} PCI segment(s) \
                 (num_pci_segments), numbered from 0"
            )));
        }
        pci.num_pci_segments = count;
        pci.virtio.pci_segments = segments;
        Ok(())
    }
}

/// Requires an absolute path, so a request never depends on gpuvm's working directory.
pub fn absolute_path(path: &std::path::Path, what: &str) -> Result<(), ActionError> {
    if path.is_absolute() && !path.as_os_str().is_empty() {
        Ok(())
    } else {
        Err(ActionError::bad_request(format!(
            "{what} must be an absolute path, got {:?}",
            path
        )))
    }
}

/// A log output (Firecracker's PUT /logger).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggerConfig {
    pub path: PathBuf,
    /// The most verbose level written; None keeps the current one.
    pub level: Option<log::LevelFilter>,
}

/// A metrics output (Firecracker's PUT /metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsConfig {
    pub path: PathBuf,
}

/// A GPU the guest released for a snapshot: the snapshot's guest waits for one of the
/// same model under this id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleasedGpu {
    pub gpu_id: String,
    pub vendor_id: u16,
    pub device_id: u16,
    /// Where the guest had it ("0000:00:05.0").
    pub bdf: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_config_validates_and_round_trips() {
        let body: MachineConfigBody = serde_json::from_str(
            r#"{"vcpu_count": 2, "mem_size_mib": 256, "cpuid_masks": ["popcnt"]}"#,
        )
        .unwrap();
        assert!(body.thp);
        let config = body.to_config().unwrap();
        assert_eq!(config.memory_size, 256 << 20);
        let back = MachineConfigBody::from_config(&config);
        assert_eq!(back.to_config().unwrap().cpuid_masks, config.cpuid_masks);
        assert_eq!((back.vcpu_count, back.mem_size_mib), (2, 256));
        for bad in [
            r#"{"vcpu_count": 0, "mem_size_mib": 256}"#,
            r#"{"vcpu_count": 1, "mem_size_mib": 0}"#,
            r#"{"vcpu_count": 1, "mem_size_mib": 18446744073709551615}"#,
            r#"{"vcpu_count": 1, "mem_size_mib": 64, "cpuid_masks": ["nosuch"]}"#,
        ] {
            let body: MachineConfigBody = serde_json::from_str(bad).unwrap();
            assert_eq!(body.to_config().unwrap_err().status, 400, "{bad}");
        }
        for bad in [
            r#"{"vcpu_count": 300, "mem_size_mib": 256}"#,
            r#"{"vcpu_count": 1, "mem_size_mib": 64, "smt": true}"#,
            r#"{"mem_size_mib": 64}"#,
        ] {
            assert!(
                serde_json::from_str::<MachineConfigBody>(bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn gpu_bodies_name_one_backend_and_a_sane_id() {
        let gpu = |json: &str| serde_json::from_str::<GpuBody>(json).unwrap();
        let good = gpu(r#"{"gpu_id":"gpu0","host_bdf":"0000:41:00.0"}"#);
        assert_eq!(good.validate(Some("gpu0")), Ok(()));
        assert_eq!(good.validate(Some("gpu1")).unwrap_err().status, 400);
        let user = gpu(r#"{"gpu_id":"emu-1","vfio_user_socket":"/run/emu.sock"}"#);
        assert_eq!(user.validate(None), Ok(()));
        assert_eq!(
            gpu(r#"{"gpu_id":"a","host_bdf":"41:00.0"}"#).validate(None),
            Ok(())
        );
        for bad in [
            r#"{"gpu_id":"gpu0"}"#,
            r#"{"gpu_id":"gpu0","host_bdf":"0000:41:00.0","vfio_user_socket":"/s"}"#,
            r#"{"gpu_id":"gpu0","vfio_user_socket":"relative.sock"}"#,
            r#"{"gpu_id":"","host_bdf":"0000:41:00.0"}"#,
            r#"{"gpu_id":"a/b","host_bdf":"0000:41:00.0"}"#,
            r#"{"gpu_id":"g","host_bdf":"0000:41:20.0"}"#,
            r#"{"gpu_id":"g","host_bdf":"0000:41:00.8"}"#,
            r#"{"gpu_id":"g","host_bdf":"zz:41:00.0"}"#,
            r#"{"gpu_id":"g","host_bdf":"../../etc"}"#,
            r#"{"gpu_id":"g","host_bdf":"0000:41:00.0","pci_segment":16}"#,
        ] {
            assert_eq!(gpu(bad).validate(None).unwrap_err().status, 400, "{bad}");
        }
        let long = format!(r#"{{"gpu_id":"{}","host_bdf":"41:00.0"}}"#, "x".repeat(65));
        assert!(gpu(&long).validate(None).is_err());
        assert!(serde_json::from_str::<GpuBody>(r#"{"gpu_id":"g","bdf":"41:00.0"}"#).is_err());
        let placed = gpu(r#"{"gpu_id":"g","host_bdf":"0000:41:00.0","pci_segment":15}"#);
        assert_eq!(placed.validate(None), Ok(()));
        assert_eq!(placed.tuning().segment, Some(15));
        assert!(serde_json::from_str::<GpuBody>(
            r#"{"gpu_id":"g","host_bdf":"0000:41:00.0","pci_segment":-1}"#
        )
        .is_err());
    }

    #[test]
    fn enums_use_firecracker_spelling() {
        let body: ActionBody = serde_json::from_str(r#"{"action_type":"InstanceStart"}"#).unwrap();
        assert_eq!(body.action_type, ActionType::InstanceStart);
        let body: SnapshotLoadBody = serde_json::from_str(r#"{"snapshot_path":"/s"}"#).unwrap();
        assert_eq!(body.restore_mode, RestoreModeBody::Lazy);
        assert!(!body.resume_vm && !body.record_working_set);
        assert!(serde_json::from_str::<VmStateBody>(r#"{"state":"Running"}"#).is_err());
    }
}
