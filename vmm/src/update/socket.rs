//! The hand-over socket, and who may be at either end of it.
//!
//! `gpuvm update` binds the socket inside a private directory it has just made
//! ([`HandOverSocket::bind`]: `mkdtemp`, mode 0700, removed afterwards), so that no other
//! user can connect to it, bind a socket of their own at its path or replace it. It does
//! not listen: the new gpuvm, which inherits the socket, does ([`listen`]), so that the
//! kernel records the new gpuvm as the listener and the old gpuvm, once connected, reads
//! the new one's pid and uid with `SO_PEERCRED` ([`peer_credentials`]). The new gpuvm reads
//! the same for every connection it accepts and takes only the old gpuvm's.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::UpdateError;

/// The socket's name inside its private directory.
const SOCKET_NAME: &str = "handover.sock";
/// How many connections may wait for the new gpuvm's accept.
const BACKLOG: i32 = 8;

/// The process at the other end of a connected Unix socket, as the kernel recorded it
/// (`SO_PEERCRED`): for an accepted connection the process that connected, for a connecting
/// socket the process that called `listen` on the other end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCredentials {
    pub pid: u32,
    pub uid: u32,
}

/// The peer of `socket`.
pub fn peer_credentials(socket: &UnixStream) -> Result<PeerCredentials, UpdateError> {
    let credentials: libc::ucred =
        socket_option(socket.as_fd(), libc::SO_PEERCRED).map_err(|source| UpdateError::Socket {
            what: "read who is at the other end of the hand-over socket",
            source,
        })?;
    // A peer in another pid namespace reads as pid 0, one with no mapped uid as the
    // overflow uid: neither matches an expected process.
    Ok(PeerCredentials {
        pid: u32::try_from(credentials.pid).unwrap_or(0),
        uid: credentials.uid,
    })
}

/// The `SOL_SOCKET` option `option` of `socket`, read as a `T` (a C struct or integer of
/// exactly the size the kernel writes for it: `ucred` for SO_PEERCRED, `c_int` for flags).
fn socket_option<T: Copy>(socket: BorrowedFd<'_>, option: libc::c_int) -> std::io::Result<T> {
    // SAFETY: every T used here (ucred, c_int) is plain integers, for which all zero bytes
    // is a valid value.
    let mut value: T = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes (one T) into `value`, a live local, and
    // the length it wrote into `len`; the result is checked.
    let result = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&mut value as *mut T).cast(),
            &mut len,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(value)
}

/// This process's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

/// A directory only this user can enter, made for one hand-over and removed (with the
/// socket in it) when dropped.
#[derive(Debug)]
pub struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    /// Makes `parent/PREFIX??????` as `mkdtemp(3)` does: a name no one could have guessed,
    /// created with mode 0700 or not at all (never an existing directory or a symbolic
    /// link), then checked to be a directory of this user that no one else can enter.
    pub fn create(parent: &Path, prefix: &str) -> Result<PrivateDir, UpdateError> {
        let io = |source| UpdateError::Io {
            what: "create a private directory for the hand-over socket",
            source,
        };
        let template = parent.join(format!("{prefix}XXXXXX"));
        let mut template = CString::new(template.as_os_str().as_bytes())
            .map_err(|_| io(std::io::ErrorKind::InvalidInput.into()))?
            .into_bytes_with_nul();
        // SAFETY: mkdtemp rewrites the trailing XXXXXX of the NUL-terminated buffer it is
        // given, which is `template`, live and writable; the result is checked.
        if unsafe { libc::mkdtemp(template.as_mut_ptr().cast()) }.is_null() {
            return Err(io(std::io::Error::last_os_error()));
        }
        template.pop();
        let dir = PrivateDir {
            path: PathBuf::from(OsStr::from_bytes(&template)),
        };
        let meta = std::fs::symlink_metadata(&dir.path).map_err(io)?;
        if !meta.is_dir() || meta.uid() != effective_uid() || meta.mode() & 0o077 != 0 {
            return Err(io(std::io::Error::other(format!(
                "{} is not a directory of uid {} that only it can enter",
                dir.path.display(),
                effective_uid()
            ))));
        }
        Ok(dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.path) {
            log::warn!(
                "cannot remove the hand-over directory {}: {error}",
                self.path.display()
            );
        }
    }
}

/// A Unix stream socket bound, not listening, inside its own [`PrivateDir`].
#[derive(Debug)]
pub struct HandOverSocket {
    socket: OwnedFd,
    path: PathBuf,
    // Dropped last: the socket's file goes with it.
    dir: PrivateDir,
}

