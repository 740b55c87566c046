//! How a device behind the transport interrupts the driver: the ISR byte and MSI-X
//! vectors (one irqfd per vector). Everything is atomics and eventfds so the device's I/O
//! thread signals without taking the transport's lock.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};

use vmm_sys_util::eventfd::EventFd;

use super::NO_VECTOR;
use crate::VirtioInterrupt;

/// ISR bit 0: a queue has new used buffers.
pub const ISR_QUEUE: u8 = 1;
/// ISR bit 1: the device configuration changed.
pub const ISR_CONFIG: u8 = 2;

struct Vector {
    /// An irqfd on the vector's GSI.
    irqfd: EventFd,
    /// MSI-X enabled, function and vector unmasked: a write to `irqfd` reaches the guest.
    live: AtomicBool,
    /// Signalled while masked; delivered when unmasked (the PBA bit of the spec).
    pending: AtomicBool,
}

/// The interrupt side of one virtio-pci function, shared between the transport (register
/// accesses on vCPU threads) and the device's I/O thread.
///
/// No INTx: a signal while MSI-X is disabled only sets the ISR bit.
pub struct VirtioPciInterrupt {
    isr: AtomicU8,
    config_generation: AtomicU8,
    msix_enabled: AtomicBool,
    config_vector: AtomicU16,
    queue_vectors: Vec<AtomicU16>,
    vectors: Vec<Vector>,
}

impl VirtioPciInterrupt {
    pub(super) fn new(irqfds: Vec<EventFd>, queues: usize) -> Self {
        VirtioPciInterrupt {
            isr: AtomicU8::new(0),
            config_generation: AtomicU8::new(0),
            msix_enabled: AtomicBool::new(false),
            config_vector: AtomicU16::new(NO_VECTOR),
            queue_vectors: (0..queues).map(|_| AtomicU16::new(NO_VECTOR)).collect(),
            vectors: irqfds
                .into_iter()
                .map(|irqfd| Vector {
                    irqfd,
                    live: AtomicBool::new(false),
                    pending: AtomicBool::new(false),
                })
                .collect(),
        }
    }

    pub(super) fn vector_count(&self) -> usize {
        self.vectors.len()
    }

    /// `vector` if the function has it, [`NO_VECTOR`] otherwise (what the driver reads
    /// back to learn that its choice was refused).
    pub(super) fn checked_vector(&self, vector: u16) -> u16 {
        if usize::from(vector) < self.vectors.len() {
            vector
        } else {
            NO_VECTOR
        }
    }

    pub(super) fn config_vector(&self) -> u16 {
        self.config_vector.load(Ordering::Acquire)
    }

    pub(super) fn set_config_vector(&self, vector: u16) {
        self.config_vector
            .store(self.checked_vector(vector), Ordering::Release);
    }

    pub(super) fn queue_vector(&self, queue: usize) -> u16 {
        self.queue_vectors
            .get(queue)
            .map_or(NO_VECTOR, |v| v.load(Ordering::Acquire))
    }

    pub(super) fn set_queue_vector(&self, queue: usize, vector: u16) {
        if let Some(slot) = self.queue_vectors.get(queue) {
            slot.store(self.checked_vector(vector), Ordering::Release);
        }
    }

    /// The ISR byte as a driver reads it: reading clears it.
    pub(super) fn take_isr(&self) -> u8 {
        self.isr.swap(0, Ordering::AcqRel)
    }

    pub(super) fn isr(&self) -> u8 {
        self.isr.load(Ordering::Acquire)
    }

    pub(super) fn set_isr(&self, isr: u8) {
        self.isr.store(isr, Ordering::Release);
    }

    pub(super) fn config_generation(&self) -> u8 {
        self.config_generation.load(Ordering::Acquire)
    }

    pub(super) fn set_config_generation(&self, generation: u8) {
        self.config_generation.store(generation, Ordering::Release);
    }

    pub(super) fn pending(&self, vector: usize) -> bool {
        self.vectors
            .get(vector)
            .is_some_and(|v| v.pending.load(Ordering::Acquire))
    }

    pub(super) fn set_pending(&self, vector: usize, pending: bool) {
        if let Some(v) = self.vectors.get(vector) {
            v.pending.store(pending, Ordering::Release);
        }
    }

    /// Follows the MSI-X table: whether MSI-X is enabled and which vectors are unmasked
    /// (`live`, one per vector). Vectors that became live deliver what was pending.
    pub(super) fn set_msix_state(&self, enabled: bool, live: &[bool]) {
        self.msix_enabled.store(enabled, Ordering::SeqCst);
        for (index, vector) in self.vectors.iter().enumerate() {
            let now_live = enabled && live.get(index).copied().unwrap_or(false);
            vector.live.store(now_live, Ordering::SeqCst);
            // Pairs with `fire`: whichever side runs second sees the other's store.
            if now_live && vector.pending.swap(false, Ordering::SeqCst) {
                Self::write_irqfd(index, &vector.irqfd);
            }
        }
    }

