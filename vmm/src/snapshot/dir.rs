//! The snapshot directory: its lock, the names of memory files, writing a memory file,
//! committing a state, and removing what the committed state no longer names.

use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use gpuvm_memory::snapshot::{
    flock, is_gpuvm_file, remove_abandoned_temp_file, remove_logged, temp_file_target, RamMappings,
    WriteOptions, WriteStats, FRAMED_FILE_MAGIC, MEMORY_FILE_MAGIC, RAW_CRCS_MAGIC,
};

use super::{MachineState, MemoryChain, SnapshotError, MEMORY_FILE_PREFIX, STATE_FILE};
use crate::hotplug::migration::is_device_file_name;

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
    fresh_file_name(dir, MEMORY_FILE_PREFIX)
}

/// `prefix` and a stamp (the time in ns, bumped on collision) not used in `dir` yet.
pub(crate) fn fresh_file_name(dir: &Path, prefix: &str) -> String {
    let mut stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    loop {
        let name = format!("{prefix}{stamp}");
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

/// The memory file whose raw image's page CRC table `name` is (`<memory file>.raw-crcs`).
fn raw_crcs_memory_file(name: &[u8]) -> Option<&[u8]> {
    name.strip_suffix(super::files::RAW_CRCS_SUFFIX.as_bytes())
        .filter(|memory| is_memory_file_name(memory))
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

/// As [`write_memory`] for a full memory file written while the guest runs, from RAM
/// write-protected at the snapshot instant (see `WriteProtectedRam`).
pub(crate) fn write_memory_background(
    dir: &Path,
    mappings: &RamMappings<'_>,
    protected: gpuvm_memory::snapshot::WriteProtectedRam,
) -> Result<(String, WriteStats, Vec<String>), SnapshotError> {
    let name = fresh_memory_file(dir);
    let (stats, background) =
        protected.write_full(&dir.join(&name), mappings, &WriteOptions::default())?;
    log::debug!(
        "memory file {name} written in the background: scan {:?}, write {:?}, guest pages \
         copied aside {} KiB at most",
        stats.scan_time,
        stats.write_time,
        background.copies_peak_bytes >> 10
    );
    Ok((name.clone(), stats, vec![name]))
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
    let mut keep = state.memory_files.clone();
    keep.extend(
        state
            .devices
            .migrated_gpus
            .iter()
            .map(|gpu| gpu.state_file.clone()),
    );
    remove_unreferenced(dir, &keep);
    crate::working_set::remove(dir);
    Ok(())
}

/// Removes, in `dir`, memory and device-state files that `keep` does not name (after a
/// state commit) and
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
        let kept = keep.iter().any(|k| k.as_bytes() == name);
        if is_memory_file_name(name) {
            if !kept && is_gpuvm_file(&path, MEMORY_FILE_MAGIC) {
                remove_logged(&path, "old memory file");
            }
        } else if let Some(memory) = raw_crcs_memory_file(name) {
            // A raw image's page CRC table goes with its memory file.
            let memory_kept = keep.iter().any(|k| k.as_bytes() == memory);
            if !memory_kept && is_gpuvm_file(&path, RAW_CRCS_MAGIC) {
                remove_logged(&path, "old page CRC table");
            }
        } else if is_device_file_name(name) {
            if !kept && is_gpuvm_file(&path, FRAMED_FILE_MAGIC) {
                remove_logged(&path, "old device state file");
            }
        } else if let Some(target) = temp_file_target(name) {
            let ours = is_memory_file_name(target)
                || raw_crcs_memory_file(target).is_some()
                || is_device_file_name(target)
                || target == STATE_FILE.as_bytes()
                || target == crate::working_set::FILE.as_bytes();
            if ours {
                remove_abandoned_temp_file(&path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
        write("memory-1.raw-crcs", RAW_CRCS_MAGIC);
        write("memory-2.raw-crcs", RAW_CRCS_MAGIC);
        write(".memory-1.raw-crcs.tmp.1.0", RAW_CRCS_MAGIC);
        let users = [
            ("memory-notes.txt", &b"notes"[..]),
            ("memory-4", b"user data"),
            ("memory-", b"GPUVMMEM"),
            (".memory-notes.tmp.1.0", b"GPUVMMEM"),
            (".state.tmp.1.1", b"user data"),
            ("notes.txt", b"GPUVMMEM"),
            ("memory-5.raw-crcs", b"user data"),
            ("notes.raw-crcs", b"GPUVMRCT"),
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
        expected.push("memory-2.raw-crcs".into());
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
