//! The memory pattern shared with the host (gpuvm-guest-images has an independent copy).

#[inline(always)]
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[inline(always)]
pub fn pattern(seed: u64, addr: u64) -> u64 {
    splitmix64(seed.wrapping_add(addr))
}

/// Writes pattern(seed, a) to every word of [start, start+len); returns the wrapping sum.
pub fn fill(start: u64, len: u64, seed: u64) -> u64 {
    let mut sum = 0u64;
    let mut addr = start;
    let end = start + len;
    while addr < end {
        let value = pattern(seed, addr);
        // SAFETY: the range is guest RAM of the data region (above the image), identity mapped
        // and user writable; nothing else uses it.
        unsafe { (addr as *mut u64).write_volatile(value) };
        sum = sum.wrapping_add(value);
        addr += 8;
    }
    sum
}

/// A word that did not hold the expected pattern.
pub struct Mismatch {
    pub addr: u64,
    pub expected: u64,
    pub got: u64,
}

/// Reads back [start, start+len) expecting pattern(seed, a); returns the wrapping sum.
pub fn verify(start: u64, len: u64, seed: u64) -> Result<u64, Mismatch> {
    let mut sum = 0u64;
    let mut addr = start;
    let end = start + len;
    while addr < end {
        // SAFETY: as in `fill`.
        let got = unsafe { (addr as *const u64).read_volatile() };
        let expected = pattern(seed, addr);
        if got != expected {
            return Err(Mismatch {
                addr,
                expected,
                got,
            });
        }
        sum = sum.wrapping_add(got);
        addr += 8;
    }
    Ok(sum)
}

/// memloop step: verify pattern(old_seed) (if given), then write pattern(new_seed), word by
/// word; returns the wrapping sum of the words written.
pub fn verify_and_rewrite(
    start: u64,
    len: u64,
    old_seed: Option<u64>,
    new_seed: u64,
) -> Result<u64, Mismatch> {
    let mut sum = 0u64;
    let mut addr = start;
    let end = start + len;
    while addr < end {
        let word = addr as *mut u64;
        if let Some(old_seed) = old_seed {
            // SAFETY: as in `fill`.
            let got = unsafe { word.read_volatile() };
            let expected = pattern(old_seed, addr);
            if got != expected {
                return Err(Mismatch {
                    addr,
                    expected,
                    got,
                });
            }
        }
        let value = pattern(new_seed, addr);
        // SAFETY: as in `fill`.
        unsafe { word.write_volatile(value) };
        sum = sum.wrapping_add(value);
        addr += 8;
    }
    Ok(sum)
}

/// Writes zeros over [start, start+len).
pub fn zero(start: u64, len: u64) {
    // SAFETY: as in `fill`.
    unsafe { core::ptr::write_bytes(start as *mut u8, 0, len as usize) };
}
