//! The guest-physical address space above 4 GiB, planned from the host and the devices.
//!
//! ```text
//! 4 GiB            boot RAM above the 32-bit hole
//! ram_top          room for hot-plugged RAM (layout::ram_hotplug_area), 1 GiB aligned
//! mmio64_start     segment 0's 64-bit PCI BAR window: every passthrough device's 64-bit
//!                  BARs, each aligned to its size, placed as the root will place them
//!                  (gpuvm_devices::pci::BarAllocator), plus room to hot-plug one more device
//!                  of the largest BAR set present; at least PCI_MMIO64_DEFAULT_SIZE where
//!                  the address width allows (a VM without passthrough devices gets that)
//! ...              the windows of segments 1..: 64 GiB each, or what the devices placed
//!                  on the segment need (a NUMA node's GPUs), aligned to their largest BAR
//! < 2^phys_bits    the guest's physical address width: what KVM reports in CPUID
//!                  0x80000008, at most 48 bits (4-level paging)
//! ```
//!
//! On AMD hosts the HyperTransport range 0xFD_0000_0000..0x100_0000_0000 (1012 GiB to
//! 1 TiB) holds neither RAM nor BARs: a window that would cross it, or that the hole would
//! cut short of the default, starts at 1 TiB instead where that gives it more room, and
//! RAM that would reach it is refused (RAM above 1 TiB is not laid out yet).
//!
//! Below 4 GiB, the segments' ECAM windows lie one after another from 0xe000_0000 (1 MiB
//! per bus), and segments 1.. share 0xe100_0000 (or the end of the ECAM windows, if later)
//! ..0xf000_0000 for their 32-bit BARs: 16 MiB each, or what the devices placed on the
//! segment need (an H100's BAR0 alone is 16 MiB).
//!
//! [`plan`] is pure: the VMM gives it the host's CPUID (KVM_GET_SUPPORTED_CPUID) and the
//! BAR sizes of the devices it has opened, before it builds the PCI roots, and a plan
//! that does not fit is refused with the numbers before the guest starts.

use std::fmt;

use gpuvm_devices::pci::BarAllocator;
use kvm_bindings::kvm_cpuid_entry2;

use super::layout::{
    pci_ecam_bases, ram_hotplug_area, PCI_ECAM_START, PCI_MMIO64_ALIGN, PCI_MMIO64_DEFAULT_SIZE,
    PCI_SEGMENTS_MMIO32_END, PCI_SEGMENTS_MMIO32_START, PCI_SEGMENT_MMIO32_SIZE,
    PCI_SEGMENT_MMIO64_SIZE,
};

/// The widest guest-physical address space gpuvm plans for: what 4-level paging (a
/// 48-bit virtual address space, and Linux's 4-level limits) can use.
pub const MAX_GUEST_PHYS_BITS: u8 = 48;
/// MAXPHYADDR when CPUID has no leaf 0x80000008 (Intel SDM, CPUID.80000008H absent).
pub const DEFAULT_PHYS_BITS: u8 = 36;
pub use super::layout::{AMD_HT_HOLE_END, AMD_HT_HOLE_START};

/// The host CPU's vendor, from CPUID leaf 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuVendor {
    Intel,
    /// AuthenticAMD, and Hygon's Zen-based HygonGenuine (the same HyperTransport hole).
    Amd,
    Other,
}

impl CpuVendor {
    /// From CPUID leaf 0's EBX, EDX, ECX (the 12-byte vendor string in that order).
    pub fn from_leaf0(ebx: u32, ecx: u32, edx: u32) -> Self {
        let mut name = [0u8; 12];
        name[0..4].copy_from_slice(&ebx.to_le_bytes());
        name[4..8].copy_from_slice(&edx.to_le_bytes());
        name[8..12].copy_from_slice(&ecx.to_le_bytes());
        match &name {
            b"GenuineIntel" => CpuVendor::Intel,
            b"AuthenticAMD" | b"HygonGenuine" => CpuVendor::Amd,
            _ => CpuVendor::Other,
        }
    }
}

/// The guest-physical address width the host gives a VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostAddressWidth {
    pub vendor: CpuVendor,
    /// What KVM reports: CPUID 0x80000008 EAX[23:16] (GuestPhysBits, the widest address
    /// KVM's own page tables map) when set, else EAX[7:0] (MAXPHYADDR).
    pub reported_bits: u8,
    /// What gpuvm plans within: `reported_bits`, at most [`MAX_GUEST_PHYS_BITS`].
    pub phys_bits: u8,
}

impl HostAddressWidth {
    pub fn new(vendor: CpuVendor, reported_bits: u8) -> Self {
        HostAddressWidth {
            vendor,
            reported_bits,
            phys_bits: reported_bits.clamp(32, MAX_GUEST_PHYS_BITS),
        }
    }

    /// From CPUID as KVM reports it (KVM_GET_SUPPORTED_CPUID): leaf 0's vendor and leaf
    /// 0x80000008's widths.
    pub fn from_cpuid(entries: &[kvm_cpuid_entry2]) -> Self {
        let leaf = |function: u32| entries.iter().find(|e| e.function == function);
        let vendor = leaf(0).map_or(CpuVendor::Other, |e| {
            CpuVendor::from_leaf0(e.ebx, e.ecx, e.edx)
        });
        let bits = leaf(0x8000_0008)
            .map(|e| {
                let guest = (e.eax >> 16) as u8;
                if guest != 0 {
                    guest
                } else {
                    e.eax as u8
                }
            })
            .filter(|&bits| bits != 0)
            .unwrap_or(DEFAULT_PHYS_BITS);
        Self::new(vendor, bits)
    }

    /// The first guest-physical address past the guest's address space.
    pub fn limit(&self) -> u64 {
        1u64 << self.phys_bits
    }

    /// Whether the AMD HyperTransport hole must be kept free.
    pub fn has_ht_hole(&self) -> bool {
        self.vendor == CpuVendor::Amd
    }

    fn describe_limit(&self) -> String {
        let mut text = format!(
            "the guest's {}-bit physical address space ({}",
            self.phys_bits,
            human(self.limit())
        );
        if self.reported_bits != self.phys_bits {
            text += &format!(
                "; KVM reports {} bits, gpuvm plans within {MAX_GUEST_PHYS_BITS}",
                self.reported_bits
            );
        }
        text + ")"
    }
}

