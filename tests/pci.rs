//! PCI passthrough end to end without hardware: the emulated NVIDIA-like GPU
//! (`gpuvm-emu-gpu`, vfio-user server) attached with `--vfio-user`, driven by the test
//! guest's `pci` workload (enumeration, BAR sizing, BAR0 MMIO, MSI-X, DMA into guest RAM).

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{run_gpuvm, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn socket_path(name: &str) -> PathBuf {
    gpuvm_tests::socket_path("pci", name)
}

fn start_emu(socket: &Path, extra: &[&str]) -> SpawnedProcess {
    gpuvm_tests::start_emu_gpu(&emu_bin(), socket, extra)
}

#[test]
fn pci_workload_over_vfio_user() {
    let socket = socket_path("e2e");
    let emu = start_emu(&socket, &[]);
    let out = run_gpuvm(
        &[
            "run",
            "--cmdline",
            "pci",
            "--vfio-user",
            socket.to_str().unwrap(),
        ],
        LIMIT,
    );
    out.assert_code(0)
        .assert_stdout_has("pci: 00:00.0 vendor=0x1b36 device=0x0008 class=0x060000")
        .assert_stdout_has("pci: 00:01.0 vendor=0x10de device=0x2330 class=0x030200")
        .assert_stdout_has("size=0x1000000 flags=0x0")
        .assert_stdout_has("size=0x10000000 flags=0xc")
        .assert_stdout_has("size=0x2000000 flags=0xc")
        .assert_stdout_has("pci: BAR0 boot0=0x1a0000a1")
        .assert_stdout_has("pci: BAR0 mmio round trip ok")
        // BAR1 is mmapped into the guest as a KVM memory slot: 1024 guest accesses, none
        // of them through the socket.
        .assert_stdout_has("pci: BAR1 direct write/read ok")
        .assert_stdout_has("trapped accesses 0")
        .assert_stdout_has("pci: msi-x cap at 0x60, 4 vectors")
        .assert_stdout_has("pci: msi-x interrupt received on vector 0x40")
        .assert_stdout_has("pci: dma verified 65536 bytes")
        // MSI-X off: the same doorbell arrives as level-triggered INTx on slot 1's GSI,
        // acknowledged once, not re-fired after the VMM unmasks it at the EOI.
        .assert_stdout_has("pci: intx pin INTA line 17")
        .assert_stdout_has("pci: intx interrupt received on GSI 17 vector 0x41, dma verified")
        .assert_stdout_has("pci: ok");
    // The device server ends when gpuvm disconnects.
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

#[test]
fn two_devices_in_one_vm() {
    let first = socket_path("two-a");
    let second = socket_path("two-b");
    let emu_a = start_emu(&first, &[]);
    let emu_b = start_emu(&second, &[]);
    let out = run_gpuvm(
        &[
            "run",
            "--cmdline",
            "pci",
            "--vfio-user",
            first.to_str().unwrap(),
            "--vfio-user",
            second.to_str().unwrap(),
        ],
        LIMIT,
    );
    // The workload drives the last GPU it finds (00:02.0); both are enumerated.
    out.assert_code(0)
        .assert_stdout_has("pci: 00:01.0 vendor=0x10de device=0x2330")
        .assert_stdout_has("pci: 00:02.0 vendor=0x10de device=0x2330")
        .assert_stdout_has("pci: BAR0 0xc1000000 size=0x1000000")
        .assert_stdout_has("pci: ok");
    emu_a.wait(Duration::from_secs(10));
    emu_b.wait(Duration::from_secs(10));
}

#[test]
fn large_bar1_stays_64_bit_prefetchable_and_size_aligned() {
    let socket = socket_path("bar1");
    let emu = start_emu(&socket, &["--bar1-mib", "8192"]);
    let out = run_gpuvm(
        &[
            "run",
            "--cmdline",
            "pci",
            "--vfio-user",
            socket.to_str().unwrap(),
            "--memory",
            "256M",
        ],
        LIMIT,
    );
    out.assert_code(0)
        .assert_stdout_has("size=0x200000000 flags=0xc");
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("pci: BAR1 0x"))
        .expect("BAR1 line");
    let address = u64::from_str_radix(
        line.trim_start_matches("pci: BAR1 0x")
            .split(' ')
            .next()
            .unwrap(),
        16,
    )
    .unwrap();
    assert!(address >= 4 << 30, "64-bit BAR above 4 GiB: {line}");
    assert_eq!(address % (8 << 30), 0, "size-aligned: {line}");
    emu.wait(Duration::from_secs(10));
}

#[test]
fn pci_workload_without_a_device_fails_cleanly() {
    let out = run_gpuvm(&["run", "--cmdline", "pci"], LIMIT);
    out.assert_code(1)
        .assert_stdout_has("pci: FAIL no device 0x10de:0x2330 on bus 0");
}

#[test]
fn missing_vfio_user_socket_is_a_clean_error() {
    let socket = socket_path("absent");
    let out = run_gpuvm(
        &[
            "run",
            "--cmdline",
            "pci",
            "--vfio-user",
            socket.to_str().unwrap(),
        ],
        LIMIT,
    );
    out.assert_clean_error("vfio-user socket");
}

#[test]
fn gpu_flag_for_a_missing_device_is_a_clean_error() {
    if Path::new("/sys/bus/pci/devices/0000:41:00.0").exists() {
        return; // a real host with a device there: not this test's business
    }
    let out = run_gpuvm(&["run", "--gpu", "0000:41:00.0"], LIMIT);
    out.assert_clean_error("no PCI device 0000:41:00.0");
    let out = run_gpuvm(&["run", "--gpu", "not-a-bdf"], LIMIT);
    out.assert_clean_error("'not-a-bdf' is not a PCI address");
}

#[test]
fn check_host_reports_truthfully() {
    let out = run_gpuvm(
        &["check-host", "--gpu", "0000:41:00.0", "--memory-mib", "512"],
        LIMIT,
    );
    let iommu = Path::new("/sys/kernel/iommu_groups")
        .read_dir()
        .map(|d| d.count() > 0)
        .unwrap_or(false);
    let iommu_line = if iommu {
        "ok    iommu:"
    } else {
        "FAIL  iommu:"
    };
    out.assert_stdout_has(iommu_line)
        .assert_stdout_has("memlock:")
        .assert_stdout_has("hugepages-2M:");
    let device_present = Path::new("/sys/bus/pci/devices/0000:41:00.0").exists();
    if !device_present {
        out.assert_stdout_has("FAIL  gpu 0000:41:00.0: no PCI device 0000:41:00.0");
    }
    let failed = out.stdout.contains("\nFAIL") || out.stdout.starts_with("FAIL");
    assert_eq!(
        out.code(),
        Some(if failed { 1 } else { 0 }),
        "{}",
        out.stdout
    );
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

fn ctl(socket: &Path, args: &[&str]) -> gpuvm_tests::RunOutput {
    let mut all = vec!["ctl", "--api-sock", socket.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    run_gpuvm(&all, LIMIT)
}

/// A GPU attached through PUT /gpus/{id} (`gpuvm ctl add-gpu`), the guest's `pci`
/// workload passes, and a snapshot is refused with a clear message while the VM keeps
/// running: a passthrough device's state lives in the device.
#[test]
fn gpu_over_the_api_and_snapshot_refused() {
    let device = socket_path("api-dev");
    let emu = start_emu(&device, &[]);
    let api = std::env::temp_dir().join(format!("gpuvm-pci-api-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&api);
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", api.to_str().unwrap()]);
    vmm.wait_until("the API socket", LIMIT, |_| api.exists());
    let device_arg = device.to_str().unwrap();
    // Bad bodies first: the id in the path must match, and one backend only.
    ctl(
        &api,
        &[
            "raw",
            "PUT",
            "/gpus/a",
            r#"{"gpu_id":"b","host_bdf":"0000:41:00.0"}"#,
        ],
    )
    .assert_clean_error("does not match");
    ctl(
        &api,
        &["add-gpu", "--id", "emu0", "--vfio-user-socket", device_arg],
    )
    .assert_code(0);
    ctl(&api, &["set-boot-source", "--cmdline", "pci hold"]).assert_code(0);
    ctl(&api, &["start"]).assert_code(0);
    vmm.wait_for_stdout("pci: holding", LIMIT);
    assert!(vmm.stdout().contains("pci: intx interrupt received"));
    ctl(
        &api,
        &["add-gpu", "--id", "late", "--host-bdf", "0000:41:00.0"],
    )
    .assert_clean_error("already been started");

    let snapshot = std::env::temp_dir().join(format!("gpuvm-pci-snap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snapshot);
    ctl(
        &api,
        &["snapshot-create", "--dir", snapshot.to_str().unwrap()],
    )
    .assert_clean_error("cannot snapshot a VM with passthrough devices (00:01.0");
    assert!(
        !snapshot.exists(),
        "a refused snapshot leaves nothing behind"
    );
    let info = ctl(&api, &["info"]);
    info.assert_code(0)
        .assert_stdout_has(r#""state":"Running""#);

    ctl(&api, &["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

/// `--config-file` takes the same GPU bodies as PUT /gpus/{id}.
#[test]
fn gpu_from_a_config_file() {
    let device = socket_path("config-dev");
    let emu = start_emu(&device, &[]);
    let config = std::env::temp_dir().join(format!("gpuvm-pci-config-{}.json", std::process::id()));
    let body = serde_json::json!({
        "boot-source": {"boot_args": "pci"},
        "gpus": [{"gpu_id": "emu0", "vfio_user_socket": device}],
    });
    std::fs::write(&config, body.to_string()).unwrap();
    let out = run_gpuvm(&["run", "--config-file", config.to_str().unwrap()], LIMIT);
    out.assert_code(0)
        .assert_stdout_has("pci: 00:01.0 vendor=0x10de device=0x2330")
        .assert_stdout_has("pci: ok");
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);

    let twice = serde_json::json!({
        "gpus": [
            {"gpu_id": "a", "vfio_user_socket": "/x.sock"},
            {"gpu_id": "a", "host_bdf": "0000:41:00.0"},
        ],
    });
    std::fs::write(&config, twice.to_string()).unwrap();
    run_gpuvm(&["run", "--config-file", config.to_str().unwrap()], LIMIT)
        .assert_clean_error("appears twice");
    let _ = std::fs::remove_file(&config);
}

/// Snapshot flags are refused up front with passthrough devices.
#[test]
fn snapshot_flags_with_a_gpu_are_refused() {
    let snapshot = std::env::temp_dir().join("gpuvm-pci-never");
    run_gpuvm(
        &[
            "run",
            "--vfio-user",
            "/nonexistent.sock",
            "--snapshot-dir",
            snapshot.to_str().unwrap(),
        ],
        LIMIT,
    )
    .assert_clean_error("--snapshot-dir cannot be used with passthrough devices");
}
