//! gpuvm as `cloud-hypervisor`: when the binary is invoked under that name (a symlink)
//! or as `gpuvm --ch-compat ...`, it takes the command line Kata Containers' clh driver
//! gives Cloud Hypervisor and serves Cloud Hypervisor's API (`/api/v1/...`) on the
//! `--api-socket`. The VM is then configured and booted through that API (vm.create,
//! vm.boot).
//!
//! Accepted: `--api-socket <path>` (or `path=<path>`, `fd=` is refused), `-v` repeated
//! (more logging), `--seccomp true|false`, `--event-monitor ...` (accepted, ignored with a
//! log line: gpuvm writes no event stream), `--log-file <path>` (ignored, logs go to
//! stderr), `-V`/`--version`. Anything else is refused naming the option.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpuvm_api::server::ApiServer;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::args::ForeignFlags;
use crate::args::SeccompArgs;
use crate::run::run_from_api;
use crate::CliError;

/// Whether this process should act as Cloud Hypervisor: argv[0]'s file name is
/// `cloud-hypervisor`, or the first argument is `--ch-compat`.
pub fn wanted(args: &[String]) -> bool {
    let name = args
        .first()
        .map(|a| {
            std::path::Path::new(a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    name.as_deref() == Some("cloud-hypervisor")
        || args.get(1).map(String::as_str) == Some("--ch-compat")
}

#[derive(Debug, PartialEq)]
struct ChArgs {
    api_socket: PathBuf,
    verbosity: u8,
    seccomp: bool,
}

fn parse(args: &[String]) -> Result<Option<ChArgs>, String> {
    let mut api_socket = None;
    let mut verbosity = 0u8;
    let mut seccomp = true;
    let mut flags = ForeignFlags::new(args.iter().skip(1).filter(|a| *a != "--ch-compat"));
    while let Some((name, inline)) = flags.next_flag() {
        let mut value = || flags.value(name, inline);
        match name {
            "-V" | "--version" => return Ok(None),
            "-v" | "-vv" | "-vvv" | "-vvvv" => verbosity += (name.len() - 1) as u8,
            "--api-socket" => {
                let value = value()?;
                let path = match value.split_once('=') {
                    Some(("path", path)) => path.to_string(),
                    Some(("fd", _)) => {
                        return Err("--api-socket fd=...: gpuvm binds the socket itself; give a path".into())
                    }
                    _ => value,
                };
                api_socket = Some(PathBuf::from(path));
            }
            "--seccomp" => {
                seccomp = match value()?.as_str() {
                    "true" => true,
                    "false" => false,
                    "log" => true,
                    other => return Err(format!("--seccomp {other:?}: true, false or log")),
                }
            }
            "--event-monitor" => {
                let value = value()?;
                log::info!(target: crate::LOG_TARGET, "--event-monitor {value} ignored: gpuvm writes no event stream");
            }
            "--log-file" => {
                let value = value()?;
                log::info!(target: crate::LOG_TARGET, "--log-file {value} ignored: gpuvm logs to stderr");
            }
            other => {
                return Err(format!(
                    "{other}: not supported by gpuvm's Cloud Hypervisor mode (it takes --api-socket, -v, --seccomp, --event-monitor, --log-file; configure the VM with PUT /api/v1/vm.create)"
                ))
            }
        }
    }
    let api_socket =
        api_socket.ok_or("--api-socket is required: the VM is configured through the API")?;
    Ok(Some(ChArgs {
        api_socket,
        verbosity,
        seccomp,
    }))
}

/// The `cloud-hypervisor` entry point.
pub fn main(args: &[String], process_start: Instant) -> ExitCode {
    let parsed = match parse(args) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => {
            println!("cloud-hypervisor v{} (gpuvm)", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("gpuvm: error: {message}");
            return crate::gpuvm_error();
        }
    };
    let level = match parsed.verbosity {
        0 => None,
        1 => Some(log::LevelFilter::Info),
        2 => Some(log::LevelFilter::Debug),
        _ => Some(log::LevelFilter::Trace),
    };
    if let Err(error) = gpuvm_vmm::logging::init(gpuvm_vmm::logging::LogFormat::Text, level) {
        eprintln!("gpuvm: error: cannot set up logging: {error}");
        return crate::gpuvm_error();
    }
    match serve(&parsed, process_start) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            crate::gpuvm_error()
        }
    }
}

fn serve(args: &ChArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    let seccomp = SeccompArgs {
        no_seccomp: !args.seccomp,
        seccomp: false,
    };
    seccomp.enable()?;
    let (requests_tx, requests_rx) = std::sync::mpsc::channel();
    let wake = EventFd::new(EFD_NONBLOCK).map_err(gpuvm_vmm::Error::EventFd)?;
    let server = ApiServer::start(
        &args.api_socket,
        requests_tx,
        wake.try_clone().map_err(gpuvm_vmm::Error::EventFd)?,
    )
    .map_err(|e| CliError::Other(e.to_string()))?;
    run_from_api(
        requests_rx,
        wake,
        process_start,
        &|| server.wait_idle(Duration::from_secs(2)),
        &|| None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn kata_command_lines_parse() {
        let kata = args(&[
            "/usr/bin/cloud-hypervisor",
            "--api-socket",
            "/run/vc/clh-api.sock",
            "-v",
            "--seccomp",
            "false",
        ]);
        assert!(wanted(&kata));
        assert_eq!(
            parse(&kata).unwrap(),
            Some(ChArgs {
                api_socket: "/run/vc/clh-api.sock".into(),
                verbosity: 1,
                seccomp: false
            })
        );
        let compat = args(&[
            "gpuvm",
            "--ch-compat",
            "--api-socket",
            "path=/s",
            "-vv",
            "--event-monitor",
            "path=/e",
        ]);
        assert!(wanted(&compat));
        assert_eq!(
            parse(&compat).unwrap().unwrap().api_socket,
            PathBuf::from("/s")
        );
        assert!(!wanted(&args(&["gpuvm", "run"])));
        assert!(parse(&args(&[
            "cloud-hypervisor",
            "--kernel",
            "/k",
            "--api-socket",
            "/s"
        ]))
        .unwrap_err()
        .contains("--kernel"));
        assert!(parse(&args(&["cloud-hypervisor"])).is_err());
        assert!(parse(&args(&["cloud-hypervisor", "--api-socket", "fd=3"])).is_err());
    }
}
