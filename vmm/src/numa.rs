//! Guest NUMA nodes: what the user asked for (`--numa`), the host facts it is checked
//! against and planned from, the plan (each guest node's vCPUs, RAM and host node, the
//! distances, each passthrough device's node), and carrying it out: each node's RAM
//! bound to its host node before anything touches it, the vCPU threads optionally pinned
//! to the node's host CPUs, and the SRAT/SLIT the guest reads.
//!
//! Host facts come from sysfs through [`HostNuma`], rooted at `$GPUVM_TEST_SYSFS_ROOT`
//! when set (tests point it at a fake tree, as the PCIe topology discovery does):
//! `devices/system/node/nodeN/{cpulist,distance}` and `bus/pci/devices/<bdf>/numa_node`.
//!
//! Test hook: a fake tree may describe host nodes this host lacks, which mbind cannot bind
//! to. `GPUVM_TEST_NUMA_BIND_NODE=N` binds every guest node's RAM (and pins its vCPUs) to
//! the real host node N instead of the host node planned; it exists for tests only and
//! says so in a warning.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use gpuvm_arch::x86_64::acpi::numa::{
    NumaMemoryRange, NumaPciInitiator, NumaTopology, LOCAL_DISTANCE, REMOTE_DISTANCE,
};
use gpuvm_arch::x86_64::layout::MAX_PCI_SEGMENTS;
use gpuvm_memory::numa::{bind_file_range, NodePolicy, NumaBindError};
use gpuvm_memory::{ByteSize, GuestRam, RamRegion};

use crate::config::PciOptions;

/// Points host-fact discovery at a fake sysfs tree (tests); shared with the PCIe topology.
pub const TEST_SYSFS_ROOT_ENV: &str = gpuvm_vfio::topology::TEST_SYSFS_ROOT_ENV;
/// Test hook: bind all guest RAM to this real host node (see the module docs).
pub const TEST_BIND_NODE_ENV: &str = "GPUVM_TEST_NUMA_BIND_NODE";
/// The unit automatic mode splits RAM in: node boundaries stay on huge-page boundaries.
const AUTO_RAM_UNIT: u64 = 2 << 20;

// The configuration's types live with the rest of the VM's configuration (config.rs).
pub use crate::config::{NumaMode, NumaNodeSpec, NumaOptions};

#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    #[error("--numa: {0}")]
    Invalid(String),
    #[error("--numa: cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--numa: {0}")]
    HostFile(#[from] gpuvm_vfio::sysfs::SysfsError),
    #[error("--numa: {path}: cannot parse {text:?}")]
    Parse { path: PathBuf, text: String },
    #[error("--numa: host NUMA node {node} does not exist on this host (its nodes: {known})")]
    AbsentHostNode { node: u32, known: String },
    #[error("--numa: guest node {guest_node}: {source}")]
    Bind {
        guest_node: u32,
        source: NumaBindError,
    },
}

/// The host's NUMA facts as sysfs shows them under `root`.
#[derive(Clone, Debug)]
pub struct HostNuma {
    root: PathBuf,
}

impl HostNuma {
    /// `$GPUVM_TEST_SYSFS_ROOT` when set, else /sys.
    pub fn from_env() -> Self {
        HostNuma::at(&gpuvm_vfio::topology::HostTopology::default_root())
    }

    pub fn at(root: &Path) -> Self {
        HostNuma {
            root: root.to_path_buf(),
        }
    }

    fn node_dir(&self) -> PathBuf {
        self.root.join("devices/system/node")
    }

    /// A bounded read of one attribute: a FIFO, a device node, a huge file or a
    /// directory at `path` is an error naming it, never a hang.
    fn read(&self, path: PathBuf) -> Result<String, NumaError> {
        Ok(gpuvm_vfio::sysfs::read_text(&path)?)
    }

