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
//!
//! `HOLD` (0x1038) holds doorbells back: while it is non-zero a doorbell queues its job
//! (address, length, seed, vector; at most [`MAX_QUEUED_JOBS`], a further one sets
//! `DMA_STATUS` 4 and is dropped) instead of running it; writing 0 runs the queued jobs
//! in order (DMA, then interrupt). A stopped device (migration states STOP, STOP_COPY,
//! RESUMING) queues doorbells the same way and neither DMAs nor interrupts; the jobs run
//! when it is RUNNING again with `HOLD` 0.
//!
//! Migration: region 9 is a vfio-user migration region laid out as linux/vfio.h's
//! (deprecated, v1) `struct vfio_device_migration_info` followed by a data window (see
//! `user.rs` for the client). The saved state ([`STATE_MAGIC`], version
//! [`STATE_VERSION`]) carries the model (vendor, device id, BAR sizes, vectors), the
//! configuration space, every BAR0 register, the INTx line, the queued jobs and the
//! non-zero 4 KiB pages of BAR1 and BAR3 with their offsets, and ends with an FNV-1a
//! checksum. A blob of another model, truncated, corrupt or with pages outside a BAR is
//! refused (the device reports the error state and [`mig_error`] code in the region's
//! `reserved` field) and the device is left as it was.

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

use crate::migration::MigrationState;

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
    /// Non-zero: doorbells queue their jobs; writing 0 runs the queue in order.
    pub const HOLD: u64 = 0x1038;
    /// Read: how many jobs are queued.
    pub const QUEUED_JOBS: u64 = 0x103c;
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
    /// Serve the migration region (region 9); false makes a device that cannot be
    /// snapshotted.
    pub migration: bool,
    /// Refuse every reset (the server answers it with its error flag): a device whose
    /// reset fails.
    pub reset_fails: bool,
    /// After a reset, configuration space reads all ones: a device that never comes back.
    pub dead_after_reset: bool,
}

