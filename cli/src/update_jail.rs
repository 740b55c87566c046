//! The running gpuvm's confinement, as `gpuvm update` finds it in /proc, and how the new
//! gpuvm is started inside the same one: its root (a chroot, or the mount namespace the
//! jailer pivoted into the jail), working directory, network namespace, cgroups, resource
//! limits and uid/gid. A VM updated out of its jail would leave the new process with the
//! host's file system, network and limits, and root.
//!
//! Everything is opened here, in `gpuvm update` (root, on the host); the new process's
//! child side ([`Confinement::enter`], run between fork and exec) only writes to, sets and
//! joins what is already open, in this order: cgroups (their `cgroup.procs`, which need the
//! host's /sys/fs/cgroup), limits, network namespace, mount namespace, root, working
//! directory, uid/gid last (everything before needs root). Then the new binary, copied into
//! the jail as the jailer copies its exec file, is executed from inside it.
//!
//! PID namespaces: a running gpuvm that is the init of a namespace of its own (the
//! jailer's `--new-pid-ns`) cannot have the new one in it (when the init exits, the kernel
//! kills every process of its namespace), so the new gpuvm gets one of its own as well;
//! one in a namespace it is not the init of has the new one join it. Either way the new
//! one cannot read the old one's pid: it watches it through a pidfd given to it and knows
//! its offer by a token (cli/src/update.rs). A user namespace is not followed: refused
//! before anything is touched.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::CliError;

/// The resource limits the jailer sets, and others a VMM may be given: carried over as
/// they are.
/// Each with its name in /proc/PID/limits.
const LIMITS: [(libc::__rlimit_resource_t, &str); 6] = [
    (libc::RLIMIT_NOFILE, "Max open files"),
    (libc::RLIMIT_FSIZE, "Max file size"),
    (libc::RLIMIT_MEMLOCK, "Max locked memory"),
    (libc::RLIMIT_AS, "Max address space"),
    (libc::RLIMIT_NPROC, "Max processes"),
    (libc::RLIMIT_CORE, "Max core file size"),
];

/// The limit `name` in a /proc/PID/limits `table` (soft and hard, `unlimited` as such).
fn limit_in(table: &str, name: &str) -> Option<libc::rlimit> {
    let rest = table.lines().find_map(|line| line.strip_prefix(name))?;
    let mut values = rest.split_whitespace().map(|value| match value {
        "unlimited" => Some(libc::RLIM_INFINITY),
        number => number.parse().ok(),
    });
    Some(libc::rlimit {
        rlim_cur: values.next()??,
        rlim_max: values.next()??,
    })
}

/// Process `pid`'s confinement, each part open.
#[derive(Debug)]
pub struct Confinement {
    pid: i32,
    /// Its root directory (`/proc/PID/root`), as a path-only descriptor.
    root: OwnedFd,
    /// Whether that root is not this process's (a chroot, or a jail's mount namespace).
    jailed: bool,
    /// Its working directory.
    cwd: OwnedFd,
    /// Its mount and network namespaces, where they are not this process's.
    mount_ns: Option<File>,
    net_ns: Option<File>,
    /// `cgroup.procs` of each of its cgroups that is not this process's.
    cgroups: Vec<File>,
    limits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    /// Its uid and gid, where they are not this process's.
    ids: Option<(libc::uid_t, libc::gid_t)>,
    pid_namespace: PidNamespace,
}

/// Where the new gpuvm's pid namespace comes from.
#[derive(Debug)]
enum PidNamespace {
    /// The running gpuvm's is this process's.
    Same,
    /// The running gpuvm's, of which it is not the init: joined. With a pidfd of the
    /// running gpuvm, which the new one is given.
    Join(File, OwnedFd),
    /// The running gpuvm is its own namespace's init: the new gpuvm is too, of a new one.
    New(OwnedFd),
}

fn other(what: String) -> CliError {
    CliError::Other(what)
}

