//! An emulated NVIDIA-like GPU served over vfio-user, for testing passthrough without
//! hardware: vendor 0x10de, device 0x2330 (H100-like), BAR0 16 MiB of registers, BAR1
//! 64-bit prefetchable memory (256 MiB by default), BAR3 64-bit prefetchable 32 MiB,
//! MSI-X, and a DMA engine.
//!
//! The DMA engine: the guest writes a guest-physical address, a length and a seed to BAR0,
//! then a vector number to the doorbell. The device writes `pattern(seed, a)` (splitmix64
//! of seed + a) to every 8-byte word at guest-physical `a` in the range, through the guest
//! RAM memfd it received with the DMA map, then signals that MSI-X vector; with neither
//! MSI nor MSI-X enabled it asserts its INTA line instead (level-triggered, as vfio-pci
//! presents it: the line masks itself when it fires and fires again on unmask while the
//! guest has not acknowledged it through `INTX_ACK`).

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;

use vfio_bindings::bindings::vfio::{
    vfio_region_info, vfio_region_sparse_mmap_area, VFIO_IRQ_INFO_EVENTFD,
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX,
    VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{
    DmaMapFlags, DmaUnmapFlags, IrqInfo, Server, ServerBackend, ServerRegion, SparseArea,
};

/// BAR0 register offsets.
pub mod regs {
    /// Read-only chip identification.
    pub const BOOT_0: u64 = 0x0;
    pub const BOOT_0_VALUE: u32 = 0x1a00_00a1;
    /// 64 read/write scratch dwords.
    pub const SCRATCH: u64 = 0x100;
    pub const SCRATCH_LEN: u64 = 0x100;
    pub const DMA_ADDR_LO: u64 = 0x1000;
    pub const DMA_ADDR_HI: u64 = 0x1004;
    pub const DMA_LEN: u64 = 0x1008;
    pub const DMA_SEED: u64 = 0x100c;
    /// Write a vector number: run the DMA, then raise that MSI-X vector.
    pub const DOORBELL: u64 = 0x1010;
    /// Completed DMA count.
    pub const DMA_DONE: u64 = 0x1014;
    /// 0: last DMA succeeded, 1: its range is not DMA-mapped, 2: bad length, 3: Bus
    /// Master is off in the command register (nothing written).
    pub const DMA_STATUS: u64 = 0x1018;
    /// Read: wrapping sum of the 512 u64 words of BAR1's first page (the guest checks that
    /// writes through its direct BAR1 mapping reached the device).
    pub const BAR1_CHECKSUM: u64 = 0x1020;
    /// Read: how many BAR1 accesses came over the socket (0 when the client mapped BAR1
    /// into the guest and the guest's accesses went straight to memory).
    pub const BAR1_SOCKET_ACCESSES: u64 = 0x1028;
    /// Write: deassert INTx (the guest's interrupt handler acknowledges the device).
    pub const INTX_ACK: u64 = 0x1030;
    /// Read: how many times INTx was signalled (each assertion and each re-assertion).
    pub const INTX_COUNT: u64 = 0x1034;
    pub const MSIX_TABLE: u64 = 0x80_0000;
    pub const MSIX_PBA: u64 = 0x80_1000;
}

pub const VENDOR_ID: u16 = 0x10de;
pub const DEVICE_ID: u16 = 0x2330;
pub const BAR0_SIZE: u64 = 16 << 20;
const MSI_CAP_OFFSET: usize = 0x50;
const MSIX_CAP_OFFSET: usize = 0x60;
const CONFIG_SIZE: usize = 4096;
/// Status register (byte 6) bit: INTx asserted.
const STATUS_INTERRUPT: u8 = 1 << 3;
/// Command register low byte (byte 4) bit: Bus Master.
const COMMAND_BUS_MASTER: u8 = 1 << 2;
/// Command register high byte (byte 5) bit: INTx disabled.
const COMMAND_INTX_DISABLE: u8 = 1 << 2;

/// Shape of the emulated device.
#[derive(Clone, Copy, Debug)]
pub struct EmuGpuOptions {
    /// The PCI device id ([`DEVICE_ID`] unless a test needs another model).
    pub device_id: u16,
    pub bar1_size: u64,
    pub bar3_size: u64,
    pub msix_vectors: u16,
}

impl Default for EmuGpuOptions {
    fn default() -> Self {
        EmuGpuOptions {
            device_id: DEVICE_ID,
            bar1_size: 256 << 20,
            bar3_size: 32 << 20,
            msix_vectors: 4,
        }
    }
}

/// splitmix64(seed + addr): the value the DMA engine writes at guest-physical `addr`.
pub fn pattern(seed: u64, addr: u64) -> u64 {
    let mut z = seed.wrapping_add(addr).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct DmaMapping {
    guest_addr: u64,
    size: u64,
    host: *mut u8,
}

/// The device model behind the vfio-user server.
pub struct EmuGpu {
    options: EmuGpuOptions,
    config: Vec<u8>,
    bar0: HashMap<u64, u32>,
    /// Sparse BAR1/BAR3 memory: (region, page) -> page bytes.
    memory: HashMap<(u32, u64), Box<[u8; 4096]>>,
    dma: Vec<DmaMapping>,
    msix: Vec<Option<File>>,
    /// The MSI eventfd while the client has MSI enabled (the doorbell then signals it).
    msi: Option<File>,
    /// The INTx eventfd while the client has INTx on.
    intx: Option<File>,
    /// The line is asserted (until INTX_ACK).
    intx_pending: bool,
    /// Fired and not yet unmasked by the client.
    intx_masked: bool,
    intx_count: u32,
    /// BAR1 memory, shared with the client (it mmaps BAR1 into the guest).
    bar1: File,
    bar1_socket_accesses: u32,
}

// SAFETY: the raw pointers are private MAP_SHARED mappings owned by this struct (unmapped
// in dma_unmap/drop), used only through &mut self.
unsafe impl Send for EmuGpu {}

impl EmuGpu {
    pub fn new(options: EmuGpuOptions) -> std::io::Result<Self> {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"gpuvm-emu-bar1".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh file descriptor nobody else owns.
        let bar1 = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        bar1.set_len(options.bar1_size)?;
        let mut config = vec![0u8; CONFIG_SIZE];
        config[0..2].copy_from_slice(&VENDOR_ID.to_le_bytes());
        config[2..4].copy_from_slice(&options.device_id.to_le_bytes());
        config[6] = 0x10; // status: capability list
        config[8] = 0xa1; // revision
        config[0x0a] = 0x02; // 3D controller
        config[0x0b] = 0x03; // display controller
                             // BAR type bits: BAR0 32-bit, BAR1 and BAR3 64-bit prefetchable.
        config[0x14] = 0x0c;
        config[0x1c] = 0x0c;
        config[0x2c..0x2e].copy_from_slice(&VENDOR_ID.to_le_bytes());
        config[0x2e..0x30].copy_from_slice(&0x16c1u16.to_le_bytes());
        // Capability list: MSI (64-bit, 1 vector) at 0x50, then MSI-X at 0x60.
        config[0x34] = MSI_CAP_OFFSET as u8;
        config[MSI_CAP_OFFSET] = 0x05;
        config[MSI_CAP_OFFSET + 1] = MSIX_CAP_OFFSET as u8;
        config[MSI_CAP_OFFSET + 2] = 0x80;
        config[0x3d] = 1; // INTA
        let cap = MSIX_CAP_OFFSET;
        config[cap] = 0x11;
        config[cap + 2..cap + 4].copy_from_slice(&(options.msix_vectors - 1).to_le_bytes());
        config[cap + 4..cap + 8].copy_from_slice(&(regs::MSIX_TABLE as u32).to_le_bytes());
        config[cap + 8..cap + 12].copy_from_slice(&(regs::MSIX_PBA as u32).to_le_bytes());
        Ok(EmuGpu {
            options,
            config,
            bar0: HashMap::new(),
            memory: HashMap::new(),
            dma: Vec::new(),
            msix: Vec::new(),
            msi: None,
            intx: None,
            intx_pending: false,
            intx_masked: false,
            intx_count: 0,
            bar1,
            bar1_socket_accesses: 0,
        })
    }

    fn region_size(&self, index: u32) -> u64 {
        match index {
            0 => BAR0_SIZE,
            1 => self.options.bar1_size,
            3 => self.options.bar3_size,
            7 => CONFIG_SIZE as u64,
            _ => 0,
        }
    }

    /// Region descriptions for the vfio-user server (BAR0..5, ROM, config, VGA).
    pub fn regions(&self) -> Vec<ServerRegion> {
        (0..crate::region::COUNT)
            .map(|index| {
                let size = self.region_size(index);
                let mmap = if index == 1 {
                    VFIO_REGION_INFO_FLAG_MMAP
                } else {
                    0
                };
                ServerRegion {
                    region_info: vfio_region_info {
                        argsz: std::mem::size_of::<vfio_region_info>() as u32,
                        flags: if size > 0 {
                            VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE | mmap
                        } else {
                            0
                        },
                        index,
                        cap_offset: 0,
                        size,
                        offset: 0,
                    },
                    // The server sends the fd only with a sparse-mmap capability, so BAR1
                    // lists itself as one area.
                    sparse_areas: if index == 1 {
                        vec![SparseArea {
                            area: vfio_region_sparse_mmap_area { offset: 0, size },
                        }]
                    } else {
                        Vec::new()
                    },
                    mmap_fd: (index == 1).then(|| self.bar1.as_raw_fd()),
                }
            })
            .collect()
    }

    pub fn irqs(&self) -> Vec<IrqInfo> {
        (0..5)
            .map(|index| IrqInfo {
                index,
                flags: VFIO_IRQ_INFO_EVENTFD,
                count: match index {
                    0 | 1 => 1,
                    2 => u32::from(self.options.msix_vectors),
                    _ => 0,
                },
            })
            .collect()
    }

    fn bar1_checksum(&self) -> u64 {
        use std::os::unix::fs::FileExt;
        let mut page = [0u8; 4096];
        if self.bar1.read_exact_at(&mut page, 0).is_err() {
            return 0;
        }
        page.chunks_exact(8).fold(0u64, |sum, word| {
            sum.wrapping_add(u64::from_le_bytes(word.try_into().unwrap_or([0; 8])))
        })
    }

    fn bar0_read(&self, offset: u64) -> u32 {
        match offset {
            regs::BOOT_0 => regs::BOOT_0_VALUE,
            regs::BAR1_CHECKSUM => self.bar1_checksum() as u32,
            regs::BAR1_SOCKET_ACCESSES => self.bar1_socket_accesses,
            regs::INTX_COUNT => self.intx_count,
            o if o == regs::BAR1_CHECKSUM + 4 => (self.bar1_checksum() >> 32) as u32,
            _ => self.bar0.get(&offset).copied().unwrap_or(0),
        }
    }

    fn bar0_write(&mut self, offset: u64, value: u32) {
        match offset {
            regs::DOORBELL => self.ring_doorbell(value),
            regs::INTX_ACK => {
                log::debug!("emu-gpu: INTx ack");
                self.set_intx_pending(false)
            }
            regs::BOOT_0 | regs::DMA_DONE | regs::DMA_STATUS | regs::INTX_COUNT => {}
            _ => {
                self.bar0.insert(offset, value);
            }
        }
    }

    fn ring_doorbell(&mut self, vector: u32) {
        let address = u64::from(self.bar0_read(regs::DMA_ADDR_LO))
            | u64::from(self.bar0_read(regs::DMA_ADDR_HI)) << 32;
        let len = u64::from(self.bar0_read(regs::DMA_LEN));
        let seed = u64::from(self.bar0_read(regs::DMA_SEED));
        // Without Bus Master a device may not touch memory: no DMA (the completion is
        // still signalled, so a guest that forgot it sees status 3 instead of hanging).
        let status = if self.config[4] & COMMAND_BUS_MASTER == 0 {
            3
        } else {
            self.dma_pattern(address, len, seed)
        };
        log::info!("emu-gpu: DMA {len:#x} bytes to {address:#x} seed {seed}: status {status}");
        self.bar0.insert(regs::DMA_STATUS, status);
        let done = self.bar0_read(regs::DMA_DONE).wrapping_add(1);
        self.bar0.insert(regs::DMA_DONE, done);
        if let Some(eventfd) = self.msi.as_mut() {
            if let Err(error) = eventfd.write_all(&1u64.to_le_bytes()) {
                log::warn!("emu-gpu: cannot signal MSI: {error}");
            }
            return;
        }
        if self.msix.is_empty() && self.intx.is_some() {
            return self.set_intx_pending(true);
        }
        match self.msix.get_mut(vector as usize) {
            Some(Some(eventfd)) => {
                if let Err(error) = eventfd.write_all(&1u64.to_le_bytes()) {
                    log::warn!("emu-gpu: cannot signal vector {vector}: {error}");
                }
            }
            _ => log::warn!("emu-gpu: MSI-X vector {vector} has no eventfd"),
        }
    }

    /// Asserts or deasserts INTA. The status register's interrupt bit follows the line;
    /// the Command register's INTx-disable bit keeps it from reaching the eventfd.
    fn set_intx_pending(&mut self, pending: bool) {
        self.intx_pending = pending;
        if pending {
            self.config[6] |= STATUS_INTERRUPT;
        } else {
            self.config[6] &= !STATUS_INTERRUPT;
        }
        self.fire_intx();
    }

    /// Signals INTx if the line is asserted, enabled and not masked; masks it (vfio-pci
    /// does the same, so a level interrupt cannot storm before the guest handles it).
    fn fire_intx(&mut self) {
        let disabled = self.config[5] & COMMAND_INTX_DISABLE != 0;
        if !self.intx_pending || self.intx_masked || disabled {
            return;
        }
        if let Some(eventfd) = self.intx.as_mut() {
            match eventfd.write_all(&1u64.to_le_bytes()) {
                Ok(()) => {
                    log::debug!("emu-gpu: INTx fired");
                    self.intx_masked = true;
                    self.intx_count = self.intx_count.wrapping_add(1);
                }
                Err(error) => log::warn!("emu-gpu: cannot signal INTx: {error}"),
            }
        }
    }

    fn dma_pattern(&mut self, address: u64, len: u64, seed: u64) -> u32 {
        if len == 0 || (len | address) & 7 != 0 {
            return 2;
        }
        let Some(mapping) = self.dma.iter().find(|m| {
            address >= m.guest_addr
                && address
                    .checked_add(len)
                    .is_some_and(|end| end <= m.guest_addr + m.size)
        }) else {
            return 1;
        };
        let start = address - mapping.guest_addr;
        for word in 0..len / 8 {
            let at = start + word * 8;
            // SAFETY: [start, start + len) lies inside the mapping (checked above), and
            // the guest owns the memory's contents: racing with it is the guest's choice.
            unsafe {
                std::ptr::write_volatile(
                    mapping.host.add(at as usize) as *mut u64,
                    pattern(seed, address + word * 8),
                )
            };
        }
        0
    }

    fn memory_access(&mut self, region: u32, offset: u64, read: Option<&mut [u8]>, write: &[u8]) {
        match read {
            Some(data) => {
                for (i, byte) in data.iter_mut().enumerate() {
                    let at = offset + i as u64;
                    *byte = self
                        .memory
                        .get(&(region, at / 4096))
                        .map_or(0, |page| page[(at % 4096) as usize]);
                }
            }
            None => {
                for (i, byte) in write.iter().enumerate() {
                    let at = offset + i as u64;
                    let page = self
                        .memory
                        .entry((region, at / 4096))
                        .or_insert_with(|| Box::new([0; 4096]));
                    page[(at % 4096) as usize] = *byte;
                }
            }
        }
    }
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_string())
}

impl ServerBackend for EmuGpu {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        if offset.saturating_add(data.len() as u64) > self.region_size(region) {
            return Err(invalid("read outside the region"));
        }
        match region {
            0 => {
                let mut bytes = [0u8; 8];
                let base = offset & !3;
                bytes[0..4].copy_from_slice(&self.bar0_read(base).to_le_bytes());
                bytes[4..8].copy_from_slice(&self.bar0_read(base + 4).to_le_bytes());
                let start = (offset - base) as usize;
                for (i, byte) in data.iter_mut().enumerate() {
                    *byte = bytes.get(start + i).copied().unwrap_or(0);
                }
            }
            1 => {
                self.bar1_socket_accesses = self.bar1_socket_accesses.wrapping_add(1);
                std::os::unix::fs::FileExt::read_exact_at(&self.bar1, data, offset)?
            }
            3 => self.memory_access(region, offset, Some(data), &[]),
            7 => data.copy_from_slice(&self.config[offset as usize..offset as usize + data.len()]),
            _ => data.fill(0),
        }
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if offset.saturating_add(data.len() as u64) > self.region_size(region) {
            return Err(invalid("write outside the region"));
        }
        match region {
            0 => {
                // Registers are dwords; narrower writes merge into the dword.
                let base = offset & !3;
                let mut bytes = self.bar0_read(base).to_le_bytes();
                for (i, byte) in data.iter().enumerate().take(4) {
                    if let Some(slot) = bytes.get_mut((offset - base) as usize + i) {
                        *slot = *byte;
                    }
                }
                self.bar0_write(base, u32::from_le_bytes(bytes));
            }
            1 => {
                self.bar1_socket_accesses = self.bar1_socket_accesses.wrapping_add(1);
                std::os::unix::fs::FileExt::write_all_at(&self.bar1, data, offset)?
            }
            3 => self.memory_access(region, offset, None, data),
            // Only the command register is writable; BARs and MSI-X are the VMM's.
            7 if offset < 2 + 4 && offset + data.len() as u64 > 4 => {
                for (i, byte) in data.iter().enumerate() {
                    let at = offset as usize + i;
                    if (4..6).contains(&at) {
                        self.config[at] = *byte;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> std::io::Result<()> {
        let fd = fd.ok_or_else(|| invalid("DMA map without a file descriptor"))?;
        let len = usize::try_from(size).map_err(|_| invalid("DMA map too large"))?;
        // SAFETY: a fresh shared mapping of the client's RAM file; the kernel checks the
        // fd, offset and length.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        log::info!("emu-gpu: DMA map {address:#x}+{size:#x} (file offset {offset:#x})");
        self.dma.push(DmaMapping {
            guest_addr: address,
            size,
            host: host.cast(),
        });
        Ok(())
    }

    fn dma_unmap(&mut self, _flags: DmaUnmapFlags, address: u64, size: u64) -> std::io::Result<()> {
        self.dma.retain(|m| {
            let keep = !(m.guest_addr == address && m.size == size);
            if !keep {
                // SAFETY: the mapping was created by dma_map with this length.
                unsafe { libc::munmap(m.host.cast(), m.size as usize) };
            }
            keep
        });
        Ok(())
    }

    fn reset(&mut self) -> std::io::Result<()> {
        self.bar0.clear();
        self.msix.clear();
        self.msi = None;
        self.intx = None;
        self.intx_pending = false;
        self.intx_masked = false;
        self.config[4] = 0;
        self.config[5] = 0;
        self.config[6] &= !STATUS_INTERRUPT;
        Ok(())
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> std::io::Result<()> {
        if index == VFIO_PCI_INTX_IRQ_INDEX {
            if flags & VFIO_IRQ_SET_ACTION_UNMASK != 0 {
                log::debug!("emu-gpu: INTx unmask (pending {})", self.intx_pending);
                self.intx_masked = false;
                self.fire_intx();
            } else if flags & VFIO_IRQ_SET_ACTION_TRIGGER != 0 {
                self.intx = if flags & VFIO_IRQ_SET_DATA_EVENTFD != 0 && count == 1 {
                    fds.into_iter().next()
                } else {
                    None
                };
                self.intx_masked = false;
                self.fire_intx();
            }
            return Ok(());
        }
        if index == VFIO_PCI_MSI_IRQ_INDEX {
            self.msi = if flags & VFIO_IRQ_SET_DATA_EVENTFD != 0 && count == 1 {
                fds.into_iter().next()
            } else {
                None
            };
            return Ok(());
        }
        if index != VFIO_PCI_MSIX_IRQ_INDEX {
            return Ok(());
        }
        if flags & VFIO_IRQ_SET_DATA_EVENTFD == 0 || count == 0 {
            self.msix.clear();
            return Ok(());
        }
        let end = start as usize + count as usize;
        if end > usize::from(self.options.msix_vectors) || fds.len() != count as usize {
            return Err(invalid("bad MSI-X vector range"));
        }
        if self.msix.len() < end {
            self.msix.resize_with(end, || None);
        }
        for (slot, fd) in self.msix[start as usize..end].iter_mut().zip(fds) {
            *slot = Some(fd);
        }
        log::info!("emu-gpu: MSI-X vectors {start}..{end} armed");
        Ok(())
    }
}

impl Drop for EmuGpu {
    fn drop(&mut self) {
        for mapping in &self.dma {
            // SAFETY: each mapping was created by dma_map with this length.
            unsafe { libc::munmap(mapping.host.cast(), mapping.size as usize) };
        }
    }
}

/// Listens on `socket` and serves one client until it disconnects.
pub fn serve(socket: &Path, options: EmuGpuOptions) -> Result<(), vfio_user::Error> {
    let mut device = EmuGpu::new(options).map_err(vfio_user::Error::Backend)?;
    let server = Server::new(socket, true, device.irqs(), device.regions())?;
    log::info!("emu-gpu: listening on {}", socket.display());
    server.run(&mut device)
}
