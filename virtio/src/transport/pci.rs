//! [`VirtioPciDevice`]: BAR0's regions, the device status state machine, activation and
//! ioeventfd placement. Its PCI configuration space is in `config_space`, its snapshots in
//! `state`.

use std::fmt;
use std::sync::Arc;

use gpuvm_devices::pci::{
    config, le_value, BarKind, BarSet, BarSpec, MsiRouting, MsixTable, PciBar, PciDevice,
    MSIX_ENTRY_SIZE,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::common_config::{
    offered_features, CommonConfig, CommonWrite, QueueConfig, StatusChange,
};
use super::config_space::PciCfgWindow;
use super::interrupt::VirtioPciInterrupt;
use super::layout::*;
use super::{IoEventRegistrar, TransportError, VectorAllocator};
use crate::{
    ActivateError, Activation, ActiveQueue, GuestMemory, LogSampler, QueuePosition, VirtioDevice,
    VirtioInterrupt,
};

const ENTRY_CONTROL: u64 = 12;
const VECTOR_MASKED: u8 = 1;

/// Where the queue notify ioeventfds are registered now.
struct NotifyRegistration {
    base: u64,
    /// Per queue: whether its ioeventfd is registered at `base + 4 * queue`.
    registered: Vec<bool>,
}

/// A virtio device on the PCI bus (virtio-pci modern, MSI-X only).
pub struct VirtioPciDevice {
    pub(super) device: Box<dyn VirtioDevice>,
    pub(super) name: String,
    pub(super) memory: GuestMemory,
    pub(super) config_image: [u8; CONFIG_IMAGE_LEN],
    pub(super) command: u16,
    pub(super) interrupt_line: u8,
    pub(super) pci_cfg: PciCfgWindow,
    pub(super) bars: BarSet,
    pub(super) msix: MsixTable,
    pub(super) interrupt: Arc<VirtioPciInterrupt>,
    pub(super) common: CommonConfig,
    /// One per queue, owned for the transport's whole life; devices get clones.
    kicks: Vec<EventFd>,
    ioevents: Arc<dyn IoEventRegistrar>,
    notify_registration: Option<NotifyRegistration>,
    pub(super) active: bool,
    /// Set by [`VirtioPciDevice::pause`]: where each queue stood.
    pub(super) paused: Option<Vec<Option<QueuePosition>>>,
    /// What the guest did wrong: the first 16, then at powers of two.
    guest_errors: LogSampler,
}

impl fmt::Debug for VirtioPciDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("name", &self.name)
            .field("status", &self.common.status)
            .field("active", &self.active)
            .finish()
    }
}

