//! Shared guest RAM with transparent huge pages on hosts whose shmem THP policy is `never`.
//!
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` governs only the kernel's internal
//! shmem mount (memfd, SysV shm); a tmpfs mounted with `huge=` follows its own option.
//! So gpuvm mounts a tmpfs of its own with `huge=advise`, never attached anywhere:
//! `fsopen`/`fsconfig`/`fsmount` give a detached mount that only the returned descriptor
//! reaches, so nothing appears in any mount table and nothing is left behind if gpuvm is
//! killed. One file is created in it and unlinked; once the mount descriptor is closed the
//! file's descriptor is the only thing keeping the superblock alive. That descriptor is
//! used exactly as a memfd is: `MAP_SHARED` mappings, sent to vhost-user back ends,
//! reopened through /proc, read and written by the snapshot code.
//!
//! `huge=advise` rather than `within_size`: huge pages go where the mapping asks for them
//! with `MADV_HUGEPAGE`, which lets [`crate::backing`] keep the first
//! [`SMALL_PAGE_PREFIX`] of guest RAM in 4 KiB pages (see there).
//!
//! Mounting needs CAP_SYS_ADMIN (in the user namespace owning the mount namespace); where
//! gpuvm lacks it the caller falls back to a memfd and says why.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Set to any value to behave as if the private mount were not possible (tests, and a
/// way to compare the two backings without rebuilding).
pub const DISABLE_ENV: &str = "GPUVM_NO_HUGE_TMPFS";

/// The host's shmem THP policy: it governs memfds, and only its `deny` and `force` reach
/// other tmpfs mounts.
pub const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The huge page size a tmpfs uses for its PMD-mapped folios on x86-64.
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// The first bytes of the RAM file (guest-physical 0 up: the real-mode area, boot
/// structures, firmware tables and a small guest's kernel) stay in 4 KiB pages. They are
/// touched sparsely, so huge pages there would only cost memory: the test guest (loaded
/// at 1 MiB, its image and zero-filled data reaching past 6 MiB) touches 0.8 MiB of them,
/// which 2 MiB pages turn into 4.7 MiB resident (bench/boot's peak RSS from 5.6 to 10.1
/// MiB) for no speed. A Linux vmlinux loads at 16 MiB, in huge pages.
pub const SMALL_PAGE_PREFIX: u64 = 8 << 20;

// The new mount API's constants (include/uapi/linux/mount.h); stable kernel ABI.
const FSOPEN_CLOEXEC: libc::c_uint = 0x1;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 0x1;
const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;
const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;
const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x8;

/// The file's name inside the private mount; /proc/PID/maps shows it (with
/// " (deleted)"), which is how people and tests find guest RAM there.
pub const FILE_NAME: &CStr = c"gpuvm-guest-ram";

/// Why no huge-page tmpfs file could be made.
#[derive(Debug, thiserror::Error)]
pub enum HugeTmpfsError {
    #[error("{DISABLE_ENV} is set")]
    Disabled,
    #[error("{SHMEM_ENABLED} is deny, which turns huge pages off on every tmpfs")]
    HostDenies,
    #[error("{step} failed: {source}")]
    Syscall {
        step: &'static str,
        source: io::Error,
    },
}

/// A new, unlinked file of `size` bytes on a private tmpfs mounted with `huge=advise`
/// (mappings with `MADV_HUGEPAGE` get 2 MiB pages), sized so the mount's limit is exactly what guest RAM needs.
pub fn create_file(size: u64) -> Result<File, HugeTmpfsError> {
    if std::env::var_os(DISABLE_ENV).is_some() {
        return Err(HugeTmpfsError::Disabled);
    }
    // `deny` (for emergencies) overrides every mount's huge= option.
    if std::fs::read_to_string(SHMEM_ENABLED).is_ok_and(|policy| policy.contains("[deny]")) {
        return Err(HugeTmpfsError::HostDenies);
    }
    let mount = private_mount(size)?;
    // SAFETY: FILE_NAME is NUL-terminated; `mount` is a live descriptor of the mount's
    // root directory. The kernel returns a new descriptor or -1.
    let fd = unsafe {
        libc::openat(
            mount.as_raw_fd(),
            FILE_NAME.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        )
    };
    let file: File = check_fd(fd, "creating the file on the private tmpfs")?;
    // SAFETY: as above; unlinkat only removes the name we just created.
    let ret = unsafe { libc::unlinkat(mount.as_raw_fd(), FILE_NAME.as_ptr(), 0) };
    if ret != 0 {
        return Err(syscall_error("unlinking the file on the private tmpfs"));
    }
    file.set_len(size)
        .map_err(|source| HugeTmpfsError::Syscall {
            step: "sizing the file on the private tmpfs",
            source,
        })?;
    Ok(file)
}

/// The root of a detached tmpfs mount (`huge=advise`, `size` rounded up to a huge
/// page, mode 0700, nosuid/nodev/noexec).
fn private_mount(size: u64) -> Result<OwnedFd, HugeTmpfsError> {
    // SAFETY: the name is a NUL-terminated string; fsopen takes no other memory.
    let fs = unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), FSOPEN_CLOEXEC) };
    let fs: OwnedFd = check_fd(fs as libc::c_int, "fsopen(tmpfs)")?;
    let limit = std::ffi::CString::new(size.next_multiple_of(HUGE_PAGE_SIZE).to_string())
        .expect("a number has no NUL byte");
    for (key, value) in [
        (c"huge", c"advise"),
        (c"mode", c"0700"),
        (c"size", limit.as_c_str()),
    ] {
        // SAFETY: key and value are NUL-terminated strings that outlive the call; `fs` is
        // the filesystem context fsopen returned.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                FSCONFIG_SET_STRING,
                key.as_ptr(),
                value.as_ptr(),
                0,
            )
        };
        if ret != 0 {
            return Err(syscall_error("fsconfig (tmpfs option)"));
        }
    }
    // SAFETY: no memory is passed; `fs` is the filesystem context.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    if ret != 0 {
        return Err(syscall_error("fsconfig (create tmpfs)"));
    }
    // SAFETY: no memory is passed; `fs` holds a created superblock. The result is a
    // descriptor of a mount that is attached nowhere.
    let mount = unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            fs.as_raw_fd(),
            FSMOUNT_CLOEXEC,
            MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        )
    };
    check_fd(mount as libc::c_int, "fsmount")
}

fn check_fd<T: FromRawFd>(fd: libc::c_int, step: &'static str) -> Result<T, HugeTmpfsError> {
    if fd < 0 {
        return Err(syscall_error(step));
    }
    // SAFETY: fd is a new descriptor the kernel just returned and nothing else owns.
    Ok(unsafe { T::from_raw_fd(fd) })
}

fn syscall_error(step: &'static str) -> HugeTmpfsError {
    HugeTmpfsError::Syscall {
        step,
        source: io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use std::sync::Arc;
    use std::time::Duration;

    use vm_memory::{Bytes, GuestAddress};

    use crate::snapshot::test_util::*;
    use crate::snapshot::{write_full, RamMappings, SnapshotChain, WriteOptions};
    use crate::uffd::{start_lazy_restore, LazyOptions};
    use crate::{Backing, GuestRam, GuestRamConfig};

    const MIB: u64 = 1 << 20;

    /// Whether this process may mount (the tests that need it say so and skip otherwise).
    pub(crate) fn can_mount() -> bool {
        match private_mount(HUGE_PAGE_SIZE) {
            Ok(_) => true,
            Err(e) => {
                eprintln!("skipped: cannot mount a private tmpfs here ({e})");
                false
            }
        }
    }

    #[test]
    fn the_file_is_sized_unlinked_and_usable() {
        if !can_mount() {
            return;
        }
        let file = create_file(6 << 20).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 6 << 20);
        assert_eq!(file.metadata().unwrap().nlink(), 0);
        file.write_all_at(b"tmpfs", (6 << 20) - 5).unwrap();
        let mut buf = [0u8; 5];
        file.read_exact_at(&mut buf, (6 << 20) - 5).unwrap();
        assert_eq!(&buf, b"tmpfs");
        // The snapshot scan reopens guest RAM through /proc; that works here too.
        let again = File::open(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
        again.read_exact_at(&mut buf, (6 << 20) - 5).unwrap();
        assert_eq!(&buf, b"tmpfs");
        // The mount's limit is the file's size: once all of it is allocated, growing
        // past it fails with ENOSPC.
        // SAFETY: fallocate on a descriptor we own; no memory is passed.
        assert_eq!(
            unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, 6 << 20) },
            0
        );
        let err = file.write_all_at(&[1u8; 4096], 6 << 20).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    }

    #[test]
    fn the_file_is_on_a_tmpfs_with_huge_pages() {
        if !can_mount() {
            return;
        }
        let attached = || {
            std::fs::read_to_string("/proc/self/mountinfo")
                .unwrap()
                .lines()
                .filter(|line| line.contains("huge=advise"))
                .count()
        };
        let before = attached();
        let file = create_file(4 << 20).unwrap();
        // SAFETY: statfs fills the zeroed struct we pass for a descriptor we own.
        let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fstatfs(file.as_raw_fd(), &mut stat) }, 0);
        assert_eq!(stat.f_type, libc::TMPFS_MAGIC);
        // The mount is attached nowhere: our mount table has no more huge tmpfs than before.
        assert_eq!(attached(), before);
    }

    /// Bytes of the mapping that starts at `addr` which the kernel maps with PMDs (2 MiB
    /// entries), from /proc/self/smaps.
    fn pmd_mapped_bytes(addr: *mut u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", addr as usize);
        let mut in_mapping = false;
        let mut kib = 0;
        for line in smaps.lines() {
            if line
                .split_whitespace()
                .next()
                .is_some_and(|r| r.contains('-') && !r.ends_with(':'))
            {
                in_mapping = line.starts_with(&start);
                continue;
            }
            if in_mapping {
                for key in ["ShmemPmdMapped:", "FilePmdMapped:"] {
                    if let Some(rest) = line.strip_prefix(key) {
                        kib += rest
                            .trim()
                            .trim_end_matches("kB")
                            .trim()
                            .parse::<u64>()
                            .unwrap();
                    }
                }
            }
        }
        kib * 1024
    }

    fn huge_config(size: u64) -> GuestRamConfig {
        GuestRamConfig {
            size,
            backing: Backing::Memfd,
            thp: true,
        }
    }

    #[test]
    fn default_guest_ram_gets_huge_pages() {
        if !can_mount() {
            return;
        }
        let regions = two_regions(12 * MIB, 4 * MIB, 4 * MIB);
        let ram = GuestRam::create(&huge_config(16 * MIB), &regions).unwrap();
        assert!(ram.huge_tmpfs());
        assert_eq!(ram.page_size(), 4096, "the snapshot page size stays 4 KiB");
        let (_, second) = ram.host_regions().nth(1).unwrap();
        assert_eq!(pmd_mapped_bytes(second), 0, "nothing is touched yet");
        ram.memory()
            .write_slice(&[7u8; 4096], GuestAddress(regions[1].guest_addr + MIB))
            .unwrap();
        // One write faults in a whole huge page (the region is 2 MiB aligned in the file
        // and, with MAP_SHARED of a huge tmpfs, in our address space).
        assert_eq!(pmd_mapped_bytes(second), 2 * MIB);
        assert_eq!(ram.resident_bytes().unwrap(), 2 * MIB);
        // The first MiBs stay in small pages; past them the first region is huge too.
        let (_, first) = ram.host_regions().next().unwrap();
        ram.memory()
            .write_slice(&[1u8], GuestAddress(SMALL_PAGE_PREFIX - 1))
            .unwrap();
        assert_eq!(pmd_mapped_bytes(first), 0);
        assert_eq!(ram.resident_bytes().unwrap(), 2 * MIB + 4096);
        ram.memory()
            .write_slice(&[1u8], GuestAddress(SMALL_PAGE_PREFIX))
            .unwrap();
        // MADV_HUGEPAGE on part of the mapping split it: the rest is a mapping of its own.
        let first_huge = first.wrapping_add(SMALL_PAGE_PREFIX as usize);
        assert_eq!(pmd_mapped_bytes(first_huge), 2 * MIB);
        assert_eq!(ram.resident_bytes().unwrap(), 4 * MIB + 4096);
        let mut buf = [0u8; 4];
        ram.memfd()
            .read_exact_at(&mut buf, regions[1].file_offset + MIB)
            .unwrap();
        assert_eq!(buf, [7; 4]);
    }

    #[test]
    fn turning_thp_off_gives_a_plain_memfd() {
        let config = GuestRamConfig {
            thp: false,
            ..huge_config(4 * MIB)
        };
        let ram = GuestRam::create(&config, &two_regions(2 * MIB, 0, 2 * MIB)).unwrap();
        assert!(!ram.huge_tmpfs());
        let link = std::fs::read_link(format!("/proc/self/fd/{}", ram.memfd().as_raw_fd()));
        assert!(link.unwrap().to_string_lossy().starts_with("/memfd:"));
    }

    /// Lazy restore (userfaultfd MISSING faults answered with UFFDIO_COPY) on huge tmpfs
    /// RAM: every page comes back right. UFFDIO_COPY fills shmem 4 KiB at a time, so the
    /// restored pages are small; only what the guest touches afterwards is huge.
    #[test]
    fn lazy_restore_works_on_huge_tmpfs_ram() {
        if !can_mount() {
            return;
        }
        let dir = TempDir::new("huge-lazy");
        let regions = two_regions(8 * MIB, 8 * MIB, 4 * MIB);
        let source = GuestRam::create(&huge_config(12 * MIB), &regions).unwrap();
        assert!(source.huge_tmpfs());
        let expected = fill_ram(&source, &mut Rng::new(30), |linear| match linear % 5 {
            0 | 1 => PageFill::Random,
            2 => PageFill::LastByte,
            _ => PageFill::Untouched,
        });
        let path = dir.path().join("mem");
        let source_mappings = RamMappings::from_guest_ram(&source).unwrap();
        write_full(&path, &source_mappings, &WriteOptions::default()).unwrap();

        let ram = GuestRam::create(&huge_config(12 * MIB), &regions).unwrap();
        assert!(ram.huge_tmpfs());
        let mappings = RamMappings::from_guest_ram(&ram).unwrap();
        let chain = Arc::new(SnapshotChain::open(&[&path], mappings.layout()).unwrap());
        let opts = LazyOptions {
            chunk_bytes: 256 << 10,
            loader_threads: 1,
            ..LazyOptions::default()
        };
        let restore = start_lazy_restore(chain, &mappings, opts).unwrap();
        // Fault a few pages ourselves while the loader runs.
        for linear in [3, 700, 2049, 2900] {
            let want = &expected[linear as usize * 4096..][..4096];
            assert!(read_page(&ram, linear) == want, "page {linear}");
        }
        let stats = restore
            .wait_timeout(Some(Duration::from_secs(60)))
            .unwrap()
            .expect("restore finished");
        assert!(stats.complete());
        assert_ram_eq(&ram, &expected);
        restore.shutdown().unwrap();
    }
}
