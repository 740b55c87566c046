//! virtio 1.x devices for gpuvm.
//!
//! - [`device`]: [`VirtioDevice`], what every device implements, and what the transport
//!   hands it when the driver sets DRIVER_OK ([`Activation`]).
//! - [`transport`]: virtio-pci (modern only), a [`gpuvm_devices::pci::PciDevice`] on the
//!   PCI root bus with MSI-X and ioeventfd queue notification.
//! - [`queue`]: taking chains from a driver's ring without trusting its available index.
//! - [`worker`]: the I/O thread each activated device runs on, off the vCPU threads.
//! - [`rate_limiter`]: token buckets for bandwidth and operations (block, net, rng).
//! - Devices: [`block`], [`net`], [`vsock`], [`rng`], [`balloon`]; [`vhost_user`] devices whose data
//!   path is an external backend (virtiofsd, qemu-storage-daemon).
//!
//! Every device accepts whatever a guest writes into its rings and registers: a bad
//! descriptor chain is answered with an error status or dropped, never a panic.

pub mod balloon;
pub mod block;
pub mod device;
pub mod net;
pub mod queue;
pub mod rate_limiter;
pub mod rng;
pub(crate) mod socket;
pub mod transport;
pub mod vhost_user;
pub mod vsock;
pub mod worker;

#[cfg(test)]
pub(crate) mod test_util;

pub use device::{
    read_config_bytes, ActivateError, Activation, ActiveQueue, DeviceState, DeviceStateError,
    QueuePosition, VirtioDevice, VirtioInterrupt,
};

/// Guest memory as the devices see it (every region of the VM's RAM, mapped in gpuvm).
pub type GuestMemory = vm_memory::GuestMemoryMmap;

/// Locks `mutex`, carrying on if a thread panicked while holding it (the panic was
/// reported by its own thread; the data stays usable).
pub(crate) fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Counts a recurring message a guest can cause (a bad descriptor, a bad register write) and
/// lets the first few through, then only the 2^k-th, so a guest cannot flood the log.
#[derive(Debug)]
pub(crate) struct LogSampler {
    count: u64,
    /// How many are logged before only powers of two are.
    first: u64,
}

impl LogSampler {
    pub(crate) const fn new(first: u64) -> Self {
        LogSampler { count: 0, first }
    }

    /// Counts one more; whether to log this one.
    pub(crate) fn sample(&mut self) -> bool {
        self.count = self.count.saturating_add(1);
        self.count <= self.first || self.count.is_power_of_two()
    }

    /// How many were counted so far.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::LogSampler;

    #[test]
    fn log_sampler_lets_the_first_then_powers_of_two_through() {
        let mut sampler = LogSampler::new(3);
        let logged: Vec<u64> = (1..=40).filter(|_| sampler.sample()).collect::<Vec<_>>();
        assert_eq!(logged, [1, 2, 3, 4, 8, 16, 32]);
        assert_eq!(sampler.count(), 40);
    }
}
