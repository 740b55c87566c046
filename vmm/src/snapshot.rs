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

use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuvm_arch::x86_64::cpuid::CpuidMask;
use gpuvm_memory::snapshot::{
    flock, is_gpuvm_file, remove_abandoned_temp_file, remove_logged, temp_file_target, RamLayout,
    RamMappings, SnapshotChain, SnapshotInfo, WriteOptions, WriteStats, FRAMED_FILE_MAGIC,
    MEMORY_FILE_MAGIC,
};
use gpuvm_memory::Backing;
use serde::{Deserialize, Serialize};

use crate::config::MachineConfig;
use crate::devices::DeviceStates;
use crate::persist::PersistError;
use crate::vcpu::VcpuState;
use crate::vm_state::VmState;

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

/// Creates the snapshot directory `dir` if it is not there: only its last component (a
/// mistyped parent is an error, not a new tree).
pub(crate) fn create_dir(dir: &Path) -> Result<(), SnapshotError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(SnapshotError::NoParentDir {
            path: dir.to_path_buf(),
        }),
        Err(source) => Err(SnapshotError::CreateDir {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// A lock on a snapshot directory: exclusive while a snapshot or a working set is
/// written into it, shared while a restore reads it. `flock(2)` on the directory itself:
/// nothing is added to the directory, and the lock ends with its process however that
/// ends. Taken without waiting: a directory in use is an error at once.
#[derive(Debug)]
pub struct SnapshotDirLock {
    dir: File,
}

impl SnapshotDirLock {
    /// For writing into `dir`, which must exist.
    pub fn exclusive(dir: &Path) -> Result<SnapshotDirLock, SnapshotError> {
        Self::take(dir, libc::LOCK_EX)
    }

    /// For reading the snapshot in `dir`.
    pub fn shared(dir: &Path) -> Result<SnapshotDirLock, SnapshotError> {
        Self::take(dir, libc::LOCK_SH)
    }

    fn take(path: &Path, operation: libc::c_int) -> Result<SnapshotDirLock, SnapshotError> {
        let lock_error = |source| SnapshotError::Lock {
            path: path.to_path_buf(),
            source,
        };
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| match source.raw_os_error() {
                Some(libc::ENOENT | libc::ENOTDIR) => SnapshotError::Invalid {
                    dir: path.to_path_buf(),
                    reason: "no such snapshot directory".into(),
                },
                _ => lock_error(source),
            })?;
        match flock(&dir, operation | libc::LOCK_NB) {
            Ok(()) => Ok(SnapshotDirLock { dir }),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let path = path.to_path_buf();
                Err(if operation == libc::LOCK_SH {
                    SnapshotError::DirBeingWritten { path }
                } else {
                    SnapshotError::DirInUse { path }
                })
            }
            Err(source) => Err(lock_error(source)),
        }
    }

    /// Whether `other` is the directory this lock is on.
    pub fn is_for(&self, other: &Path) -> bool {
        match (self.dir.metadata(), std::fs::metadata(other)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
}

/// Readies `dir` for a snapshot, before anything is written or paused: creates it (its
/// last component), locks it, and refuses it if its `state` is not a gpuvm state file
/// (the commit would replace it).
pub(crate) fn prepare_dir(dir: &Path) -> Result<SnapshotDirLock, SnapshotError> {
    create_dir(dir)?;
    let lock = SnapshotDirLock::exclusive(dir)?;
    check_replaceable(dir, STATE_FILE)?;
    Ok(lock)
}

/// Refuses `dir/name` if something is there that gpuvm did not write (a framed file).
pub(crate) fn check_replaceable(dir: &Path, name: &'static str) -> Result<(), SnapshotError> {
    let path = dir.join(name);
    if std::fs::symlink_metadata(&path).is_err() || is_gpuvm_file(&path, FRAMED_FILE_MAGIC) {
        Ok(())
    } else {
        Err(SnapshotError::NotGpuvmFile {
            dir: dir.to_path_buf(),
            name,
        })
    }
}

/// A memory-file name not used in `dir` yet (the time in ns, bumped on collision).
pub(crate) fn fresh_memory_file(dir: &Path) -> String {
    let mut stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    loop {
        let name = format!("{MEMORY_FILE_PREFIX}{stamp}");
        // Not even a dangling link: the new file must not replace anything.
        if std::fs::symlink_metadata(dir.join(&name)).is_err() {
            return name;
        }
        stamp += 1;
    }
}

/// Whether `name` is one gpuvm gives memory files: `memory-` and a decimal stamp.
fn is_memory_file_name(name: &[u8]) -> bool {
    name.strip_prefix(MEMORY_FILE_PREFIX.as_bytes())
        .is_some_and(|stamp| !stamp.is_empty() && stamp.iter().all(u8::is_ascii_digit))
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

/// Writes the state file that commits a snapshot whose new memory file `new_memory_file`
/// is written, then removes what it no longer needs (see [`remove_unreferenced`]) and the
/// working set of the snapshot it replaced. If the state cannot be written, the new
/// memory file is removed: the previous snapshot stays as it was, with nothing added.
pub(crate) fn commit(
    dir: &Path,
    state: &MachineState,
    new_memory_file: &str,
) -> Result<(), SnapshotError> {
    if let Err(error) = crate::persist::write_state_file(&dir.join(STATE_FILE), state) {
        remove_logged(
            &dir.join(new_memory_file),
            "memory file of a failed snapshot",
        );
        return Err(error.into());
    }
    remove_unreferenced(dir, &state.memory_files);
    crate::working_set::remove(dir);
    Ok(())
}

/// Removes, in `dir`, memory files that `keep` does not name (after a state commit) and
/// temporary files left by snapshots killed while writing: only files gpuvm wrote (its
/// names and its magic), never anything else.
pub(crate) fn remove_unreferenced(dir: &Path, keep: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let name = file_name.as_bytes();
        let path = entry.path();
        if is_memory_file_name(name) {
            if !keep.iter().any(|k| k.as_bytes() == name) && is_gpuvm_file(&path, MEMORY_FILE_MAGIC)
            {
                remove_logged(&path, "old memory file");
            }
        } else if let Some(target) = temp_file_target(name) {
            let ours = is_memory_file_name(target)
                || target == STATE_FILE.as_bytes()
                || target == crate::working_set::FILE.as_bytes();
            if ours {
                remove_abandoned_temp_file(&path);
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

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuvm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn fresh_names_do_not_collide() {
        let dir = temp_dir("names");
        let first = fresh_memory_file(&dir);
        std::fs::write(dir.join(&first), MEMORY_FILE_MAGIC).unwrap();
        let second = fresh_memory_file(&dir);
        assert_ne!(first, second);
        std::fs::write(dir.join(&second), MEMORY_FILE_MAGIC).unwrap();
        remove_unreferenced(&dir, std::slice::from_ref(&second));
        assert!(!dir.join(&first).exists());
        assert!(dir.join(&second).exists());
        std::fs::remove_dir_all(dir).ok();
    }

    /// Only what gpuvm wrote goes: its memory files and its abandoned temp files; a user's
    /// files stay, whatever their names.
    #[test]
    fn cleanup_removes_only_gpuvm_files() {
        let dir = temp_dir("cleanup");
        let write = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).unwrap();
        write("memory-1", MEMORY_FILE_MAGIC);
        write("memory-2", MEMORY_FILE_MAGIC);
        write(".memory-3.tmp.1.0", MEMORY_FILE_MAGIC);
        write(".state.tmp.1.0", b"");
        write(".working-set.tmp.1.0", FRAMED_FILE_MAGIC);
        let users = [
            ("memory-notes.txt", &b"notes"[..]),
            ("memory-4", b"user data"),
            ("memory-", b"GPUVMMEM"),
            (".memory-notes.tmp.1.0", b"GPUVMMEM"),
            (".state.tmp.1.1", b"user data"),
            ("notes.txt", b"GPUVMMEM"),
        ];
        for (name, bytes) in users {
            write(name, bytes);
        }
        remove_unreferenced(&dir, &["memory-2".to_string()]);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut expected: Vec<String> = users.iter().map(|(n, _)| n.to_string()).collect();
        expected.push("memory-2".into());
        expected.sort();
        assert_eq!(left, expected);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn only_the_last_component_is_created() {
        let dir = temp_dir("create");
        let nested = dir.join("missing").join("snap");
        let error = create_dir(&nested).unwrap_err();
        assert!(
            matches!(error, SnapshotError::NoParentDir { .. }),
            "{error}"
        );
        assert!(!dir.join("missing").exists());
        create_dir(&dir.join("snap")).unwrap();
        create_dir(&dir.join("snap")).unwrap();
        std::fs::write(dir.join("file"), b"x").unwrap();
        assert!(create_dir(&dir.join("file")).is_err());
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_locked_directory_is_refused() {
        let dir = temp_dir("lock");
        let writer = SnapshotDirLock::exclusive(&dir).unwrap();
        assert!(writer.is_for(&dir));
        assert!(matches!(
            SnapshotDirLock::exclusive(&dir),
            Err(SnapshotError::DirInUse { .. })
        ));
        assert!(matches!(
            SnapshotDirLock::shared(&dir),
            Err(SnapshotError::DirBeingWritten { .. })
        ));
        drop(writer);
        let reader = SnapshotDirLock::shared(&dir).unwrap();
        let _second_reader = SnapshotDirLock::shared(&dir).unwrap();
        assert!(SnapshotDirLock::exclusive(&dir).is_err());
        drop(reader);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_state_gpuvm_did_not_write_is_refused() {
        let dir = temp_dir("foreign-state");
        check_replaceable(&dir, STATE_FILE).unwrap();
        std::fs::write(dir.join(STATE_FILE), b"my own notes").unwrap();
        let error = prepare_dir(&dir).unwrap_err();
        assert!(
            matches!(error, SnapshotError::NotGpuvmFile { .. }),
            "{error}"
        );
        std::fs::remove_file(dir.join(STATE_FILE)).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join(STATE_FILE)).unwrap();
        assert!(prepare_dir(&dir).is_err());
        std::fs::remove_dir_all(dir).ok();
    }
}
