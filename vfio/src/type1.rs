//! Kernel VFIO through the type1 container/group API across a live update.
//!
//! The new gpuvm process gets the container, each group and each device as descriptors.
//! vfio-ioctls opens a group by its path and builds a device only through that group, and a
//! group opens once (the old process holds it), so this module drives the handed-over files
//! with the linux/vfio.h ioctls itself: [`HandedOverContainer`] (DMA map and unmap, as a
//! `VfioOps`), [`HandedOverDevice`] (regions, interrupts, migration) and [`group_files`].
//!
//! The mappings of guest RAM never leave the container (its pins stay while either process
//! holds it open); only the host addresses the kernel keeps for them move, as
//! VFIO_UPDATE_VADDR allows: once its vCPUs are paused the old process invalidates them
//! ([`invalidate_vaddr`]: VFIO_IOMMU_UNMAP_DMA with VFIO_DMA_UNMAP_FLAG_VADDR), the new one
//! gives the addresses of its own mapping of the same RAM ([`set_vaddr`]:
//! VFIO_IOMMU_MAP_DMA with VFIO_DMA_MAP_FLAG_VADDR; from Linux 6.3 this also moves the
//! locked-memory accounting to the new process), and a failed update gives the old
//! process's back ([`restore_vaddr`]). The device's DMA goes on throughout: only the
//! kernel's own later pinning (mediated devices, a new IOMMU domain) waits for valid
//! addresses.

use std::any::Any;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::Mutex;

use vfio_bindings::bindings::vfio::{
    vfio_device_info, vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap, vfio_irq_info,
    vfio_region_info, VFIO_DEVICE_FEATURE_GET, VFIO_DEVICE_FEATURE_MIGRATION,
    VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, VFIO_DEVICE_FEATURE_SET, VFIO_DMA_MAP_FLAG_READ,
    VFIO_DMA_MAP_FLAG_VADDR, VFIO_DMA_MAP_FLAG_WRITE, VFIO_DMA_UNMAP_FLAG_VADDR,
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_UPDATE_VADDR,
};
use vfio_ioctls::VfioOps;
use vmm_sys_util::errno;
use vmm_sys_util::eventfd::EventFd;

use crate::kernel::vfio_io;
use crate::migration::MigrationOps;
use crate::DmaRegion;

const VFIO_CHECK_EXTENSION: libc::c_ulong = vfio_io(1);
const VFIO_DEVICE_GET_INFO: libc::c_ulong = vfio_io(7);
const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = vfio_io(8);
const VFIO_DEVICE_GET_IRQ_INFO: libc::c_ulong = vfio_io(9);
const VFIO_DEVICE_SET_IRQS: libc::c_ulong = vfio_io(10);
const VFIO_IOMMU_MAP_DMA: libc::c_ulong = vfio_io(13);
const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = vfio_io(14);
const VFIO_DEVICE_FEATURE: libc::c_ulong = vfio_io(17);

/// Most interrupt vectors one VFIO_DEVICE_SET_IRQS carries here (MSI-X's limit).
const MAX_IRQ_VECTORS: usize = 2048;

