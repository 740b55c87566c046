//! The device end to end without a guest: the test plays the driver over virtio-queue's
//! mock split queues in real guest memory, and plays host programs over real Unix sockets.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use virtio_vsock::packet::{VsockPacket, PKT_HEADER_SIZE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::packet::*;
use super::*;
use crate::{Activation, ActiveQueue, VirtioDevice, VirtioInterrupt};

const GUEST_CID: u64 = 3;
const QUEUE_SIZE: u16 = 256;
/// Two descriptors per chain.
const CHAINS: u16 = QUEUE_SIZE / 2;
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;
const RING_BASES: [u64; 3] = [0x0, 0x1_0000, 0x2_0000];
const BUFFER_BASES: [u64; 3] = [0x10_0000, 0x98_0000, 0x120_0000];
/// Each chain's buffers: the header at the slot's start, data from DATA_OFFSET.
const SLOT: u64 = 0x1_1000;
const DATA_OFFSET: u64 = 0x1000;
const MEMORY_SIZE: usize = 0x130_0000;
const WAIT: Duration = Duration::from_secs(5);
/// The guest's receive buffer in these tests.
const GUEST_BUF_ALLOC: u32 = 64 * 1024;

#[derive(Default)]
struct RecordingInterrupt {
    queues: [AtomicU32; 3],
}

impl VirtioInterrupt for RecordingInterrupt {
    fn signal_queue(&self, queue_index: u16) -> std::io::Result<()> {
        self.queues[usize::from(queue_index)].fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn signal_config(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A vsock header, encoded and decoded through `VsockPacket`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Hdr {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    type_: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

impl Hdr {
    /// A packet from the guest's `src_port` to host port `dst_port`.
    fn from_guest(src_port: u32, dst_port: u32, op: u16) -> Self {
        Hdr {
            src_cid: GUEST_CID,
            dst_cid: VSOCK_HOST_CID,
            src_port,
            dst_port,
            len: 0,
            type_: VSOCK_TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: GUEST_BUF_ALLOC,
            fwd_cnt: 0,
        }
    }

    fn to_bytes(self) -> [u8; PKT_HEADER_SIZE] {
        let mut bytes = [0u8; PKT_HEADER_SIZE];
        // SAFETY: `bytes` outlives the packet and is only accessed through it meanwhile.
        let mut packet = unsafe { VsockPacket::new(&mut bytes, None) }.unwrap();
        packet
            .set_src_cid(self.src_cid)
            .set_dst_cid(self.dst_cid)
            .set_src_port(self.src_port)
            .set_dst_port(self.dst_port)
            .set_len(self.len)
            .set_type(self.type_)
            .set_op(self.op)
            .set_flags(self.flags)
            .set_buf_alloc(self.buf_alloc)
            .set_fwd_cnt(self.fwd_cnt);
        bytes
    }

    fn from_bytes(raw: [u8; PKT_HEADER_SIZE]) -> Self {
        let mut bytes = [0u8; PKT_HEADER_SIZE];
        // SAFETY: `bytes` outlives the packet and is only accessed through it meanwhile.
        let mut packet = unsafe { VsockPacket::new(&mut bytes, None) }.unwrap();
        packet.set_header_from_raw(&raw).unwrap();
        Hdr {
            src_cid: packet.src_cid(),
            dst_cid: packet.dst_cid(),
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            len: packet.len(),
            type_: packet.type_(),
            op: packet.op(),
            flags: packet.flags(),
            buf_alloc: packet.buf_alloc(),
            fwd_cnt: packet.fwd_cnt(),
        }
    }
}

/// A packet the device put in an rx buffer.
struct RxPacket {
    hdr: Hdr,
    data: Vec<u8>,
}

impl std::fmt::Debug for RxPacket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} with {} bytes", self.hdr, self.data.len())
    }
}

/// One descriptor of a test chain.
#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    writable: bool,
}

/// The test's driver: the queues' rings and buffers in guest memory, and their kicks.
fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEMORY_SIZE)]).expect("guest memory")
}

struct TestGuest<'m> {
    memory: &'m GuestMemoryMmap,
    /// The rings as the driver sees them (made once: making one zeroes its rings).
    rings: Vec<MockSplitQueue<'m, GuestMemoryMmap>>,
    interrupt: Arc<RecordingInterrupt>,
    kicks: Vec<EventFd>,
    next_chain: [u16; 3],
    used_seen: [u16; 3],
    /// Packets taken from the used ring and not yet looked at.
    received: std::collections::VecDeque<RxPacket>,
}

impl<'m> TestGuest<'m> {
    /// Activates `device` with three fresh queues in `memory`.
    fn activate(device: &mut Vsock, memory: &'m GuestMemoryMmap) -> Self {
        Self::try_activate(device, memory).expect("activate")
    }

    /// As [`TestGuest::activate`], returning the device's refusal.
    fn try_activate(
        device: &mut Vsock,
        memory: &'m GuestMemoryMmap,
    ) -> Result<Self, crate::ActivateError> {
        let interrupt = Arc::new(RecordingInterrupt::default());
        let mut rings = Vec::new();
        let mut queues = Vec::new();
        let mut kicks = Vec::new();
        for base in RING_BASES {
            let mock = MockSplitQueue::create(memory, GuestAddress(base), QUEUE_SIZE);
            let queue: Queue = mock.create_queue().unwrap();
            let kick = EventFd::new(EFD_NONBLOCK).unwrap();
            kicks.push(kick.try_clone().unwrap());
            queues.push(Some(ActiveQueue { queue, kick }));
            rings.push(mock);
        }
        device.activate(Activation {
            memory: memory.clone(),
            acked_features: 0,
            queues,
            interrupt: interrupt.clone(),
        })?;
        Ok(TestGuest {
            memory,
            rings,
            interrupt,
            kicks,
            next_chain: [0; 3],
            used_seen: [0; 3],
            received: std::collections::VecDeque::new(),
        })
    }

