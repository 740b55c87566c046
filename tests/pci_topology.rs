//! The guest's PCIe topology mirrors the host's (issue 28): four emulated GPUs take the
//! places of four host GPUs (`topology_bdf=`) in a fake sysfs tree where two sit behind
//! each of two PCIe switches. The test guest's `pci-topology` workload walks the buses
//! through the bridges, finds two virtual switches with two GPUs each, checks every BAR
//! lies inside its bridges' windows and reads each GPU's BOOT_0 register.
//! `--pci-topology flat` keeps the devices on bus 0, and so does the default where the
//! host GPUs hang straight off root ports (nothing to mirror) unless `host` is asked for.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{run_gpuvm, run_gpuvm_with_env, RunOutput, Scratch, SpawnedProcess};

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

/// The passes of the guest's `hold` loop so far (`pci-topology: ok N` lines).
fn passes(stdout: &str) -> usize {
    stdout
        .lines()
        .filter(|l| l.starts_with("pci-topology: ok "))
        .count()
}

#[test]
fn a_snapshot_of_the_topology_vm_is_refused_and_the_guest_goes_on_seeing_it() {
    // Cold-plugged devices, the only ones placed behind ports, cannot be snapshotted
    // (their state lives in the device): the refusal is clean and the tree stays.
    let scratch = Scratch::new("pci-topology", "snapshot");
    let sysfs = scratch.path("sys");
    let chains: Vec<&[&str]> = HOST_GPUS.iter().map(|c| c.as_slice()).collect();
    fake_sysfs(&sysfs, &chains);
    let mut servers = Vec::new();
    let mut devices = Vec::new();
    for (i, chain) in HOST_GPUS.iter().enumerate() {
        let socket = scratch.path(&format!("gpu{i}.sock"));
        servers.push(gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]));
        devices.push(format!("{},topology_bdf={}", socket.display(), chain[3]));
    }
    let api = scratch.path("api.sock");
    let mut args = vec!["run", "--api-sock", api.to_str().unwrap()];
    args.extend(["--cmdline", "pci-topology 2 2 hold"]);
    for device in &devices {
        args.extend(["--vfio-user", device.as_str()]);
    }
    let env = [("GPUVM_TEST_SYSFS_ROOT", sysfs.to_str().unwrap())];
    let mut vmm = SpawnedProcess::gpuvm_with_env(&args, &env);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
    let ctl = |what: &[&str]| {
        let mut all = vec!["ctl", "--api-sock", api.to_str().unwrap()];
        all.extend_from_slice(what);
        run_gpuvm(&all, LIMIT)
    };
    ctl(&["start"]).assert_code(0);
    vmm.wait_for_stdout("pci-topology: ok 1", LIMIT);
    assert!(
        vmm.stdout().contains(" switch-upstream "),
        "{}",
        vmm.stdout()
    );
    let snapshot = scratch.path("snapshot");
    ctl(&["snapshot-create", "--dir", snapshot.to_str().unwrap()])
        .assert_clean_error("cannot snapshot a VM with cold-plugged passthrough devices (03:00.0");
    let before = passes(&vmm.stdout());
    vmm.wait_until("more passes after the refusal", LIMIT, |p| {
        passes(&p.stdout()) > before + 1
    });
    ctl(&["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    assert!(!out.stdout.contains("FAIL"), "{}", out.stdout);
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
}
