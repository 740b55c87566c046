//! Background snapshots: guest RAM written while the guest runs, as it was at one
//! instant (the pause), with userfaultfd write protection.
//!
//! The caller's flow:
//! 1. [`WriteProtectedRam::arm`] while the guest runs: every region is registered with a
//!    new userfaultfd in write-protect mode and protected. Protecting costs the kernel
//!    time per mapped page (tens of ms for 8 GiB of 4 KiB pages), which is why it happens
//!    before the pause: a guest write meanwhile faults, and the fault thread just records
//!    the block around it (see [`FAULT_BLOCK_BYTES`]) and lifts its protection.
//! 2. [`WriteProtectedRam::freeze`] with vCPUs and devices paused: the blocks lifted during
//!    step 1 are protected again, and from then on a write fault copies the block's pages
//!    aside before lifting its protection. This instant is the snapshot's.
//! 3. Resume the guest, then [`WriteProtectedRam::write_full`]: a scan pass (zero pages,
//!    CRCs) and a data pass, each taking every page as it was at the freeze: from guest
//!    RAM while it is still protected, else from the copy the fault thread took. A page
//!    read from RAM counts only if it was still unsettled (no copy) after the read: the
//!    fault thread settles a page before it lifts its protection. The data pass lifts
//!    protection behind it, so copies are only taken for pages the guest writes ahead of
//!    the writer. The file is the same format [`super::write_full`] writes.
//!
//! Whatever happens (an error, a drop), every protection is lifted before this returns or
//! drops: no guest write waits on a thread that is gone.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::atomic::write_atomically;
use super::format::ExtentKind;
use super::layout::RamMappings;
use super::scan::{page_is_zero, private_description, spans, ScanResult};
use super::writer::{build_metadata, new_id, start_writeback, write_all_at};
use super::{Result, SnapshotError, SnapshotInfo, WriteOptions, WriteStats};

// The userfaultfd ABI (linux/userfaultfd.h) used here, which the userfaultfd crate only
// offers behind a feature this workspace does not enable.
const UFFD_API: u64 = 0xAA;
const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `_UFFDIO_WRITEPROTECT` in the ioctl mask `UFFDIO_REGISTER` returns.
const UFFDIO_WRITEPROTECT_AVAILABLE: u64 = 1 << 0x06;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xc018_aa06;
/// Size of `struct uffd_msg`.
const UFFD_MSG_LEN: usize = 32;
/// Fault messages read per `read(2)`.
const MSGS_PER_READ: usize = 64;

/// Largest page size written in the background: the copies and the writer's buffer hold
/// whole pages, which must stay small (1 GiB pages are written paused).
pub const MAX_BACKGROUND_PAGE_SIZE: u64 = 2 << 20;
/// Bytes of guest RAM served per write fault: memory written in order (most guests write
/// so) faults once per block; 4 KiB blocks made a memloop guest fault on every page.
const FAULT_BLOCK_BYTES: u64 = 1 << 20;
/// Bytes the writer reads and writes per step (and lifts protection on behind it).
const CHUNK_BYTES: u64 = 8 << 20;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// Why background snapshots cannot be used on this host, or `None` when they can:
/// checked once (a userfaultfd asked for write protection of shmem and hugetlbfs, Linux
/// 5.19 and later).
pub fn background_unsupported() -> Option<&'static str> {
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    PROBE
        .get_or_init(|| open_wp_uffd().err().map(|e| e.to_string()))
        .as_deref()
}

/// A userfaultfd that reports write faults on shmem and hugetlbfs, and kernel-mode faults
/// too (KVM writes guest memory through `get_user_pages`).
fn open_wp_uffd() -> std::io::Result<OwnedFd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: the userfaultfd system call takes flags only and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes the `UffdioApi` passed, which lives for the call.
    if unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
        let error = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            error.kind(),
            format!("userfaultfd write protection of shared memory (Linux 5.19+): {error}"),
        ));
    }
    Ok(uffd)
}

