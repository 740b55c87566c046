//! virtio devices end to end: the test guest's own ring-3 virtio-pci driver (the `virtio-*`
//! workloads) against gpuvm's devices, with seccomp on (the default), and what the host
//! sees of it: the disk image's bytes, the vsock socket, the tap.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use gpuvm_tests::snapshot_support::arg;
use gpuvm_tests::virtio_support::{self, blk_image, vsock_echo};
use gpuvm_tests::{run_gpuvm, RunOutput, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
/// Where the `virtio-blk` workload writes its pattern, and with which seed.
const TEST_OFFSET: u64 = 8 * 512;
const TEST_LEN: u64 = 8 * 512;
const PATTERN_SEED: u64 = 0xb10c;

fn pattern_is_on_disk(image: &Path) -> bool {
    virtio_support::pattern_is_on_disk(image, TEST_OFFSET, TEST_LEN, PATTERN_SEED)
}

fn assert_ok(out: &RunOutput, line: &str) {
    out.assert_code(0).assert_stdout_has(line);
}

#[test]
fn entropy_reaches_the_guest_with_msix() {
    let out = run_gpuvm(&["run", "--cmdline", "virtio-rng", "--rng"], LIMIT);
    assert_ok(&out, "virtio-rng: ok 128 bytes");
    out.assert_stdout_has("virtio-rng: msi-x ok");
}

#[test]
fn entropy_from_a_file_source() {
    let scratch = Scratch::new("virtio", "rng-file");
    let source = scratch.path("entropy");
    let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 + i / 256) as u8).collect();
    std::fs::write(&source, bytes).unwrap();
    let rng = format!("src={}", arg(&source));
    let out = run_gpuvm(&["run", "--cmdline", "virtio-rng", "--rng", &rng], LIMIT);
    assert_ok(&out, "virtio-rng: ok 128 bytes");
    // The guest prints what it read: the file's first 64 bytes.
    let first: String = (0..64u32)
        .map(|i| format!("{:02x}", (i * 7 + i / 256) as u8))
        .collect();
    out.assert_stdout_has(&format!("virtio-rng: block 1 {first}"));
}

#[test]
fn a_drive_is_read_written_and_flushed() {
    let scratch = Scratch::new("virtio", "blk-rw");
    let image = blk_image(&scratch, 1 << 20);
    let drive = format!("id=root,path={},serial=gpuvm-disk-1", arg(&image));
    let out = run_gpuvm(
        &["run", "--cmdline", "virtio-blk", "--drive", &drive],
        LIMIT,
    );
    assert_ok(
        &out,
        "virtio-blk: ok capacity=2048 serial=gpuvm-disk-1 rw=yes",
    );
    out.assert_stdout_has("flush offered");
    assert!(
        pattern_is_on_disk(&image),
        "the guest's write is in the image"
    );
}

#[test]
fn a_read_only_drive_refuses_writes_and_keeps_its_image() {
    for engine in ["sync", "async"] {
        let scratch = Scratch::new("virtio", &format!("blk-ro-{engine}"));
        let image = blk_image(&scratch, 1 << 20);
        let before = std::fs::read(&image).unwrap();
        let drive = format!("id=root,path={},ro,engine={engine}", arg(&image));
        let drive = drive.replace("engine=sync", "engine=Sync");
        let drive = drive.replace("engine=async", "engine=Async");
        let out = run_gpuvm(
            &["run", "--cmdline", "virtio-blk", "--drive", &drive],
            LIMIT,
        );
        assert_ok(&out, "virtio-blk: write refused");
        out.assert_stdout_has("rw=no");
        assert_eq!(std::fs::read(&image).unwrap(), before, "{engine}");
    }
}

#[test]
fn bad_drives_are_refused_before_the_guest_runs() {
    let scratch = Scratch::new("virtio", "blk-bad");
    let fifo = scratch.path("fifo");
    let c_path = std::ffi::CString::new(arg(&fifo)).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let dir = scratch.path("dir");
    std::fs::create_dir(&dir).unwrap();
    for (path, why) in [
        (arg(&fifo), "fifo"),
        ("/dev/zero", "/dev/zero"),
        (arg(&dir), "directory"),
        ("/nonexistent/disk.img", "missing"),
    ] {
        let drive = format!("id=root,path={path}");
        let out = run_gpuvm(
            &["run", "--cmdline", "virtio-blk", "--drive", &drive],
            LIMIT,
        );
        out.assert_code(125);
        out.assert_stderr_has("drive root");
        assert!(
            !out.stdout.contains("testguest: ready"),
            "{why}: the guest ran:\n{}",
            out.describe()
        );
    }
}

