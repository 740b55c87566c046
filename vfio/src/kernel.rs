//! The kernel VFIO backend (vfio-ioctls): devices opened through the iommufd cdev API where
//! the host has /dev/iommu and the device a vfio-dev node, else through the container/group
//! API; all guest RAM DMA-mapped once at boot, in parallel, hugepage-aligned chunks.
//!
//! DMA mapping goes through [`DmaMapper`], which the real backend implements with
//! VFIO_IOMMU_MAP_DMA / IOMMU_IOAS_MAP and tests implement with a fake.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::{VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX};
/// The handle on a VM's KVM VFIO pseudo-device that [`KernelVfio::open`] takes.
pub use vfio_ioctls::VfioDeviceFd;
use vfio_ioctls::{VfioContainer, VfioDevice, VfioIommufd, VfioOps};
use vmm_sys_util::eventfd::EventFd;

use crate::host::normalize_bdf;
use crate::{DmaRegion, PassthroughDevice, RegionInfo, Result, VfioError, REGION_MMAP};

/// Maps host memory into the IOMMU address space shared by the VM's devices.
pub trait DmaMapper: Send + Sync {
    /// Maps `[host_addr, host_addr + size)` at I/O virtual address `iova`.
    ///
    /// # Safety
    /// The host range must stay mapped (and never be referenced as Rust data the device
    /// could race with) for as long as the IOMMU mapping exists.
    unsafe fn map(&self, iova: u64, size: u64, host_addr: u64) -> std::io::Result<()>;
}

/// How a DMA mapping of guest RAM went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaStats {
    pub bytes: u64,
    pub chunks: usize,
    pub threads: usize,
    pub elapsed: Duration,
}

/// Splits `regions` into chunks of at most `chunk` bytes whose boundaries are multiples of
/// `align` (the RAM page size, so a huge page is never split across two mappings).
pub fn plan_chunks(regions: &[DmaRegion], chunk: u64, align: u64) -> Vec<(u64, u64, u64)> {
    let align = align.max(4096);
    let chunk = chunk.max(align) / align * align;
    let mut chunks = Vec::new();
    for region in regions {
        let mut offset = 0;
        while offset < region.size {
            let len = chunk.min(region.size - offset);
            chunks.push((region.guest_addr + offset, len, region.host_addr + offset));
            offset += len;
        }
    }
    chunks
}

/// Maps every RAM region with `threads` threads; logs progress every ~10% and the total.
/// The first failure stops the remaining work and is returned.
pub fn map_guest_ram(
    mapper: &dyn DmaMapper,
    regions: &[DmaRegion],
    chunk: u64,
    align: u64,
    threads: usize,
) -> Result<DmaStats> {
    let started = Instant::now();
    let chunks = plan_chunks(regions, chunk, align);
    let total: u64 = chunks.iter().map(|c| c.1).sum();
    let threads = threads.clamp(1, chunks.len().max(1));
    let next = AtomicUsize::new(0);
    let mapped = AtomicU64::new(0);
    let reported_decile = AtomicU64::new(0);
    let failure: Mutex<Option<std::io::Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                if failure.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                    return;
                }
                let Some(&(iova, size, host)) = chunks.get(next.fetch_add(1, Ordering::Relaxed))
                else {
                    return;
                };
                // SAFETY: the chunks lie inside guest RAM mappings that the VM keeps for its
                // whole life, longer than the devices and their IOMMU mappings.
                if let Err(error) = unsafe { mapper.map(iova, size, host) } {
                    *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
                    return;
                }
                let done = mapped.fetch_add(size, Ordering::Relaxed) + size;
                let decile = done * 10 / total.max(1);
                if reported_decile.fetch_max(decile, Ordering::Relaxed) < decile {
                    log::info!(
                        "DMA map: {} of {} MiB ({}%) in {:?}",
                        done >> 20,
                        total >> 20,
                        decile * 10,
                        started.elapsed()
                    );
                }
            });
        }
    });
    if let Some(error) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(VfioError::Io(std::io::Error::new(
            error.kind(),
            format!("DMA-mapping guest RAM: {error}"),
        )));
    }
    let stats = DmaStats {
        bytes: total,
        chunks: chunks.len(),
        threads,
        elapsed: started.elapsed(),
    };
    log::info!(
        "DMA-mapped {} MiB of guest RAM in {} chunks with {} threads in {:?}",
        stats.bytes >> 20,
        stats.chunks,
        stats.threads,
        stats.elapsed
    );
    Ok(stats)
}

