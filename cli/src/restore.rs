//! `gpuvm restore`: rebuilds a VM from a snapshot directory and runs it.

use std::process::ExitCode;
use std::time::Instant;

use gpuvm_vmm::snapshot::RestoreMode;

use crate::args::{snapshot_policy, Mode, RestoreArgs};
use crate::report::{finish, RestoredAt};
use crate::{jail, CliError};

/// Restores the snapshot and runs it until the guest ends.
pub fn restore(args: RestoreArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    args.seccomp.enable()?;
    let mode = match args.restore_mode {
        Mode::Eager => RestoreMode::Eager,
        Mode::Lazy => RestoreMode::Lazy,
        // clap makes --uffd-socket required in this mode.
        Mode::External => RestoreMode::External(args.uffd_socket.clone().unwrap_or_default()),
    };
    crate::args::set_snapshot_pause(&args.snapshot_args);
    let restore_called = Instant::now();
    let (mut machine, timings) =
        gpuvm_vmm::builder::restore(&args.snapshot, &mode, Box::new(std::io::stdout()))?;
    if let Some(policy) = snapshot_policy(&args.snapshot_args) {
        machine.set_snapshot_policy(policy);
    }
    if args.record_working_set {
        machine.record_working_set();
    }
    jail::enter(&args.jail)?;
    if args.report.report_timing {
        eprintln!(
            "gpuvm: restore mode={:?} validate_us={} memory_us={} ready_us={}",
            args.restore_mode,
            timings.validate.as_micros(),
            timings.memory.as_micros(),
            timings.total_to_ready.as_micros()
        );
    }
    let restored = RestoredAt {
        timings,
        called: restore_called,
        returned: Instant::now(),
    };
    finish(
        machine,
        &args.report,
        process_start,
        Some((args.restore_mode, restored)),
    )
}
