//! `--config-file`: a JSON configuration (the bodies of the API's routes) over the
//! command line's flags.

use std::path::Path;

use gpuvm_vmm::action::{ConfigFile, DriveBody};
use gpuvm_vmm::config::{PciOptions, VmConfig};

use crate::CliError;

fn invalid(path: &Path, reason: impl std::fmt::Display) -> CliError {
    CliError::Other(format!("config file {}: {reason}", path.display()))
}

/// The configuration from `path` over `config` (the command-line flags).
/// Its `gpus` and virtio devices are added to `pci` (after the command line's; its vsock
/// and entropy device replace the command line's).
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
    for drive in file.drives {
        match drive {
            DriveBody::Local(config) => pci.virtio.drives.push(config),
            DriveBody::VhostUser(config) => pci.virtio.vhost_user_drives.push(config),
        }
    }
    pci.virtio.fs.extend(file.fs);
    pci.virtio.nets.extend(file.network_interfaces);
    if file.vsock.is_some() {
        pci.virtio.vsock = file.vsock;
    }
    if file.entropy.is_some() {
        pci.virtio.rng = file.entropy;
    }
    pci.virtio.validate().map_err(|e| invalid(path, e))?;
    if let Some(segments) = &file.pci_segments {
        segments.apply(pci).map_err(|e| invalid(path, e.message))?;
    }
    if let Some(machine) = file.machine_config {
        config.machine = machine.to_config().map_err(|e| invalid(path, e.message))?;
        pci.max_vcpus = machine
            .checked_max_vcpus()
            .map_err(|e| invalid(path, e.message))?;
    }
    if let Some(boot) = file.boot_source {
        config.boot = boot.into_boot_source();
    }
    Ok(config)
}
