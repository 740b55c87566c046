//! The GPUDirect clique capability (issue 28): four emulated GPUs stand for host GPUs
//! (`--vfio-user SOCKET,topology_bdf=BDF`) in a fake sysfs tree (GPUVM_TEST_SYSFS_ROOT);
//! gpuvm derives each GPU's clique from where its host GPU sits (behind one switch, or
//! under one root complex: one clique) and shows it in the vendor capability NVIDIA's
//! driver reads. The test guest's `gpu-clique` workload walks each GPU's capability list
//! and prints the clique it finds. An explicit `clique=` overrides the derived one; a GPU
//! hot-plugged with `gpudirect_clique` gets it, and a snapshot records it.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{run_gpuvm_with_env, RunOutput, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);

/// A fake sysfs tree in the temporary directory, removed on drop.
struct FakeSysfs {
    root: PathBuf,
}

impl FakeSysfs {
    /// A tree with a device at each `chain` ("pci0000:40/0000:40:01.0/.../BDF"), linked
    /// from bus/pci/devices as the kernel links them.
    fn new(name: &str, chains: &[&str]) -> FakeSysfs {
        let root =
            std::env::temp_dir().join(format!("gpuvm-gpu-clique-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        for chain in chains {
            std::fs::create_dir_all(root.join("devices").join(chain)).unwrap();
            let bdf = chain.rsplit('/').next().unwrap();
            symlink(
                Path::new("../../../devices").join(chain),
                root.join("bus/pci/devices").join(bdf),
            )
            .unwrap();
        }
        FakeSysfs { root }
    }
}

impl Drop for FakeSysfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Two switches on two root ports of one root complex, two GPUs behind each.
const TWO_SWITCHES: &[&str] = &[
    "pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:00.0/0000:43:00.0",
    "pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:01.0/0000:44:00.0",
    "pci0000:40/0000:40:02.0/0000:51:00.0/0000:52:00.0/0000:53:00.0",
    "pci0000:40/0000:40:02.0/0000:51:00.0/0000:52:01.0/0000:54:00.0",
];

/// Four GPUs on four root ports of one root complex, no switch.
const ONE_ROOT_COMPLEX: &[&str] = &[
    "pci0000:40/0000:40:01.0/0000:43:00.0",
    "pci0000:40/0000:40:02.0/0000:44:00.0",
    "pci0000:40/0000:40:03.0/0000:53:00.0",
    "pci0000:40/0000:40:04.0/0000:54:00.0",
];

/// The host GPUs the four emulated ones stand for, in plug order.
const HOST_GPUS: [&str; 4] = [
    "0000:43:00.0",
    "0000:44:00.0",
    "0000:53:00.0",
    "0000:54:00.0",
];

/// Starts one emulated GPU per entry of `options` (what follows the socket in
/// `--vfio-user`), runs `gpu-clique 4` with them and `tree` as sysfs, and returns what the
/// guest read from each GPU ("clique N" or "none"), in the order of `options`: the guest
/// names GPUs by their guest address, which gpuvm's log ties to the socket.
fn guest_cliques(name: &str, tree: &FakeSysfs, options: &[String]) -> (Vec<String>, RunOutput) {
    let emu = PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let mut servers: Vec<SpawnedProcess> = Vec::new();
    let mut sockets = Vec::new();
    let mut values = Vec::new();
    for (i, option) in options.iter().enumerate() {
        let socket = gpuvm_tests::socket_path("gpu-clique", &format!("{name}-{i}"));
        servers.push(gpuvm_tests::start_emu_gpu(&emu, &socket, &[]));
        values.push(format!("{},{option}", socket.display()));
        sockets.push(socket.display().to_string());
    }
    let mut args = vec!["--log-level", "info", "run", "--cmdline", "gpu-clique 4"];
    for value in &values {
        args.extend(["--vfio-user", value.as_str()]);
    }
    let root = tree.root.to_str().unwrap();
    let out = run_gpuvm_with_env(&args, &[("GPUVM_TEST_SYSFS_ROOT", root)], LIMIT, None);
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
    out.assert_code(0).assert_stdout_has("gpu-clique: ok 4");
    let mut cliques = vec![String::new(); sockets.len()];
    for line in out.stdout.lines() {
        let Some((address, found)) = line
            .strip_prefix("gpu-clique: ")
            .and_then(|rest| rest.split_once(' '))
            .filter(|(address, _)| *address != "ok")
        else {
            continue;
        };
        // gpuvm logs "PCI BB:DD.F: <device name>" where it plugs each device.
        let plugged = format!("PCI {address}: ");
        let device = out
            .stderr
            .lines()
            .find_map(|l| l.split_once(&plugged).map(|(_, name)| name.trim()))
            .unwrap_or_else(|| panic!("no '{plugged}' in the log\n{}", out.describe()));
        let index = sockets
            .iter()
            .position(|socket| device.ends_with(socket.as_str()))
            .unwrap_or_else(|| panic!("{device} is none of {sockets:?}"));
        cliques[index] = found.to_string();
    }
    (cliques, out)
}

fn derived_from_host() -> Vec<String> {
    HOST_GPUS
        .iter()
        .map(|bdf| format!("topology_bdf={bdf}"))
        .collect()
}

#[test]
fn gpus_behind_two_switches_get_two_cliques() {
    let tree = FakeSysfs::new("switches", TWO_SWITCHES);
    let (cliques, out) = guest_cliques("switches", &tree, &derived_from_host());
    assert_eq!(
        cliques,
        ["clique 0", "clique 0", "clique 1", "clique 1"],
        "{}",
        out.describe()
    );
    // The host place behind each clique is logged.
    out.assert_stderr_has("switch 0000:41:00.0 (PIX with 0000:44:00.0)");
}

#[test]
fn gpus_under_one_root_complex_share_one_clique() {
    let tree = FakeSysfs::new("rootcomplex", ONE_ROOT_COMPLEX);
    let (cliques, out) = guest_cliques("rootcomplex", &tree, &derived_from_host());
    assert_eq!(cliques, ["clique 0"; 4], "{}", out.describe());
}

#[test]
fn an_explicit_clique_overrides_and_no_host_place_gets_none() {
    let tree = FakeSysfs::new("explicit", TWO_SWITCHES);
    let mut options = derived_from_host();
    options[2] = "topology_bdf=0000:53:00.0,clique=7".to_string();
    // No host device to derive from: no capability, and the VM still runs.
    options[1] = "p2p=on".to_string();
    let (cliques, out) = guest_cliques("explicit", &tree, &options);
    assert_eq!(
        cliques,
        ["clique 0", "none", "clique 7", "clique 1"],
        "{}",
        out.describe()
    );
    out.assert_stderr_has("no GPUDirect clique: none given and no host device");
}

/// A GPU hot-plugged with `gpudirect_clique` in PUT /gpus gets the capability before the
/// guest hears of it, and a snapshot records the clique the guest saw (the restore gives
/// the guest that clique again: vfio/src/pci.rs unit tests).
#[test]
fn a_hot_plugged_gpu_takes_its_clique_into_the_snapshot() {
    let scratch = gpuvm_tests::Scratch::new("gpu-clique", "hotplug");
    let socket = gpuvm_tests::socket_path("gpu-clique", "hotplug-emu");
    let emu = PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let server = gpuvm_tests::start_emu_gpu(&emu, &socket, &[]);
    let api = gpuvm_tests::socket_path("gpu-clique", "hotplug-api");
    let mut vmm = gpuvm_tests::spawn_api_vmm(&api, Some("info"), &[]);
    gpuvm_tests::api_boot(&api, "gpu-migrate");
    vmm.wait_for_stdout("gpu-migrate: waiting for a device", LIMIT);
    let gpu = serde_json::json!({
        "gpu_id": "gpu0",
        "vfio_user_socket": socket,
        "gpudirect_clique": 5,
    })
    .to_string();
    gpuvm_tests::api_expect(&api, 200, "PUT", "/gpus/gpu0", Some(&gpu));
    vmm.wait_for_stdout("gpu-migrate: iter 1 ok", LIMIT);
    let dir = scratch.path("snap");
    gpuvm_tests::api_snapshot_create(&api, &dir);
    let state = std::fs::read(dir.join("state")).expect("state file");
    let state = String::from_utf8_lossy(&state);
    assert!(
        state.contains("\"gpudirect_clique\":5"),
        "the snapshot records the clique"
    );
    vmm.signal(libc::SIGKILL);
    let out = vmm.wait(Duration::from_secs(10));
    assert!(
        out.stderr
            .contains("GPUDirect clique 5 (capability at 0xc8)"),
        "{}",
        out.describe()
    );
    let emu_out = server.wait(Duration::from_secs(10));
    assert!(!emu_out.stderr.contains("panicked"), "{}", emu_out.stderr);
}
