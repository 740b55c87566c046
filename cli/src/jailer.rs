//! gpuvm as Firecracker's `jailer`: when the binary is invoked under that name (a symlink)
//! or as `gpuvm jailer ...`, it takes the jailer's command line, builds the jail the same
//! way and execs the exec file inside it, so platforms that start Firecracker through its
//! jailer start gpuvm (installed as `firecracker`) unchanged.
//!
//! The steps, in the jailer's order: validate every flag, path and the id (nothing is
//! created before that passes); create `<chroot-base>/<exec-name>/<id>/root` and copy the
//! exec file into it; join `--netns`; set the resource limits; create and fill the cgroup
//! and move into it; a new mount namespace with the jail as its root (pivot_root, the old
//! root detached); the jail's directories and device nodes owned by `--uid:--gid`;
//! `--daemonize`; `--new-pid-ns`; the pid file; drop to `--uid`/`--gid` (the shared
//! [`crate::jail::drop_privileges`]); exec `/<exec-name> --id <id> --start-time-us ...
//! --start-time-cpu-us ... --parent-cpu-time-us ... <args after -->` with an empty
//! environment. Every error before the exec exits 1, as Firecracker's jailer does.

use std::ffi::{CString, OsString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;

/// The status of every jailer error, as Firecracker's jailer (its `main` returns an error).
const JAILER_ERROR: u8 = 1;
const DEFAULT_CHROOT_BASE: &str = "/srv/jailer";
const MAX_ID_LEN: usize = 64;
/// The jailer bounds the number of open files to this unless `--resource-limit no-file=`.
const DEFAULT_NO_FILE: u64 = 2048;
const PROC_MOUNTS: &str = "/proc/mounts";
/// The directories of the jail, owned by the unprivileged user (the VMM creates its API
/// socket in /run).
const JAIL_DIRS: [&str; 4] = ["/", "/dev", "/dev/net", "/run"];
const JAIL_DIR_MODE: u32 = 0o700;
/// Device nodes every jail gets, with the numbers Linux fixes for them (the jailer creates
/// them even when the host lacks the node: they must exist for the VMM to start).
const REQUIRED_NODES: [(&str, u32, u32); 2] = [("/dev/kvm", 10, 232), ("/dev/net/tun", 10, 200)];
/// Device nodes a jail gets where the host has them: entropy, lazy restore
/// (userfaultfd), PCI passthrough (every node under /dev/vfio).
const OPTIONAL_NODES: [&str; 2] = ["/dev/urandom", "/dev/userfaultfd"];
const VFIO_DIR: &str = "/dev/vfio";

const USAGE: &str = "\
usage: jailer --id <id> --exec-file <file> --uid <uid> --gid <gid>
              [--chroot-base-dir <dir>] [--netns <path>] [--daemonize] [--new-pid-ns]
              [--cgroup <file>=<value>]... [--cgroup-version 1|2] [--parent-cgroup <path>]
              [--resource-limit fsize=<n>|no-file=<n>]... [-- <arguments for the exec file>]";

#[derive(Debug, thiserror::Error)]
pub enum JailerError {
    #[error("unknown argument {0:?}\n{USAGE}")]
    UnknownArgument(String),
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    #[error("{0} is given twice")]
    Duplicate(&'static str),
    #[error("{0} is required\n{USAGE}")]
    Required(&'static str),
    #[error("invalid instance id {id:?}: {why}")]
    InvalidId { id: String, why: String },
    #[error("invalid {flag} {value:?}: not a number")]
    InvalidNumber { flag: &'static str, value: String },
    #[error("exec file {0}: {1}")]
    ExecFile(PathBuf, String),
    #[error("chroot base dir {0}: {1}")]
    ChrootBase(PathBuf, String),
    #[error("{0} already holds a jail: every jail needs a unique --id")]
    JailExists(PathBuf),
    #[error("netns {0}: {1}")]
    Netns(PathBuf, io::Error),
    #[error("invalid --cgroup {0:?}: it takes <controller>.<file>=<value>, with no '/'")]
    CgroupFormat(String),
    #[error("invalid --cgroup-version {0:?}: 1 or 2")]
    CgroupVersion(String),
    #[error("invalid --parent-cgroup {0:?}: a relative path without '.' or '..'")]
    ParentCgroup(String),
    #[error("no cgroup v{version} hierarchy in {PROC_MOUNTS} has the {controller} controller")]
    CgroupControllerMissing { version: u8, controller: String },
    #[error("invalid --resource-limit {0:?}: fsize=<bytes> or no-file=<count>")]
    ResourceLimitFormat(String),
    #[error("cannot set resource limit {resource}: {error}")]
    ResourceLimit { resource: String, error: io::Error },
    #[error("cannot {what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        error: io::Error,
    },
    #[error("cannot {0}: {1}")]
    Syscall(&'static str, io::Error),
    #[error("{0}")]
    Privileges(String),
    #[error("cannot exec {0}: {1}")]
    Exec(PathBuf, io::Error),
}

fn io_error<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> JailerError + 'a {
    move |error| JailerError::Io {
        what,
        path: path.to_owned(),
        error,
    }
}

/// Turns a -1 return of a libc call into the errno it left.
fn check(what: &'static str, result: libc::c_int) -> Result<libc::c_int, JailerError> {
    if result < 0 {
        Err(JailerError::Syscall(what, io::Error::last_os_error()))
    } else {
        Ok(result)
    }
}

fn c_path(path: &Path) -> Result<CString, JailerError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| JailerError::Io {
        what: "use",
        path: path.to_owned(),
        error: io::Error::new(io::ErrorKind::InvalidInput, "the path contains a NUL byte"),
    })
}

/// Whether this process should act as the jailer: argv[0]'s file name is `jailer`, or the
/// first argument is `jailer`.
pub fn wanted(args: &[String]) -> bool {
    let name = args
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned());
    name.as_deref() == Some("jailer") || args.get(1).map(String::as_str) == Some("jailer")
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Resource {
    FileSize,
    OpenFiles,
}

#[derive(Debug, PartialEq)]
struct JailerArgs {
    id: String,
    exec_file: PathBuf,
    uid: u32,
    gid: u32,
    chroot_base: PathBuf,
    netns: Option<PathBuf>,
    daemonize: bool,
    new_pid_ns: bool,
    /// `(file, value)`, e.g. `("cpu.max", "50000 100000")`.
    cgroups: Vec<(String, String)>,
    cgroup_version: u8,
    parent_cgroup: Option<PathBuf>,
    resource_limits: Vec<(Resource, u64)>,
    /// Everything after `--`, for the exec file.
    extra: Vec<String>,
}

#[derive(Debug, PartialEq)]
enum Parsed {
    Help,
    Version,
    Run(Box<JailerArgs>),
}

fn set_once<T>(slot: &mut Option<T>, name: &'static str, value: T) -> Result<(), JailerError> {
    if slot.replace(value).is_some() {
        return Err(JailerError::Duplicate(name));
    }
    Ok(())
}

fn parse_number<T: std::str::FromStr>(flag: &'static str, value: &str) -> Result<T, JailerError> {
    value.parse().map_err(|_| JailerError::InvalidNumber {
        flag,
        value: value.into(),
    })
}

/// The flags' syntax and the id; the paths are checked by [`plan`].
fn parse(args: &[String]) -> Result<Parsed, JailerError> {
    let skip = if args.get(1).map(String::as_str) == Some("jailer") {
        2
    } else {
        1
    };
    let mut rest = args.iter().skip(skip);
    let (mut id, mut exec_file, mut uid, mut gid) = (None, None, None, None);
    let (mut chroot_base, mut netns, mut version, mut parent) = (None, None, None, None);
    let (mut daemonize, mut new_pid_ns) = (false, false);
    let (mut cgroups, mut limits, mut extra) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(arg) = rest.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_string())),
            _ => (arg.as_str(), None),
        };
        macro_rules! value {
            ($flag:literal) => {
                match inline.clone().or_else(|| rest.next().cloned()) {
                    Some(value) => value,
                    None => return Err(JailerError::MissingValue($flag)),
                }
            };
        }
        match name {
            "--" => {
                extra.extend(rest.by_ref().cloned());
            }
            "--help" | "-h" => return Ok(Parsed::Help),
            "--version" => return Ok(Parsed::Version),
            "--id" => set_once(&mut id, "--id", value!("--id"))?,
            "--exec-file" => set_once(&mut exec_file, "--exec-file", value!("--exec-file"))?,
            "--uid" => set_once(&mut uid, "--uid", value!("--uid"))?,
            "--gid" => set_once(&mut gid, "--gid", value!("--gid"))?,
            "--chroot-base-dir" => set_once(
                &mut chroot_base,
                "--chroot-base-dir",
                value!("--chroot-base-dir"),
            )?,
            "--netns" => set_once(&mut netns, "--netns", value!("--netns"))?,
            "--cgroup-version" => {
                set_once(&mut version, "--cgroup-version", value!("--cgroup-version"))?
            }
            "--parent-cgroup" => {
                set_once(&mut parent, "--parent-cgroup", value!("--parent-cgroup"))?
            }
            "--daemonize" => daemonize = true,
            "--new-pid-ns" => new_pid_ns = true,
            "--cgroup" => cgroups.push(parse_cgroup(&value!("--cgroup"))?),
            "--resource-limit" => limits.push(parse_limit(&value!("--resource-limit"))?),
            _ => return Err(JailerError::UnknownArgument(arg.clone())),
        }
    }
    let id = id.ok_or(JailerError::Required("--id"))?;
    validate_id(&id)?;
    let exec_file = exec_file.ok_or(JailerError::Required("--exec-file"))?;
    let uid = parse_number("--uid", &uid.ok_or(JailerError::Required("--uid"))?)?;
    let gid = parse_number("--gid", &gid.ok_or(JailerError::Required("--gid"))?)?;
    let cgroup_version = match version.as_deref() {
        None | Some("1") => 1,
        Some("2") => 2,
        Some(other) => return Err(JailerError::CgroupVersion(other.into())),
    };
    let parent_cgroup = parent
        .map(|p| {
            let path = PathBuf::from(&p);
            let plain =
                !p.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)));
            plain.then_some(path).ok_or(JailerError::ParentCgroup(p))
        })
        .transpose()?;
    Ok(Parsed::Run(Box::new(JailerArgs {
        id,
        exec_file: exec_file.into(),
        uid,
        gid,
        chroot_base: chroot_base
            .unwrap_or_else(|| DEFAULT_CHROOT_BASE.into())
            .into(),
        netns: netns.map(PathBuf::from),
        daemonize,
        new_pid_ns,
        cgroups,
        cgroup_version,
        parent_cgroup,
        resource_limits: limits,
        extra,
    })))
}

