//! Bounded mutation fuzzing of every input gpuvm takes from outside (issue 31): a snapshot's
//! state file, a GPU snapshot's device-state file, memory files (gpuvm's own format, and
//! Firecracker's raw image with the page CRC table gpuvm keeps beside it) and the API
//! bodies of all three front ends. Each test mutates real inputs (made by the test from the
//! test guest) with a fixed seed and a bounded budget, and judges every outcome:
//!
//! - a clean error: gpuvm's error status and one `gpuvm: error:` line (an API: a 4xx with
//!   a message), never a panic, a signal, a hang or a dropped connection;
//! - or a load whose guest runs on exactly as the undamaged input's does (the same memloop
//!   iterations and checksums, no FAIL);
//! - for forged state and device-state *values* (a well-framed file whose JSON was edited,
//!   as an attacker would), also a guest that runs differently, as long as gpuvm itself is
//!   healthy: it finished the restore and runs, or ended with a status it documents.
//!
//! Budget, from the environment: `GPUVM_FUZZ_CASES` (cases per test), `GPUVM_FUZZ_SECONDS`
//! (wall-clock seconds per test, after its setup) and `GPUVM_FUZZ_SEED` (to explore other
//! mutations; each test has its own fixed default). Each test prints its seed and the cases
//! it ran; a failing case is named by its number, seed and mutation, so it can be replayed.
//! Seccomp is on throughout (the default).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::snapshot_support::{frame_state, read_state, write_state};
use gpuvm_tests::{
    api_expect, gpuvm_bin, run_gpuvm, start_firecracker, wait_for_api_socket, Scratch,
    SpawnedProcess,
};
use gpuvm_vmm::exit_status::{GPUVM_ERROR, TRIPLE_FAULT};
use serde_json::Value;

/// How long a restore or load may take to fail or to show its guest running on.
const RESTORE_LIMIT: Duration = Duration::from_secs(10);
/// How long the undamaged input's reference run may take (a slow, busy host).
const REFERENCE_LIMIT: Duration = Duration::from_secs(60);
/// Iterations a restored memloop must complete after the first one it prints: the second
/// checks every page the first wrote.
const VERIFIED_ITERATIONS: u64 = 2;

// ---- The deterministic mutator. ----

/// splitmix64: a tiny, deterministic PRNG; its sequence is the test's replay record.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// One test's budget: a fixed seed, a number of cases and a wall-clock limit.
struct Budget {
    test: &'static str,
    seed: u64,
    cases: usize,
    seconds: u64,
    until: Instant,
}

impl Budget {
    fn new(test: &'static str, seed: u64, default_cases: usize, default_seconds: u64) -> Budget {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let seed = env("GPUVM_FUZZ_SEED")
            .and_then(|v| parse_seed(&v))
            .unwrap_or(seed);
        let cases = env("GPUVM_FUZZ_CASES")
            .and_then(|v| v.parse().ok())
            .unwrap_or(default_cases);
        let seconds = env("GPUVM_FUZZ_SECONDS")
            .and_then(|v| v.parse().ok())
            .unwrap_or(default_seconds);
        eprintln!("{test}: seed {seed:#x}, up to {cases} cases in {seconds} s");
        Budget {
            test,
            seed,
            cases,
            seconds,
            until: Instant::now() + Duration::from_secs(seconds),
        }
    }

    /// Whether case number `case` (from 0) may run.
    fn allows(&self, case: usize) -> bool {
        case < self.cases && Instant::now() < self.until
    }

    /// Reports the run and fails with every bad outcome; a budget that ran out before a few
    /// cases is a failure too (the test must not pass having tried nothing).
    fn finish(&self, ran: usize, tally: &Tally, bad: &[String]) {
        eprintln!(
            "{}: seed {:#x}: {ran} cases in <= {} s: {} clean errors, {} verified, {} ran differently (forged values), {} bad",
            self.test,
            self.seed,
            self.seconds,
            tally.clean,
            tally.verified,
            tally.diverged,
            bad.len()
        );
        assert!(
            bad.is_empty(),
            "{}: seed {:#x}: {} bad outcomes:\n\n{}",
            self.test,
            self.seed,
            bad.len(),
            bad.join("\n\n")
        );
        assert!(
            ran >= self.cases.min(3),
            "{}: only {ran} cases ran within {} s",
            self.test,
            self.seconds
        );
    }
}

fn parse_seed(text: &str) -> Option<u64> {
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16).ok(),
        None => text.parse().ok(),
    }
}

#[derive(Default)]
struct Tally {
    clean: usize,
    verified: usize,
    diverged: usize,
}

/// Byte-level damage to `bytes`: bit flips (aimed at the first 4 KiB half of the time,
/// where headers are), a run overwritten, a cut, bytes inserted or a slice repeated.
fn mutate_bytes(bytes: &mut Vec<u8>, rng: &mut Rng) -> String {
    if bytes.is_empty() {
        bytes.push(rng.next() as u8);
        return "one byte into an empty file".into();
    }
    let len = bytes.len() as u64;
    let offset = |rng: &mut Rng| match rng.below(2) {
        0 => rng.below(len.min(4096)),
        _ => rng.below(len),
    } as usize;
    match rng.below(6) {
        0 => {
            let mut flipped = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let (at, bit) = (offset(rng), rng.below(8));
                bytes[at] ^= 1 << bit;
                flipped.push(format!("{at}.{bit}"));
            }
            format!("flipped bits {} of {len}", flipped.join(","))
        }
        1 => {
            let at = offset(rng);
            let run = (1 + rng.below(64) as usize).min(bytes.len() - at);
            let fill = *rng.pick(&[0x00u8, 0xff, 0x7f, 0x80]);
            bytes[at..at + run].fill(fill);
            format!("{run} bytes at {at} set to {fill:#x}")
        }
        2 => {
            let cut = rng.below(len) as usize;
            bytes.truncate(cut);
            format!("cut to {cut} of {len} bytes")
        }
        3 => {
            let at = offset(rng);
            let extra: Vec<u8> = (0..1 + rng.below(32)).map(|_| rng.next() as u8).collect();
            let count = extra.len();
            bytes.splice(at..at, extra);
            format!("{count} random bytes inserted at {at}")
        }
        4 => {
            let at = offset(rng);
            let run = (1 + rng.below(256) as usize).min(bytes.len() - at);
            let copy = bytes[at..at + run].to_vec();
            bytes.splice(at..at, copy);
            format!("{run} bytes at {at} repeated")
        }
        _ => {
            // A number in JSON text made huge (where there is one).
            let digits: Vec<usize> = (0..bytes.len())
                .filter(|&i| bytes[i].is_ascii_digit())
                .collect();
            if digits.is_empty() {
                bytes.push(b'9');
                return "a digit appended".into();
            }
            let at = *rng.pick(&digits);
            bytes.splice(at..at, b"99999999999999999999".iter().copied());
            format!("20 nines inserted before the digit at {at}")
        }
    }
}

/// The JSON pointers of `value` and everything in it; of a long array only the first few
/// and the last elements (a KVM structure is a list of thousands of bytes).
fn pointers(value: &Value, at: &str, out: &mut Vec<String>) {
    out.push(at.to_string());
    match value {
        Value::Object(map) => {
            for (key, inner) in map {
                let key = key.replace('~', "~0").replace('/', "~1");
                pointers(inner, &format!("{at}/{key}"), out);
            }
        }
        Value::Array(items) => {
            let last = items.len().saturating_sub(1);
            for (index, inner) in items.iter().enumerate() {
                if index < 4 || index == last {
                    pointers(inner, &format!("{at}/{index}"), out);
                }
            }
        }
        _ => {}
    }
}

