//! PCI-to-PCI bridges as PCIe ports: a root port, a switch's upstream port and its
//! downstream ports. Each is one function with a type-1 header (bus numbers, the memory,
//! prefetchable-memory and I/O windows) and a PCIe capability saying which kind of port it
//! is; root ports and downstream ports also carry a slot (its number). An empty root port
//! for hot-plug has a PCIe native hot-plug slot and an MSI for its events
//! ([`PciBridge::make_hotplug_slot`]); the other slots have no hot-plug.
//!
//! gpuvm acts as firmware: the VMM builds each bridge with bus numbers and windows that
//! already hold what sits behind it, so a guest (Linux keeps valid firmware assignments)
//! can use them as they are. The guest may rewrite them; [`PciBridge::buses`] follows what
//! it wrote, which is what [`super::PciRoot`] routes configuration cycles by. BAR accesses
//! are routed by address, so the windows are bookkeeping for the guest, not a filter.

use std::sync::Arc;

use super::{config, read_le, BarSpec, MsiMessage, MsiRouting, PciBar, PciDevice};
use crate::Persist;

/// Red Hat's vendor ID and its ID for a generic PCIe root port (what QEMU's
/// pcie-root-port shows); the switch ports get neighbouring IDs of gpuvm's choosing, as
/// guests find ports by class and PCIe port type, not by ID.
const VENDOR_ID: u16 = 0x1b36;
const ROOT_PORT_DEVICE_ID: u16 = 0x000c;
const UPSTREAM_PORT_DEVICE_ID: u16 = 0x0110;
const DOWNSTREAM_PORT_DEVICE_ID: u16 = 0x0111;

/// Type-1 header registers.
pub mod regs {
    pub const PRIMARY_BUS: u16 = 0x18;
    pub const SECONDARY_BUS: u16 = 0x19;
    pub const SUBORDINATE_BUS: u16 = 0x1a;
    pub const IO_BASE: u16 = 0x1c;
    pub const IO_LIMIT: u16 = 0x1d;
    pub const MEMORY_BASE: u16 = 0x20;
    pub const MEMORY_LIMIT: u16 = 0x22;
    pub const PREF_BASE: u16 = 0x24;
    pub const PREF_LIMIT: u16 = 0x26;
    pub const PREF_BASE_UPPER: u16 = 0x28;
    pub const PREF_LIMIT_UPPER: u16 = 0x2c;
    pub const BRIDGE_CONTROL: u16 = 0x3e;
    /// Where the PCIe capability sits.
    pub const PCIE_CAP: u16 = 0x40;
    pub const CAP_ID_PCIE: u8 = 0x10;
    /// Offsets inside the PCIe capability.
    pub const PCIE_FLAGS: u16 = 0x02;
    pub const LINK_CAP: u16 = 0x0c;
    pub const LINK_STATUS: u16 = 0x12;
    pub const SLOT_CAP: u16 = 0x14;
    pub const SLOT_CONTROL: u16 = 0x18;
    pub const SLOT_STATUS: u16 = 0x1a;
    pub const LINK_CAP2: u16 = 0x2c;
    /// Slot status: a card is present.
    pub const PRESENCE_DETECT_STATE: u16 = 1 << 6;
    /// Link status: the data link layer is up.
    pub const DLL_LINK_ACTIVE: u16 = 1 << 13;
    /// Slot capabilities of a hot-plug slot: Attention Button Present, Power Controller
    /// Present, Hot-Plug Capable.
    pub const SLOT_CAP_ATTENTION_BUTTON: u32 = 1 << 0;
    pub const SLOT_CAP_POWER_CONTROLLER: u32 = 1 << 1;
    pub const SLOT_CAP_HOT_PLUG_CAPABLE: u32 = 1 << 6;
    /// Slot control: Power Controller Control (1: power off), and the indicators (2 bits
    /// each: 01 on, 10 blink, 11 off).
    pub const POWER_CONTROLLER_OFF: u16 = 1 << 10;
    pub const POWER_INDICATOR_OFF: u16 = 0b11 << 8;
    pub const ATTENTION_INDICATOR_OFF: u16 = 0b11 << 6;
    /// Slot status: Attention Button Pressed, Presence Detect Changed, Command Completed,
    /// Data Link Layer State Changed (all write-1-to-clear).
    pub const ATTENTION_BUTTON_PRESSED: u16 = 1 << 0;
    pub const PRESENCE_DETECT_CHANGED: u16 = 1 << 3;
    pub const COMMAND_COMPLETED: u16 = 1 << 4;
    pub const DLL_STATE_CHANGED: u16 = 1 << 8;
    /// The slot status bits the guest clears by writing 1 (power fault, MRL sensor
    /// changed included: they never set here).
    pub const SLOT_STATUS_RW1C: u16 = 0x011f;
    /// Slot control: the event enables (attention button, presence detect changed,
    /// command completed, DLL state changed) and Hot-Plug Interrupt Enable.
    pub const ATTENTION_BUTTON_ENABLE: u16 = 1 << 0;
    pub const PRESENCE_DETECT_ENABLE: u16 = 1 << 3;
    pub const COMMAND_COMPLETED_ENABLE: u16 = 1 << 4;
    pub const HOT_PLUG_INTERRUPT_ENABLE: u16 = 1 << 5;
    pub const DLL_STATE_ENABLE: u16 = 1 << 12;
    /// Where a hot-plug port's MSI capability sits (after the PCIe capability).
    pub const MSI_CAP: u16 = 0x80;
    pub const CAP_ID_MSI: u8 = 0x05;
    /// PCIe flags: a slot is implemented.
    pub const SLOT_IMPLEMENTED: u16 = 1 << 8;
}

/// Memory windows decode in 1 MiB units.
pub const WINDOW_GRANULE: u64 = 1 << 20;

/// The bytes of a bridge's configuration space gpuvm keeps (header and PCIe capability);
/// the extended space above reads zero (no extended capabilities).
const SPACE: usize = 0x100;
/// Length of the PCIe capability structure (version 2).
const PCIE_CAP_LEN: usize = 0x3c;
/// The link the ports report: 32 GT/s (PCIe 5), 16 lanes, as a GPU's host link is.
const LINK_SPEED: u32 = 5;
const LINK_WIDTH: u32 = 16;

