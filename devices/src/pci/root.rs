//! PCI bus 0: configuration access (mechanism #1 and ECAM), BAR allocation at plug time,
//! and dispatch of guest accesses to the BARs as currently programmed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::bars::BarKind;
use super::{config, PciDevice};
use crate::BusDevice;

/// Segment/bus/device/function of a PCI function. `Display` gives `bb:dd.f` (the
/// segment is implied by the root); [`PciBdf::full`] gives `ssss:bb:dd.f`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PciBdf {
    /// The PCI segment group (the root) the function sits on.
    pub segment: u16,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl std::fmt::Display for PciBdf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:02x}:{:02x}.{}", self.bus, self.device, self.function)
    }
}

impl PciBdf {
    /// The address with its segment, as Linux and Cloud Hypervisor write it: `0001:00:02.0`.
    pub fn full(&self) -> String {
        format!("{:04x}:{self}", self.segment)
    }

    /// The address as gpuvm logs and labels a device: `bus:device.function` on segment 0,
    /// with the segment in front elsewhere (`0001:03:00.0`, a NUMA node's segment).
    pub fn shown(&self) -> String {
        if self.segment == 0 {
            self.to_string()
        } else {
            self.full()
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciError {
    #[error("PCI bus 0 of segment {0} is full (32 devices)")]
    BusFull(u16),
    #[error("no room for a {size:#x}-byte BAR in the {window} MMIO window {start:#x}..{end:#x}")]
    NoSpace {
        window: &'static str,
        size: u64,
        start: u64,
        end: u64,
    },
    #[error("invalid PCI MMIO layout: {0}")]
    Layout(&'static str),
    #[error("the PCI bus cannot be saved: {0}")]
    NotSaved(&'static str),
    #[error("PCI slot {0:#04x} is taken or out of range")]
    SlotTaken(u8),
    #[error(
        "a {size:#x}-byte BAR cannot go back to {base:#x}: the {window} window does not have \
         that range free"
    )]
    RangeTaken {
        window: &'static str,
        base: u64,
        size: u64,
    },
    #[error("the snapshot's PCI state does not fit this bus: {0}")]
    SavedState(String),
    #[error("PCI {bdf}: {reason}")]
    NotWhereSaved { bdf: String, reason: String },
}

/// Where the root puts things in guest-physical space. Saved for a live update's new
/// process, which rebuilds segments 1.. as the guest's ACPI tables have them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciRootConfig {
    /// ECAM (memory-mapped configuration) base: 1 MiB per bus from bus 0.
    pub ecam_base: u64,
    /// How many buses from bus 0 the ECAM window covers (1 without bridges; see
    /// [`PciRoot::config`]).
    pub buses: u16,
    /// 32-bit BARs go in `[mmio32_start, mmio32_end)`.
    pub mmio32_start: u64,
    pub mmio32_end: u64,
    /// 64-bit BARs go in `[mmio64_start, mmio64_start + mmio64_size)`.
    pub mmio64_start: u64,
    pub mmio64_size: u64,
}

impl PciRootConfig {
    /// Bytes of ECAM space for bus 0 (for each bus).
    pub const ECAM_SIZE: u64 = 1 << 20;

    /// Bytes of ECAM space for all [`PciRootConfig::buses`].
    pub fn ecam_size(&self) -> u64 {
        u64::from(self.buses.clamp(1, 256)) * Self::ECAM_SIZE
    }

    pub fn validate(&self) -> Result<(), PciError> {
        if self.mmio32_start >= self.mmio32_end || self.mmio32_end > 1 << 32 {
            return Err(PciError::Layout(
                "the 32-bit window must be non-empty and below 4 GiB",
            ));
        }
        let ecam_end = self.ecam_base + self.ecam_size();
        if self.ecam_base < self.mmio32_end && ecam_end > self.mmio32_start {
            return Err(PciError::Layout("ECAM overlaps the 32-bit window"));
        }
        if self.mmio64_size == 0 || self.mmio64_start.checked_add(self.mmio64_size).is_none() {
            return Err(PciError::Layout("the 64-bit window must be non-empty"));
        }
        Ok(())
    }
}

type SharedDevice = Arc<Mutex<dyn PciDevice>>;

fn lock(device: &SharedDevice) -> MutexGuard<'_, dyn PciDevice + 'static> {
    // A poisoned lock means a device panicked earlier; keep serving the guest.
    device.lock().unwrap_or_else(|e| e.into_inner())
}

/// Places BARs in one window `[start, end)`: each aligned to its own size, in the
/// smallest free range that holds it (ranges skipped for alignment, or given back by
/// removed devices), else after everything placed so far. Best fit keeps the big ranges
/// whole: a 32 MiB BAR goes into the gap below a 256 GiB-aligned BAR1, not after it, so
/// N devices with one BAR1 each pack into N BAR1s of space plus one gap.
///
/// Pure bookkeeping: the VMM's address-space planner runs the same allocator over the
/// devices it is about to plug to size the window
/// (gpuvm_arch::x86_64::address_space).
#[derive(Clone, Debug)]
pub struct BarAllocator {
    start: u64,
    next: u64,
    end: u64,
    name: &'static str,
    /// Free ranges below `next` (base, size), sorted and coalesced.
    free: Vec<(u64, u64)>,
}

impl BarAllocator {
    /// An allocator for `[start, end)`, named (`"32-bit"`, `"64-bit"`) in its errors.
    pub fn new(name: &'static str, start: u64, end: u64) -> Self {
        BarAllocator {
            start,
            next: start,
            end,
            name,
            free: Vec::new(),
        }
    }

    /// The end of the highest range placed so far (the window's start when none is).
    pub fn high_water(&self) -> u64 {
        self.next
    }

    /// Places a `size`-byte BAR (a power of two), aligned to its size.
    pub fn allocate(&mut self, size: u64) -> Result<u64, PciError> {
        self.allocate_aligned(size, size)
    }

    /// Places `size` bytes aligned to `align` (a bridge window holding several BARs).
    pub fn allocate_aligned(&mut self, size: u64, align: u64) -> Result<u64, PciError> {
        let align = align.max(1);
        let best = self
            .free
            .iter()
            .enumerate()
            .filter_map(|(at, &(base, len))| {
                let placed = base.checked_next_multiple_of(align)?;
                (placed.checked_add(size)? <= base + len).then_some((len, base, at, placed))
            })
            .min();
        if let Some((_, _, at, placed)) = best {
            self.take_from_free(at, placed, size);
            return Ok(placed);
        }
        let no_space = || PciError::NoSpace {
            window: self.name,
            size,
            start: self.next,
            end: self.end,
        };
        // Size-aligned: the BAR register can only hold aligned addresses anyway.
        let base = self
            .next
            .checked_next_multiple_of(align)
            .ok_or_else(no_space)?;
        let end = base.checked_add(size).ok_or_else(no_space)?;
        if end > self.end {
            return Err(no_space());
        }
        if base > self.next {
            self.insert_free(self.next, base - self.next);
        }
        self.next = end;
        Ok(base)
    }

    /// Takes exactly `[base, base + size)` (a restored device's BAR): inside a free range
    /// (given back, or skipped by an earlier placement: restored devices come back in any
    /// order), or past everything placed so far.
    pub fn reserve(&mut self, base: u64, size: u64) -> Result<(), PciError> {
        let taken = || PciError::RangeTaken {
            window: self.name,
            base,
            size,
        };
        let end = base
            .checked_add(size)
            .filter(|&end| end <= self.end && base.is_multiple_of(size.max(1)))
            .ok_or_else(taken)?;
        let inside = |&(free, free_size): &(u64, u64)| free <= base && end <= free + free_size;
        if let Some(at) = self.free.iter().position(inside) {
            self.take_from_free(at, base, size);
            return Ok(());
        }
        if base < self.next {
            return Err(taken());
        }
        if base > self.next {
            self.insert_free(self.next, base - self.next);
        }
        self.next = end;
        Ok(())
    }

    /// Gives `[base, base + size)` back (a removed device's BAR).
    pub fn release(&mut self, base: u64, size: u64) {
        if size == 0 {
            return;
        }
        self.insert_free(base, size);
        // A free range that reaches `next` is no longer below anything placed.
        if let Some(&(last, last_size)) = self.free.last() {
            if last + last_size == self.next {
                self.free.pop();
                self.next = last;
            }
        }
    }

    /// The allocator's bookkeeping, for a snapshot.
    pub fn state(&self) -> WindowState {
        WindowState {
            start: self.start,
            end: self.end,
            next: self.next,
            free: self.free.clone(),
        }
    }

    /// An allocator for `[start, end)` with the bookkeeping `saved` (a restore), which
    /// must be for that same window and consistent: free ranges sorted, apart, non-empty
    /// and below the high-water mark.
    pub fn from_state(
        name: &'static str,
        start: u64,
        end: u64,
        saved: &WindowState,
    ) -> Result<Self, PciError> {
        let bad = |what: String| PciError::SavedState(format!("its {name} window {what}"));
        if (saved.start, saved.end) != (start, end) {
            return Err(bad(format!(
                "is {:#x}..{:#x}; this VM's is {start:#x}..{end:#x}",
                saved.start, saved.end
            )));
        }
        if saved.next < start || saved.next > end {
            return Err(bad(format!(
                "is used up to {:#x}, outside the window",
                saved.next
            )));
        }
        let mut floor = start;
        for &(base, size) in &saved.free {
            let Some(free_end) = base.checked_add(size).filter(|_| size > 0) else {
                return Err(bad(format!("has a bad free range {base:#x}+{size:#x}")));
            };
            if base < floor || free_end > saved.next {
                return Err(bad(format!(
                    "has free range {base:#x}..{free_end:#x} out of order or past {:#x}",
                    saved.next
                )));
            }
            floor = free_end;
        }
        Ok(BarAllocator {
            start,
            next: saved.next,
            end,
            name,
            free: saved.free.clone(),
        })
    }

    /// Whether `[base, base + size)` lies in the window and is allocated (below the
    /// high-water mark and in no free range).
    fn holds(&self, base: u64, size: u64) -> bool {
        let Some(end) = base.checked_add(size) else {
            return false;
        };
        base >= self.start
            && end <= self.next
            && !self
                .free
                .iter()
                .any(|&(free, free_size)| free < end && base < free + free_size)
    }

    /// Removes `[placed, placed + size)` from free range `at`, keeping what is left of it.
    fn take_from_free(&mut self, at: usize, placed: u64, size: u64) {
        let (base, len) = self.free.remove(at);
        let end = placed + size;
        let pieces = [(base, placed - base), (end, base + len - end)];
        for (piece, piece_size) in pieces.into_iter().rev() {
            if piece_size > 0 {
                self.free.insert(at, (piece, piece_size));
            }
        }
    }

    /// Adds a free range, merged with its neighbours.
    fn insert_free(&mut self, base: u64, size: u64) {
        let at = self.free.partition_point(|&(b, _)| b < base);
        self.free.insert(at, (base, size));
        if at + 1 < self.free.len() && base + size == self.free[at + 1].0 {
            self.free[at].1 += self.free.remove(at + 1).1;
        }
        if at > 0 && self.free[at - 1].0 + self.free[at - 1].1 == base {
            let merged = self.free.remove(at).1;
            self.free[at - 1].1 += merged;
        }
    }
}

/// A BAR range given to a slot: (in the 64-bit window, base, size).
type PlacedBar = (bool, u64, u64);

/// A window allocator's bookkeeping ([`BarAllocator::state`]): the window, how far it is
/// used, and the free ranges below that (removed devices' BARs, alignment gaps).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowState {
    pub start: u64,
    pub end: u64,
    pub next: u64,
    pub free: Vec<(u64, u64)>,
}

/// One range the root gave a slot: a BAR (`bar`: its index) or, for a bridge on bus 0, one
/// of its windows (`bar` None).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedRange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bar: Option<u8>,
    /// In the 64-bit window (else the 32-bit one).
    pub wide: bool,
    pub base: u64,
    pub size: u64,
}

