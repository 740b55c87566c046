//! gpuvm as `firecracker` (a symlink to the binary), driven the way Firecracker's
//! getting-started guide and snapshot docs drive Firecracker: logger, metrics,
//! machine-config, boot-source, drives, vsock, InstanceStart, GET / Running, pause,
//! snapshot/create into a state file and a memory file, kill, then a new process loads
//! them (mem_backend File) and the guest goes on (a vsock echo after the restore). Plus
//! the issue's table rows and the refusals of what gpuvm does not support.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::virtio_support::{blk_image, vsock_echo};
use gpuvm_tests::{
    api_expect, firecracker_link, run_gpuvm, start_firecracker, wait_for_api_socket, Scratch,
    SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(60);

fn start(scratch: &Scratch, api: &Path, id: &str) -> SpawnedProcess {
    start_firecracker(scratch, api, id, &["--level", "Info"])
}

fn info(api: &Path) -> serde_json::Value {
    serde_json::from_str(&api_expect(api, 200, "GET", "/", None)).unwrap()
}

fn refused(api: &Path, method: &str, path: &str, body: Option<&str>, needle: &str) {
    let answer = api_expect(api, 400, method, path, body);
    assert!(answer.contains(needle), "{method} {path}: {answer}");
}

fn kernel(scratch: &Scratch) -> PathBuf {
    let path = scratch.path("vmlinux");
    let out = run_gpuvm(&["guest-image", "--output", path.to_str().unwrap()], LIMIT);
    out.assert_code(0);
    path
}

#[test]
fn getting_started_then_snapshot_and_load() {
    let scratch = Scratch::new("firecracker", "getting-started");
    let api = scratch.path("fc.sock");
    let mut vmm = start(&scratch, &api, "fc-vm-1");
    let kernel = kernel(&scratch);

    // GET / before start, /version.
    let before = info(&api);
    assert_eq!(before["id"], "fc-vm-1");
    assert_eq!(before["state"], "Not started");
    assert!(before["vmm_version"].is_string() && before["app_name"].is_string());
    let version = api_expect(&api, 200, "GET", "/version", None);
    assert!(version.contains("firecracker_version"), "{version}");

    // Logger into a file, metrics into a FIFO nobody reads (must not block).
    let log = scratch.path("fc.log");
    api_expect(
        &api,
        204,
        "PUT",
        "/logger",
        Some(&format!(
            r#"{{"log_path": "{}", "level": "Info", "show_level": true, "show_log_origin": false}}"#,
            log.display()
        )),
    );
    let fifo = scratch.path("metrics.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    api_expect(
        &api,
        204,
        "PUT",
        "/metrics",
        Some(&format!(r#"{{"metrics_path": "{}"}}"#, fifo.display())),
    );

    // machine-config with Firecracker's fields; PATCH; refusals name the field.
    api_expect(
        &api,
        204,
        "PUT",
        "/machine-config",
        Some(
            r#"{"vcpu_count": 1, "mem_size_mib": 64, "smt": false, "cpu_template": "None", "huge_pages": "None", "track_dirty_pages": false}"#,
        ),
    );
    refused(
        &api,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64, "smt": true}"#),
        "smt",
    );
    refused(
        &api,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64, "cpu_template": "T2"}"#),
        "T2",
    );
    refused(
        &api,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64, "nosuch": 1}"#),
        "nosuch",
    );
    api_expect(
        &api,
        204,
        "PATCH",
        "/machine-config",
        Some(r#"{"mem_size_mib": 128}"#),
    );
    let machine: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/machine-config", None)).unwrap();
    assert_eq!(machine["mem_size_mib"], 128);
    assert_eq!(machine["huge_pages"], "None");

    // boot-source: a relative path is resolved against gpuvm's working directory.
    let cwd = std::env::current_dir().unwrap();
    refused(
        &api,
        "PUT",
        "/boot-source",
        Some(r#"{"kernel_image_path": "no-such-vmlinux"}"#),
        &cwd.join("no-such-vmlinux").display().to_string(),
    );
    api_expect(
        &api,
        204,
        "PUT",
        "/boot-source",
        Some(&format!(
            r#"{{"kernel_image_path": "{}", "boot_args": "virtio-vsock 2"}}"#,
            kernel.display()
        )),
    );

    let image = blk_image(&scratch, 1 << 20);
    api_expect(
        &api,
        204,
        "PUT",
        "/drives/rootfs",
        Some(&format!(
            r#"{{"drive_id": "rootfs", "path_on_host": "{}", "is_root_device": true, "is_read_only": false, "cache_type": "Unsafe"}}"#,
            image.display()
        )),
    );
    refused(
        &api,
        "PUT",
        "/drives/other",
        Some(
            r#"{"drive_id": "other", "path_on_host": "/x", "is_root_device": false, "partuuid": "abc"}"#,
        ),
        "partuuid",
    );
    let uds = scratch.path("v.sock");
    api_expect(
        &api,
        204,
        "PUT",
        "/vsock",
        Some(&format!(
            r#"{{"guest_cid": 3, "uds_path": "{}"}}"#,
            uds.display()
        )),
    );

    // Routes gpuvm does not serve: 400 naming them.
    refused(
        &api,
        "PUT",
        "/mmds/config",
        Some(r#"{"network_interfaces": []}"#),
        "empty",
    );
    refused(&api, "GET", "/balloon/hinting/status", None, "hinting");
    refused(
        &api,
        "PUT",
        "/serial",
        Some(r#"{"serial_out_path": "/tmp/x"}"#),
        "serial",
    );
    refused(&api, "PUT", "/cpu-config", Some("{}"), "CPU templates");

    let vm_config: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/vm/config", None)).unwrap();
    assert_eq!(vm_config["machine-config"]["vcpu_count"], 1);
    assert_eq!(vm_config["drives"][0]["drive_id"], "rootfs");
    assert!(vm_config["boot-source"]["kernel_image_path"].is_string());

    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    vmm.wait_for_stdout("virtio-vsock: listening", LIMIT);
    assert_eq!(info(&api)["state"], "Running");
    vsock_echo(&uds, b"before the snapshot");
    for _ in 0..64 {
        api_expect(
            &api,
            204,
            "PUT",
            "/actions",
            Some(r#"{"action_type": "FlushMetrics"}"#),
        );
    }

    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    assert_eq!(info(&api)["state"], "Paused");
    let state = scratch.path("snapshot.state");
    let mem = scratch.path("snapshot.mem");
    api_expect(
        &api,
        204,
        "PUT",
        "/snapshot/create",
        Some(&format!(
            r#"{{"snapshot_type": "Full", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
            state.display(),
            mem.display()
        )),
    );
    assert!(
        state.is_file() && mem.is_file(),
        "a state file and a memory file"
    );
    assert!(
        std::fs::read_to_string(&log).unwrap().contains("INFO"),
        "log lines in the log file"
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);

    // A new process loads the two files and the guest goes on.
    let api2 = scratch.path("fc2.sock");
    let restored = start(&scratch, &api2, "fc-vm-2");
    refused(
        &api2,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "clock_realtime": true}}"#,
            state.display(),
            mem.display()
        )),
        "clock_realtime",
    );
    api_expect(
        &api2,
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "enable_diff_snapshots": false, "resume_vm": true}}"#,
            state.display(),
            mem.display()
        )),
    );
    assert_eq!(info(&api2)["state"], "Running");
    vsock_echo(&uds, b"after the restore");
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("virtio-vsock: ok");
}

