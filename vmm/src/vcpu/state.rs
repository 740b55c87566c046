//! A vCPU's snapshot state: everything KVM holds for it, and how it is read from and
//! loaded into the vCPU.

use gpuvm_arch::x86_64::address_space::CpuVendor;
use gpuvm_devices::Persist;
use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

use super::Vcpu;
use crate::persist::{exact_bytes, PersistError};

/// Everything KVM holds for one vCPU.
#[derive(Serialize, Deserialize)]
/// KVM's structures are read back at exactly their size ([`exact_bytes`]).
pub struct VcpuState {
    pub id: u8,
    #[serde(deserialize_with = "exact_bytes::vec")]
    pub cpuid: Vec<kvm_cpuid_entry2>,
    #[serde(deserialize_with = "exact_bytes::vec")]
    pub msrs: Vec<kvm_msr_entry>,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub regs: kvm_regs,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub sregs: kvm_sregs,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub xsave: kvm_xsave,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub xcrs: kvm_xcrs,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub debug_regs: kvm_debugregs,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub lapic: kvm_lapic_state,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub mp_state: kvm_mp_state,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub events: kvm_vcpu_events,
    pub tsc_khz: Option<u32>,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("id", &self.id)
            .field("rip", &self.regs.rip)
            .field("msrs", &self.msrs.len())
            .finish_non_exhaustive()
    }
}

/// The MSRs worth saving: every index KVM lists (those it cannot read back are skipped
/// when saving).
pub fn saved_msr_indices(kvm: &Kvm) -> Result<Vec<u32>, kvm_ioctls::Error> {
    kvm.get_msr_index_list()
        .map(|list| list.as_slice().to_vec())
}

/// The CPU vendor (CPUID leaf 0) of a saved vCPU and of this host, when they differ.
fn foreign_vendor(saved_cpuid: &[kvm_cpuid_entry2]) -> Option<(CpuVendor, CpuVendor)> {
    let saved = saved_cpuid.iter().find(|entry| entry.function == 0)?;
    let saved = CpuVendor::from_leaf0(saved.ebx, saved.ecx, saved.edx);
    let host = std::arch::x86_64::__cpuid(0);
    let here = CpuVendor::from_leaf0(host.ebx, host.ecx, host.edx);
    (saved != here).then_some((saved, here))
}

