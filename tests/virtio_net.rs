//! virtio-net end to end: the test guest's `virtio-net IP` workload (its own ring-3 driver,
//! ARP, ICMP echo and a UDP echo on port 7) against gpuvm's network device, through a real
//! tap in a network namespace each test makes for itself (`ip netns add
//! gpuvm-vnet-<pid>-<n>`, removed again even when the test fails), with gpuvm started inside
//! it by `ip netns exec` and seccomp on (the default). The host side is the namespace's own
//! network stack: `ping`, a UDP socket, the neighbour table. Tests that need root (a
//! namespace, a tap) print why and skip without it.

use std::net::UdpSocket;
use std::time::Duration;

use gpuvm_tests::netns::Netns;
use gpuvm_tests::{run_gpuvm, RunOutput, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
/// Starts `gpuvm run --cmdline "virtio-net 10.0.<n>.2" --net NET` inside the namespace.
/// `ip netns exec` execs gpuvm (no fork), so the process's pid is gpuvm's.
fn spawn_guest(netns: &Netns, net: &str) -> SpawnedProcess {
    spawn_guest_with(netns, net, &[])
}

/// [`spawn_guest`] with more `gpuvm run` arguments.
fn spawn_guest_with(netns: &Netns, net: &str, extra: &[&str]) -> SpawnedProcess {
    let cmdline = format!("virtio-net {}", netns.guest_ip());
    let mut args = vec!["run", "--cmdline", &cmdline, "--net", net];
    args.extend_from_slice(extra);
    netns.spawn_gpuvm(&args)
}

/// Makes the host resolve the guest's IP (a datagram to the guest's discard port, which it
/// ignores, goes out after an ARP request) and returns the MAC the guest answered with.
/// Only while the guest runs: the kernel flushes the entry when the tap loses its carrier
/// (gpuvm closing it at exit).
fn resolve_guest(netns: &Netns) -> String {
    let (host, guest) = (netns.host_ip(), netns.guest_ip());
    for _ in 0..50 {
        netns.run(move || {
            let socket = UdpSocket::bind((host, 0)).expect("bind in the namespace");
            socket
                .send_to(b"resolve", (guest, 9))
                .expect("send to the guest");
        });
        std::thread::sleep(Duration::from_millis(100));
        if let Some(mac) = netns.guest_neighbour() {
            return mac;
        }
    }
    panic!(
        "the host did not resolve {guest}: {}",
        netns.ip(&["neigh", "show"])
    );
}

/// The MAC the guest printed (`virtio-net: mac=...`).
fn guest_mac(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix("virtio-net: mac="))
        .unwrap_or_else(|| panic!("no mac= line:\n{stdout}"))
        .trim()
        .to_string()
}

/// The rx and tx frame counts of the guest's `virtio-net: ok rx=R tx=T` line.
fn ok_counts(out: &RunOutput) -> (u64, u64) {
    let line = out
        .stdout
        .lines()
        .find_map(|line| line.strip_prefix("virtio-net: ok "))
        .unwrap_or_else(|| panic!("no ok line\n{}", out.describe()));
    let count = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
    };
    (count("rx="), count("tx="))
}

fn assert_ping_installed() {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("ping").is_file()));
    assert!(
        found,
        "ping is needed for this test (scripts/install-deps.sh installs iputils-ping)"
    );
}

