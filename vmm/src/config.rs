//! What a VM is made of: the machine (vCPUs, memory, CPU features) and what it boots.

use gpuvm_arch::x86_64::boot::BootSource;
use gpuvm_arch::x86_64::cpuid::CpuidMask;
use gpuvm_memory::Backing;

/// Default guest memory when none is given.
pub const DEFAULT_MEMORY_SIZE: u64 = 128 << 20;

#[derive(Clone, Debug)]
pub struct MachineConfig {
    pub vcpus: u8,
    pub memory_size: u64,
    pub backing: Backing,
    /// Request transparent huge pages for memfd backing.
    pub thp: bool,
    /// Populate all guest memory before boot, in parallel.
    pub prefault: bool,
    /// CPUID feature bits hidden from the guest.
    pub cpuid_masks: Vec<CpuidMask>,
    /// Log dirty pages in KVM so later snapshots write only what changed.
    pub track_dirty_pages: bool,
}

impl Default for MachineConfig {
    fn default() -> Self {
        MachineConfig {
            vcpus: 1,
            memory_size: DEFAULT_MEMORY_SIZE,
            backing: Backing::Memfd,
            thp: true,
            prefault: false,
            cpuid_masks: Vec::new(),
            track_dirty_pages: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct VmConfig {
    pub machine: MachineConfig,
    pub boot: BootSource,
}
