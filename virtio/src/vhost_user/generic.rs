//! [`VhostUserGeneric`]: any virtio device type a vhost-user backend implements, its
//! features and configuration space taken from the backend (QEMU's `vhost-user-device`).
//!
//! gpuvm knows nothing of the device's requests: the backend serves every queue, and the
//! guest sees the backend's device-specific features and its GET_CONFIG answer. Types whose
//! device gpuvm must own (guest memory, DMA translation) or that need vhost-user parts
//! gpuvm does not implement (shared memory windows, backend requests) are refused.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use virtio_bindings::virtio_ids::*;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use super::lifecycle::{check_queues, thread_name, VhostUserCore, VhostUserDevice, VhostUserKind};
use super::{Timeouts, VhostUserError};

const KIND: &str = "vhost-user";
/// The largest configuration space gpuvm reads from a backend (virtio-pci's device
/// configuration capability has room for far more; no device type needs more than this).
pub const MAX_CONFIG_SIZE: u16 = 256;

/// Feature bits the guest sees from the backend: the device-specific ranges (0 to 23 and
/// 50 to 63) and the ring features gpuvm's transport does. Transport bits (VERSION_1,
/// ACCESS_PLATFORM, packed rings, ...) are the transport's; bit 30 only means the backend
/// speaks the protocol-feature messages.
const FORWARDED_FEATURES: u64 = 0x00ff_ffff
    | (0x3fff << 50)
    | (1 << VIRTIO_RING_F_INDIRECT_DESC)
    | (1 << VIRTIO_RING_F_EVENT_IDX);

/// What gpuvm knows of a virtio device type.
struct DeviceType {
    id: u32,
    name: &'static str,
    /// Queues the device has without multiqueue (the default `num_queues`).
    queues: u16,
    /// Bytes of its configuration space read from the backend by default (the fields
    /// every backend of the type has; `config_size` overrides it).
    config_size: u16,
    /// Why gpuvm refuses to pass the type through, if it does.
    refusal: Option<&'static str>,
}

const fn allowed(id: u32, name: &'static str, queues: u16, config_size: u16) -> DeviceType {
    DeviceType {
        id,
        name,
        queues,
        config_size,
        refusal: None,
    }
}

const fn refused(id: u32, name: &'static str, why: &'static str) -> DeviceType {
    DeviceType {
        id,
        name,
        queues: 1,
        config_size: 0,
        refusal: Some(why),
    }
}

/// Why neither balloon type can be a vhost-user device.
const BALLOON_REFUSAL: &str =
    "a balloon hands guest memory back to the host, which only the VMM that owns guest RAM can do";

