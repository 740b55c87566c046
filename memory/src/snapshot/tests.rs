//! Snapshot write/read/restore tests on real guest RAM (memfd mappings).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Duration;

use super::format::{
    align_up, ExtentKind, Header, FLAG_PAGE_CRCS, FLAG_PAGE_CRCS_CHECKED_ON_LOAD, HEADER_LEN,
};
use super::test_util::*;
use super::*;
use crate::{Backing, GuestRam};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

fn mappings(ram: &GuestRam) -> RamMappings<'_> {
    RamMappings::from_guest_ram(ram).unwrap()
}

fn layout_of(ram: &GuestRam) -> RamLayout {
    mappings(ram).layout().clone()
}

/// A mix: random pages, all-zero pages, pages with one non-zero byte at the very end (the
/// zero check must read whole pages), and pages written and then zeroed.
fn mixed(linear: u64) -> PageFill {
    match linear % 11 {
        0 | 3 | 4 | 8 => PageFill::Random,
        5 => PageFill::LastByte,
        7 => PageFill::ZeroedAgain,
        _ => PageFill::Untouched,
    }
}

fn non_zero_pages(expected: &[u8], page_size: usize) -> u64 {
    expected
        .chunks_exact(page_size)
        .filter(|p| p.iter().any(|&b| b != 0))
        .count() as u64
}

fn restore_into_fresh(
    chain: &SnapshotChain,
    regions: &[crate::RamRegion],
    backing: Backing,
) -> GuestRam {
    let ram = guest_ram(regions, backing);
    restore_eager(chain, &mappings(&ram), &EagerOptions::default()).unwrap();
    ram
}