    /// The host's nodes, ascending. A host without the node directory (a kernel without
    /// NUMA) has one, node 0.
    pub fn nodes(&self) -> Result<Vec<u32>, NumaError> {
        let dir = self.node_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(vec![0]),
            Err(source) => return Err(NumaError::Read { path: dir, source }),
        };
        let mut nodes: Vec<u32> = entries
            .filter_map(|entry| {
                let name = entry.ok()?.file_name();
                name.to_str()?.strip_prefix("node")?.parse().ok()
            })
            .collect();
        nodes.sort_unstable();
        if nodes.is_empty() {
            nodes.push(0);
        }
        Ok(nodes)
    }

    /// An error naming the host's nodes unless `node` is one of them.
    pub fn check_node(&self, node: u32) -> Result<(), NumaError> {
        let nodes = self.nodes()?;
        if nodes.contains(&node) {
            return Ok(());
        }
        Err(NumaError::AbsentHostNode {
            node,
            known: nodes
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// The CPUs of host node `node` (its `cpulist`).
    pub fn cpus_of(&self, node: u32) -> Result<Vec<usize>, NumaError> {
        let path = self.node_dir().join(format!("node{node}/cpulist"));
        let text = self.read(path.clone())?;
        parse_cpu_list(&text).ok_or_else(|| NumaError::Parse {
            path,
            text: excerpt(&text),
        })
    }

    /// Host node `from`'s distance to each host node, keyed by node (sysfs lists them in
    /// the order of the host's nodes).
    pub fn distances_from(&self, from: u32) -> Result<BTreeMap<u32, u32>, NumaError> {
        let path = self.node_dir().join(format!("node{from}/distance"));
        let text = self.read(path.clone())?;
        let values = text
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| NumaError::Parse {
                path: path.clone(),
                text: excerpt(&text),
            })?;
        Ok(self.nodes()?.into_iter().zip(values).collect())
    }

    /// The host node of PCI device `bdf` (`numa_node`); None where the host does not
    /// know (-1, a single-node host) or the file is absent.
    pub fn pci_device_node(&self, bdf: &str) -> Result<Option<u32>, NumaError> {
        let bdf = gpuvm_vfio::topology::normalize_bdf(bdf);
        let path = self.root.join(format!("bus/pci/devices/{bdf}/numa_node"));
        let Some(text) = gpuvm_vfio::sysfs::read_optional_text(&path)? else {
            return Ok(None);
        };
        let value: i64 = text.parse().map_err(|_| NumaError::Parse {
            path: path.clone(),
            text: excerpt(&text),
        })?;
        Ok(u32::try_from(value).ok())
    }
}

/// The start of a host file's text for an error message: a damaged file may hold up to
/// [`gpuvm_vfio::sysfs::MAX_ATTRIBUTE_BYTES`] of anything.
fn excerpt(text: &str) -> String {
    const SHOWN: usize = 64;
    match text.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

/// The host NUMA node of PCI device `bdf` as sysfs (or `$GPUVM_TEST_SYSFS_ROOT`) says:
/// what `gpuvm check-host` reports per GPU. None where the host does not say.
pub fn pci_numa_node(bdf: &str) -> Result<Option<u32>, NumaError> {
    HostNuma::from_env().pci_device_node(bdf)
}

/// CPU numbers a CPU list may name: above the kernel's largest NR_CPUS (8192), so a
/// real list always fits, and a damaged one (`0-18446744073709551615`) cannot make
/// gpuvm allocate without bound.
pub const MAX_HOST_CPUS: usize = 1 << 16;

/// Parses a kernel CPU list such as `0-3,8,10-11`; None when it is not one, or names a
/// CPU at or above [`MAX_HOST_CPUS`].
pub fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (first, last): (usize, usize) = match part.split_once('-') {
            Some((first, last)) => (first.trim().parse().ok()?, last.trim().parse().ok()?),
            None => {
                let cpu = part.trim().parse().ok()?;
                (cpu, cpu)
            }
        };
        if first > last || last >= MAX_HOST_CPUS || cpus.len() + (last - first) >= MAX_HOST_CPUS {
            return None;
        }
        cpus.extend(first..=last);
    }
    Some(cpus)
}

/// One planned guest node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    pub cpus: Vec<u8>,
    pub mem_size: u64,
    pub host_node: Option<u32>,
    /// PCI segments whose host bridge is on this node (NumaNodeSpec::pci_segments).
    pub pci_segments: Vec<u16>,
}

/// The guest's nodes, planned and checked. Guest node `i` is `nodes[i]`; its RAM is the
/// RAM file's bytes after those of nodes `0..i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaPlan {
    pub nodes: Vec<NodePlan>,
    /// `distances[from][to]` between guest nodes.
    pub distances: Vec<Vec<u8>>,
    /// Each passthrough device's guest node, keyed by its backend (host BDF or vfio-user
    /// socket path as text), where its host node is one of the guest nodes'.
    pub device_nodes: BTreeMap<String, u32>,
    pub pin_vcpus: bool,
}

/// Each cold-plugged passthrough device's backend key, in plug order (kernel VFIO devices,
/// then vfio-user ones).
pub fn device_keys(pci: &PciOptions) -> Vec<String> {
    pci.gpus
        .iter()
        .cloned()
        .chain(
            pci.vfio_user
                .iter()
                .map(|socket| socket.display().to_string()),
        )
        .collect()
}

