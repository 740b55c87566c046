//! The `pcie-hotplug [N] [keep|snapshot]` workload: PCIe native hot-plug into the VM's
//! empty root ports (`--pcie-root-ports`), driven as Linux's pciehp drives a slot, by
//! polling its Slot Status (the ports raise no interrupt):
//!
//! 1. finds the root ports on bus 0 whose slot is Hot-Plug Capable and checks each is
//!    empty and powered off;
//! 2. waits for Presence Detect Changed with a card present on one (PUT /gpus/{id}),
//!    powers the slot on (Slot Control: Power Controller Control 0, power indicator on),
//!    waits for Command Completed and for the link (Data Link Layer Link Active);
//! 3. runs the `pci` checks on the device on the port's secondary bus and checks its
//!    BARs lie in the port's memory and prefetchable windows;
//! 4. points the port's MSI at this CPU, enables the attention button's interrupt (Slot
//!    Control: Hot-Plug Interrupt Enable, Attention Button Pressed Enable), waits for the
//!    MSI and Attention Button Pressed (DELETE /gpus/{id}), quiets the device, powers the
//!    slot off, and waits until presence detect clears and the device reads all ones;
//!
//! N times (default 1; rounds may use any port). With `keep` it never powers the slot off
//! (for the VMM's eject timeout). With `snapshot`, round 1's device stays: the workload
//! waits for a byte on the serial port (the restored VMM's stdin, sent once the VM was
//! snapshotted and restored), checks again that the port's windows, bus and slot (card
//! present, powered on, link up) are as before and runs the `pci` checks on the device
//! again; the later rounds go into the other ports, and round 1's device is removed last.
//! Configuration space is reached through mechanism #1, from ring 3.

use core::sync::atomic::Ordering;

use crate::console::exit;
use crate::pci::{config_read, config_write};
use crate::println;

const EXIT_FAIL: u32 = 1;
/// The DMA the GPU does after the restore: 64 KiB of RAM at 32 MiB (where the `pci` checks
/// put theirs), another seed.
const AFTER_RESTORE_DMA_ADDR: u64 = 32 << 20;
const AFTER_RESTORE_DMA_LEN: u64 = 64 << 10;
const AFTER_RESTORE_DMA_SEED: u64 = 0x7e57;
const SERIAL_DATA: u16 = 0x3f8;
const SERIAL_LINE_STATUS: u16 = 0x3fd;
const CAP_ID_PCIE: u32 = 0x10;
/// Offsets in the PCIe capability.
const LINK_STATUS: u8 = 0x12;
const SLOT_CAP: u8 = 0x14;
const SLOT_CONTROL: u8 = 0x18;
/// Slot capabilities: Attention Button Present, Power Controller Present, Hot-Plug Capable.
const SLOT_CAP_HOTPLUG: u32 = 1 << 0 | 1 << 1 | 1 << 6;
/// Slot control: power off, power indicator on / off, attention indicator off.
const POWER_OFF: u32 = 1 << 10;
const POWER_INDICATOR_ON: u32 = 0b01 << 8;
const POWER_INDICATOR_OFF: u32 = 0b11 << 8;
const ATTENTION_INDICATOR_OFF: u32 = 0b11 << 6;
/// Slot control: Attention Button Pressed Enable, Hot-Plug Interrupt Enable.
const ATTENTION_BUTTON_ENABLE: u32 = 1 << 0;
const HOT_PLUG_INTERRUPT_ENABLE: u32 = 1 << 5;
const CAP_ID_MSI: u8 = 0x05;
/// The vector `pci::check_device` installs its counting handler on (it counts into
/// `pci::TG_MSI_COUNT`); the device's own MSI-X is quiet by the time the port uses it.
const MSI_VECTOR: u32 = 0x40;
/// Slot status (the high half of the Slot Control dword).
const ATTENTION_BUTTON_PRESSED: u32 = 1 << 0;
const PRESENCE_DETECT_CHANGED: u32 = 1 << 3;
const COMMAND_COMPLETED: u32 = 1 << 4;
const PRESENCE_DETECT_STATE: u32 = 1 << 6;
const DLL_STATE_CHANGED: u32 = 1 << 8;
const DLL_LINK_ACTIVE: u32 = 1 << 13;
/// How many polls a step may take before the workload gives up (each poll exits to the
/// VMM; the VMM's side of each step is immediate).
const POLLS: u32 = 100_000;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("pcie-hotplug: FAIL {what}");
    exit(EXIT_FAIL)
}

