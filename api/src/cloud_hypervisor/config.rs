//! Cloud Hypervisor's VmConfig and device bodies, with its field names. Only the fields
//! gpuvm acts on are typed; every other field lands in `other` and is accepted when it
//! holds Cloud Hypervisor's default (or is one gpuvm may safely ignore), else the request
//! is answered 400 naming the field.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Fields gpuvm does not model.
pub type Other = BTreeMap<String, Value>;

/// Cloud Hypervisor's documented defaults that are not false, zero, null or empty.
const NON_ZERO_DEFAULTS: &[(&str, &str)] = &[
    ("ip", "\"192.168.249.1\""),
    ("mask", "\"255.255.255.0\""),
    ("vhost_mode", "\"Client\""),
    ("hotplug_method", "\"Acpi\""),
    ("nested", "true"),
    ("sparse", "true"),
    ("offload_tso", "true"),
    ("offload_ufo", "true"),
    ("offload_csum", "true"),
    ("image_type", "\"Raw\""),
    ("lock_granularity", "\"ByteRange\""),
    ("num_queues", "1"),
    ("queue_size", "128"),
    ("core_scheduling", "\"Vm\""),
];

/// Fields the translation reads itself (translate.rs checks their values).
const TRANSLATED: &[&str] = &["num_pci_segments", "pci_segment"];

/// Fields accepted at any value because they change nothing gpuvm's guest can rely on:
/// gpuvm ignores the CPU topology hint. A disk's `queue_size` is the largest
/// virtqueue the device offers; gpuvm's drives offer 256 entries and the driver sizes its
/// queue within that (Kata asks 1024 for hot-plugged disks); network interfaces and shares
/// read theirs.
const IGNORED: &[&str] = &[
    "topology",
    "queue_size",
    "max_phys_bits",
    "serial_number",
    "uuid",
    "oem_strings",
    "id",
];

fn is_default(name: &str, value: &Value) -> bool {
    let zero = match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.iter().all(|(k, v)| is_default(k, v)),
    };
    zero || NON_ZERO_DEFAULTS.iter().any(|(field, default)| {
        *field == name && serde_json::from_str::<Value>(default).is_ok_and(|d| d == *value)
    })
}