impl fmt::Display for HostAddressWidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}-bit guest physical addresses ({})",
            self.phys_bits,
            human(self.limit())
        )?;
        if self.reported_bits != self.phys_bits {
            write!(
                f,
                ", KVM reports {} bits, capped at {MAX_GUEST_PHYS_BITS} (4-level paging)",
                self.reported_bits
            )?;
        }
        match self.vendor {
            CpuVendor::Amd => write!(f, ", AMD host: 1012 GiB..1 TiB kept free"),
            CpuVendor::Intel => write!(f, ", Intel host"),
            CpuVendor::Other => Ok(()),
        }
    }
}

/// `bytes` for people: "64 TiB", "1020 GiB", "256.03 GiB", "512 MiB", "4096 bytes".
pub fn human(bytes: u64) -> String {
    const UNITS: [(u32, &str); 5] = [
        (50, "PiB"),
        (40, "TiB"),
        (30, "GiB"),
        (20, "MiB"),
        (10, "KiB"),
    ];
    // The largest unit that says it exactly; above 1 GiB, GiB with two decimals rather
    // than MiB.
    match UNITS
        .iter()
        .find(|(shift, _)| bytes >= 1 << shift && bytes.is_multiple_of(1 << shift))
    {
        Some((shift, _)) if *shift < 30 && bytes >= 1 << 30 => {
            format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
        }
        Some((shift, unit)) => format!("{} {unit}", bytes >> shift),
        None if bytes >= 1 << 30 => format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64),
        None => format!("{bytes} bytes"),
    }
}

/// What the plan is made from.
#[derive(Clone, Debug)]
pub struct PlanRequest<'a> {
    pub host: HostAddressWidth,
    /// The end of boot RAM (the highest RAM region's end).
    pub ram_top: u64,
    /// Room kept for hot-plugged RAM after boot RAM (PciOptions::ram_hotplug_size).
    pub ram_hotplug_size: u64,
    /// Each passthrough device's 64-bit BAR sizes (powers of two), in the order the
    /// devices are plugged.
    pub devices: &'a [Vec<u64>],
    /// A window size given by hand (PciOptions::mmio64_size); 0 plans it.
    pub mmio64_size: u64,
    /// The window exactly (start, size): a restored VM's, where its guest has it.
    pub fixed_window: Option<(u64, u64)>,
    /// PCI segments (1..): segment 0 has the planned window, each further one 64 GiB or
    /// what its devices need.
    pub segments: u16,
    /// The BARs of the devices placed on segments 1.. (segment 1's first; missing ones
    /// hold none). `devices` holds only segment 0's.
    pub segment_bars: &'a [SegmentBars],
    /// How many buses each segment's ECAM window covers, segment 0's first (missing: one;
    /// more with root ports and switches).
    pub segment_buses: &'a [u16],
}

/// The BARs of the passthrough devices on one PCI segment other than 0, device by device
/// in plug order: each device's 64-bit memory BAR sizes and its 32-bit ones.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SegmentBars {
    pub mmio64: Vec<Vec<u64>>,
    pub mmio32: Vec<Vec<u64>>,
}

/// Where things go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressSpacePlan {
    pub host: HostAddressWidth,
    /// The end of boot RAM and of the room for hot-plugged RAM after it.
    pub ram_end: u64,
    /// Segment 0's 64-bit BAR window.
    pub mmio64_start: u64,
    pub mmio64_size: u64,
    /// The devices' 64-bit BARs, summed, and the part of the window kept for hot-plug (the
    /// largest device's 64-bit BARs; 0 without devices).
    pub device_bars: u64,
    pub hotplug_reserve: u64,
    /// Each further segment's 64-bit window (start, size), segment 1's first.
    pub segment_mmio64: Vec<(u64, u64)>,
    /// Each further segment's 32-bit window (start, end), segment 1's first.
    pub segment_mmio32: Vec<(u64, u64)>,
    /// Each segment's ECAM window base, segment 0's first (layout::pci_ecam_bases).
    pub segment_ecam: Vec<u64>,
    /// The end of the last window: the highest guest-physical address used, plus one.
    pub end: u64,
}

impl AddressSpacePlan {
    pub fn mmio64_end(&self) -> u64 {
        self.mmio64_start + self.mmio64_size
    }
}

impl fmt::Display for AddressSpacePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "64-bit PCI window {:#x}..{:#x} ({}",
            self.mmio64_start,
            self.mmio64_end(),
            human(self.mmio64_size)
        )?;
        if self.device_bars > 0 {
            write!(
                f,
                ": {} of device BARs, {} kept for hot-plug",
                human(self.device_bars),
                human(self.hotplug_reserve)
            )?;
        }
        write!(f, "), within {}", self.host)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error(
        "the VM needs a 64-bit PCI MMIO window of {} at {start:#x}..{:#x}{what}, \
         ending above {}{hint}",
        human(*size),
        start + size,
        host.describe_limit()
    )]
    WindowTooHigh {
        host: HostAddressWidth,
        start: u64,
        size: u64,
        /// What the window holds, or what follows it.
        what: String,
        hint: String,
    },
    #[error(
        "guest RAM and the room kept for hot-plugged RAM end at {end:#x} ({}), above {}",
        human(*end),
        host.describe_limit()
    )]
    RamTooHigh { host: HostAddressWidth, end: u64 },
    #[error(
        "the room kept for hot-plugged RAM, {start:#x}..{end:#x} ({} to {}), crosses the AMD \
         HyperTransport range {AMD_HT_HOLE_START:#x}..{AMD_HT_HOLE_END:#x} (1012 GiB to \
         1 TiB), which must hold no RAM: boot RAM goes on above it, but the room is one \
         range; make it smaller, or boot RAM larger (at least 1009 GiB puts the room above \
         1 TiB)",
        human(*start),
        human(*end)
    )]
    RamInHtHole { start: u64, end: u64 },
    #[error(
        "the snapshot's 64-bit PCI MMIO window {start:#x}..{end:#x} crosses the AMD \
         HyperTransport range {AMD_HT_HOLE_START:#x}..{AMD_HT_HOLE_END:#x} of this host"
    )]
    WindowInHtHole { start: u64, end: u64 },
    #[error(
        "the 64-bit PCI MMIO window of {} (mmio64_size, --pci-mmio64-gib) is smaller than \
         the {} the passthrough devices' 64-bit BARs need there, each aligned to its size",
        human(*given),
        human(*needed)
    )]
    WindowTooSmall { given: u64, needed: u64 },
    #[error(
        "the passthrough devices on PCI segment {segment} need {} of 32-bit BARs there, each \
         aligned to its size; segments 1.. share {} below 4 GiB \
         ({PCI_SEGMENTS_MMIO32_START:#x}..{PCI_SEGMENTS_MMIO32_END:#x}) and the segments \
         before it take {}: put fewer devices with 32-bit BARs on one guest NUMA node",
        human(*needed),
        human(PCI_SEGMENTS_MMIO32_END - PCI_SEGMENTS_MMIO32_START),
        human(*taken)
    )]
    Mmio32TooSmall {
        segment: u16,
        needed: u64,
        taken: u64,
    },
    #[error(
        "the ECAM windows of the {segments} PCI segments take {} (1 MiB per bus: each root \
         port and switch port adds one), more than the {} left below 4 GiB beside the \
         32-bit BAR windows of segments 1..: use fewer root ports or segments",
        human(*size),
        human(*room)
    )]
    EcamTooLarge { segments: u16, size: u64, room: u64 },
}

