//! Just enough of the i8042 keyboard controller for a guest to reset the machine.

use log::{info, warn};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Offset of the command/status port (0x64) from the data port (0x60).
const COMMAND_OFFSET: u64 = 4;
/// "Pulse the reset line": how Linux's `reboot=k` and most firmware reset the CPU.
const CMD_RESET_CPU: u8 = 0xfe;

/// An i8042 with no keyboard: idle on reads, resets the VM on command 0xFE.
///
/// Reads see status 0 (output buffer empty, input buffer empty: ready for commands) and
/// data 0. Other commands are accepted and ignored.
pub struct I8042 {
    reset_evt: EventFd,
}

impl I8042 {
    /// Width of the port range, 0x60..=0x64.
    pub const LEN: u64 = 5;

    /// `reset_evt` is signalled when the guest asks for a CPU reset.
    pub fn new(reset_evt: EventFd) -> Self {
        I8042 { reset_evt }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let command_index = COMMAND_OFFSET.checked_sub(offset);
        let command = command_index.and_then(|index| data.get(usize::try_from(index).ok()?));
        if command == Some(&CMD_RESET_CPU) {
            info!("guest requested a CPU reset through the i8042");
            if let Err(e) = self.reset_evt.write(1) {
                warn!("cannot signal the reset event: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> (I8042, EventFd) {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (I8042::new(evt.try_clone().unwrap()), evt)
    }

    #[test]
    fn reset_command_signals_reset() {
        let (mut i8042, evt) = device();
        i8042.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);
        assert_eq!(evt.read().unwrap(), 1);
        // A word write at 0x63 puts its second byte on the command port.
        i8042.write(3, &[0, CMD_RESET_CPU]);
        assert_eq!(evt.read().unwrap(), 1);
    }

    #[test]
    fn other_writes_do_not_reset() {
        let (mut i8042, evt) = device();
        i8042.write(COMMAND_OFFSET, &[0xaa]);
        i8042.write(0, &[CMD_RESET_CPU]);
        i8042.write(COMMAND_OFFSET + 1, &[CMD_RESET_CPU]);
        i8042.write(u64::MAX, &[CMD_RESET_CPU; 4]);
        i8042.write(COMMAND_OFFSET, &[]);
        assert!(evt.read().is_err(), "no reset was signalled");
    }

    #[test]
    fn reads_are_idle() {
        let (mut i8042, _evt) = device();
        for offset in [0, COMMAND_OFFSET, 2, 99, u64::MAX] {
            let mut data = [0xaau8; 4];
            i8042.read(offset, &mut data);
            assert_eq!(data, [0; 4]);
        }
        i8042.read(0, &mut []);
    }
}
