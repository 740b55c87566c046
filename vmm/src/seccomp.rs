//! Seccomp filters, one per thread kind, built with rust-vmm's `seccompiler`.
//!
//! | kind | threads | what it allows |
//! |---|---|---|
//! | `vmm` | the main thread once the vCPUs are spawned (event loop, API actions, snapshot writing, teardown), the threads it spawns later (snapshot scan), and the lazy-restore fault and loader threads | file I/O for snapshots, epoll, timers, KVM VM ioctls, userfaultfd ioctls, VFIO teardown and INTx unmask |
//! | `vcpu` | one per vCPU | `KVM_RUN` and the vCPU state ioctls, device emulation (eventfds, vfio-user messages, VFIO region access and interrupt setup, memory slots and MSI routes when the guest moves BARs or programs MSI) |
//! | `api` | the API accept thread and its connection threads | accept, read, write on the socket, no ioctls at all |
//!
//! Every filter also allows what any Rust thread needs to live and end (memory
//! allocation without `PROT_EXEC`, futexes, signals returns, thread exit, abort). A system
//! call outside the list raises SIGSYS; the handler here writes one line
//! (`gpuvm: seccomp: blocked system call N on a KIND thread`) and ends the process with
//! [`VIOLATION_EXIT_CODE`]. With `GPUVM_SECCOMP_LOG_ONLY=1` the kernel logs violations
//! (SECCOMP_RET_LOG, in the audit log / dmesg) and lets them through, for diagnosis.
//!
//! Nothing is filtered until the binary calls [`enable`]: the library's own tests and other
//! users of the crate run unfiltered.
//!
//! Test hooks (environment, for the integration tests only):
//! - `GPUVM_TEST_SECCOMP_VIOLATION=KIND`: a thread of that kind makes a forbidden system
//!   call (`getppid`) right after installing its filter.
//! - `GPUVM_TEST_SECCOMP_REMOVE=KIND:NR[,KIND:NR...]`: leaves system call NR out of that
//!   kind's filter, to show the filter is applied where it should be.

use std::collections::BTreeMap;
use std::mem::size_of;
use std::sync::{Arc, OnceLock};

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_device_attr, kvm_dirty_log, kvm_irq_routing,
    kvm_irqchip, kvm_irqfd, kvm_lapic_state, kvm_mp_state, kvm_msr_list, kvm_msrs, kvm_pit_state2,
    kvm_regs, kvm_sregs, kvm_userspace_memory_region, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The exit status of a process that made a forbidden system call.
pub const VIOLATION_EXIT_CODE: i32 = 148;

/// The system call the violation test hook makes: in no filter.
pub const VIOLATION_SYSCALL: i64 = libc::SYS_getppid;

/// Which filter a thread runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThreadKind {
    Vmm,
    Vcpu,
    Api,
}

impl ThreadKind {
    pub const ALL: [ThreadKind; 3] = [ThreadKind::Vmm, ThreadKind::Vcpu, ThreadKind::Api];

    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Api => "api",
        }
    }

    fn parse(text: &str) -> Option<ThreadKind> {
        ThreadKind::ALL.into_iter().find(|k| k.name() == text)
    }

    /// Carried in SECCOMP_RET_DATA of the trap, so the SIGSYS handler knows the kind
    /// even on threads that inherited their filter.
    fn code(self) -> u32 {
        self as u32 + 1
    }

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the {kind} seccomp filter: {source}")]
    Build {
        kind: &'static str,
        source: seccompiler::BackendError,
    },
    #[error("cannot install the {kind} thread's seccomp filter: {source} (on a host without seccomp, run with --no-seccomp)")]
    Install {
        kind: &'static str,
        source: seccompiler::Error,
    },
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
    #[error("{var}={value:?} is invalid: {reason}")]
    BadTestHook {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error("seccomp filters were already enabled")]
    AlreadyEnabled,
    #[error("seccomp filters must be enabled before gpuvm starts a thread ({0} threads run)")]
    NotSingleThreaded(usize),
    #[error("cannot limit glibc malloc to one arena (mallopt M_ARENA_MAX)")]
    Allocator,
}

