//! gpuvm as Firecracker's `jailer` (a symlink to the binary, or `gpuvm jailer`): the jail
//! it builds (`<base>/firecracker/<id>/root` with a copy of the exec file, device nodes,
//! /run owned by the unprivileged user), the process it execs (uid/gid, its own mount
//! namespace rooted in the jail, the cgroup and resource limits), a Firecracker client
//! sequence over the jailed API socket, `--daemonize` and `--new-pid-ns`, and refusals
//! of bad command lines that leave nothing behind.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::{api_expect, gpuvm_bin, run_gpuvm, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
const UID: u32 = 1234;
const GID: u32 = 1235;

/// `<scratch>/<name>`: a symlink to gpuvm (`jailer`, `firecracker`).
fn link(scratch: &Scratch, name: &str) -> PathBuf {
    let link = scratch.path(name);
    if !link.exists() {
        std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    }
    link
}

/// The jail base directory, created empty.
fn base(scratch: &Scratch) -> PathBuf {
    let base = scratch.path("jails");
    std::fs::create_dir_all(&base).unwrap();
    base
}

fn jail_args(scratch: &Scratch, id: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--id",
        id,
        "--exec-file",
        link(scratch, "firecracker").to_str().unwrap(),
        "--uid",
        &UID.to_string(),
        "--gid",
        &GID.to_string(),
        "--chroot-base-dir",
        base(scratch).to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn status_field(pid: i32, name: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !ready() {
        assert!(Instant::now() < deadline, "waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_for_socket(socket: &Path) {
    wait_for(&format!("{}", socket.display()), || {
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
}

/// A process this test did not start as a child (daemonized, or in its own PID
/// namespace): killed, and waited for until it is gone.
struct Detached(i32);

impl Drop for Detached {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the VMM this test started (its pid from the jail's pid file).
        unsafe { libc::kill(self.0, libc::SIGKILL) };
        let deadline = Instant::now() + LIMIT;
        while Instant::now() < deadline
            && !matches!(
                status_field(self.0, "State:").chars().next(),
                None | Some('Z')
            )
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The cgroup hierarchy this host lets the test write, and the `--cgroup` value to set in
/// it: v2's cpu controller where the unified hierarchy has it (preferred), else v1's; Err
/// with the reason where neither is mounted writable.
fn writable_cgroup() -> Result<(&'static str, PathBuf, &'static str, &'static str), String> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let writable_mounts = || {
        mounts.lines().filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let options: Vec<&str> = fields.get(3)?.split(',').collect();
            options
                .contains(&"rw")
                .then(|| (fields[2], PathBuf::from(fields[1]), options))
        })
    };
    for (fs_type, root, _) in writable_mounts() {
        let controllers =
            std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        if fs_type == "cgroup2" && controllers.split_whitespace().any(|c| c == "cpu") {
            return Ok(("2", root, "cpu.max", "50000 100000"));
        }
    }
    for (fs_type, root, options) in writable_mounts() {
        if fs_type == "cgroup" && options.contains(&"cpu") {
            return Ok(("1", root, "cpu.cfs_quota_us", "50000"));
        }
    }
    Err("no writable cgroup hierarchy with the cpu controller in /proc/mounts".into())
}

/// Boots the test guest with `cmdline` through the Firecracker API of the jail at `root`
/// (its socket at /run/api.sock), the kernel copied into the jail as Firecracker's docs
/// ask.
fn boot_memloop(root: &Path, cmdline: &str) {
    let api = root.join("run/api.sock");
    let kernel = root.join("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        LIMIT,
    )
    .assert_code(0);
    api_expect(
        &api,
        204,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64}"#),
    );
    let boot = serde_json::json!({"kernel_image_path": "/vmlinux", "boot_args": cmdline});
    api_expect(&api, 204, "PUT", "/boot-source", Some(&boot.to_string()));
    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
}

/// A jail with an open-files limit of 1000 and, where the host lets the test write one, a
/// cgroup value under a parent cgroup of the test's own (removed when dropped, once the
/// VMM has gone).
struct LimitedJail {
    cgroup: Result<(&'static str, PathBuf, &'static str, &'static str), String>,
    parent: String,
    id: String,
}

impl LimitedJail {
    fn new(parent: &str, id: &str) -> LimitedJail {
        LimitedJail {
            cgroup: writable_cgroup(),
            parent: format!("{parent}-{}", std::process::id()),
            id: id.to_string(),
        }
    }

    /// The jailer's arguments for it, the VMM's API socket at /run/api.sock.
    fn args(&self, scratch: &Scratch) -> Vec<String> {
        let mut extra: Vec<String> = vec!["--resource-limit".into(), "no-file=1000".into()];
        if let Ok((version, _, file, value)) = &self.cgroup {
            extra.extend([
                "--cgroup-version".into(),
                version.to_string(),
                "--cgroup".into(),
                format!("{file}={value}"),
                "--parent-cgroup".into(),
                self.parent.clone(),
            ]);
        }
        extra.extend(["--", "--api-sock", "/run/api.sock"].map(String::from));
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        jail_args(scratch, &self.id, &extra)
    }
}

impl Drop for LimitedJail {
    fn drop(&mut self) {
        if let Ok((_, hierarchy, _, _)) = &self.cgroup {
            let _ = std::fs::remove_dir(hierarchy.join(&self.parent).join(&self.id));
            let _ = std::fs::remove_dir(hierarchy.join(&self.parent));
        }
    }
}

#[test]
fn jailed_firecracker_serves_its_api_and_boots_as_the_jailed_user() {
    let scratch = Scratch::new("jailer", "boots");
    let jail = LimitedJail::new("gpuvm-jailer-test", "t1");
    let (cgroup, parent) = (&jail.cgroup, &jail.parent);
    if let Err(reason) = cgroup {
        println!("skipping the cgroup checks: {reason}");
    }
    let args = jail.args(&scratch);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vmm = SpawnedProcess::spawn(&link(&scratch, "jailer"), &args);
    let root = base(&scratch).join("firecracker/t1/root");
    let api = root.join("run/api.sock");
    vmm.wait_until("the jailed API socket", LIMIT, |_| {
        std::os::unix::net::UnixStream::connect(&api).is_ok()
    });
    let pid = vmm.pid();

    // The exec'd VMM is the jailer's process (no --daemonize, no --new-pid-ns), running
    // as the given user, in its own mount namespace whose root is the jail.
    assert_eq!(
        status_field(pid, "Uid:"),
        format!("{UID} {UID} {UID} {UID}")
    );
    assert_eq!(
        status_field(pid, "Gid:"),
        format!("{GID} {GID} {GID} {GID}")
    );
    assert_eq!(status_field(pid, "Groups:"), "");
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    assert_ne!(ns(&pid.to_string()), ns("self"));
    let mut seen: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    seen.sort();
    assert_eq!(seen, ["dev", "firecracker", "firecracker.pid", "run"]);
    assert_eq!(
        std::fs::read_to_string(root.join("firecracker.pid")).unwrap(),
        pid.to_string()
    );
    // The exec file is a copy owned by the user, not the binary itself.
    let copy = std::fs::metadata(root.join("firecracker")).unwrap();
    let original = std::fs::metadata(gpuvm_bin()).unwrap();
    assert_ne!(copy.ino(), original.ino());
    assert_eq!(
        (copy.len(), copy.uid(), copy.gid()),
        (original.len(), UID, GID)
    );
    for (node, major, minor) in [("dev/kvm", 10, 232), ("dev/net/tun", 10, 200)] {
        let meta = std::fs::metadata(root.join(node)).unwrap();
        assert!(meta.file_type().is_char_device(), "{node}");
        assert_eq!(meta.rdev(), libc::makedev(major, minor), "{node}");
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (UID, GID, 0o600)
        );
    }
    let run = std::fs::metadata(root.join("run")).unwrap();
    assert_eq!((run.uid(), run.mode() & 0o777), (UID, 0o700));
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    assert_eq!(
        open_files.split_whitespace().collect::<Vec<_>>()[3..5],
        ["1000", "1000"],
        "{open_files}"
    );
    if let Ok((_, hierarchy, file, value)) = &cgroup {
        let dir = hierarchy.join(parent).join("t1");
        let written = std::fs::read_to_string(dir.join(file)).unwrap();
        assert_eq!(written.trim(), *value);
        let member = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert!(
            member.contains(&format!("/{parent}/t1\n")),
            "{pid} is not in {}: {member}",
            dir.display()
        );
    }

    // A Firecracker client's sequence over the jailed socket.
    let info = || -> serde_json::Value {
        serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap()
    };
    assert_eq!(info()["id"], "t1");
    assert_eq!(info()["state"], "Not started");
    boot_memloop(&root, "memloop 1M 7 0");
    vmm.wait_for_stdout("memloop: cpus=1", LIMIT);
    assert_eq!(info()["state"], "Running");
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);
}

/// What a jailed process is confined by, as /proc shows it from outside.
#[derive(Debug, PartialEq)]
struct Confinement {
    uid: String,
    gid: String,
    groups: String,
    namespaces: Vec<PathBuf>,
    root_entries: Vec<String>,
    cgroups: String,
    open_files_limit: String,
}

fn confinement(pid: i32) -> Confinement {
    let mut root_entries: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    root_entries.sort();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    Confinement {
        uid: status_field(pid, "Uid:"),
        gid: status_field(pid, "Gid:"),
        groups: status_field(pid, "Groups:"),
        namespaces: ["mnt", "net", "pid", "ipc", "uts"]
            .iter()
            .map(|ns| std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap())
            .collect(),
        root_entries,
        cgroups: std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap(),
        open_files_limit: limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap()
            .to_string(),
    }
}

/// The memloop iterations in `stdout`.
fn memloop_iterations(stdout: &str) -> usize {
    stdout
        .lines()
        .filter(|line| line.starts_with("memloop: iter ") && line.contains(" ok"))
        .count()
}

/// A live update of a jailed VMM (the jailer's mount namespace, cgroup, limits and user):
/// the new gpuvm is started inside the same jail, from a copy of its binary in the jail,
/// and the VM runs on there; twice, the second time with another binary, which becomes the
/// jail's.
#[test]
fn a_jailed_vmm_is_updated_inside_its_jail() {
    let scratch = Scratch::new("jailer", "update");
    let jail = LimitedJail::new("gpuvm-jailer-update", "u1");
    let args = jail.args(&scratch);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut first = SpawnedProcess::spawn(&link(&scratch, "jailer"), &args);
    let root = base(&scratch).join("firecracker/u1/root");
    let api = root.join("run/api.sock");
    first.wait_until("the jailed API socket", LIMIT, |_| {
        std::os::unix::net::UnixStream::connect(&api).is_ok()
    });
    boot_memloop(&root, "memloop 4M 7 0");
    first.wait_for_stdout("memloop: iter 2 ok", LIMIT);
    let jailed = confinement(first.pid());
    assert_eq!(jailed.uid, format!("{UID} {UID} {UID} {UID}"));
    let mut owner = first.pid();
    // The process a later update started is not this test's child: ended when the test ends,
    // whatever fails.
    let mut _later: Option<Detached> = None;
    let gpuvm_copy = scratch.path("gpuvm-new");
    std::fs::copy(gpuvm_bin(), &gpuvm_copy).unwrap();
    for binary in [None, Some(&gpuvm_copy)] {
        let mut extra = Vec::new();
        if let Some(binary) = binary {
            extra.extend(["--binary", binary.to_str().unwrap()]);
        }
        let seen = memloop_iterations(&first.stdout());
        let out = gpuvm_tests::gpuvm_update(owner, &extra, &[]);
        let context = format!("{}\n{}", first.stdout(), first.stderr());
        let new = gpuvm_tests::updated_to(&out, &context);
        gpuvm_tests::wait_process_gone(owner, LIMIT, || context.clone());
        owner = new;
        _later = Some(Detached(new));
        // Everything the jail confines, the same: nothing of the update is left in it.
        assert_eq!(confinement(new), jailed, "{context}");
        assert_eq!(
            std::fs::read_link(format!("/proc/{new}/exe")).unwrap(),
            PathBuf::from("/firecracker")
        );
        let installed = std::fs::metadata(root.join("firecracker")).unwrap();
        assert_eq!(
            (installed.len(), installed.uid(), installed.gid()),
            (std::fs::metadata(gpuvm_bin()).unwrap().len(), UID, GID)
        );
        // The jailed API answers from the new process, and the guest goes on.
        let info: serde_json::Value =
            serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap();
        assert_eq!(
            (&info["id"], &info["state"]),
            (&"u1".into(), &"Running".into())
        );
        first.wait_until("more memloop iterations", LIMIT, |out| {
            memloop_iterations(&out.stdout()) > seen + 2
        });
    }
    // The jail's binary is the second update's: a new inode, the old ones' gone.
    assert_eq!(
        std::fs::read(root.join("firecracker")).unwrap(),
        std::fs::read(&gpuvm_copy).unwrap()
    );
    assert!(first.try_status().is_some_and(|s| s.success()));
}

#[test]
fn daemonize_returns_at_once_and_the_vmm_runs_on() {
    let scratch = Scratch::new("jailer", "daemonize");
    let args = jail_args(
        &scratch,
        "d1",
        &["--daemonize", "--", "--api-sock", "/run/api.sock"],
    );
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.insert(0, "jailer");
    let jailer = SpawnedProcess::gpuvm(&args).wait(LIMIT);
    assert_eq!(jailer.code(), Some(0), "{}", jailer.describe());
    assert_eq!((jailer.stdout.as_str(), jailer.stderr.as_str()), ("", ""));
    let root = base(&scratch).join("firecracker/d1/root");
    let pid_file = root.join("firecracker.pid");
    wait_for("the pid file", || {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.parse::<i32>().is_ok())
    });
    let vmm = Detached(std::fs::read_to_string(&pid_file).unwrap().parse().unwrap());
    let api = root.join("run/api.sock");
    wait_for_socket(&api);
    let info: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap();
    assert_eq!(info["id"], "d1");
    assert_eq!(
        status_field(vmm.0, "Uid:"),
        format!("{UID} {UID} {UID} {UID}")
    );
    // Detached: its own session, stdio on /dev/null.
    // Its own session, of which it is not the leader (the second fork), so no terminal
    // can become its controlling one.
    let session: i32 = status_field(vmm.0, "NSsid:").parse().unwrap();
    // SAFETY: getsid(2) of this process reads no memory.
    assert_ne!(session, unsafe { libc::getsid(0) });
    assert_ne!(session, vmm.0);
    for fd in 0..3 {
        assert_eq!(
            std::fs::read_link(format!("/proc/{}/fd/{fd}", vmm.0)).unwrap(),
            PathBuf::from("/dev/null")
        );
    }
}

/// Runs the jailer for jail `id` with `--new-pid-ns` (the VMM's API at /run/api.sock), the
/// VMM's stdout going to `stdout`; returns the jail's root and the VMM's pid (from the pid
/// file) once the jailer has left. The VMM keeps the stdio it inherits, so the jailer's go to
/// files (pipes would stay open).
fn jail_in_new_pid_ns(scratch: &Scratch, id: &str, stdout: std::fs::File) -> (PathBuf, i32) {
    let args = jail_args(
        scratch,
        id,
        &["--new-pid-ns", "--", "--api-sock", "/run/api.sock"],
    );
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.insert(0, "jailer");
    let errors = scratch.path(&format!("{id}.stderr"));
    let status = std::process::Command::new(gpuvm_bin())
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(std::fs::File::create(&errors).unwrap())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "{status}: {}",
        std::fs::read_to_string(&errors).unwrap_or_default()
    );
    let root = base(scratch).join(format!("firecracker/{id}/root"));
    let pid = std::fs::read_to_string(root.join("firecracker.pid"))
        .unwrap()
        .parse()
        .unwrap();
    (root, pid)
}

