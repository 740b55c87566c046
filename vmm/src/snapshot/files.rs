//! Firecracker's snapshot layout over gpuvm's snapshot directory: a state FILE
//! (`snapshot_path`) and a memory FILE (`mem_file_path`). gpuvm still writes its
//! directory (a hidden sibling of the state file, `.<name>.gpuvm`, which also holds the
//! chain Diff snapshots extend), then writes its `state` and its newest memory file, as a
//! raw image, to the two paths. A load stages the two files back into
//! a directory (`.<name>.gpuvm-load.<pid>`, hard links where possible) under the name the
//! state gives its memory file.
//!
//! The memory file is a raw guest-RAM image (Firecracker's layout, see
//! `gpuvm_memory::snapshot::write_raw`), converted from the directory's newest memory file
//! once the snapshot is committed (the guest already runs again), and the state file
//! records that (`raw_memory`, with its size), so a load reads it as raw and refuses one of
//! another size. A state without that mark (written by gpuvm before raw images) still
//! loads with its gpuvm-format memory file. A Diff's image holds only the dirty pages at
//! their flat offsets, holes elsewhere: the client merges it onto the base image, as with
//! Firecracker.
//!
//! Guest memory is kept on disk once: when the image and the state naming it are written,
//! the converted memory file's page data is freed (`MemoryFile::drop_page_data`: same
//! length, header, index and page CRCs kept, the data a hole). Nothing loads from it after
//! that: a load stages the image, its CRC table and the state; a later Diff's conversion
//! reads only the older files' indexes and stored CRCs (the CRC table of the merged image)
//! and the new Diff file's own data; a Diff is written against the chain's id, kept in
//! memory. Dropping the converted data was chosen over writing the image straight from guest
//! RAM (no gpuvm-format data at all) because it leaves the snapshot path, its crash promises
//! and the Diff chain as they are, at the cost of still writing memory twice (the indexed
//! file is written and fsynced, then converted): the disk space is halved, not the time.
//! A kill before the data is freed leaves it there (twice the space, nothing broken); a kill
//! while it is freed can leave the file short, which only the dead process's next Diff
//! would have read. The hidden directory is therefore no gpuvm snapshot of its own any more
//! (its pages would fail their checks): it loads only with the two files.
//!
//! The raw image has no room for checks, so gpuvm keeps its page CRC table
//! (`gpuvm_memory::snapshot::RawPageCrcs`: one CRC32 per page of guest RAM, for a Diff of
//! the merged image) in its directory, `<newest memory file>.raw-crcs`, and the state file
//! names it with its digest (`raw_memory.page_crcs`). A load stages the table with the two
//! files and checks every page against it as it loads (eager and lazy alike): a page gpuvm
//! wrote never loads changed without an error. A state naming a table that is not there
//! is refused (the table is part of the snapshot: copy the hidden directory with the two
//! files); a state naming none (written before gpuvm kept tables) loads unchecked, with a
//! warning.

use std::path::{Path, PathBuf};

use gpuvm_memory::snapshot::{
    is_plain_file_name, write_raw, MemoryFile, RawContent, SnapshotChain,
};

use super::{
    MachineState, RawMemory, RawPageCrcsRecord, SnapshotDirLock, SnapshotReport, STATE_FILE,
};

/// What the name of a raw image's page CRC table adds to its memory file's name.
pub(crate) const RAW_CRCS_SUFFIX: &str = ".raw-crcs";

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

/// After a snapshot into `report.dir`: its newest memory as a raw image at `mem_file`
/// (all of guest RAM for a Full snapshot, only the dirty pages for a Diff), and its state,
/// marked as having that raw memory, at `state_file`. Both are replaced atomically.
pub fn export(report: &SnapshotReport, state_file: &Path, mem_file: &Path) -> Result<(), String> {
    let mut state: MachineState = crate::persist::read_state_file(&report.dir.join(STATE_FILE))
        .map_err(|e| format!("cannot read the snapshot's state: {e}"))?;
    let paths: Vec<PathBuf> = state
        .memory_files
        .iter()
        .map(|name| report.dir.join(name))
        .collect();
    let chain = SnapshotChain::open_with_file_layout(&paths)
        .map_err(|e| format!("cannot read the snapshot's memory: {e}"))?;
    let content = if report.diff {
        RawContent::NewestOnly
    } else {
        RawContent::Full
    };
    if let Ok(meta) = std::fs::symlink_metadata(mem_file) {
        if meta.is_dir() {
            return Err(format!("{} is a directory, not a file", mem_file.display()));
        }
    }
    let written = write_raw(mem_file, &chain, content)
        .map_err(|e| format!("cannot write {}: {e}", mem_file.display()))?;
    log::info!(
        "raw memory image {}: {} bytes, {} pages with data",
        mem_file.display(),
        written.file_len,
        written.pages_written
    );
    let newest = state
        .memory_files
        .last()
        .ok_or("the snapshot's state names no memory file")?;
    let table_name = format!("{newest}{RAW_CRCS_SUFFIX}");
    written
        .page_crcs
        .write(&report.dir.join(&table_name))
        .map_err(|e| format!("cannot keep the memory image's page CRCs: {e}"))?;
    state.raw_memory = Some(RawMemory {
        size: chain.layout().ram_size(),
        diff: report.diff,
        page_crcs: Some(RawPageCrcsRecord {
            file: table_name,
            crc: written.page_crcs.digest(),
        }),
    });
    if let Ok(meta) = std::fs::symlink_metadata(state_file) {
        if meta.is_dir() {
            return Err(format!(
                "{} is a directory, not a file",
                state_file.display()
            ));
        }
    }
    crate::persist::write_state_file(state_file, &state)
        .map_err(|e| format!("cannot write {}: {e}", state_file.display()))?;
    if let Some(newest) = chain.layers().last() {
        drop_converted_data(&report.dir, newest);
    }
    Ok(())
}

