//! What this host's KVM offers, asked before anything is built: opening /dev/kvm with an
//! error that says what to do, and how many vCPUs a VM may have. A leaf: request
//! validation ([`crate::action`]) and the builder both ask it.

use gpuvm_arch::x86_64::mptable;
use kvm_ioctls::Kvm;

use crate::Error;

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

/// KVM_GET_SUPPORTED_CPUID, read once per process and copied from then on: on nested
/// hosts it costs ~0.8 ms (every CPUID KVM runs to build it exits to the hypervisor
/// below), and what KVM supports does not change while gpuvm runs. The address-space
/// planner (host address width) and the vCPUs share it.
pub fn supported_cpuid(kvm: &Kvm) -> Result<kvm_bindings::CpuId, kvm_ioctls::Error> {
    static CPUID: std::sync::OnceLock<kvm_bindings::CpuId> = std::sync::OnceLock::new();
    if let Some(cpuid) = CPUID.get() {
        return Ok(cpuid.clone());
    }
    let cpuid = kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)?;
    Ok(CPUID.get_or_init(|| cpuid).clone())
}

/// [`max_vcpus`] of this host, read once, for checking a configuration before anything is
/// built (PUT /machine-config). None when /dev/kvm cannot be opened: the build then says
/// why.
pub fn host_max_vcpus() -> Option<u8> {
    static MAX: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| open_kvm().ok().map(|kvm| max_vcpus(&kvm)))
}
