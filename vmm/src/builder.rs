//! Builds a ready-to-run [`Machine`] from a [`VmConfig`]: KVM VM, guest RAM, devices,
//! kernel, firmware tables and vCPUs, validated in that order so nothing is left
//! half-built on error (everything is owned and dropped on the way out).
//! [`restore`] (builder/restore.rs) builds one from a snapshot with the same VM, RAM,
//! device and vCPU stages.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use gpuvm_arch::x86_64::acpi::{self, AcpiConfig};
use gpuvm_arch::x86_64::address_space::MAX_GUEST_PHYS_BITS;
use gpuvm_arch::x86_64::cpuid::Topology;
use gpuvm_arch::x86_64::layout::{self, KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR};
use gpuvm_arch::x86_64::{boot, mptable, reset_vector};
use gpuvm_devices::acpi_sleep::SLEEP_CONTROL_PORT;
use gpuvm_devices::cpu_hotplug::{CpuHotplug, CPU_HOTPLUG_PORT, CPU_HOTPLUG_PORT_LEN};
use gpuvm_devices::memory_hotplug::{MemoryHotplug, MEMORY_HOTPLUG_PORT, MEMORY_HOTPLUG_PORT_LEN};
use gpuvm_devices::pci::hotplug::HOTPLUG_GSI;
use gpuvm_devices::pci::PciRootConfig;
use gpuvm_devices::{Bus, BusDevice};
use gpuvm_memory::{slot_slices, ByteSize, GuestRam, GuestRamConfig, RamRegion, SlotSliceSize};
use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{MachineConfig, PciOptions, VmConfig};
use crate::devices::MachineDevices;
use crate::host::{max_vcpus, open_kvm};
use crate::machine::{Machine, RamHotplug};
use crate::snapshot::StageClock;
use crate::vcpu::{Vcpu, VcpuTemplate, VcpuThread};
use crate::Error;

mod attach;
mod restore;
pub use restore::{
    prepare_handed_over, restore, restore_with_gpus, restore_with_overrides, PreparedMachine,
};

/// Serial port COM1 and its legacy interrupt line.
const COM1_BASE: u64 = 0x3f8;
const COM1_IRQ: u32 = 4;
const I8042_BASE: u64 = 0x60;
const I8042_LEN: u64 = 5;
/// The test guest's status port (QEMU's isa-debug-exit uses the same address).
pub const EXIT_PORT: u64 = 0xf4;
const POST_CODE_PORT: u64 = 0x80;
const CMOS_BASE: u64 = 0x70;

/// Whether the ACPI tables of the VMs this process builds offer power-off (see
/// [`without_acpi_power_off`]).
static ACPI_POWER_OFF: AtomicBool = AtomicBool::new(true);

/// Builds VMs whose ACPI tables offer no power-off (no sleep control register, no
/// `\_S5_`), as Firecracker's: there a guest's `poweroff` halts it and `reboot` stops the
/// VMM. The Firecracker front end calls this before any VM is built. The sleep control
/// device itself stays on the port bus either way: a VM restored from a snapshot keeps
/// the tables it booted with, and a guest is only told of the port by them.
pub fn without_acpi_power_off() {
    ACPI_POWER_OFF.store(false, Ordering::Relaxed);
}

/// A KVM VM with guest RAM and devices, before a kernel or saved state goes in.
struct MachineBase {
    kvm: Kvm,
    vm: VmFd,
    ram: GuestRam,
    /// The room for hot-plugged RAM (memory.hotplug_size), mapped for device emulation.
    ram_hotplug_area: Option<GuestRam>,
    devices: MachineDevices,
    /// Where each PCI segment's root bus put ECAM and the BAR windows, segment 0's first
    /// (the ACPI tables describe them).
    pci: Vec<PciRootConfig>,
    /// The NUMA nodes as placed: the vCPU threads' pinning, the ACPI tables' topology and
    /// the plan the machine's snapshots carry.
    numa: crate::numa::PlacedNuma,
}