/// A bus-0 slot with a function, and the ranges the root gave it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotState {
    pub slot: u8,
    pub ranges: Vec<SavedRange>,
}

/// The root's allocations ([`Persist`] state): which bus-0 slots hold a function, the
/// ranges each was given, and both windows' allocators. A restore puts every function
/// back into its slot with exactly its ranges, and the next hot-plugged device goes where
/// it would have gone in the saved VM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciRootState {
    pub segment: u16,
    pub slots: Vec<SlotState>,
    pub mmio32: WindowState,
    pub mmio64: WindowState,
    /// The buses its ECAM window covered (those behind its bridges included): the
    /// restored root's window covers them from the start, before the bridges are rebuilt,
    /// as the guest's MCFG (in its RAM) says. 0 in states written before it was saved.
    #[serde(default, skip_serializing_if = "is_one_bus")]
    pub buses: u16,
    /// The value the guest last wrote to 0xCF8 (configuration mechanism #1, segment 0):
    /// a guest paused between selecting a register there and accessing it at 0xCFC gets
    /// that register when it goes on. Absent when 0, and in states written before it was
    /// saved.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub config_address: u32,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

fn is_one_bus(buses: &u16) -> bool {
    *buses <= 1
}

/// Bus 0 of one PCI segment group and its functions (function 0 of each device only).
/// Each segment has its own root: its own ECAM window and BAR windows.
pub struct PciRoot {
    segment: u16,
    config: PciRootConfig,
    devices: Mutex<BTreeMap<u8, SharedDevice>>,
    mmio32: Mutex<BarAllocator>,
    mmio64: Mutex<BarAllocator>,
    /// The BAR ranges each slot was given: (64-bit window, base, size).
    placed: Mutex<BTreeMap<u8, Vec<PlacedBar>>>,
    /// Each placed range's BAR index (None: a bridge's window), by slot, in `placed`'s
    /// order: what a snapshot saves.
    placed_bars: Mutex<BTreeMap<u8, Vec<Option<u8>>>>,
    /// Restored from a snapshot: the slots whose function has not been put back yet, and
    /// the ranges each must get ([`PciRoot::add_device_at`] checks and takes them).
    awaited: Mutex<Option<BTreeMap<u8, Vec<SavedRange>>>>,
    /// Functions behind bridges, keyed by their path from bus 0: the bus-0 slot of the
    /// root port, then the device number on each secondary bus down to the function.
    downstream: Mutex<BTreeMap<Vec<u8>, SharedDevice>>,
    /// The 0xCF8 address register ([`ConfigAddressPort`]): the root's, so that it is
    /// saved with the root.
    config_address: AtomicU32,
}

impl PciRoot {
    /// The root bus of segment 0 with a host bridge at 00:00.0.
    pub fn new(config: PciRootConfig) -> Result<Arc<Self>, PciError> {
        Self::new_segment(0, config)
    }

    /// The root bus of PCI segment `segment`, with a host bridge at 00:00.0.
    pub fn new_segment(segment: u16, config: PciRootConfig) -> Result<Arc<Self>, PciError> {
        config.validate()?;
        let root = PciRoot {
            segment,
            config,
            devices: Mutex::new(BTreeMap::new()),
            mmio32: Mutex::new(BarAllocator::new(
                "32-bit",
                config.mmio32_start,
                config.mmio32_end,
            )),
            mmio64: Mutex::new(BarAllocator::new(
                "64-bit",
                config.mmio64_start,
                config.mmio64_start + config.mmio64_size,
            )),
            placed: Mutex::new(BTreeMap::new()),
            placed_bars: Mutex::new(BTreeMap::new()),
            awaited: Mutex::new(None),
            downstream: Mutex::new(BTreeMap::new()),
            config_address: AtomicU32::new(0),
        };
        root.add_device(Arc::new(Mutex::new(HostBridge::new())))?;
        Ok(Arc::new(root))
    }

    /// Where the root puts things; `buses` covers the buses behind its bridges as they
    /// are numbered now.
    pub fn config(&self) -> PciRootConfig {
        PciRootConfig {
            buses: self.config.buses.max(u16::from(self.highest_bus()) + 1),
            ..self.config
        }
    }

    /// The PCI segment group this root is bus 0 of.
    pub fn segment(&self) -> u16 {
        self.segment
    }

