//! Code at the x86 reset vector (0xFFFF0), which a real machine's BIOS supplies and a
//! direct-boot VMM must supply itself.
//!
//! Linux's `reboot` on a machine with hardware-reduced ACPI and no EFI ends up in
//! `machine_real_restart`: it drops to real mode and jumps to F000:FFF0, expecting firmware
//! to reset the machine. Without firmware that address holds zeros, which decode as
//! `add [bx+si], al` forever: the guest spins and the VMM never learns of the reboot. The
//! stub here does what a BIOS's reset path ends in: it pulses the reset line through the
//! i8042 (command 0xFE on port 0x64), which gpuvm turns into the end of the run.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Where a CPU starts after reset, and where Linux's real-mode restart jumps (F000:FFF0).
pub const RESET_VECTOR: u64 = 0xffff0;

/// `mov al, 0xfe; out 0x64, al; 1: cli; hlt; jmp 1b` in 16-bit code.
const RESET_STUB: [u8; 8] = [
    0xb0, 0xfe, // mov al, 0xfe       i8042 command: pulse the CPU reset line
    0xe6, 0x64, // out 0x64, al
    0xfa, // cli
    0xf4, // hlt                      not reached: the VMM ends the run on the write
    0xeb, 0xfc, // jmp short -4       back to cli
];

// The stub ends below 1 MiB, above the MP table (layout.rs).
const _: () = assert!(RESET_VECTOR + RESET_STUB.len() as u64 <= super::layout::BIOS_AREA_END);
const _: () = assert!(RESET_VECTOR > super::layout::MPTABLE_CONFIG_START);

#[derive(Debug, thiserror::Error)]
#[error("failed to write the reset vector stub into guest memory: {0}")]
pub struct ResetVectorError(#[from] vm_memory::GuestMemoryError);

/// Writes the reset stub at [`RESET_VECTOR`] (inside the reserved BIOS area of the e820 map).
pub fn setup_reset_vector(mem: &GuestMemoryMmap) -> Result<(), ResetVectorError> {
    mem.write_slice(&RESET_STUB, GuestAddress(RESET_VECTOR))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stub_resets_through_the_i8042_and_loops_on_itself() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        setup_reset_vector(&mem).unwrap();
        let mut code = [0u8; 8];
        mem.read_slice(&mut code, GuestAddress(RESET_VECTOR))
            .unwrap();
        // mov al, 0xfe; out 0x64, al: the i8042's reset command (devices/src/i8042.rs).
        assert_eq!(code[..4], [0xb0, 0xfe, 0xe6, 0x64]);
        // The jump at the end lands on the cli: rel8 counts from the next instruction.
        let jump_end = 8i64;
        let target = jump_end + i64::from(code[7] as i8);
        assert_eq!(code[6], 0xeb);
        assert_eq!(code[target as usize], 0xfa);
    }

    #[test]
    fn memory_without_the_first_mib_is_an_error() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        assert!(setup_reset_vector(&mem).is_err());
    }
}