/// `ioctl(fd, request, arg)` as an io::Result.
///
/// # Safety
/// `arg` must point to the structure `request` reads and writes, as large as it says.
unsafe fn ioctl_ptr<T>(fd: RawFd, request: libc::c_ulong, arg: *mut T) -> std::io::Result<i32> {
    // SAFETY: the caller's contract.
    let rc = unsafe { libc::ioctl(fd, request, arg) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

/// Why the container cannot hand its mappings to another process, if it cannot. Asks the
/// kernel, which takes the container's lock: not while a DMA mapping is in progress.
pub fn vaddr_update_refusal(container: BorrowedFd<'_>) -> Option<String> {
    (!supports_vaddr_update(container)).then(|| {
        "this kernel's type1 IOMMU cannot move a mapping's host address to another process \
         (no VFIO_UPDATE_VADDR: Linux before 5.12, or a mediated device in the container)"
            .into()
    })
}

/// Whether the container's IOMMU driver can move a mapping's host address
/// (VFIO_UPDATE_VADDR: type1 from Linux 5.12, unless the container has mediated devices).
pub fn supports_vaddr_update(container: BorrowedFd<'_>) -> bool {
    // SAFETY: VFIO_CHECK_EXTENSION takes its argument by value.
    let rc = unsafe {
        libc::ioctl(
            container.as_raw_fd(),
            VFIO_CHECK_EXTENSION,
            VFIO_UPDATE_VADDR as libc::c_ulong,
        )
    };
    rc > 0
}

/// One VFIO_IOMMU_UNMAP_DMA with VFIO_DMA_UNMAP_FLAG_VADDR: the mapping at `iova` keeps its
/// pages and IOMMU entries, and the kernel forgets its host address.
fn invalidate_one(container: BorrowedFd<'_>, iova: u64, size: u64) -> std::io::Result<()> {
    let mut unmap = vfio_iommu_type1_dma_unmap {
        argsz: std::mem::size_of::<vfio_iommu_type1_dma_unmap>() as u32,
        flags: VFIO_DMA_UNMAP_FLAG_VADDR,
        iova,
        size,
        ..Default::default()
    };
    // SAFETY: the argument is a vfio_iommu_type1_dma_unmap of `argsz` bytes.
    unsafe { ioctl_ptr(container.as_raw_fd(), VFIO_IOMMU_UNMAP_DMA, &mut unmap) }?;
    Ok(())
}

/// One VFIO_IOMMU_MAP_DMA with VFIO_DMA_MAP_FLAG_VADDR: the mapping at `chunk.guest_addr`
/// (exactly `chunk.size` bytes, its address invalidated) takes `chunk.host_addr`.
fn set_one(container: BorrowedFd<'_>, chunk: &DmaRegion) -> std::io::Result<()> {
    let mut map = vfio_iommu_type1_dma_map {
        argsz: std::mem::size_of::<vfio_iommu_type1_dma_map>() as u32,
        // With VADDR the kernel refuses READ/WRITE: the mapping keeps its permissions.
        flags: VFIO_DMA_MAP_FLAG_VADDR,
        vaddr: chunk.host_addr,
        iova: chunk.guest_addr,
        size: chunk.size,
    };
    // SAFETY: the argument is a vfio_iommu_type1_dma_map of `argsz` bytes; the kernel only
    // records the address (the pages stay pinned from the first mapping).
    unsafe { ioctl_ptr(container.as_raw_fd(), VFIO_IOMMU_MAP_DMA, &mut map) }?;
    Ok(())
}

/// Invalidates the host address of each mapping in `mappings` (IOVA, size: each exactly
/// one VFIO_IOMMU_MAP_DMA the context made). On an error part way, the ones already
/// invalidated are given `own` addresses back ([`restore_vaddr`]) before it is returned.
pub fn invalidate_vaddr(
    container: BorrowedFd<'_>,
    mappings: &[(u64, u64)],
    own: &[DmaRegion],
) -> std::io::Result<()> {
    for (done, &(iova, size)) in mappings.iter().enumerate() {
        if let Err(error) = invalidate_one(container, iova, size) {
            let undo = own_chunks(&mappings[..done], own);
            if let Err(undo_error) = undo.and_then(|chunks| restore_vaddr(container, &chunks)) {
                log::error!("kernel VFIO (type1): cannot give back the addresses: {undo_error}");
            }
            return Err(std::io::Error::new(
                error.kind(),
                format!("VFIO_DMA_UNMAP_FLAG_VADDR at IOVA {iova:#x} ({size:#x} bytes): {error}"),
            ));
        }
    }
    Ok(())
}

/// Gives each invalidated mapping the host address in `chunks` (this process's mapping
/// of the same RAM). Returns how many moved.
pub fn set_vaddr(container: BorrowedFd<'_>, chunks: &[DmaRegion]) -> std::io::Result<usize> {
    for chunk in chunks {
        set_one(container, chunk).map_err(|error| {
            std::io::Error::new(
                error.kind(),
                format!(
                    "VFIO_DMA_MAP_FLAG_VADDR at IOVA {:#x} ({:#x} bytes): {error}",
                    chunk.guest_addr, chunk.size
                ),
            )
        })?;
    }
    Ok(chunks.len())
}

/// After a failed update: each mapping of `chunks` takes this process's address again,
/// whether it is still invalidated or the new process had already given its own (EINVAL:
/// then it is invalidated and set again).
pub fn restore_vaddr(container: BorrowedFd<'_>, chunks: &[DmaRegion]) -> std::io::Result<()> {
    for chunk in chunks {
        match set_one(container, chunk) {
            Ok(()) => {}
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                invalidate_one(container, chunk.guest_addr, chunk.size)?;
                set_one(container, chunk)?;
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// The chunks of `own` (this process's RAM as DMA regions) at each mapping's IOVA and size.
pub fn own_chunks(mappings: &[(u64, u64)], own: &[DmaRegion]) -> std::io::Result<Vec<DmaRegion>> {
    mappings
        .iter()
        .map(|&(iova, size)| {
            let region = own
                .iter()
                .find(|r| {
                    iova >= r.guest_addr
                        && iova
                            .checked_add(size)
                            .is_some_and(|end| end <= r.guest_addr + r.size)
                })
                .ok_or_else(|| {
                    std::io::Error::other(format!(
                        "the mapping at IOVA {iova:#x} ({size:#x} bytes) is not in guest RAM here"
                    ))
                })?;
            let offset = iova - region.guest_addr;
            Ok(DmaRegion {
                guest_addr: iova,
                size,
                host_addr: region.host_addr + offset,
                fd: region.fd,
                fd_offset: region.fd_offset + offset,
            })
        })
        .collect()
}

/// The group files of `bdfs` this process holds (vfio-ioctls keeps its own to itself, or
/// a live update handed them over): each device's IOMMU group from sysfs, its `/dev/vfio/N`
/// found among this process's descriptors and duplicated. One entry per group.
pub fn group_files(bdfs: &[&str]) -> std::io::Result<Vec<(u32, OwnedFd)>> {
    let mut groups: Vec<(u32, OwnedFd)> = Vec::new();
    for bdf in bdfs {
        let link = Path::new("/sys/bus/pci/devices")
            .join(bdf)
            .join("iommu_group");
        let target = std::fs::read_link(&link)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", link.display())))?;
        let group: u32 = (target.file_name().and_then(|n| n.to_str()))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("{bdf}: no IOMMU group number")))?;
        if groups.iter().any(|(g, _)| *g == group) {
            continue;
        }
        let fd = open_group_fd(group).ok_or_else(|| {
            std::io::Error::other(format!("{bdf}: group {group} is not open here"))
        })?;
        // SAFETY: `fd` is one of this process's open descriptors (just found), borrowed only
        // to be duplicated.
        let copy = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
        groups.push((group, copy));
    }
    Ok(groups)
}

/// This process's descriptor for `/dev/vfio/<group>`, if it holds one.
pub fn open_group_fd(group: u32) -> Option<RawFd> {
    let wanted = std::path::PathBuf::from(format!("/dev/vfio/{group}"));
    std::fs::read_dir("/proc/self/fd")
        .ok()?
        .flatten()
        .find(|entry| std::fs::read_link(entry.path()).is_ok_and(|target| target == wanted))
        .and_then(|entry| entry.file_name().to_str()?.parse().ok())
}

/// A handed-over type1 container: maps and unmaps guest RAM added after the update (and
/// peers' BARs) as vfio-ioctls' container would.
pub struct HandedOverContainer {
    file: File,
    /// The groups' files (IOMMU group number, file): held for as long as the container is,
    /// as the old process held them (a hot reset names them).
    _groups: Vec<(u32, OwnedFd)>,
    /// The VM's KVM VFIO device the groups were added to (closing it would remove them).
    _kvm_vfio: Option<std::sync::Arc<vfio_ioctls::VfioDeviceFd>>,
}

impl HandedOverContainer {
    pub fn new(
        container: OwnedFd,
        groups: Vec<(u32, OwnedFd)>,
        kvm_vfio: Option<std::sync::Arc<vfio_ioctls::VfioDeviceFd>>,
    ) -> Self {
        HandedOverContainer {
            file: File::from(container),
            _groups: groups,
            _kvm_vfio: kvm_vfio,
        }
    }
}

impl AsFd for HandedOverContainer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl VfioOps for HandedOverContainer {
    unsafe fn vfio_dma_map(
        &self,
        iova: u64,
        size: usize,
        user_addr: *mut u8,
    ) -> vfio_ioctls::Result<()> {
        let mut map = vfio_iommu_type1_dma_map {
            argsz: std::mem::size_of::<vfio_iommu_type1_dma_map>() as u32,
            flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
            vaddr: user_addr as u64,
            iova,
            size: size as u64,
        };
        // SAFETY: the argument is a vfio_iommu_type1_dma_map of `argsz` bytes; the pages at
        // `user_addr` stay mapped until unmapped (the caller's contract).
        unsafe { ioctl_ptr(self.file.as_raw_fd(), VFIO_IOMMU_MAP_DMA, &mut map) }
            .map(drop)
            .map_err(|e| vfio_ioctls::VfioError::IommuDmaMap(errno::Error::from(e)))
    }

    fn vfio_dma_unmap(&self, iova: u64, size: usize) -> vfio_ioctls::Result<()> {
        let mut unmap = vfio_iommu_type1_dma_unmap {
            argsz: std::mem::size_of::<vfio_iommu_type1_dma_unmap>() as u32,
            iova,
            size: size as u64,
            ..Default::default()
        };
        // SAFETY: the argument is a vfio_iommu_type1_dma_unmap of `argsz` bytes.
        unsafe { ioctl_ptr(self.file.as_raw_fd(), VFIO_IOMMU_UNMAP_DMA, &mut unmap) }
            .map(drop)
            .map_err(|e| vfio_ioctls::VfioError::IommuDmaUnmap(errno::Error::from(e)))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// VFIO_DEVICE_SET_IRQS' header and up to [`MAX_IRQ_VECTORS`] eventfds.
#[repr(C)]
struct IrqSet {
    argsz: u32,
    flags: u32,
    index: u32,
    start: u32,
    count: u32,
    fds: [i32; MAX_IRQ_VECTORS],
}

/// VFIO_DEVICE_FEATURE's header with one 8-byte payload (the migration flags, or the
/// migration state and its data fd).
#[repr(C)]
struct Feature {
    argsz: u32,
    flags: u32,
    payload: [u32; 2],
}

/// A device file of a handed-over group (VFIO_GROUP_GET_DEVICE_FD in the old process):
/// what gpuvm's kernel backend asks of a device, over the file itself.
pub struct HandedOverDevice {
    file: File,
    /// Each region's flags, size and offset in the file, by index.
    regions: Vec<vfio_region_info>,
    /// Each interrupt index's vector count.
    irqs: Vec<u32>,
    /// The data file of the migration state in progress (STOP_COPY or RESUMING).
    migration_data: Mutex<Option<File>>,
}

impl HandedOverDevice {
    /// Reads the device's regions and interrupt indexes from `device`.
    pub fn new(device: OwnedFd) -> std::io::Result<Self> {
        let file = File::from(device);
        let fd = file.as_raw_fd();
        let mut info = vfio_device_info {
            argsz: std::mem::size_of::<vfio_device_info>() as u32,
            ..Default::default()
        };
        // SAFETY: the argument is a vfio_device_info of `argsz` bytes.
        unsafe { ioctl_ptr(fd, VFIO_DEVICE_GET_INFO, &mut info) }?;
        // A PCI device has 9 regions and 5 interrupt indexes; more is not a device to trust.
        if info.num_regions > 64 || info.num_irqs > 64 {
            return Err(std::io::Error::other(format!(
                "the device reports {} regions and {} interrupt indexes",
                info.num_regions, info.num_irqs
            )));
        }
        let regions = (0..info.num_regions)
            .map(|index| {
                let mut region = vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    index,
                    ..Default::default()
                };
                // SAFETY: the argument is a vfio_region_info of `argsz` bytes (the kernel
                // writes capabilities only past `argsz`, asking for more room instead).
                match unsafe { ioctl_ptr(fd, VFIO_DEVICE_GET_REGION_INFO, &mut region) } {
                    Ok(_) => Ok(region),
                    // A region the device does not have (EINVAL) reads as empty.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(vfio_region_info {
                        index,
                        ..Default::default()
                    }),
                    Err(e) => Err(e),
                }
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let irqs = (0..info.num_irqs)
            .map(|index| {
                let mut irq = vfio_irq_info {
                    argsz: std::mem::size_of::<vfio_irq_info>() as u32,
                    index,
                    ..Default::default()
                };
                // SAFETY: the argument is a vfio_irq_info of `argsz` bytes.
                match unsafe { ioctl_ptr(fd, VFIO_DEVICE_GET_IRQ_INFO, &mut irq) } {
                    Ok(_) => Ok(irq.count),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(0),
                    Err(e) => Err(e),
                }
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(HandedOverDevice {
            file,
            regions,
            irqs,
            migration_data: Mutex::new(None),
        })
    }

    fn region(&self, index: u32) -> Option<&vfio_region_info> {
        self.regions.get(index as usize)
    }

    pub fn region_flags(&self, index: u32) -> u32 {
        self.region(index).map_or(0, |r| r.flags)
    }

    pub fn region_offset(&self, index: u32) -> u64 {
        self.region(index).map_or(0, |r| r.offset)
    }

    pub fn region_size(&self, index: u32) -> u64 {
        self.region(index).map_or(0, |r| r.size)
    }

    /// Reads `buf` at `addr` of region `index` (an access past the region is refused).
    pub fn region_read(&self, index: u32, buf: &mut [u8], addr: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let at = self.checked_offset(index, addr, buf.len())?;
        self.file.read_exact_at(buf, at)
    }

    /// Writes `buf` at `addr` of region `index` (an access past the region is refused).
    pub fn region_write(&self, index: u32, buf: &[u8], addr: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let at = self.checked_offset(index, addr, buf.len())?;
        self.file.write_all_at(buf, at)
    }

    fn checked_offset(&self, index: u32, addr: u64, len: usize) -> std::io::Result<u64> {
        let size = self.region_size(index);
        match addr.checked_add(len as u64) {
            Some(end) if end <= size => Ok(self.region_offset(index) + addr),
            _ => Err(std::io::Error::other(format!(
                "{len} bytes at {addr:#x} of region {index} ({size:#x} bytes)"
            ))),
        }
    }

    /// The vector count of interrupt index `index` (None when the device has no such index).
    pub fn irq_count(&self, index: u32) -> Option<u32> {
        self.irqs.get(index as usize).copied()
    }

    fn set_irqs(&self, flags: u32, index: u32, count: u32, fds: &[RawFd]) -> std::io::Result<()> {
        if fds.len() > MAX_IRQ_VECTORS {
            return Err(std::io::Error::other(format!(
                "{} interrupt vectors",
                fds.len()
            )));
        }
        let mut set = IrqSet {
            argsz: (std::mem::size_of::<u32>() * 5 + std::mem::size_of_val(fds)) as u32,
            flags,
            index,
            start: 0,
            count,
            fds: [0; MAX_IRQ_VECTORS],
        };
        set.fds[..fds.len()].copy_from_slice(fds);
        // SAFETY: the argument is a vfio_irq_set followed by `fds.len()` eventfds, which
        // `argsz` covers and `IrqSet` holds.
        unsafe { ioctl_ptr(self.file.as_raw_fd(), VFIO_DEVICE_SET_IRQS, &mut set) }?;
        Ok(())
    }

    /// Triggers interrupt index `index`'s vectors on `eventfds`.
    pub fn enable_irq(&self, index: u32, eventfds: &[&EventFd]) -> std::io::Result<()> {
        let fds: Vec<RawFd> = eventfds.iter().map(|e| e.as_raw_fd()).collect();
        self.set_irqs(
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            index,
            fds.len() as u32,
            &fds,
        )
    }

    /// Turns interrupt index `index` off.
    pub fn disable_irq(&self, index: u32) -> std::io::Result<()> {
        self.set_irqs(
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            index,
            0,
            &[],
        )
    }

    /// Unmasks interrupt index `index` (INTx after the guest handled it).
    pub fn unmask_irq(&self, index: u32) -> std::io::Result<()> {
        self.set_irqs(
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK,
            index,
            1,
            &[],
        )
    }

    fn feature(&self, flags: u32, payload: [u32; 2]) -> std::io::Result<[u32; 2]> {
        let mut feature = Feature {
            argsz: std::mem::size_of::<Feature>() as u32,
            flags,
            payload,
        };
        // SAFETY: the argument is a vfio_device_feature with an 8-byte payload, `argsz`
        // bytes in all.
        unsafe { ioctl_ptr(self.file.as_raw_fd(), VFIO_DEVICE_FEATURE, &mut feature) }?;
        Ok(feature.payload)
    }
}

impl AsRawFd for HandedOverDevice {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

fn lock_data(device: &HandedOverDevice) -> std::sync::MutexGuard<'_, Option<File>> {
    device
        .migration_data
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl MigrationOps for HandedOverDevice {
    fn query_migration_support(&self) -> std::io::Result<Option<u64>> {
        match self.feature(
            VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIGRATION,
            [0; 2],
        ) {
            Ok([low, high]) => Ok(Some(u64::from(low) | (u64::from(high) << 32))),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn set_migration_state(&self, state: u32) -> std::io::Result<()> {
        let flags = VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE;
        let [_, data_fd] = self.feature(flags, [state, u32::MAX])?;
        let data_fd = data_fd as i32;
        // STOP_COPY and RESUMING come with a data file; the other states end the last one.
        *lock_data(self) = (data_fd >= 0).then(|| {
            // SAFETY: the kernel just opened `data_fd` for this process and gave it here.
            File::from(unsafe { OwnedFd::from_raw_fd(data_fd) })
        });
        Ok(())
    }

    fn read_migration_data(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::io::Read;
        match lock_data(self).as_mut() {
            Some(data) => data.read(buf),
            None => Err(std::io::Error::other(
                "no migration data file (not in STOP_COPY)",
            )),
        }
    }

    fn write_migration_data(&self, data: &[u8]) -> std::io::Result<()> {
        match lock_data(self).as_mut() {
            Some(file) => file.write_all(data),
            None => Err(std::io::Error::other(
                "no migration data file (not RESUMING)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(guest_addr: u64, size: u64, host_addr: u64) -> DmaRegion {
        DmaRegion {
            guest_addr,
            size,
            host_addr,
            fd: 3,
            fd_offset: guest_addr,
        }
    }

    /// Each mapping takes the host address of this process's RAM at its IOVA, its file
    /// offset with it; a mapping outside RAM here (another layout) is refused by name.
    #[test]
    fn own_chunks_follow_this_process_ram() {
        let own = [
            region(0, 0x8000_0000, 0x7f00_0000_0000),
            region(0x1_0000_0000, 0x4000_0000, 0x7e00_0000_0000),
        ];
        let chunks = own_chunks(
            &[(0x4000_0000, 0x4000_0000), (0x1_0000_0000, 0x4000_0000)],
            &own,
        )
        .unwrap();
        assert_eq!(chunks[0].host_addr, 0x7f00_4000_0000);
        assert_eq!(chunks[0].fd_offset, 0x4000_0000);
        assert_eq!(chunks[1].host_addr, 0x7e00_0000_0000);
        assert_eq!(chunks[1].size, 0x4000_0000);
        let error = own_chunks(&[(0x7000_0000, 0x2000_0000)], &own).unwrap_err();
        assert!(error.to_string().contains("IOVA 0x70000000"), "{error}");
        assert!(own_chunks(&[(u64::MAX - 10, 0x1000)], &own).is_err());
    }

    /// A file that is not a container: the address moves fail with the IOVA named, and
    /// the extension reads as missing.
    #[test]
    fn vaddr_moves_on_a_file_that_is_no_container_fail_by_name() {
        let file = File::open("/dev/null").unwrap();
        assert!(!supports_vaddr_update(file.as_fd()));
        let refusal = vaddr_update_refusal(file.as_fd()).expect("no container: refused");
        assert!(refusal.contains("VFIO_UPDATE_VADDR"), "{refusal}");
        let own = [region(0, 0x20_0000, 0x7f00_0000_0000)];
        let error = invalidate_vaddr(file.as_fd(), &[(0, 0x20_0000)], &own).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("VFIO_DMA_UNMAP_FLAG_VADDR at IOVA 0x0"),
            "{error}"
        );
        let error = set_vaddr(file.as_fd(), &own).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("VFIO_DMA_MAP_FLAG_VADDR at IOVA 0x0"),
            "{error}"
        );
        assert!(restore_vaddr(file.as_fd(), &own).is_err());
    }

    /// A device file that is no VFIO device is refused when adopted.
    #[test]
    fn a_file_that_is_no_device_is_refused() {
        let file = File::open("/dev/null").unwrap();
        assert!(HandedOverDevice::new(OwnedFd::from(file)).is_err());
    }
}