fn create_base(
    kvm: Kvm,
    machine_config: &MachineConfig,
    pci_options: &PciOptions,
    serial_out: Box<dyn Write + Send>,
    clock: &mut StageClock,
) -> Result<MachineBase, Error> {
    create_base_over(kvm, None, machine_config, pci_options, serial_out, clock)
}

/// [`create_base`], over `adopted` guest RAM when given (a live update's memfd, and
/// whether it is on the huge-page tmpfs) instead of new RAM.
fn create_base_over(
    kvm: Kvm,
    adopted: Option<(std::fs::File, bool)>,
    machine_config: &MachineConfig,
    pci_options: &PciOptions,
    serial_out: Box<dyn Write + Send>,
    clock: &mut StageClock,
) -> Result<MachineBase, Error> {
    let max = max_vcpus(&kvm);
    // Every possible vCPU (hot-pluggable ones too) must be one KVM can create.
    let possible = pci_options.max_vcpus(machine_config);
    if machine_config.vcpus == 0 || possible > max {
        return Err(Error::VcpuCount {
            requested: possible,
            max,
        });
    }
    // A size of 0 is the memory crate's error to report.
    let size = machine_config.memory_size;
    if size > 0 && size < layout::HIMEM_START {
        return Err(Error::MemoryTooSmall { size });
    }
    let regions = crate::host::ram_regions(&kvm, machine_config.memory_size);
    // Before any RAM is made: the layout must fit boot RAM's KVM memory slots.
    boot_ram_slot_size(&regions)?;
    // Where hot-plugged RAM may go, `(start, size)`: its room is in guest RAM's own file.
    let hotplug_area = (pci_options.ram_hotplug_size > 0).then(|| {
        let top = regions.iter().map(|r| r.end()).max().unwrap_or(0);
        layout::ram_hotplug_area(top, pci_options.ram_hotplug_size)
    });
    let ram_config = GuestRamConfig {
        size: machine_config.memory_size,
        backing: machine_config.backing,
        thp: machine_config.thp,
    };
    let (ram, numa) = match adopted {
        // Its pages are where the guest left them, hot-plugged RAM's after boot RAM's,
        // bound to their nodes by the process that made them.
        Some((memfd, huge_tmpfs)) => {
            let room = hotplug_area.map_or(0, |(_, room)| room);
            let ram = GuestRam::adopt(memfd, &ram_config, &regions, huge_tmpfs, room)?;
            let numa = crate::numa::prepare(machine_config, pci_options, None)?;
            (ram, numa)
        }
        None => {
            // Create RAM first: it is where bad sizes are caught, before any KVM object
            // exists.
            let ram = match hotplug_area {
                Some((_, room)) => GuestRam::create_with_hotplug_room(&ram_config, &regions, room)?,
                None => GuestRam::create(&ram_config, &regions)?,
            };
            // Before anything touches guest RAM (prefault, loaders, DMA mapping).
            let numa = crate::numa::prepare(machine_config, pci_options, Some(&ram))?;
            (ram, numa)
        }
    };
    let ram_hotplug_area = hotplug_area
        .map(|(start, size)| ram.hotplug_area(start, size))
        .transpose()?;
    // What device emulation reads and writes: boot RAM and, from the start, the whole
    // hot-plug area, so RAM plugged later needs no new memory map in any device.
    let device_memory = match &ram_hotplug_area {
        Some(area) => ram.memory_with(area)?,
        None => ram.memory().clone(),
    };
    clock.mark("guest_ram");
    let vm = kvm.create_vm().map_err(|source| Error::KvmSetup {
        what: "create the VM",
        source,
    })?;
    vm.set_tss_address(KVM_TSS_ADDR as usize)
        .map_err(|source| Error::KvmSetup {
            what: "set the TSS address",
            source,
        })?;
    // Only Intel needs the identity map page; hosts without it answer ENOTTY/EINVAL.
    if let Err(error) = vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR) {
        log::debug!("KVM_SET_IDENTITY_MAP_ADDR: {error}");
    }
    clock.mark("create_vm");
    if machine_config.prefault {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let stats = gpuvm_memory::prefault(&ram, threads)?;
        log::info!(
            "prefaulted {} MiB with {} threads in {:?}",
            stats.bytes >> 20,
            stats.threads,
            stats.elapsed
        );
    }
    register_memory(&vm, &ram, machine_config.track_dirty_pages)?;
    clock.mark("memslots");
    // After the memory slots: registering memory with KVM once the irqchip exists costs
    // ~8 ms more here (measured on the nested CI hosts: a 256 MiB restore went from
    // about 8 to 3 ms).
    vm.create_irq_chip().map_err(|source| Error::KvmSetup {
        what: "create the in-kernel interrupt controller",
        source,
    })?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(|source| Error::KvmSetup {
        what: "create the in-kernel PIT",
        source,
    })?;
    clock.mark("irqchip_pit");
    let mut devices = create_devices(&vm, serial_out, machine_config.vcpus, possible)?;
    if pci_options.ram_hotplug_size > 0 {
        devices.memory_hotplug = Some(create_memory_hotplug(&vm, &mut devices.io_bus)?);
    }
    // The root and its devices live on in the buses' entries.
    let pci = attach::attach(
        &kvm,
        &vm,
        (&ram, &device_memory),
        pci_options,
        &numa.passthrough_segments,
        &mut devices,
    )?
    .iter()
    .map(|root| root.config())
    .collect();
    clock.mark("devices");
    Ok(MachineBase {
        kvm,
        vm,
        ram,
        ram_hotplug_area,
        devices,
        pci,
        numa,
    })
}

