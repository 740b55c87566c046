//! Restoring a machine from a snapshot directory: a pipeline of named stages, sharing
//! the VM, RAM, device and vCPU stages with a boot (see [`restore`]).

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use gpuvm_devices::Persist;
use gpuvm_memory::snapshot::{restore_eager, EagerOptions, RamMappings, SnapshotChain};
use gpuvm_memory::uffd::external::{mappings_for, send_handshake, HandlerWatch};
use gpuvm_memory::uffd::{
    guest_ram_ranges, register_guest_ram, start_lazy_restore, LazyOptions, UffdError,
};
use gpuvm_memory::GuestRam;

use super::{create_base, create_vcpus, spare_vcpu_threads, start_vcpu_threads, MachineBase};
use crate::action::LoadOverrides;
use crate::config::PciOptions;
use crate::host::open_kvm;
use crate::machine::{LazyMemory, Machine, RamHotplug};
use crate::snapshot::{self, MemoryChain, RestoreMode, RestoreTimings, SnapshotError, StageClock};
use crate::virtio::{DeviceResources, VirtioOptions, VirtioSetupError};
use crate::vm_state::InKernelDevices;
use crate::working_set;
use crate::Error;
use gpuvm_devices::memory_hotplug::MEMORY_BLOCK_SIZE;

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
    restore_with_gpus(dir, mode, serial_out, &[], &DeviceResources::default())
}

/// As [`restore`], opening the GPUs whose state the snapshot holds where `gpus` says
/// (by `gpu_id`) instead of where the snapshot says they were; network interfaces that
/// came as tap descriptors take new ones from `taps` (Cloud Hypervisor's `net_fds`).
pub fn restore_with_gpus(
    dir: &Path,
    mode: &RestoreMode,
    serial_out: Box<dyn Write + Send>,
    gpus: &[crate::action::GpuBody],
    taps: &DeviceResources,
) -> Result<(Machine, RestoreTimings), Error> {
    let none = LoadOverrides::default();
    restore_with_overrides(dir, mode, serial_out, gpus, taps, &none)
}

