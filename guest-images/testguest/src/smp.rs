//! CPU discovery (MP table, else ACPI MADT), AP start-up with INIT/SIPI/SIPI through the xAPIC,
//! and the ring-3 primitives CPUs share: job dispatch and a barrier.

use crate::arch::{delay_us, pause, rdtsc};
use crate::boot::{self, MAX_CPUS, TRAMPOLINE_PADDR, TRAMPOLINE_SIPI_VECTOR};
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

const DEFAULT_LAPIC_BASE: u64 = 0xFEE0_0000;
const LAPIC_ID: u64 = 0x20;
const LAPIC_SVR: u64 = 0xF0;
const LAPIC_ICR_LOW: u64 = 0x300;
const LAPIC_ICR_HIGH: u64 = 0x310;
const ICR_INIT_ASSERT: u32 = 0x4500;
const ICR_STARTUP: u32 = 0x4600;

/// How long the BSP waits for one AP to reach ring 3 (its ring-0 path is emulated).
const AP_TIMEOUT_MS: u64 = 3000;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum CpuSource {
    MpTable,
    Madt,
    /// Neither table found: only the boot CPU is known.
    BootCpuOnly,
}

impl CpuSource {
    pub fn name(self) -> &'static str {
        match self {
            CpuSource::MpTable => "mptable",
            CpuSource::Madt => "madt",
            CpuSource::BootCpuOnly => "none",
        }
    }
}

pub struct CpuTable {
    apic_ids: [u32; MAX_CPUS],
    count: usize,
    pub lapic_base: u64,
    pub source: CpuSource,
    /// Enabled CPUs listed beyond MAX_CPUS (not started).
    pub ignored: usize,
}

impl CpuTable {
    fn new(source: CpuSource) -> CpuTable {
        CpuTable {
            apic_ids: [0; MAX_CPUS],
            count: 0,
            lapic_base: DEFAULT_LAPIC_BASE,
            source,
            ignored: 0,
        }
    }

    fn add(&mut self, apic_id: u32) {
        if self.apic_ids[..self.count].contains(&apic_id) {
            return;
        }
        if self.count == MAX_CPUS {
            self.ignored += 1;
            return;
        }
        self.apic_ids[self.count] = apic_id;
        self.count += 1;
    }

    pub fn apic_ids(&self) -> &[u32] {
        &self.apic_ids[..self.count]
    }
}

pub fn read_u8(paddr: u64) -> u8 {
    // SAFETY: low memory, BIOS areas and ACPI tables are identity mapped and user readable.
    unsafe { (paddr as *const u8).read_volatile() }
}

fn read_u16(paddr: u64) -> u16 {
    u16::from_le_bytes([read_u8(paddr), read_u8(paddr + 1)])
}

pub fn read_u32(paddr: u64) -> u32 {
    // SAFETY: as in read_u8.
    unsafe { (paddr as *const u32).read_unaligned() }
}

pub fn read_u64(paddr: u64) -> u64 {
    // SAFETY: as in read_u8.
    unsafe { (paddr as *const u64).read_unaligned() }
}

pub fn bytes_equal(paddr: u64, expected: &[u8]) -> bool {
    expected
        .iter()
        .enumerate()
        .all(|(i, &b)| read_u8(paddr + i as u64) == b)
}

pub fn checksum_ok(paddr: u64, len: u64) -> bool {
    (0..len).fold(0u8, |sum, i| sum.wrapping_add(read_u8(paddr + i))) == 0
}

/// Finds `signature` 16-byte aligned in [start, end) with a zero checksum over `len` bytes.
pub fn scan(start: u64, end: u64, signature: &[u8], len: u64) -> Option<u64> {
    (start..end)
        .step_by(16)
        .find(|&a| bytes_equal(a, signature) && checksum_ok(a, len))
}

