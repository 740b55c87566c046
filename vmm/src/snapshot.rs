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
//! snapshot killed at any point leaves the previous `state` and every file it names.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuvm_devices::SerialState;
use gpuvm_memory::snapshot::{
    RamLayout, RamMappings, SnapshotChain, SnapshotInfo, WriteOptions, WriteStats,
};
use gpuvm_memory::Backing;
use serde::{Deserialize, Serialize};

use crate::config::MachineConfig;
use crate::persist::{PersistError, VcpuState, VmState};
use crate::x86_64::cpuid::CpuidMask;

pub const STATE_FILE: &str = "state";
const MEMORY_FILE_PREFIX: &str = "memory-";

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot create snapshot directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
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
        "cannot snapshot a VM with passthrough devices ({}): their state lives in the device \
         and cannot be saved or restored",
        devices.join(", ")
    )]
    Passthrough { devices: Vec<String> },
    #[error("KVM failed to {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
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

/// Serde mirror of vm-superio's `SerialState` (its fields are public; the crate has no
/// serde support of its own).
#[derive(Serialize, Deserialize)]
#[serde(remote = "SerialState")]
struct SerialStateDef {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

/// Everything in a snapshot's state file.
#[derive(Serialize, Deserialize)]
pub struct MachineState {
    pub config: SavedMachineConfig,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    #[serde(with = "SerialStateDef")]
    pub serial: SerialState,
    /// Memory files in this directory, base first, then diffs in order.
    pub memory_files: Vec<String>,
    /// The id (from its header) of the newest of `memory_files`, binding them to this
    /// state: a restore refuses the chain unless its newest file has this id, and each
    /// diff names its base by id, so every file is bound. `None` in states written
    /// before ids were recorded: they load with a warning, their files unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_file_id: Option<String>,
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

pub(crate) fn create_dir(dir: &Path) -> Result<(), SnapshotError> {
    std::fs::create_dir_all(dir).map_err(|source| SnapshotError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })
}

/// A memory-file name not used in `dir` yet (the time in ns, bumped on collision).
pub(crate) fn fresh_memory_file(dir: &Path) -> String {
    let mut stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    loop {
        let name = format!("{MEMORY_FILE_PREFIX}{stamp}");
        if !dir.join(&name).exists() {
            return name;
        }
        stamp += 1;
    }
}

/// Writes the memory file for a snapshot: a diff against `chain` when `dirty` bitmaps
/// are given and the chain is in `dir`, a full file otherwise.
pub(crate) fn write_memory(
    dir: &Path,
    mappings: &RamMappings<'_>,
    chain: Option<&MemoryChain>,
    dirty: Option<&[Vec<u64>]>,
) -> Result<(String, WriteStats, Vec<String>), SnapshotError> {
    let name = fresh_memory_file(dir);
    let path = dir.join(&name);
    let options = WriteOptions::default();
    match (chain.filter(|c| c.dir == dir), dirty) {
        (Some(chain), Some(dirty)) => {
            let slices: Vec<&[u64]> = dirty.iter().map(|d| d.as_slice()).collect();
            let stats = gpuvm_memory::snapshot::write_diff(
                &path,
                mappings,
                &slices,
                &chain.last,
                &options,
            )?;
            let mut files = chain.files.clone();
            files.push(name.clone());
            Ok((name, stats, files))
        }
        _ => {
            let stats = gpuvm_memory::snapshot::write_full(&path, mappings, &options)?;
            Ok((name.clone(), stats, vec![name]))
        }
    }
}

/// Removes memory files in `dir` that `keep` does not name (after a state commit), and
/// temporary files left by snapshots killed while writing.
pub(crate) fn remove_unreferenced(dir: &Path, keep: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale_memory = name.starts_with(MEMORY_FILE_PREFIX) && !keep.contains(&name);
        // Temporary files of writers killed mid-snapshot (`.memory-N.tmp...`, `.state.tmp...`).
        let stale_temporary = (name.starts_with(&format!(".{MEMORY_FILE_PREFIX}"))
            || name.starts_with(&format!(".{STATE_FILE}.")))
            && name.contains(".tmp");
        if stale_memory || stale_temporary {
            if let Err(error) = std::fs::remove_file(entry.path()) {
                log::warn!(
                    "cannot remove old memory file {}: {error}",
                    entry.path().display()
                );
            }
        }
    }
}

/// A snapshot read and validated before anything touches KVM.
pub struct LoadedSnapshot {
    pub dir: PathBuf,
    pub state: MachineState,
    pub config: MachineConfig,
    pub chain: Arc<SnapshotChain>,
}

/// Reads `dir/state`, checks its configuration, and opens and validates the memory
/// chain against the guest layout that configuration implies.
pub fn load(
    dir: &Path,
    regions: impl Fn(u64) -> Vec<gpuvm_memory::RamRegion>,
) -> Result<LoadedSnapshot, SnapshotError> {
    load_state(dir, regions)?.open_chain()
}

