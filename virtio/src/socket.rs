//! Unix-socket helpers for the devices whose other end is a Unix socket: vhost-user
//! backends and hybrid vsock's host side.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// The longest path a Unix socket address holds (sun_path without its NUL).
pub(crate) fn max_path_len() -> usize {
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_path.len() - 1
}

/// Connects a stream socket to `path` without blocking: a listener whose backlog is full
/// refuses (EAGAIN) instead of stalling the caller's thread, and one that does not exist
/// or does not listen refuses at once (ENOENT, ECONNREFUSED). The stream comes back
/// non-blocking. A vhost-user frontend retries on those errors until its connect timeout;
/// vsock answers a guest's connection with a reset. A path that cannot be a socket
/// address (empty, too long, with a NUL) is InvalidInput.
pub(crate) fn connect_nonblocking(path: &Path) -> std::io::Result<UnixStream> {
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() > max_path_len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "not a usable socket path (1 to {} bytes, no NUL)",
                max_path_len()
            ),
        ));
    }
    for (slot, byte) in address.sun_path.iter_mut().zip(bytes) {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: socket(2) takes no pointers; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `address` is a valid sockaddr_un that outlives the call, and the length
    // given is its size (the path is NUL-terminated within it).
    let result = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&address as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if result < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(UnixStream::from(socket))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;
    use std::path::PathBuf;

    #[test]
    fn paths_that_cannot_be_socket_addresses_are_refused() {
        let too_long = PathBuf::from("/".repeat(max_path_len() + 1));
        for path in [PathBuf::new(), too_long, PathBuf::from("/tmp/a\0b")] {
            let error = connect_nonblocking(&path).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidInput, "{path:?}");
            assert!(
                error.to_string().contains("not a usable socket path"),
                "{error}"
            );
        }
    }
}
