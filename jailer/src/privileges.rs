//! Giving up root for good: the jailer's last step before it execs, and gpuvm's own
//! `--uid`/`--gid` jail (cli/src/jail.rs) once the VM's file descriptors are open.

use std::io;

/// Why root could not be given up; the process must not go on as root after any of them.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("cannot drop supplementary groups: {0}")]
    SupplementaryGroups(io::Error),
    #[error("cannot switch to gid {gid}: {error}")]
    Gid { gid: libc::gid_t, error: io::Error },
    #[error("cannot switch to uid {uid}: {error}")]
    Uid { uid: libc::uid_t, error: io::Error },
    #[error("dropped to an unprivileged uid but could still become root again")]
    RootRegainable,
}

/// Gives up root for good: no supplementary groups, then `gid`, then `uid` (real, effective
/// and saved), and checks that root cannot be regained.
pub fn drop_privileges(uid: libc::uid_t, gid: libc::gid_t) -> Result<(), PrivilegeError> {
    // Order matters: groups and gid need the privileges that setuid gives up.
    // glibc applies each of these to every thread of the process.
    // SAFETY: setgroups(2) with a zero count reads no memory.
    if unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
        return Err(PrivilegeError::SupplementaryGroups(
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: setresgid/setresuid take plain integers.
    if unsafe { libc::setresgid(gid, gid, gid) } != 0 {
        let error = io::Error::last_os_error();
        return Err(PrivilegeError::Gid { gid, error });
    }
    // SAFETY: as above.
    if unsafe { libc::setresuid(uid, uid, uid) } != 0 {
        let error = io::Error::last_os_error();
        return Err(PrivilegeError::Uid { uid, error });
    }
    // SAFETY: as above; this must fail once root is given up.
    if uid != 0 && unsafe { libc::setuid(0) } == 0 {
        return Err(PrivilegeError::RootRegainable);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_step_and_the_id() {
        let eperm = || io::Error::from_raw_os_error(libc::EPERM);
        let gid = PrivilegeError::Gid {
            gid: 100,
            error: eperm(),
        };
        assert_eq!(
            gid.to_string(),
            "cannot switch to gid 100: Operation not permitted (os error 1)"
        );
        let groups = PrivilegeError::SupplementaryGroups(eperm());
        assert!(groups
            .to_string()
            .starts_with("cannot drop supplementary groups: "));
    }
}
