//! Populating all guest RAM before boot, with several threads.
//!
//! Faulting pages in up front moves the allocation cost out of the guest's first touch
//! (where every fault is a VM exit) and makes it parallel. Call it before any vCPU runs:
//! the fallback path rewrites each page's first byte with its own value.

use std::io;
use std::time::{Duration, Instant};

use log::{debug, info};

use crate::backing::{host_base_page_size, ByteSize};
use crate::GuestRam;

/// What a prefault run did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefaultStats {
    /// Guest RAM bytes populated.
    pub bytes: u64,
    /// Threads that did the work (at most the number asked for).
    pub threads: usize,
    pub elapsed: Duration,
}

/// Errors from [`prefault`].
#[derive(Debug, thiserror::Error)]
pub enum PrefaultError {
    #[error("prefaulting needs at least one thread")]
    ZeroThreads,
    #[error("cannot start a prefault thread: {0}")]
    Spawn(io::Error),
    #[error("cannot populate guest RAM at host address {addr:#x} (+{len:#x} bytes): {source}")]
    Populate {
        addr: usize,
        len: usize,
        source: io::Error,
    },
    #[error("a prefault thread panicked")]
    ThreadPanicked,
    #[error("cannot prefault: {0}")]
    TooLarge(crate::RamError),
}

/// How pages get populated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// One `MADV_POPULATE_WRITE` per range (Linux 5.14+), falling back to `Touch`.
    Madvise,
    /// A volatile write of each page's first byte, back to itself.
    Touch,
}

/// A host virtual address range inside a guest RAM mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    addr: usize,
    len: usize,
}

/// Populates (allocates and maps writable) all of `ram` using up to `threads` threads.
pub fn prefault(ram: &GuestRam, threads: usize) -> Result<PrefaultStats, PrefaultError> {
    prefault_with(ram, threads, Method::Madvise)
}

fn prefault_with(
    ram: &GuestRam,
    threads: usize,
    method: Method,
) -> Result<PrefaultStats, PrefaultError> {
    if threads == 0 {
        return Err(PrefaultError::ZeroThreads);
    }
    // Sparse guests may be larger than host RAM; populating one would exhaust the host.
    crate::backing::check_fits_host(ram.size(), false).map_err(PrefaultError::TooLarge)?;
    let start = Instant::now();
    let spans: Vec<Span> = ram
        .host_regions()
        .map(|(region, host)| Span {
            addr: host as usize,
            len: region.size as usize,
        })
        .collect();
    let page = ram.page_size() as usize;
    let plan = split_spans(&spans, threads, page);
    debug!(
        "prefaulting {} in {} chunk(s) of {} page(s)",
        ByteSize(ram.size()),
        plan.len(),
        ByteSize(ram.page_size())
    );

    std::thread::scope(|scope| {
        let mut workers = Vec::with_capacity(plan.len());
        for (index, work) in plan.iter().enumerate() {
            let worker = std::thread::Builder::new()
                .name(format!("prefault-{index}"))
                .spawn_scoped(scope, move || {
                    work.iter()
                        .try_for_each(|span| populate(*span, page, method))
                })
                .map_err(PrefaultError::Spawn)?;
            workers.push(worker);
        }
        workers
            .into_iter()
            .try_for_each(|worker| worker.join().map_err(|_| PrefaultError::ThreadPanicked)?)
    })?;

    let stats = PrefaultStats {
        bytes: ram.size(),
        threads: plan.len(),
        elapsed: start.elapsed(),
    };
    info!(
        "prefaulted {} of guest RAM with {} thread(s) in {:.1?} ({:.2} GiB/s)",
        ByteSize(stats.bytes),
        stats.threads,
        stats.elapsed,
        stats.bytes as f64 / (1u64 << 30) as f64 / stats.elapsed.as_secs_f64().max(1e-9)
    );
    Ok(stats)
}

/// Splits `spans` into at most `parts` contiguous shares of nearly equal size, cutting
/// only at multiples of `page` (span boundaries are page-aligned already).
fn split_spans(spans: &[Span], parts: usize, page: usize) -> Vec<Vec<Span>> {
    let total: usize = spans.iter().map(|s| s.len).sum();
    let pages = total.div_ceil(page);
    let share = pages.div_ceil(parts.max(1)).max(1) * page;

    let mut plan: Vec<Vec<Span>> = Vec::new();
    let mut current: Vec<Span> = Vec::new();
    let mut room = share;
    for span in spans {
        let mut span = *span;
        while span.len > 0 {
            let take = span.len.min(room);
            current.push(Span {
                addr: span.addr,
                len: take,
            });
            span.addr += take;
            span.len -= take;
            room -= take;
            if room == 0 {
                plan.push(std::mem::take(&mut current));
                room = share;
            }
        }
    }
    if !current.is_empty() {
        plan.push(current);
    }
    plan
}

