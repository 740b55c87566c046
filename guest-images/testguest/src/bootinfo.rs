//! `struct hvm_start_info` (PVH boot protocol), copied into the image before anything can
//! overwrite it (the AP trampoline goes to low memory).

const START_INFO_MAGIC: u32 = 0x336e_c578;
const MAX_CMDLINE: usize = 1024;
pub const MAX_MEMMAP: usize = 128;
pub const E820_RAM: u32 = 1;

#[derive(Clone, Copy, Default)]
pub struct MemmapEntry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

pub struct BootInfo {
    cmdline: [u8; MAX_CMDLINE],
    cmdline_len: usize,
    memmap: [MemmapEntry; MAX_MEMMAP],
    memmap_len: usize,
    pub rsdp_paddr: u64,
}

pub enum BootInfoError {
    NoStartInfo,
    BadMagic(u32),
}

impl core::fmt::Display for BootInfoError {
    fn fmt(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
        match self {
            BootInfoError::NoStartInfo => write!(f, "no hvm_start_info (%ebx was 0)"),
            BootInfoError::BadMagic(magic) => {
                write!(
                    f,
                    "hvm_start_info magic {magic:#x}, expected {START_INFO_MAGIC:#x}"
                )
            }
        }
    }
}

fn read_u32(paddr: u64) -> u32 {
    // SAFETY: all guest-physical memory below 64 GiB is identity mapped and user readable;
    // the VMM put start_info (and what it points to) there.
    unsafe { (paddr as *const u32).read_unaligned() }
}

fn read_u64(paddr: u64) -> u64 {
    // SAFETY: as in read_u32.
    unsafe { (paddr as *const u64).read_unaligned() }
}

fn read_u8(paddr: u64) -> u8 {
    // SAFETY: as in read_u32.
    unsafe { (paddr as *const u8).read_volatile() }
}

impl BootInfo {
    pub fn read(start_info: u64) -> Result<BootInfo, BootInfoError> {
        if start_info == 0 {
            return Err(BootInfoError::NoStartInfo);
        }
        let magic = read_u32(start_info);
        if magic != START_INFO_MAGIC {
            return Err(BootInfoError::BadMagic(magic));
        }
        let version = read_u32(start_info + 4);
        let mut info = BootInfo {
            cmdline: [0; MAX_CMDLINE],
            cmdline_len: 0,
            memmap: [MemmapEntry::default(); MAX_MEMMAP],
            memmap_len: 0,
            rsdp_paddr: read_u64(start_info + 32),
        };
        let cmdline = read_u64(start_info + 24);
        if cmdline != 0 {
            while info.cmdline_len < MAX_CMDLINE {
                let byte = read_u8(cmdline + info.cmdline_len as u64);
                if byte == 0 {
                    break;
                }
                info.cmdline[info.cmdline_len] = byte;
                info.cmdline_len += 1;
            }
        }
        // The memory map fields exist from version 1 on.
        if version >= 1 {
            let memmap = read_u64(start_info + 40);
            let entries = read_u32(start_info + 48) as usize;
            if memmap != 0 {
                for i in 0..entries.min(MAX_MEMMAP) {
                    let entry = memmap + 24 * i as u64;
                    info.memmap[i] = MemmapEntry {
                        addr: read_u64(entry),
                        size: read_u64(entry + 8),
                        kind: read_u32(entry + 16),
                    };
                    info.memmap_len += 1;
                }
            }
        }
        Ok(info)
    }

    /// The command line; non-UTF-8 bytes make it empty-invalid, reported by the caller.
    pub fn cmdline(&self) -> Result<&str, core::str::Utf8Error> {
        core::str::from_utf8(&self.cmdline[..self.cmdline_len])
    }

    pub fn memmap(&self) -> &[MemmapEntry] {
        &self.memmap[..self.memmap_len]
    }
}
