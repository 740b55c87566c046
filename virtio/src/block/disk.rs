//! The backing file: opened with its checks, locked, and the operations on it that do not go
//! through a backend (discard and write zeroes run synchronously on the worker).
//!
//! Size rule: an image whose size is not a multiple of 512 bytes is used rounded down to
//! whole sectors (as Firecracker does), with a warning; the tail is never read or written.
//! An empty file is a disk of 0 sectors (every request to it fails) until another image
//! is swapped in: Kata's Firecracker driver starts VMs with empty placeholder files as
//! drives. A file of 1 to 511 bytes is refused: it holds bytes no sector could reach, so
//! it is not a disk image (wherever a drive is given: command line, any API, before boot,
//! hot-plugged or swapped in).

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{BlockError, SECTOR_SIZE};

/// An open, locked disk image.
#[derive(Debug)]
pub(crate) struct Disk {
    file: File,
    path: PathBuf,
    read_only: bool,
    direct: bool,
    capacity_sectors: u64,
    /// st_dev and st_ino: recognises the same file behind another path on hot-swap.
    identity: (u64, u64),
}

/// Describes a file type the device refuses.
fn refused_kind(file_type: std::fs::FileType) -> Option<&'static str> {
    if file_type.is_file() || file_type.is_block_device() {
        None
    } else if file_type.is_dir() {
        Some("a directory")
    } else if file_type.is_fifo() {
        Some("a FIFO")
    } else if file_type.is_socket() {
        Some("a socket")
    } else if file_type.is_char_device() {
        Some("a character device")
    } else {
        Some("not a regular file")
    }
}

impl Disk {
    /// Opens `path` (following symlinks) and takes an advisory lock on it: shared for a
    /// read-only drive, exclusive for a read-write one, without waiting.
    pub fn open(path: &Path, read_only: bool, direct: bool) -> Result<Disk, BlockError> {
        Self::open_with_lock(path, read_only, direct, true)
    }

    /// [`Disk::open`], with the lock optional: a hot-swap to the file already open takes the
    /// lock only after the old descriptor (which holds it) is closed.
    pub fn open_with_lock(
        path: &Path,
        read_only: bool,
        direct: bool,
        lock: bool,
    ) -> Result<Disk, BlockError> {
        let path = path.to_path_buf();
        // The type is checked before opening so that opening has no side effects (a FIFO
        // with no writer, a tty, a watchdog), and again on the descriptor after.
        let metadata = std::fs::metadata(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => BlockError::Missing { path: path.clone() },
            _ => BlockError::Stat {
                path: path.clone(),
                source,
            },
        })?;
        if let Some(kind) = refused_kind(metadata.file_type()) {
            return Err(BlockError::NotADisk { path, kind });
        }

