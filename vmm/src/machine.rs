//! A built VM and its run: vCPU threads plus the VMM thread's event loop, which waits
//! for the guest to end (exit port, reset, vCPU stop) and forwards stdin to the serial
//! port.

use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use gpuvm_devices::{Bus, ExitStatus, Persist, SerialDevice};
use gpuvm_memory::snapshot::{RamMappings, SnapshotId};
use gpuvm_memory::uffd::external::HandlerWatch;
use gpuvm_memory::uffd::{LazyRestore, LazyStats, UffdError};
use gpuvm_memory::GuestRam;
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::register_signal_handler;
use vmm_sys_util::terminal::Terminal;
use vmm_sys_util::timerfd::TimerFd;

use crate::config::MachineConfig;
use crate::seccomp::{self, ThreadKind};
use crate::snapshot::{
    self, MachineState, MemoryChain, SavedMachineConfig, SnapshotError, SnapshotReport,
};
use crate::vcpu::{self, StopReporter, Vcpu, VcpuHandle, VcpuStop, VcpuThread};
use crate::vm_state::InKernelDevices;
use crate::working_set;
use crate::{lock, Error};

/// Devices the VMM thread itself needs to reach.
pub struct MachineDevices {
    pub io_bus: Arc<Bus>,
    pub mmio_bus: Arc<Bus>,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub reset_evt: EventFd,
    pub exit_evt: EventFd,
    pub exit_status: ExitStatus,
    /// Names of passthrough devices: their state lives in the hardware, so a VM with any
    /// cannot be snapshotted.
    pub passthrough: Vec<String>,
    /// Device event sources the run loop watches (e.g. INTx resample eventfds).
    pub event_sources: Vec<Arc<Mutex<dyn MutEventSubscriber + Send>>>,
}

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
}

impl GuestEnd {
    /// The process exit code that reflects this ending.
    pub fn exit_code(&self) -> i32 {
        match self {
            GuestEnd::ExitStatus(status) => (*status & 0xff) as i32,
            GuestEnd::TripleFault => i32::from(crate::exit_status::TRIPLE_FAULT),
            GuestEnd::Reset | GuestEnd::PowerOff | GuestEnd::Snapshotted => 0,
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
    handles: &'a [VcpuHandle],
}

impl RunningMachine<'_> {
    pub fn machine(&self) -> &Machine {
        self.machine
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

    /// Snapshots into `dir` and leaves the vCPUs as they were (running or paused).
    /// `full` forces a full memory file even when dirty pages are tracked. A snapshot that
    /// fails leaves the VM as it was (see [`Machine::take_snapshot`]).
    pub fn snapshot(&mut self, dir: &std::path::Path, full: bool) -> Result<SnapshotReport, Error> {
        let resume = !self.machine.paused;
        self.machine.take_snapshot(self.handles, dir, full, resume)
    }
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
    /// /dev/kvm, open for as long as the VM, as before; nothing asks it anything once
    /// the VM is built (the vCPUs hold the MSR list snapshots save).
    _kvm: Kvm,
    config: MachineConfig,
    memory_chain: Option<MemoryChain>,
    snapshot_policy: Option<SnapshotPolicy>,
    snapshots: Vec<SnapshotReport>,
    vcpus_started: Option<Instant>,
    /// Where to write the working set of the snapshot this machine was lazily restored
    /// from (`--record-working-set`), until it is written.
    working_set_target: Option<(PathBuf, SnapshotId)>,
    run_control: Option<Box<dyn RunControl>>,
    paused: bool,
    /// Pages dirtied since the chain's last memory file that KVM no longer reports: its
    /// dirty log was read (and so cleared) for a snapshot that then failed.
    unsaved_dirty: Option<Vec<Vec<u64>>>,
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
            _kvm: kvm,
            config,
            memory_chain: None,
            snapshot_policy: None,
            snapshots: Vec::new(),
            vcpus_started: None,
            working_set_target: None,
            run_control: None,
            paused: false,
            unsaved_dirty: None,
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

    pub fn config(&self) -> &MachineConfig {
        &self.config
    }

    /// Continues the memory chain a restored snapshot came from, so that a later diff
    /// snapshot into the same directory builds on it.
    pub(crate) fn set_memory_chain(&mut self, chain: MemoryChain) {
        self.memory_chain = Some(chain);
    }

    /// Snapshots taken during the run.
    pub fn snapshots(&self) -> &[SnapshotReport] {
        &self.snapshots
    }

    /// When the vCPU threads were started.
    pub fn vcpus_started(&self) -> Option<Instant> {
        self.vcpus_started
    }

    /// Lets a lazy restore's background loader start now rather than when the vCPUs run
    /// (for a restored machine that waits, not yet run, e.g. for an API `Resumed`).
    pub fn release_lazy_loading(&self) {
        if let Some(LazyMemory::InProcess(lazy)) = &self.lazy {
            lazy.release_background();
        }
    }

    /// Statistics of an in-process lazy restore, if one ran.
    pub fn lazy_stats(&self) -> Option<LazyStats> {
        match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => Some(lazy.stats()),
            _ => None,
        }
    }

    /// Waits until lazily restored memory is fully loaded (for benchmarks and tests).
    pub fn wait_lazy_complete(&self, limit: Duration) -> Option<LazyStats> {
        match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => lazy.wait_timeout(Some(limit)).ok().flatten(),
            _ => None,
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
                    None => VcpuThread::spawn(vcpu.id)?,
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
        drop(threads);
        if let Err(error) = started {
            SNAPSHOT_SIGNAL_FD.store(-1, Ordering::SeqCst);
            return Err(error);
        }
        self.vcpus_started = Some(Instant::now());
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
                    let end = run_control.serve(&mut RunningMachine {
                        machine: self,
                        handles: &handles,
                    });
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

    /// What a vCPU that does not leave KVM_RUN when kicked waits for: guest memory that a
    /// lazy restore has not served (nothing else blocks a kicked vCPU for long).
    fn stall_cause(&self) -> Option<&'static str> {
        match &self.lazy {
            Some(LazyMemory::External(_)) => {
                Some("guest memory from the external page-fault handler, which has not served it")
            }
            Some(LazyMemory::InProcess(_)) => {
                Some("guest memory that the lazy restore has not loaded yet")
            }
            None => None,
        }
    }

    /// Whether lazily restored memory is fully loaded; an error if the loader failed or
    /// the external handler is gone (an external handler's progress is unknown: `false`).
    fn lazy_progress(&self) -> Result<bool, Error> {
        match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => lazy
                .wait_timeout(Some(Duration::ZERO))
                .map(|done| done.is_some())
                .map_err(|e| Error::Snapshot(SnapshotError::Uffd(e))),
            Some(LazyMemory::External(watch)) => match watch.failure() {
                Some(reason) => Err(SnapshotError::Uffd(UffdError::HandlerFailed(reason)).into()),
                None => Ok(false),
            },
            None => Ok(true),
        }
    }

