//! `gpuvm`: the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use gpuvm_arch::x86_64::boot::{BootSource, KernelSource};
use gpuvm_arch::x86_64::cpuid::CpuidMask;
use gpuvm_memory::Backing;
use gpuvm_vmm::api::server::ApiServer;
use gpuvm_vmm::api::vmm::{ApiController, BeforeRun, Started};
use gpuvm_vmm::config::{MachineConfig, VmConfig};
use gpuvm_vmm::machine::{AfterSnapshot, SnapshotPolicy};
use gpuvm_vmm::metrics::{CountingWriter, METRICS};
use gpuvm_vmm::snapshot::RestoreMode;
use gpuvm_vmm::Machine;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

mod passthrough_cli;

/// A KVM micro-VMM for GPU virtual machines.
#[derive(Parser, Debug)]
#[command(name = "gpuvm", version, about)]
struct Cli {
    /// Log output: text, or json (one object per line with ts, level, target, message).
    #[arg(long, global = true, default_value = "text", value_name = "text|json")]
    log_format: gpuvm_vmm::logging::LogFormat,
    /// Log level for every module: off, error, warn, info, debug, trace (default: the
    /// GPUVM_LOG environment variable, else warn).
    #[arg(long, global = true, value_name = "LEVEL")]
    log_level: Option<log::LevelFilter>,
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
    /// Talk to a running gpuvm's API socket.
    Ctl(CtlArgs),
    /// Check that this host can pass GPUs through (KVM, IOMMU, vfio-pci binding, IOMMU
    /// groups, memlock, huge pages); each failing check says how to fix it.
    CheckHost(passthrough_cli::CheckHostArgs),
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
    /// Serve the control API on this Unix socket. Without --config-file, gpuvm waits for
    /// PUT /actions InstanceStart (or PUT /snapshot/load); the flags above are the
    /// initial configuration.
    #[arg(long)]
    api_sock: Option<PathBuf>,
    #[command(flatten)]
    jail: JailArgs,
    #[command(flatten)]
    seccomp: SeccompArgs,
    /// Start at once with this JSON configuration ({"machine-config": {...},
    /// "boot-source": {...}}, the bodies of the API's routes).
    #[arg(long)]
    config_file: Option<PathBuf>,
    #[command(flatten)]
    passthrough: passthrough_cli::PassthroughArgs,
    #[command(flatten)]
    snapshot: SnapshotArgs,
    #[command(flatten)]
    report: ReportArgs,
}

/// Confinement applied once /dev/kvm, guest memory and the devices are open, before the
/// guest runs (see the `jail` module).
#[derive(Args, Debug, Default)]
struct JailArgs {
    /// Change the root directory to DIR (snapshot paths are then inside DIR).
    #[arg(long, value_name = "DIR")]
    chroot: Option<PathBuf>,
    /// Run as this user id (with --gid; supplementary groups are dropped).
    #[arg(long, requires = "gid")]
    uid: Option<u32>,
    /// Run as this group id (with --uid).
    #[arg(long, requires = "uid")]
    gid: Option<u32>,
}

/// Seccomp filters (on by default; see the `seccomp` module).
#[derive(Args, Debug, Default)]
struct SeccompArgs {
    /// Run without seccomp filters (by default every vmm, vCPU and API thread runs under
    /// its own filter, and a system call outside it ends gpuvm with status 148).
    #[arg(long)]
    no_seccomp: bool,
    /// Accepted for compatibility: filters are on by default now.
    #[arg(long, hide = true, conflicts_with = "no_seccomp")]
    seccomp: bool,
}

impl SeccompArgs {
    /// Compiles the filters and arms the SIGSYS handler, unless --no-seccomp.
    fn enable(&self) -> Result<(), CliError> {
        if self.no_seccomp {
            log::info!("seccomp filters are off (--no-seccomp)");
            return Ok(());
        }
        let settings = gpuvm_vmm::seccomp::Settings::from_env().map_err(gpuvm_vmm::Error::from)?;
        if settings.on_violation == gpuvm_vmm::seccomp::OnViolation::Log {
            log::warn!("seccomp filters only log violations (GPUVM_SECCOMP_LOG_ONLY)");
        }
        gpuvm_vmm::seccomp::enable(&settings).map_err(gpuvm_vmm::Error::from)?;
        Ok(())
    }
}

