//! ACPI tables, so guests find the vCPUs, the interrupt routing and PCI (with its ECAM
//! window) the standard way:
//!
//! ```text
//! RSDP (v2, at ACPI_RSDP, where guests scan for it; PVH and bzImage get its address; the
//! tables below it, from ACPI_START)
//!  └─ XSDT ─┬─ FACP (FADT): HW-reduced ACPI, IA-PC boot flags (legacy devices, no VGA, no 8042),
//!           │        reset register = port 0x64 value 0xFE, sleep control and status
//!           │        registers = port SLEEP_CONTROL_PORT (power-off); X_DSDT ─▶ DSDT
//!           ├─ APIC (MADT): a local APIC per vCPU, the IOAPIC, LINT1 = NMI
//!           └─ MCFG: one ECAM window per PCI segment group (the buses it covers)
//! DSDT: \_SB.PCI0 (PNP0A08/PNP0A03, _SEG/_BBN 0, _CRS bus range + CF8..CFF + both BAR
//!       windows, _PRT for 32 slots x 4 pins, _OSC granting native PCIe hot-plug, PME, AER
//!       and the capability structure: see [`OscAml`]), with more segments \_SB.PC01..
//!       (_SEG and _UID N, _BBN 0, _CRS bus range + the segment's own BAR windows, _PRT,
//!       _OSC),
//!       \_SB.MBRD (PNP0C02, reserves every ECAM window, the hot-plug ports and the
//!       sleep control port), \_SB.COM1 (PNP0501, 0x3F8, IRQ 4); PCI hot-plug:
//!       each segment's \_SB.PCI0.SDxx (\_SB.PC0N.SDxx) slots with _EJ0 and PCNT over the
//!       segment's own register block (see [`PciHotplugAml`]), \_SB.GED0 (ACPI0013)
//!       raising it on HOTPLUG_GSI; \_S5_ (soft-off is sleep type 5)
//! ```
//!
//! The tables are encoded by rust-vmm's `acpi_tables`. They describe what the VMM really
//! builds: the IOAPIC id, ISA IRQ wiring and LINT pins follow the MP table (mptable.rs,
//! kept alongside), the PCI windows and ECAM come from the root bus's [`PciRootConfig`],
//! and the _PRT uses [`intx_gsi`], the rule the INTx wiring uses.
//!
//! Power-off: a hardware-reduced FADT has no PM1 control block, so without the sleep
//! registers and `\_S5_` Linux finds no ACPI power-off and `poweroff` only halts. With
//! them (as Cloud Hypervisor has), Linux writes `5 << 2 | SLP_EN` to the control register
//! and gpuvm_devices::acpi_sleep ends the VM. [`AcpiConfig::power_off`] false leaves both
//! out (Firecracker offers no ACPI power-off: its guests stop it with `reboot`).

use acpi_tables::aml::{self, AddressSpaceCacheable};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{Aml, AmlSink};
use gpuvm_devices::acpi_sleep::{AcpiSleepControl, S5_SLEEP_TYPE, SLEEP_CONTROL_PORT};
use gpuvm_devices::cpu_hotplug::{CPU_HOTPLUG_PORT, CPU_HOTPLUG_PORT_LEN};
use gpuvm_devices::memory_hotplug::{MEMORY_HOTPLUG_PORT, MEMORY_HOTPLUG_PORT_LEN};
use gpuvm_devices::pci::hotplug::{hotplug_port, HOTPLUG_GSI, HOTPLUG_PORT_LEN};
use gpuvm_devices::pci::{intx_gsi, PciRootConfig};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use zerocopy::{Immutable, IntoBytes};

use super::layout::{ACPI_RSDP, ACPI_START, APIC_ADDR, IOAPIC_ADDR, MAX_PCI_SEGMENTS};
use super::mptable::{ioapic_id, MAX_MPTABLE_CPUS};

pub mod cpus;
pub mod memory;
pub mod numa;

pub const OEM_ID: [u8; 6] = *b"GPUVM ";
const OEM_TABLE_ID: [u8; 8] = *b"GPUVMTBL";
const OEM_REVISION: u32 = 1;
/// Where the RSDP goes: the start of the area guests scan (0xE0000..0xFFFFF).
pub const RSDP_ADDR: u64 = ACPI_RSDP;
/// Tables start 16-byte aligned.
const TABLE_ALIGN: u64 = 16;
/// DSDT revision 2: AML integers are 64 bits (the 64-bit BAR window needs them).
const DSDT_REVISION: u8 = 2;
/// Configuration mechanism #1 ports.
const PCI_CONFIG_PORT: u16 = 0xcf8;
const PCI_CONFIG_PORT_LEN: u8 = 8;
/// i8042 command port; writing 0xFE pulses the CPU reset line (devices/src/i8042.rs).
const RESET_PORT: u64 = 0x64;
const RESET_VALUE: u8 = 0xfe;
const COM1_PORT: u16 = 0x3f8;
const COM1_IRQ: u32 = 4;
const PCI_SLOTS: u8 = 32;
const PCI_PINS: u8 = 4;
/// One bus of ECAM is 32 devices x 8 functions x 4 KiB.
const ECAM_BYTES_PER_BUS: u64 = 1 << 20;

/// FADT IA-PC boot architecture flags. IAPC_8042 stays clear: gpuvm's i8042 only takes the
/// reset command, and a guest told of a keyboard controller probes it (Linux's i8042 driver
/// waits out its 500 ms read timeout on every boot; 2 s in the real-kernel tier's emulation).
const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
#[cfg(test)]
const IAPC_8042: u16 = 1 << 1;
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
/// MADT flags: PCAT_COMPAT, the machine also has the dual 8259 PICs (KVM's in-kernel irqchip).
const MADT_PCAT_COMPAT: u32 = 1;
const MADT_FLAGS_OFFSET: usize = 40;
/// The table header's revision byte; the MADT revision whose local APIC flags have the
/// online-capable bit (ACPI 6.3).
const MADT_REVISION_OFFSET: usize = 8;
const MADT_ONLINE_CAPABLE_REVISION: u8 = 5;
const CHECKSUM_OFFSET: usize = 9;

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("{0} vCPUs do not fit in the ACPI MADT (1 to {MAX_MPTABLE_CPUS})")]
    CpuCount(u8),
    #[error("invalid PCI layout for the ACPI tables: {0}")]
    Layout(&'static str),
    #[error("the ACPI tables need {needed} bytes but the BIOS area has {room}")]
    TooLarge { needed: u64, room: u64 },
    #[error("failed to write the ACPI tables into guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

/// What the tables describe.
#[derive(Clone, Debug)]
pub struct AcpiConfig {
    pub vcpus: u8,
    /// vCPUs the guest may have by hot-plug; with more than `vcpus`, the DSDT has the CPU
    /// hot-plug devices ([`cpus`]) and the MADT lists the others as online capable.
    pub max_vcpus: u8,
    /// ACPI memory hot-plug: the DSDT has the memory devices ([`memory`]) over
    /// gpuvm_devices::memory_hotplug's register block.
    pub memory_hotplug: bool,
    /// The PCI roots: `pci_segments[n]` is segment group n's (segment 0 first, always).
    pub pci_segments: Vec<PciRootConfig>,
    /// Offer ACPI power-off: the FADT's sleep control and status registers and `\_S5_`.
    pub power_off: bool,
}

/// The tables and where each goes in guest memory.
#[derive(Debug)]
pub struct AcpiTables {
    pub rsdp_addr: u64,
    /// (guest address, bytes): the RSDP first, then the tables in ascending address order
    /// (below it).
    pub blobs: Vec<(u64, Vec<u8>)>,
}

impl AcpiTables {
    /// The table with `signature` (or the RSDP for `b"RSD "`), for tests and tools.
    pub fn find(&self, signature: &[u8; 4]) -> Option<(u64, &[u8])> {
        self.blobs
            .iter()
            .find(|(_, bytes)| bytes.starts_with(signature))
            .map(|(addr, bytes)| (*addr, bytes.as_slice()))
    }
}

/// MADT Local APIC NMI structure (type 4): which LINT pin of which processor is NMI.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, IntoBytes, Immutable)]
struct LocalApicNmi {
    kind: u8,
    length: u8,
    processor_uid: u8,
    flags: u16,
    lint: u8,
}

impl LocalApicNmi {
    /// Every processor (uid 0xFF), flags "conforms to the bus".
    fn all_processors(lint: u8) -> Self {
        LocalApicNmi {
            kind: 4,
            length: 6,
            processor_uid: 0xff,
            flags: 0,
            lint,
        }
    }
}

impl Aml for LocalApicNmi {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(self.as_bytes());
    }
}

fn bytes_of(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

fn set_checksum(table: &mut [u8]) {
    table[CHECKSUM_OFFSET] = 0;
    let sum = table.iter().fold(0u8, |acc, b| acc.wrapping_add(*b));
    table[CHECKSUM_OFFSET] = 0u8.wrapping_sub(sum);
}

/// The last bus the ECAM window covers (it starts at bus 0).
fn ecam_end_bus(pci: &PciRootConfig) -> Result<u8, AcpiError> {
    let buses = pci.ecam_size() / ECAM_BYTES_PER_BUS;
    if buses == 0 || buses > 256 || !pci.ecam_size().is_multiple_of(ECAM_BYTES_PER_BUS) {
        return Err(AcpiError::Layout(
            "the ECAM window must cover 1 to 256 whole buses",
        ));
    }
    if !pci.ecam_base.is_multiple_of(ECAM_BYTES_PER_BUS) {
        return Err(AcpiError::Layout("the ECAM window must be 1 MiB aligned"));
    }
    Ok((buses - 1) as u8)
}

/// One segment's host bridge window values, checked.
struct SegmentWindows {
    end_bus: u8,
    mmio32_start: u32,
    mmio32_last: u32,
    mmio64_start: u64,
    mmio64_last: u64,
    ecam_base: u32,
}

impl SegmentWindows {
    fn of(pci: &PciRootConfig) -> Result<Self, AcpiError> {
        let end_bus = ecam_end_bus(pci)?;
        let to_u32 = |value: u64, what| u32::try_from(value).map_err(|_| AcpiError::Layout(what));
        let mmio32_start = to_u32(pci.mmio32_start, "the 32-bit window must lie below 4 GiB")?;
        let mmio32_last = to_u32(
            pci.mmio32_end.saturating_sub(1),
            "the 32-bit window must lie below 4 GiB",
        )?;
        let ecam_base = to_u32(pci.ecam_base, "the ECAM window must lie below 4 GiB")?;
        to_u32(pci.ecam_size(), "the ECAM window is too large")?;
        if pci.mmio32_end <= pci.mmio32_start || pci.mmio64_size == 0 {
            return Err(AcpiError::Layout("a PCI BAR window is empty"));
        }
        let mmio64_last = pci
            .mmio64_start
            .checked_add(pci.mmio64_size - 1)
            .ok_or(AcpiError::Layout("the 64-bit window wraps around"))?;
        Ok(SegmentWindows {
            end_bus,
            mmio32_start,
            mmio32_last,
            mmio64_start: pci.mmio64_start,
            mmio64_last,
            ecam_base,
        })
    }
}

/// Every segment's ECAM and BAR windows are disjoint from every other's (ACPI: a host
/// bridge's resources are its own), and there are at most [`MAX_PCI_SEGMENTS`].
fn check_segments(segments: &[PciRootConfig]) -> Result<(), AcpiError> {
    if segments.is_empty() || segments.len() > usize::from(MAX_PCI_SEGMENTS) {
        return Err(AcpiError::Layout("1 to MAX_PCI_SEGMENTS PCI segments"));
    }
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for pci in segments {
        ranges.push((pci.ecam_base, pci.ecam_base + pci.ecam_size()));
        ranges.push((pci.mmio32_start, pci.mmio32_end));
        ranges.push((
            pci.mmio64_start,
            pci.mmio64_start.saturating_add(pci.mmio64_size),
        ));
    }
    ranges.sort_unstable();
    if ranges.windows(2).any(|pair| pair[0].1 > pair[1].0) {
        return Err(AcpiError::Layout("PCI segment windows overlap"));
    }
    Ok(())
}

/// The name of segment `segment`'s host bridge: PCI0 for segment 0 (as before segments),
/// PC01..PC0F for the others.
fn host_bridge_name(segment: u16) -> String {
    if segment == 0 {
        "PCI0".to_string()
    } else {
        format!("PC{segment:02X}")
    }
}

/// `\_SB.PCI0` / `\_SB.PC0N`: a PCIe host bridge (PNP0A08, PNP0A03) of segment group N
/// (`_SEG` N, `_UID` N, `_BBN` 0) with its bus range and BAR windows in `_CRS`; segment 0
/// also decodes 0xCF8..0xCFF and carries the hot-plug slots.
struct HostBridgeAml<'a> {
    segment: u16,
    windows: &'a SegmentWindows,
    prt: &'a aml::Package<'a>,
    /// The proximity domain of the device in each bus-0 slot, where known (segment 0's;
    /// another segment's devices take its host bridge's).
    slot_domains: &'a SlotDomains,
    /// This segment's bus-0 slots that hold a PCI bridge (left out of ACPI hot-plug).
    bridge_slots: &'a [u8],
    /// The proximity domain of the devices below it (`_PXM`), where it has one.
    domain: Option<u32>,
}

