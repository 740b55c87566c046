//! The kick signal: it makes a vCPU thread leave KVM_RUN (or not enter it) at once.

use std::cell::Cell;
use std::sync::Once;

use kvm_bindings::kvm_run;
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use super::VcpuError;

thread_local! {
    // This thread's kvm_run mapping, for the kick signal handler.
    pub(super) static KVM_RUN_PTR: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
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

pub(super) fn kick_signal() -> i32 {
    SIGRTMIN()
}

pub(super) fn install_kick_handler() -> Result<(), VcpuError> {
    static INSTALL: Once = Once::new();
    let mut result = Ok(());
    INSTALL.call_once(|| {
        result =
            register_signal_handler(kick_signal(), kick_handler).map_err(VcpuError::SignalHandler);
    });
    result
}