fn from_mp_table() -> Option<CpuTable> {
    let floating =
        scan(0x9FC00, 0xA0000, b"_MP_", 16).or_else(|| scan(0xF0000, 0x100000, b"_MP_", 16))?;
    let config = read_u32(floating + 4) as u64;
    if config == 0 || !bytes_equal(config, b"PCMP") {
        return None;
    }
    let base_len = read_u16(config + 4) as u64;
    if base_len < 44 || !checksum_ok(config, base_len) {
        return None;
    }
    let mut table = CpuTable::new(CpuSource::MpTable);
    table.lapic_base = match read_u32(config + 36) {
        0 => DEFAULT_LAPIC_BASE,
        base => base as u64,
    };
    let entries = read_u16(config + 34);
    let end = config + base_len;
    let mut entry = config + 44;
    for _ in 0..entries {
        if entry >= end {
            break;
        }
        let len = match read_u8(entry) {
            0 => {
                // Processor: flags bit 0 = enabled.
                if read_u8(entry + 3) & 1 != 0 {
                    table.add(read_u8(entry + 1) as u32);
                }
                20
            }
            1..=4 => 8,
            _ => break,
        };
        entry += len;
    }
    (table.count > 0).then_some(table)
}

fn find_acpi_table(rsdp: u64, signature: &[u8; 4]) -> Option<u64> {
    let revision = read_u8(rsdp + 15);
    let xsdt = if revision >= 2 {
        read_u64(rsdp + 24)
    } else {
        0
    };
    let (root, entry_size) = if xsdt != 0 {
        (xsdt, 8)
    } else {
        (read_u32(rsdp + 16) as u64, 4)
    };
    if root == 0 {
        return None;
    }
    let root_len = read_u32(root + 4) as u64;
    if !(36..=0x10000).contains(&root_len) {
        return None;
    }
    (root + 36..root + root_len)
        .step_by(entry_size)
        .map(|p| {
            if entry_size == 8 {
                read_u64(p)
            } else {
                read_u32(p) as u64
            }
        })
        .find(|&t| t != 0 && bytes_equal(t, signature))
}

fn from_madt(rsdp_hint: u64) -> Option<CpuTable> {
    from_madt_where(rsdp_hint, |flags| flags & 1 != 0)
}

/// The MADT's processors that are not enabled but online capable (flags bit 1, ACPI 6.3):
/// the CPUs the VMM may hot-plug.
pub fn hotpluggable(rsdp_hint: u64) -> Option<CpuTable> {
    from_madt_where(rsdp_hint, |flags| flags & 3 == 2)
}

/// The MADT's processors whose flags `wanted` accepts.
fn from_madt_where(rsdp_hint: u64, wanted: fn(u32) -> bool) -> Option<CpuTable> {
    let rsdp = if rsdp_hint != 0 && bytes_equal(rsdp_hint, b"RSD PTR ") {
        rsdp_hint
    } else {
        scan(0xE0000, 0x100000, b"RSD PTR ", 20)?
    };
    let madt = find_acpi_table(rsdp, b"APIC")?;
    let madt_len = read_u32(madt + 4) as u64;
    if !(44..=0x10000).contains(&madt_len) {
        return None;
    }
    let mut table = CpuTable::new(CpuSource::Madt);
    table.lapic_base = read_u32(madt + 36) as u64;
    let mut entry = madt + 44;
    while entry + 2 <= madt + madt_len {
        let kind = read_u8(entry);
        let len = read_u8(entry + 1) as u64;
        if len < 2 {
            break;
        }
        match kind {
            // Processor local APIC: flags bit 0 = enabled.
            0 if wanted(read_u32(entry + 4)) => table.add(read_u8(entry + 3) as u32),
            // Local APIC address override.
            5 => table.lapic_base = read_u64(entry + 4),
            // Processor local x2APIC: only IDs the xAPIC can address.
            9 if wanted(read_u32(entry + 8)) && read_u32(entry + 4) < 0xff => {
                table.add(read_u32(entry + 4))
            }
            _ => {}
        }
        entry += len;
    }
    (table.count > 0).then_some(table)
}

