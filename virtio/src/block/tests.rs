//! The device end to end: a [`Block`] activated over a mock split queue in real guest
//! memory, requests written the way a driver writes them, files in a scratch directory.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_WRITE_ZEROES,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::rate_limiter::RateLimiterConfig;
use crate::test_util::{ops_limit, RecordingInterrupt};
use crate::{Activation, ActiveQueue, GuestMemory, QueuePosition, VirtioDevice};

const MEMORY_SIZE: u64 = 0x100_0000;
/// Headers (one 256-byte slot per request in flight), then status bytes, then data.
const HEADERS: u64 = 0x10_0000;
const STATUSES: u64 = 0x18_0000;
const OUT_DATA: u64 = 0x20_0000;
const IN_DATA: u64 = 0x80_0000;
const WAIT: Duration = Duration::from_secs(10);

/// A directory under the temp dir, removed with what is in it.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        Scratch::under(&std::env::temp_dir(), tag)
    }

    fn under(base: &Path, tag: &str) -> Scratch {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let path = base.join(format!(
            "gpuvm-blk-{}-{tag}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Scratch(path)
    }

    fn file(&self, name: &str, contents: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn drive(path: &Path, engine: IoEngine) -> BlockConfig {
    BlockConfig {
        drive_id: "test".into(),
        path: path.to_path_buf(),
        read_only: false,
        direct: false,
        serial: None,
        io_engine: engine,
        rate_limiter: RateLimiterConfig::default(),
        root: false,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// (address, length, device-writable)
type Part = (u64, u32, bool);

/// A device activated over a mock queue.
struct Harness {
    memory: GuestMemory,
    block: Block,
    kick: EventFd,
    interrupt: Arc<RecordingInterrupt>,
    next_descriptor: u16,
    made_available: u16,
    /// The rings' addresses (a `MockSplitQueue` zeroes its rings when made, so it is made
    /// once per activation).
    desc_table: u64,
    avail: u64,
    used: u64,
}

impl Harness {
    fn new(block: Block) -> Harness {
        let memory = crate::test_util::memory(MEMORY_SIZE as usize);
        let mut harness = Harness {
            memory,
            block,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            interrupt: Arc::new(RecordingInterrupt::default()),
            next_descriptor: 0,
            made_available: 0,
            desc_table: 0,
            avail: 0,
            used: 0,
        };
        harness.activate();
        harness
    }

    /// Activates over fresh rings.
    fn activate(&mut self) {
        let mock = MockSplitQueue::create(&self.memory, GuestAddress(0), QUEUE_SIZE);
        let queue: Queue = mock.create_queue().unwrap();
        (self.desc_table, self.avail, self.used) = (
            mock.desc_table_addr().0,
            mock.avail_addr().0,
            mock.used_addr().0,
        );
        self.next_descriptor = 0;
        self.made_available = 0;
        let features = self.block.device_features() | (1u64 << VIRTIO_F_VERSION_1);
        self.block
            .activate(Activation {
                memory: self.memory.clone(),
                acked_features: features,
                queues: vec![Some(ActiveQueue {
                    queue,
                    kick: self.kick.try_clone().unwrap(),
                })],
                interrupt: self.interrupt.clone(),
            })
            .unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.memory.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// The used ring's element for the `index`th completion: (head, len).
    fn used_element(&self, index: u16) -> (u32, u32) {
        let used = self.used + 4 + 8 * u64::from(index % QUEUE_SIZE);
        (
            self.memory.read_obj(GuestAddress(used)).unwrap(),
            self.memory.read_obj(GuestAddress(used + 4)).unwrap(),
        )
    }

    /// Makes a chain available (without a kick); returns its head.
    fn add_chain(&mut self, parts: &[Part]) -> u16 {
        let count = parts.len() as u16;
        if self.next_descriptor + count > QUEUE_SIZE {
            self.next_descriptor = 0;
        }
        let head = self.next_descriptor;
        for (i, &(addr, len, writable)) in parts.iter().enumerate() {
            let index = head + i as u16;
            let mut flags = if writable { VRING_DESC_F_WRITE } else { 0 };
            if i + 1 < parts.len() {
                flags |= VRING_DESC_F_NEXT;
            }
            let descriptor =
                RawDescriptor::from(Descriptor::new(addr, len, flags as u16, index + 1));
            self.memory
                .write_obj(
                    descriptor,
                    GuestAddress(self.desc_table + 16 * u64::from(index)),
                )
                .unwrap();
        }
        let avail = self.avail;
        let slot = u64::from(self.made_available % QUEUE_SIZE);
        self.memory
            .write_obj(head, GuestAddress(avail + 4 + 2 * slot))
            .unwrap();
        self.made_available = self.made_available.wrapping_add(1);
        self.memory
            .write_obj(self.made_available, GuestAddress(avail + 2))
            .unwrap();
        self.next_descriptor += count;
        head
    }

    fn kick(&self) {
        self.kick.write(1).unwrap();
    }

    /// Waits until `count` chains are used; false on timeout.
    fn wait_used(&self, count: u16) -> bool {
        let deadline = Instant::now() + WAIT;
        while self.used_idx() < count {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Makes a chain available, kicks, waits for it; returns the used length.
    fn run(&mut self, parts: &[Part]) -> u32 {
        let head = self.add_chain(parts);
        let expected = self.made_available;
        self.kick();
        assert!(self.wait_used(expected), "the request was not completed");
        let (id, len) = self.used_element(expected - 1);
        assert_eq!(id, u32::from(head));
        len
    }

    fn header(&self, slot: u64, request_type: u32, sector: u64) -> u64 {
        let addr = HEADERS + slot * 256;
        self.memory
            .write_obj(request_type, GuestAddress(addr))
            .unwrap();
        self.memory.write_obj(0u32, GuestAddress(addr + 4)).unwrap();
        self.memory
            .write_obj(sector, GuestAddress(addr + 8))
            .unwrap();
        addr
    }

    fn status_byte(&self, slot: u64) -> u64 {
        let addr = STATUSES + slot;
        self.memory.write_obj(0xffu8, GuestAddress(addr)).unwrap();
        addr
    }

    fn status(&self, slot: u64) -> u32 {
        u32::from(
            self.memory
                .read_obj::<u8>(GuestAddress(STATUSES + slot))
                .unwrap(),
        )
    }

    /// One request with `out` after the header and `in_len` writable data bytes.
    fn request(
        &mut self,
        request_type: u32,
        sector: u64,
        out: &[u8],
        in_len: u32,
    ) -> (u32, Vec<u8>, u32) {
        let header = self.header(0, request_type, sector);
        let status = self.status_byte(0);
        let mut parts = vec![(header, 16, false)];
        if !out.is_empty() {
            self.memory
                .write_slice(out, GuestAddress(OUT_DATA))
                .unwrap();
            parts.push((OUT_DATA, out.len() as u32, false));
        }
        if in_len > 0 {
            parts.push((IN_DATA, in_len, true));
        }
        parts.push((status, 1, true));
        let used_len = self.run(&parts);
        let mut data = vec![0u8; in_len as usize];
        self.memory
            .read_slice(&mut data, GuestAddress(IN_DATA))
            .unwrap();
        (self.status(0), data, used_len)
    }

    fn write(&mut self, sector: u64, data: &[u8]) -> u32 {
        self.request(VIRTIO_BLK_T_OUT, sector, data, 0).0
    }

    fn read(&mut self, sector: u64, len: u32) -> (u32, Vec<u8>) {
        let (status, data, used_len) = self.request(VIRTIO_BLK_T_IN, sector, &[], len);
        if status == VIRTIO_BLK_S_OK {
            assert_eq!(used_len, len + 1);
        }
        (status, data)
    }

    fn segments(&mut self, request_type: u32, segments: &[(u64, u32, u32)]) -> u32 {
        let mut raw = Vec::new();
        for &(sector, sectors, flags) in segments {
            raw.extend_from_slice(&sector.to_le_bytes());
            raw.extend_from_slice(&sectors.to_le_bytes());
            raw.extend_from_slice(&flags.to_le_bytes());
        }
        self.request(request_type, 0, &raw, 0).0
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.block.reset();
    }
}

fn engines() -> [IoEngine; 2] {
    [IoEngine::Sync, IoEngine::Async]
}

fn new_block(config: BlockConfig) -> Block {
    let engine = config.io_engine;
    let block = Block::new(config).unwrap();
    if engine == IoEngine::Async && block.io_engine() == IoEngine::Sync {
        eprintln!("io_uring is not available here: the Async case runs the synchronous fallback");
    }
    block
}

#[test]
fn writes_then_reads_back_through_both_engines() {
    let scratch = Scratch::new("rw");
    for engine in engines() {
        let path = scratch.file(&format!("disk-{engine:?}"), &vec![0u8; 1 << 20]);
        let mut h = Harness::new(new_block(drive(&path, engine)));

        // Data split across descriptors at places that are not sector boundaries.
        let data = pattern(1536, 7);
        let header = h.header(0, VIRTIO_BLK_T_OUT, 3);
        let status = h.status_byte(0);
        h.memory.write_slice(&data, GuestAddress(OUT_DATA)).unwrap();
        h.run(&[
            (header, 16, false),
            (OUT_DATA, 700, false),
            (OUT_DATA + 700, 836, false),
            (status, 1, true),
        ]);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK, "{engine:?}");

        let header = h.header(0, VIRTIO_BLK_T_IN, 3);
        let status = h.status_byte(0);
        let used_len = h.run(&[
            (header, 16, false),
            (IN_DATA, 1000, true),
            (IN_DATA + 0x1_0000, 536, true),
            (status, 1, true),
        ]);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK);
        assert_eq!(used_len, 1537);
        let mut back = vec![0u8; 1536];
        h.memory
            .read_slice(&mut back[..1000], GuestAddress(IN_DATA))
            .unwrap();
        h.memory
            .read_slice(&mut back[1000..], GuestAddress(IN_DATA + 0x1_0000))
            .unwrap();
        assert_eq!(back, data, "{engine:?}");

        // Bigger than the bounce buffer: several chunks.
        let big = pattern(300 * 1024, 3);
        assert_eq!(h.write(100, &big), VIRTIO_BLK_S_OK);
        let (status, back) = h.read(100, big.len() as u32);
        assert_eq!(status, VIRTIO_BLK_S_OK);
        assert!(back == big, "{engine:?}: the big read differs");

        let file = std::fs::read(&path).unwrap();
        assert_eq!(&file[3 * 512..3 * 512 + 1536], &data[..]);
        assert_eq!(&file[100 * 512..100 * 512 + big.len()], &big[..]);
        assert!(h.interrupt.count() > 0);
        assert!(h.interrupt.queues().iter().all(|&queue| queue == 0));
    }
}

/// Lengths summing to 16 sectors, none of them a whole sector, the first and the last a
/// single byte.
fn odd_lengths() -> Vec<u32> {
    let mut lengths = vec![1, 3, 509, 2047, 1];
    lengths.extend([97, 1000, 13, 511, 700].iter().cycle().take(8));
    let sum: u32 = lengths.iter().sum();
    lengths.push(16 * 512 - sum - 1);
    lengths.push(1);
    lengths
}

/// Parts for `lengths` laid out from `base`, each 100 bytes after the previous one (the
/// gaps are left alone by the device).
fn scattered(base: u64, lengths: &[u32], writable: bool) -> Vec<Part> {
    let mut addr = base;
    lengths
        .iter()
        .map(|&len| {
            let part = (addr, len, writable);
            addr += u64::from(len) + 100;
            part
        })
        .collect()
}

#[test]
fn a_request_over_many_descriptors_split_at_odd_places() {
    let scratch = Scratch::new("odd");
    let lengths = odd_lengths();
    assert_eq!(lengths.iter().sum::<u32>(), 16 * 512);
    for engine in engines() {
        let path = scratch.file(&format!("disk-{engine:?}"), &pattern(1 << 20, 1));
        let mut h = Harness::new(new_block(drive(&path, engine)));
        h.memory
            .write_slice(&vec![0xeeu8; 0x4_0000], GuestAddress(IN_DATA))
            .unwrap();

        let data = pattern(16 * 512, 42);
        let mut parts = vec![(h.header(0, VIRTIO_BLK_T_OUT, 9), 16, false)];
        let out = scattered(OUT_DATA, &lengths, false);
        let mut next = 0;
        for &(addr, len, _) in &out {
            let len = len as usize;
            h.memory
                .write_slice(&data[next..next + len], GuestAddress(addr))
                .unwrap();
            next += len;
        }
        parts.extend(out);
        parts.push((h.status_byte(0), 1, true));
        assert_eq!(h.run(&parts), 1);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK, "{engine:?}");

        // Read back from two sectors earlier, split the other way round.
        let reversed: Vec<u32> = lengths.iter().rev().copied().collect();
        let mut parts = vec![(h.header(0, VIRTIO_BLK_T_IN, 7), 16, false)];
        let into = scattered(IN_DATA, &reversed, true);
        parts.extend(into.iter().copied());
        parts.push((h.status_byte(0), 1, true));
        assert_eq!(h.run(&parts), 16 * 512 + 1);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK, "{engine:?}");
        let mut back = Vec::new();
        for &(addr, len, _) in &into {
            let mut part = vec![0u8; len as usize];
            h.memory.read_slice(&mut part, GuestAddress(addr)).unwrap();
            back.extend(part);
            // The gap after each buffer is untouched.
            let mut gap = [0u8; 100];
            h.memory
                .read_slice(&mut gap, GuestAddress(addr + u64::from(len)))
                .unwrap();
            assert!(
                gap.iter().all(|&b| b == 0xee),
                "{engine:?}: a gap was written"
            );
        }
        let before = pattern(1 << 20, 1);
        assert_eq!(&back[..1024], &before[7 * 512..9 * 512], "{engine:?}");
        assert!(
            back[1024..] == data[..14 * 512],
            "{engine:?}: the read differs"
        );

        drop(h);
        let file = std::fs::read(&path).unwrap();
        assert!(
            file[9 * 512..25 * 512] == data[..],
            "{engine:?}: the file differs"
        );
        assert!(file[..9 * 512] == before[..9 * 512]);
        assert!(file[25 * 512..] == before[25 * 512..]);
    }
}

#[test]
fn a_read_past_the_end_of_a_file_cut_short_behind_the_device_fails() {
    let scratch = Scratch::new("cut");
    for engine in engines() {
        let path = scratch.file(&format!("disk-{engine:?}"), &pattern(64 * 1024, 3));
        let mut h = Harness::new(new_block(drive(&path, engine)));
        // Another process cuts the file in the middle of the last 8 sectors; the device
        // still believes in its capacity (virtio-blk has no way to shrink it under the
        // driver's feet).
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(64 * 1024 - 4096 + 1000)
            .unwrap();

        let (status, data, used_len) = h.request(VIRTIO_BLK_T_IN, 120, &[], 4096);
        assert_eq!(status, VIRTIO_BLK_S_IOERR, "{engine:?}");
        assert_eq!(
            used_len, 1,
            "{engine:?}: an error reports only the status byte"
        );
        // What there was may have arrived; nothing is promised beyond it.
        assert_eq!(data.len(), 4096);

        // Reads before the cut still work, and so does the device.
        let (status, data) = h.read(100, 4096);
        assert_eq!(status, VIRTIO_BLK_S_OK, "{engine:?}");
        assert_eq!(data, pattern(64 * 1024, 3)[100 * 512..100 * 512 + 4096]);
    }
}

#[test]
fn many_requests_in_flight_complete_and_a_pause_waits_for_them() {
    let scratch = Scratch::new("many");
    for engine in engines() {
        let path = scratch.file(&format!("disk-{engine:?}"), &vec![0u8; 1 << 20]);
        let mut h = Harness::new(new_block(drive(&path, engine)));
        for slot in 0..64u64 {
            let header = h.header(slot, VIRTIO_BLK_T_OUT, slot * 8);
            let status = h.status_byte(slot);
            let data = OUT_DATA + slot * 4096;
            h.memory
                .write_slice(&[slot as u8 + 1; 4096], GuestAddress(data))
                .unwrap();
            h.add_chain(&[(header, 16, false), (data, 4096, false), (status, 1, true)]);
        }
        h.kick();
        // A pause in the middle leaves nothing half done: every request taken is complete.
        std::thread::sleep(Duration::from_millis(1));
        let position = h.block.pause()[0].unwrap();
        assert_eq!(position.next_avail, position.next_used, "{engine:?}");
        assert_eq!(h.used_idx(), position.next_used);
        h.block.resume().unwrap();
        assert!(h.wait_used(64), "{engine:?}");
        for slot in 0..64u64 {
            assert_eq!(h.status(slot), VIRTIO_BLK_S_OK);
        }
        let file = std::fs::read(&path).unwrap();
        for slot in 0..64usize {
            assert!(file[slot * 4096..(slot + 1) * 4096]
                .iter()
                .all(|&b| b == slot as u8 + 1));
        }
    }
}

#[test]
fn flush_and_get_id() {
    let scratch = Scratch::new("id");
    let path = scratch.file("disk", &vec![0u8; 65536]);
    for engine in engines() {
        let mut config = drive(&path, engine);
        config.serial = Some("serial-0123456789abc".into());
        let mut h = Harness::new(new_block(config));
        assert_eq!(h.request(VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, VIRTIO_BLK_S_OK);

        let (status, id, used_len) = h.request(VIRTIO_BLK_T_GET_ID, 0, &[], 20);
        assert_eq!(status, VIRTIO_BLK_S_OK);
        assert_eq!(&id, b"serial-0123456789abc");
        assert_eq!(used_len, 21);

        // A short buffer gets what fits and nothing past it.
        h.memory
            .write_slice(&[0xee; 16], GuestAddress(IN_DATA))
            .unwrap();
        let (status, id, _) = h.request(VIRTIO_BLK_T_GET_ID, 0, &[], 8);
        assert_eq!(status, VIRTIO_BLK_S_OK);
        assert_eq!(&id, b"serial-0");
        let mut after = [0u8; 8];
        h.memory
            .read_slice(&mut after, GuestAddress(IN_DATA + 8))
            .unwrap();
        assert_eq!(after, [0xee; 8]);
        drop(h);
    }
    // Without a serial: the drive ID.
    let mut h = Harness::new(new_block(drive(&path, IoEngine::Sync)));
    let (_, id, _) = h.request(VIRTIO_BLK_T_GET_ID, 0, &[], 20);
    assert_eq!(&id[..5], b"test\0");
}

#[test]
fn discard_punches_a_hole() {
    let scratch = Scratch::new("discard");
    let path = scratch.file("disk", &vec![0xaa; 4 << 20]);
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let blocks_before = std::fs::metadata(&path).unwrap().blocks();
    let mut h = Harness::new(new_block(drive(&path, IoEngine::Async)));
    // 1 MiB from sector 2048, plus a second segment.
    let status = h.segments(VIRTIO_BLK_T_DISCARD, &[(2048, 2048, 0), (6000, 8, 0)]);
    assert_eq!(status, VIRTIO_BLK_S_OK);
    let metadata = std::fs::metadata(&path).unwrap();
    assert_eq!(metadata.len(), 4 << 20, "the file keeps its size");
    assert!(
        metadata.blocks() < blocks_before,
        "no blocks were freed ({} then {})",
        blocks_before,
        metadata.blocks()
    );
    let (status, data) = h.read(2048, 1 << 20);
    assert_eq!(status, VIRTIO_BLK_S_OK);
    assert!(data.iter().all(|&b| b == 0));
    let (_, data) = h.read(2047, 512);
    assert!(data.iter().all(|&b| b == 0xaa), "the sector before is kept");
    let (_, data) = h.read(4096, 512);
    assert!(data.iter().all(|&b| b == 0xaa), "the sector after is kept");
}

#[test]
fn write_zeroes_with_and_without_unmap() {
    let scratch = Scratch::new("zeroes");
    let path = scratch.file("disk", &vec![0xaa; 1 << 20]);
    for engine in engines() {
        std::fs::write(&path, vec![0xaa; 1 << 20]).unwrap();
        let mut h = Harness::new(new_block(drive(&path, engine)));
        assert_eq!(
            h.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[(8, 8, 0)]),
            VIRTIO_BLK_S_OK
        );
        assert_eq!(
            h.segments(
                VIRTIO_BLK_T_WRITE_ZEROES,
                &[(100, 16, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP)]
            ),
            VIRTIO_BLK_S_OK
        );
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file.len(), 1 << 20);
        assert!(file[8 * 512..16 * 512].iter().all(|&b| b == 0));
        assert!(file[100 * 512..116 * 512].iter().all(|&b| b == 0));
        assert!(file[..8 * 512].iter().all(|&b| b == 0xaa));
        assert!(file[16 * 512..100 * 512].iter().all(|&b| b == 0xaa));
        assert!(file[116 * 512..].iter().all(|&b| b == 0xaa));
        // Unknown flags are unsupported, not ignored.
        assert_eq!(
            h.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0x10)]),
            VIRTIO_BLK_S_UNSUPP
        );
    }
}