/// What a thread's filter does with a system call outside its list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnViolation {
    /// SIGSYS: the handler reports the call and ends the process.
    Trap,
    /// SECCOMP_RET_LOG: the kernel logs it and lets it through.
    Log,
}

/// How the filters are built: from `GPUVM_SECCOMP_LOG_ONLY` and the test hooks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub on_violation: OnViolation,
    /// System calls left out of a filter (test hook).
    pub removed: Vec<(ThreadKind, i64)>,
    /// A kind whose threads make a forbidden call once filtered (test hook).
    pub violation: Option<ThreadKind>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            on_violation: OnViolation::Trap,
            removed: Vec::new(),
            violation: None,
        }
    }
}

impl Settings {
    /// Reads `GPUVM_SECCOMP_LOG_ONLY`, `GPUVM_TEST_SECCOMP_VIOLATION` and
    /// `GPUVM_TEST_SECCOMP_REMOVE`.
    pub fn from_env() -> Result<Settings, SeccompError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Settings::parse(
            var("GPUVM_SECCOMP_LOG_ONLY").as_deref(),
            var("GPUVM_TEST_SECCOMP_VIOLATION").as_deref(),
            var("GPUVM_TEST_SECCOMP_REMOVE").as_deref(),
        )
    }

    fn parse(
        log_only: Option<&str>,
        violation: Option<&str>,
        remove: Option<&str>,
    ) -> Result<Settings, SeccompError> {
        let bad = |var: &'static str, value: &str, reason: &str| SeccompError::BadTestHook {
            var,
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        let mut settings = Settings::default();
        if let Some(value) = log_only {
            settings.on_violation = match value {
                "1" | "true" | "yes" => OnViolation::Log,
                "0" | "false" | "no" => OnViolation::Trap,
                _ => return Err(bad("GPUVM_SECCOMP_LOG_ONLY", value, "expected 1 or 0")),
            };
        }
        if let Some(value) = violation {
            settings.violation = Some(ThreadKind::parse(value).ok_or_else(|| {
                bad(
                    "GPUVM_TEST_SECCOMP_VIOLATION",
                    value,
                    "expected vmm, vcpu or api",
                )
            })?);
        }
        if let Some(value) = remove {
            for item in value.split(',') {
                let parsed = item.split_once(':').and_then(|(kind, nr)| {
                    Some((ThreadKind::parse(kind)?, nr.trim().parse::<i64>().ok()?))
                });
                let Some((kind, nr)) = parsed else {
                    return Err(bad(
                        "GPUVM_TEST_SECCOMP_REMOVE",
                        value,
                        "expected KIND:SYSCALL_NUMBER with KIND vmm, vcpu or api",
                    ));
                };
                settings.removed.push((kind, nr));
            }
        }
        Ok(settings)
    }
}

/// The compiled filters, once [`enable`] ran.
struct Filters {
    programs: [BpfProgram; 3],
    violation: Option<ThreadKind>,
}

static FILTERS: OnceLock<Filters> = OnceLock::new();

/// Compiles the three filters and installs the SIGSYS handler. Threads then install
/// their filter with [`apply`]; before this call [`apply`] does nothing. Must be called
/// while the process has one thread (see [`prepare_libraries`]).
pub fn enable(settings: &Settings) -> Result<(), SeccompError> {
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        let threads = tasks.count();
        if threads > 1 {
            return Err(SeccompError::NotSingleThreaded(threads));
        }
    }
    prepare_libraries()?;
    // In ThreadKind::index order.
    let programs = [
        compile(ThreadKind::Vmm, settings)?,
        compile(ThreadKind::Vcpu, settings)?,
        compile(ThreadKind::Api, settings)?,
    ];
    if settings.on_violation == OnViolation::Trap {
        install_sigsys_handler()?;
    }
    FILTERS
        .set(Filters {
            programs,
            violation: settings.violation,
        })
        .map_err(|_| SeccompError::AlreadyEnabled)
}