fn uffd_ioctl<T>(uffd: RawFd, request: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
    loop {
        // SAFETY: every request used here takes a pointer to the `#[repr(C)]` struct of its
        // kind, which `arg` is and which outlives the call.
        if unsafe { libc::ioctl(uffd, request, arg as *mut T) } == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        // EAGAIN: the address space is changing (a fault being set up); try again.
        if !matches!(error.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) {
            return Err(error);
        }
        std::thread::yield_now();
    }
}

/// Protects (`protect`) or lifts protection of (and wakes the writers waiting in)
/// `len` bytes at `start`.
fn set_protection(uffd: RawFd, start: u64, len: u64, protect: bool) -> std::io::Result<()> {
    let mut wp = UffdioWriteprotect {
        range: UffdioRange { start, len },
        mode: if protect {
            UFFDIO_WRITEPROTECT_MODE_WP
        } else {
            0
        },
    };
    uffd_ioctl(uffd, UFFDIO_WRITEPROTECT, &mut wp)
}

/// One guest RAM region as the fault thread and writer see it.
#[derive(Clone, Copy)]
struct Region {
    host_addr: u64,
    len: u64,
    first_linear: u64,
    /// Where the region starts in the memfd.
    file_offset: u64,
}

/// What the fault thread does with a write fault.
enum Mode {
    /// Before the freeze: record the block (start, length), lift its protection.
    Tracking(Vec<(u64, u64)>),
    /// After it: copy the page aside first (unless it is settled), then lift protection.
    Preserving,
}

/// State shared by the fault thread and the writer.
struct Shared {
    uffd: OwnedFd,
    /// Guest RAM's memfd, when known: pages are read through it rather than through the
    /// mapping, whose page tables write protection has split (a read through them would
    /// fault for every 4 KiB page of a huge-page mapping).
    memfd: Option<OwnedFd>,
    regions: Vec<Region>,
    page_size: u64,
    mode: Mutex<Mode>,
    /// One bit per linear page: its freeze-time contents no longer come from guest RAM,
    /// either copied aside (in `copies`) or already written (released by the writer).
    settled: Vec<AtomicU64>,
    /// Freeze-time contents of pages the guest wrote before the writer got to them.
    copies: Mutex<BTreeMap<u64, Box<[u8]>>>,
    /// Bytes held in `copies` at most, for the report.
    copies_peak: AtomicU64,
    /// Set when the fault thread failed: the file cannot be trusted.
    failed: Mutex<Option<String>>,
    stop: AtomicBool,
    /// Written to wake the fault thread's poll when it must stop.
    stop_event: OwnedFd,
}

impl Shared {
    fn is_settled(&self, linear: u64) -> bool {
        self.settled[(linear / 64) as usize].load(Ordering::Acquire) & (1 << (linear % 64)) != 0
    }

    fn settle(&self, linear: u64) {
        self.settled[(linear / 64) as usize].fetch_or(1 << (linear % 64), Ordering::AcqRel);
    }

    /// The region and linear page of a host address in guest RAM.
    fn locate(&self, addr: u64) -> Option<(usize, u64)> {
        self.regions.iter().enumerate().find_map(|(i, r)| {
            (addr >= r.host_addr && addr - r.host_addr < r.len)
                .then(|| (i, r.first_linear + (addr - r.host_addr) / self.page_size))
        })
    }

    fn host_addr_of(&self, region: usize, linear: u64) -> u64 {
        let r = &self.regions[region];
        r.host_addr + (linear - r.first_linear) * self.page_size
    }

    /// The block of guest RAM a write fault at `addr` is served for: the aligned
    /// [`FAULT_BLOCK_BYTES`] (at least a page) around it, inside its region.
    fn fault_block(&self, addr: u64) -> Option<(usize, u64, u64)> {
        let (region, _) = self.locate(addr)?;
        let r = &self.regions[region];
        let block = FAULT_BLOCK_BYTES.max(self.page_size);
        let start = (addr & !(block - 1)).max(r.host_addr);
        let end = ((addr & !(block - 1)) + block).min(r.host_addr + r.len);
        Some((region, start, end - start))
    }