fn read_msrs(fd: &VcpuFd, id: u8, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, PersistError> {
    // KVM_GET_MSRS stops at the first MSR it cannot read; skip that one and go on.
    let mut saved = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(kvm_bindings::KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| PersistError::Vcpu {
            id,
            what: "size the MSR list",
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        let read = fd
            .get_msrs(&mut msrs)
            .map_err(|source| PersistError::Vcpu {
                id,
                what: "read MSRs",
                source,
            })?;
        saved.extend_from_slice(&msrs.as_slice()[..read]);
        let consumed = if read < chunk.len() { read + 1 } else { read };
        rest = &rest[consumed..];
    }
    Ok(saved)
}

impl Persist for Vcpu {
    type State = VcpuState;
    type Error = PersistError;

    /// Captures the vCPU; it must be paused (out of KVM_RUN), on its own thread.
    fn save(&self) -> Result<VcpuState, PersistError> {
        let (fd, id) = (&self.fd, self.id);
        let err = |what| move |source| PersistError::Vcpu { id, what, source };
        // MP state first: reading it makes KVM settle pending APIC events into the state.
        let mp_state = fd.get_mp_state().map_err(err("read MP state"))?;
        Ok(VcpuState {
            id,
            cpuid: fd
                .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
                .map_err(err("read CPUID"))?
                .as_slice()
                .to_vec(),
            regs: fd.get_regs().map_err(err("read registers"))?,
            sregs: fd.get_sregs().map_err(err("read segment registers"))?,
            xsave: fd.get_xsave().map_err(err("read XSAVE state"))?,
            xcrs: fd.get_xcrs().map_err(err("read XCRs"))?,
            debug_regs: fd.get_debug_regs().map_err(err("read debug registers"))?,
            lapic: fd.get_lapic().map_err(err("read LAPIC"))?,
            msrs: read_msrs(fd, id, &self.msr_indices)?,
            events: fd.get_vcpu_events().map_err(err("read vCPU events"))?,
            mp_state,
            tsc_khz: fd.get_tsc_khz().ok(),
        })
    }

    /// Loads saved state into this freshly created vCPU, in the order KVM needs: CPUID
    /// before MSRs, segment registers (APIC base) before the LAPIC, events last.
    fn restore(&mut self, state: &VcpuState) -> Result<(), PersistError> {
        let fd = &self.fd;
        let id = state.id;
        let err = |what| move |source| PersistError::Vcpu { id, what, source };
        let cpuid = CpuId::from_entries(&state.cpuid).map_err(|_| PersistError::Vcpu {
            id,
            what: "size CPUID",
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        fd.set_cpuid2(&cpuid).map_err(err("set CPUID"))?;
        if let Some(khz) = state.tsc_khz {
            if let Err(error) = fd.set_tsc_khz(khz) {
                log::warn!(
                    "vCPU {id}: cannot set TSC frequency {khz} kHz ({error}); guest time may drift"
                );
            }
        }
        fd.set_sregs(&state.sregs)
            .map_err(err("set segment registers"))?;
        fd.set_regs(&state.regs).map_err(err("set registers"))?;
        // SAFETY: gpuvm never asks for dynamically enabled XSTATE features (AMX), so the
        // guest's XSAVE area fits the 4096-byte legacy kvm_xsave that KVM_SET_XSAVE reads.
        unsafe { fd.set_xsave(&state.xsave) }.map_err(err("set XSAVE state"))?;
        // A host without XSAVE reports no XCRs and refuses KVM_SET_XCRS (EINVAL) whatever it
        // is given, so a state with none has nothing to load.
        if state.xcrs.nr_xcrs > 0 {
            fd.set_xcrs(&state.xcrs).map_err(err("set XCRs"))?;
        }
        fd.set_debug_regs(&state.debug_regs)
            .map_err(err("set debug registers"))?;
        fd.set_lapic(&state.lapic).map_err(err("set LAPIC"))?;
        let foreign = foreign_vendor(&state.cpuid);
        let mut left_out = Vec::new();
        let mut rest = &state.msrs[..];
        while !rest.is_empty() {
            let chunk = &rest[..rest.len().min(kvm_bindings::KVM_MAX_MSR_ENTRIES)];
            let msrs = Msrs::from_entries(chunk).map_err(|_| PersistError::Vcpu {
                id,
                what: "size the MSR list",
                source: kvm_ioctls::Error::new(libc::E2BIG),
            })?;
            // KVM_SET_MSRS stops at the first MSR it refuses.
            let written = fd.set_msrs(&msrs).map_err(err("set MSRs"))?;
            if written == chunk.len() {
                rest = &rest[written..];
                continue;
            }
            // A state written on a host of the other CPU vendor holds that vendor's MSRs
            // (IA32_FEATURE_CONTROL, ARCH_CAPABILITIES bits), which this host's KVM cannot
            // take: those are left out, said below. On a host like the one that wrote it,
            // a refused MSR is an error.
            let refused = chunk[written].index;
            if foreign.is_none() {
                return Err(PersistError::MsrRestore { id, index: refused });
            }
            left_out.push(format!("{refused:#x}"));
            rest = &rest[written + 1..];
        }
        if let (Some((saved, here)), false) = (&foreign, left_out.is_empty()) {
            log::warn!(
                "vCPU {id}: the state was written on a {saved:?} host, this one is {here:?}: its \
                 MSR(s) {} are left out (a guest that relies on them may misbehave)",
                left_out.join(", ")
            );
        }
        fd.set_mp_state(state.mp_state)
            .map_err(err("set MP state"))?;
        fd.set_vcpu_events(&state.events)
            .map_err(err("set vCPU events"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf0(vendor: &[u8; 12]) -> kvm_cpuid_entry2 {
        let word = |i: usize| u32::from_le_bytes(vendor[i..i + 4].try_into().unwrap());
        kvm_cpuid_entry2 {
            function: 0,
            ebx: word(0),
            edx: word(4),
            ecx: word(8),
            ..Default::default()
        }
    }

    /// A state from this host's kind of CPU is not foreign (its refused MSRs are errors);
    /// one from the other vendor is, named with both vendors.
    #[test]
    fn a_state_from_the_other_cpu_vendor_is_told_apart() {
        let host = std::arch::x86_64::__cpuid(0);
        let here = CpuVendor::from_leaf0(host.ebx, host.ecx, host.edx);
        let (own, other, other_vendor): (&[u8; 12], &[u8; 12], _) = if here == CpuVendor::Amd {
            (b"AuthenticAMD", b"GenuineIntel", CpuVendor::Intel)
        } else {
            (b"GenuineIntel", b"AuthenticAMD", CpuVendor::Amd)
        };
        if here != CpuVendor::Other {
            assert_eq!(foreign_vendor(&[leaf0(own)]), None);
        }
        assert_eq!(
            foreign_vendor(&[leaf0(other)]),
            Some((other_vendor, here)),
            "foreign, named with both vendors"
        );
        assert_eq!(foreign_vendor(&[]), None, "no leaf 0: nothing to compare");
    }
}
