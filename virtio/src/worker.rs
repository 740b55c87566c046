//! The I/O thread an activated device runs on: an epoll loop over the device's file
//! descriptors (queue kicks, a tap, sockets, timers) and a stop eventfd.
//!
//! The device hands its serving state (a [`WorkerHandler`]) to [`Worker::spawn`] and gets
//! it back from [`Worker::stop`], so a reset or a snapshot sees the queues exactly where
//! the thread left them. [`DeviceWorker`] holds that state for a device across activate,
//! pause, resume and reset.
//!
//! Devices activate when the guest's driver says so, on a vCPU thread, whose seccomp
//! filter does not let it create threads or do a device's I/O. So the VMM sets the I/O
//! threads up with [`start`] while it builds the VM: one thread per device it is built
//! with, made at once (each installs the device filter first), serves that device's first
//! worker; a factory thread, which installs a filter of its own that also lets it make
//! threads, makes every other one when it is needed (a hot-plugged device, a device
//! started again after a reset, a pause or a change), and the new thread stacks the device
//! filter on the one it inherits before it serves. A thread ends when its worker stops:
//! nothing is kept for devices that are gone, and no thread is made for a device that may
//! never come. Without [`start`] (unit tests, library users) or without a factory (no
//! filters in force) a worker gets a fresh thread from the caller.

use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

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
        assert_ne!(
            token, STOP_TOKEN,
            "token {STOP_TOKEN:#x} is the worker's own"
        );
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

/// Work for an I/O thread: runs a worker, told how the thread's setup went.
type Job = Box<dyn FnOnce(std::io::Result<()>) + Send>;

/// The threads [`start`] made for the devices the VM was built with, waiting for their
/// first worker.
static IDLE: Mutex<Vec<Sender<Job>>> = Mutex::new(Vec::new());
/// Set once [`start`] ran: from then on workers run on its threads or the factory's.
static STARTED: AtomicBool = AtomicBool::new(false);
/// The setup [`start`] was given: for every I/O thread, and the crate's other long-lived
/// threads.
static SETUP: Mutex<Option<ThreadSetup>> = Mutex::new(None);
/// Asks the factory for a thread; None without one.
static FACTORY: Mutex<Option<Sender<Job>>> = Mutex::new(None);

/// The factory thread's name, and the name a thread it makes has until its worker names it.
pub const FACTORY_THREAD_NAME: &str = "virtio-factory";
const MADE_THREAD_NAME: &str = "virtio-io";
/// The factory only receives requests and spawns threads.
const FACTORY_STACK_SIZE: usize = 128 << 10;

/// What a thread does first, before it takes work (the VMM installs a seccomp filter
/// here); an error ends the thread.
pub type ThreadSetup = Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// How [`start`] sets the I/O threads up.
pub struct IoThreads {
    /// Threads made now and waited for, one per device the VM is built with: each serves
    /// one worker (the first a device starts) and ends with it.
    pub count: usize,
    /// What every I/O thread runs first (the device filter).
    pub setup: ThreadSetup,
    /// What the factory thread runs first (a filter that also allows making threads, and
    /// that each thread it makes then narrows with `setup`). None: no factory, every other
    /// thread is spawned by the caller of [`Worker::spawn`], which is only right while no
    /// filter is in force.
    pub factory: Option<ThreadSetup>,
}

/// Errors of [`start`] and [`Worker::spawn`].
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot set up a device I/O thread: {0}")]
    Setup(std::io::Error),
    #[error("cannot create a device I/O thread: {0}")]
    Spawn(std::io::Error),
    #[error("the device I/O thread factory is gone (it could not set itself up: see the log)")]
    NoFactory,
    #[error("cannot set up the worker's event loop: {0}")]
    Epoll(std::io::Error),
}

impl From<WorkerError> for std::io::Error {
    fn from(error: WorkerError) -> Self {
        match error {
            WorkerError::Setup(e) | WorkerError::Spawn(e) | WorkerError::Epoll(e) => e,
            other => std::io::Error::other(other.to_string()),
        }
    }
}

