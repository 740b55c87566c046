//! Instructions the host's KVM instruction emulator may lack, handled in the VMM.
//!
//! On hosts where guest ring 0 runs under KVM's instruction emulator (nested, software
//! assisted; see ENVIRONMENT.md), KVM_RUN fails with an emulation internal error for a
//! handful of instructions a Linux kernel uses early. The exit carries the instruction
//! bytes; the few whose effect is simple are carried out here. Everything else is
//! reported with its bytes so the user knows what stopped the guest.

use kvm_bindings::kvm_regs;

const RFLAGS_AC: u64 = 1 << 18;
/// #BP, the exception `int3` raises.
pub const BREAKPOINT_VECTOR: u8 = 3;

/// What a failed instruction turns into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emulation {
    /// `int3`: advance RIP past it and inject #BP (a trap: RIP points after it).
    Breakpoint,
    /// `fwait`: nothing to wait for without x87 exceptions pending.
    Nop { len: u8 },
    /// `clac` / `stac`.
    SetAlignmentCheck { set: bool },
    /// `popcnt reg, reg` in 16/32/64-bit operand size.
    Popcnt {
        len: u8,
        dest: u8,
        src: u8,
        width: u8,
    },
}

impl Emulation {
    /// The instruction's length in bytes (never zero, so no `is_empty`).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u8 {
        match self {
            Emulation::Breakpoint => 1,
            Emulation::Nop { len } | Emulation::Popcnt { len, .. } => *len,
            Emulation::SetAlignmentCheck { .. } => 3,
        }
    }
}

/// Recognises the instructions gpuvm can complete itself.
pub fn decode(bytes: &[u8]) -> Option<Emulation> {
    match bytes {
        [0xcc, ..] => return Some(Emulation::Breakpoint),
        [0x9b, ..] => return Some(Emulation::Nop { len: 1 }),
        [0x0f, 0x01, 0xca, ..] => return Some(Emulation::SetAlignmentCheck { set: false }),
        [0x0f, 0x01, 0xcb, ..] => return Some(Emulation::SetAlignmentCheck { set: true }),
        _ => {}
    }
    decode_popcnt(bytes)
}

/// `[66] F3 [REX] 0F B8 /r` with a register operand (mod = 11).
fn decode_popcnt(bytes: &[u8]) -> Option<Emulation> {
    let mut index = 0;
    let mut operand_16 = false;
    let mut has_rep = false;
    while let Some(&byte) = bytes.get(index) {
        match byte {
            0x66 => operand_16 = true,
            0xf3 => has_rep = true,
            _ => break,
        }
        index += 1;
    }
    if !has_rep {
        return None;
    }
    let mut rex = 0u8;
    if let Some(&byte) = bytes.get(index) {
        if byte & 0xf0 == 0x40 {
            rex = byte;
            index += 1;
        }
    }
    if bytes.get(index..index + 2)? != [0x0f, 0xb8] {
        return None;
    }
    let modrm = *bytes.get(index + 2)?;
    if modrm >> 6 != 0b11 {
        return None; // memory operand: not handled
    }
    let width = if rex & 0x08 != 0 {
        64
    } else if operand_16 {
        16
    } else {
        32
    };
    Some(Emulation::Popcnt {
        len: (index + 3) as u8,
        dest: ((modrm >> 3) & 7) | ((rex & 0x4) << 1),
        src: (modrm & 7) | ((rex & 0x1) << 3),
        width,
    })
}

fn gpr_mut(regs: &mut kvm_regs, index: u8) -> &mut u64 {
    match index & 0xf {
        0 => &mut regs.rax,
        1 => &mut regs.rcx,
        2 => &mut regs.rdx,
        3 => &mut regs.rbx,
        4 => &mut regs.rsp,
        5 => &mut regs.rbp,
        6 => &mut regs.rsi,
        7 => &mut regs.rdi,
        8 => &mut regs.r8,
        9 => &mut regs.r9,
        10 => &mut regs.r10,
        11 => &mut regs.r11,
        12 => &mut regs.r12,
        13 => &mut regs.r13,
        14 => &mut regs.r14,
        _ => &mut regs.r15,
    }
}

