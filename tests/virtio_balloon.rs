//! The memory balloon end to end: the test guest's `virtio-balloon` driver inflates to the
//! target the API sets (PATCH /balloon) and the host frees the memory behind those pages
//! (the guest RAM memfd's allocated blocks drop), deflates and finds the pages zeroed,
//! sends statistics when polling is on; the balloon's target and actual survive a snapshot
//! and restore; a hostile driver's buffers are refused while the VM runs on; Firecracker's
//! `/balloon` routes (through a `firecracker` symlink) and the refusals (passthrough
//! devices, a target larger than memory).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::{
    api_expect, api_start_instance, gpuvm_bin, run_gpuvm, wait_for_api_socket, Scratch,
    SpawnedProcess,
};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

fn get(api: &Path, path: &str) -> Value {
    serde_json::from_str(&api_expect(api, 200, "GET", path, None)).unwrap()
}

fn call(api: &Path, status: u16, method: &str, path: &str, body: Value) -> String {
    api_expect(api, status, method, path, Some(&body.to_string()))
}

/// `gpuvm run --api-sock` waiting for its configuration.
fn start_api(scratch: &Scratch) -> (SpawnedProcess, PathBuf) {
    let api = scratch.path("api.sock");
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    (vmm, api)
}

/// Configures 256 MiB, the test guest with `boot_args`, and `balloon`, then starts.
fn boot(api: &Path, boot_args: &str, balloon: Value) {
    call(
        api,
        204,
        "PUT",
        "/machine-config",
        json!({"vcpu_count": 1, "mem_size_mib": 256}),
    );
    call(
        api,
        204,
        "PUT",
        "/boot-source",
        json!({ "boot_args": boot_args }),
    );
    call(api, 204, "PUT", "/balloon", balloon);
    api_start_instance(api);
}

/// How many times `needle` appears in the output so far.
fn count(vmm: &SpawnedProcess, needle: &str) -> usize {
    vmm.stdout().matches(needle).count()
}

/// Waits until `needle` appeared `times` times.
fn wait_for_count(vmm: &mut SpawnedProcess, needle: &str, times: usize) {
    vmm.wait_until(needle, LIMIT, |p| count(p, needle) >= times);
}

/// Bytes the guest RAM memfd of process `pid` has allocated (st_blocks of
/// /proc/PID/fd/N, whose link names the memfd).
fn guest_ram_allocated(pid: i32) -> u64 {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap();
    let mut total = 0;
    let mut found = false;
    for fd in fds.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if target.to_string_lossy().contains("gpuvm-guest-ram") {
            total += std::fs::metadata(fd.path()).unwrap().blocks() * 512;
            found = true;
            // One memfd backs every region.
            break;
        }
    }
    assert!(found, "no gpuvm-guest-ram memfd among /proc/{pid}/fd");
    total
}

