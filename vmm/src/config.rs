//! What a VM is made of: the machine (vCPUs, memory, CPU features) and what it boots.

use std::path::PathBuf;

use gpuvm_arch::x86_64::boot::BootSource;
use gpuvm_arch::x86_64::cpuid::CpuidMask;
use gpuvm_memory::Backing;

use crate::virtio::{DeviceResources, VirtioOptions};

/// Default guest memory when none is given.
pub const DEFAULT_MEMORY_SIZE: u64 = 128 << 20;

#[derive(Clone, Debug)]
pub struct MachineConfig {
    pub vcpus: u8,
    pub memory_size: u64,
    pub backing: Backing,
    /// Huge pages for memfd backing: guest RAM on a private huge-page tmpfs where gpuvm
    /// may mount one (else a memfd with `MADV_HUGEPAGE`); false gives a plain memfd.
    pub thp: bool,
    /// Populate all guest memory before boot, in parallel.
    pub prefault: bool,
    /// CPUID feature bits hidden from the guest.
    pub cpuid_masks: Vec<CpuidMask>,
    /// Log dirty pages in KVM so later snapshots write only what changed.
    pub track_dirty_pages: bool,
}

impl Default for MachineConfig {
    fn default() -> Self {
        MachineConfig {
            vcpus: 1,
            memory_size: DEFAULT_MEMORY_SIZE,
            backing: Backing::Memfd,
            thp: true,
            prefault: false,
            cpuid_masks: Vec::new(),
            track_dirty_pages: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct VmConfig {
    pub machine: MachineConfig,
    pub boot: BootSource,
}

/// The PCI devices of one VM: passthrough devices and virtio devices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PciOptions {
    /// Host PCI addresses of GPUs bound to vfio-pci (kernel VFIO).
    pub gpus: Vec<String>,
    /// vfio-user sockets of device processes.
    pub vfio_user: Vec<PathBuf>,
    /// Size of the 64-bit BAR window; 0 plans it from the passthrough devices' BARs and
    /// the host's address width (gpuvm_arch::x86_64::address_space).
    pub mmio64_size: u64,
    /// Segment 0's 64-bit BAR window exactly, (start, size): a restored VM's, where the
    /// guest's ACPI tables have it. None plans it.
    pub mmio64_window: Option<(u64, u64)>,
    /// Segment 0's allocations as a snapshot saved them: a restore puts every function
    /// back exactly there. None places devices afresh (or, restoring an older snapshot,
    /// from each device's own saved place).
    pub pci_root: Option<gpuvm_devices::pci::PciRootState>,
    /// PCI segment groups (1 to [`gpuvm_arch::x86_64::layout::MAX_PCI_SEGMENTS`]); 0 means 1, or as many as the
    /// virtio devices' segments need (a restore rebuilds them from the devices).
    pub num_pci_segments: u16,
    /// Segments 1.. as a live update's old process had them (their windows, allocations
    /// and host-mirroring ports): the new process builds them so instead of planning them.
    /// Empty otherwise.
    pub saved_segments: Vec<crate::pci::SavedPciSegment>,
    /// Block, net, vsock and entropy devices.
    pub virtio: VirtioOptions,
    /// Descriptors the devices in `virtio` take when they are built: tap queues passed
    /// for network interfaces, and a live update's handed-over taps and drive images.
    pub device_resources: DeviceResources,
    /// vCPUs the VM may grow to by ACPI hot-plug (Cloud Hypervisor's `cpus.max_vcpus`):
    /// CPUs are hot-pluggable devices like the PCI slots. 0, or no more than
    /// [`MachineConfig::vcpus`], means no vCPU hot-plug. (Here rather than in
    /// [`MachineConfig`], whose struct literals other crates build field by field.)
    pub max_vcpus: u8,
    /// Guest-physical room kept for hot-pluggable RAM (Cloud Hypervisor's
    /// `memory.hotplug_size`), right after boot RAM and before the 64-bit BAR window;
    /// 0 means no memory hot-plug. (Here for the same reason as `max_vcpus`.)
    pub ram_hotplug_size: u64,
    /// Per-device passthrough choices, keyed by the device's backend as configured: the
    /// host PCI address for kernel VFIO, the socket path (as text) for vfio-user. A
    /// device without an entry gets the defaults.
    pub tuning: std::collections::BTreeMap<String, PassthroughTuning>,
    /// Where passthrough devices sit in the guest's PCI hierarchy (`--pci-topology`);
    /// None: mirror the host where a device with a known host place sits behind a host
    /// PCIe switch, else bus 0.
    pub pci_topology: Option<PciTopology>,
    /// Empty PCIe root ports with native hot-plug slots (`--pcie-root-ports`, Kata's
    /// `pcie_root_port`): PUT /gpus/{id} plugs into a free one (see crate::pci_topology).
    pub pcie_root_ports: u8,
    /// Guest NUMA nodes (`--numa`); off by default. Here, not in [`MachineConfig`], for
    /// the same reason as `max_vcpus`; see crate::numa.
    pub numa: NumaOptions,
    /// The NVSwitch fabric partition the host's fabric manager activates before the
    /// VM's GPUs are attached and deactivates after it ends (shared NVSwitch mode; see
    /// crate::fabric).
    pub fabric_partition: Option<crate::fabric::FabricPartition>,
}

/// The guest's PCI layout for passthrough devices (see crate::pci_topology).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PciTopology {
    /// Every device on bus 0, as before topologies.
    Flat,
    /// A root port per device; devices that share a host PCIe switch share a virtual one.
    Host,
}

/// How one passthrough device is presented beyond its own registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassthroughTuning {
    /// The GPUDirect clique the guest's driver is told; None derives it from the host's
    /// PCIe topology.
    pub clique: Option<u8>,
    /// Whether this device's BARs are DMA-mapped for its peers (`p2p=off` clears it).
    pub p2p: bool,
    /// The host PCI device whose place in the host's topology this device takes (a
    /// vfio-user device standing for a host GPU); a kernel VFIO device is its own.
    pub topology_bdf: Option<String>,
    /// The PCI segment the device goes on (Cloud Hypervisor's `pci_segment`, `--gpu
    /// ...,pci_segment=N`): its host bridge's node is the guest node that lists the
    /// segment. None: segment 0, or its NUMA node's segment (crate::numa).
    pub segment: Option<u16>,
}

