//! A built VM and its run: vCPU threads plus the VMM thread's event loop, which waits
//! for the guest to end (exit port, reset, vCPU stop) and forwards stdin to the serial
//! port. Snapshots of the running machine, lazy-memory progress, the loop's event
//! subscribers and the memory report live in the submodules.

mod cpu_hotplug;
mod events;
mod lazy;
mod memory_hotplug;
mod report;
mod take_snapshot;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use gpuvm_memory::snapshot::SnapshotId;
use gpuvm_memory::uffd::external::HandlerWatch;
use gpuvm_memory::uffd::LazyRestore;
use gpuvm_memory::GuestRam;
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

pub use self::cpu_hotplug::CpuResizeError;
use self::events::{install_snapshot_signal, ControlEvents, StdinInput, SNAPSHOT_SIGNAL_FD};
use self::lazy::LAZY_CHECK_INTERVAL;
pub(crate) use self::memory_hotplug::RamHotplug;
pub use self::memory_hotplug::{plan_ram_resize, MemoryResizeError, RamResize};
pub use self::report::MemoryReport;
use crate::config::MachineConfig;
use crate::devices::MachineDevices;
use crate::seccomp::{self, ThreadKind};
use crate::snapshot::{MemoryChain, SnapshotError, SnapshotReport};
use crate::vcpu::{self, StopReporter, Vcpu, VcpuHandle, VcpuThread};
use crate::{lock, Error};

/// How the guest ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestEnd {
    /// The guest wrote a status to the exit port.
    ExitStatus(u32),
    /// The guest reset the machine (i8042 reset or reset system event).
    Reset,
    /// The guest triple-faulted: a crash, not a reset (gpuvm does not reboot anyway).
    TripleFault,
    /// The guest powered off.
    PowerOff,
    /// A snapshot was taken and the run was asked to end there.
    Snapshotted,
    /// A live update handed the VM to a new gpuvm process (crate::update).
    HandedOver,
}

impl GuestEnd {
    /// The process exit code that reflects this ending.
    pub fn exit_code(&self) -> i32 {
        match self {
            GuestEnd::ExitStatus(status) => (*status & 0xff) as i32,
            GuestEnd::TripleFault => i32::from(crate::exit_status::TRIPLE_FAULT),
            GuestEnd::Reset | GuestEnd::PowerOff | GuestEnd::Snapshotted | GuestEnd::HandedOver => {
                0
            }
        }
    }
}

/// What to do after a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterSnapshot {
    Resume,
    Exit,
}

/// When the running machine snapshots itself (until the API socket drives it).
#[derive(Clone, Debug)]
pub struct SnapshotPolicy {
    pub dir: PathBuf,
    /// Snapshot this long after the vCPUs start.
    pub after: Option<Duration>,
    /// Also snapshot on SIGUSR1 (`gpuvm snapshot --pid`).
    pub on_signal: bool,
    pub then: AfterSnapshot,
}

/// Memory being restored lazily behind the running guest.
pub(crate) enum LazyMemory {
    InProcess(LazyRestore),
    /// An external page-fault handler serves the userfaultfd; the watch keeps the
    /// connection and the VMM's own reference to the userfaultfd, and fences guest RAM
    /// if the handler dies.
    External(HandlerWatch),
}

/// Serves control requests (the API socket) from inside [`Machine::run`]'s event loop, on
/// the VMM thread, which owns the machine.
pub trait RunControl: Send {
    /// Readable when requests are waiting.
    fn event(&self) -> &EventFd;
    /// Serves the waiting requests. Returns how the run ends if a request ends it.
    fn serve(&mut self, running: &mut RunningMachine<'_>) -> Option<GuestEnd>;
}

/// A machine whose vCPUs are running (or paused by a control request).
pub struct RunningMachine<'a> {
    machine: &'a mut Machine,
    /// The guest's vCPUs (hot-plugged ones join them).
    handles: &'a mut Vec<VcpuHandle>,
    /// vCPUs the guest ejected: their threads paused, their KVM vCPUs kept (KVM cannot
    /// destroy one) for a later hot-plug of the same CPU.
    parked: &'a mut Vec<VcpuHandle>,
    /// Where the vCPUs report that they stopped (a hot-plugged one too).
    reporter: &'a Arc<StopReporter>,
}

