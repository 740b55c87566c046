//! `gpuvm update`: hands a running VM to a new gpuvm binary (live update), and the new
//! binary's side, the hidden `gpuvm update-receive`.
//!
//! The caller spawns the new binary, not the running gpuvm: the running VMM thread's
//! seccomp filter allows no fork or exec (and should not), so `gpuvm update` starts
//! `NEW update-receive` with a listening hand-over socket, then asks the running gpuvm
//! over its API socket (PUT /vmm/update) to connect there and hand the VM over. The
//! running gpuvm needs nothing new from its filter: a Unix socket, connect, sendmsg,
//! recvmsg and socket timeouts, all of which it has for vfio-user devices already.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use gpuvm_api::server::ApiServer;
use gpuvm_vmm::config::VmConfig;
use gpuvm_vmm::controller::ApiController;
use gpuvm_vmm::update::receive::{self, Outcome};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::args::{ReportArgs, SeccompArgs};
use crate::CliError;

/// `gpuvm update`.
#[derive(Args, Debug)]
pub struct UpdateArgs {
    /// Process id of the running gpuvm (started with --api-sock).
    #[arg(long)]
    pub pid: i32,
    /// The gpuvm binary to hand the VM to (default: the binary the running gpuvm was
    /// started from, as it was then: /proc/PID/exe).
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// The running gpuvm's API socket (default: the one Unix socket it listens on with a
    /// path).
    #[arg(long)]
    pub api_sock: Option<PathBuf>,
    /// How long each side waits for the other at each step before the running gpuvm
    /// takes the VM back.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
}

/// `gpuvm update-receive` (started by `gpuvm update`; not for people).
#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// The listening hand-over socket, inherited as this descriptor.
    #[arg(long)]
    pub handover_fd: i32,
    /// The API socket to serve once the old gpuvm has gone (the same path).
    #[arg(long)]
    pub api_sock: PathBuf,
    /// How long to wait for the running gpuvm at each step.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
    #[command(flatten)]
    pub seccomp: SeccompArgs,
}

