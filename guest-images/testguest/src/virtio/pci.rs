//! PCI configuration space of bus 0 through configuration mechanism #1 (ports 0xcf8/0xcfc),
//! the capability list, memory BAR addresses and the MSI-X capability.

use crate::arch::{inl, outl};

const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;
const REG_COMMAND: u8 = 0x04;
const REG_BAR0: u8 = 0x10;
const REG_CAPABILITIES: u8 = 0x34;
const STATUS_CAPABILITY_LIST: u32 = 1 << 4;
const COMMAND_MEMORY: u32 = 1 << 1;
const COMMAND_BUS_MASTER: u32 = 1 << 2;
pub const CAP_VENDOR: u8 = 0x09;
pub const CAP_MSIX: u8 = 0x11;
const MSIX_ENABLE: u32 = 1 << 31;
const MSIX_FUNCTION_MASK: u32 = 1 << 30;

fn config_address(device: u8, register: u8) -> u32 {
    1 << 31 | u32::from(device) << 11 | u32::from(register & 0xfc)
}

/// The aligned dword at `register` of bus 0, device `device`, function 0.
pub fn config_read(device: u8, register: u8) -> u32 {
    outl(CONFIG_ADDRESS, config_address(device, register));
    inl(CONFIG_DATA)
}

pub fn config_write(device: u8, register: u8, value: u32) {
    outl(CONFIG_ADDRESS, config_address(device, register));
    outl(CONFIG_DATA, value);
}

/// The first device on bus 0 (function 0) with these IDs.
pub fn find(vendor: u16, device_id: u16) -> Option<u8> {
    let wanted = u32::from(device_id) << 16 | u32::from(vendor);
    (0..32u8).find(|&device| config_read(device, 0) == wanted)
}

/// Memory decoding and bus mastering on (status bits written as 0: they are write-1-to-clear).
pub fn enable_memory_and_bus_master(device: u8) {
    let command = config_read(device, REG_COMMAND) & 0xffff;
    config_write(
        device,
        REG_COMMAND,
        command | COMMAND_MEMORY | COMMAND_BUS_MASTER,
    );
}

pub fn command(device: u8) -> u32 {
    config_read(device, REG_COMMAND) & 0xffff
}

/// The capability pointers of `device` in list order (at most 48: a loop ends there).
pub struct Capabilities {
    device: u8,
    next: u8,
    remaining: u8,
}

pub fn capabilities(device: u8) -> Capabilities {
    let has_list = config_read(device, REG_COMMAND) >> 16 & STATUS_CAPABILITY_LIST != 0;
    Capabilities {
        device,
        next: if has_list {
            (config_read(device, REG_CAPABILITIES) & 0xfc) as u8
        } else {
            0
        },
        remaining: 48,
    }
}

impl Iterator for Capabilities {
    /// (pointer, capability ID)
    type Item = (u8, u8);

    fn next(&mut self) -> Option<(u8, u8)> {
        if self.next < 0x40 || self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let pointer = self.next;
        let header = config_read(self.device, pointer);
        self.next = (header >> 8 & 0xfc) as u8;
        Some((pointer, header as u8))
    }
}

/// Why a BAR cannot be used.
pub enum BarError {
    NoSuchBar,
    IoSpace,
    Unassigned,
}

impl core::fmt::Display for BarError {
    fn fmt(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
        f.write_str(match self {
            BarError::NoSuchBar => "is not a BAR index (0-5)",
            BarError::IoSpace => "is an I/O BAR",
            BarError::Unassigned => "has no address assigned",
        })
    }
}

/// The address a memory BAR was programmed with (32- or 64-bit).
pub fn bar_address(device: u8, bar: u8) -> Result<u64, BarError> {
    if bar > 5 {
        return Err(BarError::NoSuchBar);
    }
    let register = REG_BAR0 + 4 * bar;
    let low = config_read(device, register);
    if low & 1 != 0 {
        return Err(BarError::IoSpace);
    }
    let mut address = u64::from(low & !0xf);
    if low & 0b110 == 0b100 {
        if bar == 5 {
            return Err(BarError::NoSuchBar);
        }
        address |= u64::from(config_read(device, register + 4)) << 32;
    }
    if address == 0 {
        return Err(BarError::Unassigned);
    }
    Ok(address)
}

/// The MSI-X capability: where its table is and how many entries it has.
pub struct Msix {
    device: u8,
    pointer: u8,
    pub table_size: u16,
    pub table_bar: u8,
    pub table_offset: u32,
}

impl Msix {
    pub fn find(device: u8) -> Option<Msix> {
        let (pointer, _) = capabilities(device).find(|&(_, id)| id == CAP_MSIX)?;
        let control = config_read(device, pointer);
        let table = config_read(device, pointer + 4);
        Some(Msix {
            device,
            pointer,
            table_size: (control >> 16 & 0x7ff) as u16 + 1,
            table_bar: (table & 7) as u8,
            table_offset: table & !7,
        })
    }

    /// MSI-X on, function mask off; returns whether the enable bit reads back set.
    pub fn enable(&self) -> bool {
        let control = config_read(self.device, self.pointer);
        config_write(
            self.device,
            self.pointer,
            (control | MSIX_ENABLE) & !MSIX_FUNCTION_MASK,
        );
        config_read(self.device, self.pointer) & MSIX_ENABLE != 0
    }

    pub fn pointer(&self) -> u8 {
        self.pointer
    }
}