#[test]
fn an_image_in_use_read_write_is_refused_to_a_second_vm() {
    let scratch = Scratch::new("virtio", "blk-lock");
    let image = blk_image(&scratch, 1 << 20);
    let drive = format!("id=root,path={}", arg(&image));
    // The first VM waits for vsock connections with the drive open.
    let uds = scratch.path("v.sock");
    let vsock = format!("cid=3,uds={}", arg(&uds));
    let mut first = SpawnedProcess::gpuvm(&[
        "run",
        "--cmdline",
        "virtio-vsock",
        "--drive",
        &drive,
        "--vsock",
        &vsock,
    ]);
    first.wait_for_stdout("virtio-vsock: listening", LIMIT);
    let second = run_gpuvm(
        &["run", "--cmdline", "virtio-blk", "--drive", &drive],
        LIMIT,
    );
    second.assert_code(125);
    second.assert_stderr_has("lock");
    first.signal(libc::SIGKILL);
}

#[test]
fn vsock_host_connections_echo_through_the_guest() {
    let scratch = Scratch::new("virtio", "vsock");
    let uds = scratch.path("v.sock");
    let vsock = format!("cid=7,uds={}", arg(&uds));
    let mut vm = SpawnedProcess::gpuvm(&["run", "--cmdline", "virtio-vsock 3", "--vsock", &vsock]);
    vm.wait_for_stdout("virtio-vsock: listening", LIMIT);
    // Small, then larger than the guest's 64 KiB credit (flow control both ways).
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    vsock_echo(&uds, b"hello over vsock");
    vsock_echo(&uds, &big);
    // A malformed request is closed without reaching the guest.
    let mut bad = UnixStream::connect(&uds).unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    bad.write_all(b"CONNECT lots\n").unwrap();
    let mut answer = String::new();
    let _ = bad.read_to_string(&mut answer);
    assert!(!answer.starts_with("OK"), "{answer:?}");
    vsock_echo(&uds, b"third");
    let out = vm.wait(LIMIT);
    let echoed = 16 + big.len() + 5;
    assert_ok(&out, &format!("virtio-vsock: ok cid=7 echoed={echoed}"));
    assert!(!uds.exists(), "the socket file is removed at exit");
}

/// The guest is served by the device's own thread, under the device filter.
#[test]
fn device_threads_run_under_their_own_filter() {
    let scratch = Scratch::new("virtio", "threads");
    let uds = scratch.path("v.sock");
    let vsock = format!("cid=3,uds={}", arg(&uds));
    let image = blk_image(&scratch, 1 << 20);
    let drive = format!("id=root,path={}", arg(&image));
    let mut vm = SpawnedProcess::gpuvm(&[
        "run",
        "--cmdline",
        "virtio-vsock",
        "--vsock",
        &vsock,
        "--drive",
        &drive,
        "--rng",
    ]);
    vm.wait_for_stdout("virtio-vsock: listening", LIMIT);
    let threads = gpuvm_tests::thread_seccomp_modes(vm.pid());
    let vsock_thread = threads.iter().find(|(name, _)| name == "virtio-vsock");
    assert_eq!(
        vsock_thread.map(|(_, mode)| *mode),
        Some(2),
        "the active vsock device's thread is filtered: {threads:?}"
    );
    // One I/O thread per device: the two the guest did not activate are idle, and none is
    // kept for devices hot-plugged later (the factory makes theirs); every one under the
    // device filter.
    let idle: Vec<_> = threads
        .iter()
        .filter(|(name, _)| name.starts_with("virtio-idle"))
        .collect();
    assert_eq!(idle.len(), 2, "{threads:?}");
    assert!(idle.iter().all(|(_, mode)| *mode == 2), "{threads:?}");
    vsock_echo(&uds, b"filtered");
    let out = vm.wait(LIMIT);
    assert_ok(&out, "virtio-vsock: ok");
}

/// Two VMs cannot share a hybrid vsock socket: the second is refused before its guest runs
/// (Firecracker's CID-per-socket model: the socket path is the VM's address on the host),
/// and the first keeps serving.
#[test]
fn a_vsock_socket_in_use_is_refused_to_a_second_vm() {
    let scratch = Scratch::new("virtio", "vsock-clash");
    let uds = scratch.path("v.sock");
    let vsock = format!("cid=3,uds={}", arg(&uds));
    let mut first = SpawnedProcess::gpuvm(&["run", "--cmdline", "virtio-vsock", "--vsock", &vsock]);
    first.wait_for_stdout("virtio-vsock: listening", LIMIT);
    let second = run_gpuvm(
        &["run", "--cmdline", "virtio-vsock", "--vsock", &vsock],
        LIMIT,
    );
    second.assert_code(125);
    second.assert_clean_error("vsock");
    assert!(
        !second.stdout.contains("virtio-vsock: listening"),
        "{}",
        second.describe()
    );
    vsock_echo(&uds, b"still the first VM's");
    first.wait(LIMIT).assert_code(0);
}
