//! A passthrough PCI function: BARs, the ROM BAR and MSI-X are emulated here; every other
//! configuration register goes to the device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuvm_devices::pci::{
    config, BarKind, BarSet, BarSpec, GuestMemoryMapper, MsiRouting, MsixCapability, MsixTable,
    PciBar, PciDevice,
};
use vmm_sys_util::eventfd::EventFd;

use crate::dma::{BarPlacementWatch, BarWindow, DmaProgress};
use crate::migration::{MigrationInfo, MigrationState};
use crate::msi::{MsiChange, MsiState, CAP_ID_MSI};
use crate::{region, DmaRegion, PassthroughDevice, Result, VfioError};
use gpuvm_devices::Persist;

/// GSIs and their eventfds for `count` MSI-X vectors; the VMM registers each eventfd as an
/// irqfd on its GSI.
pub type VectorAllocator<'a> = &'a mut dyn FnMut(u32) -> std::io::Result<Vec<(u32, EventFd)>>;

struct Msix {
    capability: MsixCapability,
    table: MsixTable,
    eventfds: Vec<EventFd>,
}

const PAGE: u64 = 4096;
/// BAR parts at least this large are mmapped at a host address aligned to it, as their
/// guest addresses are, so KVM and the host can map them with 1 GiB PFN mappings.
pub(crate) const HUGE_BAR_ALIGN: u64 = 1 << 30;

/// Where an aligned mapping of `len` bytes goes inside a reservation of
/// `len + align` bytes at `reserved`: `(aligned start, bytes before it, bytes after it)`,
/// the two ends to give back. `align` is a power of two.
fn aligned_in_reservation(reserved: u64, len: u64, align: u64) -> (u64, u64, u64) {
    let aligned = reserved.next_multiple_of(align);
    let head = aligned - reserved;
    let tail = (reserved + len + align) - (aligned + len);
    (aligned, head, tail)
}

/// Mmaps `len` bytes of `fd` at `offset` shared and writable, as a BAR part is mapped; a
/// part of [`HUGE_BAR_ALIGN`] or more lands on a host address aligned to it (an
/// over-sized inaccessible reservation first, then the mapping fixed inside it at the
/// aligned address, then the reservation's ends given back).
pub(crate) fn mmap_bar_part(
    fd: std::os::fd::RawFd,
    offset: u64,
    len: usize,
) -> std::io::Result<*mut u8> {
    let map = |address: *mut libc::c_void, flags: libc::c_int| {
        // SAFETY: either a fresh mapping where the kernel picks (null address), or a fixed
        // one over a part of our own inaccessible reservation that nothing else uses; the
        // kernel checks the fd, offset and length.
        let mapped = unsafe {
            libc::mmap(
                address,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | flags,
                fd,
                offset as libc::off_t,
            )
        };
        if mapped == libc::MAP_FAILED {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(mapped.cast::<u8>())
        }
    };
    if (len as u64) < HUGE_BAR_ALIGN {
        return map(std::ptr::null_mut(), 0);
    }
    let reserved_len = len + HUGE_BAR_ALIGN as usize;
    // SAFETY: a fresh private inaccessible mapping where the kernel picks: no existing
    // memory changes and nothing can touch it.
    let reserved = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserved_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if reserved == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let (aligned, head, tail) = aligned_in_reservation(reserved as u64, len as u64, HUGE_BAR_ALIGN);
    let give_back = |start: u64, bytes: u64| {
        if bytes > 0 {
            // SAFETY: `start..start + bytes` is a part of our own reservation that holds
            // nothing (an end outside the aligned mapping, or all of it after a failure).
            unsafe { libc::munmap(start as *mut libc::c_void, bytes as usize) };
        }
    };
    match map(aligned as *mut libc::c_void, libc::MAP_FIXED) {
        Ok(mapped) => {
            give_back(reserved as u64, head);
            give_back(aligned + len as u64, tail);
            Ok(mapped)
        }
        Err(error) => {
            give_back(reserved as u64, reserved_len as u64);
            Err(error)
        }
    }
}
/// Command register bit 2: the device may master the bus (DMA, and MSI writes).
const COMMAND_BUS_MASTER: u8 = 1 << 2;
/// x86-64's architectural limit on physical addresses (52 bits).
const MAX_GUEST_PHYS: u64 = 1 << 52;

/// An mmapped part of a BAR and where it is mapped in the guest now.
struct BarMapping {
    bar: u8,
    offset: u64,
    size: u64,
    host: u64,
    /// (mapper handle, guest address) while mapped.
    mapped: Option<(u32, u64)>,
    /// Where the guest has it (its BAR placed, memory decoding on), mapped or not.
    wanted: Option<u64>,
}

/// The legacy INTx line. It is on in the backend only while neither MSI nor MSI-X is
/// (vfio-pci allows one interrupt type at a time).
struct Intx {
    gsi: u32,
    /// The Interrupt Line register: firmware (the VMM) writes the GSI, the guest may
    /// overwrite it; it is only a note for the guest.
    line: u8,
    trigger: EventFd,
    active: bool,
}

/// Turns INTx on or off in the backend if it is not already.
fn switch_intx(backend: &mut dyn PassthroughDevice, intx: &mut Option<Intx>, on: bool, name: &str) {
    let Some(intx) = intx.as_mut() else {
        return;
    };
    if intx.active == on {
        return;
    }
    let result = if on {
        backend.enable_intx(&intx.trigger)
    } else {
        backend.disable_intx()
    };
    match result {
        Ok(()) => {
            intx.active = on;
            log::debug!(
                "{name}: INTx (GSI {}) {}",
                intx.gsi,
                if on { "on" } else { "off" }
            );
        }
        Err(error) => log::warn!("{name}: cannot switch INTx: {error}"),
    }
}

/// A PCI function backed by a [`PassthroughDevice`].
pub struct VfioPciDevice {
    /// Vendor id (low half) and device id (high half).
    ids: u32,
    backend: Box<dyn PassthroughDevice>,
    bars: BarSet,
    msix: Option<Msix>,
    msi: Option<MsiState>,
    intx: Option<Intx>,
    name: String,
    mapper: Option<std::sync::Arc<dyn GuestMemoryMapper>>,
    mappings: Vec<BarMapping>,
    /// Guest RAM being DMA-mapped for this device in the background, and how long a guest
    /// write setting Bus Master may wait for it.
    dma_gate: Option<(Arc<DmaProgress>, Duration)>,
    /// Told where the mmapped BAR parts are whenever that changes (peer-to-peer DMA).
    bar_watch: Option<Arc<dyn BarPlacementWatch>>,
    /// The GPUDirect clique capability gpuvm shows the guest, when it shows one.
    gpudirect: Option<GpuDirectCapability>,
}

impl VfioPciDevice {
    /// Resets the device (the backend picks the method and refuses a device that does not
    /// come back: [`crate::reset`]), reads its BARs and MSI-X capability, and allocates one
    /// GSI per MSI-X vector through `allocate`.
    pub fn new(
        mut backend: Box<dyn PassthroughDevice>,
        allocate: VectorAllocator<'_>,
        router: Arc<dyn MsiRouting>,
    ) -> Result<Self> {
        backend.reset()?;
        Self::over_running(backend, allocate, router)
    }