/// Which PCIe port a bridge is (the device/port type of the PCIe capability).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PortKind {
    RootPort,
    SwitchUpstream,
    SwitchDownstream,
}

impl PortKind {
    fn port_type(self) -> u16 {
        match self {
            PortKind::RootPort => 0x4,
            PortKind::SwitchUpstream => 0x5,
            PortKind::SwitchDownstream => 0x6,
        }
    }

    fn device_id(self) -> u16 {
        match self {
            PortKind::RootPort => ROOT_PORT_DEVICE_ID,
            PortKind::SwitchUpstream => UPSTREAM_PORT_DEVICE_ID,
            PortKind::SwitchDownstream => DOWNSTREAM_PORT_DEVICE_ID,
        }
    }

    /// Root ports and downstream ports lead to a slot; an upstream port does not.
    fn has_slot(self) -> bool {
        self != PortKind::SwitchUpstream
    }
}

/// An address window `[base, base + size)`; size 0 is a closed window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub base: u64,
    pub size: u64,
}

impl Window {
    pub fn end(&self) -> u64 {
        self.base + self.size
    }

    /// Whether `[address, address + size)` lies inside.
    pub fn contains(&self, address: u64, size: u64) -> bool {
        self.size > 0 && address >= self.base && address + size <= self.end()
    }
}

/// What the VMM builds a bridge with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BridgeSetup {
    pub kind: PortKind,
    pub primary_bus: u8,
    pub secondary_bus: u8,
    pub subordinate_bus: u8,
    /// The non-prefetchable memory window (below 4 GiB), 1 MiB granular.
    pub memory: Window,
    /// The 64-bit prefetchable memory window, 1 MiB granular.
    pub prefetchable: Window,
    /// Physical slot number (root and downstream ports).
    pub slot: u16,
    /// Whether a device sits behind the port (presence detect, link up).
    pub occupied: bool,
}

/// A bridge's registers as saved in a snapshot: the configuration space as the guest left it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PciBridgeState {
    pub kind: PortKind,
    pub config: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BridgeError {
    #[error("a bridge's saved configuration space is {0} bytes, not {SPACE}")]
    StateSize(usize),
    #[error("the saved bridge is a {saved:?}, the one built here a {built:?}")]
    Kind { saved: PortKind, built: PortKind },
}

/// One PCIe port function.
pub struct PciBridge {
    kind: PortKind,
    space: [u8; SPACE],
    /// Bits the guest may change, per byte of `space`.
    writable: [u8; SPACE],
    /// A hot-plug slot: the guest turned its power off while a card was present (the VMM
    /// takes the card away then, see [`PciBridge::take_powered_off`]).
    powered_off: bool,
    /// Written when the guest turns a hot-plug slot's power off: the VMM thread's wake-up.
    power_off_notice: Option<vmm_sys_util::eventfd::EventFd>,
    /// A hot-plug slot's MSI: its GSI, the irqfd that raises it, and where its route goes.
    msi: Option<SlotMsi>,
}

/// The MSI of a hot-plug port (see [`PciBridge::make_hotplug_slot`]).
struct SlotMsi {
    gsi: u32,
    trigger: vmm_sys_util::eventfd::EventFd,
    routing: Arc<dyn MsiRouting>,
    /// The route as last installed (None: MSI off).
    route: Option<MsiMessage>,
}

impl PciBridge {
    pub fn new(setup: &BridgeSetup) -> Self {
        let mut bridge = PciBridge {
            kind: setup.kind,
            space: [0; SPACE],
            writable: [0; SPACE],
            powered_off: false,
            power_off_notice: None,
            msi: None,
        };
        bridge.build_header(setup);
        bridge.build_pcie_capability(setup);
        bridge
    }

    pub fn kind(&self) -> PortKind {
        self.kind
    }

    fn put(&mut self, offset: u16, bytes: &[u8], writable: &[u8]) {
        let at = usize::from(offset);
        self.space[at..at + bytes.len()].copy_from_slice(bytes);
        self.writable[at..at + writable.len()].copy_from_slice(writable);
    }

    fn put16(&mut self, offset: u16, value: u16, writable: u16) {
        self.put(offset, &value.to_le_bytes(), &writable.to_le_bytes());
    }

    fn put32(&mut self, offset: u16, value: u32, writable: u32) {
        self.put(offset, &value.to_le_bytes(), &writable.to_le_bytes());
    }

    fn get16(&self, offset: u16) -> u16 {
        let at = usize::from(offset);
        u16::from_le_bytes([self.space[at], self.space[at + 1]])
    }

    fn get32(&self, offset: u16) -> u32 {
        let at = usize::from(offset);
        u32::from_le_bytes([
            self.space[at],
            self.space[at + 1],
            self.space[at + 2],
            self.space[at + 3],
        ])
    }

    fn build_header(&mut self, setup: &BridgeSetup) {
        self.put16(config::VENDOR_ID, VENDOR_ID, 0);
        self.put16(config::DEVICE_ID, setup.kind.device_id(), 0);
        // I/O space, memory space, bus master, parity and SERR enables.
        self.put16(config::COMMAND, 0, 0x0147);
        self.put16(config::STATUS, config::STATUS_CAPABILITIES, 0);
        // Class 06/04/00: PCI-to-PCI bridge.
        self.put32(config::CLASS_REVISION, 0x0604_0000, 0);
        self.put(config::HEADER_TYPE, &[0x01], &[0]);
        self.put(
            regs::PRIMARY_BUS,
            &[
                setup.primary_bus,
                setup.secondary_bus,
                setup.subordinate_bus,
            ],
            &[0xff; 3],
        );
        // 16-bit I/O decoding, window closed: no device here has I/O BARs.
        self.put(regs::IO_BASE, &[0xf0, 0x00], &[0xf0, 0xf0]);
        let (base, limit) = window_registers(setup.memory);
        self.put16(regs::MEMORY_BASE, (base >> 16) as u16 & 0xfff0, 0xfff0);
        self.put16(regs::MEMORY_LIMIT, (limit >> 16) as u16 & 0xfff0, 0xfff0);
        let (base, limit) = window_registers(setup.prefetchable);
        // Low nibble 1: 64-bit prefetchable decoding.
        self.put16(regs::PREF_BASE, (base >> 16) as u16 & 0xfff0 | 1, 0xfff0);
        self.put16(regs::PREF_LIMIT, (limit >> 16) as u16 & 0xfff0 | 1, 0xfff0);
        self.put32(regs::PREF_BASE_UPPER, (base >> 32) as u32, u32::MAX);
        self.put32(regs::PREF_LIMIT_UPPER, (limit >> 32) as u32, u32::MAX);
        self.put(config::CAPABILITIES_POINTER, &[regs::PCIE_CAP as u8], &[0]);
        self.put(config::INTERRUPT_LINE, &[0xff], &[0xff]);
        // Parity, SERR, ISA, VGA, master abort mode, secondary bus reset.
        self.put16(regs::BRIDGE_CONTROL, 0, 0x007f);
    }

