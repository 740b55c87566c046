//! The PCI stage of a build: the root buses of every segment on the VM's port-I/O and MMIO
//! buses, the cold-plugged passthrough devices with guest RAM DMA-mapped for them in the
//! background, the virtio devices, and the hot-plug controller. The pieces it puts
//! together (device plugging, BAR slots, segment windows) are [`crate::pci`]'s.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gpuvm_arch::x86_64::address_space::SegmentBars;
use gpuvm_arch::x86_64::layout::{PCI_ECAM_START, PCI_MMIO32_END, PCI_MMIO32_START};
use gpuvm_devices::pci::hotplug::{hotplug_port, HOTPLUG_PORT_LEN};
use gpuvm_devices::pci::{
    BarKind, ConfigAddressPort, EcamWindow, GuestMemoryMapper, MmioWindows, PciRoot,
};
use gpuvm_memory::GuestRam;
use gpuvm_vfio::dma::DmaProgress;
use gpuvm_vfio::kernel::KernelVfio;
use gpuvm_vfio::pci::VfioPciDevice;
use gpuvm_vfio::user::VfioUserDevice;
use gpuvm_vfio::PassthroughDevice;
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::GuestMemoryMmap;

use crate::config::PciOptions;
use crate::devices::MachineDevices;
use crate::dma::{DmaTestHooks, RamChunks};
use crate::interrupts::{duplicate_vm, MsiRouter};
use crate::p2p::{PeerBars, PeerDma};
use crate::pci::{
    bar64_sizes, host_address_width, plan_address_space, saved_segment_configs, segment_configs,
    segment_count, KvmBarSlots, PciSetupError, Plug, CONFIG_ADDRESS_PORT,
};
use crate::pci_topology::{host_place, DeviceInput, LayoutRequest, Placement};

