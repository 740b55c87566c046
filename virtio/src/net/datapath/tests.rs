//! One queue pair against a stand-in tap: frames both ways, hostile chains, a full tap,
//! rate limits, and the slicing of chains into I/O vectors.

use std::os::unix::net::UnixDatagram;

use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress, GuestMemory as _, Permissions};

use super::*;
use crate::net::test_util::{
    active_queue, add_chain, descriptor, frame, memory, stand_in_tap, used, DATA, MEMORY_SIZE,
    QUEUE_SIZE,
};
use crate::test_util::{bandwidth_limit, ops_limit};

struct Rig {
    memory: GuestMemory,
    pair: QueuePair,
    peer: UnixDatagram,
    limiter: RateLimiter,
    counters: NetCounters,
    log: LogThrottle,
}

impl Rig {
    fn new(
        rx: &MockSplitQueue<GuestMemory>,
        tx: &MockSplitQueue<GuestMemory>,
        memory: &GuestMemory,
    ) -> Rig {
        let (tap, peer) = stand_in_tap();
        Rig {
            memory: memory.clone(),
            pair: QueuePair::new(tap, 0, Some(active_queue(rx)), Some(active_queue(tx))),
            peer,
            limiter: RateLimiter::unlimited(),
            counters: NetCounters::default(),
            log: LogThrottle::new("test-net"),
        }
    }

    fn rx(&mut self) -> Pass {
        self.pair.process_rx(
            &self.memory,
            &mut self.limiter,
            &self.counters,
            &mut self.log,
        )
    }

    fn tx(&mut self) -> Pass {
        self.pair.process_tx(
            &self.memory,
            &mut self.limiter,
            &self.counters,
            &mut self.log,
        )
    }

    fn peer_frames(&self) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        let mut buf = vec![0u8; 70000];
        while let Ok(n) = self.peer.recv(&mut buf) {
            frames.push(buf[..n].to_vec());
        }
        frames
    }

    /// Sends `frame` to the device as the tap would: header first.
    fn tap_sends(&self, header: [u8; VNET_HDR_LEN], frame: &[u8]) {
        let mut datagram = header.to_vec();
        datagram.extend_from_slice(frame);
        self.peer.send(&datagram).unwrap();
    }
}

fn queues(
    memory: &GuestMemory,
) -> (
    MockSplitQueue<'_, GuestMemory>,
    MockSplitQueue<'_, GuestMemory>,
) {
    (
        MockSplitQueue::create(memory, GuestAddress(0), QUEUE_SIZE),
        MockSplitQueue::create(memory, GuestAddress(0x8000), QUEUE_SIZE),
    )
}

fn put_tx_frame(memory: &GuestMemory, addr: u64, header: [u8; VNET_HDR_LEN], frame: &[u8]) -> u32 {
    memory.write_slice(&header, GuestAddress(addr)).unwrap();
    memory
        .write_slice(frame, GuestAddress(addr + VNET_HDR_LEN as u64))
        .unwrap();
    (VNET_HDR_LEN + frame.len()) as u32
}

#[test]
fn header_layout_is_virtio_net_hdr_v1() {
    assert_eq!(VNET_HDR_LEN, 12);
    assert_eq!(
        (FLAGS_OFFSET, GSO_TYPE_OFFSET, NUM_BUFFERS_OFFSET),
        (0, 1, 10)
    );
}

#[test]
fn tx_writes_header_and_frame_split_over_descriptors() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    let payload = frame(100, 7);
    put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &payload);
    // Header split across two descriptors, the frame across two more.
    add_chain(
        &txq,
        0,
        &[
            descriptor(DATA, 5, false),
            descriptor(DATA + 5, 20, false),
            descriptor(DATA + 25, 50, false),
            descriptor(DATA + 75, 37, false),
        ],
    );
    let mut rig = Rig::new(&rxq, &txq, &memory);
    let pass = rig.tx();
    assert!(pass.used);
    let frames = rig.peer_frames();
    assert_eq!(frames.len(), 1);
    assert_eq!(&frames[0][..VNET_HDR_LEN], &[0; VNET_HDR_LEN]);
    assert_eq!(&frames[0][VNET_HDR_LEN..], &payload[..]);
    assert_eq!(used(&txq), vec![(0, 0)]);
    let stats = rig.counters.snapshot();
    assert_eq!(
        (stats.tx_packets, stats.tx_bytes, stats.tx_dropped),
        (1, 100, 0)
    );
}

