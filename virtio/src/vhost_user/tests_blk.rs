//! VhostUserBlock against the real qemu-storage-daemon.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_RO, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use vm_memory::{Bytes, GuestAddress};

use super::test_util::*;
use super::{
    Timeouts, VhostUserBlock, VhostUserBlockConfig, VhostUserConfig, VhostUserError,
    VhostUserGeneric,
};
use crate::{GuestMemory, VirtioDevice};

const QSD: &str = "qemu-storage-daemon";
const IMAGE_SIZE: u64 = 1 << 20;
const HEADER: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x30000;
/// `writeback` in the virtio-blk configuration space.
const WRITEBACK_OFFSET: u64 = 32;

fn pattern(sector: u64) -> Vec<u8> {
    (0..512u64)
        .map(|i| ((i * 7 + sector * 13) % 251) as u8)
        .collect()
}

/// A 1 MiB raw image (sector N holds `pattern(N)`) exported by qemu-storage-daemon.
struct Exported {
    backend: Backend,
    socket: TempPath,
    image: TempPath,
}

fn export(writable: bool) -> Exported {
    let image = TempPath(unique_path("disk.img"));
    let mut file = std::fs::File::create(&image.0).unwrap();
    for sector in 0..IMAGE_SIZE / 512 {
        file.write_all(&pattern(sector)).unwrap();
    }
    drop(file);
    let socket = TempPath(unique_path("blk.sock"));
    let mut backend = Backend::spawn(Command::new(QSD).args([
        "--blockdev".to_string(),
        format!("driver=file,node-name=file0,filename={}", image.0.display()),
        "--blockdev".to_string(),
        "driver=raw,node-name=disk0,file=file0".to_string(),
        "--export".to_string(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={},writable={}",
            socket.0.display(),
            if writable { "on" } else { "off" }
        ),
    ]));
    backend.wait_for_socket(&socket.0);
    Exported {
        backend,
        socket,
        image,
    }
}

/// An activated device over a ring in shareable guest memory.
struct Driver {
    memory: GuestMemory,
    ring: TestRing,
    kick: vmm_sys_util::eventfd::EventFd,
    interrupts: std::sync::mpsc::Receiver<u16>,
}

fn activate(
    device: &mut dyn VirtioDevice,
    memory: GuestMemory,
) -> Result<Driver, crate::ActivateError> {
    let features = interrupting_features(device);
    let Activated {
        mut rings,
        mut kicks,
        interrupts,
    } = activate_rings(device, &memory, features, &[(0, 128)])?;
    Ok(Driver {
        memory,
        ring: rings.remove(0),
        kick: kicks.remove(0),
        interrupts,
    })
}

impl Driver {
    /// One request on the ring; returns the status byte and the used length.
    fn request(&mut self, kind: u32, sector: u64, data: Option<&[u8]>) -> (u8, u32) {
        let m = &self.memory;
        m.write_obj(kind.to_le(), GuestAddress(HEADER)).unwrap();
        m.write_obj(0u32, GuestAddress(HEADER + 4)).unwrap();
        m.write_obj(sector.to_le(), GuestAddress(HEADER + 8))
            .unwrap();
        m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let device_writes_data = match data {
            Some(bytes) => {
                m.write_slice(bytes, GuestAddress(DATA)).unwrap();
                false
            }
            None => {
                m.write_slice(&[0u8; 512], GuestAddress(DATA)).unwrap();
                true
            }
        };
        let head = self.ring.submit(
            m,
            &[
                (HEADER, 16, false),
                (DATA, 512, device_writes_data),
                (STATUS, 1, true),
            ],
        );
        self.kick.write(1).unwrap();
        let (used_head, len) = self.ring.wait_used(m, &self.interrupts, 0);
        assert_eq!(used_head, u32::from(head));
        (m.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), len)
    }

    fn data(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; 512];
        self.memory
            .read_slice(&mut bytes, GuestAddress(DATA))
            .unwrap();
        bytes
    }
}

fn read_image(path: &Path, sector: u64) -> Vec<u8> {
    let mut file = std::fs::File::open(path).unwrap();
    file.seek(SeekFrom::Start(sector * 512)).unwrap();
    let mut bytes = vec![0u8; 512];
    file.read_exact(&mut bytes).unwrap();
    bytes
}

