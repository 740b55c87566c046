//! Synchronous I/O on the worker thread: preadv / pwritev straight between the file and
//! guest memory, one system call for a whole request unless the kernel moves less (then it
//! goes on from where it stopped), and fdatasync for a flush.
//!
//! O_DIRECT refuses guest buffers whose addresses or lengths are not sector-aligned; those
//! requests go through a fixed, page-aligned bounce buffer in chunks of [`BOUNCE_SIZE`]
//! instead (the io_uring backend sends them here too). The buffer keeps what one request
//! allocates fixed whatever its length, and its alignment makes every chunk valid O_DIRECT
//! I/O (offsets and lengths are whole sectors).

use std::fs::File;
use std::io::{Error, ErrorKind};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use vm_memory::VolatileSlice;

use super::{guest_iovecs, GuestCursor, MAX_IOVECS};

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

    /// Reads `buffers`' total length from `offset` straight into them. A file that ends
    /// before the request does (truncated behind our back) is an `UnexpectedEof`.
    pub fn read(file: &File, offset: u64, buffers: &[VolatileSlice]) -> std::io::Result<()> {
        transfer_all(buffers, offset, |iovecs, at| preadv(file, iovecs, at)).map_err(|error| {
            match error {
                Moved::Nothing => Error::new(
                    ErrorKind::UnexpectedEof,
                    "the file ends before the request does",
                ),
                Moved::Failed(error) => error,
            }
        })
    }

    /// Writes `buffers` straight to the file at `offset`.
    pub fn write(file: &File, offset: u64, buffers: &[VolatileSlice]) -> std::io::Result<()> {
        transfer_all(buffers, offset, |iovecs, at| pwritev(file, iovecs, at)).map_err(|error| {
            match error {
                Moved::Nothing => Error::new(ErrorKind::WriteZero, "the file took no more bytes"),
                Moved::Failed(error) => error,
            }
        })
    }

    /// [`SyncBackend::read`] through the aligned bounce buffer, for O_DIRECT with unaligned
    /// guest buffers.
    pub fn read_bounced(
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

    /// [`SyncBackend::write`] through the aligned bounce buffer, for O_DIRECT with unaligned
    /// guest buffers.
    pub fn write_bounced(
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
        let total: u64 = super::total_len(buffers);
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

/// Why [`transfer_all`] stopped before the end.
#[derive(Debug)]
enum Moved {
    /// A call moved no bytes: end of file for a read, no room for a write.
    Nothing,
    Failed(Error),
}

/// Moves every byte of `buffers` with `call` (a preadv or pwritev at the file offset it is
/// given, over at most [`MAX_IOVECS`] iovecs): once for the whole request where the kernel
/// does it all, again from where it stopped after a short count, again after EINTR.
fn transfer_all(
    buffers: &[VolatileSlice],
    offset: u64,
    mut call: impl FnMut(&[libc::iovec], u64) -> std::io::Result<usize>,
) -> Result<(), Moved> {
    let mut iovecs = guest_iovecs(buffers);
    // The first iovec with bytes left; those before it are done.
    let mut first = 0;
    let mut done = 0u64;
    loop {
        while iovecs.get(first).is_some_and(|iovec| iovec.iov_len == 0) {
            first += 1;
        }
        if first == iovecs.len() {
            return Ok(());
        }
        let end = (first + MAX_IOVECS).min(iovecs.len());
        let window = &mut iovecs[first..end];
        let moved = match call(window, offset.saturating_add(done)) {
            Ok(0) => return Err(Moved::Nothing),
            Ok(moved) => moved,
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => return Err(Moved::Failed(error)),
        };
        done += moved as u64;
        consume(window, moved);
    }
}

/// Marks the first `bytes` of `iovecs` done: whole iovecs become empty, a partly done one
/// starts after what was moved.
fn consume(iovecs: &mut [libc::iovec], mut bytes: usize) {
    for iovec in iovecs {
        if bytes == 0 {
            return;
        }
        let taken = bytes.min(iovec.iov_len);
        // In bounds: taken <= iov_len, so the new base is at most one past the buffer.
        iovec.iov_base = iovec.iov_base.cast::<u8>().wrapping_add(taken).cast();
        iovec.iov_len -= taken;
        bytes -= taken;
    }
}

/// A file offset as the system call takes it.
fn file_offset(offset: u64) -> std::io::Result<libc::off_t> {
    libc::off_t::try_from(offset).map_err(|_| Error::from_raw_os_error(libc::EFBIG))
}

/// One preadv: the bytes read (0 at the end of the file).
fn preadv(file: &File, iovecs: &[libc::iovec], offset: u64) -> std::io::Result<usize> {
    let offset = file_offset(offset)?;
    // SAFETY: every iovec covers guest memory (or, in tests, a host buffer) that stays
    // mapped and writable while the call runs: the request's buffers borrow the guest
    // memory for longer than this call. The kernel writes only within them; the count is
    // at most MAX_IOVECS, so it fits a c_int.
    let result = unsafe {
        libc::preadv(
            file.as_raw_fd(),
            iovecs.as_ptr(),
            iovecs.len() as libc::c_int,
            offset,
        )
    };
    if result < 0 {
        return Err(Error::last_os_error());
    }
    Ok(result as usize)
}

/// One pwritev: the bytes written.
fn pwritev(file: &File, iovecs: &[libc::iovec], offset: u64) -> std::io::Result<usize> {
    let offset = file_offset(offset)?;
    // SAFETY: every iovec covers memory that stays mapped and readable while the call runs
    // (as for preadv); the kernel only reads it.
    let result = unsafe {
        libc::pwritev(
            file.as_raw_fd(),
            iovecs.as_ptr(),
            iovecs.len() as libc::c_int,
            offset,
        )
    };
    if result < 0 {
        return Err(Error::last_os_error());
    }
    Ok(result as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;

    /// A file with `contents` in the temp dir, removed on drop.
    struct TempFile(PathBuf, File);

    impl TempFile {
        fn new(tag: &str, contents: &[u8]) -> TempFile {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static COUNT: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "gpuvm-blk-sync-{}-{tag}-{}",
                std::process::id(),
                COUNT.fetch_add(1, Ordering::Relaxed)
            ));
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .unwrap();
            file.write_all(contents).unwrap();
            TempFile(path, file)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13) ^ 0x5a)
            .collect()
    }

    /// Host buffers of `sizes`, and guest-style slices over them.
    struct Buffers(Vec<Vec<u8>>);

    impl Buffers {
        fn new(sizes: &[usize]) -> Buffers {
            Buffers(sizes.iter().map(|&size| vec![0u8; size]).collect())
        }

        fn slices(&mut self) -> Vec<VolatileSlice<'_>> {
            self.0
                .iter_mut()
                // SAFETY: each Vec outlives the slices (they borrow `self`) and is not
                // touched otherwise meanwhile.
                .map(|buffer| unsafe { VolatileSlice::new(buffer.as_mut_ptr(), buffer.len()) })
                .collect()
        }

        fn joined(&self) -> Vec<u8> {
            self.0.concat()
        }
    }

    /// At most `max` bytes of `iovecs`: a stand-in for a kernel that moves less than asked.
    fn limited(iovecs: &[libc::iovec], max: usize) -> Vec<libc::iovec> {
        let mut left = max;
        let mut out = Vec::new();
        for iovec in iovecs {
            if left == 0 {
                break;
            }
            let len = iovec.iov_len.min(left);
            out.push(libc::iovec {
                iov_base: iovec.iov_base,
                iov_len: len,
            });
            left -= len;
        }
        out
    }

    #[test]
    fn the_bounce_buffer_is_page_aligned() {
        let mut backend = SyncBackend::new();
        let zeroes = backend.zeroes();
        assert_eq!(zeroes.as_ptr() as usize % BOUNCE_ALIGNMENT, 0);
        assert_eq!(zeroes.len(), BOUNCE_SIZE);
        assert!(zeroes.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_request_split_at_odd_places_is_one_system_call_each_way() {
        let data = pattern(8192);
        let file = TempFile::new("one-call", &data);
        let sizes = [3, 509, 1000, 1, 536, 2047];
        let total: usize = sizes.iter().sum();

        let mut buffers = Buffers::new(&sizes);
        let mut calls = Vec::new();
        transfer_all(&buffers.slices(), 7, |iovecs, at| {
            calls.push((iovecs.len(), at));
            preadv(&file.1, iovecs, at)
        })
        .unwrap();
        assert_eq!(calls, [(sizes.len(), 7)]);
        assert_eq!(buffers.joined(), &data[7..7 + total]);

        // And back, elsewhere, through the public entry points.
        SyncBackend::write(&file.1, 100, &buffers.slices()).unwrap();
        let mut back = Buffers::new(&[total]);
        SyncBackend::read(&file.1, 100, &back.slices()).unwrap();
        assert_eq!(back.joined(), &data[7..7 + total]);
        let on_disk = std::fs::read(&file.0).unwrap();
        assert_eq!(&on_disk[100..100 + total], &data[7..7 + total]);
        assert_eq!(&on_disk[..100], &data[..100]);
    }

    #[test]
    fn short_counts_and_interruptions_go_on_where_they_stopped() {
        let data = pattern(3000);
        let file = TempFile::new("short", &data);
        let sizes = [5, 700, 2, 1293];
        let total: usize = sizes.iter().sum();

        // Reads of at most 7 bytes, the first one interrupted.
        let mut buffers = Buffers::new(&sizes);
        let mut calls = 0;
        transfer_all(&buffers.slices(), 11, |iovecs, at| {
            calls += 1;
            if calls == 1 {
                return Err(Error::from(ErrorKind::Interrupted));
            }
            preadv(&file.1, &limited(iovecs, 7), at)
        })
        .unwrap();
        assert_eq!(calls, 1 + total.div_ceil(7));
        assert_eq!(buffers.joined(), &data[11..11 + total]);

        // Writes of at most 13 bytes.
        let mut source = Buffers::new(&sizes);
        for (buffer, fill) in source.0.iter_mut().zip(1u8..) {
            buffer.fill(fill);
        }
        let mut calls = 0;
        transfer_all(&source.slices(), 0, |iovecs, at| {
            calls += 1;
            pwritev(&file.1, &limited(iovecs, 13), at)
        })
        .unwrap();
        assert_eq!(calls, total.div_ceil(13));
        let on_disk = std::fs::read(&file.0).unwrap();
        assert_eq!(&on_disk[..total], &source.joined()[..]);
        assert_eq!(&on_disk[total..], &data[total..]);
    }

    #[test]
    fn no_call_gets_more_than_iov_max_iovecs() {
        let count = MAX_IOVECS + 476;
        let data = pattern(3 * count);
        let file = TempFile::new("iov-max", &data);
        let mut buffers = Buffers::new(&vec![3; count]);
        let mut calls = Vec::new();
        transfer_all(&buffers.slices(), 0, |iovecs, at| {
            calls.push((iovecs.len(), at));
            preadv(&file.1, iovecs, at)
        })
        .unwrap();
        assert_eq!(calls, [(MAX_IOVECS, 0), (476, 3 * MAX_IOVECS as u64)]);
        assert_eq!(buffers.joined(), data);

        // A short count in the middle of an iovec: the next call starts inside it.
        let mut buffers = Buffers::new(&vec![3; count]);
        let mut calls = Vec::new();
        transfer_all(&buffers.slices(), 0, |iovecs, at| {
            calls.push((iovecs.len(), at));
            preadv(&file.1, &limited(iovecs, 3 * 1000 + 1), at)
        })
        .unwrap();
        assert!(calls.iter().all(|&(len, _)| len <= MAX_IOVECS));
        // 1000 iovecs and a byte of the next one were done.
        assert_eq!(calls[1], (count - 1000, 3001));
        assert_eq!(buffers.joined(), data);
    }

    #[test]
    fn the_end_of_the_file_or_a_full_disk_is_an_error_not_a_loop() {
        let data = pattern(1000);
        let file = TempFile::new("eof", &data);
        let mut buffers = Buffers::new(&[600, 600]);
        let error = SyncBackend::read(&file.1, 0, &buffers.slices()).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::UnexpectedEof);
        // What there was arrived before the end.
        assert_eq!(&buffers.joined()[..1000], &data[..]);

        let mut calls = 0;
        let result = transfer_all(&buffers.slices(), 0, |_, _| {
            calls += 1;
            Ok(0)
        });
        assert!(matches!(result, Err(Moved::Nothing)));
        assert_eq!(calls, 1);

        let result = transfer_all(&buffers.slices(), 0, |_, _| {
            Err(Error::from_raw_os_error(libc::ENOSPC))
        });
        assert!(
            matches!(result, Err(Moved::Failed(error)) if error.raw_os_error() == Some(libc::ENOSPC))
        );
    }

    #[test]
    fn an_offset_past_what_the_kernel_takes_is_refused() {
        let file = TempFile::new("offset", &[0u8; 16]);
        let mut buffers = Buffers::new(&[8]);
        let error = SyncBackend::read(&file.1, u64::MAX - 4, &buffers.slices()).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EFBIG));
    }

    #[test]
    fn nothing_to_move_makes_no_call() {
        let mut calls = 0;
        let mut buffers = Buffers::new(&[0, 0]);
        transfer_all(&buffers.slices(), 0, |_, _| {
            calls += 1;
            Ok(0)
        })
        .unwrap();
        assert_eq!(calls, 0);
    }
}