    /// Records, once the lazy restore has loaded everything (or the run ends first), which
    /// memory the guest needed first, as the working set of the snapshot it was restored
    /// from (see [`crate::working_set`]): the working set this restore loaded, if any,
    /// then the blocks the guest faulted on. Only for in-process lazy restores; a no-op
    /// otherwise.
    pub fn record_working_set(&mut self) {
        if !matches!(self.lazy, Some(LazyMemory::InProcess(_))) {
            log::warn!("--record-working-set needs a lazy restore; nothing will be recorded");
            return;
        }
        self.working_set_target = self
            .memory_chain
            .as_ref()
            .map(|chain| (chain.dir.clone(), chain.last.id));
    }

    /// Writes the working set if one is to be recorded (best effort: a failure is logged,
    /// the guest is not disturbed).
    fn save_working_set(&mut self) {
        let Some((dir, memory_file)) = self.working_set_target.take() else {
            return;
        };
        let Some(LazyMemory::InProcess(lazy)) = &self.lazy else {
            return;
        };
        // What was loaded first (the guest did not fault there), then what it still
        // faulted on.
        let mut needed = lazy.working_set().to_vec();
        needed.extend(lazy.fault_order());
        let blocks = working_set::blocks_of(&needed);
        if blocks.is_empty() {
            log::info!("the guest faulted on nothing: no working set to record");
            return;
        }
        match working_set::write(&dir, &memory_file, &blocks) {
            Ok(()) => log::info!(
                "recorded a working set of {} blocks in {}",
                blocks.len(),
                dir.join(working_set::FILE).display()
            ),
            Err(error) => log::warn!("cannot record the working set: {error}"),
        }
    }

