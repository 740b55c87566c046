//! vCPUs: one thread each, running KVM_RUN and dispatching exits to the device buses.
//!
//! The VMM thread steers a vCPU thread through a [`VcpuHandle`]: it sets what it wants
//! of the thread (run, pause, stop) in state they share, and kicks the thread out of
//! KVM_RUN with a signal. The thread acts on the latest wish between KVM_RUN calls and
//! says what it is doing in the same state, so a wish is idempotent, a wish that is
//! withdrawn before the thread looked is never acted on, and no answer is left over for
//! a later request to mistake for its own. The signal handler sets
//! `kvm_run.immediate_exit`, so a kick that lands just before the thread re-enters
//! KVM_RUN is not lost (KVM_RUN returns EINTR at once).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpuvm_arch::x86_64::cpuid::{self, CpuidMask, Topology};
use gpuvm_arch::x86_64::emulate;
use gpuvm_arch::x86_64::msr;
use gpuvm_arch::x86_64::regs::{self, EntryPoint};
use gpuvm_devices::{Bus, Persist};
use kvm_bindings::{kvm_run, CpuId, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::persist::PersistError;
use crate::seccomp::SeccompError;

mod state;
pub use state::{saved_msr_indices, VcpuState};

/// KVM_INTERNAL_ERROR_EMULATION: the instruction emulator gave up.
const INTERNAL_ERROR_EMULATION: u32 = 1;
const LAPIC_LVT_LINT0: usize = 0x350;
const LAPIC_LVT_LINT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7;
const APIC_MODE_NMI: u32 = 0x4;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("failed to create vCPU {id}: {source}")]
    Create { id: u8, source: kvm_ioctls::Error },
    #[error("vCPU {id}: failed to {what}: {source}")]
    Setup {
        id: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: {source}")]
    BootRegs { id: u8, source: regs::RegsError },
    #[error("vCPU {id}: KVM_RUN failed: {source}")]
    Run { id: u8, source: kvm_ioctls::Error },
    #[error("vCPU {id}: the guest executed an instruction this host's KVM cannot emulate at rip {rip:#x}: bytes [{bytes}]")]
    UnemulatedInstruction { id: u8, rip: u64, bytes: String },
    #[error("vCPU {id}: KVM internal error, suberror {suberror}")]
    Internal { id: u8, suberror: u32 },
    #[error("vCPU {id}: hardware failed to enter the guest (reason {reason:#x})")]
    FailEntry { id: u8, reason: u64 },
    #[error("vCPU {id}: unexpected exit {exit}")]
    UnexpectedExit { id: u8, exit: String },
    #[error("cannot start vCPU thread {id}: {source}")]
    Spawn { id: u8, source: std::io::Error },
    #[error("failed to install the vCPU kick signal handler: {0}")]
    SignalHandler(vmm_sys_util::errno::Error),
    #[error("vCPU {0} did not answer within the time limit")]
    NoResponse(u8),
    #[error(
        "vCPU {id} did not stop running the guest within {} ms of being asked to{}",
        .waited.as_millis(),
        .cause.map(|c| format!(": it waits for {c}")).unwrap_or_default()
    )]
    NotStopping {
        id: u8,
        waited: Duration,
        /// What the vCPU most likely waits for, when the machine knows.
        cause: Option<&'static str>,
    },
    #[error("vCPU {0} has stopped")]
    Ended(u8),
    #[error("vCPU {0} is not paused (its state can only be saved while it is)")]
    NotPaused(u8),
    #[error("vCPU {id} was handed to the thread started for vCPU {thread}")]
    WrongThread { id: u8, thread: u8 },
    #[error("vCPU {0}: cannot save its state: {1}")]
    SaveState(u8, PersistError),
    #[error("vCPU {id}: {source}")]
    Seccomp { id: u8, source: SeccompError },
}

/// Why a vCPU stopped running the guest on its own.
#[derive(Debug)]
pub enum VcpuStop {
    /// The guest asked for a reset.
    Reset,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault,
    /// The guest asked to power off.
    PowerOff,
    Error(VcpuError),
}

/// What the VMM thread wants a vCPU thread to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wish {
    Run,
    Pause,
    Stop,
}

/// What a vCPU thread is doing, as it last said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Activity {
    /// Installing its seccomp filter, or waiting for its vCPU.
    Starting,
    /// Out of KVM_RUN until its wish changes; it captures its state on request.
    Paused,
    /// Running the guest; it looks at its wish between KVM_RUN calls.
    Running,
    /// The thread has ended.
    Ended,
}

/// What the VMM thread and one vCPU thread share.
struct Shared {
    wish: Wish,
    activity: Activity,
    /// How installing the thread's seccomp filter went, once it has.
    ready: Option<Result<(), SeccompError>>,
    /// A state capture asked of the paused thread...
    save_request: bool,
    /// ...and its result.
    saved: Option<Result<VcpuState, PersistError>>,
    /// The last kick out of KVM_RUN.
    kicked: Option<Kick>,
}

/// A kick: when, and how many KVM_RUN calls the thread had returned from by then.
#[derive(Clone, Copy)]
struct Kick {
    at: Instant,
    runs: u64,
}

