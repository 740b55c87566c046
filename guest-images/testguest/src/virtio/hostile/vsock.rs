//! Attacks on the socket device (type 19), its request and receive buffers, and the good
//! request: a REQUEST to a port nobody listens on, which the host answers with RST.

use super::driver::{Kind, D};
use super::memory::{fill, get16, get32, put16, put32, put64};
use super::session::Session;
use super::{
    Outcome, Text, ATTACK_WAIT_MS, DATA, GOOD_WAIT_MS, HDR, HUGE, OUTSIDE, RX, RX_BUFFERS,
};
use crate::virtio::queue::DESC_F_WRITE;
use crate::virtio::vsock::{HEADER, OP_REQUEST, OP_RST, OP_RW, TYPE_STREAM};
use crate::virtio::Deadline;

pub(super) const VSOCK_HEADER: u32 = HEADER as u32;
const HOST_CID: u64 = 2;
/// A host port nobody listens on (`<uds>_4444` does not exist): a REQUEST there is answered
/// with RST.
const CLOSED_PORT: u32 = 4444;
const RX_LEN: u32 = VSOCK_HEADER + 256;

impl Session {
    /// A header from this guest to the host's closed port.
    pub(super) fn to_closed_port(&self, src_port: u32, len: u32, op: u16) -> VsockHeader {
        VsockHeader {
            src_cid: self.cid,
            dst_cid: HOST_CID,
            src_port,
            dst_port: CLOSED_PORT,
            len,
            kind: TYPE_STREAM,
            op,
        }
    }

    pub(super) fn attack_port(&self) -> u32 {
        50_000 + self.tag
    }

    pub(super) fn vsock_header(&self, h: VsockHeader) {
        fill(HDR, 64, 0);
        put64(HDR, h.src_cid);
        put64(HDR + 8, h.dst_cid);
        put32(HDR + 16, h.src_port);
        put32(HDR + 20, h.dst_port);
        put32(HDR + 24, h.len);
        put16(HDR + 28, h.kind);
        put16(HDR + 30, h.op);
        put32(HDR + 36, 4096);
    }

    /// A REQUEST to the closed port must be answered with RST.
    pub(super) fn good_vsock(&mut self) -> Result<(), Text> {
        let port = 30_000 + self.checks % 10_000;
        self.vsock_header(self.to_closed_port(port, 0, OP_REQUEST));
        let ring = self.attack_ring();
        ring.set_desc(ring.desc, 0, D::r(HDR, VSOCK_HEADER));
        if self.good_request(0).is_none() {
            return Err(text!("REQUEST not taken"));
        }
        let reply = self.vsock_reply(port, GOOD_WAIT_MS);
        self.repost_rx();
        match reply {
            Some(OP_RST) => Ok(()),
            Some(op) => Err(text!("REQUEST to a closed port answered with op {op}")),
            None => Err(text!("REQUEST to a closed port not answered")),
        }
    }

    /// Receive-queue packets not seen yet, until one for `port` arrives (its op) or `ms`
    /// pass. The buffers consumed are given back later ([`Session::repost_rx`]).
    pub(super) fn vsock_reply(&mut self, port: u32, ms: u64) -> Option<u16> {
        let rx = self.rings[0];
        let mut seen = self.rx_seen;
        let deadline = Deadline::after_ms(ms);
        loop {
            while rx.used_index() != seen {
                let (id, len) = rx.used_element(seen);
                seen = seen.wrapping_add(1);
                self.rx_seen = seen;
                if id < u32::from(RX_BUFFERS) {
                    self.rx_repost |= 1 << id;
                    let buffer = rx_buffer(id as u16);
                    if len >= VSOCK_HEADER && get32(buffer + 20) == port {
                        return Some(get16(buffer + 30));
                    }
                }
            }
            if deadline.expired() {
                return None;
            }
            crate::arch::pause();
        }
    }

    /// Posts the receive buffers whose bits are set in `mask` and notifies.
    pub(super) fn post_rx(&mut self, mask: u16) {
        let mut rx = self.rings[0];
        for i in 0..RX_BUFFERS {
            if mask & (1 << i) != 0 {
                rx.set_desc(rx.desc, u32::from(i), D::w(rx_buffer(i), RX_LEN));
                rx.offer(i);
            }
        }
        rx.notify();
        self.rings[0] = rx;
        self.rx_repost = 0;
    }

    /// Gives the socket device back the receive buffers it filled.
    pub(super) fn repost_rx(&mut self) {
        if self.kind() != Kind::Vsock || self.rx_repost == 0 {
            return;
        }
        self.post_rx(self.rx_repost);
    }
}

