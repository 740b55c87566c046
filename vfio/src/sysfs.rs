//! Bounded reads of the host's sysfs and procfs attribute files: the one place gpuvm
//! reads host facts (PCIe topology, NUMA, device class) from files a host, a container
//! runtime or a test tree controls.
//!
//! A real attribute is a small regular file. A tree that is broken or hostile may put a
//! FIFO (an open or a read that blocks forever), a device node such as /dev/zero (an
//! endless read), a huge file, a symlink loop or a directory where an attribute should
//! be. Every read here therefore opens with `O_NONBLOCK` (a FIFO's open returns at once),
//! `O_NOFOLLOW` (the attribute itself is never a link; the directories above it may be,
//! as sysfs's are), checks that what it opened is a regular file, and reads at most a
//! fixed number of bytes: each of those cases is an error that names the path and says
//! what was found, in bounded time.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Most attributes are at most a page (the kernel's limit for text attributes); binary
/// ones read here (a PCI device's `config`) are at most 4 KiB. Anything larger is not
/// what it claims to be.
pub const MAX_ATTRIBUTE_BYTES: usize = 64 * 1024;

/// What went wrong reading one attribute file.
#[derive(Debug, thiserror::Error)]
pub enum SysfsError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is a {found}, not a regular file")]
    NotRegular { path: PathBuf, found: &'static str },
    #[error("{path} holds more than {limit} bytes: not a sysfs attribute")]
    TooLarge { path: PathBuf, limit: usize },
    #[error("{path} is not text")]
    NotText { path: PathBuf },
}

