//! The muxer: every connection between guest ports and host Unix sockets, the host
//! listener and its clients' `CONNECT` lines, the timeouts, and what goes to the guest next.
//!
//! It knows nothing of virtqueues: [`super::handler`] hands it each packet the guest sent
//! and each rx buffer to fill.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_vsock::packet::VsockPacket;
use vm_memory::bitmap::BitmapSlice;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::timerfd::TimerFd;

use super::connection::{Close, Connection, ConnectionLive, RxFill};
use super::packet::{
    write_header, ConnKey, Reply, VSOCK_HOST_CID, VSOCK_OP_CREDIT_REQUEST, VSOCK_OP_CREDIT_UPDATE,
    VSOCK_OP_REQUEST, VSOCK_OP_RESPONSE, VSOCK_OP_RST, VSOCK_OP_RW, VSOCK_OP_SHUTDOWN,
    VSOCK_TYPE_STREAM,
};
use super::unix::{guest_port_path, HostListener, LineProgress, PendingClient, PendingClientLive};
use super::CONNECT_LINE_TIMEOUT;
use crate::socket::connect_nonblocking;
use crate::worker::EventControl;

/// The host listener's epoll token.
pub const LISTENER_TOKEN: u64 = 3;
/// The timer's epoll token.
pub const TIMER_TOKEN: u64 = 4;
/// Host clients and connections get tokens from here up, never reused (an event still
/// in the worker's batch for a closed socket then matches nothing).
pub const FIRST_DYNAMIC_TOKEN: u64 = 16;

/// Connections and host clients still writing their `CONNECT` line, together; beyond,
/// guest requests get RST and host clients are closed.
pub const MAX_CONNECTIONS: usize = 1024;
/// RSTs for unknown connections waiting for rx buffers; beyond, the tx queue waits (a
/// guest that sends garbage and never reads cannot make gpuvm queue without bound).
const MAX_PENDING_RST: usize = 1024;
/// RSTs for connections that ended (host clients come and go whatever the guest does)
/// beyond which more are dropped: a guest that reads nothing loses only its own RSTs.
const MAX_QUEUED_RST: usize = 4 * MAX_PENDING_RST;
/// Where host-initiated connections' local ports start (guest services use low ports).
pub const FIRST_HOST_PORT: u32 = 1 << 30;
/// Accepts per listener event, so one busy listener does not starve the queues.
const ACCEPTS_PER_EVENT: usize = 64;
/// How long the listener rests after accept() fails for a reason that would repeat
/// (EMFILE, ENOBUFS): level-triggered epoll would otherwise spin on it.
const LISTENER_BACKOFF: Duration = Duration::from_millis(100);

/// Warnings a guest can trigger per packet: at most a few per second.
pub struct LogLimiter {
    window: Instant,
    count: u32,
}

impl LogLimiter {
    const PER_SECOND: u32 = 10;

    pub fn new() -> Self {
        LogLimiter {
            window: Instant::now(),
            count: 0,
        }
    }

    pub fn allow(&mut self) -> bool {
        let now = Instant::now();
        if now.duration_since(self.window) >= Duration::from_secs(1) {
            self.window = now;
            self.count = 0;
        }
        self.count = self.count.saturating_add(1);
        self.count <= Self::PER_SECOND
    }
}

/// What an rx buffer carries next.
#[derive(Clone, Copy, Debug)]
enum RxItem {
    /// Whatever the connection has pending (it may be gone or have nothing by then).
    Connection(ConnKey),
    /// An RST for a connection that does not (or no longer) exist.
    Rst(ConnKey),
}

/// What goes to the guest next, as a live update carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RxItemLive {
    pub local_port: u32,
    pub peer_port: u32,
    /// An RST for a connection that does not exist (else: the connection's next packet).
    pub rst: bool,
}

/// Every connection, waiting host client and queued packet of a muxer, as a live update
/// carries them to a new process; the sockets go beside as descriptors, the connections'
/// first, then the clients', in this order.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MuxerLive {
    pub connections: Vec<ConnectionLive>,
    pub pending_clients: Vec<PendingClientLive>,
    pub next_host_port: u32,
    pub rx_items: Vec<RxItemLive>,
}

impl MuxerLive {
    /// How many descriptors go with it.
    pub fn descriptors(&self) -> usize {
        self.connections.len() + self.pending_clients.len()
    }

