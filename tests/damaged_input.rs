//! Input files that are not what they claim to be: FIFOs, devices and endless or huge
//! files given as a snapshot's state or memory file, a kernel, an initrd or a config
//! file; memory files and states of another snapshot; memory files with bytes appended.
//! Every outcome must be a clean error naming the file, within a time limit, with gpuvm's
//! memory bounded (each gpuvm here runs under a 4 GiB address-space limit, so that a
//! build reading endlessly fails instead of exhausting the host), and never a guest
//! that runs on memory that is not its own.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use gpuvm_tests::{
    gpuvm_bin, socket_path, wait_for_api_socket, RunOutput, Scratch, SpawnedProcess,
};

/// How long a refusal may take (a restore that blocks in open(2) never ends).
const REFUSAL_LIMIT: Duration = Duration::from_secs(60);
/// How long a snapshot or a restored guest may take.
const RUN_LIMIT: Duration = Duration::from_secs(240);
/// Address-space limit for gpuvm in these tests, in KiB.
const ADDRESS_SPACE_KIB: u64 = 4 << 20;
/// memloop iterations: enough that the guest is still running when it is snapshotted
/// after iteration 1.
const ITERS: u64 = 60;
const STATE_MAGIC: &[u8; 8] = b"GPUVMSTA";
const STATE_HEADER_LEN: usize = 24;

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// Starts `gpuvm ARGS` with its address space limited to [`ADDRESS_SPACE_KIB`].
fn gpuvm_bounded(args: &[&str]) -> SpawnedProcess {
    let bin = gpuvm_bin();
    let script = format!("ulimit -v {ADDRESS_SPACE_KIB} && exec \"$0\" \"$@\"");
    let mut sh_args = vec!["-c", script.as_str(), arg(&bin)];
    sh_args.extend_from_slice(args);
    SpawnedProcess::spawn(Path::new("/bin/sh"), &sh_args)
}

/// Runs `gpuvm ARGS` (bounded) and requires a clean refusal: a non-zero exit status (not
/// a signal: no crash, no abort on a failed allocation) within [`REFUSAL_LIMIT`], no
/// panic, nothing from a guest on stdout, and every one of `needles` in the error.
fn assert_refused(args: &[&str], needles: &[&str]) -> RunOutput {
    let out = gpuvm_bounded(args)
        .wait_timeout(REFUSAL_LIMIT)
        .unwrap_or_else(|| panic!("gpuvm {args:?} hung (killed after {REFUSAL_LIMIT:?})"));
    assert!(
        out.code().is_some_and(|c| c != 0),
        "gpuvm {args:?} did not fail cleanly: {}",
        out.describe()
    );
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    assert!(
        out.stdout.is_empty(),
        "a guest ran: gpuvm {args:?}: {}",
        out.describe()
    );
    for needle in needles {
        assert!(
            out.stderr.contains(needle),
            "the error lacks {needle:?}: gpuvm {args:?}: {}",
            out.describe()
        );
    }
    out
}