/// Puts the PCI root buses (always segment 0's: its host bridge, CF8/CFC and the ECAM
/// window are what the ACPI tables describe; one more root per further segment) and the
/// requested passthrough devices on the VM's buses; all guest RAM is DMA-mapped for every
/// device in the background (`devices.dma_mappings`), and each device's Bus Master waits
/// for it. Returns the roots, segment 0's first.
///
/// The passthrough devices are opened first: the 64-bit BAR window is sized from their
/// BARs and the host's address width before any root exists (crate::pci::plan_address_space),
/// and a VM that does not fit is refused there.
///
/// `(ram, device_memory)`: guest RAM, and what device emulation reads and writes (RAM
/// and the hot-plug area). Passthrough devices on guest NUMA nodes other than 0 go on
/// segments of their own, after those asked for: `device_segments`, by backend key
/// (crate::numa::PlacedNuma::passthrough_segments).
pub fn attach(
    kvm: &Kvm,
    vm: &VmFd,
    (ram, device_memory): (&GuestRam, &GuestMemoryMmap),
    options: &PciOptions,
    device_segments: &BTreeMap<String, u16>,
    devices: &mut MachineDevices,
) -> Result<Vec<Arc<PciRoot>>, PciSetupError> {
    let count = (device_segments.values().copied())
        .map(|segment| segment.saturating_add(1))
        .fold(segment_count(options)?, u16::max);
    // One KVM VFIO device for the VM: the cold-plugged context's, shared with those of the
    // kernel VFIO devices hot-plugged (or handed over) later.
    let kvm_vfio = Arc::new(crate::pci::SharedKvmVfio::default());
    let opened = open_devices(vm, options, &kvm_vfio)?;
    let host = host_address_width(kvm)?;
    let segments: Vec<u16> = (crate::numa::device_keys(options).iter())
        .map(|key| device_segments.get(key).copied().unwrap_or(0))
        .collect();
    let layouts = SegmentLayouts::new(&opened.layout, &segments, count, options.pcie_root_ports);
    let buses = layouts.buses(
        options.pci_root.as_ref(),
        !options.saved_segments.is_empty(),
    )?;
    let (needs, segment_bars) = layouts.needs(&opened)?;
    let plan = plan_address_space(host, ram, options, &needs, (count, &segment_bars, &buses))?;
    log::info!("guest address space: {plan}");
    // A live update's new process: segments 1.. where the guest's ACPI tables have them.
    let configs = saved_segment_configs(
        segment_configs(&plan, count, &buses),
        &options.saved_segments,
    )?;
    for (segment, config) in configs.iter().enumerate().skip(1) {
        log::info!(
            "PCI segment {segment}: 64-bit BAR window {:#x}..{:#x} ({}), 32-bit {:#x}..{:#x}, \
             ECAM {:#x} ({} buses)",
            config.mmio64_start,
            config.mmio64_start + config.mmio64_size,
            gpuvm_arch::x86_64::address_space::human(config.mmio64_size),
            config.mmio32_start,
            config.mmio32_end,
            config.ecam_base,
            config.buses
        );
    }
    let mut roots = configs
        .iter()
        .enumerate()
        .map(|(segment, config)| PciRoot::new_segment(segment as u16, *config))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(saved) = &options.pci_root {
        // A restore: segment 0's allocations as saved, before any device is placed.
        let root = Arc::get_mut(&mut roots[0]).ok_or(PciSetupError::BusShared)?;
        gpuvm_devices::Persist::restore(root, saved)?;
    }
    for (segment, saved) in options.saved_segments.iter().enumerate() {
        // A live update: segments 1..'s allocations too.
        let root = Arc::get_mut(&mut roots[segment + 1]).ok_or(PciSetupError::BusShared)?;
        gpuvm_devices::Persist::restore(root, &saved.root)?;
    }
    let (config, root) = (configs[0], roots[0].clone());
    let router = Arc::new(MsiRouter::new(kvm, vm).map_err(PciSetupError::VmFd)?);
    let slots: Arc<dyn GuestMemoryMapper> = Arc::new(KvmBarSlots::new(kvm, vm)?);
    let peers = crate::p2p::PeerDma::new();
    let mut cliques = gpuvm_vfio::topology::CliqueAssigner::default();
    if !options.is_empty() {
        attach_devices(
            vm,
            ram,
            opened,
            (&roots, &layouts),
            &router,
            &slots,
            &peers,
            &mut cliques,
            devices,
        )?;
    }
    // Also when there are none yet: the thread factory it starts (with filters on) makes
    // the threads of virtio devices hot-plugged later.
    crate::virtio::start_io_threads(&options.virtio)?;
    if !options.virtio.is_empty() {
        devices.virtio = crate::virtio::attach(
            duplicate_vm(kvm, vm).map_err(PciSetupError::VmFd)?,
            device_memory,
            &roots,
            &router,
            &options.virtio,
            &options.device_resources,
        )?;
    }
    // A live update's new process plugs the old one's vfio-user devices here.
    devices.handover.plug = Some(crate::update::passthrough::PlugParts {
        root: root.clone(),
        segments: roots[1..].to_vec(),
        router: router.clone(),
        slots: slots.clone(),
        peers: peers.clone(),
        kvm_vfio: kvm_vfio.clone(),
    });
    let mut hotplug =
        crate::hotplug::PciHotplug::new(kvm, vm, ram, device_memory, root.clone(), router, slots)?;
    hotplug.set_peer_dma(peers);
    hotplug.set_kvm_vfio(kvm_vfio);
    hotplug.add_root_ports(options.pcie_root_ports)?;
    for (segment, root) in roots.iter().enumerate() {
        // Each ECAM window was placed for the buses the layout said it would number.
        let (used, planned) = (u16::from(root.highest_bus()) + 1, configs[segment].buses);
        if used > planned {
            return Err(PciSetupError::EcamBuses {
                segment: segment as u16,
                used,
                planned,
            });
        }
    }
    // Hot-plugged GPUs continue the cold-plugged ones' clique numbering.
    hotplug.set_cliques(cliques);
    let io_bus = Arc::get_mut(&mut devices.io_bus).ok_or(PciSetupError::BusShared)?;
    io_bus
        .insert(
            u64::from(hotplug_port(0)),
            u64::from(HOTPLUG_PORT_LEN),
            hotplug.controller(),
        )
        .map_err(PciSetupError::Place)?;
    // Every further segment's bus 0 has ACPI hot-plug too, at its own ports.
    for root in &roots[1..] {
        io_bus
            .insert(
                u64::from(hotplug_port(root.segment())),
                u64::from(HOTPLUG_PORT_LEN),
                hotplug.add_segment(root.clone())?,
            )
            .map_err(PciSetupError::Place)?;
    }
    devices.pci_hotplug = Some(hotplug);
    io_bus
        .insert(
            CONFIG_ADDRESS_PORT,
            8,
            Arc::new(Mutex::new(ConfigAddressPort::new(root.clone()))),
        )
        .map_err(PciSetupError::Place)?;
    let mmio_bus = Arc::get_mut(&mut devices.mmio_bus).ok_or(PciSetupError::BusShared)?;
    debug_assert_eq!(config.ecam_base, PCI_ECAM_START);
    debug_assert_eq!(
        (config.mmio32_start, config.mmio32_end),
        (PCI_MMIO32_START, PCI_MMIO32_END)
    );
    for root in &roots {
        let config = root.config();
        mmio_bus
            .insert(
                config.ecam_base,
                config.ecam_size(),
                Arc::new(Mutex::new(EcamWindow::new(root.clone()))),
            )
            .map_err(PciSetupError::Place)?;
        for (base, end) in [
            (config.mmio32_start, config.mmio32_end),
            (
                config.mmio64_start,
                config.mmio64_start + config.mmio64_size,
            ),
        ] {
            mmio_bus
                .insert(
                    base,
                    end - base,
                    Arc::new(Mutex::new(MmioWindows::new(root.clone(), base))),
                )
                .map_err(PciSetupError::Place)?;
        }
    }
    Ok(roots)
}

