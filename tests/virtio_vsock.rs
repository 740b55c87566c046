//! Guest-initiated hybrid vsock end to end: the test guest's `virtio-vsock-connect`
//! workload opens connections to host CID 2 port P, which gpuvm (seccomp on, the default)
//! forwards to the Unix socket `<uds>_P` a host program listens on. The host side here
//! echoes, refuses (no listener), or hangs up midway, and checks what it received against
//! the guest's pattern.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpuvm_tests::snapshot_support::arg;
use gpuvm_tests::{RunOutput, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);
/// How long a host thread waits for the guest (the guest's own idle limit is 60 s).
const HOST_WAIT: Duration = Duration::from_secs(90);
/// The host port the guest connects to.
const PORT: u32 = 5201;
/// The workload's stream pattern: connection k sends `pattern(CONNECT_SEED + k, offset)`
/// as little-endian words (guest-images/testguest/src/virtio/vsock.rs).
const CONNECT_SEED: u64 = 0x7653_4f43_0000;
/// Per connection: more than gpuvm's 256 KiB credit window plus what the host socket
/// buffers, and than the guest's 64 KiB window.
const BYTES: usize = 1 << 20;

/// The bytes guest connection `number` sends.
fn stream_pattern(number: u32, len: usize) -> Vec<u8> {
    (0..len as u64)
        .step_by(8)
        .flat_map(|offset| {
            gpuvm_guest_images::pattern(CONNECT_SEED + u64::from(number), offset).to_le_bytes()
        })
        .take(len)
        .collect()
}

/// Which guest connection sent `data` (its first bytes identify it), if any of 1..=count.
fn connection_number(data: &[u8], count: u32) -> Option<u32> {
    let probe = data.len().min(64);
    (1..=count).find(|&number| data[..probe] == stream_pattern(number, probe)[..])
}

/// `<uds>_<port>`: where gpuvm forwards the guest's connections to `port`.
fn port_path(uds: &Path, port: u32) -> PathBuf {
    PathBuf::from(format!("{}_{port}", uds.display()))
}

fn start_vm(uds: &Path, cmdline: &str) -> SpawnedProcess {
    let vsock = format!("cid=9,uds={}", arg(uds));
    SpawnedProcess::gpuvm(&["run", "--cmdline", cmdline, "--vsock", &vsock])
}

/// Counts arrivals; `wait_for(n)` returns once n arrived (false after [`HOST_WAIT`]).
#[derive(Default)]
struct Gate {
    arrived: Mutex<usize>,
    changed: Condvar,
}

impl Gate {
    fn arrive(&self) {
        *self.arrived.lock().unwrap() += 1;
        self.changed.notify_all();
    }

    fn wait_for(&self, wanted: usize) -> bool {
        let arrived = self.arrived.lock().unwrap();
        let (arrived, _) = self
            .changed
            .wait_timeout_while(arrived, HOST_WAIT, |arrived| *arrived < wanted)
            .unwrap();
        *arrived >= wanted
    }
}

/// What one host-side connection saw.
struct Served {
    received: Vec<u8>,
    /// Whether every connection had sent data before this one echoed anything.
    all_open_together: bool,
}

/// Listens on `<uds>_PORT` and serves `count` connections, each on its own thread, with
/// `serve(stream, gate)`; returns what each thread returned, in accept order.
fn listen<T: Send + 'static>(
    uds: &Path,
    count: usize,
    serve: impl Fn(UnixStream, Arc<Gate>) -> T + Send + Sync + 'static,
) -> JoinHandle<Vec<T>> {
    let listener = UnixListener::bind(port_path(uds, PORT)).expect("bind the port's socket");
    listener.set_nonblocking(true).unwrap();
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        let gate = Arc::new(Gate::default());
        let deadline = Instant::now() + HOST_WAIT;
        let mut threads = Vec::new();
        while threads.len() < count {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    stream.set_read_timeout(Some(HOST_WAIT)).unwrap();
                    stream.set_write_timeout(Some(HOST_WAIT)).unwrap();
                    let (serve, gate) = (serve.clone(), gate.clone());
                    threads.push(std::thread::spawn(move || serve(stream, gate)));
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {
                    assert!(
                        Instant::now() < deadline,
                        "only {} of {count} guest connections arrived",
                        threads.len()
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(error) => panic!("accept: {error}"),
            }
        }
        threads
            .into_iter()
            .map(|thread| thread.join().expect("host connection thread"))
            .collect()
    })
}

