//! VFIO migration v2: saving a device's internal state into a snapshot and loading it
//! into a fresh device.
//!
//! The state machine is linux/vfio.h's `enum vfio_device_mig_state`. Backends move only
//! along single arcs every v2 device must support (RUNNING -> STOP -> STOP_COPY -> STOP,
//! STOP -> RESUMING -> STOP, STOP -> RUNNING); [`save_device_state`] and
//! [`load_device_state`] walk them. The kernel backend drives
//! `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE` ([`KernelMigration`]); the vfio-user backend
//! drives a migration region (see `user.rs`).

use std::io::{Read, Write};

use crate::{PassthroughDevice, Result, VfioError};

/// VFIO migration v2 device states (values of linux/vfio.h enum vfio_device_mig_state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigrationState {
    Error,
    Stop,
    Running,
    StopCopy,
    Resuming,
}

impl MigrationState {
    /// The value linux/vfio.h gives the state.
    pub fn uapi_value(self) -> u32 {
        match self {
            MigrationState::Error => 0,
            MigrationState::Stop => 1,
            MigrationState::Running => 2,
            MigrationState::StopCopy => 3,
            MigrationState::Resuming => 4,
        }
    }

    /// The state of a linux/vfio.h value (None for states gpuvm never uses, such as
    /// PRE_COPY or RUNNING_P2P).
    pub fn from_uapi(value: u32) -> Option<Self> {
        Some(match value {
            0 => MigrationState::Error,
            1 => MigrationState::Stop,
            2 => MigrationState::Running,
            3 => MigrationState::StopCopy,
            4 => MigrationState::Resuming,
            _ => return None,
        })
    }

    /// Whether `self -> to` is one of the single arcs every v2 device supports and
    /// gpuvm walks (RUNNING <-> STOP, STOP <-> STOP_COPY, STOP <-> RESUMING). The one
    /// table of the state machine: the kernel and vfio-user backends refuse any other
    /// change before asking the device, and the emulated device refuses it too.
    pub fn is_single_arc(self, to: MigrationState) -> bool {
        use MigrationState::*;
        matches!(
            (self, to),
            (Running, Stop)
                | (Stop, Running)
                | (Stop, StopCopy)
                | (StopCopy, Stop)
                | (Stop, Resuming)
                | (Resuming, Stop)
        )
    }
}

/// What a device can do (from VFIO_DEVICE_FEATURE_MIGRATION's flags, or the vfio-user device's region).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationInfo {
    pub stop_copy: bool,
    pub p2p: bool,
    pub pre_copy: bool,
    /// "kernel VFIO migration v2" or "vfio-user migration region"
    pub transport: &'static str,
}

/// How much state one read asks the device for.
const CHUNK: usize = 64 * 1024;

fn arc(device: &mut dyn PassthroughDevice, to: MigrationState) -> Result<()> {
    log::debug!("{}: migration state -> {to:?}", device.name());
    device.set_migration_state(to)
}

/// Saves the device's state: moves it to STOP (if RUNNING), then STOP_COPY, streams every byte the device gives into
/// `out` (at most `limit` bytes, else an error), then back to STOP. The device is left STOPPED: the caller resumes it
/// with set_migration_state(Running). Returns the byte count.
pub fn save_device_state(
    device: &mut dyn PassthroughDevice,
    out: &mut dyn Write,
    limit: u64,
) -> Result<u64> {
    let name = device.name();
    let info = device.migration().ok_or_else(|| {
        VfioError::MigrationUnsupported(format!(
            "{name}: the device offers no migration (it cannot be snapshotted)"
        ))
    })?;
    if !info.stop_copy {
        return Err(VfioError::MigrationUnsupported(format!(
            "{name}: the device's migration ({}) has no STOP_COPY",
            info.transport
        )));
    }
    arc(device, MigrationState::Stop)?;
    arc(device, MigrationState::StopCopy)?;
    let copied = copy_out(device, out, limit);
    // Leave STOP_COPY whatever happened, so the data fd closes and the device can resume.
    let back = arc(device, MigrationState::Stop);
    let copied = copied?;
    back?;
    log::info!(
        "{name}: saved {copied} bytes of device state ({})",
        info.transport
    );
    Ok(copied)
}

