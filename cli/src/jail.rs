//! Confinement of the gpuvm process: seccomp filters, armed before the VM is built, and
//! for cloud hosts a chroot and an unprivileged uid/gid, applied after the VM's file
//! descriptors are open and before the guest runs; the process cannot regain root
//! afterwards (checked).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;

use crate::args::{JailArgs, SeccompArgs};
use crate::{CliError, LOG_TARGET};

impl SeccompArgs {
    /// Compiles the filters and arms the SIGSYS handler, unless --no-seccomp.
    pub fn enable(&self) -> Result<(), CliError> {
        if self.no_seccomp {
            log::info!(target: LOG_TARGET, "seccomp filters are off (--no-seccomp)");
            return Ok(());
        }
        let settings = gpuvm_vmm::seccomp::Settings::from_env().map_err(gpuvm_vmm::Error::from)?;
        if settings.on_violation == gpuvm_vmm::seccomp::OnViolation::Log {
            log::warn!(
                target: LOG_TARGET,
                "seccomp filters only log violations (GPUVM_SECCOMP_LOG_ONLY)"
            );
        }
        gpuvm_vmm::seccomp::enable(&settings).map_err(gpuvm_vmm::Error::from)?;
        Ok(())
    }
}

fn os_error(what: &str) -> CliError {
    CliError::Other(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// Chroot (`--chroot`), then drop to `--uid`/`--gid`.
pub fn enter(args: &JailArgs) -> Result<(), CliError> {
    if let Some(dir) = &args.chroot {
        let path = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| CliError::Other("--chroot path contains a NUL byte".into()))?;
        // SAFETY: chroot(2) reads a NUL-terminated path that lives across the call.
        if unsafe { libc::chroot(path.as_ptr()) } != 0 {
            return Err(os_error(&format!("cannot chroot to {}", dir.display())));
        }
        std::env::set_current_dir("/")
            .map_err(|e| CliError::Other(format!("cannot enter the new root: {e}")))?;
        log::info!("chrooted to {}", dir.display());
    }
    if let (Some(uid), Some(gid)) = (args.uid, args.gid) {
        // The jailer's own step, shared with it.
        gpuvm_jailer::drop_privileges(uid, gid).map_err(|e| CliError::Other(e.to_string()))?;
        log::info!("running as uid {uid} gid {gid}");
    }
    Ok(())
}
