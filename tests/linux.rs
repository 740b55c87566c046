//! Linux guests built from Debian's packages by guest-images/linux/build.sh.
//!
//! On hosts where guest ring 0 is emulated (see ENVIRONMENT.md) Linux only gets as far
//! as its early console in reasonable time, so the default tests stop at the kernel's
//! "Linux version" banner. The full boot to the initramfs' /init is for hosts with
//! hardware virtualization: `cargo test -p gpuvm-tests --test linux -- --ignored`.

use std::path::PathBuf;
use std::time::Duration;

use gpuvm_tests::{boot_until_marker, linux_guest_file, RunOutput};

/// Kernel arguments that get a stock kernel past what the nested emulator lacks.
const CMDLINE: &str = "console=ttyS0 earlyprintk=ttyS0 noxsave mitigations=off \
    clearcpuid=popcnt,smap,ssse3 cryptomgr.notests \
    initcall_blacklist=init_kprobe_trace,ftrace_check_for_weak_functions panic=-1";

fn image(name: &str) -> PathBuf {
    linux_guest_file(
        name,
        "build the Linux guest with guest-images/linux/build.sh (scripts/test.sh does)",
    )
}

fn boot_until(kernel: &str, marker: &str, limit: Duration) -> RunOutput {
    boot_with_until(kernel, &[], marker, limit)
}

/// Boots `kernel` with `extra` gpuvm flags until the console shows `marker`.
fn boot_with_until(kernel: &str, extra: &[&str], marker: &str, limit: Duration) -> RunOutput {
    let kernel = image(kernel);
    let initrd = image("initramfs.cpio");
    let mut args = vec![
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        initrd.to_str().unwrap(),
        "--memory",
        "256M",
        "--cmdline",
        CMDLINE,
    ];
    args.extend_from_slice(extra);
    boot_until_marker(&args, limit, marker)
}

#[test]
fn vmlinux_pvh_prints_linux_banner() {
    boot_until("vmlinux", "Linux version", Duration::from_secs(240));
}

/// Linux finds gpuvm's ACPI tables through the RSDP in the PVH start info: its early
/// console lists every table and then takes the CPUs and the IOAPIC from the MADT rather
/// than the MP table. Measured on the 2-core development host under load: banner at 20 s,
/// tables at 23 s, MADT at 30 s; 56 s with a second Linux guest booting beside it. The
/// kernel stops later anyway (about 50 s in, at a `lock cmpxchg16b` this host's KVM cannot
/// emulate, with or without ACPI). The limit leaves room for a much busier machine.
#[test]
fn vmlinux_pvh_reads_the_acpi_tables() {
    let out = boot_with_until(
        "vmlinux",
        &["--vcpus", "2"],
        "smpboot: Allowing",
        Duration::from_secs(480),
    );
    for line in [
        "ACPI: RSDP 0x00000000000E0000 000024 (v02 GPUVM )",
        "ACPI: XSDT 0x",
        "ACPI: FACP 0x",
        "ACPI: DSDT 0x",
        "ACPI: APIC 0x",
        "ACPI: MCFG 0x",
        "ACPI: LAPIC_NMI (acpi_id[0xff] dfl dfl lint[0x1])",
        "IOAPIC[0]: apic_id 2, version 17, address 0xfec00000, GSI 0-23",
        "ACPI: Using ACPI (MADT) for SMP configuration information",
        "smpboot: Allowing 2 CPUs, 0 hotplug CPUs",
    ] {
        assert!(
            out.stdout.contains(line),
            "no {line:?} from the kernel\n--- stdout\n{}\n--- stderr\n{}",
            out.stdout,
            out.stderr
        );
    }
    assert!(
        !out.stdout.contains("ACPI BIOS Error") && !out.stdout.contains("ACPI Error"),
        "{}",
        out.stdout
    );
}

/// Further in: the ACPI interpreter loads the DSDT, PCI0 becomes the root bridge with the
/// `_CRS` windows, the host bridge is found through the MCFG's ECAM window, and PnP finds
/// the ECAM reservation and COM1. Here that needs `--cpuid-mask cx16` (the emulator lacks
/// `lock cmpxchg16b`, which SLUB uses otherwise) and minutes of emulated ring 0 (measured on
/// the 2-core development host, 1 vCPU: 133 s, and 365 s under load), so it is opt-in:
/// `cargo test --release -p gpuvm-tests --test linux -- --ignored vmlinux_pvh_enumerates_pci_through_acpi`.
#[test]
#[ignore = "2 to 6 minutes of emulated guest ring 0 on CI hosts"]
fn vmlinux_pvh_enumerates_pci_through_acpi() {
    let out = boot_with_until(
        "vmlinux",
        &["--cpuid-mask", "cx16"],
        "pnp: PnP ACPI: found",
        Duration::from_secs(900),
    );
    for line in [
        "PCI: MMCONFIG for domain 0000 [bus 00-00] at [mem 0xe0000000-0xe00fffff] (base 0xe0000000)",
        "PCI: MMCONFIG at [mem 0xe0000000-0xe00fffff] reserved in E820",
        "ACPI: 1 ACPI AML tables successfully acquired and loaded",
        "ACPI: Interpreter enabled",
        "ACPI: PCI Root Bridge [PCI0] (domain 0000 [bus 00])",
        "pci_bus 0000:00: root bus resource [mem 0xc0000000-0xdfffffff window]",
        "pci_bus 0000:00: root bus resource [bus 00]",
        "pci 0000:00:00.0: [1b36:0008] type 00 class 0x060000",
        "PCI: Using ACPI for IRQ routing",
        "system 00:00: [mem 0xe0000000-0xe00fffff] has been reserved",
        "pnp: PnP ACPI: found 2 devices",
    ] {
        assert!(
            out.stdout.contains(line),
            "no {line:?} from the kernel\n--- stdout\n{}\n--- stderr\n{}",
            out.stdout,
            out.stderr
        );
    }
    // The 64-bit window starts above RAM (4 GiB for this 256 MiB guest), 4 TiB long
    // (room for eight hot-plugged GPUs with 256 GiB BAR1s).
    assert!(out
        .stdout
        .contains("pci_bus 0000:00: root bus resource [mem 0x100000000-0x400ffffffff window]"));
    assert!(!out.stdout.contains("ACPI Error") && !out.stdout.contains("ACPI BIOS Error"));
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
