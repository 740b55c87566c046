//! The vCPU thread: started early to install its seccomp filter, then handed its vCPU;
//! it waits to be resumed, runs the guest and dispatches each exit to the device buses.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use gpuvm_arch::x86_64::emulate;
use gpuvm_devices::Persist;
use kvm_bindings::{kvm_run, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::VcpuExit;

use super::control::{Activity, Control, EndedOnDrop, VcpuHandle, Wish};
use super::kick::{install_kick_handler, KVM_RUN_PTR};
use super::{StopReporter, Vcpu, VcpuError, VcpuStop};

/// KVM_INTERNAL_ERROR_EMULATION: the instruction emulator gave up.
const INTERNAL_ERROR_EMULATION: u32 = 1;

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
    pub(super) handle: VcpuHandle,
}

/// Whether vCPU threads take Firecracker's names (see [`name_threads_as_firecracker`]).
static FIRECRACKER_NAMES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Names vCPU threads `fc_vcpu <N>`, as Firecracker does, instead of `vcpu<N>` (Cloud
/// Hypervisor's names). Orchestrators find vCPU threads by name to put them in cgroups:
/// Kata's Firecracker driver looks for `fc_vcpu <N>`, its Cloud Hypervisor driver for
/// `vcpu<N>`. The Firecracker front end calls this before any vCPU exists.
pub fn name_threads_as_firecracker() {
    FIRECRACKER_NAMES.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// The name of a thread started for a vCPU that hot-plug may add: not `vcpu<N>` (nor
/// Firecracker's `fc_vcpu <N>`) until it has its vCPU, so that orchestrators counting vCPU
/// threads by name (Kata's GetThreadIDs) see only the vCPUs the guest has.
fn spare_thread_name(id: u8) -> String {
    format!("spare-vcpu{id}")
}

/// Renames the calling thread (PR_SET_NAME, which every filter allows).
fn set_own_name(name: &str) {
    let Ok(name) = std::ffi::CString::new(name) else {
        return;
    };
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes (the kernel
    // truncates longer ones) from a pointer that stays valid for the call.
    let renamed = unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) };
    if renamed != 0 {
        log::debug!(
            "cannot rename the vCPU thread: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn thread_name(id: u8) -> String {
    if FIRECRACKER_NAMES.load(std::sync::atomic::Ordering::Relaxed) {
        format!("fc_vcpu {id}")
    } else {
        format!("vcpu{id}")
    }
}

impl VcpuThread {
    /// Spawns the thread for vCPU `id`: it pins itself to host CPUs `pin_to` (if given:
    /// its NUMA node's), installs the vCPU filter, says it is ready, and waits for its vCPU.
    pub fn spawn(id: u8, pin_to: Option<Vec<usize>>) -> Result<VcpuThread, VcpuError> {
        Self::spawn_named(id, false, pin_to)
    }

    /// As [`VcpuThread::spawn`], for a vCPU that hot-plug may add later: the thread is
    /// named `spare-vcpu<N>` until it is handed its vCPU, then takes the vCPU's name.
    pub fn spawn_spare(id: u8, pin_to: Option<Vec<usize>>) -> Result<VcpuThread, VcpuError> {
        Self::spawn_named(id, true, pin_to)
    }

    fn spawn_named(
        id: u8,
        spare: bool,
        pin_to: Option<Vec<usize>>,
    ) -> Result<VcpuThread, VcpuError> {
        install_kick_handler()?;
        let name = if spare {
            spare_thread_name(id)
        } else {
            thread_name(id)
        };
        let control = Arc::new(Control::new());
        let thread_control = control.clone();
        let (launch_tx, launch_rx) = channel::<Launch>();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let _ended = EndedOnDrop(thread_control.clone());
                // Pinned to its NUMA node's host CPUs (if asked) while sched_setaffinity
                // is still allowed.
                if let Some(cpus) = &pin_to {
                    crate::numa::pin_current_vcpu_thread(id, cpus);
                }
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
                    if spare {
                        set_own_name(&thread_name(id));
                    }
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

impl Vcpu {
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
            Ok(VcpuExit::Shutdown) => {
                self.log_triple_fault_state();
                return Ok(Some(VcpuStop::TripleFault));
            }
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

    /// Where the guest was when it triple-faulted, for the log: the registers a guest
    /// kernel's developer (or a map of its symbols) needs to find the fault. The run ends
    /// either way; a register that cannot be read is left out.
    fn log_triple_fault_state(&self) {
        let id = self.id;
        let (regs, sregs) = (self.fd.get_regs(), self.fd.get_sregs());
        // KVM on AMD resets the vCPU at a shutdown intercept (the VMCB is undefined after
        // one): what is read then is the reset state, not where the guest was.
        let reset = matches!(
            (&regs, &sregs),
            (Ok(r), Ok(s)) if r.rip == 0xfff0 && s.cs.base == 0xffff_0000
        );
        let regs = regs.map(|r| {
            format!(
                "rip {:#x} rsp {:#x} rflags {:#x} rax {:#x} rdi {:#x}",
                r.rip, r.rsp, r.rflags, r.rax, r.rdi
            )
        });
        let sregs = sregs.map(|s| {
            format!(
                "cr0 {:#x} cr2 {:#x} cr3 {:#x} cr4 {:#x} efer {:#x} cs {:#x} (base {:#x}) idt {:#x}+{:#x}",
                s.cr0, s.cr2, s.cr3, s.cr4, s.efer, s.cs.selector, s.cs.base, s.idt.base, s.idt.limit
            )
        });
        let events = self.fd.get_vcpu_events().map(|e| {
            format!(
                "exception {} (injected {}, pending {}, error code {:#x})",
                e.exception.nr, e.exception.injected, e.exception.pending, e.exception.error_code
            )
        });
        let part = |read: Result<String, kvm_ioctls::Error>| {
            read.unwrap_or_else(|error| format!("(unreadable: {error})"))
        };
        log::error!(
            "vCPU {id} at the triple fault: {}; {}; {}{}",
            part(regs),
            part(sregs),
            part(events),
            if reset {
                " (KVM reset the vCPU at the shutdown, as it does on AMD hosts: the registers \
                 are the reset state's; the exception is the last one KVM recorded)"
            } else {
                ""
            }
        );
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
