//! The kernel VFIO backend (vfio-ioctls): devices opened through the iommufd cdev API where
//! the host has /dev/iommu and the device a vfio-dev node, else through the container/group
//! API; all guest RAM DMA-mapped once per IOMMU context, in hugepage-aligned chunks, in
//! the background while the guest boots (crate::dma).
//!
//! DMA mapping goes through [`KernelVfio::dma_mapper`], a [`DmaMapper`] over
//! vfio-ioctls' `VfioOps` (VFIO_IOMMU_MAP_DMA for a type1 container, IOMMU_IOAS_MAP for
//! an iommufd IOAS); the tests drive it over a fake `VfioOps`.
//!
//! A live update hands an iommufd context to the new gpuvm process as descriptors: the
//! iommufd (whose IOAS keeps every mapping and pin) and each device's cdev, bound to it and
//! attached to that IOAS ([`KernelVfio::hand_over`], [`KernelVfio::adopt`]). Nothing is
//! unmapped, re-pinned, detached or reset. vfio-ioctls builds a device over a bound cdev
//! (`VfioDevice::new_from_bound_fd`) but has no IOAS over an existing id, so the adopted
//! context maps RAM added later through iommufd-ioctls' IOMMU_IOAS_MAP on that id
//! ([`IoasMapper`]), and gives vfio-ioctls an empty IOAS of its own that nothing attaches
//! to. The pins stay accounted to the old process's mm: moving them needs
//! IOMMU_IOAS_CHANGE_PROCESS (Linux 6.13, and mappings made from a file), not used yet.
//! A type1 container goes over with its groups and device files, which this crate drives
//! itself in the new process (vfio-ioctls opens groups by path only, and a group cannot be
//! opened a second time while the old process holds it): see [`crate::type1`].

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX,
};
/// The handle on a VM's KVM VFIO pseudo-device that [`KernelVfio::open`] takes.
pub use vfio_ioctls::VfioDeviceFd;
use vfio_ioctls::{VfioContainer, VfioDevice, VfioIommufd, VfioOps};
use vmm_sys_util::eventfd::EventFd;

use crate::dma::{DmaMapper, PeerMapper, PeerMappingUnsupported};
use crate::host::normalize_bdf;
use crate::migration::{KernelMigration, MigrationInfo, MigrationState};
use crate::{DmaRegion, PassthroughDevice, RegionInfo, Result, VfioError, REGION_MMAP};

/// Which kernel interface the devices were opened through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelApi {
    Iommufd,
    Container,
}

/// What a live update hands over of a kernel VFIO context ([`KernelVfio::hand_over`]).
pub enum ContextHandOver {
    /// A duplicate of the iommufd and the id of the devices' IOAS.
    Iommufd { iommufd: OwnedFd, ioas_id: u32 },
    /// A duplicate of the type1 container (its groups and devices go with the devices).
    Container { container: OwnedFd },
}

/// The IOMMU context shared by all of a VM's kernel VFIO devices.
pub struct KernelVfio {
    ops: Arc<dyn VfioOps>,
    api: KernelApi,
    /// An iommufd context's IOAS, where the devices are attached and RAM is mapped.
    ioas: Option<(Arc<iommufd_ioctls::IommuFd>, u32)>,
    /// Set when the context was handed over by a live update (the same context as
    /// `ops`): RAM is mapped through [`IoasMapper`] on `ioas`, not through `ops` (whose
    /// IOAS is an empty one), and devices are adopted into it.
    adopted: Option<Arc<VfioIommufd>>,
    /// Handed over by a live update (an iommufd context or a type1 container).
    handed_over: bool,
}

/// Whether a device another gpuvm process may run must be left alone here (a live
/// update): neither detached, reset nor given up when its model goes.
#[derive(Default)]
pub struct HandOverMark {
    /// Another gpuvm process runs the device now.
    handed_over: AtomicBool,
    /// Taken over from a process that may yet take it back (until the update commits).
    provisional: AtomicBool,
}

impl HandOverMark {
    /// The new process has the device (this one gave it away or hands it back).
    pub fn mark_handed_over(&self) {
        self.handed_over.store(true, Ordering::Release);
    }

    /// Taken over by a live update that has not committed yet.
    pub fn mark_provisional(&self) {
        self.provisional.store(true, Ordering::Release);
    }

    /// The live update committed: the device is this process's for good.
    pub fn confirm(&self) {
        self.provisional.store(false, Ordering::Release);
    }

    fn leaves_device_alone(&self) -> bool {
        self.handed_over.load(Ordering::Acquire) || self.provisional.load(Ordering::Acquire)
    }
}

/// Maps RAM into a handed-over iommufd context's IOAS by its id (IOMMU_IOAS_MAP through
/// iommufd-ioctls; see the module comment).
struct IoasMapper {
    iommufd: Arc<iommufd_ioctls::IommuFd>,
    ioas_id: u32,
}

impl DmaMapper for IoasMapper {
    fn name(&self) -> String {
        format!("kernel VFIO (iommufd IOAS {}, handed over)", self.ioas_id)
    }

    fn max_parallel(&self) -> usize {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(IOMMUFD_MAX_PARALLEL)
    }

