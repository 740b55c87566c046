//! `virtio-vsock [COUNT]`: the socket device (type 19) as an echo server on port 1024. It
//! accepts COUNT connections (default 1) one after another, echoes every byte it receives
//! (respecting the peer's credit), and ends a connection with RST once the peer shut it
//! down (or reset it).

use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, TYPE_VSOCK};
use super::{read_ram, write_ram, Deadline, Dma, PEER_TIMEOUT_MS};
use crate::args::{parse_number, Words};
use crate::console::exit;
use crate::println;

const NAME: &str = "virtio-vsock";
const USAGE: &str = "virtio-vsock [COUNT]";
const PORT: u32 = 1024;
pub(crate) const HEADER: usize = 44;
/// Payload bytes per rx buffer and per packet sent.
const PAYLOAD: usize = 4096;
const RX_BUFFERS: usize = 16;
const EVENT_BUFFERS: usize = 4;
const EVENT_SIZE: u32 = 4;
/// What the driver tells the peer it may have in flight, and the echo buffer's size.
const BUF_ALLOC: u32 = 64 << 10;
pub(crate) const TYPE_STREAM: u16 = 1;
pub(crate) const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
pub(crate) const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
pub(crate) const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const SHUTDOWN_RCV: u32 = 1;
/// VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: the device lost every connection (after a restore).
const EVENT_TRANSPORT_RESET: u32 = 0;

