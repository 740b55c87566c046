//! [`VhostUserFs`]: virtio-fs served by virtiofsd.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use super::block::snapshot_refusal;
use super::lifecycle::{check_queue_size, read_config_bytes, thread_name, VhostUserCore};
use super::{Timeouts, VhostUserError};
use crate::device::{ActivateError, Activation, QueuePosition, VirtioDevice};

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
        if self.num_queues == 0 || self.num_queues > 64 {
            return refuse(format!(
                "num_queues {} is not from 1 to 64",
                self.num_queues
            ));
        }
        check_queue_size(&device, self.queue_size)
    }
}

/// virtio-fs: FUSE requests on its queues, answered by virtiofsd from the shared
/// directory, straight to and from guest memory. No DAX window.
pub struct VhostUserFs {
    config: FsConfig,
    core: VhostUserCore,
    features: u64,
    /// tag[36] and num_request_queues (le32): the device's own, virtiofsd has no
    /// configuration space.
    config_space: [u8; FS_TAG_BYTES + 4],
}

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
        let name = format!("{KIND} {}", config.tag);
        let core = VhostUserCore::connect(
            KIND,
            name.clone(),
            thread_name("vu-fs", &config.tag),
            &config.socket,
            1 + usize::from(config.num_queues),
            VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK,
            timeouts,
        )?;
        let features = core.backend_features() & FORWARDED_FEATURES;
        let mut config_space = [0u8; FS_TAG_BYTES + 4];
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

    pub fn config(&self) -> &FsConfig {
        &self.config
    }

    /// virtiofsd died, closed its socket or missed a reply: requests are no longer
    /// answered. There is no reconnection.
    pub fn is_broken(&self) -> bool {
        self.core.is_broken()
    }

    /// Why a snapshot of a VM with this device must be refused (always, for now:
    /// virtiofsd's open files and inodes live in it and DEVICE_STATE is not implemented).
    pub fn snapshot_refusal(&self) -> Option<String> {
        Some(snapshot_refusal(self.core.name(), &self.config.socket))
    }
}

impl VirtioDevice for VhostUserFs {
    fn name(&self) -> &str {
        self.core.name()
    }

    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![self.config.queue_size; 1 + usize::from(self.config.num_queues)]
    }

    fn device_features(&self) -> u64 {
        self.features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        log::debug!(
            "{}: ignored a {}-byte configuration write at {offset}",
            self.core.name(),
            data.len()
        );
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        self.core.activate(activation)
    }

    fn reset(&mut self) {
        self.core.reset();
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        self.core.pause()
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        self.core.resume()
    }

    /// What the device was (a snapshot is refused before it gets here, see
    /// [`VhostUserFs::snapshot_refusal`]).
    fn save_state(&self) -> serde_json::Value {
        serde_json::json!({
            "vhost_user_fs": {
                "tag": self.config.tag,
                "socket": self.config.socket,
            }
        })
    }

    /// Always refused: virtiofsd's state was never saved.
    fn restore_state(&mut self, _state: &serde_json::Value) -> Result<(), String> {
        Err(snapshot_refusal(self.core.name(), &self.config.socket))
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}
