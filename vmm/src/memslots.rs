//! KVM memory slots: guest physical ranges backed by host mappings (guest RAM, hot-plugged
//! RAM, passthrough BARs). One place builds the `KVM_SET_USER_MEMORY_REGION` argument, so
//! every caller sets and removes slots the same way.

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;

/// One KVM memory slot: `size` bytes of guest physical memory at `guest_addr`, backed by
/// the host mapping at `host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MemorySlot {
    pub slot: u32,
    pub guest_addr: u64,
    pub size: u64,
    pub host: u64,
    /// Whether KVM logs the pages the guest writes (dirty tracking for snapshots).
    pub dirty_log: bool,
}

impl MemorySlot {
    fn region(&self) -> kvm_userspace_memory_region {
        kvm_userspace_memory_region {
            slot: self.slot,
            guest_phys_addr: self.guest_addr,
            memory_size: self.size,
            userspace_addr: self.host,
            flags: if self.dirty_log {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
        }
    }

    /// Registers the slot with `vm` (or changes it, for a slot number KVM has already).
    ///
    /// # Safety
    /// `host..host + size` must be a mapping that stays alive until the slot is removed
    /// ([`MemorySlot::remove`]) or the VM is gone: KVM reads and writes it for the guest.
    pub unsafe fn set(&self, vm: &VmFd) -> Result<(), kvm_ioctls::Error> {
        // SAFETY: the caller keeps the host range mapped for as long as the slot exists.
        unsafe { vm.set_user_memory_region(self.region()) }
    }

    /// Removes the slot from `vm` (size 0); its host memory may be unmapped afterwards.
    pub fn remove(&self, vm: &VmFd) -> Result<(), kvm_ioctls::Error> {
        let removed = MemorySlot {
            size: 0,
            dirty_log: false,
            ..*self
        };
        // SAFETY: a slot of size 0 maps no host memory: KVM only deletes the slot.
        unsafe { vm.set_user_memory_region(removed.region()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_asks_for_dirty_logging_only_when_tracked() {
        let slot = MemorySlot {
            slot: 3,
            guest_addr: 1 << 32,
            size: 2 << 20,
            host: 0x7f00_0000_0000,
            dirty_log: true,
        };
        let region = slot.region();
        assert_eq!(
            (region.slot, region.guest_phys_addr, region.memory_size),
            (3, 1 << 32, 2 << 20)
        );
        assert_eq!(region.userspace_addr, 0x7f00_0000_0000);
        assert_eq!(region.flags, KVM_MEM_LOG_DIRTY_PAGES);
        let untracked = MemorySlot {
            dirty_log: false,
            ..slot
        };
        assert_eq!(untracked.region().flags, 0);
    }
}
