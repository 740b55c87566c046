//! gpuvm as `cloud-hypervisor`: when the binary is invoked under that name (a symlink or a
//! hard link), as `gpuvm ch ...` or `gpuvm --ch-compat ...`, or as `gpuvm` with flags only
//! Cloud Hypervisor takes (`gpuvm --api-socket ...`: what Kata starts after resolving a
//! `cloud-hypervisor` symlink; see [`crate::front_end`]), it takes Cloud Hypervisor's
//! command line and serves Cloud Hypervisor's API (`/api/v1/...`) on the `--api-socket`.
//!
//! The VM options (`--kernel`, `--cmdline`, `--initramfs`, `--cpus`, `--memory`, `--disk`,
//! `--net`, `--fs`, `--vsock`, `--rng`, `--device`, `--user-device`, `--serial`,
//! `--console`; their values parsed by [`options`]) become the VmConfig body of
//! `PUT /api/v1/vm.create`, which is answered by the same route a client reaches through
//! the socket (so refusals, defaults and field meanings are the API's), then vm.boot:
//! with a payload the VM boots at once, with or without an API socket, as Cloud
//! Hypervisor's does. `--user-device` and `--net fd=` go through vm.add-user-device and
//! vm.add-net (the descriptors passed as Kata passes them). `--restore` is vm.restore
//! (then vm.resume with `resume=on`). Any failure is `gpuvm: error: <option>: ...`,
//! status 125. Requests on the API socket that arrive while these start requests are
//! under way wait for them (at most [`gpuvm_api::server::START_WAIT`], then 503 with
//! Retry-After), as Cloud Hypervisor's do: an early `vm.resume` finds the VM restored.
//!
//! Also accepted: `--api-socket <path>` (or `path=<path>`; `fd=` is refused), `-v`
//! repeated (more logging), `--seccomp true|false|log`, `--event-monitor ...` (accepted,
//! ignored with a log line: gpuvm writes no event stream), `--log-file <path>` (ignored,
//! logs go to stderr), `-V`/`--version`. Any other option is refused naming it.

mod options;

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuvm_api::http::{Method, Request};
use gpuvm_api::server::{ApiServer, StartGate, StartUnderWay};
use gpuvm_vmm::action::VmmAction;
use gpuvm_vmm::action_channel::{action_channel, ActionSender};
use serde_json::{json, Map, Value};

use crate::args::SeccompArgs;
use crate::run::run_from_api;
use crate::CliError;

/// What the command line asks for at start.
#[derive(Debug, PartialEq)]
enum Start {
    /// vm.create with `config`, the user devices and descriptor-backed interfaces
    /// added, then vm.boot.
    Boot {
        config: Value,
        user_devices: Vec<Value>,
        fd_nets: Vec<options::Net>,
    },
    /// vm.restore with `body` and the tap descriptors its `net_fds` names, then vm.resume
    /// when `resume`.
    Restore {
        body: Value,
        resume: bool,
        tap_fds: Vec<i32>,
    },
}

#[derive(Debug, PartialEq)]
struct ChArgs {
    api_socket: Option<PathBuf>,
    verbosity: u8,
    seccomp: bool,
    start: Option<Start>,
}

/// Walks the arguments: `--flag value`, `--flag=value`, and for the options Cloud
/// Hypervisor lets repeat, several values after one flag (`--disk path=a path=b`).
struct Flags<'a> {
    args: std::iter::Peekable<std::slice::Iter<'a, String>>,
}

impl<'a> Flags<'a> {
    fn next_flag(&mut self) -> Option<(&'a str, Option<&'a str>)> {
        let arg = self.args.next()?;
        Some(match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value)),
            _ => (arg.as_str(), None),
        })
    }

    fn value(&mut self, name: &str, inline: Option<&str>) -> Result<String, String> {
        inline
            .map(str::to_string)
            .or_else(|| self.args.next().cloned())
            .ok_or_else(|| format!("{name} needs a value"))
    }

    /// One value or more: every following argument up to the next flag.
    fn values(&mut self, name: &str, inline: Option<&str>) -> Result<Vec<String>, String> {
        let mut values = vec![self.value(name, inline)?];
        while let Some(next) = self.args.next_if(|a| !a.starts_with('-')) {
            values.push(next.clone());
        }
        Ok(values)
    }
}

