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
//! then the guest is told (the block's insert event and the GED interrupt).
//!
//! Shrinking removes whole slots, newest first, down to exactly `desired_ram` (any other
//! size is refused with the sizes it could be): the guest is asked to eject each (the
//! block's remove event and the GED interrupt; Linux offlines the range and runs `_EJ0`)
//! and the resize answers once it did, or with an error after [`memory_eject_timeout`]
//! (the request is withdrawn and the RAM stays the guest's). Once ejected, on the VMM
//! thread: every passthrough device's DMA mapping of the range goes first (a device must
//! never reach freed RAM; if one cannot be removed the RAM stays allocated), then the KVM
//! memory slot, then the host pages (a hole punched in the file's range), and the slot is
//! free for a later grow; devices hot-plugged later no longer map the range.
//!
//! A device hot-plugged moments before maps guest RAM (hot-plugged slots included) on a
//! background thread (crate::dma): a range unmapped while it runs could be mapped after,
//! leaving the device pinning pages the VM gave back. So a shrink is refused (409, the
//! client retries) while any passthrough device's background mapping is still running,
//! and RAM the guest ejected on its own stays allocated until then. The other order
//! cannot race: the shrink waits for the eject on the run loop, so a hot-plug sent
//! meanwhile is handled after it answered, and maps only what is left.
//!
//! What the area's early mapping costs: a guest that points a virtio buffer into a part
//! of the area it was not given gets zeroes and, for writes, makes the host allocate
//! those pages: at most the hot-plug size the VM was allowed, its own memory, never
//! another VM's, and never reachable by a passthrough device (no IOMMU mapping).

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::memslots::MemorySlot;
use gpuvm_devices::memory_hotplug::{
    ost_status_meaning, MemoryHotplug, MEMORY_BLOCK_SIZE, MEMORY_HOTPLUG_SLOTS, OST_EJECT_REQUEST,
};
use gpuvm_memory::{ByteSize, GuestRam, RamError};

use super::{Machine, RunningMachine};
use crate::devices::SavedRamHotplug;
use crate::dma::RamChunks;
use crate::lock;

/// KVM memory slot of hot-plug slot 0; slot n uses this + n. Boot RAM has the slots
/// below; BAR mappings count up from crate::pci::FIRST_BAR_SLOT.
pub(crate) const FIRST_HOTPLUG_RAM_SLOT: u32 = crate::builder::BOOT_RAM_SLOTS;
const _: () =
    assert!(FIRST_HOTPLUG_RAM_SLOT + MEMORY_HOTPLUG_SLOTS as u32 <= crate::pci::FIRST_BAR_SLOT);

/// How long a vm.resize that shrinks RAM waits for the guest's eject, unless
/// [`MEMORY_EJECT_TIMEOUT_VAR`] says otherwise (as DELETE /gpus/{id} does).
pub const MEMORY_EJECT_TIMEOUT: Duration = Duration::from_secs(30);
/// `GPUVM_MEMORY_EJECT_TIMEOUT_MS=<ms>`: the memory eject timeout.
pub const MEMORY_EJECT_TIMEOUT_VAR: &str = "GPUVM_MEMORY_EJECT_TIMEOUT_MS";
/// How often the VMM thread looks for the guest's eject while a shrink waits.
const EJECT_POLL: Duration = Duration::from_millis(5);

/// The memory eject timeout in effect.
pub fn memory_eject_timeout() -> Duration {
    std::env::var(MEMORY_EJECT_TIMEOUT_VAR)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(MEMORY_EJECT_TIMEOUT, Duration::from_millis)
}

