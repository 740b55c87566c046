//! Benchmark workloads for bench/virtio: they move data as fast as the ring-3 driver can, time
//! themselves with the TSC and print one parseable line per measurement.
//!
//! - `virtio-blk-bench SIZE_MIB [DEPTH] [RANDOM_COUNT]`: on the first block device, a
//!   sequential read of the first SIZE_MIB MiB in 1 MiB requests, a sequential write of the
//!   same range (skipped on a read-only drive), then RANDOM_COUNT (default 20000) 4 KiB reads
//!   at random 4 KiB-aligned offsets in that range. DEPTH (default 16, at most 21: three
//!   descriptors per request in a 64-entry queue) requests are kept in flight, the used ring
//!   is polled, and one notification covers every request added since the last one. Lines:
//!   `virtio-blk-bench: tsc_hz=<hz> source=<cpuid-15|cpuid-16|hypervisor|guess>`,
//!   `virtio-blk-bench: <seq-read|seq-write|rand-read> bytes=<n> requests=<r> depth=<d>
//!   cycles=<c> notifies=<k> notify_cycles=<cycles spent in the k notifications>`, then `virtio-blk-bench: ok`. The guest idles 50 ms after the
//!   `capacity=` line and after each phase's line, so the host can sample the VMM's threads
//!   between phases.
//! - `virtio-vsock-bench [PORT]`: a socket-device server on PORT (default 1234) built for
//!   speed: 64 KiB receive buffers (as many as the queue takes) and several transmit buffers
//!   in flight, notifications batched. It serves one connection at a time; each starts with a
//!   command of 9 bytes, a letter and a little-endian u64 argument:
//!   - `S n`: sink. The guest consumes n bytes and answers 16 bytes: the byte count and the
//!     TSC cycles from the first data byte to the last (both u64 LE).
//!   - `G n`: source. The guest sends n bytes (as fast as the host's credit allows).
//!   - `E 0`: echo every byte back (one message at a time: for ping-pong latency).
//!   - `Q 0`: answer one byte `q`; the workload prints its totals and exits 0 once the host
//!     closes the connection.
//!
//!   Lines: `virtio-vsock-bench: listening cid=<cid> port=<port> tsc_hz=<hz> source=<s>`,
//!   `virtio-vsock-bench: sink bytes=<n> cycles=<c>` per sink, `virtio-vsock-bench: ok ...`.
//!
//! - `virtio-fs-bench SIZE_MIB [DEPTH]`: on the first virtio-fs device (virtiofsd), FUSE_INIT
//!   (asking for FUSE_MAX_PAGES), LOOKUP of `big.bin` in the root, OPEN read-only, then READs
//!   of the whole of its first SIZE_MIB MiB in requests of the largest size the INIT reply
//!   allows (max_pages * 4 KiB with FUSE_MAX_PAGES, else max_write), at most 1 MiB, with
//!   DEPTH (default 4, at most 16) in flight on request queue 1, polled; RELEASE. Lines:
//!   `virtio-fs-bench: tsc_hz=<hz> source=<s>`, `virtio-fs-bench: init major=7 minor=<m>
//!   max_write=<n> max_pages=<p> chunk=<bytes>`, `virtio-fs-bench: seq-read bytes=<n>
//!   requests=<r> depth=<d> chunk=<bytes> cycles=<c> notifies=<k>`, `virtio-fs-bench: ok`.
//!
//! Buffers for all of them live at [`BUF_START`].. (64 MiB up; run with --memory 256M or more), rings
//! and request headers in the driver's DMA area.

use core::sync::atomic::{fence, Ordering};

use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, TYPE_BLOCK, TYPE_VSOCK};
use super::{fail_setup, Deadline, Dma, PEER_TIMEOUT_MS, REQUEST_TIMEOUT_MS};
use crate::arch::{cpuid, delay_us, pause, rdtsc};
use crate::args::{parse_number, Words};
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::console::exit;
use crate::println;

/// Where the benchmark's data buffers start (above the driver's DMA area at 40-48 MiB).
pub const BUF_START: u64 = 64 << 20;

pub fn run(info: &BootInfo, workload: &str, words: &mut Words) -> ! {
    match workload {
        "virtio-blk-bench" => {
            let mut dma = Dma::new(info, BLK);
            blk_bench(info, &mut dma, words)
        }
        "virtio-vsock-bench" => {
            let mut dma = Dma::new(info, VSOCK);
            vsock_bench(info, &mut dma, words)
        }
        "virtio-fs-bench" => {
            let mut dma = Dma::new(info, FS);
            fs_bench(info, &mut dma, words)
        }
        other => {
            println!("testguest: unknown workload '{other}'");
            exit(super::EXIT_SETUP)
        }
    }
}

/// The TSC frequency and where it came from (CPUID 0x15, 0x16, the hypervisor's timing leaf
/// 0x40000010), or 3 GHz marked `guess`: the host then converts cycles itself.
fn tsc_frequency() -> (u64, &'static str) {
    let max_leaf = cpuid(0, 0).eax;
    if max_leaf >= 0x15 {
        let r = cpuid(0x15, 0);
        if r.eax != 0 && r.ebx != 0 && r.ecx != 0 {
            return (r.ecx as u64 * r.ebx as u64 / r.eax as u64, "cpuid-15");
        }
    }
    if max_leaf >= 0x16 {
        let mhz = cpuid(0x16, 0).eax & 0xffff;
        if mhz != 0 {
            return (mhz as u64 * 1_000_000, "cpuid-16");
        }
    }
    let hypervisor = cpuid(1, 0).ecx & (1 << 31) != 0;
    if hypervisor && cpuid(0x4000_0000, 0).eax >= 0x4000_0010 {
        let khz = cpuid(0x4000_0010, 0).eax;
        if khz != 0 {
            return (khz as u64 * 1000, "hypervisor");
        }
    }
    (3_000_000_000, "guess")
}

