//! virtio devices across a snapshot and a drive hot-swap: the test guest's `virtio-devices`
//! workload (a drive, the entropy device and a vsock echo server together) is snapshotted
//! after one vsock connection and restored, eagerly and lazily, by another gpuvm that
//! serves the next connection on the same socket path; a restore whose image changed size
//! is refused; and a VM configured through the API has its image swapped while it runs
//! (PATCH /drives/{id}), with the API's answers to wrong drive requests.
//!
//! After vsock connection `k` the guest prints the drive's capacity and the first 8 bytes
//! of sector 0 as it reads them then, reads entropy, and writes a pattern to sector
//! 16 + k - 1, which the tests look for in the image files.

use std::io::{Read, Write};
use std::path::Path;

use gpuvm_tests::snapshot_support::{arg, copy_dir, signal_snapshot, LIMIT};
use gpuvm_tests::virtio_support::{
    assert_in_order, blk_image, disk_image, has_pattern, vsock_connect, vsock_echo, BLK_MAGIC,
    SECTOR,
};
use gpuvm_tests::{
    api_expect, api_start_instance, wait_for_api_socket, RunOutput, Scratch, SpawnedProcess,
};

/// The workload's pattern seed (guest-images/testguest/src/virtio/devices.rs).
const PATTERN_SEED: u64 = 0xd5e7;
/// Connection `k` writes sector `FIRST_WRITE_SECTOR + k - 1`.
const FIRST_WRITE_SECTOR: u64 = 16;
const MIB: u64 = 1 << 20;

/// The guest's line for what it read from the drive: capacity in sectors, sector 0's
/// first 8 bytes in hex.
fn blk_fields(capacity_bytes: u64, magic: &[u8; 8]) -> String {
    let hex: String = magic.iter().map(|b| format!("{b:02x}")).collect();
    format!("blk capacity={} sector0={hex}", capacity_bytes / SECTOR)
}

fn is_zero(image: &[u8], sector: u64) -> bool {
    let start = (sector * SECTOR) as usize;
    image[start..start + SECTOR as usize]
        .iter()
        .all(|&b| b == 0)
}

/// Checks which of the written sectors `image` holds: `written` with the pattern, the
/// other candidates (16..16+4) still zero.
fn assert_sectors(image_path: &Path, written: &[u64], context: &str) {
    let image = std::fs::read(image_path).expect("read the disk image");
    for sector in FIRST_WRITE_SECTOR..FIRST_WRITE_SECTOR + 4 {
        if written.contains(&sector) {
            assert!(
                has_pattern(&image, sector * SECTOR, SECTOR, PATTERN_SEED),
                "{context}: sector {sector} of {} lacks the guest's pattern",
                image_path.display()
            );
        } else {
            assert!(
                is_zero(&image, sector),
                "{context}: sector {sector} of {} was written, expected only {written:?}",
                image_path.display()
            );
        }
    }
}

/// The lines of `stdout` after the first one that contains `marker` (panics without one).
fn after<'a>(stdout: &'a str, marker: &str) -> &'a str {
    let at = stdout
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in the output:\n{stdout}"));
    &stdout[at..]
}

/// `gpuvm restore --snapshot SNAP --restore-mode MODE...` (`mode` and any further flags):
/// once the guest printed `marker`, has `payload` echoed over vsock, then waits for the
/// end, which must be status 0.
fn restore_and_echo(
    snap: &Path,
    mode: &[&str],
    marker: &str,
    uds: &Path,
    payload: &[u8],
) -> RunOutput {
    let mut args = vec!["restore", "--snapshot", arg(snap), "--restore-mode"];
    args.extend_from_slice(mode);
    let mut vm = SpawnedProcess::gpuvm(&args);
    vm.wait_for_stdout(marker, LIMIT);
    vsock_echo(uds, payload);
    let out = vm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "restore {mode:?}: {}", out.describe());
    out
}

/// The drive, entropy device and vsock flags of `gpuvm run`.
struct Devices {
    drive: String,
    vsock: String,
}

impl Devices {
    fn new(image: &Path, uds: &Path) -> Devices {
        Devices {
            drive: format!("id=root,path={}", arg(image)),
            vsock: format!("cid=3,uds={}", arg(uds)),
        }
    }

