//! `gpuvm update`: hands a running VM to a new gpuvm binary (live update), and the new
//! binary's side, the hidden `gpuvm update-receive`.
//!
//! The caller spawns the new binary, not the running gpuvm: the running VMM thread's
//! seccomp filter allows no fork or exec (and should not), so `gpuvm update` binds a
//! hand-over socket in a private directory, starts `NEW update-receive --old-pid P` with
//! it (the new binary listens on it), then asks the running gpuvm over its API socket
//! (PUT /vmm/update) to connect there and hand the VM over. Each side checks who is at
//! the other end (SO_PEERCRED; gpuvm_vmm::update::socket). The running gpuvm needs from
//! its filter a Unix socket, connect, sendmsg, recvmsg and socket timeouts, which it has
//! for vfio-user devices already, and `getsockopt(SO_PEERCRED)` and `geteuid`.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use gpuvm_api::server::{ApiServer, StartGate};
use gpuvm_vmm::config::VmConfig;
use gpuvm_vmm::controller::ApiController;
use gpuvm_vmm::update::receive::{self, Outcome};
use gpuvm_vmm::update::socket::{HandOverSocket, ListenedHandOver};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::args::{ReceiveArgs, ReportArgs, ServedApi, UpdateArgs};
use crate::front_end::FrontEnd;
use crate::update_jail::Confinement;
use crate::CliError;

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
    // Where the running gpuvm is confined (root, namespaces, cgroups, limits, ids): the
    // new one is started there (update_jail).
    let confinement = Confinement::of(pid)?;
    let api_sock = match &args.api_sock {
        Some(path) => path.clone(),
        None => api_socket_of(pid, &confinement)
            .or_else(|error| handed_over_api_socket_of(pid, &confinement).ok_or(error))?,
    };
    let binary = args.binary.clone().unwrap_or_else(|| proc_dir.join("exe"));
    let served = served_api_of(pid)?;
    // In a jail, the new binary is copied in (as the jailer copies its exec file) and run
    // from there; the hand-over socket is made inside it too, the only place the jailed
    // gpuvm can reach, and given to its user.
    let staged = confinement
        .jailed()
        .then(|| confinement.copy_in(&binary))
        .transpose()?;
    let program = match &staged {
        Some(name) => Path::new("/").join(name),
        None => binary.clone(),
    };
    let started = start_receiver(&confinement, &program, pid, &api_sock, &args, &served);
    let (handover, mut child, token) = match started {
        Ok(started) => started,
        Err(error) => {
            if let Some(staged) = &staged {
                confinement.discard(staged);
            }
            return Err(error);
        }
    };
    let outcome = hand_over(
        &args,
        pid,
        &binary,
        &api_sock,
        (handover, token),
        &mut child,
        &confinement,
    );
    if let Some(staged) = &staged {
        match &outcome {
            // The jail's binary is the one that runs the VM now.
            Ok(_) => confinement.install(staged, child.id())?,
            // The running process keeps its binary; the new one may still be running
            // from the copy (the old gpuvm died during the hand-over): left then.
            Err(_) if child.try_wait().ok().flatten().is_none() => {}
            Err(_) => confinement.discard(staged),
        }
    }
    outcome
}