    /// The bytes its connections hold for their host sockets.
    pub fn buffered(&self) -> usize {
        self.connections.iter().map(|c| c.to_host.len()).sum()
    }
}

pub struct Muxer {
    guest_cid: u64,
    listener: Arc<HostListener>,
    listener_resting: bool,
    connections: HashMap<ConnKey, Connection>,
    by_token: HashMap<u64, ConnKey>,
    pending_clients: HashMap<u64, PendingClient>,
    /// Local ports of host-initiated connections.
    host_ports: HashSet<u32>,
    next_host_port: u32,
    next_token: u64,
    rx_items: VecDeque<RxItem>,
    pending_rst: usize,
    timer: TimerFd,
    /// Deadlines by token; entries of connections gone or rescheduled are skipped when due.
    deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    timer_set_for: Option<Instant>,
    warnings: LogLimiter,
}

impl Muxer {
    /// `timer` is the device's timeout timer (created with the device: the I/O thread's
    /// seccomp filter does not allow creating one).
    pub fn new(guest_cid: u64, listener: Arc<HostListener>, timer: TimerFd) -> Self {
        Muxer {
            guest_cid,
            listener,
            listener_resting: false,
            connections: HashMap::new(),
            by_token: HashMap::new(),
            pending_clients: HashMap::new(),
            host_ports: HashSet::new(),
            next_host_port: FIRST_HOST_PORT,
            next_token: FIRST_DYNAMIC_TOKEN,
            rx_items: VecDeque::new(),
            pending_rst: 0,
            timer,
            deadlines: BinaryHeap::new(),
            timer_set_for: None,
            warnings: LogLimiter::new(),
        }
    }

    /// Every connection and waiting host client with a duplicate of its socket, and what
    /// goes to the guest next (a live update; the worker is stopped).
    pub fn hand_over(&self) -> std::io::Result<(MuxerLive, Vec<OwnedFd>)> {
        let now = Instant::now();
        let mut keys: Vec<ConnKey> = self.connections.keys().copied().collect();
        keys.sort_by_key(|key| (key.local_port, key.peer_port));
        let mut tokens: Vec<u64> = self.pending_clients.keys().copied().collect();
        tokens.sort_unstable();
        let mut live = MuxerLive {
            next_host_port: self.next_host_port,
            ..MuxerLive::default()
        };
        let mut fds = Vec::new();
        for key in keys {
            let connection = &self.connections[&key];
            live.connections.push(connection.live(key, now));
            fds.push(OwnedFd::from(connection.stream.try_clone()?));
        }
        for token in tokens {
            let client = &self.pending_clients[&token];
            live.pending_clients.push(client.live(now));
            fds.push(OwnedFd::from(client.stream.try_clone()?));
        }
        live.rx_items = (self.rx_items.iter())
            .map(|item| match *item {
                RxItem::Connection(key) => RxItemLive {
                    local_port: key.local_port,
                    peer_port: key.peer_port,
                    rst: false,
                },
                RxItem::Rst(key) => RxItemLive {
                    local_port: key.local_port,
                    peer_port: key.peer_port,
                    rst: true,
                },
            })
            .collect();
        Ok((live, fds))
    }