/// Reads what arrives; `count` connections' first bytes must all have arrived before any
/// echo goes back (so the guest cannot have run them one after another), then echoes
/// everything until the guest shuts the connection down.
/// With `hold`, it also waits for that gate's first arrival before echoing.
fn echo_once_all_open(
    mut stream: UnixStream,
    gate: Arc<Gate>,
    count: usize,
    hold: Option<&Gate>,
) -> Served {
    let mut received = Vec::new();
    let mut buffer = vec![0u8; 64 << 10];
    let first = stream.read(&mut buffer).expect("the guest's first bytes");
    received.extend_from_slice(&buffer[..first]);
    gate.arrive();
    let all_open_together = gate.wait_for(count);
    if let Some(hold) = hold {
        assert!(hold.wait_for(1), "the test never released the echo");
    }
    stream.write_all(&buffer[..first]).expect("echo");
    loop {
        let read = match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) => panic!(
                "read from the guest after {} bytes: {error}",
                received.len()
            ),
        };
        received.extend_from_slice(&buffer[..read]);
        stream.write_all(&buffer[..read]).expect("echo");
    }
    Served {
        received,
        all_open_together,
    }
}

/// Checks that the host saw exactly the guest's `count` streams of `bytes` each.
fn assert_host_saw_the_streams(served: &[Served], count: u32, bytes: usize) {
    assert_eq!(served.len(), count as usize, "host connections");
    let mut seen = Vec::new();
    for connection in served {
        let number = connection_number(&connection.received, count)
            .expect("a host connection does not start with any guest connection's pattern");
        assert_eq!(
            connection.received.len(),
            bytes,
            "connection {number}: bytes"
        );
        assert!(
            connection.received == stream_pattern(number, bytes),
            "connection {number}: the bytes differ from the guest's pattern"
        );
        assert!(
            connection.all_open_together,
            "connection {number} waited in vain for the others to open"
        );
        seen.push(number);
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        (1..=count).collect::<Vec<_>>(),
        "one host connection per guest one"
    );
}

fn assert_guest_lines(out: &RunOutput, count: u32, bytes: usize) {
    out.assert_code(0);
    for number in 1..=count {
        out.assert_stdout_has(&format!(
            "virtio-vsock-connect: connection {number} port {}->{PORT} done sent={bytes} echoed={bytes}",
            50_000 + number
        ));
    }
    out.assert_stdout_has(&format!(
        "virtio-vsock-connect: connect ok connections={count} bytes={}",
        count as usize * bytes
    ));
}

/// The guest's line for a connection that ran out of gpuvm's credit; checks that exactly
/// the advertised window was in flight then.
fn assert_waited_for_credit(stdout: &str, number: u32) {
    let prefix = format!("virtio-vsock-connect: connection {number} waits for credit ");
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("connection {number} never waited for credit:\n{stdout}"));
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {line:?}"))
    };
    assert_eq!(field("in_flight"), field("buf_alloc"), "{line}");
    assert!(field("sent") >= field("buf_alloc"), "{line}");
}

/// Several guest connections at once, each with more than gpuvm's credit window: the host
/// reads nothing more until every one of them ran out of credit (so they are open
/// together and the window holds), then echoes everything.
#[test]
fn guest_connections_echo_through_a_host_listener() {
    let scratch = Scratch::new("virtio-vsock", "connect");
    let uds = scratch.path("v.sock");
    let count = 4;
    let release = Arc::new(Gate::default());
    let hold = release.clone();
    let host = listen(&uds, count as usize, move |stream, gate| {
        echo_once_all_open(stream, gate, count as usize, Some(&hold))
    });
    let mut vm = start_vm(
        &uds,
        &format!("virtio-vsock-connect {PORT} {count} {BYTES}"),
    );
    for number in 1..=count {
        vm.wait_for_stdout(
            &format!("virtio-vsock-connect: connection {number} waits for credit"),
            LIMIT,
        );
    }
    release.arrive();
    let out = vm.wait(LIMIT);
    let served = host.join().expect("host listener");
    assert_guest_lines(&out, count, BYTES);
    for number in 1..=count {
        assert_waited_for_credit(&out.stdout, number);
    }
    assert_host_saw_the_streams(&served, count, BYTES);
    assert!(!uds.exists(), "the socket file is removed at exit");
}

#[test]
fn a_guest_connection_without_a_host_listener_is_refused() {
    let scratch = Scratch::new("virtio-vsock", "refused");
    let uds = scratch.path("v.sock");
    let out = start_vm(&uds, &format!("virtio-vsock-connect {PORT} 2 4096")).wait(LIMIT);
    out.assert_code(1);
    for number in 1..=2 {
        out.assert_stdout_has(&format!(
            "virtio-vsock-connect: connection {number} to port {PORT} refused (RST)"
        ));
    }
    out.assert_stdout_has(
        "virtio-vsock-connect: connect failed complete=0 refused=2 ended-by-host=0 of 2",
    );
    assert!(
        !out.stdout.contains("FAIL") && !out.stderr.contains("panicked"),
        "{}",
        out.describe()
    );
}

