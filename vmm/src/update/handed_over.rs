//! What a VM keeps of its cold-plugged vfio-user devices for a live update, and what the
//! offer and the paused state say of each: plain data, so that the machine's devices
//! ([`crate::devices`]) can hold it while the hand-over's logic
//! ([`super::passthrough`]) works on the devices.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::{GuestMemoryMapper, PciBdf, PciRoot};
use gpuvm_vfio::dma::DmaProgress;
use gpuvm_vfio::pci::{VfioPciDevice, VfioPciState};
use gpuvm_vfio::user::UserConnection;
use gpuvm_vfio::user_handover::ConnectionLayout;
use serde::{Deserialize, Serialize};

use crate::interrupts::MsiRouter;

/// What the VMM keeps of its passthrough devices for a live update: the cold-plugged
/// vfio-user devices, and where a new process plugs handed-over ones.
#[derive(Default)]
pub struct PassthroughHandOver {
    pub vfio_user: Vec<PluggedVfioUser>,
    /// Segment 0's root, MSI router and BAR slots (set when PCI is attached).
    pub plug: Option<PlugParts>,
}

/// What plugging a device into segment 0 takes besides the VM.
pub struct PlugParts {
    pub root: Arc<PciRoot>,
    pub router: Arc<MsiRouter>,
    pub slots: Arc<dyn GuestMemoryMapper>,
}

/// A cold-plugged vfio-user device.
pub struct PluggedVfioUser {
    /// The device's socket path (its name; never connected to again by a new process).
    pub socket: PathBuf,
    pub bdf: PciBdf,
    pub device: Arc<Mutex<VfioPciDevice>>,
    pub connection: UserConnection,
    /// Guest RAM being (or done being) DMA-mapped for it.
    pub dma: Arc<DmaProgress>,
}

/// One handed-over vfio-user device in the offer: its socket and client layout (the
/// connection and the region files come as descriptors).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OfferedVfioUser {
    pub socket: PathBuf,
    pub layout: ConnectionLayout,
}

impl OfferedVfioUser {
    /// The connection's socket and the region files.
    pub fn descriptor_count(&self) -> usize {
        1 + self.layout.file_count()
    }
}

/// One handed-over vfio-user device in the state: where it is and the PCI state gpuvm
/// emulates for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedOverVfioUser {
    pub socket: PathBuf,
    /// Its slot on bus 0 of segment 0.
    pub slot: u8,
    pub vendor_id: u16,
    pub device_id: u16,
    pub pci: VfioPciState,
    /// The GSI its INTx is wired to, if it is.
    pub intx_gsi: Option<u32>,
    /// The guest RAM the device has DMA-mapped (guest address, size, offset in the RAM
    /// file): the new process maps none of it again.
    pub dma_mapped: Vec<(u64, u64, u64)>,
}