impl SysfsError {
    /// Whether the file (or a directory above it) does not exist: for most attributes,
    /// "the host does not say", not an error.
    pub fn is_not_found(&self) -> bool {
        matches!(self, SysfsError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// Reads the attribute file at `path`, at most `limit` bytes (more is an error).
pub fn read_bytes(path: &Path, limit: usize) -> Result<Vec<u8>, SysfsError> {
    let io_error = |source| SysfsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            // O_NOFOLLOW on a symbolic link.
            Some(libc::ELOOP) if is_symlink(path) => SysfsError::NotRegular {
                path: path.to_path_buf(),
                found: "symbolic link",
            },
            _ => io_error(source),
        })?;
    let file_type = file.metadata().map_err(io_error)?.file_type();
    if !file_type.is_file() {
        return Err(SysfsError::NotRegular {
            path: path.to_path_buf(),
            found: describe_type(&file_type),
        });
    }
    let mut bytes = Vec::new();
    // One byte past the limit tells a file of exactly `limit` bytes from a larger one;
    // `take` bounds the read whatever the file's reported size (sysfs reports 4096).
    file.take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io_error)?;
    if bytes.len() > limit {
        return Err(SysfsError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(bytes)
}

/// Reads a text attribute (at most [`MAX_ATTRIBUTE_BYTES`]), surrounding whitespace
/// trimmed.
pub fn read_text(path: &Path) -> Result<String, SysfsError> {
    let bytes = read_bytes(path, MAX_ATTRIBUTE_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|_| SysfsError::NotText {
        path: path.to_path_buf(),
    })?;
    Ok(text.trim().to_string())
}

/// Like [`read_text`], with a missing file as None.
pub fn read_optional_text(path: &Path) -> Result<Option<String>, SysfsError> {
    match read_text(path) {
        Ok(text) => Ok(Some(text)),
        Err(error) if error.is_not_found() => Ok(None),
        Err(error) => Err(error),
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_symlink())
}

fn describe_type(file_type: &std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "directory"
    } else if file_type.is_fifo() {
        "FIFO"
    } else if file_type.is_char_device() {
        "character device"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_socket() {
        "socket"
    } else if file_type.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// Hostile trees for tests of the readers built on this module: each kind of file a
/// broken host may put where an attribute should be.
#[cfg(any(test, feature = "test-util"))]
pub mod hostile {
    use std::path::Path;

    /// The kinds of non-attribute a tree may hold at an attribute's path.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Hostile {
        Fifo,
        DevZero,
        Huge,
        SymlinkLoop,
        Directory,
        Garbage,
    }

    impl Hostile {
        pub const ALL: [Hostile; 6] = [
            Hostile::Fifo,
            Hostile::DevZero,
            Hostile::Huge,
            Hostile::SymlinkLoop,
            Hostile::Directory,
            Hostile::Garbage,
        ];

        /// Puts this kind of file at `path` (replacing what is there).
        pub fn create(self, path: &Path) -> std::io::Result<()> {
            let _ = std::fs::remove_file(path);
            let _ = std::fs::remove_dir_all(path);
            match self {
                Hostile::Fifo => {
                    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
                        .map_err(std::io::Error::other)?;
                    // SAFETY: `c_path` is a valid NUL-terminated string that outlives the call.
                    if unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) } != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                }
                Hostile::DevZero => std::os::unix::fs::symlink("/dev/zero", path),
                Hostile::Huge => {
                    // Sparse: 1 GiB of size, no blocks.
                    let file = std::fs::File::create(path)?;
                    file.set_len(1 << 30)
                }
                Hostile::SymlinkLoop => {
                    let other = path.with_extension("loop");
                    let _ = std::fs::remove_file(&other);
                    std::os::unix::fs::symlink(&other, path)?;
                    std::os::unix::fs::symlink(path, &other)
                }
                Hostile::Directory => std::fs::create_dir(path),
                Hostile::Garbage => std::fs::write(path, b"\xff\xfe garbage \x00\x01 -7x\n"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::hostile::Hostile;
    use super::*;
    use std::time::{Duration, Instant};

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuvm-sysfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn reads_a_small_attribute() {
        let dir = temp_dir("small");
        let path = dir.join("numa_node");
        std::fs::write(&path, "1\n").unwrap();
        assert_eq!(read_text(&path).unwrap(), "1");
        assert_eq!(read_optional_text(&dir.join("absent")).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_of_exactly_the_limit_is_read_and_one_byte_more_is_refused() {
        let dir = temp_dir("limit");
        let path = dir.join("config");
        std::fs::write(&path, vec![7u8; 4096]).unwrap();
        assert_eq!(read_bytes(&path, 4096).unwrap().len(), 4096);
        let error = read_bytes(&path, 4095).unwrap_err();
        assert!(
            matches!(error, SysfsError::TooLarge { limit: 4095, .. }),
            "{error}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_hostile_file_is_a_clear_error_in_bounded_time() {
        let dir = temp_dir("hostile");
        for hostile in Hostile::ALL {
            let path = dir.join("attribute");
            hostile.create(&path).unwrap();
            let started = Instant::now();
            let result = read_text(&path);
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{hostile:?} took {:?}",
                started.elapsed()
            );
            let error = result.expect_err(&format!("{hostile:?} must be refused"));
            let message = error.to_string();
            assert!(message.contains("attribute"), "{hostile:?}: {message}");
            let expected = match hostile {
                Hostile::Fifo => "FIFO",
                Hostile::DevZero => "symbolic link",
                Hostile::Huge => "more than",
                Hostile::SymlinkLoop => "symbolic link",
                Hostile::Directory => "directory",
                Hostile::Garbage => "not text",
            };
            assert!(message.contains(expected), "{hostile:?}: {message}");
            assert!(!error.is_not_found(), "{hostile:?}");
            let _ = std::fs::remove_file(path.with_extension("loop"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_device_node_reached_through_a_linked_directory_is_refused() {
        // O_NOFOLLOW guards only the last component: a device node met by its own name
        // (here /dev/zero itself) must still be refused by its type.
        let error = read_text(Path::new("/dev/zero")).unwrap_err();
        assert!(error.to_string().contains("character device"), "{error}");
    }

    #[test]
    fn a_loop_in_the_directories_above_is_an_error() {
        let dir = temp_dir("dirloop");
        std::os::unix::fs::symlink(dir.join("b"), dir.join("a")).unwrap();
        std::os::unix::fs::symlink(dir.join("a"), dir.join("b")).unwrap();
        let error = read_text(&dir.join("a/numa_node")).unwrap_err();
        assert!(matches!(error, SysfsError::Io { .. }), "{error}");
        assert!(!error.is_not_found());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