#[test]
fn config_file_without_api_boots_at_once() {
    let scratch = Scratch::new("firecracker", "config-file");
    let kernel = kernel(&scratch);
    let config = scratch.path("vm.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"boot-source": {{"kernel_image_path": "{}", "boot_args": "hello"}},
            "machine-config": {{"vcpu_count": 1, "mem_size_mib": 64, "smt": false}},
            "drives": [], "network-interfaces": [], "balloon": null,
            "logger": {{"log_path": "{}", "level": "Info"}}}}"#,
            kernel.display(),
            scratch.path("log").display()
        ),
    )
    .unwrap();
    let link = firecracker_link(&scratch);
    let vmm = SpawnedProcess::spawn(
        &link,
        &[
            "--no-api",
            "--config-file",
            config.to_str().unwrap(),
            "--id",
            "x",
            "--boot-timer",
            "--show-level",
            "--show-log-origin",
            "--seccomp-level",
            "2",
        ],
    );
    let out = vmm.wait(LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("hello from ring 3");

    std::fs::write(&config, r#"{"boot-source": {"kernel_image_path": "/k"}, "mmds-config": {"network_interfaces": ["eth0"]}}"#).unwrap();
    let out = SpawnedProcess::spawn(
        &link,
        &["--no-api", "--config-file", config.to_str().unwrap()],
    )
    .wait(LIMIT);
    out.assert_code(125);
    out.assert_stderr_has("mmds-config.network_interfaces");

    let out = SpawnedProcess::spawn(
        &link,
        &["--api-sock", "/tmp/x.sock", "--mmds-size-limit", "ten"],
    )
    .wait(LIMIT);
    out.assert_code(125);
    out.assert_stderr_has("--mmds-size-limit");
}

/// Metrics reach the output on their own, every period, as Firecracker's do (60 s there;
/// shortened here through GPUVM_METRICS_PERIOD_MS), from `--metrics-path` and from
/// `PUT /metrics` alike, with seccomp on and no FlushMetrics.
#[test]
fn metrics_are_written_every_period_without_flush_metrics() {
    let scratch = Scratch::new("firecracker", "periodic-metrics");
    let lines = |path: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect()
    };
    let wait_for_lines = |path: &Path, vmm: &SpawnedProcess| {
        let deadline = std::time::Instant::now() + LIMIT;
        while lines(path).len() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "fewer than 2 metrics lines in {}: {}",
                path.display(),
                vmm.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(lines(path).iter().all(|line| line.is_object()));
    };
    let env = [("GPUVM_METRICS_PERIOD_MS", "100")];

    let flagged = scratch.path("flag-metrics.json");
    let api = scratch.path("fc-flag.sock");
    let mut vmm = SpawnedProcess::spawn_with_env(
        &firecracker_link(&scratch),
        &[
            "--api-sock",
            api.to_str().unwrap(),
            "--metrics-path",
            flagged.to_str().unwrap(),
        ],
        &env,
    );
    wait_for_api_socket(&mut vmm, &api);
    wait_for_lines(&flagged, &vmm);
    drop(vmm);

    let put = scratch.path("put-metrics.json");
    let api = scratch.path("fc-put.sock");
    let mut vmm = SpawnedProcess::spawn_with_env(
        &firecracker_link(&scratch),
        &["--api-sock", api.to_str().unwrap()],
        &env,
    );
    wait_for_api_socket(&mut vmm, &api);
    assert!(lines(&put).is_empty());
    api_expect(
        &api,
        204,
        "PUT",
        "/metrics",
        Some(&format!(r#"{{"metrics_path": "{}"}}"#, put.display())),
    );
    wait_for_lines(&put, &vmm);
    assert!(
        !vmm.stderr().contains("blocked system call"),
        "{}",
        vmm.stderr()
    );
}

// ---- Raw memory files (Firecracker's layout) ----

const FC_UFFD_HANDLER: &str = env!("CARGO_BIN_EXE_gpuvm-test-fc-uffd-handler");
/// Guest RAM of the raw-image tests, and the memloop guest that checks its own memory
/// (`memloop SIZE SEED ITERS`: every iteration verifies every page it wrote).
const RAW_MEM_MIB: u64 = 128;
const RAW_MEMLOOP: &str = "memloop 32M 13 40";

/// `PUT /snapshot/create` of `snapshot_type` into `state` and `mem`.
fn create_snapshot(api: &Path, snapshot_type: &str, state: &Path, mem: &Path) {
    api_expect(
        api,
        204,
        "PUT",
        "/snapshot/create",
        Some(&format!(
            r#"{{"snapshot_type": "{snapshot_type}", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
            state.display(),
            mem.display()
        )),
    );
}

/// Boots the memloop guest through Firecracker's API (dirty pages tracked if
/// `track_dirty_pages`), and pauses it after its first checked iteration.
fn boot_memloop_and_pause(
    scratch: &Scratch,
    api: &Path,
    track_dirty_pages: bool,
) -> SpawnedProcess {
    boot_sized_memloop_and_pause(scratch, api, track_dirty_pages, RAW_MEM_MIB, RAW_MEMLOOP)
}

/// As [`boot_memloop_and_pause`], with `mem_mib` of guest RAM and `memloop` as the
/// guest's command line.
fn boot_sized_memloop_and_pause(
    scratch: &Scratch,
    api: &Path,
    track_dirty_pages: bool,
    mem_mib: u64,
    memloop: &str,
) -> SpawnedProcess {
    let mut vmm = start(scratch, api, "fc-raw-create");
    let kernel = kernel(scratch);
    api_expect(
        api,
        204,
        "PUT",
        "/machine-config",
        Some(&format!(
            r#"{{"vcpu_count": 1, "mem_size_mib": {mem_mib}, "smt": false, "track_dirty_pages": {track_dirty_pages}}}"#
        )),
    );
    api_expect(
        api,
        204,
        "PUT",
        "/boot-source",
        Some(&format!(
            r#"{{"kernel_image_path": "{}", "boot_args": "{memloop}"}}"#,
            kernel.display()
        )),
    );
    api_expect(
        api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    vmm.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    api_expect(api, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    vmm
}

/// Boots the memloop guest through Firecracker's API, pauses it after its first checked
/// iteration and writes a Full snapshot into `state` and `mem`; the VMM is killed after.
/// Returns what the guest printed before the snapshot.
fn memloop_full_snapshot(scratch: &Scratch, state: &Path, mem: &Path) -> String {
    let api = scratch.path("raw-create.sock");
    let vmm = boot_memloop_and_pause(scratch, &api, false);
    create_snapshot(&api, "Full", state, mem);
    let before = output_until_killed(vmm);
    assert!(
        !before.contains("memloop: done"),
        "the guest finished before the snapshot: {before}"
    );
    before
}

/// Kills the paused VMM and returns all it printed: read after it ended, so no byte the
/// guest wrote before the snapshot is still in the pipe.
fn output_until_killed(mut vmm: SpawnedProcess) -> String {
    vmm.signal(libc::SIGKILL);
    vmm.wait(LIMIT).stdout
}

/// Whether `name`, in the hidden directory, is a gpuvm-format memory file (not the raw
/// image's page CRC table beside it, `<memory file>.raw-crcs`).
fn is_indexed_memory_file(name: &str) -> bool {
    name.starts_with("memory-") && !name.ends_with(".raw-crcs")
}

/// The gpuvm-format memory files in the hidden directory beside `state`.
fn indexed_memory_files(state: &Path) -> Vec<PathBuf> {
    let hidden = gpuvm_vmm::snapshot::files::directory_for(state).unwrap();
    std::fs::read_dir(&hidden)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_indexed_memory_file)
        })
        .collect()
}

/// Checks that `mem` is the raw image of the gpuvm-format memory file gpuvm converted it
/// from (in the hidden directory beside `state`): guest RAM's size, sparse, the page CRC
/// table kept beside it is the one that file stores, and that file's page data is freed
/// (the disk keeps guest memory once). Writes a copy of that file at `refilled` with its
/// data put back from the raw image (every page it stores, from its flat offset: the
/// region's memfd offset plus the page's offset in the region), every page checked
/// against the CRC gpuvm stored for it: a gpuvm-format memory file as gpuvm wrote it.
fn assert_raw_image_of_gpuvm_snapshot(state: &Path, mem: &Path, refilled: &Path) {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let meta = std::fs::metadata(mem).unwrap();
    assert_eq!(
        meta.len(),
        RAW_MEM_MIB << 20,
        "the raw image is guest RAM's size"
    );
    assert!(
        meta.blocks() * 512 < meta.len() / 2,
        "the raw image is not sparse: {} of {} bytes allocated",
        meta.blocks() * 512,
        meta.len()
    );
    let hidden = gpuvm_vmm::snapshot::files::directory_for(state).unwrap();
    let indexed = indexed_memory_files(state);
    assert_eq!(indexed.len(), 1, "{indexed:?}");
    let chain = gpuvm_memory::snapshot::SnapshotChain::open_with_file_layout(&indexed).unwrap();
    let layout = chain.layout();
    let page = layout.page_size();
    let data_pages = chain.data_pages();
    assert!(
        meta.blocks() * 512 >= data_pages * page,
        "fewer bytes allocated than the {data_pages} data pages"
    );
    let indexed_allocated = std::fs::metadata(&indexed[0]).unwrap().blocks() * 512;
    assert!(
        indexed_allocated < data_pages * page / 8,
        "the gpuvm-format file still holds its page data: {indexed_allocated} bytes allocated \
         for {data_pages} data pages"
    );
    let table = std::fs::read_dir(&hidden)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|n| n.ends_with(".raw-crcs"))
        .expect("the raw image's page CRC table");
    let table = gpuvm_memory::snapshot::RawPageCrcs::read_in_dir(&hidden, &table, layout).unwrap();
    assert_eq!(
        gpuvm_memory::snapshot::RawPageCrcs::of_chain(&chain).unwrap(),
        table,
        "the raw image's table is not the gpuvm-format file's page CRCs"
    );
    // Flat offset of linear page `linear`.
    let flat = |linear: u64| {
        let mut first = 0;
        for region in layout.regions() {
            let pages = region.size / page;
            if linear < first + pages {
                return region.file_offset + (linear - first) * page;
            }
            first += pages;
        }
        panic!("page {linear} outside guest RAM");
    };
    std::fs::copy(&indexed[0], refilled).unwrap();
    let (refilled_file, raw) = (
        std::fs::File::options().write(true).open(refilled).unwrap(),
        std::fs::File::open(mem).unwrap(),
    );
    let mut bytes = vec![0u8; page as usize];
    let mut copied = 0;
    for run in chain.plan() {
        for k in 0..run.count {
            raw.read_exact_at(&mut bytes, flat(run.start + k)).unwrap();
            refilled_file
                .write_all_at(&bytes, run.file_offset + k * page)
                .unwrap();
            copied += 1;
        }
    }
    assert!(copied > 100, "only {copied} pages copied");
    drop(refilled_file);
    gpuvm_memory::snapshot::MemoryFile::open(refilled)
        .unwrap()
        .verify_data()
        .expect("every page of the raw image is the one gpuvm stored");
}

