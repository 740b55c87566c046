//! The per-kind lists: which system calls, and which ioctl requests, each thread kind
//! may make.

use std::collections::BTreeMap;

use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use super::{ioctls, ThreadKind};

pub type Rules = BTreeMap<i64, Vec<SeccompRule>>;
type BuildResult<T> = Result<T, seccompiler::BackendError>;

fn arg(index: u8, op: SeccompCmpOp, value: u64) -> BuildResult<SeccompCondition> {
    SeccompCondition::new(index, SeccompCmpArgLen::Qword, op, value)
}

fn arg32(index: u8, op: SeccompCmpOp, value: u64) -> BuildResult<SeccompCondition> {
    SeccompCondition::new(index, SeccompCmpArgLen::Dword, op, value)
}

/// One rule per allowed value of a 32-bit argument.
fn one_of(index: u8, values: &[u32]) -> BuildResult<Vec<SeccompRule>> {
    values
        .iter()
        .map(|v| SeccompRule::new(vec![arg32(index, SeccompCmpOp::Eq, u64::from(*v))?]))
        .collect()
}

/// The one fallocate mode the VMM thread may use: freeing a range of guest RAM's file.
const VMM_FALLOCATE_MODE: u32 = (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u32;

fn allow_all(rules: &mut Rules, syscalls: &[i64]) {
    for nr in syscalls {
        rules.insert(*nr, Vec::new());
    }
}

/// What every thread needs: memory (never executable), futexes, signal returns, time,
/// logging to stderr, thread start and exit, and abort after a panic.
fn common(rules: &mut Rules) -> BuildResult<()> {
    allow_all(
        rules,
        &[
            libc::SYS_brk,
            libc::SYS_munmap,
            libc::SYS_mremap,
            libc::SYS_madvise,
            libc::SYS_futex,
            libc::SYS_rt_sigprocmask,
            libc::SYS_rt_sigreturn,
            libc::SYS_sigaltstack,
            libc::SYS_set_robust_list,
            libc::SYS_rseq,
            libc::SYS_sched_getaffinity,
            libc::SYS_sched_yield,
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_restart_syscall,
            libc::SYS_getrandom,
            libc::SYS_gettid,
            libc::SYS_getpid,
            libc::SYS_tgkill,
            libc::SYS_write,
            libc::SYS_close,
            libc::SYS_exit,
            libc::SYS_exit_group,
        ],
    );
    // No executable mappings, ever.
    let no_exec = || -> BuildResult<Vec<SeccompRule>> {
        Ok(vec![SeccompRule::new(vec![arg(
            2,
            SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64),
            0,
        )?])?])
    };
    rules.insert(libc::SYS_mmap, no_exec()?);
    rules.insert(libc::SYS_mprotect, no_exec()?);
    // Naming a new thread.
    rules.insert(libc::SYS_prctl, one_of(0, &[libc::PR_SET_NAME as u32])?);
    Ok(())
}

/// Dropping to another uid/gid (`--uid/--gid`): glibc makes every thread of the process
/// call these, so threads that exist before the drop need them.
fn setid(rules: &mut Rules) {
    allow_all(
        rules,
        &[
            libc::SYS_setgroups,
            libc::SYS_setresgid,
            libc::SYS_setresuid,
            libc::SYS_setgid,
            libc::SYS_setuid,
        ],
    );
}

fn fcntl(rules: &mut Rules) -> BuildResult<()> {
    rules.insert(
        libc::SYS_fcntl,
        one_of(
            1,
            &[
                libc::F_GETFD as u32,
                libc::F_SETFD as u32,
                libc::F_GETFL as u32,
                libc::F_SETFL as u32,
                libc::F_DUPFD_CLOEXEC as u32,
            ],
        )?,
    );
    Ok(())
}

/// Spawning threads: std uses clone3 (its flags live in memory a filter cannot read),
/// glibc falls back to clone, which is allowed for threads only (CLONE_THREAD|CLONE_VM):
/// no fork.
fn threads(rules: &mut Rules) -> BuildResult<()> {
    allow_all(rules, &[libc::SYS_clone3]);
    clone_threads_only(rules)
}

