//! The frontend against peers that misbehave: nobody listening, garbage, silence, a
//! hang-up mid-negotiation; and configurations refused before connecting.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc::{channel, Receiver};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::test_util::{unique_path, TempPath};
use super::{
    FsConfig, Timeouts, VhostUserBlock, VhostUserBlockConfig, VhostUserError, VhostUserFs,
};

const QUICK: Timeouts = Timeouts {
    connect: Duration::from_millis(300),
    reply: Duration::from_millis(300),
};

/// GET_FEATURES (1), GET_PROTOCOL_FEATURES (15).
const GET_FEATURES: u32 = 1;
const GET_PROTOCOL_FEATURES: u32 = 15;
/// Version 1, and the reply bit.
const REPLY_FLAGS: u32 = 0x1 | 0x4;

/// A peer that accepts one connection and hands it to `behave`; it keeps the stream open
/// until the test drops `release` (or 10 s pass).
struct Peer {
    socket: TempPath,
    release: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    fn start(behave: impl FnOnce(&mut UnixStream) + Send + 'static) -> Peer {
        let socket = TempPath(unique_path("peer.sock"));
        let listener = UnixListener::bind(&socket.0).unwrap();
        let (release, released) = channel::<()>();
        let thread = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            behave(&mut stream);
            hold(&released);
        });
        Peer {
            socket,
            release: Some(release),
            thread: Some(thread),
        }
    }
}

