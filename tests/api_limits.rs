//! The control API under load, with seccomp on: many connections at once must neither kill
//! the VM (no thread may trip its filter through a library's lazy initialisation) nor
//! lock anyone out for long (every request has a deadline; connections beyond the limit
//! wait in order for a slot, then get 503).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuvm_api::server::{MAX_CONNECTIONS, MAX_WAITING, REQUEST_DEADLINE, SLOT_WAIT};
use gpuvm_tests::{api_start_instance, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
/// Scheduling slack on a loaded host.
const MARGIN: Duration = Duration::from_secs(3);

/// A running guest (memloop, forever) behind an API socket.
struct Vm {
    process: SpawnedProcess,
    socket: PathBuf,
}

impl Vm {
    fn start(scratch: &Scratch) -> Vm {
        let socket = scratch.path("api.sock");
        let mut process = SpawnedProcess::gpuvm(&[
            "run",
            "--api-sock",
            socket.to_str().expect("utf-8 path"),
            "--memory",
            "256M",
            "--cmdline",
            "memloop 64M 1 0",
        ]);
        wait_for_api_socket(&mut process, &socket);
        api_start_instance(&socket);
        process.wait_for_stdout(" ok checksum=", LIMIT);
        Vm { process, socket }
    }

    /// Panics with the output if gpuvm has ended.
    fn assert_running(&mut self, when: &str) {
        if let Some(status) = self.process.try_status() {
            panic!(
                "gpuvm ended {when}: {status}\n--- stderr\n{}",
                self.process.stderr()
            );
        }
    }

    /// Panics about `what`, with gpuvm's exit and output if it is ending.
    fn fail(&mut self, what: &str) -> ! {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            self.assert_running(what);
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{what} (gpuvm still running)")
    }

    /// `count` new connections; gpuvm must accept them.
    fn connect(&mut self, count: usize) -> Vec<UnixStream> {
        (0..count)
            .map(|_| {
                connect(&self.socket)
                    .unwrap_or_else(|error| self.fail(&format!("connect: {error}")))
            })
            .collect()
    }

    /// Takes every connection slot, each with an answered request; returns the connections.
    fn hold_every_slot(&mut self, what: &str) -> Vec<UnixStream> {
        let mut held = self.connect(MAX_CONNECTIONS);
        for stream in &mut held {
            self.expect_ok(stream, what);
        }
        held
    }

    /// `GET /` on a kept-alive connection must answer 200.
    fn expect_ok(&mut self, stream: &mut UnixStream, what: &str) {
        let answer = get(stream, false).ok().and_then(|()| read_answer(stream));
        if answer.as_ref().map(|a| a.0) != Some(200) {
            self.fail(&format!("{what}: {answer:?}"));
        }
    }

    /// The guest still makes progress: a new memloop line appears.
    fn assert_guest_runs(&mut self) {
        let lines = self.process.stdout().matches(" ok checksum=").count();
        self.process
            .wait_until("another memloop iteration", LIMIT, |p| {
                p.stdout().matches(" ok checksum=").count() > lines
            });
    }
}

/// A connection with a read limit, so no test can hang on it.
fn connect(socket: &Path) -> std::io::Result<UnixStream> {
    let stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(LIMIT))?;
    Ok(stream)
}

fn get(stream: &mut UnixStream, close: bool) -> std::io::Result<()> {
    let connection = if close { "close" } else { "keep-alive" };
    stream.write_all(format!("GET / HTTP/1.1\r\nConnection: {connection}\r\n\r\n").as_bytes())
}

/// Reads one answer (head and Content-Length body); its status and body, or None when
/// the server closed without answering.
fn read_answer(stream: &mut UnixStream) -> Option<(u16, String)> {
    let mut data = Vec::new();
    let mut byte = [0u8; 1];
    while !data.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => data.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&data).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_string())
        })
        .map_or(Some(0), |v| v.parse().ok())?;
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).ok()?;
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// One `GET /` on a new connection, closed after the answer; None if the connection
/// ended without one.
fn get_once(socket: &Path) -> Option<(u16, String)> {
    let mut stream = connect(socket).ok()?;
    // A refused connection may be answered and closed before the request is written.
    let _ = get(&mut stream, true);
    read_answer(&mut stream)
}

