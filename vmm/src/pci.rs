//! Wires PCI into a VM: the root bus on the port-I/O and MMIO buses, passthrough devices
//! (vfio-user sockets; kernel VFIO GPUs), MSI routing through KVM GSI routes and irqfds,
//! and the DMA mapping of all guest RAM, in the background while the guest boots: a
//! passthrough device's Bus Master bit is held back until the mapping is complete (see
//! gpuvm_vfio::dma and `VfioPciDevice::gate_bus_master`).
//!
//! PCI address space (see gpuvm_arch::x86_64::layout):
//! ```text
//! 0xc000_0000..0xe000_0000   32-bit BARs
//! 0xe000_0000..0xe010_0000   ECAM, bus 0
//! above RAM, 1 GiB aligned   64-bit BARs: sized from the passthrough devices' BARs plus
//!                            room to hot-plug one more, at least 512 GiB where the host's
//!                            address width allows (PciOptions::mmio64_size overrides)
//! ```
//!
//! [`plan_address_space`] sizes and places that window (gpuvm_arch::x86_64::address_space)
//! from the host's physical address width and the devices, opened but not yet plugged;
//! a VM that does not fit is refused there, with the numbers.
//!
//! With more PCI segment groups (`PciOptions::num_pci_segments`), segment N > 0 is a root
//! of its own: ECAM at 0xe000_0000 + N MiB, 16 MiB of 32-bit BARs from 0xe100_0000, 64 GiB
//! of 64-bit BARs after segment 0's window (both larger where the passthrough devices on
//! it need more: a guest NUMA node's GPUs, crate::numa). Its configuration space is
//! reachable through its ECAM window only (0xCF8/0xCFC reach segment 0). Virtio devices go
//! on the segment `VirtioOptions::pci_segments` names; hot-plug stays on segment 0.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use gpuvm_arch::x86_64::address_space::{
    self, AddressSpacePlan, HostAddressWidth, PlanError, PlanRequest, SegmentBars,
};
use gpuvm_arch::x86_64::layout::{
    ram_hotplug_area, FOUR_GIB, MAX_PCI_SEGMENTS, PCI_ECAM_START, PCI_MMIO32_END, PCI_MMIO32_START,
    PCI_MMIO64_ALIGN,
};
use gpuvm_devices::pci::{BarKind, GuestMemoryMapper, PciError, PciRoot, PciRootConfig};
use gpuvm_memory::GuestRam;
use gpuvm_vfio::dma::DmaProgress;
use gpuvm_vfio::kernel::VfioDeviceFd;
use gpuvm_vfio::pci::VfioPciDevice;
use gpuvm_vfio::{PassthroughDevice, VfioError};
use kvm_bindings::{kvm_create_device, kvm_device_type_KVM_DEV_TYPE_VFIO};
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::PciOptions;
use crate::dma::bus_master_wait_limit;
use crate::interrupts::{duplicate_vm, MsiRouter};
use crate::lock;
use crate::virtio::VirtioSetupError;

pub const CONFIG_ADDRESS_PORT: u64 = 0xcf8;