/// The restored guest resumed where it was snapshotted (no second boot) and its own
/// checks pass to the end: memloop verifies every page it wrote, each iteration. The
/// snapshot can cut a serial line in two (the guest paused mid-print), so the two runs'
/// output together must be the whole loop, each iteration once and in order.
fn assert_memloop_went_on(before: &str, after: &str) {
    assert!(!after.contains("FAIL"), "{after}");
    assert!(!after.contains("memloop: cpus="), "booted again: {after}");
    assert!(after.contains("memloop: done"), "{after}");
    let whole = gpuvm_tests::memloop_iterations(&format!("{before}{after}"));
    assert_eq!(
        whole,
        (0..whole.len() as u64).collect::<Vec<_>>(),
        "before: {before}\nafter: {after}"
    );
    assert!(
        gpuvm_tests::memloop_iterations(after).len() >= 2,
        "before: {before}\nafter: {after}"
    );
}

#[test]
fn full_snapshot_memory_file_is_a_sparse_raw_image_loaded_with_file() {
    let scratch = Scratch::new("firecracker", "raw-file");
    let (state, mem) = (scratch.path("vm.state"), scratch.path("vm.mem"));
    let before = memloop_full_snapshot(&scratch, &state, &mem);
    let (old_state, old_mem) = (scratch.path("old.state"), scratch.path("old.mem"));
    assert_raw_image_of_gpuvm_snapshot(&state, &mem, &old_mem);

    // A memory file of another size is refused, naming the sizes.
    let short = scratch.path("short.mem");
    std::fs::copy(&mem, &short).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(RAW_MEM_MIB << 19)
        .unwrap();
    let api = scratch.path("raw-bad.sock");
    let vmm = start(&scratch, &api, "fc-raw-bad");
    let answer = api_expect(
        &api,
        400,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "resume_vm": true}}"#,
            state.display(),
            short.display()
        )),
    );
    assert!(answer.contains("guest RAM size mismatch"), "{answer}");
    drop(vmm);

    // A fresh process loads it (File: lazily) and the guest's own checks pass on.
    let api = scratch.path("raw-load.sock");
    let restored = start(&scratch, &api, "fc-raw-load");
    api_expect(
        &api,
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "resume_vm": true}}"#,
            state.display(),
            mem.display()
        )),
    );
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert_memloop_went_on(&before, &out.stdout);

    // The two files as gpuvm wrote them before raw images (its own state, no raw mark, and
    // its indexed memory file, its data put back) still load the same way.
    let hidden = gpuvm_vmm::snapshot::files::directory_for(&state).unwrap();
    std::fs::copy(hidden.join("state"), &old_state).unwrap();
    let api = scratch.path("old-load.sock");
    let restored = start(&scratch, &api, "fc-old-load");
    api_expect(
        &api,
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_file_path": "{}", "resume_vm": true}}"#,
            old_state.display(),
            old_mem.display()
        )),
    );
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert_memloop_went_on(&before, &out.stdout);
}

