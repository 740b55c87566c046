//! vCPUs: one thread each, running KVM_RUN and dispatching exits to the device buses.
//!
//! The VMM thread steers a vCPU thread through a [`VcpuHandle`]: it sets what it wants
//! of the thread (run, pause, stop) in state they share, and kicks the thread out of
//! KVM_RUN with a signal. The thread acts on the latest wish between KVM_RUN calls and
//! says what it is doing in the same state, so a wish is idempotent, a wish that is
//! withdrawn before the thread looked is never acted on, and no answer is left over for
//! a later request to mistake for its own. The signal handler sets
//! `kvm_run.immediate_exit`, so a kick that lands just before the thread re-enters
//! KVM_RUN is not lost (KVM_RUN returns EINTR at once).

use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use gpuvm_arch::x86_64::cpuid::{self, CpuidMask, Topology};
use gpuvm_arch::x86_64::msr;
use gpuvm_arch::x86_64::regs::{self, EntryPoint};
use gpuvm_devices::Bus;
use kvm_bindings::CpuId;
use kvm_ioctls::VcpuFd;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::persist::PersistError;
use crate::seccomp::SeccompError;

mod control;
mod kick;
mod state;
mod thread;
#[cfg(test)]
mod thread_tests;
pub use control::{pause_all, resume_all, stop_all, VcpuHandle};
pub use state::{saved_msr_indices, VcpuState};
pub use thread::{name_threads_as_firecracker, VcpuThread};

const LAPIC_LVT_LINT0: usize = 0x350;
const LAPIC_LVT_LINT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7;
const APIC_MODE_NMI: u32 = 0x4;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("failed to create vCPU {id}: {source}")]
    Create { id: u8, source: kvm_ioctls::Error },
    #[error("vCPU {id}: failed to {what}: {source}")]
    Setup {
        id: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {id}: {source}")]
    BootRegs { id: u8, source: regs::RegsError },
    #[error("vCPU {id}: KVM_RUN failed: {source}")]
    Run { id: u8, source: kvm_ioctls::Error },
    #[error("vCPU {id}: the guest executed an instruction this host's KVM cannot emulate at rip {rip:#x}: bytes [{bytes}]")]
    UnemulatedInstruction { id: u8, rip: u64, bytes: String },
    #[error("vCPU {id}: KVM internal error, suberror {suberror}")]
    Internal { id: u8, suberror: u32 },
    #[error("vCPU {id}: hardware failed to enter the guest (reason {reason:#x})")]
    FailEntry { id: u8, reason: u64 },
    #[error("vCPU {id}: unexpected exit {exit}")]
    UnexpectedExit { id: u8, exit: String },
    #[error("cannot start vCPU thread {id}: {source}")]
    Spawn { id: u8, source: std::io::Error },
    #[error("failed to install the vCPU kick signal handler: {0}")]
    SignalHandler(vmm_sys_util::errno::Error),
    #[error("vCPU {0} did not answer within the time limit")]
    NoResponse(u8),
    #[error(
        "vCPU {id} did not stop running the guest within {} ms of being asked to{}",
        .waited.as_millis(),
        .cause.map(|c| format!(": it waits for {c}")).unwrap_or_default()
    )]
    NotStopping {
        id: u8,
        waited: Duration,
        /// What the vCPU most likely waits for, when the machine knows.
        cause: Option<&'static str>,
    },
    #[error("vCPU {0} has stopped")]
    Ended(u8),
    #[error("vCPU {0} is not paused (its state can only be saved while it is)")]
    NotPaused(u8),
    #[error("vCPU {id} was handed to the thread started for vCPU {thread}")]
    WrongThread { id: u8, thread: u8 },
    #[error("vCPU {0}: cannot save its state: {1}")]
    SaveState(u8, PersistError),
    #[error("vCPU {id}: {source}")]
    Seccomp { id: u8, source: SeccompError },
}

/// Why a vCPU stopped running the guest on its own.
#[derive(Debug)]
pub enum VcpuStop {
    /// The guest asked for a reset.
    Reset,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault,
    /// The guest asked to power off.
    PowerOff,
    Error(VcpuError),
}

/// Where a vCPU reports that it stopped on its own.
pub struct StopReporter {
    pub reasons: Sender<(u8, VcpuStop)>,
    pub event: EventFd,
}

/// A configured vCPU, not yet running.
pub struct Vcpu {
    pub id: u8,
    fd: VcpuFd,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    /// The MSRs a snapshot saves ([`saved_msr_indices`], read once per machine).
    msr_indices: Arc<Vec<u32>>,
}

/// How a vCPU hot-plugged into the running VM is made: as the builder made the boot
/// vCPUs (CPUID from KVM's supported list with its APIC id and the VM's topology, minus
/// the masks; boot MSRs, FPU and LAPIC), wired to the same buses.
pub struct VcpuTemplate {
    pub supported_cpuid: CpuId,
    pub topology: Topology,
    pub masks: Vec<CpuidMask>,
    pub msr_indices: Arc<Vec<u32>>,
}

