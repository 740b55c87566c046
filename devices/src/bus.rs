//! An address bus that routes guest accesses to devices; one for port I/O, one for MMIO.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use log::trace;

/// A device on a [`Bus`]. Offsets are relative to the base of the range it was inserted
/// at. Implementations must tolerate any offset and length a guest can produce.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors from [`Bus::insert`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("bus range at {base:#x} has zero length")]
    ZeroLength { base: u64 },
    #[error("bus range {base:#x}+{len:#x} runs past the end of the address space")]
    Wraps { base: u64, len: u64 },
    #[error(
        "bus range {base:#x}..{:#x} overlaps the device at {existing_base:#x}..{:#x}",
        .base + .len, .existing_base + .existing_len
    )]
    Overlap {
        base: u64,
        len: u64,
        existing_base: u64,
        existing_len: u64,
    },
}

struct Entry {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// Non-overlapping address ranges, each owned by one device.
///
/// Filled in before the vCPUs start, then shared read-only (`Arc<Bus>`); each device has
/// its own lock, so vCPUs only contend when they touch the same device.
#[derive(Default)]
pub struct Bus {
    /// Keyed by range base.
    entries: BTreeMap<u64, Entry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.entries
                    .iter()
                    .map(|(base, entry)| *base..*base + entry.len),
            )
            .finish()
    }
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::ZeroLength { base });
        }
        let end = base.checked_add(len).ok_or(BusError::Wraps { base, len })?;
        // Ranges are disjoint, so only the last one starting before `end` can overlap.
        if let Some((&existing_base, existing)) = self.entries.range(..end).next_back() {
            if existing_base + existing.len > base {
                return Err(BusError::Overlap {
                    base,
                    len,
                    existing_base,
                    existing_len: existing.len,
                });
            }
        }
        self.entries.insert(base, Entry { len, device });
        Ok(())
    }

    /// The device whose range holds all of `[addr, addr + len)`, and `addr`'s offset in it.
    /// An access that straddles a range boundary matches nothing.
    fn find(&self, addr: u64, len: usize) -> Option<(&Entry, u64)> {
        let (&base, entry) = self.entries.range(..=addr).next_back()?;
        let offset = addr - base;
        let fits = (len as u64)
            .checked_add(offset)
            .is_some_and(|end| end <= entry.len);
        fits.then_some((entry, offset))
    }

    /// Reads from the device at `addr`; `false` if there is none (the caller decides
    /// what the guest sees, usually all ones).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        let Some((entry, offset)) = self.find(addr, data.len()) else {
            trace!("bus read of {} byte(s) at {addr:#x}: no device", data.len());
            return false;
        };
        // A poisoned lock means a device panicked earlier; keep serving the guest.
        let mut device = entry.device.lock().unwrap_or_else(|e| e.into_inner());
        device.read(offset, data);
        true
    }

    /// Writes to the device at `addr`; `false` if there is none.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        let Some((entry, offset)) = self.find(addr, data.len()) else {
            trace!(
                "bus write of {} byte(s) at {addr:#x}: no device",
                data.len()
            );
            return false;
        };
        let mut device = entry.device.lock().unwrap_or_else(|e| e.into_inner());
        device.write(offset, data);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the last access and answers reads with its offset.
    #[derive(Default)]
    struct Recorder {
        last_write: Option<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last_write = Some((offset, data.to_vec()));
        }
    }

    fn recorder() -> Arc<Mutex<Recorder>> {
        Arc::new(Mutex::new(Recorder::default()))
    }

    #[test]
    fn bus_can_be_shared_by_vcpu_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Bus>();
    }

    #[test]
    fn overlapping_and_empty_ranges_are_rejected() {
        let mut bus = Bus::new();
        bus.insert(0x100, 0x10, recorder()).unwrap();
        for (base, len) in [
            (0x100, 0x10),
            (0x0f8, 0x09),
            (0x10f, 0x01),
            (0x104, 0x04),
            (0x0f0, 0x40),
        ] {
            let err = bus.insert(base, len, recorder()).unwrap_err();
            assert!(
                matches!(
                    err,
                    BusError::Overlap {
                        existing_base: 0x100,
                        ..
                    }
                ),
                "{base:#x}+{len:#x}: {err}"
            );
        }
        assert_eq!(
            bus.insert(0x200, 0, recorder()),
            Err(BusError::ZeroLength { base: 0x200 })
        );
        assert!(matches!(
            bus.insert(u64::MAX, 2, recorder()),
            Err(BusError::Wraps { .. })
        ));
        // Neighbours touching either end are fine.
        bus.insert(0x0f0, 0x10, recorder()).unwrap();
        bus.insert(0x110, 0x10, recorder()).unwrap();
        let err = bus.insert(0x0f8, 0x20, recorder()).unwrap_err();
        assert!(err.to_string().contains("0xf8..0x118"), "{err}");
    }

    #[test]
    fn accesses_reach_the_device_with_relative_offsets() {
        let mut bus = Bus::new();
        let low = recorder();
        let high = recorder();
        bus.insert(0x3f8, 8, low.clone()).unwrap();
        bus.insert(0xd000_0000, 0x1000, high.clone()).unwrap();

        assert!(bus.write(0x3fd, &[7]));
        assert_eq!(low.lock().unwrap().last_write, Some((5, vec![7])));
        assert!(bus.write(0xd000_0ffc, &[1, 2, 3, 4]));
        assert_eq!(
            high.lock().unwrap().last_write,
            Some((0xffc, vec![1, 2, 3, 4]))
        );

        let mut data = [0u8; 2];
        assert!(bus.read(0x3fe, &mut data));
        assert_eq!(data, [6, 6]);
    }

    #[test]
    fn boundaries_are_exact() {
        let mut bus = Bus::new();
        bus.insert(0x60, 5, recorder()).unwrap();
        let mut byte = [0u8; 1];
        assert!(!bus.read(0x5f, &mut byte));
        assert!(bus.read(0x60, &mut byte));
        assert!(bus.read(0x64, &mut byte));
        assert_eq!(byte, [4]);
        assert!(!bus.read(0x65, &mut byte));
        // Straddling the end, or the start, matches nothing.
        assert!(!bus.write(0x63, &[0; 4]));
        assert!(!bus.write(0x5f, &[0; 2]));
        // Zero-length accesses inside a range are delivered (and must be harmless).
        assert!(bus.write(0x62, &[]));
        // Accesses at the top of the address space do not overflow.
        assert!(!bus.read(u64::MAX, &mut [0u8; 8]));
        bus.insert(u64::MAX - 1, 1, recorder()).unwrap();
        assert!(bus.read(u64::MAX - 1, &mut byte));
        assert!(!bus.read(u64::MAX - 1, &mut [0u8; 8]));
        assert!(!Bus::new().write(0, &[1]));
    }
}
