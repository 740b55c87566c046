//! Helpers the net tests share: guest memory with mock queues in it, chains the way a driver
//! posts them, and taps that are one end of a socket pair.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::Tap;
use crate::device::ActiveQueue;
use crate::GuestMemory;

pub const MEMORY_SIZE: usize = 0x20_0000;
pub const QUEUE_SIZE: u16 = 16;
pub const DATA: u64 = 0x10_0000;

pub fn memory() -> GuestMemory {
    crate::test_util::memory(MEMORY_SIZE)
}

pub fn descriptor(addr: u64, len: u32, writable: bool) -> RawDescriptor {
    let flags = if writable {
        VRING_DESC_F_WRITE as u16
    } else {
        0
    };
    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
}

/// Puts one chain made of `descriptors` in the avail ring, at descriptor table slot `at`.
pub fn add_chain(mock: &MockSplitQueue<GuestMemory>, at: u16, descriptors: &[RawDescriptor]) {
    let linked: Vec<RawDescriptor> = descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let d = SplitDescriptor::from(*d);
            let last = i + 1 == descriptors.len();
            let flags = if last {
                d.flags() & !(VRING_DESC_F_NEXT as u16)
            } else {
                d.flags() | VRING_DESC_F_NEXT as u16
            };
            RawDescriptor::from(SplitDescriptor::new(
                d.addr().0,
                d.len(),
                flags,
                at + i as u16 + 1,
            ))
        })
        .collect();
    mock.add_desc_chains(&linked, at).unwrap();
}

pub fn active_queue(mock: &MockSplitQueue<GuestMemory>) -> ActiveQueue {
    ActiveQueue {
        queue: mock.create_queue::<Queue>().unwrap(),
        kick: EventFd::new(EFD_NONBLOCK).unwrap(),
    }
}

/// (used ring index, (chain head, length)) entries so far.
pub fn used(mock: &MockSplitQueue<GuestMemory>) -> Vec<(u32, u32)> {
    let count = mock.used().idx().load();
    (0..count)
        .map(|i| {
            let element = mock.used().ring().ref_at(i as usize).unwrap().load();
            (element.id(), element.len())
        })
        .collect()
}

pub fn frame(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add(i as u8)).collect()
}

/// A tap whose other end (non-blocking) stands in for the host's network.
pub fn stand_in_tap() -> (Tap, UnixDatagram) {
    let (ours, peer) = UnixDatagram::pair().unwrap();
    peer.set_nonblocking(true).unwrap();
    (Tap::stand_in(OwnedFd::from(ours)), peer)
}

/// `count` of [`stand_in_tap`].
pub fn stand_in_taps(count: usize) -> (Vec<Tap>, Vec<UnixDatagram>) {
    (0..count).map(|_| stand_in_tap()).unzip()
}
