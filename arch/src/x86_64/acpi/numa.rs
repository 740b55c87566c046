//! The NUMA tables of a VM with guest NUMA nodes: the SRAT (which proximity domain each
//! vCPU, each range of RAM and each passthrough device belongs to) and the SLIT (the
//! distances between the domains). A VM without NUMA nodes gets neither.
//!
//! ```text
//! SRAT rev 3: header, reserved u32 = 1, reserved u64
//!   type 0  Processor Local APIC Affinity (16 bytes) per possible vCPU (hot-pluggable too)
//!   type 1  Memory Affinity (40 bytes) per node range of boot RAM (split at the 32-bit hole),
//!           and one flagged hot-pluggable for the room kept for hot-plugged RAM
//!   type 5  Generic Initiator Affinity (32 bytes) per passthrough device whose node is known,
//!           with a PCI handle (segment, bus << 8 | device << 3 | function)
//! SLIT rev 1: header, u64 number of localities, then N x N distance bytes (row = from)
//! ```
//!
//! Both are encoded here rather than with `acpi_tables`' SRAT/SLIT: its SRAT has no x86
//! processor affinity structure, and its SLIT only sets distances in symmetric pairs.

use acpi_tables::sdt::Sdt;

use super::{AcpiError, OEM_ID, OEM_REVISION, OEM_TABLE_ID};

/// SRAT revision with the Generic Initiator Affinity structure (ACPI 6.3).
const SRAT_REVISION: u8 = 3;
const SLIT_REVISION: u8 = 1;
const HEADER_LEN: u32 = 36;
const PROCESSOR_AFFINITY: u8 = 0;
const PROCESSOR_AFFINITY_LEN: u8 = 16;
const MEMORY_AFFINITY: u8 = 1;
const MEMORY_AFFINITY_LEN: u8 = 40;
const GENERIC_INITIATOR: u8 = 5;
const GENERIC_INITIATOR_LEN: u8 = 32;
/// Generic Initiator device handle type: PCI.
const HANDLE_PCI: u8 = 1;
/// The entry is valid (for a processor: it is or may become present).
const ENABLED: u32 = 1;
const MEMORY_HOTPLUGGABLE: u32 = 1 << 1;
/// A node's distance to itself, as ACPI defines it.
pub const LOCAL_DISTANCE: u8 = 10;
/// The distance gpuvm uses between distinct nodes where the host gives none.
pub const REMOTE_DISTANCE: u8 = 20;

/// One range of guest-physical RAM and its proximity domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NumaMemoryRange {
    pub domain: u32,
    pub base: u64,
    pub size: u64,
    /// Room for hot-pluggable RAM rather than boot RAM.
    pub hotpluggable: bool,
}

/// A PCI device (a passthrough GPU) and its proximity domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NumaPciInitiator {
    pub domain: u32,
    pub segment: u16,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

/// What the SRAT and SLIT describe. Domains are numbered `0..distances.len()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NumaTopology {
    /// The domain of each possible vCPU, indexed by APIC id (gpuvm's APIC id is the vCPU id).
    pub cpu_domains: Vec<u32>,
    pub memory: Vec<NumaMemoryRange>,
    pub initiators: Vec<NumaPciInitiator>,
    /// PCI segments whose host bridge the configuration puts in a domain, (segment,
    /// domain): Cloud Hypervisor's `numa[].pci_segments`, for the virtio devices placed
    /// there. The other host bridges take their devices' domain.
    pub segment_domains: Vec<(u16, u32)>,
    /// `distances[from][to]`; the diagonal is [`LOCAL_DISTANCE`].
    pub distances: Vec<Vec<u8>>,
}

impl NumaTopology {
    fn check(&self) -> Result<(), AcpiError> {
        let domains = self.distances.len();
        if domains == 0 || domains > 256 {
            return Err(AcpiError::Layout("NUMA: 1 to 256 proximity domains"));
        }
        let known = |domain: u32| (domain as usize) < domains;
        if self.cpu_domains.is_empty() || !self.cpu_domains.iter().all(|d| known(*d)) {
            return Err(AcpiError::Layout(
                "NUMA: every vCPU needs a proximity domain that the SLIT has",
            ));
        }
        if self.cpu_domains.len() > 256 {
            return Err(AcpiError::Layout("NUMA: APIC ids must fit in 8 bits"));
        }
        if !self.memory.iter().all(|m| known(m.domain) && m.size > 0) {
            return Err(AcpiError::Layout(
                "NUMA: a memory range is empty or in an unknown proximity domain",
            ));
        }
        if !self
            .initiators
            .iter()
            .all(|i| known(i.domain) && i.device < 32 && i.function < 8)
        {
            return Err(AcpiError::Layout(
                "NUMA: a device is in an unknown proximity domain or has a bad PCI address",
            ));
        }
        if !self
            .segment_domains
            .iter()
            .all(|&(_, domain)| known(domain))
        {
            return Err(AcpiError::Layout(
                "NUMA: a PCI segment is in an unknown proximity domain",
            ));
        }
        for (from, row) in self.distances.iter().enumerate() {
            if row.len() != domains {
                return Err(AcpiError::Layout(
                    "NUMA: the distance matrix must be square",
                ));
            }
            for (to, distance) in row.iter().enumerate() {
                let valid = if from == to {
                    *distance == LOCAL_DISTANCE
                } else {
                    *distance > LOCAL_DISTANCE
                };
                if !valid {
                    return Err(AcpiError::Layout(
                        "NUMA: distances are 10 to itself and 11..=255 to other nodes",
                    ));
                }
            }
        }
        Ok(())
    }
}

