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

/// Cloud Hypervisor's vm.create with `platform.num_pci_segments: 2`, a virtio disk with
/// `pci_segment: 1` and the entropy device on segment 0: the guest's `acpi` workload finds
/// two MCFG allocations, walks segment 1 through its own ECAM window and finds the disk
/// there (with segment 1's own host bridge), while 0xCF8 shows segment 0's device in that
/// slot. Bad segment numbers are refused with 400 naming the field, before anything is
/// created.
#[test]
fn a_disk_on_pci_segment_1_is_found_through_segment_1s_ecam() {
    use gpuvm_tests::{api_expect, gpuvm_bin, wait_for_api_socket, Scratch, SpawnedProcess};

    let scratch = Scratch::new("acpi", "segments");
    let kernel = scratch.path("guest.elf");
    let written = std::process::Command::new(gpuvm_bin())
        .args(["guest-image", "--output", kernel.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(written.success());
    let image = gpuvm_tests::virtio_support::blk_image(&scratch, 1 << 20);
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let api = scratch.path("api.sock");
    let mut vmm = SpawnedProcess::spawn(&link, &["--api-socket", api.to_str().unwrap(), "-v"]);
    wait_for_api_socket(&mut vmm, &api);
    let config = |segments: &str, disk_segment: &str| {
        format!(
            r#"{{"payload":{{"kernel":"{}","cmdline":"acpi"}},
                "cpus":{{"boot_vcpus":1,"max_vcpus":1}},
                "memory":{{"size":134217728}},
                "disks":[{{"path":"{}","pci_segment":{disk_segment}}}],
                "rng":{{"src":"/dev/urandom","pci_segment":0}},
                "serial":{{"mode":"Tty"}},"console":{{"mode":"Off"}},
                "platform":{{"num_pci_segments":{segments}}}}}"#,
            kernel.display(),
            image.display()
        )
    };
    for (segments, disk_segment, named) in [
        ("2", "5", "disks[0].pci_segment = 5"),
        ("2", "2", "disks[0].pci_segment = 2"),
        ("0", "0", "platform.num_pci_segments = 0"),
        ("17", "1", "platform.num_pci_segments = 17"),
    ] {
        let body = config(segments, disk_segment);
        let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some(&body));
        assert!(refused.contains(named), "{refused}");
        api_expect(&api, 404, "GET", "/api/v1/vm.info", None);
    }
    api_expect(
        &api,
        204,
        "PUT",
        "/api/v1/vm.create",
        Some(&config("2", "1")),
    );
    let info = api_expect(&api, 200, "GET", "/api/v1/vm.info", None);
    assert!(info.contains(r#""pci_segment":1"#), "{info}");
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("acpi: MCFG ECAM 0xe0000000 segment 0 buses 0-0")
        .assert_stdout_has("acpi: MCFG ECAM 0xe0100000 segment 1 buses 0-0")
        // Segment 0: its host bridge and the entropy device (virtio 1af4:1044).
        .assert_stdout_has("acpi: 00:00.0 id 0x00081b36 through ECAM and 0xcf8")
        .assert_stdout_has("acpi: 00:01.0 id 0x10441af4 through ECAM and 0xcf8")
        // Segment 1: its own host bridge and the disk (virtio 1af4:1042), which 0xCF8
        // does not reach: there it reads segment 0's devices.
        .assert_stdout_has(
            "acpi: 0001:00:00.0 id 0x00081b36 through ECAM only (0xcf8 00:00.0 reads 0x00081b36)",
        )
        .assert_stdout_has(
            "acpi: 0001:00:01.0 id 0x10421af4 through ECAM only (0xcf8 00:01.0 reads 0x10441af4)",
        )
        .assert_stdout_has("acpi: ok")
        .assert_stderr_has("at 0001:00:01.0");
    assert!(
        !out.stdout.contains("acpi: 00:02.0") && !out.stdout.contains("acpi: 0001:00:02.0"),
        "one device per segment: {}",
        out.stdout
    );
}

/// gpuvm's own configuration file: `pci-segments` puts the drive `d1` on segment 1 of 2
/// (the entropy device stays on segment 0); the guest finds it through segment 1's ECAM.
/// A device on a segment the VM does not have, 0 segments and 17 are refused before boot,
/// naming what is wrong.
#[test]
fn config_file_pci_segments_place_a_drive_and_bad_ones_are_refused() {
    use gpuvm_tests::Scratch;

    let scratch = Scratch::new("acpi", "segments_config_file");
    let image = gpuvm_tests::virtio_support::blk_image(&scratch, 1 << 20);
    let write_config = |name: &str, segments: &str| {
        let path = scratch.path(name);
        let body = format!(
            r#"{{"drives":[{{"drive_id":"d1","path":"{}"}}],"entropy":{{}},
                "pci-segments":{segments}}}"#,
            image.display()
        );
        std::fs::write(&path, body).unwrap();
        path
    };
    let good = write_config("good.json", r#"{"num_pci_segments":2,"devices":{"d1":1}}"#);
    let out = run_gpuvm(
        &[
            "run",
            "--cmdline",
            "acpi",
            "--config-file",
            good.to_str().unwrap(),
        ],
        LIMIT,
    );
    out.assert_code(0)
        .assert_stdout_has("acpi: MCFG ECAM 0xe0100000 segment 1 buses 0-0")
        .assert_stdout_has("acpi: 00:01.0 id 0x10441af4 through ECAM and 0xcf8")
        .assert_stdout_has(
            "acpi: 0001:00:01.0 id 0x10421af4 through ECAM only (0xcf8 00:01.0 reads 0x10441af4)",
        )
        .assert_stdout_has("acpi: ok");
    for (name, segments, named) in [
        (
            "missing.json",
            r#"{"num_pci_segments":2,"devices":{"d1":2}}"#,
            "pci_segment = 2 of device \"d1\"",
        ),
        (
            "default.json",
            r#"{"devices":{"d1":1}}"#,
            "the VM has 1 PCI segment(s)",
        ),
        (
            "zero.json",
            r#"{"num_pci_segments":0}"#,
            "num_pci_segments = 0",
        ),
        (
            "many.json",
            r#"{"num_pci_segments":17}"#,
            "num_pci_segments = 17",
        ),
        (
            "unknown.json",
            r#"{"num_pci_segments":2,"devices":{"nope":1}}"#,
            "\"nope\", which is not configured",
        ),
    ] {
        let path = write_config(name, segments);
        let out = run_gpuvm(
            &[
                "run",
                "--cmdline",
                "acpi",
                "--config-file",
                path.to_str().unwrap(),
            ],
            LIMIT,
        );
        assert_ne!(out.code(), Some(0), "{name}: {}", out.describe());
        assert!(out.stderr.contains(named), "{name}: {}", out.describe());
        assert!(!out.stdout.contains("acpi:"), "{name}: the guest ran");
    }
}

