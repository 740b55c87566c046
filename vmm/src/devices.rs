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

/// The saved state of every emulated device, one field each. Flattened into the state
/// file's top level (a device's state is a key there, e.g. `serial`), so a field added
/// here needs `#[serde(default)]` for state files written before it.
#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceStates {
    pub serial: SerialState,
}

/// A device refused its saved state (or could not give its own).
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error(transparent)]
    Serial(#[from] SerialError),
}

impl Persist for MachineDevices {
    type State = DeviceStates;
    type Error = DeviceStateError;

    fn save(&self) -> Result<DeviceStates, DeviceStateError> {
        Ok(DeviceStates {
            serial: lock(&self.serial).save()?,
        })
    }

    fn restore(&mut self, state: &DeviceStates) -> Result<(), DeviceStateError> {
        lock(&self.serial).restore(&state.serial)?;
        Ok(())
    }
}
