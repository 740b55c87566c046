//! Lazy restore of guest RAM with userfaultfd.
//!
//! The VMM's flow:
//! 1. [`SnapshotChain::open`](crate::snapshot::SnapshotChain::open) — validates the files
//!    before anything touches guest memory.
//! 2. Create fresh guest RAM (a new memfd) and its KVM memslots.
//! 3. [`start_lazy_restore`] — registers the guest RAM mappings (the ones the memslots
//!    point at) with a userfaultfd in MISSING mode and starts the loader: a fault-serving
//!    thread plus a background thread streaming the rest of the file. Do this before
//!    resuming vCPUs.
//! 4. Resume vCPUs; [`LazyRestore::wait`] when everything must be resident, or just keep
//!    going.
//!
//! Alternatively the VMM can hand the userfaultfd to another process with the
//! Firecracker-compatible handshake in [`external`].

pub mod external;
pub mod fence;
mod loader;
mod ops;

#[cfg(test)]
mod tests;

use std::io;

use log::debug;
use userfaultfd::{IoctlFlags, Uffd, UffdBuilder};

use crate::snapshot::{RamMappings, SnapshotError};

pub use loader::{LazyCompletion, LazyOptions, LazyRestore, LazyStats, ThreadStartHook};

/// Errors from userfaultfd setup, lazy loading and the external-handler handshake.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// The userfaultfd could not be created (needs root or vm.unprivileged_userfaultfd=1).
    #[error("cannot create a userfaultfd: {0}")]
    Create(#[source] userfaultfd::Error),
    /// Registering a guest RAM range failed.
    #[error("cannot register {len:#x} bytes at {addr:#x} with userfaultfd: {source}")]
    Register {
        addr: u64,
        len: u64,
        #[source]
        source: userfaultfd::Error,
    },
    /// The kernel does not offer an ioctl the loader needs on a range.
    #[error("userfaultfd range at {addr:#x} lacks {missing} (available: {available})")]
    MissingIoctls {
        addr: u64,
        missing: String,
        available: String,
    },
    /// `UFFDIO_UNREGISTER` failed.
    #[error("cannot unregister {len:#x} bytes at {addr:#x} from userfaultfd: {source}")]
    Unregister {
        addr: u64,
        len: u64,
        #[source]
        source: userfaultfd::Error,
    },
    /// `UFFDIO_COPY` or `UFFDIO_ZEROPAGE` failed.
    #[error("{op} at {addr:#x} failed: {}", io::Error::from_raw_os_error(*errno))]
    Fill {
        op: &'static str,
        addr: u64,
        errno: i32,
    },
    /// `UFFDIO_COPY`/`UFFDIO_ZEROPAGE` kept returning EAGAIN without progress.
    #[error("{op} at {addr:#x} made no progress after {attempts} EAGAIN retries")]
    Stuck {
        op: &'static str,
        addr: u64,
        attempts: u32,
    },
    /// `UFFDIO_WAKE` failed.
    #[error("cannot wake faulting threads at {addr:#x}: {source}")]
    Wake {
        addr: u64,
        #[source]
        source: userfaultfd::Error,
    },
    /// Reading fault events failed.
    #[error("cannot read userfaultfd events: {0}")]
    ReadEvents(#[source] userfaultfd::Error),
    /// A system call around the loader failed.
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// Reading or validating the snapshot failed.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The guest RAM description does not fit the snapshot.
    #[error("guest RAM does not match the snapshot: {0}")]
    Layout(String),
    /// The loader stopped with an error; pages may be missing, the guest must not run on.
    #[error("lazy restore failed: {0}")]
    RestoreFailed(String),
    /// The external page-fault handler stopped serving guest memory (it exited or hung
    /// up); guest RAM has been fenced.
    #[error("{0}")]
    HandlerFailed(String),
    /// Waiting for guest memory to be loaded gave up: whoever loads it (`server`) made no
    /// progress for `stalled`. Nothing was cancelled; it may still go on.
    #[error(
        "guest memory is still being served by {server}, which made no progress for {} s",
        .stalled.as_secs()
    )]
    NoProgress {
        server: &'static str,
        stalled: std::time::Duration,
    },
    /// The handshake message was malformed.
    #[error("bad userfaultfd handshake: {0}")]
    Handshake(String),
    /// The handshake message was not valid JSON for the mapping list.
    #[error("bad userfaultfd handshake JSON: {0}")]
    HandshakeJson(#[source] serde_json::Error),
}

pub(crate) fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> UffdError {
    move |source| UffdError::Io { op, source }
}

/// Locks `m`, carrying on through poisoning (a panicked loader thread must not wedge the
/// others or the VMM).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates a userfaultfd (non-blocking, close-on-exec, handling kernel-mode faults too:
/// KVM reaches guest memory through `get_user_pages`, not user-mode accesses).
pub fn create_uffd() -> Result<Uffd, UffdError> {
    UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .create()
        .map_err(UffdError::Create)
}

/// Registers `len` bytes at each `(host_addr, len)` in MISSING mode and checks that the
/// ioctls the loader uses are available there (`UFFDIO_ZEROPAGE` is not required for
/// hugetlb ranges, where the kernel does not offer it).
pub fn register_ranges(
    uffd: &Uffd,
    ranges: &[(u64, u64)],
    page_size: u64,
) -> Result<(), UffdError> {
    let mut needed = IoctlFlags::COPY | IoctlFlags::WAKE;
    if page_size == ops::BASE_PAGE_SIZE {
        needed |= IoctlFlags::ZEROPAGE;
    }
    for &(addr, len) in ranges {
        let available = uffd
            .register(addr as *mut libc::c_void, len as usize)
            .map_err(|source| UffdError::Register { addr, len, source })?;
        if !available.contains(needed) {
            return Err(UffdError::MissingIoctls {
                addr,
                missing: format!("{:?}", needed.difference(available)),
                available: format!("{available:?}"),
            });
        }
        debug!("userfaultfd registered {len:#x} bytes at {addr:#x}");
    }
    Ok(())
}

/// Creates a userfaultfd and registers every region of `ram` with it.
pub fn register_guest_ram(ram: &RamMappings<'_>) -> Result<Uffd, UffdError> {
    let uffd = create_uffd()?;
    register_ranges(&uffd, &guest_ram_ranges(ram), ram.layout().page_size())?;
    Ok(uffd)
}

/// The `(host address, length)` of every guest RAM region of `ram`.
pub fn guest_ram_ranges(ram: &RamMappings<'_>) -> Vec<(u64, u64)> {
    ram.host_addrs()
        .into_iter()
        .zip(ram.layout().regions())
        .map(|(addr, r)| (addr, r.size))
        .collect()
}

/// Registers `ram` with a new userfaultfd and starts loading `chain` into it lazily.
/// Call before the vCPUs run; `ram` must be fresh (never touched).
///
/// If the loader fails (the memory file became unreadable, short or different after it
/// was validated), guest RAM is fenced (see [`fence`]): no vCPU reads a page that was
/// not loaded, none waits forever, and [`LazyRestore::wait_timeout`] reports the error.
pub fn start_lazy_restore(
    chain: std::sync::Arc<crate::snapshot::SnapshotChain>,
    ram: &RamMappings<'_>,
    opts: LazyOptions,
) -> Result<LazyRestore, UffdError> {
    chain.layers()[0].check_layout(ram.layout())?;
    let uffd = register_guest_ram(ram)?;
    let fence = fence::RamFence::new(guest_ram_ranges(ram));
    LazyRestore::start_fenced(chain, &ram.host_addrs(), uffd, opts, Some(fence))
}
