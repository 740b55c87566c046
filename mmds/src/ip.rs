//! Ethernet, ARP and IPv4 as far as MMDS needs them: recognising the guest's frames for
//! the MMDS address, answering its ARP requests, and framing IPv4 packets back to it.

use std::net::Ipv4Addr;

pub const ETH_HEADER_LEN: usize = 14;
pub const ETHERTYPE_IPV4: u16 = 0x0800;
pub const ETHERTYPE_ARP: u16 = 0x0806;
pub const IPV4_HEADER_LEN: usize = 20;
pub const PROTO_TCP: u8 = 6;
const ARP_LEN: usize = 28;

/// The MAC MMDS answers from (Firecracker's).
pub const MMDS_MAC: [u8; 6] = [0x06, 0x01, 0x23, 0x45, 0x67, 0x01];

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*bytes.get(at)?, *bytes.get(at + 1)?]))
}

fn ipv4_at(bytes: &[u8], at: usize) -> Option<Ipv4Addr> {
    let b: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
    Some(Ipv4Addr::from(b))
}

/// The Internet checksum of `parts` concatenated.
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    let mut odd: Option<u8> = None;
    for part in parts {
        for &byte in *part {
            match odd.take() {
                Some(high) => sum += u32::from(u16::from_be_bytes([high, byte])),
                None => odd = Some(byte),
            }
        }
    }
    if let Some(high) = odd {
        sum += u32::from(u16::from_be_bytes([high, 0]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet for MMDS from the guest.
#[derive(Debug, PartialEq, Eq)]
pub struct Ipv4Packet<'a> {
    pub guest_mac: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub protocol: u8,
    pub payload: &'a [u8],
}

/// What a guest frame is to MMDS at `address`.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// Not for MMDS: it goes to the tap.
    Other,
    /// An ARP request for the MMDS address: the reply frame.
    ArpRequest { reply: Vec<u8> },
    /// An IPv4 packet to the MMDS address (checked header).
    Ipv4(Ipv4Packet<'a>),
    /// For MMDS but malformed: dropped.
    Malformed,
}

/// Classifies a guest frame (the Ethernet frame, no virtio header).
pub fn classify(frame: &[u8], address: Ipv4Addr) -> Frame<'_> {
    let Some(ethertype) = u16_at(frame, 12) else {
        return Frame::Other;
    };
    let Ok(guest_mac) = <[u8; 6]>::try_from(&frame[6..12]) else {
        return Frame::Other;
    };
    let body = &frame[ETH_HEADER_LEN..];
    match ethertype {
        ETHERTYPE_ARP => {
            // Ethernet/IPv4 request for the address?
            if body.len() < ARP_LEN
                || u16_at(body, 0) != Some(1)
                || u16_at(body, 2) != Some(ETHERTYPE_IPV4)
                || body[4] != 6
                || body[5] != 4
                || ipv4_at(body, 24) != Some(address)
            {
                return Frame::Other;
            }
            if u16_at(body, 6) != Some(1) {
                return Frame::Malformed;
            }
            let (sender_mac, sender_ip) = (&body[8..14], &body[14..18]);
            let mut reply = Vec::with_capacity(ETH_HEADER_LEN + ARP_LEN);
            reply.extend_from_slice(sender_mac);
            reply.extend_from_slice(&MMDS_MAC);
            reply.extend_from_slice(&ETHERTYPE_ARP.to_be_bytes());
            reply.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 2]);
            reply.extend_from_slice(&MMDS_MAC);
            reply.extend_from_slice(&address.octets());
            reply.extend_from_slice(sender_mac);
            reply.extend_from_slice(sender_ip);
            Frame::ArpRequest { reply }
        }
        ETHERTYPE_IPV4 => {
            if ipv4_at(body, 16) != Some(address) {
                return Frame::Other;
            }
            let header_len = usize::from(body[0] & 0x0f) * 4;
            let Some(total) = u16_at(body, 2).map(usize::from) else {
                return Frame::Malformed;
            };
            let fragmented = u16_at(body, 6).is_none_or(|f| f & 0x3fff != 0);
            if body[0] >> 4 != 4
                || header_len < IPV4_HEADER_LEN
                || total < header_len
                || total > body.len()
                || fragmented
                || checksum(&[&body[..header_len]]) != 0
            {
                return Frame::Malformed;
            }
            Frame::Ipv4(Ipv4Packet {
                guest_mac,
                src: ipv4_at(body, 12).unwrap_or(Ipv4Addr::UNSPECIFIED),
                dst: address,
                protocol: body[9],
                payload: &body[header_len..total],
            })
        }
        _ => Frame::Other,
    }
}

