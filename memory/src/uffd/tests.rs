//! Lazy restore tests: real userfaultfd on memfd / hugetlb guest RAM, threads faulting
//! while the background loader runs, and the external handshake across processes.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::external::{mappings_for, send_handshake, ExternalHandler};
use super::*;
use crate::snapshot::test_util::*;
use crate::snapshot::{write_diff, write_full, RamMappings, SnapshotChain, WriteOptions};
use crate::{Backing, GuestRam, RamRegion};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;
const WAIT: Duration = Duration::from_secs(60);

fn mappings(ram: &GuestRam) -> RamMappings<'_> {
    RamMappings::from_guest_ram(ram).unwrap()
}

fn mixed(linear: u64) -> PageFill {
    match linear % 7 {
        0 | 2 | 3 => PageFill::Random,
        4 => PageFill::LastByte,
        6 => PageFill::ZeroedAgain,
        _ => PageFill::Untouched,
    }
}

/// Writes a full snapshot of random+zero pages; returns the file and expected contents.
fn snapshot_of(dir: &TempDir, regions: &[RamRegion], seed: u64) -> (PathBuf, Vec<u8>) {
    let ram = guest_ram(regions, Backing::Memfd);
    let expected = fill_ram(&ram, &mut Rng::new(seed), mixed);
    let path = dir.path().join("mem");
    write_full(&path, &mappings(&ram), &WriteOptions::default()).unwrap();
    (path, expected)
}

fn open_chain(paths: &[&Path], ram: &GuestRam) -> Arc<SnapshotChain> {
    Arc::new(SnapshotChain::open(paths, mappings(ram).layout()).unwrap())
}

/// Reads `count` random pages from `threads` threads (each read faults if the page is
/// missing) and checks them.
fn read_randomly(ram: &GuestRam, expected: &[u8], threads: u64, count: u64) {
    let page_size = ram.page_size() as usize;
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut rng = Rng::new(100 + t);
                for _ in 0..count {
                    let linear = rng.below(total_pages(ram));
                    let want = &expected[linear as usize * page_size..][..page_size];
                    assert!(
                        read_page(ram, linear) == want,
                        "page {linear} wrong while loading"
                    );
                }
            });
        }
    });
}

fn data_bytes(expected: &[u8], page_size: usize) -> u64 {
    expected
        .chunks_exact(page_size)
        .filter(|p| p.iter().any(|&b| b != 0))
        .count() as u64
        * page_size as u64
}

