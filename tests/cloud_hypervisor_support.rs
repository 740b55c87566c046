//! Shared by the tests that run gpuvm as `cloud-hypervisor`: the symlink, the test guest
//! as a kernel file, and vm.info's state.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{api_expect, gpuvm_bin, Scratch, SpawnedProcess};

/// The embedded test guest written to `scratch/guest.elf` (`gpuvm guest-image`), for
/// `--kernel` and `payload.kernel`.
pub fn guest_image(scratch: &Scratch) -> PathBuf {
    let kernel = scratch.path("guest.elf");
    let written = Command::new(gpuvm_bin())
        .args(["guest-image", "--output", kernel.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(written.success(), "gpuvm guest-image failed");
    kernel
}

/// `cloud-hypervisor ARGS` through a symlink named so in `scratch`.
pub fn spawn_ch(scratch: &Scratch, args: &[&str]) -> SpawnedProcess {
    let link = scratch.path("cloud-hypervisor");
    if !link.exists() {
        std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    }
    SpawnedProcess::spawn(&link, args)
}

/// `GET /api/v1/vm.info`, parsed.
pub fn vm_info(api: &Path) -> serde_json::Value {
    serde_json::from_str(&api_expect(api, 200, "GET", "/api/v1/vm.info", None)).unwrap()
}

/// The VM's state as vm.info gives it (Created, Running, Paused).
pub fn vm_state(api: &Path) -> String {
    vm_info(api)["state"].as_str().unwrap().to_string()
}

/// Waits until vm.info answers: a VM created by the command line (`--kernel`,
/// `--restore`) exists only once the start-up requests are through, a moment after the
/// API socket is up.
pub fn wait_for_vm(process: &mut SpawnedProcess, api: &Path, limit: std::time::Duration) {
    process.wait_until("the VM", limit, |_| {
        gpuvm_api::client::request(api, "GET", "/api/v1/vm.info", None)
            .is_ok_and(|r| r.status == 200)
    });
}