#[derive(Debug, thiserror::Error)]
pub enum PciSetupError {
    #[error(transparent)]
    Bus(#[from] PciError),
    #[error("cannot place a PCI window on the bus: {0}")]
    Place(gpuvm_devices::BusError),
    #[error("{0}")]
    Device(#[from] VfioError),
    #[error("the PCI buses were shared before PCI was attached")]
    BusShared,
    #[error("cannot duplicate the VM file descriptor: {0}")]
    VmFd(std::io::Error),
    #[error("cannot wire a device's INTx line: {0}")]
    Intx(std::io::Error),
    #[error(
        "PCI segment {segment} numbers {used} buses but its ECAM window was placed for \
         {planned}: the next segment's window follows it"
    )]
    EcamBuses {
        segment: u16,
        used: u16,
        planned: u16,
    },
    #[error("cannot create the KVM VFIO device (KVM_DEV_TYPE_VFIO): {0}")]
    KvmVfio(std::io::Error),
    #[error(transparent)]
    Virtio(#[from] VirtioSetupError),
    #[error(transparent)]
    AddressSpace(#[from] PlanError),
    #[error(transparent)]
    Topology(#[from] crate::pci_topology::PciTopologyError),
    #[error("cannot read the host's CPUID from KVM (KVM_GET_SUPPORTED_CPUID): {0}")]
    HostCpuid(std::io::Error),
    #[error("num_pci_segments = {0}: a VM has 1 to {MAX_PCI_SEGMENTS} PCI segments")]
    SegmentCount(u16),
    #[error(
        "device {device} is on PCI segment {segment}, but the VM has {count} segment(s) \
         (num_pci_segments)"
    )]
    NoSuchSegment {
        device: String,
        segment: u16,
        count: u16,
    },
    #[error("the handed-over PCI segments do not fit: {0}")]
    SavedSegments(String),
}

/// The VM's KVM VFIO pseudo-device. vfio-ioctls registers each VFIO group (or cdev device)
/// with it, so KVM knows the VM has assigned devices: on hosts where device DMA is not
/// cache-coherent KVM then honours the guest's memory types instead of forcing write-back.
pub fn create_kvm_vfio_device(vm: &VmFd) -> Result<VfioDeviceFd, PciSetupError> {
    Ok(VfioDeviceFd::new_from_kvm(kvm_vfio_device(vm)?))
}

/// The VM's one KVM VFIO pseudo-device, shared by every kernel VFIO context of the VM (the
/// cold-plugged devices', each hot-plugged device's own, a live update's adopted ones):
/// KVM allows one per VM, a second KVM_CREATE_DEVICE of the type failing with EBUSY, so a
/// context made while another lives must register its files with the same device. Made
/// when a context first needs it and held only by the contexts: once the last one is gone
/// its file closes and KVM drops it, and the next context makes a new one.
#[derive(Default)]
pub struct SharedKvmVfio(Mutex<std::sync::Weak<VfioDeviceFd>>);

impl SharedKvmVfio {
    /// The VM's device, made now if no context holds one.
    pub fn get(&self, vm: &VmFd) -> Result<Arc<VfioDeviceFd>, PciSetupError> {
        let mut shared = lock(&self.0);
        if let Some(device) = shared.upgrade() {
            return Ok(device);
        }
        let device = Arc::new(create_kvm_vfio_device(vm)?);
        *shared = Arc::downgrade(&device);
        Ok(device)
    }

