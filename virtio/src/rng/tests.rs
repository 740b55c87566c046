//! The entropy device: its handler over a mock queue in real guest memory (requests, hostile
//! chains, rate limits, file sources), then the device on its worker thread.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::handler::RngHandler;
use super::source::Backend;
use super::{Rng, RngConfig, RngError, MAX_REQUEST_BYTES};
use crate::device::{ActivateError, Activation, ActiveQueue, QueuePosition, VirtioDevice};
use crate::rate_limiter::{RateLimiterConfig, TokenBucketConfig};
use crate::test_util::{bandwidth_limit, ops_limit, RecordingInterrupt};
use crate::GuestMemory;

const MEMORY_SIZE: usize = 0x10_0000;
const BUFFERS: u64 = 0x1_0000;
const QUEUE_SIZE: u16 = 16;
/// MockSplitQueue puts its used ring over the end of its available ring (it takes the
/// ring's length in entries for bytes), so the queues here use their own used ring.
const USED_RING: u64 = 0x2000;
const WRITE: u16 = VRING_DESC_F_WRITE as u16;
const NEXT: u16 = VRING_DESC_F_NEXT as u16;

fn memory() -> GuestMemory {
    crate::test_util::memory(MEMORY_SIZE)
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
}

fn handler(
    memory: &GuestMemory,
    vq: &MockSplitQueue<GuestMemory>,
    config: &RngConfig,
) -> (RngHandler, Arc<RecordingInterrupt>) {
    let interrupt = Arc::new(RecordingInterrupt::default());
    let handler = RngHandler::new(
        Backend::new(config).unwrap(),
        queue_for(vq),
        EventFd::new(EFD_NONBLOCK).unwrap(),
        memory.clone(),
        interrupt.clone(),
    );
    (handler, interrupt)
}

fn queue_for(vq: &MockSplitQueue<GuestMemory>) -> Queue {
    let mut queue: Queue = vq.create_queue().unwrap();
    queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
    queue
}

/// The used ring's index and its entries as (head, length).
fn used(memory: &GuestMemory) -> (u16, Vec<(u32, u32)>) {
    let idx = u16::from_le(memory.read_obj(GuestAddress(USED_RING + 2)).unwrap());
    let entries = (0..u64::from(idx.min(QUEUE_SIZE)))
        .map(|i| {
            let entry = GuestAddress(USED_RING + 4 + 8 * i);
            let id = u32::from_le(memory.read_obj(entry).unwrap());
            let len = u32::from_le(memory.read_obj(entry.unchecked_add(4)).unwrap());
            (id, len)
        })
        .collect();
    (idx, entries)
}

fn read(memory: &GuestMemory, addr: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0; len];
    memory.read_slice(&mut bytes, GuestAddress(addr)).unwrap();
    bytes
}

fn ops_limited(size: u64, refill_time_ms: u64) -> RngConfig {
    RngConfig {
        source: None,
        rate_limiter: ops_limit(size, refill_time_ms),
    }
}

#[test]
fn fills_every_writable_descriptor_of_a_chain() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    // Chain 0: three writable buffers; chain 3: one.
    vq.add_desc_chains(
        &[
            desc(BUFFERS, 100, WRITE | NEXT, 1),
            desc(BUFFERS + 0x1000, 200, WRITE | NEXT, 2),
            desc(BUFFERS + 0x2000, 300, WRITE, 0),
            desc(BUFFERS + 0x3000, 64, WRITE, 0),
        ],
        0,
    )
    .unwrap();
    let (mut handler, interrupt) = handler(&memory, &vq, &RngConfig::default());
    handler.process_queue();
    assert_eq!(used(&memory), (2, vec![(0, 600), (3, 64)]));
    for (addr, len) in [
        (BUFFERS, 100),
        (BUFFERS + 0x1000, 200),
        (BUFFERS + 0x2000, 300),
    ] {
        let bytes = read(&memory, addr, len);
        assert!(bytes.iter().any(|&b| b != 0), "{addr:#x} is all zero");
        // Nothing past the buffer was written.
        assert_eq!(read(&memory, addr + len as u64, 16), vec![0; 16]);
    }
    assert_ne!(
        read(&memory, BUFFERS, 100),
        read(&memory, BUFFERS + 0x1000, 100)
    );
    assert_eq!(interrupt.count(), 1);
    assert_eq!(
        handler.position(),
        QueuePosition {
            next_avail: 2,
            next_used: 2
        }
    );
}