/// Builds a machine that boots `config.boot`.
pub fn build(config: &VmConfig, serial_out: Box<dyn Write + Send>) -> Result<Machine, Error> {
    build_with_pci(config, &PciOptions::default(), serial_out)
}

/// Builds a machine that boots `config.boot` with the passthrough devices in `pci`.
pub fn build_with_pci(
    config: &VmConfig,
    pci: &PciOptions,
    serial_out: Box<dyn Write + Send>,
) -> Result<Machine, Error> {
    let started = Instant::now();
    let mut clock = StageClock::starting_at(started);
    let machine_config = &config.machine;
    let max_vcpus = pci.max_vcpus(machine_config);
    let ram_hotplug_size = pci.ram_hotplug_size;
    let device_keys = crate::numa::device_keys(pci);
    let MachineBase {
        kvm,
        vm,
        ram,
        ram_hotplug_area,
        devices,
        pci,
        numa,
    } = {
        let kvm = open_kvm()?;
        clock.mark("open_kvm");
        create_base(kvm, machine_config, pci, serial_out, &mut clock)?
    };

    let topology = numa.plan.as_ref().map(|plan| {
        plan.topology(
            ram.regions(),
            ram_hotplug_size,
            &device_keys,
            &devices.passthrough,
            &numa.passthrough_segments,
        )
    });
    let rsdp = acpi::setup_acpi_with_numa(
        ram.memory(),
        &AcpiConfig {
            vcpus: machine_config.vcpus,
            max_vcpus,
            memory_hotplug: devices.memory_hotplug.is_some(),
            pci_segments: pci,
            power_off: ACPI_POWER_OFF.load(Ordering::Relaxed),
        },
        topology.as_ref(),
        &(devices.pci_hotplug.as_ref())
            .map(|hotplug| hotplug.bridge_slots())
            .unwrap_or_default(),
    )?;
    clock.mark("acpi");
    let loaded = boot::load(ram.memory(), ram.regions(), &config.boot, Some(rsdp))?;
    mptable::setup_mptable(ram.memory(), machine_config.vcpus)?;
    reset_vector::setup_reset_vector(ram.memory())?;
    clock.mark("load_kernel");

    let supported_cpuid = crate::host::supported_cpuid(&kvm).map_err(|source| Error::KvmSetup {
        what: "read supported CPUID",
        source,
    })?;
    // The topology covers every possible vCPU, so a hot-plugged one fits in it.
    let topology = Topology {
        vcpu_count: max_vcpus,
    };
    let vcpus = create_vcpus(&kvm, &vm, 0..machine_config.vcpus, &devices)?;
    for vcpu in &vcpus {
        let id = vcpu.id;
        let ignored = vcpu.configure(&supported_cpuid, topology, &machine_config.cpuid_masks)?;
        if id == 0 {
            for mask in ignored {
                log::warn!(
                    "CPUID mask {mask} did not take effect: this host's KVM still shows the feature to the guest"
                );
            }
            vcpu.setup_boot_registers(ram.memory(), loaded.entry)?;
        }
    }
    clock.mark("create_vcpus");
    let mut vcpu_threads = start_vcpu_threads(&vcpus, &numa)?;
    // Threads for the vCPUs hot-plug may add, each under its filter, waiting.
    vcpu_threads.extend(spare_vcpu_threads(machine_config.vcpus..max_vcpus, &numa)?);
    clock.mark("vcpu_threads");
    let vcpu_template = match vcpus.first() {
        Some(first) if max_vcpus > machine_config.vcpus => Some(VcpuTemplate {
            supported_cpuid,
            topology,
            masks: machine_config.cpuid_masks.clone(),
            msr_indices: first.msr_indices(),
        }),
        _ => None,
    };
    log::info!(
        "VM built in {:?}: {} vCPU(s), {} MiB {} RAM",
        started.elapsed(),
        machine_config.vcpus,
        machine_config.memory_size >> 20,
        machine_config.backing
    );
    let mut machine = Machine::new(kvm, vm, ram, devices, vcpus, machine_config.clone());
    machine.numa = numa;
    machine.vcpu_threads = vcpu_threads;
    machine.max_vcpus = max_vcpus;
    machine.vcpu_template = vcpu_template;
    if let (Some(block), Some(area)) = (machine.devices().memory_hotplug.clone(), ram_hotplug_area)
    {
        machine.ram_hotplug = Some(RamHotplug::new(area, ram_hotplug_size, block));
    }
    machine.boot_timings = Some(crate::machine::BootTimings {
        called: started,
        stages: clock.into_stages(),
        returned: Instant::now(),
    });
    Ok(machine)
}

