//! Helpers shared by the snapshot and uffd tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Backing, GuestRam, GuestRamConfig, RamRegion};

/// A directory removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "gpuvm-mem-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// xorshift64*: deterministic test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Two regions with a hole between them (like RAM split around the MMIO hole).
pub(crate) use crate::backing::tests::two_regions;

/// Fresh guest RAM with `regions`.
pub(crate) fn guest_ram(regions: &[RamRegion], backing: Backing) -> GuestRam {
    let config = GuestRamConfig {
        size: regions.iter().map(|r| r.size).sum(),
        backing,
        thp: false,
    };
    GuestRam::create(&config, regions).unwrap()
}

/// Raw pointer to linear page `linear` of `ram` (region order, then offset).
pub(crate) fn page_ptr(ram: &GuestRam, linear: u64) -> *mut u8 {
    let page_size = ram.page_size();
    let mut first = 0;
    for (region, host) in ram.host_regions() {
        let pages = region.size / page_size;
        if linear < first + pages {
            return host.wrapping_add(((linear - first) * page_size) as usize);
        }
        first += pages;
    }
    panic!("page {linear} outside guest RAM");
}

pub(crate) fn total_pages(ram: &GuestRam) -> u64 {
    ram.size() / ram.page_size()
}

/// Writes `data` (one page) into linear page `linear`.
pub(crate) fn write_page(ram: &GuestRam, linear: u64, data: &[u8]) {
    assert_eq!(data.len() as u64, ram.page_size());
    // SAFETY: the page is inside a live mapping of `ram`; `data` is a page long.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), page_ptr(ram, linear), data.len()) };
}

/// Copies linear page `linear` out of `ram`.
pub(crate) fn read_page(ram: &GuestRam, linear: u64) -> Vec<u8> {
    let mut out = vec![0u8; ram.page_size() as usize];
    // SAFETY: the page is inside a live mapping of `ram`.
    unsafe { std::ptr::copy_nonoverlapping(page_ptr(ram, linear), out.as_mut_ptr(), out.len()) };
    out
}

/// What a test wrote into each page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageFill {
    /// Never written.
    Untouched,
    /// Random bytes.
    Random,
    /// All zero except the last byte.
    LastByte,
    /// Written with random data, then with zeros.
    ZeroedAgain,
}

/// Fills every page of `ram` per `pattern(linear)`; returns the expected contents.
pub(crate) fn fill_ram(
    ram: &GuestRam,
    rng: &mut Rng,
    pattern: impl Fn(u64) -> PageFill,
) -> Vec<u8> {
    let page_size = ram.page_size() as usize;
    let pages = total_pages(ram);
    let mut expected = vec![0u8; pages as usize * page_size];
    for linear in 0..pages {
        let page = &mut expected[linear as usize * page_size..][..page_size];
        match pattern(linear) {
            PageFill::Untouched => {}
            PageFill::Random => {
                rng.fill(page);
                write_page(ram, linear, page);
            }
            PageFill::LastByte => {
                page[page_size - 1] = 0xa5;
                write_page(ram, linear, page);
            }
            PageFill::ZeroedAgain => {
                let mut junk = vec![0u8; page_size];
                rng.fill(&mut junk);
                write_page(ram, linear, &junk);
                write_page(ram, linear, page);
            }
        }
    }
    expected
}

/// Checks `ram` page by page against `expected`, naming the first bad page.
pub(crate) fn assert_ram_eq(ram: &GuestRam, expected: &[u8]) {
    let page_size = ram.page_size() as usize;
    for linear in 0..total_pages(ram) {
        let want = &expected[linear as usize * page_size..][..page_size];
        let got = read_page(ram, linear);
        assert!(got == want, "page {linear} differs after restore");
    }
}

/// Kills the child process when dropped, so a failing test leaves nothing running.
pub(crate) struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
