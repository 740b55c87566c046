//! [`VhostUserFs`]: virtio-fs served by virtiofsd.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use super::lifecycle::{check_queues, thread_name, VhostUserCore, VhostUserDevice, VhostUserKind};
use super::{Timeouts, VhostUserError};

const KIND: &str = "vhost-user-fs";
/// VIRTIO_ID_FS.
const DEVICE_TYPE: u32 = 26;
/// The tag field of the configuration space: a tag of this many bytes has no NUL.
pub const FS_TAG_BYTES: usize = 36;
/// Ring features gpuvm passes on. VIRTIO_FS_F_NOTIFICATION (its notification queue) is
/// left out, as is everything gpuvm's transport does not do.
const FORWARDED_FEATURES: u64 = (1 << VIRTIO_RING_F_INDIRECT_DESC) | (1 << VIRTIO_RING_F_EVENT_IDX);

fn default_num_queues() -> u16 {
    1
}

fn default_queue_size() -> u16 {
    1024
}

/// A shared directory (Cloud Hypervisor's `fs` object): the guest mounts it with
/// `mount -t virtiofs <tag> <dir>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    /// What the guest mounts: 1 to 36 bytes, no NUL.
    pub tag: String,
    /// virtiofsd's `--socket-path`.
    pub socket: PathBuf,
    /// Request queues; the device also has one high-priority queue.
    #[serde(default = "default_num_queues")]
    pub num_queues: u16,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
}

impl FsConfig {
    pub fn new(tag: impl Into<String>, socket: impl Into<PathBuf>) -> Self {
        FsConfig {
            tag: tag.into(),
            socket: socket.into(),
            num_queues: default_num_queues(),
            queue_size: default_queue_size(),
        }
    }

    pub fn validate(&self) -> Result<(), VhostUserError> {
        let device = format!("{KIND} {}", self.tag);
        let refuse = |reason: String| {
            Err(VhostUserError::Config {
                device: device.clone(),
                reason,
            })
        };
        if self.tag.is_empty() {
            return refuse("the tag is empty".to_string());
        }
        if self.tag.len() > FS_TAG_BYTES {
            return refuse(format!(
                "the tag is {} bytes, at most {FS_TAG_BYTES} fit the device",
                self.tag.len()
            ));
        }
        if self.tag.contains('\0') {
            return refuse("the tag contains a NUL byte".to_string());
        }
        check_queues(&device, self.num_queues, self.queue_size)
    }
}

impl VhostUserKind for FsConfig {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn socket(&self) -> &Path {
        &self.socket
    }

    /// The high-priority queue and the request queues.
    fn queue_count(&self) -> usize {
        1 + usize::from(self.num_queues)
    }

    fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn names(&self) -> (&'static str, String, String) {
        (
            KIND,
            format!("{KIND} {}", self.tag),
            thread_name("vu-fs", &self.tag),
        )
    }
}

/// virtio-fs: FUSE requests on its queues, answered by virtiofsd from the shared
/// directory, straight to and from guest memory. No DAX window. Its configuration space,
/// tag[36] and num_request_queues (le32), is the device's own: virtiofsd has none.
pub type VhostUserFs = VhostUserDevice<FsConfig>;

impl VhostUserFs {
    /// Connects to virtiofsd with the default [`Timeouts`] and negotiates.
    pub fn new(config: FsConfig) -> Result<VhostUserFs, VhostUserError> {
        Self::with_timeouts(config, Timeouts::default())
    }

    pub fn with_timeouts(
        config: FsConfig,
        timeouts: Timeouts,
    ) -> Result<VhostUserFs, VhostUserError> {
        config.validate()?;
        let (kind, name, thread) = config.names();
        let core = VhostUserCore::connect(
            kind,
            name.clone(),
            thread,
            &config.socket,
            config.queue_count(),
            VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK,
            timeouts,
        )?;
        let features = core.backend_features() & FORWARDED_FEATURES;
        let mut config_space = vec![0u8; FS_TAG_BYTES + 4];
        config_space[..config.tag.len()].copy_from_slice(config.tag.as_bytes());
        config_space[FS_TAG_BYTES..].copy_from_slice(&u32::from(config.num_queues).to_le_bytes());
        log::info!(
            "{name}: backend at {} ({} request queues of {}, features {features:#x})",
            config.socket.display(),
            config.num_queues,
            config.queue_size
        );
        Ok(VhostUserFs {
            config,
            core,
            features,
            config_space,
        })
    }
}
