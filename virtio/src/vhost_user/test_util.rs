//! What the vhost-user tests share: shareable guest memory, backend processes that are
//! always killed, unique paths, an interrupt that reports to the test, and ring helpers.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, FileOffset, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

use super::Timeouts;
use crate::{ActivateError, Activation, ActiveQueue, GuestMemory, VirtioDevice, VirtioInterrupt};

pub const VRING_DESC_F_NEXT: u16 = 1;
pub const VRING_DESC_F_WRITE: u16 = 2;

/// A path under the temporary directory no other test (or run) uses.
pub fn unique_path(name: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "gpuvm-vhost-{}-{}-{name}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Removes a file or directory tree when dropped.
pub struct TempPath(pub PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether `program` runs here; prints why a test is skipped when it does not.
pub fn have_backend(program: &str, test: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|status| status.success())
        .unwrap_or(false);
    if !found {
        eprintln!(
            "SKIPPED {test}: `{program}` is not installed (scripts/install-deps.sh installs it)"
        );
    }
    found
}

/// A backend process, killed (SIGKILL) and reaped when dropped, even if the test fails.
pub struct Backend {
    pub child: Child,
}

impl Backend {
    pub fn spawn(command: &mut Command) -> Backend {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the backend");
        Backend { child }
    }

    /// Waits (bounded) until the backend's socket exists.
    pub fn wait_for_socket(&mut self, socket: &Path) {
        let begin = Instant::now();
        while !socket.exists() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the backend exited early: {status}");
            }
            assert!(
                begin.elapsed() < Duration::from_secs(10),
                "the backend did not create {} within 10 s",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Guest RAM as gpuvm makes it: one memfd mapped MAP_SHARED, so a backend can map it.
pub fn shared_memory(size: usize) -> GuestMemory {
    let name = CString::new("gpuvm-vhost-test").unwrap();
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64).unwrap();
    GuestMemory::from_ranges_with_files([(GuestAddress(0), size, Some(FileOffset::new(file, 0)))])
        .unwrap()
}

/// Records the queues the device signalled.
pub struct TestInterrupt {
    sender: Mutex<Sender<u16>>,
}

impl TestInterrupt {
    pub fn new() -> (Arc<TestInterrupt>, Receiver<u16>) {
        let (sender, receiver) = channel();
        (
            Arc::new(TestInterrupt {
                sender: Mutex::new(sender),
            }),
            receiver,
        )
    }
}

impl VirtioInterrupt for TestInterrupt {
    fn signal_queue(&self, queue_index: u16) -> std::io::Result<()> {
        let _ = self.sender.lock().unwrap().send(queue_index);
        Ok(())
    }

    fn signal_config(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One split ring in guest memory, driven from the driver's side.
pub struct TestRing {
    pub size: u16,
    desc_table: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    /// Where the next chain's descriptors go.
    next_descriptor: u16,
    made_available: u16,
    used_seen: u16,
}

impl TestRing {
    /// Lays out (and zeroes) a ring of `size` at `base`.
    pub fn new(memory: &GuestMemory, base: GuestAddress, size: u16) -> TestRing {
        let mock = MockSplitQueue::create(memory, base, size);
        TestRing {
            size,
            desc_table: mock.desc_table_addr(),
            avail: mock.avail_addr(),
            used: mock.used_addr(),
            next_descriptor: 0,
            made_available: 0,
            used_seen: 0,
        }
    }

    /// The queue (and our end of its kick eventfd) as the transport would hand it over.
    pub fn active_queue(&self) -> (ActiveQueue, EventFd) {
        let mut queue = Queue::new(self.size).unwrap();
        queue.set_size(self.size);
        queue.set_ready(true);
        let split = |a: GuestAddress| (Some(a.0 as u32), Some((a.0 >> 32) as u32));
        let (low, high) = split(self.desc_table);
        queue.set_desc_table_address(low, high);
        let (low, high) = split(self.avail);
        queue.set_avail_ring_address(low, high);
        let (low, high) = split(self.used);
        queue.set_used_ring_address(low, high);
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let ours = kick.try_clone().unwrap();
        (ActiveQueue { queue, kick }, ours)
    }

    /// Makes a chain of `(address, len, device_writes)` buffers available; returns its head.
    pub fn submit(&mut self, memory: &GuestMemory, buffers: &[(u64, u32, bool)]) -> u16 {
        let first = self.next_descriptor;
        for (i, &(address, len, writes)) in buffers.iter().enumerate() {
            let index = first + i as u16;
            let last = i + 1 == buffers.len();
            let mut flags = if writes { VRING_DESC_F_WRITE } else { 0 };
            if !last {
                flags |= VRING_DESC_F_NEXT;
            }
            let at = self
                .desc_table
                .unchecked_add(16 * u64::from(index % self.size));
            memory.write_obj(address.to_le(), at).unwrap();
            memory.write_obj(len.to_le(), at.unchecked_add(8)).unwrap();
            memory
                .write_obj(flags.to_le(), at.unchecked_add(12))
                .unwrap();
            memory
                .write_obj((index + 1).to_le(), at.unchecked_add(14))
                .unwrap();
        }
        self.next_descriptor += buffers.len() as u16;
        let slot = u64::from(self.made_available % self.size);
        memory
            .write_obj(first.to_le(), self.avail.unchecked_add(4 + 2 * slot))
            .unwrap();
        self.made_available = self.made_available.wrapping_add(1);
        std::sync::atomic::fence(Ordering::SeqCst);
        memory
            .write_obj(self.made_available.to_le(), self.avail.unchecked_add(2))
            .unwrap();
        first
    }

    /// The used ring's index.
    pub fn used_idx(&self, memory: &GuestMemory) -> u16 {
        u16::from_le(memory.read_obj::<u16>(self.used.unchecked_add(2)).unwrap())
    }

    /// Waits (bounded) for the next used element and its interrupt; returns (head,
    /// written length).
    pub fn wait_used(
        &mut self,
        memory: &GuestMemory,
        interrupts: &Receiver<u16>,
        queue: u16,
    ) -> (u32, u32) {
        let begin = Instant::now();
        loop {
            let left = Duration::from_secs(10).saturating_sub(begin.elapsed());
            assert!(
                !left.is_zero(),
                "no completion on queue {queue} within 10 s"
            );
            if let Ok(signalled) = interrupts.recv_timeout(left) {
                assert_eq!(signalled, queue, "interrupt for another queue");
                if self.used_idx(memory) != self.used_seen {
                    break;
                }
            }
        }
        let slot = u64::from(self.used_seen % self.size);
        let element = self.used.unchecked_add(4 + slot * 8);
        let head = u32::from_le(memory.read_obj::<u32>(element).unwrap());
        let len = u32::from_le(memory.read_obj::<u32>(element.unchecked_add(4)).unwrap());
        self.used_seen = self.used_seen.wrapping_add(1);
        (head, len)
    }
}

/// Bounds for talking to a real backend (qemu-storage-daemon, virtiofsd).
pub fn timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(5),
        reply: Duration::from_secs(3),
    }
}

/// The device's features as a driver acks them for a test: VERSION_1, and no EVENT_IDX,
/// so that every completion interrupts (which the tests wait for).
pub fn interrupting_features(device: &dyn VirtioDevice) -> u64 {
    (device.device_features() & !(1 << VIRTIO_RING_F_EVENT_IDX)) | (1 << VIRTIO_F_VERSION_1)
}

/// An activated device's rings, the driver's ends of their kicks, and its interrupts.
pub struct Activated {
    pub rings: Vec<TestRing>,
    pub kicks: Vec<EventFd>,
    pub interrupts: Receiver<u16>,
}

/// Activates `device` with one ring per `(base, size)` in `memory`, every queue enabled.
pub fn activate_rings(
    device: &mut dyn VirtioDevice,
    memory: &GuestMemory,
    acked_features: u64,
    rings: &[(u64, u16)],
) -> Result<Activated, ActivateError> {
    let rings: Vec<TestRing> = rings
        .iter()
        .map(|&(base, size)| TestRing::new(memory, GuestAddress(base), size))
        .collect();
    let (queues, kicks): (Vec<_>, Vec<_>) = rings
        .iter()
        .map(|ring| {
            let (queue, kick) = ring.active_queue();
            (Some(queue), kick)
        })
        .unzip();
    let (interrupt, interrupts) = TestInterrupt::new();
    device.activate(Activation {
        memory: memory.clone(),
        acked_features,
        queues,
        interrupt,
    })?;
    Ok(Activated {
        rings,
        kicks,
        interrupts,
    })
}

/// Waits (at most 5 s) until the device notices that its backend is gone.
pub fn wait_until_broken(is_broken: impl Fn() -> bool) {
    let begin = Instant::now();
    while !is_broken() {
        assert!(
            begin.elapsed() < Duration::from_secs(5),
            "the device did not notice"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
