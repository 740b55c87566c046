//! Big machines (issue 27): guest RAM far above 1 TiB of guest-physical address space, and
//! huge BARs mapped on 1 GiB host boundaries.
//!
//! The guest RAM test boots the test guest with more RAM than this host has (memfd, no
//! prefault: untouched RAM costs nothing, and gpuvm allows a sparse guest up to 64 times
//! host RAM), checks the e820 map the guest reads, snapshots it and restores it lazily;
//! the memory file holds only the pages the guest touched. Its size is
//! `GPUVM_BIG_RAM_GIB` (default [`DEFAULT_RAM_GIB`]); on the CI hosts (nested KVM with
//! shadow paging) registering the memory slot costs KVM about 0.2% of it in reverse maps
//! and time to match, so the default stays below what the slowest host takes quickly.
//!
//! The many-slots test cuts a small guest's RAM into many KVM memory slots (as gpuvm cuts a
//! region past KVM's 8 TiB per slot) and checks the guest's memory through a diff snapshot
//! chain and a lazy restore.
//!
//! The BAR test starts one emulated GPU with an H200-like 256 GiB BAR1 and checks, in
//! gpuvm's debug log and in /proc/PID/maps, that the BAR's host mapping is 1 GiB aligned.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpuvm_arch::x86_64::layout::{ram_reaches_ht_hole, AMD_HT_HOLE_END, AMD_HT_HOLE_START};
use gpuvm_tests::host_is_amd;
use gpuvm_tests::snapshot_support::{
    arg, assert_restored_memloop_completes, field, full_then_diff_with_pages, has, iterations,
    memory_files, memory_header, only_report, restore, signal_snapshot,
};
use gpuvm_tests::{guest_ram_ranges_on, run_gpuvm, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(240);
const GIB: u64 = 1 << 30;
/// The guest RAM the test boots unless `GPUVM_BIG_RAM_GIB` says otherwise (less on hosts
/// with under 16 GiB: gpuvm allows a sparse guest 64 times host RAM).
const DEFAULT_RAM_GIB: u64 = 1024;

fn big_ram_gib() -> u64 {
    std::env::var("GPUVM_BIG_RAM_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            let sparse_limit =
                gpuvm_memory::host_memory_total() * gpuvm_memory::SPARSE_RAM_PER_HOST_RAM / GIB;
            DEFAULT_RAM_GIB.min(sparse_limit)
        })
}

/// The RAM entries (type 1) of the e820 map the test guest printed (`info` workload).
fn guest_e820_ram(stdout: &str) -> Vec<(u64, u64)> {
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    stdout
        .lines()
        .filter_map(|line| line.strip_prefix("info: e820 "))
        .filter(|rest| rest.ends_with("type 1"))
        .map(|rest| {
            let range = rest.split_whitespace().next().unwrap();
            let (start, end) = range.split_once('-').unwrap();
            (hex(start), hex(end) - hex(start))
        })
        .collect()
}

