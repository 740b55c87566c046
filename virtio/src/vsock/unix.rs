//! The host side of hybrid vsock: the Unix socket host clients connect to (`uds_path`),
//! their `CONNECT <port>\n` line, and the sockets guest-initiated connections reach
//! (`<uds_path>_<port>`).

use std::ffi::OsString;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::VsockError;

/// The longest `CONNECT <port>\n` line, newline included.
pub const MAX_CONNECT_LINE: usize = 32;

/// `uds_path`, bound and listening; the socket file goes away with it while it owns it.
#[derive(Debug)]
pub struct HostListener {
    pub listener: UnixListener,
    path: PathBuf,
    /// The socket file's identity, so that dropping does not remove a file someone else
    /// put at the path since.
    device_inode: (u64, u64),
    /// Whether dropping removes the socket file: not while a live update hands the
    /// listener between processes (both hold it; the one that ends must leave the file).
    owns_file: AtomicBool,
}

impl HostListener {
    /// Listens on `path`. A socket file nobody listens on (left by a gpuvm that died, or
    /// the one a snapshot's VM used) is replaced; anything else at the path is refused.
    pub fn bind(path: &Path) -> Result<Self, VsockError> {
        let io_error = |source| VsockError::Io {
            path: path.to_path_buf(),
            source,
        };
        match std::fs::symlink_metadata(path) {
            Ok(metadata) if metadata.file_type().is_socket() => match UnixStream::connect(path) {
                Ok(_) => return Err(VsockError::PathInUse(path.to_path_buf())),
                Err(error) if error.kind() == ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(io_error)?;
                }
                Err(error) => return Err(io_error(error)),
            },
            Ok(_) => return Err(VsockError::PathNotSocket(path.to_path_buf())),
            Err(error) if error.kind() == ErrorKind::NotFound => {}
            Err(error) => return Err(io_error(error)),
        }
        let listener = UnixListener::bind(path).map_err(io_error)?;
        listener.set_nonblocking(true).map_err(io_error)?;
        let metadata = std::fs::symlink_metadata(path).map_err(io_error)?;
        Ok(HostListener {
            listener,
            path: path.to_path_buf(),
            device_inode: (metadata.dev(), metadata.ino()),
            owns_file: AtomicBool::new(true),
        })
    }

    /// The listener another gpuvm process bound at `path` and handed over (a live update):
    /// the socket file must be there still. It does not own the file until
    /// [`HostListener::own_file`] (the hand-over may yet fail, and the file is the other
    /// process's then).
    pub fn adopt(listener: UnixListener, path: &Path) -> Result<Self, VsockError> {
        let io_error = |source| VsockError::Io {
            path: path.to_path_buf(),
            source,
        };
        let metadata = std::fs::symlink_metadata(path).map_err(io_error)?;
        if !metadata.file_type().is_socket() {
            return Err(VsockError::PathNotSocket(path.to_path_buf()));
        }
        listener.set_nonblocking(true).map_err(io_error)?;
        Ok(HostListener {
            listener,
            path: path.to_path_buf(),
            device_inode: (metadata.dev(), metadata.ino()),
            owns_file: AtomicBool::new(false),
        })
    }

    /// Whether dropping the listener removes its socket file (`owns`): a live update's old
    /// process gives it up when the new one takes the VM, which then owns it.
    pub fn set_owns_file(&self, owns: bool) {
        self.owns_file.store(owns, Ordering::Release);
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        if !self.owns_file.load(Ordering::Acquire) {
            return;
        }
        let ours = std::fs::symlink_metadata(&self.path)
            .map(|metadata| (metadata.dev(), metadata.ino()) == self.device_inode)
            .unwrap_or(false);
        if ours {
            if let Err(error) = std::fs::remove_file(&self.path) {
                log::warn!(
                    "virtio-vsock: cannot remove {}: {error}",
                    self.path.display()
                );
            }
        }
    }
}

/// Where a host client's `CONNECT` line stands.
#[derive(Debug, PartialEq, Eq)]
pub enum LineProgress {
    /// More bytes are needed (the client is slow; nothing waits for it).
    Incomplete,
    /// A complete, valid line for this guest port.
    Port(u32),
    /// Malformed, too long, or the client left: close it.
    Invalid,
}

/// An accepted host client that has not finished its `CONNECT` line.
pub struct PendingClient {
    pub stream: UnixStream,
    pub deadline: Instant,
    line: Vec<u8>,
}

/// A host client still writing its `CONNECT` line, as a live update carries it (its socket
/// goes beside, as a descriptor).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PendingClientLive {
    /// What it sent of the line so far.
    pub line: Vec<u8>,
    /// Time left to finish it.
    pub deadline_ms: u64,
}

impl PendingClient {
    pub fn live(&self, now: Instant) -> PendingClientLive {
        PendingClientLive {
            line: self.line.clone(),
            deadline_ms: self.deadline.saturating_duration_since(now).as_millis() as u64,
        }
    }

    /// A client a live update carried, over its handed-over socket.
    pub fn from_live(
        stream: UnixStream,
        live: &PendingClientLive,
        now: Instant,
    ) -> Result<Self, String> {
        if live.line.len() >= MAX_CONNECT_LINE || live.line.contains(&b'\n') {
            return Err(format!(
                "a host client's CONNECT line of {} bytes is not one being written",
                live.line.len()
            ));
        }
        stream
            .set_nonblocking(true)
            .map_err(|e| format!("a host client's socket: {e}"))?;
        Ok(PendingClient {
            stream,
            deadline: now + Duration::from_millis(live.deadline_ms),
            line: live.line.clone(),
        })
    }

