//! `gpu-agent`: the guest side of gpuvm's GPU release protocol (vmm/src/gpu_release.rs),
//! the part a Linux guest runs as a daemon around `cuda-checkpoint` (docs/gpu-snapshots.md).
//!
//! It waits for the emulated GPU to be hot-plugged, runs the `pci` checks on it and puts
//! "application state" into the device's own memory (BAR1, second page: what a CUDA
//! process keeps on the GPU). It listens on vsock port 1027 for one line per request:
//! - `RELEASE <id> <bdf>`: copies that state out of the device into guest RAM (the
//!   checkpoint), quiets the device (MSI-X, decoding and Bus Master off), answers
//!   `RELEASED <id>`, then ejects it when the VMM asks (ACPI PCI hot-plug, as
//!   `pci-hotplug` does);
//! - `ATTACH <id> <bdf>`: a device arrived there: checks it is the same model, runs the
//!   `pci` checks (DMA included), writes the checkpoint back into its memory, reads it
//!   back, and answers `RESUMED <id>`.
//!
//! A snapshot taken between the two resets every vsock connection (TRANSPORT_RESET): the
//! agent just listens again.

use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, TYPE_VSOCK};
use super::vsock::{
    live_queues, post_event_buffers, received_header, Header, EVENT_SIZE, EVENT_TRANSPORT_RESET,
    HEADER, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST, OP_RW,
    OP_SHUTDOWN, TYPE_STREAM,
};
use super::{read_ram, write_ram, Dma};
use crate::arch::{inl, outl};
use crate::args::Words;
use crate::console::exit;
use crate::hotplug::{B0EJ, PCID, PCIU};
use crate::println;

const NAME: &str = "gpu-agent";
const PORT: u32 = 1027;
const BUFFER: usize = 1024;
const RX_BUFFERS: usize = 8;
const BUF_ALLOC: u32 = 64 << 10;
/// Words of application state kept in the device's memory.
const STATE_WORDS: u64 = 512;
/// Where in BAR1 it lives (the first page is the `pci` checks' own).
const STATE_OFFSET: u64 = 4096;
const STATE_SEED: u64 = 0xc0da_5eed;
const LINE: usize = 128;

fn fail(what: core::fmt::Arguments) -> ! {
    super::fail(NAME, what)
}

/// The agent's one connection.
struct Peer {
    cid: u64,
    port: u32,
    /// Bytes received (our fwd_cnt) and sent.
    received: u32,
    sent: u32,
}

/// What the agent knows of the GPU.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gpu {
    /// None yet (or ejected) and no checkpoint: the next one that arrives is set up fresh.
    Absent,
    /// At this slot, its state loaded.
    Held(u8),
    /// Released for a snapshot: the checkpoint is in RAM, the device (if still there)
    /// waits to be ejected.
    Released(u8),
    /// Ejected after a release: waiting for ATTACH.
    Away,
}

struct Agent {
    dev: VirtioPci,
    cid: u64,
    rx: SplitQueue,
    tx: SplitQueue,
    events: SplitQueue,
    tx_buffer: u64,
    peer: Option<Peer>,
    line: [u8; LINE],
    line_len: usize,
    gpu: Gpu,
    /// Slots whose arrival the hot-plug register showed and nothing took yet.
    arrived: u32,
    checkpoint: [u64; STATE_WORDS as usize],
}

/// The device memory (BAR1) word `index` of the state, as a pointer.
fn state_word(slot: u8, index: u64) -> *mut u64 {
    let bar1 = crate::pci::bar1_address(slot);
    if bar1 == 0 || !crate::boot::is_mapped(bar1, STATE_OFFSET + 8 * STATE_WORDS) {
        fail(format_args!("BAR1 at {bar1:#x} is not usable"));
    }
    (bar1 + STATE_OFFSET + 8 * index) as *mut u64
}

fn state_checksum(slot: u8) -> u64 {
    (0..STATE_WORDS).fold(0u64, |sum, i| {
        // SAFETY: BAR1 is identity mapped (checked) and memory
        // decoding is on while the agent holds the device.
        sum.wrapping_add(unsafe { state_word(slot, i).read_volatile() }.rotate_left(i as u32))
    })
}