/// `poweroff` the way Linux's hardware-reduced ACPI does it: the guest finds the FADT's
/// sleep control register and `\_S5_`, clears WAK_STS and writes `5 << 2 | SLP_EN`; gpuvm
/// ends the run there, with status 0, under its seccomp filters (on by default). The
/// guest never reaches its exit port: it prints FAIL and exits 1 if the VM goes on.
#[test]
fn acpi_power_off_ends_the_run_with_status_0() {
    let out = run_gpuvm(
        &["--log-level", "info", "run", "--cmdline", "acpi poweroff"],
        LIMIT,
    );
    out.assert_code(0)
        .assert_stdout_has("acpi: FACP -> DSDT at")
        .assert_stdout_has("acpi: sleep control port 0x600 S5 type 5")
        .assert_stdout_has("acpi: sleep status port 0x600")
        .assert_stdout_has("acpi: entering S5: 0x34 to port 0x600")
        .assert_stderr_has("guest requested power-off through the ACPI sleep control register")
        .assert_stderr_has("guest powered off through the ACPI sleep control register")
        .assert_stderr_has("guest ended: PowerOff");
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(
        !out.stderr.contains("guest reported exit status"),
        "the guest ended through the exit port: {}",
        out.describe()
    );
    // WAK_STS, written first, is not a sleep request; the S5 request is.
    assert!(!out.stderr.contains("sleep type"), "{}", out.describe());
}

/// Firecracker has no ACPI power-off (its guests stop it with `reboot`), and gpuvm's
/// Firecracker mode keeps it that way: the FADT has no sleep registers and the DSDT no
/// `\_S5_`, so the guest finds nothing to write to and says so (status 3).
#[test]
fn firecracker_mode_offers_no_acpi_power_off() {
    use gpuvm_tests::{gpuvm_bin, Scratch, SpawnedProcess};

    let scratch = Scratch::new("acpi", "firecracker_poweroff");
    let kernel = scratch.path("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        LIMIT,
    )
    .assert_code(0);
    let config = scratch.path("vm.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"boot-source": {{"kernel_image_path": "{}", "boot_args": "acpi poweroff"}},
            "machine-config": {{"vcpu_count": 1, "mem_size_mib": 64, "smt": false}}}}"#,
            kernel.display()
        ),
    )
    .unwrap();
    let link = scratch.path("firecracker");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let out = SpawnedProcess::spawn(
        &link,
        &["--no-api", "--config-file", config.to_str().unwrap()],
    )
    .wait(LIMIT);
    out.assert_code(3)
        .assert_stdout_has("acpi: FACP -> DSDT at")
        .assert_stdout_has(
            "acpi: no ACPI power-off: sleep control register none, sleep status register none, \\_S5_ none",
        );
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
}