#[test]
fn new_pid_ns_runs_the_vmm_as_pid_1_of_its_namespace() {
    let scratch = Scratch::new("jailer", "pidns");
    let (root, pid) = jail_in_new_pid_ns(&scratch, "p1", std::fs::File::open("/dev/null").unwrap());
    let vmm = Detached(pid);
    let api = root.join("run/api.sock");
    wait_for_socket(&api);
    assert_eq!(status_field(vmm.0, "NSpid:"), format!("{pid} 1"));
    let info: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap();
    assert_eq!(info["state"], "Not started");
}

/// A live update of a VMM that is pid 1 of its own PID namespace (`--new-pid-ns`): the
/// new gpuvm cannot live in that namespace (its init's exit kills it), so it is pid 1 of a
/// new one of its own, in the same jail; the new one knows the old one's offer by a token. The
/// jail's pid file follows the VM.
#[test]
fn a_vmm_that_is_init_of_its_pid_namespace_is_updated_into_one_of_its_own() {
    let scratch = Scratch::new("jailer", "pidns-update");
    // The VMM keeps the stdio it inherits: the guest's serial output goes to a file.
    let console = scratch.path("console");
    let (root, _) = jail_in_new_pid_ns(&scratch, "p2", std::fs::File::create(&console).unwrap());
    let pid_file = root.join("firecracker.pid");
    let read_pid = || -> i32 { std::fs::read_to_string(&pid_file).unwrap().parse().unwrap() };
    let mut vmm = Detached(read_pid());
    let api = root.join("run/api.sock");
    wait_for_socket(&api);
    boot_memloop(&root, "memloop 4M 7 0");
    let iterations = || memloop_iterations(&std::fs::read_to_string(&console).unwrap_or_default());
    wait_for("memloop iterations", || iterations() > 2);
    let pid_ns = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap();
    let jailed = confinement(vmm.0);
    let gpuvm_copy = scratch.path("gpuvm-new");
    std::fs::copy(gpuvm_bin(), &gpuvm_copy).unwrap();
    for binary in [None, Some(&gpuvm_copy)] {
        let mut extra = Vec::new();
        if let Some(binary) = binary {
            extra.extend(["--binary", binary.to_str().unwrap()]);
        }
        let old = vmm.0;
        let seen = iterations();
        let out = gpuvm_tests::gpuvm_update(old, &extra, &[]);
        let context = || {
            format!(
                "{}\n{}",
                std::fs::read_to_string(&console).unwrap_or_default(),
                std::fs::read_to_string(scratch.path("p2.stderr")).unwrap_or_default()
            )
        };
        let new = gpuvm_tests::updated_to(&out, &context());
        gpuvm_tests::wait_process_gone(old, LIMIT, context);
        vmm = Detached(new);
        // Pid 1 of a pid namespace of its own, neither the old one's nor the host's.
        assert_eq!(status_field(new, "NSpid:"), format!("{new} 1"));
        assert_ne!(
            pid_ns(new),
            std::fs::read_link("/proc/self/ns/pid").unwrap()
        );
        assert_eq!(read_pid(), new);
        // Otherwise confined as the first: the pid namespace aside, the same.
        let mut now = confinement(new);
        assert_ne!(now.namespaces[2], jailed.namespaces[2]);
        now.namespaces[2] = jailed.namespaces[2].clone();
        assert_eq!(now, jailed);
        let info: serde_json::Value =
            serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap();
        assert_eq!(info["state"], "Running");
        wait_for("memloop iterations after the update", || {
            iterations() > seen + 2
        });
    }
}

