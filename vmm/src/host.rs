//! What this host's KVM offers, asked before anything is built: opening /dev/kvm with an
//! error that says what to do, and how many vCPUs a VM may have. A leaf: request
//! validation ([`crate::action`]) and the builder both ask it.

use gpuvm_arch::x86_64::address_space::{CpuVendor, HostAddressWidth};
use gpuvm_arch::x86_64::mptable;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};

use kvm_ioctls::Kvm;

use crate::Error;

/// /dev/kvm as opened before this process entered its jail ([`adopt_kvm`]), if it was.
static ADOPTED_KVM: std::sync::Mutex<Option<OwnedFd>> = std::sync::Mutex::new(None);

/// Takes `kvm`, an open /dev/kvm, as the one every later [`open_kvm`] copies: a process
/// started inside a jail (a live update's new gpuvm) is given it, the jail need not hold
/// the device node.
pub fn adopt_kvm(kvm: OwnedFd) {
    *ADOPTED_KVM.lock().unwrap_or_else(|e| e.into_inner()) = Some(kvm);
}

/// Opens /dev/kvm (or copies the adopted one) with an error that tells the user what to do.
pub fn open_kvm() -> Result<Kvm, Error> {
    if let Some(adopted) = ADOPTED_KVM
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
    {
        let copy = adopted.try_clone().map_err(|e| Error::Kvm {
            hint: "cannot copy the inherited /dev/kvm descriptor",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EBADF)),
        })?;
        // SAFETY: `copy` is a descriptor of /dev/kvm (checked a character device when
        // inherited) that this process owns and hands to the Kvm alone.
        return Ok(unsafe { Kvm::from_raw_fd(copy.into_raw_fd()) });
    }
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

/// Guest RAM's regions for `size` bytes on this host: around the 32-bit MMIO hole, and on
/// AMD hosts around the HyperTransport range where RAM reaches it (the host's vendor is
/// read from KVM's CPUID only then). A CPUID that cannot be read counts as no AMD host:
/// the address-space plan, which needs it too, then says why.
pub fn ram_regions(kvm: &Kvm, size: u64) -> Vec<gpuvm_memory::RamRegion> {
    use gpuvm_arch::x86_64::layout;
    if !layout::ram_reaches_ht_hole(size) {
        return layout::ram_regions(size);
    }
    let amd = address_width(kvm).is_ok_and(|host| host.has_ht_hole());
    if amd {
        log::info!(
            "guest RAM reaches the AMD HyperTransport range: it goes on at 1 TiB, past \
             {:#x}..{:#x}",
            layout::AMD_HT_HOLE_START,
            layout::AMD_HT_HOLE_END
        );
    }
    layout::ram_regions_around(size, amd)
}

/// The guest-physical address width this host's KVM gives a VM (CPUID 0x80000008 as
/// KVM_GET_SUPPORTED_CPUID reports it) and the host's CPU vendor, which decides where
/// RAM and BARs may not go (AMD's HyperTransport range).
///
/// `GPUVM_TEST_HOST_VENDOR=amd` makes an Intel host plan as an AMD one does, so tests
/// check the AMD layout end to end on the CI hosts (KVM itself does not care).
pub fn address_width(kvm: &Kvm) -> Result<HostAddressWidth, kvm_ioctls::Error> {
    let cpuid = supported_cpuid(kvm)?;
    let mut host = HostAddressWidth::from_cpuid(cpuid.as_slice());
    if std::env::var("GPUVM_TEST_HOST_VENDOR").as_deref() == Ok("amd") {
        host.vendor = CpuVendor::Amd;
    }
    Ok(host)
}

/// [`max_vcpus`] of this host, read once, for checking a configuration before anything is
/// built (PUT /machine-config). None when /dev/kvm cannot be opened: the build then says
/// why.
pub fn host_max_vcpus() -> Option<u8> {
    static MAX: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| open_kvm().ok().map(|kvm| max_vcpus(&kvm)))
}