    unsafe fn map(&self, chunk: &crate::DmaRegion) -> std::io::Result<()> {
        use iommufd_bindings::iommufd::{
            iommu_ioas_map, iommufd_ioas_map_flags_IOMMU_IOAS_MAP_FIXED_IOVA as FIXED_IOVA,
            iommufd_ioas_map_flags_IOMMU_IOAS_MAP_READABLE as READABLE,
            iommufd_ioas_map_flags_IOMMU_IOAS_MAP_WRITEABLE as WRITEABLE,
        };
        let map = iommu_ioas_map {
            size: std::mem::size_of::<iommu_ioas_map>() as u32,
            flags: READABLE | WRITEABLE | FIXED_IOVA,
            ioas_id: self.ioas_id,
            __reserved: 0,
            user_va: chunk.host_addr,
            length: chunk.size,
            iova: chunk.guest_addr,
        };
        // The kernel pins the caller's pages at `host_addr` (the caller's contract: they
        // stay mapped until unmapped here).
        self.iommufd
            .map_iommu_ioas(&map)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn unmap(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        let mut unmap = iommufd_bindings::iommufd::iommu_ioas_unmap {
            size: std::mem::size_of::<iommufd_bindings::iommufd::iommu_ioas_unmap>() as u32,
            ioas_id: self.ioas_id,
            iova: guest_addr,
            length: size,
        };
        self.iommufd
            .unmap_iommu_ioas(&mut unmap)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// Most IOAS_MAP calls gpuvm keeps in flight at once on iommufd.
const IOMMUFD_MAX_PARALLEL: usize = 8;

/// Maps through the context's `VfioOps`: one mapping covers every device of the context.
struct OpsMapper {
    ops: Arc<dyn VfioOps>,
    api: KernelApi,
    /// A type1 container a live update handed over (its mappings under a name of their own).
    handed_over: bool,
}

impl DmaMapper for OpsMapper {
    fn name(&self) -> String {
        match self.api {
            KernelApi::Container if self.handed_over => {
                "kernel VFIO (type1 container, handed over)".into()
            }
            KernelApi::Container => "kernel VFIO (type1 container)".into(),
            KernelApi::Iommufd => "kernel VFIO (iommufd IOAS)".into(),
        }
    }

    /// type1: `vfio_dma_do_map` holds the container's `iommu->lock` while it pins and
    /// maps (`vfio_pin_map_dma`), so a second thread would only wait on that mutex.
    /// iommufd: `iopt_map_pages` takes `iova_rwsem` for write only to reserve the IOVA
    /// range and to link the area, and pins and maps (`iopt_fill_domains_pages`) under
    /// `domains_rwsem` held for read, so maps of disjoint ranges run side by side.
    fn max_parallel(&self) -> usize {
        match self.api {
            KernelApi::Container => 1,
            KernelApi::Iommufd => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(IOMMUFD_MAX_PARALLEL),
        }
    }

    unsafe fn map(&self, chunk: &crate::DmaRegion) -> std::io::Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.ops.vfio_dma_map(
                chunk.guest_addr,
                chunk.size as usize,
                chunk.host_addr as *mut u8,
            )
        }
        .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn unmap(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        self.ops
            .vfio_dma_unmap(guest_addr, size as usize)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// A type1 container maps peers' BARs from the host addresses where gpuvm mmapped them:
/// VFIO_IOMMU_MAP_DMA resolves those VM_PFNMAP pages to the BARs' physical addresses.
impl PeerMapper for OpsMapper {
    fn name(&self) -> String {
        DmaMapper::name(self)
    }

    unsafe fn map_peer(&self, window: &DmaRegion) -> std::io::Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { DmaMapper::map(self, window) }
    }

    fn unmap_peer(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        DmaMapper::unmap(self, guest_addr, size)
    }
}

fn sysfs_path(bdf: &str) -> Result<PathBuf> {
    let bdf = normalize_bdf(bdf)
        .ok_or_else(|| VfioError::NotPci(format!("'{bdf}' is not a PCI address")))?;
    let path = Path::new("/sys/bus/pci/devices").join(&bdf);
    if !path.exists() {
        return Err(VfioError::NotPci(format!("no PCI device {bdf}")));
    }
    Ok(path)
}

impl KernelVfio {
    /// iommufd when /dev/iommu exists and the first device has a vfio-dev cdev, else the
    /// container API.
    ///
    /// `kvm_vfio` is the VM's KVM VFIO pseudo-device (KVM_DEV_TYPE_VFIO): vfio-ioctls adds
    /// every group or device file to it as it is opened, which tells KVM the VM has assigned
    /// devices (needed for non-coherent DMA: KVM then honours the guest's cache attributes).
    pub fn open(first_bdf: &str, kvm_vfio: Option<Arc<VfioDeviceFd>>) -> Result<Self> {
        let cdev = sysfs_path(first_bdf)?.join("vfio-dev").exists();
        if cdev && Path::new("/dev/iommu").exists() {
            let iommufd = iommufd_ioctls::IommuFd::new()
                .map_err(|e| std::io::Error::other(format!("open /dev/iommu: {e}")))?;
            let ops = VfioIommufd::new(Arc::new(iommufd), None, kvm_vfio)
                .map_err(|e| std::io::Error::other(format!("iommufd IOAS: {e}")))?;
            log::info!("kernel VFIO: iommufd cdev API");
            let ioas = Some((ops.iommufd().clone(), ops.ioas().id()));
            return Ok(KernelVfio {
                ops: Arc::new(ops),
                api: KernelApi::Iommufd,
                ioas,
                adopted: None,
                handed_over: false,
            });
        }
        let container = VfioContainer::new(kvm_vfio)
            .map_err(|e| std::io::Error::other(format!("open /dev/vfio/vfio: {e}")))?;
        log::info!("kernel VFIO: container/group API");
        Ok(KernelVfio {
            ops: Arc::new(container),
            api: KernelApi::Container,
            ioas: None,
            adopted: None,
            handed_over: false,
        })
    }

    /// What a live update hands over of this context: a duplicate of its iommufd and the
    /// id of the IOAS its devices are attached to, or a duplicate of its type1 container
    /// (refused, with the reason, where the kernel cannot move the mappings' host
    /// addresses).
    pub fn hand_over(&self) -> std::result::Result<ContextHandOver, String> {
        if let Some((iommufd, ioas_id)) = &self.ioas {
            // SAFETY: the iommufd stays open for as long as `iommufd`; borrowed only to be
            // duplicated.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(iommufd.as_raw_fd()) };
            let copy = fd
                .try_clone_to_owned()
                .map_err(|e| format!("cannot duplicate the iommufd: {e}"))?;
            return Ok(ContextHandOver::Iommufd {
                iommufd: copy,
                ioas_id: *ioas_id,
            });
        }
        // Whether the kernel can move the mappings is asked at the update
        // (crate::type1::vaddr_update_refusal): the question waits for the container's lock,
        // which a DMA mapping in progress holds, and this runs as the VM is built.
        let copy = (self.container())
            .ok_or("no type1 container to hand over")?
            .try_clone_to_owned()
            .map_err(|e| format!("cannot duplicate the container: {e}"))?;
        Ok(ContextHandOver::Container { container: copy })
    }

    /// A live update's new process: the type1 container the old one handed over, its
    /// mappings as they are (their host addresses moved with [`crate::type1::set_vaddr`]).
    /// `groups` (IOMMU group number, file) were added to this VM's KVM VFIO device
    /// `kvm_vfio` by the caller; both are held for as long as the context is.
    pub fn adopt_container(
        container: OwnedFd,
        groups: Vec<(u32, OwnedFd)>,
        kvm_vfio: Arc<VfioDeviceFd>,
    ) -> Self {
        let container = crate::type1::HandedOverContainer::new(container, groups, Some(kvm_vfio));
        KernelVfio {
            ops: Arc::new(container),
            api: KernelApi::Container,
            ioas: None,
            adopted: None,
            handed_over: true,
        }
    }

    /// A live update's new process: the context the old one handed over (`iommufd`, its
    /// IOAS `ioas_id`), whose mappings stay as they are. `kvm_vfio` is this VM's KVM VFIO
    /// pseudo-device, which the devices join as they are adopted.
    pub fn adopt(
        iommufd: OwnedFd,
        ioas_id: u32,
        kvm_vfio: Option<Arc<VfioDeviceFd>>,
    ) -> Result<Self> {
        let iommufd = Arc::new(iommufd_ioctls::IommuFd::new_from_fd(std::fs::File::from(
            iommufd,
        )));
        // vfio-ioctls' context needs an IOAS of its own; it stays empty and unattached.
        let ops = VfioIommufd::new(iommufd.clone(), None, kvm_vfio).map_err(|e| {
            std::io::Error::other(format!("the handed-over iommufd refuses an IOAS: {e}"))
        })?;
        let ops = Arc::new(ops);
        Ok(KernelVfio {
            ops: ops.clone(),
            api: KernelApi::Iommufd,
            ioas: Some((iommufd, ioas_id)),
            adopted: Some(ops),
            handed_over: true,
        })
    }

    /// A device of an adopted context over its handed-over file: a cdev still bound to the
    /// iommufd and attached to the IOAS ([`KernelVfio::adopt`]), or a type1 group's device
    /// file ([`KernelVfio::adopt_container`]). Nothing is asked of it but its regions and
    /// interrupts. `mark` says whether it is left alone when it goes.
    pub fn adopt_device(
        &self,
        file: OwnedFd,
        bdf: &str,
        mark: Arc<HandOverMark>,
    ) -> Result<KernelVfioDevice> {
        if self.api == KernelApi::Container {
            let device = crate::type1::HandedOverDevice::new(file)
                .map_err(|e| std::io::Error::other(format!("adopt VFIO device {bdf}: {e}")))?;
            return Ok(KernelVfioDevice::with_file(
                DeviceFile::HandedOver(device),
                bdf,
                sysfs_path(bdf)?,
                false,
                mark,
            ));
        }
        let cdev = file;
        let context = (self.adopted.clone())
            .ok_or_else(|| std::io::Error::other("not a handed-over iommufd context"))?;
        let device = VfioDevice::new_from_bound_fd(std::fs::File::from(cdev), context, false)
            .map_err(|e| std::io::Error::other(format!("adopt VFIO device {bdf}: {e}")))?;
        Ok(KernelVfioDevice::over(
            device,
            bdf,
            sysfs_path(bdf)?,
            true,
            mark,
        ))
    }

    /// The type1 container's file, opened here or handed over (None for iommufd): what a
    /// live update hands over, and where its new process moves the mappings' host
    /// addresses.
    pub fn container(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        if self.api != KernelApi::Container {
            return None;
        }
        let any = self.ops.as_any();
        let fd = (any.downcast_ref::<VfioContainer>().map(AsRawFd::as_raw_fd)).or_else(|| {
            (any.downcast_ref::<crate::type1::HandedOverContainer>())
                .map(|c| std::os::fd::AsFd::as_fd(c).as_raw_fd())
        })?;
        // SAFETY: the container stays open for as long as `self.ops`, which the returned
        // borrow cannot outlive.
        Some(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
    }

    pub fn api(&self) -> KernelApi {
        self.api
    }

    /// Opens a device bound to vfio-pci (its group joins the container, or the device
    /// attaches to the IOAS).
    pub fn open_device(&self, bdf: &str) -> Result<KernelVfioDevice> {
        let path = sysfs_path(bdf)?;
        let device = VfioDevice::new(&path, self.ops.clone(), self.api == KernelApi::Iommufd)
            .map_err(|e| std::io::Error::other(format!("open VFIO device {bdf}: {e}")))?;
        let cdev = self.api == KernelApi::Iommufd;
        Ok(KernelVfioDevice::over(
            device,
            bdf,
            path,
            cdev,
            Arc::default(),
        ))
    }

    /// The mapper for guest RAM ([`crate::dma::BackgroundMapping`]); its mappings cover
    /// every device of this context.
    pub fn dma_mapper(&self) -> Arc<dyn DmaMapper> {
        match (&self.adopted, &self.ioas) {
            (Some(_), Some((iommufd, ioas_id))) => Arc::new(IoasMapper {
                iommufd: iommufd.clone(),
                ioas_id: *ioas_id,
            }),
            _ => Arc::new(OpsMapper {
                ops: self.ops.clone(),
                api: self.api,
                handed_over: self.handed_over,
            }),
        }
    }

    /// The mapper for peers' BARs: a type1 container's; an iommufd IOAS cannot map
    /// them (IOMMU_IOAS_MAP pins user pages, and BAR mmaps are VM_PFNMAP without pages
    /// until the kernel maps dma-bufs into an IOAS).
    pub fn peer_mapper(&self) -> std::result::Result<Arc<dyn PeerMapper>, PeerMappingUnsupported> {
        match self.api {
            KernelApi::Container => Ok(Arc::new(OpsMapper {
                ops: self.ops.clone(),
                api: self.api,
                handed_over: self.handed_over,
            })),
            KernelApi::Iommufd => Err(PeerMappingUnsupported {
                context: DmaMapper::name(&OpsMapper {
                    ops: self.ops.clone(),
                    api: self.api,
                    handed_over: self.handed_over,
                }),
                reason: "IOMMU_IOAS_MAP cannot map PFNMAP (BAR) memory on this kernel".into(),
            }),
        }
    }

    /// A context over any `VfioOps` (the tests' fake ioctl layer).
    #[cfg(test)]
    pub(crate) fn with_ops(ops: Arc<dyn VfioOps>, api: KernelApi) -> Self {
        KernelVfio {
            ops,
            api,
            ioas: None,
            adopted: None,
            handed_over: false,
        }
    }
}

impl KernelVfioDevice {
    /// The backend over vfio-ioctls' `device` (host address `bdf`, sysfs directory
    /// `sysfs`), opened through the cdev API or not, its VFIO migration probed.
    fn over(
        device: VfioDevice,
        bdf: &str,
        sysfs: PathBuf,
        cdev: bool,
        mark: Arc<HandOverMark>,
    ) -> Self {
        let device = DeviceFile::Ioctls(std::mem::ManuallyDrop::new(device));
        KernelVfioDevice::with_file(device, bdf, sysfs, cdev, mark)
    }

    /// The backend over `device`, its VFIO migration probed.
    fn with_file(
        device: DeviceFile,
        bdf: &str,
        sysfs: PathBuf,
        cdev: bool,
        mark: Arc<HandOverMark>,
    ) -> Self {
        let migration = KernelMigration::probe(device.migration_ops(), bdf.to_string());
        KernelVfioDevice {
            device,
            name: bdf.to_string(),
            mappings: Vec::new(),
            migration,
            sysfs,
            cdev,
            mark,
        }
    }

    /// A duplicate of the device's file (its cdev), for a live update's new process.
    pub fn hand_over(&self) -> Result<OwnedFd> {
        // SAFETY: the device fd is open for as long as `self.device`; borrowed only to be
        // duplicated.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.device.as_raw_fd()) };
        Ok(fd.try_clone_to_owned()?)
    }

    /// Whether another gpuvm process runs the device (a live update), shared with whoever
    /// hands it over.
    pub fn hand_over_mark(&self) -> Arc<HandOverMark> {
        self.mark.clone()
    }

    /// A duplicate of the device file and the offset of region `index` in it: what a
    /// vfio-user peer is given to map this device's BAR (None if it cannot be mmapped).
    pub fn region_file(&self, index: u32) -> Option<(std::os::fd::OwnedFd, u64)> {
        if self.device.region_flags(index) & REGION_MMAP == 0 {
            return None;
        }
        // SAFETY: the device fd is open for as long as `self.device`; borrowing it only to
        // duplicate it.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.device.as_raw_fd()) };
        let copy = fd.try_clone_to_owned().ok()?;
        Some((copy, self.device.region_offset(index)))
    }
}

/// The device file a [`KernelVfioDevice`] drives.
enum DeviceFile {
    /// Opened by vfio-ioctls. Dropped with the device unless another process runs it now
    /// (its `mark`): vfio-ioctls' drop detaches the device from its IOAS or group.
    Ioctls(std::mem::ManuallyDrop<VfioDevice>),
    /// A type1 group's device file a live update handed over (vfio-ioctls builds no group
    /// device from a descriptor; see [`crate::type1`]).
    HandedOver(crate::type1::HandedOverDevice),
}

impl DeviceFile {
    fn region_flags(&self, index: u32) -> u32 {
        match self {
            DeviceFile::Ioctls(device) => device.get_region_flags(index),
            DeviceFile::HandedOver(device) => device.region_flags(index),
        }
    }

    fn region_offset(&self, index: u32) -> u64 {
        match self {
            DeviceFile::Ioctls(device) => device.get_region_offset(index),
            DeviceFile::HandedOver(device) => device.region_offset(index),
        }
    }

    fn region_size(&self, index: u32) -> u64 {
        match self {
            DeviceFile::Ioctls(device) => device.get_region_size(index),
            DeviceFile::HandedOver(device) => device.region_size(index),
        }
    }

    fn region_read(&self, index: u32, data: &mut [u8], offset: u64) -> Result<()> {
        match self {
            DeviceFile::Ioctls(device) => device.region_read(index, data, offset),
            DeviceFile::HandedOver(device) => device.region_read(index, data, offset)?,
        }
        Ok(())
    }

    fn region_write(&self, index: u32, data: &[u8], offset: u64) -> Result<()> {
        match self {
            DeviceFile::Ioctls(device) => device.region_write(index, data, offset),
            DeviceFile::HandedOver(device) => device.region_write(index, data, offset)?,
        }
        Ok(())
    }

    fn irq_count(&self, index: u32) -> Option<u32> {
        match self {
            DeviceFile::Ioctls(device) => device.get_irq_info(index).map(|irq| irq.count),
            DeviceFile::HandedOver(device) => device.irq_count(index),
        }
    }

    fn enable_irq(&self, index: u32, eventfds: &[&EventFd]) -> Result<()> {
        match self {
            DeviceFile::Ioctls(device) => device
                .enable_irq(index, eventfds.to_vec())
                .map_err(interrupt_error),
            DeviceFile::HandedOver(device) => device
                .enable_irq(index, eventfds)
                .map_err(VfioError::Interrupts),
        }
    }

    fn disable_irq(&self, index: u32) -> Result<()> {
        match self {
            DeviceFile::Ioctls(device) => device.disable_irq(index).map_err(interrupt_error),
            DeviceFile::HandedOver(device) => {
                device.disable_irq(index).map_err(VfioError::Interrupts)
            }
        }
    }

    fn unmask_irq(&self, index: u32) -> Result<()> {
        match self {
            DeviceFile::Ioctls(device) => device.unmask_irq(index).map_err(interrupt_error),
            DeviceFile::HandedOver(device) => {
                device.unmask_irq(index).map_err(VfioError::Interrupts)
            }
        }
    }

    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            DeviceFile::Ioctls(device) => device.as_raw_fd(),
            DeviceFile::HandedOver(device) => device.as_raw_fd(),
        }
    }

    fn migration_ops(&self) -> &dyn crate::migration::MigrationOps {
        match self {
            DeviceFile::Ioctls(device) => &**device,
            DeviceFile::HandedOver(device) => device,
        }
    }
}

/// A device opened through kernel VFIO.
pub struct KernelVfioDevice {
    device: DeviceFile,
    name: String,
    /// (address, length) of BAR mmaps, unmapped on drop.
    mappings: Vec<(usize, usize)>,
    /// VFIO migration v2 (vfio-ioctls' VFIO_DEVICE_FEATURE calls on the device).
    migration: KernelMigration,
    /// The device's sysfs directory (its `reset_method`).
    sysfs: PathBuf,
    /// Opened through the iommufd cdev API (a hot reset then takes no group fds).
    cdev: bool,
    /// Whether a live update's other process runs the device (then it is left alone).
    mark: Arc<HandOverMark>,
}

/// A refused interrupt request (vfio-ioctls' enable/disable/unmask of an IRQ index), as
/// every interrupt call of this backend reports it.
fn interrupt_error(error: vfio_ioctls::VfioError) -> VfioError {
    VfioError::Interrupts(std::io::Error::other(error.to_string()))
}

// SAFETY: the raw addresses in `mappings` are plain numbers owned by this struct.
unsafe impl Send for KernelVfioDevice {}

impl PassthroughDevice for KernelVfioDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn left_running_on_drop(&self) -> bool {
        self.mark.leaves_device_alone()
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let size = self.device.region_size(index);
        (size > 0).then(|| RegionInfo {
            index,
            size,
            flags: self.device.region_flags(index),
            mmap_areas: Vec::new(),
        })
    }

    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<()> {
        self.device.region_read(index, data, offset)
    }

    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.device.region_write(index, data, offset)
    }

