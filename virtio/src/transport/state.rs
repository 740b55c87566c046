//! Snapshots of a virtio-pci function: [`VirtioPciState`] and [`Persist`] for
//! [`VirtioPciDevice`].
//!
//! The state is a plain serde struct holding the device's own typed state
//! ([`DeviceState`]); a field added later takes `#[serde(default)]` so older snapshots
//! still load, or the state format version goes up with a migration (vmm/src/persist.rs).

use gpuvm_devices::pci::{PciDevice, MSIX_ENTRY_SIZE};
use gpuvm_devices::Persist;
use serde::{Deserialize, Serialize};

use super::common_config::CommonConfig;
use super::config_space::PciCfgWindow;
use super::layout::BAR_INDEX;
use super::pci::{build_queue, ActivationFailure, VirtioPciDevice};
use super::{SnapshotError, StateMismatch, NO_VECTOR};
use crate::{DeviceState, QueuePosition};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

/// The PCI function's own registers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciConfigState {
    pub command: u16,
    /// BAR0's programmed address (placed, whether decoding or not).
    pub bar_address: u64,
    pub interrupt_line: u8,
    /// The PCI_CFG access capability's window.
    pub pci_cfg_bar: u8,
    pub pci_cfg_offset: u32,
    pub pci_cfg_length: u32,
}

/// One MSI-X table entry, and whether an interrupt waits for it to be unmasked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixEntryState {
    pub address: u64,
    pub data: u32,
    pub masked: bool,
    pub pending: bool,
}

/// One queue's setup as the driver wrote it, and where the device stood.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueConfigState {
    pub size: u16,
    pub enabled: bool,
    pub msix_vector: u16,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
    /// Always the queue's index (kept so a later layout change can be detected).
    pub notify_off: u16,
    /// Ring positions reported by the paused device; `None` while not active.
    pub position: Option<QueuePosition>,
}

/// Everything a virtio-pci function needs to come back as the driver left it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VirtioPciState {
    pub pci: PciConfigState,
    pub msix_control: u16,
    pub msix_entries: Vec<MsixEntryState>,
    pub device_status: u8,
    pub offered_features: u64,
    pub acked_features: u64,
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub config_msix_vector: u16,
    pub config_generation: u8,
    pub isr: u8,
    pub queue_select: u16,
    pub queues: Vec<QueueConfigState>,
    /// The device's own state ([`crate::VirtioDevice::save_state`]).
    pub device: DeviceState,
}

/// What a restore overwrites on the PCI side, to put back if it fails late.
struct PciRollback {
    command: u16,
    bar_address: u64,
    interrupt_line: u8,
    pci_cfg: PciCfgWindow,
    msix_control: u16,
    msix_entries: Vec<MsixEntryState>,
}

impl VirtioPciDevice {
    fn msix_entries(&self) -> Vec<MsixEntryState> {
        (0..self.interrupt.vector_count())
            .map(|vector| {
                let mut bytes = [0u8; MSIX_ENTRY_SIZE as usize];
                self.msix
                    .read_table(vector as u64 * MSIX_ENTRY_SIZE, &mut bytes);
                let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
                MsixEntryState {
                    address: u64::from(word(0)) | u64::from(word(4)) << 32,
                    data: word(8),
                    masked: word(12) & 1 != 0,
                    pending: self.interrupt.pending(vector),
                }
            })
            .collect()
    }

    fn load_msix(&mut self, control: u16, entries: &[MsixEntryState]) {
        for (vector, entry) in entries.iter().enumerate() {
            let mut bytes = [0u8; MSIX_ENTRY_SIZE as usize];
            bytes[0..8].copy_from_slice(&entry.address.to_le_bytes());
            bytes[8..12].copy_from_slice(&entry.data.to_le_bytes());
            bytes[12..16].copy_from_slice(&u32::from(entry.masked).to_le_bytes());
            self.msix
                .write_table(vector as u64 * MSIX_ENTRY_SIZE, &bytes);
            self.interrupt.set_pending(vector, entry.pending);
        }
        self.msix.set_control(control);
        self.sync_msix_state();
    }

    fn bar_address_placed(&self) -> u64 {
        self.bars
            .placed()
            .into_iter()
            .find(|bar| bar.index == BAR_INDEX)
            .map_or(0, |bar| bar.address)
    }

