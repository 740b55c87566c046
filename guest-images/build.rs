//! Builds the freestanding test guest (`testguest/`, its own Cargo package outside the
//! workspace) with a nested `cargo build` and hands its ELF to `src/lib.rs`.
//!
//! The guest needs its own flags (static, non-PIE, own linker script, no start files), so the
//! nested build gets exactly those and none of the outer build's settings.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The only target installed; the guest uses its precompiled `core` (no -Zbuild-std).
const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";

/// Inherited variables that would change or break the nested build.
fn must_not_inherit(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_ENCODED_RUSTDOCFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_INCREMENTAL",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
    ];
    const PREFIXES: &[&str] = &[
        "CARGO_PROFILE_",
        "CARGO_CFG_",
        "CARGO_BUILD_",
        "CARGO_TARGET_",
    ];
    EXACT.contains(&name) || PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

fn guest_rustflags(linker_script: &Path) -> String {
    let flags = [
        "-C".to_string(),
        "relocation-model=static".to_string(),
        "-C".to_string(),
        "link-arg=-nostartfiles".to_string(),
        "-C".to_string(),
        "link-arg=-nostdlib".to_string(),
        "-C".to_string(),
        "link-arg=-static".to_string(),
        "-C".to_string(),
        "link-arg=-no-pie".to_string(),
        "-C".to_string(),
        format!("link-arg=-T{}", linker_script.display()),
    ];
    flags.join("\x1f")
}

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(env::var_os(name).unwrap_or_else(|| panic!("cargo did not set {name}")))
}

fn main() {
    let manifest_dir = env_path("CARGO_MANIFEST_DIR");
    let out_dir = env_path("OUT_DIR");
    let guest_dir = manifest_dir.join("testguest");
    let linker_script = guest_dir.join("linker.ld");
    let target_dir = out_dir.join("testguest-target");

    for input in ["src", "Cargo.toml", "Cargo.lock", "linker.ld"] {
        println!("cargo:rerun-if-changed={}", guest_dir.join(input).display());
    }

    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let mut command = Command::new(cargo);
    command
        .current_dir(&guest_dir)
        .arg("build")
        .arg("--release")
        .arg("--locked")
        .arg("--offline")
        .arg("--manifest-path")
        .arg(guest_dir.join("Cargo.toml"))
        .arg("--target")
        .arg(GUEST_TARGET)
        .arg("--target-dir")
        .arg(&target_dir);
    for (name, _) in env::vars_os() {
        if name.to_str().is_some_and(must_not_inherit) {
            command.env_remove(&name);
        }
    }
    command.env("CARGO_ENCODED_RUSTFLAGS", guest_rustflags(&linker_script));

    let output = command
        .output()
        .unwrap_or_else(|err| panic!("cannot run cargo to build the test guest: {err}"));
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stdout));
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        panic!(
            "building the test guest ({}) failed: {}",
            guest_dir.display(),
            output.status
        );
    }

    let built = target_dir
        .join(GUEST_TARGET)
        .join("release")
        .join("testguest");
    let elf = out_dir.join("testguest.elf");
    std::fs::copy(&built, &elf).unwrap_or_else(|err| {
        panic!(
            "cannot copy the test guest {} to {}: {err}",
            built.display(),
            elf.display()
        )
    });
    println!("cargo:rustc-env=GPUVM_TEST_GUEST_ELF={}", elf.display());
}
