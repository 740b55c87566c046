//! `virtio-devices [COUNT]`: the block, entropy and socket devices together, for snapshot,
//! restore and drive hot-swap tests. It reads the drive's capacity and sector 0 and 64 bytes
//! of entropy, then serves COUNT (default 1) vsock connections on port 1024 like
//! `virtio-vsock`. After connection `k` ends it reads the drive's capacity (from the device
//! configuration, so a swapped image shows) and sector 0 again, reads 64 more bytes of
//! entropy, and writes [`PATTERN_SEED`]'s pattern to sector 16 + k - 1 (connection 1: sector
//! 16) and flushes. A TRANSPORT_RESET event (the device lost its connections: a restore)
//! drops the connection being served and the server keeps listening.
//!
//! Lines: `virtio-devices: blk capacity=<sectors> sector0=<hex>`, `virtio-devices: listening
//! ...`, per connection `virtio-devices: after connection <k>: blk capacity=<sectors>
//! sector0=<hex>`, `virtio-devices: rng ok`, `virtio-devices: wrote sector <16+k-1>`, and at
//! the end `virtio-devices: ok connections=<COUNT>`.

use super::blk::{Request, F_FLUSH, F_RO, SECTOR, T_FLUSH, T_IN, T_OUT};
use super::queue::{Buffer, SplitQueue};
use super::rng::{read_block, BLOCK};
use super::transport::{VirtioPci, TYPE_BLOCK, TYPE_ENTROPY, TYPE_VSOCK};
use super::vsock::{connection_count, Server};
use super::{read_ram, write_ram, Dma, Hex};
use crate::args::Words;
use crate::console::exit;
use crate::pattern::pattern;
use crate::println;

const NAME: &str = "virtio-devices";
const USAGE: &str = "virtio-devices [COUNT]";
/// After connection `k` (counted from 1) the workload writes sector
/// `FIRST_WRITE_SECTOR + k - 1`: connection 1 writes sector 16.
const FIRST_WRITE_SECTOR: u64 = 16;
/// The word at disk offset `o` of a written sector is `pattern(PATTERN_SEED, o)`
/// (gpuvm_guest_images::pattern on the host).
pub const PATTERN_SEED: u64 = 0xd5e7;

/// The drive: its device, one request at a time, and a one-sector buffer.
struct Drive<'a> {
    dev: &'a VirtioPci,
    request: Request<'a>,
    sector: u64,
}

impl Drive<'_> {
    /// The capacity in sectors as the device configuration says now.
    fn capacity(&self) -> u64 {
        self.dev.read_config(|dev| dev.config64(0))
    }

    /// The first 8 bytes of sector 0, read from the device.
    fn sector0(&mut self) -> [u8; 8] {
        crate::pattern::zero(self.sector, SECTOR);
        self.request.expect_ok(
            "read sector 0",
            T_IN,
            0,
            Some(Buffer::writable(self.sector, SECTOR as u32)),
        );
        let mut first = [0u8; 8];
        read_ram(self.sector, &mut first);
        first
    }

    /// Writes the pattern to `sector` (which must lie below `capacity`) and flushes.
    fn write_pattern(&mut self, sector: u64, capacity: u64) {
        if sector >= capacity {
            self.dev.fail(format_args!(
                "capacity {capacity} sectors, the workload writes sector {sector}"
            ));
        }
        let mut word = 0;
        while word < SECTOR {
            let value = pattern(PATTERN_SEED, sector * SECTOR + word);
            write_ram(self.sector + word, &value.to_le_bytes());
            word += 8;
        }
        self.request.expect_ok(
            "write the pattern",
            T_OUT,
            sector,
            Some(Buffer::readable(self.sector, SECTOR as u32)),
        );
        self.request.expect_ok("flush", T_FLUSH, 0, None);
    }
}

/// The entropy device's request queue and a buffer; the last block read.
struct Entropy<'a> {
    dev: &'a VirtioPci,
    queue: SplitQueue,
    buffer: u64,
    last: [u8; BLOCK],
}

impl Entropy<'_> {
    /// Reads 64 bytes into a zeroed buffer; they must not be all zero nor the same as the
    /// previous read's (a device that wrote nothing, or stale bytes).
    fn read(&mut self) {
        crate::pattern::zero(self.buffer, BLOCK as u64);
        let block = read_block(self.dev, &mut self.queue, self.buffer);
        if block.iter().all(|&b| b == 0) {
            self.dev
                .fail(format_args!("64 bytes of entropy are all zero"));
        }
        if block == self.last {
            self.dev.fail(format_args!(
                "64 bytes of entropy are the same as the previous read: {}",
                Hex(&block)
            ));
        }
        self.last = block;
        println!("{NAME}: rng ok");
    }
}

pub fn run(dma: &mut Dma, words: &mut Words) -> ! {
    let wanted = connection_count(words, USAGE);

    let mut blk_dev = VirtioPci::find(NAME, TYPE_BLOCK);
    let features = blk_dev.initialize(F_RO | F_FLUSH);
    if features & F_RO != 0 {
        blk_dev.fail(format_args!("the drive is read-only; this workload writes"));
    }
    if features & F_FLUSH == 0 {
        blk_dev.fail(format_args!("the drive does not offer FLUSH"));
    }
    let blk_queue = blk_dev.setup_queue(dma, 0, None);
    blk_queue.suppress_interrupts(true);
    blk_dev.driver_ok();

    let mut rng_dev = VirtioPci::find(NAME, TYPE_ENTROPY);
    rng_dev.initialize(0);
    let rng_queue = rng_dev.setup_queue(dma, 0, None);
    rng_queue.suppress_interrupts(true);
    rng_dev.driver_ok();

    let mut vsock_dev = VirtioPci::find(NAME, TYPE_VSOCK);
    vsock_dev.initialize(0);

    let mut drive = Drive {
        dev: &blk_dev,
        request: Request::new(&blk_dev, blk_queue, dma),
        sector: dma.alloc(SECTOR, 4096),
    };
    let mut entropy = Entropy {
        dev: &rng_dev,
        queue: rng_queue,
        buffer: dma.alloc(4096, 4096),
        last: [0; BLOCK],
    };

    let capacity = drive.capacity();
    let first = drive.sector0();
    println!("{NAME}: blk capacity={capacity} sector0={}", Hex(&first));
    entropy.read();

    let mut server = Server::start(NAME, &vsock_dev, dma);
    println!(
        "{NAME}: listening cid={} port=1024 connections={wanted}",
        server.cid
    );
    server.serve(wanted, true, |k| {
        let capacity = drive.capacity();
        let first = drive.sector0();
        println!(
            "{NAME}: after connection {k}: blk capacity={capacity} sector0={}",
            Hex(&first)
        );
        entropy.read();
        let sector = FIRST_WRITE_SECTOR + u64::from(k - 1);
        drive.write_pattern(sector, capacity);
        println!("{NAME}: wrote sector {sector}");
    });
    println!("{NAME}: ok connections={wanted}");
    exit(0)
}
