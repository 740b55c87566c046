//! NVSwitch shared-mode fabric partitions: before any GPU of the VM is attached, the
//! host's fabric manager is asked to activate the VM's partition (the GPUs' NVLinks are
//! trained and routed through the NVSwitches); after the VM ends, or when its start
//! fails, it is asked to deactivate it.
//!
//! Two ways to reach the manager (see docs/gpu-hosts.md):
//! - a command: `CMD activate ID` / `CMD deactivate ID`, exit status 0 for success, its
//!   standard error quoted in the error otherwise;
//! - a Unix socket: one JSON request per line, `{"op":"activate","partition":ID}`,
//!   answered by one line, `{"ok":true}` or `{"ok":false,"error":"..."}`.
//!
//! Each request has a deadline ([`DEFAULT_TIMEOUT`] unless configured).
//!
//! The VMM thread runs under a seccomp filter that allows neither `fork` nor `execve`,
//! and `--jail` may chroot it and drop its privileges, so the end of the VM cannot start
//! a command. The command form therefore starts a small helper process at activation,
//! before any filter or jail: a shell that waits for a line on its standard input (or
//! for gpuvm's end, if gpuvm is killed), then runs `CMD deactivate ID` under the deadline
//! and reports its status on a pipe. The socket form keeps its connection for the VM's
//! life and sends the deactivation on it (reconnecting once if the manager closed it).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the manager may take to answer one request, unless configured.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How gpuvm reaches the fabric manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FabricManager {
    /// A program run as `PROGRAM activate ID` / `PROGRAM deactivate ID`.
    Command(PathBuf),
    /// A Unix socket speaking one JSON request per line.
    Socket(PathBuf),
}

/// A VM's fabric partition: which one, through which manager, with what deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricPartition {
    pub partition: u32,
    pub manager: FabricManager,
    pub timeout: Duration,
}

/// Which request went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricOp {
    Activate,
    Deactivate,
}

impl FabricOp {
    fn word(self) -> &'static str {
        match self {
            FabricOp::Activate => "activate",
            FabricOp::Deactivate => "deactivate",
        }
    }
}

impl std::fmt::Display for FabricOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.word())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("fabric partition {partition}: cannot {op} it: the fabric manager ({manager}) cannot be reached: {source}")]
    Unreachable {
        partition: u32,
        op: FabricOp,
        manager: String,
        source: std::io::Error,
    },
    #[error(
        "fabric partition {partition}: the fabric manager ({manager}) refused to {op} it: {reason}"
    )]
    Refused {
        partition: u32,
        op: FabricOp,
        manager: String,
        reason: String,
    },
    #[error("fabric partition {partition}: the fabric manager ({manager}) did not {op} it within {timeout:?}")]
    Timeout {
        partition: u32,
        op: FabricOp,
        manager: String,
        timeout: Duration,
    },
    #[error("fabric partition {partition}: the fabric manager ({manager}) answered the {op} request with something gpuvm cannot read: {answer}")]
    BadAnswer {
        partition: u32,
        op: FabricOp,
        manager: String,
        answer: String,
    },
}

impl FabricPartition {
    fn manager_name(&self) -> String {
        match &self.manager {
            FabricManager::Command(path) => format!("command {}", path.display()),
            FabricManager::Socket(path) => format!("socket {}", path.display()),
        }
    }

    fn unreachable(&self, op: FabricOp, source: std::io::Error) -> FabricError {
        FabricError::Unreachable {
            partition: self.partition,
            op,
            manager: self.manager_name(),
            source,
        }
    }

    fn refused(&self, op: FabricOp, reason: String) -> FabricError {
        FabricError::Refused {
            partition: self.partition,
            op,
            manager: self.manager_name(),
            reason,
        }
    }

    fn timed_out(&self, op: FabricOp) -> FabricError {
        FabricError::Timeout {
            partition: self.partition,
            op,
            manager: self.manager_name(),
            timeout: self.timeout,
        }
    }

    fn bad_answer(&self, op: FabricOp, answer: String) -> FabricError {
        FabricError::BadAnswer {
            partition: self.partition,
            op,
            manager: self.manager_name(),
            answer,
        }
    }

    /// Asks the manager to activate the partition. Call it before any GPU is attached,
    /// and before seccomp filters or the jail: it may start processes and open sockets.
    pub fn activate(&self) -> Result<ActivePartition, FabricError> {
        let link = match &self.manager {
            FabricManager::Command(program) => {
                self.run_command(program, FabricOp::Activate)?;
                // The helper starts only once the partition is active: if it cannot be
                // started, deactivate now rather than leave the partition behind.
                match DeactivateHelper::start(program, self.partition, self.timeout) {
                    Ok(helper) => Link::Helper(helper),
                    Err(error) => {
                        let error = self.unreachable(FabricOp::Deactivate, error);
                        if let Err(undo) = self.run_command(program, FabricOp::Deactivate) {
                            log::error!("{undo}");
                        }
                        return Err(error);
                    }
                }
            }
            FabricManager::Socket(path) => {
                let mut stream = self.connect(path, FabricOp::Activate)?;
                self.socket_request(&mut stream, FabricOp::Activate)?;
                Link::Socket(Some(stream))
            }
        };
        log::info!(
            "fabric partition {} activated by the fabric manager ({})",
            self.partition,
            self.manager_name()
        );
        Ok(ActivePartition {
            partition: self.clone(),
            link,
            done: false,
        })
    }

