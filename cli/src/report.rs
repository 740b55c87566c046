//! Running a built or restored machine to its end, and the `--report-timing` and
//! `--report-memory` figures printed then.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpuvm_vmm::Machine;

use crate::args::{Mode, ReportArgs};
use crate::{CliError, LOG_TARGET};

/// A restore's timings and when it was called and returned, for `--report-timing`.
pub struct RestoredAt {
    pub timings: gpuvm_vmm::snapshot::RestoreTimings,
    pub called: Instant,
    pub returned: Instant,
}

/// A `gpuvm: <label>` line of every stage from process start to vCPUs running, back to
/// back, in microseconds: `process` (exec to the build's call), the builder's `stages`,
/// `other` (between the builder's last stage and its return), `start_vcpus` (from its
/// return to the vCPU threads running); `total_us` is their sum; `parallel_*` ran on
/// another thread meanwhile and are not in the sum.
fn stages_line(
    label: &str,
    (called, stages, returned): (Instant, &[(&str, Duration)], Instant),
    parallel: &[(&str, Duration)],
    process_start: Instant,
    running: Instant,
) -> String {
    let mut all = vec![("process", called.duration_since(process_start))];
    all.extend(stages.iter().copied());
    let builder_sum: Duration = stages.iter().map(|&(_, d)| d).sum();
    let builder_wall = returned.duration_since(called);
    all.push(("other", builder_wall.saturating_sub(builder_sum)));
    all.push(("start_vcpus", running.duration_since(returned)));
    let total: Duration = all.iter().map(|&(_, d)| d).sum();
    let mut line = format!("gpuvm: {label}");
    for (name, d) in &all {
        line.push_str(&format!(" {name}_us={}", d.as_micros()));
    }
    line.push_str(&format!(" total_us={}", total.as_micros()));
    for (name, d) in parallel {
        line.push_str(&format!(" parallel_{name}_us={}", d.as_micros()));
    }
    line
}

/// Runs the machine to its end and prints the requested reports.
pub fn finish(
    mut machine: Machine,
    report: &ReportArgs,
    process_start: Instant,
    restore: Option<(Mode, RestoredAt)>,
) -> Result<ExitCode, CliError> {
    let (restore_mode, restored) = match restore {
        Some((mode, restored)) => (Some(mode), Some(restored)),
        None => (None, None),
    };
    let end = machine.run()?;
    if report.report_timing {
        if let Some(started) = machine.vcpus_started() {
            eprintln!(
                "gpuvm: timing process_to_vcpus_running_us={}",
                started.duration_since(process_start).as_micros()
            );
            if let Some(restored) = &restored {
                let timings = &restored.timings;
                let build = (restored.called, &timings.stages[..], restored.returned);
                let line = stages_line(
                    "restore-stages",
                    build,
                    &timings.parallel,
                    process_start,
                    started,
                );
                eprintln!("{line}");
            } else if let Some(boot) = machine.boot_timings() {
                let build = (boot.called, &boot.stages[..], boot.returned);
                let line = stages_line("boot-stages", build, &[], process_start, started);
                eprintln!("{line}");
            }
        }
        for snap in machine.snapshots() {
            eprintln!(
                "gpuvm: snapshot diff={} bytes={} data_pages={} zero_pages={} memory_ms={} paused_ms={}",
                snap.diff,
                snap.memory_bytes_written,
                snap.data_pages,
                snap.zero_pages,
                snap.memory_time.as_millis(),
                snap.pause_to_resume.as_millis()
            );
        }
        if restore_mode == Some(Mode::Lazy) {
            if let Some(stats) = machine.wait_lazy_complete(Duration::from_secs(600)) {
                let micros = |d: Option<Duration>| d.map_or(-1, |d| d.as_micros() as i64);
                eprintln!(
                    "gpuvm: lazy faults={} fault_p50_us={} fault_p99_us={} bytes_by_faults={} bytes_background={} bytes_working_set={} all_loaded_ms={}",
                    stats.faults,
                    micros(stats.fault_latency_p50),
                    micros(stats.fault_latency_p99),
                    stats.bytes_loaded_by_faults,
                    stats.bytes_loaded_background,
                    stats.bytes_loaded_working_set,
                    stats.time_to_complete.map_or(-1, |d| d.as_millis() as i64)
                );
            }
        }
    }
    if report.report_memory {
        let memory = machine.memory_report()?;
        eprintln!(
            "gpuvm: memory rss_kib={} guest_resident_kib={} overhead_kib={}",
            memory.peak_rss / 1024,
            memory.guest_resident / 1024,
            memory.overhead() / 1024
        );
    }
    log::info!(target: LOG_TARGET, "guest ended: {end:?}");
    Ok(ExitCode::from(end.exit_code() as u8))
}