/// Fails with EXIT_SETUP unless e820 RAM covers `[BUF_START, BUF_START + len)`.
fn check_buffer_ram(info: &BootInfo, workload: &str, len: u64) {
    let end = BUF_START + len;
    let covered = info.memmap().iter().any(|entry| {
        entry.kind == E820_RAM
            && entry.addr <= BUF_START
            && entry.addr.saturating_add(entry.size) >= end
    });
    if !covered {
        fail_setup(
            workload,
            format_args!(
                "not enough RAM: buffers need {BUF_START:#x}-{end:#x} (--memory {}M or more)",
                (end >> 20) + 64
            ),
        );
    }
}

/// The next optional numeric argument (`default` when absent); EXIT_SETUP on a bad one.
fn optional_number(words: &mut Words, usage: &str, default: u64) -> u64 {
    match words.next_word() {
        None => default,
        Some(word) => parse_number(word).unwrap_or_else(|| {
            println!("testguest: bad argument '{word}'; usage: {usage}");
            exit(super::EXIT_SETUP)
        }),
    }
}

fn write_u32(addr: u64, value: u32) {
    // SAFETY: `addr` is inside a buffer this workload allocated (DMA area or bench buffers),
    // identity mapped, user writable RAM nobody else uses.
    unsafe { (addr as *mut u32).write_volatile(value) }
}

fn write_u64(addr: u64, value: u64) {
    // SAFETY: as in `write_u32`.
    unsafe { (addr as *mut u64).write_volatile(value) }
}

fn read_u8(addr: u64) -> u8 {
    // SAFETY: as in `write_u32`.
    unsafe { (addr as *const u8).read_volatile() }
}

fn write_u8(addr: u64, value: u8) {
    // SAFETY: as in `write_u32`.
    unsafe { (addr as *mut u8).write_volatile(value) }
}

// ---------------------------------------------------------------------------------------------
// virtio-blk-bench

const BLK: &str = "virtio-blk-bench";
const BLK_USAGE: &str = "virtio-blk-bench SIZE_MIB [DEPTH] [RANDOM_COUNT]";
const F_RO: u64 = 1 << 5;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const SECTOR: u64 = 512;
const MIB: u64 = 1 << 20;
const SEQ_REQUEST: u64 = MIB;
const RANDOM_REQUEST: u64 = 4096;
const DEFAULT_DEPTH: u64 = 16;
/// Three descriptors per request (header, data, status) in a queue of at most 64.
const MAX_DEPTH: usize = 21;
const DEFAULT_RANDOM: u64 = 20_000;
/// Idle time after each line that ends a phase (and before the first), so the host can read
/// the VMM's per-thread CPU times between phases while the device is idle.
const PHASE_GAP_US: u64 = 50_000;

struct BlkBench<'a> {
    dev: &'a VirtioPci,
    queue: SplitQueue,
    depth: usize,
    /// Per slot: a 16-byte request header and a status byte (DMA area).
    headers: u64,
    statuses: u64,
    /// Per slot: one 1 MiB data buffer at BUF_START + slot MiB.
    data: u64,
    notifies: u64,
    tsc_hz: u64,
}

impl BlkBench<'_> {
    /// Runs `count` requests of `kind` and `len` bytes, the i-th at sector `sector_of(i)`,
    /// `depth` in flight; returns the TSC cycles from the first submission to the last
    /// completion.
    fn phase(
        &mut self,
        what: &str,
        kind: u32,
        len: u64,
        count: u64,
        mut sector_of: impl FnMut(u64) -> u64,
    ) -> u64 {
        let mut free = [0u8; MAX_DEPTH];
        let mut free_len = self.depth;
        for (slot, entry) in free.iter_mut().enumerate().take(self.depth) {
            *entry = slot as u8;
        }
        let notifies_before = self.notifies;
        let mut notify_cycles = 0u64;
        let mut submitted = 0u64;
        let mut completed = 0u64;
        let mut deadline = Deadline::after_ms(REQUEST_TIMEOUT_MS);
        let start = rdtsc();
        while completed < count {
            let mut added = false;
            while free_len > 0 && submitted < count {
                free_len -= 1;
                let slot = u64::from(free[free_len]);
                let header = self.headers + 16 * slot;
                let status = self.statuses + slot;
                write_u32(header, kind);
                write_u32(header + 4, 0);
                write_u64(header + 8, sector_of(submitted));
                write_u8(status, 0xff);
                let chain = [
                    Buffer::readable(header, 16),
                    Buffer {
                        addr: self.data + slot * SEQ_REQUEST,
                        len: len as u32,
                        device_writes: kind == T_IN,
                    },
                    Buffer::writable(status, 1),
                ];
                if let Err(err) = self.queue.add(&chain, slot) {
                    self.dev.fail(format_args!("{what}: request queue: {err}"));
                }
                submitted += 1;
                added = true;
            }
            if added {
                let before = rdtsc();
                self.queue.notify();
                notify_cycles += rdtsc().wrapping_sub(before);
                self.notifies += 1;
            }
            let mut progressed = false;
            loop {
                match self.queue.pop_used() {
                    Ok(Some(used)) => {
                        let slot = used.token;
                        let status = read_u8(self.statuses + slot);
                        if status != 0 {
                            self.dev.fail(format_args!(
                                "{what}: request {completed} answered status {status}"
                            ));
                        }
                        free[free_len] = slot as u8;
                        free_len += 1;
                        completed += 1;
                        progressed = true;
                    }
                    Ok(None) => break,
                    Err(err) => self.dev.fail(format_args!("{what}: {err}")),
                }
            }
            if progressed {
                deadline = Deadline::after_ms(REQUEST_TIMEOUT_MS);
            } else if deadline.expired() {
                self.dev.fail(format_args!(
                    "{what}: no request completed within {REQUEST_TIMEOUT_MS} ms ({completed} of {count} done)"
                ));
            } else {
                pause();
            }
        }
        let cycles = rdtsc().wrapping_sub(start);
        println!(
            "{BLK}: {what} bytes={} requests={count} depth={} cycles={cycles} notifies={} notify_cycles={notify_cycles}",
            count * len,
            self.depth,
            self.notifies - notifies_before
        );
        delay_us(self.tsc_hz, PHASE_GAP_US);
        cycles
    }
}

