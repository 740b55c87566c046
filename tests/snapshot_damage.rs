//! Every kind of corrupt or unusable snapshot must fail with a clear error, promptly, and
//! never run the guest on wrong data: a table of corruptions of the state and memory files
//! and of the configuration, a missing snapshot directory, a page found corrupt only while
//! a lazily restored guest runs, a memory file changed after validation, and (the test
//! oracle) a wrong page in a consistent file, which the guest itself catches.

use std::path::Path;
use std::time::{Duration, Instant};

use gpuvm_tests::snapshot_support::{
    arg, copy_dir, flip_byte, frame_state, memory_files, memory_header, read_state, restore,
    small_snapshot, write_state, FLAG_PAGE_CRCS_CHECKED_ON_LOAD, MEMORY_HEADER_LEN, MEMORY_MAGIC,
};
use gpuvm_tests::{RunOutput, Scratch, SpawnedProcess};

// ---- The test oracle: a wrong page in a consistent file ----

/// The test oracle itself: a page restored with the wrong content (but a consistent
/// file, all CRCs recomputed) is caught by the guest's own verification.
#[test]
fn guest_detects_a_wrong_page_after_restore() {
    let scratch = Scratch::new("snapshot", "oracle");
    let good = small_snapshot(&scratch);
    let path = good.join(&memory_files(&good)[0]);
    let header = memory_header(&path);
    let mut bytes = std::fs::read(&path).expect("read");
    // The middle data page: with 32 MiB of memloop data in the file, it is a memloop page.
    let page = header.data_pages / 2;
    let at = (header.data_offset + page * header.page_size) as usize;
    bytes[at + 8] ^= 1;
    let index_start = MEMORY_HEADER_LEN as usize;
    let crcs_start = header.page_crc_offset(0) as usize;
    let crc = crc32fast::hash(&bytes[at..at + header.page_size as usize]);
    let crc_at = crcs_start + page as usize * 4;
    bytes[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    // The index CRC covers the page CRCs only in files without FLAG_PAGE_CRCS_CHECKED_ON_LOAD.
    let index_end = if header.flags & FLAG_PAGE_CRCS_CHECKED_ON_LOAD != 0 {
        crcs_start
    } else {
        crcs_start + header.data_pages as usize * 4
    };
    let index_crc = crc32fast::hash(&bytes[index_start..index_end]);
    bytes[120..124].copy_from_slice(&index_crc.to_le_bytes());
    let header_crc = crc32fast::hash(&bytes[..124]);
    bytes[124..128].copy_from_slice(&header_crc.to_le_bytes());
    std::fs::write(&path, bytes).expect("write");

    for mode in ["eager", "lazy"] {
        let out = restore(&good, mode, &[]);
        assert_eq!(out.code(), Some(1), "{mode}: {}", out.describe());
        assert!(
            out.stdout.contains("memloop: FAIL"),
            "{mode}: {}",
            out.describe()
        );
    }
}

// ---- Corrupt and unusable snapshots ----

/// Writes a valid, empty (all-zero) full memory file for a guest of `ram_size` bytes
/// with gpuvm's layout: to build states that are consistent but unusable on this host.
fn write_empty_memory_file(path: &Path, ram_size: u64) {
    // The layout this host gives that much RAM (around the HyperTransport range on AMD).
    let regions =
        gpuvm_arch::x86_64::layout::ram_regions_around(ram_size, gpuvm_tests::host_is_amd());
    let mut metadata = Vec::new();
    for r in &regions {
        metadata.extend_from_slice(&r.guest_addr.to_le_bytes());
        metadata.extend_from_slice(&r.size.to_le_bytes());
        metadata.extend_from_slice(&r.file_offset.to_le_bytes());
    }
    let data_offset = (MEMORY_HEADER_LEN + metadata.len() as u64).div_ceil(4096) * 4096;
    let mut header = vec![0u8; MEMORY_HEADER_LEN as usize];
    header[..8].copy_from_slice(MEMORY_MAGIC);
    header[8..12].copy_from_slice(&1u32.to_le_bytes()); // version
    header[12..16].copy_from_slice(&128u32.to_le_bytes()); // header length
    header[16..20].copy_from_slice(&0u32.to_le_bytes()); // flags: full, no page CRCs
    header[20..24].copy_from_slice(&(regions.len() as u32).to_le_bytes());
    header[24..32].copy_from_slice(&4096u64.to_le_bytes());
    header[32..40].copy_from_slice(&ram_size.to_le_bytes());
    header[40..56].copy_from_slice(&[0x5a; 16]); // snapshot id
                                                 // base id 0, generation 0, 0 extents, 0 data pages
    header[96..104].copy_from_slice(&data_offset.to_le_bytes());
    header[120..124].copy_from_slice(&crc32fast::hash(&metadata).to_le_bytes());
    let crc = crc32fast::hash(&header[..124]);
    header[124..128].copy_from_slice(&crc.to_le_bytes());
    let mut bytes = header;
    bytes.extend_from_slice(&metadata);
    bytes.resize(data_offset as usize, 0);
    std::fs::write(path, bytes).expect("write memory file");
}

/// A `migrated_gpus` list of one GPU whose device state is `state_file` (a forged state:
/// the GPU need not exist, the file is refused first).
fn migrated_gpu(state_file: &str) -> serde_json::Value {
    serde_json::json!([{
        "gpu_id": "gpu0",
        "host_bdf": "0000:00:00.0",
        "slot": 5,
        "vendor_id": 0x10de,
        "device_id": 0x1234,
        "pci": {"bars": [], "memory_enabled": false},
        "state_file": state_file,
        "state_bytes": 100
    }])
}

/// One corruption: what to do to a copy of the good snapshot, which restore mode to
/// use, and a piece of the error gpuvm must print.
struct Corruption {
    name: &'static str,
    corrupt: Box<dyn Fn(&Path)>,
    mode: &'static str,
    error: &'static str,
}

fn edit_state(edit: impl Fn(&mut serde_json::Value) + 'static) -> Box<dyn Fn(&Path)> {
    Box::new(move |dir: &Path| {
        let mut state = read_state(dir);
        edit(&mut state);
        write_state(dir, &state);
    })
}

fn on_memory_file(action: impl Fn(&Path) + 'static) -> Box<dyn Fn(&Path)> {
    Box::new(move |dir: &Path| action(&dir.join(&memory_files(dir)[0])))
}

fn corruptions() -> Vec<Corruption> {
    let case = |name, mode, error, corrupt: Box<dyn Fn(&Path)>| Corruption {
        name,
        corrupt,
        mode,
        error,
    };
    let state_bytes = |edit: fn(&mut Vec<u8>)| -> Box<dyn Fn(&Path)> {
        Box::new(move |dir: &Path| {
            let path = dir.join("state");
            let mut bytes = std::fs::read(&path).expect("read state");
            edit(&mut bytes);
            std::fs::write(&path, bytes).expect("write state");
        })
    };
    vec![
        case(
            "state: wrong magic",
            "lazy",
            "not a gpuvm state file",
            state_bytes(|b| b[0..8].copy_from_slice(b"NOTSTATE")),
        ),
        case(
            "state: unknown version",
            "lazy",
            "version 7",
            state_bytes(|b| b[8..12].copy_from_slice(&7u32.to_le_bytes())),
        ),
        case(
            "state: payload byte flipped",
            "eager",
            "CRC mismatch",
            state_bytes(|b| {
                let at = b.len() / 2;
                b[at] ^= 0x20
            }),
        ),
        case(
            "state: truncated",
            "lazy",
            "truncated",
            state_bytes(|b| b.truncate(b.len() / 2)),
        ),
        case(
            "state: shorter than its header",
            "lazy",
            "not a gpuvm state file",
            state_bytes(|b| b.truncate(10)),
        ),
        case(
            "state: empty",
            "lazy",
            "not a gpuvm state file",
            state_bytes(|b| b.clear()),
        ),
        case(
            "state: trailing garbage",
            "lazy",
            "trailing data",
            state_bytes(|b| b.extend_from_slice(b"xx")),
        ),
        case(
            "state: missing",
            "lazy",
            "cannot read state file",
            Box::new(|dir: &Path| std::fs::remove_file(dir.join("state")).unwrap()),
        ),
        case(
            "state: valid CRC, not JSON",
            "lazy",
            "is corrupt",
            state_bytes(|b| {
                let framed = frame_state(b"{not json");
                *b = framed
            }),
        ),
        case(
            "state: valid CRC, a field missing",
            "lazy",
            "is corrupt",
            edit_state(|s| {
                s["config"].as_object_mut().unwrap().remove("vcpus");
            }),
        ),
        case(
            "memory: truncated",
            "lazy",
            "truncated",
            on_memory_file(|p| {
                let len = std::fs::metadata(p).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(len - 4096 * 3)
                    .unwrap();
            }),
        ),
        case(
            "memory: truncated inside the index",
            "eager",
            "truncated",
            on_memory_file(|p| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(MEMORY_HEADER_LEN + 10)
                    .unwrap();
            }),
        ),
        case(
            "memory: wrong magic",
            "lazy",
            "not a gpuvm memory file",
            on_memory_file(|p| flip_byte(p, 0)),
        ),
        case(
            "memory: header CRC",
            "lazy",
            "header CRC mismatch",
            on_memory_file(|p| flip_byte(p, 33)),
        ),
        case(
            "memory: index CRC",
            "eager",
            "index CRC mismatch",
            on_memory_file(|p| flip_byte(p, MEMORY_HEADER_LEN + 9)),
        ),
        case(
            "memory: data page CRC (eager)",
            "eager",
            "data CRC mismatch",
            on_memory_file(|p| {
                let header = memory_header(p);
                flip_byte(p, header.data_offset + header.page_size * 3 + 17)
            }),
        ),
        case(
            "memory: file missing",
            "lazy",
            "No such file",
            on_memory_file(|p| std::fs::remove_file(p).unwrap()),
        ),
        case(
            "memory: state names no file",
            "lazy",
            "names no memory file",
            edit_state(|s| s["memory_files"] = serde_json::json!([])),
        ),
        case(
            "memory: state names a file outside the directory",
            "lazy",
            "outside the snapshot directory",
            edit_state(|s| s["memory_files"] = serde_json::json!(["../../etc/passwd"])),
        ),
        // Issue 31: every file a state names resolves inside its directory, with no
        // link out, before anything is opened or built.
        case(
            "devices: a GPU's device state file outside the directory",
            "lazy",
            "device state file outside the snapshot directory",
            edit_state(|s| s["migrated_gpus"] = migrated_gpu("/etc/passwd")),
        ),
        case(
            "devices: a GPU's device state file up and out",
            "eager",
            "device state file outside the snapshot directory",
            edit_state(|s| s["migrated_gpus"] = migrated_gpu("../../../../etc/passwd")),
        ),
        case(
            "devices: a GPU's device state file linked out of the directory",
            "lazy",
            "symbolic link",
            Box::new(|dir: &Path| {
                std::os::unix::fs::symlink("/etc/passwd", dir.join("device-1")).unwrap();
                let mut state = read_state(dir);
                state["migrated_gpus"] = migrated_gpu("device-1");
                write_state(dir, &state);
            }),
        ),
        case(
            "memory: the memory file linked to a good copy outside the directory",
            "eager",
            "symbolic link",
            on_memory_file(|p| {
                let outside = p.parent().unwrap().with_extension("memory-outside");
                std::fs::rename(p, &outside).unwrap();
                std::os::unix::fs::symlink(&outside, p).unwrap();
            }),
        ),
        // Issue 31: KVM's structures are read at exactly their size.
        case(
            "vcpu: sregs one byte short",
            "lazy",
            "a kvm_sregs of",
            edit_state(|s| {
                s["vcpus"][0]["sregs"].as_array_mut().unwrap().pop();
            }),
        ),
        case(
            "vcpu: regs one byte long",
            "eager",
            "is corrupt",
            edit_state(|s| {
                s["vcpus"][0]["regs"].as_array_mut().unwrap().push(0.into());
            }),
        ),
        case(
            "config: 0 vCPUs",
            "lazy",
            "0 configured vCPUs",
            edit_state(|s| s["config"]["vcpus"] = 0.into()),
        ),
        case(
            "config: more vCPUs than states",
            "lazy",
            "1 vCPU states for 2 configured",
            edit_state(|s| s["config"]["vcpus"] = 2.into()),
        ),
        case(
            "config: 255 vCPUs with 255 states (more than the host allows)",
            "lazy",
            "invalid vCPU count",
            edit_state(|s| {
                let one = s["vcpus"][0].clone();
                s["vcpus"] = (0..255)
                    .map(|id| {
                        let mut v = one.clone();
                        v["id"] = id.into();
                        v
                    })
                    .collect();
                s["config"]["vcpus"] = 255.into();
            }),
        ),
        case(
            "config: memory size differs from the memory file",
            "lazy",
            "size mismatch",
            edit_state(|s| s["config"]["memory_size"] = (256u64 << 20).into()),
        ),
        case(
            "config: more guest memory than this host can back (64 times its RAM)",
            "lazy",
            "larger than this host",
            Box::new(|dir: &Path| {
                // A sparse guest may be up to 64 times the host's RAM: one GiB more.
                let size = 64 * host_memory_bytes() + (1 << 30);
                write_empty_memory_file(&dir.join("memory-1"), size);
                let mut state = read_state(dir);
                state["config"]["memory_size"] = size.into();
                state["memory_files"] = serde_json::json!(["memory-1"]);
                state["memory_file_id"] = "5a".repeat(16).into();
                write_state(dir, &state);
            }),
        ),
        case(
            "config: huge pages the memory file was not taken with",
            "lazy",
            "page size mismatch",
            edit_state(|s| s["config"]["backing"] = "hugetlb-2m".into()),
        ),
        case(
            "config: unknown backing",
            "lazy",
            "unknown memory backing",
            edit_state(|s| s["config"]["backing"] = "tape".into()),
        ),
        case(
            "config: unknown CPUID mask",
            "lazy",
            "bogus",
            edit_state(|s| s["config"]["cpuid_masks"] = serde_json::json!(["bogus"])),
        ),
        case(
            "external: no handler at the socket",
            "external",
            "page-fault handler",
            Box::new(|_: &Path| {}),
        ),
    ]
}