    fn args<'a>(&'a self, cmdline: &'a str) -> Vec<&'a str> {
        vec![
            "run",
            "--memory",
            "128M",
            "--cmdline",
            cmdline,
            "--drive",
            &self.drive,
            "--rng",
            "--vsock",
            &self.vsock,
        ]
    }
}

/// Runs `virtio-devices 2` with `image` (1 MiB, "GPUVMBLK"), serves connection 1, and
/// snapshots the idle guest into `snap` with `gpuvm snapshot --pid` and
/// `--snapshot-then exit`. Returns the run's output.
fn snapshot_after_connection_1(image: &Path, uds: &Path, snap: &Path) -> RunOutput {
    let devices = Devices::new(image, uds);
    let mut args = devices.args("virtio-devices 2");
    args.extend([
        "--snapshot-dir",
        arg(snap),
        "--snapshot-then",
        "exit",
        "--report-timing",
    ]);
    let mut vm = SpawnedProcess::gpuvm(&args);
    vm.wait_for_stdout("virtio-devices: listening", LIMIT);
    vsock_echo(uds, b"before the snapshot");
    // Connection 1 is over and its sector written: the guest waits for connection 2.
    vm.wait_for_stdout("virtio-devices: wrote sector 16\n", LIMIT);
    signal_snapshot(vm.pid());
    let out = vm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "snapshot run: {}", out.describe());
    assert!(
        out.stderr.contains("gpuvm: snapshot diff=false") && snap.join("state").exists(),
        "no full snapshot in {}: {}",
        snap.display(),
        out.describe()
    );
    assert_in_order(
        &out.stdout,
        &[
            &format!("virtio-devices: {}", blk_fields(MIB, BLK_MAGIC)),
            "virtio-devices: rng ok",
            "virtio-devices: connection 1 from cid 2",
            &format!(
                "virtio-devices: after connection 1: {}",
                blk_fields(MIB, BLK_MAGIC)
            ),
            "virtio-devices: rng ok",
            "virtio-devices: wrote sector 16",
        ],
        "before the snapshot",
    );
    assert!(
        !out.stdout.contains("connection 2") && !out.stdout.contains("virtio-devices: ok"),
        "the guest went on before the snapshot: {}",
        out.describe()
    );
    assert!(
        !uds.exists(),
        "the vsock socket file outlived the snapshotted run"
    );
    assert_sectors(image, &[16], "after the snapshotted run");
    out
}

#[test]
fn drive_entropy_and_vsock_survive_eager_and_lazy_restores() {
    let scratch = Scratch::new("virtio_snapshot", "restore");
    let image = blk_image(&scratch, MIB);
    let uds = scratch.path("v.sock");
    let snap = scratch.path("snap");
    snapshot_after_connection_1(&image, &uds, &snap);
    // The image as the snapshot left it: each restore starts from a copy of it, at the
    // path the snapshot names (a restore reopens the drive by its saved path).
    let image_at_snapshot = std::fs::read(&image).unwrap();

    for mode in ["eager", "lazy"] {
        std::fs::write(&image, &image_at_snapshot).unwrap();
        let dir = scratch.path(&format!("snap-{mode}"));
        copy_dir(&snap, &dir);
        // The device lost connection 1's socket: the guest hears of it before anything else.
        let out = restore_and_echo(
            &dir,
            &[mode, "--report-timing"],
            "virtio-devices: transport reset",
            &uds,
            format!("after the {mode} restore").as_bytes(),
        );
        let context = format!("{mode} restore");
        let mode_line = format!(
            "gpuvm: restore mode={}{}",
            mode[..1].to_uppercase(),
            &mode[1..]
        );
        out.assert_stderr_has(&mode_line);
        assert!(
            !out.stdout.contains("FAIL"),
            "{context}: {}",
            out.describe()
        );
        assert!(
            !out.stdout.contains("testguest: ready")
                && !out.stdout.contains("virtio-devices: listening")
                && !out.stdout.contains("after connection 1"),
            "{context}: the guest started over instead of resuming: {}",
            out.describe()
        );
        assert_in_order(
            &out.stdout,
            &[
                "virtio-devices: transport reset cid=3",
                "virtio-devices: connection 2 from cid 2",
                "virtio-devices: connection 2 shut down by peer",
                &format!(
                    "virtio-devices: after connection 2: {}",
                    blk_fields(MIB, BLK_MAGIC)
                ),
                "virtio-devices: rng ok",
                "virtio-devices: wrote sector 17",
                "virtio-devices: ok connections=2",
            ],
            &context,
        );
        assert!(
            !out.stdout.contains("dropped by the reset"),
            "{context}: no connection was open at the snapshot: {}",
            out.describe()
        );
        assert_sectors(&image, &[16, 17], &context);
        assert!(
            !uds.exists(),
            "{context}: the vsock socket file outlived the run"
        );
    }
}