/// [`Shared`] behind its lock; every change is announced on `changed`.
struct Control {
    shared: Mutex<Shared>,
    changed: Condvar,
    /// Whether the wish is anything but Run, for the running thread to read between
    /// KVM_RUN calls without taking the lock (written only under it).
    attention: AtomicBool,
    /// KVM_RUN calls the thread has returned from: one that has not returned since a
    /// kick long ago waits in the kernel (see [`STOP_RUNNING_LIMIT`]).
    runs: AtomicU64,
}

impl Control {
    fn new() -> Control {
        Control {
            shared: Mutex::new(Shared {
                // A new thread waits to be resumed.
                wish: Wish::Pause,
                activity: Activity::Starting,
                ready: None,
                save_request: false,
                saved: None,
                kicked: None,
            }),
            changed: Condvar::new(),
            attention: AtomicBool::new(true),
            runs: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        crate::lock(&self.shared)
    }

    fn wait<'a>(&self, shared: MutexGuard<'a, Shared>) -> MutexGuard<'a, Shared> {
        self.changed
            .wait(shared)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn set_wish(&self, shared: &mut Shared, wish: Wish) {
        // Stop is final.
        if shared.wish != Wish::Stop {
            shared.wish = wish;
            self.attention.store(wish != Wish::Run, Ordering::SeqCst);
            self.changed.notify_all();
        }
    }

    fn set_activity(&self, shared: &mut Shared, activity: Activity) {
        if shared.activity != activity {
            shared.activity = activity;
            self.changed.notify_all();
        }
    }
}

/// Marks the thread Ended however it ends (a panic included), so nobody waits for it.
struct EndedOnDrop(Arc<Control>);

impl Drop for EndedOnDrop {
    fn drop(&mut self) {
        let mut shared = self.0.lock();
        self.0.set_activity(&mut shared, Activity::Ended);
    }
}

/// Where a vCPU reports that it stopped on its own.
pub struct StopReporter {
    pub reasons: Sender<(u8, VcpuStop)>,
    pub event: EventFd,
}

thread_local! {
    // This thread's kvm_run mapping, for the kick signal handler.
    static KVM_RUN_PTR: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN_PTR.with(|ptr| ptr.get());
    if !run.is_null() {
        // SAFETY: the pointer is this thread's own kvm_run mapping, valid for as long as
        // the thread's VcpuFd lives; it is cleared before the VcpuFd is dropped. A byte
        // store is async-signal-safe.
        unsafe { std::ptr::write_volatile(&mut (*run).immediate_exit, 1) };
    }
}

fn kick_signal() -> i32 {
    SIGRTMIN()
}

fn install_kick_handler() -> Result<(), VcpuError> {
    static INSTALL: Once = Once::new();
    let mut result = Ok(());
    INSTALL.call_once(|| {
        result =
            register_signal_handler(kick_signal(), kick_handler).map_err(VcpuError::SignalHandler);
    });
    result
}

/// A configured vCPU, not yet running.
pub struct Vcpu {
    pub id: u8,
    fd: VcpuFd,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    /// The MSRs a snapshot saves ([`saved_msr_indices`], read once per machine).
    msr_indices: Arc<Vec<u32>>,
}

impl Vcpu {
    pub fn new(
        id: u8,
        fd: VcpuFd,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        msr_indices: Arc<Vec<u32>>,
    ) -> Self {
        Vcpu {
            id,
            fd,
            io_bus,
            mmio_bus,
            msr_indices,
        }
    }

    fn setup_err(&self, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        let id = self.id;
        move |source| VcpuError::Setup { id, what, source }
    }

    /// CPUID, MSRs, FPU and local APIC: the state every vCPU needs. Returns the masks
    /// that KVM did not honour (the bit still reads back as set).
    pub fn configure(
        &self,
        supported_cpuid: &CpuId,
        topology: Topology,
        masks: &[CpuidMask],
    ) -> Result<Vec<CpuidMask>, VcpuError> {
        let mut cpuid = supported_cpuid.clone();
        cpuid::normalize(&mut cpuid, self.id, topology, masks);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(self.setup_err("set CPUID"))?;
        let effective = self
            .fd
            .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(self.setup_err("read CPUID back"))?;
        let ignored = masks
            .iter()
            .copied()
            .filter(|m| m.is_set_in(&effective))
            .collect();

        let msrs = msr::boot_msrs();
        let written = self
            .fd
            .set_msrs(&msrs)
            .map_err(self.setup_err("set MSRs"))?;
        if written != msrs.as_slice().len() {
            log::warn!(
                "vCPU {}: KVM accepted {written} of {} boot MSRs",
                self.id,
                msrs.as_slice().len()
            );
        }
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(self.setup_err("set FPU state"))?;

        // LINT0 delivers the PIC's ExtINT, LINT1 NMIs: what firmware leaves for Linux.
        let mut lapic = self.fd.get_lapic().map_err(self.setup_err("read LAPIC"))?;
        set_lvt_mode(&mut lapic.regs, LAPIC_LVT_LINT0, APIC_MODE_EXTINT);
        set_lvt_mode(&mut lapic.regs, LAPIC_LVT_LINT1, APIC_MODE_NMI);
        self.fd
            .set_lapic(&lapic)
            .map_err(self.setup_err("set LAPIC"))?;
        Ok(ignored)
    }