fn table(signature: [u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let mut table = Sdt::new(
        signature,
        HEADER_LEN,
        revision,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    table.append_slice(body);
    table.as_slice().to_vec()
}

/// The System Resource Affinity Table.
pub fn srat(topology: &NumaTopology) -> Result<Vec<u8>, AcpiError> {
    topology.check()?;
    let mut body = Vec::new();
    // Reserved: 1 for backward compatibility, then 8 zero bytes.
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&0u64.to_le_bytes());
    for (apic_id, domain) in topology.cpu_domains.iter().enumerate() {
        let domain = domain.to_le_bytes();
        body.extend_from_slice(&[
            PROCESSOR_AFFINITY,
            PROCESSOR_AFFINITY_LEN,
            domain[0],
            apic_id as u8,
        ]);
        // Listed enabled also when hot-pluggable: Linux ignores disabled entries, and the
        // MADT says which vCPUs are present.
        body.extend_from_slice(&ENABLED.to_le_bytes());
        // Local SAPIC EID, then bits 8..31 of the domain.
        body.extend_from_slice(&[0, domain[1], domain[2], domain[3]]);
        // Clock domain.
        body.extend_from_slice(&0u32.to_le_bytes());
    }
    for range in &topology.memory {
        body.extend_from_slice(&[MEMORY_AFFINITY, MEMORY_AFFINITY_LEN]);
        body.extend_from_slice(&range.domain.to_le_bytes());
        body.extend_from_slice(&0u16.to_le_bytes());
        body.extend_from_slice(&range.base.to_le_bytes());
        body.extend_from_slice(&range.size.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        let flags = ENABLED
            | if range.hotpluggable {
                MEMORY_HOTPLUGGABLE
            } else {
                0
            };
        body.extend_from_slice(&flags.to_le_bytes());
        body.extend_from_slice(&0u64.to_le_bytes());
    }
    for initiator in &topology.initiators {
        body.extend_from_slice(&[GENERIC_INITIATOR, GENERIC_INITIATOR_LEN, 0, HANDLE_PCI]);
        body.extend_from_slice(&initiator.domain.to_le_bytes());
        // Device handle (16 bytes): segment, bus << 8 | devfn, 12 reserved bytes.
        body.extend_from_slice(&initiator.segment.to_le_bytes());
        let devfn = initiator.device << 3 | initiator.function;
        body.extend_from_slice(&(u16::from(initiator.bus) << 8 | u16::from(devfn)).to_le_bytes());
        body.extend_from_slice(&[0; 12]);
        body.extend_from_slice(&ENABLED.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
    }
    Ok(table(*b"SRAT", SRAT_REVISION, &body))
}

/// The System Locality Information Table.
pub fn slit(topology: &NumaTopology) -> Result<Vec<u8>, AcpiError> {
    topology.check()?;
    let mut body = Vec::new();
    body.extend_from_slice(&(topology.distances.len() as u64).to_le_bytes());
    for row in &topology.distances {
        body.extend_from_slice(row);
    }
    Ok(table(*b"SLIT", SLIT_REVISION, &body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_nodes() -> NumaTopology {
        NumaTopology {
            cpu_domains: vec![0, 0, 1, 1, 1],
            memory: vec![
                NumaMemoryRange {
                    domain: 0,
                    base: 0,
                    size: 0xc000_0000,
                    hotpluggable: false,
                },
                NumaMemoryRange {
                    domain: 1,
                    base: 0x1_0000_0000,
                    size: 0x4000_0000,
                    hotpluggable: false,
                },
            ],
            initiators: vec![NumaPciInitiator {
                domain: 1,
                segment: 0,
                bus: 0,
                device: 3,
                function: 0,
            }],
            segment_domains: Vec::new(),
            distances: vec![vec![10, 21], vec![21, 10]],
        }
    }

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b))
    }

    fn u32_at(bytes: &[u8], offset: usize) -> u32 {
        u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap())
    }

    fn u64_at(bytes: &[u8], offset: usize) -> u64 {
        u64::from_le_bytes(bytes[offset..offset + 8].try_into().unwrap())
    }

    #[test]
    fn srat_has_every_vcpu_range_and_device_with_a_valid_header() {
        let srat = srat(&two_nodes()).unwrap();
        assert_eq!(&srat[0..4], b"SRAT");
        assert_eq!(srat[8], SRAT_REVISION);
        assert_eq!(u32_at(&srat, 4) as usize, srat.len());
        assert_eq!(srat.len(), 48 + 5 * 16 + 2 * 40 + 32);
        assert_eq!(sum(&srat), 0, "checksum");
        assert_eq!(u32_at(&srat, 36), 1, "reserved 1");

        let mut offset = 48;
        for (apic_id, domain) in [0u8, 0, 1, 1, 1].iter().enumerate() {
            let entry = &srat[offset..offset + 16];
            assert_eq!(entry[0], 0, "processor affinity");
            assert_eq!(entry[1], 16);
            assert_eq!(entry[2], *domain);
            assert_eq!(entry[3], apic_id as u8);
            assert_eq!(u32_at(entry, 4), 1, "enabled");
            assert_eq!(&entry[9..12], &[0, 0, 0], "high domain bits");
            offset += 16;
        }
        for (domain, base, size) in [(0u32, 0u64, 0xc000_0000u64), (1, 1 << 32, 1 << 30)] {
            let entry = &srat[offset..offset + 40];
            assert_eq!((entry[0], entry[1]), (1, 40));
            assert_eq!(u32_at(entry, 2), domain);
            assert_eq!(u64_at(entry, 8), base);
            assert_eq!(u64_at(entry, 16), size);
            assert_eq!(u32_at(entry, 28), 1, "enabled, not hot-pluggable");
            offset += 40;
        }
        let entry = &srat[offset..offset + 32];
        assert_eq!((entry[0], entry[1], entry[3]), (5, 32, 1), "GI, PCI handle");
        assert_eq!(u32_at(entry, 4), 1);
        assert_eq!(u16::from_le_bytes([entry[8], entry[9]]), 0, "segment");
        assert_eq!(
            u16::from_le_bytes([entry[10], entry[11]]),
            3 << 3,
            "bus 0 dev 3 fn 0"
        );
        assert_eq!(u32_at(entry, 24), 1, "enabled");
    }

    #[test]
    fn hotpluggable_memory_and_high_domains_are_encoded() {
        let mut topology = two_nodes();
        topology.distances = vec![vec![20; 300]; 300];
        for (i, row) in topology.distances.iter_mut().enumerate() {
            row[i] = 10;
        }
        assert!(srat(&topology).is_err(), "more than 256 domains");
        let mut topology = two_nodes();
        topology.memory[1].hotpluggable = true;
        let srat = srat(&topology).unwrap();
        let second_range = 48 + 5 * 16 + 40;
        assert_eq!(u32_at(&srat, second_range + 28), 3);
        assert_eq!(sum(&srat), 0);
    }

    #[test]
    fn slit_is_the_distance_matrix_row_by_row() {
        let mut topology = two_nodes();
        topology.distances = vec![vec![10, 21, 32], vec![21, 10, 21], vec![32, 22, 10]];
        topology.cpu_domains = vec![0, 1, 2];
        let slit = slit(&topology).unwrap();
        assert_eq!(&slit[0..4], b"SLIT");
        assert_eq!(u32_at(&slit, 4) as usize, slit.len());
        assert_eq!(slit.len(), 36 + 8 + 9);
        assert_eq!(sum(&slit), 0, "checksum");
        assert_eq!(u64_at(&slit, 36), 3);
        assert_eq!(
            &slit[44..],
            &[10, 21, 32, 21, 10, 21, 32, 22, 10],
            "asymmetric kept"
        );
    }

    fn config(vcpus: u8, max_vcpus: u8) -> crate::x86_64::acpi::AcpiConfig {
        use crate::x86_64::layout::{
            FOUR_GIB, PCI_ECAM_START, PCI_MMIO32_END, PCI_MMIO32_START, PCI_MMIO64_DEFAULT_SIZE,
        };
        crate::x86_64::acpi::AcpiConfig {
            vcpus,
            max_vcpus,
            memory_hotplug: false,
            pci_segments: vec![gpuvm_devices::pci::PciRootConfig {
                ecam_base: PCI_ECAM_START,
                buses: 1,
                mmio32_start: PCI_MMIO32_START,
                mmio32_end: PCI_MMIO32_END,
                mmio64_start: FOUR_GIB,
                mmio64_size: PCI_MMIO64_DEFAULT_SIZE,
            }],
            power_off: true,
        }
    }

    fn xsdt_entries(tables: &crate::x86_64::acpi::AcpiTables) -> Vec<u64> {
        let (_, xsdt) = tables.find(b"XSDT").unwrap();
        (36..xsdt.len())
            .step_by(8)
            .map(|o| u64_at(xsdt, o))
            .collect()
    }

    /// The body of `Device (name)` in `aml`: from its name to the next slot's device.
    fn slot_device(aml: &[u8], slot: u8) -> &[u8] {
        let find = |name: &[u8]| aml.windows(4).position(|w| w == name);
        let start = find(format!("SD{slot:02X}").as_bytes()).expect("the slot's device");
        let end = find(format!("SD{:02X}", slot + 1).as_bytes()).unwrap_or(aml.len());
        &aml[start..end]
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn the_slot_of_a_device_with_a_known_node_has_its_pxm() {
        use crate::x86_64::acpi::{build, build_with_numa};
        let mut topology = two_nodes();
        topology.initiators.push(NumaPciInitiator {
            domain: 0,
            segment: 0,
            bus: 0,
            device: 5,
            function: 0,
        });
        // Behind a root port (bus 1): no bus-0 slot is its ACPI companion.
        topology.initiators.push(NumaPciInitiator {
            domain: 1,
            segment: 0,
            bus: 1,
            device: 7,
            function: 0,
        });
        let tables = build_with_numa(&config(3, 5), Some(&topology)).unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        // Name (_PXM, n): NameOp, the name, then n as a byte constant (ZeroOp / OneOp for 0, 1).
        let pxm = |domain: u8| -> Vec<u8> {
            let value = match domain {
                0 => vec![0x00],
                1 => vec![0x01],
                n => vec![0x0a, n],
            };
            [&[0x08][..], b"_PXM", &value].concat()
        };
        assert!(contains(slot_device(dsdt, 3), &pxm(1)), "SD03: node 1");
        assert!(contains(slot_device(dsdt, 5), &pxm(0)), "SD05: node 0");
        for slot in (1..31).filter(|s| ![3, 5].contains(s)) {
            assert!(
                !contains(slot_device(dsdt, slot), b"_PXM"),
                "slot {slot} holds no device with a known node"
            );
        }
        // The two slots' and PCI0's (node 0's host bridge).
        assert_eq!(dsdt.windows(4).filter(|w| w == b"_PXM").count(), 3);
        assert_eq!(sum(dsdt), 0, "checksum");

        let plain = build(&config(3, 5)).unwrap();
        let (_, plain_dsdt) = plain.find(b"DSDT").unwrap();
        assert!(!contains(plain_dsdt, b"_PXM"), "no NUMA nodes: no _PXM");
    }

    #[test]
    fn the_xsdt_lists_srat_and_slit_only_with_numa_nodes() {
        use crate::x86_64::acpi::{build, build_with_numa};
        let plain = build(&config(5, 5)).unwrap();
        assert!(plain.find(b"SRAT").is_none() && plain.find(b"SLIT").is_none());
        assert_eq!(xsdt_entries(&plain).len(), 3);

        let topology = two_nodes();
        let tables = build_with_numa(&config(3, 5), Some(&topology)).unwrap();
        let (srat_addr, srat_bytes) = tables.find(b"SRAT").unwrap();
        let (slit_addr, slit_bytes) = tables.find(b"SLIT").unwrap();
        assert_eq!(srat_bytes, srat(&topology).unwrap().as_slice());
        assert_eq!(slit_bytes, slit(&topology).unwrap().as_slice());
        let listed = xsdt_entries(&tables);
        assert_eq!(listed.len(), 5);
        assert!(listed.contains(&srat_addr) && listed.contains(&slit_addr));
        for (_, bytes) in &tables.blobs[1..] {
            assert_eq!(sum(bytes), 0);
        }
        for pair in tables.blobs[1..].windows(2) {
            assert!(
                pair[0].0 + pair[0].1.len() as u64 <= pair[1].0,
                "no overlap"
            );
        }
    }

    #[test]
    fn inconsistent_topologies_are_refused() {
        let cases: Vec<fn(&mut NumaTopology)> = vec![
            |t| t.cpu_domains[0] = 2,
            |t| t.cpu_domains.clear(),
            |t| t.memory[0].domain = 7,
            |t| t.memory[0].size = 0,
            |t| t.initiators[0].device = 32,
            |t| t.distances[0][0] = 20,
            |t| t.distances[0][1] = 10,
            |t| t.distances[1].pop().map(drop).unwrap_or(()),
            |t| t.distances.clear(),
        ];
        for (index, break_it) in cases.iter().enumerate() {
            let mut topology = two_nodes();
            break_it(&mut topology);
            assert!(srat(&topology).is_err(), "case {index}");
            assert!(slit(&topology).is_err(), "case {index}");
        }
    }
}
