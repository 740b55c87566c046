//! `UFFDIO_COPY` / `UFFDIO_ZEROPAGE` with the retry rules the loader needs:
//! - `EEXIST`: the page is already present (the other loader path won the race, or it was
//!   populated through another mapping of the memfd). Skip it, and wake it, since a thread
//!   may be waiting on a fault there that nobody else will wake.
//! - `EAGAIN` with progress: a partial copy (the kernel stopped at an existing page or a
//!   pending mm change); continue after the copied part.
//! - `EAGAIN` without progress: the mm is changing; retry after a pause.

use std::time::Duration;

use userfaultfd::{Error as RawError, Uffd};

use super::UffdError;

/// The base page size; larger loader pages mean hugetlb.
pub(crate) const BASE_PAGE_SIZE: u64 = 4096;
/// EAGAIN-without-progress retries before giving up (the kernel only does this while the
/// address space is changing, which settles quickly).
const MAX_STALLS: u32 = 10_000;

/// Outcome of filling a range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Filled {
    /// Pages that were already present (left as they are, and woken).
    pub existed: u64,
    /// EAGAIN retries needed.
    pub retries: u64,
}

/// Copies `len` bytes (whole pages) from `src` to the registered range at `dst`, waking
/// threads that fault there.
///
/// # Safety
/// `src..src + len` must be readable memory of this process.
pub(crate) unsafe fn copy(
    uffd: &Uffd,
    src: *const u8,
    dst: u64,
    len: usize,
    page_size: usize,
) -> Result<Filled, UffdError> {
    let mut out = Filled::default();
    let mut done = 0usize;
    let mut stalls = 0u32;
    while done < len {
        let at = dst + done as u64;
        // SAFETY: the caller vouches for the source range; the kernel checks the
        // destination against the registered ranges and never touches our memory there.
        let result = unsafe {
            uffd.copy(
                src.add(done).cast(),
                at as *mut libc::c_void,
                len - done,
                true,
            )
        };
        match result {
            Ok(n) if n > 0 => done += n,
            // uffd-rs returns the kernel's signed `copy` field as usize; a negative
            // value is -errno (no progress).
            Err(RawError::PartiallyCopied(n)) if (n as isize) > 0 => {
                done += n;
                out.retries += 1;
            }
            Ok(_) | Err(RawError::PartiallyCopied(_)) => {
                stall(&mut stalls, "UFFDIO_COPY", at)?;
                out.retries += 1;
            }
            Err(RawError::CopyFailed(errno)) if errno as i32 == libc::EEXIST => {
                wake(uffd, at, page_size)?;
                out.existed += 1;
                done += page_size;
            }
            Err(RawError::CopyFailed(errno)) if errno as i32 == libc::EAGAIN => {
                stall(&mut stalls, "UFFDIO_COPY", at)?;
                out.retries += 1;
            }
            Err(RawError::CopyFailed(errno)) => {
                return Err(UffdError::Fill {
                    op: "UFFDIO_COPY",
                    addr: at,
                    errno: errno as i32,
                })
            }
            Err(other) => {
                return Err(UffdError::Fill {
                    op: "UFFDIO_COPY",
                    addr: at,
                    errno: raw_errno(&other),
                })
            }
        }
    }
    Ok(out)
}

/// Maps zero pages at `dst..dst + len` (base pages only; hugetlb has no zeropage ioctl).
pub(crate) fn zeropage(
    uffd: &Uffd,
    dst: u64,
    len: usize,
    page_size: usize,
) -> Result<Filled, UffdError> {
    let mut out = Filled::default();
    let mut stalls = 0u32;
    let mut done = 0usize;
    while done < len {
        let at = dst + done as u64;
        // One page at a time: uffd-rs drops the partial count on EAGAIN, and this is only
        // used for single faulting pages anyway.
        // SAFETY: the kernel checks the destination against the registered ranges.
        match unsafe { uffd.zeropage(at as *mut libc::c_void, page_size, true) } {
            Ok(_) => done += page_size,
            Err(RawError::ZeropageFailed(errno)) if errno as i32 == libc::EEXIST => {
                wake(uffd, at, page_size)?;
                out.existed += 1;
                done += page_size;
            }
            Err(RawError::ZeropageFailed(errno)) if errno as i32 == libc::EAGAIN => {
                stall(&mut stalls, "UFFDIO_ZEROPAGE", at)?;
                out.retries += 1;
            }
            Err(other) => {
                return Err(UffdError::Fill {
                    op: "UFFDIO_ZEROPAGE",
                    addr: at,
                    errno: raw_errno(&other),
                })
            }
        }
    }
    Ok(out)
}

/// Wakes threads waiting on faults in `addr..addr + len`.
pub(crate) fn wake(uffd: &Uffd, addr: u64, len: usize) -> Result<(), UffdError> {
    uffd.wake(addr as *mut libc::c_void, len)
        .map_err(|source| UffdError::Wake { addr, source })
}

fn stall(stalls: &mut u32, op: &'static str, addr: u64) -> Result<(), UffdError> {
    *stalls += 1;
    if *stalls > MAX_STALLS {
        return Err(UffdError::Stuck {
            op,
            addr,
            attempts: *stalls,
        });
    }
    if *stalls > 16 {
        std::thread::sleep(Duration::from_micros(50));
    } else {
        std::thread::yield_now();
    }
    Ok(())
}

/// poll(2) on `fds` with no timeout, retried when a signal interrupts it.
pub(crate) fn poll_until_ready(fds: &mut [libc::pollfd]) -> std::io::Result<()> {
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed array of pollfds for the call.
        let ret = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ret >= 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// The errno inside a uffd-rs error, EIO when it carries none.
pub(crate) fn raw_errno(e: &RawError) -> i32 {
    match e {
        RawError::CopyFailed(errno) | RawError::ZeropageFailed(errno) => *errno as i32,
        RawError::SystemError(errno) => *errno as i32,
        _ => libc::EIO,
    }
}

/// A zero-initialised, page-aligned buffer (`UFFDIO_COPY` needs a page-aligned source),
/// which costs no page faults until it is written.
pub(crate) type AlignedBuf = crate::anon::AnonMap;