#[test]
fn a_read_only_drive_refuses_writes_and_keeps_the_file() {
    let scratch = Scratch::new("ro");
    let contents = pattern(65536, 1);
    let path = scratch.file("disk", &contents);
    for engine in engines() {
        let mut config = drive(&path, engine);
        config.read_only = true;
        let block = new_block(config);
        let features = block.device_features();
        assert_ne!(features & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(features & (1 << VIRTIO_BLK_F_DISCARD), 0);
        assert_eq!(features & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
        let mut h = Harness::new(block);
        assert_eq!(h.write(0, &[0u8; 512]), VIRTIO_BLK_S_IOERR);
        assert_eq!(
            h.segments(VIRTIO_BLK_T_DISCARD, &[(0, 8, 0)]),
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            h.segments(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0)]),
            VIRTIO_BLK_S_IOERR
        );
        let (status, data) = h.read(0, 1024);
        assert_eq!(status, VIRTIO_BLK_S_OK);
        assert_eq!(data, contents[..1024]);
        assert_eq!(h.request(VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, VIRTIO_BLK_S_OK);
        assert_eq!(std::fs::read(&path).unwrap(), contents);
    }
}

#[test]
fn bad_requests_are_answered_or_dropped_and_the_device_goes_on() {
    let scratch = Scratch::new("bad");
    let path = scratch.file("disk", &vec![0u8; 1 << 20]);
    for engine in engines() {
        let mut h = Harness::new(new_block(drive(&path, engine)));
        // 2048 sectors: the last one is fine, one past it is not.
        assert_eq!(h.read(2047, 512).0, VIRTIO_BLK_S_OK);
        assert_eq!(h.read(2048, 512).0, VIRTIO_BLK_S_IOERR);
        assert_eq!(h.read(2047, 1024).0, VIRTIO_BLK_S_IOERR);
        assert_eq!(h.read(u64::MAX, 512).0, VIRTIO_BLK_S_IOERR);
        assert_eq!(h.write(u64::MAX / 512, &[1u8; 512]), VIRTIO_BLK_S_IOERR);
        assert_eq!(h.write(0, &[1u8; 100]), VIRTIO_BLK_S_IOERR);
        assert_eq!(h.request(99, 0, &[], 0).0, VIRTIO_BLK_S_UNSUPP);

        // Data outside guest memory.
        let header = h.header(0, VIRTIO_BLK_T_IN, 0);
        let status = h.status_byte(0);
        h.run(&[
            (header, 16, false),
            (MEMORY_SIZE - 256, 512, true),
            (status, 1, true),
        ]);
        assert_eq!(h.status(0), VIRTIO_BLK_S_IOERR);

        // A read-only "status" descriptor: nothing written, the chain comes back empty.
        let header = h.header(0, VIRTIO_BLK_T_IN, 0);
        let status = h.status_byte(0);
        let used = h.run(&[
            (header, 16, false),
            (IN_DATA, 512, true),
            (status, 1, false),
        ]);
        assert_eq!(used, 0);
        assert_eq!(h.status(0), 0xff);
        // No status descriptor at all, and a status outside guest memory.
        assert_eq!(h.run(&[(header, 16, false)]), 0);
        assert_eq!(h.run(&[(header, 16, false), (MEMORY_SIZE, 1, true)]), 0);

        // A broken available index: nothing is served and nothing spins or hangs.
        h.memory
            .write_obj(
                h.made_available.wrapping_add(1000),
                GuestAddress(h.avail + 2),
            )
            .unwrap();
        h.kick();
        std::thread::sleep(Duration::from_millis(20));
        let position = h.block.pause()[0].unwrap();
        assert_eq!(position.next_avail, h.made_available);
        h.memory
            .write_obj(h.made_available, GuestAddress(h.avail + 2))
            .unwrap();
        h.block.resume().unwrap();

        // The device still serves.
        assert_eq!(h.write(1, &[9u8; 512]), VIRTIO_BLK_S_OK);
        assert_eq!(h.read(1, 512), (VIRTIO_BLK_S_OK, vec![9u8; 512]));
    }
}

#[test]
fn refuses_what_is_not_a_disk() {
    let scratch = Scratch::new("refuse");
    let open = |path: &Path| Block::new(drive(path, IoEngine::Sync)).err();

    let error = open(&scratch.0).expect("a directory was accepted");
    assert!(
        matches!(
            error,
            BlockError::NotADisk {
                kind: "a directory",
                ..
            }
        ),
        "{error}"
    );

    let fifo = scratch.0.join("fifo");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let started = Instant::now();
    let error = open(&fifo).expect("a FIFO was accepted");
    assert!(
        matches!(error, BlockError::NotADisk { kind: "a FIFO", .. }),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the FIFO hung the open"
    );

    let error = open(Path::new("/dev/zero")).expect("/dev/zero was accepted");
    assert!(
        matches!(
            error,
            BlockError::NotADisk {
                kind: "a character device",
                ..
            }
        ),
        "{error}"
    );

    let error = open(&scratch.0.join("missing")).expect("a missing file was accepted");
    assert!(matches!(error, BlockError::Missing { .. }), "{error}");
    assert!(error.to_string().contains("no such file"));

    // An empty file (Kata's placeholder drives): a disk of no sectors.
    let empty = scratch.file("empty", &[]);
    let block = Block::new(drive(&empty, IoEngine::Sync)).expect("a placeholder drive");
    assert_eq!(block.capacity_sectors(), 0);
    // 1 to 511 bytes: not a disk image (issue 31: one rule everywhere).
    for len in [1, 100, 511] {
        let tiny = scratch.file("tiny", &vec![1u8; len]);
        let error = Block::new(drive(&tiny, IoEngine::Sync)).err();
        assert!(
            matches!(error, Some(BlockError::LessThanASector { size, .. }) if size == len as u64),
            "{len}: {error:?}"
        );
        let error = check_image(&drive(&tiny, IoEngine::Sync)).unwrap_err();
        assert!(
            error.to_string().contains("less than one sector"),
            "{error}"
        );
    }

    // Not a whole number of sectors: rounded down.
    let odd = scratch.file("odd", &[1u8; 1500]);
    let block = Block::new(drive(&odd, IoEngine::Sync)).unwrap();
    assert_eq!(block.capacity_sectors(), 2);

    let mut long_serial = drive(&odd, IoEngine::Sync);
    long_serial.serial = Some("x".repeat(21));
    drop(block);
    assert!(matches!(
        Block::new(long_serial).err(),
        Some(BlockError::SerialTooLong { .. })
    ));
}

#[test]
fn locks_keep_a_second_writer_out() {
    let scratch = Scratch::new("lock");
    let path = scratch.file("disk", &vec![0u8; 4096]);
    let read_only = |path: &Path| {
        let mut config = drive(path, IoEngine::Sync);
        config.read_only = true;
        config
    };

    let writer = Block::new(drive(&path, IoEngine::Sync)).unwrap();
    let error = Block::new(drive(&path, IoEngine::Sync))
        .err()
        .expect("two writers");
    assert!(matches!(error, BlockError::Locked { .. }), "{error}");
    assert!(error.to_string().contains("in use"), "{error}");
    let error = Block::new(read_only(&path))
        .err()
        .expect("a reader beside a writer");
    assert!(matches!(error, BlockError::Locked { .. }), "{error}");
    drop(writer);

    let first = Block::new(read_only(&path)).unwrap();
    let second = Block::new(read_only(&path)).unwrap();
    assert!(
        Block::new(drive(&path, IoEngine::Sync)).is_err(),
        "a writer beside readers"
    );
    drop((first, second));
    Block::new(drive(&path, IoEngine::Sync)).unwrap();
}

#[test]
fn read_write_open_of_a_read_only_file_is_refused() {
    let scratch = Scratch::new("perm");
    let path = scratch.file("disk", &vec![0u8; 4096]);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let immutable = root && set_immutable(&path, true);
    if root && !immutable {
        eprintln!("skipped: root ignores file modes and this file system has no immutable flag");
        return;
    }
    let error = Block::new(drive(&path, IoEngine::Sync)).err();
    if immutable {
        set_immutable(&path, false);
    }
    let error = error.expect("a read-only file was opened read-write");
    assert!(matches!(error, BlockError::OpenReadWrite { .. }), "{error}");
    assert!(error.to_string().contains("read_only"), "{error}");
    // Read-only is fine.
    let mut config = drive(&path, IoEngine::Sync);
    config.read_only = true;
    Block::new(config).unwrap();
}

/// Sets or clears FS_IMMUTABLE_FL (root can still not write such a file).
fn set_immutable(path: &Path, on: bool) -> bool {
    const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
    const FS_IOC_SETFLAGS: libc::c_ulong = 0x4008_6602;
    const FS_IMMUTABLE_FL: libc::c_long = 0x10;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    let mut flags: libc::c_long = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`, which outlives the call.
    if unsafe { libc::ioctl(fd, FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return false;
    }
    flags = if on {
        flags | FS_IMMUTABLE_FL
    } else {
        flags & !FS_IMMUTABLE_FL
    };
    // SAFETY: FS_IOC_SETFLAGS reads one long from `flags`, which outlives the call.
    unsafe { libc::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0 }
}

#[test]
fn hot_swap_changes_capacity_and_content() {
    let scratch = Scratch::new("swap");
    let first = scratch.file("first", &vec![0x11; 1 << 20]);
    let second = scratch.file("second", &vec![0x22; 2 << 20]);
    for engine in engines() {
        let mut h = Harness::new(new_block(drive(&first, engine)));
        assert_eq!(h.read(0, 512), (VIRTIO_BLK_S_OK, vec![0x11; 512]));
        assert_eq!(h.read(3000, 512).0, VIRTIO_BLK_S_IOERR);

        h.block.update_backing(second.clone()).unwrap();
        let mut capacity = [0u8; 8];
        h.block.read_config(0, &mut capacity);
        assert_eq!(u64::from_le_bytes(capacity), 4096);
        assert_eq!(h.interrupt.config_changes(), 1);
        assert_eq!(h.block.config().path, second);
        assert_eq!(h.read(3000, 512), (VIRTIO_BLK_S_OK, vec![0x22; 512]));
        assert_eq!(h.write(0, &[0x33; 512]), VIRTIO_BLK_S_OK);
        assert_eq!(std::fs::read(&second).unwrap()[..512], [0x33; 512]);
        assert_eq!(std::fs::read(&first).unwrap()[..512], [0x11; 512]);

        // The first image is free again; the second is ours.
        drop(Block::new(drive(&first, IoEngine::Sync)).unwrap());
        assert!(Block::new(drive(&second, IoEngine::Sync)).is_err());

        // A refused file leaves the drive as it was.
        assert!(h.block.update_backing(scratch.0.join("missing")).is_err());
        assert_eq!(h.block.capacity_sectors(), 4096);
        assert_eq!(h.read(3000, 512).0, VIRTIO_BLK_S_OK);

        // The same file, grown: the new size shows, and the lock is still held.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&second)
            .unwrap()
            .set_len(3 << 20)
            .unwrap();
        h.block.update_backing(second.clone()).unwrap();
        assert_eq!(h.block.capacity_sectors(), 6144);
        assert_eq!(h.read(6000, 512), (VIRTIO_BLK_S_OK, vec![0; 512]));
        assert!(Block::new(drive(&second, IoEngine::Sync)).is_err());
        drop(h);
        std::fs::write(&second, vec![0x22; 2 << 20]).unwrap();
    }
}

#[test]
fn the_rate_limiter_limits_operations() {
    let scratch = Scratch::new("rate");
    let path = scratch.file("disk", &vec![0u8; 1 << 20]);
    let mut config = drive(&path, IoEngine::Async);
    // One request per 300 ms (the bucket starts full: the first goes at once).
    config.rate_limiter = ops_limit(1, 300);
    let mut h = Harness::new(new_block(config));
    let started = Instant::now();
    queue_four_reads(&mut h);
    std::thread::sleep(Duration::from_millis(50));
    let served = h.used_idx();
    // The bucket starts with one token; the next comes 300 ms later.
    if started.elapsed() < Duration::from_millis(250) {
        assert!(served <= 1, "{served} served before a second token existed");
    }
    assert!(h.wait_used(4));
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(800),
        "4 requests in {elapsed:?}"
    );
    for slot in 0..4 {
        assert_eq!(h.status(slot), VIRTIO_BLK_S_OK);
    }

    // Lifted: the next four go at once.
    h.block
        .update_rate_limiter(RateLimiterConfig::default())
        .unwrap();
    let started = Instant::now();
    queue_four_reads(&mut h);
    assert!(h.wait_used(8));
    // Limited, these four would take at least 900 ms.
    assert!(started.elapsed() < Duration::from_millis(700));
}

/// Makes four one-sector reads available, in slots 0 to 3, and kicks.
fn queue_four_reads(h: &mut Harness) {
    for slot in 0..4u64 {
        let header = h.header(slot, VIRTIO_BLK_T_IN, slot);
        let status = h.status_byte(slot);
        h.add_chain(&[
            (header, 16, false),
            (IN_DATA + slot * 512, 512, true),
            (status, 1, true),
        ]);
    }
    h.kick();
}

/// A scratch directory whose file system takes O_DIRECT (tmpfs does not).
fn direct_scratch() -> Option<Scratch> {
    for base in [std::env::temp_dir(), PathBuf::from("/var/tmp")] {
        let scratch = Scratch::under(&base, "direct");
        let probe = scratch.file("probe", &[0u8; 4096]);
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags_direct()
            .open(&probe);
        if opened.is_ok() {
            return Some(scratch);
        }
    }
    None
}

trait DirectOpen {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl DirectOpen for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::custom_flags(self, libc::O_DIRECT)
    }
}

#[test]
fn direct_io_with_aligned_and_unaligned_buffers() {
    let Some(scratch) = direct_scratch() else {
        eprintln!("skipped: no scratch file system here takes O_DIRECT");
        return;
    };
    for engine in engines() {
        let path = scratch.file(&format!("disk-{engine:?}"), &vec![0u8; 1 << 20]);
        let mut config = drive(&path, engine);
        config.direct = true;
        let mut h = Harness::new(new_block(config));

        let aligned = pattern(8192, 5);
        assert_eq!(h.write(16, &aligned), VIRTIO_BLK_S_OK);
        assert_eq!(h.read(16, 8192), (VIRTIO_BLK_S_OK, aligned.clone()));
        assert_eq!(h.block.bounced_requests(), 0);

        // Buffers 8 bytes off alignment, on both sides.
        let unaligned = pattern(4096, 9);
        let header = h.header(0, VIRTIO_BLK_T_OUT, 40);
        let status = h.status_byte(0);
        h.memory
            .write_slice(&unaligned, GuestAddress(OUT_DATA + 8))
            .unwrap();
        h.run(&[
            (header, 16, false),
            (OUT_DATA + 8, 4096, false),
            (status, 1, true),
        ]);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK);
        let header = h.header(0, VIRTIO_BLK_T_IN, 40);
        let status = h.status_byte(0);
        h.run(&[
            (header, 16, false),
            (IN_DATA + 8, 4096, true),
            (status, 1, true),
        ]);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK);
        let mut back = vec![0u8; 4096];
        h.memory
            .read_slice(&mut back, GuestAddress(IN_DATA + 8))
            .unwrap();
        assert_eq!(back, unaligned);
        // Whatever the engine: the sync engine bounces only these too.
        assert_eq!(h.block.bounced_requests(), 2, "{engine:?}");

        // Aligned buffers over several descriptors go straight to the file.
        let spread = pattern(3 * 4096, 11);
        let header = h.header(0, VIRTIO_BLK_T_OUT, 64);
        let status = h.status_byte(0);
        h.memory
            .write_slice(&spread[..4096], GuestAddress(OUT_DATA + 0x1_0000))
            .unwrap();
        h.memory
            .write_slice(&spread[4096..], GuestAddress(OUT_DATA + 0x3_0000))
            .unwrap();
        h.run(&[
            (header, 16, false),
            (OUT_DATA + 0x1_0000, 4096, false),
            (OUT_DATA + 0x3_0000, 8192, false),
            (status, 1, true),
        ]);
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK, "{engine:?}");
        assert_eq!(h.read(64, 3 * 4096), (VIRTIO_BLK_S_OK, spread.clone()));
        assert_eq!(h.block.bounced_requests(), 2, "{engine:?}");
        drop(h);
        let file = std::fs::read(&path).unwrap();
        assert_eq!(&file[16 * 512..16 * 512 + 8192], &aligned[..]);
        assert_eq!(&file[40 * 512..40 * 512 + 4096], &unaligned[..]);
        assert_eq!(&file[64 * 512..64 * 512 + 3 * 4096], &spread[..]);
    }
}

#[test]
fn pause_resume_reset_and_snapshot_state() {
    let scratch = Scratch::new("pause");
    let path = scratch.file("disk", &vec![0u8; 1 << 20]);
    for engine in engines() {
        let mut h = Harness::new(new_block(drive(&path, engine)));
        assert_eq!(h.write(0, &[1u8; 512]), VIRTIO_BLK_S_OK);
        assert_eq!(
            h.block.pause(),
            vec![Some(QueuePosition {
                next_avail: 1,
                next_used: 1
            })]
        );
        // Paused: a request waits.
        let header = h.header(0, VIRTIO_BLK_T_IN, 0);
        let status = h.status_byte(0);
        h.add_chain(&[(header, 16, false), (IN_DATA, 512, true), (status, 1, true)]);
        h.kick();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(h.used_idx(), 1);
        let state = h.block.save_state().unwrap();
        h.block.resume().unwrap();
        assert!(h.wait_used(2));
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK);

        // Reset, then a new activation serves from scratch.
        h.block.reset();
        assert!(
            h.block.pause().is_empty(),
            "an inactive device has no queues"
        );
        h.activate();
        assert_eq!(h.read(0, 512), (VIRTIO_BLK_S_OK, vec![1u8; 512]));
        drop(h);

        // The state restores into a device over the same file...
        let mut restored = new_block(drive(&path, engine));
        restored.restore_state(&state).unwrap();
        drop(restored);
        // ...but not over a file whose size changed, nor in another mode.
        std::fs::write(&path, vec![0u8; 2 << 20]).unwrap();
        let mut grown = new_block(drive(&path, engine));
        let reason = grown.restore_state(&state).unwrap_err().to_string();
        assert!(reason.contains("changed since the snapshot"), "{reason}");
        drop(grown);
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let mut config = drive(&path, engine);
        config.read_only = true;
        let reason = new_block(config)
            .restore_state(&state)
            .unwrap_err()
            .to_string();
        assert!(reason.contains("read-write"), "{reason}");
        let other_kind = crate::DeviceState::Rng(crate::rng::RngState::default());
        let reason = new_block(drive(&path, engine))
            .restore_state(&other_kind)
            .unwrap_err()
            .to_string();
        assert!(
            reason.contains("a rng state, this is a block device"),
            "{reason}"
        );
    }
}

#[test]
fn features_and_configuration_space() {
    let scratch = Scratch::new("config");
    let path = scratch.file("disk", &vec![0u8; 3 << 20]);
    let block = new_block(drive(&path, IoEngine::Sync));
    assert_eq!(block.device_type(), 2);
    assert_eq!(block.queue_max_sizes(), vec![256]);
    let features = block.device_features();
    for bit in [
        VIRTIO_BLK_F_FLUSH,
        VIRTIO_BLK_F_DISCARD,
        VIRTIO_BLK_F_WRITE_ZEROES,
    ] {
        assert_ne!(features & (1 << bit), 0, "feature {bit}");
    }
    assert_eq!(features & (1 << VIRTIO_BLK_F_RO), 0);

    let mut space = [0u8; 64];
    block.read_config(0, &mut space);
    let le32 = |at: usize| u32::from_le_bytes(space[at..at + 4].try_into().unwrap());
    assert_eq!(u64::from_le_bytes(space[..8].try_into().unwrap()), 6144);
    assert_eq!(le32(12), SEG_MAX);
    assert_eq!(le32(20), 512);
    assert_eq!(le32(36), MAX_DISCARD_SECTORS);
    assert_eq!(le32(40), MAX_DISCARD_SEGMENTS);
    assert_eq!(le32(48), MAX_DISCARD_SECTORS);
    assert_eq!(le32(52), MAX_DISCARD_SEGMENTS);
    assert_eq!(space[56], 1);

    // Partial and out-of-range reads.
    let mut four = [0xffu8; 4];
    block.read_config(20, &mut four);
    assert_eq!(u32::from_le_bytes(four), 512);
    block.read_config(1 << 20, &mut four);
    assert_eq!(four, [0; 4]);
    block.read_config(u64::MAX, &mut four);
    assert_eq!(four, [0; 4]);
}

#[test]
fn the_worker_thread_is_named() {
    let scratch = Scratch::new("name");
    let path = scratch.file("disk", &vec![0u8; 4096]);
    let mut config = drive(&path, IoEngine::Sync);
    config.drive_id = "root-fs".into();
    let h = Harness::new(new_block(config));
    let names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .collect();
    assert!(names.iter().any(|n| n == "virtio-blk-root"), "{names:?}");
    drop(h);
}

/// Issue 25: a drive's state carries its rate limiter's buckets as the pause found them;
/// a restore loads them, and refuses a bucket no drive can have held, changing nothing.
#[test]
fn state_carries_the_rate_limiter_buckets() {
    let scratch = Scratch::new("buckets");
    let path = scratch.file("disk", &vec![0u8; 1 << 20]);
    let mut config = drive(&path, IoEngine::Sync);
    config.rate_limiter = ops_limit(10, 1000);
    let mut block = new_block(config.clone());
    assert!(block.pause().is_empty(), "never activated");
    let state = block.save_state().unwrap();
    let crate::DeviceState::Block(fields) = &state else {
        panic!("not a block state: {state:?}")
    };
    let ops = fields.buckets.ops.expect("the ops bucket is saved");
    assert_eq!((ops.config.size, ops.budget, ops.debt), (10, 10, 0));
    assert_eq!(fields.buckets.bandwidth, None);
    // One device at a time holds the image's lock.
    drop(block);

    let mut restored = new_block(config.clone());
    restored.restore_state(&state).unwrap();
    drop(restored);

    let mut forged = fields.clone();
    forged.buckets.ops.as_mut().unwrap().budget = 11;
    forged.serial = Some("changed".into());
    let mut refusing = new_block(config);
    let error = refusing
        .restore_state(&crate::DeviceState::Block(forged))
        .unwrap_err()
        .to_string();
    assert!(error.contains("more than its size 10"), "{error}");
    assert_eq!(refusing.config().serial, None, "nothing changed");
}

/// A live update's new process takes the old one's image descriptor: the drive keeps the
/// lock (it belongs to the open file description), so nobody else can open the image
/// meanwhile, and the image is not opened again.
#[test]
fn an_adopted_image_keeps_its_lock_and_data() {
    let scratch = Scratch::new("adopt");
    let path = scratch.file("disk", &pattern(8192, 5));
    let mut old = Block::new(drive(&path, IoEngine::Sync)).unwrap();
    let image = old.image_descriptor().unwrap();
    let mut config = drive(&path, IoEngine::Sync);
    config.drive_id = "adopt-same".into();
    let adopted = Block::adopt(config.clone(), image).unwrap();
    assert_eq!(adopted.capacity_sectors(), 16);
    // The old process ends: the adopted descriptor holds the lock alone.
    drop(old);
    let error = Block::new(drive(&path, IoEngine::Sync))
        .err()
        .expect("a second writer beside the adopted image");
    assert!(matches!(error, BlockError::Locked { .. }), "{error}");
    drop(adopted);
    Block::new(drive(&path, IoEngine::Sync)).unwrap();
}

#[test]
fn an_image_descriptor_that_is_not_the_drives_is_refused() {
    let scratch = Scratch::new("adopt-other");
    let path = scratch.file("disk", &vec![0u8; 4096]);
    let other = scratch.file("other", &vec![0u8; 4096]);
    let mut config = drive(&path, IoEngine::Sync);
    config.drive_id = "adopt-other".into();
    let other = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&other)
        .unwrap();
    let error = Block::adopt(config.clone(), other)
        .err()
        .expect("another file");
    assert!(
        matches!(error, BlockError::AdoptedMismatch { .. }) && error.to_string().contains("inode"),
        "{error}"
    );
    // A read-only descriptor cannot serve a read-write drive.
    config.drive_id = "adopt-read-only".into();
    let error = Block::adopt(config, std::fs::File::open(&path).unwrap())
        .err()
        .expect("a read-only descriptor");
    assert!(error.to_string().contains("not open read-write"), "{error}");
}
