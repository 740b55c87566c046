//! What a VM keeps of its cold-plugged vfio-user devices for a live update, and what the
//! offer and the paused state say of each (cold- or hot-plugged): plain data, so that the
//! machine's devices ([`crate::devices`]) can hold it while the hand-over's logic
//! ([`super::passthrough`], and crate::hotplug for hot-plugged GPUs) works on the devices.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::{GuestMemoryMapper, PciBdf, PciRoot};
use gpuvm_vfio::dma::DmaProgress;
use gpuvm_vfio::kernel::HandOverMark;
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
    /// The cold-plugged kernel VFIO devices and their IOMMU context.
    pub kernel: Option<PluggedKernelContext>,
    /// Segment 0's root, MSI router and BAR slots (set when PCI is attached).
    pub plug: Option<PlugParts>,
}

/// What plugging a device into the VM's PCI segments takes besides the VM.
pub struct PlugParts {
    /// Segment 0's root.
    pub root: Arc<PciRoot>,
    /// Segments 1..'s roots, segment 1's first.
    pub segments: Vec<Arc<PciRoot>>,
    pub router: Arc<MsiRouter>,
    pub slots: Arc<dyn GuestMemoryMapper>,
    /// The VM's peer-to-peer DMA mappings, which a plugged device joins.
    pub peers: Arc<crate::p2p::PeerDma>,
    /// The VM's KVM VFIO device, which every kernel VFIO context shares.
    pub kvm_vfio: Arc<crate::pci::SharedKvmVfio>,
}

impl PlugParts {
    /// The root of PCI segment `segment`, if the VM has it.
    pub fn root_of(&self, segment: u16) -> Option<&Arc<PciRoot>> {
        match segment {
            0 => Some(&self.root),
            further => self.segments.get(usize::from(further) - 1),
        }
    }

    /// The path from bus 0 of its segment's root to `bdf`, behind the ports of a
    /// host-mirroring layout (None on bus 0, or where no port leads there).
    pub fn path_of(&self, bdf: PciBdf) -> Option<Vec<u8>> {
        crate::pci_topology::path_of(self.root_of(bdf.segment)?, bdf)
    }
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

/// A VM's cold-plugged kernel VFIO devices and their IOMMU context.
pub struct PluggedKernelContext {
    /// A duplicate of the context's iommufd and the id of the devices' IOAS, or of its
    /// type1 container; or why the context cannot be handed over.
    pub hand_over: Result<gpuvm_vfio::kernel::ContextHandOver, String>,
    /// The mappings of guest RAM the context holds (IOVA, size: each one DMA map call), as
    /// the process that made them planned them (this one at boot or at a RAM hot-plug, or
    /// the old one of a live update): a type1 update moves exactly these, whatever this
    /// binary would plan. See [`PluggedKernelContext::ram_mappings`].
    pub ram_mappings: Mutex<Vec<(u64, u64)>>,
    /// Set while a live update has moved the type1 mappings' host addresses away from
    /// this process (until it commits, or they come back when it fails).
    pub addresses_away: std::sync::atomic::AtomicBool,
    /// Guest RAM being (or done being) DMA-mapped in the context.
    pub dma: Arc<DmaProgress>,
    pub devices: Vec<PluggedKernelVfio>,
}

impl PluggedKernelContext {
    /// A context whose RAM is mapped by the DMA map calls `ram_mappings` (IOVA, size), its
    /// mapping's progress `dma`; no live update has moved its addresses.
    pub fn new(
        hand_over: Result<gpuvm_vfio::kernel::ContextHandOver, String>,
        ram_mappings: Vec<(u64, u64)>,
        dma: Arc<DmaProgress>,
        devices: Vec<PluggedKernelVfio>,
    ) -> Self {
        PluggedKernelContext {
            hand_over,
            ram_mappings: Mutex::new(ram_mappings),
            addresses_away: Default::default(),
            dma,
            devices,
        }
    }