/// Makes the hand-over socket where the running gpuvm can reach it and starts the new
/// gpuvm `program` in `confinement`, listening on it.
fn start_receiver(
    confinement: &Confinement,
    program: &Path,
    pid: i32,
    api_sock: &Path,
    args: &UpdateArgs,
    served: &(ServedApi, String),
) -> Result<(ListenedHandOver, std::process::Child, Option<String>), CliError> {
    // A fresh directory only the running gpuvm's user can enter holds the socket: no one
    // else can connect to it, bind one of their own at its path or put anything there
    // beforehand.
    let parent = match confinement.jailed() {
        true => confinement.root_path(),
        false => std::env::temp_dir(),
    };
    let handover = HandOverSocket::bind(&parent)
        .map_err(|e| CliError::Other(format!("cannot make the hand-over socket: {e}")))?;
    if let Some((uid, gid)) = confinement.ids() {
        handover
            .give_to(uid, gid)
            .map_err(|e| CliError::Other(format!("cannot make the hand-over socket: {e}")))?;
    }
    // A jail need not hold /dev/kvm (gpuvm's own --chroot): the new gpuvm is given it.
    let kvm = match confinement.jailed() {
        true => Some(
            std::fs::File::options()
                .read(true)
                .write(true)
                .open("/dev/kvm")
                .map_err(|e| {
                    CliError::Other(format!("cannot open /dev/kvm for the new gpuvm: {e}"))
                })?,
        ),
        false => None,
    };
    // A new gpuvm in another pid namespace than the old one knows the old one's offer by a
    // secret only the two get (and the old one its listener by the socket alone).
    let token = confinement.old_pidfd().map(|_| new_token()).transpose()?;
    let token_pipe = token.as_deref().map(token_pipe).transpose()?;
    let mut child = spawn_receiver(
        program,
        Inherited {
            handover: &handover,
            kvm: kvm.as_ref(),
            old: confinement.old_pidfd().zip(token_pipe.as_ref()),
        },
        confinement,
        pid,
        api_sock,
        args.timeout_ms,
        served,
    )?;
    // The new gpuvm listens on the socket itself, so that the old one, once connected,
    // sees who will run its VM (SO_PEERCRED). Until then nobody can connect, so the old
    // one is asked only once it does.
    let timeout = Duration::from_millis(args.timeout_ms);
    if let Err(error) = wait_listening(&handover, &mut child, program, timeout) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(error);
    }
    Ok((handover.release(), child, token))
}

