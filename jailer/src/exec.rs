//! The jailer's ends: no inherited descriptor reaches the jail (its first step), and its
//! last, dropping to `--uid`/`--gid` and exec of the exec file with Firecracker's jailer's
//! arguments, which tell the VMM when the jailer started and what CPU time it took.

use std::convert::Infallible;
use std::ffi::OsStr;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::Path;

use crate::args::JailerArgs;
use crate::privileges::drop_privileges;
use crate::JailerError;

/// When the jailer started, on the monotonic clock and on its own CPU clock.
pub(crate) struct StartTimes {
    wall_us: u64,
    cpu_us: u64,
}

impl StartTimes {
    pub(crate) fn now() -> Self {
        let wall_us = clock_us(libc::CLOCK_MONOTONIC);
        let cpu_us = clock_us(libc::CLOCK_PROCESS_CPUTIME_ID);
        StartTimes { wall_us, cpu_us }
    }
}

/// Microseconds on `clock`.
fn clock_us(clock: libc::clockid_t) -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes one timespec into `now`, which outlives the call.
    unsafe { libc::clock_gettime(clock, &mut now) };
    (now.tv_sec as u64) * 1_000_000 + (now.tv_nsec as u64) / 1_000
}

/// Closes every inherited descriptor but stdin, stdout and stderr, so none leaks into the
/// jail (the jailer's first step).
pub(crate) fn close_inherited_fds() -> Result<(), JailerError> {
    // SAFETY: close_range(2) closes descriptors; nothing in this process holds one above 2
    // yet (this runs first).
    let result = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if result < 0 {
        return Err(JailerError::Syscall(
            "close inherited file descriptors",
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Drops to `--uid`/`--gid` and execs `/<exec_name> --id <id> --start-time-us ...
/// --start-time-cpu-us ... --parent-cpu-time-us ... <args after -->` with an empty
/// environment (nothing of the caller's reaches the VMM); returns only on failure.
pub(crate) fn exec(
    args: &JailerArgs,
    exec_name: &OsStr,
    start: &StartTimes,
) -> Result<Infallible, JailerError> {
    drop_privileges(args.uid, args.gid)?;
    let program = Path::new("/").join(exec_name);
    let parent_cpu_us = clock_us(libc::CLOCK_PROCESS_CPUTIME_ID).saturating_sub(start.cpu_us);
    let error = std::process::Command::new(&program)
        .arg("--id")
        .arg(&args.id)
        .arg("--start-time-us")
        .arg(start.wall_us.to_string())
        .arg("--start-time-cpu-us")
        .arg(clock_us(libc::CLOCK_PROCESS_CPUTIME_ID).to_string())
        .arg("--parent-cpu-time-us")
        .arg(parent_cpu_us.to_string())
        .args(&args.extra)
        .env_clear()
        .exec();
    Err(JailerError::Exec(program, error))
}
