//! A PCI root bus: configuration mechanism #1 (ports 0xCF8/0xCFC), an ECAM window, a host
//! bridge at 00:00.0, BAR allocation and guest BAR programming, and MSI-X table emulation.
//!
//! - [`PciRoot`] owns the devices of bus 0 and dispatches configuration and BAR accesses.
//!   It sits on the port-I/O bus (config mechanism #1) and on the MMIO bus (ECAM and BAR
//!   windows); BAR accesses are looked up on every access from the BARs as the guest has
//!   currently programmed them, so moving a BAR needs no bus update.
//! - [`PciDevice`] is what a function on the bus implements.
//! - [`BarSet`] emulates the six BAR registers and the ROM BAR (sizing by all-ones writes).
//! - [`MsixTable`] emulates an MSI-X table and PBA and pushes routes through [`MsiRouting`].

mod bars;
pub mod bridge;
pub mod hotplug;
mod msix;
mod root;

pub use bars::{BarKind, BarSet, BarSpec, PciBar};
pub use bridge::{BridgeSetup, PciBridge, PciBridgeState, PortKind, Window};
pub use hotplug::HotplugController;
#[cfg(any(test, feature = "test-util"))]
pub use msix::RecordedRoutes;
pub use msix::{MsiMessage, MsiRouting, MsixCapability, MsixTable, MSIX_ENTRY_SIZE};
pub use root::{
    BarAllocator, ConfigAddressPort, EcamWindow, HostBridge, MmioWindows, PciBdf, PciError,
    PciRoot, PciRootConfig, PciRootState, SavedRange, SlotState, WindowState,
};

/// Offsets and bits of the type-0 configuration header.
pub mod config {
    pub const VENDOR_ID: u16 = 0x00;
    pub const DEVICE_ID: u16 = 0x02;
    pub const COMMAND: u16 = 0x04;
    pub const STATUS: u16 = 0x06;
    pub const CLASS_REVISION: u16 = 0x08;
    pub const HEADER_TYPE: u16 = 0x0e;
    pub const BAR0: u16 = 0x10;
    pub const BAR5_END: u16 = 0x28;
    pub const ROM_BAR: u16 = 0x30;
    pub const CAPABILITIES_POINTER: u16 = 0x34;
    pub const INTERRUPT_LINE: u16 = 0x3c;
    pub const INTERRUPT_PIN: u16 = 0x3d;
    pub const COMMAND_MEMORY: u16 = 1 << 1;
    pub const STATUS_CAPABILITIES: u16 = 1 << 4;
    pub const CAP_ID_MSIX: u8 = 0x11;
    /// Size of the extended (PCIe) configuration space of one function.
    pub const SPACE_SIZE: u16 = 4096;
}

/// First GSI of the IOAPIC pins that carry PCI INTx (16..24, above the ISA IRQs).
pub const FIRST_INTX_GSI: u32 = 16;
/// How many IOAPIC pins PCI INTx is spread over.
pub const INTX_GSI_COUNT: u32 = 8;

/// The GSI that INTx pin `pin_index` (0 for INTA .. 3 for INTD) of bus-0 device `device`
/// is wired to: the usual swizzle, spread over the 8 IOAPIC pins above the ISA IRQs. The
/// ACPI _PRT and the Interrupt Line the VMM programs follow this one rule.
pub const fn intx_gsi(device: u8, pin_index: u8) -> u32 {
    FIRST_INTX_GSI + (device as u32 + pin_index as u32) % INTX_GSI_COUNT
}

/// A function on the PCI bus.
///
/// Configuration offsets are below [`config::SPACE_SIZE`] and accesses are 1, 2 or 4
/// bytes wide and naturally aligned (the root splits or drops anything else).
pub trait PciDevice: Send {
    fn config_read(&mut self, offset: u16, data: &mut [u8]);
    fn config_write(&mut self, offset: u16, data: &[u8]);
    /// The BARs the guest has currently placed and enabled (memory decoding on).
    fn active_bars(&self) -> Vec<PciBar>;
    /// The BAR layout the device needs, for the root to allocate addresses at plug time.
    fn bar_specs(&self) -> Vec<BarSpec>;
    /// Programs the address the root allocated for `bar` (as firmware would).
    fn set_bar_address(&mut self, bar: u8, address: u64);
    /// Turns memory decoding on (firmware does it for allocated devices).
    fn enable_memory_decoding(&mut self);
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]);
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]);
    /// The function as a PCI-to-PCI bridge, if it is one: the root routes configuration
    /// cycles for the buses behind it by its bus numbers.
    fn as_bridge(&self) -> Option<&PciBridge> {
        None
    }
}

/// Maps host memory into guest-physical space (KVM memory slots in the VMM), so guest
/// accesses to a BAR's mmapped parts go straight to the device without exits.
pub trait GuestMemoryMapper: Send + Sync {
    /// Maps `[host, host + size)` at guest-physical `guest_addr`; returns a handle for
    /// [`GuestMemoryMapper::unmap`]. Addresses and size are page aligned.
    fn map(&self, guest_addr: u64, size: u64, host: u64) -> std::io::Result<u32>;
    fn unmap(&self, handle: u32) -> std::io::Result<()>;
}

/// Reads a little-endian value of `data.len()` bytes from `bytes` at `offset`, all ones past the end.
pub fn read_le(bytes: &[u8], offset: usize, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = bytes.get(offset + i).copied().unwrap_or(0xff);
    }
}

/// Writes `data` into `bytes` at `offset`, dropping what falls past the end.
pub fn write_le(bytes: &mut [u8], offset: usize, data: &[u8]) {
    for (i, byte) in data.iter().enumerate() {
        if let Some(slot) = bytes.get_mut(offset + i) {
            *slot = *byte;
        }
    }
}

/// `data` as a little-endian integer (up to 8 bytes).
pub fn le_value(data: &[u8]) -> u64 {
    data.iter()
        .take(8)
        .enumerate()
        .fold(0, |value, (i, byte)| value | (u64::from(*byte) << (8 * i)))
}

/// Fills `data` with the low bytes of `value`.
pub fn set_le_value(data: &mut [u8], value: u64) {
    for (i, byte) in data.iter_mut().enumerate().take(8) {
        *byte = (value >> (8 * i)) as u8;
    }
}
