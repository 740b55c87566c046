//! Guest NUMA nodes (issue 27): `--numa` gives the guest an SRAT and a SLIT, binds each
//! node's RAM to its host node with mbind before anything touches it, and optionally pins
//! the vCPU threads. The test guest's `numa` workload parses the tables, checks nodes,
//! memory, distances, device nodes and the node of each running vCPU against what the
//! command line said; the host side reads /proc/PID/numa_maps while the guest holds.
//!
//! This host has one NUMA node. Automatic mode runs over a fake sysfs tree of a
//! two-socket host (`GPUVM_TEST_SYSFS_ROOT`) with two emulated GPUs, one per socket; the
//! fake node 1 cannot be bound for real, so the test hook `GPUVM_TEST_NUMA_BIND_NODE=0`
//! binds every guest node's RAM to the real node 0 (gpuvm warns that the hook is on).

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{run_gpuvm, RunOutput, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

/// Guest RAM's mappings in `pid`'s numa_maps, (host address, policy), by address.
fn ram_policies(pid: i32) -> Vec<(u64, String)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/numa_maps")).unwrap();
    let mut found: Vec<(u64, String)> = maps
        .lines()
        .filter(|line| line.contains("gpuvm-guest-ram"))
        .map(|line| {
            let mut words = line.split_whitespace();
            let addr = u64::from_str_radix(words.next().unwrap(), 16).unwrap();
            (addr, words.next().unwrap().to_string())
        })
        .collect();
    found.sort();
    found
}

/// The host CPUs of host node 0, as /proc's Cpus_allowed_list shows a pinned thread's.
fn host_node0_cpus() -> String {
    std::fs::read_to_string("/sys/devices/system/node/node0/cpulist")
        .unwrap()
        .trim()
        .to_string()
}

/// Runs gpuvm with `args` (whose guest holds after `numa: ok`), hands its numa_maps'
/// guest RAM lines and its pid to `inspect` while it holds, and returns its output.
fn run_and_inspect(
    args: &[&str],
    env: &[(&str, &str)],
    inspect: impl FnOnce(i32, Vec<(u64, String)>),
) -> RunOutput {
    let mut gpuvm = SpawnedProcess::gpuvm_with_env(args, env);
    gpuvm.wait_for_stdout("numa: ok", LIMIT);
    let pid = gpuvm.pid();
    inspect(pid, ram_policies(pid));
    gpuvm.wait(LIMIT)
}

#[test]
fn two_nodes_get_srat_slit_and_each_node_s_ram_its_own_policy() {
    // Node 0 bound to host node 0, node 1 left to the host: the policy changes exactly
    // 512 MiB into guest RAM.
    let args = [
        "--log-level",
        "info",
        "run",
        "--no-thp",
        "--vcpus",
        "2",
        "--memory",
        "1G",
        "--numa",
        "node=0,cpus=0,mem_mib=512,host_node=0",
        "--numa",
        "node=1,cpus=1,mem_mib=512",
        "--cmdline",
        "numa cpus=0,1 mem=512M,512M dist=10,20,20,10 hold=2",
    ];
    let out = run_and_inspect(&args, &[], |_, policies| {
        assert_eq!(policies.len(), 2, "{policies:?}");
        assert_eq!(policies[0].1, "bind:0", "{policies:?}");
        assert_eq!(policies[1].1, "default", "{policies:?}");
        assert_eq!(policies[1].0 - policies[0].0, 512 * MIB, "{policies:?}");
    });
    out.assert_code(0)
        .assert_stdout_has("numa: SRAT memory node 0 0x0-0x20000000 flags 0x1")
        .assert_stdout_has("numa: SRAT memory node 1 0x20000000-0x40000000 flags 0x1")
        .assert_stdout_has("numa: vcpu apic 1 runs on node 1")
        .assert_stdout_has("numa: ok")
        .assert_stderr_has("guest NUMA node 0: vCPUs [0], 512 MiB bound to host node 0");
}

#[test]
fn both_nodes_bound_across_the_32_bit_hole_with_pinned_vcpus() {
    // 4 GiB: node 1's RAM is split by the 32-bit hole (3..4 GiB) into two SRAT ranges and
    // two mappings, both bound; each vCPU thread pinned to node 0's CPUs.
    let node0_cpus = host_node0_cpus();
    let args = [
        "--log-level",
        "info",
        "run",
        "--vcpus",
        "2",
        "--memory",
        "4G",
        "--numa",
        "node=0,cpus=0,mem_mib=2048,host_node=0",
        "--numa",
        "node=1,cpus=1,mem_mib=2048,host_node=0",
        "--numa-pin-vcpus",
        "--cmdline",
        "numa cpus=0,1 mem=2G,2G dist=10,20,20,10 hold=2",
    ];
    let out = run_and_inspect(&args, &[], |pid, policies| {
        assert!(!policies.is_empty());
        assert!(policies.iter().all(|(_, p)| p == "bind:0"), "{policies:?}");
        let vcpus: Vec<Vec<String>> =
            gpuvm_tests::thread_status_fields(pid, &["Name:", "Cpus_allowed_list:"])
                .into_iter()
                .filter(|f| f[0].starts_with("vcpu"))
                .collect();
        assert_eq!(vcpus.len(), 2, "{vcpus:?}");
        for fields in vcpus {
            assert_eq!(fields[1], node0_cpus, "{fields:?}");
        }
    });
    out.assert_code(0)
        .assert_stdout_has("numa: SRAT memory node 0 0x0-0x80000000 flags 0x1")
        .assert_stdout_has("numa: SRAT memory node 1 0x80000000-0xc0000000 flags 0x1")
        .assert_stdout_has("numa: SRAT memory node 1 0x100000000-0x140000000 flags 0x1")
        .assert_stdout_has("numa: vcpu apic 0 runs on node 0")
        .assert_stdout_has("numa: ok");
}