fn populate(span: Span, page: usize, method: Method) -> Result<(), PrefaultError> {
    if method == Method::Madvise {
        match madvise_populate_write(span) {
            Ok(()) => return Ok(()),
            // EINVAL: a kernel older than 5.14 that does not know the advice.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                debug!("MADV_POPULATE_WRITE unsupported ({e}); touching pages instead");
                return populate(span, page, Method::Touch);
            }
            Err(source) => {
                return Err(PrefaultError::Populate {
                    addr: span.addr,
                    len: span.len,
                    source,
                })
            }
        }
    }
    touch_pages(span, page.max(host_base_page_size()));
    Ok(())
}

fn madvise_populate_write(span: Span) -> io::Result<()> {
    loop {
        // SAFETY: the span lies inside a live guest RAM mapping; populating only faults
        // pages in and never changes their contents.
        let ret = unsafe {
            libc::madvise(
                span.addr as *mut libc::c_void,
                span.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if ret == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

fn touch_pages(span: Span, step: usize) {
    for offset in (0..span.len).step_by(step) {
        let byte = (span.addr + offset) as *mut u8;
        // SAFETY: `byte` is inside a live, writable guest RAM mapping. Writing back the
        // value just read leaves guest memory unchanged (no vCPU runs yet), and volatile
        // access keeps the compiler from dropping the seemingly useless store.
        unsafe { byte.write_volatile(byte.read_volatile()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::tests::two_regions;
    use crate::GuestRamConfig;
    use vm_memory::{Bytes, GuestAddress};

    const MIB: u64 = 1 << 20;

    fn span(addr: usize, len: usize) -> Span {
        Span { addr, len }
    }

    #[test]
    fn spans_split_evenly_at_page_boundaries() {
        let spans = [span(0x10000, 3 * 4096), span(0x40000, 5 * 4096)];
        let plan = split_spans(&spans, 2, 4096);
        assert_eq!(
            plan,
            vec![
                vec![span(0x10000, 3 * 4096), span(0x40000, 4096)],
                vec![span(0x41000, 4 * 4096)],
            ]
        );
        // More threads than pages: one page each, never an empty share.
        let plan = split_spans(&[span(0, 2 * 4096)], 8, 4096);
        assert_eq!(plan, vec![vec![span(0, 4096)], vec![span(4096, 4096)]]);
        // Every byte is covered exactly once, whatever the thread count.
        for parts in 1..10 {
            let plan = split_spans(&spans, parts, 4096);
            assert!(plan.len() <= parts);
            let covered: usize = plan.iter().flatten().map(|s| s.len).sum();
            assert_eq!(covered, 8 * 4096);
            assert!(plan.iter().flatten().all(|s| s.len % 4096 == 0));
        }
    }

    fn check_prefault(method: Method) {
        let regions = two_regions(6 * MIB, 2 * MIB, 10 * MIB);
        // 4 KiB pages (no huge tmpfs), so one write makes exactly one page resident.
        let config = GuestRamConfig {
            thp: false,
            ..GuestRamConfig::new(16 * MIB)
        };
        let ram = GuestRam::create(&config, &regions).unwrap();
        let marker = GuestAddress(regions[1].guest_addr + 5 * 4096);
        ram.memory().write_slice(b"keep", marker).unwrap();
        assert_eq!(ram.resident_bytes().unwrap(), 4096);

        let stats = prefault_with(&ram, 3, method).unwrap();
        assert_eq!(stats.bytes, 16 * MIB);
        assert_eq!(stats.threads, 3);
        assert_eq!(ram.resident_bytes().unwrap(), ram.size());
        let mut buf = [0u8; 4];
        ram.memory().read_slice(&mut buf, marker).unwrap();
        assert_eq!(&buf, b"keep");
    }

    #[test]
    fn prefault_makes_all_ram_resident() {
        check_prefault(Method::Madvise);
    }

    #[test]
    fn touch_fallback_makes_all_ram_resident_and_keeps_data() {
        check_prefault(Method::Touch);
    }

    #[test]
    fn zero_threads_is_an_error() {
        let ram =
            GuestRam::create(&GuestRamConfig::new(MIB), &two_regions(MIB, 0, 0)[..1]).unwrap();
        assert!(matches!(prefault(&ram, 0), Err(PrefaultError::ZeroThreads)));
        assert_eq!(ram.resident_bytes().unwrap(), 0);
    }
}
