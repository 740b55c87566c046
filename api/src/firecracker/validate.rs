//! Firecracker's rules for its request bodies and `--config-file` sections (its OpenAPI
//! document's types, required fields, enums and ranges, and its `deny_unknown_fields`),
//! checked in one pass on the JSON before anything is translated: every refused value is
//! named by its field path (`machine-config.vcpu_count`, `drives[2].path_on_host`), all
//! of them in one 400, as the Cloud Hypervisor front end does
//! ([`crate::cloud_hypervisor::validate`]).
//!
//! What gpuvm does not model (`smt: true`, a `cpu_template`, `cache_type: "Writeback"`...)
//! is refused afterwards by the translation ([`super::translate`]), which says why; the
//! rules here are about shape and range. gpuvm's own extension fields (`backing`,
//! `cpuid_masks`, a drive's `serial`...) are accepted where the translation takes them.
//! Values are quoted cut short, so a huge string never comes back whole.

use serde_json::{Map, Value};

/// Most vCPUs: above Firecracker's 32, as gpuvm's own API (a GPU VM wants a socket's
/// worth); the host's KVM limit is checked when the VM is built.
pub const MAX_VCPUS: u64 = gpuvm_vmm::action::MAX_VCPUS as u64;
/// The largest guest gpuvm's Firecracker mode takes, in MiB (16 TiB): past it the size in
/// bytes is absurd for any host, and a multiplication by 2^20 could overflow.
pub const MAX_MEM_MIB: u64 = 1 << 24;
/// Firecracker's kernel command line limit on x86_64, in bytes.
pub const MAX_BOOT_ARGS: usize = 2048;
/// Firecracker's longest resource id.
pub const MAX_ID_LEN: usize = 64;
/// The longest path (Linux PATH_MAX, with its NUL).
pub const MAX_PATH_LEN: usize = 4095;
/// Any other string field (a level name, a MAC, a CPU template name).
const MAX_SHORT_STRING: usize = 256;
/// The longest Linux interface name (IFNAMSIZ - 1).
const MAX_IFNAME: usize = 15;
/// How much of a refused value a message quotes.
const QUOTE_LEN: usize = 64;

/// What a field holds.
#[derive(Clone, Copy)]
enum Kind {
    Bool,
    /// An integer in `min..=max`.
    UInt(u64, u64),
    /// A string of at most this many bytes (and at least 1).
    Str(usize),
    /// Firecracker's resource ids: 1 to 64 of `[A-Za-z0-9_.-]`.
    Id,
    /// A host path: 1 to PATH_MAX bytes, no NUL.
    Path,
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// A JSON object with these fields.
    Object(&'static [Field]),
    /// A list of this kind.
    List(&'static Kind),
}

/// One field of a body.
struct Field {
    name: &'static str,
    kind: Kind,
    required: bool,
    /// `null` stands for "left out" (an `Option` in both Firecracker and gpuvm).
    nullable: bool,
}

const fn required(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        required: true,
        nullable: false,
    }
}

/// Optional; `null` is refused (gpuvm's field has a default, not an `Option`).
const fn optional(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        required: false,
        nullable: false,
    }
}

/// Optional; `null` means left out.
const fn nullable(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        required: false,
        nullable: true,
    }
}

const U16: Kind = Kind::UInt(0, u16::MAX as u64);
const U32: Kind = Kind::UInt(0, u32::MAX as u64);
const U64: Kind = Kind::UInt(0, u64::MAX);

const TOKEN_BUCKET: &[Field] = &[
    required("size", U64),
    optional("one_time_burst", U64),
    // Firecracker's name is refill_time; gpuvm's refill_time_ms is taken too.
    optional("refill_time", U64),
    optional("refill_time_ms", U64),
];

const RATE_LIMITER: &[Field] = &[
    nullable("bandwidth", Kind::Object(TOKEN_BUCKET)),
    nullable("ops", Kind::Object(TOKEN_BUCKET)),
];