/// `gpuvm update --pid P`: starts the new binary and asks the running gpuvm to hand it
/// the VM. Succeeds once the new process runs the VM; on failure the VM runs on in the
/// old process, and the error says why.
pub fn update(args: UpdateArgs) -> Result<ExitCode, CliError> {
    if args.pid <= 0 {
        return Err(CliError::Other(format!("invalid process id {}", args.pid)));
    }
    let pid = args.pid;
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    if !proc_dir.exists() {
        return Err(CliError::Other(format!("no process {pid}")));
    }
    if std::fs::read_link(proc_dir.join("root")).ok() != Some(PathBuf::from("/")) {
        return Err(CliError::Other(format!(
            "live update of a jailed gpuvm (process {pid} runs in a chroot) is not supported yet"
        )));
    }
    let api_sock = match &args.api_sock {
        Some(path) => path.clone(),
        None => api_socket_of(pid)?,
    };
    let binary = args.binary.clone().unwrap_or_else(|| proc_dir.join("exe"));
    let handover =
        std::env::temp_dir().join(format!("gpuvm-update-{pid}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&handover);
    let listener = UnixListener::bind(&handover).map_err(|e| {
        CliError::Other(format!(
            "cannot listen on the hand-over socket {}: {e}",
            handover.display()
        ))
    })?;
    let removal = RemoveOnDrop(handover.clone());
    let mut child = spawn_receiver(&binary, &listener, &api_sock, args.timeout_ms)?;
    drop(listener);
    let body = serde_json::json!({
        "handover_socket": handover,
        "timeout_ms": args.timeout_ms,
    })
    .to_string();
    let started = Instant::now();
    let answer = gpuvm_api::client::request(&api_sock, "PUT", "/vmm/update", Some(&body));
    drop(removal);
    match answer {
        Ok(answer) if answer.is_success() => {
            let value: serde_json::Value = serde_json::from_str(&answer.body).unwrap_or_default();
            println!(
                "gpuvm: the VM now runs in process {} ({} binary {}); the hand-over took {} ms, \
                 {} us of it paused before the new process was ready",
                child.id(),
                if args.binary.is_some() { "new" } else { "same" },
                binary.display(),
                started.elapsed().as_millis(),
                value["paused_to_ready_us"]
            );
            Ok(ExitCode::SUCCESS)
        }
        Ok(answer) => {
            // The old process answered: the VM runs on there, the new one must not linger.
            let _ = child.kill();
            let status = child.wait().ok();
            Err(CliError::Other(format!(
                "live update of process {pid} failed (the new gpuvm {} ended: {}): {}",
                binary.display(),
                status.map_or("unknown".into(), |s| s.to_string()),
                answer.message()
            )))
        }
        Err(error) => Err(no_answer(pid, &mut child, &error)),
    }
}

/// The old process `pid` did not answer PUT /vmm/update. If it died during the hand-over,
/// the new process (`child`) may run the VM (it takes it over when the old one dies after
/// its Ready): it is left alone then, and the error says where the VM is.
fn no_answer(
    pid: i32,
    child: &mut std::process::Child,
    error: &gpuvm_api::client::ClientError,
) -> CliError {
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{pid}/exe")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if std::path::Path::new(&format!("/proc/{pid}/exe")).exists() {
        // The old process lives (and keeps the VM): the new one must not linger.
        let _ = child.kill();
        let _ = child.wait();
        return CliError::Other(format!(
            "live update of process {pid} failed: its API did not answer ({error})"
        ));
    }
    match child.try_wait() {
        Ok(None) => CliError::Other(format!(
            "process {pid} ended during the hand-over without answering ({error}); the new \
             gpuvm, process {}, runs the VM if it had taken it (see its log)",
            child.id()
        )),
        _ => CliError::Other(format!(
            "process {pid} ended during the hand-over without answering ({error}), and so did \
             the new gpuvm: the VM is lost"
        )),
    }
}

/// Starts `binary update-receive` with `listener` as an inherited descriptor, in its own
/// process group (a signal to the caller's group must not reach the VM's new home).
fn spawn_receiver(
    binary: &Path,
    listener: &UnixListener,
    api_sock: &Path,
    timeout_ms: u64,
) -> Result<std::process::Child, CliError> {
    let fd = listener.as_raw_fd();
    // SAFETY: F_SETFD on a descriptor this process owns: it survives the exec below. This
    // process starts no other child meanwhile (it has one thread).
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(CliError::Other(format!(
            "cannot pass the hand-over socket on: {}",
            std::io::Error::last_os_error()
        )));
    }
    Command::new(binary)
        .arg("update-receive")
        .arg("--handover-fd")
        .arg(fd.to_string())
        .arg("--api-sock")
        .arg(api_sock)
        .arg("--timeout-ms")
        .arg(timeout_ms.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| CliError::Other(format!("cannot start {}: {e}", binary.display())))
}