#[derive(Args, Debug)]
struct CtlArgs {
    /// The API socket of the gpuvm to talk to.
    #[arg(long)]
    api_sock: PathBuf,
    #[command(subcommand)]
    command: CtlCommand,
}

#[derive(Subcommand, Debug)]
enum CtlCommand {
    /// GET /: instance information and state.
    Info,
    /// GET /machine-config.
    GetMachineConfig,
    /// PUT /machine-config.
    SetMachineConfig {
        #[arg(long)]
        vcpus: u8,
        #[arg(long, value_parser = parse_size)]
        memory: u64,
        #[arg(long, default_value = "memfd", value_parser = ["memfd", "hugetlb-2m", "hugetlb-1g"])]
        memory_backing: String,
        #[arg(long)]
        no_thp: bool,
        #[arg(long)]
        prefault: bool,
        #[arg(long, value_delimiter = ',')]
        cpuid_mask: Vec<String>,
        #[arg(long)]
        track_dirty_pages: bool,
    },
    /// PUT /boot-source (no --kernel: the embedded test guest).
    SetBootSource {
        #[arg(long)]
        kernel: Option<PathBuf>,
        #[arg(long)]
        initrd: Option<PathBuf>,
        #[arg(long)]
        cmdline: Option<String>,
    },
    /// PUT /actions InstanceStart.
    Start,
    /// PUT /actions SendCtrlAltDel (ends the run as a guest reset).
    CtrlAltDel,
    /// PATCH /vm Paused.
    Pause,
    /// PATCH /vm Resumed.
    Resume,
    /// PUT /snapshot/create.
    SnapshotCreate {
        /// Snapshot directory.
        #[arg(long)]
        dir: PathBuf,
        /// Write only pages dirtied since the last snapshot into DIR.
        #[arg(long)]
        diff: bool,
    },
    /// PUT /snapshot/load (only before start).
    SnapshotLoad {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, value_enum, default_value = "lazy")]
        restore_mode: Mode,
        #[arg(long, required_if_eq("restore_mode", "external"))]
        uffd_socket: Option<PathBuf>,
        /// Run at once instead of waiting for `resume`.
        #[arg(long)]
        resume: bool,
        /// Record the guest's working set for later lazy restores (lazy mode only).
        #[arg(long)]
        record_working_set: bool,
    },
    /// PUT /gpus/{id}: a passthrough device (before start).
    AddGpu {
        #[arg(long)]
        id: String,
        /// A host GPU bound to vfio-pci, e.g. 0000:41:00.0.
        #[arg(
            long,
            required_unless_present = "vfio_user_socket",
            conflicts_with = "vfio_user_socket"
        )]
        host_bdf: Option<String>,
        /// A vfio-user device's socket.
        #[arg(long)]
        vfio_user_socket: Option<PathBuf>,
    },
    /// GET /metrics.
    Metrics,
    /// Any request: METHOD PATH [JSON BODY].
    Raw {
        method: String,
        path: String,
        body: Option<String>,
    },
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
    /// Lazy restores: write down which guest memory this restore's guest faulted on
    /// (`working-set` in the snapshot directory), so that later lazy restores of the same
    /// snapshot load it first.
    #[arg(long)]
    record_working_set: bool,
    #[command(flatten)]
    jail: JailArgs,
    #[command(flatten)]
    seccomp: SeccompArgs,
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

