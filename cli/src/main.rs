//! `gpuvm`: the command line. Picks the front end ([`front_end`]: gpuvm's own, Cloud
//! Hypervisor's, Firecracker's or the jailer's), parses the arguments ([`args`]), sets up
//! logging and hands each subcommand to its module.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

mod args;
mod cloud_hypervisor;
mod config_file;
mod ctl;
mod devices;
mod fabric;
mod firecracker;
mod front_end;
mod jail;
mod jailer;
mod numa;
mod passthrough;
mod report;
mod restore;
mod run;
mod snapshot_signal;
mod update;
mod update_jail;

use args::{Cli, Command};
use front_end::FrontEnd;

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
    // Arguments are bytes on Linux (paths, a kernel command line): never `env::args()`,
    // which panics on one that is not UTF-8.
    let argv: Vec<OsString> = std::env::args_os().collect();
    let selected = match front_end::select(&argv) {
        Ok(selected) => selected,
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            return gpuvm_error();
        }
    };
    // The jailer's own test of its names (`jailer`, `gpuvm jailer`) agrees with select();
    // it stays the authority should the jailer take more.
    let jailer_wanted = || jailer::wanted(&lossy(&argv));
    match selected {
        FrontEnd::Gpuvm if !jailer_wanted() => gpuvm_main(argv, process_start),
        FrontEnd::Gpuvm | FrontEnd::Jailer => match front_end::utf8_args(&argv, FrontEnd::Jailer) {
            Ok(argv) => jailer::main(&argv),
            Err(message) => {
                // As the jailer reports its errors: status 1.
                eprintln!("gpuvm: jailer: error: {message}");
                ExitCode::from(1)
            }
        },
        FrontEnd::CloudHypervisor => match front_end::utf8_args(&argv, selected) {
            Ok(argv) => cloud_hypervisor::main(&argv, process_start),
            Err(message) => {
                eprintln!("gpuvm: error: {message}");
                gpuvm_error()
            }
        },
        FrontEnd::Firecracker => match front_end::utf8_args(&argv, selected) {
            Ok(argv) => firecracker::main(&argv, process_start),
            Err(message) => {
                eprintln!("gpuvm: error: {message}");
                gpuvm_error()
            }
        },
    }
}

/// `argv` as text, bytes that are not UTF-8 replaced (for tests of names only).
fn lossy(argv: &[OsString]) -> Vec<String> {
    argv.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// gpuvm's own command line: its subcommands.
fn gpuvm_main(argv: Vec<OsString>, process_start: Instant) -> ExitCode {
    let cli = match Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(error) if error.kind() == clap::error::ErrorKind::InvalidUtf8 => {
            // clap says only that some argument is not UTF-8: name it.
            eprintln!("gpuvm: error: {}", args::not_utf8(&argv));
            return gpuvm_error();
        }
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
    // A live update's new process may take over a log output (outputs::adopt): its
    // records go there as well as to stderr.
    let tee = matches!(cli.command, Command::UpdateReceive(_));
    if let Err(error) = gpuvm_vmm::logging::init_with(cli.log_format, cli.log_level, tee) {
        eprintln!("gpuvm: error: cannot set up logging: {error}");
        return gpuvm_error();
    }
    let result = match cli.command {
        Command::Run(args) => run::run(*args, process_start),
        Command::Restore(args) => restore::restore(args, process_start),
        Command::Snapshot { pid } => snapshot_signal::signal_snapshot(pid),
        Command::Update(args) => update::update(args),
        Command::UpdateReceive(args) => update::receive(args, process_start),
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
