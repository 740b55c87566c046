//! CPUID for gpuvm vCPUs: KVM's supported set, normalised per vCPU (APIC ids, topology,
//! hypervisor bit), minus the features the user masks.
//!
//! On some hosts KVM does not honour every cleared bit (see ENVIRONMENT.md: nested
//! hypervisors report a bit cleared but the guest still sees it), so after setting CPUID
//! the VMM reads it back and warns about each mask that did not take effect.

use std::fmt;
use std::str::FromStr;

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

/// The four CPUID output registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuidReg {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

/// One feature bit to hide from the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuidMask {
    pub leaf: u32,
    pub subleaf: Option<u32>,
    pub reg: CpuidReg,
    pub bit: u8,
}

/// Features users commonly need to hide, by the names Linux's /proc/cpuinfo uses.
const NAMED_FEATURES: &[(&str, u32, Option<u32>, CpuidReg, u8)] = &[
    ("sse3", 1, None, CpuidReg::Ecx, 0),
    ("pclmulqdq", 1, None, CpuidReg::Ecx, 1),
    ("ssse3", 1, None, CpuidReg::Ecx, 9),
    ("fma", 1, None, CpuidReg::Ecx, 12),
    ("cx16", 1, None, CpuidReg::Ecx, 13),
    ("pcid", 1, None, CpuidReg::Ecx, 17),
    ("sse4_1", 1, None, CpuidReg::Ecx, 19),
    ("sse4_2", 1, None, CpuidReg::Ecx, 20),
    ("x2apic", 1, None, CpuidReg::Ecx, 21),
    ("movbe", 1, None, CpuidReg::Ecx, 22),
    ("popcnt", 1, None, CpuidReg::Ecx, 23),
    ("tsc_deadline_timer", 1, None, CpuidReg::Ecx, 24),
    ("aes", 1, None, CpuidReg::Ecx, 25),
    ("xsave", 1, None, CpuidReg::Ecx, 26),
    ("avx", 1, None, CpuidReg::Ecx, 28),
    ("f16c", 1, None, CpuidReg::Ecx, 29),
    ("rdrand", 1, None, CpuidReg::Ecx, 30),
    ("hypervisor", 1, None, CpuidReg::Ecx, 31),
    ("fsgsbase", 7, Some(0), CpuidReg::Ebx, 0),
    ("bmi1", 7, Some(0), CpuidReg::Ebx, 3),
    ("avx2", 7, Some(0), CpuidReg::Ebx, 5),
    ("smep", 7, Some(0), CpuidReg::Ebx, 7),
    ("bmi2", 7, Some(0), CpuidReg::Ebx, 8),
    ("erms", 7, Some(0), CpuidReg::Ebx, 9),
    ("invpcid", 7, Some(0), CpuidReg::Ebx, 10),
    ("avx512f", 7, Some(0), CpuidReg::Ebx, 16),
    ("rdseed", 7, Some(0), CpuidReg::Ebx, 18),
    ("smap", 7, Some(0), CpuidReg::Ebx, 20),
    ("umip", 7, Some(0), CpuidReg::Ecx, 2),
    ("pku", 7, Some(0), CpuidReg::Ecx, 3),
    ("la57", 7, Some(0), CpuidReg::Ecx, 16),
    ("pdpe1gb", 0x8000_0001, None, CpuidReg::Edx, 26),
    ("rdtscp", 0x8000_0001, None, CpuidReg::Edx, 27),
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CpuidMaskParseError {
    #[error("unknown CPUID feature '{0}' (use a name like popcnt, xsave, smap, or LEAF[.SUBLEAF]:REG:BIT such as 0x7.0:ebx:20)")]
    Unknown(String),
    #[error("invalid CPUID mask '{0}': expected LEAF[.SUBLEAF]:REG:BIT with REG one of eax, ebx, ecx, edx and BIT 0..31")]
    Malformed(String),
}

fn parse_u32(text: &str) -> Option<u32> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

impl FromStr for CpuidMask {
    type Err = CpuidMaskParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim().to_ascii_lowercase();
        if let Some(&(_, leaf, subleaf, reg, bit)) =
            NAMED_FEATURES.iter().find(|entry| entry.0 == text)
        {
            return Ok(CpuidMask {
                leaf,
                subleaf,
                reg,
                bit,
            });
        }
        let parts: Vec<&str> = text.split(':').collect();
        if parts.len() != 3 {
            return Err(CpuidMaskParseError::Unknown(text));
        }
        let malformed = || CpuidMaskParseError::Malformed(text.clone());
        let (leaf, subleaf) = match parts[0].split_once('.') {
            Some((leaf, sub)) => (parse_u32(leaf), Some(parse_u32(sub).ok_or_else(malformed)?)),
            None => (parse_u32(parts[0]), None),
        };
        let reg = match parts[1] {
            "eax" => CpuidReg::Eax,
            "ebx" => CpuidReg::Ebx,
            "ecx" => CpuidReg::Ecx,
            "edx" => CpuidReg::Edx,
            _ => return Err(malformed()),
        };
        let bit = parts[2]
            .parse::<u8>()
            .ok()
            .filter(|b| *b < 32)
            .ok_or_else(malformed)?;
        Ok(CpuidMask {
            leaf: leaf.ok_or_else(malformed)?,
            subleaf,
            reg,
            bit,
        })
    }
}

impl fmt::Display for CpuidMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reg = match self.reg {
            CpuidReg::Eax => "eax",
            CpuidReg::Ebx => "ebx",
            CpuidReg::Ecx => "ecx",
            CpuidReg::Edx => "edx",
        };
        match self.subleaf {
            Some(sub) => write!(f, "{:#x}.{}:{}:{}", self.leaf, sub, reg, self.bit),
            None => write!(f, "{:#x}:{}:{}", self.leaf, reg, self.bit),
        }
    }
}

