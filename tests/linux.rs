//! Linux guests built from Debian's packages by guest-images/linux/build.sh.
//!
//! On hosts where guest ring 0 is emulated (see ENVIRONMENT.md) Linux only gets as far
//! as its early console in reasonable time, so the default tests stop at the kernel's
//! "Linux version" banner. The full boot to the initramfs' /init is for hosts with
//! hardware virtualization: `cargo test -p gpuvm-tests --test linux -- --ignored`.

use std::path::PathBuf;
use std::time::Duration;

use gpuvm_tests::run_gpuvm_until;

/// Kernel arguments that get a stock kernel past what the nested emulator lacks.
const CMDLINE: &str = "console=ttyS0 earlyprintk=ttyS0 noxsave mitigations=off \
    clearcpuid=popcnt,smap,ssse3 cryptomgr.notests \
    initcall_blacklist=init_kprobe_trace,ftrace_check_for_weak_functions panic=-1";

fn image(name: &str) -> PathBuf {
    let dir = std::env::var_os("GPUVM_LINUX_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guest-images/linux/out")
        });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the Linux guest with guest-images/linux/build.sh (scripts/test.sh does) \
         or point GPUVM_LINUX_DIR at its output",
        path.display()
    );
    path
}

fn boot_until(kernel: &str, marker: &str, limit: Duration) {
    let kernel = image(kernel);
    let initrd = image("initramfs.cpio");
    let out = run_gpuvm_until(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--memory",
            "256M",
            "--cmdline",
            CMDLINE,
        ],
        limit,
        Some(marker),
    );
    assert!(
        out.stdout.contains(marker),
        "no {marker:?} from the kernel (exit {:?})\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    eprintln!("{marker:?} after {:?}", out.elapsed);
}

#[test]
fn vmlinux_pvh_prints_linux_banner() {
    boot_until("vmlinux", "Linux version", Duration::from_secs(240));
}

#[test]
#[ignore = "full boot needs hardware virtualization (guest ring 0 is emulated on CI hosts)"]
fn vmlinux_pvh_reaches_init() {
    boot_until(
        "vmlinux",
        "gpuvm-linux: init reached",
        Duration::from_secs(600),
    );
}

#[test]
#[ignore = "full boot needs hardware virtualization (guest ring 0 is emulated on CI hosts)"]
fn bzimage_reaches_init() {
    boot_until(
        "bzImage",
        "gpuvm-linux: init reached",
        Duration::from_secs(600),
    );
}