/// `clone` for threads only (CLONE_THREAD|CLONE_VM set).
fn clone_threads_only(rules: &mut Rules) -> BuildResult<()> {
    let thread = (libc::CLONE_THREAD | libc::CLONE_VM) as u64;
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![arg(
            0,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )?])?],
    );
    Ok(())
}

/// The device-thread factory's list: `device` (its threads inherit this filter and stack
/// the device filter on it, and filters intersect, so it must hold all of the device's)
/// plus what making such a thread takes beyond it, found by running the factory filtered:
/// `clone` for threads only (clone3, whose flags a filter cannot read, is answered ENOSYS
/// ahead of this list so that glibc falls back to clone: [`super::compile_factory`]), and
/// for the new thread's own filter `prctl(PR_SET_NO_NEW_PRIVS)` (seccompiler sets it,
/// already set) and `seccomp(SECCOMP_SET_MODE_FILTER)` without flags (no TSYNC). Stack,
/// guard, `set_robust_list`, `rseq`, `sigaltstack`, `sched_getaffinity`, `PR_SET_NAME`
/// and the exit path are in the common list already.
pub fn factory_rules(device: Rules) -> BuildResult<Rules> {
    let mut rules = device;
    clone_threads_only(&mut rules)?;
    stack_filters(&mut rules)?;
    Ok(rules)
}

/// The `api-takeover` thread's list (a new gpuvm after a live update): `api` (the API
/// thread it starts inherits this filter and stacks the API filter on it, and filters
/// intersect, so it must hold all of the API's) plus what it does before: wait for the old
/// gpuvm to exit (reading /proc/PID/stat), replace a stale API socket file and bind, listen
/// on a Unix socket at its path (where the old gpuvm did not hand its listening socket
/// over), make the API server's eventfd, and let the new thread install its own filter.
pub fn api_takeover_rules(api: Rules) -> BuildResult<Rules> {
    let mut rules = api;
    allow_all(
        &mut rules,
        &[
            libc::SYS_openat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_unlink,
            libc::SYS_bind,
            libc::SYS_listen,
            // The API server's eventfd that pauses its accept loop.
            libc::SYS_eventfd2,
        ],
    );
    rules.insert(libc::SYS_socket, one_of(0, &[libc::AF_UNIX as u32])?);
    stack_filters(&mut rules)?;
    Ok(rules)
}

/// Installing a further filter on a thread: `prctl(PR_SET_NO_NEW_PRIVS)` (seccompiler sets
/// it, already set) and `seccomp(SECCOMP_SET_MODE_FILTER)` without flags (no TSYNC).
fn stack_filters(rules: &mut Rules) -> BuildResult<()> {
    let mut prctl = rules.remove(&libc::SYS_prctl).unwrap_or_default();
    prctl.extend(one_of(0, &[libc::PR_SET_NO_NEW_PRIVS as u32])?);
    rules.insert(libc::SYS_prctl, prctl);
    rules.insert(
        libc::SYS_seccomp,
        vec![SeccompRule::new(vec![
            arg32(
                0,
                SeccompCmpOp::Eq,
                u64::from(libc::SECCOMP_SET_MODE_FILTER),
            )?,
            arg32(1, SeccompCmpOp::Eq, 0)?,
        ])?],
    );
    Ok(())
}

fn ioctl(rules: &mut Rules, requests: &[u32]) -> BuildResult<()> {
    rules.insert(libc::SYS_ioctl, one_of(1, requests)?);
    Ok(())
}

