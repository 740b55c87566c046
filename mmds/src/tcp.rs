//! A minimal TCP responder for MMDS's port 80: it accepts connections (SYN → SYN-ACK),
//! takes in-order data into a bounded request buffer, answers each complete HTTP request
//! with data segments, and closes when asked (FIN) or after a `Connection: close` answer.
//! No retransmission (the link is a virtqueue: nothing is lost on the way), no options
//! beyond what a segment needs; out-of-order data is dropped and re-acknowledged.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use crate::http;
use crate::ip::{checksum, ipv4_frame, PROTO_TCP};
use crate::Mmds;

pub const MMDS_PORT: u16 = 80;
/// The most connections open at once (Firecracker's bound); a SYN past it is reset.
pub const MAX_CONNECTIONS: usize = 30;
/// The data carried per segment (fits a 1500-byte MTU).
pub const MSS: usize = 1460;
const HEADER_LEN: usize = 20;
const WINDOW: u16 = 16384;

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

/// One segment from the guest.
#[derive(Debug)]
pub struct Segment<'a> {
    pub src_port: u16,
    pub dst_port: u16,
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    pub payload: &'a [u8],
}

/// Parses a TCP segment (checksum checked against the pseudo header).
pub fn parse(packet: &[u8], src: Ipv4Addr, dst: Ipv4Addr) -> Option<Segment<'_>> {
    if packet.len() < HEADER_LEN {
        return None;
    }
    let offset = usize::from(packet[12] >> 4) * 4;
    if offset < HEADER_LEN || offset > packet.len() {
        return None;
    }
    if checksum(&[&pseudo_header(src, dst, packet.len()), packet]) != 0 {
        return None;
    }
    let u16_at = |at: usize| u16::from_be_bytes([packet[at], packet[at + 1]]);
    let u32_at = |at: usize| u32::from_be_bytes(packet[at..at + 4].try_into().unwrap_or([0; 4]));
    Some(Segment {
        src_port: u16_at(0),
        dst_port: u16_at(2),
        seq: u32_at(4),
        ack: u32_at(8),
        flags: packet[13],
        payload: &packet[offset..],
    })
}

fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, len: usize) -> [u8; 12] {
    let mut p = [0u8; 12];
    p[..4].copy_from_slice(&src.octets());
    p[4..8].copy_from_slice(&dst.octets());
    p[9] = PROTO_TCP;
    p[10..12].copy_from_slice(&(len as u16).to_be_bytes());
    p
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// SYN-ACK sent, waiting for the guest's ACK (data may come with it).
    SynReceived,
    Established,
    /// Our FIN is sent.
    Closing,
}

#[derive(Debug)]
struct Connection {
    state: State,
    /// Next byte we send.
    snd_nxt: u32,
    /// Next byte we expect.
    rcv_nxt: u32,
    request: Vec<u8>,
    fin_sent: bool,
    fin_received: bool,
}

/// The guest's address and port on a connection.
type Key = (Ipv4Addr, u16);

/// All connections to MMDS of one network interface.
#[derive(Debug, Default)]
pub struct Responder {
    connections: BTreeMap<Key, Connection>,
    next_isn: u32,
}

/// Frames for the guest, and where they go.
pub struct Out<'o> {
    pub guest_mac: [u8; 6],
    pub guest_ip: Ipv4Addr,
    pub mmds_ip: Ipv4Addr,
    pub frames: &'o mut Vec<Vec<u8>>,
}

impl Out<'_> {
    #[allow(clippy::too_many_arguments)]
    fn send(&mut self, src_port: u16, dst_port: u16, seq: u32, ack: u32, flags: u8, data: &[u8]) {
        let mut segment = Vec::with_capacity(HEADER_LEN + data.len());
        segment.extend_from_slice(&src_port.to_be_bytes());
        segment.extend_from_slice(&dst_port.to_be_bytes());
        segment.extend_from_slice(&seq.to_be_bytes());
        segment.extend_from_slice(&ack.to_be_bytes());
        segment.push((HEADER_LEN as u8 / 4) << 4);
        segment.push(flags);
        segment.extend_from_slice(&WINDOW.to_be_bytes());
        segment.extend_from_slice(&[0, 0, 0, 0]);
        segment.extend_from_slice(data);
        let sum = checksum(&[
            &pseudo_header(self.mmds_ip, self.guest_ip, segment.len()),
            &segment,
        ]);
        segment[16..18].copy_from_slice(&sum.to_be_bytes());
        self.frames.push(ipv4_frame(
            self.guest_mac,
            self.mmds_ip,
            self.guest_ip,
            PROTO_TCP,
            &segment,
        ));
    }
}

impl Responder {
    pub fn connections(&self) -> usize {
        self.connections.len()
    }