impl Default for EmuGpuOptions {
    fn default() -> Self {
        EmuGpuOptions {
            device_id: DEVICE_ID,
            bar1_size: 256 << 20,
            bar3_size: 32 << 20,
            msix_vectors: 4,
            migration: true,
            reset_fails: false,
            dead_after_reset: false,
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
    /// Doorbells held back by HOLD or by a stopped device, oldest first.
    queue: Vec<DmaJob>,
    migration: MigrationRegion,
    /// Reset with [`EmuGpuOptions::dead_after_reset`]: config space reads all ones.
    dead: bool,
}

/// One doorbell's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DmaJob {
    address: u64,
    len: u64,
    seed: u64,
    vector: u32,
}

/// Most doorbells the device queues.
pub const MAX_QUEUED_JOBS: usize = 16;

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
        Ok(EmuGpu {
            options,
            config: EmuGpu::fresh_config(&options),
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
            queue: Vec::new(),
            migration: MigrationRegion::fresh(),
            dead: false,
        })
    }

    /// Configuration space out of reset.
    fn fresh_config(options: &EmuGpuOptions) -> Vec<u8> {
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
        config
    }

    /// Merges the bytes of a configuration write (`data` at `offset`) that fall in the BAR
    /// register at `register` and keeps only the bits a BAR of its size decodes (its type
    /// bits fixed), as hardware does.
    fn write_bar_register(&mut self, register: usize, offset: u64, data: &[u8]) {
        let mut bytes = [0u8; 4];
        bytes.copy_from_slice(&self.config[register..register + 4]);
        for (i, byte) in data.iter().enumerate() {
            let at = offset as usize + i;
            if (register..register + 4).contains(&at) {
                bytes[at - register] = *byte;
            }
        }
        let value = u32::from_le_bytes(bytes);
        // BAR0: 32-bit memory; BAR1 and BAR3: 64-bit prefetchable (low dword, then high);
        // BAR5: none.
        let (size, high, type_bits) = match register {
            0x10 => (BAR0_SIZE, false, 0x0),
            0x14 => (self.options.bar1_size, false, 0xc),
            0x18 => (self.options.bar1_size, true, 0x0),
            0x1c => (self.options.bar3_size, false, 0xc),
            0x20 => (self.options.bar3_size, true, 0x0),
            _ => (0, false, 0x0),
        };
        let decoded = match size {
            0 => 0,
            size => !(size - 1),
        };
        let kept = if high {
            value & (decoded >> 32) as u32
        } else {
            (value & decoded as u32 & !0xf) | type_bits
        };
        let kept = if size == 0 { 0 } else { kept };
        self.config[register..register + 4].copy_from_slice(&kept.to_le_bytes());
    }

    fn region_size(&self, index: u32) -> u64 {
        match index {
            0 => BAR0_SIZE,
            1 => self.options.bar1_size,
            3 => self.options.bar3_size,
            7 => CONFIG_SIZE as u64,
            MIGRATION_REGION if self.options.migration => MIGRATION_REGION_SIZE,
            _ => 0,
        }
    }

    /// Region descriptions for the vfio-user server (BAR0..5, ROM, config, VGA).
    pub fn regions(&self) -> Vec<ServerRegion> {
        let count = if self.options.migration {
            MIGRATION_REGION + 1
        } else {
            crate::region::COUNT
        };
        (0..count)
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
            regs::QUEUED_JOBS => self.queue.len() as u32,
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
            regs::HOLD => {
                if value == 0 {
                    self.bar0.remove(&regs::HOLD);
                } else {
                    self.bar0.insert(regs::HOLD, value);
                }
                self.run_queue();
            }
            regs::BOOT_0
            | regs::DMA_DONE
            | regs::DMA_STATUS
            | regs::INTX_COUNT
            | regs::QUEUED_JOBS => {}
            _ => {
                self.bar0.insert(offset, value);
            }
        }
    }

    /// Whether the device may DMA and interrupt (migration state RUNNING).
    fn running(&self) -> bool {
        self.migration.device_state & MIG_V1_RUNNING != 0
    }

    fn ring_doorbell(&mut self, vector: u32) {
        let job = DmaJob {
            address: u64::from(self.bar0_read(regs::DMA_ADDR_LO))
                | u64::from(self.bar0_read(regs::DMA_ADDR_HI)) << 32,
            len: u64::from(self.bar0_read(regs::DMA_LEN)),
            seed: u64::from(self.bar0_read(regs::DMA_SEED)),
            vector,
        };
        if self.bar0_read(regs::HOLD) != 0 || !self.running() {
            if self.queue.len() >= MAX_QUEUED_JOBS {
                log::warn!("emu-gpu: doorbell queue full; job dropped");
                self.bar0.insert(regs::DMA_STATUS, 4);
            } else {
                log::debug!("emu-gpu: doorbell queued: {job:?}");
                self.queue.push(job);
            }
            return;
        }
        self.run_job(job);
    }

    /// Runs the queued jobs in order, if the device is running and not held.
    fn run_queue(&mut self) {
        if self.bar0_read(regs::HOLD) != 0 || !self.running() {
            return;
        }
        for job in std::mem::take(&mut self.queue) {
            self.run_job(job);
        }
    }

    fn run_job(&mut self, job: DmaJob) {
        let DmaJob {
            address,
            len,
            seed,
            vector,
        } = job;
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
        if !self.intx_pending || self.intx_masked || disabled || !self.running() {
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
            7 if self.dead => data.fill(0xff),
            7 => data.copy_from_slice(&self.config[offset as usize..offset as usize + data.len()]),
            MIGRATION_REGION => self.migration_read(offset, data),
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
            // The command register, and the BAR registers as hardware has them: a VMM
            // that sizes BARs by writing all ones (Cloud Hypervisor, QEMU) reads back
            // the size mask. MSI-X and the rest are the VMM's.
            7 => {
                for (i, byte) in data.iter().enumerate() {
                    let at = offset as usize + i;
                    if (4..6).contains(&at) {
                        self.config[at] = *byte;
                    }
                }
                let touched = offset & !3..(offset + data.len() as u64).next_multiple_of(4);
                for register in touched.step_by(4).filter(|r| (0x10..0x28).contains(r)) {
                    self.write_bar_register(register as usize, offset, data);
                }
            }
            MIGRATION_REGION => self.migration_write(offset, data),
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
        // Any file and offset: guest RAM's memfd, or a peer's BAR file (peer-to-peer DMA).
        // A plain file must hold the whole range (a write past its end would fault), and
        // mappings must not overlap (the lookup takes the first that covers a job).
        let end = address
            .checked_add(size)
            .ok_or_else(|| invalid("DMA map wraps"))?;
        let metadata = fd.metadata()?;
        if metadata.is_file() && offset.checked_add(size).is_none_or(|e| e > metadata.len()) {
            return Err(invalid("DMA map past the end of its file"));
        }
        if self
            .dma
            .iter()
            .any(|m| address < m.guest_addr + m.size && m.guest_addr < end)
        {
            return Err(invalid("DMA map overlaps a mapping"));
        }
        let host = crate::mmap_shared(fd.as_raw_fd(), offset, len)?;
        log::info!("emu-gpu: DMA map {address:#x}+{size:#x} (file offset {offset:#x})");
        self.dma.push(DmaMapping {
            guest_addr: address,
            size,
            host,
        });
        Ok(())
    }

    fn dma_unmap(&mut self, _flags: DmaUnmapFlags, address: u64, size: u64) -> std::io::Result<()> {
        log::info!("emu-gpu: DMA unmap {address:#x}+{size:#x}");
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
        if self.options.reset_fails {
            log::warn!("emu-gpu: refusing the reset (reset_fails)");
            return Err(std::io::Error::other("reset refused (reset_fails)"));
        }
        self.dead = self.options.dead_after_reset;
        self.bar0.clear();
        self.queue.clear();
        self.migration = MigrationRegion::fresh();
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

// ----- Migration: the vfio-user migration region and the saved state -----

/// The migration region's index (libvfio-user's: the first past VFIO_PCI_NUM_REGIONS).
pub const MIGRATION_REGION: u32 = 9;
/// linux/vfio.h v1 `device_state` bits.
pub const MIG_V1_RUNNING: u32 = 1;
pub const MIG_V1_SAVING: u32 = 2;
pub const MIG_V1_RESUMING: u32 = 4;
/// v1's error state (SAVING | RESUMING).
pub const MIG_V1_ERROR: u32 = MIG_V1_SAVING | MIG_V1_RESUMING;

/// The v1 `device_state` bits of a v2 state (None: not representable), as the kernel
/// documents the mapping: STOP = 0, RUNNING = RUNNING, STOP_COPY = SAVING, RESUMING =
/// RESUMING.
pub fn v1_bits(state: MigrationState) -> Option<u32> {
    match state {
        MigrationState::Stop => Some(0),
        MigrationState::Running => Some(MIG_V1_RUNNING),
        MigrationState::StopCopy => Some(MIG_V1_SAVING),
        MigrationState::Resuming => Some(MIG_V1_RESUMING),
        MigrationState::Error => None,
    }
}

/// The v2 state of v1 `device_state` bits ([`v1_bits`] backwards; the v1 error state is
/// ERROR, other bits are None).
pub fn v1_state(bits: u32) -> Option<MigrationState> {
    match bits {
        0 => Some(MigrationState::Stop),
        MIG_V1_RUNNING => Some(MigrationState::Running),
        MIG_V1_SAVING => Some(MigrationState::StopCopy),
        MIG_V1_RESUMING => Some(MigrationState::Resuming),
        MIG_V1_ERROR => Some(MigrationState::Error),
        _ => None,
    }
}

/// `struct vfio_device_migration_info` field offsets.
pub mod mig_region {
    pub const DEVICE_STATE: u64 = 0;
    /// gpuvm: the device's [`super::mig_error`] code of the last failure.
    pub const RESERVED: u64 = 4;
    pub const PENDING_BYTES: u64 = 8;
    pub const DATA_OFFSET: u64 = 16;
    pub const DATA_SIZE: u64 = 24;
    /// Where the data window starts.
    pub const WINDOW: u64 = 0x1000;
    pub const WINDOW_SIZE: u64 = 256 << 10;
}
const MIGRATION_REGION_SIZE: u64 = mig_region::WINDOW + mig_region::WINDOW_SIZE;

/// Why the device refused a state or an arc (the region's `reserved` field).
pub mod mig_error {
    pub const NONE: u32 = 0;
    pub const BAD_ARC: u32 = 1;
    pub const BAD_MAGIC: u32 = 2;
    pub const OTHER_MODEL: u32 = 3;
    pub const TRUNCATED: u32 = 4;
    pub const CORRUPT: u32 = 5;
    pub const OUT_OF_RANGE: u32 = 6;
    pub const TOO_LARGE: u32 = 7;

    /// What a code means.
    pub fn describe(code: u32) -> &'static str {
        match code {
            BAD_ARC => "the device does not allow that state change",
            BAD_MAGIC => "the saved state is not an emulated-GPU state (bad magic or version)",
            OTHER_MODEL => "the saved state is of another device model",
            TRUNCATED => "the saved state is truncated",
            CORRUPT => "the saved state is corrupt (checksum or field values)",
            OUT_OF_RANGE => "the saved state has memory pages or registers outside the device",
            TOO_LARGE => "more state was written than this device can have",
            _ => "unknown error",
        }
    }
}

/// "GPUVMEMU".
pub const STATE_MAGIC: [u8; 8] = *b"GPUVMEMU";
pub const STATE_VERSION: u32 = 1;
const PAGE: u64 = 4096;

#[derive(Default)]
struct MigrationRegion {
    /// v1 bits; the default (0) is replaced by RUNNING in `Default`.
    device_state: u32,
    error: u32,
    /// STOP_COPY: the saved state and how far the client has read it.
    saved: Vec<u8>,
    cursor: usize,
    /// The chunk staged in the window by the last data_offset read.
    staged: usize,
    /// RESUMING: the window and the state received so far.
    window: Vec<u8>,
    incoming: Vec<u8>,
}

impl MigrationRegion {
    fn fresh() -> Self {
        MigrationRegion {
            device_state: MIG_V1_RUNNING,
            ..Default::default()
        }
    }
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A bounds-checked reader over a saved state.
struct StateReader<'a> {
    data: &'a [u8],
}

impl<'a> StateReader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], u32> {
        if self.data.len() < n {
            return Err(mig_error::TRUNCATED);
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, u32> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, u32> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
}

/// A checked saved state, applied only once all of it is valid.
struct ParsedState<'a> {
    command: [u8; 2],
    intx_pending: bool,
    intx_count: u32,
    bar0: Vec<(u64, u32)>,
    queue: Vec<DmaJob>,
    /// (region, offset, 4 KiB of content).
    pages: Vec<(u32, u64, &'a [u8])>,
}

/// Config bytes a saved state may differ in: the command register and the status
/// register's interrupt bit.
fn config_byte_is_state(at: usize) -> bool {
    matches!(at, 4..=6)
}

impl EmuGpu {
    fn model_header(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&STATE_VERSION.to_le_bytes());
        out.extend_from_slice(&VENDOR_ID.to_le_bytes());
        out.extend_from_slice(&self.options.device_id.to_le_bytes());
        out.extend_from_slice(&self.options.msix_vectors.to_le_bytes());
        out.extend_from_slice(&BAR0_SIZE.to_le_bytes());
        out.extend_from_slice(&self.options.bar1_size.to_le_bytes());
        out.extend_from_slice(&self.options.bar3_size.to_le_bytes());
    }

    /// The non-zero pages of BAR1 (its memfd; holes skipped with SEEK_DATA).
    fn bar1_pages(&self, out: &mut Vec<(u32, u64, Vec<u8>)>) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let size = self.options.bar1_size;
        let fd = self.bar1.as_raw_fd();
        let mut at = 0u64;
        let mut page = vec![0u8; PAGE as usize];
        while at < size {
            // SAFETY: lseek on our own memfd; only the file offset changes.
            let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                break; // ENXIO: no data past `at`.
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let end = if hole < 0 {
                size
            } else {
                (hole as u64).min(size)
            };
            let mut offset = data as u64 & !(PAGE - 1);
            while offset < end {
                self.bar1.read_exact_at(&mut page, offset)?;
                if page.iter().any(|b| *b != 0) {
                    out.push((1, offset, page.clone()));
                }
                offset += PAGE;
            }
            at = end.max(at + PAGE);
        }
        Ok(())
    }

    /// The device's whole state as a blob.
    fn save_state(&self) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.model_header(&mut out);
        out.extend_from_slice(&(CONFIG_SIZE as u32).to_le_bytes());
        out.extend_from_slice(&self.config);
        let mut registers: Vec<_> = self.bar0.iter().map(|(o, v)| (*o, *v)).collect();
        registers.sort_unstable();
        out.extend_from_slice(&(registers.len() as u32).to_le_bytes());
        for (offset, value) in registers {
            out.extend_from_slice(&(offset as u32).to_le_bytes());
            out.extend_from_slice(&value.to_le_bytes());
        }
        out.push(u8::from(self.intx_pending));
        out.extend_from_slice(&self.intx_count.to_le_bytes());
        out.extend_from_slice(&(self.queue.len() as u32).to_le_bytes());
        for job in &self.queue {
            out.extend_from_slice(&job.address.to_le_bytes());
            out.extend_from_slice(&job.len.to_le_bytes());
            out.extend_from_slice(&job.seed.to_le_bytes());
            out.extend_from_slice(&job.vector.to_le_bytes());
        }
        let mut pages = Vec::new();
        self.bar1_pages(&mut pages)?;
        let mut bar3: Vec<_> = self
            .memory
            .iter()
            .filter(|(_, page)| page.iter().any(|b| *b != 0))
            .map(|((region, index), page)| (*region, index * PAGE, page.to_vec()))
            .collect();
        bar3.sort_unstable_by_key(|(region, offset, _)| (*region, *offset));
        pages.extend(bar3);
        out.extend_from_slice(&(pages.len() as u32).to_le_bytes());
        for (region, offset, content) in &pages {
            out.extend_from_slice(&region.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(content);
        }
        let checksum = fnv1a(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        log::info!(
            "emu-gpu: saved state: {} bytes ({} registers, {} queued jobs, {} memory pages)",
            out.len(),
            self.bar0.len(),
            self.queue.len(),
            pages.len()
        );
        Ok(out)
    }

    /// The largest state this model can have (bounds what a client may send).
    fn max_state_size(&self) -> u64 {
        let pages = (self.options.bar1_size + self.options.bar3_size) / PAGE;
        512 + CONFIG_SIZE as u64
            + (BAR0_SIZE / 4) * 8
            + MAX_QUEUED_JOBS as u64 * 28
            + pages * (12 + PAGE)
    }

    fn parse_state<'a>(&self, blob: &'a [u8]) -> Result<ParsedState<'a>, u32> {
        let mut header = Vec::new();
        self.model_header(&mut header);
        if blob.len() < 12 || blob[..8] != STATE_MAGIC || blob[8..12] != header[8..12] {
            return Err(mig_error::BAD_MAGIC);
        }
        if blob.len() < header.len() + 8 {
            return Err(mig_error::TRUNCATED);
        }
        if blob[..header.len()] != header[..] {
            return Err(mig_error::OTHER_MODEL);
        }
        let (body, checksum) = blob.split_at(blob.len() - 8);
        if fnv1a(body).to_le_bytes() != checksum {
            // A cut-off blob fails the checksum too; tell it apart by trying to parse.
            return Err(self
                .parse_body(&body[header.len()..])
                .err()
                .filter(|e| *e == mig_error::TRUNCATED)
                .unwrap_or(mig_error::CORRUPT));
        }
        self.parse_body(&body[header.len()..])
    }

    fn parse_body<'a>(&self, body: &'a [u8]) -> Result<ParsedState<'a>, u32> {
        let mut reader = StateReader { data: body };
        if reader.u32()? != CONFIG_SIZE as u32 {
            return Err(mig_error::CORRUPT);
        }
        let config = reader.take(CONFIG_SIZE)?;
        // Everything but the live bits must be this device's own configuration space.
        let fresh = EmuGpu::fresh_config(&self.options);
        let differs = (0..CONFIG_SIZE).any(|at| {
            if at == 6 {
                (config[at] ^ fresh[at]) & !STATUS_INTERRUPT != 0
            } else {
                !config_byte_is_state(at) && config[at] != fresh[at]
            }
        });
        if differs {
            return Err(mig_error::OTHER_MODEL);
        }
        let count = reader.u32()? as u64;
        if count > BAR0_SIZE / 4 {
            return Err(mig_error::CORRUPT);
        }
        let mut bar0 = Vec::new();
        for _ in 0..count {
            let offset = u64::from(reader.u32()?);
            let value = reader.u32()?;
            if offset % 4 != 0 || offset >= BAR0_SIZE {
                return Err(mig_error::OUT_OF_RANGE);
            }
            bar0.push((offset, value));
        }
        let intx_pending = match reader.u8()? {
            0 => false,
            1 => true,
            _ => return Err(mig_error::CORRUPT),
        };
        let intx_count = reader.u32()?;
        let jobs = reader.u32()? as usize;
        if jobs > MAX_QUEUED_JOBS {
            return Err(mig_error::CORRUPT);
        }
        let mut queue = Vec::with_capacity(jobs);
        for _ in 0..jobs {
            queue.push(DmaJob {
                address: reader.u64()?,
                len: reader.u64()?,
                seed: reader.u64()?,
                vector: reader.u32()?,
            });
        }
        let count = reader.u32()? as u64;
        let most = (self.options.bar1_size + self.options.bar3_size) / PAGE;
        if count > most {
            return Err(mig_error::CORRUPT);
        }
        let mut pages = Vec::new();
        for _ in 0..count {
            let region = reader.u32()?;
            let offset = reader.u64()?;
            let content = reader.take(PAGE as usize)?;
            let size = match region {
                1 | 3 => self.region_size(region),
                _ => return Err(mig_error::OUT_OF_RANGE),
            };
            if offset % PAGE != 0 || offset.checked_add(PAGE).is_none_or(|end| end > size) {
                return Err(mig_error::OUT_OF_RANGE);
            }
            pages.push((region, offset, content));
        }
        if !reader.data.is_empty() {
            return Err(mig_error::CORRUPT);
        }
        Ok(ParsedState {
            command: [config[4], config[5]],
            intx_pending,
            intx_count,
            bar0,
            queue,
            pages,
        })
    }

    fn apply_state(&mut self, state: ParsedState<'_>) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.config[4] = state.command[0];
        self.config[5] = state.command[1];
        self.bar0 = state.bar0.into_iter().collect();
        self.queue = state.queue;
        self.intx_count = state.intx_count;
        self.intx_masked = false;
        // The line's level (and the status bit) without firing: the device is stopped.
        self.intx_pending = state.intx_pending;
        if state.intx_pending {
            self.config[6] |= STATUS_INTERRUPT;
        } else {
            self.config[6] &= !STATUS_INTERRUPT;
        }
        // SAFETY: punches a hole over our own memfd's whole length (zeroes it, keeps
        // its size, so the client's mapping stays valid).
        let punched = unsafe {
            libc::fallocate(
                self.bar1.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                self.options.bar1_size as libc::off_t,
            )
        };
        if punched < 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.memory.clear();
        for (region, offset, content) in state.pages {
            if region == 1 {
                self.bar1.write_all_at(content, offset)?;
            } else {
                self.memory_access(region, offset, None, content);
            }
        }
        Ok(())
    }

    /// A v1 state change asked for by the client; failures set the error state.
    fn migration_set_state(&mut self, to: u32) {
        let from = self.migration.device_state;
        if to == from {
            return;
        }
        // The single arcs of v2, in v1 bits.
        let allowed = v1_state(from)
            .zip(v1_state(to))
            .is_some_and(|(from, to)| from.is_single_arc(to));
        if !allowed {
            log::warn!("emu-gpu: migration arc {from:#x} -> {to:#x} refused");
            self.migration.error = mig_error::BAD_ARC;
            self.migration.device_state = MIG_V1_ERROR;
            return;
        }
        self.migration.error = mig_error::NONE;
        match (from, to) {
            (0, MIG_V1_SAVING) => match self.save_state() {
                Ok(saved) => {
                    self.migration.saved = saved;
                    self.migration.cursor = 0;
                    self.migration.staged = 0;
                }
                Err(error) => {
                    log::error!("emu-gpu: cannot save the state: {error}");
                    self.migration.error = mig_error::CORRUPT;
                    self.migration.device_state = MIG_V1_ERROR;
                    return;
                }
            },
            (MIG_V1_SAVING, 0) => {
                self.migration.saved = Vec::new();
                self.migration.cursor = 0;
                self.migration.staged = 0;
            }
            (0, MIG_V1_RESUMING) => {
                self.migration.window = vec![0; mig_region::WINDOW_SIZE as usize];
                self.migration.incoming = Vec::new();
            }
            (MIG_V1_RESUMING, 0) => {
                self.migration.window = Vec::new();
                let incoming = std::mem::take(&mut self.migration.incoming);
                let result = self.parse_state(&incoming).and_then(|state| {
                    self.apply_state(state).map_err(|error| {
                        log::error!("emu-gpu: cannot apply the state: {error}");
                        mig_error::CORRUPT
                    })
                });
                if let Err(code) = result {
                    log::warn!(
                        "emu-gpu: saved state refused: {}",
                        mig_error::describe(code)
                    );
                    self.migration.error = code;
                    self.migration.device_state = MIG_V1_ERROR;
                    return;
                }
                log::info!("emu-gpu: loaded a {}-byte state", incoming.len());
            }
            _ => {}
        }
        self.migration.device_state = to;
        if to == MIG_V1_RUNNING {
            self.run_queue();
            self.fire_intx();
        }
    }

    fn migration_read(&mut self, offset: u64, data: &mut [u8]) {
        use mig_region::*;
        let saving = self.migration.device_state == MIG_V1_SAVING;
        let remaining = self
            .migration
            .saved
            .len()
            .saturating_sub(self.migration.cursor);
        let field: Option<u64> = match offset {
            DEVICE_STATE => Some(u64::from(self.migration.device_state)),
            RESERVED => Some(u64::from(self.migration.error)),
            PENDING_BYTES if saving => {
                // Reading pending_bytes retires the chunk the client has read.
                self.migration.cursor += self.migration.staged;
                self.migration.staged = 0;
                Some((self.migration.saved.len() - self.migration.cursor) as u64)
            }
            PENDING_BYTES => Some(0),
            DATA_OFFSET => {
                if saving {
                    self.migration.staged = remaining.min(WINDOW_SIZE as usize);
                }
                Some(WINDOW)
            }
            DATA_SIZE if saving => Some(self.migration.staged as u64),
            DATA_SIZE => Some(0),
            _ => None,
        };
        if let Some(value) = field {
            let bytes = value.to_le_bytes();
            for (i, byte) in data.iter_mut().enumerate() {
                *byte = bytes.get(i).copied().unwrap_or(0);
            }
            return;
        }
        data.fill(0);
        if saving && offset >= WINDOW {
            let start = self.migration.cursor + (offset - WINDOW) as usize;
            let end = self.migration.cursor + self.migration.staged;
            if let Some(chunk) = self.migration.saved.get(start..end) {
                let n = chunk.len().min(data.len());
                data[..n].copy_from_slice(&chunk[..n]);
            }
        }
    }

    fn migration_write(&mut self, offset: u64, data: &[u8]) {
        use mig_region::*;
        let mut value = [0u8; 8];
        let n = data.len().min(8);
        value[..n].copy_from_slice(&data[..n]);
        let value = u64::from_le_bytes(value);
        match offset {
            DEVICE_STATE => self.migration_set_state(value as u32),
            DATA_SIZE if self.migration.device_state == MIG_V1_RESUMING => {
                let total = self.migration.incoming.len() as u64 + value;
                if value > WINDOW_SIZE || total > self.max_state_size() {
                    log::warn!("emu-gpu: migration data beyond the device's largest state");
                    self.migration.error = mig_error::TOO_LARGE;
                    self.migration.device_state = MIG_V1_ERROR;
                    self.migration.incoming = Vec::new();
                    return;
                }
                let chunk = &self.migration.window[..value as usize];
                self.migration.incoming.extend_from_slice(chunk);
            }
            o if o >= WINDOW && self.migration.device_state == MIG_V1_RESUMING => {
                let start = (o - WINDOW) as usize;
                if let Some(slot) = self.migration.window.get_mut(start..start + data.len()) {
                    slot.copy_from_slice(data);
                }
            }
            _ => {}
        }
    }
}
