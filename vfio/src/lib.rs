//! PCI device passthrough for gpuvm.
//!
//! - [`PassthroughDevice`]: the one seam between the PCI model and a backend: regions
//!   (info, read/write, mmap), MSI-X eventfds, DMA mappings of guest RAM, reset.
//! - [`user::VfioUserDevice`]: the vfio-user backend (the VMM is the client; the device
//!   process receives the guest RAM memfd with each DMA mapping).
//! - [`pci::VfioPciDevice`]: a [`gpuvm_devices::pci::PciDevice`] over any backend: BARs,
//!   ROM BAR and MSI-X are emulated, the rest of configuration space is passed through.
//! - [`emu`]: an emulated NVIDIA-like GPU served over vfio-user, for tests.
//! - [`dma`]: DMA mapping of guest RAM in the background, and the progress that gates
//!   each device's Bus Master bit.
//! - [`host`]: host checks (memlock limit, IOMMU groups) shared by `gpuvm check-host`.
//! - [`topology`]: the host's PCIe topology from sysfs (switches, root complexes, cliques).
//! - [`sysfs`]: bounded, non-blocking reads of host attribute files (all host facts go
//!   through it).

use std::os::fd::RawFd;

use vmm_sys_util::eventfd::EventFd;

pub mod dma;
pub mod emu;
pub mod host;
pub mod kernel;
pub mod migration;
pub mod msi;
pub mod pci;
pub mod reset;
pub mod sysfs;
pub mod topology;
pub mod type1;
pub mod user;
pub mod user_handover;

#[cfg(test)]
mod migration_tests;
#[cfg(test)]
mod tests;

/// VFIO region indices of a PCI device (as in linux/vfio.h).
pub mod region {
    pub const BAR0: u32 = 0;
    pub const ROM: u32 = 6;
    pub const CONFIG: u32 = 7;
    pub const COUNT: u32 = 9;
}

/// Region flags (linux/vfio.h VFIO_REGION_INFO_FLAG_*).
pub const REGION_READ: u32 = 1;
pub const REGION_WRITE: u32 = 2;
pub const REGION_MMAP: u32 = 4;

/// What a backend says about one region.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionInfo {
    pub index: u32,
    pub size: u64,
    pub flags: u32,
    /// Parts of the region that can be mmapped (offset, size); empty when none can.
    pub mmap_areas: Vec<(u64, u64)>,
}