    /// Makes every page of guest RAM present in the memfd before a snapshot scans it:
    /// pages a lazy restore has not loaded yet are holes, which the writer would record
    /// as zero. Bounded: whoever serves the pages (the external handler, or the loader's
    /// reads) may stop answering, and this thread must not wait on it forever; after
    /// [`SNAPSHOT_MEMORY_STALL`] without progress the snapshot fails, and the VM stays as
    /// it is.
    fn complete_lazy_memory(&self) -> Result<(), Error> {
        let waited = match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => {
                lazy.wait_progressing(SNAPSHOT_MEMORY_STALL).map(drop)
            }
            // The handler loads pages only on fault: they are faulted in, with system
            // calls, so that a handler dying meanwhile (guest RAM is then fenced) is an
            // error, not a SIGSEGV or a hang.
            Some(LazyMemory::External(watch)) => watch.fault_in(SNAPSHOT_MEMORY_STALL),
            None => Ok(()),
        };
        waited.map_err(|e| Error::Snapshot(SnapshotError::Uffd(e)))
    }

    /// Takes the snapshot the policy asked for; returns the run's outcome if it ends here.
    /// A snapshot that fails does not end the run (a signal or timer asked for it; the
    /// guest did nothing wrong): it is logged and the VM runs on, unless guest memory can
    /// no longer be served (a failed lazy restore), which ends the run in any case.
    fn snapshot_requested(&mut self, handles: &[VcpuHandle]) -> Option<Result<GuestEnd, Error>> {
        let policy = self.snapshot_policy.clone()?;
        let keep_running = policy.then == AfterSnapshot::Resume;
        // A VM the API paused stays paused after a timer or SIGUSR1 snapshot.
        let resume = keep_running && !self.paused;
        match self.take_snapshot(handles, &policy.dir, false, resume) {
            Ok(report) => {
                log::info!("snapshot written to {}: {report:?}", policy.dir.display());
                (!keep_running).then_some(Ok(GuestEnd::Snapshotted))
            }
            Err(error) if self.lazy_progress().is_err() => Some(Err(error)),
            Err(error) => {
                log::error!(
                    "snapshot into {} failed; the VM keeps running and the previous snapshot \
                     there is kept: {error}",
                    policy.dir.display()
                );
                None
            }
        }
    }

    /// Whether this machine's state can be saved: not with passthrough devices, whose
    /// state (GPU memory, engines) lives in the hardware.
    pub fn check_snapshottable(&self) -> Result<(), Error> {
        if self.devices.passthrough.is_empty() {
            Ok(())
        } else {
            Err(SnapshotError::Passthrough {
                devices: self.devices.passthrough.clone(),
            }
            .into())
        }
    }

    /// Pauses every vCPU, saves every component and guest memory into `dir` (a full memory
    /// file when `full`, else a diff when dirty pages are tracked and the chain is in
    /// `dir`), and resumes if `resume`.
    ///
    /// A snapshot that fails changes nothing: the previous snapshot in `dir` stays intact
    /// with nothing added (see [`snapshot`]), no dirty page is forgotten, and vCPUs that
    /// were running run again. A directory another process is using, or whose `state`
    /// gpuvm did not write, is refused before any vCPU is paused.
    pub fn take_snapshot(
        &mut self,
        handles: &[VcpuHandle],
        dir: &std::path::Path,
        full: bool,
        resume: bool,
    ) -> Result<SnapshotReport, Error> {
        self.check_snapshottable()?;
        let dir_lock = snapshot::prepare_dir(dir)?;
        let was_running = !self.paused;
        let paused_at = Instant::now();
        let written = self.write_snapshot(handles, dir, &dir_lock, full);
        drop(dir_lock);
        if resume || (written.is_err() && was_running) {
            if let Err(error) = vcpu::resume_all(handles) {
                log::error!("cannot resume the vCPUs after a snapshot: {error}");
            }
        }
        let (memory_file, stats, memory_time) = written?;
        let report = SnapshotReport {
            dir: dir.to_path_buf(),
            memory_file,
            diff: stats.info.is_diff(),
            memory_bytes_written: stats.file_len,
            data_pages: stats.data_pages,
            zero_pages: stats.zero_pages,
            pause_to_resume: paused_at.elapsed(),
            memory_time,
        };
        self.snapshots.push(report.clone());
        Ok(report)
    }

    /// The part of [`Machine::take_snapshot`] that pauses the vCPUs and writes, under
    /// `dir_lock`: the new memory file's name, its figures and the time memory took.
    fn write_snapshot(
        &mut self,
        handles: &[VcpuHandle],
        dir: &std::path::Path,
        dir_lock: &snapshot::SnapshotDirLock,
        full: bool,
    ) -> Result<(String, gpuvm_memory::snapshot::WriteStats, Duration), Error> {
        vcpu::pause_all(handles)?;
        self.complete_lazy_memory()?;
        // The working set of the snapshot this machine was restored from, before a snapshot
        // into another directory; one into the same directory replaces that snapshot (and
        // this lock would refuse the write).
        if let Some((target, _)) = &self.working_set_target {
            if dir_lock.is_for(target) {
                log::info!("no working set recorded: this snapshot replaces the one it was for");
                self.working_set_target = None;
            }
        }
        self.save_working_set();
        let mut vcpus = Vec::with_capacity(handles.len());
        for handle in handles {
            vcpus.push(handle.save_state()?);
        }
        let vm = InKernelDevices(&self.vm)
            .save()
            .map_err(SnapshotError::from)?;
        let devices = self.devices.save().map_err(SnapshotError::SaveDevices)?;

        let memory_started = Instant::now();
        let dirty = if self.config.track_dirty_pages {
            Some(self.take_dirty_bitmaps()?)
        } else {
            None
        };
        let chain = if full {
            None
        } else {
            self.memory_chain.as_ref()
        };
        let written = RamMappings::from_guest_ram(&self.ram)
            .map_err(SnapshotError::from)
            .and_then(|mappings| snapshot::write_memory(dir, &mappings, chain, dirty.as_deref()))
            .and_then(|(memory_file, stats, files)| {
                let memory_time = memory_started.elapsed();
                let state = MachineState {
                    config: SavedMachineConfig::from_config(&self.config),
                    vm,
                    vcpus,
                    devices,
                    memory_files: files,
                    memory_file_id: Some(stats.info.id.to_string()),
                };
                snapshot::commit(dir, &state, &memory_file)?;
                Ok((memory_file, stats, memory_time, state.memory_files))
            });
        let (memory_file, stats, memory_time, files) = match written {
            Ok(written) => written,
            Err(error) => {
                // Not saved after all: the next snapshot must still see these pages dirty.
                self.unsaved_dirty = dirty;
                return Err(error.into());
            }
        };
        self.memory_chain = Some(MemoryChain {
            dir: dir.to_path_buf(),
            files,
            last: stats.info.clone(),
        });
        Ok((memory_file, stats, memory_time))
    }

    /// KVM's dirty bitmaps for every RAM slot since the last call (which they reset),
    /// with the pages of snapshots that failed since the last one that did not.
    fn take_dirty_bitmaps(&mut self) -> Result<Vec<Vec<u64>>, Error> {
        let mut bitmaps = self.unsaved_dirty.take().unwrap_or_default();
        for (slot, region) in self.ram.regions().iter().enumerate() {
            let fresh = match self.vm.get_dirty_log(slot as u32, region.size as usize) {
                Ok(fresh) => fresh,
                Err(source) => {
                    // What was read so far is cleared in KVM: keep it for the next try.
                    self.unsaved_dirty = Some(bitmaps);
                    return Err(Error::Snapshot(SnapshotError::Kvm {
                        what: "read the dirty page log",
                        source,
                    }));
                }
            };
            match bitmaps.get_mut(slot) {
                Some(unsaved) => unsaved
                    .iter_mut()
                    .zip(&fresh)
                    .for_each(|(word, dirty)| *word |= dirty),
                None => bitmaps.push(fresh),
            }
        }
        Ok(bitmaps)
    }

    /// Peak RSS of this process against the guest pages it holds.
    pub fn memory_report(&self) -> Result<MemoryReport, Error> {
        Ok(MemoryReport {
            peak_rss: peak_rss_bytes().map_err(Error::ProcStatus)?,
            guest_resident: self.ram.resident_bytes()?,
        })
    }
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