fn blk_bench(info: &BootInfo, dma: &mut Dma, words: &mut Words) -> ! {
    let Some(size_mib) = words.next_word().and_then(parse_number) else {
        println!("testguest: missing or bad SIZE_MIB; usage: {BLK_USAGE}");
        exit(super::EXIT_SETUP)
    };
    let depth = optional_number(words, BLK_USAGE, DEFAULT_DEPTH);
    let random = optional_number(words, BLK_USAGE, DEFAULT_RANDOM);
    if size_mib == 0 || depth == 0 || depth as usize > MAX_DEPTH {
        println!("testguest: SIZE_MIB must be > 0 and DEPTH 1..={MAX_DEPTH}; usage: {BLK_USAGE}");
        exit(super::EXIT_SETUP)
    }
    let depth = depth as usize;
    check_buffer_ram(info, BLK, depth as u64 * SEQ_REQUEST);
    let (tsc_hz, source) = tsc_frequency();
    println!("{BLK}: tsc_hz={tsc_hz} source={source}");

    let mut dev = VirtioPci::find(BLK, TYPE_BLOCK);
    let features = dev.initialize(F_RO);
    let queue = dev.setup_queue(dma, 0, None);
    queue.suppress_interrupts(true);
    dev.driver_ok();
    let capacity = dev.read_config(|dev| dev.config64(0));
    let sectors = size_mib * (MIB / SECTOR);
    if capacity < sectors {
        dev.fail(format_args!(
            "capacity {capacity} sectors, SIZE_MIB {size_mib} needs {sectors}"
        ));
    }
    let queue_size = queue.size;
    if depth * 3 > queue_size as usize {
        dev.fail(format_args!(
            "depth {depth} needs {} descriptors, the queue has {queue_size}",
            depth * 3
        ));
    }
    let headers = dma.alloc(16 * depth as u64, 16);
    let statuses = dma.alloc(depth as u64, 16);
    let data = BUF_START;
    // Something other than zeroes for the writes (the reads overwrite it).
    crate::pattern::fill(data, depth as u64 * SEQ_REQUEST, 0xbe7c);
    let read_only = features & F_RO != 0;
    println!(
        "{BLK}: capacity={capacity} size_mib={size_mib} depth={depth} queue_size={queue_size} rw={}",
        if read_only { "no" } else { "yes" }
    );
    let mut bench = BlkBench {
        dev: &dev,
        queue,
        depth,
        headers,
        statuses,
        data,
        notifies: 0,
        tsc_hz,
    };
    delay_us(tsc_hz, PHASE_GAP_US);
    let per_request = SEQ_REQUEST / SECTOR;
    bench.phase("seq-read", T_IN, SEQ_REQUEST, size_mib, |i| i * per_request);
    if read_only {
        println!("{BLK}: seq-write skipped (read-only drive)");
    } else {
        bench.phase("seq-write", T_OUT, SEQ_REQUEST, size_mib, |i| {
            i * per_request
        });
    }
    let pages = size_mib * (MIB / RANDOM_REQUEST);
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ rdtsc();
    bench.phase("rand-read", T_IN, RANDOM_REQUEST, random, |_| {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % pages) * (RANDOM_REQUEST / SECTOR)
    });
    println!("{BLK}: ok notifies={}", bench.notifies);
    exit(0)
}

// ---------------------------------------------------------------------------------------------
// virtio-vsock-bench

const VSOCK: &str = "virtio-vsock-bench";
const VSOCK_USAGE: &str = "virtio-vsock-bench [PORT]";
const DEFAULT_PORT: u64 = 1234;
const HEADER: u64 = 44;
/// The device's largest packet payload (MAX_PKT_DATA).
const PAYLOAD: u64 = 64 << 10;
/// One rx or tx buffer (header and payload), rounded to pages.
const SLOT: u64 = (HEADER + PAYLOAD + 4095) & !4095;
const RX_BUFFERS: usize = 64;
const TX_BUFFERS: usize = 32;
const EVENT_BUFFERS: usize = 4;
/// Receive space the guest advertises; a sink consumes at once, so it never fills.
const GUEST_BUF_ALLOC: u32 = 16 << 20;
/// A credit update goes out once this much was consumed since the host last heard.
const CREDIT_UPDATE_EVERY: u32 = 4 << 20;
/// Rx buffers given back before the queue is notified (or sooner when the queue is idle).
const RX_NOTIFY_BATCH: u32 = 16;
const TYPE_STREAM: u16 = 1;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const COMMAND_LEN: usize = 9;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The command's 9 bytes are not all in yet.
    Command,
    Sink {
        wanted: u64,
    },
    Source {
        left: u64,
    },
    Echo,
    Quit,
}

struct Conn {
    peer_cid: u64,
    peer_port: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Payload bytes sent to the peer.
    tx_cnt: u32,
    /// Payload bytes consumed (all of them, at once): our fwd_cnt.
    fwd_cnt: u32,
    /// fwd_cnt as last sent to the peer.
    fwd_cnt_sent: u32,
    credit_requested: bool,
    command: [u8; COMMAND_LEN],
    command_len: usize,
    mode: Mode,
    sink_received: u64,
    sink_start: u64,
}

struct Vsock<'a> {
    dev: &'a VirtioPci,
    cid: u64,
    port: u32,
    rx: SplitQueue,
    tx: SplitQueue,
    events: SplitQueue,
    tx_free: [u64; TX_BUFFERS],
    tx_free_len: usize,
    tx_unnotified: bool,
    rx_unnotified: u32,
    conn: Option<Conn>,
    connections: u64,
    quit: bool,
    received: u64,
    sent: u64,
    rx_notifies: u64,
    tx_notifies: u64,
}