    /// Copies `buf.len()` bytes of `region` from its linear page `first` into `buf`:
    /// through the memfd when there is one, else through the mapping. A page the guest
    /// writes meanwhile may come out torn (callers check whether it was settled).
    fn read_pages(&self, region: usize, first: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let r = &self.regions[region];
        let offset_in_region = (first - r.first_linear) * self.page_size;
        let Some(memfd) = &self.memfd else {
            let src = (r.host_addr + offset_in_region) as *const u8;
            // SAFETY: the range lies in `region`'s mapping (callers pass pages of the
            // region), which the `RamMappings` the writer borrows keeps mapped; `buf` is
            // not guest memory.
            unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) };
            return Ok(());
        };
        let mut done = 0;
        while done < buf.len() {
            let at = r.file_offset + offset_in_region + done as u64;
            // SAFETY: reads into the unfilled tail of `buf`, which this call borrows.
            let got = unsafe {
                libc::pread(
                    memfd.as_raw_fd(),
                    buf[done..].as_mut_ptr().cast(),
                    buf.len() - done,
                    at as libc::off_t,
                )
            };
            match got {
                n if n > 0 => done += n as usize,
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                _ => {
                    let error = std::io::Error::last_os_error();
                    if error.kind() != std::io::ErrorKind::Interrupted {
                        return Err(error);
                    }
                }
            }
        }
        Ok(())
    }

    /// Handles one write fault at `addr`: serves the whole block around it, so that a
    /// guest writing through memory faults once per block, not once per page.
    fn on_write_fault(&self, addr: u64) -> std::io::Result<()> {
        let Some((region, start, len)) = self.fault_block(addr) else {
            // Not guest RAM this registered: nothing to serve (the kernel wakes it).
            return Ok(());
        };
        let mut mode = self.mode.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *mode {
            Mode::Tracking(touched) => touched.push((start, len)),
            Mode::Preserving => {
                let first = self.regions[region].first_linear
                    + (start - self.regions[region].host_addr) / self.page_size;
                let mut block = vec![0u8; len as usize];
                // Still write-protected: nothing changes the block while it is read.
                self.read_pages(region, first, &mut block)?;
                let mut copies = self.copies.lock().unwrap_or_else(|e| e.into_inner());
                for (i, page) in block.chunks_exact(self.page_size as usize).enumerate() {
                    let linear = first + i as u64;
                    if self.is_settled(linear) {
                        continue;
                    }
                    copies.insert(linear, page.into());
                    // The bit is set before the protection is lifted: a reader that still
                    // sees it clear after reading the page read it unchanged.
                    self.settle(linear);
                }
                self.copies_peak
                    .fetch_max(copies.len() as u64 * self.page_size, Ordering::Relaxed);
            }
        }
        // Lifted under the mode lock: a block recorded while tracking must not be lifted
        // after the freeze protected it again.
        let lifted = set_protection(self.uffd.as_raw_fd(), start, len, false);
        drop(mode);
        lifted
    }

    /// Lifts every protection (waking every waiting writer), best effort.
    fn lift_all(&self) {
        for r in &self.regions {
            if let Err(error) = set_protection(self.uffd.as_raw_fd(), r.host_addr, r.len, false) {
                log::warn!(
                    "background snapshot: cannot lift write protection at {:#x}: {error}",
                    r.host_addr
                );
            }
        }
    }

    /// The fault thread: serves write faults until told to stop. On an error it lifts
    /// every protection (so no guest write waits forever) and records why.
    fn serve_faults(&self) {
        if let Err(error) = self.fault_loop() {
            log::error!("background snapshot: write-fault thread failed: {error}");
            *self.failed.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("the write-fault thread failed: {error}"));
            self.lift_all();
        }
    }

    fn fault_loop(&self) -> std::io::Result<()> {
        let mut msgs = [0u8; UFFD_MSG_LEN * MSGS_PER_READ];
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.stop_event.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            poll_until_ready(&mut fds)?;
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            // SAFETY: reads into `msgs`, a buffer of that many bytes owned here.
            let got =
                unsafe { libc::read(self.uffd.as_raw_fd(), msgs.as_mut_ptr().cast(), msgs.len()) };
            if got < 0 {
                let error = std::io::Error::last_os_error();
                if matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                    continue;
                }
                return Err(error);
            }
            for msg in msgs[..got as usize].chunks_exact(UFFD_MSG_LEN) {
                let flags = u64::from_ne_bytes(msg[8..16].try_into().unwrap_or_default());
                let addr = u64::from_ne_bytes(msg[16..24].try_into().unwrap_or_default());
                if msg[0] == UFFD_EVENT_PAGEFAULT && flags & UFFD_PAGEFAULT_FLAG_WP != 0 {
                    self.on_write_fault(addr)?;
                }
            }
        }
    }
}

