//! Crash-safe file replacement: write a temporary file next to the target, fsync it,
//! rename it over the target, fsync the directory.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use log::{debug, warn};

/// Distinguishes temp files of concurrent writes from one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `path` atomically: `write` fills a fresh temporary file in the same directory,
/// which is then fsynced, renamed over `path`, and the directory fsynced.
///
/// A crash (or `kill -9`) at any point leaves either the old file or the new one at
/// `path`, never a mix. Temporary files left behind by writers that died are removed by the
/// next write to the same path. If `write` fails the temporary file is removed and `path`
/// is untouched.
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

    let temp = temp_path(&dir, file_name.as_bytes());
    let mut file = OpenOptions::new()
        .write(true)
        .read(true)
        .create_new(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&temp)?;
    let result = write(&mut file).and_then(|value| {
        file.sync_all()?;
        drop(file);
        fs::rename(&temp, path)?;
        sync_dir(&dir)?;
        Ok(value)
    });
    if result.is_err() {
        // The target is untouched; do not leave the partial file around.
        let _ = fs::remove_file(&temp);
    }
    result
}

/// `.<name>.tmp.<pid>.<n>`: hidden, and names the writer so stale ones can be recognised.
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

/// Removes temp files for `name` whose writer process no longer exists.
fn remove_stale_temp_files(dir: &Path, name: &[u8]) {
    let mut prefix = b".".to_vec();
    prefix.extend_from_slice(name);
    prefix.extend_from_slice(b".tmp.");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let Some(rest) = entry_name.as_bytes().strip_prefix(prefix.as_slice()) else {
            continue;
        };
        let pid = std::str::from_utf8(rest)
            .ok()
            .and_then(|r| r.split('.').next())
            .and_then(|p| p.parse::<libc::pid_t>().ok());
        let Some(pid) = pid else { continue };
        if pid > 0 && !process_exists(pid) {
            match fs::remove_file(entry.path()) {
                Ok(()) => debug!("removed stale temp file {}", entry.path().display()),
                Err(e) => warn!(
                    "cannot remove stale temp file {}: {e}",
                    entry.path().display()
                ),
            }
        }
    }
}

fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks whether the process exists; nothing is delivered.
    let ret = unsafe { libc::kill(pid, 0) };
    ret == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// fsync a directory so a rename in it is durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_and_cleans_up() {
        let dir = crate::snapshot::test_util::TempDir::new("atomic");
        let path = dir.path().join("state");
        write_atomically(&path, |f| -> io::Result<()> {
            use std::io::Write;
            f.write_all(b"one")
        })
        .unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"one");

        // A failing writer leaves the old file and no temp file.
        let err = write_atomically(&path, |f| -> io::Result<()> {
            use std::io::Write;
            f.write_all(b"partial")?;
            Err(io::Error::other("boom"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "boom");
        assert_eq!(fs::read(&path).unwrap(), b"one");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

        // A stale temp file from a dead writer is removed by the next write.
        let stale = dir.path().join(".state.tmp.999999999.0");
        fs::write(&stale, b"junk").unwrap();
        let live = dir
            .path()
            .join(format!(".state.tmp.{}.77", std::process::id()));
        fs::write(&live, b"in progress").unwrap();
        write_atomically(&path, |f| -> io::Result<()> {
            use std::io::Write;
            f.write_all(b"two")
        })
        .unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert!(!stale.exists());
        assert!(live.exists(), "a live writer's temp file must be kept");
    }
}
