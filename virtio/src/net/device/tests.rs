//! The device on its worker thread over stand-in taps: configuration space, activation,
//! pause/resume/reset, the control queue, snapshots and rate-limit changes.

use serde_json::json;
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_net::{
    VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, VIRTIO_NET_ERR, VIRTIO_NET_OK,
};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::device::ActiveQueue;
use crate::net::test_util::{
    active_queue, add_chain, descriptor, frame, memory, stand_in_taps, used, DATA,
};
use crate::net::VNET_HDR_LEN;
use crate::test_util::{ops_limit, wait_until, RecordingInterrupt};
use crate::GuestMemory;

fn mac_of(net: &Net) -> [u8; 6] {
    let mut mac = [0u8; 6];
    net.read_config(0, &mut mac);
    mac
}

#[test]
fn config_space_layout() {
    let mut config = NetConfig::new("eth0", None);
    config.guest_mac = Some("06:11:22:33:44:55".parse().unwrap());
    config.num_queue_pairs = 3;
    let (taps, _peers) = stand_in_taps(3);
    let net = Net::new(config, taps).unwrap();
    let mut space = [0xffu8; 12];
    net.read_config(0, &mut space);
    assert_eq!(
        space,
        [0x06, 0x11, 0x22, 0x33, 0x44, 0x55, 1, 0, 3, 0, 0, 0],
        "mac, status LINK_UP (le16), max_virtqueue_pairs (le16), mtu"
    );
    let mut status = [0u8; 2];
    net.read_config(6, &mut status);
    assert_eq!(u16::from_le_bytes(status), VIRTIO_NET_S_LINK_UP as u16);
    let mut past = [0xffu8; 4];
    net.read_config(CONFIG_LEN as u64 - 2, &mut past);
    assert_eq!(past, [0; 4], "bytes past the end read as zero");
    net.read_config(u64::MAX, &mut past);
    assert_eq!(past, [0; 4]);
    assert_eq!(net.device_type(), 1);
    assert_eq!(
        net.queue_max_sizes(),
        vec![256, 256, 256, 256, 256, 256, CONTROL_QUEUE_SIZE]
    );
    let features = net.device_features();
    for feature in [
        VIRTIO_NET_F_MAC,
        VIRTIO_NET_F_STATUS,
        VIRTIO_NET_F_MQ,
        VIRTIO_NET_F_CTRL_VQ,
    ] {
        assert_ne!(features & (1 << feature), 0, "feature {feature}");
    }
}

#[test]
fn single_pair_offers_no_control_queue_and_ignores_config_writes() {
    let (taps, _peers) = stand_in_taps(1);
    let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
    assert_eq!(net.queue_max_sizes(), vec![256, 256]);
    assert_eq!(
        net.device_features(),
        (1 << VIRTIO_NET_F_MAC) | (1 << VIRTIO_NET_F_STATUS)
    );
    let before = mac_of(&net);
    assert_eq!(before, MacAddr::derived_from("eth0").bytes());
    net.write_config(0, &[0x02, 0, 0, 0, 0, 1]);
    assert_eq!(mac_of(&net), before);
}

#[test]
fn new_refuses_the_wrong_number_of_taps() {
    let mut config = NetConfig::new("eth0", None);
    config.num_queue_pairs = 2;
    let (taps, _peers) = stand_in_taps(1);
    assert!(matches!(
        Net::new(config, taps),
        Err(NetError::TapCount {
            expected: 2,
            given: 1,
            ..
        })
    ));
    assert!(matches!(
        Net::open(NetConfig::new("eth0", None)),
        Err(NetError::NoTapName { .. })
    ));
}

/// Activates `net` with one queue pair over `queues` (RX, TX); returns their kick
/// eventfds, with which the test notifies the device as a guest would.
fn activate_one_pair(
    net: &mut Net,
    memory: &GuestMemory,
    (rxq, txq): (&MockSplitQueue<GuestMemory>, &MockSplitQueue<GuestMemory>),
    signals: &Arc<RecordingInterrupt>,
) -> (
    vmm_sys_util::eventfd::EventFd,
    vmm_sys_util::eventfd::EventFd,
) {
    let (rx, tx) = (active_queue(rxq), active_queue(txq));
    let kicks = (rx.kick.try_clone().unwrap(), tx.kick.try_clone().unwrap());
    net.activate(activation(memory, vec![Some(rx), Some(tx)], 0, signals))
        .unwrap();
    kicks
}