    /// Plugs `device` into the next free slot, places its BARs (32-bit BARs in the
    /// 32-bit window; 64-bit BARs, prefetchable ones included, in the 64-bit window,
    /// aligned to their size) and turns on memory decoding, as firmware would.
    pub fn add_device(&self, device: SharedDevice) -> Result<PciBdf, PciError> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        // Slots a restore still has to fill are not free.
        let awaited = self.awaited.lock().unwrap_or_else(|e| e.into_inner());
        let slot = (0..32u8)
            .find(|slot| {
                !devices.contains_key(slot)
                    && !awaited.as_ref().is_some_and(|a| a.contains_key(slot))
            })
            .ok_or(PciError::BusFull(self.segment))?;
        drop(awaited);
        self.insert(&mut devices, slot, device, None)
    }

    /// Plugs a restored `device` back into `slot` with its BARs at the addresses it had
    /// (`bars`: BAR index and address; a BAR not listed is placed as by
    /// [`PciRoot::add_device`]). Its memory decoding is left as its own restored state
    /// says: a snapshot's guest had already set it.
    pub fn add_device_at(
        &self,
        slot: u8,
        device: SharedDevice,
        bars: &[(u8, u64)],
    ) -> Result<PciBdf, PciError> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        if slot == 0 || slot >= 32 || devices.contains_key(&slot) {
            return Err(PciError::SlotTaken(slot));
        }
        if self
            .awaited
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return self.insert_saved(&mut devices, slot, device, bars);
        }
        self.insert(&mut devices, slot, device, Some(bars))
    }

    /// [`PciRoot::add_device_at`] on a root restored from a snapshot's state: `device`
    /// must be the function the state has in `slot`, with BARs of the saved sizes and
    /// kinds; it gets exactly the saved ranges (the windows' bookkeeping has them
    /// already). Its BARs read `bars` (where the guest had moved them), else the saved
    /// ranges' addresses.
    fn insert_saved(
        &self,
        devices: &mut BTreeMap<u8, SharedDevice>,
        slot: u8,
        device: SharedDevice,
        bars: &[(u8, u64)],
    ) -> Result<PciBdf, PciError> {
        let bdf = PciBdf {
            segment: self.segment,
            bus: 0,
            device: slot,
            function: 0,
        };
        let not_there = |reason: String| PciError::NotWhereSaved {
            bdf: bdf.full(),
            reason,
        };
        let mut awaited = self.awaited.lock().unwrap_or_else(|e| e.into_inner());
        let Some(saved) = awaited.as_ref().and_then(|a| a.get(&slot)).cloned() else {
            return Err(not_there(
                "the snapshot's PCI state has no function in this slot to restore".into(),
            ));
        };
        {
            let mut guard = lock(&device);
            let specs = guard.bar_specs();
            let window = |wide: bool| if wide { "64-bit" } else { "32-bit" };
            for spec in &specs {
                let wide = matches!(spec.kind, BarKind::Memory64 { .. });
                let Some(range) = saved.iter().find(|r| r.bar == Some(spec.index)) else {
                    return Err(not_there(format!(
                        "the restored function has a {:#x}-byte BAR{} the snapshot's PCI state \
                         gave no range",
                        spec.size, spec.index
                    )));
                };
                if (range.size, range.wide) != (spec.size, wide) {
                    return Err(not_there(format!(
                        "the restored function's BAR{} is {:#x} bytes in the {} window; the \
                         snapshot's PCI state gave it {:#x} bytes at {:#x} in the {} window",
                        spec.index,
                        spec.size,
                        window(wide),
                        range.size,
                        range.base,
                        window(range.wide)
                    )));
                }
            }
            if let Some(extra) = saved
                .iter()
                .find(|r| !specs.iter().any(|spec| r.bar == Some(spec.index)))
            {
                return Err(not_there(format!(
                    "the snapshot's PCI state gave BAR{} {:#x} bytes at {:#x}; the restored \
                     function has no such BAR",
                    extra.bar.unwrap_or_default(),
                    extra.size,
                    extra.base
                )));
            }
            for range in &saved {
                let Some(index) = range.bar else { continue };
                let address = bars
                    .iter()
                    .find(|(bar, _)| *bar == index)
                    .map_or(range.base, |&(_, address)| address);
                log::info!(
                    "PCI {}: BAR{index} {:#x} bytes back at {address:#x} (range {:#x} as saved)",
                    bdf.full(),
                    range.size,
                    range.base
                );
                guard.set_bar_address(index, address);
            }
        }
        if let Some(awaited) = awaited.as_mut() {
            awaited.remove(&slot);
        }
        drop(awaited);
        devices.insert(slot, device);
        self.record(
            slot,
            saved
                .iter()
                .map(|r| (r.bar, (r.wide, r.base, r.size)))
                .collect(),
        );
        Ok(bdf)
    }

    /// Records the ranges `slot` was given, with their BAR indices.
    fn record(&self, slot: u8, ranges: Vec<(Option<u8>, PlacedBar)>) {
        let (bars, ranges): (Vec<_>, Vec<_>) = ranges.into_iter().unzip();
        self.placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(slot, ranges);
        self.placed_bars
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(slot, bars);
    }

    /// Ends a restore from a snapshot's state: every slot the state has must have its
    /// function back. From now on devices are placed as on a booted VM.
    pub fn finish_restore(&self) -> Result<(), PciError> {
        let Some(left) = self
            .awaited
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(());
        };
        if left.is_empty() {
            return Ok(());
        }
        let slots: Vec<String> = left
            .keys()
            .map(|slot| format!("{:04x}:00:{slot:02x}.0", self.segment))
            .collect();
        Err(PciError::SavedState(format!(
            "no function was restored into {} (the state has one there)",
            slots.join(", ")
        )))
    }

    /// Places `device`'s BARs (largest first, which keeps the windows dense; at the
    /// `restored` addresses where given) and puts it into `slot`. A BAR that does not fit
    /// gives back the ranges taken so far.
    fn insert(
        &self,
        devices: &mut BTreeMap<u8, SharedDevice>,
        slot: u8,
        device: SharedDevice,
        restored: Option<&[(u8, u64)]>,
    ) -> Result<PciBdf, PciError> {
        let mut placed = Vec::new();
        {
            let mut guard = lock(&device);
            let mut specs = guard.bar_specs();
            specs.sort_by_key(|spec| std::cmp::Reverse(spec.size));
            for spec in specs {
                let wide = matches!(spec.kind, BarKind::Memory64 { .. });
                let allocator = if wide { &self.mmio64 } else { &self.mmio32 };
                let saved = restored
                    .and_then(|bars| bars.iter().find(|(index, _)| *index == spec.index))
                    .map(|&(_, address)| address);
                let address = {
                    let mut allocator = allocator.lock().unwrap_or_else(|e| e.into_inner());
                    match saved {
                        Some(address) => allocator.reserve(address, spec.size).map(|()| address),
                        None => allocator.allocate(spec.size),
                    }
                };
                let address = match address {
                    Ok(address) => address,
                    Err(error) => {
                        self.give_back(placed.into_iter().map(|(_, range)| range).collect());
                        return Err(error);
                    }
                };
                placed.push((Some(spec.index), (wide, address, spec.size)));
                log::info!(
                    "PCI {:04x}:00:{slot:02x}.0: BAR{} {:?} {:#x} bytes at {address:#x}",
                    self.segment,
                    spec.index,
                    spec.kind,
                    spec.size
                );
                guard.set_bar_address(spec.index, address);
            }
            if restored.is_none() {
                guard.enable_memory_decoding();
            }
        }
        devices.insert(slot, device);
        self.record(slot, placed);
        Ok(PciBdf {
            segment: self.segment,
            bus: 0,
            device: slot,
            function: 0,
        })
    }

    /// Returns BAR ranges to their windows' free lists.
    fn give_back(&self, placed: Vec<PlacedBar>) {
        for (wide, base, size) in placed {
            let allocator = if wide { &self.mmio64 } else { &self.mmio32 };
            allocator
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .release(base, size);
        }
    }

    /// Takes the device in `bdf`'s slot off the bus (hot-unplug): from now on its
    /// configuration space reads all ones and its BARs decode nothing; the BAR ranges it
    /// was given go back to the windows for the next device with BARs of the same sizes.
    /// The host bridge stays. Returns the device, if there was one.
    pub fn remove_device(&self, bdf: PciBdf) -> Option<SharedDevice> {
        if bdf.segment != self.segment || bdf.bus != 0 || bdf.function != 0 || bdf.device == 0 {
            return None;
        }
        let device = self
            .devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&bdf.device)?;
        let placed = self
            .placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&bdf.device)
            .unwrap_or_default();
        self.placed_bars
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&bdf.device);
        self.give_back(placed);
        log::info!("PCI {}: removed", bdf.full());
        Some(device)
    }

    /// Whether a device is in `slot` of bus 0.
    pub fn has_device(&self, slot: u8) -> bool {
        self.devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&slot)
    }

    fn device(&self, bdf: PciBdf) -> Option<SharedDevice> {
        if bdf.segment != self.segment || bdf.function != 0 {
            return None;
        }
        if bdf.bus == 0 {
            let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
            return devices.get(&bdf.device).cloned();
        }
        let mut path = self.path_of_bus(bdf.bus)?;
        path.push(bdf.device);
        let downstream = self.downstream.lock().unwrap_or_else(|e| e.into_inner());
        downstream.get(&path).cloned()
    }

    /// The functions directly on the secondary bus of the bridge at `path` (bus 0's for
    /// an empty path), with their device numbers.
    fn children(&self, path: &[u8]) -> Vec<(u8, SharedDevice)> {
        if path.is_empty() {
            let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
            return devices.iter().map(|(n, d)| (*n, d.clone())).collect();
        }
        let downstream = self.downstream.lock().unwrap_or_else(|e| e.into_inner());
        downstream
            .range(path.to_vec()..)
            .take_while(|(key, _)| key.starts_with(path))
            .filter(|(key, _)| key.len() == path.len() + 1)
            .map(|(key, device)| (key[path.len()], device.clone()))
            .collect()
    }

    /// The path of the bridge whose secondary bus is `bus`, following the bus numbers the
    /// bridges have now (the guest may renumber them), from bus 0 down.
    fn path_of_bus(&self, bus: u8) -> Option<Vec<u8>> {
        let mut path = Vec::new();
        loop {
            let (number, secondary) = self.children(&path).into_iter().find_map(|(n, d)| {
                let (secondary, subordinate) = lock(&d).as_bridge()?.buses();
                // Secondary bus 0 is an unconfigured bridge: it forwards nothing.
                (secondary != 0 && secondary <= bus && bus <= subordinate).then_some((n, secondary))
            })?;
            path.push(number);
            if secondary == bus {
                return Some(path);
            }
        }
    }

    /// The address of the function at `path` (see [`PciRoot::add_behind`]) under the
    /// bridges' current bus numbers; None if a bridge on the way is missing or closed.
    pub fn bdf_of_path(&self, path: &[u8]) -> Option<PciBdf> {
        let (&device, parents) = path.split_last()?;
        let mut bus = 0;
        for depth in 1..=parents.len() {
            let bridge = self.device_at(&parents[..depth])?;
            bus = lock(&bridge).as_bridge()?.buses().0;
        }
        Some(PciBdf {
            segment: self.segment,
            bus,
            device,
            function: 0,
        })
    }

    /// The function at `path`, on bus 0 or behind bridges.
    pub fn device_at(&self, path: &[u8]) -> Option<SharedDevice> {
        match path {
            [] => None,
            [slot] => self
                .devices
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(slot)
                .cloned(),
            _ => self
                .downstream
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(path)
                .cloned(),
        }
    }

    /// Takes `[_, size)` aligned to `align` from the 64-bit (`wide`) or 32-bit window for
    /// a bridge's window; [`PciRoot::add_port`] records it with the port.
    pub fn allocate_window(&self, wide: bool, size: u64, align: u64) -> Result<u64, PciError> {
        let allocator = if wide { &self.mmio64 } else { &self.mmio32 };
        let mut allocator = allocator.lock().unwrap_or_else(|e| e.into_inner());
        allocator.allocate_aligned(size, align)
    }

    /// Gives back a range [`PciRoot::allocate_window`] took (a port that was not plugged).
    pub fn release_window(&self, wide: bool, base: u64, size: u64) {
        self.give_back(vec![(wide, base, size)]);
    }

    /// Takes exactly `[base, base + size)` for a restored bridge's window.
    pub fn reserve_window(&self, wide: bool, base: u64, size: u64) -> Result<(), PciError> {
        let allocator = if wide { &self.mmio64 } else { &self.mmio32 };
        let mut allocator = allocator.lock().unwrap_or_else(|e| e.into_inner());
        let taken = || PciError::RangeTaken {
            window: if wide { "64-bit" } else { "32-bit" },
            base,
            size,
        };
        // Windows are 1 MiB granular, not size aligned: reserve them in aligned pieces.
        let mut at = base;
        let end = base.checked_add(size).ok_or_else(taken)?;
        let mut done = Vec::new();
        while at < end {
            let piece =
                (1u64 << at.trailing_zeros().min(63)).min(1 << (63 - (end - at).leading_zeros()));
            if let Err(error) = allocator.reserve(at, piece) {
                for (base, size) in done {
                    allocator.release(base, size);
                }
                return Err(error);
            }
            done.push((at, piece));
            at += piece;
        }
        Ok(())
    }

    /// Plugs a root port (or another function on bus 0 that owns address windows) into
    /// `slot` with the ranges `windows` ((64-bit, base, size), taken with
    /// [`PciRoot::allocate_window`] or [`PciRoot::reserve_window`]), which go back to the
    /// windows when it is removed.
    pub fn add_port(
        &self,
        slot: u8,
        device: SharedDevice,
        windows: Vec<(bool, u64, u64)>,
    ) -> Result<PciBdf, PciError> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let awaited = self.awaited.lock().unwrap_or_else(|e| e.into_inner());
        if slot == 0
            || slot >= 32
            || devices.contains_key(&slot)
            || awaited.as_ref().is_some_and(|a| a.contains_key(&slot))
        {
            return Err(PciError::SlotTaken(slot));
        }
        drop(awaited);
        devices.insert(slot, device);
        self.record(slot, windows.into_iter().map(|w| (None, w)).collect());
        Ok(PciBdf {
            segment: self.segment,
            bus: 0,
            device: slot,
            function: 0,
        })
    }

    /// Plugs `device` behind bridges: `path` is the bus-0 slot of its root port, then its
    /// device number on each secondary bus down to its own. Its BARs go at `bars` (index,
    /// address), which lie inside its bridges' windows: nothing is taken from the root's
    /// windows (the root port's windows hold them). `enable` turns on memory decoding
    /// (firmware does; a restored device keeps its own state).
    pub fn add_behind(
        &self,
        path: &[u8],
        device: SharedDevice,
        bars: &[(u8, u64)],
        enable: bool,
    ) -> Result<PciBdf, PciError> {
        let (&number, parents) = path
            .split_last()
            .filter(|(n, p)| !p.is_empty() && **n < 32)
            .ok_or(PciError::Layout("a device behind a bridge needs a bridge"))?;
        let parent = self
            .device_at(parents)
            .filter(|parent| lock(parent).as_bridge().is_some())
            .ok_or(PciError::Layout("no bridge at that path"))?;
        drop(parent);
        let mut downstream = self.downstream.lock().unwrap_or_else(|e| e.into_inner());
        if downstream.contains_key(path) {
            return Err(PciError::SlotTaken(number));
        }
        {
            let mut guard = lock(&device);
            for spec in guard.bar_specs() {
                let Some(&(_, address)) = bars.iter().find(|(index, _)| *index == spec.index)
                else {
                    return Err(PciError::Layout("a BAR behind a bridge has no address"));
                };
                guard.set_bar_address(spec.index, address);
            }
            if enable {
                guard.enable_memory_decoding();
            }
        }
        downstream.insert(path.to_vec(), device);
        drop(downstream);
        self.bdf_of_path(path)
            .ok_or(PciError::Layout("no bus behind that bridge"))
    }

    /// Takes the function at `path` (behind a bridge, see [`PciRoot::add_behind`]) off
    /// its bus (hot-unplug from a PCIe slot): from now on it reads all ones. Its BARs were
    /// inside its bridges' windows, so nothing goes back to the root's windows. Returns
    /// the function, if there was one.
    pub fn remove_behind(&self, path: &[u8]) -> Option<SharedDevice> {
        if path.len() < 2 {
            return None;
        }
        let device = self
            .downstream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(path)?;
        log::info!("PCI {path:?} (path from bus 0): removed");
        Some(device)
    }

    /// The highest bus number any bridge forwards to (0 without bridges).
    pub fn highest_bus(&self) -> u8 {
        let mut all: Vec<SharedDevice> = self.children(&[]).into_iter().map(|(_, d)| d).collect();
        all.extend(
            self.downstream
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned(),
        );
        all.iter()
            .filter_map(|d| lock(d).as_bridge().map(|b| b.buses().1))
            .max()
            .unwrap_or(0)
    }

    /// Configuration read; absent functions read all ones.
    pub fn config_read(&self, bdf: PciBdf, offset: u16, data: &mut [u8]) {
        data.fill(0xff);
        if !valid_config_access(offset, data.len()) {
            return;
        }
        if let Some(device) = self.device(bdf) {
            lock(&device).config_read(offset, data);
        }
    }

    /// Configuration write; writes to absent functions are dropped.
    pub fn config_write(&self, bdf: PciBdf, offset: u16, data: &[u8]) {
        if !valid_config_access(offset, data.len()) {
            log::debug!("PCI {bdf}: dropping unaligned config write at {offset:#x}");
            return;
        }
        if let Some(device) = self.device(bdf) {
            lock(&device).config_write(offset, data);
        }
    }

    /// The device and BAR that decode `[address, address + len)`, with the offset in the BAR.
    fn find_bar(&self, address: u64, len: usize) -> Option<(SharedDevice, u8, u64)> {
        let mut devices: Vec<SharedDevice> = self
            .devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        devices.extend(
            self.downstream
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned(),
        );
        for device in devices {
            let bars = lock(&device).active_bars();
            for bar in bars {
                if address >= bar.address && address - bar.address + len as u64 <= bar.size {
                    return Some((device, bar.index, address - bar.address));
                }
            }
        }
        None
    }

    /// A guest read at guest-physical `address`; false if no BAR decodes it.
    pub fn mmio_read(&self, address: u64, data: &mut [u8]) -> bool {
        match self.find_bar(address, data.len()) {
            Some((device, bar, offset)) => {
                lock(&device).bar_read(bar, offset, data);
                true
            }
            None => false,
        }
    }

    /// A guest write at guest-physical `address`; false if no BAR decodes it.
    pub fn mmio_write(&self, address: u64, data: &[u8]) -> bool {
        match self.find_bar(address, data.len()) {
            Some((device, bar, offset)) => {
                lock(&device).bar_write(bar, offset, data);
                true
            }
            None => false,
        }
    }
}

