//! Helpers shared by gpuvm's integration tests: find the `gpuvm` binary, run it with a
//! time limit while capturing its output, reserve huge pages for a test and give them back,
//! drive a VM through gpuvm's own API (start, boot, hot-plug a GPU, snapshot, restore).
//! The snapshot tests' own helpers are in [`snapshot_support`], the vhost-user backends the
//! tests start in [`vhost_user_support`].

pub mod cloud_hypervisor_support;
pub mod netns;
pub mod snapshot_support;
pub mod vhost_user_support;
pub mod virtio_support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Whether this host's CPU is AMD's (or Hygon's): gpuvm lays guest RAM and the 64-bit PCI
/// window out around the HyperTransport range there.
pub fn host_is_amd() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .find(|line| line.starts_with("vendor_id"))
            .is_some_and(|line| line.contains("AuthenticAMD") || line.contains("HygonGenuine"))
    })
}

/// The `gpuvm` binary: `$GPUVM_BIN`, else the one cargo built next to this test.
pub fn gpuvm_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("GPUVM_BIN") {
        return PathBuf::from(path);
    }
    // target/<profile>/deps/<test binary> -> target/<profile>/gpuvm
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let candidate = profile_dir.join("gpuvm");
    assert!(
        candidate.exists(),
        "gpuvm binary not found at {} (build it with `cargo build --workspace`, or set GPUVM_BIN)",
        candidate.display()
    );
    candidate
}

/// What one gpuvm run produced.
#[derive(Debug)]
pub struct RunOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl RunOutput {
    /// The status and both output streams, for assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.status, self.stdout, self.stderr
        )
    }

    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Panics with the whole output unless the run exited with `code`.
    pub fn assert_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code(),
            Some(code),
            "gpuvm exited with {:?}, expected {code}\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }

    pub fn assert_stdout_has(&self, text: &str) -> &Self {
        self.assert_output_has("stdout", &self.stdout, text)
    }

    /// Panics with the whole output unless stderr holds `text`.
    pub fn assert_stderr_has(&self, text: &str) -> &Self {
        self.assert_output_has("stderr", &self.stderr, text)
    }

    fn assert_output_has(&self, name: &str, output: &str, text: &str) -> &Self {
        assert!(
            output.contains(text),
            "{name} lacks {text:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout,
            self.stderr
        );
        self
    }

    /// A failed run must explain itself in one line and never panic.
    pub fn assert_clean_error(&self, needle: &str) -> &Self {
        assert_ne!(self.code(), Some(0), "expected failure\n{}", self.stderr);
        assert!(
            self.status.code().is_some(),
            "killed by a signal: {:?}\n{}",
            self.status,
            self.stderr
        );
        assert!(
            !self.stderr.contains("panicked"),
            "gpuvm panicked:\n{}",
            self.stderr
        );
        assert!(
            self.stderr.to_lowercase().contains(&needle.to_lowercase()),
            "stderr lacks {needle:?}:\n{}",
            self.stderr
        );
        self
    }
}

/// Runs `gpuvm ARGS` to completion; kills it and panics after `limit`.
pub fn run_gpuvm(args: &[&str], limit: Duration) -> RunOutput {
    run_gpuvm_until(args, limit, None)
}

/// `gpuvm ctl --api-sock API ARGS` (the CLI client of gpuvm's API), run to its end.
pub fn gpuvm_ctl(api: &Path, args: &[&str], limit: Duration) -> RunOutput {
    let mut all = vec![
        "ctl",
        "--api-sock",
        api.to_str().expect("UTF-8 socket path"),
    ];
    all.extend_from_slice(args);
    run_gpuvm(&all, limit)
}

/// Runs `gpuvm ARGS`; once a whole line with `stop_at` is on stdout the process is killed (for
/// guests that never end by themselves, like Linux on this host). Panics after `limit`.
pub fn run_gpuvm_until(args: &[&str], limit: Duration, stop_at: Option<&str>) -> RunOutput {
    run_gpuvm_with_env(args, &[], limit, stop_at)
}