/// The virtio device types of the virtio specification (virtio_ids.h).
const DEVICE_TYPES: &[DeviceType] = &[
    // mac, status, max_virtqueue_pairs, mtu.
    allowed(VIRTIO_ID_NET, "net", 2, 12),
    // Up to write_zeroes_may_unmap and its padding, as --drive's vhost_user.
    allowed(VIRTIO_ID_BLOCK, "block", 1, 60),
    // cols, rows, max_nr_ports, emerg_wr.
    allowed(VIRTIO_ID_CONSOLE, "console", 2, 12),
    allowed(VIRTIO_ID_RNG, "entropy", 1, 0),
    refused(VIRTIO_ID_BALLOON, "balloon", BALLOON_REFUSAL),
    allowed(VIRTIO_ID_IOMEM, "iomem", 1, 0),
    allowed(VIRTIO_ID_RPMSG, "rpmsg", 2, 0),
    // num_queues, seg_max, max_sectors, cmd_per_lun, event_info_size, sense_size,
    // cdb_size, max_channel, max_target, max_lun.
    allowed(VIRTIO_ID_SCSI, "scsi", 3, 36),
    allowed(VIRTIO_ID_9P, "9p", 1, 0),
    allowed(VIRTIO_ID_MAC80211_WLAN, "mac80211-wlan", 2, 0),
    allowed(VIRTIO_ID_RPROC_SERIAL, "rproc-serial", 2, 0),
    allowed(VIRTIO_ID_CAIF, "caif", 2, 0),
    refused(VIRTIO_ID_MEMORY_BALLOON, "memory-balloon", BALLOON_REFUSAL),
    refused(
        VIRTIO_ID_GPU,
        "gpu",
        "vhost-user-gpu needs its display socket (VHOST_USER_GPU_SET_SOCKET) and host-visible \
         shared memory, which gpuvm does not implement",
    ),
    allowed(VIRTIO_ID_CLOCK, "clock", 1, 0),
    allowed(VIRTIO_ID_INPUT, "input", 2, 0),
    // guest_cid.
    allowed(VIRTIO_ID_VSOCK, "vsock", 3, 8),
    allowed(VIRTIO_ID_CRYPTO, "crypto", 2, 0),
    allowed(VIRTIO_ID_SIGNAL_DIST, "signal-dist", 2, 0),
    allowed(VIRTIO_ID_PSTORE, "pstore", 1, 0),
    refused(
        VIRTIO_ID_IOMMU,
        "iommu",
        "an IOMMU translates every device's DMA, so it must be the VMM's own device",
    ),
    refused(
        VIRTIO_ID_MEM,
        "mem",
        "virtio-mem plugs and unplugs guest RAM, which only the VMM that owns it can do",
    ),
    allowed(VIRTIO_ID_SOUND, "sound", 4, 0),
    refused(
        VIRTIO_ID_FS,
        "fs",
        "virtio-fs's configuration space (its tag) is gpuvm's, not virtiofsd's: use \
         --fs tag=TAG,socket=SOCKET",
    ),
    refused(
        VIRTIO_ID_PMEM,
        "pmem",
        "virtio-pmem needs a memory window in guest physical space mapped from the backend, \
         which gpuvm does not do for vhost-user devices",
    ),
    allowed(VIRTIO_ID_RPMB, "rpmb", 1, 0),
    allowed(VIRTIO_ID_MAC80211_HWSIM, "mac80211-hwsim", 2, 0),
    allowed(VIRTIO_ID_VIDEO_ENCODER, "video-encoder", 2, 0),
    allowed(VIRTIO_ID_VIDEO_DECODER, "video-decoder", 2, 0),
    allowed(VIRTIO_ID_SCMI, "scmi", 1, 0),
    allowed(VIRTIO_ID_NITRO_SEC_MOD, "nitro-sec-mod", 1, 0),
    allowed(VIRTIO_ID_I2C_ADAPTER, "i2c", 1, 0),
    allowed(VIRTIO_ID_WATCHDOG, "watchdog", 1, 0),
    allowed(VIRTIO_ID_CAN, "can", 3, 0),
    allowed(VIRTIO_ID_DMABUF, "dmabuf", 1, 0),
    allowed(VIRTIO_ID_PARAM_SERV, "param-serv", 1, 0),
    allowed(VIRTIO_ID_AUDIO_POLICY, "audio-policy", 1, 0),
    allowed(VIRTIO_ID_BT, "bt", 2, 0),
    allowed(VIRTIO_ID_GPIO, "gpio", 2, 0),
];

fn device_type(id: u32) -> Option<&'static DeviceType> {
    DEVICE_TYPES.iter().find(|known| known.id == id)
}

fn default_queue_size() -> u16 {
    256
}

/// `--vhost-user type=ID,socket=SOCKET`: a virtio device of type `type` (the virtio
/// device ID, e.g. 2 for block) whose queues, features and configuration space a
/// vhost-user backend provides.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostUserConfig {
    /// The device's name in logs and errors.
    pub id: String,
    /// The virtio device ID.
    #[serde(rename = "type")]
    pub device_type: u32,
    /// The backend's listening Unix socket.
    pub socket: PathBuf,
    /// Every queue of the device (the backend serves them all); the type's queue count
    /// without multiqueue when absent.
    #[serde(default)]
    pub num_queues: Option<u16>,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// Bytes of configuration space read from the backend (GET_CONFIG); what every
    /// backend of the type has when absent.
    #[serde(default)]
    pub config_size: Option<u16>,
}

