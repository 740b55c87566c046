//! A 16550A UART (vm-superio's model) on the bus, interrupting through an eventfd.

use std::io::{self, Write};

use log::{debug, warn};
use serde::{Deserialize, Serialize};
use vm_superio::serial::{Error as UartError, NoEvents, SerialState as UartState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::persist::Persist;

/// Raises the UART interrupt by signalling an eventfd (registered by the VMM as an irqfd).
struct EventFdTrigger(EventFd);

impl Trigger for EventFdTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// A trigger for measuring the FIFO of a throwaway UART.
struct NoTrigger;

impl Trigger for NoTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        Ok(())
    }
}

/// Errors from [`SerialDevice::enqueue_input`] and restoring a [`SerialState`].
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    #[error("cannot raise the serial interrupt: {0}")]
    Interrupt(io::Error),
    #[error("saved serial state has {0} bytes queued, more than the FIFO holds")]
    InvalidState(usize),
}

/// The serial port's saved state: the UART's registers and receive FIFO (vm-superio's
/// `SerialState`, field for field, which has no serde support of its own).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<UartState> for SerialState {
    fn from(uart: UartState) -> Self {
        SerialState {
            baud_divisor_low: uart.baud_divisor_low,
            baud_divisor_high: uart.baud_divisor_high,
            interrupt_enable: uart.interrupt_enable,
            interrupt_identification: uart.interrupt_identification,
            line_control: uart.line_control,
            line_status: uart.line_status,
            modem_control: uart.modem_control,
            modem_status: uart.modem_status,
            scratch: uart.scratch,
            in_buffer: uart.in_buffer,
        }
    }
}

impl From<&SerialState> for UartState {
    fn from(state: &SerialState) -> Self {
        UartState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        }
    }
}

/// A 16550A serial port: guest output goes to `out` (flushed byte by byte), host input
/// is queued with [`enqueue_input`](Self::enqueue_input).
pub struct SerialDevice {
    uart: Serial<EventFdTrigger, NoEvents, Box<dyn Write + Send>>,
    /// Set after the first failed write to `out`, so a closed console logs once.
    output_failed: bool,
}

impl SerialDevice {
    /// Width of the port range: eight byte-wide registers.
    pub const LEN: u64 = 8;

    pub fn new(interrupt: EventFd, out: Box<dyn Write + Send>) -> Self {
        SerialDevice {
            uart: Serial::new(EventFdTrigger(interrupt), out),
            output_failed: false,
        }
    }

    /// Queues `bytes` for the guest to read and raises the receive interrupt if the guest
    /// enabled it. Returns how many bytes fit in the receive FIFO (0 when it is full);
    /// offer the rest again later.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> Result<usize, SerialError> {
        if bytes.is_empty() || self.uart.fifo_capacity() == 0 {
            return Ok(0);
        }
        match self.uart.enqueue_raw_bytes(bytes) {
            Ok(count) => Ok(count),
            Err(UartError::Trigger(e)) => Err(SerialError::Interrupt(e)),
            // Ruled out above (FIFO space) or not produced by enqueueing (I/O).
            Err(UartError::FullFifo) | Err(UartError::IOError(_)) => Ok(0),
        }
    }

    /// Free space in the receive FIFO, in bytes.
    pub fn fifo_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// Register number for byte `index` of an access at `offset`, if it is one of ours.
    /// A wide access covers consecutive registers, as it would on an ISA bus.
    fn register(offset: u64, index: usize) -> Option<u8> {
        let register = offset.checked_add(index as u64)?;
        (register < Self::LEN).then_some(register as u8)
    }
}

impl Persist for SerialDevice {
    type State = SerialState;
    type Error = SerialError;

    /// The UART's registers and receive FIFO.
    fn save(&self) -> Result<SerialState, SerialError> {
        Ok(self.uart.state().into())
    }

