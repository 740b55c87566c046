//! `gpuvm`: the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use gpuvm_memory::Backing;
use gpuvm_vmm::config::{MachineConfig, VmConfig};
use gpuvm_vmm::machine::{AfterSnapshot, SnapshotPolicy};
use gpuvm_vmm::snapshot::RestoreMode;
use gpuvm_vmm::x86_64::boot::{BootSource, KernelSource};
use gpuvm_vmm::x86_64::cpuid::CpuidMask;
use gpuvm_vmm::Machine;

/// A KVM micro-VMM for GPU virtual machines.
#[derive(Parser, Debug)]
#[command(name = "gpuvm", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Boot a VM and run it until the guest ends. Without --kernel, boots the embedded
    /// test guest.
    Run(RunArgs),
    /// Restore a VM from a snapshot directory and run it until the guest ends.
    Restore(RestoreArgs),
    /// Ask a running gpuvm (started with --snapshot-dir) to snapshot itself now.
    Snapshot {
        /// Process id of the running gpuvm.
        #[arg(long)]
        pid: i32,
    },
    /// Write the embedded test guest (a PVH ELF) to a file, e.g. to boot it elsewhere.
    GuestImage {
        /// Where to write the image.
        #[arg(long, short)]
        output: PathBuf,
    },
}

#[derive(Args, Debug)]
struct RunArgs {
    /// Kernel to boot: an ELF vmlinux (PVH or 64-bit entry) or a bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (for the test guest: the workload, default "hello").
    #[arg(long)]
    cmdline: Option<String>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Guest memory size, e.g. 512M or 4G.
    #[arg(long, value_parser = parse_size, default_value = "128M")]
    memory: u64,
    /// What backs guest memory: memfd, hugetlb-2m or hugetlb-1g.
    #[arg(long, default_value = "memfd", value_parser = parse_backing)]
    memory_backing: Backing,
    /// Do not ask for transparent huge pages on memfd backing.
    #[arg(long)]
    no_thp: bool,
    /// Populate all guest memory before boot, with several threads.
    #[arg(long)]
    prefault: bool,
    /// CPUID features to hide from the guest: names (popcnt, xsave, smap, ...) or
    /// LEAF[.SUBLEAF]:REG:BIT, comma-separated or repeated.
    #[arg(long, value_delimiter = ',')]
    cpuid_mask: Vec<CpuidMask>,
    /// Log dirty pages so that later snapshots into the same directory are diffs.
    #[arg(long)]
    track_dirty_pages: bool,
    #[command(flatten)]
    snapshot: SnapshotArgs,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args, Debug)]
struct SnapshotArgs {
    /// Directory for snapshots; enables `gpuvm snapshot --pid` (SIGUSR1).
    #[arg(long)]
    snapshot_dir: Option<PathBuf>,
    /// Take a snapshot this many milliseconds after the vCPUs start.
    #[arg(long, requires = "snapshot_dir")]
    snapshot_after_ms: Option<u64>,
    /// After a snapshot: keep running, or end gpuvm.
    #[arg(long, value_enum, default_value = "resume", requires = "snapshot_dir")]
    snapshot_then: Then,
}

#[derive(Args, Debug)]
struct ReportArgs {
    /// At exit, print peak RSS, guest-resident memory and gpuvm's overhead to stderr.
    #[arg(long)]
    report_memory: bool,
    /// At exit, print snapshot and restore figures to stderr.
    #[arg(long)]
    report_timing: bool,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Then {
    Resume,
    Exit,
}

#[derive(Copy, Clone, Debug, ValueEnum, PartialEq, Eq)]
enum Mode {
    /// Read all memory, then run.
    Eager,
    /// Run at once, load memory on fault and in the background (userfaultfd).
    Lazy,
    /// Hand the userfaultfd to an external page-fault handler (--uffd-socket).
    External,
}

#[derive(Args, Debug)]
struct RestoreArgs {
    /// The snapshot directory.
    #[arg(long)]
    snapshot: PathBuf,
    #[arg(long, value_enum, default_value = "lazy")]
    restore_mode: Mode,
    /// Unix socket of the external page-fault handler (Firecracker's UFFD handshake).
    #[arg(long, required_if_eq("restore_mode", "external"))]
    uffd_socket: Option<PathBuf>,
    #[command(flatten)]
    snapshot_args: SnapshotArgs,
    #[command(flatten)]
    report: ReportArgs,
}

/// Parses sizes like 4096, 512K, 128M, 4G (powers of 1024).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let not_a_size = || format!("'{text}' is not a size (examples: 4096, 512M, 4G)");
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(not_a_size()),
    };
    let value: u64 = digits.parse().map_err(|_| not_a_size())?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{text}' is too large"))
}

fn parse_backing(text: &str) -> Result<Backing, String> {
    text.parse()
        .map_err(|e: gpuvm_memory::RamError| e.to_string())
}