#[test]
fn the_guest_check_fails_when_expectations_differ() {
    let out = run_gpuvm(
        &[
            "run",
            "--vcpus",
            "2",
            "--memory",
            "256M",
            "--numa",
            "node=0,cpus=0,mem_mib=128",
            "--numa",
            "node=1,cpus=1,mem_mib=128",
            "--cmdline",
            "numa cpus=1,0 mem=128M,128M dist=10,20,20,10",
        ],
        LIMIT,
    );
    out.assert_code(1)
        .assert_stdout_has("numa: FAIL apic 0 is on node 0 in the SRAT, expected 1");
}

#[test]
fn without_numa_there_is_no_srat() {
    let out = run_gpuvm(&["run", "--cmdline", "numa cpus=0 mem=128M dist=10"], LIMIT);
    out.assert_code(1)
        .assert_stdout_has("numa: FAIL the XSDT lists no SRAT");
}

#[test]
fn bad_nodes_are_refused_before_the_vm_starts() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["node=0,cpus=0-1,mem_mib=512,host_node=7"],
            "--numa: host NUMA node 7 does not exist on this host",
        ),
        (
            &["node=0,cpus=0,mem_mib=256", "node=1,cpus=1,mem_mib=128"],
            "--numa: the nodes' memory adds up to 384 MiB, but the VM has 512 MiB",
        ),
        (
            &["node=0,cpus=0,mem_mib=512"],
            "--numa: vCPU 1 is on no node",
        ),
    ];
    for (nodes, message) in cases {
        let mut args = vec!["run", "--vcpus", "2", "--memory", "512M"];
        for node in nodes {
            args.extend(["--numa", node]);
        }
        run_gpuvm(&args, LIMIT).assert_clean_error(message);
    }
}

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

/// A two-socket host: node 0 and node 1 (distance 21), a GPU under each socket's root
/// complex, each GPU with its `numa_node`, linked from bus/pci/devices as sysfs does.
const HOST_GPUS: [(&str, &str, &str, u32); 2] = [
    ("pci0000:17", "0000:17:01.0", "0000:18:00.0", 0),
    ("pci0000:97", "0000:97:01.0", "0000:9a:00.0", 1),
];

fn fake_two_socket_sysfs(root: &Path) {
    fake_host_sysfs(root, &HOST_GPUS);
}

/// A two-socket host as [`fake_two_socket_sysfs`] with `gpus` (root complex, port, GPU,
/// node) under its sockets.
fn fake_host_sysfs(root: &Path, gpus: &[(&str, &str, &str, u32)]) {
    for (node, cpus) in [(0, "0-3"), (1, "4-7")] {
        let dir = root.join(format!("devices/system/node/node{node}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cpulist"), format!("{cpus}\n")).unwrap();
        let distance = if node == 0 { "10 21\n" } else { "21 10\n" };
        std::fs::write(dir.join("distance"), distance).unwrap();
    }
    let links = root.join("bus/pci/devices");
    std::fs::create_dir_all(&links).unwrap();
    for &(complex, port, gpu, node) in gpus {
        // `port`: the GPU's root port, or the chain of ports down to it through a switch
        // ("root port/upstream/downstream").
        let port_dir = root.join(format!("devices/{complex}/{port}"));
        let gpu_dir = port_dir.join(gpu);
        std::fs::create_dir_all(&gpu_dir).unwrap();
        std::fs::write(gpu_dir.join("numa_node"), format!("{node}\n")).unwrap();
        std::fs::write(port_dir.join("numa_node"), format!("{node}\n")).unwrap();
        let port_name = port.rsplit('/').next().unwrap();
        std::os::unix::fs::symlink(&port_dir, links.join(port_name)).unwrap();
        std::os::unix::fs::symlink(&gpu_dir, links.join(gpu)).unwrap();
    }
}

/// A VM with `--numa auto` on a fake two-socket host with `gpus` (each an emulated GPU
/// started with `emu_args`, its `topology_bdf` the host GPU it stands for): gpuvm runs
/// with `vm_args` (`--vcpus`, `--memory`, `--cmdline`, ...), the devices and the
/// environment that points it at the fake tree and binds every guest node's RAM to the
/// real node 0. `run` gets the arguments and the environment and returns gpuvm's output;
/// the device servers must then have ended well.
fn run_on_fake_two_socket_host(
    test: &str,
    gpus: &[(&str, &str, &str, u32)],
    emu_args: &[&str],
    vm_args: &[&str],
    run: impl FnOnce(&[&str], &[(&str, &str)]) -> RunOutput,
) -> RunOutput {
    let scratch = Scratch::new("numa", test);
    let sysfs = scratch.path("sys");
    fake_host_sysfs(&sysfs, gpus);
    let mut servers = Vec::new();
    let mut devices = Vec::new();
    for (index, (_, _, gpu, _)) in gpus.iter().enumerate() {
        let socket = scratch.path(&format!("gpu{index}.sock"));
        servers.push(gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, emu_args));
        devices.push(format!("{},topology_bdf={gpu}", socket.display()));
    }
    let mut args = vec!["--log-level", "info", "run", "--numa", "auto"];
    args.extend_from_slice(vm_args);
    for device in &devices {
        args.extend(["--vfio-user", device.as_str()]);
    }
    let env = [
        ("GPUVM_TEST_SYSFS_ROOT", sysfs.to_str().unwrap()),
        ("GPUVM_TEST_NUMA_BIND_NODE", "0"),
    ];
    let out = run(&args, &env);
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
    out
}