impl Agent {
    fn start(dma: &mut Dma) -> Agent {
        let mut dev = VirtioPci::find(NAME, TYPE_VSOCK);
        dev.initialize(0);
        let (rx, tx, events, cid) = live_queues(&dev, dma);
        let mut agent = Agent {
            dev,
            cid,
            rx,
            tx,
            events,
            tx_buffer: dma.alloc(BUFFER as u64, 64),
            peer: None,
            line: [0; LINE],
            line_len: 0,
            gpu: Gpu::Absent,
            arrived: 0,
            checkpoint: [0; STATE_WORDS as usize],
        };
        for _ in 0..RX_BUFFERS.min(agent.rx.size as usize) {
            let buffer = dma.alloc(BUFFER as u64, 64);
            agent.post(buffer);
        }
        agent.rx.notify();
        post_event_buffers(&agent.dev, &mut agent.events, dma);
        agent
    }

    fn post(&mut self, buffer: u64) {
        if let Err(err) = self
            .rx
            .add(&[Buffer::writable(buffer, BUFFER as u32)], buffer)
        {
            fail(format_args!("rx queue: {err}"));
        }
    }

    /// Sends one packet to (cid, port) with `payload`.
    fn send(&mut self, cid: u64, port: u32, op: u16, payload: &[u8]) {
        let fwd_cnt = self.peer.as_ref().map_or(0, |p| p.received);
        let header = Header {
            src_cid: self.cid,
            dst_cid: cid,
            src_port: PORT,
            dst_port: port,
            len: payload.len() as u32,
            kind: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: BUF_ALLOC,
            fwd_cnt,
        };
        write_ram(self.tx_buffer, &header.bytes());
        write_ram(self.tx_buffer + HEADER as u64, payload);
        let len = (HEADER + payload.len()) as u32;
        if let Err(err) = self.tx.add(&[Buffer::readable(self.tx_buffer, len)], 0) {
            fail(format_args!("tx queue: {err}"));
        }
        self.tx.notify();
        if let Err(err) = self.tx.wait_used() {
            fail(format_args!("tx queue: {err}"));
        }
    }

    fn reply(&mut self, line: core::fmt::Arguments) {
        let mut text = Text {
            bytes: [0; LINE],
            len: 0,
        };
        let _ = core::fmt::Write::write_fmt(&mut text, line);
        let _ = core::fmt::Write::write_str(&mut text, "\n");
        let Some(peer) = &mut self.peer else { return };
        let (cid, port) = (peer.cid, peer.port);
        peer.sent = peer.sent.wrapping_add(text.len as u32);
        self.send(cid, port, OP_RW, &text.bytes[..text.len]);
    }

    /// Takes one packet off the rx queue, if any.
    fn poll_packet(&mut self) {
        let used = match self.rx.pop_used() {
            Ok(Some(used)) => used,
            Ok(None) => return,
            Err(err) => fail(format_args!("rx queue: {err}")),
        };
        let packet = received_header(&self.dev, &used, BUFFER - HEADER);
        let len = packet.len as usize;
        let mut payload = [0u8; BUFFER - HEADER];
        read_ram(used.token + HEADER as u64, &mut payload[..len]);
        self.post(used.token);
        self.rx.notify();
        self.handle(packet, &payload[..len]);
    }

    fn handle(&mut self, packet: Header, payload: &[u8]) {
        let ours = self
            .peer
            .as_ref()
            .is_some_and(|p| p.cid == packet.src_cid && p.port == packet.src_port);
        if packet.kind != TYPE_STREAM || packet.dst_port != PORT {
            if packet.op != OP_RST {
                self.send(packet.src_cid, packet.src_port, OP_RST, &[]);
            }
            return;
        }
        match packet.op {
            OP_REQUEST => {
                // One VMM at a time; a new connection replaces a stale one.
                self.peer = Some(Peer {
                    cid: packet.src_cid,
                    port: packet.src_port,
                    received: 0,
                    sent: 0,
                });
                self.line_len = 0;
                self.send(packet.src_cid, packet.src_port, OP_RESPONSE, &[]);
            }
            _ if !ours => {
                if packet.op != OP_RST {
                    self.send(packet.src_cid, packet.src_port, OP_RST, &[]);
                }
            }
            OP_RW => {
                if let Some(peer) = &mut self.peer {
                    peer.received = peer.received.wrapping_add(payload.len() as u32);
                }
                for &byte in payload {
                    if byte == b'\n' {
                        let mut line = [0u8; LINE];
                        let len = self.line_len;
                        line[..len].copy_from_slice(&self.line[..len]);
                        self.line_len = 0;
                        self.command(&line[..len]);
                    } else if self.line_len < LINE {
                        self.line[self.line_len] = byte;
                        self.line_len += 1;
                    }
                }
            }
            OP_CREDIT_REQUEST => {
                let (cid, port) = (packet.src_cid, packet.src_port);
                self.send(cid, port, OP_CREDIT_UPDATE, &[]);
            }
            OP_SHUTDOWN => {
                let (cid, port) = (packet.src_cid, packet.src_port);
                self.send(cid, port, OP_RST, &[]);
                self.peer = None;
            }
            OP_RST => self.peer = None,
            _ => {}
        }
    }