impl CpuidMask {
    fn matches(&self, entry: &kvm_cpuid_entry2) -> bool {
        entry.function == self.leaf && self.subleaf.is_none_or(|sub| entry.index == sub)
    }

    fn reg_mut<'a>(&self, entry: &'a mut kvm_cpuid_entry2) -> &'a mut u32 {
        match self.reg {
            CpuidReg::Eax => &mut entry.eax,
            CpuidReg::Ebx => &mut entry.ebx,
            CpuidReg::Ecx => &mut entry.ecx,
            CpuidReg::Edx => &mut entry.edx,
        }
    }

    /// Whether the bit is still set in `cpuid` (used to check that KVM honoured it).
    pub fn is_set_in(&self, cpuid: &CpuId) -> bool {
        cpuid.as_slice().iter().any(|entry| {
            let mut copy = *entry;
            self.matches(entry) && (*self.reg_mut(&mut copy) >> self.bit) & 1 == 1
        })
    }
}

/// Topology of the VM as reported through CPUID: one socket, one thread per core.
#[derive(Clone, Copy, Debug)]
pub struct Topology {
    pub vcpu_count: u8,
}

fn bits_needed(count: u32) -> u32 {
    if count <= 1 {
        0
    } else {
        32 - (count - 1).leading_zeros()
    }
}

/// Adjusts KVM's supported CPUID for vCPU `vcpu_id` and applies `masks`.
pub fn normalize(cpuid: &mut CpuId, vcpu_id: u8, topology: Topology, masks: &[CpuidMask]) {
    let count = u32::from(topology.vcpu_count);
    let core_shift = bits_needed(count);
    for entry in cpuid.as_mut_slice().iter_mut() {
        match entry.function {
            1 => {
                // Initial APIC id, logical processor count, CLFLUSH size (8 * 8 bytes).
                entry.ebx = (u32::from(vcpu_id) << 24) | (count.max(1) << 16) | (8 << 8);
                entry.ecx |= 1 << 31; // running under a hypervisor
                if count > 1 {
                    entry.edx |= 1 << 28; // HTT: more than one logical processor per package
                } else {
                    entry.edx &= !(1 << 28);
                }
            }
            4 => {
                // Intel deterministic cache parameters: cores per package - 1 in EAX[31:26].
                entry.eax = (entry.eax & 0x03ff_ffff) | ((count.max(1) - 1) << 26);
            }
            0xb | 0x1f => {
                // Extended topology: level 0 SMT (one thread), level 1 cores.
                entry.edx = u32::from(vcpu_id);
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8;
                    }
                    1 => {
                        entry.eax = core_shift;
                        entry.ebx = count;
                        entry.ecx = (2 << 8) | 1;
                    }
                    index => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = index & 0xff;
                    }
                }
            }
            0x8000_0008 => {
                // AMD: number of cores - 1 and the APIC id width.
                entry.ecx = (core_shift << 12) | (count.max(1) - 1);
            }
            _ => {}
        }
        for mask in masks {
            if mask.matches(entry) {
                *mask.reg_mut(entry) &= !(1u32 << mask.bit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CpuId {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ecx: (1 << 23) | (1 << 26),
                edx: 1 << 28,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                index: 0,
                ebx: 1 << 20,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                index: 1,
                ..Default::default()
            },
        ];
        CpuId::from_entries(&entries).unwrap()
    }

    #[test]
    fn parses_names_and_raw_masks() {
        let popcnt: CpuidMask = "popcnt".parse().unwrap();
        assert_eq!(
            (popcnt.leaf, popcnt.reg, popcnt.bit),
            (1, CpuidReg::Ecx, 23)
        );
        let raw: CpuidMask = "0x7.0:ebx:20".parse().unwrap();
        assert_eq!(raw, "smap".parse().unwrap());
        assert_eq!(raw.to_string(), "0x7.0:ebx:20");
        assert!(matches!(
            "nonsense".parse::<CpuidMask>(),
            Err(CpuidMaskParseError::Unknown(_))
        ));
        assert!(matches!(
            "1:exx:3".parse::<CpuidMask>(),
            Err(CpuidMaskParseError::Malformed(_))
        ));
        assert!(matches!(
            "1:ecx:32".parse::<CpuidMask>(),
            Err(CpuidMaskParseError::Malformed(_))
        ));
    }

    #[test]
    fn sets_apic_id_topology_and_masks() {
        let mut cpuid = sample();
        let masks = ["popcnt".parse().unwrap(), "smap".parse().unwrap()];
        normalize(&mut cpuid, 3, Topology { vcpu_count: 4 }, &masks);
        let leaf1 = cpuid.as_slice()[0];
        assert_eq!(leaf1.ebx >> 24, 3);
        assert_eq!((leaf1.ebx >> 16) & 0xff, 4);
        assert_ne!(leaf1.ecx & (1 << 31), 0);
        assert_eq!(leaf1.ecx & (1 << 23), 0, "popcnt masked");
        assert_ne!(leaf1.ecx & (1 << 26), 0, "xsave untouched");
        assert_eq!(cpuid.as_slice()[1].ebx & (1 << 20), 0, "smap masked");
        let topo = cpuid.as_slice()[2];
        assert_eq!((topo.eax, topo.ebx, topo.edx), (2, 4, 3));
        assert!(!masks[0].is_set_in(&cpuid));
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let mut cpuid = sample();
        normalize(&mut cpuid, 0, Topology { vcpu_count: 1 }, &[]);
        assert_eq!(cpuid.as_slice()[0].edx & (1 << 28), 0);
    }
}