/// The machine's memory hot-plug: the room for it, the register block and the RAM added.
pub(crate) struct RamHotplug {
    /// The room kept for hot-plugged RAM, mapped whole (see the module's comment).
    area: GuestRam,
    /// What the user asked for (`memory.hotplug_size`): the most RAM that may be added.
    hotplug_size: u64,
    block: Arc<Mutex<MemoryHotplug>>,
    /// The RAM of each filled slot: a view of its range of `area`.
    added: Vec<AddedRam>,
    /// Bumped whenever a slot is filled or freed: the memory file's layout changed.
    layout: u64,
    /// `layout` when the last memory file of the snapshot chain was written (or restored
    /// from): a diff on that chain needs the same slots, registered since then (their
    /// dirty log started with them).
    chain_layout: Option<u64>,
}

struct AddedRam {
    /// Its slot of the register block.
    slot: u8,
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
            layout: 0,
            chain_layout: None,
        }
    }

    /// The memory chain was just written (or restored from) with the slots as they are.
    pub(crate) fn note_chain_layout(&mut self) {
        self.chain_layout = Some(self.layout);
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
         --memory hotplug_size=...): it keeps its {} of RAM", ByteSize(*.current)
    )]
    NoHotplug { current: u64 },
    #[error("desired_ram = 0: a VM needs RAM")]
    Zero,
    #[error(
        "desired_ram = {desired} is below the VM's {} of boot RAM: only hot-plugged RAM \
         can be removed", ByteSize(*.boot)
    )]
    BelowBoot { desired: u64, boot: u64 },
    #[error(
        "desired_ram = {desired} is not boot RAM plus whole hot-plugged slots (RAM is \
         removed a slot at a time, newest first): it can shrink to {}",
        sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    )]
    NotSlotBoundary { desired: u64, sizes: Vec<u64> },
    #[error("the VM is paused: resume it first (the guest has to eject the RAM)")]
    Paused,
    #[error("the lazy restore has not loaded guest RAM yet: remove RAM once it is done")]
    LazyLoading,
    #[error("the guest is still asked to eject hot-plugged RAM: resize once that is done")]
    RemovalPending,
    #[error(
        "passthrough device {device} is still DMA-mapping guest RAM in the background \
         ({mapped_mib} of {total_mib} MiB mapped, as after a hot-plug or a restore): RAM is \
         not removed before that mapping is done, or the device could map a range after it \
         was taken back. The VM keeps its {current} bytes; retry the resize once the mapping \
         is done"
    )]
    DmaMappingInProgress {
        device: String,
        mapped_mib: u64,
        total_mib: u64,
        current: u64,
    },
    #[error(
        "the guest did not eject slot(s) {slots:?} within {} ms{}; the request is withdrawn \
         and the VM keeps its {current} bytes (a Linux guest needs the range offlinable: \
         memhp_default_state=online_movable)",
        timeout.as_millis(),
        guest_said.as_deref().map(|said| format!(" (its last _OST: {said})")).unwrap_or_default()
    )]
    EjectTimeout {
        slots: Vec<u8>,
        timeout: Duration,
        current: u64,
        /// What the guest's `_OST` last said about the eject request of one of `slots`.
        guest_said: Option<String>,
    },
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
    #[error(
        "cannot take passthrough device {device}'s DMA mapping of the RAM the guest ejected \
         at {guest_addr:#x} back: {error}; the RAM stays allocated"
    )]
    DmaUnmap {
        device: String,
        guest_addr: u64,
        error: std::io::Error,
    },
}

impl MemoryResizeError {
    /// The HTTP status the API answers with.
    pub fn status(&self) -> u16 {
        match self {
            MemoryResizeError::NoHotplug { .. }
            | MemoryResizeError::Zero
            | MemoryResizeError::BelowBoot { .. }
            | MemoryResizeError::NotSlotBoundary { .. }
            | MemoryResizeError::NotBlockMultiple { .. }
            | MemoryResizeError::AboveHotplugSize { .. }
            | MemoryResizeError::NoSlot
            | MemoryResizeError::NoRoom(_) => 400,
            MemoryResizeError::Paused
            | MemoryResizeError::LazyLoading
            | MemoryResizeError::RemovalPending
            | MemoryResizeError::DmaMappingInProgress { .. } => 409,
            MemoryResizeError::EjectTimeout { .. } => 504,
            MemoryResizeError::Ram(_)
            | MemoryResizeError::Kvm(_)
            | MemoryResizeError::Dma { .. }
            | MemoryResizeError::DmaUnmap { .. } => 500,
        }
    }
}

