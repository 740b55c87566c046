//! Resetting a passthrough device before it is attached and after it is detached, and
//! checking that it came back.
//!
//! Kernel VFIO, in order of preference:
//! 1. VFIO_DEVICE_RESET when the device info has VFIO_DEVICE_FLAGS_RESET: the kernel
//!    resets the function with the first method that works (sysfs `reset_method`: FLR,
//!    the PCI AF FLR, a D3hot power-management reset, or a secondary bus reset when the
//!    function is alone on its bus).
//! 2. Else VFIO_DEVICE_PCI_HOT_RESET of the device's dependent set (every function a bus
//!    or slot reset would also reset, from VFIO_DEVICE_GET_PCI_HOT_RESET_INFO). The kernel
//!    resets only a set this process owns entirely: with the group API it must be handed
//!    an fd of every group in the set; with the iommufd cdev API it takes a zero-length
//!    array and checks that every device in the set is bound to the same iommufd.
//! 3. Else no reset is possible: said at warning level, and the device is still checked.
//!
//! vfio-user: VFIO_USER_DEVICE_RESET when the device advertises VFIO_DEVICE_FLAGS_RESET.
//!
//! After the reset the vendor/device id dword of configuration space is read: all ones
//! means the device did not come back (it fell off the bus, or its process is gone), and
//! it is refused with an error naming the device and the method tried.

use std::fmt;
use std::io::{Read, Write};
use std::os::fd::{BorrowedFd, RawFd};
use std::path::Path;

/// What a config space read of a device that is not there answers.
pub const ABSENT_IDS: u32 = 0xffff_ffff;

/// How a device is (or would be) reset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResetMethod {
    /// VFIO_DEVICE_RESET; the kernel's method for the function when sysfs names it.
    Function { kernel_method: Option<String> },
    /// VFIO_DEVICE_PCI_HOT_RESET of the dependent set (`devices` in it, when known).
    HotReset { devices: Option<usize> },
    /// VFIO_USER_DEVICE_RESET to the device process.
    VfioUser,
    /// No reset is possible, and why.
    None { reason: String },
}

impl fmt::Display for ResetMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResetMethod::Function { kernel_method } => match kernel_method.as_deref() {
                Some("flr") => write!(f, "FLR"),
                Some("af_flr") => write!(f, "FLR (PCI Advanced Features)"),
                Some("pm") => write!(f, "PM reset (D3hot)"),
                Some("bus") => write!(f, "secondary bus reset"),
                Some(other) => write!(f, "function reset ({other})"),
                None => write!(f, "function reset (VFIO_DEVICE_RESET)"),
            },
            ResetMethod::HotReset {
                devices: Some(devices),
            } => write!(
                f,
                "VFIO hot reset of its dependent set ({devices} device(s))"
            ),
            ResetMethod::HotReset { devices: None } => {
                write!(f, "VFIO hot reset of its dependent set")
            }
            ResetMethod::VfioUser => write!(f, "VFIO_USER_DEVICE_RESET"),
            ResetMethod::None { reason } => write!(f, "no reset ({reason})"),
        }
    }
}

/// A device that cannot be used after its reset.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    #[error("{device}: reset by {method} failed: {reason}; the device is not attached")]
    Failed {
        device: String,
        method: String,
        reason: String,
    },
    #[error(
        "{device}: did not come back after {method}: its vendor/device id reads {ids:#010x} \
         (the device is off the bus or dead); the device is not attached"
    )]
    NotBack {
        device: String,
        method: String,
        ids: u32,
    },
}

/// One entry of VFIO_DEVICE_GET_PCI_HOT_RESET_INFO's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dependent {
    /// The group id (group API) or the iommufd device id (cdev API).
    pub group_or_devid: u32,
    pub segment: u16,
    pub bus: u8,
    pub devfn: u8,
}

/// VFIO_DEVICE_GET_PCI_HOT_RESET_INFO's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HotResetInfo {
    pub flags: u32,
    pub devices: Vec<Dependent>,
}