impl VirtioPciDevice {
    /// Puts `device` behind a transport: checks its queues, allocates one MSI-X vector per
    /// queue plus one for configuration changes through `allocate` (GSI + irqfd each,
    /// routed by `router`), and creates the queues' kick eventfds. `ioevents` gets the
    /// notify addresses once the BAR is placed and decoding.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        memory: GuestMemory,
        allocate: VectorAllocator<'_>,
        router: Arc<dyn MsiRouting>,
        ioevents: Arc<dyn IoEventRegistrar>,
    ) -> Result<Self, TransportError> {
        let name = device.name().to_string();
        let max_sizes = device.queue_max_sizes();
        if max_sizes.is_empty() || max_sizes.len() > MAX_QUEUES {
            return Err(TransportError::QueueCount {
                device: name,
                queues: max_sizes.len(),
                max: MAX_QUEUES,
            });
        }
        if let Some((queue, &size)) = max_sizes
            .iter()
            .enumerate()
            .find(|(_, &size)| Queue::new(size).is_err())
        {
            return Err(TransportError::QueueMaxSize {
                device: name,
                queue,
                size,
            });
        }
        let wanted = max_sizes.len() as u32 + 1;
        let allocated = allocate(wanted).map_err(|source| TransportError::Vectors {
            device: name.clone(),
            wanted,
            source,
        })?;
        if allocated.len() != wanted as usize {
            return Err(TransportError::VectorCount {
                device: name,
                wanted,
                got: allocated.len(),
            });
        }
        let (gsis, irqfds): (Vec<u32>, Vec<EventFd>) = allocated.into_iter().unzip();
        let kicks = (0..max_sizes.len())
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| TransportError::KickEventFd {
                device: name.clone(),
                source,
            })?;
        let device_type = device.device_type();
        log::info!(
            "{name}: virtio-pci device {:#06x}, {} queue(s), MSI-X GSIs {gsis:?}",
            device_id(device_type),
            max_sizes.len()
        );
        Ok(VirtioPciDevice {
            config_image: config_image(device_type, max_sizes.len(), wanted as u16),
            common: CommonConfig::new(offered_features(device.device_features()), &max_sizes),
            interrupt: Arc::new(VirtioPciInterrupt::new(irqfds, max_sizes.len())),
            msix: MsixTable::new(gsis, router),
            bars: BarSet::new(&[BarSpec {
                index: BAR_INDEX,
                size: BAR_SIZE,
                kind: BarKind::Memory64 {
                    prefetchable: false,
                },
            }]),
            command: 0,
            interrupt_line: 0,
            pci_cfg: PciCfgWindow::default(),
            device,
            name,
            memory,
            kicks,
            ioevents,
            notify_registration: None,
            active: false,
            paused: None,
            guest_errors: LogSampler::new(16),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device behind the transport.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// The device, for the VMM's operations on one kind of device (see
    /// [`VirtioDevice::as_any_mut`]).
    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    /// The device status register (`VIRTIO_CONFIG_S_*` bits).
    pub fn device_status(&self) -> u8 {
        self.common.status
    }

    /// Whether the device is serving its queues (DRIVER_OK accepted, not reset since).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// The guest-physical address of queue `queue`'s notify register, while BAR0 decodes.
    pub fn notify_address(&self, queue: u16) -> Option<u64> {
        let base = self.bar_address()?;
        (usize::from(queue) < self.kicks.len())
            .then(|| base + NOTIFY_OFFSET + u64::from(queue) * u64::from(NOTIFY_OFF_MULTIPLIER))
    }

    /// Stops the device serving its queues for a snapshot and keeps where each stood;
    /// [`gpuvm_devices::Persist::save`] needs it when the device is active. Harmless on an
    /// inactive device.
    pub fn pause(&mut self) {
        if self.paused.is_none() {
            self.paused = Some(self.device.pause());
        }
    }

    /// Serves the queues again after [`VirtioPciDevice::pause`].
    pub fn resume(&mut self) -> Result<(), ActivateError> {
        if self.paused.take().is_some() {
            self.device.resume()?;
        }
        Ok(())
    }

    /// Logs what the guest did wrong, sampled: a guest that hammers a register cannot
    /// flood the log.
    pub(super) fn guest_error(&mut self, what: fmt::Arguments) {
        if self.guest_errors.sample() {
            log::warn!(
                "{}: {what} ({} guest errors so far)",
                self.name,
                self.guest_errors.count()
            );
        }
    }

    fn bar_address(&self) -> Option<u64> {
        self.bars
            .active()
            .into_iter()
            .find(|bar| bar.index == BAR_INDEX)
            .map(|bar| bar.address)
    }

    /// Moves the queue notify ioeventfds to where BAR0 decodes now (or removes them while
    /// it does not). A failed registration only costs speed: the write then exits to
    /// [`PciDevice::bar_write`], which signals the same eventfd.
    pub(super) fn sync_notify_registration(&mut self) {
        let wanted = self.bar_address().map(|address| address + NOTIFY_OFFSET);
        if self.notify_registration.as_ref().map(|r| r.base) == wanted {
            return;
        }
        self.unregister_notify();
        let Some(base) = wanted else {
            return;
        };
        let registered = self
            .kicks
            .iter()
            .enumerate()
            .map(|(queue, kick)| {
                let address = base + queue as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
                match self.ioevents.register(address, kick) {
                    Ok(()) => true,
                    Err(error) => {
                        log::warn!(
                            "{}: no ioeventfd for queue {queue} at {address:#x}, notifications exit: {error}",
                            self.name
                        );
                        false
                    }
                }
            })
            .collect();
        self.notify_registration = Some(NotifyRegistration { base, registered });
    }

    fn unregister_notify(&mut self) {
        let Some(registration) = self.notify_registration.take() else {
            return;
        };
        for (queue, kick) in self.kicks.iter().enumerate() {
            if !registration.registered[queue] {
                continue;
            }
            let address = registration.base + queue as u64 * u64::from(NOTIFY_OFF_MULTIPLIER);
            if let Err(error) = self.ioevents.unregister(address, kick) {
                log::warn!(
                    "{}: cannot remove the ioeventfd of queue {queue} at {address:#x}: {error}",
                    self.name
                );
            }
        }
    }

    /// Tells the interrupt side which vectors can deliver now.
    pub(super) fn sync_msix_state(&self) {
        let function_masked = self.msix.function_masked();
        let live: Vec<bool> = (0..self.interrupt.vector_count())
            .map(|vector| {
                let mut control = [0u8; 1];
                self.msix.read_table(
                    vector as u64 * MSIX_ENTRY_SIZE + ENTRY_CONTROL,
                    &mut control,
                );
                !function_masked && control[0] & VECTOR_MASKED == 0
            })
            .collect();
        self.interrupt.set_msix_state(self.msix.enabled(), &live);
    }

    /// The driver wrote 0 to device_status: stop the device, forget the driver's setup.
    fn reset(&mut self) {
        if self.common.status != 0 || self.active {
            log::debug!("{}: reset by the driver", self.name);
            self.device.reset();
        }
        self.active = false;
        self.paused = None;
        self.common.reset();
        self.interrupt.reset();
        // Kicks counted before the reset are for rings that no longer exist.
        for kick in &self.kicks {
            let _ = kick.read();
        }
    }

    fn write_status(&mut self, written: u8) {
        match self.common.status_change(written) {
            StatusChange::Reset => self.reset(),
            StatusChange::Ignored(reason) => {
                self.guest_error(format_args!("device_status {written:#x} ignored: {reason}"))
            }
            StatusChange::Update {
                status,
                activate,
                refused,
            } => {
                if let Some(reason) = refused {
                    log::warn!("{}: {reason}", self.name);
                }
                self.common.status = status;
                if activate {
                    self.activate_on_driver_ok();
                }
            }
        }
    }

    fn activate_on_driver_ok(&mut self) {
        match self.activate(None) {
            Ok(()) => log::info!(
                "{}: activated, features {:#x}, queues {:?}",
                self.name,
                self.common.acked_features(),
                self.common
                    .queues
                    .iter()
                    .map(|q| q.enabled.then_some(q.size))
                    .collect::<Vec<_>>()
            ),
            Err(failure) => {
                match &failure {
                    // The driver's doing, and it can retry in a loop: rate-limited.
                    ActivationFailure::Queue { .. } => self.guest_error(format_args!(
                        "cannot activate, device needs reset: {failure}"
                    )),
                    ActivationFailure::Device(_) => log::warn!(
                        "{}: cannot activate, device needs reset: {failure}",
                        self.name
                    ),
                }
                self.common.set_needs_reset();
                // Tells the driver to look at the status (it finds DEVICE_NEEDS_RESET).
                let _ = self.interrupt.signal_config();
            }
        }
    }

    /// Hands the enabled queues to the device, at `positions` (a restore) or at their
    /// start. The rings must lie in guest memory.
    pub(super) fn activate(
        &mut self,
        positions: Option<&[Option<QueuePosition>]>,
    ) -> Result<(), ActivationFailure> {
        let event_idx = self.common.acked_features() & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::with_capacity(self.common.queues.len());
        for (index, config) in self.common.queues.iter().enumerate() {
            if !config.enabled {
                queues.push(None);
                continue;
            }
            let position = positions.and_then(|p| p.get(index).copied().flatten());
            let queue = build_queue(config, event_idx, position, &self.memory)
                .map_err(|reason| ActivationFailure::Queue { index, reason })?;
            let kick = self.kicks[index]
                .try_clone()
                .map_err(|error| ActivationFailure::Queue {
                    index,
                    reason: format!("cannot clone its kick eventfd: {error}"),
                })?;
            queues.push(Some(ActiveQueue { queue, kick }));
        }
        self.device
            .activate(Activation {
                memory: self.memory.clone(),
                acked_features: self.common.acked_features(),
                queues,
                interrupt: self.interrupt.clone(),
            })
            .map_err(ActivationFailure::Device)?;
        self.active = true;
        Ok(())
    }

    /// Signals every enabled queue's kick once, so a re-activated device looks at rings
    /// the driver may have filled while the VM was being snapshotted.
    pub(super) fn kick_enabled_queues(&self) {
        for (config, kick) in self.common.queues.iter().zip(&self.kicks) {
            if config.enabled {
                let _ = kick.write(1);
            }
        }
    }

    /// Which region of BAR0 `[offset, offset + len)` lies in, wholly.
    fn region(&self, offset: u64, len: usize) -> Option<(Region, u64)> {
        let end = offset.checked_add(len as u64)?;
        let vectors = self.interrupt.vector_count() as u64;
        let regions = [
            (Region::Common, COMMON_OFFSET, COMMON_LEN),
            (Region::Isr, ISR_OFFSET, ISR_LEN),
            (Region::Device, DEVICE_OFFSET, DEVICE_LEN),
            (
                Region::Notify,
                NOTIFY_OFFSET,
                self.kicks.len() as u64 * u64::from(NOTIFY_OFF_MULTIPLIER),
            ),
            (
                Region::MsixTable,
                MSIX_TABLE_OFFSET,
                vectors * MSIX_ENTRY_SIZE,
            ),
            (Region::MsixPba, MSIX_PBA_OFFSET, vectors.div_ceil(64) * 8),
        ];
        regions
            .into_iter()
            .find(|&(_, start, size)| offset >= start && end <= start + size)
            .map(|(region, start, _)| (region, offset - start))
    }

    /// The PBA from the interrupt side's pending bits.
    fn read_pba(&self, offset: u64, data: &mut [u8]) {
        for (i, byte) in data.iter_mut().enumerate() {
            let first = (offset as usize + i) * 8;
            *byte = (0..8).fold(0, |bits, bit| {
                bits | (u8::from(self.interrupt.pending(first + bit)) << bit)
            });
        }
    }
}

/// Why DRIVER_OK (or a restore) could not start the device.
#[derive(Debug, thiserror::Error)]
pub(super) enum ActivationFailure {
    #[error("queue {index}: {reason}")]
    Queue { index: usize, reason: String },
    #[error(transparent)]
    Device(ActivateError),
}

/// A [`Queue`] from the driver's registers, checked against guest memory.
pub(super) fn build_queue(
    config: &QueueConfig,
    event_idx: bool,
    position: Option<QueuePosition>,
    memory: &GuestMemory,
) -> Result<Queue, String> {
    let mut queue = Queue::new(config.max_size).map_err(|e| e.to_string())?;
    queue.try_set_size(config.size).map_err(|e| e.to_string())?;
    queue
        .try_set_desc_table_address(GuestAddress(config.desc))
        .map_err(|e| e.to_string())?;
    queue
        .try_set_avail_ring_address(GuestAddress(config.driver))
        .map_err(|e| e.to_string())?;
    queue
        .try_set_used_ring_address(GuestAddress(config.device))
        .map_err(|e| e.to_string())?;
    queue.set_ready(true);
    queue.set_event_idx(event_idx);
    if let Some(position) = position {
        queue.set_next_avail(position.next_avail);
        queue.set_next_used(position.next_used);
    }
    if !queue.is_valid(memory) {
        return Err(format!(
            "rings (descriptors {:#x}, driver {:#x}, device {:#x}, size {}) are not in guest memory",
            config.desc, config.driver, config.device, config.size
        ));
    }
    Ok(queue)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Region {
    Common,
    Isr,
    Device,
    Notify,
    MsixTable,
    MsixPba,
}

impl PciDevice for VirtioPciDevice {
    fn config_read(&mut self, offset: u16, data: &mut [u8]) {
        self.read_config_space(offset, data);
    }

    fn config_write(&mut self, offset: u16, data: &[u8]) {
        self.write_config_space(offset, data);
    }

    fn active_bars(&self) -> Vec<PciBar> {
        self.bars.active()
    }

    fn bar_specs(&self) -> Vec<BarSpec> {
        self.bars.specs()
    }

    fn set_bar_address(&mut self, bar: u8, address: u64) {
        self.bars.set_address(bar, address);
        self.sync_notify_registration();
    }

    fn enable_memory_decoding(&mut self) {
        self.write_command(self.command | config::COMMAND_MEMORY);
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if bar != BAR_INDEX {
            data.fill(0xff);
            return self.guest_error(format_args!("read of BAR{bar}, which does not exist"));
        }
        let Some((region, at)) = self.region(offset, data.len()) else {
            data.fill(0);
            if offset.saturating_add(data.len() as u64) > BAR_SIZE {
                data.fill(0xff);
                self.guest_error(format_args!(
                    "read of {} byte(s) at {offset:#x}, past BAR0",
                    data.len()
                ));
            }
            return;
        };
        match region {
            Region::Common => self.common.read(at, data, &self.interrupt),
            Region::Isr => {
                data.fill(0);
                if at == 0 {
                    data[0] = self.interrupt.take_isr();
                }
            }
            Region::Device => self.device.read_config(at, data),
            Region::Notify => data.fill(0),
            Region::MsixTable => self.msix.read_table(at, data),
            Region::MsixPba => self.read_pba(at, data),
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if bar != BAR_INDEX {
            return self.guest_error(format_args!("write to BAR{bar}, which does not exist"));
        }
        let Some((region, at)) = self.region(offset, data.len()) else {
            return self.guest_error(format_args!(
                "write of {} byte(s) at BAR0 offset {offset:#x}, outside every register",
                data.len()
            ));
        };
        match region {
            Region::Common => match self.common.write(at, data, &self.interrupt) {
                CommonWrite::Stored => {}
                CommonWrite::Status(value) => self.write_status(value),
                CommonWrite::Refused(reason) => self.guest_error(format_args!(
                    "common config write of {} byte(s) at {at:#x} (value {:#x}) dropped: {reason}",
                    data.len(),
                    le_value(data)
                )),
            },
            Region::Isr | Region::MsixPba => {}
            Region::Device => self.device.write_config(at, data),
            Region::Notify => {
                let queue = (at / u64::from(NOTIFY_OFF_MULTIPLIER)) as usize;
                if let Err(error) = self.kicks[queue].write(1) {
                    log::warn!("{}: cannot kick queue {queue}: {error}", self.name);
                }
            }
            Region::MsixTable => {
                self.msix.write_table(at, data);
                self.sync_msix_state();
            }
        }
    }
}

impl Drop for VirtioPciDevice {
    fn drop(&mut self) {
        self.unregister_notify();
        if self.active {
            self.device.reset();
        }
    }
}