/// The CPUs the platform describes: MP table first, then the ACPI MADT.
pub fn discover(rsdp_paddr: u64) -> CpuTable {
    from_mp_table()
        .or_else(|| from_madt(rsdp_paddr))
        .unwrap_or_else(|| CpuTable::new(CpuSource::BootCpuOnly))
}

struct Lapic {
    base: u64,
}

impl Lapic {
    fn read(&self, reg: u64) -> u32 {
        // SAFETY: the local APIC page is identity mapped (user); MMIO reads have no memory effects.
        unsafe { ((self.base + reg) as *const u32).read_volatile() }
    }

    fn write(&self, reg: u64, value: u32) {
        // SAFETY: as in `read`; writes go to the emulated local APIC.
        unsafe { ((self.base + reg) as *mut u32).write_volatile(value) }
    }

    fn send_ipi(&self, apic_id: u32, command: u32) {
        self.write(LAPIC_ICR_HIGH, apic_id << 24);
        self.write(LAPIC_ICR_LOW, command);
    }
}

/// CPUs in ring 3 (BSP included); indices 0..ONLINE are in use.
static ONLINE: AtomicUsize = AtomicUsize::new(1);
/// Parameters of the AP being started (one at a time).
static BOOTING_INDEX: AtomicUsize = AtomicUsize::new(0);
static BOOTING_APIC: AtomicU32 = AtomicU32::new(0);
/// Hand-shake of the AP being started: the AP claims the slot (WAITING -> CLAIMED), prints,
/// counts itself online (READY); a BSP that times out abandons it (WAITING -> ABANDONED) so a late
/// AP parks without taking part.
static BOOTING_STATE: AtomicU32 = AtomicU32::new(STATE_ABANDONED);
const STATE_WAITING: u32 = 0;
const STATE_CLAIMED: u32 = 1;
const STATE_READY: u32 = 2;
const STATE_ABANDONED: u32 = 3;
/// Job for the APs: a `fn(usize)` as usize, 0 = none yet.
static JOB: AtomicUsize = AtomicUsize::new(0);

pub struct BringUp {
    /// CPUs in ring 3, BSP included.
    pub online: usize,
    /// CPUs expected (table entries, BSP included).
    pub expected: usize,
}

/// Starts APs with INIT/SIPI/SIPI, one at a time: the trampoline is in place and the BSP's
/// local APIC enabled once it exists.
pub struct Starter {
    lapic: Lapic,
    tsc_hz: u64,
    /// TSC ticks the BSP waits for one AP.
    timeout: u64,
}

impl Starter {
    pub fn new(lapic_base: u64, tsc_hz: u64) -> Starter {
        let lapic = Lapic { base: lapic_base };
        // Software-enable the local APIC (spurious vector 0xff); IF stays clear in ring 3.
        lapic.write(LAPIC_SVR, lapic.read(LAPIC_SVR) | 0x1ff);
        let tramp = boot::trampoline();
        // SAFETY: the trampoline page below 1 MiB is RAM the guest does not otherwise use (boot
        // info was copied out before); identity mapped and user writable.
        unsafe {
            core::ptr::copy_nonoverlapping(tramp.as_ptr(), TRAMPOLINE_PADDR as *mut u8, tramp.len())
        };
        Starter {
            lapic,
            tsc_hz,
            timeout: tsc_hz / 1000 * AP_TIMEOUT_MS,
        }
    }

    pub fn bsp_apic_id(&self) -> u32 {
        self.lapic.read(LAPIC_ID) >> 24
    }

