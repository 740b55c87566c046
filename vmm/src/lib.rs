//! gpuvm's virtual machine monitor: builds a KVM VM from a [`config::VmConfig`] and runs
//! it. The `gpuvm` binary (the `gpuvm-cli` crate, cli/) is a thin CLI over this crate.
//!
//! - [`action`]: [`action::VmmAction`], the one action type every front end (the
//!   `gpuvm-api` crate's routes, the CLI's config file) translates onto, and
//!   [`controller`], the VMM thread's side that carries actions out;
//!   [`action_channel::ActionSender`] is how a front end sends one and waits for its answer.
//! - [`builder`] turns a configuration into a [`machine::Machine`] (KVM VM, RAM, devices,
//!   kernel, vCPUs).
//! - [`machine`] runs it: vCPU threads and the VMM thread's event loop.
//! - [`vcpu`] is one vCPU thread and its exit handling.
//! - [`seccomp`] holds the seccomp filters of the vmm, vCPU and API threads.
//! - Snapshots: each component with state implements [`gpuvm_devices::Persist`] with its
//!   own `State` beside it ([`vcpu::VcpuState`], [`vm_state::VmState`], the devices');
//!   [`devices::DeviceStates`] is the one list of emulated devices a snapshot holds, and
//!   [`snapshot::MachineState`] the tree of all of them.
//! - The architecture (layout, boot protocols, ACPI, CPUID, MSRs, MP table) is in the
//!   `gpuvm-arch` crate ([`gpuvm_arch::x86_64`]).

pub mod action;
pub mod action_channel;
pub mod builder;
pub mod config;
pub mod controller;
pub mod devices;
pub mod dma;
pub mod fabric;
pub mod gpu_release;
pub mod host;
pub mod hotplug;
pub mod interrupts;
pub mod logging;
pub mod machine;
mod memslots;
pub mod metrics;
pub mod numa;
pub mod outputs;
pub mod p2p;
pub mod pci;
pub mod pci_topology;
pub mod persist;
pub mod seccomp;
pub mod snapshot;
pub mod update;
pub mod vcpu;
pub mod virtio;
pub mod vm_state;
pub mod working_set;

/// Locks `mutex`, carrying on if a thread panicked while holding it: device and VMM state
/// stays usable, and the panic has already been reported by its own thread.
pub(crate) fn lock<T: ?Sized>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub use machine::{GuestEnd, Machine, MemoryReport};

/// The exit statuses gpuvm chooses itself. Any other status is the guest's own (what it
/// wrote to the exit port), passed through unchanged; a guest may write any byte, so
/// these are values the test guest never uses and the usual runners give the same
/// meaning to (see the README's "Exit status").
pub mod exit_status {
    /// gpuvm itself failed (bad arguments or input, a host limit, a refused request),
    /// with a one-line `gpuvm: error: ...`: 125, as `docker run`, `env`, `timeout` and
    /// `chroot` report that the runner failed rather than what it ran.
    pub const GPUVM_ERROR: u8 = 125;
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN): it crashed beyond recovery, e.g.
    /// restored from a damaged state. Below 125 so that `timeout`'s 124 stays its own.
    pub const TRIPLE_FAULT: u8 = 123;
    /// A seccomp filter blocked a system call (Firecracker's status for the same).
    pub const SECCOMP_VIOLATION: u8 = crate::seccomp::VIOLATION_EXIT_CODE as u8;
}

/// Everything that can go wrong building or running a VM, each with enough context to
/// be the one line the user reads.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{hint} ({source})")]
    Kvm {
        hint: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM failed to {what}: {source}")]
    KvmSetup {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("invalid vCPU count {requested}: this host allows 1 to {max}")]
    VcpuCount { requested: u8, max: u8 },
    #[error(
        "guest RAM ({} KiB) is too small: gpuvm puts its boot structures in the first 1 MiB and the kernel above it",
        .size >> 10
    )]
    MemoryTooSmall { size: u64 },
    #[error(
        "guest RAM needs {needed} KVM memory slots of at most {}, more than the {reserved} gpuvm keeps for boot RAM",
        gpuvm_memory::ByteSize(*.slot_size)
    )]
    TooManyRamSlots {
        needed: u64,
        reserved: u32,
        slot_size: u64,
    },
    #[error(
        "{}={value:?} is not a KVM memory slot size: {reason}",
        builder::TEST_MAX_SLOT_VAR
    )]
    TestMaxSlot { value: String, reason: String },
    #[error(transparent)]
    Memory(#[from] gpuvm_memory::RamError),
    #[error(transparent)]
    Prefault(#[from] gpuvm_memory::PrefaultError),
    #[error(transparent)]
    Boot(#[from] gpuvm_arch::x86_64::boot::BootError),
    #[error(transparent)]
    MpTable(#[from] gpuvm_arch::x86_64::mptable::MpTableError),
    #[error(transparent)]
    ResetVector(#[from] gpuvm_arch::x86_64::reset_vector::ResetVectorError),
    #[error(transparent)]
    Acpi(#[from] gpuvm_arch::x86_64::acpi::AcpiError),
    #[error(transparent)]
    Vcpu(#[from] vcpu::VcpuError),
    #[error("cannot place a device: {0}")]
    Bus(gpuvm_devices::BusError),
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("VMM event loop failed: {0:?}")]
    EventManager(event_manager::Error),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error("this VM has already run")]
    AlreadyRan,
    #[error(transparent)]
    Pci(#[from] pci::PciSetupError),
    #[error("cannot read this process's memory use: {0}")]
    ProcStatus(std::io::Error),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    #[error(transparent)]
    Numa(#[from] numa::NumaError),
}