/// Which kernel interface the devices were opened through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelApi {
    Iommufd,
    Container,
}

/// The IOMMU context shared by all of a VM's kernel VFIO devices.
pub struct KernelVfio {
    ops: Arc<dyn VfioOps>,
    api: KernelApi,
}

struct OpsMapper(Arc<dyn VfioOps>);

impl DmaMapper for OpsMapper {
    unsafe fn map(&self, iova: u64, size: u64, host_addr: u64) -> std::io::Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.0
                .vfio_dma_map(iova, size as usize, host_addr as *mut u8)
        }
        .map_err(|e| std::io::Error::other(e.to_string()))
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
            return Ok(KernelVfio {
                ops: Arc::new(ops),
                api: KernelApi::Iommufd,
            });
        }
        let container = VfioContainer::new(kvm_vfio)
            .map_err(|e| std::io::Error::other(format!("open /dev/vfio/vfio: {e}")))?;
        log::info!("kernel VFIO: container/group API");
        Ok(KernelVfio {
            ops: Arc::new(container),
            api: KernelApi::Container,
        })
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
        Ok(KernelVfioDevice {
            device,
            name: bdf.to_string(),
            mappings: Vec::new(),
        })
    }

    /// The mapper for [`map_guest_ram`]; mappings cover every device of this context.
    pub fn mapper(&self) -> impl DmaMapper {
        OpsMapper(self.ops.clone())
    }
}

/// A device opened through kernel VFIO.
pub struct KernelVfioDevice {
    device: VfioDevice,
    name: String,
    /// (address, length) of BAR mmaps, unmapped on drop.
    mappings: Vec<(usize, usize)>,
}

// SAFETY: the raw addresses in `mappings` are plain numbers owned by this struct.
unsafe impl Send for KernelVfioDevice {}

