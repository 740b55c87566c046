//! vhost-user devices end to end: the test guest's ring-3 virtio drivers against real
//! backends that the tests start themselves on files they create: qemu-storage-daemon
//! exporting vhost-user-blk (`--drive id=ID,vhost_user=SOCKET`) and virtiofsd serving a
//! directory (`--fs tag=TAG,socket=SOCKET`, the `virtio-fs` workload speaking FUSE). Also
//! what gpuvm does with bad sockets and tags, a second VM on a busy backend, a backend
//! killed under a running VM, and snapshots refused for vhost-user devices.
//!
//! A test whose backend binary is missing says so on stderr and passes without running
//! (scripts/install-deps.sh installs both).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::snapshot_support::arg;
use gpuvm_tests::vhost_user_support::{backend_binary, start_qsd, start_virtiofsd, Backend};
use gpuvm_tests::virtio_support::{self, blk_image, vsock_echo};
use gpuvm_tests::{
    api_expect, api_start_instance, run_gpuvm, wait_for_api_socket, RunOutput, Scratch,
    SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(60);
/// How long gpuvm may take to refuse a device whose backend is not there (its connect
/// timeout is 5 s, its reply timeout 5 s).
const REFUSAL_LIMIT: Duration = Duration::from_secs(15);
/// Where the `virtio-blk` workload writes its pattern, and with which seed.
const TEST_OFFSET: u64 = 8 * 512;
const TEST_LEN: u64 = 8 * 512;
const PATTERN_SEED: u64 = 0xb10c;
/// The `virtio-devices` workload's pattern seed; connection 1 writes sector 16.
const DEVICES_PATTERN_SEED: u64 = 0xd5e7;
const DEVICES_FIRST_SECTOR: u64 = 16;
/// What the `virtio-fs` workload writes into `from-guest.txt`
/// (guest-images/testguest/src/virtio/fs.rs).
const FS_WRITTEN: &str = "written by the gpuvm test guest over virtio-fs\n";

/// The whole stdout line that starts with `prefix` (panics with the output without one).
fn line_starting<'a>(out: &'a RunOutput, prefix: &str) -> &'a str {
    out.stdout
        .lines()
        .find(|line| line.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?}\n{}", out.describe()))
}

/// Asserts that `lines` appear whole in stdout in this order.
fn assert_lines_in_order(out: &RunOutput, lines: &[&str]) {
    let mut rest = out.stdout.lines();
    for line in lines {
        assert!(
            rest.any(|got| got == *line),
            "line {line:?} missing or out of order\n{}",
            out.describe()
        );
    }
}

/// Refused before the guest ran: status 125 within [`REFUSAL_LIMIT`], no panic, stderr
/// names every one of `needles`, the guest printed nothing.
fn assert_refused(out: &RunOutput, needles: &[&str], context: &str) {
    assert_eq!(out.code(), Some(125), "{context}: {}", out.describe());
    assert!(
        out.elapsed < REFUSAL_LIMIT,
        "{context}: took {:?}, expected under {REFUSAL_LIMIT:?}\n{}",
        out.elapsed,
        out.describe()
    );
    for needle in needles {
        out.assert_clean_error(needle);
    }
    assert!(
        !out.stdout.contains("testguest: ready"),
        "{context}: the guest ran\n{}",
        out.describe()
    );
}

/// `GET /`'s instance state.
fn instance_state(api: &Path) -> String {
    let body = api_expect(api, 200, "GET", "/", None);
    let info: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET / body {body:?}: {e}"));
    info["state"].as_str().unwrap_or_default().to_string()
}

