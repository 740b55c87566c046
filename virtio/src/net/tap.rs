//! Linux tap devices: Ethernet frames in and out of the host's network stack, each with a
//! virtio_net_hdr_v1 in front (IFF_VNET_HDR), so frames pass between the tap and the guest's
//! buffers without rewriting.

use std::ffi::CStr;
use std::fs::OpenOptions;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::config::is_valid_interface_name;
use super::VNET_HDR_LEN;

const TUN_DEVICE: &str = "/dev/net/tun";
/// The flags a tap must have to carry virtio-net frames: Ethernet frames (not IP packets),
/// no packet-information prefix, a virtio_net_hdr in front of each frame.
const REQUIRED_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

/// Why a tap could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap name {0:?} is not a Linux interface name")]
    Name(String),
    #[error("cannot open {TUN_DEVICE}: {0}")]
    OpenTun(#[source] std::io::Error),
    #[error("tap {name}: TUNSETIFF failed (does the tap exist with other flags, e.g. without multi_queue, or is this process missing CAP_NET_ADMIN?): {source}")]
    SetInterface {
        name: String,
        source: std::io::Error,
    },
    #[error("the file descriptor is not an attached tun/tap queue (TUNGETIFF failed): {0}")]
    NotATunQueue(#[source] std::io::Error),
    #[error("tap {name}: flags {flags:#x} lack IFF_TAP, IFF_NO_PI or IFF_VNET_HDR (open it with all three)")]
    WrongFlags { name: String, flags: libc::c_int },
    #[error("tap {name}: {what} failed: {source}")]
    Ioctl {
        name: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("tap {name}: cannot make it non-blocking: {source}")]
    NonBlocking {
        name: String,
        source: std::io::Error,
    },
}

/// One queue of a tap: a non-blocking file descriptor that reads and writes whole frames,
/// each preceded by a 12-byte virtio_net_hdr_v1.
#[derive(Debug)]
pub struct Tap {
    fd: OwnedFd,
    name: String,
    /// A socket standing in for a tap in unit tests: the tun ioctls are skipped.
    #[cfg(test)]
    stand_in: bool,
}

impl Tap {
    /// Opens (creating it if it does not exist and this process may) one queue of the tap
    /// `name`; `multi_queue` for a device with more than one queue pair, each pair opening its
    /// own queue of the same tap.
    pub fn open(name: &str, multi_queue: bool) -> Result<Tap, TapError> {
        if !is_valid_interface_name(name) {
            return Err(TapError::Name(name.chars().take(32).collect()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_DEVICE)
            .map_err(TapError::OpenTun)?;
        let fd = OwnedFd::from(file);
        let mut request = interface_request(name);
        let mut flags = REQUIRED_FLAGS;
        if multi_queue {
            flags |= libc::IFF_MULTI_QUEUE;
        }
        request.ifr_ifru.ifru_flags = flags as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one `ifreq`, which `request` is, and it lives
        // across the call.
        let result = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut request) };
        if result < 0 {
            return Err(TapError::SetInterface {
                name: name.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        let tap = Tap {
            fd,
            name: name.to_string(),
            #[cfg(test)]
            stand_in: false,
        };
        tap.configure()?;
        Ok(tap)
    }

    /// Opens `count` queues of the tap `name` (multi-queue when `count` > 1).
    pub fn open_queues(name: &str, count: u16) -> Result<Vec<Tap>, TapError> {
        (0..count).map(|_| Tap::open(name, count > 1)).collect()
    }

    /// Takes a tap queue opened by someone else (passed over a Unix socket, or inherited):
    /// checks with TUNGETIFF that it is an attached tap with IFF_TAP, IFF_NO_PI and
    /// IFF_VNET_HDR, then sets the header size, no offloads, and non-blocking I/O.
    pub fn from_fd(fd: OwnedFd) -> Result<Tap, TapError> {
        let mut request = interface_request("");
        // SAFETY: TUNGETIFF writes one `ifreq`, which `request` is. On a descriptor that is
        // not a tun queue the ioctl fails (ENOTTY, EBADFD, EINVAL) without writing.
        let result = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNGETIFF, &mut request) };
        if result < 0 {
            return Err(TapError::NotATunQueue(std::io::Error::last_os_error()));
        }
        // SAFETY: the kernel filled ifr_name with a NUL-terminated name (IFNAMSIZ bytes at most,
        // terminator included), and the union's flags member is what TUNGETIFF sets.
        let (name, flags) = unsafe {
            (
                CStr::from_ptr(request.ifr_name.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
                libc::c_int::from(request.ifr_ifru.ifru_flags) & 0xffff,
            )
        };
        if flags & REQUIRED_FLAGS != REQUIRED_FLAGS {
            return Err(TapError::WrongFlags { name, flags });
        }
        let tap = Tap {
            fd,
            name,
            #[cfg(test)]
            stand_in: false,
        };
        tap.configure()?;
        Ok(tap)
    }

    /// A connected datagram socket playing the tap in unit tests (no root needed).
    #[cfg(test)]
    pub(crate) fn stand_in(fd: OwnedFd) -> Tap {
        set_nonblocking(fd.as_fd()).expect("non-blocking stand-in");
        Tap {
            fd,
            name: "stand-in".to_string(),
            stand_in: true,
        }
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The header the tap expects is virtio_net_hdr_v1 (12 bytes, num_buffers included), no
    /// offloads until the driver acks any (none are offered), and the fd never blocks.
    fn configure(&self) -> Result<(), TapError> {
        let header_size = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one c_int from the pointer, which points at one.
        let result =
            unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TUNSETVNETHDRSZ, &header_size) };
        self.check(result, "TUNSETVNETHDRSZ")?;
        self.set_offloads(0)?;
        set_nonblocking(self.fd.as_fd()).map_err(|source| TapError::NonBlocking {
            name: self.name.clone(),
            source,
        })
    }

    /// Sets the offloads (TUN_F_*) the tap may hand the device: only those the driver acked
    /// the matching VIRTIO_NET_F_GUEST_* feature for. Zero makes the host finish checksums
    /// and segmentation before frames reach the tap.
    pub fn set_offloads(&self, flags: libc::c_uint) -> Result<(), TapError> {
        #[cfg(test)]
        if self.stand_in {
            return Ok(());
        }
        // SAFETY: TUNSETOFFLOAD takes its argument by value; no memory is passed.
        let result = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        self.check(result, "TUNSETOFFLOAD")
    }

    /// Attaches (`true`) or detaches this queue of a multi-queue tap: a detached queue gets no
    /// frames, so the host does not steer flows to a queue pair the guest does not use.
    pub fn set_queue_enabled(&self, enabled: bool) -> Result<(), TapError> {
        #[cfg(test)]
        if self.stand_in {
            return Ok(());
        }
        let mut request = interface_request("");
        let flag = if enabled {
            libc::IFF_ATTACH_QUEUE
        } else {
            libc::IFF_DETACH_QUEUE
        };
        request.ifr_ifru.ifru_flags = flag as libc::c_short;
        // SAFETY: TUNSETQUEUE reads one `ifreq`, which `request` is.
        let result = unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TUNSETQUEUE, &mut request) };
        self.check(result, "TUNSETQUEUE")
    }

    fn check(&self, result: libc::c_int, what: &'static str) -> Result<(), TapError> {
        if result < 0 {
            return Err(TapError::Ioctl {
                name: self.name.clone(),
                what,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

impl Tap {
    /// A second descriptor of this queue (the same open file description: the same
    /// attachment to the tap), to hand the interface to another gpuvm process.
    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        self.fd.try_clone()
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl From<Tap> for OwnedFd {
    fn from(tap: Tap) -> OwnedFd {
        tap.fd
    }
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// An `ifreq` naming `name` (truncated to IFNAMSIZ - 1 bytes; callers validated it).
fn interface_request(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain C data (a name array and a union of integers and addresses) for
    // which all zero bytes is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request
        .ifr_name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *slot = byte as libc::c_char;
    }
    request
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> std::io::Result<()> {
    // SAFETY: F_GETFL on a valid fd reads its status flags; no memory is passed.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: F_SETFL with an int argument sets the status flags; no memory is passed.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_names_before_touching_the_kernel() {
        for name in ["", "a/b", "sixteen-chars-xx", "with space", ".."] {
            assert!(
                matches!(Tap::open(name, false), Err(TapError::Name(_))),
                "{name:?}"
            );
        }
    }

    #[test]
    fn from_fd_refuses_what_is_not_a_tap() {
        let (reader, _writer) = std::io::pipe().unwrap();
        let error = Tap::from_fd(OwnedFd::from(reader)).unwrap_err();
        assert!(matches!(error, TapError::NotATunQueue(_)), "{error}");

        let (socket, _peer) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let error = Tap::from_fd(OwnedFd::from(socket)).unwrap_err();
        assert!(matches!(error, TapError::NotATunQueue(_)), "{error}");
    }

    #[test]
    fn from_fd_refuses_an_unattached_tun_fd() {
        let Ok(file) = OpenOptions::new().read(true).write(true).open(TUN_DEVICE) else {
            eprintln!("skipped: cannot open {TUN_DEVICE} (not root or no tun module)");
            return;
        };
        let error = Tap::from_fd(OwnedFd::from(file)).unwrap_err();
        assert!(matches!(error, TapError::NotATunQueue(_)), "{error}");
    }

    #[test]
    fn interface_request_carries_the_name_nul_terminated() {
        let request = interface_request("tap0");
        // SAFETY: interface_request zero-fills, so the name is NUL-terminated.
        let name = unsafe { CStr::from_ptr(request.ifr_name.as_ptr()) };
        assert_eq!(name.to_str().unwrap(), "tap0");
        let long = interface_request(&"x".repeat(40));
        assert_eq!(long.ifr_name[libc::IFNAMSIZ - 1], 0);
    }
}