    fn load_pci(&mut self, command: u16, bar_address: u64, line: u8, window: PciCfgWindow) {
        self.bars.set_address(BAR_INDEX, bar_address);
        self.interrupt_line = line;
        self.pci_cfg = window;
        // Through the register path, so decoding and the ioeventfds follow.
        self.config_write(gpuvm_devices::pci::config::COMMAND, &command.to_le_bytes());
        self.sync_notify_registration();
    }

    /// Refuses a state this transport cannot take, before anything changes.
    fn check_state(&self, state: &VirtioPciState) -> Result<(), StateMismatch> {
        if state.queues.len() != self.common.queues.len() {
            return Err(StateMismatch::QueueCount {
                saved: state.queues.len(),
                now: self.common.queues.len(),
            });
        }
        if state.msix_entries.len() != self.interrupt.vector_count() {
            return Err(StateMismatch::VectorCount {
                saved: state.msix_entries.len(),
                now: self.interrupt.vector_count(),
            });
        }
        let unknown = state.acked_features & !self.common.offered_features;
        if unknown != 0 {
            return Err(StateMismatch::UnofferedFeatures(unknown));
        }
        let vector_ok = |v: u16| v == NO_VECTOR || usize::from(v) < self.interrupt.vector_count();
        if !vector_ok(state.config_msix_vector) {
            return Err(StateMismatch::ConfigVector(state.config_msix_vector));
        }
        for (index, (saved, config)) in state.queues.iter().zip(&self.common.queues).enumerate() {
            if !config.size_is_valid(saved.size) {
                return Err(StateMismatch::QueueSize {
                    index,
                    size: saved.size,
                    max: config.max_size,
                });
            }
            if !vector_ok(saved.msix_vector) {
                return Err(StateMismatch::QueueVector {
                    index,
                    vector: saved.msix_vector,
                });
            }
            if usize::from(saved.notify_off) != index {
                return Err(StateMismatch::NotifyOffset {
                    index,
                    offset: saved.notify_off,
                });
            }
        }
        let mut probe = self.common.clone();
        probe.status = 0;
        probe.driver_features = state.acked_features;
        if state.device_status & (virtio_bindings::virtio_config::VIRTIO_CONFIG_S_FEATURES_OK as u8)
            != 0
        {
            if let Some(reason) = probe.features_refusal() {
                return Err(StateMismatch::Features(reason));
            }
        }
        Ok(())
    }

    fn common_from_state(&self, state: &VirtioPciState) -> CommonConfig {
        let mut common = self.common.clone();
        common.reset();
        common.device_feature_select = state.device_feature_select;
        common.driver_feature_select = state.driver_feature_select;
        common.driver_features = state.acked_features;
        common.status = state.device_status;
        common.queue_select = state.queue_select;
        for (config, saved) in common.queues.iter_mut().zip(&state.queues) {
            config.size = saved.size;
            config.enabled = saved.enabled;
            config.desc = saved.desc;
            config.driver = saved.driver;
            config.device = saved.device;
        }
        common
    }

    /// Puts a failed restore back to the fresh transport it was.
    fn roll_back(&mut self, rollback: PciRollback) {
        self.common.reset();
        self.interrupt.reset();
        self.load_pci(
            rollback.command,
            rollback.bar_address,
            rollback.interrupt_line,
            rollback.pci_cfg,
        );
        self.load_msix(rollback.msix_control, &rollback.msix_entries);
    }
}

impl Persist for VirtioPciDevice {
    type State = VirtioPciState;
    type Error = SnapshotError;