/// The passthrough devices of a VM, open but not plugged yet.
type KernelHandle = (
    String,
    Result<std::os::fd::OwnedFd, String>,
    Arc<gpuvm_vfio::kernel::HandOverMark>,
);

struct OpenedDevices {
    /// The kernel VFIO context and its devices (`--gpu`), if any.
    kernel: Option<(KernelVfio, Vec<Box<dyn PassthroughDevice>>)>,
    /// What a live update hands over of each kernel VFIO device: its host address, a
    /// duplicate of its cdev (or why there is none) and its hand-over mark.
    kernel_handles: Vec<KernelHandle>,
    vfio_user: Vec<VfioUserDevice>,
    /// Each device's 64-bit BAR sizes, in plug order (kernel VFIO devices first).
    bar64_sizes: Vec<Vec<u64>>,
    /// Each device's BAR files for peer-to-peer DMA, in plug order.
    peer_bars: Vec<PeerBars>,
    /// Each device's explicit GPUDirect clique and the host device to derive one from,
    /// in plug order.
    cliques: Vec<(Option<u8>, Option<String>)>,
    /// Each device's host place and BARs, in plug order, and the layout asked for.
    layout: LayoutRequest,
}

/// Each PCI segment's share of the passthrough devices and how its root lays them out:
/// segment 0 with the empty root ports for hot-plug, a NUMA node's segment with the
/// node's devices (behind root ports and switches like their host's, as segment 0's).
struct SegmentLayouts {
    /// Each segment's layout request, segment 0's first.
    requests: Vec<LayoutRequest>,
    /// Each segment's devices, by their index in plug order.
    members: Vec<Vec<usize>>,
    /// Each device's (segment, index among its segment's devices), in plug order.
    places: Vec<(u16, usize)>,
}