impl VhostUserConfig {
    pub fn new(id: impl Into<String>, device_type: u32, socket: impl Into<PathBuf>) -> Self {
        VhostUserConfig {
            id: id.into(),
            device_type,
            socket: socket.into(),
            num_queues: None,
            queue_size: default_queue_size(),
            config_size: None,
        }
    }

    /// What logs and errors call the device: "vhost-user block ID".
    pub fn describe_device(&self) -> String {
        match device_type(self.device_type) {
            Some(known) => format!("{KIND} {} {}", known.name, self.id),
            None => format!("{KIND} {}", self.id),
        }
    }

    /// The device's queue count.
    pub fn queues(&self) -> u16 {
        self.num_queues
            .unwrap_or_else(|| device_type(self.device_type).map_or(1, |known| known.queues))
    }

    /// Bytes of configuration space the device has.
    pub fn config_bytes(&self) -> u16 {
        self.config_size
            .unwrap_or_else(|| device_type(self.device_type).map_or(0, |known| known.config_size))
    }

    /// Refuses device types that are not virtio's or that gpuvm cannot pass through, and
    /// queue and configuration sizes out of range.
    pub fn validate(&self) -> Result<(), VhostUserError> {
        let device = self.describe_device();
        let refuse = |reason: String| {
            Err(VhostUserError::Config {
                device: device.clone(),
                reason,
            })
        };
        if self.device_type == 0 {
            return refuse("type 0 is reserved by virtio (it means no device)".to_string());
        }
        let Some(known) = device_type(self.device_type) else {
            return refuse(format!(
                "type {} is not a virtio device ID (virtio defines 1 to 41, minus 14 and 15)",
                self.device_type
            ));
        };
        if let Some(why) = known.refusal {
            return refuse(format!(
                "type {} ({}) cannot be a generic vhost-user device: {why}",
                self.device_type, known.name
            ));
        }
        if self.config_bytes() > MAX_CONFIG_SIZE {
            return refuse(format!(
                "config_size {} is more than {MAX_CONFIG_SIZE}",
                self.config_bytes()
            ));
        }
        check_queues(&device, self.queues(), self.queue_size)
    }
}

impl VhostUserKind for VhostUserConfig {
    fn device_type(&self) -> u32 {
        self.device_type
    }

    fn socket(&self) -> &Path {
        &self.socket
    }

    fn queue_count(&self) -> usize {
        usize::from(self.queues())
    }

    fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// The configuration space is the backend's, so are its writable fields.
    fn passes_config_writes(&self) -> bool {
        true
    }

    fn names(&self) -> (&'static str, String, String) {
        (KIND, self.describe_device(), thread_name("vu", &self.id))
    }
}

/// A virtio device of any type a vhost-user backend implements. The guest sees the
/// backend's device-specific features and its configuration space as GET_CONFIG reads
/// it at construction; the guest's writes go to the backend with SET_CONFIG (and into
/// that copy once the backend accepts them).
pub type VhostUserGeneric = VhostUserDevice<VhostUserConfig>;

impl VhostUserGeneric {
    /// Connects to the backend with the default [`Timeouts`], negotiates, and reads the
    /// configuration space.
    pub fn new(config: VhostUserConfig) -> Result<VhostUserGeneric, VhostUserError> {
        Self::with_timeouts(config, Timeouts::default())
    }