#[test]
fn auto_gives_each_gpu_s_socket_a_guest_node() {
    // 3 vCPUs and 512 MiB over two nodes: the remainder vCPU goes to node 0.
    let vm = [
        "--vcpus",
        "3",
        "--memory",
        "512M",
        "--cmdline",
        "numa cpus=0,0,1 mem=256M,256M dist=10,21,21,10 gi=0,1 hold=2",
    ];
    let out = run_on_fake_two_socket_host("auto", &HOST_GPUS, &[], &vm, |args, env| {
        run_and_inspect(args, env, |_, policies| {
            assert!(!policies.is_empty());
            assert!(policies.iter().all(|(_, p)| p == "bind:0"), "{policies:?}");
        })
    });
    out.assert_code(0)
        .assert_stdout_has("numa: ok")
        .assert_stdout_has("numa: vcpu apic 0 runs on node 0")
        .assert_stdout_has("numa: vcpu apic 1 runs on node 0")
        .assert_stdout_has("numa: vcpu apic 2 runs on node 1")
        .assert_stderr_has("guest NUMA node 1: vCPUs [2], 256 MiB bound to host node 0")
        .assert_stderr_has("test hook GPUVM_TEST_NUMA_BIND_NODE");
    let devices: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("numa: SRAT device "))
        .collect();
    assert_eq!(devices.len(), 2, "{}", out.stdout);
    // Linux reads a device's node from its host bridge only: the node-1 GPU is on a PCI
    // segment of its own (found there through the segment's ECAM window), the node-0 GPU
    // stays on segment 0.
    assert!(
        devices[0].starts_with("numa: SRAT device 0000:00:") && devices[0].contains(" node 0 "),
        "{devices:?}"
    );
    assert!(
        devices[1].starts_with("numa: SRAT device 0001:00:01.0 node 1 "),
        "{devices:?}"
    );
    out.assert_stdout_has("numa: device 0001:00:01.0 is ")
        .assert_stderr_has("PCI segment 1, whose host bridge is guest node 1's");
}

/// Two H100-like GPUs (64 GiB BAR1, 32 MiB BAR3, 16 MiB BAR0) under each socket.
const H100_HOST_GPUS: [(&str, &str, &str, u32); 4] = [
    ("pci0000:17", "0000:17:01.0", "0000:18:00.0", 0),
    ("pci0000:17", "0000:17:02.0", "0000:19:00.0", 0),
    ("pci0000:97", "0000:97:01.0", "0000:9a:00.0", 1),
    ("pci0000:97", "0000:97:02.0", "0000:9b:00.0", 1),
];

/// With `--numa auto`, node 1's two GPUs go on a PCI segment of their own whose BAR
/// windows are sized from them and one more (hot-plug onto the node's segment): 256 GiB
/// of 64-bit window (three BAR1s, the BAR3s in the gap after the first) and 48 MiB below
/// 4 GiB for their BAR0s, where the fixed 64 GiB and 16 MiB held not even one. The `big-bars` checks pass for all four GPUs, found on both
/// segments: every BAR assigned, aligned to its size, inside the host bridges' `_CRS`
/// windows, a word written and read back at both ends of each BAR1 and BAR3.
#[test]
fn a_node_segment_s_windows_hold_its_gpus_big_bars() {
    let vm = [
        "--vcpus",
        "2",
        "--memory",
        "256M",
        "--cmdline",
        "big-bars 4",
    ];
    let out = run_on_fake_two_socket_host(
        "node-segment-bars",
        &H100_HOST_GPUS,
        &["--bar1-mib", "65536"],
        &vm,
        |args, env| gpuvm_tests::run_gpuvm_with_env(args, env, LIMIT, None),
    );
    out.assert_code(0)
        .assert_stdout_has("big-bars: ok 4")
        .assert_stderr_has("PCI segment 1, whose host bridge is guest node 1's");
    let window = out
        .stderr
        .lines()
        .find(|l| l.contains("PCI segment 1: 64-bit BAR window "))
        .unwrap_or_else(|| panic!("segment 1's windows are logged: {}", out.stderr));
    assert!(window.contains("(256 GiB), 32-bit "), "{window}");
    assert!(
        window.contains(" 32-bit 0xe1000000..0xe4000000,"),
        "{window}"
    );
    let on_segment = |prefix: &str| {
        out.stdout
            .lines()
            .filter(|l| l.starts_with(prefix) && l.contains(" BAR1 "))
            .count()
    };
    assert_eq!(on_segment("big-bars: 00:"), 2, "{}", out.stdout);
    assert_eq!(on_segment("big-bars: 0001:00:"), 2, "{}", out.stdout);
    for line in out
        .stdout
        .lines()
        .filter(|l| l.contains(" size=0x1000000000 "))
    {
        // Each 64 GiB BAR1 on its own 64 GiB boundary (the guest checked it too).
        let address = line.split_whitespace().nth(3).unwrap();
        let address = u64::from_str_radix(address.trim_start_matches("0x"), 16).unwrap();
        assert_eq!(address % (64 << 30), 0, "{line}");
    }
}

#[test]
fn auto_on_this_single_node_host_gives_no_tables() {
    let out = run_gpuvm(
        &[
            "--log-level",
            "info",
            "run",
            "--vcpus",
            "2",
            "--numa",
            "auto",
            "--cmdline",
            "numa cpus=0,0 mem=128M dist=10",
        ],
        LIMIT,
    );
    out.assert_code(1)
        .assert_stdout_has("numa: FAIL the XSDT lists no SRAT")
        .assert_stderr_has("--numa auto: one guest node");
}

/// Cloud Hypervisor's `numa` VmConfig field: two nodes of one vCPU each with a distance
/// of 25, the RAM split evenly (gpuvm has no memory zones); the test guest checks the
/// SRAT and SLIT the field gave.
#[test]
fn cloud_hypervisor_numa_field_gives_the_guest_its_nodes() {
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch};
    let scratch = Scratch::new("numa", "cloud_hypervisor");
    let kernel = guest_image(&scratch);
    let api = scratch.path("clh-api.sock");
    let mut vmm = spawn_ch(&scratch, &["--api-socket", api.to_str().unwrap()]);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": {"kernel": kernel, "cmdline": "numa cpus=0,1 mem=256M,256M dist=10,25,25,10"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 512 * MIB, "thp": false},
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
        "numa": [
            {"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}]},
            {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}],
             "memory_zones": null, "pci_segments": null}
        ]
    })
    .to_string();
    // Memory zones are refused by name: gpuvm's RAM has none.
    let zoned = config.replace(r#""memory_zones":null"#, r#""memory_zones":["mem1"]"#);
    let refused = gpuvm_tests::api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some(&zoned));
    assert!(refused.contains("numa[1].memory_zones"), "{refused}");
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vmm.wait_for_stdout("numa: ok", LIMIT);
    let out = vmm.wait(LIMIT);
    out.assert_stdout_has("numa: SRAT memory node 0 0x0-0x10000000 flags 0x1")
        .assert_stdout_has("numa: SRAT memory node 1 0x10000000-0x20000000 flags 0x1")
        .assert_stdout_has("numa: vcpu apic 1 runs on node 1")
        .assert_stdout_has("numa: ok");
}