#[test]
fn tx_drops_hostile_chains_and_keeps_going() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    let good = frame(60, 1);
    let good_len = put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &good);
    let mut csum_header = [0u8; VNET_HDR_LEN];
    csum_header[FLAGS_OFFSET] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
    let csum_len = put_tx_frame(&memory, DATA + 0x1000, csum_header, &good);
    let mut gso_header = [0u8; VNET_HDR_LEN];
    gso_header[GSO_TYPE_OFFSET] = 1; // VIRTIO_NET_HDR_GSO_TCPV4
    let gso_len = put_tx_frame(&memory, DATA + 0x2000, gso_header, &good);

    // Too short for a header.
    add_chain(&txq, 0, &[descriptor(DATA, 8, false)]);
    // Only writable descriptors: nothing to send.
    add_chain(&txq, 1, &[descriptor(DATA, good_len, true)]);
    // Outside guest memory.
    add_chain(&txq, 2, &[descriptor(MEMORY_SIZE as u64 - 16, 64, false)]);
    // Huge lengths: past the frame bound (and past memory).
    add_chain(&txq, 3, &[descriptor(DATA, u32::MAX, false)]);
    add_chain(
        &txq,
        4,
        &[
            descriptor(DATA, 40000, false),
            descriptor(DATA, 40000, false),
        ],
    );
    // Offloads that were never offered.
    add_chain(&txq, 6, &[descriptor(DATA + 0x1000, csum_len, false)]);
    add_chain(&txq, 7, &[descriptor(DATA + 0x2000, gso_len, false)]);
    // And a good one after all of that.
    add_chain(&txq, 8, &[descriptor(DATA, good_len, false)]);

    let mut rig = Rig::new(&rxq, &txq, &memory);
    rig.tx();
    let frames = rig.peer_frames();
    assert_eq!(frames.len(), 1, "only the good frame goes out");
    assert_eq!(&frames[0][VNET_HDR_LEN..], &good[..]);
    let heads: Vec<u32> = used(&txq).iter().map(|&(head, _)| head).collect();
    assert_eq!(
        heads,
        vec![0, 1, 2, 3, 4, 6, 7, 8],
        "every chain comes back"
    );
    let stats = rig.counters.snapshot();
    assert_eq!(
        (stats.tx_packets, stats.tx_dropped, stats.invalid_chains),
        (1, 7, 7)
    );
}

#[test]
fn tx_waits_for_a_full_tap_and_resends_the_same_chain() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    let payload = frame(1000, 3);
    let len = put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &payload);
    for slot in 0..QUEUE_SIZE {
        add_chain(&txq, slot, &[descriptor(DATA, len, false)]);
    }
    let mut rig = Rig::new(&rxq, &txq, &memory);
    // Shrink the socket buffer so the "tap" fills up quickly.
    let size: libc::c_int = 4096;
    // SAFETY: SO_SNDBUF reads one c_int from the pointer given, which points at one.
    unsafe {
        libc::setsockopt(
            rig.pair.tap.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        );
    }
    rig.tx();
    assert!(rig.pair.tx_waiting_for_tap, "the tap filled up");
    let sent_first = used(&txq).len();
    assert!(sent_first < QUEUE_SIZE as usize);
    assert_eq!(
        rig.counters.snapshot().tx_dropped,
        0,
        "a full tap drops nothing"
    );
    let mut received = rig.peer_frames().len();
    // The tap is writable again: the device carries on where it stopped.
    rig.pair.tx_waiting_for_tap = false;
    while used(&txq).len() < QUEUE_SIZE as usize {
        rig.tx();
        received += rig.peer_frames().len();
        rig.pair.tx_waiting_for_tap = false;
    }
    assert_eq!(received, QUEUE_SIZE as usize, "every frame exactly once");
    assert_eq!(rig.counters.snapshot().tx_packets, QUEUE_SIZE as u64);
}