/// Guest RAM under write protection for a background snapshot (see the module
/// documentation). Dropping it lifts every protection and stops its fault thread.
pub struct WriteProtectedRam {
    shared: Arc<Shared>,
    fault_thread: Option<std::thread::JoinHandle<()>>,
    /// The data pass lifted every protection already (nothing left to lift on drop).
    released_all: bool,
}

/// What a background write did beyond [`WriteStats`].
#[derive(Clone, Debug, Default)]
pub struct BackgroundStats {
    /// Most bytes of guest pages held as copies at once (pages the guest wrote before
    /// the writer got to them).
    pub copies_peak_bytes: u64,
}

impl WriteProtectedRam {
    /// Registers and protects every region of `ram` (the guest may run), starting the
    /// fault thread, which first runs `on_thread_start` (its seccomp filter).
    pub fn arm(
        ram: &RamMappings<'_>,
        on_thread_start: Option<crate::uffd::ThreadStartHook>,
    ) -> Result<WriteProtectedRam> {
        let layout = ram.layout();
        let page_size = layout.page_size();
        let fail = |op: &'static str| move |e| SnapshotError::io(op, "guest RAM", e);
        if page_size > MAX_BACKGROUND_PAGE_SIZE {
            return Err(SnapshotError::InvalidLayout(format!(
                "{page_size}-byte pages are not written in the background"
            )));
        }
        let uffd = open_wp_uffd().map_err(fail("open a userfaultfd for"))?;
        let regions: Vec<Region> = (0..layout.regions().len())
            .map(|i| Region {
                host_addr: ram.host_addr(i) as u64,
                len: layout.regions()[i].size,
                first_linear: layout.region_first_linear(i),
                file_offset: layout.regions()[i].file_offset,
            })
            .collect();
        let memfd = ram
            .memfd()
            .map(|fd| fd.try_clone_to_owned())
            .transpose()
            .map_err(fail("duplicate the memfd of"))?;
        for r in &regions {
            let mut register = UffdioRegister {
                range: UffdioRange {
                    start: r.host_addr,
                    len: r.len,
                },
                mode: UFFDIO_REGISTER_MODE_WP,
                ioctls: 0,
            };
            uffd_ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, &mut register)
                .map_err(fail("register for write protection"))?;
            if register.ioctls & UFFDIO_WRITEPROTECT_AVAILABLE == 0 {
                return Err(SnapshotError::io(
                    "write-protect",
                    "guest RAM",
                    std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
                ));
            }
        }
        // SAFETY: eventfd takes an initial value and flags and returns a new fd or -1.
        let event = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if event < 0 {
            return Err(fail("create an eventfd for")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `event` was just returned by the kernel and is owned by nobody else.
        let stop_event = unsafe { OwnedFd::from_raw_fd(event) };
        let shared = Arc::new(Shared {
            uffd,
            memfd,
            settled: (0..layout.total_pages().div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            regions,
            page_size,
            mode: Mutex::new(Mode::Tracking(Vec::new())),
            copies: Mutex::new(BTreeMap::new()),
            copies_peak: AtomicU64::new(0),
            failed: Mutex::new(None),
            stop: AtomicBool::new(false),
            stop_event,
        });
        let thread_shared = Arc::clone(&shared);
        // RAM is protected only once the fault thread is ready (its filter installed):
        // a guest write must never wait on a thread that is not there.
        let (ready_tx, ready_rx) =
            std::sync::mpsc::sync_channel::<std::result::Result<(), String>>(1);
        let fault_thread = std::thread::Builder::new()
            .name("snapshot-wp".into())
            .spawn(move || {
                let setup =
                    on_thread_start.map_or(Ok(()), |hook| hook().map_err(|e| e.to_string()));
                let ready = setup.is_ok();
                let _ = ready_tx.send(setup);
                if ready {
                    thread_shared.serve_faults();
                }
            })
            .map_err(fail("start the write-fault thread for"))?;
        let setup = ready_rx
            .recv()
            .unwrap_or_else(|_| Err("it ended before it was ready".into()));
        let armed = WriteProtectedRam {
            shared,
            fault_thread: Some(fault_thread),
            released_all: false,
        };
        if let Err(reason) = setup {
            return Err(fail("set up the write-fault thread for")(
                std::io::Error::other(reason),
            ));
        }
        for r in &armed.shared.regions {
            set_protection(armed.shared.uffd.as_raw_fd(), r.host_addr, r.len, true)
                .map_err(fail("write-protect"))?;
        }
        armed.check_fault_thread()?;
        Ok(armed)
    }

    /// The snapshot instant; call with every writer of guest RAM paused. Protects again
    /// the blocks written since [`WriteProtectedRam::arm`]; from now on a written block is
    /// copied aside first. Returns how many pages were protected again.
    pub fn freeze(&self) -> Result<u64> {
        let mut mode = self.shared.mode.lock().unwrap_or_else(|e| e.into_inner());
        let Mode::Tracking(touched) = std::mem::replace(&mut *mode, Mode::Preserving) else {
            return Ok(0);
        };
        let mut touched = touched;
        touched.sort_unstable();
        // One ioctl per run of adjacent blocks: a guest writing in order (most do) leaves
        // few runs, and this runs while the vCPUs are paused.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &(start, len) in &touched {
            match runs.last_mut() {
                Some((run_start, run_len)) if *run_start + *run_len >= start => {
                    *run_len = (*run_len).max(start + len - *run_start);
                }
                _ => runs.push((start, len)),
            }
        }
        for (start, len) in runs {
            set_protection(self.shared.uffd.as_raw_fd(), start, len, true)
                .map_err(|e| SnapshotError::io("write-protect again", "guest RAM", e))?;
        }
        drop(mode);
        self.check_fault_thread()?;
        Ok(touched
            .iter()
            .map(|&(_, len)| len / self.shared.page_size)
            .sum())
    }

    fn check_fault_thread(&self) -> Result<()> {
        match &*self.shared.failed.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(reason) => Err(SnapshotError::io(
                "write guest RAM in the background:",
                "guest RAM",
                std::io::Error::other(reason.clone()),
            )),
            None => Ok(()),
        }
    }