/// Issue 12, item 1: holding the connection limit open (each on its own thread, each
/// allocating) plus a burst of short connections used to kill the VM (glibc malloc
/// created arenas for the new threads and read /sys under the api filter: exit 148).
#[test]
fn held_and_concurrent_connections_keep_the_vm_running() {
    let scratch = Scratch::new("api_limits", "burst");
    let mut vm = Vm::start(&scratch);
    let mut held = vm.hold_every_slot("held connection");
    vm.assert_running("with the connection limit held");

    // The held connections stay busy (a request well within every deadline), so all 100
    // short ones are beyond the limit: each waits at most SLOT_WAIT and gets 503.
    let burst: Vec<_> = (0..100)
        .map(|_| {
            let socket = vm.socket.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                (get_once(&socket), started.elapsed())
            })
        })
        .collect();
    let busy_until = Instant::now() + SLOT_WAIT + MARGIN;
    while Instant::now() < busy_until {
        for stream in &mut held {
            vm.expect_ok(stream, "a held connection during the burst");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for thread in burst {
        let (answer, took) = thread.join().expect("burst thread");
        let (status, body) =
            answer.unwrap_or_else(|| vm.fail("a connection beyond the limit got no answer"));
        assert_eq!(status, 503, "beyond the limit: {body}");
        assert!(body.contains("fault_message"), "{body}");
        assert!(took < SLOT_WAIT + MARGIN, "a 503 came after {took:?}");
    }
    vm.assert_running("after the burst");

    // Freed slots serve again, and the guest never stopped.
    drop(held);
    let started = Instant::now();
    loop {
        match get_once(&vm.socket) {
            Some((200, body)) => {
                assert!(body.contains("Running"), "{body}");
                break;
            }
            other => assert!(
                started.elapsed() < REQUEST_DEADLINE + MARGIN,
                "after the held connections closed: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    vm.assert_guest_runs();
    vm.assert_running("at the end");
}

/// Issue 12, item 1, the queue's bound: with every slot and every waiting place taken, a
/// further connection gets 503 at once.
#[test]
fn a_connection_beyond_slots_and_queue_gets_503_at_once() {
    let scratch = Scratch::new("api_limits", "full");
    let mut vm = Vm::start(&scratch);
    let _held = vm.hold_every_slot("a held connection");
    // Silent connections: they wait for a slot.
    let _waiting: Vec<UnixStream> = vm.connect(MAX_WAITING);
    let started = Instant::now();
    let answer = get_once(&vm.socket);
    assert_eq!(answer.as_ref().map(|a| a.0), Some(503), "{answer:?}");
    assert!(
        started.elapsed() < MARGIN,
        "503 after {:?}",
        started.elapsed()
    );
    vm.assert_running("with slots and queue full");
}

/// Issue 12, item 7: clients that send a byte at a time (never silent long enough for an
/// idle timeout) and reconnect as soon as they are dropped must not lock a legitimate
/// client out for longer than the request deadline.
#[test]
fn slow_clients_cannot_hold_the_api() {
    let scratch = Scratch::new("api_limits", "slowloris");
    let mut vm = Vm::start(&scratch);
    let stop = Arc::new(AtomicBool::new(false));
    let trickle = b"GET / HTTP/1.1\r\nX-Slow: "
        .iter()
        .copied()
        .chain(std::iter::repeat(b'a'));
    let slow: Vec<_> = (0..MAX_CONNECTIONS)
        .map(|_| {
            let socket = vm.socket.clone();
            let stop = stop.clone();
            let trickle = trickle.clone();
            std::thread::spawn(move || {
                // How long each connection was held before the server dropped it.
                let mut held = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let Ok(mut stream) = connect(&socket) else {
                        break;
                    };
                    let started = Instant::now();
                    for byte in trickle.clone().take(4000) {
                        if stop.load(Ordering::SeqCst) || stream.write_all(&[byte]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    if !stop.load(Ordering::SeqCst) {
                        held.push(started.elapsed());
                    }
                }
                held
            })
        })
        .collect();
    // Let every slow client take its slot.
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    let answer = get_once(&vm.socket);
    let waited = started.elapsed();
    // Long enough for every first slow connection to have been dropped.
    std::thread::sleep((REQUEST_DEADLINE + MARGIN).saturating_sub(waited));
    stop.store(true, Ordering::SeqCst);
    let held: Vec<Duration> = slow
        .into_iter()
        .flat_map(|t| t.join().expect("slow client"))
        .collect();
    vm.assert_running("with slow clients");
    assert_eq!(
        answer.as_ref().map(|a| a.0),
        Some(200),
        "legitimate request among slow clients: {answer:?}"
    );
    assert!(
        waited < REQUEST_DEADLINE + MARGIN,
        "the legitimate request waited {waited:?}"
    );
    assert!(!held.is_empty(), "no slow connection was ever dropped");
    let longest = held.iter().max().expect("one");
    assert!(
        *longest < REQUEST_DEADLINE + MARGIN,
        "a slow connection was held for {longest:?}"
    );
}

/// Issue 31: with 300 idle connections held (every slot, the whole queue, and more), a
/// new client that writes its request only after the server has answered it still gets
/// the documented 503, with Retry-After, instead of EPIPE on its write or ECONNRESET on
/// its read.
#[test]
fn a_client_beyond_300_idle_connections_reads_503_not_a_reset() {
    let scratch = Scratch::new("api_limits", "idle-300");
    let mut vm = Vm::start(&scratch);
    let _idle: Vec<UnixStream> = vm.connect(300);
    // The server answers and refuses at accept; give it time to reach the new one.
    std::thread::sleep(Duration::from_millis(300));
    let mut stream =
        connect(&vm.socket).unwrap_or_else(|error| vm.fail(&format!("connect: {error}")));
    std::thread::sleep(Duration::from_millis(300));
    if let Err(error) = get(&mut stream, true) {
        vm.fail(&format!("writing the request failed: {error}"));
    }
    let mut text = String::new();
    if let Err(error) = stream.read_to_string(&mut text) {
        vm.fail(&format!(
            "reading the answer failed: {error} (after {text:?})"
        ));
    }
    assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
    assert!(text.contains("\r\nRetry-After: "), "{text}");
    vm.assert_running("with 300 idle connections");
}