    fn mmap_region(&mut self, index: u32, offset: u64, size: u64) -> Result<Option<*mut u8>> {
        if self.device.region_flags(index) & REGION_MMAP == 0 {
            return Ok(None);
        }
        let file_offset = self.device.region_offset(index) + offset;
        // The kernel validates offset and length against the BAR.
        let address = crate::mmap_shared(self.device.as_raw_fd(), file_offset, size as usize)?;
        self.mappings.push((address as usize, size as usize));
        Ok(Some(address))
    }

    fn msix_vectors(&mut self) -> Result<u32> {
        Ok(self.device.irq_count(VFIO_PCI_MSIX_IRQ_INDEX).unwrap_or(0))
    }

    fn enable_msix(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        self.device.enable_irq(VFIO_PCI_MSIX_IRQ_INDEX, eventfds)
    }

    fn disable_msix(&mut self) -> Result<()> {
        self.device.disable_irq(VFIO_PCI_MSIX_IRQ_INDEX)
    }

    fn enable_msi(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        self.device.enable_irq(VFIO_PCI_MSI_IRQ_INDEX, eventfds)
    }

    fn disable_msi(&mut self) -> Result<()> {
        self.device.disable_irq(VFIO_PCI_MSI_IRQ_INDEX)
    }

    fn intx_supported(&mut self) -> bool {
        self.device
            .irq_count(VFIO_PCI_INTX_IRQ_INDEX)
            .is_some_and(|count| count > 0)
    }