fn run(args: RunArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    args.seccomp.enable()?;
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
            cpuid_masks: passthrough_cli::with_hidden_hypervisor(
                args.cpuid_mask,
                args.passthrough.hide_hypervisor,
            ),
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
    let mut pci = args.passthrough.pci_options();
    let config = match &args.config_file {
        Some(path) => api_config::apply_config_file(path, config, &mut pci)?,
        None => config,
    };
    if !pci.is_empty() && args.snapshot.snapshot_dir.is_some() {
        return Err(CliError::Other(
            "--snapshot-dir cannot be used with passthrough devices: their state lives in the device and cannot be saved".into(),
        ));
    }
    let Some(api_sock) = &args.api_sock else {
        let mut machine = gpuvm_vmm::builder::build_with_pci(&config, &pci, serial_out())?;
        if let Some(policy) = snapshot_policy(&args.snapshot) {
            machine.set_snapshot_policy(policy);
        }
        jail::enter(&args.jail)?;
        return finish(machine, &args.report, process_start, None);
    };
    let (requests_tx, requests_rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(EFD_NONBLOCK).map_err(gpuvm_vmm::Error::EventFd)?;
    let mut server = ApiServer::start(
        api_sock,
        requests_tx,
        wake.try_clone().map_err(gpuvm_vmm::Error::EventFd)?,
    )
    .map_err(|e| CliError::Other(e.to_string()))?;
    let mut controller =
        ApiController::new(requests_rx, wake, config.clone(), Box::new(serial_out));
    controller.set_pci_options(pci);
    let (mut machine, paused) = if args.config_file.is_some() {
        (
            gpuvm_vmm::builder::build_with_pci(&config, &controller.pci_options(), serial_out())?,
            false,
        )
    } else {
        match controller.wait_for_start() {
            Some(Started { machine, paused }) => (machine, paused),
            None => {
                return Err(CliError::Other(
                    "the API server stopped before the VM started".into(),
                ))
            }
        }
    };
    if args.jail.chroot.is_some() {
        // The socket's path means nothing inside the new root.
        server.keep_socket_file();
    }
    jail::enter(&args.jail)?;
    if paused && controller.wait_for_resume(&machine) == BeforeRun::End {
        server.wait_idle(Duration::from_secs(2));
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(policy) = snapshot_policy(&args.snapshot) {
        machine.set_snapshot_policy(policy);
    }
    machine.set_run_control(controller.into_run_control());
    let result = finish(machine, &args.report, process_start, None);
    // Let the answer to a request that ended the run reach its client.
    server.wait_idle(Duration::from_secs(2));
    result
}

/// What the CLI reports as `gpuvm: error: ...`.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Vmm(#[from] gpuvm_vmm::Error),
    #[error("{0}")]
    Other(String),
}

/// The serial console: stdout, counted for the metrics.
fn serial_out() -> Box<dyn std::io::Write + Send> {
    Box::new(CountingWriter::new(
        std::io::stdout(),
        &METRICS.serial_bytes_out,
    ))
}

/// `--config-file` and API error plumbing for the CLI.
mod api_config {
    use std::path::Path;

    use gpuvm_arch::x86_64::boot::{BootSource, KernelSource};
    use gpuvm_vmm::api::action::ConfigFile;
    use gpuvm_vmm::config::VmConfig;
    use gpuvm_vmm::pci::PciOptions;

    use super::CliError;

    fn invalid(path: &Path, reason: impl std::fmt::Display) -> CliError {
        CliError::Other(format!("config file {}: {reason}", path.display()))
    }

    /// The configuration from `path` over `config` (the command-line flags).
    /// Its `gpus` are added to `pci` (after the command line's).
    pub fn apply_config_file(
        path: &Path,
        mut config: VmConfig,
        pci: &mut PciOptions,
    ) -> Result<VmConfig, CliError> {
        // A configuration is a few KiB of JSON: a FIFO, a device or a huge file is refused
        // before it is read (the read is bounded too).
        const MAX_CONFIG_FILE: u64 = 1 << 20;
        let bytes = gpuvm_memory::snapshot::read_regular_file(path, MAX_CONFIG_FILE)
            .map_err(|e| invalid(path, e))?;
        let text = String::from_utf8(bytes).map_err(|e| invalid(path, e))?;
        let file: ConfigFile = serde_json::from_str(&text).map_err(|e| invalid(path, e))?;
        let mut ids = std::collections::HashSet::new();
        for gpu in &file.gpus {
            gpu.validate(None).map_err(|e| invalid(path, e.message))?;
            if !ids.insert(gpu.gpu_id.as_str()) {
                return Err(invalid(
                    path,
                    format!("gpu_id {:?} appears twice", gpu.gpu_id),
                ));
            }
            pci.gpus.extend(gpu.host_bdf.clone());
            pci.vfio_user.extend(gpu.vfio_user_socket.clone());
        }
        if let Some(machine) = file.machine_config {
            config.machine = machine.to_config().map_err(|e| invalid(path, e.message))?;
        }
        if let Some(boot) = file.boot_source {
            let kernel = match boot.kernel_image_path {
                Some(kernel) => KernelSource::File(kernel),
                None => KernelSource::Embedded(gpuvm_guest_images::TEST_GUEST_ELF),
            };
            let embedded = matches!(kernel, KernelSource::Embedded(_));
            config.boot = BootSource {
                kernel,
                initrd: boot.initrd_path,
                cmdline: boot.boot_args.unwrap_or_else(|| {
                    if embedded {
                        "hello".into()
                    } else {
                        String::new()
                    }
                }),
            };
        }
        Ok(config)
    }
}

fn restore(args: RestoreArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    args.seccomp.enable()?;
    let mode = match args.restore_mode {
        Mode::Eager => RestoreMode::Eager,
        Mode::Lazy => RestoreMode::Lazy,
        // clap makes --uffd-socket required in this mode.
        Mode::External => RestoreMode::External(args.uffd_socket.clone().unwrap_or_default()),
    };
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

/// A restore's timings and when it was called and returned, for `--report-timing`.
struct RestoredAt {
    timings: gpuvm_vmm::snapshot::RestoreTimings,
    called: Instant,
    returned: Instant,
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
fn finish(
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
    log::info!("guest ended: {end:?}");
    Ok(ExitCode::from(end.exit_code() as u8))
}

/// `gpuvm snapshot --pid`: sends SIGUSR1 to a gpuvm that takes snapshots on it. SIGUSR1
/// ends a process that does not handle it, and means something else to one that does, so
/// the target must run a gpuvm binary (this file, or one holding [`SNAPSHOT_SIGNAL_MARKER`]:
/// an upgrade or rebuild since it started) with its snapshot handler installed (only
/// `--snapshot-dir` installs it). The process is held by a pidfd from before the checks:
/// if it ends and its pid is reused meanwhile, the signal fails instead of reaching the
/// newcomer.
fn signal_snapshot(pid: i32) -> Result<ExitCode, CliError> {
    if pid <= 0 {
        return Err(CliError::Other(format!("invalid process id {pid}")));
    }
    let pidfd = pidfd::open(pid)?;
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let inspect = |what: &str, error: std::io::Error| {
        CliError::Other(format!("cannot inspect process {pid} ({what}): {error}"))
    };
    let exe = proc_dir.join("exe");
    if !is_gpuvm_binary(&exe).map_err(|e| inspect("its binary", e))? {
        let runs = std::fs::read_link(&exe).unwrap_or_default();
        return Err(CliError::Other(format!(
            "process {pid} ({}) is not a gpuvm; not signalling it",
            runs.display()
        )));
    }
    let status =
        std::fs::read_to_string(proc_dir.join("status")).map_err(|e| inspect("its status", e))?;
    let caught = status
        .lines()
        .find_map(|line| line.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .ok_or_else(|| CliError::Other(format!("process {pid}: no SigCgt in its status")))?;
    if caught & (1 << (libc::SIGUSR1 - 1)) == 0 {
        return Err(CliError::Other(format!(
            "gpuvm process {pid} does not take snapshots on a signal (it was started without \
             --snapshot-dir, or its VM is not running yet); not signalling it"
        )));
    }
    pidfd::send_signal(&pidfd, pid, libc::SIGUSR1)?;
    Ok(ExitCode::SUCCESS)
}

/// In every gpuvm binary whose SIGUSR1 means "snapshot now" (the bytes sit in its
/// read-only data because [`is_gpuvm_binary`] searches for them). Change the number if the
/// signal ever means something else.
const SNAPSHOT_SIGNAL_MARKER: &[u8] = b"gpuvm: SIGUSR1 takes a snapshot (protocol 1)";

/// Whether `exe` (a process's /proc/PID/exe) is this binary, or another file holding
/// [`SNAPSHOT_SIGNAL_MARKER`].
fn is_gpuvm_binary(exe: &std::path::Path) -> std::io::Result<bool> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let id = |m: std::fs::Metadata| (m.dev(), m.ino());
    let mut file = std::fs::File::open(exe)?;
    if id(file.metadata()?) == id(std::fs::metadata("/proc/self/exe")?) {
        return Ok(true);
    }
    // Read in chunks, each starting with the previous one's last marker-length bytes so
    // that a marker across a boundary is found.
    let keep = SNAPSHOT_SIGNAL_MARKER.len() - 1;
    let mut buffer = vec![0u8; 1 << 20];
    let mut filled = 0;
    loop {
        let read = file.read(&mut buffer[filled..])?;
        if read == 0 {
            return Ok(false);
        }
        filled += read;
        let window = &buffer[..filled];
        if window
            .windows(SNAPSHOT_SIGNAL_MARKER.len())
            .any(|w| w == SNAPSHOT_SIGNAL_MARKER)
        {
            return Ok(true);
        }
        let tail = filled.saturating_sub(keep);
        buffer.copy_within(tail..filled, 0);
        filled -= tail;
    }
}

/// pidfd_open(2) and pidfd_send_signal(2), which libc does not wrap.
mod pidfd {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use super::CliError;

    fn error(pid: i32, what: &str) -> CliError {
        let error = std::io::Error::last_os_error();
        CliError::Other(match error.raw_os_error() {
            Some(libc::ESRCH) => format!("no process {pid}"),
            _ => format!("cannot {what} process {pid}: {error}"),
        })
    }

    pub fn open(pid: i32) -> Result<OwnedFd, CliError> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(error(pid, "open"));
        }
        // SAFETY: the descriptor was just returned to us and nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    pub fn send_signal(pidfd: &OwnedFd, pid: i32, signal: i32) -> Result<(), CliError> {
        // SAFETY: a live pidfd, a valid signal, no siginfo (null) and no flags.
        let result = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if result != 0 {
            return Err(error(pid, "signal"));
        }
        Ok(())
    }
}

/// `gpuvm ctl`: one request; prints the answer's body, exits 0 on success.
fn ctl(args: CtlArgs) -> ExitCode {
    use serde_json::json;
    let (method, path, body): (&str, &str, Option<serde_json::Value>) = match &args.command {
        CtlCommand::Info => ("GET", "/", None),
        CtlCommand::GetMachineConfig => ("GET", "/machine-config", None),
        CtlCommand::SetMachineConfig {
            vcpus,
            memory,
            memory_backing,
            no_thp,
            prefault,
            cpuid_mask,
            track_dirty_pages,
        } => (
            "PUT",
            "/machine-config",
            Some(json!({
                "vcpu_count": vcpus,
                "mem_size_mib": memory >> 20,
                "backing": memory_backing,
                "thp": !no_thp,
                "prefault": prefault,
                "cpuid_masks": cpuid_mask,
                "track_dirty_pages": track_dirty_pages,
            })),
        ),
        CtlCommand::SetBootSource {
            kernel,
            initrd,
            cmdline,
        } => (
            "PUT",
            "/boot-source",
            Some(json!({
                "kernel_image_path": kernel.as_ref().map(|p| absolute(p)),
                "initrd_path": initrd.as_ref().map(|p| absolute(p)),
                "boot_args": cmdline,
            })),
        ),
        CtlCommand::Start => (
            "PUT",
            "/actions",
            Some(json!({"action_type": "InstanceStart"})),
        ),
        CtlCommand::CtrlAltDel => (
            "PUT",
            "/actions",
            Some(json!({"action_type": "SendCtrlAltDel"})),
        ),
        CtlCommand::Pause => ("PATCH", "/vm", Some(json!({"state": "Paused"}))),
        CtlCommand::Resume => ("PATCH", "/vm", Some(json!({"state": "Resumed"}))),
        CtlCommand::SnapshotCreate { dir, diff } => (
            "PUT",
            "/snapshot/create",
            Some(json!({
                "snapshot_path": absolute(dir),
                "snapshot_type": if *diff { "Diff" } else { "Full" },
            })),
        ),
        CtlCommand::SnapshotLoad {
            dir,
            restore_mode,
            uffd_socket,
            resume,
            record_working_set,
        } => (
            "PUT",
            "/snapshot/load",
            Some(json!({
                "snapshot_path": absolute(dir),
                "restore_mode": match restore_mode {
                    Mode::Eager => "Eager",
                    Mode::Lazy => "Lazy",
                    Mode::External => "External",
                },
                "uffd_socket_path": uffd_socket.as_ref().map(|p| absolute(p)),
                "resume_vm": resume,
                "record_working_set": record_working_set,
            })),
        ),
        CtlCommand::Metrics => ("GET", "/metrics", None),
        CtlCommand::Raw { method, path, body } => {
            let body = body.as_deref().map(str::to_owned);
            return ctl_send(&args.api_sock, method, path, body.as_deref());
        }
        CtlCommand::AddGpu {
            id,
            host_bdf,
            vfio_user_socket,
        } => {
            let body = json!({
                "gpu_id": id,
                "host_bdf": host_bdf,
                "vfio_user_socket": vfio_user_socket.as_ref().map(|p| absolute(p)),
            })
            .to_string();
            return ctl_send(&args.api_sock, "PUT", &format!("/gpus/{id}"), Some(&body));
        }
    };
    let body = body.map(|b| b.to_string());
    ctl_send(&args.api_sock, method, path, body.as_deref())
}

/// Paths go to the server as absolute paths: it does not share our working directory.
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn ctl_send(socket: &std::path::Path, method: &str, path: &str, body: Option<&str>) -> ExitCode {
    match gpuvm_vmm::api::client::request(socket, method, path, body) {
        Ok(response) if response.is_success() => {
            if !response.body.is_empty() {
                println!("{}", response.body);
            }
            ExitCode::SUCCESS
        }
        Ok(response) => {
            eprintln!("gpuvm: error: {} ({})", response.message(), response.status);
            gpuvm_error()
        }
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            gpuvm_error()
        }
    }
}