fn pause() {
    for _ in 0..20_000 {
        core::hint::spin_loop();
    }
}

/// 8-bit port read (the #GP handler emulates it where the hypervisor drops IOPL).
fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: port I/O to an emulated device touches no memory.
    unsafe {
        core::arch::asm!("in al, dx", in("dx") port, out("al") value,
            options(nomem, nostack, preserves_flags));
    }
    value
}

/// Waits for a byte on the serial port (the VMM's stdin) and takes it.
fn wait_for_serial_byte() {
    while inb(SERIAL_LINE_STATUS) & 1 == 0 {
        pause();
    }
    inb(SERIAL_DATA);
}

/// One empty root port with a hot-plug slot.
#[derive(Clone, Copy)]
struct Port {
    /// Its device number on bus 0.
    device: u8,
    /// Where its PCIe capability is.
    cap: u8,
}

impl Port {
    fn slot_status(&self) -> u32 {
        config_read(self.device, self.cap + SLOT_CONTROL) >> 16
    }

    fn slot_control(&self) -> u32 {
        config_read(self.device, self.cap + SLOT_CONTROL) & 0xffff
    }

    /// Writes 1 to the status bits `bits` (clearing them), Slot Control unchanged.
    fn clear_status(&self, bits: u32) {
        config_write(
            self.device,
            self.cap + SLOT_CONTROL,
            self.slot_control() | bits << 16,
        );
    }

    /// Writes Slot Control and waits for Command Completed, which it then clears.
    fn command(&self, control: u32) {
        config_write(self.device, self.cap + SLOT_CONTROL, control);
        self.wait("command completed", |status| {
            status & COMMAND_COMPLETED != 0
        });
        self.clear_status(COMMAND_COMPLETED);
    }

    /// Polls the slot status until `done` accepts it.
    fn wait(&self, what: &str, done: impl Fn(u32) -> bool) -> u32 {
        for _ in 0..POLLS {
            let status = self.slot_status();
            if done(status) {
                return status;
            }
            pause();
        }
        fail(format_args!(
            "00:{:02x}.0: no {what} (slot status {:#06x})",
            self.device,
            self.slot_status()
        ))
    }

    /// Points the port's MSI at this CPU's `MSI_VECTOR` and enables it.
    fn enable_msi(&self) {
        let Some(msi) = crate::pci::find_capability(self.device, CAP_ID_MSI) else {
            fail(format_args!(
                "00:{:02x}.0 has no MSI capability",
                self.device
            ));
        };
        config_write(self.device, msi + 4, 0xfee0_0000 | crate::lapic::id() << 12);
        config_write(self.device, msi + 8, 0);
        config_write(self.device, msi + 12, MSI_VECTOR);
        config_write(self.device, msi, config_read(self.device, msi) | 1 << 16);
        if config_read(self.device, msi) >> 16 & 1 == 0 {
            fail(format_args!(
                "00:{:02x}.0's MSI did not enable",
                self.device
            ));
        }
    }

    fn link_active(&self) -> bool {
        config_read(self.device, (self.cap + LINK_STATUS) & 0xfc) >> 16 & DLL_LINK_ACTIVE != 0
    }

    fn secondary_bus(&self) -> u8 {
        (config_read(self.device, 0x18) >> 8) as u8
    }