#[test]
fn a_read_only_buffer_gets_zero_bytes_and_stays_untouched() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    memory
        .write_slice(&[0xaa; 64], GuestAddress(BUFFERS))
        .unwrap();
    vq.add_desc_chains(
        &[
            desc(BUFFERS, 64, 0, 0),
            // Readable then writable: only the writable part is filled.
            desc(BUFFERS + 0x1000, 32, NEXT, 2),
            desc(BUFFERS + 0x2000, 48, WRITE, 0),
        ],
        0,
    )
    .unwrap();
    let (mut handler, interrupt) = handler(&memory, &vq, &RngConfig::default());
    handler.process_queue();
    assert_eq!(used(&memory), (2, vec![(0, 0), (1, 48)]));
    assert_eq!(read(&memory, BUFFERS, 64), vec![0xaa; 64]);
    assert_eq!(read(&memory, BUFFERS + 0x1000, 32), vec![0; 32]);
    assert_eq!(interrupt.count(), 1);
}

#[test]
fn a_request_is_capped() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    vq.add_desc_chains(&[desc(BUFFERS, 0x8_0000, WRITE, 0)], 0)
        .unwrap();
    let (mut handler, _) = handler(&memory, &vq, &RngConfig::default());
    handler.process_queue();
    assert_eq!(used(&memory), (1, vec![(0, MAX_REQUEST_BYTES as u32)]));
    let past = BUFFERS + MAX_REQUEST_BYTES as u64;
    assert_eq!(read(&memory, past, 4096), vec![0; 4096]);
}

/// Stores descriptors at their table indices and offers `heads` in the available ring.
fn offer(vq: &MockSplitQueue<GuestMemory>, descs: &[(u16, RawDescriptor)], heads: &[u16]) {
    for (index, desc) in descs {
        vq.desc_table().store(*index, *desc).unwrap();
    }
    for head in heads {
        let idx = vq.avail().idx().load();
        vq.avail()
            .ring()
            .ref_at((idx % QUEUE_SIZE) as usize)
            .unwrap()
            .store(u16::to_le(*head));
        vq.avail().idx().store(idx.wrapping_add(1));
    }
}

#[test]
fn hostile_chains_neither_panic_nor_hang() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    let end = MEMORY_SIZE as u64;
    offer(
        &vq,
        &[
            // Outside guest memory.
            (0, desc(end + 0x1000, 64, WRITE, 0)),
            // Across the end of guest memory.
            (1, desc(end - 16, 64, WRITE, 0)),
            // u32::MAX bytes.
            (2, desc(BUFFERS, u32::MAX, WRITE, 0)),
            // 3 -> 4 -> 3 ...: a loop, bounded by the queue size.
            (3, desc(BUFFERS + 0x1000, 100, WRITE | NEXT, 4)),
            (4, desc(BUFFERS + 0x2000, 100, WRITE | NEXT, 3)),
            // Next points outside the table.
            (5, desc(BUFFERS + 0x3000, 8, WRITE | NEXT, 999)),
            // An indirect table outside memory.
            (6, desc(end * 4, 64, VRING_DESC_F_INDIRECT_FLAG, 0)),
        ],
        // And a head past the table.
        &[0, 1, 2, 3, 5, 6, 1000],
    );
    let (mut handler, interrupt) = handler(&memory, &vq, &RngConfig::default());
    handler.process_queue();
    let (idx, entries) = used(&memory);
    // Every chain with a head inside the table came back; head 1000 could not.
    assert_eq!(idx, 6, "{entries:?}");
    assert_eq!(
        entries,
        vec![
            (0, 0),
            (1, 0),
            (2, 0),
            // The loop ends after QUEUE_SIZE descriptors.
            (3, 100 * QUEUE_SIZE as u32),
            // A bad next index ends the chain after its first descriptor.
            (5, 8),
            (6, 0),
        ]
    );
    assert_eq!(read(&memory, BUFFERS, 64), vec![0; 64]);
    assert_eq!(interrupt.count(), 1);
    assert_eq!(handler.position().next_avail, 7);

    // An available index too far ahead of the device's: nothing is served, nothing hangs.
    let avail_idx = vq.avail().idx().load();
    vq.avail().idx().store(avail_idx.wrapping_add(1000));
    memory
        .write_obj(
            u16::to_le(VRING_USED_F_NO_NOTIFY_FLAG),
            GuestAddress(USED_RING),
        )
        .unwrap();
    handler.process_queue();
    assert_eq!(used(&memory).0, 6);
    assert_eq!(interrupt.count(), 1);
    // Kicks stay enabled, so a driver that fixes its index is heard.
    let flags: u16 = memory.read_obj(GuestAddress(USED_RING)).unwrap();
    assert_eq!(u16::from_le(flags), 0);
    vq.avail().idx().store(avail_idx);
    offer(&vq, &[(7, desc(BUFFERS, 4, WRITE, 0))], &[7]);
    handler.on_kick();
    assert_eq!(used(&memory).0, 7);
}

