//! Bounds every wait on a backend's reply.
//!
//! The vhost crate's receive loop retries EAGAIN, so a socket receive timeout
//! (SO_RCVTIMEO) would only make it spin; instead, before each request the caller arms a
//! deadline here, and when it passes this thread shuts the socket down (shutdown(2) on the
//! connection's own descriptor), which makes the blocked `recvmsg` (or `sendmsg`) return
//! at once with an end-of-stream error. The connection is then closed for good: a
//! backend that misses a deadline is treated as dead.
//!
//! One thread serves every vhost-user device of the process. It is started by the first
//! device built ([`start`]), on the thread that builds it: the VMM builds devices before it
//! locks threads down with seccomp; the thread only waits on a channel and calls
//! shutdown(2).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

enum Command {
    Arm {
        id: u64,
        deadline: Instant,
        socket: Arc<OwnedFd>,
        fired: Arc<AtomicBool>,
    },
    Disarm(u64),
}

struct Armed {
    id: u64,
    deadline: Instant,
    socket: Arc<OwnedFd>,
    fired: Arc<AtomicBool>,
}

static COMMANDS: OnceLock<Mutex<Sender<Command>>> = OnceLock::new();
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Starts the watchdog thread unless it runs already.
pub(super) fn start() -> std::io::Result<()> {
    if COMMANDS.get().is_some() {
        return Ok(());
    }
    let (sender, receiver) = channel::<Command>();
    // Two devices built at once may both get here: the loser's thread ends as soon as its
    // sender is dropped.
    std::thread::Builder::new()
        .name("vhost-user-wdog".to_string())
        .spawn(move || {
            // Under the device threads' filter: it only shuts sockets down.
            if let Err(error) = crate::worker::run_thread_setup() {
                log::error!(
                    "vhost-user watchdog: cannot set up its thread, replies are unbounded: {error}"
                );
                return;
            }
            let mut armed: Vec<Armed> = Vec::new();
            loop {
                let next = armed.iter().map(|a| a.deadline).min();
                let command = match next {
                    None => receiver.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    Some(deadline) => {
                        receiver.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    }
                };
                match command {
                    Ok(Command::Arm {
                        id,
                        deadline,
                        socket,
                        fired,
                    }) => armed.push(Armed {
                        id,
                        deadline,
                        socket,
                        fired,
                    }),
                    Ok(Command::Disarm(id)) => armed.retain(|a| a.id != id),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
                let now = Instant::now();
                armed.retain(|a| {
                    if a.deadline > now {
                        return true;
                    }
                    a.fired.store(true, Ordering::SeqCst);
                    // SAFETY: shutdown(2) on a socket descriptor the Arc keeps open; it
                    // touches no memory.
                    unsafe { libc::shutdown(a.socket.as_raw_fd(), libc::SHUT_RDWR) };
                    false
                });
            }
        })?;
    let _ = COMMANDS.set(Mutex::new(sender));
    Ok(())
}

/// A deadline for one request; dropping it (or [`Deadline::disarm`]) cancels it.
pub(super) struct Deadline {
    id: u64,
    fired: Arc<AtomicBool>,
    armed: bool,
}

impl Deadline {
    /// Shuts `socket` down unless disarmed within `timeout`. Without a running watchdog
    /// (never started) the wait is unbounded; [`start`] is called by every constructor.
    pub(super) fn arm(socket: &Arc<OwnedFd>, timeout: Duration) -> Deadline {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let fired = Arc::new(AtomicBool::new(false));
        let armed = match COMMANDS.get() {
            Some(commands) => crate::lock(commands)
                .send(Command::Arm {
                    id,
                    deadline: Instant::now() + timeout,
                    socket: Arc::clone(socket),
                    fired: Arc::clone(&fired),
                })
                .is_ok(),
            None => false,
        };
        if !armed {
            log::warn!("vhost-user: the reply watchdog is not running; a silent backend can block");
        }
        Deadline { id, fired, armed }
    }

    /// Cancels the deadline; true if it had already passed (the socket is shut down).
    pub(super) fn disarm(mut self) -> bool {
        self.cancel();
        self.fired.load(Ordering::SeqCst)
    }

    fn cancel(&mut self) {
        if std::mem::take(&mut self.armed) {
            if let Some(commands) = COMMANDS.get() {
                let _ = crate::lock(commands).send(Command::Disarm(self.id));
            }
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_late_reply_ends_the_blocked_read() {
        start().unwrap();
        let (mut ours, _theirs) = UnixStream::pair().unwrap();
        let socket = Arc::new(OwnedFd::from(ours.try_clone().unwrap()));
        let begin = Instant::now();
        let deadline = Deadline::arm(&socket, Duration::from_millis(200));
        let mut byte = [0u8; 1];
        // The peer never writes: only the watchdog can end this read.
        let read = ours.read(&mut byte).unwrap();
        assert_eq!(read, 0, "shutdown reads as end of stream");
        assert!(deadline.disarm(), "the deadline reports that it fired");
        let waited = begin.elapsed();
        assert!(waited >= Duration::from_millis(200), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[test]
    fn a_disarmed_deadline_leaves_the_socket_alone() {
        start().unwrap();
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let socket = Arc::new(OwnedFd::from(ours.try_clone().unwrap()));
        let deadline = Deadline::arm(&socket, Duration::from_millis(50));
        assert!(!deadline.disarm());
        std::thread::sleep(Duration::from_millis(150));
        // Still connected: what we write arrives.
        use std::io::Write;
        (&ours).write_all(b"x").unwrap();
        let mut byte = [0u8; 1];
        theirs.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"x");
    }
}
