//! Private anonymous mappings for the crate's own buffers: page-aligned, zero until
//! written, and costing no page faults until touched. (A zeroed, over-aligned allocation
//! from the allocator writes every byte up front: a page fault per 4 KiB, which on hosts
//! with shadow paging costs milliseconds per few MiB, at whatever moment it is made.)

use std::io;

const BASE_PAGE: usize = 4096;
const HUGE_PAGE: usize = 2 << 20;

/// `len` bytes of private anonymous memory, owned like a `Box<[u8]>`.
pub(crate) struct AnonMap {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
}

// SAFETY: the mapping is owned exclusively (like a Box); access goes through &/&mut self.
unsafe impl Send for AnonMap {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for AnonMap {}

impl AnonMap {
    /// `len` bytes (at least one page), page-aligned.
    pub fn new(len: usize) -> io::Result<AnonMap> {
        Self::map(len, BASE_PAGE)
    }

    /// `len` bytes in whole 2 MiB units with transparent huge pages requested: a handful
    /// of huge-page faults instead of one per 4 KiB page where THP is available.
    pub fn with_huge_pages(len: usize) -> io::Result<AnonMap> {
        let map = Self::map(len, HUGE_PAGE)?;
        // SAFETY: advice on the mapping just created; failure only means no huge pages.
        unsafe { libc::madvise(map.ptr.cast(), map.map_len, libc::MADV_HUGEPAGE) };
        Ok(map)
    }

    fn map(len: usize, unit: usize) -> io::Result<AnonMap> {
        let map_len = len.max(1).div_ceil(unit) * unit;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(AnonMap {
            ptr: ptr.cast(),
            len,
            map_len,
        })
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live mapping of map_len >= len bytes, zero until written.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The first `len / 4` 32-bit words.
    pub fn words(&self) -> &[u32] {
        // SAFETY: mmap returns page-aligned memory, so 4-byte aligned; `len / 4` words lie
        // inside the mapping; any bit pattern is a valid u32.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u32>(), self.len / 4) }
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, with its length; nothing borrows it now.
        unsafe { libc::munmap(self.ptr.cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_zeroed_aligned_and_writable() {
        for (map, align) in [
            (AnonMap::new(10_000).unwrap(), BASE_PAGE),
            (AnonMap::with_huge_pages(3 << 20).unwrap(), BASE_PAGE),
            (AnonMap::new(0).unwrap(), BASE_PAGE),
        ] {
            let mut map = map;
            assert_eq!(map.as_ptr() as usize % align, 0);
            assert!(map.as_slice().iter().all(|&b| b == 0));
            let len = map.as_slice().len();
            if len > 0 {
                map.as_mut_slice()[len - 1] = 7;
                assert_eq!(map.as_slice()[len - 1], 7);
            }
            assert_eq!(map.words().len(), len / 4);
        }
    }
}
