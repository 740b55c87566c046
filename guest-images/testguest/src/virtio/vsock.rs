//! `virtio-vsock [COUNT]`: the socket device (type 19) as an echo server on port 1024. It
//! accepts COUNT connections (default 1) one after another, echoes every byte it receives
//! (respecting the peer's credit), and ends a connection with RST once the peer shut it
//! down (or reset it).
//!
//! `virtio-vsock-connect PORT COUNT BYTES [ACCEPT]`: the guest-initiated direction (see
//! [`connect`]); the host listens on `<uds>_PORT`.

use super::queue::{Buffer, SplitQueue, Used};
use super::transport::{VirtioPci, TYPE_VSOCK};
use super::{read_ram, write_ram, Deadline, Dma, PEER_TIMEOUT_MS};
use crate::args::{parse_number, Words};
use crate::console::exit;
use crate::println;

const NAME: &str = "virtio-vsock";
const USAGE: &str = "virtio-vsock [COUNT]";
pub(crate) const PORT: u32 = 1024;
pub(crate) const HEADER: usize = 44;
/// Payload bytes per rx buffer and per packet sent.
const PAYLOAD: usize = 4096;
const RX_BUFFERS: usize = 16;
const EVENT_BUFFERS: usize = 4;
pub(crate) const EVENT_SIZE: u32 = 4;
/// What the driver tells the peer it may have in flight, and the echo buffer's size.
const BUF_ALLOC: u32 = 64 << 10;
pub(crate) const TYPE_STREAM: u16 = 1;
pub(crate) const OP_REQUEST: u16 = 1;
pub(crate) const OP_RESPONSE: u16 = 2;
pub(crate) const OP_RST: u16 = 3;
pub(crate) const OP_SHUTDOWN: u16 = 4;
pub(crate) const OP_RW: u16 = 5;
pub(crate) const OP_CREDIT_UPDATE: u16 = 6;
pub(crate) const OP_CREDIT_REQUEST: u16 = 7;
const SHUTDOWN_RCV: u32 = 1;
/// VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: the device lost every connection (after a restore).
pub(crate) const EVENT_TRANSPORT_RESET: u32 = 0;

/// struct virtio_vsock_hdr (little endian, packed).
#[derive(Clone, Copy, Default)]
pub(crate) struct Header {
    pub(crate) src_cid: u64,
    pub(crate) dst_cid: u64,
    pub(crate) src_port: u32,
    pub(crate) dst_port: u32,
    pub(crate) len: u32,
    pub(crate) kind: u16,
    pub(crate) op: u16,
    pub(crate) flags: u32,
    pub(crate) buf_alloc: u32,
    pub(crate) fwd_cnt: u32,
}