#[test]
fn a_restore_whose_image_changed_size_is_refused() {
    let scratch = Scratch::new("virtio_snapshot", "resized");
    let image = blk_image(&scratch, MIB);
    let uds = scratch.path("v.sock");
    let snap = scratch.path("snap");
    snapshot_after_connection_1(&image, &uds, &snap);

    for (size, why) in [
        (2 * MIB, "grown"),
        (MIB / 2, "shrunk"),
        (MIB + SECTOR, "one sector more"),
    ] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .unwrap()
            .set_len(size)
            .unwrap();
        let before = std::fs::read(&image).unwrap();
        let dir = scratch.path(&format!("snap-{}", size));
        copy_dir(&snap, &dir);
        let out = SpawnedProcess::gpuvm(&[
            "restore",
            "--snapshot",
            arg(&dir),
            "--restore-mode",
            "eager",
        ])
        .wait(LIMIT);
        out.assert_code(125);
        out.assert_clean_error("the image changed since the snapshot");
        for part in [
            "virtio-blk root".to_string(),
            arg(&image).to_string(),
            format!("has {} sectors", size / SECTOR),
            format!("had {}", MIB / SECTOR),
        ] {
            assert!(
                out.stderr.contains(&part),
                "{why}: the error lacks {part:?}:\n{}",
                out.stderr
            );
        }
        assert!(
            out.stdout.is_empty(),
            "{why}: the guest ran although the restore was refused: {}",
            out.describe()
        );
        assert_eq!(
            std::fs::read(&image).unwrap(),
            before,
            "{why}: the refused restore changed the image"
        );
        assert!(
            !uds.exists(),
            "{why}: the vsock socket file was left behind"
        );
    }
}

/// One API request; returns its status and body.
fn api(socket: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let response = gpuvm_api::client::request(socket, method, path, Some(body))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (response.status, response.body)
}

/// An API request that must fail with `status` and a body that mentions `needle`.
fn api_refused(socket: &Path, status: u16, method: &str, path: &str, body: &str, needle: &str) {
    let (got, answer) = api(socket, method, path, body);
    assert_eq!(
        got, status,
        "{method} {path} {body} answered {got}, expected {status}: {answer}"
    );
    assert!(
        answer.contains(needle),
        "{method} {path} {body}: the answer lacks {needle:?}: {answer}"
    );
}

