//! One device under attack: its rings and setup, the request every attack bends, how an
//! attack's answer is classified, the good request that must work afterwards, and the loop
//! that runs one attack and prints its line.

use core::fmt::Write;

use super::blk::blk_header;
use super::driver::{Dev, Kind, Ring, Template, D};
use super::memory::{fill, get16, get8, put16, put32, put8};
use super::net::{net_frame, NET_FRAME, NET_HEADER};
use super::vsock::{vsock_op, VSOCK_HEADER};
use super::{
    fail, Outcome, Text, ATTACK_WAIT_MS, DATA, GOOD_WAIT_MS, HDR, MAX_QUEUES, MAX_QUEUE_SIZE, NAME,
    RINGS, RING_STRIDE, STATUS,
};
use crate::println;
use crate::virtio::blk::T_IN;
use crate::virtio::transport::{
    COMMON_QUEUE_DESC, COMMON_QUEUE_DEVICE, COMMON_QUEUE_DRIVER, COMMON_QUEUE_ENABLE,
    COMMON_QUEUE_NOTIFY_OFF, COMMON_QUEUE_SIZE, STATUS_DRIVER_OK, STATUS_NEEDS_RESET,
};
use crate::virtio::vsock::OP_RW;

pub(super) struct Session {
    pub(super) dev: Dev,
    pub(super) rings: [Ring; MAX_QUEUES],
    pub(super) features: u64,
    /// Block: capacity in sectors. Socket: the guest's CID.
    pub(super) capacity: u64,
    pub(super) cid: u64,
    pub(super) ram_end: u64,
    /// Good requests so far (each writes a different pattern / uses a different port).
    pub(super) checks: u32,
    /// Attacks on this device so far (each names its own socket port).
    pub(super) tag: u32,
    /// The device must be reset and set up again before the next request.
    pub(super) dirty: bool,
    /// Receive queue (socket): used elements consumed so far, buffers to give back.
    pub(super) rx_seen: u16,
    pub(super) rx_repost: u16,
    /// Ranges the device may write during the current attack (clipped to the area).
    pub(super) writable: [(u64, u64); 24],
    pub(super) writable_len: usize,
    /// Whether the area was copied for the current attack and awaits the comparison.
    pub(super) armed: bool,
    /// The attack under way, for failure messages.
    pub(super) current: Text,
    /// `virtio-hostile storm`: the notification storm too.
    pub(super) storm: bool,
}

impl Session {
    pub(super) fn new(dev: Dev, ram_end: u64) -> Session {
        Session {
            dev,
            rings: [Ring::default(); MAX_QUEUES],
            features: 0,
            capacity: 0,
            cid: 0,
            ram_end,
            checks: 0,
            tag: 0,
            dirty: true,
            rx_seen: 0,
            rx_repost: 0,
            writable: [(0, 0); 24],
            writable_len: 0,
            armed: false,
            current: Text::new(),
            storm: false,
        }
    }

    pub(super) fn kind(&self) -> Kind {
        self.dev.kind
    }

    pub(super) fn attack_ring(&self) -> Ring {
        self.rings[usize::from(self.kind().attack_queue())]
    }

    /// Queue `queue`'s rings from its registers; `size` is written unless `None` (then the
    /// size the device reports is used). The rings are zeroed, interrupts suppressed.
    pub(super) fn setup_queue(&mut self, queue: u16, size: Option<u16>) -> Result<Ring, Text> {
        self.dev.select(queue);
        let max = get16(self.dev.common + COMMON_QUEUE_SIZE);
        if max == 0 {
            return Err(text!("queue {queue} has size 0"));
        }
        let size = match size {
            Some(size) => {
                put16(self.dev.common + COMMON_QUEUE_SIZE, size);
                get16(self.dev.common + COMMON_QUEUE_SIZE)
            }
            None => max,
        };
        if size == 0 || size > MAX_QUEUE_SIZE {
            return Err(text!("queue {queue} size reads {size}"));
        }
        let notify_off = get16(self.dev.common + COMMON_QUEUE_NOTIFY_OFF);
        let notify_offset = u64::from(notify_off) * u64::from(self.dev.notify_multiplier);
        if notify_offset + 2 > u64::from(self.dev.notify_len) {
            return Err(text!(
                "queue {queue} notify offset {notify_offset:#x} outside"
            ));
        }
        let base = RINGS + u64::from(queue) * RING_STRIDE;
        fill(base, 3 * 4096, 0);
        let ring = Ring {
            queue,
            size,
            desc: base,
            avail: base + 4096,
            used: base + 8192,
            notify: self.dev.notify + notify_offset,
            next_avail: 0,
        };
        // VIRTQ_AVAIL_F_NO_INTERRUPT: the driver polls.
        put16(ring.avail, 1);
        put32(self.dev.common + COMMON_QUEUE_DESC, ring.desc as u32);
        put32(
            self.dev.common + COMMON_QUEUE_DESC + 4,
            (ring.desc >> 32) as u32,
        );
        put32(self.dev.common + COMMON_QUEUE_DRIVER, ring.avail as u32);
        put32(self.dev.common + COMMON_QUEUE_DRIVER + 4, 0);
        put32(self.dev.common + COMMON_QUEUE_DEVICE, ring.used as u32);
        put32(self.dev.common + COMMON_QUEUE_DEVICE + 4, 0);
        put16(self.dev.common + COMMON_QUEUE_ENABLE, 1);
        self.rings[usize::from(queue)] = ring;
        Ok(ring)
    }