    /// As [`VfioPciDevice::new`] without the reset: the device runs on as it is (a live
    /// update takes over a device another gpuvm process set up; its saved PCI state, loaded
    /// with `Persist::restore`, gives it this process's interrupts).
    pub fn over_running(
        mut backend: Box<dyn PassthroughDevice>,
        allocate: VectorAllocator<'_>,
        router: Arc<dyn MsiRouting>,
    ) -> Result<Self> {
        let name = backend.name();
        let ids = read_config32(backend.as_mut(), config::VENDOR_ID)?;
        if ids & 0xffff == 0xffff || ids & 0xffff == 0 {
            return Err(VfioError::NotPci(format!(
                "{name}: vendor id reads {:#06x}",
                ids & 0xffff
            )));
        }
        let bars = BarSet::new(&bar_specs(backend.as_mut())?);
        let msix = match find_capability(backend.as_mut(), config::CAP_ID_MSIX)? {
            None => None,
            Some(offset) => {
                let mut dwords = [0u32; 3];
                for (i, dword) in dwords.iter_mut().enumerate() {
                    *dword = read_config32(backend.as_mut(), offset + 4 * i as u16)?;
                }
                let capability = MsixCapability::parse(offset, dwords);
                let vectors = u32::from(capability.vectors).min(backend.msix_vectors()?);
                let allocated = allocate(vectors).map_err(VfioError::Interrupts)?;
                let (gsis, eventfds): (Vec<u32>, Vec<EventFd>) = allocated.into_iter().unzip();
                log::info!(
                    "{name}: MSI-X with {vectors} vector(s), table in BAR{} at {:#x}, GSIs {gsis:?}",
                    capability.table_bar,
                    capability.table_offset
                );
                Some(Msix {
                    capability,
                    table: MsixTable::new(gsis, router.clone()),
                    eventfds,
                })
            }
        };
        let msi = match find_capability(backend.as_mut(), CAP_ID_MSI)? {
            None => None,
            Some(offset) => {
                let mut capability = [0u8; 24];
                for (i, chunk) in capability.chunks_mut(4).enumerate() {
                    let dword = read_config32(backend.as_mut(), offset + 4 * i as u16)?;
                    chunk.copy_from_slice(&dword.to_le_bytes());
                }
                let vectors = allocate(MsiState::capable_vectors(&capability))
                    .map_err(VfioError::Interrupts)?;
                log::info!("{name}: MSI with {} vector(s)", vectors.len());
                Some(MsiState::new(offset, capability, vectors, router))
            }
        };
        Ok(VfioPciDevice {
            ids,
            backend,
            bars,
            msix,
            msi,
            intx: None,
            name,
            mapper: None,
            mappings: Vec::new(),
            dma_gate: None,
            bar_watch: None,
            gpudirect: None,
        })
    }

    /// Holds back Bus Master until `progress` says all guest RAM is mapped: the guest's
    /// config write that sets it stalls (its vCPU waits, at most `limit`) until the map is
    /// complete, so the device can never DMA into RAM that is not mapped yet. If the map
    /// failed or is still not done after `limit`, the bit is refused: written as 0 to the
    /// device (a read of the command register shows it clear), an error is logged and
    /// counted in `progress`.
    pub fn gate_bus_master(&mut self, progress: Arc<DmaProgress>, limit: Duration) {
        self.dma_gate = Some((progress, limit));
    }

    /// Tells `watch` where the mmapped BAR parts are now, and again after every BAR move
    /// or memory-decoding change (all unplaced when the device is dropped).
    pub fn watch_bar_placement(&mut self, watch: Arc<dyn BarPlacementWatch>) {
        self.bar_watch = Some(watch);
        self.report_bar_placement(false);
    }

    fn report_bar_placement(&self, dropping: bool) {
        let Some(watch) = &self.bar_watch else {
            return;
        };
        let windows: Vec<BarWindow> = self
            .mappings
            .iter()
            .map(|m| BarWindow {
                bar: m.bar,
                offset: m.offset,
                size: m.size,
                host_addr: m.host,
                guest_addr: m.wanted.filter(|_| !dropping),
            })
            .collect();
        if dropping {
            watch.gone(&windows);
        } else {
            watch.placed(&windows);
        }
    }

    /// Whether a guest write may set Bus Master now; waits for the mapping if need be.
    fn bus_master_allowed(&mut self) -> bool {
        let Some((progress, limit)) = &self.dma_gate else {
            return true;
        };
        if progress.is_done() {
            return true;
        }
        let started = Instant::now();
        log::info!(
            "{}: the guest sets Bus Master while guest RAM is still being DMA-mapped ({} of {} MiB): holding its vCPU until the map is complete",
            self.name,
            progress.mapped_bytes() >> 20,
            progress.total_bytes() >> 20
        );
        match progress.wait(*limit) {
            Ok(()) => {
                log::info!(
                    "{}: guest RAM is mapped; Bus Master goes through after {:?}",
                    self.name,
                    started.elapsed()
                );
                true
            }
            Err(error) => {
                progress.note_bus_master_refused();
                log::error!(
                    "{}: Bus Master refused: guest RAM is not DMA-mapped for the device ({error})",
                    self.name
                );
                false
            }
        }
    }

    /// Mmaps the BAR parts the backend allows (never the pages holding the MSI-X table or
    /// PBA, which must trap) and keeps them mapped into the guest wherever the guest puts
    /// the BARs. Returns how many bytes are mapped.
    pub fn map_bars(&mut self, mapper: Arc<dyn GuestMemoryMapper>) -> Result<u64> {
        let mut total = 0;
        for spec in self.bars.specs() {
            if spec.kind == BarKind::Rom {
                continue;
            }
            let Some(info) = self.backend.region_info(u32::from(spec.index)) else {
                continue;
            };
            if info.flags & crate::REGION_MMAP == 0 {
                continue;
            }
            let areas = if info.mmap_areas.is_empty() {
                vec![(0, info.size)]
            } else {
                info.mmap_areas.clone()
            };
            for (offset, size) in self.split_around_msix(spec.index, &areas) {
                let Some(host) = self
                    .backend
                    .mmap_region(u32::from(spec.index), offset, size)?
                else {
                    continue;
                };
                total += size;
                log::debug!(
                    "{}: BAR{} +{offset:#x} ({size:#x} bytes) mapped at host {:#x}",
                    self.name,
                    spec.index,
                    host as u64
                );
                self.mappings.push(BarMapping {
                    bar: spec.index,
                    offset,
                    size,
                    host: host as u64,
                    mapped: None,
                    wanted: None,
                });
            }
        }
        self.mapper = Some(mapper);
        self.sync_guest_mappings();
        Ok(total)
    }

    /// `areas` of `bar`, page aligned, minus the pages of the MSI-X table and PBA.
    fn split_around_msix(&self, bar: u8, areas: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut holes = Vec::new();
        if let Some(msix) = &self.msix {
            let cap = msix.capability;
            if cap.table_bar == bar {
                holes.push((cap.table_offset, cap.table_offset + cap.table_len()));
            }
            if cap.pba_bar == bar {
                holes.push((cap.pba_offset, cap.pba_offset + cap.pba_len()));
            }
        }
        let holes: Vec<(u64, u64)> = holes
            .into_iter()
            .map(|(start, end)| (start / PAGE * PAGE, end.div_ceil(PAGE) * PAGE))
            .collect();
        let mut pieces = Vec::new();
        for &(offset, size) in areas {
            let mut start = offset.div_ceil(PAGE) * PAGE;
            let end = (offset + size) / PAGE * PAGE;
            let mut cuts: Vec<(u64, u64)> = holes
                .iter()
                .copied()
                .filter(|&(h_start, h_end)| h_start < end && h_end > start)
                .collect();
            cuts.sort();
            for (h_start, h_end) in cuts {
                if h_start > start {
                    pieces.push((start, h_start - start));
                }
                start = start.max(h_end);
            }
            if end > start {
                pieces.push((start, end - start));
            }
        }
        pieces
    }