#[test]
fn api_configured_devices_and_a_drive_swapped_while_running() {
    let scratch = Scratch::new("virtio_snapshot", "api");
    let first = scratch.path("first.img");
    let second = scratch.path("second.img");
    disk_image(&first, BLK_MAGIC, MIB);
    disk_image(&second, b"SWAPPED2", 2 * MIB);
    let uds = scratch.path("v.sock");
    let socket = scratch.path("api.sock");
    let mut vm = SpawnedProcess::gpuvm(&["run", "--api-sock", arg(&socket)]);
    wait_for_api_socket(&mut vm, &socket);

    let drive = |path: &Path| format!(r#"{{"drive_id": "root", "path": "{}"}}"#, arg(path));
    let swap = |path: &str| format!(r#"{{"drive_id": "root", "path": "{path}"}}"#);
    api_expect(
        &socket,
        204,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 128}"#),
    );
    api_expect(
        &socket,
        204,
        "PUT",
        "/boot-source",
        Some(r#"{"boot_args": "virtio-devices 2"}"#),
    );
    // The id in the body must be the path's.
    api_refused(
        &socket,
        400,
        "PUT",
        "/drives/other",
        &drive(&first),
        "drive_id",
    );
    api_expect(&socket, 204, "PUT", "/drives/root", Some(&drive(&first)));
    api_expect(&socket, 204, "PUT", "/entropy", Some("{}"));
    let vsock = format!(r#"{{"guest_cid": 3, "uds_path": "{}"}}"#, arg(&uds));
    api_expect(&socket, 204, "PUT", "/vsock", Some(&vsock));
    // Before start a drive is changed with PUT, not PATCH.
    api_refused(
        &socket,
        409,
        "PATCH",
        "/drives/root",
        &swap(arg(&second)),
        "PUT",
    );
    assert!(
        !vm.stdout().contains("testguest"),
        "the guest ran before start"
    );
    api_start_instance(&socket);
    vm.wait_for_stdout("virtio-devices: listening", LIMIT);

    // Wrong requests against the running VM change nothing (connection 1 still sees the
    // first image).
    api_refused(
        &socket,
        409,
        "PUT",
        "/drives/root",
        &drive(&second),
        "already been started",
    );
    api_refused(
        &socket,
        404,
        "PATCH",
        "/drives/data",
        &format!(r#"{{"drive_id": "data", "path": "{}"}}"#, arg(&second)),
        "data",
    );
    api_refused(
        &socket,
        400,
        "PATCH",
        "/drives/root",
        &swap("second.img"),
        "absolute",
    );
    api_refused(
        &socket,
        400,
        "PATCH",
        "/drives/other",
        &swap(arg(&second)),
        "drive_id",
    );
    let missing = scratch.path("missing.img");
    api_refused(
        &socket,
        400,
        "PATCH",
        "/drives/root",
        &swap(arg(&missing)),
        "no such file",
    );

    vsock_echo(&uds, b"connection 1");
    vm.wait_for_stdout("virtio-devices: wrote sector 16\n", LIMIT);
    let stdout = vm.stdout();
    assert_in_order(
        &stdout,
        &[
            &format!("virtio-devices: {}", blk_fields(MIB, BLK_MAGIC)),
            &format!(
                "virtio-devices: after connection 1: {}",
                blk_fields(MIB, BLK_MAGIC)
            ),
            "virtio-devices: rng ok",
            "virtio-devices: wrote sector 16",
        ],
        "before the swap",
    );
    assert!(
        !stdout.contains("connection 2"),
        "connection 2 before the swap:\n{stdout}"
    );

    // The guest waits for connection 2 with no request in flight: swap the image, then
    // connection 2 ends and the guest reads the drive again.
    api_expect(
        &socket,
        204,
        "PATCH",
        "/drives/root",
        Some(&swap(arg(&second))),
    );
    vsock_echo(&uds, b"connection 2");
    let out = vm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert_in_order(
        after(&out.stdout, "virtio-devices: wrote sector 16"),
        &[
            "virtio-devices: connection 2 from cid 2",
            &format!(
                "virtio-devices: after connection 2: {}",
                blk_fields(2 * MIB, b"SWAPPED2")
            ),
            "virtio-devices: rng ok",
            "virtio-devices: wrote sector 17",
            "virtio-devices: ok connections=2",
        ],
        "after the swap",
    );
    // Sector 16 went to the first image, sector 17 to the second.
    assert_sectors(&first, &[16], "the first image");
    assert_sectors(&second, &[17], "the swapped-in image");
    assert_eq!(std::fs::metadata(&first).unwrap().len(), MIB);
    assert_eq!(std::fs::metadata(&second).unwrap().len(), 2 * MIB);
}

/// A snapshot taken through the API after a hot-swap names the swapped-in image: the
/// restored drive is the second image (its size, its sector 0, its sectors written).
#[test]
fn a_snapshot_after_a_swap_restores_the_swapped_in_image() {
    let scratch = Scratch::new("virtio_snapshot", "swap-snap");
    let first = scratch.path("first.img");
    let second = scratch.path("second.img");
    disk_image(&first, BLK_MAGIC, MIB);
    disk_image(&second, b"SWAPPED2", 2 * MIB);
    let uds = scratch.path("v.sock");
    let socket = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let devices = Devices::new(&first, &uds);
    let mut args = devices.args("virtio-devices 2");
    args.extend(["--api-sock", arg(&socket), "--config-file"]);
    // --config-file starts the VM at once with the flags' devices.
    let config = scratch.path("config.json");
    std::fs::write(
        &config,
        r#"{"boot-source": {"boot_args": "virtio-devices 2"}}"#,
    )
    .unwrap();
    args.push(arg(&config));
    let mut vm = SpawnedProcess::gpuvm(&args);
    wait_for_api_socket(&mut vm, &socket);
    vm.wait_for_stdout("virtio-devices: listening", LIMIT);
    api_expect(
        &socket,
        204,
        "PATCH",
        "/drives/root",
        Some(&format!(
            r#"{{"drive_id": "root", "path": "{}"}}"#,
            arg(&second)
        )),
    );
    vsock_echo(&uds, b"connection 1");
    vm.wait_for_stdout("virtio-devices: wrote sector 16\n", LIMIT);
    assert!(
        vm.stdout().contains(&format!(
            "virtio-devices: after connection 1: {}",
            blk_fields(2 * MIB, b"SWAPPED2")
        )),
        "the swap did not reach the guest:\n{}",
        vm.stdout()
    );
    api_expect(
        &socket,
        200,
        "PUT",
        "/snapshot/create",
        Some(&format!(r#"{{"snapshot_path": "{}"}}"#, arg(&snap))),
    );
    vm.signal(libc::SIGKILL);
    let killed = vm.wait(LIMIT);
    assert!(
        !killed.stdout.contains("connection 2"),
        "{}",
        killed.describe()
    );
    assert_sectors(&first, &[], "the first image before the restore");
    assert_sectors(&second, &[16], "the second image before the restore");

    let out = restore_and_echo(
        &snap,
        &["eager"],
        "virtio-devices: transport reset",
        &uds,
        b"connection 2",
    );
    assert_in_order(
        &out.stdout,
        &[
            "virtio-devices: transport reset cid=3",
            &format!(
                "virtio-devices: after connection 2: {}",
                blk_fields(2 * MIB, b"SWAPPED2")
            ),
            "virtio-devices: wrote sector 17",
            "virtio-devices: ok connections=2",
        ],
        "restored after the swap",
    );
    assert_sectors(&first, &[], "the first image after the restore");
    assert_sectors(&second, &[16, 17], "the second image after the restore");
}

/// A vsock connection open when the snapshot is taken cannot be kept: the restored guest
/// hears of the transport reset, drops it without counting it, and serves a new one.
#[test]
fn a_connection_open_at_the_snapshot_is_dropped_by_the_transport_reset() {
    let scratch = Scratch::new("virtio_snapshot", "open-conn");
    let image = blk_image(&scratch, MIB);
    let uds = scratch.path("v.sock");
    let snap = scratch.path("snap");
    let devices = Devices::new(&image, &uds);
    let mut args = devices.args("virtio-devices 1");
    args.extend(["--snapshot-dir", arg(&snap), "--snapshot-then", "exit"]);
    let mut vm = SpawnedProcess::gpuvm(&args);
    vm.wait_for_stdout("virtio-devices: listening", LIMIT);

    // A connection that echoes once and stays open.
    let (mut open, mut reader) = vsock_connect(&uds);
    open.write_all(b"half").unwrap();
    let mut echo = [0u8; 4];
    reader.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"half");
    vm.wait_for_stdout("virtio-devices: connection 1 from cid 2", LIMIT);

    signal_snapshot(vm.pid());
    let out = vm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "snapshot run: {}", out.describe());
    assert!(
        !out.stdout.contains("after connection 1"),
        "connection 1 ended before the snapshot: {}",
        out.describe()
    );
    // The VMM that held the connection is gone: the host side ends too.
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{} bytes after the VMM exited", rest.len());

    let out = restore_and_echo(
        &snap,
        &["eager"],
        "virtio-devices: connection 1 dropped by the reset",
        &uds,
        b"a new connection 1",
    );
    assert_in_order(
        &out.stdout,
        &[
            "virtio-devices: transport reset cid=3",
            "virtio-devices: connection 1 dropped by the reset, echoed 4 bytes",
            "virtio-devices: connection 1 from cid 2",
            "virtio-devices: connection 1 shut down by peer, echoed 18 bytes",
            &format!(
                "virtio-devices: after connection 1: {}",
                blk_fields(MIB, BLK_MAGIC)
            ),
            "virtio-devices: rng ok",
            "virtio-devices: wrote sector 16",
            "virtio-devices: ok connections=1",
        ],
        "restored with a connection open at the snapshot",
    );
    assert_sectors(&image, &[16], "after the restored run");
}