/// One range of guest RAM to make visible to the device for DMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaRegion {
    /// I/O virtual address the device uses: the guest-physical address.
    pub guest_addr: u64,
    pub size: u64,
    /// Where the range is mapped in this process (kernel VFIO pins it from here).
    pub host_addr: u64,
    /// The RAM file and the range's offset in it (vfio-user hands the fd to the device).
    pub fd: RawFd,
    pub fd_offset: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("vfio-user socket {path}: {source}")]
    Connect {
        path: std::path::PathBuf,
        source: vfio_user::Error,
    },
    #[error("vfio-user: {what}: {source}")]
    User {
        what: &'static str,
        source: vfio_user::Error,
    },
    #[error("device has no region {0}")]
    NoRegion(u32),
    #[error("access at {offset:#x}+{len} is outside region {index} ({size:#x} bytes)")]
    OutOfRange {
        index: u32,
        offset: u64,
        len: usize,
        size: u64,
    },
    #[error("the device is not a usable PCI function: {0}")]
    NotPci(String),
    #[error("cannot set up interrupts: {0}")]
    Interrupts(std::io::Error),
    #[error(
        "RLIMIT_MEMLOCK is {current} bytes but DMA-mapping guest RAM pins {needed} bytes: raise it \
         (`ulimit -l {needed_kib}` as root, or `LimitMEMLOCK=infinity` / memlock in /etc/security/limits.conf)"
    )]
    Memlock {
        current: u64,
        needed: u64,
        needed_kib: u64,
    },
    /// The device (named first in the message) cannot be migrated or snapshotted.
    #[error("the device does not support VFIO migration: {0}")]
    MigrationUnsupported(String),
    #[error("{device}: migration state {from:?} -> {to:?} failed: {reason}")]
    MigrationArc {
        device: String,
        from: migration::MigrationState,
        to: migration::MigrationState,
        reason: String,
    },
    #[error("{device}: migration data: {reason}")]
    MigrationData { device: String, reason: String },
    #[error(transparent)]
    Reset(#[from] reset::ResetError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, VfioError>;

/// Maps `len` bytes of `fd` from `offset` into this process, shared and read-write, at an
/// address the kernel picks. BAR mmaps (kernel VFIO's device fd, a vfio-user region's
/// file) and the emulated device's view of guest RAM are all such mappings; the caller
/// owns the mapping (it unmaps it, or keeps it for the process's life).
pub(crate) fn mmap_shared(fd: RawFd, offset: u64, len: usize) -> std::io::Result<*mut u8> {
    if len as u64 >= pci::HUGE_BAR_ALIGN {
        return pci::mmap_bar_part(fd, offset, len);
    }
    // SAFETY: a fresh mapping at an address the kernel picks, so no existing memory
    // changes; the kernel checks the fd, offset and length.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset as libc::off_t,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(address.cast())
}

/// A passthrough device as the VMM drives it, whatever carries the requests.
pub trait PassthroughDevice: Send {
    /// A short name for logs (BDF or socket path).
    fn name(&self) -> String;
    fn region_info(&self, index: u32) -> Option<RegionInfo>;
    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<()>;
    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()>;
    /// Maps `size` bytes of region `index` at `offset` into this process, if the region
    /// allows it; the mapping lives as long as the device.
    fn mmap_region(&mut self, index: u32, offset: u64, size: u64) -> Result<Option<*mut u8>>;
    /// How many MSI-X vectors the device has (0: none).
    fn msix_vectors(&mut self) -> Result<u32>;
    /// Makes vector i signal `eventfds[i]`.
    fn enable_msix(&mut self, eventfds: &[&EventFd]) -> Result<()>;
    fn disable_msix(&mut self) -> Result<()>;
    /// Makes MSI vector i signal `eventfds[i]` (MSI, for devices or guests without MSI-X).
    fn enable_msi(&mut self, _eventfds: &[&EventFd]) -> Result<()> {
        Err(VfioError::Interrupts(std::io::Error::other(
            "this backend does not do MSI",
        )))
    }
    fn disable_msi(&mut self) -> Result<()> {
        Ok(())
    }
    /// Whether the device has a legacy INTx line (VFIO IRQ index 0 with a vector).
    fn intx_supported(&mut self) -> bool {
        false
    }
    /// Makes the device's INTx signal `trigger`. Like vfio-pci, the device masks its line
    /// each time it fires, until [`PassthroughDevice::unmask_intx`].
    fn enable_intx(&mut self, _trigger: &EventFd) -> Result<()> {
        Err(VfioError::Interrupts(std::io::Error::other(
            "this backend does not do INTx",
        )))
    }
    fn disable_intx(&mut self) -> Result<()> {
        Ok(())
    }
    /// Unmasks INTx after the guest's end of interrupt; a line still asserted fires again.
    fn unmask_intx(&mut self) -> Result<()> {
        Ok(())
    }
    /// Whether the device must be left as it is when its model here goes: another gpuvm
    /// process runs it now, or may yet take it back (a live update).
    fn left_running_on_drop(&self) -> bool {
        false
    }
    /// Makes guest RAM visible to the device for DMA (a synchronous map; the VMM maps in
    /// the background through the backend's [`dma::DmaMapper`] instead).
    fn dma_map(&mut self, region: &DmaRegion) -> Result<()>;
    fn reset(&mut self) -> Result<()>;
    /// What the device can do for migration (None: it cannot be migrated or snapshotted).
    fn migration(&mut self) -> Option<migration::MigrationInfo> {
        None
    }
    /// Moves the device to `state` (one arc the device allows; see
    /// [`migration::save_device_state`] for the walks).
    fn set_migration_state(&mut self, _state: migration::MigrationState) -> Result<()> {
        Err(VfioError::MigrationUnsupported(format!(
            "{}: this backend has no migration support",
            self.name()
        )))
    }
    /// Reads the next piece of the device's state, in STOP_COPY; Ok(0) is the end.
    fn read_migration_data(&mut self, _buf: &mut [u8]) -> Result<usize> {
        Err(VfioError::MigrationUnsupported(format!(
            "{}: this backend has no migration support",
            self.name()
        )))
    }
    /// Gives the device the next piece of a saved state, in RESUMING.
    fn write_migration_data(&mut self, _data: &[u8]) -> Result<()> {
        Err(VfioError::MigrationUnsupported(format!(
            "{}: this backend has no migration support",
            self.name()
        )))
    }
}