    /// Moves the guest mappings to where the active BARs are now.
    fn sync_guest_mappings(&mut self) {
        let Some(mapper) = self.mapper.clone() else {
            return;
        };
        let active = self.bars.active();
        let mut moved = false;
        for mapping in &mut self.mappings {
            // While the guest sizes a 64-bit BAR its address is all ones: past any physical
            // address width, so there is nothing to map until it writes the address back.
            let wanted = active
                .iter()
                .find(|bar| bar.index == mapping.bar && bar.address + bar.size <= MAX_GUEST_PHYS)
                .map(|bar| bar.address + mapping.offset);
            moved |= mapping.wanted != wanted;
            mapping.wanted = wanted;
            if mapping.mapped.map(|(_, at)| at) == wanted {
                continue;
            }
            if let Some((handle, at)) = mapping.mapped.take() {
                if let Err(error) = mapper.unmap(handle) {
                    log::warn!(
                        "{}: cannot unmap BAR{} at {at:#x}: {error}",
                        self.name,
                        mapping.bar
                    );
                }
            }
            if let Some(at) = wanted {
                match mapper.map(at, mapping.size, mapping.host) {
                    Ok(handle) => mapping.mapped = Some((handle, at)),
                    Err(error) => log::warn!(
                        "{}: cannot map BAR{} +{:#x} at {at:#x}: {error}; accesses will trap",
                        self.name,
                        mapping.bar,
                        mapping.offset
                    ),
                }
            }
        }
        if moved {
            self.report_bar_placement(false);
        }
    }

    /// Maps guest RAM for the device's DMA synchronously (the VMM maps in the background
    /// instead, see [`VfioPciDevice::gate_bus_master`]).
    pub fn dma_map(&mut self, regions: &[DmaRegion]) -> Result<()> {
        for region in regions {
            self.backend.dma_map(region)?;
        }
        Ok(())
    }

    /// Vendor and device id, as read when the device was opened.
    pub fn pci_ids(&self) -> (u16, u16) {
        (self.ids as u16, (self.ids >> 16) as u16)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Interrupt Pin register (1..4 for INTA..INTD, 0 for none).
    pub fn interrupt_pin(&mut self) -> u8 {
        let mut pin = [0u8];
        match self
            .backend
            .region_read(region::CONFIG, u64::from(config::INTERRUPT_PIN), &mut pin)
        {
            Ok(()) if pin[0] <= 4 => pin[0],
            _ => 0,
        }
    }

    /// Wires the device's INTx to `trigger` (which the VMM made an irqfd on `gsi`) when the
    /// device has an interrupt pin; returns whether it did. INTx is on until the guest
    /// enables MSI or MSI-X, and again once it disables them.
    pub fn attach_intx(&mut self, gsi: u32, trigger: EventFd) -> Result<bool> {
        if self.interrupt_pin() == 0 || !self.backend.intx_supported() {
            return Ok(false);
        }
        self.intx = Some(Intx {
            gsi,
            line: u8::try_from(gsi).unwrap_or(0xff),
            trigger,
            active: false,
        });
        self.update_intx();
        // With MSI or MSI-X on (a device taken over running) INTx stays off until they go.
        let msi_on = self.msix.as_ref().is_some_and(|m| m.table.enabled())
            || self.msi.as_ref().is_some_and(|m| m.enabled());
        if !msi_on && !self.intx.as_ref().is_some_and(|i| i.active) {
            return Err(VfioError::Interrupts(std::io::Error::other(
                "the device refused its INTx eventfd",
            )));
        }
        log::info!("{}: INTx on GSI {gsi}", self.name);
        Ok(true)
    }

    /// The guest's INTERRUPT_LINE as `state` saved it, for INTx wired after the state was
    /// loaded (a device taken over running: [`VfioPciDevice::attach_intx`] then).
    pub fn restore_intx_line(&mut self, state: &VfioPciState) {
        if let (Some(intx), Some(line)) = (self.intx.as_mut(), state.intx_line) {
            intx.line = line;
        }
    }

    /// Gives the backend this device's interrupt eventfds again as they are now: a live
    /// update that failed after the new process had given the device its own.
    pub fn rearm_interrupts(&mut self) -> Result<()> {
        if let Some(msix) = self.msix.as_ref().filter(|m| m.table.enabled()) {
            let fds: Vec<&EventFd> = msix.eventfds.iter().collect();
            self.backend.enable_msix(&fds)?;
        }
        if let Some(msi) = self.msi.as_ref().filter(|m| m.enabled()) {
            let fds: Vec<&EventFd> = msi.eventfds.iter().take(msi.active_vectors()).collect();
            self.backend.enable_msi(&fds)?;
        }
        if let Some(intx) = self.intx.as_ref().filter(|i| i.active) {
            self.backend.enable_intx(&intx.trigger)?;
        }
        Ok(())
    }

    /// The GSI its INTx is wired to, if it is.
    pub fn intx_gsi(&self) -> Option<u32> {
        self.intx.as_ref().map(|intx| intx.gsi)
    }

    /// The guest ended a level-triggered INTx (KVM's resample eventfd fired): unmask the
    /// device's line so it can fire again.
    pub fn intx_resampled(&mut self) {
        if self.intx.as_ref().is_some_and(|i| i.active) {
            if let Err(error) = self.backend.unmask_intx() {
                log::warn!("{}: cannot unmask INTx: {error}", self.name);
            }
        }
    }

    /// INTx on exactly when neither MSI nor MSI-X is enabled.
    fn update_intx(&mut self) {
        let msi_on = self.msix.as_ref().is_some_and(|m| m.table.enabled())
            || self.msi.as_ref().is_some_and(|m| m.enabled());
        switch_intx(self.backend.as_mut(), &mut self.intx, !msi_on, &self.name);
    }

    fn msix_control_bytes(&self, offset: u16, len: usize) -> Option<(u16, u16)> {
        let msix = self.msix.as_ref()?;
        let control = msix.capability.control_offset();
        let end = offset + len as u16;
        (offset < control + 2 && end > control).then_some((control, msix.table.control()))
    }

    fn set_msix_control(&mut self, offset: u16, data: &[u8]) {
        let Some(msix) = self.msix.as_mut() else {
            return;
        };
        let control_offset = msix.capability.control_offset();
        let mut bytes = msix.table.control().to_le_bytes();
        for (i, byte) in data.iter().enumerate() {
            let at = offset + i as u16;
            if (control_offset..control_offset + 2).contains(&at) {
                bytes[usize::from(at - control_offset)] = *byte;
            }
        }
        if !msix.table.set_control(u16::from_le_bytes(bytes)) {
            return;
        }
        if msix.table.enabled() {
            switch_intx(self.backend.as_mut(), &mut self.intx, false, &self.name);
        }
        let result = if msix.table.enabled() {
            let fds: Vec<&EventFd> = msix.eventfds.iter().collect();
            self.backend.enable_msix(&fds)
        } else {
            self.backend.disable_msix()
        };
        match result {
            Ok(()) => log::info!(
                "{}: MSI-X {}",
                self.name,
                if msix.table.enabled() {
                    "enabled"
                } else {
                    "disabled"
                }
            ),
            Err(error) => log::warn!("{}: cannot switch MSI-X: {error}", self.name),
        }
        self.update_intx();
    }

    /// Which part of the MSI-X structures `[offset, offset + len)` of `bar` hits.
    fn msix_target(&self, bar: u8, offset: u64, len: usize) -> Option<MsixPart> {
        let cap = self.msix.as_ref()?.capability;
        let within = |start: u64, size: u64| offset >= start && offset + len as u64 <= start + size;
        if bar == cap.table_bar && within(cap.table_offset, cap.table_len()) {
            Some(MsixPart::Table(offset - cap.table_offset))
        } else if bar == cap.pba_bar && within(cap.pba_offset, cap.pba_len()) {
            Some(MsixPart::Pba(offset - cap.pba_offset))
        } else {
            None
        }
    }
}

enum MsixPart {
    Table(u64),
    Pba(u64),
}

/// What gpuvm emulates of a passthrough function's PCI state (BAR addresses, memory
/// decoding, the MSI-X table and control, the MSI capability, the INTx line register):
/// the part a snapshot carries beside the device's own migration data, which holds the
/// rest of its configuration space.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VfioPciState {
    /// (BAR index, guest-physical address) of each BAR, the ROM BAR included.
    pub bars: Vec<(u8, u64)>,
    pub memory_enabled: bool,
    /// The MSI-X Message Control register, when the device has MSI-X.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub msix_control: Option<u16>,
    /// The whole MSI-X table as the guest wrote it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub msix_table: Vec<u8>,
    /// The MSI capability's bytes as the guest sees them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub msi_capability: Vec<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intx_line: Option<u8>,
    /// The clique of the GPUDirect capability the guest saw (None: it saw none; snapshots
    /// from before the capability existed load as None).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpudirect_clique: Option<u8>,
}