fn snapshot_policy(args: &SnapshotArgs) -> Option<SnapshotPolicy> {
    let dir = args.snapshot_dir.clone()?;
    Some(SnapshotPolicy {
        dir,
        after: args.snapshot_after_ms.map(Duration::from_millis),
        on_signal: true,
        then: match args.snapshot_then {
            Then::Resume => AfterSnapshot::Resume,
            Then::Exit => AfterSnapshot::Exit,
        },
    })
}

fn run(args: RunArgs, process_start: Instant) -> Result<ExitCode, gpuvm_vmm::Error> {
    let kernel = match args.kernel {
        Some(path) => KernelSource::File(path),
        None => KernelSource::Embedded(gpuvm_guest_images::TEST_GUEST_ELF),
    };
    let is_test_guest = matches!(kernel, KernelSource::Embedded(_));
    let config = VmConfig {
        machine: MachineConfig {
            vcpus: args.vcpus,
            memory_size: args.memory,
            backing: args.memory_backing,
            thp: !args.no_thp,
            prefault: args.prefault,
            cpuid_masks: args.cpuid_mask,
            track_dirty_pages: args.track_dirty_pages,
        },
        boot: BootSource {
            kernel,
            initrd: args.initrd,
            cmdline: args.cmdline.unwrap_or_else(|| {
                if is_test_guest {
                    "hello".into()
                } else {
                    String::new()
                }
            }),
        },
    };
    let mut machine = gpuvm_vmm::builder::build(&config, Box::new(std::io::stdout()))?;
    if let Some(policy) = snapshot_policy(&args.snapshot) {
        machine.set_snapshot_policy(policy);
    }
    finish(machine, &args.report, process_start, None)
}

fn restore(args: RestoreArgs, process_start: Instant) -> Result<ExitCode, gpuvm_vmm::Error> {
    let mode = match args.restore_mode {
        Mode::Eager => RestoreMode::Eager,
        Mode::Lazy => RestoreMode::Lazy,
        // clap makes --uffd-socket required in this mode.
        Mode::External => RestoreMode::External(args.uffd_socket.clone().unwrap_or_default()),
    };
    let (mut machine, timings) =
        gpuvm_vmm::builder::restore(&args.snapshot, &mode, Box::new(std::io::stdout()))?;
    if let Some(policy) = snapshot_policy(&args.snapshot_args) {
        machine.set_snapshot_policy(policy);
    }
    if args.report.report_timing {
        eprintln!(
            "gpuvm: restore mode={:?} validate_us={} memory_us={} ready_us={}",
            args.restore_mode,
            timings.validate.as_micros(),
            timings.memory.as_micros(),
            timings.total_to_ready.as_micros()
        );
    }
    finish(
        machine,
        &args.report,
        process_start,
        Some(args.restore_mode),
    )
}

/// Runs the machine to its end and prints the requested reports.
fn finish(
    mut machine: Machine,
    report: &ReportArgs,
    process_start: Instant,
    restore_mode: Option<Mode>,
) -> Result<ExitCode, gpuvm_vmm::Error> {
    let end = machine.run()?;
    if report.report_timing {
        if let Some(started) = machine.vcpus_started() {
            eprintln!(
                "gpuvm: timing process_to_vcpus_running_us={}",
                started.duration_since(process_start).as_micros()
            );
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
                    "gpuvm: lazy faults={} fault_p50_us={} fault_p99_us={} bytes_by_faults={} bytes_background={} all_loaded_ms={}",
                    stats.faults,
                    micros(stats.fault_latency_p50),
                    micros(stats.fault_latency_p99),
                    stats.bytes_loaded_by_faults,
                    stats.bytes_loaded_background,
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
    log::info!("guest ended: {end:?}");
    Ok(ExitCode::from(end.exit_code() as u8))
}

fn signal_snapshot(pid: i32) -> ExitCode {
    if pid <= 0 {
        eprintln!("gpuvm: error: invalid process id {pid}");
        return ExitCode::from(1);
    }
    // SAFETY: kill(2) with a positive pid and a valid signal has no memory effects.
    let result = unsafe { libc::kill(pid, libc::SIGUSR1) };
    if result != 0 {
        let error = std::io::Error::last_os_error();
        eprintln!("gpuvm: error: cannot signal process {pid}: {error}");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

fn write_guest_image(output: &std::path::Path) -> ExitCode {
    match std::fs::write(output, gpuvm_guest_images::TEST_GUEST_ELF) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpuvm: error: cannot write {}: {error}", output.display());
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let process_start = Instant::now();
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("GPUVM_LOG", "warn"))
        .format_timestamp_micros()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args, process_start),
        Command::Restore(args) => restore(args, process_start),
        Command::Snapshot { pid } => return signal_snapshot(pid),
        Command::GuestImage { output } => return write_guest_image(&output),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4g"), Ok(4 << 30));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("abc").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