/// Asks the running gpuvm `pid` to hand its VM to `child`, listening on `handover`.
fn hand_over(
    args: &UpdateArgs,
    pid: i32,
    binary: &Path,
    api_sock: &Path,
    (handover, token): (ListenedHandOver, Option<String>),
    child: &mut std::process::Child,
    confinement: &Confinement,
) -> Result<ExitCode, CliError> {
    test_delay_request();
    if let Ok(Some(status)) = child.try_wait() {
        return Err(CliError::Other(format!(
            "the new gpuvm {} ended before the running one was asked ({status}); the VM was \
             not touched",
            binary.display()
        )));
    }
    let mut body = serde_json::json!({
        // As the running gpuvm names it: inside its jail, if it has one.
        "handover_socket": confinement.inside(handover.path()),
        "timeout_ms": args.timeout_ms,
    });
    // The running gpuvm offers the VM to this child only, whoever else listens: by its
    // pid; where the two are in different pid namespaces, the token (which the child has
    // too) goes with the offer instead, and the child takes no other.
    let by_token = token.is_some();
    match token {
        Some(token) => body["handover_token"] = token.into(),
        None => body["receiver_pid"] = child.id().into(),
    }
    let body = body.to_string();
    let started = Instant::now();
    // The running gpuvm names its socket as it bound it: inside its jail, or before.
    let reachable = confinement.reachable(api_sock).ok_or_else(|| {
        CliError::Other(format!(
            "process {pid}'s API socket {} cannot be reached from here",
            api_sock.display()
        ))
    })?;
    let answer = gpuvm_api::client::request(&reachable, "PUT", "/vmm/update", Some(&body));
    drop(handover);
    match answer {
        Ok(answer) if answer.is_success() => {
            let value: serde_json::Value = serde_json::from_str(&answer.body).unwrap_or_default();
            // The old gpuvm reports whom it handed the VM to as the kernel names the
            // socket's listener: the process started here, or something is badly wrong.
            if !by_token && value["new_pid"].as_u64() != Some(u64::from(child.id())) {
                return Err(CliError::Other(format!(
                    "process {pid} handed its VM to process {}, not to the new gpuvm this \
                     update started (process {})",
                    value["new_pid"],
                    child.id()
                )));
            }
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
        Err(error) => Err(no_answer(pid, child, &error)),
    }
}

/// A fresh hand-over token: 32 random bytes in hex.
fn new_token() -> Result<String, CliError> {
    let mut bytes = [0u8; 32];
    // SAFETY: getrandom(2) writes at most `bytes.len()` bytes into `bytes`, a live local.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got != bytes.len() as isize {
        return Err(CliError::Other(format!(
            "cannot draw a hand-over token: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A pipe holding `token` (its write end closed), for the new gpuvm to inherit and read:
/// the token never shows on a command line or in an environment.
fn token_pipe(token: &str) -> Result<OwnedFd, CliError> {
    let mut ends = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into `ends`, a live local.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(CliError::Other(format!(
            "cannot make a pipe for the hand-over token: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: pipe2 returned these two descriptors, owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    // 64 bytes: far below a pipe's buffer, so the write cannot block.
    std::io::Write::write_all(&mut std::fs::File::from(write), token.as_bytes())
        .map_err(|e| CliError::Other(format!("cannot write the hand-over token: {e}")))?;
    Ok(read)
}

/// Test hook: `gpuvm update` waits this many milliseconds between the new gpuvm listening
/// and asking the old one to connect, so that a test can connect first.
const DELAY_REQUEST_HOOK: &str = "GPUVM_TEST_UPDATE_DELAY_REQUEST_MS";

fn test_delay_request() {
    if let Some(millis) = std::env::var(DELAY_REQUEST_HOOK)
        .ok()
        .and_then(|value| value.parse::<u64>().ok())
    {
        log::warn!("{DELAY_REQUEST_HOOK}={millis}: waiting before asking the running gpuvm");
        std::thread::sleep(Duration::from_millis(millis));
    }
}

/// Waits (at most `timeout`) until the new gpuvm (`child`) listens on `handover`; an error
/// if it ends first.
fn wait_listening(
    handover: &HandOverSocket,
    child: &mut std::process::Child,
    binary: &Path,
    timeout: Duration,
) -> Result<(), CliError> {
    let deadline = Instant::now() + timeout;
    loop {
        if handover
            .is_listening()
            .map_err(|e| CliError::Other(e.to_string()))?
        {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(CliError::Other(format!(
                "the new gpuvm {} ended before it listened on the hand-over socket ({status}); \
                 the VM was not touched",
                binary.display()
            )));
        }
        if Instant::now() >= deadline {
            return Err(CliError::Other(format!(
                "the new gpuvm {} did not listen on the hand-over socket within {timeout:?}; \
                 the VM was not touched",
                binary.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
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

/// The descriptors the new gpuvm inherits: the bound hand-over socket, for a jail
/// /dev/kvm, and for a new gpuvm in another pid namespace a pidfd of the old one and a
/// pipe holding the hand-over token.
struct Inherited<'a> {
    handover: &'a HandOverSocket,
    kvm: Option<&'a std::fs::File>,
    old: Option<(&'a OwnedFd, &'a OwnedFd)>,
}

/// Starts `binary update-receive` with the `inherited` descriptors, in its own process
/// group (a signal to the caller's group must not reach the VM's new home), inside the
/// old process's `confinement` (its working directory among it: Firecracker's API
/// resolves relative paths against it, and so does anything else relative the new
/// process is given later).
fn spawn_receiver(
    binary: &Path,
    inherited: Inherited<'_>,
    confinement: &Confinement,
    old_pid: i32,
    api_sock: &Path,
    timeout_ms: u64,
    served: &(ServedApi, String),
) -> Result<std::process::Child, CliError> {
    let (api, instance_id) = served;
    let (handover, kvm) = (
        inherited.handover.fd().as_raw_fd(),
        inherited.kvm.map(AsRawFd::as_raw_fd),
    );
    let old = inherited
        .old
        .map(|(pidfd, token)| (pidfd.as_raw_fd(), token.as_raw_fd()));
    let fds: Vec<i32> = std::iter::once(handover)
        .chain(kvm)
        .chain(old.into_iter().flat_map(|(pidfd, token)| [pidfd, token]))
        .collect();
    for &fd in &fds {
        // SAFETY: F_SETFD on a descriptor this process owns: it survives the exec below.
        // This process starts no other child meanwhile (it has one thread).
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
            return Err(CliError::Other(format!(
                "cannot pass a descriptor on to the new gpuvm: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    let mut command = Command::new(binary);
    command
        .arg("update-receive")
        .arg("--handover-fd")
        .arg(handover.to_string())
        .arg("--old-pid")
        .arg(old_pid.to_string())
        .arg("--api-sock")
        .arg(api_sock)
        .arg("--timeout-ms")
        .arg(timeout_ms.to_string())
        .arg("--api")
        .arg(
            api.to_possible_value()
                .expect("no skipped variants")
                .get_name(),
        )
        .arg("--instance-id")
        .arg(instance_id);
    if let Some(kvm) = kvm {
        command.arg("--kvm-fd").arg(kvm.to_string());
    }
    if let Some((pidfd, token)) = old {
        command
            .arg("--old-pidfd")
            .arg(pidfd.to_string())
            .arg("--token-fd")
            .arg(token.to_string());
    }
    confinement.enter_pid_namespace()?;
    let entering = confinement.entering();
    // SAFETY: `enter` makes system calls only, on descriptors `confinement` keeps open
    // until after the spawn (see update_jail), as a pre-exec hook must.
    unsafe {
        command.pre_exec(move || entering.enter());
    }
    let spawned = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| {
            CliError::Other(format!(
                "cannot start {} in process {old_pid}'s confinement: {e}",
                binary.display()
            ))
        });
    for fd in fds {
        // SAFETY: as above; back to close-on-exec, so no later child inherits it.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    spawned
}

/// The API gpuvm process `pid` serves on its socket and, for Firecracker's, its instance
/// id, from its command line: a front end's (`firecracker --id X ...`, `cloud-hypervisor
/// ...`, `gpuvm run ...`) or, once it took a VM over itself, `gpuvm update-receive --api A
/// --instance-id X`, which says them as this function passed them on.
fn served_api_of(pid: i32) -> Result<(ServedApi, String), CliError> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| CliError::Other(format!("cannot read process {pid}'s command line: {e}")))?;
    let raw = raw.strip_suffix(&[0]).unwrap_or(&raw);
    let argv: Vec<OsString> = raw
        .split(|byte| *byte == 0)
        .map(|arg| OsString::from_vec(arg.to_vec()))
        .collect();
    served_api(&argv).map_err(|e| CliError::Other(format!("process {pid}'s command line: {e}")))
}

/// [`served_api_of`] for the command line `argv`.
fn served_api(argv: &[OsString]) -> Result<(ServedApi, String), String> {
    let default_id = || crate::firecracker::DEFAULT_ID.to_string();
    if argv.get(1).is_some_and(|arg| arg == "update-receive") {
        let value = |flag: &str| {
            let at = argv.iter().position(|arg| arg == flag)?;
            argv.get(at + 1)?.to_str().map(str::to_string)
        };
        // Its own parser's names for the APIs (clap's, as `update-receive` read them).
        let api = match value("--api") {
            None => ServedApi::Gpuvm,
            Some(name) => ServedApi::from_str(&name, false)
                .map_err(|_| format!("an API this gpuvm does not serve ({name})"))?,
        };
        return Ok((api, value("--instance-id").unwrap_or_else(default_id)));
    }
    match crate::front_end::select(argv).map_err(|e| e.to_string())? {
        FrontEnd::Firecracker => {
            let args = crate::front_end::utf8_args(argv, FrontEnd::Firecracker)?;
            Ok((
                ServedApi::Firecracker,
                crate::firecracker::instance_id(&args)?,
            ))
        }
        FrontEnd::Gpuvm | FrontEnd::CloudHypervisor | FrontEnd::Jailer => {
            Ok((ServedApi::Gpuvm, default_id()))
        }
    }
}

/// The API socket a gpuvm that took a VM over (`update-receive --api-sock PATH`) serves:
/// the listening socket handed to it belongs to the network namespace the first gpuvm made
/// it in, which need not be this process's (nor its own), so /proc/PID/net/unix may not
/// list it. The path its own command line names, if a socket is there.
fn handed_over_api_socket_of(pid: i32, confinement: &Confinement) -> Option<PathBuf> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv: Vec<OsString> = raw
        .strip_suffix(&[0])
        .unwrap_or(&raw)
        .split(|byte| *byte == 0)
        .map(|arg| OsString::from_vec(arg.to_vec()))
        .collect();
    let path = receiver_api_sock(&argv)?;
    confinement.reachable(&path).map(|_| path)
}

/// The `--api-sock` of an `update-receive` command line `argv`.
fn receiver_api_sock(argv: &[OsString]) -> Option<PathBuf> {
    if argv.get(1).is_none_or(|arg| arg != "update-receive") {
        return None;
    }
    let at = argv.iter().position(|arg| arg == "--api-sock")?;
    argv.get(at + 1).map(PathBuf::from)
}

/// The API socket of gpuvm process `pid`: the one listening Unix socket with a path among
/// its descriptors (/proc/PID/fd, /proc/PID/net/unix: the table of the process's own
/// network namespace, which need not be this one's, as with a VMM Kata starts in the
/// pod's namespace).
fn api_socket_of(pid: i32, confinement: &Confinement) -> Result<PathBuf, CliError> {
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
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix"))
        .map_err(|e| CliError::Other(format!("cannot read /proc/{pid}/net/unix: {e}")))?;
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
        .filter(|path| confinement.reachable(path).is_some())
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
/// committed, and serves the API socket the old one handed over with `Commit` (or, from an
/// older gpuvm, binds its path again once the old one has gone).
pub fn receive(args: ReceiveArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    if args.api == ServedApi::Firecracker {
        // Kata's Firecracker driver finds the vCPU threads by Firecracker's names.
        gpuvm_vmm::vcpu::name_threads_as_firecracker();
    }
    // Before the filters, which allow no pidfd_open.
    let old = match (args.old_pidfd, args.token_fd) {
        (Some(pidfd), Some(token)) => {
            let pidfd = inherited(pidfd, "--old-pidfd", None)?;
            let pipe = inherited(token, "--token-fd", Some(libc::S_IFIFO))?;
            let mut token = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(pipe), &mut token)
                .map_err(|e| CliError::Other(format!("cannot read the hand-over token: {e}")))?;
            receive::OldProcess::inherited(args.old_pid, pidfd, token)
        }
        _ => receive::OldProcess::open(args.old_pid),
    }
    .map_err(refused)?;
    if let Some(fd) = args.kvm_fd {
        gpuvm_vmm::host::adopt_kvm(inherited(fd, "--kvm-fd", Some(libc::S_IFCHR))?);
    }
    args.seccomp.enable()?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let listener = inherited_listener(args.handover_fd)?;
    let mut incoming = receive::accept(&listener, old, timeout).map_err(refused)?;
    drop(listener);
    incoming.adopt_outputs().map_err(refused)?;
    incoming
        .prepare(crate::run::serial_out())
        .map_err(refused)?;
    let (mut machine, timings) = incoming.load().map_err(refused)?;
    // Nothing is served until the VM is this process's: the old one may yet take it back.
    machine.hold_devices();
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
    // The client's record came with the devices' state: its ids still name them. The MMDS
    // came with it too, and the interfaces built here answer from it.
    controller.adopt_record(&machine);
    controller.adopt_mmds(incoming.mmds());
    machine.set_run_control(controller.into_run_control());
    let outcome = incoming.ready(timeout).map_err(refused)?;
    machine.take_over_devices();
    // The old process's API socket, with the connections made during the hand-over
    // waiting in its backlog; None from an older gpuvm (or one that died before `Commit`).
    let api_listener = incoming.take_api_listener();
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
    let api_sock = args.api_sock.clone();
    // Made here, outside the API thread's filter: the session takes the working directory
    // (the old process's, which this one was started in).
    let firecracker = (args.api == ServedApi::Firecracker)
        .then(|| gpuvm_api::firecracker::Session::new(args.instance_id.clone()));
    let api = std::thread::Builder::new()
        .name("api-takeover".into())
        .spawn(move || {
            // A filter of its own before anything else: the API list plus waiting on
            // /proc, binding the socket and starting the API thread, which stacks the API
            // filter on this one (filters intersect: it ends with the API filter's rights).
            gpuvm_vmm::seccomp::apply_api_takeover().map_err(|e| e.to_string())?;
            if let Some(listener) = api_listener {
                // The same socket, served at once: it never stopped answering.
                return ApiServer::serve_handed_over(listener, &api_sock, vmm, firecracker)
                    .map_err(|e| e.to_string());
            }
            // The old process removes the API socket's file as it exits: bind it after
            // that.
            if !incoming.wait_old_exit(API_TAKEOVER_WAIT) {
                log::warn!(
                    "the old gpuvm has not exited {API_TAKEOVER_WAIT:?} after the hand-over"
                );
            }
            match firecracker {
                None => ApiServer::start(&api_sock, vmm),
                Some(session) => {
                    ApiServer::start_firecracker(&api_sock, vmm, session, StartGate::default())
                }
            }
            .map_err(|e| e.to_string())
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

/// How long the new process waits for the old one to exit before it binds the API socket
/// all the same.
const API_TAKEOVER_WAIT: Duration = Duration::from_secs(10);

/// A hand-over this process did not complete: the VM is not its to run.
fn refused(error: gpuvm_vmm::update::UpdateError) -> CliError {
    CliError::Other(format!(
        "live update: this process does not run the VM: {error}"
    ))
}

/// The hand-over socket `gpuvm update` passed as descriptor `fd`, checked to be a socket,
/// listened on here (so that the old gpuvm sees this process as its peer).
fn inherited_listener(fd: i32) -> Result<UnixListener, CliError> {
    let socket = inherited(fd, "--handover-fd", Some(libc::S_IFSOCK))?;
    gpuvm_vmm::update::socket::listen(socket).map_err(refused)
}

/// Descriptor `fd`, inherited from `gpuvm update` for this process alone as `flag`,
/// checked to be open and, where given, of file type `kind` (`S_IFSOCK`, `S_IFCHR`);
/// close-on-exec again, so no later child inherits it.
fn inherited(fd: i32, flag: &str, kind: Option<libc::mode_t>) -> Result<OwnedFd, CliError> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one stat into `stat`; its result is checked before use.
    let is_kind = fd > 2
        && unsafe { libc::fstat(fd, stat.as_mut_ptr()) } == 0
        // SAFETY: fstat succeeded, so `stat` is initialised.
        && kind.is_none_or(|kind| unsafe { stat.assume_init() }.st_mode & libc::S_IFMT == kind);
    if !is_kind {
        return Err(CliError::Other(format!(
            "{flag} {fd} is not an inherited descriptor of the right kind (gpuvm \
             update-receive is started by gpuvm update)"
        )));
    }
    // SAFETY: fcntl on a descriptor checked open just above.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: a descriptor inherited for this process alone (see `gpuvm update`); nothing
    // else here owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(argv: &[&str]) -> Result<(ServedApi, String), String> {
        served_api(&argv.iter().map(OsString::from).collect::<Vec<_>>())
    }

    #[test]
    fn a_receivers_api_socket_is_read_from_its_command_line() {
        let argv = |args: &[&str]| args.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            receiver_api_sock(&argv(&[
                "gpuvm",
                "update-receive",
                "--handover-fd",
                "3",
                "--api-sock",
                "/run/vm.sock"
            ])),
            Some(PathBuf::from("/run/vm.sock"))
        );
        assert_eq!(
            receiver_api_sock(&argv(&["gpuvm", "run", "--api-sock", "/run/vm.sock"])),
            None
        );
        assert_eq!(receiver_api_sock(&argv(&["gpuvm", "update-receive"])), None);
    }

    #[test]
    fn the_new_process_serves_the_api_the_old_command_line_chose() {
        let gpuvm = (ServedApi::Gpuvm, "anonymous-instance".to_string());
        assert_eq!(
            served(&["/usr/bin/gpuvm", "run", "--api-sock", "/a"]),
            Ok(gpuvm.clone())
        );
        assert_eq!(
            served(&["cloud-hypervisor", "--api-socket", "/a"]),
            Ok(gpuvm.clone())
        );
        assert_eq!(
            served(&["/opt/gpuvm", "--api-socket", "path=/a"]),
            Ok(gpuvm.clone())
        );
        let fc = |id: &str| Ok((ServedApi::Firecracker, id.to_string()));
        assert_eq!(
            served(&["/x/firecracker", "--api-sock", "/a", "--id", "vm7"]),
            fc("vm7")
        );
        assert_eq!(
            served(&["gpuvm", "--api-sock", "/a"]),
            fc("anonymous-instance")
        );
        assert_eq!(served(&["gpuvm", "--fc-compat", "--id", "k"]), fc("k"));
        // A process that took a VM over says what it serves on its own command line.
        let receiver = |api: &str| {
            served(&[
                "gpuvm",
                "update-receive",
                "--handover-fd",
                "3",
                "--old-pid",
                "9",
                "--api",
                api,
                "--instance-id",
                "vm7",
            ])
        };
        assert_eq!(receiver("firecracker"), fc("vm7"));
        assert_eq!(receiver("gpuvm"), Ok((ServedApi::Gpuvm, "vm7".to_string())));
        assert!(receiver("qemu").unwrap_err().contains("qemu"));
        assert!(served(&["gpuvm", "--api-sock", "/a", "--api-socket", "/b"]).is_err());
    }
}
