//! The common configuration structure (`struct virtio_pci_common_cfg`): feature
//! negotiation, device status and per-queue setup, as registers. What a register write
//! means for the device (reset, activation) is the transport's business; this only keeps
//! the values and says which change the driver asked for.

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_ADMIN_VQ,
    VIRTIO_F_NOTIFICATION_DATA, VIRTIO_F_NOTIF_CONFIG_DATA, VIRTIO_F_RING_PACKED,
    VIRTIO_F_RING_RESET, VIRTIO_F_SR_IOV, VIRTIO_F_VERSION_1,
};

use super::interrupt::VirtioPciInterrupt;

/// Register offsets in the common configuration.
pub mod offsets {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const MSIX_CONFIG: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const CONFIG_GENERATION: u64 = 0x15;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
}
use offsets::*;

const fn bit(feature: u32) -> u64 {
    1 << feature
}

/// Transport features the transport cannot honour, whatever the device offers: no IOMMU,
/// split rings only, no notification data, no per-queue reset, no SR-IOV or admin queue.
pub const UNSUPPORTED_FEATURES: u64 = bit(VIRTIO_F_ACCESS_PLATFORM)
    | bit(VIRTIO_F_RING_PACKED)
    | bit(VIRTIO_F_SR_IOV)
    | bit(VIRTIO_F_NOTIFICATION_DATA)
    | bit(VIRTIO_F_NOTIF_CONFIG_DATA)
    | bit(VIRTIO_F_RING_RESET)
    | bit(VIRTIO_F_ADMIN_VQ);

/// What the transport offers for a device offering `device_features`.
pub fn offered_features(device_features: u64) -> u64 {
    (device_features & !UNSUPPORTED_FEATURES) | bit(VIRTIO_F_VERSION_1)
}

/// One queue's registers as the driver set them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueConfig {
    pub max_size: u16,
    pub size: u16,
    pub enabled: bool,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
}

impl QueueConfig {
    fn new(max_size: u16) -> Self {
        QueueConfig {
            max_size,
            size: max_size,
            enabled: false,
            desc: 0,
            driver: 0,
            device: 0,
        }
    }

    pub fn size_is_valid(&self, size: u16) -> bool {
        size.is_power_of_two() && size <= self.max_size
    }
}

/// What a write to `device_status` asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum StatusChange {
    /// 0 was written: stop the device and return every register to its default.
    Reset,
    /// Store `status`; start the device if `activate`. `refused` says which bit the
    /// transport dropped and why.
    Update {
        status: u8,
        activate: bool,
        refused: Option<String>,
    },
    /// The write is invalid (it clears bits) and changes nothing.
    Ignored(&'static str),
}

/// What a register write did.
#[derive(Debug, PartialEq, Eq)]
pub enum CommonWrite {
    Stored,
    /// `device_status` was written with this value; see [`CommonConfig::status_change`].
    Status(u8),
    /// Dropped, with the reason (for a rate-limited log).
    Refused(&'static str),
}

/// The common configuration registers of one function (the MSI-X vector choices live in
/// [`VirtioPciInterrupt`], which the device's thread reads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommonConfig {
    pub offered_features: u64,
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub driver_features: u64,
    pub status: u8,
    pub queue_select: u16,
    pub queues: Vec<QueueConfig>,
}

const STATUS_DRIVER: u8 = VIRTIO_CONFIG_S_DRIVER as u8;
const STATUS_FEATURES_OK: u8 = VIRTIO_CONFIG_S_FEATURES_OK as u8;
const STATUS_DRIVER_OK: u8 = VIRTIO_CONFIG_S_DRIVER_OK as u8;
const STATUS_NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;

impl CommonConfig {
    pub fn new(offered_features: u64, queue_max_sizes: &[u16]) -> Self {
        CommonConfig {
            offered_features,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            queue_select: 0,
            queues: queue_max_sizes
                .iter()
                .map(|&max| QueueConfig::new(max))
                .collect(),
        }
    }