    /// `PROGRAM op ID` with the deadline; before seccomp only.
    fn run_command(&self, program: &Path, op: FabricOp) -> Result<(), FabricError> {
        let mut child = Command::new(program)
            .arg(op.word())
            .arg(self.partition.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| self.unreachable(op, e))?;
        // Read standard error on the side so a chatty manager cannot fill the pipe and
        // stall while gpuvm waits for its exit.
        let stderr = child.stderr.take().map(|mut stderr| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = stderr.read_to_string(&mut text);
                text
            })
        });
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(self.timed_out(op));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(error) => return Err(self.unreachable(op, error)),
            }
        };
        let stderr = stderr
            .and_then(|reader| reader.join().ok())
            .unwrap_or_default();
        if status.success() {
            return Ok(());
        }
        let stderr = stderr.trim();
        Err(self.refused(
            op,
            if stderr.is_empty() {
                format!("it exited with {status}")
            } else {
                format!("it exited with {status}: {stderr}")
            },
        ))
    }

    fn connect(&self, path: &Path, op: FabricOp) -> Result<UnixStream, FabricError> {
        let stream = UnixStream::connect(path).map_err(|e| self.unreachable(op, e))?;
        stream
            .set_read_timeout(Some(self.timeout))
            .and_then(|()| stream.set_write_timeout(Some(self.timeout)))
            .map_err(|e| self.unreachable(op, e))?;
        Ok(stream)
    }

    /// One request line and its answer line on `stream`.
    fn socket_request(&self, stream: &mut UnixStream, op: FabricOp) -> Result<(), FabricError> {
        let request = serde_json::json!({ "op": op.word(), "partition": self.partition });
        let timed_out = |error: &std::io::Error| {
            matches!(
                error.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
        };
        let sent = stream.write_all(format!("{request}\n").as_bytes());
        if let Err(error) = sent {
            return Err(if timed_out(&error) {
                self.timed_out(op)
            } else {
                self.unreachable(op, error)
            });
        }
        // Byte by byte up to the newline: nothing past the answer is taken from the
        // connection, which carries the deactivation later.
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        let deadline = Instant::now() + self.timeout;
        loop {
            match stream.read(&mut byte) {
                Ok(0) => {
                    return Err(self.unreachable(
                        op,
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "it closed the connection without an answer",
                        ),
                    ))
                }
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) if line.len() >= MAX_ANSWER => {
                    return Err(self.bad_answer(op, "an answer longer than 64 KiB".into()))
                }
                Ok(_) => line.push(byte[0]),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) if timed_out(&error) || Instant::now() >= deadline => {
                    return Err(self.timed_out(op))
                }
                Err(error) => return Err(self.unreachable(op, error)),
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out(op));
            }
        }
        let text = String::from_utf8_lossy(&line).trim().to_string();
        let answer: serde_json::Value =
            serde_json::from_str(&text).map_err(|_| self.bad_answer(op, text.clone()))?;
        match answer.get("ok").and_then(serde_json::Value::as_bool) {
            Some(true) => Ok(()),
            Some(false) => Err(self.refused(
                op,
                answer
                    .get("error")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("no reason given")
                    .to_string(),
            )),
            None => Err(self.bad_answer(op, text)),
        }
    }
}

/// Longest answer line gpuvm reads from a manager.
const MAX_ANSWER: usize = 64 << 10;

/// How the deactivation reaches the manager.
enum Link {
    Helper(DeactivateHelper),
    /// The activation's connection (None once used).
    Socket(Option<UnixStream>),
}

/// An activated partition; [`ActivePartition::deactivate`] at the VM's end (dropping it
/// deactivates too, with any error logged).
pub struct ActivePartition {
    partition: FabricPartition,
    link: Link,
    done: bool,
}

impl ActivePartition {
    pub fn partition(&self) -> u32 {
        self.partition.partition
    }

    /// Asks the manager to deactivate the partition. Works under the VMM thread's
    /// seccomp filter and inside the jail (see the module's description).
    pub fn deactivate(mut self) -> Result<(), FabricError> {
        self.deactivate_once()
    }