impl Default for PassthroughTuning {
    fn default() -> Self {
        PassthroughTuning {
            clique: None,
            p2p: true,
            topology_bdf: None,
            segment: None,
        }
    }
}

impl PciOptions {
    /// The choices for the device whose backend is `key` (a host PCI address or a
    /// vfio-user socket path).
    pub fn tuning_of(&self, key: &str) -> PassthroughTuning {
        self.tuning.get(key).cloned().unwrap_or_default()
    }

    /// The vCPUs a VM of `machine` with these options may have.
    pub fn max_vcpus(&self, machine: &MachineConfig) -> u8 {
        self.max_vcpus.max(machine.vcpus)
    }

    /// No passthrough device (virtio devices aside).
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty() && self.vfio_user.is_empty()
    }
}

/// One guest node as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNodeSpec {
    /// The guest node id (its proximity domain): nodes are numbered 0..N.
    pub node: u32,
    /// The vCPUs (ids, hot-pluggable ones included) on this node.
    pub cpus: Vec<u8>,
    /// Bytes of boot RAM on this node.
    pub mem_size: u64,
    /// The host node its RAM is bound to (and its vCPUs pinned to, when asked); None
    /// leaves placement to the host.
    pub host_node: Option<u32>,
    /// PCI segments whose host bridge is on this node (Cloud Hypervisor's
    /// `numa[].pci_segments`): the virtio devices placed there are the node's.
    pub pci_segments: Vec<u16>,
}

/// How the guest's NUMA nodes are chosen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NumaMode {
    /// No NUMA nodes: no SRAT/SLIT, RAM placed by the host's policy.
    #[default]
    Off,
    /// One guest node per host node that has a GPU of this VM.
    Auto,
    /// These nodes.
    Nodes(Vec<NumaNodeSpec>),
}

/// `--numa` and `--numa-pin-vcpus`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NumaOptions {
    pub mode: NumaMode,
    /// Pin each vCPU thread to the CPUs of its node's host node.
    pub pin_vcpus: bool,
    /// The SLIT's `distances[from][to]` between guest nodes, in place of gpuvm's (20
    /// between distinct nodes; the host's in auto mode). None: gpuvm's.
    pub distances: Option<Vec<Vec<u8>>>,
}
