//! The device's I/O thread: starts and stops the backend's rings, and relays the
//! backend's call eventfds to the guest.
//!
//! The extra hop: a backend signals a queue's call eventfd, this thread reads it and calls
//! [`VirtioInterrupt::signal_queue`], which sets the ISR bit and fires the queue's MSI-X
//! vector (or holds it pending while masked). One eventfd read and one irqfd write per
//! interrupt batch, on a thread that does nothing else. The thread also watches the
//! backend's socket for a hang-up: a backend that dies marks the device broken at once,
//! not at the next request.
//!
//! Every vhost-user request runs on this thread (a vCPU thread, which activates and resets
//! devices, may not do a device's I/O): the ring setup inside [`WorkerHandler::register`]
//! (so [`Worker::spawn`](crate::worker::Worker::spawn) returns its outcome), the ring
//! stop on a request over [`StopRequest`].

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::connection::{mark_broken, Connection, PROTOCOL_FEATURES_BIT};
use super::VhostUserError;
use crate::worker::{EventControl, WorkerHandler};
use crate::{GuestMemory, QueuePosition, VirtioInterrupt};

/// Queue tokens are the queue indices (below 2^16); these come after them.
const SOCKET_TOKEN: u64 = 1 << 32;
const STOP_TOKEN: u64 = (1 << 32) + 1;

/// The memory table every backend takes without CONFIGURE_MEM_SLOTS (libvhost-user's
/// VHOST_MEMORY_BASELINE_NREGIONS).
const MAX_MEMORY_REGIONS: usize = 8;

/// One queue the driver enabled, as the backend runs it.
pub(super) struct RingQueue {
    pub index: usize,
    /// Addresses, size and (after a stop) the positions.
    pub queue: Queue,
    /// The transport's kick eventfd, handed to the backend.
    pub kick: EventFd,
    /// Ours: the backend signals it, the relay reads it.
    pub call: EventFd,
}

/// What it takes to start the backend's rings (again, after a pause).
pub(super) struct Rings {
    pub memory: GuestMemory,
    pub acked_features: u64,
    pub queues: Vec<RingQueue>,
    /// How many queues the device has (positions are reported for each).
    pub total_queues: usize,
    pub interrupt: Arc<dyn VirtioInterrupt>,
}

impl Rings {
    /// Where each queue stands, as of the last stop.
    pub fn positions(&self) -> Vec<Option<QueuePosition>> {
        let mut positions = vec![None; self.total_queues];
        for ring in &self.queues {
            if let Some(slot) = positions.get_mut(ring.index) {
                *slot = Some(QueuePosition {
                    next_avail: ring.queue.next_avail(),
                    next_used: ring.queue.next_used(),
                });
            }
        }
        positions
    }
}

/// Asks the I/O thread to stop the rings; the positions come back on the channel.
pub(super) struct StopRequest {
    pub signal: EventFd,
    pub done: Sender<()>,
}

pub(super) struct RelayHandler {
    connection: Arc<Mutex<Connection>>,
    rings: Rings,
    owner: String,
    socket: Arc<OwnedFd>,
    socket_path: PathBuf,
    broken: Arc<AtomicBool>,
    stop: StopRequest,
    /// Taken by `register`: the ring setup's outcome, typed, for the activating thread.
    setup_outcome: Option<Sender<Result<(), VhostUserError>>>,
    failed_signals: u64,
}

impl RelayHandler {
    pub fn new(
        connection: Arc<Mutex<Connection>>,
        rings: Rings,
        stop: StopRequest,
        setup_outcome: Sender<Result<(), VhostUserError>>,
    ) -> RelayHandler {
        let (owner, socket, socket_path, broken) = {
            let c = crate::lock(&connection);
            (
                c.owner().to_string(),
                c.socket(),
                c.socket_path().to_path_buf(),
                c.broken_flag(),
            )
        };
        RelayHandler {
            connection,
            rings,
            owner,
            socket,
            socket_path,
            broken,
            stop,
            setup_outcome: Some(setup_outcome),
            failed_signals: 0,
        }
    }

