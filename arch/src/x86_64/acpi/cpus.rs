//! ACPI CPU hot-plug in the DSDT, as Cloud Hypervisor's: a processor container with one
//! processor device per possible vCPU, over gpuvm_devices::cpu_hotplug's register block.
//!
//! ```text
//! Device (\_SB.CPUS) {                       processor container
//!   _HID "ACPI0010", _CID PNP0A05
//!   Mutex (CPLK)
//!   OperationRegion (PRST, SystemIO, CPU_HOTPLUG_PORT, CPU_HOTPLUG_PORT_LEN)
//!   Field (PRST, DWordAcc) { CSEL, 32 }
//!   Field (PRST, ByteAcc)  { Offset (4), CPEN, 1, CINS, 1, CRMV, 1, CEJF, 1, Offset (8), CEVN, 32 }
//!   Method (CSTA, 1) { CSEL = Arg0; Return (CPEN ? 0xF : 0) }          _STA of CPU Arg0
//!   Method (CEJX, 1) { CSEL = Arg0; CEJF = 1 }                          _EJ0 of CPU Arg0
//!   Method (CTFY, 2) { If (Arg0 == n) { Notify (Cnnn, Arg1) } ... }
//!   Method (CSCN)    { for each CPU n: CSEL = n;                        run by \_SB.GED0._EVT
//!                        If (CINS) { CTFY (n, 1); CINS = 1 }            device check: inserted
//!                        If (CRMV) { CTFY (n, 3); CRMV = 1 } }          eject request
//!   Device (Cnnn) { _HID "ACPI0007", _UID n, _STA: CSTA (n),
//!                   _MAT: the MADT local APIC entry of CPU n (enabled), _EJ0: CEJX (n) }
//! }
//! ```
//!
//! The register accesses are under the mutex (CSEL selects for the accesses after it).
//! `_UID` n is the MADT's processor UID and APIC id n: Linux maps the device to its CPU
//! through `_MAT` (or the MADT) and onlines it on the device check.

use acpi_tables::aml;
use acpi_tables::{Aml, AmlSink};
use gpuvm_devices::cpu_hotplug::{CPU_HOTPLUG_PORT, CPU_HOTPLUG_PORT_LEN};

/// The container's path, for the GED's `_EVT` and `_INI`.
pub const CSCN_PATH: &str = "\\_SB_.CPUS.CSCN";
pub const CEVN_PATH: &str = "\\_SB_.CPUS.CEVN";
/// MADT local APIC flags: enabled.
const LAPIC_ENABLED: u32 = 1;
/// Acquire's timeout: wait forever.
const FOREVER: u16 = 0xffff;

fn cpu_name(cpu: u8) -> String {
    format!("C{cpu:03X}")
}

/// The MADT's Processor Local APIC structure for CPU `cpu` (UID = APIC id = `cpu`),
/// enabled: what `_MAT` returns once the CPU is present.
pub fn local_apic_entry(cpu: u8) -> Vec<u8> {
    let mut entry = vec![0u8, 8, cpu, cpu];
    entry.extend_from_slice(&LAPIC_ENABLED.to_le_bytes());
    entry
}

/// `\_SB.CPUS` for `max_vcpus` possible CPUs.
pub struct CpuHotplugAml {
    pub max_vcpus: u8,
}

struct CpuDeviceAml {
    cpu: u8,
}

impl Aml for CpuDeviceAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let uid = u32::from(self.cpu);
        let sta_call = aml::MethodCall::new("CSTA".into(), vec![&uid]);
        let sta_return = aml::Return::new(&sta_call);
        let sta = aml::Method::new("_STA".into(), 0, false, vec![&sta_return]);
        let mat_buffer = aml::BufferData::new(local_apic_entry(self.cpu));
        let mat_return = aml::Return::new(&mat_buffer);
        let mat = aml::Method::new("_MAT".into(), 0, false, vec![&mat_return]);
        let ej0_call = aml::MethodCall::new("CEJX".into(), vec![&uid]);
        let ej0 = aml::Method::new("_EJ0".into(), 1, false, vec![&ej0_call]);
        aml::Device::new(
            cpu_name(self.cpu).as_str().into(),
            vec![
                &aml::Name::new("_HID".into(), &"ACPI0007"),
                &aml::Name::new("_UID".into(), &uid),
                &sta,
                &mat,
                &ej0,
            ],
        )
        .to_aml_bytes(sink);
    }
}

