//! Reads, writes and flushes: synchronously on the worker thread ([`SyncBackend`]) or through
//! io_uring ([`IoUringBackend`]), both straight between the file and guest memory through
//! iovecs ([`guest_iovecs`]); O_DIRECT with unaligned guest buffers goes through the sync
//! backend's bounce buffer. Discard and write zeroes always run synchronously (see `disk`).

pub(crate) mod io_uring;
pub(crate) mod sync;

pub(crate) use self::io_uring::IoUringBackend;
pub(crate) use self::sync::SyncBackend;

use vm_memory::{GuestAddress, VolatileSlice};

use super::request::Status;
use super::SECTOR_SIZE;

/// The alignment O_DIRECT is given: memory addresses, lengths and file offsets in multiples
/// of the virtio sector. A host whose logical block size is bigger (4Kn disks) refuses
/// sector-sized direct I/O; use buffered I/O there.
pub(crate) const DIRECT_ALIGNMENT: usize = SECTOR_SIZE as usize;

/// The most iovecs one vectored system call or io_uring READV / WRITEV takes (the kernel's
/// IOV_MAX).
pub(crate) const MAX_IOVECS: usize = 1024;

/// A request the worker still has to answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Completion {
    pub head: u16,
    pub status_addr: GuestAddress,
    pub status: Status,
    /// The bytes written into the chain's writable part (data and status byte).
    pub used_len: u32,
}

/// Whether every buffer can go to an O_DIRECT file as it is.
pub(crate) fn direct_io_aligned(buffers: &[VolatileSlice]) -> bool {
    buffers.iter().all(|buffer| {
        (buffer.ptr_guard().as_ptr() as usize).is_multiple_of(DIRECT_ALIGNMENT)
            && buffer.len().is_multiple_of(DIRECT_ALIGNMENT)
    })
}

/// Whether an O_DIRECT file (`direct`) needs `buffers` copied through an aligned bounce
/// buffer: the kernel refuses unaligned addresses and lengths there.
pub(crate) fn needs_bounce(buffers: &[VolatileSlice], direct: bool) -> bool {
    direct && !direct_io_aligned(buffers)
}

/// The bytes `buffers` hold in all.
pub(crate) fn total_len(buffers: &[VolatileSlice]) -> u64 {
    buffers.iter().map(|buffer| buffer.len() as u64).sum()
}

/// One iovec per guest buffer, pointing straight into guest memory, for preadv / pwritev
/// or io_uring's READV / WRITEV. The pointers stay valid while the guest memory they come
/// from stays mapped, which the caller ensures for as long as the kernel uses them.
pub(crate) fn guest_iovecs(buffers: &[VolatileSlice]) -> Vec<libc::iovec> {
    buffers
        .iter()
        .map(|buffer| libc::iovec {
            iov_base: buffer.ptr_guard_mut().as_ptr().cast(),
            iov_len: buffer.len(),
        })
        .collect()
}

/// Walks guest buffers in order, copying to or from host memory.
pub(crate) struct GuestCursor<'s, 'a> {
    buffers: &'s [VolatileSlice<'a>],
    index: usize,
    offset: usize,
}

impl<'s, 'a> GuestCursor<'s, 'a> {
    pub fn new(buffers: &'s [VolatileSlice<'a>]) -> Self {
        GuestCursor {
            buffers,
            index: 0,
            offset: 0,
        }
    }

    /// Copies `data` into the buffers from where the last copy stopped; returns how much
    /// fitted.
    pub fn write_from(&mut self, mut data: &[u8]) -> usize {
        let mut copied = 0;
        while let Some(part) = self.next_part(data.len()) {
            part.copy_from(&data[..part.len()]);
            copied += part.len();
            data = &data[part.len()..];
        }
        copied
    }

    /// Fills `data` from the buffers from where the last copy stopped; returns how much
    /// there was.
    pub fn read_into(&mut self, mut data: &mut [u8]) -> usize {
        let mut copied = 0;
        while let Some(part) = self.next_part(data.len()) {
            let n = part.copy_to(&mut data[..part.len()]);
            copied += n;
            data = &mut data[n..];
        }
        copied
    }

    /// The next at most `max` bytes of buffer, consumed.
    fn next_part(&mut self, max: usize) -> Option<VolatileSlice<'a>> {
        if max == 0 {
            return None;
        }
        loop {
            let buffer = self.buffers.get(self.index)?;
            let left = buffer.len() - self.offset;
            if left == 0 {
                self.index += 1;
                self.offset = 0;
                continue;
            }
            let len = left.min(max);
            // In bounds: offset + len <= buffer.len().
            let part = buffer.subslice(self.offset, len).ok()?;
            self.offset += len;
            return Some(part);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cursor_crosses_buffers() {
        let mut first = [0u8; 3];
        let mut second = [0u8; 5];
        // SAFETY: both arrays outlive the slices and nothing else touches them meanwhile.
        let buffers = unsafe {
            [
                VolatileSlice::new(first.as_mut_ptr(), first.len()),
                VolatileSlice::new(second.as_mut_ptr(), second.len()),
            ]
        };
        let mut cursor = GuestCursor::new(&buffers);
        assert_eq!(cursor.write_from(&[1, 2]), 2);
        assert_eq!(cursor.write_from(&[3, 4, 5, 6, 7, 8, 9, 10]), 6);
        assert_eq!(first, [1, 2, 3]);
        assert_eq!(second, [4, 5, 6, 7, 8]);

        let mut cursor = GuestCursor::new(&buffers);
        let mut out = [0u8; 10];
        assert_eq!(cursor.read_into(&mut out[..4]), 4);
        assert_eq!(cursor.read_into(&mut out[4..]), 4);
        assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]);
    }
}
