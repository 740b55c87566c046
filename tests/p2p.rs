//! Peer-to-peer DMA between two emulated GPUs (issue 28): gpuvm DMA-maps each device's
//! BAR1 at its guest address in the other's DMA context (for vfio-user, a DMA_MAP with the
//! peer BAR's file), so GPU A's DMA engine writes GPU B's memory. The test guest's `p2p`
//! workload checks the pattern through its own mapping of B's BAR1, moves B's BAR1 and
//! checks that the DMA follows it and that the old address is no longer mapped; with
//! `p2p=off` on B, A's DMA to B's BAR1 fails. Hot-plugged GPUs get their peers' BARs and
//! give theirs, and an unplugged GPU's BARs leave its peers' contexts. A GPU restored from a
//! snapshot (VFIO migration) is a peer again.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{
    api_boot, api_expect, api_load_lazy, api_snapshot_create, gpu_body, run_gpuvm, spawn_api_vmm,
    RunOutput, SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

/// An emulated GPU's server on each socket.
fn start_servers(sockets: &[PathBuf]) -> Vec<SpawnedProcess> {
    sockets
        .iter()
        .map(|socket| gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[]))
        .collect()
}

/// Each server ended with status 0 once its VMM was gone.
fn assert_servers_ended_cleanly(servers: impl IntoIterator<Item = SpawnedProcess>) {
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
}

/// A VMM logging at info with its API on `api`, booted into the guest's `p2p hotplug`,
/// which waits for two hot-plugged GPUs.
fn start_vm_waiting_for_gpus(api: &Path) -> SpawnedProcess {
    let mut vmm = spawn_api_vmm(api, Some("info"), &[]);
    api_boot(api, "p2p hotplug");
    vmm.wait_for_stdout("p2p: waiting for 2 devices", LIMIT);
    vmm
}

/// PUT /gpus/ID with the GPU served on `socket` (answered 200).
fn hot_plug(api: &Path, id: &str, socket: &Path) {
    api_expect(
        api,
        200,
        "PUT",
        &format!("/gpus/{id}"),
        Some(&gpu_body(id, socket)),
    );
}

/// Once the guest's `p2p hotplug` has seen each GPU reach the other's BAR1, unplugs gpu-b
/// (DELETE /gpus/gpu-b) and waits for the VM's end: the guest saw B ejected and its old
/// address refused, and the VMM unmapped B's BAR from A's context.
fn unplug_b_once_peers(mut vmm: SpawnedProcess, api: &Path) -> RunOutput {
    vmm.wait_for_stdout("p2p: both directions ok", LIMIT);
    api_expect(api, 204, "DELETE", "/gpus/gpu-b", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("p2p: B ejected")
        .assert_stdout_has("p2p: ejected peer's address refused")
        .assert_stdout_has("p2p: ok hotplug")
        .assert_stderr_has("unmapped at");
    out
}

/// Runs the test guest's `p2p MODE...` with two emulated GPUs, B's `--vfio-user` value
/// followed by `b_options` (",p2p=off"); returns gpuvm's output once both servers ended.
fn run_two_gpus(name: &str, cmdline: &str, b_options: &str) -> RunOutput {
    let sockets = [
        gpuvm_tests::socket_path("p2p", &format!("{name}-a")),
        gpuvm_tests::socket_path("p2p", &format!("{name}-b")),
    ];
    let servers = start_servers(&sockets);
    let b = format!("{}{b_options}", sockets[1].display());
    let out = run_gpuvm(
        &[
            "--log-level",
            "info",
            "run",
            "--cmdline",
            cmdline,
            "--vfio-user",
            sockets[0].to_str().unwrap(),
            "--vfio-user",
            &b,
        ],
        LIMIT,
    );
    assert_servers_ended_cleanly(servers);
    out
}

#[test]
fn a_gpus_dma_reaches_its_peers_bar_and_follows_it_when_moved() {
    let out = run_two_gpus("move", "p2p", "");
    out.assert_code(0)
        .assert_stdout_has("p2p: A 00:01.0 B 00:02.0")
        .assert_stdout_has("p2p: moved B.BAR1 to")
        .assert_stdout_has("p2p: old address refused")
        .assert_stdout_has("p2p: ok");
    // Two checked DMAs, one before and one after the move, at different addresses.
    let checked: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("p2p: dma at ") && l.ends_with(" ok"))
        .collect();
    assert_eq!(checked.len(), 2, "{}", out.stdout);
    assert_ne!(checked[0], checked[1], "{}", out.stdout);
    // The VMM mapped each device's BAR1 for the other, and unmapped B's old address.
    out.assert_stderr_has("'s BAR1 +0x0 (256 MiB) mapped at")
        .assert_stderr_has("unmapped at");
}