fn hold(released: &Receiver<()>) {
    let _ = released.recv_timeout(Duration::from_secs(10));
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn read_header(stream: &mut UnixStream) -> Option<(u32, u32, u32)> {
    let mut header = [0u8; 12];
    stream.read_exact(&mut header).ok()?;
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
    Some((word(0), word(4), word(8)))
}

fn reply_u64(stream: &mut UnixStream, request: u32, value: u64) {
    let mut message = Vec::new();
    message.extend_from_slice(&request.to_le_bytes());
    message.extend_from_slice(&REPLY_FLAGS.to_le_bytes());
    message.extend_from_slice(&8u32.to_le_bytes());
    message.extend_from_slice(&value.to_le_bytes());
    stream.write_all(&message).unwrap();
}

fn connect_block(socket: &std::path::Path) -> (Result<VhostUserBlock, VhostUserError>, Duration) {
    let begin = Instant::now();
    let result = VhostUserBlock::with_timeouts(VhostUserBlockConfig::new("peer", socket), QUICK);
    (result, begin.elapsed())
}

#[test]
fn nobody_listening_fails_within_the_connect_timeout() {
    let socket = TempPath(unique_path("nobody.sock"));
    let (result, waited) = connect_block(&socket.0);
    let error = result.err().expect("no backend");
    assert!(
        matches!(error, VhostUserError::ConnectTimeout { .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains(&socket.0.display().to_string()),
        "{error}"
    );
    assert!(
        waited >= QUICK.connect && waited < Duration::from_secs(2),
        "{waited:?}"
    );

    // A socket file whose listener is gone: refused, retried, then the same error.
    let listener = UnixListener::bind(&socket.0).unwrap();
    drop(listener);
    let (result, waited) = connect_block(&socket.0);
    let error = result.err().expect("no backend");
    assert!(
        matches!(error, VhostUserError::ConnectTimeout { .. }),
        "{error}"
    );
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn a_path_that_is_not_a_socket_is_refused() {
    let file = TempPath(unique_path("plain-file"));
    std::fs::write(&file.0, b"not a socket").unwrap();
    let (result, waited) = connect_block(&file.0);
    let error = result.err().expect("not a socket");
    assert!(error.to_string().contains("cannot connect"), "{error}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn a_peer_answering_garbage_is_refused() {
    let peer = Peer::start(|stream| {
        let _ = read_header(stream);
        let _ = stream.write_all(&[0xa5; 64]);
    });
    let (result, waited) = connect_block(&peer.socket.0);
    let error = result.err().expect("garbage");
    assert!(
        matches!(
            error,
            VhostUserError::Protocol {
                request: "GET_FEATURES",
                ..
            }
        ),
        "{error}"
    );
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn a_reply_to_another_request_is_refused() {
    let peer = Peer::start(|stream| {
        let _ = read_header(stream);
        reply_u64(stream, GET_PROTOCOL_FEATURES, 0);
    });
    let (result, _) = connect_block(&peer.socket.0);
    let error = result.err().expect("wrong reply");
    assert!(error.to_string().contains("invalid message"), "{error}");
}

#[test]
fn a_silent_peer_times_out() {
    let peer = Peer::start(|stream| {
        let _ = read_header(stream);
        // Never answers, never closes (until the test ends).
    });
    let (result, waited) = connect_block(&peer.socket.0);
    let error = result.err().expect("silence");
    assert!(
        matches!(
            error,
            VhostUserError::Timeout {
                request: "GET_FEATURES",
                ..
            }
        ),
        "{error}"
    );
    assert!(
        waited >= QUICK.reply && waited < Duration::from_secs(2),
        "{waited:?}"
    );
}

#[test]
fn a_peer_closing_during_negotiation_is_refused() {
    let peer = Peer::start(|stream| {
        let (request, _, _) = read_header(stream).unwrap();
        assert_eq!(request, GET_FEATURES);
        // VERSION_1 and PROTOCOL_FEATURES: the frontend goes on to ask for protocol
        // features, and the peer hangs up instead of answering.
        reply_u64(stream, GET_FEATURES, (1 << 32) | (1 << 30));
        let (request, _, _) = read_header(stream).unwrap();
        assert_eq!(request, GET_PROTOCOL_FEATURES);
        let _ = stream.shutdown(std::net::Shutdown::Both);
    });
    let (result, waited) = connect_block(&peer.socket.0);
    let error = result.err().expect("hang-up");
    assert!(
        matches!(
            error,
            VhostUserError::Protocol {
                request: "GET_PROTOCOL_FEATURES",
                ..
            }
        ),
        "{error}"
    );
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn tags_that_do_not_fit_are_refused_before_connecting() {
    let nowhere = unique_path("never-connected.sock");
    let long = "t".repeat(37);
    let begin = Instant::now();
    let error = VhostUserFs::with_timeouts(FsConfig::new(long, &nowhere), QUICK)
        .err()
        .expect("too long");
    assert!(matches!(error, VhostUserError::Config { .. }), "{error}");
    assert!(error.to_string().contains("37 bytes"), "{error}");
    assert!(
        begin.elapsed() < QUICK.connect,
        "refused without connecting"
    );
    assert!(FsConfig::new("", &nowhere).validate().is_err());
    assert!(FsConfig::new("a\0b", &nowhere).validate().is_err());
    assert!(FsConfig::new("t".repeat(36), &nowhere).validate().is_ok());
    let mut config = FsConfig::new("ok", &nowhere);
    config.queue_size = 1000;
    assert!(config.validate().is_err(), "not a power of two");
    config.queue_size = 1024;
    config.num_queues = 0;
    assert!(config.validate().is_err());
}

#[test]
fn configs_parse_with_defaults_and_refuse_unknown_fields() {
    let fs: FsConfig =
        serde_json::from_str(r#"{"tag": "kataShared", "socket": "/run/vfs.sock"}"#).unwrap();
    assert_eq!((fs.num_queues, fs.queue_size), (1, 1024));
    let blk: VhostUserBlockConfig =
        serde_json::from_str(r#"{"drive_id": "rootfs", "socket": "/run/blk.sock"}"#).unwrap();
    assert_eq!((blk.num_queues, blk.queue_size), (1, 128));
    assert!(
        serde_json::from_str::<FsConfig>(r#"{"tag": "t", "socket": "/s", "dax": true}"#).is_err()
    );
    assert!(serde_json::from_str::<VhostUserBlockConfig>(
        r#"{"drive_id": "d", "socket": "/s", "path_on_host": "/x"}"#
    )
    .is_err());
    let mut bad = blk.clone();
    bad.queue_size = 0;
    assert!(bad.validate().is_err());
}

/// Reads one request and its body; returns (request, flags).
fn read_request(stream: &mut UnixStream) -> Option<(u32, u32)> {
    let (request, flags, size) = read_header(stream)?;
    let mut body = vec![0u8; size as usize];
    stream.read_exact(&mut body).ok()?;
    Some((request, flags))
}

#[test]
fn a_backend_silent_during_activation_fails_it_within_the_timeout() {
    use super::test_util::{activate_rings, shared_memory};
    use crate::VirtioDevice;

    const SET_PROTOCOL_FEATURES: u32 = 16;
    const SET_OWNER: u32 = 3;
    const NEED_REPLY: u32 = 0x8;
    const REPLY_ACK: u64 = 0x8;
    let peer = Peer::start(|stream| {
        // Negotiates REPLY_ACK like a real backend, then never answers again.
        assert_eq!(read_request(stream).unwrap().0, GET_FEATURES);
        reply_u64(stream, GET_FEATURES, (1 << 32) | (1 << 30));
        assert_eq!(read_request(stream).unwrap().0, GET_PROTOCOL_FEATURES);
        reply_u64(stream, GET_PROTOCOL_FEATURES, REPLY_ACK);
        assert_eq!(read_request(stream).unwrap().0, SET_PROTOCOL_FEATURES);
        let (request, flags) = read_request(stream).unwrap();
        assert_eq!(request, SET_OWNER);
        assert_ne!(flags & NEED_REPLY, 0, "REPLY_ACK asks for acknowledgements");
        reply_u64(stream, SET_OWNER, 0);
        let _ = read_request(stream);
    });
    let mut device =
        VhostUserFs::with_timeouts(FsConfig::new("stall", &peer.socket.0), QUICK).unwrap();
    let memory = shared_memory(1 << 20);
    let begin = Instant::now();
    let error = activate_rings(&mut device, &memory, 1 << 32, &[(0, 16), (0x1000, 16)])
        .err()
        .expect("the backend never acknowledges");
    let waited = begin.elapsed();
    assert!(
        error.to_string().contains("did not answer SET_FEATURES"),
        "{error}"
    );
    assert!(
        waited >= QUICK.reply && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(device.is_broken());
    let begin = Instant::now();
    device.reset();
    assert!(device.pause().is_empty(), "nothing active");
    assert!(begin.elapsed() < Duration::from_millis(500));
}
