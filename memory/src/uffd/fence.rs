//! Fencing guest RAM when a lazy restore can no longer serve it.
//!
//! While guest RAM is registered with a userfaultfd, a thread touching a missing page
//! sleeps until somebody fills or wakes it. When the page server is gone (the loader
//! failed, or an external handler died) there are two bad outcomes to avoid:
//! - closing the last userfaultfd reference drops the registration, after which missing
//!   pages are silently filled with **zeros** — the guest would run on wrong memory;
//! - keeping it open with nobody serving leaves faulting threads asleep **forever**.
//!
//! [`RamFence::fence`] takes a third way: it makes guest RAM inaccessible
//! (`mprotect(PROT_NONE)`, which also makes KVM drop its mappings of it) and then wakes
//! every thread queued on a fault there (`UFFDIO_WAKE`). A woken vCPU retries its access,
//! finds no access rights and leaves `KVM_RUN` with `EFAULT`; a host thread touching
//! guest RAM with a system call gets `EFAULT` back. Nobody reads a page that was never
//! loaded, nobody waits forever, and the VMM ends the run with the error that caused the
//! fence. Fencing is one-way: the machine cannot run on afterwards.

use std::sync::atomic::{AtomicBool, Ordering};

use log::{debug, error};
use userfaultfd::Uffd;

use super::UffdError;

/// Guest RAM ranges of this process, registered with a userfaultfd.
#[derive(Debug)]
pub struct RamFence {
    ranges: Vec<(u64, u64)>,
    fenced: AtomicBool,
}

impl RamFence {
    /// A fence over `ranges` (`(host address, length)`, page aligned, mapped in this
    /// process for as long as the fence may be used).
    pub fn new(ranges: Vec<(u64, u64)>) -> RamFence {
        RamFence {
            ranges,
            fenced: AtomicBool::new(false),
        }
    }

    /// The ranges this fence covers.
    pub(crate) fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    /// Makes every range inaccessible, then wakes every thread waiting on a fault in
    /// them through `uffd` (the userfaultfd they are registered with). Idempotent.
    /// Returns the first error; it still tries every range.
    pub fn fence(&self, uffd: &Uffd) -> Result<(), UffdError> {
        if self.fenced.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let mut first_error = None;
        for &(addr, len) in &self.ranges {
            // SAFETY: the range is guest RAM mapped by this process for the lifetime of
            // the machine (the fence's owner outlives no mapping it names). Removing
            // access rights cannot break Rust invariants: nothing in this process holds
            // references into guest RAM, which is only reached through raw pointers and
            // system calls that report EFAULT.
            let ret =
                unsafe { libc::mprotect(addr as *mut libc::c_void, len as usize, libc::PROT_NONE) };
            if ret != 0 {
                let source = std::io::Error::last_os_error();
                error!("cannot fence guest RAM at {addr:#x} (+{len:#x}): {source}");
                first_error.get_or_insert(UffdError::Io {
                    op: "mprotect guest RAM to PROT_NONE",
                    source,
                });
            }
        }
        for &(addr, len) in &self.ranges {
            if let Err(e) = uffd.wake(addr as *mut libc::c_void, len as usize) {
                debug!("UFFDIO_WAKE on fenced guest RAM at {addr:#x}: {e}");
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                debug!("guest RAM fenced: {} ranges", self.ranges.len());
                Ok(())
            }
        }
    }
}
