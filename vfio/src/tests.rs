//! The vfio-user path end to end inside one process: the emulated GPU served on a socket,
//! a VfioPciDevice over the vfio-user client, guest RAM as a memfd.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::{BarKind, MsiMessage, PciDevice, RecordedRoutes};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::emu::{self, regs, EmuGpuOptions};
use crate::pci::VfioPciDevice;
use crate::user::VfioUserDevice;
use crate::DmaRegion;

fn start_server(name: &str) -> std::path::PathBuf {
    let socket =
        std::env::temp_dir().join(format!("gpuvm-vfio-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    // Listening before the client connects (a server thread that binds could still be
    // between bind and listen when the socket file appears: ECONNREFUSED).
    let mut device = emu::EmuGpu::new(EmuGpuOptions::default()).expect("device");
    let server =
        vfio_user::Server::new(&socket, true, device.irqs(), device.regions()).expect("listen");
    std::thread::spawn(move || server.run(&mut device));
    socket
}

fn read32(device: &mut dyn PciDevice, offset: u16) -> u32 {
    let mut data = [0; 4];
    device.config_read(offset, &mut data);
    u32::from_le_bytes(data)
}

#[test]
fn emulated_gpu_over_vfio_user() {
    let socket = start_server("e2e");
    let backend = VfioUserDevice::connect(&socket).expect("connect");
    let routes = Arc::new(RecordedRoutes::default());
    let mut eventfds_seen = Vec::new();
    let mut allocate = |count: u32| -> std::io::Result<Vec<(u32, EventFd)>> {
        (0..count)
            .map(|_| {
                let fd = EventFd::new(EFD_NONBLOCK)?;
                eventfds_seen.push(fd.try_clone()?);
                // GSIs keep counting across calls, like the VMM's allocator.
                Ok((24 + eventfds_seen.len() as u32 - 1, fd))
            })
            .collect()
    };
    let mut device =
        VfioPciDevice::new(Box::new(backend), &mut allocate, routes.clone()).expect("device");
    assert_eq!(eventfds_seen.len(), 5, "4 MSI-X vectors and 1 MSI vector");
    assert_eq!(read32(&mut device, 0), 0x2330_10de);
    let specs = device.bar_specs();
    assert_eq!(specs.len(), 3, "{specs:?}");
    assert_eq!(specs[0].size, 16 << 20);
    assert_eq!(specs[1].kind, BarKind::Memory64 { prefetchable: true });
    assert_eq!(specs[1].size, 256 << 20);
    assert_eq!(specs[2].index, 3);

    // BAR0 registers round-trip over the socket.
    device.bar_write(0, regs::SCRATCH, &0xdead_beefu32.to_le_bytes());
    let mut data = [0; 4];
    device.bar_read(0, regs::SCRATCH, &mut data);
    assert_eq!(u32::from_le_bytes(data), 0xdead_beef);
    device.bar_read(0, regs::BOOT_0, &mut data);
    assert_eq!(u32::from_le_bytes(data), regs::BOOT_0_VALUE);

    // Program MSI-X vector 1 and enable MSI-X through the capability.
    device.bar_write(0, regs::MSIX_TABLE + 16, &0xfee0_0000u64.to_le_bytes());
    device.bar_write(0, regs::MSIX_TABLE + 24, &0x45u32.to_le_bytes());
    device.bar_write(0, regs::MSIX_TABLE + 28, &0u32.to_le_bytes());
    device.config_write(0x62, &0x8000u16.to_le_bytes());
    assert_eq!(read32(&mut device, 0x60) >> 16, 0x8003);
    assert_eq!(
        routes.routes().get(&25),
        Some(&MsiMessage {
            address: 0xfee0_0000,
            data: 0x45
        })
    );

    // Guest RAM: a 1 MiB memfd at guest address 0x10_0000.
    // SAFETY: memfd_create with a static name.
    let memfd = unsafe { libc::memfd_create(c"ram".as_ptr(), 0) };
    assert!(memfd >= 0);
    // SAFETY: ftruncate on the fd we just created.
    assert_eq!(unsafe { libc::ftruncate(memfd, 1 << 20) }, 0);
    device
        .dma_map(&[DmaRegion {
            guest_addr: 0x10_0000,
            size: 1 << 20,
            host_addr: 0,
            fd: memfd,
            fd_offset: 0,
        }])
        .expect("DMA map");
    device.bar_write(0, regs::DMA_ADDR_LO, &0x10_2000u32.to_le_bytes());
    device.bar_write(0, regs::DMA_ADDR_HI, &0u32.to_le_bytes());
    device.bar_write(0, regs::DMA_LEN, &4096u32.to_le_bytes());
    device.bar_write(0, regs::DMA_SEED, &7u32.to_le_bytes());
    // Bus Master off: the device does not DMA (status 3) but signals completion.
    device.bar_write(0, regs::DOORBELL, &1u32.to_le_bytes());
    device.bar_read(0, regs::DMA_STATUS, &mut data);
    assert_eq!(u32::from_le_bytes(data), 3, "DMA status without Bus Master");
    assert_eq!(eventfds_seen[1].read().expect("vector 1 fired"), 1);
    device.config_write(0x04, &[0x06, 0]);
    device.bar_write(0, regs::DOORBELL, &1u32.to_le_bytes());
    device.bar_read(0, regs::DMA_STATUS, &mut data);
    assert_eq!(u32::from_le_bytes(data), 0, "DMA status");
    assert_eq!(eventfds_seen[1].read().expect("vector 1 fired"), 1);
    assert!(eventfds_seen[0].read().is_err(), "vector 0 stayed quiet");
    let mut word = [0u8; 8];
    for addr in [0x10_2000u64, 0x10_2ff8] {
        // SAFETY: pread into a local buffer.
        let n = unsafe {
            libc::pread(
                memfd,
                word.as_mut_ptr().cast(),
                8,
                (addr - 0x10_0000) as i64,
            )
        };
        assert_eq!(n, 8);
        assert_eq!(u64::from_le_bytes(word), emu::pattern(7, addr));
    }
    // MSI instead of MSI-X: the capability at 0x50 is emulated, the device signals the MSI
    // eventfd (the first allocated after the four MSI-X ones).
    device.config_write(0x62, &0u16.to_le_bytes());
    assert!(routes.routes().is_empty(), "MSI-X off");
    device.config_write(0x54, &0xfee0_0000u32.to_le_bytes());
    device.config_write(0x5c, &0x51u16.to_le_bytes());
    device.config_write(0x52, &1u16.to_le_bytes());
    assert_eq!(read32(&mut device, 0x50) >> 16 & 1, 1, "MSI enabled");
    assert_eq!(
        routes.routes().get(&28),
        Some(&MsiMessage {
            address: 0xfee0_0000,
            data: 0x51
        })
    );
    device.bar_write(0, regs::DOORBELL, &0u32.to_le_bytes());
    assert_eq!(eventfds_seen[4].read().expect("MSI fired"), 1);
    assert!(
        eventfds_seen[0].read().is_err(),
        "MSI-X vector 0 stayed quiet"
    );
    device.config_write(0x52, &0u16.to_le_bytes());
    // Out of the mapped range: status 1.
    device.bar_write(0, regs::DMA_ADDR_LO, &0x20_0000u32.to_le_bytes());
    device.bar_write(0, regs::DOORBELL, &1u32.to_le_bytes());
    device.bar_read(0, regs::DMA_STATUS, &mut data);
    assert_eq!(u32::from_le_bytes(data), 1);
    drop(device);
    // SAFETY: closing the fd we created.
    unsafe { libc::close(memfd.as_raw_fd()) };
}

/// A backend with one 64 KiB BAR0 holding the MSI-X table (0x2000) and PBA (0x3000),
/// mmap-able or not; it keeps the command register and records every write to it.
struct FakeBackend {
    name: &'static str,
    mmap: bool,
    config: Vec<u8>,
    memory: Vec<u8>,
    command_writes: Arc<Mutex<Vec<u8>>>,
}

impl FakeBackend {
    fn new(name: &'static str, mmap: bool) -> Self {
        let mut config = vec![0u8; 256];
        config[0..4].copy_from_slice(&0x2330_10deu32.to_le_bytes());
        config[6] = 0x10;
        config[0x34] = 0x60;
        config[0x60] = 0x11;
        config[0x62] = 1; // 2 vectors
        config[0x64..0x68].copy_from_slice(&0x2000u32.to_le_bytes());
        config[0x68..0x6c].copy_from_slice(&0x3000u32.to_le_bytes());
        FakeBackend {
            name,
            mmap,
            config,
            memory: vec![0; 64 << 10],
            command_writes: Arc::default(),
        }
    }

    /// A [`VfioPciDevice`] over this backend, its MSI-X vectors on GSIs from 24.
    fn device(self) -> VfioPciDevice {
        let mut allocate = |count: u32| -> std::io::Result<Vec<(u32, EventFd)>> {
            (0..count)
                .map(|i| Ok((24 + i, EventFd::new(EFD_NONBLOCK)?)))
                .collect()
        };
        VfioPciDevice::new(
            Box::new(self),
            &mut allocate,
            Arc::new(RecordedRoutes::default()),
        )
        .expect("device")
    }
}

impl crate::PassthroughDevice for FakeBackend {
    fn name(&self) -> String {
        self.name.into()
    }
    fn region_info(&self, index: u32) -> Option<crate::RegionInfo> {
        match index {
            0 => Some(crate::RegionInfo {
                index,
                size: 64 << 10,
                flags: crate::REGION_READ | crate::REGION_WRITE | crate::REGION_MMAP,
                mmap_areas: Vec::new(),
            }),
            crate::region::CONFIG => Some(crate::RegionInfo {
                index,
                size: 256,
                flags: crate::REGION_READ | crate::REGION_WRITE,
                mmap_areas: Vec::new(),
            }),
            _ => None,
        }
    }
    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> crate::Result<()> {
        let source = if index == crate::region::CONFIG {
            &self.config
        } else {
            &self.memory
        };
        gpuvm_devices::pci::read_le(source, offset as usize, data);
        Ok(())
    }
    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> crate::Result<()> {
        if index == crate::region::CONFIG && offset == 4 {
            self.command_writes.lock().unwrap().push(data[0]);
            self.config[4] = data[0];
        }
        Ok(())
    }
    fn mmap_region(
        &mut self,
        _index: u32,
        offset: u64,
        _size: u64,
    ) -> crate::Result<Option<*mut u8>> {
        if !self.mmap {
            return Ok(None);
        }
        // SAFETY: offset is inside the 64 KiB buffer (the caller maps BAR0 parts only).
        Ok(Some(unsafe {
            self.memory.as_mut_ptr().add(offset as usize)
        }))
    }
    fn msix_vectors(&mut self) -> crate::Result<u32> {
        Ok(2)
    }
    fn enable_msix(&mut self, _eventfds: &[&EventFd]) -> crate::Result<()> {
        Ok(())
    }
    fn disable_msix(&mut self) -> crate::Result<()> {
        Ok(())
    }
    fn dma_map(&mut self, _region: &DmaRegion) -> crate::Result<()> {
        Ok(())
    }
    fn reset(&mut self) -> crate::Result<()> {
        Ok(())
    }
}

/// Records guest mappings as (guest address, size, host offset from the first mapping).
#[derive(Default)]
struct Slots {
    live: Mutex<BTreeMap<u32, (u64, u64, u64)>>,
    next: std::sync::atomic::AtomicU32,
}

impl gpuvm_devices::pci::GuestMemoryMapper for Slots {
    fn map(&self, guest_addr: u64, size: u64, host: u64) -> std::io::Result<u32> {
        let handle = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.live
            .lock()
            .unwrap()
            .insert(handle, (guest_addr, size, host));
        Ok(handle)
    }
    fn unmap(&self, handle: u32) -> std::io::Result<()> {
        self.live
            .lock()
            .unwrap()
            .remove(&handle)
            .map(|_| ())
            .ok_or_else(|| std::io::Error::other("unknown handle"))
    }
}

fn guest_ranges(slots: &Slots) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = slots
        .live
        .lock()
        .unwrap()
        .values()
        .map(|m| (m.0, m.1))
        .collect();
    ranges.sort();
    ranges
}

#[test]
fn mmapped_bar_parts_follow_the_bar_and_skip_msix_pages() {
    let mut device = FakeBackend::new("fake", true).device();
    let slots = Arc::new(Slots::default());
    let mapped = device.map_bars(slots.clone()).expect("map bars");
    assert_eq!(
        mapped,
        (64 << 10) - 0x2000,
        "table and PBA pages stay trapped"
    );
    assert!(guest_ranges(&slots).is_empty(), "not placed yet");
    device.set_bar_address(0, 0xc000_0000);
    assert!(guest_ranges(&slots).is_empty(), "memory decoding is off");
    device.enable_memory_decoding();
    assert_eq!(
        guest_ranges(&slots),
        vec![(0xc000_0000, 0x2000), (0xc000_4000, 0xc000)]
    );
    // The guest moves BAR0.
    device.config_write(0x10, &0xc010_0000u32.to_le_bytes());
    assert_eq!(
        guest_ranges(&slots),
        vec![(0xc010_0000, 0x2000), (0xc010_4000, 0xc000)]
    );
    // Memory decoding off: nothing mapped; the MSI-X table still traps to the emulation.
    device.config_write(0x04, &[0, 0]);
    assert!(guest_ranges(&slots).is_empty());
    device.config_write(0x04, &[2, 0]);
    assert_eq!(guest_ranges(&slots).len(), 2);
    device.bar_write(0, 0x2000 + 8, &0x41u32.to_le_bytes());
    let mut data = [0u8; 4];
    device.bar_read(0, 0x2000 + 8, &mut data);
    assert_eq!(u32::from_le_bytes(data), 0x41);
    drop(device);
    assert!(guest_ranges(&slots).is_empty(), "unmapped on drop");
}

/// INTx as vfio-pci presents it: level-triggered, masked each time it fires until the VMM
/// unmasks it (at the guest's EOI); a line the guest did not acknowledge fires again on
/// unmask, an acknowledged one does not; MSI-X takes over from INTx and gives it back.
#[test]
fn intx_is_level_triggered_and_yields_to_msix() {
    let socket = start_server("intx");
    let backend = VfioUserDevice::connect(&socket).expect("connect");
    let routes = Arc::new(RecordedRoutes::default());
    let mut next_gsi = 24;
    let mut allocate = |count: u32| -> std::io::Result<Vec<(u32, EventFd)>> {
        (0..count)
            .map(|_| {
                next_gsi += 1;
                Ok((next_gsi, EventFd::new(EFD_NONBLOCK)?))
            })
            .collect()
    };
    let mut device = VfioPciDevice::new(Box::new(backend), &mut allocate, routes).expect("device");
    assert_eq!(device.interrupt_pin(), 1, "INTA");
    let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
    assert!(device
        .attach_intx(17, trigger.try_clone().unwrap())
        .expect("attach INTx"));
    // Firmware's Interrupt Line is the GSI; the guest may rewrite it.
    assert_eq!(read32(&mut device, 0x3c) & 0xffff, 0x0111);
    let fired = |trigger: &EventFd| trigger.read().is_ok();
    let ring = |device: &mut VfioPciDevice| {
        device.bar_write(0, regs::DMA_LEN, &0u32.to_le_bytes());
        device.bar_write(0, regs::DOORBELL, &0u32.to_le_bytes());
    };
    let intx_count = |device: &mut VfioPciDevice| {
        let mut data = [0; 4];
        device.bar_read(0, regs::INTX_COUNT, &mut data);
        u32::from_le_bytes(data)
    };

    ring(&mut device);
    assert!(fired(&trigger), "the doorbell asserts INTx");
    assert_eq!(
        read32(&mut device, 0x04) >> 16 & 0x8,
        0x8,
        "status: interrupt"
    );
    ring(&mut device);
    assert!(!fired(&trigger), "masked until unmasked");
    device.intx_resampled();
    assert!(fired(&trigger), "still asserted: fires again on unmask");
    device.bar_write(0, regs::INTX_ACK, &1u32.to_le_bytes());
    assert_eq!(read32(&mut device, 0x04) >> 16 & 0x8, 0, "status clear");
    device.intx_resampled();
    assert!(!fired(&trigger), "acknowledged: no more interrupts");
    assert_eq!(intx_count(&mut device), 2);

    // MSI-X on: INTx is off in the device, the doorbell uses the vector.
    device.config_write(0x62, &0x8000u16.to_le_bytes());
    ring(&mut device);
    assert!(!fired(&trigger), "no INTx while MSI-X is enabled");
    device.config_write(0x62, &0u16.to_le_bytes());
    ring(&mut device);
    assert!(fired(&trigger), "INTx is back once MSI-X is off");
    assert_eq!(intx_count(&mut device), 3);
}

/// A device gated by a background mapping of `delay` that fails when `fail` is set.
fn gated_device(
    delay: std::time::Duration,
    fail: bool,
    limit: std::time::Duration,
) -> (
    VfioPciDevice,
    Arc<Mutex<Vec<u8>>>,
    crate::dma::BackgroundMapping,
) {
    use crate::dma::{BackgroundMapping, DmaMapper, DmaProgress, MapOptions};
    struct Mapper(bool);
    impl DmaMapper for Mapper {
        fn name(&self) -> String {
            "fake".into()
        }
        fn max_parallel(&self) -> usize {
            1
        }
        unsafe fn map(&self, _chunk: &DmaRegion) -> std::io::Result<()> {
            if self.0 {
                return Err(std::io::Error::other("injected"));
            }
            Ok(())
        }
        fn unmap(&self, _guest_addr: u64, _size: u64) -> std::io::Result<()> {
            Ok(())
        }
    }
    let backend = FakeBackend::new("gated", false);
    let writes = backend.command_writes.clone();
    let mut device = backend.device();
    let chunks = vec![DmaRegion {
        guest_addr: 0,
        size: 1 << 20,
        host_addr: 0,
        fd: -1,
        fd_offset: 0,
    }];
    let progress = DmaProgress::new("fake", 1 << 20);
    device.gate_bus_master(progress.clone(), limit);
    let mapping = BackgroundMapping::start(
        progress,
        Arc::new(Mapper(fail)),
        chunks,
        MapOptions {
            delay,
            ..Default::default()
        },
    )
    .unwrap();
    (device, writes, mapping)
}

/// Memory decoding goes through at once; the write that sets Bus Master waits for the
/// map, then reaches the device whole, and reads show what the guest wrote.
#[test]
fn bus_master_waits_for_the_dma_map() {
    use std::time::{Duration, Instant};
    let (mut device, writes, mapping) =
        gated_device(Duration::from_millis(400), false, Duration::from_secs(30));
    let started = Instant::now();
    device.config_write(0x04, &[0x02, 0]);
    assert!(started.elapsed() < Duration::from_millis(300), "not gated");
    assert_eq!(read32(&mut device, 0x04) & 0xffff, 0x02);
    device.config_write(0x04, &[0x06, 0]);
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "the write waited for the map: {:?}",
        started.elapsed()
    );
    assert!(mapping.progress().is_done());
    assert_eq!(*writes.lock().unwrap(), [0x02, 0x06]);
    assert_eq!(read32(&mut device, 0x04) & 0xffff, 0x06);
    // Once mapped, no more waiting; clearing and setting again goes straight through.
    let again = Instant::now();
    device.config_write(0x04, &[0x02, 0]);
    device.config_write(0x04, &0x0006_0000_0006u64.to_le_bytes()[..4]);
    assert!(again.elapsed() < Duration::from_millis(300));
    assert_eq!(mapping.join().bus_master_refused, 0);
}