/// The VM options given, by their VmConfig section.
#[derive(Default)]
struct VmOptions {
    payload: Map<String, Value>,
    /// `cpus`, `memory`, `vsock`, `rng`, `serial`, `console`: given once each.
    single: Map<String, Value>,
    disks: Vec<Value>,
    nets: Vec<options::Net>,
    fs: Vec<Value>,
    devices: Vec<Value>,
    user_devices: Vec<Value>,
    /// `--numa`: one guest NUMA node each.
    numa: Vec<Value>,
    /// The VM options named (they need `--kernel`, as in Cloud Hypervisor).
    named: Vec<&'static str>,
}

impl VmOptions {
    fn set_once(&mut self, option: &str, section: &str, value: Value) -> Result<(), String> {
        if self.single.insert(section.into(), value).is_some() {
            return Err(format!("{option} given twice: it takes one value"));
        }
        Ok(())
    }

    /// The vm.create body: Cloud Hypervisor's defaults (one vCPU, 512 MiB, an entropy
    /// device on /dev/urandom) where the options left them out.
    fn config(&mut self) -> Value {
        let mut config = Map::new();
        config.insert("payload".into(), Value::Object(self.payload.clone()));
        config.insert("cpus".into(), json!({"boot_vcpus": 1, "max_vcpus": 1}));
        config.insert("memory".into(), json!({"size": 512u64 << 20}));
        config.insert("rng".into(), json!({"src": "/dev/urandom"}));
        config.extend(self.single.clone());
        let tap_nets: Vec<Value> = self
            .nets
            .iter()
            .filter(|n| n.fds.is_empty())
            .map(|n| n.config.clone())
            .collect();
        for (section, list) in [
            ("disks", &self.disks),
            ("net", &tap_nets),
            ("fs", &self.fs),
            ("devices", &self.devices),
            ("numa", &self.numa),
        ] {
            if !list.is_empty() {
                config.insert(section.into(), Value::Array(list.clone()));
            }
        }
        Value::Object(config)
    }
}

const ACCEPTED: &str = "--api-socket, --kernel, --cmdline, --initramfs, --cpus, --memory, --disk, --net, --fs, --vsock, --rng, --device, --user-device, --numa, --serial, --console, --restore, -v, --seccomp, --event-monitor, --log-file, --version";