impl VfioPciDevice {
    /// Whether (and how) the device can save its internal state.
    pub fn migration(&mut self) -> Option<MigrationInfo> {
        self.backend.migration()
    }

    /// Saves the device's internal state into `out` (the device is left stopped; see
    /// [`crate::migration::save_device_state`]).
    pub fn save_device_state(&mut self, out: &mut dyn std::io::Write, limit: u64) -> Result<u64> {
        crate::migration::save_device_state(self.backend.as_mut(), out, limit)
    }

    /// Loads a saved internal state into this freshly opened device (left stopped).
    pub fn load_device_state(&mut self, input: &mut dyn std::io::Read, len: u64) -> Result<()> {
        crate::migration::load_device_state(self.backend.as_mut(), input, len)
    }

    /// Moves the device to `state` (RUNNING after a save or a load).
    pub fn set_migration_state(&mut self, state: MigrationState) -> Result<()> {
        self.backend.set_migration_state(state)
    }
}

/// Why a saved [`VfioPciState`] does not fit the passthrough function it is loaded into.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VfioPciStateError {
    #[error("{device}: the saved BAR {index} is not one of this device's")]
    UnknownBar { device: String, index: u8 },
    #[error("{device}: the saved MSI-X table is {saved} bytes, this device's is {now}")]
    MsixTableSize {
        device: String,
        saved: usize,
        now: u64,
    },
    #[error("{device}: the saved state {} an MSI-X capability, this device {}", has(*saved), has(*now))]
    MsixCapability {
        device: String,
        saved: bool,
        now: bool,
    },
    #[error("{device}: the saved state has an MSI capability, this device has none")]
    NoMsiCapability { device: String },
    #[error("{device}: the saved MSI capability is {len} bytes, not 4 to 24")]
    MsiCapabilityLength { device: String, len: usize },
}

fn has(yes: bool) -> &'static str {
    if yes {
        "has"
    } else {
        "has no"
    }
}

impl Persist for VfioPciDevice {
    type State = VfioPciState;
    type Error = VfioPciStateError;

    /// The emulated part of the function's PCI state (the device's own state is its
    /// migration data, [`VfioPciDevice::save_device_state`]).
    fn save(&self) -> std::result::Result<VfioPciState, VfioPciStateError> {
        let mut state = VfioPciState {
            bars: self
                .bars
                .placed()
                .iter()
                .map(|bar| (bar.index, bar.address))
                .collect(),
            memory_enabled: self.bars.memory_enabled(),
            intx_line: self.intx.as_ref().map(|intx| intx.line),
            gpudirect_clique: self.gpudirect.map(|capability| capability.clique),
            ..VfioPciState::default()
        };
        if let Some(msix) = &self.msix {
            state.msix_control = Some(msix.table.control());
            let mut table = vec![0u8; msix.capability.table_len() as usize];
            for (i, entry) in table.chunks_mut(4).enumerate() {
                msix.table.read_table(4 * i as u64, entry);
            }
            state.msix_table = table;
        }
        if let Some(msi) = &self.msi {
            let mut bytes = vec![0u8; usize::from(msi.byte_len())];
            msi.read(msi.offset, &mut bytes);
            state.msi_capability = bytes;
        }
        Ok(state)
    }

    /// Loads the emulated PCI state of a snapshot into this device, which the PCI root
    /// has placed at the saved BAR addresses: the same paths as the guest's own writes
    /// (MSI-X and MSI routes, the backend's interrupts, BAR mappings into the guest).
    /// A state that does not fit this device (another MSI-X table size, a missing
    /// capability) is refused before anything changes.
    fn restore(&mut self, state: &VfioPciState) -> std::result::Result<(), VfioPciStateError> {
        self.check_state(state)?;
        for &(index, address) in &state.bars {
            self.bars.set_address(index, address);
        }
        self.bars.set_memory_enabled(state.memory_enabled);
        self.sync_guest_mappings();
        if let (Some(msix), Some(control)) = (&mut self.msix, state.msix_control) {
            for (i, entry) in state.msix_table.chunks(4).enumerate() {
                msix.table.write_table(4 * i as u64, entry);
            }
            let offset = msix.capability.control_offset();
            self.set_msix_control(offset, &control.to_le_bytes());
        }
        if let (false, Some(offset)) = (
            state.msi_capability.is_empty(),
            self.msi.as_ref().map(|msi| msi.offset),
        ) {
            let bytes = &state.msi_capability;
            // Address, data and masks first; the control word (which enables) last.
            self.config_write(offset + 4, &bytes[4..]);
            self.config_write(offset, &bytes[..4]);
        }
        if let (Some(intx), Some(line)) = (self.intx.as_mut(), state.intx_line) {
            intx.line = line;
        }
        self.update_intx();
        self.restore_gpudirect(state.gpudirect_clique);
        Ok(())
    }
}

