//! A chain's guest buffers as host memory: the slices behind its descriptors, checked
//! against guest memory and bounded, and readv/writev over them with the device's own
//! buffers around them.

use std::os::fd::RawFd;

use virtio_queue::DescriptorChain;
use vm_memory::bitmap::{Bitmap, BitmapSlice};
use vm_memory::{GuestMemory as _, Permissions, VolatileSlice};

use super::{ChainError, MAX_GUEST_PIECES};
use crate::GuestMemory;

pub(super) type Slices<'m> = Vec<VolatileSlice<'m>>;

/// The host memory behind a chain's readable (`for_device_write == false`) or writable
/// descriptors, at most `limit` bytes of it; `Err(TooLong)` if the chain holds more and
/// `stop_at_limit` is false.
pub(super) fn chain_slices<'m>(
    memory: &'m GuestMemory,
    chain: DescriptorChain<&'m GuestMemory>,
    writable: bool,
    limit: usize,
    stop_at_limit: bool,
) -> Result<(Slices<'m>, usize), ChainError> {
    let (descriptors, access) = if writable {
        (chain.writable(), Permissions::Write)
    } else {
        (chain.readable(), Permissions::Read)
    };
    let mut slices = Vec::new();
    let mut total = 0usize;
    for descriptor in descriptors {
        let mut len = descriptor.len() as usize;
        if total + len > limit {
            if !stop_at_limit {
                return Err(ChainError::TooLong);
            }
            len = limit - total;
        }
        let pieces = memory
            .get_slices(descriptor.addr(), len, access)
            .map_err(|error| ChainError::BadAddress(error.to_string()))?;
        for piece in pieces {
            let piece = piece.map_err(|error| ChainError::BadAddress(error.to_string()))?;
            if slices.len() == MAX_GUEST_PIECES {
                if stop_at_limit {
                    return Ok((slices, total));
                }
                return Err(ChainError::TooFragmented);
            }
            total += piece.len();
            slices.push(piece);
        }
        if total == limit && stop_at_limit {
            break;
        }
    }
    Ok((slices, total))
}

/// Splits `slices` after `at` bytes (which they hold).
pub(super) fn split_slices<'m>(slices: Slices<'m>, at: usize) -> (Slices<'m>, Slices<'m>) {
    let mut head = Vec::new();
    let mut tail = Vec::with_capacity(slices.len());
    let mut left = at;
    for slice in slices {
        if left == 0 {
            tail.push(slice);
        } else if slice.len() <= left {
            left -= slice.len();
            head.push(slice);
        } else {
            // In bounds: 0 < left < slice.len().
            if let (Ok(first), Ok(rest)) = (slice.subslice(0, left), slice.offset(left)) {
                head.push(first);
                tail.push(rest);
            }
            left = 0;
        }
    }
    (head, tail)
}

/// One readv or writev over the device's own buffers and guest slices.
pub(super) fn vectored_io(
    fd: RawFd,
    prefix: &mut [u8],
    guest: &[VolatileSlice<'_>],
    suffix: &mut [u8],
    write: bool,
) -> std::io::Result<usize> {
    let guards: Vec<_> = guest.iter().map(|slice| slice.ptr_guard_mut()).collect();
    let mut iovecs = Vec::with_capacity(guards.len() + 2);
    iovecs.push(libc::iovec {
        iov_base: prefix.as_mut_ptr().cast(),
        iov_len: prefix.len(),
    });
    iovecs.extend(guards.iter().map(|guard| libc::iovec {
        iov_base: guard.as_ptr().cast(),
        iov_len: guard.len(),
    }));
    if !suffix.is_empty() {
        iovecs.push(libc::iovec {
            iov_base: suffix.as_mut_ptr().cast(),
            iov_len: suffix.len(),
        });
    }
    let count = iovecs.len() as libc::c_int;
    loop {
        // SAFETY: every iovec covers memory valid for its length while the call runs: the
        // device's buffers are borrowed mutably, and the guest slices are mapped guest RAM
        // (the guards keep them so). The kernel reads or writes only within them. Guest
        // memory may change under the kernel's feet; that is the guest's own business.
        let result = unsafe {
            if write {
                libc::writev(fd, iovecs.as_ptr(), count)
            } else {
                libc::readv(fd, iovecs.as_ptr(), count)
            }
        };
        if result >= 0 {
            return Ok(result as usize);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Writes `bytes` over the start of `slices` (which hold at least that many).
pub(super) fn write_into<B: BitmapSlice>(slices: &[VolatileSlice<'_, B>], bytes: &[u8]) {
    let mut rest = bytes;
    for slice in slices {
        if rest.is_empty() {
            break;
        }
        let n = slice.len().min(rest.len());
        slice.copy_from(&rest[..n]);
        rest = &rest[n..];
    }
}

pub(super) fn mark_dirty(slices: &[VolatileSlice<'_>], mut bytes: usize) {
    for slice in slices {
        if bytes == 0 {
            break;
        }
        let n = slice.len().min(bytes);
        slice.bitmap().mark_dirty(0, n);
        bytes -= n;
    }
}
