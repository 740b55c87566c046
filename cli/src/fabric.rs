//! `gpuvm run --fabric-partition ID` with `--fabric-manager-command CMD` or
//! `--fabric-manager-socket PATH`: the NVSwitch partition the host's fabric manager
//! activates before the VM's GPUs are attached and deactivates after the VM ends
//! (gpuvm_vmm::fabric).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use gpuvm_vmm::fabric::{ActivePartition, FabricManager, FabricPartition};

use crate::CliError;

/// NVSwitch shared-mode fabric partition (see docs/gpu-hosts.md).
#[derive(Args, Debug, Default)]
pub struct FabricArgs {
    /// Ask the host's fabric manager to activate this partition before any GPU is
    /// attached, and to deactivate it after the VM ends.
    #[arg(long, value_name = "ID")]
    pub fabric_partition: Option<u32>,
    /// The manager as a program, run as `CMD activate ID` and `CMD deactivate ID` (exit
    /// status 0: done).
    #[arg(
        long,
        value_name = "CMD",
        requires = "fabric_partition",
        conflicts_with = "fabric_manager_socket"
    )]
    pub fabric_manager_command: Option<PathBuf>,
    /// The manager as a Unix socket: one JSON request per line,
    /// {"op":"activate","partition":ID}, answered by {"ok":true} or
    /// {"ok":false,"error":"..."}.
    #[arg(long, value_name = "PATH", requires = "fabric_partition")]
    pub fabric_manager_socket: Option<PathBuf>,
    /// How long the manager may take to answer each request, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub fabric_manager_timeout_s: u64,
}

impl FabricArgs {
    /// The configured partition, if any.
    pub fn partition(&self) -> Result<Option<FabricPartition>, CliError> {
        let Some(partition) = self.fabric_partition else {
            return Ok(None);
        };
        let manager = match (&self.fabric_manager_command, &self.fabric_manager_socket) {
            (Some(command), None) => FabricManager::Command(command.clone()),
            (None, Some(socket)) => FabricManager::Socket(socket.clone()),
            _ => {
                return Err(CliError::Other(
                    "--fabric-partition needs the fabric manager: --fabric-manager-command CMD or --fabric-manager-socket PATH".into(),
                ))
            }
        };
        Ok(Some(FabricPartition {
            partition,
            manager,
            timeout: Duration::from_secs(self.fabric_manager_timeout_s),
        }))
    }
}

/// Activates `partition` (before any device is attached, seccomp or the jail).
pub fn activate(partition: Option<&FabricPartition>) -> Result<Option<ActivePartition>, CliError> {
    partition
        .map(|partition| {
            partition
                .activate()
                .map_err(|error| CliError::Other(error.to_string()))
        })
        .transpose()
}

/// Deactivates `active` once the VM has ended (or failed to start). A deactivation that
/// fails turns a good run into an error (the partition is left behind); after a failed
/// run the run's own error is the one reported, and the deactivation's is logged.
pub fn finish<T>(active: Option<ActivePartition>, run: Result<T, CliError>) -> Result<T, CliError> {
    let Some(active) = active else {
        return run;
    };
    match (run, active.deactivate()) {
        (run, Ok(())) => run,
        (Ok(_), Err(error)) => Err(CliError::Other(error.to_string())),
        (Err(run), Err(error)) => {
            log::error!("{error}");
            Err(run)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_needs_one_manager() {
        let none = FabricArgs::default();
        assert_eq!(none.partition().unwrap(), None);

        let no_manager = FabricArgs {
            fabric_partition: Some(3),
            ..FabricArgs::default()
        };
        let error = no_manager.partition().unwrap_err().to_string();
        assert!(error.contains("--fabric-manager-command"), "{error}");

        let socket = FabricArgs {
            fabric_partition: Some(3),
            fabric_manager_socket: Some("/run/fm.sock".into()),
            fabric_manager_timeout_s: 5,
            ..FabricArgs::default()
        };
        assert_eq!(
            socket.partition().unwrap(),
            Some(FabricPartition {
                partition: 3,
                manager: FabricManager::Socket("/run/fm.sock".into()),
                timeout: Duration::from_secs(5),
            })
        );
    }
}
