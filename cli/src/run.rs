//! `gpuvm run`: builds a VM from the flags (and `--config-file`) and runs it, or with
//! `--api-sock` serves the control API and starts the VM when asked.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpuvm_api::server::ApiServer;
use gpuvm_arch::x86_64::boot::{BootSource, KernelSource};
use gpuvm_vmm::config::{MachineConfig, PciOptions, VmConfig};
use gpuvm_vmm::controller::{ApiController, BeforeRun, Started};
use gpuvm_vmm::metrics::{CountingWriter, METRICS};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::args::{snapshot_policy, RunArgs};
use crate::report::finish;
use crate::{config_file, fabric, jail, passthrough, CliError};

/// Boots the VM the flags describe and runs it until the guest ends.
pub fn run(args: RunArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    args.seccomp.enable()?;
    crate::args::set_snapshot_pause(&args.snapshot);
    let (config, pci) = configuration(&args)?;
    if !pci.is_empty() && args.snapshot.snapshot_dir.is_some() {
        return Err(CliError::Other(
            "--snapshot-dir cannot be used with passthrough devices: their state lives in the device and cannot be saved".into(),
        ));
    }
    // The partition is active before any GPU is attached, and deactivated after the VM
    // ends or fails to start.
    let fabric = fabric::activate(pci.fabric_partition.as_ref())?;
    fabric::finish(fabric, run_vm(&args, config, pci, process_start))
}

/// [`run`] once the configuration is known.
fn run_vm(
    args: &RunArgs,
    config: VmConfig,
    pci: PciOptions,
    process_start: Instant,
) -> Result<ExitCode, CliError> {
    let Some(api_sock) = &args.api_sock else {
        let mut machine = gpuvm_vmm::builder::build_with_pci(&config, &pci, serial_out())?;
        if let Some(policy) = snapshot_policy(&args.snapshot) {
            machine.set_snapshot_policy(policy);
        }
        jail::enter(&args.jail)?;
        return finish(machine, &args.report, process_start, None);
    };
    serve_api(args, api_sock, config, pci, process_start)
}

/// The VM's configuration (the flags, then `--config-file` over them) and its
/// passthrough devices.
fn configuration(args: &RunArgs) -> Result<(VmConfig, PciOptions), CliError> {
    let kernel = match &args.kernel {
        Some(path) => KernelSource::File(path.clone()),
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
            cpuid_masks: passthrough::with_hidden_hypervisor(
                args.cpuid_mask.clone(),
                args.passthrough.hide_hypervisor,
            ),
            track_dirty_pages: args.track_dirty_pages,
        },
        boot: BootSource {
            kernel,
            initrd: args.initrd.clone(),
            cmdline: args.cmdline.clone().unwrap_or_else(|| {
                if is_test_guest {
                    "hello".into()
                } else {
                    String::new()
                }
            }),
        },
    };
    let mut pci = args.passthrough.pci_options().map_err(CliError::Other)?;
    pci.virtio = args.devices.virtio_options()?;
    pci.fabric_partition = args.fabric.partition()?;
    pci.numa = args.numa.numa_options().map_err(CliError::Other)?;
    let Some(path) = &args.config_file else {
        return Ok((config, pci));
    };
    // The file's actions go through the controller, as the API's requests do.
    let (_no_requests, requests) = std::sync::mpsc::channel();
    let wake = EventFd::new(EFD_NONBLOCK).map_err(gpuvm_vmm::Error::EventFd)?;
    let mut controller = ApiController::new(requests, wake, config, Box::new(serial_out));
    controller.set_pci_options(pci);
    controller
        .configure(config_file::actions(path)?)
        .map_err(|error| config_file::refused(path, error))?;
    Ok((controller.vm_config(), controller.pci_options()))
}

/// `--api-sock`: serves the control API and runs the VM it starts (at once with
/// `--config-file`, else on PUT /actions InstanceStart or PUT /snapshot/load).
fn serve_api(
    args: &RunArgs,
    api_sock: &Path,
    config: VmConfig,
    pci: PciOptions,
    process_start: Instant,
) -> Result<ExitCode, CliError> {
    let (requests_tx, requests_rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(EFD_NONBLOCK).map_err(gpuvm_vmm::Error::EventFd)?;
    let vmm = gpuvm_vmm::action_channel::ActionSender::new(
        requests_tx.clone(),
        wake.try_clone().map_err(gpuvm_vmm::Error::EventFd)?,
    );
    let mut server = ApiServer::start(api_sock, vmm).map_err(|e| CliError::Other(e.to_string()))?;
    let mut controller =
        ApiController::new(requests_rx, wake, config.clone(), Box::new(serial_out));
    controller.set_request_sender(requests_tx);
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

/// For the other VMMs' front ends (Cloud Hypervisor's, Firecracker's): serves the API's
/// actions until one starts a VM (with the test guest as the default boot source), then
/// runs it to its end. `idle` waits until no answer is in flight (so the answer to the
/// request that ended the run reaches its client); `start_failure` says why the API
/// stopped before a VM started, where the front end knows (a refused config file).
pub(crate) fn run_from_api(
    requests: std::sync::mpsc::Receiver<gpuvm_vmm::action::ActionRequest>,
    wake: EventFd,
    process_start: Instant,
    idle: &dyn Fn(),
    start_failure: &dyn Fn() -> Option<String>,
) -> Result<ExitCode, CliError> {
    let config = VmConfig {
        machine: MachineConfig::default(),
        boot: gpuvm_vmm::controller::default_boot_source(),
    };
    let mut controller = ApiController::new(requests, wake, config, Box::new(serial_out));
    let Some(Started {
        mut machine,
        paused,
    }) = controller.wait_for_start()
    else {
        idle();
        if let Some(message) = start_failure() {
            return Err(CliError::Other(message));
        }
        if controller.shutdown_requested() {
            return Ok(ExitCode::SUCCESS);
        }
        return Err(CliError::Other(
            "the API server stopped before the VM started".into(),
        ));
    };
    if paused && controller.wait_for_resume(&machine) == BeforeRun::End {
        idle();
        return Ok(ExitCode::SUCCESS);
    }
    machine.set_run_control(controller.into_run_control());
    let report = crate::args::ReportArgs {
        report_memory: false,
        report_timing: false,
    };
    let result = finish(machine, &report, process_start, None);
    idle();
    result
}

/// The serial console: stdout, counted for the metrics.
pub(crate) fn serial_out() -> Box<dyn std::io::Write + Send> {
    Box::new(CountingWriter::new(
        std::io::stdout(),
        &METRICS.serial_bytes_out,
    ))
}
