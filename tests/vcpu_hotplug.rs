//! vCPU hot-plug through Cloud Hypervisor's vm.resize, as Kata's clh driver uses it
//! (static_sandbox_resource_mgmt = false): gpuvm as `cloud-hypervisor` boots the test
//! guest with 1 vCPU of 4 possible, the guest's `cpu-hotplug` workload brings every
//! hot-plugged CPU online (INIT/SIPI, a ring-3 check on the new CPU) and ejects the ones the
//! VMM asks for; snapshots keep the hot-plugged vCPUs.

use std::path::Path;
use std::time::{Duration, Instant};

use gpuvm_tests::cloud_hypervisor_support::{boot_test_guest, spawn_ch, vm_info, wait_for_vm};
use gpuvm_tests::{api_expect, thread_seccomp_modes, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);

/// `cloud-hypervisor --kernel <test guest> --cmdline cpu-hotplug --cpus boot=1,max=4`.
fn start(scratch: &Scratch, api: &Path) -> SpawnedProcess {
    let options = [
        "--cpus",
        "boot=1,max=4",
        "--memory",
        "size=128M",
        "--seccomp",
        "true",
        "-v",
    ];
    boot_test_guest(scratch, api, "cpu-hotplug", &options, LIMIT)
}

fn resize(api: &Path, status: u16, body: &str) -> String {
    api_expect(api, status, "PUT", "/api/v1/vm.resize", Some(body))
}

/// The VMM's own count (gpuvm's GET /machine-config on the same socket).
fn vcpus(api: &Path) -> (u64, u64) {
    let config: serde_json::Value =
        serde_json::from_str(&api_expect(api, 200, "GET", "/machine-config", None)).unwrap();
    let count = config["vcpu_count"].as_u64().unwrap();
    (count, config["max_vcpus"].as_u64().unwrap_or(count))
}

