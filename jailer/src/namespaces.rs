//! The jail's namespaces and process tree: joining `--netns`, `--daemonize` (detached from
//! the caller and its terminal) and `--new-pid-ns` (the exec file as pid 1 of its own PID
//! namespace). The mount namespace is the chroot's (`chroot::pivot_into`).

use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::{check, io_error, JailerError, JAILER_ERROR};

/// Joins the network namespace `--netns` names (a file under /var/run/netns, or a
/// process's `/proc/<pid>/ns/net`), so the VMM's TAP devices are the ones set up there.
pub(crate) fn join_netns(netns: &Path) -> Result<(), JailerError> {
    let file = File::open(netns).map_err(|e| JailerError::Netns(netns.to_owned(), e))?;
    // SAFETY: setns(2) on a descriptor this function owns; it changes only this
    // (still single-threaded) process's network namespace.
    check("join the network namespace", unsafe {
        libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET)
    })?;
    Ok(())
}

/// /dev/null for [`daemonize`]: it is outside the jail, so it is opened before entering it.
pub(crate) fn open_dev_null() -> Result<File, JailerError> {
    File::options()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(io_error("open", Path::new("/dev/null")))
}

/// Detaches as Firecracker's jailer does: fork (the caller returns at once), setsid, fork
/// again (no controlling terminal can come back), stdio onto /dev/null.
pub(crate) fn daemonize(dev_null: &File) -> Result<(), JailerError> {
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

/// `--new-pid-ns`: forks into a new PID namespace. Returns in the child, pid 1 there; the
/// parent writes the child's pid (as the host sees it) to `pid_file` and exits, 0 or, when
/// the pid file cannot be written, the jailer's error status.
pub(crate) fn fork_into_new_pid_ns(pid_file: &Path) -> Result<(), JailerError> {
    // SAFETY: unshare(2) with CLONE_NEWPID only decides the namespace of the children
    // this process creates from now on.
    check("create a PID namespace", unsafe {
        libc::unshare(libc::CLONE_NEWPID)
    })?;
    // SAFETY: the process is single-threaded, so the child is a full copy; it goes on
    // to exec, the parent records its pid and exits.
    let child = check("fork into the PID namespace", unsafe { libc::fork() })?;
    if child > 0 {
        let code = match fs::write(pid_file, child.to_string()) {
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
    Ok(())
}