fn activation(
    memory: &GuestMemory,
    queues: Vec<Option<ActiveQueue>>,
    features: u64,
    signals: &Arc<RecordingInterrupt>,
) -> Activation {
    Activation {
        memory: memory.clone(),
        acked_features: features,
        queues,
        interrupt: signals.clone(),
    }
}

#[test]
fn serves_frames_on_its_thread_pauses_resumes_and_resets() {
    let memory = memory();
    let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&memory, GuestAddress(0x8000), 16);
    let (taps, peers) = stand_in_taps(1);
    let peer = &peers[0];
    let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
    let signals = Arc::new(RecordingInterrupt::default());

    // A frame the tap has before the guest posts any buffer waits in the tap.
    let mut datagram = vec![0u8; VNET_HDR_LEN];
    datagram.extend(frame(90, 4));
    peer.send(&datagram).unwrap();

    let (rx_kick, tx_kick) = activate_one_pair(&mut net, &memory, (&rxq, &txq), &signals);
    assert!(
        net.activate(activation(&memory, vec![], 0, &signals))
            .is_err(),
        "twice"
    );

    add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
    rx_kick.write(1).unwrap();
    wait_until("the RX frame", || used(&rxq).len() == 1);
    assert_eq!(used(&rxq)[0], (0, (VNET_HDR_LEN + 90) as u32));
    assert!(signals.queues().contains(&0));

    memory
        .write_slice(&[0u8; VNET_HDR_LEN], GuestAddress(DATA + 0x1000))
        .unwrap();
    memory
        .write_slice(
            &frame(70, 8),
            GuestAddress(DATA + 0x1000 + VNET_HDR_LEN as u64),
        )
        .unwrap();
    add_chain(
        &txq,
        0,
        &[descriptor(DATA + 0x1000, (VNET_HDR_LEN + 70) as u32, false)],
    );
    tx_kick.write(1).unwrap();
    wait_until("the TX frame", || used(&txq).len() == 1);
    let mut buf = vec![0u8; 200];
    let n = peer.recv(&mut buf).unwrap();
    assert_eq!(&buf[VNET_HDR_LEN..n], &frame(70, 8)[..]);

    let positions = net.pause();
    assert_eq!(
        positions,
        vec![
            Some(QueuePosition {
                next_avail: 1,
                next_used: 1
            }),
            Some(QueuePosition {
                next_avail: 1,
                next_used: 1
            })
        ]
    );
    // Nothing is served while paused; everything is after resume, with no new kick.
    add_chain(&rxq, 1, &[descriptor(DATA + 0x2000, 2000, true)]);
    peer.send(&datagram).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(used(&rxq).len(), 1);
    assert_eq!(saved(&net).active_queue_pairs, 1);
    net.resume().unwrap();
    wait_until("the RX frame after resume", || used(&rxq).len() == 2);

    let stats = net.stats();
    assert_eq!(
        (
            stats.rx_packets,
            stats.rx_bytes,
            stats.tx_packets,
            stats.tx_bytes
        ),
        (2, 180, 1, 70)
    );

    // A reset gives the taps back: the device activates again.
    net.reset();
    assert!(net.pause().is_empty(), "not active");
    let rxq2 = MockSplitQueue::create(&memory, GuestAddress(0x10000), 16);
    let txq2 = MockSplitQueue::create(&memory, GuestAddress(0x18000), 16);
    let rx2 = active_queue(&rxq2);
    let rx2_kick = rx2.kick.try_clone().unwrap();
    net.activate(activation(
        &memory,
        vec![Some(rx2), Some(active_queue(&txq2))],
        0,
        &signals,
    ))
    .unwrap();
    add_chain(&rxq2, 0, &[descriptor(DATA + 0x3000, 2000, true)]);
    peer.send(&datagram).unwrap();
    rx2_kick.write(1).unwrap();
    wait_until("the RX frame after reset", || used(&rxq2).len() == 1);
    net.reset();
}

