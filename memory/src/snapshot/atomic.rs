//! Crash-safe file replacement: write a temporary file next to the target, fsync it,
//! rename it over the target, fsync the directory.
//!
//! Also what tells gpuvm's own files from anyone else's in a directory it writes to: only
//! files gpuvm wrote (its naming and its magic) are ever removed or replaced.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use log::{debug, warn};

/// First bytes of a gpuvm memory file.
pub const MEMORY_FILE_MAGIC: &[u8; 8] = &super::format::MAGIC;
/// First bytes of gpuvm's framed files (a snapshot's `state`, a `working-set`); the VMM's
/// `persist::STATE_MAGIC` is this constant.
pub const FRAMED_FILE_MAGIC: &[u8; 8] = b"GPUVMSTA";
/// First bytes of a raw image's page CRC table file (raw.rs writes it).
pub const RAW_CRCS_MAGIC: &[u8; 8] = b"GPUVMRCT";

/// Distinguishes temp files of concurrent writes from one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Tries to create a temp file this many times when cleaners of other writes keep
/// removing it (see [`create_temp`]).
const TEMP_ATTEMPTS: usize = 8;

/// Writes `path` atomically: `write` fills a fresh temporary file in the same directory,
/// which is then fsynced, renamed over `path`, and the directory fsynced.
///
/// A crash (or `kill -9`) at any point leaves either the old file or the new one at
/// `path`, never a mix. The temporary file is locked (`flock`) while it is written, so that
/// temporary files left behind by writers that died (no lock: a lock ends with its
/// process) are recognised and removed by the next write to the same path, without asking
/// whether some process id still lives. If `write` fails the temporary file is removed and
/// `path` is untouched.
pub fn write_atomically<T, E>(
    path: &Path,
    write: impl FnOnce(&mut File) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<io::Error>,
{
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    remove_stale_temp_files(&dir, file_name.as_bytes());

    let (temp, mut file) = create_temp(&dir, file_name.as_bytes())?;
    let result = write(&mut file).and_then(|value| {
        file.sync_all()?;
        fs::rename(&temp, path)?;
        drop(file);
        sync_dir(&dir)?;
        Ok(value)
    });
    if result.is_err() {
        // The target is untouched; do not leave the partial file around.
        let _ = fs::remove_file(&temp);
    }
    result
}

/// Creates and locks a new temp file for `name` in `dir`.
fn create_temp(dir: &Path, name: &[u8]) -> io::Result<(PathBuf, File)> {
    for _ in 0..TEMP_ATTEMPTS {
        let temp = temp_path(dir, name);
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create_new(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&temp)?;
        flock(&file, libc::LOCK_EX)?;
        // Another process cleaning up may have found it empty and unlocked in the moment
        // between the create and the lock, and removed it: then take a new name.
        if is_same_file(&file, &temp) {
            return Ok((temp, file));
        }
    }
    Err(io::Error::other(format!(
        "cannot create a temporary file in {}: it was removed {TEMP_ATTEMPTS} times while being created",
        dir.display()
    )))
}

fn is_same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// `.<name>.tmp.<pid>.<n>`: hidden, and unique to this write.
fn temp_path(dir: &Path, name: &[u8]) -> PathBuf {
    let mut temp = OsString::from(".");
    temp.push(std::ffi::OsStr::from_bytes(name));
    temp.push(format!(
        ".tmp.{}.{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    dir.join(temp)
}

/// The name a temporary file of [`write_atomically`] stands in for: `Some(name)` when
/// `file_name` is exactly `.<name>.tmp.<digits>.<digits>`.
pub fn temp_file_target(file_name: &[u8]) -> Option<&[u8]> {
    let rest = file_name.strip_prefix(b".")?;
    let at = rest.windows(5).rposition(|w| w == b".tmp.")?;
    let (name, suffix) = (&rest[..at], &rest[at + 5..]);
    let mut numbers = suffix.split(|&b| b == b'.');
    let digits = |part: Option<&[u8]>| {
        part.is_some_and(|p| !p.is_empty() && p.iter().all(u8::is_ascii_digit))
    };
    let well_formed = digits(numbers.next()) && digits(numbers.next()) && numbers.next().is_none();
    (well_formed && !name.is_empty()).then_some(name)
}

/// Removes temp files for `name` in `dir` that their writers left behind.
fn remove_stale_temp_files(dir: &Path, name: &[u8]) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if temp_file_target(entry.file_name().as_bytes()) == Some(name) {
            remove_abandoned_temp_file(&entry.path());
        }
    }
}

/// Removes `path`, a file named like a temp file of [`write_atomically`], if its writer is
/// gone and gpuvm wrote it: a regular file that nobody holds locked, empty (its writer
/// died right after creating it) or starting with a gpuvm magic (what every writer puts
/// first). Returns whether it was removed; a failure is logged.
pub fn remove_abandoned_temp_file(path: &Path) -> bool {
    let Some(file) = open_no_follow(path) else {
        return false;
    };
    // Held while the file is removed; fails while a live writer holds its lock.
    if flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err() {
        debug!("temp file {} is being written; kept", path.display());
        return false;
    }
    let empty = file.metadata().is_ok_and(|m| m.len() == 0);
    let magics = [MEMORY_FILE_MAGIC, FRAMED_FILE_MAGIC, RAW_CRCS_MAGIC];
    if !empty && !starts_with_any(&file, &magics) {
        return false;
    }
    remove_logged(path, "stale temp file")
}

/// Whether `path` is a regular file (not a link to one) that starts with `magic`: a file
/// gpuvm wrote, which it may replace or remove. Never blocks (a FIFO is not opened for
/// reading) and reads at most 8 bytes.
pub fn is_gpuvm_file(path: &Path, magic: &[u8; 8]) -> bool {
    open_no_follow(path).is_some_and(|file| starts_with_any(&file, &[magic]))
}

/// Removes `path` (a file gpuvm wrote), logging a failure; whether it is gone.
pub fn remove_logged(path: &Path, what: &str) -> bool {
    match fs::remove_file(path) {
        Ok(()) => {
            debug!("removed {what} {}", path.display());
            true
        }
        Err(e) => {
            warn!("cannot remove {what} {}: {e}", path.display());
            false
        }
    }
}

/// Opens `path` for reading if it is a regular file itself (not a symbolic link, FIFO,
/// device...), without waiting on anything.
fn open_no_follow(path: &Path) -> Option<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

fn starts_with_any(file: &File, magics: &[&[u8; 8]]) -> bool {
    let mut head = [0u8; 8];
    let mut reader = file.take(8);
    reader.read_exact(&mut head).is_ok() && magics.iter().any(|m| **m == head)
}

/// `flock(2)` on `file`.
pub fn flock(file: &File, operation: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock only acts on the open file description of a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// fsync a directory so a rename in it is durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_text(path: &Path, text: &'static [u8]) -> io::Result<()> {
        write_atomically(path, |f| -> io::Result<()> { f.write_all(text) })
    }

    #[test]
    fn replaces_and_cleans_up() {
        let dir = crate::snapshot::test_util::TempDir::new("atomic");
        let path = dir.path().join("state");
        write_text(&path, b"one").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"one");

        // A failing writer leaves the old file and no temp file.
        let err = write_atomically(&path, |f| -> io::Result<()> {
            f.write_all(b"partial")?;
            Err(io::Error::other("boom"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "boom");
        assert_eq!(fs::read(&path).unwrap(), b"one");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

        // Temp files of dead writers (empty, or cut short after the magic) are removed
        // by the next write, whatever process id they name (even a live one: this one).
        let own = std::process::id();
        let stale_empty = dir.path().join(".state.tmp.999999999.0");
        fs::write(&stale_empty, b"").unwrap();
        let stale_cut = dir.path().join(format!(".state.tmp.{own}.77"));
        fs::write(&stale_cut, b"GPUVMSTA\x01\0\0").unwrap();
        write_text(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert!(!stale_empty.exists());
        assert!(!stale_cut.exists());
    }

    #[test]
    fn keeps_temp_files_in_use_or_not_written_by_gpuvm() {
        let dir = crate::snapshot::test_util::TempDir::new("atomic-keep");
        let path = dir.path().join("state");
        // A live writer (it holds the lock), though the process id it names is gone.
        let live = dir.path().join(".state.tmp.999999999.1");
        fs::write(&live, b"GPUVMSTA in progress").unwrap();
        let writer = File::open(&live).unwrap();
        flock(&writer, libc::LOCK_EX).unwrap();
        // Someone else's data under a temp-like name, and a FIFO (never opened to wait).
        let foreign = dir.path().join(".state.tmp.999999999.2");
        fs::write(&foreign, b"user data").unwrap();
        let fifo = dir.path().join(".state.tmp.999999999.3");
        let fifo_c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo reads a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(fifo_c.as_ptr(), 0o600) }, 0);
        write_text(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert!(live.exists(), "a live writer's temp file must be kept");
        assert!(foreign.exists(), "a file gpuvm did not write must be kept");
        assert!(fifo.exists());
        drop(writer);
        write_text(&path, b"newer").unwrap();
        assert!(!live.exists(), "once its writer is gone, it is stale");
        assert!(foreign.exists());
    }

    #[test]
    fn temp_names_are_recognised_exactly() {
        assert_eq!(temp_file_target(b".state.tmp.12.0"), Some(&b"state"[..]));
        assert_eq!(
            temp_file_target(b".memory-17.tmp.4.55"),
            Some(&b"memory-17"[..])
        );
        for not_temp in [
            &b"state"[..],
            b".state.tmp.12",
            b".state.tmp.12.0.1",
            b".state.tmp.x.0",
            b".state.tmp..0",
            b"state.tmp.1.2",
            b"..tmp.1.2",
            b".tmp.1.2",
        ] {
            assert_eq!(temp_file_target(not_temp), None, "{not_temp:?}");
        }
    }

    #[test]
    fn only_regular_files_with_the_magic_are_gpuvm_files() {
        let dir = crate::snapshot::test_util::TempDir::new("atomic-magic");
        let ours = dir.path().join("a");
        fs::write(&ours, b"GPUVMSTA....").unwrap();
        assert!(is_gpuvm_file(&ours, FRAMED_FILE_MAGIC));
        assert!(!is_gpuvm_file(&ours, MEMORY_FILE_MAGIC));
        let short = dir.path().join("b");
        fs::write(&short, b"GPUVM").unwrap();
        assert!(!is_gpuvm_file(&short, FRAMED_FILE_MAGIC));
        let link = dir.path().join("c");
        std::os::unix::fs::symlink(&ours, &link).unwrap();
        assert!(
            !is_gpuvm_file(&link, FRAMED_FILE_MAGIC),
            "a link is not ours"
        );
        assert!(!is_gpuvm_file(dir.path(), FRAMED_FILE_MAGIC));
        assert!(!is_gpuvm_file(
            &dir.path().join("missing"),
            FRAMED_FILE_MAGIC
        ));
    }
}