/// Opens `path` as a path-only directory descriptor.
fn open_dir(path: &Path) -> Result<OwnedFd, CliError> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| other(format!("{} contains a NUL byte", path.display())))?;
    // SAFETY: open(2) reads the NUL-terminated path, which outlives the call; the result
    // is checked.
    let fd = unsafe {
        libc::open(
            c_path.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(other(format!(
            "cannot open {}: {}",
            path.display(),
            io::Error::last_os_error()
        )));
    }
    // SAFETY: open returned this descriptor, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `/proc/PID/ns/NAME` of `pid` opened, if it is not this process's.
fn other_namespace(pid: i32, name: &str) -> Result<Option<File>, CliError> {
    let theirs = format!("/proc/{pid}/ns/{name}");
    let ours = format!("/proc/self/ns/{name}");
    // A kernel built without that kind of namespace (the tier's small iommufd kernel has no
    // user namespaces) has no such file: everyone is in the one there is.
    if std::fs::symlink_metadata(&ours).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
        return Ok(None);
    }
    let read = |path: &str| {
        std::fs::read_link(path)
            .map_err(|e| other(format!("cannot read process {pid}'s {name} namespace: {e}")))
    };
    if read(&theirs)? == read(&ours)? {
        return Ok(None);
    }
    File::open(&theirs)
        .map(Some)
        .map_err(|e| other(format!("cannot open {theirs}: {e}")))
}

