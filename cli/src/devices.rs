//! The virtio part of the `gpuvm run` command line: `--drive`, `--net`, `--vsock` and
//! `--rng`, each a comma-separated `key=value` list with the fields of the API's body for
//! that device (short aliases for the common ones).

use clap::Args;
use gpuvm_virtio::block::BlockConfig;
use gpuvm_virtio::net::NetConfig;
use gpuvm_virtio::rng::RngConfig;
use gpuvm_virtio::vhost_user::{FsConfig, VhostUserBlockConfig, VhostUserConfig};
use gpuvm_virtio::vsock::VsockConfig;
use gpuvm_vmm::virtio::VirtioOptions;
use serde_json::{Map, Value};

use crate::CliError;

#[derive(Args, Debug, Default)]
pub struct DeviceArgs {
    /// A virtio block device: `id=ID,path=IMAGE[,ro][,direct][,serial=S][,engine=Sync|Async]
    /// [,bw=BYTES_PER_S][,iops=OPS_PER_S][,root]`, or one served by a vhost-user backend:
    /// `id=ID,vhost_user=SOCKET[,num_queues=N][,queue_size=N]`. Repeatable.
    #[arg(long = "drive", value_name = "KEY=VALUE,...")]
    pub drives: Vec<String>,
    /// A virtio network interface on a tap: `id=ID,tap=NAME[,mac=MAC][,queues=PAIRS]
    /// [,rx_bw=..][,tx_bw=..]`. Repeatable.
    #[arg(long = "net", value_name = "KEY=VALUE,...")]
    pub nets: Vec<String>,
    /// A virtio vsock (Firecracker's hybrid vsock): `cid=CID,uds=PATH`.
    #[arg(long = "vsock", value_name = "KEY=VALUE,...")]
    pub vsock: Option<String>,
    /// A virtio entropy device; optionally `src=FILE` (default: getrandom) and
    /// `bw=BYTES_PER_S`.
    #[arg(long = "rng", value_name = "KEY=VALUE,...", num_args = 0..=1, default_missing_value = "")]
    pub rng: Option<String>,
    /// A virtio-fs share served by virtiofsd: `tag=TAG,socket=SOCKET[,num_queues=N]
    /// [,queue_size=N]`. Repeatable.
    #[arg(long = "fs", value_name = "KEY=VALUE,...")]
    pub fs: Vec<String>,
    /// A virtio device of any type a vhost-user backend implements, its features and
    /// configuration space the backend's: `type=VIRTIO_ID,socket=SOCKET[,id=ID]
    /// [,num_queues=N][,queue_size=N][,config_size=BYTES]`. Repeatable.
    #[arg(long = "vhost-user", value_name = "KEY=VALUE,...")]
    pub vhost_user: Vec<String>,
}

/// Short names on the command line for the bodies' field names.
const ALIASES: &[(&str, &str)] = &[
    ("id", "@id"),
    ("ro", "read_only"),
    ("engine", "io_engine"),
    ("tap", "host_dev_name"),
    ("mac", "guest_mac"),
    ("queues", "num_queue_pairs"),
    ("cid", "guest_cid"),
    ("uds", "uds_path"),
    ("vhost_user", "socket"),
    ("src", "source"),
];

/// Fields whose values stay strings even when they look like numbers.
const STRING_FIELDS: &[&str] = &[
    "drive_id",
    "iface_id",
    "vsock_id",
    "path",
    "host_dev_name",
    "guest_mac",
    "serial",
    "uds_path",
    "source",
    "socket",
    "tag",
    "id",
];

/// A token bucket refilled once a second: `size` tokens per second.
fn per_second(size: u64) -> Value {
    serde_json::json!({ "size": size, "refill_time_ms": 1000 })
}