/// Removes the hand-over socket's file when `gpuvm update` is done with it.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The API socket of gpuvm process `pid`: the one listening Unix socket with a path among
/// its descriptors (/proc/PID/fd, /proc/net/unix).
fn api_socket_of(pid: i32) -> Result<PathBuf, CliError> {
    let inodes: Vec<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(|e| CliError::Other(format!("cannot list process {pid}'s descriptors: {e}")))?
        .flatten()
        .filter_map(|entry| std::fs::read_link(entry.path()).ok())
        .filter_map(|target| {
            target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/unix")
        .map_err(|e| CliError::Other(format!("cannot read /proc/net/unix: {e}")))?;
    // Columns: Num RefCount Protocol Flags Type St Inode Path; flag 0x10000 is listening.
    let listening: Vec<PathBuf> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = u64::from_str_radix(fields.get(3)?, 16).ok()?;
            let inode: u64 = fields.get(6)?.parse().ok()?;
            let path = fields.get(7)?;
            (flags & 0x10000 != 0 && inodes.contains(&inode) && path.starts_with('/'))
                .then(|| PathBuf::from(path))
        })
        .filter(|path| {
            std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_socket())
        })
        .collect();
    match listening.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(CliError::Other(format!(
            "process {pid} listens on no API socket (live update needs gpuvm run --api-sock)"
        ))),
        several => Err(CliError::Other(format!(
            "process {pid} listens on several sockets ({}); say which is its API socket with \
             --api-sock",
            several
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// `gpuvm update-receive`: takes the VM from the old gpuvm, runs it once the old one has
/// committed, and serves the API socket at its path once the old one has gone.
pub fn receive(args: ReceiveArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    args.seccomp.enable()?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let listener = inherited_listener(args.handover_fd)?;
    let mut incoming = receive::accept(&listener, timeout).map_err(refused)?;
    drop(listener);
    incoming.adopt_stdio().map_err(refused)?;
    incoming
        .prepare(crate::run::serial_out())
        .map_err(refused)?;
    let (mut machine, timings) = incoming.load().map_err(refused)?;
    let (requests_tx, requests_rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(EFD_NONBLOCK).map_err(gpuvm_vmm::Error::EventFd)?;
    let vmm = gpuvm_vmm::action_channel::ActionSender::new(
        requests_tx.clone(),
        wake.try_clone().map_err(gpuvm_vmm::Error::EventFd)?,
    );
    let config = VmConfig {
        machine: machine.config().clone(),
        boot: gpuvm_vmm::controller::default_boot_source(),
    };
    let mut controller =
        ApiController::new(requests_rx, wake, config, Box::new(crate::run::serial_out));
    controller.set_request_sender(requests_tx);
    machine.set_run_control(controller.into_run_control());
    let outcome = incoming.ready(timeout).map_err(refused)?;
    // The VM was built while the guest ran (the stages before `wait_for_state`); only
    // loading the state and what follows count in the pause.
    let built: Duration = timings
        .stages
        .iter()
        .take_while(|(name, _)| *name != "wait_for_state")
        .map(|&(_, d)| d)
        .sum();
    eprintln!(
        "gpuvm: live update: this process (pid {}) runs the VM{}; paused_to_run_us={} \
         build_us={} stages_us:{}",
        std::process::id(),
        if outcome == Outcome::OldProcessDied {
            " (the old process died before it committed)"
        } else {
            ""
        },
        incoming.paused_for().as_micros(),
        built.as_micros(),
        timings
            .stages
            .iter()
            .map(|(name, d)| format!(" {name}={}", d.as_micros()))
            .collect::<String>()
    );
    // The old process removes the API socket's file as it exits: bind it after that.
    let api_sock = args.api_sock.clone();
    let api = std::thread::Builder::new()
        .name("api-takeover".into())
        .spawn(move || {
            // No filter of its own: filters stack, and the API thread this starts takes
            // the API filter alone (as when the VMM thread starts it before its own).
            if !incoming.wait_old_exit(Duration::from_secs(10)) {
                log::warn!("the old gpuvm has not exited 10 s after the hand-over");
            }
            ApiServer::start(&api_sock, vmm)
        })
        .map_err(|e| CliError::Other(format!("cannot start the API thread: {e}")))?;
    let report = ReportArgs {
        report_memory: false,
        report_timing: false,
    };
    let result = crate::report::finish(machine, &report, process_start, None);
    match api.join() {
        Ok(Ok(server)) => server.wait_idle(Duration::from_secs(2)),
        Ok(Err(error)) => log::error!("the API socket could not be served: {error}"),
        Err(_) => log::error!("the API thread failed"),
    }
    result
}

/// A hand-over this process did not complete: the VM is not its to run.
fn refused(error: gpuvm_vmm::update::UpdateError) -> CliError {
    CliError::Other(format!(
        "live update: this process does not run the VM: {error}"
    ))
}

/// The hand-over socket `gpuvm update` passed as descriptor `fd`, checked to be a socket.
fn inherited_listener(fd: i32) -> Result<UnixListener, CliError> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one stat into `stat`; its result is checked before use.
    let is_socket = fd > 2
        && unsafe { libc::fstat(fd, stat.as_mut_ptr()) } == 0
        // SAFETY: fstat succeeded, so `stat` is initialised.
        && unsafe { stat.assume_init() }.st_mode & libc::S_IFMT == libc::S_IFSOCK;
    if !is_socket {
        return Err(CliError::Other(format!(
            "--handover-fd {fd} is not a socket (gpuvm update-receive is started by gpuvm \
             update)"
        )));
    }
    // SAFETY: a socket descriptor inherited for this process alone (see `gpuvm update`);
    // nothing else here owns it. CLOEXEC again, so no later child inherits it.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: as above: the listener takes ownership of `fd`.
    Ok(unsafe { UnixListener::from_raw_fd(fd) })
}