/// A failed map refuses Bus Master at once (no hang): the rest of the write goes through,
/// the bit reads back clear, the refusal is counted.
#[test]
fn a_failed_map_refuses_bus_master() {
    use std::time::{Duration, Instant};
    let (mut device, writes, mapping) =
        gated_device(Duration::from_millis(100), true, Duration::from_secs(30));
    let started = Instant::now();
    device.config_write(0x04, &[0x06, 0]);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(*writes.lock().unwrap(), [0x02]);
    assert_eq!(
        read32(&mut device, 0x04) & 0xffff,
        0x02,
        "Bus Master reads clear"
    );
    let status = mapping.join();
    assert!(status.error.is_some() && !status.done);
    assert_eq!(status.bus_master_refused, 1);
}

/// A map that outlasts the limit refuses Bus Master when the limit runs out.
#[test]
fn a_map_slower_than_the_limit_refuses_bus_master() {
    use std::time::Duration;
    let (mut device, writes, mapping) =
        gated_device(Duration::from_secs(60), false, Duration::from_millis(100));
    device.config_write(0x04, &[0x04, 0]);
    assert_eq!(*writes.lock().unwrap(), [0x00]);
    assert_eq!(mapping.progress().status().bus_master_refused, 1);
}

// ----- Reset before attach and after detach (crate::reset) -----

