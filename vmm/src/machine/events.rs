//! The run loop's event subscribers: [`ControlEvents`] turns the guest-end, API, timer
//! and vCPU-stop signals into the run's outcome; [`StdinInput`] forwards stdin to the
//! serial port; SIGUSR1 asks for a snapshot through an eventfd.

use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use gpuvm_devices::{ExitStatus, SerialDevice};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::register_signal_handler;
use vmm_sys_util::terminal::Terminal;
use vmm_sys_util::timerfd::TimerFd;

use super::GuestEnd;
use crate::vcpu::VcpuStop;
use crate::{lock, Error};

/// Turns the guest-end signals into the run's outcome.
pub(super) struct ControlEvents {
    pub(super) api_evt: Option<EventFd>,
    pub(super) api_requested: bool,
    pub(super) exit_evt: EventFd,
    pub(super) reset_evt: EventFd,
    pub(super) poweroff_evt: EventFd,
    pub(super) vcpu_evt: EventFd,
    pub(super) snapshot_evt: EventFd,
    pub(super) snapshot_timer: Option<TimerFd>,
    pub(super) lazy_timer: Option<TimerFd>,
    pub(super) lazy_check: bool,
    pub(super) exit_status: ExitStatus,
    pub(super) vcpu_reasons: Receiver<(u8, VcpuStop)>,
    pub(super) outcome: Option<Result<GuestEnd, Error>>,
    pub(super) snapshot_requested: bool,
}

/// The eventfd SIGUSR1 writes to (-1: none). A signal handler can only reach a global.
pub(super) static SNAPSHOT_SIGNAL_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn snapshot_signal_handler(
    _: libc::c_int,
    _: *mut libc::siginfo_t,
    _: *mut libc::c_void,
) {
    let fd = SNAPSHOT_SIGNAL_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        let one: u64 = 1;
        // SAFETY: write(2) is async-signal-safe; the buffer is a live 8-byte value and fd
        // is an eventfd kept open for as long as it is published here.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

pub(super) fn install_snapshot_signal(evt: &EventFd) -> Result<(), Error> {
    SNAPSHOT_SIGNAL_FD.store(evt.as_raw_fd(), Ordering::SeqCst);
    register_signal_handler(libc::SIGUSR1, snapshot_signal_handler)
        .map_err(|e| Error::EventFd(std::io::Error::from_raw_os_error(e.errno())))
}

impl ControlEvents {
    fn finish(&mut self, outcome: Result<GuestEnd, Error>) {
        // The first ending wins; later ones are consequences of it.
        if self.outcome.is_none() {
            self.outcome = Some(outcome);
        }
    }
}

impl MutEventSubscriber for ControlEvents {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.exit_evt.as_raw_fd() {
            let _ = self.exit_evt.read();
            let status = self.exit_status.get().unwrap_or(0);
            log::info!("guest reported exit status {status}");
            self.finish(Ok(GuestEnd::ExitStatus(status)));
        } else if fd == self.reset_evt.as_raw_fd() {
            let _ = self.reset_evt.read();
            log::info!("guest requested a reset through the i8042");
            self.finish(Ok(GuestEnd::Reset));
        } else if fd == self.poweroff_evt.as_raw_fd() {
            let _ = self.poweroff_evt.read();
            log::info!("guest powered off through the ACPI sleep control register");
            self.finish(Ok(GuestEnd::PowerOff));
        } else if self.api_evt.as_ref().is_some_and(|e| e.as_raw_fd() == fd) {
            if let Some(evt) = &self.api_evt {
                let _ = evt.read();
            }
            self.api_requested = true;
        } else if fd == self.snapshot_evt.as_raw_fd() {
            let _ = self.snapshot_evt.read();
            self.snapshot_requested = true;
        } else if self
            .snapshot_timer
            .as_ref()
            .is_some_and(|t| t.as_raw_fd() == fd)
        {
            if let Some(timer) = self.snapshot_timer.as_mut() {
                let _ = timer.wait();
            }
            self.snapshot_requested = true;
        } else if self
            .lazy_timer
            .as_ref()
            .is_some_and(|t| t.as_raw_fd() == fd)
        {
            if let Some(timer) = self.lazy_timer.as_mut() {
                let _ = timer.wait();
            }
            self.lazy_check = true;
        } else if fd == self.vcpu_evt.as_raw_fd() {
            let _ = self.vcpu_evt.read();
            while let Ok((id, stop)) = self.vcpu_reasons.try_recv() {
                log::debug!("vCPU {id} stopped: {stop:?}");
                self.finish(match stop {
                    VcpuStop::Reset => Ok(GuestEnd::Reset),
                    VcpuStop::TripleFault => {
                        log::error!(
                            "vCPU {id}: the guest triple-faulted; the run ends with status {}",
                            crate::exit_status::TRIPLE_FAULT
                        );
                        Ok(GuestEnd::TripleFault)
                    }
                    VcpuStop::PowerOff => Ok(GuestEnd::PowerOff),
                    VcpuStop::Error(error) => Err(Error::Vcpu(error)),
                });
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        for fd in [
            &self.exit_evt,
            &self.reset_evt,
            &self.poweroff_evt,
            &self.vcpu_evt,
            &self.snapshot_evt,
        ] {
            if let Err(error) = ops.add(Events::new(fd, EventSet::IN)) {
                log::error!("cannot watch a VM control event: {error}");
            }
        }
        if let Some(evt) = &self.api_evt {
            if let Err(error) = ops.add(Events::new(evt, EventSet::IN)) {
                log::error!("cannot watch the API request event: {error}");
            }
        }
        for timer in [&self.snapshot_timer, &self.lazy_timer]
            .into_iter()
            .flatten()
        {
            if let Err(error) = ops.add(Events::new(timer, EventSet::IN)) {
                log::error!("cannot watch a VMM timer: {error}");
            }
        }
    }
}

/// Forwards stdin to the serial port; on a terminal, in raw mode (restored on drop).
pub(super) struct StdinInput {
    serial: Arc<Mutex<SerialDevice>>,
    raw_terminal: bool,
}

impl StdinInput {
    pub(super) fn attach(
        events: &mut EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>,
        serial: Arc<Mutex<SerialDevice>>,
    ) -> Arc<Mutex<StdinInput>> {
        let stdin = std::io::stdin();
        let raw_terminal =
            std::io::IsTerminal::is_terminal(&stdin) && stdin.lock().set_raw_mode().is_ok();
        let input = Arc::new(Mutex::new(StdinInput {
            serial,
            raw_terminal,
        }));
        events.add_subscriber(input.clone());
        input
    }
}

impl Drop for StdinInput {
    fn drop(&mut self) {
        if self.raw_terminal {
            let _ = std::io::stdin().lock().set_canon_mode();
        }
    }
}

impl MutEventSubscriber for StdinInput {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let mut buffer = [0u8; 64];
        let count = if events.event_set().contains(EventSet::IN) {
            std::io::stdin().lock().read(&mut buffer).unwrap_or(0)
        } else {
            0
        };
        if count == 0 {
            // EOF, error or hang-up: stop watching stdin, keep the VM running.
            let _ = ops.remove(events);
            return;
        }
        if let Err(error) = lock(&self.serial).enqueue_input(&buffer[..count]) {
            log::debug!("serial input dropped: {error}");
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        let stdin = std::io::stdin();
        // Not every stdin can be polled (a regular file, or none at all): then no input.
        if let Err(error) = ops.add(Events::new(&stdin, EventSet::IN)) {
            log::debug!("stdin is not forwarded to the guest: {error}");
        }
    }
}
