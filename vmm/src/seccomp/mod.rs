//! Seccomp filters, one per thread kind, built with rust-vmm's `seccompiler`.
//!
//! | kind | threads | what it allows |
//! |---|---|---|
//! | `vmm` | the main thread once the vCPUs are spawned (event loop, API actions, snapshot writing, teardown), the threads it spawns later (snapshot scan), the lazy-restore fault and loader threads, the `dma-map` thread (guest RAM DMA-mapped in the background) and the `p2p-map` thread (peer BARs mapped for passthrough devices, started with the first one) | file I/O for snapshots, epoll, timers, KVM VM ioctls, userfaultfd ioctls, VFIO DMA mapping, teardown and INTx unmask |
//! | `vcpu` | one per vCPU | `KVM_RUN` and the vCPU state ioctls, device emulation (eventfds, vfio-user messages, VFIO region access and interrupt setup, memory slots and MSI routes when the guest moves BARs or programs MSI) |
//! | `api` | the API accept thread and its connection threads; stacked on `api-takeover`'s (the API list plus reading /proc, binding the API socket and installing a filter) in a new gpuvm after a live update, whose `api-takeover` thread waits for the old gpuvm to exit and starts the API server | accept, read, write on the socket, no ioctls at all |
//! | `snapshot-fault` | the `snapshot-wp` thread of a background snapshot (started by the main thread, which allows it to stack this filter on its own) | reading userfaultfd write faults, `UFFDIO_WRITEPROTECT` |
//! | `device` | the virtio devices' I/O threads: one per device the VM is built with, made with it; any other (hot-plug, a device started again) made on demand by the factory below | epoll, file I/O on disk images (read, write, flush, discard, io_uring), tap reads and writes, Unix sockets of vsock, timers; no KVM ioctls |
//!
//! The device-thread factory (`virtio-factory`, virtio/src/worker.rs) is made with the VM,
//! before the main thread's filter, and installs [`apply_factory`]'s filter: the device
//! list plus `clone` for threads only and what a new thread needs to install its own
//! filter ([`rules::factory_rules`]). Filters are inherited and stack (the strictest
//! answer of all wins), so each thread it makes, once it has stacked the device filter
//! on the inherited one, can do exactly what the device filter allows.
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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use seccompiler::{sock_filter, BpfProgram, SeccompAction, SeccompFilter, TargetArch};

mod handler;
pub mod ioctls;
mod rules;
use handler::install_sigsys_handler;
pub use rules::rules;

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
    Device,
    SnapshotFault,
}

impl ThreadKind {
    pub const ALL: [ThreadKind; 5] = [
        ThreadKind::Vmm,
        ThreadKind::Vcpu,
        ThreadKind::Api,
        ThreadKind::Device,
        ThreadKind::SnapshotFault,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Api => "api",
            ThreadKind::Device => "device",
            ThreadKind::SnapshotFault => "snapshot-fault",
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
    #[error("cannot start the thread that compiles the seccomp filters: {0}")]
    CompileThread(std::io::Error),
    #[error("the seccomp filters did not compile (the first thread that needed one said why)")]
    NotCompiled,
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
                    "expected vmm, vcpu, api, device or snapshot-fault",
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
                        "expected KIND:SYSCALL_NUMBER with KIND vmm, vcpu, api, device or snapshot-fault",
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
    programs: [BpfProgram; 5],
    /// The device-thread factory's ([`compile_factory`]).
    factory: BpfProgram,
    /// The `api-takeover` thread's ([`apply_api_takeover`]).
    api_takeover: BpfProgram,
    violation: Option<ThreadKind>,
}

static FILTERS: OnceLock<Filters> = OnceLock::new();
/// Set by [`enable`]: from then on every thread installs its filter.
static ENABLED: AtomicBool = AtomicBool::new(false);
/// The thread compiling the filters, until the first thread that needs one takes its work.
static COMPILING: Mutex<Option<JoinHandle<Result<Filters, SeccompError>>>> = Mutex::new(None);

/// Installs the SIGSYS handler and starts compiling the filters; threads then install
/// theirs with [`apply`] (before this call [`apply`] does nothing). The filters compile on
/// a short-lived thread of their own while the caller goes on building the VM (about 0.3 ms
/// of a boot's critical path otherwise); the first thread to install one waits for them,
/// and every filtered thread of the VM starts after that (the vCPU, VMM, API and device
/// threads install theirs first thing), so nothing runs the guest beside an unfiltered
/// thread. Must be called while the process has one thread (see [`prepare_libraries`]).
pub fn enable(settings: &Settings) -> Result<(), SeccompError> {
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        let threads = tasks.count();
        if threads > 1 {
            return Err(SeccompError::NotSingleThreaded(threads));
        }
    }
    if ENABLED.load(Ordering::Acquire) {
        return Err(SeccompError::AlreadyEnabled);
    }
    prepare_libraries()?;
    if settings.on_violation == OnViolation::Trap {
        install_sigsys_handler()?;
    }
    let settings = settings.clone();
    let compiling = std::thread::Builder::new()
        .name("seccomp-compile".into())
        .spawn(move || compile_all(&settings))
        .map_err(SeccompError::CompileThread)?;
    *lock_compiling() = Some(compiling);
    ENABLED.store(true, Ordering::Release);
    Ok(())
}