/// A snapshot's state file, read and checked, with the memory chain still to open.
pub struct LoadedState {
    pub dir: PathBuf,
    pub state: MachineState,
    pub config: MachineConfig,
    chain: ChainInputs,
}

/// What opening a snapshot's memory chain takes: its files, base first, and the guest
/// RAM layout they must match. Cheap to clone, to validate on another thread.
#[derive(Debug, Clone)]
pub struct ChainInputs {
    paths: Vec<PathBuf>,
    layout: RamLayout,
    /// The newest file's id as the state records it (see [`MachineState::memory_file_id`]).
    head_id: Option<String>,
}

impl ChainInputs {
    /// Opens and validates the chain (headers, index CRCs, lengths, chain ids, layout),
    /// and checks that it is the one the state was written with.
    pub fn validate(&self) -> Result<SnapshotChain, SnapshotError> {
        let chain = SnapshotChain::open(&self.paths, &self.layout)?;
        if let Some(expected) = &self.head_id {
            let found = chain.head().id.to_string();
            if found != *expected {
                return Err(SnapshotError::ForeignMemoryFile {
                    path: chain.layers()[chain.layers().len() - 1]
                        .path()
                        .to_path_buf(),
                    expected: expected.clone(),
                    found,
                });
            }
        }
        Ok(chain)
    }
}

impl LoadedState {
    /// Opens and validates the memory chain the state names (headers, index CRCs,
    /// lengths, chain ids, layout).
    pub fn open_chain(self) -> Result<LoadedSnapshot, SnapshotError> {
        let chain = self.validate_chain()?;
        Ok(self.with_chain(chain))
    }

    /// The chain validation alone (for running it on another thread).
    pub fn validate_chain(&self) -> Result<SnapshotChain, SnapshotError> {
        self.chain.validate()
    }

    /// What [`LoadedState::validate_chain`] works on, to validate on another thread
    /// without sharing the state.
    pub fn chain_inputs(&self) -> ChainInputs {
        self.chain.clone()
    }

    /// Joins the state with its validated chain.
    pub fn with_chain(self, chain: SnapshotChain) -> LoadedSnapshot {
        LoadedSnapshot {
            dir: self.dir,
            state: self.state,
            config: self.config,
            chain: Arc::new(chain),
        }
    }
}

/// Reads and checks `dir/state` and its configuration (the first half of [`load`]).
pub fn load_state(
    dir: &Path,
    regions: impl Fn(u64) -> Vec<gpuvm_memory::RamRegion>,
) -> Result<LoadedState, SnapshotError> {
    let invalid = |reason: String| SnapshotError::Invalid {
        dir: dir.to_path_buf(),
        reason,
    };
    if !dir.is_dir() {
        return Err(invalid("no such snapshot directory".into()));
    }
    let state: MachineState = crate::persist::read_state_file(&dir.join(STATE_FILE))?;
    let config = state.config.to_config(dir)?;
    if state.vcpus.len() != usize::from(config.vcpus) || config.vcpus == 0 {
        return Err(invalid(format!(
            "state has {} vCPU states for {} configured vCPUs",
            state.vcpus.len(),
            config.vcpus
        )));
    }
    if state
        .vcpus
        .iter()
        .enumerate()
        .any(|(i, v)| usize::from(v.id) != i)
    {
        return Err(invalid("vCPU states are not in id order".into()));
    }
    if state.memory_files.is_empty() {
        return Err(invalid("the state names no memory file".into()));
    }
    if state
        .memory_files
        .iter()
        .any(|f| !f.starts_with(MEMORY_FILE_PREFIX) || f.contains('/') || f.contains(".."))
    {
        return Err(invalid(
            "the state names a memory file outside the snapshot directory".into(),
        ));
    }
    if state.memory_file_id.is_none() {
        log::warn!(
            "{}: the state file records no memory-file id (written by an older gpuvm), so its \
             memory files cannot be checked to be this snapshot's",
            dir.join(STATE_FILE).display()
        );
    }
    let layout = RamLayout::new(config.backing.page_size(), regions(config.memory_size))?;
    let paths: Vec<PathBuf> = state.memory_files.iter().map(|f| dir.join(f)).collect();
    let head_id = state.memory_file_id.clone();
    Ok(LoadedState {
        dir: dir.to_path_buf(),
        state,
        config,
        chain: ChainInputs {
            paths,
            layout,
            head_id,
        },
    })
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

    #[test]
    fn fresh_names_do_not_collide() {
        let dir = std::env::temp_dir().join(format!("gpuvm-names-{}", std::process::id()));
        create_dir(&dir).unwrap();
        let first = fresh_memory_file(&dir);
        std::fs::write(dir.join(&first), b"x").unwrap();
        let second = fresh_memory_file(&dir);
        assert_ne!(first, second);
        std::fs::write(dir.join(&second), b"y").unwrap();
        remove_unreferenced(&dir, std::slice::from_ref(&second));
        assert!(!dir.join(&first).exists());
        assert!(dir.join(&second).exists());
        std::fs::remove_dir_all(dir).ok();
    }
}