/// Cloud Hypervisor's `pci_segment` on a passthrough device (Kata's way to put a GPU on its
/// socket's host bridge): a vfio-user GPU added before boot with `pci_segment: 1` goes on
/// segment 1, which numa[1].pci_segments makes node 1's (gpuvm's log says where). A GPU added to the running VM off segment 0 is refused by name (hot-plug
/// is on segment 0). Linux's view of such a device's node: the real-kernel `linux-numa`.
#[test]
fn cloud_hypervisor_puts_a_gpu_on_the_segment_it_names() {
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch};
    let scratch = Scratch::new("numa", "ch_gpu_segment");
    let kernel = guest_image(&scratch);
    let api = scratch.path("clh-api.sock");
    let sockets = [scratch.path("gpu0.sock"), scratch.path("gpu1.sock")];
    let _emus: Vec<SpawnedProcess> = (sockets.iter())
        .map(|socket| gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[]))
        .collect();
    let mut vmm = spawn_ch(&scratch, &["-v", "--api-socket", api.to_str().unwrap()]);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": {"kernel": kernel, "cmdline": "numa cpus=0,1 mem=256M,256M dist=10,25,25,10 hold=60"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
        "memory": {"size": 512 * MIB, "thp": false},
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
        "platform": {"num_pci_segments": 2},
        "numa": [
            {"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}],
             "pci_segments": [0]},
            {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}],
             "pci_segments": [1]}
        ]
    })
    .to_string();
    let put = |status, route: &str, body: &serde_json::Value| {
        gpuvm_tests::api_expect(&api, status, "PUT", route, Some(&body.to_string()))
    };
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    let add = |socket: &Path, id: &str, segment: u16| serde_json::json!({"socket": socket, "id": id, "pci_segment": segment});
    // A segment the VM does not have is refused before anything is added.
    let refused = put(
        400,
        "/api/v1/vm.add-user-device",
        &add(&sockets[0], "gpu0", 2),
    );
    assert!(refused.contains("pci_segment = 2"), "{refused}");
    put(
        204,
        "/api/v1/vm.add-user-device",
        &add(&sockets[0], "gpu0", 1),
    );
    put(204, "/api/v1/vm.boot", &serde_json::json!({}));
    vmm.wait_for_stdout("numa: ok", LIMIT);
    assert!(
        vmm.stderr().contains("PCI 0001:00:01.0: vfio-user"),
        "{}",
        vmm.stderr()
    );
    // A GPU hot-plugged onto segment 1 goes on its bus 0 (its own ACPI hot-plug slots).
    let answer = put(
        200,
        "/api/v1/vm.add-user-device",
        &add(&sockets[1], "gpu1", 1),
    );
    assert!(answer.contains("0001:00:02.0"), "{answer}");
    // Other devices are hot-plugged on segment 0 only.
    let disk = scratch.path("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let refused = put(
        400,
        "/api/v1/vm.add-disk",
        &serde_json::json!({"path": disk, "id": "disk1", "pci_segment": 1}),
    );
    assert!(
        refused.contains("other devices on segment 0 only"),
        "{refused}"
    );
    assert!(!vmm.stdout().contains("FAIL"), "{}", vmm.stdout());
}

/// A GPU hot-plugged onto PCI segment 1 of a running VM (Cloud Hypervisor's
/// vm.add-user-device with `pci_segment`, as for a NUMA node's GPU) arrives through that
/// segment's own ACPI hot-plug registers: the guest finds it through the segment's ECAM
/// window, BAR1 lies naturally aligned in the segment's 64-bit window and its first and
/// last words read back. The VM is snapshotted with it (its state through VFIO
/// migration) and restored by a new process onto a fresh device process: there
/// vm.remove-device asks the guest to eject it on segment 1, and it goes.
#[test]
fn a_gpu_is_hot_plugged_onto_another_segment_and_ejected_there() {
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch, wait_for_vm};
    let scratch = Scratch::new("numa", "ch_segment_hotplug");
    let kernel = guest_image(&scratch);
    let api = scratch.path("clh-api.sock");
    let socket = scratch.path("gpu0.sock");
    let _emu = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]);
    let mut vmm = spawn_ch(&scratch, &["-v", "--api-socket", api.to_str().unwrap()]);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": {"kernel": kernel, "cmdline": "segment-hotplug 1"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 256 * MIB, "thp": false},
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
        "platform": {"num_pci_segments": 2},
    })
    .to_string();
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.boot", Some("{}"));
    vmm.wait_for_stdout("seghotplug: waiting on segment 1", LIMIT);
    let add = serde_json::json!({"socket": socket, "id": "gpu0", "pci_segment": 1});
    let answer = gpuvm_tests::api_expect(
        &api,
        200,
        "PUT",
        "/api/v1/vm.add-user-device",
        Some(&add.to_string()),
    );
    assert!(answer.contains("\"0001:00:01.0\""), "{answer}");
    vmm.wait_for_stdout("reads back", LIMIT);
    let found = vmm.stdout();
    assert!(
        found.contains("seghotplug: device at 0001:00:01.0 is the emulated GPU"),
        "{found}"
    );
    // BAR1 inside segment 1's 64-bit window, as gpuvm planned and logged it.
    let bar1 = hex_after(&found, "BAR1 at 0x");
    let window = vmm.stderr();
    let window = window
        .lines()
        .find(|line| line.contains("PCI segment 1: 64-bit BAR window"))
        .unwrap_or_else(|| panic!("{window}"))
        .to_string();
    let (start, end) = (hex_after(&window, "window 0x"), hex_after(&window, ".."));
    assert!(
        (start..end).contains(&bar1),
        "BAR1 {bar1:#x} outside {window}"
    );

    // Snapshotted with the GPU, restored by a new process onto a fresh device process.
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    let snapshot = scratch.path("snapshot");
    std::fs::create_dir(&snapshot).unwrap();
    let body = serde_json::json!({ "destination_url": format!("file://{}", snapshot.display()) });
    let body = body.to_string();
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&body));
    let files: Vec<String> = std::fs::read_dir(&snapshot)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let state = std::fs::read(snapshot.join("state")).unwrap_or_default();
    let state = String::from_utf8_lossy(&state);
    assert!(
        state.contains("\"pci_segment_hotplug\"") && state.contains("\"segment\":1"),
        "segment 1's hot-plug registers and the GPU's segment are saved: {files:?}"
    );
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    drop(_emu);
    let _fresh = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]);
    let api2 = scratch.path("clh-api2.sock");
    let source = format!("source_url=file://{}", snapshot.display());
    let mut restored = spawn_ch(
        &scratch,
        &[
            "-v",
            "--api-socket",
            api2.to_str().unwrap(),
            "--restore",
            &source,
        ],
    );
    gpuvm_tests::wait_for_api_socket(&mut restored, &api2);
    wait_for_vm(&mut restored, &api2, LIMIT);
    gpuvm_tests::api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    let info = gpuvm_tests::api_expect(&api2, 200, "GET", "/api/v1/vm.info", None);
    assert!(info.contains("0001:00:01.0"), "{info}");
    gpuvm_tests::api_expect(
        &api2,
        204,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id": "gpu0"}"#),
    );
    let out = restored.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("seghotplug: ejected 0001:00:01.0")
        .assert_stdout_has("seghotplug: ok");
    assert!(!out.stdout.contains("FAIL"), "{}", out.stdout);
}