    pub fn with_timeouts(
        config: VhostUserConfig,
        timeouts: Timeouts,
    ) -> Result<VhostUserGeneric, VhostUserError> {
        config.validate()?;
        let (kind, name, thread) = config.names();
        let core = VhostUserCore::connect(
            kind,
            name.clone(),
            thread,
            &config.socket,
            config.queue_count(),
            VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::REPLY_ACK,
            timeouts,
        )?;
        let features = core.backend_features() & FORWARDED_FEATURES;
        let config_len = usize::from(config.config_bytes());
        let config_space = if config_len == 0 {
            Vec::new()
        } else if core
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG)
        {
            let (_, mut space) = core.request("GET_CONFIG", |f| {
                f.get_config(
                    0,
                    config_len as u32,
                    VhostUserConfigFlags::empty(),
                    &vec![0u8; config_len],
                )
            })?;
            space.resize(config_len, 0);
            space
        } else {
            return Err(VhostUserError::Unsupported {
                socket: config.socket.clone(),
                missing: format!(
                    "does not offer the CONFIG protocol feature, and {name} has a \
                     {config_len}-byte configuration space (config_size=0 leaves it empty)"
                ),
            });
        };
        log::info!(
            "{name}: backend at {} (type {}, {} queues of {}, {config_len}-byte configuration, \
             features {features:#x})",
            config.socket.display(),
            config.device_type,
            config.queues(),
            config.queue_size
        );
        Ok(VhostUserGeneric {
            config,
            core,
            features,
            config_space,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(config: VhostUserConfig) -> String {
        config.validate().unwrap_err().to_string()
    }

    #[test]
    fn types_gpuvm_owns_or_cannot_pass_are_refused() {
        let error = refusal(VhostUserConfig::new("x", 0, "/s"));
        assert!(error.contains("type 0 is reserved"), "{error}");
        let error = refusal(VhostUserConfig::new("x", 14, "/s"));
        assert!(
            error.contains("type 14 is not a virtio device ID"),
            "{error}"
        );
        let error = refusal(VhostUserConfig::new("x", 4096, "/s"));
        assert!(error.contains("type 4096 is not"), "{error}");
        for (id, needle) in [
            (VIRTIO_ID_BALLOON, "balloon"),
            (VIRTIO_ID_MEMORY_BALLOON, "balloon"),
            (VIRTIO_ID_IOMMU, "IOMMU"),
            (VIRTIO_ID_MEM, "virtio-mem"),
            (VIRTIO_ID_FS, "--fs"),
            (VIRTIO_ID_PMEM, "memory window"),
            (VIRTIO_ID_GPU, "VHOST_USER_GPU_SET_SOCKET"),
        ] {
            let error = refusal(VhostUserConfig::new("x", id, "/s"));
            assert!(
                error.contains(&format!("type {id} (")) && error.contains(needle),
                "{error}"
            );
        }
        for id in [
            VIRTIO_ID_NET,
            VIRTIO_ID_BLOCK,
            VIRTIO_ID_VSOCK,
            VIRTIO_ID_GPIO,
        ] {
            VhostUserConfig::new("x", id, "/s").validate().unwrap();
        }
    }

    #[test]
    fn queue_and_config_sizes_are_checked_and_default_by_type() {
        let block = VhostUserConfig::new("d", VIRTIO_ID_BLOCK, "/s");
        assert_eq!((block.queues(), block.config_bytes()), (1, 60));
        let vsock = VhostUserConfig::new("v", VIRTIO_ID_VSOCK, "/s");
        assert_eq!((vsock.queues(), vsock.config_bytes()), (3, 8));
        let mut bad = block.clone();
        bad.num_queues = Some(0);
        assert!(refusal(bad).contains("num_queues 0"));
        let mut bad = block.clone();
        bad.queue_size = 100;
        assert!(refusal(bad).contains("queue_size 100"));
        let mut bad = block;
        bad.config_size = Some(MAX_CONFIG_SIZE + 1);
        assert!(refusal(bad).contains("config_size 257"));
    }

    #[test]
    fn only_device_and_ring_features_reach_the_guest() {
        assert_eq!(FORWARDED_FEATURES & (1 << 30), 0, "PROTOCOL_FEATURES");
        assert_eq!(
            FORWARDED_FEATURES & (1 << 32),
            0,
            "VERSION_1 is the transport's"
        );
        assert_eq!(FORWARDED_FEATURES & (1 << 33), 0, "ACCESS_PLATFORM");
        assert_eq!(FORWARDED_FEATURES & (1 << 34), 0, "RING_PACKED");
        assert_ne!(FORWARDED_FEATURES & (1 << 9), 0, "VIRTIO_BLK_F_FLUSH");
        assert_ne!(FORWARDED_FEATURES & (1 << 63), 0, "a high device bit");
    }
}