    /// The VM's device with the type1 `groups` a live update handed over added to it
    /// (KVM_DEV_VFIO_GROUP_ADD, as vfio-ioctls adds the groups it opens).
    pub fn with_groups(
        &self,
        vm: &VmFd,
        groups: &[std::os::fd::OwnedFd],
    ) -> Result<Arc<VfioDeviceFd>, String> {
        use kvm_bindings::{kvm_device_attr, KVM_DEV_VFIO_GROUP, KVM_DEV_VFIO_GROUP_ADD};
        use std::os::fd::AsRawFd;
        let shared = self.get(vm).map_err(|e| e.to_string())?;
        // A second descriptor of the same device: closing it leaves the device as it is.
        let device = (shared.try_clone())
            .and_then(VfioDeviceFd::to_kvm)
            .map_err(|e| format!("cannot use the KVM VFIO device: {e}"))?;
        for group in groups {
            let fd: i32 = group.as_raw_fd();
            let attr = kvm_device_attr {
                group: KVM_DEV_VFIO_GROUP,
                attr: u64::from(KVM_DEV_VFIO_GROUP_ADD),
                addr: &fd as *const i32 as u64,
                flags: 0,
            };
            device
                .set_device_attr(&attr)
                .map_err(|e| format!("KVM_DEV_VFIO_GROUP_ADD of a handed-over group: {e}"))?;
        }
        Ok(shared)
    }
}

/// The KVM VFIO pseudo-device itself (KVM_CREATE_DEVICE).
fn kvm_vfio_device(vm: &VmFd) -> Result<kvm_ioctls::DeviceFd, PciSetupError> {
    let mut request = kvm_create_device {
        type_: kvm_device_type_KVM_DEV_TYPE_VFIO,
        fd: 0,
        flags: 0,
    };
    vm.create_device(&mut request)
        .map_err(|e| PciSetupError::KvmVfio(std::io::Error::from_raw_os_error(e.errno())))
}

/// The 64-bit window: after the top of RAM and the room kept for hot-plugged RAM, aligned
/// so large BARs pack well.
pub fn mmio64_start(ram: &GuestRam, ram_hotplug_size: u64) -> u64 {
    let top = ram
        .regions()
        .iter()
        .map(|r| r.guest_addr + r.size)
        .max()
        .unwrap_or(0)
        .max(FOUR_GIB);
    let (hotplug_start, hotplug_size) = ram_hotplug_area(top, ram_hotplug_size);
    (hotplug_start + hotplug_size).next_multiple_of(PCI_MMIO64_ALIGN)
}

/// The 64-bit window of the builds before it was planned (and saved in snapshots): 512 GiB
/// right above RAM ending at `ram_top` (None: 4 GiB) and the room for hot-plugged RAM. A
/// restore of their states puts the window back there, where their guests have it.
pub fn unplanned_mmio64_window(ram_top: Option<u64>, ram_hotplug_size: u64) -> (u64, u64) {
    const UNPLANNED_MMIO64_SIZE: u64 = 512 << 30;
    let top = ram_top.unwrap_or(FOUR_GIB).max(FOUR_GIB);
    let (hotplug_start, hotplug_size) = ram_hotplug_area(top, ram_hotplug_size);
    let start = (hotplug_start + hotplug_size).next_multiple_of(PCI_MMIO64_ALIGN);
    (start, UNPLANNED_MMIO64_SIZE)
}

/// KVM memory slots for mmapped BAR parts, numbered from [`FIRST_BAR_SLOT`] (RAM uses the
/// slots below).
pub struct KvmBarSlots {
    vm: VmFd,
    free: Mutex<Vec<u32>>,
    next: AtomicU32,
}

/// First KVM slot for BARs; RAM has the slots below: boot RAM's
/// ([`crate::builder::BOOT_RAM_SLOTS`]), then memory hot-plug's, with room to spare (a
/// compile-time check in machine/memory_hotplug.rs). KVM allows 32764 slots on x86.
pub(crate) const FIRST_BAR_SLOT: u32 = 64;

impl KvmBarSlots {
    pub fn new(kvm: &Kvm, vm: &VmFd) -> Result<Self, PciSetupError> {
        Ok(KvmBarSlots {
            vm: duplicate_vm(kvm, vm).map_err(PciSetupError::VmFd)?,
            free: Mutex::new(Vec::new()),
            next: AtomicU32::new(FIRST_BAR_SLOT),
        })
    }

    fn set(&self, slot: u32, guest_addr: u64, size: u64, host: u64) -> std::io::Result<()> {
        let region = crate::memslots::MemorySlot {
            slot,
            guest_addr,
            size,
            host,
            dirty_log: false,
        };
        // SAFETY: `host` is a device BAR mapping owned by the VfioPciDevice, which removes the
        // slot (size 0) before it unmaps the memory.
        unsafe { region.set(&self.vm) }.map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
    }
}

impl GuestMemoryMapper for KvmBarSlots {
    fn map(&self, guest_addr: u64, size: u64, host: u64) -> std::io::Result<u32> {
        let slot = lock(&self.free)
            .pop()
            .unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed));
        if let Err(error) = self.set(slot, guest_addr, size, host) {
            lock(&self.free).push(slot);
            return Err(error);
        }
        log::debug!("BAR slot {slot}: {guest_addr:#x}+{size:#x}");
        Ok(slot)
    }

    fn unmap(&self, slot: u32) -> std::io::Result<()> {
        self.set(slot, 0, 0, 0)?;
        lock(&self.free).push(slot);
        Ok(())
    }
}

/// What plugging a passthrough device into the root needs.
pub(crate) struct Plug<'a> {
    pub vm: &'a VmFd,
    pub root: &'a Arc<PciRoot>,
    pub router: &'a Arc<MsiRouter>,
    pub slots: &'a Arc<dyn GuestMemoryMapper>,
}