    /// Starts the CPU with local APIC id `apic_id` into `tg_ap_main` (ring 3, where it prints
    /// "smp: cpu <index> apic <id> online" and runs the job); its index, or None if it did not
    /// arrive in time or no slot is left.
    pub fn start(&self, apic_id: u32) -> Option<usize> {
        let (lapic, tsc_hz) = (&self.lapic, self.tsc_hz);
        let index = ONLINE.load(Ordering::Acquire);
        if index >= MAX_CPUS {
            return None;
        }
        boot::prepare_ap_boot(index, tg_ap_main);
        BOOTING_INDEX.store(index, Ordering::Relaxed);
        BOOTING_APIC.store(apic_id, Ordering::Relaxed);
        BOOTING_STATE.store(STATE_WAITING, Ordering::Release);

        lapic.send_ipi(apic_id, ICR_INIT_ASSERT);
        delay_us(tsc_hz, 10_000);
        lapic.send_ipi(apic_id, ICR_STARTUP | TRAMPOLINE_SIPI_VECTOR);
        delay_us(tsc_hz, 200);
        // A second SIPI is ignored by an AP that already left wait-for-SIPI.
        if BOOTING_STATE.load(Ordering::Acquire) == STATE_WAITING {
            lapic.send_ipi(apic_id, ICR_STARTUP | TRAMPOLINE_SIPI_VECTOR);
        }
        let start = rdtsc();
        while BOOTING_STATE.load(Ordering::Acquire) == STATE_WAITING
            && rdtsc().wrapping_sub(start) < self.timeout
        {
            pause();
        }
        if BOOTING_STATE
            .compare_exchange(
                STATE_WAITING,
                STATE_ABANDONED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            return None;
        }
        // Claimed: the AP is in ring 3 and only has its line to print.
        while BOOTING_STATE.load(Ordering::Acquire) != STATE_READY {
            pause();
        }
        Some(index)
    }
}

/// Starts every AP of `table`, one after the other, each running `tg_ap_main` in ring 3 where
/// it prints "smp: cpu <index> apic <id> online" and waits for a job. Stops at the first AP that
/// does not arrive in time.
pub fn bring_up(table: &CpuTable, tsc_hz: u64) -> BringUp {
    let starter = Starter::new(table.lapic_base, tsc_hz);
    let bsp_apic_id = starter.bsp_apic_id();
    let expected = table.apic_ids().len() + usize::from(!table.apic_ids().contains(&bsp_apic_id));
    crate::println!("smp: cpu 0 apic {bsp_apic_id} online");
    for &apic_id in table.apic_ids().iter().filter(|&&id| id != bsp_apic_id) {
        if starter.start(apic_id).is_none() {
            break;
        }
    }
    BringUp {
        online: ONLINE.load(Ordering::Acquire),
        expected,
    }
}

extern "sysv64" fn tg_ap_main() -> ! {
    crate::arch::init_fpu();
    let index = BOOTING_INDEX.load(Ordering::Relaxed);
    let apic_id = BOOTING_APIC.load(Ordering::Relaxed);
    if BOOTING_STATE
        .compare_exchange(
            STATE_WAITING,
            STATE_CLAIMED,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        // Too late: the BSP gave up on this CPU.
        crate::console::halt_forever();
    }
    crate::println!("smp: cpu {index} apic {apic_id} online");
    ONLINE.fetch_add(1, Ordering::AcqRel);
    BOOTING_STATE.store(STATE_READY, Ordering::Release);
    loop {
        let job = JOB.load(Ordering::Acquire);
        if job != 0 {
            // SAFETY: JOB only ever holds a `fn(usize)` stored by `run_on_aps`.
            let job: fn(usize) = unsafe { core::mem::transmute::<usize, fn(usize)>(job) };
            job(index);
            crate::console::halt_forever();
        }
        pause();
    }
}

/// Lets every online AP call `job(cpu_index)` once (data for it must be published before).
pub fn run_on_aps(job: fn(usize)) {
    JOB.store(job as usize, Ordering::Release);
}

/// Sense-free barrier over a generation counter (ring 3, spinning).
pub struct Barrier {
    arrived: AtomicUsize,
    generation: AtomicUsize,
}

impl Barrier {
    pub const fn new() -> Barrier {
        Barrier {
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
        }
    }

    pub fn wait(&self, participants: usize) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == participants {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
        } else {
            while self.generation.load(Ordering::Acquire) == generation {
                pause();
            }
        }
    }
}