fn copy_out(device: &mut dyn PassthroughDevice, out: &mut dyn Write, limit: u64) -> Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = device.read_migration_data(&mut buf)?;
        if n == 0 {
            return Ok(total);
        }
        let n = n.min(buf.len());
        total = total.saturating_add(n as u64);
        if total > limit {
            return Err(VfioError::MigrationData {
                device: device.name(),
                reason: format!("the device's state is larger than the {limit}-byte limit"),
            });
        }
        out.write_all(&buf[..n])?;
    }
}

/// Loads a saved state into a freshly opened (reset, RUNNING) device: STOP, RESUMING, writes `len` bytes read from
/// `input`, STOP. The device is left STOPPED (a bad state is an error from the device, and the device is reset).
pub fn load_device_state(
    device: &mut dyn PassthroughDevice,
    input: &mut dyn Read,
    len: u64,
) -> Result<()> {
    let name = device.name();
    let info = device.migration().ok_or_else(|| {
        VfioError::MigrationUnsupported(format!(
            "{name}: the device offers no migration (a saved state cannot be loaded)"
        ))
    })?;
    let applied = arc(device, MigrationState::Stop)
        .and_then(|()| arc(device, MigrationState::Resuming))
        .and_then(|()| match copy_in(device, input, len) {
            // RESUMING -> STOP is where the device checks and applies the state.
            Ok(()) => arc(device, MigrationState::Stop),
            Err(error) => {
                if let Err(leave) = arc(device, MigrationState::Stop) {
                    log::warn!("{name}: leaving RESUMING after a failed load: {leave}");
                }
                Err(error)
            }
        });
    if let Err(error) = applied {
        // A half-loaded device must not run with mixed state.
        if let Err(reset) = device.reset() {
            log::warn!("{name}: reset after a failed load: {reset}");
        }
        return Err(error);
    }
    log::info!(
        "{name}: loaded {len} bytes of device state ({})",
        info.transport
    );
    Ok(())
}

fn copy_in(device: &mut dyn PassthroughDevice, input: &mut dyn Read, len: u64) -> Result<()> {
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    while left > 0 {
        let want = (left.min(CHUNK as u64)) as usize;
        input.read_exact(&mut buf[..want])?;
        device.write_migration_data(&buf[..want])?;
        left -= want as u64;
    }
    Ok(())
}

// ----- Kernel VFIO migration v2 (VFIO_DEVICE_FEATURE) -----

/// linux/vfio.h VFIO_DEVICE_FEATURE_MIGRATION flags.
pub use vfio_bindings::bindings::vfio::{
    VFIO_MIGRATION_P2P, VFIO_MIGRATION_PRE_COPY, VFIO_MIGRATION_STOP_COPY,
};

/// The kernel's migration calls on one device, as vfio-ioctls' `VfioDevice` makes them
/// (`VFIO_DEVICE_FEATURE` on the device fd; the data fd the kernel returns for
/// STOP_COPY and RESUMING is kept by the device and dropped when it leaves them), so
/// tests can put a fake kernel behind [`KernelMigration`].
pub trait MigrationOps {
    /// `VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIGRATION`: the flags, or None when
    /// the kernel or the device has no migration v2 (ENOTTY, EINVAL).
    fn query_migration_support(&self) -> std::io::Result<Option<u64>>;
    /// `VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE` to a uapi state.
    fn set_migration_state(&self, state: u32) -> std::io::Result<()>;
    /// Reads the STOP_COPY data fd; 0 at the end of the state.
    fn read_migration_data(&self, buf: &mut [u8]) -> std::io::Result<usize>;
    /// Writes all of `data` to the RESUMING data fd.
    fn write_migration_data(&self, data: &[u8]) -> std::io::Result<()>;
}

fn ioctl_error(error: vfio_ioctls::VfioError) -> std::io::Error {
    std::io::Error::other(error.to_string())
}

impl MigrationOps for vfio_ioctls::VfioDevice {
    fn query_migration_support(&self) -> std::io::Result<Option<u64>> {
        vfio_ioctls::VfioDevice::query_migration_support(self).map_err(ioctl_error)
    }
    fn set_migration_state(&self, state: u32) -> std::io::Result<()> {
        vfio_ioctls::VfioDevice::set_migration_state(self, state).map_err(ioctl_error)
    }
    fn read_migration_data(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        vfio_ioctls::VfioDevice::read_migration_data(self, buf).map_err(ioctl_error)
    }
    fn write_migration_data(&self, data: &[u8]) -> std::io::Result<()> {
        vfio_ioctls::VfioDevice::write_migration_data(self, data).map_err(ioctl_error)
    }
}

