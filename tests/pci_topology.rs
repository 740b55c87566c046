//! The guest's PCIe topology mirrors the host's (issue 28): four emulated GPUs take the
//! places of four host GPUs (`topology_bdf=`) in a fake sysfs tree where two sit behind
//! each of two PCIe switches. The test guest's `pci-topology` workload walks the buses
//! through the bridges, finds two virtual switches with two GPUs each, checks every BAR
//! lies inside its bridges' windows and reads each GPU's BOOT_0 register.
//! `--pci-topology flat` keeps the devices on bus 0, and so does the default where the
//! host GPUs hang straight off root ports (nothing to mirror) unless `host` is asked for.
//! A VM with such a topology snapshots and restores in a new process: its ports rebuilt
//! in place and its GPUs restored behind them through VFIO migration. It is live-updated
//! too: the new process rebuilds the ports from the state and takes the GPUs behind them
//! over on their device processes' connections, with no reset and no new DMA mapping.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{run_gpuvm_with_env, RunOutput, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(180);

/// The host GPUs of the fake tree, (root port, upstream port, downstream port, GPU):
/// switch A under root port 40:01.0, switch B under 40:03.0, one root complex.
const HOST_GPUS: [[&str; 4]; 4] = [
    [
        "0000:40:01.0",
        "0000:41:00.0",
        "0000:42:00.0",
        "0000:43:00.0",
    ],
    [
        "0000:40:01.0",
        "0000:41:00.0",
        "0000:42:01.0",
        "0000:44:00.0",
    ],
    [
        "0000:40:03.0",
        "0000:51:00.0",
        "0000:52:00.0",
        "0000:53:00.0",
    ],
    [
        "0000:40:03.0",
        "0000:51:00.0",
        "0000:52:01.0",
        "0000:54:00.0",
    ],
];

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

/// Two host GPUs, each right behind a root port of its own.
const HOST_GPUS_ON_ROOT_PORTS: [[&str; 2]; 2] = [
    ["0000:40:01.0", "0000:41:00.0"],
    ["0000:40:03.0", "0000:51:00.0"],
];

/// `root/devices/pci0000:40/<port>/.../<gpu>` for each chain, and
/// `root/bus/pci/devices/<bdf>` links to every device, as sysfs has them.
fn fake_sysfs(root: &Path, chains: &[&[&str]]) {
    let links = root.join("bus/pci/devices");
    std::fs::create_dir_all(&links).unwrap();
    for chain in chains {
        let mut dir = root.join("devices/pci0000:40");
        for bdf in *chain {
            dir.push(bdf);
            std::fs::create_dir_all(&dir).unwrap();
            let link = links.join(bdf);
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(&dir, &link).unwrap();
            }
        }
    }
}

/// Starts four emulated GPUs, runs the test guest's `cmdline` with them standing for the
/// host GPUs (plus `extra` arguments), and returns gpuvm's output once the servers end.
fn run_with_gpus(scratch: &Scratch, cmdline: &str, extra: &[&str]) -> RunOutput {
    let chains: Vec<&[&str]> = HOST_GPUS.iter().map(|c| c.as_slice()).collect();
    run_with_host(scratch, &chains, cmdline, extra)
}

/// As [`run_with_gpus`], one emulated GPU per chain of the host tree (its last entry).
fn run_with_host(
    scratch: &Scratch,
    chains: &[&[&str]],
    cmdline: &str,
    extra: &[&str],
) -> RunOutput {
    let sysfs = scratch.path("sys");
    fake_sysfs(&sysfs, chains);
    let mut servers: Vec<SpawnedProcess> = Vec::new();
    let mut devices = Vec::new();
    for (i, chain) in chains.iter().enumerate() {
        let socket = scratch.path(&format!("gpu{i}.sock"));
        servers.push(gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]));
        devices.push(format!(
            "{},topology_bdf={}",
            socket.display(),
            chain[chain.len() - 1]
        ));
    }
    let mut args = vec!["--log-level", "info", "run", "--cmdline", cmdline];
    for device in &devices {
        args.extend(["--vfio-user", device.as_str()]);
    }
    args.extend_from_slice(extra);
    let env = [("GPUVM_TEST_SYSFS_ROOT", sysfs.to_str().unwrap())];
    let out = run_gpuvm_with_env(&args, &env, LIMIT, None);
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
    out
}

