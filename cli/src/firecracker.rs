//! gpuvm as `firecracker`: when the binary is invoked under that name (a symlink or a hard
//! link), as `gpuvm --fc-compat ...` / `gpuvm firecracker ...`, or as `gpuvm` with flags
//! only Firecracker takes (`gpuvm --api-sock ... --config-file ...`: what Kata starts after
//! resolving a `firecracker` symlink, and what the jailer execs when its exec file is
//! gpuvm; see [`crate::front_end`]), it takes Firecracker's command line and serves
//! Firecracker's API ([`gpuvm_api::firecracker`]) on `--api-sock`.
//!
//! Accepted: `--api-sock <path>` (default /run/firecracker.socket), `--id <id>`,
//! `--config-file <file>` (Firecracker's JSON: boots at once), `--no-api` (needs
//! `--config-file`), `--log-path`, `--level`, `--show-level`, `--show-log-origin`,
//! `--metrics-path`, `--boot-timer` (accepted; gpuvm logs its own boot timing at debug
//! level), `--mmds-size-limit <bytes>` (the MMDS data store's limit; by default Firecracker's
//! HTTP payload limit, 51200 bytes), `--seccomp-level 0|1|2` and `--no-seccomp`, the jailer's
//! `--start-time-us`/`--start-time-cpu-us`/`--parent-cpu-time-us` (accepted, ignored),
//! `--version`. Anything else is refused naming it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuvm_api::server::{ApiServer, StartGate, StartUnderWay};
use gpuvm_vmm::action::VmmAction;
use gpuvm_vmm::action_channel::{action_channel, ActionSender};

use crate::args::ForeignFlags;
use crate::args::SeccompArgs;
use crate::run::run_from_api;
use crate::CliError;

#[derive(Debug, PartialEq)]
struct FcArgs {
    api_sock: Option<PathBuf>,
    id: String,
    config_file: Option<PathBuf>,
    log_path: Option<PathBuf>,
    level: Option<log::LevelFilter>,
    metrics_path: Option<PathBuf>,
    mmds_size_limit: usize,
    seccomp: bool,
}

const DEFAULT_API_SOCK: &str = "/run/firecracker.socket";
pub(crate) const DEFAULT_ID: &str = "anonymous-instance";

/// The instance id a `firecracker` command line gives (`--id`, else Firecracker's
/// default): a live update's new process serves the API under it.
pub fn instance_id(args: &[String]) -> Result<String, String> {
    Ok(parse(args)?.map_or_else(|| DEFAULT_ID.to_string(), |parsed| parsed.id))
}

fn parse(args: &[String]) -> Result<Option<FcArgs>, String> {
    let mut parsed = FcArgs {
        api_sock: Some(PathBuf::from(DEFAULT_API_SOCK)),
        id: DEFAULT_ID.into(),
        config_file: None,
        log_path: None,
        level: None,
        metrics_path: None,
        mmds_size_limit: gpuvm_api::firecracker::DEFAULT_MMDS_SIZE_LIMIT,
        seccomp: true,
    };
    let mut no_api = false;
    let skip = if matches!(
        args.get(1).map(String::as_str),
        Some("--fc-compat" | "firecracker")
    ) {
        2
    } else {
        1
    };
    let mut flags = ForeignFlags::new(args.iter().skip(skip));
    while let Some((name, inline)) = flags.next_flag() {
        let mut value = || flags.value(name, inline);
        match name {
            "--version" | "-V" => return Ok(None),
            "--api-sock" => parsed.api_sock = Some(value()?.into()),
            "--id" => parsed.id = value()?,
            "--config-file" => parsed.config_file = Some(value()?.into()),
            "--no-api" => no_api = true,
            "--log-path" => parsed.log_path = Some(value()?.into()),
            "--level" => parsed.level = Some(gpuvm_api::firecracker::translate::level(&value()?)?),
            "--metrics-path" => parsed.metrics_path = Some(value()?.into()),
            "--mmds-size-limit" => {
                let given = value()?;
                parsed.mmds_size_limit = given.parse().map_err(|_| {
                    format!("--mmds-size-limit {given:?}: a number of bytes")
                })?;
            }
            "--show-level" | "--show-log-origin" | "--boot-timer" => {}
            "--no-seccomp" => parsed.seccomp = false,
            "--seccomp-level" => {
                parsed.seccomp = match value()?.as_str() {
                    "0" => false,
                    "1" | "2" => true,
                    other => return Err(format!("--seccomp-level {other:?}: 0, 1 or 2")),
                }
            }
            "--start-time-us" | "--start-time-cpu-us" | "--parent-cpu-time-us" => {
                value()?;
            }
            other => {
                return Err(format!(
                    "{other}: not supported by gpuvm's Firecracker mode (it takes --api-sock, --id, --config-file, --no-api, --log-path, --level, --show-level, --show-log-origin, --metrics-path, --mmds-size-limit, --boot-timer, --seccomp-level, --no-seccomp)"
                ))
            }
        }
    }
    if no_api {
        if parsed.config_file.is_none() {
            return Err(
                "--no-api needs --config-file: there is no other way to configure the VM".into(),
            );
        }
        parsed.api_sock = None;
    }
    Ok(Some(parsed))
}