impl Plug<'_> {
    /// The part of a cold plug (builder/attach.rs) that hot-plug shares: the device with its vectors and BARs,
    /// Bus Master gated by `dma`, on the next free slot of bus 0 (INTx not wired).
    pub(crate) fn open(
        &self,
        backend: Box<dyn PassthroughDevice>,
        dma: &Arc<DmaProgress>,
    ) -> Result<Plugged, PciSetupError> {
        self.open_placed(backend, dma, None)
    }

    /// As [`Plug::open`]; with `place`, the device goes into that slot with its BARs at
    /// the given addresses (a restored device, where the guest left it).
    pub(crate) fn open_placed(
        &self,
        backend: Box<dyn PassthroughDevice>,
        dma: &Arc<DmaProgress>,
        place: Option<(u8, &[(u8, u64)])>,
    ) -> Result<Plugged, PciSetupError> {
        self.open_with(backend, dma, |root, device| match place {
            None => root.add_device(device),
            Some((slot, bars)) => root.add_device_at(slot, device, bars),
        })
    }

    /// As [`Plug::open`], with `add` putting the device on the bus (behind a bridge:
    /// crate::pci_topology).
    pub(crate) fn open_with(
        &self,
        backend: Box<dyn PassthroughDevice>,
        dma: &Arc<DmaProgress>,
        add: impl FnOnce(
            &Arc<PciRoot>,
            Arc<Mutex<dyn gpuvm_devices::pci::PciDevice>>,
        ) -> Result<gpuvm_devices::pci::PciBdf, PciError>,
    ) -> Result<Plugged, PciSetupError> {
        let mut gsis = Vec::new();
        let mut allocate = |count| {
            let vectors = self.router.allocate(count)?;
            gsis.extend(vectors.iter().map(|(gsi, _)| *gsi));
            Ok(vectors)
        };
        let mut device = VfioPciDevice::new(backend, &mut allocate, self.router.clone())?;
        let mapped = device.map_bars(self.slots.clone())?;
        log::info!(
            "{}: {} MiB of BARs mapped into the guest",
            device.name(),
            mapped >> 20
        );
        device.gate_bus_master(dma.clone(), bus_master_wait_limit(dma.total_bytes()));
        let pin = device.interrupt_pin();
        let name = device.name().to_string();
        let device = Arc::new(Mutex::new(device));
        let added = add(self.root, device.clone());
        let bdf = match added {
            Ok(bdf) => bdf,
            Err(error) => {
                self.router.release(&gsis);
                return Err(error.into());
            }
        };
        // Segment 0's labels keep their short form (the API and snapshots show them).
        log::info!("PCI {}: {name}", bdf.shown());
        Ok(Plugged {
            bdf,
            pin,
            label: format!("{} {name}", bdf.shown()),
            device,
            gsis,
        })
    }

    /// A level-triggered irqfd on `gsi` for the device's INTx; KVM signals the resample
    /// eventfd at the guest's EOI, and the returned subscriber unmasks the device then.
    pub(crate) fn intx(
        &self,
        device: &Arc<Mutex<VfioPciDevice>>,
        gsi: u32,
    ) -> Result<Option<Arc<Mutex<dyn MutEventSubscriber + Send>>>, PciSetupError> {
        let eventfd = || EventFd::new(EFD_NONBLOCK).map_err(PciSetupError::Intx);
        let (trigger, resample) = (eventfd()?, eventfd()?);
        self.vm
            .register_irqfd_with_resample(&trigger, &resample, gsi)
            .map_err(|e| PciSetupError::Intx(std::io::Error::from_raw_os_error(e.errno())))?;
        let unregister = || {
            let _ = self.vm.unregister_irqfd(&trigger, gsi);
        };
        let irqfd = trigger.try_clone().map_err(PciSetupError::Intx)?;
        match lock(device).attach_intx(gsi, irqfd) {
            Ok(true) => Ok(Some(Arc::new(Mutex::new(IntxResample {
                resample,
                device: device.clone(),
                _trigger: trigger,
            })))),
            Ok(false) => {
                unregister();
                Ok(None)
            }
            Err(error) => {
                unregister();
                Err(error.into())
            }
        }
    }
}

/// A device on the bus, from [`Plug::open`].
pub(crate) struct Plugged {
    pub bdf: gpuvm_devices::pci::PciBdf,
    pub pin: u8,
    /// "BDF name", as the snapshot refusal lists it.
    pub label: String,
    pub device: Arc<Mutex<VfioPciDevice>>,
    /// The MSI/MSI-X GSIs it was given.
    pub gsis: Vec<u32>,
}

/// Watches a device's INTx resample eventfd in the VMM's event loop.
struct IntxResample {
    resample: EventFd,
    device: Arc<Mutex<VfioPciDevice>>,
    /// Kept open so the irqfd stays registered as long as the device.
    _trigger: EventFd,
}