/// `PUT /snapshot/load` of `state` with `mem` (mem_backend File, resumed) in a fresh
/// process; returns the answer's status and body, and the process.
fn load_raw(
    scratch: &Scratch,
    name: &str,
    state: &Path,
    mem: &Path,
) -> (u16, String, SpawnedProcess) {
    let api = scratch.path(&format!("{name}.sock"));
    let vmm = start(scratch, &api, name);
    let body = format!(
        r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "resume_vm": true}}"#,
        state.display(),
        mem.display()
    );
    let response = gpuvm_api::client::request(&api, "PUT", "/snapshot/load", Some(&body))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    (response.status, response.message(), vmm)
}

/// Issue 31: a raw memory image gpuvm wrote never loads changed without an error. One
/// byte flipped at 16 MiB + 1234 (in a page with data or in a hole): the guest never runs
/// on it, gpuvm ends with `data CRC mismatch` (File loads are lazy: the page is checked
/// as it loads, so the 204 may come first). The page CRC table gpuvm keeps in the hidden
/// directory is part of the snapshot: missing, damaged or another snapshot's, the load is
/// refused before the VM is built.
#[test]
fn a_damaged_raw_memory_file_never_loads_silently() {
    let scratch = Scratch::new("firecracker", "raw-damaged");
    let (state, mem) = (scratch.path("vm.state"), scratch.path("vm.mem"));
    let _ = memloop_full_snapshot(&scratch, &state, &mem);
    let hidden = gpuvm_vmm::snapshot::files::directory_for(&state).unwrap();
    let table = std::fs::read_dir(&hidden)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_str().unwrap().ends_with(".raw-crcs"))
        .expect("gpuvm keeps the raw image's page CRC table in its directory");

    // A byte flipped in the image.
    let flipped = scratch.path("flipped.mem");
    std::fs::copy(&mem, &flipped).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&flipped)
            .unwrap();
        let at = (16 << 20) + 1234;
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at).unwrap();
        file.write_all_at(&[byte[0] ^ 0x01], at).unwrap();
    }
    let (status, message, vmm) = load_raw(&scratch, "fc-flipped", &state, &flipped);
    let out = vmm.wait(LIMIT);
    eprintln!(
        "flipped image: load answered {status} {message}; gpuvm: {:?}",
        out.code()
    );
    assert!(
        status != 204 || out.code() != Some(0),
        "a damaged image loaded and ran: {}",
        out.describe()
    );
    assert!(
        message.contains("data CRC mismatch") || out.stderr.contains("data CRC mismatch"),
        "{status} {message}: {}",
        out.describe()
    );
    assert!(!out.stdout.contains("memloop: done"), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());

    // The table damaged, then another snapshot's (a valid table of other pages), then
    // gone: refused at once, naming it.
    let saved = std::fs::read(&table).unwrap();
    let mut damaged = saved.clone();
    damaged[40] ^= 0x10;
    std::fs::write(&table, &damaged).unwrap();
    let (status, message, _vmm) = load_raw(&scratch, "fc-table-damaged", &state, &mem);
    assert_eq!(status, 400, "{message}");
    assert!(message.contains("CRC mismatch"), "{message}");
    let mut foreign = saved.clone();
    foreign[40] ^= 0x10;
    let entries_crc = crc32fast::hash(&foreign[32..]);
    foreign[12..16].copy_from_slice(&entries_crc.to_le_bytes());
    std::fs::write(&table, &foreign).unwrap();
    let (status, message, _vmm) = load_raw(&scratch, "fc-table-foreign", &state, &mem);
    assert_eq!(status, 400, "{message}");
    assert!(message.contains("another snapshot"), "{message}");
    std::fs::remove_file(&table).unwrap();
    let (status, message, _vmm) = load_raw(&scratch, "fc-table-missing", &state, &mem);
    assert_eq!(status, 400, "{message}");
    assert!(
        message.contains("page CRC table") && message.contains("missing"),
        "{message}"
    );
}