const MACHINE_CONFIG: &[Field] = &[
    required("vcpu_count", Kind::UInt(1, MAX_VCPUS)),
    required("mem_size_mib", Kind::UInt(1, MAX_MEM_MIB)),
    nullable("smt", Kind::Bool),
    nullable("cpu_template", Kind::Str(MAX_SHORT_STRING)),
    nullable("track_dirty_pages", Kind::Bool),
    nullable("huge_pages", Kind::OneOf(&["None", "2M"])),
    // gpuvm's extensions.
    nullable(
        "backing",
        Kind::OneOf(&["memfd", "hugetlb-2m", "hugetlb-1g"]),
    ),
    nullable("thp", Kind::Bool),
    nullable("prefault", Kind::Bool),
    nullable("cpuid_masks", Kind::List(&Kind::Str(MAX_SHORT_STRING))),
];

const BOOT_SOURCE: &[Field] = &[
    required("kernel_image_path", Kind::Path),
    nullable("initrd_path", Kind::Path),
    nullable("boot_args", Kind::Str(MAX_BOOT_ARGS)),
];

const DRIVE: &[Field] = &[
    required("drive_id", Kind::Id),
    // Firecracker requires it; gpuvm has always defaulted it to false.
    optional("is_root_device", Kind::Bool),
    optional("path_on_host", Kind::Path),
    optional("is_read_only", Kind::Bool),
    nullable("partuuid", Kind::Str(MAX_SHORT_STRING)),
    nullable("cache_type", Kind::OneOf(&["Unsafe", "Writeback"])),
    optional("io_engine", Kind::OneOf(&["Sync", "Async"])),
    optional("rate_limiter", Kind::Object(RATE_LIMITER)),
    optional("socket", Kind::Path),
    // gpuvm's extensions (its own drive body's names).
    optional("path", Kind::Path),
    optional("read_only", Kind::Bool),
    optional("root", Kind::Bool),
    optional("direct", Kind::Bool),
    nullable("serial", Kind::Str(MAX_SHORT_STRING)),
    optional("num_queues", U16),
    optional("queue_size", U16),
];

const NETWORK_INTERFACE: &[Field] = &[
    required("iface_id", Kind::Id),
    required("host_dev_name", Kind::Str(MAX_IFNAME)),
    nullable("guest_mac", Kind::Str(MAX_SHORT_STRING)),
    optional("rx_rate_limiter", Kind::Object(RATE_LIMITER)),
    optional("tx_rate_limiter", Kind::Object(RATE_LIMITER)),
    // gpuvm's extensions.
    optional("num_queue_pairs", U16),
    optional("queue_size", U16),
];

const VSOCK: &[Field] = &[
    // 0-2 are the hypervisor's, the local and the host's; u32::MAX is VMADDR_CID_ANY.
    required("guest_cid", Kind::UInt(3, u32::MAX as u64 - 1)),
    required("uds_path", Kind::Path),
    nullable("vsock_id", Kind::Str(MAX_SHORT_STRING)),
];

const ENTROPY: &[Field] = &[
    optional("rate_limiter", Kind::Object(RATE_LIMITER)),
    // gpuvm's extension: where the entropy comes from.
    nullable("source", Kind::Path),
];

const BALLOON: &[Field] = &[
    required("amount_mib", U32),
    required("deflate_on_oom", Kind::Bool),
    optional("stats_polling_interval_s", U16),
    nullable("free_page_hinting", Kind::Bool),
    nullable("free_page_reporting", Kind::Bool),
];

const LOGGER: &[Field] = &[
    nullable("log_path", Kind::Path),
    nullable("level", Kind::Str(MAX_SHORT_STRING)),
    nullable("show_level", Kind::Bool),
    nullable("show_log_origin", Kind::Bool),
    nullable("module", Kind::Str(MAX_SHORT_STRING)),
];

const METRICS: &[Field] = &[required("metrics_path", Kind::Path)];