#[test]
fn gpus_behind_two_host_switches_sit_behind_two_virtual_switches() {
    let scratch = Scratch::new("pci-topology", "host");
    let out = run_with_gpus(&scratch, "pci-topology 2 2", &[]);
    out.assert_code(0)
        .assert_stdout_has("pci-topology: ok")
        .assert_stderr_has("switch upstream port (host switch 0000:41:00.0)")
        .assert_stderr_has("switch upstream port (host switch 0000:51:00.0)");
    // Two root ports on bus 0, each with a switch: 1 upstream and 2 downstream ports.
    let lines = |what: &str| out.stdout.lines().filter(|l| l.contains(what)).count();
    assert_eq!(lines(" root-port "), 2, "{}", out.stdout);
    assert_eq!(lines(" switch-upstream "), 2, "{}", out.stdout);
    assert_eq!(lines(" switch-downstream "), 4, "{}", out.stdout);
    assert_eq!(lines(" gpu BAR0 "), 4, "{}", out.stdout);
    assert!(
        !out.stdout
            .lines()
            .any(|l| l.starts_with("pci-topology: 00:") && l.contains(" gpu ")),
        "no GPU on bus 0:\n{}",
        out.stdout
    );
}

#[test]
fn gpus_under_host_root_ports_stay_on_bus_0_unless_host_is_asked_for() {
    let chains: Vec<&[&str]> = HOST_GPUS_ON_ROOT_PORTS
        .iter()
        .map(|c| c.as_slice())
        .collect();
    let scratch = Scratch::new("pci-topology", "ports-default");
    let out = run_with_host(&scratch, &chains, "pci-topology flat 2", &[]);
    out.assert_code(0)
        .assert_stdout_has("pci-topology: ok")
        .assert_stderr_has("no device sits behind a host PCIe switch");
    drop(scratch);
    let scratch = Scratch::new("pci-topology", "ports-host");
    let out = run_with_host(
        &scratch,
        &chains,
        "pci-topology ports 2",
        &["--pci-topology", "host"],
    );
    out.assert_code(0).assert_stdout_has("pci-topology: ok");
    assert!(!out.stdout.contains(" switch-upstream "), "{}", out.stdout);
}

#[test]
fn flat_keeps_the_gpus_on_bus_0() {
    let scratch = Scratch::new("pci-topology", "flat");
    let out = run_with_gpus(&scratch, "pci-topology flat 4", &["--pci-topology", "flat"]);
    out.assert_code(0).assert_stdout_has("pci-topology: ok");
    assert!(!out.stderr.contains("root port"), "{}", out.stderr);
}

#[test]
fn the_walk_fails_where_the_layout_is_not_the_expected_one() {
    // The guest's check can fail: the host layout is not four GPUs on bus 0.
    let scratch = Scratch::new("pci-topology", "mismatch");
    let out = run_with_gpus(&scratch, "pci-topology flat 4", &[]);
    out.assert_code(1)
        .assert_stdout_has("pci-topology: FAIL expected 4 GPUs on bus 0 and no bridges");
}

/// Two emulated GPUs (started with `emu_args`) standing for two host GPUs behind one host
/// switch, cold-plugged into a VM (`--api-sock`, a pipe on its stdin) whose guest runs
/// `pci-topology 1 2 snapshot`: returned once the guest has checked the GPUs and waits for
/// a byte, with the device processes and the API socket.
fn start_gpus_behind_a_switch(
    scratch: &Scratch,
    emu_args: &[&str],
) -> (SpawnedProcess, Vec<SpawnedProcess>, PathBuf) {
    let sysfs = scratch.path("sys");
    let chains: Vec<&[&str]> = HOST_GPUS[..2].iter().map(|c| c.as_slice()).collect();
    fake_sysfs(&sysfs, &chains);
    let mut servers = Vec::new();
    let mut devices = Vec::new();
    for (i, chain) in chains.iter().enumerate() {
        let socket = scratch.path(&format!("gpu{i}.sock"));
        servers.push(gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, emu_args));
        devices.push(format!("{},topology_bdf={}", socket.display(), chain[3]));
    }
    let api = scratch.path("api.sock");
    let mut args = vec![
        "--log-level",
        "info",
        "run",
        "--api-sock",
        api.to_str().unwrap(),
        "--cmdline",
        "pci-topology 1 2 snapshot",
    ];
    for device in &devices {
        args.extend(["--vfio-user", device.as_str()]);
    }
    let env = [("GPUVM_TEST_SYSFS_ROOT", sysfs.to_str().unwrap())];
    let mut vmm = SpawnedProcess::gpuvm_with_env_and_input(&args, &env);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
    gpuvm_tests::api_start_instance(&api);
    vmm.wait_for_stdout("send a byte once the VM is restored", LIMIT);
    (vmm, servers, api)
}

