//! The SIGSYS handler: it reports a blocked system call in one line and ends the process.

use super::{SeccompError, VIOLATION_EXIT_CODE};

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
    // ThreadKind::code of each kind (no allocation, so no lookup through the kind).
    let kind_name: &[u8] = match kind {
        1 => b"vmm",
        2 => b"vcpu",
        3 => b"api",
        4 => b"device",
        5 => b"snapshot-fault",
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

pub(super) fn install_sigsys_handler() -> Result<(), SeccompError> {
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
    fn every_thread_kind_is_named() {
        for kind in super::super::ThreadKind::ALL {
            let mut buf = [0u8; 160];
            let len = format_violation(&mut buf, 110, kind.code(), None);
            let line = std::str::from_utf8(&buf[..len]).unwrap();
            assert!(
                line.ends_with(&format!(" on a {} thread\n", kind.name())),
                "{line}"
            );
        }
    }
}