/// The hexadecimal number right after `marker` in `text`.
fn hex_after(text: &str, marker: &str) -> u64 {
    let at = text
        .find(marker)
        .unwrap_or_else(|| panic!("{marker:?} in {text}"))
        + marker.len();
    let digits: String = text[at..]
        .trim_start_matches("0x")
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect();
    u64::from_str_radix(&digits, 16).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// A snapshot of a two-node VM carries its node plan: the restored process binds node
/// 0's RAM to host node 0 again and leaves node 1's to the host, as the first run did.
#[test]
fn a_restored_vm_binds_each_node_s_ram_again() {
    let scratch = Scratch::new("numa", "restore");
    let dir = scratch.path("snap");
    let args = [
        "--log-level",
        "info",
        "run",
        "--no-thp",
        "--vcpus",
        "2",
        "--memory",
        "1G",
        "--numa",
        "node=0,cpus=0,mem_mib=512,host_node=0",
        "--numa",
        "node=1,cpus=1,mem_mib=512",
        "--cmdline",
        "numa cpus=0,1 mem=512M,512M dist=10,20,20,10 hold=6",
        "--snapshot-dir",
        dir.to_str().unwrap(),
        "--snapshot-then",
        "exit",
    ];
    let expect_bound = |policies: &[(u64, String)]| {
        assert_eq!(policies.len(), 2, "{policies:?}");
        assert_eq!(policies[0].1, "bind:0", "{policies:?}");
        assert_eq!(policies[1].1, "default", "{policies:?}");
        assert_eq!(policies[1].0 - policies[0].0, 512 * MIB, "{policies:?}");
    };
    let mut first = SpawnedProcess::gpuvm(&args);
    first.wait_for_stdout("numa: ok", LIMIT);
    expect_bound(&ram_policies(first.pid()));
    gpuvm_tests::snapshot_support::signal_snapshot(first.pid());
    first.wait(LIMIT).assert_code(0);
    let state = gpuvm_tests::snapshot_support::read_state(&dir);
    assert_eq!(
        state["numa"]["nodes"][0]["host_node"], 0,
        "{}",
        state["numa"]
    );

    let mut restored = SpawnedProcess::gpuvm(&[
        "--log-level",
        "info",
        "restore",
        "--snapshot",
        dir.to_str().unwrap(),
    ]);
    restored.wait_for_stderr(
        "guest NUMA node 0: vCPUs [0], 512 MiB bound to host node 0",
        LIMIT,
    );
    expect_bound(&ram_policies(restored.pid()));
    restored.wait(LIMIT).assert_code(0);
}

/// A host tree that is broken or hostile where `--numa auto` reads it (a FIFO, a device
/// node, a directory, a huge or garbage file where an attribute should be, a symlink
/// loop where a device's link should be): gpuvm refuses with an error that names the
/// file and what it found, at once; it never blocks on a FIFO or reads without bound.
#[test]
fn a_hostile_host_tree_is_a_clear_error_at_once() {
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str); 6] = [
        (
            "fifo",
            |sys| {
                let path = sys.join("bus/pci/devices/0000:18:00.0/numa_node");
                std::fs::remove_file(&path).unwrap();
                let made = std::process::Command::new("mkfifo").arg(&path).status();
                assert!(made.unwrap().success());
            },
            "0000:18:00.0/numa_node is a FIFO, not a regular file",
        ),
        (
            "directory",
            |sys| {
                let path = sys.join("bus/pci/devices/0000:9a:00.0/numa_node");
                std::fs::remove_file(&path).unwrap();
                std::fs::create_dir(&path).unwrap();
            },
            "0000:9a:00.0/numa_node is a directory, not a regular file",
        ),
        (
            "garbage",
            |sys| {
                let path = sys.join("bus/pci/devices/0000:18:00.0/numa_node");
                std::fs::write(path, "\u{1b}[2J1;rm -rf\n").unwrap();
            },
            "0000:18:00.0/numa_node: cannot parse",
        ),
        (
            "dev-zero",
            |sys| {
                let path = sys.join("devices/system/node/node0/distance");
                std::fs::remove_file(&path).unwrap();
                std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
            },
            "node0/distance is a symbolic link, not a regular file",
        ),
        (
            "huge",
            |sys| {
                let path = sys.join("devices/system/node/node1/distance");
                std::fs::File::create(&path)
                    .unwrap()
                    .set_len(4 << 30)
                    .unwrap();
            },
            "node1/distance holds more than 65536 bytes",
        ),
        (
            "link-loop",
            |sys| {
                let links = sys.join("bus/pci/devices");
                std::fs::remove_file(links.join("0000:18:00.0")).unwrap();
                std::os::unix::fs::symlink(links.join("loop"), links.join("0000:18:00.0")).unwrap();
                std::os::unix::fs::symlink(links.join("0000:18:00.0"), links.join("loop")).unwrap();
            },
            "0000:18:00.0/numa_node: Too many levels of symbolic links",
        ),
    ];
    for (name, damage, message) in cases {
        let scratch = Scratch::new("numa", &format!("hostile-{name}"));
        let sysfs = scratch.path("sys");
        fake_two_socket_sysfs(&sysfs);
        damage(&sysfs);
        // No device process is started: the plan is made (and refused) before gpuvm
        // connects to any device.
        let mut args = vec!["run", "--vcpus", "2", "--memory", "512M", "--numa", "auto"];
        let devices: Vec<String> = HOST_GPUS
            .iter()
            .enumerate()
            .map(|(index, (_, _, gpu, _))| {
                let socket = scratch.path(&format!("gpu{index}.sock"));
                format!("{},topology_bdf={gpu}", socket.display())
            })
            .collect();
        for device in &devices {
            args.extend(["--vfio-user", device.as_str()]);
        }
        let started = std::time::Instant::now();
        let out = gpuvm_tests::run_gpuvm_with_env(
            &args,
            &[("GPUVM_TEST_SYSFS_ROOT", sysfs.to_str().unwrap())],
            Duration::from_secs(20),
            None,
        );
        out.assert_clean_error("--numa: ")
            .assert_clean_error(message);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{name}: {:?}",
            started.elapsed()
        );
    }
}