/// Boots a kernel with `gpuvm ARGS` until the console shows a whole line with `marker`
/// ([`run_gpuvm_until`]); panics with the output if the run ends without it. Prints how
/// long the marker took (boot times on loaded hosts vary widely).
pub fn boot_until_marker(args: &[&str], limit: Duration, marker: &str) -> RunOutput {
    let out = run_gpuvm_until(args, limit, Some(marker));
    assert!(
        out.stdout.contains(marker),
        "no {marker:?} from the kernel (exit {:?})\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    eprintln!("{marker:?} after {:?}", out.elapsed);
    out
}

/// Like [`run_gpuvm_until`], with extra environment variables (e.g. the seccomp test
/// hooks) set for gpuvm.
pub fn run_gpuvm_with_env(
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
    stop_at: Option<&str>,
) -> RunOutput {
    let mut process = SpawnedProcess::gpuvm_with_env(args, env);
    let deadline = Instant::now() + limit;
    loop {
        if stop_at.is_some_and(|needle| has_whole_line_with(&process.stdout(), needle)) {
            process.signal(libc::SIGKILL);
            break;
        }
        if process.try_status().is_some() {
            break;
        }
        if Instant::now() > deadline {
            process.kill_and_panic(&format!("gpuvm {args:?} did not finish within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    process.wait(LIMIT_AFTER_KILL)
}

/// Runs `gpuvm ARGS` snapshotting into `dir` after `after_ms` milliseconds and then exiting;
/// the run must exit 0 within `limit`.
pub fn run_until_snapshot(
    args: &[&str],
    dir: &std::path::Path,
    after_ms: u32,
    limit: Duration,
) -> RunOutput {
    let after_ms = after_ms.to_string();
    let mut args = args.to_vec();
    args.extend([
        "--snapshot-dir",
        dir.to_str().expect("UTF-8 snapshot path"),
        "--snapshot-after-ms",
        &after_ms,
        "--snapshot-then",
        "exit",
    ]);
    let out = run_gpuvm(&args, limit);
    out.assert_code(0);
    out
}

/// Iteration numbers of the memloop guest's `iter N ok` lines; a line whose start was
/// printed before a snapshot (the restored run goes on mid-line) still counts.
pub fn memloop_iterations(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|line| line.split_once(" ok checksum="))
        .filter_map(|(head, _)| head.split_whitespace().last()?.parse().ok())
        .collect()
}

/// Whether `text` holds `needle` on a line that has ended (so a test that stops a guest
/// there sees that whole line).
fn has_whole_line_with(text: &str, needle: &str) -> bool {
    text.find(needle)
        .is_some_and(|at| text[at + needle.len()..].contains('\n'))
}

/// How long a process gets to end once it has exited or been sent SIGKILL.
const LIMIT_AFTER_KILL: Duration = Duration::from_secs(10);

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// Raises the 2 MiB huge page pool for a test and puts the old size back on drop.
pub struct HugePageReservation {
    previous: u64,
}

impl HugePageReservation {
    /// Makes at least `free_pages` 2 MiB pages free. Returns why not if the host refuses
    /// (not root, not enough contiguous memory).
    pub fn reserve(free_pages: u64) -> Result<Self, String> {
        let read = |path: &str| -> Result<u64, String> {
            std::fs::read_to_string(path)
                .map_err(|e| format!("read {path}: {e}"))?
                .trim()
                .parse()
                .map_err(|e| format!("parse {path}: {e}"))
        };
        let previous = read(NR_HUGEPAGES)?;
        let free_path = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
        let free = read(free_path)?;
        let guard = HugePageReservation { previous };
        if free < free_pages {
            let wanted = previous + (free_pages - free);
            std::fs::write(NR_HUGEPAGES, wanted.to_string())
                .map_err(|e| format!("write {NR_HUGEPAGES}: {e}"))?;
            let now_free = read(free_path)?;
            if now_free < free_pages {
                return Err(format!(
                    "asked for {free_pages} free 2 MiB pages, the host gave {now_free}"
                ));
            }
        }
        Ok(guard)
    }
}

impl Drop for HugePageReservation {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.previous.to_string());
    }
}

/// Serialises tests that change the huge page pool.
pub static HUGEPAGE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A Unix socket path in the temporary directory, unique to this test process and `name`
/// (`prefix` names the test file); any stale file there is removed.
pub fn socket_path(prefix: &str, name: &str) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("gpuvm-{prefix}-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

/// How a test starts gpuvm under a peer's name (`cloud-hypervisor`, `firecracker`), as an
/// orchestrator configured with that path does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerLaunch {
    /// A `<name> -> gpuvm` symlink, started through the link (argv[0] names the peer).
    Symlink,
    /// The same symlink resolved, as Kata resolves the configured path
    /// (`filepath.EvalSymlinks`) before starting it: gpuvm's own path, named `gpuvm`, with
    /// the peer's command line.
    Resolved,
    /// A hard link named `<name>` (a copy where the scratch directory is on another
    /// filesystem than the binary: the same name either way).
    HardLink,
}

impl PeerLaunch {
    /// The path the orchestrator executes for the peer `name`, made in `scratch`.
    pub fn path(self, scratch: &Scratch, name: &str) -> PathBuf {
        let link = scratch.path(name);
        match self {
            PeerLaunch::Symlink | PeerLaunch::Resolved => {
                if std::fs::symlink_metadata(&link).is_err() {
                    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
                }
                if self == PeerLaunch::Symlink {
                    return link;
                }
                let resolved = std::fs::canonicalize(&link).unwrap();
                assert_eq!(resolved.file_name().unwrap(), "gpuvm", "{resolved:?}");
                resolved
            }
            PeerLaunch::HardLink => {
                if std::fs::symlink_metadata(&link).is_err()
                    && std::fs::hard_link(gpuvm_bin(), &link).is_err()
                {
                    std::fs::copy(gpuvm_bin(), &link).unwrap();
                }
                assert!(!std::fs::symlink_metadata(&link).unwrap().is_symlink());
                link
            }
        }
    }
}

/// gpuvm as `firecracker`: a symlink of that name in `scratch`, as Firecracker's clients start
/// the binary (the name selects the front end).
pub fn firecracker_link(scratch: &Scratch) -> PathBuf {
    let link = scratch.path("firecracker");
    if !link.exists() {
        std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    }
    link
}

/// Starts `firecracker --api-sock API --id ID EXTRA...` (gpuvm through [`firecracker_link`])
/// and waits for its API socket.
pub fn start_firecracker(
    scratch: &Scratch,
    api: &Path,
    id: &str,
    extra: &[&str],
) -> SpawnedProcess {
    let mut args = vec!["--api-sock", api.to_str().unwrap(), "--id", id];
    args.extend_from_slice(extra);
    let mut vmm = SpawnedProcess::spawn(&firecracker_link(scratch), &args);
    wait_for_api_socket(&mut vmm, api);
    vmm
}

/// Starts the emulated GPU (`emu_bin`: the test's `env!("CARGO_BIN_EXE_gpuvm-emu-gpu")`)
/// serving vfio-user on `socket`, logging at info, and waits until it listens: its
/// "listening" line comes after listen(2), whereas the socket file appears at bind(2),
/// when a connection would still be refused.
pub fn start_emu_gpu(
    emu_bin: &std::path::Path,
    socket: &std::path::Path,
    extra: &[&str],
) -> SpawnedProcess {
    let mut args = vec!["--socket", socket.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    let mut emu = SpawnedProcess::spawn_with_env(emu_bin, &args, &[("GPUVM_LOG", "info")]);
    emu.wait_for_stderr("emu-gpu: listening on", Duration::from_secs(10));
    emu
}

/// `name` in the Linux guests' build output (`$GPUVM_LINUX_DIR`, else
/// guest-images/linux/out); panics saying how to build it (`build_hint`) when it is missing.
pub fn linux_guest_file(name: &str, build_hint: &str) -> PathBuf {
    let dir = std::env::var_os("GPUVM_LINUX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guest-images/linux/out")
        });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: {build_hint} or point GPUVM_LINUX_DIR at its output",
        path.display()
    );
    path
}