/// linux/vfio.h: the entries carry iommufd device ids (cdev API).
pub const HOT_RESET_FLAG_DEV_ID: u32 = 1;
/// linux/vfio.h: every device of the set is owned through this device's iommufd.
pub const HOT_RESET_FLAG_DEV_ID_OWNED: u32 = 2;
/// linux/vfio.h VFIO_DEVICE_FLAGS_RESET.
pub const DEVICE_FLAGS_RESET: u32 = 1;

/// The reset requests on one kernel VFIO device (kernel.rs issues them as ioctls; the
/// tests fake them).
pub trait KernelResetOps {
    /// VFIO_DEVICE_GET_INFO's flags.
    fn device_flags(&self) -> std::io::Result<u32>;
    /// VFIO_DEVICE_RESET.
    fn function_reset(&self) -> std::io::Result<()>;
    /// VFIO_DEVICE_GET_PCI_HOT_RESET_INFO.
    fn hot_reset_info(&self) -> std::io::Result<HotResetInfo>;
    /// VFIO_DEVICE_PCI_HOT_RESET with these group fds (empty with the cdev API).
    fn hot_reset(&self, group_fds: &[RawFd]) -> std::io::Result<()>;
    /// The vendor/device id dword of configuration space.
    fn read_ids(&self) -> std::io::Result<u32>;
    /// The first method of the device's sysfs `reset_method`, if the kernel has the file.
    fn kernel_reset_method(&self) -> Option<String>;
    /// This process's open fd of VFIO group `group`, if it holds one.
    fn group_fd(&self, group: u32) -> Option<RawFd>;
    /// Whether the device was opened through the iommufd cdev API.
    fn cdev(&self) -> bool;
}

/// How [`reset_kernel_device`] would reset the device, and the group fds a hot reset
/// needs.
pub fn plan_kernel_reset(ops: &dyn KernelResetOps) -> (ResetMethod, Vec<RawFd>) {
    match ops.device_flags() {
        Ok(flags) if flags & DEVICE_FLAGS_RESET != 0 => {
            return (
                ResetMethod::Function {
                    kernel_method: ops.kernel_reset_method(),
                },
                Vec::new(),
            )
        }
        Ok(_) => {}
        Err(error) => {
            log::warn!("VFIO_DEVICE_GET_INFO: {error}; trying a hot reset");
        }
    }
    let info = match ops.hot_reset_info() {
        Ok(info) => info,
        Err(error) => {
            return (
                ResetMethod::None {
                    reason: format!("no function reset, and no bus or slot reset either: {error}"),
                },
                Vec::new(),
            )
        }
    };
    let devices = Some(info.devices.len());
    if ops.cdev() || info.flags & HOT_RESET_FLAG_DEV_ID != 0 {
        if info.flags & HOT_RESET_FLAG_DEV_ID_OWNED == 0 {
            return (
                ResetMethod::None {
                    reason: format!(
                        "no function reset, and its hot reset also resets {} device(s) not all bound to this VM's iommufd",
                        info.devices.len()
                    ),
                },
                Vec::new(),
            );
        }
        return (ResetMethod::HotReset { devices }, Vec::new());
    }
    let mut groups: Vec<u32> = info.devices.iter().map(|d| d.group_or_devid).collect();
    groups.sort_unstable();
    groups.dedup();
    let mut fds = Vec::with_capacity(groups.len());
    for group in groups {
        match ops.group_fd(group) {
            Some(fd) => fds.push(fd),
            None => {
                return (
                    ResetMethod::None {
                        reason: format!(
                            "no function reset, and its hot reset also resets IOMMU group {group}, which this VM does not hold"
                        ),
                    },
                    Vec::new(),
                )
            }
        }
    }
    (ResetMethod::HotReset { devices }, fds)
}