fn header_bytes(buffer: u64) -> [u8; HEADER as usize] {
    let mut bytes = [0u8; HEADER as usize];
    fence(Ordering::SeqCst);
    // SAFETY: `buffer` is an rx buffer of SLOT bytes the device finished with.
    unsafe { core::ptr::copy_nonoverlapping(buffer as *const u8, bytes.as_mut_ptr(), bytes.len()) };
    bytes
}

impl Vsock<'_> {
    fn fail(&self, what: core::fmt::Arguments) -> ! {
        self.dev.fail(what)
    }

    /// Takes finished tx buffers back.
    fn reap_tx(&mut self) {
        loop {
            match self.tx.pop_used() {
                Ok(Some(used)) => {
                    self.tx_free[self.tx_free_len] = used.token;
                    self.tx_free_len += 1;
                }
                Ok(None) => return,
                Err(err) => self.fail(format_args!("tx queue: {err}")),
            }
        }
    }

    fn flush_tx(&mut self) {
        if self.tx_unnotified {
            self.tx_unnotified = false;
            self.tx.notify();
            self.tx_notifies += 1;
        }
    }

    /// A free tx buffer, waiting for one if all are in flight.
    fn tx_buffer(&mut self) -> u64 {
        if self.tx_free_len == 0 {
            self.flush_tx();
            let deadline = Deadline::after_ms(REQUEST_TIMEOUT_MS);
            loop {
                self.reap_tx();
                if self.tx_free_len > 0 {
                    break;
                }
                if deadline.expired() {
                    self.fail(format_args!(
                        "no tx buffer came back within {REQUEST_TIMEOUT_MS} ms"
                    ));
                }
                pause();
            }
        }
        self.tx_free_len -= 1;
        self.tx_free[self.tx_free_len]
    }

    /// Queues one packet whose payload (`len` bytes) is already at `buffer + HEADER`; the
    /// notification waits for [`Vsock::flush_tx`] unless `now`.
    fn send_from(
        &mut self,
        buffer: u64,
        op: u16,
        dst_cid: u64,
        dst_port: u32,
        len: u32,
        fwd: u32,
        now: bool,
    ) {
        write_u64(buffer, self.cid);
        write_u64(buffer + 8, dst_cid);
        write_u32(buffer + 16, self.port);
        write_u32(buffer + 20, dst_port);
        write_u32(buffer + 24, len);
        // type (u16) and op (u16)
        write_u32(buffer + 28, u32::from(TYPE_STREAM) | u32::from(op) << 16);
        write_u32(buffer + 32, 0);
        write_u32(buffer + 36, GUEST_BUF_ALLOC);
        write_u32(buffer + 40, fwd);
        if let Err(err) = self
            .tx
            .add(&[Buffer::readable(buffer, HEADER as u32 + len)], buffer)
        {
            self.fail(format_args!("tx queue: {err}"));
        }
        self.tx_unnotified = true;
        if now {
            self.flush_tx();
        }
    }

    /// A packet without payload to (cid, port).
    fn control_to(&mut self, op: u16, dst_cid: u64, dst_port: u32) {
        let fwd = self.conn.as_ref().map_or(0, |conn| conn.fwd_cnt);
        let buffer = self.tx_buffer();
        self.send_from(buffer, op, dst_cid, dst_port, 0, fwd, true);
        if let Some(conn) = &mut self.conn {
            conn.fwd_cnt_sent = conn.fwd_cnt;
        }
    }

    fn control(&mut self, op: u16) {
        let Some(conn) = &self.conn else { return };
        let (cid, port) = (conn.peer_cid, conn.peer_port);
        self.control_to(op, cid, port);
    }

    /// Sends `bytes` on the connection (a short reply: one packet, credit permitting).
    fn send_bytes(&mut self, bytes: &[u8]) {
        let Some(conn) = &self.conn else { return };
        let credit = conn
            .peer_buf_alloc
            .saturating_sub(conn.tx_cnt.wrapping_sub(conn.peer_fwd_cnt));
        if (credit as usize) < bytes.len() {
            self.fail(format_args!(
                "no credit for a {}-byte reply (peer allows {credit})",
                bytes.len()
            ));
        }
        let (cid, port, fwd) = (conn.peer_cid, conn.peer_port, conn.fwd_cnt);
        let buffer = self.tx_buffer();
        // SAFETY: the payload fits the tx buffer (bytes.len() <= PAYLOAD, checked by callers).
        unsafe {
            core::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (buffer + HEADER) as *mut u8,
                bytes.len(),
            )
        };
        self.send_from(buffer, OP_RW, cid, port, bytes.len() as u32, fwd, true);
        if let Some(conn) = &mut self.conn {
            conn.tx_cnt = conn.tx_cnt.wrapping_add(bytes.len() as u32);
            conn.fwd_cnt_sent = conn.fwd_cnt;
        }
        self.sent += bytes.len() as u64;
    }

    /// Source mode: sends as much as credit and tx buffers allow without waiting.
    fn pump_source(&mut self) {
        loop {
            if self.tx_free_len == 0 {
                self.reap_tx();
            }
            let Some(conn) = &mut self.conn else { return };
            let Mode::Source { left } = conn.mode else {
                return;
            };
            if left == 0 {
                conn.mode = Mode::Command;
                return;
            }
            let credit = conn
                .peer_buf_alloc
                .saturating_sub(conn.tx_cnt.wrapping_sub(conn.peer_fwd_cnt));
            if credit == 0 {
                if !conn.credit_requested {
                    conn.credit_requested = true;
                    self.control(OP_CREDIT_REQUEST);
                }
                return;
            }
            if self.tx_free_len == 0 {
                return;
            }
            let len = left.min(PAYLOAD).min(u64::from(credit)) as u32;
            let (cid, port, fwd) = (conn.peer_cid, conn.peer_port, conn.fwd_cnt);
            conn.tx_cnt = conn.tx_cnt.wrapping_add(len);
            conn.fwd_cnt_sent = conn.fwd_cnt;
            conn.mode = Mode::Source {
                left: left - u64::from(len),
            };
            self.sent += u64::from(len);
            let buffer = self.tx_buffer();
            self.send_from(buffer, OP_RW, cid, port, len, fwd, false);
        }
    }

    /// Consumes `len` payload bytes at `payload` for the connection: a command, then what
    /// the command says (sink bytes count, echo bytes come back); one connection may carry
    /// several sink or source commands in turn.
    fn data(&mut self, payload: u64, len: u32) {
        let now = rdtsc();
        let Some(conn) = &mut self.conn else { return };
        conn.fwd_cnt = conn.fwd_cnt.wrapping_add(len);
        self.received += u64::from(len);
        let len = u64::from(len);
        let mut offset = 0u64;
        while offset < len {
            let Some(conn) = &mut self.conn else { return };
            match conn.mode {
                Mode::Command => {
                    while offset < len && conn.command_len < COMMAND_LEN {
                        conn.command[conn.command_len] = read_u8(payload + offset);
                        conn.command_len += 1;
                        offset += 1;
                    }
                    if conn.command_len < COMMAND_LEN {
                        return;
                    }
                    conn.command_len = 0;
                    let argument = u64::from_le_bytes(conn.command[1..9].try_into().unwrap());
                    conn.sink_received = 0;
                    conn.mode = match conn.command[0] {
                        b'S' => Mode::Sink { wanted: argument },
                        b'G' => Mode::Source { left: argument },
                        b'E' => Mode::Echo,
                        b'Q' => Mode::Quit,
                        other => {
                            let other = other as char;
                            self.fail(format_args!("unknown command {other:?}"))
                        }
                    };
                    if conn.mode == Mode::Quit {
                        self.quit = true;
                        self.send_bytes(b"q");
                        return;
                    }
                    if conn.mode == (Mode::Sink { wanted: 0 }) {
                        conn.mode = Mode::Command;
                        self.send_bytes(&[0u8; 16]);
                    }
                }
                Mode::Sink { wanted } => {
                    let take = (len - offset).min(wanted - conn.sink_received);
                    if conn.sink_received == 0 {
                        conn.sink_start = now;
                    }
                    conn.sink_received += take;
                    offset += take;
                    if conn.sink_received == wanted {
                        let cycles = rdtsc().wrapping_sub(conn.sink_start);
                        conn.mode = Mode::Command;
                        let mut reply = [0u8; 16];
                        reply[..8].copy_from_slice(&wanted.to_le_bytes());
                        reply[8..].copy_from_slice(&cycles.to_le_bytes());
                        self.send_bytes(&reply);
                        println!("{VSOCK}: sink bytes={wanted} cycles={cycles}");
                    }
                }
                Mode::Echo => {
                    self.echo(payload + offset, len - offset);
                    return;
                }
                Mode::Source { .. } | Mode::Quit => {
                    // Bytes the host should not send now: consumed and dropped.
                    return;
                }
            }
        }
    }

    fn echo(&mut self, payload: u64, len: u64) {
        let mut offset = 0;
        while offset < len {
            let chunk = (len - offset).min(PAYLOAD);
            let mut bytes = [0u8; 256];
            if chunk <= bytes.len() as u64 {
                for (i, byte) in bytes.iter_mut().enumerate().take(chunk as usize) {
                    *byte = read_u8(payload + offset + i as u64);
                }
                self.send_bytes(&bytes[..chunk as usize]);
            } else {
                self.fail(format_args!(
                    "echo of {chunk} bytes at once: the echo mode is for small messages"
                ));
            }
            offset += chunk;
        }
    }

    fn drop_connection(&mut self) {
        if self.conn.take().is_some() {
            self.connections += 1;
        }
    }

    fn handle(&mut self, buffer: u64, used_len: u32) {
        let bytes = header_bytes(buffer);
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u16_at = |at: usize| u16::from_le_bytes(bytes[at..at + 2].try_into().unwrap());
        let (src_cid, dst_cid) = (u64_at(0), u64_at(8));
        let (src_port, dst_port) = (u32_at(16), u32_at(20));
        let len = u32_at(24);
        let (kind, op) = (u16_at(28), u16_at(30));
        let (buf_alloc, fwd_cnt) = (u32_at(36), u32_at(40));
        if (used_len as u64) < HEADER
            || u64::from(len) > PAYLOAD
            || u64::from(used_len) < HEADER + u64::from(len)
        {
            self.fail(format_args!(
                "rx packet op {op} of {used_len} bytes claims {len} payload bytes"
            ));
        }
        if kind != TYPE_STREAM || dst_cid != self.cid || dst_port != self.port {
            if op != OP_RST {
                self.control_to(OP_RST, src_cid, src_port);
            }
            return;
        }
        let ours = self
            .conn
            .as_ref()
            .is_some_and(|conn| conn.peer_cid == src_cid && conn.peer_port == src_port);
        if !ours {
            if op == OP_REQUEST && self.conn.is_none() && !self.quit {
                self.conn = Some(Conn {
                    peer_cid: src_cid,
                    peer_port: src_port,
                    peer_buf_alloc: buf_alloc,
                    peer_fwd_cnt: fwd_cnt,
                    tx_cnt: 0,
                    fwd_cnt: 0,
                    fwd_cnt_sent: 0,
                    credit_requested: false,
                    command: [0; COMMAND_LEN],
                    command_len: 0,
                    mode: Mode::Command,
                    sink_received: 0,
                    sink_start: 0,
                });
                self.control(OP_RESPONSE);
            } else if op != OP_RST {
                self.control_to(OP_RST, src_cid, src_port);
            }
            return;
        }
        if let Some(conn) = &mut self.conn {
            conn.peer_buf_alloc = buf_alloc;
            conn.peer_fwd_cnt = fwd_cnt;
            conn.credit_requested = false;
        }
        match op {
            OP_RW => self.data(buffer + HEADER, len),
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.control(OP_CREDIT_UPDATE),
            OP_SHUTDOWN => {
                self.control(OP_RST);
                self.drop_connection();
            }
            OP_RST => self.drop_connection(),
            other => self.fail(format_args!("unexpected op {other}")),
        }
        // The host's view of our receive space: tell it once enough was consumed.
        if let Some(conn) = &self.conn {
            if conn.fwd_cnt.wrapping_sub(conn.fwd_cnt_sent) >= CREDIT_UPDATE_EVERY {
                self.control(OP_CREDIT_UPDATE);
            }
        }
    }

    fn post_rx(&mut self, buffer: u64) {
        if let Err(err) = self.rx.add(
            &[Buffer::writable(buffer, (HEADER + PAYLOAD) as u32)],
            buffer,
        ) {
            self.fail(format_args!("rx queue: {err}"));
        }
        self.rx_unnotified += 1;
    }

    fn flush_rx(&mut self) {
        if self.rx_unnotified > 0 {
            self.rx_unnotified = 0;
            self.rx.notify();
            self.rx_notifies += 1;
        }
    }

    /// Events (transport reset) are taken off and given back; nothing else depends on them.
    fn poll_events(&mut self) {
        while let Ok(Some(used)) = self.events.pop_used() {
            let _ = self
                .events
                .add(&[Buffer::writable(used.token, 4)], used.token);
            self.events.notify();
            println!("{VSOCK}: event");
        }
    }

    fn serve(&mut self) {
        let mut idle = Deadline::after_ms(PEER_TIMEOUT_MS);
        let mut polls = 0u32;
        loop {
            let mut progressed = false;
            loop {
                match self.rx.pop_used() {
                    Ok(Some(used)) => {
                        progressed = true;
                        self.handle(used.token, used.len);
                        self.post_rx(used.token);
                        if self.rx_unnotified >= RX_NOTIFY_BATCH {
                            self.flush_rx();
                        }
                    }
                    Ok(None) => break,
                    Err(err) => self.fail(format_args!("rx queue: {err}")),
                }
            }
            self.pump_source();
            self.flush_tx();
            if progressed {
                idle = Deadline::after_ms(PEER_TIMEOUT_MS);
                continue;
            }
            // Idle: hand back whatever rx buffers wait, recycle tx buffers.
            self.flush_rx();
            self.reap_tx();
            if self.quit && self.conn.is_none() {
                return;
            }
            polls = polls.wrapping_add(1);
            if polls % 1024 == 0 {
                self.poll_events();
                if idle.expired() {
                    self.fail(format_args!(
                        "no packet within {PEER_TIMEOUT_MS} ms ({} connections served)",
                        self.connections
                    ));
                }
            }
            pause();
        }
    }
}