impl SegmentLayouts {
    /// `segments`: each device's segment, in plug order (missing: 0).
    fn new(layout: &LayoutRequest, segments: &[u16], count: u16, hotplug_ports: u8) -> Self {
        let mut members = vec![Vec::new(); usize::from(count.max(1))];
        let mut places = Vec::new();
        for index in 0..layout.devices.len() {
            let segment = segments.get(index).copied().unwrap_or(0);
            // A segment the VM lacks holds nothing: plugging the device says so.
            let at = members.get_mut(usize::from(segment)).map_or(0, |devices| {
                devices.push(index);
                devices.len() - 1
            });
            places.push((segment, at));
        }
        let requests = (members.iter().enumerate())
            .map(|(segment, devices)| {
                layout.for_segment(devices, if segment == 0 { hotplug_ports } else { 0 })
            })
            .collect();
        SegmentLayouts {
            requests,
            members,
            places,
        }
    }

    /// How many buses each segment's ECAM window covers, segment 0's first. A restored
    /// segment 0 covers what it covered when saved (`saved`): more than its layout
    /// numbers only if the guest numbered buses of its own, which one segment alone can
    /// take but which would move the next segment's ECAM window from under its guest.
    fn buses(
        &self,
        saved: Option<&gpuvm_devices::pci::PciRootState>,
        further_saved: bool,
    ) -> Result<Vec<u16>, PciSetupError> {
        let mut buses = (self.requests.iter())
            .map(LayoutRequest::buses)
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(saved) = saved.filter(|saved| saved.buses > buses[0]) {
            // The next segment's ECAM window follows segment 0's, unless it comes as saved
            // too (a live update's segments, placed after the buses saved here).
            if buses.len() > 1 && !further_saved {
                return Err(PciSetupError::EcamBuses {
                    segment: 0,
                    used: saved.buses,
                    planned: buses[0],
                });
            }
            buses[0] = saved.buses;
        }
        Ok(buses)
    }

    /// What the BAR windows must hold: segment 0's 64-bit window (its devices' BARs or
    /// their root ports' windows, and the hot-plug ports'), and each further segment's
    /// windows, sized from its devices.
    fn needs(
        &self,
        opened: &OpenedDevices,
    ) -> Result<(Vec<Vec<u64>>, Vec<SegmentBars>), PciSetupError> {
        let sizes = |index: usize, wide: bool| -> Vec<u64> {
            (opened.layout.devices[index].specs.iter())
                .filter(|spec| match spec.kind {
                    BarKind::Memory64 { .. } => wide,
                    BarKind::Memory32 { .. } => !wide,
                    BarKind::Rom => false,
                })
                .map(|spec| spec.size)
                .collect()
        };
        let flat = |segment: usize, wide: bool| -> Vec<Vec<u64>> {
            self.members[segment]
                .iter()
                .map(|&i| sizes(i, wide))
                .collect()
        };
        let needs = self.requests[0].address_needs(&flat(0, true))?;
        let segment_bars = (1..self.requests.len())
            .map(|segment| {
                Ok(SegmentBars {
                    mmio64: self.requests[segment].address_needs(&flat(segment, true))?,
                    mmio32: self.requests[segment].mmio32_needs(&flat(segment, false))?,
                })
            })
            .collect::<Result<Vec<_>, PciSetupError>>()?;
        Ok((needs, segment_bars))
    }
}

