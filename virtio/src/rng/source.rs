//! Where the random bytes come from, and what outlives one activation: the source and the
//! rate limiter (its tokens too).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use virtio_queue::Writer;

use super::{RngConfig, RngError, DEVICE_NAME};
use crate::rate_limiter::RateLimiter;
use crate::LogSampler;

/// How many of a recurring per-request message are logged before only the 2^k-th is.
pub(super) const LOGGED_FIRST: u64 = 8;

/// Where the random bytes come from.
#[derive(Debug)]
enum EntropySource {
    Getrandom,
    File { file: File, path: PathBuf },
}

impl EntropySource {
    fn open(path: &Path) -> Result<Self, RngError> {
        // O_NONBLOCK: opening a FIFO must not wait for a writer, and a device that has no
        // bytes yet answers EAGAIN instead of stalling the worker.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| RngError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        let file_type = file
            .metadata()
            .map_err(|source| RngError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .file_type();
        let refuse = |kind| RngError::WouldBlock {
            path: path.to_path_buf(),
            kind,
        };
        if file_type.is_dir() {
            return Err(RngError::Directory {
                path: path.to_path_buf(),
            });
        }
        if file_type.is_fifo() {
            return Err(refuse("FIFO"));
        }
        if file_type.is_socket() {
            return Err(refuse("socket"));
        }
        Ok(EntropySource::File {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Fills as much of `buf` as the source gives without waiting; fewer bytes (maybe none)
    /// at the end of a file or when a device has none ready.
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            let result = match self {
                EntropySource::Getrandom => {
                    let rest = &mut buf[filled..];
                    // SAFETY: the pointer and length describe `rest`, which is writable
                    // and lives across the call; getrandom writes at most that many bytes.
                    let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
                    if got < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        Ok(got as usize)
                    }
                }
                EntropySource::File { file, .. } => file.read(&mut buf[filled..]),
            };
            match result {
                Ok(0) => break,
                Ok(got) => filled += got,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) if filled == 0 => return Err(error),
                Err(_) => break,
            }
        }
        Ok(filled)
    }

    fn describe(&self) -> String {
        match self {
            EntropySource::Getrandom => "getrandom".to_string(),
            EntropySource::File { path, .. } => path.display().to_string(),
        }
    }
}

/// What outlives one activation: the source and the limiter (its tokens too).
#[derive(Debug)]
pub(super) struct Backend {
    source: EntropySource,
    pub(super) limiter: RateLimiter,
    source_log: LogSampler,
}

impl Backend {
    pub(super) fn new(config: &RngConfig) -> Result<Self, RngError> {
        let source = match &config.source {
            Some(path) => EntropySource::open(path)?,
            None => EntropySource::Getrandom,
        };
        Ok(Backend {
            source,
            limiter: RateLimiter::new(config.rate_limiter)?,
            source_log: LogSampler::new(LOGGED_FIRST),
        })
    }

    /// Writes up to `len` random bytes through `writer` (`buffer` holds at least `len`);
    /// returns how many went into the guest's buffers. Tokens for bytes the source did not
    /// give are refunded.
    pub(super) fn fill(&mut self, buffer: &mut [u8], writer: &mut Writer<'_>, len: usize) -> u32 {
        let chunk = &mut buffer[..len];
        let got = match self.source.read(chunk) {
            Ok(got) => got,
            Err(error) => {
                if self.source_log.sample() {
                    log::error!(
                        "{DEVICE_NAME}: reading {} failed: {error}",
                        self.source.describe()
                    );
                }
                0
            }
        };
        if got < len {
            self.limiter.refund((len - got) as u64, 0);
            if got == 0 && self.source_log.sample() {
                log::warn!(
                    "{DEVICE_NAME}: {} gave no bytes (end of file, or none ready); answering with 0 bytes",
                    self.source.describe()
                );
            }
        }
        if let Err(error) = writer.write_all(&chunk[..got]) {
            if self.source_log.sample() {
                log::error!("{DEVICE_NAME}: writing into the guest's buffer failed: {error}");
            }
        }
        // At most MAX_REQUEST_BYTES.
        writer.bytes_written() as u32
    }
}
