//! `gpuvm`: the command line. Parses the arguments ([`args`]), sets up logging and hands
//! each subcommand to its module.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

mod args;
mod cloud_hypervisor;
mod config_file;
mod ctl;
mod devices;
mod firecracker;
mod jail;
mod jailer;
mod passthrough;
mod report;
mod restore;
mod run;
mod snapshot_signal;

use args::{Cli, Command};

/// The log target of the CLI's lines about the run as a whole (the jail's own lines are
/// under `gpuvm::jail`): log filters and the README's JSON example name it.
const LOG_TARGET: &str = "gpuvm";

/// What the CLI reports as `gpuvm: error: ...`.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Vmm(#[from] gpuvm_vmm::Error),
    #[error("{0}")]
    Other(String),
}

fn main() -> ExitCode {
    let process_start = Instant::now();
    let argv: Vec<String> = std::env::args().collect();
    if cloud_hypervisor::wanted(&argv) {
        return cloud_hypervisor::main(&argv, process_start);
    }
    if firecracker::wanted(&argv) {
        return firecracker::main(&argv, process_start);
    }
    if jailer::wanted(&argv) {
        return jailer::main(&argv);
    }
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
        Command::Run(args) => run::run(*args, process_start),
        Command::Restore(args) => restore::restore(args, process_start),
        Command::Snapshot { pid } => snapshot_signal::signal_snapshot(pid),
        Command::Ctl(args) => return ctl::ctl(args),
        Command::CheckHost(args) => return passthrough::check_host(&args),
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

fn write_guest_image(output: &std::path::Path) -> ExitCode {
    match std::fs::write(output, gpuvm_guest_images::TEST_GUEST_ELF) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpuvm: error: cannot write {}: {error}", output.display());
            gpuvm_error()
        }
    }
}

/// The status of every `gpuvm: error: ...`: distinct from what a guest may report.
fn gpuvm_error() -> ExitCode {
    ExitCode::from(gpuvm_vmm::exit_status::GPUVM_ERROR)
}