    fn build_pcie_capability(&mut self, setup: &BridgeSetup) {
        let cap = regs::PCIE_CAP;
        self.put(cap, &[regs::CAP_ID_PCIE, 0], &[0, 0]);
        let slot = if setup.kind.has_slot() {
            regs::SLOT_IMPLEMENTED
        } else {
            0
        };
        self.put16(
            cap + regs::PCIE_FLAGS,
            2 | setup.kind.port_type() << 4 | slot,
            0,
        );
        // Device capabilities: 128-byte payloads, role-based error reporting.
        self.put32(cap + 0x04, 1 << 15, 0);
        self.put16(cap + 0x08, 0, 0x7fff);
        // Link: speed, width, port number (the slot), and (on ports facing a device)
        // data link layer active reporting, which guests check the link with.
        let reporting = u32::from(setup.kind.has_slot()) << 20;
        let port_number = u32::from(setup.slot as u8) << 24;
        self.put32(
            cap + regs::LINK_CAP,
            LINK_SPEED | LINK_WIDTH << 4 | reporting | port_number,
            0,
        );
        // Link control: ASPM, common clock, extended sync and the like (retrain reads 0).
        self.put16(cap + 0x10, 0, 0x0fdb);
        let active = if setup.occupied && setup.kind.has_slot() {
            regs::DLL_LINK_ACTIVE
        } else {
            0
        };
        let link_up = if setup.occupied || setup.kind == PortKind::SwitchUpstream {
            LINK_SPEED as u16 | (LINK_WIDTH as u16) << 4
        } else {
            0
        };
        self.put16(cap + regs::LINK_STATUS, link_up | active, 0);
        if setup.kind.has_slot() {
            // Slot capabilities: the physical slot number only; no hot-plug.
            self.put32(cap + regs::SLOT_CAP, u32::from(setup.slot) << 19, 0);
            self.put16(cap + 0x18, 0, 0x1fff);
            let present = if setup.occupied {
                regs::PRESENCE_DETECT_STATE
            } else {
                0
            };
            self.put16(cap + regs::SLOT_STATUS, present, 0);
        }
        if setup.kind == PortKind::RootPort {
            self.put16(cap + 0x1c, 0, 0x001f);
        }
        self.put16(cap + 0x28, 0, 0xffff);
        // Supported link speeds 2.5 to 32 GT/s.
        self.put32(cap + regs::LINK_CAP2, 0b11_1110, 0);
        self.put16(cap + 0x30, LINK_SPEED as u16, 0x0fff);
        debug_assert!(usize::from(cap) + PCIE_CAP_LEN <= SPACE);
    }

    /// Makes a root port's slot a PCIe native hot-plug slot, empty and powered off (what
    /// Linux's pciehp drives): Hot-Plug Capable, an attention button (the VMM "presses"
    /// it to ask for a removal, as an operator would on a server) and a power controller
    /// (the guest turns the slot off when it is done with the card, which tells the VMM
    /// it may take the card away: the handshake the ACPI slots' _EJ0 gives on bus 0). No
    /// MRL sensor, no surprise removal, and Command Completed is reported for each Slot
    /// Control write. With `msi` (a GSI, its irqfd and the routing that points the GSI at
    /// the message the guest programs) the port gets an MSI capability and raises it when
    /// an enabled slot event comes (Hot-Plug Interrupt Enable and the event's enable set);
    /// without, guests poll the slot status.
    pub fn make_hotplug_slot(
        &mut self,
        msi: Option<(u32, vmm_sys_util::eventfd::EventFd, Arc<dyn MsiRouting>)>,
    ) {
        let cap = regs::PCIE_CAP;
        let slot_cap = self.get32(cap + regs::SLOT_CAP)
            | regs::SLOT_CAP_ATTENTION_BUTTON
            | regs::SLOT_CAP_POWER_CONTROLLER
            | regs::SLOT_CAP_HOT_PLUG_CAPABLE;
        self.put32(cap + regs::SLOT_CAP, slot_cap, 0);
        self.put16(
            cap + regs::SLOT_CONTROL,
            regs::POWER_CONTROLLER_OFF | regs::POWER_INDICATOR_OFF | regs::ATTENTION_INDICATOR_OFF,
            0x1fff,
        );
        self.put16(cap + regs::SLOT_STATUS, 0, 0);
        self.set_link(false);
        if let Some((gsi, trigger, routing)) = msi {
            // The PCIe capability points on to the MSI capability: 64-bit addresses, one
            // message, no per-vector masking.
            self.put(cap + 1, &[regs::MSI_CAP as u8], &[0]);
            let msi_cap = regs::MSI_CAP;
            self.put(msi_cap, &[regs::CAP_ID_MSI, 0], &[0, 0]);
            self.put16(msi_cap + 2, 1 << 7, 0x0001);
            self.put32(msi_cap + 4, 0, 0xffff_fffc);
            self.put32(msi_cap + 8, 0, u32::MAX);
            self.put16(msi_cap + 12, 0, 0xffff);
            self.msi = Some(SlotMsi {
                gsi,
                trigger,
                routing,
                route: None,
            });
        }
    }

    /// The MSI message the guest has programmed and enabled, if any.
    fn msi_message(&self) -> Option<MsiMessage> {
        let msi_cap = regs::MSI_CAP;
        if self.msi.is_none() || self.get16(msi_cap + 2) & 1 == 0 {
            return None;
        }
        Some(MsiMessage {
            address: u64::from(self.get32(msi_cap + 4)) | u64::from(self.get32(msi_cap + 8)) << 32,
            data: u32::from(self.get16(msi_cap + 12)),
        })
    }

