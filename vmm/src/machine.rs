//! A built VM and its run: vCPU threads plus the VMM thread's event loop, which waits
//! for the guest to end (exit port, reset, vCPU stop) and forwards stdin to the serial
//! port.

use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use gpuvm_devices::{Bus, ExitStatus, SerialDevice};
use gpuvm_memory::GuestRam;
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::terminal::Terminal;

use crate::vcpu::{StopReporter, Vcpu, VcpuHandle, VcpuStop};
use crate::Error;

/// Devices the VMM thread itself needs to reach.
pub struct MachineDevices {
    pub io_bus: Arc<Bus>,
    pub mmio_bus: Arc<Bus>,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub reset_evt: EventFd,
    pub exit_evt: EventFd,
    pub exit_status: ExitStatus,
}

/// How the guest ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestEnd {
    /// The guest wrote a status to the exit port.
    ExitStatus(u32),
    /// The guest reset the machine (i8042 reset, reset system event, or triple fault).
    Reset,
    /// The guest powered off.
    PowerOff,
}

impl GuestEnd {
    /// The process exit code that reflects this ending.
    pub fn exit_code(&self) -> i32 {
        match self {
            GuestEnd::ExitStatus(status) => (*status & 0xff) as i32,
            GuestEnd::Reset | GuestEnd::PowerOff => 0,
        }
    }
}

/// Memory figures taken when the VM ends (for `--report-memory`).
#[derive(Clone, Copy, Debug)]
pub struct MemoryReport {
    pub peak_rss: u64,
    pub guest_resident: u64,
}

impl MemoryReport {
    /// What gpuvm itself costs on top of the guest pages it holds.
    pub fn overhead(&self) -> u64 {
        self.peak_rss.saturating_sub(self.guest_resident)
    }
}

pub struct Machine {
    // Field order is drop order: vCPUs and the VM fd go before the memory they map.
    vcpus: Vec<Vcpu>,
    devices: MachineDevices,
    vm: VmFd,
    ram: GuestRam,
    _kvm: Kvm,
}

impl Machine {
    pub(crate) fn new(
        kvm: Kvm,
        vm: VmFd,
        ram: GuestRam,
        devices: MachineDevices,
        vcpus: Vec<Vcpu>,
    ) -> Self {
        Machine {
            vcpus,
            devices,
            vm,
            ram,
            _kvm: kvm,
        }
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    pub fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    /// Runs the guest to its end. vCPU threads are always stopped and joined before this
    /// returns, whatever the outcome.
    pub fn run(&mut self) -> Result<GuestEnd, Error> {
        if self.vcpus.is_empty() {
            return Err(Error::AlreadyRan);
        }
        let (reasons_tx, reasons_rx) = channel();
        let reporter = Arc::new(StopReporter {
            reasons: reasons_tx,
            event: EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?,
        });
        let control = Arc::new(Mutex::new(ControlEvents {
            exit_evt: self.devices.exit_evt.try_clone().map_err(Error::EventFd)?,
            reset_evt: self.devices.reset_evt.try_clone().map_err(Error::EventFd)?,
            vcpu_evt: reporter.event.try_clone().map_err(Error::EventFd)?,
            exit_status: self.devices.exit_status.clone(),
            vcpu_reasons: reasons_rx,
            outcome: None,
        }));
        let mut events: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            EventManager::new().map_err(Error::EventManager)?;
        events.add_subscriber(control.clone());
        let _stdin = StdinInput::attach(&mut events, self.devices.serial.clone());

        let mut handles: Vec<VcpuHandle> = Vec::with_capacity(self.vcpus.len());
        for vcpu in self.vcpus.drain(..) {
            handles.push(vcpu.start(reporter.clone())?);
        }
        let outcome = loop {
            if let Err(error) = events.run() {
                break Err(Error::EventManager(error));
            }
            if let Some(outcome) = lock(&control).outcome.take() {
                break outcome;
            }
        };
        for handle in handles.iter_mut() {
            handle.stop_and_join();
        }
        outcome
    }

    /// Peak RSS of this process against the guest pages it holds.
    pub fn memory_report(&self) -> Result<MemoryReport, Error> {
        Ok(MemoryReport {
            peak_rss: peak_rss_bytes().map_err(Error::ProcStatus)?,
            guest_resident: self.ram.resident_bytes()?,
        })
    }
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// VmHWM from /proc/self/status.
fn peak_rss_bytes() -> std::io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .ok_or_else(|| std::io::Error::other("no VmHWM in /proc/self/status"))
}

/// Turns the guest-end signals into the run's outcome.
struct ControlEvents {
    exit_evt: EventFd,
    reset_evt: EventFd,
    vcpu_evt: EventFd,
    exit_status: ExitStatus,
    vcpu_reasons: Receiver<(u8, VcpuStop)>,
    outcome: Option<Result<GuestEnd, Error>>,
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
        } else if fd == self.vcpu_evt.as_raw_fd() {
            let _ = self.vcpu_evt.read();
            while let Ok((id, stop)) = self.vcpu_reasons.try_recv() {
                log::debug!("vCPU {id} stopped: {stop:?}");
                self.finish(match stop {
                    VcpuStop::Reset => Ok(GuestEnd::Reset),
                    VcpuStop::PowerOff => Ok(GuestEnd::PowerOff),
                    VcpuStop::Error(error) => Err(Error::Vcpu(error)),
                });
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        for fd in [&self.exit_evt, &self.reset_evt, &self.vcpu_evt] {
            if let Err(error) = ops.add(Events::new(fd, EventSet::IN)) {
                log::error!("cannot watch a VM control event: {error}");
            }
        }
    }
}

/// Forwards stdin to the serial port; on a terminal, in raw mode (restored on drop).
struct StdinInput {
    serial: Arc<Mutex<SerialDevice>>,
    raw_terminal: bool,
}

impl StdinInput {
    fn attach(
        events: &mut EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>,
        serial: Arc<Mutex<SerialDevice>>,
    ) -> Option<Arc<Mutex<StdinInput>>> {
        let stdin = std::io::stdin();
        let raw_terminal =
            std::io::IsTerminal::is_terminal(&stdin) && stdin.lock().set_raw_mode().is_ok();
        let input = Arc::new(Mutex::new(StdinInput {
            serial,
            raw_terminal,
        }));
        events.add_subscriber(input.clone());
        Some(input)
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
