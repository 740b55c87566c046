//! ACPI memory hot-plug in the DSDT: a container with one memory device (`PNP0C80`) per
//! slot of gpuvm_devices::memory_hotplug's register block, the interface QEMU's ACPI
//! memory hot-plug offers (its docs/specs/acpi_mem_hotplug.rst), which Linux's
//! acpi_memhotplug driver uses.
//!
//! ```text
//! Device (\_SB.MHPC) {                        container, _HID PNP0A06
//!   Mutex (MLCK)
//!   OperationRegion (MHPR, SystemIO, MEMORY_HOTPLUG_PORT, MEMORY_HOTPLUG_PORT_LEN)
//!   Field (MHPR, DWordAcc) { MBAL, 32, MBAH, 32, MLNL, 32, MLNH, 32 }     reads
//!   Field (MHPR, DWordAcc) { MSEL, 32, MOEV, 32, MOSC, 32 }              writes
//!   Field (MHPR, ByteAcc)  { Offset (0x14), MEN_, 1, MINS, 1, MRMV, 1, MEJ_, 1,
//!                            Offset (0x18), MEVN, 32 }
//!   Method (MSTA, 1)  { MSEL = Arg0; Return (MEN_ ? 0xF : 0) }           _STA of slot Arg0
//!   Method (MCRS, 1)  { MSEL = Arg0; QWordMemory from MBAx and MLNx }     _CRS of slot Arg0
//!   Method (MOST, 4)  { MSEL = Arg0; MOEV = Arg1; MOSC = Arg2 }          _OST of slot Arg0
//!   Method (MEJ0, 2)  { MSEL = Arg0; MEJ_ = 1 }                          _EJ0 of slot Arg0
//!   Method (MTFY, 2)  { If (Arg0 == n) { Notify (MPnn, Arg1) } ... }
//!   Method (MSCN)     { for each slot n: MSEL = n;                       run by \_SB.GED0._EVT
//!                         If (MINS) { MTFY (n, 1); MINS = 1 }            device check: inserted
//!                         If (MRMV) { MTFY (n, 3); MRMV = 1 } }          eject request
//!   Device (MPnn) { _HID PNP0C80, _UID n, _CRS, _STA, _OST, _EJ0 }
//! }
//! ```
//!
//! Every register access is under the mutex (MSEL selects for the accesses after it).

use acpi_tables::aml::{self, AddressSpaceCacheable};
use acpi_tables::{Aml, AmlSink};
use gpuvm_devices::memory_hotplug::{
    MEMORY_HOTPLUG_PORT, MEMORY_HOTPLUG_PORT_LEN, MEMORY_HOTPLUG_SLOTS,
};

/// The container's methods and fields, for the GED's `_EVT` and `_INI`.
pub const MSCN_PATH: &str = "\\_SB_.MHPC.MSCN";
pub const MEVN_PATH: &str = "\\_SB_.MHPC.MEVN";
/// Acquire's timeout: wait forever.
const FOREVER: u16 = 0xffff;
/// Byte offsets of the QWord address space descriptor's minimum, maximum and length.
const QWORD_MIN: u8 = 14;
const QWORD_MAX: u8 = 22;
const QWORD_LEN: u8 = 38;

fn slot_name(slot: u8) -> String {
    format!("MP{slot:02X}")
}

/// `\_SB.MHPC` with [`MEMORY_HOTPLUG_SLOTS`] memory devices; with NUMA nodes, each has the
/// proximity domain of the hot-plug area (`_PXM`, as the SRAT's hot-pluggable range says),
/// so the guest adds the RAM to that node.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryHotplugAml {
    pub proximity_domain: Option<u32>,
}

struct MemoryDeviceAml {
    slot: u8,
    proximity_domain: Option<u32>,
}