impl VfioPciDevice {
    fn check_state(&self, state: &VfioPciState) -> std::result::Result<(), VfioPciStateError> {
        let device = || self.name.clone();
        if let Some(&(index, _)) = state
            .bars
            .iter()
            .find(|(index, _)| !self.bars.specs().iter().any(|spec| spec.index == *index))
        {
            return Err(VfioPciStateError::UnknownBar {
                device: device(),
                index,
            });
        }
        match (&self.msix, state.msix_control) {
            (None, None) => {}
            (Some(msix), Some(_)) => {
                if state.msix_table.len() as u64 != msix.capability.table_len() {
                    return Err(VfioPciStateError::MsixTableSize {
                        device: device(),
                        saved: state.msix_table.len(),
                        now: msix.capability.table_len(),
                    });
                }
            }
            (now, saved) => {
                return Err(VfioPciStateError::MsixCapability {
                    device: device(),
                    saved: saved.is_some(),
                    now: now.is_some(),
                })
            }
        }
        if !state.msi_capability.is_empty() {
            if self.msi.is_none() {
                return Err(VfioPciStateError::NoMsiCapability { device: device() });
            }
            let len = state.msi_capability.len();
            if !(4..=24).contains(&len) {
                return Err(VfioPciStateError::MsiCapabilityLength {
                    device: device(),
                    len,
                });
            }
        }
        Ok(())
    }
}

fn read_config32(backend: &mut dyn PassthroughDevice, offset: u16) -> Result<u32> {
    let mut data = [0u8; 4];
    backend.region_read(region::CONFIG, u64::from(offset), &mut data)?;
    Ok(u32::from_le_bytes(data))
}

/// BARs from the region sizes and the type bits the device reports in its BAR registers
/// (what [`VfioPciDevice::new`] gives the device; the VMM also reads them before it plugs
/// the device, to size the 64-bit BAR window).
pub fn bar_specs(backend: &mut dyn PassthroughDevice) -> Result<Vec<BarSpec>> {
    let mut specs = Vec::new();
    let mut index = 0u8;
    while index < 6 {
        let size = backend.region_info(u32::from(index)).map_or(0, |r| r.size);
        if size == 0 {
            index += 1;
            continue;
        }
        let register = read_config32(backend, config::BAR0 + 4 * u16::from(index))?;
        let size = size.max(16).next_power_of_two();
        if register & 1 == 1 {
            log::warn!("{}: I/O BAR{index} is not passed through", backend.name());
            index += 1;
            continue;
        }
        let prefetchable = register & 0b1000 != 0;
        if register & 0b110 == 0b100 {
            specs.push(BarSpec {
                index,
                size,
                kind: BarKind::Memory64 { prefetchable },
            });
            index += 2;
        } else {
            specs.push(BarSpec {
                index,
                size,
                kind: BarKind::Memory32 { prefetchable },
            });
            index += 1;
        }
    }
    if let Some(rom) = backend.region_info(region::ROM).filter(|r| r.size > 0) {
        specs.push(BarSpec {
            index: region::ROM as u8,
            size: rom.size.max(2048).next_power_of_two(),
            kind: BarKind::Rom,
        });
    }
    Ok(specs)
}

/// Walks the standard capability list for `id`.
fn find_capability(backend: &mut dyn PassthroughDevice, id: u8) -> Result<Option<u16>> {
    let status = read_config32(backend, config::COMMAND)? >> 16;
    if status as u16 & config::STATUS_CAPABILITIES == 0 {
        return Ok(None);
    }
    let mut pointer = (read_config32(backend, config::CAPABILITIES_POINTER)? & 0xfc) as u16;
    // At most 48 capabilities fit in 192 bytes; a longer chain is a loop.
    for _ in 0..48 {
        if pointer < 0x40 {
            return Ok(None);
        }
        let header = read_config32(backend, pointer)?;
        if header as u8 == id {
            return Ok(Some(pointer));
        }
        pointer = ((header >> 8) & 0xfc) as u16;
    }
    Ok(None)
}

impl PciDevice for VfioPciDevice {
    fn config_read(&mut self, offset: u16, data: &mut [u8]) {
        if BarSet::handles(offset) {
            return self.bars.read(offset, data);
        }
        if let Err(error) = self
            .backend
            .region_read(region::CONFIG, u64::from(offset), data)
        {
            log::debug!("{}: config read at {offset:#x}: {error}", self.name);
            data.fill(0xff);
        }
        if let Some(msi) = self.msi.as_ref().filter(|m| m.contains(offset, data.len())) {
            msi.read(offset, data);
        }
        if let Some(intx) = self.intx.as_ref() {
            let line = config::INTERRUPT_LINE;
            if offset <= line && line < offset + data.len() as u16 {
                data[usize::from(line - offset)] = intx.line;
            }
        }
        if let Some((control_offset, control)) = self.msix_control_bytes(offset, data.len()) {
            let vectors = self.msix.as_ref().map_or(1, |m| m.capability.vectors);
            let value = ((vectors - 1) & 0x7ff) | control;
            for (i, byte) in data.iter_mut().enumerate() {
                let at = offset + i as u16;
                if (control_offset..control_offset + 2).contains(&at) {
                    *byte = value.to_le_bytes()[usize::from(at - control_offset)];
                }
            }
        }
        if let Some(capability) = &self.gpudirect {
            capability.overlay(offset, data);
        }
    }

