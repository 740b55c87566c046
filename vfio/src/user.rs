//! The vfio-user backend: gpuvm is the client, the device runs in another process and
//! DMAs into guest RAM through the memfd it receives with each mapping.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX,
};
use vfio_user::Client;
use vmm_sys_util::eventfd::EventFd;

use crate::dma::DmaMapper;
use crate::{DmaRegion, PassthroughDevice, RegionInfo, Result, VfioError};

/// A device behind a vfio-user socket. The client is shared with the device's
/// [`UserDmaMapper`], which maps guest RAM from its own thread while vCPUs use the device.
pub struct VfioUserDevice {
    client: Arc<Mutex<Client>>,
    path: PathBuf,
}

fn lock(client: &Mutex<Client>) -> MutexGuard<'_, Client> {
    client.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends guest RAM to the device process (DMA_MAP with the RAM memfd), one request at a
/// time: they share the device's socket.
pub struct UserDmaMapper {
    client: Arc<Mutex<Client>>,
    name: String,
}

impl DmaMapper for UserDmaMapper {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn max_parallel(&self) -> usize {
        1
    }

    unsafe fn map(&self, chunk: &DmaRegion) -> std::io::Result<()> {
        lock(&self.client)
            .dma_map(chunk.fd_offset, chunk.guest_addr, chunk.size, chunk.fd)
            .map_err(|e| std::io::Error::other(format!("vfio-user DMA map: {e}")))
    }
}

impl VfioUserDevice {
    /// Connects and negotiates; the server must already be listening.
    pub fn connect(path: &Path) -> Result<Self> {
        let client = Client::new(path).map_err(|source| VfioError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        log::info!("vfio-user: connected to {}", path.display());
        Ok(VfioUserDevice {
            client: Arc::new(Mutex::new(client)),
            path: path.to_path_buf(),
        })
    }

    /// The mapper for guest RAM ([`crate::dma::BackgroundMapping`]), over this device's
    /// connection.
    pub fn dma_mapper(&self) -> Arc<dyn DmaMapper> {
        Arc::new(UserDmaMapper {
            client: self.client.clone(),
            name: self.name(),
        })
    }

    fn client(&self) -> MutexGuard<'_, Client> {
        lock(&self.client)
    }

    fn check_range(&self, index: u32, offset: u64, len: usize) -> Result<()> {
        let size = self
            .client()
            .region(index)
            .ok_or(VfioError::NoRegion(index))?
            .size;
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(VfioError::OutOfRange {
                index,
                offset,
                len,
                size,
            });
        }
        Ok(())
    }
}

fn user(what: &'static str) -> impl FnOnce(vfio_user::Error) -> VfioError {
    move |source| VfioError::User { what, source }
}

impl PassthroughDevice for VfioUserDevice {
    fn name(&self) -> String {
        format!("vfio-user:{}", self.path.display())
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let client = self.client();
        let region = client.region(index)?;
        Some(RegionInfo {
            index,
            size: region.size,
            flags: region.flags,
            mmap_areas: region
                .sparse_areas
                .iter()
                .map(|area| (area.offset, area.size))
                .collect(),
        })
    }

    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<()> {
        self.check_range(index, offset, data.len())?;
        self.client()
            .region_read(index, offset, data)
            .map_err(user("region read"))
    }

    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(index, offset, data.len())?;
        self.client()
            .region_write(index, offset, data)
            .map_err(user("region write"))
    }

    /// Regions the server shares a file for (flag MMAP plus an fd) are mmapped; the rest
    /// go over the socket.
    fn mmap_region(&mut self, index: u32, offset: u64, size: u64) -> Result<Option<*mut u8>> {
        let client = self.client();
        let region = client.region(index).ok_or(VfioError::NoRegion(index))?;
        let Some(file) = region
            .file_offset
            .as_ref()
            .filter(|_| region.flags & crate::REGION_MMAP != 0)
        else {
            return Ok(None);
        };
        if offset.checked_add(size).is_none_or(|end| end > region.size) {
            return Err(VfioError::OutOfRange {
                index,
                offset,
                len: size as usize,
                size: region.size,
            });
        }
        // SAFETY: a fresh shared mapping of the region's file; the kernel checks the fd and
        // range. It is never unmapped: it lives as long as the VM's memory slots may use it.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.file().as_raw_fd(),
                (file.start() + offset) as libc::off_t,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(VfioError::Io(std::io::Error::last_os_error()));
        }
        log::info!(
            "{}: region {index} +{offset:#x} ({size:#x} bytes) mmapped",
            self.name()
        );
        Ok(Some(address.cast()))
    }

    fn msix_vectors(&mut self) -> Result<u32> {
        let info = self
            .client()
            .get_irq_info(VFIO_PCI_MSIX_IRQ_INDEX)
            .map_err(user("get MSI-X info"))?;
        Ok(info.count)
    }

    fn enable_msix(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        let fds: Vec<_> = eventfds.iter().map(|fd| fd.as_raw_fd()).collect();
        self.client()
            .set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                fds.len() as u32,
                &fds,
            )
            .map_err(user("set MSI-X eventfds"))
    }

    fn disable_msix(&mut self) -> Result<()> {
        self.client()
            .set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                0,
                &[],
            )
            .map_err(user("disable MSI-X"))
    }

    fn enable_msi(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        let fds: Vec<_> = eventfds.iter().map(|fd| fd.as_raw_fd()).collect();
        self.client()
            .set_irqs(
                VFIO_PCI_MSI_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                fds.len() as u32,
                &fds,
            )
            .map_err(user("set MSI eventfds"))
    }

    fn disable_msi(&mut self) -> Result<()> {
        self.client()
            .set_irqs(
                VFIO_PCI_MSI_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                0,
                &[],
            )
            .map_err(user("disable MSI"))
    }

    fn intx_supported(&mut self) -> bool {
        self.client()
            .get_irq_info(VFIO_PCI_INTX_IRQ_INDEX)
            .is_ok_and(|info| info.count > 0)
    }

    fn enable_intx(&mut self, trigger: &EventFd) -> Result<()> {
        self.client()
            .set_irqs(
                VFIO_PCI_INTX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                1,
                &[trigger.as_raw_fd()],
            )
            .map_err(user("set the INTx eventfd"))
    }

    fn disable_intx(&mut self) -> Result<()> {
        self.client()
            .set_irqs(
                VFIO_PCI_INTX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                0,
                &[],
            )
            .map_err(user("disable INTx"))
    }

    fn unmask_intx(&mut self) -> Result<()> {
        self.client()
            .set_irqs(
                VFIO_PCI_INTX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK,
                0,
                1,
                &[],
            )
            .map_err(user("unmask INTx"))
    }

    fn dma_map(&mut self, region: &DmaRegion) -> Result<()> {
        log::info!(
            "vfio-user: DMA map {:#x}+{:#x} (fd offset {:#x})",
            region.guest_addr,
            region.size,
            region.fd_offset
        );
        self.client()
            .dma_map(region.fd_offset, region.guest_addr, region.size, region.fd)
            .map_err(user("DMA map"))
    }

    fn reset(&mut self) -> Result<()> {
        if !self.client().resettable() {
            return Ok(());
        }
        self.client().reset().map_err(user("reset"))
    }
}

impl Drop for VfioUserDevice {
    fn drop(&mut self) {
        if let Err(error) = self.client().shutdown() {
            log::debug!("vfio-user: shutdown of {}: {error}", self.path.display());
        }
    }
}