    /// Every register back to its reset value.
    pub fn reset(&mut self) {
        let max_sizes: Vec<u16> = self.queues.iter().map(|q| q.max_size).collect();
        *self = CommonConfig::new(self.offered_features, &max_sizes);
    }

    pub fn driver_ok(&self) -> bool {
        self.status & STATUS_DRIVER_OK != 0
    }

    pub fn features_ok(&self) -> bool {
        self.status & STATUS_FEATURES_OK != 0
    }

    pub fn needs_reset(&self) -> bool {
        self.status & STATUS_NEEDS_RESET != 0
    }

    pub fn set_needs_reset(&mut self) {
        self.status |= STATUS_NEEDS_RESET;
    }

    /// The features the driver accepted, once FEATURES_OK holds.
    pub fn acked_features(&self) -> u64 {
        self.driver_features
    }

    /// Why the driver's features cannot be accepted, if they cannot.
    pub fn features_refusal(&self) -> Option<String> {
        let unknown = self.driver_features & !self.offered_features;
        if unknown != 0 {
            return Some(format!(
                "driver acked features {unknown:#x} that were not offered"
            ));
        }
        if self.driver_features & bit(VIRTIO_F_VERSION_1) == 0 {
            return Some(
                "driver did not ack VIRTIO_F_VERSION_1 (legacy drivers are not supported)".into(),
            );
        }
        None
    }

    fn selected_queue(&self) -> Option<&QueueConfig> {
        self.queues.get(usize::from(self.queue_select))
    }

    /// The structure as the driver would read it now.
    fn image(&self, interrupt: &VirtioPciInterrupt) -> [u8; super::layout::COMMON_LEN as usize] {
        let mut image = [0u8; super::layout::COMMON_LEN as usize];
        let mut put = |offset: u64, bytes: &[u8]| {
            let start = offset as usize;
            image[start..start + bytes.len()].copy_from_slice(bytes);
        };
        let feature_word = |features: u64, select: u32| match select {
            0 => features as u32,
            1 => (features >> 32) as u32,
            _ => 0,
        };
        put(
            DEVICE_FEATURE_SELECT,
            &self.device_feature_select.to_le_bytes(),
        );
        put(
            DEVICE_FEATURE,
            &feature_word(self.offered_features, self.device_feature_select).to_le_bytes(),
        );
        put(
            DRIVER_FEATURE_SELECT,
            &self.driver_feature_select.to_le_bytes(),
        );
        put(
            DRIVER_FEATURE,
            &feature_word(self.driver_features, self.driver_feature_select).to_le_bytes(),
        );
        put(MSIX_CONFIG, &interrupt.config_vector().to_le_bytes());
        put(NUM_QUEUES, &(self.queues.len() as u16).to_le_bytes());
        put(DEVICE_STATUS, &[self.status]);
        put(CONFIG_GENERATION, &[interrupt.config_generation()]);
        put(QUEUE_SELECT, &self.queue_select.to_le_bytes());
        // An unavailable queue reads size 0 and zeros elsewhere.
        if let Some(queue) = self.selected_queue() {
            let index = usize::from(self.queue_select);
            put(QUEUE_SIZE, &queue.size.to_le_bytes());
            put(
                QUEUE_MSIX_VECTOR,
                &interrupt.queue_vector(index).to_le_bytes(),
            );
            put(QUEUE_ENABLE, &u16::from(queue.enabled).to_le_bytes());
            put(QUEUE_NOTIFY_OFF, &self.queue_select.to_le_bytes());
            put(QUEUE_DESC, &queue.desc.to_le_bytes());
            put(QUEUE_DRIVER, &queue.driver.to_le_bytes());
            put(QUEUE_DEVICE, &queue.device.to_le_bytes());
        }
        image
    }