    /// The muxer a live update carried (`live`, its sockets `fds` in its order), with this
    /// process's listener and timer; refused, naming why, when the two do not match or a
    /// part is out of bounds.
    pub fn from_live(
        guest_cid: u64,
        listener: Arc<HostListener>,
        timer: TimerFd,
        live: &MuxerLive,
        fds: Vec<OwnedFd>,
    ) -> Result<Self, String> {
        if fds.len() != live.descriptors() {
            return Err(format!(
                "{} connections and {} host clients came with {} sockets",
                live.connections.len(),
                live.pending_clients.len(),
                fds.len()
            ));
        }
        if live.descriptors() > MAX_CONNECTIONS || live.rx_items.len() > MAX_QUEUED_RST * 2 {
            return Err(format!(
                "{} connections and clients, {} queued packets: more than a muxer holds",
                live.descriptors(),
                live.rx_items.len()
            ));
        }
        let now = Instant::now();
        let mut muxer = Muxer::new(guest_cid, listener, timer);
        muxer.next_host_port = live.next_host_port.max(FIRST_HOST_PORT);
        let mut fds = fds.into_iter();
        for saved in &live.connections {
            let key = ConnKey {
                local_port: saved.local_port,
                peer_port: saved.peer_port,
            };
            let stream = UnixStream::from(fds.next().ok_or("a connection without its socket")?);
            let token = muxer.next_token();
            let connection = Connection::from_live(stream, token, saved, now)?;
            if saved.host_initiated && !muxer.host_ports.insert(key.local_port) {
                return Err(format!("host port {} is used twice", key.local_port));
            }
            if muxer.connections.insert(key, connection).is_some() {
                return Err(format!(
                    "connection {}:{} is there twice",
                    key.local_port, key.peer_port
                ));
            }
            muxer.by_token.insert(token, key);
        }
        for saved in &live.pending_clients {
            let stream = UnixStream::from(fds.next().ok_or("a host client without its socket")?);
            let client = PendingClient::from_live(stream, saved, now)?;
            let token = muxer.next_token();
            muxer.schedule(client.deadline, token);
            muxer.pending_clients.insert(token, client);
        }
        for item in &live.rx_items {
            let key = ConnKey {
                local_port: item.local_port,
                peer_port: item.peer_port,
            };
            if item.rst {
                muxer.queue_rst(key);
                continue;
            }
            // Each connection once, and only one that is there.
            if let Some(connection) = muxer.connections.get_mut(&key) {
                if !connection.queued_for_rx {
                    connection.queued_for_rx = true;
                    muxer.rx_items.push_back(RxItem::Connection(key));
                }
            }
        }
        Ok(muxer)
    }

    /// How many connections exist (host clients still writing their line excluded).
    #[cfg(test)]
    pub fn connection_count(&self) -> usize {
        self.connections.len()
    }

