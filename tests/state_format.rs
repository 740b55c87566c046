//! Snapshots written by earlier gpuvm builds still restore: each `fixtures/state-v<N>`
//! is a snapshot directory written by the build whose state format was version N (a
//! 2-vCPU memloop guest in 16 MiB, snapshotted mid-run). Restoring it must resume the
//! guest, which then checks every page it wrote before the snapshot.
//!
//! When the state format changes, the old fixtures stay as they are (the reader migrates
//! them) and a fixture of the new version is added beside them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{assert_memloop_resumed_and_done, Scratch, SpawnedProcess};

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
