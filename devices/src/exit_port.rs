//! A port where the guest reports its exit status (the test guest's way to finish a run).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use log::{debug, info, warn};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Marks the stored value as reported, so status 0 differs from "nothing yet".
const REPORTED: u64 = 1 << 32;

/// The exit status the guest reported; cheap to clone, shared with the VMM.
#[derive(Clone, Debug, Default)]
pub struct ExitStatus(Arc<AtomicU64>);

impl ExitStatus {
    pub fn new() -> Self {
        Self::default()
    }

    /// The last status the guest wrote, or `None` if it has written none.
    pub fn get(&self) -> Option<u32> {
        let value = self.0.load(Ordering::Acquire);
        (value & REPORTED != 0).then_some(value as u32)
    }

    fn set(&self, status: u32) {
        self.0
            .store(REPORTED | u64::from(status), Ordering::Release);
    }
}

/// A 4-byte port: a 1-, 2- or 4-byte write at its start is the guest's exit status
/// (little-endian, zero-extended); it is stored and `exit_evt` is signalled. Reads
/// return 0.
pub struct ExitPort {
    status: ExitStatus,
    exit_evt: EventFd,
}

impl ExitPort {
    /// Width of the port range.
    pub const LEN: u64 = 4;

    pub fn new(exit_evt: EventFd) -> Self {
        ExitPort {
            status: ExitStatus::new(),
            exit_evt,
        }
    }

    /// A handle on the reported status, for the VMM to keep.
    pub fn status(&self) -> ExitStatus {
        self.status.clone()
    }
}

impl BusDevice for ExitPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 || data.is_empty() || data.len() > 4 {
            debug!(
                "exit port: ignoring a {}-byte write at offset {offset}",
                data.len()
            );
            return;
        }
        let mut bytes = [0u8; 4];
        bytes[..data.len()].copy_from_slice(data);
        let status = u32::from_le_bytes(bytes);
        info!("guest reported exit status {status}");
        self.status.set(status);
        if let Err(e) = self.exit_evt.write(1) {
            warn!("cannot signal the exit event: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port() -> (ExitPort, EventFd, ExitStatus) {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let port = ExitPort::new(evt.try_clone().unwrap());
        let status = port.status();
        (port, evt, status)
    }

    #[test]
    fn writes_report_the_status() {
        let (mut port, evt, status) = port();
        assert_eq!(status.get(), None);
        port.write(0, &[0]);
        assert_eq!(status.get(), Some(0));
        assert_eq!(evt.read().unwrap(), 1);
        port.write(0, &[0x34, 0x12]);
        assert_eq!(status.get(), Some(0x1234));
        port.write(0, &0xdead_beefu32.to_le_bytes());
        assert_eq!(status.get(), Some(0xdead_beef));
        assert_eq!(evt.read().unwrap(), 2);
    }

    #[test]
    fn hostile_writes_are_ignored() {
        let (mut port, evt, status) = port();
        port.write(0, &[]);
        port.write(1, &[5]);
        port.write(u64::MAX, &[5]);
        port.write(0, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(status.get(), None);
        assert!(evt.read().is_err(), "nothing was signalled");
        let mut data = [0xffu8; 8];
        port.read(3, &mut data);
        assert_eq!(data, [0; 8]);
    }
}