/// Ids name directories and cgroups: ASCII letters, digits and `-`, 1 to 64 of them.
fn validate_id(id: &str) -> Result<(), JailerError> {
    let why = if id.is_empty() || id.len() > MAX_ID_LEN {
        format!("its length is {}, not 1 to {MAX_ID_LEN}", id.len())
    } else if let Some((position, c)) = id
        .chars()
        .enumerate()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '-'))
    {
        format!("character {c:?} at position {position}: only letters, digits and '-' are allowed")
    } else {
        return Ok(());
    };
    Err(JailerError::InvalidId { id: id.into(), why })
}

fn parse_cgroup(arg: &str) -> Result<(String, String), JailerError> {
    let bad = || JailerError::CgroupFormat(arg.into());
    let (file, value) = arg.split_once('=').ok_or_else(bad)?;
    let controller_ok = file
        .split_once('.')
        .is_some_and(|(controller, rest)| !controller.is_empty() && !rest.is_empty());
    if value.is_empty() || value.contains('=') || !controller_ok || file.contains('/') {
        return Err(bad());
    }
    if file == "." || file == ".." || file.starts_with('.') {
        return Err(bad());
    }
    Ok((file.into(), value.into()))
}

fn parse_limit(arg: &str) -> Result<(Resource, u64), JailerError> {
    let bad = || JailerError::ResourceLimitFormat(arg.into());
    let (name, value) = arg.split_once('=').ok_or_else(bad)?;
    let resource = match name {
        "fsize" => Resource::FileSize,
        "no-file" => Resource::OpenFiles,
        _ => return Err(bad()),
    };
    Ok((resource, value.parse().map_err(|_| bad())?))
}

