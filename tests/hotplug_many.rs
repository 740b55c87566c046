//! Hot-plug without a fixed thread budget (issue 26): a running VM with seccomp on (the
//! default) takes 8 block devices at once through Cloud Hypervisor's vm.add-disk, as Kata
//! adds one per container with a block rootfs, and again after they are removed. A device's
//! I/O thread is made by the thread factory when the guest activates the device and ends
//! with its worker: the VM's threads are the same before, between and after the batches.
//! A thread the factory makes installs the device filter itself.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::cloud_hypervisor_support::{disk_ids, guest_image, test_guest_args, vm_info};
use gpuvm_tests::virtio_support::{disk_image, pattern_is_on_disk, SECTOR};
use gpuvm_tests::{api_expect, gpuvm_bin, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
/// What Kata adds for a pod of 8 containers with block rootfs (twice the old limit of 4).
const DISKS: usize = 8;
/// The guest's virtio-blk check writes sectors 8..16 with this seed's pattern.
const BLK_PATTERN_SEED: u64 = 0xb10c;
const BLK_MAGIC: &[u8; 8] = b"GPUVMBLK";
/// virtio/src/worker.rs FACTORY_THREAD_NAME.
const FACTORY: &str = "virtio-factory";
/// vmm/src/hotplug.rs EJECT_TIMEOUT_VAR.
const EJECT_TIMEOUT_VAR: &str = "GPUVM_HOTPLUG_EJECT_TIMEOUT_MS";

/// A thread's name, seccomp mode and number of stacked filters (/proc/PID/task/TID/status).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Task {
    name: String,
    seccomp: String,
    filters: String,
}

/// The VM's threads, API connection threads left out (one comes and goes per request).
fn tasks(pid: i32) -> Vec<Task> {
    let mut tasks: Vec<Task> =
        gpuvm_tests::thread_status_fields(pid, &["Name:", "Seccomp:", "Seccomp_filters:"])
            .into_iter()
            .filter(|fields| !fields[0].starts_with("api-conn"))
            .map(|fields| Task {
                name: fields[0].clone(),
                seccomp: fields[1].clone(),
                filters: fields[2].clone(),
            })
            .collect();
    tasks.sort();
    tasks
}