/// Keeps library code from making, lazily and on whatever thread gets there first, a
/// system call that thread's filter refuses (a SIGSYS would end the VM). Runs before any
/// other thread exists. What was checked, for every kind (api, vmm, vcpu):
///
/// - glibc malloc. A thread's first allocation binds it to an arena; once 8 exist, the
///   next one sizes the limit with `__get_nprocs`, which opens
///   /sys/devices/system/cpu/online (how 8 held API connections killed gpuvm: connection
///   threads inherit the api filter before their first allocation). Arenas other than
///   the main one also open /proc/sys/vm/overcommit_memory the first time one of their
///   heaps shrinks (`check_may_shrink_heap`), after any large free. `M_ARENA_MAX` = 1
///   removes both paths: every thread uses the main arena (brk/mmap only; per-thread
///   tcaches keep most small allocations off its lock), and the limit is never computed.
///   It must be set before a second thread allocates, hence the single-thread check.
/// - Thread creation (api and vmm threads start threads): glibc maps the stack and its
///   guard (`mmap`/`mprotect`, no exec), `clone3`, `set_robust_list`, `rseq`; std names
///   the thread with `prctl(PR_SET_NAME)` and, for its stack-overflow handler, reads the
///   new thread's bounds with `pthread_getattr_np` (`sched_getaffinity`; only the main
///   thread's bounds come from /proc/self/maps, read before `main`) and maps an
///   alternate signal stack (`sigaltstack`). All in the common list.
/// - Randomness: std's hash keys and glibc's tcache key use `getrandom` (allowed), so
///   their /dev/urandom fallbacks never run.
/// - Locale and messages: gpuvm never calls `setlocale`, so `strerror` (io::Error
///   display) stays in the C locale and opens no message catalog.
/// - Time: clocks come from the vDSO or `clock_gettime`; logs are stamped in UTC
///   (`humantime`), so no time zone file is read.
/// - Names and DNS: filtered threads use Unix sockets and numeric ids only; NSS is never
///   reached.
/// - CPU counts: `available_parallelism` (cgroup files) runs only while building the VM,
///   on the main thread before its filter.
/// - `RUST_BACKTRACE` set: a panic's backtrace opens the executable; the panic message is
///   printed before that, and the process is ending anyway (`panic = "abort"`).
pub fn prepare_libraries() -> Result<(), SeccompError> {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a malloc parameter; M_ARENA_MAX takes a positive count.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) } != 1 {
        return Err(SeccompError::Allocator);
    }
    Ok(())
}

/// Whether [`enable`] ran.
pub fn enabled() -> bool {
    FILTERS.get().is_some()
}

/// Installs `kind`'s filter on the calling thread (and the threads it creates later).
/// Does nothing unless [`enable`] ran.
pub fn apply(kind: ThreadKind) -> Result<(), SeccompError> {
    let Some(filters) = FILTERS.get() else {
        return Ok(());
    };
    seccompiler::apply_filter(&filters.programs[kind.index()]).map_err(|source| {
        SeccompError::Install {
            kind: kind.name(),
            source,
        }
    })?;
    log::debug!("seccomp: {} filter installed", kind.name());
    if filters.violation == Some(kind) {
        log::warn!(
            "seccomp test hook: a {} thread makes a forbidden system call",
            kind.name()
        );
        // SAFETY: getppid takes no arguments and touches no memory.
        unsafe { libc::syscall(VIOLATION_SYSCALL) };
    }
    Ok(())
}

/// A hook for threads other crates spawn (the memory crate's lazy-restore threads):
/// installs `kind`'s filter on the thread that calls it. None while filters are off.
pub fn thread_hook(kind: ThreadKind) -> Option<Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>> {
    if !enabled() {
        return None;
    }
    Some(Arc::new(move || {
        apply(kind).map_err(|e| std::io::Error::other(e.to_string()))
    }))
}

