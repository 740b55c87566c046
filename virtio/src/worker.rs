//! The I/O thread an activated device runs on: an epoll loop over the device's file
//! descriptors (queue kicks, a tap, sockets, timers) and a stop eventfd.
//!
//! The device hands its serving state (a [`WorkerHandler`]) to [`Worker::spawn`] and gets
//! it back from [`Worker::stop`], so a reset or a snapshot sees the queues exactly where
//! the thread left them.

use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The token of the stop eventfd; handlers' tokens must differ from it.
const STOP_TOKEN: u64 = u64::MAX;
const EVENTS_PER_WAIT: usize = 32;

/// Adds and removes the file descriptors the loop waits on, from inside a handler.
pub struct EventControl<'a> {
    epoll: &'a Epoll,
}

impl EventControl<'_> {
    /// Waits for `fd` to become readable (and hang-ups); `token` comes back to
    /// [`WorkerHandler::handle_event`].
    pub fn add(&self, fd: RawFd, token: u64) -> std::io::Result<()> {
        self.add_with(fd, token, EventSet::IN)
    }

    /// Waits for the given events on `fd`.
    pub fn add_with(&self, fd: RawFd, token: u64, events: EventSet) -> std::io::Result<()> {
        assert_ne!(token, STOP_TOKEN, "token {STOP_TOKEN:#x} is the worker's own");
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    }

    /// Changes the events `fd` is waited for (e.g. adds OUT while a write is blocked).
    pub fn modify(&self, fd: RawFd, token: u64, events: EventSet) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Modify, fd, EpollEvent::new(events, token))
    }

    /// Stops waiting for `fd` (before it is closed).
    pub fn remove(&self, fd: RawFd) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default())
    }
}

/// A device's serving state while its worker runs.
pub trait WorkerHandler: Send + 'static {
    /// Registers the descriptors to wait on before the loop starts.
    fn register(&mut self, control: &EventControl) -> std::io::Result<()>;
    /// `token`'s descriptor is ready with `events`.
    fn handle_event(&mut self, token: u64, events: EventSet, control: &EventControl);
}

/// A running I/O thread and the way to stop it.
pub struct Worker<H: WorkerHandler> {
    stop: EventFd,
    thread: Option<JoinHandle<H>>,
    name: String,
}

impl<H: WorkerHandler> Worker<H> {
    /// Starts `handler` on a thread named `name` (at most 15 bytes show in
    /// /proc/PID/task/*/comm).
    pub fn spawn(name: &str, mut handler: H) -> std::io::Result<Self> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP_TOKEN),
        )?;
        handler.register(&EventControl { epoll: &epoll })?;
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                run(&epoll, &mut handler);
                handler
            })?;
        Ok(Worker {
            stop,
            thread: Some(thread),
            name: name.to_string(),
        })
    }

    /// Stops the thread after the event it is handling and gives the handler back; `None`
    /// if the thread panicked (its panic was already reported).
    pub fn stop(mut self) -> Option<H> {
        self.stop_thread()
    }

    fn stop_thread(&mut self) -> Option<H> {
        let thread = self.thread.take()?;
        if let Err(error) = self.stop.write(1) {
            log::error!("{}: cannot signal the worker to stop: {error}", self.name);
        }
        thread.join().ok()
    }
}

impl<H: WorkerHandler> Drop for Worker<H> {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

fn run<H: WorkerHandler>(epoll: &Epoll, handler: &mut H) {
    let control = EventControl { epoll };
    let mut events = vec![EpollEvent::default(); EVENTS_PER_WAIT];
    loop {
        let ready = match epoll.wait(-1, &mut events) {
            Ok(ready) => ready,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(error) => {
                log::error!("device worker: epoll_wait failed, stopping: {error}");
                return;
            }
        };
        for event in &events[..ready] {
            if event.data() == STOP_TOKEN {
                return;
            }
            handler.handle_event(event.data(), event.event_set(), &control);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    struct Counter {
        kick: EventFd,
        seen: u64,
        told: mpsc::Sender<u64>,
    }

    impl WorkerHandler for Counter {
        fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
            control.add(self.kick.as_raw_fd(), 7)
        }

        fn handle_event(&mut self, token: u64, _events: EventSet, _control: &EventControl) {
            assert_eq!(token, 7);
            self.seen += self.kick.read().unwrap_or(0);
            self.told.send(self.seen).unwrap();
        }
    }

    #[test]
    fn handles_kicks_then_gives_the_handler_back() {
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let trigger = kick.try_clone().unwrap();
        let (told, heard) = mpsc::channel();
        let worker = Worker::spawn(
            "test-worker",
            Counter {
                kick,
                seen: 0,
                told,
            },
        )
        .unwrap();
        trigger.write(3).unwrap();
        assert_eq!(heard.recv().unwrap(), 3);
        trigger.write(2).unwrap();
        assert_eq!(heard.recv().unwrap(), 5);
        let handler = worker.stop().expect("the worker did not panic");
        assert_eq!(handler.seen, 5);
    }
}