impl Aml for CpuHotplugAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        let port = u64::from(CPU_HOTPLUG_PORT);
        let len = u64::from(CPU_HOTPLUG_PORT_LEN);
        let region = aml::OpRegion::new("PRST".into(), aml::OpRegionSpace::SystemIO, &port, &len);
        let selector = aml::Field::new(
            "PRST".into(),
            aml::FieldAccessType::DWord,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::WriteAsZeroes,
            vec![aml::FieldEntry::Named(*b"CSEL", 32)],
        );
        let flags = aml::Field::new(
            "PRST".into(),
            aml::FieldAccessType::Byte,
            aml::FieldLockRule::NoLock,
            aml::FieldUpdateRule::WriteAsZeroes,
            vec![
                aml::FieldEntry::Reserved(32),
                aml::FieldEntry::Named(*b"CPEN", 1),
                aml::FieldEntry::Named(*b"CINS", 1),
                aml::FieldEntry::Named(*b"CRMV", 1),
                aml::FieldEntry::Named(*b"CEJF", 1),
                aml::FieldEntry::Reserved(28),
                aml::FieldEntry::Named(*b"CEVN", 32),
            ],
        );
        let acquire = aml::Acquire::new("CPLK".into(), FOREVER);
        let release = aml::Release::new("CPLK".into());
        let (csel, cpen, cins, crmv, cejf): (
            aml::Path,
            aml::Path,
            aml::Path,
            aml::Path,
            aml::Path,
        ) = (
            "CSEL".into(),
            "CPEN".into(),
            "CINS".into(),
            "CRMV".into(),
            "CEJF".into(),
        );
        let status: u8 = 0xf;

        // CSTA (Arg0): _STA of CPU Arg0.
        let select_arg = aml::Store::new(&csel, &aml::Arg(0));
        let absent = aml::Store::new(&aml::Local(0), &aml::ZERO);
        let is_present = aml::Equal::new(&cpen, &aml::ONE);
        let present = aml::Store::new(&aml::Local(0), &status);
        let if_present = aml::If::new(&is_present, vec![&present]);
        let give = aml::Return::new(&aml::Local(0));
        let csta = aml::Method::new(
            "CSTA".into(),
            1,
            true,
            vec![&acquire, &select_arg, &absent, &if_present, &release, &give],
        );

        // CEJX (Arg0): _EJ0 of CPU Arg0.
        let eject = aml::Store::new(&cejf, &aml::ONE);
        let cejx = aml::Method::new(
            "CEJX".into(),
            1,
            true,
            vec![&acquire, &select_arg, &eject, &release],
        );

        // CTFY (Arg0, Arg1): Notify (CPU Arg0, Arg1).
        let uids: Vec<u32> = (0..self.max_vcpus).map(u32::from).collect();
        let names: Vec<aml::Path> = (0..self.max_vcpus)
            .map(|cpu| cpu_name(cpu).as_str().into())
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
        let ctfy = aml::Method::new(
            "CTFY".into(),
            2,
            true,
            ifs.iter().map(|i| i as &dyn Aml).collect(),
        );

        // CSCN: every CPU's pending insert and remove events.
        let (check, eject_request) = (1u8, 3u8);
        let count = u32::from(self.max_vcpus);
        let start = aml::Store::new(&aml::Local(0), &aml::ZERO);
        let more = aml::LessThan::new(&aml::Local(0), &count);
        let select_local = aml::Store::new(&csel, &aml::Local(0));
        let inserting = aml::Equal::new(&cins, &aml::ONE);
        let tell_insert = aml::MethodCall::new("CTFY".into(), vec![&aml::Local(0), &check]);
        let clear_insert = aml::Store::new(&cins, &aml::ONE);
        let on_insert = aml::If::new(&inserting, vec![&tell_insert, &clear_insert]);
        let removing = aml::Equal::new(&crmv, &aml::ONE);
        let tell_remove = aml::MethodCall::new("CTFY".into(), vec![&aml::Local(0), &eject_request]);
        let clear_remove = aml::Store::new(&crmv, &aml::ONE);
        let on_remove = aml::If::new(&removing, vec![&tell_remove, &clear_remove]);
        let next = aml::Add::new(&aml::Local(0), &aml::Local(0), &aml::ONE);
        let scan = aml::While::new(&more, vec![&select_local, &on_insert, &on_remove, &next]);
        let cscn = aml::Method::new(
            "CSCN".into(),
            0,
            true,
            vec![&acquire, &start, &scan, &release],
        );

        let hid = aml::Name::new("_HID".into(), &"ACPI0010");
        let cid = aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A05"));
        let mutex = aml::Mutex::new("CPLK".into(), 0);
        let cpus: Vec<CpuDeviceAml> = (0..self.max_vcpus)
            .map(|cpu| CpuDeviceAml { cpu })
            .collect();
        let mut children: Vec<&dyn Aml> = vec![
            &hid, &cid, &mutex, &region, &selector, &flags, &csta, &cejx, &ctfy, &cscn,
        ];
        children.extend(cpus.iter().map(|c| c as &dyn Aml));
        aml::Device::new("CPUS".into(), children).to_aml_bytes(sink);
    }
}
