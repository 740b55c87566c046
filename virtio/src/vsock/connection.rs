//! One stream between a guest port and a host Unix socket: its state, the credit both ways,
//! and the bytes waiting for the host socket.
//!
//! Guest → host: data goes straight to the host socket; what the socket does not take waits
//! in `to_host`, which never holds more than the [`BUF_ALLOC`] the guest was promised.
//! Host → guest: the host socket is read straight into the guest's rx buffer, and only as
//! much as the guest's credit allows, so nothing is buffered on that side at all.

use std::collections::VecDeque;
use std::io::{ErrorKind, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use virtio_vsock::packet::VsockPacket;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile};
use vmm_sys_util::epoll::EventSet;

use super::packet::{
    write_header, ConnKey, Reply, MAX_PKT_DATA, VSOCK_FLAGS_SHUTDOWN_RCV,
    VSOCK_FLAGS_SHUTDOWN_SEND, VSOCK_OP_CREDIT_UPDATE, VSOCK_OP_REQUEST, VSOCK_OP_RESPONSE,
    VSOCK_OP_RW, VSOCK_OP_SHUTDOWN,
};
use super::{CONNECT_TIMEOUT, SHUTDOWN_TIMEOUT};

/// The receive buffer each connection advertises to the guest, and the most guest data it
/// ever holds for a host socket that is not reading.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// A credit update goes to the guest once it believes less than this is free.
const CREDIT_UPDATE_THRESHOLD: u32 = 64 * 1024;
/// An emptied `to_host` keeps at most this much capacity (1024 idle connections must not
/// each keep a full buffer).
const IDLE_BUFFER_CAPACITY: usize = 16 * 1024;

/// Where the connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum State {
    /// Host-initiated: REQUEST queued or sent, waiting for the guest's RESPONSE.
    Connecting,
    Established,
    /// The host socket ended: SHUTDOWN queued or sent, waiting for the guest's RST.
    Closing,
}

/// How a connection ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Close {
    /// The guest must be told with an RST.
    Rst,
    /// The guest already knows (it sent the RST).
    Quiet,
}

/// What filling one rx buffer produced.
#[derive(Debug, PartialEq, Eq)]
pub enum RxFill {
    /// A packet with this much data is in the buffer.
    Packet(u32),
    /// Nothing to send now (the host socket had no data after all, or the buffer has no
    /// room for data).
    Nothing,
    /// The connection is over; the caller writes the RST (if any) and drops it.
    Close(Close),
}

/// A connection as a live update carries it ([`Connection::live`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionLive {
    pub local_port: u32,
    pub peer_port: u32,
    pub state: State,
    pub host_initiated: bool,
    /// Time left before it is killed, if it has a deadline.
    pub deadline_ms: Option<u64>,
    pub received: u32,
    pub fwd_cnt: u32,
    pub last_fwd_cnt_sent: u32,
    /// The bytes waiting for the host socket (gpuvm's `OK` line first, `ok_line_left` of
    /// them).
    pub to_host: Vec<u8>,
    pub ok_line_left: usize,
    pub sent: u32,
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: u32,
    pub request_pending: bool,
    pub response_pending: bool,
    pub credit_update_pending: bool,
    /// Not used on restore (the socket is read again); kept for the record.
    pub host_readable: bool,
    pub peer_shut_rcv: bool,
    pub peer_shut_send: bool,
    pub host_write_shut: bool,
}

pub struct Connection {
    pub stream: UnixStream,
    pub token: u64,
    pub state: State,
    /// Whether gpuvm allocated the local port (a host-initiated connection).
    pub host_initiated: bool,
    /// When the connection is killed unless something happens first.
    pub deadline: Option<Instant>,
    /// A deadline set since the muxer last looked (it schedules the timer).
    pub new_deadline: Option<Instant>,
    /// The events the worker's epoll waits for on `stream`; `None`: not in the epoll.
    pub registered: Option<EventSet>,
    /// Whether the muxer's rx queue holds this connection.
    pub queued_for_rx: bool,