/// Strings an attacker puts where a name or path goes.
const HOSTILE_STRINGS: [&str; 10] = [
    "/etc/passwd",
    "../../x",
    "../state",
    "/dev/zero",
    "",
    "\u{0}",
    "state",
    "memory-0/../../../etc/hostname",
    "/proc/self/mem",
    "ü\u{202e}\u{fffd}",
];

/// Numbers at and past every boundary a parser or an allocation may get wrong.
fn hostile_number(rng: &mut Rng, old: &Value) -> Value {
    let old = old.as_u64().unwrap_or(1);
    match rng.below(9) {
        0 => Value::from(u64::MAX),
        1 => Value::from(i64::MIN),
        2 => Value::from(-1),
        3 => Value::from(0),
        4 => serde_json::json!(1e300),
        5 => Value::from(old.wrapping_add(1)),
        6 => Value::from(old ^ (1 << rng.below(64))),
        7 => Value::from(u64::from(u32::MAX) + 1),
        _ => Value::from(old.saturating_mul(4096)),
    }
}

/// Edits one value of `root` as a forger would (a well-formed document with hostile
/// content); returns what it did.
fn mutate_json(root: &mut Value, rng: &mut Rng) -> String {
    let mut all = Vec::new();
    pointers(root, "", &mut all);
    let at = rng.pick(&all).clone();
    let target = root.pointer_mut(&at).expect("a pointer just listed");
    match rng.below(8) {
        0 | 1 => {
            let new = hostile_number(rng, target);
            let what = format!("{at} = {new}");
            *target = new;
            what
        }
        2 => {
            let new = if rng.below(4) == 0 {
                "x".repeat(1 + rng.below(70_000) as usize)
            } else {
                rng.pick(&HOSTILE_STRINGS).to_string()
            };
            let what = format!("{at} = {:?}", truncated(&new));
            *target = Value::from(new);
            what
        }
        3 => {
            // Removed from its parent (the root itself is emptied instead).
            let Some(split) = at.rfind('/') else {
                *target = Value::Object(Default::default());
                return "the whole document {}".into();
            };
            let (parent, key) = (&at[..split], &at[split + 1..]);
            let key = key.replace("~1", "/").replace("~0", "~");
            match root.pointer_mut(parent) {
                Some(Value::Object(map)) => {
                    map.remove(&key);
                }
                Some(Value::Array(items)) => {
                    if let Ok(index) = key.parse::<usize>() {
                        if index < items.len() {
                            items.remove(index);
                        }
                    }
                }
                _ => {}
            }
            format!("{at} removed")
        }
        4 => match target {
            Value::Array(items) => {
                let copy = items.clone();
                items.extend(copy);
                format!("{at} repeated ({} items now)", items.len())
            }
            Value::Object(map) => {
                map.insert("frobnicate".into(), Value::from(1));
                format!("{at}/frobnicate added")
            }
            other => {
                let copy = other.clone();
                *other = Value::Array(vec![copy.clone(), copy]);
                format!("{at} made a list of itself twice")
            }
        },
        5 => match target {
            Value::Array(items) if !items.is_empty() => {
                let keep = rng.below(items.len() as u64) as usize;
                items.truncate(keep);
                format!("{at} cut to {keep} items")
            }
            other => {
                *other = Value::Array(Vec::new());
                format!("{at} = []")
            }
        },
        6 => {
            let new = rng
                .pick(&[
                    Value::Null,
                    Value::from(true),
                    Value::from("1"),
                    serde_json::json!({}),
                    serde_json::json!([[]]),
                ])
                .clone();
            let what = format!("{at} = {new}");
            *target = new;
            what
        }
        _ => match target {
            Value::Bool(flag) => {
                *flag = !*flag;
                format!("{at} negated")
            }
            Value::Number(number) => {
                let new = hostile_number(rng, &Value::Number(number.clone()));
                let what = format!("{at} = {new}");
                *target = new;
                what
            }
            Value::String(text) => {
                text.push_str("/../../../etc/passwd");
                format!("{at} += \"/../../../etc/passwd\"")
            }
            other => {
                *other = Value::from(-1);
                format!("{at} = -1")
            }
        },
    }
}

fn truncated(text: &str) -> String {
    if text.len() > 40 {
        let end = text.floor_char_boundary_compat(40);
        format!("{}... ({} bytes)", &text[..end], text.len())
    } else {
        text.to_string()
    }
}

// ---- Restoring and judging. ----

/// How one damaged input ended.
enum Outcome {
    /// gpuvm refused it: its error line (or the API's message).
    CleanError(String),
    /// The guest ran on exactly as from the undamaged input.
    Verified,
    /// gpuvm took the input and is healthy, but the guest runs (or ended) differently:
    /// acceptable only for forged values that a well-framed file may hold.
    Diverged(String),
    Bad(String),
}

/// The lines of `stdout` that ended (the last may be cut by a kill).
fn complete_lines(stdout: &str) -> impl Iterator<Item = &str> {
    stdout
        .split_inclusive('\n')
        .filter_map(|line| line.strip_suffix('\n'))
}

fn has_line(stdout: &str, line: &str) -> bool {
    complete_lines(stdout).any(|l| l == line)
}