/// Places each device's BARs (largest first, as the root places a device's) from `start`,
/// device by device; returns the allocator after them.
fn place_devices(name: &'static str, start: u64, devices: &[Vec<u64>]) -> BarAllocator {
    let mut allocator = BarAllocator::new(name, start, u64::MAX);
    for bars in devices {
        place(&mut allocator, bars);
    }
    allocator
}

fn place(allocator: &mut BarAllocator, bars: &[u64]) {
    let mut sizes = bars.to_vec();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    for size in sizes {
        // The window is unbounded here: only an address past u64 fails, and then the
        // width check refuses the plan anyway.
        let _ = allocator.allocate(size);
    }
}

/// How much of a window starting at `start` the devices' BARs take, placed device by
/// device as the root places them, and then once more the largest device's (the hot-plug
/// reserve). Returns (up to the last device, up to the reserve), from `start`.
fn bars_span(start: u64, devices: &[Vec<u64>]) -> (u64, u64) {
    let mut allocator = place_devices("64-bit", start, devices);
    let devices_end = allocator.high_water();
    if let Some(largest) = devices.iter().max_by_key(|bars| bars.iter().sum::<u64>()) {
        place(&mut allocator, largest);
    }
    let round = |end: u64| (end - start).next_multiple_of(PCI_MMIO64_ALIGN);
    (round(devices_end), round(allocator.high_water()))
}

/// The device whose BARs take the most, if any.
fn largest_device(devices: &[Vec<u64>]) -> Option<&Vec<u64>> {
    devices.iter().max_by_key(|bars| bars.iter().sum::<u64>())
}

/// A window for `devices` at or after `next`, in `unit`s: the `least` size at `next` where
/// their BARs fit in it (the layout every segment had before windows were sized), else
/// aligned to the largest BAR and as large as they take. With `reserve`, room for one more
/// of `reserve`'s BARs after them (a device hot-plugged onto the segment). Returns
/// (start, size).
fn sized_window(
    next: u64,
    devices: &[Vec<u64>],
    reserve: Option<&Vec<u64>>,
    least: u64,
    unit: u64,
) -> (u64, u64) {
    let span = |start: u64| {
        let mut allocator = place_devices("", start, devices);
        if let Some(bars) = reserve {
            place(&mut allocator, bars);
        }
        (allocator.high_water() - start).next_multiple_of(unit)
    };
    if span(next) <= least {
        return (next, least);
    }
    let largest = (devices.iter().chain(reserve))
        .flatten()
        .copied()
        .max()
        .unwrap_or(unit);
    let start = next.next_multiple_of(largest.max(unit));
    (start, span(start).max(least))
}

/// The 32-bit windows of segments 1..`segments`, one after another from
/// [`PCI_SEGMENTS_MMIO32_START`], or from `ecam_end` where the segments' ECAM windows
/// reach past it: (start, end) each. Each has room for one more of its largest device
/// (hot-plug onto the segment) where the 32-bit space allows that for all of them.
fn segment_windows32(
    segments: u16,
    bars: &[SegmentBars],
    ecam_end: u64,
) -> Result<Vec<(u64, u64)>, PlanError> {
    // Room for one more of each segment's largest device where the space allows it.
    segment_windows32_with(segments, bars, ecam_end, true)
        .or_else(|_| segment_windows32_with(segments, bars, ecam_end, false))
}

/// [`segment_windows32`], with or without the hot-plug `reserve`.
fn segment_windows32_with(
    segments: u16,
    bars: &[SegmentBars],
    ecam_end: u64,
    reserve: bool,
) -> Result<Vec<(u64, u64)>, PlanError> {
    let mut windows = Vec::new();
    if segments <= 1 {
        return Ok(windows);
    }
    // Each further segment's 32-bit window is at least PCI_SEGMENT_MMIO32_SIZE.
    let room = PCI_SEGMENTS_MMIO32_END - u64::from(segments - 1) * PCI_SEGMENT_MMIO32_SIZE;
    if ecam_end > room {
        return Err(PlanError::EcamTooLarge {
            segments,
            size: ecam_end - PCI_ECAM_START,
            room: room - PCI_ECAM_START,
        });
    }
    let first = PCI_SEGMENTS_MMIO32_START.max(ecam_end);
    let mut next = first;
    for segment in 1..segments {
        let devices = bars
            .get(usize::from(segment) - 1)
            .map_or(&[][..], |b| &b.mmio32[..]);
        let spare = reserve.then(|| largest_device(devices)).flatten();
        let (start, size) = sized_window(next, devices, spare, PCI_SEGMENT_MMIO32_SIZE, 1 << 20);
        if start + size > PCI_SEGMENTS_MMIO32_END {
            return Err(PlanError::Mmio32TooSmall {
                segment,
                needed: size,
                taken: next - first,
            });
        }
        windows.push((start, start + size));
        next = start + size;
    }
    Ok(windows)
}

fn overlaps_ht_hole(start: u64, end: u64) -> bool {
    start < AMD_HT_HOLE_END && end > AMD_HT_HOLE_START
}

