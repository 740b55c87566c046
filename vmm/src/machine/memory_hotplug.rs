//! Memory hot-plug of the running machine (Cloud Hypervisor's vm.resize `desired_ram`), by
//! ACPI as Cloud Hypervisor's default `hotplug_method = "acpi"` does it: each resize that
//! grows RAM fills one slot of the memory hot-plug register block
//! (gpuvm_devices::memory_hotplug) with a new RAM range in the room kept after boot RAM
//! (gpuvm_arch::x86_64::layout::ram_hotplug_area), and the DSDT's memory devices
//! (arch/src/x86_64/acpi/memory.rs) let the guest find it.
//!
//! Order, on the VMM thread: a view of the new range in the hot-plug area (sparse room in
//! guest RAM's own file after boot RAM, mapped whole at build for device emulation:
//! virtio devices and vhost-user back ends have had it in their memory map since they
//! were made, so no device needs a new map; with hugetlb the view checks the pool for the
//! range), a KVM memory slot, the DMA mapping for every passthrough device (synchronously:
//! a device must never be able to DMA into RAM the guest was told about but the IOMMU
//! does not map), and only
//! then the guest is told (the block's insert event and the GED interrupt). Shrinking is
//! refused: it needs the guest to offline and eject a slot first.
//!
//! What the area's early mapping costs: a guest that points a virtio buffer into a part
//! of the area it was not given gets zeroes and, for writes, makes the host allocate
//! those pages: at most the hot-plug size the VM was allowed, its own memory, never
//! another VM's, and never reachable by a passthrough device (no IOMMU mapping).

use std::sync::{Arc, Mutex};

use gpuvm_devices::memory_hotplug::{MemoryHotplug, MEMORY_BLOCK_SIZE, MEMORY_HOTPLUG_SLOTS};
use gpuvm_memory::{ByteSize, GuestRam, RamError};
use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};

use super::{Machine, RunningMachine};
use crate::devices::SavedRamHotplug;
use crate::dma::RamChunks;
use crate::lock;

/// KVM memory slot of hot-plug slot 0; slot n uses this + n. Boot RAM has slots 0 and 1
/// (below and above the 32-bit hole: layout::ram_regions); BAR mappings count up from
/// 16 (vmm/src/pci.rs FIRST_BAR_SLOT).
pub(crate) const FIRST_HOTPLUG_RAM_SLOT: u32 = 2;
const BAR_SLOTS_START: u32 = 16;
const _: () = assert!(FIRST_HOTPLUG_RAM_SLOT + MEMORY_HOTPLUG_SLOTS as u32 <= BAR_SLOTS_START);

/// The machine's memory hot-plug: the room for it, the register block and the RAM added.
pub(crate) struct RamHotplug {
    /// The room kept for hot-plugged RAM, mapped whole (see the module's comment).
    area: GuestRam,
    /// What the user asked for (`memory.hotplug_size`): the most RAM that may be added.
    hotplug_size: u64,
    block: Arc<Mutex<MemoryHotplug>>,
    /// The RAM of each filled slot: a view of its range of `area`.
    added: Vec<AddedRam>,
}

struct AddedRam {
    ram: GuestRam,
}

impl RamHotplug {
    /// Memory hot-plug of at most `hotplug_size` bytes into `area` (from
    /// [`GuestRam::hotplug_area`]).
    pub(crate) fn new(area: GuestRam, hotplug_size: u64, block: Arc<Mutex<MemoryHotplug>>) -> Self {
        RamHotplug {
            area,
            hotplug_size,
            block,
            added: Vec::new(),
        }
    }

    /// Bytes of RAM added so far.
    pub(crate) fn added_bytes(&self) -> u64 {
        self.added.iter().map(|added| added.ram.size()).sum()
    }

    /// The lowest address in the area where `size` bytes fit between the slots in use.
    fn place(&self, size: u64, align: u64) -> Option<u64> {
        let mut used: Vec<(u64, u64)> = self
            .added
            .iter()
            .flat_map(|added| added.ram.regions().iter().map(|r| (r.guest_addr, r.end())))
            .collect();
        used.sort_unstable();
        let area = self.area.regions().first()?;
        let end = area.end();
        let mut candidate = area.guest_addr;
        for (start, stop) in used {
            if candidate + size <= start {
                break;
            }
            candidate = candidate.max(stop.next_multiple_of(align));
        }
        (candidate + size <= end).then_some(candidate)
    }
}