#[test]
fn raw_memory_file_is_served_by_a_firecracker_protocol_uffd_handler() {
    let scratch = Scratch::new("firecracker", "raw-uffd");
    let (state, mem) = (scratch.path("vm.state"), scratch.path("vm.mem"));
    let before = memloop_full_snapshot(&scratch, &state, &mem);

    let handler_socket = scratch.path("fc-uffd.sock");
    let mut handler = SpawnedProcess::spawn(
        Path::new(FC_UFFD_HANDLER),
        &[handler_socket.to_str().unwrap(), mem.to_str().unwrap()],
    );
    handler.wait_for_stdout("fc-uffd-handler: listening", LIMIT);
    let api = scratch.path("raw-uffd.sock");
    let restored = start(&scratch, &api, "fc-raw-uffd");
    api_expect(
        &api,
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "Uffd", "backend_path": "{}"}}, "resume_vm": true}}"#,
            state.display(),
            handler_socket.display()
        )),
    );
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert_memloop_went_on(&before, &out.stdout);
    let served = handler.wait(LIMIT);
    served.assert_code(0);
    let faults: u64 = served
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("fc-uffd-handler: served "))
        .and_then(|l| l.strip_suffix(" faults"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}", served.stdout));
    assert!(faults > 0, "the handler served no fault: {}", served.stdout);
}