impl Header {
    pub(crate) fn parse(bytes: &[u8; HEADER]) -> Header {
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

    pub(crate) fn bytes(&self) -> [u8; HEADER] {
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
        self.submit_tx(header.op, len);
    }

    /// Puts the packet in the tx buffer (header and `payload` bytes) on the tx queue and
    /// waits until the device took it.
    fn submit_tx(&mut self, op: u16, payload: u32) {
        if let Err(err) = self.tx.add(
            &[Buffer::readable(self.tx_buffer, HEADER as u32 + payload)],
            0,
        ) {
            self.dev.fail(format_args!("tx queue: {err}"));
        }
        self.tx.notify();
        if let Err(err) = self.tx.wait_used() {
            self.dev.fail(format_args!("tx queue (op {op}): {err}"));
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

/// The socket device's queues (rx, tx, event) set up on `dev` (initialized, not yet
/// live), polled rather than interrupting, then DRIVER_OK; and the guest CID.
pub(crate) fn live_queues(
    dev: &VirtioPci,
    dma: &mut Dma,
) -> (SplitQueue, SplitQueue, SplitQueue, u64) {
    let rx = dev.setup_queue(dma, 0, None);
    let tx = dev.setup_queue(dma, 1, None);
    let events = dev.setup_queue(dma, 2, None);
    for queue in [&rx, &tx, &events] {
        queue.suppress_interrupts(true);
    }
    dev.driver_ok();
    let cid = dev.read_config(|dev| dev.config64(0));
    (rx, tx, events, cid)
}

/// The header of the packet the device put in `used`'s buffer, checked against what the
/// buffer holds (at most `max_payload` bytes after the header); a lie ends the run.
pub(crate) fn received_header(dev: &VirtioPci, used: &Used, max_payload: usize) -> Header {
    let mut bytes = [0u8; HEADER];
    read_ram(used.token, &mut bytes);
    let packet = Header::parse(&bytes);
    if (used.len as usize) < HEADER
        || packet.len as usize > max_payload
        || (used.len as usize) < HEADER + packet.len as usize
    {
        dev.fail(format_args!(
            "rx packet op {} of {} bytes claims {} payload bytes",
            packet.op, used.len, packet.len
        ));
    }
    packet
}

/// Gives the device buffers for its events (a TRANSPORT_RESET after a restore).
pub(crate) fn post_event_buffers(dev: &VirtioPci, events: &mut SplitQueue, dma: &mut Dma) {
    for _ in 0..EVENT_BUFFERS.min(events.size as usize) {
        let buffer = dma.alloc(u64::from(EVENT_SIZE), 8);
        if let Err(err) = events.add(&[Buffer::writable(buffer, EVENT_SIZE)], buffer) {
            dev.fail(format_args!("event queue: {err}"));
        }
    }
    events.notify();
}

impl<'a> Server<'a> {
    /// Sets up the queues (rx, tx, event) of `dev` (initialized, not yet live), sets
    /// DRIVER_OK, reads the guest CID and posts the rx and event buffers; `name` prefixes
    /// the server's lines.
    pub fn start(name: &'static str, dev: &'a VirtioPci, dma: &mut Dma) -> Server<'a> {
        let (rx, tx, events, cid) = live_queues(dev, dma);
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
        post_event_buffers(dev, &mut server.events, dma);
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
            let packet = received_header(dev, &used, PAYLOAD);
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

// virtio-vsock-connect: guest-initiated connections (the host listens on `<uds>_PORT`).

const CONNECT_NAME: &str = "virtio-vsock-connect";
/// What the host-initiated connections' lines (the echo server on port 1024) start with.
const ACCEPT_NAME: &str = "virtio-vsock-connect/accept";
const CONNECT_USAGE: &str = "virtio-vsock-connect PORT COUNT BYTES [ACCEPT]";
/// VMADDR_CID_HOST: where guest-initiated connections go.
const HOST_CID: u64 = 2;
/// The guest's local port for connection k is FIRST_LOCAL_PORT + k.
const FIRST_LOCAL_PORT: u32 = 50_000;
/// The most connections the workload opens at once.
const MAX_STREAMS: usize = 16;
/// Connection k sends the bytes of `pattern(CONNECT_SEED + k, offset)` (little-endian
/// words); the host test computes the same bytes.
const CONNECT_SEED: u64 = 0x7653_4f43_0000;
const SHUTDOWN_SEND: u32 = 2;

/// The byte at `offset` of connection `number`'s stream.
fn stream_byte(number: u32, offset: u32) -> u8 {
    let word = crate::pattern::pattern(CONNECT_SEED + u64::from(number), u64::from(offset & !7));
    (word >> (8 * (offset & 7))) as u8
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum StreamState {
    /// REQUEST sent, waiting for RESPONSE (or RST: refused).
    Requesting,
    Open,
    /// Everything sent and echoed back: SHUTDOWN sent, waiting for the RST.
    ShuttingDown,
    /// Over; how it ended.
    Done(Outcome),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Complete,
    Refused,
    /// The host reset (RST) or shut down (SHUTDOWN) the connection before the echo was whole.
    ResetByHost,
    ShutByHost,
}

/// One guest-initiated connection.
#[derive(Clone, Copy)]
struct Stream {
    number: u32,
    local_port: u32,
    state: StreamState,
    /// The device's receive buffer and how much of our data it consumed.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Pattern bytes sent (also our tx_cnt).
    sent: u32,
    /// Echoed bytes received and verified (also our fwd_cnt: they are consumed at once).
    verified: u32,
    /// The fwd_cnt the device last heard from us.
    fwd_cnt_told: u32,
    credit_requested: bool,
    /// Whether the device's credit ran out at least once.
    waited_for_credit: bool,
}

impl Stream {
    fn credit(&self) -> u32 {
        let in_flight = self.sent.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }
}

struct Client<'a> {
    io: Server<'a>,
    port: u32,
    bytes: u32,
    streams: [Stream; MAX_STREAMS],
    count: usize,
    /// Round-robin start for the next data packet, so connections interleave.
    next_turn: usize,
}

impl Client<'_> {
    fn send(&mut self, index: usize, op: u16, flags: u32, payload: u32) {
        let io = &mut self.io;
        let stream = &mut self.streams[index];
        let header = Header {
            src_cid: io.cid,
            dst_cid: HOST_CID,
            src_port: stream.local_port,
            dst_port: self.port,
            len: payload,
            kind: TYPE_STREAM,
            op,
            flags,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: stream.verified,
        };
        stream.fwd_cnt_told = stream.verified;
        if payload > 0 {
            let mut chunk = [0u8; PAYLOAD];
            for (at, byte) in chunk.iter_mut().take(payload as usize).enumerate() {
                *byte = stream_byte(stream.number, stream.sent.wrapping_add(at as u32));
            }
            write_ram(io.tx_buffer + HEADER as u64, &chunk[..payload as usize]);
            stream.sent += payload;
        }
        write_ram(io.tx_buffer, &header.bytes());
        io.submit_tx(op, payload);
    }

    fn finish(&mut self, index: usize, outcome: Outcome) {
        let stream = &mut self.streams[index];
        stream.state = StreamState::Done(outcome);
        let (number, local, port) = (stream.number, stream.local_port, self.port);
        let (sent, echoed) = (stream.sent, stream.verified);
        match outcome {
            Outcome::Complete => println!(
                "{CONNECT_NAME}: connection {number} port {local}->{port} done sent={sent} echoed={echoed}"
            ),
            Outcome::Refused => {
                println!("{CONNECT_NAME}: connection {number} to port {port} refused (RST)")
            }
            Outcome::ResetByHost => println!(
                "{CONNECT_NAME}: connection {number} reset by host sent={sent} echoed={echoed}"
            ),
            Outcome::ShutByHost => println!(
                "{CONNECT_NAME}: connection {number} shut down by host sent={sent} echoed={echoed}"
            ),
        }
    }

    /// A packet for one of our local ports.
    fn handle(&mut self, packet: Header, payload: u64) {
        let index = self.streams[..self.count].iter().position(|stream| {
            stream.local_port == packet.dst_port
                && packet.src_cid == HOST_CID
                && packet.src_port == self.port
                && !matches!(stream.state, StreamState::Done(_))
        });
        let Some(index) = index else {
            // A late packet for a connection that is over (or a stranger): RST unless it is one.
            if packet.op != OP_RST {
                let reply = Header {
                    src_cid: self.io.cid,
                    dst_cid: packet.src_cid,
                    src_port: packet.dst_port,
                    dst_port: packet.src_port,
                    kind: TYPE_STREAM,
                    op: OP_RST,
                    ..Header::default()
                };
                write_ram(self.io.tx_buffer, &reply.bytes());
                self.io.submit_tx(OP_RST, 0);
            }
            return;
        };
        let bytes = self.bytes;
        let stream = &mut self.streams[index];
        stream.peer_buf_alloc = packet.buf_alloc;
        stream.peer_fwd_cnt = packet.fwd_cnt;
        stream.credit_requested = false;
        let number = stream.number;
        match (stream.state, packet.op) {
            (StreamState::Requesting, OP_RESPONSE) => {
                stream.state = StreamState::Open;
                println!(
                    "{CONNECT_NAME}: connection {number} port {}->{} open buf_alloc={}",
                    stream.local_port, self.port, packet.buf_alloc
                );
            }
            (StreamState::Requesting, OP_RST) => self.finish(index, Outcome::Refused),
            (StreamState::Open, OP_RW) => {
                let unacknowledged = stream.verified.wrapping_sub(stream.fwd_cnt_told);
                if unacknowledged + packet.len > BUF_ALLOC {
                    self.io.dev.fail(format_args!(
                        "connection {number}: device sent {} bytes with {unacknowledged} of our {BUF_ALLOC} credit used",
                        packet.len
                    ));
                }
                if stream.verified + packet.len > stream.sent.min(bytes) {
                    self.io.dev.fail(format_args!(
                        "connection {number}: {} bytes echoed beyond the {} sent",
                        stream.verified + packet.len,
                        stream.sent
                    ));
                }
                let mut data = [0u8; PAYLOAD];
                let data = &mut data[..packet.len as usize];
                read_ram(payload, data);
                for (at, byte) in data.iter().enumerate() {
                    let offset = stream.verified + at as u32;
                    let expected = stream_byte(number, offset);
                    if *byte != expected {
                        self.io.dev.fail(format_args!(
                            "connection {number}: echo byte {offset} is {byte:#04x}, sent {expected:#04x}"
                        ));
                    }
                }
                stream.verified += packet.len;
            }
            (StreamState::Open | StreamState::ShuttingDown, OP_CREDIT_UPDATE) => {}
            (StreamState::Open | StreamState::ShuttingDown, OP_CREDIT_REQUEST) => {
                self.send(index, OP_CREDIT_UPDATE, 0, 0)
            }
            (StreamState::Open, OP_SHUTDOWN) => {
                // The host ended it before the echo was whole: answer with RST.
                self.send(index, OP_RST, 0, 0);
                self.finish(index, Outcome::ShutByHost);
            }
            (StreamState::Open, OP_RST) => self.finish(index, Outcome::ResetByHost),
            (StreamState::ShuttingDown, OP_RST) => self.finish(index, Outcome::Complete),
            (StreamState::ShuttingDown, OP_SHUTDOWN) => {
                self.send(index, OP_RST, 0, 0);
                self.finish(index, Outcome::Complete);
            }
            (_, op) => {
                self.send(index, OP_RST, 0, 0);
                self.io
                    .dev
                    .fail(format_args!("connection {number}: unexpected op {op}"));
            }
        }
    }

    /// Sends what each open connection may send now: one data packet per connection per
    /// round (so they interleave), credit updates, credit requests, and SHUTDOWN once the
    /// whole echo is back.
    fn pump(&mut self) {
        for turn in 0..self.count {
            let index = (self.next_turn + turn) % self.count;
            let stream = self.streams[index];
            if stream.state != StreamState::Open {
                continue;
            }
            if stream.verified == self.bytes {
                self.send(index, OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND, 0);
                self.streams[index].state = StreamState::ShuttingDown;
                continue;
            }
            let remaining = self.bytes - stream.sent;
            let count = remaining.min(stream.credit()).min(PAYLOAD as u32);
            if count > 0 {
                self.send(index, OP_RW, 0, count);
            } else if remaining > 0 && !stream.credit_requested {
                if !stream.waited_for_credit {
                    // Once per connection: the test holds the host's reads to see this.
                    println!(
                        "{CONNECT_NAME}: connection {} waits for credit sent={} in_flight={} buf_alloc={}",
                        stream.number,
                        stream.sent,
                        stream.sent.wrapping_sub(stream.peer_fwd_cnt),
                        stream.peer_buf_alloc
                    );
                }
                self.streams[index].waited_for_credit = true;
                self.streams[index].credit_requested = true;
                self.send(index, OP_CREDIT_REQUEST, 0, 0);
            } else if stream.verified.wrapping_sub(stream.fwd_cnt_told) >= BUF_ALLOC / 2 {
                // We consumed half our window since the device last heard: tell it.
                self.send(index, OP_CREDIT_UPDATE, 0, 0);
            }
        }
        self.next_turn = (self.next_turn + 1) % self.count.max(1);
    }

    fn all_done(&self) -> bool {
        self.streams[..self.count]
            .iter()
            .all(|stream| matches!(stream.state, StreamState::Done(_)))
    }

    fn states(&self) -> (u32, u32, u32) {
        let mut counts = (0, 0, 0);
        for stream in &self.streams[..self.count] {
            match stream.state {
                StreamState::Done(Outcome::Complete) => counts.0 += 1,
                StreamState::Done(Outcome::Refused) => counts.1 += 1,
                StreamState::Done(_) => counts.2 += 1,
                _ => {}
            }
        }
        counts
    }
}

fn connect_argument(
    words: &mut Words,
    what: &str,
    parse: fn(&str) -> Option<u64>,
    range: core::ops::RangeInclusive<u64>,
) -> u64 {
    let word = words.next_word();
    match word.and_then(parse) {
        Some(value) if range.contains(&value) => value,
        _ => {
            println!(
                "testguest: bad {what} '{}' (from {} to {}); usage: {CONNECT_USAGE}",
                word.unwrap_or(""),
                range.start(),
                range.end()
            );
            exit(super::EXIT_SETUP)
        }
    }
}

/// `virtio-vsock-connect PORT COUNT BYTES [ACCEPT]`: opens COUNT connections to host CID 2
/// port PORT at once (from local ports 50001..), sends BYTES of a pattern on each within
/// the device's credit, verifies the echo byte for byte, and shuts each down (SHUTDOWN,
/// then the device's RST). Meanwhile it echoes ACCEPT host-initiated connections to port
/// 1024 (one at a time, as `virtio-vsock` does). A refused connection (RST), one the host
/// ends early, or ACCEPT connections not served end the run with EXIT_FAIL.
pub fn connect(dma: &mut Dma, words: &mut Words) -> ! {
    let port = connect_argument(words, "PORT", parse_number, 0..=u64::from(u32::MAX)) as u32;
    let count = connect_argument(words, "COUNT", parse_number, 1..=MAX_STREAMS as u64) as usize;
    let bytes = connect_argument(words, "BYTES", crate::args::parse_size, 1..=(1 << 30)) as u32;
    let accept = match words.next_word() {
        None => 0,
        Some(word) => match parse_number(word) {
            Some(accept) if accept <= 1024 => accept as u32,
            _ => {
                println!("testguest: bad ACCEPT '{word}'; usage: {CONNECT_USAGE}");
                exit(super::EXIT_SETUP)
            }
        },
    };
    let mut dev = VirtioPci::find(CONNECT_NAME, TYPE_VSOCK);
    dev.initialize(0);
    let io = Server::start(ACCEPT_NAME, &dev, dma);
    let cid = io.cid;
    println!(
        "{CONNECT_NAME}: cid={cid} port={port} connections={count} bytes={bytes} accept={accept}"
    );
    let mut client = Client {
        io,
        port,
        bytes,
        streams: [Stream {
            number: 0,
            local_port: 0,
            state: StreamState::Requesting,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            sent: 0,
            verified: 0,
            fwd_cnt_told: 0,
            credit_requested: false,
            waited_for_credit: false,
        }; MAX_STREAMS],
        count,
        next_turn: 0,
    };
    // Every REQUEST goes out before any answer is read: the connections are open together.
    for index in 0..count {
        let number = index as u32 + 1;
        client.streams[index].number = number;
        client.streams[index].local_port = FIRST_LOCAL_PORT + number;
        client.send(index, OP_REQUEST, 0, 0);
    }
    let mut idle = Deadline::after_ms(PEER_TIMEOUT_MS);
    while !client.all_done() || client.io.served < accept {
        client.io.poll_event(false);
        let used = match client.io.rx.pop_used() {
            Ok(Some(used)) => Some(used),
            Ok(None) => None,
            Err(err) => dev.fail(format_args!("rx queue: {err}")),
        };
        if let Some(used) = used {
            idle = Deadline::after_ms(PEER_TIMEOUT_MS);
            let buffer = used.token;
            let packet = received_header(&dev, &used, PAYLOAD);
            if packet.kind == TYPE_STREAM && packet.dst_cid == cid && packet.dst_port == PORT {
                // A host-initiated connection: the echo server's.
                client.io.handle(packet, buffer + HEADER as u64);
            } else if packet.kind == TYPE_STREAM && packet.dst_cid == cid {
                client.handle(packet, buffer + HEADER as u64);
            } else {
                client.io.handle(packet, buffer + HEADER as u64);
            }
            client.io.post_rx(buffer);
            client.io.rx.notify();
        } else if idle.expired() {
            let (complete, refused, ended) = client.states();
            dev.fail(format_args!(
                "no packet within {PEER_TIMEOUT_MS} ms (connections complete={complete} refused={refused} ended={ended} of {count}, accepted {} of {accept})",
                client.io.served
            ));
        }
        client.io.flush();
        let finished = client
            .io
            .connection
            .as_ref()
            .is_some_and(|conn| conn.closing && conn.pending == 0);
        if finished {
            client.io.close(true, "shut down by peer");
        }
        client.pump();
        if used.is_none() {
            crate::arch::pause();
        }
    }
    let (complete, refused, ended) = client.states();
    if client.io.served > 0 {
        println!(
            "{CONNECT_NAME}: accepted connections={} echoed={}",
            client.io.served, client.io.echoed
        );
    }
    if complete as usize == count {
        let total = u64::from(bytes) * count as u64;
        println!("{CONNECT_NAME}: connect ok connections={count} bytes={total}");
        exit(0)
    }
    println!(
        "{CONNECT_NAME}: connect failed complete={complete} refused={refused} ended-by-host={ended} of {count}"
    );
    exit(super::EXIT_FAIL)
}