/// Sets the I/O threads up as `threads` says: starts the factory (if asked for and not
/// running yet), and makes `count` threads, returning once each of those has run its
/// setup. The factory is not waited for (measured: waiting for a new thread to be
/// scheduled costs milliseconds of boot on a loaded host): it runs its setup first thing
/// and serves no request before, and until then nothing in it runs at all.
pub fn start(threads: IoThreads) -> Result<(), WorkerError> {
    let IoThreads {
        count,
        setup,
        factory,
    } = threads;
    STARTED.store(true, Ordering::SeqCst);
    *crate::lock(&SETUP) = Some(setup.clone());
    if let Some(factory_setup) = factory {
        start_factory(factory_setup, setup.clone())?;
    }
    let (ready_tx, ready_rx) = channel();
    for index in 0..count {
        let (job_tx, job_rx) = channel::<Job>();
        let setup = setup.clone();
        let ready = ready_tx.clone();
        std::thread::Builder::new()
            .name(format!("virtio-idle{index}"))
            .spawn(move || {
                let result = setup();
                let ok = result.is_ok();
                let _ = ready.send(result.map(|()| job_tx));
                // Its one worker; none if the VM goes first (the sender is dropped).
                if ok {
                    if let Ok(job) = job_rx.recv() {
                        job(Ok(()));
                    }
                }
            })
            .map_err(WorkerError::Spawn)?;
    }
    for _ in 0..count {
        let sender = ready_rx
            .recv()
            .map_err(|_| WorkerError::Setup(std::io::Error::other("I/O thread ended")))?
            .map_err(WorkerError::Setup)?;
        crate::lock(&IDLE).push(sender);
    }
    Ok(())
}

/// Starts the factory thread: it runs `factory_setup`, then makes a thread for each job it
/// is sent, which runs `setup` before the job. Nothing to do if it runs already.
fn start_factory(factory_setup: ThreadSetup, setup: ThreadSetup) -> Result<(), WorkerError> {
    let mut factory = crate::lock(&FACTORY);
    if factory.is_some() {
        return Ok(());
    }
    let (requests_tx, requests) = channel::<Job>();
    std::thread::Builder::new()
        .name(FACTORY_THREAD_NAME.to_string())
        .stack_size(FACTORY_STACK_SIZE)
        .spawn(move || {
            if let Err(error) = factory_setup() {
                // It ends, an unfiltered factory being no option: requests find it gone
                // (a job already sent is dropped, and its worker fails to start).
                log::error!(
                    "the device I/O thread factory cannot set itself up; devices started from now on fail: {error}"
                );
                return;
            }
            while let Ok(job) = requests.recv() {
                make_thread(job, setup.clone());
            }
        })
        .map_err(WorkerError::Spawn)?;
    *factory = Some(requests_tx);
    Ok(())
}

/// Makes a thread (under the caller's filter) that runs `setup`, then `job`; `job` learns
/// of a failure to make it.
fn make_thread(job: Job, setup: ThreadSetup) {
    let job = Arc::new(Mutex::new(Some(job)));
    let on_thread = job.clone();
    let spawned = std::thread::Builder::new()
        .name(MADE_THREAD_NAME.to_string())
        .spawn(move || {
            let result = setup();
            let job = crate::lock(&on_thread).take();
            if let Some(job) = job {
                job(result);
            }
        });
    if let Err(error) = spawned {
        let job = crate::lock(&job).take();
        if let Some(job) = job {
            job(Err(error));
        }
    }
}

/// Runs `job` on a thread: one [`start`] made for it, else one the factory makes, else (no
/// factory: no filters in force) one made here, under the caller's filter, named `name`.
fn dispatch(name: &str, mut job: Job) -> Result<(), WorkerError> {
    if STARTED.load(Ordering::SeqCst) {
        loop {
            let idle = crate::lock(&IDLE).pop();
            let Some(idle) = idle else { break };
            match idle.send(job) {
                Ok(()) => return Ok(()),
                // That thread is gone (its setup failed, or it panicked): the next.
                Err(returned) => job = returned.0,
            }
        }
        let factory = crate::lock(&FACTORY).clone();
        if let Some(factory) = factory {
            return factory.send(job).map_err(|_| WorkerError::NoFactory);
        }
    }
    let setup = crate::lock(&SETUP).clone();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || job(setup.map_or(Ok(()), |setup| setup())))
        .map_err(WorkerError::Spawn)?;
    Ok(())
}

/// Runs, on the calling thread, the setup the I/O threads run (the device seccomp filter
/// in gpuvm): for other threads the crate starts, such as vhost-user's watchdog. Nothing
/// to do before [`start`] ran.
pub(crate) fn run_thread_setup() -> std::io::Result<()> {
    let setup = crate::lock(&SETUP).clone();
    match setup {
        Some(setup) => setup(),
        None => Ok(()),
    }
}