/// Where the cgroup values go, found before anything is created.
#[derive(Debug)]
enum CgroupPlan {
    /// Create each directory, write its values, then move this process into it (v1: one
    /// directory per hierarchy holding a controller; v2: one in the unified hierarchy).
    Create {
        version: u8,
        groups: Vec<CgroupGroup>,
    },
    /// cgroup v2 with no `--cgroup`: move into `--parent-cgroup` (default the exec file's
    /// name) if it exists, as Firecracker's jailer does.
    MoveInto(PathBuf),
}

/// One cgroup to create: in hierarchy `root`, the directory `dir` and the values for it.
#[derive(Debug)]
struct CgroupGroup {
    root: PathBuf,
    dir: PathBuf,
    /// `(file, value)`.
    values: Vec<(String, String)>,
}

/// A character device to create in the jail.
#[derive(Debug, Clone)]
struct DeviceNode {
    path: PathBuf,
    rdev: libc::dev_t,
    required: bool,
}

/// Everything the jail needs, checked and resolved before anything is changed.
#[derive(Debug)]
struct Plan {
    args: JailerArgs,
    exec_source: PathBuf,
    exec_name: OsString,
    /// `<chroot-base>/<exec-name>/<id>`: what a failure before the chroot removes.
    instance_dir: PathBuf,
    chroot_dir: PathBuf,
    cgroups: Option<CgroupPlan>,
    nodes: Vec<DeviceNode>,
    no_file: u64,
    file_size: Option<u64>,
}

fn plan(args: JailerArgs) -> Result<Plan, JailerError> {
    let exec_source = fs::canonicalize(&args.exec_file)
        .map_err(|e| JailerError::ExecFile(args.exec_file.clone(), e.to_string()))?;
    if !exec_source.is_file() {
        return Err(JailerError::ExecFile(
            args.exec_file.clone(),
            "not a regular file".into(),
        ));
    }
    // The name the jail is filed under is the one given (a `firecracker` symlink to
    // gpuvm gives `firecracker`, which is how gpuvm then knows to act as Firecracker).
    let exec_name = args
        .exec_file
        .file_name()
        .ok_or_else(|| JailerError::ExecFile(args.exec_file.clone(), "no file name".into()))?
        .to_owned();
    let base = fs::canonicalize(&args.chroot_base)
        .map_err(|e| JailerError::ChrootBase(args.chroot_base.clone(), e.to_string()))?;
    if !base.is_dir() {
        return Err(JailerError::ChrootBase(base, "not a directory".into()));
    }
    let instance_dir = base.join(&exec_name).join(&args.id);
    let chroot_dir = instance_dir.join("root");
    if fs::read_dir(&chroot_dir).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(JailerError::JailExists(chroot_dir));
    }
    if let Some(netns) = &args.netns {
        File::open(netns).map_err(|e| JailerError::Netns(netns.clone(), e))?;
    }
    let parent = args
        .parent_cgroup
        .clone()
        .unwrap_or_else(|| PathBuf::from(&exec_name));
    let cgroups = plan_cgroups(
        &args,
        &parent,
        &fs::read_to_string(PROC_MOUNTS).unwrap_or_default(),
    )?;
    let mut no_file = DEFAULT_NO_FILE;
    let mut file_size = None;
    for (resource, value) in &args.resource_limits {
        match resource {
            Resource::OpenFiles => no_file = *value,
            Resource::FileSize => file_size = Some(*value),
        }
    }
    Ok(Plan {
        exec_source,
        exec_name,
        instance_dir,
        chroot_dir,
        cgroups,
        nodes: device_nodes(),
        no_file,
        file_size,
        args,
    })
}