#[test]
fn p2p_off_keeps_a_gpus_bars_from_its_peers() {
    let out = run_two_gpus("off", "p2p off", ",p2p=off");
    out.assert_code(0)
        .assert_stdout_has("p2p: peer refused")
        .assert_stdout_has("p2p: ok off")
        .assert_stderr_has("p2p=off, its BARs are not DMA-mapped for its peers");
}

/// Both GPUs hot-plugged into a running VM (PUT /gpus): each reaches the other's BAR1;
/// after DELETE /gpus/gpu-b (the guest ejects it), A's DMA to B's old BAR1 address fails.
#[test]
fn hot_plugged_gpus_are_peers_until_one_is_unplugged() {
    let sockets = [
        gpuvm_tests::socket_path("p2p", "hot-a"),
        gpuvm_tests::socket_path("p2p", "hot-b"),
    ];
    let servers = start_servers(&sockets);
    let api = gpuvm_tests::socket_path("p2p", "hot-api");
    let vmm = start_vm_waiting_for_gpus(&api);
    for (id, socket) in ["gpu-a", "gpu-b"].iter().zip(&sockets) {
        hot_plug(&api, id, socket);
    }
    unplug_b_once_peers(vmm, &api);
    assert_servers_ended_cleanly(servers);
}

/// A GPU restored from a snapshot (VFIO migration: its state saved beside RAM, the device
/// opened again on restore) is a peer again: GPU A is hot-plugged and the VM snapshotted
/// while the guest's `p2p hotplug` waits for its second GPU; the VM is restored into a new
/// VMM, GPU B is hot-plugged there, and A's DMA reaches B's BAR1 (B's BAR mapped in the
/// restored A's context) and B's reaches A's (the restored A's BARs, where the restored
/// guest has them, mapped in B's context). Then B is unplugged and leaves A's context.
#[test]
fn a_restored_gpu_is_a_peer_again() {
    let scratch = gpuvm_tests::Scratch::new("p2p", "restore");
    let sockets = [
        gpuvm_tests::socket_path("p2p", "restore-a"),
        gpuvm_tests::socket_path("p2p", "restore-b"),
    ];
    // A serves the snapshotted VM, then the restored one.
    let server_a = gpuvm_tests::start_emu_gpu(&emu_bin(), &sockets[0], &["--clients", "2"]);
    let api = gpuvm_tests::socket_path("p2p", "restore-api");
    let mut vmm = start_vm_waiting_for_gpus(&api);
    hot_plug(&api, "gpu-a", &sockets[0]);
    let dir = scratch.path("snap");
    api_snapshot_create(&api, &dir);
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));

    let server_b = gpuvm_tests::start_emu_gpu(&emu_bin(), &sockets[1], &[]);
    let api2 = gpuvm_tests::socket_path("p2p", "restore-api2");
    let restored = spawn_api_vmm(&api2, Some("info"), &[]);
    api_load_lazy(&api2, &dir);
    hot_plug(&api2, "gpu-b", &sockets[1]);
    unplug_b_once_peers(restored, &api2)
        .assert_stderr_has("restore: gpu-a is back at")
        .assert_stderr_has("'s BAR1 +0x0 (256 MiB) mapped at");
    assert_servers_ended_cleanly([server_a, server_b]);
}