    fn enable_intx(&mut self, trigger: &EventFd) -> Result<()> {
        self.device.enable_irq(VFIO_PCI_INTX_IRQ_INDEX, &[trigger])
    }

    fn disable_intx(&mut self) -> Result<()> {
        self.device.disable_irq(VFIO_PCI_INTX_IRQ_INDEX)
    }

    fn unmask_intx(&mut self) -> Result<()> {
        self.device.unmask_irq(VFIO_PCI_INTX_IRQ_INDEX)
    }

    /// Guest RAM is mapped once per IOMMU context with [`KernelVfio::dma_mapper`], not per
    /// device.
    fn dma_map(&mut self, _region: &DmaRegion) -> Result<()> {
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        let ioctls = ResetIoctls {
            device: &self.device,
            sysfs: &self.sysfs,
            cdev: self.cdev,
        };
        crate::reset::reset_kernel_device(&self.name, &ioctls)?;
        self.migration.reset();
        Ok(())
    }

    fn migration(&mut self) -> Option<MigrationInfo> {
        self.migration.info()
    }

    fn set_migration_state(&mut self, state: MigrationState) -> Result<()> {
        self.migration.set_state(self.device.migration_ops(), state)
    }

    fn read_migration_data(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.migration.read(self.device.migration_ops(), buf)
    }

