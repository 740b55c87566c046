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
    assert!(
        !threads
            .iter()
            .any(|(name, _)| name.starts_with("virtio-idle")),
        "the only device's thread is busy: {threads:?}"
    );
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
        let mut vm = spawn_guest_with(
            &netns,
            "id=eth0,tap=tap0",
            &["--snapshot-dir", dir_arg, "--snapshot-then", "exit"],
        );
        vm.wait_for_stdout("virtio-net: sent gratuitous arp", LIMIT);
        gpuvm_tests::snapshot_support::signal_snapshot(vm.pid());
        let first = vm.wait(LIMIT);
        first.assert_code(0);
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
