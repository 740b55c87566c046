//! Micro benchmarks (ignored by default). Run with
//! `cargo test --release -p gpuvm-memory --lib bench_ -- --ignored --nocapture --test-threads=1`.
//!
//! For 256 MiB and 2 GiB of guest RAM, half the pages random and half zero, prints:
//! scan+write throughput (with and without page CRCs), a plain sequential read of the
//! file (dd-like, cold and warm page cache), eager restore, lazy-restore fault latency
//! (on-demand only, and with the background loader running) and background load bandwidth.

use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::test_util::*;
use super::*;
use crate::uffd::{start_lazy_restore, LazyOptions};
use crate::{Backing, GuestRam};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

fn gbps(bytes: u64, d: Duration) -> String {
    format!("{:.2} GB/s", bytes as f64 / d.as_secs_f64() / 1e9)
}

/// Evicts `path` from the page cache (it was fsynced, so its pages are clean).
fn drop_cache(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: plain syscall on an fd we own.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// dd-like: read the whole file front to back in 4 MiB reads.
fn sequential_read(path: &Path) -> (u64, Duration) {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    let mut buf = vec![0u8; 4 << 20];
    let start = Instant::now();
    let mut off = 0;
    while off < len {
        let n = f.read_at(&mut buf, off).unwrap();
        assert!(n > 0);
        off += n as u64;
    }
    (len, start.elapsed())
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Touches distinct random pages (each a first touch) from `threads` threads until
/// `stop`, timing each touch: the vCPU's view of a fault, kernel round trip included.
fn touch_until(
    ram: &GuestRam,
    threads: u64,
    stop: &AtomicBool,
    max_touches: usize,
) -> Vec<Duration> {
    let pages = total_pages(ram);
    let mut order: Vec<u64> = (0..pages).collect();
    let mut rng = Rng::new(1000);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let order = &order;
    let mut all = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut samples = Vec::new();
                    for &page in order.iter().skip(t as usize).step_by(threads as usize) {
                        if stop.load(Ordering::Relaxed) || samples.len() >= max_touches {
                            break;
                        }
                        let p = page_ptr(ram, page);
                        let start = Instant::now();
                        // SAFETY: the page is inside `ram`'s live mapping.
                        unsafe { std::ptr::read_volatile(p) };
                        samples.push(start.elapsed());
                    }
                    samples
                })
            })
            .collect();
        for h in handles {
            all.extend(h.join().unwrap());
        }
    });
    all.sort();
    all
}

/// How guest RAM is filled.
#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// A random half of the 4 KiB pages hold data (worst case: runs of ~2 pages).
    Scattered,
    /// Data in 2 MiB runs alternating with 2 MiB of zeros (closer to a real guest).
    Runs,
}