impl VcpuTemplate {
    /// Creates vCPU `id` in `vm` (KVM_CREATE_VCPU) and sets it up; it waits for INIT/SIPI
    /// from the guest, as the boot APs do. Called on the VMM thread, whose filter allows
    /// these ioctls.
    pub fn create(
        &self,
        vm: &kvm_ioctls::VmFd,
        id: u8,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
    ) -> Result<Vcpu, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(|source| VcpuError::Create { id, source })?;
        let vcpu = Vcpu::new(id, fd, io_bus, mmio_bus, self.msr_indices.clone());
        let ignored = vcpu.configure(&self.supported_cpuid, self.topology, &self.masks)?;
        if !ignored.is_empty() {
            log::debug!("vCPU {id}: {} CPUID mask(s) without effect", ignored.len());
        }
        Ok(vcpu)
    }
}

impl Vcpu {
    /// The MSRs its snapshots save (shared by the machine's vCPUs).
    pub fn msr_indices(&self) -> Arc<Vec<u32>> {
        self.msr_indices.clone()
    }

    pub fn new(
        id: u8,
        fd: VcpuFd,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        msr_indices: Arc<Vec<u32>>,
    ) -> Self {
        Vcpu {
            id,
            fd,
            io_bus,
            mmio_bus,
            msr_indices,
        }
    }

    fn setup_err(&self, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        let id = self.id;
        move |source| VcpuError::Setup { id, what, source }
    }

    /// CPUID, MSRs, FPU and local APIC: the state every vCPU needs. Returns the masks
    /// that KVM did not honour (the bit still reads back as set).
    pub fn configure(
        &self,
        supported_cpuid: &CpuId,
        topology: Topology,
        masks: &[CpuidMask],
    ) -> Result<Vec<CpuidMask>, VcpuError> {
        let mut cpuid = supported_cpuid.clone();
        cpuid::normalize(&mut cpuid, self.id, topology, masks);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(self.setup_err("set CPUID"))?;
        let effective = self
            .fd
            .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(self.setup_err("read CPUID back"))?;
        let ignored = masks
            .iter()
            .copied()
            .filter(|m| m.is_set_in(&effective))
            .collect();

        let msrs = msr::boot_msrs();
        let written = self
            .fd
            .set_msrs(&msrs)
            .map_err(self.setup_err("set MSRs"))?;
        if written != msrs.as_slice().len() {
            log::warn!(
                "vCPU {}: KVM accepted {written} of {} boot MSRs",
                self.id,
                msrs.as_slice().len()
            );
        }
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(self.setup_err("set FPU state"))?;

        // LINT0 delivers the PIC's ExtINT, LINT1 NMIs: what firmware leaves for Linux.
        let mut lapic = self.fd.get_lapic().map_err(self.setup_err("read LAPIC"))?;
        set_lvt_mode(&mut lapic.regs, LAPIC_LVT_LINT0, APIC_MODE_EXTINT);
        set_lvt_mode(&mut lapic.regs, LAPIC_LVT_LINT1, APIC_MODE_NMI);
        self.fd
            .set_lapic(&lapic)
            .map_err(self.setup_err("set LAPIC"))?;
        Ok(ignored)
    }

    /// Registers and segments of the boot vCPU. The others wait for INIT/SIPI from the
    /// guest, as on hardware (the in-kernel LAPIC keeps them in wait-for-SIPI).
    pub fn setup_boot_registers(
        &self,
        mem: &GuestMemoryMmap,
        entry: EntryPoint,
    ) -> Result<(), VcpuError> {
        let sregs = self
            .fd
            .get_sregs()
            .map_err(self.setup_err("read segment registers"))?;
        let sregs =
            regs::setup_boot_sregs(mem, entry, sregs).map_err(|source| VcpuError::BootRegs {
                id: self.id,
                source,
            })?;
        self.fd
            .set_sregs(&sregs)
            .map_err(self.setup_err("set segment registers"))?;
        self.fd
            .set_regs(&regs::boot_regs(entry))
            .map_err(self.setup_err("set registers"))?;
        Ok(())
    }
}

fn set_lvt_mode(regs: &mut [std::os::raw::c_char; 1024], offset: usize, mode: u32) {
    let mut bytes = [0u8; 4];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = regs[offset + index] as u8;
    }
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (index, byte) in value.to_le_bytes().iter().enumerate() {
        regs[offset + index] = *byte as std::os::raw::c_char;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lvt_mode_keeps_other_bits() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        regs[LAPIC_LVT_LINT0] = 0x30; // vector bits
        regs[LAPIC_LVT_LINT0 + 2] = 1; // mask bit 16
        set_lvt_mode(&mut regs, LAPIC_LVT_LINT0, APIC_MODE_EXTINT);
        let value = u32::from_le_bytes([
            regs[LAPIC_LVT_LINT0] as u8,
            regs[LAPIC_LVT_LINT0 + 1] as u8,
            regs[LAPIC_LVT_LINT0 + 2] as u8,
            regs[LAPIC_LVT_LINT0 + 3] as u8,
        ]);
        assert_eq!(value, 0x1_0730);
    }
}