/// An Ethernet frame carrying an IPv4 packet from MMDS at `src` to the guest.
pub fn ipv4_frame(
    guest_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    payload: &[u8],
) -> Vec<u8> {
    let total = (IPV4_HEADER_LEN + payload.len()) as u16;
    let mut header = [0u8; IPV4_HEADER_LEN];
    header[0] = 0x45;
    header[2..4].copy_from_slice(&total.to_be_bytes());
    header[6] = 0x40; // don't fragment
    header[8] = 64;
    header[9] = protocol;
    header[12..16].copy_from_slice(&src.octets());
    header[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&[&header]);
    header[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = Vec::with_capacity(ETH_HEADER_LEN + total as usize);
    frame.extend_from_slice(&guest_mac);
    frame.extend_from_slice(&MMDS_MAC);
    frame.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    frame.extend_from_slice(&header);
    frame.extend_from_slice(payload);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const GUEST_MAC: [u8; 6] = [0x06, 0, 0, 0, 0, 2];

    fn arp_request(target: Ipv4Addr) -> Vec<u8> {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&GUEST_MAC);
        f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
        f.extend_from_slice(&GUEST_MAC);
        f.extend_from_slice(&[169, 254, 0, 2]);
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&target.octets());
        f
    }

    #[test]
    fn arp_for_the_address_is_answered() {
        let mmds = Ipv4Addr::new(169, 254, 169, 254);
        let Frame::ArpRequest { reply } = classify(&arp_request(mmds), mmds) else {
            panic!("not answered");
        };
        assert_eq!(&reply[..6], &GUEST_MAC);
        assert_eq!(&reply[22..28], &MMDS_MAC);
        assert_eq!(&reply[28..32], &mmds.octets());
        assert_eq!(&reply[38..42], &[169, 254, 0, 2]);
        assert_eq!(
            classify(&arp_request(Ipv4Addr::new(10, 0, 0, 1)), mmds),
            Frame::Other
        );
    }

    #[test]
    fn ipv4_is_checked() {
        let mmds = Ipv4Addr::new(169, 254, 169, 254);
        let guest = Ipv4Addr::new(169, 254, 0, 2);
        // A frame built towards MMDS: swap the roles to reuse ipv4_frame.
        let mut frame = ipv4_frame(MMDS_MAC, guest, mmds, PROTO_TCP, b"abc");
        frame[6..12].copy_from_slice(&GUEST_MAC);
        let Frame::Ipv4(packet) = classify(&frame, mmds) else {
            panic!("not recognised");
        };
        assert_eq!((packet.src, packet.payload), (guest, &b"abc"[..]));
        let mut damaged = frame.clone();
        damaged[ETH_HEADER_LEN + 8] ^= 1;
        assert_eq!(classify(&damaged, mmds), Frame::Malformed);
        let mut short = frame.clone();
        short.truncate(ETH_HEADER_LEN + 21);
        assert_eq!(classify(&short, mmds), Frame::Malformed);
        for n in 0..frame.len() {
            let _ = classify(&frame[..n], mmds);
        }
        assert_eq!(classify(&frame, Ipv4Addr::new(1, 2, 3, 4)), Frame::Other);
    }
}