    /// Registers and segments of the boot vCPU. The others wait for INIT/SIPI from the
    /// guest, as on hardware (the in-kernel LAPIC keeps them in wait-for-SIPI).
    pub fn setup_boot_registers(
        &self,
        mem: &GuestMemoryMmap,
        entry: EntryPoint,
    ) -> Result<(), VcpuError> {
        let sregs = self
            .fd
            .get_sregs()
            .map_err(self.setup_err("read segment registers"))?;
        let sregs =
            regs::setup_boot_sregs(mem, entry, sregs).map_err(|source| VcpuError::BootRegs {
                id: self.id,
                source,
            })?;
        self.fd
            .set_sregs(&sregs)
            .map_err(self.setup_err("set segment registers"))?;
        self.fd
            .set_regs(&regs::boot_regs(entry))
            .map_err(self.setup_err("set registers"))?;
        Ok(())
    }

    /// The thread's life once it has its vCPU: wait to be resumed, run, report why it
    /// stopped.
    fn thread_main(mut self, control: &Control, reporter: Arc<StopReporter>) {
        // Published before any kick can be meant for KVM_RUN: a kick that lands before the
        // first entry still makes that entry return at once.
        let run_ptr: *mut kvm_run = self.fd.get_kvm_run();
        KVM_RUN_PTR.with(|ptr| ptr.set(run_ptr));
        let stop = if self.wait_while_paused(control) {
            self.run_loop(control)
        } else {
            None
        };
        KVM_RUN_PTR.with(|ptr| ptr.set(std::ptr::null_mut()));
        if let Some(stop) = stop {
            // The VMM may already be gone if it is shutting down; nothing to report then.
            let _ = reporter.reasons.send((self.id, stop));
            let _ = reporter.event.write(1);
        }
    }

    /// Runs the guest until the wish is Stop (returns None) or the guest stops (Some).
    fn run_loop(&mut self, control: &Control) -> Option<VcpuStop> {
        loop {
            // The wish is only looked at between runs; a kick makes KVM_RUN return.
            if control.attention.load(Ordering::SeqCst) && !self.wait_while_paused(control) {
                return None;
            }
            let outcome = self.run_once();
            control.runs.fetch_add(1, Ordering::SeqCst);
            match outcome {
                Ok(None) => {}
                Ok(Some(stop)) => return Some(stop),
                Err(error) => return Some(VcpuStop::Error(error)),
            }
        }
    }

    /// Acts on the wish: true once it is Run (at once if it is), false for Stop; while it
    /// is Pause, stays out of KVM_RUN and captures the vCPU's state on request.
    fn wait_while_paused(&self, control: &Control) -> bool {
        let mut shared = control.lock();
        loop {
            match shared.wish {
                Wish::Run => {
                    control.set_activity(&mut shared, Activity::Running);
                    return true;
                }
                Wish::Stop => return false,
                Wish::Pause => {
                    control.set_activity(&mut shared, Activity::Paused);
                    if std::mem::take(&mut shared.save_request) {
                        drop(shared);
                        let state = self.save();
                        shared = control.lock();
                        shared.saved = Some(state);
                        control.changed.notify_all();
                    } else {
                        shared = control.wait(shared);
                    }
                }
            }
        }
    }

