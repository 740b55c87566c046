//! A snapshot's working set: the guest memory a lazy restore of it should load first.
//!
//! A snapshot restored many times (a golden image cloned onto many hosts, a function
//! started from the same snapshot again and again) resumes the same guest at the same
//! point each time, so the guest touches the same memory first each time. A lazy restore
//! started with `--record-working-set` writes down which memory that was: the 2 MiB blocks
//! its guest faulted on, in the order of the first fault, into `working-set` beside the
//! snapshot's `state`. Later lazy restores of that snapshot load these blocks before the
//! vCPUs would fault on them (the background loader starts on them while the restore is
//! still setting up) and only then sweep the rest.
//!
//! The file is advice, never part of the snapshot: it names the memory file it was
//! recorded for (the newest of the chain, by its random id), so a snapshot written into
//! the same directory later makes it stale; a missing, stale or unreadable file is ignored
//! with a warning, and a new snapshot into the directory removes it.
//!
//! It is written under the directory's exclusive lock (see
//! [`crate::snapshot::SnapshotDirLock`]): not while a snapshot is being written there, and
//! never over a `working-set` that gpuvm did not write.

use std::path::Path;

use gpuvm_memory::snapshot::{is_gpuvm_file, remove_logged, SnapshotId, FRAMED_FILE_MAGIC};
use serde::{Deserialize, Serialize};

use crate::persist;
use crate::snapshot::{check_replaceable, SnapshotDirLock, SnapshotError};

/// The file's name in a snapshot directory.
pub const FILE: &str = "working-set";
/// Granularity: fine enough to keep touched memory apart from untouched, coarse enough
/// that the list stays short (at most 4096 entries for 8 GiB of guest RAM); it is read
/// while the restore runs.
pub const BLOCK: u64 = 2 << 20;
/// At most this many blocks are kept (256 GiB of guest RAM).
pub const MAX_BLOCKS: usize = 1 << 17;

/// What `working-set` holds (framed like the state file: magic, version, length, CRC).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct WorkingSetFile {
    /// Hex id of the newest memory file of the chain it was recorded for.
    memory_file_id: String,
    /// Bytes per block (always [`BLOCK`]; stored so another size is refused, not misread).
    block_size: u64,
    /// Guest-physical addresses of blocks, in the order the guest first needed them.
    blocks: Vec<u64>,
}

/// The blocks of `faults` (guest-physical addresses in the order a guest faulted on
/// them), each once, in first-fault order, at most [`MAX_BLOCKS`].
pub fn blocks_of(faults: &[u64]) -> Vec<u64> {
    let mut seen = std::collections::HashSet::new();
    faults
        .iter()
        .map(|gpa| gpa & !(BLOCK - 1))
        .filter(|block| seen.insert(*block))
        .take(MAX_BLOCKS)
        .collect()
}

/// Writes `blocks` as the working set of the snapshot in `dir` whose newest memory file is
/// `memory_file`; atomically, so a reader sees the old file or the new one. Refused while
/// another process holds the directory (a snapshot being written there would replace
/// the snapshot this describes) and over a `working-set` gpuvm did not write.
pub fn write(dir: &Path, memory_file: &SnapshotId, blocks: &[u64]) -> Result<(), SnapshotError> {
    let _writing = SnapshotDirLock::exclusive(dir)?;
    check_replaceable(dir, FILE)?;
    let file = WorkingSetFile {
        memory_file_id: memory_file.to_string(),
        block_size: BLOCK,
        blocks: blocks.iter().take(MAX_BLOCKS).copied().collect(),
    };
    Ok(persist::write_state_file(&dir.join(FILE), &file)?)
}

