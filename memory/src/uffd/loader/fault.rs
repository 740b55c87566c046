//! The fault-serving thread: polls the userfaultfd and resolves each fault with its one
//! page (data from the snapshot, or a zero page for a hole), then puts the page's chunk
//! first in the background queue.

use std::os::unix::io::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use log::{debug, warn};
use userfaultfd::{Event, EventBuffer};

use super::Shared;
use crate::uffd::ops::{self, AlignedBuf, BASE_PAGE_SIZE};
use crate::uffd::{io_err, lock, UffdError};

/// Fault-serving thread: poll the userfaultfd, resolve each fault with its one page.
pub(super) fn fault_thread(shared: &Shared) -> Result<(), UffdError> {
    let page_size = shared.page_size as usize;
    let mut page_buf = AlignedBuf::new(page_size).map_err(io_err("map the fault buffer"))?;
    // hugetlb has no UFFDIO_ZEROPAGE: holes get a copy of a zeroed huge page.
    let zero_buf = if shared.page_size != BASE_PAGE_SIZE {
        Some(AlignedBuf::new(page_size).map_err(io_err("map the zero page"))?)
    } else {
        None
    };
    let mut events = EventBuffer::new(64);
    let mut pending = Vec::with_capacity(64);
    let mut fds = [
        libc::pollfd {
            fd: shared.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: shared.stop_event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        ops::poll_until_ready(&mut fds).map_err(io_err("poll the userfaultfd"))?;
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            return Err(UffdError::Io {
                op: "poll the userfaultfd",
                source: std::io::Error::other("userfaultfd reported an error or hang-up"),
            });
        }
        pending.clear();
        for event in shared
            .uffd
            .read_events(&mut events)
            .map_err(UffdError::ReadEvents)?
        {
            match event.map_err(UffdError::ReadEvents)? {
                Event::Pagefault { addr, .. } => pending.push(addr as u64),
                other => debug!("ignoring userfaultfd event {other:?}"),
            }
        }
        let read_at = Instant::now();
        for &addr in &pending {
            serve_fault(shared, addr, &mut page_buf, zero_buf.as_ref())?;
            let ns = read_at.elapsed().as_nanos() as u64;
            let mut latencies = lock(&shared.latencies_ns);
            if latencies.len() < shared.opts.max_latency_samples {
                latencies.push(ns);
            }
        }
    }
}

fn serve_fault(
    shared: &Shared,
    addr: u64,
    page_buf: &mut AlignedBuf,
    zero_buf: Option<&AlignedBuf>,
) -> Result<(), UffdError> {
    let c = &shared.counters;
    c.faults.fetch_add(1, Ordering::Relaxed);
    let page_addr = addr & !(shared.page_size - 1);
    let Some(linear) = shared.locate(page_addr) else {
        warn!("userfaultfd fault at {addr:#x} outside guest RAM; ignored");
        return Ok(());
    };
    let page_size = shared.page_size as usize;
    if shared.loaded.get(linear) {
        // The background thread got there first and woke the vCPU; waking again is
        // harmless and covers pages populated some other way.
        c.faults_already_loaded.fetch_add(1, Ordering::Relaxed);
        return ops::wake(&shared.uffd, page_addr, page_size);
    }
    {
        let mut order = lock(&shared.fault_order);
        if order.len() < shared.opts.max_recorded_faults {
            order.push(shared.chain.layout().linear_to_gpa(linear));
        }
    }
    let result = match shared.run_of(linear) {
        Some(run) => {
            let layer = &shared.chain.layers()[run.layer];
            let offset = run.file_offset + (linear - run.start) * shared.page_size;
            layer.read_data(offset, page_buf.as_mut_slice())?;
            if shared.opts.verify_data {
                shared.chain.check_page(run, linear, page_buf.as_slice())?;
            }
            // SAFETY: page_buf holds page_size readable bytes.
            let filled = unsafe {
                ops::copy(
                    &shared.uffd,
                    page_buf.as_ptr(),
                    page_addr,
                    page_size,
                    page_size,
                )
            };
            c.faults_data.fetch_add(1, Ordering::Relaxed);
            filled.map(|f| (f, true))
        }
        None => {
            c.faults_zero.fetch_add(1, Ordering::Relaxed);
            let filled = match zero_buf {
                // SAFETY: zero_buf holds page_size readable bytes.
                Some(zeros) => unsafe {
                    ops::copy(
                        &shared.uffd,
                        zeros.as_ptr(),
                        page_addr,
                        page_size,
                        page_size,
                    )
                },
                None => ops::zeropage(&shared.uffd, page_addr, page_size, page_size),
            };
            filled.map(|f| (f, false))
        }
    };
    match result {
        Ok((filled, data)) => {
            shared.note_fill(filled);
            if data && filled.existed == 0 {
                c.bytes_by_faults
                    .fetch_add(page_size as u64, Ordering::Relaxed);
            }
            shared.mark_loaded(linear, linear + 1, data);
        }
        // After completion the ranges are unregistered; a fault read just before that
        // was already woken by the unregister and retried as a normal fault.
        Err(e) if shared.is_done() => debug!("late fault at {page_addr:#x}: {e}"),
        Err(e) => return Err(e),
    }
    if shared.opts.background {
        shared.prioritise((linear / shared.chunk_pages) as usize);
    }
    Ok(())
}
