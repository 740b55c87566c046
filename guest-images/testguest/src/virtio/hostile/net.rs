//! The network device (type 1): no attacks of its own beyond the chain and register ones; its
//! good request sends one frame.

use super::driver::D;
use super::memory::{fill, put8};
use super::session::Session;
use super::{Text, HDR};
use crate::virtio::net::{MIN_FRAME, NET_HEADER as HEADER};

/// virtio_net_hdr_v1 and a minimal Ethernet frame.
pub(super) const NET_HEADER: u32 = HEADER as u32;
pub(super) const NET_FRAME: u32 = MIN_FRAME as u32;

impl Session {
    pub(super) fn good_net(&mut self) -> Result<(), Text> {
        net_frame(HDR);
        let ring = self.attack_ring();
        ring.set_desc(ring.desc, 0, D::r(HDR, NET_HEADER + NET_FRAME));
        self.good_request(0)
            .map(|_| ())
            .ok_or_else(|| text!("frame not sent"))
    }
}

/// virtio_net_hdr_v1 (zero: no offloads) and a broadcast frame of a local experimental
/// ethertype.
pub(super) fn net_frame(at: u64) {
    fill(at, u64::from(NET_HEADER + NET_FRAME), 0);
    let frame = at + u64::from(NET_HEADER);
    for i in 0..6 {
        put8(frame + i, 0xff);
    }
    for (i, byte) in [0x02u8, 0, 0, 0, 0x68, 0x01].iter().enumerate() {
        put8(frame + 6 + i as u64, *byte);
    }
    put8(frame + 12, 0x88);
    put8(frame + 13, 0xb5);
}