#[test]
fn reads_and_writes_through_qemu_storage_daemon() {
    if !have_backend(QSD, "reads_and_writes_through_qemu_storage_daemon") {
        return;
    }
    let exported = export(true);
    let config = VhostUserBlockConfig::new("data", &exported.socket.0);
    let mut device = VhostUserBlock::with_timeouts(config, timeouts()).unwrap();
    assert_eq!(device.device_type(), 2);
    assert_eq!(device.capacity_sectors(), IMAGE_SIZE / 512);
    let mut capacity = [0u8; 8];
    device.read_config(0, &mut capacity);
    assert_eq!(u64::from_le_bytes(capacity), 2048);
    assert!(!device.read_only());
    assert_eq!(
        device.device_features() & (1 << 30),
        0,
        "PROTOCOL_FEATURES is not a guest bit"
    );
    assert_eq!(device.queue_max_sizes(), vec![128]);

    let mut driver = activate(&mut device, shared_memory(4 << 20)).unwrap();
    let (status, len) = driver.request(VIRTIO_BLK_T_IN, 0, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(len, 513, "512 data bytes and the status byte");
    assert_eq!(driver.data(), pattern(0));

    let written: Vec<u8> = (0..512).map(|i| (i % 7) as u8 + 0xa0).collect();
    let (status, _) = driver.request(VIRTIO_BLK_T_OUT, 5, Some(&written));
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 5, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(driver.data(), written);
    assert_eq!(
        read_image(&exported.image.0, 5),
        written,
        "the image on the host changed"
    );

    // A read past the end: the backend's own error status.
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 4096, None);
    assert_ne!(u32::from(status), VIRTIO_BLK_S_OK);

    // Pause reports where the ring stands; resume serves again from there.
    let positions = device.pause();
    assert_eq!(positions.len(), 1);
    let position = positions[0].expect("queue 0 is active");
    assert_eq!((position.next_avail, position.next_used), (4, 4));
    device.resume().unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 1, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(driver.data(), pattern(1));

    // Reset, then a fresh activation over new rings.
    device.reset();
    let mut driver = activate(&mut device, driver.memory.clone()).unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 2, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(driver.data(), pattern(2));
    assert!(!device.is_broken());

    let refusal = device.snapshot_refusal().expect("snapshots are refused");
    assert!(refusal.contains("vhost-user-blk data"), "{refusal}");
    let state = device.save_state().unwrap();
    let error = device.restore_state(&state).unwrap_err().to_string();
    assert!(error.contains("DEVICE_STATE transfer"), "{error}");
}

#[test]
fn read_only_export_is_read_only() {
    if !have_backend(QSD, "read_only_export_is_read_only") {
        return;
    }
    let exported = export(false);
    let config = VhostUserBlockConfig::new("ro", &exported.socket.0);
    let device = VhostUserBlock::with_timeouts(config, timeouts()).unwrap();
    assert!(device.read_only());
    assert_ne!(device.device_features() & (1 << VIRTIO_BLK_F_RO), 0);
}

#[test]
fn memory_without_a_file_is_refused_clearly() {
    if !have_backend(QSD, "memory_without_a_file_is_refused_clearly") {
        return;
    }
    let exported = export(true);
    let config = VhostUserBlockConfig::new("anon", &exported.socket.0);
    let mut device = VhostUserBlock::with_timeouts(config, timeouts()).unwrap();
    let anonymous = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let error = activate(&mut device, anonymous).err().expect("refused");
    assert!(
        error.to_string().contains("not backed by a file"),
        "{error}"
    );
    // The device is still usable with shareable memory.
    let mut driver = activate(&mut device, shared_memory(4 << 20)).unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 0, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
}