/// `kind`'s filter as BPF, with `settings` applied.
pub fn compile(kind: ThreadKind, settings: &Settings) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build {
        kind: kind.name(),
        source,
    };
    let mut rules = rules(kind).map_err(build)?;
    for (removed_kind, nr) in &settings.removed {
        if *removed_kind == kind {
            rules.remove(nr);
        }
    }
    let (mismatch, marker) = match settings.on_violation {
        OnViolation::Trap => (SeccompAction::Trap, Some(libc::SECCOMP_RET_TRAP)),
        OnViolation::Log => (SeccompAction::Log, None),
    };
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(build)?;
    let mut program: BpfProgram = filter.try_into().map_err(build)?;
    if let Some(trap) = marker {
        // Tag every trap with the kind (SECCOMP_RET_DATA reaches the handler as si_errno).
        const BPF_RET_K: u16 = 0x06;
        for insn in program.iter_mut() {
            if insn.code == BPF_RET_K && insn.k == trap {
                insn.k = trap | kind.code();
            }
        }
    }
    Ok(program)
}

// ---------------------------------------------------------------------------------------
// The lists.

type Rules = BTreeMap<i64, Vec<SeccompRule>>;
type BuildResult<T> = Result<T, seccompiler::BackendError>;

/// `_IOC(dir, type, nr, size)` as the kernel encodes ioctl request numbers.
const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (ty << 8) | nr
}
const IOC_NONE: u32 = 0;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;
const fn io(ty: u32, nr: u32) -> u32 {
    ioc(IOC_NONE, ty, nr, 0)
}
const fn ior(ty: u32, nr: u32, size: usize) -> u32 {
    ioc(IOC_READ, ty, nr, size)
}
const fn iow(ty: u32, nr: u32, size: usize) -> u32 {
    ioc(IOC_WRITE, ty, nr, size)
}
const fn iowr(ty: u32, nr: u32, size: usize) -> u32 {
    ioc(IOC_READ | IOC_WRITE, ty, nr, size)
}

/// ioctl request numbers the filters name (as kvm-ioctls, vfio-ioctls and userfaultfd
/// define them).
pub mod ioctls {
    use super::*;

    const KVMIO: u32 = 0xAE;
    // System (/dev/kvm) and VM.
    pub const KVM_CHECK_EXTENSION: u32 = io(KVMIO, 0x03);
    pub const KVM_GET_MSR_INDEX_LIST: u32 = iowr(KVMIO, 0x02, size_of::<kvm_msr_list>());
    pub const KVM_GET_DIRTY_LOG: u32 = iow(KVMIO, 0x42, size_of::<kvm_dirty_log>());
    pub const KVM_SET_USER_MEMORY_REGION: u32 =
        iow(KVMIO, 0x46, size_of::<kvm_userspace_memory_region>());
    pub const KVM_GET_IRQCHIP: u32 = iowr(KVMIO, 0x62, size_of::<kvm_irqchip>());
    pub const KVM_SET_GSI_ROUTING: u32 = iow(KVMIO, 0x6a, size_of::<kvm_irq_routing>());
    pub const KVM_IRQFD: u32 = iow(KVMIO, 0x76, size_of::<kvm_irqfd>());
    pub const KVM_GET_CLOCK: u32 = ior(KVMIO, 0x7c, size_of::<kvm_clock_data>());
    pub const KVM_GET_PIT2: u32 = ior(KVMIO, 0x9f, size_of::<kvm_pit_state2>());
    pub const KVM_SET_DEVICE_ATTR: u32 = iow(KVMIO, 0xe1, size_of::<kvm_device_attr>());
    pub const KVM_HAS_DEVICE_ATTR: u32 = iow(KVMIO, 0xe3, size_of::<kvm_device_attr>());
    // vCPU.
    pub const KVM_RUN: u32 = io(KVMIO, 0x80);
    pub const KVM_GET_REGS: u32 = ior(KVMIO, 0x81, size_of::<kvm_regs>());
    pub const KVM_SET_REGS: u32 = iow(KVMIO, 0x82, size_of::<kvm_regs>());
    pub const KVM_GET_SREGS: u32 = ior(KVMIO, 0x83, size_of::<kvm_sregs>());
    pub const KVM_GET_MSRS: u32 = iowr(KVMIO, 0x88, size_of::<kvm_msrs>());
    pub const KVM_GET_LAPIC: u32 = ior(KVMIO, 0x8e, size_of::<kvm_lapic_state>());
    pub const KVM_GET_CPUID2: u32 = iowr(KVMIO, 0x91, size_of::<kvm_cpuid2>());
    pub const KVM_GET_MP_STATE: u32 = ior(KVMIO, 0x98, size_of::<kvm_mp_state>());
    pub const KVM_GET_VCPU_EVENTS: u32 = ior(KVMIO, 0x9f, size_of::<kvm_vcpu_events>());
    pub const KVM_SET_VCPU_EVENTS: u32 = iow(KVMIO, 0xa0, size_of::<kvm_vcpu_events>());
    pub const KVM_GET_DEBUGREGS: u32 = ior(KVMIO, 0xa1, size_of::<kvm_debugregs>());
    pub const KVM_GET_TSC_KHZ: u32 = io(KVMIO, 0xa3);
    pub const KVM_GET_XSAVE: u32 = ior(KVMIO, 0xa4, size_of::<kvm_xsave>());
    pub const KVM_GET_XCRS: u32 = ior(KVMIO, 0xa6, size_of::<kvm_xcrs>());