#[test]
fn activation_without_the_first_pair_is_refused_and_keeps_the_taps() {
    let memory = memory();
    let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
    let (taps, _peers) = stand_in_taps(1);
    let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
    let signals = Arc::new(RecordingInterrupt::default());
    let error = net
        .activate(activation(
            &memory,
            vec![Some(active_queue(&rxq)), None],
            0,
            &signals,
        ))
        .unwrap_err();
    assert!(
        matches!(
            error,
            ActivateError::QueueCount {
                given: 1,
                needed: 2,
                ..
            }
        ),
        "{error}"
    );
    net.activate(activation(
        &memory,
        vec![Some(active_queue(&rxq)), Some(active_queue(&rxq))],
        0,
        &signals,
    ))
    .unwrap();
    net.reset();
}

fn control_chain(
    memory: &GuestMemory,
    mock: &MockSplitQueue<GuestMemory>,
    slot: u16,
    addr: u64,
    command: &[u8],
) {
    memory.write_slice(command, GuestAddress(addr)).unwrap();
    memory
        .write_slice(&[0xaa], GuestAddress(addr + 0x100))
        .unwrap();
    add_chain(
        mock,
        slot,
        &[
            descriptor(addr, command.len() as u32, false),
            descriptor(addr + 0x100, 1, true),
        ],
    );
}

fn ack(memory: &GuestMemory, addr: u64) -> u8 {
    memory.read_obj(GuestAddress(addr + 0x100)).unwrap()
}

/// `count` queues of 16, 16 KiB apart from address 0.
fn mock_queues(memory: &GuestMemory, count: u64) -> Vec<MockSplitQueue<'_, GuestMemory>> {
    (0..count)
        .map(|i| MockSplitQueue::create(memory, GuestAddress(i * 0x4000), 16))
        .collect()
}

/// A device with two queue pairs, and the other ends of its taps.
fn two_pair_net() -> (Net, Vec<UnixDatagram>) {
    let (taps, peers) = stand_in_taps(2);
    let mut config = NetConfig::new("eth0", None);
    config.num_queue_pairs = 2;
    (Net::new(config, taps).unwrap(), peers)
}

#[test]
fn control_queue_sets_queue_pairs_and_refuses_the_rest() {
    let memory = memory();
    let mocks = mock_queues(&memory, 5);
    let (mut net, _peers) = two_pair_net();
    net.restore_state(&net_state(json!({
        "mac": "06:00:00:00:00:09", "num_queue_pairs": 2, "active_queue_pairs": 1
    })))
    .unwrap();
    assert_eq!(mac_of(&net), [6, 0, 0, 0, 0, 9]);

    let mq = 1u64 << VIRTIO_NET_F_MQ;
    let ctrl_vq = 1u64 << VIRTIO_NET_F_CTRL_VQ;
    let signals = Arc::new(RecordingInterrupt::default());
    let queues = mocks.iter().map(|m| Some(active_queue(m))).collect();
    net.activate(activation(&memory, queues, mq | ctrl_vq, &signals))
        .unwrap();
    let ctrl = &mocks[4];
    let (mq_class, set) = (
        VIRTIO_NET_CTRL_MQ as u8,
        VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8,
    );
    let base = DATA;
    control_chain(&memory, ctrl, 0, base, &[mq_class, set, 2, 0]);
    control_chain(&memory, ctrl, 2, base + 0x1000, &[mq_class, set, 3, 0]);
    control_chain(&memory, ctrl, 4, base + 0x2000, &[mq_class, set, 0, 0]);
    control_chain(&memory, ctrl, 6, base + 0x3000, &[0 /* RX mode */, 0, 1]);
    control_chain(&memory, ctrl, 8, base + 0x4000, &[mq_class]);
    // No writable byte for the ack at all.
    memory
        .write_slice(&[mq_class, set, 1, 0], GuestAddress(base + 0x5000))
        .unwrap();
    add_chain(ctrl, 10, &[descriptor(base + 0x5000, 4, false)]);
    // The worker makes a first pass over every queue when it starts; kick anyway.
    net.pause();
    net.resume().unwrap();
    wait_until("the control commands", || used(ctrl).len() == 6);
    assert_eq!(ack(&memory, base), VIRTIO_NET_OK as u8);
    for addr in [base + 0x1000, base + 0x2000, base + 0x3000, base + 0x4000] {
        assert_eq!(
            ack(&memory, addr),
            VIRTIO_NET_ERR as u8,
            "command at {addr:#x}"
        );
    }
    assert_eq!(used(ctrl)[0], (0, 1));
    assert_eq!(used(ctrl)[5], (10, 0));
    net.pause();
    assert_eq!(saved(&net).active_queue_pairs, 2);
    assert_eq!(net.pause().len(), 5);
    net.reset();
    assert_eq!(
        saved(&net).active_queue_pairs,
        1,
        "a reset goes back to one pair"
    );
}