    /// A driver reset: ISR and the vector choices go back to their defaults.
    pub(super) fn reset(&self) {
        self.isr.store(0, Ordering::Release);
        self.config_generation.store(0, Ordering::Release);
        self.config_vector.store(NO_VECTOR, Ordering::Release);
        for slot in &self.queue_vectors {
            slot.store(NO_VECTOR, Ordering::Release);
        }
        for vector in &self.vectors {
            vector.pending.store(false, Ordering::Release);
        }
    }

    fn fire(&self, vector: u16) {
        let Some(target) = self.vectors.get(usize::from(vector)) else {
            return; // NO_VECTOR, or a vector the function does not have.
        };
        if !self.msix_enabled.load(Ordering::SeqCst) {
            return;
        }
        target.pending.store(true, Ordering::SeqCst);
        if target.live.load(Ordering::SeqCst) && target.pending.swap(false, Ordering::SeqCst) {
            Self::write_irqfd(usize::from(vector), &target.irqfd);
        }
    }

    fn write_irqfd(index: usize, irqfd: &EventFd) {
        // Only fails when the counter is about to overflow: the guest has ~2^64 interrupts
        // to take already, one more is not lost.
        if let Err(error) = irqfd.write(1) {
            log::debug!("virtio-pci: MSI-X vector {index}: irqfd write: {error}");
        }
    }
}

impl VirtioInterrupt for VirtioPciInterrupt {
    fn signal_queue(&self, queue_index: u16) -> io::Result<()> {
        let Some(slot) = self.queue_vectors.get(usize::from(queue_index)) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("virtio-pci: no queue {queue_index}"),
            ));
        };
        self.isr.fetch_or(ISR_QUEUE, Ordering::AcqRel);
        self.fire(slot.load(Ordering::Acquire));
        Ok(())
    }

    fn signal_config(&self) -> io::Result<()> {
        // The driver re-reads the configuration until the generation stays the same.
        self.config_generation.fetch_add(1, Ordering::AcqRel);
        self.isr.fetch_or(ISR_CONFIG, Ordering::AcqRel);
        self.fire(self.config_vector.load(Ordering::Acquire));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    fn interrupt(vectors: usize, queues: usize) -> (VirtioPciInterrupt, Vec<EventFd>) {
        let fds: Vec<EventFd> = (0..vectors)
            .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
            .collect();
        let clones = fds.iter().map(|fd| fd.try_clone().unwrap()).collect();
        (VirtioPciInterrupt::new(fds, queues), clones)
    }

    #[test]
    fn masked_vector_is_held_pending_until_unmasked() {
        let (interrupt, fds) = interrupt(3, 2);
        interrupt.set_queue_vector(1, 2);
        interrupt.set_msix_state(true, &[true, true, false]);
        interrupt.signal_queue(1).unwrap();
        assert!(fds[2].read().is_err(), "vector 2 is masked");
        assert!(interrupt.pending(2));
        interrupt.set_msix_state(true, &[true, true, true]);
        assert_eq!(fds[2].read().unwrap(), 1);
        assert!(!interrupt.pending(2));
        assert!(fds[0].read().is_err() && fds[1].read().is_err());
    }

    #[test]
    fn disabled_msix_and_no_vector_only_set_isr() {
        let (interrupt, fds) = interrupt(2, 1);
        interrupt.set_queue_vector(0, 0);
        interrupt.signal_queue(0).unwrap();
        assert!(fds[0].read().is_err());
        assert!(!interrupt.pending(0), "nothing pends while MSI-X is off");
        assert_eq!(interrupt.take_isr(), ISR_QUEUE);
        assert_eq!(interrupt.take_isr(), 0, "read clears");
        interrupt.set_msix_state(true, &[true, true]);
        interrupt.set_queue_vector(0, 7);
        assert_eq!(interrupt.queue_vector(0), NO_VECTOR, "out of range");
        interrupt.signal_queue(0).unwrap();
        assert!(fds.iter().all(|fd| fd.read().is_err()));
        assert!(interrupt.signal_queue(5).is_err());
    }

    #[test]
    fn config_signal_bumps_generation() {
        let (interrupt, fds) = interrupt(2, 1);
        interrupt.set_config_vector(1);
        interrupt.set_msix_state(true, &[true, true]);
        interrupt.signal_config().unwrap();
        assert_eq!(fds[1].read().unwrap(), 1);
        assert_eq!(interrupt.config_generation(), 1);
        assert_eq!(interrupt.take_isr(), ISR_CONFIG);
    }
}
