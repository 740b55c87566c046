//! `gpuvm-test-fc-uffd-handler`: a page-fault handler that speaks Firecracker's example
//! UFFD handler protocol (Firecracker's `src/firecracker/examples/uffd/`) and nothing of
//! gpuvm's: it proves that an unmodified Firecracker handler serves a gpuvm restore from
//! the raw memory file gpuvm's Firecracker API writes.
//!
//! Usage: `gpuvm-test-fc-uffd-handler SOCKET MEMORY_FILE` (positional, as Firecracker's
//! example takes them).
//!
//! The protocol, as the example follows it:
//! 1. open the memory file, bind a Unix listener on SOCKET and accept one connection;
//! 2. map the whole memory file read-only (private, populated);
//! 3. receive one message: a JSON array of regions
//!    `{base_host_virt_addr, size, offset, page_size}` with the userfaultfd attached
//!    (SCM_RIGHTS), retrying a few times if no descriptor came;
//! 4. check that the regions' sizes add up to the memory file's size (the example asserts
//!    this: the file is a flat image of all of guest RAM);
//! 5. serve each page fault with UFFDIO_COPY of one page from file offset
//!    `region.offset + (fault page - region.base_host_virt_addr)`, treating EEXIST as
//!    served and EAGAIN (a `remove` event pending) as "try again after the next read";
//! 6. a `remove` event unregisters its range.
//!
//! Prints `fc-uffd-handler: listening` once the socket accepts connections (for the tests
//! to wait on) and `fc-uffd-handler: served N faults` when the VMM hangs up. Exit status 0
//! after the hang-up, 1 on any failure (where the example panics).

use std::fs::File;
use std::os::unix::io::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::ExitCode;
use std::time::Duration;

use serde::Deserialize;
use userfaultfd::{Event, Uffd};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// One guest memory region as the VMM describes it (Firecracker's
/// `GuestRegionUffdMapping`); other fields (gpuvm adds `page_size_kib`) are ignored.
#[derive(Debug, Deserialize)]
struct Region {
    base_host_virt_addr: u64,
    size: u64,
    offset: u64,
    page_size: u64,
}

impl Region {
    fn contains(&self, page: u64) -> bool {
        page >= self.base_host_virt_addr && page - self.base_host_virt_addr < self.size
    }
}

/// The memory file mapped read-only.
struct Backing {
    addr: *const u8,
    len: u64,
}

impl Backing {
    fn map(file: &File) -> Result<Backing, String> {
        let len = file
            .metadata()
            .map_err(|e| format!("cannot stat the memory file: {e}"))?
            .len();
        if len == 0 {
            return Err("the memory file is empty".into());
        }
        let map_len = usize::try_from(len).map_err(|_| "the memory file is too large")?;
        // SAFETY: a fresh private read-only mapping of a file we hold open; nothing else
        // is mapped at the address the kernel picks.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!(
                "cannot map the memory file: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Backing {
            addr: addr.cast(),
            len,
        })
    }
}

