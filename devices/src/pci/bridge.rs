//! PCI-to-PCI bridges as PCIe ports: a root port, a switch's upstream port and its
//! downstream ports. Each is one function with a type-1 header (bus numbers, the memory,
//! prefetchable-memory and I/O windows) and a PCIe capability saying which kind of port it
//! is; root ports and downstream ports also carry a slot (its number, no hot-plug).
//!
//! gpuvm acts as firmware: the VMM builds each bridge with bus numbers and windows that
//! already hold what sits behind it, so a guest (Linux keeps valid firmware assignments)
//! can use them as they are. The guest may rewrite them; [`PciBridge::buses`] follows what
//! it wrote, which is what [`super::PciRoot`] routes configuration cycles by. BAR accesses
//! are routed by address, so the windows are bookkeeping for the guest, not a filter.

use super::{config, read_le, BarSpec, PciBar, PciDevice};
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
    pub const SLOT_STATUS: u16 = 0x1a;
    pub const LINK_CAP2: u16 = 0x2c;
    /// Slot status: a card is present.
    pub const PRESENCE_DETECT_STATE: u16 = 1 << 6;
    /// Link status: the data link layer is up.
    pub const DLL_LINK_ACTIVE: u16 = 1 << 13;
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
}

impl PciBridge {
    pub fn new(setup: &BridgeSetup) -> Self {
        let mut bridge = PciBridge {
            kind: setup.kind,
            space: [0; SPACE],
            writable: [0; SPACE],
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
        Ok(PciBridgeState {
            kind: self.kind,
            config: self.space.to_vec(),
        })
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
        for (i, byte) in data.iter().enumerate() {
            let mask = self.writable[at + i];
            self.space[at + i] = self.space[at + i] & !mask | byte & mask;
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
}