/// Attacks on the socket device: malformed packets, bad receive buffers, a reset flood.
pub(super) fn attacks(s: &mut Session, n: &mut u32) {
    // (name, header tweak, header descriptor length, data descriptor)
    type Tweak = fn(&mut VsockHeader);
    let cases: [(&str, Tweak, u32, Option<D>); 9] = [
        (
            "packet with a wrong src_cid",
            |h| h.src_cid = 99,
            VSOCK_HEADER,
            None,
        ),
        (
            "packet with src_cid 2^64-1",
            |h| h.src_cid = u64::MAX,
            VSOCK_HEADER,
            None,
        ),
        (
            "packet to dst_cid 2^64-1",
            |h| h.dst_cid = u64::MAX,
            VSOCK_HEADER,
            None,
        ),
        ("unknown op 99", |h| h.op = 99, VSOCK_HEADER, None),
        (
            "unknown socket type 99",
            |h| h.kind = 99,
            VSOCK_HEADER,
            None,
        ),
        (
            "len 4096 with a 16-byte buffer",
            |h| {
                h.op = OP_RW;
                h.len = 4096
            },
            VSOCK_HEADER,
            Some(D::r(DATA, 16)),
        ),
        (
            "len 0xffff_ffff",
            |h| {
                h.op = OP_RW;
                h.len = u32::MAX
            },
            VSOCK_HEADER,
            Some(D::r(DATA, 16)),
        ),
        (
            "len 100 and one 60-byte descriptor",
            |h| {
                h.op = OP_RW;
                h.len = 100
            },
            VSOCK_HEADER + 16,
            None,
        ),
        ("header of 20 bytes", |_| {}, 20, None),
    ];
    for (name, tweak, header_len, data) in cases {
        s.attack(n, name, |s| {
            let mut h = s.to_closed_port(s.attack_port(), 0, OP_REQUEST);
            tweak(&mut h);
            s.vsock_header(h);
            match data {
                Some(data) => s.submit(&[D::r(HDR, header_len).to(1), data], 0),
                None => s.submit(&[D::r(HDR, header_len)], 0),
            }
        });
    }
    s.attack(n, "device-writable tx descriptor", |s| {
        s.template();
        s.submit(&[D::w(HDR, VSOCK_HEADER).to(1), D::r(DATA, 16)], 0)
    });
    for (label, rx) in [
        ("read-only rx buffers", D::r(0, RX_LEN)),
        ("rx buffers outside RAM", D::w(OUTSIDE, RX_LEN)),
        ("rx buffers of 0xffff_ffff bytes", D::w(HUGE, u32::MAX)),
        ("rx buffers of 20 bytes", D::w(0, 20)),
    ] {
        s.attack(n, label, |s| {
            // Replace every posted receive buffer, then make the device answer (RST).
            let ring = s.rings[0];
            for i in 0..RX_BUFFERS {
                let mut d = rx;
                if d.addr == 0 {
                    d.addr = rx_buffer(i);
                }
                if d.flags & DESC_F_WRITE != 0 {
                    s.allow(d.addr, u64::from(d.len));
                }
                ring.set_desc(ring.desc, u32::from(i), d);
            }
            let rx_since = ring.used_index();
            s.rings[0] = ring;
            let t = s.template();
            let outcome = s.submit(&t.linked()[..t.n], 0);
            let mut returned = 0;
            let deadline = Deadline::after_ms(200);
            while !deadline.expired() && returned < u32::from(RX_BUFFERS) {
                returned = u32::from(s.rings[0].used_index().wrapping_sub(rx_since));
                crate::arch::pause();
            }
            Outcome::broken(text!("{}; {returned} rx buffers returned", outcome.text))
        });
    }
    s.attack(n, "RST flood without rx buffers", |s| {
        // Every rx buffer taken away first (a reset, then no buffers posted).
        s.renegotiate(true);
        s.dev.driver_ok();
        let mut ring = s.attack_ring();
        let batch = ring.size;
        let mut sent = 0u32;
        let mut stalled = false;
        while sent < 4096 && !stalled {
            for i in 0..batch {
                let header = HDR + 64 * u64::from(i);
                put64(header, s.cid);
                put64(header + 8, HOST_CID);
                put32(header + 16, 10_000 + sent + u32::from(i));
                put32(header + 20, CLOSED_PORT);
                put32(header + 24, 0);
                put16(header + 28, TYPE_STREAM);
                put16(header + 30, 99);
                ring.set_desc(ring.desc, u32::from(i), D::r(header, VSOCK_HEADER));
                ring.offer(i);
            }
            let since = ring.used_index();
            ring.notify();
            let deadline = Deadline::after_ms(ATTACK_WAIT_MS);
            while ring.used_index().wrapping_sub(since) < batch {
                if deadline.expired() {
                    stalled = true;
                    break;
                }
                crate::arch::pause();
            }
            sent += u32::from(ring.used_index().wrapping_sub(since));
        }
        s.rings[usize::from(ring.queue)] = ring;
        if stalled {
            Outcome::broken(text!(
                "tx stalls after {sent} packets (RST backlog bounded)"
            ))
        } else {
            Outcome::broken(text!("{sent} packets taken without stalling"))
        }
    });
}

/// struct virtio_vsock_hdr, the fields the attacks set.
pub(super) struct VsockHeader {
    pub(super) src_cid: u64,
    pub(super) dst_cid: u64,
    pub(super) src_port: u32,
    pub(super) dst_port: u32,
    pub(super) len: u32,
    pub(super) kind: u16,
    pub(super) op: u16,
}

pub(super) fn vsock_op(op: u16) -> &'static str {
    match op {
        1 => "REQUEST",
        2 => "RESPONSE",
        3 => "RST",
        4 => "SHUTDOWN",
        5 => "RW",
        6 => "CREDIT_UPDATE",
        7 => "CREDIT_REQUEST",
        _ => "unknown",
    }
}

/// Receive buffer `i` (descriptor `i` of the receive queue).
pub(super) fn rx_buffer(i: u16) -> u64 {
    RX + u64::from(i) * 0x1000
}