/// Opens the passthrough devices of `options` and reads what their BARs need.
fn open_devices(
    vm: &VmFd,
    options: &PciOptions,
    kvm_vfio: &crate::pci::SharedKvmVfio,
) -> Result<OpenedDevices, PciSetupError> {
    let mut opened = OpenedDevices {
        kernel: None,
        kernel_handles: Vec::new(),
        vfio_user: Vec::new(),
        bar64_sizes: Vec::new(),
        peer_bars: Vec::new(),
        cliques: Vec::new(),
        layout: LayoutRequest::new(options),
    };
    if let Some(first) = options.gpus.first() {
        let vfio = KernelVfio::open(first, Some(kvm_vfio.get(vm)?))?;
        let mut backends: Vec<Box<dyn PassthroughDevice>> = Vec::new();
        for bdf in &options.gpus {
            let device = vfio.open_device(bdf)?;
            (opened.kernel_handles).push((
                bdf.clone(),
                device.hand_over().map_err(|e| e.to_string()),
                device.hand_over_mark(),
            ));
            let tuning = options.tuning_of(bdf);
            (opened.cliques).push((tuning.clique, Some(bdf.clone())));
            (opened.peer_bars).push(PeerBars::new(bdf.clone(), &tuning, |i| {
                device.region_file(i)
            }));
            let mut backend: Box<dyn PassthroughDevice> = Box::new(device);
            opened.bar64_sizes.push(bar64_sizes(backend.as_mut())?);
            (opened.layout.devices).push(DeviceInput {
                host_bdf: host_place(options, bdf, true),
                specs: gpuvm_vfio::pci::bar_specs(backend.as_mut())?,
            });
            backends.push(backend);
        }
        opened.kernel = Some((vfio, backends));
    }
    for socket in &options.vfio_user {
        let mut backend = VfioUserDevice::connect(socket)?;
        let tuning = options.tuning_of(&socket.display().to_string());
        (opened.cliques).push((tuning.clique, tuning.topology_bdf.clone()));
        (opened.peer_bars).push(PeerBars::new(backend.name(), &tuning, |i| {
            backend.region_file(i)
        }));
        opened.bar64_sizes.push(bar64_sizes(&mut backend)?);
        (opened.layout.devices).push(DeviceInput {
            host_bdf: host_place(options, &socket.display().to_string(), false),
            specs: gpuvm_vfio::pci::bar_specs(&mut backend)?,
        });
        opened.vfio_user.push(backend);
    }
    Ok(opened)
}