impl Aml for MemoryDeviceAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let uid = u32::from(self.slot);
        let crs_call = aml::MethodCall::new("MCRS".into(), vec![&uid]);
        let crs_return = aml::Return::new(&crs_call);
        let crs = aml::Method::new("_CRS".into(), 0, false, vec![&crs_return]);
        let sta_call = aml::MethodCall::new("MSTA".into(), vec![&uid]);
        let sta_return = aml::Return::new(&sta_call);
        let sta = aml::Method::new("_STA".into(), 0, false, vec![&sta_return]);
        let ost_call = aml::MethodCall::new(
            "MOST".into(),
            vec![&uid, &aml::Arg(0), &aml::Arg(1), &aml::Arg(2)],
        );
        let ost = aml::Method::new("_OST".into(), 3, false, vec![&ost_call]);
        let ej0_call = aml::MethodCall::new("MEJ0".into(), vec![&uid, &aml::Arg(0)]);
        let ej0 = aml::Method::new("_EJ0".into(), 1, false, vec![&ej0_call]);
        let hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C80"));
        let uid_name = aml::Name::new("_UID".into(), &uid);
        let pxm = self
            .proximity_domain
            .map(|domain| aml::Name::new("_PXM".into(), &domain));
        let mut children: Vec<&dyn Aml> = vec![&hid, &uid_name];
        if let Some(pxm) = &pxm {
            children.push(pxm);
        }
        children.extend([&crs as &dyn Aml, &sta, &ost, &ej0]);
        aml::Device::new(slot_name(self.slot).as_str().into(), children).to_aml_bytes(sink);
    }
}

