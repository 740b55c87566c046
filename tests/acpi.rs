//! ACPI tables end to end: the test guest's `acpi` workload finds the RSDP (PVH start info
//! and the 0xE0000 scan), checks every checksum it can reach, counts the MADT's local APICs
//! against the MP table, and reads PCI configuration space through the ECAM window the MCFG
//! names, comparing it with configuration mechanism #1.

use std::path::PathBuf;
use std::time::Duration;

use gpuvm_tests::{run_gpuvm, start_emu_gpu};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn acpi_passes(vcpus: &str) {
    let out = run_gpuvm(&["run", "--vcpus", vcpus, "--cmdline", "acpi"], LIMIT);
    out.assert_code(0)
        .assert_stdout_has("acpi: RSDP at 0xe0000 (start info), scan agrees")
        .assert_stdout_has("acpi: RSDP revision 2 checksums ok")
        .assert_stdout_has("acpi: XSDT checksum ok, 3 tables")
        .assert_stdout_has("acpi: FACP -> DSDT at")
        .assert_stdout_has("reset port 0x64 value 0xfe")
        .assert_stdout_has(&format!(
            "acpi: MADT {vcpus} local APICs (MP table: {vcpus} cpus), 1 IOAPIC"
        ))
        .assert_stdout_has("acpi: MCFG ECAM 0xe0000000 segment 0 buses 0-0")
        // The host bridge (1b36:0008) answers the same through ECAM and 0xCF8.
        .assert_stdout_has("acpi: 00:00.0 id 0x00081b36 through ECAM and 0xcf8")
        .assert_stdout_has("acpi: ok");
    for table in ["FACP", "APIC", "MCFG"] {
        out.assert_stdout_has(&format!("acpi: {table} at 0x"));
    }
}

#[test]
fn acpi_tables_check_out_with_1_vcpu() {
    acpi_passes("1");
}

#[test]
fn acpi_tables_check_out_with_2_vcpus() {
    acpi_passes("2");
}

#[test]
fn ecam_reaches_an_attached_gpu() {
    let socket = gpuvm_tests::socket_path("acpi", "gpu");
    let emu = start_emu_gpu(&emu_bin(), &socket, &[]);
    let out = run_gpuvm(
        &[
            "run",
            "--cmdline",
            "acpi",
            "--vfio-user",
            socket.to_str().unwrap(),
        ],
        LIMIT,
    );
    out.assert_code(0)
        .assert_stdout_has("acpi: 00:00.0 id 0x00081b36 through ECAM and 0xcf8")
        .assert_stdout_has("acpi: 00:01.0 id 0x233010de through ECAM and 0xcf8")
        .assert_stdout_has("acpi: ok");
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

/// A broken table must fail the run: the guest changes one byte of each table in turn (as
/// a VMM writing a bad table would) and has to name it.
#[test]
fn a_corrupted_table_is_detected() {
    for (table, failure) in [
        ("MCFG", "acpi: FAIL MCFG checksum"),
        ("APIC", "acpi: FAIL APIC checksum"),
        ("FACP", "acpi: FAIL FACP checksum"),
        ("DSDT", "acpi: FAIL DSDT checksum"),
        ("XSDT", "acpi: FAIL XSDT checksum"),
        ("RSDP", "acpi: FAIL RSDP checksum"),
    ] {
        let cmdline = format!("acpi corrupt {table}");
        let out = run_gpuvm(&["run", "--cmdline", &cmdline], LIMIT);
        out.assert_code(1)
            .assert_stdout_has(&format!("acpi: corrupted {table} at 0x"))
            .assert_stdout_has(failure);
        assert!(!out.stdout.contains("acpi: ok"), "{}", out.stdout);
    }
}