fn vsock_bench(info: &BootInfo, dma: &mut Dma, words: &mut Words) -> ! {
    let port = optional_number(words, VSOCK_USAGE, DEFAULT_PORT);
    let Ok(port) = u32::try_from(port) else {
        println!("testguest: bad PORT {port}; usage: {VSOCK_USAGE}");
        exit(super::EXIT_SETUP)
    };
    check_buffer_ram(info, VSOCK, (RX_BUFFERS + TX_BUFFERS) as u64 * SLOT);
    let (tsc_hz, source) = tsc_frequency();

    let mut dev = VirtioPci::find(VSOCK, TYPE_VSOCK);
    dev.initialize(0);
    let rx = dev.setup_queue(dma, 0, None);
    let tx = dev.setup_queue(dma, 1, None);
    let events = dev.setup_queue(dma, 2, None);
    for queue in [&rx, &tx, &events] {
        queue.suppress_interrupts(true);
    }
    dev.driver_ok();
    let cid = dev.read_config(|dev| dev.config64(0));
    let rx_count = RX_BUFFERS.min(rx.size as usize);
    let tx_count = TX_BUFFERS.min(tx.size as usize);
    let mut vsock = Vsock {
        dev: &dev,
        cid,
        port,
        rx,
        tx,
        events,
        tx_free: [0; TX_BUFFERS],
        tx_free_len: 0,
        tx_unnotified: false,
        rx_unnotified: 0,
        conn: None,
        connections: 0,
        quit: false,
        received: 0,
        sent: 0,
        rx_notifies: 0,
        tx_notifies: 0,
    };
    for i in 0..rx_count {
        vsock.post_rx(BUF_START + i as u64 * SLOT);
    }
    vsock.flush_rx();
    for i in 0..tx_count {
        vsock.tx_free[i] = BUF_START + (RX_BUFFERS + i) as u64 * SLOT;
    }
    vsock.tx_free_len = tx_count;
    for _ in 0..EVENT_BUFFERS.min(vsock.events.size as usize) {
        let buffer = dma.alloc(4, 8);
        if let Err(err) = vsock.events.add(&[Buffer::writable(buffer, 4)], buffer) {
            dev.fail(format_args!("event queue: {err}"));
        }
    }
    vsock.events.notify();
    println!(
        "{VSOCK}: listening cid={cid} port={port} rx_buffers={rx_count} tx_buffers={tx_count} tsc_hz={tsc_hz} source={source}"
    );
    vsock.serve();
    println!(
        "{VSOCK}: ok connections={} received={} sent={} rx_notifies={} tx_notifies={}",
        vsock.connections, vsock.received, vsock.sent, vsock.rx_notifies, vsock.tx_notifies
    );
    exit(0)
}

