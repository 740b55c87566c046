//! Builds a ready-to-run [`Machine`] from a [`VmConfig`]: KVM VM, guest RAM, devices,
//! kernel, firmware tables and vCPUs, validated in that order so nothing is left
//! half-built on error (everything is owned and dropped on the way out).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpuvm_arch::x86_64::acpi::{self, AcpiConfig};
use gpuvm_arch::x86_64::cpuid::Topology;
use gpuvm_arch::x86_64::layout::{self, KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR};
use gpuvm_arch::x86_64::{boot, mptable};
use gpuvm_devices::pci::PciRootConfig;
use gpuvm_devices::{Bus, BusDevice, Persist};
use gpuvm_memory::{GuestRam, GuestRamConfig};
use std::path::Path;

use gpuvm_memory::snapshot::{restore_eager, EagerOptions, RamMappings, SnapshotChain};
use gpuvm_memory::uffd::external::{mappings_for, send_handshake, HandlerWatch};
use gpuvm_memory::uffd::{
    guest_ram_ranges, register_guest_ram, start_lazy_restore, LazyOptions, UffdError,
};
use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{MachineConfig, VmConfig};
use crate::machine::{LazyMemory, Machine, MachineDevices};
use crate::pci::PciOptions;
use crate::snapshot::{self, MemoryChain, RestoreMode, RestoreTimings, SnapshotError, StageClock};
use crate::vcpu::{Vcpu, VcpuThread};
use crate::vm_state::InKernelDevices;
use crate::working_set;
use crate::Error;

/// Serial port COM1 and its legacy interrupt line.
const COM1_BASE: u64 = 0x3f8;
const COM1_IRQ: u32 = 4;
const I8042_BASE: u64 = 0x60;
const I8042_LEN: u64 = 5;
/// The test guest's status port (QEMU's isa-debug-exit uses the same address).
pub const EXIT_PORT: u64 = 0xf4;
const POST_CODE_PORT: u64 = 0x80;
const CMOS_BASE: u64 = 0x70;

/// Opens /dev/kvm with an error that tells the user what to do.
pub fn open_kvm() -> Result<Kvm, Error> {
    Kvm::new().map_err(|source| {
        let hint = match source.errno() {
            libc::ENOENT => "no /dev/kvm: is KVM enabled (kvm_intel/kvm_amd loaded, virtualization on in firmware)?",
            libc::EACCES | libc::EPERM => "permission denied on /dev/kvm: add this user to the 'kvm' group or run as root",
            _ => "cannot open /dev/kvm",
        };
        Error::Kvm { hint, source }
    })
}

/// The most vCPUs a VM may have here: KVM's limit, capped by what the MP table addresses.
pub fn max_vcpus(kvm: &Kvm) -> u8 {
    kvm.get_max_vcpus()
        .min(usize::from(mptable::MAX_MPTABLE_CPUS)) as u8
}

/// [`max_vcpus`] of this host, read once, for checking a configuration before anything is
/// built (PUT /machine-config). None when /dev/kvm cannot be opened: the build then says
/// why.
pub fn host_max_vcpus() -> Option<u8> {
    static MAX: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| open_kvm().ok().map(|kvm| max_vcpus(&kvm)))
}

/// A KVM VM with guest RAM and devices, before a kernel or saved state goes in.
struct MachineBase {
    kvm: Kvm,
    vm: VmFd,
    ram: GuestRam,
    devices: MachineDevices,
    /// Where the PCI root bus put ECAM and the BAR windows (the ACPI tables describe it).
    pci: PciRootConfig,
}