/// The working set recorded for the snapshot in `dir` whose newest memory file is
/// `memory_file`: empty when there is none, or when it is unreadable or was recorded for
/// another snapshot (then with a warning: a restore never fails over advice).
pub fn read(dir: &Path, memory_file: &SnapshotId) -> Vec<u64> {
    let path = dir.join(FILE);
    if !path.exists() {
        return Vec::new();
    }
    let file: WorkingSetFile = match persist::read_state_file_in_dir(dir, FILE) {
        Ok(file) => file,
        Err(error) => {
            log::warn!("ignoring the working set: {error}");
            return Vec::new();
        }
    };
    let wanted = memory_file.to_string();
    if file.memory_file_id != wanted {
        log::warn!(
            "ignoring the working set in {}: it was recorded for memory file {}, the snapshot's is {wanted}",
            path.display(),
            file.memory_file_id
        );
        return Vec::new();
    }
    if file.block_size != BLOCK || file.blocks.len() > MAX_BLOCKS {
        log::warn!(
            "ignoring the working set in {}: {} blocks of {} bytes (expected at most {MAX_BLOCKS} of {BLOCK})",
            path.display(),
            file.blocks.len(),
            file.block_size
        );
        return Vec::new();
    }
    file.blocks
}

/// Removes `dir`'s working set (a new snapshot was committed there: it describes the old
/// one), if gpuvm wrote it. A file that is not there is fine. The caller holds the
/// directory's lock.
pub fn remove(dir: &Path) {
    let path = dir.join(FILE);
    if is_gpuvm_file(&path, FRAMED_FILE_MAGIC) {
        remove_logged(&path, "old working set");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuvm-ws-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn blocks_keep_first_fault_order_once_each() {
        let faults = [
            5 * MIB,
            0x1234_5000,
            4 * MIB + 7,
            2 * MIB,
            0x1234_6000,
            4096,
        ];
        assert_eq!(blocks_of(&faults), vec![4 * MIB, 0x1220_0000, 2 * MIB, 0]);
        assert!(blocks_of(&[]).is_empty());
        let many: Vec<u64> = (0..(MAX_BLOCKS as u64 + 5)).map(|i| i * BLOCK).collect();
        assert_eq!(blocks_of(&many).len(), MAX_BLOCKS);
    }

    #[test]
    fn round_trips_for_its_own_snapshot_only() {
        let dir = temp_dir("roundtrip");
        let id = SnapshotId([7; 16]);
        assert!(read(&dir, &id).is_empty(), "no file yet");
        let blocks = vec![6 * MIB, 0, 2 * MIB];
        write(&dir, &id, &blocks).unwrap();
        assert_eq!(read(&dir, &id), blocks);
        // Recorded for another memory file: stale.
        assert!(read(&dir, &SnapshotId([8; 16])).is_empty());
        remove(&dir);
        assert!(!dir.join(FILE).exists());
        remove(&dir); // twice is fine
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Not written while another process holds the directory (here: this test, with
    /// flock(2) as a snapshot writer takes it), nor over a file gpuvm did not write; and
    /// such a file is not removed either.
    #[test]
    fn written_only_under_the_lock_and_never_over_a_user_file() {
        use std::os::unix::io::AsRawFd;
        let dir = temp_dir("locked");
        let id = SnapshotId([3; 16]);
        let holder = std::fs::File::open(&dir).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(
            unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        assert!(
            write(&dir, &id, &[0]).is_err(),
            "written under another's lock"
        );
        assert!(!dir.join(FILE).exists());
        drop(holder);
        std::fs::write(dir.join(FILE), b"user notes").unwrap();
        assert!(write(&dir, &id, &[0]).is_err(), "replaced a user's file");
        remove(&dir);
        assert_eq!(std::fs::read(dir.join(FILE)).unwrap(), b"user notes");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_file_is_ignored() {
        let dir = temp_dir("damaged");
        let id = SnapshotId([9; 16]);
        write(&dir, &id, &[0, 2 * MIB]).unwrap();
        let path = dir.join(FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        assert!(read(&dir, &id).is_empty(), "CRC mismatch must be ignored");
        std::fs::write(&path, b"not a working set").unwrap();
        assert!(read(&dir, &id).is_empty());
        // Well framed, wrong block size.
        persist::write_state_file(
            &path,
            &WorkingSetFile {
                memory_file_id: id.to_string(),
                block_size: 4096,
                blocks: vec![0],
            },
        )
        .unwrap();
        assert!(read(&dir, &id).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
