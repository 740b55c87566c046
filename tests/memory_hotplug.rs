//! Memory hot-plug through Cloud Hypervisor's vm.resize `desired_ram`, as Kata's clh driver
//! uses it (ResizeMemory: it reads vm.info's `memory.size`, rounds the growth up to the
//! guest's memory block and sends the new total): gpuvm as `cloud-hypervisor` boots the
//! test guest with `memory.hotplug_size`, and the guest's `memory-hotplug` workload finds
//! each new range through the ACPI memory hot-plug registers and memtests all of it from
//! ring 3.

use std::path::Path;
use std::time::Duration;

use gpuvm_tests::cloud_hypervisor_support::{boot_test_guest, spawn_ch, vm_info, wait_for_vm};
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
            "cannot take hot-plugged RAM back",
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