impl MutEventSubscriber for IntxResample {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        // Reset the count first: a new assertion after the unmask must wake us again.
        let _ = self.resample.read();
        lock(&self.device).intx_resampled();
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(error) = ops.add(Events::new(&self.resample, EventSet::IN)) {
            log::error!("cannot watch an INTx resample eventfd: {error}");
        }
    }
}

/// The guest-physical address width this host's KVM gives a VM (CPUID 0x80000008 as
/// KVM_GET_SUPPORTED_CPUID reports it) and the host's CPU vendor.
pub fn host_address_width(kvm: &Kvm) -> Result<HostAddressWidth, PciSetupError> {
    crate::host::address_width(kvm)
        .map_err(|e| PciSetupError::HostCpuid(std::io::Error::from_raw_os_error(e.errno())))
}

/// The sizes of `backend`'s 64-bit BARs: what it needs in the 64-bit window.
pub fn bar64_sizes(backend: &mut dyn PassthroughDevice) -> Result<Vec<u64>, PciSetupError> {
    Ok(gpuvm_vfio::pci::bar_specs(backend)?
        .into_iter()
        .filter(|spec| matches!(spec.kind, BarKind::Memory64 { .. }))
        .map(|spec| spec.size)
        .collect())
}

/// The address space above RAM for a VM with `ram`, `options`, `segments` PCI segments,
/// passthrough devices on segment 0 whose 64-bit BARs are `devices` (in plug order) and
/// those on further segments `segment_bars`; see gpuvm_arch::x86_64::address_space.
/// Refused, with the numbers, where it does not fit.
pub fn plan_address_space(
    host: HostAddressWidth,
    ram: &GuestRam,
    options: &PciOptions,
    devices: &[Vec<u64>],
    (segments, segment_bars, segment_buses): (u16, &[SegmentBars], &[u16]),
) -> Result<AddressSpacePlan, PciSetupError> {
    let ram_top = ram
        .regions()
        .iter()
        .map(|r| r.guest_addr + r.size)
        .max()
        .unwrap_or(0);
    let plan = address_space::plan(&PlanRequest {
        host,
        ram_top,
        ram_hotplug_size: options.ram_hotplug_size,
        devices,
        mmio64_size: options.mmio64_size,
        fixed_window: options.mmio64_window,
        segments,
        segment_bars,
        segment_buses,
    })?;
    debug_assert!(
        options.mmio64_window.is_some()
            || plan.mmio64_start >= mmio64_start(ram, options.ram_hotplug_size)
    );
    Ok(plan)
}

/// How many PCI segments `options` make: `num_pci_segments` (0 means 1), checked, and
/// every virtio device's segment must be one of them; with `num_pci_segments` 0 (a
/// restore), as many as the devices' segments need.
pub fn segment_count(options: &PciOptions) -> Result<u16, PciSetupError> {
    let needed = options
        .virtio
        .pci_segments
        .values()
        .max()
        .map_or(1, |highest| highest.saturating_add(1));
    let count = match options.num_pci_segments {
        0 => needed,
        count => count,
    };
    if count == 0 || count > MAX_PCI_SEGMENTS {
        return Err(PciSetupError::SegmentCount(count));
    }
    if let Some((device, &segment)) = options
        .virtio
        .pci_segments
        .iter()
        .find(|(_, &segment)| segment >= count)
    {
        return Err(PciSetupError::NoSuchSegment {
            device: device.clone(),
            segment,
            count,
        });
    }
    Ok(count)
}

/// A PCI segment beyond 0 as a live update hands it over: the windows and ECAM the
/// guest's ACPI tables give it (planned from the old process's devices, which the new
/// process does not plan from: its devices come over by descriptor), its root's
/// allocations, and the ports of a host-mirroring layout on it (their slots out of the
/// root's, as segment 0's are: crate::pci_topology::save_topology_ports).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedPciSegment {
    pub config: PciRootConfig,
    pub root: gpuvm_devices::pci::PciRootState,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_ports: Vec<crate::pci_topology::SavedTopologyPort>,
}