/// The host PCI device each passthrough device of `pci` stands for, keyed by backend: a
/// kernel VFIO device is itself, a vfio-user device its `topology_bdf` if any.
fn device_host_bdfs(pci: &PciOptions) -> Vec<(String, String)> {
    let mut devices: Vec<(String, String)> = pci
        .gpus
        .iter()
        .map(|bdf| (bdf.clone(), bdf.clone()))
        .collect();
    for socket in &pci.vfio_user {
        let key = socket.display().to_string();
        if let Some(bdf) = pci.tuning_of(&key).topology_bdf {
            devices.push((key, bdf));
        }
    }
    devices
}

/// Plans the guest's nodes for a VM of `vcpus` boot vCPUs (`max_vcpus` possible) and
/// `memory_size` bytes of RAM (node sizes multiples of `page_size`). None when the VM
/// gets no NUMA nodes.
pub fn plan(
    options: &NumaOptions,
    vcpus: u8,
    max_vcpus: u8,
    memory_size: u64,
    page_size: u64,
    pci: &PciOptions,
    host: &HostNuma,
) -> Result<Option<NumaPlan>, NumaError> {
    // A VM without NUMA nodes reads nothing of the host.
    if options.mode == NumaMode::Off {
        return Ok(None);
    }
    let possible = max_vcpus.max(vcpus);
    let mut device_host_nodes = BTreeMap::new();
    for (key, bdf) in device_host_bdfs(pci) {
        if let Some(node) = host.pci_device_node(&bdf)? {
            device_host_nodes.insert(key, node);
        }
    }
    let (nodes, distances) = match &options.mode {
        NumaMode::Off => return Ok(None),
        NumaMode::Auto => {
            let gpu_nodes: BTreeSet<u32> = device_host_nodes.values().copied().collect();
            let host_nodes = host.nodes()?;
            if gpu_nodes.len() < 2 || host_nodes.len() < 2 {
                return Ok(None);
            }
            // A device's numa_node names a node the node directory lacks: one of the two
            // is wrong, and guessing which would bind RAM to the wrong socket.
            if let Some((key, node)) = device_host_nodes
                .iter()
                .find(|(_, node)| !host_nodes.contains(node))
            {
                return Err(NumaError::Invalid(format!(
                    "auto: device {key} is on host node {node} (its numa_node), which {} \
                     does not list (the host's nodes: {})",
                    host.node_dir().display(),
                    host_nodes
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            let host_order: Vec<u32> = gpu_nodes.into_iter().collect();
            let nodes = auto_nodes(&host_order, possible, memory_size, page_size)?;
            (nodes, host_distances(host, &host_order)?)
        }
        NumaMode::Nodes(specs) => {
            let nodes = explicit_nodes(specs, possible, memory_size, page_size)?;
            let segments = crate::pci::segment_count(pci)
                .map_err(|error| NumaError::Invalid(error.to_string()))?;
            check_node_segments(&nodes, segments)?;
            for node in &nodes {
                if let Some(host_node) = node.host_node {
                    host.check_node(host_node)?;
                }
            }
            let count = nodes.len();
            let distances = (0..count)
                .map(|from| {
                    (0..count)
                        .map(|to| {
                            if from == to {
                                LOCAL_DISTANCE
                            } else {
                                REMOTE_DISTANCE
                            }
                        })
                        .collect()
                })
                .collect();
            (nodes, distances)
        }
    };
    let distances = match &options.distances {
        Some(given) => checked_distances(given, nodes.len())?,
        None => distances,
    };
    let device_nodes = device_host_nodes
        .into_iter()
        .filter_map(|(key, host_node)| {
            let guest = nodes.iter().position(|n| n.host_node == Some(host_node))?;
            Some((key, guest as u32))
        })
        .collect();
    Ok(Some(NumaPlan {
        nodes,
        distances,
        device_nodes,
        pin_vcpus: options.pin_vcpus,
    }))
}

/// The distances given in place of gpuvm's, checked as the SLIT needs them: one row and
/// column per guest node, 10 from a node to itself, 11 to 255 between distinct nodes.
fn checked_distances(given: &[Vec<u8>], nodes: usize) -> Result<Vec<Vec<u8>>, NumaError> {
    if given.len() != nodes || given.iter().any(|row| row.len() != nodes) {
        return Err(NumaError::Invalid(format!(
            "distances: {nodes} rows of {nodes} distances expected (one per guest node)"
        )));
    }
    for (from, row) in given.iter().enumerate() {
        for (to, distance) in row.iter().enumerate() {
            let valid = if from == to {
                *distance == LOCAL_DISTANCE
            } else {
                *distance > LOCAL_DISTANCE
            };
            if !valid {
                return Err(NumaError::Invalid(format!(
                    "distances: node {from} to node {to} is {distance}: a node is \
                     {LOCAL_DISTANCE} from itself and 11 to 255 from another"
                )));
            }
        }
    }
    Ok(given.to_vec())
}

/// Automatic mode: guest node `i` on host node `host_order[i]`; vCPUs and RAM split
/// evenly, remainders to the first node.
fn auto_nodes(
    host_order: &[u32],
    vcpus: u8,
    memory_size: u64,
    page_size: u64,
) -> Result<Vec<NodePlan>, NumaError> {
    let count = host_order.len();
    if usize::from(vcpus) < count {
        return Err(NumaError::Invalid(format!(
            "auto: the GPUs are on {count} host nodes; give at least {count} vCPUs (one per node)"
        )));
    }
    let unit = AUTO_RAM_UNIT.max(page_size);
    let per_node = memory_size / unit / count as u64 * unit;
    if per_node == 0 {
        return Err(NumaError::Invalid(format!(
            "auto: {} of RAM cannot be split over {count} nodes in {} steps",
            ByteSize(memory_size),
            ByteSize(unit)
        )));
    }
    let per_node_cpus = usize::from(vcpus) / count;
    let first_cpus = usize::from(vcpus) - per_node_cpus * (count - 1);
    let mut next_cpu = 0u8;
    Ok(host_order
        .iter()
        .enumerate()
        .map(|(index, host_node)| {
            let (cpus, mem_size) = if index == 0 {
                (first_cpus, memory_size - per_node * (count as u64 - 1))
            } else {
                (per_node_cpus, per_node)
            };
            let first = next_cpu;
            next_cpu += cpus as u8;
            NodePlan {
                cpus: (first..next_cpu).collect(),
                mem_size,
                host_node: Some(*host_node),
                pci_segments: Vec::new(),
            }
        })
        .collect())
}

/// The host's distances between `host_order`'s nodes; 20 where the host gives none or
/// one a guest cannot be told (another node no farther than the node itself).
fn host_distances(host: &HostNuma, host_order: &[u32]) -> Result<Vec<Vec<u8>>, NumaError> {
    host_order
        .iter()
        .map(|from| {
            let known = host.distances_from(*from)?;
            Ok(host_order
                .iter()
                .map(|to| match known.get(to) {
                    _ if from == to => LOCAL_DISTANCE,
                    Some(d) if (11..=254).contains(d) => *d as u8,
                    _ => REMOTE_DISTANCE,
                })
                .collect())
        })
        .collect()
}

/// Checks the nodes given: ids 0..N once each, every possible vCPU on exactly one node,
/// the sizes adding up to the VM's RAM.
fn explicit_nodes(
    specs: &[NumaNodeSpec],
    vcpus: u8,
    memory_size: u64,
    page_size: u64,
) -> Result<Vec<NodePlan>, NumaError> {
    let mut sorted: Vec<&NumaNodeSpec> = specs.iter().collect();
    sorted.sort_by_key(|spec| spec.node);
    for (index, spec) in sorted.iter().enumerate() {
        if spec.node != index as u32 {
            return Err(NumaError::Invalid(format!(
                "guest nodes must be numbered 0 to {} once each (node={} {})",
                specs.len() - 1,
                spec.node,
                if sorted[..index].iter().any(|s| s.node == spec.node) {
                    "is given twice"
                } else {
                    "leaves a gap"
                }
            )));
        }
    }
    let mut owner: BTreeMap<u8, u32> = BTreeMap::new();
    for spec in &sorted {
        if spec.cpus.is_empty() {
            return Err(NumaError::Invalid(format!(
                "node {} has no cpus",
                spec.node
            )));
        }
        for cpu in &spec.cpus {
            if *cpu >= vcpus {
                return Err(NumaError::Invalid(format!(
                    "node {} lists vCPU {cpu}, but the VM has vCPUs 0 to {}",
                    spec.node,
                    vcpus - 1
                )));
            }
            if let Some(other) = owner.insert(*cpu, spec.node) {
                return Err(NumaError::Invalid(format!(
                    "vCPU {cpu} is on node {other} and node {}",
                    spec.node
                )));
            }
        }
    }
    if let Some(missing) = (0..vcpus).find(|cpu| !owner.contains_key(cpu)) {
        return Err(NumaError::Invalid(format!(
            "vCPU {missing} is on no node (every vCPU, hot-pluggable ones too, needs one)"
        )));
    }
    for spec in &sorted {
        if spec.mem_size == 0 || !spec.mem_size.is_multiple_of(page_size) {
            return Err(NumaError::Invalid(format!(
                "node {}: mem_mib must be a positive multiple of the {} page size",
                spec.node,
                ByteSize(page_size)
            )));
        }
    }
    let total = sorted
        .iter()
        .try_fold(0u64, |sum, spec| sum.checked_add(spec.mem_size));
    if total != Some(memory_size) {
        return Err(NumaError::Invalid(format!(
            "the nodes' memory adds up to {}, but the VM has {}",
            total.map_or_else(
                || "more than 16 EiB".to_string(),
                |t| ByteSize(t).to_string()
            ),
            ByteSize(memory_size)
        )));
    }
    Ok(sorted
        .into_iter()
        .map(|spec| NodePlan {
            cpus: spec.cpus.clone(),
            mem_size: spec.mem_size,
            host_node: spec.host_node,
            pci_segments: spec.pci_segments.clone(),
        })
        .collect())
}

/// The PCI segments given to nodes: each one of the VM's `segments`, on one node.
fn check_node_segments(nodes: &[NodePlan], segments: u16) -> Result<(), NumaError> {
    let mut owner = BTreeMap::new();
    for (node, plan) in nodes.iter().enumerate() {
        for &segment in &plan.pci_segments {
            if segment >= segments {
                return Err(NumaError::Invalid(format!(
                    "node {node} lists PCI segment {segment}, but the VM has segments 0 to {} \
                     (platform.num_pci_segments)",
                    segments - 1
                )));
            }
            if let Some(other) = owner.insert(segment, node) {
                return Err(NumaError::Invalid(format!(
                    "PCI segment {segment} is on node {other} and node {node} (a host bridge \
                     has one node)"
                )));
            }
        }
    }
    Ok(())
}

/// The guest-physical ranges of the RAM file's bytes `[offset, offset + size)`.
fn guest_ranges(regions: &[RamRegion], offset: u64, size: u64) -> Vec<(u64, u64)> {
    let end = offset + size;
    regions
        .iter()
        .filter_map(|region| {
            let start = offset.max(region.file_offset);
            let stop = end.min(region.file_offset + region.size);
            (start < stop).then(|| {
                (
                    region.guest_addr + (start - region.file_offset),
                    stop - start,
                )
            })
        })
        .collect()
}

/// The real host node RAM and vCPUs of host node `node` go to: `node`, or the test hook's.
fn real_host_node(node: u32) -> u32 {
    match std::env::var(TEST_BIND_NODE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(real) => {
            log::warn!(
                "test hook {TEST_BIND_NODE_ENV}: host node {node}'s guest RAM and vCPUs go to host node {real}"
            );
            real
        }
        None => node,
    }
}

/// A guest PCI address: segment, bus, device, function.
pub type GuestPciAddress = (u16, u8, u8, u8);

/// What the NUMA stage decided for the VM being built: the builder carries it to the PCI
/// stage (which segment each passthrough device goes on), to the vCPU threads (the host
/// CPUs each pins itself to) and to the machine (the plan its snapshots and live updates
/// carry). Empty without NUMA nodes.
#[derive(Clone, Debug, Default)]
pub struct PlacedNuma {
    pub plan: Option<NumaPlan>,
    /// Each cold-plugged passthrough device's PCI segment other than 0, by backend key
    /// ([`NumaPlan::passthrough_segments`]).
    pub passthrough_segments: BTreeMap<String, u16>,
    /// The host CPUs of each pinned vCPU, by vCPU id.
    pub vcpu_cpus: BTreeMap<u8, Vec<usize>>,
}

impl PlacedNuma {
    /// The plan as a snapshot or live update carries it.
    pub fn saved(&self) -> Option<SavedNumaPlan> {
        self.plan.as_ref().map(SavedNumaPlan::of)
    }

    /// The host CPUs vCPU `id` is pinned to, if it is.
    pub fn cpus_of(&self, id: u8) -> Option<Vec<usize>> {
        self.vcpu_cpus.get(&id).cloned()
    }
}

/// Pins the calling thread, vCPU `id`'s, to host CPUs `cpus`. vCPU threads call it before
/// their seccomp filter is on (the filter has no sched_setaffinity).
pub fn pin_current_vcpu_thread(id: u8, cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in cpus {
        // SAFETY: CPU_SET bounds-checks `cpu` against the set's size.
        unsafe { libc::CPU_SET(*cpu, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; the set is a valid cpu_set_t of the size given.
    let result = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if result != 0 {
        log::warn!(
            "cannot pin vCPU {id} to host CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        );
    } else {
        log::debug!("vCPU {id} pinned to host CPUs {cpus:?}");
    }
}

impl NumaPlan {
    /// Binds each node's RAM to its host node (before anything touches it; `ram` None: RAM
    /// a live update adopted, bound by the process that made it) and returns the vCPU
    /// threads' pinning. A host node this host lacks is an error.
    pub fn place(
        &self,
        ram: Option<&GuestRam>,
        host: &HostNuma,
    ) -> Result<BTreeMap<u8, Vec<usize>>, NumaError> {
        let mut affinity = BTreeMap::new();
        let real_sysfs = HostNuma::at(Path::new("/sys"));
        let mut offset = 0;
        for (guest_node, node) in self.nodes.iter().enumerate() {
            let guest_node = guest_node as u32;
            if let Some(host_node) = node.host_node {
                host.check_node(host_node)?;
                let real = real_host_node(host_node);
                if let Some(ram) = ram {
                    bind_file_range(ram, offset, node.mem_size, real, NodePolicy::Bind)
                        .map_err(|source| NumaError::Bind { guest_node, source })?;
                }
                if self.pin_vcpus {
                    let cpus = real_sysfs.cpus_of(real)?;
                    for cpu in &node.cpus {
                        affinity.insert(*cpu, cpus.clone());
                    }
                }
                log::info!(
                    "guest NUMA node {guest_node}: vCPUs {:?}, {} bound to host node {real}{}",
                    node.cpus,
                    ByteSize(node.mem_size),
                    if self.pin_vcpus { ", vCPUs pinned" } else { "" }
                );
            } else {
                log::info!(
                    "guest NUMA node {guest_node}: vCPUs {:?}, {} (no host node)",
                    node.cpus,
                    ByteSize(node.mem_size)
                );
            }
            offset += node.mem_size;
        }
        Ok(affinity)
    }

    /// What the SRAT and SLIT say: each possible vCPU's node, each node's RAM ranges (in
    /// the guest layout `regions`), and each cold-plugged passthrough device's node:
    /// `device_keys` ([`device_keys`]) and `labels` (the plugged devices' labels, which
    /// start with their guest address) are both in plug order; `segments` has those not
    /// on segment 0 ([`PlacedNuma::passthrough_segments`]).
    ///
    /// With `ram_hotplug_size` bytes of hot-pluggable RAM, its area (where the builder puts
    /// it, right after boot RAM) is a hot-pluggable range of the node that holds the highest
    /// boot RAM ([`hotplug_domain`]), so the guest knows the range and the node of RAM added
    /// later before any arrives.
    pub fn topology(
        &self,
        regions: &[RamRegion],
        ram_hotplug_size: u64,
        device_keys: &[String],
        labels: &[String],
        segments: &BTreeMap<String, u16>,
    ) -> NumaTopology {
        let guest_devices: Vec<(String, GuestPciAddress)> = device_keys
            .iter()
            .zip(labels)
            .filter_map(|(key, label)| {
                let (segment, bus, device, function) = parse_label_bdf(label)?;
                let segment = segments.get(key).copied().unwrap_or(segment);
                Some((key.clone(), (segment, bus, device, function)))
            })
            .collect();
        let mut topology = self.topology_of(regions, &guest_devices);
        if ram_hotplug_size > 0 {
            let top = regions.iter().map(RamRegion::end).max().unwrap_or(0);
            let (base, size) = gpuvm_arch::x86_64::layout::ram_hotplug_area(top, ram_hotplug_size);
            topology.memory.push(NumaMemoryRange {
                domain: hotplug_domain(&topology.memory),
                base,
                size,
                hotpluggable: true,
            });
        }
        topology
    }

    /// As [`NumaPlan::topology`], with each device's backend key and guest PCI address
    /// (segment, bus, device, function).
    pub fn topology_of(
        &self,
        regions: &[RamRegion],
        guest_devices: &[(String, GuestPciAddress)],
    ) -> NumaTopology {
        let possible = self.nodes.iter().map(|n| n.cpus.len()).sum();
        let mut cpu_domains = vec![0; possible];
        let mut memory = Vec::new();
        let mut offset = 0;
        for (domain, node) in self.nodes.iter().enumerate() {
            for cpu in &node.cpus {
                if let Some(slot) = cpu_domains.get_mut(usize::from(*cpu)) {
                    *slot = domain as u32;
                }
            }
            for (base, size) in guest_ranges(regions, offset, node.mem_size) {
                memory.push(NumaMemoryRange {
                    domain: domain as u32,
                    base,
                    size,
                    hotpluggable: false,
                });
            }
            offset += node.mem_size;
        }
        let initiators = guest_devices
            .iter()
            .filter_map(|(key, (segment, bus, device, function))| {
                Some(NumaPciInitiator {
                    domain: *self.device_nodes.get(key)?,
                    segment: *segment,
                    bus: *bus,
                    device: *device,
                    function: *function,
                })
            })
            .collect();
        let segment_domains = (self.nodes.iter().enumerate())
            .flat_map(|(domain, node)| {
                (node.pci_segments.iter()).map(move |&segment| (segment, domain as u32))
            })
            .collect();
        NumaTopology {
            cpu_domains,
            memory,
            initiators,
            segment_domains,
            distances: self.distances.clone(),
        }
    }
}

impl NumaPlan {
    /// The PCI segment of each cold-plugged passthrough device (`device_keys`, in plug
    /// order) that must leave segment 0 for Linux to see its node, by backend key.
    ///
    /// Linux takes a PCI device's `numa_node` from its host bridge's `_PXM` only (neither
    /// a Generic Initiator nor a `_PXM` on the device reaches it), so each guest node other
    /// than 0 that holds a device gets a segment (a host bridge) of its own, numbered from
    /// `first_free` in node order; the ACPI tables give each such host bridge its devices'
    /// node ([`gpuvm_arch::x86_64::acpi`]). Devices on node 0 or on no node stay on
    /// segment 0, whose host bridge is node 0's. Empty when every device is on node 0 or
    /// none: the layout stays as it is without NUMA.
    pub fn passthrough_segments(
        &self,
        device_keys: &[String],
        first_free: u16,
    ) -> Result<BTreeMap<String, u16>, NumaError> {
        let remote_nodes: BTreeSet<u32> = device_keys
            .iter()
            .filter_map(|key| self.device_nodes.get(key).copied())
            .filter(|&node| node != 0)
            .collect();
        let mut node_segments = BTreeMap::new();
        for (index, node) in remote_nodes.into_iter().enumerate() {
            let segment = u16::try_from(index)
                .ok()
                .and_then(|index| first_free.checked_add(index))
                .filter(|&segment| segment < MAX_PCI_SEGMENTS)
                .ok_or_else(|| {
                    NumaError::Invalid(format!(
                        "passthrough devices on guest node {node} need a PCI segment of their \
                         own (Linux reads a device's node from its host bridge), but the VM \
                         has {first_free} already and at most {MAX_PCI_SEGMENTS}"
                    ))
                })?;
            node_segments.insert(node, segment);
        }
        Ok(device_keys
            .iter()
            .filter_map(|key| {
                let node = self.device_nodes.get(key)?;
                Some((key.clone(), *node_segments.get(node)?))
            })
            .collect())
    }
}

/// The proximity domain of the hot-plug area: that of the highest boot RAM (`boot_ram`:
/// the node ranges), which the area continues; 0 without boot RAM ranges. gpuvm has one
/// hot-plug area and no per-node hot-plug sizes (Cloud Hypervisor's memory zones have
/// them), so the area extends the last node's RAM, as more DIMMs on that socket would.
fn hotplug_domain(boot_ram: &[NumaMemoryRange]) -> u32 {
    boot_ram
        .iter()
        .max_by_key(|range| range.base + range.size)
        .map_or(0, |range| range.domain)
}

/// The NUMA plan of a VM of `machine` with `pci`, or None without NUMA nodes.
pub fn plan_for(
    machine: &crate::config::MachineConfig,
    pci: &PciOptions,
) -> Result<Option<NumaPlan>, NumaError> {
    plan(
        &pci.numa,
        machine.vcpus,
        pci.max_vcpus(machine),
        machine.memory_size,
        machine.backing.page_size(),
        pci,
        &HostNuma::from_env(),
    )
}

/// Plans the VM's nodes, places its RAM (`ram`: just created, untouched; None for RAM a
/// live update adopted, placed already) and plans its vCPU threads' pinning and its
/// passthrough devices' segments; with no nodes, says why where `--numa auto` chose none.
pub fn prepare(
    machine: &crate::config::MachineConfig,
    pci: &PciOptions,
    ram: Option<&GuestRam>,
) -> Result<PlacedNuma, NumaError> {
    let named = named_segments(pci);
    match plan_for(machine, pci)? {
        Some(plan) => {
            // Segments for passthrough devices come after those the VM asked for (and
            // those devices name).
            let asked = crate::pci::segment_count(pci)
                .map_err(|error| NumaError::Invalid(error.to_string()))?
                .max(named.values().max().map_or(0, |highest| highest + 1));
            // Each segment's ECAM window covers the buses its root ports and switches
            // number (layout::pci_ecam_bases), so a node's segment holds its devices with
            // the host's topology as segment 0 does. A device that names its segment
            // stays there.
            let placed: Vec<String> = (device_keys(pci).into_iter())
                .filter(|key| !named.contains_key(key))
                .collect();
            let mut segments = plan.passthrough_segments(&placed, asked)?;
            for (key, segment) in &segments {
                log::info!(
                    "passthrough device {key}: PCI segment {segment}, whose host bridge is \
                     guest node {}'s",
                    plan.device_nodes.get(key).copied().unwrap_or_default()
                );
            }
            segments.extend(named);
            let vcpu_cpus = plan.place(ram, &HostNuma::from_env())?;
            Ok(PlacedNuma {
                plan: Some(plan),
                passthrough_segments: segments,
                vcpu_cpus,
            })
        }
        None => {
            if pci.numa.mode == NumaMode::Auto {
                log::info!(
                    "--numa auto: one guest node (the VM's GPUs are on fewer than two host nodes, \
                     or the host has one): no SRAT/SLIT needed"
                );
            }
            Ok(PlacedNuma {
                passthrough_segments: named,
                ..PlacedNuma::default()
            })
        }
    }
}

/// The segments other than 0 that cold-plugged passthrough devices name (`pci_segment`),
/// by backend key.
fn named_segments(pci: &PciOptions) -> BTreeMap<String, u16> {
    device_keys(pci)
        .into_iter()
        .filter_map(|key| {
            let segment = pci.tuning_of(&key).segment.filter(|&s| s != 0)?;
            Some((key, segment))
        })
        .collect()
}

/// The node plan a snapshot carries, so that a restore binds each node's RAM (and pins
/// its vCPUs) as the VM was: the plan as resolved (auto mode's host nodes included), not
/// the options it came from, since the restored guest's SRAT is in its RAM already.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedNumaPlan {
    /// Guest node `i` is `nodes[i]`; its RAM follows that of nodes `0..i`.
    pub nodes: Vec<SavedNumaNode>,
    pub distances: Vec<Vec<u8>>,
    #[serde(default)]
    pub pin_vcpus: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedNumaNode {
    pub cpus: Vec<u8>,
    pub mem_size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_node: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pci_segments: Vec<u16>,
}

impl SavedNumaPlan {
    pub fn of(plan: &NumaPlan) -> Self {
        SavedNumaPlan {
            nodes: plan
                .nodes
                .iter()
                .map(|node| SavedNumaNode {
                    cpus: node.cpus.clone(),
                    mem_size: node.mem_size,
                    host_node: node.host_node,
                    pci_segments: node.pci_segments.clone(),
                })
                .collect(),
            distances: plan.distances.clone(),
            pin_vcpus: plan.pin_vcpus,
        }
    }

    /// The options that plan these nodes again (checked again against the restoring host:
    /// a host node it lacks is refused).
    pub fn options(&self) -> NumaOptions {
        let specs = self
            .nodes
            .iter()
            .enumerate()
            .map(|(index, node)| NumaNodeSpec {
                node: index as u32,
                cpus: node.cpus.clone(),
                mem_size: node.mem_size,
                host_node: node.host_node,
                pci_segments: node.pci_segments.clone(),
            })
            .collect();
        NumaOptions {
            mode: NumaMode::Nodes(specs),
            pin_vcpus: self.pin_vcpus,
            distances: Some(self.distances.clone()),
        }
    }
}

/// Parses a guest PCI address as a passthrough device's label starts (`bb:dd.f` on
/// segment 0, `ssss:bb:dd.f` elsewhere: PciBdf::shown).
pub fn parse_label_bdf(label: &str) -> Option<GuestPciAddress> {
    let address = label.split_whitespace().next()?;
    // `bus:device.function`, or `segment:bus:device.function` off segment 0.
    let (segment, address) = match address.matches(':').count() {
        2 => {
            let (segment, rest) = address.split_once(':')?;
            (u16::from_str_radix(segment, 16).ok()?, rest)
        }
        _ => (0, address),
    };
    let (bus, rest) = address.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    Some((
        segment,
        u8::from_str_radix(bus, 16).ok()?,
        u8::from_str_radix(device, 16).ok()?,
        function.parse().ok()?,
    ))
}

#[cfg(test)]
#[path = "numa_tests.rs"]
mod tests;
