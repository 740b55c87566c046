//! Split virtqueues (virtio 1.x, 2.7): descriptor table, available ring (driver area) and used
//! ring (device area) in guest RAM, each on its own 4 KiB page. No event index (the feature is
//! never acked), so every submission is followed by a notification.

use core::sync::atomic::{fence, Ordering};

use super::{Deadline, Dma};

/// The largest queue the driver sets up (smaller if the device offers less).
pub const MAX_QUEUE_SIZE: u16 = 64;
const DESC_SIZE: u64 = 16;
pub(crate) const DESC_F_NEXT: u16 = 1;
pub(crate) const DESC_F_WRITE: u16 = 2;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
const PAGE: u64 = 4096;

/// One buffer of a chain: guest-physical address, length, and who writes it.
#[derive(Clone, Copy)]
pub struct Buffer {
    pub addr: u64,
    pub len: u32,
    pub device_writes: bool,
}

impl Buffer {
    pub fn readable(addr: u64, len: u32) -> Buffer {
        Buffer {
            addr,
            len,
            device_writes: false,
        }
    }

    pub fn writable(addr: u64, len: u32) -> Buffer {
        Buffer {
            addr,
            len,
            device_writes: true,
        }
    }
}

/// A chain the device has finished: the token it was added with and the bytes it wrote.
#[derive(Clone, Copy)]
pub struct Used {
    pub token: u64,
    pub len: u32,
}

pub enum QueueError {
    /// Not enough free descriptors for the chain.
    Full,
    Timeout,
    /// The device returned an ID that is not the head of a chain in flight.
    BadId(u32),
}

impl core::fmt::Display for QueueError {
    fn fmt(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
        match self {
            QueueError::Full => write!(f, "no free descriptors"),
            QueueError::Timeout => {
                write!(f, "no used buffer within {} ms", super::REQUEST_TIMEOUT_MS)
            }
            QueueError::BadId(id) => {
                write!(f, "used ring names descriptor {id}, which is not in flight")
            }
        }
    }
}

pub struct SplitQueue {
    pub index: u16,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// The MMIO address this queue's notifications go to.
    notify: u64,
    free: [u16; MAX_QUEUE_SIZE as usize],
    free_len: usize,
    /// Per head: descriptors in its chain (0 = not in flight), and the caller's token.
    chain_len: [u8; MAX_QUEUE_SIZE as usize],
    token: [u64; MAX_QUEUE_SIZE as usize],
    /// The `next` fields as written, so freeing a chain never trusts ring memory.
    next: [u16; MAX_QUEUE_SIZE as usize],
    next_avail: u16,
    last_used: u16,
}

fn write16(addr: u64, value: u16) {
    // SAFETY: `addr` is inside this queue's rings in the driver's DMA area (identity mapped RAM).
    unsafe { (addr as *mut u16).write_volatile(value) }
}

fn read16(addr: u64) -> u16 {
    // SAFETY: as in `write16`.
    unsafe { (addr as *const u16).read_volatile() }
}

fn read32(addr: u64) -> u32 {
    // SAFETY: as in `write16`.
    unsafe { (addr as *const u32).read_volatile() }
}

impl SplitQueue {
    /// Allocates the rings (zeroed) for `size` entries, `size` a power of two up to
    /// [`MAX_QUEUE_SIZE`]; `notify` is where [`SplitQueue::notify`] writes.
    pub fn new(dma: &mut Dma, index: u16, size: u16, notify: u64) -> SplitQueue {
        let desc = dma.alloc(PAGE, PAGE);
        let avail = dma.alloc(PAGE, PAGE);
        let used = dma.alloc(PAGE, PAGE);
        let mut free = [0u16; MAX_QUEUE_SIZE as usize];
        for (slot, entry) in free.iter_mut().enumerate().take(size as usize) {
            // Popped from the end: descriptor 0 first.
            *entry = size - 1 - slot as u16;
        }
        SplitQueue {
            index,
            size,
            desc,
            avail,
            used,
            notify,
            free,
            free_len: size as usize,
            chain_len: [0; MAX_QUEUE_SIZE as usize],
            token: [0; MAX_QUEUE_SIZE as usize],
            next: [0; MAX_QUEUE_SIZE as usize],
            next_avail: 0,
            last_used: 0,
        }
    }