/// Where the 64-bit windows of segments 1.. go after segment 0's ends at `end0`: one
/// after another from there, or past the AMD hole if they would cross it; with `reserve`
/// (a planned window) each with room for one more of its largest device (hot-plug onto
/// the segment). Returns each (start, size) and where the last ends.
fn segment_windows(
    host: &HostAddressWidth,
    end0: u64,
    segments: u16,
    bars: &[SegmentBars],
    reserve: bool,
) -> (Vec<(u64, u64)>, u64) {
    let lay = |base: u64| {
        let mut windows = Vec::new();
        let mut next = base.next_multiple_of(PCI_MMIO64_ALIGN);
        for segment in 1..segments.max(1) {
            let devices = bars
                .get(usize::from(segment) - 1)
                .map_or(&[][..], |b| &b.mmio64[..]);
            let spare = reserve.then(|| largest_device(devices)).flatten();
            let window = sized_window(
                next,
                devices,
                spare,
                PCI_SEGMENT_MMIO64_SIZE,
                PCI_MMIO64_ALIGN,
            );
            next = window.0 + window.1;
            windows.push(window);
        }
        let end = if windows.is_empty() { end0 } else { next };
        (windows, end)
    };
    let (windows, end) = lay(end0);
    if host.has_ht_hole()
        && windows
            .first()
            .is_some_and(|&(first, _)| overlaps_ht_hole(first, end))
    {
        return lay(end0.max(AMD_HT_HOLE_END));
    }
    (windows, end)
}