/// How long a snapshot waits for lazily restored guest memory that is not loading (see
/// [`Machine::complete_lazy_memory`]).
const SNAPSHOT_MEMORY_STALL: Duration = Duration::from_secs(10);

/// Turns the guest-end signals into the run's outcome.
struct ControlEvents {
    api_evt: Option<EventFd>,
    api_requested: bool,
    exit_evt: EventFd,
    reset_evt: EventFd,
    vcpu_evt: EventFd,
    snapshot_evt: EventFd,
    snapshot_timer: Option<TimerFd>,
    lazy_timer: Option<TimerFd>,
    lazy_check: bool,
    exit_status: ExitStatus,
    vcpu_reasons: Receiver<(u8, VcpuStop)>,
    outcome: Option<Result<GuestEnd, Error>>,
    snapshot_requested: bool,
}

/// How often the VMM checks on a lazy restore (for failures and completion).
const LAZY_CHECK_INTERVAL: Duration = Duration::from_millis(20);

/// The eventfd SIGUSR1 writes to (-1: none). A signal handler can only reach a global.
static SNAPSHOT_SIGNAL_FD: AtomicI32 = AtomicI32::new(-1);

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

fn install_snapshot_signal(evt: &EventFd) -> Result<(), Error> {
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
struct StdinInput {
    serial: Arc<Mutex<SerialDevice>>,
    raw_terminal: bool,
}

impl StdinInput {
    fn attach(
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
