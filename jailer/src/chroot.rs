//! The jail's file system: `<chroot-base>/<exec-name>/<id>/root` with a copy of the exec
//! file, made the root of a mount namespace of its own (pivot_root, so the host's tree is
//! gone, not just out of reach as under a bare chroot), and its directories owned by the
//! unprivileged user.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::{c_path, check, io_error, JailerError};

/// The directories of the jail, owned by the unprivileged user (the VMM creates its API
/// socket in /run).
const JAIL_DIRS: [&str; 4] = ["/", "/dev", "/dev/net", "/run"];
const JAIL_DIR_MODE: u32 = 0o700;

/// Creates the jail's root `chroot_dir` and copies the exec file `exec_source` into it as
/// `exec_name`.
pub(crate) fn create_jail(
    chroot_dir: &Path,
    exec_source: &Path,
    exec_name: &OsStr,
    uid: u32,
    gid: u32,
) -> Result<(), JailerError> {
    fs::create_dir_all(chroot_dir).map_err(io_error("create", chroot_dir))?;
    copy_exec_file(exec_source, &chroot_dir.join(exec_name), uid, gid)
}

/// Copies (never links) the exec file into the jail, so no two VMMs share its pages,
/// owned by the unprivileged user.
fn copy_exec_file(
    source_path: &Path,
    target: &Path,
    uid: u32,
    gid: u32,
) -> Result<(), JailerError> {
    let mut source = File::open(source_path).map_err(io_error("open", source_path))?;
    let mode = source
        .metadata()
        .map_err(io_error("stat", source_path))?
        .permissions()
        .mode();
    // create_new and O_NOFOLLOW: nothing already in the jail's place is written through.
    let mut copy = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(mode & 0o7777)
        .open(target)
        .map_err(io_error("create", target))?;
    std::os::unix::fs::fchown(&copy, Some(uid), Some(gid)).map_err(io_error("chown", target))?;
    io::copy(&mut source, &mut copy).map_err(io_error("copy the exec file to", target))?;
    // The copy is closed here: exec of a file open for writing fails (ETXTBSY).
    Ok(())
}

/// A new mount namespace whose root is `new_root`: every mount made a slave (so nothing
/// propagates back to the host), `new_root` bind-mounted onto itself (pivot_root needs a
/// mount point), pivot_root, and the old root detached and removed.
pub(crate) fn pivot_into(new_root: &Path) -> Result<(), JailerError> {
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
        let error = io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EINVAL) && root_is_initramfs() {
            return move_over_initramfs();
        }
        return Err(JailerError::Syscall("pivot_root", error));
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

/// Whether this mount namespace's root is the kernel's initramfs (rootfs: a ramfs or
/// tmpfs that is the root of the mount tree), which pivot_root(2) refuses to move.
fn root_is_initramfs() -> bool {
    let mut filesystem = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: statfs(2) writes one statfs into `filesystem`; read only when it succeeded.
    let known = unsafe { libc::statfs(c"/".as_ptr(), filesystem.as_mut_ptr()) } == 0;
    // SAFETY: statfs succeeded, so `filesystem` is initialised.
    known
        && [RAMFS_MAGIC, TMPFS_MAGIC].contains(&unsafe { filesystem.assume_init() }.f_type)
        && fs::read_to_string("/proc/self/mountinfo").is_ok_and(|mounts| {
            // A mount of type rootfs on "/".
            mounts.lines().any(|line| {
                line.split_whitespace().nth(4) == Some("/") && line.contains(" - rootfs ")
            })
        })
}

/// linux/magic.h's ramfs and tmpfs `f_type`s: rootfs is one or the other.
const RAMFS_MAGIC: libc::__fsword_t = 0x8584_58f6;
const TMPFS_MAGIC: libc::__fsword_t = 0x0102_1994;

/// On a host that runs from its initramfs (PXE-booted hosts, the real-kernel tier's outer
/// machine), where pivot_root cannot work: the jail (the current directory, a bind mount
/// in this process's own mount namespace) is moved over "/" as switch_root does, and the
/// process chroots into it. The initramfs stays mounted beneath, out of reach of a process
/// without CAP_SYS_ADMIN and CAP_SYS_CHROOT, which the VMM gives up before it execs.
fn move_over_initramfs() -> Result<(), JailerError> {
    eprintln!(
        "gpuvm: jailer: the root is the initramfs, which pivot_root cannot move: the jail is \
         moved over / in its own mount namespace instead"
    );
    fs::remove_dir("old_root").map_err(io_error("remove", Path::new("old_root")))?;
    // SAFETY: mount(2) with MS_MOVE reads two NUL-terminated literals.
    check("move the jail over /", unsafe {
        libc::mount(
            c".".as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_MOVE,
            std::ptr::null(),
        )
    })?;
    // SAFETY: chroot(2) reads a NUL-terminated literal: the moved jail, the current directory.
    check("chroot", unsafe { libc::chroot(c".".as_ptr()) })?;
    std::env::set_current_dir("/").map_err(io_error("enter", Path::new("/")))?;
    Ok(())
}

/// The jail's own directories, owned by `uid:gid` (inside the jail, after the pivot).
pub(crate) fn own_jail_dirs(uid: u32, gid: u32) -> Result<(), JailerError> {
    for dir in JAIL_DIRS {
        own_dir(Path::new(dir), uid, gid)?;
    }
    Ok(())
}

pub(crate) fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), JailerError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_error("chown", path))
}

/// Creates `path` if needed, private to `uid:gid`.
pub(crate) fn own_dir(path: &Path, uid: u32, gid: u32) -> Result<(), JailerError> {
    fs::create_dir_all(path).map_err(io_error("create", path))?;
    fs::set_permissions(path, fs::Permissions::from_mode(JAIL_DIR_MODE))
        .map_err(io_error("chmod", path))?;
    chown(path, uid, gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exec_file_is_copied_with_its_mode_and_never_over_what_is_there() {
        let dir = std::env::temp_dir().join(format!("gpuvm-jailer-chroot-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let source = dir.join("exec");
        fs::write(&source, b"#!/bin/true\n").unwrap();
        fs::set_permissions(&source, fs::Permissions::from_mode(0o751)).unwrap();
        // SAFETY: getuid(2) and getgid(2) take no arguments.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let root = dir.join("root");
        create_jail(&root, &source, OsStr::new("vmm"), uid, gid).unwrap();
        let copy = root.join("vmm");
        assert_eq!(fs::read(&copy).unwrap(), b"#!/bin/true\n");
        let mode = fs::metadata(&copy).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o751);
        let again = copy_exec_file(&source, &copy, uid, gid).unwrap_err();
        let expected = format!("cannot create {}", copy.display());
        assert!(again.to_string().starts_with(&expected), "{again}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
