//! The one trait every component with snapshot state implements: vCPUs, the VM's
//! in-kernel devices, each emulated device.

/// A component whose state a snapshot saves and a restore loads back.
///
/// `State` is the component's own saved form, defined in the component's file beside it;
/// it is serialized into the snapshot's state file, whose format version covers every
/// `State` (a field added later needs `#[serde(default)]` or a version bump).
///
/// A restore builds each component with the same code as a boot (buses, interrupts, file
/// descriptors), then hands it its state: so `restore` loads state into a freshly built
/// component that has not run yet, instead of constructing one.
pub trait Persist {
    type State;
    type Error;

    /// Captures the component's state; the machine is paused.
    fn save(&self) -> Result<Self::State, Self::Error>;

    /// Loads `state` into this freshly built component. On error the component is left
    /// as it was.
    fn restore(&mut self, state: &Self::State) -> Result<(), Self::Error>;
}