/// The mount points in /proc/mounts of cgroup `version`, with their mount options.
fn cgroup_mounts(proc_mounts: &str, version: u8) -> Vec<(PathBuf, Vec<String>)> {
    let fs_type = if version == 1 { "cgroup" } else { "cgroup2" };
    proc_mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 4 && fields[2] == fs_type).then(|| {
                (
                    PathBuf::from(fields[1]),
                    fields[3].split(',').map(String::from).collect(),
                )
            })
        })
        .collect()
}

fn plan_cgroups(
    args: &JailerArgs,
    parent: &Path,
    proc_mounts: &str,
) -> Result<Option<CgroupPlan>, JailerError> {
    let version = args.cgroup_version;
    let missing = |controller: &str| JailerError::CgroupControllerMissing {
        version,
        controller: controller.into(),
    };
    if version == 2 {
        let Some((root, _)) = cgroup_mounts(proc_mounts, 2).into_iter().next() else {
            return if args.cgroups.is_empty() {
                Ok(None)
            } else {
                Err(missing("unified"))
            };
        };
        if args.cgroups.is_empty() {
            return Ok(Some(CgroupPlan::MoveInto(root.join(parent))));
        }
        let available = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        for (file, _) in &args.cgroups {
            let controller = controller_of(file);
            if !available.split_whitespace().any(|c| c == controller) {
                return Err(missing(controller));
            }
        }
        let dir = root.join(parent).join(&args.id);
        return Ok(Some(CgroupPlan::Create {
            version,
            groups: vec![CgroupGroup {
                root,
                dir,
                values: args.cgroups.clone(),
            }],
        }));
    }
    if args.cgroups.is_empty() {
        return Ok(None);
    }
    let mounts = cgroup_mounts(proc_mounts, 1);
    let mut groups: Vec<CgroupGroup> = Vec::new();
    for (file, value) in &args.cgroups {
        let controller = controller_of(file);
        let (root, _) = mounts
            .iter()
            .find(|(_, options)| options.iter().any(|o| o == controller))
            .ok_or_else(|| missing(controller))?;
        match groups.iter_mut().find(|group| &group.root == root) {
            Some(group) => group.values.push((file.clone(), value.clone())),
            None => groups.push(CgroupGroup {
                root: root.clone(),
                dir: root.join(parent).join(&args.id),
                values: vec![(file.clone(), value.clone())],
            }),
        }
    }
    Ok(Some(CgroupPlan::Create { version, groups }))
}

fn controller_of(file: &str) -> &str {
    file.split_once('.')
        .map_or(file, |(controller, _)| controller)
}

/// The device nodes to create: the required ones, and the optional ones the host has, with
/// the host's device numbers.
fn device_nodes() -> Vec<DeviceNode> {
    let mut nodes: Vec<DeviceNode> = REQUIRED_NODES
        .iter()
        .map(|(path, major, minor)| DeviceNode {
            path: path.into(),
            rdev: libc::makedev(*major, *minor),
            required: true,
        })
        .collect();
    let mut optional: Vec<PathBuf> = OPTIONAL_NODES.iter().map(PathBuf::from).collect();
    if let Ok(entries) = fs::read_dir(VFIO_DIR) {
        let mut vfio: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        vfio.sort();
        optional.extend(vfio);
    }
    for path in optional {
        if let Ok(meta) = fs::metadata(&path) {
            if meta.file_type().is_char_device() {
                nodes.push(DeviceNode {
                    path,
                    rdev: meta.rdev(),
                    required: false,
                });
            }
        }
    }
    nodes
}

/// Microseconds on `clock`.
fn clock_us(clock: libc::clockid_t) -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes one timespec into `now`, which outlives the call.
    unsafe { libc::clock_gettime(clock, &mut now) };
    (now.tv_sec as u64) * 1_000_000 + (now.tv_nsec as u64) / 1_000
}