/// Cloud Hypervisor's `--numa` flag, once per node, gives the guest the nodes the API's
/// `numa` field gives (Kata's shape: `guest_numa_id=0,cpus=[0],distances=[1@25]`); a node
/// with memory zones is refused naming the flag and the field, before the guest runs.
#[test]
fn cloud_hypervisor_numa_flag_gives_the_guest_its_nodes() {
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch};
    let scratch = Scratch::new("numa", "cloud_hypervisor_flag");
    let kernel = guest_image(&scratch);
    let kernel = kernel.to_str().unwrap();
    let command_line = |nodes: &[&'static str]| {
        let mut args = vec![
            "--kernel",
            kernel,
            "--cmdline",
            "numa cpus=0,1 mem=256M,256M dist=10,25,25,10",
            "--cpus",
            "boot=2",
            "--memory",
            "size=512M,thp=off",
            "--serial",
            "tty",
            "--console",
            "off",
            "--numa",
        ];
        args.extend_from_slice(nodes);
        args
    };

    let refused = spawn_ch(
        &scratch,
        &command_line(&[
            "guest_numa_id=0,cpus=[0],distances=[1@25]",
            "guest_numa_id=1,cpus=[1],distances=[0@25],memory_zones=[mem1]",
        ]),
    )
    .wait(LIMIT);
    refused
        .assert_code(125)
        .assert_stderr_has("--numa: numa[1].memory_zones");
    assert!(!refused.stdout.contains("numa:"), "{}", refused.stdout);

    let mut vmm = spawn_ch(
        &scratch,
        &command_line(&[
            "guest_numa_id=0,cpus=[0],distances=[1@25]",
            "guest_numa_id=1,cpus=1,distances=[0@25]",
        ]),
    );
    vmm.wait_for_stdout("numa: ok", LIMIT);
    vmm.wait(LIMIT)
        .assert_stdout_has("numa: SRAT memory node 0 0x0-0x10000000 flags 0x1")
        .assert_stdout_has("numa: SRAT memory node 1 0x10000000-0x20000000 flags 0x1")
        .assert_stdout_has("numa: vcpu apic 1 runs on node 1")
        .assert_stdout_has("numa: ok");
}

/// Room for hot-plugged RAM (Cloud Hypervisor's `hotplug_size`) is a hot-pluggable,
/// enabled memory range in the SRAT, right after boot RAM and on the node that holds the
/// highest boot RAM (node 1 here); the guest checks it against its e820 map, and a wrong
/// expected node fails the check.
#[test]
fn the_hot_plug_area_is_a_hot_pluggable_range_of_the_last_node() {
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch};
    let scratch = Scratch::new("numa", "hotplug_area");
    let kernel = guest_image(&scratch);
    let kernel = kernel.to_str().unwrap();
    let run = |expected_node: u32| {
        let cmdline =
            format!("numa cpus=0,1 mem=256M,256M dist=10,25,25,10 hotplug={expected_node},1G");
        let args = [
            "--kernel",
            kernel,
            "--cmdline",
            cmdline.as_str(),
            "--cpus",
            "boot=2",
            "--memory",
            "size=512M,hotplug_size=1G,thp=off",
            "--serial",
            "tty",
            "--console",
            "off",
            "--numa",
            "guest_numa_id=0,cpus=[0],distances=[1@25]",
            "guest_numa_id=1,cpus=[1],distances=[0@25]",
        ];
        spawn_ch(&scratch, &args).wait(LIMIT)
    };
    run(1)
        .assert_code(0)
        .assert_stdout_has("numa: SRAT memory node 1 0x10000000-0x20000000 flags 0x1")
        .assert_stdout_has(
            "numa: SRAT hot-pluggable memory node 1 0x100000000-0x140000000 flags 0x3",
        )
        .assert_stdout_has("numa: ok");
    let wrong = run(0);
    wrong.assert_stdout_has(
        "numa: FAIL hot-pluggable range: node 1, 0x40000000 bytes; expected node 0",
    );
    assert_ne!(wrong.code(), Some(0), "{}", wrong.stdout);
}