/// As [`restore_with_gpus`], changing what `overrides` says in the restored VM: dirty-page
/// tracking on, network interfaces on new taps, the vsock device on a new socket path.
pub fn restore_with_overrides(
    dir: &Path,
    mode: &RestoreMode,
    serial_out: Box<dyn Write + Send>,
    gpus: &[crate::action::GpuBody],
    taps: &DeviceResources,
    overrides: &LoadOverrides,
) -> Result<(Machine, RestoreTimings), Error> {
    let started = Instant::now();
    let mut clock = StageClock::starting_at(started);
    let kvm = open_kvm()?;
    clock.mark("open_kvm");
    // Not while another process writes a snapshot there; held until the restore is set up.
    let _reading = snapshot::SnapshotDirLock::shared(dir)?;
    let state = snapshot::load_state(dir, |size| crate::host::ram_regions(&kvm, size))?;
    clock.mark("state");
    let validation = Validation::start(&state, dir, mode)?;
    // Guest memory, ACPI tables included, comes from the snapshot.
    let mut config = state.config.clone();
    // userfaultfd needs untouched memory; eager fills it anyway.
    config.prefault = false;
    config.track_dirty_pages |= overrides.track_dirty_pages;
    // The virtio devices the snapshot holds, rebuilt from their saved configuration.
    let mut virtio = crate::virtio::options_of(&state.state.devices.virtio);
    apply_load_overrides(&mut virtio, overrides).map_err(crate::pci::PciSetupError::from)?;
    // vCPU hot-plug: as many possible vCPUs as at boot (the CPU hot-plug block's state
    // says which are present; the snapshot has the state of those).
    let max_vcpus = state
        .state
        .devices
        .cpu_hotplug
        .as_ref()
        .map_or(0, |cpus| cpus.max_vcpus);
    let ram_hotplug_size = saved_ram_hotplug_size(&state.state, dir)?;
    let pci = PciOptions {
        virtio,
        device_resources: taps.clone(),
        max_vcpus,
        // Where the snapshot's guest has its 64-bit BAR window (older states: the fixed
        // window of the builds that wrote them, whatever this host would plan).
        mmio64_window: (state.state.devices.pci_mmio64_window).or_else(|| {
            // Those builds laid RAM out in at most two regions, on any host.
            let regions = gpuvm_arch::x86_64::layout::ram_regions(state.config.memory_size);
            Some(crate::pci::unplanned_mmio64_window(
                regions.iter().map(|r| r.end()).max(),
                ram_hotplug_size,
            ))
        }),
        // Its slot and BAR allocations (older states: rebuilt from the devices' places).
        pci_root: state.state.devices.pci_root.clone(),
        num_pci_segments: saved_segment_count(&state.state.devices),
        // Memory hot-plug's room, with the RAM plugged into it before the snapshot.
        ram_hotplug_size,
        // The snapshot's NUMA nodes: each node's RAM bound to its host node again.
        numa: state
            .state
            .numa
            .as_ref()
            .map(crate::numa::SavedNumaPlan::options)
            .unwrap_or_default(),
        ..PciOptions::default()
    };
    let max_vcpus = pci.max_vcpus(&config);
    // vCPUs are created (not yet given their state) while validation may still run.
    let created = create_base(kvm, &config, &pci, serial_out, &mut clock).and_then(|base| {
        let ids: Vec<u8> = state.state.vcpus.iter().map(|saved| saved.id).collect();
        let vcpus = create_vcpus(&base.kvm, &base.vm, ids.iter().copied(), &base.devices)?;
        let mut threads = start_vcpu_threads(&vcpus, &base.numa)?;
        let absent = (0..max_vcpus).filter(|id| !ids.contains(id));
        threads.extend(spare_vcpu_threads(absent, &base.numa)?);
        let template = hotplug_template(&base, &config, &vcpus, max_vcpus)?;
        Ok((base, vcpus, (threads, template)))
    });
    clock.mark("create_vcpus");
    // The snapshot's own errors come first, as when validation ran before everything else.
    let (chain, working_set, parallel_validation) = validation.finish(&state, dir)?;
    clock.mark("memory_file_wait");
    let (mut base, mut vcpus, (vcpu_threads, vcpu_template)) = created?;
    let loaded = state.with_chain(chain);
    let validated = started.elapsed();
    if hold_after_validation() {
        clock.mark("test_hold");
    }
    // Guest memory before any VM or vCPU state: setting some MSRs (kvmclock, steal time)
    // makes KVM touch guest pages, which must be registered with userfaultfd (or filled)
    // by then.
    let memory_started = Instant::now();
    let ram_hotplug = restore_ram_hotplug(&mut base, &loaded, config.track_dirty_pages)?;
    let mut rams = vec![&base.ram];
    rams.extend(ram_hotplug.iter().flat_map(|hotplug| hotplug.plugged()));
    let lazy = restore_memory(&rams, &loaded.chain, mode, working_set)?;
    let memory = memory_started.elapsed();
    clock.mark("memory");
    restore_vm_state(&mut base, &loaded)?;
    clock.mark("vm_state");
    restore_root_ports(&mut base, &loaded.state.devices, &loaded.dir)?;
    if !loaded.state.devices.migrated_gpus.is_empty() || !gpus.is_empty() {
        restore_passthrough(&mut base, &loaded, lazy.as_ref(), gpus)?;
        clock.mark("passthrough");
    }
    // Every function the saved PCI allocations hold must be back in its slot by now.
    if let Some(hotplug) = &base.devices.pci_hotplug {
        hotplug
            .finish_root_restore()
            .map_err(|e| SnapshotError::Invalid {
                dir: loaded.dir.clone(),
                reason: e.to_string(),
            })?;
    }
    for (vcpu, saved) in vcpus.iter_mut().zip(&loaded.state.vcpus) {
        vcpu.restore(saved).map_err(SnapshotError::from)?;
    }
    clock.mark("vcpu_state");
    let MachineBase {
        kvm,
        vm,
        ram,
        ram_hotplug_area: _,
        devices,
        pci: _,
        numa,
    } = base;
    let mut machine = Machine::new(kvm, vm, ram, devices, vcpus, config);
    machine.numa = numa;
    machine.vcpu_threads = vcpu_threads;
    machine.max_vcpus = max_vcpus;
    machine.vcpu_template = vcpu_template;
    machine.lazy = lazy;
    machine.ram_hotplug = ram_hotplug;
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

/// How many PCI segments the saved VM had, where its state says (each segment after 0
/// saves its hot-plug registers): a segment with no device at save time is rebuilt too,
/// since the guest's ACPI tables describe it. 0 (older states): as many as the devices'
/// segments need.
fn saved_segment_count(devices: &crate::devices::DeviceStates) -> u16 {
    match devices.pci_segment_hotplug.len() {
        0 => 0,
        further => u16::try_from(further + 1).unwrap_or(u16::MAX),
    }
}

/// The PCI options that rebuild the devices a live update's `state` holds, as
/// [`restore_with_overrides`] rebuilds a snapshot's: its virtio devices from their saved
/// configuration, vCPU hot-plug, the 64-bit BAR window, the PCI root's allocations and the
/// NUMA nodes.
fn handed_over_pci_options(state: &snapshot::MachineState) -> PciOptions {
    PciOptions {
        virtio: crate::virtio::options_of(&state.devices.virtio),
        max_vcpus: state
            .devices
            .cpu_hotplug
            .as_ref()
            .map_or(0, |cpus| cpus.max_vcpus),
        mmio64_window: state.devices.pci_mmio64_window,
        pci_root: state.devices.pci_root.clone(),
        num_pci_segments: saved_segment_count(&state.devices),
        saved_segments: state.devices.handed_over_pci_segments.clone(),
        numa: state
            .numa
            .as_ref()
            .map(crate::numa::SavedNumaPlan::options)
            .unwrap_or_default(),
        ..PciOptions::default()
    }
}

/// A machine built for a live update over the guest RAM the old process handed over,
/// with its devices and vCPUs, before any state is loaded: built while the old process
/// still runs the guest (nothing of it touches guest RAM or runs), so that the pause covers
/// only saving and loading the state ([`PreparedMachine::load`]).
pub struct PreparedMachine {
    base: MachineBase,
    vcpus: Vec<crate::vcpu::Vcpu>,
    vcpu_threads: Vec<crate::vcpu::VcpuThread>,
    vcpu_template: Option<crate::vcpu::VcpuTemplate>,
    config: crate::config::MachineConfig,
    max_vcpus: u8,
    clock: StageClock,
}

/// Builds the VM of a live update's `state` (its configuration and devices; its vCPU
/// states may be absent) with vCPUs `vcpu_ids`, over `memfd` (on the huge-page tmpfs if
/// `huge_tmpfs`): a restore's stages without a snapshot directory, nothing read into RAM.
/// Its drives and network interfaces take the descriptors the old process handed over
/// (`resources`) instead of opening their images and taps again.
pub fn prepare_handed_over(
    state: &snapshot::MachineState,
    vcpu_ids: &[u8],
    memfd: std::fs::File,
    huge_tmpfs: bool,
    serial_out: Box<dyn Write + Send>,
    resources: &DeviceResources,
) -> Result<PreparedMachine, Error> {
    let source = Path::new("(live update)");
    let mut clock = StageClock::starting_at(Instant::now());
    let kvm = open_kvm()?;
    clock.mark("open_kvm");
    let mut config = state.config.to_config(source)?;
    config.prefault = false;
    if vcpu_ids.len() != usize::from(config.vcpus)
        || config.vcpus == 0
        || vcpu_ids
            .iter()
            .enumerate()
            .any(|(i, &id)| usize::from(id) != i)
    {
        return Err(SnapshotError::Invalid {
            dir: source.to_path_buf(),
            reason: format!("vCPUs {vcpu_ids:?} for {} configured vCPUs", config.vcpus),
        }
        .into());
    }
    let mut pci = handed_over_pci_options(state);
    pci.device_resources = resources.clone();
    // Memory hot-plug's room, over the same bytes of the handed-over file.
    pci.ram_hotplug_size = saved_ram_hotplug_size(state, source)?;
    let max_vcpus = pci.max_vcpus(&config);
    let base = super::create_base_over(
        kvm,
        Some((memfd, huge_tmpfs)),
        &config,
        &pci,
        serial_out,
        &mut clock,
    )?;
    let vcpus = create_vcpus(&base.kvm, &base.vm, vcpu_ids.iter().copied(), &base.devices)?;
    let mut vcpu_threads = start_vcpu_threads(&vcpus, &base.numa)?;
    vcpu_threads.extend(spare_vcpu_threads(
        (0..max_vcpus).filter(|id| !vcpu_ids.contains(id)),
        &base.numa,
    )?);
    let vcpu_template = hotplug_template(&base, &config, &vcpus, max_vcpus)?;
    clock.mark("create_vcpus");
    Ok(PreparedMachine {
        base,
        vcpus,
        vcpu_threads,
        vcpu_template,
        config,
        max_vcpus,
        clock,
    })
}

impl PreparedMachine {
    /// Loads `state` (saved with the vCPUs paused; built from the same configuration and
    /// devices as the one this was prepared with) and gives the machine; its vCPUs run once
    /// [`Machine::run`] is called. The old process's vfio-user and kernel VFIO devices are
    /// plugged back over their handed-over connections and descriptors (`vfio_user` in the
    /// state's order, `kernel_vfio`); the vsock device serves the old one's connections
    /// over their sockets (`vsock_sockets`, in the state's order). The timings
    /// have the stages of the preparation, then `wait_for_state` (from the end of the
    /// preparation to this call), `vm_state`, `passthrough` and `vcpu_state`.
    pub fn load(
        mut self,
        state: &snapshot::MachineState,
        (vfio_user, kernel_vfio, hot_kernel_vfio): (
            Vec<crate::update::passthrough::IncomingVfioUser>,
            Option<crate::update::kernel_vfio::IncomingKernelVfio>,
            Vec<crate::update::kernel_vfio::IncomingKernelVfio>,
        ),
        vsock_sockets: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(Machine, RestoreTimings), Error> {
        let source = Path::new("(live update)");
        self.clock.mark("wait_for_state");
        let ids: Vec<u8> = state.vcpus.iter().map(|saved| saved.id).collect();
        let built: Vec<u8> = self.vcpus.iter().map(|vcpu| vcpu.id).collect();
        if ids != built {
            return Err(SnapshotError::Invalid {
                dir: source.to_path_buf(),
                reason: format!("vCPU states for {ids:?}, vCPUs {built:?} built"),
            }
            .into());
        }
        // Hot-plugged RAM before the devices' state, as a restore does: the register
        // block's slots get their state with the other devices.
        let ram_hotplug = adopt_ram_hotplug(&mut self.base, state, self.config.track_dirty_pages)
            .map_err(|reason| SnapshotError::Invalid {
            dir: source.to_path_buf(),
            reason,
        })?;
        if ram_hotplug.is_some() {
            self.clock.mark("ram_hotplug");
        }
        // The old process's vsock connections, before the device's state activates it.
        if let Some(live) = &state.devices.handed_over_vsock {
            let mut sockets = Some(vsock_sockets);
            let adopted = (self.base.devices.virtio.iter()).find_map(|handle| {
                handle.with_device(|vsock: &mut gpuvm_virtio::vsock::Vsock| {
                    vsock.adopt_connections(live.clone(), sockets.take().unwrap_or_default())
                })
            });
            if adopted.is_none() {
                return Err(SnapshotError::Invalid {
                    dir: source.to_path_buf(),
                    reason: "the state has vsock connections and the VM no vsock device".into(),
                }
                .into());
            }
        }
        load_vm_state(&mut self.base, state, source)?;
        if let (Some(parts), Some(saved)) =
            (&self.base.devices.handover.plug, &state.devices.pci_root)
        {
            parts.root.load_config_address(saved);
        }
        self.clock.mark("vm_state");
        restore_root_ports(&mut self.base, &state.devices, source)?;
        // The old process's vfio-user devices, over its connections, back in their slots.
        crate::update::passthrough::plug_handed_over(
            &self.base.vm,
            &self.base.ram,
            &mut self.base.devices,
            (
                &state.devices.handed_over_vfio_user,
                &state.devices.handed_over_peer_mappings,
            ),
            vfio_user,
        )
        .and_then(|()| {
            // The old process's kernel VFIO devices, over its iommufd and cdevs.
            let plugged = ram_hotplug.iter().flat_map(|hotplug| hotplug.plugged());
            let all_ram = crate::dma::RamChunks::regions_of_all(&self.base.ram, plugged);
            crate::update::kernel_vfio::plug_handed_over(
                &self.base.vm,
                (&self.base.ram, &all_ram),
                &mut self.base.devices,
                state.devices.handed_over_kernel_vfio.as_ref(),
                kernel_vfio,
            )?;
            // The hot-plugged ones, each over its own context, back into their hot-plug
            // slots.
            crate::update::kernel_vfio::plug_hot_handed_over(
                &mut self.base.devices,
                &all_ram,
                &state.devices.handed_over_hot_kernel_vfio,
                hot_kernel_vfio,
            )
        })
        .map(|()| crate::update::passthrough::finish_peer_adoption(&self.base.devices))
        .map_err(|reason| SnapshotError::Invalid {
            dir: source.to_path_buf(),
            reason,
        })?;
        self.clock.mark("passthrough");
        // As after a snapshot's restore: every function the saved PCI allocations hold is
        // back in its slot (and the root leaves its restore mode).
        if let Some(hotplug) = &self.base.devices.pci_hotplug {
            hotplug
                .finish_root_restore()
                .map_err(|e| SnapshotError::Invalid {
                    dir: source.to_path_buf(),
                    reason: e.to_string(),
                })?;
        }
        for (vcpu, saved) in self.vcpus.iter_mut().zip(&state.vcpus) {
            vcpu.restore(saved).map_err(SnapshotError::from)?;
        }
        self.clock.mark("vcpu_state");
        let MachineBase {
            kvm,
            vm,
            ram,
            devices,
            numa,
            ..
        } = self.base;
        let mut machine = Machine::new(kvm, vm, ram, devices, self.vcpus, self.config);
        machine.numa = numa;
        machine.vcpu_threads = self.vcpu_threads;
        machine.max_vcpus = self.max_vcpus;
        machine.vcpu_template = self.vcpu_template;
        machine.ram_hotplug = ram_hotplug;
        let stages = self.clock.into_stages();
        let timings = RestoreTimings {
            total_to_ready: stages.iter().map(|&(_, d)| d).sum(),
            stages,
            ..RestoreTimings::default()
        };
        Ok((machine, timings))
    }
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
    rams: &[&GuestRam],
    chain: &Arc<SnapshotChain>,
    mode: &RestoreMode,
    working_set: Vec<u64>,
) -> Result<Option<LazyMemory>, SnapshotError> {
    let mappings = RamMappings::from_guest_rams(rams)?;
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

/// The room for hot-plugged RAM a snapshot's VM had (0: none), checked as the API checks
/// it: a state file is input like any other.
fn saved_ram_hotplug_size(
    state: &snapshot::MachineState,
    dir: &Path,
) -> Result<u64, SnapshotError> {
    let Some(saved) = &state.devices.ram_hotplug else {
        return Ok(0);
    };
    let size = saved.hotplug_size;
    let limit = crate::action::MAX_MEM_SIZE_MIB << 20;
    if size == 0 || !size.is_multiple_of(MEMORY_BLOCK_SIZE) || size > limit {
        return Err(SnapshotError::Invalid {
            dir: dir.to_path_buf(),
            reason: format!(
                "its memory hot-plug size {size} is not a non-zero multiple of {} MiB up to \
                 {} MiB",
                MEMORY_BLOCK_SIZE >> 20,
                limit >> 20
            ),
        });
    }
    Ok(size)
}

/// Memory hot-plug of the restored VM: the RAM its snapshot had plugged, plugged again at
/// the same places (KVM slots, and the passthrough devices' DMA mapping of it, before
/// any of them is restored), ready for the memory file to fill. None without memory
/// hot-plug.
fn restore_ram_hotplug(
    base: &mut MachineBase,
    loaded: &snapshot::LoadedSnapshot,
    dirty_log: bool,
) -> Result<Option<RamHotplug>, SnapshotError> {
    let Some(saved) = &loaded.state.devices.ram_hotplug else {
        return Ok(None);
    };
    let invalid = |reason: String| SnapshotError::Invalid {
        dir: loaded.dir.clone(),
        reason,
    };
    let (Some(area), Some(block)) = (
        base.ram_hotplug_area.take(),
        base.devices.memory_hotplug.clone(),
    ) else {
        return Err(invalid(
            "its memory hot-plug could not be set up again".into(),
        ));
    };
    let hotplug = RamHotplug::restore(&base.vm, area, saved, block, dirty_log)
        .map_err(|e| invalid(format!("its hot-plugged RAM: {e}")))?;
    if let Some(pci_hotplug) = base.devices.pci_hotplug.as_mut() {
        for ram in hotplug.plugged() {
            pci_hotplug.add_ram(ram);
        }
    }
    Ok(Some(hotplug))
}

/// Memory hot-plug of a live update's VM: the slots of `state` (saved paused) plugged
/// again over the RAM the old process handed over, which holds their pages already (KVM
/// slots, and the record PCI hot-plug keeps for GPUs plugged later; the cold-plugged
/// vfio-user devices have them mapped already). None without memory hot-plug.
fn adopt_ram_hotplug(
    base: &mut MachineBase,
    state: &snapshot::MachineState,
    dirty_log: bool,
) -> Result<Option<RamHotplug>, String> {
    let Some(saved) = &state.devices.ram_hotplug else {
        return Ok(None);
    };
    let (Some(area), Some(block)) = (
        base.ram_hotplug_area.take(),
        base.devices.memory_hotplug.clone(),
    ) else {
        return Err("its memory hot-plug could not be set up again".into());
    };
    let hotplug = RamHotplug::adopt(&base.vm, area, saved, block, dirty_log)
        .map_err(|e| format!("its hot-plugged RAM: {e}"))?;
    if let Some(pci_hotplug) = base.devices.pci_hotplug.as_mut() {
        for ram in hotplug.plugged() {
            pci_hotplug.add_ram(ram);
        }
    }
    Ok(Some(hotplug))
}

/// The `vm_state` stage: the emulated devices' state, then the in-kernel irqchip, PIT
/// and clock.
/// How vCPUs hot-plugged into the restored VM are made, if it may have more than it has:
/// as at boot (its saved vCPUs bring their own CPUID), with the topology of every
/// possible vCPU.
fn hotplug_template(
    base: &MachineBase,
    config: &crate::config::MachineConfig,
    vcpus: &[crate::vcpu::Vcpu],
    max_vcpus: u8,
) -> Result<Option<crate::vcpu::VcpuTemplate>, Error> {
    let Some(first) = vcpus.first() else {
        return Ok(None);
    };
    if usize::from(max_vcpus) <= vcpus.len() {
        return Ok(None);
    }
    let supported_cpuid =
        crate::host::supported_cpuid(&base.kvm).map_err(|source| Error::KvmSetup {
            what: "read supported CPUID",
            source,
        })?;
    Ok(Some(crate::vcpu::VcpuTemplate {
        supported_cpuid,
        topology: gpuvm_arch::x86_64::cpuid::Topology {
            vcpu_count: max_vcpus,
        },
        masks: config.cpuid_masks.clone(),
        msr_indices: first.msr_indices(),
    }))
}

fn restore_vm_state(
    base: &mut MachineBase,
    loaded: &snapshot::LoadedSnapshot,
) -> Result<(), SnapshotError> {
    load_vm_state(base, &loaded.state, &loaded.dir)
}

/// [`restore_vm_state`] for a state from anywhere; `source` names it in errors.
fn load_vm_state(
    base: &mut MachineBase,
    state: &snapshot::MachineState,
    source: &Path,
) -> Result<(), SnapshotError> {
    base.devices
        .restore(&state.devices)
        .map_err(|e| SnapshotError::Invalid {
            dir: source.to_path_buf(),
            reason: e.to_string(),
        })?;
    InKernelDevices(&base.vm).restore(&state.vm)?;
    Ok(())
}

/// Says a chunk of restored RAM is ready for a device's DMA once the lazy restore has
/// loaded all of it (whole-restore granularity: simple, and a device rarely waits long,
/// since the loader streams everything in the background).
struct LazyLoaded(gpuvm_memory::uffd::LazyCompletion);

impl gpuvm_vfio::dma::ChunkReady for LazyLoaded {
    fn wait_ready(&self, _chunk: &gpuvm_vfio::DmaRegion) -> bool {
        match self.0.wait() {
            Ok(()) => true,
            Err(error) => {
                log::error!("no DMA mapping for restored devices: {error}");
                false
            }
        }
    }
}

/// Rebuilds the saved PCIe ports in their places, before the devices in and behind them
/// come back: the root ports for hot-plug (crate::pci_topology::SavedHotplugPort) and the
/// ports of a host-mirroring layout (crate::pci_topology::SavedTopologyPort), after
/// checking them against each other and the segment's windows (a damaged or hostile
/// state is refused naming the port, before any is built).
fn restore_root_ports(
    base: &mut MachineBase,
    saved: &crate::devices::DeviceStates,
    dir: &Path,
) -> Result<(), SnapshotError> {
    let invalid = |reason: String| SnapshotError::Invalid {
        dir: dir.to_path_buf(),
        reason,
    };
    restore_segment_ports(base, saved).map_err(invalid)?;
    if saved.pcie_root_ports.is_empty() && saved.pci_topology_ports.is_empty() {
        return Ok(());
    }
    crate::pci_topology::check_saved_state(saved).map_err(|e| invalid(e.to_string()))?;
    // Their windows are taken in the saved allocations' bookkeeping, which comes with them.
    let root = (base.devices.handover.plug.as_ref()).map(|plug| plug.root.clone());
    let (Some(hotplug), Some(root)) = (
        (base.devices.pci_hotplug.as_mut()).filter(|_| saved.pci_root.is_some()),
        root,
    ) else {
        return Err(invalid(
            "it has PCIe ports but no saved PCI allocations".into(),
        ));
    };
    hotplug
        .restore_root_ports(&saved.pcie_root_ports)
        .map_err(|e| invalid(e.to_string()))?;
    crate::pci_topology::restore_topology_ports(&root, &saved.pci_topology_ports)
        .map_err(|e| invalid(e.to_string()))
}

/// A live update's segments 1..: the ports of their host-mirroring layouts, checked
/// against each segment's windows and bus-0 slots, rebuilt in place.
fn restore_segment_ports(
    base: &MachineBase,
    saved: &crate::devices::DeviceStates,
) -> Result<(), String> {
    let roots = (base.devices.handover.plug.as_ref()).map_or(&[][..], |plug| &plug.segments);
    for (index, segment) in saved.handed_over_pci_segments.iter().enumerate() {
        if segment.topology_ports.is_empty() {
            continue;
        }
        let number = index + 1;
        let root =
            (roots.get(index)).ok_or_else(|| format!("the VM has no PCI segment {number}"))?;
        crate::pci_topology::check_saved_ports(
            crate::pci_topology::SegmentWindows::of_state(&segment.root),
            &segment.root.slots,
            &[],
            &segment.topology_ports,
            &[],
        )
        .and_then(|()| crate::pci_topology::restore_topology_ports(root, &segment.topology_ports))
        .map_err(|e| format!("PCI segment {number}: {e}"))?;
    }
    Ok(())
}

/// The `passthrough` stage: hot-plugged devices whose state the snapshot holds are
/// plugged back with it (crate::hotplug::migration), DMA-mapped once RAM is filled.
fn restore_passthrough(
    base: &mut MachineBase,
    loaded: &snapshot::LoadedSnapshot,
    lazy: Option<&LazyMemory>,
    moved: &[crate::action::GpuBody],
) -> Result<(), SnapshotError> {
    let mut saved = loaded.state.devices.migrated_gpus.clone();
    for body in moved {
        let Some(gpu) = saved.iter_mut().find(|gpu| gpu.gpu_id == body.gpu_id) else {
            return Err(SnapshotError::Invalid {
                dir: loaded.dir.clone(),
                reason: format!(
                    "gpus names {}, which is not a GPU whose state the snapshot holds",
                    body.gpu_id
                ),
            });
        };
        gpu.host_bdf = body.host_bdf.clone();
        gpu.vfio_user_socket = body.vfio_user_socket.clone();
    }
    let ready: Arc<dyn gpuvm_vfio::dma::ChunkReady> = match lazy {
        None => Arc::new(gpuvm_vfio::dma::AllReady),
        Some(LazyMemory::InProcess(restore)) => Arc::new(LazyLoaded(restore.completion())),
        Some(LazyMemory::External(_)) => {
            return Err(SnapshotError::Invalid {
                dir: loaded.dir.clone(),
                reason: "the snapshot holds passthrough devices' state: restore it eagerly or \
                         lazily (an external page-fault handler does not say when guest RAM is \
                         filled, which a device must wait for before its DMA)"
                    .into(),
            })
        }
    };
    let Some(hotplug) = base.devices.pci_hotplug.as_mut() else {
        return Err(SnapshotError::Invalid {
            dir: loaded.dir.clone(),
            reason: "the snapshot holds passthrough devices, but this VM has no PCI bus".into(),
        });
    };
    hotplug.restore_migrated(&saved, &loaded.dir, ready)?;
    // The restored devices are passthrough devices like any hot-plugged one.
    base.devices.passthrough.extend(hotplug.labels());
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

/// Changes the devices a snapshot saved as a load's `overrides` say: interfaces named in
/// `network_overrides` open their new tap (by name), the vsock device listens on the new
/// path. An interface the snapshot does not have is refused, naming every such id.
fn apply_load_overrides(
    options: &mut VirtioOptions,
    overrides: &LoadOverrides,
) -> Result<(), VirtioSetupError> {
    let unknown: Vec<&str> = overrides
        .network_overrides
        .iter()
        .filter(|o| !options.nets.iter().any(|n| n.iface_id == o.iface_id))
        .map(|o| o.iface_id.as_str())
        .collect();
    if !unknown.is_empty() {
        return Err(VirtioSetupError::Invalid(format!(
            "network_overrides: the snapshot has no network interface {}",
            unknown
                .iter()
                .map(|id| format!("{id:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    for over in &overrides.network_overrides {
        for net in options
            .nets
            .iter_mut()
            .filter(|n| n.iface_id == over.iface_id)
        {
            net.host_dev_name = Some(over.host_dev_name.clone());
            net.validate().map_err(|e| VirtioSetupError::Net {
                id: over.iface_id.clone(),
                message: e.to_string(),
            })?;
        }
    }
    if let Some(path) = &overrides.vsock_uds_path {
        let Some(vsock) = options.vsock.as_mut() else {
            return Err(VirtioSetupError::Vsock(
                "vsock_override: the snapshot has no vsock device".into(),
            ));
        };
        vsock.uds_path = path.clone();
        vsock
            .validate()
            .map_err(|e| VirtioSetupError::Vsock(e.to_string()))?;
    }
    Ok(())
}