#[test]
fn the_topology_vm_snapshots_and_restores_in_a_new_process_with_its_ports_and_gpus() {
    // Two GPUs behind one host switch: a root port, a switch upstream port and two
    // downstream ports, cold-plugged at boot. The snapshot keeps every port (place, bus
    // numbers, windows, registers) and each GPU's state (VFIO migration); a new process
    // rebuilds the ports in place and plugs the GPUs back behind them, onto the same
    // device processes (each serves the restored VMs too).
    let scratch = Scratch::new("pci-topology", "snapshot");
    let (mut vmm, servers, api) = start_gpus_behind_a_switch(&scratch, &["--clients", "3"]);
    let before = vmm.stdout();
    assert_eq!(before.matches(" switch-downstream ").count(), 2, "{before}");
    assert_eq!(
        before.matches("passed the pci checks").count(),
        2,
        "{before}"
    );

    let dir = scratch.path("snap");
    gpuvm_tests::api_snapshot_create(&api, &dir);
    let state = gpuvm_tests::snapshot_support::read_state(&dir);
    let ports = state["pci_topology_ports"].as_array().expect("the ports");
    let paths: Vec<String> = ports.iter().map(|p| p["path"].to_string()).collect();
    assert_eq!(paths, ["[1]", "[1,0]", "[1,0,0]", "[1,0,1]"], "{state}");
    let gpus = state["migrated_gpus"].as_array().expect("the GPUs' state");
    let places: Vec<String> = gpus.iter().map(|g| g["path"].to_string()).collect();
    assert_eq!(places, ["[1,0,0,0]", "[1,0,1,0]"], "{state}");
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));

    let api2 = scratch.path("api2.sock");
    let mut restored = SpawnedProcess::gpuvm_with_input(&[
        "--log-level",
        "info",
        "run",
        "--api-sock",
        api2.to_str().unwrap(),
    ]);
    gpuvm_tests::wait_for_api_socket(&mut restored, &api2);
    gpuvm_tests::api_load_lazy(&api2, &dir);
    // Behind a switch port there is no slot to take a GPU out of.
    let refused = gpuvm_tests::api_expect(&api2, 409, "DELETE", "/gpus/vfio-user-03:00.0", None);
    assert!(refused.contains("no hot-plug slot"), "{refused}");
    // The restored VM snapshots again (its GPUs are the hot-plug manager's now, found
    // behind the same ports), and a third process restores that snapshot: the guest,
    // still waiting for its byte, checks against what it saw before the first one.
    let again = scratch.path("snap-again");
    snapshot_when_the_gpus_run(&api2, &again);
    let state = gpuvm_tests::snapshot_support::read_state(&again);
    let ports: Vec<String> = (state["pci_topology_ports"]
        .as_array()
        .expect("the ports")
        .iter())
    .map(|p| p["path"].to_string())
    .collect();
    assert_eq!(ports, ["[1]", "[1,0]", "[1,0,0]", "[1,0,1]"], "{state}");
    let gpus = state["migrated_gpus"].as_array().expect("the GPUs' state");
    let places: Vec<String> = gpus.iter().map(|g| g["path"].to_string()).collect();
    assert_eq!(places, ["[1,0,0,0]", "[1,0,1,0]"], "{state}");
    restored.signal(libc::SIGKILL);
    let _ = restored.wait(Duration::from_secs(10));
    let api3 = scratch.path("api3.sock");
    let mut restored = SpawnedProcess::gpuvm_with_input(&[
        "--log-level",
        "info",
        "run",
        "--api-sock",
        api3.to_str().unwrap(),
    ]);
    gpuvm_tests::wait_for_api_socket(&mut restored, &api3);
    gpuvm_tests::api_load_lazy(&api3, &again);
    restored.write_stdin(b"r");
    let out = restored.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("pci-topology: after the restore the same tree: 4 ports, 2 GPUs"),
        "{}",
        out.stdout
    );
    for bdf in ["03:00.0", "04:00.0"] {
        assert!(
            out.stdout.contains(&format!(
                "pci-topology: {bdf} kept its state and did one more DMA with MSI-X, verified"
            )),
            "{}",
            out.stdout
        );
    }
    assert!(
        out.stdout.contains("pci-topology: restored ok"),
        "{}",
        out.stdout
    );
    for what in [
        "root port restored",
        "switch upstream port restored",
        "switch downstream port restored",
    ] {
        assert!(out.stderr.contains(what), "{what}: {}", out.stderr);
    }
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert!(!done.stderr.contains("panicked"), "{}", done.stderr);
    }
}

