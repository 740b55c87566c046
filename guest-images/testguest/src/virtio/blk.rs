//! `virtio-blk`: the block device (type 2). Reads the capacity, checks that sector 0 starts
//! with `GPUVMBLK` (the host test writes it), asks for the serial (GET_ID), then either writes
//! [`PATTERN_SEED`]'s pattern to sectors 8..16, flushes and reads it back, or, on a read-only
//! device, checks that a write is refused with IOERR.

use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, TYPE_BLOCK};
use super::{read_ram, write_ram, Dma, Hex};
use crate::console::exit;
use crate::pattern::pattern;
use crate::println;

const NAME: &str = "virtio-blk";
pub const F_RO: u64 = 1 << 5;
pub const F_FLUSH: u64 = 1 << 9;
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
pub const SECTOR: u64 = 512;
const ID_BYTES: usize = 20;
pub(crate) const MAGIC: &[u8; 8] = b"GPUVMBLK";
/// The write test: sectors 8..16 (4 KiB at disk offset 4096); the word at disk offset `o`
/// is `pattern(PATTERN_SEED, o)` (gpuvm_guest_images::pattern on the host).
const TEST_SECTOR: u64 = 8;
const TEST_SECTORS: u64 = 8;
pub const PATTERN_SEED: u64 = 0xb10c;

/// One request at a time on the request queue, with its header and status byte.
pub struct Request<'a> {
    dev: &'a VirtioPci,
    queue: SplitQueue,
    header: u64,
    status: u64,
}

impl<'a> Request<'a> {
    /// Allocates the header and the status byte for requests on `queue`.
    pub fn new(dev: &'a VirtioPci, queue: SplitQueue, dma: &mut Dma) -> Request<'a> {
        let header = dma.alloc(16, 16);
        let status = dma.alloc(1, 16);
        Request {
            dev,
            queue,
            header,
            status,
        }
    }

    /// One request: header, optional data, status byte. Returns the status.
    fn submit(&mut self, kind: u32, sector: u64, data: Option<Buffer>) -> u8 {
        let mut header = [0u8; 16];
        header[0..4].copy_from_slice(&kind.to_le_bytes());
        header[8..16].copy_from_slice(&sector.to_le_bytes());
        write_ram(self.header, &header);
        write_ram(self.status, &[0xff]);
        let head = Buffer::readable(self.header, 16);
        let status = Buffer::writable(self.status, 1);
        let added = match data {
            Some(data) => self.queue.add(&[head, data, status], 0),
            None => self.queue.add(&[head, status], 0),
        };
        if let Err(err) = added {
            self.dev.fail(format_args!("request queue: {err}"));
        }
        self.queue.notify();
        if let Err(err) = self.queue.wait_used() {
            self.dev
                .fail(format_args!("request type {kind} sector {sector}: {err}"));
        }
        let mut status = [0u8];
        read_ram(self.status, &mut status);
        status[0]
    }

    /// Submits a request that must succeed (EXIT_FAIL with `what` otherwise).
    pub fn expect_ok(&mut self, what: &str, kind: u32, sector: u64, data: Option<Buffer>) {
        let status = self.submit(kind, sector, data);
        if status != S_OK {
            self.dev.fail(format_args!("{what}: status {status}"));
        }
    }
}

/// A read-write disk other workloads move data through (`memory-hotplug blk`): set up
/// once, then whole-sector writes and reads at any guest-physical buffer.
pub(crate) struct DiskIo<'a> {
    request: Request<'a>,
}

