//! MSI-X emulation: the capability's control word, the vector table and the PBA. Each
//! vector owns one GSI; while it is enabled and unmasked its GSI is routed to the message
//! the guest programmed, otherwise the route is removed.

use std::sync::Arc;

/// Bytes per MSI-X table entry (address low, address high, data, vector control).
pub const MSIX_ENTRY_SIZE: u64 = 16;
const CONTROL_ENABLE: u16 = 1 << 15;
const CONTROL_FUNCTION_MASK: u16 = 1 << 14;
const VECTOR_MASKED: u32 = 1;

/// An MSI message: where the device writes and what.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsiMessage {
    pub address: u64,
    pub data: u32,
}

/// Installs or removes the MSI route of a GSI (the VMM implements it with
/// KVM_SET_GSI_ROUTING; an irqfd on that GSI then delivers the message).
pub trait MsiRouting: Send + Sync {
    fn set_route(&self, gsi: u32, message: Option<MsiMessage>) -> std::io::Result<()>;
}

/// Where the MSI-X capability says the table and PBA live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixCapability {
    /// Offset of the capability in configuration space.
    pub offset: u16,
    pub vectors: u16,
    pub table_bar: u8,
    pub table_offset: u64,
    pub pba_bar: u8,
    pub pba_offset: u64,
}

impl MsixCapability {
    /// Parses the capability's dwords 0..3 (as read from configuration space at `offset`).
    pub fn parse(offset: u16, dwords: [u32; 3]) -> Self {
        let control = (dwords[0] >> 16) as u16;
        MsixCapability {
            offset,
            vectors: (control & 0x7ff) + 1,
            table_bar: (dwords[1] & 7) as u8,
            table_offset: u64::from(dwords[1] & !7),
            pba_bar: (dwords[2] & 7) as u8,
            pba_offset: u64::from(dwords[2] & !7),
        }
    }

    pub fn table_len(&self) -> u64 {
        u64::from(self.vectors) * MSIX_ENTRY_SIZE
    }

    pub fn pba_len(&self) -> u64 {
        u64::from(self.vectors).div_ceil(64) * 8
    }

    /// Offset of the message control word in configuration space.
    pub fn control_offset(&self) -> u16 {
        self.offset + 2
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    message: MsiMessage,
    control: u32,
}

impl Default for Entry {
    fn default() -> Self {
        // Vectors come out of reset masked.
        Entry {
            message: MsiMessage::default(),
            control: VECTOR_MASKED,
        }
    }
}

/// The MSI-X state of one function.
pub struct MsixTable {
    entries: Vec<Entry>,
    gsis: Vec<u32>,
    /// What is routed now per vector, to push only changes.
    routed: Vec<Option<MsiMessage>>,
    control: u16,
    router: Arc<dyn MsiRouting>,
}

impl std::fmt::Debug for MsixTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsixTable")
            .field("vectors", &self.entries.len())
            .field("control", &self.control)
            .finish()
    }
}

impl MsixTable {
    /// One vector per GSI in `gsis`.
    pub fn new(gsis: Vec<u32>, router: Arc<dyn MsiRouting>) -> Self {
        let count = gsis.len();
        MsixTable {
            entries: vec![Entry::default(); count],
            gsis,
            routed: vec![None; count],
            control: 0,
            router,
        }
    }

    pub fn enabled(&self) -> bool {
        self.control & CONTROL_ENABLE != 0
    }

    pub fn function_masked(&self) -> bool {
        self.control & CONTROL_FUNCTION_MASK != 0
    }

    /// The writable bits of the message control word (enable, function mask).
    pub fn control(&self) -> u16 {
        self.control
    }

    /// Sets the message control word; returns whether MSI-X enable changed.
    pub fn set_control(&mut self, control: u16) -> bool {
        let was_enabled = self.enabled();
        self.control = control & (CONTROL_ENABLE | CONTROL_FUNCTION_MASK);
        self.update_routes();
        was_enabled != self.enabled()
    }