const MMDS_CONFIG: &[Field] = &[
    optional("version", Kind::OneOf(&["V1", "V2"])),
    required("network_interfaces", Kind::List(&Kind::Id)),
    optional("ipv4_address", Kind::Str(MAX_SHORT_STRING)),
    optional("imds_compat", Kind::Bool),
];

const SNAPSHOT_CREATE: &[Field] = &[
    required("snapshot_path", Kind::Path),
    required("mem_file_path", Kind::Path),
    optional("snapshot_type", Kind::OneOf(&["Full", "Diff"])),
];

const MEM_BACKEND: &[Field] = &[
    required("backend_type", Kind::OneOf(&["File", "Uffd"])),
    required("backend_path", Kind::Path),
];

const NETWORK_OVERRIDE: &[Field] = &[
    required("iface_id", Kind::Id),
    required("host_dev_name", Kind::Str(MAX_IFNAME)),
];

const VSOCK_OVERRIDE: &[Field] = &[required("uds_path", Kind::Path)];

const SNAPSHOT_LOAD: &[Field] = &[
    required("snapshot_path", Kind::Path),
    nullable("mem_file_path", Kind::Path),
    nullable("mem_backend", Kind::Object(MEM_BACKEND)),
    optional("enable_diff_snapshots", Kind::Bool),
    optional("track_dirty_pages", Kind::Bool),
    optional("resume_vm", Kind::Bool),
    nullable(
        "network_overrides",
        Kind::List(&Kind::Object(NETWORK_OVERRIDE)),
    ),
    nullable("vsock_override", Kind::Object(VSOCK_OVERRIDE)),
    optional("clock_realtime", Kind::Bool),
];

/// A body's kind: which route (or `--config-file` section) it is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    MachineConfig,
    /// PATCH /machine-config: every field optional.
    MachineConfigPatch,
    BootSource,
    Drive,
    NetworkInterface,
    Vsock,
    Entropy,
    Balloon,
    Logger,
    Metrics,
    MmdsConfig,
    SnapshotCreate,
    SnapshotLoad,
}

impl Body {
    fn fields(self) -> &'static [Field] {
        match self {
            Body::MachineConfig | Body::MachineConfigPatch => MACHINE_CONFIG,
            Body::BootSource => BOOT_SOURCE,
            Body::Drive => DRIVE,
            Body::NetworkInterface => NETWORK_INTERFACE,
            Body::Vsock => VSOCK,
            Body::Entropy => ENTROPY,
            Body::Balloon => BALLOON,
            Body::Logger => LOGGER,
            Body::Metrics => METRICS,
            Body::MmdsConfig => MMDS_CONFIG,
            Body::SnapshotCreate => SNAPSHOT_CREATE,
            Body::SnapshotLoad => SNAPSHOT_LOAD,
        }
    }

    /// The field path's first part for an API body (a config file's sections are named by
    /// their key and index instead).
    pub fn api_name(self) -> &'static str {
        match self {
            Body::MachineConfig | Body::MachineConfigPatch => "machine-config",
            Body::BootSource => "boot-source",
            Body::Drive => "drive",
            Body::NetworkInterface => "network-interface",
            Body::Vsock => "vsock",
            Body::Entropy => "entropy",
            Body::Balloon => "balloon",
            Body::Logger => "logger",
            Body::Metrics => "metrics",
            Body::MmdsConfig => "mmds-config",
            Body::SnapshotCreate => "snapshot-create",
            Body::SnapshotLoad => "snapshot-load",
        }
    }
}

/// Checks an API request's body; the refusal names every bad field.
pub fn api_body(kind: Body, value: &Value) -> Result<(), String> {
    let mut refusals = Refusals::default();
    check_body(&mut refusals, kind.api_name(), kind, value);
    refusals.into_result()
}