    // Guest → host.
    /// Bytes of data the guest sent.
    received: Wrapping<u32>,
    /// Bytes of the guest's data written to the host socket.
    fwd_cnt: Wrapping<u32>,
    /// The fwd_cnt the guest last heard.
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Bytes for the host socket that it did not take yet.
    to_host: VecDeque<u8>,
    /// How many of `to_host`'s first bytes are gpuvm's own `OK <port>\n` (not guest data,
    /// so not counted in fwd_cnt).
    ok_line_left: usize,

    // Host → guest.
    /// Bytes of data sent to the guest.
    sent: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,

    request_pending: bool,
    response_pending: bool,
    credit_update_pending: bool,
    /// The host socket reported readable (or hung up) and was not read to EWOULDBLOCK since.
    host_readable: bool,
    /// The guest will receive no more.
    peer_shut_rcv: bool,
    /// The guest will send no more.
    peer_shut_send: bool,
    host_write_shut: bool,
}

impl Connection {
    fn new(stream: UnixStream, token: u64, state: State) -> Self {
        Connection {
            stream,
            token,
            state,
            host_initiated: false,
            deadline: None,
            new_deadline: None,
            registered: None,
            queued_for_rx: false,
            received: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            to_host: VecDeque::new(),
            ok_line_left: 0,
            sent: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            request_pending: false,
            response_pending: false,
            credit_update_pending: false,
            host_readable: false,
            peer_shut_rcv: false,
            peer_shut_send: false,
            host_write_shut: false,
        }
    }

    /// A host client asked for a guest port: a REQUEST goes to the guest, which has
    /// [`CONNECT_TIMEOUT`] to answer.
    pub fn host_initiated(stream: UnixStream, token: u64, now: Instant) -> Self {
        let mut connection = Connection::new(stream, token, State::Connecting);
        connection.host_initiated = true;
        connection.request_pending = true;
        connection.set_deadline(now + CONNECT_TIMEOUT);
        connection
    }

    /// The guest asked for a host port and the host listener took the connection: a
    /// RESPONSE goes back.
    pub fn guest_initiated(stream: UnixStream, token: u64) -> Self {
        let mut connection = Connection::new(stream, token, State::Established);
        connection.response_pending = true;
        connection
    }

    /// The connection as a live update carries it to a new process (its host socket goes
    /// beside, as a descriptor): everything but the epoll and rx-queue bookkeeping, which
    /// the new process's muxer builds again. `now`: deadlines go as time left.
    pub fn live(&self, key: ConnKey, now: Instant) -> ConnectionLive {
        ConnectionLive {
            local_port: key.local_port,
            peer_port: key.peer_port,
            state: self.state,
            host_initiated: self.host_initiated,
            deadline_ms: (self.deadline)
                .map(|deadline| deadline.saturating_duration_since(now).as_millis() as u64),
            received: self.received.0,
            fwd_cnt: self.fwd_cnt.0,
            last_fwd_cnt_sent: self.last_fwd_cnt_sent.0,
            to_host: self.to_host.iter().copied().collect(),
            ok_line_left: self.ok_line_left,
            sent: self.sent.0,
            peer_buf_alloc: self.peer_buf_alloc,
            peer_fwd_cnt: self.peer_fwd_cnt.0,
            request_pending: self.request_pending,
            response_pending: self.response_pending,
            credit_update_pending: self.credit_update_pending,
            host_readable: self.host_readable,
            peer_shut_rcv: self.peer_shut_rcv,
            peer_shut_send: self.peer_shut_send,
            host_write_shut: self.host_write_shut,
        }
    }