    fn mock(&self, queue: usize) -> &MockSplitQueue<'m, GuestMemoryMmap> {
        &self.rings[queue]
    }

    fn slot(queue: usize, chain: u16) -> u64 {
        BUFFER_BASES[queue] + u64::from(chain) * SLOT
    }

    /// Makes a chain of one or two descriptors available (without a kick); returns its
    /// chain number.
    fn push_chain(&mut self, queue: usize, descs: &[Desc]) -> u16 {
        assert!(!descs.is_empty() && descs.len() <= 2);
        let chain = self.next_chain[queue] % CHAINS;
        self.next_chain[queue] = self.next_chain[queue].wrapping_add(1);
        let head = chain * 2;
        let mock = self.mock(queue);
        for (index, desc) in descs.iter().enumerate() {
            let mut flags = if desc.writable {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
            if index + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let raw = RawDescriptor::from(SplitDescriptor::new(
                desc.addr,
                desc.len,
                flags,
                head + index as u16 + 1,
            ));
            mock.desc_table().store(head + index as u16, raw).unwrap();
        }
        let avail_idx = mock.avail().idx().load();
        mock.avail()
            .ring()
            .ref_at(usize::from(avail_idx % QUEUE_SIZE))
            .unwrap()
            .store(head);
        mock.avail().idx().store(avail_idx.wrapping_add(1));
        chain
    }

    fn kick(&self, queue: usize) {
        self.kicks[queue].write(1).unwrap();
    }

    /// Gives the device `count` rx buffers of a header and `data_len` bytes.
    fn give_rx_buffers(&mut self, count: usize, data_len: u32) {
        for _ in 0..count {
            let chain = self.next_chain[RX] % CHAINS;
            let slot = Self::slot(RX, chain);
            self.push_chain(
                RX,
                &[
                    Desc {
                        addr: slot,
                        len: PKT_HEADER_SIZE as u32,
                        writable: true,
                    },
                    Desc {
                        addr: slot + DATA_OFFSET,
                        len: data_len,
                        writable: true,
                    },
                ],
            );
        }
        self.kick(RX);
    }

    /// Sends a packet on the tx queue (the header's len is the data's).
    fn send(&mut self, mut hdr: Hdr, data: &[u8]) {
        hdr.len = data.len() as u32;
        self.send_raw(hdr, data);
    }

    /// Sends a header as it is (its len may lie) with `data` in a second descriptor.
    fn send_raw(&mut self, hdr: Hdr, data: &[u8]) {
        let chain = self.next_chain[TX] % CHAINS;
        let slot = Self::slot(TX, chain);
        self.memory
            .write_slice(&hdr.to_bytes(), GuestAddress(slot))
            .unwrap();
        let mut descs = vec![Desc {
            addr: slot,
            len: PKT_HEADER_SIZE as u32,
            writable: false,
        }];
        if !data.is_empty() {
            self.memory
                .write_slice(data, GuestAddress(slot + DATA_OFFSET))
                .unwrap();
            descs.push(Desc {
                addr: slot + DATA_OFFSET,
                len: data.len() as u32,
                writable: false,
            });
        }
        self.push_chain(TX, &descs);
        self.kick(TX);
    }

    /// Used-ring entries (head, len) of `queue` that appeared since the last call.
    fn take_used(&mut self, queue: usize) -> Vec<(u32, u32)> {
        let mock = &self.rings[queue];
        let used_idx = mock.used().idx().load();
        let mut entries = Vec::new();
        let mut seen = self.used_seen[queue];
        while seen != used_idx {
            let slot = usize::from(seen % QUEUE_SIZE);
            let element = mock.used().ring().ref_at(slot).unwrap().load();
            entries.push((element.id(), element.len()));
            seen = seen.wrapping_add(1);
        }
        self.used_seen[queue] = seen;
        entries
    }

    /// Waits until the device returned `count` tx buffers (all packets so far handled).
    fn wait_tx_used(&mut self, count: usize) {
        let deadline = Instant::now() + WAIT;
        let mut seen = 0;
        while seen < count {
            seen += self.take_used(TX).len();
            assert!(Instant::now() < deadline, "tx buffers not returned");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn read_rx(&self, (head, len): (u32, u32)) -> RxPacket {
        let chain = u16::try_from(head / 2).unwrap();
        let slot = Self::slot(RX, chain);
        let mut raw = [0u8; PKT_HEADER_SIZE];
        self.memory
            .read_slice(&mut raw, GuestAddress(slot))
            .unwrap();
        let hdr = Hdr::from_bytes(raw);
        assert_eq!(
            len,
            PKT_HEADER_SIZE as u32 + hdr.len,
            "used length is header plus data"
        );
        let mut data = vec![0u8; hdr.len as usize];
        self.memory
            .read_slice(&mut data, GuestAddress(slot + DATA_OFFSET))
            .unwrap();
        RxPacket { hdr, data }
    }

    /// Moves what the device put in the used ring to `received`.
    fn collect_rx(&mut self) {
        for entry in self.take_used(RX) {
            let packet = self.read_rx(entry);
            self.received.push_back(packet);
        }
    }

    /// The next `count` packets for the guest (panics after [`WAIT`]).
    fn recv(&mut self, count: usize) -> Vec<RxPacket> {
        let deadline = Instant::now() + WAIT;
        loop {
            self.collect_rx();
            if self.received.len() >= count {
                return self.received.drain(..count).collect();
            }
            assert!(
                Instant::now() < deadline,
                "waited for {count} rx packets, got {:?}",
                self.received
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn recv_one(&mut self) -> RxPacket {
        self.recv(1).pop().unwrap()
    }

    /// Whatever packets arrive within `wait`.
    fn recv_for(&mut self, wait: Duration) -> Vec<RxPacket> {
        std::thread::sleep(wait);
        self.collect_rx();
        self.received.drain(..).collect()
    }

    /// RW data from the device until `total` bytes arrived, checking each header.
    fn recv_data(&mut self, key: ConnKey, total: usize) -> Vec<u8> {
        let mut data = Vec::new();
        while data.len() < total {
            let packet = self.recv_one();
            assert_eq!(packet.hdr.op, VSOCK_OP_RW, "{packet:?}");
            assert_eq!(packet.hdr.src_port, key.local_port);
            assert_eq!(packet.hdr.dst_port, key.peer_port);
            assert_eq!(packet.hdr.buf_alloc, BUF_ALLOC);
            data.extend_from_slice(&packet.data);
        }
        assert_eq!(data.len(), total, "no more than was written");
        data
    }
}

/// A device on a fresh socket path (the device removes it when dropped).
fn new_device(tag: &str) -> (Vsock, PathBuf) {
    let uds_path = temp_socket_path(tag);
    let config = VsockConfig {
        vsock_id: Some(tag.to_string()),
        guest_cid: GUEST_CID,
        uds_path: uds_path.clone(),
    };
    (Vsock::new(&config).expect("vsock device"), uds_path)
}

/// A host program's listener for guest connections, removed when dropped.
struct PortListener {
    listener: UnixListener,
    path: PathBuf,
}

impl PortListener {
    fn bind(uds_path: &Path, port: u32) -> Self {
        let path = super::unix::guest_port_path(uds_path, port);
        PortListener {
            listener: UnixListener::bind(&path).unwrap(),
            path,
        }
    }

    fn accept(&self) -> UnixStream {
        let (stream, _) = self.listener.accept().unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        stream
    }
}

impl Drop for PortListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn connect_client(uds_path: &Path, line: &[u8]) -> UnixStream {
    let mut client = UnixStream::connect(uds_path).unwrap();
    client.set_read_timeout(Some(WAIT)).unwrap();
    client.write_all(line).unwrap();
    client
}

fn read_line(client: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        assert_eq!(client.read(&mut byte).unwrap(), 1, "EOF before a line");
        line.push(byte[0]);
    }
    String::from_utf8(line).unwrap()
}

/// Whether the device closed `client` (EOF or reset) within [`WAIT`].
fn closed_by_device(client: &mut UnixStream) -> bool {
    let mut buffer = [0u8; 64];
    match client.read(&mut buffer) {
        Ok(0) => true,
        Ok(_) => false,
        Err(error) => error.kind() == ErrorKind::ConnectionReset,
    }
}

/// A host client connects to guest port `guest_port` and the guest accepts; returns the
/// client (its `OK` line read) and the connection's ports.
fn host_connect(
    guest: &mut TestGuest<'_>,
    uds_path: &Path,
    guest_port: u32,
) -> (UnixStream, ConnKey) {
    let mut client = connect_client(uds_path, format!("CONNECT {guest_port}\n").as_bytes());
    let request = guest.recv_one();
    assert_eq!(request.hdr.op, VSOCK_OP_REQUEST, "{request:?}");
    assert_eq!(request.hdr.dst_port, guest_port);
    let key = ConnKey {
        local_port: request.hdr.src_port,
        peer_port: guest_port,
    };
    guest.send(
        Hdr::from_guest(guest_port, key.local_port, VSOCK_OP_RESPONSE),
        &[],
    );
    assert_eq!(read_line(&mut client), format!("OK {}\n", key.local_port));
    (client, key)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn host_initiated_connect_then_data_both_ways_with_credit() {
    let (mut device, uds_path) = new_device("host-connect");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(16, 4096);

    let mut client = connect_client(&uds_path, b"CONNECT 1024\n");
    let request = guest.recv_one();
    assert_eq!(
        request.hdr,
        Hdr {
            src_cid: VSOCK_HOST_CID,
            dst_cid: GUEST_CID,
            src_port: FIRST_HOST_PORT,
            dst_port: 1024,
            len: 0,
            type_: VSOCK_TYPE_STREAM,
            op: VSOCK_OP_REQUEST,
            flags: 0,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: 0,
        }
    );
    assert!(guest.interrupt.queues[RX].load(Ordering::SeqCst) > 0);
    let key = ConnKey {
        local_port: FIRST_HOST_PORT,
        peer_port: 1024,
    };
    guest.send(
        Hdr::from_guest(1024, FIRST_HOST_PORT, VSOCK_OP_RESPONSE),
        &[],
    );
    assert_eq!(read_line(&mut client), format!("OK {FIRST_HOST_PORT}\n"));

    // Host → guest: 10000 bytes in 4096-byte buffers.
    let to_guest = pattern(10_000, 1);
    client.write_all(&to_guest).unwrap();
    guest.give_rx_buffers(8, 4096);
    assert_eq!(guest.recv_data(key, to_guest.len()), to_guest);

    // Guest → host: the OK line is not counted, the data is.
    let to_host = pattern(5000, 2);
    guest.send(
        Hdr::from_guest(1024, FIRST_HOST_PORT, VSOCK_OP_RW),
        &to_host,
    );
    let mut received = vec![0u8; to_host.len()];
    client.read_exact(&mut received).unwrap();
    assert_eq!(received, to_host);
    assert!(guest.interrupt.queues[TX].load(Ordering::SeqCst) > 0);

    let mut request = Hdr::from_guest(1024, FIRST_HOST_PORT, VSOCK_OP_CREDIT_REQUEST);
    request.fwd_cnt = to_guest.len() as u32;
    guest.send(request, &[]);
    let update = guest.recv_one();
    assert_eq!(update.hdr.op, VSOCK_OP_CREDIT_UPDATE);
    assert_eq!(update.hdr.fwd_cnt, 5000, "every byte the host took");
    assert_eq!(update.hdr.buf_alloc, BUF_ALLOC);
    assert!(guest.recv_for(Duration::from_millis(50)).is_empty());
}

#[test]
fn guest_initiated_connect_data_and_host_close() {
    let (mut device, uds_path) = new_device("guest-connect");
    let port_listener = PortListener::bind(&uds_path, 5000);
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(16, 4096);

    guest.send(Hdr::from_guest(40000, 5000, VSOCK_OP_REQUEST), &[]);
    let response = guest.recv_one();
    assert_eq!(response.hdr.op, VSOCK_OP_RESPONSE);
    assert_eq!(response.hdr.src_port, 5000);
    assert_eq!(response.hdr.dst_port, 40000);
    assert_eq!(response.hdr.dst_cid, GUEST_CID);
    let mut host = port_listener.accept();
    let key = ConnKey {
        local_port: 5000,
        peer_port: 40000,
    };

    let to_host = pattern(3000, 3);
    guest.send(Hdr::from_guest(40000, 5000, VSOCK_OP_RW), &to_host);
    let mut received = vec![0u8; to_host.len()];
    host.read_exact(&mut received).unwrap();
    assert_eq!(received, to_host);

    let to_guest = pattern(6000, 4);
    host.write_all(&to_guest).unwrap();
    assert_eq!(guest.recv_data(key, to_guest.len()), to_guest);

    // The host program closes: SHUTDOWN (both directions), and the guest's RST ends it.
    drop(host);
    let shutdown = guest.recv_one();
    assert_eq!(shutdown.hdr.op, VSOCK_OP_SHUTDOWN, "{shutdown:?}");
    assert_eq!(
        shutdown.hdr.flags,
        VSOCK_FLAGS_SHUTDOWN_RCV | VSOCK_FLAGS_SHUTDOWN_SEND
    );
    assert_eq!(
        (shutdown.hdr.src_port, shutdown.hdr.dst_port),
        (5000, 40000)
    );
    assert_eq!(shutdown.hdr.fwd_cnt, 3000);
    guest.send(Hdr::from_guest(40000, 5000, VSOCK_OP_RST), &[]);
    guest.wait_tx_used(3);
    // The connection is gone: data for it is answered with RST.
    guest.send(Hdr::from_guest(40000, 5000, VSOCK_OP_RW), b"late");
    let rst = guest.recv_one();
    assert_eq!(rst.hdr.op, VSOCK_OP_RST);
    assert_eq!((rst.hdr.src_port, rst.hdr.dst_port), (5000, 40000));
}

#[test]
fn host_close_without_guest_answer_ends_with_rst() {
    let (mut device, uds_path) = new_device("host-close-timeout");
    let port_listener = PortListener::bind(&uds_path, 5002);
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(8, 4096);
    guest.send(Hdr::from_guest(40002, 5002, VSOCK_OP_REQUEST), &[]);
    assert_eq!(guest.recv_one().hdr.op, VSOCK_OP_RESPONSE);
    drop(port_listener.accept());
    let started = Instant::now();
    assert_eq!(guest.recv_one().hdr.op, VSOCK_OP_SHUTDOWN);
    let rst = guest.recv_one();
    assert_eq!(rst.hdr.op, VSOCK_OP_RST);
    assert!(started.elapsed() >= SHUTDOWN_TIMEOUT - Duration::from_millis(100));
}

#[test]
fn guest_connect_without_host_listener_is_refused() {
    let (mut device, _uds_path) = new_device("guest-refused");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(4, 4096);
    guest.send(Hdr::from_guest(40001, 5001, VSOCK_OP_REQUEST), &[]);
    let rst = guest.recv_one();
    assert_eq!(rst.hdr.op, VSOCK_OP_RST);
    assert_eq!((rst.hdr.src_port, rst.hdr.dst_port), (5001, 40001));
    assert_eq!(
        (rst.hdr.src_cid, rst.hdr.dst_cid),
        (VSOCK_HOST_CID, GUEST_CID)
    );
}

#[test]
fn guest_refusal_and_silence_close_the_host_client() {
    let (mut device, uds_path) = new_device("guest-refuses");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(8, 4096);

    let mut refused = connect_client(&uds_path, b"CONNECT 1025\n");
    let request = guest.recv_one();
    assert_eq!(request.hdr.op, VSOCK_OP_REQUEST);
    guest.send(
        Hdr::from_guest(1025, request.hdr.src_port, VSOCK_OP_RST),
        &[],
    );
    assert!(closed_by_device(&mut refused));

    // No answer at all: closed after the timeout, and the guest hears RST.
    let started = Instant::now();
    let mut ignored = connect_client(&uds_path, b"CONNECT 1026\n");
    let request = guest.recv_one();
    assert_eq!(request.hdr.op, VSOCK_OP_REQUEST);
    assert_ne!(request.hdr.src_port, 0);
    assert!(closed_by_device(&mut ignored));
    assert!(started.elapsed() >= CONNECT_TIMEOUT - Duration::from_millis(100));
    let rst = guest.recv_one();
    assert_eq!(rst.hdr.op, VSOCK_OP_RST);
    assert_eq!(rst.hdr.src_port, request.hdr.src_port);
    assert_eq!(rst.hdr.dst_port, 1026);
}

#[test]
fn request_the_guest_never_saw_times_out_without_rst() {
    let (mut device, uds_path) = new_device("never-seen");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    // No rx buffers: the REQUEST cannot reach the guest.
    let started = Instant::now();
    let mut client = connect_client(&uds_path, b"CONNECT 1027\n");
    assert!(closed_by_device(&mut client));
    assert!(started.elapsed() >= CONNECT_TIMEOUT - Duration::from_millis(100));
    // Neither the stale REQUEST nor an RST for it comes later.
    guest.give_rx_buffers(4, 4096);
    assert!(guest.recv_for(Duration::from_millis(100)).is_empty());
}

#[test]
fn malformed_connect_lines_close_the_client_and_slow_ones_block_nobody() {
    let (mut device, uds_path) = new_device("bad-lines");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(8, 4096);

    let long = [b'7'; 40];
    let bad_lines: [&[u8]; 6] = [
        b"CONNECT\n",
        b"CONNECT 4294967296\n",
        b"LISTEN 1024\n",
        b"CONNECT 1 2\n",
        b"CONNECT -5\n",
        &long,
    ];
    for line in bad_lines {
        let mut client = connect_client(&uds_path, line);
        assert!(
            closed_by_device(&mut client),
            "{:?}",
            String::from_utf8_lossy(line)
        );
    }
    // The client that gives up half-way is closed too.
    drop(connect_client(&uds_path, b"CONNE"));

    // A slow client holds nothing up: a later one is served first.
    let mut slow = connect_client(&uds_path, b"CONN");
    let (_fast, fast_key) = host_connect(&mut guest, &uds_path, 2001);
    slow.write_all(b"ECT 2002\n").unwrap();
    let request = guest.recv_one();
    assert_eq!(request.hdr.op, VSOCK_OP_REQUEST);
    assert_eq!(request.hdr.dst_port, 2002);
    assert_ne!(request.hdr.src_port, fast_key.local_port);
    // Nothing else reached the guest: the bad lines made no requests.
    assert!(guest.recv_for(Duration::from_millis(50)).is_empty());
}

#[test]
fn guest_that_stops_reading_does_not_make_the_host_side_buffer() {
    let (mut device, uds_path) = new_device("no-reader");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(4, 4096);
    let (mut client, key) = host_connect(&mut guest, &uds_path, 3000);

    // The guest only has 1000 bytes of buffer: it may see 1000 bytes and no more,
    // however many (and however large) rx buffers it offers.
    let mut credit = Hdr::from_guest(3000, key.local_port, VSOCK_OP_CREDIT_UPDATE);
    credit.buf_alloc = 1000;
    guest.send(credit, &[]);
    guest.wait_tx_used(2);
    client.set_nonblocking(true).unwrap();
    let mut written = 0usize;
    let chunk = pattern(64 * 1024, 5);
    let limit = 64 << 20;
    while written < limit {
        match client.write(&chunk) {
            Ok(count) => written += count,
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                // The device may still be reading its credit's worth.
                std::thread::sleep(Duration::from_millis(50));
                match client.write(&chunk) {
                    Ok(count) => written += count,
                    Err(error) if error.kind() == ErrorKind::WouldBlock => break,
                    Err(error) => panic!("{error}"),
                }
            }
            Err(error) => panic!("{error}"),
        }
    }
    assert!(
        written < limit,
        "the host socket was drained beyond the guest's credit"
    );
    guest.give_rx_buffers(32, 4096);
    let first = guest.recv_data(key, 1000);
    assert_eq!(first, chunk[..1000]);
    assert!(
        guest.recv_for(Duration::from_millis(100)).is_empty(),
        "nothing beyond the credit"
    );

    // The guest reads: with fwd_cnt 1000 the next 1000 bytes come.
    credit.fwd_cnt = 1000;
    guest.send(credit, &[]);
    assert_eq!(guest.recv_data(key, 1000), chunk[1000..2000]);
    assert!(guest.recv_for(Duration::from_millis(100)).is_empty());

    // The other way: the client does not read. The guest may send BUF_ALLOC bytes, which
    // the device holds; beyond its credit, the connection is reset.
    let block = pattern(MAX_PKT_DATA as usize, 6);
    // The guest's headers keep its own credit at zero, so no data comes its way.
    let mut rw = Hdr::from_guest(3000, key.local_port, VSOCK_OP_RW);
    rw.buf_alloc = 1000;
    rw.fwd_cnt = 1000;
    let mut sent = 0u32;
    let mut last_fwd_cnt = 0u32;
    loop {
        for packet in guest.recv_for(Duration::from_millis(20)) {
            assert_eq!(packet.hdr.op, VSOCK_OP_CREDIT_UPDATE, "{packet:?}");
            last_fwd_cnt = packet.hdr.fwd_cnt;
        }
        if sent + MAX_PKT_DATA > BUF_ALLOC + last_fwd_cnt {
            break;
        }
        guest.send(rw, &block);
        sent += MAX_PKT_DATA;
        guest.wait_tx_used(1);
    }
    assert!(
        sent >= BUF_ALLOC,
        "the device took at least its buffer's worth"
    );
    guest.send(rw, &block);
    let rst = guest.recv_one();
    assert_eq!(rst.hdr.op, VSOCK_OP_RST, "beyond the credit: {rst:?}");
    let mut drained = vec![0u8; 1 << 20];
    let mut total = 0;
    client.set_nonblocking(false).unwrap();
    loop {
        match client.read(&mut drained) {
            Ok(0) | Err(_) => break,
            Ok(count) => total += count,
        }
    }
    assert_eq!(
        total as u32, last_fwd_cnt,
        "the host got what the guest was told"
    );
}

#[test]
fn fifty_connections_at_once() {
    let (mut device, uds_path) = new_device("fifty");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(50, 4096);
    let mut clients: Vec<UnixStream> = (0..50)
        .map(|index| connect_client(&uds_path, format!("CONNECT {}\n", 2000 + index).as_bytes()))
        .collect();
    let requests = guest.recv(50);
    guest.give_rx_buffers(60, 4096);
    let mut host_port_of = HashMap::new();
    for request in &requests {
        assert_eq!(request.hdr.op, VSOCK_OP_REQUEST);
        assert!(request.hdr.src_port >= FIRST_HOST_PORT);
        assert!(host_port_of
            .insert(request.hdr.dst_port, request.hdr.src_port)
            .is_none());
    }
    let distinct: std::collections::HashSet<_> = host_port_of.values().collect();
    assert_eq!(distinct.len(), 50, "every connection has its own host port");
    for (guest_port, host_port) in &host_port_of {
        guest.send(
            Hdr::from_guest(*guest_port, *host_port, VSOCK_OP_RESPONSE),
            &[],
        );
    }
    for (index, client) in clients.iter_mut().enumerate() {
        let host_port = host_port_of[&(2000 + index as u32)];
        assert_eq!(read_line(client), format!("OK {host_port}\n"));
        client
            .write_all(format!("client {index}").as_bytes())
            .unwrap();
    }
    let mut heard = HashMap::new();
    while heard.len() < 50 {
        let packet = guest.recv_one();
        assert_eq!(packet.hdr.op, VSOCK_OP_RW);
        let index = packet.hdr.dst_port - 2000;
        assert_eq!(host_port_of[&packet.hdr.dst_port], packet.hdr.src_port);
        assert_eq!(packet.data, format!("client {index}").as_bytes());
        heard.insert(index, ());
    }
    // And back: the guest writes to every one.
    for (guest_port, host_port) in &host_port_of {
        guest.send(
            Hdr::from_guest(*guest_port, *host_port, VSOCK_OP_RW),
            format!("to {guest_port}").as_bytes(),
        );
    }
    for (index, client) in clients.iter_mut().enumerate() {
        let expected = format!("to {}", 2000 + index);
        let mut received = vec![0u8; expected.len()];
        client.read_exact(&mut received).unwrap();
        assert_eq!(received, expected.as_bytes());
    }
}

#[test]
fn guest_shutdown_half_closes_the_host_socket() {
    let (mut device, uds_path) = new_device("half-close");
    let port_listener = PortListener::bind(&uds_path, 5003);
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(8, 4096);
    guest.send(Hdr::from_guest(40003, 5003, VSOCK_OP_REQUEST), &[]);
    assert_eq!(guest.recv_one().hdr.op, VSOCK_OP_RESPONSE);
    let mut host = port_listener.accept();
    let key = ConnKey {
        local_port: 5003,
        peer_port: 40003,
    };

    guest.send(Hdr::from_guest(40003, 5003, VSOCK_OP_RW), b"last words");
    let mut shutdown = Hdr::from_guest(40003, 5003, VSOCK_OP_SHUTDOWN);
    shutdown.flags = VSOCK_FLAGS_SHUTDOWN_SEND;
    guest.send(shutdown, &[]);
    let mut everything = Vec::new();
    host.read_to_end(&mut everything).unwrap();
    assert_eq!(everything, b"last words", "then EOF");

    // The other direction still works.
    host.write_all(b"reply").unwrap();
    assert_eq!(guest.recv_data(key, 5), b"reply");

    // The guest will not receive either: both directions are done, RST.
    shutdown.flags = VSOCK_FLAGS_SHUTDOWN_RCV;
    guest.send(shutdown, &[]);
    let rst = guest.recv_one();
    assert_eq!(rst.hdr.op, VSOCK_OP_RST);
    let error = host.write(b"x").unwrap_err();
    assert_eq!(
        error.kind(),
        ErrorKind::BrokenPipe,
        "the device closed its end"
    );
}

#[test]
fn hostile_packets_and_buffers_are_dropped_or_reset() {
    let (mut device, uds_path) = new_device("hostile");
    let port_listener = PortListener::bind(&uds_path, 5004);
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);

    // Rx buffers the device cannot use are returned empty (read-only, too short, outside
    // memory) and the next good one carries the packet.
    for desc in [
        Desc {
            addr: GuestTest::RX_SLOT,
            len: 4096,
            writable: false,
        },
        Desc {
            addr: GuestTest::RX_SLOT,
            len: 8,
            writable: true,
        },
        Desc {
            addr: 1 << 40,
            len: 4096,
            writable: true,
        },
    ] {
        guest.push_chain(RX, &[desc]);
    }
    guest.give_rx_buffers(1, 4096);
    guest.send(Hdr::from_guest(6, 5004, VSOCK_OP_RW), b"x");
    guest.wait_tx_used(1);
    let deadline = Instant::now() + WAIT;
    let mut entries = Vec::new();
    while entries.len() < 4 {
        entries.extend(guest.take_used(RX));
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(entries[..3].iter().all(|(_, len)| *len == 0), "{entries:?}");
    let rst = guest.read_rx(entries[3]);
    assert_eq!(
        (rst.hdr.op, rst.hdr.src_port, rst.hdr.dst_port),
        (VSOCK_OP_RST, 5004, 6)
    );

    // Wrong addresses: dropped without an answer.
    let mut bad_source = Hdr::from_guest(1, 5004, VSOCK_OP_REQUEST);
    bad_source.src_cid = 7;
    guest.send(bad_source, &[]);
    let mut bad_destination = Hdr::from_guest(1, 5004, VSOCK_OP_REQUEST);
    bad_destination.dst_cid = 9;
    guest.send(bad_destination, &[]);
    let mut cid_overflow = Hdr::from_guest(1, 5004, VSOCK_OP_REQUEST);
    cid_overflow.src_cid = u64::MAX;
    guest.send(cid_overflow, &[]);
    // A header whose len is larger than its data descriptor.
    let mut lying_len = Hdr::from_guest(2, 5004, VSOCK_OP_RW);
    lying_len.len = 1000;
    guest.send_raw(lying_len, &[1u8; 10]);
    // A len beyond the largest packet, with no data at all.
    lying_len.len = u32::MAX;
    guest.send_raw(lying_len, &[]);
    // A header descriptor shorter than a header, a write-only one, one outside memory,
    // and one that wraps the address space.
    for desc in [
        Desc {
            addr: GuestTest::TX_SLOT,
            len: 10,
            writable: false,
        },
        Desc {
            addr: GuestTest::TX_SLOT,
            len: PKT_HEADER_SIZE as u32,
            writable: true,
        },
        Desc {
            addr: 1 << 40,
            len: PKT_HEADER_SIZE as u32,
            writable: false,
        },
        Desc {
            addr: u64::MAX - 4,
            len: PKT_HEADER_SIZE as u32,
            writable: false,
        },
    ] {
        guest.push_chain(TX, &[desc]);
    }
    guest.kick(TX);
    guest.wait_tx_used(9);
    // None of that produced packets, even with buffers to put them in.
    guest.give_rx_buffers(8, 4096);
    assert!(guest.recv_for(Duration::from_millis(100)).is_empty());

    // Bad socket type, unknown operation, data for no connection: RST.
    let mut seqpacket = Hdr::from_guest(3, 5004, VSOCK_OP_REQUEST);
    seqpacket.type_ = 2;
    guest.send(seqpacket, &[]);
    guest.send(Hdr::from_guest(4, 5004, 99), &[]);
    guest.send(Hdr::from_guest(5, 5004, VSOCK_OP_RW), b"who?");
    for (packet, port) in guest.recv(3).iter().zip([3, 4, 5]) {
        assert_eq!(packet.hdr.op, VSOCK_OP_RST, "{packet:?}");
        assert_eq!(packet.hdr.dst_port, port);
        assert_eq!(packet.hdr.type_, VSOCK_TYPE_STREAM);
    }

    // After all that, the device still serves a good connection.
    guest.give_rx_buffers(4, 4096);
    guest.send(Hdr::from_guest(40004, 5004, VSOCK_OP_REQUEST), &[]);
    assert_eq!(guest.recv_one().hdr.op, VSOCK_OP_RESPONSE);
    let mut host = port_listener.accept();
    guest.send(Hdr::from_guest(40004, 5004, VSOCK_OP_RW), b"alive");
    let mut received = [0u8; 5];
    host.read_exact(&mut received).unwrap();
    assert_eq!(&received, b"alive");

    // A second REQUEST for the live connection resets it.
    guest.send(Hdr::from_guest(40004, 5004, VSOCK_OP_REQUEST), &[]);
    assert_eq!(guest.recv_one().hdr.op, VSOCK_OP_RST);
    assert!(closed_by_device(&mut host));
}

/// Buffer addresses for hand-made chains (past the slots the helpers use).
struct GuestTest;

impl GuestTest {
    const TX_SLOT: u64 = BUFFER_BASES[TX] + (CHAINS as u64 - 1) * SLOT;
    const RX_SLOT: u64 = BUFFER_BASES[RX] + (CHAINS as u64 - 1) * SLOT;
}

#[test]
fn pause_keeps_connections_and_reports_positions() {
    let (mut device, uds_path) = new_device("pause");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(8, 4096);
    let (mut client, key) = host_connect(&mut guest, &uds_path, 6000);

    let positions = device.pause();
    assert_eq!(positions.len(), 3);
    let rx = positions[RX].unwrap();
    let tx = positions[TX].unwrap();
    assert_eq!((rx.next_avail, rx.next_used), (1, 1), "one REQUEST");
    assert_eq!((tx.next_avail, tx.next_used), (1, 1), "one RESPONSE");
    assert_eq!(
        device.with_paused_worker(|worker| worker.muxer().connection_count()),
        Some(1)
    );
    // Nothing moves while paused.
    client.write_all(b"while paused").unwrap();
    assert!(guest.recv_for(Duration::from_millis(100)).is_empty());

    device.resume().unwrap();
    assert_eq!(guest.recv_data(key, 12), b"while paused");

    device.reset();
    assert!(
        closed_by_device(&mut client),
        "a reset drops the connections"
    );
    assert!(device.pause().is_empty(), "not active");
}

#[test]
fn restore_sends_transport_reset_and_rebinds_the_listener() {
    let (mut device, uds_path) = new_device("restore");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(4, 4096);
    let (_client, _key) = host_connect(&mut guest, &uds_path, 7000);
    device.pause();
    let state = device.save_state().unwrap();
    assert_eq!(
        serde_json::to_value(&state).unwrap(),
        serde_json::json!({ "vsock": { "guest_cid": GUEST_CID } })
    );
    drop(device);
    assert!(!uds_path.exists(), "the socket file goes with the device");

    let config = VsockConfig {
        vsock_id: None,
        guest_cid: GUEST_CID,
        uds_path: uds_path.clone(),
    };
    let mut restored = Vsock::new(&config).unwrap();
    let error = restored
        .restore_state(&crate::DeviceState::Vsock(super::VsockState {
            guest_cid: 1,
        }))
        .unwrap_err()
        .to_string();
    assert!(error.contains("guest_cid 1"), "{error}");
    assert!(serde_json::from_value::<crate::DeviceState>(
        serde_json::json!({ "vsock": { "guest_cid": 3, "extra": 1 } })
    )
    .is_err());
    restored.restore_state(&state).unwrap();
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut restored, &memory);
    let chain = guest.next_chain[EVENT];
    let slot = TestGuest::slot(EVENT, chain);
    guest
        .memory
        .write_obj(0xdead_beef_u32, GuestAddress(slot))
        .unwrap();
    guest.push_chain(
        EVENT,
        &[Desc {
            addr: slot,
            len: 4,
            writable: true,
        }],
    );
    guest.kick(EVENT);
    let deadline = Instant::now() + WAIT;
    let used = loop {
        let used = guest.take_used(EVENT);
        if !used.is_empty() {
            break used;
        }
        assert!(Instant::now() < deadline, "no TRANSPORT_RESET");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(used, vec![(u32::from(chain) * 2, 4)]);
    let event: u32 = guest.memory.read_obj(GuestAddress(slot)).unwrap();
    assert_eq!(event, VSOCK_EVENT_TRANSPORT_RESET);
    assert!(guest.interrupt.queues[EVENT].load(Ordering::SeqCst) > 0);

    // The new listener serves clients; the old connection is gone.
    guest.give_rx_buffers(4, 4096);
    let (_client, key) = host_connect(&mut guest, &uds_path, 7001);
    assert_eq!(key.local_port, FIRST_HOST_PORT);
}

#[test]
fn configuration_space_features_and_validation() {
    let (mut device, uds_path) = new_device("config");
    assert_eq!(device.device_type(), 19);
    assert_eq!(device.queue_max_sizes(), vec![256, 256, 256]);
    assert_eq!(device.name(), "virtio-vsock config");
    let mut cid = [0xffu8; 8];
    device.read_config(0, &mut cid);
    assert_eq!(u64::from_le_bytes(cid), GUEST_CID);
    let mut high = [0xffu8; 4];
    device.read_config(4, &mut high);
    assert_eq!(high, [0; 4]);
    let mut past = [0xffu8; 4];
    device.read_config(6, &mut past);
    assert_eq!(past, [0; 4]);
    device.read_config(u64::MAX, &mut past);
    assert_eq!(past, [0; 4]);
    device.write_config(0, &[9; 8]);
    device.read_config(0, &mut cid);
    assert_eq!(u64::from_le_bytes(cid), GUEST_CID, "read-only");

    // Activation needs all three queues.
    let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEMORY_SIZE)]).unwrap();
    let mock = MockSplitQueue::create(&memory, GuestAddress(0), QUEUE_SIZE);
    let result = device.activate(Activation {
        memory: memory.clone(),
        acked_features: 0,
        queues: vec![
            Some(ActiveQueue {
                queue: mock.create_queue().unwrap(),
                kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            }),
            None,
            None,
        ],
        interrupt: Arc::new(RecordingInterrupt::default()),
    });
    assert!(matches!(
        result,
        Err(crate::ActivateError::QueueCount {
            given: 1,
            needed: 3,
            ..
        })
    ));

    // The I/O thread has its name.
    let memory = guest_memory();
    let _guest = TestGuest::activate(&mut device, &memory);
    let names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .collect();
    assert!(
        names.iter().any(|name| name.trim() == THREAD_NAME),
        "{names:?}"
    );

    for guest_cid in [0, 1, 2, u64::from(u32::MAX), u64::from(u32::MAX) + 1] {
        let config = VsockConfig {
            vsock_id: None,
            guest_cid,
            uds_path: temp_socket_path("never"),
        };
        assert!(
            matches!(config.validate(), Err(VsockError::GuestCid(_))),
            "{guest_cid}"
        );
        assert!(Vsock::new(&config).is_err());
    }
    let long = VsockConfig {
        vsock_id: None,
        guest_cid: 3,
        uds_path: PathBuf::from(format!("/tmp/{}", "x".repeat(100))),
    };
    assert!(matches!(
        long.validate(),
        Err(VsockError::PathLength { .. })
    ));
    // The path is taken while the device lives.
    let same = VsockConfig {
        vsock_id: None,
        guest_cid: 4,
        uds_path: uds_path.clone(),
    };
    assert!(matches!(Vsock::new(&same), Err(VsockError::PathInUse(_))));

    let parsed: VsockConfig =
        serde_json::from_str(r#"{"guest_cid": 3, "uds_path": "/tmp/v.sock"}"#).unwrap();
    assert_eq!(parsed.vsock_id, None);
    assert_eq!(parsed.uds_path, PathBuf::from("/tmp/v.sock"));
    assert!(serde_json::from_str::<VsockConfig>(
        r#"{"guest_cid": 3, "uds_path": "/tmp/v.sock", "port": 1}"#
    )
    .is_err());
}

/// A driver that publishes an available index far ahead of its ring (more chains than the
/// queue holds) gets nothing served from that ring, and the worker does not spin on it: a
/// reset, which waits for the worker to come back to its loop, still ends, and the device
/// serves the next activation. (The worker used to retry such a ring forever.)
#[test]
fn an_available_index_far_ahead_is_ignored_not_spun_on() {
    let (mut device, _uds_path) = new_device("avail-ahead");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(2, 4096);
    let avail = guest.mock(TX).avail().idx();
    avail.store(avail.load().wrapping_add(50_000));
    guest.kick(TX);
    std::thread::sleep(Duration::from_millis(100));
    assert!(guest.take_used(TX).is_empty(), "nothing is served from it");

    let (done, reset_done) = std::sync::mpsc::channel();
    let resetter = std::thread::spawn(move || {
        device.reset();
        let _ = done.send(());
        device
    });
    reset_done
        .recv_timeout(WAIT)
        .expect("the reset waits for a worker spinning on the broken ring");
    let mut device = resetter.join().unwrap();

    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(1, 4096);
    guest.send(Hdr::from_guest(7, 5004, VSOCK_OP_RW), b"x");
    assert_eq!(guest.recv_one().hdr.op, VSOCK_OP_RST);
}

/// A live update's hand-over: the paused device gives its connections and listener to a
/// device of a "new process", which serves them on (data both ways on the same
/// connection, no TRANSPORT_RESET, no new REQUEST) and leaves the socket file alone until
/// it owns it; the old device, given up, leaves it too.
#[test]
fn handed_over_connections_go_on_in_the_adopting_device() {
    let (mut device, uds_path) = new_device("handover");
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut device, &memory);
    guest.give_rx_buffers(8, 4096);
    let (mut client, key) = host_connect(&mut guest, &uds_path, 6100);
    client.write_all(b"to the guest").unwrap();
    assert_eq!(guest.recv_data(key, 12), b"to the guest");
    assert!(device.hand_over().is_err(), "a running device is refused");

    device.pause();
    let (live, fds) = device.hand_over().unwrap().expect("an active device");
    assert_eq!(live.muxer.connections.len(), 1);
    assert_eq!(fds.len(), 1);
    assert!(!live.transport_reset_pending);
    let state = device.save_state().unwrap();
    let listener = UnixListener::from(device.listener_descriptor().unwrap());
    let config = VsockConfig {
        vsock_id: None,
        guest_cid: GUEST_CID,
        uds_path: uds_path.clone(),
    };
    // The old process's device gives the file up once the new one has the VM.
    device.own_socket_file(false);
    drop(device);
    assert!(uds_path.exists(), "the old device left the socket file");

    // A count of sockets that does not match is refused when the device starts.
    let mut short = Vsock::adopting(&config, listener.try_clone().unwrap()).unwrap();
    short.adopt_connections(live.clone(), Vec::new());
    short.restore_state(&state).unwrap();
    let memory_short = guest_memory();
    let Err(error) = TestGuest::try_activate(&mut short, &memory_short) else {
        panic!("activated with no sockets for its connection");
    };
    assert!(error.to_string().contains("came with 0 sockets"), "{error}");
    drop(short);
    assert!(
        uds_path.exists(),
        "a device that never owned the file leaves it"
    );

    let mut adopting = Vsock::adopting(&config, listener).unwrap();
    adopting.adopt_connections(live, fds);
    adopting.restore_state(&state).unwrap();
    let memory = guest_memory();
    let mut guest = TestGuest::activate(&mut adopting, &memory);
    // Held until resumed: the host's bytes wait in the socket.
    client.write_all(b"across").unwrap();
    guest.give_rx_buffers(8, 4096);
    assert!(guest.recv_for(Duration::from_millis(100)).is_empty());
    adopting.pause();
    adopting.resume().unwrap();
    assert_eq!(guest.recv_data(key, 6), b"across");
    guest.send(
        Hdr::from_guest(key.peer_port, key.local_port, VSOCK_OP_RW),
        b"back to the host",
    );
    let mut back = [0u8; 16];
    client.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"back to the host");
    // No TRANSPORT_RESET waits on the event queue.
    assert!(guest.take_used(EVENT).is_empty());
    adopting.own_socket_file(true);
    drop(adopting);
    assert!(
        !uds_path.exists(),
        "the device that owns it removes the file"
    );
}