impl Aml for HostBridgeAml<'_> {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let w = self.windows;
        let segment = u32::from(self.segment);
        let bus = aml::AddressSpace::new_bus_number(0u16, u16::from(w.end_bus));
        let config_ports = aml::IO::new(PCI_CONFIG_PORT, PCI_CONFIG_PORT, 1, PCI_CONFIG_PORT_LEN);
        let mmio32 = aml::AddressSpace::new_memory(
            AddressSpaceCacheable::NotCacheable,
            true,
            w.mmio32_start,
            w.mmio32_last,
            None,
        );
        let mmio64 = aml::AddressSpace::new_memory(
            AddressSpaceCacheable::Cacheable,
            true,
            w.mmio64_start,
            w.mmio64_last,
            None,
        );
        let mut resources: Vec<&dyn Aml> = vec![&bus];
        if self.segment == 0 {
            resources.push(&config_ports);
        }
        resources.extend([&mmio32 as &dyn Aml, &mmio64]);
        let crs = aml::ResourceTemplate::new(resources);
        let hid = aml::EISAName::new("PNP0A08");
        let cid = aml::EISAName::new("PNP0A03");
        let mut children: Vec<&dyn Aml> = Vec::new();
        let names = [
            aml::Name::new("_HID".into(), &hid),
            aml::Name::new("_CID".into(), &cid),
            aml::Name::new("_ADR".into(), &aml::ZERO),
            aml::Name::new("_SEG".into(), &segment),
            aml::Name::new("_UID".into(), &segment),
            aml::Name::new("_BBN".into(), &aml::ZERO),
            aml::Name::new("_CRS".into(), &crs),
            aml::Name::new("_PRT".into(), self.prt),
        ];
        children.extend(names.iter().map(|n| n as &dyn Aml));
        let pxm = self
            .domain
            .map(|domain| aml::Name::new("_PXM".into(), &domain));
        if let Some(pxm) = &pxm {
            children.push(pxm);
        }
        children.push(&OscAml);
        // Every segment's bus 0 has ACPI hot-plug slots, each over its own register block.
        let no_domains = [None; PCI_SLOTS as usize];
        let hotplug = PciHotplugAml {
            port: hotplug_port(self.segment),
            slot_domains: if self.segment == 0 {
                self.slot_domains
            } else {
                &no_domains
            },
            bridge_slots: self.bridge_slots,
        };
        children.push(&hotplug);
        aml::Device::new(host_bridge_name(self.segment).as_str().into(), children)
            .to_aml_bytes(sink);
    }
}

/// The PCI Firmware Specification's `_OSC` UUID for PCI and PCIe host bridges.
const PCI_HOST_BRIDGE_OSC_UUID: &str = "33DB4D5B-1FF7-401C-9657-7441C03DD766";
/// `_OSC` control bits (the third DWord): PCIe native hot-plug, SHPC native hot-plug,
/// native PME, AER, and the PCIe capability structure (without which Linux takes none).
const OSC_CONTROL_PCIE_NATIVE_HOTPLUG: u32 = 1 << 0;
const OSC_CONTROL_SHPC_NATIVE_HOTPLUG: u32 = 1 << 1;
const OSC_CONTROL_PME: u32 = 1 << 2;
const OSC_CONTROL_AER: u32 = 1 << 3;
const OSC_CONTROL_CAPABILITY_STRUCTURE: u32 = 1 << 4;
/// What gpuvm grants: every control the OS asks for among these. gpuvm has no firmware that
/// handles PCIe events itself, so the OS owns them all; LTR and DPC stay with the
/// "platform" (the ports implement neither).
const OSC_GRANTED: u32 = OSC_CONTROL_PCIE_NATIVE_HOTPLUG
    | OSC_CONTROL_SHPC_NATIVE_HOTPLUG
    | OSC_CONTROL_PME
    | OSC_CONTROL_AER
    | OSC_CONTROL_CAPABILITY_STRUCTURE;
/// `_OSC` status bits (the first DWord) the platform sets.
const OSC_STATUS_UNRECOGNIZED_UUID: u32 = 1 << 2;
const OSC_STATUS_UNRECOGNIZED_REVISION: u32 = 1 << 3;
const OSC_STATUS_CAPABILITIES_MASKED: u32 = 1 << 4;
/// The `_OSC` revision of the PCI Firmware Specification's UUID.
const OSC_REVISION: u8 = 1;

/// `_OSC` of a host bridge: grants the OS native control of PCIe hot-plug (the root ports'
/// slots, which Linux's pciehp drives only when granted, short of `pcie_ports=native`),
/// PME, AER and the capability structure:
///
/// ```text
/// Method (_OSC, 4, Serialized) {
///     CreateDWordField (Arg3, 0, CDW1)                        status
///     If (Arg0 == ToUUID (PCI_HOST_BRIDGE_OSC_UUID)) {
///         CreateDWordField (Arg3, 8, CDW3)                    control asked for
///         Local0 = CDW3 & OSC_GRANTED
///         If (Arg1 != 1) { CDW1 |= unrecognized revision }
///         If (CDW3 != Local0) { CDW1 |= capabilities masked }
///         CDW3 = Local0                                       control granted
///     } Else { CDW1 |= unrecognized UUID }
///     Return (Arg3)
/// }
/// ```
///
/// The support DWord (the second) is not read: what is granted does not depend on it
/// (Linux asks for control only when it supports what the controls need).
struct OscAml;

impl Aml for OscAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let (status, control): (aml::Path, aml::Path) = ("CDW1".into(), "CDW3".into());
        let (uuid, revision, buffer) = (aml::Arg(0), aml::Arg(1), aml::Arg(3));
        let granted = aml::Local(0);
        let status_field = aml::CreateDWordField::new(&status, &buffer, &aml::ZERO);
        let control_offset = 8u8;
        let control_field = aml::CreateDWordField::new(&control, &buffer, &control_offset);
        let mask = OSC_GRANTED;
        let grant = aml::And::new(&granted, &control, &mask);
        let our_revision = OSC_REVISION;
        let bad_revision = OSC_STATUS_UNRECOGNIZED_REVISION;
        let set_bad_revision = aml::Or::new(&status, &status, &bad_revision);
        let revision_differs = aml::NotEqual::new(&revision, &our_revision);
        let revision_check = aml::If::new(&revision_differs, vec![&set_bad_revision]);
        let masked = OSC_STATUS_CAPABILITIES_MASKED;
        let set_masked = aml::Or::new(&status, &status, &masked);
        let control_masked = aml::NotEqual::new(&control, &granted);
        let masked_check = aml::If::new(&control_masked, vec![&set_masked]);
        let store_granted = aml::Store::new(&control, &granted);
        let our_uuid = aml::Uuid::new(PCI_HOST_BRIDGE_OSC_UUID);
        let uuid_equal = aml::Equal::new(&uuid, &our_uuid);
        let uuid_matches = aml::If::new(
            &uuid_equal,
            vec![
                &control_field,
                &grant,
                &revision_check,
                &masked_check,
                &store_granted,
            ],
        );
        let bad_uuid = OSC_STATUS_UNRECOGNIZED_UUID;
        let set_bad_uuid = aml::Or::new(&status, &status, &bad_uuid);
        let otherwise = aml::Else::new(vec![&set_bad_uuid]);
        let return_buffer = aml::Return::new(&buffer);
        aml::Method::new(
            "_OSC".into(),
            4,
            true,
            vec![&status_field, &uuid_matches, &otherwise, &return_buffer],
        )
        .to_aml_bytes(sink);
    }
}

/// `segments[n]` is segment n's root; `power_off` adds `\_S5_` and reserves the sleep
/// control port.
fn dsdt(
    segments: &[PciRootConfig],
    power_off: bool,
    cpu_hotplug: Option<cpus::CpuHotplugAml>,
    memory_hotplug: Option<memory::MemoryHotplugAml>,
    slot_domains: &SlotDomains,
    bridge_slots: &[Vec<u8>],
    bridge_domains: &[Option<u32>],
) -> Result<Vec<u8>, AcpiError> {
    check_segments(segments)?;
    let windows = segments
        .iter()
        .map(SegmentWindows::of)
        .collect::<Result<Vec<_>, _>>()?;

    // _PRT: slot D pin P (0 = INTA) -> GSI 16 + (D + P) % 8, as the INTx wiring does.
    let routes: Vec<(u32, u8, u32)> = (0..PCI_SLOTS)
        .flat_map(|slot| {
            (0..PCI_PINS).map(move |pin| (u32::from(slot) << 16 | 0xffff, pin, intx_gsi(slot, pin)))
        })
        .collect();
    let entries: Vec<aml::Package> = routes
        .iter()
        .map(|(address, pin, gsi)| aml::Package::new(vec![address, pin, &aml::ZERO, gsi]))
        .collect();
    let prt = aml::Package::new(entries.iter().map(|e| e as &dyn Aml).collect());
    let bridges: Vec<HostBridgeAml> = windows
        .iter()
        .enumerate()
        .map(|(segment, windows)| HostBridgeAml {
            segment: segment as u16,
            windows,
            prt: &prt,
            slot_domains,
            bridge_slots: bridge_slots.get(segment).map_or(&[], Vec::as_slice),
            domain: bridge_domains.get(segment).copied().flatten(),
        })
        .collect();
    // Motherboard resources: the ECAM windows belong to the platform, not to RAM or any
    // device (Linux checks MCFG against this or the e820 map).
    let ecam_reservations: Vec<aml::Memory32Fixed> = windows
        .iter()
        .map(|w| {
            let size = (u32::from(w.end_bus) + 1) * ECAM_BYTES_PER_BUS as u32;
            aml::Memory32Fixed::new(true, w.ecam_base, size)
        })
        .collect();
    let hotplug_ports: Vec<aml::IO> = (0..segments.len() as u16)
        .map(|segment| {
            let port = hotplug_port(segment);
            aml::IO::new(port, port, 1, HOTPLUG_PORT_LEN as u8)
        })
        .collect();
    let mut mbrd_resources: Vec<&dyn Aml> =
        ecam_reservations.iter().map(|r| r as &dyn Aml).collect();
    mbrd_resources.extend(hotplug_ports.iter().map(|p| p as &dyn Aml));
    let cpu_ports = aml::IO::new(
        CPU_HOTPLUG_PORT,
        CPU_HOTPLUG_PORT,
        1,
        CPU_HOTPLUG_PORT_LEN as u8,
    );
    if cpu_hotplug.is_some() {
        mbrd_resources.push(&cpu_ports);
    }
    let memory_ports = aml::IO::new(
        MEMORY_HOTPLUG_PORT,
        MEMORY_HOTPLUG_PORT,
        1,
        MEMORY_HOTPLUG_PORT_LEN as u8,
    );
    if memory_hotplug.is_some() {
        mbrd_resources.push(&memory_ports);
    }
    let sleep_port = aml::IO::new(
        SLEEP_CONTROL_PORT,
        SLEEP_CONTROL_PORT,
        1,
        AcpiSleepControl::LEN as u8,
    );
    if power_off {
        mbrd_resources.push(&sleep_port);
    }
    let mbrd_crs = aml::ResourceTemplate::new(mbrd_resources);

    let mut table = Sdt::new(
        *b"DSDT",
        36,
        DSDT_REVISION,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    let mut body = Vec::new();
    let bridges = bridges.iter().map(|b| b as &dyn Aml);
    aml::Scope::new(
        "\\_SB_".into(),
        bridges
            .chain([
                &GedAml {
                    pci_segments: segments.len() as u16,
                    cpus: cpu_hotplug.is_some(),
                    memory: memory_hotplug.is_some(),
                } as &dyn Aml,
                &aml::Device::new(
                    "MBRD".into(),
                    vec![
                        &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C02")),
                        &aml::Name::new("_UID".into(), &aml::ZERO),
                        &aml::Name::new("_CRS".into(), &mbrd_crs),
                    ],
                ),
                &aml::Device::new(
                    "COM1".into(),
                    vec![
                        &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
                        &aml::Name::new("_UID".into(), &aml::ZERO),
                        &aml::Name::new(
                            "_CRS".into(),
                            &aml::ResourceTemplate::new(vec![
                                &aml::IO::new(COM1_PORT, COM1_PORT, 1, 8),
                                &aml::Interrupt::new(true, true, false, false, COM1_IRQ),
                            ]),
                        ),
                    ],
                ),
            ])
            .chain(cpu_hotplug.as_ref().map(|c| c as &dyn Aml))
            .chain(memory_hotplug.as_ref().map(|m| m as &dyn Aml))
            .collect(),
    )
    .to_aml_bytes(&mut body);
    if power_off {
        // At the DefinitionBlock's top level, which is the root scope: `\_S5_`, where
        // ACPICA looks for each sleep state's SLP_TYP values.
        aml::Name::new("_S5_".into(), &aml::Package::new(vec![&S5_SLEEP_TYPE]))
            .to_aml_bytes(&mut body);
    }
    table.append_slice(&body);
    Ok(table.as_slice().to_vec())
}

/// The ACPI PCI hot-plug interface of one segment's bus 0, inside its host bridge
/// (`\_SB.PCI0`, `\_SB.PC0N`; the registers are gpuvm_devices::pci::hotplug's, modelled
/// on QEMU's PCIHP, each segment's block at its own ports):
///
/// ```text
/// OperationRegion (PCST, SystemIO, hotplug_port(segment), HOTPLUG_PORT_LEN)
/// Field (PCST, DWordAcc, NoLock, WriteAsZeros) { PCIU, 32, PCID, 32, B0EJ, 32, EVTS, 32,
///                                              EVEN, 32 }
/// Method (PCEJ, 1, Serialized) { B0EJ = 1 << Arg0 }
/// Device (SDxx) { _ADR = xx << 16, _SUN = xx, Method (_EJ0, 1) { PCEJ (xx) } }  slots 1..31
///     but those holding a bridge
///     (and _PXM = the device's proximity domain, where a cold-plugged device's is known)
/// Method (PCNT, 0, Serialized) {           called by \_SB.GED0._EVT
///     Local0 = PCIU; Local1 = PCID          (each read clears the register)
///     If (Local0 & 1 << xx) { Notify (SDxx, 1) }   device check: a new device
///     If (Local1 & 1 << xx) { Notify (SDxx, 3) }   eject request
/// }
/// ```
///
/// Linux's acpiphp finds the slots by their `_EJ0` and handles both notifications. A
/// passthrough device with a known node gets a `_PXM` on its SDxx and a Generic Initiator
/// in the SRAT; Linux (6.1, 6.12) reads neither for `numa_node`, only the host bridge's
/// `_PXM` ([`host_bridge_domains`]), which is why the VMM gives the devices of each node
/// other than 0 a segment of their own.
///
/// Slots holding a PCI bridge (the PCIe root ports gpuvm puts on bus 0, for a host-mirroring
/// topology or for hot-plug) get no SDxx and no notification: their slots are PCIe native
/// hot-plug (pciehp) slots, and an ACPI slot on the same port would register a second
/// hot-plug slot for it (pciehp's slot names then clash: "1-1" for "1") and offer the guest
/// an `_EJ0` that detaches the whole port. The register block ignores B0EJ for them too.
struct PciHotplugAml<'a> {
    /// The first port of the segment's register block.
    port: u16,
    slot_domains: &'a SlotDomains,
    /// Bus-0 slots that hold a PCI bridge.
    bridge_slots: &'a [u8],
}

