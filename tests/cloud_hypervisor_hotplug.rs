//! Disks hot-plugged into a running VM through Cloud Hypervisor's API, as Kata adds a
//! container's block rootfs after vm.boot: vm.add-disk answers `{id, bdf}`, the guest
//! (`virtio-blk-hotplug`) finds the disk in that slot and reads and writes it,
//! vm.remove-device answers at once and the guest ejects the disk; a hot-plugged disk
//! survives a snapshot and restore in its slot and can still be removed, and a disk added
//! after the restore gets an id of its own; refusals name what is wrong. A VM restored by
//! vm.restore, or moved by a live update, keeps the client's configuration: vm.info lists
//! the same devices under the same ids, and vm.remove-device takes them (issue 26).

use std::path::Path;
use std::time::Duration;

use gpuvm_tests::cloud_hypervisor_support::{
    self, guest_image, put_with_fds, spawn_ch, vm_info, wait_for_vm,
};
use gpuvm_tests::virtio_support::{assert_in_order, disk_image, pattern_is_on_disk, SECTOR};
use gpuvm_tests::{api_expect, wait_for_api_socket, Scratch, SpawnedProcess};
use std::os::fd::AsRawFd;

const LIMIT: Duration = Duration::from_secs(60);
/// The guest's virtio-blk check writes sectors 8..16 with this seed's pattern.
const BLK_PATTERN_SEED: u64 = 0xb10c;
const BLK_MAGIC: &[u8; 8] = b"GPUVMBLK";

fn add_disk(api: &Path, body: &str) -> serde_json::Value {
    let answer = api_expect(api, 200, "PUT", "/api/v1/vm.add-disk", Some(body));
    serde_json::from_str(&answer).unwrap()
}

