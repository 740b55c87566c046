//! Loading a kernel and writing the boot protocol structures the guest expects.
//!
//! - ELF with a Xen PVH note (Linux vmlinux built with CONFIG_PVH, and the test guest):
//!   PVH boot with `hvm_start_info`, its memory map, and the initrd as module 0.
//! - ELF without the note: the Linux 64-bit boot protocol at the ELF entry.
//! - bzImage: the Linux 64-bit boot protocol at `startup_64` (load address + 0x200).

use std::fs::File;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::elf::{Elf64_Ehdr, Elf64_Phdr, PT_LOAD};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::{
    self, BzImage, Cmdline, Elf, KernelLoader, KernelLoaderResult, PvhBootCapability,
};
use vm_memory::{
    Address, ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, ReadVolatile,
};

use super::layout::{
    e820_map, E820Entry, BDA_EBDA_POINTER, CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START,
    HIMEM_START, MMIO_HOLE_START, PVH_INFO_START, ZERO_PAGE_START,
};
use super::regs::EntryPoint;
use gpuvm_memory::RamRegion;

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const BOOT_FLAG_MAGIC: u16 = 0xaa55;
const SETUP_HEADER_MAGIC: u32 = 0x5372_6448; // "HdrS"
/// Where a bzImage's `setup_header` starts (the boot protocol's 0x1f1).
const SETUP_HEADER_OFFSET: u64 = 0x1f1;
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
const KERNEL_ALIGNMENT_DEFAULT: u32 = 0x100_0000;
const INITRD_ADDR_MAX_DEFAULT: u64 = 0x37ff_ffff;
const PAGE_SIZE: u64 = 4096;
/// Offset of startup_64 from the start of the protected-mode kernel in a bzImage.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;

/// Where the kernel comes from: the test guest baked into the binary, or a file.
#[derive(Clone, Debug)]
pub enum KernelSource {
    Embedded(&'static [u8]),
    File(PathBuf),
}

/// What to boot.
#[derive(Clone, Debug)]
pub struct BootSource {
    pub kernel: KernelSource,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
}

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open kernel image {path}: {source}")]
    OpenKernel {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("kernel image {path} ({size} bytes) is larger than guest RAM ({ram} bytes): it cannot be a kernel for this VM; give the VM more memory or check the path")]
    KernelTooLarge { path: PathBuf, size: u64, ram: u64 },
    #[error("guest RAM is too small for {image}: it occupies guest memory up to {end:#x}, beyond the guest's {ram_mib} MiB; give the VM more memory")]
    RamTooSmall {
        image: String,
        end: u64,
        ram_mib: u64,
    },
    #[error("cannot read kernel image {path}: {source}")]
    ReadKernel {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{0} is not a kernel gpuvm can boot: expected an ELF (vmlinux or PVH image) or a bzImage"
    )]
    NotAKernel(String),
    #[error("{image} is an ELF file gpuvm cannot boot: {reason} (gpuvm boots 64-bit little-endian x86-64 ELF kernels)")]
    UnsupportedElf { image: String, reason: String },
    #[error("failed to load kernel {image}: {source}")]
    Load {
        image: String,
        source: loader::Error,
    },
    #[error("cannot open initrd {path}: {source}")]
    OpenInitrd {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("initrd {path} ({size} bytes) does not fit in guest memory below {limit:#x}; give the VM more memory")]
    InitrdTooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
    #[error("failed to copy initrd {path} into guest memory: {source}")]
    ReadInitrd {
        path: PathBuf,
        source: vm_memory::GuestMemoryError,
    },
    #[error("kernel command line is too long ({len} bytes, at most {max})")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("invalid kernel command line: {0}")]
    Cmdline(#[from] linux_loader::cmdline::Error),
    #[error("failed to write boot parameters into guest memory: {0}")]
    BootParams(#[from] linux_loader::configurator::Error),
    #[error("failed to write into guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
    #[error("kernel entry point {0:#x} lies outside guest memory")]
    EntryOutsideMemory(u64),
}

/// Opens a kernel image or initrd: a regular file, never a FIFO (whose open would wait for
/// a writer) or a device (endless); its size comes with it, for checking against guest
/// RAM before anything is read. The API checks boot files with this too.
pub fn open_boot_file(path: &Path) -> std::io::Result<(File, u64)> {
    gpuvm_memory::snapshot::open_regular_file(path, u64::MAX)
}

/// A kernel image opened for loading, readable the way linux-loader wants.
enum Image {
    Embedded(Cursor<&'static [u8]>),
    File(File),
}

impl Read for Image {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Image::Embedded(cursor) => cursor.read(buf),
            Image::File(file) => file.read(buf),
        }
    }
}