impl RunningMachine<'_> {
    pub fn machine(&self) -> &Machine {
        self.machine
    }

    /// The machine's devices, to change them (PCI hot-plug).
    pub fn devices_mut(&mut self) -> &mut crate::devices::MachineDevices {
        &mut self.machine.devices
    }

    /// The guest's vCPUs (a live update saves their state).
    pub fn vcpu_handles(&self) -> &[VcpuHandle] {
        self.handles
    }

    /// Whether a control request paused the vCPUs.
    pub fn is_paused(&self) -> bool {
        self.machine.paused
    }

    /// Pauses every vCPU; at once if they are paused. If one cannot pause, none is: the
    /// VM runs on, as reported, and the error says why.
    pub fn pause(&mut self) -> Result<(), Error> {
        vcpu::pause_all(self.handles)?;
        self.machine.paused = true;
        Ok(())
    }

    /// Resumes every vCPU; at once if they run.
    pub fn resume(&mut self) -> Result<(), Error> {
        // Asked to run, every vCPU does as soon as it wakes (a paused thread waits on
        // nothing else), so the VM is running even if one fails to confirm it.
        self.machine.paused = false;
        vcpu::resume_all(self.handles)?;
        Ok(())
    }

    /// Stops the virtio devices' I/O after the request in flight, as a snapshot does, so
    /// that their state can be saved (a live update); the vCPUs must be paused first.
    pub fn pause_devices(&mut self) {
        crate::virtio::pause_all(&self.machine.devices.virtio);
    }

    /// Lets the devices stopped by [`RunningMachine::pause_devices`] run again.
    pub fn resume_devices(&mut self) {
        self.machine.resume_devices();
    }

    /// Snapshots into `dir` and leaves the vCPUs as they were (running or paused).
    /// `full` forces a full memory file even when dirty pages are tracked. A snapshot that
    /// fails leaves the VM as it was (see [`Machine::take_snapshot`]).
    pub fn snapshot(&mut self, dir: &std::path::Path, full: bool) -> Result<SnapshotReport, Error> {
        let resume = !self.machine.paused;
        self.machine.take_snapshot(self.handles, dir, full, resume)
    }
}