/// Why guest RAM could not change.
#[derive(Debug, thiserror::Error)]
pub enum MemoryResizeError {
    #[error(
        "this VM has no memory hot-plug (create it with memory.hotplug_size, or \
         --memory-hotplug-size): it keeps its {} of RAM", ByteSize(*.current)
    )]
    NoHotplug { current: u64 },
    #[error("desired_ram = 0: a VM needs RAM")]
    Zero,
    #[error(
        "desired_ram = {desired} is below the VM's {current} bytes: gpuvm cannot take \
         hot-plugged RAM back yet (the guest would have to offline and eject it first)"
    )]
    Shrink { desired: u64, current: u64 },
    #[error(
        "desired_ram = {desired} grows RAM by {grow} bytes, which is not a multiple of \
         {} (the memory block size hot-plugged RAM comes in{})",
        ByteSize(*.granule),
        if *.granule > MEMORY_BLOCK_SIZE { ", at least a huge page" } else { "" }
    )]
    NotBlockMultiple {
        desired: u64,
        grow: u64,
        granule: u64,
    },
    #[error(
        "desired_ram = {desired} is above the {} of boot RAM plus the hot-plug size {} \
         (memory.hotplug_size)", ByteSize(*.boot), ByteSize(*.hotplug_size)
    )]
    AboveHotplugSize {
        desired: u64,
        boot: u64,
        hotplug_size: u64,
    },
    #[error(
        "every one of the {MEMORY_HOTPLUG_SLOTS} memory hot-plug slots is in use (each resize \
         that grows RAM takes one)"
    )]
    NoSlot,
    #[error("no room left for {} in the hot-plug area", ByteSize(*.0))]
    NoRoom(u64),
    #[error("cannot create the hot-plugged RAM: {0}")]
    Ram(#[from] RamError),
    #[error("cannot register the hot-plugged RAM with KVM: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error("cannot DMA-map the hot-plugged RAM for passthrough device {device}: {error}")]
    Dma {
        device: String,
        error: std::io::Error,
    },
}

impl MemoryResizeError {
    /// The HTTP status the API answers with.
    pub fn status(&self) -> u16 {
        match self {
            MemoryResizeError::NoHotplug { .. }
            | MemoryResizeError::Zero
            | MemoryResizeError::Shrink { .. }
            | MemoryResizeError::NotBlockMultiple { .. }
            | MemoryResizeError::AboveHotplugSize { .. }
            | MemoryResizeError::NoSlot
            | MemoryResizeError::NoRoom(_) => 400,
            MemoryResizeError::Ram(_)
            | MemoryResizeError::Kvm(_)
            | MemoryResizeError::Dma { .. } => 500,
        }
    }
}

/// What a resize from `current` bytes (boot RAM `boot` plus hot-plugged) to `desired` adds,
/// checked against the hot-plug size; `granule` is what RAM grows in. Ok(0) for no change.
pub fn check_growth(
    desired: u64,
    current: u64,
    boot: u64,
    hotplug_size: Option<u64>,
    granule: u64,
) -> Result<u64, MemoryResizeError> {
    if desired == 0 {
        return Err(MemoryResizeError::Zero);
    }
    if desired == current {
        return Ok(0);
    }
    let Some(hotplug_size) = hotplug_size else {
        return Err(MemoryResizeError::NoHotplug { current });
    };
    if desired < current {
        return Err(MemoryResizeError::Shrink { desired, current });
    }
    let grow = desired - current;
    if !grow.is_multiple_of(granule) {
        return Err(MemoryResizeError::NotBlockMultiple {
            desired,
            grow,
            granule,
        });
    }
    if desired - boot > hotplug_size {
        return Err(MemoryResizeError::AboveHotplugSize {
            desired,
            boot,
            hotplug_size,
        });
    }
    Ok(grow)
}

impl Machine {
    /// Guest RAM now: boot RAM plus hot-plugged RAM.
    pub fn ram_size(&self) -> u64 {
        self.config.memory_size
            + self
                .ram_hotplug
                .as_ref()
                .map_or(0, |hotplug| hotplug.added_bytes())
    }