// ---------------------------------------------------------------------------------------------
// virtio-fs-bench

const FS: &str = "virtio-fs-bench";
const FS_USAGE: &str = "virtio-fs-bench SIZE_MIB [DEPTH]";
/// VIRTIO_ID_FS.
const TYPE_FS: u16 = 26;
const FS_DEFAULT_DEPTH: u64 = 4;
/// Three descriptors per request (in header + read_in, out header, data).
const FS_MAX_DEPTH: usize = 16;
const FUSE_LOOKUP: u32 = 1;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_RELEASE: u32 = 18;
const FUSE_INIT: u32 = 26;
/// FUSE_MAX_PAGES: the server may say how many pages one request carries.
const FUSE_MAX_PAGES: u32 = 1 << 22;
const FUSE_IN_HEADER: u64 = 40;
const FUSE_OUT_HEADER: u64 = 16;
/// fuse_read_in: fh, offset, size, read_flags, lock_owner, flags, padding.
const FUSE_READ_IN: u64 = 40;
const FS_BIG: &[u8] = b"big.bin\0";
const FS_MIN_CHUNK: u64 = 4096;

struct FsBench<'a> {
    dev: &'a VirtioPci,
    queue: SplitQueue,
    /// Per slot: in header + operation body (256 bytes), out header (16 bytes).
    requests: u64,
    out_headers: u64,
    /// Reply body for the set-up requests.
    reply: u64,
    unique: u64,
    notifies: u64,
}