/// A second descriptor for a device's timer, disarmed, for the handler a device hands its
/// worker at activation. Activation runs on a vCPU thread, whose seccomp filter allows
/// fcntl F_DUPFD_CLOEXEC but not timerfd_create, so the device creates its timer up front
/// and every activation duplicates it (vsock's connection deadlines, the balloon's
/// statistics interval).
pub(crate) fn duplicate_timer(timer: &TimerFd) -> std::io::Result<TimerFd> {
    // SAFETY: fcntl on a descriptor the device owns, with integer arguments only.
    let fd = unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created by the fcntl above and nothing else owns it.
    let mut duplicate = unsafe { TimerFd::from_raw_fd(fd) };
    duplicate.clear()?;
    Ok(duplicate)
}

/// Names the calling thread (what /proc/PID/task/*/comm shows; at most 15 bytes).
fn set_thread_name(name: &str) {
    let mut bytes: Vec<u8> = name.bytes().filter(|b| *b != 0).take(15).collect();
    bytes.push(0);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from a
    // pointer that stays valid for the call.
    unsafe { libc::prctl(libc::PR_SET_NAME, bytes.as_ptr()) };
}

/// A running worker and the way to stop it.
pub struct Worker<H: WorkerHandler> {
    stop: EventFd,
    handed_back: Option<Receiver<H>>,
    name: String,
}

impl<H: WorkerHandler> Worker<H> {
    /// Starts serving `handler` on an I/O thread named `name` (at most 15 bytes show in
    /// /proc/PID/task/*/comm).
    pub fn spawn(name: &str, handler: H) -> Result<Self, WorkerError> {
        // Everything but the stop eventfd is created on the I/O thread, under its own
        // filter: the caller is usually a vCPU thread.
        let stop = EventFd::new(EFD_NONBLOCK).map_err(WorkerError::Epoll)?;
        let stop_fd = stop.as_raw_fd();
        let (started_tx, started_rx) = channel();
        let (back_tx, back_rx) = channel();
        let thread_name = name.to_string();
        let job: Job = Box::new(move |setup: std::io::Result<()>| {
            if let Err(error) = setup {
                let _ = started_tx.send(Err(WorkerError::Setup(error)));
                return;
            }
            set_thread_name(&thread_name);
            let mut handler = handler;
            match event_loop(stop_fd, &mut handler) {
                Ok(epoll) => {
                    let _ = started_tx.send(Ok(()));
                    run(&epoll, &mut handler);
                }
                Err(error) => {
                    let _ = started_tx.send(Err(WorkerError::Epoll(error)));
                }
            }
            // The thread ends once the handler is back.
            let _ = back_tx.send(handler);
        });
        dispatch(name, job)?;
        match started_rx.recv() {
            Ok(Ok(())) => Ok(Worker {
                stop,
                handed_back: Some(back_rx),
                name: name.to_string(),
            }),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(WorkerError::Spawn(std::io::Error::other(
                "the I/O thread ended before it started",
            ))),
        }
    }

    /// Stops the thread after the event it is handling and gives the handler back; `None`
    /// if the thread panicked (its panic was already reported).
    pub fn stop(mut self) -> Option<H> {
        self.stop_thread()
    }

    fn stop_thread(&mut self) -> Option<H> {
        let handed_back = self.handed_back.take()?;
        if let Err(error) = self.stop.write(1) {
            log::error!("{}: cannot signal the worker to stop: {error}", self.name);
        }
        handed_back.recv().ok()
    }
}