    fn write_migration_data(&mut self, data: &[u8]) -> Result<()> {
        self.migration.write(self.device.migration_ops(), data)
    }
}

/// `_IO(VFIO_TYPE, VFIO_BASE + nr)` (linux/vfio.h).
pub(crate) const fn vfio_io(nr: u32) -> libc::c_ulong {
    ((b';' as libc::c_ulong) << 8) | (100 + nr) as libc::c_ulong
}
const VFIO_DEVICE_GET_INFO: libc::c_ulong = vfio_io(7);
const VFIO_DEVICE_RESET: libc::c_ulong = vfio_io(11);
const VFIO_DEVICE_GET_PCI_HOT_RESET_INFO: libc::c_ulong = vfio_io(12);
const VFIO_DEVICE_PCI_HOT_RESET: libc::c_ulong = vfio_io(13);

/// The reset ioctls on one opened device; [`crate::reset`] picks the method.
struct ResetIoctls<'a> {
    device: &'a DeviceFile,
    sysfs: &'a Path,
    cdev: bool,
}

impl ResetIoctls<'_> {
    /// An ioctl whose argument is `words`, a VFIO structure that starts with its `argsz`.
    fn ioctl_words(&self, request: libc::c_ulong, words: &mut [u32]) -> std::io::Result<()> {
        words[0] = std::mem::size_of_val(words) as u32;
        // SAFETY: the kernel reads and writes at most `argsz` bytes of the argument, and
        // `argsz` is the buffer's length; the fd is the open device.
        let rc = unsafe { libc::ioctl(self.device.as_raw_fd(), request, words.as_mut_ptr()) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl crate::reset::KernelResetOps for ResetIoctls<'_> {
    fn device_flags(&self) -> std::io::Result<u32> {
        // struct vfio_device_info: argsz, flags, num_regions, num_irqs, cap_offset, pad.
        let mut info = [0u32; 6];
        self.ioctl_words(VFIO_DEVICE_GET_INFO, &mut info)?;
        Ok(info[1])
    }

    fn function_reset(&self) -> std::io::Result<()> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument; the fd is the open device.
        let rc = unsafe { libc::ioctl(self.device.as_raw_fd(), VFIO_DEVICE_RESET) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn hot_reset_info(&self) -> std::io::Result<crate::reset::HotResetInfo> {
        // struct vfio_pci_hot_reset_info: argsz, flags, count, then 8-byte entries; asked
        // once for the count (ENOSPC), then with room for every entry.
        let mut header = [0u32; 3];
        let count = match self.ioctl_words(VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, &mut header) {
            Ok(()) => header[2],
            Err(error) if error.raw_os_error() == Some(libc::ENOSPC) => header[2],
            Err(error) => return Err(error),
        };
        let mut words = vec![0u32; 3 + 2 * count as usize];
        self.ioctl_words(VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, &mut words)?;
        let returned = (words[2] as usize).min(count as usize);
        let devices = words[3..3 + 2 * returned]
            .chunks_exact(2)
            .map(|entry| crate::reset::Dependent {
                group_or_devid: entry[0],
                segment: entry[1] as u16,
                bus: (entry[1] >> 16) as u8,
                devfn: (entry[1] >> 24) as u8,
            })
            .collect();
        Ok(crate::reset::HotResetInfo {
            flags: words[1],
            devices,
        })
    }

    fn hot_reset(&self, group_fds: &[std::os::fd::RawFd]) -> std::io::Result<()> {
        // struct vfio_pci_hot_reset: argsz, flags, count, then the group fds.
        let mut words = vec![0u32; 3 + group_fds.len()];
        words[2] = group_fds.len() as u32;
        for (slot, fd) in words[3..].iter_mut().zip(group_fds) {
            *slot = *fd as u32;
        }
        self.ioctl_words(VFIO_DEVICE_PCI_HOT_RESET, &mut words)
    }

    fn read_ids(&self) -> std::io::Result<u32> {
        let offset = self.device.region_offset(crate::region::CONFIG);
        let mut ids = [0u8; 4];
        // SAFETY: a read into a 4-byte buffer we own, from the open device fd.
        let read = unsafe {
            libc::pread(
                self.device.as_raw_fd(),
                ids.as_mut_ptr().cast(),
                ids.len(),
                offset as libc::off_t,
            )
        };
        if read != ids.len() as isize {
            return Err(if read < 0 {
                std::io::Error::last_os_error()
            } else {
                std::io::Error::other(format!("short config space read ({read} bytes)"))
            });
        }
        Ok(u32::from_le_bytes(ids))
    }

    fn kernel_reset_method(&self) -> Option<String> {
        crate::sysfs::read_text(&self.sysfs.join("reset_method"))
            .ok()?
            .split_whitespace()
            .next()
            .map(str::to_string)
    }

    fn group_fd(&self, group: u32) -> Option<std::os::fd::RawFd> {
        // vfio-ioctls keeps its group files to itself; they are among this process's fds.
        crate::type1::open_group_fd(group)
    }

    fn cdev(&self) -> bool {
        self.cdev
    }
}

impl Drop for KernelVfioDevice {
    fn drop(&mut self) {
        for &(address, len) in &self.mappings {
            // SAFETY: each mapping was created by mmap_region with this length.
            unsafe { libc::munmap(address as *mut libc::c_void, len) };
        }
        if let DeviceFile::Ioctls(device) = &mut self.device {
            if !self.mark.leaves_device_alone() {
                // SAFETY: dropped once, here, and never used again.
                unsafe { std::mem::ManuallyDrop::drop(device) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::dma::tests::{ram, Overlap};
    use crate::dma::{plan_chunks, BackgroundMapping, DmaProgress, MapOptions};

    /// The fake ioctl layer: records VFIO_IOMMU_MAP_DMA / IOMMU_IOAS_MAP calls as vfio-ioctls
    /// would issue them, how many ran at once, and fails the one at `fail_iova`.
    #[derive(Default)]
    struct FakeOps {
        calls: Mutex<Vec<(u64, usize, u64)>>,
        fail_iova: Option<u64>,
        delay: Duration,
        overlap: Overlap,
    }

    impl VfioOps for FakeOps {
        unsafe fn vfio_dma_map(
            &self,
            iova: u64,
            size: usize,
            user_addr: *mut u8,
        ) -> vfio_ioctls::Result<()> {
            self.overlap.call(self.delay);
            if Some(iova) == self.fail_iova {
                return Err(vfio_ioctls::VfioError::IommuDmaMap(
                    vmm_sys_util::errno::Error::new(libc::ENOMEM),
                ));
            }
            self.calls
                .lock()
                .unwrap()
                .push((iova, size, user_addr as u64));
            Ok(())
        }

        fn vfio_dma_unmap(&self, iova: u64, size: usize) -> vfio_ioctls::Result<()> {
            let mut calls = self.calls.lock().unwrap();
            let before = calls.len();
            calls.retain(|&(at, len, _)| (at, len) != (iova, size));
            if calls.len() == before {
                return Err(vfio_ioctls::VfioError::InvalidDmaUnmapSize);
            }
            Ok(())
        }
    }

    /// type1 maps a peer's BAR from the host address of its mmap, and unmaps it at the
    /// same IOVA; iommufd cannot, and says why.
    #[test]
    fn type1_maps_peer_bars_and_iommufd_refuses() {
        let fake = Arc::new(FakeOps::default());
        let vfio = KernelVfio::with_ops(fake.clone(), KernelApi::Container);
        let mapper = vfio.peer_mapper().expect("type1 maps peers");
        let window = DmaRegion {
            guest_addr: 0x1_2000_0000,
            size: 256 << 20,
            host_addr: 0x7f55_0000_0000,
            fd: -1,
            fd_offset: 0,
        };
        // SAFETY: the fake layer only records the call.
        unsafe { mapper.map_peer(&window) }.unwrap();
        assert_eq!(
            *fake.calls.lock().unwrap(),
            [(0x1_2000_0000, 256 << 20, 0x7f55_0000_0000)]
        );
        mapper.unmap_peer(0x1_2000_0000, 256 << 20).unwrap();
        assert!(fake.calls.lock().unwrap().is_empty());
        assert!(mapper.unmap_peer(0x1_2000_0000, 256 << 20).is_err());

        let vfio = KernelVfio::with_ops(Arc::new(FakeOps::default()), KernelApi::Iommufd);
        let refused = vfio.peer_mapper().err().expect("iommufd cannot");
        assert!(refused.to_string().contains("iommufd"), "{refused}");
        assert!(refused.to_string().contains("PFNMAP"), "{refused}");
    }

    /// Maps `ram()` in the background through a context over `ops`, as vmm/src/pci.rs does.
    fn map_in_background(ops: Arc<FakeOps>, api: KernelApi) -> crate::dma::DmaStatus {
        let vfio = KernelVfio::with_ops(ops, api);
        let chunks = plan_chunks(&ram(), 1 << 30, 2 << 20);
        let total = chunks.iter().map(|c| c.size).sum();
        let progress = DmaProgress::new("kernel", total);
        let mapping = BackgroundMapping::start(
            progress.clone(),
            vfio.dma_mapper(),
            chunks,
            MapOptions::default(),
        )
        .unwrap();
        // The caller goes on at once; the gate opens when the map is done.
        let _ = progress.wait(Duration::from_secs(60));
        mapping.join()
    }

    #[test]
    fn all_ram_is_mapped_once_in_aligned_chunks_in_the_background() {
        let fake = Arc::new(FakeOps::default());
        let status = map_in_background(fake.clone(), KernelApi::Container);
        assert!(status.done, "{status:?}");
        assert_eq!(status.mapped_bytes, (8 << 30) + (6 << 20));
        let calls = fake.calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 9);
        // Contiguous per region, in order, host addresses follow the IOVAs.
        let mut expected_next = [0u64, 4 << 30];
        for (iova, size, host) in &calls {
            assert_eq!(iova % (2 << 20), 0, "chunk start aligned to the huge page");
            assert!(*size <= 1 << 30);
            let region = usize::from(*iova >= 4 << 30);
            assert_eq!(*iova, expected_next[region]);
            expected_next[region] += *size as u64;
            let base = ram()[region];
            assert_eq!(*host, base.host_addr + (iova - base.guest_addr));
        }
        assert_eq!(expected_next, [3 << 30, (9 << 30) + (6 << 20)]);
    }

    /// type1 serializes under the container lock: one map at a time. iommufd pins under
    /// read locks: several at once.
    #[test]
    fn type1_maps_one_chunk_at_a_time_and_iommufd_in_parallel() {
        let slow = || {
            Arc::new(FakeOps {
                delay: Duration::from_millis(20),
                ..Default::default()
            })
        };
        let type1 = slow();
        let status = map_in_background(type1.clone(), KernelApi::Container);
        assert_eq!(status.parallel, 1);
        assert_eq!(type1.overlap.most(), 1);

        let vfio = KernelVfio::with_ops(slow(), KernelApi::Iommufd);
        let parallel = vfio.dma_mapper().max_parallel();
        assert_eq!(
            parallel,
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(IOMMUFD_MAX_PARALLEL)
        );
        let iommufd = slow();
        let status = map_in_background(iommufd.clone(), KernelApi::Iommufd);
        assert!(status.done);
        assert_eq!(status.parallel, parallel);
        if parallel > 1 {
            assert!(iommufd.overlap.most() > 1);
        }
        assert_eq!(iommufd.calls.lock().unwrap().len(), 9);
    }

    #[test]
    fn a_failed_map_is_reported() {
        let fake = Arc::new(FakeOps {
            fail_iova: Some(4 << 30),
            ..Default::default()
        });
        let status = map_in_background(fake.clone(), KernelApi::Container);
        let error = status.error.expect("failed");
        assert!(error.contains("DMA-mapping guest RAM"), "{error}");
        assert!(!status.done);
        assert!(fake
            .calls
            .lock()
            .unwrap()
            .iter()
            .all(|(iova, _, _)| *iova < 4 << 30));
    }

    #[test]
    fn opening_a_missing_device_is_a_clear_error() {
        let error = KernelVfio::open("0000:ff:1f.7", None)
            .err()
            .expect("no such device");
        assert!(
            error.to_string().contains("no PCI device 0000:ff:1f.7"),
            "{error}"
        );
        let error = KernelVfio::open("gpu0", None).err().expect("bad address");
        assert!(error.to_string().contains("not a PCI address"), "{error}");
    }
}