/// Plans the address space above RAM; see the module documentation.
pub fn plan(request: &PlanRequest<'_>) -> Result<AddressSpacePlan, PlanError> {
    let host = request.host;
    let limit = host.limit();
    let (hotplug_start, hotplug_size) = ram_hotplug_area(request.ram_top, request.ram_hotplug_size);
    let ram_end = hotplug_start + hotplug_size;
    // Boot RAM is laid out around the hole (layout::ram_regions_around); the hot-plug
    // room after it is one range.
    if host.has_ht_hole() && hotplug_size > 0 && overlaps_ht_hole(hotplug_start, ram_end) {
        return Err(PlanError::RamInHtHole {
            start: hotplug_start,
            end: ram_end,
        });
    }
    if ram_end > limit {
        return Err(PlanError::RamTooHigh { host, end: ram_end });
    }
    let base = ram_end.next_multiple_of(PCI_MMIO64_ALIGN);
    let device_bars: u64 = request.devices.iter().flatten().sum();
    let largest = request
        .devices
        .iter()
        .map(|bars| bars.iter().sum::<u64>())
        .max()
        .unwrap_or(0);
    let planned = request.fixed_window.is_none() && request.mmio64_size == 0;
    let (segment_ecam, ecam_end) = pci_ecam_bases(request.segments, request.segment_buses);
    let segment_mmio32 = segment_windows32(request.segments, request.segment_bars, ecam_end)?;
    let layout = |start: u64, size: u64| {
        let (segment_mmio64, end) = segment_windows(
            &host,
            start.saturating_add(size),
            request.segments,
            request.segment_bars,
            planned,
        );
        AddressSpacePlan {
            host,
            ram_end,
            mmio64_start: start,
            mmio64_size: size,
            device_bars,
            hotplug_reserve: if planned { largest } else { 0 },
            segment_mmio64,
            segment_mmio32: segment_mmio32.clone(),
            segment_ecam: segment_ecam.clone(),
            end,
        }
    };
    let fits = |plan: &AddressSpacePlan| {
        plan.end <= limit
            && !(host.has_ht_hole() && overlaps_ht_hole(plan.mmio64_start, plan.mmio64_end()))
    };
    // Where the window may start: right above RAM, or (AMD) past the HyperTransport hole.
    let mut starts = vec![request.fixed_window.map_or(base, |(start, _)| start)];
    if host.has_ht_hole() && request.fixed_window.is_none() && base < AMD_HT_HOLE_END {
        starts.push(AMD_HT_HOLE_END);
    }
    let mut refused = None;
    let mut best: Option<AddressSpacePlan> = None;
    for start in starts {
        // The size the window must have from `start`.
        let size = match (request.fixed_window, request.mmio64_size) {
            (Some((_, size)), _) => size,
            (None, 0) => bars_span(start, request.devices).1.max(PCI_MMIO64_ALIGN),
            (None, given) => {
                let needed = bars_span(start, request.devices).0;
                if given < needed {
                    return Err(PlanError::WindowTooSmall { given, needed });
                }
                given
            }
        };
        let plan = layout(start, size);
        if !fits(&plan) {
            // The last one tried is the one the refusal describes: on AMD hosts, the
            // window past the hole.
            refused = Some(plan);
            continue;
        }
        if !planned || size >= PCI_MMIO64_DEFAULT_SIZE {
            return Ok(plan);
        }
        // Planned and smaller than the default: grow it toward the default as far as the
        // width (and the AMD hole) allow. Whether a size fits only gets worse as it grows.
        let (mut low, mut high) = (
            size / PCI_MMIO64_ALIGN,
            PCI_MMIO64_DEFAULT_SIZE / PCI_MMIO64_ALIGN,
        );
        while low < high {
            let middle = (low + high).div_ceil(2);
            if fits(&layout(start, middle * PCI_MMIO64_ALIGN)) {
                low = middle;
            } else {
                high = middle - 1;
            }
        }
        let grown = layout(start, low * PCI_MMIO64_ALIGN);
        if grown.mmio64_size == PCI_MMIO64_DEFAULT_SIZE {
            return Ok(grown);
        }
        // Cut short (on AMD hosts, by the HyperTransport hole): a later start (past the
        // hole) may hold more, and hot-plug needs the room more than low addresses.
        if best
            .as_ref()
            .is_none_or(|b| grown.mmio64_size > b.mmio64_size)
        {
            best = Some(grown);
        }
    }
    if let Some(best) = best {
        return Ok(best);
    }
    let refused = refused.expect("at least one start is tried");
    if request.fixed_window.is_some()
        && host.has_ht_hole()
        && overlaps_ht_hole(refused.mmio64_start, refused.mmio64_end())
    {
        return Err(PlanError::WindowInHtHole {
            start: refused.mmio64_start,
            end: refused.mmio64_end(),
        });
    }
    let mut what = String::new();
    if !request.devices.is_empty() {
        what = format!(
            " ({} passthrough device(s) with {} of 64-bit BARs",
            request.devices.len(),
            human(device_bars)
        );
        if refused.hotplug_reserve > 0 {
            what += &format!(", room for one more of {}", human(refused.hotplug_reserve));
        }
        what += ")";
    }
    if refused.end > refused.mmio64_end() {
        let sizes: u64 = refused.segment_mmio64.iter().map(|&(_, size)| size).sum();
        what += &format!(
            " and {} more PCI segment window(s) of {} in all to {:#x}",
            request.segments - 1,
            human(sizes),
            refused.end
        );
    }
    let hint = if request.fixed_window.is_some() {
        ": this host cannot hold the snapshot's address space".to_string()
    } else if request.devices.is_empty() {
        String::new()
    } else {
        ": pass through fewer or smaller devices, or use a host with a wider physical \
         address space"
            .to_string()
    };
    Err(PlanError::WindowTooHigh {
        host,
        start: refused.mmio64_start,
        size: refused.mmio64_size,
        what,
        hint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x86_64::layout::{pci_segment_mmio32, pci_segment_mmio64_start, FOUR_GIB};

    const GIB: u64 = 1 << 30;
    const TIB: u64 = 1 << 40;
    /// An H100/H200-like GPU's 64-bit BARs: BAR1 and the 32 MiB BAR3.
    fn gpu(bar1: u64) -> Vec<u64> {
        vec![bar1, 32 << 20]
    }

    fn intel(bits: u8) -> HostAddressWidth {
        HostAddressWidth::new(CpuVendor::Intel, bits)
    }

    fn amd(bits: u8) -> HostAddressWidth {
        HostAddressWidth::new(CpuVendor::Amd, bits)
    }

    fn request(host: HostAddressWidth, devices: &[Vec<u64>]) -> PlanRequest<'_> {
        PlanRequest {
            host,
            ram_top: 2 * GIB,
            ram_hotplug_size: 0,
            devices,
            mmio64_size: 0,
            fixed_window: None,
            segments: 1,
            segment_bars: &[],
            segment_buses: &[],
        }
    }

    /// Places the devices (and the reserve device) in the plan's window as the root does;
    /// every BAR must land inside it, aligned to its size, clear of the AMD hole.
    fn check_fits(plan: &AddressSpacePlan, devices: &[Vec<u64>]) -> Vec<u64> {
        let mut window = BarAllocator::new("64-bit", plan.mmio64_start, plan.mmio64_end());
        let mut placed = Vec::new();
        let largest = devices.iter().max_by_key(|d| d.iter().sum::<u64>());
        for bars in devices.iter().chain(largest) {
            let mut sizes = bars.clone();
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            for size in sizes {
                let at = window.allocate(size).expect("the planned window holds it");
                assert_eq!(at % size, 0, "{at:#x} aligned to {size:#x}");
                assert!(at >= plan.ram_end && at + size <= plan.end);
                if plan.host.has_ht_hole() {
                    assert!(!overlaps_ht_hole(at, at + size), "{at:#x}+{size:#x}");
                }
                placed.push(at);
            }
        }
        assert!(plan.end <= plan.host.limit());
        assert_eq!(plan.mmio64_start % PCI_MMIO64_ALIGN, 0);
        assert_eq!(plan.mmio64_size % PCI_MMIO64_ALIGN, 0);
        placed
    }

    fn cpuid(vendor: &[u8; 12], leaf_80000008: Option<u32>) -> Vec<kvm_cpuid_entry2> {
        let word = |i: usize| u32::from_le_bytes(vendor[i..i + 4].try_into().unwrap());
        let mut entries = vec![kvm_cpuid_entry2 {
            function: 0,
            eax: 0x1c,
            ebx: word(0),
            edx: word(4),
            ecx: word(8),
            ..Default::default()
        }];
        if let Some(eax) = leaf_80000008 {
            entries.push(kvm_cpuid_entry2 {
                function: 0x8000_0008,
                eax,
                ..Default::default()
            });
        }
        entries
    }

    #[test]
    fn width_and_vendor_come_from_kvm_cpuid() {
        // This CI host: 48 physical bits, 57 virtual, no GuestPhysBits.
        let host = HostAddressWidth::from_cpuid(&cpuid(b"GenuineIntel", Some(0x3930)));
        assert_eq!(host, intel(48));
        assert_eq!(host.limit(), 256 * TIB);
        // A 46-bit Intel host; an AMD host whose KVM reports GuestPhysBits 48 below a
        // 52-bit MAXPHYADDR.
        assert_eq!(
            HostAddressWidth::from_cpuid(&cpuid(b"GenuineIntel", Some(0x302e))),
            intel(46)
        );
        let epyc = HostAddressWidth::from_cpuid(&cpuid(b"AuthenticAMD", Some(0x0030_3034)));
        assert_eq!((epyc.vendor, epyc.reported_bits), (CpuVendor::Amd, 48));
        // A 52-bit host is planned within 48 bits.
        let wide = HostAddressWidth::from_cpuid(&cpuid(b"GenuineIntel", Some(0x3934)));
        assert_eq!((wide.reported_bits, wide.phys_bits), (52, 48));
        assert!(
            wide.to_string()
                .contains("KVM reports 52 bits, capped at 48"),
            "{wide}"
        );
        // No leaf 0x80000008: the architectural default.
        assert_eq!(
            HostAddressWidth::from_cpuid(&cpuid(b"HygonGenuine", None)),
            amd(DEFAULT_PHYS_BITS)
        );
        assert_eq!(
            HostAddressWidth::from_cpuid(&cpuid(b"VIA VIA VIA ", Some(40))).vendor,
            CpuVendor::Other
        );
    }

    #[test]
    fn without_devices_the_window_is_the_default() {
        for host in [intel(46), intel(48), amd(48)] {
            let plan = plan(&request(host, &[])).unwrap();
            // On AMD the hole would cut it to 1008 GiB: it starts past the hole.
            let start = if host.has_ht_hole() {
                AMD_HT_HOLE_END
            } else {
                FOUR_GIB
            };
            assert_eq!(plan.mmio64_start, start, "{plan}");
            assert_eq!(plan.mmio64_size, PCI_MMIO64_DEFAULT_SIZE);
            assert_eq!(plan.hotplug_reserve, 0);
        }
        // Room for eight H200-like GPUs hot-plugged one by one (Kata's path): each lands
        // where the root's allocator puts it, in the window planned without them.
        let plan = plan(&request(intel(46), &[])).unwrap();
        let mut window = BarAllocator::new("64-bit", plan.mmio64_start, plan.mmio64_end());
        for _ in 0..8 {
            window
                .allocate(256 * GIB)
                .expect("room for a hot-plugged BAR1");
            window.allocate(32 << 20).expect("room for its BAR3");
        }
        // A 42-bit host (4 TiB) gets all it has above 4 GiB.
        let plan = super::plan(&request(intel(42), &[])).unwrap();
        assert_eq!(plan.mmio64_end(), 4 * TIB);
        // A narrow host gets what fits: 39 bits (512 GiB) leaves 508 GiB above 4 GiB.
        let narrow = super::plan(&request(intel(39), &[])).unwrap();
        assert_eq!(narrow.mmio64_end(), 512 * GIB);
        assert_eq!(narrow.mmio64_size, 508 * GIB);
    }

    #[test]
    fn eight_h200s_on_46_48_and_52_bit_hosts() {
        let devices = vec![gpu(256 * GIB); 8];
        for host in [intel(46), intel(48), intel(52)] {
            let plan = plan(&request(host, &devices)).unwrap();
            assert_eq!(plan.mmio64_start, FOUR_GIB);
            // BAR1s at 256 GiB .. 2.25 TiB, the BAR3s in the gap below the first, and one
            // more GPU's room: 2.5 TiB, inside the default window.
            assert_eq!(plan.mmio64_size, PCI_MMIO64_DEFAULT_SIZE, "{plan}");
            assert_eq!(plan.device_bars, 8 * (256 * GIB + (32 << 20)));
            assert_eq!(plan.hotplug_reserve, 256 * GIB + (32 << 20));
            let placed = check_fits(&plan, &devices);
            let bar1s: Vec<u64> = placed.iter().step_by(2).copied().collect();
            assert_eq!(bar1s, (1..=9).map(|i| i * 256 * GIB).collect::<Vec<_>>());
            assert_eq!(bars_span(plan.mmio64_start, &devices).1, 2556 * GIB);
            assert!(placed
                .iter()
                .skip(1)
                .step_by(2)
                .all(|&bar3| bar3 < 256 * GIB));
        }
    }

    #[test]
    fn eight_h100s_and_mixed_sizes() {
        let devices = vec![gpu(64 * GIB); 8];
        let plan = plan(&request(intel(46), &devices)).unwrap();
        // 64 GiB .. 576 GiB, one more: 640 GiB.
        assert_eq!(
            FOUR_GIB + bars_span(FOUR_GIB, &devices).1,
            640 * GIB,
            "{plan}"
        );
        check_fits(&plan, &devices);
        let mixed: Vec<Vec<u64>> = (0..8)
            .map(|i| gpu(if i % 2 == 0 { 64 * GIB } else { 256 * GIB }))
            .collect();
        let plan = super::plan(&request(intel(46), &mixed)).unwrap();
        check_fits(&plan, &mixed);
        // 4 x 256 + 4 x 64 GiB, one more 256 GiB, and the alignment waste stays below one
        // BAR1.
        assert!(
            bars_span(plan.mmio64_start, &mixed).1 < (5 * 256 + 4 * 64 + 256) * GIB,
            "{plan}"
        );
    }

    #[test]
    fn two_h200s_fit_where_the_fixed_window_did_not() {
        let devices = vec![gpu(256 * GIB); 2];
        // On a 40-bit host (1 TiB) the window is what the devices and the reserve need
        // (BAR1s at 256 and 512 GiB, room for a third at 768 GiB), not the default.
        let plan = plan(&request(intel(40), &devices)).unwrap();
        assert_eq!(
            (plan.mmio64_start, plan.mmio64_end()),
            (FOUR_GIB, 1024 * GIB)
        );
        check_fits(&plan, &devices);
        // Three do not fit there (a fourth's room would end at 1.25 TiB), with the numbers.
        let error = super::plan(&request(intel(40), &vec![gpu(256 * GIB); 3])).unwrap_err();
        assert!(error.to_string().contains("1 TiB"), "{error}");
        // Small devices still get at least the default.
        let small = vec![gpu(256 << 20); 2];
        let plan = super::plan(&request(intel(48), &small)).unwrap();
        assert_eq!(plan.mmio64_size, PCI_MMIO64_DEFAULT_SIZE);
    }

    #[test]
    fn amd_hosts_keep_the_hypertransport_hole_free() {
        // Two H100s and one more fit below the hole, but the default window does not: it
        // starts past the hole. On a 40-bit host (1 TiB, nothing past the hole) they stay
        // below it.
        let two = vec![gpu(64 * GIB); 2];
        let plan = plan(&request(amd(48), &two)).unwrap();
        assert_eq!(plan.mmio64_start, AMD_HT_HOLE_END, "{plan}");
        assert_eq!(plan.mmio64_size, PCI_MMIO64_DEFAULT_SIZE, "{plan}");
        check_fits(&plan, &two);
        let plan = super::plan(&request(amd(40), &two)).unwrap();
        assert_eq!(plan.mmio64_start, FOUR_GIB);
        assert!(plan.mmio64_end() <= AMD_HT_HOLE_START, "{plan}");
        check_fits(&plan, &two);
        // Two H200s and the room for a third would reach 1 TiB: past the hole.
        let two = vec![gpu(256 * GIB); 2];
        let plan = super::plan(&request(amd(48), &two)).unwrap();
        assert_eq!(plan.mmio64_start, AMD_HT_HOLE_END, "{plan}");
        check_fits(&plan, &two);
        // Eight would cross it: the window starts at 1 TiB.
        let eight = vec![gpu(256 * GIB); 8];
        let plan = super::plan(&request(amd(48), &eight)).unwrap();
        assert_eq!(plan.mmio64_start, AMD_HT_HOLE_END, "{plan}");
        assert_eq!(plan.mmio64_end(), AMD_HT_HOLE_END + PCI_MMIO64_DEFAULT_SIZE);
        check_fits(&plan, &eight);
        // Without devices on a host with little room past the hole (41 bits: 1 TiB there,
        // 896 GiB of it left by two more segments' windows), the window stays below the
        // hole (912 GiB), the larger of the two; the segments after it skip the hole.
        let mut with_segments = request(amd(41), &[]);
        with_segments.ram_top = 100 * GIB;
        with_segments.segments = 3;
        let plan = super::plan(&with_segments).unwrap();
        assert_eq!(plan.mmio64_start, 100 * GIB, "{plan}");
        assert_eq!(plan.mmio64_end(), AMD_HT_HOLE_START, "{plan}");
        assert_eq!(plan.segment_mmio64[0].0, AMD_HT_HOLE_END, "{plan}");
        assert!(plan
            .segment_mmio64
            .iter()
            .all(|&(s, size)| size == PCI_SEGMENT_MMIO64_SIZE && !overlaps_ht_hole(s, s + size)));
        // The same on Intel gets the whole default window, segments right after it.
        with_segments.host = intel(48);
        with_segments.ram_top = 600 * GIB;
        let plan = super::plan(&with_segments).unwrap();
        assert_eq!(plan.mmio64_size, PCI_MMIO64_DEFAULT_SIZE);
        assert_eq!(plan.segment_mmio64[0].0, plan.mmio64_end());
        // A 40-bit AMD host (1 TiB): nothing above the hole; the default window shrinks
        // below it.
        let plan = super::plan(&request(amd(40), &[])).unwrap();
        assert!(plan.mmio64_end() <= AMD_HT_HOLE_START && plan.mmio64_size >= 256 * GIB);
    }

    #[test]
    fn amd_hot_plug_room_across_the_hole_is_refused_and_ram_above_it_is_planned_past_it() {
        // Boot RAM past the hole (its third region ends past 1 TiB): planned above it.
        let mut big = request(amd(48), &[]);
        big.ram_top = AMD_HT_HOLE_END + 8 * GIB;
        big.ram_hotplug_size = 16 * GIB;
        let planned = plan(&big).unwrap();
        assert!(planned.ram_end >= big.ram_top + 16 * GIB);
        assert!(planned.mmio64_start >= planned.ram_end);
        // Room that would cross the hole: refused with the range.
        big.ram_top = 1000 * GIB;
        let error = plan(&big).unwrap_err();
        assert_eq!(
            error,
            PlanError::RamInHtHole {
                start: 1000 * GIB,
                end: 1016 * GIB
            }
        );
        assert!(error.to_string().contains("HyperTransport"), "{error}");
        // Boot RAM up to the hole with no room: its window goes past the hole.
        big.ram_top = AMD_HT_HOLE_START;
        big.ram_hotplug_size = 0;
        let planned = plan(&big).unwrap();
        assert!(!overlaps_ht_hole(
            planned.mmio64_start,
            planned.mmio64_end()
        ));
        big.host = intel(48);
        big.ram_top = 1000 * GIB;
        big.ram_hotplug_size = 16 * GIB;
        assert!(plan(&big).is_ok());
    }

    #[test]
    fn too_narrow_a_host_is_refused_with_the_numbers() {
        let eight = vec![gpu(256 * GIB); 8];
        let error = plan(&request(intel(41), &eight)).unwrap_err();
        let text = error.to_string();
        for needle in [
            "2556 GiB",
            "0x100000000..0x28000000000",
            "8 passthrough device(s) with 2048.25 GiB of 64-bit BARs, room for one more of 256.03 GiB",
            "41-bit physical address space (2 TiB)",
        ] {
            assert!(text.contains(needle), "{needle} in: {text}");
        }
        // 46 bits but an explicit window past it.
        let mut explicit = request(intel(36), &[]);
        explicit.mmio64_size = 64 * GIB;
        let text = plan(&explicit).unwrap_err().to_string();
        assert!(
            text.contains("36-bit physical address space (64 GiB)"),
            "{text}"
        );
        // A 52-bit host capped at 48 says so.
        let mut huge = request(intel(52), &[]);
        huge.mmio64_size = 300 * TIB;
        let text = plan(&huge).unwrap_err().to_string();
        assert!(text.contains("KVM reports 52 bits"), "{text}");
        // On AMD the refusal describes the window past the hole, where it would go: 42
        // bits hold it, 41 do not.
        assert!(plan(&request(amd(42), &eight)).is_ok());
        match plan(&request(amd(41), &eight)) {
            Err(PlanError::WindowTooHigh { start, .. }) => assert_eq!(start, AMD_HT_HOLE_END),
            other => panic!("{other:?}"),
        }
        // RAM alone past the width.
        let mut ram = request(intel(36), &[]);
        ram.ram_top = 80 * GIB;
        assert!(matches!(plan(&ram), Err(PlanError::RamTooHigh { .. })));
    }

    #[test]
    fn an_explicit_size_is_kept_and_checked_against_the_devices() {
        let devices = vec![gpu(64 * GIB); 2];
        let mut explicit = request(intel(48), &devices);
        explicit.mmio64_size = 1024 * GIB;
        let plan = plan(&explicit).unwrap();
        assert_eq!(plan.mmio64_size, 1024 * GIB);
        explicit.mmio64_size = 64 * GIB;
        assert_eq!(
            super::plan(&explicit).unwrap_err(),
            PlanError::WindowTooSmall {
                given: 64 * GIB,
                needed: 188 * GIB
            }
        );
    }

    #[test]
    fn a_fixed_window_is_kept_where_it_fits() {
        let mut restored = request(intel(48), &[]);
        restored.fixed_window = Some((1024 * GIB, 2048 * GIB));
        let plan = plan(&restored).unwrap();
        assert_eq!(
            (plan.mmio64_start, plan.mmio64_size),
            (1024 * GIB, 2048 * GIB)
        );
        restored.host = intel(41);
        let text = super::plan(&restored).unwrap_err().to_string();
        assert!(text.contains("snapshot"), "{text}");
    }

    /// Segments with root ports or switches cover more buses: the ECAM windows after them
    /// move up, and the other segments' 32-bit windows start after the last ECAM window
    /// once it reaches past their usual start; one bus each keeps the layout as it was.
    #[test]
    fn ecam_windows_follow_each_segments_buses() {
        use crate::x86_64::layout::{pci_segment_ecam, PCI_SEGMENTS_MMIO32_START};
        let mut three = request(intel(48), &[]);
        three.segments = 3;
        let planned = super::plan(&three).unwrap();
        let old: Vec<u64> = (0..3).map(pci_segment_ecam).collect();
        assert_eq!(planned.segment_ecam, old);
        assert_eq!(planned.segment_mmio32[0].0, PCI_SEGMENTS_MMIO32_START);

        let buses = [5, 3, 1];
        three.segment_buses = &buses;
        let planned = super::plan(&three).unwrap();
        assert_eq!(
            planned.segment_ecam,
            vec![0xe000_0000, 0xe050_0000, 0xe080_0000]
        );
        assert_eq!(planned.segment_mmio32[0].0, PCI_SEGMENTS_MMIO32_START);

        let buses = [12, 9, 2];
        three.segment_buses = &buses;
        let planned = super::plan(&three).unwrap();
        assert_eq!(
            planned.segment_ecam,
            vec![0xe000_0000, 0xe0c0_0000, 0xe150_0000]
        );
        let (start, end) = planned.segment_mmio32[0];
        assert!(start >= 0xe170_0000, "{start:#x}");
        assert!(planned.segment_mmio32[1].0 >= end);

        // One segment alone may use every bus (its ECAM ends at 0xf000_0000 at most).
        let mut one = request(intel(48), &[]);
        let buses = [256];
        one.segment_buses = &buses;
        assert_eq!(super::plan(&one).unwrap().segment_ecam, vec![0xe000_0000]);
        let buses = [200, 25];
        three.segment_buses = &buses;
        let error = super::plan(&three).unwrap_err().to_string();
        assert!(
            error.contains("ECAM windows of the 3 PCI segments take 226 MiB"),
            "{error}"
        );
        assert!(error.contains("than the 224 MiB left"), "{error}");
    }

    #[test]
    fn segments_follow_segment_zero_within_the_width() {
        let devices = vec![gpu(256 * GIB); 2];
        let mut three = request(intel(48), &devices);
        three.segments = 3;
        let plan = plan(&three).unwrap();
        // Without devices of their own, 64 GiB each, where the fixed layout had them.
        assert_eq!(
            plan.segment_mmio64,
            vec![
                (
                    pci_segment_mmio64_start(plan.mmio64_end(), 1),
                    PCI_SEGMENT_MMIO64_SIZE
                ),
                (
                    pci_segment_mmio64_start(plan.mmio64_end(), 2),
                    PCI_SEGMENT_MMIO64_SIZE
                )
            ]
        );
        assert_eq!(
            plan.segment_mmio32,
            vec![pci_segment_mmio32(1), pci_segment_mmio32(2)]
        );
        assert_eq!(plan.end, plan.segment_mmio64[1].0 + PCI_SEGMENT_MMIO64_SIZE);
        // The segments push a 40-bit host over: said so.
        three.host = intel(40);
        let text = super::plan(&three).unwrap_err().to_string();
        assert!(text.contains("2 more PCI segment window(s)"), "{text}");
    }

    /// Four H100-like GPUs on segment 0 and four on a NUMA node's segment 1: each
    /// segment's windows hold its own devices' BARs, aligned to their size (a 64 GiB
    /// window, the fixed size, held none of them: BAR1 alone fills it), and room for one
    /// more of them (hot-plug onto the node's segment); a segment without devices keeps
    /// the fixed sizes.
    #[test]
    fn a_node_segments_windows_are_sized_from_its_devices() {
        let h100 = gpu(64 * GIB);
        let h100_bar0 = vec![16u64 << 20];
        let on_zero = vec![h100.clone(); 4];
        let node_one = SegmentBars {
            mmio64: vec![h100.clone(); 4],
            mmio32: vec![h100_bar0.clone(); 4],
        };
        let bars = [node_one.clone(), SegmentBars::default()];
        let mut request = request(intel(46), &on_zero);
        request.segments = 3;
        request.segment_bars = &bars;
        let plan = plan(&request).unwrap();
        let (start1, size1) = plan.segment_mmio64[0];
        assert!(start1 >= plan.mmio64_end(), "{plan:?}");
        let mut window = BarAllocator::new("64-bit", start1, start1 + size1);
        for bars in &node_one.mmio64 {
            let mut sizes = bars.clone();
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            for size in sizes {
                let at = window.allocate(size).expect("segment 1's window holds it");
                assert_eq!(at % size, 0);
            }
        }
        // Four BAR1s and the fifth's room, the first BAR3 after the first BAR1 (pushing
        // the next BAR1s one alignment on) and the others in the gap it leaves: 384 GiB,
        // not more.
        assert_eq!(size1, 384 * GIB, "{plan:?}");
        for size in [64 * GIB, 32 << 20] {
            let at = window.allocate(size).expect("room for a fifth GPU");
            assert_eq!(at % size, 0);
        }
        assert_eq!(
            plan.segment_mmio64[1],
            (start1 + size1, PCI_SEGMENT_MMIO64_SIZE)
        );
        assert_eq!(plan.end, start1 + size1 + PCI_SEGMENT_MMIO64_SIZE);
        // Below 4 GiB: 80 MiB for the four BAR0s and a fifth's, then segment 2's 16 MiB
        // after it.
        assert_eq!(
            plan.segment_mmio32,
            vec![
                (
                    PCI_SEGMENTS_MMIO32_START,
                    PCI_SEGMENTS_MMIO32_START + (80 << 20)
                ),
                (
                    PCI_SEGMENTS_MMIO32_START + (80 << 20),
                    PCI_SEGMENTS_MMIO32_START + (96 << 20)
                )
            ]
        );
        // Too many 32-bit BARs for the room below 4 GiB: refused with the numbers.
        let crowded = [SegmentBars {
            mmio64: Vec::new(),
            mmio32: vec![h100_bar0; 16],
        }];
        request.segments = 2;
        request.segment_bars = &crowded;
        let error = super::plan(&request).unwrap_err();
        assert!(
            matches!(error, PlanError::Mmio32TooSmall { segment: 1, needed, .. } if needed == 256 << 20),
            "{error:?}"
        );
        assert!(error.to_string().contains("240 MiB"), "{error}");
        // Eight H200s, four on each segment: too wide for a 41-bit host (2 TiB), with the
        // numbers; a 42-bit one holds them.
        let h200s = vec![gpu(256 * GIB); 4];
        let node_one = [SegmentBars {
            mmio64: h200s.clone(),
            mmio32: Vec::new(),
        }];
        let mut eight = super::tests::request(intel(41), &h200s);
        eight.segments = 2;
        eight.segment_bars = &node_one;
        let text = super::plan(&eight).unwrap_err().to_string();
        // Placed device by device as the root places them, the BAR3s after the first
        // BAR1 push each next BAR1 one alignment further: five BAR1s of room, and a
        // sixth for hot-plug onto the segment.
        assert!(
            text.contains("1 more PCI segment window(s) of 1536 GiB in all"),
            "{text}"
        );
        eight.host = intel(42);
        let plan = super::plan(&eight).unwrap();
        assert_eq!(plan.segment_mmio64[0].0 % (256 * GIB), 0, "{plan:?}");
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(64 * TIB), "64 TiB");
        assert_eq!(human(1020 * GIB), "1020 GiB");
        assert_eq!(human(512 << 20), "512 MiB");
        assert_eq!(human(256 * GIB + (32 << 20)), "256.03 GiB");
        assert_eq!(human(3), "3 bytes");
    }
}