        let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(flags)
            .open(&path)
            .map_err(|source| open_error(&path, read_only, direct, source))?;
        Self::from_open_file(file, path, read_only, direct, lock)
    }

    /// Takes over `file`, the image descriptor another gpuvm process had open for the
    /// drive at `path` (a live update): it must be that file (same device and inode as
    /// `path` now), opened as the drive says (read-write unless `read_only`, O_DIRECT if
    /// `direct`). The lock is taken on it again, which succeeds at once where the
    /// descriptor holds it already: flock locks belong to the open file description, which
    /// the handed-over descriptor shares with the old process's.
    pub fn adopt(
        file: File,
        path: &Path,
        read_only: bool,
        direct: bool,
    ) -> Result<Disk, BlockError> {
        let path = path.to_path_buf();
        let mismatch = |reason: String| BlockError::AdoptedMismatch {
            path: path.clone(),
            reason,
        };
        let held = file
            .metadata()
            .map_err(|e| mismatch(format!("cannot stat the descriptor: {e}")))?;
        let named =
            std::fs::metadata(&path).map_err(|e| mismatch(format!("cannot stat the path: {e}")))?;
        if (held.dev(), held.ino()) != (named.dev(), named.ino()) {
            return Err(mismatch(format!(
                "the descriptor is inode {} on device {:#x}, the path inode {} on device {:#x}",
                held.ino(),
                held.dev(),
                named.ino(),
                named.dev()
            )));
        }
        // SAFETY: F_GETFL on a descriptor `file` owns; no memory is involved.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(mismatch(format!(
                "cannot read its flags: {}",
                std::io::Error::last_os_error()
            )));
        }
        let writable = flags & libc::O_ACCMODE == libc::O_RDWR;
        if !read_only && !writable {
            return Err(mismatch("the descriptor is not open read-write".into()));
        }
        if direct != (flags & libc::O_DIRECT != 0) {
            return Err(mismatch(format!(
                "the drive's direct is {direct}, the descriptor's O_DIRECT is {}",
                !direct
            )));
        }
        Self::from_open_file(file, path, read_only, direct, true)
    }

    /// The checks and figures common to a file opened here and one adopted: its type
    /// (regular file or block device), its size, and the lock if `lock`.
    fn from_open_file(
        file: File,
        path: PathBuf,
        read_only: bool,
        direct: bool,
        lock: bool,
    ) -> Result<Disk, BlockError> {
        let metadata = file.metadata().map_err(|source| BlockError::Stat {
            path: path.clone(),
            source,
        })?;
        if let Some(kind) = refused_kind(metadata.file_type()) {
            // Swapped between the two looks.
            return Err(BlockError::NotADisk { path, kind });
        }
        clear_nonblock(&file).map_err(|source| BlockError::Stat {
            path: path.clone(),
            source,
        })?;

        // SEEK_END gives a block device's size too (st_size is 0 for it).
        let size = (&file)
            .seek(SeekFrom::End(0))
            .map_err(|source| BlockError::Stat {
                path: path.clone(),
                source,
            })?;
        if size == 0 {
            // A disk of no sectors (every request to it fails), as Firecracker. Kata's
            // Firecracker driver starts VMs with empty placeholder files as drives and
            // swaps real images in later (PATCH /drives).
            log::warn!(
                "{}: an empty file: a disk of 0 sectors until it is replaced",
                path.display()
            );
        } else if size < SECTOR_SIZE {
            return Err(BlockError::LessThanASector { path, size });
        } else if !size.is_multiple_of(SECTOR_SIZE) {
            log::warn!(
                "{}: {size} bytes is not a multiple of {SECTOR_SIZE}: the last {} bytes are not part of the disk",
                path.display(),
                size % SECTOR_SIZE
            );
        }
        let disk = Disk {
            file,
            path,
            read_only,
            direct,
            capacity_sectors: size / SECTOR_SIZE,
            identity: (metadata.dev(), metadata.ino()),
        };
        if lock {
            disk.lock()?;
        }
        Ok(disk)
    }

    /// Takes the advisory lock without waiting (flock: it belongs to this open file, so a
    /// second open in the same process conflicts too).
    pub fn lock(&self) -> Result<(), BlockError> {
        let (operation, wanted) = if self.read_only {
            (libc::LOCK_SH, "a shared")
        } else {
            (libc::LOCK_EX, "an exclusive")
        };
        // SAFETY: flock on a descriptor this struct owns; no memory is involved.
        let result = unsafe { libc::flock(self.file.as_raw_fd(), operation | libc::LOCK_NB) };
        if result == 0 {
            return Ok(());
        }
        let source = std::io::Error::last_os_error();
        if source.raw_os_error() == Some(libc::EWOULDBLOCK) {
            Err(BlockError::Locked {
                path: self.path.clone(),
                wanted,
            })
        } else {
            Err(BlockError::Lock {
                path: self.path.clone(),
                source,
            })
        }
    }

    /// Whether `path` names this same file (device and inode).
    pub fn is_same_file(&self, path: &Path) -> bool {
        std::fs::metadata(path)
            .map(|m| (m.dev(), m.ino()) == self.identity)
            .unwrap_or(false)
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_sectors
    }

    /// Deallocates `[offset, offset + len)`; the file keeps its size and the range reads
    /// as zeroes. A file system without hole punching is told apart by the caller (a
    /// discard may be ignored, a write-zeroes may not).
    pub fn punch_hole(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
    }

    /// Zeroes `[offset, offset + len)` in place: FALLOC_FL_ZERO_RANGE (keeps the blocks
    /// allocated), or writing zeroes from `zeroes` (an aligned buffer of zeroes, so it
    /// works with O_DIRECT) where the file system cannot.
    pub fn write_zeroes(&self, offset: u64, len: u64, zeroes: &[u8]) -> std::io::Result<()> {
        match self.fallocate(
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => return Ok(()),
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL)
                ) => {}
            Err(error) => return Err(error),
        }
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(zeroes.len() as u64) as usize;
            self.file.write_all_at(&zeroes[..chunk], offset + done)?;
            done += chunk as u64;
        }
        Ok(())
    }

    fn fallocate(&self, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
        };
        loop {
            // SAFETY: fallocate on a descriptor this struct owns; no memory is involved.
            let result = unsafe { libc::fallocate64(self.file.as_raw_fd(), mode, offset, len) };
            if result == 0 {
                return Ok(());
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

fn open_error(path: &Path, read_only: bool, direct: bool, source: std::io::Error) -> BlockError {
    let path = path.to_path_buf();
    match source.raw_os_error() {
        Some(libc::ENOENT) => BlockError::Missing { path },
        Some(libc::EACCES) | Some(libc::EROFS) | Some(libc::EPERM) | Some(libc::ETXTBSY)
            if !read_only =>
        {
            BlockError::OpenReadWrite { path, source }
        }
        Some(libc::EINVAL) if direct => BlockError::DirectUnsupported { path, source },
        _ => BlockError::Open { path, source },
    }
}

/// O_NONBLOCK was only there so that opening could not hang; it means nothing for regular
/// files and block devices, but is cleared so the descriptor is what it looks like.
fn clear_nonblock(file: &File) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor `file` owns; no memory is involved.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: F_SETFL on a descriptor `file` owns; no memory is involved.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
