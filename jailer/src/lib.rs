//! gpuvm as Firecracker's `jailer`: when the binary is invoked under that name (a symlink)
//! or as `gpuvm jailer ...`, it takes the jailer's command line, builds the jail the same
//! way and execs the exec file inside it, so platforms that start Firecracker through its
//! jailer start gpuvm (installed as `firecracker`) unchanged.
//!
//! The steps, in the jailer's order: close inherited descriptors; validate every flag,
//! path and the id (nothing is created before that passes: `args`, `plan`); create
//! `<chroot-base>/<exec-name>/<id>/root` and copy the exec file into it (`chroot`); join
//! `--netns` (`namespaces`); set the resource limits (`rlimits`); create and fill the
//! cgroup and move into it (`cgroups`); a new mount namespace with the jail as its root
//! (pivot_root, the old root detached: `chroot`); the jail's directories and device
//! nodes owned by `--uid:--gid` (`device_nodes`); `--daemonize`; `--new-pid-ns`; the pid
//! file; drop to `--uid`/`--gid` ([`privileges`], shared with gpuvm's own jail); exec
//! `/<exec-name> --id <id> --start-time-us ... --start-time-cpu-us ...
//! --parent-cpu-time-us ... <args after -->` with an empty environment (`exec`). Every
//! error before the exec exits 1, as Firecracker's jailer does.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod args;
mod cgroups;
mod chroot;
mod device_nodes;
mod exec;
mod namespaces;
mod plan;
pub mod privileges;
mod rlimits;

pub use privileges::{drop_privileges, PrivilegeError};

use args::{Parsed, USAGE};
use cgroups::PROC_MOUNTS;
use exec::StartTimes;
use plan::Plan;

/// The status of every jailer error, as Firecracker's jailer (its `main` returns an error).
const JAILER_ERROR: u8 = 1;

/// The Firecracker release whose jailer this stands in for, which `--version` names as
/// Firecracker's jailer names its own: the API version gpuvm-api serves (a test checks),
/// so a platform comparing the two finds them matching.
const FIRECRACKER_VERSION: &str = "1.17.0";

/// Why the jail could not be built: printed as `gpuvm: jailer: error: ...`, and exit
/// status 1.
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
    #[error(transparent)]
    Privileges(#[from] PrivilegeError),
    #[error("cannot exec {0}: {1}")]
    Exec(PathBuf, io::Error),
}

/// For `map_err`: an I/O error on `path` while doing `what`.
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

/// Whether this process should act as the jailer: `argv[0]`'s file name is `jailer`, or the
/// first argument is `jailer`.
pub fn wanted(args: &[String]) -> bool {
    let name = args
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned());
    name.as_deref() == Some("jailer") || args.get(1).map(String::as_str) == Some("jailer")
}

/// The `jailer` entry point.
pub fn main(args: &[String]) -> ExitCode {
    // Taken first: the exec file is told when the jailer started and what it cost.
    let start = StartTimes::now();
    let result = exec::close_inherited_fds().and_then(|()| args::parse(args));
    let plan = match result {
        Ok(Parsed::Help) => {
            println!("{USAGE}\n\nArguments after -- go to the exec file.");
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            // The workspace's version, which is also the gpuvm binary's.
            println!(
                "Jailer v{FIRECRACKER_VERSION} (gpuvm {})",
                env!("CARGO_PKG_VERSION")
            );
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Run(args)) => plan::plan(*args),
        Err(error) => Err(error),
    };
    let error = match plan {
        Ok(plan) => run(plan, &start),
        Err(error) => error,
    };
    eprintln!("gpuvm: jailer: error: {error}");
    ExitCode::from(JAILER_ERROR)
}

/// Builds the jail and execs; returns only on failure.
fn run(plan: Plan, start: &StartTimes) -> JailerError {
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
    match enter_and_exec(&plan, start) {
        Ok(never) => match never {},
        Err(error) => error,
    }
}

/// The steps before the chroot: the jail's directory and exec file, the netns, the limits
/// and the cgroups.
fn prepare(plan: &Plan, created_cgroups: &mut Vec<PathBuf>) -> Result<(), JailerError> {
    chroot::create_jail(
        &plan.chroot_dir,
        &plan.exec_source,
        &plan.exec_name,
        plan.args.uid,
        plan.args.gid,
    )?;
    if let Some(netns) = &plan.args.netns {
        namespaces::join_netns(netns)?;
    }
    plan.limits.apply()?;
    if let Some(cgroups) = &plan.cgroups {
        cgroups::enter(cgroups, created_cgroups)?;
    }
    Ok(())
}

/// The steps from the chroot on; returns only on failure.
fn enter_and_exec(
    plan: &Plan,
    start: &StartTimes,
) -> Result<std::convert::Infallible, JailerError> {
    let (uid, gid) = (plan.args.uid, plan.args.gid);
    let dev_null = if plan.args.daemonize {
        Some(namespaces::open_dev_null()?)
    } else {
        None
    };
    chroot::pivot_into(&plan.chroot_dir)?;
    chroot::own_jail_dirs(uid, gid)?;
    device_nodes::create(&plan.nodes, uid, gid)?;
    if let Some(dev_null) = dev_null {
        namespaces::daemonize(&dev_null)?;
    }
    // The pid file names the process that becomes the VMM (the child in a new PID
    // namespace), at the jail's root.
    let pid_file = Path::new("/").join(format!("{}.pid", plan.exec_name.to_string_lossy()));
    if plan.args.new_pid_ns {
        namespaces::fork_into_new_pid_ns(&pid_file)?;
    } else {
        fs::write(&pid_file, std::process::id().to_string())
            .map_err(io_error("write", &pid_file))?;
    }
    exec::exec(&plan.args, &plan.exec_name, start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_jailer_is_wanted_by_its_name_or_as_a_subcommand() {
        assert!(wanted(&args(&["/usr/bin/jailer"])));
        assert!(wanted(&args(&["gpuvm", "jailer", "--id", "x"])));
        assert!(!wanted(&args(&["gpuvm", "run"])));
    }

    #[test]
    fn version_names_the_firecracker_api_version_the_vmm_serves() {
        // Read from the source rather than depended on: the jailer stays clear of the VMM
        // crates, and its tests build without them.
        let api = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../api/src/firecracker/mod.rs"
        ));
        let declared =
            format!("pub const FIRECRACKER_API_VERSION: &str = \"{FIRECRACKER_VERSION}\";");
        assert!(
            api.contains(&declared),
            "api/src/firecracker/mod.rs no longer declares {declared}"
        );
    }
}