/// With the host-mirroring PCIe topology each GPU sits behind a root port of its own on
/// its node's host bridge (bus 1 of segment 0 and of segment 1, not bus 0), and its
/// Generic Initiator names it there: the guest finds a function at each address the SRAT
/// gives, and each on its socket's node.
#[test]
fn devices_behind_root_ports_are_named_by_their_address_behind_the_port() {
    let scratch = Scratch::new("numa", "root_ports");
    let sysfs = scratch.path("sys");
    fake_two_socket_sysfs(&sysfs);
    let mut servers = Vec::new();
    let mut devices = Vec::new();
    for (index, (_, _, gpu, _)) in HOST_GPUS.iter().enumerate() {
        let socket = scratch.path(&format!("gpu{index}.sock"));
        servers.push(gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]));
        devices.push(format!("{},topology_bdf={gpu}", socket.display()));
    }
    let mut args = vec![
        "--log-level",
        "info",
        "run",
        "--vcpus",
        "2",
        "--memory",
        "512M",
        "--numa",
        "auto",
        "--pci-topology",
        "host",
        "--cmdline",
        "numa cpus=0,1 mem=256M,256M dist=10,21,21,10 gi=0,1",
    ];
    for device in &devices {
        args.extend(["--vfio-user", device.as_str()]);
    }
    let env = [
        ("GPUVM_TEST_SYSFS_ROOT", sysfs.to_str().unwrap()),
        ("GPUVM_TEST_NUMA_BIND_NODE", "0"),
    ];
    let out = SpawnedProcess::gpuvm_with_env(&args, &env).wait(LIMIT);
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
    // Each GPU behind a root port of its node's host bridge: node 1's on segment 1, whose
    // ECAM window covers the port's bus (the guest finds the GPU there through the MCFG),
    // so Linux would show it on node 1 and NCCL its port.
    out.assert_code(0)
        .assert_stderr_has(": root port")
        .assert_stderr_has("PCI segment 1, whose host bridge is guest node 1's")
        .assert_stdout_has("numa: ok");
    let named: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("numa: SRAT device "))
        .collect();
    assert_eq!(named.len(), 2, "{}", out.stdout);
    for (line, node) in named.iter().zip([0, 1]) {
        let (segment, bus) = (&line[..4], &line[5..7]);
        assert_eq!(
            segment,
            format!("{node:04x}"),
            "on its node's segment: {line}"
        );
        assert_ne!(bus, "00", "behind a root port, not on bus 0: {line}");
        assert!(line.contains(&format!(" node {node} ")), "{line}");
        let address = if node == 0 { &line[5..12] } else { &line[..12] };
        assert!(
            out.stdout
                .contains(&format!("numa: device {address} is 10de:")),
            "no emulated GPU answers at {address}\n{}",
            out.stdout
        );
    }
}

/// An 8-GPU host as HGX boards are built: on each socket two PCIe switches with two GPUs
/// each (chains of root port, switch upstream port, downstream port).
const HGX_HOST_GPUS: [(&str, &str, &str, u32); 8] = [
    (
        "pci0000:17",
        "0000:17:01.0/0000:18:00.0/0000:19:00.0",
        "0000:1a:00.0",
        0,
    ),
    (
        "pci0000:17",
        "0000:17:01.0/0000:18:00.0/0000:19:01.0",
        "0000:1b:00.0",
        0,
    ),
    (
        "pci0000:17",
        "0000:17:02.0/0000:28:00.0/0000:29:00.0",
        "0000:2a:00.0",
        0,
    ),
    (
        "pci0000:17",
        "0000:17:02.0/0000:28:00.0/0000:29:01.0",
        "0000:2b:00.0",
        0,
    ),
    (
        "pci0000:97",
        "0000:97:01.0/0000:98:00.0/0000:99:00.0",
        "0000:9a:00.0",
        1,
    ),
    (
        "pci0000:97",
        "0000:97:01.0/0000:98:00.0/0000:99:01.0",
        "0000:9b:00.0",
        1,
    ),
    (
        "pci0000:97",
        "0000:97:02.0/0000:a8:00.0/0000:a9:00.0",
        "0000:aa:00.0",
        1,
    ),
    (
        "pci0000:97",
        "0000:97:02.0/0000:a8:00.0/0000:a9:01.0",
        "0000:ab:00.0",
        1,
    ),
];

/// NUMA placement and the host's switches together, with a root port for hot-plug: each
/// socket's four GPUs sit behind two virtual switches on their node's host bridge
/// (segment 1 for node 1), so Linux would show each GPU on its socket's node and NCCL the
/// switches it shares. Each segment's ECAM window covers the buses its ports number:
/// segment 0 has 10 (bus 0, two switches of four buses, the hot-plug port's), so segment
/// 1's window starts 10 MiB after segment 0's, where it used to be 1 MiB; 19 MiB of ECAM
/// in all, past where the segments' 32-bit windows used to start. The guest finds every
/// GPU at the address its Generic Initiator names, through the MCFG's windows.
#[test]
fn each_node_s_gpus_keep_their_switches_on_the_node_s_segment() {
    let vm = [
        "--vcpus",
        "2",
        "--memory",
        "512M",
        "--pcie-root-ports",
        "1",
        "--cmdline",
        "numa cpus=0,1 mem=256M,256M dist=10,21,21,10 gi=0,0,0,0,1,1,1,1",
    ];
    let out = run_on_fake_two_socket_host("hgx", &HGX_HOST_GPUS, &[], &vm, |args, env| {
        gpuvm_tests::run_gpuvm_with_env(args, env, LIMIT, None)
    });
    out.assert_code(0)
        .assert_stdout_has("numa: ok")
        .assert_stderr_has("PCI segment 1, whose host bridge is guest node 1's")
        .assert_stderr_has("ECAM 0xe0a00000 (9 buses)");
    let upstream_ports = |segment_one: bool| {
        (out.stderr.lines())
            .filter(|l| l.contains("switch upstream") && l.contains("PCI 0001:") == segment_one)
            .count()
    };
    assert_eq!(upstream_ports(false), 2, "{}", out.stderr);
    assert_eq!(upstream_ports(true), 2, "{}", out.stderr);
    let named: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("numa: SRAT device "))
        .collect();
    assert_eq!(named.len(), 8, "{}", out.stdout);
    for (index, line) in named.iter().enumerate() {
        let node = index / 4;
        assert!(line.starts_with(&format!("{node:04x}:")), "{line}");
        assert!(line.contains(&format!(" node {node} ")), "{line}");
        // Behind a root port and a switch: bus 3 or later on either segment.
        let bus = u8::from_str_radix(&line[5..7], 16).unwrap();
        assert!(bus >= 3, "{line}");
    }
    let found = (out.stdout.lines())
        .filter(|l| l.starts_with("numa: device ") && l.contains(" is 10de:"))
        .count();
    assert_eq!(found, 8, "{}", out.stdout);
}

