//! Firecracker's request bodies, with its field names, and their translation onto
//! gpuvm's actions. A field gpuvm cannot honour is refused naming it, never ignored.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use gpuvm_vmm::action::{
    BackingKind, BootSourceBody, DriveBody, LoadOverrides, LoggerConfig, MachineConfigBody,
    MachineConfigPatch, MetricsConfig, NetworkOverride, RestoreModeBody, SnapshotCreateBody,
    SnapshotLoadBody, SnapshotType, VmmAction,
};

/// A refusal's fault message.
pub type Refusal = String;

/// Relative paths are resolved against gpuvm's working directory, as Firecracker does.
pub fn resolve(cwd: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        cwd.join(path)
    }
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, body: &Value) -> Result<T, Refusal> {
    T::deserialize(body).map_err(|e| format!("invalid {what} body: {e}"))
}

/// PUT and PATCH /machine-config (all optional in a PATCH; gpuvm's own fields such as
/// `backing`, `thp`, `prefault` and `cpuid_masks` are accepted as extensions).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineConfig {
    pub vcpu_count: Option<u8>,
    pub mem_size_mib: Option<u64>,
    pub smt: Option<bool>,
    pub cpu_template: Option<String>,
    pub track_dirty_pages: Option<bool>,
    pub huge_pages: Option<String>,
    pub backing: Option<BackingKind>,
    pub thp: Option<bool>,
    pub prefault: Option<bool>,
    pub cpuid_masks: Option<Vec<String>>,
}

/// PATCH /machine-config: the fields given, checked, for the VMM thread to apply to the
/// configuration it holds (one action: nothing comes between reading and writing it).
pub fn machine_config_patch(body: &Value) -> Result<MachineConfigPatch, Refusal> {
    let fc: MachineConfig = parse("machine-config", body)?;
    if fc.smt == Some(true) {
        return Err(
            "machine-config smt: true is not supported by gpuvm (each vCPU is a core of its own; smt: false is accepted)"
                .into(),
        );
    }
    if let Some(template) = &fc.cpu_template {
        if template != "None" {
            return Err(format!(
                "machine-config cpu_template {template:?} is not supported by gpuvm (only \"None\"; hide CPUID features with gpuvm's cpuid_masks)"
            ));
        }
    }
    let huge = match fc.huge_pages.as_deref() {
        None => None,
        Some("None") => Some(BackingKind::Memfd),
        Some("2M") => Some(BackingKind::Hugetlb2M),
        Some(other) => {
            return Err(format!(
                "machine-config huge_pages {other:?}: gpuvm takes \"None\" or \"2M\""
            ))
        }
    };
    Ok(MachineConfigPatch {
        vcpu_count: fc.vcpu_count,
        mem_size_mib: fc.mem_size_mib,
        track_dirty_pages: fc.track_dirty_pages,
        backing: huge.or(fc.backing),
        thp: fc.thp,
        prefault: fc.prefault,
        cpuid_masks: fc.cpuid_masks,
    })
}

/// PUT /machine-config (and a config file's section): vcpu_count and mem_size_mib
/// required, the rest gpuvm's defaults unless given.
pub fn machine_config(body: &Value) -> Result<MachineConfigBody, Refusal> {
    let patch = machine_config_patch(body)?;
    let (Some(vcpu_count), Some(mem_size_mib)) = (patch.vcpu_count, patch.mem_size_mib) else {
        return Err(
            "machine-config needs vcpu_count and mem_size_mib (PATCH changes single fields)".into(),
        );
    };
    let mut out: MachineConfigBody = serde_json::from_value(serde_json::json!({
        "vcpu_count": vcpu_count, "mem_size_mib": mem_size_mib,
    }))
    .map_err(|e| e.to_string())?;
    patch.apply(&mut out);
    Ok(out)
}