/// The numbers N of the complete `memloop: iter N ok` lines.
fn memloop_iterations(stdout: &str) -> Vec<u64> {
    complete_lines(stdout)
        .filter(|line| line.contains(" ok"))
        .filter_map(|line| line.strip_prefix("memloop: iter "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

/// The `memloop: iter N ok checksum=...` lines for the VERIFIED_ITERATIONS iterations
/// after the first one past `last`, from a reference run's stdout.
fn expected_lines(reference: &str, last: u64) -> Vec<String> {
    (1..=VERIFIED_ITERATIONS)
        .map(|n| {
            let prefix = format!("memloop: iter {} ok", last + 1 + n);
            complete_lines(reference)
                .find(|line| line.starts_with(&prefix))
                .unwrap_or_else(|| panic!("the reference lacks {prefix:?}:\n{reference}"))
                .to_string()
        })
        .collect()
}

/// Watches a process that is restoring (or has loaded) a memloop guest until it shows
/// `expected`, ends, or `limit` passes. `restored`: whether gpuvm finished the restore
/// (a guest that then runs differently is the forged input's, not a gpuvm hang).
fn watch(
    process: &mut SpawnedProcess,
    expected: &[String],
    limit: Duration,
    restored: impl Fn(&SpawnedProcess) -> bool,
) -> Outcome {
    let deadline = Instant::now() + limit;
    loop {
        let stdout = process.stdout();
        let wrong = stdout.contains("FAIL") || stdout.contains("testguest: ready");
        if wrong || expected.iter().all(|line| has_line(&stdout, line)) {
            process.signal(libc::SIGKILL);
            while process.try_status().is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
            let (stdout, stderr) = (process.stdout(), process.stderr());
            if stderr.contains("panicked") {
                return Outcome::Bad(format!("gpuvm panicked:\n{stderr}"));
            }
            if wrong || stdout.contains("FAIL") {
                return Outcome::Diverged(format!(
                    "the guest saw wrong memory or rebooted: {}",
                    tail(&stdout)
                ));
            }
            return Outcome::Verified;
        }
        if let Some(status) = process.try_status() {
            process.drain_output(Duration::from_secs(5));
            let (stdout, stderr) = (process.stdout(), process.stderr());
            return ended(status, &stdout, &stderr);
        }
        if Instant::now() > deadline {
            process.signal(libc::SIGKILL);
            while process.try_status().is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
            let (stdout, stderr) = (process.stdout(), process.stderr());
            if stderr.contains("panicked") {
                return Outcome::Bad(format!("gpuvm panicked:\n{stderr}"));
            }
            if restored(process) {
                return Outcome::Diverged(format!(
                    "restored, but the guest did not run on within {limit:?}: {}",
                    tail(&stdout)
                ));
            }
            return Outcome::Bad(format!(
                "neither failed nor finished the restore within {limit:?} (a hang)\n--- stdout\n{}\n--- stderr\n{stderr}",
                tail(&stdout)
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Judges a gpuvm that ended by itself before its guest showed it ran on.
fn ended(status: std::process::ExitStatus, stdout: &str, stderr: &str) -> Outcome {
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("gpuvm: error: "))
        .collect();
    let described = || {
        format!(
            "{status}\n--- stdout\n{}\n--- stderr\n{stderr}",
            tail(stdout)
        )
    };
    if stderr.contains("panicked") {
        return Outcome::Bad(format!("gpuvm panicked: {}", described()));
    }
    match status.code() {
        Some(code) if code == i32::from(GPUVM_ERROR) && errors.len() == 1 => {
            Outcome::CleanError(errors[0].to_string())
        }
        Some(code) if code == i32::from(GPUVM_ERROR) => Outcome::Bad(format!(
            "error status without exactly one error line: {}",
            described()
        )),
        // The guest's own status (what it wrote to the exit port) or its triple fault.
        Some(code) if code < i32::from(GPUVM_ERROR) || code == i32::from(TRIPLE_FAULT) => {
            Outcome::Diverged(format!("the guest ended with {code}: {}", tail(stdout)))
        }
        _ => Outcome::Bad(format!("ended with {}", described())),
    }
}

/// The last lines of `text`, for messages.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(6)..].join("\n")
}

/// Records `outcome` of `case`: `strict` inputs (damage a checksum or check must catch)
/// may only fail cleanly or run on exactly; forged values may also run differently.
fn record(tally: &mut Tally, bad: &mut Vec<String>, case: &str, strict: bool, outcome: Outcome) {
    match outcome {
        Outcome::CleanError(line) => {
            eprintln!("{case}: {line}");
            tally.clean += 1;
        }
        Outcome::Verified => {
            eprintln!("{case}: ran on correctly");
            tally.verified += 1;
        }
        Outcome::Diverged(why) if !strict => {
            eprintln!("{case}: taken; {why}");
            tally.diverged += 1;
        }
        Outcome::Diverged(why) => bad.push(format!("{case}: loaded silently wrong: {why}")),
        Outcome::Bad(why) => bad.push(format!("{case}: {why}")),
    }
}

// ---- gpuvm's own snapshots (state file and memory file). ----

/// A memloop snapshot taken with `gpuvm run --snapshot-dir` and a SIGUSR-style snapshot,
/// and the reference lines its restore prints.
struct GpuvmSnapshot {
    dir: PathBuf,
    expected: Vec<String>,
}

impl GpuvmSnapshot {
    fn take(dir: PathBuf) -> GpuvmSnapshot {
        let mut vm = SpawnedProcess::gpuvm(&[
            "run",
            "--memory",
            "64M",
            "--cmdline",
            "memloop 16M 7 0",
            "--snapshot-dir",
            dir.to_str().expect("UTF-8 path"),
            "--snapshot-then",
            "exit",
        ]);
        vm.wait_for_stdout("memloop: iter 1 ok", REFERENCE_LIMIT);
        gpuvm_tests::snapshot_support::signal_snapshot(vm.pid());
        let out = vm.wait(REFERENCE_LIMIT);
        out.assert_code(0);
        let last = *memloop_iterations(&out.stdout)
            .iter()
            .max()
            .unwrap_or_else(|| panic!("no iteration before the snapshot:\n{}", out.stdout));
        // The undamaged snapshot's run on: the reference every damaged copy is held to.
        let mut process = restore_process(&dir, "eager");
        let want = format!("memloop: iter {} ok", last + 1 + VERIFIED_ITERATIONS);
        process.wait_until(&want, REFERENCE_LIMIT, |p| {
            complete_lines(&p.stdout()).any(|line| line.starts_with(&want))
        });
        process.signal(libc::SIGKILL);
        let reference = process.wait(Duration::from_secs(10)).stdout;
        let expected = expected_lines(&reference, last);
        GpuvmSnapshot { dir, expected }
    }

    /// A fresh copy of the snapshot's regular files in `to`.
    fn copy_to(&self, to: &Path) {
        std::fs::create_dir_all(to).expect("create the copy");
        for entry in std::fs::read_dir(&self.dir).expect("list").flatten() {
            if entry.file_type().is_ok_and(|t| t.is_file()) {
                std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
            }
        }
    }
}

fn restore_process(dir: &Path, mode: &str) -> SpawnedProcess {
    SpawnedProcess::gpuvm(&[
        "restore",
        "--snapshot",
        dir.to_str().expect("UTF-8 path"),
        "--restore-mode",
        mode,
        "--report-timing",
    ])
}

/// Whether a `gpuvm restore --report-timing` finished building the restored VM.
fn restore_finished(process: &SpawnedProcess) -> bool {
    process.stderr().contains("gpuvm: restore mode=")
}

/// The one memory file of a full snapshot in `dir`.
fn gpuvm_memory_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("list")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("memory-") && !name.contains(".tmp")
        })
        .collect();
    assert_eq!(
        files.len(),
        1,
        "memory files in {}: {files:?}",
        dir.display()
    );
    files[0].clone()
}

#[test]
fn state_file_mutations_fail_cleanly_or_run_on() {
    let scratch = Scratch::new("fuzz_inputs", "state");
    let good = GpuvmSnapshot::take(scratch.path("good"));
    let budget = Budget::new("state file", 0x5747_e0f1_1e00_0001, 200, 25);
    let mut rng = Rng(budget.seed);
    let (mut tally, mut bad) = (Tally::default(), Vec::new());
    let mut case = 0;
    while budget.allows(case) {
        let dir = scratch.path(&format!("case-{case}"));
        good.copy_to(&dir);
        // Byte damage under a valid-looking frame is the framing CRC's to catch (strict);
        // an edited payload, framed again, is a forgery the parser and validation face.
        let mut names_outside = false;
        let (what, strict) = match rng.below(3) {
            0 => {
                let mut bytes = std::fs::read(dir.join("state")).expect("read state");
                let what = mutate_bytes(&mut bytes, &mut rng);
                std::fs::write(dir.join("state"), bytes).expect("write state");
                (format!("state bytes: {what}"), true)
            }
            1 => {
                // The payload damaged as text, then framed with a correct CRC.
                let framed = std::fs::read(dir.join("state")).expect("read state");
                let mut payload = framed[24..].to_vec();
                let what = mutate_bytes(&mut payload, &mut rng);
                std::fs::write(dir.join("state"), frame_state(&payload)).expect("write");
                (format!("state payload text, framed again: {what}"), false)
            }
            _ => {
                let mut state = read_state(&dir);
                let mut edits = Vec::new();
                for _ in 0..1 + rng.below(2) {
                    let edit = mutate_json(&mut state, &mut rng);
                    names_outside |= names_a_file_outside(&edit);
                    edits.push(edit);
                }
                write_state(&dir, &state);
                (
                    format!("state JSON, framed again: {}", edits.join("; ")),
                    false,
                )
            }
        };
        let mode = if case % 2 == 0 { "eager" } else { "lazy" };
        let mut process = restore_process(&dir, mode);
        let outcome = watch(
            &mut process,
            &good.expected,
            RESTORE_LIMIT,
            restore_finished,
        );
        let named = format!("case {case} ({mode}; {})", truncated_what(&what));
        // A path outside the snapshot that a forged state names must never be followed:
        // a run that took one is bad even if its guest went on.
        let outcome = match outcome {
            Outcome::Verified | Outcome::Diverged(_) if names_outside => {
                Outcome::Bad("took a state naming a file outside its directory".into())
            }
            other => other,
        };
        record(&mut tally, &mut bad, &named, strict, outcome);
        let _ = std::fs::remove_dir_all(&dir);
        case += 1;
    }
    budget.finish(case, &tally, &bad);
}

/// Whether one edit (as [`mutate_json`] describes it) put a path outside the snapshot
/// directory into a field that names a file gpuvm opens.
fn names_a_file_outside(edit: &str) -> bool {
    let Some((field, value)) = edit.split_once(" = ").or_else(|| edit.split_once(" += ")) else {
        return false;
    };
    let names_a_file = ["/memory_files/", "/state_file", "/path"]
        .iter()
        .any(|name| field.contains(name) || field.ends_with(name.trim_end_matches('/')));
    let outside = ["/etc/", "/proc/", "../", "\"/dev/"]
        .iter()
        .any(|p| value.contains(p));
    names_a_file && outside
}

fn truncated_what(what: &str) -> String {
    if what.len() > 300 {
        format!("{}...", &what[..what.floor_char_boundary_compat(300)])
    } else {
        what.to_string()
    }
}

/// `str::floor_char_boundary` for stable Rust.
trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, index: usize) -> usize;
}

impl FloorCharBoundary for str {
    fn floor_char_boundary_compat(&self, index: usize) -> usize {
        (0..=index.min(self.len()))
            .rev()
            .find(|&i| self.is_char_boundary(i))
            .unwrap_or(0)
    }
}

// ---- A GPU snapshot's device-state file. ----

/// `PUT /snapshot/load` of `dir` (lazily, resumed, the device now behind `device`) in a
/// fresh gpuvm with its stdin piped to the guest; the answer and the process.
fn load_gpu_snapshot(
    dir: &Path,
    api: &Path,
    device: &Path,
) -> (Result<(u16, String), String>, SpawnedProcess) {
    let mut vmm = SpawnedProcess::gpuvm_with_input(&["run", "--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, api);
    let load = serde_json::json!({
        "snapshot_path": dir,
        "restore_mode": "Lazy",
        "resume_vm": true,
        "gpus": [{ "gpu_id": "gpu0", "vfio_user_socket": device }],
    })
    .to_string();
    (send(api, "PUT", "/snapshot/load", load.as_bytes()), vmm)
}

/// After a load answered 204: the guest checks the device's state once it gets a byte on
/// its serial port, runs the job the snapshot held and ends with `gpu-migrate: ok`.
fn judge_gpu_restore(vmm: &mut SpawnedProcess) -> Outcome {
    let deadline = Instant::now() + RESTORE_LIMIT;
    let mut released = false;
    loop {
        let stdout = vmm.stdout();
        if let Some(status) = vmm.try_status() {
            vmm.drain_output(Duration::from_secs(5));
            let (stdout, stderr) = (vmm.stdout(), vmm.stderr());
            if status.code() == Some(0)
                && has_line(&stdout, "gpu-migrate: ok")
                && !stdout.contains("FAIL")
                && !stderr.contains("panicked")
            {
                return Outcome::Verified;
            }
            if stdout.contains("FAIL") && !stderr.contains("panicked") {
                return Outcome::Diverged(format!("the guest saw wrong state: {}", tail(&stdout)));
            }
            return ended(status, &stdout, &stderr);
        }
        if !released && complete_lines(&stdout).any(|l| l.starts_with("gpu-migrate: iter ")) {
            vmm.write_stdin(b"g");
            released = true;
        }
        if Instant::now() > deadline {
            vmm.signal(libc::SIGKILL);
            let stderr = vmm.stderr();
            if stderr.contains("panicked") {
                return Outcome::Bad(format!("gpuvm panicked:\n{stderr}"));
            }
            // The load answered 204: gpuvm restored the VM; the guest went elsewhere.
            return Outcome::Diverged(format!(
                "restored, but the guest did not finish within {RESTORE_LIMIT:?}: {}",
                tail(&stdout)
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn device_state_mutations_fail_cleanly_or_restore_the_device() {
    let scratch = Scratch::new("fuzz_inputs", "device");
    let emu = PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"));
    let first = gpuvm_tests::socket_path("fuzz", "emu-a");
    let emu_a = gpuvm_tests::start_emu_gpu(&emu, &first, &[]);
    let api = gpuvm_tests::socket_path("fuzz", "device-api");
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    api_expect(
        &api,
        204,
        "PUT",
        "/boot-source",
        Some(r#"{"boot_args": "gpu-migrate"}"#),
    );
    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    vmm.wait_for_stdout("gpu-migrate: waiting for a device", REFERENCE_LIMIT);
    let plug = serde_json::json!({ "gpu_id": "gpu0", "vfio_user_socket": first }).to_string();
    api_expect(&api, 200, "PUT", "/gpus/gpu0", Some(&plug));
    vmm.wait_for_stdout("gpu-migrate: iter 1 ok", REFERENCE_LIMIT);
    let good = scratch.path("good");
    let create = serde_json::json!({ "snapshot_path": good }).to_string();
    api_expect(&api, 200, "PUT", "/snapshot/create", Some(&create));
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));
    drop(emu_a);
    let device_file = std::fs::read_dir(&good)
        .expect("list")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|name| name.starts_with("device-"))
        .expect("the snapshot holds a device-state file");

    // One device process serves every load, one after another.
    let device = gpuvm_tests::socket_path("fuzz", "emu-b");
    let mut emu_b = gpuvm_tests::start_emu_gpu(&emu, &device, &["--clients", "100000"]);
    {
        let load_api = gpuvm_tests::socket_path("fuzz", "device-reference");
        let (answer, mut vmm) = load_gpu_snapshot(&good, &load_api, &device);
        assert!(
            matches!(answer, Ok((204, _))),
            "the undamaged snapshot: {answer:?}"
        );
        match judge_gpu_restore(&mut vmm) {
            Outcome::Verified => {}
            Outcome::CleanError(why) | Outcome::Diverged(why) | Outcome::Bad(why) => {
                panic!("the undamaged snapshot does not restore: {why}")
            }
        }
    }

    let budget = Budget::new("device-state file", 0x5747_e0f1_1e00_0002, 100, 25);
    let mut rng = Rng(budget.seed);
    let (mut tally, mut bad) = (Tally::default(), Vec::new());
    let mut case = 0;
    while budget.allows(case) && emu_b.try_status().is_none() {
        let dir = scratch.path(&format!("case-{case}"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for entry in std::fs::read_dir(&good).expect("list").flatten() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
        }
        let mut names_outside = false;
        let (what, strict) = if rng.below(2) == 0 {
            let path = dir.join(&device_file);
            let mut bytes = std::fs::read(&path).expect("read device state");
            let what = mutate_bytes(&mut bytes, &mut rng);
            std::fs::write(&path, bytes).expect("write device state");
            (format!("{device_file}: {what}"), true)
        } else {
            // The state's record of the device, forged and framed again.
            let mut state = read_state(&dir);
            let entry = &mut state["migrated_gpus"][0];
            let edit = mutate_json(entry, &mut rng);
            names_outside = names_a_file_outside(&edit);
            write_state(&dir, &state);
            (format!("state migrated_gpus[0]: {edit}"), false)
        };
        let named = format!("case {case} ({})", truncated_what(&what));
        let load_api = gpuvm_tests::socket_path("fuzz", &format!("device-{case}"));
        let (answer, mut vmm) = load_gpu_snapshot(&dir, &load_api, &device);
        let outcome = match answer {
            Ok((204, _)) => judge_gpu_restore(&mut vmm),
            Ok((status @ 400..=499, message)) if !message.trim().is_empty() => {
                Outcome::CleanError(format!("{status} {}", truncated(&message)))
            }
            Ok((status, message)) => Outcome::Bad(format!("the load answered {status}: {message}")),
            Err(why) => Outcome::Bad(format!("the load got no answer: {why}")),
        };
        let outcome = match outcome {
            Outcome::Verified | Outcome::Diverged(_) if names_outside => {
                Outcome::Bad("took a state naming a device file outside its directory".into())
            }
            other => other,
        };
        drop(vmm);
        let _ = std::fs::remove_file(&load_api);
        record(&mut tally, &mut bad, &named, strict, outcome);
        let _ = std::fs::remove_dir_all(&dir);
        case += 1;
    }
    if let Some(status) = emu_b.try_status() {
        bad.push(format!(
            "the emulated GPU ended with {status} after case {case}:\n{}",
            tail(&emu_b.stderr())
        ));
    }
    budget.finish(case, &tally, &bad);
}

// ---- Memory files: gpuvm's format and Firecracker's raw image. ----

/// Firecracker-shaped snapshot: the state and raw memory image gpuvm wrote through
/// `PUT /snapshot/create`, and the reference lines a load of them prints.
struct RawSnapshot {
    state: PathBuf,
    mem: PathBuf,
    /// The page CRC table gpuvm keeps for the image in its hidden directory.
    crc_table: PathBuf,
    expected: Vec<String>,
}

const RAW_MEM_MIB: u64 = 64;

fn raw_snapshot(scratch: &Scratch) -> RawSnapshot {
    let kernel = scratch.path("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        REFERENCE_LIMIT,
    )
    .assert_code(0);
    let api = scratch.path("raw-create.sock");
    let mut vmm = start_firecracker(scratch, &api, "fuzz-raw-create", &[]);
    let machine = format!(
        r#"{{"vcpu_count": 1, "mem_size_mib": {RAW_MEM_MIB}, "track_dirty_pages": false}}"#
    );
    api_expect(&api, 204, "PUT", "/machine-config", Some(&machine));
    let boot = format!(
        r#"{{"kernel_image_path": "{}", "boot_args": "memloop 16M 11 0"}}"#,
        kernel.display()
    );
    api_expect(&api, 204, "PUT", "/boot-source", Some(&boot));
    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    vmm.wait_for_stdout("memloop: iter 1 ok", REFERENCE_LIMIT);
    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    let (state, mem) = (scratch.path("vm.state"), scratch.path("vm.mem"));
    let create = format!(
        r#"{{"snapshot_type": "Full", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
        state.display(),
        mem.display()
    );
    api_expect(&api, 204, "PUT", "/snapshot/create", Some(&create));
    // Read after the VMM ended, so no line the guest printed is still in the pipe.
    vmm.signal(libc::SIGKILL);
    let before = vmm.wait(Duration::from_secs(10)).stdout;
    let last = *memloop_iterations(&before).last().expect("an iteration");
    let hidden = gpuvm_vmm::snapshot::files::directory_for(&state).expect("hidden directory");
    let crc_table = std::fs::read_dir(&hidden)
        .expect("list the hidden directory")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".raw-crcs"))
        .expect("the raw image's page CRC table");

    // The undamaged load: the reference.
    let (status, message, mut process) = load_raw(scratch, "reference", &state, &mem);
    assert_eq!(status, 204, "the undamaged image does not load: {message}");
    let want = format!("memloop: iter {} ok", last + 1 + VERIFIED_ITERATIONS);
    process.wait_until(&want, REFERENCE_LIMIT, |p| {
        complete_lines(&p.stdout()).any(|line| line.starts_with(&want))
    });
    process.signal(libc::SIGKILL);
    let reference = process.wait(Duration::from_secs(10)).stdout;
    RawSnapshot {
        state,
        mem,
        crc_table,
        expected: expected_lines(&reference, last),
    }
}

/// `PUT /snapshot/load` (File backend, resumed) of `state` and `mem` in a fresh
/// `firecracker`; the answer's status and message, and the process.
fn load_raw(
    scratch: &Scratch,
    name: &str,
    state: &Path,
    mem: &Path,
) -> (u16, String, SpawnedProcess) {
    let api = scratch.path(&format!("{name}.sock"));
    let vmm = start_firecracker(scratch, &api, &format!("fuzz-{name}"), &[]);
    let body = format!(
        r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "resume_vm": true}}"#,
        state.display(),
        mem.display()
    );
    match send(&api, "PUT", "/snapshot/load", body.as_bytes()) {
        Ok((status, body)) => (status, body, vmm),
        Err(why) => (0, why, vmm),
    }
}

/// A change made to a file in place, and how to undo it (the raw image is 64 MiB, sparse:
/// a copy per case would write it whole).
struct Undo {
    path: PathBuf,
    len: u64,
    patches: Vec<(u64, Vec<u8>)>,
}

impl Undo {
    fn apply(self) {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .expect("open to undo");
        file.set_len(self.len).expect("restore the length");
        for (at, bytes) in self.patches.iter().rev() {
            file.write_all_at(bytes, *at).expect("undo");
        }
    }
}

/// Damages the file at `path` in place: bit flips (in the guest's data, in any page, or in
/// a header), a zeroed or random page, a page copied over another, a cut tail or appended
/// bytes.
fn damage_in_place(path: &Path, rng: &mut Rng, data_end: u64) -> (String, Undo) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open to damage");
    let len = file.metadata().expect("stat").len();
    let mut undo = Undo {
        path: path.to_path_buf(),
        len,
        patches: Vec::new(),
    };
    let patch = |at: u64, bytes: &[u8], undo: &mut Undo| {
        let mut old = vec![0; bytes.len()];
        file.read_exact_at(&mut old, at)
            .expect("read before damage");
        undo.patches.push((at, old));
        file.write_all_at(bytes, at).expect("damage");
    };
    let page = 4096u64;
    let pages = (len / page).max(1);
    let what = match rng.below(6) {
        0 | 1 => {
            let mut flipped = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let at = match rng.below(3) {
                    0 => rng.below(data_end.min(len)),
                    1 => rng.below(len),
                    _ => rng.below(len.min(page)),
                };
                let mut byte = [0u8];
                file.read_exact_at(&mut byte, at).expect("read");
                let bit = rng.below(8);
                patch(at, &[byte[0] ^ (1 << bit)], &mut undo);
                flipped.push(format!("{at}.{bit}"));
            }
            format!("flipped bits {} of {len}", flipped.join(","))
        }
        2 => {
            let index = rng.below(pages.min(data_end / page + 1));
            let bytes: Vec<u8> = if rng.below(2) == 0 {
                vec![0; page.min(len) as usize]
            } else {
                (0..page.min(len)).map(|_| rng.next() as u8).collect()
            };
            let at = (index * page).min(len - bytes.len() as u64);
            patch(at, &bytes, &mut undo);
            format!(
                "page at {at} overwritten ({})",
                if bytes[0] == 0 && bytes.iter().all(|&b| b == 0) {
                    "zeros"
                } else {
                    "random"
                }
            )
        }
        3 => {
            let (from, to) = (rng.below(pages), rng.below(pages));
            let size = page.min(len);
            let mut bytes = vec![0; size as usize];
            file.read_exact_at(&mut bytes, (from * page).min(len - size))
                .expect("read page");
            patch((to * page).min(len - size), &bytes, &mut undo);
            format!("page {from} copied over page {to}")
        }
        4 => {
            // A cut tail, at most 16 MiB of it (kept for the undo), page-aligned half the time.
            let most = len.min(16 << 20);
            let mut cut = 1 + rng.below(most);
            if rng.below(2) == 0 {
                cut = (cut / page).max(1) * page;
                cut = cut.min(len);
            }
            let new_len = len - cut;
            let mut tail = vec![0; cut as usize];
            file.read_exact_at(&mut tail, new_len)
                .expect("read the tail");
            undo.patches.push((new_len, tail));
            file.set_len(new_len).expect("cut");
            format!("cut to {new_len} of {len} bytes")
        }
        _ => {
            let extra: Vec<u8> = if rng.below(2) == 0 {
                vec![0; page as usize]
            } else {
                (0..1 + rng.below(8192)).map(|_| rng.next() as u8).collect()
            };
            file.write_all_at(&extra, len).expect("append");
            format!("{} bytes appended", extra.len())
        }
    };
    (what, undo)
}

#[test]
fn memory_file_damage_is_detected_or_harmless() {
    let scratch = Scratch::new("fuzz_inputs", "memory");
    let raw = raw_snapshot(&scratch);
    let good = GpuvmSnapshot::take(scratch.path("good"));
    let budget = Budget::new("memory files", 0x5747_e0f1_1e00_0003, 120, 30);
    let mut rng = Rng(budget.seed);
    let (mut tally, mut bad) = (Tally::default(), Vec::new());
    let mut case = 0;
    while budget.allows(case) {
        let named;
        let outcome = match case % 3 {
            // Firecracker's raw image, and the CRC table gpuvm keeps beside it.
            0 | 1 => {
                let (target, data_end) = if case % 3 == 0 {
                    (&raw.mem, 48 << 20)
                } else {
                    (&raw.crc_table, u64::MAX)
                };
                let (what, undo) = damage_in_place(target, &mut rng, data_end);
                let file = target.file_name().unwrap_or_default().to_string_lossy();
                named = format!("case {case} (raw load; {file}: {what})");
                let (status, message, mut process) =
                    load_raw(&scratch, &format!("case-{case}"), &raw.state, &raw.mem);
                let outcome = match status {
                    204 => watch(&mut process, &raw.expected, RESTORE_LIMIT, |_| true),
                    400..=499 if !message.is_empty() => {
                        // A refused load leaves the process serving its API.
                        match send(&scratch.path(&format!("case-{case}.sock")), "GET", "/", b"") {
                            Ok((200, _)) => Outcome::CleanError(format!("{status} {message}")),
                            other => Outcome::Bad(format!(
                                "refused ({status} {message}) and then did not answer: {other:?}"
                            )),
                        }
                    }
                    _ => Outcome::Bad(format!("the load answered {status}: {message}")),
                };
                drop(process);
                undo.apply();
                outcome
            }
            // gpuvm's own memory file: a copy per case (it is small and sparse-free).
            _ => {
                let dir = scratch.path(&format!("case-{case}"));
                good.copy_to(&dir);
                let memory = gpuvm_memory_file(&dir);
                let mut bytes = std::fs::read(&memory).expect("read memory file");
                let what = mutate_bytes(&mut bytes, &mut rng);
                std::fs::write(&memory, bytes).expect("write memory file");
                let mode = if case % 2 == 0 { "eager" } else { "lazy" };
                named = format!("case {case} (gpuvm restore {mode}; memory file: {what})");
                let mut process = restore_process(&dir, mode);
                let outcome = watch(&mut process, &good.expected, RESTORE_LIMIT, |_| false);
                let _ = std::fs::remove_dir_all(&dir);
                outcome
            }
        };
        // A damaged memory file is never a forged value: only a clean error or a guest
        // that runs on exactly (a damaged page it never loads) will do.
        record(&mut tally, &mut bad, &named, true, outcome);
        case += 1;
    }
    budget.finish(case, &tally, &bad);
}

// ---- API bodies. ----

/// Sends one request with a raw body on a fresh connection; the status and body of the
/// answer, or why there was none.
fn send(socket: &Path, method: &str, path: &str, body: &[u8]) -> Result<(u16, String), String> {
    let mut stream = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    let limit = Some(Duration::from_secs(15));
    stream.set_read_timeout(limit).map_err(|e| e.to_string())?;
    stream.set_write_timeout(limit).map_err(|e| e.to_string())?;
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n")
            .into_bytes();
    if !body.is_empty() {
        request.extend_from_slice(
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            )
            .as_bytes(),
        );
    }
    request.extend_from_slice(b"\r\n");
    request.extend_from_slice(body);
    stream
        .write_all(&request)
        .map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    // A refusal that does not read a large body closes on the unread bytes, and the
    // answer is followed by a reset: the answer counts, a reset before one does not.
    if let Err(e) = stream.read_to_end(&mut answer) {
        if answer.is_empty() {
            return Err(format!("read: {e}"));
        }
    }
    if answer.is_empty() {
        return Err("the connection closed without an answer".into());
    }
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {}", truncated(&text)))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// One front end under fuzz: its process, socket, liveness probe and valid requests.
struct FrontEnd {
    name: &'static str,
    process: SpawnedProcess,
    socket: PathBuf,
    ping: &'static str,
    /// (method, path, a valid body)
    requests: Vec<(&'static str, &'static str, String)>,
    /// A request that undoes a configuration a mutated body made (e.g. Cloud Hypervisor's
    /// vm.delete after a vm.create was taken, so vm.create stays reachable).
    undo: Option<(&'static str, &'static str, &'static str)>,
}

fn gpuvm_front_end(scratch: &Scratch, kernel: &Path) -> FrontEnd {
    let socket = scratch.path("gpuvm.sock");
    let mut process = SpawnedProcess::gpuvm(&["run", "--api-sock", socket.to_str().unwrap()]);
    wait_for_api_socket(&mut process, &socket);
    let k = kernel.display();
    let s = scratch.path("x").display().to_string();
    FrontEnd {
        name: "gpuvm",
        process,
        socket,
        ping: "/",
        requests: vec![
            ("PUT", "/machine-config", r#"{"vcpu_count": 2, "mem_size_mib": 128}"#.into()),
            ("PUT", "/machine-config", r#"{"vcpu_count": 2, "mem_size_mib": 128, "numa": {"nodes": [{"node": 0, "cpus": [0], "mem_mib": 64, "host_node": 0}, {"node": 1, "cpus": [1], "mem_mib": 64}], "distances": [[10, 21], [21, 10]], "pin_vcpus": true}}"#.into()),
            ("PUT", "/machine-config", r#"{"vcpu_count": 2, "mem_size_mib": 128, "numa": {"auto": true}}"#.into()),
            ("PUT", "/boot-source", format!(r#"{{"kernel_image_path": "{k}", "boot_args": "memloop 1M 1 1"}}"#)),
            ("PUT", "/boot-source", r#"{"boot_args": "virtio-devices 2"}"#.into()),
            ("PUT", "/drives/root", format!(r#"{{"drive_id": "root", "path_on_host": "{s}.img", "is_root_device": false, "is_read_only": true}}"#)),
            ("PATCH", "/drives/root", format!(r#"{{"drive_id": "root", "path_on_host": "{s}.img"}}"#)),
            ("PUT", "/network-interfaces/eth0", r#"{"iface_id": "eth0", "host_dev_name": "tap-fuzz0", "guest_mac": "06:00:00:00:00:01"}"#.into()),
            ("PUT", "/vsock", format!(r#"{{"guest_cid": 3, "uds_path": "{s}.vsock"}}"#)),
            ("PUT", "/entropy", r#"{"rate_limiter": {"bandwidth": {"size": 1048576, "refill_time": 100}}}"#.into()),
            ("PUT", "/balloon", r#"{"amount_mib": 0, "deflate_on_oom": true, "stats_polling_interval_s": 1}"#.into()),
            ("PUT", "/gpus/gpu0", format!(r#"{{"gpu_id": "gpu0", "vfio_user_socket": "{s}.gpu"}}"#)),
            ("PUT", "/gpus/gpu1", format!(r#"{{"gpu_id": "gpu1", "vfio_user_socket": "{s}.gpu1", "gpudirect_clique": 3, "p2p": false}}"#)),
            ("PUT", "/gpus/gpu2", r#"{"gpu_id": "gpu2", "host_bdf": "0000:41:00.0", "gpudirect_clique": 15, "p2p": true}"#.into()),
            ("PUT", "/fs/fs0", format!(r#"{{"fs_id": "fs0", "socket": "{s}.fs", "tag": "shared"}}"#)),
            ("PUT", "/snapshot/create", format!(r#"{{"snapshot_path": "{s}.snap"}}"#)),
            ("PUT", "/snapshot/load", format!(r#"{{"snapshot_path": "{s}.snap", "restore_mode": "Lazy", "resume_vm": true, "gpus": [{{"gpu_id": "gpu0", "vfio_user_socket": "{s}.gpu"}}]}}"#)),
            ("PATCH", "/vm", r#"{"state": "Paused"}"#.into()),
            ("PATCH", "/balloon", r#"{"amount_mib": 16}"#.into()),
        ],
        undo: None,
    }
}

fn cloud_hypervisor_front_end(scratch: &Scratch, kernel: &Path) -> FrontEnd {
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).expect("link");
    let socket = scratch.path("ch.sock");
    let mut process = SpawnedProcess::spawn(
        &link,
        &[
            "--api-socket",
            socket.to_str().unwrap(),
            "--seccomp",
            "true",
        ],
    );
    wait_for_api_socket(&mut process, &socket);
    let k = kernel.display();
    let s = scratch.path("x").display().to_string();
    let create = format!(
        r#"{{"payload":{{"kernel":"{k}","cmdline":"memloop 1M 1 1"}},
            "cpus":{{"boot_vcpus":1,"max_vcpus":4}},
            "memory":{{"size":134217728,"hotplug_size":536870912,"shared":true}},
            "disks":[{{"path":"{s}.img","readonly":true,"id":"disk0","queue_size":128,"num_queues":1}}],
            "net":[{{"tap":"tap-fuzz1","mac":"06:00:00:00:00:02","id":"net0"}}],
            "rng":{{"src":"/dev/urandom"}},
            "serial":{{"mode":"Tty"}},"console":{{"mode":"Off"}},
            "vsock":{{"cid":3,"socket":"{s}.vsock"}},
            "platform":{{"num_pci_segments":2}}}}"#
    );
    // Kata's GPU VM: two guest NUMA nodes and a device with its GPUDirect clique.
    let create_numa = format!(
        r#"{{"payload":{{"kernel":"{k}","cmdline":"memloop 1M 1 1"}},
            "cpus":{{"boot_vcpus":2,"max_vcpus":2}},
            "memory":{{"size":134217728}},
            "devices":[{{"path":"/sys/bus/pci/devices/0000:41:00.0","id":"gpu0","x_nv_gpudirect_clique":2}}],
            "numa":[{{"guest_numa_id":0,"cpus":[0],"distances":[{{"destination":1,"distance":20}}],"memory_zones":null,"pci_segments":null}},
                    {{"guest_numa_id":1,"cpus":[1],"distances":[{{"destination":0,"distance":20}}]}}]}}"#
    );
    FrontEnd {
        name: "cloud-hypervisor",
        process,
        socket,
        ping: "/api/v1/vmm.ping",
        requests: vec![
            ("PUT", "/api/v1/vm.create", create),
            ("PUT", "/api/v1/vm.create", create_numa),
            (
                "PUT",
                "/api/v1/vm.add-disk",
                format!(r#"{{"path":"{s}.img","id":"disk1","readonly":true}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.add-net",
                r#"{"tap":"tap-fuzz2","mac":"06:00:00:00:00:03","id":"net1"}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.add-vsock",
                format!(r#"{{"cid":4,"socket":"{s}.vsock2","id":"vsock1"}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.add-device",
                r#"{"path":"/sys/bus/pci/devices/0000:00:00.0","id":"dev0"}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.add-device",
                r#"{"path":"/sys/bus/pci/devices/0000:41:00.0","id":"gpu1","x_nv_gpudirect_clique":7}"#
                    .into(),
            ),
            (
                "PUT",
                "/api/v1/vm.add-user-device",
                format!(r#"{{"socket":"{s}.user","id":"user0"}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.add-fs",
                format!(
                    r#"{{"tag":"shared","socket":"{s}.fs","num_queues":1,"queue_size":1024,"id":"fs0"}}"#
                ),
            ),
            (
                "PUT",
                "/api/v1/vm.add-pmem",
                format!(r#"{{"file":"{s}.pmem","size":2097152,"id":"pmem0"}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.remove-device",
                r#"{"id":"disk1"}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.resize",
                r#"{"desired_vcpus":2,"desired_ram":268435456}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.resize-zone",
                r#"{"id":"zone0","desired_ram":268435456}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.resize-disk",
                r#"{"id":"disk0","desired_size":1048576}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.snapshot",
                format!(r#"{{"destination_url":"file://{s}.snap"}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.restore",
                format!(r#"{{"source_url":"file://{s}.snap","prefault":false}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.coredump",
                format!(r#"{{"destination_url":"file://{s}.core"}}"#),
            ),
            (
                "PUT",
                "/api/v1/vm.send-migration",
                r#"{"destination_url":"unix:/nonexistent","local":true}"#.into(),
            ),
            (
                "PUT",
                "/api/v1/vm.receive-migration",
                r#"{"receiver_url":"unix:/nonexistent"}"#.into(),
            ),
        ],
        undo: Some(("PUT", "/api/v1/vm.delete", "/api/v1/vm.create")),
    }
}

fn firecracker_front_end(scratch: &Scratch, kernel: &Path) -> FrontEnd {
    let socket = scratch.path("fc.sock");
    let process = start_firecracker(scratch, &socket, "fuzz-api", &[]);
    let k = kernel.display();
    let s = scratch.path("x").display().to_string();
    FrontEnd {
        name: "firecracker",
        process,
        socket,
        ping: "/",
        requests: vec![
            ("PUT", "/machine-config", r#"{"vcpu_count": 2, "mem_size_mib": 128, "smt": false, "track_dirty_pages": false}"#.into()),
            ("PATCH", "/machine-config", r#"{"mem_size_mib": 256}"#.into()),
            ("PUT", "/boot-source", format!(r#"{{"kernel_image_path": "{k}", "boot_args": "memloop 1M 1 1", "initrd_path": "{s}.initrd"}}"#)),
            ("PUT", "/drives/rootfs", format!(r#"{{"drive_id": "rootfs", "path_on_host": "{s}.img", "is_root_device": true, "is_read_only": true, "rate_limiter": {{"bandwidth": {{"size": 1048576, "one_time_burst": 0, "refill_time": 100}}}}}}"#)),
            ("PATCH", "/drives/rootfs", format!(r#"{{"drive_id": "rootfs", "path_on_host": "{s}.img"}}"#)),
            ("PUT", "/network-interfaces/eth0", r#"{"iface_id": "eth0", "host_dev_name": "tap-fuzz3", "guest_mac": "06:00:00:00:00:04", "rx_rate_limiter": {"ops": {"size": 100, "refill_time": 1000}}}"#.into()),
            ("PUT", "/vsock", format!(r#"{{"guest_cid": 3, "uds_path": "{s}.vsock"}}"#)),
            ("PUT", "/balloon", r#"{"amount_mib": 0, "deflate_on_oom": true, "stats_polling_interval_s": 1}"#.into()),
            ("PUT", "/entropy", r#"{"rate_limiter": {"bandwidth": {"size": 1000, "refill_time": 100}}}"#.into()),
            ("PUT", "/logger", format!(r#"{{"log_path": "{s}.log", "level": "Info", "show_level": true}}"#)),
            ("PUT", "/metrics", format!(r#"{{"metrics_path": "{s}.metrics"}}"#)),
            ("PUT", "/mmds/config", r#"{"version": "V2", "network_interfaces": ["eth0"], "ipv4_address": "169.254.169.254"}"#.into()),
            ("PUT", "/mmds", r#"{"latest": {"meta-data": {"ami-id": "ami-12345678", "list": [1, 2, {"a": null}]}}}"#.into()),
            ("PATCH", "/mmds", r#"{"latest": {"meta-data": {"ami-id": null}}}"#.into()),
            ("PUT", "/cpu-config", r#"{"cpuid_modifiers": [{"leaf": "0x1", "subleaf": "0x0", "flags": 0, "modifiers": [{"register": "eax", "bitmap": "0bxxxx000000000011111100000000xxxx"}]}]}"#.into()),
            ("PUT", "/snapshot/create", format!(r#"{{"snapshot_type": "Full", "snapshot_path": "{s}.state", "mem_file_path": "{s}.mem"}}"#)),
            ("PUT", "/snapshot/load", format!(r#"{{"snapshot_path": "{s}.state", "mem_backend": {{"backend_type": "File", "backend_path": "{s}.mem"}}, "resume_vm": true, "network_overrides": [{{"iface_id": "eth0", "host_dev_name": "tap-fuzz4"}}]}}"#)),
            ("PATCH", "/vm", r#"{"state": "Paused"}"#.into()),
        ],
        undo: None,
    }
}

/// Whether `status` is an answer gpuvm may give to a bad body: any 2xx or 4xx, and the
/// documented 503 (all connection slots busy).
fn acceptable(status: u16) -> bool {
    (200..300).contains(&status) || (400..500).contains(&status) || status == 503
}

#[test]
fn api_body_mutations_get_an_answer_and_never_a_5xx() {
    let scratch = Scratch::new("fuzz_inputs", "api");
    let kernel = scratch.path("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        REFERENCE_LIMIT,
    )
    .assert_code(0);
    let mut front_ends = vec![
        gpuvm_front_end(&scratch, &kernel),
        cloud_hypervisor_front_end(&scratch, &kernel),
        firecracker_front_end(&scratch, &kernel),
    ];
    let budget = Budget::new("API bodies", 0x5747_e0f1_1e00_0004, 1500, 30);
    let mut rng = Rng(budget.seed);
    let (mut tally, mut bad) = (Tally::default(), Vec::new());
    let mut case = 0;
    while budget.allows(case) && bad.is_empty() {
        let front = &mut front_ends[case % 3];
        let (method, path, valid) = rng.pick(&front.requests).clone();
        let mut body = valid.into_bytes();
        let what = match rng.below(3) {
            0 => mutate_bytes(&mut body, &mut rng),
            _ => {
                let mut json: Value = serde_json::from_slice(&body).expect("a valid body");
                let mut edits = Vec::new();
                for _ in 0..1 + rng.below(3) {
                    edits.push(mutate_json(&mut json, &mut rng));
                }
                body = serde_json::to_vec(&json).expect("encode");
                edits.join("; ")
            }
        };
        let named = format!(
            "case {case} ({} {method} {path}: {}; body {:?})",
            front.name,
            truncated_what(&what),
            truncated(&String::from_utf8_lossy(&body))
        );
        match send(&front.socket, method, path, &body) {
            Ok((status, answer)) if acceptable(status) => {
                if (200..300).contains(&status) {
                    tally.verified += 1;
                    if let Some((undo_method, undo_path, after)) = front.undo {
                        if path == after {
                            let _ = send(&front.socket, undo_method, undo_path, b"");
                        }
                    }
                } else {
                    tally.clean += 1;
                }
                if (400..500).contains(&status) && answer.trim().is_empty() {
                    bad.push(format!("{named}: {status} without a message"));
                }
            }
            Ok((status, answer)) => bad.push(format!("{named}: answered {status}: {answer}")),
            Err(why) => bad.push(format!("{named}: {why}")),
        }
        // Alive and answering after every case.
        match send(&front.socket, "GET", front.ping, b"") {
            Ok((200, _)) => {}
            other => bad.push(format!("{named}: then GET {} gave {other:?}", front.ping)),
        }
        if let Some(status) = front.process.try_status() {
            bad.push(format!(
                "{named}: {} ended with {status}:\n{}",
                front.name,
                tail(&front.process.stderr())
            ));
        }
        case += 1;
    }
    for front in &mut front_ends {
        assert!(
            front.process.try_status().is_none(),
            "{} ended: {}",
            front.name,
            front.process.stderr()
        );
        let stderr = front.process.stderr();
        assert!(!stderr.contains("panicked"), "{}: {stderr}", front.name);
    }
    budget.finish(case, &tally, &bad);
}