#[test]
fn ping_and_udp_echo_through_a_tap() {
    let Some(netns) = Netns::create("ping_and_udp_echo_through_a_tap") else {
        return;
    };
    assert_ping_installed();
    let mut vm = spawn_guest(&netns, "id=eth0,tap=tap0");
    vm.wait_for_stdout("virtio-net: sent gratuitous arp", LIMIT);
    let mac = guest_mac(&vm.stdout());
    // The announcement (gratuitous ARP and a broadcast datagram) reached the host's tap.
    let rx_packets: u64 = String::from_utf8(
        netns
            .exec("cat", &["/sys/class/net/tap0/statistics/rx_packets"])
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .expect("tap0 rx_packets");
    assert!(rx_packets >= 2, "tap0 received {rx_packets} frames");

    let guest = netns.guest_ip().to_string();
    let ping = netns.exec("ping", &["-c", "1", "-W", "5", &guest]);
    assert!(
        ping.status.success(),
        "ping {guest} failed: {}{}\n--- gpuvm stdout\n{}\n--- gpuvm stderr\n{}",
        String::from_utf8_lossy(&ping.stdout),
        String::from_utf8_lossy(&ping.stderr),
        vm.stdout(),
        vm.stderr()
    );
    assert!(
        String::from_utf8_lossy(&ping.stdout).contains("1 received"),
        "{}",
        String::from_utf8_lossy(&ping.stdout)
    );
    // The host resolved the guest through its ARP answer: the MAC the device offered.
    assert_eq!(netns.guest_neighbour().as_deref(), Some(mac.as_str()));

    // The largest datagram a 1500-byte MTU carries unfragmented: full-size frames both ways.
    let payload: Vec<u8> = (0..1472u32).map(|i| (i * 13 + i / 256) as u8).collect();
    let echo = netns.udp_echo(&payload);
    assert!(
        echo == payload,
        "the echoed payload differs ({} bytes back)",
        echo.len()
    );

    let out = vm.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("virtio-net: ok");
    out.assert_stdout_has(&format!("virtio-net: arp reply to {}", netns.host_ip()));
    out.assert_stdout_has(&format!(
        "virtio-net: icmp echo reply to {}",
        netns.host_ip()
    ));
    out.assert_stdout_has(&format!("virtio-net: echoed {} udp bytes", payload.len()));
    // Sent: the gratuitous ARP, the broadcast, an ARP reply, the ICMP reply, the echo.
    // Received: at least the ARP request, the ICMP request and the datagram.
    let (rx, tx) = ok_counts(&out);
    assert!(rx >= 3 && tx >= 5, "rx={rx} tx={tx}\n{}", out.describe());
}

#[test]
fn a_configured_mac_is_what_the_guest_and_the_host_see() {
    let Some(netns) = Netns::create("a_configured_mac_is_what_the_guest_and_the_host_see") else {
        return;
    };
    let mac = "06:00:0a:00:00:02";
    let mut vm = spawn_guest(&netns, &format!("id=eth0,tap=tap0,mac={mac}"));
    vm.wait_for_stdout("virtio-net: sent gratuitous arp", LIMIT);
    assert_eq!(guest_mac(&vm.stdout()), mac);
    // The guest answers ARP with it too.
    assert_eq!(resolve_guest(&netns), mac);
    let echo = netns.udp_echo(b"mac");
    assert_eq!(echo, b"mac");
    let out = vm.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("virtio-net: ok");
}

#[test]
fn bad_network_interfaces_are_refused_before_the_guest_runs() {
    let long = "gpuvmtap0123456789"; // 18 bytes; Linux names have 15 at most
    for (net, needles) in [
        (
            format!("id=eth0,tap={long}"),
            vec!["eth0", &long[..15], "interface name"],
        ),
        (
            "id=eth0,tap=tap/0".to_string(),
            vec!["eth0", "tap/0", "interface name"],
        ),
        // No tap by name, and no descriptors can come on the command line.
        ("id=eth0".to_string(), vec!["eth0", "tap"]),
        (
            "id=eth0,tap=tap0,mac=01:00:0a:00:00:02".to_string(),
            vec!["01:00:0a:00:00:02", "multicast"],
        ),
    ] {
        let out = run_gpuvm(
            &["run", "--cmdline", "virtio-net 10.0.0.2", "--net", &net],
            LIMIT,
        );
        out.assert_code(125);
        for needle in needles {
            out.assert_clean_error(needle);
        }
        assert!(
            !out.stdout.contains("testguest: ready") && !out.stdout.contains("virtio-net:"),
            "--net {net}: the guest ran:\n{}",
            out.describe()
        );
    }
}

/// The guest is served by the device's own thread, under the device filter.
#[test]
fn the_net_device_thread_runs_under_its_filter() {
    let Some(netns) = Netns::create("the_net_device_thread_runs_under_its_filter") else {
        return;
    };
    let mut vm = spawn_guest(&netns, "id=eth0,tap=tap0");
    vm.wait_for_stdout("virtio-net: sent gratuitous arp", LIMIT);
    // `ip netns exec` exec'd gpuvm: the pid we spawned is gpuvm's own.
    let exe = std::fs::read_link(format!("/proc/{}/exe", vm.pid())).expect("/proc/PID/exe");
    let gpuvm = gpuvm_tests::gpuvm_bin();
    assert_eq!(
        exe.canonicalize().unwrap(),
        gpuvm.canonicalize().unwrap(),
        "pid {} is not gpuvm",
        vm.pid()
    );
    let threads = gpuvm_tests::thread_seccomp_modes(vm.pid());
    let net_threads: Vec<_> = threads
        .iter()
        .filter(|(name, _)| name.starts_with("virtio-net"))
        .collect();
    assert_eq!(
        net_threads,
        [&("virtio-net".to_string(), 2)],
        "one filtered thread serves the device: {threads:?}"
    );
    // The only device's thread is busy, and none is kept idle for hot-plug (the factory
    // makes those threads when they are needed).
    let idle = threads
        .iter()
        .filter(|(name, _)| name.starts_with("virtio-idle"))
        .count();
    assert_eq!(idle, 0, "{threads:?}");
    // The filtered thread still moves frames both ways.
    assert_eq!(netns.udp_echo(b"filtered"), b"filtered");
    let out = vm.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("virtio-net: ok");
}

/// A VM with a network interface snapshotted while its guest waits for a datagram, then
/// restored (eagerly and lazily) on the same tap: the restored guest answers as if nothing
/// happened.
#[test]
fn a_restored_vm_keeps_its_network_interface() {
    for mode in ["eager", "lazy"] {
        let Some(netns) = Netns::create(&format!("restore_{mode}")) else {
            return;
        };
        let scratch = gpuvm_tests::Scratch::new("virtio-net", mode);
        let dir = scratch.path("snap");
        let dir_arg = dir.to_str().unwrap();
        // The other three device kinds ride along (their own workloads cross restores in
        // tests/virtio_snapshot.rs): the VM restored here has block, net, vsock and rng.
        let image = scratch.path("disk.img");
        std::fs::write(&image, vec![0u8; 1 << 20]).expect("image");
        let drive = format!("id=data,path={}", image.display());
        let vsock = format!("cid=3,uds={}", scratch.path("vsock.sock").display());
        let mut vm = spawn_guest_with(
            &netns,
            "id=eth0,tap=tap0",
            &[
                "--snapshot-dir",
                dir_arg,
                "--snapshot-then",
                "exit",
                "--drive",
                &drive,
                "--vsock",
                &vsock,
                "--rng",
            ],
        );
        vm.wait_for_stdout("virtio-net: sent gratuitous arp", LIMIT);
        gpuvm_tests::snapshot_support::signal_snapshot(vm.pid());
        let first = vm.wait(LIMIT);
        first.assert_code(0);
        let state = std::fs::read(dir.join("state")).expect("state file");
        let state = String::from_utf8_lossy(&state);
        for kind in ["\"block\"", "\"net\"", "\"vsock\"", "\"rng\""] {
            assert!(
                state.contains(kind),
                "{mode}: no {kind} device in the snapshot"
            );
        }
        assert!(
            !first.stdout.contains("virtio-net: ok"),
            "{mode}: the guest finished before the snapshot:\n{}",
            first.describe()
        );

        let restored =
            netns.spawn_gpuvm(&["restore", "--snapshot", dir_arg, "--restore-mode", mode]);
        let payload = format!("after a {mode} restore").into_bytes();
        let echo = netns.udp_echo(&payload);
        assert!(echo == payload, "{mode}: the echo differs");
        let out = restored.wait(LIMIT);
        out.assert_code(0).assert_stdout_has("virtio-net: ok");
        out.assert_stdout_has(&format!("virtio-net: echoed {} udp bytes", payload.len()));
        assert!(
            !out.stdout.contains("virtio-net: mac="),
            "{mode}: the restored guest started over:\n{}",
            out.describe()
        );
    }
}

/// A tap another process holds (a single-queue tap can be attached once) is refused with
/// a clear error before the guest runs, and the holder keeps it.
#[test]
fn a_tap_held_by_another_process_is_refused() {
    let Some(netns) = Netns::create("a_tap_held_by_another_process_is_refused") else {
        return;
    };
    // Attach tap0 in the namespace, as another VMM would.
    let held = netns.open_tap();
    let out = spawn_guest(&netns, "id=eth0,tap=tap0").wait(LIMIT);
    out.assert_code(125);
    out.assert_clean_error("eth0");
    out.assert_clean_error("tap0");
    out.assert_clean_error("busy");
    assert!(
        !out.stdout.contains("testguest: ready"),
        "the guest ran:\n{}",
        out.describe()
    );
    drop(held);
}

/// Replaces the namespace's `tap0` with a multi-queue one (`ip tuntap ... multi_queue`) at
/// the same address.
fn make_multi_queue_tap(netns: &Netns) {
    netns.ip(&["link", "del", "tap0"]);
    netns.ip(&["tuntap", "add", "dev", "tap0", "mode", "tap", "multi_queue"]);
    netns.ip(&[
        "addr",
        "add",
        &format!("{}/24", netns.host_ip()),
        "dev",
        "tap0",
    ]);
    netns.ip(&["link", "set", "tap0", "up"]);
}

/// `numqueues N numdisabled D` of `ip -d link show tap0`.
fn tap_queues(netns: &Netns) -> (u32, u32) {
    let details = netns.ip(&["-d", "link", "show", "tap0"]);
    let number = |key: &str| -> u32 {
        let mut words = details.split_whitespace();
        words.find(|w| *w == key);
        words
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in `ip -d link show tap0`:\n{details}"))
    };
    (number("numqueues"), number("numdisabled"))
}

/// A UDP echo server on the host side of the namespace; it answers only once `serve` is
/// set, and returns the source ports it echoed to when `stop` is set.
struct EchoServer {
    port: u16,
    serve: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u16>>,
}

impl EchoServer {
    fn start(netns: &Netns) -> EchoServer {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let host = netns.host_ip();
        // Made on a thread inside the namespace; the socket stays there.
        let socket = netns.run(move || UdpSocket::bind((host, 0)).expect("bind in the namespace"));
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let port = socket.local_addr().unwrap().port();
        let (serve, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (serving, stopping) = (Arc::clone(&serve), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let mut ports = Vec::new();
            let mut buffer = [0u8; 2048];
            while !stopping.load(Ordering::SeqCst) {
                if !serving.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                match socket.recv_from(&mut buffer) {
                    Ok((len, from)) => {
                        socket.send_to(&buffer[..len], from).expect("echo");
                        ports.push(from.port());
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => panic!("echo server: {e}"),
                }
            }
            ports
        });
        EchoServer {
            port,
            serve,
            stop,
            thread,
        }
    }

    fn serve(&self) {
        self.serve.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn stop(self) -> Vec<u16> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.join().expect("echo server")
    }
}

/// `(tx, rx)` of each `virtio-net-mq: pair P tx=T rx=R` line, in pair order.
fn pair_counts(out: &RunOutput) -> Vec<(u64, u64)> {
    out.stdout
        .lines()
        .filter_map(|line| line.strip_prefix("virtio-net-mq: pair "))
        .enumerate()
        .map(|(index, rest)| {
            let mut words = rest.split_whitespace();
            assert_eq!(words.next(), Some(index.to_string().as_str()), "{rest}");
            let mut count = |key: &str| -> u64 {
                words
                    .next()
                    .and_then(|w| w.strip_prefix(key))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no {key} in {rest:?}"))
            };
            (count("tx="), count("rx="))
        })
        .collect()
}

/// Two queue pairs on a multi-queue tap: the guest negotiates VIRTIO_NET_F_MQ, is refused 0
/// and 3 pairs over the control queue, sets 2, and its UDP echo requests go out of both TX
/// queues (16 source ports) and come back, byte for byte; the tap has both queues attached.
#[test]
fn two_queue_pairs_carry_traffic_on_a_multi_queue_tap() {
    const PAIRS: usize = 2;
    const ROUNDS: usize = 8;
    let Some(netns) = Netns::create("two_queue_pairs_carry_traffic_on_a_multi_queue_tap") else {
        return;
    };
    make_multi_queue_tap(&netns);
    let echo = EchoServer::start(&netns);
    let cmdline = format!(
        "virtio-net-mq {} {} {} {PAIRS} {ROUNDS}",
        netns.guest_ip(),
        netns.host_ip(),
        echo.port
    );
    let mut vm = netns.spawn_gpuvm(&[
        "run",
        "--cmdline",
        &cmdline,
        "--net",
        &format!("id=eth0,tap=tap0,queues={PAIRS}"),
    ]);
    // The echo server holds its replies until the queues are checked, so the guest is still
    // running (waiting for its first echo) here.
    vm.wait_for_stdout("virtio-net-mq: pairs-set 2 ok", LIMIT);
    assert_eq!(
        tap_queues(&netns),
        (PAIRS as u32, 0),
        "gpuvm attached both tap queues"
    );
    echo.serve();
    let out = vm.wait(LIMIT);
    let ports = echo.stop();
    out.assert_code(0)
        .assert_stdout_has("virtio-net-mq: max_virtqueue_pairs=2")
        .assert_stdout_has("virtio-net-mq: pairs-set 0 of 2 refused")
        .assert_stdout_has("virtio-net-mq: pairs-set 3 of 2 refused")
        .assert_stdout_has(&format!(
            "virtio-net-mq: ok pairs={PAIRS} replies={}",
            PAIRS * ROUNDS
        ));
    let counts = pair_counts(&out);
    assert_eq!(counts.len(), PAIRS, "{}", out.describe());
    // Each request left from its pair's TX queue; ARP answers may add to a pair's count.
    for (pair, (tx, _)) in counts.iter().enumerate() {
        assert!(
            *tx >= ROUNDS as u64,
            "pair {pair} sent {tx} frames: {counts:?}"
        );
    }
    let received: u64 = counts.iter().map(|(_, rx)| rx).sum();
    assert!(
        received >= (PAIRS * ROUNDS) as u64,
        "the guest received {received} frames for {} replies: {counts:?}",
        PAIRS * ROUNDS
    );
    // The host saw a request from every source port the guest used.
    let mut distinct = ports.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let expected: Vec<u16> = (40000..40000 + (PAIRS * ROUNDS) as u16).collect();
    assert_eq!(distinct, expected, "source ports the host echoed to");
    eprintln!("per-pair (tx, rx): {counts:?}");
}

/// `queues=2` on a tap made without multi_queue cannot attach a second queue: a clear error
/// naming the interface and the tap before the guest runs.
#[test]
fn queue_pairs_on_a_single_queue_tap_are_refused() {
    let Some(netns) = Netns::create("queue_pairs_on_a_single_queue_tap_are_refused") else {
        return;
    };
    let out = netns
        .spawn_gpuvm(&[
            "run",
            "--cmdline",
            &format!(
                "virtio-net-mq {} {} 9 2 1",
                netns.guest_ip(),
                netns.host_ip()
            ),
            "--net",
            "id=eth0,tap=tap0,queues=2",
        ])
        .wait(LIMIT);
    out.assert_code(125);
    out.assert_clean_error("tap0");
    out.assert_clean_error("multi_queue");
    assert!(
        !out.stdout.contains("testguest: ready"),
        "the guest ran:\n{}",
        out.describe()
    );
}