/// The RAM ranges (start, length) the test guest sees for `memory` bytes of guest RAM.
pub fn guest_ram_ranges(memory: u64) -> Vec<(u64, u64)> {
    guest_ram_ranges_on(memory, false)
}

/// As [`guest_ram_ranges`], on an AMD host where `amd` (RAM kept out of the HyperTransport
/// range).
pub fn guest_ram_ranges_on(memory: u64, amd: bool) -> Vec<(u64, u64)> {
    use gpuvm_arch::x86_64::layout::{e820_map, ram_regions_around, E820_RAM};
    e820_map(&ram_regions_around(memory, amd))
        .into_iter()
        .filter(|e| e.kind == E820_RAM)
        .map(|e| (e.addr, e.size))
        .collect()
}

/// A process started in the background, for tests that signal or kill it while it runs
/// (snapshots, `kill -9`). Output is collected as raw bytes: a kill may cut a line, and
/// tests that join the output of two processes need the exact bytes. Killed on drop.
pub struct SpawnedProcess {
    child: Child,
    stdout: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    stderr: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    started: Instant,
    status: Option<ExitStatus>,
}

fn spawn_raw_reader<R: Read + Send + 'static>(
    mut reader: R,
    sink: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(count) = reader.read(&mut buffer) {
            if count == 0 {
                break;
            }
            sink.lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(&buffer[..count]);
        }
    })
}

