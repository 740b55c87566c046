//! Cloud Hypervisor's option values, `key=value,key=value` (`--cpus boot=2`, `--disk
//! path=/x.img,readonly=on`, `--serial tty`), turned into the JSON sections of the
//! VmConfig body `PUT /api/v1/vm.create` takes, with Cloud Hypervisor's field names and
//! value types. What gpuvm makes of each field is decided by the API's translation
//! (gpuvm_api::cloud_hypervisor::translate), not here: this module only knows the syntax.
//!
//! The syntax is Cloud Hypervisor's: items split at commas outside `"..."` and `[...]`;
//! booleans `on|off|true|false` (any case; empty is off); sizes a number with an optional
//! `K`, `M` or `G` suffix (powers of 1024); a key given twice keeps its last value. A key
//! Cloud Hypervisor does not know is an error; a key it knows but whose Cloud Hypervisor
//! value gpuvm has no field for (its rate limiters, vCPU affinity) is refused here.

use serde_json::{json, Map, Value};

/// A bad option value. Each names the option and, where there is one, the key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptionError {
    #[error("{option} {value:?}: unbalanced quotes or brackets")]
    Syntax { option: String, value: String },
    #[error("{option} {key}: unknown key (Cloud Hypervisor's {option} takes {known})")]
    UnknownKey {
        option: String,
        key: String,
        known: String,
    },
    #[error("{option} {key}: needs a value ({key}=...)")]
    MissingValue { option: String, key: String },
    #[error("{option} {key}={value}: {expected}")]
    BadValue {
        option: String,
        key: String,
        value: String,
        expected: &'static str,
    },
    #[error("{option}: {key}= is required")]
    Required { option: String, key: &'static str },
    #[error("{option} {key}: not supported by gpuvm ({why})")]
    Unsupported {
        option: String,
        key: String,
        why: &'static str,
    },
    #[error("{option}: give one of {modes}")]
    Mode { option: String, modes: &'static str },
}

type Result<T> = std::result::Result<T, OptionError>;

/// How a key's value becomes its JSON field.
#[derive(Clone, Copy)]
enum Kind {
    /// A string, under this field name.
    Text(&'static str),
    /// A file path, under this field name: relative ones resolve against the working
    /// directory, as Cloud Hypervisor opens them (gpuvm's API wants absolute paths).
    Path(&'static str),
    /// on/off → a boolean.
    Flag(&'static str),
    /// A size with K/M/G → a number of bytes.
    Size(&'static str),
    /// A decimal number.
    Number(&'static str),
    /// One of Cloud Hypervisor's command-line words → its JSON enum name.
    Choice(&'static str, &'static [(&'static str, &'static str)]),
    /// A value whose JSON shape gpuvm does not model: a boolean or number where it reads
    /// as one, else the text, so the translation accepts it only at its default.
    Raw(&'static str),
    /// Known to Cloud Hypervisor, refused by gpuvm: why.
    Refuse(&'static str),
    /// Read by the option's own code.
    Own,
}

/// `path` made absolute against the working directory (unchanged if it already is, or
/// if the working directory cannot be read).
pub fn absolute(path: &str) -> String {
    if path.starts_with('/') || path.is_empty() {
        return path.to_string();
    }
    match std::env::current_dir() {
        Ok(dir) => dir.join(path).to_string_lossy().into_owned(),
        Err(_) => path.to_string(),
    }
}

/// The keys of every PCI device option (Cloud Hypervisor's common PCI device fields).
const PCI_COMMON: &[(&str, Kind)] = &[
    ("id", Kind::Text("id")),
    ("pci_segment", Kind::Number("pci_segment")),
    ("pci_device_id", Kind::Number("pci_device_id")),
    ("iommu", Kind::Flag("iommu")),
];

const RATE_LIMITER: &str = "Cloud Hypervisor's rate limiters; gpuvm's own are set through its API";

const RATE_LIMITER_KEYS: &[(&str, Kind)] = &[
    ("bw_size", Kind::Refuse(RATE_LIMITER)),
    ("bw_one_time_burst", Kind::Refuse(RATE_LIMITER)),
    ("bw_refill_time", Kind::Refuse(RATE_LIMITER)),
    ("ops_size", Kind::Refuse(RATE_LIMITER)),
    ("ops_one_time_burst", Kind::Refuse(RATE_LIMITER)),
    ("ops_refill_time", Kind::Refuse(RATE_LIMITER)),
];

/// Splits `text` at commas outside quotes and brackets, as Cloud Hypervisor does.
fn split_items(option: &str, text: &str) -> Result<Vec<String>> {
    let syntax = || OptionError::Syntax {
        option: option.into(),
        value: text.into(),
    };
    let mut items = Vec::new();
    let mut current = String::new();
    let mut brackets = 0u32;
    let mut quoted = false;
    for c in text.trim().chars() {
        match c {
            '"' => quoted = !quoted,
            _ if quoted => {}
            '[' => brackets += 1,
            ']' => brackets = brackets.checked_sub(1).ok_or_else(syntax)?,
            ',' if brackets == 0 => {
                items.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    items.push(current);
    if quoted || brackets != 0 {
        return Err(syntax());
    }
    Ok(items)
}

/// `key=value` items (a value of None: the key was written alone), in order.
fn items(option: &str, text: &str) -> Result<Vec<(String, Option<String>)>> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    Ok(split_items(option, text)?
        .into_iter()
        .map(|item| match item.split_once('=') {
            Some((key, value)) => (key.trim().to_string(), Some(unquote(value.trim()))),
            None => (item.trim().to_string(), None),
        })
        .collect())
}

fn unquote(value: &str) -> String {
    value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value)
        .to_string()
}

/// Cloud Hypervisor's booleans: on, off, true, false in any case; empty is off.
pub fn toggle(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "on" | "true" => Some(true),
        "off" | "false" | "" => Some(false),
        _ => None,
    }
}

/// Cloud Hypervisor's sizes: a decimal number of bytes, or with a K, M or G suffix.
pub fn byte_size(value: &str) -> Option<u64> {
    let (digits, shift) = match value.as_bytes().last() {
        Some(b'K') => (&value[..value.len() - 1], 10),
        Some(b'M') => (&value[..value.len() - 1], 20),
        Some(b'G') => (&value[..value.len() - 1], 30),
        _ => (value, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn bad(option: &str, key: &str, value: &str, expected: &'static str) -> OptionError {
    OptionError::BadValue {
        option: option.into(),
        key: key.into(),
        value: value.into(),
        expected,
    }
}

/// The JSON for one typed value.
fn convert(option: &str, key: &str, kind: Kind, value: &str) -> Result<Option<(String, Value)>> {
    let field = |name: &str, v: Value| Ok(Some((name.to_string(), v)));
    match kind {
        Kind::Text(name) => field(name, json!(value)),
        Kind::Path(name) => field(name, json!(absolute(value))),
        Kind::Flag(name) => match toggle(value) {
            Some(on) => field(name, json!(on)),
            None => Err(bad(option, key, value, "on or off")),
        },
        Kind::Size(name) => match byte_size(value) {
            Some(bytes) => field(name, json!(bytes)),
            None => Err(bad(
                option,
                key,
                value,
                "a size: bytes, or a number with K, M or G",
            )),
        },
        Kind::Number(name) => match value.parse::<u64>() {
            Ok(n) => field(name, json!(n)),
            Err(_) => Err(bad(option, key, value, "a decimal number")),
        },
        Kind::Choice(name, words) => {
            match words
                .iter()
                .find(|(word, _)| word.eq_ignore_ascii_case(value))
            {
                Some((_, variant)) => field(name, json!(variant)),
                None => Err(bad(
                    option,
                    key,
                    value,
                    "a value Cloud Hypervisor takes here",
                )),
            }
        }
        Kind::Raw(name) => {
            let parsed = toggle(value)
                .map(Value::from)
                .or_else(|| value.parse::<u64>().ok().map(Value::from))
                .unwrap_or_else(|| json!(value));
            field(name, parsed)
        }
        Kind::Refuse(why) => Err(OptionError::Unsupported {
            option: option.into(),
            key: key.into(),
            why,
        }),
        Kind::Own => Ok(None),
    }
}

/// Parses `text` against `specs`: the JSON object of the typed keys, and the values of
/// the [`Kind::Own`] keys for the caller.
fn object(
    option: &str,
    text: &str,
    specs: &[&[(&str, Kind)]],
) -> Result<(Map<String, Value>, Map<String, Value>)> {
    let mut typed = Map::new();
    let mut own = Map::new();
    for (key, value) in items(option, text)? {
        let Some(kind) = specs
            .iter()
            .flat_map(|s| s.iter())
            .find(|(name, _)| *name == key)
            .map(|(_, kind)| *kind)
        else {
            let known: Vec<&str> = specs
                .iter()
                .flat_map(|s| s.iter())
                .map(|(name, _)| *name)
                .collect();
            return Err(OptionError::UnknownKey {
                option: option.into(),
                key,
                known: known.join(", "),
            });
        };
        let Some(value) = value else {
            return Err(OptionError::MissingValue {
                option: option.into(),
                key,
            });
        };
        match convert(option, &key, kind, &value)? {
            Some((field, json)) => {
                typed.insert(field, json);
            }
            None => {
                own.insert(key, json!(value));
            }
        }
    }
    Ok((typed, own))
}

fn require(
    option: &str,
    object: &Map<String, Value>,
    field: &str,
    key: &'static str,
) -> Result<()> {
    if object.contains_key(field) {
        Ok(())
    } else {
        Err(OptionError::Required {
            option: option.into(),
            key,
        })
    }
}

/// `--cpus boot=N,max=N,...` → `cpus` (Cloud Hypervisor's default: one vCPU).
pub fn cpus(text: &str) -> Result<Value> {
    const OPTION: &str = "--cpus";
    const KEYS: &[(&str, Kind)] = &[
        ("boot", Kind::Number("boot_vcpus")),
        ("max", Kind::Number("max_vcpus")),
        ("topology", Kind::Own),
        ("kvm_hyperv", Kind::Flag("kvm_hyperv")),
        ("max_phys_bits", Kind::Number("max_phys_bits")),
        (
            "affinity",
            Kind::Refuse("gpuvm does not pin vCPUs to host CPUs"),
        ),
        ("features", Kind::Own),
        ("nested", Kind::Flag("nested")),
        (
            "core_scheduling",
            Kind::Choice(
                "core_scheduling",
                &[("vm", "Vm"), ("vcpu", "Vcpu"), ("off", "Off")],
            ),
        ),
        ("profile", Kind::Raw("profile")),
    ];
    let (mut cpus, own) = object(OPTION, text, &[KEYS])?;
    let boot = cpus.get("boot_vcpus").cloned().unwrap_or(json!(1));
    cpus.insert("boot_vcpus".into(), boot.clone());
    cpus.entry("max_vcpus").or_insert(boot);
    if let Some(Value::String(topology)) = own.get("topology") {
        // threads_per_core:cores_per_die:dies_per_package:packages
        let parts: Vec<Option<u64>> = topology.split(':').map(|p| p.parse().ok()).collect();
        let [Some(threads), Some(cores), Some(dies), Some(packages)] = parts[..] else {
            return Err(bad(
                OPTION,
                "topology",
                topology,
                "threads_per_core:cores_per_die:dies_per_package:packages",
            ));
        };
        cpus.insert(
            "topology".into(),
            json!({"threads_per_core": threads, "cores_per_die": cores,
                   "dies_per_package": dies, "packages": packages}),
        );
    }
    if let Some(Value::String(features)) = own.get("features") {
        // A list, `amx` or `[amx]`: each named feature is turned on.
        let list = features.trim_start_matches('[').trim_end_matches(']');
        let named: Map<String, Value> = list
            .split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(|f| (f.to_string(), json!(true)))
            .collect();
        cpus.insert("features".into(), Value::Object(named));
    }
    Ok(Value::Object(cpus))
}

/// `--memory size=512M,...` → `memory` (Cloud Hypervisor's default size: 512 MiB).
pub fn memory(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[
        ("size", Kind::Size("size")),
        ("file", Kind::Raw("file")),
        ("mergeable", Kind::Flag("mergeable")),
        (
            "hotplug_method",
            Kind::Choice(
                "hotplug_method",
                &[("acpi", "Acpi"), ("virtio-mem", "VirtioMem")],
            ),
        ),
        ("hotplug_size", Kind::Size("hotplug_size")),
        ("hotplugged_size", Kind::Size("hotplugged_size")),
        ("shared", Kind::Flag("shared")),
        ("hugepages", Kind::Flag("hugepages")),
        ("hugepage_size", Kind::Size("hugepage_size")),
        ("prefault", Kind::Flag("prefault")),
        ("reserve", Kind::Raw("reserve")),
        ("thp", Kind::Flag("thp")),
    ];
    let (mut memory, _) = object("--memory", text, &[KEYS])?;
    memory.entry("size").or_insert(json!(512u64 << 20));
    Ok(Value::Object(memory))
}

/// `--disk path=...` → one of `disks`.
pub fn disk(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[
        ("path", Kind::Path("path")),
        ("readonly", Kind::Flag("readonly")),
        ("direct", Kind::Flag("direct")),
        ("queue_size", Kind::Number("queue_size")),
        ("num_queues", Kind::Number("num_queues")),
        ("vhost_user", Kind::Flag("vhost_user")),
        ("socket", Kind::Path("vhost_socket")),
        ("_disable_io_uring", Kind::Flag("disable_io_uring")),
        ("_disable_aio", Kind::Flag("disable_aio")),
        ("serial", Kind::Text("serial")),
        ("rate_limit_group", Kind::Text("rate_limit_group")),
        (
            "queue_affinity",
            Kind::Refuse("gpuvm does not pin queues to host CPUs"),
        ),
        ("backing_files", Kind::Flag("backing_files")),
        ("sparse", Kind::Flag("sparse")),
        (
            "image_type",
            Kind::Choice(
                "image_type",
                &[
                    ("raw", "Raw"),
                    ("qcow2", "Qcow2"),
                    ("vhd", "FixedVhd"),
                    ("vhdx", "Vhdx"),
                    ("vmdk", "FlatVmdk"),
                ],
            ),
        ),
        (
            "lock_granularity",
            Kind::Choice(
                "lock_granularity",
                &[("byte-range", "ByteRange"), ("full", "Full")],
            ),
        ),
    ];
    let (disk, _) = object("--disk", text, &[KEYS, RATE_LIMITER_KEYS, PCI_COMMON])?;
    if !disk.contains_key("vhost_socket") {
        require("--disk", &disk, "path", "path")?;
    }
    Ok(Value::Object(disk))
}

/// A `--net` value: its `net` entry, and the tap descriptors `fd=` named (then the
/// interface goes through vm.add-net with them, as Kata passes taps).
#[derive(Debug, PartialEq)]
pub struct Net {
    pub config: Value,
    pub fds: Vec<i32>,
}

/// `--net tap=...` or `--net fd=3` / `fd=[3,4]` → a `net` entry.
pub fn net(text: &str) -> Result<Net> {
    const OPTION: &str = "--net";
    const KEYS: &[(&str, Kind)] = &[
        ("tap", Kind::Text("tap")),
        ("ip", Kind::Text("ip")),
        ("mask", Kind::Text("mask")),
        ("mac", Kind::Text("mac")),
        ("host_mac", Kind::Text("host_mac")),
        ("offload_tso", Kind::Flag("offload_tso")),
        ("offload_ufo", Kind::Flag("offload_ufo")),
        ("offload_csum", Kind::Flag("offload_csum")),
        ("mtu", Kind::Number("mtu")),
        ("queue_size", Kind::Number("queue_size")),
        ("num_queues", Kind::Number("num_queues")),
        ("vhost_user", Kind::Flag("vhost_user")),
        ("socket", Kind::Path("vhost_socket")),
        (
            "vhost_mode",
            Kind::Choice("vhost_mode", &[("client", "Client"), ("server", "Server")]),
        ),
        ("fd", Kind::Own),
    ];
    let (config, own) = object(OPTION, text, &[KEYS, RATE_LIMITER_KEYS, PCI_COMMON])?;
    let mut fds = Vec::new();
    if let Some(Value::String(list)) = own.get("fd") {
        let bad_list = || {
            bad(
                OPTION,
                "fd",
                list,
                "open tap descriptors above 2, each once: fd=3 or fd=[3,4]",
            )
        };
        tap_fds(list, &mut fds).ok_or_else(bad_list)?;
    }
    Ok(Net {
        config: Value::Object(config),
        fds,
    })
}

/// Appends the descriptors of `list` (`3` or `[3,4]`) to `fds`; None if one is not a number
/// above 2 (0, 1 and 2 are gpuvm's stdin, stdout, the serial console, and stderr) or is
/// named twice, also across lists.
fn tap_fds(list: &str, fds: &mut Vec<i32>) -> Option<()> {
    let inner = list.trim().trim_start_matches('[').trim_end_matches(']');
    for fd in inner.split(',').map(str::trim) {
        match fd.parse::<i32>() {
            Ok(n) if n > 2 && !fds.contains(&n) => fds.push(n),
            _ => return None,
        }
    }
    Some(())
}

/// `--restore ...,net_fds=[net0@[23,24],net1@25]`: vm.restore's `net_fds` entries (id and
/// count) and the descriptors, in order.
fn restore_net_fds(list: &str) -> Result<(Vec<Value>, Vec<i32>)> {
    let bad_list = || {
        bad(
            "--restore",
            "net_fds",
            list,
            "[<interface id>@[<fd>,...],...] with open tap descriptors above 2, each once",
        )
    };
    let inner = list
        .trim()
        .strip_prefix('[')
        .and_then(|l| l.strip_suffix(']'))
        .ok_or_else(bad_list)?;
    // Split at the commas outside the per-interface brackets.
    let (mut items, mut depth, mut start) = (Vec::new(), 0u32, 0);
    for (at, c) in inner.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(bad_list)?,
            ',' if depth == 0 => {
                items.push(&inner[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    let (mut entries, mut fds) = (Vec::new(), Vec::new());
    for item in items {
        let (id, list) = item.split_once('@').ok_or_else(bad_list)?;
        let before = fds.len();
        tap_fds(list, &mut fds).ok_or_else(bad_list)?;
        let id = id.trim();
        if id.is_empty() {
            return Err(bad_list());
        }
        entries.push(json!({"id": id, "num_fds": fds.len() - before}));
    }
    Ok((entries, fds))
}

/// `--fs tag=...,socket=...` → one of `fs`.
pub fn fs(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[
        ("tag", Kind::Text("tag")),
        ("socket", Kind::Path("socket")),
        ("num_queues", Kind::Number("num_queues")),
        ("queue_size", Kind::Number("queue_size")),
    ];
    let (fs, _) = object("--fs", text, &[KEYS, PCI_COMMON])?;
    require("--fs", &fs, "tag", "tag")?;
    require("--fs", &fs, "socket", "socket")?;
    Ok(Value::Object(fs))
}

/// `--vsock cid=3,socket=/path` → `vsock`.
pub fn vsock(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[
        ("cid", Kind::Number("cid")),
        ("socket", Kind::Path("socket")),
    ];
    let (vsock, _) = object("--vsock", text, &[KEYS, PCI_COMMON])?;
    require("--vsock", &vsock, "cid", "cid")?;
    require("--vsock", &vsock, "socket", "socket")?;
    Ok(Value::Object(vsock))
}

/// `--rng src=/dev/urandom` → `rng` (Cloud Hypervisor's default source: /dev/urandom).
pub fn rng(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[("src", Kind::Text("src"))];
    let (mut rng, _) = object("--rng", text, &[KEYS, PCI_COMMON])?;
    rng.entry("src").or_insert(json!("/dev/urandom"));
    Ok(Value::Object(rng))
}

/// `--device path=/sys/bus/pci/devices/<BDF>` → one of `devices`.
pub fn device(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[
        ("path", Kind::Path("path")),
        (
            "fd",
            Kind::Refuse("gpuvm opens the device through its sysfs path: give path="),
        ),
        (
            "x_nv_gpudirect_clique",
            Kind::Number("x_nv_gpudirect_clique"),
        ),
        ("x_exclude_mmap_bars", Kind::Raw("x_exclude_mmap_bars")),
    ];
    let (device, _) = object("--device", text, &[KEYS, PCI_COMMON])?;
    require("--device", &device, "path", "path")?;
    Ok(Value::Object(device))
}

/// `--user-device socket=/path` → the body of vm.add-user-device.
pub fn user_device(text: &str) -> Result<Value> {
    const KEYS: &[(&str, Kind)] = &[
        ("socket", Kind::Path("socket")),
        ("id", Kind::Text("id")),
        ("pci_segment", Kind::Number("pci_segment")),
        ("pci_device_id", Kind::Number("pci_device_id")),
    ];
    let (device, _) = object("--user-device", text, &[KEYS])?;
    require("--user-device", &device, "socket", "socket")?;
    Ok(Value::Object(device))
}

/// `--numa guest_numa_id=0,cpus=[0-1,4],distances=[1@20,2@30],memory_zones=[mem0]` →
/// one entry of `numa`. Lists take Cloud Hypervisor's forms: in brackets or bare when
/// they have one item, vCPUs as numbers or `a-b` ranges, distances as
/// `destination@distance`. `memory_zones`, `sgx_epc_sections` and `pci_segments` are
/// passed on as written: the API's translation refuses what gpuvm cannot do by name,
/// as it does for the `numa` field of vm.create.
pub fn numa(text: &str) -> Result<Value> {
    const OPTION: &str = "--numa";
    const KEYS: &[(&str, Kind)] = &[
        ("guest_numa_id", Kind::Number("guest_numa_id")),
        ("cpus", Kind::Own),
        ("distances", Kind::Own),
        ("memory_zones", Kind::Own),
        ("sgx_epc_sections", Kind::Own),
        ("pci_segments", Kind::Own),
    ];
    let (mut node, own) = object(OPTION, text, &[KEYS])?;
    require(OPTION, &node, "guest_numa_id", "guest_numa_id")?;
    for (key, value) in &own {
        let Value::String(text) = value else { continue };
        let list = list_items(text);
        let json = match key.as_str() {
            "cpus" => json!(vcpu_list(&list).ok_or_else(|| bad(
                OPTION,
                key,
                text,
                "vCPU ids 0 to 255 or ranges a-b, e.g. [0-3,8]"
            ))?),
            "distances" => distance_list(&list).ok_or_else(|| {
                bad(
                    OPTION,
                    key,
                    text,
                    "destination@distance pairs, e.g. [1@20,2@30]",
                )
            })?,
            "pci_segments" => json!(list
                .iter()
                .map(|item| item.parse::<u16>().ok())
                .collect::<Option<Vec<u16>>>()
                .ok_or_else(|| bad(OPTION, key, text, "PCI segment numbers, e.g. [0,1]"))?),
            // memory_zones, sgx_epc_sections: names.
            _ => json!(list),
        };
        node.insert(key.clone(), json);
    }
    Ok(Value::Object(node))
}

/// A list value's items: `[a,b]`, or `a` alone; surrounding whitespace dropped.
fn list_items(text: &str) -> Vec<String> {
    let inner = text
        .trim()
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(text.trim());
    inner
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_string)
        .collect()
}

/// vCPU ids and `a-b` ranges (each id below 256, as Cloud Hypervisor's are bytes).
fn vcpu_list(items: &[String]) -> Option<Vec<u8>> {
    let mut cpus = Vec::new();
    for item in items {
        let (first, last) = match item.split_once('-') {
            Some((first, last)) => (
                first.trim().parse::<u8>().ok()?,
                last.trim().parse::<u8>().ok()?,
            ),
            None => {
                let cpu = item.parse::<u8>().ok()?;
                (cpu, cpu)
            }
        };
        if first > last {
            return None;
        }
        cpus.extend(first..=last);
    }
    Some(cpus)
}

/// `destination@distance` pairs → `[{"destination": d, "distance": n}]`.
fn distance_list(items: &[String]) -> Option<Value> {
    items
        .iter()
        .map(|item| {
            let (destination, distance) = item.split_once('@')?;
            let destination: u32 = destination.trim().parse().ok()?;
            let distance: u8 = distance.trim().parse().ok()?;
            Some(json!({"destination": destination, "distance": distance}))
        })
        .collect::<Option<Vec<Value>>>()
        .map(Value::Array)
}

/// `--serial` / `--console`: `off`, `pty`, `tty`, `null`, `file=<path>` or
/// `socket=<path>` → `{"mode": ..., "file"/"socket": ...}`.
pub fn console(option: &str, text: &str) -> Result<Value> {
    const MODES: &str = "off, pty, tty, null, file=<path>, socket=<path>";
    let mut mode = None;
    let mut config = Map::new();
    for (key, value) in items(option, text)? {
        let word = match (key.as_str(), &value) {
            ("off", None) => "Off",
            ("pty", None) => "Pty",
            ("tty", None) => "Tty",
            ("null", None) => "Null",
            ("file", Some(path)) => {
                config.insert("file".into(), json!(path));
                "File"
            }
            ("socket", Some(path)) => {
                config.insert("socket".into(), json!(path));
                "Socket"
            }
            ("id", Some(_)) | ("pci_segment", Some(_)) | ("iommu", Some(_))
                if option == "--console" =>
            {
                let kind = PCI_COMMON
                    .iter()
                    .find(|(name, _)| *name == key)
                    .map(|(_, kind)| *kind)
                    .unwrap_or(Kind::Own);
                if let Some((field, json)) =
                    convert(option, &key, kind, value.as_deref().unwrap_or_default())?
                {
                    config.insert(field, json);
                }
                continue;
            }
            _ => {
                return Err(OptionError::UnknownKey {
                    option: option.into(),
                    key,
                    known: MODES.into(),
                })
            }
        };
        if mode.replace(word).is_some() {
            return Err(OptionError::Mode {
                option: option.into(),
                modes: MODES,
            });
        }
    }
    let Some(mode) = mode else {
        return Err(OptionError::Mode {
            option: option.into(),
            modes: MODES,
        });
    };
    config.insert("mode".into(), json!(mode));
    Ok(Value::Object(config))
}

/// `--restore source_url=file:///dir,...`: the body of vm.restore, whether the VM runs
/// on at once (`resume=on`; else it waits paused for vm.resume, as in Cloud Hypervisor),
/// and the tap descriptors `net_fds` names, in order (they go with the request).
pub fn restore(text: &str) -> Result<(Value, bool, Vec<i32>)> {
    const KEYS: &[(&str, Kind)] = &[
        ("source_url", Kind::Text("source_url")),
        ("prefault", Kind::Flag("prefault")),
        ("memory_restore_mode", Kind::Raw("memory_restore_mode")),
        ("net_fds", Kind::Own),
        ("vfio_fds", Kind::Raw("vfio_fds")),
        ("iommufd_fd", Kind::Raw("iommufd_fd")),
        ("zone_updates", Kind::Raw("zone_updates")),
        ("resume", Kind::Own),
    ];
    let (mut body, own) = object("--restore", text, &[KEYS])?;
    require("--restore", &body, "source_url", "source_url")?;
    let mut fds = Vec::new();
    if let Some(Value::String(list)) = own.get("net_fds") {
        let (entries, taps) = restore_net_fds(list)?;
        body.insert("net_fds".into(), Value::Array(entries));
        fds = taps;
    }
    let resume = match own.get("resume") {
        Some(Value::String(value)) => {
            toggle(value).ok_or_else(|| bad("--restore", "resume", value, "on or off"))?
        }
        _ => false,
    };
    Ok((Value::Object(body), resume, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_resolve_against_the_working_directory() {
        let here = std::env::current_dir().unwrap();
        assert_eq!(absolute("/abs/x"), "/abs/x");
        assert_eq!(absolute("x.img"), here.join("x.img").to_string_lossy());
        let disk = disk("path=images/root.img").unwrap();
        assert_eq!(disk["path"], json!(here.join("images/root.img")));
    }

    #[test]
    fn values_split_like_cloud_hypervisor() {
        assert_eq!(
            split_items("--x", r#"a=1,b=[1,2],c="x,y""#).unwrap(),
            vec!["a=1", "b=[1,2]", r#"c="x,y""#]
        );
        assert!(split_items("--x", "a=[1,2").is_err());
        assert!(split_items("--x", "a=1]").is_err());
        assert!(split_items("--x", r#"a="x"#).is_err());
        assert_eq!(
            items("--x", r#"c="x,y""#).unwrap(),
            vec![("c".to_string(), Some("x,y".to_string()))]
        );
    }

    #[test]
    fn booleans_and_sizes() {
        for (text, on) in [
            ("on", true),
            ("ON", true),
            ("true", true),
            ("off", false),
            ("false", false),
            ("", false),
        ] {
            assert_eq!(toggle(text), Some(on), "{text}");
        }
        assert_eq!(toggle("yes"), None);
        assert_eq!(byte_size("512M"), Some(512 << 20));
        assert_eq!(byte_size("1G"), Some(1 << 30));
        assert_eq!(byte_size("4K"), Some(4096));
        assert_eq!(byte_size("4096"), Some(4096));
        assert_eq!(byte_size("12X"), None);
        assert_eq!(byte_size("M"), None);
        assert_eq!(byte_size("99999999999999G"), None);
    }

    #[test]
    fn cpus_and_memory() {
        assert_eq!(
            cpus("boot=2").unwrap(),
            json!({"boot_vcpus": 2, "max_vcpus": 2})
        );
        assert_eq!(
            cpus("boot=2,max=4,kvm_hyperv=on,topology=1:2:1:1,features=amx").unwrap(),
            json!({"boot_vcpus": 2, "max_vcpus": 4, "kvm_hyperv": true,
                   "topology": {"threads_per_core": 1, "cores_per_die": 2,
                                "dies_per_package": 1, "packages": 1},
                   "features": {"amx": true}})
        );
        assert_eq!(cpus("").unwrap(), json!({"boot_vcpus": 1, "max_vcpus": 1}));
        assert!(matches!(
            cpus("boot=two").unwrap_err(),
            OptionError::BadValue { key, .. } if key == "boot"
        ));
        assert!(matches!(
            cpus("boot=1,affinity=[0@[0]]").unwrap_err(),
            OptionError::Unsupported { key, .. } if key == "affinity"
        ));
        assert!(cpus("topology=1:2").is_err());
        assert_eq!(
            memory("size=256M,shared=on,hugepages=off,thp=off").unwrap(),
            json!({"size": 256u64 << 20, "shared": true, "hugepages": false, "thp": false})
        );
        assert_eq!(memory("").unwrap(), json!({"size": 512u64 << 20}));
        assert_eq!(
            memory("size=1G,hotplug_method=virtio-mem,hotplug_size=2G").unwrap(),
            json!({"size": 1u64 << 30, "hotplug_method": "VirtioMem", "hotplug_size": 2u64 << 30})
        );
        assert!(matches!(
            memory("size=512X").unwrap_err(),
            OptionError::BadValue { key, .. } if key == "size"
        ));
        assert!(matches!(
            memory("shared=maybe").unwrap_err(),
            OptionError::BadValue { key, .. } if key == "shared"
        ));
        let unknown = memory("size=1G,balloon=on").unwrap_err();
        assert!(
            unknown
                .to_string()
                .contains("--memory balloon: unknown key"),
            "{unknown}"
        );
        assert!(matches!(
            memory("size").unwrap_err(),
            OptionError::MissingValue { key, .. } if key == "size"
        ));
    }

    #[test]
    fn devices() {
        assert_eq!(
            disk("path=/x.img,readonly=on,id=root,image_type=raw").unwrap(),
            json!({"path": "/x.img", "readonly": true, "id": "root", "image_type": "Raw"})
        );
        assert_eq!(
            disk("vhost_user=on,socket=/v.sock").unwrap(),
            json!({"vhost_user": true, "vhost_socket": "/v.sock"})
        );
        assert!(matches!(
            disk("readonly=on").unwrap_err(),
            OptionError::Required { key: "path", .. }
        ));
        assert!(matches!(
            disk("path=/x,bw_size=1000").unwrap_err(),
            OptionError::Unsupported { key, .. } if key == "bw_size"
        ));
        assert!(disk("path=/x,image_type=iso").is_err());
        assert_eq!(
            net("tap=tap0,mac=06:00:00:00:00:01,num_queues=4").unwrap(),
            Net {
                config: json!({"tap": "tap0", "mac": "06:00:00:00:00:01", "num_queues": 4}),
                fds: vec![]
            }
        );
        assert_eq!(net("fd=3,id=net0").unwrap().fds, vec![3]);
        assert_eq!(net("fd=[3,4]").unwrap().fds, vec![3, 4]);
        assert_eq!(net("fd=[3,4]").unwrap().config, json!({}));
        assert!(net("fd=1").is_err());
        assert!(net("fd=[3,3]").is_err());
        assert!(net("fd=x").is_err());
        assert_eq!(
            fs("tag=myfs,socket=/fs.sock,num_queues=1").unwrap(),
            json!({"tag": "myfs", "socket": "/fs.sock", "num_queues": 1})
        );
        assert!(fs("tag=myfs").is_err());
        assert_eq!(
            vsock("cid=3,socket=/v").unwrap(),
            json!({"cid": 3, "socket": "/v"})
        );
        assert!(vsock("cid=x,socket=/v").is_err());
        assert!(vsock("socket=/v").is_err());
        assert_eq!(rng("").unwrap(), json!({"src": "/dev/urandom"}));
        assert_eq!(
            rng("src=/dev/random").unwrap(),
            json!({"src": "/dev/random"})
        );
        assert!(rng("source=/dev/random").is_err());
        assert_eq!(
            device("path=/sys/bus/pci/devices/0000:01:00.0,id=gpu0").unwrap(),
            json!({"path": "/sys/bus/pci/devices/0000:01:00.0", "id": "gpu0"})
        );
        assert!(matches!(
            device("fd=5").unwrap_err(),
            OptionError::Unsupported { key, .. } if key == "fd"
        ));
        assert_eq!(
            user_device("socket=/u.sock,id=emu").unwrap(),
            json!({"socket": "/u.sock", "id": "emu"})
        );
        assert!(user_device("id=emu").is_err());
        assert!(user_device("socket=/u,iommu=on").is_err());
    }

    #[test]
    fn numa_nodes() {
        assert_eq!(
            numa("guest_numa_id=1,cpus=[0-2,5],distances=[0@20,2@30]").unwrap(),
            json!({"guest_numa_id": 1, "cpus": [0, 1, 2, 5],
                   "distances": [{"destination": 0, "distance": 20},
                                 {"destination": 2, "distance": 30}]})
        );
        // One-item lists need no brackets; names and segments are passed on as written.
        assert_eq!(
            numa("guest_numa_id=0,cpus=3,distances=1@20,memory_zones=mem0,pci_segments=[0,1]")
                .unwrap(),
            json!({"guest_numa_id": 0, "cpus": [3],
                   "distances": [{"destination": 1, "distance": 20}],
                   "memory_zones": ["mem0"], "pci_segments": [0, 1]})
        );
        assert_eq!(
            numa("guest_numa_id=0,sgx_epc_sections=[epc0,epc1]").unwrap(),
            json!({"guest_numa_id": 0, "sgx_epc_sections": ["epc0", "epc1"]})
        );
        assert!(matches!(
            numa("cpus=[0]").unwrap_err(),
            OptionError::Required {
                key: "guest_numa_id",
                ..
            }
        ));
        for (text, key) in [
            ("guest_numa_id=0,cpus=[3-1]", "cpus"),
            ("guest_numa_id=0,cpus=[0-256]", "cpus"),
            ("guest_numa_id=0,cpus=[0-18446744073709551615]", "cpus"),
            ("guest_numa_id=0,cpus=[x]", "cpus"),
            ("guest_numa_id=0,distances=[1]", "distances"),
            ("guest_numa_id=0,distances=[1@256]", "distances"),
            ("guest_numa_id=0,distances=[x@20]", "distances"),
            ("guest_numa_id=0,pci_segments=[65536]", "pci_segments"),
            ("guest_numa_id=x", "guest_numa_id"),
        ] {
            let error = numa(text).unwrap_err();
            assert!(
                matches!(&error, OptionError::BadValue { key: k, .. } if k == key),
                "{text}: {error}"
            );
        }
        assert!(matches!(
            numa("guest_numa_id=0,cpus=[0").unwrap_err(),
            OptionError::Syntax { .. }
        ));
        assert!(matches!(
            numa("guest_numa_id=0,memory=1G").unwrap_err(),
            OptionError::UnknownKey { .. }
        ));
    }

    #[test]
    fn consoles_and_restore() {
        assert_eq!(console("--serial", "tty").unwrap(), json!({"mode": "Tty"}));
        assert_eq!(console("--console", "off").unwrap(), json!({"mode": "Off"}));
        assert_eq!(
            console("--serial", "null").unwrap(),
            json!({"mode": "Null"})
        );
        assert_eq!(
            console("--serial", "file=/tmp/s.log").unwrap(),
            json!({"mode": "File", "file": "/tmp/s.log"})
        );
        assert_eq!(
            console("--console", "tty,iommu=on").unwrap(),
            json!({"mode": "Tty", "iommu": true})
        );
        assert!(console("--serial", "tty,iommu=on").is_err());
        assert!(console("--serial", "tty,off").is_err());
        assert!(console("--serial", "").is_err());
        assert!(console("--serial", "loud").is_err());
        assert_eq!(
            restore("source_url=file:///snap").unwrap(),
            (json!({"source_url": "file:///snap"}), false, Vec::new())
        );
        assert_eq!(
            restore("source_url=file:///snap,prefault=on,resume=true").unwrap(),
            (
                json!({"source_url": "file:///snap", "prefault": true}),
                true,
                Vec::new()
            )
        );
        assert_eq!(
            restore("source_url=file:///s,memory_restore_mode=ondemand")
                .unwrap()
                .0,
            json!({"source_url": "file:///s", "memory_restore_mode": "ondemand"})
        );
        assert!(restore("prefault=on").is_err());
        assert!(restore("source_url=file:///s,resume=maybe").is_err());
    }
}