    // VFIO (`_IO(';', 100 + n)`) and iommufd (`_IO(';', 0x80 + n)`).
    const VFIO: u32 = b';' as u32;
    pub const VFIO_GROUP_UNSET_CONTAINER: u32 = io(VFIO, 100 + 5);
    pub const VFIO_DEVICE_GET_REGION_INFO: u32 = io(VFIO, 100 + 8);
    pub const VFIO_DEVICE_GET_IRQ_INFO: u32 = io(VFIO, 100 + 9);
    pub const VFIO_DEVICE_SET_IRQS: u32 = io(VFIO, 100 + 10);
    pub const VFIO_DEVICE_RESET: u32 = io(VFIO, 100 + 11);
    pub const VFIO_IOMMU_UNMAP_DMA: u32 = io(VFIO, 100 + 14);
    pub const VFIO_DEVICE_DETACH_IOMMUFD_PT: u32 = io(VFIO, 100 + 20);
    pub const IOMMU_DESTROY: u32 = io(VFIO, 0x80);
    pub const IOMMU_IOAS_UNMAP: u32 = io(VFIO, 0x86);

    // userfaultfd.
    const UFFDIO: u32 = 0xAA;
    /// struct uffdio_range: start, len.
    const UFFDIO_RANGE: usize = 16;
    pub const UFFDIO_UNREGISTER: u32 = ior(UFFDIO, 0x01, UFFDIO_RANGE);
    pub const UFFDIO_WAKE: u32 = ior(UFFDIO, 0x02, UFFDIO_RANGE);
    /// struct uffdio_copy: dst, src, len, mode, copy.
    pub const UFFDIO_COPY: u32 = iowr(UFFDIO, 0x03, 40);
    /// struct uffdio_zeropage: range, mode, zeropage.
    pub const UFFDIO_ZEROPAGE: u32 = iowr(UFFDIO, 0x04, 32);