/// Starts a thread for each of `vcpus` now, so that their seccomp filters are installed
/// while the rest of the VM is set up (see [`VcpuThread`]), each pinned where `numa` says.
fn start_vcpu_threads(
    vcpus: &[Vcpu],
    numa: &crate::numa::PlacedNuma,
) -> Result<Vec<VcpuThread>, Error> {
    vcpus
        .iter()
        .map(|vcpu| VcpuThread::spawn(vcpu.id, numa.cpus_of(vcpu.id)).map_err(Error::from))
        .collect()
}

/// Starts a thread for each vCPU of `ids` that hot-plug may add later: under the vCPU
/// filter at once, each waits for its vCPU ([`VcpuThread`]), which the VMM thread creates
/// when the guest is to get it (threads cannot be started under the filters later).
fn spare_vcpu_threads(
    ids: impl Iterator<Item = u8>,
    numa: &crate::numa::PlacedNuma,
) -> Result<Vec<VcpuThread>, Error> {
    ids.map(|id| VcpuThread::spawn_spare(id, numa.cpus_of(id)).map_err(Error::from))
        .collect()
}

/// Creates the vCPUs `ids`, wired to the buses, with no state yet (boot registers or
/// saved state come next).
fn create_vcpus(
    kvm: &Kvm,
    vm: &VmFd,
    ids: impl Iterator<Item = u8>,
    devices: &MachineDevices,
) -> Result<Vec<Vcpu>, Error> {
    let msr_indices =
        Arc::new(
            crate::vcpu::saved_msr_indices(kvm).map_err(|source| Error::KvmSetup {
                what: "list MSRs",
                source,
            })?,
        );
    ids.map(|id| {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(|source| Error::Vcpu(crate::vcpu::VcpuError::Create { id, source }))?;
        Ok(Vcpu::new(
            id,
            fd,
            devices.io_bus.clone(),
            devices.mmio_bus.clone(),
            msr_indices.clone(),
        ))
    })
    .collect()
}