/// The byte ranges of `file` that hold data (`SEEK_DATA`/`SEEK_HOLE`).
fn data_ranges(file: &std::fs::File) -> Vec<(u64, u64)> {
    use std::os::unix::io::AsRawFd;
    let len = file.metadata().unwrap().len();
    let mut ranges = Vec::new();
    let mut at = 0u64;
    while at < len {
        // SAFETY: lseek on a descriptor this test owns.
        let data = unsafe { libc::lseek(file.as_raw_fd(), at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        assert!(hole > data, "SEEK_HOLE from data at {data}: {hole}");
        ranges.push((data as u64, hole as u64));
        at = hole as u64;
    }
    ranges
}

/// A Diff through Firecracker's API writes Firecracker's Diff memory file: RAM-sized,
/// only the dirty pages present; merged onto the Full image by its data ranges (what a
/// client such as snapshot-editor does), the merge loads with the Diff's state and the
/// guest's own checks pass on.
#[test]
fn diff_memory_file_merged_onto_the_full_image_loads() {
    use std::os::unix::fs::MetadataExt;
    let scratch = Scratch::new("firecracker", "raw-diff");
    let state = scratch.path("vm.state");
    let (base, diff) = (scratch.path("base.mem"), scratch.path("diff.mem"));
    let api = scratch.path("raw-diff.sock");
    let mut vmm = boot_memloop_and_pause(&scratch, &api, true);
    create_snapshot(&api, "Full", &state, &base);
    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Resumed"}"#));
    let iters = gpuvm_tests::memloop_iterations(&vmm.stdout()).len();
    vmm.wait_for_stdout(&format!("memloop: iter {} ok", iters + 1), LIMIT);
    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    create_snapshot(&api, "Diff", &state, &diff);
    let before = output_until_killed(vmm);
    assert!(!before.contains("memloop: done"), "{before}");

    let (base_meta, diff_meta) = (
        std::fs::metadata(&base).unwrap(),
        std::fs::metadata(&diff).unwrap(),
    );
    assert_eq!(
        diff_meta.len(),
        RAW_MEM_MIB << 20,
        "a Diff image is RAM-sized too"
    );
    assert!(
        diff_meta.blocks() > 0 && diff_meta.blocks() < base_meta.blocks(),
        "the Diff holds fewer pages than the Full image: {} vs {} blocks",
        diff_meta.blocks(),
        base_meta.blocks()
    );
    // The Diff's state alone with the Full image would be the wrong guest; the merge is
    // what loads.
    let merged = merge_diff_image(&scratch, &base, &diff);
    load_merged_image_and_check(&scratch, "raw-diff-load", &state, &merged, &before);
}

/// A copy of the Full image `base` with the Diff image `diff`'s data ranges written over
/// it, as a Firecracker client merges them.
fn merge_diff_image(scratch: &Scratch, base: &Path, diff: &Path) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let merged = scratch.path("merged.mem");
    std::fs::copy(base, &merged).unwrap();
    let (from, to) = (
        std::fs::File::open(diff).unwrap(),
        std::fs::File::options().write(true).open(&merged).unwrap(),
    );
    let ranges = data_ranges(&from);
    assert!(!ranges.is_empty(), "the Diff image holds no data");
    for (start, end) in ranges {
        let mut bytes = vec![0u8; (end - start) as usize];
        from.read_exact_at(&mut bytes, start).unwrap();
        to.write_all_at(&bytes, start).unwrap();
    }
    merged
}

/// Loads `state` with the merged image in a new gpuvm (API socket named after `name`); the
/// guest's memloop must go on from where `before` left it and finish.
fn load_merged_image_and_check(
    scratch: &Scratch,
    name: &str,
    state: &Path,
    merged: &Path,
    before: &str,
) {
    let api = scratch.path(&format!("{name}.sock"));
    let restored = start(scratch, &api, &format!("fc-{name}"));
    api_expect(
        &api,
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_file_path": "{}", "resume_vm": true}}"#,
            state.display(),
            merged.display()
        )),
    );
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert_memloop_went_on(before, &out.stdout);
}

