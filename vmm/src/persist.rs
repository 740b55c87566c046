//! Saved machine state: what a snapshot's state file holds, how it is captured from and
//! restored into KVM, and the file's framing.
//!
//! State file layout (all integers little-endian):
//! ```text
//! offset 0   8 bytes  magic "GPUVMSTA"
//! offset 8   u32      format version (STATE_FORMAT_VERSION)
//! offset 12  u32      CRC32 (IEEE) of the payload
//! offset 16  u64      payload length in bytes
//! offset 24  payload  JSON-encoded MachineState
//! ```
//! Guest memory is not in this file; `MachineState::memory` names the memory files.

use std::path::Path;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

pub const STATE_MAGIC: &[u8; 8] = b"GPUVMSTA";
pub const STATE_FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 24;
/// A state file is small (tens of KiB per vCPU); anything near this is not one of ours.
const MAX_PAYLOAD: u64 = 64 << 20;
/// The largest state file read: larger ones are refused unread.
pub const MAX_STATE_FILE: u64 = HEADER_LEN as u64 + MAX_PAYLOAD;

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("failed to {what} of vCPU {id}: {source}")]
    Vcpu {
        id: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("failed to {what} of the VM: {source}")]
    Vm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM refused MSR {index:#x} of vCPU {id} on restore")]
    MsrRestore { id: u8, index: u32 },
    #[error("cannot read state file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write state file {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a gpuvm state file (bad magic)")]
    BadMagic { path: String },
    #[error(
        "{path} has state format version {found}; this gpuvm reads version {STATE_FORMAT_VERSION}"
    )]
    UnknownVersion { path: String, found: u32 },
    #[error("{path} is truncated or has trailing data: header says {expected} payload bytes, file has {actual}")]
    BadLength {
        path: String,
        expected: u64,
        actual: u64,
    },
    #[error("{path} is corrupt: CRC mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    BadCrc {
        path: String,
        stored: u32,
        computed: u32,
    },
    #[error("{path} is corrupt: {source}")]
    Decode {
        path: String,
        source: serde_json::Error,
    },
    #[error("cannot encode the machine state: {0}")]
    Encode(serde_json::Error),
}

/// Everything KVM holds for one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debug_regs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
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

/// The VM-wide in-kernel devices and clock.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

/// The MSRs worth saving: every index KVM lists, minus those it cannot read back.
pub fn saved_msr_indices(kvm: &Kvm) -> Result<Vec<u32>, PersistError> {
    kvm.get_msr_index_list()
        .map(|list| list.as_slice().to_vec())
        .map_err(|source| PersistError::Vm {
            what: "list MSRs",
            source,
        })
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

/// Captures a paused vCPU.
pub fn save_vcpu(fd: &VcpuFd, id: u8, msr_indices: &[u32]) -> Result<VcpuState, PersistError> {
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
        msrs: read_msrs(fd, id, msr_indices)?,
        events: fd.get_vcpu_events().map_err(err("read vCPU events"))?,
        mp_state,
        tsc_khz: fd.get_tsc_khz().ok(),
    })
}