/// Turns `key=value,...` into the JSON body of the device's API route. `id_field` is what
/// `id=` means for this device; `limiters` maps a rate key (`bw`, `iops`, `rx_bw`, ...)
/// to the limiter field and bucket it sets.
fn to_body(
    flag: &str,
    text: &str,
    id_field: &str,
    limiters: &[(&str, &str, &str)],
) -> Result<Value, CliError> {
    let bad = |reason: String| CliError::Other(format!("--{flag} {text:?}: {reason}"));
    let mut body = Map::new();
    for item in text.split(',').filter(|item| !item.is_empty()) {
        let (key, value) = match item.split_once('=') {
            Some((key, value)) => (key, Some(value)),
            None => (item, None),
        };
        if let Some((_, field, bucket)) = limiters.iter().find(|(k, _, _)| *k == key) {
            let amount: u64 = value
                .unwrap_or_default()
                .parse()
                .map_err(|_| bad(format!("{key} needs a whole number")))?;
            let limiter = body
                .entry(field.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(limiter) = limiter {
                limiter.insert(bucket.to_string(), per_second(amount));
            }
            continue;
        }
        let field = match ALIASES.iter().find(|(alias, _)| *alias == key) {
            Some((_, "@id")) => id_field,
            Some((_, field)) => field,
            None => key,
        };
        let value = match value {
            // A bare key is a flag: `ro`, `direct`, `root`.
            None => Value::Bool(true),
            Some(value) if STRING_FIELDS.contains(&field) => Value::String(value.into()),
            Some(value) => match (value.parse::<u64>(), value) {
                (Ok(number), _) => Value::from(number),
                (_, "true" | "on" | "yes") => Value::Bool(true),
                (_, "false" | "off" | "no") => Value::Bool(false),
                (_, value) => Value::String(value.into()),
            },
        };
        if body.insert(field.to_string(), value).is_some() {
            return Err(bad(format!("{key} is given twice")));
        }
    }
    Ok(Value::Object(body))
}

fn parse<T: serde::de::DeserializeOwned>(
    flag: &str,
    text: &str,
    body: Value,
) -> Result<T, CliError> {
    serde_json::from_value(body)
        .map_err(|error| CliError::Other(format!("--{flag} {text:?}: {error}")))
}

impl DeviceArgs {
    /// The virtio devices the flags describe.
    pub fn virtio_options(&self) -> Result<VirtioOptions, CliError> {
        let mut options = VirtioOptions::default();
        for text in &self.drives {
            let limiters = [
                ("bw", "rate_limiter", "bandwidth"),
                ("iops", "rate_limiter", "ops"),
            ];
            let body = to_body("drive", text, "drive_id", &limiters)?;
            if body.get("socket").is_some() {
                options
                    .vhost_user_drives
                    .push(parse::<VhostUserBlockConfig>("drive", text, body)?);
            } else {
                options
                    .drives
                    .push(parse::<BlockConfig>("drive", text, body)?);
            }
        }
        for text in &self.nets {
            let limiters = [
                ("rx_bw", "rx_rate_limiter", "bandwidth"),
                ("tx_bw", "tx_rate_limiter", "bandwidth"),
                ("rx_pps", "rx_rate_limiter", "ops"),
                ("tx_pps", "tx_rate_limiter", "ops"),
            ];
            let body = to_body("net", text, "iface_id", &limiters)?;
            options.nets.push(parse::<NetConfig>("net", text, body)?);
        }
        for text in &self.fs {
            let body = to_body("fs", text, "tag", &[])?;
            options.fs.push(parse::<FsConfig>("fs", text, body)?);
        }
        for (index, text) in self.vhost_user.iter().enumerate() {
            let mut body = to_body("vhost-user", text, "id", &[])?;
            if let Value::Object(fields) = &mut body {
                fields
                    .entry("id")
                    .or_insert_with(|| Value::String(format!("vhost-user{index}")));
            }
            options
                .vhost_user
                .push(parse::<VhostUserConfig>("vhost-user", text, body)?);
        }
        if let Some(text) = &self.vsock {
            let body = to_body("vsock", text, "vsock_id", &[])?;
            options.vsock = Some(parse::<VsockConfig>("vsock", text, body)?);
        }
        if let Some(text) = &self.rng {
            let limiters = [("bw", "rate_limiter", "bandwidth")];
            let body = to_body("rng", text, "id", &limiters)?;
            options.rng = Some(parse::<RngConfig>("rng", text, body)?);
        }
        options
            .validate()
            .map_err(|error| CliError::Other(error.to_string()))?;
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(drives: &[&str], nets: &[&str], vsock: Option<&str>, rng: Option<&str>) -> DeviceArgs {
        DeviceArgs {
            drives: drives.iter().map(|s| s.to_string()).collect(),
            nets: nets.iter().map(|s| s.to_string()).collect(),
            vsock: vsock.map(str::to_string),
            rng: rng.map(str::to_string),
            fs: Vec::new(),
            vhost_user: Vec::new(),
        }
    }

    #[test]
    fn flags_become_the_api_bodies() {
        let options = args(
            &["id=rootfs,path=/img/root.ext4,ro,serial=0001,engine=Sync,bw=1048576,iops=100,root"],
            &["id=eth0,tap=tap0,mac=06:00:ac:10:00:02,queues=1"],
            Some("cid=3,uds=/run/v.sock"),
            Some(""),
        )
        .virtio_options()
        .unwrap();
        let drive = &options.drives[0];
        assert_eq!(drive.drive_id, "rootfs");
        assert_eq!(drive.path.to_str(), Some("/img/root.ext4"));
        assert!(drive.read_only && drive.root && !drive.direct);
        assert_eq!(drive.serial.as_deref(), Some("0001"));
        let bandwidth = drive.rate_limiter.bandwidth.unwrap();
        assert_eq!((bandwidth.size, bandwidth.refill_time_ms), (1 << 20, 1000));
        assert_eq!(drive.rate_limiter.ops.unwrap().size, 100);
        assert_eq!(options.nets[0].host_dev_name.as_deref(), Some("tap0"));
        assert_eq!(options.vsock.as_ref().unwrap().guest_cid, 3);
        assert_eq!(options.rng, Some(RngConfig::default()));
    }

    #[test]
    fn vhost_user_drives_and_shares() {
        let mut flags = args(
            &["id=data,vhost_user=/run/qsd.sock,num_queues=2"],
            &[],
            None,
            None,
        );
        flags.fs = vec!["tag=kataShared,socket=/run/vfs.sock".into()];
        let options = flags.virtio_options().unwrap();
        assert!(options.drives.is_empty());
        let drive = &options.vhost_user_drives[0];
        assert_eq!((drive.drive_id.as_str(), drive.num_queues), ("data", 2));
        assert_eq!(drive.socket.to_str(), Some("/run/qsd.sock"));
        assert_eq!(options.fs[0].tag, "kataShared");
        let mut long_tag = args(&[], &[], None, None);
        long_tag.fs = vec![format!("tag={},socket=/s", "t".repeat(37))];
        assert!(long_tag.virtio_options().is_err());
    }

    #[test]
    fn generic_vhost_user_devices() {
        let mut flags = args(&[], &[], None, None);
        flags.vhost_user = vec![
            "type=2,socket=/run/qsd.sock,num_queues=1,queue_size=128".into(),
            "type=19,socket=/run/vsock.sock,id=vs0".into(),
        ];
        let options = flags.virtio_options().unwrap();
        let block = &options.vhost_user[0];
        assert_eq!((block.id.as_str(), block.device_type), ("vhost-user0", 2));
        assert_eq!((block.num_queues, block.queue_size), (Some(1), 128));
        assert_eq!(block.socket.to_str(), Some("/run/qsd.sock"));
        assert_eq!(options.vhost_user[1].id, "vs0");
        let error = |text: &str| {
            let mut flags = args(&[], &[], None, None);
            flags.vhost_user = vec![text.to_string()];
            flags.virtio_options().unwrap_err().to_string()
        };
        assert!(error("type=0,socket=/s").contains("type 0 is reserved"));
        assert!(error("type=99,socket=/s").contains("type 99 is not a virtio device ID"));
        assert!(error("type=5,socket=/s").contains("balloon"));
        assert!(error("type=2").contains("socket"));
        assert!(error("socket=/s").contains("type"));
        assert!(error("type=blk,socket=/s").contains("type"));
    }

    #[test]
    fn bad_flags_name_what_is_wrong() {
        let error = |a: DeviceArgs| a.virtio_options().unwrap_err().to_string();
        assert!(error(args(&["id=a,path=/x,colour=red"], &[], None, None)).contains("colour"));
        assert!(error(args(&["path=/x"], &[], None, None)).contains("drive_id"));
        assert!(error(args(&["id=a,path=/x,bw=lots"], &[], None, None)).contains("whole number"));
        assert!(error(args(&["id=a,path=/x,path=/y"], &[], None, None)).contains("twice"));
        assert!(error(args(&["id=a,path=/x", "id=a,path=/y"], &[], None, None)).contains("twice"));
        assert!(error(args(&[], &[], Some("uds=/v.sock"), None)).contains("guest_cid"));
    }
}