/// Refuses the first field of `other` that is neither at its default nor ignorable,
/// naming it as `prefix.field`.
pub fn check_other(prefix: &str, other: &Other) -> Result<(), String> {
    for (name, value) in other {
        if TRANSLATED.contains(&name.as_str()) {
            continue;
        }
        if IGNORED.contains(&name.as_str()) {
            if !is_default(name, value) {
                log::info!("Cloud Hypervisor API: ignoring {prefix}{name} = {value}");
            }
            continue;
        }
        if let Value::Object(members) = value {
            // A section gpuvm does not model (platform, balloon, ...): each of its fields
            // must be at its default, named in full.
            let members: Other = members.clone().into_iter().collect();
            check_other(&format!("{prefix}{name}."), &members)?;
            continue;
        }
        if !is_default(name, value) {
            return Err(format!(
                "{prefix}{name} = {value} is not supported by gpuvm (only its default is accepted)"
            ));
        }
    }
    Ok(())
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PayloadConfig {
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: Option<String>,
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CpusConfig {
    pub boot_vcpus: u32,
    pub max_vcpus: u32,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemoryConfig {
    pub size: u64,
    #[serde(default)]
    pub shared: bool,
    #[serde(default)]
    pub hugepages: bool,
    #[serde(default)]
    pub hugepage_size: Option<u64>,
    #[serde(default = "yes")]
    pub thp: bool,
    #[serde(default)]
    pub prefault: bool,
    /// Room for ACPI memory hot-plug (vm.resize desired_ram), bytes; Kata always sends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotplug_size: Option<u64>,
    /// "Acpi" (Cloud Hypervisor's default) or "VirtioMem" (not supported by gpuvm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotplug_method: Option<String>,
    #[serde(flatten)]
    pub other: Other,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DiskConfig {
    #[serde(default)]
    pub path: Option<PathBuf>,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub direct: bool,
    #[serde(default)]
    pub vhost_user: bool,
    #[serde(default)]
    pub vhost_socket: Option<PathBuf>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NetConfig {
    #[serde(default)]
    pub tap: Option<String>,
    #[serde(default)]
    pub mac: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub num_queues: Option<u16>,
    #[serde(default)]
    pub queue_size: Option<u16>,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FsConfig {
    pub tag: String,
    pub socket: PathBuf,
    #[serde(default)]
    pub num_queues: Option<u16>,
    #[serde(default)]
    pub queue_size: Option<u16>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VsockConfig {
    pub cid: u64,
    pub socket: PathBuf,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RngConfig {
    pub src: PathBuf,
    #[serde(flatten)]
    pub other: Other,
}

/// `balloon`: `size` in bytes (whole MiB); free page reporting is refused.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BalloonConfig {
    pub size: u64,
    #[serde(default)]
    pub deflate_on_oom: bool,
    #[serde(default)]
    pub free_page_reporting: bool,
    #[serde(flatten)]
    pub other: Other,
}

/// A host PCI device to pass through: `path` is its sysfs directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub id: Option<String>,
    /// The GPUDirect clique (0 to 15) NVIDIA's driver in the guest is told; absent:
    /// derived from the host's PCIe topology. Any JSON here, so that a value out of range
    /// or of another type is refused by name (translate.rs) rather than as a parse error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x_nv_gpudirect_clique: Option<serde_json::Value>,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConsoleConfig {
    pub mode: String,
    #[serde(flatten)]
    pub other: Other,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmConfig {
    pub payload: PayloadConfig,
    #[serde(default)]
    pub cpus: Option<CpusConfig>,
    #[serde(default)]
    pub memory: Option<MemoryConfig>,
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    #[serde(default)]
    pub net: Vec<NetConfig>,
    #[serde(default)]
    pub fs: Vec<FsConfig>,
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    #[serde(default)]
    pub rng: Option<RngConfig>,
    #[serde(default)]
    pub balloon: Option<BalloonConfig>,
    #[serde(default)]
    pub devices: Vec<DeviceConfig>,
    #[serde(default)]
    pub serial: Option<ConsoleConfig>,
    #[serde(default)]
    pub console: Option<ConsoleConfig>,
    /// Guest NUMA nodes (translate.rs: [`super::translate::numa`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<Vec<NumaConfig>>,
    #[serde(flatten)]
    pub other: Other,
}

/// One guest NUMA node. Numbers are JSON values so that one out of range is refused by
/// name (translate.rs) rather than as a parse error.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NumaConfig {
    pub guest_numa_id: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distances: Option<Vec<NumaDistance>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_zones: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_segments: Option<Vec<Value>>,
    #[serde(flatten)]
    pub other: Other,
}

/// A node's distance to another (`destination` is a guest_numa_id).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NumaDistance {
    pub destination: Value,
    pub distance: Value,
    #[serde(flatten)]
    pub other: Other,
}

/// vm.remove-device.
#[derive(Clone, Debug, Deserialize)]
pub struct RemoveDevice {
    pub id: String,
}

/// vm.snapshot.
#[derive(Clone, Debug, Deserialize)]
pub struct SnapshotConfig {
    pub destination_url: String,
    #[serde(flatten)]
    pub other: Other,
}

/// vm.restore.
#[derive(Clone, Debug, Deserialize)]
pub struct RestoreConfig {
    pub source_url: String,
    #[serde(default)]
    pub prefault: bool,
    /// `Copy` (Cloud Hypervisor's default, which ch-remote always sends): every page is
    /// loaded before the VM runs; `OnDemand`: pages on fault (gpuvm's lazy restore, also
    /// what gpuvm does when the field is absent).
    #[serde(default)]
    pub memory_restore_mode: Option<String>,
    /// Run the VM once restored (otherwise it waits for vm.resume).
    #[serde(default)]
    pub resume: bool,
    /// New taps for the network interfaces that came as descriptors: the descriptors
    /// come with the request (SCM_RIGHTS), `num_fds` of them per interface, in order.
    /// (ch-remote sends `null` for none.)
    #[serde(default)]
    pub net_fds: Option<Vec<RestoredNetConfig>>,
    #[serde(flatten)]
    pub other: Other,
}

/// One interface of vm.restore's `net_fds`.
#[derive(Clone, Debug, Deserialize)]
pub struct RestoredNetConfig {
    pub id: String,
    pub num_fds: usize,
    #[serde(flatten)]
    pub other: Other,
}