/// Every filter, with `settings` applied.
fn compile_all(settings: &Settings) -> Result<Filters, SeccompError> {
    // In ThreadKind::index order.
    let programs = [
        compile(ThreadKind::Vmm, settings)?,
        compile(ThreadKind::Vcpu, settings)?,
        compile(ThreadKind::Api, settings)?,
        compile(ThreadKind::Device, settings)?,
        compile(ThreadKind::SnapshotFault, settings)?,
    ];
    Ok(Filters {
        programs,
        factory: compile_factory(settings)?,
        api_takeover: compile_api_takeover(settings)?,
        violation: settings.violation,
    })
}

fn lock_compiling(
) -> std::sync::MutexGuard<'static, Option<JoinHandle<Result<Filters, SeccompError>>>> {
    COMPILING.lock().unwrap_or_else(|e| e.into_inner())
}

/// The compiled filters (waiting for [`enable`]'s compiling thread the first time); None
/// unless [`enable`] ran.
fn filters() -> Result<Option<&'static Filters>, SeccompError> {
    if let Some(filters) = FILTERS.get() {
        return Ok(Some(filters));
    }
    if !ENABLED.load(Ordering::Acquire) {
        return Ok(None);
    }
    let mut compiling = lock_compiling();
    // Another thread may have taken them while this one waited for the lock.
    if let Some(filters) = FILTERS.get() {
        return Ok(Some(filters));
    }
    let thread = compiling.take().ok_or(SeccompError::NotCompiled)?;
    let compiled = thread.join().map_err(|_| SeccompError::NotCompiled)??;
    Ok(Some(FILTERS.get_or_init(|| compiled)))
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
    ENABLED.load(Ordering::Acquire)
}

