//! Emulated BAR registers: what the guest reads, sizing with all-ones writes, moves.

use super::config;

/// Index of the expansion ROM in [`BarSet`] (after BAR0..BAR5).
pub const ROM_INDEX: u8 = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Memory32 {
        prefetchable: bool,
    },
    /// Uses two BAR registers: this one and the next (the high dword).
    Memory64 {
        prefetchable: bool,
    },
    Rom,
}

/// A BAR a device has: its register index (0..=5, or 6 for the ROM), size and type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarSpec {
    pub index: u8,
    pub size: u64,
    pub kind: BarKind,
}

impl BarSpec {
    /// BARs are powers of two of at least 16 bytes (2 KiB for the ROM, whose address
    /// register starts at bit 11).
    pub fn is_valid(&self) -> bool {
        let min = if self.kind == BarKind::Rom { 2048 } else { 16 };
        let fits = match self.kind {
            BarKind::Memory32 { .. } => self.index <= 5 && self.size <= 1 << 31,
            BarKind::Memory64 { .. } => self.index <= 4,
            BarKind::Rom => self.index == ROM_INDEX && self.size <= 1 << 31,
        };
        fits && self.size.is_power_of_two() && self.size >= min
    }
}

/// A BAR where the guest (or the root at plug time) placed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciBar {
    pub index: u8,
    pub address: u64,
    pub size: u64,
    pub kind: BarKind,
}

/// The BAR registers of one function (0x10..0x28 and the ROM BAR at 0x30).
#[derive(Clone, Debug, Default)]
pub struct BarSet {
    specs: [Option<BarSpec>; 7],
    /// Raw register values as written, address bits only.
    regs: [u32; 7],
    memory_enabled: bool,
}

impl BarSet {
    /// Invalid specs (bad size, index, overlapping registers) are dropped with a warning:
    /// the guest then sees those BARs as absent.
    pub fn new(specs: &[BarSpec]) -> Self {
        let mut set = BarSet::default();
        for spec in specs {
            let index = usize::from(spec.index);
            let high_taken = matches!(spec.kind, BarKind::Memory64 { .. })
                && set.specs.get(index + 1).is_some_and(|s| s.is_some());
            if !spec.is_valid() || set.specs[index].is_some() || high_taken || set.is_high(index) {
                log::warn!("PCI: ignoring invalid BAR {spec:?}");
                continue;
            }
            set.specs[index] = Some(*spec);
        }
        set
    }

    pub fn specs(&self) -> Vec<BarSpec> {
        self.specs.iter().flatten().copied().collect()
    }

    /// Whether register `index` is the high dword of a 64-bit BAR.
    fn is_high(&self, index: usize) -> bool {
        index > 0
            && matches!(
                self.specs[index - 1],
                Some(BarSpec {
                    kind: BarKind::Memory64 { .. },
                    ..
                })
            )
    }

    /// The register index (0..=6) a config offset falls in, if it is a BAR register.
    pub fn register_index(offset: u16) -> Option<usize> {
        match offset {
            config::BAR0..config::BAR5_END => Some(usize::from((offset - config::BAR0) / 4)),
            config::ROM_BAR..=0x33 => Some(usize::from(ROM_INDEX)),
            _ => None,
        }
    }

    /// Whether `offset` is one of the BAR registers this set emulates.
    pub fn handles(offset: u16) -> bool {
        Self::register_index(offset).is_some()
    }

    fn register_value(&self, index: usize) -> u32 {
        if self.is_high(index) {
            return self.regs[index];
        }
        let Some(spec) = self.specs[index] else {
            return 0;
        };
        let flags = match spec.kind {
            BarKind::Memory32 { prefetchable } => u32::from(prefetchable) << 3,
            BarKind::Memory64 { prefetchable } => 0b100 | u32::from(prefetchable) << 3,
            BarKind::Rom => self.regs[index] & 1,
        };
        let address_mask = if spec.kind == BarKind::Rom {
            0xffff_f800
        } else {
            0xffff_fff0
        };
        (self.regs[index] & address_mask) | flags
    }

    /// Reads from a BAR register (`offset` inside 0x10..0x28 or 0x30..0x34).
    pub fn read(&self, offset: u16, data: &mut [u8]) {
        let Some(index) = Self::register_index(offset) else {
            return;
        };
        let value = self.register_value(index).to_le_bytes();
        super::read_le(&value, usize::from(offset % 4), data);
    }

    /// Writes a BAR register; the size bits stay zero, so all-ones reads back the size.
    pub fn write(&mut self, offset: u16, data: &[u8]) {
        let Some(index) = Self::register_index(offset) else {
            return;
        };
        let mut bytes = self.regs[index].to_le_bytes();
        super::write_le(&mut bytes, usize::from(offset % 4), data);
        let written = u32::from_le_bytes(bytes);
        self.regs[index] = written & self.writable_mask(index);
    }

    fn writable_mask(&self, index: usize) -> u32 {
        if self.is_high(index) {
            let size = self.specs[index - 1].map_or(0, |s| s.size);
            return (!(size - 1) >> 32) as u32;
        }
        match self.specs[index] {
            None => 0,
            Some(spec) if spec.kind == BarKind::Rom => (!(spec.size - 1) as u32) | 1,
            Some(spec) => !(spec.size - 1) as u32,
        }
    }