/// The `_PXM` of each of `count` segments' host bridges: with NUMA nodes, the domain the
/// configuration gives the segment (Cloud Hypervisor's `numa[].pci_segments`), else
/// segment 0's is domain 0 and another segment's the domain of the devices the SRAT
/// places on it (the VMM gives each node's passthrough devices a segment of their own);
/// without NUMA nodes, or for a segment with neither, none. Linux takes a PCI device's
/// `numa_node` from its host bridge's `_PXM` alone (acpi_pci_root_add), so this is what
/// the guest's drivers (NVIDIA's, NCCL, virtio-net's queue placement) see.
fn host_bridge_domains(numa: Option<&numa::NumaTopology>, count: usize) -> Vec<Option<u32>> {
    let Some(topology) = numa else {
        return vec![None; count];
    };
    (0..count)
        .map(|segment| {
            let given = (topology.segment_domains.iter())
                .find(|(given, _)| usize::from(*given) == segment)
                .map(|&(_, domain)| domain);
            if given.is_some() {
                return given;
            }
            if segment == 0 {
                return Some(0);
            }
            let mut domains = (topology.initiators.iter())
                .filter(|initiator| usize::from(initiator.segment) == segment)
                .map(|initiator| initiator.domain);
            let first = domains.next()?;
            // A host bridge has one node: devices of several nodes on it get none.
            domains.all(|domain| domain == first).then_some(first)
        })
        .collect()
}

/// `slot_domains[slot]`: the proximity domain of the device in that slot of segment 0, bus 0.
type SlotDomains = [Option<u32>; PCI_SLOTS as usize];

/// The proximity domain of each bus-0 slot of segment 0 holding a device the SRAT places
/// (function 0 is the slot's ACPI companion; every function of a device shares its node).
fn slot_domains(numa: Option<&numa::NumaTopology>) -> SlotDomains {
    let mut domains = [None; PCI_SLOTS as usize];
    let initiators = numa.map(|t| t.initiators.as_slice()).unwrap_or_default();
    for initiator in initiators {
        if initiator.segment == 0 && initiator.bus == 0 && initiator.device < PCI_SLOTS {
            domains[usize::from(initiator.device)].get_or_insert(initiator.domain);
        }
    }
    domains
}

fn slot_name(slot: u8) -> String {
    format!("SD{slot:02X}")
}

impl Aml for PciHotplugAml<'_> {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let port = u64::from(self.port);
        let len = u64::from(HOTPLUG_PORT_LEN);
        aml::OpRegion::new("PCST".into(), aml::OpRegionSpace::SystemIO, &port, &len)
            .to_aml_bytes(sink);
        aml::Field::new(
            "PCST".into(),
            aml::FieldAccessType::DWord,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::WriteAsZeroes,
            vec![
                aml::FieldEntry::Named(*b"PCIU", 32),
                aml::FieldEntry::Named(*b"PCID", 32),
                aml::FieldEntry::Named(*b"B0EJ", 32),
                aml::FieldEntry::Named(*b"EVTS", 32),
                aml::FieldEntry::Named(*b"EVEN", 32),
            ],
        )
        .to_aml_bytes(sink);
        let b0ej: aml::Path = "B0EJ".into();
        aml::Method::new(
            "PCEJ".into(),
            1,
            true,
            vec![&aml::Store::new(
                &b0ej,
                &aml::ShiftLeft::new(&aml::ZERO, &aml::ONE, &aml::Arg(0)),
            )],
        )
        .to_aml_bytes(sink);
        let acpi_slots: Vec<u8> = (1..PCI_SLOTS)
            .filter(|slot| !self.bridge_slots.contains(slot))
            .collect();
        for &slot in &acpi_slots {
            let address = u32::from(slot) << 16;
            let sun = u32::from(slot);
            let pcej: aml::Path = "PCEJ".into();
            let call = aml::MethodCall::new(pcej, vec![&sun]);
            let adr = aml::Name::new("_ADR".into(), &address);
            let sun_name = aml::Name::new("_SUN".into(), &sun);
            let ej0 = aml::Method::new("_EJ0".into(), 1, false, vec![&call]);
            let pxm = self.slot_domains[usize::from(slot)]
                .map(|domain| aml::Name::new("_PXM".into(), &domain));
            let mut children: Vec<&dyn Aml> = vec![&adr, &sun_name, &ej0];
            children.extend(pxm.as_ref().map(|p| p as &dyn Aml));
            aml::Device::new(slot_name(slot).as_str().into(), children).to_aml_bytes(sink);
        }
        let (up, down) = (aml::Local(0), aml::Local(1));
        let (pciu, pcid): (aml::Path, aml::Path) = ("PCIU".into(), "PCID".into());
        let store_up = aml::Store::new(&up, &pciu);
        let store_down = aml::Store::new(&down, &pcid);
        let bits: Vec<u32> = (0..PCI_SLOTS).map(|slot| 1u32 << slot).collect();
        let names: Vec<aml::Path> = (0..PCI_SLOTS)
            .map(|slot| slot_name(slot).as_str().into())
            .collect();
        let (check, eject) = (1u8, 3u8);
        let mut tests = Vec::new();
        let mut notifies = Vec::new();
        for slot in acpi_slots.iter().map(|&slot| usize::from(slot)) {
            tests.push((
                aml::And::new(&aml::ZERO, &up, &bits[slot]),
                aml::And::new(&aml::ZERO, &down, &bits[slot]),
            ));
            notifies.push((
                aml::Notify::new(&names[slot], &check),
                aml::Notify::new(&names[slot], &eject),
            ));
        }
        let mut ifs = Vec::new();
        for ((up_bit, down_bit), (notify_check, notify_eject)) in tests.iter().zip(&notifies) {
            ifs.push(aml::If::new(up_bit, vec![notify_check]));
            ifs.push(aml::If::new(down_bit, vec![notify_eject]));
        }
        let mut body: Vec<&dyn Aml> = vec![&store_up, &store_down];
        body.extend(ifs.iter().map(|i| i as &dyn Aml));
        aml::Method::new("PCNT".into(), 0, true, body).to_aml_bytes(sink);
    }
}

/// The Generic Event Device (ACPI0013) that signals PCI hot-plug: the FADT is
/// hardware-reduced, so there are no GPE blocks or SCI (ACPICA skips both on such
/// machines); a GED's interrupt is how hardware-reduced platforms raise events. Its
/// interrupt is [`HOTPLUG_GSI`], edge-triggered, active high; `_EVT` acknowledges the
/// event (EVTS is write-1-to-clear) and runs `\_SB.PCI0.PCNT`, and each further
/// segment's `\_SB.PC0N.PCNT` (their blocks raise the same GSI); `_INI` enables the
/// interrupt (EVEN, every segment's), so a guest without ACPI never gets it.
/// With CPU hot-plug (`cpus`), `_EVT` also runs `\_SB.CPUS.CSCN` and `_INI` enables the
/// CPU block's interrupt (CEVN): both blocks raise the same GSI. With memory hot-plug
/// (`memory`), likewise `\_SB.MHPC.MSCN` and MEVN.
struct GedAml {
    /// PCI segments, each with its own hot-plug register block.
    pci_segments: u16,
    cpus: bool,
    memory: bool,
}

impl Aml for GedAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let path = |segment: u16, name: &str| -> aml::Path {
            format!("\\_SB_.{}.{name}", host_bridge_name(segment))
                .as_str()
                .into()
        };
        let segments = 0..self.pci_segments.max(1);
        let evts: Vec<aml::Path> = segments.clone().map(|s| path(s, "EVTS")).collect();
        let acks: Vec<aml::Store> = evts.iter().map(|e| aml::Store::new(e, &aml::ONE)).collect();
        let pcnts: Vec<aml::MethodCall> = segments
            .clone()
            .map(|s| aml::MethodCall::new(path(s, "PCNT"), vec![]))
            .collect();
        let even: Vec<aml::Path> = segments.map(|s| path(s, "EVEN")).collect();
        let enables: Vec<aml::Store> = even.iter().map(|e| aml::Store::new(e, &aml::ONE)).collect();
        let cscn = aml::MethodCall::new(cpus::CSCN_PATH.into(), vec![]);
        let cevn: aml::Path = cpus::CEVN_PATH.into();
        let enable_cpus = aml::Store::new(&cevn, &aml::ONE);
        let mut init: Vec<&dyn Aml> = enables.iter().map(|e| e as &dyn Aml).collect();
        let mut event: Vec<&dyn Aml> = Vec::new();
        for (ack, pcnt) in acks.iter().zip(&pcnts) {
            event.push(ack);
            event.push(pcnt);
        }
        if self.cpus {
            init.push(&enable_cpus);
            event.push(&cscn);
        }
        let mscn = aml::MethodCall::new(memory::MSCN_PATH.into(), vec![]);
        let mevn: aml::Path = memory::MEVN_PATH.into();
        let enable_memory = aml::Store::new(&mevn, &aml::ONE);
        if self.memory {
            init.push(&enable_memory);
            event.push(&mscn);
        }
        aml::Device::new(
            "GED0".into(),
            vec![
                &aml::Name::new("_HID".into(), &"ACPI0013"),
                &aml::Name::new("_UID".into(), &aml::ZERO),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![&aml::Interrupt::new(
                        true,
                        true,
                        false,
                        false,
                        HOTPLUG_GSI,
                    )]),
                ),
                &aml::Method::new("_INI".into(), 0, false, init),
                &aml::Method::new("_EVT".into(), 1, true, event),
            ],
        )
        .to_aml_bytes(sink);
    }
}