    pub fn new(stream: UnixStream, deadline: Instant) -> Self {
        PendingClient {
            stream,
            deadline,
            line: Vec::with_capacity(MAX_CONNECT_LINE),
        }
    }

    /// Reads what the client sent so far, one byte at a time: whatever follows the newline
    /// is stream data for the guest and stays in the socket.
    pub fn read_line(&mut self) -> LineProgress {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) => return LineProgress::Invalid,
                Ok(_) => {
                    self.line.push(byte[0]);
                    if byte[0] == b'\n' {
                        return parse_connect_line(&self.line)
                            .map_or(LineProgress::Invalid, LineProgress::Port);
                    }
                    if self.line.len() >= MAX_CONNECT_LINE {
                        return LineProgress::Invalid;
                    }
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {
                    return LineProgress::Incomplete
                }
                Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return LineProgress::Invalid,
            }
        }
    }
}

/// `CONNECT <port>\n` (the command in any case, as Firecracker accepts it) → the port.
pub fn parse_connect_line(line: &[u8]) -> Option<u32> {
    if line.len() > MAX_CONNECT_LINE || line.last() != Some(&b'\n') {
        return None;
    }
    let text = std::str::from_utf8(line).ok()?;
    let mut words = text.split_ascii_whitespace();
    let command = words.next()?;
    let port = words.next()?;
    if !command.eq_ignore_ascii_case("CONNECT") || words.next().is_some() {
        return None;
    }
    port.parse().ok()
}

/// `<uds_path>_<port>`: where a guest's connection to host port `port` goes.
pub fn guest_port_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut path = OsString::from(uds_path.as_os_str());
    path.push(format!("_{port}"));
    PathBuf::from(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::{connect_nonblocking, max_path_len};
    use crate::vsock::temp_socket_path;
    use std::io::Write;

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect_line(b"CONNECT 1024\n"), Some(1024));
        assert_eq!(parse_connect_line(b"connect 52\n"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 4294967295\n"), Some(u32::MAX));
        assert_eq!(parse_connect_line(b"CONNECT 1024\r\n"), Some(1024));
        assert_eq!(parse_connect_line(b"CONNECT 4294967296\n"), None);
        assert_eq!(parse_connect_line(b"CONNECT -1\n"), None);
        assert_eq!(parse_connect_line(b"CONNECT\n"), None);
        assert_eq!(parse_connect_line(b"CONNECT 1 2\n"), None);
        assert_eq!(parse_connect_line(b"LISTEN 1024\n"), None);
        assert_eq!(parse_connect_line(b"CONNECT 1024"), None, "no newline");
        assert_eq!(parse_connect_line(b"CONNECT \xff\n"), None);
        let long = format!("CONNECT {}1\n", " ".repeat(30));
        assert_eq!(parse_connect_line(long.as_bytes()), None, "over 32 bytes");
    }

    #[test]
    fn pending_client_reads_the_line_across_writes_and_leaves_the_data() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut client = PendingClient::new(ours, Instant::now());
        assert_eq!(client.read_line(), LineProgress::Incomplete);
        theirs.write_all(b"CONN").unwrap();
        assert_eq!(client.read_line(), LineProgress::Incomplete);
        theirs.write_all(b"ECT 77\nhello").unwrap();
        assert_eq!(client.read_line(), LineProgress::Port(77));
        let mut rest = [0u8; 5];
        client.stream.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"hello");
    }

    #[test]
    fn pending_client_without_newline_in_32_bytes_is_invalid() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut client = PendingClient::new(ours, Instant::now());
        theirs.write_all(&[b'1'; 40]).unwrap();
        assert_eq!(client.read_line(), LineProgress::Invalid);
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut client = PendingClient::new(ours, Instant::now());
        drop(theirs);
        assert_eq!(client.read_line(), LineProgress::Invalid, "EOF");
    }

    #[test]
    fn listener_replaces_stale_sockets_refuses_others_and_cleans_up() {
        let path = temp_socket_path("bind");
        // A stale socket: bound, then its listener closed.
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let listener = HostListener::bind(&path).unwrap();
        assert!(matches!(
            HostListener::bind(&path),
            Err(VsockError::PathInUse(_))
        ));
        drop(listener);
        assert!(!path.exists(), "the socket file goes with the listener");

        std::fs::write(&path, b"not a socket").unwrap();
        assert!(matches!(
            HostListener::bind(&path),
            Err(VsockError::PathNotSocket(_))
        ));
        assert!(path.exists(), "a regular file is left alone");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn nonblocking_connect_reaches_a_listener_and_reports_refusal() {
        let path = temp_socket_path("connect");
        let port_path = guest_port_path(&path, 5000);
        assert!(port_path.to_str().unwrap().ends_with("_5000"));
        assert_eq!(
            connect_nonblocking(&port_path).unwrap_err().kind(),
            ErrorKind::NotFound
        );
        let listener = UnixListener::bind(&port_path).unwrap();
        let mut stream = connect_nonblocking(&port_path).unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        stream.write_all(b"x").unwrap();
        let mut byte = [0u8; 1];
        accepted.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"x");
        drop(listener);
        std::fs::remove_file(&port_path).unwrap();
        let too_long = PathBuf::from("/".repeat(max_path_len() + 1));
        assert_eq!(
            connect_nonblocking(&too_long).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
    }
}