#[test]
fn full_snapshot_round_trip_stores_only_non_zero_pages() {
    let dir = TempDir::new("full");
    let regions = two_regions(8 * MIB, 8 * MIB, 4 * MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let expected = fill_ram(&ram, &mut Rng::new(1), mixed);
    let path = dir.path().join("mem");

    let resident = ram.resident_bytes().unwrap();
    let stats = write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();
    // The scan skipped the memfd's holes instead of reading (and so allocating) them.
    assert_eq!(ram.resident_bytes().unwrap(), resident);
    let data_pages = non_zero_pages(&expected, PAGE as usize);
    assert_eq!(stats.data_pages, data_pages);
    assert_eq!(stats.zero_pages, 0);
    assert_eq!(stats.pages_examined, 3 * 1024);
    assert!(!stats.info.is_diff());

    // File size is exactly header + regions + index + page CRCs (padded) + data pages.
    let metadata = HEADER_LEN as u64 + 2 * 24 + stats.extents * 24 + data_pages * 4;
    let file_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(file_len, align_up(metadata, 4096) + data_pages * PAGE);
    assert_eq!(file_len, stats.file_len);

    let file = MemoryFile::open(&path).unwrap();
    assert_eq!(file.info(), stats.info);
    file.verify_data().unwrap();
    // The index never mentions a zero page, including those the guest zeroed again.
    for e in file.extents() {
        assert_eq!(e.kind, ExtentKind::Data);
        for p in 0..u64::from(e.page_count) {
            let (_, linear) = file.layout().locate_guest_page(e.first_page + p).unwrap();
            assert_ne!(mixed(linear), PageFill::ZeroedAgain);
            assert_ne!(mixed(linear), PageFill::Untouched);
        }
    }

    let chain = SnapshotChain::open(&[&path], &layout_of(&ram)).unwrap();
    assert_eq!(chain.data_pages(), data_pages);
    let restored = restore_into_fresh(&chain, &regions, Backing::Memfd);
    // Holes were never touched: only the data pages are allocated in the new memfd.
    assert_eq!(restored.resident_bytes().unwrap(), data_pages * PAGE);
    assert_ram_eq(&restored, &expected);
}

#[test]
fn without_crcs_or_memfd_everything_goes_through_the_mappings() {
    let dir = TempDir::new("nocrc");
    let regions = two_regions(4 * MIB, 4 * MIB, 4 * MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let expected = fill_ram(&ram, &mut Rng::new(2), mixed);
    let path = dir.path().join("mem");
    let opts = WriteOptions {
        page_crcs: false,
        threads: 1,
    };
    let stats = write_full(&path, &mappings_only(&ram), &opts).unwrap();
    assert_eq!(stats.data_pages, non_zero_pages(&expected, PAGE as usize));
    let metadata = HEADER_LEN as u64 + 2 * 24 + stats.extents * 24;
    assert_eq!(
        stats.file_len,
        align_up(metadata, 4096) + stats.data_pages * PAGE
    );
    let file = MemoryFile::open(&path).unwrap();
    assert!(!file.has_page_crcs());

    let chain = SnapshotChain::open(&[&path], &layout_of(&ram)).unwrap();
    let fresh = guest_ram(&regions, Backing::Memfd);
    let restore = EagerOptions {
        threads: 3,
        verify_data: false,
        chunk_bytes: 256 << 10,
    };
    let done = restore_eager(&chain, &mappings_only(&fresh), &restore).unwrap();
    assert_eq!(done.pages, stats.data_pages);
    assert_ram_eq(&fresh, &expected);
}

/// Mappings without the memfd: every page is read, and restores write the mappings.
fn mappings_only(ram: &GuestRam) -> RamMappings<'_> {
    let (regions, addrs): (Vec<_>, Vec<_>) = ram.host_regions().unzip();
    let layout = RamLayout::new(ram.page_size(), regions).unwrap();
    // SAFETY: the addresses are `ram`'s own live mappings of each region.
    unsafe { RamMappings::new(layout, addrs) }.unwrap()
}

#[test]
fn a_page_written_with_zeros_is_left_out() {
    let dir = TempDir::new("zeroed");
    let regions = two_regions(MIB, 0, MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let mut rng = Rng::new(3);
    // Page 10 keeps data; page 11 gets data, then zeros.
    fill_ram(&ram, &mut rng, |p| match p {
        10 => PageFill::Random,
        11 => PageFill::ZeroedAgain,
        _ => PageFill::Untouched,
    });
    let path = dir.path().join("mem");
    let stats = write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();
    assert_eq!(stats.data_pages, 1);
    let file = MemoryFile::open(&path).unwrap();
    assert_eq!(file.extents().len(), 1);
    assert_eq!(file.extents()[0].first_page, 10);
    assert_eq!(file.extents()[0].page_count, 1);
    assert_eq!(stats.file_len, 4096 + PAGE);
}

/// Applies random changes and returns the per-region dirty bitmaps: some pages get new
/// data, some data pages are zeroed, and some pages are marked dirty without changing.
fn mutate(ram: &GuestRam, expected: &mut [u8], rng: &mut Rng, changes: u64) -> Vec<Vec<u64>> {
    let page_size = ram.page_size() as usize;
    let log_pages_per_page = ram.page_size() / 4096;
    let mut bitmaps: Vec<Vec<u64>> = ram
        .regions()
        .iter()
        .map(|r| vec![0u64; (r.size / 4096).div_ceil(64) as usize])
        .collect();
    let pages = total_pages(ram);
    for _ in 0..changes {
        let linear = rng.below(pages);
        let page = &mut expected[linear as usize * page_size..][..page_size];
        match rng.below(3) {
            0 => rng.fill(page),
            1 => page.fill(0),
            _ => {} // dirty but unchanged
        }
        write_page(ram, linear, page);
        // Mark one 4 KiB dirty-log bit inside the page, as KVM would for one write.
        let mut first = 0;
        for (i, r) in ram.regions().iter().enumerate() {
            let n = r.size / ram.page_size();
            if linear < first + n {
                let bit = (linear - first) * log_pages_per_page + rng.below(log_pages_per_page);
                bitmaps[i][(bit / 64) as usize] |= 1 << (bit % 64);
                break;
            }
            first += n;
        }
    }
    bitmaps
}

fn refs(bitmaps: &[Vec<u64>]) -> Vec<&[u64]> {
    bitmaps.iter().map(|b| b.as_slice()).collect()
}

#[test]
fn diff_chain_restores_exact_memory_and_is_validated() {
    let dir = TempDir::new("diff");
    let regions = two_regions(4 * MIB, 4 * MIB, 2 * MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let layout = layout_of(&ram);
    let mut rng = Rng::new(4);
    let mut expected = fill_ram(&ram, &mut rng, mixed);
    let (base, d1, d2) = (
        dir.path().join("base"),
        dir.path().join("d1"),
        dir.path().join("d2"),
    );
    let opts = WriteOptions::default();

    let base_stats = write_full(&base, &mappings(&ram), &opts).unwrap();
    let dirty1 = mutate(&ram, &mut expected, &mut rng, 300);
    let after_d1 = expected.clone();
    let d1_stats = write_diff(
        &d1,
        &mappings(&ram),
        &refs(&dirty1),
        &base_stats.info,
        &opts,
    )
    .unwrap();
    assert_eq!(d1_stats.info.generation, 1);
    assert_eq!(d1_stats.info.base_id, Some(base_stats.info.id));
    assert!(
        d1_stats.zero_pages > 0,
        "the diff must record dirty pages that are now zero"
    );
    let dirty_pages: u64 = dirty1
        .iter()
        .flatten()
        .map(|w| u64::from(w.count_ones()))
        .sum();
    assert_eq!(d1_stats.pages_examined, dirty_pages);
    assert_eq!(d1_stats.data_pages + d1_stats.zero_pages, dirty_pages);

    let mut dirty2 = mutate(&ram, &mut expected, &mut rng, 300);
    // A data page the guest gave back (a hole punched in the memfd, as a balloon would):
    // dirty, never read, recorded as zero.
    let freed = (0..1024u64)
        .find(|&p| {
            expected[(p * PAGE) as usize..][..PAGE as usize]
                .iter()
                .any(|&b| b != 0)
        })
        .unwrap();
    // SAFETY: plain syscall on the memfd; the range is inside it.
    let ret = unsafe {
        libc::fallocate(
            ram.memfd().as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            (freed * PAGE) as libc::off_t,
            PAGE as libc::off_t,
        )
    };
    assert_eq!(ret, 0);
    expected[(freed * PAGE) as usize..][..PAGE as usize].fill(0);
    dirty2[0][(freed / 64) as usize] |= 1 << (freed % 64);
    let d2_stats = write_diff(&d2, &mappings(&ram), &refs(&dirty2), &d1_stats.info, &opts).unwrap();
    assert_eq!(d2_stats.info.generation, 2);

    let full_chain = SnapshotChain::open(&[&base, &d1, &d2], &layout).unwrap();
    assert_eq!(full_chain.head(), d2_stats.info);
    assert_eq!(
        full_chain.data_pages(),
        non_zero_pages(&expected, PAGE as usize)
    );
    assert_ram_eq(
        &restore_into_fresh(&full_chain, &regions, Backing::Memfd),
        &expected,
    );

    let partial_chain = SnapshotChain::open(&[&base, &d1], &layout).unwrap();
    assert_ram_eq(
        &restore_into_fresh(&partial_chain, &regions, Backing::Memfd),
        &after_d1,
    );

    // Broken chains are refused before anything is loaded.
    for paths in [
        vec![&base, &d2],
        vec![&d1],
        vec![&base, &d2, &d1],
        vec![&base, &base],
    ] {
        let err = SnapshotChain::open(&paths, &layout).unwrap_err();
        assert!(
            matches!(err, SnapshotError::BrokenChain { .. }),
            "{paths:?}: {err}"
        );
    }
    let err = SnapshotChain::open::<&Path>(&[], &layout).unwrap_err();
    assert!(matches!(err, SnapshotError::BrokenChain { .. }), "{err}");
}

#[test]
fn diff_arguments_are_checked() {
    let dir = TempDir::new("diffargs");
    let regions = two_regions(MIB, 0, MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let base = write_full(
        &dir.path().join("b"),
        &mappings(&ram),
        &WriteOptions::default(),
    )
    .unwrap();
    let path = dir.path().join("d");
    let words = vec![0u64; 4];
    let err = write_diff(
        &path,
        &mappings(&ram),
        &[&words],
        &base.info,
        &WriteOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, SnapshotError::DirtyBitmapCount { regions: 2, got: 1 }),
        "{err}"
    );
    let short = vec![0u64; 3];
    let err = write_diff(
        &path,
        &mappings(&ram),
        &[&words, &short],
        &base.info,
        &WriteOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            SnapshotError::DirtyBitmapTooShort {
                region: 1,
                needed: 4,
                got: 3,
                ..
            }
        ),
        "{err}"
    );
    let mut other = base.info.clone();
    other.ram_size *= 2;
    let err = write_diff(
        &path,
        &mappings(&ram),
        &[&words, &words],
        &other,
        &WriteOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, SnapshotError::RamSizeMismatch { .. }),
        "{err}"
    );
    assert!(!path.exists());
}

/// Writes a small snapshot and returns its path, the guest layout and the file's
/// (data offset, index start) for corruption tests.
fn small_snapshot(dir: &TempDir) -> (std::path::PathBuf, RamLayout, u64) {
    let regions = two_regions(MIB, MIB, MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    fill_ram(&ram, &mut Rng::new(5), mixed);
    let path = dir.path().join("mem");
    let stats = write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();
    let data_offset = stats.file_len - stats.data_pages * PAGE;
    (path, layout_of(&ram), data_offset)
}

fn flip_byte(path: &Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
}

fn write_u32(path: &Path, at: u64, v: u32) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&v.to_le_bytes(), at).unwrap();
}