    fn run_once(&mut self) -> Result<Option<VcpuStop>, VcpuError> {
        let id = self.id;
        let exit = self.fd.run();
        crate::metrics::METRICS.count_vcpu_exit(&exit);
        match exit {
            Ok(VcpuExit::IoOut(port, data)) => {
                if !self.io_bus.write(u64::from(port), data) {
                    log::trace!("vCPU {id}: write to unclaimed port {port:#x}");
                }
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.io_bus.read(u64::from(port), data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !self.mmio_bus.write(addr, data) {
                    log::debug!("vCPU {id}: write to unclaimed MMIO {addr:#x}");
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !self.mmio_bus.read(addr, data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::Shutdown) => return Ok(Some(VcpuStop::TripleFault)),
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                return Ok(Some(match kind {
                    KVM_SYSTEM_EVENT_RESET => VcpuStop::Reset,
                    KVM_SYSTEM_EVENT_SHUTDOWN => VcpuStop::PowerOff,
                    other => {
                        return Err(VcpuError::UnexpectedExit {
                            id,
                            exit: format!("system event {other}"),
                        })
                    }
                }));
            }
            Ok(VcpuExit::Hlt) => {
                // Only without an in-kernel LAPIC; with it KVM halts the vCPU itself.
                return Ok(Some(VcpuStop::PowerOff));
            }
            Ok(VcpuExit::InternalError) => return self.handle_internal_error().map(|()| None),
            Ok(VcpuExit::FailEntry(reason, _)) => return Err(VcpuError::FailEntry { id, reason }),
            Ok(VcpuExit::Intr) => {}
            Ok(other) => {
                return Err(VcpuError::UnexpectedExit {
                    id,
                    exit: format!("{other:?}"),
                })
            }
            Err(error) if error.errno() == libc::EINTR || error.errno() == libc::EAGAIN => {
                // Kicked: clear the flag the signal handler set, then look at requests.
                self.fd.set_kvm_immediate_exit(0);
            }
            Err(source) => return Err(VcpuError::Run { id, source }),
        }
        Ok(None)
    }

    /// Completes an instruction KVM's emulator could not, or reports it.
    fn handle_internal_error(&mut self) -> Result<(), VcpuError> {
        let id = self.id;
        let run = self.fd.get_kvm_run();
        // SAFETY: after KVM_EXIT_INTERNAL_ERROR the `internal` member is the active one.
        let internal = unsafe { run.__bindgen_anon_1.internal };
        if internal.suberror != INTERNAL_ERROR_EMULATION {
            return Err(VcpuError::Internal {
                id,
                suberror: internal.suberror,
            });
        }
        // data[0] is flags; the instruction length is the first byte of data[1] and the
        // bytes follow it (struct kvm_run.emulation_failure).
        let mut raw = [0u8; 16];
        for (index, word) in internal.data[1..3].iter().enumerate() {
            raw[index * 8..index * 8 + 8].copy_from_slice(&word.to_le_bytes());
        }
        let has_bytes = internal.ndata >= 2 && internal.data[0] & 1 == 1;
        let len = if has_bytes {
            usize::from(raw[0]).min(15)
        } else {
            0
        };
        let bytes = &raw[1..1 + len];
        let mut regs = self
            .fd
            .get_regs()
            .map_err(self.setup_err("read registers"))?;
        let Some(emulation) = emulate::decode(bytes) else {
            return Err(VcpuError::UnemulatedInstruction {
                id,
                rip: regs.rip,
                bytes: bytes
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            });
        };
        log::debug!(
            "vCPU {id}: completing {emulation:?} at {:#x} for KVM",
            regs.rip
        );
        let exception = emulate::apply(emulation, &mut regs);
        self.fd
            .set_regs(&regs)
            .map_err(self.setup_err("set registers"))?;
        if let Some(vector) = exception {
            let mut events = self
                .fd
                .get_vcpu_events()
                .map_err(self.setup_err("read vCPU events"))?;
            events.exception.injected = 1;
            events.exception.nr = vector;
            events.exception.has_error_code = 0;
            self.fd
                .set_vcpu_events(&events)
                .map_err(self.setup_err("inject exception"))?;
        }
        Ok(())
    }
}

fn set_lvt_mode(regs: &mut [std::os::raw::c_char; 1024], offset: usize, mode: u32) {
    let mut bytes = [0u8; 4];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = regs[offset + index] as u8;
    }
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (index, byte) in value.to_le_bytes().iter().enumerate() {
        regs[offset + index] = *byte as std::os::raw::c_char;
    }
}

/// What a started vCPU thread is waiting for: its vCPU and where to report stops.
type Launch = (Vcpu, Arc<StopReporter>);

/// A vCPU thread started before its vCPU is ready to run.
///
/// Installing a seccomp filter costs a few hundred microseconds per thread on the nested
/// hosts (the kernel translates and JITs the program), so the builders start the
/// threads as soon as the vCPUs exist: the filters go in while the VM is still being
/// set up (a restore validates files and loads state meanwhile) instead of between
/// "ready" and "running". The thread holds no vCPU until [`VcpuThread::launch`]; dropped
/// unlaunched, it ends.
pub struct VcpuThread {
    // Dropped first: an unlaunched thread waits on this channel, and the handle's drop
    // joins the thread.
    launch: Sender<Launch>,
    handle: VcpuHandle,
}

impl VcpuThread {
    /// Spawns the thread for vCPU `id`: it installs the vCPU filter, says it is ready,
    /// and waits for its vCPU.
    pub fn spawn(id: u8) -> Result<VcpuThread, VcpuError> {
        install_kick_handler()?;
        let control = Arc::new(Control::new());
        let thread_control = control.clone();
        let (launch_tx, launch_rx) = channel::<Launch>();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                let _ended = EndedOnDrop(thread_control.clone());
                // Filtered before anything else runs on this thread, guest code included.
                let filtered = crate::seccomp::apply(crate::seccomp::ThreadKind::Vcpu);
                let failed = filtered.is_err();
                {
                    let mut shared = thread_control.lock();
                    shared.ready = Some(filtered);
                    thread_control.changed.notify_all();
                }
                if failed {
                    return;
                }
                // The sender is dropped unlaunched when the machine is torn down first.
                if let Ok((vcpu, reporter)) = launch_rx.recv() {
                    vcpu.thread_main(&thread_control, reporter);
                }
            })
            .map_err(|source| VcpuError::Spawn { id, source })?;
        Ok(VcpuThread {
            launch: launch_tx,
            handle: VcpuHandle {
                id,
                thread: Some(thread),
                control,
                stall_cause: None,
            },
        })
    }

    /// The id of the vCPU this thread is for.
    pub fn id(&self) -> u8 {
        self.handle.id
    }

    /// Hands `vcpu` to the thread. It runs the guest after [`VcpuHandle::wait_ready`] and
    /// [`VcpuHandle::resume`].
    pub fn launch(self, vcpu: Vcpu, reporter: Arc<StopReporter>) -> Result<VcpuHandle, VcpuError> {
        if vcpu.id != self.handle.id {
            return Err(VcpuError::WrongThread {
                id: vcpu.id,
                thread: self.handle.id,
            });
        }
        // A thread whose filter failed has already ended; wait_ready reports why.
        let _ = self.launch.send((vcpu, reporter));
        Ok(self.handle)
    }
}