/// gpuvm's machine configuration in Firecracker's shape (GET /machine-config).
pub fn machine_config_json(gpuvm: &Value) -> Value {
    let huge_pages = match gpuvm["backing"].as_str() {
        Some("hugetlb-2m") => "2M",
        _ => "None",
    };
    serde_json::json!({
        "vcpu_count": gpuvm["vcpu_count"],
        "mem_size_mib": gpuvm["mem_size_mib"],
        "smt": false,
        "track_dirty_pages": gpuvm["track_dirty_pages"],
        "huge_pages": huge_pages,
        "backing": gpuvm["backing"],
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BootSource {
    kernel_image_path: PathBuf,
    initrd_path: Option<PathBuf>,
    boot_args: Option<String>,
}

/// PUT /boot-source.
pub fn boot_source(body: &Value, cwd: &Path) -> Result<BootSourceBody, Refusal> {
    let fc: BootSource = parse("boot-source", body)?;
    Ok(BootSourceBody {
        kernel_image_path: Some(resolve(cwd, &fc.kernel_image_path)),
        initrd_path: fc.initrd_path.map(|p| resolve(cwd, &p)),
        boot_args: fc.boot_args,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Logger {
    log_path: Option<PathBuf>,
    level: Option<String>,
    show_level: Option<bool>,
    show_log_origin: Option<bool>,
    module: Option<String>,
}

/// Firecracker's level names (case-insensitive, as it accepts them).
pub fn level(name: &str) -> Result<log::LevelFilter, Refusal> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "off" => log::LevelFilter::Off,
        "error" => log::LevelFilter::Error,
        "warning" | "warn" => log::LevelFilter::Warn,
        "info" => log::LevelFilter::Info,
        "debug" => log::LevelFilter::Debug,
        "trace" => log::LevelFilter::Trace,
        _ => {
            return Err(format!(
                "logger level {name:?}: Off, Error, Warning, Info, Debug or Trace"
            ))
        }
    })
}

/// PUT /logger. `show_level` and `show_log_origin` are accepted: gpuvm's log lines
/// always carry the level and the module.
pub fn logger(body: &Value, cwd: &Path) -> Result<LoggerConfig, Refusal> {
    let fc: Logger = parse("logger", body)?;
    let _ = (fc.show_level, fc.show_log_origin);
    if let Some(module) = fc.module {
        return Err(format!(
            "logger module {module:?} is not supported by gpuvm (filter modules with GPUVM_LOG)"
        ));
    }
    let Some(path) = fc.log_path else {
        return Err("logger log_path: gpuvm needs a file or FIFO to write to".into());
    };
    Ok(LoggerConfig {
        path: resolve(cwd, &path),
        level: fc.level.as_deref().map(level).transpose()?,
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Metrics {
    metrics_path: PathBuf,
}

/// PUT /metrics.
pub fn metrics(body: &Value, cwd: &Path) -> Result<MetricsConfig, Refusal> {
    let fc: Metrics = parse("metrics", body)?;
    Ok(MetricsConfig {
        path: resolve(cwd, &fc.metrics_path),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotCreate {
    snapshot_path: PathBuf,
    mem_file_path: PathBuf,
    #[serde(default)]
    snapshot_type: SnapshotType,
}

/// PUT /snapshot/create: a state file and a memory file, the memory a raw guest-RAM image
/// in Firecracker's layout (see `gpuvm_vmm::snapshot::files`); a Diff's holds only the
/// dirty pages.
pub fn snapshot_create(body: &Value, cwd: &Path) -> Result<SnapshotCreateBody, Refusal> {
    let fc: SnapshotCreate = parse("snapshot/create", body)?;
    Ok(SnapshotCreateBody {
        snapshot_type: fc.snapshot_type,
        mem_file_path: Some(resolve(cwd, &fc.mem_file_path)),
        ..SnapshotCreateBody::full(resolve(cwd, &fc.snapshot_path))
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MemBackend {
    backend_type: String,
    backend_path: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotLoad {
    snapshot_path: PathBuf,
    mem_file_path: Option<PathBuf>,
    mem_backend: Option<MemBackend>,
    #[serde(default)]
    enable_diff_snapshots: bool,
    #[serde(default)]
    track_dirty_pages: bool,
    #[serde(default)]
    resume_vm: bool,
    #[serde(default)]
    network_overrides: Option<Vec<NetworkOverride>>,
    #[serde(default)]
    vsock_override: Option<VsockOverride>,
    #[serde(default)]
    clock_realtime: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VsockOverride {
    uds_path: PathBuf,
}

/// PUT /snapshot/load. `File` (and the older `mem_file_path`) restores lazily: the guest
/// runs at once and pages load on fault and in the background, from the raw image (or a
/// gpuvm-format memory file, when the state file is one written before raw images).
/// `Uffd` hands the faults to the external handler at `backend_path`, which serves them
/// from the raw image; gpuvm then reads the memory layout from its own snapshot
/// directory, the hidden `.<state file>.gpuvm` beside the state file that PUT
/// /snapshot/create wrote.
///
/// `track_dirty_pages` (or the older `enable_diff_snapshots`) turns dirty-page tracking on
/// in the restored VM (a Diff snapshot may follow); `network_overrides` give interfaces of
/// the snapshot new taps and `vsock_override` the vsock device a new socket path (an
/// `iface_id` the snapshot does not have is refused when the snapshot is read).
pub fn snapshot_load(
    body: &Value,
    cwd: &Path,
) -> Result<(SnapshotLoadBody, LoadOverrides), Refusal> {
    let fc: SnapshotLoad = parse("snapshot/load", body)?;
    let network_overrides = fc.network_overrides.unwrap_or_default();
    for (i, over) in network_overrides.iter().enumerate() {
        if network_overrides[..i]
            .iter()
            .any(|o| o.iface_id == over.iface_id)
        {
            return Err(format!(
                "snapshot/load network_overrides names {:?} twice",
                over.iface_id
            ));
        }
    }
    let overrides = LoadOverrides {
        track_dirty_pages: fc.enable_diff_snapshots || fc.track_dirty_pages,
        network_overrides,
        vsock_uds_path: fc.vsock_override.map(|v| resolve(cwd, &v.uds_path)),
    };
    if fc.clock_realtime {
        return Err("snapshot/load clock_realtime is not supported by gpuvm".into());
    }
    let state = resolve(cwd, &fc.snapshot_path);
    let mut load = SnapshotLoadBody {
        snapshot_path: state.clone(),
        restore_mode: RestoreModeBody::Lazy,
        uffd_socket_path: None,
        resume_vm: fc.resume_vm,
        record_working_set: false,
        mem_file_path: None,
        gpus: Vec::new(),
    };
    match (fc.mem_file_path, fc.mem_backend) {
        (Some(_), Some(_)) => {
            return Err("snapshot/load: give mem_backend or mem_file_path, not both".into())
        }
        (None, None) => return Err("snapshot/load needs mem_backend (or mem_file_path)".into()),
        (Some(path), None) => load.mem_file_path = Some(resolve(cwd, &path)),
        (None, Some(backend)) => match backend.backend_type.as_str() {
            "File" => load.mem_file_path = Some(resolve(cwd, &backend.backend_path)),
            "Uffd" => {
                load.restore_mode = RestoreModeBody::External;
                load.uffd_socket_path = Some(resolve(cwd, &backend.backend_path));
                load.snapshot_path = gpuvm_vmm::snapshot::files::directory_for(&state)?;
            }
            other => {
                return Err(format!(
                    "snapshot/load mem_backend backend_type {other:?}: File or Uffd"
                ))
            }
        },
    }
    Ok((load, overrides))
}

/// A drive body in Firecracker's shape onto gpuvm's: relative paths resolved,
/// `cache_type` "Unsafe" (Firecracker's default, gpuvm's behaviour) accepted, anything
/// gpuvm does not model refused naming it.
pub fn drive(body: &Value, cwd: &Path) -> Result<DriveBody, Refusal> {
    let mut body = body.clone();
    let Some(object) = body.as_object_mut() else {
        return Err("a drive body is a JSON object".into());
    };
    match object.remove("cache_type") {
        None => {}
        Some(Value::String(s)) if s == "Unsafe" => {}
        Some(other) => {
            return Err(format!(
                "drive cache_type {other} is not supported by gpuvm (only \"Unsafe\": gpuvm does not flush to the host on guest flushes)"
            ))
        }
    }
    match object.remove("partuuid") {
        None | Some(Value::Null) => {}
        Some(_) => {
            return Err("drive partuuid is not supported by gpuvm (give root= in boot_args)".into())
        }
    }
    for key in ["path_on_host", "path", "socket"] {
        if let Some(Value::String(path)) = object.get(key) {
            let resolved = resolve(cwd, Path::new(path));
            object.insert(key.into(), resolved.to_string_lossy().into_owned().into());
        }
    }
    parse("drive", &body)
}

/// Firecracker routes gpuvm does not serve, and why (answered 400).
pub fn unsupported(path: &str) -> Option<&'static str> {
    let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
    Some(match first {
        "balloon" if path.contains("/hinting") => {
            "balloon free page hinting is not supported by gpuvm"
        }
        "serial" => "serial output redirection is not supported by gpuvm (the serial console is gpuvm's stdout)",
        "cpu-config" => "custom CPU templates are not supported by gpuvm (use machine-config cpuid_masks)",
        "pmem" => "virtio-pmem is not supported by gpuvm",
        "hotplug" => "memory hot-plug is not supported by gpuvm",
        _ => return None,
    })
}

/// `--config-file` in Firecracker's shape: the actions its sections stand for, in the
/// order Firecracker applies them (logger and metrics first, `mmds-config` after the
/// network interfaces it names), without the start. Every section is checked first
/// ([`super::validate::config_file`]), so a refusal names each bad value by its path
/// (`drives[1].path_on_host`).
pub fn config_file(json: &Value, cwd: &Path) -> Result<Vec<VmmAction>, Refusal> {
    let Some(object) = json.as_object() else {
        return Err("the configuration is a JSON object".into());
    };
    let mut actions = Vec::new();
    for key in object.keys() {
        let known = [
            "logger",
            "metrics",
            "machine-config",
            "boot-source",
            "drives",
            "network-interfaces",
            "vsock",
            "entropy",
            "balloon",
            "gpus",
            "mmds-config",
        ];
        if !known.contains(&key.as_str()) {
            let value = &object[key];
            if value.is_null() || value.as_array().is_some_and(|a| a.is_empty()) {
                continue;
            }
            return Err(match unsupported(key) {
                Some(why) => format!("config section {key:?}: {why}"),
                None => format!("config section {key:?} is not supported by gpuvm"),
            });
        }
    }
    super::validate::config_file(json)?;
    let section = |name: &str| object.get(name).filter(|v| !v.is_null());
    if let Some(body) = section("logger") {
        actions.push(VmmAction::PutLogger(logger(body, cwd)?));
    }
    if let Some(body) = section("metrics") {
        actions.push(VmmAction::PutMetrics(metrics(body, cwd)?));
    }
    if let Some(body) = section("machine-config") {
        actions.push(VmmAction::PutMachineConfig(machine_config(body)?));
    }
    if let Some(body) = section("boot-source") {
        actions.push(VmmAction::PutBootSource(boot_source(body, cwd)?));
    }
    let list = |name: &str| -> Result<Vec<Value>, Refusal> {
        match section(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => Ok(items.clone()),
            Some(_) => Err(format!("config section {name:?} is a list")),
        }
    };
    for (i, body) in list("drives")?.iter().enumerate() {
        let drive = drive(body, cwd).map_err(|e| format!("drives[{i}]: {e}"))?;
        actions.push(VmmAction::PutDrive(drive));
    }
    let mut iface_ids = Vec::new();
    for (i, body) in list("network-interfaces")?.iter().enumerate() {
        let config: gpuvm_virtio::net::NetConfig = parse("network-interfaces", body)
            .map_err(|e| format!("network-interfaces[{i}]: {e}"))?;
        iface_ids.push(config.iface_id.clone());
        actions.push(VmmAction::PutNetworkInterface(config));
    }
    for body in list("gpus")? {
        actions.push(VmmAction::PutGpu(parse("gpus", &body)?));
    }
    if let Some(body) = section("vsock") {
        actions.push(VmmAction::PutVsock(vsock(body, cwd)?));
    }
    if let Some(body) = section("entropy") {
        actions.push(VmmAction::PutEntropy(parse("entropy", body)?));
    }
    if let Some(body) = section("balloon") {
        actions.push(VmmAction::PutBalloon(balloon(body)?));
    }
    if let Some(body) = section("mmds-config") {
        let config = mmds_config(body)?;
        // The controller checks it when the action runs; checked here too, the file is
        // refused before any of its sections takes effect.
        let configured: Vec<&str> = iface_ids.iter().map(String::as_str).collect();
        gpuvm_vmm::controller::mmds::check(&config, &configured).map_err(|error| error.message)?;
        actions.push(VmmAction::PutMmdsConfig(config));
    }
    Ok(actions)
}

/// PUT /mmds/config (and a config file's `mmds-config`): the body as gpuvm's
/// configuration (the controller checks it: gpuvm_vmm::controller::mmds::check).
pub fn mmds_config(body: &Value) -> Result<gpuvm_mmds::MmdsConfig, Refusal> {
    parse("mmds-config", body)
}

/// PUT /balloon: free page hinting and reporting are refused when asked for.
pub fn balloon(body: &Value) -> Result<gpuvm_virtio::balloon::BalloonConfig, Refusal> {
    let mut body = body.clone();
    if let Some(object) = body.as_object_mut() {
        for key in ["free_page_hinting", "free_page_reporting"] {
            match object.remove(key) {
                None | Some(Value::Null) | Some(Value::Bool(false)) => {}
                Some(_) => return Err(format!("balloon {key} is not supported by gpuvm")),
            }
        }
    }
    parse("balloon", &body)
}

/// PUT /vsock: `uds_path` resolved like every path.
pub fn vsock(body: &Value, cwd: &Path) -> Result<gpuvm_virtio::vsock::VsockConfig, Refusal> {
    let mut config: gpuvm_virtio::vsock::VsockConfig = parse("vsock", body)?;
    config.uds_path = resolve(cwd, &config.uds_path);
    Ok(config)
}
