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

/// The `gpuvm: restore-stages` line: every stage from process start to vCPUs running,
/// back to back (`process` = exec to restore, the builder's stages, `start_vcpus` = from
/// the restore's return to the vCPU threads running), in microseconds; `total_us` is
/// their sum; `parallel_*` ran on another thread meanwhile and are not in the sum.
fn restore_stages_line(restored: &RestoredAt, process_start: Instant, running: Instant) -> String {
    let mut stages = vec![("process", restored.called.duration_since(process_start))];
    stages.extend(restored.timings.stages.iter().copied());
    stages.push(("start_vcpus", running.duration_since(restored.returned)));
    // The few microseconds between the builder's last stage and its return.
    let builder_sum: Duration = restored.timings.stages.iter().map(|&(_, d)| d).sum();
    let builder_wall = restored.returned.duration_since(restored.called);
    stages.push(("other", builder_wall.saturating_sub(builder_sum)));
    let total: Duration = stages.iter().map(|&(_, d)| d).sum();
    let mut line = String::from("gpuvm: restore-stages");
    for (name, d) in &stages {
        line.push_str(&format!(" {name}_us={}", d.as_micros()));
    }
    line.push_str(&format!(" total_us={}", total.as_micros()));
    for (name, d) in &restored.timings.parallel {
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
                eprintln!("{}", restore_stages_line(restored, process_start, started));
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