/// The fake reset ioctl layer: answers VFIO_DEVICE_GET_INFO, VFIO_DEVICE_RESET,
/// VFIO_DEVICE_GET_PCI_HOT_RESET_INFO and VFIO_DEVICE_PCI_HOT_RESET as the kernel would
/// for the device described, and records the requests.
#[derive(Default)]
struct FakeResetOps {
    flags: u32,
    reset_errno: Option<i32>,
    hot_reset_info: Option<crate::reset::HotResetInfo>,
    /// Group id -> the fd this process holds for it.
    groups: BTreeMap<u32, i32>,
    cdev: bool,
    kernel_method: Option<String>,
    ids_after_reset: u32,
    calls: Mutex<Vec<String>>,
}

impl FakeResetOps {
    fn flr() -> Self {
        FakeResetOps {
            flags: crate::reset::DEVICE_FLAGS_RESET,
            kernel_method: Some("flr".into()),
            ids_after_reset: 0x2330_10de,
            ..Default::default()
        }
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

impl crate::reset::KernelResetOps for FakeResetOps {
    fn device_flags(&self) -> std::io::Result<u32> {
        Ok(self.flags)
    }
    fn function_reset(&self) -> std::io::Result<()> {
        self.calls.lock().unwrap().push("VFIO_DEVICE_RESET".into());
        match self.reset_errno {
            Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
    fn hot_reset_info(&self) -> std::io::Result<crate::reset::HotResetInfo> {
        self.hot_reset_info
            .clone()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn hot_reset(&self, group_fds: &[i32]) -> std::io::Result<()> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("VFIO_DEVICE_PCI_HOT_RESET {group_fds:?}"));
        match self.reset_errno {
            Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
    fn read_ids(&self) -> std::io::Result<u32> {
        Ok(self.ids_after_reset)
    }
    fn kernel_reset_method(&self) -> Option<String> {
        self.kernel_method.clone()
    }
    fn group_fd(&self, group: u32) -> Option<i32> {
        self.groups.get(&group).copied()
    }
    fn cdev(&self) -> bool {
        self.cdev
    }
}

fn dependent(group: u32, devfn: u8) -> crate::reset::Dependent {
    crate::reset::Dependent {
        group_or_devid: group,
        segment: 0,
        bus: 0x41,
        devfn,
    }
}

#[test]
fn a_device_with_flr_is_reset_by_vfio_device_reset() {
    use crate::reset::{reset_kernel_device, ResetMethod};
    let ops = FakeResetOps::flr();
    let method = reset_kernel_device("0000:41:00.0", &ops).expect("reset");
    assert_eq!(
        method,
        ResetMethod::Function {
            kernel_method: Some("flr".into())
        }
    );
    assert_eq!(method.to_string(), "FLR");
    assert_eq!(ops.calls(), ["VFIO_DEVICE_RESET"]);
}

#[test]
fn without_flr_the_dependent_set_is_hot_reset_with_its_group_fds() {
    use crate::reset::{reset_kernel_device, HotResetInfo, ResetMethod};
    // Two functions of one device in group 7, a third function in group 9.
    let ops = FakeResetOps {
        hot_reset_info: Some(HotResetInfo {
            flags: 0,
            devices: vec![dependent(7, 0), dependent(7, 1), dependent(9, 2)],
        }),
        groups: BTreeMap::from([(7, 40), (9, 41)]),
        ids_after_reset: 0x2330_10de,
        ..Default::default()
    };
    let method = reset_kernel_device("0000:41:00.0", &ops).expect("reset");
    assert_eq!(method, ResetMethod::HotReset { devices: Some(3) });
    assert_eq!(ops.calls(), ["VFIO_DEVICE_PCI_HOT_RESET [40, 41]"]);

    // iommufd cdev: no group fds, and only when the kernel says the set is owned.
    let cdev = FakeResetOps {
        cdev: true,
        hot_reset_info: Some(HotResetInfo {
            flags: crate::reset::HOT_RESET_FLAG_DEV_ID | crate::reset::HOT_RESET_FLAG_DEV_ID_OWNED,
            devices: vec![dependent(1, 0), dependent(2, 1)],
        }),
        ids_after_reset: 0x2330_10de,
        ..Default::default()
    };
    let method = reset_kernel_device("0000:41:00.0", &cdev).expect("reset");
    assert_eq!(method, ResetMethod::HotReset { devices: Some(2) });
    assert_eq!(cdev.calls(), ["VFIO_DEVICE_PCI_HOT_RESET []"]);
}

#[test]
fn a_device_with_no_reset_says_so_and_is_still_checked() {
    use crate::reset::{reset_kernel_device, HotResetInfo, ResetMethod};
    // No function reset, no bus reset at all.
    let none = FakeResetOps {
        ids_after_reset: 0x2330_10de,
        ..Default::default()
    };
    let method = reset_kernel_device("0000:41:00.0", &none).expect("usable");
    assert!(
        matches!(&method, ResetMethod::None { reason } if reason.contains("no bus or slot reset"))
    );
    assert!(none.calls().is_empty());

    // A hot reset that would reset a group this VM does not hold is not tried.
    let foreign = FakeResetOps {
        hot_reset_info: Some(HotResetInfo {
            flags: 0,
            devices: vec![dependent(7, 0), dependent(8, 1)],
        }),
        groups: BTreeMap::from([(7, 40)]),
        ids_after_reset: 0x2330_10de,
        ..Default::default()
    };
    let method = reset_kernel_device("0000:41:00.0", &foreign).expect("usable");
    assert!(
        matches!(&method, ResetMethod::None { reason } if reason.contains("IOMMU group 8")),
        "{method}"
    );
    assert!(foreign.calls().is_empty());

    // With no reset possible, a device that reads all ones is still refused.
    let dead = FakeResetOps {
        ids_after_reset: crate::reset::ABSENT_IDS,
        ..Default::default()
    };
    let error = reset_kernel_device("0000:41:00.0", &dead).unwrap_err();
    assert!(
        error.to_string().contains("0000:41:00.0") && error.to_string().contains("0xffffffff"),
        "{error}"
    );
}

#[test]
fn a_failing_reset_ioctl_or_a_device_that_does_not_come_back_is_refused() {
    use crate::reset::{reset_kernel_device, HotResetInfo, ResetError};
    let failing = FakeResetOps {
        reset_errno: Some(libc::EIO),
        ..FakeResetOps::flr()
    };
    let error = reset_kernel_device("0000:41:00.0", &failing).unwrap_err();
    assert!(matches!(error, ResetError::Failed { .. }), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("0000:41:00.0")
            && message.contains("FLR")
            && message.contains("not attached"),
        "{message}"
    );

    let failing_hot = FakeResetOps {
        reset_errno: Some(libc::EBUSY),
        hot_reset_info: Some(HotResetInfo {
            flags: 0,
            devices: vec![dependent(7, 0)],
        }),
        groups: BTreeMap::from([(7, 40)]),
        ..Default::default()
    };
    let message = reset_kernel_device("0000:41:00.0", &failing_hot)
        .unwrap_err()
        .to_string();
    assert!(message.contains("hot reset"), "{message}");

    let gone = FakeResetOps {
        ids_after_reset: crate::reset::ABSENT_IDS,
        ..FakeResetOps::flr()
    };
    let error = reset_kernel_device("0000:41:00.0", &gone).unwrap_err();
    assert!(matches!(error, ResetError::NotBack { .. }), "{error}");
    assert!(error.to_string().contains("after reset by FLR"), "{error}");
}

#[test]
fn the_reset_method_check_host_shows_comes_from_sysfs() {
    use crate::reset::{reset_method_in, ResetMethod};
    let dir = std::env::temp_dir().join(format!("gpuvm-reset-sysfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // No reset_method and no reset file: only the hot reset is left.
    assert_eq!(
        reset_method_in(&dir),
        ResetMethod::HotReset { devices: None }
    );
    std::fs::write(dir.join("reset"), "").unwrap();
    assert_eq!(
        reset_method_in(&dir),
        ResetMethod::Function {
            kernel_method: None
        }
    );
    std::fs::write(dir.join("reset_method"), "bus\n").unwrap();
    assert_eq!(reset_method_in(&dir).to_string(), "secondary bus reset");
    std::fs::write(dir.join("reset_method"), "flr bus\n").unwrap();
    assert_eq!(reset_method_in(&dir).to_string(), "FLR");
    std::fs::write(dir.join("reset_method"), "\n").unwrap();
    assert_eq!(
        reset_method_in(&dir),
        ResetMethod::HotReset { devices: None }
    );
    // check-host's line for it, found under a fake sysfs root.
    let sys = dir.join("sys");
    let device = sys.join("bus/pci/devices/0000:41:00.0");
    std::fs::create_dir_all(&device).unwrap();
    std::fs::write(device.join("reset_method"), "flr bus\n").unwrap();
    let checks = crate::reset::reset_checks(&sys, &["41:00.0".to_string()]);
    assert_eq!(checks.len(), 1);
    assert_eq!(checks[0].name, "0000:41:00.0 reset");
    assert_eq!(checks[0].detail, "FLR");
    assert_eq!(checks[0].status, crate::host::CheckStatus::Ok);
    std::fs::write(device.join("reset_method"), "").unwrap();
    let checks = crate::reset::reset_checks(&sys, &["0000:41:00.0".to_string()]);
    assert_eq!(checks[0].status, crate::host::CheckStatus::Warn);
    assert!(checks[0].detail.contains("hot reset"), "{:?}", checks[0]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(reset_method_in(&dir), ResetMethod::None { .. }));
}

fn start_server_with(name: &str, options: EmuGpuOptions) -> std::path::PathBuf {
    let socket =
        std::env::temp_dir().join(format!("gpuvm-vfio-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let mut device = emu::EmuGpu::new(options).expect("device");
    let server =
        vfio_user::Server::new(&socket, true, device.irqs(), device.regions()).expect("listen");
    std::thread::spawn(move || server.run(&mut device));
    socket
}

fn open_over_vfio_user(socket: &std::path::Path) -> crate::Result<VfioPciDevice> {
    let backend = VfioUserDevice::connect(socket)?;
    let routes = Arc::new(RecordedRoutes::default());
    let mut allocate = |count: u32| -> std::io::Result<Vec<(u32, EventFd)>> {
        (0..count)
            .map(|i| Ok((i, EventFd::new(EFD_NONBLOCK)?)))
            .collect()
    };
    VfioPciDevice::new(Box::new(backend), &mut allocate, routes)
}

#[test]
fn a_vfio_user_device_whose_reset_fails_or_that_stays_dead_is_refused() {
    let refused = start_server_with(
        "reset-fails",
        EmuGpuOptions {
            reset_fails: true,
            ..EmuGpuOptions::default()
        },
    );
    let error = open_over_vfio_user(&refused).err().expect("refused");
    let message = error.to_string();
    assert!(
        matches!(error, crate::VfioError::Reset(_))
            && message.contains("VFIO_USER_DEVICE_RESET")
            && message.contains("refused"),
        "{message}"
    );

    let dead = start_server_with(
        "dead-after-reset",
        EmuGpuOptions {
            dead_after_reset: true,
            ..EmuGpuOptions::default()
        },
    );
    let message = open_over_vfio_user(&dead)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        message.contains("did not come back after reset by VFIO_USER_DEVICE_RESET")
            && message.contains("0xffffffff"),
        "{message}"
    );

    // The good device: reset, checked, usable.
    let good = start_server_with("reset-good", EmuGpuOptions::default());
    let mut device = open_over_vfio_user(&good).expect("attached");
    assert_eq!(read32(&mut device, 0) & 0xffff, 0x10de);
}

/// The emulated GPU's BAR registers behave as hardware's: all ones written reads back as
/// the size mask with the type bits (how Cloud Hypervisor and QEMU size a vfio-user
/// device's BARs), an address keeps only the bits its size decodes, and nothing else of
/// the header but the command register changes.
#[test]
fn the_emulated_gpus_bar_registers_size_as_hardware() {
    use vfio_user::ServerBackend;
    let options = EmuGpuOptions {
        bar1_size: 64 << 30,
        ..EmuGpuOptions::default()
    };
    let bar3_size = options.bar3_size;
    let mut device = emu::EmuGpu::new(options).expect("device");
    let read = |device: &mut emu::EmuGpu, offset: u64| {
        let mut data = [0u8; 4];
        device.region_read(7, offset, &mut data).unwrap();
        u32::from_le_bytes(data)
    };
    for register in [0x10u64, 0x14, 0x18, 0x1c, 0x20, 0x24] {
        device.region_write(7, register, &[0xff; 4]).unwrap();
    }
    let size_of = |low: u32, high: u32| !(u64::from(high) << 32 | u64::from(low & !0xf)) + 1;
    assert_eq!(
        read(&mut device, 0x10),
        !((16u32 << 20) - 1),
        "BAR0: 16 MiB, 32-bit"
    );
    let (low, high) = (read(&mut device, 0x14), read(&mut device, 0x18));
    assert_eq!(low & 0xf, 0xc, "BAR1: 64-bit prefetchable");
    assert_eq!(size_of(low, high), 64 << 30);
    let (low, high) = (read(&mut device, 0x1c), read(&mut device, 0x20));
    assert_eq!(size_of(low, high), bar3_size);
    assert_eq!(read(&mut device, 0x24), 0, "no BAR5");
    // An address (byte writes too) keeps what its size decodes.
    device
        .region_write(7, 0x14, &0x8000_000cu32.to_le_bytes())
        .unwrap();
    device.region_write(7, 0x18, &[0x40]).unwrap();
    assert_eq!(
        read(&mut device, 0x14),
        0xc,
        "below 64 GiB nothing is decoded"
    );
    assert_eq!(read(&mut device, 0x18), 0xffff_ff40);
    device
        .region_write(7, 0x18, &0x50u32.to_le_bytes())
        .unwrap();
    assert_eq!(read(&mut device, 0x18), 0x50);
    // The identity stays read-only.
    device.region_write(7, 0, &[0; 4]).unwrap();
    assert_eq!(read(&mut device, 0), 0x2330_10de);
}
