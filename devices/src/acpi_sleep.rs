//! The hardware-reduced ACPI sleep control and status registers, for power-off.
//!
//! A hardware-reduced platform has no PM1 control block; the FADT's SLEEP_CONTROL_REG and
//! SLEEP_STATUS_REG (8-bit, system I/O) take its place. gpuvm puts both at one port,
//! [`SLEEP_CONTROL_PORT`] (the DSDT reserves it and names `\_S5_` as sleep type
//! [`S5_SLEEP_TYPE`]; see arch/src/x86_64/acpi.rs). To power off, ACPICA
//! (hwxfsleep.c, `acpi_hw_extended_sleep`) clears WAK_STS in the status register, then
//! writes `SLP_TYP << 2 | SLP_EN` to the control register:
//!
//! ```text
//! bit  7     WAK_STS (status register; write 1 to clear)
//! bit  5     SLP_EN  (control register: enter the sleep state)
//! bits 4..2  SLP_TYP (control register: which state, from the \_Sx_ package)
//! ```
//!
//! Only SLP_EN with the S5 type does anything: it signals the power-off event. gpuvm
//! supports no other sleep state (the DSDT names none), so the guest never waits on
//! WAK_STS: reads return 0.

use log::{debug, info, warn};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// The one port of both registers (Cloud Hypervisor uses the same for its ACPI shutdown
/// device; nothing else of gpuvm's is near it).
pub const SLEEP_CONTROL_PORT: u16 = 0x600;
/// The SLP_TYP value the DSDT's `\_S5_` package gives for soft-off.
pub const S5_SLEEP_TYPE: u8 = 5;
/// SLEEP_CONTROL_REG's SLP_EN bit.
pub const SLP_EN: u8 = 1 << 5;
/// Where SLP_TYP sits in SLEEP_CONTROL_REG, and its mask.
pub const SLP_TYP_SHIFT: u8 = 2;
pub const SLP_TYP_MASK: u8 = 0x7 << SLP_TYP_SHIFT;
/// SLEEP_STATUS_REG's WAK_STS bit (ACPICA writes it to clear the status before sleeping).
pub const WAK_STS: u8 = 1 << 7;

/// The sleep control/status register pair: powers the VM off on an S5 request.
pub struct AcpiSleepControl {
    poweroff_evt: EventFd,
}

impl AcpiSleepControl {
    /// Width of the port range: one byte register.
    pub const LEN: u64 = 1;

    /// `poweroff_evt` is signalled when the guest enters S5 (soft-off).
    pub fn new(poweroff_evt: EventFd) -> Self {
        AcpiSleepControl { poweroff_evt }
    }
}

impl BusDevice for AcpiSleepControl {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        // The registers are 8 bits wide (the FADT's GAS says byte access); a wider or
        // misplaced write is not a sleep request.
        let [value] = data else {
            debug!(
                "ACPI sleep control: ignored a {}-byte write at offset {offset}",
                data.len()
            );
            return;
        };
        if offset != 0 {
            debug!("ACPI sleep control: ignored a write at offset {offset}");
            return;
        }
        if value & SLP_EN == 0 {
            // ACPICA's WAK_STS clear before every sleep lands here.
            debug!("ACPI sleep control: {value:#04x} written without SLP_EN, ignored");
            return;
        }
        let sleep_type = (value & SLP_TYP_MASK) >> SLP_TYP_SHIFT;
        if sleep_type != S5_SLEEP_TYPE {
            warn!(
                "the guest asked for ACPI sleep type {sleep_type} (control register {value:#04x}); only S5 (power-off) is supported, ignored"
            );
            return;
        }
        info!("guest requested power-off through the ACPI sleep control register");
        if let Err(e) = self.poweroff_evt.write(1) {
            warn!("cannot signal the power-off event: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Linux writes to enter S5: `((5 << 2) & 0x1c) | 0x20`.
    const S5_REQUEST: u8 = 0x34;

    fn device() -> (AcpiSleepControl, EventFd) {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (AcpiSleepControl::new(evt.try_clone().unwrap()), evt)
    }

    #[test]
    fn linux_s5_request_signals_power_off() {
        assert_eq!(
            (S5_SLEEP_TYPE << SLP_TYP_SHIFT) & SLP_TYP_MASK | SLP_EN,
            S5_REQUEST
        );
        let (mut device, evt) = device();
        // ACPICA's sequence: clear WAK_STS, then SLP_TYP | SLP_EN.
        device.write(0, &[WAK_STS]);
        assert!(evt.read().is_err(), "clearing WAK_STS is no power-off");
        device.write(0, &[S5_REQUEST]);
        assert_eq!(evt.read().unwrap(), 1);
        // Bits outside SLP_TYP and SLP_EN do not matter.
        device.write(0, &[S5_REQUEST | 0xc3]);
        assert_eq!(evt.read().unwrap(), 1);
    }

    #[test]
    fn other_sleep_states_and_slp_en_clear_are_ignored() {
        let (mut device, evt) = device();
        for sleep_type in (0..8u8).filter(|&t| t != S5_SLEEP_TYPE) {
            device.write(0, &[sleep_type << SLP_TYP_SHIFT | SLP_EN]);
        }
        // S5's type without SLP_EN, and every value without SLP_EN.
        for value in (0..=u8::MAX).filter(|v| v & SLP_EN == 0) {
            device.write(0, &[value]);
        }
        assert!(evt.read().is_err(), "no power-off was signalled");
    }

    #[test]
    fn odd_widths_offsets_and_empty_writes_are_ignored() {
        let (mut device, evt) = device();
        device.write(0, &[]);
        device.write(0, &[S5_REQUEST, 0]);
        device.write(0, &[S5_REQUEST; 4]);
        device.write(1, &[S5_REQUEST]);
        device.write(u64::MAX, &[S5_REQUEST]);
        device.write(u64::MAX, &[]);
        assert!(evt.read().is_err(), "no power-off was signalled");
    }

    #[test]
    fn reads_return_zero() {
        let (mut device, evt) = device();
        for offset in [0, 1, 7, u64::MAX] {
            for len in [1, 2, 4] {
                let mut data = vec![0xaau8; len];
                device.read(offset, &mut data);
                assert_eq!(data, vec![0; len]);
            }
        }
        device.read(0, &mut []);
        assert!(evt.read().is_err(), "reads never power off");
    }
}
