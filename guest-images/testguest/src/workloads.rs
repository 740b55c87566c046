//! The workloads selected by the command line (all in ring 3).

use crate::args::{parse_number, parse_size, Words};
use crate::boot::MAX_CPUS;
use crate::bootinfo::BootInfo;
use crate::console::{exit, halt_forever};
use crate::pattern::{fill, verify, verify_and_rewrite, zero, Mismatch};
use crate::println;
use crate::region::Region;
use crate::smp::{self, Barrier};
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Exit status for bad usage, missing RAM and failed CPU bring-up.
const EXIT_SETUP_FAILED: u32 = 2;

pub fn run(info: &BootInfo) -> ! {
    let Ok(cmdline) = info.cmdline() else {
        println!("testguest: command line is not UTF-8");
        exit(EXIT_SETUP_FAILED);
    };
    let mut words = Words::new(cmdline);
    match words.next_word().unwrap_or("hello") {
        "hello" => {
            println!("testguest: hello from ring 3");
            exit(0)
        }
        "memtest" => memtest(info, &mut words),
        "memloop" => memloop(info, &mut words),
        "zerofill" => zerofill(info, &mut words),
        "smp" => smp_workload(info),
        "cpu-hotplug" => crate::cpu_hotplug::run(info),
        "memory-hotplug" => crate::memory_hotplug::run(info, words),
        "info" => print_info(info, cmdline),
        "fault" => fault(words.next_word().unwrap_or("ud")),
        "pci" => crate::pci::run(words.next_word()),
        "big-bars" => crate::bigbars::run(info, words.next_word(), words.next_word()),
        "edu" => crate::edu::run(info, words.next_word()),
        "pci-hotplug" => crate::hotplug::run(words.next_word(), words.next_word()),
        "pcie-hotplug" => crate::pcie_hotplug::run(words.next_word(), words.next_word()),
        "segment-hotplug" => crate::segment_hotplug::run(info, words.next_word()),
        "gpu-migrate" => crate::gpu_migrate::run(),
        "gpu-clique" => crate::gpu_clique::run(words.next_word()),
        "p2p" => crate::p2p::run(info, &mut words),
        "pci-topology" => crate::pci_topology::run(&mut words),
        "kata-agent" => crate::kata::run(info),
        "acpi" => crate::acpi::run(info, words),
        "numa" => crate::numa::run(info, &mut words),
        "virtio-hostile" => crate::virtio::hostile::run(info),
        name @ ("virtio-blk-bench" | "virtio-vsock-bench" | "virtio-fs-bench") => {
            crate::virtio::bench::run(info, name, &mut words)
        }
        name @ ("virtio-rng" | "virtio-blk" | "virtio-blk-hotplug" | "virtio-vsock"
        | "virtio-net" | "virtio-devices") => crate::virtio::run(info, name, &mut words),
        "virtio-fs" => crate::virtio::run(info, "virtio-fs", &mut words),
        "virtio-balloon" => crate::virtio::run(info, "virtio-balloon", &mut words),
        "gpu-agent" => crate::virtio::run(info, "gpu-agent", &mut words),
        name @ ("virtio-net-mq" | "virtio-net-bench") => crate::virtio::run(info, name, &mut words),
        "virtio-vsock-connect" => crate::virtio::run(info, "virtio-vsock-connect", &mut words),
        other => {
            println!("testguest: unknown workload '{other}'");
            exit(EXIT_SETUP_FAILED)
        }
    }
}

/// The next argument parsed with `parse`, or a usage message and exit 2.
fn argument(words: &mut Words, parse: fn(&str) -> Option<u64>, name: &str, usage: &str) -> u64 {
    let Some(word) = words.next_word() else {
        println!("testguest: missing {name}; usage: {usage}");
        exit(EXIT_SETUP_FAILED);
    };
    let Some(value) = parse(word) else {
        println!("testguest: bad {name} '{word}'; usage: {usage}");
        exit(EXIT_SETUP_FAILED);
    };
    value
}

fn data_region(info: &BootInfo, size: u64, workload: &str) -> Region {
    Region::new(info.memmap(), size).unwrap_or_else(|_| {
        println!("{workload}: FAIL not enough RAM");
        exit(EXIT_SETUP_FAILED)
    })
}