#[test]
fn rx_reads_a_frame_into_a_chain_and_sets_num_buffers() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    // Header and frame across three writable descriptors, a readable one in front that
    // the device must not write to.
    memory
        .write_slice(&[0xee; 16], GuestAddress(DATA + 0x3000))
        .unwrap();
    add_chain(
        &rxq,
        0,
        &[
            descriptor(DATA + 0x3000, 16, false),
            descriptor(DATA, 6, true),
            descriptor(DATA + 0x100, 40, true),
            descriptor(DATA + 0x200, 2000, true),
        ],
    );
    let mut rig = Rig::new(&rxq, &txq, &memory);
    let payload = frame(300, 9);
    let mut tap_header = [0u8; VNET_HDR_LEN];
    tap_header[FLAGS_OFFSET] = 2; // DATA_VALID: not for a guest without GUEST_CSUM
    rig.tap_sends(tap_header, &payload);
    let pass = rig.rx();
    assert!(pass.used);
    assert_eq!(used(&rxq), vec![(0, (VNET_HDR_LEN + 300) as u32)]);
    let mut header = [0u8; VNET_HDR_LEN];
    memory
        .read_slice(&mut header[..6], GuestAddress(DATA))
        .unwrap();
    memory
        .read_slice(&mut header[6..], GuestAddress(DATA + 0x100))
        .unwrap();
    let mut expected = [0u8; VNET_HDR_LEN];
    expected[NUM_BUFFERS_OFFSET] = 1;
    assert_eq!(header, expected);
    let mut got = vec![0u8; 300];
    memory
        .read_slice(&mut got[..34], GuestAddress(DATA + 0x106))
        .unwrap();
    memory
        .read_slice(&mut got[34..], GuestAddress(DATA + 0x200))
        .unwrap();
    assert_eq!(got, payload);
    let mut untouched = [0u8; 16];
    memory
        .read_slice(&mut untouched, GuestAddress(DATA + 0x3000))
        .unwrap();
    assert_eq!(untouched, [0xee; 16]);
    let stats = rig.counters.snapshot();
    assert_eq!((stats.rx_packets, stats.rx_bytes), (1, 300));
    // The only chain is used: the tap is not read until the driver adds buffers.
    assert!(!rig.pair.rx_has_buffers);
}

#[test]
fn rx_drops_frames_too_big_for_the_chain_and_reuses_it() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    add_chain(&rxq, 0, &[descriptor(DATA, 200, true)]);
    let mut rig = Rig::new(&rxq, &txq, &memory);
    rig.tap_sends([0; VNET_HDR_LEN], &frame(1000, 1));
    rig.tap_sends([0; VNET_HDR_LEN], &frame(200 - VNET_HDR_LEN + 1, 2));
    rig.tap_sends([0; VNET_HDR_LEN], &frame(200 - VNET_HDR_LEN, 3));
    rig.rx();
    assert_eq!(
        used(&rxq),
        vec![(0, 200)],
        "the exact fit lands in the chain"
    );
    let mut got = vec![0u8; 200 - VNET_HDR_LEN];
    memory
        .read_slice(&mut got, GuestAddress(DATA + VNET_HDR_LEN as u64))
        .unwrap();
    assert_eq!(got, frame(200 - VNET_HDR_LEN, 3));
    let stats = rig.counters.snapshot();
    assert_eq!((stats.rx_packets, stats.rx_dropped), (1, 2));
}

#[test]
fn rx_returns_chains_that_cannot_hold_a_frame() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    // Readable only, too short, outside memory, huge: none can take a frame.
    add_chain(&rxq, 0, &[descriptor(DATA, 2000, false)]);
    add_chain(&rxq, 1, &[descriptor(DATA, 10, true)]);
    add_chain(&rxq, 2, &[descriptor(MEMORY_SIZE as u64 - 8, 2000, true)]);
    add_chain(&rxq, 3, &[descriptor(u64::MAX - 100, u32::MAX, true)]);
    // A huge descriptor inside memory is fine: the device uses what a frame needs.
    add_chain(
        &rxq,
        4,
        &[descriptor(0x1000, (MEMORY_SIZE - 0x1000) as u32, true)],
    );
    let mut rig = Rig::new(&rxq, &txq, &memory);
    rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 5));
    rig.rx();
    assert_eq!(
        used(&rxq),
        vec![
            (0, 0),
            (1, 0),
            (2, 0),
            (3, 0),
            (4, (VNET_HDR_LEN + 64) as u32)
        ]
    );
    let stats = rig.counters.snapshot();
    assert_eq!((stats.invalid_chains, stats.rx_packets), (4, 1));
}

#[test]
fn rx_stops_watching_the_tap_when_the_queue_is_empty() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
    let mut rig = Rig::new(&rxq, &txq, &memory);
    rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 1));
    rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 2));
    rig.rx();
    assert_eq!(used(&rxq).len(), 1);
    assert!(!rig.pair.rx_has_buffers);
    assert!(
        !rig.pair.wants_rx(&rig.limiter),
        "no buffers: the tap is not watched"
    );
    // The second frame waits in the tap for a buffer.
    add_chain(&rxq, 1, &[descriptor(DATA + 0x1000, 2000, true)]);
    rig.pair.rx_has_buffers = true; // what an RX kick does
    assert!(rig.pair.wants_rx(&rig.limiter));
    rig.rx();
    assert_eq!(used(&rxq).len(), 2);
    let mut got = vec![0u8; 64];
    memory
        .read_slice(&mut got, GuestAddress(DATA + 0x1000 + VNET_HDR_LEN as u64))
        .unwrap();
    assert_eq!(got, frame(64, 2));
}

