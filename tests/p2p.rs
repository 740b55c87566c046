//! Peer-to-peer DMA between two emulated GPUs (issue 28): gpuvm DMA-maps each device's
//! BAR1 at its guest address in the other's DMA context (for vfio-user, a DMA_MAP with the
//! peer BAR's file), so GPU A's DMA engine writes GPU B's memory. The test guest's `p2p`
//! workload checks the pattern through its own mapping of B's BAR1, moves B's BAR1 and
//! checks that the DMA follows it and that the old address is no longer mapped; with
//! `p2p=off` on B, A's DMA to B's BAR1 fails. Hot-plugged GPUs get their peers' BARs and
//! give theirs, and an unplugged GPU's BARs leave its peers' contexts. A GPU restored from a
//! snapshot (VFIO migration) is a peer again.

use std::path::PathBuf;
use std::time::Duration;

use gpuvm_tests::{
    api_expect, api_start_instance, run_gpuvm, wait_for_api_socket, RunOutput, SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

/// Runs the test guest's `p2p MODE...` with two emulated GPUs, B's `--vfio-user` value
/// followed by `b_options` (",p2p=off"); returns gpuvm's output once both servers ended.
fn run_two_gpus(name: &str, cmdline: &str, b_options: &str) -> RunOutput {
    let sockets = [
        gpuvm_tests::socket_path("p2p", &format!("{name}-a")),
        gpuvm_tests::socket_path("p2p", &format!("{name}-b")),
    ];
    let servers: Vec<SpawnedProcess> = sockets
        .iter()
        .map(|socket| gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[]))
        .collect();
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
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
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
    let servers: Vec<SpawnedProcess> = sockets
        .iter()
        .map(|socket| gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[]))
        .collect();
    let api = gpuvm_tests::socket_path("p2p", "hot-api");
    let mut vmm = SpawnedProcess::gpuvm_with_env(
        &[
            "--log-level",
            "info",
            "run",
            "--api-sock",
            api.to_str().unwrap(),
        ],
        &[],
    );
    wait_for_api_socket(&mut vmm, &api);
    let boot = serde_json::json!({ "boot_args": "p2p hotplug" }).to_string();
    api_expect(&api, 204, "PUT", "/boot-source", Some(&boot));
    api_start_instance(&api);
    vmm.wait_for_stdout("p2p: waiting for 2 devices", LIMIT);
    for (id, socket) in ["gpu-a", "gpu-b"].iter().zip(&sockets) {
        let body = serde_json::json!({ "gpu_id": id, "vfio_user_socket": socket }).to_string();
        api_expect(&api, 200, "PUT", &format!("/gpus/{id}"), Some(&body));
    }
    vmm.wait_for_stdout("p2p: both directions ok", LIMIT);
    api_expect(&api, 204, "DELETE", "/gpus/gpu-b", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("p2p: B ejected")
        .assert_stdout_has("p2p: ejected peer's address refused")
        .assert_stdout_has("p2p: ok hotplug")
        .assert_stderr_has("unmapped at");
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
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
    let mut vmm = SpawnedProcess::gpuvm_with_env(
        &[
            "--log-level",
            "info",
            "run",
            "--api-sock",
            api.to_str().unwrap(),
        ],
        &[],
    );
    wait_for_api_socket(&mut vmm, &api);
    let boot = serde_json::json!({ "boot_args": "p2p hotplug" }).to_string();
    api_expect(&api, 204, "PUT", "/boot-source", Some(&boot));
    api_start_instance(&api);
    vmm.wait_for_stdout("p2p: waiting for 2 devices", LIMIT);
    let gpu_body = |id: &str, socket: &PathBuf| {
        serde_json::json!({ "gpu_id": id, "vfio_user_socket": socket }).to_string()
    };
    api_expect(
        &api,
        200,
        "PUT",
        "/gpus/gpu-a",
        Some(&gpu_body("gpu-a", &sockets[0])),
    );
    let dir = scratch.path("snap");
    let create = serde_json::json!({ "snapshot_path": dir }).to_string();
    api_expect(&api, 200, "PUT", "/snapshot/create", Some(&create));
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));

    let server_b = gpuvm_tests::start_emu_gpu(&emu_bin(), &sockets[1], &[]);
    let api2 = gpuvm_tests::socket_path("p2p", "restore-api2");
    let mut restored = SpawnedProcess::gpuvm_with_env(
        &[
            "--log-level",
            "info",
            "run",
            "--api-sock",
            api2.to_str().unwrap(),
        ],
        &[],
    );
    wait_for_api_socket(&mut restored, &api2);
    let load = serde_json::json!({
        "snapshot_path": dir,
        "restore_mode": "Lazy",
        "resume_vm": true,
    })
    .to_string();
    api_expect(&api2, 204, "PUT", "/snapshot/load", Some(&load));
    api_expect(
        &api2,
        200,
        "PUT",
        "/gpus/gpu-b",
        Some(&gpu_body("gpu-b", &sockets[1])),
    );
    restored.wait_for_stdout("p2p: both directions ok", LIMIT);
    api_expect(&api2, 204, "DELETE", "/gpus/gpu-b", None);
    let out = restored.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("p2p: B ejected")
        .assert_stdout_has("p2p: ejected peer's address refused")
        .assert_stdout_has("p2p: ok hotplug")
        .assert_stderr_has("restore: gpu-a is back at")
        .assert_stderr_has("'s BAR1 +0x0 (256 MiB) mapped at")
        .assert_stderr_has("unmapped at");
    for server in [server_a, server_b] {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
}