    /// A read of any width at any offset inside the structure (bytes past it read zero).
    pub fn read(&self, offset: u64, data: &mut [u8], interrupt: &VirtioPciInterrupt) {
        let image = self.image(interrupt);
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|at| image.get(at).copied())
                .unwrap_or(0);
        }
    }

    /// A write: only accesses of a field's own width (or an aligned 32-bit half of a
    /// 64-bit field) are taken.
    pub fn write(
        &mut self,
        offset: u64,
        data: &[u8],
        interrupt: &VirtioPciInterrupt,
    ) -> CommonWrite {
        let value = gpuvm_devices::pci::le_value(data);
        let queue_frozen = self.driver_ok();
        match (offset, data.len()) {
            (DEVICE_FEATURE_SELECT, 4) => self.device_feature_select = value as u32,
            (DRIVER_FEATURE_SELECT, 4) => self.driver_feature_select = value as u32,
            (DRIVER_FEATURE, 4) => {
                if self.features_ok() {
                    return CommonWrite::Refused("driver features written after FEATURES_OK");
                }
                let shift = match self.driver_feature_select {
                    0 => 0,
                    1 => 32,
                    _ => return CommonWrite::Refused("driver feature word past bit 63"),
                };
                self.driver_features =
                    (self.driver_features & !(0xffff_ffff << shift)) | (value << shift);
            }
            (MSIX_CONFIG, 2) => interrupt.set_config_vector(value as u16),
            (DEVICE_STATUS, 1) => return CommonWrite::Status(value as u8),
            (QUEUE_SELECT, 2) => self.queue_select = value as u16,
            (QUEUE_MSIX_VECTOR, 2) => {
                let index = usize::from(self.queue_select);
                if index >= self.queues.len() {
                    return CommonWrite::Refused(
                        "queue_msix_vector of a queue that does not exist",
                    );
                }
                interrupt.set_queue_vector(index, value as u16);
            }
            (QUEUE_SIZE | QUEUE_ENABLE, 2) | (QUEUE_DESC..=0x37, 4 | 8) => {
                if queue_frozen {
                    return CommonWrite::Refused("queue setup written after DRIVER_OK");
                }
                let Some(queue) = self.queues.get_mut(usize::from(self.queue_select)) else {
                    return CommonWrite::Refused("queue setup of a queue that does not exist");
                };
                return Self::write_queue(queue, offset, data.len(), value);
            }
            (
                DEVICE_FEATURE | NUM_QUEUES | CONFIG_GENERATION | QUEUE_NOTIFY_OFF | 0x38..=0x3f,
                _,
            ) => return CommonWrite::Refused("write to a read-only field"),
            _ => return CommonWrite::Refused("access of the wrong width or alignment"),
        }
        CommonWrite::Stored
    }

    fn write_queue(queue: &mut QueueConfig, offset: u64, len: usize, value: u64) -> CommonWrite {
        match (offset, len) {
            (QUEUE_SIZE, _) => {
                let size = value as u16;
                if !queue.size_is_valid(size) {
                    return CommonWrite::Refused(
                        "queue size zero, not a power of two or above the maximum",
                    );
                }
                queue.size = size;
            }
            (QUEUE_ENABLE, _) => {
                // Writing 0 is reserved for VIRTIO_F_RING_RESET, which is not offered.
                if value != 1 {
                    return CommonWrite::Refused("queue_enable written with a value other than 1");
                }
                queue.enabled = true;
            }
            _ => {
                let field_start = offset & !7;
                let field = match field_start {
                    QUEUE_DESC => &mut queue.desc,
                    QUEUE_DRIVER => &mut queue.driver,
                    _ => &mut queue.device,
                };
                match (len, offset - field_start) {
                    (8, 0) => *field = value,
                    (4, 0) => *field = (*field & !0xffff_ffff) | value,
                    (4, 4) => *field = (*field & 0xffff_ffff) | (value << 32),
                    _ => return CommonWrite::Refused("misaligned queue address access"),
                }
            }
        }
        CommonWrite::Stored
    }

    /// What writing `written` to `device_status` means, given the status now.
    pub fn status_change(&self, written: u8) -> StatusChange {
        if written == 0 {
            return StatusChange::Reset;
        }
        // DEVICE_NEEDS_RESET is the device's to set.
        let mut status = (written & !STATUS_NEEDS_RESET) | (self.status & STATUS_NEEDS_RESET);
        if self.status & !status != 0 {
            return StatusChange::Ignored("the driver cleared device status bits without a reset");
        }
        let newly = status & !self.status;
        let mut refused = None;
        if newly & STATUS_FEATURES_OK != 0 {
            let refusal = if status & STATUS_DRIVER == 0 {
                Some("FEATURES_OK without DRIVER".to_string())
            } else {
                self.features_refusal()
            };
            if let Some(reason) = refusal {
                status &= !STATUS_FEATURES_OK;
                refused = Some(format!("FEATURES_OK refused: {reason}"));
            }
        }
        if newly & STATUS_DRIVER_OK != 0 && status & STATUS_FEATURES_OK == 0 {
            status &= !STATUS_DRIVER_OK;
            refused = Some(refused.unwrap_or_else(|| "DRIVER_OK without FEATURES_OK".into()));
        }
        let activate = newly & STATUS_DRIVER_OK != 0
            && status & STATUS_DRIVER_OK != 0
            && status & STATUS_NEEDS_RESET == 0;
        StatusChange::Update {
            status,
            activate,
            refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_ACKNOWLEDGE;

    const ACK: u8 = VIRTIO_CONFIG_S_ACKNOWLEDGE as u8;

    fn setup() -> (CommonConfig, VirtioPciInterrupt) {
        let features = offered_features(1 << 5 | bit(VIRTIO_F_ACCESS_PLATFORM));
        (
            CommonConfig::new(features, &[256, 8]),
            VirtioPciInterrupt::new(Vec::new(), 2),
        )
    }

    fn read(config: &CommonConfig, interrupt: &VirtioPciInterrupt, offset: u64, len: usize) -> u64 {
        let mut data = vec![0; len];
        config.read(offset, &mut data, interrupt);
        gpuvm_devices::pci::le_value(&data)
    }

    #[test]
    fn offered_features_drop_what_the_transport_lacks() {
        let (config, interrupt) = setup();
        assert_eq!(config.offered_features, 1 << 5 | 1 << 32);
        assert_eq!(read(&config, &interrupt, DEVICE_FEATURE, 4), 1 << 5);
        let mut config = config;
        config.write(DEVICE_FEATURE_SELECT, &1u32.to_le_bytes(), &interrupt);
        assert_eq!(read(&config, &interrupt, DEVICE_FEATURE, 4), 1);
        config.write(DEVICE_FEATURE_SELECT, &2u32.to_le_bytes(), &interrupt);
        assert_eq!(read(&config, &interrupt, DEVICE_FEATURE, 4), 0);
    }

    #[test]
    fn status_bits_only_accumulate() {
        let (mut config, _) = setup();
        config.status = ACK | STATUS_DRIVER;
        assert!(matches!(
            config.status_change(ACK),
            StatusChange::Ignored(_)
        ));
        assert_eq!(config.status_change(0), StatusChange::Reset);
        // DRIVER_OK before FEATURES_OK is dropped.
        match config.status_change(ACK | STATUS_DRIVER | STATUS_DRIVER_OK) {
            StatusChange::Update {
                status, activate, ..
            } => {
                assert_eq!(status, ACK | STATUS_DRIVER);
                assert!(!activate);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn queue_addresses_take_halves_and_whole() {
        let (mut config, interrupt) = setup();
        assert_eq!(
            config.write(QUEUE_DESC, &0x1000u32.to_le_bytes(), &interrupt),
            CommonWrite::Stored
        );
        config.write(QUEUE_DESC + 4, &0x2u32.to_le_bytes(), &interrupt);
        assert_eq!(read(&config, &interrupt, QUEUE_DESC, 8), 0x2_0000_1000);
        config.write(QUEUE_DEVICE, &0x3_0000_4000u64.to_le_bytes(), &interrupt);
        assert_eq!(config.queues[0].device, 0x3_0000_4000);
        assert!(matches!(
            config.write(QUEUE_DRIVER + 2, &[1, 2], &interrupt),
            CommonWrite::Refused(_)
        ));
        assert_eq!(config.queues[0].driver, 0);
    }
}
