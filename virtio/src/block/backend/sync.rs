//! Synchronous I/O on the worker thread through a fixed, aligned bounce buffer: pread and
//! pwrite in chunks of [`BOUNCE_SIZE`], then fdatasync for a flush.
//!
//! The buffer keeps what one request allocates fixed whatever its length, and its alignment
//! makes every chunk valid O_DIRECT I/O (offsets and lengths are whole sectors). The
//! io_uring backend uses it too, for O_DIRECT requests whose guest buffers are not aligned.

use std::fs::File;
use std::os::unix::fs::FileExt;

use vm_memory::VolatileSlice;

use super::GuestCursor;

/// The bounce buffer's size: big enough that a chunk is one efficient system call, small
/// enough to be nothing next to a VM.
pub(crate) const BOUNCE_SIZE: usize = 128 * 1024;
/// Its alignment: a page, which any O_DIRECT file accepts.
const BOUNCE_ALIGNMENT: usize = 4096;

/// `len` bytes at a page-aligned address (a `Vec` over-allocated by one page, used from its
/// first aligned byte: no unsafe allocation).
struct AlignedBuffer {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuffer {
    fn new(len: usize) -> Self {
        let storage = vec![0u8; len + BOUNCE_ALIGNMENT];
        let start = storage.as_ptr().align_offset(BOUNCE_ALIGNMENT);
        AlignedBuffer {
            storage,
            start,
            len,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

pub(crate) struct SyncBackend {
    buffer: AlignedBuffer,
}

impl SyncBackend {
    pub fn new() -> Self {
        SyncBackend {
            buffer: AlignedBuffer::new(BOUNCE_SIZE),
        }
    }

    /// Reads `buffers`' total length from `offset` into them.
    pub fn read(
        &mut self,
        file: &File,
        offset: u64,
        buffers: &[VolatileSlice],
    ) -> std::io::Result<()> {
        self.in_chunks(buffers, |bounce, cursor, done| {
            // read_exact_at retries short reads and EINTR; a file shorter than the disk
            // (truncated behind our back) is an UnexpectedEof.
            file.read_exact_at(bounce, offset + done)?;
            cursor.write_from(bounce);
            Ok(())
        })
    }

    /// Writes `buffers` to the file at `offset`.
    pub fn write(
        &mut self,
        file: &File,
        offset: u64,
        buffers: &[VolatileSlice],
    ) -> std::io::Result<()> {
        self.in_chunks(buffers, |bounce, cursor, done| {
            cursor.read_into(bounce);
            file.write_all_at(bounce, offset + done)
        })
    }

    /// Moves `buffers`' total length through the bounce buffer a chunk at a time: `step`
    /// gets each chunk of it, the cursor over `buffers`, and how many bytes came before.
    fn in_chunks(
        &mut self,
        buffers: &[VolatileSlice],
        mut step: impl FnMut(&mut [u8], &mut GuestCursor, u64) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let total: u64 = buffers.iter().map(|b| b.len() as u64).sum();
        let mut cursor = GuestCursor::new(buffers);
        let mut done = 0u64;
        while done < total {
            let chunk = (total - done).min(BOUNCE_SIZE as u64) as usize;
            step(&mut self.buffer.as_mut_slice()[..chunk], &mut cursor, done)?;
            done += chunk as u64;
        }
        Ok(())
    }

    /// Makes every completed write durable (fdatasync).
    pub fn flush(file: &File) -> std::io::Result<()> {
        file.sync_data()
    }

    /// The bounce buffer, zeroed: what write zeroes writes where the file system cannot
    /// zero a range itself.
    pub fn zeroes(&mut self) -> &[u8] {
        let buffer = self.buffer.as_mut_slice();
        buffer.fill(0);
        buffer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounce_buffer_is_page_aligned() {
        let mut backend = SyncBackend::new();
        let zeroes = backend.zeroes();
        assert_eq!(zeroes.as_ptr() as usize % BOUNCE_ALIGNMENT, 0);
        assert_eq!(zeroes.len(), BOUNCE_SIZE);
        assert!(zeroes.iter().all(|&b| b == 0));
    }
}