/// Installs `kind`'s filter on the calling thread (and the threads it creates later).
/// Does nothing unless [`enable`] ran.
pub fn apply(kind: ThreadKind) -> Result<(), SeccompError> {
    let Some(filters) = filters()? else {
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

/// Installs the device-thread factory's filter ([`compile_factory`]) on the calling thread,
/// which then makes the device threads: each stacks the device filter ([`apply`]) on the
/// one it inherits. Does nothing unless [`enable`] ran.
pub fn apply_factory() -> Result<(), SeccompError> {
    let Some(filters) = filters()? else {
        return Ok(());
    };
    seccompiler::apply_filter(&filters.factory).map_err(|source| SeccompError::Install {
        kind: "device-thread factory",
        source,
    })?;
    log::debug!("seccomp: device-thread factory filter installed");
    Ok(())
}

/// Installs the `api-takeover` thread's filter on the calling thread: a new gpuvm after a
/// live update waits there for the old one to exit, then starts the API server, whose
/// thread stacks the API filter on this one ([`rules::api_takeover_rules`]). Does nothing
/// unless [`enable`] ran.
pub fn apply_api_takeover() -> Result<(), SeccompError> {
    let Some(filters) = filters()? else {
        return Ok(());
    };
    seccompiler::apply_filter(&filters.api_takeover).map_err(|source| SeccompError::Install {
        kind: "api-takeover",
        source,
    })?;
    log::debug!("seccomp: api-takeover filter installed");
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
    let rules = kind_rules(kind, settings)?;
    compile_rules(kind, rules, settings)
}

/// `kind`'s list with the system calls `settings` leaves out of it removed.
fn kind_rules(kind: ThreadKind, settings: &Settings) -> Result<rules::Rules, SeccompError> {
    let mut rules = rules(kind).map_err(|source| SeccompError::Build {
        kind: kind.name(),
        source,
    })?;
    for (removed_kind, nr) in &settings.removed {
        if *removed_kind == kind {
            rules.remove(nr);
        }
    }
    Ok(rules)
}

/// The device-thread factory's filter: the device list (with `settings`' removals) plus
/// what making a filtered thread takes ([`rules::factory_rules`]); its traps report a
/// device thread. Ahead of the list, `clone3` is answered ENOSYS: its flags live in memory
/// a filter cannot read, and glibc then makes the thread with `clone`, whose flags the list
/// checks (threads only, no fork).
pub fn compile_factory(settings: &Settings) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build {
        kind: "device-thread factory",
        source,
    };
    let rules = rules::factory_rules(kind_rules(ThreadKind::Device, settings)?).map_err(build)?;
    let program = compile_rules(ThreadKind::Device, rules, settings)?;
    Ok(clone3_enosys(program))
}

/// The `api-takeover` thread's filter: the API list (with `settings`' removals) plus what
/// binding the API socket and starting the API thread take ([`rules::api_takeover_rules`]);
/// its traps report an api thread.
fn compile_api_takeover(settings: &Settings) -> Result<BpfProgram, SeccompError> {
    let rules =
        rules::api_takeover_rules(kind_rules(ThreadKind::Api, settings)?).map_err(|source| {
            SeccompError::Build {
                kind: "api-takeover",
                source,
            }
        })?;
    compile_rules(ThreadKind::Api, rules, settings)
}

/// `program` behind a check that answers x86_64's `clone3` with ENOSYS (and lets every
/// other call through to `program`, which also checks the architecture).
fn clone3_enosys(program: BpfProgram) -> BpfProgram {
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JEQ_K: u16 = 0x15;
    const BPF_RET_K: u16 = 0x06;
    // seccomp_data: nr at 0, arch at 4.
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
    let insn = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    let mut prefix = vec![
        insn(BPF_LD_W_ABS, 0, 0, ARCH),
        // Another architecture: on to `program` (3 ahead), which refuses it.
        insn(BPF_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        insn(BPF_LD_W_ABS, 0, 0, NR),
        insn(BPF_JEQ_K, 0, 1, libc::SYS_clone3 as u32),
        insn(
            BPF_RET_K,
            0,
            0,
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        ),
    ];
    prefix.extend(program);
    prefix
}

/// `rules` as BPF, whose traps report `kind`.
fn compile_rules(
    kind: ThreadKind,
    rules: rules::Rules,
    settings: &Settings,
) -> Result<BpfProgram, SeccompError> {
    let build = |source| SeccompError::Build {
        kind: kind.name(),
        source,
    };
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// `rules` with what they refuse failing with EPERM instead of trapping.
    fn refusing(rules: rules::Rules) -> BpfProgram {
        SeccompFilter::new(
            rules,
            SeccompAction::Errno(libc::EPERM as u32),
            SeccompAction::Allow,
            TargetArch::x86_64,
        )
        .unwrap()
        .try_into()
        .unwrap()
    }

    fn errno() -> Option<i32> {
        std::io::Error::last_os_error().raw_os_error()
    }

    /// What a thread made by a factory-filtered thread could do once it stacked the device
    /// filter, and its id.
    #[derive(Debug)]
    struct Made {
        tid: i64,
        spawn: Result<(), Option<i32>>,
        no_new_privs: (i32, Option<i32>),
        epoll: bool,
        open: Result<(), Option<i32>>,
    }

    #[test]
    fn the_factory_makes_threads_that_end_with_the_device_filters_rights() {
        let factory = clone3_enosys(refusing(
            rules::factory_rules(rules(ThreadKind::Device).unwrap()).unwrap(),
        ));
        let device = refusing(rules(ThreadKind::Device).unwrap());
        let (report, reports) = std::sync::mpsc::channel::<Made>();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let factory_thread = std::thread::spawn(move || {
            seccompiler::apply_filter(&factory).unwrap();
            // SAFETY: clone3 with no arguments: answered by the filter before the kernel.
            let clone3 = unsafe { libc::syscall(libc::SYS_clone3, 0, 0) };
            let clone3 = (clone3, errno());
            // SAFETY: a raw clone without CLONE_THREAD, refused before it does anything.
            let fork = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD as u64, 0, 0, 0, 0) };
            if fork == 0 {
                // SAFETY: _exit in a child that must not exist.
                unsafe { libc::_exit(0) };
            }
            let fork = (fork, errno());
            let open = std::fs::File::open("/proc/self/status").map(|_| ());
            // A thread (glibc falls back from clone3 to clone), which narrows its filter.
            let made = std::thread::Builder::new().spawn(move || {
                seccompiler::apply_filter(&device).unwrap();
                let spawn = std::thread::Builder::new()
                    .spawn(|| ())
                    .map(|_| ())
                    .map_err(|e| e.raw_os_error());
                // SAFETY: sets no_new_privs, which is set already; refused here.
                let no_new_privs = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
                let no_new_privs = (no_new_privs, errno());
                // SAFETY: epoll_create1 with a flag; the descriptor is closed at once.
                let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
                if epoll >= 0 {
                    // SAFETY: closes the descriptor just made.
                    unsafe { libc::close(epoll) };
                }
                let open = std::fs::File::open("/proc/self/status")
                    .map(|_| ())
                    .map_err(|e| e.raw_os_error());
                report
                    .send(Made {
                        // SAFETY: gettid takes no arguments.
                        tid: unsafe { libc::syscall(libc::SYS_gettid) },
                        spawn,
                        no_new_privs,
                        epoll: epoll >= 0,
                        open,
                    })
                    .unwrap();
                wait.recv().unwrap();
            });
            (
                clone3,
                fork,
                open.map_err(|e| e.raw_os_error()),
                made.is_ok(),
            )
        });
        let made = reports.recv().unwrap();
        let status =
            std::fs::read_to_string(format!("/proc/self/task/{}/status", made.tid)).unwrap();
        done.send(()).unwrap();
        let (clone3, fork, open, spawned) = factory_thread.join().unwrap();
        assert_eq!(clone3, (-1, Some(libc::ENOSYS)), "clone3 answered ENOSYS");
        assert_eq!(fork, (-1, Some(libc::EPERM)), "no fork from the factory");
        assert_eq!(open, Err(Some(libc::EPERM)), "no files for the factory");
        assert!(spawned, "the factory makes threads");
        assert_eq!(made.spawn, Err(Some(libc::EPERM)), "{made:?}");
        assert_eq!(made.no_new_privs, (-1, Some(libc::EPERM)), "{made:?}");
        assert!(made.epoll, "{made:?}");
        assert_eq!(made.open, Err(Some(libc::EPERM)), "{made:?}");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .map(|v| v.trim().to_string())
        };
        assert_eq!(field("Seccomp:").as_deref(), Some("2"), "{status}");
        assert_eq!(
            field("Seccomp_filters:").as_deref(),
            Some("2"),
            "the factory's and the device filter, stacked: {status}"
        );
    }

    #[test]
    fn the_factory_filter_holds_the_device_filter_and_little_more() {
        let device = rules(ThreadKind::Device).unwrap();
        let factory = rules::factory_rules(device.clone()).unwrap();
        assert!(device.keys().all(|nr| factory.contains_key(nr)));
        let mut added: Vec<i64> = factory
            .keys()
            .filter(|nr| !device.contains_key(nr))
            .copied()
            .collect();
        added.sort_unstable();
        assert_eq!(added, [libc::SYS_clone, libc::SYS_seccomp]);
        assert!(!factory.contains_key(&libc::SYS_clone3));
        let program = compile_factory(&Settings::default()).unwrap();
        assert!(
            program.len()
                > compile(ThreadKind::Device, &Settings::default())
                    .unwrap()
                    .len()
        );
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
}
