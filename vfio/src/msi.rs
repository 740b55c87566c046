//! MSI capability emulation for passthrough functions: the guest's writes to the
//! capability stay in a shadow copy; enabled vectors are routed to their GSIs and the
//! device is told to signal the matching eventfds.

use std::sync::Arc;

use gpuvm_devices::pci::{MsiMessage, MsiRouting};
use vmm_sys_util::eventfd::EventFd;

pub const CAP_ID_MSI: u8 = 0x05;
const CONTROL_ENABLE: u16 = 1;
const CONTROL_64BIT: u16 = 1 << 7;
const CONTROL_PER_VECTOR_MASK: u16 = 1 << 8;

/// What the device needs to hear after a capability write.
#[derive(Debug, PartialEq, Eq)]
pub enum MsiChange {
    None,
    /// Enable MSI with this many vectors.
    Enable(usize),
    Disable,
}

pub struct MsiState {
    /// Offset of the capability in configuration space.
    pub offset: u16,
    shadow: [u8; 24],
    gsis: Vec<u32>,
    pub eventfds: Vec<EventFd>,
    routed: Vec<Option<MsiMessage>>,
    router: Arc<dyn MsiRouting>,
}

impl MsiState {
    /// `capability` holds the device's 24 bytes from `offset`; one GSI per vector the
    /// device can do (`1 << MMC`, at most 32).
    pub fn new(
        offset: u16,
        capability: [u8; 24],
        vectors: Vec<(u32, EventFd)>,
        router: Arc<dyn MsiRouting>,
    ) -> Self {
        let mut shadow = capability;
        // Starts disabled with one vector, whatever the device had.
        shadow[2] &= !(CONTROL_ENABLE as u8 | 0x70);
        let (gsis, eventfds): (Vec<u32>, Vec<EventFd>) = vectors.into_iter().unzip();
        let count = gsis.len();
        MsiState {
            offset,
            shadow,
            gsis,
            eventfds,
            routed: vec![None; count],
            router,
        }
    }

    /// Vectors the device supports (Multiple Message Capable).
    pub fn capable_vectors(capability: &[u8; 24]) -> u32 {
        1 << ((capability[2] >> 1) & 7).min(5)
    }

    fn control(&self) -> u16 {
        u16::from_le_bytes([self.shadow[2], self.shadow[3]])
    }

    /// Bytes of the capability: 64-bit capable ones are 14 (24 with masking), else 10 (20).
    pub fn byte_len(&self) -> u16 {
        let control = self.control();
        let base = if control & CONTROL_64BIT != 0 { 14 } else { 10 };
        if control & CONTROL_PER_VECTOR_MASK != 0 {
            base + 10
        } else {
            base
        }
    }

    pub fn contains(&self, offset: u16, len: usize) -> bool {
        offset < self.offset + self.byte_len() && offset + len as u16 > self.offset
    }

    pub fn enabled(&self) -> bool {
        self.control() & CONTROL_ENABLE != 0
    }

    pub fn read(&self, offset: u16, data: &mut [u8]) {
        for (i, byte) in data.iter_mut().enumerate() {
            let at = (offset + i as u16).wrapping_sub(self.offset);
            if let Some(value) = self
                .shadow
                .get(usize::from(at))
                .filter(|_| at < self.byte_len())
            {
                *byte = *value;
            }
        }
    }

    /// Applies a guest write (read-only bits stay) and says what the device must do.
    pub fn write(&mut self, offset: u16, data: &[u8]) -> MsiChange {
        let was_enabled = self.enabled();
        let sixty_four = self.control() & CONTROL_64BIT != 0;
        let mask_offset = if sixty_four { 16 } else { 12 };
        for (i, byte) in data.iter().enumerate() {
            let at = usize::from((offset + i as u16).wrapping_sub(self.offset));
            if at >= usize::from(self.byte_len()) {
                continue;
            }
            let writable = match at {
                2 => 0x71, // enable, multiple message enable
                4 => 0xfc, // address is dword aligned
                5..=7 => 0xff,
                8..=11 if sixty_four => 0xff,
                8 | 9 if !sixty_four => 0xff,
                12 | 13 if sixty_four => 0xff,
                m if m >= mask_offset && m < mask_offset + 4 => 0xff,
                _ => 0,
            };
            self.shadow[at] = (self.shadow[at] & !writable) | (byte & writable);
        }
        // MME may not exceed MMC.
        let mmc = (self.shadow[2] >> 1) & 7;
        let mme = (self.shadow[2] >> 4) & 7;
        if mme > mmc {
            self.shadow[2] = (self.shadow[2] & !0x70) | (mmc << 4);
        }
        self.update_routes();
        match (was_enabled, self.enabled()) {
            (false, true) => MsiChange::Enable(self.active_vectors()),
            (true, false) => MsiChange::Disable,
            _ => MsiChange::None,
        }
    }

