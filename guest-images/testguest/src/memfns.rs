//! memcpy/memmove/memset/memcmp/bcmp for the freestanding link (no libc). Written with string
//! instructions or byte loops the compiler will not turn back into calls to themselves.

use core::arch::asm;

#[no_mangle]
pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees both ranges are valid and do not overlap; DF is clear per ABI.
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dest => _, inout("rsi") src => _,
             options(nostack, preserves_flags));
    }
    dest
}

#[no_mangle]
pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dest as usize).wrapping_sub(src as usize) >= n {
        // No harmful overlap for a forward copy.
        // SAFETY: the caller guarantees both ranges are valid.
        unsafe { memcpy(dest, src, n) }
    } else {
        // SAFETY: copies backwards from the last byte (dest > src overlapping); DF restored.
        unsafe {
            asm!("std", "rep movsb", "cld",
                 inout("rcx") n => _,
                 inout("rdi") dest.add(n - 1) => _,
                 inout("rsi") src.add(n - 1) => _,
                 options(nostack));
        }
        dest
    }
}

#[no_mangle]
pub unsafe extern "C" fn memset(dest: *mut u8, value: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees the range is valid.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dest => _, in("al") value as u8,
             options(nostack, preserves_flags));
    }
    dest
}

#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: the caller guarantees both ranges hold n bytes.
        let (x, y) = unsafe { (a.add(i).read_volatile(), b.add(i).read_volatile()) };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}