/// When [`crate::builder::build_with_pci`] ran and its stages, back to back from its call, for
/// `--report-timing`'s `boot-stages` line: `plan` (NUMA plan from the host), `open_kvm`,
/// then the base's (`guest_ram`, `create_vm`, `memslots`, `irqchip_pit`,
/// `devices`), `acpi` (the tables), `load_kernel` (kernel, MP table, reset vector),
/// `create_vcpus` (KVM_CREATE_VCPU, CPUID, boot registers) and `vcpu_threads` (threads
/// started under their filters, spare ones for hot-plug included).
#[derive(Clone, Debug)]
pub struct BootTimings {
    pub called: Instant,
    pub stages: Vec<(&'static str, std::time::Duration)>,
    pub returned: Instant,
}

pub struct Machine {
    // Field order is drop order: vCPUs, lazy loaders and the VM fd go before the memory
    // they use.
    vcpus: Vec<Vcpu>,
    /// Threads started early for `vcpus` (see [`VcpuThread`]), waiting for them.
    pub(crate) vcpu_threads: Vec<VcpuThread>,
    pub(crate) lazy: Option<LazyMemory>,
    devices: MachineDevices,
    vm: VmFd,
    ram: GuestRam,
    /// Memory hot-plug (vm.resize desired_ram): the register block and the RAM added,
    /// after `vm` so that KVM lets go of it first. None without memory hot-plug.
    pub(crate) ram_hotplug: Option<RamHotplug>,
    /// /dev/kvm, open for as long as the VM, as before; nothing asks it anything once
    /// the VM is built (the vCPUs hold the MSR list snapshots save).
    _kvm: Kvm,
    config: MachineConfig,
    /// vCPUs the guest may have by hot-plug (at least `config.vcpus`, which counts the
    /// vCPUs it has).
    pub(crate) max_vcpus: u8,
    /// How hot-plugged vCPUs are made (None without vCPU hot-plug).
    pub(crate) vcpu_template: Option<vcpu::VcpuTemplate>,
    memory_chain: Option<MemoryChain>,
    snapshot_policy: Option<SnapshotPolicy>,
    snapshots: Vec<SnapshotReport>,
    vcpus_started: Option<Instant>,
    /// How long each stage of a boot's build took (None for a restored machine).
    pub(crate) boot_timings: Option<BootTimings>,
    /// Where to write the working set of the snapshot this machine was lazily restored
    /// from (`--record-working-set`), until it is written.
    working_set_target: Option<(PathBuf, SnapshotId)>,
    run_control: Option<Box<dyn RunControl>>,
    paused: bool,
    /// Pages dirtied since the chain's last memory file that KVM no longer reports: its
    /// dirty log was read (and so cleared) for a snapshot that then failed.
    unsaved_dirty: Option<Vec<Vec<u64>>>,
    /// Its NUMA nodes as placed (empty without): the plan its snapshots and live updates
    /// carry, and where a vCPU thread started late pins itself.
    pub(crate) numa: crate::numa::PlacedNuma,
}

impl Machine {
    pub(crate) fn new(
        kvm: Kvm,
        vm: VmFd,
        ram: GuestRam,
        devices: MachineDevices,
        vcpus: Vec<Vcpu>,
        config: MachineConfig,
    ) -> Self {
        Machine {
            vcpus,
            vcpu_threads: Vec::new(),
            lazy: None,
            devices,
            vm,
            ram,
            ram_hotplug: None,
            _kvm: kvm,
            max_vcpus: config.vcpus,
            vcpu_template: None,
            config,
            memory_chain: None,
            snapshot_policy: None,
            snapshots: Vec::new(),
            vcpus_started: None,
            boot_timings: None,
            working_set_target: None,
            run_control: None,
            paused: false,
            unsaved_dirty: None,
            numa: crate::numa::PlacedNuma::default(),
        }
    }

    /// Makes the running machine snapshot itself as `policy` says.
    pub fn set_snapshot_policy(&mut self, policy: SnapshotPolicy) {
        self.snapshot_policy = Some(policy);
    }

    /// Lets `control` serve requests while the machine runs.
    pub fn set_run_control(&mut self, control: Box<dyn RunControl>) {
        self.run_control = Some(control);
    }

    /// The machine's devices (for the API's device operations).
    pub fn devices(&self) -> &MachineDevices {
        &self.devices
    }

    /// A live update's new process, once the paused state is loaded: the virtio devices
    /// serve nothing (no ring, tap, image or host socket is touched) until the VM is this
    /// process's ([`Machine::take_over_devices`]); the old process takes the VM back on any
    /// failure before that, and must find everything as it left it.
    pub fn hold_devices(&self) {
        crate::virtio::pause_all(&self.devices.virtio);
    }

    /// The VM is this process's (the old one committed, or died after this one was ready):
    /// the devices held by [`Machine::hold_devices`] serve, and the vsock socket file is
    /// this process's to remove when the VM ends.
    pub fn take_over_devices(&self) {
        crate::virtio::resume_all(&self.devices.virtio);
        crate::virtio::vsock_owns_socket_file(&self.devices.virtio, true);
    }

    pub fn config(&self) -> &MachineConfig {
        &self.config
    }