/// What a resize of guest RAM does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RamResize {
    Unchanged,
    /// Bytes to add, in one new slot.
    Grow(u64),
    /// How many of the plugged slots to remove, newest first.
    Shrink(usize),
}

/// What a resize to `desired` bytes does, for boot RAM `boot` and the slots `plugged`
/// (their sizes, oldest first); see [`check_growth`] for growth. A shrink removes whole
/// slots, newest first, and must land on `desired` exactly.
pub fn plan_ram_resize(
    desired: u64,
    boot: u64,
    plugged: &[u64],
    hotplug_size: Option<u64>,
    granule: u64,
) -> Result<RamResize, MemoryResizeError> {
    let current = boot + plugged.iter().sum::<u64>();
    if desired == 0 {
        return Err(MemoryResizeError::Zero);
    }
    if desired >= current {
        let grow = check_growth(desired, current, boot, hotplug_size, granule)?;
        return Ok(if grow == 0 {
            RamResize::Unchanged
        } else {
            RamResize::Grow(grow)
        });
    }
    if hotplug_size.is_none() {
        return Err(MemoryResizeError::NoHotplug { current });
    }
    if desired < boot {
        return Err(MemoryResizeError::BelowBoot { desired, boot });
    }
    // The sizes reachable by removing the newest slots, largest first.
    let mut sizes = Vec::with_capacity(plugged.len());
    let mut size = current;
    for &slot_size in plugged.iter().rev() {
        size -= slot_size;
        sizes.push(size);
        if size == desired {
            return Ok(RamResize::Shrink(sizes.len()));
        }
    }
    Err(MemoryResizeError::NotSlotBoundary { desired, sizes })
}