/// Resets a kernel VFIO device by the best method it has, then checks it came back.
pub fn reset_kernel_device(
    device: &str,
    ops: &dyn KernelResetOps,
) -> Result<ResetMethod, ResetError> {
    let (method, group_fds) = plan_kernel_reset(ops);
    let result = match &method {
        ResetMethod::Function { .. } => ops.function_reset(),
        ResetMethod::HotReset { .. } => ops.hot_reset(&group_fds),
        ResetMethod::None { .. } | ResetMethod::VfioUser => Ok(()),
    };
    if let Err(error) = result {
        return Err(ResetError::Failed {
            device: device.to_string(),
            method: method.to_string(),
            reason: error.to_string(),
        });
    }
    check_came_back(device, &method, ops.read_ids())?;
    log_reset(device, &method);
    Ok(method)
}

/// Refuses a device whose vendor/device id dword reads all ones (or cannot be read)
/// after `method`.
pub fn check_came_back(
    device: &str,
    method: &ResetMethod,
    ids: std::io::Result<u32>,
) -> Result<(), ResetError> {
    let what = match method {
        ResetMethod::None { .. } => "attach (no reset was possible)".to_string(),
        method => format!("reset by {method}"),
    };
    match ids {
        Ok(ABSENT_IDS) => Err(ResetError::NotBack {
            device: device.to_string(),
            method: what,
            ids: ABSENT_IDS,
        }),
        Ok(_) => Ok(()),
        Err(error) => Err(ResetError::Failed {
            device: device.to_string(),
            method: method.to_string(),
            reason: format!("its configuration space cannot be read afterwards: {error}"),
        }),
    }
}

/// The one log line for a reset that worked.
pub fn log_reset(device: &str, method: &ResetMethod) {
    match method {
        ResetMethod::None { reason } => {
            log::warn!("{device}: cannot be reset: {reason}; it is used as the last user left it")
        }
        method => log::info!("{device} reset by {method}"),
    }
}

/// The method the kernel would use for the PCI function at `bdf`, from sysfs alone (no
/// VFIO open): what `gpuvm check-host` shows.
pub fn host_reset_method(bdf: &str) -> ResetMethod {
    match crate::host::normalize_bdf(bdf) {
        Some(bdf) => reset_method_in(&Path::new("/sys/bus/pci/devices").join(bdf)),
        None => ResetMethod::None {
            reason: format!("'{bdf}' is not a PCI address"),
        },
    }
}

/// [`host_reset_method`] for a device's sysfs directory. vfio-pci offers
/// VFIO_DEVICE_RESET exactly when the kernel has a reset method for the function: the
/// `reset_method` file lists them (Linux 5.15+); older kernels only have a `reset` file
/// when one exists. With none, gpuvm tries the hot reset of the dependent set.
pub fn reset_method_in(sysfs_dir: &Path) -> ResetMethod {
    if !sysfs_dir.exists() {
        return ResetMethod::None {
            reason: format!("no PCI device at {}", sysfs_dir.display()),
        };
    }
    match crate::sysfs::read_text(&sysfs_dir.join("reset_method")) {
        Ok(methods) => match methods.split_whitespace().next() {
            Some(first) => ResetMethod::Function {
                kernel_method: Some(first.to_string()),
            },
            None => ResetMethod::HotReset { devices: None },
        },
        Err(_) if sysfs_dir.join("reset").exists() => ResetMethod::Function {
            kernel_method: None,
        },
        Err(_) => ResetMethod::HotReset { devices: None },
    }
}

/// vfio-user message header (the protocol's, as vfio_user lays it out).
const USER_HEADER_LEN: usize = 16;
const USER_COMMAND_DEVICE_RESET: u16 = 13;
const USER_FLAG_REPLY: u32 = 1;
const USER_FLAG_ERROR: u32 = 1 << 5;
/// The message id of gpuvm's own reset requests; the server echoes it and the
/// vfio_user client never compares ids.
const USER_RESET_MESSAGE_ID: u16 = 0xfffe;