    fn config_write(&mut self, offset: u16, data: &[u8]) {
        // The GPUDirect capability is read-only and the device never sees it.
        if self
            .gpudirect
            .is_some_and(|capability| capability.covers(offset, data.len()))
        {
            return;
        }
        if BarSet::handles(offset) {
            self.bars.write(offset, data);
            return self.sync_guest_mappings();
        }
        if self.msix_control_bytes(offset, data.len()).is_some() {
            return self.set_msix_control(offset, data);
        }
        if let Some(msi) = self.msi.as_mut().filter(|m| m.contains(offset, data.len())) {
            let result = match msi.write(offset, data) {
                MsiChange::None => return,
                MsiChange::Enable(vectors) => {
                    switch_intx(self.backend.as_mut(), &mut self.intx, false, &self.name);
                    let fds: Vec<&EventFd> = msi.eventfds.iter().take(vectors).collect();
                    self.backend.enable_msi(&fds)
                }
                MsiChange::Disable => self.backend.disable_msi(),
            };
            if let Err(error) = result {
                log::warn!("{}: cannot switch MSI: {error}", self.name);
            }
            return self.update_intx();
        }
        if let Some(intx) = self.intx.as_mut() {
            let line = config::INTERRUPT_LINE;
            if offset <= line && line < offset + data.len() as u16 {
                intx.line = data[usize::from(line - offset)];
            }
        }
        let mut gated = [0u8; 4];
        let data = if offset == config::COMMAND
            && data[0] & COMMAND_BUS_MASTER != 0
            && data.len() <= gated.len()
            && !self.bus_master_allowed()
        {
            gated[..data.len()].copy_from_slice(data);
            gated[0] &= !COMMAND_BUS_MASTER;
            &gated[..data.len()]
        } else {
            data
        };
        if offset == config::COMMAND {
            self.bars
                .set_memory_enabled(u16::from(data[0]) & config::COMMAND_MEMORY != 0);
            self.sync_guest_mappings();
        }
        if let Err(error) = self
            .backend
            .region_write(region::CONFIG, u64::from(offset), data)
        {
            log::debug!("{}: config write at {offset:#x}: {error}", self.name);
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
        self.sync_guest_mappings();
    }

    fn enable_memory_decoding(&mut self) {
        let mut command = [0u8; 2];
        self.config_read(config::COMMAND, &mut command);
        let value = u16::from_le_bytes(command) | config::COMMAND_MEMORY;
        self.config_write(config::COMMAND, &value.to_le_bytes());
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        match (
            self.msix_target(bar, offset, data.len()),
            self.msix.as_ref(),
        ) {
            (Some(MsixPart::Table(at)), Some(msix)) => return msix.table.read_table(at, data),
            (Some(MsixPart::Pba(at)), Some(msix)) => return msix.table.read_pba(at, data),
            _ => {}
        }
        if let Err(error) = self.backend.region_read(u32::from(bar), offset, data) {
            log::debug!("{}: BAR{bar} read at {offset:#x}: {error}", self.name);
            data.fill(0xff);
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        match self.msix_target(bar, offset, data.len()) {
            Some(MsixPart::Table(at)) => {
                if let Some(msix) = self.msix.as_mut() {
                    msix.table.write_table(at, data);
                }
                return;
            }
            Some(MsixPart::Pba(_)) => return,
            None => {}
        }
        if let Err(error) = self.backend.region_write(u32::from(bar), offset, data) {
            log::debug!("{}: BAR{bar} write at {offset:#x}: {error}", self.name);
        }
    }
}

impl Drop for VfioPciDevice {
    /// Leaves the device quiet for whoever uses it next.
    fn drop(&mut self) {
        // Peers lose their DMA mappings of this device's BARs before the BARs' mmaps go.
        self.report_bar_placement(true);
        if let Some(mapper) = &self.mapper {
            for mapping in &mut self.mappings {
                if let Some((handle, _)) = mapping.mapped.take() {
                    let _ = mapper.unmap(handle);
                }
            }
        }
        if self.backend.left_running_on_drop() {
            // Its interrupts, its reset and its connection are another process's.
            return;
        }
        if self.msix.as_ref().is_some_and(|m| m.table.enabled()) {
            let _ = self.backend.disable_msix();
        }
        if self.msi.as_ref().is_some_and(|m| m.enabled()) {
            let _ = self.backend.disable_msi();
        }
        switch_intx(self.backend.as_mut(), &mut self.intx, false, &self.name);
        // Best effort: the device is going anyway; the next user's attach checks it.
        if let Err(error) = self.backend.reset() {
            log::warn!("{}: reset after detach: {error}", self.name);
        }
    }
}

/// PCI vendor id of NVIDIA, the only vendor whose driver reads the GPUDirect capability.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// The vendor-specific capability id.
const CAP_ID_VENDOR: u8 = 0x09;
/// Where the GPUDirect capability may go: NVIDIA reserves 0xC8, and 0xD4 for GPUs whose
/// own capabilities (MSI-X, on Turing and later) sit at 0xC8.
const GPUDIRECT_OFFSETS: [u16; 2] = [0xc8, 0xd4];
const GPUDIRECT_LEN: u16 = 8;
/// The largest clique id the capability's 4-bit field holds.
pub const MAX_GPUDIRECT_CLIQUE: u8 = 15;

/// NVIDIA's GPUDirect P2P capability, as gpuvm adds it to a passthrough GPU's
/// configuration space (the device itself never sees it). Its 8 bytes: id 0x09, next
/// pointer, length 8, the signature "P2P", then a 16-bit word with the version (0) in bits
/// 2:0 and the clique id in bits 6:3. GPUs with one clique id may do P2P DMA to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GpuDirectCapability {
    offset: u16,
    clique: u8,
    link: CapabilityLink,
}

/// How the guest's capability walk reaches the added capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CapabilityLink {
    /// From the next pointer of the device's last capability (at this offset).
    After(u16),
    /// From the capabilities pointer: the device has no capability list of its own.
    Head,
}

impl GpuDirectCapability {
    fn bytes(&self) -> [u8; GPUDIRECT_LEN as usize] {
        [CAP_ID_VENDOR, 0, 8, b'P', b'2', b'P', self.clique << 3, 0]
    }

    /// Whether `[offset, offset + len)` touches the capability's bytes.
    fn covers(&self, offset: u16, len: usize) -> bool {
        offset < self.offset + GPUDIRECT_LEN && offset + len as u16 > self.offset
    }

    /// Puts what the guest sees of the capability, and of the pointer that leads to it,
    /// over a configuration read of `[offset, offset + data.len())`.
    fn overlay(&self, offset: u16, data: &mut [u8]) {
        let bytes = self.bytes();
        for (i, byte) in data.iter_mut().enumerate() {
            let at = offset + i as u16;
            if (self.offset..self.offset + GPUDIRECT_LEN).contains(&at) {
                *byte = bytes[usize::from(at - self.offset)];
            }
            match self.link {
                CapabilityLink::After(last) if at == last + 1 => *byte = self.offset as u8,
                CapabilityLink::Head if at == config::CAPABILITIES_POINTER => {
                    *byte = self.offset as u8
                }
                CapabilityLink::Head if at == config::COMMAND + 2 => {
                    *byte |= config::STATUS_CAPABILITIES as u8
                }
                _ => {}
            }
        }
    }
}

/// Why a passthrough device gets no GPUDirect capability.
#[derive(Debug, thiserror::Error)]
pub enum GpuDirectError {
    #[error("{device}: the GPUDirect clique capability is for NVIDIA devices (vendor {VENDOR_NVIDIA:#06x}), this one is {vendor:#06x}")]
    NotNvidia { device: String, vendor: u16 },
    #[error("{device}: GPUDirect clique {clique} is out of range (0 to {MAX_GPUDIRECT_CLIQUE})")]
    CliqueOutOfRange { device: String, clique: u8 },
    #[error("{device}: no room for the GPUDirect clique capability: the device's own capabilities use both 0xC8 and 0xD4")]
    NoRoom { device: String },
    #[error("{device}: cannot read its capability list: {source}")]
    Config { device: String, source: VfioError },
}

impl VfioPciDevice {
    /// Shows the guest NVIDIA's GPUDirect capability with `clique`, chained at the end of
    /// the device's capability list; returns its configuration offset. Calling it again
    /// changes the clique in place.
    pub fn add_gpudirect_clique(&mut self, clique: u8) -> std::result::Result<u16, GpuDirectError> {
        let device = || self.name.clone();
        let vendor = self.ids as u16;
        if vendor != VENDOR_NVIDIA {
            return Err(GpuDirectError::NotNvidia {
                device: device(),
                vendor,
            });
        }
        if clique > MAX_GPUDIRECT_CLIQUE {
            return Err(GpuDirectError::CliqueOutOfRange {
                device: device(),
                clique,
            });
        }
        if let Some(capability) = self.gpudirect.as_mut() {
            capability.clique = clique;
            return Ok(capability.offset);
        }
        let capabilities =
            capability_extents(self.backend.as_mut()).map_err(|source| GpuDirectError::Config {
                device: device(),
                source,
            })?;
        let free = |at: u16| {
            capabilities
                .iter()
                .all(|&(start, len)| start + len <= at || start >= at + GPUDIRECT_LEN)
        };
        let Some(offset) = GPUDIRECT_OFFSETS.into_iter().find(|&at| free(at)) else {
            return Err(GpuDirectError::NoRoom { device: device() });
        };
        let link = match capabilities.last() {
            Some(&(last, _)) => CapabilityLink::After(last),
            None => CapabilityLink::Head,
        };
        self.gpudirect = Some(GpuDirectCapability {
            offset,
            clique,
            link,
        });
        log::info!(
            "{}: GPUDirect clique {clique} (capability at {offset:#x})",
            self.name
        );
        Ok(offset)
    }