/// The handshake: the JSON region list and the userfaultfd, with the example's retries.
fn receive_handshake(stream: &UnixStream) -> Result<(Vec<Region>, File), String> {
    for _ in 0..5 {
        let mut message = vec![0u8; 1024];
        match stream.recv_with_fd(&mut message) {
            Ok((len, Some(file))) => {
                let regions: Vec<Region> = serde_json::from_slice(&message[..len])
                    .map_err(|e| format!("cannot parse the region list: {e}"))?;
                return Ok((regions, file));
            }
            Ok((len, None)) => eprintln!(
                "fc-uffd-handler: no userfaultfd with {:?}; retrying",
                String::from_utf8_lossy(&message[..len])
            ),
            Err(e) => eprintln!("fc-uffd-handler: cannot receive the handshake: {e}; retrying"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err("no userfaultfd after 5 tries".into())
}

/// Copies the page holding `addr` from the backing file. `Ok(false)`: not now (EAGAIN,
/// a `remove` event is pending); the fault is retried after the next read.
fn serve_fault(
    uffd: &Uffd,
    regions: &[Region],
    backing: &Backing,
    page_size: u64,
    addr: u64,
) -> Result<bool, String> {
    let page = addr & !(page_size - 1);
    let region = regions
        .iter()
        .find(|r| r.contains(page))
        .ok_or_else(|| format!("fault at {addr:#x} outside every region"))?;
    let source = region.offset + (page - region.base_host_virt_addr);
    if source + page_size > backing.len {
        return Err(format!("fault at {addr:#x} maps past the memory file"));
    }
    // SAFETY: the source page lies inside the live read-only mapping of the memory file
    // (checked above); the destination is a registered page of the VMM's guest RAM that
    // the kernel reported missing, and UFFDIO_COPY writes only that page.
    let copied = unsafe {
        uffd.copy(
            backing.addr.add(source as usize).cast(),
            page as *mut libc::c_void,
            page_size as usize,
            true,
        )
    };
    match copied {
        Ok(n) if n > 0 => Ok(true),
        Ok(_) => Err(format!("UFFDIO_COPY at {page:#x} copied nothing")),
        // `copy` reports -errno through the byte count: EAGAIN while a remove is pending.
        Err(userfaultfd::Error::PartiallyCopied(n)) if n == 0 || n == (-libc::EAGAIN) as usize => {
            Ok(false)
        }
        Err(userfaultfd::Error::CopyFailed(errno)) if errno as i32 == libc::EEXIST => Ok(true),
        Err(e) => Err(format!("UFFDIO_COPY at {page:#x}: {e}")),
    }
}

fn run() -> Result<u64, String> {
    let mut args = std::env::args_os().skip(1);
    let (Some(socket), Some(memory), None) = (args.next(), args.next(), args.next()) else {
        return Err(format!(
            "usage: {} SOCKET MEMORY_FILE",
            env!("CARGO_BIN_NAME")
        ));
    };
    let file = File::open(&memory).map_err(|e| format!("cannot open the memory file: {e}"))?;
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(|e| format!("cannot listen: {e}"))?;
    println!("fc-uffd-handler: listening");
    let (stream, _) = listener
        .accept()
        .map_err(|e| format!("cannot accept: {e}"))?;
    let backing = Backing::map(&file)?;
    let (regions, uffd_file) = receive_handshake(&stream)?;
    let memory_size: u64 = regions.iter().map(|r| r.size).sum();
    if memory_size != backing.len {
        return Err(format!(
            "the regions hold {memory_size} bytes, the memory file {} (it must be a flat image of guest RAM)",
            backing.len
        ));
    }
    let page_size = regions.first().ok_or("the region list is empty")?.page_size;
    if !page_size.is_power_of_two() {
        return Err(format!("page size {page_size} is not a power of two"));
    }
    // SAFETY: the descriptor came with the handshake and is ours alone from here on.
    let uffd = unsafe { Uffd::from_raw_fd(uffd_file.into_raw_fd()) };

    let mut served = 0u64;
    let mut deferred: Vec<Event> = Vec::new();
    loop {
        let mut fds = [
            libc::pollfd {
                fd: stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds for the duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("poll: {error}"));
        }
        if fds[0].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLIN) != 0 {
            // The VMM sends nothing after the handshake: readable means it hung up.
            let mut byte = [0u8; 1];
            // SAFETY: reads at most one byte into `byte`, without blocking.
            let n = unsafe {
                libc::recv(
                    stream.as_raw_fd(),
                    byte.as_mut_ptr().cast(),
                    1,
                    libc::MSG_DONTWAIT,
                )
            };
            if n == 0 || fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0 {
                return Ok(served);
            }
        }
        if fds[1].revents & libc::POLLIN == 0 {
            continue;
        }
        // Like the example: read every pending event first (a pending remove blocks every
        // copy with EAGAIN), then handle them, deferring faults that got EAGAIN.
        loop {
            let mut events: Vec<Event> = std::mem::take(&mut deferred);
            while let Some(event) = uffd
                .read_event()
                .map_err(|e| format!("cannot read a userfaultfd event: {e}"))?
            {
                events.push(event);
            }
            for event in events {
                match event {
                    Event::Pagefault { addr, .. } => {
                        if serve_fault(&uffd, &regions, &backing, page_size, addr as u64)? {
                            served += 1;
                        } else {
                            deferred.push(event);
                        }
                    }
                    Event::Remove { start, end } => {
                        let len = (end as usize).saturating_sub(start as usize);
                        uffd.unregister(start, len)
                            .map_err(|e| format!("cannot unregister a removed range: {e}"))?;
                    }
                    other => return Err(format!("unexpected userfaultfd event {other:?}")),
                }
            }
            if deferred.is_empty() {
                break;
            }
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(served) => {
            println!("fc-uffd-handler: served {served} faults");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("fc-uffd-handler: error: {message}");
            ExitCode::from(1)
        }
    }
}
