//! gpuvm driven by a Firecracker client nobody here wrote: the PyPI package
//! `firecracker-python` (pinned, installed unmodified into a virtual environment), through
//! tests/clients/firecracker_python_driver.py. The driver starts gpuvm through a
//! `firecracker` symlink with the package's ProcessManager and drives it with the package's
//! Api and VMMManager: configuration, InstanceStart, pause/resume, snapshot create, then a
//! fresh process with snapshot load and resume, states read through the package's getters.
//!
//! The virtual environment lives in `target/fc-clients-venv` (or `$GPUVM_FC_CLIENTS_VENV`)
//! and is reused while it holds the pinned version. Where it cannot be made (no
//! python3-venv, no PyPI) the test fails saying so: CI has PyPI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use gpuvm_tests::virtio_support::blk_image;
use gpuvm_tests::{gpuvm_bin, run_gpuvm, Scratch, SpawnedProcess};

const PACKAGE: &str = "firecracker-python";
const PINNED_VERSION: &str = "0.0.5";
const LIMIT: Duration = Duration::from_secs(300);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// Whether `python` imports the package's API module at the pinned version.
fn has_pinned_package(python: &Path) -> bool {
    let probe = format!(
        "import importlib.metadata as m, firecracker.api; \
         assert m.version({PACKAGE:?}) == {PINNED_VERSION:?}"
    );
    python.exists()
        && Command::new(python)
            .args(["-c", &probe])
            .output()
            .is_ok_and(|out| out.status.success())
}

fn run_setup_step(program: &Path, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} (the test needs python3 with venv, Debian's python3-venv): {e}",
                program.display()
            )
        });
    assert!(
        out.status.success(),
        "{} {args:?} failed ({}), so the Firecracker client cannot be installed \
         (needs python3-venv and access to PyPI):\n{}{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The venv's python with `firecracker-python==0.0.5` and its pinned dependencies.
fn client_python() -> PathBuf {
    let venv = std::env::var_os("GPUVM_FC_CLIENTS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/fc-clients-venv"));
    let python = venv.join("bin/python");
    if has_pinned_package(&python) {
        return python;
    }
    let venv_arg = venv.to_str().expect("a UTF-8 venv path");
    run_setup_step(Path::new("python3"), &["-m", "venv", "--clear", venv_arg]);
    run_setup_step(
        &venv.join("bin/pip"),
        &[
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("{PACKAGE}=={PINNED_VERSION}"),
        ],
    );
    assert!(
        has_pinned_package(&python),
        "{PACKAGE}=={PINNED_VERSION} installed into {} but `import firecracker.api` fails",
        venv.display()
    );
    python
}

/// Kills the gpuvm processes the driver started and left behind (it kills them itself
/// unless it was killed): their pids are in `<work>/<vm id>/firecracker.pid`.
fn kill_leftovers(work: &Path) {
    let Ok(entries) = std::fs::read_dir(work) else {
        return;
    };
    for entry in entries.flatten() {
        let pid_file = entry.path().join("firecracker.pid");
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|text| text.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2) with a pid this test's driver started; no memory is touched.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

#[test]
fn firecracker_python_create_pause_snapshot_load_resume() {
    let python = client_python();
    let scratch = Scratch::new("fc-clients", "python");
    let link = scratch.path("firecracker");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let kernel = scratch.path("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        Duration::from_secs(60),
    )
    .assert_code(0);
    let disk = blk_image(&scratch, 1 << 20);
    let work = scratch.path("work");
    let driver = repo_root().join("tests/clients/firecracker_python_driver.py");

    let run = SpawnedProcess::spawn(
        &python,
        &[
            driver.to_str().unwrap(),
            "--firecracker",
            link.to_str().unwrap(),
            "--kernel",
            kernel.to_str().unwrap(),
            "--disk",
            disk.to_str().unwrap(),
            "--work",
            work.to_str().unwrap(),
        ],
    )
    .wait_timeout(LIMIT);
    kill_leftovers(&work);
    let out = run.unwrap_or_else(|| panic!("the firecracker-python driver ran past {LIMIT:?}"));
    println!("{}", out.stdout);
    assert_eq!(
        out.code(),
        Some(0),
        "the firecracker-python driver failed:\n{}",
        out.describe()
    );
    // The steps ran in order and each one's checks passed.
    gpuvm_tests::virtio_support::assert_in_order(
        &out.stdout,
        &[
            "step: get_vmm_state: Not started",
            "step: boot-source, drives/rootfs, machine-config, vsock: 204",
            "step: get_vmm_config echoes the bodies",
            "step: InstanceStart; get_vmm_state: Running; vsock echo",
            "step: update_vmm_state Paused / Resumed",
            "step: snapshot create",
            "step: ProcessManager.stop: SIGTERM ends gpuvm",
            "step: snapshot load",
            "step: restored guest: pause/resume, vsock echo, guest done, gpuvm ended",
            "firecracker-python: all steps passed",
        ],
        "firecracker-python driver",
    );
}