/// Closes every inherited descriptor but stdin, stdout and stderr, so none leaks into the
/// jail (the jailer's first step).
fn close_inherited_fds() -> Result<(), JailerError> {
    // SAFETY: close_range(2) closes descriptors; nothing in this process holds one above 2
    // yet (this runs first).
    let result = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if result < 0 {
        return Err(JailerError::Syscall(
            "close inherited file descriptors",
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The `jailer` entry point.
pub fn main(args: &[String]) -> ExitCode {
    let start_us = clock_us(libc::CLOCK_MONOTONIC);
    let start_cpu_us = clock_us(libc::CLOCK_PROCESS_CPUTIME_ID);
    let result = close_inherited_fds().and_then(|()| parse(args));
    let plan = match result {
        Ok(Parsed::Help) => {
            println!("{USAGE}\n\nArguments after -- go to the exec file.");
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            println!(
                "Jailer v{} (gpuvm {})",
                gpuvm_api::firecracker::FIRECRACKER_API_VERSION,
                env!("CARGO_PKG_VERSION")
            );
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Run(args)) => plan(*args),
        Err(error) => Err(error),
    };
    let error = match plan {
        Ok(plan) => run(plan, start_us, start_cpu_us),
        Err(error) => error,
    };
    eprintln!("gpuvm: jailer: error: {error}");
    ExitCode::from(JAILER_ERROR)
}

/// Builds the jail and execs; returns only on failure.
fn run(plan: Plan, start_us: u64, start_cpu_us: u64) -> JailerError {
    // The topmost directory of the jail's path that this run creates.
    let created_dir = plan
        .instance_dir
        .parent()
        .into_iter()
        .chain([plan.instance_dir.as_path()])
        .find(|dir| !dir.exists())
        .map(Path::to_path_buf);
    let mut created_cgroups = Vec::new();
    if let Err(error) = prepare(&plan, &mut created_cgroups) {
        // Nothing of a failed jail is left: the directories this run created go.
        if let Some(dir) = created_dir {
            let _ = fs::remove_dir_all(dir);
        }
        for dir in created_cgroups.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
        return error;
    }
    match enter_and_exec(&plan, start_us, start_cpu_us) {
        Ok(never) => match never {},
        Err(error) => error,
    }
}

/// The steps before the chroot: the jail's directory and exec file, the netns, the limits
/// and the cgroups.
fn prepare(plan: &Plan, created_cgroups: &mut Vec<PathBuf>) -> Result<(), JailerError> {
    fs::create_dir_all(&plan.chroot_dir).map_err(io_error("create", &plan.chroot_dir))?;
    copy_exec_file(plan)?;
    if let Some(netns) = &plan.args.netns {
        let file = File::open(netns).map_err(|e| JailerError::Netns(netns.clone(), e))?;
        // SAFETY: setns(2) on a descriptor this function owns; it changes only this
        // (still single-threaded) process's network namespace.
        check("join the network namespace", unsafe {
            libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET)
        })?;
    }
    set_limit(libc::RLIMIT_NOFILE, "no-file", plan.no_file)?;
    if let Some(size) = plan.file_size {
        set_limit(libc::RLIMIT_FSIZE, "fsize", size)?;
    }
    match &plan.cgroups {
        None => {}
        Some(CgroupPlan::MoveInto(dir)) if dir.is_dir() => {
            write_cgroup_file(&dir.join("cgroup.procs"), &std::process::id().to_string())?;
        }
        Some(CgroupPlan::MoveInto(_)) => {}
        Some(CgroupPlan::Create { version, groups }) => {
            for group in groups {
                create_cgroup(*version, group, created_cgroups)?;
            }
            // Moving in comes last, once every value is written (cpuset needs its cpus
            // and mems before it takes a task).
            let tasks = if *version == 1 {
                "tasks"
            } else {
                "cgroup.procs"
            };
            for group in groups {
                write_cgroup_file(&group.dir.join(tasks), &std::process::id().to_string())?;
            }
        }
    }
    Ok(())
}

/// Copies (never links) the exec file into the jail, so no two VMMs share its pages,
/// owned by the unprivileged user.
fn copy_exec_file(plan: &Plan) -> Result<(), JailerError> {
    let target = plan.chroot_dir.join(&plan.exec_name);
    let mut source = File::open(&plan.exec_source).map_err(io_error("open", &plan.exec_source))?;
    let mode = source
        .metadata()
        .map_err(io_error("stat", &plan.exec_source))?
        .permissions()
        .mode();
    let mut copy = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(mode & 0o7777)
        .open(&target)
        .map_err(io_error("create", &target))?;
    std::os::unix::fs::fchown(&copy, Some(plan.args.uid), Some(plan.args.gid))
        .map_err(io_error("chown", &target))?;
    io::copy(&mut source, &mut copy).map_err(io_error("copy the exec file to", &target))?;
    // The copy is closed here: exec of a file open for writing fails (ETXTBSY).
    Ok(())
}

fn set_limit(
    resource: libc::__rlimit_resource_t,
    name: &str,
    value: u64,
) -> Result<(), JailerError> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit(2) reads one rlimit that outlives the call.
    if unsafe { libc::setrlimit(resource, &limit) } != 0 {
        return Err(JailerError::ResourceLimit {
            resource: format!("{name}={value}"),
            error: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// cgroup files take one line.
fn write_cgroup_file(path: &Path, value: &str) -> Result<(), JailerError> {
    fs::write(path, format!("{value}\n")).map_err(io_error("write", path))
}

/// Creates `dir` and the directories between it and `root`, recording those it created;
/// v2 enables the controllers on the way down, v1 cpuset copies its parent's cpus and
/// mems into each new level (a new cpuset is empty and takes no task).
fn create_cgroup(
    version: u8,
    group: &CgroupGroup,
    created: &mut Vec<PathBuf>,
) -> Result<(), JailerError> {
    let CgroupGroup { root, dir, values } = group;
    let relative = dir.strip_prefix(root).unwrap_or(dir);
    let mut level = root.to_path_buf();
    let controllers: Vec<&str> = {
        let mut list: Vec<&str> = values.iter().map(|(file, _)| controller_of(file)).collect();
        list.sort_unstable();
        list.dedup();
        list
    };
    for component in relative.components() {
        if version == 2 {
            for controller in &controllers {
                write_cgroup_file(
                    &level.join("cgroup.subtree_control"),
                    &format!("+{controller}"),
                )?;
            }
        }
        let parent = level.clone();
        level.push(component);
        if !level.exists() {
            fs::create_dir(&level).map_err(io_error("create cgroup", &level))?;
            created.push(level.clone());
        }
        if version == 1 && controllers.contains(&"cpuset") {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let own = fs::read_to_string(level.join(file)).unwrap_or_default();
                if own.trim().is_empty() {
                    let inherited = fs::read_to_string(parent.join(file))
                        .map_err(io_error("read", &parent.join(file)))?;
                    write_cgroup_file(&level.join(file), inherited.trim())?;
                }
            }
        }
    }
    for (file, value) in values {
        write_cgroup_file(&dir.join(file), value)?;
    }
    Ok(())
}

/// The steps from the chroot on; returns only on failure.
fn enter_and_exec(
    plan: &Plan,
    start_us: u64,
    start_cpu_us: u64,
) -> Result<std::convert::Infallible, JailerError> {
    let (uid, gid) = (plan.args.uid, plan.args.gid);
    // /dev/null is outside the jail: opened before entering it.
    let dev_null = if plan.args.daemonize {
        Some(
            File::options()
                .read(true)
                .write(true)
                .open("/dev/null")
                .map_err(io_error("open", Path::new("/dev/null")))?,
        )
    } else {
        None
    };
    pivot_into(&plan.chroot_dir)?;
    for dir in JAIL_DIRS {
        own_dir(Path::new(dir), uid, gid)?;
    }
    if plan.nodes.iter().any(|n| n.path.starts_with(VFIO_DIR)) {
        own_dir(Path::new(VFIO_DIR), uid, gid)?;
    }
    for node in &plan.nodes {
        match make_node(node, uid, gid) {
            Ok(()) => {}
            Err(error) if node.required => return Err(error),
            Err(error) => eprintln!("gpuvm: jailer: warning: {error}"),
        }
    }
    if let Some(dev_null) = dev_null {
        daemonize(&dev_null)?;
    }
    let pid_file = Path::new("/").join(format!("{}.pid", plan.exec_name.to_string_lossy()));
    if plan.args.new_pid_ns {
        // SAFETY: unshare(2) with CLONE_NEWPID only decides the namespace of the children
        // this process creates from now on.
        check("create a PID namespace", unsafe {
            libc::unshare(libc::CLONE_NEWPID)
        })?;
        // SAFETY: the process is single-threaded, so the child is a full copy; it goes on
        // to exec, the parent records its pid and exits.
        let child = check("fork into the PID namespace", unsafe { libc::fork() })?;
        if child > 0 {
            let code = match fs::write(&pid_file, child.to_string()) {
                Ok(()) => 0,
                Err(error) => {
                    eprintln!(
                        "gpuvm: jailer: error: cannot write {}: {error}",
                        pid_file.display()
                    );
                    libc::c_int::from(JAILER_ERROR)
                }
            };
            // SAFETY: _exit(2) ends this process without running the child's exit handlers
            // twice; nothing here needs flushing.
            unsafe { libc::_exit(code) };
        }
    } else {
        fs::write(&pid_file, std::process::id().to_string())
            .map_err(io_error("write", &pid_file))?;
    }
    crate::jail::drop_privileges(uid, gid).map_err(|e| JailerError::Privileges(e.to_string()))?;
    let program = Path::new("/").join(&plan.exec_name);
    let parent_cpu_us = clock_us(libc::CLOCK_PROCESS_CPUTIME_ID).saturating_sub(start_cpu_us);
    let error = std::process::Command::new(&program)
        .arg("--id")
        .arg(&plan.args.id)
        .arg("--start-time-us")
        .arg(start_us.to_string())
        .arg("--start-time-cpu-us")
        .arg(clock_us(libc::CLOCK_PROCESS_CPUTIME_ID).to_string())
        .arg("--parent-cpu-time-us")
        .arg(parent_cpu_us.to_string())
        .args(&plan.args.extra)
        .env_clear()
        .exec();
    Err(JailerError::Exec(program, error))
}

/// A new mount namespace whose root is `new_root`: every mount made a slave (so nothing
/// propagates back to the host), `new_root` bind-mounted onto itself (pivot_root needs a
/// mount point), pivot_root, and the old root detached and removed.
fn pivot_into(new_root: &Path) -> Result<(), JailerError> {
    let new_root_c = c_path(new_root)?;
    // SAFETY: unshare(2) with CLONE_NEWNS only gives this process its own mount table.
    check("create a mount namespace", unsafe {
        libc::unshare(libc::CLONE_NEWNS)
    })?;
    // SAFETY: mount(2) changing propagation reads only the NUL-terminated target "/".
    check("make the mounts private to the jail", unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_SLAVE | libc::MS_REC,
            std::ptr::null(),
        )
    })?;
    // SAFETY: a bind mount reads the two NUL-terminated paths, alive across the call.
    check("bind-mount the jail onto itself", unsafe {
        libc::mount(
            new_root_c.as_ptr(),
            new_root_c.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        )
    })?;
    std::env::set_current_dir(new_root).map_err(io_error("enter", new_root))?;
    fs::create_dir("old_root").map_err(io_error("create", Path::new("old_root")))?;
    // SAFETY: pivot_root(2) reads two NUL-terminated relative paths (literals).
    let pivoted =
        unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c"old_root".as_ptr()) };
    if pivoted < 0 {
        return Err(JailerError::Syscall(
            "pivot_root",
            io::Error::last_os_error(),
        ));
    }
    std::env::set_current_dir("/").map_err(io_error("enter", Path::new("/")))?;
    // SAFETY: umount2(2) reads a NUL-terminated literal.
    check("detach the old root", unsafe {
        libc::umount2(c"/old_root".as_ptr(), libc::MNT_DETACH)
    })?;
    fs::remove_dir("/old_root").map_err(io_error("remove", Path::new("/old_root")))?;
    // SAFETY: chroot(2) reads a NUL-terminated literal; the root is already the jail, this
    // also sets the process's root for good measure as the jailer does.
    check("chroot", unsafe { libc::chroot(c".".as_ptr()) })?;
    Ok(())
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), JailerError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_error("chown", path))
}

