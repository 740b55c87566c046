//! Firecracker's snapshot layout over gpuvm's snapshot directory: a state FILE
//! (`snapshot_path`) and a memory FILE (`mem_file_path`). gpuvm still writes its
//! directory (a hidden sibling of the state file, `.<name>.gpuvm`, which also holds the
//! chain Diff snapshots extend), then hard-links (or, across file systems, copies) its
//! `state` and newest memory file to the two paths. A load stages the two files back into
//! a directory (`.<name>.gpuvm-load.<pid>`, hard links where possible) under the name the
//! state gives its memory file. The memory file stays in gpuvm's indexed format.

use std::path::{Path, PathBuf};

use super::{MachineState, SnapshotReport, STATE_FILE};

fn sibling(file: &Path, suffix: &str) -> Result<PathBuf, String> {
    let name = file
        .file_name()
        .ok_or_else(|| format!("{} names no file", file.display()))?;
    let parent = file.parent().unwrap_or(Path::new("/"));
    Ok(parent.join(format!(".{}{suffix}", name.to_string_lossy())))
}

/// The directory gpuvm writes a snapshot whose state file is `state_file` into.
pub fn directory_for(state_file: &Path) -> Result<PathBuf, String> {
    sibling(state_file, ".gpuvm")
}

/// `dst` becomes `src`'s contents: a hard link, else a copy. What was at `dst` goes.
fn link_or_copy(src: &Path, dst: &Path) -> Result<(), String> {
    if let Ok(meta) = std::fs::symlink_metadata(dst) {
        if meta.is_dir() {
            return Err(format!("{} is a directory, not a file", dst.display()));
        }
        std::fs::remove_file(dst).map_err(|e| format!("cannot replace {}: {e}", dst.display()))?;
    }
    if std::fs::hard_link(src, dst).is_ok() {
        return Ok(());
    }
    copy(src, dst).map_err(|e| format!("cannot write {}: {e}", dst.display()))
}

/// A plain pread/pwrite copy (the VMM thread's seccomp filter has no copy_file_range or
/// sendfile), keeping holes where whole blocks are zero.
fn copy(src: &Path, dst: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let from = std::fs::File::open(src)?;
    let to = std::fs::File::create(dst)?;
    let len = from.metadata()?.len();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    while offset < len {
        let n = from.read_at(&mut buf, offset)?;
        if n == 0 {
            break;
        }
        if buf[..n].iter().any(|&b| b != 0) {
            to.write_all_at(&buf[..n], offset)?;
        }
        offset += n as u64;
    }
    to.set_len(len)
}

/// After a snapshot into `report.dir`: its state to `state_file`, its newest memory file
/// to `mem_file`.
pub fn export(report: &SnapshotReport, state_file: &Path, mem_file: &Path) -> Result<(), String> {
    link_or_copy(&report.dir.join(STATE_FILE), state_file)?;
    link_or_copy(&report.dir.join(&report.memory_file), mem_file)
}

/// Before a load: a directory holding `state_file` as its state and `mem_file` as the
/// one memory file that state names.
pub fn stage(state_file: &Path, mem_file: &Path) -> Result<PathBuf, String> {
    let state: MachineState = crate::persist::read_state_file(state_file)
        .map_err(|e| format!("cannot read {}: {e}", state_file.display()))?;
    let [memory_name] = state.memory_files.as_slice() else {
        return Err(format!(
            "{} names {} memory files (a Diff snapshot's chain): gpuvm loads Firecracker's two-file layout only from Full snapshots",
            state_file.display(),
            state.memory_files.len()
        ));
    };
    if memory_name.contains('/') || memory_name.contains("..") {
        return Err(format!("{} names a bad memory file", state_file.display()));
    }
    let dir = sibling(state_file, &format!(".gpuvm-load.{}", std::process::id()))?;
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        // A stale one from an earlier process with this pid: its two files are replaced.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    link_or_copy(state_file, &dir.join(STATE_FILE))?;
    link_or_copy(mem_file, &dir.join(memory_name))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_siblings() {
        assert_eq!(
            directory_for(Path::new("/srv/vm/snap.state")).unwrap(),
            PathBuf::from("/srv/vm/.snap.state.gpuvm")
        );
        assert!(directory_for(Path::new("/")).is_err());
    }
}
