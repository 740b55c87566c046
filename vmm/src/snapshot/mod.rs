//! Snapshots of a running machine and restore into a new process.
//!
//! A snapshot directory holds:
//! - `state`: the [`MachineState`] (vCPUs, in-kernel devices, serial, configuration, and
//!   the names of the memory files), framed by [`crate::persist`];
//! - `memory-<N>`: memory files in gpuvm's sparse format (docs/memory-file-format.md), a
//!   full one first, then diffs when dirty-page tracking is on.
//!
//! Commit protocol: new memory files get fresh names, then the state file is replaced
//! atomically, and only then are memory files the new state does not name deleted. A
//! snapshot killed at any point leaves the previous `state` and every file it names; one
//! that fails removes what it wrote and leaves the rest as it was.
//!
//! A snapshot holds an exclusive lock on its directory ([`SnapshotDirLock`]) from before
//! the first file is touched until its commit is done; a restore holds a shared one while
//! it reads. gpuvm removes or replaces only files it wrote there (its names and its
//! magic); a directory whose `state` is anything else is refused.

//!
//! - this file: the state file's tree ([`MachineState`]), the errors, and the restore's
//!   modes and stage timings;
//! - [`dir`]: the snapshot directory: its lock, memory file names, writing memory,
//!   committing a state and cleaning up what it no longer names;
//! - [`load`]: reading and checking a snapshot before anything touches KVM.
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_arch::x86_64::cpuid::CpuidMask;
use gpuvm_memory::snapshot::SnapshotInfo;
use gpuvm_memory::Backing;
use serde::{Deserialize, Serialize};

use crate::config::MachineConfig;
use crate::devices::DeviceStates;
use crate::persist::PersistError;
use crate::vcpu::VcpuState;
use crate::vm_state::VmState;

mod dir;
pub mod files;
mod load;
pub mod migrate;

pub use dir::SnapshotDirLock;
pub(crate) use dir::{
    check_replaceable, commit, fresh_file_name, prepare_dir, write_memory, write_memory_background,
};
pub use load::{load, load_state, ChainInputs, LoadedSnapshot, LoadedState};

pub const STATE_FILE: &str = "state";
const MEMORY_FILE_PREFIX: &str = "memory-";

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot create snapshot directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot create snapshot directory {path}: its parent directory does not exist \
         (gpuvm creates only the last component)"
    )]
    NoParentDir { path: PathBuf },
    #[error(
        "snapshot directory {path} is in use by another gpuvm process (it is writing a \
         snapshot there, or reading one); nothing was written"
    )]
    DirInUse { path: PathBuf },
    #[error(
        "snapshot directory {path} is being written by another gpuvm process; restore it \
         once that snapshot is done"
    )]
    DirBeingWritten { path: PathBuf },
    #[error("cannot lock snapshot directory {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "refusing to write into {dir}: its {name} is not a file gpuvm wrote (gpuvm \
         replaces or removes only its own files)"
    )]
    NotGpuvmFile { dir: PathBuf, name: &'static str },
    #[error(transparent)]
    State(#[from] PersistError),
    #[error(transparent)]
    Memory(#[from] gpuvm_memory::snapshot::SnapshotError),
    #[error(transparent)]
    Uffd(#[from] gpuvm_memory::uffd::UffdError),
    #[error("snapshot {dir}: {reason}")]
    Invalid { dir: PathBuf, reason: String },
    #[error(
        "memory file {path} belongs to another snapshot: it is memory snapshot {found}, the \
         state file was written with {expected}"
    )]
    ForeignMemoryFile {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error(
        "page CRC table {path} belongs to another snapshot: its entries' CRC is {found:#010x}, \
         the state file names {expected:#010x}"
    )]
    ForeignPageCrcs {
        path: PathBuf,
        expected: u32,
        found: u32,
    },
    #[error(
        "cannot snapshot a VM with cold-plugged passthrough devices ({}): gpuvm saves the \
         state of hot-plugged ones (PUT /gpus/{{id}} after start, with VFIO migration) and of \
         cold-plugged vfio-user ones behind the ports of --pci-topology host only; \
         hot-plugged GPUs can also be released by the guest for the snapshot (\"passthrough\": \"guest_release\", with a vsock device and the \
         guest's GPU agent; docs/gpu-snapshots.md)",
        devices.join(", ")
    )]
    Passthrough { devices: Vec<String> },
    #[error(
        "cannot snapshot this VM: {}. A hot-plugged GPU without VFIO migration can be released \
         by the guest for the snapshot instead (\"passthrough\": \"guest_release\", with a vsock \
         device and the guest's GPU agent; docs/gpu-snapshots.md)",
        refusals.join("; ")
    )]
    PassthroughNotMigratable { refusals: Vec<String> },
    #[error("passthrough device {id}: {reason}")]
    PassthroughState { id: String, reason: String },
    #[error("this VM cannot be snapshotted: {0}")]
    Unsnapshottable(String),
    #[error("KVM failed to {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("cannot save the device state: {0}")]
    SaveDevices(crate::devices::DeviceStateError),
}

