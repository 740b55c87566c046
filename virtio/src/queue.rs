//! Taking chains from a driver's ring without trusting its available index.
//!
//! virtio-queue refuses to pop from a ring whose available index is more than a queue's
//! length ahead of the device, logging an error on every try; and a ring whose entries
//! cannot be read makes `enable_notification` report buffers that cannot be taken. A device
//! that retries either spins on its I/O thread (and a reset, which waits for that thread,
//! then hangs the vCPU that asked for it). Every device takes chains through
//! [`pop_available`], which checks first and tells the device to wait for the next kick.

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_queue::{DescriptorChain, Queue, QueueT};

use crate::GuestMemory;

/// What the driver has made available.
pub enum Available<'m> {
    Chain(DescriptorChain<&'m GuestMemory>),
    /// Nothing; notifications are on again (with no race: a chain that arrived while
    /// they were off is returned instead).
    Empty,
    /// The ring cannot be served as it stands (an index too far ahead, unreadable
    /// memory): wait for the driver's next kick. The reason is for a rate-limited log.
    Broken(&'static str),
}

/// Whether the driver's available index is readable and at most a queue's length ahead.
pub fn available_index_is_valid(queue: &Queue, memory: &GuestMemory) -> bool {
    queue
        .avail_idx(memory, Ordering::Acquire)
        .is_ok_and(|avail| (avail - Wrapping(queue.next_avail())).0 <= queue.size())
}

/// The next chain the driver made available, or why there is none (see [`Available`]).
pub fn pop_available<'m>(queue: &mut Queue, memory: &'m GuestMemory) -> Available<'m> {
    if !available_index_is_valid(queue, memory) {
        return Available::Broken("the available index is unreadable or more than a queue ahead");
    }
    let mut retried = false;
    loop {
        if let Some(chain) = queue.pop_descriptor_chain(memory) {
            return Available::Chain(chain);
        }
        match queue.enable_notification(memory) {
            // Buffers arrived while the device was looking: take them, once.
            Ok(true) if !retried => retried = true,
            Ok(true) => {
                return Available::Broken(
                    "the ring says buffers are available but none can be taken",
                )
            }
            Ok(false) => return Available::Empty,
            Err(_) => return Available::Broken("the ring cannot be read"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;

    fn memory() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    #[test]
    fn chains_then_empty_then_an_index_too_far_ahead_is_broken() {
        let memory = memory();
        let mock = MockSplitQueue::new(&memory, 16);
        let descriptors = [RawDescriptor::from(SplitDescriptor::new(0x8000, 64, 0, 0))];
        mock.add_desc_chains(&descriptors, 0).unwrap();
        let mut queue: Queue = mock.create_queue().unwrap();
        assert!(matches!(
            pop_available(&mut queue, &memory),
            Available::Chain(_)
        ));
        assert!(matches!(
            pop_available(&mut queue, &memory),
            Available::Empty
        ));
        // The driver claims 1000 more chains than a 16-entry queue can hold.
        let avail = mock.avail().idx();
        avail.store(avail.load().wrapping_add(1000));
        assert!(!available_index_is_valid(&queue, &memory));
        assert!(matches!(
            pop_available(&mut queue, &memory),
            Available::Broken(_)
        ));
    }
}