    /// Installs (or drops) the MSI route after the guest changed the MSI capability.
    fn follow_msi(&mut self) {
        let message = self.msi_message();
        let Some(msi) = self.msi.as_mut() else {
            return;
        };
        if msi.route == message {
            return;
        }
        match msi.routing.set_route(msi.gsi, message) {
            Ok(()) => msi.route = message,
            Err(error) => log::warn!("PCIe slot: cannot route its MSI: {error}"),
        }
    }

    /// Whether an enabled slot event is pending (what the hot-plug interrupt signals).
    fn event_pending(&self) -> bool {
        let control = self.get16(regs::PCIE_CAP + regs::SLOT_CONTROL);
        let status = self.slot_status();
        let command =
            control & regs::COMMAND_COMPLETED_ENABLE != 0 && status & regs::COMMAND_COMPLETED != 0;
        let events = [
            (
                regs::ATTENTION_BUTTON_ENABLE,
                regs::ATTENTION_BUTTON_PRESSED,
            ),
            (regs::PRESENCE_DETECT_ENABLE, regs::PRESENCE_DETECT_CHANGED),
            (regs::DLL_STATE_ENABLE, regs::DLL_STATE_CHANGED),
        ];
        let event = events
            .iter()
            .any(|(enable, bit)| control & enable != 0 && status & bit != 0);
        control & regs::HOT_PLUG_INTERRUPT_ENABLE != 0 && (command || event)
    }

    /// Raises the MSI if an enabled event became pending (`was_pending`: before the change),
    /// as a port signals the rising edge of its events.
    fn interrupt_on_edge(&self, was_pending: bool) {
        if was_pending || !self.event_pending() {
            return;
        }
        let Some(msi) = self.msi.as_ref().filter(|msi| msi.route.is_some()) else {
            return;
        };
        if let Err(error) = msi.trigger.write(1) {
            log::warn!("PCIe slot: cannot raise its MSI: {error}");
        }
    }

    /// Whether this port has a hot-plug slot ([`PciBridge::make_hotplug_slot`]).
    pub fn is_hotplug_slot(&self) -> bool {
        self.kind.has_slot()
            && self.get32(regs::PCIE_CAP + regs::SLOT_CAP) & regs::SLOT_CAP_HOT_PLUG_CAPABLE != 0
    }

    /// Where the port tells the VMM that the guest turned the slot off.
    pub fn set_power_off_notice(&mut self, notice: vmm_sys_util::eventfd::EventFd) {
        self.power_off_notice = Some(notice);
    }

    fn slot_status(&self) -> u16 {
        self.get16(regs::PCIE_CAP + regs::SLOT_STATUS)
    }

    fn set_slot_status(&mut self, status: u16) {
        let at = usize::from(regs::PCIE_CAP + regs::SLOT_STATUS);
        self.space[at..at + 2].copy_from_slice(&status.to_le_bytes());
    }

    /// Whether the guest has the slot's power on.
    pub fn slot_powered(&self) -> bool {
        self.get16(regs::PCIE_CAP + regs::SLOT_CONTROL) & regs::POWER_CONTROLLER_OFF == 0
    }

    /// Whether a card is in the slot.
    pub fn slot_occupied(&self) -> bool {
        self.slot_status() & regs::PRESENCE_DETECT_STATE != 0
    }

