//! The pause/resume/stop protocol: what the VMM thread and a vCPU thread share, the
//! [`VcpuHandle`] that steers one thread through it, and the all-vCPU forms.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::signal::Killable;

use super::kick::kick_signal;
use super::{VcpuError, VcpuState};
use crate::persist::PersistError;
use crate::seccomp::SeccompError;

/// What the VMM thread wants a vCPU thread to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wish {
    Run,
    Pause,
    Stop,
}

/// What a vCPU thread is doing, as it last said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Activity {
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
pub(super) struct Shared {
    pub(super) wish: Wish,
    pub(super) activity: Activity,
    /// How installing the thread's seccomp filter went, once it has.
    pub(super) ready: Option<Result<(), SeccompError>>,
    /// A state capture asked of the paused thread...
    pub(super) save_request: bool,
    /// ...and its result.
    pub(super) saved: Option<Result<VcpuState, PersistError>>,
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
pub(super) struct Control {
    shared: Mutex<Shared>,
    pub(super) changed: Condvar,
    /// Whether the wish is anything but Run, for the running thread to read between
    /// KVM_RUN calls without taking the lock (written only under it).
    pub(super) attention: AtomicBool,
    /// KVM_RUN calls the thread has returned from: one that has not returned since a
    /// kick long ago waits in the kernel (see [`STOP_RUNNING_LIMIT`]).
    pub(super) runs: AtomicU64,
}

impl Control {
    pub(super) fn new() -> Control {
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

    pub(super) fn lock(&self) -> MutexGuard<'_, Shared> {
        crate::lock(&self.shared)
    }

    pub(super) fn wait<'a>(&self, shared: MutexGuard<'a, Shared>) -> MutexGuard<'a, Shared> {
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

    pub(super) fn set_activity(&self, shared: &mut Shared, activity: Activity) {
        if shared.activity != activity {
            shared.activity = activity;
            self.changed.notify_all();
        }
    }
}

/// Marks the thread Ended however it ends (a panic included), so nobody waits for it.
pub(super) struct EndedOnDrop(pub(super) Arc<Control>);

impl Drop for EndedOnDrop {
    fn drop(&mut self) {
        let mut shared = self.0.lock();
        self.0.set_activity(&mut shared, Activity::Ended);
    }
}

/// The VMM thread's handle on a running vCPU thread.
pub struct VcpuHandle {
    pub id: u8,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) control: Arc<Control>,
    pub(super) stall_cause: Option<&'static str>,
}

/// How long a running vCPU may take to leave KVM_RUN once kicked. It takes microseconds
/// (the kick interrupts KVM_RUN itself, emulated guest code included), so a vCPU that
/// takes longer is blocked in the kernel, waiting for guest memory nobody serves (a
/// stalled page-fault handler), and may never come back.
pub(super) const STOP_RUNNING_LIMIT: Duration = Duration::from_secs(2);

/// How long a thread may take to do what needs no guest: install its seccomp filter (a
/// few hundred microseconds, much more on a loaded nested host), wake up to resume,
/// capture its state.
pub(super) const ANSWER_LIMIT: Duration = Duration::from_secs(10);

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
    pub(super) fn wait_until(
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