    /// Writes `ram` as it was at [`WriteProtectedRam::freeze`] to `path` as a full memory
    /// file (replacing any file there atomically), while the guest runs. Lifts every
    /// protection before returning, written or not.
    pub fn write_full(
        mut self,
        path: &Path,
        ram: &RamMappings<'_>,
        opts: &WriteOptions,
    ) -> Result<(WriteStats, BackgroundStats)> {
        let layout = ram.layout();
        let info = SnapshotInfo {
            id: new_id(path)?,
            base_id: None,
            generation: 0,
            page_size: layout.page_size(),
            ram_size: layout.ram_size(),
        };
        let mut cursor = Cursor::default();
        let result = self.write_file(path, ram, opts, info, &mut cursor);
        self.released_all = cursor.next >= layout.total_pages();
        let stats = BackgroundStats {
            copies_peak_bytes: self.shared.copies_peak.load(Ordering::Relaxed),
        };
        drop(self);
        result.map(|written| (written, stats))
    }

    fn write_file(
        &self,
        path: &Path,
        ram: &RamMappings<'_>,
        opts: &WriteOptions,
        info: SnapshotInfo,
        cursor: &mut Cursor,
    ) -> Result<WriteStats> {
        let scan_start = Instant::now();
        let scanned = self.scan(ram, opts.page_crcs)?;
        let scan_time = scan_start.elapsed();
        let (metadata, extents, data_offset) = build_metadata(ram, &scanned, &info, opts.page_crcs);
        let data_pages = scanned.data_pages();
        let file_len = data_offset + data_pages * info.page_size;
        let write_start = Instant::now();
        write_atomically(path, |file| -> std::io::Result<()> {
            // The header first, as the paused writer does: a temp file cut short by a kill
            // still starts with the magic, so the next snapshot knows it as gpuvm's own.
            write_all_at(file, &metadata, 0)?;
            file.set_len(file_len)?;
            self.write_data(file, ram, &scanned, data_offset, cursor)?;
            // A fault-thread failure means a page may have changed unseen.
            self.check_fault_thread().map_err(std::io::Error::other)
        })
        .map_err(|e| SnapshotError::io("write memory file", path, e))?;
        Ok(WriteStats {
            info,
            pages_examined: scanned.pages_examined,
            data_pages,
            zero_pages: 0,
            extents,
            file_len,
            scan_time,
            write_time: write_start.elapsed(),
        })
    }