    // Terminals (stdin in raw mode while the guest runs, restored at the end).
    pub const TCGETS: u32 = 0x5401;
    pub const TCSETS: u32 = 0x5402;
    pub const TCSETSW: u32 = 0x5403;
    pub const TIOCGWINSZ: u32 = 0x5413;
    pub const FIONBIO: u32 = 0x5421;
    pub const FIOCLEX: u32 = 0x5451;
}

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
                ],
            );
            ioctl(
                &mut rules,
                &[
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
                    // Kernel VFIO teardown: the group or cdev leaves the KVM VFIO device.
                    KVM_SET_DEVICE_ATTR,
                    KVM_HAS_DEVICE_ATTR,
                    // Lazy restore.
                    UFFDIO_COPY,
                    UFFDIO_ZEROPAGE,
                    UFFDIO_WAKE,
                    UFFDIO_UNREGISTER,
                    // Kernel VFIO: INTx unmask, reset and unmapping at teardown.
                    VFIO_DEVICE_SET_IRQS,
                    VFIO_DEVICE_RESET,
                    VFIO_DEVICE_GET_REGION_INFO,
                    VFIO_DEVICE_GET_IRQ_INFO,
                    VFIO_GROUP_UNSET_CONTAINER,
                    VFIO_IOMMU_UNMAP_DMA,
                    VFIO_DEVICE_DETACH_IOMMUFD_PT,
                    IOMMU_DESTROY,
                    IOMMU_IOAS_UNMAP,
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
                ],
            )?;
        }
        ThreadKind::Api => {
            threads(&mut rules)?;
            setid(&mut rules);
            allow_all(
                &mut rules,
                &[
                    libc::SYS_accept4,
                    libc::SYS_read,
                    libc::SYS_recvfrom,
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

// ---------------------------------------------------------------------------------------
// The SIGSYS handler.

/// `siginfo_t` as the kernel fills it for SIGSYS (`_sigsys` member of the union).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

/// Appends `value` in decimal or hex to `buf` at `*len`, without allocating.
fn push_number(buf: &mut [u8], len: &mut usize, mut value: u64, hex: bool) {
    let base = if hex { 16 } else { 10 };
    let mut digits = [0u8; 20];
    let mut count = 0;
    loop {
        let digit = (value % base) as u8;
        digits[count] = if digit < 10 {
            b'0' + digit
        } else {
            b'a' + digit - 10
        };
        count += 1;
        value /= base;
        if value == 0 {
            break;
        }
    }
    if hex {
        push(buf, len, b"0x");
    }
    for digit in digits[..count].iter().rev() {
        push(buf, len, &[*digit]);
    }
}

fn push(buf: &mut [u8], len: &mut usize, bytes: &[u8]) {
    let room = buf.len() - *len;
    let n = bytes.len().min(room);
    buf[*len..*len + n].copy_from_slice(&bytes[..n]);
    *len += n;
}

/// The report line for a blocked call (no allocation: used in the signal handler).
fn format_violation(buf: &mut [u8; 160], syscall: u64, kind: u32, ioctl: Option<u64>) -> usize {
    let mut len = 0;
    push(buf, &mut len, b"gpuvm: seccomp: blocked system call ");
    push_number(buf, &mut len, syscall, false);
    let kind_name: &[u8] = match kind {
        1 => b"vmm",
        2 => b"vcpu",
        3 => b"api",
        _ => b"unknown",
    };
    push(buf, &mut len, b" on a ");
    push(buf, &mut len, kind_name);
    push(buf, &mut len, b" thread");
    if let Some(request) = ioctl {
        push(buf, &mut len, b" (ioctl request ");
        push_number(buf, &mut len, request & 0xffff_ffff, true);
        push(buf, &mut len, b")");
    }
    push(buf, &mut len, b"\n");
    len
}

extern "C" fn sigsys_handler(
    _: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    if info.is_null() {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(VIOLATION_EXIT_CODE) };
    }
    // SAFETY: the kernel passes a valid siginfo for SIGSYS, laid out as `SigsysInfo`.
    let info = unsafe { &*(info as *const SigsysInfo) };
    let syscall = info.syscall as u64;
    let kind = (info.errno as u32) & libc::SECCOMP_RET_DATA;
    let ioctl = if info.syscall as i64 == libc::SYS_ioctl && !context.is_null() {
        // SAFETY: with SA_SIGINFO the third argument is this thread's ucontext_t; the
        // second system call argument is in RSI.
        let context = unsafe { &*(context as *const libc::ucontext_t) };
        Some(context.uc_mcontext.gregs[libc::REG_RSI as usize] as u64)
    } else {
        None
    };
    let mut buf = [0u8; 160];
    let len = format_violation(&mut buf, syscall, kind, ioctl);
    // SAFETY: write(2) and _exit(2) are async-signal-safe; `buf` lives across the call.
    unsafe {
        libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), len);
        libc::_exit(VIOLATION_EXIT_CODE);
    }
}

