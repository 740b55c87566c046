//! VhostUserFs against the real virtiofsd.

use std::process::Command;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::{Bytes, GuestAddress};

use super::test_util::*;
use super::{FsConfig, VhostUserError, VhostUserFs};
use crate::VirtioDevice;

const VIRTIOFSD: &str = "virtiofsd";
const FUSE_INIT: u32 = 26;
const REQUEST: u64 = 0x10_0000;
const REPLY: u64 = 0x11_0000;
/// The high-priority ring and one request ring: (base, size).
const HIPRIO_AND_REQUESTS: &[(u64, u16)] = &[(0, 1024), (0x8000, 1024)];

struct Served {
    backend: Backend,
    socket: TempPath,
    _shared: TempPath,
    /// virtiofsd writes `<socket>.pid` next to its socket.
    _pid_file: TempPath,
}

fn serve() -> Served {
    let shared = TempPath(unique_path("shared"));
    std::fs::create_dir(&shared.0).unwrap();
    std::fs::write(shared.0.join("hello.txt"), b"hello from the host\n").unwrap();
    let socket = TempPath(unique_path("fs.sock"));
    let mut backend = Backend::spawn(Command::new(VIRTIOFSD).args([
        format!("--socket-path={}", socket.0.display()),
        format!("--shared-dir={}", shared.0.display()),
        "--sandbox".to_string(),
        "none".to_string(),
    ]));
    backend.wait_for_socket(&socket.0);
    let pid_file = TempPath(format!("{}.pid", socket.0.display()).into());
    Served {
        backend,
        socket,
        _shared: shared,
        _pid_file: pid_file,
    }
}

/// fuse_in_header + fuse_init_in (protocol 7.31), 104 bytes.
fn fuse_init_request(unique: u64) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&104u32.to_le_bytes()); // len
    bytes.extend_from_slice(&FUSE_INIT.to_le_bytes()); // opcode
    bytes.extend_from_slice(&unique.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes()); // nodeid
    bytes.extend_from_slice(&[0u8; 12]); // uid, gid, pid
    bytes.extend_from_slice(&[0u8; 4]); // total_extlen, padding
    bytes.extend_from_slice(&7u32.to_le_bytes()); // major
    bytes.extend_from_slice(&31u32.to_le_bytes()); // minor
    bytes.extend_from_slice(&(128u32 << 10).to_le_bytes()); // max_readahead
    bytes.extend_from_slice(&0u32.to_le_bytes()); // flags
    bytes.extend_from_slice(&[0u8; 48]); // flags2, unused[11]
    assert_eq!(bytes.len(), 104);
    bytes
}

#[test]
fn fuse_init_through_virtiofsd() {
    if !have_backend(VIRTIOFSD, "fuse_init_through_virtiofsd") {
        return;
    }
    let served = serve();
    let config = FsConfig::new("shared", &served.socket.0);
    let mut device = VhostUserFs::with_timeouts(config, timeouts()).unwrap();
    assert_eq!(device.device_type(), 26);
    assert_eq!(device.queue_max_sizes(), vec![1024, 1024]);
    let mut space = [0u8; 40];
    device.read_config(0, &mut space);
    assert_eq!(&space[..6], b"shared");
    assert!(space[6..36].iter().all(|&b| b == 0));
    assert_eq!(u32::from_le_bytes(space[36..40].try_into().unwrap()), 1);

    let memory = shared_memory(4 << 20);
    let features = interrupting_features(&device);
    let Activated {
        mut rings,
        kicks,
        interrupts,
    } = activate_rings(&mut device, &memory, features, HIPRIO_AND_REQUESTS).unwrap();
    let requests = &mut rings[1];
    let request_kick = &kicks[1];

    let unique = 0x1234_5678_9abc;
    memory
        .write_slice(&fuse_init_request(unique), GuestAddress(REQUEST))
        .unwrap();
    let head = requests.submit(&memory, &[(REQUEST, 104, false), (REPLY, 256, true)]);
    request_kick.write(1).unwrap();
    let (used_head, written) = requests.wait_used(&memory, &interrupts, 1);
    assert_eq!(used_head, u32::from(head));
    let mut header = [0u8; 16];
    memory.read_slice(&mut header, GuestAddress(REPLY)).unwrap();
    let len = u32::from_le_bytes(header[0..4].try_into().unwrap());
    let error = i32::from_le_bytes(header[4..8].try_into().unwrap());
    let reply_unique = u64::from_le_bytes(header[8..16].try_into().unwrap());
    assert_eq!(error, 0, "FUSE_INIT failed");
    assert_eq!(reply_unique, unique);
    assert!(
        len >= 16 + 24,
        "a fuse_init_out follows the header ({len} bytes)"
    );
    assert_eq!(written, len, "the used length is the reply's");
    let major = u32::from_le_bytes({
        let mut b = [0u8; 4];
        memory.read_slice(&mut b, GuestAddress(REPLY + 16)).unwrap();
        b
    });
    assert_eq!(major, 7);

    // Pause / resume / reset complete and keep the device healthy.
    let positions = device.pause();
    assert_eq!(positions.len(), 2);
    assert_eq!(
        positions[1].map(|p| (p.next_avail, p.next_used)),
        Some((1, 1))
    );
    device.resume().unwrap();
    device.reset();
    assert!(!device.is_broken());
    assert!(device
        .snapshot_refusal()
        .unwrap()
        .contains("vhost-user-fs shared"));
}

#[test]
fn killed_virtiofsd_breaks_the_device() {
    if !have_backend(VIRTIOFSD, "killed_virtiofsd_breaks_the_device") {
        return;
    }
    let mut served = serve();
    let config = FsConfig::new("victim", &served.socket.0);
    let mut device = VhostUserFs::with_timeouts(config, timeouts()).unwrap();
    let memory = shared_memory(4 << 20);
    let _activated = activate_rings(
        &mut device,
        &memory,
        1 << VIRTIO_F_VERSION_1,
        HIPRIO_AND_REQUESTS,
    )
    .unwrap();
    served.backend.kill();
    wait_until_broken(|| device.is_broken());
    let begin = Instant::now();
    device.reset();
    assert!(begin.elapsed() < Duration::from_secs(2));
}

#[test]
fn more_request_queues_than_virtiofsd_serves_is_refused() {
    if !have_backend(
        VIRTIOFSD,
        "more_request_queues_than_virtiofsd_serves_is_refused",
    ) {
        return;
    }
    let served = serve();
    let mut config = FsConfig::new("mq", &served.socket.0);
    config.num_queues = 8;
    match VhostUserFs::with_timeouts(config, timeouts()) {
        Err(VhostUserError::Unsupported { missing, .. }) => {
            eprintln!("virtiofsd refused 8 request queues: {missing}");
            assert!(missing.contains("needs 9"), "{missing}")
        }
        Err(other) => panic!("unexpected error: {other}"),
        // virtiofsd versions that serve many request queues take it.
        Ok(device) => assert_eq!(device.queue_max_sizes().len(), 9),
    }
}