#[test]
fn rx_drops_frames_with_offloads_from_the_tap() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
    let mut rig = Rig::new(&rxq, &txq, &memory);
    let mut header = [0u8; VNET_HDR_LEN];
    header[GSO_TYPE_OFFSET] = 1;
    rig.tap_sends(header, &frame(64, 1));
    rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 2));
    rig.rx();
    assert_eq!(used(&rxq).len(), 1);
    assert_eq!(rig.counters.snapshot().rx_dropped, 1);
}

#[test]
fn rate_limited_rx_holds_the_frame_until_tokens_come() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
    add_chain(&rxq, 1, &[descriptor(DATA + 0x1000, 2000, true)]);
    let mut rig = Rig::new(&rxq, &txq, &memory);
    rig.limiter = RateLimiter::new(ops_limit(1, 50)).unwrap();
    rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 1));
    rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 2));
    rig.rx();
    assert_eq!(used(&rxq).len(), 1, "one token, one frame");
    assert!(
        rig.pair.held.is_some(),
        "the second frame waits in its chain"
    );
    assert!(!rig.pair.wants_rx(&rig.limiter));
    rig.rx();
    assert_eq!(used(&rxq).len(), 1, "still blocked");
    // Wait for the timer as the worker would.
    let mut poll = libc::pollfd {
        fd: rig.limiter.timer_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd given.
    assert_eq!(unsafe { libc::poll(&mut poll, 1, 2000) }, 1);
    rig.limiter.on_timer();
    rig.rx();
    assert_eq!(used(&rxq).len(), 2);
    assert!(rig.pair.held.is_none());
    assert_eq!(rig.counters.snapshot().rx_packets, 2);
}

#[test]
fn rate_limited_tx_leaves_the_chain_in_the_queue() {
    let memory = memory();
    let (rxq, txq) = queues(&memory);
    let len = put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &frame(100, 1));
    add_chain(&txq, 0, &[descriptor(DATA, len, false)]);
    add_chain(&txq, 1, &[descriptor(DATA, len, false)]);
    let mut rig = Rig::new(&rxq, &txq, &memory);
    rig.limiter = RateLimiter::new(bandwidth_limit(150, 20)).unwrap();
    rig.tx();
    assert_eq!(used(&txq).len(), 1);
    assert!(rig.limiter.is_blocked());
    assert_eq!(
        rig.pair.tx.as_ref().unwrap().queue.next_avail(),
        1,
        "the second chain is not taken"
    );
    std::thread::sleep(Duration::from_millis(40));
    rig.limiter.on_timer();
    rig.tx();
    assert_eq!(used(&txq).len(), 2);
    assert_eq!(rig.peer_frames().len(), 2);
}

#[test]
fn split_slices_splits_inside_a_slice() {
    let memory = memory();
    let slices: Slices = memory
        .get_slices(GuestAddress(DATA), 30, Permissions::Read)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let (head, tail) = split_slices(slices, 12);
    assert_eq!(head.iter().map(|s| s.len()).sum::<usize>(), 12);
    assert_eq!(tail.iter().map(|s| s.len()).sum::<usize>(), 18);
}

#[test]
fn chain_slices_refuses_too_many_pieces() {
    let memory = memory();
    let mock = MockSplitQueue::create(&memory, GuestAddress(0), 16);
    // An indirect table of 2000 one-byte descriptors.
    let table = GuestAddress(0x18_0000);
    for i in 0..2000u64 {
        let next = (i + 1) as u16;
        let flags = if i + 1 < 2000 {
            virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16
        } else {
            0
        };
        let d = RawDescriptor::from(SplitDescriptor::new(DATA + i, 1, flags, next));
        memory.write_obj(d, table.unchecked_add(i * 16)).unwrap();
    }
    use vm_memory::Address;
    let head = RawDescriptor::from(SplitDescriptor::new(
        table.0,
        2000 * 16,
        virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16,
        0,
    ));
    mock.add_desc_chains(&[head], 0).unwrap();
    let mut queue: Queue = mock.create_queue().unwrap();
    let chain = queue.pop_descriptor_chain(&memory).unwrap();
    assert_eq!(
        chain_slices(&memory, chain.clone(), false, MAX_FRAME_LEN, false).err(),
        Some(ChainError::TooFragmented)
    );
    let (slices, total) = chain_slices(&memory, chain, false, MAX_FRAME_LEN, true).unwrap();
    assert_eq!((slices.len(), total), (MAX_GUEST_PIECES, MAX_GUEST_PIECES));
}