    /// The memory window and the prefetchable window, (base, end) each.
    fn windows(&self) -> [(u64, u64); 2] {
        let memory = config_read(self.device, 0x20);
        let memory_base = u64::from(memory & 0xfff0) << 16;
        let memory_end = (u64::from(memory >> 16 & 0xfff0) << 16) + (1 << 20);
        let pref = config_read(self.device, 0x24);
        let pref_base =
            u64::from(pref & 0xfff0) << 16 | u64::from(config_read(self.device, 0x28)) << 32;
        let pref_end = (u64::from(pref >> 16 & 0xfff0) << 16
            | u64::from(config_read(self.device, 0x2c)) << 32)
            + (1 << 20);
        [(memory_base, memory_end), (pref_base, pref_end)]
    }
}

/// The root ports on bus 0 with a hot-plug slot.
fn find_ports() -> ([Option<Port>; 32], usize) {
    let mut ports = [None; 32];
    let mut count = 0;
    for device in 1..32u8 {
        if config_read(device, 0) & 0xffff == 0xffff || config_read(device, 0x08) >> 16 != 0x0604 {
            continue;
        }
        let Some(cap) = crate::pci::find_capability(device, CAP_ID_PCIE as u8) else {
            continue;
        };
        let port_type = config_read(device, cap) >> 20 & 0xf;
        let slot_cap = config_read(device, cap + SLOT_CAP);
        if port_type != 4 || slot_cap & SLOT_CAP_HOTPLUG != SLOT_CAP_HOTPLUG {
            continue;
        }
        ports[count] = Some(Port { device, cap });
        count += 1;
    }
    (ports, count)
}

/// `pci.rs`'s mechanism #1 address puts its device argument at bit 11, so device 0 of bus
/// `bus` is its "device" `bus << 5` (the bus number starts at bit 16): that reaches buses
/// 1 to 7, which hold the root ports' secondary buses of the VMs this workload runs in.
fn behind(bus: u8) -> u8 {
    if bus == 0 || bus >= 8 {
        fail(format_args!(
            "secondary bus {bus} is out of this workload's reach (1..=7)"
        ));
    }
    bus << 5
}

pub fn run(count: Option<&str>, mode: Option<&str>) -> ! {
    let rounds: u32 = match count.map(str::parse) {
        None => 1,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => fail(format_args!("usage: pcie-hotplug [N] [keep|snapshot]")),
    };
    let keep = mode == Some("keep");
    let snapshot = mode == Some("snapshot");
    let (ports, found) = find_ports();
    if found == 0 {
        fail(format_args!("no root port with a hot-plug slot on bus 0"));
    }
    for port in ports.iter().flatten() {
        let status = port.slot_status();
        if status & PRESENCE_DETECT_STATE != 0 || port.slot_control() & POWER_OFF == 0 {
            fail(format_args!(
                "00:{:02x}.0's slot is not empty and off (status {status:#06x})",
                port.device
            ));
        }
        println!(
            "pcie-hotplug: root port 00:{:02x}.0, slot bus {:02x}, empty, powered off",
            port.device,
            port.secondary_bus()
        );
    }
    println!("pcie-hotplug: {found} hot-plug root port(s); waiting for {rounds} device(s)");
    // `snapshot`: round 1's device, kept through the snapshot and removed last.
    let mut kept = None;
    for round in 1..=rounds {
        let port = loop {
            let arrived = ports.iter().flatten().find(|port| {
                let status = port.slot_status();
                status & PRESENCE_DETECT_CHANGED != 0 && status & PRESENCE_DETECT_STATE != 0
            });
            if let Some(port) = arrived {
                break *port;
            }
            pause();
        };
        port.clear_status(PRESENCE_DETECT_CHANGED);
        port.command(POWER_INDICATOR_ON | ATTENTION_INDICATOR_OFF);
        let mut polls = 0;
        while !port.link_active() {
            polls += 1;
            if polls > POLLS {
                fail(format_args!(
                    "00:{:02x}.0: the link never came up",
                    port.device
                ));
            }
            pause();
        }
        port.clear_status(DLL_STATE_CHANGED);
        let bus = port.secondary_bus();
        let device = behind(bus);
        println!(
            "pcie-hotplug: device {round} present behind 00:{:02x}.0, slot powered on, link up",
            port.device
        );
        if !crate::pci::is_gpu(device) {
            fail(format_args!("{bus:02x}:00.0 is not the emulated GPU"));
        }
        crate::pci::check_device(device, false);
        check_bars(&port, device);
        println!(
            "pcie-hotplug: device {round} at {bus:02x}:00.0 passed the pci checks, BARs inside \
             the port's windows"
        );
        if keep {
            println!("pcie-hotplug: keeping the device; the slot stays powered");
            crate::console::halt_forever();
        }
        if snapshot && round == 1 {
            check_after_restore(&port, device);
            kept = Some((port, device, round));
            continue;
        }
        remove(&port, device, round);
    }
    if let Some((port, device, round)) = kept {
        remove(&port, device, round);
    }
    println!("pcie-hotplug: ok");
    exit(0)
}