/// Migration v2 bookkeeping for a kernel VFIO device: what it can do, the state it is in,
/// and the single arcs the kernel takes (RUNNING->STOP->STOP_COPY->STOP,
/// STOP->RESUMING->STOP, STOP->RUNNING).
pub struct KernelMigration {
    name: String,
    state: MigrationState,
    info: Option<MigrationInfo>,
}

impl KernelMigration {
    /// Probes the device; a device without the feature has no migration.
    pub fn probe(ops: &dyn MigrationOps, name: String) -> Self {
        let info = match ops.query_migration_support() {
            Ok(Some(flags)) => {
                let info = MigrationInfo {
                    stop_copy: flags & u64::from(VFIO_MIGRATION_STOP_COPY) != 0,
                    p2p: flags & u64::from(VFIO_MIGRATION_P2P) != 0,
                    pre_copy: flags & u64::from(VFIO_MIGRATION_PRE_COPY) != 0,
                    transport: "kernel VFIO migration v2",
                };
                log::info!("{name}: VFIO migration: {info:?}");
                Some(info)
            }
            Ok(None) => {
                log::info!("{name}: no VFIO migration v2 (the driver does not offer it)");
                None
            }
            Err(error) => {
                log::warn!("{name}: probing VFIO migration failed: {error}");
                None
            }
        };
        KernelMigration {
            name,
            // A freshly opened device runs.
            state: MigrationState::Running,
            info,
        }
    }

    pub fn info(&self) -> Option<MigrationInfo> {
        self.info.clone()
    }

    pub fn state(&self) -> MigrationState {
        self.state
    }

    /// The device was reset (VFIO_DEVICE_RESET): it runs again.
    pub fn reset(&mut self) {
        self.state = MigrationState::Running;
    }

    /// Moves along one arc the kernel allows (the caller walks longer paths).
    pub fn set_state(&mut self, ops: &dyn MigrationOps, to: MigrationState) -> Result<()> {
        if self.info.is_none() {
            return Err(VfioError::MigrationUnsupported(format!(
                "{}: the kernel driver has no VFIO_DEVICE_FEATURE_MIGRATION",
                self.name
            )));
        }
        let from = self.state;
        if from == to {
            return Ok(());
        }
        let arc_error = |reason: String| VfioError::MigrationArc {
            device: self.name.clone(),
            from,
            to,
            reason,
        };
        if !from.is_single_arc(to) {
            return Err(arc_error("not a single arc of the v2 state machine".into()));
        }
        if let Err(error) = ops.set_migration_state(to.uapi_value()) {
            // The kernel leaves the device in the old state or in ERROR; it says which.
            self.state = MigrationState::Error;
            return Err(arc_error(format!("VFIO_DEVICE_FEATURE: {error}")));
        }
        self.state = to;
        Ok(())
    }

    fn expect_state(&self, want: MigrationState) -> Result<()> {
        if self.state != want {
            return Err(VfioError::MigrationData {
                device: self.name.clone(),
                reason: format!("the device is in {:?}, not {want:?}", self.state),
            });
        }
        Ok(())
    }

    /// Reads the next piece of state (STOP_COPY); 0 at the end.
    pub fn read(&self, ops: &dyn MigrationOps, buf: &mut [u8]) -> Result<usize> {
        self.expect_state(MigrationState::StopCopy)?;
        loop {
            match ops.read_migration_data(buf) {
                Ok(n) => return Ok(n.min(buf.len())),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    return Err(VfioError::MigrationData {
                        device: self.name.clone(),
                        reason: format!("reading the STOP_COPY data fd: {error}"),
                    })
                }
            }
        }
    }

    /// Writes the next piece of a saved state (RESUMING).
    pub fn write(&self, ops: &dyn MigrationOps, data: &[u8]) -> Result<()> {
        self.expect_state(MigrationState::Resuming)?;
        ops.write_migration_data(data)
            .map_err(|error| VfioError::MigrationData {
                device: self.name.clone(),
                reason: format!("writing the RESUMING data fd: {error}"),
            })
    }
}
