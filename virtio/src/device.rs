//! The contract between the virtio-pci transport and a device.

use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use crate::GuestMemory;

/// Why a device could not start serving its queues.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("{device}: the driver set up {given} queues, the device needs {needed}")]
    QueueCount {
        device: &'static str,
        given: usize,
        needed: usize,
    },
    #[error("{device}: cannot start its I/O thread: {source}")]
    Thread {
        device: &'static str,
        source: std::io::Error,
    },
    #[error("{device}: {message}")]
    Device {
        device: &'static str,
        message: String,
    },
}

impl ActivateError {
    /// `device`'s I/O thread could not start (see [`crate::worker::Worker::spawn`]).
    pub fn thread(device: &'static str, error: crate::worker::WorkerError) -> Self {
        ActivateError::Thread {
            device,
            source: error.into(),
        }
    }
}

/// How a device raises interrupts: the transport maps a queue or the configuration
/// change to its MSI-X vector (an irqfd), and sets the ISR bits.
pub trait VirtioInterrupt: Send + Sync {
    /// The device put buffers in queue `queue_index`'s used ring.
    fn signal_queue(&self, queue_index: u16) -> std::io::Result<()>;
    /// The device's configuration space changed.
    fn signal_config(&self) -> std::io::Result<()>;
}

/// One queue the driver enabled.
pub struct ActiveQueue {
    /// The queue as the driver configured it (sizes and ring addresses already checked
    /// against guest memory by the transport).
    pub queue: virtio_queue::Queue,
    /// Signalled when the driver notifies the queue (a KVM ioeventfd on the notify
    /// address, or the transport's own write on the MMIO exit path).
    pub kick: EventFd,
}

/// What the transport hands a device when the driver sets DRIVER_OK.
pub struct Activation {
    pub memory: GuestMemory,
    /// The features the driver accepted (a subset of [`VirtioDevice::device_features`]
    /// plus the transport's own bits such as VIRTIO_F_VERSION_1).
    pub acked_features: u64,
    /// In queue order; only queues the driver enabled carry `Some`.
    pub queues: Vec<Option<ActiveQueue>>,
    pub interrupt: Arc<dyn VirtioInterrupt>,
}

/// A virtio device behind a transport.
///
/// Methods are called with the transport's lock held, from a vCPU thread (register
/// accesses) or the VMM thread (snapshots): they must not block on guest I/O. The I/O
/// itself runs on the device's own thread (see [`crate::worker`]).
pub trait VirtioDevice: Send {
    /// A short name for logs and errors ("virtio-blk rootfs").
    fn name(&self) -> &str;
    /// The virtio device ID (virtio_bindings::virtio_ids::VIRTIO_ID_*).
    fn device_type(&self) -> u32;
    /// The largest size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> Vec<u16>;
    /// The device-specific feature bits it offers (the transport adds VERSION_1).
    fn device_features(&self) -> u64;
    /// Reads the device-specific configuration space; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device-specific configuration space; read-only fields ignore writes.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// The driver set DRIVER_OK: start serving the queues.
    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError>;
    /// The driver reset the device (or the VM is going away): stop serving and drop
    /// the queues. The device can be activated again afterwards.
    fn reset(&mut self);
    /// Stops serving after the request in flight (the VM is pausing for a snapshot) and
    /// reports where each active queue stands; nothing touches guest memory until
    /// [`VirtioDevice::resume`]. A device that is not active returns an empty list.
    fn pause(&mut self) -> Vec<Option<QueuePosition>>;
    /// Serves the queues again from where [`VirtioDevice::pause`] left them.
    fn resume(&mut self) -> Result<(), ActivateError>;
    /// The device's own snapshot state (what the guest can change in its configuration
    /// space, backend bookkeeping, rate-limiter buckets): its [`gpuvm_devices::Persist`]
    /// state, as the variant of [`DeviceState`] for its kind. Queue addresses, positions
    /// and acked features are the transport's. Called while paused.
    fn save_state(&self) -> Result<DeviceState, DeviceStateError>;
    /// Loads [`VirtioDevice::save_state`]'s output into this freshly built device, before
    /// the transport re-activates it; a state of another kind, or one that does not fit
    /// this device, is refused and the device is left as it was.
    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError>;
    /// The device itself, for the VMM's operations on one kind of device (a drive's new
    /// image); `None` for devices that have none.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// A virtio device's own state in a snapshot, one variant per kind of device; each
/// holds that device's [`gpuvm_devices::Persist::State`], defined beside the device.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    Block(crate::block::BlockState),
    Net(crate::net::NetState),
    Vsock(crate::vsock::VsockState),
    Rng(crate::rng::RngState),
    Balloon(crate::balloon::BalloonState),
    VhostUser(crate::vhost_user::VhostUserState),
}

impl DeviceState {
    /// The variant's name, as the state file spells it.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceState::Block(_) => "block",
            DeviceState::Net(_) => "net",
            DeviceState::Vsock(_) => "vsock",
            DeviceState::Rng(_) => "rng",
            DeviceState::Balloon(_) => "balloon",
            DeviceState::VhostUser(_) => "vhost_user",
        }
    }
}

/// Why a device's state could not be saved or was refused on restore.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error("{device}: the snapshot holds a {found} state, this is a {expected} device")]
    WrongKind {
        device: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error(transparent)]
    Block(#[from] crate::block::BlockStateError),
    #[error(transparent)]
    Net(#[from] crate::net::NetStateError),
    #[error(transparent)]
    Vsock(#[from] crate::vsock::VsockStateError),
    #[error(transparent)]
    Rng(#[from] crate::rng::RngStateError),
    #[error(transparent)]
    Balloon(#[from] crate::balloon::BalloonStateError),
    #[error(transparent)]
    VhostUser(#[from] crate::vhost_user::VhostUserStateError),
}

impl DeviceStateError {
    /// `device` (a `expected` device) was handed `found`'s state.
    pub fn wrong_kind(device: &str, expected: &'static str, found: &DeviceState) -> Self {
        DeviceStateError::WrongKind {
            device: device.to_string(),
            expected,
            found: found.kind(),
        }
    }
}

/// Copies the configuration space `space` from `offset` into `data`, the way
/// [`VirtioDevice::read_config`] reads: bytes past its end (or an offset past it) read as zero.
pub fn read_config_bytes(space: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Some(source) = usize::try_from(offset)
        .ok()
        .and_then(|offset| space.get(offset..))
    else {
        return;
    };
    let len = source.len().min(data.len());
    data[..len].copy_from_slice(&source[..len]);
}

/// Where a queue's ring indices stand when its device pauses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueuePosition {
    pub next_avail: u16,
    pub next_used: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_config_bytes_zero_fills_past_the_end() {
        let space = [1, 2, 3, 4];
        let mut data = [0xff; 3];
        read_config_bytes(&space, 1, &mut data);
        assert_eq!(data, [2, 3, 4]);
        read_config_bytes(&space, 2, &mut data);
        assert_eq!(data, [3, 4, 0]);
        for offset in [4, 5, u64::MAX] {
            let mut data = [0xff; 2];
            read_config_bytes(&space, offset, &mut data);
            assert_eq!(data, [0, 0], "offset {offset}");
        }
        let mut data = [0xff; 2];
        read_config_bytes(&[], 0, &mut data);
        assert_eq!(data, [0, 0]);
    }
}