/// Confinement for cloud hosts: chroot, then drop to an unprivileged uid/gid. Applied
/// after the VM's file descriptors are open and before the guest runs; the process cannot
/// regain root afterwards (checked).
mod jail {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    use super::{CliError, JailArgs};

    fn os_error(what: &str) -> CliError {
        CliError::Other(format!("{what}: {}", std::io::Error::last_os_error()))
    }

    pub fn enter(args: &JailArgs) -> Result<(), CliError> {
        if let Some(dir) = &args.chroot {
            let path = CString::new(dir.as_os_str().as_bytes())
                .map_err(|_| CliError::Other("--chroot path contains a NUL byte".into()))?;
            // SAFETY: chroot(2) reads a NUL-terminated path that lives across the call.
            if unsafe { libc::chroot(path.as_ptr()) } != 0 {
                return Err(os_error(&format!("cannot chroot to {}", dir.display())));
            }
            std::env::set_current_dir("/")
                .map_err(|e| CliError::Other(format!("cannot enter the new root: {e}")))?;
            log::info!("chrooted to {}", dir.display());
        }
        if let (Some(uid), Some(gid)) = (args.uid, args.gid) {
            // Order matters: groups and gid need the privileges that setuid gives up.
            // glibc applies each of these to every thread of the process.
            // SAFETY: setgroups(2) with a zero count reads no memory.
            if unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
                return Err(os_error("cannot drop supplementary groups"));
            }
            // SAFETY: setresgid/setresuid take plain integers.
            if unsafe { libc::setresgid(gid, gid, gid) } != 0 {
                return Err(os_error(&format!("cannot switch to gid {gid}")));
            }
            // SAFETY: as above.
            if unsafe { libc::setresuid(uid, uid, uid) } != 0 {
                return Err(os_error(&format!("cannot switch to uid {uid}")));
            }
            // SAFETY: as above; this must fail once root is given up.
            if uid != 0 && unsafe { libc::setuid(0) } == 0 {
                return Err(CliError::Other(
                    "dropped to an unprivileged uid but could still become root again".into(),
                ));
            }
            log::info!("running as uid {uid} gid {gid}");
        }
        Ok(())
    }
}