/// Config accesses the root passes on: 1, 2 or 4 bytes, naturally aligned, in the 4 KiB space.
impl crate::Persist for PciRoot {
    type State = PciRootState;
    type Error = PciError;

    fn save(&self) -> Result<PciRootState, PciError> {
        let placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        let bars = self.placed_bars.lock().unwrap_or_else(|e| e.into_inner());
        let slots = placed
            .iter()
            .map(|(&slot, ranges)| SlotState {
                slot,
                ranges: ranges
                    .iter()
                    .enumerate()
                    .map(|(at, &(wide, base, size))| SavedRange {
                        bar: bars.get(&slot).and_then(|b| b.get(at).copied().flatten()),
                        wide,
                        base,
                        size,
                    })
                    .collect(),
            })
            .collect();
        Ok(PciRootState {
            segment: self.segment,
            slots,
            mmio32: self
                .mmio32
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state(),
            mmio64: self
                .mmio64
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state(),
            buses: self.config().buses,
            config_address: self.config_address.load(Ordering::Acquire),
        })
    }

    /// Loads the allocations into a root that holds only its host bridge; the functions
    /// come back with [`PciRoot::add_device_at`], then [`PciRoot::finish_restore`] checks
    /// that all did.
    fn restore(&mut self, state: &PciRootState) -> Result<(), PciError> {
        let bad = |what: String| PciError::SavedState(what);
        if state.segment != self.segment {
            return Err(bad(format!(
                "it is segment {}'s; this is segment {}",
                state.segment, self.segment
            )));
        }
        *self.config_address.get_mut() = state.config_address;
        let devices = self.devices.get_mut().unwrap_or_else(|e| e.into_inner());
        if devices.keys().any(|&slot| slot != 0)
            || !self.downstream.get_mut().is_ok_and(|d| d.is_empty())
        {
            return Err(bad("the bus has functions already".into()));
        }
        let config = PciRootConfig {
            buses: self.config.buses.max(state.buses),
            ..self.config
        };
        if state.buses > 256 || config.validate().is_err() {
            return Err(bad(format!(
                "its ECAM window of {} buses does not fit this root's layout",
                state.buses
            )));
        }
        let mmio32 = BarAllocator::from_state(
            "32-bit",
            config.mmio32_start,
            config.mmio32_end,
            &state.mmio32,
        )?;
        let mmio64 = BarAllocator::from_state(
            "64-bit",
            config.mmio64_start,
            config.mmio64_start.saturating_add(config.mmio64_size),
            &state.mmio64,
        )?;
        let mut awaited = BTreeMap::new();
        let mut taken: Vec<(u64, u64)> = Vec::new();
        for saved in &state.slots {
            if saved.slot >= 32 || awaited.contains_key(&saved.slot) {
                return Err(bad(format!(
                    "slot {:#04x} is out of range or twice",
                    saved.slot
                )));
            }
            if saved.slot == 0 {
                // The host bridge, there already; it has no BARs.
                if !saved.ranges.is_empty() {
                    return Err(bad("slot 0 (the host bridge) has ranges".into()));
                }
                continue;
            }
            for range in &saved.ranges {
                let place = format!(
                    "slot {:#04x}'s range {:#x}+{:#x}",
                    saved.slot, range.base, range.size
                );
                if range.bar.is_none() {
                    return Err(bad(format!(
                        "{place} is a bridge's window; bridges on bus 0 are not restored"
                    )));
                }
                let window = if range.wide { &mmio64 } else { &mmio32 };
                if range.size == 0 || !window.holds(range.base, range.size) {
                    return Err(bad(format!("{place} is not allocated in its window")));
                }
                let end = range.base + range.size;
                if taken.iter().any(|&(b, e)| b < end && range.base < e) {
                    return Err(bad(format!("{place} overlaps another slot's")));
                }
                taken.push((range.base, end));
            }
            awaited.insert(saved.slot, saved.ranges.clone());
        }
        *self.mmio32.get_mut().unwrap_or_else(|e| e.into_inner()) = mmio32;
        *self.mmio64.get_mut().unwrap_or_else(|e| e.into_inner()) = mmio64;
        *self.awaited.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(awaited);
        self.config = config;
        Ok(())
    }
}