#[test]
fn bad_command_lines_are_refused_and_leave_nothing_behind() {
    let scratch = Scratch::new("jailer", "refusals");
    let fc = link(&scratch, "firecracker");
    let fc = fc.to_str().unwrap();
    let base_dir = base(&scratch);
    let base_dir = base_dir.to_str().unwrap();
    let long_id = "a".repeat(65);
    let missing = scratch.path("no-such-vmm");
    let missing = missing.to_str().unwrap();
    let common = [
        "--uid",
        "1234",
        "--gid",
        "1234",
        "--chroot-base-dir",
        base_dir,
    ];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--id", "../x", "--exec-file", fc],
            "invalid instance id \"../x\"",
        ),
        (vec!["--id", &long_id, "--exec-file", fc], "length is 65"),
        (vec!["--id", "ok", "--exec-file", missing], "no-such-vmm"),
        (
            vec!["--id", "ok", "--exec-file", fc, "--bogus"],
            "unknown argument \"--bogus\"",
        ),
        (
            vec!["--id", "ok", "--exec-file", fc, "--cgroup", "nosuchctl.x=1"],
            "nosuchctl",
        ),
        (
            vec![
                "--id",
                "ok",
                "--exec-file",
                fc,
                "--netns",
                "/var/run/netns/gpuvm-none",
            ],
            "gpuvm-none",
        ),
    ];
    for (mut args, needle) in cases {
        args.insert(0, "jailer");
        args.extend_from_slice(&common);
        let out = run_gpuvm(&args, LIMIT);
        assert_eq!(out.code(), Some(1), "{args:?}: {}", out.describe());
        assert!(out.stderr.contains(needle), "{args:?}: {}", out.describe());
        assert!(
            std::fs::read_dir(base_dir).unwrap().next().is_none(),
            "{args:?} left something in {base_dir}"
        );
    }
    // A value the cgroup refuses fails after the jail and the cgroup were created: both go.
    match writable_cgroup() {
        Ok((version, hierarchy, _, _)) => {
            let parent = format!("gpuvm-jailer-refusal-{}", std::process::id());
            let mut args = vec!["jailer", "--id", "ok", "--exec-file", fc];
            args.extend_from_slice(&common);
            args.extend([
                "--cgroup-version",
                version,
                "--cgroup",
                "cpu.no_such_file=1",
                "--parent-cgroup",
                &parent,
            ]);
            let out = run_gpuvm(&args, LIMIT);
            assert_eq!(out.code(), Some(1), "{}", out.describe());
            out.assert_stderr_has("cpu.no_such_file");
            assert!(std::fs::read_dir(base_dir).unwrap().next().is_none());
            let left = hierarchy.join(&parent);
            let existed = left.exists();
            let _ = std::fs::remove_dir(left.join("ok"));
            let _ = std::fs::remove_dir(&left);
            assert!(!existed, "{} was left behind", left.display());
        }
        Err(reason) => println!("skipping the cgroup refusal: {reason}"),
    }
    for (drop, flag) in [
        ("--uid", "--uid is required"),
        ("--gid", "--gid is required"),
    ] {
        let mut args = vec!["jailer", "--id", "ok", "--exec-file", fc];
        let mut rest = common.iter();
        while let Some(arg) = rest.next() {
            let value = rest.next().unwrap();
            if *arg != drop {
                args.extend([*arg, *value]);
            }
        }
        let out = run_gpuvm(&args, LIMIT);
        assert_eq!(out.code(), Some(1), "{}", out.describe());
        out.assert_stderr_has(flag);
        assert!(std::fs::read_dir(base_dir).unwrap().next().is_none());
    }
}