/// Bytes the file system allocated for `path`: a file's blocks, or the sum over a
/// directory's files.
fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).unwrap();
    if !meta.is_dir() {
        return meta.blocks() * 512;
    }
    std::fs::read_dir(path)
        .unwrap()
        .map(|e| allocated_bytes(&e.unwrap().path()))
        .sum()
}

/// Issue 30: a snapshot in Firecracker's layout keeps guest memory on disk once. After a
/// Full snapshot of a guest that touched N bytes of its RAM, the raw image and the hidden
/// directory together take about N (the gpuvm-format memory file the image is converted
/// from keeps its index and page CRCs, not its data); a Diff after it adds about its dirty
/// pages; and the Diff merged onto the Full image still loads, the guest's own checks
/// passing on. Prints the figures (time of each snapshot request, bytes on disk).
#[test]
fn snapshots_keep_guest_memory_on_disk_once() {
    const MEM_MIB: u64 = 512;
    let scratch = Scratch::new("firecracker", "raw-once");
    let state = scratch.path("vm.state");
    let hidden = gpuvm_vmm::snapshot::files::directory_for(&state).unwrap();
    let (base, diff) = (scratch.path("base.mem"), scratch.path("diff.mem"));
    let api = scratch.path("raw-once.sock");
    let mut vmm = boot_sized_memloop_and_pause(&scratch, &api, true, MEM_MIB, "memloop 256M 13 12");
    let started = std::time::Instant::now();
    create_snapshot(&api, "Full", &state, &base);
    let full_time = started.elapsed();

    // N: the pages with data that gpuvm's own file indexes (and wrote, then freed).
    let indexed = indexed_memory_files(&state);
    assert_eq!(indexed.len(), 1, "{indexed:?}");
    let chain = gpuvm_memory::snapshot::SnapshotChain::open_with_file_layout(&indexed).unwrap();
    let data_bytes = chain.data_pages() * chain.layout().page_size();
    assert!(
        data_bytes >= 256 << 20,
        "the guest touched {data_bytes} bytes"
    );
    let (image, kept) = (allocated_bytes(&base), allocated_bytes(&hidden));
    eprintln!(
        "Full snapshot of a {MEM_MIB} MiB guest with {} MiB of data: {} ms; on disk: raw image \
         {} KiB + hidden directory {} KiB (before issue 30 the hidden directory also kept \
         the {} KiB gpuvm-format file: {} KiB written and kept)",
        data_bytes >> 20,
        full_time.as_millis(),
        image >> 10,
        kept >> 10,
        std::fs::metadata(&indexed[0]).unwrap().len() >> 10,
        (image + std::fs::metadata(&indexed[0]).unwrap().len()) >> 10
    );
    assert!(
        image >= data_bytes,
        "the image holds {image} bytes of {data_bytes}"
    );
    assert!(
        image + kept < data_bytes + data_bytes / 8,
        "the disk holds guest memory twice: image {image} + hidden directory {kept} bytes \
         for {data_bytes} bytes of data"
    );

    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Resumed"}"#));
    let iters = gpuvm_tests::memloop_iterations(&vmm.stdout()).len();
    vmm.wait_for_stdout(&format!("memloop: iter {} ok", iters + 1), LIMIT);
    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    let started = std::time::Instant::now();
    create_snapshot(&api, "Diff", &state, &diff);
    let diff_time = started.elapsed();
    let before = output_until_killed(vmm);
    assert!(!before.contains("memloop: done"), "{before}");

    let (diff_image, kept) = (allocated_bytes(&diff), allocated_bytes(&hidden));
    eprintln!(
        "Diff snapshot: {} ms; on disk: Diff image {} KiB + hidden directory {} KiB",
        diff_time.as_millis(),
        diff_image >> 10,
        kept >> 10
    );
    assert!(diff_image > 0);
    assert!(
        kept < diff_image / 4 + (4 << 20),
        "the hidden directory keeps the Diff's data too: {kept} bytes for a {diff_image}-byte \
         image"
    );

    // The Diff merged onto the Full image (by its data ranges) loads, and the guest's own
    // checks of every page it wrote pass on.
    let merged = merge_diff_image(&scratch, &base, &diff);
    load_merged_image_and_check(&scratch, "raw-once-load", &state, &merged, &before);
}