/// The value of field `name` (`Uid:`, `Gid:`) of `/proc/PID/status`, split.
fn status_ids(status: &str, name: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|id| id.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

impl Confinement {
    /// Reads and opens process `pid`'s confinement.
    pub fn of(pid: i32) -> Result<Confinement, CliError> {
        if other_namespace(pid, "user")?.is_some() {
            return Err(other(format!(
                "live update of process {pid}, which runs in a user namespace of its own, is \
                 not supported: the new gpuvm could not be started inside it; the VM was not \
                 touched"
            )));
        }
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let status = std::fs::read_to_string(proc_dir.join("status"))
            .map_err(|e| other(format!("cannot read process {pid}'s status: {e}")))?;
        let pid_namespace = match other_namespace(pid, "pid")? {
            None => PidNamespace::Same,
            Some(namespace) => {
                let pidfd = crate::snapshot_signal::pidfd::open(pid)?;
                // Its pid in the namespace it is in: the last of NSpid.
                match status_ids(&status, "NSpid:").last() {
                    Some(1) => PidNamespace::New(pidfd),
                    _ => PidNamespace::Join(namespace, pidfd),
                }
            }
        };
        let root = open_dir(&proc_dir.join("root"))?;
        let cwd = open_dir(&proc_dir.join("cwd"))?;
        let mount_ns = other_namespace(pid, "mnt")?;
        let same_root = std::fs::metadata(proc_dir.join("root"))
            .and_then(|theirs| Ok((theirs, std::fs::metadata("/")?)))
            .map(|(theirs, ours)| theirs.dev() == ours.dev() && theirs.ino() == ours.ino())
            .map_err(|e| {
                other(format!(
                    "cannot compare process {pid}'s root with ours: {e}"
                ))
            })?;
        let net_ns = other_namespace(pid, "net")?;
        let cgroups = other_cgroups(pid)?;
        // From /proc (prlimit on another process needs CAP_SYS_RESOURCE, which root in a
        // container may lack).
        let table = std::fs::read_to_string(proc_dir.join("limits"))
            .map_err(|e| other(format!("cannot read process {pid}'s resource limits: {e}")))?;
        let limits: Vec<_> = LIMITS
            .iter()
            .filter_map(|&(resource, name)| {
                let limit = limit_in(&table, name)?;
                let mut own = limit;
                // SAFETY: getrlimit(2) writes one rlimit into `own`.
                unsafe { libc::getrlimit(resource, &mut own) };
                let differs = (own.rlim_cur, own.rlim_max) != (limit.rlim_cur, limit.rlim_max);
                differs.then_some((resource, name, limit, own))
            })
            .collect();
        // A hard limit above this process's needs CAP_SYS_RESOURCE (a VMM given unlimited
        // locked memory, an update run from a shell in a container): tried here first, so
        // that a refusal names the limit instead of failing the new process's start.
        for (resource, name, limit, own) in &limits {
            if limit.rlim_max > own.rlim_max {
                // SAFETY: setrlimit(2) reads one rlimit that outlives the call; this
                // short-lived process only raises its own limit to the running gpuvm's.
                if unsafe { libc::setrlimit(*resource, limit) } != 0 {
                    return Err(other(format!(
                        "cannot give the new gpuvm process {pid}'s limit \"{name}\" ({}): {}; \
                         the VM was not touched",
                        limit.rlim_max,
                        io::Error::last_os_error()
                    )));
                }
            }
        }
        let limits = limits
            .into_iter()
            .map(|(resource, _, limit, _)| (resource, limit))
            .collect();
        let (uids, gids) = (status_ids(&status, "Uid:"), status_ids(&status, "Gid:"));
        let (uid, gid) = match (uids.as_slice(), gids.as_slice()) {
            ([real, effective, ..], [greal, geffective, ..])
                if real == effective && greal == geffective =>
            {
                (*effective, *geffective)
            }
            _ => {
                return Err(other(format!(
                    "process {pid} runs with mixed ids (uids {uids:?}, gids {gids:?}): the \
                     new gpuvm would not know whose to take"
                )))
            }
        };
        // SAFETY: geteuid/getegid take no arguments and cannot fail.
        let ours = unsafe { (libc::geteuid(), libc::getegid()) };
        Ok(Confinement {
            pid,
            root,
            jailed: mount_ns.is_some() || !same_root,
            cwd,
            mount_ns,
            net_ns,
            cgroups,
            limits,
            ids: ((uid, gid) != ours).then_some((uid, gid)),
            pid_namespace,
        })
    }

    /// A pidfd of the running gpuvm when the new one will be in another pid namespace
    /// than this process's (it cannot open one itself), for it to inherit.
    pub fn old_pidfd(&self) -> Option<&OwnedFd> {
        match &self.pid_namespace {
            PidNamespace::Same => None,
            PidNamespace::Join(_, pidfd) | PidNamespace::New(pidfd) => Some(pidfd),
        }
    }

    /// Makes the children this process starts from now on (the new gpuvm) members of the
    /// running gpuvm's pid namespace, or of a new one of their own. Only for that child:
    /// this process has one thread and starts nothing else.
    pub fn enter_pid_namespace(&self) -> Result<(), CliError> {
        let result = match &self.pid_namespace {
            PidNamespace::Same => return Ok(()),
            // SAFETY: setns(2) on an open namespace file: it decides the namespace of this
            // process's later children only.
            PidNamespace::Join(namespace, _) => unsafe {
                libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWPID)
            },
            // SAFETY: unshare(2) of the pid namespace: likewise for later children.
            PidNamespace::New(_) => unsafe { libc::unshare(libc::CLONE_NEWPID) },
        };
        if result != 0 {
            return Err(other(format!(
                "cannot start the new gpuvm in a pid namespace like process {}'s: {}",
                self.pid,
                io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// Whether the running gpuvm's root is not this process's: the new binary must be
    /// copied in, and the hand-over socket made there.
    pub fn jailed(&self) -> bool {
        self.jailed
    }

    /// The jail's root, as a path this process can use while it holds the descriptor.
    pub fn root_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.root.as_raw_fd()))
    }

    /// `path` (under [`Confinement::root_path`]) as the jailed process names it.
    pub fn inside(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(self.root_path()) {
            Ok(rest) => Path::new("/").join(rest),
            Err(_) => path.to_path_buf(),
        }
    }

    /// `path`, a socket as the running gpuvm names it, as this process can reach it: inside
    /// the jail where it is there (a socket bound after the jail was entered), else as it
    /// is (one bound before, as gpuvm's own --chroot does).
    pub fn reachable(&self, path: &Path) -> Option<PathBuf> {
        let is_socket = |path: &Path| {
            std::fs::symlink_metadata(path)
                .is_ok_and(|meta| std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()))
        };
        let in_jail = self.jailed.then(|| {
            self.root_path()
                .join(path.strip_prefix("/").unwrap_or(path))
        });
        in_jail
            .filter(|path| is_socket(path))
            .or_else(|| is_socket(path).then(|| path.to_path_buf()))
    }

    /// The uid and gid the new gpuvm takes, where they differ from this process's.
    pub fn ids(&self) -> Option<(libc::uid_t, libc::gid_t)> {
        self.ids
    }

    /// Copies `binary` into the jail as `NAME.update` (NAME: the file name of the running
    /// gpuvm's own binary), owned and executable as the jailer's copy; returns its name
    /// in the jail's root. [`Confinement::install`] puts it in place once the update went
    /// through, [`Confinement::discard`] removes it otherwise.
    pub fn copy_in(&self, binary: &Path) -> Result<String, CliError> {
        let name = exec_name(self.pid)?;
        let staged = format!(".{name}.update");
        let target = self.root_path().join(&staged);
        let _ = std::fs::remove_file(&target);
        std::fs::copy(binary, &target).map_err(|e| {
            other(format!(
                "cannot copy {} into process {}'s jail: {e}",
                binary.display(),
                self.pid
            ))
        })?;
        std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| other(format!("cannot make the copied binary executable: {e}")))?;
        if let Some((uid, gid)) = self.ids {
            std::os::unix::fs::chown(&target, Some(uid), Some(gid))
                .map_err(|e| other(format!("cannot give the copied binary to uid {uid}: {e}")))?;
        }
        Ok(staged)
    }

    /// The staged copy (`.NAME.update`) becomes the jail's `NAME`, as the jailer would
    /// have copied the new binary: the running process's binary keeps its inode. The
    /// jailer's pid file (`NAME.pid`), if it names the old process, names `new_pid` now.
    pub fn install(&self, staged: &str, new_pid: u32) -> Result<(), CliError> {
        let name = &staged[1..staged.len() - ".update".len()];
        let pid_file = self.root_path().join(format!("{name}.pid"));
        if std::fs::read_to_string(&pid_file).is_ok_and(|pid| pid.trim() == self.pid.to_string()) {
            std::fs::write(&pid_file, new_pid.to_string()).map_err(|e| {
                other(format!(
                    "the VM runs in the new gpuvm (process {new_pid}), but the jail's pid file \
                     could not say so: {e}"
                ))
            })?;
        }
        let (from, to) = (cstring(staged)?, cstring(name)?);
        // SAFETY: renameat(2) inside the jail's root, a descriptor this process holds,
        // with two NUL-terminated names that outlive the call; the result is checked.
        let result = unsafe {
            libc::renameat(
                self.root.as_raw_fd(),
                from.as_ptr(),
                self.root.as_raw_fd(),
                to.as_ptr(),
            )
        };
        if result != 0 {
            return Err(other(format!(
                "the VM runs in the new gpuvm, but its binary could not be put in place as \
                 /{name} in the jail: {}",
                io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// Removes the staged copy of an update that did not go through.
    pub fn discard(&self, staged: &str) {
        if let Ok(name) = cstring(staged) {
            // SAFETY: unlinkat(2) inside the jail's root, a descriptor this process holds.
            unsafe { libc::unlinkat(self.root.as_raw_fd(), name.as_ptr(), 0) };
        }
    }

    /// The new gpuvm's child side, run between fork and exec (the descriptors it uses
    /// stay open in `self` until the child has been started): joins every part of the
    /// confinement.
    pub fn entering(&self) -> Entering {
        Entering {
            cgroups: self.cgroups.iter().map(AsRawFd::as_raw_fd).collect(),
            limits: self.limits.clone(),
            net_ns: self.net_ns.as_ref().map(AsRawFd::as_raw_fd),
            mount_ns: self.mount_ns.as_ref().map(AsRawFd::as_raw_fd),
            root: self.jailed.then(|| self.root.as_raw_fd()),
            cwd: self.cwd.as_raw_fd(),
            ids: self.ids,
        }
    }
}

/// [`Confinement::entering`]: its descriptors as numbers, so that the child can be given
/// them.
#[derive(Debug)]
pub struct Entering {
    cgroups: Vec<RawFd>,
    limits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    net_ns: Option<RawFd>,
    mount_ns: Option<RawFd>,
    /// The root to enter, for a jail.
    root: Option<RawFd>,
    cwd: RawFd,
    ids: Option<(libc::uid_t, libc::gid_t)>,
}

impl Entering {
    /// Joins every part, in the child: only system calls on what is already open (it runs
    /// after a fork).
    pub fn enter(&self) -> io::Result<()> {
        let check = |result: libc::c_int| {
            if result < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        for &procs in &self.cgroups {
            // SAFETY: write(2) of one byte from a static buffer to an open cgroup.procs:
            // "0" moves the writing process.
            let written = unsafe { libc::write(procs, c"0".as_ptr().cast(), 1) };
            check(written as libc::c_int)?;
        }
        for (resource, limit) in &self.limits {
            // SAFETY: setrlimit(2) reads one rlimit that outlives the call.
            check(unsafe { libc::setrlimit(*resource, limit) })?;
        }
        if let Some(net) = self.net_ns {
            // SAFETY: setns(2) on an open namespace file; this child has one thread.
            check(unsafe { libc::setns(net, libc::CLONE_NEWNET) })?;
        }
        if let Some(mount) = self.mount_ns {
            // SAFETY: as above.
            check(unsafe { libc::setns(mount, libc::CLONE_NEWNS) })?;
        }
        if let Some(root) = self.root {
            // SAFETY: fchdir(2) to the open root directory, then chroot(2) to ".": the
            // process's root becomes exactly the running gpuvm's.
            check(unsafe { libc::fchdir(root) })?;
            // SAFETY: chroot(2) reads the static NUL-terminated ".".
            check(unsafe { libc::chroot(c".".as_ptr()) })?;
        }
        // SAFETY: fchdir(2) to an open directory, which lies inside the new root.
        check(unsafe { libc::fchdir(self.cwd) })?;
        if let Some((uid, gid)) = self.ids {
            // The steps of gpuvm_jailer::drop_privileges, which may allocate and so
            // cannot run here.
            // SAFETY: setgroups(2) with a zero count reads no memory.
            check(unsafe { libc::setgroups(0, std::ptr::null()) })?;
            // SAFETY: setresgid/setresuid take plain integers.
            check(unsafe { libc::setresgid(gid, gid, gid) })?;
            // SAFETY: as above.
            check(unsafe { libc::setresuid(uid, uid, uid) })?;
        }
        Ok(())
    }
}

fn cstring(name: &str) -> Result<CString, CliError> {
    CString::new(name).map_err(|_| other(format!("{name:?} contains a NUL byte")))
}

/// The file name of the running gpuvm `pid`'s binary (`firecracker` for a jailer's
/// `/firecracker`): the name the new binary is given in the jail.
fn exec_name(pid: i32) -> Result<String, CliError> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map_err(|e| other(format!("cannot read process {pid}'s binary: {e}")))?;
    exec_name_of(&exe).ok_or_else(|| {
        other(format!(
            "process {pid}'s binary {} has no usable file name",
            exe.display()
        ))
    })
}

/// [`exec_name`] for the binary `exe` (as /proc/PID/exe reads): a staged copy a past
/// update ran before it was put in place (`.NAME.update`) counts as `NAME`.
fn exec_name_of(exe: &Path) -> Option<String> {
    let name = exe.file_name()?.to_str()?;
    let name = name.strip_suffix(" (deleted)").unwrap_or(name);
    let name = match name
        .strip_prefix('.')
        .and_then(|n| n.strip_suffix(".update"))
    {
        Some(staged) => staged,
        None => name,
    };
    (!name.is_empty() && !name.starts_with('.') && !name.contains('/')).then(|| name.to_string())
}

/// `cgroup.procs` of each of `pid`'s cgroups that is not this process's, opened for
/// writing: v2's unified hierarchy and every v1 hierarchy, found in this process's
/// mounts.
fn other_cgroups(pid: i32) -> Result<Vec<File>, CliError> {
    let read = |path: String| {
        std::fs::read_to_string(&path).map_err(|e| other(format!("cannot read {path}: {e}")))
    };
    // A kernel without cgroups has no /proc/PID/cgroup: nothing to join.
    if !Path::new("/proc/self/cgroup").exists() {
        return Ok(Vec::new());
    }
    let theirs = read(format!("/proc/{pid}/cgroup"))?;
    let ours = read("/proc/self/cgroup".into())?;
    let mounts = read("/proc/self/mountinfo".into())?;
    let mut files = Vec::new();
    for line in theirs.lines() {
        if ours.lines().any(|mine| mine == line) {
            continue;
        }
        let Some((controllers, path)) = line
            .split_once(':')
            .and_then(|(_, rest)| rest.split_once(':'))
        else {
            continue;
        };
        let Some(mount) = cgroup_mount(&mounts, controllers) else {
            return Err(other(format!(
                "process {pid}'s cgroup {line:?} is in a hierarchy this host does not mount"
            )));
        };
        let procs = mount
            .join(path.trim_start_matches('/'))
            .join("cgroup.procs");
        let file = File::options().write(true).open(&procs).map_err(|e| {
            other(format!(
                "cannot open {} to start the new gpuvm in process {pid}'s cgroup: {e}",
                procs.display()
            ))
        })?;
        files.push(file);
    }
    Ok(files)
}

/// Where `mountinfo` mounts the cgroup hierarchy of `controllers` (a /proc/PID/cgroup
/// line's middle field: empty for v2, `cpu,cpuacct` or `name=systemd` for v1), mounted at
/// its root.
fn cgroup_mount(mountinfo: &str, controllers: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        let mount: Vec<&str> = mount.split_whitespace().collect();
        let fs: Vec<&str> = fs.split_whitespace().collect();
        let (root, point, fs_type) = (*mount.get(3)?, *mount.get(4)?, *fs.first()?);
        if root != "/" {
            return None;
        }
        let options: Vec<&str> = fs.get(2)?.split(',').collect();
        let matches = match controllers {
            "" => fs_type == "cgroup2",
            wanted => fs_type == "cgroup" && wanted.split(',').all(|one| options.contains(&one)),
        };
        matches.then(|| PathBuf::from(point))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
42 31 0:39 /sub /mnt/cpuset rw,relatime - cgroup cgroup rw,cpuset";

    #[test]
    fn each_cgroup_line_finds_its_hierarchys_mount() {
        let found = |controllers| cgroup_mount(MOUNTINFO, controllers);
        assert_eq!(found(""), Some("/sys/fs/cgroup/unified".into()));
        assert_eq!(found("cpu"), Some("/sys/fs/cgroup/cpu,cpuacct".into()));
        assert_eq!(
            found("cpu,cpuacct"),
            Some("/sys/fs/cgroup/cpu,cpuacct".into())
        );
        assert_eq!(found("name=systemd"), Some("/sys/fs/cgroup/systemd".into()));
        // Mounted, but not at the hierarchy's root: a cgroup path cannot be found there.
        assert_eq!(found("cpuset"), None);
        assert_eq!(found("memory"), None);
    }

    #[test]
    fn a_kind_of_namespace_the_kernel_lacks_is_shared_by_everyone() {
        // As on a kernel built without user namespaces: no /proc/PID/ns file for it.
        let own = std::process::id() as i32;
        assert!(other_namespace(own, "no-such-kind").unwrap().is_none());
        assert!(other_namespace(own, "mnt").unwrap().is_none());
    }

    #[test]
    fn this_process_is_not_confined_apart_from_itself() {
        let own = Confinement::of(std::process::id() as i32).unwrap();
        assert!(!own.jailed());
        assert!(own.mount_ns.is_none() && own.net_ns.is_none());
        assert!(own.cgroups.is_empty());
        assert_eq!(own.ids(), None);
        let inside = own.inside(&own.root_path().join("dir/handover.sock"));
        assert_eq!(inside, Path::new("/dir/handover.sock"));
    }

    #[test]
    fn the_jails_binary_keeps_the_running_ones_name() {
        let name = |exe: &str| exec_name_of(Path::new(exe));
        assert_eq!(name("/firecracker").as_deref(), Some("firecracker"));
        assert_eq!(name("/.firecracker.update").as_deref(), Some("firecracker"));
        assert_eq!(name("/usr/bin/gpuvm (deleted)").as_deref(), Some("gpuvm"));
        assert_eq!(name("/.hidden"), None);
        assert_eq!(name("/"), None);
    }

    #[test]
    fn limits_are_read_as_proc_shows_them() {
        let table = "Limit                     Soft Limit           Hard Limit           Units
Max file size             unlimited            unlimited            bytes
Max open files            1000                 1000                 files
Max locked memory         8388608              unlimited            bytes
";
        let limit = |name| limit_in(table, name).map(|l| (l.rlim_cur, l.rlim_max));
        assert_eq!(limit("Max open files"), Some((1000, 1000)));
        assert_eq!(
            limit("Max file size"),
            Some((libc::RLIM_INFINITY, libc::RLIM_INFINITY))
        );
        assert_eq!(
            limit("Max locked memory"),
            Some((8388608, libc::RLIM_INFINITY))
        );
        assert_eq!(limit("Max processes"), None);
    }

    #[test]
    fn status_ids_are_read_in_order() {
        let status = "Name:\tgpuvm\nUid:\t1234\t1234\t1234\t1234\nGid:\t5\t5\t5\t5\n";
        assert_eq!(status_ids(status, "Uid:"), [1234; 4]);
        assert_eq!(status_ids(status, "Gid:"), [5; 4]);
        assert!(status_ids(status, "Groups:").is_empty());
    }
}