#[test]
fn lazy_restore_serves_faults_while_loading_in_background() {
    let dir = TempDir::new("lazy");
    let regions = two_regions(16 * MIB, 16 * MIB, 8 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 1);
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let opts = LazyOptions {
        chunk_bytes: 256 << 10,
        loader_threads: 2,
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    read_randomly(&ram, &expected, 4, 400);
    let stats = restore
        .wait_timeout(Some(WAIT))
        .unwrap()
        .expect("restore finished");

    assert!(stats.complete());
    assert_eq!(stats.loaded_data_pages, stats.total_data_pages);
    assert_eq!(
        stats.total_data_pages * PAGE,
        data_bytes(&expected, PAGE as usize)
    );
    // Every data page was loaded exactly once, by one path or the other.
    assert_eq!(
        stats.bytes_loaded_by_faults + stats.bytes_loaded_background,
        stats.total_data_pages * PAGE
    );
    // On a fast host the background loader can finish before the readers touch a page;
    // then nothing faults. On-demand faulting is covered deterministically by
    // `on_demand_only_loads_exactly_the_faulted_pages`, which runs without the background loader.
    if stats.faults == 0 {
        eprintln!("note: the background loader finished before any reader faulted");
    }
    assert!(stats.fault_latency_p50 <= stats.fault_latency_p99);
    assert_ram_eq(&ram, &expected);
    let final_stats = restore.shutdown().unwrap();
    assert!(final_stats.time_to_complete.is_some());
}

#[test]
fn on_demand_only_loads_exactly_the_faulted_pages() {
    let dir = TempDir::new("ondemand");
    let regions = two_regions(4 * MIB, 4 * MIB, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 2);
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let total = chain.data_pages();
    let opts = LazyOptions {
        background: false,
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();

    // Touch pages in a known order; until every data page is in, each first touch faults.
    let pages = total_pages(&ram);
    let mut order: Vec<u64> = (0..pages).collect();
    let mut rng = Rng::new(3);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut touched_before_done = Vec::new();
    for &linear in &order {
        if !restore.is_complete() {
            touched_before_done.push(linear);
        }
        let want = &expected[linear as usize * PAGE as usize..][..PAGE as usize];
        assert!(read_page(&ram, linear) == want, "page {linear}");
    }
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    assert_eq!(stats.faults_served_data, total);
    assert_eq!(stats.bytes_loaded_background, 0);
    assert_eq!(stats.bytes_loaded_by_faults, total * PAGE);
    assert_eq!(
        stats.faults,
        stats.faults_served_data + stats.faults_served_zero
    );
    // The recorded fault order is the first-touch order (as guest addresses). The touch
    // that completes the restore may be seen as "before" it.
    let layout = mappings(&ram).layout().clone();
    let gpas: Vec<u64> = order.iter().map(|&l| layout.linear_to_gpa(l)).collect();
    let recorded = restore.fault_order();
    assert!(
        recorded.len() + 1 >= touched_before_done.len(),
        "{} faults recorded, {} touches before completion, {stats:?}",
        recorded.len(),
        touched_before_done.len()
    );
    assert_eq!(recorded[..], gpas[..recorded.len()]);
    assert_ram_eq(&ram, &expected);
}

#[test]
fn lazy_restore_of_a_diff_chain_with_working_set() {
    let dir = TempDir::new("lazychain");
    let regions = two_regions(8 * MIB, 0, 8 * MIB);
    let src = guest_ram(&regions, Backing::Memfd);
    let mut rng = Rng::new(4);
    let mut expected = fill_ram(&src, &mut rng, mixed);
    let (base, diff) = (dir.path().join("base"), dir.path().join("diff"));
    let base_info = write_full(&base, &mappings(&src), &WriteOptions::default())
        .unwrap()
        .info;
    // Zero every data page in the first MiB (zero extents must hide the base), rewrite a
    // few others.
    let mut bitmaps: Vec<Vec<u64>> = regions
        .iter()
        .map(|r| vec![0u64; (r.size / PAGE / 64) as usize])
        .collect();
    for linear in (0..256).chain((1000..2000).step_by(37)) {
        let page = &mut expected[linear as usize * PAGE as usize..][..PAGE as usize];
        if linear < 256 {
            page.fill(0);
        } else {
            rng.fill(page);
        }
        write_page(&src, linear, page);
        bitmaps[0][(linear / 64) as usize] |= 1 << (linear % 64);
    }
    let refs: Vec<&[u64]> = bitmaps.iter().map(|b| b.as_slice()).collect();
    write_diff(
        &diff,
        &mappings(&src),
        &refs,
        &base_info,
        &WriteOptions::default(),
    )
    .unwrap();

    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&base, &diff], &ram);
    let opts = LazyOptions {
        working_set: (1500..1600).map(|p| p * PAGE).collect(),
        chunk_bytes: 1 << 20,
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    read_randomly(&ram, &expected, 3, 300);
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    assert_eq!(stats.loaded_data_pages, stats.total_data_pages);
    assert_ram_eq(&ram, &expected);
}

#[test]
fn the_background_loader_takes_the_working_set_before_the_sweep() {
    let dir = TempDir::new("lazyworkingset");
    // Two regions, so the working set's guest addresses are not linear page numbers.
    let regions = two_regions(8 * MIB, 4 * MIB, 8 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 12);
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    // With 1 MiB chunks: the first chunk of the second region, and the last but one
    // chunk of the first, in that order; repeated and out-of-RAM entries are ignored.
    let second = 12 * MIB;
    let working_set = vec![second, second + 5 * PAGE, 6 * MIB + 3 * PAGE, 9 * MIB];
    // Linear pages: the first region holds 0..2048; the second region starts at 2048.
    let pages = |from: u64, to: u64| &expected[(from * PAGE) as usize..(to * PAGE) as usize];
    let want = data_bytes(pages(2048, 2048 + 256), PAGE as usize)
        + data_bytes(pages(1536, 1792), PAGE as usize);
    assert!(want > 0);
    let opts = LazyOptions {
        working_set,
        chunk_bytes: 1 << 20,
        loader_threads: 1,
        ..LazyOptions::default()
    };
    // Nothing faults, so the background loader alone decides the order: had it swept
    // these chunks first, or ignored the working set, none would count as working set.
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    assert_eq!(stats.faults, 0, "{stats:?}");
    assert_eq!(stats.bytes_loaded_working_set, want, "{stats:?}");
    assert_eq!(stats.loaded_data_pages, stats.total_data_pages);
    assert_ram_eq(&ram, &expected);
}

#[test]
fn corrupt_data_fails_the_restore_instead_of_reaching_the_guest() {
    let dir = TempDir::new("lazycorrupt");
    let regions = two_regions(2 * MIB, 0, 2 * MIB);
    let (path, _) = snapshot_of(&dir, &regions, 5);
    let file_len = std::fs::metadata(&path).unwrap().len();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(b"garbage", file_len - 3 * PAGE).unwrap();
    }
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let restore = start_lazy_restore(chain, &mappings(&ram), LazyOptions::default()).unwrap();
    let err = restore.wait_timeout(Some(WAIT)).unwrap_err();
    assert!(err.to_string().contains("data CRC mismatch"), "{err}");
    assert!(restore.shutdown().is_err());
}