    /// The clique the guest reads from the GPUDirect capability, if it has one.
    pub fn gpudirect_clique(&self) -> Option<u8> {
        self.gpudirect.map(|capability| capability.clique)
    }

    /// Gives the guest the GPUDirect capability it saw when the snapshot was taken (a
    /// freshly opened device may have derived another, or none).
    fn restore_gpudirect(&mut self, saved: Option<u8>) {
        match saved {
            Some(clique) => {
                if let Err(error) = self.add_gpudirect_clique(clique) {
                    log::warn!("restoring the GPUDirect capability: {error}");
                }
            }
            None => {
                if self.gpudirect.take().is_some() {
                    log::info!(
                        "{}: the snapshot's guest saw no GPUDirect capability; none is shown",
                        self.name
                    );
                }
            }
        }
    }
}

/// The device's capabilities in list order, each as (offset, length). Lengths come from
/// the capability's id where the format fixes it; an unknown one is taken to reach the
/// next capability above it (or the end of the standard space).
fn capability_extents(backend: &mut dyn PassthroughDevice) -> Result<Vec<(u16, u16)>> {
    let status = read_config32(backend, config::COMMAND)? >> 16;
    if status as u16 & config::STATUS_CAPABILITIES == 0 {
        return Ok(Vec::new());
    }
    let mut headers = Vec::new();
    let mut pointer = (read_config32(backend, config::CAPABILITIES_POINTER)? & 0xfc) as u16;
    // At most 48 capabilities fit in 192 bytes; a longer chain is a loop.
    while pointer >= 0x40 && headers.len() < 48 {
        let header = read_config32(backend, pointer)?;
        headers.push((pointer, header));
        pointer = ((header >> 8) & 0xfc) as u16;
    }
    let starts: Vec<u16> = headers.iter().map(|&(at, _)| at).collect();
    let extents = headers
        .iter()
        .map(|&(at, header)| {
            let control = (header >> 16) as u16;
            let known = match header as u8 {
                0x01 => Some(8),
                CAP_ID_MSI => {
                    let address64 = if control & (1 << 7) != 0 { 4 } else { 0 };
                    let masking = if control & (1 << 8) != 0 { 10 } else { 0 };
                    Some(10 + address64 + masking)
                }
                0x10 => Some(0x3c),
                config::CAP_ID_MSIX => Some(12),
                CAP_ID_VENDOR => Some(u16::from((header >> 16) as u8).max(3)),
                _ => None,
            };
            let len = known.unwrap_or_else(|| {
                let next_above = starts.iter().copied().filter(|&s| s > at).min();
                next_above.unwrap_or(0x100) - at
            });
            (at, len)
        })
        .collect();
    Ok(extents)
}

#[cfg(test)]
mod gpudirect_tests {
    use super::*;
    use gpuvm_devices::pci::RecordedRoutes;

    /// A function with configuration space only, recording configuration writes.
    struct ConfigOnly {
        config: Vec<u8>,
        writes: Arc<std::sync::Mutex<Vec<u16>>>,
    }

    impl PassthroughDevice for ConfigOnly {
        fn name(&self) -> String {
            "config-only".into()
        }
        fn region_info(&self, index: u32) -> Option<crate::RegionInfo> {
            (index == region::CONFIG).then(|| crate::RegionInfo {
                index,
                size: 256,
                flags: crate::REGION_READ | crate::REGION_WRITE,
                mmap_areas: Vec::new(),
            })
        }
        fn region_read(&mut self, _index: u32, offset: u64, data: &mut [u8]) -> Result<()> {
            gpuvm_devices::pci::read_le(&self.config, offset as usize, data);
            Ok(())
        }
        fn region_write(&mut self, _index: u32, offset: u64, _data: &[u8]) -> Result<()> {
            self.writes.lock().unwrap().push(offset as u16);
            Ok(())
        }
        fn mmap_region(&mut self, _: u32, _: u64, _: u64) -> Result<Option<*mut u8>> {
            Ok(None)
        }
        fn msix_vectors(&mut self) -> Result<u32> {
            Ok(1)
        }
        fn enable_msix(&mut self, _eventfds: &[&EventFd]) -> Result<()> {
            Ok(())
        }
        fn disable_msix(&mut self) -> Result<()> {
            Ok(())
        }
        fn dma_map(&mut self, _region: &DmaRegion) -> Result<()> {
            Ok(())
        }
        fn reset(&mut self) -> Result<()> {
            Ok(())
        }
    }

    /// Configuration space of `vendor`'s device with `capabilities` ((offset, id, bytes
    /// after the header)) chained in the order given.
    fn config_space(vendor: u16, capabilities: &[(u8, u8, &[u8])]) -> Vec<u8> {
        let mut config = vec![0u8; 256];
        config[0..2].copy_from_slice(&vendor.to_le_bytes());
        config[2..4].copy_from_slice(&0x2330u16.to_le_bytes());
        if let Some(&(first, _, _)) = capabilities.first() {
            config[6] = 0x10;
            config[0x34] = first;
        }
        for (i, &(at, id, rest)) in capabilities.iter().enumerate() {
            let at = usize::from(at);
            config[at] = id;
            config[at + 1] = capabilities.get(i + 1).map_or(0, |next| next.0);
            config[at + 2..at + 2 + rest.len()].copy_from_slice(rest);
        }
        config
    }

    fn open(config: Vec<u8>) -> (VfioPciDevice, Arc<std::sync::Mutex<Vec<u16>>>) {
        let writes = Arc::default();
        let backend = ConfigOnly {
            config,
            writes: Arc::clone(&writes),
        };
        let mut allocate = |count: u32| -> std::io::Result<Vec<(u32, EventFd)>> {
            (0..count).map(|i| Ok((24 + i, EventFd::new(0)?))).collect()
        };
        let device = VfioPciDevice::new(
            Box::new(backend),
            &mut allocate,
            Arc::new(RecordedRoutes::default()),
        )
        .expect("device");
        (device, writes)
    }

    /// Walks the capability list as a guest does, returning (offset, id) pairs.
    fn guest_walk(device: &mut VfioPciDevice) -> Vec<(u16, u8)> {
        let mut status = [0u8; 2];
        device.config_read(config::COMMAND + 2, &mut status);
        if u16::from_le_bytes(status) & config::STATUS_CAPABILITIES == 0 {
            return Vec::new();
        }
        let mut found = Vec::new();
        let mut pointer = [0u8];
        device.config_read(config::CAPABILITIES_POINTER, &mut pointer);
        let mut at = u16::from(pointer[0] & 0xfc);
        while at >= 0x40 && found.len() < 48 {
            let mut header = [0u8; 2];
            device.config_read(at, &mut header);
            found.push((at, header[0]));
            at = u16::from(header[1] & 0xfc);
        }
        found
    }