/// `configs` (segment 0's first) with segments 1.. as `saved` has them (a live update's
/// new process); `saved` must hold every one of them.
pub fn saved_segment_configs(
    mut configs: Vec<PciRootConfig>,
    saved: &[SavedPciSegment],
) -> Result<Vec<PciRootConfig>, PciSetupError> {
    if saved.is_empty() {
        return Ok(configs);
    }
    if saved.len() + 1 != configs.len() {
        return Err(PciSetupError::SavedSegments(format!(
            "{} saved segment(s) beyond 0 for a VM of {} segment(s)",
            saved.len(),
            configs.len()
        )));
    }
    for (segment, saved) in saved.iter().enumerate() {
        if usize::from(saved.root.segment) != segment + 1 {
            return Err(PciSetupError::SavedSegments(format!(
                "segment {}'s allocations are saved as segment {}'s",
                segment + 1,
                saved.root.segment
            )));
        }
        saved.config.validate()?;
        configs[segment + 1] = saved.config;
    }
    Ok(configs)
}

/// Where each segment's root puts configuration space and BARs: segment 0's 64-bit
/// window, the others' BAR windows and every ECAM window where `plan` put them, each
/// ECAM window covering the segment's `buses` (missing: one).
pub fn segment_configs(plan: &AddressSpacePlan, count: u16, buses: &[u16]) -> Vec<PciRootConfig> {
    let buses_of = |segment: u16| buses.get(usize::from(segment)).copied().unwrap_or(1);
    let mut configs = vec![PciRootConfig {
        ecam_base: PCI_ECAM_START,
        buses: buses_of(0),
        mmio32_start: PCI_MMIO32_START,
        mmio32_end: PCI_MMIO32_END,
        mmio64_start: plan.mmio64_start,
        mmio64_size: plan.mmio64_size,
    }];
    for segment in 1..count {
        let index = usize::from(segment) - 1;
        let (mmio32_start, mmio32_end) = plan.segment_mmio32[index];
        let (mmio64_start, mmio64_size) = plan.segment_mmio64[index];
        configs.push(PciRootConfig {
            ecam_base: plan.segment_ecam[usize::from(segment)],
            buses: buses_of(segment),
            mmio32_start,
            mmio32_end,
            mmio64_start,
            mmio64_size,
        });
    }
    configs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::PciSegmentsBody;
    use std::os::fd::AsRawFd;

    fn segments(num: Option<u16>, devices: &[(&str, u16)]) -> PciSegmentsBody {
        PciSegmentsBody {
            num_pci_segments: num,
            devices: devices.iter().map(|(id, s)| (id.to_string(), *s)).collect(),
        }
    }

    /// A live update's saved segments replace the planned configurations of segments 1..,
    /// and a state that does not fit (another count of segments, a segment's allocations
    /// under another number, windows that are no layout) is refused, not built.
    #[test]
    fn saved_segments_replace_the_plan_or_are_refused() {
        let config = |mmio64_start: u64| PciRootConfig {
            ecam_base: 0xe010_0000,
            buses: 1,
            mmio32_start: 0xe100_0000,
            mmio32_end: 0xe200_0000,
            mmio64_start,
            mmio64_size: 1 << 36,
        };
        let saved_segment = |segment: u16, config: PciRootConfig| {
            let root = PciRoot::new_segment(segment, config).unwrap();
            SavedPciSegment {
                config,
                root: gpuvm_devices::Persist::save(&*root).unwrap(),
                topology_ports: Vec::new(),
            }
        };
        let planned = vec![config(1 << 40), config(5 << 40)];
        assert_eq!(
            saved_segment_configs(planned.clone(), &[]).unwrap(),
            planned,
            "nothing saved: the plan"
        );
        let saved = saved_segment(1, config(6 << 40));
        let built = saved_segment_configs(planned.clone(), std::slice::from_ref(&saved)).unwrap();
        assert_eq!(built, vec![planned[0], saved.config]);

        let two = [saved.clone(), saved_segment(2, config(7 << 40))];
        let error = saved_segment_configs(planned.clone(), &two).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("2 saved segment(s) beyond 0 for a VM of 2"),
            "{error}"
        );
        let renumbered = saved_segment(2, config(6 << 40));
        let error = saved_segment_configs(planned.clone(), &[renumbered]).unwrap_err();
        assert!(
            error.to_string().contains("saved as segment 2's"),
            "{error}"
        );
        let mut bad = saved;
        bad.config.mmio32_end = bad.config.mmio32_start;
        assert!(saved_segment_configs(planned, &[bad]).is_err());
    }

    #[test]
    fn segment_counts_and_device_segments_are_checked() {
        let mut options = PciOptions::default();
        assert_eq!(
            segment_count(&options).unwrap(),
            1,
            "one segment by default"
        );
        segments(Some(3), &[("d1", 2), ("net0", 1)])
            .apply(&mut options)
            .unwrap();
        assert_eq!(segment_count(&options).unwrap(), 3);
        // Adding to what is set; segment 0 takes a device off its segment.
        segments(None, &[("d1", 0), ("rng", 2)])
            .apply(&mut options)
            .unwrap();
        assert_eq!(options.num_pci_segments, 3);
        assert_eq!(
            options.virtio.pci_segments,
            [("net0".to_string(), 1), ("rng".to_string(), 2)].into()
        );
        // Refusals change nothing.
        let before = options.clone();
        for bad in [
            segments(Some(0), &[]),
            segments(Some(MAX_PCI_SEGMENTS + 1), &[]),
            segments(Some(2), &[]),
            segments(None, &[("d2", 3)]),
        ] {
            assert!(bad.apply(&mut options).is_err(), "{bad:?}");
            assert_eq!(options, before);
        }
        // A restore names no count: as many as the devices need, at most the maximum.
        let mut restored = PciOptions::default();
        restored.virtio.pci_segments = [("d1".to_string(), 4)].into();
        assert_eq!(segment_count(&restored).unwrap(), 5);
        restored.virtio.pci_segments = [("d1".to_string(), MAX_PCI_SEGMENTS)].into();
        assert!(matches!(
            segment_count(&restored),
            Err(PciSetupError::SegmentCount(_))
        ));
        restored.num_pci_segments = 2;
        assert!(matches!(
            segment_count(&restored),
            Err(PciSetupError::NoSuchSegment { segment, count: 2, .. }) if segment == MAX_PCI_SEGMENTS
        ));
    }

    /// KVM allows one VFIO pseudo-device per VM: a second one is refused while the first
    /// lives, so every context shares the one `SharedKvmVfio` gives; once nothing holds
    /// it, KVM drops it and the next context gets a new one.
    #[test]
    fn the_vms_kvm_vfio_device_is_shared_while_it_lives() {
        let kvm = Kvm::new().expect("open /dev/kvm");
        let vm = kvm.create_vm().expect("create VM");
        let shared = SharedKvmVfio::default();
        let first = shared.get(&vm).expect("the first context's device");
        let second = shared.get(&vm).expect("the second context's device");
        assert!(
            Arc::ptr_eq(&first, &second),
            "two KVM VFIO devices for one VM"
        );
        let busy = create_kvm_vfio_device(&vm).expect_err("KVM made a second VFIO device");
        assert!(busy.to_string().contains("busy"), "{busy}");
        let with_groups = shared.with_groups(&vm, &[]).expect("no groups to add");
        assert!(Arc::ptr_eq(&first, &with_groups));
        drop((first, second, with_groups));
        shared
            .get(&vm)
            .expect("a new device once the old one is gone");
    }

    /// The pseudo-device exists on this host's KVM, accepts the VFIO file attribute and
    /// refuses a file that is not a VFIO group or device (so the registration vfio-ioctls
    /// does on real hosts goes to a live KVM object, not a stub).
    #[test]
    fn kvm_vfio_device_is_created_and_checks_what_it_is_given() {
        let kvm = Kvm::new().expect("open /dev/kvm");
        let vm = kvm.create_vm().expect("create VM");
        let device = create_kvm_vfio_device(&vm)
            .expect("KVM_DEV_TYPE_VFIO")
            .to_kvm()
            .expect("a KVM device");
        let not_vfio = EventFd::new(0).unwrap();
        let fd = not_vfio.as_raw_fd();
        let add = kvm_bindings::kvm_device_attr {
            flags: 0,
            group: kvm_bindings::KVM_DEV_VFIO_FILE,
            attr: u64::from(kvm_bindings::KVM_DEV_VFIO_FILE_ADD),
            addr: &fd as *const i32 as u64,
        };
        device
            .has_device_attr(&add)
            .expect("the VFIO file attribute is supported");
        assert!(device.set_device_attr(&add).is_err());
    }
}