    /// Asks the device not to interrupt for this queue (a hint; the driver polls).
    pub fn suppress_interrupts(&self, suppress: bool) {
        write16(self.avail, if suppress { AVAIL_F_NO_INTERRUPT } else { 0 });
    }

    /// Chains `buffers` and makes the chain available (no notification yet).
    pub fn add(&mut self, buffers: &[Buffer], token: u64) -> Result<(), QueueError> {
        if buffers.is_empty() || buffers.len() > self.free_len {
            return Err(QueueError::Full);
        }
        let mut indices = [0u16; MAX_QUEUE_SIZE as usize];
        for index in indices.iter_mut().take(buffers.len()) {
            self.free_len -= 1;
            *index = self.free[self.free_len];
        }
        for (position, buffer) in buffers.iter().enumerate() {
            let index = indices[position];
            let last = position + 1 == buffers.len();
            let next = if last { 0 } else { indices[position + 1] };
            let flags = if last { 0 } else { DESC_F_NEXT }
                | if buffer.device_writes {
                    DESC_F_WRITE
                } else {
                    0
                };
            let entry = self.desc + u64::from(index) * DESC_SIZE;
            // SAFETY: `entry` is descriptor `index` < size of this queue's table (DMA area).
            unsafe {
                (entry as *mut u64).write_volatile(buffer.addr);
                ((entry + 8) as *mut u32).write_volatile(buffer.len);
                ((entry + 12) as *mut u16).write_volatile(flags);
                ((entry + 14) as *mut u16).write_volatile(next);
            }
            self.next[index as usize] = next;
        }
        let head = indices[0];
        self.chain_len[head as usize] = buffers.len() as u8;
        self.token[head as usize] = token;
        let slot = self.next_avail % self.size;
        write16(self.avail + 4 + 2 * u64::from(slot), head);
        // The descriptors and the ring entry before the index that publishes them.
        fence(Ordering::SeqCst);
        self.next_avail = self.next_avail.wrapping_add(1);
        write16(self.avail + 2, self.next_avail);
        Ok(())
    }

    /// Tells the device this queue has new buffers (virtio-pci: the queue index, 16 bits).
    pub fn notify(&self) {
        fence(Ordering::SeqCst);
        // SAFETY: `notify` lies in the notify capability's region of a BAR (checked when the
        // queue was set up), identity mapped and user accessible; the write traps to the VMM.
        unsafe { (self.notify as *mut u16).write_volatile(self.index) };
    }

    /// The device's used index as it is now.
    pub fn used_index(&self) -> u16 {
        read16(self.used + 2)
    }

    /// The next chain the device finished, if any; its descriptors are free again.
    pub fn pop_used(&mut self) -> Result<Option<Used>, QueueError> {
        if self.used_index() == self.last_used {
            return Ok(None);
        }
        // The element is read after the index that published it.
        fence(Ordering::SeqCst);
        let element = self.used + 4 + 8 * u64::from(self.last_used % self.size);
        let id = read32(element);
        let len = read32(element + 4);
        self.last_used = self.last_used.wrapping_add(1);
        if id >= u32::from(self.size) || self.chain_len[id as usize] == 0 {
            return Err(QueueError::BadId(id));
        }
        let head = id as u16;
        let mut index = head;
        for _ in 0..self.chain_len[head as usize] {
            self.free[self.free_len] = index;
            self.free_len += 1;
            index = self.next[index as usize];
        }
        self.chain_len[head as usize] = 0;
        Ok(Some(Used {
            token: self.token[head as usize],
            len,
        }))
    }

    /// Spins until the device finishes a chain, at most [`super::REQUEST_TIMEOUT_MS`].
    pub fn wait_used(&mut self) -> Result<Used, QueueError> {
        let deadline = Deadline::after_ms(super::REQUEST_TIMEOUT_MS);
        loop {
            if let Some(used) = self.pop_used()? {
                return Ok(used);
            }
            if deadline.expired() {
                return Err(QueueError::Timeout);
            }
            crate::arch::pause();
        }
    }
}