    fn capability_bytes(device: &mut VfioPciDevice, at: u16) -> [u8; 8] {
        let mut bytes = [0u8; 8];
        device.config_read(at, &mut bytes[..4]);
        device.config_read(at + 4, &mut bytes[4..]);
        bytes
    }

    const MSIX: &[u8] = &[0, 0, 0, 0x20, 0, 0, 0, 0x30, 0, 0];

    #[test]
    fn the_capability_is_chained_at_c8_with_the_clique() {
        let (mut device, writes) = open(config_space(
            VENDOR_NVIDIA,
            &[(0x60, 0x11, MSIX), (0x70, 0x01, &[])],
        ));
        assert_eq!(device.add_gpudirect_clique(5).unwrap(), 0xc8);
        assert_eq!(
            guest_walk(&mut device),
            vec![(0x60, 0x11), (0x70, 0x01), (0xc8, CAP_ID_VENDOR)]
        );
        assert_eq!(
            capability_bytes(&mut device, 0xc8),
            [0x09, 0, 8, b'P', b'2', b'P', 5 << 3, 0]
        );
        assert_eq!(device.gpudirect_clique(), Some(5));
        // Guest writes to it go nowhere and change nothing.
        device.config_write(0xcc, &[0xff; 4]);
        device.config_write(0xc8, &[0xff; 2]);
        assert!(!writes.lock().unwrap().contains(&0xcc), "{writes:?}");
        assert!(!writes.lock().unwrap().contains(&0xc8));
        assert_eq!(capability_bytes(&mut device, 0xc8)[6], 5 << 3);
        // Asking again changes the clique in place.
        assert_eq!(device.add_gpudirect_clique(15).unwrap(), 0xc8);
        assert_eq!(capability_bytes(&mut device, 0xc8)[6], 15 << 3);
        assert_eq!(guest_walk(&mut device).len(), 3);
    }

    #[test]
    fn a_capability_at_c8_moves_it_to_d4() {
        let (mut device, _) = open(config_space(
            VENDOR_NVIDIA,
            &[(0x60, 0x01, &[]), (0xc8, 0x11, MSIX)],
        ));
        assert_eq!(device.add_gpudirect_clique(1).unwrap(), 0xd4);
        assert_eq!(
            guest_walk(&mut device),
            vec![(0x60, 0x01), (0xc8, 0x11), (0xd4, CAP_ID_VENDOR)]
        );
        // The MSI-X capability's own bytes still read through.
        let mut header = [0u8; 1];
        device.config_read(0xc8, &mut header);
        assert_eq!(header[0], 0x11);
    }

    #[test]
    fn no_room_not_nvidia_and_out_of_range_are_refused() {
        // A PCIe capability at 0xa0 spans 0xa0..0xdc: both places are taken.
        let (mut device, _) = open(config_space(VENDOR_NVIDIA, &[(0xa0, 0x10, &[])]));
        assert!(matches!(
            device.add_gpudirect_clique(0),
            Err(GpuDirectError::NoRoom { .. })
        ));
        assert_eq!(guest_walk(&mut device), vec![(0xa0, 0x10)]);
        let (mut device, _) = open(config_space(0x8086, &[(0x60, 0x01, &[])]));
        let error = device.add_gpudirect_clique(0).unwrap_err();
        assert!(error.to_string().contains("0x8086"), "{error}");
        let (mut device, _) = open(config_space(VENDOR_NVIDIA, &[]));
        assert!(matches!(
            device.add_gpudirect_clique(16),
            Err(GpuDirectError::CliqueOutOfRange { clique: 16, .. })
        ));
        assert_eq!(device.gpudirect_clique(), None);
    }

    #[test]
    fn a_device_without_capabilities_gets_a_list() {
        let (mut device, _) = open(config_space(VENDOR_NVIDIA, &[]));
        assert!(guest_walk(&mut device).is_empty());
        assert_eq!(device.add_gpudirect_clique(3).unwrap(), 0xc8);
        assert_eq!(guest_walk(&mut device), vec![(0xc8, CAP_ID_VENDOR)]);
    }

    #[test]
    fn snapshots_carry_the_clique_and_old_ones_load() {
        let (mut device, _) = open(config_space(VENDOR_NVIDIA, &[(0x60, 0x01, &[])]));
        device.add_gpudirect_clique(9).unwrap();
        let state = device.save().unwrap();
        assert_eq!(state.gpudirect_clique, Some(9));

        // A freshly opened device with no (or another) clique shows the saved one.
        let (mut restored, _) = open(config_space(VENDOR_NVIDIA, &[(0x60, 0x01, &[])]));
        restored.restore(&state).unwrap();
        assert_eq!(capability_bytes(&mut restored, 0xc8)[6], 9 << 3);

        // A snapshot from before the capability (the field defaults to None): the guest
        // keeps seeing no capability even where one would be derived now.
        let old = VfioPciState {
            bars: Vec::new(),
            ..VfioPciState::default()
        };
        restored.restore(&old).unwrap();
        assert_eq!(guest_walk(&mut restored), vec![(0x60, 0x01)]);
    }
}

#[cfg(test)]
mod huge_bar_alignment_tests {
    use super::*;

    #[test]
    fn the_aligned_start_and_the_given_back_ends_tile_the_reservation() {
        const GIB: u64 = 1 << 30;
        for reserved in [0x7f00_0000_0000, 0x7f00_0000_1000, 0x7f00_3fff_f000] {
            for len in [GIB, 256 * GIB, GIB + PAGE] {
                let (aligned, head, tail) = aligned_in_reservation(reserved, len, GIB);
                assert!(aligned.is_multiple_of(GIB), "{aligned:#x}");
                assert!(aligned >= reserved && head < GIB);
                assert_eq!(reserved + head, aligned);
                assert_eq!(head + len + tail, len + GIB);
            }
        }
        assert_eq!(
            aligned_in_reservation(0x7f00_0000_0000, GIB, GIB),
            (0x7f00_0000_0000, 0, GIB)
        );
    }

    #[test]
    fn a_large_bar_part_is_mapped_on_a_gib_boundary_and_a_small_one_anywhere() {
        // A sparse memfd stands in for the BAR: nothing is allocated for its pages.
        let name = std::ffi::CString::new("huge-bar-test").unwrap();
        // SAFETY: a fresh fd the test owns.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        let len = (2 * HUGE_BAR_ALIGN + PAGE) as usize;
        // SAFETY: the memfd is ours.
        assert_eq!(unsafe { libc::ftruncate(fd, len as libc::off_t) }, 0);
        let large = mmap_bar_part(fd, 0, len).unwrap();
        assert!((large as u64).is_multiple_of(HUGE_BAR_ALIGN), "{large:p}");
        // SAFETY: inside the shared writable mapping just made.
        unsafe {
            large.write(0x5a);
            large.add(len - 1).write(0xa5);
            assert_eq!(large.add(len - 1).read(), 0xa5);
        }
        let small = mmap_bar_part(fd, 0, PAGE as usize).unwrap();
        // SAFETY: the same page of the same memfd, mapped twice.
        assert_eq!(unsafe { small.read() }, 0x5a);
        // SAFETY: both mappings were made above and nothing else uses them; the fd is ours.
        unsafe {
            libc::munmap(large.cast(), len);
            libc::munmap(small.cast(), PAGE as usize);
            libc::close(fd);
        }
    }
}