/// Once the raw image and the state naming it are written: frees the data of the memory
/// file it was converted from, so that guest memory is kept on disk once (see the module
/// doc). Nothing depends on it succeeding: a failure leaves the data there, and says so.
fn drop_converted_data(dir: &Path, converted: &MemoryFile) {
    // Not while a gpuvm-format load of the directory itself reads it.
    let _lock = match SnapshotDirLock::exclusive(dir) {
        Ok(lock) => lock,
        Err(e) => {
            log::warn!(
                "{} keeps its page data (the disk holds guest memory twice): {e}",
                converted.path().display()
            );
            return;
        }
    };
    match converted.drop_page_data() {
        Ok(freed) => log::info!(
            "{}: {freed} bytes of page data freed (the raw image holds them)",
            converted.path().display()
        ),
        Err(e) => log::warn!(
            "{} keeps its page data (the disk holds guest memory twice): {e}",
            converted.path().display()
        ),
    }
}

/// Before a load: a directory holding `state_file` as its state and `mem_file` as the
/// memory file that state names (the newest one, for a raw image: after a Diff, the
/// client has merged the Diff's image onto its base's, as with Firecracker).
pub fn stage(state_file: &Path, mem_file: &Path) -> Result<PathBuf, String> {
    let state: MachineState = crate::persist::read_state_file(state_file)
        .map_err(|e| format!("cannot read {}: {e}", state_file.display()))?;
    let memory_name = match (&state.raw_memory, state.memory_files.as_slice()) {
        (_, [only]) => only,
        (Some(raw), [.., newest]) => {
            if raw.diff {
                log::info!(
                    "{} is a Diff snapshot's state: {} must be its memory merged onto the base's",
                    state_file.display(),
                    mem_file.display()
                );
            }
            newest
        }
        (_, files) => {
            return Err(format!(
                "{} names {} memory files (a Diff snapshot's chain in gpuvm's format): gpuvm loads Firecracker's two-file layout only from Full snapshots or raw images",
                state_file.display(),
                files.len()
            ))
        }
    };
    if !is_plain_file_name(memory_name) {
        return Err(format!("{} names a bad memory file", state_file.display()));
    }
    // The page CRC table gpuvm kept for the image, in its own directory beside the state.
    let table = match state.raw_memory.as_ref().and_then(|r| r.page_crcs.as_ref()) {
        Some(record) if !is_plain_file_name(&record.file) => {
            return Err(format!(
                "{} names a page CRC table outside its directory: {:?}",
                state_file.display(),
                record.file
            ))
        }
        Some(record) => {
            let path = directory_for(state_file)?.join(&record.file);
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.is_file() => Some((path, &record.file)),
                Ok(_) => {
                    return Err(format!(
                        "the page CRC table {} of {} is not a regular file",
                        path.display(),
                        mem_file.display()
                    ))
                }
                Err(e) => {
                    return Err(format!(
                        "the page CRC table {} that {} names is missing ({e}): without it the \
                         memory image {} cannot be checked. gpuvm writes it into the hidden \
                         directory beside the state file: keep that directory with the two files",
                        path.display(),
                        state_file.display(),
                        mem_file.display()
                    ))
                }
            }
        }
        None => None,
    };
    let dir = sibling(state_file, &format!(".gpuvm-load.{}", std::process::id()))?;
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        // A stale one from an earlier process with this pid: its two files are replaced.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    link_or_copy(state_file, &dir.join(STATE_FILE))?;
    link_or_copy(mem_file, &dir.join(memory_name))?;
    if let Some((path, name)) = table {
        link_or_copy(&path, &dir.join(name))?;
    }
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
