//! `gpuvm snapshot --pid`: asks a running gpuvm to snapshot itself (SIGUSR1), once sure
//! that the process is a gpuvm that takes snapshots on that signal.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::CliError;

/// `gpuvm snapshot --pid`: sends SIGUSR1 to a gpuvm that takes snapshots on it. SIGUSR1
/// ends a process that does not handle it, and means something else to one that does, so
/// the target must run a gpuvm binary (this one, or one holding [`SNAPSHOT_SIGNAL_MARKER`]:
/// an upgrade or rebuild since it started) with its snapshot handler installed (only
/// `--snapshot-dir` installs it). The process is held by a pidfd from before the checks:
/// if it ends and its pid is reused meanwhile, the signal fails instead of reaching the
/// newcomer.
pub fn signal_snapshot(pid: i32) -> Result<ExitCode, CliError> {
    if pid <= 0 {
        return Err(CliError::Other(format!("invalid process id {pid}")));
    }
    let pidfd = pidfd::open(pid)?;
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let inspect = |what: &str, error: std::io::Error| {
        CliError::Other(format!("cannot inspect process {pid} ({what}): {error}"))
    };
    let exe = proc_dir.join("exe");
    if !is_gpuvm_binary(&exe).map_err(|e| inspect("its binary", e))? {
        let runs = std::fs::read_link(&exe).unwrap_or_default();
        return Err(CliError::Other(format!(
            "process {pid} ({}) is not a gpuvm; not signalling it",
            runs.display()
        )));
    }
    let status =
        std::fs::read_to_string(proc_dir.join("status")).map_err(|e| inspect("its status", e))?;
    let caught = status
        .lines()
        .find_map(|line| line.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .ok_or_else(|| CliError::Other(format!("process {pid}: no SigCgt in its status")))?;
    if caught & (1 << (libc::SIGUSR1 - 1)) == 0 {
        return Err(CliError::Other(format!(
            "gpuvm process {pid} does not take snapshots on a signal (it was started without \
             --snapshot-dir, or its VM is not running yet); not signalling it"
        )));
    }
    pidfd::send_signal(&pidfd, pid, libc::SIGUSR1)?;
    Ok(ExitCode::SUCCESS)
}

/// In every gpuvm binary whose SIGUSR1 means "snapshot now" (the bytes sit in its
/// read-only data because [`is_gpuvm_binary`] searches for them). Change the number if the
/// signal ever means something else.
const SNAPSHOT_SIGNAL_MARKER: &[u8] = b"gpuvm: SIGUSR1 takes a snapshot (protocol 1)";

/// Whether `exe` (a process's /proc/PID/exe) is this binary, or another file holding
/// [`SNAPSHOT_SIGNAL_MARKER`].
fn is_gpuvm_binary(exe: &std::path::Path) -> std::io::Result<bool> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let id = |m: std::fs::Metadata| (m.dev(), m.ino());
    let mut file = std::fs::File::open(exe)?;
    if id(file.metadata()?) == id(std::fs::metadata("/proc/self/exe")?) {
        return Ok(true);
    }
    // Read in chunks, each starting with the previous one's last marker-length bytes so
    // that a marker across a boundary is found.
    let keep = SNAPSHOT_SIGNAL_MARKER.len() - 1;
    let mut buffer = vec![0u8; 1 << 20];
    let mut filled = 0;
    loop {
        let read = file.read(&mut buffer[filled..])?;
        if read == 0 {
            return Ok(false);
        }
        filled += read;
        let window = &buffer[..filled];
        if window
            .windows(SNAPSHOT_SIGNAL_MARKER.len())
            .any(|w| w == SNAPSHOT_SIGNAL_MARKER)
        {
            return Ok(true);
        }
        let tail = filled.saturating_sub(keep);
        buffer.copy_within(tail..filled, 0);
        filled -= tail;
    }
}

/// pidfd_open(2) and pidfd_send_signal(2), which libc does not wrap (a live update's
/// confinement opens its pidfds here too).
pub(crate) mod pidfd {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use crate::CliError;

    fn error(pid: i32, what: &str) -> CliError {
        let error = std::io::Error::last_os_error();
        CliError::Other(match error.raw_os_error() {
            Some(libc::ESRCH) => format!("no process {pid}"),
            _ => format!("cannot {what} process {pid}: {error}"),
        })
    }

    pub fn open(pid: i32) -> Result<OwnedFd, CliError> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(error(pid, "open"));
        }
        // SAFETY: the descriptor was just returned to us and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    pub fn send_signal(pidfd: &OwnedFd, pid: i32, signal: i32) -> Result<(), CliError> {
        // SAFETY: a live pidfd, a valid signal, no siginfo (null) and no flags.
        let result = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if result != 0 {
            return Err(error(pid, "signal"));
        }
        Ok(())
    }
}
