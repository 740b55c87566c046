//! Host facts that passthrough depends on.

use crate::{Result, VfioError};

/// The soft RLIMIT_MEMLOCK of this process (u64::MAX when unlimited).
pub fn memlock_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(if limit.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        limit.rlim_cur
    })
}

/// Kernel VFIO pins every DMA-mapped page against RLIMIT_MEMLOCK: fails with the value to
/// raise it to when `ram_bytes` (plus a little for the device) does not fit.
pub fn check_memlock(ram_bytes: u64) -> Result<()> {
    let needed = ram_bytes.saturating_add(64 << 20);
    let current = memlock_limit()?;
    if current >= needed {
        return Ok(());
    }
    Err(VfioError::Memlock {
        current,
        needed,
        needed_kib: needed.div_ceil(1024),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_error_names_the_value() {
        let current = memlock_limit().unwrap();
        if current == u64::MAX {
            assert!(check_memlock(u64::MAX - (64 << 20)).is_ok());
            return;
        }
        let error = check_memlock(current + (1 << 30)).unwrap_err().to_string();
        let kib = (current + (1 << 30) + (64 << 20)).div_ceil(1024);
        assert!(error.contains(&format!("ulimit -l {kib}")), "{error}");
        assert!(check_memlock(0).is_ok() || current < 64 << 20);
    }
}
