//! GPUs with big BARs in one VM (issue 27): the 64-bit PCI window is planned from the
//! devices' BARs and the host's physical address width, not fixed at 512 GiB. Emulated
//! GPUs (`gpuvm-emu-gpu --bar1-mib`, BAR1 a sparse memfd: only the pages the guest touches
//! are allocated) declare H200-like 256 GiB and H100-like 64 GiB BAR1s; the test guest's
//! `big-bars` workload checks every BAR's address and alignment against the `_CRS`
//! windows and writes and reads a word at the start and end of each BAR1 and BAR3.
//!
//! Each 256 GiB BAR1 is a KVM memory slot. On the CI hosts (nested, shadow-paging KVM)
//! registering one costs ~0.7-2 s and ~680 MiB of kernel memory (KVM's reverse maps for
//! 64 Mi pages; hardware hosts with TDP MMU do not allocate them), so the VMs here run
//! one at a time.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuvm_tests::{run_gpuvm, RunOutput, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(240);
const GIB: u64 = 1 << 30;

/// One VM with big BARs at a time (kernel memory for their memory slots, see above).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

/// Starts one emulated GPU per BAR1 size (GiB), runs `big-bars N` with all of them and
/// returns gpuvm's output once every device server has ended.
fn boot_with_gpus(name: &str, bar1_gib: &[u64]) -> RunOutput {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut sockets = Vec::new();
    let mut servers: Vec<SpawnedProcess> = Vec::new();
    for (i, gib) in bar1_gib.iter().enumerate() {
        let socket = gpuvm_tests::socket_path("big-bars", &format!("{name}-{i}"));
        let mib = (gib * 1024).to_string();
        servers.push(gpuvm_tests::start_emu_gpu(
            &emu_bin(),
            &socket,
            &["--bar1-mib", &mib],
        ));
        sockets.push(socket);
    }
    let cmdline = format!("big-bars {}", bar1_gib.len());
    let mut args = vec!["--log-level", "info", "run", "--cmdline", &cmdline];
    for socket in &sockets {
        args.extend(["--vfio-user", socket.to_str().unwrap()]);
    }
    let started = Instant::now();
    let out = run_gpuvm(&args, LIMIT);
    eprintln!(
        "{name}: {} GPU(s) with BAR1s of {bar1_gib:?} GiB: gpuvm ran {:?}",
        bar1_gib.len(),
        started.elapsed()
    );
    for server in servers {
        let done = server.wait(Duration::from_secs(30));
        assert_eq!(done.code(), Some(0), "{}", done.stderr);
    }
    out
}

/// `0xSTART..0xEND` after `prefix` in a line of `text`.
fn window_after(text: &str, prefix: &str) -> (u64, u64) {
    let line = text
        .lines()
        .find_map(|l| l.split_once(prefix).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no '{prefix}' in:\n{text}"));
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    let range = line.split_whitespace().next().unwrap();
    let (start, end) = range.split_once("..").unwrap();
    (hex(start), hex(end))
}

/// The GPUs' BAR1s (address, size) as the guest found them, in slot order.
fn bar1s(stdout: &str) -> Vec<(u64, u64)> {
    let hex = |s: &str| {
        u64::from_str_radix(s.trim_start_matches("0x").trim_start_matches("size=0x"), 16).unwrap()
    };
    stdout
        .lines()
        .filter(|l| l.starts_with("big-bars: 00:") && l.contains(" BAR1 "))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            (hex(words[3]), hex(words[4]))
        })
        .collect()
}

/// The run passed, the guest's `_CRS` window is the one gpuvm planned and logged, every
/// BAR1 has the size its device declared, and the window has room for one more device of
/// the largest kind.
fn check(out: &RunOutput, bar1_gib: &[u64]) {
    out.assert_code(0)
        .assert_stdout_has(&format!("big-bars: ok {}", bar1_gib.len()))
        .assert_stderr_has("kept for hot-plug");
    let planned = window_after(&out.stderr, "guest address space: 64-bit PCI window ");
    let guest = window_after(&out.stdout, "big-bars: window ");
    assert_eq!(guest, planned, "the _CRS window is the planned one");
    let bars = bar1s(&out.stdout);
    let sizes: Vec<u64> = bars.iter().map(|&(_, size)| size / GIB).collect();
    assert_eq!(sizes, bar1_gib, "{}", out.stdout);
    let largest = bar1_gib.iter().max().unwrap() * GIB;
    let top = bars.iter().map(|&(a, s)| a + s).max().unwrap();
    // Room for one more of the largest above the last BAR1, aligned to its size.
    assert!(
        top.next_multiple_of(largest) + largest <= planned.1,
        "{planned:x?} {bars:x?}"
    );
}

