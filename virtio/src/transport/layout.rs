//! Where everything lives: the configuration space header and capabilities, and the
//! fixed offsets of the transport's structures in BAR0.

use gpuvm_devices::pci::config;
use virtio_bindings::virtio_ids::{VIRTIO_ID_BLOCK, VIRTIO_ID_NET};

/// The PCI vendor of virtio (Red Hat, Inc.).
pub const VENDOR_ID: u16 = 0x1af4;
/// Modern virtio devices are 0x1040 + the virtio device type.
pub const DEVICE_ID_BASE: u16 = 0x1040;
/// Modern-only devices have revision 1 or more.
pub const REVISION: u8 = 1;
/// Subsystem 1af4:1100, what pci.ids knows as "QEMU Virtual Machine"; drivers of modern
/// devices ignore it.
pub const SUBSYSTEM_VENDOR_ID: u16 = 0x1af4;
pub const SUBSYSTEM_ID: u16 = 0x1100;

/// The one BAR: 64-bit memory, not prefetchable (its registers have side effects).
pub const BAR_INDEX: u8 = 0;
pub const BAR_SIZE: u64 = 0x1_0000;

/// `struct virtio_pci_common_cfg` up to and including the virtio 1.2 admin queue fields
/// (which read zero: their features are not offered).
pub const COMMON_OFFSET: u64 = 0x0000;
pub const COMMON_LEN: u64 = 0x40;
/// The ISR status byte (read to clear).
pub const ISR_OFFSET: u64 = 0x1000;
pub const ISR_LEN: u64 = 4;
/// The device-specific configuration.
pub const DEVICE_OFFSET: u64 = 0x2000;
pub const DEVICE_LEN: u64 = 0x1000;
/// Queue `q` is notified at `NOTIFY_OFFSET + q * NOTIFY_OFF_MULTIPLIER` (its
/// `queue_notify_off` is `q`).
pub const NOTIFY_OFFSET: u64 = 0x3000;
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
/// The MSI-X table (up to 2048 vectors) and pending bit array.
pub const MSIX_TABLE_OFFSET: u64 = 0x4000;
pub const MSIX_PBA_OFFSET: u64 = 0xc000;
/// The notify area is one page.
pub const MAX_QUEUES: usize = 0x1000 / NOTIFY_OFF_MULTIPLIER as usize;

/// `cfg_type` of the virtio vendor capabilities (`VIRTIO_PCI_CAP_*`; virtio-bindings has
/// no virtio_pci module).
pub const CAP_COMMON_CFG: u8 = 1;
pub const CAP_NOTIFY_CFG: u8 = 2;
pub const CAP_ISR_CFG: u8 = 3;
pub const CAP_DEVICE_CFG: u8 = 4;
pub const CAP_PCI_CFG: u8 = 5;
const CAP_ID_VENDOR: u8 = 0x09;

/// Capability offsets in configuration space, chained in this order.
pub const CAP_COMMON_AT: u16 = 0x40;
pub const CAP_ISR_AT: u16 = 0x50;
pub const CAP_DEVICE_AT: u16 = 0x60;
pub const CAP_NOTIFY_AT: u16 = 0x70;
pub const CAP_PCI_CFG_AT: u16 = 0x84;
pub const CAP_MSIX_AT: u16 = 0x98;
/// `struct virtio_pci_cfg_cap`: the window the driver programs (bar, offset, length) and
/// the data dword that accesses BAR memory through configuration space.
pub const PCI_CFG_BAR: u16 = CAP_PCI_CFG_AT + 4;
pub const PCI_CFG_OFFSET: u16 = CAP_PCI_CFG_AT + 8;
pub const PCI_CFG_LENGTH: u16 = CAP_PCI_CFG_AT + 12;
pub const PCI_CFG_DATA: u16 = CAP_PCI_CFG_AT + 16;
/// The emulated configuration space ends here; the rest reads zero.
pub const CONFIG_IMAGE_LEN: usize = 0x100;

/// The PCI device ID of a virtio device type (types past 16 bits are clamped, not wrapped).
pub fn device_id(device_type: u32) -> u16 {
    DEVICE_ID_BASE.saturating_add(u16::try_from(device_type).unwrap_or(u16::MAX))
}

/// The PCI class code (class, subclass, programming interface) of a virtio device type.
pub fn class_code(device_type: u32) -> u32 {
    match device_type {
        VIRTIO_ID_BLOCK => 0x01_80_00,
        VIRTIO_ID_NET => 0x02_00_00,
        _ => 0xff_00_00,
    }
}