impl Seek for Image {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        match self {
            Image::Embedded(cursor) => cursor.seek(pos),
            Image::File(file) => file.seek(pos),
        }
    }
}

impl ReadVolatile for Image {
    fn read_volatile<B: vm_memory::bitmap::BitmapSlice>(
        &mut self,
        buf: &mut vm_memory::VolatileSlice<B>,
    ) -> Result<usize, vm_memory::VolatileMemoryError> {
        match self {
            Image::Embedded(cursor) => cursor.read_volatile(buf),
            Image::File(file) => file.read_volatile(buf),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ImageFormat {
    Elf,
    BzImage,
}

fn detect_format(image: &mut Image, name: &str) -> Result<ImageFormat, BootError> {
    let mut head = [0u8; 0x206];
    let mut filled = 0;
    // A short file is simply not a kernel, so read what there is.
    while filled < head.len() {
        match image.read(&mut head[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(source) => {
                return Err(BootError::ReadKernel {
                    path: PathBuf::from(name),
                    source,
                })
            }
        }
    }
    image
        .seek(SeekFrom::Start(0))
        .map_err(|source| BootError::ReadKernel {
            path: PathBuf::from(name),
            source,
        })?;
    if filled >= 4 && head[..4] == *b"\x7fELF" {
        check_elf_ident(&head[..filled], name)?;
        return Ok(ImageFormat::Elf);
    }
    if filled >= 0x206
        && u32::from_le_bytes([head[0x202], head[0x203], head[0x204], head[0x205]])
            == SETUP_HEADER_MAGIC
    {
        return Ok(ImageFormat::BzImage);
    }
    Err(BootError::NotAKernel(name.to_string()))
}

/// Checks an ELF image's identification and machine before its headers are read as
/// 64-bit ones (linux-loader reads any ELF as ELF64): class 64-bit (`EI_CLASS` 2),
/// little-endian (`EI_DATA` 1), version 1, machine x86-64 (`e_machine` 62).
fn check_elf_ident(head: &[u8], name: &str) -> Result<(), BootError> {
    const EI_CLASS: usize = 4;
    const EI_DATA: usize = 5;
    const EI_VERSION: usize = 6;
    const E_MACHINE: usize = 18;
    const EM_X86_64: u16 = 62;
    let refuse = |reason: String| {
        Err(BootError::UnsupportedElf {
            image: name.to_string(),
            reason,
        })
    };
    if head.len() < E_MACHINE + 2 {
        return refuse(format!("its header is cut short ({} bytes)", head.len()));
    }
    match head[EI_CLASS] {
        2 => {}
        1 => return refuse("its class byte (EI_CLASS) says 32-bit".into()),
        class => return refuse(format!("its class byte (EI_CLASS) is {class}, not 64-bit")),
    }
    if head[EI_DATA] != 1 {
        return refuse(format!(
            "its data byte (EI_DATA) is {}, not little-endian",
            head[EI_DATA]
        ));
    }
    if head[EI_VERSION] != 1 {
        return refuse(format!("its ELF version is {}, not 1", head[EI_VERSION]));
    }
    let machine = u16::from_le_bytes([head[E_MACHINE], head[E_MACHINE + 1]]);
    if machine != EM_X86_64 {
        return refuse(format!(
            "its machine (e_machine) is {machine}, not x86-64 ({EM_X86_64})"
        ));
    }
    Ok(())
}

/// What loading produced, needed to build the boot structures and registers.
#[derive(Debug)]
pub struct LoadedKernel {
    pub entry: EntryPoint,
    pub kernel_end: u64,
    setup_header: Option<setup_header>,
}

/// Loads the kernel, initrd and command line and writes the boot-protocol structures;
/// `rsdp_addr` (the ACPI tables' root, already in guest memory) goes into them.
pub fn load(
    mem: &GuestMemoryMmap,
    regions: &[RamRegion],
    source: &BootSource,
    rsdp_addr: Option<u64>,
) -> Result<LoadedKernel, BootError> {
    let (mut image, name) = match &source.kernel {
        KernelSource::Embedded(bytes) => (
            Image::Embedded(Cursor::new(*bytes)),
            "the embedded test guest".to_string(),
        ),
        KernelSource::File(path) => {
            let (file, size) = open_boot_file(path).map_err(|source| BootError::OpenKernel {
                path: path.clone(),
                source,
            })?;
            // The image is loaded into guest RAM, so a larger one cannot be a kernel for it.
            let ram: u64 = regions.iter().map(|r| r.size).sum();
            if size > ram {
                return Err(BootError::KernelTooLarge {
                    path: path.clone(),
                    size,
                    ram,
                });
            }
            (Image::File(file), path.display().to_string())
        }
    };
    let format = detect_format(&mut image, &name)?;
    // Headers linux-loader cannot read are its to report, when it loads the image.
    if let Ok(extents) = image_extents(&mut image, format) {
        check_fits(mem, regions, &extents, &name)?;
        populate_copied(mem, &extents);
    }
    let load_error = |source| BootError::Load {
        image: name.clone(),
        source,
    };
    let result: KernelLoaderResult = match format {
        ImageFormat::Elf => {
            Elf::load(mem, None, &mut image, Some(GuestAddress(HIMEM_START))).map_err(load_error)?
        }
        ImageFormat::BzImage => {
            BzImage::load(mem, None, &mut image, Some(GuestAddress(HIMEM_START)))
                .map_err(load_error)?
        }
    };
    let entry = match (format, result.pvh_boot_cap) {
        (ImageFormat::Elf, PvhBootCapability::PvhEntryPresent(addr)) => EntryPoint::Pvh {
            entry: addr.raw_value(),
        },
        (ImageFormat::Elf, _) => EntryPoint::Linux64 {
            entry: elf_entry(&mut image).map_err(|source| BootError::ReadKernel {
                path: PathBuf::from(&name),
                source,
            })?,
        },
        (ImageFormat::BzImage, _) => EntryPoint::Linux64 {
            entry: result.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET,
        },
    };
    if mem.find_region(GuestAddress(entry.address())).is_none() {
        return Err(BootError::EntryOutsideMemory(entry.address()));
    }
    log::info!(
        "loaded {name}: {entry:?}, image ends at {:#x}",
        result.kernel_end
    );
    let loaded = LoadedKernel {
        entry,
        kernel_end: result.kernel_end,
        setup_header: result.setup_header,
    };
    write_boot_structures(mem, regions, source, &loaded, rsdp_addr.unwrap_or(0))?;
    if let KernelSource::Embedded(bytes) = &source.kernel {
        release_embedded_image(bytes);
    }
    Ok(loaded)
}

/// The embedded image is read once, when it is loaded: its pages of the binary are handed
/// back, so they do not count in gpuvm's resident memory for the VM's whole life (the test
/// guest is a few hundred KiB). They stay in the page cache, and a later read faults them
/// in again.
fn release_embedded_image(bytes: &'static [u8]) {
    const PAGE: usize = 4096;
    let start = (bytes.as_ptr() as usize).next_multiple_of(PAGE);
    let end = (bytes.as_ptr() as usize + bytes.len()) & !(PAGE - 1);
    if end > start {
        // SAFETY: [start, end) holds whole pages of a read-only static that nothing ever
        // writes (the pages at its ends, which may hold other data, are left alone); for
        // such pages of a private file mapping MADV_DONTNEED only drops this process's
        // mapping, and the next access reads the same bytes from the binary again.
        let result =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        if result != 0 {
            log::debug!(
                "cannot release the embedded image's pages: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Checks that every part of the image (`extents`), its zero-filled parts (ELF `p_memsz`)
/// included, lands in guest RAM, before anything is copied: the loader would only say
/// "Unable to read kernel image", and a zero-filled part beyond RAM would leave a guest
/// writing to memory that is not there. Headers the loader would refuse are left to its
/// error (the caller checks nothing then).
fn check_fits(
    mem: &GuestMemoryMmap,
    regions: &[RamRegion],
    extents: &[Extent],
    name: &str,
) -> Result<(), BootError> {
    let outside = extents.iter().find(|extent| {
        usize::try_from(extent.loaded).map_or(true, |len| {
            !mem.check_range(GuestAddress(extent.start), len)
        })
    });
    if let Some(extent) = outside {
        return Err(BootError::RamTooSmall {
            image: name.to_string(),
            end: extent.start.saturating_add(extent.loaded),
            ram_mib: regions.iter().map(|r| r.size).sum::<u64>() >> 20,
        });
    }
    Ok(())
}

/// Faults in, one `MADV_POPULATE_WRITE` per segment, the guest RAM the loader is about to
/// copy the image's bytes into (not a segment's zero-filled tail, which the guest may never
/// touch): one system call instead of a page fault per 4 KiB as the copy goes (the test
/// guest's 600 KiB, about 150 faults). Only an optimisation: a range it cannot populate is
/// copied into as before.
fn populate_copied(mem: &GuestMemoryMmap, extents: &[Extent]) {
    let page = PAGE_SIZE as usize;
    for extent in extents {
        let len = match usize::try_from(extent.copied) {
            Ok(len) if len > 0 => len,
            _ => continue,
        };
        // In one region's mapping (get_slice refuses a range that is not).
        let Ok(slice) = mem.get_slice(GuestAddress(extent.start), len) else {
            continue;
        };
        let host = slice.ptr_guard_mut().as_ptr() as usize;
        let from = host & !(page - 1);
        let to = (host + len).div_ceil(page) * page;
        // SAFETY: [from, to) lies in one guest RAM region's live mapping (the slice's, its
        // ends rounded out to pages of that page-aligned mapping); populating only faults
        // pages in and never changes their contents.
        let done = unsafe {
            libc::madvise(
                from as *mut libc::c_void,
                to - from,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if done != 0 {
            log::debug!(
                "cannot populate guest RAM at {:#x}+{len:#x} for the kernel: {}",
                extent.start,
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Where one piece of the image goes in guest RAM, as linux-loader places it.
#[derive(Clone, Copy, Debug)]
struct Extent {
    start: u64,
    /// Bytes copied from the image (an ELF segment's `p_filesz`).
    copied: u64,
    /// Bytes it takes in guest RAM, its zero-filled tail included (`p_memsz`).
    loaded: u64,
}

/// Where the image is loaded, from its headers, as linux-loader places it: ELF PT_LOAD
/// segments at `p_paddr`; a bzImage's protected-mode kernel (the image past its setup
/// sectors) at `code32_start`.
fn image_extents(image: &mut Image, format: ImageFormat) -> std::io::Result<Vec<Extent>> {
    let mut extents = Vec::new();
    match format {
        ImageFormat::Elf => {
            let ehdr: Elf64_Ehdr = read_header(image, 0)?;
            let phdr_size = std::mem::size_of::<Elf64_Phdr>() as u64;
            for index in 0..u64::from(ehdr.e_phnum) {
                let at = ehdr.e_phoff.saturating_add(index * phdr_size);
                let phdr: Elf64_Phdr = read_header(image, at)?;
                if phdr.p_type == PT_LOAD && phdr.p_memsz > 0 {
                    extents.push(Extent {
                        start: phdr.p_paddr,
                        copied: phdr.p_filesz.min(phdr.p_memsz),
                        loaded: phdr.p_memsz,
                    });
                }
            }
        }
        ImageFormat::BzImage => {
            let header: setup_header = read_header(image, SETUP_HEADER_OFFSET)?;
            let setup_sects = match header.setup_sects {
                0 => 4,
                n => u64::from(n),
            };
            let size = image.seek(SeekFrom::End(0))?;
            let kernel = size.saturating_sub((setup_sects + 1) * 512);
            extents.push(Extent {
                start: u64::from(header.code32_start),
                copied: kernel,
                loaded: kernel,
            });
        }
    }
    image.seek(SeekFrom::Start(0))?;
    Ok(extents)
}

fn elf_entry(image: &mut Image) -> std::io::Result<u64> {
    let ehdr: Elf64_Ehdr = read_header(image, 0)?;
    Ok(ehdr.e_entry)
}

/// Reads a header (linux-loader's ELF or boot-protocol type) at `offset` in the image.
fn read_header<T: ByteValued + Default>(image: &mut Image, offset: u64) -> std::io::Result<T> {
    let mut header = T::default();
    image.seek(SeekFrom::Start(offset))?;
    image.read_exact(header.as_mut_slice())?;
    Ok(header)
}

/// Copies the initrd as high as possible below `limit`, page aligned, above the kernel.
fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel_end: u64,
    limit: u64,
) -> Result<(u64, u64), BootError> {
    let (mut file, size) = open_boot_file(path).map_err(|source| BootError::OpenInitrd {
        path: path.to_path_buf(),
        source,
    })?;
    let too_large = || BootError::InitrdTooLarge {
        path: path.to_path_buf(),
        size,
        limit,
    };
    let address = limit.checked_sub(size).ok_or_else(too_large)? & !(PAGE_SIZE - 1);
    let kernel_end_aligned = kernel_end.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    if address < kernel_end_aligned || address < HIMEM_START {
        return Err(too_large());
    }
    mem.read_exact_volatile_from(GuestAddress(address), &mut file, size as usize)
        .map_err(|source| BootError::ReadInitrd {
            path: path.to_path_buf(),
            source,
        })?;
    log::info!(
        "initrd {} loaded at {address:#x} ({size} bytes)",
        path.display()
    );
    Ok((address, size))
}

/// Highest address (exclusive) of RAM below the 32-bit MMIO hole.
fn low_ram_end(regions: &[RamRegion]) -> u64 {
    regions
        .iter()
        .filter(|r| r.guest_addr < MMIO_HOLE_START)
        .map(|r| r.end().min(MMIO_HOLE_START))
        .max()
        .unwrap_or(0)
}

fn write_boot_structures(
    mem: &GuestMemoryMmap,
    regions: &[RamRegion],
    source: &BootSource,
    kernel: &LoadedKernel,
    rsdp_addr: u64,
) -> Result<(), BootError> {
    if source.cmdline.len() >= CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong {
            len: source.cmdline.len(),
            max: CMDLINE_MAX_SIZE - 1,
        });
    }
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE)?;
    if !source.cmdline.is_empty() {
        cmdline.insert_str(&source.cmdline)?;
    }
    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline).map_err(|source| {
        BootError::Load {
            image: "command line".into(),
            source,
        }
    })?;
    // Point the BIOS data area at the EBDA, where the MP floating pointer lives.
    mem.write_obj((EBDA_START >> 4) as u16, GuestAddress(BDA_EBDA_POINTER))?;

    let e820 = e820_map(regions);
    match kernel.entry {
        EntryPoint::Pvh { .. } => {
            let initrd = match &source.initrd {
                Some(path) => Some(load_initrd(
                    mem,
                    path,
                    kernel.kernel_end,
                    low_ram_end(regions),
                )?),
                None => None,
            };
            write_pvh_start_info(mem, &e820, initrd, rsdp_addr)
        }
        EntryPoint::Linux64 { .. } => {
            let header = kernel.setup_header.unwrap_or_default();
            let limit = match header.initrd_addr_max {
                0 => INITRD_ADDR_MAX_DEFAULT,
                max => u64::from(max),
            };
            let initrd = match &source.initrd {
                Some(path) => Some(load_initrd(
                    mem,
                    path,
                    kernel.kernel_end,
                    low_ram_end(regions).min(limit + 1),
                )?),
                None => None,
            };
            write_zero_page(
                mem,
                header,
                &e820,
                cmdline_len(&source.cmdline),
                initrd,
                rsdp_addr,
            )
        }
    }
}

fn cmdline_len(cmdline: &str) -> u32 {
    cmdline.len() as u32
}

fn write_pvh_start_info(
    mem: &GuestMemoryMmap,
    e820: &[E820Entry],
    initrd: Option<(u64, u64)>,
    rsdp_addr: u64,
) -> Result<(), BootError> {
    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind,
            reserved: 0,
        })
        .collect();
    let start_info_size = std::mem::size_of::<hvm_start_info>() as u64;
    let memmap_addr = GuestAddress(PVH_INFO_START + start_info_size.next_multiple_of(64));
    let memmap_bytes = (memmap.len() * std::mem::size_of::<hvm_memmap_table_entry>()) as u64;
    let modlist_addr = GuestAddress(memmap_addr.raw_value() + memmap_bytes.next_multiple_of(64));

    let mut start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: memmap_addr.raw_value(),
        memmap_entries: memmap.len() as u32,
        rsdp_paddr: rsdp_addr,
        ..Default::default()
    };
    let mut params;
    if let Some((paddr, size)) = initrd {
        start_info.nr_modules = 1;
        start_info.modlist_paddr = modlist_addr.raw_value();
        params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
        params.set_modules(
            &[hvm_modlist_entry {
                paddr,
                size,
                ..Default::default()
            }],
            modlist_addr,
        );
    } else {
        params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
    }
    params.set_sections(&memmap, memmap_addr);
    PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem)?;
    Ok(())
}

fn write_zero_page(
    mem: &GuestMemoryMmap,
    mut header: setup_header,
    e820: &[E820Entry],
    cmdline_size: u32,
    initrd: Option<(u64, u64)>,
    rsdp_addr: u64,
) -> Result<(), BootError> {
    header.type_of_loader = LOADER_TYPE_UNDEFINED;
    header.boot_flag = BOOT_FLAG_MAGIC;
    header.header = SETUP_HEADER_MAGIC;
    header.cmd_line_ptr = CMDLINE_START as u32;
    header.cmdline_size = cmdline_size;
    if header.kernel_alignment == 0 {
        header.kernel_alignment = KERNEL_ALIGNMENT_DEFAULT;
    }
    let mut params = boot_params {
        hdr: header,
        acpi_rsdp_addr: rsdp_addr,
        ..Default::default()
    };
    if let Some((address, size)) = initrd {
        params.hdr.ramdisk_image = address as u32;
        params.hdr.ramdisk_size = size as u32;
        params.ext_ramdisk_image = (address >> 32) as u32;
        params.ext_ramdisk_size = (size >> 32) as u32;
    }
    for (slot, entry) in params.e820_table.iter_mut().zip(e820) {
        *slot = boot_e820_entry {
            addr: entry.addr,
            size: entry.size,
            r#type: entry.kind,
        };
    }
    params.e820_entries = e820.len().min(params.e820_table.len()) as u8;
    let boot = BootParams::new(&params, GuestAddress(ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(&boot, mem)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x86_64::layout::ram_regions;

    fn memory(size: u64) -> (GuestMemoryMmap, Vec<RamRegion>) {
        let regions = ram_regions(size);
        let ranges: Vec<_> = regions
            .iter()
            .map(|r| (GuestAddress(r.guest_addr), r.size as usize))
            .collect();
        (GuestMemoryMmap::from_ranges(&ranges).unwrap(), regions)
    }

    fn source(kernel: KernelSource) -> BootSource {
        BootSource {
            kernel,
            initrd: None,
            cmdline: "hello".into(),
        }
    }

    #[test]
    fn embedded_test_guest_boots_with_pvh() {
        let (mem, regions) = memory(64 << 20);
        let loaded = load(
            &mem,
            &regions,
            &source(KernelSource::Embedded(gpuvm_guest_images::TEST_GUEST_ELF)),
            Some(0xe0000),
        )
        .unwrap();
        assert!(matches!(loaded.entry, EntryPoint::Pvh { .. }));
        let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC);
        assert_eq!(info.memmap_entries as usize, e820_map(&regions).len());
        assert_eq!({ info.rsdp_paddr }, 0xe0000);
        let mut cmdline = [0u8; 6];
        mem.read_slice(&mut cmdline, GuestAddress(info.cmdline_paddr))
            .unwrap();
        assert_eq!(&cmdline, b"hello\0");
    }

    /// The RAM the loader copies the test guest's file bytes into is populated (one
    /// MADV_POPULATE_WRITE), and its zero-filled tail (.bss: most of its 5 MiB) is left
    /// alone: populating that too would add megabytes of RSS the guest may never touch.
    #[test]
    fn the_copied_bytes_are_populated_and_the_zero_filled_tail_is_not() {
        let (mem, _) = memory(64 << 20);
        let mut image = Image::Embedded(Cursor::new(gpuvm_guest_images::TEST_GUEST_ELF));
        let extents = image_extents(&mut image, ImageFormat::Elf).unwrap();
        let (start, file_len, mem_len) = (extents[0].start, extents[0].copied, extents[0].loaded);
        assert!(
            mem_len >= file_len + (2 << 20),
            "{file_len:#x} of {mem_len:#x}"
        );
        populate_copied(&mem, &extents);
        let resident = |at: u64, len: u64| -> usize {
            let host = mem.get_host_address(GuestAddress(at)).unwrap() as usize;
            let from = host & !(PAGE_SIZE as usize - 1);
            let pages = (host + len as usize - from).div_ceil(PAGE_SIZE as usize);
            let mut vec = vec![0u8; pages];
            // SAFETY: mincore reads the residency of [from, from + pages pages), inside the
            // test's anonymous mapping, into `vec`, which holds one byte per page.
            let done = unsafe {
                libc::mincore(
                    from as *mut libc::c_void,
                    pages * PAGE_SIZE as usize,
                    vec.as_mut_ptr(),
                )
            };
            assert_eq!(done, 0, "{}", std::io::Error::last_os_error());
            vec.iter().filter(|&&v| v & 1 == 1).count()
        };
        let file_pages = file_len.div_ceil(PAGE_SIZE) as usize;
        assert_eq!(resident(start, file_len), file_pages);
        // The tail past the last copied page: nothing of it.
        let tail = (start + file_len).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        assert_eq!(resident(tail, start + mem_len - tail), 0);
    }

    #[test]
    fn garbage_is_not_a_kernel() {
        let (mem, regions) = memory(16 << 20);
        static GARBAGE: [u8; 4096] = [0x5a; 4096];
        let err = load(
            &mem,
            &regions,
            &source(KernelSource::Embedded(&GARBAGE)),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, BootError::NotAKernel(_)), "{err}");
        static EMPTY: [u8; 0] = [];
        let err = load(
            &mem,
            &regions,
            &source(KernelSource::Embedded(&EMPTY)),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, BootError::NotAKernel(_)), "{err}");
    }

    #[test]
    fn truncated_elf_is_an_error_not_a_panic() {
        let (mem, regions) = memory(16 << 20);
        let elf = gpuvm_guest_images::TEST_GUEST_ELF;
        let truncated: &'static [u8] =
            Box::leak(elf[..elf.len().min(100)].to_vec().into_boxed_slice());
        assert!(load(
            &mem,
            &regions,
            &source(KernelSource::Embedded(truncated)),
            None
        )
        .is_err());
    }

    /// Issue 31: an ELF whose identification is not 64-bit little-endian x86-64 is
    /// refused, naming what is wrong, instead of being read as ELF64 and booted.
    #[test]
    fn an_elf_that_is_not_64_bit_x86_64_is_refused() {
        let (mem, regions) = memory(64 << 20);
        let elf = gpuvm_guest_images::TEST_GUEST_ELF;
        for (at, value, needle) in [
            (4, 1, "says 32-bit"),
            (4, 7, "is 7, not 64-bit"),
            (5, 2, "not little-endian"),
            (6, 0, "ELF version is 0"),
            (18, 3, "e_machine) is 3"),
        ] {
            let mut bad = elf.to_vec();
            bad[at] = value;
            let bad: &'static [u8] = Box::leak(bad.into_boxed_slice());
            let err = load(&mem, &regions, &source(KernelSource::Embedded(bad)), None).unwrap_err();
            assert!(
                matches!(err, BootError::UnsupportedElf { .. }) && err.to_string().contains(needle),
                "{needle}: {err}"
            );
        }
    }

    #[test]
    fn missing_file_is_reported_with_its_path() {
        let (mem, regions) = memory(16 << 20);
        let err = load(
            &mem,
            &regions,
            &source(KernelSource::File("/nonexistent/vmlinux".into())),
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/vmlinux"), "{err}");
    }

    #[test]
    fn minimal_bzimage_gets_a_zero_page_and_initrd() {
        // A synthetic bzImage: setup header with HdrS, protocol 2.15, loaded high.
        let (mem, regions) = memory(64 << 20);
        let mut image = vec![0u8; 0x1000 + 0x400];
        image[0x1f1] = 7; // setup_sects: (7 + 1) * 512 = 0x1000 bytes of setup
        image[0x202..0x206].copy_from_slice(&SETUP_HEADER_MAGIC.to_le_bytes());
        image[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        image[0x211] = 1; // loadflags: LOADED_HIGH
        image[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
        image[0x22c..0x230].copy_from_slice(&0x37ff_ffffu32.to_le_bytes()); // initrd_addr_max
        let image: &'static [u8] = Box::leak(image.into_boxed_slice());
        let dir = std::env::temp_dir().join(format!("gpuvm-boot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let initrd = dir.join("initrd");
        std::fs::write(&initrd, vec![0xab; 10_000]).unwrap();
        let mut boot = source(KernelSource::Embedded(image));
        boot.initrd = Some(initrd);
        let loaded = load(&mem, &regions, &boot, Some(0xe0000)).unwrap();
        assert_eq!(loaded.entry, EntryPoint::Linux64 { entry: 0x10_0200 });
        let params: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!({ params.acpi_rsdp_addr }, 0xe0000);
        let hdr = params.hdr;
        assert_eq!({ hdr.boot_flag }, BOOT_FLAG_MAGIC);
        assert_eq!({ hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!(params.e820_entries as usize, e820_map(&regions).len());
        let ramdisk = u64::from(hdr.ramdisk_image);
        assert_eq!({ hdr.ramdisk_size }, 10_000);
        assert_eq!(ramdisk % PAGE_SIZE, 0);
        assert!(ramdisk + 10_000 <= 64 << 20);
        let byte: u8 = mem.read_obj(GuestAddress(ramdisk + 9_999)).unwrap();
        assert_eq!(byte, 0xab);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn overlong_cmdline_is_rejected() {
        let (mem, regions) = memory(16 << 20);
        let mut boot = source(KernelSource::Embedded(gpuvm_guest_images::TEST_GUEST_ELF));
        boot.cmdline = "x".repeat(CMDLINE_MAX_SIZE + 1);
        assert!(matches!(
            load(&mem, &regions, &boot, None),
            Err(BootError::CmdlineTooLong { .. })
        ));
    }
}
