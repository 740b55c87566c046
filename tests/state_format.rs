//! Snapshots written by earlier gpuvm builds still restore: each `fixtures/state-v<N>...`
//! is a snapshot directory written by the build whose state format was version N.
//!
//! - `state-v1`: a 2-vCPU memloop guest in 16 MiB, snapshotted mid-run. Restoring it must
//!   resume the guest, which then checks every page it wrote before the snapshot.
//! - `state-v1-virtio` (written by the last version-1 build) and `state-v2` (by the first
//!   version-2 build): the test guest's `virtio-devices 2` workload in 64 MiB (the least it
//!   runs in) with a drive, the entropy device and a vsock device, snapshotted after
//!   vsock connection 1 (see tests/virtio_snapshot.rs). Both limit the drive (bw=16 MiB/s)
//!   and the entropy device (bw=1 MiB/s), so their states carry rate limiters. They were
//!   made as a user would, in a directory holding the 64 KiB image `disk.img`:
//!   ```text
//!   gpuvm run --memory 64M --cmdline "virtio-devices 2" \
//!       --drive id=root,path=disk.img,bw=16777216 --rng bw=1048576 \
//!       --vsock cid=3,uds=v.sock --snapshot-dir snap --snapshot-then exit
//!   ```
//!   then one vsock echo, `gpuvm snapshot --pid`, and the image as the snapshot left it
//!   copied beside the state. The state names the image and the vsock socket by those
//!   relative paths, so a restore run from the fixture's directory finds the image and
//!   listens there; the guest resumes, serves connection 2, reads the drive and entropy
//!   again and writes sector 17.
//!
//! States written before the PCI root's allocations were saved (`pci_root`; all these
//! fixtures) rebuild them from each device's own saved place. None holds a client's record
//! of the configuration (`client_record`, optional: Cloud Hypervisor's vm.info shows a stub
//! configuration for such a restored VM).
//!
//! When the state format changes, the old fixtures stay as they are (the reader migrates
//! them) and a fixture of the new version is added beside them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::virtio_support::{assert_in_order, has_pattern, vsock_echo, SECTOR};
use gpuvm_tests::{assert_memloop_resumed_and_done, gpuvm_bin, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// A copy of fixture `name` in `scratch`: a restore must never change the fixture.
fn copy_fixture(scratch: &Scratch, name: &str) -> PathBuf {
    let from = fixture(name);
    let to = scratch.path(name);
    std::fs::create_dir(&to).expect("create the fixture copy");
    for entry in std::fs::read_dir(&from).expect("read the fixture directory") {
        let entry = entry.expect("fixture entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy a fixture file");
    }
    to
}

/// The version field of the state file in `dir` (bytes 8..12 of its header).
fn state_version(dir: &Path) -> u32 {
    let bytes = std::fs::read(dir.join("state")).expect("read the fixture's state");
    u32::from_le_bytes(bytes[8..12].try_into().expect("a state header"))
}

/// Restores fixture `name` eagerly: the guest resumes where it was snapshotted and ends
/// with every page verified.
fn assert_fixture_restores(name: &str, version: u32) {
    let scratch = Scratch::new("state-format", name);
    let dir = copy_fixture(&scratch, name);
    assert_eq!(
        state_version(&dir),
        version,
        "{name} is not a version {version} state"
    );
    let snapshot = dir.to_str().expect("UTF-8 path");
    let out =
        SpawnedProcess::gpuvm(&["restore", "--snapshot", snapshot, "--restore-mode", "eager"])
            .wait(LIMIT);
    assert_memloop_resumed_and_done(&out);
}

#[test]
fn a_version_1_state_restores() {
    assert_fixture_restores("state-v1", 1);
}

/// The workload's pattern seed (guest-images/testguest/src/virtio/devices.rs).
const PATTERN_SEED: u64 = 0xd5e7;

/// Restores the virtio fixture `name` eagerly from its own directory (the state names
/// `disk.img` and `v.sock` relative to it), serves vsock connection 2 and checks that the
/// guest went on with every device: the drive as it was (128 sectors, its magic), fresh
/// entropy, and sector 17 written beside the sector 16 of before the snapshot.
fn assert_virtio_fixture_restores(name: &str, version: u32) {
    let scratch = Scratch::new("state-format", name);
    let dir = copy_fixture(&scratch, name);
    assert_eq!(
        state_version(&dir),
        version,
        "{name} is not a version {version} state"
    );
    let image = dir.join("disk.img");
    let before = std::fs::read(&image).expect("read the fixture's image");
    assert!(
        has_pattern(&before, 16 * SECTOR, SECTOR, PATTERN_SEED)
            && before[(17 * SECTOR) as usize..(18 * SECTOR) as usize]
                .iter()
                .all(|&b| b == 0),
        "{name}: the image is not as the snapshot left it"
    );
    let bin = gpuvm_bin();
    let mut vm = SpawnedProcess::spawn(
        Path::new("/bin/sh"),
        &[
            "-c",
            r#"cd "$1" && exec "$2" restore --snapshot . --restore-mode eager"#,
            "sh",
            dir.to_str().expect("UTF-8 path"),
            bin.to_str().expect("UTF-8 path"),
        ],
    );
    vm.wait_for_stdout("virtio-devices: transport reset", LIMIT);
    vsock_echo(&dir.join("v.sock"), b"after the restore of an old state");
    let out = vm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{name}: {}", out.describe());
    assert_in_order(
        &out.stdout,
        &[
            "virtio-devices: transport reset cid=3",
            "virtio-devices: connection 2 from cid 2",
            "virtio-devices: after connection 2: blk capacity=128 sector0=475055564d424c4b",
            "virtio-devices: rng ok",
            "virtio-devices: wrote sector 17",
            "virtio-devices: ok connections=2",
        ],
        name,
    );
    assert!(
        !out.stdout.contains("connection 1 from"),
        "{name}: the guest started over instead of resuming: {}",
        out.describe()
    );
    let after = std::fs::read(&image).expect("read the restored image");
    for sector in [16, 17] {
        assert!(
            has_pattern(&after, sector * SECTOR, SECTOR, PATTERN_SEED),
            "{name}: sector {sector} lacks the guest's pattern after the restore"
        );
    }
}

#[test]
fn a_version_1_state_with_virtio_devices_restores() {
    assert_virtio_fixture_restores("state-v1-virtio", 1);
}

#[test]
fn a_version_2_state_restores() {
    // Written before the PCI root's allocations were saved: they are rebuilt from each
    // device's own place.
    let state = std::fs::read(fixture("state-v2").join("state")).expect("read the fixture");
    assert!(
        !String::from_utf8_lossy(&state).contains("\"pci_root\""),
        "state-v2 predates the saved PCI allocations"
    );
    // Nor does it hold a client's record (`client_record`, kept since issue 26): a state
    // without one restores as before.
    assert!(
        !String::from_utf8_lossy(&state).contains("\"client_record\""),
        "state-v2 predates the kept client record"
    );
    assert_virtio_fixture_restores("state-v2", 2);
}