/// `write(2)` of `len` bytes of guest RAM at `addr` into a pipe: the kernel reads the
/// memory (faulting through userfaultfd like a vCPU's KVM access would) and reports a
/// fenced page as EFAULT instead of the SIGSEGV a plain load would raise.
fn read_with_syscall(addr: usize, len: usize) -> Result<usize, i32> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the kernel validates the source range; the pipe is ours.
    let n = unsafe { libc::write(fds[1], addr as *const libc::c_void, len) };
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    // SAFETY: closing the fds we opened.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    if n < 0 {
        Err(errno)
    } else {
        Ok(n as usize)
    }
}

#[test]
fn a_failed_loader_fences_guest_ram_and_wakes_the_waiting_thread() {
    let dir = TempDir::new("fence");
    let regions = two_regions(2 * MIB, 0, 2 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 6);
    // Data is stored in linear page order, so the file's last page is the last data page.
    let last_data = expected
        .chunks_exact(PAGE as usize)
        .rposition(|p| p.iter().any(|&b| b != 0))
        .unwrap() as u64;
    let first_data = expected
        .chunks_exact(PAGE as usize)
        .position(|p| p.iter().any(|&b| b != 0))
        .unwrap() as u64;
    assert_ne!(first_data, last_data);
    let file_len = std::fs::metadata(&path).unwrap().len();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(b"garbage", file_len - PAGE + 100).unwrap();
    }
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let opts = LazyOptions {
        background: false,
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    let good = page_ptr(&ram, first_data) as usize;
    let bad = page_ptr(&ram, last_data) as usize;
    // A good page loads.
    assert_eq!(read_with_syscall(good, PAGE as usize), Ok(PAGE as usize));
    // A thread reading the corrupt page waits on its fault; the loader fails on it and
    // must wake it with an error, not leave it waiting nor hand it zeros.
    let reader = std::thread::spawn(move || read_with_syscall(bad, PAGE as usize));
    let started = Instant::now();
    while !reader.is_finished() {
        assert!(
            started.elapsed() < WAIT,
            "the reader still waits on a fault nobody will serve"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(reader.join().unwrap(), Err(libc::EFAULT));
    let err = restore.wait_timeout(Some(Duration::ZERO)).unwrap_err();
    assert!(err.to_string().contains("data CRC mismatch"), "{err}");
    // Everything is fenced now, loaded pages too: no access reads anything.
    assert_eq!(read_with_syscall(good, 1), Err(libc::EFAULT));
    let untouched = page_ptr(&ram, (first_data + last_data) / 2) as usize;
    assert_eq!(read_with_syscall(untouched, 1), Err(libc::EFAULT));
    assert!(restore.shutdown().is_err());
}

#[test]
fn held_background_loaders_start_on_release() {
    let dir = TempDir::new("hold");
    let regions = two_regions(4 * MIB, 0, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 7);
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let opts = LazyOptions {
        hold_background: true,
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    // Faults are served while the loaders are held.
    let first_data = expected
        .chunks_exact(PAGE as usize)
        .position(|p| p.iter().any(|&b| b != 0))
        .unwrap() as u64;
    let want = &expected[(first_data * PAGE) as usize..][..PAGE as usize];
    assert!(read_page(&ram, first_data) == want);
    std::thread::sleep(Duration::from_millis(100));
    let held = restore.stats();
    assert_eq!(held.bytes_loaded_background, 0, "{held:?}");
    assert!(held.faults >= 1 && !held.complete(), "{held:?}");
    restore.release_background();
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    assert!(stats.bytes_loaded_background > 0, "{stats:?}");
    assert_ram_eq(&ram, &expected);
}

#[test]
fn held_background_loaders_load_the_working_set_before_release() {
    let dir = TempDir::new("holdws");
    let regions = two_regions(4 * MIB, 0, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 8);
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let opts = LazyOptions {
        hold_background: true,
        chunk_bytes: 1 << 20,
        // The second MiB of the second region.
        working_set: vec![5 * MIB],
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    let want = data_bytes(
        &expected[(1280 * PAGE) as usize..(1536 * PAGE) as usize],
        PAGE as usize,
    );
    let deadline = Instant::now() + WAIT;
    while restore.stats().bytes_loaded_working_set < want {
        assert!(
            Instant::now() < deadline,
            "working set not loaded while held"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Nothing else, until released.
    std::thread::sleep(Duration::from_millis(100));
    let held = restore.stats();
    assert_eq!(held.bytes_loaded_background, want, "{held:?}");
    assert!(!held.complete(), "{held:?}");
    restore.release_background();
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    assert_eq!(stats.faults, 0, "{stats:?}");
    assert_ram_eq(&ram, &expected);
}

#[test]
fn layout_mismatch_is_refused_before_registering() {
    let dir = TempDir::new("lazylayout");
    let (path, _) = snapshot_of(&dir, &two_regions(2 * MIB, 0, 2 * MIB), 6);
    let chain = Arc::new(SnapshotChain::open_with_file_layout(&[&path]).unwrap());
    let other = guest_ram(&two_regions(2 * MIB, 2 * MIB, 2 * MIB), Backing::Memfd);
    let err = start_lazy_restore(chain, &mappings(&other), LazyOptions::default()).unwrap_err();
    assert!(matches!(err, UffdError::Snapshot(_)), "{err}");
    // Nothing was registered: the fresh RAM is ordinary memory.
    assert!(read_page(&other, 0).iter().all(|&b| b == 0));
}

/// Grows the 2 MiB hugetlb pool and shrinks it back by the same amount when dropped.
struct HugePages {
    added: u64,
}

const NR_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
const FREE_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

fn read_counter(path: &str) -> Result<u64, String> {
    std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {path}: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("cannot parse {path}: {e}"))
}

impl HugePages {
    fn reserve(pages: u64) -> Result<HugePages, String> {
        let old = read_counter(NR_2M)?;
        std::fs::write(NR_2M, (old + pages).to_string())
            .map_err(|e| format!("cannot write {NR_2M}: {e}"))?;
        let guard = HugePages {
            added: read_counter(NR_2M)?.saturating_sub(old),
        };
        if guard.added < pages || read_counter(FREE_2M)? < pages {
            return Err(format!(
                "the kernel gave only {} of {pages} huge pages",
                guard.added
            ));
        }
        Ok(guard)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Ok(now) = read_counter(NR_2M) {
            if let Err(e) = std::fs::write(NR_2M, now.saturating_sub(self.added).to_string()) {
                eprintln!("could not give back {} huge pages: {e}", self.added);
            }
        }
    }
}

#[test]
fn hugetlb_2m_lazy_restore_of_full_and_diff() {
    let _pool = crate::backing::tests::HUGETLB_POOL
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let regions = two_regions(16 * MIB, 16 * MIB, 8 * MIB);
    let size = 24 * MIB;
    let _pages = match HugePages::reserve(2 * size / (2 * MIB)) {
        Ok(g) => g,
        Err(why) => {
            eprintln!("skipped hugetlb_2m_lazy_restore_of_full_and_diff: {why}");
            return;
        }
    };
    let dir = TempDir::new("huge");
    let src = guest_ram(&regions, Backing::Hugetlb2M);
    let huge = 2 * MIB;
    let mut rng = Rng::new(7);
    let mut expected = fill_ram(&src, &mut rng, |p| match p % 4 {
        0 => PageFill::Random,
        1 => PageFill::LastByte,
        2 => PageFill::ZeroedAgain,
        _ => PageFill::Untouched,
    });
    let (base, diff) = (dir.path().join("base"), dir.path().join("diff"));
    let stats = write_full(&base, &mappings(&src), &WriteOptions::default()).unwrap();
    assert_eq!(stats.info.page_size, huge);
    assert_eq!(stats.data_pages, 6, "6 of 12 huge pages are non-zero");
    // The dirty log has 4 KiB granularity; one bit dirties its whole huge page.
    let mut bitmaps: Vec<Vec<u64>> = regions
        .iter()
        .map(|r| vec![0u64; (r.size / PAGE / 64) as usize])
        .collect();
    for linear in [0u64, 3, 5] {
        let page = &mut expected[(linear * huge) as usize..][..huge as usize];
        if linear == 0 {
            page.fill(0);
        } else {
            rng.fill(page);
        }
        write_page(&src, linear, page);
        let bit = linear * 512 + 77;
        bitmaps[0][(bit / 64) as usize] |= 1 << (bit % 64);
    }
    let refs: Vec<&[u64]> = bitmaps.iter().map(|b| b.as_slice()).collect();
    let d = write_diff(
        &diff,
        &mappings(&src),
        &refs,
        &stats.info,
        &WriteOptions::default(),
    )
    .unwrap();
    assert_eq!((d.data_pages, d.zero_pages), (2, 1));
    drop(src);

    let ram = guest_ram(&regions, Backing::Hugetlb2M);
    let chain = open_chain(&[&base, &diff], &ram);
    let restore = start_lazy_restore(chain, &mappings(&ram), LazyOptions::default()).unwrap();
    read_randomly(&ram, &expected, 3, 40);
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    assert_eq!(stats.loaded_data_pages, stats.total_data_pages);
    assert_ram_eq(&ram, &expected);
    drop(restore);
    drop(ram);

    // Eager restore into huge pages goes through the mapping (hugetlbfs has no write()).
    let ram = guest_ram(&regions, Backing::Hugetlb2M);
    let chain = open_chain(&[&base, &diff], &ram);
    crate::snapshot::restore_eager(&chain, &mappings(&ram), &Default::default()).unwrap();
    assert_ram_eq(&ram, &expected);
}

/// Environment for [`external_handler_child`]: socket path, memory file, and whether to
/// load in the background.
const HANDLER_SOCKET_ENV: &str = "GPUVM_UFFD_HANDLER_SOCKET";
const HANDLER_FILE_ENV: &str = "GPUVM_UFFD_HANDLER_FILE";

/// The page-fault handler process of `external_handshake_round_trip`: listens, receives
/// the handshake, serves faults from the memory file on demand, reports and exits when
/// the VMM side hangs up. Does nothing when run directly.
#[test]
#[ignore = "helper process run by external_handshake_round_trip"]
fn external_handler_child() {
    let (Ok(socket), Ok(file)) = (
        std::env::var(HANDLER_SOCKET_ENV),
        std::env::var(HANDLER_FILE_ENV),
    ) else {
        return;
    };
    let listener = UnixListener::bind(&socket).unwrap();
    let handler = ExternalHandler::accept(&listener).unwrap();
    println!("HANDLER-REGIONS {}", handler.regions().len());
    let chain = Arc::new(SnapshotChain::open_with_file_layout(&[&file]).unwrap());
    let opts = LazyOptions {
        background: false,
        ..LazyOptions::default()
    };
    let (restore, stream) = handler.serve(chain, opts).unwrap();
    let stats = restore.wait_timeout(Some(WAIT)).unwrap().expect("complete");
    println!(
        "HANDLER-DONE faults_served_data={} total={} pid={}",
        stats.faults_served_data,
        stats.total_data_pages,
        std::process::id()
    );
    // Wait for the VMM to hang up.
    let mut buf = [0u8; 1];
    let _ = std::io::Read::read(&mut &stream, &mut buf);
}

#[test]
fn external_handshake_round_trip() {
    let dir = TempDir::new("external");
    let regions = two_regions(4 * MIB, 4 * MIB, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 8);
    let socket = dir.path().join("uffd.sock");
    let mut child = KillOnDrop(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "uffd::tests::external_handler_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HANDLER_SOCKET_ENV, &socket)
            .env(HANDLER_FILE_ENV, &path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + WAIT;
    while !socket.exists() {
        assert!(Instant::now() < deadline, "the handler never listened");
        std::thread::sleep(Duration::from_millis(10));
    }

    let ram = guest_ram(&regions, Backing::Memfd);
    let uffd = register_guest_ram(&mappings(&ram)).unwrap();
    let stream = send_handshake(&socket, &mappings_for(&mappings(&ram)), &uffd).unwrap();
    // Every first touch is served by the other process.
    assert_ram_eq(&ram, &expected);

    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let done = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("HANDLER-DONE"))
        .expect("handler reported completion");
    let data_pages = data_bytes(&expected, PAGE as usize) / PAGE;
    assert!(
        done.contains(&format!(
            "faults_served_data={data_pages} total={data_pages}"
        )),
        "{done}"
    );
    assert!(!done.contains(&format!("pid={}", std::process::id())));
    drop(stream);
    assert!(child.0.wait().unwrap().success());
}

#[test]
fn the_thread_start_hook_runs_on_every_lazy_restore_thread() {
    let dir = TempDir::new("hook");
    let regions = two_regions(4 * MIB, 4 * MIB, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 11);
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let names = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = names.clone();
    let opts = LazyOptions {
        loader_threads: 2,
        on_thread_start: Some(Arc::new(move || {
            let name = std::thread::current().name().unwrap_or("").to_string();
            seen.lock().unwrap().push(name);
            Ok(())
        })),
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    restore.wait_timeout(Some(WAIT)).unwrap().expect("done");
    assert_ram_eq(&ram, &expected);
    restore.shutdown().unwrap();
    let mut names = names.lock().unwrap().clone();
    names.sort();
    assert_eq!(names, ["uffd-faults", "uffd-loader-0", "uffd-loader-1"]);

    // A hook that fails fails the restore.
    let ram = guest_ram(&regions, Backing::Memfd);
    let chain = open_chain(&[&path], &ram);
    let opts = LazyOptions {
        on_thread_start: Some(Arc::new(|| Err(std::io::Error::other("no filter")))),
        ..LazyOptions::default()
    };
    let restore = start_lazy_restore(chain, &mappings(&ram), opts).unwrap();
    let error = restore.wait_timeout(Some(WAIT)).unwrap_err();
    assert!(error.to_string().contains("no filter"), "{error}");
}

#[test]
fn waiting_on_a_loader_that_makes_no_progress_gives_up() {
    let dir = TempDir::new("no-progress");
    let regions = two_regions(4 * MIB, 0, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 12);
    let ram = guest_ram(&regions, Backing::Memfd);
    // No background loader and nothing faulting: no page ever loads.
    let stuck = start_lazy_restore(
        open_chain(&[&path], &ram),
        &mappings(&ram),
        LazyOptions {
            background: false,
            ..LazyOptions::default()
        },
    )
    .unwrap();
    let started = Instant::now();
    let error = stuck
        .wait_progressing(Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(error, UffdError::NoProgress { .. }), "{error}");
    assert!(started.elapsed() < WAIT, "{:?}", started.elapsed());
    drop(stuck);
    // A loader that loads completes the wait.
    let ram = guest_ram(&regions, Backing::Memfd);
    let restore = start_lazy_restore(
        open_chain(&[&path], &ram),
        &mappings(&ram),
        LazyOptions::default(),
    )
    .unwrap();
    let stats = restore.wait_progressing(WAIT).unwrap();
    assert!(stats.complete(), "{stats:?}");
    assert_ram_eq(&ram, &expected);
}

/// `HandlerWatch::fault_in` with a handler that serves nothing gives up after the limit
/// (its fault-in thread stays waiting); once the handler serves, the next call completes
/// and guest RAM holds the snapshot. The "handler" is a loader in this process on a
/// duplicate of the userfaultfd the watch holds.
#[test]
fn faulting_in_from_a_stalled_handler_gives_up_and_completes_once_it_serves() {
    use std::os::unix::io::{AsRawFd, FromRawFd};
    let dir = TempDir::new("fault-in");
    let regions = two_regions(4 * MIB, 4 * MIB, 4 * MIB);
    let (path, expected) = snapshot_of(&dir, &regions, 13);
    let ram = guest_ram(&regions, Backing::Memfd);
    let uffd = register_guest_ram(&mappings(&ram)).unwrap();
    // SAFETY: dup of a valid fd; the new fd is owned by the Uffd made from it.
    let served = unsafe { userfaultfd::Uffd::from_raw_fd(libc::dup(uffd.as_raw_fd())) };
    let (connection, _handler_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let watch =
        external::HandlerWatch::start(connection, uffd, guest_ram_ranges(&mappings(&ram)), None)
            .unwrap();
    for _ in 0..2 {
        let started = Instant::now();
        let error = watch.fault_in(Duration::from_millis(300)).unwrap_err();
        assert!(matches!(error, UffdError::NoProgress { .. }), "{error}");
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(started.elapsed() < WAIT, "{:?}", started.elapsed());
    }
    let handler = LazyRestore::start(
        open_chain(&[&path], &ram),
        &mappings(&ram).host_addrs(),
        served,
        LazyOptions {
            background: false,
            ..LazyOptions::default()
        },
    )
    .unwrap();
    watch.fault_in(WAIT).unwrap();
    assert!(handler.stats().faults > 0);
    assert_ram_eq(&ram, &expected);
    assert!(watch.failure().is_none());
}
