//! The PCI stage of a build: the root buses of every segment on the VM's port-I/O and MMIO
//! buses, the cold-plugged passthrough devices with guest RAM DMA-mapped for them in the
//! background, the virtio devices, and the hot-plug controller. The pieces it puts
//! together (device plugging, BAR slots, segment windows) are [`crate::pci`]'s.

use std::sync::{Arc, Mutex};

use gpuvm_arch::x86_64::layout::{PCI_ECAM_START, PCI_MMIO32_END, PCI_MMIO32_START};
use gpuvm_devices::pci::hotplug::{HOTPLUG_PORT, HOTPLUG_PORT_LEN};
use gpuvm_devices::pci::{
    intx_gsi, ConfigAddressPort, EcamWindow, GuestMemoryMapper, MmioWindows, PciRoot, PciRootConfig,
};
use gpuvm_memory::GuestRam;
use gpuvm_vfio::dma::DmaProgress;
use gpuvm_vfio::kernel::KernelVfio;
use gpuvm_vfio::user::VfioUserDevice;
use gpuvm_vfio::PassthroughDevice;
use kvm_ioctls::{Kvm, VmFd};

use crate::config::PciOptions;
use crate::devices::MachineDevices;
use crate::dma::{DmaTestHooks, RamChunks};
use crate::interrupts::{duplicate_vm, MsiRouter};
use crate::pci::{
    create_kvm_vfio_device, segment_configs, segment_count, KvmBarSlots, PciSetupError, Plug,
    CONFIG_ADDRESS_PORT,
};

/// Puts the PCI root buses (always segment 0's: its host bridge, CF8/CFC and the ECAM
/// window are what the ACPI tables describe; one more root per further segment) and the
/// requested passthrough devices on the VM's buses; all guest RAM is DMA-mapped for every
/// device in the background (`devices.dma_mappings`), and each device's Bus Master waits
/// for it. Returns the roots, segment 0's first.
pub fn attach(
    kvm: &Kvm,
    vm: &VmFd,
    ram: &GuestRam,
    options: &PciOptions,
    devices: &mut MachineDevices,
) -> Result<Vec<Arc<PciRoot>>, PciSetupError> {
    let count = segment_count(options)?;
    let configs = segment_configs(ram, options, count);
    let roots = configs
        .iter()
        .enumerate()
        .map(|(segment, config)| PciRoot::new_segment(segment as u16, *config))
        .collect::<Result<Vec<_>, _>>()?;
    let (config, root) = (configs[0], roots[0].clone());
    let router = Arc::new(MsiRouter::new(kvm, vm).map_err(PciSetupError::VmFd)?);
    let slots: Arc<dyn GuestMemoryMapper> = Arc::new(KvmBarSlots::new(kvm, vm)?);
    if !options.is_empty() {
        attach_devices(vm, ram, options, &root, &router, &slots, devices)?;
    }
    // Also when there are none yet: a virtio device hot-plugged later needs a thread.
    crate::virtio::start_io_threads(&options.virtio)?;
    if !options.virtio.is_empty() {
        devices.virtio = crate::virtio::attach(
            duplicate_vm(kvm, vm).map_err(PciSetupError::VmFd)?,
            ram.memory(),
            &roots,
            &router,
            &options.virtio,
            &options.passed_taps,
        )?;
    }
    let hotplug = crate::hotplug::PciHotplug::new(
        kvm,
        vm,
        ram,
        root.clone(),
        router,
        slots,
        DmaTestHooks::from_env(),
    )?;
    let io_bus = Arc::get_mut(&mut devices.io_bus).ok_or(PciSetupError::BusShared)?;
    io_bus
        .insert(
            u64::from(HOTPLUG_PORT),
            u64::from(HOTPLUG_PORT_LEN),
            hotplug.controller(),
        )
        .map_err(PciSetupError::Place)?;
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
                PciRootConfig::ECAM_SIZE,
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

/// Plugs the passthrough devices of `options` into `root`. Guest RAM is mapped in the
/// background: once per kernel VFIO context (its mappings serve all its devices), once
/// per vfio-user device; each mapping starts as soon as its devices are open.
fn attach_devices(
    vm: &VmFd,
    ram: &GuestRam,
    options: &PciOptions,
    root: &Arc<PciRoot>,
    router: &Arc<MsiRouter>,
    slots: &Arc<dyn GuestMemoryMapper>,
    devices: &mut MachineDevices,
) -> Result<(), PciSetupError> {
    let ram_chunks = RamChunks::new(ram);
    let hooks = DmaTestHooks::from_env();
    let plug = Plug {
        vm,
        root,
        router,
        slots,
    };
    if let Some(first) = options.gpus.first() {
        let vfio = KernelVfio::open(first, Some(Arc::new(create_kvm_vfio_device(vm)?)))?;
        let mut backends: Vec<Box<dyn PassthroughDevice>> = Vec::new();
        for bdf in &options.gpus {
            backends.push(Box::new(vfio.open_device(bdf)?));
        }
        // Kernel VFIO pins all of guest RAM: check the limit before the long mapping.
        gpuvm_vfio::host::check_memlock(ram.size())?;
        let mapper = vfio.dma_mapper();
        let progress = ram_chunks.progress(mapper.name());
        devices
            .dma_mappings
            .push(ram_chunks.start(progress.clone(), mapper, hooks)?);
        for backend in backends {
            plug_device(&plug, backend, &progress, devices)?;
        }
    }
    for socket in &options.vfio_user {
        let backend = VfioUserDevice::connect(socket)?;
        let mapper = backend.dma_mapper();
        let progress = ram_chunks.progress(mapper.name());
        // Plugging resets the device: map after that.
        plug_device(&plug, Box::new(backend), &progress, devices)?;
        devices
            .dma_mappings
            .push(ram_chunks.start(progress, mapper, hooks)?);
    }
    Ok(())
}

/// Cold-plugs one device with `plug`: MSI/MSI-X vectors, BAR mappings, its Bus Master
/// gated by the DMA mapping `dma`, a slot on the bus, and INTx on the slot's GSI.
fn plug_device(
    plug: &Plug<'_>,
    backend: Box<dyn PassthroughDevice>,
    dma: &Arc<DmaProgress>,
    devices: &mut MachineDevices,
) -> Result<(), PciSetupError> {
    let plugged = plug.open(backend, dma)?;
    let (bdf, pin, device) = (plugged.bdf, plugged.pin, plugged.device);
    devices.passthrough.push(plugged.label);
    if pin > 0 {
        let gsi = intx_gsi(bdf.device, pin - 1);
        if let Some(resample) = plug.intx(&device, gsi)? {
            devices.event_sources.push(resample);
        }
    }
    Ok(())
}