    /// The data link layer up (at the port's speed and width) or down.
    fn set_link(&mut self, up: bool) {
        let value = if up {
            LINK_SPEED as u16 | (LINK_WIDTH as u16) << 4 | regs::DLL_LINK_ACTIVE
        } else {
            0
        };
        let at = usize::from(regs::PCIE_CAP + regs::LINK_STATUS);
        self.space[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    fn link_up(&self) -> bool {
        self.get16(regs::PCIE_CAP + regs::LINK_STATUS) & regs::DLL_LINK_ACTIVE != 0
    }

    /// A card was put into the slot (the VMM has it on the secondary bus): presence
    /// detect set and changed. The link comes up once the guest powers the slot on (or
    /// at once, if it already is). A guest that listens to the attention button but not
    /// to presence changes, with the slot off, also sees the button pressed, as an
    /// operator presses it after inserting a card: Linux's pciehp, on a slot with an
    /// attention button, enables only the button's event (the press's interrupt then shows
    /// it the presence change too, and it powers the slot on).
    pub fn card_inserted(&mut self) {
        let was_pending = self.event_pending();
        self.powered_off = false;
        let mut status =
            self.slot_status() | regs::PRESENCE_DETECT_STATE | regs::PRESENCE_DETECT_CHANGED;
        let control = self.get16(regs::PCIE_CAP + regs::SLOT_CONTROL);
        let listens_to_button_only = control & regs::ATTENTION_BUTTON_ENABLE != 0
            && control & regs::PRESENCE_DETECT_ENABLE == 0;
        if listens_to_button_only && !self.slot_powered() {
            status |= regs::ATTENTION_BUTTON_PRESSED;
        }
        self.set_slot_status(status);
        self.follow_power();
        self.interrupt_on_edge(was_pending);
    }

    /// Asks the guest to give the card up: the attention button is pressed.
    pub fn press_attention_button(&mut self) {
        let was_pending = self.event_pending();
        let status = self.slot_status() | regs::ATTENTION_BUTTON_PRESSED;
        self.set_slot_status(status);
        self.interrupt_on_edge(was_pending);
    }

    /// Withdraws a press the guest did not act on.
    pub fn release_attention_button(&mut self) {
        let status = self.slot_status() & !regs::ATTENTION_BUTTON_PRESSED;
        self.set_slot_status(status);
    }

    /// Whether the guest turned the slot off with a card in it since the last call.
    pub fn take_powered_off(&mut self) -> bool {
        std::mem::take(&mut self.powered_off)
    }

    /// The VMM took the card away: presence detect cleared and changed, link down.
    pub fn card_removed(&mut self) {
        let was_pending = self.event_pending();
        self.powered_off = false;
        let mut status =
            self.slot_status() & !regs::PRESENCE_DETECT_STATE & !regs::ATTENTION_BUTTON_PRESSED;
        status |= regs::PRESENCE_DETECT_CHANGED;
        if self.link_up() {
            status |= regs::DLL_STATE_CHANGED;
        }
        self.set_slot_status(status);
        self.set_link(false);
        self.interrupt_on_edge(was_pending);
    }

    /// Brings the link up or down after the slot's power or presence changed; a power-off
    /// with a card in it is noted for the VMM.
    fn follow_power(&mut self) {
        let up = self.slot_powered() && self.slot_occupied();
        if up == self.link_up() {
            return;
        }
        self.set_link(up);
        let status = self.slot_status() | regs::DLL_STATE_CHANGED;
        self.set_slot_status(status);
        // Powered on again before the VMM took the card: it is wanted after all.
        self.powered_off &= !up;
        if !up && self.slot_occupied() {
            self.powered_off = true;
            if let Some(notice) = &self.power_off_notice {
                if let Err(error) = notice.write(1) {
                    log::warn!("PCIe slot: cannot wake the VMM thread: {error}");
                }
            }
        }
    }

    /// After a guest write to a hot-plug slot: Slot Control was written (`control_written`)
    /// and the Slot Status bits written 1 (`status_clear`) are cleared.
    fn slot_write(&mut self, control_written: bool, status_clear: u16) {
        let status = self.slot_status() & !(status_clear & regs::SLOT_STATUS_RW1C);
        self.set_slot_status(status);
        if control_written {
            let status = self.slot_status() | regs::COMMAND_COMPLETED;
            self.set_slot_status(status);
            self.follow_power();
        }
    }

    /// Its registers as a snapshot keeps them (what [`Persist::save`] gives; it cannot fail).
    pub fn registers(&self) -> PciBridgeState {
        PciBridgeState {
            kind: self.kind,
            config: self.space.to_vec(),
        }
    }

    /// The secondary and subordinate bus numbers as currently programmed.
    pub fn buses(&self) -> (u8, u8) {
        (
            self.space[usize::from(regs::SECONDARY_BUS)],
            self.space[usize::from(regs::SUBORDINATE_BUS)],
        )
    }

    /// The memory window as currently programmed (size 0 when closed).
    pub fn memory_window(&self) -> Window {
        let base = u64::from(self.get16(regs::MEMORY_BASE) & 0xfff0) << 16;
        let limit = u64::from(self.get16(regs::MEMORY_LIMIT) & 0xfff0) << 16 | 0xf_ffff;
        window_from(base, limit)
    }

    /// The prefetchable window as currently programmed (size 0 when closed).
    pub fn prefetchable_window(&self) -> Window {
        let base = u64::from(self.get16(regs::PREF_BASE) & 0xfff0) << 16
            | u64::from(self.get32(regs::PREF_BASE_UPPER)) << 32;
        let limit = u64::from(self.get16(regs::PREF_LIMIT) & 0xfff0) << 16
            | 0xf_ffff
            | u64::from(self.get32(regs::PREF_LIMIT_UPPER)) << 32;
        window_from(base, limit)
    }
}

/// A bridge's snapshot state is its configuration space as the guest left it (bus
/// numbers, windows, enables); it goes back into a bridge built as the same kind of port.
impl Persist for PciBridge {
    type State = PciBridgeState;
    type Error = BridgeError;

    fn save(&self) -> Result<PciBridgeState, BridgeError> {
        Ok(self.registers())
    }

    fn restore(&mut self, state: &PciBridgeState) -> Result<(), BridgeError> {
        if state.kind != self.kind {
            return Err(BridgeError::Kind {
                saved: state.kind,
                built: self.kind,
            });
        }
        if state.config.len() != SPACE {
            return Err(BridgeError::StateSize(state.config.len()));
        }
        self.space.copy_from_slice(&state.config);
        // A power-off the VMM had not acted on is not kept (snapshots refuse a device being
        // removed).
        self.powered_off = false;
        // The MSI route lives in the hypervisor, not in the registers: install the one the
        // restored MSI capability says (this port's GSI may differ from the saved one's).
        if let Some(msi) = self.msi.as_mut() {
            msi.route = None;
        }
        self.follow_msi();
        Ok(())
    }
}

/// The base and limit (last byte) registers encode for `window`; a closed window has
/// its base above its limit.
fn window_registers(window: Window) -> (u64, u64) {
    if window.size == 0 {
        return (0xfff0_0000, 0);
    }
    (window.base, window.end() - 1)
}

fn window_from(base: u64, limit: u64) -> Window {
    if limit < base {
        return Window::default();
    }
    Window {
        base,
        size: limit - base + 1,
    }
}

impl PciDevice for PciBridge {
    fn config_read(&mut self, offset: u16, data: &mut [u8]) {
        data.fill(0);
        if usize::from(offset) < SPACE {
            read_le(&self.space, usize::from(offset), data);
        }
    }

    fn config_write(&mut self, offset: u16, data: &[u8]) {
        let at = usize::from(offset);
        if at + data.len() > SPACE {
            return;
        }
        let before = self.buses();
        let was_pending = self.is_hotplug_slot() && self.event_pending();
        for (i, byte) in data.iter().enumerate() {
            let mask = self.writable[at + i];
            self.space[at + i] = self.space[at + i] & !mask | byte & mask;
        }
        if self.is_hotplug_slot() {
            let control = usize::from(regs::PCIE_CAP + regs::SLOT_CONTROL);
            let status = usize::from(regs::PCIE_CAP + regs::SLOT_STATUS);
            let written = at..at + data.len();
            let control_written = written.contains(&control) || written.contains(&(control + 1));
            let mut clear = 0u16;
            for (i, byte) in data.iter().enumerate() {
                if at + i == status {
                    clear |= u16::from(*byte);
                } else if at + i == status + 1 {
                    clear |= u16::from(*byte) << 8;
                }
            }
            if control_written || clear != 0 {
                self.slot_write(control_written, clear);
            }
            let msi = usize::from(regs::MSI_CAP);
            if at < msi + 14 && written.end > msi {
                self.follow_msi();
            }
            self.interrupt_on_edge(was_pending);
        }
        if self.buses() != before {
            log::debug!("PCI bridge: buses now {:?} (were {before:?})", self.buses());
        }
    }

    fn active_bars(&self) -> Vec<PciBar> {
        Vec::new()
    }

    fn bar_specs(&self) -> Vec<BarSpec> {
        Vec::new()
    }

    fn set_bar_address(&mut self, _bar: u8, _address: u64) {}

    fn enable_memory_decoding(&mut self) {
        // Firmware turns on forwarding of memory and of the devices' DMA.
        let command = self.get16(config::COMMAND) | config::COMMAND_MEMORY | 1 << 2;
        self.space[usize::from(config::COMMAND)..usize::from(config::COMMAND) + 2]
            .copy_from_slice(&command.to_le_bytes());
    }

    fn bar_read(&mut self, _bar: u8, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn bar_write(&mut self, _bar: u8, _offset: u64, _data: &[u8]) {}

    fn as_bridge(&self) -> Option<&PciBridge> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(kind: PortKind) -> BridgeSetup {
        BridgeSetup {
            kind,
            primary_bus: 0,
            secondary_bus: 1,
            subordinate_bus: 4,
            memory: Window {
                base: 0xc000_0000,
                size: 32 << 20,
            },
            prefetchable: Window {
                base: 0x40_0000_0000,
                size: 1 << 30,
            },
            slot: 3,
            occupied: true,
        }
    }

    fn read32(bridge: &mut PciBridge, offset: u16) -> u32 {
        let mut data = [0; 4];
        bridge.config_read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn read16(bridge: &mut PciBridge, offset: u16) -> u16 {
        let mut data = [0; 2];
        bridge.config_read(offset, &mut data);
        u16::from_le_bytes(data)
    }

    #[test]
    fn type1_header_identifies_a_bridge_with_its_buses_and_windows() {
        let mut bridge = PciBridge::new(&setup(PortKind::RootPort));
        assert_eq!(read32(&mut bridge, 0), 0x000c_1b36);
        assert_eq!(read32(&mut bridge, 0x08) >> 8, 0x06_0400, "class");
        assert_eq!(read32(&mut bridge, 0x0c) >> 16 & 0x7f, 1, "header type 1");
        assert_eq!(read32(&mut bridge, 0x18) & 0xff_ffff, 0x04_0100);
        assert_eq!(read16(&mut bridge, 0x20), 0xc000, "memory base");
        assert_eq!(read16(&mut bridge, 0x22), 0xc1f0, "memory limit");
        assert_eq!(read16(&mut bridge, 0x24), 0x0001, "64-bit prefetchable");
        assert_eq!(read16(&mut bridge, 0x26), 0x3ff1);
        assert_eq!(read32(&mut bridge, 0x28), 0x40);
        assert_eq!(read32(&mut bridge, 0x2c), 0x40);
        assert_eq!(
            bridge.prefetchable_window(),
            Window {
                base: 0x40_0000_0000,
                size: 1 << 30
            }
        );
        let mut io = [0; 2];
        bridge.config_read(0x1c, &mut io);
        assert!(io[0] > io[1], "the I/O window is closed: {io:?}");
        assert_eq!(read32(&mut bridge, 0x34) & 0xff, 0x40);
        assert_eq!(read32(&mut bridge, 0x100), 0, "no extended capabilities");
    }

    #[test]
    fn the_pcie_capability_names_the_port_and_its_slot() {
        for (kind, port_type, slot) in [
            (PortKind::RootPort, 4, true),
            (PortKind::SwitchUpstream, 5, false),
            (PortKind::SwitchDownstream, 6, true),
        ] {
            let mut bridge = PciBridge::new(&setup(kind));
            assert_eq!(
                read16(&mut bridge, 0x40),
                0x0010,
                "{kind:?}: PCIe cap, last"
            );
            let flags = read16(&mut bridge, 0x42);
            assert_eq!(flags >> 4 & 0xf, port_type, "{kind:?}");
            assert_eq!(flags & regs::SLOT_IMPLEMENTED != 0, slot, "{kind:?}");
            let slot_cap = read32(&mut bridge, 0x40 + regs::SLOT_CAP);
            if slot {
                assert_eq!(slot_cap >> 19, 3, "physical slot number");
                assert_eq!(slot_cap & 0x7f, 0, "no hot-plug bits");
                let status = read16(&mut bridge, 0x40 + regs::SLOT_STATUS);
                assert_ne!(status & regs::PRESENCE_DETECT_STATE, 0);
            } else {
                assert_eq!(slot_cap, 0);
            }
            let link = read16(&mut bridge, 0x40 + regs::LINK_STATUS);
            assert_eq!((link & 0xf, link >> 4 & 0x3f), (5, 16), "{kind:?}");
        }
    }

    #[test]
    fn the_guest_may_renumber_and_move_the_windows_but_not_the_identity() {
        let mut bridge = PciBridge::new(&setup(PortKind::SwitchDownstream));
        bridge.config_write(0x18, &0x0008_0605u32.to_le_bytes());
        assert_eq!(bridge.buses(), (6, 8));
        assert_eq!(read32(&mut bridge, 0x18) & 0xff_ffff, 0x08_0605);
        // Memory window to 0xd000_0000..0xd03f_ffff; the low nibble stays read-only.
        bridge.config_write(0x20, &0xd030_d00fu32.to_le_bytes());
        assert_eq!(
            bridge.memory_window(),
            Window {
                base: 0xd000_0000,
                size: 4 << 20
            }
        );
        assert_eq!(read16(&mut bridge, 0x20), 0xd000);
        // Prefetchable window moved above 1 TiB; the 64-bit type bits stay.
        bridge.config_write(0x24, &0x0ff0_0000u32.to_le_bytes());
        bridge.config_write(0x28, &0x100u32.to_le_bytes());
        bridge.config_write(0x2c, &0x100u32.to_le_bytes());
        assert_eq!(read16(&mut bridge, 0x24) & 0xf, 1);
        assert_eq!(
            bridge.prefetchable_window(),
            Window {
                base: 0x100_0000_0000,
                size: 256 << 20
            }
        );
        // Closing a window: base above limit.
        bridge.config_write(0x20, &0x0000_fff0u32.to_le_bytes());
        assert_eq!(bridge.memory_window(), Window::default());
        // The I/O window's upper nibbles are writable, the rest of the identity is not.
        bridge.config_write(0x1c, &[0x10, 0x20]);
        let mut io = [0; 2];
        bridge.config_read(0x1c, &mut io);
        assert_eq!(io, [0x10, 0x20]);
        bridge.config_write(0x00, &0xffff_ffffu32.to_le_bytes());
        bridge.config_write(0x08, &0u32.to_le_bytes());
        assert_eq!(read32(&mut bridge, 0), 0x0111_1b36);
        assert_eq!(read32(&mut bridge, 0x08) >> 8, 0x06_0400);
        // Command: memory and bus master stick, unknown bits do not.
        bridge.config_write(0x04, &0xffffu16.to_le_bytes());
        assert_eq!(read16(&mut bridge, 0x04), 0x0147);
        // Writes past the kept space are dropped without a panic.
        bridge.config_write(0xffc, &[1, 2, 3, 4]);
    }

    #[test]
    fn a_hot_plug_slot_goes_through_insertion_power_and_removal() {
        let mut port = PciBridge::new(&BridgeSetup {
            occupied: false,
            ..setup(PortKind::RootPort)
        });
        port.make_hotplug_slot(None);
        let notice =
            vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        port.set_power_off_notice(notice.try_clone().unwrap());
        let cap = regs::PCIE_CAP;
        let status = |port: &mut PciBridge| read16(port, cap + regs::SLOT_STATUS);
        let link = |port: &mut PciBridge| read16(port, cap + regs::LINK_STATUS);
        assert!(port.is_hotplug_slot());
        assert_eq!(read32(&mut port, cap + regs::SLOT_CAP) & 0x43, 0x43);
        assert!(!port.slot_powered() && !port.slot_occupied());
        assert_eq!(link(&mut port) & regs::DLL_LINK_ACTIVE, 0);

        port.card_inserted();
        let present = regs::PRESENCE_DETECT_STATE | regs::PRESENCE_DETECT_CHANGED;
        assert_eq!(status(&mut port) & present, present);
        assert_eq!(
            link(&mut port) & regs::DLL_LINK_ACTIVE,
            0,
            "off: no link yet"
        );
        // Acknowledge the change, then power on (16-bit Slot Control write).
        port.config_write(
            cap + regs::SLOT_STATUS,
            &regs::PRESENCE_DETECT_CHANGED.to_le_bytes(),
        );
        assert_eq!(status(&mut port), regs::PRESENCE_DETECT_STATE);
        port.config_write(cap + regs::SLOT_CONTROL, &0x0100u16.to_le_bytes());
        let status_now = status(&mut port);
        assert_ne!(status_now & regs::COMMAND_COMPLETED, 0);
        assert_ne!(status_now & regs::DLL_STATE_CHANGED, 0);
        assert_ne!(link(&mut port) & regs::DLL_LINK_ACTIVE, 0);
        assert!(notice.read().is_err(), "powering on is no removal");
        // Status bits are write-1-to-clear; presence detect state is not.
        port.config_write(cap + regs::SLOT_STATUS, &0xffffu16.to_le_bytes());
        assert_eq!(status(&mut port), regs::PRESENCE_DETECT_STATE);

        port.press_attention_button();
        assert_ne!(status(&mut port) & regs::ATTENTION_BUTTON_PRESSED, 0);
        assert!(!port.take_powered_off());
        // A 32-bit write: control (power off) and status (clear the button) at once.
        let dword = u32::from(regs::POWER_CONTROLLER_OFF | 0x0300)
            | u32::from(regs::ATTENTION_BUTTON_PRESSED) << 16;
        port.config_write(cap + regs::SLOT_CONTROL, &dword.to_le_bytes());
        assert_eq!(status(&mut port) & regs::ATTENTION_BUTTON_PRESSED, 0);
        assert_eq!(link(&mut port) & regs::DLL_LINK_ACTIVE, 0);
        assert_eq!(notice.read().unwrap(), 1, "the VMM is woken");
        assert!(port.take_powered_off());
        assert!(!port.take_powered_off(), "taken once");
        port.card_removed();
        let status_now = status(&mut port);
        assert_eq!(status_now & regs::PRESENCE_DETECT_STATE, 0);
        assert_ne!(status_now & regs::PRESENCE_DETECT_CHANGED, 0);
        // A port without a hot-plug slot ignores the same writes.
        let mut plain = PciBridge::new(&setup(PortKind::RootPort));
        plain.config_write(cap + regs::SLOT_CONTROL, &dword.to_le_bytes());
        assert!(!plain.is_hotplug_slot());
        assert_ne!(status(&mut plain) & regs::PRESENCE_DETECT_STATE, 0);
    }

    #[test]
    fn a_hot_plug_slot_raises_its_msi_on_the_rising_edge_of_enabled_events() {
        use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
        let routes = Arc::new(crate::pci::RecordedRoutes::default());
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut port = PciBridge::new(&BridgeSetup {
            occupied: false,
            ..setup(PortKind::RootPort)
        });
        port.make_hotplug_slot(Some((30, irq.try_clone().unwrap(), routes.clone())));
        let cap = regs::PCIE_CAP;
        assert_eq!(
            read16(&mut port, cap) >> 8,
            regs::MSI_CAP,
            "PCIe cap -> MSI cap"
        );
        let msi = regs::MSI_CAP;
        assert_eq!(
            read32(&mut port, msi) & 0x0080_00ff,
            0x0080_0005,
            "MSI, 64-bit"
        );
        port.config_write(msi + 4, &0xfee0_1000u32.to_le_bytes());
        port.config_write(msi + 8, &0u32.to_le_bytes());
        port.config_write(msi + 12, &0x45u16.to_le_bytes());
        assert!(routes.routes().is_empty(), "not enabled yet");
        port.config_write(msi + 2, &1u16.to_le_bytes());
        assert_eq!(
            routes.routes().get(&30),
            Some(&MsiMessage {
                address: 0xfee0_1000,
                data: 0x45
            })
        );
        // A card arrives before presence-detect events are enabled: no interrupt, until
        // the guest enables them with the change still pending.
        port.card_inserted();
        assert!(irq.read().is_err());
        let enables = regs::HOT_PLUG_INTERRUPT_ENABLE
            | regs::PRESENCE_DETECT_ENABLE
            | regs::ATTENTION_BUTTON_ENABLE
            | regs::POWER_CONTROLLER_OFF;
        port.config_write(cap + regs::SLOT_CONTROL, &enables.to_le_bytes());
        assert_eq!(irq.read().unwrap(), 1, "raised on enable");
        port.press_attention_button();
        assert!(irq.read().is_err(), "still pending: no new edge");
        let all = regs::SLOT_STATUS_RW1C;
        port.config_write(cap + regs::SLOT_STATUS, &all.to_le_bytes());
        port.press_attention_button();
        assert_eq!(
            irq.read().unwrap(),
            1,
            "a new edge after the guest cleared the bits"
        );
        // MSI off: the route goes and nothing is raised.
        port.config_write(cap + regs::SLOT_STATUS, &all.to_le_bytes());
        port.config_write(msi + 2, &0u16.to_le_bytes());
        assert!(routes.routes().is_empty());
        port.press_attention_button();
        assert!(irq.read().is_err());
    }

    #[test]
    fn an_insertion_presses_the_button_for_a_guest_that_listens_only_to_it() {
        use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
        let cap = regs::PCIE_CAP;
        let msi = regs::MSI_CAP;
        let off = regs::POWER_CONTROLLER_OFF | regs::POWER_INDICATOR_OFF;
        // Slot Control as Linux's pciehp leaves an empty slot with an attention button:
        // the button's and the link's events, command completed, hot-plug interrupt.
        let pciehp = off
            | regs::ATTENTION_BUTTON_ENABLE
            | regs::DLL_STATE_ENABLE
            | regs::COMMAND_COMPLETED_ENABLE
            | regs::HOT_PLUG_INTERRUPT_ENABLE;
        let presence = pciehp | regs::PRESENCE_DETECT_ENABLE;
        let powered_on = pciehp & !regs::POWER_CONTROLLER_OFF;
        for (control, pressed) in [
            (pciehp, true),
            (presence, false),
            (off, false),
            (powered_on, false),
        ] {
            let routes = Arc::new(crate::pci::RecordedRoutes::default());
            let irq = EventFd::new(EFD_NONBLOCK).unwrap();
            let mut port = PciBridge::new(&BridgeSetup {
                occupied: false,
                ..setup(PortKind::RootPort)
            });
            port.make_hotplug_slot(Some((30, irq.try_clone().unwrap(), routes)));
            port.config_write(msi + 4, &0xfee0_1000u32.to_le_bytes());
            port.config_write(msi + 2, &1u16.to_le_bytes());
            port.config_write(cap + regs::SLOT_CONTROL, &control.to_le_bytes());
            let all = regs::SLOT_STATUS_RW1C;
            port.config_write(cap + regs::SLOT_STATUS, &all.to_le_bytes());
            while irq.read().is_ok() {}

            port.card_inserted();
            let status = read16(&mut port, cap + regs::SLOT_STATUS);
            assert_eq!(
                status & regs::ATTENTION_BUTTON_PRESSED != 0,
                pressed,
                "Slot Control {control:#06x}: status {status:#06x}"
            );
            assert_ne!(status & regs::PRESENCE_DETECT_STATE, 0);
            // The press, the presence change, or (powered on) the link coming up.
            let interrupt = control & regs::HOT_PLUG_INTERRUPT_ENABLE != 0;
            assert_eq!(irq.read().is_ok(), interrupt, "Slot Control {control:#06x}");
        }
    }

    #[test]
    fn state_comes_back_as_the_guest_left_it() {
        let mut bridge = PciBridge::new(&setup(PortKind::RootPort));
        bridge.config_write(0x18, &0x0009_0700u32.to_le_bytes());
        bridge.enable_memory_decoding();
        let saved = bridge.save().unwrap();
        let mut again = PciBridge::new(&setup(PortKind::RootPort));
        again.restore(&saved).unwrap();
        assert_eq!(again.buses(), (7, 9));
        assert_eq!(read16(&mut again, 0x04), 0x0006);
        let mut other = PciBridge::new(&setup(PortKind::SwitchUpstream));
        assert!(matches!(
            other.restore(&saved),
            Err(BridgeError::Kind { .. })
        ));
        let short = PciBridgeState {
            kind: PortKind::RootPort,
            config: vec![0; 12],
        };
        assert_eq!(again.restore(&short), Err(BridgeError::StateSize(12)));
    }

    #[test]
    fn a_hot_plug_slot_comes_back_with_its_card_power_and_msi_route() {
        use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
        let cap = regs::PCIE_CAP;
        let msi = regs::MSI_CAP;
        let empty = BridgeSetup {
            occupied: false,
            ..setup(PortKind::RootPort)
        };
        let routes = Arc::new(crate::pci::RecordedRoutes::default());
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut port = PciBridge::new(&empty);
        port.make_hotplug_slot(Some((30, irq.try_clone().unwrap(), routes)));
        port.config_write(msi + 4, &0xfee0_2000u32.to_le_bytes());
        port.config_write(msi + 12, &0x51u16.to_le_bytes());
        port.config_write(msi + 2, &1u16.to_le_bytes());
        let enables = regs::HOT_PLUG_INTERRUPT_ENABLE | regs::PRESENCE_DETECT_ENABLE;
        port.config_write(cap + regs::SLOT_CONTROL, &enables.to_le_bytes());
        port.card_inserted();
        let saved = port.save().unwrap();

        // Rebuilt as the restore rebuilds it: empty, with another GSI.
        let routes = Arc::new(crate::pci::RecordedRoutes::default());
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut again = PciBridge::new(&empty);
        again.make_hotplug_slot(Some((41, irq.try_clone().unwrap(), routes.clone())));
        again.restore(&saved).unwrap();
        assert!(again.is_hotplug_slot());
        assert!(again.slot_occupied() && again.slot_powered());
        assert_ne!(
            read16(&mut again, cap + regs::LINK_STATUS) & regs::DLL_LINK_ACTIVE,
            0,
            "powered with a card: link up"
        );
        assert_eq!(
            read16(&mut again, cap + regs::SLOT_CONTROL),
            read16(&mut port, cap + regs::SLOT_CONTROL)
        );
        assert_eq!(
            routes.routes().get(&41),
            Some(&MsiMessage {
                address: 0xfee0_2000,
                data: 0x51
            }),
            "the guest's MSI routed to the new GSI"
        );
        // Events after the restore still interrupt the guest.
        let all = regs::SLOT_STATUS_RW1C;
        again.config_write(cap + regs::SLOT_STATUS, &all.to_le_bytes());
        while irq.read().is_ok() {}
        again.card_removed();
        assert_eq!(irq.read().unwrap(), 1);
        assert!(!again.take_powered_off());
    }
}