/// `power_off`: the sleep control and status registers (8-bit, system I/O), both at
/// [`SLEEP_CONTROL_PORT`]; ACPICA needs both to offer S5 on a hardware-reduced machine.
fn fadt(dsdt_addr: u64, power_off: bool) -> Vec<u8> {
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .dsdt_64(dsdt_addr);
    fadt.iapc_boot_arch = (IAPC_LEGACY_DEVICES | IAPC_VGA_NOT_PRESENT).into();
    fadt.reset_reg = GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        RESET_PORT,
    );
    fadt.reset_value = RESET_VALUE;
    if power_off {
        let sleep_register = GAS::new(
            AddressSpace::SystemIo,
            8,
            0,
            AccessSize::ByteAccess,
            u64::from(SLEEP_CONTROL_PORT),
        );
        fadt.sleep_control_reg = sleep_register;
        fadt.sleep_status_reg = sleep_register;
    }
    bytes_of(&fadt.finalize())
}

/// ISA IRQs need no interrupt source overrides: like the MP table, IRQ n is IOAPIC pin n
/// with the bus's default polarity and trigger, which is what ACPI assumes without one.
///
/// CPUs `vcpus..max_vcpus` (hot-pluggable) are listed not enabled and online capable,
/// which ACPI 6.3 defines for MADT revision 5 (Linux counts them as possible CPUs).
fn madt(vcpus: u8, max_vcpus: u8) -> Vec<u8> {
    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(APIC_ADDR as u32),
    );
    for cpu in 0..vcpus.max(max_vcpus) {
        let status = if cpu < vcpus {
            EnabledStatus::Enabled
        } else {
            EnabledStatus::DisabledOnlineCapable
        };
        madt.add_structure(ProcessorLocalApic::new(cpu, cpu, status));
    }
    madt.add_structure(IoApic::new(ioapic_id(vcpus), IOAPIC_ADDR as u32, 0));
    madt.add_structure(LocalApicNmi::all_processors(1));
    let mut bytes = bytes_of(&madt);
    // The crate has no setter for the MADT flags.
    bytes[MADT_FLAGS_OFFSET..MADT_FLAGS_OFFSET + 4]
        .copy_from_slice(&MADT_PCAT_COMPAT.to_le_bytes());
    if max_vcpus > vcpus {
        bytes[MADT_REVISION_OFFSET] = MADT_ONLINE_CAPABLE_REVISION;
    }
    set_checksum(&mut bytes);
    bytes
}

/// One ECAM allocation per segment: segment n's window, its buses from 0.
fn mcfg(segments: &[PciRootConfig]) -> Result<Vec<u8>, AcpiError> {
    let mut mcfg = MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for (segment, pci) in segments.iter().enumerate() {
        mcfg.add_ecam(pci.ecam_base, segment as u16, 0, ecam_end_bus(pci)?);
    }
    Ok(bytes_of(&mcfg))
}

/// Builds every table and places it in `[ACPI_START, ACPI_RSDP)`, the RSDP at [`RSDP_ADDR`].
pub fn build(config: &AcpiConfig) -> Result<AcpiTables, AcpiError> {
    build_with_numa(config, None)
}

/// As [`build`], with an SRAT and a SLIT when the VM has NUMA nodes (`numa`).
pub fn build_with_numa(
    config: &AcpiConfig,
    numa: Option<&numa::NumaTopology>,
) -> Result<AcpiTables, AcpiError> {
    build_with_bridges(config, numa, &[])
}

/// As [`build_with_numa`], for segments whose bus-0 slots hold PCI bridges (PCIe root
/// ports): `bridge_slots[n]` are segment n's, left out of ACPI PCI hot-plug (see
/// [`PciHotplugAml`]).
pub fn build_with_bridges(
    config: &AcpiConfig,
    numa: Option<&numa::NumaTopology>,
    bridge_slots: &[Vec<u8>],
) -> Result<AcpiTables, AcpiError> {
    if config.vcpus == 0 || config.vcpus.max(config.max_vcpus) > MAX_MPTABLE_CPUS {
        return Err(AcpiError::CpuCount(config.vcpus.max(config.max_vcpus)));
    }
    let mut next = ACPI_START;
    let mut place = |len: usize| {
        let addr = next;
        next = (addr + len as u64).next_multiple_of(TABLE_ALIGN);
        addr
    };
    let cpu_hotplug = (config.max_vcpus > config.vcpus).then_some(cpus::CpuHotplugAml {
        max_vcpus: config.max_vcpus,
    });
    let memory_hotplug = config.memory_hotplug.then_some(memory::MemoryHotplugAml {
        // The node the SRAT gives the hot-plug area.
        proximity_domain: numa.and_then(|topology| {
            topology
                .memory
                .iter()
                .find(|range| range.hotpluggable)
                .map(|range| range.domain)
        }),
    });
    let dsdt = dsdt(
        &config.pci_segments,
        config.power_off,
        cpu_hotplug,
        memory_hotplug,
        &slot_domains(numa),
        bridge_slots,
        &host_bridge_domains(numa, config.pci_segments.len()),
    )?;
    let dsdt_addr = place(dsdt.len());
    let fadt = fadt(dsdt_addr, config.power_off);
    let fadt_addr = place(fadt.len());
    let madt = madt(config.vcpus, config.max_vcpus);
    let madt_addr = place(madt.len());
    let mcfg = mcfg(&config.pci_segments)?;
    let mcfg_addr = place(mcfg.len());
    let mut numa_tables = Vec::new();
    if let Some(topology) = numa {
        for table in [numa::srat(topology)?, numa::slit(topology)?] {
            numa_tables.push((place(table.len()), table));
        }
    }
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for addr in [fadt_addr, madt_addr, mcfg_addr]
        .into_iter()
        .chain(numa_tables.iter().map(|(addr, _)| *addr))
    {
        xsdt.add_entry(addr);
    }
    let xsdt = bytes_of(&xsdt);
    let xsdt_addr = place(xsdt.len());
    let end = next;
    if end > RSDP_ADDR {
        return Err(AcpiError::TooLarge {
            needed: end - ACPI_START,
            room: RSDP_ADDR - ACPI_START,
        });
    }
    let rsdp = bytes_of(&Rsdp::new(OEM_ID, xsdt_addr));
    let mut blobs = vec![
        (RSDP_ADDR, rsdp),
        (dsdt_addr, dsdt),
        (fadt_addr, fadt),
        (madt_addr, madt),
        (mcfg_addr, mcfg),
    ];
    blobs.extend(numa_tables);
    blobs.push((xsdt_addr, xsdt));
    Ok(AcpiTables {
        rsdp_addr: RSDP_ADDR,
        blobs,
    })
}

/// Builds the tables and writes them into guest memory; returns the RSDP's address.
pub fn setup_acpi(mem: &GuestMemoryMmap, config: &AcpiConfig) -> Result<u64, AcpiError> {
    setup_acpi_with_numa(mem, config, None, &[])
}