    fn poll_event(&mut self) {
        let used = match self.events.pop_used() {
            Ok(Some(used)) => used,
            Ok(None) => return,
            Err(err) => fail(format_args!("event queue: {err}")),
        };
        let mut id = [0u8; 4];
        read_ram(used.token, &mut id);
        if u32::from_le_bytes(id) == EVENT_TRANSPORT_RESET {
            self.peer = None;
            self.cid = self.dev.read_config(|dev| dev.config64(0));
            println!(
                "{NAME}: transport reset, listening again (cid {})",
                self.cid
            );
        }
        let _ = self
            .events
            .add(&[Buffer::writable(used.token, EVENT_SIZE)], used.token);
        self.events.notify();
    }

    /// Hot-plug registers: arrivals are remembered, eject requests served.
    fn poll_hotplug(&mut self) {
        self.arrived |= inl(PCIU);
        let down = inl(PCID);
        if down == 0 {
            return;
        }
        for slot in 0..32u8 {
            if down & 1 << slot == 0 {
                continue;
            }
            match self.gpu {
                Gpu::Released(held) if held == slot => {
                    outl(B0EJ, 1 << slot);
                    if crate::pci::vendor_device(slot) != 0xffff_ffff {
                        fail(format_args!(
                            "00:{slot:02x}.0 is still there after the eject"
                        ));
                    }
                    self.gpu = Gpu::Away;
                    println!("{NAME}: ejected 00:{slot:02x}.0");
                }
                Gpu::Held(held) if held == slot => {
                    // Unplugged without a release: its state is lost, as on real hardware.
                    crate::pci::release_device(slot);
                    outl(B0EJ, 1 << slot);
                    self.gpu = Gpu::Absent;
                    println!("{NAME}: ejected 00:{slot:02x}.0 without a release (state dropped)");
                }
                _ => println!("{NAME}: eject request for 00:{slot:02x}.0 ignored"),
            }
        }
    }

    /// A fresh device: `pci` checks, then the state written into its memory.
    fn take_new(&mut self, slot: u8) {
        if !crate::pci::is_gpu(slot) {
            fail(format_args!("00:{slot:02x}.0 is not the emulated GPU"));
        }
        crate::pci::check_device(slot, false);
        for i in 0..STATE_WORDS {
            let value = crate::pattern::pattern(STATE_SEED, i * 8);
            // SAFETY: see `state_checksum`.
            unsafe { state_word(slot, i).write_volatile(value) };
        }
        self.gpu = Gpu::Held(slot);
        println!(
            "{NAME}: holding 00:{slot:02x}.0, state checksum={:#018x}",
            state_checksum(slot)
        );
    }