    /// Bytes of RAM that may be hot-plugged in all (`memory.hotplug_size`), None without
    /// memory hot-plug.
    pub fn ram_hotplug_size(&self) -> Option<u64> {
        self.ram_hotplug
            .as_ref()
            .map(|hotplug| hotplug.hotplug_size)
    }

    /// Whether RAM was hot-plugged (its snapshots are full memory files).
    pub fn has_hotplugged_ram(&self) -> bool {
        self.ram_hotplug
            .as_ref()
            .is_some_and(|hotplug| !hotplug.added.is_empty())
    }

    /// What hot-plugged RAM grows in: the memory block size, or the huge page if larger.
    pub fn ram_granule(&self) -> u64 {
        MEMORY_BLOCK_SIZE.max(self.ram.page_size())
    }

    /// Checks a resize of guest RAM to `desired` bytes; Ok(bytes to add).
    pub fn check_ram_resize(&self, desired: u64) -> Result<u64, MemoryResizeError> {
        check_growth(
            desired,
            self.ram_size(),
            self.config.memory_size,
            self.ram_hotplug_size(),
            self.ram_granule(),
        )
    }
}

impl RunningMachine<'_> {
    /// Grows guest RAM to `desired` bytes: a new RAM range in a free slot, mapped for KVM
    /// and every passthrough device, then the guest is told. Nothing changes on error.
    pub fn resize_ram(&mut self, desired: u64) -> Result<(), MemoryResizeError> {
        let grow = self.machine.check_ram_resize(desired)?;
        if grow == 0 {
            return Ok(());
        }
        let granule = self.machine.ram_granule();
        let dirty_log = self.machine.config.track_dirty_pages;
        let Some(hotplug) = self.machine.ram_hotplug.as_mut() else {
            return Err(MemoryResizeError::NoHotplug {
                current: self.machine.config.memory_size,
            });
        };
        let slot = lock(&hotplug.block)
            .free_slot()
            .ok_or(MemoryResizeError::NoSlot)?;
        let base = hotplug
            .place(grow, granule)
            .ok_or(MemoryResizeError::NoRoom(grow))?;
        let ram = hotplug.area.view(base, grow)?;
        let (kvm_slot, region) = register_slot(&self.machine.vm, slot, &ram, dirty_log)?;
        if let Err(error) = dma_map(&mut self.machine.devices, &ram) {
            // The guest was told nothing: take the slot back and drop the RAM.
            let removed = kvm_userspace_memory_region {
                memory_size: 0,
                ..region
            };
            // SAFETY: removing the slot just added; its memory is still mapped.
            if let Err(undo) = unsafe { self.machine.vm.set_user_memory_region(removed) } {
                log::error!("cannot remove KVM memory slot {kvm_slot} again: {undo}");
                // Keep the RAM: KVM may still map it.
                hotplug.added.push(AddedRam { ram });
            }
            return Err(error);
        }
        if let Some(pci_hotplug) = self.machine.devices.pci_hotplug.as_mut() {
            pci_hotplug.add_ram(&ram);
        }
        lock(&hotplug.block).insert(slot, base, grow);
        hotplug.added.push(AddedRam { ram });
        log::info!(
            "{} of RAM hot-plugged at {base:#x} (slot {slot}, KVM slot {kvm_slot}); the guest has {}",
            ByteSize(grow),
            ByteSize(self.machine.ram_size()),
        );
        Ok(())
    }
}

/// Registers `ram` (a view of the hot-plug area in hot-plug slot `slot`) as its KVM memory
/// slot; returns the slot number and region.
fn register_slot(
    vm: &kvm_ioctls::VmFd,
    slot: u8,
    ram: &GuestRam,
    dirty_log: bool,
) -> Result<(u32, kvm_userspace_memory_region), MemoryResizeError> {
    let (range, host) = ram
        .host_regions()
        .next()
        .ok_or(MemoryResizeError::NoRoom(ram.size()))?;
    let kvm_slot = FIRST_HOTPLUG_RAM_SLOT + u32::from(slot);
    let region = kvm_userspace_memory_region {
        slot: kvm_slot,
        guest_phys_addr: range.guest_addr,
        memory_size: range.size,
        userspace_addr: host as u64,
        flags: if dirty_log {
            KVM_MEM_LOG_DIRTY_PAGES
        } else {
            0
        },
    };
    // SAFETY: `ram`'s mapping is kept in the machine (RamHotplug::added, dropped after the
    // VM fd) for as long as the slot exists.
    unsafe { vm.set_user_memory_region(region) }.map_err(MemoryResizeError::Kvm)?;
    Ok((kvm_slot, region))
}