    pub fn into_rings(self) -> Rings {
        self.rings
    }

    /// SET_FEATURES, SET_MEM_TABLE, then each ring. On failure the rings already started
    /// are stopped again, so the backend leaves guest memory alone.
    fn start_rings(&mut self) -> Result<(), VhostUserError> {
        let result = start_rings(&mut crate::lock(&self.connection), &self.rings);
        if result.is_err() {
            stop_rings(&mut crate::lock(&self.connection), &mut self.rings);
        }
        result
    }
}

fn start_rings(connection: &mut Connection, rings: &Rings) -> Result<(), VhostUserError> {
    connection.renegotiate_if_adopted()?;
    let backend = connection.backend_features();
    let features = (rings.acked_features & backend) | (backend & PROTOCOL_FEATURES_BIT);
    connection.request("SET_FEATURES", |f| f.set_features(features))?;
    let mut table = memory_table(&rings.memory)?;
    connection.announce_table(&mut table);
    connection.request("SET_MEM_TABLE", |f| f.set_mem_table(&table).map(drop))?;
    for ring in &rings.queues {
        let index = ring.index;
        let queue = &ring.queue;
        let size = u64::from(queue.size());
        let config = VringConfigData {
            queue_max_size: queue.max_size(),
            queue_size: queue.size(),
            flags: 0,
            desc_table_addr: connection.frontend_address(
                queue.desc_table(),
                host_address(
                    &rings.memory,
                    index,
                    "descriptor table",
                    queue.desc_table(),
                    16 * size,
                )?,
            ),
            used_ring_addr: connection.frontend_address(
                queue.used_ring(),
                host_address(
                    &rings.memory,
                    index,
                    "used ring",
                    queue.used_ring(),
                    6 + 8 * size,
                )?,
            ),
            avail_ring_addr: connection.frontend_address(
                queue.avail_ring(),
                host_address(
                    &rings.memory,
                    index,
                    "available ring",
                    queue.avail_ring(),
                    6 + 2 * size,
                )?,
            ),
            log_addr: None,
        };
        connection.request("SET_VRING_NUM", |f| f.set_vring_num(index, queue.size()))?;
        connection.request("SET_VRING_ADDR", |f| f.set_vring_addr(index, &config))?;
        connection.request("SET_VRING_BASE", |f| {
            f.set_vring_base(index, queue.next_avail())
        })?;
        connection.request("SET_VRING_CALL", |f| f.set_vring_call(index, &ring.call))?;
        connection.request("SET_VRING_KICK", |f| f.set_vring_kick(index, &ring.kick))?;
        if connection.has_vring_enable() {
            connection.request("SET_VRING_ENABLE", |f| f.set_vring_enable(index, true))?;
        }
    }
    Ok(())
}

/// Stops each ring (SET_VRING_ENABLE 0, GET_VRING_BASE) and records where it stands: the
/// next available index is the backend's; the next used index is the used ring's `idx`
/// in guest memory (a stopped backend has completed what it took). Without an answer (a
/// dead backend) the available position is taken to be the used one: whatever the
/// backend took and never completed is lost with it.
fn stop_rings(connection: &mut Connection, rings: &mut Rings) {
    for ring in &mut rings.queues {
        let index = ring.index;
        if connection.has_vring_enable() {
            let _ = connection.request("SET_VRING_ENABLE", |f| f.set_vring_enable(index, false));
        }
        let base = connection.request("GET_VRING_BASE", |f| f.get_vring_base(index));
        let used = rings
            .memory
            .read_obj::<u16>(GuestAddress(ring.queue.used_ring()).unchecked_add(2))
            .map(u16::from_le)
            .unwrap_or(ring.queue.next_used());
        let avail = match base {
            Ok(base) => base as u16,
            Err(error) => {
                log::warn!(
                    "{}: queue {index}: no ring position from the backend: {error}",
                    connection.owner()
                );
                used
            }
        };
        ring.queue.set_next_avail(avail);
        ring.queue.set_next_used(used);
    }
}