/// `PUT /snapshot/create` into `dir`, which must be refused with 400, the VM running on;
/// the fault message.
fn snapshot_refused(api: &Path, dir: &Path) -> String {
    assert_eq!(instance_state(api), "Running", "before the snapshot");
    let body = format!(r#"{{"snapshot_path": "{}"}}"#, arg(dir));
    let fault = api_expect(api, 400, "PUT", "/snapshot/create", Some(&body));
    assert!(
        !dir.join("state").exists(),
        "a refused snapshot wrote {}",
        dir.join("state").display()
    );
    assert_eq!(instance_state(api), "Running", "after the refused snapshot");
    fault
}

/// A drive `data` served by qemu-storage-daemon from a 1 MiB image in a new scratch
/// directory `name`.
struct QsdDrive {
    scratch: Scratch,
    image: PathBuf,
    socket: PathBuf,
    backend: Backend,
    /// `--drive`'s value.
    drive: String,
}

/// [`QsdDrive`], or `None` (the test skipped) without qemu-storage-daemon.
fn qsd_drive(test: &str, name: &str, writable: bool) -> Option<QsdDrive> {
    let qsd = backend_binary("qemu-storage-daemon", "vhost_user", test)?;
    let scratch = Scratch::new("vhost_user", name);
    let image = blk_image(&scratch, 1 << 20);
    let socket = scratch.path("qsd.sock");
    let backend = start_qsd(&qsd, &image, &socket, writable);
    let drive = format!("id=data,vhost_user={}", arg(&socket));
    Some(QsdDrive {
        scratch,
        image,
        socket,
        backend,
        drive,
    })
}

/// `gpuvm run --api-sock` with the `cmdline` workload, `devices` and a vsock device (cid
/// 3), started through the API; returns the VM, the API socket and the vsock socket once
/// the guest listens.
fn start_api_vm(
    scratch: &Scratch,
    cmdline: &str,
    devices: &[&str],
) -> (SpawnedProcess, PathBuf, PathBuf) {
    let api = scratch.path("api.sock");
    let uds = scratch.path("v.sock");
    let vsock = format!("cid=3,uds={}", arg(&uds));
    let mut args = vec!["run", "--api-sock", arg(&api), "--cmdline", cmdline];
    args.extend_from_slice(devices);
    args.extend(["--vsock", &vsock]);
    let mut vm = SpawnedProcess::gpuvm(&args);
    wait_for_api_socket(&mut vm, &api);
    api_start_instance(&api);
    let workload = cmdline.split(' ').next().unwrap_or(cmdline);
    vm.wait_for_stdout(&format!("{workload}: listening"), LIMIT);
    (vm, api, uds)
}

/// Runs the `virtio-blk` workload with `qsd`'s export given as `flag value`: the guest
/// sees 2048 writable sectors with flush, writes, flushes and reads back its pattern, ends
/// with an ok line that goes on with `ok_fields` (and ends `rw=yes`), and the pattern is in
/// the image.
fn assert_blk_read_written_and_flushed(qsd: &QsdDrive, flag: &str, value: &str, ok_fields: &str) {
    let out = run_gpuvm(&["run", "--cmdline", "virtio-blk", flag, value], LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("virtio-blk: capacity 2048 sectors, read-write, flush offered");
    out.assert_stdout_has("virtio-blk: wrote, flushed and read back 4096 bytes at sector 8");
    let ok = line_starting(&out, "virtio-blk: ok ");
    assert!(
        ok.starts_with(&format!("virtio-blk: ok {ok_fields}")) && ok.ends_with(" rw=yes"),
        "{ok:?}\n{}",
        out.describe()
    );
    assert!(
        virtio_support::pattern_is_on_disk(&qsd.image, TEST_OFFSET, TEST_LEN, PATTERN_SEED),
        "the guest's write (sectors 8..16) is not in {}\n{}",
        qsd.image.display(),
        qsd.backend.stderr()
    );
}

#[test]
fn a_drive_on_qemu_storage_daemon_is_read_written_and_flushed() {
    let Some(qsd) = qsd_drive(
        "a_drive_on_qemu_storage_daemon_is_read_written_and_flushed",
        "blk-rw",
        true,
    ) else {
        return;
    };
    assert_blk_read_written_and_flushed(&qsd, "--drive", &qsd.drive, "capacity=2048 serial=");
}

#[test]
fn a_read_only_export_refuses_writes_and_keeps_its_image() {
    let Some(qsd) = qsd_drive(
        "a_read_only_export_refuses_writes_and_keeps_its_image",
        "blk-ro",
        false,
    ) else {
        return;
    };
    let before = std::fs::read(&qsd.image).unwrap();
    let out = run_gpuvm(
        &["run", "--cmdline", "virtio-blk", "--drive", &qsd.drive],
        LIMIT,
    );
    out.assert_code(0);
    out.assert_stdout_has("virtio-blk: capacity 2048 sectors, read-only");
    out.assert_stdout_has("virtio-blk: write refused");
    let ok = line_starting(&out, "virtio-blk: ok ");
    assert!(ok.ends_with(" rw=no"), "{ok:?}\n{}", out.describe());
    assert!(
        std::fs::read(&qsd.image).unwrap() == before,
        "the read-only export's image changed\n{}",
        qsd.backend.stderr()
    );
}

#[test]
fn a_virtiofsd_share_is_read_and_written_over_fuse() {
    let Some(virtiofsd) = backend_binary(
        "virtiofsd",
        "vhost_user",
        "a_virtiofsd_share_is_read_and_written_over_fuse",
    ) else {
        return;
    };
    let scratch = Scratch::new("vhost_user", "fs");
    let shared = scratch.path("shared");
    std::fs::create_dir(&shared).unwrap();
    // Longer than the 64 bytes the guest prints, with a newline it prints as '.'.
    let hello = "hello from the host: this file is shared with the guest by virtiofsd\nline 2\n";
    std::fs::write(shared.join("hello.txt"), hello).unwrap();
    let socket = scratch.path("fs.sock");
    let backend = start_virtiofsd(&virtiofsd, &shared, &socket);
    // 36 bytes: the whole tag field, with no NUL after it.
    let tag = "host-share-0123456789abcdefghijklmno";
    assert_eq!(tag.len(), 36);
    let fs = format!("tag={tag},socket={}", arg(&socket));
    let out = run_gpuvm(&["run", "--cmdline", "virtio-fs", "--fs", &fs], LIMIT);
    out.assert_code(0);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());

    let init = line_starting(&out, "virtio-fs: init ok major=7 minor=");
    let minor: u32 = init["virtio-fs: init ok major=7 minor=".len()..]
        .parse()
        .unwrap_or_else(|e| panic!("{init:?}: {e}"));
    assert!(
        minor >= 27,
        "virtiofsd answered minor {minor}; FUSE 7.27 is its oldest"
    );
    let first_64: String = hello[..64].replace('\n', ".");
    let hello_line = format!("virtio-fs: hello.txt {} bytes: {first_64}", hello.len());
    let wrote_line = format!("virtio-fs: wrote from-guest.txt {} bytes", FS_WRITTEN.len());
    assert_lines_in_order(
        &out,
        &[
            &format!("virtio-fs: tag={tag} queues=1"),
            init,
            &hello_line,
            &wrote_line,
            "virtio-fs: ok",
        ],
    );

    let created = shared.join("from-guest.txt");
    let written = std::fs::read_to_string(&created).unwrap_or_else(|e| {
        panic!(
            "{}: {e}\n{}\n{}",
            created.display(),
            out.describe(),
            backend.stderr()
        )
    });
    assert_eq!(written, FS_WRITTEN, "from-guest.txt on the host");
    let mode = std::fs::metadata(&created).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o644, "from-guest.txt's mode is {mode:o}");
    assert_eq!(
        std::fs::read_to_string(shared.join("hello.txt")).unwrap(),
        hello,
        "hello.txt changed"
    );
}

