//! [`VhostUserBlock`]: virtio-blk served by a vhost-user-blk backend
//! (qemu-storage-daemon's `--export type=vhost-user-blk`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_GEOMETRY,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use super::lifecycle::{check_queues, thread_name, VhostUserCore, VhostUserDevice, VhostUserKind};
use super::{Timeouts, VhostUserError};

const KIND: &str = "vhost-user-blk";

/// The virtio-blk configuration space up to `write_zeroes_may_unmap` and its padding
/// (what every vhost-user-blk backend has; later fields read as zero).
const CONFIG_LEN: usize = 60;
/// `num_queues` (le16) in the configuration space.
const NUM_QUEUES_OFFSET: usize = 34;

/// The backend features gpuvm passes on to the guest. Left out: CONFIG_WCE (the cache
/// mode would need SET_CONFIG), packed rings and the transport bits the transport owns.
const FORWARDED_FEATURES: u64 = (1 << VIRTIO_BLK_F_SIZE_MAX)
    | (1 << VIRTIO_BLK_F_SEG_MAX)
    | (1 << VIRTIO_BLK_F_GEOMETRY)
    | (1 << VIRTIO_BLK_F_RO)
    | (1 << VIRTIO_BLK_F_BLK_SIZE)
    | (1 << VIRTIO_BLK_F_FLUSH)
    | (1 << VIRTIO_BLK_F_TOPOLOGY)
    | (1 << VIRTIO_BLK_F_DISCARD)
    | (1 << VIRTIO_BLK_F_WRITE_ZEROES)
    | (1 << VIRTIO_RING_F_INDIRECT_DESC)
    | (1 << VIRTIO_RING_F_EVENT_IDX);

fn default_num_queues() -> u16 {
    1
}

fn default_queue_size() -> u16 {
    128
}

/// A drive served by a vhost-user-blk backend (a drive with `socket` instead of
/// `path_on_host`). Read-only comes from the backend (VIRTIO_BLK_F_RO: qemu-storage-daemon
/// without `writable=on`), see [`VhostUserBlock::read_only`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostUserBlockConfig {
    /// The drive's name in the API and in logs.
    pub drive_id: String,
    /// The backend's listening Unix socket.
    pub socket: PathBuf,
    /// Request queues (the backend must serve as many; more than one needs its MQ).
    #[serde(default = "default_num_queues")]
    pub num_queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
}

impl VhostUserBlockConfig {
    /// A drive with the default queue count and size.
    pub fn new(drive_id: impl Into<String>, socket: impl Into<PathBuf>) -> Self {
        VhostUserBlockConfig {
            drive_id: drive_id.into(),
            socket: socket.into(),
            num_queues: default_num_queues(),
            queue_size: default_queue_size(),
        }
    }

    pub fn validate(&self) -> Result<(), VhostUserError> {
        let device = format!("{KIND} {}", self.drive_id);
        check_queues(&device, self.num_queues, self.queue_size)
    }
}

impl VhostUserKind for VhostUserBlockConfig {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn socket(&self) -> &Path {
        &self.socket
    }

    fn queue_count(&self) -> usize {
        usize::from(self.num_queues)
    }

    fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn names(&self) -> (&'static str, String, String) {
        (
            KIND,
            format!("{KIND} {}", self.drive_id),
            thread_name("vu-blk", &self.drive_id),
        )
    }
}

/// virtio-blk whose requests a vhost-user-blk backend serves straight from guest memory.
/// Its configuration space is GET_CONFIG's answer, with `num_queues` set to ours.
pub type VhostUserBlock = VhostUserDevice<VhostUserBlockConfig>;

impl VhostUserBlock {
    /// Connects to the backend with the default [`Timeouts`], negotiates, and reads the
    /// disk's configuration (capacity, block size).
    pub fn new(config: VhostUserBlockConfig) -> Result<VhostUserBlock, VhostUserError> {
        Self::with_timeouts(config, Timeouts::default())
    }

    pub fn with_timeouts(
        config: VhostUserBlockConfig,
        timeouts: Timeouts,
    ) -> Result<VhostUserBlock, VhostUserError> {
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
        if !core
            .protocol_features()
            .contains(VhostUserProtocolFeatures::CONFIG)
        {
            return Err(VhostUserError::Unsupported {
                socket: config.socket.clone(),
                missing: "does not offer the CONFIG protocol feature (the disk's capacity)"
                    .to_string(),
            });
        }
        let backend = core.backend_features();
        let mut features = backend & FORWARDED_FEATURES;
        if config.num_queues > 1 {
            if backend & (1 << VIRTIO_BLK_F_MQ) == 0 {
                return Err(VhostUserError::Unsupported {
                    socket: config.socket.clone(),
                    missing: format!(
                        "has no multiqueue (VIRTIO_BLK_F_MQ); {name} asks for {} queues",
                        config.num_queues
                    ),
                });
            }
            features |= 1 << VIRTIO_BLK_F_MQ;
        }
        let (_, mut config_space) = core.request("GET_CONFIG", |f| {
            f.get_config(
                0,
                CONFIG_LEN as u32,
                VhostUserConfigFlags::empty(),
                &[0u8; CONFIG_LEN],
            )
        })?;
        config_space.resize(CONFIG_LEN, 0);
        config_space[NUM_QUEUES_OFFSET..NUM_QUEUES_OFFSET + 2]
            .copy_from_slice(&config.num_queues.to_le_bytes());
        let device = VhostUserBlock {
            config,
            core,
            config_space,
            features,
        };
        log::info!(
            "{name}: backend at {} ({} sectors{}, features {:#x})",
            device.config.socket.display(),
            device.capacity_sectors(),
            if device.read_only() {
                ", read-only"
            } else {
                ""
            },
            device.features
        );
        Ok(device)
    }

    /// The capacity the backend reported, in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&self.config_space[..8]);
        u64::from_le_bytes(bytes)
    }

    /// The backend exports the disk read-only.
    pub fn read_only(&self) -> bool {
        self.features & (1 << VIRTIO_BLK_F_RO) != 0
    }
}