/// Kata's jailed Firecracker with both paths resolved (`filepath.EvalSymlinks`): the jailer
/// is gpuvm's own path with the jailer's flags, and its exec file is gpuvm itself, which
/// the jail starts as `/gpuvm --id ... --start-time-us ...`: Firecracker's flags under
/// gpuvm's name, which pick the Firecracker front end.
#[test]
fn gpuvm_by_its_own_name_jails_itself_as_firecracker() {
    let scratch = Scratch::new("jailer", "own-name");
    let gpuvm = std::fs::canonicalize(gpuvm_bin()).unwrap();
    assert_eq!(gpuvm.file_name().unwrap(), "gpuvm");
    let base = base(&scratch);
    let args = [
        "--id",
        "own1",
        "--exec-file",
        gpuvm.to_str().unwrap(),
        "--uid",
        &UID.to_string(),
        "--gid",
        &GID.to_string(),
        "--chroot-base-dir",
        base.to_str().unwrap(),
        "--daemonize",
        "--",
        "--api-sock",
        "/run/api.sock",
    ];
    let jailer = SpawnedProcess::spawn(&gpuvm, &args).wait(LIMIT);
    assert_eq!(jailer.code(), Some(0), "{}", jailer.describe());
    let root = base.join("gpuvm/own1/root");
    let pid_file = root.join("gpuvm.pid");
    wait_for("the pid file", || {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.parse::<i32>().is_ok())
    });
    let vmm = Detached(std::fs::read_to_string(&pid_file).unwrap().parse().unwrap());
    let api = root.join("run/api.sock");
    wait_for_socket(&api);
    let info: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap();
    assert_eq!(info["id"], "own1");
    assert_eq!(info["state"], "Not started");
    assert_eq!(
        status_field(vmm.0, "Uid:"),
        format!("{UID} {UID} {UID} {UID}")
    );
}