#[test]
fn guest_ram_larger_than_the_host_boots_and_restores_lazily_from_a_sparse_file() {
    let gib = big_ram_gib();
    let memory = format!("{gib}G");
    let bytes = gib * GIB;

    // The guest's own view of RAM: every byte of it, where the layout puts it.
    let started = Instant::now();
    let out = run_gpuvm(
        &[
            "run",
            "--memory",
            &memory,
            "--cmdline",
            "info",
            "--report-timing",
        ],
        LIMIT,
    );
    out.assert_code(0).assert_stdout_has("testguest: ready");
    eprintln!(
        "{memory}: start to exit {:?}; {}",
        started.elapsed(),
        out.stderr
            .lines()
            .find(|l| l.starts_with("gpuvm: timing "))
            .unwrap_or("no timing line")
    );
    let ram = guest_e820_ram(&out.stdout);
    assert_eq!(
        ram,
        guest_ram_ranges_on(bytes, host_is_amd()),
        "{}",
        out.stdout
    );
    let top = ram.last().map(|(start, len)| start + len).unwrap();
    assert!(
        top > bytes,
        "RAM must reach past its size (the 32-bit hole): {top:#x}"
    );

    // The same guest on an AMD host (as this host plans when told to): RAM that would reach
    // the HyperTransport range goes on at 1 TiB. The rest of the test runs that layout, its
    // three regions through the memory file and a lazy restore.
    let amd = [(AS_AMD, "amd")];
    let reaches_hole = ram_reaches_ht_hole(bytes);
    let out =
        SpawnedProcess::gpuvm_with_env(&["run", "--memory", &memory, "--cmdline", "info"], &amd)
            .wait(LIMIT);
    assert_eq!(out.code(), Some(0), "AMD layout: {}", out.describe());
    let ram = guest_e820_ram(&out.stdout);
    assert_eq!(ram, guest_ram_ranges_on(bytes, true), "{}", out.stdout);
    if reaches_hole {
        assert!(
            ram.iter().any(|&(start, _)| start == AMD_HT_HOLE_END)
                && ram
                    .iter()
                    .all(|&(start, len)| start + len <= AMD_HT_HOLE_START
                        || start >= AMD_HT_HOLE_END),
            "RAM must go on at 1 TiB, none in the HyperTransport range: {ram:x?}"
        );
    } else {
        eprintln!(
            "{memory} does not reach the HyperTransport range: the AMD layout is the usual one"
        );
    }

    // Snapshot a guest that writes a little of it, then restore it lazily.
    let scratch = Scratch::new("big-ram", "snapshot");
    let dir: PathBuf = scratch.path("snapshot");
    let iters = 150;
    let cmdline = format!("memloop 32M 1 {iters}");
    let mut run = SpawnedProcess::gpuvm_with_env(
        &[
            "run",
            "--memory",
            &memory,
            "--cmdline",
            &cmdline,
            "--snapshot-dir",
            arg(&dir),
            "--snapshot-then",
            "exit",
            "--report-timing",
        ],
        &amd,
    );
    run.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let snapshot_started = Instant::now();
    signal_snapshot(run.pid());
    let out = run.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "snapshot run: {}", out.describe());
    eprintln!(
        "{memory}: snapshot and exit {:?}",
        snapshot_started.elapsed()
    );
    let report = only_report(&out, "gpuvm: snapshot ");
    assert!(has(&report, "diff", "false"), "{report:?}");

    let files = memory_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let path = dir.join(&files[0]);
    let header = memory_header(&path);
    assert_eq!(header.ram_size, bytes);
    assert_eq!(header.data_pages, field(&report, "data_pages") as u64);
    // Only what the guest touched is stored, and the file's blocks hold no more than that.
    let data = header.data_pages * header.page_size;
    assert!(
        data < GIB,
        "{data} bytes of data for a guest that wrote 32 MiB"
    );
    let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
    assert!(
        allocated <= header.file_len.next_multiple_of(1 << 20) && allocated < 2 * GIB,
        "the memory file is not sparse: {allocated} bytes allocated for {} of file",
        header.file_len
    );
    eprintln!(
        "{memory}: memory file {} bytes, {allocated} allocated, {} data pages",
        header.file_len, header.data_pages
    );

    // A host whose layout differs (no HyperTransport range) cannot take it: refused
    // before anything runs, naming the region.
    if reaches_hole && !host_is_amd() {
        let out = restore(&dir, "lazy", &[]);
        assert_ne!(out.code(), Some(0), "an Intel host restored an AMD layout");
        assert!(out.stderr.contains("region"), "{}", out.stderr);
        assert!(!out.stdout.contains("memloop: iter"), "{}", out.stdout);
    }

    let restored_at = Instant::now();
    let restore_args = ["restore", "--snapshot", arg(&dir), "--restore-mode", "lazy"];
    let out = SpawnedProcess::gpuvm_with_env(&restore_args, &amd).wait(LIMIT);
    assert_restored_memloop_completes(&out, iters);
    eprintln!("{memory}: lazy restore to exit {:?}", restored_at.elapsed());
}

/// What makes gpuvm plan as an AMD host does (vmm/src/host.rs).
const AS_AMD: &str = "GPUVM_TEST_HOST_VENDOR";

/// What makes gpuvm cut boot RAM into KVM memory slots of at most this many MiB, as it cuts
/// a region past KVM's 8 TiB per slot (vmm/src/builder.rs).
const MAX_SLOT_MIB: &str = "GPUVM_TEST_MAX_SLOT_MIB";