fn create_base(
    kvm: Kvm,
    machine_config: &MachineConfig,
    pci_options: &PciOptions,
    serial_out: Box<dyn Write + Send>,
    clock: &mut StageClock,
) -> Result<MachineBase, Error> {
    let max = max_vcpus(&kvm);
    if machine_config.vcpus == 0 || machine_config.vcpus > max {
        return Err(Error::VcpuCount {
            requested: machine_config.vcpus,
            max,
        });
    }
    // A size of 0 is the memory crate's error to report.
    let size = machine_config.memory_size;
    if size > 0 && size < layout::HIMEM_START {
        return Err(Error::MemoryTooSmall { size });
    }
    let regions = layout::ram_regions(machine_config.memory_size);
    // Create RAM first: it is where bad sizes are caught, before any KVM object exists.
    let ram = GuestRam::create(
        &GuestRamConfig {
            size: machine_config.memory_size,
            backing: machine_config.backing,
            thp: machine_config.thp,
        },
        &regions,
    )?;
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
    let mut devices = create_devices(&vm, serial_out)?;
    // The root and its devices live on in the buses' entries.
    let pci = crate::pci::attach(&kvm, &vm, &ram, pci_options, &mut devices)?.config();
    clock.mark("devices");
    Ok(MachineBase {
        kvm,
        vm,
        ram,
        devices,
        pci,
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
    let machine_config = &config.machine;
    let MachineBase {
        kvm,
        vm,
        ram,
        devices,
        pci,
    } = create_base(
        open_kvm()?,
        machine_config,
        pci,
        serial_out,
        &mut StageClock::starting_at(started),
    )?;

    let rsdp = acpi::setup_acpi(
        ram.memory(),
        &AcpiConfig {
            vcpus: machine_config.vcpus,
            pci,
        },
    )?;
    let loaded = boot::load(ram.memory(), ram.regions(), &config.boot, Some(rsdp))?;
    mptable::setup_mptable(ram.memory(), machine_config.vcpus)?;

    let supported_cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| Error::KvmSetup {
            what: "read supported CPUID",
            source,
        })?;
    let topology = Topology {
        vcpu_count: machine_config.vcpus,
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
    let vcpu_threads = start_vcpu_threads(&vcpus)?;
    log::info!(
        "VM built in {:?}: {} vCPU(s), {} MiB {} RAM",
        started.elapsed(),
        machine_config.vcpus,
        machine_config.memory_size >> 20,
        machine_config.backing
    );
    let mut machine = Machine::new(kvm, vm, ram, devices, vcpus, machine_config.clone());
    machine.vcpu_threads = vcpu_threads;
    Ok(machine)
}

/// Starts a thread for each of `vcpus` now, so that their seccomp filters are installed
/// while the rest of the VM is set up (see [`VcpuThread`]).
fn start_vcpu_threads(vcpus: &[Vcpu]) -> Result<Vec<VcpuThread>, Error> {
    vcpus
        .iter()
        .map(|vcpu| VcpuThread::spawn(vcpu.id).map_err(Error::from))
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

/// Builds a machine from the snapshot in `dir`. Everything in the snapshot is read and
/// validated before a KVM VM exists, so a bad snapshot leaves nothing behind. With
/// [`RestoreMode::Lazy`] the machine is ready as soon as the loader is running.
///
/// A pipeline of stages, each a function below, timed under the names
/// [`RestoreTimings::stages`] lists; the KVM VM, RAM and devices (`guest_ram` to
/// `devices`) and the vCPUs are built by the same stages as a boot.
pub fn restore(
    dir: &Path,
    mode: &RestoreMode,
    serial_out: Box<dyn Write + Send>,
) -> Result<(Machine, RestoreTimings), Error> {
    let started = Instant::now();
    let mut clock = StageClock::starting_at(started);
    let kvm = open_kvm()?;
    clock.mark("open_kvm");
    // Not while another process writes a snapshot there; held until the restore is set up.
    let _reading = snapshot::SnapshotDirLock::shared(dir)?;
    let state = snapshot::load_state(dir, layout::ram_regions)?;
    clock.mark("state");
    let validation = Validation::start(&state, dir, mode)?;
    // Guest memory, ACPI tables included, comes from the snapshot.
    let mut config = state.config.clone();
    config.prefault = false; // userfaultfd needs untouched memory; eager fills it anyway
                             // vCPUs are created (not yet given their state) while validation may still run.
    let created = create_base(kvm, &config, &PciOptions::default(), serial_out, &mut clock)
        .and_then(|base| {
            let ids = state.state.vcpus.iter().map(|saved| saved.id);
            let vcpus = create_vcpus(&base.kvm, &base.vm, ids, &base.devices)?;
            let threads = start_vcpu_threads(&vcpus)?;
            Ok((base, vcpus, threads))
        });
    clock.mark("create_vcpus");
    // The snapshot's own errors come first, as when validation ran before everything else.
    let (chain, working_set, parallel_validation) = validation.finish(&state, dir)?;
    clock.mark("memory_file_wait");
    let (mut base, mut vcpus, vcpu_threads) = created?;
    let loaded = state.with_chain(chain);
    let validated = started.elapsed();
    if hold_after_validation() {
        clock.mark("test_hold");
    }
    // Guest memory before any VM or vCPU state: setting some MSRs (kvmclock, steal time)
    // makes KVM touch guest pages, which must be registered with userfaultfd (or filled)
    // by then.
    let memory_started = Instant::now();
    let lazy = restore_memory(&base.ram, &loaded.chain, mode, working_set)?;
    let memory = memory_started.elapsed();
    clock.mark("memory");
    restore_vm_state(&mut base, &loaded)?;
    clock.mark("vm_state");
    for (vcpu, saved) in vcpus.iter_mut().zip(&loaded.state.vcpus) {
        vcpu.restore(saved).map_err(SnapshotError::from)?;
    }
    clock.mark("vcpu_state");
    let MachineBase {
        kvm,
        vm,
        ram,
        devices,
        pci: _,
    } = base;
    let mut machine = Machine::new(kvm, vm, ram, devices, vcpus, config);
    machine.vcpu_threads = vcpu_threads;
    machine.lazy = lazy;
    if let Some(last) = loaded.chain.layers().last() {
        machine.set_memory_chain(MemoryChain {
            dir: dir.to_path_buf(),
            files: loaded.state.memory_files.clone(),
            last: last.info(),
        });
    }
    let stages = clock.into_stages();
    let timings = RestoreTimings {
        validate: validated,
        memory,
        total_to_ready: stages.iter().map(|&(_, d)| d).sum(),
        stages,
        parallel: parallel_validation
            .map(|took| vec![("memory_file", took)])
            .unwrap_or_default(),
    };
    log_restore(dir, mode, &timings);
    Ok((machine, timings))
}

/// What [`validate_with_working_set`] gives.
type Validated = (Result<SnapshotChain, SnapshotError>, Vec<u64>);

/// The memory files' validation, on a second thread while KVM objects are created.
/// Nothing that depends on them happens before it is finished: guest RAM is neither
/// registered nor filled, no vCPU or VM state is set and no vCPU runs, so a bad file
/// still tears the half-built VM down (everything is dropped) before anything ran.
struct Validation {
    /// Whoever claims the validation does it: the thread, or the restore itself if the
    /// thread has not been scheduled by the time the KVM setup is done (on a loaded host
    /// a new thread can wait tens of milliseconds for a CPU).
    claimed: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Option<(Validated, std::time::Duration)>>,
    wants_working_set: bool,
}

impl Validation {
    fn start(
        state: &snapshot::LoadedState,
        dir: &Path,
        mode: &RestoreMode,
    ) -> Result<Validation, Error> {
        let inputs = state.chain_inputs();
        let wants_working_set = matches!(mode, RestoreMode::Lazy);
        let thread_dir = dir.to_path_buf();
        let claimed = Arc::new(AtomicBool::new(false));
        let thread_claim = claimed.clone();
        let thread = std::thread::Builder::new()
            .name("snapshot-validate".into())
            .spawn(move || {
                if thread_claim.swap(true, Ordering::AcqRel) {
                    return None;
                }
                let started = Instant::now();
                let checked = validate_with_working_set(&inputs, &thread_dir, wants_working_set);
                Some((checked, started.elapsed()))
            })
            .map_err(|e| {
                Error::Snapshot(SnapshotError::Uffd(UffdError::Io {
                    op: "spawn the snapshot validation thread",
                    source: e,
                }))
            })?;
        Ok(Validation {
            claimed,
            thread,
            wants_working_set,
        })
    }

    /// The validated chain, the working set, and how long the thread took if it did the
    /// work.
    fn finish(
        self,
        state: &snapshot::LoadedState,
        dir: &Path,
    ) -> Result<(SnapshotChain, Vec<u64>, Option<std::time::Duration>), SnapshotError> {
        let ((chain, working_set), took) = if self.claimed.swap(true, Ordering::AcqRel) {
            // The thread is validating (or has): wait for it.
            let (checked, took) =
                self.thread
                    .join()
                    .ok()
                    .flatten()
                    .ok_or_else(|| SnapshotError::Invalid {
                        dir: dir.to_path_buf(),
                        reason: "the memory-file validation thread failed".into(),
                    })?;
            (checked, Some(took))
        } else {
            // Not started yet: validate here. The thread, once it runs, finds the work
            // claimed and ends without touching anything.
            drop(self.thread);
            let checked =
                validate_with_working_set(&state.chain_inputs(), dir, self.wants_working_set);
            (checked, None)
        };
        Ok((chain?, working_set, took))
    }
}

/// The `memory` stage: fills guest RAM from `chain` (eager), or registers it for loading
/// on fault (lazy: the in-process loader; external: the handler's handshake).
fn restore_memory(
    ram: &GuestRam,
    chain: &Arc<SnapshotChain>,
    mode: &RestoreMode,
    working_set: Vec<u64>,
) -> Result<Option<LazyMemory>, SnapshotError> {
    let mappings = RamMappings::from_guest_ram(ram)?;
    Ok(match mode {
        RestoreMode::Eager => {
            let stats = restore_eager(chain, &mappings, &EagerOptions::default())?;
            log::info!(
                "eager restore: {} MiB in {:?}",
                stats.bytes >> 20,
                stats.elapsed
            );
            None
        }
        RestoreMode::Lazy => {
            if !working_set.is_empty() {
                log::info!(
                    "lazy restore: {} working-set blocks of {} KiB load first",
                    working_set.len(),
                    working_set::BLOCK >> 10
                );
            }
            let options = LazyOptions {
                // Only the working set loads before the vCPUs run; the sweep waits for
                // them (Machine::run releases it).
                hold_background: true,
                working_set,
                // The fault and loader threads run the VMM thread's filter.
                on_thread_start: crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
                ..LazyOptions::default()
            };
            Some(LazyMemory::InProcess(start_lazy_restore(
                chain.clone(),
                &mappings,
                options,
            )?))
        }
        RestoreMode::External(socket) => {
            let uffd = register_guest_ram(&mappings)?;
            let connection = send_handshake(socket, &mappings_for(&mappings), &uffd)?;
            // Keep our reference to the userfaultfd: if the handler dies, guest RAM is
            // fenced instead of silently reading as zero.
            let watch = HandlerWatch::start(
                connection,
                uffd,
                guest_ram_ranges(&mappings),
                crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
            )?;
            Some(LazyMemory::External(watch))
        }
    })
}

/// The `vm_state` stage: the emulated devices' state, then the in-kernel irqchip, PIT
/// and clock.
fn restore_vm_state(
    base: &mut MachineBase,
    loaded: &snapshot::LoadedSnapshot,
) -> Result<(), SnapshotError> {
    base.devices
        .restore(&loaded.state.devices)
        .map_err(|e| SnapshotError::Invalid {
            dir: loaded.dir.clone(),
            reason: e.to_string(),
        })?;
    InKernelDevices(&base.vm).restore(&loaded.state.vm)?;
    Ok(())
}

/// Logs a restore's stages, in microseconds.
fn log_restore(dir: &Path, mode: &RestoreMode, timings: &RestoreTimings) {
    log::info!(
        "restored {} ({mode:?}) in {:?}; stages (us):{}{}",
        dir.display(),
        timings.total_to_ready,
        timings
            .stages
            .iter()
            .map(|(name, d)| format!(" {name}={}", d.as_micros()))
            .collect::<String>(),
        timings
            .parallel
            .iter()
            .map(|(name, d)| format!(" parallel_{name}={}", d.as_micros()))
            .collect::<String>()
    );
}

/// Validates the memory chain and, for a lazy restore, reads the working set recorded for
/// it (advice: never an error), both off the restore's critical path when on the thread.
fn validate_with_working_set(
    inputs: &snapshot::ChainInputs,
    dir: &Path,
    wants_working_set: bool,
) -> (Result<SnapshotChain, SnapshotError>, Vec<u64>) {
    let chain = inputs.validate();
    let working_set = match (&chain, wants_working_set) {
        (Ok(chain), true) => chain
            .layers()
            .last()
            .map(|newest| working_set::read(dir, &newest.info().id))
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    (chain, working_set)
}

/// Test hook: `GPUVM_TEST_HOLD_AFTER_VALIDATION=<ms>` pauses a restore for that long right
/// after the snapshot was validated, so that end-to-end tests can change the files
/// behind gpuvm's back (truncate or corrupt a memory file) and check that the failure is
/// still caught cleanly. Logged at warn level so a test sees when to act.
/// Returns whether it held.
fn hold_after_validation() -> bool {
    const HOOK: &str = "GPUVM_TEST_HOLD_AFTER_VALIDATION";
    let Some(value) = std::env::var_os(HOOK) else {
        return false;
    };
    match value.to_str().and_then(|v| v.parse::<u64>().ok()) {
        Some(ms) => {
            log::warn!("{HOOK}: snapshot validated, holding {ms} ms");
            std::thread::sleep(std::time::Duration::from_millis(ms));
            log::warn!("{HOOK}: going on");
            true
        }
        None => {
            log::warn!("{HOOK} is not a number of milliseconds; ignored");
            false
        }
    }
}

/// Hands every RAM region to KVM as a memory slot.
fn register_memory(vm: &VmFd, ram: &GuestRam, track_dirty_pages: bool) -> Result<(), Error> {
    for (slot, (region, host)) in ram.host_regions().enumerate() {
        let memory_region = kvm_userspace_memory_region {
            slot: slot as u32,
            guest_phys_addr: region.guest_addr,
            memory_size: region.size,
            userspace_addr: host as u64,
            flags: if track_dirty_pages {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
        };
        // SAFETY: the host range is a live mapping owned by `ram`, which the Machine keeps
        // alive for as long as the VM fd (the VM is dropped first, see Machine's fields).
        unsafe { vm.set_user_memory_region(memory_region) }.map_err(|source| Error::KvmSetup {
            what: "register guest memory with KVM",
            source,
        })?;
    }
    Ok(())
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

fn create_devices(vm: &VmFd, serial_out: Box<dyn Write + Send>) -> Result<MachineDevices, Error> {
    let mut io_bus = Bus::new();

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
        io_bus: Arc::new(io_bus),
        mmio_bus: Arc::new(Bus::new()),
        serial,
        reset_evt,
        exit_evt,
        exit_status,
        passthrough: Vec::new(),
        event_sources: Vec::new(),
    })
}
