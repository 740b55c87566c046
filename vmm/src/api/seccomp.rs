//! A seccomp filter for the API threads (`gpuvm run --seccomp`): the accept thread
//! installs it on itself before serving, and the connection threads it spawns inherit it.
//! The list is what those threads were seen to call (strace over every route, bad
//! requests and timeouts), plus what a thread may need to start, log, abort, or follow
//! glibc's set*id broadcast when `--uid/--gid` drops privileges later.

/// AUDIT_ARCH_X86_64 (EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE).
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

/// What the API threads may call.
pub const API_SYSCALLS: &[libc::c_long] = &[
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_setsockopt,
    libc::SYS_fcntl,
    libc::SYS_shutdown,
    libc::SYS_futex,
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_restart_syscall,
    libc::SYS_getrandom,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_setgroups,
    libc::SYS_setresgid,
    libc::SYS_setresuid,
    libc::SYS_setgid,
    libc::SYS_setuid,
];

fn statement(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump_if_equal(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

/// The BPF program: allow `allowed` on x86_64, answer everything else with `otherwise`.
pub fn program(allowed: &[libc::c_long], otherwise: u32) -> Vec<libc::sock_filter> {
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let ret = libc::BPF_RET | libc::BPF_K;
    let mut program = vec![
        statement(load, DATA_ARCH),
        jump_if_equal(AUDIT_ARCH_X86_64, 1, 0),
        statement(ret, libc::SECCOMP_RET_KILL_PROCESS),
        statement(load, DATA_NR),
    ];
    for nr in allowed {
        program.push(jump_if_equal(*nr as u32, 0, 1));
        program.push(statement(ret, libc::SECCOMP_RET_ALLOW));
    }
    program.push(statement(ret, otherwise));
    program
}

/// Installs `program` on the calling thread (and threads it creates later).
pub fn apply(program: &[libc::sock_filter]) -> std::io::Result<()> {
    let fprog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with integer arguments; no_new_privs only ever restricts this thread.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fprog` points at `program`, which outlives the call; the kernel copies it.
    let result = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &fprog as *const libc::sock_fprog,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The API threads' filter: anything else kills the process.
pub fn apply_api_filter() -> std::io::Result<()> {
    apply(&program(API_SYSCALLS, libc::SECCOMP_RET_KILL_PROCESS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_allows_the_list_and_refuses_the_rest() {
        assert!(!API_SYSCALLS.contains(&libc::SYS_getppid));
        assert!(!API_SYSCALLS.contains(&libc::SYS_openat));
        // In a thread of its own, refusing with EPERM instead of killing the test.
        let outcome = std::thread::spawn(|| {
            apply(&program(
                API_SYSCALLS,
                libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
            ))
            .expect("install the filter");
            // SAFETY: raw syscalls without arguments or memory effects.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) };
            // SAFETY: as above.
            let ppid = unsafe { libc::syscall(libc::SYS_getppid) };
            let errno = std::io::Error::last_os_error().raw_os_error();
            let open = std::fs::File::open("/proc/self/status").map(|_| ());
            (tid, ppid, errno, open.map_err(|e| e.raw_os_error()))
        })
        .join()
        .unwrap();
        assert!(outcome.0 > 0, "gettid is allowed");
        assert_eq!(
            (outcome.1, outcome.2),
            (-1, Some(libc::EPERM)),
            "getppid is refused"
        );
        assert_eq!(outcome.3, Err(Some(libc::EPERM)), "openat is refused");
        // The test's own thread is untouched.
        assert!(std::fs::File::open("/proc/self/status").is_ok());
    }
}