/// Boot RAM's regions at most: below the 32-bit hole, above it, and (AMD hosts) past the
/// HyperTransport range (layout::ram_regions_around).
const MAX_BOOT_RAM_REGIONS: u32 = 3;

/// KVM memory slots kept for boot RAM, numbered from 0: its regions, each cut into slots of
/// at most [`SlotSliceSize::KVM`] (KVM's slots hold 8 TiB less a page). Enough for RAM
/// filling all the guest-physical address space gpuvm gives a guest: each region takes at
/// most one slot more than its share of that space's slots. Memory hot-plug's slots
/// follow, then the BAR mappings'.
pub(crate) const BOOT_RAM_SLOTS: u32 = MAX_BOOT_RAM_REGIONS
    + (1u64 << MAX_GUEST_PHYS_BITS).div_ceil(SlotSliceSize::KVM.bytes()) as u32;

/// `GPUVM_TEST_MAX_SLOT_MIB=<MiB>`: boot RAM's KVM memory slots are at most this large
/// (a multiple of 2 MiB) instead of [`SlotSliceSize::KVM`], so tests can split a guest that
/// fits this host over many slots.
pub const TEST_MAX_SLOT_VAR: &str = "GPUVM_TEST_MAX_SLOT_MIB";

/// The most boot RAM's KVM memory slots hold: [`TEST_MAX_SLOT_VAR`]'s, read once, when set.
fn max_slot_size() -> Result<SlotSliceSize, Error> {
    static SIZE: OnceLock<Result<SlotSliceSize, (String, String)>> = OnceLock::new();
    SIZE.get_or_init(|| match std::env::var(TEST_MAX_SLOT_VAR) {
        Ok(value) if !value.is_empty() => {
            parse_max_slot_mib(&value).map_err(|reason| (value, reason))
        }
        _ => Ok(SlotSliceSize::KVM),
    })
    .clone()
    .map_err(|(value, reason)| Error::TestMaxSlot { value, reason })
}

fn parse_max_slot_mib(value: &str) -> Result<SlotSliceSize, String> {
    let mib: u64 = value
        .trim()
        .parse()
        .map_err(|_| "not a whole number of MiB".to_string())?;
    let bytes = mib
        .checked_mul(1 << 20)
        .ok_or_else(|| "too large".to_string())?;
    SlotSliceSize::new(bytes).map_err(|error| error.to_string())
}

/// How boot RAM laid out as `regions` is cut into KVM memory slots; refused when it would
/// need more slots than boot RAM has (only a test's small [`TEST_MAX_SLOT_VAR`] can ask
/// for that).
pub(crate) fn boot_ram_slot_size(regions: &[RamRegion]) -> Result<SlotSliceSize, Error> {
    fits_boot_ram_slots(regions, max_slot_size()?)
}

fn fits_boot_ram_slots(
    regions: &[RamRegion],
    slot_size: SlotSliceSize,
) -> Result<SlotSliceSize, Error> {
    let needed = slot_size.slot_count(regions);
    if needed > u64::from(BOOT_RAM_SLOTS) {
        return Err(Error::TooManyRamSlots {
            needed,
            reserved: BOOT_RAM_SLOTS,
            slot_size: slot_size.bytes(),
        });
    }
    Ok(slot_size)
}

/// Hands boot RAM to KVM: every region, as one memory slot or (past what one slot holds)
/// several, numbered from 0 in address order.
fn register_memory(vm: &VmFd, ram: &GuestRam, track_dirty_pages: bool) -> Result<(), Error> {
    let slot_size = boot_ram_slot_size(ram.regions())?;
    let mut slot = 0u32;
    for (region, host) in ram.host_regions() {
        for slice in slot_slices(&[region], slot_size) {
            let memory_slot = crate::memslots::MemorySlot {
                slot,
                guest_addr: slice.guest_addr,
                size: slice.size,
                host: host as u64 + slice.region_offset,
                dirty_log: track_dirty_pages,
            };
            // SAFETY: the host range is inside a live mapping owned by `ram` (a slice lies
            // within its region), which the Machine keeps alive for as long as the VM fd (the
            // VM is dropped first, see Machine's fields).
            unsafe { memory_slot.set(vm) }.map_err(|source| Error::KvmSetup {
                what: "register guest memory with KVM",
                source,
            })?;
            slot += 1;
        }
    }
    let regions = ram.regions().len();
    if slot as usize > regions {
        log::info!(
            "guest RAM: {slot} KVM memory slots for {regions} region(s) (at most {} each)",
            ByteSize(slot_size.bytes())
        );
    } else {
        log::debug!("guest RAM: {slot} KVM memory slot(s), one per region");
    }
    Ok(())
}

