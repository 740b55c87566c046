//! `virtio-net IP`: the network device (type 1) with a fixed IPv4 address. It announces itself
//! (gratuitous ARP, a broadcast UDP datagram from port 7 to port 9), answers ARP requests and
//! ICMP echo requests for IP, and echoes the first UDP datagram sent to IP (or broadcast)
//! port 7 back to its sender; then it is done.
//!
//! Also here: `virtio-net-mq` (several queue pairs: VIRTIO_NET_F_MQ, the control queue's
//! VQ_PAIRS_SET, UDP echo requests from every TX queue; see [`run_mq`]) and `virtio-net-bench`
//! (UDP throughput each way for bench/virtio; see [`run_bench`]).

use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, TYPE_NET};
use super::{read_ram, write_ram, Deadline, Dma, PEER_TIMEOUT_MS};
use crate::args::Words;
use crate::console::exit;
use crate::println;
use core::fmt;

const NAME: &str = "virtio-net";
const USAGE: &str = "virtio-net IP";
const F_MAC: u64 = 1 << 5;
/// struct virtio_net_hdr_v1 (num_buffers included with VERSION_1), all zero on transmit.
pub(crate) const NET_HEADER: usize = 12;
/// Each rx buffer: the header and a whole untagged frame without FCS (1514), rounded up.
const RX_BUFFER: usize = 2048;
const RX_BUFFERS: usize = 16;
const MAX_FRAME: usize = RX_BUFFER - NET_HEADER;
pub(crate) const MIN_FRAME: usize = 60;
const ETHERTYPE_ARP: u16 = 0x0806;
const ETHERTYPE_IPV4: u16 = 0x0800;
const PROTOCOL_ICMP: u8 = 1;
const PROTOCOL_UDP: u8 = 17;
const ECHO_PORT: u16 = 7;
const DISCARD_PORT: u16 = 9;
const BROADCAST_MAC: Mac = Mac([0xff; 6]);
const BROADCAST_IP: Ip = Ip([0xff; 4]);
/// Used when the device does not offer VIRTIO_NET_F_MAC (locally administered).
const FALLBACK_MAC: Mac = Mac([0x02, 0x00, 0x00, 0x00, 0x00, 0x01]);

