//! Memory hot-plug through Cloud Hypervisor's vm.resize `desired_ram`, as Kata's clh driver
//! uses it (ResizeMemory: it reads vm.info's `memory.size`, rounds the growth up to the
//! guest's memory block and sends the new total): gpuvm as `cloud-hypervisor` boots the
//! test guest with `memory.hotplug_size`, and the guest's `memory-hotplug` workload finds
//! each new range through the ACPI memory hot-plug registers and memtests all of it from
//! ring 3. A vm.resize below the current size removes whole slots, newest first, once the
//! guest ejected them (the test guest does as soon as it sees the remove request).

use std::path::Path;
use std::time::Duration;

use gpuvm_tests::cloud_hypervisor_support::{
    boot_test_guest, guest_image, spawn_ch, test_guest_args, vm_info, wait_for_vm,
};
use gpuvm_tests::vhost_user_support::{backend_binary, start_qsd};
use gpuvm_tests::{api_expect, thread_seccomp_modes, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;
/// The guest's memory block (Linux's on x86_64; what Kata's agent reports).
const BLOCK_MIB: u64 = 128;

/// `cloud-hypervisor --kernel <test guest> --cmdline memory-hotplug
/// --memory size=256M,hotplug_size=1G`.
fn start(scratch: &Scratch, api: &Path) -> SpawnedProcess {
    boot_test_guest(scratch, api, "memory-hotplug", &HOT_PLUG_VM, LIMIT)
}

/// 1 vCPU, 256 MiB of RAM and room for 1 GiB more; seccomp on, verbose.
const HOT_PLUG_VM: [&str; 7] = [
    "--cpus",
    "boot=1",
    "--memory",
    "size=256M,hotplug_size=1G",
    "--seccomp",
    "true",
    "-v",
];

fn resize(api: &Path, status: u16, body: &str) -> String {
    api_expect(api, status, "PUT", "/api/v1/vm.resize", Some(body))
}

/// The VMM's own view (gpuvm's GET /machine-config on the same socket): RAM in MiB and the
/// hot-plug room in bytes.
fn ram(api: &Path) -> (u64, u64) {
    let config: serde_json::Value =
        serde_json::from_str(&api_expect(api, 200, "GET", "/machine-config", None)).unwrap();
    (
        config["mem_size_mib"].as_u64().unwrap(),
        config["ram_hotplug_size"].as_u64().unwrap_or(0),
    )
}

/// What Kata's ResizeMemory sends for a sandbox that should have `request_mib`: vm.info's
/// memory.size plus the growth rounded up to the block.
fn kata_resize_memory(api: &Path, request_mib: u64) -> u64 {
    let current = vm_info(api)["config"]["memory"]["size"].as_u64().unwrap();
    let wanted = request_mib * MIB;
    assert!(wanted > current, "{wanted} <= {current}");
    let block = BLOCK_MIB * MIB;
    let desired = current + (wanted - current).next_multiple_of(block);
    resize(api, 204, &format!(r#"{{"desired_ram":{desired}}}"#));
    desired
}

#[test]
fn resize_adds_ram_the_guest_memtests() {
    let scratch = Scratch::new("memory_hotplug", "resize");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("memory-hotplug: waiting, 14 slot(s)", LIMIT);
    assert_eq!(ram(&api), (256, 1 << 30));

    // Refused, and nothing changes.
    for (body, says) in [
        (r#"{"desired_ram":0}"#, "desired_ram = 0"),
        (
            &format!(r#"{{"desired_ram":{}}}"#, 356 * MIB) as &str,
            "not a multiple of 128 MiB",
        ),
        (
            &format!(r#"{{"desired_ram":{}}}"#, (256 + 1024 + 128) * MIB),
            "hot-plug size 1 GiB",
        ),
        (
            &format!(r#"{{"desired_ram":{}}}"#, 128 * MIB),
            "below the VM's 256 MiB of boot RAM",
        ),
    ] {
        let answer = resize(&api, 400, body);
        assert!(answer.contains(says), "{body}: {answer}");
    }
    assert_eq!(ram(&api), (256, 1 << 30));
    assert_eq!(vm_info(&api)["config"]["memory"]["size"], 256 * MIB);
    // The size it has: no change (Kata's early check does not even send it).
    resize(&api, 204, &format!(r#"{{"desired_ram":{}}}"#, 256 * MIB));

    // A container with a 200 MiB limit: 256 MiB more.
    let desired = kata_resize_memory(&api, 256 + 200);
    assert_eq!(desired, 512 * MIB);
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    assert_eq!(ram(&api), (512, 1 << 30));
    assert_eq!(vm_info(&api)["config"]["memory"]["size"], 512 * MIB);
    // Another with 100 MiB: one more block, in the next slot, right after the first.
    kata_resize_memory(&api, 512 + 100);
    vm.wait_for_stdout(
        "memory-hotplug: slot 1 base=0x110000000 size=134217728 memtest ok",
        LIMIT,
    );
    vm.wait_for_stdout("memory-hotplug: 2 slot(s), 402653184 bytes added", LIMIT);
    assert_eq!(ram(&api), (640, 1 << 30));
    // What is left of the hot-plug size: 1 GiB - 384 MiB.
    let beyond = (256 + 1024 + 128) * MIB;
    let answer = resize(&api, 400, &format!(r#"{{"desired_ram":{beyond}}}"#));
    assert!(answer.contains("hot-plug size"), "{answer}");
    assert_eq!(ram(&api), (640, 1 << 30));

    // A snapshot holds the hot-plugged RAM: restored in a new process, the guest finds its
    // two slots' patterns intact when a third slot comes (checked before it takes it).
    let snap = scratch.path("snap");
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    assert_eq!(ram(&api), (640, 1 << 30));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    for lazy in [false, true] {
        let api2 = scratch.path(if lazy { "lazy.sock" } else { "eager.sock" });
        let source = format!(
            "source_url=file://{}{}",
            snap.display(),
            if lazy {
                ",memory_restore_mode=ondemand"
            } else {
                ""
            }
        );
        let mut restored = spawn_ch(
            &scratch,
            &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
        );
        wait_for_vm(&mut restored, &api2, LIMIT);
        assert_eq!(ram(&api2), (640, 1 << 30), "lazy={lazy}");
        assert_eq!(vm_info(&api2)["config"]["memory"]["size"], 640 * MIB);
        api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
        // One more block, in the next free slot and place.
        kata_resize_memory(&api2, 640 + 100);
        restored.wait_for_stdout(
            "memory-hotplug: 2 earlier slot(s) still hold their patterns",
            LIMIT,
        );
        restored.wait_for_stdout(
            "memory-hotplug: slot 2 base=0x118000000 size=134217728 memtest ok",
            LIMIT,
        );
        assert_eq!(ram(&api2), (768, 1 << 30));
        api_expect(&api2, 204, "PUT", "/api/v1/vmm.shutdown", None);
        let out = restored.wait(LIMIT);
        assert!(
            !out.stdout.contains("FAIL"),
            "lazy={lazy}: {}",
            out.describe()
        );
        assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
    }
}

#[test]
fn threads_stay_filtered_through_a_resize() {
    let scratch = Scratch::new("memory_hotplug", "filters");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("memory-hotplug: waiting, 14 slot(s)", LIMIT);
    kata_resize_memory(&api, 256 + 200);
    vm.wait_for_stdout("memory-hotplug: slot 0 base=0x100000000", LIMIT);
    // Every thread still under its filter (the new memory slot was made on the VMM
    // thread, under its filter).
    let unfiltered: Vec<_> = thread_seccomp_modes(vm.pid())
        .into_iter()
        .filter(|(_, mode)| *mode != 2)
        .collect();
    assert!(
        unfiltered.is_empty(),
        "threads without a filter: {unfiltered:?}"
    );
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
}

/// `cloud-hypervisor` running an endless memloop with `--memory <memory>` and `extra`
/// flags, once its VM runs.
fn start_memloop(scratch: &Scratch, api: &Path, memory: &str, extra: &[&str]) -> SpawnedProcess {
    let options = [&["--memory", memory], extra].concat();
    boot_test_guest(scratch, api, "memloop 1M 1 1000000000", &options, LIMIT)
}

/// Without `hotplug_size` a VM keeps its RAM: any other size is refused naming what to set.
#[test]
fn without_hotplug_size_ram_cannot_grow() {
    let scratch = Scratch::new("memory_hotplug", "none");
    let api = scratch.path("api.sock");
    let vm = start_memloop(&scratch, &api, "size=256M", &[]);
    let answer = resize(&api, 400, &format!(r#"{{"desired_ram":{}}}"#, 512 * MIB));
    assert!(answer.contains("hotplug_size"), "{answer}");
    assert!(answer.contains("static_sandbox_resource_mgmt"), "{answer}");
    resize(&api, 204, &format!(r#"{{"desired_ram":{}}}"#, 256 * MIB));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vm.wait(LIMIT);
}

/// With a passthrough device (the emulated GPU over vfio-user, as Kata hot-plugs one), the
/// new RAM is DMA-mapped for it before the guest is told: by the time vm.resize answers,
/// the mapping is done (gpuvm logs it), and the guest then memtests the range.
#[test]
fn hot_plugged_ram_is_dma_mapped_for_a_gpu_before_the_guest_uses_it() {
    let scratch = Scratch::new("memory_hotplug", "gpu");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("memory-hotplug: waiting", LIMIT);
    let socket = scratch.path("gpu.sock");
    let emu_bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let mut emu = gpuvm_tests::start_emu_gpu(&emu_bin, &socket, &[]);
    let body = serde_json::json!({ "socket": socket, "id": "gpu0" }).to_string();
    api_expect(&api, 200, "PUT", "/api/v1/vm.add-user-device", Some(&body));

    resize(&api, 204, &format!(r#"{{"desired_ram":{}}}"#, 512 * MIB));
    // Logged before the answer: the map happened on the VMM thread, before the insert (the
    // log reaches this test through a pipe its reader drains, so wait for the last line).
    vm.wait_for_stderr("of RAM hot-plugged at 0x100000000", LIMIT);
    let stderr = vm.stderr();
    let mapped = stderr
        .find("hot-plugged RAM at 0x100000000: DMA-mapped for")
        .unwrap_or_else(|| panic!("no DMA map of the new RAM:\n{stderr}"));
    let told = stderr
        .find("of RAM hot-plugged at 0x100000000")
        .unwrap_or_else(|| panic!("no hot-plug:\n{stderr}"));
    assert!(mapped < told, "mapped after the guest was told:\n{stderr}");
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    assert_eq!(ram(&api), (512, 1 << 30));

    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
    emu.signal(libc::SIGTERM);
}

/// What the guest's `memory-hotplug blk` moves through the disk per slot (its BLK_BYTES),
/// and the seed of slot N's data (BLK_SEED + N).
const BLK_BYTES: u64 = 64 << 10;
const BLK_SEED: u64 = 0x6d68_626c_6b00;

/// RAM grows under a VM with a virtio disk, and the disk moves data through the new RAM:
/// the guest writes from and reads into buffers in each hot-plugged range (the device
/// reads and writes RAM the VM did not boot with), and the host finds each slot's data on
/// the disk. Kata's VMs always have virtio devices, so this is what its ResizeMemory needs.
#[test]
fn ram_grows_under_a_virtio_disk_that_uses_it() {
    let scratch = Scratch::new("memory_hotplug", "virtio");
    let disk = scratch.path("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let disk_arg = format!("path={},id=data", disk.display());
    disk_moves_data_through_hot_plugged_ram(&scratch, &disk_arg, &disk);
}

/// The same through a vhost-user-blk back end (qemu-storage-daemon), a process of its own
/// that mapped the VM's memory table when the disk was set up: the hot-plug area was in that
/// table from the start, so the back end reaches RAM plugged later without a new table.
#[test]
fn ram_grows_under_a_vhost_user_disk_that_uses_it() {
    let Some(qsd) = backend_binary(
        "qemu-storage-daemon",
        "memory_hotplug",
        "ram_grows_under_a_vhost_user_disk_that_uses_it",
    ) else {
        return;
    };
    let scratch = Scratch::new("memory_hotplug", "vhost-user");
    let disk = scratch.path("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let socket = scratch.path("qsd.sock");
    let backend = start_qsd(&qsd, &disk, &socket, true);
    let disk_arg = format!("vhost_user=on,socket={},id=data", socket.display());
    disk_moves_data_through_hot_plugged_ram(&scratch, &disk_arg, &disk);
    backend.terminate(LIMIT);
}

/// Boots `memory-hotplug blk 2` with `--disk disk_arg` (the disk's image at `image`), grows
/// RAM twice as Kata does, and checks the guest's I/O through each new range and its data
/// on the disk.
fn disk_moves_data_through_hot_plugged_ram(scratch: &Scratch, disk_arg: &str, image: &Path) {
    let api = scratch.path("api.sock");
    let options = [&HOT_PLUG_VM[..], &["--disk", disk_arg]].concat();
    let mut vm = boot_test_guest(scratch, &api, "memory-hotplug blk 2", &options, LIMIT);
    vm.wait_for_stdout("memory-hotplug: waiting, 14 slot(s)", LIMIT);
    kata_resize_memory(&api, 256 + 200);
    assert_eq!(ram(&api).0, 512);
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 virtio-blk wrote and read back 65536 bytes at 0x100000000, sector 0",
        LIMIT,
    );
    kata_resize_memory(&api, 512 + 100);
    vm.wait_for_stdout(
        "memory-hotplug: slot 1 virtio-blk wrote and read back 65536 bytes at 0x110000000, sector 128",
        LIMIT,
    );
    // The guest ends after its second slot.
    let out = vm.wait(LIMIT);
    assert!(
        out.stdout
            .contains("memory-hotplug: 2 slot(s), 402653184 bytes added"),
        "{}",
        out.describe()
    );
    assert_eq!(out.status.code(), Some(0), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
    // What the device read from hot-plugged RAM is on the disk, slot by slot.
    let bytes = std::fs::read(image).unwrap();
    for slot in 0..2u64 {
        let start = slot * BLK_BYTES;
        for word in (0..BLK_BYTES).step_by(8) {
            let offset = start + word;
            let expected = gpuvm_guest_images::pattern(BLK_SEED + slot, offset);
            let at = offset as usize;
            let got = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
            assert_eq!(got, expected, "slot {slot}: disk offset {offset:#x}");
        }
    }
}

/// Bytes the host has allocated for guest RAM's file (memfd or tmpfs file), seen through
/// the process's descriptors.
fn guest_ram_allocated(pid: i32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut inodes = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().contains("gpuvm-guest-ram") {
            continue;
        }
        if let Ok(meta) = std::fs::metadata(entry.path()) {
            inodes.insert((meta.dev(), meta.ino()), meta.blocks() * 512);
        }
    }
    assert!(!inodes.is_empty(), "no guest RAM file in /proc/{pid}/fd");
    inodes.values().sum()
}

/// `cloud-hypervisor` with `env` set, booting the test guest with `cmdline`.
fn boot_with_env(
    scratch: &Scratch,
    api: &Path,
    cmdline: &str,
    env: &[(&str, &str)],
) -> SpawnedProcess {
    let kernel = guest_image(scratch);
    let mut args = test_guest_args(api, &kernel, cmdline);
    args.extend_from_slice(&HOT_PLUG_VM);
    let link = scratch.path("cloud-hypervisor");
    if !link.exists() {
        std::os::unix::fs::symlink(gpuvm_tests::gpuvm_bin(), &link).unwrap();
    }
    let mut vm = SpawnedProcess::spawn_with_env(&link, &args, env);
    wait_for_vm(&mut vm, api, LIMIT);
    vm
}

fn desired(mib: u64) -> String {
    format!(r#"{{"desired_ram":{}}}"#, mib * MIB)
}

/// Grow twice, then shrink by the newest slot: the guest ejects it, the resize answers,
/// the VM's size drops, the host gets the pages back, and the next grow fills the same slot
/// at the same place. Sizes that are not a slot boundary are refused. A snapshot taken
/// after a shrink has no trace of the slot, and the restored VM grows again.
#[test]
fn shrinking_ejects_the_newest_slot_and_frees_its_pages() {
    let scratch = Scratch::new("memory_hotplug", "shrink");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("memory-hotplug: waiting, 14 slot(s)", LIMIT);
    resize(&api, 204, &desired(512));
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    resize(&api, 204, &desired(640));
    vm.wait_for_stdout(
        "memory-hotplug: slot 1 base=0x110000000 size=134217728 memtest ok",
        LIMIT,
    );
    assert_eq!(ram(&api).0, 640);
    let before = guest_ram_allocated(vm.pid());

    // Inside a slot, or below boot RAM: refused, nothing changes.
    let answer = resize(&api, 400, &desired(512 + 64));
    assert!(
        answer.contains(&format!("it can shrink to {}, {}", 512 * MIB, 256 * MIB)),
        "{answer}"
    );
    let answer = resize(&api, 400, &desired(384));
    assert!(answer.contains("newest first"), "{answer}");
    let answer = resize(&api, 400, &desired(128));
    assert!(
        answer.contains("below the VM's 256 MiB of boot RAM"),
        "{answer}"
    );
    assert_eq!(ram(&api).0, 640);
    assert!(!vm.stdout().contains("ejected"), "{}", vm.stdout());

    // One slot back: answered once the guest ejected it.
    resize(&api, 204, &desired(512));
    assert_eq!(ram(&api).0, 512);
    vm.wait_for_stdout("memory-hotplug: slot 1 base=0x110000000 ejected", LIMIT);
    assert_eq!(vm_info(&api)["config"]["memory"]["size"], 512 * MIB);
    let after = guest_ram_allocated(vm.pid());
    assert!(
        before.saturating_sub(after) >= 120 * MIB,
        "the host kept the slot's pages: {before} bytes allocated before, {after} after"
    );

    // The slot and its place are free again; the guest no longer counts the old range.
    resize(&api, 204, &desired(640));
    vm.wait_for_stdout("memory-hotplug: 3 slot(s), 536870912 bytes added", LIMIT);
    let stdout = vm.stdout();
    assert!(
        stdout.contains("memory-hotplug: 1 earlier slot(s) still hold their patterns"),
        "{stdout}"
    );
    // The same hot-plug slot, so the same KVM slot (whatever its number: boot RAM's come
    // first), both times.
    let plugged = "of RAM hot-plugged at 0x110000000 (slot 1, KVM slot ";
    vm.wait_for_stderr(plugged, LIMIT);
    let stderr = vm.stderr();
    let kvm_slots: Vec<&str> = stderr
        .match_indices(plugged)
        .map(|(at, _)| stderr[at + plugged.len()..].split(')').next().unwrap())
        .collect();
    assert_eq!(kvm_slots.len(), 2, "{stderr}");
    assert_eq!(kvm_slots[0], kvm_slots[1], "{stderr}");

    // Shrunk again, then snapshotted: the memory file has nothing of slot 1.
    resize(&api, 204, &desired(512));
    assert_eq!(ram(&api).0, 512);
    let snap = scratch.path("snap");
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    // Paused: the guest cannot eject, so a shrink is refused at once.
    let answer = resize(&api, 409, &desired(256));
    assert!(answer.contains("resume it first"), "{answer}");
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
    let saved: u64 = std::fs::read_dir(&snap)
        .unwrap()
        .flatten()
        .map(|entry| entry.metadata().unwrap().len())
        .sum();
    // The memory file holds the pages in use: slot 0 (256 MiB, all memtested) and what
    // boot RAM the guest touched (a few MiB); slot 1 would add its 128 MiB.
    assert!(
        (256 * MIB..384 * MIB).contains(&saved),
        "the snapshot holds {saved} bytes"
    );

    let api2 = scratch.path("restored.sock");
    let source = format!("source_url=file://{}", snap.display());
    let mut restored = spawn_ch(
        &scratch,
        &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
    );
    wait_for_vm(&mut restored, &api2, LIMIT);
    assert_eq!(ram(&api2), (512, 1 << 30));
    api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    resize(&api2, 204, &desired(640));
    restored.wait_for_stdout(
        "memory-hotplug: slot 1 base=0x110000000 size=134217728 memtest ok",
        LIMIT,
    );
    let stdout = restored.stdout();
    assert!(
        stdout.contains("memory-hotplug: 1 earlier slot(s) still hold their patterns"),
        "{stdout}"
    );
    assert_eq!(ram(&api2).0, 640);
    // And it shrinks again after the restore.
    resize(&api2, 204, &desired(512));
    assert_eq!(ram(&api2).0, 512);
    api_expect(&api2, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = restored.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
}

/// A guest that never ejects: the shrink answers 504 after the (shortened) eject timeout,
/// the VM keeps its RAM, and it grows again afterwards (the request was withdrawn).
#[test]
fn a_guest_that_does_not_eject_keeps_its_ram() {
    let scratch = Scratch::new("memory_hotplug", "noeject");
    let api = scratch.path("api.sock");
    let mut vm = boot_with_env(
        &scratch,
        &api,
        "memory-hotplug noeject",
        &[("GPUVM_MEMORY_EJECT_TIMEOUT_MS", "1500")],
    );
    vm.wait_for_stdout("memory-hotplug: waiting, 14 slot(s)", LIMIT);
    resize(&api, 204, &desired(512));
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    let before = guest_ram_allocated(vm.pid());
    let started = std::time::Instant::now();
    let answer = resize(&api, 504, &desired(256));
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert!(
        answer.contains("did not eject slot(s) [0] within 1500 ms"),
        "{answer}"
    );
    vm.wait_for_stdout("memory-hotplug: slot 0 remove request ignored", LIMIT);
    assert_eq!(ram(&api).0, 512);
    assert_eq!(vm_info(&api)["config"]["memory"]["size"], 512 * MIB);
    assert!(guest_ram_allocated(vm.pid()) >= before);
    // Withdrawn: a grow is not held up by it.
    resize(&api, 204, &desired(640));
    vm.wait_for_stdout(
        "memory-hotplug: 1 earlier slot(s) still hold their patterns",
        LIMIT,
    );
    vm.wait_for_stdout(
        "memory-hotplug: slot 1 base=0x110000000 size=134217728 memtest ok",
        LIMIT,
    );
    assert_eq!(ram(&api).0, 640);
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
}

/// With a passthrough device attached (the emulated GPU over vfio-user), a shrink takes
/// the device's DMA mapping of the ejected range back before its pages are freed: the
/// device process sees the unmap of exactly what it was given, the host frees the pages,
/// and the range can be plugged and mapped again (the device refuses a mapping that
/// overlaps one it still has).
#[test]
fn a_gpu_loses_its_dma_mapping_before_ejected_ram_is_freed() {
    let scratch = Scratch::new("memory_hotplug", "gpu-shrink");
    let api = scratch.path("api.sock");
    let mut vm = start(&scratch, &api);
    vm.wait_for_stdout("memory-hotplug: waiting", LIMIT);
    let socket = scratch.path("gpu.sock");
    let emu_bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let mut emu = gpuvm_tests::start_emu_gpu(&emu_bin, &socket, &[]);
    let body = serde_json::json!({ "socket": socket, "id": "gpu0" }).to_string();
    api_expect(&api, 200, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    resize(&api, 204, &desired(512));
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    let mapping = "0x100000000+0x10000000";
    emu.wait_for_stderr(&format!("emu-gpu: DMA map {mapping}"), LIMIT);
    let before = guest_ram_allocated(vm.pid());
    resize(&api, 204, &desired(256));
    vm.wait_for_stdout("memory-hotplug: slot 0 base=0x100000000 ejected", LIMIT);
    emu.wait_for_stderr(&format!("emu-gpu: DMA unmap {mapping}"), LIMIT);
    assert_eq!(ram(&api).0, 256);
    let after = guest_ram_allocated(vm.pid());
    assert!(
        before.saturating_sub(after) >= 248 * MIB,
        "the host kept the slot's pages: {before} bytes allocated before, {after} after"
    );
    vm.wait_for_stderr("DMA mapping removed for", LIMIT);
    // The same range again: mapped anew for the device, and the guest's memtest passes.
    resize(&api, 204, &desired(512));
    vm.wait_for_stdout("memory-hotplug: 2 slot(s), 536870912 bytes added", LIMIT);
    assert_eq!(
        emu.stderr()
            .matches(&format!("emu-gpu: DMA map {mapping}"))
            .count(),
        2,
        "{}",
        emu.stderr()
    );
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    emu.signal(libc::SIGTERM);
}

/// Grows the guest's RAM by slot 0 (256 MiB, memtested by the guest), then starts an
/// emulated GPU (not yet attached): its socket and process.
fn grow_then_start_gpu(
    scratch: &Scratch,
    api: &Path,
    vm: &mut SpawnedProcess,
) -> (std::path::PathBuf, SpawnedProcess) {
    vm.wait_for_stdout("memory-hotplug: waiting", LIMIT);
    resize(api, 204, &desired(512));
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    let socket = scratch.path("gpu.sock");
    let emu_bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let emu = gpuvm_tests::start_emu_gpu(&emu_bin, &socket, &[]);
    (socket, emu)
}

/// A shrink racing a GPU hot-plugged moments before: the device's DMA mapping of guest RAM
/// (hot-plugged slot 0 included) runs in the background, held back 3 s by the test hook.
/// A shrink then could unmap slot 0 before the mapper thread maps it, leaving the device
/// pinning pages the VM gave back; so it is refused (409, naming the device and saying to
/// retry), the VM keeps its RAM and the guest is not asked anything. Retried, it succeeds
/// once the mapping is done: the device got slot 0 mapped first, and unmapped after.
#[test]
fn a_shrink_waits_for_a_hot_plugged_gpus_dma_mapping() {
    let scratch = Scratch::new("memory_hotplug", "gpu-shrink-race");
    let api = scratch.path("api.sock");
    let mut vm = boot_with_env(
        &scratch,
        &api,
        "memory-hotplug",
        &[("GPUVM_TEST_DMA_MAP_DELAY_MS", "3000")],
    );
    let (socket, mut emu) = grow_then_start_gpu(&scratch, &api, &mut vm);
    let body = serde_json::json!({ "socket": socket, "id": "gpu0" }).to_string();
    api_expect(&api, 200, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    let mapping = "0x100000000+0x10000000";

    // While the mapping is held back: refused, nothing changes, the guest runs on.
    let answer = resize(&api, 409, &desired(256));
    for says in [
        "still DMA-mapping guest RAM",
        socket.to_str().unwrap(),
        "retry the resize once the mapping is done",
        "keeps its 536870912 bytes",
    ] {
        assert!(answer.contains(says), "{says:?} not in {answer}");
    }
    assert_eq!(ram(&api).0, 512);
    let info = vm_info(&api);
    assert_eq!(info["config"]["memory"]["size"], 512 * MIB);
    assert_eq!(info["state"], "Running");
    assert!(!emu
        .stderr()
        .contains(&format!("emu-gpu: DMA map {mapping}")));

    // Retried as a client would: refused while the mapping runs, then done.
    let deadline = std::time::Instant::now() + LIMIT;
    let when_done = loop {
        let response =
            gpuvm_api::client::request(&api, "PUT", "/api/v1/vm.resize", Some(&desired(256)))
                .unwrap();
        match response.status {
            204 => break emu.stderr(),
            409 if std::time::Instant::now() < deadline => {
                assert!(
                    response.body.contains("still DMA-mapping guest RAM"),
                    "{}",
                    response.body
                );
                assert_eq!(ram(&api).0, 512);
                std::thread::sleep(Duration::from_millis(100));
            }
            status => panic!("vm.resize answered {status}: {}", response.body),
        }
    };
    // The shrink went through only after the device had slot 0 mapped.
    assert!(
        when_done.contains(&format!("emu-gpu: DMA map {mapping}")),
        "{when_done}"
    );
    assert_eq!(ram(&api).0, 256);
    assert_eq!(vm_info(&api)["config"]["memory"]["size"], 256 * MIB);
    vm.wait_for_stdout("memory-hotplug: slot 0 base=0x100000000 ejected", LIMIT);
    emu.wait_for_stderr(&format!("emu-gpu: DMA unmap {mapping}"), LIMIT);
    let stderr = emu.stderr();
    let mapped = stderr.find(&format!("emu-gpu: DMA map {mapping}")).unwrap();
    let unmapped = stderr
        .find(&format!("emu-gpu: DMA unmap {mapping}"))
        .unwrap();
    assert!(mapped < unmapped, "{stderr}");
    assert_eq!(
        stderr
            .matches(&format!("emu-gpu: DMA map {mapping}"))
            .count(),
        1,
        "{stderr}"
    );
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("SIGSYS"), "{}", out.describe());
    emu.signal(libc::SIGTERM);
}

/// The other order: a GPU hot-plugged while a removal is open (a guest that does not eject,
/// so the shrink waits out its 1.5 s eject timeout) waits for the shrink's answer (the run
/// loop holds the removal), then maps the RAM the VM kept, slot 0 included.
#[test]
fn a_gpu_hot_plug_waits_for_an_open_memory_removal() {
    let scratch = Scratch::new("memory_hotplug", "gpu-during-removal");
    let api = scratch.path("api.sock");
    let mut vm = boot_with_env(
        &scratch,
        &api,
        "memory-hotplug noeject",
        &[("GPUVM_MEMORY_EJECT_TIMEOUT_MS", "1500")],
    );
    let (socket, mut emu) = grow_then_start_gpu(&scratch, &api, &mut vm);
    let removal_started = std::time::Instant::now();
    let shrink = std::thread::spawn({
        let api = api.clone();
        move || resize(&api, 504, &desired(256))
    });
    vm.wait_for_stdout("memory-hotplug: slot 0 remove request ignored", LIMIT);
    let body = serde_json::json!({ "socket": socket, "id": "gpu0" }).to_string();
    api_expect(&api, 200, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    // Answered only once the removal was given up (its 1.5 s eject timeout).
    let plugged_after = removal_started.elapsed();
    assert!(
        plugged_after >= Duration::from_millis(1500),
        "the hot-plug was answered {plugged_after:?} after the removal started"
    );
    let answer = shrink.join().unwrap();
    assert!(answer.contains("did not eject slot(s) [0]"), "{answer}");
    emu.wait_for_stderr("emu-gpu: DMA map 0x100000000+0x10000000", LIMIT);
    assert_eq!(ram(&api).0, 512);
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    emu.signal(libc::SIGTERM);
}

/// A VM with no virtio device (vm.create without `rng`) that tracks dirty pages (gpuvm's
/// PUT /machine-config before boot), running `memory-hotplug`.
fn start_dirty_tracked(scratch: &Scratch, api: &Path) -> SpawnedProcess {
    let mut vmm = spawn_ch(scratch, &["--api-socket", api.to_str().unwrap()]);
    gpuvm_tests::wait_for_api_socket(&mut vmm, api);
    let create = serde_json::json!({
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 256 * MIB, "hotplug_size": 1u64 << 30},
        "payload": {"kernel": guest_image(scratch), "cmdline": "memory-hotplug"},
        "serial": {"mode": "Tty"},
        "console": {"mode": "Off"},
    })
    .to_string();
    api_expect(api, 204, "PUT", "/api/v1/vm.create", Some(&create));
    let mut config: serde_json::Value =
        serde_json::from_str(&api_expect(api, 200, "GET", "/machine-config", None)).unwrap();
    config["track_dirty_pages"] = true.into();
    api_expect(
        api,
        204,
        "PUT",
        "/machine-config",
        Some(&config.to_string()),
    );
    api_expect(api, 204, "PUT", "/api/v1/vm.boot", None);
    vmm.wait_for_stdout("memory-hotplug: waiting, 14 slot(s)", LIMIT);
    vmm
}

fn set_state(api: &Path, state: &str) {
    let body = format!(r#"{{"state": "{state}"}}"#);
    api_expect(api, 204, "PATCH", "/vm", Some(&body));
}

/// PUT /snapshot/create of `snapshot_type` into `dir`: (a diff?, memory bytes written).
fn snapshot_into(api: &Path, dir: &Path, snapshot_type: &str) -> (bool, u64) {
    let body = format!(
        r#"{{"snapshot_type": "{snapshot_type}", "snapshot_path": "{}"}}"#,
        dir.display()
    );
    let answer: serde_json::Value = serde_json::from_str(&api_expect(
        api,
        200,
        "PUT",
        "/snapshot/create",
        Some(&body),
    ))
    .unwrap();
    (
        answer["diff"].as_bool().unwrap(),
        answer["memory_bytes_written"].as_u64().unwrap(),
    )
}

/// Hot-plugged RAM is in the dirty-log walk: a Diff after growing holds the pages of the
/// new range the guest wrote (its whole memtest), the next Diff of the idle guest holds
/// next to nothing (before, every snapshot of a VM with hot-plugged RAM was a full file),
/// and the chain restores to a guest whose range still holds its pattern.
#[test]
fn diffs_hold_only_the_dirty_pages_of_hot_plugged_ram() {
    let scratch = Scratch::new("memory_hotplug", "diff");
    let api = scratch.path("api.sock");
    let dir = scratch.path("snap");
    let mut vm = start_dirty_tracked(&scratch, &api);
    // Plugged while paused: the base holds the new range before the guest wrote to it.
    set_state(&api, "Paused");
    resize(&api, 204, &desired(512));
    let (diff, _) = snapshot_into(&api, &dir, "Full");
    assert!(!diff);
    set_state(&api, "Resumed");
    vm.wait_for_stdout(
        "memory-hotplug: slot 0 base=0x100000000 size=268435456 memtest ok",
        LIMIT,
    );
    set_state(&api, "Paused");
    let (diff, written) = snapshot_into(&api, &dir, "Diff");
    assert!(diff, "a full file after growing");
    assert!(
        written >= 256 * MIB,
        "the range's dirty pages: {written} bytes"
    );
    set_state(&api, "Resumed");
    std::thread::sleep(Duration::from_millis(200));
    set_state(&api, "Paused");
    let (diff, written) = snapshot_into(&api, &dir, "Diff");
    assert!(diff);
    assert!(written < 16 * MIB, "an idle guest's diff: {written} bytes");
    assert_eq!(gpuvm_tests::snapshot_support::memory_files(&dir).len(), 3);
    // Killed: the snapshot is all that is left of it.
    drop(vm);

    let api2 = scratch.path("restored.sock");
    let source = format!("source_url=file://{}", dir.display());
    let mut restored = spawn_ch(
        &scratch,
        &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
    );
    wait_for_vm(&mut restored, &api2, LIMIT);
    api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    resize(&api2, 204, &desired(640));
    restored.wait_for_stdout(
        "memory-hotplug: 1 earlier slot(s) still hold their patterns",
        LIMIT,
    );
    restored.wait_for_stdout(
        "memory-hotplug: slot 1 base=0x110000000 size=134217728 memtest ok",
        LIMIT,
    );
    // A slot plugged since the chain's last file: the layout is not the chain's, so a
    // Diff asked for now is written as a full file.
    set_state(&api2, "Paused");
    let (diff, written) = snapshot_into(&api2, &dir, "Diff");
    assert!(!diff, "a diff over a changed layout ({written} bytes)");
    let stdout = restored.stdout();
    assert!(!stdout.contains("FAIL"), "{stdout}");
}