    /// Copies `count` pages from linear page `first` (all in `region`) into `buf` as they
    /// were at the freeze.
    fn read_frozen(
        &self,
        region: usize,
        first: u64,
        count: u64,
        buf: &mut [u8],
    ) -> std::io::Result<()> {
        let shared = &self.shared;
        let page_size = shared.page_size as usize;
        shared.read_pages(region, first, &mut buf[..count as usize * page_size])?;
        // Orders the reads above before the checks below (a page settled after them was
        // still protected while it was read, see `on_write_fault`).
        fence(Ordering::SeqCst);
        let copies = shared.copies.lock().unwrap_or_else(|e| e.into_inner());
        for i in 0..count {
            if shared.is_settled(first + i) {
                if let Some(copy) = copies.get(&(first + i)) {
                    let at = i as usize * page_size;
                    buf[at..at + page_size].copy_from_slice(copy);
                }
            }
        }
        Ok(())
    }

    /// The scan pass: which pages hold data, and their CRCs, as at the freeze.
    fn scan(&self, ram: &RamMappings<'_>, page_crcs: bool) -> Result<ScanResult> {
        let layout = ram.layout();
        let page_size = layout.page_size();
        let chunk_pages = (CHUNK_BYTES / page_size).max(1);
        let memfd = ram.memfd().and_then(private_description);
        let mut buf = vec![0u8; (chunk_pages * page_size) as usize];
        let mut out = ScanResult::default();
        for region in 0..layout.regions().len() {
            let first_linear = layout.region_first_linear(region);
            let pages = layout.region_pages(region);
            // Holes of the memfd are zero at the freeze: a hole the guest writes later is
            // copied (as zeros) by the fault thread, which the data pass then reads.
            for (span_start, span_end, maybe_data) in spans(ram, memfd.as_ref(), region, 0, pages) {
                out.pages_examined += span_end - span_start;
                if !maybe_data {
                    continue;
                }
                let mut page = span_start;
                while page < span_end {
                    let count = chunk_pages.min(span_end - page);
                    self.read_frozen(region, first_linear + page, count, &mut buf)
                        .map_err(|e| {
                            SnapshotError::io("read guest RAM for", "the memory file", e)
                        })?;
                    for i in 0..count as usize {
                        let data = &buf[i * page_size as usize..(i + 1) * page_size as usize];
                        // SAFETY: `data` is a readable page-sized slice of `buf`.
                        if !unsafe { page_is_zero(data.as_ptr(), data.len()) } {
                            out.push(region, first_linear + page + i as u64, ExtentKind::Data);
                            if page_crcs {
                                out.page_crcs.push(crc32fast::hash(data));
                            }
                        }
                    }
                    page += count;
                }
            }
            self.check_fault_thread()?;
        }
        Ok(out)
    }