fn memtest(info: &BootInfo, words: &mut Words) -> ! {
    const USAGE: &str = "memtest SIZE SEED";
    let size = argument(words, parse_size, "SIZE", USAGE);
    let seed = argument(words, parse_number, "SEED", USAGE);
    let region = data_region(info, size, "memtest");
    for &(start, len) in region.ranges() {
        fill(start, len, seed);
    }
    let mut checksum = 0u64;
    for &(start, len) in region.ranges() {
        match verify(start, len, seed) {
            Ok(sum) => checksum = checksum.wrapping_add(sum),
            Err(Mismatch {
                addr,
                expected,
                got,
            }) => {
                println!("memtest: FAIL at {addr:#x} expected {expected:#018x} got {got:#018x}");
                exit(1);
            }
        }
    }
    println!(
        "memtest: size={} seed={seed} checksum={checksum:#018x}",
        region.size
    );
    println!("memtest: ok");
    exit(0)
}

/// memloop parameters, published by the BSP before the APs get the job.
static mut MEMLOOP_REGION: Region = Region::EMPTY;
static MEMLOOP_SEED: AtomicU64 = AtomicU64::new(0);
static MEMLOOP_ITERS: AtomicU64 = AtomicU64::new(0);
static MEMLOOP_CPUS: AtomicUsize = AtomicUsize::new(1);
static MEMLOOP_BARRIER: Barrier = Barrier::new();

/// Per-CPU sums of one iteration; two slots so the BSP can read iteration i while the others
/// already write i + 1 (nobody gets to i + 2 before the BSP passes the next barrier).
#[repr(align(64))]
struct IterationSums([AtomicU64; 2]);
static MEMLOOP_SUMS: [IterationSums; MAX_CPUS] =
    [const { IterationSums([AtomicU64::new(0), AtomicU64::new(0)]) }; MAX_CPUS];

fn memloop(info: &BootInfo, words: &mut Words) -> ! {
    const USAGE: &str = "memloop SIZE SEED ITERS";
    let size = argument(words, parse_size, "SIZE", USAGE);
    let seed = argument(words, parse_number, "SEED", USAGE);
    let iters = argument(words, parse_number, "ITERS", USAGE);
    let region = data_region(info, size, "memloop");
    let cpus = smp::discover(info.rsdp_paddr);
    let online = smp::bring_up(&cpus, crate::arch::tsc_hz()).online;
    // SAFETY: only the BSP runs memloop code yet; APs read the region after `run_on_aps`
    // (release/acquire through the job pointer).
    unsafe { core::ptr::addr_of_mut!(MEMLOOP_REGION).write(region) };
    MEMLOOP_SEED.store(seed, Ordering::Relaxed);
    MEMLOOP_ITERS.store(iters, Ordering::Relaxed);
    MEMLOOP_CPUS.store(online, Ordering::Relaxed);
    println!(
        "memloop: cpus={online} size={} seed={seed} iters={iters}",
        region.size
    );
    smp::run_on_aps(memloop_worker);
    memloop_worker(0);
    halt_forever()
}

fn memloop_worker(cpu: usize) {
    // SAFETY: written by the BSP before the job was published; read-only from now on.
    let region = unsafe { &*core::ptr::addr_of!(MEMLOOP_REGION) };
    let seed = MEMLOOP_SEED.load(Ordering::Relaxed);
    let iters = MEMLOOP_ITERS.load(Ordering::Relaxed);
    let cpus = MEMLOOP_CPUS.load(Ordering::Relaxed);
    let pages = region.pages();
    let first = pages * cpu as u64 / cpus as u64;
    let end = pages * (cpu as u64 + 1) / cpus as u64;
    let mut iter = 0u64;
    while iters == 0 || iter < iters {
        let old_seed = (iter > 0).then(|| seed.wrapping_add(iter - 1));
        let new_seed = seed.wrapping_add(iter);
        let mut sum = 0u64;
        region.for_each_in_pages(first, end, |start, len| {
            match verify_and_rewrite(start, len, old_seed, new_seed) {
                Ok(part) => sum = sum.wrapping_add(part),
                Err(Mismatch { addr, expected, got }) => {
                    println!(
                        "memloop: FAIL iter {iter} at {addr:#x} expected {expected:#018x} got {got:#018x}"
                    );
                    exit(1);
                }
            }
        });
        let slot = (iter & 1) as usize;
        MEMLOOP_SUMS[cpu].0[slot].store(sum, Ordering::Relaxed);
        MEMLOOP_BARRIER.wait(cpus);
        if cpu == 0 {
            let checksum = MEMLOOP_SUMS[..cpus].iter().fold(0u64, |acc, sums| {
                acc.wrapping_add(sums.0[slot].load(Ordering::Relaxed))
            });
            println!("memloop: iter {iter} ok checksum={checksum:#018x}");
        }
        iter += 1;
    }
    if cpu == 0 {
        println!("memloop: done");
        exit(0);
    }
}

