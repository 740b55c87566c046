//! The virtio-pci transport (virtio 1.x section 4.1), modern devices only.
//!
//! [`VirtioPciDevice`] puts one [`VirtioDevice`](crate::VirtioDevice) on the PCI root bus as
//! a [`gpuvm_devices::pci::PciDevice`]: vendor 0x1af4, device 0x1040 + the virtio device
//! type, one 64-bit memory BAR (BAR0, [`layout::BAR_SIZE`]) holding the common
//! configuration, the ISR byte, the device configuration, the notify area, the MSI-X table
//! and its PBA at the fixed offsets of [`layout`], and the vendor capabilities that point
//! the driver at them (plus the PCI_CFG access capability and MSI-X).
//!
//! - Interrupts are MSI-X only: one vector per queue plus one for configuration changes,
//!   each a GSI whose irqfd the VMM allocated ([`VectorAllocator`]), routed through
//!   [`MsiRouting`](gpuvm_devices::pci::MsiRouting). There is no INTx: the interrupt pin
//!   reads 0, and a device signalling while MSI-X is disabled only sets the ISR bit. An
//!   interrupt for a masked vector is held pending and delivered on unmask.
//! - Queue notifications: each queue has one kick [`EventFd`] the transport owns for its
//!   whole life (devices get clones). A driver's write to the notify area reaches it on
//!   the MMIO exit path, or directly through a KVM ioeventfd the VMM installs for the
//!   transport through [`IoEventRegistrar`] wherever the guest places BAR0.
//! - Snapshots: [`VirtioPciState`] through [`gpuvm_devices::Persist`]; see
//!   [`VirtioPciDevice::pause`].
//!
//! Wiring in the VMM:
//!
//! ```text
//! let transport = VirtioPciDevice::new(Box::new(block), memory, &mut allocate_gsis_and_irqfds,
//!                                      msi_router, ioeventfd_registrar)?;
//! let transport = Arc::new(Mutex::new(transport));
//! pci_root.add_device(transport.clone() as Arc<Mutex<dyn PciDevice>>);   // BARs allocated,
//!                                                 // set_bar_address + enable_memory_decoding
//! // snapshot: lock, pause(), save(); restore: build the same way, then restore(&state)
//! ```

mod common_config;
mod config_space;
mod interrupt;
pub mod layout;
mod pci;
mod state;
#[cfg(test)]
mod tests;

use std::io;

use vmm_sys_util::eventfd::EventFd;

pub use interrupt::VirtioPciInterrupt;
pub use pci::VirtioPciDevice;
pub use state::{MsixEntryState, PciConfigState, QueueConfigState, VirtioPciState};

/// GSIs and their eventfds for `count` MSI-X vectors: the VMM registers each eventfd as an
/// irqfd on its GSI (same shape as the passthrough device's allocator).
pub type VectorAllocator<'a> = &'a mut dyn FnMut(u32) -> io::Result<Vec<(u32, EventFd)>>;

/// "No MSI-X vector" in `config_msix_vector` and `queue_msix_vector`.
pub const NO_VECTOR: u16 = 0xffff;

/// Installs and removes KVM ioeventfds, so a guest's write to a queue's notify address
/// signals the queue's kick eventfd in the kernel instead of exiting to the VMM.
///
/// Drivers write the 16-bit queue index there (VIRTIO_F_NOTIFICATION_DATA is not offered),
/// so the VMM should match writes of any length without data match (KVM_IOEVENTFD with
/// length 0, or 2).
pub trait IoEventRegistrar: Send + Sync {
    fn register(&self, address: u64, fd: &EventFd) -> io::Result<()>;
    fn unregister(&self, address: u64, fd: &EventFd) -> io::Result<()>;
}

/// Why a transport could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{device}: {queues} queues, the transport supports 1 to {max}")]
    QueueCount {
        device: String,
        queues: usize,
        max: usize,
    },
    #[error("{device}: queue {queue} has maximum size {size}, not a power of two up to 32768")]
    QueueMaxSize {
        device: String,
        queue: usize,
        size: u16,
    },
    #[error("{device}: cannot allocate {wanted} MSI-X vectors: {source}")]
    Vectors {
        device: String,
        wanted: u32,
        source: io::Error,
    },
    #[error("{device}: asked for {wanted} MSI-X vectors, got {got}")]
    VectorCount {
        device: String,
        wanted: u32,
        got: usize,
    },
    #[error("{device}: cannot create a queue kick eventfd: {source}")]
    KickEventFd { device: String, source: io::Error },
}

/// How a saved transport state does not fit the transport it is loaded into.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateMismatch {
    #[error("{saved} queues saved, the device has {now}")]
    QueueCount { saved: usize, now: usize },
    #[error("{saved} MSI-X vectors saved, the function has {now}")]
    VectorCount { saved: usize, now: usize },
    #[error("acked features {0:#x} are not offered by this device")]
    UnofferedFeatures(u64),
    #[error("config vector {0}")]
    ConfigVector(u16),
    #[error("queue {index} size {size} (maximum {max})")]
    QueueSize { index: usize, size: u16, max: u16 },
    #[error("queue {index} vector {vector}")]
    QueueVector { index: usize, vector: u16 },
    #[error("queue {index} notify offset {offset}")]
    NotifyOffset { index: usize, offset: u16 },
    /// The transport's own check of the acked features (its words).
    #[error("FEATURES_OK with {0}")]
    Features(String),
    /// The saved ring addresses, checked as a driver's would be (the check's words).
    #[error("queue {index}: {reason}")]
    Queue { index: usize, reason: String },
}

/// Why a snapshot could not be taken or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{device}: the device is active and not paused; pause it before saving")]
    NotPaused { device: String },
    #[error("{device}: restore needs a freshly built transport (the driver already started it)")]
    NotFresh { device: String },
    #[error("{device}: the snapshot does not fit this device: {mismatch}")]
    Mismatch {
        device: String,
        mismatch: StateMismatch,
    },
    #[error("{device}: no device was rebuilt for its saved state")]
    NotRebuilt { device: String },
    #[error("{device}: the device's state: {source}")]
    DeviceState {
        device: String,
        /// Boxed: the devices' errors are large, and this error travels up every restore.
        source: Box<crate::DeviceStateError>,
    },
    #[error("{device}: cannot re-activate: {source}")]
    Activate {
        device: String,
        source: crate::ActivateError,
    },
}