/// A VM handed to a new gpuvm by a live update keeps its nodes as placed: the new
/// process pins the vCPU threads it starts to their nodes' host CPUs, and its own
/// snapshots (and further updates) carry the node plan, as the first process's do.
#[test]
fn a_live_update_keeps_the_nodes_pinning_and_plan() {
    let scratch = Scratch::new("numa", "update");
    let api = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let node0_cpus = host_node0_cpus();
    let mut first = SpawnedProcess::gpuvm(&[
        "--log-level",
        "info",
        "run",
        "--no-thp",
        "--vcpus",
        "2",
        "--memory",
        "1G",
        "--numa",
        "node=0,cpus=0,mem_mib=512,host_node=0",
        "--numa",
        "node=1,cpus=1,mem_mib=512,host_node=0",
        "--numa-pin-vcpus",
        "--cmdline",
        "numa cpus=0,1 mem=512M,512M dist=10,20,20,10 hold=60",
        "--api-sock",
        api.to_str().unwrap(),
    ]);
    gpuvm_tests::wait_for_api_socket(&mut first, &api);
    gpuvm_tests::api_start_instance(&api);
    first.wait_for_stdout("numa: ok", LIMIT);
    let new = gpuvm_tests::updated_to(&gpuvm_tests::gpuvm_update(first.pid(), &[], &[]), "");
    // The first process ends once it handed the VM over (until then its API thread may
    // still take a connection on the shared socket); its output pipes are the VM's, which
    // the new process holds.
    gpuvm_tests::wait_process_gone(first.pid(), LIMIT, || "the first gpuvm runs on".into());
    // The new process's own vCPU threads, pinned by it.
    let vcpus: Vec<Vec<String>> =
        gpuvm_tests::thread_status_fields(new, &["Name:", "Cpus_allowed_list:"])
            .into_iter()
            .filter(|fields| fields[0].starts_with("vcpu"))
            .collect();
    assert_eq!(vcpus.len(), 2, "{vcpus:?}");
    for fields in &vcpus {
        assert_eq!(fields[1], node0_cpus, "{fields:?}");
    }
    // The RAM it took over stays bound (the policy is the memfd's).
    let policies = ram_policies(new);
    assert!(
        !policies.is_empty() && policies.iter().all(|(_, p)| p == "bind:0"),
        "{policies:?}"
    );
    gpuvm_tests::api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state":"Paused"}"#));
    let body = format!(
        r#"{{"snapshot_path":"{}","snapshot_type":"Full"}}"#,
        snap.display()
    );
    gpuvm_tests::api_expect(&api, 200, "PUT", "/snapshot/create", Some(&body));
    let state = gpuvm_tests::snapshot_support::read_state(&snap);
    let nodes = &state["numa"]["nodes"];
    assert_eq!(nodes[0]["host_node"], 0, "{}", state["numa"]);
    assert_eq!(nodes[1]["cpus"][0], 1, "{}", state["numa"]);
    assert_eq!(state["numa"]["pin_vcpus"], true, "{}", state["numa"]);
    // SAFETY: kill(2) has no memory effects; `new` is the gpuvm the update started.
    unsafe { libc::kill(new, libc::SIGKILL) };
}

/// A live update of the HGX-like VM of [`each_node_s_gpus_keep_their_switches_on_the_node_s_segment`]:
/// node 1's four GPUs sit behind two switches on PCI segment 1, whose windows, ECAM and ports
/// the first process planned from the GPUs. The new process builds segment 1 as the state
/// has it (not planned again: it opens no GPU), rebuilds the switches' ports on both
/// segments, and takes every GPU over at its address over the connection it had: each
/// device process sees one client and no new DMA map. The VM then ends through the API.
#[test]
fn each_node_s_gpus_behind_their_switches_go_across_a_live_update() {
    let scratch = Scratch::new("numa", "hgx-update");
    let api = scratch.path("api.sock");
    let vm = [
        "--api-sock",
        api.to_str().unwrap(),
        "--vcpus",
        "2",
        "--memory",
        "512M",
        "--cmdline",
        "numa cpus=0,1 mem=256M,256M dist=10,21,21,10 gi=0,0,0,0,1,1,1,1 hold=120",
    ];
    let out = run_on_fake_two_socket_host("hgx-update", &HGX_HOST_GPUS, &[], &vm, |args, env| {
        let mut first = SpawnedProcess::spawn_with_env(&gpuvm_tests::gpuvm_bin(), args, env);
        gpuvm_tests::wait_for_api_socket(&mut first, &api);
        gpuvm_tests::api_start_instance(&api);
        first.wait_for_stdout("numa: ok", LIMIT);
        let mut update_env = vec![("GPUVM_LOG", "info")];
        update_env.extend_from_slice(env);
        let update = gpuvm_tests::gpuvm_update(first.pid(), &[], &update_env);
        let new = gpuvm_tests::updated_to(&update, &first.stderr());
        let logged = format!(
            "{}{}",
            String::from_utf8_lossy(&update.stderr),
            first.stderr()
        );
        // Two switches on each segment (each with two downstream ports), and each GPU taken
        // over: node 1's four at segment 1's addresses.
        for (what, count) in [
            ("switch upstream port restored", 4),
            ("switch downstream port restored", 8),
            ("taken over from the old process (no reset", 8),
            ("live update: 0001:", 4),
        ] {
            assert_eq!(logged.matches(what).count(), count, "{what}\n{logged}");
        }
        gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
        gpuvm_tests::wait_process_gone(new, LIMIT, || first.stderr());
        first.wait(LIMIT)
    });
    assert!(!out.stdout.contains("FAIL"), "{}", out.stdout);
}
