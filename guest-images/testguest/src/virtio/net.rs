//! `virtio-net IP`: the network device (type 1) with a fixed IPv4 address. It announces itself
//! (gratuitous ARP, a broadcast UDP datagram from port 7 to port 9), answers ARP requests and
//! ICMP echo requests for IP, and echoes the first UDP datagram sent to IP (or broadcast)
//! port 7 back to its sender; then it is done.

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