#[test]
fn corrupt_snapshots_fail_cleanly() {
    let scratch = Scratch::new("snapshot", "corrupt");
    let good = small_snapshot(&scratch);
    let mut failures = Vec::new();
    for (index, case) in corruptions().into_iter().enumerate() {
        let dir = scratch.path(&format!("case-{index}"));
        copy_dir(&good, &dir);
        (case.corrupt)(&dir);
        let socket = scratch.path("no-such-handler.sock");
        let mut args = vec![
            "restore",
            "--snapshot",
            arg(&dir),
            "--restore-mode",
            case.mode,
        ];
        if case.mode == "external" {
            args.extend(["--uffd-socket", arg(&socket)]);
        }
        let started = Instant::now();
        let problem = match SpawnedProcess::gpuvm(&args).wait_timeout(Duration::from_secs(60)) {
            None => Some("hung (killed after 60 s)".to_string()),
            Some(out) => {
                let stderr = out.stderr.to_lowercase();
                if out.status.code().is_none() {
                    Some(format!("killed by a signal: {}", out.describe()))
                } else if out.code() == Some(0) {
                    Some(format!("succeeded: {}", out.describe()))
                } else if stderr.contains("panicked") {
                    Some(format!("panicked: {}", out.describe()))
                } else if !stderr.contains(&case.error.to_lowercase()) {
                    Some(format!("error lacks {:?}: {}", case.error, out.describe()))
                } else if !out.stdout.is_empty() {
                    Some(format!("the guest ran: {}", out.describe()))
                } else {
                    eprintln!(
                        "ok: {} -> {} ({:?})",
                        case.name,
                        out.stderr.trim(),
                        started.elapsed()
                    );
                    None
                }
            }
        };
        if let Some(problem) = problem {
            failures.push(format!("[{}] {problem}", case.name));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // The good snapshot is still good (the corruptions hit copies only).
    let out = restore(&good, "eager", &[]);
    assert_restored_memloop_completes_or_runs(&out);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

fn assert_restored_memloop_completes_or_runs(out: &RunOutput) {
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(out.stdout.contains("memloop: done") && !out.stdout.contains("FAIL"));
}

#[test]
fn missing_snapshot_directory_fails_cleanly() {
    let scratch = Scratch::new("snapshot", "missing");
    for mode in ["eager", "lazy"] {
        let out = restore(&scratch.path("nothing-here"), mode, &[]);
        out.assert_clean_error("no such snapshot directory");
        assert!(out.stdout.is_empty(), "{}", out.describe());
    }
}

/// A data page whose CRC does not match, found only while the guest runs (lazy restore
/// checks pages as it loads them), must end gpuvm with an error, not leave the guest
/// waiting forever for a page that will never come.
#[test]
fn lazy_restore_of_a_corrupt_page_fails_cleanly() {
    let scratch = Scratch::new("snapshot", "corrupt-lazy");
    let good = small_snapshot(&scratch);
    // A byte of a page's data, or of its CRC (read only when the page loads, so the
    // restore has started before either is found).
    for damage in ["data", "crc"] {
        let dir = scratch.path(damage);
        copy_dir(&good, &dir);
        let file = dir.join(&memory_files(&dir)[0]);
        let header = memory_header(&file);
        let page = header.data_pages / 2;
        flip_byte(
            &file,
            match damage {
                "data" => header.data_offset + header.page_size * page + 5,
                _ => header.page_crc_offset(page) + 2,
            },
        );
        let run =
            SpawnedProcess::gpuvm(&["restore", "--snapshot", arg(&dir), "--restore-mode", "lazy"]);
        let out = run
            .wait_timeout(Duration::from_secs(60))
            .expect("gpuvm hung after the lazy loader found a corrupt page");
        out.assert_clean_error("data CRC mismatch");
    }
}

/// The memory file changes after restore validated it (the test hook holds gpuvm right
/// after validation): truncated, or a data byte flipped. Lazy restore finds out only
/// while the guest runs; gpuvm must then stop with the loader's error, promptly, and the
/// guest must never run on missing or wrong data (memloop would print FAIL). Eager
/// restore reads everything before the guest runs, so it fails before any vCPU starts.
#[test]
fn memory_file_changed_after_validation_fails_cleanly() {
    use std::os::unix::fs::FileExt;
    let scratch = Scratch::new("snapshot", "changed-after-validation");
    let good = small_snapshot(&scratch);
    let truncate = |file: &Path| {
        let header = memory_header(file);
        let keep = header.data_offset + header.page_size * (header.data_pages / 2);
        std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .and_then(|f| f.set_len(keep))
            .expect("truncate");
    };
    let flip = |file: &Path| {
        let header = memory_header(file);
        let at = header.data_offset + header.page_size * (header.data_pages / 2) + 9;
        flip_byte(file, at);
    };
    let garbage = |file: &Path| {
        // A whole page of different data.
        let header = memory_header(file);
        let at = header.data_offset + header.page_size * (header.data_pages * 3 / 4);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .expect("open");
        f.write_all_at(&vec![0x5au8; header.page_size as usize], at)
            .expect("write");
    };
    type Change = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, &str, Change, &str)> = vec![
        (
            "lazy-truncated",
            "lazy",
            Box::new(truncate),
            "read page data",
        ),
        ("lazy-flipped", "lazy", Box::new(flip), "data CRC mismatch"),
        (
            "lazy-rewritten",
            "lazy",
            Box::new(garbage),
            "data CRC mismatch",
        ),
        (
            "eager-truncated",
            "eager",
            Box::new(truncate),
            "read page data",
        ),
    ];
    for (name, mode, change, needle) in cases {
        let dir = scratch.path(name);
        copy_dir(&good, &dir);
        let file = dir.join(&memory_files(&dir)[0]);
        let mut run = SpawnedProcess::gpuvm_with_env(
            &["restore", "--snapshot", arg(&dir), "--restore-mode", mode],
            &[("GPUVM_TEST_HOLD_AFTER_VALIDATION", "1500")],
        );
        run.wait_for_stderr("holding", Duration::from_secs(30));
        change(&file);
        let out = run
            .wait_timeout(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("{name}: gpuvm hung after the memory file changed"));
        assert!(
            out.stderr.contains("going on"),
            "{name}: changed too late: {}",
            out.describe()
        );
        out.assert_clean_error(needle);
        assert!(!out.stdout.contains("FAIL"), "{name}: {}", out.describe());
        assert!(
            !out.stdout.contains("memloop: done"),
            "{name}: {}",
            out.describe()
        );
        if mode == "eager" {
            assert!(
                !out.stdout.contains("memloop: iter"),
                "{name}: the guest ran: {}",
                out.describe()
            );
        }
    }
}

/// The host's RAM (MemTotal), bytes.
fn host_memory_bytes() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .expect("MemTotal in /proc/meminfo");
    kib << 10
}

// ---- Damaged PCIe ports ----

/// A snapshot of a memloop VM with two root ports for hot-plug (`--pcie-root-ports 2`),
/// in `scratch`'s `ports` directory.
fn snapshot_with_root_ports(scratch: &Scratch) -> std::path::PathBuf {
    use gpuvm_tests::snapshot_support::{signal_snapshot, Memloop};
    let dir = scratch.path("ports");
    let guest = Memloop {
        memory: "128M",
        size: "32M",
        vcpus: 1,
        iters: 150,
        backing: "memfd",
        seed: 3,
    };
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut args = guest.args(&cmdline, &vcpus);
    args.extend(["--pcie-root-ports", "2"]);
    args.extend(["--snapshot-dir", arg(&dir), "--snapshot-then", "exit"]);
    let mut run = SpawnedProcess::gpuvm(&args);
    run.wait_for_stdout("memloop: iter 1 ok", Duration::from_secs(120));
    signal_snapshot(run.pid());
    let out = run.wait(Duration::from_secs(120));
    assert_eq!(out.code(), Some(0), "snapshot run: {}", out.describe());
    dir
}

/// Sets `bytes` at `offset` of a saved port's registers (a JSON port with `registers`).
fn set_register(port: &mut serde_json::Value, offset: usize, bytes: &[u8]) {
    for (i, byte) in bytes.iter().enumerate() {
        port["registers"]["config"][offset + i] = (*byte).into();
    }
}

#[test]
fn damaged_or_hostile_pcie_ports_are_refused_naming_the_port() {
    let scratch = Scratch::new("snapshot", "ports");
    let good = snapshot_with_root_ports(&scratch);
    let state = read_state(&good);
    let ports = state["pcie_root_ports"].as_array().expect("the root ports");
    assert_eq!(ports.len(), 2, "{state}");
    let slot = |i: usize| ports[i]["slot"].as_u64().expect("slot");
    let first = format!("root port for hot-plug 00:{:02x}.0", slot(0));
    let second = format!("root port for hot-plug 00:{:02x}.0", slot(1));
    let wide = ports[0]["prefetchable"].clone();
    let bus = |i: usize| ports[i]["registers"]["config"][0x19].as_u64().expect("bus");
    let (bus0, bus1) = (bus(0), bus(1));
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, Vec<String>)> = vec![
        (
            "two ports hold one range of the 64-bit window",
            Box::new(move |s| s["pcie_root_ports"][1]["prefetchable"] = wide.clone()),
            vec![second.clone(), "overlaps".into()],
        ),
        (
            "two ports forward the same bus",
            Box::new(move |s| {
                set_register(
                    &mut s["pcie_root_ports"][1],
                    0x19,
                    &[bus0 as u8, bus0 as u8],
                )
            }),
            vec![
                second.clone(),
                format!("buses {bus0:#04x}..={bus0:#04x} overlap"),
            ],
        ),
        (
            "a port's prefetchable window far outside the segment's",
            // Base and limit's upper halves: 0x40_0000_0000_0000 and up.
            Box::new(|s| {
                let port = &mut s["pcie_root_ports"][0];
                set_register(port, 0x28, &0x40_0000u32.to_le_bytes());
                set_register(port, 0x2c, &0x40_0000u32.to_le_bytes());
            }),
            vec![
                first.clone(),
                "prefetchable window 0x40000".into(),
                "outside the segment's windows".into(),
            ],
        ),
        (
            "a switch port behind a root port the snapshot does not have",
            Box::new(move |s| {
                let mut port = s["pcie_root_ports"][0]["registers"].clone();
                port["kind"] = "SwitchUpstream".into();
                s["pci_topology_ports"] = serde_json::json!([{"path": [9, 0], "registers": port}]);
            }),
            vec![
                "switch upstream port at [9, 0]".into(),
                "no saved port leads to it".into(),
            ],
        ),
        (
            "a topology root port with a hot-plug slot's registers",
            Box::new(move |s| {
                let port = s["pcie_root_ports"][1]["registers"].clone();
                s["pci_topology_ports"] = serde_json::json!([{"path": [20], "registers": port}]);
            }),
            vec![
                "root port 00:14.0".into(),
                "registers are a hot-plug slot's".into(),
            ],
        ),
    ];
    assert_ne!(bus0, bus1);
    let mut failures = Vec::new();
    for (index, (name, edit, expected)) in cases.into_iter().enumerate() {
        let dir = scratch.path(&format!("ports-{index}"));
        copy_dir(&good, &dir);
        let mut damaged = read_state(&dir);
        edit(&mut damaged);
        write_state(&dir, &damaged);
        let out = restore(&dir, "eager", &[]);
        let stderr = out.stderr.to_lowercase();
        let problem = if out.code() == Some(0) || out.status.code().is_none() {
            Some(format!("not refused: {}", out.describe()))
        } else if stderr.contains("panicked") {
            Some(format!("panicked: {}", out.describe()))
        } else if let Some(missing) =
            (expected.iter()).find(|e| !stderr.contains(&e.to_lowercase()))
        {
            Some(format!("error lacks {missing:?}: {}", out.describe()))
        } else if !out.stdout.is_empty() {
            Some(format!("the guest ran: {}", out.describe()))
        } else {
            None
        };
        if let Some(problem) = problem {
            failures.push(format!("[{name}] {problem}"));
        }
    }
    // The good snapshot still restores (the damage hit copies only).
    let out = restore(&good, "eager", &[]);
    assert_restored_memloop_completes_or_runs(&out);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