    pub(super) fn setup_queues(&mut self, attack_queue_size: Option<u16>) -> Result<(), Text> {
        let needed = self.kind().queues();
        let offered = self.dev.num_queues();
        if offered < needed {
            return Err(text!("{offered} queues, the driver needs {needed}"));
        }
        for queue in 0..needed {
            let size = if queue == self.kind().attack_queue() {
                attack_queue_size
            } else {
                None
            };
            let size = match size {
                Some(size) => Some(size),
                // The largest power of two up to MAX_QUEUE_SIZE.
                None => {
                    self.dev.select(queue);
                    let max = get16(self.dev.common + COMMON_QUEUE_SIZE).min(MAX_QUEUE_SIZE);
                    if max == 0 {
                        return Err(text!("queue {queue} has size 0"));
                    }
                    Some(1u16 << (15 - max.leading_zeros()))
                }
            };
            self.setup_queue(queue, size)?;
        }
        Ok(())
    }

    /// What follows DRIVER_OK: configuration read, socket receive buffers posted.
    pub(super) fn after_driver_ok(&mut self) -> Result<(), Text> {
        let status = self.dev.status();
        if status & STATUS_DRIVER_OK == 0 || status & STATUS_NEEDS_RESET != 0 {
            return Err(text!("status {status:#x} after DRIVER_OK"));
        }
        match self.kind() {
            Kind::Blk => self.capacity = self.dev.config64(0),
            Kind::Vsock => {
                self.cid = self.dev.config64(0);
                self.rx_seen = 0;
                self.post_rx(u16::MAX);
            }
            _ => {}
        }
        self.dirty = false;
        Ok(())
    }

    /// Reset and the whole initialization (spec 3.1.1).
    pub(super) fn bring_up(&mut self) -> Result<(), Text> {
        self.dev.reset();
        self.features = self.dev.negotiate(self.kind().features())?;
        self.setup_queues(None)?;
        self.dev.driver_ok();
        self.after_driver_ok()
    }

    /// Reset and features again (FAIL where that does not work), with `queues` the queues
    /// too: the start of an attack on the initialization.
    pub(super) fn renegotiate(&mut self, queues: bool) {
        self.dev.reset();
        if let Err(err) = self.dev.negotiate(self.kind().features()) {
            fail(format_args!("{}: {err}", self.kind().name()));
        }
        if queues {
            if let Err(err) = self.setup_queues(None) {
                fail(format_args!("{}: {err}", self.kind().name()));
            }
        }
    }

    pub(super) fn restart(&mut self, why: &str) {
        if let Err(err) = self.bring_up() {
            fail(format_args!(
                "{}: cannot set the device up again {why}: {err}",
                self.kind().name()
            ));
        }
    }

    // -- The watched area.
    /// A well-formed request for the attacked queue; writes its header. `tag` makes a
    /// socket request's port unique.
    pub(super) fn template(&mut self) -> Template {
        let unused = D::r(0, 0);
        match self.kind() {
            Kind::Blk => {
                blk_header(T_IN, 0);
                put8(STATUS, 0xff);
                Template {
                    d: [D::r(HDR, 16), D::w(DATA, 512), D::w(STATUS, 1), unused],
                    n: 3,
                    payload: 1,
                }
            }
            Kind::Rng => Template {
                d: [D::w(DATA, 64), unused, unused, unused],
                n: 1,
                payload: 0,
            },
            Kind::Vsock => {
                // Data for a connection that does not exist: answered with RST.
                self.vsock_header(self.to_closed_port(self.attack_port(), 16, OP_RW));
                Template {
                    d: [D::r(HDR, VSOCK_HEADER), D::r(DATA, 16), unused, unused],
                    n: 2,
                    payload: 1,
                }
            }
            Kind::Net => {
                net_frame(HDR);
                Template {
                    d: [D::r(HDR, NET_HEADER + NET_FRAME), unused, unused, unused],
                    n: 1,
                    payload: 0,
                }
            }
        }
    }