/// What a resize from `current` bytes (boot RAM `boot` plus hot-plugged) to `desired` adds,
/// checked against the hot-plug size; `granule` is what RAM grows in. Ok(0) for no change
/// (and for a `desired` below `current`: shrinks are [`plan_ram_resize`]'s).
fn check_growth(
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
    if desired <= current {
        return Ok(0);
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

    /// Whether hot-plugged RAM is laid out as when the memory chain's last file was
    /// written: no slot filled or freed since (else a diff cannot build on that file).
    pub fn hotplug_layout_is_the_chains(&self) -> bool {
        self.ram_hotplug
            .as_ref()
            .is_none_or(|hotplug| hotplug.chain_layout == Some(hotplug.layout))
    }

    /// The KVM memory slot and size of each plugged range, in the memory file's order (for
    /// the dirty log, after boot RAM's slots).
    pub(crate) fn hotplug_kvm_slots(&self) -> Vec<(u32, u64)> {
        let Some(hotplug) = &self.ram_hotplug else {
            return Vec::new();
        };
        let mut slots: Vec<(u32, u64)> = hotplug
            .added
            .iter()
            .map(|added| {
                (
                    FIRST_HOTPLUG_RAM_SLOT + u32::from(added.slot),
                    added.ram.size(),
                )
            })
            .collect();
        slots.sort_unstable();
        slots
    }

    /// What hot-plugged RAM grows in: the memory block size, or the huge page if larger.
    pub fn ram_granule(&self) -> u64 {
        MEMORY_BLOCK_SIZE.max(self.ram.page_size())
    }

    /// Checks a resize of guest RAM to `desired` bytes: what it would do.
    pub fn check_ram_resize(&self, desired: u64) -> Result<RamResize, MemoryResizeError> {
        let plugged: Vec<u64> = self
            .ram_hotplug
            .iter()
            .flat_map(|hotplug| hotplug.added.iter().map(|added| added.ram.size()))
            .collect();
        plan_ram_resize(
            desired,
            self.config.memory_size,
            &plugged,
            self.ram_hotplug_size(),
            self.ram_granule(),
        )
    }
}

impl RunningMachine<'_> {
    /// Brings guest RAM to `desired` bytes: grows it ([`Self::grow_ram`]) or removes
    /// whole slots ([`Self::shrink_ram`]). Slots the guest ejected on its own before are
    /// freed first.
    pub fn resize_ram(&mut self, desired: u64) -> Result<(), MemoryResizeError> {
        match self.free_ejected_ram() {
            // They stay allocated until the mapping is done; a grow need not wait for that
            // (a shrink refuses on its own, below).
            Err(MemoryResizeError::DmaMappingInProgress { device, .. }) => {
                log::info!("RAM the guest ejected is freed once {device}'s DMA mapping is done")
            }
            other => other?,
        }
        match self.machine.check_ram_resize(desired)? {
            RamResize::Unchanged => Ok(()),
            RamResize::Grow(grow) => self.grow_ram(grow),
            RamResize::Shrink(count) => self.shrink_ram(count),
        }
    }

    /// Adds `grow` bytes of RAM: a new RAM range in a free slot, mapped for KVM and every
    /// passthrough device, then the guest is told. Nothing changes on error.
    fn grow_ram(&mut self, grow: u64) -> Result<(), MemoryResizeError> {
        let granule = self.machine.ram_granule();
        let dirty_log = self.machine.config.track_dirty_pages;
        let Some(hotplug) = self.machine.ram_hotplug.as_mut() else {
            return Err(MemoryResizeError::NoHotplug {
                current: self.machine.config.memory_size,
            });
        };
        if lock(&hotplug.block).removal_pending() {
            return Err(MemoryResizeError::RemovalPending);
        }
        let slot = lock(&hotplug.block)
            .free_slot()
            .ok_or(MemoryResizeError::NoSlot)?;
        let base = hotplug
            .place(grow, granule)
            .ok_or(MemoryResizeError::NoRoom(grow))?;
        let ram = hotplug.area.view(base, grow)?;
        let region = register_slot(&self.machine.vm, slot, &ram, dirty_log)?;
        let kvm_slot = region.slot;
        if let Err(error) = dma_map(&mut self.machine.devices, &ram) {
            // The guest was told nothing: take the slot back and drop the RAM.
            if let Err(undo) = region.remove(&self.machine.vm) {
                log::error!("cannot remove KVM memory slot {kvm_slot} again: {undo}");
                // Keep the RAM: KVM may still map it.
                hotplug.added.push(AddedRam { slot, ram });
                hotplug.layout += 1;
            }
            return Err(error);
        }
        if let Some(pci_hotplug) = self.machine.devices.pci_hotplug.as_mut() {
            pci_hotplug.add_ram(&ram);
        }
        lock(&hotplug.block).insert(slot, base, grow);
        hotplug.added.push(AddedRam { slot, ram });
        hotplug.layout += 1;
        log::info!(
            "{} of RAM hot-plugged at {base:#x} (slot {slot}, KVM slot {kvm_slot}); the guest has {}",
            ByteSize(grow),
            ByteSize(self.machine.ram_size()),
        );
        Ok(())
    }
}