/// The `firecracker` entry point.
pub fn main(args: &[String], process_start: Instant) -> ExitCode {
    // Kata's Firecracker driver finds vCPU threads by Firecracker's names.
    gpuvm_vmm::vcpu::name_threads_as_firecracker();
    // Firecracker's guests have no ACPI power-off (`poweroff` halts, `reboot` ends it).
    gpuvm_vmm::builder::without_acpi_power_off();
    let parsed = match parse(args) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => {
            println!(
                "Firecracker v{} (gpuvm {})",
                gpuvm_api::firecracker::FIRECRACKER_API_VERSION,
                env!("CARGO_PKG_VERSION")
            );
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("gpuvm: error: {message}");
            return crate::gpuvm_error();
        }
    };
    if let Err(error) =
        gpuvm_vmm::logging::init_with(gpuvm_vmm::logging::LogFormat::Text, parsed.level, true)
    {
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

/// Sends `actions` to the VMM thread one by one; the first refusal is kept in `failed` and
/// ends the VMM instead. The API socket's clients wait until this returns (`_under_way` is
/// dropped then), as Firecracker's wait for its `--config-file` boot.
fn configure(
    actions: Vec<VmmAction>,
    vmm: ActionSender,
    failed: Arc<Mutex<Option<String>>>,
    _under_way: StartUnderWay,
) {
    for action in actions {
        match vmm.call(action) {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.message);
                let _ = vmm.call(VmmAction::ShutdownVmm);
                return;
            }
            // The VMM thread has gone: nothing left to configure.
            Err(_) => return,
        }
    }
}

