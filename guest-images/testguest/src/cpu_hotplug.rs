//! The `cpu-hotplug` workload: brings hot-plugged CPUs online and gives ejected ones back,
//! forever (the VMM's vm.resize drives it; the test ends the VM).
//!
//! It uses gpuvm's ACPI CPU hot-plug registers the way the DSDT's AML does (CSCN selects
//! each CPU and reads its flags, _EJ0 writes CEJ0), from ring 3 and by polling: no ACPI
//! interpreter, no GED interrupt. A CPU whose insert event it sees is started with
//! INIT/SIPI/SIPI (smp.rs) and checks itself in ring 3: its local APIC id and the initial
//! APIC id CPUID reports must be the CPU the VMM added, then it prints
//! `cpu-hotplug: cpu N online`. A CPU the VMM asks to eject stops running the job (it spins
//! in ring 3, as a dead CPU would halt) and is ejected: `cpu-hotplug: cpu N ejected`.

use core::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::arch::{cpuid, inl, outl, pause};
use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::println;
use crate::smp;

/// gpuvm_devices::cpu_hotplug's register block.
const PORT: u16 = 0xaf00;
const CSEL: u16 = PORT;
const FLAGS: u16 = PORT + 4;
const CPEN: u32 = 1 << 0;
const CINS: u32 = 1 << 1;
const CRMV: u32 = 1 << 2;
const CEJ0: u32 = 1 << 3;
const EXIT_FAIL: u32 = 1;

/// CPUs (APIC ids) the job may run on; the guest starts at most this many.
const MAX_APIC: usize = 256;

/// Per APIC id: set by the BSP to make the CPU stop; set by the CPU once it did.
static STOP: [AtomicBool; MAX_APIC] = [const { AtomicBool::new(false) }; MAX_APIC];
static STOPPED: [AtomicBool; MAX_APIC] = [const { AtomicBool::new(false) }; MAX_APIC];
/// CPUs that passed their ring-3 check (and failures, which end the run).
static CHECKED: AtomicU32 = AtomicU32::new(0);

fn fail(what: core::fmt::Arguments) -> ! {
    println!("cpu-hotplug: FAIL {what}");
    exit(EXIT_FAIL)
}

/// What a started CPU runs in ring 3: it checks who it is, says so, and spins until told to
/// stop.
fn job(_index: usize) {
    let apic = crate::lapic::id();
    let initial = cpuid(1, 0).ebx >> 24;
    if apic != initial {
        fail(format_args!(
            "cpu with local APIC id {apic} has initial APIC id {initial} in CPUID"
        ));
    }
    println!("cpu-hotplug: cpu {apic} online (ring 3, cpuid apic id {initial})");
    CHECKED.fetch_add(1, Ordering::AcqRel);
    let slot = apic as usize % MAX_APIC;
    while !STOP[slot].load(Ordering::Acquire) {
        pause();
    }
    STOP[slot].store(false, Ordering::Relaxed);
    STOPPED[slot].store(true, Ordering::Release);
    // Dead, as an offlined CPU is: the VMM parks it, and an INIT restarts it.
    crate::console::halt_forever();
}

/// A short pause between polls (each register access exits to the VMM).
fn between_polls() {
    for _ in 0..200_000 {
        core::hint::spin_loop();
    }
}

fn flags_of(cpu: u32) -> u32 {
    outl(CSEL, cpu);
    inl(FLAGS) & 0xff
}

/// Waits for the VMM's insert event for one of the CPUs `0..possible` (a vm.resize that
/// adds vCPUs), acknowledges it and returns that CPU's APIC id, for the caller to start.
/// The `kata-agent` workload's vCPU step.
pub(crate) fn wait_for_insert(possible: u32) -> u32 {
    loop {
        for cpu in 0..possible {
            let flags = flags_of(cpu);
            if flags & CINS != 0 {
                outl(FLAGS, CINS);
                if flags & CPEN == 0 {
                    fail(format_args!("cpu {cpu} inserted but not present"));
                }
                return cpu;
            }
        }
        between_polls();
    }
}

pub fn run(info: &BootInfo) -> ! {
    let Some(table) = smp::hotpluggable(info.rsdp_paddr) else {
        fail(format_args!("the MADT lists no online-capable CPU"));
    };
    let possible: u32 = table.apic_ids().iter().copied().max().unwrap_or(0) + 1;
    let starter = smp::Starter::new(table.lapic_base, crate::arch::tsc_hz());
    let bsp = starter.bsp_apic_id();
    if flags_of(bsp) & CPEN == 0 {
        fail(format_args!("the boot CPU {bsp} is not present"));
    }
    smp::run_on_aps(job);
    println!(
        "cpu-hotplug: waiting, {} CPU(s) hot-pluggable of {possible}",
        table.apic_ids().len()
    );
    loop {
        for cpu in 0..possible {
            let flags = flags_of(cpu);
            if flags & CINS != 0 {
                outl(FLAGS, CINS);
                if flags & CPEN == 0 {
                    fail(format_args!("cpu {cpu} inserted but not present"));
                }
                println!("cpu-hotplug: cpu {cpu} inserted");
                let before = CHECKED.load(Ordering::Acquire);
                if starter.start(cpu).is_none() {
                    fail(format_args!("cpu {cpu} did not come up"));
                }
                while CHECKED.load(Ordering::Acquire) == before {
                    pause();
                }
            }
            if flags & CRMV != 0 {
                outl(FLAGS, CRMV);
                println!("cpu-hotplug: eject requested for cpu {cpu}");
                let slot = cpu as usize % MAX_APIC;
                STOPPED[slot].store(false, Ordering::Relaxed);
                STOP[slot].store(true, Ordering::Release);
                while !STOPPED[slot].load(Ordering::Acquire) {
                    pause();
                }
                outl(CSEL, cpu);
                outl(FLAGS, CEJ0);
                if flags_of(cpu) & CPEN != 0 {
                    fail(format_args!("cpu {cpu} is still present after its eject"));
                }
                println!("cpu-hotplug: cpu {cpu} ejected");
            }
        }
        between_polls();
    }
}