impl HandOverSocket {
    /// Binds a socket at `PRIVATE_DIR/handover.sock`, PRIVATE_DIR a new [`PrivateDir`] in
    /// `parent`. Nothing is ever removed to make room: `bind` fails on any existing file.
    pub fn bind(parent: &Path) -> Result<HandOverSocket, UpdateError> {
        let dir = PrivateDir::create(parent, "gpuvm-update-")?;
        let path = dir.path().join(SOCKET_NAME);
        let io = |source| UpdateError::Io {
            what: "bind the hand-over socket",
            source,
        };
        let mut address = libc::sockaddr_un {
            sun_family: libc::AF_UNIX as libc::sa_family_t,
            sun_path: [0; 108],
        };
        let bytes = path.as_os_str().as_bytes();
        if bytes.len() >= address.sun_path.len() || bytes.contains(&0) {
            return Err(io(std::io::Error::other(format!(
                "{} is too long for a Unix socket's path",
                path.display()
            ))));
        }
        for (slot, byte) in address.sun_path.iter_mut().zip(bytes) {
            *slot = *byte as libc::c_char;
        }
        // SAFETY: socket takes no pointers; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        // SAFETY: socket returned this descriptor, owned by nothing else.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `address` is a live, NUL-terminated sockaddr_un of the length passed.
        let bound = unsafe {
            libc::bind(
                socket.as_raw_fd(),
                (&address as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if bound != 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        // Whatever the umask: only this user connects (root regardless).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        Ok(HandOverSocket { socket, path, dir })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Gives the directory and the socket to `uid`/`gid`, the running gpuvm's user when it
    /// is not this process's (a jail's): it, and root, are then the only ones that can
    /// reach the socket.
    pub fn give_to(&self, uid: u32, gid: u32) -> Result<(), UpdateError> {
        for path in [self.dir.path(), self.path.as_path()] {
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|source| {
                UpdateError::Io {
                    what: "give the hand-over socket to the running gpuvm's user",
                    source,
                }
            })?;
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The socket, to be inherited by the new gpuvm.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    /// Once the new gpuvm listens: closes this process's copy of the socket, so that the
    /// socket ends with the new gpuvm (the old one's `connect` is then refused at once,
    /// not left in a backlog no one accepts); the path and directory stay.
    pub fn release(self) -> ListenedHandOver {
        ListenedHandOver {
            path: self.path,
            dir: self.dir,
        }
    }

    /// Whether someone (the new gpuvm) listens on the socket now.
    pub fn is_listening(&self) -> Result<bool, UpdateError> {
        let listening: libc::c_int = socket_option(self.socket.as_fd(), libc::SO_ACCEPTCONN)
            .map_err(|source| UpdateError::Socket {
                what: "check whether the new gpuvm listens",
                source,
            })?;
        Ok(listening != 0)
    }
}

/// A [`HandOverSocket`] the new gpuvm listens on, released by `gpuvm update`: its path, in
/// its directory (removed when dropped).
#[derive(Debug)]
pub struct ListenedHandOver {
    path: PathBuf,
    // Dropped last: the socket's file goes with it.
    dir: PrivateDir,
}

impl ListenedHandOver {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Listens on the bound hand-over socket `socket` (the new gpuvm's side), which makes this
/// process the peer that connecting processes see.
pub fn listen(socket: OwnedFd) -> Result<UnixListener, UpdateError> {
    // SAFETY: listen takes no pointers; `socket` is a live descriptor; the result is
    // checked.
    if unsafe { libc::listen(socket.as_raw_fd(), BACKLOG) } != 0 {
        return Err(UpdateError::Socket {
            what: "listen on the hand-over socket",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(UnixListener::from(socket))
}

/// `socket` as a listener if it is a listening Unix stream socket (the old process's API
/// socket, which comes with `Commit`); why not otherwise.
pub fn listening_unix_stream(socket: OwnedFd) -> Result<UnixListener, UpdateError> {
    let option = |option, what| {
        socket_option::<libc::c_int>(socket.as_fd(), option)
            .map_err(|source| UpdateError::Socket { what, source })
    };
    let domain = option(libc::SO_DOMAIN, "read the handed-over API socket's domain")?;
    let kind = option(libc::SO_TYPE, "read the handed-over API socket's type")?;
    let listening = option(
        libc::SO_ACCEPTCONN,
        "check whether the handed-over API socket listens",
    )?;
    if domain != libc::AF_UNIX || kind != libc::SOCK_STREAM || listening == 0 {
        return Err(UpdateError::Protocol(format!(
            "the API socket that came with Commit is not a listening Unix stream socket \
             (domain {domain}, type {kind}, listening {listening})"
        )));
    }
    Ok(UnixListener::from(socket))
}

/// The old gpuvm's check of the hand-over socket it is told to connect to: a socket (not a
/// symbolic link to one), in a directory that belongs to root or to this user and that no
/// one else may write to, so no one else can have put it there.
pub fn check_path(path: &Path) -> Result<(), UpdateError> {
    let refuse = |reason: String| UpdateError::HandOverPath {
        path: path.to_path_buf(),
        reason,
    };
    let meta = std::fs::symlink_metadata(path).map_err(|source| UpdateError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    if meta.file_type().is_symlink() {
        return Err(refuse("it is a symbolic link".into()));
    }
    if !std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) {
        return Err(refuse("it is not a socket".into()));
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => return Err(refuse("it has no directory".into())),
    };
    let dir_meta = std::fs::metadata(dir).map_err(|source| UpdateError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    let uid = effective_uid();
    if dir_meta.uid() != 0 && dir_meta.uid() != uid {
        return Err(refuse(format!(
            "its directory belongs to uid {}, neither root nor this process's uid {uid}",
            dir_meta.uid()
        )));
    }
    if dir_meta.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "other users may write to its directory (mode {:o})",
            dir_meta.mode() & 0o7777
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn only_a_listening_unix_stream_socket_is_taken_as_the_api_socket() {
        let dir = PrivateDir::create(&std::env::temp_dir(), "gpuvm-api-listener-").unwrap();
        let path = dir.path().join("api.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let taken = listening_unix_stream(OwnedFd::from(listener.try_clone().unwrap())).unwrap();
        // The same socket: a connection made at the path is accepted through it.
        let _client = UnixStream::connect(&path).unwrap();
        taken.accept().unwrap();
        let (connected, _peer) = UnixStream::pair().unwrap();
        let error = listening_unix_stream(OwnedFd::from(connected))
            .err()
            .unwrap();
        assert!(error.to_string().contains("not a listening"), "{error}");
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(listening_unix_stream(OwnedFd::from(file)).is_err());
    }

    #[test]
    fn peer_credentials_name_the_process_at_the_other_end() {
        let (a, _b) = UnixStream::pair().unwrap();
        let peer = peer_credentials(&a).unwrap();
        assert_eq!(peer.pid, std::process::id());
        assert_eq!(peer.uid, effective_uid());
    }

    #[test]
    fn the_socket_is_private_listened_on_by_its_receiver_and_removed_with_its_directory() {
        let parent = std::env::temp_dir();
        let first = HandOverSocket::bind(&parent).unwrap();
        let second = HandOverSocket::bind(&parent).unwrap();
        assert_ne!(
            first.dir(),
            second.dir(),
            "the directory's name is not fresh"
        );
        let dir = std::fs::symlink_metadata(first.dir()).unwrap();
        assert!(dir.is_dir());
        assert_eq!(dir.mode() & 0o777, 0o700);
        let socket = std::fs::symlink_metadata(first.path()).unwrap();
        assert!(socket.file_type().is_socket());
        assert_eq!(socket.mode() & 0o777, 0o600);
        check_path(first.path()).unwrap();
        // Bound, not listening: nobody can connect until the receiver listens.
        assert!(!first.is_listening().unwrap());
        assert!(UnixStream::connect(first.path()).is_err());
        let listener = listen(first.fd().try_clone_to_owned().unwrap()).unwrap();
        assert!(first.is_listening().unwrap());
        let client = UnixStream::connect(first.path()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert_eq!(peer_credentials(&client).unwrap().pid, std::process::id());
        assert_eq!(peer_credentials(&accepted).unwrap().pid, std::process::id());
        let dir = first.dir().to_path_buf();
        drop(first);
        assert!(!dir.exists(), "{} was left behind", dir.display());
    }

    #[test]
    fn an_existing_path_is_refused_never_replaced() {
        let dir = PrivateDir::create(&std::env::temp_dir(), "gpuvm-update-test-").unwrap();
        // A fresh name never follows a link planted where a guessed name would be.
        let target = dir.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            check_path(&link),
            Err(UpdateError::HandOverPath { reason, .. }) if reason.contains("symbolic link")
        ));
        assert!(matches!(
            check_path(&target),
            Err(UpdateError::HandOverPath { reason, .. }) if reason.contains("not a socket")
        ));
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    #[test]
    fn a_socket_in_a_directory_others_may_write_is_refused() {
        let dir = PrivateDir::create(&std::env::temp_dir(), "gpuvm-update-test-").unwrap();
        let path = dir.path().join("open.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        check_path(&path).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(matches!(
            check_path(&path),
            Err(UpdateError::HandOverPath { reason, .. }) if reason.contains("other users may write")
        ));
    }
}
