//! vCPUs: one thread each, running KVM_RUN and dispatching exits to the device buses.
//!
//! The VMM thread talks to a vCPU thread through a [`VcpuHandle`]: it sends a request
//! and kicks the thread out of KVM_RUN with a signal. The signal handler sets
//! `kvm_run.immediate_exit`, so a kick that lands just before the thread re-enters
//! KVM_RUN is not lost (KVM_RUN returns EINTR at once).

use std::cell::Cell;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use gpuvm_devices::Bus;
use kvm_bindings::{kvm_run, CpuId, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::persist::{self, PersistError, VcpuState};
use crate::x86_64::cpuid::{self, CpuidMask, Topology};
use crate::x86_64::emulate;
use crate::x86_64::msr;
use crate::x86_64::regs::{self, EntryPoint};

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
    #[error("vCPU {0} answered unexpectedly: {1}")]
    UnexpectedResponse(u8, String),
    #[error("vCPU {id} was handed to the thread started for vCPU {thread}")]
    WrongThread { id: u8, thread: u8 },
    #[error("vCPU {0}: cannot save its state: {1}")]
    SaveState(u8, PersistError),
    #[error("vCPU {id}: {source}")]
    Seccomp {
        id: u8,
        source: crate::seccomp::SeccompError,
    },
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

/// Requests from the VMM thread.
#[derive(Debug)]
pub enum VcpuRequest {
    Pause,
    Resume,
    Stop,
    /// Capture the vCPU's state (only honoured while paused); the MSR indices to save.
    SaveState(Arc<Vec<u32>>),
}

/// Answers to requests.
#[derive(Debug)]
pub enum VcpuResponse {
    /// The thread is up, its seccomp filter installed (or the reason it could not be);
    /// it waits for Resume before it runs the guest.
    Ready(Result<(), crate::seccomp::SeccompError>),
    Paused,
    Resumed,
    State(Box<Result<VcpuState, PersistError>>),
    /// SaveState arrived while the vCPU was running.
    NotPaused,
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
}

impl Vcpu {
    pub fn new(id: u8, fd: VcpuFd, io_bus: Arc<Bus>, mmio_bus: Arc<Bus>) -> Self {
        Vcpu {
            id,
            fd,
            io_bus,
            mmio_bus,
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

    /// Loads state saved by a snapshot into this (not yet started) vCPU.
    pub fn restore_state(&self, state: &VcpuState) -> Result<(), PersistError> {
        persist::restore_vcpu(&self.fd, state)
    }

    /// The thread's life once it has its vCPU: wait for Resume, run, report why it stopped.
    fn thread_main(
        mut self,
        requests: Receiver<VcpuRequest>,
        responses: Sender<VcpuResponse>,
        reporter: Arc<StopReporter>,
    ) {
        if !self.wait_while_paused(&requests, &responses) {
            return;
        }
        let run_ptr: *mut kvm_run = self.fd.get_kvm_run();
        KVM_RUN_PTR.with(|ptr| ptr.set(run_ptr));
        let stop = self.run_loop(&requests, &responses);
        KVM_RUN_PTR.with(|ptr| ptr.set(std::ptr::null_mut()));
        if let Some(stop) = stop {
            // The VMM may already be gone if it is shutting down; nothing to report then.
            let _ = reporter.reasons.send((self.id, stop));
            let _ = reporter.event.write(1);
        }
    }

    /// Runs the guest until a Stop request (returns None) or the guest stops (Some).
    fn run_loop(
        &mut self,
        requests: &Receiver<VcpuRequest>,
        responses: &Sender<VcpuResponse>,
    ) -> Option<VcpuStop> {
        loop {
            // Requests are only looked at between runs; a kick makes KVM_RUN return.
            while let Ok(request) = requests.try_recv() {
                match request {
                    VcpuRequest::Stop => return None,
                    VcpuRequest::Pause => {
                        let _ = responses.send(VcpuResponse::Paused);
                        if !self.wait_while_paused(requests, responses) {
                            return None;
                        }
                    }
                    VcpuRequest::Resume => {
                        let _ = responses.send(VcpuResponse::Resumed);
                    }
                    VcpuRequest::SaveState(_) => {
                        let _ = responses.send(VcpuResponse::NotPaused);
                    }
                }
            }
            match self.run_once() {
                Ok(None) => {}
                Ok(Some(stop)) => return Some(stop),
                Err(error) => return Some(VcpuStop::Error(error)),
            }
        }
    }

    /// Blocks until Resume (true) or Stop (false), answering state requests meanwhile.
    fn wait_while_paused(
        &self,
        requests: &Receiver<VcpuRequest>,
        responses: &Sender<VcpuResponse>,
    ) -> bool {
        loop {
            match requests.recv() {
                Ok(VcpuRequest::Resume) => {
                    let _ = responses.send(VcpuResponse::Resumed);
                    return true;
                }
                Ok(VcpuRequest::Pause) => {
                    let _ = responses.send(VcpuResponse::Paused);
                }
                Ok(VcpuRequest::SaveState(msr_indices)) => {
                    let state = persist::save_vcpu(&self.fd, self.id, &msr_indices);
                    let _ = responses.send(VcpuResponse::State(Box::new(state)));
                }
                Ok(VcpuRequest::Stop) | Err(_) => return false,
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
    /// Spawns the thread for vCPU `id`: it installs the vCPU filter, reports Ready, and
    /// waits for its vCPU.
    pub fn spawn(id: u8) -> Result<VcpuThread, VcpuError> {
        install_kick_handler()?;
        let (request_tx, request_rx) = channel();
        let (response_tx, response_rx) = channel();
        let (launch_tx, launch_rx) = channel::<Launch>();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                // Filtered before anything else runs on this thread, guest code included.
                let filtered = crate::seccomp::apply(crate::seccomp::ThreadKind::Vcpu);
                let failed = filtered.is_err();
                let _ = response_tx.send(VcpuResponse::Ready(filtered));
                if failed {
                    return;
                }
                // The sender is dropped unlaunched when the machine is torn down first.
                if let Ok((vcpu, reporter)) = launch_rx.recv() {
                    vcpu.thread_main(request_rx, response_tx, reporter);
                }
            })
            .map_err(|source| VcpuError::Spawn { id, source })?;
        Ok(VcpuThread {
            launch: launch_tx,
            handle: VcpuHandle {
                id,
                thread: Some(thread),
                requests: request_tx,
                responses: response_rx,
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
    requests: Sender<VcpuRequest>,
    responses: Receiver<VcpuResponse>,
}

/// How long a vCPU may take to acknowledge a request (ring-0 guest code can be slow to
/// reach an exit on emulating hosts, but a kick interrupts KVM_RUN itself).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

impl VcpuHandle {
    fn kick(&self) {
        if let Some(thread) = &self.thread {
            // ESRCH once the thread has exited is fine: it is not in KVM_RUN.
            let _ = thread.kill(kick_signal());
        }
    }

    /// Sends a request and interrupts KVM_RUN so the thread sees it.
    pub fn send(&self, request: VcpuRequest) {
        let _ = self.requests.send(request);
        self.kick();
    }

    /// Waits for the answer to a request sent with [`send`](Self::send).
    pub fn wait_response(&self) -> Result<VcpuResponse, VcpuError> {
        match self.responses.recv_timeout(RESPONSE_TIMEOUT) {
            Ok(response) => Ok(response),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                Err(VcpuError::NoResponse(self.id))
            }
        }
    }

    /// Waits until the new thread has installed its seccomp filter (it then waits for
    /// [`resume`](Self::resume)).
    pub fn wait_ready(&self) -> Result<(), VcpuError> {
        match self.wait_response()? {
            VcpuResponse::Ready(Ok(())) => Ok(()),
            VcpuResponse::Ready(Err(source)) => Err(VcpuError::Seccomp {
                id: self.id,
                source,
            }),
            other => Err(VcpuError::UnexpectedResponse(self.id, format!("{other:?}"))),
        }
    }

    /// Pauses the vCPU and waits until it is out of KVM_RUN.
    pub fn pause(&self) -> Result<(), VcpuError> {
        self.send(VcpuRequest::Pause);
        match self.wait_response()? {
            VcpuResponse::Paused => Ok(()),
            other => Err(VcpuError::UnexpectedResponse(self.id, format!("{other:?}"))),
        }
    }

    pub fn resume(&self) -> Result<(), VcpuError> {
        self.request_resume();
        self.wait_resumed()
    }

    /// Sends Resume without waiting for the answer (to resume several vCPUs at once,
    /// then [`wait_resumed`](Self::wait_resumed) on each).
    pub fn request_resume(&self) {
        // No kick needed: a paused thread is blocked on the request channel, not in KVM_RUN.
        let _ = self.requests.send(VcpuRequest::Resume);
    }

    /// Waits for the answer to [`request_resume`](Self::request_resume).
    pub fn wait_resumed(&self) -> Result<(), VcpuError> {
        match self.wait_response()? {
            VcpuResponse::Resumed => Ok(()),
            other => Err(VcpuError::UnexpectedResponse(self.id, format!("{other:?}"))),
        }
    }

    /// Captures the state of a paused vCPU.
    pub fn save_state(&self, msr_indices: Arc<Vec<u32>>) -> Result<VcpuState, VcpuError> {
        let _ = self.requests.send(VcpuRequest::SaveState(msr_indices));
        match self.wait_response()? {
            VcpuResponse::State(state) => {
                (*state).map_err(|source| VcpuError::SaveState(self.id, source))
            }
            other => Err(VcpuError::UnexpectedResponse(self.id, format!("{other:?}"))),
        }
    }

    /// Stops the thread and waits for it to end.
    pub fn stop_and_join(&mut self) {
        self.send(VcpuRequest::Stop);
        if let Some(thread) = self.thread.take() {
            // Keep kicking until it leaves KVM_RUN: a single signal can race with entry.
            while !thread.is_finished() {
                let _ = thread.kill(kick_signal());
                std::thread::sleep(Duration::from_millis(1));
            }
            if thread.join().is_err() {
                log::error!("vCPU {} thread panicked", self.id);
            }
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop_and_join();
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
            let vcpu = |id: u8| Vcpu::new(id, vm.create_vcpu(u64::from(id)).unwrap(), bus(), bus());
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
            handle.stop_and_join();
        });
    }
}