impl SpawnedProcess {
    /// Starts `gpuvm ARGS`.
    pub fn gpuvm(args: &[&str]) -> SpawnedProcess {
        Self::spawn(&gpuvm_bin(), args)
    }

    /// Starts `gpuvm ARGS` with extra environment variables.
    pub fn gpuvm_with_env(args: &[&str], env: &[(&str, &str)]) -> SpawnedProcess {
        Self::spawn_with_env(&gpuvm_bin(), args, env)
    }

    /// Starts `program ARGS` with stdin closed and stdout/stderr captured.
    pub fn spawn(program: &std::path::Path, args: &[&str]) -> SpawnedProcess {
        Self::spawn_with_env(program, args, &[])
    }

    /// Like [`SpawnedProcess::spawn`], with extra environment variables.
    pub fn spawn_with_env(
        program: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> SpawnedProcess {
        Self::spawn_with_stdin(program, args, env, Stdio::null())
    }

    /// Starts `gpuvm ARGS` with a pipe on its stdin (see [`SpawnedProcess::write_stdin`]):
    /// what is written there reaches the guest's serial port.
    pub fn gpuvm_with_input(args: &[&str]) -> SpawnedProcess {
        Self::spawn_with_stdin(&gpuvm_bin(), args, &[], Stdio::piped())
    }

    /// [`SpawnedProcess::gpuvm_with_input`] with extra environment variables.
    pub fn gpuvm_with_env_and_input(args: &[&str], env: &[(&str, &str)]) -> SpawnedProcess {
        Self::spawn_with_stdin(&gpuvm_bin(), args, env, Stdio::piped())
    }

    /// Writes `bytes` to the process's stdin (started by [`SpawnedProcess::gpuvm_with_input`]).
    pub fn write_stdin(&mut self, bytes: &[u8]) {
        use std::io::Write;
        let stdin = self
            .child
            .stdin
            .as_mut()
            .expect("started without a stdin pipe");
        stdin.write_all(bytes).expect("write to stdin");
        stdin.flush().expect("flush stdin");
    }

    fn spawn_with_stdin(
        program: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
        stdin: Stdio,
    ) -> SpawnedProcess {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        let stdout = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let readers = vec![
            spawn_raw_reader(child.stdout.take().expect("stdout"), stdout.clone()),
            spawn_raw_reader(child.stderr.take().expect("stderr"), stderr.clone()),
        ];
        SpawnedProcess {
            child,
            stdout,
            stderr,
            readers,
            started: Instant::now(),
            status: None,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Everything the process wrote to stdout so far.
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    /// The exit status, if the process has ended.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("wait");
        }
        self.status
    }

    /// Once the process has ended: waits (at most `limit`) until the readers have taken
    /// everything it wrote, i.e. until its pipes are closed (a child it left running may
    /// hold them open longer). A fixed sleep instead loses output on a loaded host.
    pub fn drain_output(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let (done, running) = self.readers.drain(..).partition(|r| r.is_finished());
        self.readers = running;
        for reader in done {
            let _ = reader.join();
        }
    }

    /// Polls `ready` until it holds; panics with the output if the process ends first or
    /// `limit` passes.
    pub fn wait_until(
        &mut self,
        what: &str,
        limit: Duration,
        mut ready: impl FnMut(&Self) -> bool,
    ) {
        let deadline = Instant::now() + limit;
        loop {
            if ready(self) {
                return;
            }
            let ended = self.try_status();
            if ended.is_some() || Instant::now() > deadline {
                // One last look: the output may have arrived with the exit.
                if ended.is_some() {
                    self.drain_output(Duration::from_secs(2));
                } else {
                    std::thread::sleep(Duration::from_millis(50));
                }
                if ready(self) {
                    return;
                }
                panic!(
                    "waiting for {what}: process {} after {:?}\n--- stdout\n{}\n--- stderr\n{}",
                    match ended {
                        Some(status) => format!("ended with {status}"),
                        None => "still running".into(),
                    },
                    self.started.elapsed(),
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until stdout contains `needle` (see [`SpawnedProcess::wait_until`]).
    pub fn wait_for_stdout(&mut self, needle: &str, limit: Duration) {
        self.wait_until(&format!("{needle:?} on stdout"), limit, |p| {
            p.stdout().contains(needle)
        });
    }

    /// Waits until stderr contains `needle` (see [`SpawnedProcess::wait_until`]).
    pub fn wait_for_stderr(&mut self, needle: &str, limit: Duration) {
        self.wait_until(&format!("{needle:?} on stderr"), limit, |p| {
            p.stderr().contains(needle)
        });
    }

    /// Sends `signal` (e.g. `libc::SIGKILL`) unless the process has already ended.
    pub fn signal(&mut self, signal: i32) {
        if self.try_status().is_none() {
            // SAFETY: kill(2) on our own child's pid has no memory effects.
            unsafe { libc::kill(self.pid(), signal) };
        }
    }

    /// Waits for the process to end; `None` if it is still running after `limit` (it is
    /// then killed, and its output is lost).
    pub fn wait_timeout(mut self, limit: Duration) -> Option<RunOutput> {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.try_status() {
                break status;
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        Some(RunOutput {
            status,
            stdout: self.stdout(),
            stderr: self.stderr(),
            elapsed: self.started.elapsed(),
        })
    }

    /// Waits for the process to end; kills it and panics with its output after `limit`.
    pub fn wait(mut self, limit: Duration) -> RunOutput {
        let deadline = Instant::now() + limit;
        while self.try_status().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if self.try_status().is_none() {
            self.kill_and_panic(&format!("process did not end within {limit:?}"));
        }
        self.wait_timeout(Duration::ZERO).expect("ended")
    }

    /// Kills the process and panics with `why`, where each of its threads was (for a
    /// hang that happens once in many runs) and everything it wrote.
    fn kill_and_panic(&mut self, why: &str) -> ! {
        let threads = thread_report(self.pid());
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
        self.drain_output(Duration::from_secs(2));
        panic!(
            "{why}\n--- threads\n{threads}--- stdout\n{}\n--- stderr\n{}",
            self.stdout(),
            self.stderr()
        );
    }
}

impl Drop for SpawnedProcess {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits until `process` (a gpuvm started with `--api-sock socket`) accepts connections.
pub fn wait_for_api_socket(process: &mut SpawnedProcess, socket: &std::path::Path) {
    process.wait_until("the API socket", Duration::from_secs(30), |_| {
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
}

/// One API request that must answer `status`; returns the body.
pub fn api_expect(
    socket: &std::path::Path,
    status: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> String {
    let response = gpuvm_api::client::request(socket, method, path, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    assert_eq!(
        response.status, status,
        "{method} {path} answered {}: {}",
        response.status, response.body
    );
    response.body
}

/// Starts the configured VM behind `socket` (`PUT /actions` InstanceStart, answered 204).
pub fn api_start_instance(socket: &std::path::Path) {
    api_expect(
        socket,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
}

/// Starts `gpuvm run --api-sock API` (after `--log-level LEVEL` where one is given, with
/// `env`) and waits until the API answers; the VM is then configured through the API.
pub fn spawn_api_vmm(api: &Path, log_level: Option<&str>, env: &[(&str, &str)]) -> SpawnedProcess {
    let mut args = Vec::new();
    if let Some(level) = log_level {
        args.extend(["--log-level", level]);
    }
    args.extend([
        "run",
        "--api-sock",
        api.to_str().expect("UTF-8 socket path"),
    ]);
    let mut vmm = SpawnedProcess::gpuvm_with_env(&args, env);
    wait_for_api_socket(&mut vmm, api);
    vmm
}

/// Gives the VM behind `api` the test guest's command line `boot_args` (PUT /boot-source).
pub fn api_boot_source(api: &Path, boot_args: &str) {
    let body = serde_json::json!({ "boot_args": boot_args }).to_string();
    api_expect(api, 204, "PUT", "/boot-source", Some(&body));
}

/// Boots the test guest behind `api` with `boot_args` ([`api_boot_source`], then
/// [`api_start_instance`]).
pub fn api_boot(api: &Path, boot_args: &str) {
    api_boot_source(api, boot_args);
    api_start_instance(api);
}

/// The PUT /gpus/ID body for the GPU `id` served over vfio-user on `socket`.
pub fn gpu_body(id: &str, socket: &Path) -> String {
    serde_json::json!({ "gpu_id": id, "vfio_user_socket": socket }).to_string()
}

/// Snapshots the whole VM behind `api` into `dir` (PUT /snapshot/create, answered 200).
pub fn api_snapshot_create(api: &Path, dir: &Path) {
    let body = serde_json::json!({ "snapshot_path": dir }).to_string();
    api_expect(api, 200, "PUT", "/snapshot/create", Some(&body));
}

/// Restores `dir` into the VMM behind `api`, lazily, and resumes the VM (PUT
/// /snapshot/load, answered 204).
pub fn api_load_lazy(api: &Path, dir: &Path) {
    let body = serde_json::json!({
        "snapshot_path": dir,
        "restore_mode": "Lazy",
        "resume_vm": true,
    })
    .to_string();
    api_expect(api, 204, "PUT", "/snapshot/load", Some(&body));
}

/// The `PUT /snapshot/load` body that restores `snapshot` through the page-fault handler
/// listening on `handler_socket` and resumes the VM.
pub fn external_load_body(snapshot: &std::path::Path, handler_socket: &std::path::Path) -> String {
    format!(
        r#"{{"snapshot_path": "{}", "restore_mode": "External", "uffd_socket_path": "{}", "resume_vm": true}}"#,
        snapshot.display(),
        handler_socket.display()
    )
}

/// Fields of each thread of process `pid` from /proc/PID/task/TID/status: for each thread,
/// the values of `names` (e.g. "Name:"), in that order ("" where a field is missing).
pub fn thread_status_fields(pid: i32, names: &[&str]) -> Vec<Vec<String>> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .map(|status| {
            names
                .iter()
                .map(|name| {
                    status
                        .lines()
                        .find_map(|line| line.strip_prefix(name))
                        .map(|v| v.trim().to_string())
                        .unwrap_or_default()
                })
                .collect()
        })
        .collect()
}

/// Each thread of process `pid`: its name and its seccomp mode (0 off, 2 filter), from
/// /proc/PID/task/TID/status.
pub fn thread_seccomp_modes(pid: i32) -> Vec<(String, u32)> {
    let mut threads: Vec<(String, u32)> = thread_status_fields(pid, &["Name:", "Seccomp:"])
        .into_iter()
        .map(|fields| (fields[0].clone(), fields[1].parse().unwrap_or(u32::MAX)))
        .collect();
    threads.sort();
    threads
}

/// A directory for one test's sockets, snapshots and other files, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    /// `$TMPDIR/gpuvm-<suite>-<name>-<pid>`, emptied first.
    pub fn new(suite: &str, name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("gpuvm-{suite}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts the test page-fault handler (`gpuvm-test-uffd-handler`, at `program`) listening
/// on `socket` and serving the snapshot in `snapshot` (plus `extra` arguments), and waits
/// until it listens.
pub fn start_uffd_handler(
    program: &std::path::Path,
    socket: &std::path::Path,
    snapshot: &std::path::Path,
    extra: &[&str],
) -> SpawnedProcess {
    let (socket, snapshot) = (
        socket.to_str().expect("UTF-8 socket path"),
        snapshot.to_str().expect("UTF-8 snapshot path"),
    );
    let mut args = vec!["--socket", socket, "--snapshot", snapshot];
    args.extend_from_slice(extra);
    let mut handler = SpawnedProcess::spawn(program, &args);
    handler.wait_for_stdout("uffd-handler: listening", Duration::from_secs(30));
    handler
}

/// A restored memloop guest resumed (no second boot), ran at least two more iterations
/// (the one the snapshot cut and a whole one, which checks every page) and finished.
pub fn assert_memloop_resumed_and_done(out: &RunOutput) {
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    assert!(out.stdout.contains("memloop: done"), "{}", out.describe());
    assert!(
        !out.stdout.contains("memloop: cpus="),
        "the guest booted again instead of resuming: {}",
        out.describe()
    );
    assert!(
        memloop_iterations(&out.stdout).len() >= 2,
        "fewer than 2 iterations after restore: {}",
        out.describe()
    );
}

/// Each thread of `pid`: its name, state, wait channel and kernel stack (where readable).
pub fn thread_report(pid: i32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return "(no /proc entry)\n".into();
    };
    let mut report = String::new();
    for task in tasks.flatten() {
        let dir = task.path();
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        let stat = read("stat");
        let state = (stat.rsplit_once(')'))
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?");
        report.push_str(&format!(
            "{} {} state {state} wchan {}\n",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim()
        ));
        for frame in read("stack").lines().take(8) {
            report.push_str(&format!("    {frame}\n"));
        }
    }
    report
}

/// Runs `gpuvm update --pid PID EXTRA...` with `env` added to this process's environment
/// (the new gpuvm inherits it) and returns what it printed.
pub fn gpuvm_update(pid: i32, extra: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(gpuvm_bin())
        .args(["update", "--pid", &pid.to_string()])
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .expect("run gpuvm update")
}

/// The pid of the process that runs the VM after the `gpuvm update` that printed `out`,
/// which must have gone through (`context`: what to show if it did not).
pub fn updated_to(out: &std::process::Output, context: &str) -> i32 {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpuvm update failed: {}\n{stdout}\n{context}",
        String::from_utf8_lossy(&out.stderr)
    );
    (stdout.split("runs in process ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no new pid in {stdout:?}"))
}

/// Waits until process `pid` (not this one's child: a gpuvm a live update started) has
/// ended, at most `limit`; past it the test fails with `context()`.
pub fn wait_process_gone(pid: i32, limit: Duration, context: impl Fn() -> String) {
    let deadline = Instant::now() + limit;
    while process_running(pid) {
        assert!(
            Instant::now() < deadline,
            "process {pid} still runs after {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `pid` runs (a zombie does not).
pub fn process_running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

#[cfg(test)]
mod tests {
    use super::has_whole_line_with;

    #[test]
    fn a_stop_marker_counts_once_its_line_has_ended() {
        assert!(!has_whole_line_with(
            "boot\nsmpboot: Allowing 2",
            "smpboot: Allowing"
        ));
        assert!(has_whole_line_with(
            "smpboot: Allowing 2 CPUs\n",
            "smpboot: Allowing"
        ));
        assert!(has_whole_line_with(
            "a\nsmpboot: Allowing\nmore",
            "smpboot: Allowing"
        ));
        assert!(!has_whole_line_with("a\nb\n", "smpboot"));
    }
}