/// The list for `kind`.
pub fn rules(kind: ThreadKind) -> BuildResult<Rules> {
    use ioctls::*;
    let mut rules = Rules::new();
    common(&mut rules)?;
    fcntl(&mut rules)?;
    match kind {
        ThreadKind::Vmm => {
            threads(&mut rules)?;
            setid(&mut rules);
            allow_all(
                &mut rules,
                &[
                    // Event loop, timers, eventfds.
                    libc::SYS_epoll_wait,
                    // The event loop dropping stdin at EOF.
                    libc::SYS_epoll_ctl,
                    libc::SYS_timerfd_settime,
                    // virtio: a device's I/O thread gets a new stop eventfd when the
                    // device resumes after a snapshot or restarts after a drive swap
                    // (PATCH /drives), both on this thread.
                    libc::SYS_eventfd2,
                    libc::SYS_poll,
                    libc::SYS_read,
                    libc::SYS_writev,
                    // Snapshot files and lazy restore reads.
                    libc::SYS_openat,
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_pwritev,
                    libc::SYS_lseek,
                    libc::SYS_fstat,
                    libc::SYS_newfstatat,
                    libc::SYS_statx,
                    libc::SYS_mkdir,
                    libc::SYS_rename,
                    libc::SYS_unlink,
                    // Firecracker's snapshot layout: the state and memory files
                    // hard-linked out of (and into) the snapshot directory.
                    libc::SYS_linkat,
                    libc::SYS_getdents64,
                    libc::SYS_fsync,
                    libc::SYS_sync_file_range,
                    libc::SYS_ftruncate,
                    // Snapshot-directory and temp-file locks.
                    libc::SYS_flock,
                    libc::SYS_fadvise64,
                    libc::SYS_mincore,
                    // Kernel VFIO teardown finds the device's group through sysfs.
                    libc::SYS_readlink,
                    libc::SYS_readlinkat,
                    // vfio-user sockets (INTx unmask, teardown) and the external handler.
                    libc::SYS_sendmsg,
                    libc::SYS_recvmsg,
                    libc::SYS_sendto,
                    libc::SYS_recvfrom,
                    libc::SYS_shutdown,
                    // PCI hot-plug (PUT /gpus after start): connecting to a vfio-user
                    // device (Unix sockets only, below).
                    libc::SYS_connect,
                    // ...on a thread under a deadline; the connection's socket is told
                    // apart from others opened meanwhile by its peer's path, to shut it
                    // down (SYS_shutdown above) if the device never answers.
                    libc::SYS_getpeername,
                    // Virtio devices hot-plugged after start (Cloud Hypervisor's
                    // vm.add-disk, add-net, add-vsock) are opened here: rate-limit timers,
                    // a drive's io_uring (its I/O thread submits; this one never enters it).
                    libc::SYS_timerfd_create,
                    libc::SYS_io_uring_setup,
                    libc::SYS_io_uring_register,
                    // ... a vsock device's listening socket.
                    libc::SYS_bind,
                    libc::SYS_listen,
                ],
            );
            rules.insert(libc::SYS_socket, one_of(0, &[libc::AF_UNIX as u32])?);
            // Background snapshots: a userfaultfd write-protects guest RAM, and the thread
            // serving its faults stacks its own, tighter filter on this one (which can only
            // take rights away).
            allow_all(&mut rules, &[libc::SYS_userfaultfd]);
            stack_filters(&mut rules)?;
            // PCI hot-plug of a kernel VFIO device checks RLIMIT_MEMLOCK before pinning
            // guest RAM for it: getrlimit is prlimit64 on this process with no new limit.
            rules.insert(
                libc::SYS_prlimit64,
                vec![SeccompRule::new(vec![
                    arg(0, SeccompCmpOp::Eq, 0)?,
                    arg32(1, SeccompCmpOp::Eq, u64::from(libc::RLIMIT_MEMLOCK))?,
                    arg(2, SeccompCmpOp::Eq, 0)?,
                ])?],
            );
            // Live update (PUT /vmm/update): who listens on the hand-over socket, checked
            // against this process's own uid before the VM is offered.
            rules.insert(
                libc::SYS_getsockopt,
                vec![SeccompRule::new(vec![
                    arg32(1, SeccompCmpOp::Eq, libc::SOL_SOCKET as u64)?,
                    arg32(2, SeccompCmpOp::Eq, libc::SO_PEERCRED as u64)?,
                ])?],
            );
            allow_all(&mut rules, &[libc::SYS_geteuid]);
            // Memory hot-plug: the host pages of RAM the guest ejected are given back
            // (a hole punched in guest RAM's file); no other fallocate mode.
            rules.insert(libc::SYS_fallocate, one_of(1, &[VMM_FALLOCATE_MODE])?);
            // The GPU agent's connection (gpu_release): read and write timeouts only.
            rules.insert(
                libc::SYS_setsockopt,
                [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO]
                    .into_iter()
                    .map(|option| {
                        SeccompRule::new(vec![
                            arg32(1, SeccompCmpOp::Eq, libc::SOL_SOCKET as u64)?,
                            arg32(2, SeccompCmpOp::Eq, option as u64)?,
                        ])
                    })
                    .collect::<BuildResult<Vec<_>>>()?,
            );
            ioctl(
                &mut rules,
                &[
                    // PCI hot-plug of a kernel VFIO device: opening its container (or
                    // iommufd) and group, and the device.
                    VFIO_GET_API_VERSION,
                    VFIO_CHECK_EXTENSION,
                    VFIO_SET_IOMMU,
                    VFIO_GROUP_GET_STATUS,
                    VFIO_GROUP_SET_CONTAINER,
                    VFIO_GROUP_GET_DEVICE_FD,
                    VFIO_DEVICE_GET_INFO,
                    VFIO_IOMMU_GET_INFO,
                    VFIO_DEVICE_BIND_IOMMUFD,
                    VFIO_DEVICE_ATTACH_IOMMUFD_PT,
                    IOMMU_IOAS_ALLOC,
                    KVM_CREATE_DEVICE,
                    // Snapshots: VM state, dirty log, MSR list; PCI teardown and INTx.
                    KVM_CHECK_EXTENSION,
                    KVM_GET_MSR_INDEX_LIST,
                    KVM_GET_DIRTY_LOG,
                    KVM_GET_IRQCHIP,
                    KVM_GET_PIT2,
                    KVM_GET_CLOCK,
                    KVM_SET_USER_MEMORY_REGION,
                    KVM_SET_GSI_ROUTING,
                    KVM_IRQFD,
                    // virtio: notify ioeventfds placed on restore, removed at teardown.
                    KVM_IOEVENTFD,
                    // Kernel VFIO teardown: the group or cdev leaves the KVM VFIO device.
                    KVM_SET_DEVICE_ATTR,
                    KVM_HAS_DEVICE_ATTR,
                    // vCPU hot-plug (vm.resize): a vCPU created and set up here, then
                    // handed to a vCPU thread started with the VM (threads cannot be
                    // made under the vCPU filter later).
                    KVM_CREATE_VCPU,
                    KVM_SET_CPUID2,
                    KVM_GET_CPUID2,
                    KVM_SET_MSRS,
                    KVM_SET_FPU,
                    KVM_GET_LAPIC,
                    KVM_SET_LAPIC,
                    // Background snapshots: guest RAM write-protected (UFFDIO_UNREGISTER below).
                    UFFDIO_API,
                    UFFDIO_REGISTER,
                    UFFDIO_WRITEPROTECT,
                    // Lazy restore.
                    UFFDIO_COPY,
                    UFFDIO_ZEROPAGE,
                    UFFDIO_WAKE,
                    UFFDIO_UNREGISTER,
                    // Kernel VFIO: guest RAM DMA-mapped in the background (the `dma-map`
                    // thread runs under this filter).
                    VFIO_IOMMU_MAP_DMA,
                    IOMMU_IOAS_MAP,
                    // Kernel VFIO: INTx unmask, reset and unmapping at teardown.
                    VFIO_DEVICE_SET_IRQS,
                    VFIO_DEVICE_RESET,
                    // Kernel VFIO migration v2: a device's state into a snapshot and back.
                    VFIO_DEVICE_FEATURE,
                    VFIO_DEVICE_GET_REGION_INFO,
                    VFIO_DEVICE_GET_IRQ_INFO,
                    VFIO_GROUP_UNSET_CONTAINER,
                    VFIO_IOMMU_UNMAP_DMA,
                    VFIO_DEVICE_DETACH_IOMMUFD_PT,
                    IOMMU_DESTROY,
                    IOMMU_IOAS_UNMAP,
                    // virtio-net hot-plugged after start: its tap queues.
                    TUNSETIFF,
                    TUNGETIFF,
                    TUNSETOFFLOAD,
                    TUNSETVNETHDRSZ,
                    // stdin.
                    TCGETS,
                    TCSETS,
                    TCSETSW,
                    TIOCGWINSZ,
                    FIONBIO,
                    FIOCLEX,
                ],
            )?;
        }
        ThreadKind::Vcpu => {
            // vCPU threads start while the VM is built, before the jail drops privileges
            // (their filters go in early, off the restore's critical path), so they take
            // part in glibc's set*id broadcast like every other thread.
            setid(&mut rules);
            allow_all(
                &mut rules,
                &[
                    // Device emulation: eventfds, the serial console, VFIO regions
                    // (pread/pwrite on the device fd), vfio-user messages.
                    libc::SYS_read,
                    libc::SYS_writev,
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_sendmsg,
                    libc::SYS_recvmsg,
                    libc::SYS_sendto,
                    libc::SYS_recvfrom,
                ],
            );
            ioctl(
                &mut rules,
                &[
                    KVM_RUN,
                    // Exit handling (instructions completed for KVM's emulator).
                    KVM_GET_REGS,
                    KVM_SET_REGS,
                    KVM_GET_VCPU_EVENTS,
                    KVM_SET_VCPU_EVENTS,
                    // Saving state for a snapshot (on the vCPU's own thread).
                    KVM_GET_SREGS,
                    KVM_GET_MSRS,
                    KVM_GET_LAPIC,
                    KVM_GET_CPUID2,
                    KVM_GET_MP_STATE,
                    KVM_GET_DEBUGREGS,
                    KVM_GET_TSC_KHZ,
                    KVM_GET_XSAVE,
                    KVM_GET_XCRS,
                    // PCI: BAR moves become memory slots, MSI/MSI-X messages GSI routes
                    // (the irqfds are registered at setup).
                    KVM_SET_USER_MEMORY_REGION,
                    KVM_SET_GSI_ROUTING,
                    // Kernel VFIO: interrupts on and off.
                    VFIO_DEVICE_SET_IRQS,
                    VFIO_DEVICE_GET_IRQ_INFO,
                    // virtio: queue notify addresses follow the BAR as the guest places it.
                    KVM_IOEVENTFD,
                ],
            )?;
            // virtio: a device activated by its driver gets a stop eventfd for its I/O
            // thread (which already exists: see ThreadKind::Device), and disarms or arms
            // its timers (vsock's connection deadlines, rate limits) as it starts or stops.
            allow_all(&mut rules, &[libc::SYS_eventfd2, libc::SYS_timerfd_settime]);
        }
        ThreadKind::Device => {
            // Created with the VM, before the jail drops privileges.
            setid(&mut rules);
            allow_all(
                &mut rules,
                &[
                    // The worker's event loop and rate-limit timers.
                    libc::SYS_epoll_create1,
                    libc::SYS_epoll_ctl,
                    libc::SYS_epoll_wait,
                    libc::SYS_epoll_pwait,
                    libc::SYS_timerfd_settime,
                    libc::SYS_timerfd_gettime,
                    libc::SYS_read,
                    libc::SYS_readv,
                    libc::SYS_writev,
                    // Disk images: reads, writes, flush, discard and write-zeroes.
                    libc::SYS_pread64,
                    libc::SYS_pwrite64,
                    libc::SYS_preadv,
                    libc::SYS_pwritev,
                    libc::SYS_preadv2,
                    libc::SYS_pwritev2,
                    libc::SYS_fsync,
                    libc::SYS_fdatasync,
                    libc::SYS_fallocate,
                    libc::SYS_fstat,
                    libc::SYS_newfstatat,
                    libc::SYS_lseek,
                    libc::SYS_io_uring_enter,
                    // vsock: host sockets, and the guest's connections to <uds>_<port>.
                    libc::SYS_accept4,
                    libc::SYS_connect,
                    libc::SYS_sendmsg,
                    libc::SYS_recvmsg,
                    libc::SYS_sendto,
                    libc::SYS_recvfrom,
                    libc::SYS_shutdown,
                    libc::SYS_getsockopt,
                ],
            );
            // vsock's guest-initiated connections: Unix stream sockets only.
            rules.insert(libc::SYS_socket, one_of(0, &[libc::AF_UNIX as u32])?);
            // virtio-net: tap queues follow the queue pairs the driver uses.
            ioctl(&mut rules, &[FIONBIO, FIOCLEX, TUNSETQUEUE])?;
        }
        ThreadKind::SnapshotFault => {
            // Write faults read from the userfaultfd (poll, read) and answered, the
            // faulting block copied aside through the RAM memfd (pread64) first; the
            // eventfd that stops it is written by the main thread.
            allow_all(
                &mut rules,
                &[libc::SYS_poll, libc::SYS_read, libc::SYS_pread64],
            );
            ioctl(&mut rules, &[UFFDIO_WRITEPROTECT])?;
        }
        ThreadKind::Api => {
            threads(&mut rules)?;
            setid(&mut rules);
            allow_all(
                &mut rules,
                &[
                    libc::SYS_accept4,
                    // The accept loop waits in poll on the listener and the eventfd that
                    // pauses it for a live update (read to clear it).
                    libc::SYS_poll,
                    libc::SYS_read,
                    libc::SYS_recvfrom,
                    // Requests are read with recvmsg: Cloud Hypervisor's vm.add-net brings
                    // tap descriptors (SCM_RIGHTS) with its bytes.
                    libc::SYS_recvmsg,
                    libc::SYS_sendto,
                    libc::SYS_writev,
                    libc::SYS_setsockopt,
                    libc::SYS_shutdown,
                ],
            );
        }
    }
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

    use super::*;
    use crate::seccomp::{compile, Settings, VIOLATION_SYSCALL};

    fn allowed(kind: ThreadKind) -> Vec<i64> {
        rules(kind).unwrap().keys().copied().collect()
    }

    #[test]
    fn filters_stay_small() {
        for kind in ThreadKind::ALL {
            let rules = rules(kind).unwrap();
            let ioctls = rules.get(&libc::SYS_ioctl).map_or(0, Vec::len);
            let program = compile(kind, &Settings::default()).unwrap();
            eprintln!(
                "{}: {} system calls, {} ioctl requests, {} BPF instructions",
                kind.name(),
                rules.len(),
                ioctls,
                program.len()
            );
            assert!(program.len() < 1024, "{kind:?}: {}", program.len());
        }
    }

    #[test]
    fn the_violation_call_is_in_no_filter() {
        for kind in ThreadKind::ALL {
            assert!(!allowed(kind).contains(&VIOLATION_SYSCALL), "{kind:?}");
        }
    }

    #[test]
    fn api_threads_have_no_ioctls_or_files() {
        let api = allowed(ThreadKind::Api);
        for nr in [
            libc::SYS_ioctl,
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_socket,
        ] {
            assert!(!api.contains(&nr), "{nr}");
        }
        let vcpu = allowed(ThreadKind::Vcpu);
        for nr in [
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_clone3,
            libc::SYS_socket,
        ] {
            assert!(!vcpu.contains(&nr), "{nr}");
        }
        assert!(!allowed(ThreadKind::Vmm).contains(&libc::SYS_execve));
    }

    /// Runs `body` on a new thread under the VMM thread's rules, with what they refuse
    /// failing with EPERM instead of killing the test.
    fn under_the_vmm_filter<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            refuse_outside(rules(ThreadKind::Vmm).unwrap());
            body()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn the_vmm_filter_reads_the_memlock_limit_but_cannot_change_limits() {
        let outcome = under_the_vmm_filter(|| {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit and setrlimit read and write one rlimit we own.
            let memlock = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
            // SAFETY: as above.
            let nofile = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
            // SAFETY: as above; the filter refuses it before it changes anything.
            let set = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) };
            (memlock, nofile, set)
        });
        assert_eq!(outcome, (0, -1, -1), "(memlock read, nofile read, set)");
    }

    #[test]
    fn the_vmm_filter_punches_holes_but_allocates_nothing() {
        let file = tempfile_in_memory();
        let outcome = under_the_vmm_filter(move || {
            use std::os::fd::AsRawFd;
            let fd = file.as_raw_fd();
            // SAFETY: fallocate on a memfd this closure owns.
            let punch = unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    0,
                    4096,
                )
            };
            // SAFETY: as above; the filter refuses it before it changes anything.
            let allocate = unsafe { libc::fallocate(fd, 0, 0, 4096) };
            (punch, allocate)
        });
        assert_eq!(outcome, (0, -1), "(punch hole, allocate)");
    }

    fn tempfile_in_memory() -> std::fs::File {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create with a static name; the descriptor is owned by the File.
        let fd = unsafe { libc::memfd_create(c"seccomp-test".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by nobody else.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.set_len(8192).unwrap();
        file
    }

    #[test]
    fn the_vmm_filter_allows_threads_but_not_fork() {
        let outcome = under_the_vmm_filter(|| {
            let thread = std::thread::spawn(|| 7).join().unwrap();
            // SAFETY: the child, if one is ever created, leaves at once without touching
            // anything the parent owns.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: _exit in the child ends it without running the parent's cleanup.
                unsafe { libc::_exit(0) };
            }
            let errno = std::io::Error::last_os_error().raw_os_error();
            // SAFETY: a raw clone without CLONE_THREAD, refused before it does anything.
            let raw = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD as u64, 0, 0, 0, 0) };
            if raw == 0 {
                // SAFETY: as above, in a child that must not exist.
                unsafe { libc::_exit(0) };
            }
            (thread, pid, errno, raw)
        });
        assert_eq!(outcome.0, 7, "threads can be spawned");
        assert_eq!(
            (outcome.1, outcome.2),
            (-1, Some(libc::EPERM)),
            "fork refused"
        );
        assert_eq!(outcome.3, -1, "clone without CLONE_THREAD refused");
    }

    #[test]
    fn the_vmm_filter_allows_the_live_update_checks() {
        use crate::update::socket;
        let dir = socket::PrivateDir::create(&std::env::temp_dir(), "gpuvm-rules-").unwrap();
        let path = dir.path().join("handover.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let outcome = under_the_vmm_filter(move || {
            let _b = b;
            // The old process: who listens, its own uid, the socket's path.
            let peer = socket::peer_credentials(&a).map(|peer| peer.pid).ok();
            let uid = socket::effective_uid();
            let mut value: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: getsockopt writes one int into `value` and its length into `len`,
            // both live locals (or nothing, refused by the filter).
            let other_option = unsafe {
                libc::getsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(&a),
                    libc::SOL_SOCKET,
                    libc::SO_ACCEPTCONN,
                    (&mut value as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            (peer, uid, other_option, socket::check_path(&path).is_ok())
        });
        // SAFETY: geteuid has no arguments and cannot fail.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(
            outcome,
            (Some(std::process::id()), uid, -1, true),
            "(peer pid, euid, SO_ACCEPTCONN refused, path checked)"
        );
    }

    /// `rules` on the calling thread, with what they refuse failing with EPERM.
    fn refuse_outside(rules: Rules) {
        let filter = SeccompFilter::new(
            rules,
            SeccompAction::Errno(libc::EPERM as u32),
            SeccompAction::Allow,
            TargetArch::x86_64,
        )
        .unwrap();
        let program: BpfProgram = filter.try_into().unwrap();
        seccompiler::apply_filter(&program).unwrap();
    }

    #[test]
    fn the_api_takeover_thread_binds_the_api_socket_and_starts_an_api_thread() {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        use std::os::unix::net::{UnixListener, UnixStream};
        let dir = crate::update::socket::PrivateDir::create(&std::env::temp_dir(), "gpuvm-rules-")
            .unwrap();
        let path = dir.path().join("api.sock");
        // The stale socket file a killed old gpuvm leaves.
        drop(UnixListener::bind(&path).unwrap());
        let bound = path.clone();
        let takeover = std::thread::spawn(move || {
            refuse_outside(api_takeover_rules(rules(ThreadKind::Api).unwrap()).unwrap());
            // What ApiServer::start does, after waiting on /proc/PID/stat.
            let waited = std::fs::read_to_string("/proc/self/stat").is_ok();
            std::fs::remove_file(&bound).unwrap();
            let listener = UnixListener::bind(&bound).unwrap();
            // The eventfd that pauses the API server's accept loop.
            let wake = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap();
            wake.write(1).unwrap();
            let api = std::thread::spawn(move || {
                refuse_outside(rules(ThreadKind::Api).unwrap());
                // The accept loop: poll on the listener and the eventfd, which it reads.
                let mut polled = [
                    libc::pollfd {
                        fd: listener.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: wake.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: poll reads and writes the two pollfds passed, a live local.
                let ready = unsafe { libc::poll(polled.as_mut_ptr(), 2, 5000) };
                assert!(ready >= 1, "{}", std::io::Error::last_os_error());
                assert_eq!(wake.read().unwrap(), 1);
                let (mut connection, _) = listener.accept().unwrap();
                let mut byte = [0u8; 1];
                connection.read_exact(&mut byte).unwrap();
                connection.write_all(&byte).unwrap();
                // The API filter rules here: no files.
                std::fs::File::open("/proc/self/stat").map_err(|e| e.raw_os_error())
            });
            // Never a KVM ioctl.
            // SAFETY: an ioctl on no descriptor, refused by the filter before anything.
            let ioctl = unsafe { libc::ioctl(-1, crate::seccomp::ioctls::KVM_RUN as _, 0) };
            let errno = std::io::Error::last_os_error().raw_os_error();
            (waited, ioctl, errno, api)
        })
        .join()
        .unwrap();
        let (waited, ioctl, errno, api) = takeover;
        assert!(waited, "/proc/PID/stat is readable");
        assert_eq!((ioctl, errno), (-1, Some(libc::EPERM)), "ioctl refused");
        let mut client = UnixStream::connect(&path).unwrap();
        client.write_all(b"x").unwrap();
        let mut echo = [0u8; 1];
        client.read_exact(&mut echo).unwrap();
        assert_eq!(&echo, b"x");
        let open = api.join().unwrap();
        assert_eq!(
            open.err(),
            Some(Some(libc::EPERM)),
            "the API thread opens no file"
        );
    }

    #[test]
    fn a_filtered_thread_is_refused_what_is_not_listed() {
        // Refuse with EPERM instead of trapping, in a thread of its own.
        let outcome = std::thread::spawn(|| {
            let mut rules = rules(ThreadKind::Api).unwrap();
            rules.remove(&libc::SYS_getpid);
            refuse_outside(rules);
            // SAFETY: raw syscalls without arguments or memory effects.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) };
            // SAFETY: as above.
            let pid = unsafe { libc::syscall(libc::SYS_getpid) };
            let errno = std::io::Error::last_os_error().raw_os_error();
            let open = std::fs::File::open("/proc/self/status").map(|_| ());
            (tid, pid, errno, open.map_err(|e| e.raw_os_error()))
        })
        .join()
        .unwrap();
        assert!(outcome.0 > 0, "gettid is allowed");
        assert_eq!((outcome.1, outcome.2), (-1, Some(libc::EPERM)));
        assert_eq!(outcome.3, Err(Some(libc::EPERM)), "openat is refused");
        // The test's own thread is untouched.
        assert!(std::fs::File::open("/proc/self/status").is_ok());
    }
}
