//! The PCI configuration space of a [`VirtioPciDevice`]: the header and capabilities the
//! guest reads (built once, with the fields it may write laid over them), the command
//! register, MSI-X control, and the PCI_CFG window into BAR0.

use gpuvm_devices::pci::{config, BarSet, PciDevice};

use super::layout::*;
use super::pci::VirtioPciDevice;

/// Command register bits the guest may set: memory space, bus master, parity and SERR
/// response, INTx disable. (No I/O BAR, so no I/O space bit.)
const COMMAND_WRITABLE: u16 = 0x0546;
const MSIX_CONTROL_AT: u16 = CAP_MSIX_AT + 2;

/// The window of the PCI_CFG access capability: BAR memory through configuration space.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PciCfgWindow {
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
}

impl VirtioPciDevice {
    /// A guest's read of configuration space.
    pub(super) fn read_config_space(&mut self, offset: u16, data: &mut [u8]) {
        if BarSet::handles(offset) {
            return self.bars.read(offset, data);
        }
        let mut image = self.config_snapshot();
        let end = usize::from(offset) + data.len();
        let data_at = usize::from(PCI_CFG_DATA);
        if usize::from(offset) < data_at + 4 && end > data_at {
            // A read of pci_cfg_data reads BAR memory through the window.
            let mut window = [0u8; 4];
            if let Some((bar_offset, length)) = self.pci_cfg_target() {
                self.bar_read(BAR_INDEX, bar_offset, &mut window[..length]);
            }
            image[data_at..data_at + 4].copy_from_slice(&window);
        }
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = image.get(usize::from(offset) + i).copied().unwrap_or(0);
        }
    }

    /// A guest's write to configuration space: the BARs, then each writable field the
    /// access touches.
    pub(super) fn write_config_space(&mut self, offset: u16, data: &[u8]) {
        if BarSet::handles(offset) {
            self.bars.write(offset, data);
            return self.sync_notify_registration();
        }
        if let Some(command) = merge_field(config::COMMAND, 2, self.command.into(), offset, data) {
            self.write_command(command as u16);
        }
        if let Some(line) = merge_field(
            config::INTERRUPT_LINE,
            1,
            self.interrupt_line.into(),
            offset,
            data,
        ) {
            self.interrupt_line = line as u8;
        }
        if let Some(control) =
            merge_field(MSIX_CONTROL_AT, 2, self.msix.control().into(), offset, data)
        {
            if self.msix.set_control(control as u16) {
                log::debug!(
                    "{}: MSI-X {}",
                    self.name,
                    if self.msix.enabled() {
                        "enabled"
                    } else {
                        "disabled"
                    }
                );
            }
            self.sync_msix_state();
        }
        if let Some(bar) = merge_field(PCI_CFG_BAR, 1, self.pci_cfg.bar.into(), offset, data) {
            self.pci_cfg.bar = bar as u8;
        }
        if let Some(value) =
            merge_field(PCI_CFG_OFFSET, 4, self.pci_cfg.offset.into(), offset, data)
        {
            self.pci_cfg.offset = value as u32;
        }
        if let Some(value) =
            merge_field(PCI_CFG_LENGTH, 4, self.pci_cfg.length.into(), offset, data)
        {
            self.pci_cfg.length = value as u32;
        }
        if merge_field(PCI_CFG_DATA, 4, 0, offset, data).is_some() {
            // The driver writes exactly the window's length at the start of pci_cfg_data.
            match self.pci_cfg_target() {
                Some((bar_offset, length)) if offset == PCI_CFG_DATA && data.len() == length => {
                    self.bar_write(BAR_INDEX, bar_offset, data)
                }
                _ => {
                    let window = self.pci_cfg;
                    self.guest_error(format_args!(
                        "pci_cfg_data write of {} byte(s) through an invalid window {window:?}",
                        data.len()
                    ))
                }
            }
        }
    }

    /// Configuration space as the guest reads it, without side effects.
    fn config_snapshot(&self) -> [u8; CONFIG_IMAGE_LEN] {
        let mut image = self.config_image;
        let mut put = |offset: u16, bytes: &[u8]| {
            let start = usize::from(offset);
            image[start..start + bytes.len()].copy_from_slice(bytes);
        };
        put(config::COMMAND, &self.command.to_le_bytes());
        put(config::INTERRUPT_LINE, &[self.interrupt_line]);
        let vectors = self.interrupt.vector_count() as u16;
        let control = (vectors.saturating_sub(1) & 0x7ff) | self.msix.control();
        put(MSIX_CONTROL_AT, &control.to_le_bytes());
        put(PCI_CFG_BAR, &[self.pci_cfg.bar]);
        put(PCI_CFG_OFFSET, &self.pci_cfg.offset.to_le_bytes());
        put(PCI_CFG_LENGTH, &self.pci_cfg.length.to_le_bytes());
        image
    }

    /// The BAR access the PCI_CFG window describes, if it is a valid one.
    fn pci_cfg_target(&self) -> Option<(u64, usize)> {
        let window = self.pci_cfg;
        let length = window.length as usize;
        let valid = window.bar == BAR_INDEX
            && matches!(length, 1 | 2 | 4)
            && (window.offset as usize).is_multiple_of(length)
            && u64::from(window.offset) + length as u64 <= BAR_SIZE;
        valid.then_some((u64::from(window.offset), length))
    }

    pub(super) fn write_command(&mut self, command: u16) {
        self.command = command & COMMAND_WRITABLE;
        self.bars
            .set_memory_enabled(self.command & config::COMMAND_MEMORY != 0);
        self.sync_notify_registration();
    }
}

/// The new value of a `len`-byte field at `field` if the access at `offset` touches it.
fn merge_field(field: u16, len: u16, current: u64, offset: u16, data: &[u8]) -> Option<u64> {
    let end = offset.checked_add(data.len() as u16)?;
    if end <= field || offset >= field + len {
        return None;
    }
    let mut bytes = current.to_le_bytes();
    for (i, byte) in data.iter().enumerate() {
        let at = offset + i as u16;
        if (field..field + len).contains(&at) {
            bytes[usize::from(at - field)] = *byte;
        }
    }
    Some(u64::from_le_bytes(bytes))
}
