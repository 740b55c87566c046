//! KVM's side of device interrupts and doorbells, shared by every PCI device kind:
//! MSI routes with their irqfds ([`MsiRouter`]), queue-notify ioeventfds
//! ([`KvmIoEvents`]), and a second VM handle for devices ([`duplicate_vm`]).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use gpuvm_devices::pci::{MsiMessage, MsiRouting};
use gpuvm_virtio::transport::IoEventRegistrar;
use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::{IoEventAddress, Kvm, NoDatamatch, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::lock;

/// GSIs below this belong to the IOAPIC (and the PICs for 0..16).
const FIRST_MSI_GSI: u32 = 24;

/// A second handle on the VM for devices (KVM objects are per fd, the VM is the same).
pub fn duplicate_vm(kvm: &Kvm, vm: &VmFd) -> std::io::Result<VmFd> {
    // SAFETY: dup of a valid fd we own; the new fd is handed to VmFd, which owns it.
    let fd = unsafe { libc::dup(vm.as_raw_fd()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh duplicate of a KVM VM fd and nothing else owns it.
    unsafe { kvm.create_vmfd_from_rawfd(fd) }
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

/// Routes MSI messages to GSIs: KVM_SET_GSI_ROUTING replaces the whole table, so every
/// update sends KVM's default IOAPIC/PIC routes plus all MSI routes.
pub struct MsiRouter {
    vm: VmFd,
    routes: Mutex<BTreeMap<u32, MsiMessage>>,
    next_gsi: AtomicU32,
    /// A copy of each allocated GSI's irqfd eventfd: releasing a GSI deassigns its irqfd
    /// with it, so a device process that still holds the eventfd cannot raise the GSI's
    /// next owner, and the number can be reused.
    irqfds: Mutex<BTreeMap<u32, EventFd>>,
    /// Released GSIs, reused lowest first (KVM allows 4096 routes; hot-plug churn would
    /// run through them otherwise).
    free: Mutex<std::collections::BTreeSet<u32>>,
}

impl MsiRouter {
    /// Uses a duplicate of `vm`'s file descriptor so the router can live in devices.
    pub fn new(kvm: &Kvm, vm: &VmFd) -> std::io::Result<Self> {
        Ok(MsiRouter {
            vm: duplicate_vm(kvm, vm)?,
            routes: Mutex::new(BTreeMap::new()),
            next_gsi: AtomicU32::new(FIRST_MSI_GSI),
            irqfds: Mutex::new(BTreeMap::new()),
            free: Mutex::new(std::collections::BTreeSet::new()),
        })
    }

    /// `count` GSIs (released ones first), each with an eventfd registered as its irqfd.
    pub fn allocate(&self, count: u32) -> std::io::Result<Vec<(u32, EventFd)>> {
        let mut allocated = Vec::new();
        for _ in 0..count {
            let gsi = lock(&self.free)
                .pop_first()
                .unwrap_or_else(|| self.next_gsi.fetch_add(1, Ordering::Relaxed));
            let registered = EventFd::new(EFD_NONBLOCK).and_then(|eventfd| {
                self.vm
                    .register_irqfd(&eventfd, gsi)
                    .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
                Ok((eventfd.try_clone()?, eventfd))
            });
            match registered {
                Ok((kept, eventfd)) => {
                    lock(&self.irqfds).insert(gsi, kept);
                    allocated.push((gsi, eventfd));
                }
                Err(error) => {
                    lock(&self.free).insert(gsi);
                    let gsis: Vec<u32> = allocated.iter().map(|(gsi, _)| *gsi).collect();
                    self.release(&gsis);
                    return Err(error);
                }
            }
        }
        Ok(allocated)
    }

    /// Drops the routes and irqfds of a removed device's GSIs; the numbers are then free.
    pub fn release(&self, gsis: &[u32]) {
        for &gsi in gsis {
            if lock(&self.routes).contains_key(&gsi) {
                if let Err(error) = self.set_route(gsi, None) {
                    log::warn!("cannot drop the MSI route of GSI {gsi}: {error}");
                }
            }
            let Some(eventfd) = lock(&self.irqfds).remove(&gsi) else {
                continue;
            };
            match self.vm.unregister_irqfd(&eventfd, gsi) {
                Ok(()) => {
                    lock(&self.free).insert(gsi);
                }
                // Still wired to an eventfd someone holds: never hand the number out again.
                Err(error) => log::warn!("cannot deassign the irqfd of GSI {gsi}: {error}"),
            }
        }
    }

    fn table(routes: &BTreeMap<u32, MsiMessage>) -> Vec<kvm_irq_routing_entry> {
        let mut entries = Vec::new();
        let irqchip = |gsi: u32, chip: u32, pin: u32| {
            let mut entry = kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_IRQCHIP,
                ..Default::default()
            };
            entry.u.irqchip.irqchip = chip;
            entry.u.irqchip.pin = pin;
            entry
        };
        // KVM's default table: GSI 0..16 to the PICs and the IOAPIC, 16..24 to the IOAPIC.
        for gsi in 0..FIRST_MSI_GSI {
            if gsi < 16 {
                let chip = if gsi < 8 {
                    KVM_IRQCHIP_PIC_MASTER
                } else {
                    KVM_IRQCHIP_PIC_SLAVE
                };
                entries.push(irqchip(gsi, chip, gsi % 8));
            }
            entries.push(irqchip(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        }
        for (&gsi, message) in routes {
            let mut entry = kvm_irq_routing_entry {
                gsi,
                type_: KVM_IRQ_ROUTING_MSI,
                ..Default::default()
            };
            entry.u.msi.address_lo = message.address as u32;
            entry.u.msi.address_hi = (message.address >> 32) as u32;
            entry.u.msi.data = message.data;
            entries.push(entry);
        }
        entries
    }
}

impl MsiRouting for MsiRouter {
    fn set_route(&self, gsi: u32, message: Option<MsiMessage>) -> std::io::Result<()> {
        let mut routes = lock(&self.routes);
        match message {
            Some(message) => routes.insert(gsi, message),
            None => routes.remove(&gsi),
        };
        let table = KvmIrqRouting::from_entries(&Self::table(&routes))
            .map_err(|e| std::io::Error::other(format!("routing table: {e:?}")))?;
        self.vm
            .set_gsi_routing(&table)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        log::debug!("MSI route GSI {gsi} -> {message:?}");
        Ok(())
    }
}

/// Registers queue notify addresses as KVM ioeventfds (any write length, no data match).
pub struct KvmIoEvents {
    vm: VmFd,
}

impl KvmIoEvents {
    pub fn new(vm: VmFd) -> Self {
        KvmIoEvents { vm }
    }
}

impl IoEventRegistrar for KvmIoEvents {
    fn register(&self, address: u64, fd: &EventFd) -> std::io::Result<()> {
        self.vm
            .register_ioevent(fd, &IoEventAddress::Mmio(address), NoDatamatch)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
    }

    fn unregister(&self, address: u64, fd: &EventFd) -> std::io::Result<()> {
        self.vm
            .unregister_ioevent(fd, &IoEventAddress::Mmio(address), NoDatamatch)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Released GSIs come back, lowest first, with their old irqfd gone. KVM refuses
    /// (EBUSY) to assign an eventfd that is an irqfd already, which tells which are.
    #[test]
    fn released_gsis_are_reused_without_their_old_irqfds() {
        let Ok(kvm) = Kvm::new() else {
            eprintln!("no /dev/kvm: skipped");
            return;
        };
        let vm = kvm.create_vm().expect("VM");
        vm.create_irq_chip().expect("irqchip");
        let router = MsiRouter::new(&kvm, &vm).expect("router");
        let wired = |eventfd: &EventFd, gsi: u32| {
            let free = vm.register_irqfd(eventfd, gsi).is_ok();
            if free {
                vm.unregister_irqfd(eventfd, gsi).unwrap();
            }
            !free
        };
        let first = router.allocate(3).expect("allocate");
        let gsis: Vec<u32> = first.iter().map(|(gsi, _)| *gsi).collect();
        assert_eq!(gsis, [24, 25, 26]);
        assert!(first.iter().all(|(gsi, eventfd)| wired(eventfd, *gsi)));
        router.release(&gsis[..2]);
        // The device may still hold its eventfds: they are no irqfds any more.
        for (gsi, eventfd) in &first[..2] {
            assert!(
                !wired(eventfd, *gsi),
                "GSI {gsi}'s old irqfd is still assigned"
            );
        }
        assert!(wired(&first[2].1, 26), "GSI 26 was not released");
        let second = router.allocate(3).expect("allocate again");
        let reused: Vec<u32> = second.iter().map(|(gsi, _)| *gsi).collect();
        assert_eq!(reused, [24, 25, 27]);
        assert!(second.iter().all(|(gsi, eventfd)| wired(eventfd, *gsi)));
    }

    #[test]
    fn routing_table_keeps_default_routes() {
        let mut routes = BTreeMap::new();
        routes.insert(
            24,
            MsiMessage {
                address: 0x1_fee0_0000,
                data: 0x41,
            },
        );
        let table = MsiRouter::table(&routes);
        // 16 PIC + 24 IOAPIC + 1 MSI.
        assert_eq!(table.len(), 41);
        let msi = table.last().unwrap();
        assert_eq!(msi.type_, KVM_IRQ_ROUTING_MSI);
        // SAFETY: reading the union member this entry was written with.
        let (lo, hi, data) =
            unsafe { (msi.u.msi.address_lo, msi.u.msi.address_hi, msi.u.msi.data) };
        assert_eq!((lo, hi, data), (0xfee0_0000, 1, 0x41));
        assert!(table
            .iter()
            .any(|e| e.gsi == 4 && e.type_ == KVM_IRQ_ROUTING_IRQCHIP));
    }
}