    /// The data pass: every data page, as at the freeze, in index order; protection is
    /// lifted behind it.
    fn write_data(
        &self,
        file: &File,
        ram: &RamMappings<'_>,
        scanned: &ScanResult,
        data_offset: u64,
        cursor: &mut Cursor,
    ) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let page_size = self.shared.page_size;
        let chunk_pages = (CHUNK_BYTES / page_size).max(1);
        let mut buf = vec![0u8; (chunk_pages * page_size) as usize];
        let mut offset = data_offset;
        for run in scanned.runs.iter().filter(|r| r.kind == ExtentKind::Data) {
            let mut page = run.start;
            let end = run.start + run.count;
            while page < end {
                let count = chunk_pages.min(end - page);
                let len = (count * page_size) as usize;
                self.read_frozen(run.region, page, count, &mut buf[..len])?;
                file.write_all_at(&buf[..len], offset)?;
                start_writeback(file, offset, len);
                offset += len as u64;
                page += count;
                self.release_until(cursor, page)?;
            }
        }
        self.release_until(cursor, ram.layout().total_pages())
    }

    /// Marks every page before linear page `end` settled (written: the fault thread no
    /// longer copies it), drops its copies and lifts its protection.
    fn release_until(&self, cursor: &mut Cursor, end: u64) -> std::io::Result<()> {
        let shared = &self.shared;
        while cursor.next < end {
            let Some((region, r)) = shared
                .regions
                .iter()
                .enumerate()
                .find(|(_, r)| cursor.next < r.first_linear + r.len / shared.page_size)
            else {
                break;
            };
            let stop = end.min(r.first_linear + r.len / shared.page_size);
            {
                let mut copies = shared.copies.lock().unwrap_or_else(|e| e.into_inner());
                for linear in cursor.next..stop {
                    shared.settle(linear);
                }
                let kept = copies.split_off(&stop);
                copies.retain(|&linear, _| linear < cursor.next);
                copies.extend(kept);
            }
            let start = shared.host_addr_of(region, cursor.next);
            set_protection(
                shared.uffd.as_raw_fd(),
                start,
                (stop - cursor.next) * shared.page_size,
                false,
            )?;
            cursor.next = stop;
        }
        Ok(())
    }
}

/// poll(2) on `fds` with no timeout, again when a signal interrupts it.
fn poll_until_ready(fds: &mut [libc::pollfd]) -> std::io::Result<()> {
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed array of pollfds for the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) } >= 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// How far the data pass has released guest RAM (linear pages before `next`).
#[derive(Default)]
struct Cursor {
    next: u64,
}