impl FsBench<'_> {
    /// Writes slot `slot`'s fuse_in_header for `opcode` on `nodeid` with `body` after it;
    /// returns the unique.
    fn prepare(&mut self, slot: u64, opcode: u32, nodeid: u64, body: &[u8]) -> u64 {
        self.unique += 2;
        let request = self.requests + 256 * slot;
        let mut header = [0u8; FUSE_IN_HEADER as usize];
        header[0..4]
            .copy_from_slice(&((FUSE_IN_HEADER as usize + body.len()) as u32).to_le_bytes());
        header[4..8].copy_from_slice(&opcode.to_le_bytes());
        header[8..16].copy_from_slice(&self.unique.to_le_bytes());
        header[16..24].copy_from_slice(&nodeid.to_le_bytes());
        header[32..36].copy_from_slice(&1u32.to_le_bytes());
        super::write_ram(request, &header);
        super::write_ram(request + FUSE_IN_HEADER, body);
        write_u32(self.out_headers + 16 * slot, 0);
        self.unique
    }

    /// Checks slot `slot`'s reply to `unique`: the body length.
    fn check(&self, what: &str, slot: u64, unique: u64, used_len: u32, max_body: u64) -> u64 {
        let mut out = [0u8; FUSE_OUT_HEADER as usize];
        super::read_ram(self.out_headers + 16 * slot, &mut out);
        let len = u32::from_le_bytes(out[0..4].try_into().unwrap());
        let error = i32::from_le_bytes(out[4..8].try_into().unwrap());
        let echoed = u64::from_le_bytes(out[8..16].try_into().unwrap());
        if echoed != unique || error != 0 {
            self.dev.fail(format_args!(
                "{what}: reply unique {echoed} error {error}, expected unique {unique} error 0"
            ));
        }
        if u64::from(len) < FUSE_OUT_HEADER
            || u64::from(len) > FUSE_OUT_HEADER + max_body
            || used_len != len
        {
            self.dev.fail(format_args!(
                "{what}: reply length {len} (used length {used_len})"
            ));
        }
        u64::from(len) - FUSE_OUT_HEADER
    }

    /// One request at a time (set-up): the reply body's length (body at `self.reply`).
    fn call(&mut self, what: &str, opcode: u32, nodeid: u64, body: &[u8], reply_len: u32) -> u64 {
        let unique = self.prepare(0, opcode, nodeid, body);
        let mut chain = [Buffer::readable(0, 0); 3];
        chain[0] = Buffer::readable(self.requests, (FUSE_IN_HEADER as usize + body.len()) as u32);
        chain[1] = Buffer::writable(self.out_headers, FUSE_OUT_HEADER as u32);
        let count = if reply_len > 0 {
            chain[2] = Buffer::writable(self.reply, reply_len);
            3
        } else {
            2
        };
        if let Err(err) = self.queue.add(&chain[..count], 0) {
            self.dev.fail(format_args!("{what}: request queue: {err}"));
        }
        self.queue.notify();
        let used = match self.queue.wait_used() {
            Ok(used) => used,
            Err(err) => self.dev.fail(format_args!("{what}: {err}")),
        };
        self.check(what, 0, unique, used.len, u64::from(reply_len))
    }

    fn reply_u32(&self, at: u64) -> u32 {
        let mut bytes = [0u8; 4];
        super::read_ram(self.reply + at, &mut bytes);
        u32::from_le_bytes(bytes)
    }

    fn reply_u64(&self, at: u64) -> u64 {
        let mut bytes = [0u8; 8];
        super::read_ram(self.reply + at, &mut bytes);
        u64::from_le_bytes(bytes)
    }
}