/// The `--config-file` sections checked here, with the body each holds; `true` for a
/// list of bodies.
const CONFIG_SECTIONS: &[(&str, Body, bool)] = &[
    ("logger", Body::Logger, false),
    ("metrics", Body::Metrics, false),
    ("machine-config", Body::MachineConfig, false),
    ("boot-source", Body::BootSource, false),
    ("drives", Body::Drive, true),
    ("network-interfaces", Body::NetworkInterface, true),
    ("vsock", Body::Vsock, false),
    ("entropy", Body::Entropy, false),
    ("balloon", Body::Balloon, false),
    ("mmds-config", Body::MmdsConfig, false),
];

/// Checks every section of a `--config-file` that this pass knows (the translation
/// refuses sections gpuvm does not serve); `null` sections are left out, as Firecracker
/// takes them.
pub fn config_file(json: &Value) -> Result<(), String> {
    let mut refusals = Refusals::default();
    let Some(object) = json.as_object() else {
        refusals.push("(the configuration)", "not a JSON object");
        return refusals.into_result();
    };
    for &(name, kind, is_list) in CONFIG_SECTIONS {
        let Some(value) = object.get(name).filter(|v| !v.is_null()) else {
            continue;
        };
        if !is_list {
            check_body(&mut refusals, name, kind, value);
            continue;
        }
        let Some(items) = value.as_array() else {
            refusals.value(name, value, "not a list");
            continue;
        };
        for (i, item) in items.iter().enumerate() {
            check_body(&mut refusals, &format!("{name}[{i}]"), kind, item);
        }
    }
    refusals.into_result()
}

fn check_body(refusals: &mut Refusals, at: &str, kind: Body, value: &Value) {
    let Some(object) = value.as_object() else {
        refusals.value(at, value, "not a JSON object");
        return;
    };
    let fields = kind.fields();
    check_object(
        refusals,
        at,
        fields,
        object,
        kind != Body::MachineConfigPatch,
    );
    if kind == Body::Drive {
        drive_rules(refusals, at, object);
    }
}

/// What a drive needs beyond its fields' shapes: one backing, not two.
fn drive_rules(refusals: &mut Refusals, at: &str, object: &Map<String, Value>) {
    let given = |name: &str| object.get(name).is_some_and(|v| !v.is_null());
    let backings: Vec<&str> = ["path_on_host", "path", "socket"]
        .into_iter()
        .filter(|name| given(name))
        .collect();
    match backings.as_slice() {
        [] => refusals.push(
            &format!("{at}.path_on_host"),
            "required (or a vhost-user drive's socket)",
        ),
        [_] => {}
        [first, second, ..] => refusals.push(
            &format!("{at}.{second}"),
            &format!("{first} is given too: a drive has one backing"),
        ),
    }
}

fn check_object(
    refusals: &mut Refusals,
    at: &str,
    fields: &[Field],
    object: &Map<String, Value>,
    enforce_required: bool,
) {
    for (name, value) in object {
        let path = format!("{at}.{}", quote_key(name));
        let Some(field) = fields.iter().find(|f| f.name == name) else {
            let known: Vec<&str> = fields.iter().map(|f| f.name).collect();
            refusals.push(
                &path,
                &format!("unknown field (the fields here: {})", known.join(", ")),
            );
            continue;
        };
        if value.is_null() {
            if field.required {
                refusals.push(&path, "required, and null is not a value");
            } else if !field.nullable {
                refusals.push(&path, "null is not a value here (leave the field out)");
            }
            continue;
        }
        check_value(refusals, &path, field.kind, value);
    }
    if enforce_required {
        for field in fields.iter().filter(|f| f.required) {
            if !object.contains_key(field.name) {
                refusals.push(&format!("{at}.{}", field.name), "required");
            }
        }
    }
}