/// The VMM thread's handle on a running vCPU thread.
pub struct VcpuHandle {
    pub id: u8,
    thread: Option<JoinHandle<()>>,
    control: Arc<Control>,
    stall_cause: Option<&'static str>,
}

/// How long a running vCPU may take to leave KVM_RUN once kicked. It takes microseconds
/// (the kick interrupts KVM_RUN itself, emulated guest code included), so a vCPU that
/// takes longer is blocked in the kernel, waiting for guest memory nobody serves (a
/// stalled page-fault handler), and may never come back.
const STOP_RUNNING_LIMIT: Duration = Duration::from_secs(2);

/// How long a thread may take to do what needs no guest: install its seccomp filter (a
/// few hundred microseconds, much more on a loaded nested host), wake up to resume,
/// capture its state.
const ANSWER_LIMIT: Duration = Duration::from_secs(10);

impl VcpuHandle {
    /// Kicks a running vCPU out of KVM_RUN, unless it is stuck there: a kick it has not
    /// answered is still pending, and another would change nothing.
    fn kick(&self, shared: &mut Shared) {
        if shared.activity != Activity::Running || self.stuck_since(shared).is_some() {
            return;
        }
        if let Some(thread) = &self.thread {
            shared.kicked = Some(Kick {
                at: Instant::now(),
                runs: self.control.runs.load(Ordering::SeqCst),
            });
            // ESRCH once the thread has exited is fine: it is not in KVM_RUN.
            let _ = thread.kill(kick_signal());
        }
    }

    /// When the vCPU was kicked, if that was over [`STOP_RUNNING_LIMIT`] ago and it has
    /// not left KVM_RUN since: it waits in the kernel, maybe forever.
    fn stuck_since(&self, shared: &Shared) -> Option<Instant> {
        let kick = shared.kicked?;
        let still_in_run = shared.activity == Activity::Running
            && self.control.runs.load(Ordering::SeqCst) == kick.runs;
        (still_in_run && kick.at.elapsed() >= STOP_RUNNING_LIMIT).then_some(kick.at)
    }

    /// Whether the vCPU has returned from KVM_RUN since its last kick.
    fn left_run_since_kick(&self, shared: &Shared) -> bool {
        shared
            .kicked
            .is_some_and(|kick| self.control.runs.load(Ordering::SeqCst) != kick.runs)
    }

    /// Says what this vCPU waits for if it does not stop running when asked to (e.g.
    /// guest memory from an external page-fault handler), for the error that says so.
    pub fn set_stall_cause(&mut self, cause: &'static str) {
        self.stall_cause = Some(cause);
    }