/// struct virtio_vsock_hdr (little endian, packed).
#[derive(Clone, Copy, Default)]
struct Header {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    kind: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

impl Header {
    fn parse(bytes: &[u8; HEADER]) -> Header {
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u16_at = |at: usize| u16::from_le_bytes(bytes[at..at + 2].try_into().unwrap());
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            kind: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    fn bytes(&self) -> [u8; HEADER] {
        let mut out = [0u8; HEADER];
        out[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        out[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        out[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        out[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        out[24..28].copy_from_slice(&self.len.to_le_bytes());
        out[28..30].copy_from_slice(&self.kind.to_le_bytes());
        out[30..32].copy_from_slice(&self.op.to_le_bytes());
        out[32..36].copy_from_slice(&self.flags.to_le_bytes());
        out[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        out[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        out
    }
}

/// The connection being served.
struct Connection {
    number: u32,
    peer_cid: u64,
    peer_port: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Payload bytes sent to the peer (its credit is buf_alloc - (tx_cnt - fwd_cnt)).
    tx_cnt: u32,
    /// Payload bytes taken out of the echo buffer (= echoed), sent as our fwd_cnt.
    fwd_cnt: u32,
    /// Received bytes not echoed yet: [pending_start, pending_start + pending) in the ring.
    pending_start: u32,
    pending: u32,
    echoed: u64,
    credit_requested: bool,
    /// The peer will send no more (SHUTDOWN with SEND): RST once the echo is flushed.
    closing: bool,
}

pub struct Server<'a> {
    /// The workload whose lines these are (`virtio-vsock`, `virtio-devices`).
    name: &'static str,
    dev: &'a VirtioPci,
    pub cid: u64,
    rx: SplitQueue,
    tx: SplitQueue,
    events: SplitQueue,
    tx_buffer: u64,
    /// BUF_ALLOC bytes: the echo ring.
    ring: u64,
    connection: Option<Connection>,
    served: u32,
    pub echoed: u64,
}

impl Server<'_> {
    fn send(&mut self, mut header: Header, payload_from_ring: Option<(u32, u32)>) {
        header.src_cid = self.cid;
        header.src_port = PORT;
        header.kind = TYPE_STREAM;
        header.buf_alloc = BUF_ALLOC;
        let mut len = 0u32;
        if let Some((start, count)) = payload_from_ring {
            // Up to two pieces: the ring may wrap.
            let first = count.min(BUF_ALLOC - start);
            copy_ram(
                self.tx_buffer + HEADER as u64,
                self.ring + u64::from(start),
                first,
            );
            copy_ram(
                self.tx_buffer + (HEADER as u64) + u64::from(first),
                self.ring,
                count - first,
            );
            len = count;
        }
        header.len = len;
        write_ram(self.tx_buffer, &header.bytes());
        if let Err(err) = self
            .tx
            .add(&[Buffer::readable(self.tx_buffer, HEADER as u32 + len)], 0)
        {
            self.dev.fail(format_args!("tx queue: {err}"));
        }
        self.tx.notify();
        if let Err(err) = self.tx.wait_used() {
            self.dev
                .fail(format_args!("tx queue (op {}): {err}", header.op));
        }
    }

    /// Answers a packet that belongs to no connection with RST (unless it is one).
    fn refuse(&mut self, packet: &Header) {
        if packet.op == OP_RST {
            return;
        }
        self.send(
            Header {
                dst_cid: packet.src_cid,
                dst_port: packet.src_port,
                op: OP_RST,
                ..Header::default()
            },
            None,
        );
    }

    fn control(&mut self, op: u16) {
        let Some(conn) = &self.connection else { return };
        let header = Header {
            dst_cid: conn.peer_cid,
            dst_port: conn.peer_port,
            op,
            fwd_cnt: conn.fwd_cnt,
            ..Header::default()
        };
        self.send(header, None);
    }

    /// Echoes as much pending data as the peer's credit allows.
    fn flush(&mut self) {
        loop {
            let Some(conn) = &mut self.connection else {
                return;
            };
            if conn.pending == 0 {
                return;
            }
            let in_flight = conn.tx_cnt.wrapping_sub(conn.peer_fwd_cnt);
            let credit = conn.peer_buf_alloc.saturating_sub(in_flight);
            let count = conn.pending.min(credit).min(PAYLOAD as u32);
            if count == 0 {
                if !conn.credit_requested {
                    conn.credit_requested = true;
                    self.control(OP_CREDIT_REQUEST);
                }
                return;
            }
            let start = conn.pending_start;
            conn.pending_start = (conn.pending_start + count) % BUF_ALLOC;
            conn.pending -= count;
            conn.tx_cnt = conn.tx_cnt.wrapping_add(count);
            conn.fwd_cnt = conn.fwd_cnt.wrapping_add(count);
            conn.echoed += u64::from(count);
            let header = Header {
                dst_cid: conn.peer_cid,
                dst_port: conn.peer_port,
                op: OP_RW,
                fwd_cnt: conn.fwd_cnt,
                ..Header::default()
            };
            self.echoed += u64::from(count);
            self.send(header, Some((start, count)));
        }
    }

    /// Ends the connection: RST to the peer unless it reset it itself.
    fn close(&mut self, send_rst: bool, why: &str) {
        if send_rst {
            self.control(OP_RST);
        }
        if let Some(conn) = self.connection.take() {
            println!(
                "{}: connection {} {why}, echoed {} bytes",
                self.name, conn.number, conn.echoed
            );
            self.served += 1;
        }
    }

    fn handle(&mut self, packet: Header, payload: u64) {
        if packet.kind != TYPE_STREAM || packet.dst_cid != self.cid {
            println!(
                "{}: ignoring op {} type {} for cid {} from {}:{}",
                self.name, packet.op, packet.kind, packet.dst_cid, packet.src_cid, packet.src_port
            );
            self.refuse(&packet);
            return;
        }
        let ours = self.connection.as_ref().is_some_and(|conn| {
            conn.peer_cid == packet.src_cid
                && conn.peer_port == packet.src_port
                && packet.dst_port == PORT
        });
        if !ours {
            if packet.op == OP_REQUEST && packet.dst_port == PORT && self.connection.is_none() {
                self.served_request(&packet);
            } else {
                self.refuse(&packet);
            }
            return;
        }
        let Some(conn) = &mut self.connection else {
            return;
        };
        conn.peer_buf_alloc = packet.buf_alloc;
        conn.peer_fwd_cnt = packet.fwd_cnt;
        conn.credit_requested = false;
        match packet.op {
            OP_RW => {
                if conn.pending + packet.len > BUF_ALLOC {
                    let (number, pending, len) = (conn.number, conn.pending, packet.len);
                    self.control(OP_RST);
                    self.dev.fail(format_args!(
                        "connection {number}: peer sent {len} bytes with {pending} of {BUF_ALLOC} buffered (beyond its credit)"
                    ));
                }
                let end = (conn.pending_start + conn.pending) % BUF_ALLOC;
                let first = packet.len.min(BUF_ALLOC - end);
                copy_ram(self.ring + u64::from(end), payload, first);
                copy_ram(self.ring, payload + u64::from(first), packet.len - first);
                conn.pending += packet.len;
            }
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.control(OP_CREDIT_UPDATE),
            OP_SHUTDOWN => {
                if packet.flags & SHUTDOWN_RCV != 0 {
                    // The peer reads no more: what is not echoed yet is dropped.
                    conn.pending = 0;
                }
                conn.closing = true;
            }
            OP_RST => self.close(false, "reset by peer"),
            op => {
                let number = conn.number;
                self.control(OP_RST);
                self.dev
                    .fail(format_args!("connection {number}: unexpected op {op}"));
            }
        }
    }

    fn served_request(&mut self, packet: &Header) {
        let number = self.served + 1;
        println!(
            "{}: connection {number} from cid {} port {}",
            self.name, packet.src_cid, packet.src_port
        );
        self.connection = Some(Connection {
            number,
            peer_cid: packet.src_cid,
            peer_port: packet.src_port,
            peer_buf_alloc: packet.buf_alloc,
            peer_fwd_cnt: packet.fwd_cnt,
            tx_cnt: 0,
            fwd_cnt: 0,
            pending_start: 0,
            pending: 0,
            echoed: 0,
            credit_requested: false,
            closing: false,
        });
        self.control(OP_RESPONSE);
    }

    fn post_rx(&mut self, buffer: u64) {
        let size = (HEADER + PAYLOAD) as u32;
        if let Err(err) = self.rx.add(&[Buffer::writable(buffer, size)], buffer) {
            self.dev.fail(format_args!("rx queue: {err}"));
        }
    }
}

/// Copies `len` bytes of guest RAM from `src` to `dst` (both in the DMA area).
fn copy_ram(dst: u64, src: u64, len: u32) {
    core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
    // SAFETY: both ranges are buffers the driver allocated in the DMA area (identity mapped
    // RAM), `len` within both, and they do not overlap (rx/tx buffers vs. the echo ring).
    unsafe { core::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) };
    core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
}

/// COUNT: how many connections to serve (default 1); a bad one ends the run (EXIT_SETUP)
/// with `usage`.
pub fn connection_count(words: &mut Words, usage: &str) -> u32 {
    let Some(word) = words.next_word() else {
        return 1;
    };
    match parse_number(word) {
        Some(count) if (1..=u64::from(u32::MAX)).contains(&count) => count as u32,
        _ => {
            println!("testguest: bad COUNT '{word}'; usage: {usage}");
            exit(super::EXIT_SETUP)
        }
    }
}

impl<'a> Server<'a> {
    /// Sets up the queues (rx, tx, event) of `dev` (initialized, not yet live), sets
    /// DRIVER_OK, reads the guest CID and posts the rx and event buffers; `name` prefixes
    /// the server's lines.
    pub fn start(name: &'static str, dev: &'a VirtioPci, dma: &mut Dma) -> Server<'a> {
        let rx = dev.setup_queue(dma, 0, None);
        let tx = dev.setup_queue(dma, 1, None);
        let events = dev.setup_queue(dma, 2, None);
        for queue in [&rx, &tx, &events] {
            queue.suppress_interrupts(true);
        }
        dev.driver_ok();
        let cid = dev.read_config(|dev| dev.config64(0));
        let mut server = Server {
            name,
            dev,
            cid,
            rx,
            tx,
            events,
            tx_buffer: dma.alloc((HEADER + PAYLOAD) as u64, 64),
            ring: dma.alloc(u64::from(BUF_ALLOC), 4096),
            connection: None,
            served: 0,
            echoed: 0,
        };
        let rx_count = RX_BUFFERS.min(server.rx.size as usize);
        for _ in 0..rx_count {
            let buffer = dma.alloc((HEADER + PAYLOAD) as u64, 64);
            server.post_rx(buffer);
        }
        server.rx.notify();
        for _ in 0..EVENT_BUFFERS.min(server.events.size as usize) {
            let buffer = dma.alloc(u64::from(EVENT_SIZE), 8);
            if let Err(err) = server
                .events
                .add(&[Buffer::writable(buffer, EVENT_SIZE)], buffer)
            {
                dev.fail(format_args!("event queue: {err}"));
            }
        }
        server.events.notify();
        server
    }

    /// Takes one event off the event queue (if any) and gives its buffer back. With
    /// `transport_reset`, a TRANSPORT_RESET drops the connection being served (it does
    /// not count as served), re-reads the guest CID and prints `<name>: transport reset`;
    /// any other event (all of them without `transport_reset`) is printed as its id.
    /// Returns whether there was one.
    fn poll_event(&mut self, transport_reset: bool) -> bool {
        let dev = self.dev;
        let used = match self.events.pop_used() {
            Ok(Some(used)) => used,
            Ok(None) => return false,
            Err(err) => dev.fail(format_args!("event queue: {err}")),
        };
        let mut id = [0u8; 4];
        read_ram(used.token, &mut id);
        let id = u32::from_le_bytes(id);
        if transport_reset && id == EVENT_TRANSPORT_RESET {
            let dropped = self.connection.take();
            self.cid = dev.read_config(|dev| dev.config64(0));
            println!("{}: transport reset cid={}", self.name, self.cid);
            if let Some(conn) = dropped {
                println!(
                    "{}: connection {} dropped by the reset, echoed {} bytes",
                    self.name, conn.number, conn.echoed
                );
            }
        } else {
            println!("{}: event id {id}", self.name);
        }
        let _ = self
            .events
            .add(&[Buffer::writable(used.token, EVENT_SIZE)], used.token);
        self.events.notify();
        true
    }

    /// Serves connections on [`PORT`] one after another until `wanted` have ended, and
    /// calls `after_connection(k)` once connection `k` has ended (the peer sees the RST
    /// first). `transport_reset`: see [`Server::poll_event`].
    pub fn serve(
        &mut self,
        wanted: u32,
        transport_reset: bool,
        mut after_connection: impl FnMut(u32),
    ) {
        let dev = self.dev;
        let mut reported = 0;
        let mut idle = Deadline::after_ms(PEER_TIMEOUT_MS);
        while self.served < wanted {
            if self.poll_event(transport_reset) && transport_reset {
                idle = Deadline::after_ms(PEER_TIMEOUT_MS);
            }
            let used = match self.rx.pop_used() {
                Ok(Some(used)) => used,
                Ok(None) => {
                    if idle.expired() {
                        dev.fail(format_args!(
                            "no packet within {PEER_TIMEOUT_MS} ms ({} of {wanted} connections served)",
                            self.served
                        ));
                    }
                    crate::arch::pause();
                    continue;
                }
                Err(err) => dev.fail(format_args!("rx queue: {err}")),
            };
            idle = Deadline::after_ms(PEER_TIMEOUT_MS);
            let buffer = used.token;
            let mut bytes = [0u8; HEADER];
            read_ram(buffer, &mut bytes);
            let packet = Header::parse(&bytes);
            if (used.len as usize) < HEADER
                || packet.len as usize > PAYLOAD
                || (used.len as usize) < HEADER + packet.len as usize
            {
                dev.fail(format_args!(
                    "rx packet op {} of {} bytes claims {} payload bytes",
                    packet.op, used.len, packet.len
                ));
            }
            self.handle(packet, buffer + HEADER as u64);
            self.post_rx(buffer);
            self.rx.notify();
            self.flush();
            let finished = self
                .connection
                .as_ref()
                .is_some_and(|conn| conn.closing && conn.pending == 0);
            if finished {
                self.close(true, "shut down by peer");
            }
            while reported < self.served {
                reported += 1;
                after_connection(reported);
                idle = Deadline::after_ms(PEER_TIMEOUT_MS);
            }
        }
    }
}

pub fn run(dma: &mut Dma, words: &mut Words) -> ! {
    let wanted = connection_count(words, USAGE);
    let mut dev = VirtioPci::find(NAME, TYPE_VSOCK);
    dev.initialize(0);
    let mut server = Server::start(NAME, &dev, dma);
    let cid = server.cid;
    println!("{NAME}: listening cid={cid} port={PORT} connections={wanted}");
    server.serve(wanted, false, |_| {});
    println!("{NAME}: ok cid={cid} echoed={}", server.echoed);
    exit(0)
}