fn check_value(refusals: &mut Refusals, at: &str, kind: Kind, value: &Value) {
    match kind {
        Kind::Bool => {
            if !value.is_boolean() {
                refusals.value(at, value, "not a boolean");
            }
        }
        Kind::UInt(min, max) => match value.as_u64() {
            Some(n) if (min..=max).contains(&n) => {}
            _ => refusals.value(at, value, &format!("an integer in {min}..={max}")),
        },
        Kind::Str(max) => string(refusals, at, value, max, |_| None),
        Kind::Id => string(refusals, at, value, MAX_ID_LEN, |s| {
            (!s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .then_some("an id is made of [A-Za-z0-9_.-]")
        }),
        Kind::Path => string(refusals, at, value, MAX_PATH_LEN, |s| {
            s.contains('\0').then_some("a path has no NUL byte")
        }),
        Kind::OneOf(choices) => {
            if !value.as_str().is_some_and(|s| choices.contains(&s)) {
                refusals.value(at, value, &format!("one of {}", choices.join(", ")));
            }
        }
        Kind::Object(fields) => match value.as_object() {
            Some(object) => check_object(refusals, at, fields, object, true),
            None => refusals.value(at, value, "not a JSON object"),
        },
        Kind::List(item) => match value.as_array() {
            Some(items) => {
                for (i, v) in items.iter().enumerate() {
                    check_value(refusals, &format!("{at}[{i}]"), *item, v);
                }
            }
            None => refusals.value(at, value, "not a list"),
        },
    }
}

fn string(
    refusals: &mut Refusals,
    at: &str,
    value: &Value,
    max: usize,
    rule: impl Fn(&str) -> Option<&'static str>,
) {
    let Some(s) = value.as_str() else {
        refusals.value(at, value, "not a string");
        return;
    };
    if s.is_empty() || s.len() > max {
        refusals.push(at, &format!("{} bytes, 1 to {max} allowed", s.len()));
    } else if let Some(why) = rule(s) {
        refusals.value(at, value, why);
    }
}

/// A field name as the client sent it, cut short and with anything odd escaped.
fn quote_key(name: &str) -> String {
    let plain = name.len() <= QUOTE_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if plain {
        name.to_string()
    } else {
        format!("{:?}", cut(name))
    }
}

fn cut(text: &str) -> String {
    match text.char_indices().nth(QUOTE_LEN) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

/// The refused values, in the order found.
#[derive(Default)]
struct Refusals(Vec<String>);

impl Refusals {
    fn push(&mut self, field: &str, why: &str) {
        self.0.push(format!("{field}: {why}"));
    }

    /// `field = value: why`, the value quoted cut short (a huge string or object is not
    /// echoed whole).
    fn value(&mut self, field: &str, value: &Value, why: &str) {
        let shown = match value {
            Value::Array(_) => "a list".to_string(),
            Value::Object(_) => "an object".to_string(),
            Value::String(s) => format!("{:?}", cut(s)),
            other => cut(&other.to_string()),
        };
        self.0.push(format!("{field} = {shown}: {why}"));
    }

    fn into_result(self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self.0.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn refused(kind: Body, value: Value) -> String {
        api_body(kind, &value).unwrap_err()
    }

    #[test]
    fn every_bad_field_is_named_by_its_path_in_one_answer() {
        let message = refused(
            Body::MachineConfig,
            json!({"vcpu_count": 255, "mem_size_mib": "512", "smt": "no", "huge_pages": "1G",
                   "cpu_template": null, "colour": 1}),
        );
        for needle in [
            "machine-config.vcpu_count = 255: an integer in 1..=254",
            "machine-config.mem_size_mib = \"512\": an integer in 1..=16777216",
            "machine-config.smt = \"no\": not a boolean",
            "machine-config.huge_pages = \"1G\": one of None, 2M",
            "machine-config.colour: unknown field",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        assert_eq!(message.matches("; ").count(), 4, "{message}");
        // A PATCH needs no field, a PUT both counts.
        api_body(Body::MachineConfigPatch, &json!({"vcpu_count": 2})).unwrap();
        let message = refused(Body::MachineConfig, json!({"vcpu_count": 2}));
        assert_eq!(message, "machine-config.mem_size_mib: required");
    }

    #[test]
    fn absurd_numbers_are_refused_not_wrapped() {
        for (value, needle) in [
            (json!(0), "= 0:"),
            (json!(-1), "= -1:"),
            (json!(1.5), "= 1.5:"),
            (json!(256), "= 256:"),
            (json!(18446744073709551615u64), "= 18446744073709551615:"),
            (json!(1e300), "= 1e+300:"),
        ] {
            let message = refused(
                Body::MachineConfig,
                json!({"vcpu_count": value, "mem_size_mib": 128}),
            );
            assert!(
                message.starts_with("machine-config.vcpu_count ") && message.contains(needle),
                "{value}: {message}"
            );
        }
        let message = refused(
            Body::MachineConfig,
            json!({"vcpu_count": 1, "mem_size_mib": u64::MAX}),
        );
        assert!(message.contains("machine-config.mem_size_mib"), "{message}");
        let message = refused(Body::Vsock, json!({"guest_cid": 2, "uds_path": "/v.sock"}));
        assert!(message.contains("vsock.guest_cid = 2"), "{message}");
        let message = refused(
            Body::Balloon,
            json!({"amount_mib": 4294967296u64, "deflate_on_oom": true}),
        );
        assert!(message.contains("balloon.amount_mib"), "{message}");
    }

    #[test]
    fn huge_strings_are_measured_not_echoed() {
        let huge = "x".repeat(1 << 20);
        let message = refused(
            Body::BootSource,
            json!({"kernel_image_path": huge, "boot_args": "a".repeat(4096)}),
        );
        assert!(
            message.contains("boot-source.kernel_image_path: 1048576 bytes, 1 to 4095 allowed"),
            "{message}"
        );
        assert!(
            message.contains("boot-source.boot_args: 4096 bytes, 1 to 2048 allowed"),
            "{message}"
        );
        assert!(message.len() < 512, "the answer stays short");
        // An unknown field with a huge name is quoted cut short.
        let mut body = Map::new();
        body.insert(huge.clone(), json!(1));
        body.insert("kernel_image_path".into(), json!("/k"));
        let message = refused(Body::BootSource, Value::Object(body));
        assert!(
            message.starts_with("boot-source.\"xxxx"),
            "{}",
            cut(&message)
        );
        assert!(message.len() < 512);
        let message = refused(
            Body::Drive,
            json!({"drive_id": "a/b", "path_on_host": "/x\u{0}y", "is_root_device": false}),
        );
        assert!(
            message.contains("drive.drive_id = \"a/b\": an id is made of"),
            "{message}"
        );
        assert!(
            message.contains("drive.path_on_host = \"/x\\0y\": a path has no NUL byte"),
            "{message}"
        );
    }

    #[test]
    fn nulls_nested_objects_and_wrong_types() {
        let message = refused(
            Body::Drive,
            json!({"drive_id": null, "path_on_host": "/x", "is_read_only": null,
                   "rate_limiter": {"bandwidth": {"size": -5, "refill_time": null}, "ops": 7}}),
        );
        for needle in [
            "drive.drive_id: required, and null is not a value",
            "drive.is_read_only: null is not a value here",
            "drive.rate_limiter.bandwidth.size = -5",
            "drive.rate_limiter.bandwidth.refill_time: null is not a value here",
            "drive.rate_limiter.ops = 7: not a JSON object",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        // null where Firecracker's field is an Option: left out.
        api_body(
            Body::SnapshotLoad,
            &json!({"snapshot_path": "/s", "mem_file_path": "/m", "mem_backend": null,
                    "network_overrides": null, "vsock_override": null}),
        )
        .unwrap();
        for body in [json!(null), json!([]), json!("x"), json!(7)] {
            let message = refused(Body::Logger, body.clone());
            assert!(
                message.starts_with("logger = ") && message.ends_with("not a JSON object"),
                "{body}: {message}"
            );
        }
        let message = refused(
            Body::SnapshotLoad,
            json!({"snapshot_path": "/s", "mem_backend": {"backend_type": "Tape"},
                   "network_overrides": [{"iface_id": "eth0"}, 3]}),
        );
        for needle in [
            "snapshot-load.mem_backend.backend_type = \"Tape\": one of File, Uffd",
            "snapshot-load.mem_backend.backend_path: required",
            "snapshot-load.network_overrides[0].host_dev_name: required",
            "snapshot-load.network_overrides[1] = 3: not a JSON object",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        let message = refused(Body::MmdsConfig, json!({"network_interfaces": "eth0"}));
        assert_eq!(
            message,
            "mmds-config.network_interfaces = \"eth0\": not a list"
        );
        let message = refused(
            Body::Drive,
            json!({"drive_id": "d", "path_on_host": "/a", "socket": "/s"}),
        );
        assert!(
            message.contains("drive.socket: path_on_host is given too"),
            "{message}"
        );
        let message = refused(Body::Drive, json!({"drive_id": "d"}));
        assert!(
            message.contains("drive.path_on_host: required"),
            "{message}"
        );
    }

    #[test]
    fn config_file_sections_are_named_by_key_and_index() {
        let message = config_file(&json!({
            "machine-config": {"vcpu_count": 0, "mem_size_mib": 128},
            "drives": [
                {"drive_id": "root", "path_on_host": "/r", "is_root_device": true},
                {"drive_id": "b", "path_on_host": "/b", "is_root_device": false},
                {"drive_id": "c", "path_on_host": 12, "is_root_device": false}
            ],
            "network-interfaces": {"iface_id": "eth0"},
            "mmds-config": {"network_interfaces": ["eth0"], "version": "V9"},
            "balloon": null
        }))
        .unwrap_err();
        for needle in [
            "machine-config.vcpu_count = 0: an integer in 1..=254",
            "drives[2].path_on_host = 12: not a string",
            "network-interfaces = an object: not a list",
            "mmds-config.version = \"V9\": one of V1, V2",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        assert!(!message.contains("drives[0]") && !message.contains("drives[1]"));
        assert!(config_file(&json!([1])).is_err());
    }

    #[test]
    fn what_firecracker_clients_send_passes() {
        for (kind, body) in [
            (
                Body::MachineConfig,
                json!({"vcpu_count": 2, "mem_size_mib": 1024, "smt": false,
                       "track_dirty_pages": true, "huge_pages": "None"}),
            ),
            (
                Body::BootSource,
                json!({"kernel_image_path": "vmlinux", "boot_args": "console=ttyS0 reboot=k panic=1"}),
            ),
            (
                Body::Drive,
                json!({"drive_id": "rootfs", "path_on_host": "/img", "is_root_device": true,
                       "is_read_only": false, "cache_type": "Unsafe", "io_engine": "Sync",
                       "rate_limiter": {"bandwidth": {"size": 1000, "refill_time": 100, "one_time_burst": 5}}}),
            ),
            (
                Body::NetworkInterface,
                json!({"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "AA:FC:00:00:00:01",
                       "rx_rate_limiter": {"ops": {"size": 10, "refill_time_ms": 1000}}}),
            ),
            (
                Body::Vsock,
                json!({"vsock_id": "vsock0", "guest_cid": 3, "uds_path": "/v.sock"}),
            ),
            (
                Body::Balloon,
                json!({"amount_mib": 0, "deflate_on_oom": true, "stats_polling_interval_s": 1}),
            ),
            (
                Body::Logger,
                json!({"log_path": "/l", "level": "Info", "show_level": true}),
            ),
            (
                Body::MmdsConfig,
                json!({"version": "V2", "network_interfaces": ["eth0"], "ipv4_address": "169.254.170.2"}),
            ),
            (
                Body::SnapshotCreate,
                json!({"snapshot_path": "/s", "mem_file_path": "/m", "snapshot_type": "Diff"}),
            ),
        ] {
            api_body(kind, &body).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        }
    }
}