#[test]
fn two_gpus_with_256_gib_bar1s_boot() {
    // The fixed 512 GiB window refused the second one.
    let sizes = [256, 256];
    let out = boot_with_gpus("two", &sizes);
    check(&out, &sizes);
}

#[test]
fn eight_gpus_with_256_gib_bar1s_boot() {
    let sizes = [256; 8];
    let out = boot_with_gpus("eight", &sizes);
    check(&out, &sizes);
    // 8 x 256 GiB packed from the window's first 256 GiB boundary, the BAR3s below the
    // first where the window's start leaves a gap there: BAR1s at 256 GiB .. 2.25 TiB on
    // Intel hosts, where the window starts at 4 GiB. On AMD hosts it starts past the
    // HyperTransport hole at 1 TiB, a 256 GiB boundary: the first BAR3 follows the first
    // BAR1 and the other BAR1s start one slot later (the later BAR3s fill that gap).
    let top = bar1s(&out.stdout)
        .iter()
        .map(|&(a, s)| a + s)
        .max()
        .unwrap();
    let window = window_after(&out.stderr, "guest address space: 64-bit PCI window ");
    let first = window.0.next_multiple_of(256 * GIB);
    let no_gap_below = u64::from(first == window.0);
    assert_eq!(
        top,
        first + (8 + no_gap_below) * 256 * GIB,
        "{}",
        out.stdout
    );
    if window.0 == 4 * GIB {
        assert_eq!(top, 2304 * GIB, "{}", out.stdout);
    }
}

/// Kata's default GPU path (`hot_plug_vfio`): the VM is created with no passthrough
/// device, through Cloud Hypervisor's API, and GPUs come after boot by
/// vm.add-user-device. Its 64-bit window was planned before any GPU was known, so it
/// must hold big ones anyway: two with 256 GiB BAR1s are hot-plugged and the guest checks
/// both (addresses, alignment, `_CRS`, a word at each BAR's start and end). The window
/// used to be 512 GiB, which held one.
#[test]
fn two_gpus_with_256_gib_bar1s_hot_plug_into_a_vm_created_without_devices() {
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = gpuvm_tests::Scratch::new("big-bars", "hotplug");
    let kernel = guest_image(&scratch);
    let api = scratch.path("api.sock");
    let mut vmm = spawn_ch(&scratch, &["-v", "--api-socket", api.to_str().unwrap()]);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": { "kernel": kernel, "cmdline": "big-bars 2 hotplug" },
        "cpus": { "boot_vcpus": 1, "max_vcpus": 1 },
        "memory": { "size": 268435456u64 },
        "serial": { "mode": "Tty" },
        "console": { "mode": "Off" },
    })
    .to_string();
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    gpuvm_tests::api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vmm.wait_for_stdout("big-bars: waiting for 2 hot-plugged device(s)", LIMIT);
    let mut servers = Vec::new();
    for i in 0..2 {
        let socket = scratch.path(&format!("gpu{i}.sock"));
        servers.push(gpuvm_tests::start_emu_gpu(
            &emu_bin(),
            &socket,
            &["--bar1-mib", "262144"],
        ));
        let body = serde_json::json!({ "socket": socket, "id": format!("gpu{i}") }).to_string();
        gpuvm_tests::api_expect(&api, 200, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    }
    vmm.wait_for_stdout("big-bars: ok 2", LIMIT);
    let stdout = vmm.stdout();
    assert!(!stdout.contains("FAIL"), "{stdout}");
    let bars = bar1s(&stdout);
    assert_eq!(
        bars.iter().map(|&(_, size)| size / GIB).collect::<Vec<_>>(),
        [256, 256],
        "{stdout}"
    );
    let guest = window_after(&stdout, "big-bars: window ");
    let planned = window_after(&vmm.stderr(), "guest address space: 64-bit PCI window ");
    assert_eq!(guest, planned, "the _CRS window is the planned one");
    // Room for six more of them after the two (eight in all).
    let top = bars.iter().map(|&(a, s)| a + s).max().unwrap();
    assert!(top + 6 * 256 * GIB <= guest.1, "{guest:x?} {bars:x?}");
    // The workload ends the guest (status 0) after its checks, and gpuvm with it; a
    // shutdown sent meanwhile may find the VMM already stopping.
    let _ = gpuvm_api::client::request(&api, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    for server in servers {
        server.wait(Duration::from_secs(30));
    }
}

#[test]
fn eight_gpus_with_64_and_256_gib_bar1s_boot() {
    let sizes = [64, 256, 64, 256, 64, 256, 64, 256];
    let out = boot_with_gpus("mixed", &sizes);
    check(&out, &sizes);
}

/// More than the host's address width holds (8 x 32 TiB BAR1s: 256 TiB of BARs alone) is
/// refused before the guest runs, with the numbers; the device servers see the
/// disconnect and end.
#[test]
fn a_vm_wider_than_the_host_is_refused_with_the_numbers() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut sockets = Vec::new();
    let mut servers = Vec::new();
    for i in 0..8 {
        let socket = gpuvm_tests::socket_path("big-bars", &format!("wide-{i}"));
        servers.push(gpuvm_tests::start_emu_gpu(
            &emu_bin(),
            &socket,
            &["--bar1-mib", "33554432"],
        ));
        sockets.push(socket);
    }
    let mut args = vec!["run", "--cmdline", "big-bars 8"];
    for socket in &sockets {
        args.extend(["--vfio-user", socket.to_str().unwrap()]);
    }
    let out = run_gpuvm(&args, LIMIT);
    out.assert_clean_error("the VM needs a 64-bit PCI MMIO window of")
        .assert_stderr_has("8 passthrough device(s) with 262144.25 GiB of 64-bit BARs")
        .assert_stderr_has("-bit physical address space (");
    assert!(!out.stdout.contains("testguest: ready"), "{}", out.stdout);
    for server in servers {
        server.wait(Duration::from_secs(30));
    }
}