#[derive(Clone, Copy, PartialEq, Eq)]
struct Mac([u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Ip([u8; 4]);

impl fmt::Display for Ip {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let a = self.0;
        write!(f, "{}.{}.{}.{}", a[0], a[1], a[2], a[3])
    }
}

fn parse_ip(text: &str) -> Option<Ip> {
    let mut ip = [0u8; 4];
    let mut parts = text.split('.');
    for byte in ip.iter_mut() {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *byte = part.parse().ok()?;
    }
    parts.next().is_none().then_some(Ip(ip))
}

/// The internet checksum (RFC 1071) of `bytes`, starting from `sum`.
fn checksum(mut sum: u32, bytes: &[u8]) -> u16 {
    let mut chunks = bytes.chunks_exact(2);
    for pair in &mut chunks {
        sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn be16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

fn ip_at(bytes: &[u8], at: usize) -> Ip {
    Ip([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn mac_at(bytes: &[u8], at: usize) -> Mac {
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&bytes[at..at + 6]);
    Mac(mac)
}

/// A frame being built: Ethernet header first.
struct Frame {
    bytes: [u8; MAX_FRAME],
    len: usize,
}

impl Frame {
    fn new(dst: Mac, src: Mac, ethertype: u16) -> Frame {
        let mut frame = Frame {
            bytes: [0; MAX_FRAME],
            len: 14,
        };
        frame.bytes[0..6].copy_from_slice(&dst.0);
        frame.bytes[6..12].copy_from_slice(&src.0);
        frame.bytes[12..14].copy_from_slice(&ethertype.to_be_bytes());
        frame
    }

    fn push(&mut self, bytes: &[u8]) {
        self.bytes[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// IPv4 header (no options, TTL 64, don't fragment off) followed by `payload`.
    fn ipv4(&mut self, protocol: u8, src: Ip, dst: Ip, payload: &[u8]) {
        let start = self.len;
        let total = (20 + payload.len()) as u16;
        self.push(&[0x45, 0]);
        self.push(&total.to_be_bytes());
        self.push(&[0, 0, 0, 0, 64, protocol, 0, 0]);
        self.push(&src.0);
        self.push(&dst.0);
        let sum = checksum(0, &self.bytes[start..start + 20]);
        self.bytes[start + 10..start + 12].copy_from_slice(&sum.to_be_bytes());
        self.push(payload);
    }
}

/// UDP datagram with its checksum over the IPv4 pseudo-header.
fn udp(src: Ip, src_port: u16, dst: Ip, dst_port: u16, data: &[u8], out: &mut [u8]) -> usize {
    let len = 8 + data.len();
    out[0..2].copy_from_slice(&src_port.to_be_bytes());
    out[2..4].copy_from_slice(&dst_port.to_be_bytes());
    out[4..6].copy_from_slice(&(len as u16).to_be_bytes());
    out[6..8].copy_from_slice(&[0, 0]);
    out[8..len].copy_from_slice(data);
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&src.0);
    pseudo[4..8].copy_from_slice(&dst.0);
    pseudo[9] = PROTOCOL_UDP;
    pseudo[10..12].copy_from_slice(&(len as u16).to_be_bytes());
    let partial = pseudo
        .chunks_exact(2)
        .map(|pair| u32::from(u16::from_be_bytes([pair[0], pair[1]])))
        .sum();
    let sum = match checksum(partial, &out[..len]) {
        // 0 means "no checksum" in UDP; the all-ones form says the same sum.
        0 => 0xffff,
        sum => sum,
    };
    out[6..8].copy_from_slice(&sum.to_be_bytes());
    len
}

struct Nic<'a> {
    dev: &'a VirtioPci,
    mac: Mac,
    ip: Ip,
    rx: SplitQueue,
    tx: SplitQueue,
    tx_buffer: u64,
    received: u64,
    sent: u64,
}

impl Nic<'_> {
    fn send(&mut self, frame: &mut Frame) {
        if frame.len < MIN_FRAME {
            frame.bytes[frame.len..MIN_FRAME].fill(0);
            frame.len = MIN_FRAME;
        }
        write_ram(self.tx_buffer, &[0u8; NET_HEADER]);
        write_ram(
            self.tx_buffer + NET_HEADER as u64,
            &frame.bytes[..frame.len],
        );
        let len = (NET_HEADER + frame.len) as u32;
        if let Err(err) = self.tx.add(&[Buffer::readable(self.tx_buffer, len)], 0) {
            self.dev.fail(format_args!("tx queue: {err}"));
        }
        self.tx.notify();
        if let Err(err) = self.tx.wait_used() {
            self.dev.fail(format_args!("tx queue: {err}"));
        }
        self.sent += 1;
    }

    /// ARP packet (Ethernet/IPv4) with `operation` 1 (request) or 2 (reply).
    fn arp(&mut self, dst: Mac, operation: u16, target_mac: Mac, target_ip: Ip) {
        let mut frame = Frame::new(dst, self.mac, ETHERTYPE_ARP);
        frame.push(&[0, 1, 0x08, 0x00, 6, 4]);
        frame.push(&operation.to_be_bytes());
        frame.push(&self.mac.0);
        frame.push(&self.ip.0);
        frame.push(&target_mac.0);
        frame.push(&target_ip.0);
        self.send(&mut frame);
    }

    fn announce(&mut self) {
        self.arp(BROADCAST_MAC, 1, Mac([0; 6]), self.ip);
        let mut text = [0u8; 64];
        let mut writer = Cursor {
            bytes: &mut text,
            len: 0,
        };
        let _ = fmt::write(
            &mut writer,
            format_args!("gpuvm testguest {} {}", self.mac, self.ip),
        );
        let len = writer.len;
        let mut datagram = [0u8; 128];
        let size = udp(
            self.ip,
            ECHO_PORT,
            BROADCAST_IP,
            DISCARD_PORT,
            &text[..len],
            &mut datagram,
        );
        let mut frame = Frame::new(BROADCAST_MAC, self.mac, ETHERTYPE_IPV4);
        frame.ipv4(PROTOCOL_UDP, self.ip, BROADCAST_IP, &datagram[..size]);
        self.send(&mut frame);
        println!(
            "{NAME}: sent gratuitous arp and udp {}:{ECHO_PORT} -> {BROADCAST_IP}:{DISCARD_PORT}",
            self.ip
        );
    }

    /// Handles one received frame; returns true once a UDP datagram was echoed.
    fn handle(&mut self, frame: &[u8]) -> bool {
        if frame.len() < 14 {
            return false;
        }
        let dst = mac_at(frame, 0);
        if dst != self.mac && dst != BROADCAST_MAC {
            return false;
        }
        let src = mac_at(frame, 6);
        let payload = &frame[14..];
        match be16(frame, 12) {
            ETHERTYPE_ARP => self.handle_arp(payload),
            ETHERTYPE_IPV4 => return self.handle_ipv4(src, payload),
            _ => {}
        }
        false
    }

    fn handle_arp(&mut self, arp: &[u8]) {
        if arp.len() < 28 || arp[0..6] != [0, 1, 0x08, 0x00, 6, 4] || be16(arp, 6) != 1 {
            return;
        }
        let (sender_mac, sender_ip, target_ip) = (mac_at(arp, 8), ip_at(arp, 14), ip_at(arp, 24));
        if target_ip != self.ip {
            return;
        }
        self.arp(sender_mac, 2, sender_mac, sender_ip);
        println!("{NAME}: arp reply to {sender_ip} ({sender_mac})");
    }

    fn handle_ipv4(&mut self, src_mac: Mac, packet: &[u8]) -> bool {
        if packet.len() < 20 || packet[0] >> 4 != 4 {
            return false;
        }
        let header_len = usize::from(packet[0] & 0xf) * 4;
        let total = usize::from(be16(packet, 2));
        let fragmented = be16(packet, 6) & 0x3fff != 0;
        if header_len < 20 || total < header_len || total > packet.len() || fragmented {
            return false;
        }
        let (src, dst) = (ip_at(packet, 12), ip_at(packet, 16));
        if dst != self.ip && dst != BROADCAST_IP {
            return false;
        }
        let body = &packet[header_len..total];
        match packet[9] {
            PROTOCOL_ICMP if dst == self.ip && body.len() >= 8 && body[0] == 8 => {
                let mut reply = [0u8; MAX_FRAME];
                let reply = &mut reply[..body.len()];
                reply.copy_from_slice(body);
                reply[0] = 0;
                reply[2..4].copy_from_slice(&[0, 0]);
                let sum = checksum(0, reply);
                reply[2..4].copy_from_slice(&sum.to_be_bytes());
                let mut frame = Frame::new(src_mac, self.mac, ETHERTYPE_IPV4);
                frame.ipv4(PROTOCOL_ICMP, self.ip, src, reply);
                self.send(&mut frame);
                println!("{NAME}: icmp echo reply to {src} seq {}", be16(body, 6));
                false
            }
            PROTOCOL_UDP if body.len() >= 8 && be16(body, 2) == ECHO_PORT => {
                let udp_len = usize::from(be16(body, 4));
                if udp_len < 8 || udp_len > body.len() {
                    return false;
                }
                let src_port = be16(body, 0);
                let data = &body[8..udp_len];
                let mut datagram = [0u8; MAX_FRAME];
                let size = udp(self.ip, ECHO_PORT, src, src_port, data, &mut datagram);
                let mut frame = Frame::new(src_mac, self.mac, ETHERTYPE_IPV4);
                frame.ipv4(PROTOCOL_UDP, self.ip, src, &datagram[..size]);
                self.send(&mut frame);
                println!(
                    "{NAME}: echoed {} udp bytes to {src}:{src_port}",
                    data.len()
                );
                true
            }
            _ => false,
        }
    }
}

/// A `fmt::Write` into a byte array (the rest is cut off).
struct Cursor<'a> {
    bytes: &'a mut [u8],
    len: usize,
}

impl fmt::Write for Cursor<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.bytes.len() - self.len;
        let count = s.len().min(room);
        self.bytes[self.len..self.len + count].copy_from_slice(&s.as_bytes()[..count]);
        self.len += count;
        Ok(())
    }
}

pub fn run(dma: &mut Dma, words: &mut Words) -> ! {
    let ip = match words.next_word() {
        None => {
            println!("testguest: missing IP; usage: {USAGE}");
            exit(super::EXIT_SETUP)
        }
        Some(word) => parse_ip(word).unwrap_or_else(|| {
            println!("testguest: bad IP '{word}'; usage: {USAGE}");
            exit(super::EXIT_SETUP)
        }),
    };
    let mut dev = VirtioPci::find(NAME, TYPE_NET);
    let features = dev.initialize(F_MAC);
    let rx = dev.setup_queue(dma, 0, None);
    let tx = dev.setup_queue(dma, 1, None);
    rx.suppress_interrupts(true);
    tx.suppress_interrupts(true);
    dev.driver_ok();
    let mac = if features & F_MAC != 0 {
        Mac(dev.read_config(|dev| core::array::from_fn(|i| dev.config8(i as u32))))
    } else {
        FALLBACK_MAC
    };
    let mut nic = Nic {
        dev: &dev,
        mac,
        ip,
        rx,
        tx,
        tx_buffer: dma.alloc(RX_BUFFER as u64, 64),
        received: 0,
        sent: 0,
    };
    for _ in 0..RX_BUFFERS.min(nic.rx.size as usize) {
        let buffer = dma.alloc(RX_BUFFER as u64, 64);
        if let Err(err) = nic
            .rx
            .add(&[Buffer::writable(buffer, RX_BUFFER as u32)], buffer)
        {
            dev.fail(format_args!("rx queue: {err}"));
        }
    }
    nic.rx.notify();
    println!("{NAME}: mac={mac}");
    nic.announce();

    let deadline = Deadline::after_ms(PEER_TIMEOUT_MS);
    loop {
        let used = match nic.rx.pop_used() {
            Ok(Some(used)) => used,
            Ok(None) => {
                if deadline.expired() {
                    dev.fail(format_args!(
                        "no udp datagram to port {ECHO_PORT} within {PEER_TIMEOUT_MS} ms (rx={} tx={})",
                        nic.received, nic.sent
                    ));
                }
                crate::arch::pause();
                continue;
            }
            Err(err) => dev.fail(format_args!("rx queue: {err}")),
        };
        nic.received += 1;
        let len = used.len as usize;
        if !(NET_HEADER..=RX_BUFFER).contains(&len) {
            dev.fail(format_args!(
                "rx buffer of {RX_BUFFER} bytes reported {len} bytes used"
            ));
        }
        let mut frame = [0u8; MAX_FRAME];
        let frame = &mut frame[..len - NET_HEADER];
        read_ram(used.token + NET_HEADER as u64, frame);
        let done = nic.handle(frame);
        if let Err(err) = nic.rx.add(
            &[Buffer::writable(used.token, RX_BUFFER as u32)],
            used.token,
        ) {
            dev.fail(format_args!("rx queue: {err}"));
        }
        nic.rx.notify();
        if done {
            println!("{NAME}: ok rx={} tx={}", nic.received, nic.sent);
            exit(0)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Multi-queue (`virtio-net-mq`) and throughput (`virtio-net-bench`) workloads.

const MQ_NAME: &str = "virtio-net-mq";
const MQ_USAGE: &str = "virtio-net-mq IP HOST_IP PORT PAIRS ROUNDS";
const BENCH_NAME: &str = "virtio-net-bench";
const BENCH_USAGE: &str = "virtio-net-bench IP HOST_IP PORT tx|rx SECONDS";
const F_CTRL_VQ: u64 = 1 << 17;
const F_MQ: u64 = 1 << 22;
/// virtio_net_config.max_virtqueue_pairs (le16), after mac[6] and status (le16).
const CONFIG_MAX_PAIRS: u32 = 8;
const CTRL_CLASS_MQ: u8 = 4;
const CTRL_MQ_VQ_PAIRS_SET: u8 = 0;
const CTRL_OK: u8 = 0;
const CTRL_ERR: u8 = 1;
/// The most pairs the workload drives (rings and buffers must fit the DMA area).
const MQ_MAX_PAIRS: usize = 8;
/// Source ports of the echo requests start here; each request gets its own, so the host's
/// flow hash (which picks the tap queue a reply goes to) varies.
const MQ_FIRST_PORT: u16 = 40000;
/// How long one echo request waits for its reply before it is sent again, and how often.
const MQ_RETRY_MS: u64 = 1_000;
const MQ_TRIES: u32 = 5;
/// The bench's UDP payload: the largest an unfragmented 1500-byte MTU frame carries.
const BENCH_PAYLOAD: usize = 1472;

/// One RX/TX virtqueue pair, polled, with its receive buffers posted.
struct Pair {
    rx: SplitQueue,
    tx: SplitQueue,
    tx_buffer: u64,
    sent: u64,
    received: u64,
}

/// A frame received and what the workloads care about in it.
enum Received<'a> {
    ArpRequest {
        mac: Mac,
        ip: Ip,
    },
    ArpReply {
        mac: Mac,
        ip: Ip,
    },
    Udp {
        src: Ip,
        src_port: u16,
        dst_port: u16,
        data: &'a [u8],
    },
    Other,
}

/// Parses `frame` for `mac`/`ip`: ARP for `ip`, and unfragmented UDP to `ip`.
fn classify(frame: &[u8], mac: Mac, ip: Ip) -> Received<'_> {
    if frame.len() < 14 {
        return Received::Other;
    }
    let dst = mac_at(frame, 0);
    if dst != mac && dst != BROADCAST_MAC {
        return Received::Other;
    }
    let payload = &frame[14..];
    match be16(frame, 12) {
        ETHERTYPE_ARP => {
            if payload.len() < 28 || payload[0..6] != [0, 1, 0x08, 0x00, 6, 4] {
                return Received::Other;
            }
            if ip_at(payload, 24) != ip {
                return Received::Other;
            }
            let (sender_mac, sender_ip) = (mac_at(payload, 8), ip_at(payload, 14));
            match be16(payload, 6) {
                1 => Received::ArpRequest {
                    mac: sender_mac,
                    ip: sender_ip,
                },
                2 => Received::ArpReply {
                    mac: sender_mac,
                    ip: sender_ip,
                },
                _ => Received::Other,
            }
        }
        ETHERTYPE_IPV4 => {
            let packet = payload;
            if packet.len() < 20 || packet[0] >> 4 != 4 || packet[9] != PROTOCOL_UDP {
                return Received::Other;
            }
            let header_len = usize::from(packet[0] & 0xf) * 4;
            let total = usize::from(be16(packet, 2));
            let fragmented = be16(packet, 6) & 0x3fff != 0;
            if header_len < 20 || total < header_len + 8 || total > packet.len() || fragmented {
                return Received::Other;
            }
            if ip_at(packet, 16) != ip {
                return Received::Other;
            }
            let body = &packet[header_len..total];
            let udp_len = usize::from(be16(body, 4));
            if udp_len < 8 || udp_len > body.len() {
                return Received::Other;
            }
            Received::Udp {
                src: ip_at(packet, 12),
                src_port: be16(body, 0),
                dst_port: be16(body, 2),
                data: &body[8..udp_len],
            }
        }
        _ => Received::Other,
    }
}

/// An ARP packet (Ethernet/IPv4) from `mac`/`ip`, `operation` 1 (request) or 2 (reply).
fn arp_frame(mac: Mac, ip: Ip, dst: Mac, operation: u16, target_mac: Mac, target_ip: Ip) -> Frame {
    let mut frame = Frame::new(dst, mac, ETHERTYPE_ARP);
    frame.push(&[0, 1, 0x08, 0x00, 6, 4]);
    frame.push(&operation.to_be_bytes());
    frame.push(&mac.0);
    frame.push(&ip.0);
    frame.push(&target_mac.0);
    frame.push(&target_ip.0);
    frame
}

/// A UDP datagram in an Ethernet frame.
fn udp_frame(
    (mac, ip, port): (Mac, Ip, u16),
    (dst_mac, dst_ip, dst_port): (Mac, Ip, u16),
    data: &[u8],
) -> Frame {
    let mut datagram = [0u8; MAX_FRAME];
    let size = udp(ip, port, dst_ip, dst_port, data, &mut datagram);
    let mut frame = Frame::new(dst_mac, mac, ETHERTYPE_IPV4);
    frame.ipv4(PROTOCOL_UDP, ip, dst_ip, &datagram[..size]);
    frame
}

/// Copies `frame` (padded to the minimum) behind a zero header at `buffer`; returns the length.
fn place_frame(buffer: u64, frame: &mut Frame) -> u32 {
    if frame.len < MIN_FRAME {
        frame.bytes[frame.len..MIN_FRAME].fill(0);
        frame.len = MIN_FRAME;
    }
    write_ram(buffer, &[0u8; NET_HEADER]);
    write_ram(buffer + NET_HEADER as u64, &frame.bytes[..frame.len]);
    (NET_HEADER + frame.len) as u32
}

impl Pair {
    /// Sets up queues 2*`index` and 2*`index`+1 and posts receive buffers.
    fn new(dev: &VirtioPci, dma: &mut Dma, index: u16) -> Pair {
        let rx = dev.setup_queue(dma, index * 2, None);
        let tx = dev.setup_queue(dma, index * 2 + 1, None);
        rx.suppress_interrupts(true);
        tx.suppress_interrupts(true);
        Pair {
            rx,
            tx,
            tx_buffer: dma.alloc(RX_BUFFER as u64, 64),
            sent: 0,
            received: 0,
        }
    }

    /// Posts as many receive buffers as the queue holds (at most `count`); call after
    /// DRIVER_OK.
    fn post_rx(&mut self, dev: &VirtioPci, dma: &mut Dma, count: usize) {
        for _ in 0..count.min(self.rx.size as usize) {
            let buffer = dma.alloc(RX_BUFFER as u64, 64);
            if let Err(err) = self
                .rx
                .add(&[Buffer::writable(buffer, RX_BUFFER as u32)], buffer)
            {
                dev.fail(format_args!("rx queue {}: {err}", self.rx.index));
            }
        }
        self.rx.notify();
    }

    /// Sends one frame and waits until the device has taken it.
    fn send(&mut self, dev: &VirtioPci, frame: &mut Frame) {
        let len = place_frame(self.tx_buffer, frame);
        if let Err(err) = self.tx.add(&[Buffer::readable(self.tx_buffer, len)], 0) {
            dev.fail(format_args!("tx queue {}: {err}", self.tx.index));
        }
        self.tx.notify();
        if let Err(err) = self.tx.wait_used() {
            dev.fail(format_args!("tx queue {}: {err}", self.tx.index));
        }
        self.sent += 1;
    }

    /// The next received frame (copied into `into`) and its buffer, which the caller gives
    /// back with [`Pair::recycle`].
    fn receive<'f>(
        &mut self,
        dev: &VirtioPci,
        into: &'f mut [u8; MAX_FRAME],
    ) -> Option<(&'f [u8], u64)> {
        let used = match self.rx.pop_used() {
            Ok(Some(used)) => used,
            Ok(None) => return None,
            Err(err) => dev.fail(format_args!("rx queue {}: {err}", self.rx.index)),
        };
        let len = used.len as usize;
        if !(NET_HEADER..=RX_BUFFER).contains(&len) {
            dev.fail(format_args!(
                "rx queue {}: a {RX_BUFFER}-byte buffer reported {len} bytes used",
                self.rx.index
            ));
        }
        self.received += 1;
        let frame = &mut into[..len - NET_HEADER];
        read_ram(used.token + NET_HEADER as u64, frame);
        Some((frame, used.token))
    }

    /// Gives a receive buffer back to the device (notified by the caller).
    fn recycle(&mut self, dev: &VirtioPci, buffer: u64) {
        if let Err(err) = self
            .rx
            .add(&[Buffer::writable(buffer, RX_BUFFER as u32)], buffer)
        {
            dev.fail(format_args!("rx queue {}: {err}", self.rx.index));
        }
    }
}

fn parse_word<T>(
    words: &mut Words,
    what: &str,
    usage: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> T {
    let Some(word) = words.next_word() else {
        println!("testguest: missing {what}; usage: {usage}");
        exit(super::EXIT_SETUP)
    };
    parse(word).unwrap_or_else(|| {
        println!("testguest: bad {what} '{word}'; usage: {usage}");
        exit(super::EXIT_SETUP)
    })
}

fn device_mac(dev: &VirtioPci, features: u64) -> Mac {
    if features & F_MAC != 0 {
        Mac(dev.read_config(|dev| core::array::from_fn(|i| dev.config8(i as u32))))
    } else {
        FALLBACK_MAC
    }
}

/// Sends VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET `pairs` on the control queue; returns the ack.
fn set_queue_pairs(dev: &VirtioPci, ctrl: &mut SplitQueue, buffer: u64, pairs: u16) -> u8 {
    let [low, high] = pairs.to_le_bytes();
    write_ram(buffer, &[CTRL_CLASS_MQ, CTRL_MQ_VQ_PAIRS_SET, low, high]);
    // Neither OK nor ERR, so an ack the device never wrote shows.
    write_ram(buffer + 4, &[0xee]);
    let chain = [Buffer::readable(buffer, 4), Buffer::writable(buffer + 4, 1)];
    if let Err(err) = ctrl.add(&chain, buffer) {
        dev.fail(format_args!("control queue: {err}"));
    }
    ctrl.notify();
    let used = ctrl
        .wait_used()
        .unwrap_or_else(|err| dev.fail(format_args!("control queue: {err}")));
    let mut ack = [0u8];
    read_ram(buffer + 4, &mut ack);
    if used.len != 1 || (ack[0] != CTRL_OK && ack[0] != CTRL_ERR) {
        dev.fail(format_args!(
            "VQ_PAIRS_SET {pairs}: used length {} ack {:#x}",
            used.len, ack[0]
        ));
    }
    ack[0]
}

/// `virtio-net-mq IP HOST_IP PORT PAIRS ROUNDS`: negotiates VIRTIO_NET_F_MQ, checks that the
/// control queue refuses 0 and max_virtqueue_pairs + 1 pairs, sets PAIRS, resolves HOST_IP,
/// then ROUNDS times sends a UDP datagram to HOST_IP:PORT from every pair's TX queue (each
/// from its own source port) and waits for the same bytes back on any RX queue. Prints
/// `virtio-net-mq: pair <p> tx=<n> rx=<n>` per pair and `virtio-net-mq: ok ...`.
pub fn run_mq(dma: &mut Dma, words: &mut Words) -> ! {
    let ip = parse_word(words, "IP", MQ_USAGE, parse_ip);
    let host_ip = parse_word(words, "HOST_IP", MQ_USAGE, parse_ip);
    let port = parse_word(words, "PORT", MQ_USAGE, |w| w.parse::<u16>().ok());
    let pairs = parse_word(words, "PAIRS", MQ_USAGE, |w| {
        w.parse::<usize>()
            .ok()
            .filter(|n| (1..=MQ_MAX_PAIRS).contains(n))
    });
    let rounds = parse_word(words, "ROUNDS", MQ_USAGE, |w| {
        w.parse::<u16>().ok().filter(|n| (1..=1000).contains(n))
    });
    let mut dev = VirtioPci::find(MQ_NAME, TYPE_NET);
    let features = dev.initialize(F_MAC | F_MQ | F_CTRL_VQ);
    if features & (F_MQ | F_CTRL_VQ) != F_MQ | F_CTRL_VQ {
        dev.fail(format_args!(
            "the device does not offer VIRTIO_NET_F_MQ with a control queue (accepted {features:#x})"
        ));
    }
    let max_pairs = dev.read_config(|dev| {
        u16::from_le_bytes([
            dev.config8(CONFIG_MAX_PAIRS),
            dev.config8(CONFIG_MAX_PAIRS + 1),
        ])
    });
    println!("{MQ_NAME}: max_virtqueue_pairs={max_pairs}");
    if usize::from(max_pairs) < pairs {
        dev.fail(format_args!(
            "{pairs} pairs wanted, the device has {max_pairs}"
        ));
    }
    let mut queues: [Option<Pair>; MQ_MAX_PAIRS] = core::array::from_fn(|_| None);
    for (index, slot) in queues.iter_mut().enumerate().take(pairs) {
        *slot = Some(Pair::new(&dev, dma, index as u16));
    }
    let mut ctrl = dev.setup_queue(dma, max_pairs * 2, None);
    ctrl.suppress_interrupts(true);
    dev.driver_ok();
    let ctrl_buffer = dma.alloc(64, 64);
    let mac = device_mac(&dev, features);
    println!("{MQ_NAME}: mac={mac}");
    for pair in queues.iter_mut().flatten() {
        pair.post_rx(&dev, dma, RX_BUFFERS);
    }

    // Out-of-range requests are refused, and the device keeps working afterwards.
    for bad in [0, max_pairs.saturating_add(1)] {
        match set_queue_pairs(&dev, &mut ctrl, ctrl_buffer, bad) {
            CTRL_ERR => println!("{MQ_NAME}: pairs-set {bad} of {max_pairs} refused"),
            _ => dev.fail(format_args!(
                "VQ_PAIRS_SET {bad} of {max_pairs} was accepted"
            )),
        }
    }
    match set_queue_pairs(&dev, &mut ctrl, ctrl_buffer, pairs as u16) {
        CTRL_OK => println!("{MQ_NAME}: pairs-set {pairs} ok"),
        _ => dev.fail(format_args!(
            "VQ_PAIRS_SET {pairs} of {max_pairs} was refused"
        )),
    }

    let mut link = MqLink {
        dev: &dev,
        mac,
        ip,
        pairs: &mut queues[..pairs],
    };
    let host_mac = link.resolve(host_ip);
    println!("{MQ_NAME}: {host_ip} is at {host_mac}");

    let mut replies = 0u32;
    for round in 0..rounds {
        for pair in 0..pairs {
            let src_port = MQ_FIRST_PORT + round * pairs as u16 + pair as u16;
            let mut data = [0u8; 200];
            let len = 32 + (usize::from(round) * 7 + pair * 13) % 160;
            for (i, byte) in data[..len].iter_mut().enumerate() {
                *byte = (i as u16 ^ src_port) as u8;
            }
            let data = &data[..len];
            let mut answered = false;
            for _ in 0..MQ_TRIES {
                let mut frame = udp_frame((mac, ip, src_port), (host_mac, host_ip, port), data);
                if let Some(queue_pair) = link.pairs[pair].as_mut() {
                    queue_pair.send(&dev, &mut frame);
                }
                if link.await_echo(host_ip, port, src_port, data) {
                    answered = true;
                    break;
                }
            }
            if !answered {
                dev.fail(format_args!(
                    "no echo from {host_ip}:{port} to port {src_port} (pair {pair}) after {MQ_TRIES} tries"
                ));
            }
            replies += 1;
        }
    }
    for (index, pair) in link.pairs.iter().flatten().enumerate() {
        println!(
            "{MQ_NAME}: pair {index} tx={} rx={}",
            pair.sent, pair.received
        );
    }
    println!("{MQ_NAME}: ok pairs={pairs} replies={replies}");
    exit(0)
}

/// The pairs of a multi-queue device in use, polled together.
struct MqLink<'d, 'p> {
    dev: &'d VirtioPci,
    mac: Mac,
    ip: Ip,
    pairs: &'p mut [Option<Pair>],
}

impl MqLink<'_, '_> {
    /// Polls every RX queue once: answers ARP requests (from the pair they came on) and
    /// hands each other frame to `seen`; true once `seen` returned true.
    fn poll(&mut self, mut seen: impl FnMut(&Received) -> bool) -> bool {
        let mut done = false;
        for pair in self.pairs.iter_mut().flatten() {
            let mut bytes = [0u8; MAX_FRAME];
            let mut any = false;
            while let Some((frame, buffer)) = pair.receive(self.dev, &mut bytes) {
                any = true;
                let received = classify(frame, self.mac, self.ip);
                let mut reply = match received {
                    Received::ArpRequest { mac, ip } => {
                        Some(arp_frame(self.mac, self.ip, mac, 2, mac, ip))
                    }
                    _ => None,
                };
                done |= seen(&received);
                pair.recycle(self.dev, buffer);
                if let Some(reply) = reply.as_mut() {
                    pair.send(self.dev, reply);
                }
            }
            if any {
                pair.rx.notify();
            }
        }
        done
    }

    /// Sends ARP requests for `target` (from pair 0) until one is answered.
    fn resolve(&mut self, target: Ip) -> Mac {
        let deadline = Deadline::after_ms(PEER_TIMEOUT_MS);
        while !deadline.expired() {
            let mut request = arp_frame(self.mac, self.ip, BROADCAST_MAC, 1, Mac([0; 6]), target);
            let dev = self.dev;
            if let Some(pair) = self.pairs[0].as_mut() {
                pair.send(dev, &mut request);
            }
            let retry = Deadline::after_ms(MQ_RETRY_MS);
            let mut found = None;
            while found.is_none() && !retry.expired() {
                self.poll(|received| match *received {
                    Received::ArpReply { mac, ip } if ip == target => {
                        found = Some(mac);
                        true
                    }
                    _ => false,
                });
                crate::arch::pause();
            }
            if let Some(mac) = found {
                return mac;
            }
        }
        self.dev.fail(format_args!(
            "no ARP reply from {target} within {PEER_TIMEOUT_MS} ms"
        ))
    }

    /// Waits up to [`MQ_RETRY_MS`] for `expected` from `host`:`port` to `to_port`; a reply
    /// with other bytes fails the workload.
    fn await_echo(&mut self, host: Ip, port: u16, to_port: u16, expected: &[u8]) -> bool {
        let dev = self.dev;
        let deadline = Deadline::after_ms(MQ_RETRY_MS);
        while !deadline.expired() {
            let got = self.poll(|received| match *received {
                Received::Udp {
                    src,
                    src_port,
                    dst_port,
                    data,
                } if src == host && src_port == port && dst_port == to_port => {
                    if data != expected {
                        dev.fail(format_args!(
                            "the echo to port {to_port} has {} bytes that differ from the {} sent",
                            data.len(),
                            expected.len()
                        ));
                    }
                    true
                }
                _ => false,
            });
            if got {
                return true;
            }
            crate::arch::pause();
        }
        false
    }
}

/// `virtio-net-bench IP HOST_IP PORT tx|rx SECONDS` on one queue pair, polled, notifications
/// batched, for bench/virtio:
/// - `tx`: resolves HOST_IP, then sends UDP datagrams of [`BENCH_PAYLOAD`] bytes to
///   HOST_IP:PORT with every TX descriptor in flight for SECONDS. Line:
///   `virtio-net-bench: tx frames=<n> bytes=<payload bytes> cycles=<c> notifies=<k>`.
/// - `rx`: announces itself (gratuitous ARP), answers ARP, and counts the UDP datagrams to
///   PORT for SECONDS from the first one. Line:
///   `virtio-net-bench: rx frames=<n> bytes=<payload bytes> cycles=<c first to last>`.
///
/// Both print `virtio-net-bench: tsc_hz=<hz>` first and `virtio-net-bench: ok` last.
pub fn run_bench(dma: &mut Dma, words: &mut Words) -> ! {
    let ip = parse_word(words, "IP", BENCH_USAGE, parse_ip);
    let host_ip = parse_word(words, "HOST_IP", BENCH_USAGE, parse_ip);
    let port = parse_word(words, "PORT", BENCH_USAGE, |w| w.parse::<u16>().ok());
    let transmit = parse_word(words, "tx|rx", BENCH_USAGE, |w| match w {
        "tx" => Some(true),
        "rx" => Some(false),
        _ => None,
    });
    let seconds = parse_word(words, "SECONDS", BENCH_USAGE, |w| {
        w.parse::<u64>().ok().filter(|n| (1..=600).contains(n))
    });
    let mut dev = VirtioPci::find(BENCH_NAME, TYPE_NET);
    let features = dev.initialize(F_MAC);
    let mut queues: [Option<Pair>; 1] = [Some(Pair::new(&dev, dma, 0))];
    dev.driver_ok();
    let mac = device_mac(&dev, features);
    let tsc_hz = crate::arch::tsc_hz();
    println!("{BENCH_NAME}: mac={mac} tsc_hz={tsc_hz}");
    if let Some(pair) = queues[0].as_mut() {
        pair.post_rx(&dev, dma, usize::MAX);
    }
    let mut link = MqLink {
        dev: &dev,
        mac,
        ip,
        pairs: &mut queues,
    };
    if transmit {
        let host_mac = link.resolve(host_ip);
        println!("{BENCH_NAME}: {host_ip} is at {host_mac}");
        bench_tx(
            &mut link,
            dma,
            (host_mac, host_ip, port),
            seconds * 1000,
            tsc_hz,
        );
    } else {
        bench_rx(&mut link, port, seconds, tsc_hz);
    }
    println!("{BENCH_NAME}: ok");
    exit(0)
}

fn bench_tx(link: &mut MqLink, dma: &mut Dma, to: (Mac, Ip, u16), ms: u64, tsc_hz: u64) {
    let dev = link.dev;
    let mut data = [0u8; BENCH_PAYLOAD];
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = i as u8;
    }
    let mut frame = udp_frame((link.mac, link.ip, ECHO_PORT), to, &data);
    let Some(pair) = link.pairs[0].as_mut() else {
        dev.fail(format_args!("no queue pair"))
    };
    // One prepared frame per descriptor: the same datagram, sent over and over.
    let slots = usize::from(pair.tx.size);
    let mut free = [0u64; super::queue::MAX_QUEUE_SIZE as usize];
    let mut frame_len = 0;
    for slot in free.iter_mut().take(slots) {
        *slot = dma.alloc(RX_BUFFER as u64, 64);
        frame_len = place_frame(*slot, &mut frame);
    }
    let mut free_count = slots;
    let (mut frames, mut notifies) = (0u64, 0u64);
    let start = crate::arch::rdtsc();
    let ticks = tsc_hz / 1000 * ms;
    while crate::arch::rdtsc().wrapping_sub(start) < ticks {
        let mut added = false;
        while free_count > 0 {
            free_count -= 1;
            let buffer = free[free_count];
            if let Err(err) = pair.tx.add(&[Buffer::readable(buffer, frame_len)], buffer) {
                dev.fail(format_args!("tx queue: {err}"));
            }
            added = true;
        }
        if added {
            pair.tx.notify();
            notifies += 1;
        }
        let mut reaped = false;
        loop {
            match pair.tx.pop_used() {
                Ok(Some(used)) => {
                    free[free_count] = used.token;
                    free_count += 1;
                    frames += 1;
                    reaped = true;
                }
                Ok(None) => break,
                Err(err) => dev.fail(format_args!("tx queue: {err}")),
            }
        }
        if !reaped {
            crate::arch::pause();
        }
    }
    // Whatever is still in flight goes out too.
    while free_count < slots {
        match pair.tx.wait_used() {
            Ok(used) => {
                free[free_count] = used.token;
                free_count += 1;
                frames += 1;
            }
            Err(err) => dev.fail(format_args!("tx queue: {err}")),
        }
    }
    let cycles = crate::arch::rdtsc().wrapping_sub(start);
    println!(
        "{BENCH_NAME}: tx frames={frames} bytes={} cycles={cycles} notifies={notifies}",
        frames * BENCH_PAYLOAD as u64
    );
}

fn bench_rx(link: &mut MqLink, port: u16, seconds: u64, tsc_hz: u64) {
    let dev = link.dev;
    let mut announce = arp_frame(link.mac, link.ip, BROADCAST_MAC, 1, Mac([0; 6]), link.ip);
    if let Some(pair) = link.pairs[0].as_mut() {
        pair.send(dev, &mut announce);
    }
    println!("{BENCH_NAME}: rx waiting on port {port}");
    let (mut frames, mut bytes) = (0u64, 0u64);
    let (mut first, mut last) = (0u64, 0u64);
    let wait = Deadline::after_ms(PEER_TIMEOUT_MS);
    let ticks = tsc_hz * seconds;
    loop {
        let now = crate::arch::rdtsc();
        if frames > 0 && now.wrapping_sub(first) >= ticks {
            break;
        }
        if frames == 0 && wait.expired() {
            dev.fail(format_args!(
                "no datagram to port {port} within {PEER_TIMEOUT_MS} ms"
            ));
        }
        let got = link.poll(|received| match *received {
            Received::Udp { dst_port, data, .. } if dst_port == port => {
                let now = crate::arch::rdtsc();
                if frames == 0 {
                    first = now;
                }
                last = now;
                frames += 1;
                bytes += data.len() as u64;
                true
            }
            _ => false,
        });
        if !got {
            crate::arch::pause();
        }
    }
    println!(
        "{BENCH_NAME}: rx frames={frames} bytes={bytes} cycles={}",
        last.wrapping_sub(first)
    );
}