const VRING_USED_F_NO_NOTIFY_FLAG: u16 =
    virtio_bindings::bindings::virtio_ring::VRING_USED_F_NO_NOTIFY as u16;

const VRING_DESC_F_INDIRECT_FLAG: u16 =
    virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;

#[test]
fn a_rate_limited_device_serves_what_the_bucket_allows_until_the_timer_fires() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    let chains: Vec<RawDescriptor> = (0..4)
        .map(|i| desc(BUFFERS + i * 0x1000, 16, WRITE, 0))
        .collect();
    vq.add_desc_chains(&chains, 0).unwrap();
    // Two requests at once, then one per 500 ms.
    let (mut handler, interrupt) = handler(&memory, &vq, &ops_limited(2, 1000));
    handler.process_queue();
    assert_eq!(used(&memory), (2, vec![(0, 16), (1, 16)]));
    assert!(handler.backend.limiter.is_blocked());
    // The refused chain went back to the ring.
    assert_eq!(
        handler.position(),
        QueuePosition {
            next_avail: 2,
            next_used: 2
        }
    );
    assert_eq!(interrupt.count(), 1);
    // A kick while blocked serves nothing.
    handler.on_kick();
    assert_eq!(used(&memory).0, 2);
    // After the timer fires, the third goes, and the fourth waits again.
    let mut poll = libc::pollfd {
        fd: handler.backend.limiter.timer_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and the count says one.
    assert_eq!(unsafe { libc::poll(&mut poll, 1, 5000) }, 1, "no timer");
    handler.on_timer();
    assert_eq!(used(&memory), (3, vec![(0, 16), (1, 16), (2, 16)]));
    assert!(handler.backend.limiter.is_blocked());
    assert_eq!(interrupt.count(), 2);
}

#[test]
fn a_bandwidth_limit_is_charged_per_byte() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    let chains: Vec<RawDescriptor> = (0..3)
        .map(|i| desc(BUFFERS + i * 0x1000, 40, WRITE, 0))
        .collect();
    vq.add_desc_chains(&chains, 0).unwrap();
    let config = RngConfig {
        source: None,
        rate_limiter: bandwidth_limit(100, 100_000),
    };
    let (mut handler, _) = handler(&memory, &vq, &config);
    handler.process_queue();
    assert_eq!(used(&memory), (2, vec![(0, 40), (1, 40)]));
    assert!(handler.backend.limiter.is_blocked());
}