/// A live update of a VM whose GPUs sit behind a virtual switch: two updates in a row
/// (`gpuvm update --pid`), each new process rebuilding the root port and switch ports in
/// place from the state and plugging the GPUs back behind them over the connections the
/// old process used. Then the guest, which checked the GPUs before the first update, walks
/// the tree again (the same ports, bus numbers, windows and BARs) and checks that each GPU
/// kept its state and does one more DMA with MSI-X, now served by the last process. Each
/// device process saw one connection and never mapped or unmapped guest RAM again.
#[test]
fn the_topology_vm_is_live_updated_with_its_gpus_behind_the_switch() {
    let scratch = Scratch::new("pci-topology", "update");
    let (mut vmm, servers, api) = start_gpus_behind_a_switch(&scratch, &[]);
    let counts = |server: &SpawnedProcess| {
        let log = server.stderr();
        (
            log.matches("emu-gpu: listening on").count(),
            log.matches("emu-gpu: DMA map ").count(),
            log.matches("emu-gpu: DMA unmap ").count(),
        )
    };
    let before: Vec<_> = servers.iter().map(counts).collect();
    let mut owner = vmm.pid();
    for _ in 0..2 {
        let old = owner;
        // The new process logs where it rebuilt the ports and took the GPUs over.
        let out = gpuvm_tests::gpuvm_update(owner, &[], &[("GPUVM_LOG", "info")]);
        owner = gpuvm_tests::updated_to(&out, &vmm.stderr());
        // The old process ends, then the new one answers at the socket's path.
        let deadline = std::time::Instant::now() + LIMIT;
        let answers =
            || gpuvm_api::client::request(&api, "GET", "/", None).is_ok_and(|a| a.status == 200);
        while gpuvm_tests::process_running(old) || !answers() {
            assert!(std::time::Instant::now() < deadline, "{}", vmm.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let stderr = vmm.stderr();
    // Each new process rebuilt the root port, the upstream port and both downstream ports.
    for (what, count) in [
        ("root port restored", 2),
        ("switch upstream port restored", 2),
        ("switch downstream port restored", 4),
    ] {
        assert_eq!(stderr.matches(what).count(), count, "{what}: {stderr}");
    }
    assert_eq!(
        stderr
            .matches("taken over from the old process (no reset")
            .count(),
        4,
        "each GPU in each new process: {stderr}"
    );
    // Across the updates each device process kept its one connection and saw no DMA map
    // or unmap (guest RAM and the peer's BAR stay mapped as the first process mapped
    // them). The guest's checks after this may move BARs, which moves peer mappings.
    let after: Vec<_> = servers.iter().map(counts).collect();
    assert_eq!(after, before, "{}", servers[0].stderr());
    assert!(before
        .iter()
        .all(|&(connections, maps, _)| connections == 1 && maps > 0));
    vmm.write_stdin(b"r");
    vmm.wait_for_stdout("pci-topology: restored ok", LIMIT);
    let out = vmm.stdout();
    assert!(!out.contains("FAIL"), "{out}");
    assert!(
        out.contains("pci-topology: after the restore the same tree: 4 ports, 2 GPUs"),
        "{out}"
    );
    for bdf in ["03:00.0", "04:00.0"] {
        assert!(
            out.contains(&format!(
                "pci-topology: {bdf} kept its state and did one more DMA with MSI-X, verified"
            )),
            "{out}"
        );
    }
    // The guest ends the VM after its checks; the last process then exits on its own.
    gpuvm_tests::wait_process_gone(owner, LIMIT, || vmm.stderr());
    let stderr = vmm.stderr();
    let ends: Vec<&str> = (stderr.lines())
        .filter_map(|l| l.split("guest ended: ").nth(1))
        .collect();
    assert_eq!(ends.len(), 3, "{stderr}");
    assert!(ends[..2].iter().all(|end| *end == "HandedOver"), "{ends:?}");
    assert_ne!(ends[2], "HandedOver", "{stderr}");
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert!(!done.stderr.contains("panicked"), "{}", done.stderr);
    }
}

/// Snapshots the VM behind `api` into `dir` once its restored GPUs run (until guest RAM
/// is DMA-mapped for them a snapshot is refused, saying to retry).
fn snapshot_when_the_gpus_run(api: &Path, dir: &Path) {
    let body = serde_json::json!({ "snapshot_path": dir }).to_string();
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let answer = gpuvm_api::client::request(api, "PUT", "/snapshot/create", Some(&body))
            .expect("PUT /snapshot/create");
        if answer.status == 200 {
            return;
        }
        let waiting = answer.body.contains("retry once it runs");
        assert!(
            waiting && std::time::Instant::now() < deadline,
            "PUT /snapshot/create answered {}: {}",
            answer.status,
            answer.body
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