    /// The mappings of guest RAM the context holds, in the order they were made.
    pub fn ram_mappings(&self) -> Vec<(u64, u64)> {
        crate::lock(&self.ram_mappings).clone()
    }

    /// Hot-plugged RAM mapped in the context (each region one DMA map call).
    pub fn note_mapped(&self, regions: &[gpuvm_vfio::DmaRegion]) {
        (crate::lock(&self.ram_mappings)).extend(regions.iter().map(|r| (r.guest_addr, r.size)));
    }

    /// RAM the guest ejected, its mappings removed from the context.
    pub fn note_unmapped(&self, regions: &[gpuvm_vfio::DmaRegion]) {
        crate::lock(&self.ram_mappings).retain(|&(iova, size)| {
            !regions
                .iter()
                .any(|r| r.guest_addr == iova && r.size == size)
        });
    }
}

/// A cold-plugged kernel VFIO device.
pub struct PluggedKernelVfio {
    /// The host device (its PCI address), as `--gpu` named it.
    pub host_bdf: String,
    pub bdf: PciBdf,
    pub device: Arc<Mutex<VfioPciDevice>>,
    /// A duplicate of its cdev, or why there is none.
    pub cdev: Result<OwnedFd, String>,
    /// Set once another process runs it: the device is then left alone here.
    pub mark: Arc<HandOverMark>,
}

/// The kernel VFIO devices in an offer: the IOAS their iommufd keeps the mappings in, and
/// the devices (host PCI addresses) whose cdevs follow the iommufd, in this order. Or,
/// for a type1 container (`type1_groups` set, `ioas_id` 0): the container, then each
/// group's file (these IOMMU groups, in this order), then each device's file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OfferedKernelVfio {
    pub ioas_id: u32,
    pub devices: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub type1_groups: Option<Vec<u32>>,
}

impl OfferedKernelVfio {
    /// The descriptors that follow in the offer.
    pub fn descriptor_count(&self) -> usize {
        1 + self.type1_groups.as_ref().map_or(0, Vec::len) + self.devices.len()
    }
}

/// The kernel VFIO devices in the paused state: the guest RAM their context has mapped
/// (guest address, size, offset in the RAM file), and each device's place and PCI state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedOverKernelContext {
    pub dma_mapped: Vec<(u64, u64, u64)>,
    /// A type1 container's mappings (IOVA, size: each one VFIO_IOMMU_MAP_DMA) whose host
    /// addresses the old process invalidated: the new process gives them its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub type1_vaddr: Vec<(u64, u64)>,
    pub devices: Vec<HandedOverKernelVfio>,
}

/// A hot-plugged kernel VFIO device in the paused state: its own context (one device) and
/// what makes it a hot-plugged GPU again in the new process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedOverHotKernelVfio {
    pub context: HandedOverKernelContext,
    pub hot: HotPluggedGpu,
}