impl RamHotplug {
    /// Memory hot-plug of a VM restored from a snapshot taken with `saved`: each slot that
    /// held RAM is plugged again (a view of `area` at the same place, its KVM slot) before
    /// the memory file fills it; the register block itself gets its state with the other
    /// devices. Returns the hot-plug and the plugged RAM, for the memory file's layout and
    /// the passthrough devices' DMA mapping.
    pub(crate) fn restore(
        vm: &kvm_ioctls::VmFd,
        area: GuestRam,
        saved: &SavedRamHotplug,
        block: Arc<Mutex<MemoryHotplug>>,
        dirty_log: bool,
    ) -> Result<RamHotplug, MemoryResizeError> {
        let mut hotplug = RamHotplug::new(area, saved.hotplug_size, block);
        for (slot, held) in saved.block.slots.iter().enumerate() {
            if held.size == 0 {
                continue;
            }
            let slot = u8::try_from(slot)
                .ok()
                .filter(|&slot| slot < MEMORY_HOTPLUG_SLOTS)
                .ok_or(MemoryResizeError::NoSlot)?;
            let ram = hotplug.area.view(held.base, held.size)?;
            register_slot(vm, slot, &ram, dirty_log)?;
            hotplug.added.push(AddedRam { ram });
        }
        if hotplug.added_bytes() > hotplug.hotplug_size {
            return Err(MemoryResizeError::AboveHotplugSize {
                desired: hotplug.added_bytes(),
                boot: 0,
                hotplug_size: hotplug.hotplug_size,
            });
        }
        Ok(hotplug)
    }

    /// The RAM plugged so far, one view per slot.
    pub(crate) fn plugged(&self) -> impl Iterator<Item = &GuestRam> {
        self.added.iter().map(|added| &added.ram)
    }
}

impl Machine {
    /// Guest RAM as snapshots write and restores fill it: boot RAM and every plugged range,
    /// one file.
    pub(crate) fn ram_mappings(
        &self,
    ) -> Result<gpuvm_memory::snapshot::RamMappings<'_>, gpuvm_memory::snapshot::SnapshotError>
    {
        let mut rams = vec![&self.ram];
        if let Some(hotplug) = &self.ram_hotplug {
            rams.extend(hotplug.plugged());
        }
        gpuvm_memory::snapshot::RamMappings::from_guest_rams(&rams)
    }

    /// Memory hot-plug's part of a snapshot: the room and the register block's slots.
    pub(crate) fn save_ram_hotplug(
        &self,
    ) -> Result<Option<SavedRamHotplug>, crate::devices::DeviceStateError> {
        let Some(hotplug) = &self.ram_hotplug else {
            return Ok(None);
        };
        Ok(Some(SavedRamHotplug {
            hotplug_size: hotplug.hotplug_size,
            block: gpuvm_devices::Persist::save(&*lock(&hotplug.block))?,
        }))
    }
}