/// The ACPI memory hot-plug register block on the port-I/O bus, with its own irqfd on the
/// GED's GSI (the PCI and CPU hot-plug blocks have theirs).
fn create_memory_hotplug(
    vm: &VmFd,
    io_bus: &mut Arc<Bus>,
) -> Result<Arc<Mutex<MemoryHotplug>>, Error> {
    // Nothing shares the bus before the vCPUs exist.
    let io_bus = Arc::get_mut(io_bus).ok_or(Error::Pci(crate::pci::PciSetupError::BusShared))?;
    let interrupt = eventfd()?;
    vm.register_irqfd(&interrupt, HOTPLUG_GSI)
        .map_err(|source| Error::KvmSetup {
            what: "wire the memory hot-plug interrupt",
            source,
        })?;
    let block = Arc::new(Mutex::new(MemoryHotplug::new(Some(interrupt))));
    insert(
        io_bus,
        u64::from(MEMORY_HOTPLUG_PORT),
        u64::from(MEMORY_HOTPLUG_PORT_LEN),
        block.clone(),
    )?;
    Ok(block)
}

fn eventfd() -> Result<EventFd, Error> {
    EventFd::new(EFD_NONBLOCK).map_err(Error::EventFd)
}

fn insert(
    bus: &mut Bus,
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
) -> Result<(), Error> {
    bus.insert(base, len, device).map_err(Error::Bus)
}