/// One handed-over kernel VFIO device: the host device, its PCI segment and its slot on
/// the segment's bus 0 (or its device number behind the VM's PCIe ports, with its path),
/// its model, and the PCI state gpuvm emulates for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedOverKernelVfio {
    pub host_bdf: String,
    /// Its PCI segment (absent: 0, as in the state of a gpuvm that handed over segment 0
    /// only; an older binary refuses the field rather than put the device on segment 0).
    #[serde(default, skip_serializing_if = "is_segment_0")]
    pub segment: u16,
    pub slot: u8,
    /// Behind the VM's PCIe ports: the path from bus 0 (None on bus 0; absent in the
    /// state of a gpuvm that handed over bus 0 only).
    #[serde(default)]
    pub path: Option<Vec<u8>>,
    pub vendor_id: u16,
    pub device_id: u16,
    pub pci: VfioPciState,
    pub intx_gsi: Option<u32>,
    /// Whether its BARs are DMA-mapped for its peers (`p2p`, on unless `p2p=off`).
    pub p2p: bool,
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
    /// Its PCI segment (absent: 0, as for [`HandedOverKernelVfio::segment`]).
    #[serde(default, skip_serializing_if = "is_segment_0")]
    pub segment: u16,
    /// Its slot on its segment's bus 0, or its device number on its bus behind bridges.
    pub slot: u8,
    /// Behind the ports of a host-mirroring layout (crate::pci_topology, rebuilt from the
    /// state before the devices): its path from bus 0 (PciRoot::add_behind). Absent on
    /// bus 0, so such a state reads as before (and an older binary, which would put the
    /// device on bus 0, refuses the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<Vec<u8>>,
    pub vendor_id: u16,
    pub device_id: u16,
    pub pci: VfioPciState,
    /// The GSI its INTx is wired to, if it is.
    pub intx_gsi: Option<u32>,
    /// The guest RAM the device has DMA-mapped (guest address, size, offset in the RAM
    /// file): the new process maps none of it again.
    pub dma_mapped: Vec<(u64, u64, u64)>,
    /// Whether its BARs are DMA-mapped for its peers (`p2p`, on unless `p2p=off`). Absent
    /// in states of gpuvm versions that handed over only devices with p2p off, or alone,
    /// and left out when off (so such a state reads as before).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub p2p: bool,
    /// Set for a GPU hot-plugged at runtime (PUT /gpus/{id}): the new process keeps it a
    /// hot-plugged device (DELETE ejects it). Absent for a cold-plugged one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_plugged: Option<HotPluggedGpu>,
}

fn is_segment_0(segment: &u16) -> bool {
    *segment == 0
}

impl HandedOverVfioUser {
    /// What the paused state says of `device` (served on `socket`, at `bdf`: in a slot
    /// of its segment's bus 0, or behind bridges at `path`), which has `ram` DMA-mapped;
    /// `hot_plugged` for a GPU hot-plugged at runtime.
    pub fn of(
        device: &gpuvm_vfio::pci::VfioPciDevice,
        (socket, bdf, path): (PathBuf, PciBdf, Option<Vec<u8>>),
        ram: &[gpuvm_vfio::DmaRegion],
        hot_plugged: Option<HotPluggedGpu>,
    ) -> Result<Self, String> {
        use gpuvm_devices::Persist;
        let pci = device
            .save()
            .map_err(|e| format!("{}: {e}", device.name()))?;
        let (vendor_id, device_id) = device.pci_ids();
        Ok(HandedOverVfioUser {
            socket,
            segment: bdf.segment,
            slot: bdf.device,
            path,
            vendor_id,
            device_id,
            pci,
            intx_gsi: device.intx_gsi(),
            dma_mapped: (ram.iter())
                .map(|r| (r.guest_addr, r.size, r.fd_offset))
                .collect(),
            p2p: false,
            hot_plugged,
        })
    }
}