fn valid_config_access(offset: u16, len: usize) -> bool {
    matches!(len, 1 | 2 | 4)
        && usize::from(offset) % len == 0
        && usize::from(offset) + len <= usize::from(config::SPACE_SIZE)
}

/// Configuration mechanism #1: 0xCF8 (address, 32-bit) and 0xCFC..0xCFF (data).
/// Insert it on the port-I/O bus at 0xCF8 with length 8, for segment 0's root: the ports
/// reach segment 0 only (other segments are reachable through their ECAM windows).
/// The address register is the root's (saved with it).
pub struct ConfigAddressPort {
    root: Arc<PciRoot>,
}

impl PciRoot {
    /// Loads the 0xCF8 register as a paused guest left it (a live update builds the root
    /// before the guest is paused, from a state saved while it ran).
    pub fn load_config_address(&self, state: &PciRootState) {
        (self.config_address).store(state.config_address, Ordering::Release);
    }
}

impl ConfigAddressPort {
    pub fn new(root: Arc<PciRoot>) -> Self {
        ConfigAddressPort { root }
    }

    fn address(&self) -> u32 {
        self.root.config_address.load(Ordering::Acquire)
    }

    /// The function and register selected by the address register, if enabled.
    fn target(&self, data_offset: u64) -> Option<(PciBdf, u16)> {
        let address = self.address();
        if address & (1 << 31) == 0 {
            return None;
        }
        let bdf = PciBdf {
            segment: self.root.segment,
            bus: (address >> 16) as u8,
            device: ((address >> 11) & 0x1f) as u8,
            function: ((address >> 8) & 7) as u8,
        };
        Some((bdf, (address & 0xfc) as u16 + data_offset as u16))
    }
}

impl BusDevice for ConfigAddressPort {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.address().to_le_bytes()),
            4..=7 => match self.target(offset - 4) {
                Some((bdf, register)) => self.root.config_read(bdf, register, data),
                None => data.fill(0xff),
            },
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            // Only 32-bit writes select a register; byte writes to 0xCF9 (reset control
            // on some chipsets) and friends are ignored.
            0 if data.len() == 4 => {
                let address = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) & !3;
                self.root.config_address.store(address, Ordering::Release);
            }
            4..=7 => {
                if let Some((bdf, register)) = self.target(offset - 4) {
                    self.root.config_write(bdf, register, data);
                }
            }
            _ => {}
        }
    }
}

/// The ECAM window of one segment's root (bus 0, 1 MiB): offset = device << 15 |
/// function << 12 | register.
pub struct EcamWindow {
    root: Arc<PciRoot>,
}

impl EcamWindow {
    pub fn new(root: Arc<PciRoot>) -> Self {
        EcamWindow { root }
    }

    fn target(&self, offset: u64) -> (PciBdf, u16) {
        let bdf = PciBdf {
            segment: self.root.segment,
            bus: (offset >> 20) as u8,
            device: ((offset >> 15) & 0x1f) as u8,
            function: ((offset >> 12) & 7) as u8,
        };
        (bdf, (offset & 0xfff) as u16)
    }
}

impl BusDevice for EcamWindow {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let (bdf, register) = self.target(offset);
        self.root.config_read(bdf, register, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (bdf, register) = self.target(offset);
        self.root.config_write(bdf, register, data);
    }
}

/// An MMIO window (the 32-bit hole or the 64-bit window) whose accesses go to whichever
/// BAR the guest placed there. Insert it on the MMIO bus at `base`.
pub struct MmioWindows {
    root: Arc<PciRoot>,
    base: u64,
}

impl MmioWindows {
    pub fn new(root: Arc<PciRoot>, base: u64) -> Self {
        MmioWindows { root, base }
    }
}

impl BusDevice for MmioWindows {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if !self.root.mmio_read(self.base + offset, data) {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if !self.root.mmio_write(self.base + offset, data) {
            log::trace!("PCI: write to {:#x} hits no BAR", self.base + offset);
        }
    }
}

/// The host bridge at 00:00.0: identification only.
pub struct HostBridge {
    space: [u8; 64],
}

impl HostBridge {
    pub fn new() -> Self {
        let mut space = [0u8; 64];
        // Red Hat's ID for a generic PCIe host bridge; class 06/00 (host bridge).
        space[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        space[2..4].copy_from_slice(&0x0008u16.to_le_bytes());
        space[0x0b] = 0x06;
        HostBridge { space }
    }
}

impl Default for HostBridge {
    fn default() -> Self {
        Self::new()
    }
}

impl PciDevice for HostBridge {
    fn config_read(&mut self, offset: u16, data: &mut [u8]) {
        data.fill(0);
        super::read_le(&self.space, usize::from(offset), data);
        if usize::from(offset) >= self.space.len() {
            data.fill(0);
        }
    }
    fn config_write(&mut self, _offset: u16, _data: &[u8]) {}
    fn active_bars(&self) -> Vec<super::PciBar> {
        Vec::new()
    }
    fn bar_specs(&self) -> Vec<super::BarSpec> {
        Vec::new()
    }
    fn set_bar_address(&mut self, _bar: u8, _address: u64) {}
    fn enable_memory_decoding(&mut self) {}
    fn bar_read(&mut self, _bar: u8, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    fn bar_write(&mut self, _bar: u8, _offset: u64, _data: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::super::{BarSet, BarSpec, BridgeSetup, PciBar, PciBridge, PortKind, Window};
    use super::*;

    /// A function with one 32-bit BAR of plain memory and one 64-bit prefetchable BAR.
    struct Scratch {
        bars: BarSet,
        memory: Vec<u8>,
    }

    impl PciDevice for Scratch {
        fn config_read(&mut self, offset: u16, data: &mut [u8]) {
            if BarSet::handles(offset) {
                return self.bars.read(offset, data);
            }
            let ids = [0xde, 0x10, 0x30, 0x23];
            data.fill(0);
            super::super::read_le(&ids, usize::from(offset), data);
            if offset >= 4 {
                data.fill(0);
            }
        }
        fn config_write(&mut self, offset: u16, data: &[u8]) {
            if BarSet::handles(offset) {
                self.bars.write(offset, data);
            } else if offset == config::COMMAND {
                self.bars.set_memory_enabled(data[0] & 2 != 0);
            }
        }
        fn active_bars(&self) -> Vec<PciBar> {
            self.bars.active()
        }
        fn bar_specs(&self) -> Vec<BarSpec> {
            self.bars.specs()
        }
        fn set_bar_address(&mut self, bar: u8, address: u64) {
            self.bars.set_address(bar, address);
        }
        fn enable_memory_decoding(&mut self) {
            self.bars.set_memory_enabled(true);
        }
        fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
            assert_eq!(bar, 0);
            super::super::read_le(&self.memory, offset as usize, data);
        }
        fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
            assert_eq!(bar, 0);
            super::super::write_le(&mut self.memory, offset as usize, data);
        }
    }