/// The machine configuration as stored in a snapshot.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SavedMachineConfig {
    pub vcpus: u8,
    pub memory_size: u64,
    pub backing: String,
    pub thp: bool,
    pub cpuid_masks: Vec<String>,
    pub track_dirty_pages: bool,
}

impl SavedMachineConfig {
    pub fn from_config(config: &MachineConfig) -> Self {
        SavedMachineConfig {
            vcpus: config.vcpus,
            memory_size: config.memory_size,
            backing: config.backing.to_string(),
            thp: config.thp,
            cpuid_masks: config.cpuid_masks.iter().map(|m| m.to_string()).collect(),
            track_dirty_pages: config.track_dirty_pages,
        }
    }

    pub fn to_config(&self, dir: &Path) -> Result<MachineConfig, SnapshotError> {
        let invalid = |reason: String| SnapshotError::Invalid {
            dir: dir.to_path_buf(),
            reason,
        };
        let backing: Backing = self
            .backing
            .parse()
            .map_err(|e: gpuvm_memory::RamError| invalid(e.to_string()))?;
        let cpuid_masks = self
            .cpuid_masks
            .iter()
            .map(|m| m.parse::<CpuidMask>().map_err(|e| invalid(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MachineConfig {
            vcpus: self.vcpus,
            memory_size: self.memory_size,
            backing,
            thp: self.thp,
            prefault: false,
            cpuid_masks,
            track_dirty_pages: self.track_dirty_pages,
        })
    }
}

/// Everything in a snapshot's state file.
#[derive(Serialize, Deserialize)]
pub struct MachineState {
    pub config: SavedMachineConfig,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    /// Every emulated device's state (see [`DeviceStates`]), e.g. `serial`.
    #[serde(flatten)]
    pub devices: DeviceStates,
    /// Memory files in this directory, base first, then diffs in order.
    pub memory_files: Vec<String>,
    /// The id (from its header) of the newest of `memory_files`, binding them to this
    /// state: a restore refuses the chain unless its newest file has this id, and each
    /// diff names its base by id, so every file is bound. `None` in states written
    /// before ids were recorded: they load with a warning, their files unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_file_id: Option<String>,
    /// Set in the state file Firecracker's API writes beside a raw guest-RAM image
    /// ([`files`]): its memory file is that image, not gpuvm's format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_memory: Option<RawMemory>,
    /// The guest NUMA nodes the RAM was bound by, bound again on restore. `None`: no
    /// nodes (and states written before gpuvm saved them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<crate::numa::SavedNumaPlan>,
}

/// A state's memory file is a raw guest-RAM image (Firecracker's layout: flat, sparse;
/// see `gpuvm_memory::snapshot::write_raw`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RawMemory {
    /// The image's size in bytes: the guest's RAM size. A load refuses any other.
    pub size: u64,
    /// A Diff: only the pages dirtied since the previous snapshot, to be merged onto that
    /// snapshot's image before it is loaded.
    #[serde(default)]
    pub diff: bool,
    /// The page CRC table gpuvm wrote with the image (one CRC32 per page of guest RAM; for
    /// a Diff, of the image once merged onto its base's). A load checks every page against
    /// it; `None` in states written before gpuvm kept one (loaded unchecked, with a
    /// warning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_crcs: Option<RawPageCrcsRecord>,
}

/// Where a raw image's page CRC table is, and which table it is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RawPageCrcsRecord {
    /// Its name in the snapshot directory (gpuvm's hidden directory beside the state file,
    /// `.<state>.gpuvm`).
    pub file: String,
    /// Its entries' CRC32 (`RawPageCrcs::digest`): a table of another snapshot is refused.
    pub crc: u32,
}

/// Where the memory chain of the running machine stands, for diff snapshots.
#[derive(Clone, Debug)]
pub struct MemoryChain {
    pub dir: PathBuf,
    pub files: Vec<String>,
    pub last: SnapshotInfo,
}

/// What a snapshot took.
#[derive(Clone, Debug)]
pub struct SnapshotReport {
    pub dir: PathBuf,
    pub memory_file: String,
    pub diff: bool,
    pub memory_bytes_written: u64,
    pub data_pages: u64,
    pub zero_pages: u64,
    pub pause_to_resume: Duration,
    pub memory_time: Duration,
}

/// How restored guest memory is filled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestoreMode {
    /// Read everything, then run.
    Eager,
    /// Run at once; pages load on fault and in the background (userfaultfd).
    Lazy,
    /// Hand the userfaultfd to an external page-fault handler at this socket
    /// (Firecracker's handshake).
    External(PathBuf),
}