    /// Reads table bytes at `offset` from the start of the table.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        let mut bytes = [0xffu8; MSIX_ENTRY_SIZE as usize];
        let index = (offset / MSIX_ENTRY_SIZE) as usize;
        if let Some(entry) = self.entries.get(index) {
            bytes[0..8].copy_from_slice(&entry.message.address.to_le_bytes());
            bytes[8..12].copy_from_slice(&entry.message.data.to_le_bytes());
            bytes[12..16].copy_from_slice(&entry.control.to_le_bytes());
        }
        super::read_le(&bytes, (offset % MSIX_ENTRY_SIZE) as usize, data);
    }

    /// Writes table bytes; a vector's route follows its message and mask bit.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) {
        let index = (offset / MSIX_ENTRY_SIZE) as usize;
        let Some(entry) = self.entries.get_mut(index) else {
            return;
        };
        let mut bytes = [0u8; MSIX_ENTRY_SIZE as usize];
        bytes[0..8].copy_from_slice(&entry.message.address.to_le_bytes());
        bytes[8..12].copy_from_slice(&entry.message.data.to_le_bytes());
        bytes[12..16].copy_from_slice(&entry.control.to_le_bytes());
        super::write_le(&mut bytes, (offset % MSIX_ENTRY_SIZE) as usize, data);
        let le64 = |b: &[u8]| super::le_value(b);
        entry.message.address = le64(&bytes[0..8]);
        entry.message.data = le64(&bytes[8..12]) as u32;
        entry.control = le64(&bytes[12..16]) as u32 & VECTOR_MASKED;
        self.update_routes();
    }

    /// Reads the PBA. Interrupts of masked vectors are dropped rather than left pending,
    /// so the PBA always reads zero.
    pub fn read_pba(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    /// The GSI of each vector.
    pub fn gsis(&self) -> &[u32] {
        &self.gsis
    }

    fn update_routes(&mut self) {
        let live = self.enabled() && !self.function_masked();
        for (index, entry) in self.entries.iter().enumerate() {
            let wanted = (live && entry.control & VECTOR_MASKED == 0).then_some(entry.message);
            if wanted == self.routed[index] {
                continue;
            }
            match self.router.set_route(self.gsis[index], wanted) {
                Ok(()) => self.routed[index] = wanted,
                Err(error) => log::warn!(
                    "MSI-X: cannot route vector {index} (GSI {}): {error}",
                    self.gsis[index]
                ),
            }
        }
    }
}

/// An [`MsiRouting`] that only records the routes it is given: for tests of MSI and MSI-X
/// emulation, here and in the passthrough crate (feature `test-util`).
#[cfg(any(test, feature = "test-util"))]
#[derive(Default)]
pub struct RecordedRoutes(std::sync::Mutex<std::collections::BTreeMap<u32, MsiMessage>>);

#[cfg(any(test, feature = "test-util"))]
impl RecordedRoutes {
    /// The routes as they stand now, by GSI.
    pub fn routes(&self) -> std::collections::BTreeMap<u32, MsiMessage> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(any(test, feature = "test-util"))]
impl MsiRouting for RecordedRoutes {
    fn set_route(&self, gsi: u32, message: Option<MsiMessage>) -> std::io::Result<()> {
        let mut routes = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match message {
            Some(message) => routes.insert(gsi, message),
            None => routes.remove(&gsi),
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_follow_enable_and_masks() {
        let recorder = Arc::new(RecordedRoutes::default());
        let mut table = MsixTable::new(vec![24, 25], recorder.clone());
        table.write_table(0, &0xfee0_0000u32.to_le_bytes());
        table.write_table(4, &0u32.to_le_bytes());
        table.write_table(8, &0x41u32.to_le_bytes());
        assert!(recorder.routes().is_empty(), "masked and disabled");
        table.write_table(12, &0u32.to_le_bytes());
        assert!(recorder.routes().is_empty(), "MSI-X still disabled");
        assert!(table.set_control(CONTROL_ENABLE));
        assert_eq!(
            recorder.routes().get(&24),
            Some(&MsiMessage {
                address: 0xfee0_0000,
                data: 0x41
            })
        );
        assert!(!recorder.routes().contains_key(&25));
        table.set_control(CONTROL_ENABLE | CONTROL_FUNCTION_MASK);
        assert!(recorder.routes().is_empty());
        table.set_control(CONTROL_ENABLE);
        let mut data = [0u8; 4];
        table.read_table(8, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x41);
        table.read_table(16 + 12, &mut data);
        assert_eq!(u32::from_le_bytes(data), 1, "vector 1 starts masked");
        // Past the table: ignored, reads all ones.
        table.write_table(64, &[1, 2, 3, 4]);
        table.read_table(64, &mut data);
        assert_eq!(data, [0xff; 4]);
    }

    #[test]
    fn capability_parses() {
        let cap = MsixCapability::parse(0x60, [0x0007_7011, 0x0080_0000, 0x0080_1000]);
        assert_eq!(cap.vectors, 8);
        assert_eq!(cap.table_bar, 0);
        assert_eq!(cap.table_offset, 0x80_0000);
        assert_eq!(cap.pba_offset, 0x80_1000);
        assert_eq!(cap.table_len(), 128);
        assert_eq!(cap.pba_len(), 8);
    }
}