    /// Continues the memory chain a restored snapshot came from, so that a later diff
    /// snapshot into the same directory builds on it.
    pub(crate) fn set_memory_chain(&mut self, chain: MemoryChain) {
        self.memory_chain = Some(chain);
        if let Some(hotplug) = self.ram_hotplug.as_mut() {
            hotplug.note_chain_layout();
        }
    }

    /// Snapshots taken during the run.
    pub fn snapshots(&self) -> &[SnapshotReport] {
        &self.snapshots
    }

    /// When the vCPU threads were started.
    pub fn vcpus_started(&self) -> Option<Instant> {
        self.vcpus_started
    }

    /// The stages of this machine's build, when it was built to boot.
    pub fn boot_timings(&self) -> Option<&BootTimings> {
        self.boot_timings.as_ref()
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
        let snapshot_evt = EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)?;
        let mut snapshot_timer = None;
        if let Some(policy) = &self.snapshot_policy {
            if policy.on_signal {
                install_snapshot_signal(&snapshot_evt)?;
            }
            if let Some(after) = policy.after {
                let mut timer = TimerFd::new().map_err(|e| Error::EventFd(e.into()))?;
                timer
                    .reset(after.max(Duration::from_millis(1)), None)
                    .map_err(|e| Error::EventFd(e.into()))?;
                snapshot_timer = Some(timer);
            }
        }
        // A lazy restore that fails (unreadable or corrupt file) must end the run: a vCPU
        // faulting on a page nobody will load would otherwise wait forever.
        let lazy_timer = if self.lazy.is_some() {
            let mut timer = TimerFd::new().map_err(|e| Error::EventFd(e.into()))?;
            timer
                .reset(LAZY_CHECK_INTERVAL, Some(LAZY_CHECK_INTERVAL))
                .map_err(|e| Error::EventFd(e.into()))?;
            Some(timer)
        } else {
            None
        };
        let api_evt = match &self.run_control {
            Some(control) => Some(control.event().try_clone().map_err(Error::EventFd)?),
            None => None,
        };
        let control = Arc::new(Mutex::new(ControlEvents {
            api_evt,
            api_requested: false,
            exit_evt: self.devices.exit_evt.try_clone().map_err(Error::EventFd)?,
            reset_evt: self.devices.reset_evt.try_clone().map_err(Error::EventFd)?,
            poweroff_evt: self
                .devices
                .poweroff_evt
                .try_clone()
                .map_err(Error::EventFd)?,
            vcpu_evt: reporter.event.try_clone().map_err(Error::EventFd)?,
            snapshot_evt,
            snapshot_timer,
            lazy_timer,
            lazy_check: false,
            exit_status: self.devices.exit_status.clone(),
            vcpu_reasons: reasons_rx,
            outcome: None,
            snapshot_requested: false,
        }));
        let mut events: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            EventManager::new().map_err(Error::EventManager)?;
        events.add_subscriber(control.clone());
        for source in &self.devices.event_sources {
            events.add_subscriber(source.clone());
        }
        let _stdin = StdinInput::attach(&mut events, self.devices.serial.clone());

