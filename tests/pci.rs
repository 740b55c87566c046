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

fn ctl(api: &Path, args: &[&str]) -> gpuvm_tests::RunOutput {
    gpuvm_tests::gpuvm_ctl(api, args, LIMIT)
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
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
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
    // After start, PUT /gpus hot-plugs: this host has no VFIO, so a clean refusal.
    ctl(
        &api,
        &["add-gpu", "--id", "late", "--host-bdf", "0000:41:00.0"],
    )
    .assert_clean_error("cannot hot-plug late");
    ctl(&api, &["remove-gpu", "--id", "emu0"]).assert_clean_error("attached at start");

    let snapshot = std::env::temp_dir().join(format!("gpuvm-pci-snap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snapshot);
    ctl(
        &api,
        &["snapshot-create", "--dir", snapshot.to_str().unwrap()],
    )
    .assert_clean_error("cannot snapshot a VM with cold-plugged passthrough devices (00:01.0");
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

/// One VM from a config file with the emulated GPU and the `pci hold` workload, its API
/// on a socket, `env` set; returns the process, the API socket and the device server.
fn start_gpu_vm(name: &str, env: &[(&str, &str)]) -> (SpawnedProcess, PathBuf, SpawnedProcess) {
    let device = socket_path(&format!("{name}-dev"));
    let emu = start_emu(&device, &[]);
    let api = socket_path(&format!("{name}-api"));
    let config = std::env::temp_dir().join(format!("gpuvm-pci-{name}-{}.json", std::process::id()));
    let body = serde_json::json!({
        "boot-source": {"boot_args": "pci hold"},
        "gpus": [{"gpu_id": "emu0", "vfio_user_socket": device}],
    });
    std::fs::write(&config, body.to_string()).unwrap();
    let mut env = env.to_vec();
    env.push(("GPUVM_LOG", "info"));
    let vmm = SpawnedProcess::gpuvm_with_env(
        &[
            "run",
            "--config-file",
            config.to_str().unwrap(),
            "--api-sock",
            api.to_str().unwrap(),
        ],
        &env,
    );
    (vmm, api, emu)
}

/// Polls until stdout has `needle`; returns when it appeared, measured from `started`.
fn time_to(vmm: &mut SpawnedProcess, started: std::time::Instant, needle: &str) -> Duration {
    vmm.wait_until(needle, LIMIT, |p| p.stdout().contains(needle));
    started.elapsed()
}

fn dma_metrics(api: &Path) -> serde_json::Value {
    let out = ctl(api, &["metrics"]);
    out.assert_code(0);
    let json: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| {
        panic!("metrics are not JSON ({e}): {}", out.stdout);
    });
    json["dma_mapping"].clone()
}

/// Boot while pinning: with every DMA mapping held back 2 s (test hook), the guest is
/// `ready` about as fast as without the delay; its Bus Master write waits for the map, so
/// the `pci` workload's DMA (whose data the guest checks) happens only after it; the API
/// and the log show the mapping's progress and completion.
#[test]
fn the_guest_boots_while_guest_ram_is_dma_mapped() {
    const DELAY: Duration = Duration::from_secs(2);
    let run = |name: &str, env: &[(&str, &str)]| {
        let started = std::time::Instant::now();
        let (mut vmm, api, emu) = start_gpu_vm(name, env);
        let ready = time_to(&mut vmm, started, "testguest: ready");
        let early = if env.is_empty() {
            None
        } else {
            let metrics = dma_metrics(&api);
            Some((started.elapsed(), metrics))
        };
        let bus_master = time_to(&mut vmm, started, "pci: bus master on");
        time_to(&mut vmm, started, "pci: holding");
        let late = dma_metrics(&api);
        ctl(&api, &["ctrl-alt-del"]).assert_code(0);
        let out = vmm.wait(LIMIT);
        out.assert_code(0)
            .assert_stdout_has("pci: dma verified 65536 bytes")
            .assert_stdout_has("pci: ok");
        let emu_out = emu.wait(Duration::from_secs(10));
        assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
        (ready, bus_master, early, late, out)
    };
    let (ready_plain, bus_master_plain, _, plain, _) = run("boot-plain", &[]);
    let (ready, bus_master, early, late, out) =
        run("boot-delay", &[("GPUVM_TEST_DMA_MAP_DELAY_MS", "2000")]);
    eprintln!(
        "ready without delay {ready_plain:?}, with a 2 s mapper delay {ready:?}; Bus Master on after {bus_master_plain:?} / {bus_master:?}"
    );
    assert!(plain["done"] == true, "{plain}");
    // Ready well before the mapping could have finished, and about as fast as without it.
    assert!(
        ready < DELAY,
        "ready after {ready:?} with a {DELAY:?} mapper delay"
    );
    assert!(
        ready <= ready_plain * 2 + Duration::from_millis(500),
        "ready after {ready:?} with the delay, {ready_plain:?} without"
    );
    // The guest's Bus Master write (before any DMA) went through only after the map.
    assert!(bus_master >= DELAY, "Bus Master on after {bus_master:?}");
    // The API: not done while the delay runs (if we asked in time), done after it.
    let (asked_at, early) = early.expect("asked early");
    assert_eq!(early["total_bytes"], late["total_bytes"], "{early}");
    if asked_at < DELAY - Duration::from_millis(200) {
        assert!(early["done"] == false, "{early} at {asked_at:?}");
        assert_eq!(early["mapped_bytes"], 0, "{early}");
    }
    assert!(late["done"] == true, "{late}");
    assert!(late["error"].is_null(), "{late}");
    assert_eq!(late["mapped_bytes"], late["total_bytes"], "{late}");
    assert!(late["total_bytes"].as_u64().unwrap() >= 128 << 20, "{late}");
    let each = &late["mappings"][0];
    assert!(each["elapsed_ms"].as_u64().unwrap() >= 2000, "{late}");
    assert_eq!(each["parallel"], 1, "vfio-user maps one chunk at a time");
    assert_eq!(each["bus_master_refused"], 0);
    // The log: start, the held Bus Master write, done with a rate.
    out.assert_stderr_has("GPUVM_TEST_DMA_MAP_DELAY_MS: each DMA mapping starts 2000 ms late")
        .assert_stderr_has("DMA map vfio-user:")
        .assert_stderr_has("holding its vCPU until the map is complete")
        .assert_stderr_has("Bus Master goes through after");
    assert!(
        out.stderr.lines().any(|l| l.contains("DMA map vfio-user:")
            && l.contains(": done, ")
            && l.contains("MiB/s")),
        "{}",
        out.stderr
    );
}

/// A mapping that fails does not hang the guest: its Bus Master write is refused (reads
/// back clear), the `pci` workload fails cleanly with exit status 1, and the log says why.
#[test]
fn a_failed_dma_map_refuses_bus_master() {
    let socket = socket_path("map-fail");
    let emu = start_emu(&socket, &[]);
    let out = gpuvm_tests::run_gpuvm_with_env(
        &[
            "run",
            "--cmdline",
            "pci",
            "--vfio-user",
            socket.to_str().unwrap(),
        ],
        &[
            ("GPUVM_TEST_DMA_MAP_FAIL", "1"),
            ("GPUVM_TEST_DMA_MAP_DELAY_MS", "300"),
            ("GPUVM_LOG", "info"),
        ],
        LIMIT,
        None,
    );
    out.assert_code(1)
        .assert_stdout_has("pci: FAIL bus master refused (command 0x0002)")
        .assert_stderr_has("injected failure (GPUVM_TEST_DMA_MAP_FAIL)")
        .assert_stderr_has("Bus Master refused: guest RAM is not DMA-mapped");
    assert!(!out.stdout.contains("pci: dma verified"), "{}", out.stdout);
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}