    /// The vectors the guest enabled (Multiple Message Enable).
    pub fn active_vectors(&self) -> usize {
        (1usize << ((self.shadow[2] >> 4) & 7)).min(self.gsis.len())
    }

    fn message(&self, vector: usize) -> MsiMessage {
        let le32 = |at: usize| {
            u32::from_le_bytes([
                self.shadow[at],
                self.shadow[at + 1],
                self.shadow[at + 2],
                self.shadow[at + 3],
            ])
        };
        let sixty_four = self.control() & CONTROL_64BIT != 0;
        let (high, data_at) = if sixty_four { (le32(8), 12) } else { (0, 8) };
        let data = u16::from_le_bytes([self.shadow[data_at], self.shadow[data_at + 1]]);
        MsiMessage {
            address: u64::from(high) << 32 | u64::from(le32(4)),
            // Multiple vectors differ in the low data bits.
            data: u32::from(data) | vector as u32,
        }
    }

    fn masked(&self, vector: usize) -> bool {
        if self.control() & CONTROL_PER_VECTOR_MASK == 0 {
            return false;
        }
        let at = if self.control() & CONTROL_64BIT != 0 {
            16
        } else {
            12
        };
        let mask = u32::from_le_bytes([
            self.shadow[at],
            self.shadow[at + 1],
            self.shadow[at + 2],
            self.shadow[at + 3],
        ]);
        mask & (1 << vector) != 0
    }

    fn update_routes(&mut self) {
        let active = if self.enabled() {
            self.active_vectors()
        } else {
            0
        };
        for vector in 0..self.gsis.len() {
            let wanted = (vector < active && !self.masked(vector)).then(|| self.message(vector));
            if wanted == self.routed[vector] {
                continue;
            }
            match self.router.set_route(self.gsis[vector], wanted) {
                Ok(()) => self.routed[vector] = wanted,
                Err(error) => log::warn!("MSI: cannot route vector {vector}: {error}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvm_devices::pci::RecordedRoutes;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[test]
    fn multi_message_msi_routes_and_masks() {
        // 64-bit, per-vector masking, 4 vectors capable (MMC = 2).
        let mut capability = [0u8; 24];
        capability[0] = CAP_ID_MSI;
        capability[2] = 2 << 1 | 0x80;
        capability[3] = 0x01;
        assert_eq!(MsiState::capable_vectors(&capability), 4);
        let vectors = (0..4)
            .map(|i| (30 + i, EventFd::new(EFD_NONBLOCK).unwrap()))
            .collect();
        let routes = Arc::new(RecordedRoutes::default());
        let mut msi = MsiState::new(0x50, capability, vectors, routes.clone());
        assert_eq!(msi.byte_len(), 24);
        assert!(msi.contains(0x50 + 20, 4) && !msi.contains(0x50 + 24, 4));
        assert_eq!(
            msi.write(0x54, &0xfee0_1000u32.to_le_bytes()),
            MsiChange::None
        );
        msi.write(0x58, &0u32.to_le_bytes());
        msi.write(0x5c, &0x4020u16.to_le_bytes());
        msi.write(0x60, &0b0100u32.to_le_bytes()); // mask vector 2
                                                   // Enable with MME = 3 (8 vectors): capped to MMC, 4 vectors.
        assert_eq!(msi.write(0x52, &[0x31, 0x01]), MsiChange::Enable(4));
        let mut control = [0u8; 2];
        msi.read(0x52, &mut control);
        assert_eq!(
            control,
            [0x25 | 0x80, 0x01],
            "MME capped to 2; read-only bits kept"
        );
        let routed = routes.routes();
        assert_eq!(routed.len(), 3, "{routed:?}");
        assert_eq!(
            routed[&33],
            MsiMessage {
                address: 0xfee0_1000,
                data: 0x4023
            }
        );
        assert!(!routed.contains_key(&32), "masked");
        assert_eq!(msi.write(0x52, &[0x00]), MsiChange::Disable);
        assert!(routes.routes().is_empty());
    }
}