fn own_dir(path: &Path, uid: u32, gid: u32) -> Result<(), JailerError> {
    fs::create_dir_all(path).map_err(io_error("create", path))?;
    fs::set_permissions(path, fs::Permissions::from_mode(JAIL_DIR_MODE))
        .map_err(io_error("chmod", path))?;
    chown(path, uid, gid)
}

fn make_node(node: &DeviceNode, uid: u32, gid: u32) -> Result<(), JailerError> {
    let path = c_path(&node.path)?;
    // SAFETY: mknod(2) reads a NUL-terminated path that outlives the call.
    let made = unsafe {
        libc::mknod(
            path.as_ptr(),
            libc::S_IFCHR | libc::S_IRUSR | libc::S_IWUSR,
            node.rdev,
        )
    };
    if made != 0 {
        return Err(JailerError::Io {
            what: "create device node",
            path: node.path.clone(),
            error: io::Error::last_os_error(),
        });
    }
    chown(&node.path, uid, gid)
}

/// Detaches as Firecracker's jailer does: fork (the caller returns at once), setsid, fork
/// again (no controlling terminal can come back), stdio onto /dev/null.
fn daemonize(dev_null: &File) -> Result<(), JailerError> {
    for round in 0..2 {
        // SAFETY: the process is single-threaded, so the child is a full copy; the parent
        // leaves with _exit at once.
        let child = check("fork to daemonize", unsafe { libc::fork() })?;
        if child > 0 {
            // SAFETY: _exit(2) ends the parent without running exit handlers twice.
            unsafe { libc::_exit(0) };
        }
        if round == 0 {
            // SAFETY: setsid(2) takes no arguments.
            check("setsid", unsafe { libc::setsid() })?;
        }
    }
    for fd in 0..3 {
        // SAFETY: dup2(2) onto the standard descriptors, from a descriptor this function
        // borrows for the call.
        check("redirect stdio to /dev/null", unsafe {
            libc::dup2(dev_null.as_raw_fd(), fd)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn run_args(list: &[&str]) -> JailerArgs {
        match parse(&args(list)).unwrap() {
            Parsed::Run(parsed) => *parsed,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn jailer_command_lines_parse() {
        let parsed = run_args(&[
            "/usr/bin/jailer",
            "--id",
            "551e7604-e35c-42b3",
            "--exec-file",
            "/usr/bin/firecracker",
            "--uid",
            "123",
            "--gid=100",
            "--cgroup",
            "cpuset.mems=0",
            "--cgroup",
            "cpu.max=50000 100000",
            "--cgroup-version",
            "2",
            "--parent-cgroup",
            "all/uvms",
            "--resource-limit",
            "no-file=1024",
            "--netns",
            "/var/run/netns/x",
            "--daemonize",
            "--new-pid-ns",
            "--",
            "--api-sock",
            "/run/api.sock",
            "--unknown-to-the-jailer",
        ]);
        assert_eq!(parsed.id, "551e7604-e35c-42b3");
        assert_eq!((parsed.uid, parsed.gid), (123, 100));
        assert_eq!(parsed.chroot_base, PathBuf::from(DEFAULT_CHROOT_BASE));
        assert_eq!(
            parsed.cgroups,
            vec![
                ("cpuset.mems".into(), "0".into()),
                ("cpu.max".into(), "50000 100000".into())
            ]
        );
        assert_eq!(parsed.cgroup_version, 2);
        assert_eq!(parsed.parent_cgroup, Some("all/uvms".into()));
        assert_eq!(parsed.resource_limits, vec![(Resource::OpenFiles, 1024)]);
        assert!(parsed.daemonize && parsed.new_pid_ns);
        assert_eq!(
            parsed.extra,
            args(&["--api-sock", "/run/api.sock", "--unknown-to-the-jailer"])
        );
        assert!(wanted(&args(&["/usr/bin/jailer"])));
        assert!(wanted(&args(&["gpuvm", "jailer", "--id", "x"])));
        assert!(!wanted(&args(&["gpuvm", "run"])));
        let plain = run_args(&[
            "gpuvm",
            "jailer",
            "--id",
            "a",
            "--exec-file",
            "f",
            "--uid",
            "0",
            "--gid",
            "0",
        ]);
        assert_eq!(plain.cgroup_version, 1);
    }

    #[test]
    fn bad_jailer_command_lines_are_refused_naming_the_problem() {
        let base = ["jailer", "--exec-file", "/f", "--uid", "1", "--gid", "1"];
        let refused = |extra: &[&str]| {
            let mut list: Vec<&str> = base.to_vec();
            list.extend_from_slice(extra);
            parse(&args(&list)).unwrap_err().to_string()
        };
        assert!(refused(&["--id", "../x"]).contains("'.'"));
        assert!(refused(&["--id", &"a".repeat(65)]).contains("length is 65"));
        assert!(refused(&["--id", ""]).contains("length is 0"));
        assert!(refused(&[]).contains("--id is required"));
        assert!(refused(&["--id", "a", "--bogus"]).contains("\"--bogus\""));
        assert!(refused(&["--id", "a", "--id", "b"]).contains("twice"));
        assert!(refused(&["--id", "a", "--cgroup", "cpu.max"]).contains("cpu.max"));
        assert!(refused(&["--id", "a", "--cgroup", "../x.y=1"]).contains("../x.y=1"));
        assert!(refused(&["--id", "a", "--cgroup", "nodot=1"]).contains("nodot"));
        assert!(refused(&["--id", "a", "--cgroup-version", "3"]).contains("\"3\""));
        assert!(refused(&["--id", "a", "--parent-cgroup", "../up"]).contains("../up"));
        assert!(refused(&["--id", "a", "--parent-cgroup", "/abs"]).contains("/abs"));
        assert!(refused(&["--id", "a", "--resource-limit", "cpu=1"]).contains("cpu=1"));
        assert!(refused(&["--id", "a", "--resource-limit", "fsize=x"]).contains("fsize=x"));
        assert!(refused(&["--id", "a", "--uid"]).contains("--uid needs a value"));
        let no_uid = parse(&args(&[
            "jailer",
            "--id",
            "a",
            "--exec-file",
            "/f",
            "--gid",
            "1",
        ]));
        assert!(no_uid
            .unwrap_err()
            .to_string()
            .contains("--uid is required"));
        let bad_uid = parse(&args(&[
            "jailer",
            "--id",
            "a",
            "--exec-file",
            "/f",
            "--uid",
            "-1",
            "--gid",
            "1",
        ]));
        assert!(bad_uid.unwrap_err().to_string().contains("--uid \"-1\""));
        assert_eq!(
            parse(&args(&["jailer", "--version"])).unwrap(),
            Parsed::Version
        );
    }

    #[test]
    fn cgroup_hierarchies_come_from_proc_mounts() {
        let mounts = "\
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";
        let mut parsed = run_args(&[
            "jailer",
            "--id",
            "vm1",
            "--exec-file",
            "/f",
            "--uid",
            "1",
            "--gid",
            "1",
            "--cgroup",
            "cpu.shares=10",
            "--cgroup",
            "memory.limit_in_bytes=1000000",
            "--cgroup",
            "cpuacct.x=1",
        ]);
        let Some(CgroupPlan::Create { version, groups }) =
            plan_cgroups(&parsed, Path::new("firecracker"), mounts).unwrap()
        else {
            panic!("no cgroups planned");
        };
        assert_eq!(version, 1);
        assert_eq!(groups.len(), 2, "{groups:?}");
        assert_eq!(
            groups[0].dir,
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/firecracker/vm1")
        );
        assert_eq!(groups[0].values.len(), 2);
        assert_eq!(
            groups[1].dir,
            PathBuf::from("/sys/fs/cgroup/memory/firecracker/vm1")
        );
        parsed.cgroups.push(("blkio.weight".into(), "10".into()));
        let missing = plan_cgroups(&parsed, Path::new("p"), mounts).unwrap_err();
        assert!(missing.to_string().contains("blkio"), "{missing}");
        parsed.cgroups.clear();
        parsed.cgroup_version = 2;
        assert!(matches!(
            plan_cgroups(&parsed, Path::new("p"), mounts).unwrap(),
            Some(CgroupPlan::MoveInto(dir)) if dir == Path::new("/sys/fs/cgroup/unified/p")
        ));
    }
}