/// Why VFIO_USER_DEVICE_RESET did not work.
#[derive(Debug, thiserror::Error)]
pub enum UserResetFailure {
    /// The device answered with its error flag; the connection is still in step.
    #[error("the device refused it: {0}")]
    Refused(std::io::Error),
    /// The exchange itself failed (the connection cannot be trusted afterwards).
    #[error("{0}")]
    Connection(std::io::Error),
}

/// VFIO_USER_DEVICE_RESET over `socket` (the client's connection; the caller holds the
/// client so nothing else is in flight), with the reply's error flag checked: the
/// vfio_user 0.1.7 client's own reset reads the reply and drops that flag, so a refused
/// reset would look like a good one.
pub fn vfio_user_device_reset(socket: BorrowedFd<'_>) -> Result<(), UserResetFailure> {
    let mut request = [0u8; USER_HEADER_LEN];
    request[0..2].copy_from_slice(&USER_RESET_MESSAGE_ID.to_le_bytes());
    request[2..4].copy_from_slice(&USER_COMMAND_DEVICE_RESET.to_le_bytes());
    request[4..8].copy_from_slice(&(USER_HEADER_LEN as u32).to_le_bytes());
    let mut reply = [0u8; USER_HEADER_LEN];
    socket_file(socket)
        .and_then(|mut stream| {
            stream.write_all(&request)?;
            stream.read_exact(&mut reply)
        })
        .map_err(UserResetFailure::Connection)?;
    let dword =
        |at: usize| u32::from_le_bytes([reply[at], reply[at + 1], reply[at + 2], reply[at + 3]]);
    let (size, flags, errno) = (dword(4), dword(8), dword(12));
    if flags & USER_FLAG_REPLY == 0 {
        return Err(UserResetFailure::Connection(std::io::Error::other(
            format!("the device answered with flags {flags:#x}, not a reply"),
        )));
    }
    // A reply longer than its header would leave bytes for the next request to misread.
    if size as usize != USER_HEADER_LEN {
        return Err(UserResetFailure::Connection(std::io::Error::other(
            format!("the device's reply is {size} bytes, not a bare header"),
        )));
    }
    if flags & USER_FLAG_ERROR != 0 {
        return Err(UserResetFailure::Refused(if errno != 0 {
            std::io::Error::from_raw_os_error(errno as i32)
        } else {
            std::io::Error::other("no error code given")
        }));
    }
    Ok(())
}

/// A `File` over a duplicate of `socket` (reads and writes share its timeouts).
fn socket_file(socket: BorrowedFd<'_>) -> std::io::Result<std::fs::File> {
    Ok(std::fs::File::from(socket.try_clone_to_owned()?))
}

/// One `gpuvm check-host` line per device (`gpus`, else every vfio-pci-bound GPU under
/// `sys`): the reset it would get when attached and after it is detached.
pub fn reset_checks(sys: &Path, gpus: &[String]) -> Vec<crate::host::Check> {
    use crate::host::{Check, CheckStatus};
    let gpus: Vec<String> = if gpus.is_empty() {
        crate::host::vfio_gpus(sys)
    } else {
        gpus.iter()
            .map(|gpu| crate::host::normalize_bdf(gpu).unwrap_or_else(|| gpu.clone()))
            .collect()
    };
    gpus.into_iter()
        .map(|bdf| {
            let method = reset_method_in(&sys.join("bus/pci/devices").join(&bdf));
            let (status, fix) = match &method {
                ResetMethod::Function { .. } | ResetMethod::VfioUser => (CheckStatus::Ok, None),
                ResetMethod::HotReset { .. } => (
                    CheckStatus::Warn,
                    Some("no function reset: the hot reset works only when every device on its bus or slot is bound to vfio-pci and given to the same VM; else reset it from the host (echo 1 > /sys/bus/pci/devices/<bdf>/reset) between users".into()),
                ),
                ResetMethod::None { .. } => (CheckStatus::Warn, None),
            };
            Check {
                name: format!("{bdf} reset"),
                status,
                detail: method.to_string(),
                fix,
            }
        })
        .collect()
}