    /// Adds the listener, the timer and every socket to a (new) worker's epoll.
    pub fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        if !self.listener_resting {
            control.add(self.listener.listener.as_raw_fd(), LISTENER_TOKEN)?;
        }
        control.add(self.timer.as_raw_fd(), TIMER_TOKEN)?;
        for (token, client) in &self.pending_clients {
            control.add(client.stream.as_raw_fd(), *token)?;
        }
        let keys: Vec<ConnKey> = self.connections.keys().copied().collect();
        for key in keys {
            if let Some(connection) = self.connections.get_mut(&key) {
                connection.registered = None;
            }
            self.settle(key, Ok(()), control);
        }
        self.rearm_timer(Instant::now(), true);
        Ok(())
    }

    /// An event for the listener, the timer, a host client or a connection.
    pub fn handle_event(&mut self, token: u64, events: EventSet, control: &EventControl) {
        let now = Instant::now();
        match token {
            LISTENER_TOKEN => self.accept_clients(control, now),
            TIMER_TOKEN => self.expire(control, now),
            token if self.pending_clients.contains_key(&token) => {
                self.read_client_line(token, control, now)
            }
            token => {
                let Some(&key) = self.by_token.get(&token) else {
                    return;
                };
                if let Some(connection) = self.connections.get_mut(&key) {
                    let result = connection.on_host_event(events);
                    self.settle(key, result, control);
                }
            }
        }
    }

    /// Whether something waits for an rx buffer.
    pub fn has_rx_work(&self) -> bool {
        !self.rx_items.is_empty()
    }

    /// Whether RSTs pile up so that the tx queue should wait for the guest to read.
    pub fn rst_backlog_full(&self) -> bool {
        self.pending_rst >= MAX_PENDING_RST
    }

    fn next_token(&mut self) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    fn accept_clients(&mut self, control: &EventControl, now: Instant) {
        for _ in 0..ACCEPTS_PER_EVENT {
            let stream = match self.listener.listener.accept() {
                Ok((stream, _)) => stream,
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    log::warn!(
                        "virtio-vsock: accept on {} failed, resting {LISTENER_BACKOFF:?}: {error}",
                        self.listener.path().display()
                    );
                    if control.remove(self.listener.listener.as_raw_fd()).is_ok() {
                        self.listener_resting = true;
                        self.schedule(now + LISTENER_BACKOFF, LISTENER_TOKEN);
                    }
                    return;
                }
            };
            if self.connections.len() + self.pending_clients.len() >= MAX_CONNECTIONS {
                if self.warnings.allow() {
                    log::warn!(
                        "virtio-vsock: {MAX_CONNECTIONS} connections open, closing a new host client"
                    );
                }
                continue;
            }
            let token = self.next_token();
            let registered = stream
                .set_nonblocking(true)
                .and_then(|()| control.add(stream.as_raw_fd(), token));
            if let Err(error) = registered {
                log::warn!("virtio-vsock: cannot serve a host client: {error}");
                continue;
            }
            let deadline = now + CONNECT_LINE_TIMEOUT;
            self.pending_clients
                .insert(token, PendingClient::new(stream, deadline));
            self.schedule(deadline, token);
        }
    }

    fn read_client_line(&mut self, token: u64, control: &EventControl, now: Instant) {
        let Some(client) = self.pending_clients.get_mut(&token) else {
            return;
        };
        let port = match client.read_line() {
            LineProgress::Incomplete => return,
            LineProgress::Invalid => None,
            LineProgress::Port(port) => Some(port),
        };
        let Some(client) = self.pending_clients.remove(&token) else {
            return;
        };
        let _ = control.remove(client.stream.as_raw_fd());
        match port {
            Some(port) => self.host_connect(client, port, control, now),
            None => log::debug!("virtio-vsock: closing a host client with a bad CONNECT line"),
        }
    }

    /// A host client asked for guest port `peer_port`: a REQUEST from a fresh host port.
    fn host_connect(
        &mut self,
        client: PendingClient,
        peer_port: u32,
        control: &EventControl,
        now: Instant,
    ) {
        let Some(local_port) = self.allocate_host_port(peer_port) else {
            log::warn!("virtio-vsock: no free host port, closing a host client");
            return;
        };
        let key = ConnKey {
            local_port,
            peer_port,
        };
        let token = self.next_token();
        let connection = Connection::host_initiated(client.stream, token, now);
        self.by_token.insert(token, key);
        self.connections.insert(key, connection);
        self.settle(key, Ok(()), control);
    }

    fn allocate_host_port(&mut self, peer_port: u32) -> Option<u32> {
        // At most MAX_CONNECTIONS ports are taken, so this finds one.
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_host_port;
            self.next_host_port = port.checked_add(1).unwrap_or(FIRST_HOST_PORT);
            let key = ConnKey {
                local_port: port,
                peer_port,
            };
            if !self.host_ports.contains(&port) && !self.connections.contains_key(&key) {
                self.host_ports.insert(port);
                return Some(port);
            }
        }
        None
    }

    /// A packet the guest put on the tx queue.
    pub fn handle_guest_packet<B: BitmapSlice>(
        &mut self,
        packet: &VsockPacket<'_, B>,
        control: &EventControl,
    ) {
        if packet.src_cid() != self.guest_cid || packet.dst_cid() != VSOCK_HOST_CID {
            if self.warnings.allow() {
                log::warn!(
                    "virtio-vsock: dropping a packet from cid {} to cid {} (the guest is cid {})",
                    packet.src_cid(),
                    packet.dst_cid(),
                    self.guest_cid
                );
            }
            return;
        }
        let key = ConnKey {
            local_port: packet.dst_port(),
            peer_port: packet.src_port(),
        };
        if packet.type_() != VSOCK_TYPE_STREAM {
            if self.warnings.allow() {
                log::warn!(
                    "virtio-vsock: socket type {} is not offered",
                    packet.type_()
                );
            }
            if packet.op() != VSOCK_OP_RST {
                self.queue_rst(key);
            }
            return;
        }
        let Some(connection) = self.connections.get_mut(&key) else {
            match packet.op() {
                VSOCK_OP_REQUEST => {
                    self.guest_connect(key, packet.buf_alloc(), packet.fwd_cnt(), control)
                }
                VSOCK_OP_RST => {}
                _ => self.queue_rst(key),
            }
            return;
        };
        connection.update_peer_credit(packet.buf_alloc(), packet.fwd_cnt());
        let result = match packet.op() {
            VSOCK_OP_RESPONSE => connection.on_response(key.local_port),
            VSOCK_OP_RW => connection.on_rw(packet.data_slice()),
            VSOCK_OP_CREDIT_UPDATE => Ok(()),
            VSOCK_OP_CREDIT_REQUEST => {
                connection.on_credit_request();
                Ok(())
            }
            VSOCK_OP_SHUTDOWN => connection.on_shutdown(packet.flags(), Instant::now()),
            VSOCK_OP_RST => Err(Close::Quiet),
            // A REQUEST for a connection that exists, or an operation the spec lacks.
            _ => Err(Close::Rst),
        };
        self.settle(key, result, control);
    }

    /// The guest asked for host port `key.local_port`: connect to `<uds_path>_<port>`.
    fn guest_connect(
        &mut self,
        key: ConnKey,
        buf_alloc: u32,
        fwd_cnt: u32,
        control: &EventControl,
    ) {
        if self.connections.len() + self.pending_clients.len() >= MAX_CONNECTIONS {
            if self.warnings.allow() {
                log::warn!(
                    "virtio-vsock: {MAX_CONNECTIONS} connections open, refusing the guest's"
                );
            }
            self.queue_rst(key);
            return;
        }
        let path = guest_port_path(self.listener.path(), key.local_port);
        let stream = match connect_nonblocking(&path) {
            Ok(stream) => stream,
            Err(error) => {
                log::debug!(
                    "virtio-vsock: guest connection to {} refused: {error}",
                    path.display()
                );
                self.queue_rst(key);
                return;
            }
        };
        let token = self.next_token();
        let mut connection = Connection::guest_initiated(stream, token);
        connection.update_peer_credit(buf_alloc, fwd_cnt);
        self.by_token.insert(token, key);
        self.connections.insert(key, connection);
        self.settle(key, Ok(()), control);
    }

    /// After anything happened to a connection: ends it if it is over, and otherwise
    /// brings its epoll interest, rx queueing and deadline up to date.
    fn settle(&mut self, key: ConnKey, result: Result<(), Close>, control: &EventControl) {
        let Some(connection) = self.connections.get_mut(&key) else {
            return;
        };
        let close = match result {
            Err(close) => Some(close),
            Ok(()) => connection.both_directions_done().then_some(Close::Rst),
        };
        if let Some(close) = close {
            self.end(key, close, control);
            return;
        }
        let desired = connection.desired_events();
        let fd = connection.stream.as_raw_fd();
        let outcome = match connection.registered {
            None if desired.is_empty() => Ok(()),
            None => control.add_with(fd, connection.token, desired),
            Some(_) if desired.is_empty() => control.remove(fd),
            Some(current) if current != desired => control.modify(fd, connection.token, desired),
            Some(_) => Ok(()),
        };
        if let Err(error) = outcome {
            log::warn!("virtio-vsock: cannot wait on a connection's socket: {error}");
            self.end(key, Close::Rst, control);
            return;
        }
        connection.registered = (!desired.is_empty()).then_some(desired);
        if connection.has_pending_rx() && !connection.queued_for_rx {
            connection.queued_for_rx = true;
            self.rx_items.push_back(RxItem::Connection(key));
        }
        if let Some(deadline) = connection.new_deadline.take() {
            let token = connection.token;
            self.schedule(deadline, token);
        }
    }

    /// Drops a connection (closing its host socket) and, for [`Close::Rst`], tells the guest.
    fn end(&mut self, key: ConnKey, close: Close, control: &EventControl) {
        let guest_knows = self.remove(key, control);
        if close == Close::Rst && guest_knows {
            self.queue_rst(key);
        }
    }

    /// Drops a connection; returns whether the guest knows of it (a REQUEST that never
    /// reached an rx buffer needs no RST).
    fn remove(&mut self, key: ConnKey, control: &EventControl) -> bool {
        let Some(connection) = self.connections.remove(&key) else {
            return false;
        };
        self.by_token.remove(&connection.token);
        if connection.registered.is_some() {
            let _ = control.remove(connection.stream.as_raw_fd());
        }
        if connection.host_initiated {
            self.host_ports.remove(&key.local_port);
        }
        if connection.queued_for_rx {
            // Connections come and go while a guest that does not read keeps the queue
            // from draining: stale entries must not pile up.
            self.rx_items
                .retain(|item| !matches!(item, RxItem::Connection(queued) if *queued == key));
        }
        connection.guest_knows()
    }

    fn queue_rst(&mut self, key: ConnKey) {
        if self.pending_rst >= MAX_QUEUED_RST {
            if self.warnings.allow() {
                log::warn!("virtio-vsock: the guest reads no rx buffers, dropping an RST");
            }
            return;
        }
        self.pending_rst += 1;
        self.rx_items.push_back(RxItem::Rst(key));
    }

    /// Fills one rx buffer with the next packet for the guest; `None` when nothing can go
    /// into it now (the caller gives the buffer back to the queue).
    pub fn fill_rx<B: BitmapSlice>(
        &mut self,
        packet: &mut VsockPacket<'_, B>,
        control: &EventControl,
    ) -> Option<u32> {
        let now = Instant::now();
        // Each item gets one try, so connections with nothing to send cannot loop.
        for _ in 0..self.rx_items.len() {
            let item = self.rx_items.pop_front()?;
            let key = match item {
                RxItem::Rst(key) => {
                    self.pending_rst -= 1;
                    return Some(self.write_rst(packet, key));
                }
                RxItem::Connection(key) => key,
            };
            let Some(connection) = self.connections.get_mut(&key) else {
                continue;
            };
            connection.queued_for_rx = false;
            match connection.fill_rx(packet, self.guest_cid, key, now) {
                RxFill::Packet(len) => {
                    self.settle(key, Ok(()), control);
                    return Some(len);
                }
                RxFill::Nothing => self.settle(key, Ok(()), control),
                RxFill::Close(close) => {
                    let _ = self.remove(key, control);
                    if close == Close::Rst {
                        return Some(self.write_rst(packet, key));
                    }
                }
            }
        }
        None
    }

    fn write_rst<B: BitmapSlice>(&mut self, packet: &mut VsockPacket<'_, B>, key: ConnKey) -> u32 {
        if let Err(error) = write_header(packet, self.guest_cid, key, Reply::bare(VSOCK_OP_RST)) {
            log::error!("virtio-vsock: cannot write an RST header: {error}");
        }
        0
    }

    fn schedule(&mut self, deadline: Instant, token: u64) {
        self.deadlines.push(Reverse((deadline, token)));
        if self.timer_set_for.is_none_or(|set_for| deadline < set_for) {
            self.set_timer(deadline, Instant::now());
        }
    }

    fn set_timer(&mut self, deadline: Instant, now: Instant) {
        // A zero duration would disarm the timer.
        let delay = deadline
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        match self.timer.reset(delay, None) {
            Ok(()) => self.timer_set_for = Some(deadline),
            Err(error) => log::error!("virtio-vsock: cannot set the timeout timer: {error}"),
        }
    }

    /// Sets the timer for the earliest deadline; `force` also when it seems set already
    /// (after it fired: setting it again is what clears its readiness).
    fn rearm_timer(&mut self, now: Instant, force: bool) {
        match self.deadlines.peek().copied() {
            Some(Reverse((deadline, _))) => {
                if force || self.timer_set_for != Some(deadline) {
                    self.set_timer(deadline, now);
                }
            }
            None => {
                if force || self.timer_set_for.is_some() {
                    if let Err(error) = self.timer.clear() {
                        log::error!("virtio-vsock: cannot clear the timeout timer: {error}");
                    }
                    self.timer_set_for = None;
                }
            }
        }
    }

    /// The timer fired: end whatever ran out of time.
    fn expire(&mut self, control: &EventControl, now: Instant) {
        while let Some(Reverse((deadline, token))) = self.deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            if token == LISTENER_TOKEN {
                if self.listener_resting {
                    match control.add(self.listener.listener.as_raw_fd(), LISTENER_TOKEN) {
                        Ok(()) => self.listener_resting = false,
                        Err(error) => {
                            log::error!("virtio-vsock: cannot wait on the listener: {error}");
                            self.deadlines
                                .push(Reverse((now + LISTENER_BACKOFF, LISTENER_TOKEN)));
                        }
                    }
                }
                continue;
            }
            if let Some(client) = self.pending_clients.get(&token) {
                if client.deadline <= now {
                    log::debug!("virtio-vsock: a host client sent no CONNECT line in time");
                    if let Some(client) = self.pending_clients.remove(&token) {
                        let _ = control.remove(client.stream.as_raw_fd());
                    }
                }
                continue;
            }
            let Some(&key) = self.by_token.get(&token) else {
                continue;
            };
            let expired = self
                .connections
                .get(&key)
                .and_then(|connection| connection.deadline)
                .is_some_and(|deadline| deadline <= now);
            if expired {
                log::debug!(
                    "virtio-vsock: connection {}:{} timed out",
                    key.local_port,
                    key.peer_port
                );
                self.end(key, Close::Rst, control);
            }
        }
        self.rearm_timer(now, true);
    }
}
