//! The resource limits the jail runs under: `--resource-limit fsize=` and `no-file=`, and
//! the bound on open files the jailer sets when `no-file` is not given.

use std::io;

use crate::JailerError;

/// The jailer bounds the number of open files to this unless `--resource-limit no-file=`.
const DEFAULT_NO_FILE: u64 = 2048;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Resource {
    FileSize,
    OpenFiles,
}

/// The limits to set, resolved from the flags (the last of a resource given twice wins).
#[derive(Debug, PartialEq)]
pub(crate) struct Limits {
    no_file: u64,
    file_size: Option<u64>,
}

impl Limits {
    pub(crate) fn new(requested: &[(Resource, u64)]) -> Self {
        let mut limits = Limits {
            no_file: DEFAULT_NO_FILE,
            file_size: None,
        };
        for (resource, value) in requested {
            match resource {
                Resource::OpenFiles => limits.no_file = *value,
                Resource::FileSize => limits.file_size = Some(*value),
            }
        }
        limits
    }

    /// Sets the limits on this process; the exec file inherits them.
    pub(crate) fn apply(&self) -> Result<(), JailerError> {
        set_limit(libc::RLIMIT_NOFILE, "no-file", self.no_file)?;
        if let Some(size) = self.file_size {
            set_limit(libc::RLIMIT_FSIZE, "fsize", size)?;
        }
        Ok(())
    }
}

/// Sets both the soft and the hard limit, so the VMM cannot raise it again.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_files_are_bounded_unless_given_and_the_last_value_wins() {
        assert_eq!(
            Limits::new(&[]),
            Limits {
                no_file: DEFAULT_NO_FILE,
                file_size: None
            }
        );
        let given = Limits::new(&[
            (Resource::OpenFiles, 10),
            (Resource::FileSize, 4096),
            (Resource::OpenFiles, 20),
        ]);
        assert_eq!(
            given,
            Limits {
                no_file: 20,
                file_size: Some(4096)
            }
        );
    }
}