fn install_sigsys_handler() -> Result<(), SeccompError> {
    // SAFETY: a zeroed sigaction is valid; the fields are set below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = sigsys_handler as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: sa_mask is a valid sigset_t owned by `action`.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    if unsafe { libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) } != 0 {
        return Err(SeccompError::Handler(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(kind: ThreadKind) -> Vec<i64> {
        rules(kind).unwrap().keys().copied().collect()
    }

    #[test]
    fn every_filter_compiles() {
        for kind in ThreadKind::ALL {
            let program = compile(kind, &Settings::default()).unwrap();
            assert!(!program.is_empty());
            // Every trap carries the kind.
            assert!(program
                .iter()
                .filter(|i| i.code == 0x06
                    && i.k & libc::SECCOMP_RET_ACTION_FULL == libc::SECCOMP_RET_TRAP)
                .all(|i| i.k & libc::SECCOMP_RET_DATA == kind.code()));
        }
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

    #[test]
    fn ioctl_numbers_match_the_kernel() {
        assert_eq!(ioctls::KVM_RUN, 0xae80);
        assert_eq!(ioctls::KVM_GET_REGS, 0x8090_ae81);
        assert_eq!(ioctls::KVM_SET_USER_MEMORY_REGION, 0x4020_ae46);
        assert_eq!(ioctls::KVM_IRQFD, 0x4020_ae76);
        assert_eq!(ioctls::KVM_GET_DIRTY_LOG, 0x4010_ae42);
        assert_eq!(ioctls::UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(ioctls::UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(ioctls::VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(ioctls::IOMMU_IOAS_UNMAP, 0x3b86);
    }

    #[test]
    fn settings_parse_the_hooks() {
        let s = Settings::parse(Some("1"), Some("vcpu"), Some("vcpu:16,api:288")).unwrap();
        assert_eq!(s.on_violation, OnViolation::Log);
        assert_eq!(s.violation, Some(ThreadKind::Vcpu));
        assert_eq!(
            s.removed,
            vec![(ThreadKind::Vcpu, 16), (ThreadKind::Api, 288)]
        );
        assert!(Settings::parse(None, Some("gpu"), None).is_err());
        assert!(Settings::parse(None, None, Some("vcpu")).is_err());
        assert!(Settings::parse(None, None, Some("vcpu:x")).is_err());
        assert!(Settings::parse(Some("maybe"), None, None).is_err());
        let removed = compile(ThreadKind::Vcpu, &s).unwrap();
        let full = compile(ThreadKind::Vcpu, &Settings::default()).unwrap();
        assert!(removed.len() < full.len());
    }

    #[test]
    fn violation_line() {
        let mut buf = [0u8; 160];
        let len = format_violation(&mut buf, 16, 2, Some(0xae80));
        assert_eq!(
            std::str::from_utf8(&buf[..len]).unwrap(),
            "gpuvm: seccomp: blocked system call 16 on a vcpu thread (ioctl request 0xae80)\n"
        );
        let len = format_violation(&mut buf, 110, 1, None);
        assert_eq!(
            std::str::from_utf8(&buf[..len]).unwrap(),
            "gpuvm: seccomp: blocked system call 110 on a vmm thread\n"
        );
    }

    #[test]
    fn the_vmm_filter_allows_threads_but_not_fork() {
        let outcome = std::thread::spawn(|| {
            let filter = SeccompFilter::new(
                rules(ThreadKind::Vmm).unwrap(),
                SeccompAction::Errno(libc::EPERM as u32),
                SeccompAction::Allow,
                TargetArch::x86_64,
            )
            .unwrap();
            let program: BpfProgram = filter.try_into().unwrap();
            seccompiler::apply_filter(&program).unwrap();
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
        })
        .join()
        .unwrap();
        assert_eq!(outcome.0, 7, "threads can be spawned");
        assert_eq!(
            (outcome.1, outcome.2),
            (-1, Some(libc::EPERM)),
            "fork refused"
        );
        assert_eq!(outcome.3, -1, "clone without CLONE_THREAD refused");
    }

    #[test]
    fn a_filtered_thread_is_refused_what_is_not_listed() {
        // Refuse with EPERM instead of trapping, in a thread of its own.
        let outcome = std::thread::spawn(|| {
            let mut rules = rules(ThreadKind::Api).unwrap();
            rules.remove(&libc::SYS_getpid);
            let filter = SeccompFilter::new(
                rules,
                SeccompAction::Errno(libc::EPERM as u32),
                SeccompAction::Allow,
                TargetArch::x86_64,
            )
            .unwrap();
            let program: BpfProgram = filter.try_into().unwrap();
            seccompiler::apply_filter(&program).unwrap();
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