    /// Saves the transport and the device. An active device must be paused first
    /// ([`VirtioPciDevice::pause`]), so its ring positions are known and stay put.
    fn save(&self) -> Result<VirtioPciState, SnapshotError> {
        if self.active && self.paused.is_none() {
            return Err(SnapshotError::NotPaused {
                device: self.name.clone(),
            });
        }
        let positions = self.paused.as_deref().unwrap_or(&[]);
        Ok(VirtioPciState {
            pci: PciConfigState {
                command: self.command,
                bar_address: self.bar_address_placed(),
                interrupt_line: self.interrupt_line,
                pci_cfg_bar: self.pci_cfg.bar,
                pci_cfg_offset: self.pci_cfg.offset,
                pci_cfg_length: self.pci_cfg.length,
            },
            msix_control: self.msix.control(),
            msix_entries: self.msix_entries(),
            device_status: self.common.status,
            offered_features: self.common.offered_features,
            acked_features: self.common.driver_features,
            device_feature_select: self.common.device_feature_select,
            driver_feature_select: self.common.driver_feature_select,
            config_msix_vector: self.interrupt.config_vector(),
            config_generation: self.interrupt.config_generation(),
            isr: self.interrupt.isr(),
            queue_select: self.common.queue_select,
            queues: self
                .common
                .queues
                .iter()
                .enumerate()
                .map(|(index, queue)| QueueConfigState {
                    size: queue.size,
                    enabled: queue.enabled,
                    msix_vector: self.interrupt.queue_vector(index),
                    desc: queue.desc,
                    driver: queue.driver,
                    device: queue.device,
                    notify_off: index as u16,
                    position: if self.active {
                        positions.get(index).copied().flatten()
                    } else {
                        None
                    },
                })
                .collect(),
            device: self
                .device
                .save_state()
                .map_err(|source| SnapshotError::DeviceState {
                    device: self.name.clone(),
                    source: Box::new(source),
                })?,
        })
    }

    /// Loads `state` into this freshly built transport (same device, same options). If
    /// the driver had the device running (DRIVER_OK without DEVICE_NEEDS_RESET), the
    /// queues are rebuilt at their saved ring positions and the device is activated
    /// again, serving at once; each enabled queue gets one kick so requests the driver
    /// queued around the snapshot are seen.
    ///
    /// Everything that can be checked is checked before anything changes; if the device
    /// then refuses to start, the transport's registers go back to the fresh state, but
    /// the device keeps the state it was handed (it is fresh and never ran either way).
    fn restore(&mut self, state: &VirtioPciState) -> Result<(), SnapshotError> {
        let device = self.name.clone();
        if self.common.status != 0 || self.active {
            return Err(SnapshotError::NotFresh { device });
        }
        self.check_state(state)
            .map_err(|mismatch| SnapshotError::Mismatch {
                device: device.clone(),
                mismatch,
            })?;
        let common = self.common_from_state(state);
        let run = common.driver_ok() && !common.needs_reset();
        let positions: Vec<Option<QueuePosition>> =
            state.queues.iter().map(|q| q.position).collect();
        if run {
            // The rings must still lie in guest memory: check before anything changes.
            let event_idx = common.acked_features() & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
            for (index, config) in common.queues.iter().enumerate() {
                if config.enabled {
                    build_queue(config, event_idx, positions[index], &self.memory).map_err(
                        |reason| SnapshotError::Mismatch {
                            device: device.clone(),
                            mismatch: StateMismatch::Queue { index, reason },
                        },
                    )?;
                }
            }
        }
        self.device
            .restore_state(&state.device)
            .map_err(|source| SnapshotError::DeviceState {
                device: device.clone(),
                source: Box::new(source),
            })?;

        let rollback = PciRollback {
            command: self.command,
            bar_address: self.bar_address_placed(),
            interrupt_line: self.interrupt_line,
            pci_cfg: self.pci_cfg,
            msix_control: self.msix.control(),
            msix_entries: self.msix_entries(),
        };
        self.common = common;
        self.interrupt.set_config_vector(state.config_msix_vector);
        for (index, queue) in state.queues.iter().enumerate() {
            self.interrupt.set_queue_vector(index, queue.msix_vector);
        }
        self.interrupt.set_isr(state.isr);
        self.interrupt
            .set_config_generation(state.config_generation);
        self.load_pci(
            state.pci.command,
            state.pci.bar_address,
            state.pci.interrupt_line,
            PciCfgWindow {
                bar: state.pci.pci_cfg_bar,
                offset: state.pci.pci_cfg_offset,
                length: state.pci.pci_cfg_length,
            },
        );
        self.load_msix(state.msix_control, &state.msix_entries);

        if run {
            if let Err(failure) = self.activate(Some(&positions)) {
                self.roll_back(rollback);
                return Err(match failure {
                    ActivationFailure::Device(source) => SnapshotError::Activate { device, source },
                    ActivationFailure::Queue { index, reason } => SnapshotError::Mismatch {
                        device,
                        mismatch: StateMismatch::Queue { index, reason },
                    },
                });
            }
            self.kick_enabled_queues();
        }
        log::info!(
            "{}: restored, status {:#x}{}",
            self.name,
            self.common.status,
            if run { ", serving" } else { "" }
        );
        Ok(())
    }
}