#[test]
fn control_queue_is_queue_two_without_mq() {
    let memory = memory();
    let mocks = mock_queues(&memory, 3);
    let (mut net, _peers) = two_pair_net();
    let signals = Arc::new(RecordingInterrupt::default());
    let queues = mocks.iter().map(|m| Some(active_queue(m))).collect();
    net.activate(activation(
        &memory,
        queues,
        1 << VIRTIO_NET_F_CTRL_VQ,
        &signals,
    ))
    .unwrap();
    let set = [
        VIRTIO_NET_CTRL_MQ as u8,
        VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8,
        2,
        0,
    ];
    control_chain(&memory, &mocks[2], 0, DATA, &set);
    net.pause();
    net.resume().unwrap();
    wait_until("the control command", || used(&mocks[2]).len() == 1);
    assert_eq!(
        ack(&memory, DATA),
        VIRTIO_NET_ERR as u8,
        "pair 1 has no queues without MQ"
    );
    net.reset();
}

#[test]
fn restore_refuses_state_that_does_not_fit() {
    let (taps, _peers) = stand_in_taps(1);
    let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
    let state = net.save_state().unwrap();
    let crate::DeviceState::Net(fields) = &state else {
        panic!("not a net state: {state:?}")
    };
    assert_eq!(fields.mac, MacAddr::derived_from("eth0"));
    net.restore_state(&state).unwrap();
    for (bad, needle) in [
        (
            json!({"mac": "06:00:00:00:00:01", "num_queue_pairs": 2, "active_queue_pairs": 1}),
            "2 queue pairs",
        ),
        (
            json!({"mac": "06:00:00:00:00:01", "num_queue_pairs": 1, "active_queue_pairs": 0}),
            "0 active queue pairs",
        ),
    ] {
        let error = net.restore_state(&net_state(bad)).unwrap_err().to_string();
        assert!(error.contains(needle), "{error}");
    }
    let error = net
        .restore_state(&crate::DeviceState::Vsock(crate::vsock::VsockState {
            guest_cid: 3,
        }))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("a vsock state, this is a net device"),
        "{error}"
    );
    // What the state file cannot hold is refused as it is read.
    for bad in [
        json!({"mac": "01:00:00:00:00:01", "num_queue_pairs": 1, "active_queue_pairs": 1}),
        json!({"mac": "06:00:00:00:00:01", "num_queue_pairs": 1, "active_queue_pairs": 1, "x": 1}),
        json!("nonsense"),
    ] {
        let tagged = json!({ "net": bad });
        assert!(
            serde_json::from_value::<crate::DeviceState>(tagged.clone()).is_err(),
            "{tagged}"
        );
    }
}

#[test]
fn rate_limiters_update_while_running() {
    let memory = memory();
    let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&memory, GuestAddress(0x8000), 16);
    let (taps, peers) = stand_in_taps(1);
    let mut net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
    let signals = Arc::new(RecordingInterrupt::default());
    let rx = active_queue(&rxq);
    let rx_kick = rx.kick.try_clone().unwrap();
    net.activate(activation(
        &memory,
        vec![Some(rx), Some(active_queue(&txq))],
        0,
        &signals,
    ))
    .unwrap();
    let limited = ops_limit(1, 100);
    net.update_rate_limiters(limited, RateLimiterConfig::default())
        .unwrap();
    assert_eq!(net.config().rx_rate_limiter, limited);
    for slot in 0..3 {
        add_chain(
            &rxq,
            slot,
            &[descriptor(DATA + u64::from(slot) * 0x1000, 2000, true)],
        );
    }
    let mut datagram = vec![0u8; VNET_HDR_LEN];
    datagram.extend(frame(64, 1));
    let start = Instant::now();
    for _ in 0..3 {
        peers[0].send(&datagram).unwrap();
    }
    rx_kick.write(1).unwrap();
    wait_until("three rate-limited frames", || used(&rxq).len() == 3);
    // One op per 100 ms: the second and third frames wait about 100 ms each.
    assert!(
        start.elapsed() >= Duration::from_millis(150),
        "{:?}",
        start.elapsed()
    );
    net.reset();
}