#[test]
fn more_queues_than_the_backend_serves_is_refused() {
    if !have_backend(QSD, "more_queues_than_the_backend_serves_is_refused") {
        return;
    }
    let exported = export(true);
    let mut config = VhostUserBlockConfig::new("mq", &exported.socket.0);
    config.num_queues = 4;
    let error = VhostUserBlock::with_timeouts(config, timeouts())
        .err()
        .expect("refused");
    assert!(
        matches!(error, VhostUserError::Unsupported { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("needs 4"), "{error}");
}

#[test]
fn killed_backend_breaks_the_device_and_nothing_hangs() {
    if !have_backend(QSD, "killed_backend_breaks_the_device_and_nothing_hangs") {
        return;
    }
    let mut exported = export(true);
    let config = VhostUserBlockConfig::new("victim", &exported.socket.0);
    let mut device = VhostUserBlock::with_timeouts(config, timeouts()).unwrap();
    let mut driver = activate(&mut device, shared_memory(4 << 20)).unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 0, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);

    exported.backend.kill();
    wait_until_broken(|| device.is_broken());
    // The guest's next request is simply not answered.
    driver.ring.submit(
        &driver.memory,
        &[(HEADER, 16, false), (DATA, 512, true), (STATUS, 1, true)],
    );
    driver.kick.write(1).unwrap();
    assert!(driver
        .interrupts
        .recv_timeout(Duration::from_millis(300))
        .is_err());

    // Pause, resume, reset and a new activation end promptly with clear outcomes.
    let begin = Instant::now();
    let positions = device.pause();
    assert_eq!(positions.len(), 1);
    let error = device.resume().expect_err("a broken device cannot resume");
    assert!(error.to_string().contains("gone"), "{error}");
    device.reset();
    let error = activate(&mut device, driver.memory.clone())
        .err()
        .expect("refused");
    assert!(error.to_string().contains("gone"), "{error}");
    assert!(
        begin.elapsed() < Duration::from_secs(2),
        "{:?}",
        begin.elapsed()
    );
}

#[test]
fn a_second_device_on_a_busy_socket_fails_within_the_timeout() {
    if !have_backend(
        QSD,
        "a_second_device_on_a_busy_socket_fails_within_the_timeout",
    ) {
        return;
    }
    let exported = export(true);
    let first = VhostUserBlock::with_timeouts(
        VhostUserBlockConfig::new("one", &exported.socket.0),
        timeouts(),
    )
    .unwrap();
    let begin = Instant::now();
    let quick = Timeouts {
        connect: Duration::from_millis(500),
        reply: Duration::from_millis(500),
    };
    let second =
        VhostUserBlock::with_timeouts(VhostUserBlockConfig::new("two", &exported.socket.0), quick);
    let waited = begin.elapsed();
    // qemu-storage-daemon serves one frontend at a time: the second waits unanswered
    // (or is turned away) and gives up.
    let error = second.err().expect("the second device is refused");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    eprintln!("second device on one socket: {error}");
    assert!(!first.is_broken());
}

/// The generic device of type 2 on the same export: the backend's block features and its
/// GET_CONFIG answer reach the guest unchanged, and its queue serves requests.
#[test]
fn a_generic_device_of_type_2_serves_the_export() {
    if !have_backend(QSD, "a_generic_device_of_type_2_serves_the_export") {
        return;
    }
    let exported = export(false);
    let mut config = VhostUserConfig::new("gdisk", 2, &exported.socket.0);
    config.queue_size = 128;
    let mut device = VhostUserGeneric::with_timeouts(config, timeouts()).unwrap();
    assert_eq!(device.device_type(), 2);
    assert_eq!(device.name(), "vhost-user block gdisk");
    let mut capacity = [0u8; 8];
    device.read_config(0, &mut capacity);
    assert_eq!(u64::from_le_bytes(capacity), IMAGE_SIZE / 512);
    let features = device.device_features();
    assert_ne!(
        features & (1 << VIRTIO_BLK_F_RO),
        0,
        "the export is read-only"
    );
    assert_eq!(
        features & (1 << 30),
        0,
        "PROTOCOL_FEATURES is not a guest bit"
    );
    assert_eq!(features >> 32, 0, "transport bits are the transport's");
    assert_eq!(device.queue_max_sizes(), vec![128]);

    let mut driver = activate(&mut device, shared_memory(4 << 20)).unwrap();
    let (status, len) = driver.request(VIRTIO_BLK_T_IN, 3, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(len, 513);
    assert_eq!(driver.data(), pattern(3));
    device.reset();
    assert!(!device.is_broken());
}

/// The guest's write of a writable field (virtio-blk's `writeback`, behind CONFIG_WCE)
/// reaches qemu-storage-daemon through the generic device, which keeps serving.
#[test]
fn a_generic_device_passes_config_writes_to_the_backend() {
    if !have_backend(QSD, "a_generic_device_passes_config_writes_to_the_backend") {
        return;
    }
    let exported = export(true);
    let mut config = VhostUserConfig::new("gdisk", 2, &exported.socket.0);
    config.queue_size = 128;
    let mut device = VhostUserGeneric::with_timeouts(config, timeouts()).unwrap();
    assert_ne!(
        device.device_features() & (1 << VIRTIO_BLK_F_CONFIG_WCE),
        0,
        "qemu-storage-daemon offers CONFIG_WCE"
    );
    for writeback in [0u8, 1, 0] {
        device.write_config(WRITEBACK_OFFSET, &[writeback]);
        let mut read = [0xffu8];
        device.read_config(WRITEBACK_OFFSET, &mut read);
        assert_eq!(read[0], writeback, "writeback after writing {writeback}");
        assert!(!device.is_broken(), "the backend took the write");
    }
    // Past the end of the configuration space: not sent, nothing changes.
    device.write_config(4096, &[1]);
    assert!(!device.is_broken());
    let mut driver = activate(&mut device, shared_memory(4 << 20)).unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 7, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(driver.data(), pattern(7));
}

/// A live update's hand-over, within one process: the paused device gives up its
/// connection (a duplicate of the socket, what it negotiated); a device over another
/// mapping of the same guest RAM (the new process's, elsewhere in its address space)
/// adopts it without a word to the backend, is restored held, and once resumed
/// renegotiates and serves the same backend, which never sees a second connection (it
/// serves one frontend). The ring addresses it is told are in the numbering it learnt
/// from the first device (libvhost-user translates rings it knows through a new table, and
/// gives up when it cannot).
#[test]
fn an_adopted_connection_serves_on_through_another_mapping_of_guest_ram() {
    use std::os::unix::net::UnixStream;
    use vm_memory::{FileOffset, GuestMemoryBackend, GuestMemoryRegion};
    if !have_backend(
        QSD,
        "an_adopted_connection_serves_on_through_another_mapping_of_guest_ram",
    ) {
        return;
    }
    let exported = export(true);
    let config = VhostUserBlockConfig::new("data", &exported.socket.0);
    let mut device = VhostUserBlock::with_timeouts(config.clone(), timeouts()).unwrap();
    let memory = shared_memory(4 << 20);
    let mut driver = activate(&mut device, memory.clone()).unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 0, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    device.pause();
    let (live, socket) = device.hand_over().unwrap();
    assert_eq!(live.negotiated.memory.len(), 1, "{live:?}");
    let state = device.save_state().unwrap();

    let region = memory.iter().next().unwrap();
    let file = region.file_offset().unwrap().file().try_clone().unwrap();
    let again = GuestMemory::from_ranges_with_files([(
        GuestAddress(0),
        4 << 20,
        Some(FileOffset::new(file, 0)),
    )])
    .unwrap();
    assert_ne!(
        again.get_host_address(GuestAddress(0)).unwrap(),
        memory.get_host_address(GuestAddress(0)).unwrap(),
        "the second mapping is elsewhere"
    );
    let mut adopted = VhostUserBlock::adopting(config, UnixStream::from(socket), &live).unwrap();
    assert_eq!(adopted.capacity_sectors(), IMAGE_SIZE / 512);
    adopted.restore_state(&state).unwrap();
    let mut driver = activate(&mut adopted, again).unwrap();
    // Held: the backend heard nothing yet; the resume starts the rings.
    adopted.pause();
    adopted.resume().unwrap();
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 3, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(driver.data(), pattern(3));
    let written: Vec<u8> = (0..512).map(|i| (i % 11) as u8 + 0x30).collect();
    let (status, _) = driver.request(VIRTIO_BLK_T_OUT, 7, Some(&written));
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(read_image(&exported.image.0, 7), written);
    assert!(!adopted.is_broken());
    // The first device, given up, says nothing as it goes.
    drop(device);
    let (status, _) = driver.request(VIRTIO_BLK_T_IN, 7, None);
    assert_eq!(u32::from(status), VIRTIO_BLK_S_OK);
    assert_eq!(driver.data(), written);
}