/// Boot RAM over many KVM memory slots, as a region larger than one slot (8 TiB) is: this
/// host cannot hold such a guest, so `GPUVM_TEST_MAX_SLOT_MIB` cuts a 3.5 GiB one (3 GiB
/// below the 32-bit hole, 512 MiB above) into 128 MiB slots. The guest checks 3200 MiB of
/// it, across both regions and 26 of the slots, through a full snapshot, a diff snapshot
/// (whose dirty pages come from every slot's dirty log, joined per region) and a lazy
/// restore of the chain. A page lost from the diff would fail the guest's check.
#[test]
fn boot_ram_over_many_kvm_slots_snapshots_diffs_and_restores_lazily() {
    let scratch = Scratch::new("big-ram", "many-slots");
    let dir: PathBuf = scratch.path("snapshot");
    let env = [(MAX_SLOT_MIB, "128")];
    let slots_line = "guest RAM: 28 KVM memory slots for 2 region(s) (at most 128 MiB each)";
    let iters = 6;
    let cmdline = format!("memloop 3200M 5 {iters}");
    let mut run = SpawnedProcess::gpuvm_with_env(
        &[
            "--log-level",
            "info",
            "run",
            "--memory",
            "3584M",
            "--cmdline",
            &cmdline,
            "--track-dirty-pages",
            "--snapshot-dir",
            arg(&dir),
            "--snapshot-then",
            "resume",
        ],
        &env,
    );
    run.wait_for_stdout("memloop: iter 0 ok", LIMIT);
    assert!(run.stderr().contains(slots_line), "{}", run.stderr());
    let snapshots_started = Instant::now();
    let (base, diff, chain_len) = full_then_diff_with_pages(&mut run, &dir);
    eprintln!(
        "many slots: {chain_len} snapshots in {:?}",
        snapshots_started.elapsed()
    );
    run.signal(libc::SIGKILL);
    let killed = run.wait(LIMIT);
    assert!(
        !killed.stdout.contains("memloop: done") && !killed.stdout.contains("FAIL"),
        "{}",
        killed.describe()
    );
    assert!(
        diff.data_pages > 0 && diff.data_pages < base.data_pages,
        "the guest ran between snapshots, so the diff should hold some but not all pages:\n{base:?}\n{diff:?}"
    );

    // The chain restored lazily, its RAM over as many slots: every page the guest checks
    // comes from the base or the diff.
    let restore_args = [
        "--log-level",
        "info",
        "restore",
        "--snapshot",
        arg(&dir),
        "--restore-mode",
        "lazy",
    ];
    let restored_at = Instant::now();
    let out = SpawnedProcess::gpuvm_with_env(&restore_args, &env).wait(LIMIT);
    assert_restored_memloop_completes(&out, iters);
    assert!(out.stderr.contains(slots_line), "{}", out.stderr);
    eprintln!(
        "many slots: lazy restore to exit {:?}, {} iterations",
        restored_at.elapsed(),
        iterations(&out.stdout).len()
    );

    // A slot size that would need more slots than boot RAM has is refused before the
    // guest runs, and so is one that is not a whole number of 2 MiB.
    for (mib, says) in [
        ("2", "KVM memory slots of at most 2 MiB"),
        ("3", "multiple of 2 MiB"),
    ] {
        let out = SpawnedProcess::gpuvm_with_env(
            &["run", "--memory", "3584M", "--cmdline", "info"],
            &[(MAX_SLOT_MIB, mib)],
        )
        .wait(LIMIT);
        assert_ne!(out.code(), Some(0), "{}", out.describe());
        assert!(out.stderr.contains(says), "{}", out.describe());
        assert!(
            !out.stdout.contains("testguest: ready"),
            "{}",
            out.describe()
        );
    }
}

/// `0x...` after `at host ` in gpuvm's debug line for BAR `bar`'s mapping of `size` bytes.
fn logged_bar_host_address(stderr: &str, bar: u8, size: u64) -> u64 {
    let wanted = format!("BAR{bar} +0x0 ({size:#x} bytes) mapped at host ");
    let line = stderr
        .lines()
        .find_map(|l| l.split_once(wanted.as_str()).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no '{wanted}' in:\n{stderr}"));
    u64::from_str_radix(line.trim().trim_start_matches("0x"), 16).unwrap()
}

#[test]
fn a_256_gib_bar_is_mapped_at_a_gib_aligned_host_address() {
    let bar1 = 256 * GIB;
    let socket = gpuvm_tests::socket_path("big-ram", "bar-align");
    let emu = PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let server =
        gpuvm_tests::start_emu_gpu(&emu, &socket, &["--bar1-mib", &(bar1 >> 20).to_string()]);
    // A guest that keeps running (memloop) while the test reads the mappings; the VM is
    // killed when `run` is dropped.
    let mut run = SpawnedProcess::gpuvm(&[
        "--log-level",
        "debug",
        "run",
        "--cmdline",
        "memloop 4M 1 1000000",
        "--vfio-user",
        socket.to_str().unwrap(),
    ]);
    run.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let host = logged_bar_host_address(&run.stderr(), 1, bar1);
    assert_eq!(host % GIB, 0, "BAR1 mapped at host {host:#x}");
    // The mapping's line in /proc/PID/maps starts at the logged address and spans the
    // whole BAR.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", run.pid())).unwrap();
    let mapped = maps.lines().any(|line| {
        let range = line.split_whitespace().next().unwrap_or("");
        range.split_once('-').is_some_and(|(start, end)| {
            let hex = |s: &str| u64::from_str_radix(s, 16).unwrap_or(0);
            hex(start) == host && hex(end) - hex(start) == bar1
        })
    });
    assert!(mapped, "no {bar1:#x}-byte mapping at {host:#x} in:\n{maps}");
    drop(run);
    drop(server);
}