impl Drop for WriteProtectedRam {
    fn drop(&mut self) {
        let shared = &self.shared;
        if !self.released_all {
            shared.lift_all();
        }
        shared.stop.store(true, Ordering::Release);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from `one` to the eventfd owned by `shared`.
        unsafe {
            libc::write(
                shared.stop_event.as_raw_fd(),
                one.as_ptr().cast(),
                one.len(),
            )
        };
        if let Some(thread) = self.fault_thread.take() {
            if thread.join().is_err() {
                log::error!("background snapshot: the write-fault thread panicked");
            }
        }
        for r in &shared.regions {
            let mut range = UffdioRange {
                start: r.host_addr,
                len: r.len,
            };
            if let Err(error) = uffd_ioctl(shared.uffd.as_raw_fd(), UFFDIO_UNREGISTER, &mut range) {
                log::warn!(
                    "background snapshot: cannot unregister guest RAM at {:#x}: {error}",
                    r.host_addr
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::test_util::TempDir;
    use crate::snapshot::{write_full, SnapshotChain};

    /// A memfd-backed "guest" of `pages` 4 KiB pages with recognisable contents.
    struct TestRam {
        _memfd: File,
        base: *mut u8,
        len: usize,
        layout: crate::snapshot::RamLayout,
    }

    impl TestRam {
        fn new(pages: u64) -> TestRam {
            let len = (pages * 4096) as usize;
            // SAFETY: memfd_create with a valid C string; the fd is checked below.
            let fd = unsafe { libc::memfd_create(c"bg-test".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0);
            // SAFETY: fresh fd, owned from here.
            let memfd = unsafe { File::from_raw_fd(fd) };
            memfd.set_len(len as u64).unwrap();
            // SAFETY: maps the memfd shared; checked against MAP_FAILED below.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    memfd.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(base, libc::MAP_FAILED);
            let layout = crate::snapshot::RamLayout::new(
                4096,
                vec![
                    crate::RamRegion {
                        guest_addr: 0,
                        size: len as u64 / 2,
                        file_offset: 0,
                    },
                    crate::RamRegion {
                        guest_addr: 1 << 32,
                        size: len as u64 / 2,
                        file_offset: len as u64 / 2,
                    },
                ],
            )
            .unwrap();
            TestRam {
                _memfd: memfd,
                base: base.cast(),
                len,
                layout,
            }
        }

        fn mappings(&self) -> RamMappings<'_> {
            let half = self.len / 2;
            // SAFETY: both halves are mapped read-write for as long as `self` lives.
            unsafe {
                RamMappings::new(
                    self.layout.clone(),
                    vec![self.base, self.base.wrapping_add(half)],
                )
            }
            .unwrap()
            .with_memfd(std::os::fd::AsFd::as_fd(&self._memfd))
        }

        fn bytes(&self) -> &[u8] {
            // SAFETY: the mapping is `len` bytes and lives as long as `self`.
            unsafe { std::slice::from_raw_parts(self.base, self.len) }
        }
    }

    impl Drop for TestRam {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the mapping made in `new`.
            unsafe { libc::munmap(self.base.cast(), self.len) };
        }
    }

    /// Writes `value` into every `stride`th page's first word, through volatile writes
    /// (the "guest").
    fn scribble(base: usize, pages: u64, stride: u64, value: u64) {
        for page in (0..pages).step_by(stride as usize) {
            // SAFETY: inside the test mapping, 8-byte aligned.
            unsafe { std::ptr::write_volatile((base + page as usize * 4096) as *mut u64, value) };
        }
    }

    #[test]
    fn the_file_holds_ram_as_at_the_freeze_while_it_changes() {
        if let Some(reason) = background_unsupported() {
            eprintln!("skipped: {reason}");
            return;
        }
        let pages = 4096;
        let ram = TestRam::new(pages);
        let base = ram.base as usize;
        // Every third page holds data; the rest stay holes.
        scribble(base, pages, 3, 0x1111);
        let mappings = ram.mappings();
        let armed = WriteProtectedRam::arm(&mappings, None).unwrap();
        // Written between arming and freezing: part of the snapshot.
        scribble(base, pages, 5, 0x2222);
        let reprotected = armed.freeze().unwrap();
        assert!(reprotected > 0);
        let frozen = ram.bytes().to_vec();
        let dir = TempDir::new("background");
        // Written after the freeze, while the file is written: not part of it.
        let stop = Arc::new(AtomicBool::new(false));
        let guest = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    scribble(base, pages, 2, 0x3333_0000 + round);
                }
                round
            })
        };
        let path = dir.path().join("mem");
        let (stats, _) = armed
            .write_full(&path, &mappings, &WriteOptions::default())
            .unwrap();
        stop.store(true, Ordering::Relaxed);
        assert!(guest.join().unwrap() > 0);
        assert!(stats.data_pages > 0);
        // Equal, byte for byte, to what the paused writer makes of the frozen contents.
        let expected = TestRam::new(pages);
        // SAFETY: both mappings are `len` bytes; they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(frozen.as_ptr(), expected.base, frozen.len()) };
        let chain = SnapshotChain::open(std::slice::from_ref(&path), &ram.layout).unwrap();
        let restored = TestRam::new(pages);
        crate::snapshot::restore_eager(&chain, &restored.mappings(), &Default::default()).unwrap();
        assert!(
            restored.bytes() == frozen.as_slice(),
            "restored RAM differs from the freeze"
        );
        let paused = dir.path().join("paused");
        let paused_stats =
            write_full(&paused, &expected.mappings(), &WriteOptions::default()).unwrap();
        assert_eq!(paused_stats.data_pages, stats.data_pages);
        // The guest writes freely again.
        scribble(base, pages, 1, 0x4444);
    }
}