/// Polls GET /balloon/statistics until `ready` accepts it.
fn wait_for_stats(api: &Path, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let stats = get(api, "/balloon/statistics");
        if ready(&stats) {
            return stats;
        }
        assert!(started.elapsed() < LIMIT, "{what}: last statistics {stats}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn inflating_frees_host_memory_and_deflated_pages_read_as_zero() {
    let scratch = Scratch::new("virtio_balloon", "inflate");
    let (mut vmm, api) = start_api(&scratch);
    // The guest fills 80 MiB of the balloon's pages first, so the host holds them.
    boot(
        &api,
        "virtio-balloon 80",
        json!({"amount_mib": 0, "deflate_on_oom": false, "stats_polling_interval_s": 1}),
    );
    vmm.wait_for_stdout("virtio-balloon: actual 0 pages", LIMIT);
    assert!(vmm.stdout().contains("virtio-balloon: touched 20480 pages"));
    let before = guest_ram_allocated(vmm.pid());

    call(&api, 204, "PATCH", "/balloon", json!({"amount_mib": 64}));
    vmm.wait_for_stdout("virtio-balloon: actual 16384 pages", LIMIT);
    let stats = wait_for_stats(&api, "actual reaches the target", |s| {
        s["actual_pages"] == 16384
    });
    assert_eq!(stats["target_pages"], 16384, "{stats}");
    assert_eq!(
        (stats["target_mib"].clone(), stats["actual_mib"].clone()),
        (json!(64), json!(64))
    );
    let after = guest_ram_allocated(vmm.pid());
    assert!(
        before >= after + 60 * MIB,
        "the guest RAM memfd held {before} bytes before inflating 64 MiB and {after} after"
    );
    let config = get(&api, "/balloon");
    assert_eq!(
        config,
        json!({"amount_mib": 64, "deflate_on_oom": false, "stats_polling_interval_s": 1})
    );

    // The guest's statistics arrive, and follow the balloon (the device asks every second).
    let stats = wait_for_stats(&api, "statistics after inflating", |s| {
        s["total_memory"].as_u64().is_some_and(|total| {
            s["free_memory"].as_u64() == Some(total - 64 * MIB)
                && s["available_memory"] == s["free_memory"]
        })
    });
    assert!(
        stats["total_memory"].as_u64().unwrap() > 64 * MIB,
        "{stats}"
    );
    // Asked again a second later: the guest answers each request (the first answer may
    // already show the inflated balloon, when it was inflated within the first second).
    wait_for_count(&mut vmm, "virtio-balloon: stats sent", 2);

    // Back to 0: the guest deflates and checks the pages the host freed read as zero.
    call(&api, 204, "PATCH", "/balloon", json!({"amount_mib": 0}));
    wait_for_count(&mut vmm, "virtio-balloon: actual 0 pages", 2);
    assert!(vmm
        .stdout()
        .contains("virtio-balloon: deflated pages read as zero"));
    assert!(!vmm.stdout().contains("FAIL"), "{}", vmm.stdout());
    wait_for_stats(&api, "actual back to 0", |s| s["actual_pages"] == 0);

    // Statistics stay on (they cannot be turned off after boot); the interval can change.
    let refused = call(
        &api,
        400,
        "PATCH",
        "/balloon/statistics",
        json!({"stats_polling_interval_s": 0}),
    );
    assert!(refused.contains("cannot be turned off"), "{refused}");
    call(
        &api,
        204,
        "PATCH",
        "/balloon/statistics",
        json!({"stats_polling_interval_s": 2}),
    );
    assert_eq!(get(&api, "/balloon")["stats_polling_interval_s"], 2);
    // More than the guest's memory is refused.
    let refused = call(&api, 400, "PATCH", "/balloon", json!({"amount_mib": 257}));
    assert!(refused.contains("more than the guest"), "{refused}");
    vmm.signal(libc::SIGKILL);
}

#[test]
fn snapshot_and_restore_keep_target_and_actual() {
    let scratch = Scratch::new("virtio_balloon", "snapshot");
    let (mut vmm, api) = start_api(&scratch);
    boot(
        &api,
        "virtio-balloon",
        json!({"amount_mib": 16, "deflate_on_oom": true, "stats_polling_interval_s": 1}),
    );
    vmm.wait_for_stdout("virtio-balloon: actual 4096 pages", LIMIT);
    wait_for_stats(&api, "actual reaches the target", |s| {
        s["actual_pages"] == 4096 && s["total_memory"].is_u64()
    });
    let snapshot = scratch.path("snap");
    call(
        &api,
        200,
        "PUT",
        "/snapshot/create",
        json!({ "snapshot_path": snapshot }),
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);

    let restored_scratch = Scratch::new("virtio_balloon", "snapshot-restored");
    let (mut restored, api) = start_api(&restored_scratch);
    call(
        &api,
        204,
        "PUT",
        "/snapshot/load",
        json!({"snapshot_path": snapshot, "restore_mode": "Eager", "resume_vm": true}),
    );
    let stats = get(&api, "/balloon/statistics");
    assert_eq!(
        (stats["target_pages"].clone(), stats["actual_pages"].clone()),
        (json!(4096), json!(4096)),
        "{stats}"
    );
    // The statistics the guest sent before the snapshot came along.
    assert!(stats["total_memory"].is_u64(), "{stats}");
    assert_eq!(
        get(&api, "/balloon"),
        json!({"amount_mib": 16, "deflate_on_oom": true, "stats_polling_interval_s": 1})
    );
    // The restored device serves the guest's driver: it deflates on request, and the
    // device keeps asking for statistics (the held buffer came back with the snapshot).
    call(&api, 204, "PATCH", "/balloon", json!({"amount_mib": 0}));
    restored.wait_for_stdout("virtio-balloon: actual 0 pages", LIMIT);
    restored.wait_for_stdout("virtio-balloon: stats sent", LIMIT);
    assert!(restored
        .stdout()
        .contains("virtio-balloon: deflated pages read as zero"));
    wait_for_stats(&api, "actual back to 0", |s| s["actual_pages"] == 0);
    restored.signal(libc::SIGKILL);
}

#[test]
fn a_hostile_drivers_buffers_are_refused_and_the_vm_runs_on() {
    let scratch = Scratch::new("virtio_balloon", "hostile");
    let (mut vmm, api) = start_api(&scratch);
    boot(
        &api,
        "virtio-balloon hostile",
        json!({"amount_mib": 0, "deflate_on_oom": false, "stats_polling_interval_s": 1}),
    );
    vmm.wait_for_stdout("virtio-balloon: actual 0 pages", LIMIT);
    for sent in [
        "hostile pfns past ram sent",
        "hostile huge inflate buffer sent",
        "hostile partial pfn sent",
        "hostile stats buffer sent",
    ] {
        assert!(vmm.stdout().contains(sent), "{sent}: {}", vmm.stdout());
    }
    // Each was answered (the driver waits for every used buffer) and logged.
    for logged in [
        "refused 2 page frame number(s) outside guest RAM",
        "is more than 4096 page frame numbers",
        "is not a whole number of 4-byte PFNs",
        "7-byte statistics buffer is not a whole number",
    ] {
        vmm.wait_for_stderr(logged, LIMIT);
    }
    // The device still works: the refused statistics buffer is returned at the next poll
    // and good statistics follow; a real target is met.
    vmm.wait_for_stdout("virtio-balloon: stats sent 1", LIMIT);
    call(&api, 204, "PATCH", "/balloon", json!({"amount_mib": 4}));
    vmm.wait_for_stdout("virtio-balloon: actual 1024 pages", LIMIT);
    let stats = wait_for_stats(&api, "the balloon after the hostile buffers", |s| {
        s["actual_pages"] == 1024 && s["total_memory"].is_u64()
    });
    assert_eq!(stats["target_pages"], 1024);
    assert!(!vmm.stdout().contains("FAIL"), "{}", vmm.stdout());
    assert!(vmm.try_status().is_none(), "gpuvm ended");
    vmm.signal(libc::SIGKILL);
}

#[test]
fn balloon_refusals_before_start() {
    let scratch = Scratch::new("virtio_balloon", "refusals");
    let (mut vmm, api) = start_api(&scratch);
    call(
        &api,
        204,
        "PUT",
        "/machine-config",
        json!({"vcpu_count": 1, "mem_size_mib": 128}),
    );
    let balloon = json!({"amount_mib": 0, "deflate_on_oom": false});
    // No balloon yet.
    api_expect(&api, 400, "GET", "/balloon", None);
    let too_big = call(
        &api,
        400,
        "PUT",
        "/balloon",
        json!({"amount_mib": 129, "deflate_on_oom": false}),
    );
    assert!(too_big.contains("more than the guest"), "{too_big}");
    call(&api, 400, "PUT", "/balloon", json!({"amount_mib": 1}));
    call(
        &api,
        400,
        "PUT",
        "/balloon",
        json!({"amount_mib": 1, "deflate_on_oom": false, "free_page_reporting": true}),
    );
    call(&api, 204, "PUT", "/balloon", balloon.clone());
    call(&api, 204, "PATCH", "/balloon", json!({"amount_mib": 8}));
    assert_eq!(get(&api, "/balloon")["amount_mib"], 8);
    api_expect(&api, 400, "GET", "/balloon/statistics", None);
    // A passthrough device pins guest RAM: the balloon and it are refused together.
    call(
        &api,
        204,
        "PUT",
        "/gpus/gpu0",
        json!({"gpu_id": "gpu0", "vfio_user_socket": "/nonexistent/gpu.sock"}),
    );
    let refused = call(&api, 400, "PUT", "/balloon", balloon);
    assert!(refused.contains("passthrough"), "{refused}");
    let refused = call(
        &api,
        400,
        "PUT",
        "/actions",
        json!({"action_type": "InstanceStart"}),
    );
    assert!(refused.contains("passthrough"), "{refused}");
    vmm.signal(libc::SIGKILL);
}

/// Firecracker's `/balloon` routes through gpuvm's Firecracker front end.
#[test]
fn firecracker_balloon_routes() {
    let scratch = Scratch::new("virtio_balloon", "firecracker");
    let link = scratch.path("firecracker");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let kernel = scratch.path("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        LIMIT,
    )
    .assert_code(0);
    let api = scratch.path("fc.sock");
    let mut vmm = SpawnedProcess::spawn(&link, &["--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);

    let refused = call(
        &api,
        400,
        "PUT",
        "/balloon",
        json!({"amount_mib": 0, "deflate_on_oom": false, "free_page_hinting": true}),
    );
    assert!(refused.contains("free_page_hinting"), "{refused}");
    call(
        &api,
        204,
        "PUT",
        "/balloon",
        json!({"amount_mib": 0, "deflate_on_oom": true, "stats_polling_interval_s": 1,
               "free_page_hinting": false, "free_page_reporting": false}),
    );
    assert_eq!(
        get(&api, "/balloon"),
        json!({"amount_mib": 0, "deflate_on_oom": true, "stats_polling_interval_s": 1})
    );
    call(
        &api,
        204,
        "PUT",
        "/machine-config",
        json!({"vcpu_count": 1, "mem_size_mib": 128}),
    );
    call(
        &api,
        204,
        "PUT",
        "/boot-source",
        json!({"kernel_image_path": kernel, "boot_args": "virtio-balloon"}),
    );
    call(
        &api,
        204,
        "PUT",
        "/actions",
        json!({"action_type": "InstanceStart"}),
    );
    vmm.wait_for_stdout("virtio-balloon: actual 0 pages", LIMIT);
    call(&api, 204, "PATCH", "/balloon", json!({"amount_mib": 8}));
    vmm.wait_for_stdout("virtio-balloon: actual 2048 pages", LIMIT);
    let stats = wait_for_stats(&api, "Firecracker's statistics", |s| {
        s["actual_mib"] == 8 && s["free_memory"].is_u64()
    });
    assert_eq!(stats["target_mib"], 8, "{stats}");
    call(
        &api,
        204,
        "PATCH",
        "/balloon/statistics",
        json!({"stats_polling_interval_s": 3}),
    );
    // Unknown fields are refused, as Firecracker does; hinting is not supported.
    call(
        &api,
        400,
        "PATCH",
        "/balloon",
        json!({"amount_mib": 1, "x": 1}),
    );
    let hinting = api_expect(&api, 400, "GET", "/balloon/hinting/status", None);
    assert!(hinting.contains("hinting"), "{hinting}");
    // The configuration Firecracker reports includes the balloon.
    let config = get(&api, "/vm/config");
    assert_eq!(config["balloon"]["deflate_on_oom"], true, "{config}");
    vmm.signal(libc::SIGKILL);
}