fn parse(args: &[String]) -> Result<Option<ChArgs>, String> {
    let mut api_socket = None;
    let mut verbosity = 0u8;
    let mut seccomp = true;
    let mut restore = None;
    let mut vm = VmOptions::default();
    let skip = if matches!(args.get(1).map(String::as_str), Some("--ch-compat" | "ch")) {
        2
    } else {
        1
    };
    let mut flags = Flags {
        args: args.get(skip..).unwrap_or_default().iter().peekable(),
    };
    let error = |e: options::OptionError| e.to_string();
    while let Some((name, inline)) = flags.next_flag() {
        match name {
            "-V" | "--version" => return Ok(None),
            "-v" | "-vv" | "-vvv" | "-vvvv" => {
                verbosity = verbosity.saturating_add((name.len() - 1) as u8)
            }
            "--api-socket" => {
                let value = flags.value(name, inline)?;
                let path = match value.split_once('=') {
                    Some(("path", path)) => path.to_string(),
                    Some(("fd", _)) => {
                        return Err(
                            "--api-socket fd=...: gpuvm binds the socket itself; give a path"
                                .into(),
                        )
                    }
                    _ => value,
                };
                api_socket = Some(PathBuf::from(path));
            }
            "--seccomp" => {
                seccomp = match flags.value(name, inline)?.as_str() {
                    "true" => true,
                    "false" => false,
                    // gpuvm's filters kill on a violation; there is no log-only mode here.
                    "log" => true,
                    other => return Err(format!("--seccomp {other:?}: true, false or log")),
                }
            }
            "--event-monitor" => {
                let value = flags.value(name, inline)?;
                log::info!(target: crate::LOG_TARGET, "--event-monitor {value} ignored: gpuvm writes no event stream");
            }
            "--log-file" => {
                let value = flags.value(name, inline)?;
                log::info!(target: crate::LOG_TARGET, "--log-file {value} ignored: gpuvm logs to stderr");
            }
            "--restore" => {
                if restore.is_some() {
                    return Err("--restore given twice".into());
                }
                restore = Some(options::restore(&flags.value(name, inline)?).map_err(error)?);
            }
            "--kernel" | "--cmdline" | "--initramfs" => {
                let field = &name[2..];
                let mut value = flags.value(name, inline)?;
                if name != "--cmdline" {
                    value = options::absolute(&value);
                }
                if vm.payload.insert(field.into(), json!(value)).is_some() {
                    return Err(format!("{name} given twice: it takes one value"));
                }
            }
            "--cpus" | "--memory" | "--vsock" | "--rng" | "--serial" | "--console" => {
                let text = flags.value(name, inline)?;
                let value = match name {
                    "--cpus" => options::cpus(&text),
                    "--memory" => options::memory(&text),
                    "--vsock" => options::vsock(&text),
                    "--rng" => options::rng(&text),
                    _ => options::console(name, &text),
                }
                .map_err(error)?;
                vm.set_once(name, &name[2..], value)?;
                vm.named.push(option_name(name));
            }
            "--disk" | "--net" | "--fs" | "--device" | "--user-device" | "--numa" => {
                for text in flags.values(name, inline)? {
                    match name {
                        "--disk" => vm.disks.push(options::disk(&text).map_err(error)?),
                        "--net" => vm.nets.push(options::net(&text).map_err(error)?),
                        "--fs" => vm.fs.push(options::fs(&text).map_err(error)?),
                        "--device" => vm.devices.push(options::device(&text).map_err(error)?),
                        "--numa" => vm.numa.push(options::numa(&text).map_err(error)?),
                        _ => vm
                            .user_devices
                            .push(options::user_device(&text).map_err(error)?),
                    }
                }
                vm.named.push(option_name(name));
            }
            other => {
                return Err(format!(
                    "{other}: not supported by gpuvm's Cloud Hypervisor mode (it takes {ACCEPTED})"
                ))
            }
        }
    }
    let mut passed = Vec::new();
    for fd in vm.nets.iter().flat_map(|n| &n.fds) {
        if passed.contains(fd) {
            return Err(format!("--net fd={fd}: named by two interfaces"));
        }
        passed.push(*fd);
    }
    let start = match (vm.payload.contains_key("kernel"), restore) {
        (true, Some(_)) => {
            return Err(
                "--restore and --kernel: give one (a restored VM brings its own payload)".into(),
            )
        }
        (true, None) => Some(Start::Boot {
            config: vm.config(),
            user_devices: std::mem::take(&mut vm.user_devices),
            fd_nets: std::mem::take(&mut vm.nets)
                .into_iter()
                .filter(|n| !n.fds.is_empty())
                .collect(),
        }),
        (false, restore) => {
            let payload = vm.payload.keys().map(|k| format!("--{k}"));
            if let Some(option) = vm.named.iter().map(|o| o.to_string()).chain(payload).next() {
                return Err(format!(
                    "{option} needs --kernel: the VM is configured on the command line only with a payload (or through PUT /api/v1/vm.create)"
                ));
            }
            restore.map(|(body, resume, tap_fds)| Start::Restore {
                body,
                resume,
                tap_fds,
            })
        }
    };
    if api_socket.is_none() && start.is_none() {
        return Err("--api-socket is required without --kernel or --restore: the VM is configured through the API".into());
    }
    Ok(Some(ChArgs {
        api_socket,
        verbosity,
        seccomp,
        start,
    }))
}

