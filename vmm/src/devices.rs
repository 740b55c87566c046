//! The machine's emulated devices as one snapshot component: the one list of the devices
//! whose state a snapshot holds.
//!
//! Adding a device to snapshots: implement [`Persist`] in the device's own file (its
//! `State` type beside it), then add one field to [`DeviceStates`] and one line to each
//! of `save` and `restore` below. Nothing else changes.

use gpuvm_devices::{Persist, SerialError, SerialState};
use serde::{Deserialize, Serialize};

use crate::lock;
use crate::machine::MachineDevices;
use crate::virtio::VirtioDeviceState;

/// The saved state of every emulated device, one field each. Flattened into the state
/// file's top level (a device's state is a key there, e.g. `serial`), so a field added
/// here needs `#[serde(default)]` for state files written before it.
#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceStates {
    pub serial: SerialState,
    /// The virtio devices, in bus order, each with its configuration (a restore rebuilds
    /// them from it). Absent in state files written before virtio devices existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub virtio: Vec<VirtioDeviceState>,
}

/// A device refused its saved state (or could not give its own).
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error(transparent)]
    Serial(#[from] SerialError),
    #[error(transparent)]
    Virtio(#[from] gpuvm_virtio::transport::SnapshotError),
    #[error("the snapshot has {saved} virtio devices, the restored VM was built with {built}")]
    VirtioCount { saved: usize, built: usize },
}

impl Persist for MachineDevices {
    type State = DeviceStates;
    type Error = DeviceStateError;

    fn save(&self) -> Result<DeviceStates, DeviceStateError> {
        Ok(DeviceStates {
            serial: lock(&self.serial).save()?,
            virtio: crate::virtio::save_all(&self.virtio)?,
        })
    }

    fn restore(&mut self, state: &DeviceStates) -> Result<(), DeviceStateError> {
        lock(&self.serial).restore(&state.serial)?;
        if state.virtio.len() != self.virtio.len() {
            return Err(DeviceStateError::VirtioCount {
                saved: state.virtio.len(),
                built: self.virtio.len(),
            });
        }
        crate::virtio::restore_all(&self.virtio, &state.virtio)?;
        Ok(())
    }
}
