//! The one action type between the HTTP layer and the VMM thread, and the JSON bodies
//! the routes take. Bodies reject unknown fields.

use std::path::PathBuf;

use gpuvm_memory::Backing;
use serde::{Deserialize, Serialize};

use crate::config::MachineConfig;
use crate::x86_64::cpuid::CpuidMask;

/// Largest guest memory the API accepts, in MiB (keeps `mem_size_mib << 20` in range;
/// the host's own limits are checked when the VM is built).
pub const MAX_MEM_SIZE_MIB: u64 = 1 << 24;

/// What the API thread asks the VMM thread to do.
#[derive(Debug)]
pub enum VmmAction {
    GetInstanceInfo,
    GetMachineConfig,
    PutMachineConfig(MachineConfigBody),
    PutBootSource(BootSourceBody),
    StartInstance,
    /// The test guest has no keyboard: this ends the run as a guest reset would.
    SendCtrlAltDel,
    Pause,
    Resume,
    CreateSnapshot(SnapshotCreateBody),
    LoadSnapshot(SnapshotLoadBody),
    GetMetrics,
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
        }
    }

    /// Checks the values and turns them into a configuration.
    pub fn to_config(&self) -> Result<MachineConfig, ActionError> {
        if self.vcpu_count == 0 {
            return Err(ActionError::bad_request("vcpu_count must be at least 1"));
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

/// PUT /snapshot/create.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreateBody {
    /// The snapshot directory (absolute).
    pub snapshot_path: PathBuf,
    #[serde(default)]
    pub snapshot_type: SnapshotType,
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
}

/// `--config-file`: the pre-boot configuration in one JSON document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(rename = "machine-config")]
    pub machine_config: Option<MachineConfigBody>,
    #[serde(rename = "boot-source")]
    pub boot_source: Option<BootSourceBody>,
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
    fn enums_use_firecracker_spelling() {
        let body: ActionBody = serde_json::from_str(r#"{"action_type":"InstanceStart"}"#).unwrap();
        assert_eq!(body.action_type, ActionType::InstanceStart);
        let body: SnapshotLoadBody = serde_json::from_str(r#"{"snapshot_path":"/s"}"#).unwrap();
        assert_eq!(body.restore_mode, RestoreModeBody::Lazy);
        assert!(!body.resume_vm);
        assert!(serde_json::from_str::<VmStateBody>(r#"{"state":"Running"}"#).is_err());
    }
}