        // vCPU threads start paused with their filter installed (usually long before:
        // the builders start them early); this thread takes its own filter once nothing
        // privileged is left to do, while they finish theirs, then lets the guest run.
        let mut handles: Vec<VcpuHandle> = Vec::with_capacity(self.vcpus.len());
        let mut threads = std::mem::take(&mut self.vcpu_threads);
        let stall_cause = self.stall_cause();
        let started = (|| -> Result<(), Error> {
            for vcpu in self.vcpus.drain(..) {
                let thread = match threads.iter().position(|t| t.id() == vcpu.id) {
                    Some(at) => threads.swap_remove(at),
                    None => VcpuThread::spawn(vcpu.id, self.numa.cpus_of(vcpu.id))?,
                };
                let mut handle = thread.launch(vcpu, reporter.clone())?;
                if let Some(cause) = stall_cause {
                    handle.set_stall_cause(cause);
                }
                handles.push(handle);
            }
            seccomp::apply(ThreadKind::Vmm)?;
            for handle in &handles {
                handle.wait_ready()?;
            }
            vcpu::resume_all(&handles)?;
            Ok(())
        })();
        // The threads left wait for vCPUs that hot-plug may add.
        self.vcpu_threads = threads;
        if let Err(error) = started {
            SNAPSHOT_SIGNAL_FD.store(-1, Ordering::SeqCst);
            return Err(error);
        }
        self.vcpus_started = Some(Instant::now());
        let mut parked: Vec<VcpuHandle> = Vec::new();
        // The guest's CPU ejects wake this thread as API requests do (see
        // `RunningMachine::park_ejected_vcpus`).
        if let (Some(block), Some(control)) = (&self.devices.cpu_hotplug, &self.run_control) {
            if let Ok(wake) = control.event().try_clone() {
                lock(block).set_wake(wake);
            }
        }
        // So do the guest's PCI ejects and a hot-plugged GPU's device process hanging up,
        // from the start: a GPU a restore or a live update brought back may go before any
        // hot-plug request has come.
        if let (Some(hotplug), Some(control)) = (&mut self.devices.pci_hotplug, &self.run_control) {
            if let Ok(wake) = control.event().try_clone() {
                hotplug.set_wake(wake);
            }
        }
        // The background loader of a lazy restore was held back until now, so it did not
        // compete for CPUs with the restore's last steps.
        self.release_lazy_loading();
        let outcome = loop {
            if let Err(error) = events.run() {
                break Err(Error::EventManager(error));
            }
            let lazy_check = std::mem::take(&mut lock(&control).lazy_check);
            if lazy_check {
                match self.lazy_progress() {
                    Err(error) => break Err(error),
                    Ok(true) => {
                        self.save_working_set();
                        if let Some(timer) = lock(&control).lazy_timer.as_mut() {
                            let _ = timer.clear();
                        }
                    }
                    Ok(false) => {}
                }
            }
            let snapshot_requested = std::mem::take(&mut lock(&control).snapshot_requested);
            if snapshot_requested {
                if let Some(outcome) = self.snapshot_requested(&handles) {
                    break outcome;
                }
            }
            let api_requested = std::mem::take(&mut lock(&control).api_requested);
            if api_requested {
                if let Some(mut run_control) = self.run_control.take() {
                    let mut running = RunningMachine {
                        machine: self,
                        handles: &mut handles,
                        parked: &mut parked,
                        reporter: &reporter,
                    };
                    running.park_ejected_vcpus();
                    let end = run_control.serve(&mut running);
                    self.run_control = Some(run_control);
                    if let Some(end) = end {
                        break Ok(end);
                    }
                }
            }
            if let Some(outcome) = lock(&control).outcome.take() {
                break outcome;
            }
        };
        SNAPSHOT_SIGNAL_FD.store(-1, Ordering::SeqCst);
        // Bounded: a vCPU waiting for guest memory nobody serves is left behind, so that
        // the run (and the process) can end.
        vcpu::stop_all(&mut handles);
        vcpu::stop_all(&mut parked);
        // When guest memory could not be served, that is why the run ended, whatever
        // ended it first (a vCPU faulting out of fenced memory, a guest that noticed).
        if let Err(error) = self.lazy_progress() {
            match &outcome {
                // Already that failure, said in context (e.g. during a snapshot).
                Err(Error::Snapshot(SnapshotError::Uffd(_))) => {}
                Err(other) => {
                    log::debug!("run ended with {other}, caused by the lazy restore failure");
                    return Err(error);
                }
                Ok(_) => return Err(error),
            }
        }
        // The guest ended before everything was loaded: what it faulted on so far.
        self.save_working_set();
        outcome
    }
}
