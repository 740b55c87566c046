//! What the VMM's API and config file say about a drive.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{BlockError, ID_BYTES};
use crate::rate_limiter::RateLimiterConfig;

/// How the device does its reads, writes and flushes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum IoEngine {
    /// pread/pwrite/fdatasync on the device's I/O thread, one request at a time.
    Sync,
    /// io_uring: many requests in flight, straight to and from guest memory. The default;
    /// a host where io_uring cannot be set up (old kernel, seccomp, container policy) falls
    /// back to [`IoEngine::Sync`] with a log line.
    #[default]
    Async,
}

/// One drive (Firecracker's `PUT /drives/{id}` body, less the fields gpuvm does not have).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockConfig {
    /// The drive's name in the API and in logs.
    pub drive_id: String,
    /// A regular file (a raw image) or a host block device (Firecracker: `path_on_host`).
    #[serde(alias = "path_on_host")]
    pub path: PathBuf,
    /// The guest sees a read-only disk (VIRTIO_BLK_F_RO) and the image is opened read-only
    /// with a shared lock, so several VMs may share it.
    #[serde(default, alias = "is_read_only")]
    pub read_only: bool,
    /// Opens the image with O_DIRECT (no host page cache).
    #[serde(default)]
    pub direct: bool,
    /// What GET_ID returns (`/sys/block/vdX/serial`), at most 20 bytes; without it the drive
    /// ID's first 20 bytes.
    #[serde(default)]
    pub serial: Option<String>,
    #[serde(default)]
    pub io_engine: IoEngine,
    #[serde(default)]
    pub rate_limiter: RateLimiterConfig,
    /// The guest's root filesystem: only informs the VMM's kernel command line
    /// (`root=/dev/vdX`); the device does not look at it.
    #[serde(default, alias = "is_root_device")]
    pub root: bool,
}

impl BlockConfig {
    /// Refuses a serial that does not fit GET_ID's 20 bytes.
    pub fn validate(&self) -> Result<(), BlockError> {
        if let Some(serial) = &self.serial {
            if serial.len() > ID_BYTES {
                return Err(BlockError::SerialTooLong {
                    drive_id: self.drive_id.clone(),
                    serial: serial.clone(),
                    len: serial.len(),
                });
            }
        }
        Ok(())
    }

    /// The 20 bytes GET_ID returns: the serial, or the drive ID cut to 20 bytes, padded with
    /// zeroes (a full 20-byte ID has no terminating zero, as the spec allows).
    pub fn device_id(&self) -> [u8; ID_BYTES] {
        let source = self.serial.as_deref().unwrap_or(&self.drive_id).as_bytes();
        let mut id = [0u8; ID_BYTES];
        let len = source.len().min(ID_BYTES);
        id[..len].copy_from_slice(&source[..len]);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_unknown_fields() {
        let config: BlockConfig =
            serde_json::from_str(r#"{"drive_id": "rootfs", "path": "/img"}"#).unwrap();
        assert!(!config.read_only);
        assert!(!config.direct);
        assert!(!config.root);
        assert_eq!(config.serial, None);
        assert_eq!(config.io_engine, IoEngine::Async);
        assert_eq!(config.rate_limiter, RateLimiterConfig::default());

        let engine: BlockConfig = serde_json::from_str(
            r#"{"drive_id": "d", "path": "/img", "io_engine": "Sync", "read_only": true}"#,
        )
        .unwrap();
        assert_eq!(engine.io_engine, IoEngine::Sync);
        assert!(engine.read_only);

        let unknown = serde_json::from_str::<BlockConfig>(
            r#"{"drive_id": "d", "path": "/img", "cache_type": "Writeback"}"#,
        );
        assert!(unknown.is_err());
    }

    #[test]
    fn serial_is_at_most_twenty_bytes() {
        let mut config: BlockConfig =
            serde_json::from_str(r#"{"drive_id": "a-very-long-drive-identifier", "path": "/x"}"#)
                .unwrap();
        assert_eq!(&config.device_id(), b"a-very-long-drive-id");
        config.serial = Some("12345678901234567890".into());
        config.validate().unwrap();
        assert_eq!(&config.device_id(), b"12345678901234567890");
        config.serial = Some("short".into());
        assert_eq!(&config.device_id()[..6], b"short\0");
        config.serial = Some("123456789012345678901".into());
        let error = config.validate().unwrap_err();
        assert!(
            matches!(error, BlockError::SerialTooLong { len: 21, .. }),
            "{error}"
        );
    }
}