    /// A connection a live update carried (`live`), over its handed-over host socket;
    /// refused when its buffers say more than a connection ever holds.
    pub fn from_live(
        stream: UnixStream,
        token: u64,
        live: &ConnectionLive,
        now: Instant,
    ) -> Result<Connection, String> {
        if live.ok_line_left > live.to_host.len()
            || live.to_host.len() - live.ok_line_left > BUF_ALLOC as usize
            || live.ok_line_left > super::unix::MAX_CONNECT_LINE
        {
            return Err(format!(
                "connection {}:{} holds {} bytes for its host socket ({} of them gpuvm's \
                 line): more than a connection holds",
                live.local_port,
                live.peer_port,
                live.to_host.len(),
                live.ok_line_left
            ));
        }
        stream
            .set_nonblocking(true)
            .map_err(|e| format!("connection {}:{}: {e}", live.local_port, live.peer_port))?;
        let mut connection = Connection::new(stream, token, live.state);
        connection.host_initiated = live.host_initiated;
        if let Some(ms) = live.deadline_ms {
            connection.set_deadline(now + std::time::Duration::from_millis(ms));
        }
        connection.received = Wrapping(live.received);
        connection.fwd_cnt = Wrapping(live.fwd_cnt);
        connection.last_fwd_cnt_sent = Wrapping(live.last_fwd_cnt_sent);
        connection.to_host = live.to_host.iter().copied().collect();
        connection.ok_line_left = live.ok_line_left;
        connection.sent = Wrapping(live.sent);
        connection.peer_buf_alloc = live.peer_buf_alloc;
        connection.peer_fwd_cnt = Wrapping(live.peer_fwd_cnt);
        connection.request_pending = live.request_pending;
        connection.response_pending = live.response_pending;
        connection.credit_update_pending = live.credit_update_pending;
        // Whatever the host sent meanwhile is read again from the socket.
        connection.host_readable = true;
        connection.peer_shut_rcv = live.peer_shut_rcv;
        connection.peer_shut_send = live.peer_shut_send;
        connection.host_write_shut = live.host_write_shut;
        Ok(connection)
    }

    fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
        self.new_deadline = Some(deadline);
    }

    /// Every guest packet carries its receive buffer's size and how much it consumed.
    pub fn update_peer_credit(&mut self, buf_alloc: u32, fwd_cnt: u32) {
        self.peer_buf_alloc = buf_alloc;
        self.peer_fwd_cnt = Wrapping(fwd_cnt);
    }

    /// How many more bytes the guest can take. A guest that claims to have consumed more
    /// than was sent only gets more of its own memory filled.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.sent - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether the guest heard of this connection (a host-initiated REQUEST still waiting
    /// for an rx buffer means it did not).
    pub fn guest_knows(&self) -> bool {
        !self.request_pending
    }

    /// How much of the guest's data waits for the host socket.
    pub fn buffered_for_host(&self) -> usize {
        self.to_host.len() - self.ok_line_left
    }

    fn wants_to_read(&self) -> bool {
        self.state == State::Established && !self.peer_shut_rcv && self.peer_credit() > 0
    }

    /// Whether the connection has something for an rx buffer.
    pub fn has_pending_rx(&self) -> bool {
        self.request_pending
            || self.response_pending
            || self.credit_update_pending
            || (self.host_readable && self.wants_to_read())
    }

    /// The events to wait for on the host socket: readable while the guest has credit and
    /// the socket was not already seen readable (level-triggered epoll would spin while the
    /// rx queue has no buffers), writable while bytes wait for it.
    pub fn desired_events(&self) -> EventSet {
        let mut events = EventSet::empty();
        if self.wants_to_read() && !self.host_readable {
            events |= EventSet::IN;
        }
        if !self.to_host.is_empty() {
            events |= EventSet::OUT;
        }
        events
    }

    /// Both directions are over: the guest will send no more and all of it reached the
    /// host, and nothing more goes to the guest.
    pub fn both_directions_done(&self) -> bool {
        self.peer_shut_send
            && self.to_host.is_empty()
            && (self.peer_shut_rcv || self.state == State::Closing)
    }

    /// The host socket is ready with `events`.
    pub fn on_host_event(&mut self, events: EventSet) -> Result<(), Close> {
        let hang_up = events.intersects(EventSet::HANG_UP | EventSet::ERROR);
        if (events.contains(EventSet::IN) || hang_up) && self.wants_to_read() {
            self.host_readable = true;
        }
        if (events.contains(EventSet::OUT) || hang_up) && !self.to_host.is_empty() {
            self.flush_to_host()?;
        }
        Ok(())
    }

    /// The guest accepted a host-initiated connection: the client hears `OK <port>\n`.
    pub fn on_response(&mut self, local_port: u32) -> Result<(), Close> {
        if self.state != State::Connecting {
            return Err(Close::Rst);
        }
        self.state = State::Established;
        self.deadline = None;
        let line = format!("OK {local_port}\n");
        self.ok_line_left = line.len();
        self.to_host.extend(line.as_bytes());
        self.flush_to_host()
    }

    /// Stream data from the guest.
    pub fn on_rw<B: BitmapSlice>(
        &mut self,
        data: Option<&VolatileSlice<'_, B>>,
    ) -> Result<(), Close> {
        match self.state {
            State::Connecting => return Err(Close::Rst),
            // The host socket is gone; the guest hears RST soon.
            State::Closing => return Ok(()),
            State::Established => {}
        }
        if self.peer_shut_send {
            return Err(Close::Rst);
        }
        let Some(data) = data else { return Ok(()) };
        // A guest that sends beyond its credit would make gpuvm buffer without bound.
        if self.buffered_for_host() + data.len() > BUF_ALLOC as usize {
            return Err(Close::Rst);
        }
        self.received += Wrapping(data.len() as u32);
        let mut written = 0;
        if self.to_host.is_empty() {
            match (&self.stream).write_volatile(data) {
                Ok(count) => written = count,
                Err(VolatileMemoryError::IOError(error))
                    if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(_) => return Err(Close::Rst),
            }
            self.fwd_cnt += Wrapping(written as u32);
        }
        if written < data.len() {
            let rest = data.offset(written).map_err(|_| Close::Rst)?;
            let mut bytes = vec![0u8; rest.len()];
            let copied = rest.copy_to(&mut bytes[..]);
            self.to_host.extend(&bytes[..copied]);
        }
        self.check_credit_update();
        Ok(())
    }

    /// The guest will receive and/or send no more.
    pub fn on_shutdown(&mut self, flags: u32, now: Instant) -> Result<(), Close> {
        if self.state == State::Connecting {
            return Err(Close::Rst);
        }
        if flags & VSOCK_FLAGS_SHUTDOWN_RCV != 0 && !self.peer_shut_rcv {
            self.peer_shut_rcv = true;
            self.host_readable = false;
            // Makes the host peer's writes fail instead of filling a socket nobody reads.
            let _ = self.stream.shutdown(Shutdown::Read);
        }
        if flags & VSOCK_FLAGS_SHUTDOWN_SEND != 0 && !self.peer_shut_send {
            self.peer_shut_send = true;
            self.shut_host_write_when_flushed();
        }
        // A host socket that never takes the rest must not keep the connection forever.
        if self.peer_shut_send && self.peer_shut_rcv && !self.to_host.is_empty() {
            self.set_deadline(now + SHUTDOWN_TIMEOUT);
        }
        Ok(())
    }

    /// The guest asked how much room the host side has.
    pub fn on_credit_request(&mut self) {
        self.credit_update_pending = true;
    }

    /// Writes what waits in `to_host` to the host socket, as far as it takes it.
    pub fn flush_to_host(&mut self) -> Result<(), Close> {
        while !self.to_host.is_empty() {
            let (front, _) = self.to_host.as_slices();
            match (&self.stream).write(front) {
                Ok(0) => return Err(Close::Rst),
                Ok(count) => {
                    self.to_host.drain(..count);
                    let own = count.min(self.ok_line_left);
                    self.ok_line_left -= own;
                    self.fwd_cnt += Wrapping((count - own) as u32);
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => break,
                Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return Err(Close::Rst),
            }
        }
        if self.to_host.is_empty() {
            self.to_host.shrink_to(IDLE_BUFFER_CAPACITY);
            self.shut_host_write_when_flushed();
        }
        self.check_credit_update();
        Ok(())
    }

    fn shut_host_write_when_flushed(&mut self) {
        if self.peer_shut_send && self.to_host.is_empty() && !self.host_write_shut {
            self.host_write_shut = true;
            // The host client reads EOF; an error means it is gone, which a read finds.
            let _ = self.stream.shutdown(Shutdown::Write);
        }
    }

    /// Queues a credit update once the guest believes little room is left and telling it
    /// the current fwd_cnt would give it more.
    fn check_credit_update(&mut self) {
        let unacknowledged = (self.received - self.last_fwd_cnt_sent).0;
        let free_in_guest_view = BUF_ALLOC.saturating_sub(unacknowledged);
        if free_in_guest_view < CREDIT_UPDATE_THRESHOLD && self.fwd_cnt != self.last_fwd_cnt_sent {
            self.credit_update_pending = true;
        }
    }

    /// Puts this connection's next packet for the guest into `packet`.
    pub fn fill_rx<B: BitmapSlice>(
        &mut self,
        packet: &mut VsockPacket<'_, B>,
        guest_cid: u64,
        key: ConnKey,
        now: Instant,
    ) -> RxFill {
        if self.request_pending {
            self.request_pending = false;
            return self.stamp(packet, guest_cid, key, VSOCK_OP_REQUEST, 0, 0);
        }
        if self.response_pending {
            self.response_pending = false;
            return self.stamp(packet, guest_cid, key, VSOCK_OP_RESPONSE, 0, 0);
        }
        if self.host_readable && self.wants_to_read() {
            if let Some(data) = packet.data_slice() {
                let room = data
                    .len()
                    .min(self.peer_credit() as usize)
                    .min(MAX_PKT_DATA as usize);
                let read = match data.subslice(0, room) {
                    Ok(mut target) => (&self.stream).read_volatile(&mut target),
                    Err(error) => Err(error),
                };
                match read {
                    Ok(0) => {
                        self.host_readable = false;
                        return self.host_closed(packet, guest_cid, key, now);
                    }
                    Ok(count) => {
                        self.sent += Wrapping(count as u32);
                        return self.stamp(packet, guest_cid, key, VSOCK_OP_RW, 0, count as u32);
                    }
                    Err(VolatileMemoryError::IOError(error))
                        if matches!(
                            error.kind(),
                            ErrorKind::WouldBlock | ErrorKind::Interrupted
                        ) =>
                    {
                        self.host_readable = false;
                    }
                    Err(_) => return RxFill::Close(Close::Rst),
                }
            }
        }
        if self.credit_update_pending {
            return self.stamp(packet, guest_cid, key, VSOCK_OP_CREDIT_UPDATE, 0, 0);
        }
        RxFill::Nothing
    }

    /// The host socket reached its end: the guest hears SHUTDOWN (both directions, as
    /// Firecracker does: a Unix client's EOF is taken as a close) and has
    /// [`SHUTDOWN_TIMEOUT`] to answer with RST; if the guest is done sending too, RST now.
    fn host_closed<B: BitmapSlice>(
        &mut self,
        packet: &mut VsockPacket<'_, B>,
        guest_cid: u64,
        key: ConnKey,
        now: Instant,
    ) -> RxFill {
        if self.peer_shut_send {
            return RxFill::Close(Close::Rst);
        }
        self.state = State::Closing;
        self.set_deadline(now + SHUTDOWN_TIMEOUT);
        let flags = VSOCK_FLAGS_SHUTDOWN_RCV | VSOCK_FLAGS_SHUTDOWN_SEND;
        self.stamp(packet, guest_cid, key, VSOCK_OP_SHUTDOWN, flags, 0)
    }

    fn stamp<B: BitmapSlice>(
        &mut self,
        packet: &mut VsockPacket<'_, B>,
        guest_cid: u64,
        key: ConnKey,
        op: u16,
        flags: u32,
        len: u32,
    ) -> RxFill {
        let reply = Reply {
            op,
            flags,
            len,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: self.fwd_cnt.0,
        };
        if write_header(packet, guest_cid, key, reply).is_err() {
            return RxFill::Close(Close::Rst);
        }
        // Every packet tells the guest the current fwd_cnt.
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.credit_update_pending = false;
        RxFill::Packet(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use virtio_vsock::packet::PKT_HEADER_SIZE;

    fn established() -> (Connection, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let mut connection = Connection::guest_initiated(ours, 16);
        connection.update_peer_credit(8192, 0);
        (connection, theirs)
    }

    fn slice(bytes: &mut [u8]) -> VolatileSlice<'_, ()> {
        VolatileSlice::from(bytes)
    }

    #[test]
    fn peer_credit_follows_what_was_sent_and_what_the_guest_consumed() {
        let (mut connection, _peer) = established();
        assert_eq!(connection.peer_credit(), 8192);
        connection.sent = Wrapping(5000);
        assert_eq!(connection.peer_credit(), 3192);
        connection.update_peer_credit(8192, 5000);
        assert_eq!(connection.peer_credit(), 8192);
        // Counters wrap.
        connection.sent = Wrapping(10);
        connection.update_peer_credit(8192, u32::MAX - 9);
        assert_eq!(connection.peer_credit(), 8192 - 20);
        // A guest claiming more in flight than its buffer gets no credit, not a huge one.
        connection.update_peer_credit(4, 0);
        assert_eq!(connection.peer_credit(), 0);
    }

    #[test]
    fn guest_data_beyond_buf_alloc_is_refused_not_buffered() {
        let (mut connection, mut peer) = established();
        // Fill the host socket until it takes nothing more.
        let mut chunk = vec![7u8; 64 * 1024];
        loop {
            let before = connection.buffered_for_host();
            connection.on_rw(Some(&slice(&mut chunk))).unwrap();
            if connection.buffered_for_host() > before {
                break;
            }
        }
        // Keep sending within BUF_ALLOC: buffered, never more than BUF_ALLOC.
        while connection.buffered_for_host() + chunk.len() <= BUF_ALLOC as usize {
            connection.on_rw(Some(&slice(&mut chunk))).unwrap();
        }
        assert!(connection.buffered_for_host() <= BUF_ALLOC as usize);
        assert_eq!(
            connection.on_rw(Some(&slice(&mut chunk))),
            Err(Close::Rst),
            "beyond the credit the connection is reset"
        );
        assert!(connection.desired_events().contains(EventSet::OUT));
        // Once the host reads, the buffer drains and fwd_cnt counts every byte.
        let mut sink = vec![0u8; 1 << 20];
        let mut total = 0usize;
        loop {
            match peer.read(&mut sink) {
                Ok(count) => total += count,
                Err(error) if error.kind() == ErrorKind::WouldBlock => {
                    connection.on_host_event(EventSet::OUT).unwrap();
                    if connection.to_host.is_empty() {
                        while let Ok(count) = peer.read(&mut sink) {
                            total += count;
                        }
                        break;
                    }
                }
                Err(error) => panic!("{error}"),
            }
        }
        assert_eq!(connection.fwd_cnt, connection.received);
        assert_eq!(total as u32, connection.received.0);
        assert!(
            connection.credit_update_pending,
            "the guest must learn about the room"
        );
        assert!(!connection.desired_events().contains(EventSet::OUT));
    }

    #[test]
    fn ok_line_is_not_counted_as_guest_data() {
        let (ours, mut peer) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut connection = Connection::host_initiated(ours, 16, Instant::now());
        assert!(connection.deadline.is_some());
        connection.on_response(1 << 30).unwrap();
        assert_eq!(connection.state, State::Established);
        assert_eq!(connection.deadline, None);
        let mut line = [0u8; 32];
        let count = peer.read(&mut line).unwrap();
        assert_eq!(&line[..count], format!("OK {}\n", 1u32 << 30).as_bytes());
        assert_eq!(connection.fwd_cnt.0, 0);
        assert_eq!(
            connection.on_response(1),
            Err(Close::Rst),
            "a second RESPONSE"
        );
    }

    #[test]
    fn host_eof_becomes_shutdown_then_closing() {
        let (mut connection, peer) = established();
        connection.response_pending = false;
        drop(peer);
        connection
            .on_host_event(EventSet::IN | EventSet::HANG_UP)
            .unwrap();
        assert!(connection.has_pending_rx());
        let mut header = [0u8; PKT_HEADER_SIZE];
        let mut data = [0u8; 64];
        // SAFETY: both buffers outlive the packet and are only accessed through it meanwhile.
        let mut packet = unsafe { VsockPacket::new(&mut header, Some(&mut data)) }.unwrap();
        let key = ConnKey {
            local_port: 5000,
            peer_port: 40000,
        };
        let now = Instant::now();
        assert_eq!(
            connection.fill_rx(&mut packet, 3, key, now),
            RxFill::Packet(0)
        );
        assert_eq!(packet.op(), VSOCK_OP_SHUTDOWN);
        assert_eq!(
            packet.flags(),
            VSOCK_FLAGS_SHUTDOWN_RCV | VSOCK_FLAGS_SHUTDOWN_SEND
        );
        assert_eq!(connection.state, State::Closing);
        assert_eq!(connection.deadline, Some(now + SHUTDOWN_TIMEOUT));
        assert!(!connection.has_pending_rx());
    }
}
