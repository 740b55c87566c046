//! The vfio-user path end to end inside one process: the emulated GPU served on a socket,
//! a VfioPciDevice over the vfio-user client, guest RAM as a memfd.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::{BarKind, MsiMessage, MsiRouting, PciDevice};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::emu::{self, regs, EmuGpuOptions};
use crate::pci::VfioPciDevice;
use crate::user::VfioUserDevice;
use crate::DmaRegion;

#[derive(Default)]
struct Routes(Mutex<BTreeMap<u32, MsiMessage>>);

impl MsiRouting for Routes {
    fn set_route(&self, gsi: u32, message: Option<MsiMessage>) -> std::io::Result<()> {
        let mut routes = self.0.lock().unwrap();
        match message {
            Some(message) => routes.insert(gsi, message),
            None => routes.remove(&gsi),
        };
        Ok(())
    }
}

fn start_server(name: &str) -> std::path::PathBuf {
    let socket =
        std::env::temp_dir().join(format!("gpuvm-vfio-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let path = socket.clone();
    std::thread::spawn(move || emu::serve(&path, EmuGpuOptions::default()));
    for _ in 0..200 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
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
    let routes = Arc::new(Routes::default());
    let mut eventfds_seen = Vec::new();
    let mut allocate = |count: u32| -> std::io::Result<Vec<(u32, EventFd)>> {
        (0..count)
            .map(|i| {
                let fd = EventFd::new(EFD_NONBLOCK)?;
                eventfds_seen.push(fd.try_clone()?);
                Ok((24 + i, fd))
            })
            .collect()
    };
    let mut device =
        VfioPciDevice::new(Box::new(backend), &mut allocate, routes.clone()).expect("device");
    assert_eq!(eventfds_seen.len(), 4);
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
        routes.0.lock().unwrap().get(&25),
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
    // Out of the mapped range: status 1.
    device.bar_write(0, regs::DMA_ADDR_LO, &0x20_0000u32.to_le_bytes());
    device.bar_write(0, regs::DOORBELL, &1u32.to_le_bytes());
    device.bar_read(0, regs::DMA_STATUS, &mut data);
    assert_eq!(u32::from_le_bytes(data), 1);
    drop(device);
    // SAFETY: closing the fd we created.
    unsafe { libc::close(memfd.as_raw_fd()) };
}