/// Fails unless the GPU's BARs lie in `port`'s windows.
fn check_bars(port: &Port, device: u8) {
    let [memory, prefetchable] = port.windows();
    for (index, window) in [(0u8, memory), (1, prefetchable), (3, prefetchable)] {
        let (address, size, _) = crate::pci::size_bar(device, index);
        if address < window.0 || address + size > window.1 {
            fail(format_args!(
                "BAR{index} {address:#x}+{size:#x} is outside the port's window \
                 {:#x}..{:#x}",
                window.0, window.1
            ));
        }
    }
}

/// Waits for the byte that says the VM was snapshotted and restored, then checks that
/// `port` and the GPU behind it (`device`) are as they were.
fn check_after_restore(port: &Port, device: u8) {
    let (windows, bus) = (port.windows(), port.secondary_bus());
    let control = port.slot_control();
    println!("pcie-hotplug: device 1 kept; send a byte once the VM is restored");
    wait_for_serial_byte();
    if port.windows() != windows || port.secondary_bus() != bus {
        fail(format_args!(
            "00:{:02x}.0's windows or bus changed: {:x?} bus {:02x}, were {windows:x?} bus \
             {bus:02x}",
            port.device,
            port.windows(),
            port.secondary_bus()
        ));
    }
    let status = port.slot_status();
    if status & PRESENCE_DETECT_STATE == 0
        || port.slot_control() != control
        || control & POWER_OFF != 0
        || !port.link_active()
    {
        fail(format_args!(
            "00:{:02x}.0's slot is not as before: status {status:#06x}, control {:#06x} \
             (was {control:#06x}), link active {}",
            port.device,
            port.slot_control(),
            port.link_active()
        ));
    }
    if !crate::pci::is_gpu(device) {
        fail(format_args!(
            "{bus:02x}:00.0 is not the emulated GPU after the restore"
        ));
    }
    check_bars(port, device);
    let done = check_device_again(device);
    println!(
        "pcie-hotplug: after the restore 00:{:02x}.0 has its windows, bus and powered slot; \
         {bus:02x}:00.0 kept its state (DMA count {done}) and did one more DMA, verified",
        port.device
    );
}