#[test]
fn a_socket_nobody_serves_is_refused_before_the_guest_runs() {
    let scratch = Scratch::new("vhost_user", "no-backend");
    // A socket file whose listener is gone (connect: ECONNREFUSED) and a missing path.
    let stale = scratch.path("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let missing = scratch.path("missing/nobody.sock");
    let mut cases = Vec::new();
    for (socket, why) in [(&stale, "stale socket"), (&missing, "missing path")] {
        cases.push((
            vec![
                "--drive".to_string(),
                format!("id=data,vhost_user={}", arg(socket)),
            ],
            "vhost-user-blk data",
            socket,
            why,
        ));
        cases.push((
            vec![
                "--fs".to_string(),
                format!("tag=share,socket={}", arg(socket)),
            ],
            "vhost-user-fs share",
            socket,
            why,
        ));
    }
    // Each waits out gpuvm's 5 s connect timeout: run them side by side.
    std::thread::scope(|scope| {
        let runs: Vec<_> = cases
            .iter()
            .map(|(device_args, device, socket, why)| {
                scope.spawn(move || {
                    let mut args = vec!["run", "--cmdline", "virtio-blk"];
                    args.extend(device_args.iter().map(String::as_str));
                    let out = run_gpuvm(&args, LIMIT);
                    let context = format!("{device} on a {why}");
                    assert_refused(&out, &[device, arg(socket)], &context);
                    out.assert_clean_error("no vhost-user backend accepted a connection");
                })
            })
            .collect();
        for run in runs {
            if let Err(panic) = run.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

#[test]
fn a_tag_longer_than_the_config_field_is_refused() {
    let scratch = Scratch::new("vhost_user", "long-tag");
    let socket = scratch.path("fs.sock");
    let tag = "t".repeat(37);
    let fs = format!("tag={tag},socket={}", arg(&socket));
    let out = run_gpuvm(&["run", "--cmdline", "virtio-fs", "--fs", &fs], LIMIT);
    assert_refused(
        &out,
        &[
            &format!("vhost-user-fs {tag}"),
            "the tag is 37 bytes, at most 36",
        ],
        "a 37-byte tag",
    );
    // Refused from the configuration alone, not after a connect attempt.
    assert!(
        out.elapsed < Duration::from_secs(4),
        "took {:?}\n{}",
        out.elapsed,
        out.describe()
    );
}

/// qemu-storage-daemon serves one frontend at a time: a second VM on its socket gets no
/// answer, and gpuvm refuses the drive once its reply timeout passes. The first VM's drive
/// keeps working.
#[test]
fn a_second_vm_on_a_busy_qemu_storage_daemon_is_refused() {
    let Some(qsd) = qsd_drive(
        "a_second_vm_on_a_busy_qemu_storage_daemon_is_refused",
        "blk-busy",
        true,
    ) else {
        return;
    };
    let uds = qsd.scratch.path("v.sock");
    let vsock = format!("cid=3,uds={}", arg(&uds));
    // The first VM has the drive active (it read sector 0) and waits for a connection.
    let mut first = SpawnedProcess::gpuvm(&[
        "run",
        "--cmdline",
        "virtio-devices",
        "--drive",
        &qsd.drive,
        "--rng",
        "--vsock",
        &vsock,
    ]);
    first.wait_for_stdout("virtio-devices: listening", LIMIT);

    let second_drive = format!("id=second,vhost_user={}", arg(&qsd.socket));
    let second = run_gpuvm(
        &["run", "--cmdline", "virtio-blk", "--drive", &second_drive],
        LIMIT,
    );
    assert_refused(
        &second,
        &[
            "vhost-user-blk second",
            arg(&qsd.socket),
            "did not answer",
            "already serves a frontend",
        ],
        "a second VM on one qemu-storage-daemon socket",
    );

    // The first VM's drive still works: after the connection it writes sector 16.
    vsock_echo(&uds, b"still served");
    let out = first.wait(LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("virtio-devices: wrote sector 16");
    out.assert_stdout_has("virtio-devices: ok connections=1");
    assert!(
        virtio_support::pattern_is_on_disk(
            &qsd.image,
            DEVICES_FIRST_SECTOR * 512,
            512,
            DEVICES_PATTERN_SEED
        ),
        "the first VM's write after the refusal is not in the image\n{}",
        qsd.backend.stderr()
    );
}

/// qemu-storage-daemon is killed under a running VM whose drive is active: the API keeps
/// answering, a snapshot is refused naming the drive, and SendCtrlAltDel still ends gpuvm.
#[test]
fn a_killed_qemu_storage_daemon_leaves_the_vmm_in_control() {
    let Some(qsd) = qsd_drive(
        "a_killed_qemu_storage_daemon_leaves_the_vmm_in_control",
        "blk-death",
        true,
    ) else {
        return;
    };
    let (mut vm, api, _uds) = start_api_vm(
        &qsd.scratch,
        "virtio-devices",
        &["--drive", &qsd.drive, "--rng"],
    );

    qsd.backend.kill9();
    // The device notices the hang-up by itself (its relay watches the socket).
    vm.wait_for_stderr("the device is broken", Duration::from_secs(10));

    let snapshot = qsd.scratch.path("snapshot");
    let fault = snapshot_refused(&api, &snapshot);
    assert!(
        fault.contains("vhost-user drive data") && fault.contains(arg(&qsd.socket)),
        "the refusal does not name the drive and its socket: {fault}"
    );

    let asked = Instant::now();
    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "SendCtrlAltDel"}"#),
    );
    let out = vm.wait(Duration::from_secs(15));
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "gpuvm took {:?} to end after SendCtrlAltDel\n{}",
        asked.elapsed(),
        out.describe()
    );
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
}

/// A snapshot of a VM with a virtio-fs share is refused (virtiofsd holds its open files),
/// naming the share and its socket, and the VM runs on.
#[test]
fn a_snapshot_of_a_vm_with_a_share_is_refused_and_the_vm_runs_on() {
    let Some(virtiofsd) = backend_binary(
        "virtiofsd",
        "vhost_user",
        "a_snapshot_of_a_vm_with_a_share_is_refused_and_the_vm_runs_on",
    ) else {
        return;
    };
    let scratch = Scratch::new("vhost_user", "fs-snapshot");
    let shared = scratch.path("shared");
    std::fs::create_dir(&shared).unwrap();
    let socket = scratch.path("fs.sock");
    let backend = start_virtiofsd(&virtiofsd, &shared, &socket);
    let fs = format!("tag=share,socket={}", arg(&socket));
    let (vm, api, uds) = start_api_vm(&scratch, "virtio-vsock", &["--fs", &fs]);

    let snapshot = scratch.path("snapshot");
    let fault = snapshot_refused(&api, &snapshot);
    assert!(
        fault.contains("virtio-fs share share") && fault.contains(arg(&socket)),
        "the refusal does not name the share and its socket: {fault}\n{}",
        backend.stderr()
    );
    // The guest runs on: it answers a connection and finishes.
    vsock_echo(&uds, b"after the refusal");
    let out = vm.wait(LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("virtio-vsock: ok cid=3 echoed=17");
}

/// The generic `--vhost-user` device of type 2 (block) on qemu-storage-daemon: the test
/// guest's virtio-blk driver finds the disk the backend describes (its capacity from
/// GET_CONFIG, FLUSH among the backend's features) and writes, flushes and reads back.
#[test]
fn a_generic_vhost_user_block_device_is_read_written_and_flushed() {
    let Some(qsd) = qsd_drive(
        "a_generic_vhost_user_block_device_is_read_written_and_flushed",
        "generic-blk",
        true,
    ) else {
        return;
    };
    let device = format!("type=2,socket={},id=gdisk,queue_size=128", arg(&qsd.socket));
    assert_blk_read_written_and_flushed(&qsd, "--vhost-user", &device, "capacity=2048 ");
}

/// Bad `--vhost-user` values are refused from the configuration alone, before any connect
/// attempt and before the guest runs, each naming what is wrong.
#[test]
fn bad_generic_vhost_user_devices_are_refused() {
    let scratch = Scratch::new("vhost_user", "generic-bad");
    let socket = scratch.path("nobody.sock");
    let socket = arg(&socket);
    let cases = [
        (
            format!("type=99,socket={socket}"),
            "type 99 is not a virtio device ID",
        ),
        (format!("type=0,socket={socket}"), "type 0 is reserved"),
        (
            format!("type=5,socket={socket}"),
            "type 5 (balloon) cannot be a generic vhost-user device",
        ),
        (format!("type=26,socket={socket}"), "use --fs"),
        ("type=2,id=gdisk".to_string(), "missing field `socket`"),
        (format!("socket={socket}"), "missing field `type`"),
        (format!("type=block,socket={socket}"), "invalid type"),
        (
            format!("type=2,socket={socket},num_queues=0"),
            "num_queues 0 is not from 1 to 64",
        ),
    ];
    for (device, needle) in cases {
        let out = run_gpuvm(
            &["run", "--cmdline", "virtio-blk", "--vhost-user", &device],
            LIMIT,
        );
        assert_refused(&out, &["vhost-user", needle], &device);
        assert!(
            out.elapsed < Duration::from_secs(4),
            "{device}: took {:?}\n{}",
            out.elapsed,
            out.describe()
        );
    }
}

/// Two vhost-user devices on one backend socket (a backend serves one front end per
/// socket) are refused before anything connects, whichever kinds they are.
#[test]
fn two_devices_on_one_socket_are_refused() {
    let scratch = Scratch::new("vhost_user", "one-socket");
    let socket = scratch.path("shared.sock");
    let socket = arg(&socket);
    let cases = [
        vec![
            "--drive".to_string(),
            format!("id=a,vhost_user={socket}"),
            "--drive".to_string(),
            format!("id=b,vhost_user={socket}"),
        ],
        vec![
            "--drive".to_string(),
            format!("id=a,vhost_user={socket}"),
            "--fs".to_string(),
            format!("tag=share,socket={socket}"),
        ],
        vec![
            "--fs".to_string(),
            format!("tag=share,socket={socket}"),
            "--vhost-user".to_string(),
            format!("type=2,id=g,socket={socket}"),
        ],
    ];
    for devices in cases {
        let mut args = vec!["run", "--cmdline", "virtio-blk"];
        args.extend(devices.iter().map(String::as_str));
        let out = run_gpuvm(&args, LIMIT);
        let context = devices.join(" ");
        assert_refused(&out, &["both name the vhost-user socket", socket], &context);
        assert!(
            out.elapsed < Duration::from_secs(4),
            "{context}: took {:?} (it waited for a backend)\n{}",
            out.elapsed,
            out.describe()
        );
    }
}