fn write_guest_image(output: &std::path::Path) -> ExitCode {
    match std::fs::write(output, gpuvm_guest_images::TEST_GUEST_ELF) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpuvm: error: cannot write {}: {error}", output.display());
            gpuvm_error()
        }
    }
}

fn main() -> ExitCode {
    let process_start = Instant::now();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            // Help and version go to stdout and are no error; clap's own status for bad
            // arguments (2) could be a guest's.
            let _ = error.print();
            return if error.use_stderr() {
                gpuvm_error()
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if let Err(error) = gpuvm_vmm::logging::init(cli.log_format, cli.log_level) {
        eprintln!("gpuvm: error: cannot set up logging: {error}");
        return gpuvm_error();
    }
    let result = match cli.command {
        Command::Run(args) => run(args, process_start),
        Command::Restore(args) => restore(args, process_start),
        Command::Snapshot { pid } => signal_snapshot(pid),
        Command::Ctl(args) => return ctl(args),
        Command::CheckHost(args) => return passthrough_cli::check_host(&args),
        Command::GuestImage { output } => return write_guest_image(&output),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            gpuvm_error()
        }
    }
}

/// The status of every `gpuvm: error: ...`: distinct from what a guest may report.
fn gpuvm_error() -> ExitCode {
    ExitCode::from(gpuvm_vmm::exit_status::GPUVM_ERROR)
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