/// A refused port does not disturb the device: a later listener is reached.
#[test]
fn a_refused_connection_leaves_the_device_serving_host_connections() {
    let scratch = Scratch::new("virtio-vsock", "refused-then-host");
    let uds = scratch.path("v.sock");
    // ACCEPT 1: the guest also serves one host-initiated connection on port 1024.
    let mut vm = start_vm(&uds, &format!("virtio-vsock-connect {PORT} 1 4096 1"));
    vm.wait_for_stdout("virtio-vsock-connect: connection 1 to port", LIMIT);
    gpuvm_tests::virtio_support::vsock_echo(&uds, b"after a refusal");
    let out = vm.wait(LIMIT);
    out.assert_code(1);
    out.assert_stdout_has(&format!(
        "virtio-vsock-connect: connection 1 to port {PORT} refused (RST)"
    ));
    out.assert_stdout_has("virtio-vsock-connect: accepted connections=1 echoed=15");
}

#[test]
fn a_host_listener_that_hangs_up_midway_ends_the_guest_connections() {
    let scratch = Scratch::new("virtio-vsock", "hangup");
    let uds = scratch.path("v.sock");
    let count = 2;
    // Each host connection takes 64 KiB of the guest's stream, echoes none of it, and closes.
    let host = listen(&uds, count, |mut stream, _| {
        let mut taken = vec![0u8; 64 << 10];
        stream
            .read_exact(&mut taken)
            .expect("the guest's first 64 KiB");
        taken
    });
    let out = start_vm(
        &uds,
        &format!("virtio-vsock-connect {PORT} {count} {BYTES}"),
    )
    .wait(LIMIT);
    let taken = host.join().expect("host listener");
    out.assert_code(1);
    for number in 1..=count {
        let ended = [
            format!("virtio-vsock-connect: connection {number} reset by host"),
            format!("virtio-vsock-connect: connection {number} shut down by host"),
        ];
        assert!(
            ended.iter().any(|line| out.stdout.contains(line.as_str())),
            "connection {number} did not see the hang-up:\n{}",
            out.describe()
        );
    }
    out.assert_stdout_has(&format!(
        "virtio-vsock-connect: connect failed complete=0 refused=0 ended-by-host={count} of {count}"
    ));
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    for data in &taken {
        let number = connection_number(data, count as u32).expect("a guest stream");
        assert!(
            data == &stream_pattern(number, data.len()),
            "connection {number}"
        );
    }
}

/// Both directions at once: a host-initiated connection (CONNECT 1024) is echoed by the
/// guest while its own connections are open and wait for their echo.
#[test]
fn host_and_guest_initiated_connections_run_together() {
    let scratch = Scratch::new("virtio-vsock", "both");
    let uds = scratch.path("v.sock");
    let count = 2u32;
    let host_connection_done = Arc::new(Gate::default());
    let hold = host_connection_done.clone();
    // The guest's connections get no echo until the host-initiated one was echoed whole.
    let host = listen(&uds, count as usize, move |stream, gate| {
        echo_once_all_open(stream, gate, count as usize, Some(&hold))
    });
    let mut vm = start_vm(
        &uds,
        &format!("virtio-vsock-connect {PORT} {count} {BYTES} 1"),
    );
    vm.wait_for_stdout(
        &format!("virtio-vsock-connect: connection {count} port"),
        LIMIT,
    );
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    gpuvm_tests::virtio_support::vsock_echo(&uds, &payload);
    host_connection_done.arrive();
    let out = vm.wait(LIMIT);
    let served = host.join().expect("host listener");
    assert_guest_lines(&out, count, BYTES);
    out.assert_stdout_has(&format!(
        "virtio-vsock-connect: accepted connections=1 echoed={}",
        payload.len()
    ));
    assert_host_saw_the_streams(&served, count, BYTES);
    gpuvm_tests::virtio_support::assert_in_order(
        &out.stdout,
        &[
            "virtio-vsock-connect: connection 1 port 50001->5201 open",
            "virtio-vsock-connect: connection 2 port 50002->5201 open",
            "virtio-vsock-connect/accept: connection 1 shut down by peer",
            "virtio-vsock-connect: connection 1 port 50001->5201 done",
        ],
        "the host-initiated connection is served while the guest's are open",
    );
}