    fn command(&mut self, line: &[u8]) {
        let Ok(text) = core::str::from_utf8(line) else {
            self.reply(format_args!("ERROR - not text"));
            return;
        };
        let mut words = text.split(' ');
        let (verb, id, bdf) = (words.next(), words.next(), words.next());
        let (Some(verb), Some(id), Some(bdf)) = (verb, id, bdf) else {
            self.reply(format_args!("ERROR - expected VERB ID BDF"));
            return;
        };
        let Some(slot) = parse_slot(bdf) else {
            self.reply(format_args!("ERROR {id} bad address {bdf}"));
            return;
        };
        println!("{NAME}: {verb} {id} {bdf}");
        match (verb, self.gpu) {
            ("RELEASE", Gpu::Held(held)) if held == slot => {
                for i in 0..STATE_WORDS {
                    // SAFETY: see `state_checksum`.
                    self.checkpoint[i as usize] = unsafe { state_word(slot, i).read_volatile() };
                }
                let sum = state_checksum(slot);
                crate::pci::release_device(slot);
                self.gpu = Gpu::Released(slot);
                println!("{NAME}: released {id}, checkpoint checksum={sum:#018x}");
                self.reply(format_args!("RELEASED {id}"));
            }
            ("RELEASE", _) => self.reply(format_args!("ERROR {id} no device held at {bdf}")),
            ("ATTACH", Gpu::Away | Gpu::Released(_)) => self.attach(id, slot),
            ("ATTACH", _) => self.reply(format_args!("ERROR {id} nothing was released")),
            _ => self.reply(format_args!("ERROR {id} unknown request {verb}")),
        }
    }

    /// The device given back after a release: same model, `pci` checks, state restored.
    fn attach(&mut self, id: &str, slot: u8) {
        self.arrived |= inl(PCIU);
        // Handed back without leaving (the VMM gave up on the snapshot): the same device.
        let never_left = self.gpu == Gpu::Released(slot);
        if !never_left && self.arrived & 1 << slot == 0 {
            self.reply(format_args!("ERROR {id} no device arrived at slot {slot}"));
            return;
        }
        self.arrived &= !(1 << slot);
        if !crate::pci::is_gpu(slot) {
            self.reply(format_args!("ERROR {id} 00:{slot:02x}.0 is another model"));
            return;
        }
        crate::pci::check_device(slot, false);
        // What the new device holds before the restore (a reset device: not our state).
        let before = state_checksum(slot);
        for (i, value) in self.checkpoint.iter().enumerate() {
            // SAFETY: see `state_checksum`.
            unsafe { state_word(slot, i as u64).write_volatile(*value) };
        }
        for (i, value) in self.checkpoint.iter().enumerate() {
            // SAFETY: as above.
            let got = unsafe { state_word(slot, i as u64).read_volatile() };
            if got != *value {
                fail(format_args!("restored state word {i} reads back {got:#x}"));
            }
        }
        for i in 0..STATE_WORDS {
            if self.checkpoint[i as usize] != crate::pattern::pattern(STATE_SEED, i * 8) {
                fail(format_args!(
                    "checkpoint word {i} is not the state it saved"
                ));
            }
        }
        self.gpu = Gpu::Held(slot);
        println!(
            "{NAME}: resumed {id} at 00:{slot:02x}.0, state checksum={:#018x} (device held {before:#018x} before the restore)",
            state_checksum(slot)
        );
        self.reply(format_args!("RESUMED {id}"));
    }
}

/// A reply line being formatted (cut at LINE bytes; the last one stays a newline).
struct Text {
    bytes: [u8; LINE],
    len: usize,
}

impl core::fmt::Write for Text {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for &byte in s.as_bytes() {
            if self.len == LINE {
                self.bytes[LINE - 1] = b'\n';
                return Ok(());
            }
            self.bytes[self.len] = byte;
            self.len += 1;
        }
        Ok(())
    }
}

/// The device number of "0000:00:XX.0" (bus 0, function 0 only).
fn parse_slot(bdf: &str) -> Option<u8> {
    let rest = bdf.strip_prefix("0000:00:")?;
    let (device, function) = rest.split_once('.')?;
    if function != "0" {
        return None;
    }
    u8::from_str_radix(device, 16).ok().filter(|d| *d < 32)
}

pub fn run(dma: &mut Dma, _words: &mut Words) -> ! {
    let mut agent = Agent::start(dma);
    println!("{NAME}: listening on vsock port {PORT} (cid {})", agent.cid);
    let mut round = 0u32;
    loop {
        agent.poll_event();
        agent.poll_packet();
        // Each register read exits to the VMM: look at hot-plug less often than at RAM.
        round = round.wrapping_add(1);
        if round % 256 == 0 {
            agent.poll_hotplug();
        }
        if agent.gpu == Gpu::Absent && agent.arrived != 0 {
            let slot = agent.arrived.trailing_zeros() as u8;
            agent.arrived &= !(1 << slot);
            agent.take_new(slot);
        }
        crate::arch::pause();
    }
    #[allow(unreachable_code)]
    exit(0)
}