fn restore_args<'a>(dir: &'a Path, mode: &'a str) -> Vec<&'a str> {
    vec!["restore", "--snapshot", arg(dir), "--restore-mode", mode]
}

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let name = std::ffi::CString::new(arg(path)).expect("no NUL");
    // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
    let ret = unsafe { libc::mkfifo(name.as_ptr(), 0o600) };
    assert_eq!(
        ret,
        0,
        "mkfifo {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("list").flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

// ---- The state file, decoded from its documentation (vmm/src/persist.rs) ----

fn read_state(dir: &Path) -> serde_json::Value {
    let bytes = std::fs::read(dir.join("state")).expect("read state");
    assert_eq!(&bytes[..8], STATE_MAGIC, "state magic");
    serde_json::from_slice(&bytes[STATE_HEADER_LEN..]).expect("state payload is JSON")
}

fn write_state(dir: &Path, state: &serde_json::Value) {
    let payload = serde_json::to_vec(state).expect("encode state");
    let mut bytes = STATE_MAGIC.to_vec();
    // The state format version gpuvm writes (vmm/src/persist.rs STATE_FORMAT_VERSION).
    bytes.extend_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    std::fs::write(dir.join("state"), bytes).expect("write state");
}

/// The one memory file the state of a snapshot taken without dirty tracking names.
fn memory_file(dir: &Path) -> PathBuf {
    let state = read_state(dir);
    let files = state["memory_files"].as_array().expect("memory_files");
    assert_eq!(files.len(), 1, "{files:?}");
    dir.join(files[0].as_str().expect("file name"))
}

// ---- Two snapshots of memloop guests with different seeds, taken once per process ----

struct Snapshots {
    root: PathBuf,
    a: PathBuf,
    b: PathBuf,
}

static SNAPSHOTS: OnceLock<Snapshots> = OnceLock::new();

extern "C" fn remove_snapshots() {
    if let Some(snapshots) = SNAPSHOTS.get() {
        let _ = std::fs::remove_dir_all(&snapshots.root);
    }
}

/// Snapshots A (seed 1) and B (seed 2), for tests to copy (never to change).
fn snapshots() -> &'static Snapshots {
    SNAPSHOTS.get_or_init(|| {
        let root = std::env::temp_dir().join(format!(
            "gpuvm-damaged_input-snapshots-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        // gpuvm creates only the last component of a snapshot directory.
        std::fs::create_dir_all(&root).expect("mkdir");
        // SAFETY: registers a plain function without captures to run at exit.
        unsafe { libc::atexit(remove_snapshots) };
        let (a, b) = (root.join("a"), root.join("b"));
        std::thread::scope(|s| {
            s.spawn(|| snapshot_memloop(&a, 1));
            s.spawn(|| snapshot_memloop(&b, 2));
        });
        Snapshots { root, a, b }
    })
}

/// Runs memloop with `seed` and snapshots it into `dir` (SIGUSR1, then exit) after its
/// first iteration.
fn snapshot_memloop(dir: &Path, seed: u64) {
    let cmdline = format!("memloop 8M {seed} {ITERS}");
    let mut run = SpawnedProcess::gpuvm(&[
        "run",
        "--memory",
        "64M",
        "--cmdline",
        &cmdline,
        "--snapshot-dir",
        arg(dir),
        "--snapshot-then",
        "exit",
    ]);
    run.wait_for_stdout("memloop: iter 1 ok", RUN_LIMIT);
    run.signal(libc::SIGUSR1);
    let out = run.wait(RUN_LIMIT);
    assert_eq!(out.code(), Some(0), "snapshot run: {}", out.describe());
    assert!(
        !out.stdout.contains("memloop: done"),
        "the guest ended before its snapshot: {}",
        out.describe()
    );
    memory_file(dir);
}

/// A copy of snapshot `from` in `scratch`, to damage.
fn copy_of(scratch: &Scratch, from: &Path, name: &str) -> PathBuf {
    let dir = scratch.path(name);
    copy_dir(from, &dir);
    dir
}

// ---- FIFOs, devices, endless and huge files ----

#[test]
fn a_fifo_state_file_is_refused() {
    let scratch = Scratch::new("damaged_input", "fifo-state");
    let dir = scratch.path("snap");
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    mkfifo(&state);
    for mode in ["eager", "lazy"] {
        assert_refused(
            &restore_args(&dir, mode),
            &[arg(&state), "not a regular file"],
        );
    }
}

#[test]
fn a_state_file_linked_to_dev_zero_is_refused() {
    let scratch = Scratch::new("damaged_input", "zero-state");
    let dir = scratch.path("snap");
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    std::os::unix::fs::symlink("/dev/zero", &state).unwrap();
    assert_refused(
        &restore_args(&dir, "lazy"),
        &[arg(&state), "not a regular file"],
    );
}

#[test]
fn a_huge_sparse_state_file_is_refused_unread() {
    let scratch = Scratch::new("damaged_input", "sparse-state");
    let dir = scratch.path("snap");
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state");
    let file = std::fs::File::create(&state).unwrap();
    // A valid header first, so only the size tells it apart.
    let mut header = STATE_MAGIC.to_vec();
    header.extend_from_slice(&1u32.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&((6u64 << 30) - STATE_HEADER_LEN as u64).to_le_bytes());
    (&file).write_all(&header).unwrap();
    file.set_len(6 << 30).unwrap();
    assert_refused(&restore_args(&dir, "eager"), &[arg(&state), "too large"]);
}

#[test]
fn a_fifo_memory_file_is_refused() {
    let scratch = Scratch::new("damaged_input", "fifo-memory");
    let dir = copy_of(&scratch, &snapshots().a, "snap");
    let memory = memory_file(&dir);
    mkfifo(&memory);
    for mode in ["eager", "lazy"] {
        assert_refused(
            &restore_args(&dir, mode),
            &[arg(&memory), "not a regular file"],
        );
    }
}

/// Issue 31, item 8: an ELF kernel whose identification says 32-bit (or another
/// machine) is refused, naming what is wrong, instead of being read as a 64-bit one.
#[test]
fn an_elf_kernel_that_is_not_64_bit_x86_64_is_refused() {
    let scratch = Scratch::new("damaged_input", "elf-class");
    let kernel = scratch.path("guest.elf");
    let out = gpuvm_bounded(&["guest-image", "--output", arg(&kernel)])
        .wait_timeout(REFUSAL_LIMIT)
        .expect("guest-image");
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let good = std::fs::read(&kernel).unwrap();
    for (at, value, needle) in [(4, 1u8, "says 32-bit"), (18, 3, "e_machine")] {
        let mut bad = good.clone();
        bad[at] = value;
        let path = scratch.path(&format!("bad-{at}.elf"));
        std::fs::write(&path, bad).unwrap();
        assert_refused(
            &["run", "--memory", "64M", "--kernel", arg(&path)],
            &[arg(&path), needle],
        );
    }
}

/// Issue 31, item 7: a drive image of 1 to 511 bytes is not a disk image, refused on the
/// command line as through every API (an empty file is a placeholder disk of 0 sectors).
#[test]
fn a_drive_image_smaller_than_a_sector_is_refused() {
    let scratch = Scratch::new("damaged_input", "tiny-drive");
    let tiny = scratch.path("tiny.img");
    std::fs::write(&tiny, [1u8; 100]).unwrap();
    let drive = format!("drive_id=root,path={}", arg(&tiny));
    assert_refused(
        &["run", "--memory", "64M", "--drive", &drive],
        &[arg(&tiny), "less than one sector", "not a disk image"],
    );
}

#[test]
fn a_fifo_kernel_or_initrd_is_refused() {
    let scratch = Scratch::new("damaged_input", "fifo-kernel");
    let fifo = scratch.path("fifo");
    mkfifo(&fifo);
    assert_refused(
        &["run", "--memory", "64M", "--kernel", arg(&fifo)],
        &["kernel image", arg(&fifo), "not a regular file"],
    );
    assert_refused(
        &["run", "--memory", "64M", "--initrd", arg(&fifo)],
        &["initrd", arg(&fifo), "not a regular file"],
    );
    // A kernel image larger than guest RAM cannot be one: refused before it is read.
    let big = scratch.path("big-kernel");
    let file = std::fs::File::create(&big).unwrap();
    (&file).write_all(b"\x7fELF").unwrap();
    file.set_len(128 << 20).unwrap();
    assert_refused(
        &["run", "--memory", "64M", "--kernel", arg(&big)],
        &["kernel image", arg(&big), "larger than guest RAM"],
    );
}

#[test]
fn a_config_file_on_dev_zero_or_a_fifo_is_refused() {
    let scratch = Scratch::new("damaged_input", "config");
    let fifo = scratch.path("fifo");
    mkfifo(&fifo);
    let socket = socket_path("damaged_input", "config");
    for config in [Path::new("/dev/zero"), fifo.as_path()] {
        assert_refused(
            &[
                "run",
                "--api-sock",
                arg(&socket),
                "--config-file",
                arg(config),
            ],
            &["config file", arg(config), "not a regular file"],
        );
    }
    // A regular file too large to be a configuration is refused unread.
    let big = scratch.path("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    assert_refused(
        &[
            "run",
            "--api-sock",
            arg(&socket),
            "--config-file",
            arg(&big),
        ],
        &["config file", arg(&big), "too large"],
    );
}

/// One API request with a time limit of its own (the client's is minutes long).
fn bounded_request(socket: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (socket, method, path, body) = (
        socket.to_path_buf(),
        method.to_string(),
        path.to_string(),
        body.map(String::from),
    );
    let (tx, rx) = mpsc::channel();
    let what = format!("{method} {path}");
    std::thread::spawn(move || {
        let _ = tx.send(gpuvm_api::client::request(
            &socket,
            &method,
            &path,
            body.as_deref(),
        ));
    });
    let response = rx
        .recv_timeout(REFUSAL_LIMIT)
        .unwrap_or_else(|_| panic!("{what}: no answer within {REFUSAL_LIMIT:?}"))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    (response.status, response.message())
}

#[test]
fn snapshot_load_of_fifos_fails_and_the_api_still_answers() {
    let scratch = Scratch::new("damaged_input", "api-fifo");
    let fifo_state = scratch.path("fifo-state");
    std::fs::create_dir_all(&fifo_state).unwrap();
    mkfifo(&fifo_state.join("state"));
    let fifo_memory = copy_of(&scratch, &snapshots().a, "fifo-memory");
    let memory = memory_file(&fifo_memory);
    mkfifo(&memory);

    let socket = socket_path("damaged_input", "api-fifo");
    let mut vmm = gpuvm_bounded(&["run", "--api-sock", arg(&socket)]);
    wait_for_api_socket(&mut vmm, &socket);
    for (dir, named) in [
        (&fifo_state, fifo_state.join("state")),
        (&fifo_memory, memory.clone()),
    ] {
        let body = serde_json::json!({"snapshot_path": dir, "restore_mode": "Lazy"}).to_string();
        let (status, message) = bounded_request(&socket, "PUT", "/snapshot/load", Some(&body));
        assert_eq!(status, 400, "{message}");
        assert!(
            message.contains(arg(&named)) && message.contains("not a regular file"),
            "{message}"
        );
        let (status, message) = bounded_request(&socket, "GET", "/", None);
        assert_eq!(status, 200, "{message}");
    }
    assert!(vmm.try_status().is_none(), "gpuvm ended: {}", vmm.stderr());
}

// ---- Memory files and states of another snapshot ----

/// Restores `dir` in every mode and requires each to refuse it before the guest runs,
/// naming `file` as belonging to another snapshot.
fn assert_foreign_refused_in_every_mode(scratch: &Scratch, dir: &Path, file: &Path) {
    let socket = scratch.path("no-handler.sock");
    for mode in ["eager", "lazy", "external"] {
        let mut args = restore_args(dir, mode);
        if mode == "external" {
            // Validation comes before the handshake: no handler is needed to be refused.
            args.extend(["--uffd-socket", arg(&socket)]);
        }
        assert_refused(&args, &[arg(file), "another snapshot"]);
    }
}

#[test]
fn a_memory_file_of_another_snapshot_is_refused() {
    let scratch = Scratch::new("damaged_input", "swapped-memory");
    let dir = copy_of(&scratch, &snapshots().a, "snap");
    let memory = memory_file(&dir);
    std::fs::copy(memory_file(&snapshots().b), &memory).unwrap();
    assert_foreign_refused_in_every_mode(&scratch, &dir, &memory);
}

#[test]
fn a_state_of_another_snapshot_is_refused() {
    let scratch = Scratch::new("damaged_input", "swapped-state");
    let dir = copy_of(&scratch, &snapshots().a, "snap");
    // B's state over A's, with A's memory file renamed to the name B's state gives.
    let a_memory = memory_file(&dir);
    std::fs::copy(snapshots().b.join("state"), dir.join("state")).unwrap();
    let named = memory_file(&dir);
    std::fs::rename(&a_memory, &named).unwrap();
    assert_foreign_refused_in_every_mode(&scratch, &dir, &named);
}

#[test]
fn a_state_written_before_memory_file_ids_still_restores() {
    let scratch = Scratch::new("damaged_input", "old-state");
    let dir = copy_of(&scratch, &snapshots().a, "snap");
    let mut state = read_state(&dir);
    let fields = state.as_object_mut().expect("state is an object");
    assert!(
        fields.remove("memory_file_id").is_some(),
        "this build's state has no memory_file_id: {:?}",
        fields.keys().collect::<Vec<_>>()
    );
    write_state(&dir, &state);
    let out = gpuvm_bounded(&restore_args(&dir, "lazy")).wait(RUN_LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(
        out.stdout.contains("memloop: done") && !out.stdout.contains("FAIL"),
        "{}",
        out.describe()
    );
    assert!(
        out.stderr.contains("no memory-file id"),
        "no warning about the unbound memory files: {}",
        out.describe()
    );
}

/// The memory files the state in `dir` names.
fn chain_files(dir: &Path) -> Vec<String> {
    read_state(dir)["memory_files"]
        .as_array()
        .expect("memory_files")
        .iter()
        .map(|f| f.as_str().expect("file name").to_string())
        .collect()
}

fn wait_for_chain(run: &mut SpawnedProcess, dir: &Path, count: usize) {
    run.wait_until(&format!("a chain of {count} files"), RUN_LIMIT, |_| {
        dir.join("state").exists() && chain_files(dir).len() == count
    });
}

/// A diff taken from another restore of the same base has the same base id and
/// generation as the chain's own diff: only the state's binding tells them apart.
#[test]
fn a_diff_of_another_restore_of_the_same_base_is_refused() {
    let scratch = Scratch::new("damaged_input", "twin-diff");
    let (chain, base_only) = (scratch.path("chain"), scratch.path("base-only"));
    let mut run = SpawnedProcess::gpuvm(&[
        "run",
        "--memory",
        "64M",
        "--cmdline",
        "memloop 8M 3 1000000",
        "--track-dirty-pages",
        "--snapshot-dir",
        arg(&chain),
        "--snapshot-then",
        "resume",
    ]);
    run.wait_for_stdout("memloop: iter 1 ok", RUN_LIMIT);
    run.signal(libc::SIGUSR1);
    wait_for_chain(&mut run, &chain, 1);
    copy_dir(&chain, &base_only);
    run.signal(libc::SIGUSR1);
    wait_for_chain(&mut run, &chain, 2);
    run.signal(libc::SIGKILL);
    drop(run);

    // Restore the base alone and take a diff of it: [base, twin].
    let out = gpuvm_bounded(&[
        "restore",
        "--snapshot",
        arg(&base_only),
        "--restore-mode",
        "lazy",
        "--snapshot-dir",
        arg(&base_only),
        "--snapshot-after-ms",
        "200",
        "--snapshot-then",
        "exit",
    ])
    .wait(RUN_LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let twin = chain_files(&base_only);
    assert_eq!(twin.len(), 2, "{twin:?}");
    let ours = chain_files(&chain);
    assert_eq!(ours[0], twin[0], "both chains share the base");

    let diff = chain.join(&ours[1]);
    std::fs::copy(base_only.join(&twin[1]), &diff).unwrap();
    assert_foreign_refused_in_every_mode(&scratch, &chain, &diff);
}

/// `--snapshot-then exit` after a timer snapshot that fails (its directory's `state` is a
/// directory, which the snapshot's commit cannot replace) ends with gpuvm's error status and
/// the reason, not with 0 as if the snapshot had been written.
#[test]
fn a_failed_snapshot_then_exit_is_an_error() {
    let scratch = Scratch::new("damaged_input", "snapshot-then-exit");
    let dir = scratch.path("snap");
    std::fs::create_dir_all(dir.join("state")).unwrap();
    let out = gpuvm_bounded(&[
        "run",
        "--memory",
        "64M",
        "--cmdline",
        "memloop 8M 3 1000000",
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-after-ms",
        "200",
        "--snapshot-then",
        "exit",
    ])
    .wait(RUN_LIMIT);
    assert_eq!(out.code(), Some(125), "{}", out.describe());
    assert!(out.stderr.contains("gpuvm: error:"), "{}", out.describe());
    assert!(
        dir.join("state").is_dir(),
        "the directory was left as it was"
    );
}

// ---- Memory files longer than their data ----

#[test]
fn a_memory_file_with_bytes_appended_is_refused() {
    let scratch = Scratch::new("damaged_input", "appended");
    for (name, extra) in [("one-byte", 1usize), ("a-page", 4096)] {
        let dir = copy_of(&scratch, &snapshots().a, name);
        let memory = memory_file(&dir);
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&memory)
            .unwrap();
        file.write_all(&vec![0x5a; extra]).unwrap();
        for mode in ["eager", "lazy"] {
            assert_refused(
                &restore_args(&dir, mode),
                &[arg(&memory), "after the end of the page data"],
            );
        }
    }
    // The snapshot as written restores.
    let out = gpuvm_bounded(&restore_args(&snapshots().a, "eager")).wait(RUN_LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(
        out.stdout.contains("memloop: done") && !out.stdout.contains("FAIL"),
        "{}",
        out.describe()
    );
}
