//! File descriptors passed over a Unix stream socket with SCM_RIGHTS: how the control API
//! takes the taps a container runtime (Kata) opened for the VM, as with Cloud Hypervisor's
//! `add-net` with `fds`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The most descriptors one message may carry (a tap queue per vCPU, with room to spare);
/// the kernel's own limit is SCM_MAX_FD, 253.
pub const MAX_FDS_PER_MESSAGE: usize = 64;

/// Receives up to `buf.len()` bytes and at most `max_fds` descriptors from `stream`.
///
/// The descriptors come back owned (close-on-exec set), so any the caller does not keep are
/// closed when dropped. A message with more descriptors than `max_fds` is refused with
/// ENOBUFS and all its descriptors are closed. `max_fds` is capped at
/// [`MAX_FDS_PER_MESSAGE`].
pub fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let wanted = max_fds.min(MAX_FDS_PER_MESSAGE);
    // The control buffer is 8-byte aligned, so the kernel fits an even number of 4-byte
    // descriptors; vmm-sys-util checks against the count asked for and, with an odd count,
    // would close only that many of a message that brought one more (leaking the extra).
    // Ask for an even count and refuse the surplus here.
    let mut raw_fds: Vec<RawFd> = vec![-1; wanted.next_multiple_of(2)];
    let mut iovecs = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the one iovec covers `buf`, which is borrowed mutably for this call, so the
    // kernel may write any bytes there; `raw_fds` is a valid slice of descriptor slots.
    let (read, count) = unsafe { stream.recv_with_fds(&mut iovecs, &mut raw_fds) }
        .map_err(|error| std::io::Error::from_raw_os_error(error.errno()))?;
    let fds: Vec<OwnedFd> = raw_fds[..count]
        .iter()
        // SAFETY: recvmsg installed these `count` descriptors in this process just now and
        // nothing else refers to them: they are ours to own and close.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if fds.len() > wanted {
        drop(fds);
        return Err(std::io::Error::from_raw_os_error(libc::ENOBUFS));
    }
    for fd in &fds {
        // ScmSocket receives without MSG_CMSG_CLOEXEC; close the window for later execs.
        // SAFETY: F_SETFD with FD_CLOEXEC on a descriptor we own; no memory is passed.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((read, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn send(stream: &UnixStream, data: &[u8], fds: &[RawFd]) {
        stream.send_with_fds(&[data], fds).unwrap();
    }

    #[test]
    fn receives_descriptors_that_work_and_are_cloexec() {
        let (sender, receiver) = UnixStream::pair().unwrap();
        let (pipe_reader, mut pipe_writer) = std::io::pipe().unwrap();
        send(&sender, b"add-net", &[pipe_reader.as_raw_fd()]);
        drop(pipe_reader);

        let mut buf = [0u8; 32];
        let (read, fds) = recv_with_fds(&receiver, &mut buf, 4).unwrap();
        assert_eq!(&buf[..read], b"add-net");
        assert_eq!(fds.len(), 1);
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);

        pipe_writer.write_all(b"through").unwrap();
        drop(pipe_writer);
        let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "through");
    }

    #[test]
    fn a_message_without_descriptors_gives_none() {
        let (sender, receiver) = UnixStream::pair().unwrap();
        send(&sender, b"ping", &[]);
        let mut buf = [0u8; 8];
        let (read, fds) = recv_with_fds(&receiver, &mut buf, 2).unwrap();
        assert_eq!((read, fds.len()), (4, 0));
    }

    #[test]
    fn too_many_descriptors_are_refused_and_closed() {
        for (sent, max) in [(3, 1), (2, 1), (3, 2), (5, 3), (1, 0)] {
            too_many_descriptors(sent, max);
        }
    }

    fn too_many_descriptors(sent: usize, max: usize) {
        let (sender, receiver) = UnixStream::pair().unwrap();
        let (readers, mut writers): (Vec<_>, Vec<_>) =
            (0..sent).map(|_| std::io::pipe().unwrap()).unzip();
        let raw: Vec<RawFd> = readers.iter().map(|r| r.as_raw_fd()).collect();
        send(&sender, b"x", &raw);
        drop(readers);
        let mut buf = [0u8; 4];
        let error = recv_with_fds(&receiver, &mut buf, max).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ENOBUFS));
        // Had any received read end stayed open, writing to its pipe would succeed.
        for writer in &mut writers {
            let error = writer.write_all(b"x").unwrap_err();
            assert_eq!(
                error.kind(),
                std::io::ErrorKind::BrokenPipe,
                "{sent} sent, {max} allowed"
            );
        }
    }

    #[test]
    fn dropping_received_descriptors_closes_them() {
        let (sender, receiver) = UnixStream::pair().unwrap();
        let (reader, mut writer) = std::io::pipe().unwrap();
        send(&sender, b"x", &[reader.as_raw_fd()]);
        drop(reader);
        let mut buf = [0u8; 4];
        let (_, fds) = recv_with_fds(&receiver, &mut buf, 8).unwrap();
        assert_eq!(fds.len(), 1);
        writer.write_all(b"ok").unwrap();
        drop(fds);
        let error = writer.write_all(b"x").unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::BrokenPipe);
    }
}