    fn deactivate_once(&mut self) -> Result<(), FabricError> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let partition = &self.partition;
        let op = FabricOp::Deactivate;
        let result = match &mut self.link {
            Link::Helper(helper) => helper.run(partition),
            Link::Socket(kept) => {
                let kept_answer = match kept.take() {
                    Some(mut stream) => partition.socket_request(&mut stream, op),
                    None => Err(partition.unreachable(op, std::io::Error::other("no connection"))),
                };
                match kept_answer {
                    // The manager may close connections after each answer: ask again on
                    // a new one.
                    Err(FabricError::Unreachable { .. }) => match &partition.manager {
                        FabricManager::Socket(path) => partition
                            .connect(path, op)
                            .and_then(|mut stream| partition.socket_request(&mut stream, op)),
                        FabricManager::Command(_) => kept_answer,
                    },
                    other => other,
                }
            }
        };
        if result.is_ok() {
            log::info!(
                "fabric partition {} deactivated by the fabric manager ({})",
                partition.partition,
                partition.manager_name()
            );
        }
        result
    }
}

impl Drop for ActivePartition {
    fn drop(&mut self) {
        if let Err(error) = self.deactivate_once() {
            log::error!("{error}");
        }
    }
}

/// The line the helper ends with: the command's exit status.
const STATUS_MARK: &str = "gpuvm-fabric-status ";
/// The line the helper's watchdog prints when it killed the command.
const TIMEOUT_MARK: &str = "gpuvm-fabric-timeout";

/// Waits for a line (or end of file) on standard input, then runs `"$1" deactivate "$2"`
/// with a watchdog that kills it after "$3" seconds, and reports. SIGPIPE is ignored so
/// the command still completes when gpuvm is gone and nobody reads its output.
const HELPER_SCRIPT: &str = r#"trap '' PIPE
read -r _ || true
exec 2>&1
"$1" deactivate "$2" </dev/null &
pid=$!
( sleep "$3"; kill -9 "$pid" 2>/dev/null && echo gpuvm-fabric-timeout ) &
watchdog=$!
wait "$pid"
status=$?
kill "$watchdog" 2>/dev/null
echo "gpuvm-fabric-status $status"
"#;

/// The process that runs the deactivation command for a VM whose own threads cannot.
/// Its exit status is collected when gpuvm ends: the VMM thread's filter has no wait4.
struct DeactivateHelper {
    _child: Child,
    stdin: Option<ChildStdin>,
    stdout: ChildStdout,
}

impl DeactivateHelper {
    fn start(program: &Path, partition: u32, timeout: Duration) -> std::io::Result<Self> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(HELPER_SCRIPT)
            .arg("gpuvm-fabric-deactivate")
            .arg(program)
            .arg(partition.to_string())
            .arg(timeout.as_secs().max(1).to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("the helper has no output pipe"))?;
        Ok(DeactivateHelper {
            _child: child,
            stdin,
            stdout,
        })
    }

    /// Tells the helper to deactivate and reads its report: only `write`, `poll` and
    /// `read` on pipes, which the VMM thread's filter allows.
    fn run(&mut self, partition: &FabricPartition) -> Result<(), FabricError> {
        let op = FabricOp::Deactivate;
        if let Some(mut stdin) = self.stdin.take() {
            // A helper that already left is found out below, by its missing report.
            let _ = stdin.write_all(b"deactivate\n");
        }
        // The helper's own watchdog ends the command at the deadline; a little longer
        // here covers the shell's start.
        let deadline = Instant::now() + partition.timeout + Duration::from_secs(5);
        let mut output = Vec::new();
        let mut chunk = [0u8; 4096];
        let fd = self.stdout.as_raw_fd();
        loop {
            let text = String::from_utf8_lossy(&output).to_string();
            if let Some(at) = text.find(STATUS_MARK) {
                let rest = &text[at + STATUS_MARK.len()..];
                if let Some(end) = rest.find('\n') {
                    let said = text[..at].replace(TIMEOUT_MARK, "");
                    if text.contains(TIMEOUT_MARK) {
                        return Err(partition.timed_out(op));
                    }
                    return match rest[..end].trim() {
                        "0" => Ok(()),
                        status => Err(partition.refused(
                            op,
                            format!("it exited with status {status}: {}", said.trim()),
                        )),
                    };
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(partition.timed_out(op));
            }
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd we own, for the helper's output pipe, which is open.
            let ready = unsafe { libc::poll(&mut poll, 1, left.as_millis().min(60_000) as i32) };
            if ready < 0 {
                let error = std::io::Error::last_os_error();
                if error.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(partition.unreachable(op, error));
            }
            if ready == 0 {
                continue;
            }
            match self.stdout.read(&mut chunk) {
                Ok(0) => {
                    return Err(partition.unreachable(
                        op,
                        std::io::Error::other(format!(
                            "the deactivation helper ended without a report: {}",
                            String::from_utf8_lossy(&output).trim()
                        )),
                    ))
                }
                Ok(read) => {
                    output.extend_from_slice(&chunk[..read]);
                    // Keep the end: the report comes last.
                    if output.len() > MAX_ANSWER {
                        output.drain(..output.len() - MAX_ANSWER);
                    }
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(partition.unreachable(op, error)),
            }
        }
    }
}