/// A restored VM gets its 64-bit window back where its guest's ACPI tables have it (the
/// snapshot's state records it), not where a VM without devices would have it: a VM
/// booted with a 2 TiB window (`--pci-mmio64-gib`), snapshotted, restores with it.
#[test]
fn a_restored_vm_keeps_its_window() {
    use gpuvm_tests::snapshot_support::signal_snapshot;
    let scratch = gpuvm_tests::Scratch::new("big-bars", "restore");
    let dir = scratch.path("snap");
    let dir_arg = dir.to_str().unwrap();
    let mut run = SpawnedProcess::gpuvm(&[
        "--log-level",
        "info",
        "run",
        "--memory",
        "128M",
        "--cmdline",
        "memloop 32M 1 150",
        "--pci-mmio64-gib",
        "2048",
        "--snapshot-dir",
        dir_arg,
        "--snapshot-then",
        "exit",
    ]);
    run.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    signal_snapshot(run.pid());
    let booted = run.wait(LIMIT);
    booted.assert_code(0);
    let window = window_after(&booted.stderr, "guest address space: 64-bit PCI window ");
    assert_eq!(window.1 - window.0, 2048 * GIB, "{}", booted.stderr);
    let restored =
        SpawnedProcess::gpuvm(&["--log-level", "info", "restore", "--snapshot", dir_arg])
            .wait(LIMIT);
    gpuvm_tests::assert_memloop_resumed_and_done(&restored);
    assert_eq!(
        window_after(&restored.stderr, "guest address space: 64-bit PCI window "),
        window,
        "{}",
        restored.stderr
    );
}

/// `gpuvm check-host` reports the guest address width this host gives and whether eight
/// H200-class GPUs (none given) would fit it.
#[test]
fn check_host_reports_the_address_width_and_an_8_gpu_fit() {
    let out = run_gpuvm(&["check-host", "--memory-mib", "1024"], LIMIT);
    out.assert_stdout_has("ok    address width: ")
        .assert_stdout_has("-bit guest physical addresses (")
        .assert_stdout_has("8 GPUs: 8 x the BARs of an H200 (256 GiB BAR1)");
}