    fn root_config() -> PciRootConfig {
        PciRootConfig {
            ecam_base: 0xe000_0000,
            buses: 1,
            mmio32_start: 0xc000_0000,
            mmio32_end: 0xe000_0000,
            mmio64_start: 0x100_0000_0000,
            mmio64_size: 0x100_0000_0000,
        }
    }

    fn scratch() -> Arc<Mutex<Scratch>> {
        Arc::new(Mutex::new(Scratch {
            bars: BarSet::new(&[
                BarSpec {
                    index: 0,
                    size: 4096,
                    kind: BarKind::Memory32 {
                        prefetchable: false,
                    },
                },
                BarSpec {
                    index: 2,
                    size: 128 << 30,
                    kind: BarKind::Memory64 { prefetchable: true },
                },
            ]),
            memory: vec![0; 4096],
        }))
    }

    fn cf8(port: &mut ConfigAddressPort, device: u8, register: u8) {
        let address = 1u32 << 31 | u32::from(device) << 11 | u32::from(register);
        port.write(0, &address.to_le_bytes());
    }

    fn cfc_read32(port: &mut ConfigAddressPort) -> u32 {
        let mut data = [0; 4];
        port.read(4, &mut data);
        u32::from_le_bytes(data)
    }

    #[test]
    fn a_removed_slot_reads_all_ones_and_its_bars_are_reused() {
        let root = PciRoot::new(root_config()).unwrap();
        let bdf = root.add_device(scratch()).unwrap();
        let mut ecam = EcamWindow::new(root.clone());
        let mut bar0 = [0; 4];
        ecam.read(1 << 15 | 0x10, &mut bar0);
        assert!(root.remove_device(bdf).is_some());
        assert!(root.remove_device(bdf).is_none(), "removed once");
        assert!(
            root.remove_device(PciBdf {
                segment: 0,
                bus: 0,
                device: 0,
                function: 0
            })
            .is_none(),
            "the host bridge stays"
        );
        let mut data = [0; 4];
        for offset in [0x00, 0x04, 0x10, 0x18] {
            ecam.read(1 << 15 | offset, &mut data);
            assert_eq!(
                data, [0xff; 4],
                "config offset {offset:#x} of a removed slot"
            );
        }
        let address = u64::from(u32::from_le_bytes(bar0) & !0xf);
        assert!(
            !root.mmio_read(address, &mut data),
            "its BAR decodes nothing"
        );
        let again = root.add_device(scratch()).unwrap();
        assert_eq!(again, bdf, "the free slot is reused");
        ecam.read(1 << 15 | 0x10, &mut data);
        assert_eq!(data, bar0, "and so is the BAR range");
    }

    /// A device with one 32-bit and one 64-bit BAR of `size64` bytes.
    fn scratch_sized(size64: u64) -> Arc<Mutex<Scratch>> {
        let device = scratch();
        device.lock().unwrap().bars = BarSet::new(&[
            BarSpec {
                index: 0,
                size: 4096,
                kind: BarKind::Memory32 {
                    prefetchable: false,
                },
            },
            BarSpec {
                index: 2,
                size: size64,
                kind: BarKind::Memory64 { prefetchable: true },
            },
        ]);
        device
    }

    fn bar_addresses(device: &Arc<Mutex<Scratch>>) -> Vec<(u8, u64)> {
        let mut placed: Vec<(u8, u64)> = device
            .lock()
            .unwrap()
            .bars
            .placed()
            .iter()
            .map(|bar| (bar.index, bar.address))
            .collect();
        placed.sort();
        placed
    }

    /// A plugged device, its address, and its 64-bit BAR's size.
    type PlacedScratch = (PciBdf, Arc<Mutex<Scratch>>, u64);

    /// The saved VM: three devices of different BAR sizes, the middle one unplugged
    /// (holes in both windows), so that placing the survivors afresh would differ.
    fn root_with_holes() -> (Arc<PciRoot>, Vec<PlacedScratch>) {
        let root = PciRoot::new(root_config()).unwrap();
        let mut devices = Vec::new();
        for size in [4u64 << 30, 1 << 30, 1 << 30] {
            let device = scratch_sized(size);
            let bdf = root.add_device(device.clone()).unwrap();
            devices.push((bdf, device, size));
        }
        let (middle, _, _) = devices.remove(1);
        assert!(root.remove_device(middle).is_some());
        (root, devices)
    }

    #[test]
    fn saved_allocations_come_back_exactly_holes_included() {
        let (root, devices) = root_with_holes();
        let state = crate::Persist::save(&*root).unwrap();
        let mut restored = PciRoot::new(root_config()).unwrap();
        crate::Persist::restore(Arc::get_mut(&mut restored).unwrap(), &state).unwrap();
        // Back in reverse order, each into its slot with its ranges.
        for (bdf, original, size) in devices.iter().rev() {
            let device = scratch_sized(*size);
            let at = restored
                .add_device_at(bdf.device, device.clone(), &[])
                .unwrap();
            assert_eq!(at, *bdf);
            assert_eq!(bar_addresses(&device), bar_addresses(original));
        }
        restored.finish_restore().unwrap();
        assert_eq!(crate::Persist::save(&*restored).unwrap(), state);
        // The next device goes where it would have gone in the saved VM: the hole.
        let (live, fresh) = (scratch_sized(1 << 30), scratch_sized(1 << 30));
        assert_eq!(
            root.add_device(live.clone()).unwrap(),
            restored.add_device(fresh.clone()).unwrap()
        );
        assert_eq!(bar_addresses(&live), bar_addresses(&fresh));
        assert_eq!(
            bar_addresses(&fresh),
            [(0, 0xc000_1000), (2, 0x101_0000_0000)],
            "into the unplugged device's ranges"
        );
    }

    #[test]
    fn a_restored_device_that_does_not_fit_its_saved_place_is_refused() {
        let (root, devices) = root_with_holes();
        let state = crate::Persist::save(&*root).unwrap();
        let mut restored = PciRoot::new(root_config()).unwrap();
        crate::Persist::restore(Arc::get_mut(&mut restored).unwrap(), &state).unwrap();
        let (first, _, _) = &devices[0];
        // Another BAR size than the state's.
        let error = restored
            .add_device_at(first.device, scratch_sized(2 << 30), &[])
            .unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("BAR2 is 0x80000000 bytes") && message.contains("gave it 0x100000000"),
            "{message}"
        );
        // A slot the state has no function in.
        let error = restored.add_device_at(9, scratch(), &[]).unwrap_err();
        assert!(
            error.to_string().contains("no function in this slot"),
            "{error}"
        );
        // A free slot is not one the restore still has to fill.
        let next = restored.add_device(scratch_sized(1 << 30)).unwrap();
        assert_eq!(next.device, 2, "the unplugged device's slot");
        assert!(devices.iter().all(|(bdf, _, _)| bdf.device != next.device));
        restored.remove_device(next);
        // A function never put back fails the restore, naming its slot.
        restored
            .add_device_at(first.device, scratch_sized(4 << 30), &[])
            .unwrap();
        let error = restored.finish_restore().unwrap_err().to_string();
        assert!(
            error.contains(&format!("0000:00:{:02x}.0", devices[1].0.device)),
            "{error}"
        );
    }

    /// A root whose bridges numbered buses behind it saves how many its ECAM window
    /// covered; the restored root covers them before any bridge is back (its window is
    /// placed on the MMIO bus then), and a count its layout cannot hold is refused.
    #[test]
    fn the_ecam_window_covers_the_saved_buses_from_the_start() {
        let root = PciRoot::new(PciRootConfig {
            buses: 5,
            ..root_config()
        })
        .unwrap();
        let saved = crate::Persist::save(&*root).unwrap();
        assert_eq!(saved.buses, 5);
        let mut restored = PciRoot::new(root_config()).unwrap();
        assert_eq!(restored.config().buses, 1);
        crate::Persist::restore(Arc::get_mut(&mut restored).unwrap(), &saved).unwrap();
        assert_eq!(restored.config().buses, 5);
        assert_eq!(restored.config().ecam_size(), 5 * PciRootConfig::ECAM_SIZE);
        let mut too_many = saved.clone();
        too_many.buses = 4096;
        let mut refused = PciRoot::new(root_config()).unwrap();
        let error = crate::Persist::restore(Arc::get_mut(&mut refused).unwrap(), &too_many)
            .unwrap_err()
            .to_string();
        assert!(error.contains("ECAM window of 4096 buses"), "{error}");
    }

    /// A guest paused (snapshot, live update) between selecting a register at 0xCF8 and
    /// accessing it at 0xCFC reaches that register in the restored root: the address
    /// register is saved with the root.
    #[test]
    fn the_selected_config_register_survives_a_restore() {
        let root = PciRoot::new(root_config()).unwrap();
        let mut port = ConfigAddressPort::new(root.clone());
        cf8(&mut port, 0, 0);
        let host_bridge_ids = cfc_read32(&mut port);
        assert_ne!(host_bridge_ids, 0xffff_ffff);
        let saved = crate::Persist::save(&*root).unwrap();
        assert_eq!(saved.config_address, 1 << 31);
        let mut restored = PciRoot::new(root_config()).unwrap();
        crate::Persist::restore(Arc::get_mut(&mut restored).unwrap(), &saved).unwrap();
        let mut port = ConfigAddressPort::new(restored);
        assert_eq!(cfc_read32(&mut port), host_bridge_ids);
        let mut latch = [0; 4];
        port.read(0, &mut latch);
        assert_eq!(u32::from_le_bytes(latch), 1 << 31);
    }