#[test]
fn every_kind_of_damage_is_detected_with_its_own_error() {
    let dir = TempDir::new("corrupt");
    let (good, layout, data_offset) = small_snapshot(&dir);
    let file_len = std::fs::metadata(&good).unwrap().len();
    let case = |name: &str, damage: &dyn Fn(&Path)| -> SnapshotError {
        let path = dir.path().join(name);
        std::fs::copy(&good, &path).unwrap();
        damage(&path);
        let err = match MemoryFile::open(&path) {
            Err(e) => e,
            Ok(f) => f
                .check_layout(&layout)
                .and_then(|_| f.verify_data())
                .unwrap_err(),
        };
        assert!(
            err.to_string().contains(name),
            "the message names the file: {err}"
        );
        err
    };

    let err = case("magic", &|p| flip_byte(p, 2));
    assert!(matches!(err, SnapshotError::BadMagic { .. }), "{err}");
    let err = case("version", &|p| write_u32(p, 8, 2));
    assert!(
        matches!(
            err,
            SnapshotError::UnsupportedVersion {
                found: 2,
                supported: 1,
                ..
            }
        ),
        "{err}"
    );
    let err = case("header", &|p| flip_byte(p, 33));
    assert!(
        matches!(err, SnapshotError::HeaderCrcMismatch { .. }),
        "{err}"
    );
    let err = case("count", &|p| flip_byte(p, 81));
    assert!(
        matches!(err, SnapshotError::HeaderCrcMismatch { .. }),
        "{err}"
    );
    let err = case("index", &|p| flip_byte(p, HEADER_LEN as u64 + 2 * 24 + 5));
    assert!(
        matches!(err, SnapshotError::IndexCrcMismatch { .. }),
        "{err}"
    );
    let err = case("regions", &|p| flip_byte(p, HEADER_LEN as u64 + 1));
    assert!(
        matches!(err, SnapshotError::IndexCrcMismatch { .. }),
        "{err}"
    );
    let err = case("truncdata", &|p| {
        OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(file_len - 1)
            .unwrap()
    });
    assert!(
        matches!(
            err,
            SnapshotError::Truncated {
                what: "page data",
                ..
            }
        ),
        "{err}"
    );
    let err = case("truncindex", &|p| {
        OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(HEADER_LEN as u64 + 30)
            .unwrap()
    });
    assert!(
        matches!(
            err,
            SnapshotError::Truncated {
                what: "region table and page index",
                ..
            }
        ),
        "{err}"
    );
    let err = case("truncheader", &|p| {
        OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(64)
            .unwrap()
    });
    assert!(
        matches!(err, SnapshotError::Truncated { what: "header", .. }),
        "{err}"
    );
    let err = case("empty", &|p| {
        OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(0)
            .unwrap()
    });
    assert!(matches!(err, SnapshotError::BadMagic { .. }), "{err}");
    let err = case("data", &|p| flip_byte(p, data_offset + 3 * PAGE + 100));
    assert!(
        matches!(err, SnapshotError::DataCrcMismatch { .. }),
        "{err}"
    );

    // The configured guest differs from the snapshot.
    let file = MemoryFile::open(&good).unwrap();
    let huge = RamLayout::new(2 * MIB, two_regions(2 * MIB, 0, 2 * MIB)).unwrap();
    let err = file.check_layout(&huge).unwrap_err();
    assert!(
        matches!(
            err,
            SnapshotError::PageSizeMismatch {
                file: 4096,
                guest: 0x20_0000,
                ..
            }
        ),
        "{err}"
    );
    let bigger = RamLayout::new(PAGE, two_regions(MIB, MIB, 2 * MIB)).unwrap();
    let err = file.check_layout(&bigger).unwrap_err();
    assert!(
        matches!(err, SnapshotError::RamSizeMismatch { .. }),
        "{err}"
    );
    let moved = RamLayout::new(PAGE, two_regions(MIB, 2 * MIB, MIB)).unwrap();
    let err = SnapshotChain::open(&[&good], &moved).unwrap_err();
    assert!(
        matches!(err, SnapshotError::RegionMismatch { index: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("region 1 mismatch"), "{err}");

    // Eager restore refuses damaged data before the guest could run on it.
    let damaged = dir.path().join("damaged");
    std::fs::copy(&good, &damaged).unwrap();
    flip_byte(&damaged, data_offset + 5 * PAGE);
    let err = eager_restore_error(&damaged, &layout);
    assert!(
        matches!(err, SnapshotError::DataCrcMismatch { .. }),
        "{err}"
    );
}

/// The error of an eager restore of the (single-file) snapshot at `path` into fresh RAM.
fn eager_restore_error(path: &Path, layout: &RamLayout) -> SnapshotError {
    let chain = SnapshotChain::open(&[path], layout).unwrap();
    let fresh = guest_ram(layout.regions(), Backing::Memfd);
    restore_eager(&chain, &mappings(&fresh), &EagerOptions::default()).unwrap_err()
}

/// The decoded header of the memory file at `path`.
fn header_of(path: &Path) -> Header {
    let mut bytes = [0u8; HEADER_LEN];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut bytes, 0)
        .unwrap();
    Header::decode(&bytes)
}

/// File offset of page CRC number `index` in the memory file at `path`.
fn page_crc_offset(path: &Path, index: u64) -> u64 {
    let header = header_of(path);
    assert!(header.has_page_crcs());
    HEADER_LEN as u64 + header.index_len().unwrap() + index * 4
}

/// Rewrites `path` as files were written before `FLAG_PAGE_CRCS_CHECKED_ON_LOAD`: the
/// index CRC covers the page CRC table too.
fn rewrite_with_page_crcs_in_the_index_crc(path: &Path) {
    let mut header = header_of(path);
    header.flags &= !FLAG_PAGE_CRCS_CHECKED_ON_LOAD;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut metadata = vec![0u8; header.metadata_len().unwrap() as usize];
    file.read_exact_at(&mut metadata, HEADER_LEN as u64)
        .unwrap();
    header.index_crc = crc32fast::hash(&metadata);
    file.write_all_at(&header.encode(), 0).unwrap();
}

#[test]
fn page_crcs_are_read_and_checked_with_their_pages() {
    let dir = TempDir::new("lazycrc");
    let (good, layout, _) = small_snapshot(&dir);
    let header = header_of(&good);
    assert!(header.page_crcs_checked_on_load(), "{header:?}");
    assert!(header.data_page_count > 3, "{header:?}");

    // A damaged entry is not noticed when the file opens (the table is not read then),
    // but fails the load of its page, named by guest address, like damaged data.
    let damaged = dir.path().join("damaged-crc");
    std::fs::copy(&good, &damaged).unwrap();
    flip_byte(&damaged, page_crc_offset(&damaged, 3) + 1);
    let file = MemoryFile::open(&damaged).unwrap();
    let err = file.verify_data().unwrap_err();
    assert!(
        matches!(err, SnapshotError::DataCrcMismatch { .. }),
        "{err}"
    );
    let err = eager_restore_error(&damaged, &layout);
    assert!(
        matches!(err, SnapshotError::DataCrcMismatch { .. }),
        "{err}"
    );

    // A file cut inside the table after it was opened (data and table gone) fails with
    // a read error, not a panic or a pass.
    let cut = dir.path().join("cut-crc");
    std::fs::copy(&good, &cut).unwrap();
    let file = MemoryFile::open(&cut).unwrap();
    OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(page_crc_offset(&cut, 1))
        .unwrap();
    let err = file.verify_data().unwrap_err();
    assert!(matches!(err, SnapshotError::Io { .. }), "{err}");

    // The flag means nothing without a table: refused.
    let bare = dir.path().join("flag-without-crcs");
    std::fs::copy(&good, &bare).unwrap();
    let mut header = header_of(&bare);
    header.flags &= !FLAG_PAGE_CRCS;
    OpenOptions::new()
        .write(true)
        .open(&bare)
        .unwrap()
        .write_all_at(&header.encode(), 0)
        .unwrap();
    let err = MemoryFile::open(&bare).unwrap_err();
    assert!(matches!(err, SnapshotError::InvalidHeader { .. }), "{err}");
}

#[test]
fn files_whose_index_crc_covers_the_page_crcs_still_restore() {
    let dir = TempDir::new("oldcrc");
    let regions = two_regions(MIB, MIB, MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let expected = fill_ram(&ram, &mut Rng::new(9), mixed);
    let path = dir.path().join("mem");
    write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();
    rewrite_with_page_crcs_in_the_index_crc(&path);
    assert!(!header_of(&path).page_crcs_checked_on_load());

    let file = MemoryFile::open(&path).unwrap();
    file.verify_data().unwrap();
    let chain = SnapshotChain::open(&[&path], &layout_of(&ram)).unwrap();
    let fresh = restore_into_fresh(&chain, &regions, Backing::Memfd);
    assert_ram_eq(&fresh, &expected);

    // There the table is checked whole when the file opens.
    flip_byte(&path, page_crc_offset(&path, 2));
    let err = MemoryFile::open(&path).unwrap_err();
    assert!(
        matches!(err, SnapshotError::IndexCrcMismatch { .. }),
        "{err}"
    );
}

/// Environment variable telling [`crash_child`] where to write.
const CRASH_CHILD_ENV: &str = "GPUVM_MEMORY_CRASH_CHILD_PATH";

/// Helper process for `atomic_write_survives_sigkill`: rewrites a snapshot in a loop until
/// killed. Does nothing when run directly.
#[test]
#[ignore = "helper process run by atomic_write_survives_sigkill"]
fn crash_child() {
    let Ok(path) = std::env::var(CRASH_CHILD_ENV) else {
        return;
    };
    let regions = two_regions(8 * MIB, 0, 8 * MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    let mut rng = Rng::new(std::process::id().into());
    fill_ram(&ram, &mut rng, |p| {
        if p % 4 == 0 {
            PageFill::Untouched
        } else {
            PageFill::Random
        }
    });
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    // Stop by ourselves should the parent test die without killing us.
    // SAFETY: as above.
    while unsafe { libc::getppid() } == parent {
        // Consecutive files differ.
        let page: Vec<u8> = (0..PAGE).map(|_| rng.next_u64() as u8).collect();
        write_page(&ram, 1, &page);
        write_full(Path::new(&path), &mappings(&ram), &WriteOptions::default()).unwrap();
    }
}

#[test]
fn atomic_write_survives_sigkill() {
    let dir = TempDir::new("crash");
    let path = dir.path().join("mem");
    let regions = two_regions(2 * MIB, 0, 2 * MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    fill_ram(&ram, &mut Rng::new(6), mixed);
    write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();

    let mut rng = Rng::new(7);
    let mut killed_mid_write = 0;
    for round in 0..8 {
        let before = MemoryFile::open(&path).unwrap().info().id;
        let mut child = KillOnDrop(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "snapshot::tests::crash_child",
                    "--ignored",
                    "--test-threads=1",
                ])
                .env(CRASH_CHILD_ENV, &path)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        // Once the child has replaced the file it is (nearly) always inside a write.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while MemoryFile::open(&path).unwrap().info().id == before {
            assert!(child.0.try_wait().unwrap().is_none(), "the child died");
            assert!(
                std::time::Instant::now() < deadline,
                "the child never wrote"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        if round % 2 == 0 {
            // Aim inside a write: wait for the child's temp file to appear.
            let temp = format!(".mem.tmp.{}.", child.0.id());
            while !std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(&temp))
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the child never wrote"
                );
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_millis(rng.below(3)));
        } else {
            // Anywhere in the write loop.
            std::thread::sleep(Duration::from_millis(rng.below(300)));
        }
        // SAFETY: plain syscall; the pid is our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) }, 0);
        child.0.wait().unwrap();
        drop(child);

        let temp_left = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".mem.tmp."));
        if temp_left {
            killed_mid_write += 1;
        }
        // Whatever moment the kill hit, the file at `path` is complete and valid.
        let file = MemoryFile::open(&path).unwrap_or_else(|e| panic!("round {round}: {e}"));
        file.verify_data()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        // It is either the parent's file or one the child completed.
        assert!([4 * MIB, 16 * MIB].contains(&file.layout().ram_size()));
    }
    assert!(
        killed_mid_write > 0,
        "no kill landed in the middle of a write"
    );

    // The next write cleans up what the killed writers left behind.
    write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("mem")]);
}