    /// Handles one segment from the guest, pushing the frames it answers with.
    pub fn handle(&mut self, segment: &Segment, mmds: &Mmds, out: &mut Out) {
        let key = (out.guest_ip, segment.src_port);
        let (port, peer) = (segment.dst_port, segment.src_port);
        if segment.flags & RST != 0 {
            self.connections.remove(&key);
            return;
        }
        let reset = |out: &mut Out| {
            if segment.flags & ACK != 0 {
                out.send(port, peer, segment.ack, 0, RST, &[]);
            } else {
                let len =
                    segment.payload.len() as u32 + u32::from(segment.flags & (SYN | FIN) != 0);
                out.send(port, peer, 0, segment.seq.wrapping_add(len), RST | ACK, &[]);
            }
        };
        if port != MMDS_PORT {
            reset(out);
            return;
        }
        if segment.flags & SYN != 0 {
            if let Some(existing) = self.connections.get(&key) {
                if existing.state == State::SynReceived
                    && existing.rcv_nxt == segment.seq.wrapping_add(1)
                {
                    // The guest sent its SYN again: answer it again.
                    let isn = existing.snd_nxt.wrapping_sub(1);
                    out.send(port, peer, isn, existing.rcv_nxt, SYN | ACK, &[]);
                    return;
                }
                self.connections.remove(&key);
            }
            if self.connections.len() >= MAX_CONNECTIONS {
                reset(out);
                return;
            }
            self.next_isn = self.next_isn.wrapping_add(0x0001_0000).wrapping_add(7919);
            let isn = self.next_isn;
            let rcv_nxt = segment.seq.wrapping_add(1);
            out.send(port, peer, isn, rcv_nxt, SYN | ACK, &[]);
            self.connections.insert(
                key,
                Connection {
                    state: State::SynReceived,
                    snd_nxt: isn.wrapping_add(1),
                    rcv_nxt,
                    request: Vec::new(),
                    fin_sent: false,
                    fin_received: false,
                },
            );
            return;
        }
        let Some(conn) = self.connections.get_mut(&key) else {
            reset(out);
            return;
        };
        if segment.flags & ACK == 0 {
            return;
        }
        if conn.state == State::SynReceived {
            if segment.ack != conn.snd_nxt {
                reset(out);
                self.connections.remove(&key);
                return;
            }
            conn.state = State::Established;
        }
        if segment.seq != conn.rcv_nxt {
            // Out of order or a retransmission: say what we expect.
            out.send(port, peer, conn.snd_nxt, conn.rcv_nxt, ACK, &[]);
            return;
        }
        let mut acknowledge = false;
        if !segment.payload.is_empty() && !conn.fin_received {
            conn.rcv_nxt = conn.rcv_nxt.wrapping_add(segment.payload.len() as u32);
            acknowledge = true;
            if conn.state == State::Established && !conn.fin_sent {
                if conn.request.len() + segment.payload.len() > http::MAX_REQUEST_LEN {
                    let response = http::Response {
                        close: true,
                        ..http::Response::text(400, "The request is too long.")
                    };
                    send_response(conn, &response, port, peer, out);
                    acknowledge = false;
                    conn.request.clear();
                } else {
                    conn.request.extend_from_slice(segment.payload);
                    acknowledge = !serve(conn, mmds, port, peer, out);
                }
            }
        }
        if segment.flags & FIN != 0 && !conn.fin_received {
            conn.fin_received = true;
            conn.rcv_nxt = conn.rcv_nxt.wrapping_add(1);
            if !conn.fin_sent {
                out.send(port, peer, conn.snd_nxt, conn.rcv_nxt, FIN | ACK, &[]);
                conn.snd_nxt = conn.snd_nxt.wrapping_add(1);
                conn.fin_sent = true;
                conn.state = State::Closing;
            } else {
                out.send(port, peer, conn.snd_nxt, conn.rcv_nxt, ACK, &[]);
            }
            acknowledge = false;
        }
        if acknowledge {
            out.send(port, peer, conn.snd_nxt, conn.rcv_nxt, ACK, &[]);
        }
        // Both sides closed and our FIN acknowledged: the connection is done.
        if conn.fin_sent && conn.fin_received && segment.ack == conn.snd_nxt {
            self.connections.remove(&key);
        }
    }
}

/// Answers every complete request in the buffer; true if anything was sent (which
/// acknowledges the data too).
fn serve(conn: &mut Connection, mmds: &Mmds, port: u16, peer: u16, out: &mut Out) -> bool {
    let mut sent = false;
    while !conn.fin_sent {
        let response = match http::parse(&conn.request) {
            Ok(None) => break,
            Ok(Some((request, used))) => {
                conn.request.drain(..used);
                http::respond(&request, mmds)
            }
            Err(error) => {
                conn.request.clear();
                http::Response {
                    close: true,
                    ..http::Response::text(400, error.to_string())
                }
            }
        };
        send_response(conn, &response, port, peer, out);
        sent = true;
    }
    sent
}

fn send_response(
    conn: &mut Connection,
    response: &http::Response,
    port: u16,
    peer: u16,
    out: &mut Out,
) {
    let bytes = response.to_bytes();
    let chunks: Vec<&[u8]> = bytes.chunks(MSS).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let flags = if last { ACK | PSH } else { ACK };
        out.send(port, peer, conn.snd_nxt, conn.rcv_nxt, flags, chunk);
        conn.snd_nxt = conn.snd_nxt.wrapping_add(chunk.len() as u32);
    }
    if response.close {
        out.send(port, peer, conn.snd_nxt, conn.rcv_nxt, FIN | ACK, &[]);
        conn.snd_nxt = conn.snd_nxt.wrapping_add(1);
        conn.fin_sent = true;
        conn.state = State::Closing;
        conn.request.clear();
    }
}