/// After a restore, the GPU behind a port (`device`, checked by `pci::check_device` before
/// the snapshot) kept its state: memory decoding, Bus Master and MSI-X on, its DMA count;
/// and it works: one more DMA into RAM, signalled by its MSI-X. Returns the count before.
fn check_device_again(device: u8) -> u32 {
    use crate::pci::{mmio_read, mmio_write, TG_MSI_COUNT};
    let command = config_read(device, 0x04) & 0xffff;
    let msix_on = crate::pci::find_capability(device, 0x11)
        .is_some_and(|msix| config_read(device, msix) >> 31 == 1);
    if command & 0x6 != 0x6 || !msix_on {
        fail(format_args!(
            "the device lost its enables: command {command:#06x}, MSI-X on {msix_on}"
        ));
    }
    let bar0 = u64::from(config_read(device, 0x10) & !0xf);
    let done = mmio_read(bar0 + crate::pci::REG_DMA_DONE);
    if done == 0 {
        fail(format_args!("the device's DMA count restarted from 0"));
    }
    crate::pattern::zero(AFTER_RESTORE_DMA_ADDR, AFTER_RESTORE_DMA_LEN);
    TG_MSI_COUNT.store(0, Ordering::Release);
    let address = AFTER_RESTORE_DMA_ADDR;
    mmio_write(bar0 + crate::pci::REG_DMA_ADDR_LO, address as u32);
    mmio_write(bar0 + crate::pci::REG_DMA_ADDR_HI, (address >> 32) as u32);
    mmio_write(bar0 + crate::pci::REG_DMA_LEN, AFTER_RESTORE_DMA_LEN as u32);
    mmio_write(
        bar0 + crate::pci::REG_DMA_SEED,
        AFTER_RESTORE_DMA_SEED as u32,
    );
    mmio_write(bar0 + crate::pci::REG_DOORBELL, 0);
    if crate::pci::wait_for_interrupt(&TG_MSI_COUNT) == 0 {
        fail(format_args!(
            "no MSI-X interrupt for the DMA after the restore"
        ));
    }
    let status = mmio_read(bar0 + crate::pci::REG_DMA_STATUS);
    let now = mmio_read(bar0 + crate::pci::REG_DMA_DONE);
    if status != 0 || now != done.wrapping_add(1) {
        fail(format_args!(
            "DMA after the restore: status {status}, count {now} (was {done})"
        ));
    }
    let seed = AFTER_RESTORE_DMA_SEED;
    if crate::pattern::verify(address, AFTER_RESTORE_DMA_LEN, seed).is_err() {
        fail(format_args!(
            "the DMA after the restore did not write its pattern"
        ));
    }
    done
}

/// Gives up the GPU (`device`) behind `port` when the VMM asks: waits for the attention
/// button's MSI, quiets the device, powers the slot off and waits for the removal.
fn remove(port: &Port, device: u8, round: u32) {
    let bus = port.secondary_bus();
    // The removal request comes as the port's MSI (raised on enable if the button was
    // pressed already).
    crate::pci::TG_MSI_COUNT.store(0, Ordering::Release);
    port.enable_msi();
    port.command(
        POWER_INDICATOR_ON
            | ATTENTION_INDICATOR_OFF
            | HOT_PLUG_INTERRUPT_ENABLE
            | ATTENTION_BUTTON_ENABLE,
    );
    let interrupts = crate::pci::wait_for_interrupt(&crate::pci::TG_MSI_COUNT);
    if interrupts == 0 {
        fail(format_args!("no MSI from 00:{:02x}.0", port.device));
    }
    port.wait("attention button press", |status| {
        status & ATTENTION_BUTTON_PRESSED != 0
    });
    println!(
        "pcie-hotplug: MSI from 00:{:02x}.0 (count {interrupts})",
        port.device
    );
    port.clear_status(ATTENTION_BUTTON_PRESSED);
    println!(
        "pcie-hotplug: attention button pressed on 00:{:02x}.0",
        port.device
    );
    crate::pci::release_device(device);
    port.command(POWER_OFF | POWER_INDICATOR_OFF | ATTENTION_INDICATOR_OFF);
    port.wait("removal", |status| status & PRESENCE_DETECT_STATE == 0);
    port.clear_status(PRESENCE_DETECT_CHANGED | DLL_STATE_CHANGED);
    if port.link_active() {
        fail(format_args!("the link is up after the removal"));
    }
    match crate::pci::vendor_device(device) {
        0xffff_ffff => {}
        ids => fail(format_args!(
            "{bus:02x}:00.0 still reads {ids:#010x} after the removal"
        )),
    }
    println!("pcie-hotplug: device {round} removed, {bus:02x}:00.0 reads all ones");
}