    /// Places BAR `index` at `address` (masked to its alignment).
    pub fn set_address(&mut self, index: u8, address: u64) {
        let index = usize::from(index);
        let Some(spec) = self.specs.get(index).copied().flatten() else {
            return;
        };
        let rom_enable = if spec.kind == BarKind::Rom { 1 } else { 0 };
        self.regs[index] = (address as u32 | rom_enable) & self.writable_mask(index);
        if matches!(spec.kind, BarKind::Memory64 { .. }) {
            self.regs[index + 1] = ((address >> 32) as u32) & self.writable_mask(index + 1);
        }
    }

    pub fn set_memory_enabled(&mut self, enabled: bool) {
        self.memory_enabled = enabled;
    }

    pub fn memory_enabled(&self) -> bool {
        self.memory_enabled
    }

    /// Every BAR at its programmed address, enabled or not.
    pub fn placed(&self) -> Vec<PciBar> {
        self.specs
            .iter()
            .flatten()
            .map(|spec| {
                let index = usize::from(spec.index);
                let mask = if spec.kind == BarKind::Rom {
                    0xffff_f800
                } else {
                    0xffff_fff0
                };
                let low = u64::from(self.regs[index] & mask);
                let high = match spec.kind {
                    BarKind::Memory64 { .. } => u64::from(self.regs[index + 1]) << 32,
                    _ => 0,
                };
                PciBar {
                    index: spec.index,
                    address: high | low,
                    size: spec.size,
                    kind: spec.kind,
                }
            })
            .collect()
    }

    /// The BARs that decode guest accesses now: memory decoding on, a non-zero address,
    /// the ROM only when its enable bit is set.
    pub fn active(&self) -> Vec<PciBar> {
        if !self.memory_enabled {
            return Vec::new();
        }
        self.placed()
            .into_iter()
            .filter(|bar| {
                bar.address != 0
                    && bar.address.checked_add(bar.size).is_some()
                    && (bar.kind != BarKind::Rom || self.regs[usize::from(ROM_INDEX)] & 1 == 1)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read32(set: &BarSet, offset: u16) -> u32 {
        let mut data = [0; 4];
        set.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn gpu_bars() -> BarSet {
        BarSet::new(&[
            BarSpec {
                index: 0,
                size: 16 << 20,
                kind: BarKind::Memory32 {
                    prefetchable: false,
                },
            },
            BarSpec {
                index: 1,
                size: 128 << 30,
                kind: BarKind::Memory64 { prefetchable: true },
            },
            BarSpec {
                index: 6,
                size: 512 << 10,
                kind: BarKind::Rom,
            },
        ])
    }

    #[test]
    fn sizing_reads_back_size_and_flags() {
        let mut set = gpu_bars();
        for offset in [0x10, 0x14, 0x18, 0x30] {
            set.write(offset, &0xffff_ffffu32.to_le_bytes());
        }
        assert_eq!(read32(&set, 0x10), 0xff00_0000);
        // 64-bit prefetchable: type bits 10b, prefetch bit 3.
        assert_eq!(read32(&set, 0x14), 0x0000_000c);
        assert_eq!(read32(&set, 0x18), 0xffff_ffe0);
        let size64 =
            !((u64::from(read32(&set, 0x18)) << 32) | u64::from(read32(&set, 0x14) & !0xf)) + 1;
        assert_eq!(size64, 128 << 30);
        assert_eq!(read32(&set, 0x30) & !1, 0xfff8_0000);
        // Absent BARs read zero and ignore writes.
        set.write(0x1c, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(read32(&set, 0x1c), 0);
    }

    #[test]
    fn programming_moves_bars_and_decoding_gates_them() {
        let mut set = gpu_bars();
        set.set_address(0, 0xc100_0000);
        set.set_address(1, 0x40_0000_0000);
        assert!(set.active().is_empty());
        set.set_memory_enabled(true);
        let active = set.active();
        assert_eq!(active.len(), 2, "ROM stays off until enabled: {active:?}");
        assert_eq!(active[1].address, 0x40_0000_0000);
        // Guest moves BAR0 with a byte-wise write of the top byte.
        set.write(0x13, &[0xd0]);
        assert_eq!(set.active()[0].address, 0xd000_0000);
        assert_eq!(read32(&set, 0x10), 0xd000_0000);
        // Enabling the ROM.
        set.write(0x30, &0xfe00_0001u32.to_le_bytes());
        let rom = set.active().into_iter().find(|b| b.kind == BarKind::Rom);
        assert_eq!(rom.map(|b| b.address), Some(0xfe00_0000));
    }

    #[test]
    fn invalid_specs_are_dropped() {
        let set = BarSet::new(&[
            BarSpec {
                index: 0,
                size: 1000,
                kind: BarKind::Memory32 {
                    prefetchable: false,
                },
            },
            BarSpec {
                index: 5,
                size: 4096,
                kind: BarKind::Memory64 {
                    prefetchable: false,
                },
            },
        ]);
        assert!(set.specs().is_empty());
    }
}
