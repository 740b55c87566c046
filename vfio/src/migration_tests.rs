//! Migration v2: the emulated GPU saved and restored over real vfio-user sockets, hostile
//! or foreign saved states, and the kernel backend against a fake VFIO_DEVICE_FEATURE.

use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::emu::{self, regs, EmuGpuOptions, STATE_MAGIC};
use crate::migration::*;
use crate::user::VfioUserDevice;
use crate::{DmaRegion, PassthroughDevice, VfioError};

const BAR1: u32 = 1;
const CONFIG: u32 = crate::region::CONFIG;

/// Serves an emulated GPU on a fresh socket; listening before it returns (binding in the
/// server thread would race the client's connect).
fn serve(name: &str, options: EmuGpuOptions) -> PathBuf {
    let socket =
        std::env::temp_dir().join(format!("gpuvm-vfio-mig-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let mut device = emu::EmuGpu::new(options).expect("device");
    let server =
        vfio_user::Server::new(&socket, true, device.irqs(), device.regions()).expect("listen");
    std::thread::spawn(move || server.run(&mut device));
    socket
}

fn connect(name: &str, options: EmuGpuOptions) -> VfioUserDevice {
    VfioUserDevice::connect(&serve(name, options)).expect("connect")
}

fn write32(device: &mut dyn PassthroughDevice, offset: u64, value: u32) {
    device
        .region_write(0, offset, &value.to_le_bytes())
        .expect("BAR0 write");
}

fn read32(device: &mut dyn PassthroughDevice, offset: u64) -> u32 {
    let mut data = [0; 4];
    device.region_read(0, offset, &mut data).expect("BAR0 read");
    u32::from_le_bytes(data)
}

/// A 4 KiB page of BAR1 content that differs per offset.
fn bar1_page(offset: u64) -> Vec<u8> {
    (0..4096u64)
        .map(|i| (emu::pattern(offset, i) & 0xff) as u8)
        .collect()
}

const BAR1_PAGES: [u64; 3] = [0, 0x10_3000, (256 << 20) - 4096];
const DMA_GUEST: u64 = 0x4000_0000;
const DMA_SIZE: u64 = 1 << 20;

/// Device A with registers, BAR1 content and one job queued behind HOLD.
fn prepare_source(device: &mut dyn PassthroughDevice) {
    device
        .region_write(CONFIG, 4, &[0x06, 0])
        .expect("command: memory + bus master");
    for i in 0..8 {
        write32(device, regs::SCRATCH + i * 4, 0xa5a5_0000 + i as u32);
    }
    for offset in BAR1_PAGES {
        device
            .region_write(BAR1, offset, &bar1_page(offset))
            .expect("BAR1 write");
    }
    write32(device, regs::HOLD, 1);
    write32(device, regs::DMA_ADDR_LO, (DMA_GUEST + 0x2000) as u32);
    write32(device, regs::DMA_ADDR_HI, 0);
    write32(device, regs::DMA_LEN, 0x1000);
    write32(device, regs::DMA_SEED, 99);
    write32(device, regs::DOORBELL, 2);
    assert_eq!(read32(device, regs::QUEUED_JOBS), 1, "the doorbell is held");
    assert_eq!(read32(device, regs::DMA_DONE), 0, "no DMA while held");
}

fn save(device: &mut dyn PassthroughDevice) -> Vec<u8> {
    let mut blob = Vec::new();
    let n = save_device_state(device, &mut blob, 64 << 20).expect("save");
    assert_eq!(n, blob.len() as u64);
    blob
}

fn load(device: &mut dyn PassthroughDevice, blob: &[u8]) -> crate::Result<()> {
    load_device_state(device, &mut &blob[..], blob.len() as u64)
}

fn memfd(size: u64) -> std::fs::File {
    // SAFETY: memfd_create with a static name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"gpuvm-mig-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nobody else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(size).unwrap();
    file
}

#[test]
fn emulated_gpu_state_and_a_queued_doorbell_survive_save_and_load() {
    let mut a = connect("src", EmuGpuOptions::default());
    let mut b = connect("dst", EmuGpuOptions::default());
    let info = a.migration().expect("the emulated GPU migrates");
    assert_eq!(info.transport, "vfio-user migration region");
    assert!(info.stop_copy);
    prepare_source(&mut a);

    let blob = save(&mut a);
    assert_eq!(&blob[..8], &STATE_MAGIC);
    // Three non-zero pages of a 256 MiB BAR1, not the whole BAR.
    assert!(blob.len() < 64 << 10, "{} bytes", blob.len());
    // A is left stopped: a doorbell rung now queues instead of running.
    write32(&mut a, regs::HOLD, 0);
    assert_eq!(
        read32(&mut a, regs::QUEUED_JOBS),
        1,
        "a stopped device holds jobs"
    );
    a.set_migration_state(MigrationState::Running)
        .expect("A resumes");

    load(&mut b, &blob).expect("load into B");
    for i in 0..8 {
        assert_eq!(
            read32(&mut b, regs::SCRATCH + i * 4),
            0xa5a5_0000 + i as u32
        );
    }
    assert_eq!(read32(&mut b, regs::DMA_SEED), 99);
    assert_eq!(read32(&mut b, regs::HOLD), 1);
    assert_eq!(read32(&mut b, regs::QUEUED_JOBS), 1, "the job came along");
    let mut command = [0u8; 2];
    b.region_read(CONFIG, 4, &mut command).unwrap();
    assert_eq!(command, [0x06, 0], "command register");
    for offset in BAR1_PAGES {
        let mut page = vec![0u8; 4096];
        b.region_read(BAR1, offset, &mut page).unwrap();
        assert!(page == bar1_page(offset), "BAR1 page {offset:#x}");
    }
    let mut untouched = vec![0xffu8; 4096];
    b.region_read(BAR1, 0x20_0000, &mut untouched).unwrap();
    assert!(untouched.iter().all(|b| *b == 0), "zero pages stay zero");

    b.set_migration_state(MigrationState::Running)
        .expect("B runs");
    let ram = memfd(DMA_SIZE);
    b.dma_map(&DmaRegion {
        guest_addr: DMA_GUEST,
        size: DMA_SIZE,
        host_addr: 0,
        fd: ram.as_raw_fd(),
        fd_offset: 0,
    })
    .expect("DMA map");
    let vectors: Vec<_> = (0..4)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    b.enable_msix(&vectors.iter().collect::<Vec<_>>())
        .expect("MSI-X");
    assert_eq!(read32(&mut b, regs::DMA_DONE), 0, "still held on B");
    write32(&mut b, regs::HOLD, 0);
    assert_eq!(read32(&mut b, regs::DMA_DONE), 1, "the queued job ran on B");
    assert_eq!(read32(&mut b, regs::DMA_STATUS), 0);
    assert_eq!(read32(&mut b, regs::QUEUED_JOBS), 0);
    assert_eq!(vectors[2].read().expect("vector 2 fired"), 1);
    assert!(vectors[0].read().is_err() && vectors[1].read().is_err());
    let mut word = [0u8; 8];
    for addr in [DMA_GUEST + 0x2000, DMA_GUEST + 0x2ff8] {
        ram.read_exact_at(&mut word, addr - DMA_GUEST).unwrap();
        assert_eq!(
            u64::from_le_bytes(word),
            emu::pattern(99, addr),
            "{addr:#x}"
        );
    }
    ram.read_exact_at(&mut word, 0x3000).unwrap();
    assert_eq!(word, [0; 8], "nothing past the job's range");

    // A stopped B neither DMAs nor interrupts; the doorbell runs once it is RUNNING.
    b.set_migration_state(MigrationState::Stop).unwrap();
    write32(&mut b, regs::DMA_SEED, 5);
    write32(&mut b, regs::DOORBELL, 1);
    assert_eq!(read32(&mut b, regs::DMA_DONE), 1, "no DMA while stopped");
    assert!(vectors[1].read().is_err(), "no interrupt while stopped");
    b.set_migration_state(MigrationState::Running).unwrap();
    assert_eq!(read32(&mut b, regs::DMA_DONE), 2);
    assert_eq!(vectors[1].read().expect("vector 1 fired"), 1);
    ram.read_exact_at(&mut word, 0x2000).unwrap();
    assert_eq!(
        u64::from_le_bytes(word),
        emu::pattern(5, DMA_GUEST + 0x2000)
    );
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Re-seals a modified blob with a valid checksum (so only the field check can refuse it).
fn reseal(mut blob: Vec<u8>) -> Vec<u8> {
    let body = blob.len() - 8;
    let checksum = fnv1a(&blob[..body]);
    blob[body..].copy_from_slice(&checksum.to_le_bytes());
    blob
}

fn assert_refused(device: &mut VfioUserDevice, blob: &[u8], what: &str) {
    let error = load(device, blob).expect_err(what);
    let message = error.to_string();
    assert!(
        matches!(
            error,
            VfioError::MigrationArc { .. } | VfioError::MigrationData { .. }
        ),
        "{what}: {message}"
    );
    assert!(message.contains("dst-bad"), "names the device: {message}");
    log::info!("{what}: {message}");
    // The device was reset: a fresh, running device that still takes a good state.
    assert_eq!(read32(device, regs::SCRATCH), 0, "{what}: nothing applied");
}

#[test]
fn foreign_truncated_and_corrupt_states_are_refused() {
    let mut a = connect("src-bad", EmuGpuOptions::default());
    let mut b = connect("dst-bad", EmuGpuOptions::default());
    prepare_source(&mut a);
    let blob = save(&mut a);

    let truncated = &blob[..blob.len() - 100];
    assert_refused(&mut b, truncated, "truncated");
    let message = load(&mut b, truncated).unwrap_err().to_string();
    assert!(message.contains("truncated"), "{message}");

    let mut corrupt = blob.clone();
    corrupt[blob.len() / 2] ^= 0x40;
    assert_refused(&mut b, &corrupt, "corrupt");
    let message = load(&mut b, &corrupt).unwrap_err().to_string();
    assert!(message.contains("corrupt"), "{message}");

    // Header: magic 8, version 4, vendor 2, device 2, vectors 2, BAR0/1/3 sizes 8 each.
    let header = 8 + 4 + 2 + 2 + 2 + 24;
    let mut foreign = blob.clone();
    foreign[14..16].copy_from_slice(&0x2331u16.to_le_bytes());
    let foreign = reseal(foreign);
    assert_refused(&mut b, &foreign, "another device id");
    let message = load(&mut b, &foreign).unwrap_err().to_string();
    assert!(message.contains("another device model"), "{message}");

    let mut not_a_state = blob.clone();
    not_a_state[0] = b'X';
    assert_refused(&mut b, &not_a_state, "bad magic");

    // The first page record (region 1, offset 0) moved past the end of BAR1.
    let pages_at = blob.len() - 8 - BAR1_PAGES.len() * (4 + 8 + 4096) - 4;
    assert_eq!(
        u32::from_le_bytes(blob[pages_at..pages_at + 4].try_into().unwrap()),
        3
    );
    let mut outside = blob.clone();
    let offset_at = pages_at + 4 + 4;
    outside[offset_at..offset_at + 8].copy_from_slice(&(256u64 << 20).to_le_bytes());
    let outside = reseal(outside);
    assert_refused(&mut b, &outside, "page outside BAR1");
    let message = load(&mut b, &outside).unwrap_err().to_string();
    assert!(message.contains("outside the device"), "{message}");

    // A page count far beyond the BAR: refused, no allocation for it.
    let mut many = blob.clone();
    many[pages_at..pages_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_refused(&mut b, &reseal(many), "huge page count");

    // A state from a device with another BAR1 size.
    let mut c = connect(
        "src-small",
        EmuGpuOptions {
            bar1_size: 64 << 20,
            ..EmuGpuOptions::default()
        },
    );
    let small = save(&mut c);
    assert!(small.len() > header);
    assert_refused(&mut b, &small, "another BAR1 size");

    // A length the input cannot deliver: an I/O error, the device reset.
    let error = load_device_state(&mut b, &mut &blob[..10], 1 << 40).unwrap_err();
    assert!(matches!(error, VfioError::Io(_)), "{error}");

    // After all that, B still loads the good state.
    load(&mut b, &blob).expect("the good state loads");
    assert_eq!(read32(&mut b, regs::SCRATCH), 0xa5a5_0000);
}

#[test]
fn a_device_without_migration_is_refused_clearly() {
    let mut device = connect(
        "nomig",
        EmuGpuOptions {
            migration: false,
            ..EmuGpuOptions::default()
        },
    );
    assert_eq!(device.migration(), None);
    let error = save_device_state(&mut device, &mut Vec::new(), 1 << 20).unwrap_err();
    assert!(
        matches!(error, VfioError::MigrationUnsupported(_)),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("nomig") && message.contains("migration"),
        "{message}"
    );
    let error = load(&mut device, &[0; 64]).unwrap_err();
    assert!(
        matches!(error, VfioError::MigrationUnsupported(_)),
        "{error}"
    );
    // The device still works.
    write32(&mut device, regs::SCRATCH, 7);
    assert_eq!(read32(&mut device, regs::SCRATCH), 7);
}

// ----- The kernel backend against a fake kernel -----

#[derive(Default)]
struct FakeKernel {
    /// Answer the MIGRATION probe with these flags (None: no migration v2).
    flags: Option<u64>,
    /// Refuse this arc (uapi values) with EINVAL.
    refuse: Option<(u32, u32)>,
    state: u32,
    /// What STOP_COPY streams, and how far it has been read.
    saved: Vec<u8>,
    read_at: usize,
    /// What RESUMING received.
    loaded: Vec<u8>,
    /// The data fd is open (STOP_COPY or RESUMING).
    data_fd: bool,
    /// Every state set, in order (uapi values).
    walk: Vec<u32>,
    /// Never end the STOP_COPY stream (a hostile device).
    endless: bool,
}

/// The kernel's side, as vfio-ioctls' VfioDevice would reach it.
struct FakeOps(Arc<Mutex<FakeKernel>>);

fn errno(code: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(code)
}

impl MigrationOps for FakeOps {
    fn query_migration_support(&self) -> std::io::Result<Option<u64>> {
        Ok(self.0.lock().unwrap().flags)
    }

    fn set_migration_state(&self, to: u32) -> std::io::Result<()> {
        let mut fake = self.0.lock().unwrap();
        assert!(
            fake.flags.is_some(),
            "no state change on a device without migration"
        );
        let from = fake.state;
        fake.walk.push(to);
        // The kernel's single arcs (STOP 1, RUNNING 2, STOP_COPY 3, RESUMING 4).
        let allowed = matches!(
            (from, to),
            (2, 1) | (1, 2) | (1, 3) | (3, 1) | (1, 4) | (4, 1)
        );
        assert!(allowed, "arc {from} -> {to} is not a single kernel arc");
        if fake.refuse == Some((from, to)) {
            return Err(errno(libc::EINVAL));
        }
        fake.state = to;
        fake.data_fd = matches!(to, 3 | 4);
        if to == 3 {
            fake.read_at = 0;
        }
        if to == 4 {
            fake.loaded.clear();
        }
        Ok(())
    }

    fn read_migration_data(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut fake = self.0.lock().unwrap();
        if !fake.data_fd || fake.state != 3 {
            return Err(errno(libc::EBADF));
        }
        if fake.endless {
            buf.fill(0xee);
            return Ok(buf.len());
        }
        let n = buf.len().min(fake.saved.len() - fake.read_at);
        // Short reads, as a pipe gives them.
        let n = n.min(4000);
        buf[..n].copy_from_slice(&fake.saved[fake.read_at..fake.read_at + n]);
        fake.read_at += n;
        Ok(n)
    }

    fn write_migration_data(&self, data: &[u8]) -> std::io::Result<()> {
        let mut fake = self.0.lock().unwrap();
        if !fake.data_fd || fake.state != 4 {
            return Err(errno(libc::EBADF));
        }
        fake.loaded.extend_from_slice(data);
        Ok(())
    }
}

/// A device with only the kernel migration path (the rest is not needed here).
struct KernelMigrationDevice {
    ops: FakeOps,
    migration: KernelMigration,
}

impl PassthroughDevice for KernelMigrationDevice {
    fn name(&self) -> String {
        "0000:41:00.0".into()
    }
    fn region_info(&self, _index: u32) -> Option<crate::RegionInfo> {
        None
    }
    fn region_read(&mut self, index: u32, _offset: u64, _data: &mut [u8]) -> crate::Result<()> {
        Err(VfioError::NoRegion(index))
    }
    fn region_write(&mut self, index: u32, _offset: u64, _data: &[u8]) -> crate::Result<()> {
        Err(VfioError::NoRegion(index))
    }
    fn mmap_region(&mut self, index: u32, _o: u64, _s: u64) -> crate::Result<Option<*mut u8>> {
        Err(VfioError::NoRegion(index))
    }
    fn msix_vectors(&mut self) -> crate::Result<u32> {
        Ok(0)
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
        let mut fake = self.ops.0.lock().unwrap();
        fake.state = 2;
        fake.data_fd = false;
        self.migration.reset();
        Ok(())
    }
    fn migration(&mut self) -> Option<MigrationInfo> {
        self.migration.info()
    }
    fn set_migration_state(&mut self, state: MigrationState) -> crate::Result<()> {
        self.migration.set_state(&self.ops, state)
    }
    fn read_migration_data(&mut self, buf: &mut [u8]) -> crate::Result<usize> {
        self.migration.read(&self.ops, buf)
    }
    fn write_migration_data(&mut self, data: &[u8]) -> crate::Result<()> {
        self.migration.write(&self.ops, data)
    }
}

fn kernel_device(fake: FakeKernel) -> (KernelMigrationDevice, Arc<Mutex<FakeKernel>>) {
    let shared = Arc::new(Mutex::new(FakeKernel { state: 2, ..fake }));
    let ops = FakeOps(shared.clone());
    let migration = KernelMigration::probe(&ops, "0000:41:00.0".into());
    (KernelMigrationDevice { ops, migration }, shared)
}

#[test]
fn kernel_migration_saves_and_loads_through_the_data_fd() {
    let state: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let (mut device, fake) = kernel_device(FakeKernel {
        flags: Some((VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_P2P).into()),
        saved: state.clone(),
        ..FakeKernel::default()
    });
    assert_eq!(
        device.migration(),
        Some(MigrationInfo {
            stop_copy: true,
            p2p: true,
            pre_copy: false,
            transport: "kernel VFIO migration v2",
        })
    );
    let mut blob = Vec::new();
    assert_eq!(
        save_device_state(&mut device, &mut blob, 1 << 20).unwrap(),
        50_000
    );
    assert!(blob == state, "the stream arrives whole");
    assert_eq!(
        fake.lock().unwrap().walk,
        [1, 3, 1],
        "RUNNING->STOP->STOP_COPY->STOP"
    );
    device.set_migration_state(MigrationState::Running).unwrap();
    assert_eq!(fake.lock().unwrap().state, 2);

    // A fresh device: STOP, RESUMING, data, STOP.
    let (mut target, fake) = kernel_device(FakeKernel {
        flags: Some(VFIO_MIGRATION_STOP_COPY.into()),
        ..FakeKernel::default()
    });
    load(&mut target, &blob).expect("load");
    let fake = fake.lock().unwrap();
    assert_eq!(fake.walk, [1, 4, 1]);
    assert!(fake.loaded == state, "the device received the state");
    assert_eq!(fake.state, 1, "left STOPPED");
}

#[test]
fn kernel_migration_refusals_are_clear() {
    // No feature: ENOTTY on the probe.
    let (mut device, fake) = kernel_device(FakeKernel::default());
    assert_eq!(device.migration(), None);
    let error = save_device_state(&mut device, &mut Vec::new(), 1 << 20).unwrap_err();
    assert!(
        matches!(error, VfioError::MigrationUnsupported(_)),
        "{error}"
    );
    assert!(error.to_string().contains("0000:41:00.0"), "{error}");
    assert!(
        fake.lock().unwrap().walk.is_empty(),
        "no state change tried"
    );

    // A refused arc: the error names the device, the arc and the kernel's answer.
    let (mut device, fake) = kernel_device(FakeKernel {
        flags: Some(VFIO_MIGRATION_STOP_COPY.into()),
        refuse: Some((1, 3)),
        saved: vec![1; 100],
        ..FakeKernel::default()
    });
    let error = save_device_state(&mut device, &mut Vec::new(), 1 << 20).unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(
            error,
            VfioError::MigrationArc {
                from: MigrationState::Stop,
                to: MigrationState::StopCopy,
                ..
            }
        ),
        "{message}"
    );
    assert!(
        message.contains("0000:41:00.0") && message.contains("Invalid argument"),
        "{message}"
    );
    assert_eq!(fake.lock().unwrap().walk, [1, 3]);

    // More state than the limit: an error, and the device is back in STOP.
    let (mut device, fake) = kernel_device(FakeKernel {
        flags: Some(VFIO_MIGRATION_STOP_COPY.into()),
        saved: vec![9; 10_000],
        ..FakeKernel::default()
    });
    let error = save_device_state(&mut device, &mut Vec::new(), 4096).unwrap_err();
    assert!(matches!(error, VfioError::MigrationData { .. }), "{error}");
    assert!(error.to_string().contains("4096-byte limit"), "{error}");
    assert_eq!(fake.lock().unwrap().state, 1);
    assert_eq!(fake.lock().unwrap().walk, [1, 3, 1]);

    // The device refuses the loaded state (RESUMING -> STOP fails): an error, and the
    // device is reset to RUNNING.
    let (mut device, fake) = kernel_device(FakeKernel {
        flags: Some(VFIO_MIGRATION_STOP_COPY.into()),
        refuse: Some((4, 1)),
        ..FakeKernel::default()
    });
    let error = load(&mut device, &[1, 2, 3]).unwrap_err();
    assert!(
        matches!(
            error,
            VfioError::MigrationArc {
                from: MigrationState::Resuming,
                to: MigrationState::Stop,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(fake.lock().unwrap().walk, [1, 4, 1]);
    assert_eq!(fake.lock().unwrap().state, 2, "reset: running again");
    assert_eq!(device.migration.state(), MigrationState::Running);

    // Arcs the kernel does not take in one step are refused before any ioctl.
    let (mut device, fake) = kernel_device(FakeKernel {
        flags: Some(VFIO_MIGRATION_STOP_COPY.into()),
        ..FakeKernel::default()
    });
    let error = device
        .set_migration_state(MigrationState::StopCopy)
        .unwrap_err();
    assert!(error.to_string().contains("single arc"), "{error}");
    assert!(fake.lock().unwrap().walk.is_empty());
    // Reading state outside STOP_COPY is an error, not a hang.
    assert!(device.read_migration_data(&mut [0; 16]).is_err());
}

/// A device whose state never ends: the limit stops the save.
#[test]
fn an_endless_device_state_hits_the_limit() {
    let (mut device, fake) = kernel_device(FakeKernel {
        flags: Some(VFIO_MIGRATION_STOP_COPY.into()),
        endless: true,
        ..FakeKernel::default()
    });
    let mut out = Vec::new();
    let error = save_device_state(&mut device, &mut out, 1 << 20).unwrap_err();
    assert!(matches!(error, VfioError::MigrationData { .. }), "{error}");
    assert!(out.len() <= 1 << 20);
    assert_eq!(fake.lock().unwrap().state, 1, "left STOPPED");
}

// ----- A hostile vfio-user device behind the migration region -----

/// How the hostile device lies.
#[derive(Clone, Copy)]
enum Lie {
    /// data_size far beyond the window.
    HugeDataSize,
    /// pending_bytes never reaches 0.
    EndlessPending,
}

struct HostileDevice {
    lie: Lie,
    device_state: u32,
}

const HOSTILE_REGION_SIZE: u64 = 0x2000;

impl vfio_user::ServerBackend for HostileDevice {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        let value: u64 = match (region, offset) {
            (7, 0) => 0x2330_10de,
            (9, 0) => u64::from(self.device_state),
            (9, 8) => 1 << 40,
            (9, 16) => 0x1000,
            (9, 24) => match self.lie {
                Lie::HugeDataSize => 1 << 30,
                Lie::EndlessPending => 0x1000,
            },
            (9, _) => 0xabab_abab_abab_abab,
            _ => 0,
        };
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = value.to_le_bytes()[i % 8];
        }
        Ok(())
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if region == 9 && offset == 0 && data.len() == 4 {
            self.device_state = u32::from_le_bytes(data.try_into().unwrap());
        }
        Ok(())
    }
    fn dma_map(
        &mut self,
        _flags: vfio_user::DmaMapFlags,
        _offset: u64,
        _address: u64,
        _size: u64,
        _fd: Option<std::fs::File>,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn dma_unmap(
        &mut self,
        _flags: vfio_user::DmaUnmapFlags,
        _address: u64,
        _size: u64,
    ) -> std::io::Result<()> {
        Ok(())
    }
    fn reset(&mut self) -> std::io::Result<()> {
        self.device_state = emu::MIG_V1_RUNNING;
        Ok(())
    }
    fn set_irqs(
        &mut self,
        _index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        _fds: Vec<std::fs::File>,
    ) -> std::io::Result<()> {
        Ok(())
    }
}

fn hostile(name: &str, lie: Lie) -> VfioUserDevice {
    use vfio_bindings::bindings::vfio::vfio_region_info;
    let socket =
        std::env::temp_dir().join(format!("gpuvm-vfio-mig-{name}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let regions = (0..10u32)
        .map(|index| vfio_user::ServerRegion {
            region_info: vfio_region_info {
                argsz: std::mem::size_of::<vfio_region_info>() as u32,
                flags: crate::REGION_READ | crate::REGION_WRITE,
                index,
                cap_offset: 0,
                size: match index {
                    7 => 4096,
                    9 => HOSTILE_REGION_SIZE,
                    _ => 0,
                },
                offset: 0,
            },
            sparse_areas: Vec::new(),
            mmap_fd: None,
        })
        .collect();
    let server = vfio_user::Server::new(&socket, true, Vec::new(), regions).expect("server");
    std::thread::spawn(move || {
        let mut device = HostileDevice {
            lie,
            device_state: emu::MIG_V1_RUNNING,
        };
        server.run(&mut device)
    });
    VfioUserDevice::connect(&socket).expect("connect")
}

#[test]
fn a_hostile_vfio_user_migration_region_is_bounded() {
    let mut device = hostile("huge", Lie::HugeDataSize);
    assert!(device.migration().is_some());
    let error = save_device_state(&mut device, &mut Vec::new(), 1 << 20).unwrap_err();
    assert!(matches!(error, VfioError::MigrationData { .. }), "{error}");
    assert!(
        error.to_string().contains("data_size 0x40000000"),
        "{error}"
    );

    let mut device = hostile("endless", Lie::EndlessPending);
    let mut out = Vec::new();
    let error = save_device_state(&mut device, &mut out, 1 << 20).unwrap_err();
    assert!(error.to_string().contains("limit"), "{error}");
    assert!(out.len() <= 1 << 20);
    assert!(out.iter().all(|b| *b == 0xab), "the window's bytes");
}
