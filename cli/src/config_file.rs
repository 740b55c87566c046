//! `--config-file`: a JSON configuration (the bodies of the API's routes) over the
//! command line's flags, carried out as the API's requests are: a list of actions the
//! controller takes as one unit, with its rules (a device id given twice is refused; one
//! the flags gave is replaced, as a second PUT would).

use std::path::Path;

use gpuvm_vmm::action::{ConfigFile, VmmAction};

use crate::CliError;

fn invalid(path: &Path, reason: impl std::fmt::Display) -> CliError {
    CliError::Other(format!("config file {}: {reason}", path.display()))
}

/// The actions the configuration at `path` stands for.
pub fn actions(path: &Path) -> Result<Vec<VmmAction>, CliError> {
    // A configuration is a few KiB of JSON: a FIFO, a device or a huge file is refused
    // before it is read (the read is bounded too).
    const MAX_CONFIG_FILE: u64 = 1 << 20;
    let bytes = gpuvm_memory::snapshot::read_regular_file(path, MAX_CONFIG_FILE)
        .map_err(|e| invalid(path, e))?;
    let text = String::from_utf8(bytes).map_err(|e| invalid(path, e))?;
    let file: ConfigFile = serde_json::from_str(&text).map_err(|e| invalid(path, e))?;
    Ok(file.into_actions())
}

/// Where a refusal of the file's actions comes from, for the error.
pub fn refused(path: &Path, error: gpuvm_vmm::action::ActionError) -> CliError {
    invalid(path, error.message)
}
