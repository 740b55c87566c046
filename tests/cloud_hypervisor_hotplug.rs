//! Disks hot-plugged into a running VM through Cloud Hypervisor's API, as Kata adds a
//! container's block rootfs after vm.boot: vm.add-disk answers `{id, bdf}`, the guest
//! (`virtio-blk-hotplug`) finds the disk in that slot and reads and writes it,
//! vm.remove-device answers at once and the guest ejects the disk; a hot-plugged disk
//! survives a snapshot and restore in its slot and can still be removed, and a disk added
//! after the restore gets an id of its own; refusals name what is wrong.

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

    // The restored VM has the disk in the same slot. A third disk hot-plugged after the
    // restore, without an id, does not take the restored disk's (the restored VM's
    // configuration does not list it: its devices do). The restored disk is removed as a
    // hot-plugged one, then the guest finds the third.
    let api2 = scratch.path("api2.sock");
    let source = format!("source_url=file://{}", snap.display());
    let mut restored = spawn_ch(
        &scratch,
        &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
    );
    wait_for_api_socket(&mut restored, &api2);
    wait_for_vm(&mut restored, &api2, LIMIT);
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