impl RunningMachine<'_> {
    /// Removes the newest `count` slots: the guest is asked to eject them, and this waits
    /// (on the VMM thread, at most [`memory_eject_timeout`]) until it did, then frees
    /// their RAM. On timeout the requests still open are withdrawn and the RAM stays.
    fn shrink_ram(&mut self, count: usize) -> Result<(), MemoryResizeError> {
        if self.machine.paused {
            return Err(MemoryResizeError::Paused);
        }
        if !self.machine.lazy_progress().unwrap_or(false) {
            return Err(MemoryResizeError::LazyLoading);
        }
        // Checked before the guest is asked: nothing can start a mapping while this waits
        // for the eject (the run loop is here; a hot-plug waits for the answer).
        self.refuse_while_dma_mapping()?;
        let current = self.machine.ram_size();
        let Some(hotplug) = self.machine.ram_hotplug.as_ref() else {
            return Err(MemoryResizeError::NoHotplug { current });
        };
        let block = hotplug.block.clone();
        if lock(&block).removal_pending() {
            return Err(MemoryResizeError::RemovalPending);
        }
        let slots: Vec<u8> = hotplug
            .added
            .iter()
            .rev()
            .take(count)
            .map(|added| added.slot)
            .collect();
        for &slot in &slots {
            if lock(&block).request_remove(slot) {
                log::info!("the guest is asked to eject hot-plugged RAM slot {slot}");
            }
        }
        let timeout = memory_eject_timeout();
        let deadline = Instant::now() + timeout;
        loop {
            let waiting: Vec<u8> = {
                let block = lock(&block);
                slots
                    .iter()
                    .copied()
                    .filter(|&slot| !block.is_ejected(slot))
                    .collect()
            };
            if waiting.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let guest_said = lock(&block).last_ost().and_then(|(slot, event, status)| {
                    let about_waiting =
                        u8::try_from(slot).is_ok_and(|slot| waiting.contains(&slot));
                    (about_waiting && event == OST_EJECT_REQUEST).then(|| {
                        format!("{status:#x}, {} on slot {slot}", ost_status_meaning(status))
                    })
                });
                for &slot in &waiting {
                    lock(&block).cancel_remove(slot);
                }
                // What the guest did eject is its no more.
                self.free_ejected_ram()?;
                return Err(MemoryResizeError::EjectTimeout {
                    slots: waiting,
                    timeout,
                    current: self.machine.ram_size(),
                    guest_said,
                });
            }
            std::thread::sleep(EJECT_POLL);
        }
        self.free_ejected_ram()?;
        log::info!(
            "hot-plugged RAM removed; the guest has {}",
            ByteSize(self.machine.ram_size())
        );
        Ok(())
    }

    /// Refuses to take RAM back while a passthrough device's background DMA mapping of
    /// guest RAM still runs (a device hot-plugged moments ago, or a restore's): its thread
    /// maps the chunks it was given, hot-plugged RAM among them, until it is done, so a
    /// range unmapped now could be mapped again after, leaving the device pinning pages the
    /// VM no longer has. A mapping that failed or was stopped maps nothing more.
    fn refuse_while_dma_mapping(&self) -> Result<(), MemoryResizeError> {
        let running = self
            .machine
            .devices
            .background_mappings()
            .map(|mapping| mapping.progress().status())
            .find(|status| !status.done && status.error.is_none());
        match running {
            None => Ok(()),
            Some(status) => Err(MemoryResizeError::DmaMappingInProgress {
                device: status.name,
                mapped_mib: status.mapped_bytes >> 20,
                total_mib: status.total_bytes >> 20,
                current: self.machine.ram_size(),
            }),
        }
    }

    /// Frees the RAM of every slot the guest ejected: every passthrough device's DMA
    /// mapping of it goes first, then its KVM memory slot, then its host pages, then the
    /// slot is free again. A mapping that cannot be removed keeps the RAM allocated (and
    /// counted): no device may reach freed memory. While a device's background mapping
    /// still runs nothing is freed ([`Self::refuse_while_dma_mapping`]).
    fn free_ejected_ram(&mut self) -> Result<(), MemoryResizeError> {
        let Some(hotplug) = self.machine.ram_hotplug.as_ref() else {
            return Ok(());
        };
        if lock(&hotplug.block).ejected_slots().is_empty() {
            return Ok(());
        }
        // A mapping still running may map the range after it was unmapped here.
        self.refuse_while_dma_mapping()?;
        let Some(hotplug) = self.machine.ram_hotplug.as_mut() else {
            return Ok(());
        };
        let ejected = lock(&hotplug.block).ejected_slots();
        for slot in ejected {
            let Some(at) = hotplug.added.iter().position(|added| added.slot == slot) else {
                lock(&hotplug.block).release_ejected(slot);
                continue;
            };
            let ram = &hotplug.added[at].ram;
            let (range, host) = ram
                .host_regions()
                .next()
                .ok_or(MemoryResizeError::NoRoom(ram.size()))?;
            dma_unmap(&mut self.machine.devices, ram)?;
            // The view is dropped only below, after KVM let go of it.
            let removed = MemorySlot {
                slot: FIRST_HOTPLUG_RAM_SLOT + u32::from(slot),
                guest_addr: range.guest_addr,
                size: range.size,
                host: host as u64,
                dirty_log: false,
            };
            removed
                .remove(&self.machine.vm)
                .map_err(MemoryResizeError::Kvm)?;
            if let Err(error) = punch_hole(ram) {
                // The guest cannot reach the range any more; only the host memory stays.
                log::warn!(
                    "hot-plugged RAM at {:#x}: cannot free its host pages: {error}",
                    range.guest_addr
                );
            }
            if let Some(pci_hotplug) = self.machine.devices.pci_hotplug.as_mut() {
                pci_hotplug.remove_ram(range.guest_addr, range.size);
            }
            hotplug.added.remove(at);
            hotplug.layout += 1;
            lock(&hotplug.block).release_ejected(slot);
            log::info!(
                "hot-plugged RAM slot {slot} ejected by the guest: {} at {:#x} freed",
                ByteSize(range.size),
                range.guest_addr
            );
        }
        Ok(())
    }
}