    /// Writes `descs` at table indices 0.., offers `head`, notifies and classifies.
    pub(super) fn submit(&mut self, descs: &[D], head: u16) -> Outcome {
        let table = self.attack_ring().desc;
        for (i, &d) in descs.iter().enumerate() {
            self.desc(table, i as u32, d);
        }
        self.offer_and_classify(head, None)
    }

    /// Offers `head` (and then publishes `avail_index` instead of the next index, when
    /// given), notifies, waits for the device and says what it did.
    pub(super) fn offer_and_classify(&mut self, head: u16, avail_index: Option<u16>) -> Outcome {
        let queue = usize::from(self.kind().attack_queue());
        let mut ring = self.rings[queue];
        let since = ring.used_index();
        ring.offer(head);
        if let Some(index) = avail_index {
            put16(ring.avail + 2, index);
        }
        self.rings[queue] = ring;
        self.arm();
        ring.notify();
        self.classify(since, head)
    }

    /// Waits for the attacked queue's answer after `since`.
    pub(super) fn classify(&mut self, since: u16, head: u16) -> Outcome {
        let ring = self.attack_ring();
        let answer = ring.wait_used(since, ATTACK_WAIT_MS);
        self.check();
        let status = self.dev.status();
        let Some((id, len)) = answer else {
            if status & STATUS_NEEDS_RESET != 0 {
                return Outcome::broken(text!("needs reset (status {status:#x})"));
            }
            return Outcome::broken(text!("dropped (no answer within {ATTACK_WAIT_MS} ms)"));
        };
        let mut text = match self.kind() {
            Kind::Blk => match get8(STATUS) {
                0xff => text!("returned unanswered, len {len}"),
                status => text!("answered status {status}"),
            },
            Kind::Rng => text!("returned {len} bytes"),
            Kind::Net => text!("returned"),
            Kind::Vsock => match self.vsock_reply(self.attack_port(), 200) {
                Some(op) => text!("returned, answered op {}", vsock_op(op)),
                None => text!("returned, no reply"),
            },
        };
        if id != u32::from(head) {
            let _ = write!(text, " (used id {id}, head {head})");
        }
        if status & STATUS_NEEDS_RESET != 0 {
            let _ = write!(text, ", needs reset (status {status:#x})");
            return Outcome::broken(text);
        }
        Outcome::fine(text)
    }

    /// One request that must work: Err says how it did not.
    pub(super) fn good(&mut self) -> Result<(), Text> {
        self.checks += 1;
        self.repost_rx();
        match self.kind() {
            Kind::Blk => self.good_blk(),
            Kind::Rng => self.good_rng(),
            Kind::Net => self.good_net(),
            Kind::Vsock => self.good_vsock(),
        }
    }

    /// Offers descriptor `head` of the attacked queue (already written) and waits for it.
    pub(super) fn good_request(&mut self, head: u16) -> Option<(u32, u32)> {
        let queue = usize::from(self.kind().attack_queue());
        let mut ring = self.rings[queue];
        let since = ring.used_index();
        ring.offer(head);
        ring.notify();
        self.rings[queue] = ring;
        ring.wait_used(since, GOOD_WAIT_MS)
    }

    /// Runs one attack: a clean device first, the attack, the comparison of the area, then
    /// a good request (after a reset where the attack left the device broken, or where the
    /// request fails without one). One line per attack.
    pub(super) fn attack(
        &mut self,
        counter: &mut u32,
        name: &str,
        f: impl FnOnce(&mut Session) -> Outcome,
    ) {
        if self.dirty {
            self.restart("before the attack");
        }
        self.repost_rx();
        self.tag += 1;
        self.writable_len = 0;
        self.current = text!("{name}");
        let outcome = f(self);
        self.check();
        let kind = self.kind().name();
        let mut suffix = "";
        if outcome.reset || self.dirty {
            self.restart("after the attack");
            if let Err(err) = self.good() {
                fail(format_args!(
                    "{kind} {name}: ({}) the device does not work after a reset: {err}",
                    outcome.text
                ));
            }
        } else if let Err(first) = self.good() {
            self.restart("after a failed good request");
            if let Err(err) = self.good() {
                fail(format_args!(
                    "{kind} {name}: ({}) the device does not work, not even after a reset: {first}; {err}",
                    outcome.text
                ));
            }
            suffix = "; stuck until reset";
        }
        *counter += 1;
        println!("{NAME}: {kind} {name}: {}{suffix}", outcome.text);
    }
}