    /// Loads saved registers and receive FIFO, keeping this device's interrupt and output.
    fn restore(&mut self, state: &SerialState) -> Result<(), SerialError> {
        let fifo_size = Serial::new(NoTrigger, io::sink()).fifo_capacity();
        if state.in_buffer.len() > fifo_size {
            return Err(SerialError::InvalidState(state.in_buffer.len()));
        }
        let interrupt = self
            .uart
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(SerialError::Interrupt)?;
        let placeholder = Serial::new(
            EventFdTrigger(interrupt.try_clone().map_err(SerialError::Interrupt)?),
            Box::new(io::sink()) as Box<dyn Write + Send>,
        );
        let out = std::mem::replace(&mut self.uart, placeholder).into_writer();
        // The FIFO size was checked above, the only reason from_state refuses a state.
        self.uart = Serial::from_state(
            &UartState::from(state),
            EventFdTrigger(interrupt),
            NoEvents,
            out,
        )
        .map_err(|_| SerialError::InvalidState(state.in_buffer.len()))?;
        Ok(())
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        for (index, byte) in data.iter_mut().enumerate() {
            *byte = match Self::register(offset, index) {
                Some(register) => self.uart.read(register),
                None => 0xff,
            };
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        for (index, &value) in data.iter().enumerate() {
            let Some(register) = Self::register(offset, index) else {
                break;
            };
            match self.uart.write(register, value) {
                Ok(()) => {}
                Err(UartError::IOError(e)) if !self.output_failed => {
                    self.output_failed = true;
                    warn!("serial output failed, guest output is being lost: {e}");
                }
                Err(UartError::Trigger(e)) => warn!("cannot raise the serial interrupt: {e}"),
                Err(e) => debug!("serial write to register {register}: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn state_round_trips_and_rejects_overfull_fifo() {
        let evt = || EventFd::new(0).unwrap();
        let mut serial = SerialDevice::new(evt(), Box::new(io::sink()));
        serial.write(7, &[0x5a]); // scratch register
        serial.enqueue_input(b"abc").unwrap();
        let state = serial.save().unwrap();
        let mut restored = SerialDevice::new(evt(), Box::new(io::sink()));
        restored.restore(&state).unwrap();
        assert_eq!(restored.save().unwrap(), state);
        let mut scratch = [0u8];
        restored.read(7, &mut scratch);
        assert_eq!(scratch[0], 0x5a);
        let mut overfull = state.clone();
        overfull.in_buffer = vec![0; 1 << 20];
        assert!(restored.restore(&overfull).is_err());
        assert_eq!(
            restored.save().unwrap(),
            state,
            "a refused state leaves the device as it was"
        );
    }

    const DATA: u64 = 0;
    const IER: u64 = 1;
    const IIR: u64 = 2;
    const LSR: u64 = 5;
    const IER_RDA: u8 = 0x01;
    const IER_THR: u8 = 0x02;
    const LSR_DATA_READY: u8 = 0x01;

    /// Collects output and counts flushes.
    #[derive(Clone, Default)]
    struct Capture {
        bytes: Arc<Mutex<Vec<u8>>>,
        flushes: Arc<Mutex<usize>>,
    }

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.bytes.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            *self.flushes.lock().unwrap() += 1;
            Ok(())
        }
    }

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn serial() -> (SerialDevice, EventFd, Capture) {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let capture = Capture::default();
        let device = SerialDevice::new(irq.try_clone().unwrap(), Box::new(capture.clone()));
        (device, irq, capture)
    }

    fn read_byte(device: &mut SerialDevice, offset: u64) -> u8 {
        let mut byte = [0u8];
        device.read(offset, &mut byte);
        byte[0]
    }

    #[test]
    fn output_is_written_and_flushed_per_byte() {
        let (mut device, irq, capture) = serial();
        device.write(IER, &[IER_THR]);
        assert!(
            irq.read().unwrap() >= 1,
            "enabling THR raises the interrupt"
        );
        // Reading IIR acknowledges it, so the next transmitted byte raises it again.
        read_byte(&mut device, IIR);
        for &b in b"Linux version\n" {
            device.write(DATA, &[b]);
        }
        assert_eq!(&capture.bytes.lock().unwrap()[..], b"Linux version\n");
        assert_eq!(*capture.flushes.lock().unwrap(), 14);
        assert!(irq.read().unwrap() >= 1, "transmitting raises THR empty");
    }

    #[test]
    fn input_reaches_the_guest() {
        let (mut device, irq, _) = serial();
        assert_eq!(read_byte(&mut device, LSR) & LSR_DATA_READY, 0);
        device.write(IER, &[IER_RDA]);
        assert_eq!(device.enqueue_input(b"ok").unwrap(), 2);
        assert!(irq.read().unwrap() >= 1);
        assert_ne!(read_byte(&mut device, LSR) & LSR_DATA_READY, 0);
        assert_eq!(read_byte(&mut device, DATA), b'o');
        assert_eq!(read_byte(&mut device, DATA), b'k');
        assert_eq!(read_byte(&mut device, LSR) & LSR_DATA_READY, 0);
        assert_eq!(device.enqueue_input(b"").unwrap(), 0);
    }

    #[test]
    fn a_full_fifo_takes_what_fits() {
        let (mut device, _irq, _) = serial();
        let capacity = device.fifo_capacity();
        assert!(capacity > 0);
        let input = vec![b'x'; capacity + 10];
        assert_eq!(device.enqueue_input(&input).unwrap(), capacity);
        assert_eq!(device.fifo_capacity(), 0);
        assert_eq!(device.enqueue_input(b"more").unwrap(), 0);
        read_byte(&mut device, DATA);
        assert_eq!(device.enqueue_input(b"more").unwrap(), 1);
    }

    #[test]
    fn hostile_accesses_are_harmless() {
        let (mut device, _irq, capture) = serial();
        let mut wide = [0u8; 16];
        for offset in [7, 8, 1000, u64::MAX] {
            device.read(offset, &mut wide);
            device.write(offset, &wide);
            device.read(offset, &mut []);
            device.write(offset, &[]);
        }
        assert_eq!(
            &wide[1..],
            &[0xff; 15],
            "bytes past register 7 read as 0xff"
        );
        // A word write at the data port covers DATA and IER, like two byte writes.
        device.write(DATA, &[b'A', IER_THR]);
        assert_eq!(capture.bytes.lock().unwrap().last(), Some(&b'A'));
        assert_eq!(read_byte(&mut device, IER), IER_THR);

        // A console that fails does not take the device down.
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut broken = SerialDevice::new(irq, Box::new(Broken));
        broken.write(DATA, b"xy");
        broken.write(DATA, b"z");
        assert!(broken.output_failed);
    }
}