/// Issue 30: a memory file converted to a raw image keeps its index and page CRCs, not its
/// data: the blocks are freed, the file opens as before with the same length, the raw
/// image's CRC table is still computed from it (a later Diff's conversion), and its pages
/// now fail their checks rather than load as zeros. A file without page CRCs is refused.
#[test]
fn dropping_page_data_keeps_the_index_and_page_crcs() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new("drop-data");
    let (path, layout, data_offset) = small_snapshot(&dir);
    let len = std::fs::metadata(&path).unwrap().len();
    let table = RawPageCrcs::of_chain(&SnapshotChain::open(&[&path], &layout).unwrap()).unwrap();

    let freed = MemoryFile::open(&path).unwrap().drop_page_data().unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), len);
    assert!(freed >= len - data_offset, "{freed} of {len} bytes freed");
    assert!(
        meta.blocks() * 512 <= data_offset,
        "{} allocated",
        meta.blocks() * 512
    );
    let chain = SnapshotChain::open(&[&path], &layout).unwrap();
    assert_eq!(RawPageCrcs::of_chain(&chain).unwrap(), table);
    let error = chain.layers()[0].verify_data().unwrap_err();
    assert!(error.to_string().contains("data CRC mismatch"), "{error}");

    let regions = two_regions(MIB, MIB, MIB);
    let ram = guest_ram(&regions, Backing::Memfd);
    fill_ram(&ram, &mut Rng::new(6), mixed);
    let unchecked = dir.path().join("unchecked");
    let opts = WriteOptions {
        page_crcs: false,
        threads: 1,
    };
    write_full(&unchecked, &mappings(&ram), &opts).unwrap();
    let before = std::fs::metadata(&unchecked).unwrap().blocks();
    assert!(MemoryFile::open(&unchecked)
        .unwrap()
        .drop_page_data()
        .is_err());
    assert_eq!(std::fs::metadata(&unchecked).unwrap().blocks(), before);
}