fn wait_for_vcpus(vm: &mut SpawnedProcess, api: &Path, count: u64) {
    let started = Instant::now();
    while vcpus(api).0 != count {
        assert!(
            started.elapsed() < LIMIT,
            "the VM did not get to {count} vCPUs: {:?}\n{}",
            vcpus(api),
            vm.stdout()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the guest printed `line` `times` times.
fn wait_for_times(vm: &mut SpawnedProcess, line: &str, times: usize) {
    vm.wait_until(line, LIMIT, |vm| vm.stdout().matches(line).count() >= times);
}

/// A thread per possible vCPU, each under its filter: `vcpu<N>` once it has its vCPU,
/// `spare-vcpu<N>` before (Kata counts vCPU threads by the `vcpu` prefix); `vcpus` of them
/// have one.
fn every_thread_is_filtered(vm: &SpawnedProcess, vcpus: usize) {
    every_thread_of_is_filtered(vm.pid(), vcpus);
}

/// [`every_thread_is_filtered`] for the gpuvm process `pid` (one a live update started).
fn every_thread_of_is_filtered(pid: i32, vcpus: usize) {
    let threads = thread_seccomp_modes(pid);
    let possible = threads.iter().filter(|(name, _)| name.contains("vcpu"));
    assert_eq!(
        possible.count(),
        4,
        "a thread per possible vCPU: {threads:?}"
    );
    let named = threads.iter().filter(|(name, _)| name.starts_with("vcpu"));
    assert_eq!(named.count(), vcpus, "{threads:?}");
    let unfiltered: Vec<_> = threads.iter().filter(|(_, mode)| *mode != 2).collect();
    assert!(
        unfiltered.is_empty(),
        "threads without a filter: {unfiltered:?}"
    );
}

#[test]
fn resize_adds_and_removes_vcpus_the_guest_brings_online() {
    let scratch = Scratch::new("vcpu_hotplug", "resize");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("cpu-hotplug: waiting, 3 CPU(s) hot-pluggable of 4", LIMIT);
    assert_eq!(vcpus(&api), (1, 4));
    every_thread_is_filtered(&vm, 1);

    // Kata's call at sandbox start: the count the VM has.
    resize(&api, 204, r#"{"desired_vcpus":1}"#);
    assert_eq!(vcpus(&api), (1, 4));
    resize(&api, 204, r#"{"desired_vcpus":2}"#);
    vm.wait_for_stdout("cpu-hotplug: cpu 1 online", LIMIT);
    assert_eq!(vcpus(&api), (2, 4));
    resize(&api, 204, r#"{"desired_vcpus":4}"#);
    vm.wait_for_stdout("cpu-hotplug: cpu 2 online", LIMIT);
    vm.wait_for_stdout("cpu-hotplug: cpu 3 online", LIMIT);
    assert_eq!(vcpus(&api), (4, 4));
    let info = vm_info(&api);
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 4, "{info}");
    assert_eq!(info["config"]["cpus"]["max_vcpus"], 4, "{info}");

    // Refused, and nothing changes.
    let zero = resize(&api, 400, r#"{"desired_vcpus":0}"#);
    assert!(zero.contains("at least 1 vCPU"), "{zero}");
    let above = resize(&api, 400, r#"{"desired_vcpus":5}"#);
    assert!(above.contains("max_vcpus = 4"), "{above}");
    let ram = resize(&api, 400, r#"{"desired_ram":268435456}"#);
    assert!(ram.contains("static_sandbox_resource_mgmt"), "{ram}");
    assert_eq!(vcpus(&api), (4, 4));
    assert_eq!(vm_info(&api)["config"]["cpus"]["boot_vcpus"], 4);

    // Fewer: the guest ejects the highest CPUs, whose threads are parked.
    resize(&api, 204, r#"{"desired_vcpus":2}"#);
    vm.wait_for_stdout("cpu-hotplug: cpu 3 ejected", LIMIT);
    vm.wait_for_stdout("cpu-hotplug: cpu 2 ejected", LIMIT);
    wait_for_vcpus(&mut vm, &api, 2);
    // ...and a parked CPU comes back.
    resize(&api, 204, r#"{"desired_vcpus":3}"#);
    wait_for_times(&mut vm, "cpu-hotplug: cpu 2 online", 2);
    assert_eq!(vcpus(&api), (3, 4));
    // vCPU 3 was ejected: its thread is parked (and keeps its name).
    every_thread_is_filtered(&vm, 4);

    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
}

/// Hot-plugged vCPUs are in snapshots: the restored VM has them running, and can still
/// grow to its max_vcpus.
#[test]
fn hot_plugged_vcpus_survive_a_snapshot() {
    let scratch = Scratch::new("vcpu_hotplug", "snapshot");
    let api = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("cpu-hotplug: waiting", LIMIT);
    resize(&api, 204, r#"{"desired_vcpus":3}"#);
    vm.wait_for_stdout("cpu-hotplug: cpu 2 online", LIMIT);
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vm.wait(LIMIT);

    let api = scratch.path("restored.sock");
    let source = format!("source_url=file://{}", snap.display());
    let mut restored = spawn_ch(
        &scratch,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "--restore",
            &source,
            "--seccomp",
            "true",
            "-v",
        ],
    );
    wait_for_vm(&mut restored, &api, LIMIT);
    assert_eq!(vcpus(&api), (3, 4));
    let info = vm_info(&api);
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 3, "{info}");
    assert_eq!(info["config"]["cpus"]["max_vcpus"], 4, "{info}");
    // Threads for vCPUs 0 to 2 and a spare one for 3 (the main thread takes its filter
    // only once the VM runs: checked below).
    let threads = thread_seccomp_modes(restored.pid());
    let names: Vec<&str> = threads
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| name.contains("vcpu"))
        .collect();
    assert_eq!(
        names,
        ["spare-vcpu3", "vcpu0", "vcpu1", "vcpu2"],
        "{threads:?}"
    );
    api_expect(&api, 204, "PUT", "/api/v1/vm.resume", None);
    resize(&api, 204, r#"{"desired_vcpus":4}"#);
    restored.wait_for_stdout("cpu-hotplug: cpu 3 online", LIMIT);
    assert_eq!(vcpus(&api), (4, 4));
    every_thread_is_filtered(&restored, 4);
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = restored.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
}

/// A live update of a VM whose guest ejected vCPUs: the old process parks their threads
/// and hands over the vCPUs still running (0 and 1); the new process keeps spare threads
/// for the others, and a later vm.resize makes them there afresh: the guest brings them
/// online again, and ejects all but one at the next resize.
#[test]
fn ejected_vcpus_come_back_after_a_live_update() {
    let scratch = Scratch::new("vcpu_hotplug", "update");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("cpu-hotplug: waiting, 3 CPU(s) hot-pluggable of 4", LIMIT);
    resize(&api, 204, r#"{"desired_vcpus":4}"#);
    vm.wait_for_stdout("cpu-hotplug: cpu 3 online", LIMIT);
    resize(&api, 204, r#"{"desired_vcpus":2}"#);
    vm.wait_for_stdout("cpu-hotplug: cpu 3 ejected", LIMIT);
    vm.wait_for_stdout("cpu-hotplug: cpu 2 ejected", LIMIT);
    wait_for_vcpus(&mut vm, &api, 2);

    let update = gpuvm_tests::gpuvm_update(vm.pid(), &[], &[]);
    let new = gpuvm_tests::updated_to(&update, &vm.stderr());
    let deadline = Instant::now() + LIMIT;
    let answers =
        || gpuvm_api::client::request(&api, "GET", "/", None).is_ok_and(|a| a.status == 200);
    while gpuvm_tests::process_running(vm.pid()) || !answers() {
        assert!(Instant::now() < deadline, "{}", vm.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(vcpus(&api), (2, 4));
    // vCPUs 0 and 1 run; 2 and 3 wait on spare threads.
    every_thread_of_is_filtered(new, 2);

    resize(&api, 204, r#"{"desired_vcpus":4}"#);
    wait_for_times(&mut vm, "cpu-hotplug: cpu 2 online", 2);
    wait_for_times(&mut vm, "cpu-hotplug: cpu 3 online", 2);
    assert_eq!(vcpus(&api), (4, 4));
    every_thread_of_is_filtered(new, 4);
    resize(&api, 204, r#"{"desired_vcpus":1}"#);
    wait_for_times(&mut vm, "cpu-hotplug: cpu 1 ejected", 1);
    wait_for_vcpus(&mut vm, &api, 1);

    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    gpuvm_tests::wait_process_gone(new, LIMIT, || vm.stderr());
    let stdout = vm.stdout();
    assert!(!stdout.contains("FAIL"), "{stdout}");
    assert!(!vm.stderr().contains("SIGSYS"), "{}", vm.stderr());
}