fn bench(size: u64, pattern: Pattern) {
    println!(
        "\n=== guest RAM {} MiB, {pattern:?}: half the pages random, half zero ===",
        size / MIB
    );
    let dir = TempDir::new("bench");
    let regions = two_regions(size / 2, 0, size / 2);
    let src = guest_ram(&regions, Backing::Memfd);
    let mut rng = Rng::new(42);
    let fill = Instant::now();
    fill_ram(&src, &mut rng, |p| {
        let data = match pattern {
            Pattern::Scattered => p.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 63 == 0,
            Pattern::Runs => (p / 512) % 2 == 0,
        };
        if data {
            PageFill::Random
        } else {
            PageFill::Untouched
        }
    });
    println!("(fill {:?})", fill.elapsed());
    let ram_map = RamMappings::from_guest_ram(&src).unwrap();
    let path = dir.path().join("mem");

    for crcs in [false, true] {
        let opts = WriteOptions {
            page_crcs: crcs,
            ..WriteOptions::default()
        };
        let s = write_full(&path, &ram_map, &opts).unwrap();
        let total = s.scan_time + s.write_time;
        println!(
            "write_full (page CRCs {}): {} data pages ({} MiB), scan {:?} ({} of RAM), write+fsync {:?} ({}), total {} of RAM",
            if crcs { "on " } else { "off" },
            s.data_pages,
            s.data_pages * PAGE / MIB,
            s.scan_time,
            gbps(size, s.scan_time),
            s.write_time,
            gbps(s.file_len, s.write_time),
            gbps(size, total),
        );
    }
    let file_len = std::fs::metadata(&path).unwrap().len();
    drop(ram_map);
    drop(src);

    drop_cache(&path);
    let (len, cold) = sequential_read(&path);
    let (_, warm) = sequential_read(&path);
    println!(
        "sequential read of the {} MiB file (dd-like, 4 MiB reads): cold {:?} ({}), warm {:?} ({})",
        file_len / MIB,
        cold,
        gbps(len, cold),
        warm,
        gbps(len, warm)
    );

    let layout = RamMappings::from_guest_ram(&guest_ram(&regions, Backing::Memfd))
        .unwrap()
        .layout()
        .clone();
    let chain = Arc::new(SnapshotChain::open(&[&path], &layout).unwrap());
    let data_bytes = chain.data_pages() * PAGE;

    for (threads, verify, cold) in [
        (1, false, true),
        (2, false, true),
        (2, true, true),
        (2, false, false),
        (2, true, false),
    ] {
        if cold {
            drop_cache(&path);
        }
        let ram = guest_ram(&regions, Backing::Memfd);
        let opts = EagerOptions {
            verify_data: verify,
            threads,
            ..EagerOptions::default()
        };
        let r = restore_eager(&chain, &RamMappings::from_guest_ram(&ram).unwrap(), &opts).unwrap();
        println!(
            "eager restore ({} cache, {threads} threads, CRC check {}): {:?} ({})",
            if cold { "cold" } else { "warm" },
            if verify { "on " } else { "off" },
            r.elapsed,
            gbps(r.bytes, r.elapsed)
        );
    }

    // Pure on-demand: fault latency without a background loader competing.
    {
        let ram = guest_ram(&regions, Backing::Memfd);
        let opts = LazyOptions {
            background: false,
            ..LazyOptions::default()
        };
        drop_cache(&path);
        let restore = start_lazy_restore(
            chain.clone(),
            &RamMappings::from_guest_ram(&ram).unwrap(),
            opts,
        )
        .unwrap();
        let stop = AtomicBool::new(false);
        let touches = touch_until(&ram, 1, &stop, 20_000);
        let st = restore.stats();
        println!(
            "lazy, on demand only (cold cache): {} faults ({} data, {} zero); handler service p50 {:?} p99 {:?}; first-touch latency seen by the faulting thread p50 {:?} p99 {:?}",
            st.faults,
            st.faults_served_data,
            st.faults_served_zero,
            st.fault_latency_p50.unwrap(),
            st.fault_latency_p99.unwrap(),
            percentile(&touches, 0.5),
            percentile(&touches, 0.99),
        );
        // Warm cache: the same pages again in a fresh RAM.
        drop(restore);
        let ram = guest_ram(&regions, Backing::Memfd);
        let opts = LazyOptions {
            background: false,
            ..LazyOptions::default()
        };
        let restore = start_lazy_restore(
            chain.clone(),
            &RamMappings::from_guest_ram(&ram).unwrap(),
            opts,
        )
        .unwrap();
        let touches = touch_until(&ram, 1, &stop, 20_000);
        let st = restore.stats();
        println!(
            "lazy, on demand only (warm cache): handler service p50 {:?} p99 {:?}; first touch p50 {:?} p99 {:?}",
            st.fault_latency_p50.unwrap(),
            st.fault_latency_p99.unwrap(),
            percentile(&touches, 0.5),
            percentile(&touches, 0.99),
        );
    }

    // Background loader alone: time until everything is resident.
    for (chunk, cold, loader_threads) in [
        (1 << 20, true, 1),
        (4 << 20, true, 1),
        (16 << 20, true, 1),
        (4 << 20, true, 2),
        (4 << 20, false, 1),
        (4 << 20, false, 2),
    ] {
        if cold {
            drop_cache(&path);
        }
        let ram = guest_ram(&regions, Backing::Memfd);
        let opts = LazyOptions {
            chunk_bytes: chunk,
            loader_threads,
            ..LazyOptions::default()
        };
        let restore = start_lazy_restore(
            chain.clone(),
            &RamMappings::from_guest_ram(&ram).unwrap(),
            opts,
        )
        .unwrap();
        let st = restore.wait().unwrap();
        let t = st.time_to_complete.unwrap();
        println!(
            "lazy, background only, {} MiB chunks, {loader_threads} loader thread(s) ({} cache): all {} MiB resident after {:?} ({})",
            chunk >> 20,
            if cold { "cold" } else { "warm" },
            data_bytes / MIB,
            t,
            gbps(data_bytes, t)
        );
    }

    // Background loader with a faulting "guest" running.
    {
        drop_cache(&path);
        let ram = guest_ram(&regions, Backing::Memfd);
        let restore = start_lazy_restore(
            chain.clone(),
            &RamMappings::from_guest_ram(&ram).unwrap(),
            LazyOptions::default(),
        )
        .unwrap();
        let stop = AtomicBool::new(false);
        let touches = std::thread::scope(|s| {
            let toucher = s.spawn(|| touch_until(&ram, 1, &stop, usize::MAX));
            restore.wait().unwrap();
            stop.store(true, Ordering::Relaxed);
            toucher.join().unwrap()
        });
        let st = restore.stats();
        let t = st.time_to_complete.unwrap();
        println!(
            "lazy, background + 1 faulting thread (cold cache): complete after {:?} ({}); {} faults ({} already loaded), handler p50 {:?} p99 {:?}; touch latency p50 {:?} p99 {:?} over {} touches; {} MiB by faults, {} MiB in background, {} EEXIST races",
            t,
            gbps(data_bytes, t),
            st.faults,
            st.faults_already_loaded,
            st.fault_latency_p50.unwrap_or_default(),
            st.fault_latency_p99.unwrap_or_default(),
            percentile(&touches, 0.5),
            percentile(&touches, 0.99),
            touches.len(),
            st.bytes_loaded_by_faults / MIB,
            st.bytes_loaded_background / MIB,
            st.copy_races,
        );
        assert_eq!(st.loaded_data_pages, st.total_data_pages);
    }
}

#[test]
#[ignore = "benchmark"]
fn bench_256m() {
    bench(256 * MIB, Pattern::Scattered);
    bench(256 * MIB, Pattern::Runs);
}

#[test]
#[ignore = "benchmark"]
fn bench_2g() {
    bench(2048 * MIB, Pattern::Scattered);
    bench(2048 * MIB, Pattern::Runs);
}