/// As [`setup_acpi`], with the NUMA tables when `numa` is given and each segment's bus-0
/// slots that hold PCI bridges left out of ACPI hot-plug (`bridge_slots[n]`, segment n's,
/// see [`build_with_bridges`]).
pub fn setup_acpi_with_numa(
    mem: &GuestMemoryMmap,
    config: &AcpiConfig,
    numa: Option<&numa::NumaTopology>,
    bridge_slots: &[Vec<u8>],
) -> Result<u64, AcpiError> {
    let tables = build_with_bridges(config, numa, bridge_slots)?;
    for (addr, bytes) in &tables.blobs {
        mem.write_slice(bytes, GuestAddress(*addr))?;
    }
    log::debug!(
        "ACPI tables at {:#x}..{:#x} (RSDP {:#x})",
        ACPI_START,
        tables
            .blobs
            .iter()
            .map(|(addr, bytes)| addr + bytes.len() as u64)
            .max()
            .unwrap_or(ACPI_START),
        tables.rsdp_addr
    );
    Ok(tables.rsdp_addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x86_64::layout::{
        e820_map, pci_segment_ecam, pci_segment_mmio32, pci_segment_mmio64_start, ram_regions,
        E820_RESERVED, FOUR_GIB, PCI_ECAM_SIZE, PCI_ECAM_START, PCI_MMIO32_END, PCI_MMIO32_START,
        PCI_MMIO64_DEFAULT_SIZE, PCI_SEGMENT_MMIO64_SIZE,
    };

    fn pci() -> PciRootConfig {
        PciRootConfig {
            ecam_base: PCI_ECAM_START,
            buses: 1,
            mmio32_start: PCI_MMIO32_START,
            mmio32_end: PCI_MMIO32_END,
            mmio64_start: FOUR_GIB,
            mmio64_size: PCI_MMIO64_DEFAULT_SIZE,
        }
    }

    /// `count` segments laid out as the VMM lays them out.
    fn segments(count: u16) -> Vec<PciRootConfig> {
        let first = pci();
        let end0 = first.mmio64_start + first.mmio64_size;
        let mut segments = vec![first];
        for segment in 1..count {
            let (mmio32_start, mmio32_end) = pci_segment_mmio32(segment);
            segments.push(PciRootConfig {
                ecam_base: pci_segment_ecam(segment),
                buses: 1,
                mmio32_start,
                mmio32_end,
                mmio64_start: pci_segment_mmio64_start(end0, segment),
                mmio64_size: PCI_SEGMENT_MMIO64_SIZE,
            });
        }
        segments
    }

    fn tables(vcpus: u8) -> AcpiTables {
        build(&AcpiConfig {
            vcpus,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: vec![pci()],
            power_off: true,
        })
        .unwrap()
    }

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    fn u32_at(bytes: &[u8], offset: usize) -> u32 {
        u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap())
    }

    fn u64_at(bytes: &[u8], offset: usize) -> u64 {
        u64::from_le_bytes(bytes[offset..offset + 8].try_into().unwrap())
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn every_checksum_sums_to_zero_and_lengths_match() {
        for vcpus in [1, 2, 64, MAX_MPTABLE_CPUS] {
            let tables = tables(vcpus);
            let (_, rsdp) = tables.find(b"RSD ").unwrap();
            assert_eq!(sum(&rsdp[..20]), 0, "RSDP v1 checksum");
            assert_eq!(sum(rsdp), 0, "RSDP extended checksum");
            assert_eq!(u32_at(rsdp, 20) as usize, rsdp.len());
            for (addr, bytes) in &tables.blobs[1..] {
                assert_eq!(
                    sum(bytes),
                    0,
                    "{} at {addr:#x}",
                    String::from_utf8_lossy(&bytes[..4])
                );
                assert_eq!(u32_at(bytes, 4) as usize, bytes.len());
            }
        }
    }

    #[test]
    fn rsdp_points_at_an_xsdt_that_lists_every_table() {
        let tables = tables(2);
        let (rsdp_addr, rsdp) = tables.find(b"RSD ").unwrap();
        assert_eq!(rsdp_addr, tables.rsdp_addr);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(rsdp[15], 2, "revision 2 (XSDT)");
        let (xsdt_addr, xsdt) = tables.find(b"XSDT").unwrap();
        assert_eq!(u64_at(rsdp, 24), xsdt_addr);
        let listed: Vec<u64> = (36..xsdt.len())
            .step_by(8)
            .map(|o| u64_at(xsdt, o))
            .collect();
        let mut expected: Vec<u64> = [b"FACP", b"APIC", b"MCFG"]
            .iter()
            .map(|s| tables.find(s).unwrap().0)
            .collect();
        expected.sort();
        let mut sorted = listed.clone();
        sorted.sort();
        assert_eq!(sorted, expected);
        // Every table but the RSDP, XSDT and DSDT (reached through the FADT) is listed.
        for (addr, bytes) in &tables.blobs {
            let listed_here = listed.contains(addr);
            let indirect = [b"RSD ", b"XSDT", b"DSDT"]
                .iter()
                .any(|s| bytes.starts_with(&s[..]));
            assert_eq!(listed_here, !indirect, "{:?}", &bytes[..4]);
        }
    }

    #[test]
    fn fadt_is_hw_reduced_with_8042_reset_no_8042_keyboard_and_points_at_the_dsdt() {
        let tables = tables(1);
        let (_, fadt) = tables.find(b"FACP").unwrap();
        let (dsdt_addr, _) = tables.find(b"DSDT").unwrap();
        assert_eq!(u64_at(fadt, 140), dsdt_addr, "X_DSDT");
        assert_eq!(u32_at(fadt, 40), 0, "no 32-bit DSDT pointer");
        assert_ne!(u32_at(fadt, 112) & Flags::HwReducedAcpi as u32, 0);
        assert_ne!(u32_at(fadt, 112) & Flags::ResetRegSup as u32, 0);
        let iapc = u16::from_le_bytes([fadt[109], fadt[110]]);
        assert_eq!(
            iapc & IAPC_8042,
            0,
            "no keyboard controller for guests to probe"
        );
        assert_eq!(iapc & IAPC_VGA_NOT_PRESENT, IAPC_VGA_NOT_PRESENT);
        // Reset register: GAS in system I/O space at 0x64, value 0xFE.
        assert_eq!(fadt[116], 1, "system I/O");
        assert_eq!(u64_at(fadt, 120), 0x64);
        assert_eq!(fadt[128], 0xfe);
    }

    /// Offsets of the FADT's sleep registers (ACPI 5.0+), each a 12-byte GAS.
    const SLEEP_CONTROL_REG_OFFSET: usize = 244;
    const SLEEP_STATUS_REG_OFFSET: usize = 256;
    const GAS_LEN: usize = 12;
    /// `Name (_S5_, Package (1) { 5 })`: NameOp, name, PackageOp, PkgLength 4, one
    /// element, ByteConst 5.
    const S5_NAME: [u8; 10] = [0x08, b'_', b'S', b'5', b'_', 0x12, 4, 1, 0x0a, 5];
    /// `IO (Decode16, 0x600, 0x600, 1, 1)` as a small resource descriptor.
    const SLEEP_PORT_IO: [u8; 8] = [0x47, 1, 0x00, 0x06, 0x00, 0x06, 1, 1];

    /// Each host bridge's `_PXM` (Linux's only source of a PCI device's `numa_node`): with
    /// NUMA nodes, PCI0 is node 0's and a further segment is the node of the devices the SRAT
    /// places on it (none when it has none, or devices of two nodes); without, no `_PXM`.
    #[test]
    fn each_host_bridge_has_the_pxm_of_its_devices_node() {
        use numa::{NumaMemoryRange, NumaPciInitiator, NumaTopology};
        let config = AcpiConfig {
            vcpus: 2,
            max_vcpus: 2,
            memory_hotplug: false,
            pci_segments: segments(4),
            power_off: false,
        };
        let initiator = |domain, segment, device| NumaPciInitiator {
            domain,
            segment,
            bus: 0,
            device,
            function: 0,
        };
        let topology = NumaTopology {
            cpu_domains: vec![0, 1],
            memory: vec![NumaMemoryRange {
                domain: 0,
                base: 0,
                size: 0x4000_0000,
                hotpluggable: false,
            }],
            // Segment 1: two devices of node 1; segment 2: none; segment 3: two nodes.
            initiators: vec![
                initiator(1, 1, 1),
                initiator(1, 1, 2),
                initiator(0, 3, 1),
                initiator(1, 3, 2),
            ],
            segment_domains: Vec::new(),
            distances: vec![vec![10, 20], vec![20, 10]],
        };
        let tables = build_with_numa(&config, Some(&topology)).unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let position = |name: &[u8]| dsdt.windows(4).position(|w| w == name).unwrap();
        let bridge = |name: &[u8], next: &[u8]| &dsdt[position(name)..position(next)];
        // Name (_PXM, n): NameOp, the name, then ZeroOp / OneOp for 0 / 1.
        let pxm = |domain: u8| [&[0x08][..], b"_PXM", &[domain]].concat();
        let pxms = |body: &[u8]| body.windows(4).filter(|w| w == b"_PXM").count();
        let pci0 = bridge(b"PCI0", b"PC01");
        assert!(contains(pci0, &pxm(0)), "PCI0: node 0");
        assert_eq!(
            pxms(pci0),
            1,
            "no slot of segment 0 holds a device of a node"
        );
        let pc01 = bridge(b"PC01", b"PC02");
        assert!(contains(pc01, &pxm(1)), "PC01: node 1");
        assert_eq!(pxms(pc01), 1);
        assert_eq!(pxms(bridge(b"PC02", b"PC03")), 0, "PC02 holds no device");
        assert_eq!(pxms(&dsdt[position(b"PC03")..]), 0, "PC03 holds two nodes");
        assert_eq!(
            host_bridge_domains(Some(&topology), 4),
            [Some(0), Some(1), None, None]
        );
        // Segments the configuration places (Cloud Hypervisor's numa[].pci_segments): that
        // domain, over what the devices say, segment 0's included.
        let placed = NumaTopology {
            segment_domains: vec![(2, 1), (3, 0), (0, 1)],
            ..topology.clone()
        };
        assert_eq!(
            host_bridge_domains(Some(&placed), 4),
            [Some(1), Some(1), Some(1), Some(0)]
        );
        let tables = build_with_numa(&config, Some(&placed)).unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let position = |name: &[u8]| dsdt.windows(4).position(|w| w == name).unwrap();
        let pc02 = &dsdt[position(b"PC02")..position(b"PC03")];
        assert!(contains(pc02, &pxm(1)), "PC02: node 1, as configured");
        let unknown = NumaTopology {
            segment_domains: vec![(1, 2)],
            ..topology.clone()
        };
        assert!(build_with_numa(&config, Some(&unknown)).is_err());

        let plain = build(&config).unwrap();
        let (_, plain_dsdt) = plain.find(b"DSDT").unwrap();
        assert!(!contains(plain_dsdt, b"_PXM"), "no NUMA nodes: no _PXM");
        assert_eq!(host_bridge_domains(None, 2), [None, None]);
    }

    fn tables_with_power_off(power_off: bool) -> AcpiTables {
        build(&AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: segments(2),
            power_off,
        })
        .unwrap()
    }

    /// The `_CRS` of `\_SB.MBRD`: from its name to the next device's.
    fn mbrd_body(aml: &[u8]) -> &[u8] {
        let position = |name: &[u8]| aml.windows(4).position(|w| w == name).unwrap();
        &aml[position(b"MBRD")..position(b"COM1")]
    }

    /// Where the DSDT's top-level `Scope (\_SB_)` ends: ScopeOp, then its PkgLength.
    fn end_of_sb_scope(aml: &[u8]) -> usize {
        assert_eq!(aml[0], 0x10, "the DSDT starts with Scope (\\_SB_)");
        let lead = aml[1];
        let follow = usize::from(lead >> 6);
        let mut length = if follow == 0 {
            usize::from(lead & 0x3f)
        } else {
            usize::from(lead & 0x0f)
        };
        for i in 0..follow {
            length |= usize::from(aml[2 + i]) << (4 + 8 * i);
        }
        // PkgLength counts itself but not the ScopeOp.
        1 + length
    }

    #[test]
    fn fadt_has_sleep_registers_at_the_sleep_control_port() {
        let tables = tables_with_power_off(true);
        let (_, fadt) = tables.find(b"FACP").unwrap();
        assert!(
            fadt[8] >= 5,
            "FADT revision {} has no sleep registers",
            fadt[8]
        );
        assert!(fadt.len() >= SLEEP_STATUS_REG_OFFSET + GAS_LEN);
        for offset in [SLEEP_CONTROL_REG_OFFSET, SLEEP_STATUS_REG_OFFSET] {
            let gas = &fadt[offset..offset + GAS_LEN];
            // System I/O, 8 bits at bit 0, byte access, the port.
            assert_eq!(&gas[..4], &[1, 8, 0, 1], "GAS at {offset}");
            assert_eq!(u64_at(gas, 4), u64::from(SLEEP_CONTROL_PORT), "at {offset}");
        }
        assert_eq!(SLEEP_CONTROL_PORT, 0x600);
        // The reset register is unchanged.
        assert_eq!(u64_at(fadt, 120), RESET_PORT);
    }

    #[test]
    fn dsdt_names_s5_at_the_root_and_mbrd_reserves_the_sleep_port() {
        let tables = tables_with_power_off(true);
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let aml = &dsdt[36..];
        let s5 = aml
            .windows(S5_NAME.len())
            .position(|w| w == S5_NAME)
            .expect("Name (_S5_, Package () { 5 })");
        assert_eq!(
            aml.windows(4).filter(|w| w == b"_S5_").count(),
            1,
            "one \\_S5_"
        );
        assert!(
            s5 >= end_of_sb_scope(aml),
            "\\_S5_ lies outside \\_SB_, in the root scope"
        );
        assert_eq!(S5_NAME[9], S5_SLEEP_TYPE);
        assert!(
            contains(mbrd_body(aml), &SLEEP_PORT_IO),
            "the MBRD's _CRS reserves port 0x600"
        );
        // Only there: no host bridge decodes it.
        assert_eq!(
            aml.windows(SLEEP_PORT_IO.len())
                .filter(|w| *w == SLEEP_PORT_IO)
                .count(),
            1
        );
    }

    #[test]
    fn without_power_off_there_are_no_sleep_registers_and_no_s5() {
        let with = tables_with_power_off(true);
        let without = tables_with_power_off(false);
        let (_, fadt) = without.find(b"FACP").unwrap();
        let registers = SLEEP_CONTROL_REG_OFFSET..SLEEP_STATUS_REG_OFFSET + GAS_LEN;
        assert!(fadt[registers.clone()].iter().all(|&b| b == 0));
        // Everything else in the FADT is the same (the DSDT address aside).
        let (_, fadt_with) = with.find(b"FACP").unwrap();
        assert_eq!(fadt.len(), fadt_with.len());
        for offset in (0..fadt.len()).filter(|o| !registers.contains(o)) {
            if ![CHECKSUM_OFFSET, 140, 141, 142, 143].contains(&offset) {
                assert_eq!(fadt[offset], fadt_with[offset], "FADT byte {offset}");
            }
        }
        let (_, dsdt) = without.find(b"DSDT").unwrap();
        let aml = &dsdt[36..];
        assert!(!contains(aml, b"_S5_"));
        assert!(!contains(aml, &SLEEP_PORT_IO));
        // The rest of the MBRD (the ECAM windows, the hot-plug ports) stays.
        assert!(contains(
            mbrd_body(aml),
            &[0x47, 1, 0x00, 0xae, 0x00, 0xae, 1, 0x14]
        ));
    }

    fn madt_entries(madt: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut entries = Vec::new();
        let mut offset = 44;
        while offset + 2 <= madt.len() {
            let (kind, len) = (madt[offset], madt[offset + 1] as usize);
            assert!(len >= 2 && offset + len <= madt.len());
            entries.push((kind, madt[offset..offset + len].to_vec()));
            offset += len;
        }
        assert_eq!(offset, madt.len());
        entries
    }

    #[test]
    fn madt_has_one_local_apic_per_vcpu_and_the_mptable_ioapic() {
        for vcpus in [1u8, 2, 7, MAX_MPTABLE_CPUS] {
            let tables = tables(vcpus);
            let (_, madt) = tables.find(b"APIC").unwrap();
            assert_eq!(u32_at(madt, 36), APIC_ADDR as u32);
            assert_eq!(u32_at(madt, 40) & MADT_PCAT_COMPAT, MADT_PCAT_COMPAT);
            let entries = madt_entries(madt);
            let lapics: Vec<_> = entries.iter().filter(|(k, _)| *k == 0).collect();
            assert_eq!(lapics.len(), usize::from(vcpus));
            for (i, (_, e)) in lapics.iter().enumerate() {
                assert_eq!((e[2], e[3]), (i as u8, i as u8), "uid and APIC id");
                assert_eq!(u32_at(e, 4) & 1, 1, "enabled");
            }
            let ioapics: Vec<_> = entries.iter().filter(|(k, _)| *k == 1).collect();
            assert_eq!(ioapics.len(), 1);
            let ioapic = &ioapics[0].1;
            assert_eq!(ioapic[2], ioapic_id(vcpus));
            assert_eq!(u32_at(ioapic, 4), IOAPIC_ADDR as u32);
            assert_eq!(u32_at(ioapic, 8), 0, "GSI base");
            // LINT1 is NMI on every processor, as in the MP table.
            assert!(entries
                .iter()
                .any(|(k, e)| *k == 4 && e[2] == 0xff && e[5] == 1));
            // ISA IRQs are identity-mapped, as in the MP table: no overrides.
            assert!(!entries.iter().any(|(k, _)| *k == 2));
        }
    }

    /// The windows the address-space planner gives eight H200-like GPUs and two more
    /// segments (on an AMD host: past the HyperTransport hole) are what each host bridge's
    /// `_CRS` declares; the MCFG still names every ECAM window, and the e820 map has
    /// nothing (neither RAM nor reserved) in any 64-bit window.
    #[test]
    fn crs_mcfg_and_e820_tell_the_planned_windows() {
        use crate::x86_64::address_space::{
            plan, CpuVendor, HostAddressWidth, PlanRequest, AMD_HT_HOLE_END,
        };
        let regions = ram_regions(8 << 30);
        let devices = vec![vec![256u64 << 30, 32 << 20]; 8];
        let plan = plan(&PlanRequest {
            host: HostAddressWidth::new(CpuVendor::Amd, 48),
            ram_top: regions.iter().map(|r| r.end()).max().unwrap(),
            ram_hotplug_size: 0,
            devices: &devices,
            mmio64_size: 0,
            fixed_window: None,
            segments: 3,
            segment_bars: &[],
            segment_buses: &[],
        })
        .unwrap();
        assert_eq!(plan.mmio64_start, AMD_HT_HOLE_END);
        let mut pci_segments = vec![PciRootConfig {
            mmio64_start: plan.mmio64_start,
            mmio64_size: plan.mmio64_size,
            ..pci()
        }];
        for (segment, (&(mmio64_start, mmio64_size), &(mmio32_start, mmio32_end))) in
            (1u16..).zip(plan.segment_mmio64.iter().zip(&plan.segment_mmio32))
        {
            pci_segments.push(PciRootConfig {
                ecam_base: pci_segment_ecam(segment),
                buses: 1,
                mmio32_start,
                mmio32_end,
                mmio64_start,
                mmio64_size,
            });
        }
        let tables = build(&AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: pci_segments.clone(),
            power_off: true,
        })
        .unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let (_, mcfg) = tables.find(b"MCFG").unwrap();
        let map = e820_map(&regions);
        for (segment, pci) in pci_segments.iter().enumerate() {
            let (start, end) = (pci.mmio64_start, pci.mmio64_start + pci.mmio64_size);
            let mut qword = Vec::new();
            for v in [0, start, end - 1, 0, pci.mmio64_size] {
                qword.extend_from_slice(&v.to_le_bytes());
            }
            assert!(contains(dsdt, &qword), "_CRS of segment {segment}");
            assert_eq!(u64_at(mcfg, 44 + 16 * segment), pci.ecam_base);
            assert!(
                !map.iter().any(|e| e.addr < end && start < e.addr + e.size),
                "e820 entry in segment {segment}'s window: {map:x?}"
            );
        }
    }

    #[test]
    fn mcfg_describes_the_layout_ecam() {
        let tables = tables(1);
        let (_, mcfg) = tables.find(b"MCFG").unwrap();
        assert_eq!(mcfg.len(), 44 + 16, "one allocation");
        assert_eq!(u64_at(mcfg, 44), PCI_ECAM_START);
        assert_eq!(u16::from_le_bytes([mcfg[52], mcfg[53]]), 0, "segment");
        let (start_bus, end_bus) = (mcfg[54], mcfg[55]);
        assert_eq!(start_bus, 0);
        assert_eq!(
            (u64::from(end_bus) + 1) * ECAM_BYTES_PER_BUS,
            PCI_ECAM_SIZE,
            "the bus range covers exactly the ECAM window"
        );
    }

    #[test]
    fn a_root_with_bridges_covers_their_buses() {
        // Segment 0 with buses 0..=8 behind root ports and switches (crate gpuvm-vmm's
        // pci_topology): MCFG, _CRS and the ECAM reservation all reach bus 8.
        let tables = build(&AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: vec![PciRootConfig { buses: 9, ..pci() }],
            power_off: true,
        })
        .unwrap();
        let (_, mcfg) = tables.find(b"MCFG").unwrap();
        assert_eq!((mcfg[54], mcfg[55]), (0, 8), "MCFG bus range");
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        // WordBusNumber: minimum 0, maximum 8, translation 0, length 9.
        assert!(contains(dsdt, &[0, 0, 8, 0, 0, 0, 9, 0]), "_CRS bus range");
        let mut fixed = vec![0x86, 9, 0, 1];
        fixed.extend_from_slice(&(PCI_ECAM_START as u32).to_le_bytes());
        fixed.extend_from_slice(&(9 * PCI_ECAM_SIZE as u32).to_le_bytes());
        assert!(contains(dsdt, &fixed), "ECAM reservation of 9 buses");
        // A window that would run into segment 1's ECAM is refused.
        let mut segments = segments(2);
        segments[0].buses = 2;
        assert!(build(&AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: segments,
            power_off: true,
        })
        .is_err());
    }

    #[test]
    fn mcfg_has_one_allocation_per_segment_with_distinct_windows() {
        for count in [1u16, 2, 5, MAX_PCI_SEGMENTS] {
            let config = AcpiConfig {
                vcpus: 1,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: segments(count),
                power_off: true,
            };
            let tables = build(&config).unwrap();
            let (_, mcfg) = tables.find(b"MCFG").unwrap();
            assert_eq!(mcfg.len(), 44 + 16 * usize::from(count));
            let mut bases = Vec::new();
            for segment in 0..count {
                let entry = 44 + 16 * usize::from(segment);
                let base = u64_at(mcfg, entry);
                assert_eq!(base, config.pci_segments[usize::from(segment)].ecam_base);
                assert_eq!(
                    u16::from_le_bytes([mcfg[entry + 8], mcfg[entry + 9]]),
                    segment,
                    "segment number"
                );
                assert_eq!((mcfg[entry + 10], mcfg[entry + 11]), (0, 0), "buses 0..0");
                bases.push(base);
            }
            bases.sort_unstable();
            for pair in bases.windows(2) {
                assert!(pair[0] + PCI_ECAM_SIZE <= pair[1], "ECAM windows overlap");
            }
        }
    }

    /// `Name (NAME, value)` with `value` encoded as the crate encodes small integers.
    fn name_integer(name: &[u8; 4], value: u16) -> Vec<u8> {
        let mut bytes = vec![0x08];
        bytes.extend_from_slice(name);
        match value {
            0 => bytes.push(0x00),
            1 => bytes.push(0x01),
            2..=0xff => bytes.extend_from_slice(&[0x0a, value as u8]),
            _ => {
                bytes.push(0x0b);
                bytes.extend_from_slice(&value.to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn dsdt_has_a_host_bridge_per_segment_with_its_seg_and_windows() {
        let config = AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: segments(3),
            power_off: true,
        };
        let tables = build(&config).unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let aml = &dsdt[36..];
        let start_of = |name: &[u8]| {
            aml.windows(4)
                .position(|w| w == name)
                .unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(name)))
        };
        let (pci0, pc01, pc02) = (start_of(b"PCI0"), start_of(b"PC01"), start_of(b"PC02"));
        assert!(pci0 < pc01 && pc01 < pc02);
        assert!(!contains(aml, b"PC03"), "only 3 segments");
        let ged = start_of(b"GED0");
        let bodies = [
            (0u16, &aml[pci0..pc01]),
            (1, &aml[pc01..pc02]),
            (2, &aml[pc02..ged]),
        ];
        for (segment, body) in bodies {
            let pci = &config.pci_segments[usize::from(segment)];
            assert!(
                contains(body, &name_integer(b"_SEG", segment)),
                "_SEG {segment}"
            );
            assert!(
                contains(body, &name_integer(b"_UID", segment)),
                "_UID {segment}"
            );
            assert!(
                contains(body, &name_integer(b"_BBN", 0)),
                "_BBN of {segment}"
            );
            for id in [0x080a_d041u32, 0x030a_d041] {
                assert!(contains(body, &id.to_le_bytes()), "PNP0A08/PNP0A03");
            }
            let mut dword = Vec::new();
            for v in [0, pci.mmio32_start as u32, pci.mmio32_end as u32 - 1, 0] {
                dword.extend_from_slice(&v.to_le_bytes());
            }
            assert!(contains(body, &dword), "32-bit window of segment {segment}");
            let mut qword = Vec::new();
            let last = pci.mmio64_start + pci.mmio64_size - 1;
            for v in [0, pci.mmio64_start, last, 0, pci.mmio64_size] {
                qword.extend_from_slice(&v.to_le_bytes());
            }
            assert!(contains(body, &qword), "64-bit window of segment {segment}");
            let cf8 = contains(body, &[0x47, 1, 0xf8, 0x0c, 0xf8, 0x0c, 1, 8]);
            assert_eq!(cf8, segment == 0, "0xCF8 decodes segment 0 only");
            // Every segment's bus 0 has hot-plug slots over its own register block, which
            // the GED's _EVT scans and its _INI enables.
            assert!(
                contains(body, b"SD01"),
                "hot-plug slots on segment {segment}"
            );
            let mut region = vec![0x5b, 0x80];
            region.extend_from_slice(b"PCST\x01\x0b");
            region.extend_from_slice(&hotplug_port(segment).to_le_bytes());
            assert!(
                contains(body, &region),
                "segment {segment}'s register block"
            );
            let bridge = if segment == 0 { *b"PCI0" } else { *b"PC0\0" };
            let mut bridge = bridge;
            if segment != 0 {
                bridge[3] = b'0' + segment as u8;
            }
            let mut pcnt = b"\\\x2f\x03_SB_".to_vec();
            pcnt.extend_from_slice(&bridge);
            pcnt.extend_from_slice(b"PCNT");
            assert!(
                contains(&aml[ged..], &pcnt),
                "GED0 calls segment {segment}'s PCNT"
            );
            let mut port = vec![0x47, 1];
            port.extend_from_slice(&hotplug_port(segment).to_le_bytes());
            port.extend_from_slice(&hotplug_port(segment).to_le_bytes());
            assert!(
                contains(aml, &port),
                "MBRD reserves segment {segment}'s block"
            );
            // Each segment's ECAM window is reserved as a motherboard resource.
            let mut fixed = vec![0x86, 9, 0, 1];
            fixed.extend_from_slice(&(pci.ecam_base as u32).to_le_bytes());
            fixed.extend_from_slice(&(PCI_ECAM_SIZE as u32).to_le_bytes());
            assert!(contains(aml, &fixed), "ECAM reservation of {segment}");
        }
    }

    #[test]
    fn overlapping_or_too_many_segments_are_refused() {
        let mut overlapping = segments(2);
        overlapping[1].mmio32_start = overlapping[0].mmio32_end - 0x1000;
        let mut same_ecam = segments(2);
        same_ecam[1].ecam_base = same_ecam[0].ecam_base;
        let mut same_64 = segments(3);
        same_64[2].mmio64_start = same_64[1].mmio64_start + 4096;
        let mut too_many = segments(MAX_PCI_SEGMENTS);
        too_many.push(too_many[1]);
        for bad in [overlapping, same_ecam, same_64, too_many, Vec::new()] {
            assert!(matches!(
                build(&AcpiConfig {
                    vcpus: 1,
                    max_vcpus: 0,
                    memory_hotplug: false,
                    pci_segments: bad,
                    power_off: true,
                }),
                Err(AcpiError::Layout(_))
            ));
        }
    }

    /// Hot-pluggable CPUs: online capable in a revision-5 MADT, a processor device each
    /// under `\_SB.CPUS`, scanned from the GED; none of it without hot-plug.
    #[test]
    fn cpu_hot_plug_lists_every_possible_cpu() {
        for (vcpus, max_vcpus) in [(1u8, 4u8), (2, MAX_MPTABLE_CPUS)] {
            let tables = build(&AcpiConfig {
                vcpus,
                max_vcpus,
                memory_hotplug: false,
                pci_segments: vec![pci()],
                power_off: true,
            })
            .unwrap();
            let (_, madt) = tables.find(b"APIC").unwrap();
            assert_eq!(sum(madt), 0);
            assert_eq!(madt[MADT_REVISION_OFFSET], 5);
            let lapics: Vec<_> = madt_entries(madt)
                .into_iter()
                .filter(|(k, _)| *k == 0)
                .collect();
            assert_eq!(lapics.len(), usize::from(max_vcpus));
            for (cpu, (_, entry)) in lapics.iter().enumerate() {
                assert_eq!((entry[2], entry[3]), (cpu as u8, cpu as u8));
                let flags = if cpu < usize::from(vcpus) { 1 } else { 2 };
                assert_eq!(u32_at(entry, 4), flags, "CPU {cpu}");
            }
            let (_, dsdt) = tables.find(b"DSDT").unwrap();
            assert_eq!(sum(dsdt), 0);
            let aml = &dsdt[36..];
            let last = format!("C{:03X}", max_vcpus - 1);
            for name in [
                &b"CPUS"[..],
                b"ACPI0010\0",
                b"ACPI0007\0",
                b"CPLK",
                b"PRST",
                b"CSEL",
                b"CPEN",
                b"CINS",
                b"CRMV",
                b"CEJF",
                b"CEVN",
                b"CSTA",
                b"CEJX",
                b"CTFY",
                b"CSCN",
                b"C000",
                last.as_bytes(),
                b"_MAT",
            ] {
                assert!(contains(aml, name), "{}", String::from_utf8_lossy(name));
            }
            // _MAT of the last CPU: its local APIC entry, enabled.
            let mut mat = vec![0x11, 0x0b, 0x0a, 8];
            mat.extend_from_slice(&cpus::local_apic_entry(max_vcpus - 1));
            assert!(contains(aml, &mat), "_MAT buffer");
            let mut region = vec![0x5b, 0x80];
            region.extend_from_slice(b"PRST\x01\x0b");
            region.extend_from_slice(&CPU_HOTPLUG_PORT.to_le_bytes());
            assert!(contains(aml, &region), "the register block's port");
        }
        let plain = tables(2);
        let (_, dsdt) = plain.find(b"DSDT").unwrap();
        assert!(!contains(dsdt, b"CPUS") && !contains(dsdt, b"CSCN"));
        let (_, madt) = plain.find(b"APIC").unwrap();
        assert_ne!(madt[MADT_REVISION_OFFSET], 5);
    }

    #[test]
    fn dsdt_describes_pci_hot_plug() {
        let tables = tables(1);
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let aml = &dsdt[36..];
        for name in [
            &b"PCST"[..],
            b"PCIU",
            b"PCID",
            b"B0EJ",
            b"EVTS",
            b"EVEN",
            b"_INI",
            b"PCEJ",
            b"PCNT",
            b"SD01",
            b"SD1F",
            b"_EJ0",
            b"_SUN",
            b"GED0",
            b"ACPI0013\0",
            b"_EVT",
        ] {
            assert!(contains(aml, name), "{}", String::from_utf8_lossy(name));
        }
        assert!(
            !contains(aml, b"SD00"),
            "the host bridge's slot is not hot-pluggable"
        );
        // OperationRegion (PCST, SystemIO, 0xAE00, 0x10): ExtOp 0x80, name, space 1, WordConst.
        let mut region = vec![0x5b, 0x80];
        region.extend_from_slice(b"PCST\x01\x0b");
        region.extend_from_slice(&hotplug_port(0).to_le_bytes());
        assert!(contains(aml, &region), "the register block's port");
        // The GED's interrupt: Extended IRQ descriptor, consumer + edge, GSI 5.
        let mut irq = vec![0x89, 6, 0, 0x03, 1];
        irq.extend_from_slice(&HOTPLUG_GSI.to_le_bytes());
        assert!(contains(aml, &irq), "the GED's interrupt");
    }

    #[test]
    fn slots_holding_bridges_are_left_out_of_acpi_hot_plug() {
        let config = AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: vec![pci()],
            power_off: true,
        };
        let tables = build_with_bridges(&config, None, &[vec![3, 0x1f]]).unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        let aml = &dsdt[36..];
        for absent in [b"SD03", b"SD1F"] {
            assert!(
                !contains(aml, absent),
                "{}: a root port's slot is no ACPI slot",
                String::from_utf8_lossy(absent)
            );
        }
        for present in [b"SD01", b"SD02", b"SD04", b"SD1E"] {
            let name = String::from_utf8_lossy(present);
            assert!(contains(aml, present), "{name}");
        }
        // One _EJ0 and one _SUN per ACPI slot: 31 without bridges, 29 with two.
        let count = |aml: &[u8], name: &[u8]| aml.windows(4).filter(|w| *w == name).count();
        assert_eq!((count(aml, b"_EJ0"), count(aml, b"_SUN")), (29, 29));
        let plain = build(&config).unwrap();
        let plain = &plain.find(b"DSDT").unwrap().1[36..];
        assert_eq!((count(plain, b"_EJ0"), count(plain, b"_SUN")), (31, 31));
    }

    #[test]
    fn dsdt_names_the_devices_routes_and_windows() {
        let config = pci();
        let tables = tables(1);
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        assert_eq!(dsdt[8], DSDT_REVISION);
        let aml = &dsdt[36..];
        for name in [
            &b"_SB_"[..],
            b"PCI0",
            b"_HID",
            b"_CID",
            b"_SEG",
            b"_BBN",
            b"_CRS",
            b"_PRT",
            b"MBRD",
            b"COM1",
        ] {
            assert!(contains(aml, name), "{}", String::from_utf8_lossy(name));
        }
        // EISA ids: PNP0A08, PNP0A03, PNP0C02, PNP0501 (compressed, as DWords).
        for id in [0x080a_d041u32, 0x030a_d041, 0x020c_d041, 0x0105_d041] {
            assert!(contains(aml, &id.to_le_bytes()), "EISA id {id:#x}");
        }
        // _PRT: 128 entries, each Package(4) { slot << 16 | 0xFFFF, pin, Zero, GSI }.
        let mut prt_entries = 0;
        for slot in 0..PCI_SLOTS {
            for pin in 0..PCI_PINS {
                // PackageOp, PkgLength (patched below), 4 elements.
                let mut entry = vec![0x12, 0, 4];
                // Slot 0's address (0xFFFF) fits a Word; the others need a DWord.
                if slot == 0 {
                    entry.extend_from_slice(&[0x0b, 0xff, 0xff]);
                } else {
                    entry.push(0x0c);
                    entry.extend_from_slice(&(u32::from(slot) << 16 | 0xffff).to_le_bytes());
                }
                match pin {
                    0 => entry.push(0x00),
                    1 => entry.push(0x01),
                    _ => entry.extend_from_slice(&[0x0a, pin]),
                }
                entry.push(0x00); // Zero: a GSI, not a link device
                entry.extend_from_slice(&[0x0a, intx_gsi(slot, pin) as u8]);
                entry[1] = (entry.len() - 1) as u8;
                assert!(
                    contains(aml, &entry),
                    "_PRT slot {slot} pin {pin}: {entry:x?}"
                );
                prt_entries += 1;
            }
        }
        assert_eq!(prt_entries, 128);
        // _CRS windows: DWordMemory for the 32-bit window, QWordMemory for the 64-bit one,
        // and the CF8 ports.
        let mut dword = Vec::new();
        for v in [
            0,
            config.mmio32_start as u32,
            config.mmio32_end as u32 - 1,
            0,
        ] {
            dword.extend_from_slice(&v.to_le_bytes());
        }
        assert!(contains(aml, &dword), "32-bit window");
        let mut qword = Vec::new();
        let last = config.mmio64_start + config.mmio64_size - 1;
        for v in [0, config.mmio64_start, last, 0, config.mmio64_size] {
            qword.extend_from_slice(&v.to_le_bytes());
        }
        assert!(contains(aml, &qword), "64-bit window");
        assert!(
            contains(aml, &[0x47, 1, 0xf8, 0x0c, 0xf8, 0x0c, 1, 8]),
            "IO 0xCF8..0xCFF"
        );
        // The motherboard device reserves the ECAM window: Memory32Fixed(base, size).
        let mut fixed = vec![0x86, 9, 0, 1];
        fixed.extend_from_slice(&(PCI_ECAM_START as u32).to_le_bytes());
        fixed.extend_from_slice(&(PCI_ECAM_SIZE as u32).to_le_bytes());
        assert!(contains(aml, &fixed), "ECAM reservation");
        // COM1: IO 0x3F8..0x3FF, IRQ 4.
        assert!(contains(aml, &[0x47, 1, 0xf8, 0x03, 0xf8, 0x03, 1, 8]));
        assert!(contains(aml, &[0x89, 6, 0, 0x03, 1, 4, 0, 0, 0]));
    }

    #[test]
    fn tables_lie_in_the_reserved_bios_area() {
        let tables = tables(MAX_MPTABLE_CPUS);
        assert_eq!(tables.rsdp_addr % 16, 0, "RSDP on a 16-byte boundary");
        assert!(
            (0xe0000..0x100000).contains(&tables.rsdp_addr),
            "in the scanned area"
        );
        for (addr, bytes) in &tables.blobs[1..] {
            assert!(*addr >= ACPI_START && addr + bytes.len() as u64 <= RSDP_ADDR);
        }
        let mut blobs = tables.blobs.clone();
        blobs.sort_by_key(|(addr, _)| *addr);
        for pair in blobs.windows(2) {
            assert!(
                pair[0].0 + pair[0].1.len() as u64 <= pair[1].0,
                "no overlap"
            );
        }
        for size in [64 << 20, 6 << 30] {
            let map = e820_map(&ram_regions(size));
            assert!(map.iter().any(|e| e.kind == E820_RESERVED
                && e.addr <= ACPI_START
                && crate::x86_64::layout::ACPI_END <= e.addr + e.size));
        }
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert!(matches!(
            build(&AcpiConfig {
                vcpus: 0,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: vec![pci()],
                power_off: true,
            }),
            Err(AcpiError::CpuCount(0))
        ));
        assert!(matches!(
            build(&AcpiConfig {
                vcpus: 255,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: vec![pci()],
                power_off: true,
            }),
            Err(AcpiError::CpuCount(255))
        ));
        let mut bad = pci();
        bad.mmio32_end = 1 << 33;
        assert!(matches!(
            build(&AcpiConfig {
                vcpus: 1,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: vec![bad],
                power_off: true,
            }),
            Err(AcpiError::Layout(_))
        ));
        let mut bad = pci();
        bad.ecam_base += 0x8_0000;
        assert!(matches!(
            build(&AcpiConfig {
                vcpus: 1,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: vec![bad],
                power_off: true,
            }),
            Err(AcpiError::Layout(_))
        ));
        let mut bad = pci();
        bad.mmio64_start = u64::MAX - 10;
        assert!(matches!(
            build(&AcpiConfig {
                vcpus: 1,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: vec![bad],
                power_off: true,
            }),
            Err(AcpiError::Layout(_))
        ));
    }

    #[test]
    fn setup_writes_the_tables_into_guest_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let config = AcpiConfig {
            vcpus: 2,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: vec![pci()],
            power_off: true,
        };
        let rsdp = setup_acpi(&mem, &config).unwrap();
        let mut signature = [0u8; 8];
        mem.read_slice(&mut signature, GuestAddress(rsdp)).unwrap();
        assert_eq!(&signature, b"RSD PTR ");
        for (addr, bytes) in build(&config).unwrap().blobs {
            let mut read = vec![0u8; bytes.len()];
            mem.read_slice(&mut read, GuestAddress(addr)).unwrap();
            assert_eq!(read, bytes);
        }
    }

    /// Memory hot-plug: `\_SB.MHPC` and its devices, scanned and enabled from the GED, the
    /// register block reserved; with the most CPUs and PCI segments it still fits.
    #[test]
    fn memory_hot_plug_adds_its_devices_and_fits_with_everything_else() {
        let tables = build(&AcpiConfig {
            vcpus: 1,
            max_vcpus: MAX_MPTABLE_CPUS,
            memory_hotplug: true,
            pci_segments: segments(MAX_PCI_SEGMENTS),
            power_off: true,
        })
        .unwrap();
        let (_, dsdt) = tables.find(b"DSDT").unwrap();
        for name in [b"MHPC", b"MSCN", b"MEVN", b"MP00", b"CSCN"] {
            assert!(contains(dsdt, name), "{}", String::from_utf8_lossy(name));
        }
        let mut ports = Vec::new();
        aml::IO::new(
            MEMORY_HOTPLUG_PORT,
            MEMORY_HOTPLUG_PORT,
            1,
            MEMORY_HOTPLUG_PORT_LEN as u8,
        )
        .to_aml_bytes(&mut ports);
        assert!(contains(mbrd_body(dsdt), &ports), "MBRD reserves the block");
        let without = build(&AcpiConfig {
            vcpus: 1,
            max_vcpus: 0,
            memory_hotplug: false,
            pci_segments: vec![pci()],
            power_off: true,
        })
        .unwrap();
        let (_, dsdt) = without.find(b"DSDT").unwrap();
        assert!(!contains(dsdt, b"MHPC") && !contains(dsdt, b"MSCN"));
    }

    /// Runs each host bridge's `_OSC` the way an OS calls it: a small AML interpreter for the
    /// opcodes the method is made of, so the tests check what it answers, not its bytes.
    mod osc {
        use super::*;
        use std::cell::RefCell;
        use std::collections::HashMap;
        use std::rc::Rc;

        const METHOD_OP: u8 = 0x14;
        /// What Linux asks for: native hot-plug, SHPC hot-plug, PME, AER, the capability
        /// structure and LTR (drivers/acpi/pci_root.c with the usual configuration).
        const LINUX_REQUEST: u32 = 0x3f;
        const QUERY: u32 = 1;
        /// Linux's support DWord: extended config space, ASPM, clock PM, segments, MSI.
        const LINUX_SUPPORT: u32 = 0x1f;

        /// A buffer the method and its caller share (`Arg3` is changed in place).
        type SharedBuffer = Rc<RefCell<Vec<u8>>>;

        #[derive(Clone)]
        enum Value {
            Integer(u64),
            Buffer(SharedBuffer),
        }

        impl Value {
            fn integer(&self) -> u64 {
                match self {
                    Value::Integer(value) => *value,
                    Value::Buffer(_) => panic!("a buffer where _OSC uses an integer"),
                }
            }
        }

        /// A method's state: its arguments, locals and the buffer fields it created.
        struct Frame {
            args: Vec<Value>,
            locals: [u64; 8],
            /// `CreateDWordField`s: name -> (buffer, byte offset).
            fields: HashMap<[u8; 4], (SharedBuffer, usize)>,
        }

        /// PkgLength at `aml[0..]`: (the length it encodes, the bytes it takes).
        fn pkg_length(aml: &[u8]) -> (usize, usize) {
            let follow = usize::from(aml[0] >> 6);
            let mut length = if follow == 0 {
                usize::from(aml[0] & 0x3f)
            } else {
                usize::from(aml[0] & 0x0f)
            };
            for i in 0..follow {
                length |= usize::from(aml[1 + i]) << (4 + 8 * i);
            }
            (length, follow + 1)
        }

        impl Frame {
            /// Evaluates the term at `aml[*at..]`, moving `at` past it.
            fn term(&mut self, aml: &[u8], at: &mut usize) -> Value {
                let op = aml[*at];
                *at += 1;
                let mut fixed = |n: usize| {
                    let mut bytes = [0u8; 8];
                    bytes[..n].copy_from_slice(&aml[*at..*at + n]);
                    *at += n;
                    Value::Integer(u64::from_le_bytes(bytes))
                };
                match op {
                    0x00 => Value::Integer(0),
                    0x01 => Value::Integer(1),
                    0xff => Value::Integer(u64::MAX),
                    0x0a => fixed(1),
                    0x0b => fixed(2),
                    0x0c => fixed(4),
                    0x0e => fixed(8),
                    0x60..=0x67 => Value::Integer(self.locals[usize::from(op - 0x60)]),
                    0x68..=0x6e => self.args[usize::from(op - 0x68)].clone(),
                    0x11 => {
                        let start = *at;
                        let (length, taken) = pkg_length(&aml[*at..]);
                        *at += taken;
                        let size = self.term(aml, at).integer() as usize;
                        let end = start + length;
                        let mut bytes = aml[*at..end].to_vec();
                        bytes.resize(size, 0);
                        *at = end;
                        Value::Buffer(Rc::new(RefCell::new(bytes)))
                    }
                    0x92 => Value::Integer(u64::from(self.term(aml, at).integer() == 0)),
                    0x93 => {
                        let (a, b) = (self.term(aml, at), self.term(aml, at));
                        let equal = match (a, b) {
                            (Value::Integer(a), Value::Integer(b)) => a == b,
                            (Value::Buffer(a), Value::Buffer(b)) => *a.borrow() == *b.borrow(),
                            _ => false,
                        };
                        Value::Integer(u64::from(equal))
                    }
                    0x7b | 0x7d => {
                        let a = self.term(aml, at).integer();
                        let b = self.term(aml, at).integer();
                        let result = if op == 0x7b { a & b } else { a | b };
                        self.store(aml, at, result);
                        Value::Integer(result)
                    }
                    b'A'..=b'Z' | b'_' => {
                        *at -= 1;
                        let (buffer, offset) = self.fields[&self.name(aml, at)].clone();
                        let bytes = buffer.borrow();
                        Value::Integer(u64::from(u32_at(&bytes, offset)))
                    }
                    _ => panic!("_OSC uses opcode {op:#x}, which this interpreter lacks"),
                }
            }

            fn name(&self, aml: &[u8], at: &mut usize) -> [u8; 4] {
                let name = aml[*at..*at + 4].try_into().unwrap();
                *at += 4;
                name
            }

            /// Stores `value` into the target at `aml[*at..]` (a local or a buffer field).
            fn store(&mut self, aml: &[u8], at: &mut usize, value: u64) {
                let op = aml[*at];
                match op {
                    0x60..=0x67 => {
                        *at += 1;
                        self.locals[usize::from(op - 0x60)] = value;
                    }
                    _ => {
                        let (buffer, offset) = self.fields[&self.name(aml, at)].clone();
                        let bytes = (value as u32).to_le_bytes();
                        buffer.borrow_mut()[offset..offset + 4].copy_from_slice(&bytes);
                    }
                }
            }

            /// Runs the statements of `aml`; `Some` when one returned.
            fn run(&mut self, aml: &[u8]) -> Option<Value> {
                let mut at = 0;
                while at < aml.len() {
                    let op = aml[at];
                    match op {
                        0x8a => {
                            at += 1;
                            let Value::Buffer(buffer) = self.term(aml, &mut at) else {
                                panic!("CreateDWordField of no buffer");
                            };
                            let offset = self.term(aml, &mut at).integer() as usize;
                            assert!(offset + 4 <= buffer.borrow().len(), "field past the buffer");
                            let name = self.name(aml, &mut at);
                            self.fields.insert(name, (buffer, offset));
                        }
                        0x70 => {
                            at += 1;
                            let value = self.term(aml, &mut at).integer();
                            self.store(aml, &mut at, value);
                        }
                        0xa0 => {
                            let (length, taken) = pkg_length(&aml[at + 1..]);
                            let end = at + 1 + length;
                            let mut body = at + 1 + taken;
                            let taken_branch = self.term(aml, &mut body).integer() != 0;
                            if taken_branch {
                                if let Some(value) = self.run(&aml[body..end]) {
                                    return Some(value);
                                }
                            }
                            at = end;
                            if aml.get(at) == Some(&0xa1) {
                                let (length, taken) = pkg_length(&aml[at + 1..]);
                                let else_end = at + 1 + length;
                                if !taken_branch {
                                    let else_body = &aml[at + 1 + taken..else_end];
                                    if let Some(value) = self.run(else_body) {
                                        return Some(value);
                                    }
                                }
                                at = else_end;
                            }
                        }
                        0xa4 => {
                            at += 1;
                            return Some(self.term(aml, &mut at));
                        }
                        _ => {
                            // Expressions with a target (And, Or) are statements too.
                            self.term(aml, &mut at);
                        }
                    }
                }
                None
            }
        }

        /// The body of every `_OSC` method in `aml` (after its name and flags).
        fn osc_methods(aml: &[u8]) -> Vec<&[u8]> {
            let mut methods = Vec::new();
            for at in 0..aml.len().saturating_sub(6) {
                if aml[at] != METHOD_OP {
                    continue;
                }
                let (length, taken) = pkg_length(&aml[at + 1..]);
                let name_at = at + 1 + taken;
                if aml.get(name_at..name_at + 4) == Some(b"_OSC") {
                    assert_eq!(aml[name_at + 4] & 0x7, 4, "_OSC takes 4 arguments");
                    methods.push(&aml[name_at + 5..at + 1 + length]);
                }
            }
            methods
        }

        fn uuid_bytes(uuid: &str) -> Vec<u8> {
            let mut bytes = Vec::new();
            aml::Uuid::new(uuid).to_aml_bytes(&mut bytes);
            // BufferOp, PkgLength, BytePrefix 16: the data follows.
            bytes[4..].to_vec()
        }

        /// Calls `method` with (uuid, revision, 3, [status, support, control]); the three
        /// DWords it returns.
        fn call(method: &[u8], uuid: &[u8], revision: u64, dwords: [u32; 3]) -> [u32; 3] {
            let buffer: Vec<u8> = dwords.iter().flat_map(|d| d.to_le_bytes()).collect();
            let buffer = Rc::new(RefCell::new(buffer));
            let mut frame = Frame {
                args: vec![
                    Value::Buffer(Rc::new(RefCell::new(uuid.to_vec()))),
                    Value::Integer(revision),
                    Value::Integer(3),
                    Value::Buffer(buffer),
                ],
                locals: [0; 8],
                fields: HashMap::new(),
            };
            let Some(Value::Buffer(returned)) = frame.run(method) else {
                panic!("_OSC returned no buffer");
            };
            let bytes = returned.borrow();
            assert_eq!(bytes.len(), 12, "_OSC returns the buffer it was given");
            [u32_at(&bytes, 0), u32_at(&bytes, 4), u32_at(&bytes, 8)]
        }

        fn dsdt_aml(segments: u16) -> Vec<u8> {
            let tables = build(&AcpiConfig {
                vcpus: 1,
                max_vcpus: 0,
                memory_hotplug: false,
                pci_segments: super::segments(segments),
                power_off: true,
            })
            .unwrap();
            tables.find(b"DSDT").unwrap().1[36..].to_vec()
        }

        #[test]
        fn every_host_bridge_grants_linux_native_hot_plug() {
            let aml = dsdt_aml(3);
            let methods = osc_methods(&aml);
            assert_eq!(methods.len(), 3, "one _OSC per host bridge");
            let uuid = uuid_bytes(PCI_HOST_BRIDGE_OSC_UUID);
            for method in methods {
                // Linux's query: everything it wants; LTR is masked off and said so.
                let [status, support, granted] =
                    call(method, &uuid, 1, [QUERY, LINUX_SUPPORT, LINUX_REQUEST]);
                assert_eq!(granted, LINUX_REQUEST & OSC_GRANTED);
                assert_eq!(status, QUERY | OSC_STATUS_CAPABILITIES_MASKED);
                assert_eq!(support, LINUX_SUPPORT, "the support DWord is left alone");
                // Linux then asks for what the query offered, for real: all of it, no error.
                let [status, _, granted] = call(method, &uuid, 1, [0, LINUX_SUPPORT, granted]);
                assert_eq!(status, 0);
                for control in [
                    OSC_CONTROL_PCIE_NATIVE_HOTPLUG,
                    OSC_CONTROL_CAPABILITY_STRUCTURE,
                    OSC_CONTROL_PME,
                    OSC_CONTROL_AER,
                ] {
                    assert_ne!(granted & control, 0, "control {control:#x} granted");
                }
            }
        }

        #[test]
        fn osc_grants_only_what_is_asked_and_flags_bad_uuids_and_revisions() {
            let aml = dsdt_aml(1);
            let method = osc_methods(&aml)[0];
            let uuid = uuid_bytes(PCI_HOST_BRIDGE_OSC_UUID);
            let only_hotplug = OSC_CONTROL_PCIE_NATIVE_HOTPLUG;
            assert_eq!(
                call(method, &uuid, 1, [0, LINUX_SUPPORT, only_hotplug]),
                [0, LINUX_SUPPORT, only_hotplug]
            );
            assert_eq!(call(method, &uuid, 1, [0, 0, 0]), [0, 0, 0]);
            // Another revision: answered, and flagged.
            let [status, _, _] = call(method, &uuid, 2, [0, LINUX_SUPPORT, only_hotplug]);
            assert_eq!(status, OSC_STATUS_UNRECOGNIZED_REVISION);
            // Another UUID (CXL's): nothing granted, the request left as it was, flagged.
            let cxl = uuid_bytes("68F2D50B-C469-4D8A-BD3D-941A103FD3FC");
            assert_eq!(
                call(method, &cxl, 1, [0, LINUX_SUPPORT, LINUX_REQUEST]),
                [OSC_STATUS_UNRECOGNIZED_UUID, LINUX_SUPPORT, LINUX_REQUEST]
            );
        }
    }
}
