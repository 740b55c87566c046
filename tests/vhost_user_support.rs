//! The vhost-user backends the tests start themselves (tests/vhost_user.rs,
//! linux_virtio.rs, memory_hotplug.rs): a backend's binary, or a line saying the test is
//! skipped without it; qemu-storage-daemon exporting an image as vhost-user-blk and
//! virtiofsd sharing a directory, each started until its socket exists.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::snapshot_support::arg;
use crate::{RunOutput, SpawnedProcess};

/// How long a backend gets to create its socket.
pub const BACKEND_START: Duration = Duration::from_secs(10);

/// `name` in $PATH (and, for cargo-installed backends, in ~/.cargo/bin).
fn find_binary(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect())
        .unwrap_or_default();
    if let Some(cargo_home) = std::env::var_os("CARGO_HOME") {
        dirs.push(PathBuf::from(cargo_home).join("bin"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|dir| dir.join(name))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The backend binary `name`, or `None` after saying on stderr that the test `suite::test`
/// is skipped.
pub fn backend_binary(name: &str, suite: &str, test: &str) -> Option<PathBuf> {
    let found = find_binary(name);
    if found.is_none() {
        eprintln!(
            "SKIPPED {suite}::{test}: {name} is not installed (not in PATH nor ~/.cargo/bin; \
             scripts/install-deps.sh installs it)"
        );
    }
    found
}

/// A backend process started by a test: killed (SIGKILL) and reaped on drop
/// ([`SpawnedProcess`]'s drop).
pub struct Backend {
    name: &'static str,
    process: SpawnedProcess,
}

impl Backend {
    /// Starts `program ARGS` and waits until `socket` exists (panics with the backend's
    /// output if it exits first or takes longer than [`BACKEND_START`]).
    pub fn start(name: &'static str, program: &Path, args: &[&str], socket: &Path) -> Backend {
        let mut process = SpawnedProcess::spawn(program, args);
        process.wait_until(
            &format!("{name} to create {}", socket.display()),
            BACKEND_START,
            |_| socket.exists(),
        );
        Backend { name, process }
    }

    /// Kills the backend with SIGKILL and reaps it.
    pub fn kill9(self) {
        let Backend { name, mut process } = self;
        process.signal(libc::SIGKILL);
        let out = process.wait(Duration::from_secs(10));
        assert_eq!(
            out.status.code(),
            None,
            "{name} was expected to die of SIGKILL: {}",
            out.describe()
        );
    }

    /// Asks the backend to end (SIGTERM) and waits for it; panics with its output if it
    /// is still running after `limit`.
    pub fn terminate(self, limit: Duration) -> RunOutput {
        let Backend { mut process, .. } = self;
        process.signal(libc::SIGTERM);
        process.wait(limit)
    }

    /// What the backend wrote to stderr so far (for assertion messages).
    pub fn stderr(&self) -> String {
        format!("--- {} stderr\n{}", self.name, self.process.stderr())
    }
}

/// qemu-storage-daemon exporting `image` as vhost-user-blk on `socket`.
pub fn start_qsd(program: &Path, image: &Path, socket: &Path, writable: bool) -> Backend {
    let file = format!("driver=file,node-name=file0,filename={}", arg(image));
    let export = format!(
        "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={},writable={}",
        arg(socket),
        if writable { "on" } else { "off" }
    );
    Backend::start(
        "qemu-storage-daemon",
        program,
        &[
            "--blockdev",
            &file,
            "--blockdev",
            "driver=raw,node-name=disk0,file=file0",
            "--export",
            &export,
        ],
        socket,
    )
}

/// virtiofsd sharing `dir` on `socket` (it writes `<socket>.pid` beside it).
pub fn start_virtiofsd(program: &Path, dir: &Path, socket: &Path) -> Backend {
    let socket_arg = format!("--socket-path={}", arg(socket));
    let dir_arg = format!("--shared-dir={}", arg(dir));
    Backend::start(
        "virtiofsd",
        program,
        &[&socket_arg, &dir_arg, "--sandbox", "none"],
        socket,
    )
}