    /// Waits until `done` holds, the thread has ended, or `limit` has passed; returns the
    /// shared state as it then is.
    fn wait_until(
        &self,
        limit: Duration,
        done: impl Fn(&Shared) -> bool,
    ) -> MutexGuard<'_, Shared> {
        let deadline = Instant::now() + limit;
        let mut shared = self.control.lock();
        while !done(&shared) && shared.activity != Activity::Ended {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            shared = self
                .control
                .changed
                .wait_timeout(shared, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        shared
    }

    fn not_stopping(&self, shared: &Shared) -> VcpuError {
        VcpuError::NotStopping {
            id: self.id,
            waited: shared
                .kicked
                .map_or(STOP_RUNNING_LIMIT, |kick| kick.at.elapsed()),
            cause: self.stall_cause,
        }
    }

    /// Waits until the new thread has installed its seccomp filter (it then waits for
    /// [`resume`](Self::resume)).
    pub fn wait_ready(&self) -> Result<(), VcpuError> {
        let mut shared = self.wait_until(ANSWER_LIMIT, |s| s.ready.is_some());
        match shared.ready.take() {
            Some(Ok(())) => {
                shared.ready = Some(Ok(()));
                Ok(())
            }
            Some(Err(source)) => Err(VcpuError::Seccomp {
                id: self.id,
                source,
            }),
            None if shared.activity == Activity::Ended => Err(VcpuError::Ended(self.id)),
            None => Err(VcpuError::NoResponse(self.id)),
        }
    }

    /// Pauses the vCPU and waits until it is out of KVM_RUN; at once if it is paused.
    pub fn pause(&self) -> Result<(), VcpuError> {
        self.request_pause();
        self.wait_paused()
    }

    /// Asks the vCPU to pause without waiting (to pause several vCPUs at once, then
    /// [`wait_paused`](Self::wait_paused) on each).
    pub fn request_pause(&self) {
        let mut shared = self.control.lock();
        self.control.set_wish(&mut shared, Wish::Pause);
        self.kick(&mut shared);
    }

    /// Waits for [`request_pause`](Self::request_pause) to take effect; a vCPU known to
    /// be stuck in KVM_RUN fails at once. If the vCPU does not leave KVM_RUN in time, the
    /// request is withdrawn: it runs on, and does not pause later behind the VMM's back.
    pub fn wait_paused(&self) -> Result<(), VcpuError> {
        let stuck = self.stuck_since(&self.control.lock()).is_some();
        let limit = if stuck {
            Duration::ZERO
        } else {
            STOP_RUNNING_LIMIT
        };
        let mut shared = self.wait_until(limit, |s| s.activity == Activity::Paused);
        if shared.activity == Activity::Running && self.left_run_since_kick(&shared) {
            // It is out of KVM_RUN, only slow to be scheduled on a loaded host: not stuck.
            drop(shared);
            shared = self.wait_until(ANSWER_LIMIT, |s| s.activity == Activity::Paused);
        }
        match shared.activity {
            Activity::Paused => Ok(()),
            Activity::Ended => Err(VcpuError::Ended(self.id)),
            // Not launched yet: it pauses first thing once it is.
            Activity::Starting => Err(VcpuError::NoResponse(self.id)),
            Activity::Running => {
                self.control.set_wish(&mut shared, Wish::Run);
                Err(self.not_stopping(&shared))
            }
        }
    }

    /// Resumes the vCPU; at once if it is running.
    pub fn resume(&self) -> Result<(), VcpuError> {
        self.request_resume();
        self.wait_resumed()
    }

    /// Asks the vCPU to run without waiting (to resume several vCPUs at once, then
    /// [`wait_resumed`](Self::wait_resumed) on each).
    pub fn request_resume(&self) {
        // No kick needed: a paused thread waits on the condition variable, not in KVM_RUN.
        let mut shared = self.control.lock();
        self.control.set_wish(&mut shared, Wish::Run);
    }

    /// Waits for [`request_resume`](Self::request_resume) to take effect.
    pub fn wait_resumed(&self) -> Result<(), VcpuError> {
        let shared = self.wait_until(ANSWER_LIMIT, |s| s.activity == Activity::Running);
        match shared.activity {
            Activity::Running => Ok(()),
            Activity::Ended => Err(VcpuError::Ended(self.id)),
            Activity::Starting | Activity::Paused => Err(VcpuError::NoResponse(self.id)),
        }
    }

    /// Captures the state of a paused vCPU.
    pub fn save_state(&self) -> Result<VcpuState, VcpuError> {
        {
            let mut shared = self.control.lock();
            if shared.wish != Wish::Pause || shared.activity != Activity::Paused {
                return Err(VcpuError::NotPaused(self.id));
            }
            shared.saved = None;
            shared.save_request = true;
            self.control.changed.notify_all();
        }
        let mut shared = self.wait_until(ANSWER_LIMIT, |s| s.saved.is_some());
        match shared.saved.take() {
            Some(state) => state.map_err(|source| VcpuError::SaveState(self.id, source)),
            None => {
                shared.save_request = false;
                Err(match shared.activity {
                    Activity::Ended => VcpuError::Ended(self.id),
                    _ => VcpuError::NoResponse(self.id),
                })
            }
        }
    }

    /// Asks the thread to end, without waiting (see [`join_by`](Self::join_by)).
    pub fn request_stop(&self) {
        let mut shared = self.control.lock();
        self.control.set_wish(&mut shared, Wish::Stop);
        self.kick(&mut shared);
    }

    /// Waits until the thread has ended. A thread still running the guest at `deadline`
    /// (at once if it is known to be stuck) is blocked in the kernel and may never come
    /// back (see [`STOP_RUNNING_LIMIT`]): it is left behind, to end with the process, and
    /// false is returned. True once the thread has ended (or was already joined).
    pub fn join_by(&mut self, deadline: Instant) -> bool {
        let Some(thread) = self.thread.take() else {
            return true;
        };
        let stuck = self.stuck_since(&self.control.lock()).is_some();
        let limit = if stuck {
            Duration::ZERO
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        let shared = self.wait_until(limit, |s| s.activity == Activity::Ended);
        if shared.activity != Activity::Ended {
            log::error!(
                "{}; leaving its thread behind, to end with the process",
                self.not_stopping(&shared)
            );
            // Dropping the handle detaches the thread.
            return false;
        }
        drop(shared);
        // It only has to return from its closure now.
        if thread.join().is_err() {
            log::error!("vCPU {} thread panicked", self.id);
        }
        true
    }

    /// Stops the thread and waits for it to end (or leaves it behind: see
    /// [`join_by`](Self::join_by)).
    pub fn stop_and_join(&mut self) -> bool {
        self.request_stop();
        self.join_by(Instant::now() + STOP_RUNNING_LIMIT)
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Pauses every vCPU, all asked at once, all or nothing: if one does not pause, the
/// others are resumed, so the VM runs on as it did, and the error says which and why.
pub fn pause_all(handles: &[VcpuHandle]) -> Result<(), VcpuError> {
    for handle in handles {
        handle.request_pause();
    }
    let Err(error) = handles.iter().try_for_each(VcpuHandle::wait_paused) else {
        return Ok(());
    };
    if let Err(undo) = resume_all(handles) {
        log::error!("cannot resume the vCPUs after a failed pause: {undo}");
    }
    Err(error)
}

/// Resumes every vCPU, all asked at once.
pub fn resume_all(handles: &[VcpuHandle]) -> Result<(), VcpuError> {
    for handle in handles {
        handle.request_resume();
    }
    handles.iter().try_for_each(VcpuHandle::wait_resumed)
}

/// Stops every vCPU thread, all asked at once, and joins them within one time limit;
/// threads that do not end by then are left behind (see [`VcpuHandle::join_by`]).
pub fn stop_all(handles: &mut [VcpuHandle]) {
    for handle in handles.iter() {
        handle.request_stop();
    }
    let deadline = Instant::now() + STOP_RUNNING_LIMIT;
    for handle in handles.iter_mut() {
        handle.join_by(deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lvt_mode_keeps_other_bits() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        regs[LAPIC_LVT_LINT0] = 0x30; // vector bits
        regs[LAPIC_LVT_LINT0 + 2] = 1; // mask bit 16
        set_lvt_mode(&mut regs, LAPIC_LVT_LINT0, APIC_MODE_EXTINT);
        let value = u32::from_le_bytes([
            regs[LAPIC_LVT_LINT0] as u8,
            regs[LAPIC_LVT_LINT0 + 1] as u8,
            regs[LAPIC_LVT_LINT0 + 2] as u8,
            regs[LAPIC_LVT_LINT0 + 3] as u8,
        ]);
        assert_eq!(value, 0x1_0730);
    }

    /// Runs `f` on another thread and fails the test if it does not return in time.
    fn within_seconds(seconds: u64, f: impl FnOnce() + Send + 'static) {
        let (done_tx, done_rx) = channel();
        std::thread::spawn(move || {
            f();
            let _ = done_tx.send(());
        });
        done_rx
            .recv_timeout(Duration::from_secs(seconds))
            .expect("did not finish in time (a vCPU thread was left waiting)");
    }

    #[test]
    fn an_unlaunched_vcpu_thread_ends_when_dropped() {
        within_seconds(10, || {
            let thread = VcpuThread::spawn(3).unwrap();
            assert_eq!(thread.id(), 3);
            // Ready arrives whether or not the vCPU ever comes.
            thread.handle.wait_ready().unwrap();
            drop(thread);
        });
    }

    #[test]
    fn a_vcpu_is_refused_by_another_vcpus_thread_and_runs_on_its_own() {
        within_seconds(10, || {
            let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
            let vm = kvm.create_vm().expect("create VM");
            let bus = || Arc::new(Bus::new());
            let vcpu = |id: u8| {
                let fd = vm.create_vcpu(u64::from(id)).unwrap();
                Vcpu::new(id, fd, bus(), bus(), Arc::new(Vec::new()))
            };
            let reporter = Arc::new(StopReporter {
                reasons: channel().0,
                event: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            });
            let err = VcpuThread::spawn(1)
                .unwrap()
                .launch(vcpu(0), reporter.clone())
                .err()
                .expect("vCPU 0 launched on vCPU 1's thread");
            assert!(
                matches!(err, VcpuError::WrongThread { id: 0, thread: 1 }),
                "{err}"
            );
            // The right thread takes it; it stays paused until resumed, and stops on request.
            let mut handle = VcpuThread::spawn(1)
                .unwrap()
                .launch(vcpu(1), reporter)
                .unwrap();
            handle.wait_ready().unwrap();
            handle.pause().unwrap();
            assert!(handle.stop_and_join());
        });
    }

    /// A VM whose one vCPU runs `jmp $` in long mode, so that it never leaves KVM_RUN
    /// unless kicked (as a guest's AP running ring-3 code does).
    struct SpinningGuest {
        handle: VcpuHandle,
        // Guest RAM: dropped only once the vCPU thread has ended.
        ram: GuestMemoryMmap,
        _vm: kvm_ioctls::VmFd,
    }

    const RAM_SIZE: usize = 0x10000;
    const CODE: u64 = 0x1000;

    impl SpinningGuest {
        /// `prepare` gets guest RAM's host address once the code and page tables are in.
        fn start(prepare: impl FnOnce(u64, u64)) -> SpinningGuest {
            use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
            let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
            let vm = kvm.create_vm().expect("create VM");
            // The vCPU state a snapshot saves includes the in-kernel LAPIC.
            vm.create_irq_chip().expect("in-kernel irqchip");
            let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM_SIZE)]).unwrap();
            let host = ram.get_host_address(GuestAddress(0)).unwrap() as u64;
            let region = kvm_bindings::kvm_userspace_memory_region {
                slot: 0,
                flags: 0,
                guest_phys_addr: 0,
                memory_size: RAM_SIZE as u64,
                userspace_addr: host,
            };
            // SAFETY: the mapping outlives the VM's use of it (see `ram`).
            unsafe { vm.set_user_memory_region(region) }.expect("memory slot");
            let fd = vm.create_vcpu(0).expect("create vCPU");
            let entry = EntryPoint::Linux64 { entry: CODE };
            let sregs = regs::setup_boot_sregs(&ram, entry, fd.get_sregs().unwrap()).unwrap();
            fd.set_sregs(&sregs).unwrap();
            fd.set_regs(&regs::boot_regs(entry)).unwrap();
            ram.write_slice(&[0xeb, 0xfe], GuestAddress(CODE)).unwrap(); // jmp $
            prepare(host, RAM_SIZE as u64);
            let bus = || Arc::new(Bus::new());
            let reporter = Arc::new(StopReporter {
                reasons: channel().0,
                event: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            });
            let handle = VcpuThread::spawn(0)
                .unwrap()
                .launch(
                    Vcpu::new(0, fd, bus(), bus(), Arc::new(Vec::new())),
                    reporter,
                )
                .unwrap();
            handle.wait_ready().unwrap();
            SpinningGuest {
                handle,
                ram,
                _vm: vm,
            }
        }

        fn wait_ended(&self) {
            let shared = self
                .handle
                .wait_until(ANSWER_LIMIT, |s| s.activity == Activity::Ended);
            assert_eq!(shared.activity, Activity::Ended);
        }
    }

    impl Drop for SpinningGuest {
        fn drop(&mut self) {
            self.handle.stop_and_join();
            // Guest RAM goes only after the thread.
            self.wait_ended();
            let _ = &self.ram;
        }
    }

    /// Runs `f`, asserting that it returns within `limit`.
    fn returns_within<T>(what: &str, limit: Duration, f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let result = f();
        assert!(
            started.elapsed() < limit,
            "{what} took {:?}",
            started.elapsed()
        );
        result
    }

    /// Asserts that `f` succeeds within `limit`.
    fn at_once(what: &str, limit: Duration, f: impl FnOnce() -> Result<(), VcpuError>) {
        returns_within(what, limit, f).unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    #[test]
    fn pause_and_resume_are_idempotent_on_a_vcpu_that_never_exits() {
        within_seconds(30, || {
            let guest = SpinningGuest::start(|_, _| {});
            let handle = &guest.handle;
            let quick = Duration::from_millis(500);
            at_once("resume", ANSWER_LIMIT, || handle.resume());
            // Redundant: nothing to do, and nothing left over for later requests.
            at_once("a second resume", quick, || handle.resume());
            assert!(matches!(handle.save_state(), Err(VcpuError::NotPaused(0))));
            at_once("pause", quick, || handle.pause());
            at_once("a second pause", quick, || handle.pause());
            handle.save_state().expect("state of a paused vCPU");
            at_once("resume", quick, || handle.resume());
            at_once("pause", quick, || handle.pause());
            at_once("resume", quick, || handle.resume());
        });
    }

    #[test]
    fn a_vcpu_waiting_for_guest_memory_fails_a_pause_and_is_left_behind_by_a_stop() {
        within_seconds(30, || {
            let uffd = gpuvm_memory::uffd::create_uffd().expect("userfaultfd");
            let mut guest = SpinningGuest::start(|host, len| {
                // Every page missing, the page tables too: the vCPU's first instruction
                // fetch walks them from the kernel, which waits for the userfaultfd with
                // only fatal signals able to interrupt it.
                // SAFETY: guest RAM, private anonymous memory nobody else uses yet.
                let ret = unsafe {
                    libc::madvise(host as *mut libc::c_void, len as usize, libc::MADV_DONTNEED)
                };
                assert_eq!(ret, 0);
                gpuvm_memory::uffd::register_ranges(&uffd, &[(host, len)], 4096)
                    .expect("register guest RAM");
            });
            guest.handle.set_stall_cause("a page nobody serves");
            // Its first instruction fetch waits for a page that nobody serves.
            guest.handle.resume().unwrap();
            // Its fault reached the userfaultfd: it waits for a page now.
            let deadline = Instant::now() + ANSWER_LIMIT;
            while !matches!(uffd.read_event(), Ok(Some(_))) {
                assert!(Instant::now() < deadline, "the vCPU never faulted");
                std::thread::sleep(Duration::from_millis(1));
            }
            let quick = Duration::from_millis(500);
            let pause_fails = |what, limit| {
                let error = returns_within(what, limit, || guest.handle.pause())
                    .expect_err("paused while waiting for memory");
                assert!(
                    error.to_string().contains("a page nobody serves"),
                    "{error}"
                );
                error
            };
            let error = pause_fails("the pause", STOP_RUNNING_LIMIT + Duration::from_secs(1));
            assert!(
                matches!(error, VcpuError::NotStopping { id: 0, .. }),
                "{error}"
            );
            // Known to be stuck now: another pause fails at once, without another kick.
            pause_fails("a second pause", quick);
            // The pause was withdrawn; a resume has nothing to wait for.
            at_once("resume", quick, || guest.handle.resume());
            let joined = returns_within("the stop", quick, || guest.handle.stop_and_join());
            assert!(!joined, "a stuck vCPU thread was joined");
            // Closing the userfaultfd drops the registration: the fault is served with a
            // zero page (the guest then triple-faults), and the thread left behind ends.
            drop(uffd);
            guest.wait_ended();
        });
    }
}