fn serve(args: &FcArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    let session = gpuvm_api::firecracker::Session::new(args.id.clone());
    let open = |path: &PathBuf| {
        gpuvm_vmm::outputs::open_nonblocking(path)
            .map_err(|e| CliError::Other(format!("cannot open {}: {e}", path.display())))
    };
    if let Some(path) = &args.log_path {
        gpuvm_vmm::outputs::LOG.set(open(path)?);
    }
    if let Some(path) = &args.metrics_path {
        gpuvm_vmm::outputs::METRICS_OUT.set(open(path)?);
    }
    // The MMDS store's limit is the controller's, set before any request is served (the
    // controller's own store has the default already).
    let mut actions = Vec::new();
    if args.mmds_size_limit != gpuvm_api::firecracker::DEFAULT_MMDS_SIZE_LIMIT {
        actions.push(VmmAction::SetMmdsSizeLimit(args.mmds_size_limit));
    }
    if let Some(path) = &args.config_file {
        let bytes = gpuvm_memory::snapshot::read_regular_file(path, 1 << 20)
            .map_err(|e| CliError::Other(format!("config file {}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| CliError::Other(format!("config file {}: {e}", path.display())))?;
        // Its mmds-config is one of its actions (PUT /mmds/config's): before the
        // start, so the interfaces it names answer MMDS from their creation.
        let file = gpuvm_api::firecracker::translate::config_file(&json, &session.cwd)
            .map_err(|e| CliError::Other(format!("config file {}: {e}", path.display())))?;
        // GET /vm/config echoes the file's sections: the controller keeps them.
        let record = gpuvm_api::firecracker::config_file_record(&json);
        actions.push(VmmAction::Remember(record));
        actions.extend(file);
        actions.push(VmmAction::StartInstance);
    }
    let seccomp = SeccompArgs {
        no_seccomp: !args.seccomp,
        seccomp: false,
    };
    seccomp.enable()?;
    if args.metrics_path.is_some() {
        gpuvm_vmm::outputs::start_periodic_metrics();
    }
    let (vmm, vmm_end) = action_channel().map_err(gpuvm_vmm::Error::EventFd)?;
    // The API's clients wait while the config file boots the VM, as Firecracker's do.
    let (started, under_way) = StartGate::held();
    let server = match &args.api_sock {
        Some(path) => Some(
            ApiServer::start_firecracker(path, vmm.clone(), session, started)
                .map_err(|e| CliError::Other(e.to_string()))?,
        ),
        None => None,
    };
    let failed = Arc::new(Mutex::new(None));
    if actions.is_empty() {
        // Nothing to configure: requests are answered at once.
        drop((vmm, under_way));
    } else {
        let failed = failed.clone();
        std::thread::Builder::new()
            .name("fc-config".into())
            .spawn(move || configure(actions, vmm, failed, under_way))
            .map_err(|e| CliError::Other(format!("cannot start: {e}")))?;
    }
    let wait_idle = |server: &Option<ApiServer>| {
        if let Some(server) = server {
            server.wait_idle(Duration::from_secs(2));
        }
    };
    run_from_api(
        vmm_end.requests,
        vmm_end.wake,
        process_start,
        &|| wait_idle(&server),
        &|| {
            let failed = failed.lock().unwrap_or_else(|e| e.into_inner()).take();
            failed.map(|message| format!("config file: {message}"))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn firecracker_command_lines_parse() {
        let kata = args(&[
            "/usr/bin/firecracker",
            "--api-sock",
            "/run/fc.sock",
            "--id",
            "vm1",
            "--log-path",
            "/run/log.fifo",
            "--level",
            "Info",
            "--show-level",
            "--show-log-origin",
            "--metrics-path",
            "/run/metrics.fifo",
            "--seccomp-level",
            "0",
            "--boot-timer",
        ]);
        let parsed = parse(&kata).unwrap().unwrap();
        assert_eq!(parsed.api_sock, Some("/run/fc.sock".into()));
        assert_eq!(parsed.id, "vm1");
        assert_eq!(parsed.level, Some(log::LevelFilter::Info));
        assert!(!parsed.seccomp);
        let no_api = args(&["gpuvm", "--fc-compat", "--no-api", "--config-file=/c.json"]);
        let parsed = parse(&no_api).unwrap().unwrap();
        assert_eq!(
            (parsed.api_sock, parsed.config_file),
            (None, Some("/c.json".into()))
        );
        assert!(parse(&args(&["firecracker", "--no-api"])).is_err());
        let limit = parse(&args(&["firecracker", "--mmds-size-limit", "1024"]));
        assert_eq!(limit.unwrap().unwrap().mmds_size_limit, 1024);
        let bad = parse(&args(&["firecracker", "--mmds-size-limit", "-1"])).unwrap_err();
        assert!(bad.contains("--mmds-size-limit"), "{bad}");
        assert_eq!(
            parse(&args(&["firecracker"]))
                .unwrap()
                .unwrap()
                .mmds_size_limit,
            gpuvm_api::firecracker::DEFAULT_MMDS_SIZE_LIMIT
        );
        let unknown = parse(&args(&["firecracker", "--http-api-max-payload-size", "1"]));
        assert!(unknown.unwrap_err().contains("--http-api-max-payload-size"));
        assert!(parse(&args(&["firecracker", "--level", "Loud"])).is_err());
        assert_eq!(parse(&args(&["firecracker", "--version"])).unwrap(), None);
        // gpuvm's own name with Firecracker's flags: nothing to skip but the program.
        let plain = parse(&args(&["/usr/bin/gpuvm", "--api-sock", "/s", "--id", "a"]));
        assert_eq!(plain.unwrap().unwrap().api_sock, Some("/s".into()));
        assert_eq!(
            parse(&args(&["firecracker"])).unwrap().unwrap().api_sock,
            Some(DEFAULT_API_SOCK.into())
        );
    }
}