    #[test]
    fn a_saved_state_that_does_not_fit_the_bus_is_refused() {
        let (root, _) = root_with_holes();
        let good = crate::Persist::save(&*root).unwrap();
        let refused = |state: &PciRootState| {
            let mut restored = PciRoot::new(root_config()).unwrap();
            crate::Persist::restore(Arc::get_mut(&mut restored).unwrap(), state)
                .unwrap_err()
                .to_string()
        };
        let mut other_window = good.clone();
        other_window.mmio64.start += 1 << 30;
        assert!(refused(&other_window).contains("64-bit window is"));
        let mut in_a_hole = good.clone();
        let hole = in_a_hole.mmio64.free[0];
        in_a_hole.slots[1].ranges[0] = SavedRange {
            bar: Some(2),
            wide: true,
            base: hole.0,
            size: hole.1,
        };
        assert!(refused(&in_a_hole).contains("not allocated in its window"));
        let mut tangled = good.clone();
        tangled.mmio64.free.reverse();
        tangled.mmio64.free.push((0, 1));
        assert!(refused(&tangled).contains("free range"));
    }

    #[test]
    fn a_restored_device_goes_back_to_its_slot_and_bar_addresses() {
        let root = PciRoot::new(root_config()).unwrap();
        let first = root.add_device(scratch()).unwrap();
        let original = scratch();
        let second = root.add_device(original.clone()).unwrap();
        let saved: Vec<(u8, u64)> = original
            .lock()
            .unwrap()
            .bars
            .placed()
            .iter()
            .map(|bar| (bar.index, bar.address))
            .collect();
        // The snapshot's VM: the first device was unplugged before the second came.
        assert!(root.remove_device(first).is_some());
        assert!(root.remove_device(second).is_some());
        let restored = PciRoot::new(root_config()).unwrap();
        let device = scratch();
        let bdf = restored
            .add_device_at(second.device, device.clone(), &saved)
            .unwrap();
        assert_eq!(bdf, second);
        let placed: Vec<(u8, u64)> = device
            .lock()
            .unwrap()
            .bars
            .placed()
            .iter()
            .map(|bar| (bar.index, bar.address))
            .collect();
        let mut expected = saved.clone();
        expected.sort();
        let mut placed = placed;
        placed.sort();
        assert_eq!(placed, expected, "the BARs where the guest had them");
        assert!(
            !device.lock().unwrap().bars.memory_enabled(),
            "decoding is the restored state's business"
        );
        // The ranges are taken: a new device gets others, and the slot is taken.
        let next = restored.add_device(scratch()).unwrap();
        assert_ne!(next.device, second.device);
        assert!(matches!(
            restored.add_device_at(second.device, scratch(), &saved),
            Err(PciError::SlotTaken(_))
        ));
        // A range another device holds cannot be given twice.
        let other = restored.placed.lock().unwrap()[&next.device].clone();
        let clash: Vec<(u8, u64)> = vec![(0, other.iter().find(|p| !p.0).unwrap().1)];
        assert!(matches!(
            restored.add_device_at(20, scratch(), &clash),
            Err(PciError::RangeTaken { .. })
        ));
        assert!(!restored.has_device(20), "nothing plugged after a refusal");
    }

    #[test]
    fn each_segment_has_its_own_ecam_and_windows() {
        let root0 = PciRoot::new(root_config()).unwrap();
        let root1 = PciRoot::new_segment(
            1,
            PciRootConfig {
                ecam_base: 0xe010_0000,
                buses: 1,
                mmio32_start: 0xe100_0000,
                mmio32_end: 0xe200_0000,
                mmio64_start: 0x200_0000_0000,
                mmio64_size: 0x100_0000_0000,
            },
        )
        .unwrap();
        let bdf = root1.add_device(scratch()).unwrap();
        assert_eq!(bdf.segment, 1);
        assert_eq!(bdf.full(), "0001:00:01.0");
        let (mut ecam0, mut ecam1) = (
            EcamWindow::new(root0.clone()),
            EcamWindow::new(root1.clone()),
        );
        let mut data = [0; 4];
        ecam1.read(1 << 15, &mut data);
        assert_eq!(
            u32::from_le_bytes(data),
            0x2330_10de,
            "segment 1 ECAM sees it"
        );
        ecam1.read(1 << 15 | 0x10, &mut data);
        assert_eq!(
            u32::from_le_bytes(data),
            0xe100_0000,
            "BAR0 in segment 1's window"
        );
        ecam1.read(0, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x0008_1b36, "its own host bridge");
        ecam0.read(1 << 15, &mut data);
        assert_eq!(data, [0xff; 4], "segment 0 ECAM does not");
        let mut port = ConfigAddressPort::new(root0.clone());
        cf8(&mut port, 1, 0);
        assert_eq!(cfc_read32(&mut port), 0xffff_ffff, "nor does 0xCF8");
        let wrong = PciBdf { segment: 0, ..bdf };
        assert!(
            root1.remove_device(wrong).is_none(),
            "the segment must match"
        );
        assert!(root0.remove_device(wrong).is_none());
        assert!(root1.remove_device(bdf).is_some());
    }

    #[test]
    fn enumeration_through_cf8_and_ecam() {
        let root = PciRoot::new(root_config()).unwrap();
        let bdf = root.add_device(scratch()).unwrap();
        assert_eq!(bdf.to_string(), "00:01.0");
        let mut port = ConfigAddressPort::new(root.clone());
        cf8(&mut port, 0, 0);
        assert_eq!(cfc_read32(&mut port), 0x0008_1b36, "host bridge");
        cf8(&mut port, 1, 0);
        assert_eq!(cfc_read32(&mut port), 0x2330_10de);
        let mut word = [0; 2];
        port.read(6, &mut word);
        assert_eq!(u16::from_le_bytes(word), 0x2330, "CFE reads the upper half");
        cf8(&mut port, 2, 0);
        assert_eq!(cfc_read32(&mut port), 0xffff_ffff, "empty slot");
        let mut ecam = EcamWindow::new(root.clone());
        let mut data = [0; 4];
        ecam.read(1 << 15, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x2330_10de);
        ecam.read(1 << 15 | 0x10, &mut data);
        assert_eq!(
            u32::from_le_bytes(data),
            0xc000_0000,
            "BAR0 placed at the hole start"
        );
        // The 128 GiB BAR lands size-aligned in the 64-bit window and stays 64-bit prefetchable.
        ecam.read(1 << 15 | 0x18, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0xc);
        ecam.read(1 << 15 | 0x1c, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x100);
    }

    #[test]
    fn bar_moves_keep_mmio_in_sync() {
        let root = PciRoot::new(root_config()).unwrap();
        root.add_device(scratch()).unwrap();
        let mut window = MmioWindows::new(root.clone(), 0xc000_0000);
        window.write(0x10, &[1, 2, 3, 4]);
        let mut data = [0; 4];
        window.read(0x10, &mut data);
        assert_eq!(data, [1, 2, 3, 4]);
        // The guest sizes BAR0 and moves it 1 MiB up.
        let mut ecam = EcamWindow::new(root.clone());
        ecam.write(1 << 15 | 0x10, &0xffff_ffffu32.to_le_bytes());
        ecam.read(1 << 15 | 0x10, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0xffff_f000);
        ecam.write(1 << 15 | 0x10, &0xc010_0000u32.to_le_bytes());
        window.read(0x10, &mut data);
        assert_eq!(data, [0xff; 4], "old address no longer decodes");
        window.read(0x10_0010, &mut data);
        assert_eq!(data, [1, 2, 3, 4]);
        // Memory decoding off: nothing decodes.
        ecam.write(1 << 15 | 0x4, &[0]);
        window.read(0x10_0010, &mut data);
        assert_eq!(data, [0xff; 4]);
    }

    #[test]
    fn restored_devices_come_back_in_any_order() {
        let bars_of = |device: &Arc<Mutex<Scratch>>| -> Vec<(u8, u64)> {
            let device = device.lock().unwrap();
            device
                .bars
                .placed()
                .iter()
                .map(|bar| (bar.index, bar.address))
                .collect()
        };
        let root = PciRoot::new(root_config()).unwrap();
        let (low, high) = (scratch(), scratch());
        let low_bdf = root.add_device(low.clone()).unwrap();
        let high_bdf = root.add_device(high.clone()).unwrap();
        let (low_bars, high_bars) = (bars_of(&low), bars_of(&high));
        // A restore that rebuilds the later device first (a hot-plugged disk saved
        // before a device that was there at boot).
        let restored = PciRoot::new(root_config()).unwrap();
        let (high_again, low_again) = (scratch(), scratch());
        restored
            .add_device_at(high_bdf.device, high_again.clone(), &high_bars)
            .unwrap();
        restored
            .add_device_at(low_bdf.device, low_again.clone(), &low_bars)
            .unwrap();
        let sorted = |mut bars: Vec<(u8, u64)>| {
            bars.sort();
            bars
        };
        assert_eq!(sorted(bars_of(&low_again)), sorted(low_bars.clone()));
        assert_eq!(sorted(bars_of(&high_again)), sorted(high_bars));
        // The skipped range is taken now: neither given twice nor to a new device.
        assert!(matches!(
            restored.add_device_at(20, scratch(), &low_bars),
            Err(PciError::RangeTaken { .. })
        ));
        let fresh = scratch();
        restored.add_device(fresh.clone()).unwrap();
        for (_, address) in bars_of(&fresh) {
            assert!(!low_bars.iter().any(|&(_, a)| a == address), "{address:#x}");
        }
    }