/// The options' names as `&'static str` (the option table is fixed).
fn option_name(name: &str) -> &'static str {
    const NAMES: &[&str] = &[
        "--cpus",
        "--memory",
        "--vsock",
        "--rng",
        "--serial",
        "--console",
        "--disk",
        "--net",
        "--fs",
        "--device",
        "--user-device",
        "--numa",
    ];
    NAMES.iter().find(|n| **n == name).copied().unwrap_or("--")
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
    match serve(parsed, process_start) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            crate::gpuvm_error()
        }
    }
}

/// One request the command line makes of the API's routes at start.
struct StartRequest {
    /// What a refusal is blamed on, when the answer does not name a section.
    blame: &'static str,
    path: &'static str,
    body: Value,
    fds: Vec<OwnedFd>,
}

/// Takes ownership of a tap descriptor named by `--net fd=` or `--restore net_fds=`
/// (`named_by`).
fn take_tap_fd(fd: i32, named_by: &str) -> Result<OwnedFd, CliError> {
    // SAFETY: F_GETFD only reads the descriptor's flags; any number may be asked about.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(CliError::Other(format!(
            "{named_by} {fd}: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: the descriptor is open (checked above) and was handed to this process for
    // the interface, as the option says; parse() refused any number named twice and the
    // standard streams, so this is its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn start_requests(start: Start) -> Result<Vec<StartRequest>, CliError> {
    let request = |blame, path, body| StartRequest {
        blame,
        path,
        body,
        fds: Vec::new(),
    };
    Ok(match start {
        Start::Boot {
            config,
            user_devices,
            fd_nets,
        } => {
            let mut requests = vec![request("vm.create", "/api/v1/vm.create", config)];
            for net in fd_nets {
                let fds = net
                    .fds
                    .iter()
                    .map(|fd| take_tap_fd(*fd, "--net fd="))
                    .collect::<Result<_, _>>()?;
                requests.push(StartRequest {
                    fds,
                    ..request("--net", "/api/v1/vm.add-net", net.config)
                });
            }
            for device in user_devices {
                requests.push(request(
                    "--user-device",
                    "/api/v1/vm.add-user-device",
                    device,
                ));
            }
            requests.push(request("booting", "/api/v1/vm.boot", Value::Null));
            requests
        }
        Start::Restore {
            body,
            resume,
            tap_fds,
        } => {
            let fds = tap_fds
                .iter()
                .map(|fd| take_tap_fd(*fd, "--restore net_fds="))
                .collect::<Result<_, _>>()?;
            let mut requests = vec![StartRequest {
                fds,
                ..request("--restore", "/api/v1/vm.restore", body)
            }];
            if resume {
                requests.push(request(
                    "--restore resume=on",
                    "/api/v1/vm.resume",
                    Value::Null,
                ));
            }
            requests
        }
    })
}