impl Aml for MemoryHotplugAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let port = u64::from(MEMORY_HOTPLUG_PORT);
        let len = u64::from(MEMORY_HOTPLUG_PORT_LEN);
        let region = aml::OpRegion::new("MHPR".into(), aml::OpRegionSpace::SystemIO, &port, &len);
        let reads = aml::Field::new(
            "MHPR".into(),
            aml::FieldAccessType::DWord,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::Preserve,
            vec![
                aml::FieldEntry::Named(*b"MBAL", 32),
                aml::FieldEntry::Named(*b"MBAH", 32),
                aml::FieldEntry::Named(*b"MLNL", 32),
                aml::FieldEntry::Named(*b"MLNH", 32),
            ],
        );
        let writes = aml::Field::new(
            "MHPR".into(),
            aml::FieldAccessType::DWord,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::Preserve,
            vec![
                aml::FieldEntry::Named(*b"MSEL", 32),
                aml::FieldEntry::Named(*b"MOEV", 32),
                aml::FieldEntry::Named(*b"MOSC", 32),
            ],
        );
        let flags = aml::Field::new(
            "MHPR".into(),
            aml::FieldAccessType::Byte,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::WriteAsZeroes,
            vec![
                aml::FieldEntry::Reserved(0x14 * 8),
                aml::FieldEntry::Named(*b"MEN_", 1),
                aml::FieldEntry::Named(*b"MINS", 1),
                aml::FieldEntry::Named(*b"MRMV", 1),
                aml::FieldEntry::Named(*b"MEJ_", 1),
                aml::FieldEntry::Reserved(28),
                aml::FieldEntry::Named(*b"MEVN", 32),
            ],
        );
        let acquire = aml::Acquire::new("MLCK".into(), FOREVER);
        let release = aml::Release::new("MLCK".into());
        let msel: aml::Path = "MSEL".into();
        let men: aml::Path = "MEN_".into();
        let mins: aml::Path = "MINS".into();
        let mrmv: aml::Path = "MRMV".into();
        let mej: aml::Path = "MEJ_".into();
        let select_arg = aml::Store::new(&msel, &aml::Arg(0));

        // MSTA (Arg0): _STA of slot Arg0.
        let status: u8 = 0xf;
        let absent = aml::Store::new(&aml::Local(0), &aml::ZERO);
        let is_present = aml::Equal::new(&men, &aml::ONE);
        let present = aml::Store::new(&aml::Local(0), &status);
        let if_present = aml::If::new(&is_present, vec![&present]);
        let give_local = aml::Return::new(&aml::Local(0));
        let msta = aml::Method::new(
            "MSTA".into(),
            1,
            true,
            vec![
                &acquire,
                &select_arg,
                &absent,
                &if_present,
                &release,
                &give_local,
            ],
        );

        // MCRS (Arg0): _CRS of slot Arg0, a QWordMemory filled from the registers.
        let template = aml::AddressSpace::new_memory(
            AddressSpaceCacheable::Cacheable,
            true,
            0u64,
            u64::MAX - 1,
            None,
        );
        let mr64: aml::Path = "MR64".into();
        let resources = aml::ResourceTemplate::new(vec![&template]);
        let name_mr64 = aml::Name::new("MR64".into(), &resources);
        let (minl, maxl, lenl): (aml::Path, aml::Path, aml::Path) =
            ("MINL".into(), "MAXL".into(), "LENL".into());
        let field_min = aml::CreateQWordField::new(&minl, &mr64, &QWORD_MIN);
        let field_max = aml::CreateQWordField::new(&maxl, &mr64, &QWORD_MAX);
        let field_len = aml::CreateQWordField::new(&lenl, &mr64, &QWORD_LEN);
        let (mbal, mbah, mlnl, mlnh): (aml::Path, aml::Path, aml::Path, aml::Path) =
            ("MBAL".into(), "MBAH".into(), "MLNL".into(), "MLNH".into());
        let shift: u8 = 32;
        let base_high = aml::ShiftLeft::new(&aml::Local(0), &mbah, &shift);
        let base = aml::Or::new(&minl, &aml::Local(0), &mbal);
        let len_high = aml::ShiftLeft::new(&aml::Local(0), &mlnh, &shift);
        let length = aml::Or::new(&lenl, &aml::Local(0), &mlnl);
        let end = aml::Add::new(&aml::Local(1), &minl, &lenl);
        let last = aml::Subtract::new(&maxl, &aml::Local(1), &aml::ONE);
        let give_resources = aml::Return::new(&mr64);
        let mcrs = aml::Method::new(
            "MCRS".into(),
            1,
            true,
            vec![
                &acquire,
                &name_mr64,
                &field_min,
                &field_max,
                &field_len,
                &select_arg,
                &base_high,
                &base,
                &len_high,
                &length,
                &end,
                &last,
                &release,
                &give_resources,
            ],
        );

        // MOST (Arg0, Arg1, Arg2, Arg3): _OST of slot Arg0.
        let (moev, mosc): (aml::Path, aml::Path) = ("MOEV".into(), "MOSC".into());
        let event = aml::Store::new(&moev, &aml::Arg(1));
        let ost_status = aml::Store::new(&mosc, &aml::Arg(2));
        let most = aml::Method::new(
            "MOST".into(),
            4,
            true,
            vec![&acquire, &select_arg, &event, &ost_status, &release],
        );

        // MEJ0 (Arg0, Arg1): _EJ0 of slot Arg0.
        let eject = aml::Store::new(&mej, &aml::ONE);
        let mej0 = aml::Method::new(
            "MEJ0".into(),
            2,
            true,
            vec![&acquire, &select_arg, &eject, &release],
        );

        // MTFY (Arg0, Arg1): Notify (slot Arg0, Arg1).
        let uids: Vec<u32> = (0..MEMORY_HOTPLUG_SLOTS).map(u32::from).collect();
        let names: Vec<aml::Path> = (0..MEMORY_HOTPLUG_SLOTS)
            .map(|slot| slot_name(slot).as_str().into())
            .collect();
        let notifies: Vec<aml::Notify> = names
            .iter()
            .map(|name| aml::Notify::new(name, &aml::Arg(1)))
            .collect();
        let matches: Vec<aml::Equal> = uids
            .iter()
            .map(|uid| aml::Equal::new(&aml::Arg(0), uid))
            .collect();
        let ifs: Vec<aml::If> = matches
            .iter()
            .zip(&notifies)
            .map(|(test, notify)| aml::If::new(test, vec![notify]))
            .collect();
        let mtfy = aml::Method::new(
            "MTFY".into(),
            2,
            true,
            ifs.iter().map(|i| i as &dyn Aml).collect(),
        );

        // MSCN: every slot's pending insert and remove events.
        let (check, eject_request) = (1u8, 3u8);
        let count = u32::from(MEMORY_HOTPLUG_SLOTS);
        let start = aml::Store::new(&aml::Local(0), &aml::ZERO);
        let more = aml::LessThan::new(&aml::Local(0), &count);
        let select_local = aml::Store::new(&msel, &aml::Local(0));
        let inserting = aml::Equal::new(&mins, &aml::ONE);
        let tell_insert = aml::MethodCall::new("MTFY".into(), vec![&aml::Local(0), &check]);
        let clear_insert = aml::Store::new(&mins, &aml::ONE);
        let on_insert = aml::If::new(&inserting, vec![&tell_insert, &clear_insert]);
        let removing = aml::Equal::new(&mrmv, &aml::ONE);
        let tell_remove = aml::MethodCall::new("MTFY".into(), vec![&aml::Local(0), &eject_request]);
        let clear_remove = aml::Store::new(&mrmv, &aml::ONE);
        let on_remove = aml::If::new(&removing, vec![&tell_remove, &clear_remove]);
        let next = aml::Add::new(&aml::Local(0), &aml::Local(0), &aml::ONE);
        let scan = aml::While::new(&more, vec![&select_local, &on_insert, &on_remove, &next]);
        let mscn = aml::Method::new(
            "MSCN".into(),
            0,
            true,
            vec![&acquire, &start, &scan, &release],
        );

        let hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A06"));
        let uid = aml::Name::new("_UID".into(), &"Memory hotplug resources");
        let mutex = aml::Mutex::new("MLCK".into(), 0);
        let devices: Vec<MemoryDeviceAml> = (0..MEMORY_HOTPLUG_SLOTS)
            .map(|slot| MemoryDeviceAml {
                slot,
                proximity_domain: self.proximity_domain,
            })
            .collect();
        let mut children: Vec<&dyn Aml> = vec![
            &hid, &uid, &mutex, &region, &reads, &writes, &flags, &msta, &mcrs, &most, &mej0,
            &mtfy, &mscn,
        ];
        children.extend(devices.iter().map(|d| d as &dyn Aml));
        aml::Device::new("MHPC".into(), children).to_aml_bytes(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn every_slot_has_a_memory_device_with_its_methods() {
        let mut aml = Vec::new();
        MemoryHotplugAml::default().to_aml_bytes(&mut aml);
        assert!(!contains(&aml, b"_PXM"), "no NUMA, no _PXM");
        for name in [
            b"MHPC", b"MLCK", b"MHPR", b"MSEL", b"MBAL", b"MLNH", b"MEN_", b"MINS", b"MEVN",
            b"MSTA", b"MCRS", b"MOST", b"MEJ0", b"MTFY", b"MSCN", b"_OST", b"_EJ0", b"_CRS",
        ] {
            assert!(contains(&aml, name), "{}", String::from_utf8_lossy(name));
        }
        let last = slot_name(MEMORY_HOTPLUG_SLOTS - 1);
        assert!(contains(&aml, last.as_bytes()), "{last}");
        let beyond = slot_name(MEMORY_HOTPLUG_SLOTS);
        assert!(!contains(&aml, beyond.as_bytes()), "{beyond}");
        // PNP0C80 as an EISA id, once per slot.
        let mut pnp0c80 = Vec::new();
        aml::EISAName::new("PNP0C80").to_aml_bytes(&mut pnp0c80);
        let count = aml
            .windows(pnp0c80.len())
            .filter(|w| *w == pnp0c80.as_slice())
            .count();
        assert_eq!(count, usize::from(MEMORY_HOTPLUG_SLOTS));
        // The register block: OperationRegion (MHPR, SystemIO, port, len).
        let mut port = Vec::new();
        u64::from(MEMORY_HOTPLUG_PORT).to_aml_bytes(&mut port);
        assert!(contains(&aml, &port));
        // A fixed, small size whatever the hot-plug size (the DSDT shares 64 KiB).
        assert!(aml.len() < 4096, "{} bytes", aml.len());
    }

    #[test]
    fn with_numa_every_memory_device_has_the_hot_plug_areas_domain() {
        let mut aml = Vec::new();
        MemoryHotplugAml {
            proximity_domain: Some(1),
        }
        .to_aml_bytes(&mut aml);
        let mut pxm = Vec::new();
        aml::Name::new("_PXM".into(), &1u32).to_aml_bytes(&mut pxm);
        let count = aml
            .windows(pxm.len())
            .filter(|w| *w == pxm.as_slice())
            .count();
        assert_eq!(count, usize::from(MEMORY_HOTPLUG_SLOTS));
    }
}