    #[test]
    fn windows_run_out_cleanly() {
        let mut config = root_config();
        config.mmio64_size = 64 << 30;
        let root = PciRoot::new(config).unwrap();
        let error = root.add_device(scratch()).unwrap_err();
        assert!(matches!(
            error,
            PciError::NoSpace {
                window: "64-bit",
                ..
            }
        ));
        let mut bad = root_config();
        bad.ecam_base = 0xc000_0000;
        assert!(PciRoot::new(bad).is_err());
    }

    #[test]
    fn gpus_pack_into_their_bar1s_and_the_gaps_below() {
        const GIB: u64 = 1 << 30;
        // Eight H200-like GPUs (256 GiB BAR1, 32 MiB BAR3) from 4 GiB: each BAR1 at the
        // next 256 GiB boundary, every BAR3 in the gap below the first.
        let mut window = BarAllocator::new("64-bit", 4 * GIB, 4096 * GIB);
        for gpu in 1..=8u64 {
            assert_eq!(window.allocate(256 * GIB).unwrap(), gpu * 256 * GIB);
            let bar3 = window.allocate(32 << 20).unwrap();
            assert_eq!(bar3, 4 * GIB + (gpu - 1) * (32 << 20));
        }
        assert_eq!(window.high_water(), 9 * 256 * GIB);
        // Given back, a range merges with its neighbours and the end comes down again.
        window.release(8 * 256 * GIB, 256 * GIB);
        assert_eq!(window.high_water(), 8 * 256 * GIB);
        window.release(2 * 256 * GIB, 256 * GIB);
        window.release(3 * 256 * GIB, 256 * GIB);
        assert_eq!(
            window.free,
            vec![
                (4 * GIB + 8 * (32 << 20), 252 * GIB - 8 * (32 << 20)),
                (512 * GIB, 512 * GIB)
            ]
        );
        // Best fit: a small BAR goes into the small gap, a 512 GiB one into the merged range.
        assert!(window.allocate(1 << 20).unwrap() < 256 * GIB);
        assert_eq!(window.allocate(512 * GIB).unwrap(), 512 * GIB);
        // A restored BAR inside a free range splits it.
        window.reserve(8 * GIB, 4 * GIB).unwrap();
        assert!(matches!(
            window.reserve(8 * GIB, 4 * GIB),
            Err(PciError::RangeTaken { .. })
        ));
        assert!(matches!(
            window.allocate(4096 * GIB),
            Err(PciError::NoSpace {
                window: "64-bit",
                ..
            })
        ));
    }

    fn port(kind: PortKind, primary: u8, secondary: u8, subordinate: u8) -> Arc<Mutex<PciBridge>> {
        Arc::new(Mutex::new(PciBridge::new(&BridgeSetup {
            kind,
            primary_bus: primary,
            secondary_bus: secondary,
            subordinate_bus: subordinate,
            memory: Window::default(),
            prefetchable: Window::default(),
            slot: 1,
            occupied: true,
        })))
    }

    fn cf8_bus(port: &mut ConfigAddressPort, bus: u8, device: u8, register: u8) {
        let address =
            1u32 << 31 | u32::from(bus) << 16 | u32::from(device) << 11 | u32::from(register);
        port.write(0, &address.to_le_bytes());
    }

    #[test]
    fn config_cycles_reach_devices_behind_a_switch_and_follow_renumbering() {
        let root = PciRoot::new(root_config()).unwrap();
        // 00:03.0 root port -> 01:00.0 upstream -> 02:00.0 / 02:01.0 downstream -> GPUs.
        let window = root.allocate_window(true, 512 << 30, 128 << 30).unwrap();
        let rp = root
            .add_port(
                3,
                port(PortKind::RootPort, 0, 1, 4),
                vec![(true, window, 512 << 30)],
            )
            .unwrap();
        assert_eq!(rp.to_string(), "00:03.0");
        root.add_behind(&[3, 0], port(PortKind::SwitchUpstream, 1, 2, 4), &[], true)
            .unwrap();
        for (i, bus) in [(0u8, 3u8), (1, 4)] {
            root.add_behind(
                &[3, 0, i],
                port(PortKind::SwitchDownstream, 2, bus, bus),
                &[],
                true,
            )
            .unwrap();
        }
        let bar2 = window + (128 << 30);
        let gpu = root
            .add_behind(
                &[3, 0, 1, 0],
                scratch(),
                &[(0, 0xc000_0000), (2, bar2)],
                true,
            )
            .unwrap();
        assert_eq!(gpu.to_string(), "04:00.0");
        let mut port = ConfigAddressPort::new(root.clone());
        cf8_bus(&mut port, 4, 0, 0);
        assert_eq!(cfc_read32(&mut port), 0x2330_10de, "GPU behind the switch");
        cf8_bus(&mut port, 4, 1, 0);
        assert_eq!(cfc_read32(&mut port), 0xffff_ffff, "only device 0 there");
        cf8_bus(&mut port, 3, 0, 0);
        assert_eq!(
            cfc_read32(&mut port),
            0xffff_ffff,
            "the other port is empty"
        );
        cf8_bus(&mut port, 2, 1, 0);
        assert_eq!(
            cfc_read32(&mut port),
            0x0111_1b36,
            "downstream port 02:01.0"
        );
        let mut ecam = EcamWindow::new(root.clone());
        let mut data = [0; 4];
        ecam.read(4 << 20 | 0x18, &mut data);
        assert_eq!(u32::from_le_bytes(data) & !0xf, (bar2 as u32) & !0xf);
        assert_eq!(root.highest_bus(), 4);
        // Its BAR decodes by address.
        root.mmio_write(0xc000_0010, &[9, 8, 7, 6]);
        root.mmio_read(0xc000_0010, &mut data);
        assert_eq!(data, [9, 8, 7, 6]);
        // The guest renumbers: root port 0x10..0x14, upstream 0x11, downstream 0x12..0x14.
        cf8_bus(&mut port, 2, 1, 0x18);
        port.write(4, &0x0014_1402u32.to_le_bytes());
        cf8_bus(&mut port, 2, 0, 0x18);
        port.write(4, &0x0013_1302u32.to_le_bytes());
        cf8_bus(&mut port, 1, 0, 0x18);
        port.write(4, &0x0014_1201u32.to_le_bytes());
        cf8_bus(&mut port, 0, 3, 0x18);
        port.write(4, &0x0014_1100u32.to_le_bytes());
        cf8_bus(&mut port, 4, 0, 0);
        assert_eq!(cfc_read32(&mut port), 0xffff_ffff, "the old number is gone");
        cf8_bus(&mut port, 0x11, 0, 0);
        assert_eq!(
            cfc_read32(&mut port),
            0x0110_1b36,
            "upstream port now on bus 0x11"
        );
        cf8_bus(&mut port, 0x14, 0, 0);
        assert_eq!(cfc_read32(&mut port), 0x2330_10de, "the GPU on bus 0x14");
        assert_eq!(root.bdf_of_path(&[3, 0, 1, 0]).unwrap().bus, 0x14);
        // A bridge closed by the guest (secondary 0) forwards nothing.
        cf8_bus(&mut port, 0, 3, 0x18);
        port.write(4, &0u32.to_le_bytes());
        cf8_bus(&mut port, 0x14, 0, 0);
        assert_eq!(cfc_read32(&mut port), 0xffff_ffff);
        // Ports without a bridge above, taken slots and windows going back on removal.
        assert!(root.add_behind(&[7, 0], scratch(), &[], true).is_err());
        assert!(root.add_behind(&[3, 0], scratch(), &[], true).is_err());
        assert!(root.remove_device(rp).is_some());
        assert_eq!(
            root.allocate_window(true, 512 << 30, 128 << 30).unwrap(),
            window
        );
    }

    #[test]
    fn a_restored_window_is_reserved_in_aligned_pieces() {
        let root = PciRoot::new(root_config()).unwrap();
        root.reserve_window(false, 0xc030_0000, 0x50_0000).unwrap();
        assert!(root.reserve_window(false, 0xc040_0000, 0x10_0000).is_err());
        let bdf = root.add_device(scratch()).unwrap();
        let mut ecam = EcamWindow::new(root.clone());
        let mut data = [0; 4];
        ecam.read(u64::from(bdf.device) << 15 | 0x10, &mut data);
        let bar0 = u64::from(u32::from_le_bytes(data));
        assert!(!(0xc030_0000..0xc080_0000).contains(&bar0), "{bar0:#x}");
    }

    #[test]
    fn odd_accesses_do_not_panic() {
        let root = PciRoot::new(root_config()).unwrap();
        let mut port = ConfigAddressPort::new(root.clone());
        let mut data = [0; 3];
        port.read(4, &mut data);
        port.write(5, &[1, 2, 3]);
        port.write(1, &[0xff]);
        let mut ecam = EcamWindow::new(root);
        ecam.read(0xfffff, &mut [0; 4]);
        ecam.write(0xffffe, &[0; 8]);
    }
}