/// The read-only part of configuration space: header, capability chain and the MSI-X
/// capability's static fields. The transport overlays what the guest can write (command,
/// BARs, MSI-X control, the PCI_CFG window).
pub fn config_image(device_type: u32, queues: usize, vectors: u16) -> [u8; CONFIG_IMAGE_LEN] {
    let mut image = [0u8; CONFIG_IMAGE_LEN];
    let mut put = |offset: u16, bytes: &[u8]| {
        let start = usize::from(offset);
        image[start..start + bytes.len()].copy_from_slice(bytes);
    };
    put(config::VENDOR_ID, &VENDOR_ID.to_le_bytes());
    put(config::DEVICE_ID, &device_id(device_type).to_le_bytes());
    put(config::STATUS, &config::STATUS_CAPABILITIES.to_le_bytes());
    let class_revision = class_code(device_type) << 8 | u32::from(REVISION);
    put(config::CLASS_REVISION, &class_revision.to_le_bytes());
    put(0x2c, &SUBSYSTEM_VENDOR_ID.to_le_bytes());
    put(0x2e, &SUBSYSTEM_ID.to_le_bytes());
    put(config::CAPABILITIES_POINTER, &[CAP_COMMON_AT as u8]);

    let notify_len = (queues as u64 * u64::from(NOTIFY_OFF_MULTIPLIER)).max(4);
    let virtio_caps: [(u16, u8, u64, u64, u16); 5] = [
        (
            CAP_COMMON_AT,
            CAP_COMMON_CFG,
            COMMON_OFFSET,
            COMMON_LEN,
            CAP_ISR_AT,
        ),
        (CAP_ISR_AT, CAP_ISR_CFG, ISR_OFFSET, ISR_LEN, CAP_DEVICE_AT),
        (
            CAP_DEVICE_AT,
            CAP_DEVICE_CFG,
            DEVICE_OFFSET,
            DEVICE_LEN,
            CAP_NOTIFY_AT,
        ),
        (
            CAP_NOTIFY_AT,
            CAP_NOTIFY_CFG,
            NOTIFY_OFFSET,
            notify_len,
            CAP_PCI_CFG_AT,
        ),
        // The PCI_CFG capability's bar/offset/length are the driver's window, not a region.
        (CAP_PCI_CFG_AT, CAP_PCI_CFG, 0, 0, CAP_MSIX_AT),
    ];
    for (at, cfg_type, offset, length, next) in virtio_caps {
        let cap_len: u8 = if matches!(cfg_type, CAP_NOTIFY_CFG | CAP_PCI_CFG) {
            20
        } else {
            16
        };
        let bar = if cfg_type == CAP_PCI_CFG {
            0
        } else {
            BAR_INDEX
        };
        put(
            at,
            &[CAP_ID_VENDOR, next as u8, cap_len, cfg_type, bar, 0, 0, 0],
        );
        put(at + 8, &(offset as u32).to_le_bytes());
        put(at + 12, &(length as u32).to_le_bytes());
    }
    put(CAP_NOTIFY_AT + 16, &NOTIFY_OFF_MULTIPLIER.to_le_bytes());

    put(CAP_MSIX_AT, &[config::CAP_ID_MSIX, 0]);
    put(
        CAP_MSIX_AT + 2,
        &(vectors.saturating_sub(1) & 0x7ff).to_le_bytes(),
    );
    put(
        CAP_MSIX_AT + 4,
        &(MSIX_TABLE_OFFSET as u32 | u32::from(BAR_INDEX)).to_le_bytes(),
    );
    put(
        CAP_MSIX_AT + 8,
        &(MSIX_PBA_OFFSET as u32 | u32::from(BAR_INDEX)).to_le_bytes(),
    );
    image
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvm_devices::pci::MsixCapability;

    fn dword(image: &[u8], at: u16) -> u32 {
        let at = usize::from(at);
        u32::from_le_bytes(image[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn regions_fit_the_bar_without_overlap() {
        let regions = [
            (COMMON_OFFSET, COMMON_LEN),
            (ISR_OFFSET, ISR_LEN),
            (DEVICE_OFFSET, DEVICE_LEN),
            (
                NOTIFY_OFFSET,
                MAX_QUEUES as u64 * u64::from(NOTIFY_OFF_MULTIPLIER),
            ),
            (MSIX_TABLE_OFFSET, 2048 * 16),
            (MSIX_PBA_OFFSET, 2048 / 8),
        ];
        for (i, (start, len)) in regions.iter().enumerate() {
            assert!(start + len <= BAR_SIZE);
            for (other_start, other_len) in &regions[i + 1..] {
                assert!(start + len <= *other_start || other_start + other_len <= *start);
            }
        }
        assert!(BAR_SIZE.is_power_of_two());
    }

    #[test]
    fn capability_chain_walks_to_msix() {
        let image = config_image(2, 3, 4);
        assert_eq!(dword(&image, 0), 0x1042_1af4);
        assert_eq!(dword(&image, 8), 0x0180_0001);
        let mut pointer = image[usize::from(config::CAPABILITIES_POINTER)];
        let mut seen = Vec::new();
        while pointer != 0 {
            let at = usize::from(pointer);
            seen.push((image[at], image[at + 3]));
            pointer = image[at + 1];
        }
        assert_eq!(
            seen,
            [
                (9, CAP_COMMON_CFG),
                (9, CAP_ISR_CFG),
                (9, CAP_DEVICE_CFG),
                (9, CAP_NOTIFY_CFG),
                (9, CAP_PCI_CFG),
                (config::CAP_ID_MSIX, 0)
            ]
        );
        assert_eq!(dword(&image, CAP_NOTIFY_AT + 12), 12, "3 queues × 4 bytes");
        assert_eq!(dword(&image, CAP_NOTIFY_AT + 16), 4);
        let msix = MsixCapability::parse(
            CAP_MSIX_AT,
            [
                dword(&image, CAP_MSIX_AT),
                dword(&image, CAP_MSIX_AT + 4),
                dword(&image, CAP_MSIX_AT + 8),
            ],
        );
        assert_eq!(msix.vectors, 4);
        assert_eq!(msix.table_offset, MSIX_TABLE_OFFSET);
        assert_eq!(msix.pba_offset, MSIX_PBA_OFFSET);
    }
}
