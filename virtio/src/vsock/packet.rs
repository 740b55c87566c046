//! The virtio-vsock wire vocabulary (virtio 1.2, 5.10.6) and how gpuvm stamps the headers
//! of the packets it sends the guest.
//!
//! Parsing a guest's packet and finding its header and data buffers is
//! [`virtio_vsock::packet::VsockPacket`]'s job (`from_tx_virtq_chain` / `from_rx_virtq_chain`);
//! virtio-bindings 0.2 has no vsock constants, so the spec's numbers live here.

use virtio_vsock::packet::{VsockPacket, PKT_HEADER_SIZE};
use vm_memory::bitmap::BitmapSlice;

/// The host's address, the only destination a guest packet may name.
pub const VSOCK_HOST_CID: u64 = 2;
/// Stream sockets, the only socket type the device offers.
pub const VSOCK_TYPE_STREAM: u16 = 1;

/// Connection request.
pub const VSOCK_OP_REQUEST: u16 = 1;
/// Connection accepted.
pub const VSOCK_OP_RESPONSE: u16 = 2;
/// Connection refused or torn down.
pub const VSOCK_OP_RST: u16 = 3;
/// The sender will receive and/or send no more (see the flags).
pub const VSOCK_OP_SHUTDOWN: u16 = 4;
/// Stream data.
pub const VSOCK_OP_RW: u16 = 5;
/// The sender's buffer space (buf_alloc, fwd_cnt), unprompted or in answer to a request.
pub const VSOCK_OP_CREDIT_UPDATE: u16 = 6;
/// Asks the peer for a credit update.
pub const VSOCK_OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flag: the sender will receive no more data.
pub const VSOCK_FLAGS_SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const VSOCK_FLAGS_SHUTDOWN_SEND: u32 = 2;

/// The event-queue event telling the driver that every connection is gone (after a
/// snapshot restore); the driver re-reads guest_cid and resets its sockets.
pub const VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;

/// The largest payload the device accepts from the guest or puts in one rx buffer (Linux's
/// VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PKT_DATA: u32 = 64 * 1024;

/// Who a packet to the guest is from and for: the host's port and the guest's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnKey {
    /// The host-side port (`src_port` of packets to the guest, `dst_port` of the guest's).
    pub local_port: u32,
    /// The guest-side port.
    pub peer_port: u32,
}

/// The header fields of a packet the device sends the guest, besides the addresses.
#[derive(Clone, Copy, Debug)]
pub struct Reply {
    pub op: u16,
    pub flags: u32,
    pub len: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Reply {
    /// A packet without data or credit information (RST for an unknown connection).
    pub fn bare(op: u16) -> Self {
        Reply {
            op,
            flags: 0,
            len: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        }
    }
}

/// Writes a complete header for a packet from the host to `guest_cid` into an rx buffer
/// (every field, so nothing the guest left in the buffer survives).
pub fn write_header<B: BitmapSlice>(
    packet: &mut VsockPacket<'_, B>,
    guest_cid: u64,
    key: ConnKey,
    reply: Reply,
) -> Result<(), virtio_vsock::packet::Error> {
    packet.set_header_from_raw(&[0u8; PKT_HEADER_SIZE])?;
    packet
        .set_src_cid(VSOCK_HOST_CID)
        .set_dst_cid(guest_cid)
        .set_src_port(key.local_port)
        .set_dst_port(key.peer_port)
        .set_type(VSOCK_TYPE_STREAM)
        .set_op(reply.op)
        .set_flags(reply.flags)
        .set_len(reply.len)
        .set_buf_alloc(reply.buf_alloc)
        .set_fwd_cnt(reply.fwd_cnt);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_header_overwrites_every_field() {
        let mut header = [0xffu8; PKT_HEADER_SIZE];
        // SAFETY: `header` outlives the packet and is only accessed through it meanwhile.
        let mut packet = unsafe { VsockPacket::new(&mut header, None) }.unwrap();
        let key = ConnKey {
            local_port: 1 << 30,
            peer_port: 1024,
        };
        let reply = Reply {
            op: VSOCK_OP_RW,
            flags: 0,
            len: 17,
            buf_alloc: 4096,
            fwd_cnt: 9,
        };
        write_header(&mut packet, 3, key, reply).unwrap();
        assert_eq!(packet.src_cid(), VSOCK_HOST_CID);
        assert_eq!(packet.dst_cid(), 3);
        assert_eq!(packet.src_port(), 1 << 30);
        assert_eq!(packet.dst_port(), 1024);
        assert_eq!(packet.type_(), VSOCK_TYPE_STREAM);
        assert_eq!(packet.op(), VSOCK_OP_RW);
        assert_eq!(packet.flags(), 0);
        assert_eq!(packet.len(), 17);
        assert_eq!(packet.buf_alloc(), 4096);
        assert_eq!(packet.fwd_cnt(), 9);
        // The little-endian layout the guest reads: src_cid first, fwd_cnt last.
        assert_eq!(&header[..8], &2u64.to_le_bytes());
        assert_eq!(&header[40..44], &9u32.to_le_bytes());
    }
}