/// Applies the instruction's effect to `regs` and advances RIP. Returns the exception
/// vector to inject afterwards, if any.
pub fn apply(emulation: Emulation, regs: &mut kvm_regs) -> Option<u8> {
    regs.rip = regs.rip.wrapping_add(u64::from(emulation.len()));
    match emulation {
        Emulation::Breakpoint => return Some(BREAKPOINT_VECTOR),
        Emulation::Nop { .. } => {}
        Emulation::SetAlignmentCheck { set } => {
            if set {
                regs.rflags |= RFLAGS_AC;
            } else {
                regs.rflags &= !RFLAGS_AC;
            }
        }
        Emulation::Popcnt {
            dest, src, width, ..
        } => {
            let source = *gpr_mut(regs, src);
            let value = match width {
                16 => source & 0xffff,
                32 => source & 0xffff_ffff,
                _ => source,
            };
            let count = u64::from(value.count_ones());
            let dest = gpr_mut(regs, dest);
            // A 16-bit destination keeps its upper bits; 32-bit writes zero-extend.
            *dest = if width == 16 {
                (*dest & !0xffff) | count
            } else {
                count
            };
            // POPCNT clears OF SF ZF AF CF PF and sets ZF when the source is zero.
            const ARITH_FLAGS: u64 = 0x8d5;
            regs.rflags &= !ARITH_FLAGS;
            if value == 0 {
                regs.rflags |= 1 << 6;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_simple_instructions() {
        assert_eq!(decode(&[0xcc, 0x90]), Some(Emulation::Breakpoint));
        assert_eq!(decode(&[0x9b]), Some(Emulation::Nop { len: 1 }));
        assert_eq!(
            decode(&[0x0f, 0x01, 0xca]),
            Some(Emulation::SetAlignmentCheck { set: false })
        );
        assert_eq!(
            decode(&[0x0f, 0x01, 0xcb]),
            Some(Emulation::SetAlignmentCheck { set: true })
        );
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[0x0f, 0xc7, 0x0e]), None); // cmpxchg16b: not ours
    }

    #[test]
    fn popcnt_register_forms() {
        // popcnt %rdi,%rax = f3 48 0f b8 c7
        let op = decode(&[0xf3, 0x48, 0x0f, 0xb8, 0xc7]).unwrap();
        assert_eq!(
            op,
            Emulation::Popcnt {
                len: 5,
                dest: 0,
                src: 7,
                width: 64
            }
        );
        let mut regs = kvm_regs {
            rdi: 0xffff_0000_0000_0001,
            rax: 99,
            rip: 0x1000,
            rflags: 0x2 | 0x40,
            ..Default::default()
        };
        assert_eq!(apply(op, &mut regs), None);
        assert_eq!(regs.rax, 17);
        assert_eq!(regs.rip, 0x1005);
        assert_eq!(regs.rflags & 0x40, 0, "ZF cleared for a non-zero source");

        // popcnt %r9d,%r10d = f3 45 0f b8 d1 ; 32-bit, zero source sets ZF
        let op = decode(&[0xf3, 0x45, 0x0f, 0xb8, 0xd1]).unwrap();
        assert_eq!(
            op,
            Emulation::Popcnt {
                len: 5,
                dest: 10,
                src: 9,
                width: 32
            }
        );
        let mut regs = kvm_regs {
            r9: 0xffff_ffff_0000_0000,
            r10: u64::MAX,
            rflags: 0x2,
            ..Default::default()
        };
        apply(op, &mut regs);
        assert_eq!(regs.r10, 0);
        assert_ne!(regs.rflags & 0x40, 0);

        // Memory operand is left to the caller to report.
        assert_eq!(decode(&[0xf3, 0x48, 0x0f, 0xb8, 0x07]), None);
    }

    #[test]
    fn breakpoint_injects_bp_after_advancing() {
        let mut regs = kvm_regs {
            rip: 0x2000,
            ..Default::default()
        };
        assert_eq!(
            apply(Emulation::Breakpoint, &mut regs),
            Some(BREAKPOINT_VECTOR)
        );
        assert_eq!(regs.rip, 0x2001);
    }

    #[test]
    fn clac_clears_ac() {
        let mut regs = kvm_regs {
            rflags: 0x2 | RFLAGS_AC,
            ..Default::default()
        };
        apply(Emulation::SetAlignmentCheck { set: false }, &mut regs);
        assert_eq!(regs.rflags & RFLAGS_AC, 0);
        assert_eq!(regs.rip, 3);
    }
}
