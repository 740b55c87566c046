//! A placeholder for legacy ports that Linux probes but gpuvm does not emulate.

use log::trace;

use crate::bus::BusDevice;

/// Ignores writes and answers every read with one fixed byte.
///
/// For example the POST code port 0x80 (`Sink::new("post", 0xff)`) and the CMOS/RTC
/// at 0x70..=0x71 (`Sink::new("cmos", 0)`: every RTC register reads 0, so the clock is
/// unset but stable and never "update in progress").
#[derive(Debug)]
pub struct Sink {
    name: &'static str,
    read_value: u8,
}

impl Sink {
    /// `name` only appears in trace logs.
    pub fn new(name: &'static str, read_value: u8) -> Self {
        Sink { name, read_value }
    }
}

impl BusDevice for Sink {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        trace!(
            "{}: read of {} byte(s) at +{offset:#x}",
            self.name,
            data.len()
        );
        data.fill(self.read_value);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        trace!("{}: write {data:02x?} at +{offset:#x} ignored", self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fixed_value_and_ignores_writes() {
        for value in [0u8, 0xff] {
            let mut sink = Sink::new("test", value);
            for offset in [0, 1, u64::MAX] {
                sink.write(offset, &[1, 2, 3]);
                sink.write(offset, &[]);
                let mut data = [!value; 3];
                sink.read(offset, &mut data);
                assert_eq!(data, [value; 3]);
                sink.read(offset, &mut []);
            }
        }
    }
}