/// Waits until the VM's threads are `expected` again (a thread whose worker stopped ends a
/// moment later; each removal's `eject-timer` when the eject timeout is up).
fn settle(vm: &mut SpawnedProcess, expected: &[Task], context: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let now = tasks(vm.pid());
        if now == expected {
            return;
        }
        assert!(vm.try_status().is_none(), "gpuvm ended ({context})");
        assert!(
            Instant::now() < deadline,
            "{context}: threads {now:#?}, expected {expected:#?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The disks vm.info lists, by id: their PCI addresses from the device tree.
fn disks(api: &Path) -> BTreeMap<String, String> {
    let info = vm_info(api);
    disk_ids(&info)
        .into_iter()
        .map(|id| {
            let bdf = info["device_tree"][&id]["pci_bdf"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            (id, bdf)
        })
        .collect()
}

fn images(scratch: &Scratch) -> Vec<PathBuf> {
    (0..DISKS)
        .map(|n| {
            let path = scratch.path(&format!("ctr{n}.img"));
            disk_image(&path, BLK_MAGIC, 1 << 20);
            path
        })
        .collect()
}

/// `cloud-hypervisor` with a running VM; a removed device's slot is given up 5 s after its
/// removal if the guest has not ejected it by then (each removal's timer thread lives
/// that long, instead of the default 20 s).
fn spawn_vm(scratch: &Scratch, api: &Path, cmdline: &str) -> SpawnedProcess {
    let kernel = guest_image(scratch);
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let mut args = test_guest_args(api, &kernel, cmdline);
    args.extend(["--memory", "size=128M", "--seccomp", "true"]);
    let mut vm = SpawnedProcess::spawn_with_env(&link, &args, &[(EJECT_TIMEOUT_VAR, "5000")]);
    wait_for_api_socket(&mut vm, api);
    vm
}

fn add_disk(api: &Path, id: &str, image: &Path) -> String {
    let body = format!(r#"{{"path":"{}","id":"{id}"}}"#, image.display());
    let answer = api_expect(api, 200, "PUT", "/api/v1/vm.add-disk", Some(&body));
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["id"], id, "{answer}");
    answer["bdf"].as_str().expect("bdf").to_string()
}

#[test]
fn eight_disks_hot_plug_at_once_are_removed_and_come_again_without_leaking_threads() {
    let scratch = Scratch::new("hotplug_many", "eight");
    let images = images(&scratch);
    let api = scratch.path("api.sock");
    // One more than comes: the guest is still waiting when the threads are counted last.
    let total = 2 * DISKS + 1;
    let mut vm = spawn_vm(&scratch, &api, &format!("virtio-blk-hotplug {total}"));
    vm.wait_for_stdout(
        &format!("virtio-blk-hotplug: waiting for {total} disk(s)"),
        LIMIT,
    );

    // Cloud Hypervisor's entropy device (always configured) has its thread, made with the
    // VM; nothing else is made for devices to come but the factory, filtered (its own
    // filter: nothing stacked on it).
    // The factory installs its filter first thing (not waited for by the build).
    let deadline = Instant::now() + LIMIT;
    let mut before = tasks(vm.pid());
    while !before.iter().any(|t| t.name == FACTORY && t.seccomp == "2") {
        assert!(Instant::now() < deadline, "{before:#?}");
        std::thread::sleep(Duration::from_millis(10));
        before = tasks(vm.pid());
    }
    let virtio: Vec<&str> = before
        .iter()
        .filter(|t| t.name.starts_with("virtio-"))
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(virtio, ["virtio-factory", "virtio-idle0"], "{before:#?}");
    let factory = before.iter().find(|t| t.name == FACTORY);
    assert_eq!(
        factory.map(|t| (t.seccomp.as_str(), t.filters.as_str())),
        Some(("2", "1")),
        "{before:#?}"
    );
    assert!(before.iter().all(|t| t.seccomp == "2"), "{before:#?}");
    // Threads made with the VM serve whichever device starts first: the first disk takes
    // the entropy device's (this guest never starts that one). Every later one is the
    // factory's, and ends with its worker.
    let after: Vec<Task> = before
        .iter()
        .filter(|t| !t.name.starts_with("virtio-idle"))
        .cloned()
        .collect();

    let mut round = 0;
    for batch in 1..=2 {
        // All 8 at once, each answered with a slot of its own, all listed by vm.info.
        let mut added: Vec<(String, String)> = images
            .iter()
            .enumerate()
            .map(|(n, image)| {
                let id = format!("ctr{n}");
                let bdf = add_disk(&api, &id, image);
                (id, bdf)
            })
            .collect();
        let listed = disks(&api);
        assert_eq!(
            listed,
            added.iter().cloned().collect::<BTreeMap<_, _>>(),
            "batch {batch}"
        );
        let mut slots: Vec<&String> = listed.values().collect();
        slots.sort();
        slots.dedup();
        assert_eq!(slots.len(), DISKS, "{listed:?}");

        // The guest takes them in slot order: each is activated (its thread made), read and
        // written, reset (its thread ends), then removed and ejected.
        added.sort_by(|a, b| a.1.cmp(&b.1));
        for (id, bdf) in &added {
            round += 1;
            let slot = bdf.trim_start_matches("0000:");
            vm.wait_for_stdout(
                &format!("virtio-blk-hotplug: disk {round} at {slot} passed the checks"),
                LIMIT,
            );
            let index: usize = id.trim_start_matches("ctr").parse().unwrap();
            assert!(
                pattern_is_on_disk(&images[index], 8 * SECTOR, 8 * SECTOR, BLK_PATTERN_SEED),
                "the guest's writes are not on {id}'s image"
            );
            let body = format!(r#"{{"id":"{id}"}}"#);
            api_expect(&api, 204, "PUT", "/api/v1/vm.remove-device", Some(&body));
            vm.wait_for_stdout(
                &format!("virtio-blk-hotplug: {slot} ejected, reads all ones"),
                LIMIT,
            );
        }
        let deadline = Instant::now() + LIMIT;
        while !disks(&api).is_empty() {
            assert!(Instant::now() < deadline, "{:?}", disks(&api));
            std::thread::sleep(Duration::from_millis(20));
        }
        // The threads made for the disks ended with them; nothing is kept.
        settle(&mut vm, &after, &format!("after batch {batch}"));
    }
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());
    assert!(!out.stderr.contains("seccomp"), "{}", out.describe());
}

/// The factory makes a hot-plugged disk's thread, which installs the device filter itself:
/// the test hook that makes a device thread call getppid right after its filter traps on
/// that thread, once the guest activates the disk. The VM is created through vm.create
/// without an entropy device, so no device thread exists before.
#[test]
fn a_hot_plugged_device_thread_installs_the_device_filter() {
    let scratch = Scratch::new("hotplug_many", "filter");
    let images = images(&scratch);
    let kernel = guest_image(&scratch);
    let api = scratch.path("api.sock");
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let mut vm = SpawnedProcess::spawn_with_env(
        &link,
        &["--api-socket", api.to_str().unwrap()],
        &[("GPUVM_TEST_SECCOMP_VIOLATION", "device")],
    );
    wait_for_api_socket(&mut vm, &api);
    let config = format!(
        r#"{{"payload":{{"kernel":"{}","cmdline":"virtio-blk-hotplug 1"}},
            "memory":{{"size":134217728}},
            "serial":{{"mode":"Tty"}},"console":{{"mode":"Off"}}}}"#,
        kernel.display()
    );
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vm.wait_for_stdout("virtio-blk-hotplug: waiting for 1 disk(s)", LIMIT);
    let threads = tasks(vm.pid());
    assert!(
        !threads.iter().any(|t| t.name.starts_with("virtio-idle")),
        "no device thread before the hot-plug: {threads:#?}"
    );
    assert!(vm.try_status().is_none(), "no device thread trapped yet");
    add_disk(&api, "ctr0", &images[0]);
    let out = vm.wait(LIMIT);
    assert_eq!(out.code(), Some(148), "{}", out.describe());
    assert!(
        out.stderr
            .contains("gpuvm: seccomp: blocked system call 110 on a device thread"),
        "{}",
        out.describe()
    );
    assert!(
        out.stdout.contains("virtio-blk-hotplug: disk arrived at"),
        "trapped once the guest activated the disk: {}",
        out.describe()
    );
}