/// The host address of `[guest_address, guest_address + len)`, which must lie in one
/// mapping (the backend translates ring addresses through the memory table).
fn host_address(
    memory: &GuestMemory,
    queue: usize,
    ring: &'static str,
    guest_address: u64,
    len: u64,
) -> Result<u64, VhostUserError> {
    let error = || VhostUserError::RingAddress {
        queue,
        ring,
        address: guest_address,
    };
    let last = guest_address.checked_add(len - 1).ok_or_else(error)?;
    let start = memory
        .get_host_address(GuestAddress(guest_address))
        .map_err(|_| error())?;
    let end = memory
        .get_host_address(GuestAddress(last))
        .map_err(|_| error())?;
    if (end as u64).wrapping_sub(start as u64) != len - 1 {
        return Err(error());
    }
    Ok(start as u64)
}

/// SET_MEM_TABLE's regions: each guest RAM region's file (memfd) and offset, and where
/// gpuvm maps it (ring addresses are given in gpuvm's address space).
pub(super) fn memory_table(
    memory: &GuestMemory,
) -> Result<Vec<VhostUserMemoryRegionInfo>, VhostUserError> {
    let regions = memory.num_regions();
    if regions > MAX_MEMORY_REGIONS {
        return Err(VhostUserError::TooManyRegions {
            regions,
            max: MAX_MEMORY_REGIONS,
        });
    }
    memory
        .iter()
        .map(|region| {
            VhostUserMemoryRegionInfo::from_guest_region(region).map_err(|_| {
                VhostUserError::MemoryNotShareable {
                    start: region.start_addr().raw_value(),
                    size: region.len(),
                }
            })
        })
        .collect()
}

impl WorkerHandler for RelayHandler {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        if let Some(outcome) = self.setup_outcome.take() {
            let result = self.start_rings();
            let message = result.as_ref().err().map(ToString::to_string);
            let _ = outcome.send(result);
            if let Some(message) = message {
                return Err(std::io::Error::other(message));
            }
        }
        for ring in &self.rings.queues {
            control.add(ring.call.as_raw_fd(), ring.index as u64)?;
        }
        control.add(self.stop.signal.as_raw_fd(), STOP_TOKEN)?;
        // Hang-ups only: the backend sends nothing unasked on this socket.
        control.add_with(
            self.socket.as_raw_fd(),
            SOCKET_TOKEN,
            EventSet::READ_HANG_UP,
        )
    }

    fn handle_event(&mut self, token: u64, events: EventSet, control: &EventControl) {
        match token {
            SOCKET_TOKEN => {
                mark_broken(
                    &self.broken,
                    &self.owner,
                    &self.socket_path,
                    &format!("its socket hung up ({events:?})"),
                );
                let _ = control.remove(self.socket.as_raw_fd());
            }
            STOP_TOKEN => {
                let _ = self.stop.signal.read();
                stop_rings(&mut crate::lock(&self.connection), &mut self.rings);
                let _ = self.stop.done.send(());
            }
            index => {
                let Some(ring) = self.rings.queues.iter().find(|r| r.index as u64 == index) else {
                    return;
                };
                // Nothing to read: another wake-up already took the count.
                if ring.call.read().is_err() {
                    return;
                }
                if let Err(error) = self.rings.interrupt.signal_queue(ring.index as u16) {
                    self.failed_signals += 1;
                    if self.failed_signals.is_power_of_two() {
                        log::warn!(
                            "{}: cannot interrupt the guest for queue {} ({} times): {error}",
                            self.owner,
                            ring.index,
                            self.failed_signals
                        );
                    }
                }
            }
        }
    }
}