impl<H: WorkerHandler> Drop for Worker<H> {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

/// A device's serving state across activations, with the transitions every device makes:
/// activate (take the idle resources, start a worker), pause (stop it, keep its handler),
/// resume (start a new worker for the handler) and reset (turn the handler back into the
/// idle resources).
///
/// `I` is what the device keeps while the driver has not activated it (its backend: a disk,
/// taps, an entropy source); `H` the handler serving the queues, which holds `I` while active.
pub struct DeviceWorker<I, H: WorkerHandler> {
    /// For logs ("virtio-blk rootfs").
    device: String,
    /// The I/O thread's name (at most 15 bytes show in /proc/PID/task/*/comm).
    thread_name: String,
    state: DeviceState<I, H>,
}

enum DeviceState<I, H: WorkerHandler> {
    Idle(I),
    Running(Worker<H>),
    Paused(H),
    /// The worker thread panicked or could not start and took the resources with it.
    Failed,
}

/// What a change made through [`DeviceWorker::change`] is given.
pub enum Held<'a, I, H> {
    /// The device is not active: its idle resources.
    Idle(&'a mut I),
    /// The device is active: the handler, stopped between two events.
    Handler(&'a mut H),
}

/// Why [`DeviceWorker::take_idle`] has nothing to give.
#[derive(Debug, PartialEq, Eq)]
pub enum NotIdle {
    /// Activated (running or paused) and not reset since.
    Active,
    /// The worker thread panicked or could not start and took the resources with it.
    Failed,
}

/// Why [`DeviceWorker::change`] could not make its change.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error("the device's I/O thread panicked or could not start, and took its resources")]
    Failed,
    #[error("the device's I/O thread did not start again: {0}")]
    Restart(#[source] WorkerError),
}

impl<I, H: WorkerHandler> DeviceWorker<I, H> {
    /// An idle device holding `idle` until the driver activates it.
    pub fn new(device: impl Into<String>, thread_name: impl Into<String>, idle: I) -> Self {
        DeviceWorker {
            device: device.into(),
            thread_name: thread_name.into(),
            state: DeviceState::Idle(idle),
        }
    }

    pub fn is_running(&self) -> bool {
        matches!(self.state, DeviceState::Running(_))
    }

    /// The handler while paused.
    pub fn paused(&self) -> Option<&H> {
        match &self.state {
            DeviceState::Paused(handler) => Some(handler),
            _ => None,
        }
    }

    /// The idle resources, for an activation; the device counts as failed until
    /// [`DeviceWorker::start`] (or [`DeviceWorker::set_idle`]) gives it a new state.
    pub fn take_idle(&mut self) -> Result<I, NotIdle> {
        match std::mem::replace(&mut self.state, DeviceState::Failed) {
            DeviceState::Idle(idle) => Ok(idle),
            DeviceState::Failed => Err(NotIdle::Failed),
            active => {
                self.state = active;
                Err(NotIdle::Active)
            }
        }
    }

    /// Makes the device idle with `idle` (what a refused activation took, or what a stopped
    /// handler gave back).
    pub fn set_idle(&mut self, idle: I) {
        self.state = DeviceState::Idle(idle);
    }

    /// Serves `handler` on a new worker; the device has failed if its thread cannot start
    /// (the handler is dropped with it).
    pub fn start(&mut self, handler: H) -> Result<(), WorkerError> {
        match Worker::spawn(&self.thread_name, handler) {
            Ok(worker) => {
                self.state = DeviceState::Running(worker);
                Ok(())
            }
            Err(error) => {
                self.state = DeviceState::Failed;
                Err(error)
            }
        }
    }

    /// Takes the handler back from the worker (after the event it is handling) or from a
    /// pause; the caller gives the device its next state. `None` when idle or failed, or
    /// when the worker thread panicked (logged; the device has failed).
    pub fn stop(&mut self) -> Option<H> {
        match std::mem::replace(&mut self.state, DeviceState::Failed) {
            DeviceState::Running(worker) => {
                let handler = worker.stop();
                if handler.is_none() {
                    log::error!(
                        "{}: its I/O thread panicked; what it held is gone",
                        self.device
                    );
                }
                handler
            }
            DeviceState::Paused(handler) => Some(handler),
            other => {
                self.state = other;
                None
            }
        }
    }

    /// Stops serving and keeps what the next activation needs: `into_idle` turns the
    /// handler back into the idle resources. Nothing to do when idle or failed.
    pub fn reset(&mut self, into_idle: impl FnOnce(H) -> I) {
        if let Some(handler) = self.stop() {
            self.state = DeviceState::Idle(into_idle(handler));
        }
    }

    /// Stops the worker and keeps its handler as it left the queues, until
    /// [`DeviceWorker::resume`]. The handler when paused (already, or now); `None` when
    /// idle or failed, or when the worker thread panicked (logged; the device has failed).
    pub fn pause(&mut self) -> Option<&mut H> {
        if let Some(handler) = self.stop() {
            self.state = DeviceState::Paused(handler);
        }
        match &mut self.state {
            DeviceState::Paused(handler) => Some(handler),
            _ => None,
        }
    }

    /// Serves the paused handler again on a new worker; nothing to do when not paused.
    pub fn resume(&mut self) -> Result<(), WorkerError> {
        match std::mem::replace(&mut self.state, DeviceState::Failed) {
            DeviceState::Paused(handler) => self.start(handler),
            other => {
                self.state = other;
                Ok(())
            }
        }
    }

    /// Runs `change` on what the device holds now: its idle resources, the paused handler,
    /// or the running handler between two events (the worker stops after the event it is
    /// handling, and a new one serves the changed handler).
    pub fn change<T>(
        &mut self,
        change: impl FnOnce(Held<'_, I, H>) -> T,
    ) -> Result<T, ChangeError> {
        match &mut self.state {
            DeviceState::Idle(idle) => return Ok(change(Held::Idle(idle))),
            DeviceState::Paused(handler) => return Ok(change(Held::Handler(handler))),
            DeviceState::Failed => return Err(ChangeError::Failed),
            DeviceState::Running(_) => {}
        }
        let mut handler = self.stop().ok_or(ChangeError::Failed)?;
        let result = change(Held::Handler(&mut handler));
        self.start(handler).map_err(ChangeError::Restart)?;
        Ok(result)
    }
}

/// The worker's epoll: the stop eventfd and what the handler registers.
fn event_loop<H: WorkerHandler>(stop_fd: RawFd, handler: &mut H) -> std::io::Result<Epoll> {
    let epoll = Epoll::new()?;
    epoll.ctl(
        ControlOperation::Add,
        stop_fd,
        EpollEvent::new(EventSet::IN, STOP_TOKEN),
    )?;
    handler.register(&EventControl { epoll: &epoll })?;
    Ok(epoll)
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
        let (handler, trigger, heard) = counter();
        let worker = Worker::spawn("test-worker", handler).unwrap();
        trigger.write(3).unwrap();
        assert_eq!(heard.recv().unwrap(), 3);
        trigger.write(2).unwrap();
        assert_eq!(heard.recv().unwrap(), 5);
        let handler = worker.stop().expect("the worker did not panic");
        assert_eq!(handler.seen, 5);
    }

    /// A handler counting what its kick eventfd (the second) is written, and where it
    /// reports each new count.
    fn counter() -> (Counter, EventFd, mpsc::Receiver<u64>) {
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let trigger = kick.try_clone().unwrap();
        let (told, heard) = mpsc::channel();
        let handler = Counter {
            kick,
            seen: 0,
            told,
        };
        (handler, trigger, heard)
    }

    #[test]
    fn a_device_worker_starts_pauses_resumes_and_resets() {
        let (handler, trigger, heard) = counter();
        let mut device = DeviceWorker::new("test-device", "test-device", 0u64);
        assert!(device.pause().is_none(), "idle: nothing to pause");
        assert_eq!(device.take_idle(), Ok(0));
        assert_eq!(device.take_idle(), Err(NotIdle::Failed), "until started");
        device.start(handler).unwrap();
        assert!(device.is_running());
        assert_eq!(device.take_idle(), Err(NotIdle::Active));
        trigger.write(3).unwrap();
        assert_eq!(heard.recv().unwrap(), 3);

        // Paused: the handler stays as the worker left it, and kicks wait.
        assert_eq!(device.pause().map(|handler| handler.seen), Some(3));
        assert_eq!(device.paused().map(|handler| handler.seen), Some(3));
        assert_eq!(device.pause().map(|handler| handler.seen), Some(3), "twice");
        trigger.write(2).unwrap();
        assert!(heard.try_recv().is_err());
        device.resume().unwrap();
        assert_eq!(heard.recv().unwrap(), 5);

        // A change while running stops the worker between events and starts a new one.
        let seen = device.change(|held| match held {
            Held::Idle(_) => unreachable!("running"),
            Held::Handler(handler) => {
                handler.seen = 100;
                handler.seen
            }
        });
        assert_eq!(seen.unwrap(), 100);
        assert!(device.is_running());
        trigger.write(1).unwrap();
        assert_eq!(heard.recv().unwrap(), 101);

        device.reset(|handler| handler.seen);
        assert!(!device.is_running());
        assert!(device.resume().is_ok(), "nothing to resume");
        let idle = device.change(|held| match held {
            Held::Idle(seen) => *seen,
            Held::Handler(_) => unreachable!("idle"),
        });
        assert_eq!(idle.unwrap(), 101);
        assert_eq!(device.take_idle(), Ok(101));
        assert!(matches!(device.change(|_| ()), Err(ChangeError::Failed)));
        device.set_idle(7);
        assert_eq!(device.take_idle(), Ok(7));
    }
}