fn fs_bench(info: &BootInfo, dma: &mut Dma, words: &mut Words) -> ! {
    let Some(size_mib) = words.next_word().and_then(parse_number) else {
        println!("testguest: missing or bad SIZE_MIB; usage: {FS_USAGE}");
        exit(super::EXIT_SETUP)
    };
    let depth = optional_number(words, FS_USAGE, FS_DEFAULT_DEPTH);
    if size_mib == 0 || depth == 0 || depth as usize > FS_MAX_DEPTH {
        println!("testguest: SIZE_MIB must be > 0 and DEPTH 1..={FS_MAX_DEPTH}; usage: {FS_USAGE}");
        exit(super::EXIT_SETUP)
    }
    let depth = depth as usize;
    check_buffer_ram(info, FS, depth as u64 * MIB);
    let (tsc_hz, source) = tsc_frequency();
    println!("{FS}: tsc_hz={tsc_hz} source={source}");

    let mut dev = VirtioPci::find(FS, TYPE_FS);
    dev.initialize(0);
    let hiprio = dev.setup_queue(dma, 0, None);
    hiprio.suppress_interrupts(true);
    let queue = dev.setup_queue(dma, 1, None);
    queue.suppress_interrupts(true);
    dev.driver_ok();
    if depth * 3 > queue.size as usize {
        dev.fail(format_args!(
            "depth {depth} needs {} descriptors, the queue has {}",
            depth * 3,
            queue.size
        ));
    }
    let mut fs = FsBench {
        dev: &dev,
        queue,
        requests: dma.alloc(256 * FS_MAX_DEPTH as u64, 64),
        out_headers: dma.alloc(16 * FS_MAX_DEPTH as u64, 64),
        reply: dma.alloc(4096, 4096),
        unique: 0,
        notifies: 0,
    };

    // FUSE_INIT (7.31): major, minor, max_readahead, flags.
    let mut init_in = [0u8; 16];
    init_in[0..4].copy_from_slice(&7u32.to_le_bytes());
    init_in[4..8].copy_from_slice(&31u32.to_le_bytes());
    init_in[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
    init_in[12..16].copy_from_slice(&FUSE_MAX_PAGES.to_le_bytes());
    let got = fs.call("FUSE_INIT", FUSE_INIT, 0, &init_in, 256);
    if got < 24 {
        dev.fail(format_args!("FUSE_INIT: reply body of {got} bytes"));
    }
    let (major, minor) = (fs.reply_u32(0), fs.reply_u32(4));
    let flags = fs.reply_u32(12);
    let max_write = fs.reply_u32(20);
    let max_pages = if got >= 30 {
        fs.reply_u32(28) & 0xffff
    } else {
        0
    };
    let limit = if flags & FUSE_MAX_PAGES != 0 && max_pages != 0 {
        u64::from(max_pages) * 4096
    } else {
        u64::from(max_write)
    };
    let chunk = limit.min(MIB) & !(FS_MIN_CHUNK - 1);
    if major != 7 || chunk < FS_MIN_CHUNK {
        dev.fail(format_args!(
            "FUSE_INIT: {major}.{minor}, max_write {max_write}, max_pages {max_pages}"
        ));
    }
    println!("{FS}: init major={major} minor={minor} max_write={max_write} max_pages={max_pages} chunk={chunk}");

    let got = fs.call("FUSE_LOOKUP", FUSE_LOOKUP, 1, FS_BIG, 128);
    if got < 128 {
        dev.fail(format_args!("FUSE_LOOKUP: reply body of {got} bytes"));
    }
    let node = fs.reply_u64(0);
    let file_size = fs.reply_u64(48);
    let bytes = size_mib * MIB;
    if file_size < bytes {
        dev.fail(format_args!(
            "big.bin has {file_size} bytes, SIZE_MIB {size_mib} needs {bytes}"
        ));
    }
    let mut open_in = [0u8; 8];
    open_in[0..4].copy_from_slice(&0u32.to_le_bytes());
    let got = fs.call("FUSE_OPEN", FUSE_OPEN, node, &open_in, 16);
    if got < 16 {
        dev.fail(format_args!("FUSE_OPEN: reply body of {got} bytes"));
    }
    let fh = fs.reply_u64(0);

    // The timed part: `depth` READs in flight, each into its own MiB at BUF_START.
    let count = bytes.div_ceil(chunk);
    let mut uniques = [0u64; FS_MAX_DEPTH];
    let mut free = [0u8; FS_MAX_DEPTH];
    let mut free_len = depth;
    for (slot, entry) in free.iter_mut().enumerate().take(depth) {
        *entry = slot as u8;
    }
    let (mut submitted, mut completed, mut received) = (0u64, 0u64, 0u64);
    let mut deadline = Deadline::after_ms(REQUEST_TIMEOUT_MS);
    let start = rdtsc();
    while completed < count {
        let mut added = false;
        while free_len > 0 && submitted < count {
            free_len -= 1;
            let slot = u64::from(free[free_len]);
            let offset = submitted * chunk;
            let size = chunk.min(bytes - offset);
            let mut read_in = [0u8; FUSE_READ_IN as usize];
            read_in[0..8].copy_from_slice(&fh.to_le_bytes());
            read_in[8..16].copy_from_slice(&offset.to_le_bytes());
            read_in[16..20].copy_from_slice(&(size as u32).to_le_bytes());
            uniques[slot as usize] = fs.prepare(slot, FUSE_READ, node, &read_in);
            let chain = [
                Buffer::readable(
                    fs.requests + 256 * slot,
                    (FUSE_IN_HEADER + FUSE_READ_IN) as u32,
                ),
                Buffer::writable(fs.out_headers + 16 * slot, FUSE_OUT_HEADER as u32),
                Buffer::writable(BUF_START + slot * MIB, size as u32),
            ];
            if let Err(err) = fs.queue.add(&chain, slot) {
                dev.fail(format_args!("FUSE_READ: request queue: {err}"));
            }
            submitted += 1;
            added = true;
        }
        if added {
            fs.queue.notify();
            fs.notifies += 1;
        }
        let mut progressed = false;
        loop {
            match fs.queue.pop_used() {
                Ok(Some(used)) => {
                    let slot = used.token;
                    let got = fs.check("FUSE_READ", slot, uniques[slot as usize], used.len, chunk);
                    if got == 0 {
                        dev.fail(format_args!(
                            "FUSE_READ: end of file after {received} bytes"
                        ));
                    }
                    received += got;
                    free[free_len] = slot as u8;
                    free_len += 1;
                    completed += 1;
                    progressed = true;
                }
                Ok(None) => break,
                Err(err) => dev.fail(format_args!("FUSE_READ: {err}")),
            }
        }
        if progressed {
            deadline = Deadline::after_ms(REQUEST_TIMEOUT_MS);
        } else if deadline.expired() {
            dev.fail(format_args!(
                "FUSE_READ: no reply within {REQUEST_TIMEOUT_MS} ms ({completed} of {count} done)"
            ));
        } else {
            pause();
        }
    }
    let cycles = rdtsc().wrapping_sub(start);
    if received != bytes {
        dev.fail(format_args!(
            "FUSE_READ: {received} bytes, expected {bytes}"
        ));
    }
    println!(
        "{FS}: seq-read bytes={bytes} requests={count} depth={depth} chunk={chunk} cycles={cycles} notifies={}",
        fs.notifies
    );
    let mut release_in = [0u8; 24];
    release_in[0..8].copy_from_slice(&fh.to_le_bytes());
    fs.call("FUSE_RELEASE", FUSE_RELEASE, node, &release_in, 0);
    println!("{FS}: ok");
    exit(0)
}