/// The option a refusal of vm.create is about: the API names the VmConfig field.
fn blame(request_blame: &'static str, message: &str) -> &'static str {
    if request_blame != "vm.create" {
        return request_blame;
    }
    const SECTIONS: &[(&str, &str)] = &[
        ("payload", "--kernel"),
        ("cpus", "--cpus"),
        ("memory", "--memory"),
        ("disks", "--disk"),
        ("net", "--net"),
        ("fs", "--fs"),
        ("vsock", "--vsock"),
        ("rng", "--rng"),
        ("devices", "--device"),
        ("serial", "--serial"),
        ("console", "--console"),
        ("numa", "--numa"),
    ];
    let section = message
        .split(['.', '[', ' ', ':'])
        .next()
        .unwrap_or_default();
    // The boot source is opened when it is configured: those messages name the file.
    const FILES: &[(&str, &str)] = &[("kernel image", "--kernel"), ("initrd", "--initramfs")];
    SECTIONS
        .iter()
        .find(|(name, _)| *name == section)
        .or_else(|| FILES.iter().find(|(what, _)| message.contains(what)))
        .map_or(request_blame, |(_, option)| option)
}

/// Sends the start requests through the API's routes one by one; the first refusal is
/// kept in `failed` and ends the VMM instead. The API socket's clients wait until this
/// returns (`_under_way` is dropped then).
fn configure(
    requests: Vec<StartRequest>,
    vmm: ActionSender,
    failed: Arc<Mutex<Option<String>>>,
    _under_way: StartUnderWay,
) {
    for start in requests {
        let request = Request {
            method: Method::Put,
            path: start.path.into(),
            body: match &start.body {
                Value::Null => Vec::new(),
                body => body.to_string().into_bytes(),
            },
            close: false,
        };
        log::info!(target: crate::LOG_TARGET, "command line: PUT {} {}", start.path, start.body);
        let response =
            gpuvm_api::cloud_hypervisor::handle(&request, start.fds, &|a| vmm.dispatch(a));
        if response.status < 300 {
            continue;
        }
        // Cloud Hypervisor's error body: an array of messages, the error first.
        let answer: Value = serde_json::from_slice(&response.body).unwrap_or_default();
        let message = answer[0].as_str().map_or_else(
            || String::from_utf8_lossy(&response.body).into_owned(),
            str::to_string,
        );
        let message = format!("{}: {message}", blame(start.blame, &message));
        log::error!(target: crate::LOG_TARGET, "command line: {message}");
        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
        let _ = vmm.dispatch(VmmAction::ShutdownVmm);
        return;
    }
}

fn serve(args: ChArgs, process_start: Instant) -> Result<ExitCode, CliError> {
    let requests = match args.start {
        Some(start) => start_requests(start)?,
        None => Vec::new(),
    };
    let seccomp = SeccompArgs {
        no_seccomp: !args.seccomp,
        seccomp: false,
    };
    seccomp.enable()?;
    let (vmm, vmm_end) = action_channel().map_err(gpuvm_vmm::Error::EventFd)?;
    // The API's clients wait while the command line boots or restores the VM, as Cloud
    // Hypervisor's do.
    let (started, under_way) = StartGate::held();
    let server = match &args.api_socket {
        Some(path) => Some(
            ApiServer::start_cloud_hypervisor(path, vmm.clone(), started)
                .map_err(|e| CliError::Other(e.to_string()))?,
        ),
        None => None,
    };
    let failed = Arc::new(Mutex::new(None));
    if requests.is_empty() {
        // Nothing to start: requests are answered at once.
        drop((vmm, under_way));
    } else {
        let failed = failed.clone();
        std::thread::Builder::new()
            .name("ch-config".into())
            .spawn(move || configure(requests, vmm, failed, under_way))
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
        &|| failed.lock().unwrap_or_else(|e| e.into_inner()).take(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn parsed(list: &[&str]) -> ChArgs {
        parse(&args(list)).unwrap().unwrap()
    }

    fn refused(list: &[&str]) -> String {
        parse(&args(list)).unwrap_err()
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
        assert_eq!(
            parse(&kata).unwrap(),
            Some(ChArgs {
                api_socket: Some("/run/vc/clh-api.sock".into()),
                verbosity: 1,
                seccomp: false,
                start: None,
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
        assert_eq!(
            parse(&compat).unwrap().unwrap().api_socket,
            Some("/s".into())
        );
        assert_eq!(
            parsed(&["gpuvm", "ch", "--api-socket=/s"]).api_socket,
            Some("/s".into())
        );
        // gpuvm's own name with Cloud Hypervisor's flags (what Kata starts through a
        // resolved symlink): nothing to skip but the program.
        assert_eq!(
            parsed(&["/usr/bin/gpuvm", "--api-socket", "/s", "-v"]).api_socket,
            Some("/s".into())
        );
        assert!(parse(&args(&["cloud-hypervisor"])).is_err());
        assert!(parse(&args(&["cloud-hypervisor", "--api-socket", "fd=3"])).is_err());
        assert_eq!(parse(&args(&["cloud-hypervisor", "-V"])), Ok(None));
    }

    #[test]
    fn a_payload_makes_the_vm_config() {
        let boot = parsed(&[
            "cloud-hypervisor",
            "--kernel",
            "/k",
            "--cmdline",
            "console=ttyS0 -- x",
            "--initramfs=/i",
            "--cpus",
            "boot=2",
            "--memory",
            "size=256M,shared=on",
            "--rng",
            "src=/dev/urandom",
            "--serial",
            "tty",
            "--console",
            "off",
            "--vsock",
            "cid=3,socket=/v",
        ]);
        assert_eq!(boot.api_socket, None);
        let Some(Start::Boot {
            config,
            user_devices,
            fd_nets,
        }) = boot.start
        else {
            panic!("no boot: {boot:?}");
        };
        assert_eq!(
            config,
            json!({
                "payload": {"kernel": "/k", "cmdline": "console=ttyS0 -- x", "initramfs": "/i"},
                "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
                "memory": {"size": 256u64 << 20, "shared": true},
                "rng": {"src": "/dev/urandom"},
                "serial": {"mode": "Tty"},
                "console": {"mode": "Off"},
                "vsock": {"cid": 3, "socket": "/v"},
            })
        );
        assert!(user_devices.is_empty() && fd_nets.is_empty());
        // The defaults of Cloud Hypervisor's command line.
        let Some(Start::Boot { config, .. }) =
            parsed(&["cloud-hypervisor", "--kernel", "/k"]).start
        else {
            panic!("no boot");
        };
        assert_eq!(
            config,
            json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
                   "memory": {"size": 512u64 << 20}, "rng": {"src": "/dev/urandom"}})
        );
    }

    #[test]
    fn repeatable_options_take_several_values() {
        let boot = parsed(&[
            "cloud-hypervisor",
            "--api-socket",
            "/s",
            "--kernel",
            "/k",
            "--disk",
            "path=/a.img",
            "path=/b.img,readonly=on",
            "--disk=path=/c.img",
            "--net",
            "tap=tap0",
            "fd=[3,4],id=net1",
            "--fs",
            "tag=t,socket=/fs",
            "--device",
            "path=/sys/bus/pci/devices/0000:01:00.0",
            "--user-device",
            "socket=/u1",
            "socket=/u2",
            "-v",
        ]);
        assert_eq!(boot.verbosity, 1);
        let Some(Start::Boot {
            config,
            user_devices,
            fd_nets,
        }) = boot.start
        else {
            panic!("no boot");
        };
        let paths: Vec<&str> = config["disks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["path"].as_str().unwrap())
            .collect();
        assert_eq!(paths, ["/a.img", "/b.img", "/c.img"]);
        assert_eq!(config["disks"][1]["readonly"], true);
        // The interface whose taps are passed goes through vm.add-net, not vm.create.
        assert_eq!(config["net"], json!([{"tap": "tap0"}]));
        assert_eq!(
            fd_nets,
            vec![options::Net {
                config: json!({"id": "net1"}),
                fds: vec![3, 4]
            }]
        );
        assert_eq!(config["fs"], json!([{"tag": "t", "socket": "/fs"}]));
        assert_eq!(
            config["devices"][0]["path"],
            "/sys/bus/pci/devices/0000:01:00.0"
        );
        assert_eq!(
            user_devices,
            vec![json!({"socket": "/u1"}), json!({"socket": "/u2"})]
        );
    }

    #[test]
    fn restore_at_start() {
        let restore = parsed(&[
            "cloud-hypervisor",
            "--api-socket",
            "/s",
            "--restore",
            "source_url=file:///snap,prefault=on",
        ]);
        assert_eq!(
            restore.start,
            Some(Start::Restore {
                body: json!({"source_url": "file:///snap", "prefault": true}),
                resume: false,
                tap_fds: Vec::new(),
            })
        );
        // Cloud Hypervisor's net_fds: new taps for the interfaces that came as descriptors.
        let with_taps = parsed(&[
            "cloud-hypervisor",
            "--restore",
            "source_url=file:///s,net_fds=[net0@[23,24],net1@[25]]",
        ]);
        assert_eq!(
            with_taps.start,
            Some(Start::Restore {
                body: json!({"source_url": "file:///s", "net_fds": [
                    {"id": "net0", "num_fds": 2}, {"id": "net1", "num_fds": 1}]}),
                resume: false,
                tap_fds: vec![23, 24, 25],
            })
        );
        for bad in [
            "net_fds=[net0@[2]]",
            "net_fds=[net0@[23],net1@[23]]",
            "net_fds=net0@[23]",
            "net_fds=[@[23]]",
            "net_fds=[net0]",
        ] {
            let line = format!("source_url=file:///s,{bad}");
            let refused = refused(&["cloud-hypervisor", "--restore", &line]);
            assert!(refused.contains("net_fds"), "{bad}: {refused}");
        }
        // Without a socket: nothing could resume it but resume=on.
        let resumed = parsed(&[
            "cloud-hypervisor",
            "--restore",
            "source_url=file:///s,resume=on",
        ]);
        assert!(matches!(
            resumed.start,
            Some(Start::Restore { resume: true, .. })
        ));
        assert!(refused(&[
            "cloud-hypervisor",
            "--restore",
            "source_url=file:///s",
            "--kernel",
            "/k"
        ])
        .contains("--restore and --kernel"));
        assert!(refused(&["cloud-hypervisor", "--restore", "prefault=on"]).contains("source_url"));
    }

    #[test]
    fn bad_command_lines_name_the_option_and_key() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--kernel", "/k", "--cpus", "boot=2,frobnicate=1"],
                "--cpus frobnicate: unknown key",
            ),
            (
                &["--kernel", "/k", "--memory", "size=12X"],
                "--memory size=12X",
            ),
            (
                &["--kernel", "/k", "--memory", "shared=maybe"],
                "--memory shared=maybe",
            ),
            (
                &["--kernel", "/k", "--disk", "path=/x,bw_size=10"],
                "--disk bw_size: not supported",
            ),
            (
                &["--kernel", "/k", "--disk", "readonly=on"],
                "--disk: path= is required",
            ),
            (&["--kernel", "/k", "--serial", "loud"], "--serial loud"),
            (
                &["--kernel", "/k", "--cpus", "boot=1", "--cpus", "boot=2"],
                "--cpus given twice",
            ),
            (
                &["--kernel", "/k", "--kernel", "/k2"],
                "--kernel given twice",
            ),
            (
                &["--kernel", "/k", "--net", "fd=3", "--net", "fd=3"],
                "--net fd=3: named by two",
            ),
            (&["--kernel", "/k", "--net", "fd=2"], "--net fd="),
            (
                &["--kernel", "/k", "--balloon", "size=1G"],
                "--balloon: not supported",
            ),
            (
                &["--api-socket", "/s", "--cpus", "boot=2"],
                "--cpus needs --kernel",
            ),
            (
                &["--api-socket", "/s", "--cmdline", "x"],
                "--cmdline needs --kernel",
            ),
            (&["--kernel"], "--kernel needs a value"),
            (&["--kernel", "/k", "--disk"], "--disk needs a value"),
            (&["--seccomp", "maybe", "--api-socket", "/s"], "--seccomp"),
        ];
        for (list, needle) in cases {
            let mut argv = vec!["cloud-hypervisor"];
            argv.extend_from_slice(list);
            let message = refused(&argv);
            assert!(
                message.contains(needle),
                "{list:?}: {message:?} lacks {needle:?}"
            );
        }
    }

    #[test]
    fn refusals_of_vm_create_are_blamed_on_their_option() {
        assert_eq!(
            blame("vm.create", "disks[1].num_queues = 4 is not supported"),
            "--disk"
        );
        assert_eq!(
            blame(
                "vm.create",
                "cpus.boot_vcpus = 0: gpuvm runs 1 to 255 vCPUs"
            ),
            "--cpus"
        );
        assert_eq!(
            blame("vm.create", "serial.mode = \"Pty\" is not supported"),
            "--serial"
        );
        assert_eq!(blame("vm.create", "payload.kernel is required"), "--kernel");
        assert_eq!(
            blame("vm.create", "cannot open kernel image /k: No such file"),
            "--kernel"
        );
        assert_eq!(blame("vm.create", "something else"), "vm.create");
        assert_eq!(blame("--user-device", "pci_device_id = 3"), "--user-device");
        assert_eq!(
            blame(
                "vm.create",
                "numa[0].memory_zones: gpuvm has no memory zones"
            ),
            "--numa"
        );
    }

    /// `--numa`, once per node, fills the `numa` field of the vm.create body; the
    /// translation then gives the same machine config the API field gives, and refuses
    /// memory zones and PCI segments by name.
    #[test]
    fn numa_nodes_become_the_numa_field() {
        let base = [
            "cloud-hypervisor",
            "--kernel",
            "/k",
            "--cpus",
            "boot=2",
            "--memory",
            "size=1G",
            "--numa",
        ];
        let config_of = |nodes: &[&str]| {
            let mut argv: Vec<&str> = base.to_vec();
            argv.extend_from_slice(nodes);
            let Some(Start::Boot { config, .. }) = parsed(&argv).start else {
                panic!("no boot: {argv:?}");
            };
            config
        };
        let config = config_of(&[
            "guest_numa_id=0,cpus=[0],distances=[1@25]",
            "guest_numa_id=1,cpus=1,distances=[0@25]",
        ]);
        assert_eq!(
            config["numa"],
            json!([
                {"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}]},
                {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}]}
            ])
        );
        let from_flag = machine_numa(&config).unwrap();
        let mut api_body = config.clone();
        api_body["numa"] = json!([
            {"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}]},
            {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}]}
        ]);
        assert_eq!(from_flag, machine_numa(&api_body).unwrap());
        assert_eq!(from_flag["distances"], json!([[10, 25], [25, 10]]));
        // pci_segments: the node's host bridges, segment 0 being the VM's one.
        let placed = machine_numa(&config_of(&["guest_numa_id=0,cpus=[0-1],pci_segments=[0]"]));
        assert_eq!(placed.unwrap()["nodes"][0]["pci_segments"], json!([0]));

        for (node, named) in [
            (
                "guest_numa_id=0,cpus=[0-1],memory_zones=[mem0]",
                "numa[0].memory_zones",
            ),
            (
                "guest_numa_id=0,cpus=[0-1],pci_segments=[1]",
                "numa[0].pci_segments[0] = 1: the VM has 1 PCI segment(s)",
            ),
            (
                "guest_numa_id=0,cpus=[0-1],sgx_epc_sections=epc0",
                "numa[0].sgx_epc_sections",
            ),
        ] {
            let error = machine_numa(&config_of(&[node])).unwrap_err();
            assert!(error.contains(named), "{node}: {error}");
            assert_eq!(blame("vm.create", &error), "--numa", "{error}");
        }
    }

    /// What the API's translation of vm.create `config` gives PUT /machine-config as
    /// `numa`, or its refusal.
    fn machine_numa(config: &Value) -> Result<Value, String> {
        use gpuvm_api::cloud_hypervisor::config::VmConfig;
        use gpuvm_vmm::action::VmmAction;
        let config: VmConfig = serde_json::from_value(config.clone()).map_err(|e| e.to_string())?;
        let actions = gpuvm_api::cloud_hypervisor::translate::vm_config(&config)?;
        match actions.first() {
            Some(VmmAction::PutMachineConfig(machine)) => {
                Ok(serde_json::to_value(&machine.numa).map_err(|e| e.to_string())?)
            }
            other => Err(format!("{other:?}")),
        }
    }
}