/// Loads saved state into a freshly created vCPU, in the order KVM needs: CPUID before
/// MSRs, segment registers (APIC base) before the LAPIC, events last.
pub fn restore_vcpu(fd: &VcpuFd, state: &VcpuState) -> Result<(), PersistError> {
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
    fd.set_xcrs(&state.xcrs).map_err(err("set XCRs"))?;
    fd.set_debug_regs(&state.debug_regs)
        .map_err(err("set debug registers"))?;
    fd.set_lapic(&state.lapic).map_err(err("set LAPIC"))?;
    for chunk in state.msrs.chunks(kvm_bindings::KVM_MAX_MSR_ENTRIES) {
        let msrs = Msrs::from_entries(chunk).map_err(|_| PersistError::Vcpu {
            id,
            what: "size the MSR list",
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        let written = fd.set_msrs(&msrs).map_err(err("set MSRs"))?;
        if written < chunk.len() {
            return Err(PersistError::MsrRestore {
                id,
                index: chunk[written].index,
            });
        }
    }
    fd.set_mp_state(state.mp_state)
        .map_err(err("set MP state"))?;
    fd.set_vcpu_events(&state.events)
        .map_err(err("set vCPU events"))?;
    Ok(())
}

fn read_irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, PersistError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(|source| PersistError::Vm {
            what: "read the interrupt controller",
            source,
        })?;
    Ok(chip)
}

/// Captures the in-kernel PIC, IOAPIC, PIT and clock (vCPUs paused).
pub fn save_vm(vm: &VmFd) -> Result<VmState, PersistError> {
    Ok(VmState {
        pic_master: read_irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: read_irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: read_irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: vm.get_pit2().map_err(|source| PersistError::Vm {
            what: "read the PIT",
            source,
        })?,
        clock: vm.get_clock().map_err(|source| PersistError::Vm {
            what: "read the clock",
            source,
        })?,
    })
}

pub fn restore_vm(vm: &VmFd, state: &VmState) -> Result<(), PersistError> {
    let err = |what| move |source| PersistError::Vm { what, source };
    vm.set_irqchip(&state.pic_master)
        .map_err(err("restore the PIC"))?;
    vm.set_irqchip(&state.pic_slave)
        .map_err(err("restore the PIC"))?;
    vm.set_irqchip(&state.ioapic)
        .map_err(err("restore the IOAPIC"))?;
    vm.set_pit2(&state.pit).map_err(err("restore the PIT"))?;
    // Only the clock value: the flags describe the source host's clock.
    let clock = kvm_clock_data {
        clock: state.clock.clock,
        ..Default::default()
    };
    vm.set_clock(&clock).map_err(err("restore the clock"))?;
    Ok(())
}

/// Frames `state` and writes it atomically (temporary file, fsync, rename, fsync dir), with
/// the same helper the memory files use.
pub fn write_state_file<T: Serialize>(path: &Path, state: &T) -> Result<(), PersistError> {
    let payload = serde_json::to_vec(state).map_err(PersistError::Encode)?;
    // Never write a file that reading would refuse.
    if payload.len() as u64 > MAX_PAYLOAD {
        return Err(PersistError::Write {
            path: path.display().to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the state is {} bytes, more than the {MAX_PAYLOAD} a state file may hold",
                    payload.len()
                ),
            ),
        });
    }
    let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
    bytes.extend_from_slice(STATE_MAGIC);
    bytes.extend_from_slice(&STATE_FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    gpuvm_memory::snapshot::write_atomically(path, |file| {
        use std::io::Write;
        file.write_all(&bytes)
    })
    .map_err(|source| PersistError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// Reads and validates a state file: a regular file of at most [`MAX_STATE_FILE`] bytes
/// (a FIFO, a device or a huge file is refused before it is read), then magic, version,
/// length, CRC, and decodes it.
pub fn read_state_file<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, PersistError> {
    let name = path.display().to_string();
    let bytes =
        gpuvm_memory::snapshot::read_regular_file(path, MAX_STATE_FILE).map_err(|source| {
            PersistError::Read {
                path: name.clone(),
                source,
            }
        })?;
    decode_state(&bytes, &name)
}

fn decode_state<T: for<'de> Deserialize<'de>>(bytes: &[u8], name: &str) -> Result<T, PersistError> {
    if bytes.len() < HEADER_LEN || &bytes[..8] != STATE_MAGIC {
        return Err(PersistError::BadMagic { path: name.into() });
    }
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let version = word(8);
    if version != STATE_FORMAT_VERSION {
        return Err(PersistError::UnknownVersion {
            path: name.into(),
            found: version,
        });
    }
    let stored_crc = word(12);
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&bytes[16..24]);
    let expected = u64::from_le_bytes(len_bytes);
    let actual = (bytes.len() - HEADER_LEN) as u64;
    if expected != actual || expected > MAX_PAYLOAD {
        return Err(PersistError::BadLength {
            path: name.into(),
            expected,
            actual,
        });
    }
    let payload = &bytes[HEADER_LEN..];
    let computed = crc32fast::hash(payload);
    if computed != stored_crc {
        return Err(PersistError::BadCrc {
            path: name.into(),
            stored: stored_crc,
            computed,
        });
    }
    serde_json::from_slice(payload).map_err(|source| PersistError::Decode {
        path: name.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        name: String,
        regs: kvm_regs,
    }

    fn sample() -> Sample {
        Sample {
            name: "vm".into(),
            regs: kvm_regs {
                rip: 0x1234,
                rax: 42,
                ..Default::default()
            },
        }
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuvm-persist-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("state")
    }

    #[test]
    fn round_trip() {
        let path = temp("round-trip");
        write_state_file(&path, &sample()).unwrap();
        let back: Sample = read_state_file(&path).unwrap();
        assert_eq!(back, sample());
    }

    #[test]
    fn every_corruption_is_detected() {
        let path = temp("corrupt");
        write_state_file(&path, &sample()).unwrap();
        let good = std::fs::read(&path).unwrap();
        let check = |bytes: &[u8]| decode_state::<Sample>(bytes, "state").unwrap_err();

        assert!(matches!(check(&good[..10]), PersistError::BadMagic { .. }));
        let mut bad = good.clone();
        bad[0] ^= 0xff;
        assert!(matches!(check(&bad), PersistError::BadMagic { .. }));
        let mut bad = good.clone();
        bad[8] = 99;
        assert!(matches!(
            check(&bad),
            PersistError::UnknownVersion { found: 99, .. }
        ));
        assert!(matches!(
            check(&good[..good.len() - 1]),
            PersistError::BadLength { .. }
        ));
        let mut longer = good.clone();
        longer.push(0);
        assert!(matches!(check(&longer), PersistError::BadLength { .. }));
        // Flip one bit in every payload byte position in turn: the CRC catches each.
        for at in [HEADER_LEN, HEADER_LEN + 7, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 1;
            assert!(
                matches!(check(&bad), PersistError::BadCrc { .. }),
                "byte {at}"
            );
        }
    }

    #[test]
    fn only_regular_state_files_of_bounded_size_are_read() {
        let path = temp("special");
        let _ = std::fs::remove_file(&path);
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let error = read_state_file::<Sample>(&path).unwrap_err();
        assert!(
            matches!(&error, PersistError::Read { .. })
                && error.to_string().contains("not a regular file"),
            "{error}"
        );
        std::fs::remove_file(&path).unwrap();
        // Larger than any state: refused by its size, unread.
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(MAX_STATE_FILE + 1).unwrap();
        let error = read_state_file::<Sample>(&path).unwrap_err();
        assert!(error.to_string().contains("too large"), "{error}");
    }

    #[test]
    fn state_write_replaces_whole_file() {
        let path = temp("atomic");
        write_state_file(&path, &sample()).unwrap();
        let second = Sample {
            name: "second version".into(),
            ..sample()
        };
        write_state_file(&path, &second).unwrap();
        let back: Sample = read_state_file(&path).unwrap();
        assert_eq!(back, second);
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
    }
}