/// Plugs the `opened` passthrough devices into `roots`, each segment's laid out by its
/// topology (`layouts`). Guest RAM is
/// mapped in the background: once per kernel VFIO context (its mappings serve all its
/// devices), once per vfio-user device; each mapping starts as soon as its devices are
/// open. Each device's BARs are DMA-mapped for the others (`peers`), and each gets its GPUDirect
/// clique (explicit, else derived from its host place) from `cliques`.
#[allow(clippy::too_many_arguments)]
fn attach_devices(
    vm: &VmFd,
    ram: &GuestRam,
    opened: OpenedDevices,
    (roots, layouts): (&[Arc<PciRoot>], &SegmentLayouts),
    router: &Arc<MsiRouter>,
    slots: &Arc<dyn GuestMemoryMapper>,
    peers: &Arc<PeerDma>,
    cliques: &mut gpuvm_vfio::topology::CliqueAssigner,
    devices: &mut MachineDevices,
) -> Result<(), PciSetupError> {
    let mut clique_choices = opened.cliques.into_iter();
    let mut give_clique = |device: &Arc<Mutex<VfioPciDevice>>| {
        if let Some((clique, host)) = clique_choices.next() {
            cliques.apply(&mut crate::lock(device), clique, host.as_deref());
        }
    };
    peers.ensure_worker(crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm))?;
    let mut peer_bars = opened.peer_bars.into_iter();
    let root = &roots[0];
    let placements = (roots.iter().zip(&layouts.requests))
        .map(|(root, request)| Placement::build(root, request))
        .collect::<Result<Vec<_>, _>>()?;
    let placement_of = |index: usize| {
        let (segment, local) = layouts.places.get(index).copied().unwrap_or_default();
        let placement = placements.get(usize::from(segment));
        let placement = placement.ok_or(PciSetupError::NoSuchSegment {
            device: format!("passthrough device {index}"),
            segment,
            count: roots.len() as u16,
        })?;
        Ok::<_, PciSetupError>((placement, local))
    };
    let mut order = 0usize..;
    let ram_chunks = RamChunks::new(ram);
    let hooks = DmaTestHooks::from_env();
    let plug = Plug {
        vm,
        root,
        router,
        slots,
    };
    if let Some((vfio, backends)) = opened.kernel {
        // Kernel VFIO pins all of guest RAM: check the limit before the long mapping.
        gpuvm_vfio::host::check_memlock(ram.size())?;
        let mapper = vfio.dma_mapper();
        let progress = ram_chunks.progress(mapper.name());
        devices
            .dma_mappings
            .push(ram_chunks.start(progress.clone(), mapper, hooks)?);
        let context = peers.add_context(progress.name().to_string(), vfio.peer_mapper());
        let mut handed_over = Vec::new();
        let handles = opened.kernel_handles.into_iter();
        for ((backend, bars), (host_bdf, cdev, mark)) in
            backends.into_iter().zip(peer_bars.by_ref()).zip(handles)
        {
            let at = placement_of(order.next().unwrap_or_default())?;
            let (device, bdf) = plug_device(&plug, backend, &progress, at, devices)?;
            give_clique(&device);
            peers.plugged(context, bars, &device);
            handed_over.push(crate::update::handed_over::PluggedKernelVfio {
                host_bdf,
                bdf,
                device,
                cdev,
                mark,
            });
        }
        devices.handover.kernel = Some(crate::update::handed_over::PluggedKernelContext::new(
            vfio.hand_over(),
            ram_chunks.map_calls(),
            progress,
            handed_over,
        ));
    }
    for backend in opened.vfio_user {
        let mapper = backend.dma_mapper();
        let progress = ram_chunks.progress(mapper.name());
        let peer_mapper = backend.peer_mapper();
        let (socket, connection) = (backend.path().to_path_buf(), backend.connection());
        // Plugging resets the device: map after that.
        let at = placement_of(order.next().unwrap_or_default())?;
        let (device, bdf) = plug_device(&plug, Box::new(backend), &progress, at, devices)?;
        give_clique(&device);
        (devices.handover.vfio_user).push(crate::update::passthrough::PluggedVfioUser {
            socket,
            bdf,
            device: device.clone(),
            connection,
            dma: progress.clone(),
        });
        if let Some(bars) = peer_bars.next() {
            let context = peers.add_context(peer_mapper.name(), Ok(peer_mapper));
            peers.plugged(context, bars, &device);
        }
        devices
            .dma_mappings
            .push(ram_chunks.start(progress, mapper, hooks)?);
    }
    Ok(())
}

/// Cold-plugs one device with `plug`: MSI/MSI-X vectors, BAR mappings, its Bus Master
/// gated by the DMA mapping `dma`, its place in the layout (`at`: the layout and the
/// device's index in plug order), and INTx on its GSI. Returns the device and where it is.
fn plug_device(
    plug: &Plug<'_>,
    backend: Box<dyn PassthroughDevice>,
    dma: &Arc<DmaProgress>,
    (placement, index): (&Placement, usize),
    devices: &mut MachineDevices,
) -> Result<(Arc<Mutex<VfioPciDevice>>, gpuvm_devices::pci::PciBdf), PciSetupError> {
    let plugged = plug.open_with(backend, dma, |_, device| placement.add(index, device))?;
    let (bdf, pin, device) = (plugged.bdf, plugged.pin, plugged.device);
    devices.passthrough.push(plugged.label);
    if pin > 0 {
        let gsi = placement.intx_gsi(index, bdf, pin - 1);
        if let Some(resample) = plug.intx(&device, gsi)? {
            devices.event_sources.push(resample);
        }
    }
    Ok((device, bdf))
}