/// Gives `ram`'s pages back to the host: a hole punched in its range of guest RAM's file
/// (memfd, tmpfs or hugetlbfs alike; the range is whole pages of the backing), which also
/// drops them from every mapping of the file.
fn punch_hole(ram: &GuestRam) -> std::io::Result<()> {
    for region in ram.regions() {
        let offset = libc::off_t::try_from(region.file_offset)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let len = libc::off_t::try_from(region.size)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: fallocate on a file descriptor `ram` owns; nothing in this process is
        // referenced as Rust data inside the range (guest RAM is only reached through
        // volatile accesses), and neither KVM nor any device maps it any more.
        let result = unsafe {
            libc::fallocate(
                ram.memfd().as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
        };
        if result != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Registers `ram` (a view of the hot-plug area in hot-plug slot `slot`) as its KVM memory
/// slot; returns it.
fn register_slot(
    vm: &kvm_ioctls::VmFd,
    slot: u8,
    ram: &GuestRam,
    dirty_log: bool,
) -> Result<MemorySlot, MemoryResizeError> {
    let (range, host) = ram
        .host_regions()
        .next()
        .ok_or(MemoryResizeError::NoRoom(ram.size()))?;
    let region = MemorySlot {
        slot: FIRST_HOTPLUG_RAM_SLOT + u32::from(slot),
        guest_addr: range.guest_addr,
        size: range.size,
        host: host as u64,
        dirty_log,
    };
    // SAFETY: `ram`'s mapping is kept in the machine (RamHotplug::added, dropped after the
    // VM fd) for as long as the slot exists.
    unsafe { region.set(vm) }.map_err(MemoryResizeError::Kvm)?;
    Ok(region)
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
        Self::plug_saved(vm, area, saved, block, dirty_log, GuestRam::view)
    }

    /// As [`RamHotplug::restore`], for a live update: `area` is in the RAM file the old
    /// process handed over, whose plugged ranges hold the guest's pages already (with
    /// hugetlb, the pool is not asked for them again).
    pub(crate) fn adopt(
        vm: &kvm_ioctls::VmFd,
        area: GuestRam,
        saved: &SavedRamHotplug,
        block: Arc<Mutex<MemoryHotplug>>,
        dirty_log: bool,
    ) -> Result<RamHotplug, MemoryResizeError> {
        Self::plug_saved(vm, area, saved, block, dirty_log, GuestRam::held_view)
    }

    /// Plugs each slot `saved` holds again, its RAM made by `view` of `area`.
    fn plug_saved(
        vm: &kvm_ioctls::VmFd,
        area: GuestRam,
        saved: &SavedRamHotplug,
        block: Arc<Mutex<MemoryHotplug>>,
        dirty_log: bool,
        view: fn(&GuestRam, u64, u64) -> Result<GuestRam, RamError>,
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
            let ram = view(&hotplug.area, held.base, held.size)?;
            register_slot(vm, slot, &ram, dirty_log)?;
            hotplug.added.push(AddedRam { slot, ram });
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

    /// The RAM plugged so far, one view per slot, in slot order: the order of the memory
    /// file, which a restore (that knows slots, not the order they were plugged in) reads
    /// back the same way.
    pub(crate) fn plugged(&self) -> impl Iterator<Item = &GuestRam> {
        let mut by_slot: Vec<&AddedRam> = self.added.iter().collect();
        by_slot.sort_unstable_by_key(|added| added.slot);
        by_slot.into_iter().map(|added| &added.ram)
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

    /// Boot and hot-plugged RAM as DMA regions at this process's addresses.
    pub(crate) fn dma_regions_of_all_ram(&self) -> Vec<gpuvm_vfio::DmaRegion> {
        let plugged = self
            .ram_hotplug
            .iter()
            .flat_map(|hotplug| hotplug.plugged());
        RamChunks::regions_of_all(&self.ram, plugged)
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

/// Every kernel VFIO context, the cold-plugged devices' and each hot-plugged device's own:
/// each notes the RAM mapped in it (a type1 live update moves those host addresses).
fn kernel_contexts(
    devices: &crate::devices::MachineDevices,
) -> impl Iterator<Item = &crate::update::handed_over::PluggedKernelContext> {
    let hot = devices.pci_hotplug.iter().flat_map(|h| h.kernel_contexts());
    devices.handover.kernel.iter().chain(hot)
}

/// Maps `ram` for every passthrough device, cold- and hot-plugged, before the guest may
/// use it (through each device's mapper, on this thread, so that it is done when this
/// returns). On failure what was mapped is unmapped again: the RAM is dropped, and no
/// device may keep it pinned. The kernel VFIO contexts note the mappings (a type1 live
/// update moves their host addresses).
fn dma_map(
    devices: &mut crate::devices::MachineDevices,
    ram: &GuestRam,
) -> Result<(), MemoryResizeError> {
    let regions = RamChunks::regions_of(ram);
    let mut mapped: Vec<(Arc<dyn gpuvm_vfio::dma::DmaMapper>, &gpuvm_vfio::DmaRegion)> = Vec::new();
    let mut failed = None;
    'devices: for mapping in devices.background_mappings() {
        let mapper = mapping.mapper();
        for region in &regions {
            // SAFETY: `ram` stays mapped for as long as the machine, which drops its
            // devices (and so their IOMMU mappings) first; on failure every mapping made
            // here is removed before `ram` is dropped.
            match unsafe { mapper.map(region) } {
                Ok(()) => mapped.push((mapper.clone(), region)),
                Err(error) => {
                    failed = Some(MemoryResizeError::Dma {
                        device: mapper.name(),
                        error,
                    });
                    break 'devices;
                }
            }
        }
        log::info!(
            "hot-plugged RAM at {:#x}: DMA-mapped for {}",
            ram.regions().first().map_or(0, |r| r.guest_addr),
            mapper.name()
        );
    }
    if let Some(error) = failed {
        for (mapper, region) in mapped.iter().rev() {
            if let Err(undo) = mapper.unmap(region.guest_addr, region.size) {
                log::error!(
                    "hot-plugged RAM at {:#x}: {} keeps a DMA mapping after the failed hot-plug: {undo}",
                    region.guest_addr,
                    mapper.name()
                );
            }
        }
        return Err(error);
    }
    for context in kernel_contexts(devices) {
        context.note_mapped(&regions);
    }
    Ok(())
}

/// Takes every passthrough device's DMA mapping of `ram` (RAM the guest ejected) back,
/// as [`dma_map`] made it, before its pages may be freed.
fn dma_unmap(
    devices: &mut crate::devices::MachineDevices,
    ram: &GuestRam,
) -> Result<(), MemoryResizeError> {
    let regions = RamChunks::regions_of(ram);
    for mapping in devices.background_mappings() {
        let mapper = mapping.mapper();
        for region in &regions {
            mapper
                .unmap(region.guest_addr, region.size)
                .map_err(|error| MemoryResizeError::DmaUnmap {
                    device: mapper.name(),
                    guest_addr: region.guest_addr,
                    error,
                })?;
        }
        log::info!(
            "ejected RAM at {:#x}: DMA mapping removed for {}",
            ram.regions().first().map_or(0, |r| r.guest_addr),
            mapper.name()
        );
    }
    for context in kernel_contexts(devices) {
        context.note_unmapped(&regions);
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
    fn shrinking_removes_the_newest_slots_down_to_the_size_asked() {
        let block = MEMORY_BLOCK_SIZE;
        let boot = 256 * MIB;
        let plugged = [256 * MIB, 128 * MIB, 512 * MIB];
        let now = boot + 896 * MIB;
        let plan = |desired| plan_ram_resize(desired, boot, &plugged, Some(2 * GIB), block);
        assert_eq!(plan(now).unwrap(), RamResize::Unchanged);
        assert_eq!(plan(now + block).unwrap(), RamResize::Grow(block));
        assert_eq!(plan(now - 512 * MIB).unwrap(), RamResize::Shrink(1));
        assert_eq!(plan(boot + 256 * MIB).unwrap(), RamResize::Shrink(2));
        assert_eq!(plan(boot).unwrap(), RamResize::Shrink(3));
        // Inside the newest slot, or between slots: refused, naming what is possible.
        match plan(now - block) {
            Err(error @ MemoryResizeError::NotSlotBoundary { .. }) => {
                assert_eq!(error.status(), 400);
                let says = error.to_string();
                let sizes = format!("{}, {}, {}", boot + 384 * MIB, boot + 256 * MIB, boot);
                assert!(says.ends_with(&sizes), "{says}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            plan(boot - block),
            Err(MemoryResizeError::BelowBoot { .. })
        ));
        assert!(matches!(plan(0), Err(MemoryResizeError::Zero)));
        // Without memory hot-plug nothing is removed either.
        assert!(matches!(
            plan_ram_resize(boot - block, boot, &[], None, block),
            Err(MemoryResizeError::NoHotplug { .. })
        ));
        // Nothing plugged: boot RAM is all there is.
        assert!(matches!(
            plan_ram_resize(boot - block, boot, &[], Some(GIB), block),
            Err(MemoryResizeError::BelowBoot { .. })
        ));
    }

    #[test]
    fn a_punched_hole_gives_the_pages_back() {
        let ram = GuestRam::create(
            &GuestRamConfig::new(4 * MIB),
            &[gpuvm_memory::RamRegion {
                guest_addr: 0,
                size: 4 * MIB,
                file_offset: 0,
            }],
        )
        .unwrap();
        let view = ram.view(MIB, 2 * MIB).unwrap();
        let host = view.host_address(0).unwrap();
        // SAFETY: the view maps 2 MiB at `host`, used by nothing else in this test.
        unsafe { std::ptr::write_bytes(host, 0x5a, (2 * MIB) as usize) };
        let allocated = |ram: &GuestRam| {
            use std::os::unix::fs::MetadataExt;
            ram.memfd().metadata().unwrap().blocks() * 512
        };
        assert!(allocated(&ram) >= 2 * MIB);
        punch_hole(&view).unwrap();
        assert!(allocated(&ram) < MIB, "{}", allocated(&ram));
        // SAFETY: as above; the range reads as fresh pages now.
        assert_eq!(unsafe { std::ptr::read_volatile(host) }, 0);
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
        hotplug.added.push(AddedRam { slot: 0, ram });
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
