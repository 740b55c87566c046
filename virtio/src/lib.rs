//! virtio 1.x devices for gpuvm.
//!
//! - [`device`]: [`VirtioDevice`], what every device implements, and what the transport
//!   hands it when the driver sets DRIVER_OK ([`Activation`]).
//! - [`transport`]: virtio-pci (modern only), a [`gpuvm_devices::pci::PciDevice`] on the
//!   PCI root bus with MSI-X and ioeventfd queue notification.
//! - [`worker`]: the I/O thread each activated device runs on, off the vCPU threads.
//! - [`rate_limiter`]: token buckets for bandwidth and operations (block, net, rng).
//! - Devices: [`block`], [`net`], [`vsock`], [`rng`]; [`vhost_user`] devices whose data
//!   path is an external backend (virtiofsd, qemu-storage-daemon).
//!
//! Every device accepts whatever a guest writes into its rings and registers: a bad
//! descriptor chain is answered with an error status or dropped, never a panic.

pub mod block;
pub mod device;
pub mod net;
pub mod rate_limiter;
pub mod rng;
pub mod transport;
pub mod vhost_user;
pub mod vsock;
pub mod worker;

pub use device::{
    ActivateError, Activation, ActiveQueue, QueuePosition, VirtioDevice, VirtioInterrupt,
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
