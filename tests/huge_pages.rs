//! Huge pages for shared guest RAM by default: gpuvm puts guest RAM on a private
//! `huge=advise` tmpfs (memory/src/huge_tmpfs.rs), so a guest's pages are 2 MiB even where
//! the host's shmem THP policy is `never`; without the mount (no CAP_SYS_ADMIN, or
//! `GPUVM_NO_HUGE_TMPFS` as here) it is a plain memfd and gpuvm says so in one line.

use std::time::Duration;

use gpuvm_tests::SpawnedProcess;

const LIMIT: Duration = Duration::from_secs(60);
const FALLBACK_NOTE: &str = "no private huge-page tmpfs";

/// What /proc/PID/smaps says about the guest RAM mappings: which file backs them and how
/// many bytes the kernel maps with 2 MiB entries.
#[derive(Debug, Default)]
struct GuestRamMappings {
    files: Vec<String>,
    pmd_mapped: u64,
}

fn guest_ram_mappings(pid: i32) -> GuestRamMappings {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut found = GuestRamMappings::default();
    let mut in_guest_ram = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode path".
            let path = fields.nth(4).unwrap_or("").to_string();
            in_guest_ram = path.contains("gpuvm-guest-ram");
            if in_guest_ram && !found.files.contains(&path) {
                found.files.push(path);
            }
            continue;
        }
        if in_guest_ram && (first == "ShmemPmdMapped:" || first == "FilePmdMapped:") {
            let kib: u64 = fields.next().unwrap().parse().unwrap();
            found.pmd_mapped += kib * 1024;
        }
    }
    found
}

/// Whether this process may mount (CAP_SYS_ADMIN); gpuvm inherits what we have.
fn can_mount() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    effective & (1 << CAP_SYS_ADMIN) != 0
}

/// Boots a memloop guest over 64 MiB, waits for its first pass, and returns what smaps
/// shows for guest RAM and gpuvm's stderr.
fn first_pass(args: &[&str], env: &[(&str, &str)]) -> (GuestRamMappings, String) {
    let mut all_args = vec!["run", "--memory", "256M", "--cmdline", "memloop 64M 5 0"];
    all_args.extend_from_slice(args);
    let mut env = env.to_vec();
    env.push(("GPUVM_LOG", "info"));
    let mut vm = SpawnedProcess::gpuvm_with_env(&all_args, &env);
    vm.wait_for_stdout("memloop: iter 0 ok", LIMIT);
    let mappings = guest_ram_mappings(vm.pid());
    vm.signal(libc::SIGKILL);
    let out = vm.wait(LIMIT);
    (mappings, out.stderr)
}

#[test]
fn by_default_guest_ram_is_on_huge_pages() {
    if !can_mount() {
        eprintln!("skipped: no CAP_SYS_ADMIN here, so gpuvm cannot mount its tmpfs");
        return;
    }
    let (mappings, stderr) = first_pass(&[], &[]);
    assert!(
        stderr.contains("shmem on a private huge-page tmpfs"),
        "{stderr}"
    );
    assert!(!stderr.contains(FALLBACK_NOTE), "{stderr}");
    // The unlinked file on the private mount, not a memfd.
    assert_eq!(
        mappings.files,
        ["/gpuvm-guest-ram"],
        "{mappings:?}\n{stderr}"
    );
    // memloop wrote 64 MiB above 16 MiB: nearly all of it in 2 MiB pages.
    assert!(
        mappings.pmd_mapped >= 60 << 20,
        "only {} KiB PMD-mapped: {mappings:?}\n{stderr}",
        mappings.pmd_mapped >> 10
    );
}

#[test]
fn without_the_mount_guest_ram_is_a_memfd_and_gpuvm_says_so_once() {
    let (mappings, stderr) = first_pass(&[], &[("GPUVM_NO_HUGE_TMPFS", "1")]);
    let notes: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains(FALLBACK_NOTE))
        .collect();
    assert_eq!(notes.len(), 1, "{stderr}");
    assert!(notes[0].contains("GPUVM_NO_HUGE_TMPFS is set"), "{stderr}");
    assert!(notes[0].contains("a plain memfd"), "{stderr}");
    assert_eq!(
        mappings.files,
        ["/memfd:gpuvm-guest-ram"],
        "{mappings:?}\n{stderr}"
    );
    // This host's shmem THP policy decides the pages then; with `never` they are small.
    let policy =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap();
    if policy.contains("[never]") {
        assert_eq!(mappings.pmd_mapped, 0, "{mappings:?}");
    }
}

#[test]
fn no_thp_asks_for_a_plain_memfd_without_a_note() {
    let (mappings, stderr) = first_pass(&["--no-thp"], &[]);
    assert!(!stderr.contains(FALLBACK_NOTE), "{stderr}");
    assert!(
        stderr.contains("guest RAM: 256 MiB memfd (4 KiB pages)"),
        "{stderr}"
    );
    assert_eq!(
        mappings.files,
        ["/memfd:gpuvm-guest-ram"],
        "{mappings:?}\n{stderr}"
    );
    assert_eq!(mappings.pmd_mapped, 0, "{mappings:?}");
}