fn zerofill(info: &BootInfo, words: &mut Words) -> ! {
    let size = argument(words, parse_size, "SIZE", "zerofill SIZE");
    let region = data_region(info, size, "zerofill");
    for &(start, len) in region.ranges() {
        fill(start, len, 1);
    }
    for &(start, len) in region.ranges() {
        zero(start, len);
    }
    println!("zerofill: done");
    halt_forever()
}

fn smp_workload(info: &BootInfo) -> ! {
    let cpus = smp::discover(info.rsdp_paddr);
    if cpus.source == smp::CpuSource::BootCpuOnly {
        println!("smp: no MP table or ACPI MADT found, only the boot cpu is known");
    } else {
        println!(
            "smp: {} cpus listed ({}), local apic {:#x}",
            cpus.apic_ids().len(),
            cpus.source.name(),
            cpus.lapic_base
        );
    }
    if cpus.ignored > 0 {
        println!("smp: ignoring {} cpus beyond {MAX_CPUS}", cpus.ignored);
    }
    let result = smp::bring_up(&cpus, crate::arch::tsc_hz());
    if result.online == result.expected {
        println!("smp: {}/{} cpus online", result.online, result.expected);
        exit(0)
    }
    println!(
        "smp: FAIL {}/{} cpus online",
        result.online, result.expected
    );
    exit(EXIT_SETUP_FAILED)
}

/// Diagnostics for people and tests: what the guest sees.
fn print_info(info: &BootInfo, cmdline: &str) -> ! {
    println!("info: cpl={} cmdline='{cmdline}'", crate::arch::cpl());
    println!(
        "info: start_info={:#x} rsdp={:#x}",
        crate::boot::start_info_paddr(),
        info.rsdp_paddr
    );
    for entry in info.memmap() {
        println!(
            "info: e820 {:#014x}-{:#014x} type {}",
            entry.addr,
            entry.addr + entry.size,
            entry.kind
        );
    }
    println!(
        "info: cpuid pdpe1gb={} (unused: 1 GiB pages fault under kvm_pvm), tsc {} Hz",
        crate::arch::has_gib_pages(),
        crate::arch::tsc_hz()
    );
    let cpus = smp::discover(info.rsdp_paddr);
    println!(
        "info: {} cpus ({}) lapic {:#x}",
        cpus.apic_ids().len(),
        cpus.source.name(),
        cpus.lapic_base
    );
    exit(0)
}

/// Raises a CPU exception on purpose, to test the exception report (exit status 3).
fn fault(kind: &str) -> ! {
    println!("fault: raising {kind}");
    // SAFETY: each arm faults deliberately; the exception handler reports it and exits.
    unsafe {
        match kind {
            "ud" => core::arch::asm!("ud2"),
            "de" => {
                core::arch::asm!("xor edx, edx", "xor eax, eax", "div eax", out("eax") _, out("edx") _)
            }
            "bp" => core::arch::asm!("int3"),
            // Beyond the mapped 64 GiB: not present.
            "pf" => {
                core::ptr::read_volatile(crate::boot::MAPPED_LIMIT as *const u64);
            }
            // Non-canonical address.
            "gp" => {
                core::ptr::read_volatile(0x8000_0000_0000_0000u64 as *const u64);
            }
            _ => {
                println!("testguest: unknown fault '{kind}' (ud, de, bp, pf, gp)");
                exit(EXIT_SETUP_FAILED);
            }
        }
    }
    println!("fault: {kind} did not fault");
    exit(1)
}