#[test]
fn a_regular_file_source_is_read_then_answers_zero_bytes_at_its_end() {
    let dir = std::env::temp_dir().join(format!("gpuvm-rng-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("entropy");
    let content: Vec<u8> = (1..=150u8).collect();
    std::fs::write(&path, &content).unwrap();

    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    let chains: Vec<RawDescriptor> = (0..3)
        .map(|i| desc(BUFFERS + i * 0x1000, 100, WRITE, 0))
        .collect();
    vq.add_desc_chains(&chains, 0).unwrap();
    let config = RngConfig {
        source: Some(path.clone()),
        rate_limiter: RateLimiterConfig::default(),
    };
    let (mut handler, _) = handler(&memory, &vq, &config);
    handler.process_queue();
    assert_eq!(used(&memory), (3, vec![(0, 100), (1, 50), (2, 0)]));
    assert_eq!(read(&memory, BUFFERS, 100), content[..100]);
    assert_eq!(read(&memory, BUFFERS + 0x1000, 50), content[100..]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unusable_sources_are_refused() {
    let dir = std::env::temp_dir().join(format!("gpuvm-rng-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = |path: &Path| RngConfig {
        source: Some(path.to_path_buf()),
        rate_limiter: RateLimiterConfig::default(),
    };
    let error = Rng::new(source(&dir)).err().unwrap();
    assert!(matches!(error, RngError::Directory { .. }), "{error}");

    let fifo = dir.join("fifo");
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    // Opening it does not wait for a writer, and it is refused.
    let error = Rng::new(source(&fifo)).err().unwrap();
    assert!(
        matches!(error, RngError::WouldBlock { kind: "FIFO", .. }),
        "{error}"
    );

    let missing = dir.join("missing");
    let error = Rng::new(source(&missing)).err().unwrap();
    assert!(matches!(error, RngError::Open { .. }), "{error}");
    assert!(error.to_string().contains("missing"));

    let error = Rng::new(RngConfig {
        source: None,
        rate_limiter: RateLimiterConfig {
            bandwidth: Some(TokenBucketConfig::default()),
            ops: None,
        },
    })
    .err()
    .unwrap();
    assert!(matches!(error, RngError::RateLimiter(_)), "{error}");

    assert!(Rng::new(source(Path::new("/dev/urandom"))).is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_refuses_unknown_fields() {
    let config: RngConfig = serde_json::from_str(r#"{"source": "/dev/urandom"}"#).unwrap();
    assert_eq!(config.source.as_deref(), Some(Path::new("/dev/urandom")));
    assert_eq!(config.rate_limiter, RateLimiterConfig::default());
    assert!(serde_json::from_str::<RngConfig>(r#"{"src": "/dev/urandom"}"#).is_err());
}

fn activation_for(
    memory: &GuestMemory,
    vq: &MockSplitQueue<GuestMemory>,
    acked_features: u64,
) -> (Activation, EventFd, Arc<RecordingInterrupt>) {
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let trigger = kick.try_clone().unwrap();
    let interrupt = Arc::new(RecordingInterrupt::default());
    let activation = Activation {
        memory: memory.clone(),
        acked_features,
        queues: vec![Some(ActiveQueue {
            queue: queue_for(vq),
            kick,
        })],
        interrupt: interrupt.clone(),
    };
    (activation, trigger, interrupt)
}

#[test]
fn the_device_serves_on_its_worker_and_pauses_resumes_resets() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    let mut rng = Rng::new(RngConfig::default()).unwrap();
    assert_eq!(rng.device_type(), 4);
    assert_eq!(rng.queue_max_sizes(), vec![256]);
    assert!(rng.pause().is_empty());
    let mut config = [0xff; 8];
    rng.read_config(0, &mut config);
    assert_eq!(config, [0; 8]);

    // A request queued before activation is served without a kick.
    vq.add_desc_chains(&[desc(BUFFERS, 32, WRITE, 0)], 0)
        .unwrap();
    let (activation, kick, interrupt) = activation_for(&memory, &vq, 0);
    rng.activate(activation).unwrap();
    assert!(interrupt.wait_for(1), "no interrupt");
    assert_eq!(used(&memory), (1, vec![(0, 32)]));

    // A kicked request.
    vq.add_desc_chains(&[desc(BUFFERS + 0x1000, 48, WRITE, 0)], 1)
        .unwrap();
    kick.write(1).unwrap();
    assert!(interrupt.wait_for(2), "no interrupt");
    assert_eq!(used(&memory), (2, vec![(0, 32), (1, 48)]));

    // Paused: nothing is served.
    assert_eq!(
        rng.pause(),
        vec![Some(QueuePosition {
            next_avail: 2,
            next_used: 2
        })]
    );
    vq.add_desc_chains(&[desc(BUFFERS + 0x2000, 16, WRITE, 0)], 2)
        .unwrap();
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(used(&memory).0, 2);
    assert_eq!(
        serde_json::to_value(rng.save_state().unwrap()).unwrap(),
        serde_json::json!({"rng": {
            "rate_limiter": {"bandwidth": null, "ops": null},
            "buckets": {"bandwidth": null, "ops": null},
        }})
    );
    // Resumed: the request queued meanwhile is served.
    rng.resume().unwrap();
    assert!(interrupt.wait_for(3), "no interrupt");
    assert_eq!(used(&memory).0, 3);
    assert_eq!(interrupt.queues(), [0, 0, 0]);
    assert_eq!(
        interrupt.config_changes(),
        0,
        "it has no configuration to change"
    );

    // Reset, then activate again from a fresh queue.
    rng.reset();
    assert!(rng.pause().is_empty());
    let memory2 = self::memory();
    let vq2 = MockSplitQueue::new(&memory2, QUEUE_SIZE);
    vq2.add_desc_chains(&[desc(BUFFERS, 8, WRITE, 0)], 0)
        .unwrap();
    let (activation, _kick, interrupt) = activation_for(&memory2, &vq2, 0);
    rng.activate(activation).unwrap();
    assert!(interrupt.wait_for(1), "no interrupt");
    assert_eq!(used(&memory2), (1, vec![(0, 8)]));
    rng.reset();
}

#[test]
fn activation_without_the_queue_is_refused() {
    let memory = memory();
    let mut rng = Rng::new(RngConfig::default()).unwrap();
    let activation = Activation {
        memory,
        acked_features: 0,
        queues: vec![None],
        interrupt: Arc::new(RecordingInterrupt::default()),
    };
    let error = rng.activate(activation).unwrap_err();
    assert!(
        matches!(
            error,
            ActivateError::QueueCount {
                given: 0,
                needed: 1,
                ..
            }
        ),
        "{error}"
    );
}

#[test]
fn event_idx_suppresses_interrupts_the_driver_did_not_ask_for() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    let mut rng = Rng::new(RngConfig::default()).unwrap();
    // used_event (after the avail ring) = 5: interrupt only once used passes 5.
    let used_event = vq.avail_addr().unchecked_add(4 + 2 * QUEUE_SIZE as u64);
    memory.write_obj(5u16.to_le(), used_event).unwrap();
    vq.add_desc_chains(&[desc(BUFFERS, 8, WRITE, 0)], 0)
        .unwrap();
    let (activation, kick, interrupt) = activation_for(&memory, &vq, 1 << VIRTIO_RING_F_EVENT_IDX);
    rng.activate(activation).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while used(&memory).0 < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(used(&memory).0, 1);
    // Give a stray interrupt time to show.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(interrupt.count(), 0);
    // The device asked to be kicked at the next available index.
    let avail_event = GuestAddress(USED_RING + 4 + 8 * QUEUE_SIZE as u64);
    assert_eq!(
        u16::from_le(memory.read_obj::<u16>(avail_event).unwrap()),
        1
    );
    // Five more: used goes 1 -> 6, crossing used_event + 1 = 6.
    let chains: Vec<RawDescriptor> = (1..6)
        .map(|i| desc(BUFFERS + i * 0x1000, 8, WRITE, 0))
        .collect();
    vq.add_desc_chains(&chains, 1).unwrap();
    kick.write(1).unwrap();
    let ok = interrupt.wait_for(1);
    assert!(ok, "no interrupt; used {:?}", used(&memory));
    assert_eq!(used(&memory).0, 6);
    rng.reset();
}

#[test]
fn limits_change_on_a_running_device_and_survive_a_snapshot() {
    let memory = memory();
    let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
    // One request per 100 s: the second waits.
    let mut rng = Rng::new(ops_limited(1, 100_000)).unwrap();
    let chains: Vec<RawDescriptor> = (0..3)
        .map(|i| desc(BUFFERS + i * 0x1000, 8, WRITE, 0))
        .collect();
    vq.add_desc_chains(&chains, 0).unwrap();
    let (activation, _kick, interrupt) = activation_for(&memory, &vq, 0);
    rng.activate(activation).unwrap();
    assert!(interrupt.wait_for(1), "no interrupt");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(used(&memory).0, 1);
    // Lifting the limit lets the waiting requests through.
    rng.update_rate_limiter(RateLimiterConfig::default())
        .unwrap();
    assert!(interrupt.wait_for(2), "no interrupt");
    assert_eq!(used(&memory).0, 3);
    assert_eq!(rng.config().rate_limiter, RateLimiterConfig::default());
    assert!(rng
        .update_rate_limiter(ops_limited(0, 1).rate_limiter)
        .is_err());

    let limits = ops_limited(7, 700).rate_limiter;
    rng.update_rate_limiter(limits).unwrap();
    rng.pause();
    let state = rng.save_state().unwrap();
    let crate::DeviceState::Rng(fields) = &state else {
        panic!("not an rng state: {state:?}")
    };
    let ops_bucket = fields.buckets.ops.expect("the ops bucket is saved");
    assert_eq!(ops_bucket.config, limits.ops.unwrap());
    rng.reset();
    let mut restored = Rng::new(RngConfig::default()).unwrap();
    restored.restore_state(&state).unwrap();
    assert_eq!(restored.config().rate_limiter, limits);
    // What the state file cannot hold is refused as it is read.
    for bad in [
        serde_json::json!({"rng": {"rate_limiter": {}, "extra": 1}}),
        serde_json::json!({"rng": null}),
        serde_json::json!(null),
    ] {
        assert!(
            serde_json::from_value::<crate::DeviceState>(bad.clone()).is_err(),
            "{bad}"
        );
    }
    let zero_size: crate::DeviceState = serde_json::from_value(
        serde_json::json!({"rng": {"rate_limiter": {"ops": {"size": 0, "refill_time_ms": 1}}}}),
    )
    .unwrap();
    let error = restored.restore_state(&zero_size).unwrap_err().to_string();
    assert!(error.contains("size must be greater than 0"), "{error}");
    // A bucket holding more than its size cannot have been saved.
    let mut forged = fields.clone();
    forged.buckets.ops.as_mut().unwrap().budget = 8;
    let error = restored
        .restore_state(&crate::DeviceState::Rng(forged))
        .unwrap_err()
        .to_string();
    assert!(error.contains("more than its size 7"), "{error}");
    assert_eq!(restored.config().rate_limiter, limits);
}