impl<'a> DiskIo<'a> {
    /// Initializes `dev` (a block device, read-write) with its request queue in `dma`.
    pub(crate) fn open(dev: &'a mut VirtioPci, dma: &mut Dma) -> DiskIo<'a> {
        let features = dev.initialize(F_FLUSH);
        if features & F_RO != 0 {
            dev.fail(format_args!("the disk is read-only"));
        }
        let queue = dev.setup_queue(dma, 0, None);
        queue.suppress_interrupts(true);
        dev.driver_ok();
        DiskIo {
            request: Request::new(dev, queue, dma),
        }
    }

    /// Writes `len` bytes (whole sectors) from guest-physical `addr` at `sector`.
    pub(crate) fn write(&mut self, sector: u64, addr: u64, len: u32) {
        let data = Buffer::readable(addr, len);
        self.request.expect_ok("write", T_OUT, sector, Some(data));
    }

    /// Reads `len` bytes (whole sectors) at `sector` into guest-physical `addr`.
    pub(crate) fn read(&mut self, sector: u64, addr: u64, len: u32) {
        let data = Buffer::writable(addr, len);
        self.request.expect_ok("read", T_IN, sector, Some(data));
    }
}

pub fn run(dma: &mut Dma) -> ! {
    let mut dev = VirtioPci::find(NAME, TYPE_BLOCK);
    check(&mut dev, dma);
    exit(0)
}

/// The checks on `dev`, ending with the `virtio-blk: ok ...` line (EXIT_FAIL on a failure).
pub(crate) fn check(dev: &mut VirtioPci, dma: &mut Dma) {
    let features = dev.initialize(F_RO | F_FLUSH);
    let queue = dev.setup_queue(dma, 0, None);
    queue.suppress_interrupts(true);
    dev.driver_ok();
    let read_only = features & F_RO != 0;
    let capacity = dev.read_config(|dev| dev.config64(0));
    println!(
        "{NAME}: capacity {capacity} sectors, {}, flush {}",
        if read_only { "read-only" } else { "read-write" },
        if features & F_FLUSH != 0 {
            "offered"
        } else {
            "not offered"
        }
    );

    let mut request = Request::new(dev, queue, dma);
    let data = dma.alloc(TEST_SECTORS * SECTOR, 4096);

    request.expect_ok(
        "read sector 0",
        T_IN,
        0,
        Some(Buffer::writable(data, SECTOR as u32)),
    );
    let mut first = [0u8; 16];
    read_ram(data, &mut first);
    println!("{NAME}: sector 0 {}", Hex(&first));
    if &first[..8] != MAGIC {
        dev.fail(format_args!(
            "sector 0 starts with {}, expected {} (\"GPUVMBLK\")",
            Hex(&first[..8]),
            Hex(MAGIC)
        ));
    }

    let id = dma.alloc(ID_BYTES as u64, 16);
    request.expect_ok(
        "GET_ID",
        T_GET_ID,
        0,
        Some(Buffer::writable(id, ID_BYTES as u32)),
    );
    let mut id_bytes = [0u8; ID_BYTES];
    read_ram(id, &mut id_bytes);
    // NUL-terminated unless all 20 bytes are used; anything but printable ASCII is a failure.
    let id_len = id_bytes.iter().position(|&b| b == 0).unwrap_or(ID_BYTES);
    let serial = match core::str::from_utf8(&id_bytes[..id_len]) {
        Ok(text) if text.bytes().all(|b| b.is_ascii_graphic()) => text,
        _ => dev.fail(format_args!("GET_ID returned {}", Hex(&id_bytes))),
    };
    println!("{NAME}: serial '{serial}'");

    if capacity < TEST_SECTOR + TEST_SECTORS {
        dev.fail(format_args!(
            "capacity {capacity} sectors, the write test needs {}",
            TEST_SECTOR + TEST_SECTORS
        ));
    }
    let len = TEST_SECTORS * SECTOR;
    let mut word = 0;
    while word < len {
        let value = pattern(PATTERN_SEED, TEST_SECTOR * SECTOR + word);
        write_ram(data + word, &value.to_le_bytes());
        word += 8;
    }
    let write = Buffer::readable(data, len as u32);
    if read_only {
        let status = request.submit(T_OUT, TEST_SECTOR, Some(write));
        if status != S_IOERR {
            dev.fail(format_args!(
                "write to a read-only device answered status {status}, expected {S_IOERR} (IOERR)"
            ));
        }
        println!("{NAME}: write refused");
    } else {
        request.expect_ok("write sectors 8..16", T_OUT, TEST_SECTOR, Some(write));
        if features & F_FLUSH != 0 {
            request.expect_ok("flush", T_FLUSH, 0, None);
        }
        crate::pattern::zero(data, len);
        request.expect_ok(
            "read sectors 8..16",
            T_IN,
            TEST_SECTOR,
            Some(Buffer::writable(data, len as u32)),
        );
        if let Some((offset, expected, got)) = pattern_mismatch(data) {
            dev.fail(format_args!(
                "read back disk offset {offset:#x}: expected {expected:#018x} got {got:#018x}"
            ));
        }
        let flushed = if features & F_FLUSH != 0 {
            ", flushed"
        } else {
            ""
        };
        println!("{NAME}: wrote{flushed} and read back {len} bytes at sector {TEST_SECTOR}");
    }
    println!(
        "{NAME}: ok capacity={capacity} serial={serial} rw={}",
        if read_only { "no" } else { "yes" }
    );
}

/// The first word of the write test's sectors, read into `data`, that is not the pattern
/// [`check`] writes there: (disk offset, expected, got).
fn pattern_mismatch(data: u64) -> Option<(u64, u64, u64)> {
    (0..TEST_SECTORS * SECTOR).step_by(8).find_map(|word| {
        let mut bytes = [0u8; 8];
        read_ram(data + word, &mut bytes);
        let got = u64::from_le_bytes(bytes);
        let offset = TEST_SECTOR * SECTOR + word;
        let expected = pattern(PATTERN_SEED, offset);
        (got != expected).then_some((offset, expected, got))
    })
}

/// A read-write disk [`check`] ran on earlier (before a snapshot and restore, say), read
/// again through a fresh initialization of `dev`: sector 0 must still start with the magic
/// and sectors 8..16 hold the pattern the checks wrote. Returns the 8 bytes after the magic
/// (the host's tag for the disk, telling the disks apart).
pub(crate) fn check_kept(dev: &mut VirtioPci, dma: &mut Dma) -> [u8; 8] {
    let data = dma.alloc(TEST_SECTORS * SECTOR, 4096);
    let mut disk = DiskIo::open(dev, dma);
    disk.read(0, data, SECTOR as u32);
    let mut first = [0u8; 16];
    read_ram(data, &mut first);
    if &first[..8] != MAGIC {
        super::fail(
            NAME,
            format_args!(
                "kept disk: sector 0 starts with {}, expected {} (\"GPUVMBLK\")",
                Hex(&first[..8]),
                Hex(MAGIC)
            ),
        );
    }
    disk.read(TEST_SECTOR, data, (TEST_SECTORS * SECTOR) as u32);
    if let Some((offset, expected, got)) = pattern_mismatch(data) {
        super::fail(
            NAME,
            format_args!(
                "kept disk: offset {offset:#x} reads {got:#018x}, the checks wrote {expected:#018x}"
            ),
        );
    }
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&first[8..]);
    tag
}