/// Maps `ram` for every passthrough device, cold- and hot-plugged, before the guest may
/// use it (through each device's mapper, on this thread, so that it is done when this
/// returns).
fn dma_map(
    devices: &mut crate::devices::MachineDevices,
    ram: &GuestRam,
) -> Result<(), MemoryResizeError> {
    let hot = devices.pci_hotplug.iter().flat_map(|h| h.dma_mappings());
    for mapping in devices.dma_mappings.iter().chain(hot) {
        let mapper = mapping.mapper();
        for region in RamChunks::regions_of(ram) {
            // SAFETY: `ram` stays mapped for as long as the machine, which drops its
            // devices (and so their IOMMU mappings) first.
            unsafe { mapper.map(&region) }.map_err(|error| MemoryResizeError::Dma {
                device: mapper.name(),
                error,
            })?;
        }
        log::info!(
            "hot-plugged RAM at {:#x}: DMA-mapped for {}",
            ram.regions().first().map_or(0, |r| r.guest_addr),
            mapper.name()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvm_memory::GuestRamConfig;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn growth_is_checked_against_blocks_and_the_hot_plug_size() {
        let block = MEMORY_BLOCK_SIZE;
        let boot = 512 * MIB;
        // Kata's shape: the new total, rounded to the block.
        assert_eq!(
            check_growth(boot + 256 * MIB, boot, boot, Some(GIB), block).unwrap(),
            256 * MIB
        );
        assert_eq!(check_growth(boot, boot, boot, None, block).unwrap(), 0);
        assert!(matches!(
            check_growth(0, boot, boot, Some(GIB), block),
            Err(MemoryResizeError::Zero)
        ));
        assert!(matches!(
            check_growth(boot + MIB, boot, boot, None, block),
            Err(MemoryResizeError::NoHotplug { .. })
        ));
        assert!(matches!(
            check_growth(boot + 100 * MIB, boot, boot, Some(GIB), block),
            Err(MemoryResizeError::NotBlockMultiple { .. })
        ));
        assert!(matches!(
            check_growth(boot + 2 * GIB, boot, boot, Some(GIB), block),
            Err(MemoryResizeError::AboveHotplugSize { .. })
        ));
        assert!(matches!(
            check_growth(boot - block, boot, boot, Some(GIB), block),
            Err(MemoryResizeError::Shrink { .. })
        ));
        // Counted from boot RAM: what was added already uses up the hot-plug size.
        let now = boot + 768 * MIB;
        assert_eq!(
            check_growth(boot + GIB, now, boot, Some(GIB), block).unwrap(),
            256 * MIB
        );
        assert!(check_growth(boot + GIB + block, now, boot, Some(GIB), block).is_err());
        // 1 GiB huge pages: RAM grows in whole pages.
        assert!(matches!(
            check_growth(boot + 512 * MIB, boot, boot, Some(4 * GIB), GIB),
            Err(MemoryResizeError::NotBlockMultiple { granule, .. }) if granule == GIB
        ));
        for error in [
            check_growth(0, boot, boot, Some(GIB), block).unwrap_err(),
            check_growth(boot + 2 * GIB, boot, boot, Some(GIB), block).unwrap_err(),
        ] {
            assert_eq!(error.status(), 400);
        }
    }

    #[test]
    fn ranges_are_placed_first_fit_inside_the_area() {
        let block = Arc::new(Mutex::new(MemoryHotplug::new(None)));
        let boot = GuestRam::create_with_hotplug_room(
            &GuestRamConfig::new(64 * MIB),
            &[gpuvm_memory::RamRegion {
                guest_addr: 0,
                size: 64 * MIB,
                file_offset: 0,
            }],
            GIB,
        )
        .unwrap();
        let area = boot.hotplug_area(4 * GIB, GIB).unwrap();
        let mut hotplug = RamHotplug::new(area, GIB, block);
        assert_eq!(hotplug.place(256 * MIB, MEMORY_BLOCK_SIZE), Some(4 * GIB));
        assert_eq!(hotplug.place(GIB, MEMORY_BLOCK_SIZE), Some(4 * GIB));
        assert_eq!(
            hotplug.place(GIB + MEMORY_BLOCK_SIZE, MEMORY_BLOCK_SIZE),
            None
        );
        let ram = hotplug.area.view(4 * GIB, 256 * MIB).unwrap();
        assert_eq!(ram.regions()[0].file_offset, 64 * MIB);
        hotplug.added.push(AddedRam { ram });
        assert_eq!(hotplug.added_bytes(), 256 * MIB);
        assert_eq!(
            hotplug.place(128 * MIB, MEMORY_BLOCK_SIZE),
            Some(4 * GIB + 256 * MIB)
        );
        assert_eq!(
            hotplug.place(768 * MIB, MEMORY_BLOCK_SIZE),
            Some(4 * GIB + 256 * MIB)
        );
        assert_eq!(hotplug.place(GIB, MEMORY_BLOCK_SIZE), None);
    }
}
