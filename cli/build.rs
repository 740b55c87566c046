//! Link settings for the gpuvm binary.
//!
//! A release build puts the functions a boot runs next to each other (lld's
//! `--symbol-ordering-file` over `boot-text.order`, written by scripts/boot-text-order): the
//! kernel maps an executable's code 64 KiB around each page a process first touches, so the
//! few hundred KiB a boot runs, scattered over 5 MB of text, made most of the text resident.
//! Names the file lacks, or that a later change renamed, only fall back to the linker's order.
//! `GPUVM_LINK_MAP=PATH` also writes the link map there (what that script reads).

use std::path::Path;

fn main() {
    let order = Path::new(env!("CARGO_MANIFEST_DIR")).join("boot-text.order");
    println!("cargo:rerun-if-changed={}", order.display());
    println!("cargo:rerun-if-env-changed=GPUVM_LINK_MAP");
    let release = std::env::var("PROFILE").is_ok_and(|profile| profile == "release");
    if release && order.exists() {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        // The link argument names the file, not what it holds: a changed list must still
        // relink. An environment value of the crate's that follows the contents does.
        let contents = std::fs::read(&order).unwrap_or_default();
        let digest = contents
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
                (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
            });
        println!("cargo:rustc-env=GPUVM_BOOT_TEXT_ORDER_DIGEST={digest:016x}");
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
    if let Ok(map) = std::env::var("GPUVM_LINK_MAP") {
        println!("cargo:rustc-link-arg-bins=-Wl,-Map={map}");
        // The map names symbols as the ordering file must: mangled.
        println!("cargo:rustc-link-arg-bins=-Wl,--no-demangle");
    }
}