impl PassthroughDevice for KernelVfioDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let size = self.device.get_region_size(index);
        (size > 0).then(|| RegionInfo {
            index,
            size,
            flags: self.device.get_region_flags(index),
            mmap_areas: Vec::new(),
        })
    }

    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<()> {
        self.device.region_read(index, data, offset);
        Ok(())
    }

    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.device.region_write(index, data, offset);
        Ok(())
    }

    fn mmap_region(&mut self, index: u32, offset: u64, size: u64) -> Result<Option<*mut u8>> {
        if self.device.get_region_flags(index) & REGION_MMAP == 0 {
            return Ok(None);
        }
        let file_offset = self.device.get_region_offset(index) + offset;
        // SAFETY: a fresh shared mapping of the device fd at the region's offset; the
        // kernel validates offset and length against the BAR.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.device.as_raw_fd(),
                file_offset as libc::off_t,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(VfioError::Io(std::io::Error::last_os_error()));
        }
        self.mappings.push((address as usize, size as usize));
        Ok(Some(address.cast()))
    }

    fn msix_vectors(&mut self) -> Result<u32> {
        Ok(self
            .device
            .get_irq_info(VFIO_PCI_MSIX_IRQ_INDEX)
            .map_or(0, |irq| irq.count))
    }

    fn enable_msix(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        self.device
            .enable_msix(eventfds.to_vec())
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    fn disable_msix(&mut self) -> Result<()> {
        self.device
            .disable_msix()
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    fn enable_msi(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        self.device
            .enable_msi(eventfds.to_vec())
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    fn disable_msi(&mut self) -> Result<()> {
        self.device
            .disable_msi()
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    fn intx_supported(&mut self) -> bool {
        self.device
            .get_irq_info(VFIO_PCI_INTX_IRQ_INDEX)
            .is_some_and(|irq| irq.count > 0)
    }

    fn enable_intx(&mut self, trigger: &EventFd) -> Result<()> {
        self.device
            .enable_irq(VFIO_PCI_INTX_IRQ_INDEX, vec![trigger])
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    fn disable_intx(&mut self) -> Result<()> {
        self.device
            .disable_irq(VFIO_PCI_INTX_IRQ_INDEX)
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    fn unmask_intx(&mut self) -> Result<()> {
        self.device
            .unmask_irq(VFIO_PCI_INTX_IRQ_INDEX)
            .map_err(|e| VfioError::Interrupts(std::io::Error::other(e.to_string())))
    }

    /// Guest RAM is mapped once per IOMMU context with [`map_guest_ram`], not per device.
    fn dma_map(&mut self, _region: &DmaRegion) -> Result<()> {
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.device.reset();
        Ok(())
    }
}

impl Drop for KernelVfioDevice {
    fn drop(&mut self) {
        for &(address, len) in &self.mappings {
            // SAFETY: each mapping was created by mmap_region with this length.
            unsafe { libc::munmap(address as *mut libc::c_void, len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records every map call; fails the call at `fail_at` if set.
    #[derive(Default)]
    struct FakeIommu {
        calls: Mutex<Vec<(u64, u64, u64)>>,
        fail_iova: Option<u64>,
    }

    impl DmaMapper for FakeIommu {
        unsafe fn map(&self, iova: u64, size: u64, host_addr: u64) -> std::io::Result<()> {
            if Some(iova) == self.fail_iova {
                return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
            }
            self.calls.lock().unwrap().push((iova, size, host_addr));
            Ok(())
        }
    }

    fn ram() -> Vec<DmaRegion> {
        vec![
            DmaRegion {
                guest_addr: 0,
                size: 3 << 30,
                host_addr: 0x7f00_0000_0000,
                fd: -1,
                fd_offset: 0,
            },
            DmaRegion {
                guest_addr: 4 << 30,
                size: (5 << 30) + (6 << 20),
                host_addr: 0x7f10_0000_0000,
                fd: -1,
                fd_offset: 3 << 30,
            },
        ]
    }

    #[test]
    fn all_ram_is_mapped_once_in_aligned_chunks() {
        let fake = FakeIommu::default();
        let stats = map_guest_ram(&fake, &ram(), 1 << 30, 2 << 20, 4).unwrap();
        let mut calls = fake.calls.into_inner().unwrap();
        calls.sort();
        assert_eq!(stats.bytes, (8 << 30) + (6 << 20));
        assert_eq!(stats.chunks, calls.len());
        assert_eq!(stats.threads, 4);
        // Contiguous per region, no overlap, host addresses follow the IOVAs.
        let mut expected_next = [0u64, 4 << 30];
        for (iova, size, host) in &calls {
            assert_eq!(iova % (2 << 20), 0, "chunk start aligned to the huge page");
            assert!(*size <= 1 << 30);
            let region = usize::from(*iova >= 4 << 30);
            assert_eq!(*iova, expected_next[region]);
            expected_next[region] += size;
            let base = ram()[region];
            assert_eq!(*host, base.host_addr + (iova - base.guest_addr));
        }
        assert_eq!(expected_next, [3 << 30, (9 << 30) + (6 << 20)]);
    }

    #[test]
    fn chunk_size_rounds_to_the_page_size() {
        let chunks = plan_chunks(&ram()[..1], (1 << 30) + 12345, 1 << 30);
        assert!(chunks.iter().all(|c| c.1 == 1 << 30));
        assert_eq!(chunks.len(), 3);
    }

    #[test]
    fn a_failed_map_is_reported() {
        let fake = FakeIommu {
            fail_iova: Some(4 << 30),
            ..Default::default()
        };
        let error = map_guest_ram(&fake, &ram(), 1 << 30, 2 << 20, 2).unwrap_err();
        assert!(
            error.to_string().contains("DMA-mapping guest RAM"),
            "{error}"
        );
        assert!(fake
            .calls
            .lock()
            .unwrap()
            .iter()
            .all(|(iova, _, _)| *iova != 4 << 30));
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