fn remove(api: &Path, id: &str) {
    let body = format!(r#"{{"id":"{id}"}}"#);
    api_expect(api, 204, "PUT", "/api/v1/vm.remove-device", Some(&body));
}

/// The disk ids vm.info's configuration lists.
fn disk_ids(api: &Path) -> Vec<String> {
    cloud_hypervisor_support::disk_ids(&vm_info(api))
}

/// Waits for the guest's line saying the disk in `bdf` ("0000:00:XX.0") passed round
/// `round`'s checks, and for its pattern on `image`.
fn guest_checked(vm: &mut SpawnedProcess, round: u32, bdf: &str, image: &Path) {
    let slot = bdf.trim_start_matches("0000:");
    vm.wait_for_stdout(
        &format!("virtio-blk-hotplug: disk {round} at {slot} passed the checks"),
        LIMIT,
    );
    assert!(
        pattern_is_on_disk(image, 8 * SECTOR, 8 * SECTOR, BLK_PATTERN_SEED),
        "the guest's writes are not on {}",
        image.display()
    );
}

#[test]
fn disks_hot_plug_after_boot_come_back_after_restore_and_are_removed() {
    let scratch = Scratch::new("cloud_hypervisor_hotplug", "disks");
    let kernel = guest_image(&scratch);
    let images: Vec<_> = (1..=3)
        .map(|n| {
            let path = scratch.path(&format!("disk{n}.img"));
            disk_image(&path, BLK_MAGIC, 1 << 20);
            path
        })
        .collect();
    let api = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let mut vm = spawn_ch(
        &scratch,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "virtio-blk-hotplug 3",
            "--memory",
            "size=128M",
            "--serial",
            "tty",
            "--console",
            "off",
            "--seccomp",
            "true",
        ],
    );
    vm.wait_for_stdout("virtio-blk-hotplug: waiting for 3 disk(s)", LIMIT);
    assert_eq!(vm_info(&api)["state"], "Running");

    // Refusals, each naming what is wrong; the VM is unchanged by them.
    let missing = api_expect(
        &api,
        400,
        "PUT",
        "/api/v1/vm.add-disk",
        Some(r#"{"path":"/nonexistent/disk.img"}"#),
    );
    assert!(missing.contains("/nonexistent/disk.img"), "{missing}");
    let segment = format!(r#"{{"path":"{}","pci_segment":1}}"#, images[0].display());
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.add-disk", Some(&segment));
    assert!(refused.contains("pci_segment"), "{refused}");
    let unknown = api_expect(
        &api,
        404,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id":"nothing"}"#),
    );
    assert!(unknown.contains("nothing"), "{unknown}");
    assert!(disk_ids(&api).is_empty());

    // 1: a disk without an id gets Cloud Hypervisor's `_disk0`; removed at once.
    let first = add_disk(&api, &format!(r#"{{"path":"{}"}}"#, images[0].display()));
    assert_eq!(first["id"], "_disk0", "{first}");
    let bdf = first["bdf"].as_str().unwrap().to_string();
    assert!(
        bdf.starts_with("0000:00:") && bdf.ends_with(".0"),
        "{first}"
    );
    guest_checked(&mut vm, 1, &bdf, &images[0]);
    assert_eq!(disk_ids(&api), ["_disk0"]);
    // vm.info's device_tree has the disk at the address the hot-plug answered.
    let info = vm_info(&api);
    assert_eq!(
        info["device_tree"]["_disk0"]["pci_bdf"],
        bdf.as_str(),
        "{info}"
    );
    let same_id = format!(r#"{{"path":"{}","id":"_disk0"}}"#, images[1].display());
    let twice = api_expect(&api, 400, "PUT", "/api/v1/vm.add-disk", Some(&same_id));
    assert!(twice.contains("_disk0"), "{twice}");
    remove(&api, "_disk0");
    vm.wait_for_stdout(
        &format!(
            "virtio-blk-hotplug: {} ejected, reads all ones",
            bdf.trim_start_matches("0000:")
        ),
        LIMIT,
    );
    assert!(disk_ids(&api).is_empty());

    // 2: a disk without an id again (`_disk0` is free again), then a snapshot with it.
    let second = add_disk(&api, &format!(r#"{{"path":"{}"}}"#, images[1].display()));
    assert_eq!(second["id"], "_disk0", "{second}");
    let second_bdf = second["bdf"].as_str().unwrap().to_string();
    guest_checked(&mut vm, 2, &second_bdf, &images[1]);
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());

    // The restored VM has the disk in the same slot, and its configuration lists it under
    // its id (the client's record is in the snapshot). A third disk hot-plugged after the
    // restore, without an id, does not take the restored disk's. The restored disk is
    // removed as a hot-plugged one, then the guest finds the third.
    let api2 = scratch.path("api2.sock");
    let source = format!("source_url=file://{}", snap.display());
    let mut restored = spawn_ch(
        &scratch,
        &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
    );
    wait_for_api_socket(&mut restored, &api2);
    wait_for_vm(&mut restored, &api2, LIMIT);
    assert_eq!(disk_ids(&api2), ["_disk0"]);
    api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    let third = add_disk(&api2, &format!(r#"{{"path":"{}"}}"#, images[2].display()));
    assert_eq!(third["id"], "_disk1", "{third}");
    remove(&api2, "_disk0");
    restored.wait_for_stdout(
        &format!(
            "virtio-blk-hotplug: {} ejected, reads all ones",
            second_bdf.trim_start_matches("0000:")
        ),
        LIMIT,
    );
    let third_bdf = third["bdf"].as_str().unwrap().to_string();
    guest_checked(&mut restored, 3, &third_bdf, &images[2]);
    remove(&api2, third["id"].as_str().unwrap());
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert!(
        !out.stdout.contains("waiting for 3 disk(s)"),
        "the guest started over: {}",
        out.describe()
    );
    assert_in_order(
        &out.stdout,
        &[
            "virtio-blk-hotplug: disk 3 at",
            "passed the checks",
            "virtio-blk-hotplug: ok",
        ],
        "after the restore",
    );
}

/// Issue 26: a VM restored through vm.restore keeps the client's configuration. A VM
/// created (vm.create) with two disks, one without an id (`_disk0`) and one with
/// (`root`), gets a disk hot-plugged without an id (`_disk1`), which is removed, and one
/// with an id (`volume`), which is kept; then vm.snapshot, and vm.restore in a new
/// process. While Paused, vm.info's `config` is the same as before the snapshot (the same
/// disks, ids and paths, the removed one absent) and its `device_tree` has every disk at
/// its address; after vm.resume too; then `volume` is removed by its id (the guest ejects
/// it), and a boot disk cannot be removed and stays listed.
#[test]
fn a_restored_vm_keeps_the_clients_devices_and_their_ids() {
    let scratch = Scratch::new("cloud_hypervisor_hotplug", "restored-config");
    let kernel = guest_image(&scratch);
    let image = |name: &str| {
        let path = scratch.path(name);
        disk_image(&path, BLK_MAGIC, 1 << 20);
        path
    };
    let (boot0, root, removed, volume) = (
        image("boot0.img"),
        image("root.img"),
        image("removed.img"),
        image("volume.img"),
    );
    let api = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let mut vm = spawn_ch(&scratch, &["--api-socket", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vm, &api);
    let config = format!(
        r#"{{"payload":{{"kernel":"{}","cmdline":"virtio-blk-hotplug 2"}},
            "cpus":{{"boot_vcpus":1,"max_vcpus":1}},"memory":{{"size":134217728}},
            "serial":{{"mode":"Tty"}},"console":{{"mode":"Off"}},
            "disks":[{{"path":"{}"}},{{"path":"{}","id":"root","readonly":true}}]}}"#,
        kernel.display(),
        boot0.display(),
        root.display()
    );
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vm.wait_for_stdout("virtio-blk-hotplug: waiting for 2 disk(s)", LIMIT);

    // Hot-plugged without an id, checked by the guest, removed.
    let first = add_disk(&api, &format!(r#"{{"path":"{}"}}"#, removed.display()));
    assert_eq!(first["id"], "_disk1", "{first}");
    let first_bdf = first["bdf"].as_str().unwrap().to_string();
    guest_checked(&mut vm, 1, &first_bdf, &removed);
    remove(&api, "_disk1");
    vm.wait_for_stdout(
        &format!(
            "virtio-blk-hotplug: {} ejected, reads all ones",
            first_bdf.trim_start_matches("0000:")
        ),
        LIMIT,
    );
    // Hot-plugged with an id, kept through the snapshot.
    let kept = add_disk(
        &api,
        &format!(r#"{{"path":"{}","id":"volume"}}"#, volume.display()),
    );
    assert_eq!(kept["id"], "volume", "{kept}");
    let kept_bdf = kept["bdf"].as_str().unwrap().to_string();
    guest_checked(&mut vm, 2, &kept_bdf, &volume);
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    let before = vm_info(&api);
    // (A disk given without an id at vm.create is listed as given: `_disk0` is its id in
    // `device_tree` and for vm.remove-device.)
    assert_eq!(
        cloud_hypervisor_support::disk_ids(&before),
        ["root", "volume"],
        "{before}"
    );
    let paths: Vec<&str> = before["config"]["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|disk| disk["path"].as_str().unwrap())
        .collect();
    let expected = [&boot0, &root, &volume].map(|path| path.to_str().unwrap());
    assert_eq!(paths, expected, "{before}");
    let tree = before["device_tree"].clone();
    let listed: Vec<&String> = tree.as_object().unwrap().keys().collect();
    assert_eq!(listed, ["_disk0", "root", "volume"], "{before}");
    assert_eq!(tree["volume"]["pci_bdf"], kept_bdf.as_str(), "{before}");
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());

    // vm.restore in a new process: Paused, with the configuration and devices it had.
    let api2 = scratch.path("api2.sock");
    let mut restored = spawn_ch(&scratch, &["--api-socket", api2.to_str().unwrap()]);
    wait_for_api_socket(&mut restored, &api2);
    let source = format!(r#"{{"source_url":"file://{}"}}"#, snap.display());
    api_expect(&api2, 204, "PUT", "/api/v1/vm.restore", Some(&source));
    let paused = vm_info(&api2);
    assert_eq!(paused["state"], "Paused", "{paused}");
    assert_eq!(paused["config"], before["config"], "while Paused");
    assert_eq!(paused["device_tree"], tree, "while Paused");
    api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    let running = vm_info(&api2);
    assert_eq!(running["state"], "Running", "{running}");
    assert_eq!(running["config"], before["config"], "after vm.resume");
    assert_eq!(running["device_tree"], tree, "after vm.resume");

    // A boot disk is not hot-unpluggable, here as before the snapshot; it stays listed.
    let refused = api_expect(
        &api2,
        409,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id":"root"}"#),
    );
    assert!(refused.contains("root"), "{refused}");
    // The kept disk, by the client's id: the guest ejects it and ends.
    remove(&api2, "volume");
    assert_eq!(disk_ids(&api2), ["root"]);
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert!(
        !out.stdout.contains("waiting for 2 disk(s)"),
        "the guest started over: {}",
        out.describe()
    );
    assert_in_order(
        &out.stdout,
        &[
            &format!(
                "virtio-blk-hotplug: {} ejected, reads all ones",
                kept_bdf.trim_start_matches("0000:")
            ),
            "virtio-blk-hotplug: ok",
        ],
        "after the restore",
    );
}

/// A process this test made but is not the parent of (a live update's new gpuvm): killed
/// if it still runs when the test ends, failed or not.
struct KilledAtDrop(i32);

impl Drop for KilledAtDrop {
    fn drop(&mut self) {
        if Path::new(&format!("/proc/{}", self.0)).exists() {
            // SAFETY: kill(2) has no memory effects; the pid is the gpuvm this test's
            // update started, checked to exist just before.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
}

/// The client's record goes with a live update too (`gpuvm update`, which Cloud
/// Hypervisor does not have): a VM started by Cloud Hypervisor's command line with a disk
/// (`root`) and one hot-plugged (`volume`) answers vm.info in the new process with the same
/// `config` and `device_tree`, and `volume` is removed by its id there.
#[test]
fn a_live_update_keeps_the_clients_devices_and_their_ids() {
    let scratch = Scratch::new("cloud_hypervisor_hotplug", "updated-config");
    let kernel = guest_image(&scratch);
    let (root, volume) = (scratch.path("root.img"), scratch.path("volume.img"));
    disk_image(&root, BLK_MAGIC, 1 << 20);
    disk_image(&volume, BLK_MAGIC, 1 << 20);
    let api = scratch.path("api.sock");
    let disk = format!("path={},id=root", root.display());
    let mut vm = spawn_ch(
        &scratch,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "virtio-blk-hotplug 1",
            "--memory",
            "size=128M",
            "--disk",
            &disk,
            "--serial",
            "tty",
            "--console",
            "off",
        ],
    );
    vm.wait_for_stdout("virtio-blk-hotplug: waiting for 1 disk(s)", LIMIT);
    let kept = add_disk(
        &api,
        &format!(r#"{{"path":"{}","id":"volume"}}"#, volume.display()),
    );
    let kept_bdf = kept["bdf"].as_str().unwrap().to_string();
    guest_checked(&mut vm, 1, &kept_bdf, &volume);
    let before = vm_info(&api);
    assert_eq!(disk_ids(&api), ["root", "volume"], "{before}");

    let update = gpuvm_tests::gpuvm_update(vm.pid(), &["--api-sock", api.to_str().unwrap()], &[]);
    let new = gpuvm_tests::updated_to(&update, "");
    assert_ne!(new, vm.pid());
    let _new_process = KilledAtDrop(new);
    // The new process serves the socket once the old one has gone (a zombie: it is ours).
    let start = std::time::Instant::now();
    let old_stat = format!("/proc/{}/stat", vm.pid());
    while std::fs::read_to_string(&old_stat).is_ok_and(|stat| !stat.contains(") Z ")) {
        assert!(start.elapsed() < LIMIT, "the old process does not end");
        std::thread::sleep(Duration::from_millis(5));
    }
    while !gpuvm_api::client::request(&api, "GET", "/api/v1/vm.info", None)
        .is_ok_and(|answer| answer.status == 200)
    {
        assert!(start.elapsed() < LIMIT, "the new process does not answer");
        std::thread::sleep(Duration::from_millis(5));
    }
    let after = vm_info(&api);
    assert_eq!(after["config"], before["config"], "after the update");
    assert_eq!(
        after["device_tree"], before["device_tree"],
        "after the update"
    );
    remove(&api, "volume");
    assert_eq!(disk_ids(&api), ["root"]);
    // The guest ejects it in the new process (which kept the old one's output) and ends.
    vm.wait_for_stdout(
        &format!(
            "virtio-blk-hotplug: {} ejected, reads all ones",
            kept_bdf.trim_start_matches("0000:")
        ),
        LIMIT,
    );
    vm.wait_for_stdout("virtio-blk-hotplug: ok", LIMIT);
    let start = std::time::Instant::now();
    while Path::new(&format!("/proc/{new}")).exists() {
        assert!(start.elapsed() < LIMIT, "the new process {new} did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Network interfaces (a tap by name, a tap passed as a descriptor) and a vsock device
/// hot-plugged into a running VM with seccomp on: each answers `{id, bdf}` in its own slot,
/// vm.info lists it, bad ones are refused by name, and gpuvm keeps serving (a thread
/// missing a system call would end the process). The guest runs `memloop` and drives none
/// of them (the guest side of hot-plug is the disk test's); vm.remove-device is answered
/// at once even though this guest never ejects.
#[test]
fn nics_and_vsock_hot_plug_with_seccomp_on() {
    let Some(netns) = gpuvm_tests::netns::Netns::create("nics_and_vsock_hot_plug_with_seccomp_on")
    else {
        return;
    };
    let scratch = Scratch::new("cloud_hypervisor_hotplug", "nics");
    let kernel = guest_image(&scratch);
    let api = scratch.path("api.sock");
    let vsock = scratch.path("v.sock");
    let mut vm = netns.spawn_gpuvm(&[
        "ch",
        "--api-socket",
        api.to_str().unwrap(),
        "--kernel",
        kernel.to_str().unwrap(),
        "--cmdline",
        "memloop 4M 7 100000000",
        "--memory",
        "size=128M",
        "--seccomp",
        "true",
    ]);
    vm.wait_for_stdout("memloop: iter", LIMIT);
    let added = |route: &str, body: &str, fds: &[std::os::fd::RawFd]| {
        let (status, answer) = put_with_fds(&api, route, body, fds);
        assert_eq!(status, 200, "{route} {body}: {answer}");
        serde_json::from_str::<serde_json::Value>(&answer).unwrap()
    };

    // (A tap name that does not exist is made by TUNSETIFF, as root: a name Linux cannot
    // have is refused.)
    let bad = api_expect(
        &api,
        400,
        "PUT",
        "/api/v1/vm.add-net",
        Some(r#"{"tap":"a-tap-name-longer-than-ifnamsiz"}"#),
    );
    assert!(bad.contains("not a Linux interface name"), "{bad}");
    // By name: TUNSETIFF makes the tap in gpuvm's namespace.
    let by_name = added(
        "/api/v1/vm.add-net",
        r#"{"tap":"hotnet1","id":"byname"}"#,
        &[],
    );
    assert_eq!(by_name["id"], "byname", "{by_name}");
    assert!(netns.ip(&["link", "show"]).contains("hotnet1"));
    // Passed: the namespace's tap0, opened by the test as Kata opens its taps.
    let tap = netns.open_tap();
    let passed = added(
        "/api/v1/vm.add-net",
        r#"{"mac":"06:00:0a:00:00:09"}"#,
        &[tap.as_raw_fd()],
    );
    assert_eq!(passed["id"], "_net0", "{passed}");
    let socket = format!(r#"{{"cid":3,"socket":"{}"}}"#, vsock.display());
    let hot_vsock = added("/api/v1/vm.add-vsock", &socket, &[]);
    let second = api_expect(&api, 400, "PUT", "/api/v1/vm.add-vsock", Some(&socket));
    assert!(second.contains("vsock"), "{second}");
    assert!(
        vsock.exists(),
        "the hot-plugged vsock listens on {}",
        vsock.display()
    );
    // vhost-user devices are added before boot only.
    let share = format!(
        r#"{{"tag":"late","socket":"{}"}}"#,
        scratch.path("fs.sock").display()
    );
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.add-fs", Some(&share));
    assert!(refused.contains("vhost-user"), "{refused}");

    let bdfs: Vec<&str> = [&by_name, &passed, &hot_vsock]
        .iter()
        .map(|answer| answer["bdf"].as_str().unwrap())
        .collect();
    let mut unique = bdfs.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), 3, "one slot each: {bdfs:?}");
    let info = vm_info(&api);
    assert_eq!(info["state"], "Running", "{info}");
    assert_eq!(
        info["config"]["net"].as_array().map(Vec::len),
        Some(2),
        "{info}"
    );
    assert!(info["config"]["vsock"]["socket"].is_string(), "{info}");

    let tree = &info["device_tree"];
    for answer in [&by_name, &passed, &hot_vsock] {
        let id = answer["id"].as_str().unwrap();
        assert_eq!(tree[id]["pci_bdf"], answer["bdf"], "{id} in {info}");
    }
    remove(&api, "byname");
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(
        !out.stderr.contains("seccomp") && !out.stderr.contains("panicked"),
        "{}",
        out.describe()
    );
}