/// The device's own state, typed.
fn saved(net: &Net) -> super::NetState {
    gpuvm_devices::Persist::save(net).unwrap()
}

/// A net state from its JSON fields (the buckets default).
fn net_state(fields: serde_json::Value) -> crate::DeviceState {
    serde_json::from_value(json!({ "net": fields })).unwrap()
}

/// An ARP request from the guest for the default MMDS address, after the virtio-net header.
fn mmds_arp_request() -> Vec<u8> {
    let guest_mac = [0x06, 0, 0, 0, 0, 2];
    let mut datagram = vec![0u8; VNET_HDR_LEN];
    datagram.extend_from_slice(&[0xff; 6]);
    datagram.extend_from_slice(&guest_mac);
    datagram.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    datagram.extend_from_slice(&guest_mac);
    datagram.extend_from_slice(&[169, 254, 0, 2]);
    datagram.extend_from_slice(&[0; 6]);
    datagram.extend_from_slice(&gpuvm_mmds::DEFAULT_IPV4.octets());
    datagram
}

/// The guest's ARP for the MMDS address: answered from the MMDS the device was given when
/// its configuration names the interface; sent to the tap otherwise (no MMDS given, or
/// one configured for other interfaces).
#[test]
fn mmds_answers_only_through_the_mmds_the_device_was_given() {
    let configured = Arc::new(gpuvm_mmds::Mmds::default());
    configured.set_config(Some(gpuvm_mmds::MmdsConfig::new(
        gpuvm_mmds::MmdsVersion::V1,
        vec!["eth0".into()],
    )));
    let elsewhere = Arc::new(gpuvm_mmds::Mmds::default());
    elsewhere.set_config(Some(gpuvm_mmds::MmdsConfig::new(
        gpuvm_mmds::MmdsVersion::V1,
        vec!["eth1".into()],
    )));
    for (mmds, answered) in [
        (Some(configured), true),
        (Some(elsewhere), false),
        (None, false),
    ] {
        let memory = memory();
        let rxq = MockSplitQueue::create(&memory, GuestAddress(0), 16);
        let txq = MockSplitQueue::create(&memory, GuestAddress(0x8000), 16);
        let (taps, peers) = stand_in_taps(1);
        let net = Net::new(NetConfig::new("eth0", None), taps).unwrap();
        let mut net = match mmds {
            Some(mmds) => net.with_mmds(mmds),
            None => net,
        };
        let signals = Arc::new(RecordingInterrupt::default());
        let (rx_kick, tx_kick) = activate_one_pair(&mut net, &memory, (&rxq, &txq), &signals);
        add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
        rx_kick.write(1).unwrap();
        let request = mmds_arp_request();
        memory
            .write_slice(&request, GuestAddress(DATA + 0x1000))
            .unwrap();
        add_chain(
            &txq,
            0,
            &[descriptor(DATA + 0x1000, request.len() as u32, false)],
        );
        tx_kick.write(1).unwrap();
        wait_until("the TX frame", || used(&txq).len() == 1);
        let mut buf = vec![0u8; 200];
        if answered {
            wait_until("the ARP reply", || used(&rxq).len() == 1);
            let mut reply = [0u8; 42];
            memory
                .read_slice(&mut reply, GuestAddress(DATA + VNET_HDR_LEN as u64))
                .unwrap();
            assert_eq!(
                &reply[22..28],
                &gpuvm_mmds::ip::MMDS_MAC,
                "the sender is MMDS"
            );
            assert!(peers[0].recv(&mut buf).is_err(), "nothing reached the tap");
        } else {
            let n = peers[0].recv(&mut buf).expect("the ARP went to the tap");
            assert_eq!(&buf[..n], &request[..]);
            assert!(used(&rxq).is_empty());
        }
        net.reset();
    }
}