/// What makes a handed-over vfio-user device a hot-plugged GPU again in the new process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotPluggedGpu {
    /// What it was plugged from: its id, socket and choices (GPUDirect clique, p2p).
    pub source: crate::action::GpuBody,
    /// The bus-0 slot of the root port for hot-plug it is in (absent: on bus 0, in the
    /// ACPI hot-plug slot `slot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel VFIO context's record of its RAM mappings: hot-plugged RAM joins it as it
    /// is mapped and leaves it when ejected, one entry per DMA map call, in order.
    #[test]
    fn a_context_notes_the_ram_mapped_and_unmapped_in_it() {
        let context = PluggedKernelContext::new(
            Err("a test context".into()),
            vec![(0, 1 << 30)],
            DmaProgress::new("test", 1 << 30),
            Vec::new(),
        );
        let region = |guest_addr: u64, size: u64| gpuvm_vfio::DmaRegion {
            guest_addr,
            size,
            host_addr: 0x7f00_0000_0000 + guest_addr,
            fd: -1,
            fd_offset: guest_addr,
        };
        let plugged = [
            region(1 << 32, 128 << 20),
            region((1 << 32) + (128 << 20), 64 << 20),
        ];
        context.note_mapped(&plugged);
        assert_eq!(
            context.ram_mappings(),
            vec![
                (0, 1 << 30),
                (1 << 32, 128 << 20),
                ((1 << 32) + (128 << 20), 64 << 20)
            ]
        );
        // Only a mapping made exactly so leaves: one of another size is not the one made.
        context.note_unmapped(&[region(1 << 32, 64 << 20)]);
        assert_eq!(context.ram_mappings().len(), 3);
        context.note_unmapped(&plugged[..1]);
        assert_eq!(
            context.ram_mappings(),
            vec![(0, 1 << 30), ((1 << 32) + (128 << 20), 64 << 20)]
        );
    }

    fn cold(socket: &str) -> HandedOverVfioUser {
        HandedOverVfioUser {
            socket: PathBuf::from(socket),
            segment: 0,
            slot: 3,
            path: None,
            vendor_id: 0x10de,
            device_id: 0x2330,
            pci: VfioPciState::default(),
            intx_gsi: None,
            dma_mapped: vec![(0, 1 << 28, 0)],
            p2p: false,
            hot_plugged: None,
        }
    }

    /// A cold-plugged device's entry is written as before hot-plugged GPUs were handed
    /// over (an older new process reads it), and a hot-plugged one keeps its id, socket,
    /// choices and root port.
    #[test]
    fn a_hot_plugged_gpu_is_marked_and_a_cold_plugged_one_is_not() {
        let written = serde_json::to_value(cold("/run/a.sock")).unwrap();
        assert!(written.get("hot_plugged").is_none(), "{written}");
        assert!(written.get("path").is_none(), "{written}");
        assert!(written.get("segment").is_none(), "{written}");
        // One on another PCI segment says which.
        let on_segment_1 = HandedOverVfioUser {
            segment: 1,
            ..cold("/run/s.sock")
        };
        let segment_written = serde_json::to_value(&on_segment_1).unwrap();
        assert_eq!(segment_written["segment"], 1);
        let read_segment: HandedOverVfioUser = serde_json::from_value(segment_written).unwrap();
        assert_eq!(read_segment, on_segment_1);
        // One behind a switch's ports keeps its path from bus 0.
        let behind = HandedOverVfioUser {
            slot: 0,
            path: Some(vec![1, 0, 1, 0]),
            ..cold("/run/c.sock")
        };
        let behind_written = serde_json::to_value(&behind).unwrap();
        assert_eq!(behind_written["path"], serde_json::json!([1, 0, 1, 0]));
        let read_behind: HandedOverVfioUser = serde_json::from_value(behind_written).unwrap();
        assert_eq!(read_behind, behind);
        let read: HandedOverVfioUser = serde_json::from_value(written).unwrap();
        assert_eq!(read, cold("/run/a.sock"));

        let mut source = crate::action::GpuBody::new("gpu1", None, Some("/run/b.sock".into()));
        source.p2p = Some(false);
        let hot = HandedOverVfioUser {
            hot_plugged: Some(HotPluggedGpu {
                source,
                port: Some(0x1c),
            }),
            ..cold("/run/b.sock")
        };
        let read: HandedOverVfioUser =
            serde_json::from_slice(&serde_json::to_vec(&hot).unwrap()).unwrap();
        assert_eq!(read, hot);
        let gpu = read.hot_plugged.unwrap();
        assert_eq!(gpu.source.gpu_id, "gpu1");
        assert!(!gpu.source.tuning().p2p);
        // A field this build does not know is refused, not dropped.
        let mut unknown = serde_json::to_value(&hot).unwrap();
        unknown["hot_plugged"]["slot_power"] = serde_json::json!(true);
        assert!(serde_json::from_value::<HandedOverVfioUser>(unknown).is_err());
    }
}