/// The machine's devices; with more possible vCPUs (`max_vcpus`) than `vcpus`, the CPU
/// hot-plug register block too.
fn create_devices(
    vm: &VmFd,
    serial_out: Box<dyn Write + Send>,
    vcpus: u8,
    max_vcpus: u8,
) -> Result<MachineDevices, Error> {
    let mut io_bus = Bus::new();
    let cpu_hotplug = if max_vcpus > vcpus {
        // Its own irqfd on the GED's GSI (the PCI hot-plug block has another).
        let interrupt = eventfd()?;
        vm.register_irqfd(&interrupt, HOTPLUG_GSI)
            .map_err(|source| Error::KvmSetup {
                what: "wire the CPU hot-plug interrupt",
                source,
            })?;
        let block = Arc::new(Mutex::new(CpuHotplug::new(
            vcpus,
            max_vcpus,
            Some(interrupt),
        )));
        insert(
            &mut io_bus,
            u64::from(CPU_HOTPLUG_PORT),
            u64::from(CPU_HOTPLUG_PORT_LEN),
            block.clone(),
        )?;
        Some(block)
    } else {
        None
    };

    let serial_irq = eventfd()?;
    vm.register_irqfd(&serial_irq, COM1_IRQ)
        .map_err(|source| Error::KvmSetup {
            what: "wire the serial port interrupt",
            source,
        })?;
    let serial = Arc::new(Mutex::new(gpuvm_devices::SerialDevice::new(
        serial_irq, serial_out,
    )));
    insert(&mut io_bus, COM1_BASE, 8, serial.clone())?;

    let reset_evt = eventfd()?;
    let i8042 = gpuvm_devices::I8042::new(reset_evt.try_clone().map_err(Error::EventFd)?);
    insert(
        &mut io_bus,
        I8042_BASE,
        I8042_LEN,
        Arc::new(Mutex::new(i8042)),
    )?;

    let poweroff_evt = eventfd()?;
    let sleep_control =
        gpuvm_devices::AcpiSleepControl::new(poweroff_evt.try_clone().map_err(Error::EventFd)?);
    insert(
        &mut io_bus,
        u64::from(SLEEP_CONTROL_PORT),
        gpuvm_devices::AcpiSleepControl::LEN,
        Arc::new(Mutex::new(sleep_control)),
    )?;

    let exit_evt = eventfd()?;
    let exit_port = gpuvm_devices::ExitPort::new(exit_evt.try_clone().map_err(Error::EventFd)?);
    let exit_status = exit_port.status();
    insert(&mut io_bus, EXIT_PORT, 4, Arc::new(Mutex::new(exit_port)))?;

    insert(
        &mut io_bus,
        POST_CODE_PORT,
        1,
        Arc::new(Mutex::new(gpuvm_devices::Sink::new("post-code", 0xff))),
    )?;
    insert(
        &mut io_bus,
        CMOS_BASE,
        2,
        Arc::new(Mutex::new(gpuvm_devices::Sink::new("cmos", 0))),
    )?;

    log::debug!("port I/O bus: {io_bus:?}");
    Ok(MachineDevices {
        dma_mappings: Vec::new(),
        pci_hotplug: None,
        cpu_hotplug,
        memory_hotplug: None,
        io_bus: Arc::new(io_bus),
        mmio_bus: Arc::new(Bus::new()),
        serial,
        reset_evt,
        poweroff_evt,
        exit_evt,
        exit_status,
        passthrough: Vec::new(),
        event_sources: Vec::new(),
        virtio: Vec::new(),
        released_gpus: Vec::new(),
        handover: Default::default(),
        client_record: None,
        cold_plugged_ids: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use gpuvm_arch::x86_64::layout::{ram_regions, ram_regions_around};

    use super::*;

    const GIB: u64 = 1 << 30;
    const TIB: u64 = 1 << 40;

    #[test]
    fn boot_ram_slots_hold_ram_filling_the_guest_address_space() {
        let space = 1u64 << MAX_GUEST_PHYS_BITS;
        for amd in [false, true] {
            let regions = ram_regions_around(space - 4 * GIB, amd);
            let slots = fits_boot_ram_slots(&regions, SlotSliceSize::KVM).unwrap();
            let needed = slots.slot_count(&regions);
            assert!(needed > regions.len() as u64 && needed <= u64::from(BOOT_RAM_SLOTS));
        }
        // Up to 8 TiB - 1 GiB above 4 GiB is one slot per region, as before.
        let regions = ram_regions(8 * TIB - GIB + 3 * GIB);
        assert_eq!(SlotSliceSize::KVM.slot_count(&regions), 2);
    }

    #[test]
    fn a_layout_needing_more_slots_than_boot_ram_has_is_refused() {
        let regions = ram_regions(6 * GIB);
        let two_mib = SlotSliceSize::new(2 << 20).unwrap();
        let err = fits_boot_ram_slots(&regions, two_mib).unwrap_err();
        assert!(
            matches!(err, Error::TooManyRamSlots { needed: 3072, .. }),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("3072 KVM memory slots of at most 2 MiB"),
            "{err}"
        );
        let gib = SlotSliceSize::new(GIB).unwrap();
        assert_eq!(
            fits_boot_ram_slots(&regions, gib)
                .unwrap()
                .slot_count(&regions),
            6
        );
    }

    #[test]
    fn the_test_slot_size_is_whole_mib_in_2_mib_steps() {
        assert_eq!(parse_max_slot_mib("1024").unwrap().bytes(), GIB);
        assert_eq!(parse_max_slot_mib(" 2 ").unwrap().bytes(), 2 << 20);
        for (bad, why) in [
            ("1G", "whole number"),
            ("-2", "whole number"),
            ("0", "multiple of 2 MiB"),
            ("3", "multiple of 2 MiB"),
            ("8388608", "at most"),
            ("18446744073709551615", "too large"),
        ] {
            let reason = parse_max_slot_mib(bad).unwrap_err();
            assert!(reason.contains(why), "{bad}: {reason}");
        }
    }
}
