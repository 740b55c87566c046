//! Helpers the virtio tests share (tests/virtio.rs, virtio_snapshot.rs, vhost_user.rs):
//! disk images the blk workloads accept, the guest's write patterns in them, the vsock
//! CONNECT/OK echo client, and the order of the guest's lines.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::Scratch;

/// What sector 0 of an image must start with for the blk workloads to use it.
pub const BLK_MAGIC: &[u8; 8] = b"GPUVMBLK";
pub const SECTOR: u64 = 512;

/// A raw image of `size` bytes whose sector 0 starts with `magic` (8 bytes), zero elsewhere.
pub fn disk_image(path: &Path, magic: &[u8; 8], size: u64) {
    let mut file = std::fs::File::create(path).expect("create the disk image");
    file.write_all(magic).unwrap();
    file.set_len(size).unwrap();
}

/// `disk.img` in `scratch`: [`disk_image`] with [`BLK_MAGIC`].
pub fn blk_image(scratch: &Scratch, size: u64) -> PathBuf {
    let path = scratch.path("disk.img");
    disk_image(&path, BLK_MAGIC, size);
    path
}

/// Whether `image[offset..offset + len]` holds the guest's pattern with `seed`
/// ([`gpuvm_guest_images::pattern`], one little-endian word per 8 bytes).
pub fn has_pattern(image: &[u8], offset: u64, len: u64, seed: u64) -> bool {
    (0..len).step_by(8).all(|word| {
        let at = (offset + word) as usize;
        let expected = gpuvm_guest_images::pattern(seed, offset + word);
        image[at..at + 8] == expected.to_le_bytes()
    })
}

/// [`has_pattern`] on the image file at `path`.
pub fn pattern_is_on_disk(path: &Path, offset: u64, len: u64, seed: u64) -> bool {
    has_pattern(&std::fs::read(path).unwrap(), offset, len, seed)
}

/// Asks the hybrid vsock socket `uds` for the guest's port 1024 (`CONNECT 1024`, answered
/// `OK <port>`); returns the stream and a reader on it. Reads time out after 30 s.
pub fn vsock_connect(uds: &Path) -> (UnixStream, BufReader<UnixStream>) {
    let mut stream = UnixStream::connect(uds)
        .unwrap_or_else(|e| panic!("connect to the vsock socket {}: {e}", uds.display()));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(b"CONNECT 1024\n").unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).expect("answer to CONNECT");
    assert!(line.starts_with("OK "), "answer to CONNECT: {line:?}");
    assert!(line[3..].trim().parse::<u32>().is_ok(), "{line:?}");
    (stream, reader)
}

/// Connects to the guest's port 1024 through the hybrid vsock socket, has `payload`
/// echoed (written from another thread: it may be larger than the guest's credit), shuts
/// the connection down and waits for the guest's RST (EOF here).
pub fn vsock_echo(uds: &Path, payload: &[u8]) {
    let (stream, mut reader) = vsock_connect(uds);
    let writer = {
        let mut stream = stream.try_clone().unwrap();
        let payload = payload.to_vec();
        std::thread::spawn(move || stream.write_all(&payload).unwrap())
    };
    let mut echo = vec![0u8; payload.len()];
    reader.read_exact(&mut echo).expect("read the echo");
    writer.join().unwrap();
    assert!(echo == payload, "the echo differs");
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{} bytes after the echo", rest.len());
}

/// Asserts that `lines` appear in `stdout` in this order (each anywhere after the last).
pub fn assert_in_order(stdout: &str, lines: &[&str], context: &str) {
    let mut rest = stdout;
    for line in lines {
        match rest.find(line) {
            Some(at) => rest = &rest[at + line.len()..],
            None => panic!("{context}: {line:?} missing or out of order in:\n{stdout}"),
        }
    }
}