/// Timings of a restore, for reports and benchmarks.
#[derive(Clone, Debug, Default)]
pub struct RestoreTimings {
    pub validate: Duration,
    pub memory: Duration,
    pub total_to_ready: Duration,
    /// The restore's stages in the order they ran, back to back from its start; their
    /// sum is `total_to_ready`:
    /// - `open_kvm`: open /dev/kvm;
    /// - `state`: read the state file, check its magic, version, CRC and configuration;
    /// - `guest_ram`: create the guest RAM memfd and map it;
    /// - `create_vm`: KVM_CREATE_VM, TSS and identity-map addresses;
    /// - `memslots`: register guest RAM with KVM (KVM_SET_USER_MEMORY_REGION);
    /// - `irqchip_pit`: create the in-kernel irqchip and PIT;
    /// - `devices`: serial port, i8042, exit port, PCI root and their irqfds;
    /// - `create_vcpus`: KVM_CREATE_VCPU for each saved vCPU (no state yet);
    /// - `memory_file_wait`: wait for the memory-file validation (headers, index CRCs,
    ///   lengths, chain), or do it here if its thread had not started; the thread's own
    ///   time is in `parallel` as `memory_file`;
    /// - `test_hold`: only with the `GPUVM_TEST_HOLD_AFTER_VALIDATION` hook, its pause;
    /// - `memory`: eager: read all memory; lazy: userfaultfd registration and loader
    ///   start; external: registration, handshake and watcher;
    /// - `vm_state`: serial, irqchip, PIT and clock state;
    /// - `vcpu_state`: every vCPU's saved registers, MSRs, LAPIC, events, CPUID.
    pub stages: Vec<(&'static str, Duration)>,
    /// Work that ran on another thread in parallel with the stages (not part of their
    /// sum), e.g. memory-file validation.
    pub parallel: Vec<(&'static str, Duration)>,
}

/// Records back-to-back stage durations.
#[derive(Debug)]
pub struct StageClock {
    last: std::time::Instant,
    stages: Vec<(&'static str, Duration)>,
}

impl StageClock {
    /// Starts timing at `start`.
    pub fn starting_at(start: std::time::Instant) -> StageClock {
        StageClock {
            last: start,
            stages: Vec::new(),
        }
    }

    /// Ends the current stage, named `name`, now; the next starts now.
    pub fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.stages.push((name, now - self.last));
        self.last = now;
    }

    /// The recorded stages, consuming the clock.
    pub fn into_stages(self) -> Vec<(&'static str, Duration)> {
        self.stages
    }
}

/// How long the vCPUs stay paused for a snapshot that resumes the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotPause {
    /// Only while device and vCPU state is saved and guest RAM is write-protected; the
    /// memory file is then written while the guest runs. The default, where the host
    /// supports it (userfaultfd write protection of shared memory, Linux 5.19+).
    Short,
    /// For the whole write, memory included.
    Full,
}

/// The process's [`SnapshotPause`]: 0 until set, then 1 + the variant's index.
static SNAPSHOT_PAUSE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Sets how long snapshots pause the vCPUs, for every later snapshot of this process
/// (`--snapshot-pause`). Unset, `GPUVM_SNAPSHOT_PAUSE=full` in the environment asks for
/// [`SnapshotPause::Full`] (for the Firecracker and Cloud Hypervisor command lines).
pub fn set_snapshot_pause(pause: SnapshotPause) {
    SNAPSHOT_PAUSE.store(
        match pause {
            SnapshotPause::Short => 1,
            SnapshotPause::Full => 2,
        },
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// The [`SnapshotPause`] snapshots use now.
pub(crate) fn snapshot_pause() -> SnapshotPause {
    match SNAPSHOT_PAUSE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => SnapshotPause::Short,
        2 => SnapshotPause::Full,
        _ if std::env::var_os("GPUVM_SNAPSHOT_PAUSE").is_some_and(|v| v == "full") => {
            SnapshotPause::Full
        }
        _ => SnapshotPause::Short,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_config_round_trips() {
        let config = MachineConfig {
            vcpus: 2,
            memory_size: 256 << 20,
            backing: Backing::Hugetlb2M,
            thp: false,
            prefault: true,
            cpuid_masks: vec!["popcnt".parse().unwrap()],
            track_dirty_pages: true,
        };
        let saved = SavedMachineConfig::from_config(&config);
        let back = saved.to_config(Path::new("/x")).unwrap();
        assert_eq!(back.vcpus, 2);
        assert_eq!(back.backing, Backing::Hugetlb2M);
        assert_eq!(back.cpuid_masks, config.cpuid_masks);
        assert!(back.track_dirty_pages);
        let mut bad = saved.clone();
        bad.backing = "tape".into();
        assert!(bad.to_config(Path::new("/x")).is_err());
    }
}
