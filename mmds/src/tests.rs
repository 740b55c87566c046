//! The stack end to end with hand-built guest frames: ARP, the TCP handshake, a V2 token,
//! a GET, the close; and hostile frames.

use std::net::Ipv4Addr;

use serde_json::json;

use super::*;

const GUEST_MAC: [u8; 6] = [0x06, 0, 0, 0, 0, 2];
const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 2);

fn new_mmds() -> Arc<Mmds> {
    Arc::new(Mmds::default())
}

/// A TCP segment from the guest in an Ethernet frame.
fn segment(port: u16, seq: u32, ack: u32, flags: u8, data: &[u8]) -> Vec<u8> {
    let mut tcp = Vec::new();
    tcp.extend_from_slice(&40000u16.to_be_bytes());
    tcp.extend_from_slice(&port.to_be_bytes());
    tcp.extend_from_slice(&seq.to_be_bytes());
    tcp.extend_from_slice(&ack.to_be_bytes());
    tcp.extend_from_slice(&[0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    tcp.extend_from_slice(data);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&GUEST_IP.octets());
    pseudo.extend_from_slice(&DEFAULT_IPV4.octets());
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
    let sum = ip::checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    let mut frame = ip::ipv4_frame(ip::MMDS_MAC, GUEST_IP, DEFAULT_IPV4, 6, &tcp);
    frame[..6].copy_from_slice(&ip::MMDS_MAC);
    frame[6..12].copy_from_slice(&GUEST_MAC);
    frame
}

struct Reply {
    seq: u32,
    ack: u32,
    flags: u8,
    data: Vec<u8>,
}

fn replies(stack: &mut MmdsStack) -> Vec<Reply> {
    let mut out = Vec::new();
    while let Some(frame) = stack.next_reply() {
        assert_eq!(&frame[..6], &GUEST_MAC);
        let Frame::Ipv4(packet) = classify_back(&frame) else {
            panic!("a reply that is not IPv4");
        };
        let s = tcp::parse(packet.payload, DEFAULT_IPV4, GUEST_IP).expect("a valid segment");
        out.push(Reply {
            seq: s.seq,
            ack: s.ack,
            flags: s.flags,
            data: s.payload.to_vec(),
        });
    }
    out
}

use ip::Frame;

/// Parses a reply as the guest would (its IP as destination).
fn classify_back(frame: &[u8]) -> Frame<'_> {
    ip::classify(frame, GUEST_IP)
}

/// Opens a connection; returns (our next seq, MMDS's next seq).
fn connect(stack: &mut MmdsStack) -> (u32, u32) {
    assert!(stack.intercept(&segment(80, 1000, 0, 0x02, &[])));
    let synack = replies(stack);
    assert_eq!(synack.len(), 1);
    assert_eq!((synack[0].flags, synack[0].ack), (0x12, 1001));
    let theirs = synack[0].seq.wrapping_add(1);
    assert!(stack.intercept(&segment(80, 1001, theirs, 0x10, &[])));
    assert!(replies(stack).is_empty());
    (1001, theirs)
}

/// Sends a request; returns the response bytes and the replies' flags.
fn exchange(stack: &mut MmdsStack, ours: u32, theirs: u32, request: &str) -> (String, Vec<u8>) {
    assert!(stack.intercept(&segment(80, ours, theirs, 0x18, request.as_bytes())));
    let mut text = Vec::new();
    let mut flags = Vec::new();
    let mut expect = theirs;
    for reply in replies(stack) {
        assert_eq!(reply.seq, expect);
        assert_eq!(reply.ack, ours.wrapping_add(request.len() as u32));
        expect = expect.wrapping_add(reply.data.len() as u32);
        text.extend_from_slice(&reply.data);
        flags.push(reply.flags);
    }
    (String::from_utf8(text).unwrap(), flags)
}

#[test]
fn arp_then_a_v2_fetch_over_tcp() {
    let mmds = new_mmds();
    mmds.store()
        .put(json!({"latest": {"meta-data": {"instance-id": "i-1234"}}}))
        .unwrap();
    mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V2, vec!["eth0".into()])));
    assert!(mmds.stack_for("eth1").is_none());
    let mut stack = mmds.stack_for("eth0").unwrap();

    // Not for MMDS: left for the tap.
    let mut other = segment(80, 1, 0, 0x02, &[]);
    other[ip::ETH_HEADER_LEN + 19] = 1; // another destination (checksum no matter)
    assert!(!stack.intercept(&other));

    let (ours, theirs) = connect(&mut stack);
    let put = "PUT /latest/api/token HTTP/1.1\r\nX-metadata-token-ttl-seconds: 21600\r\n\r\n";
    let (answer, _) = exchange(&mut stack, ours, theirs, put);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let token = answer.rsplit("\r\n\r\n").next().unwrap().to_string();
    let ours = ours.wrapping_add(put.len() as u32);
    let theirs = theirs.wrapping_add(answer.len() as u32);

    let unauthorized = "GET /latest/meta-data/instance-id HTTP/1.1\r\n\r\n";
    let (answer, _) = exchange(&mut stack, ours, theirs, unauthorized);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    let ours = ours.wrapping_add(unauthorized.len() as u32);
    let theirs = theirs.wrapping_add(answer.len() as u32);

    let get = format!(
        "GET /latest/meta-data/instance-id HTTP/1.1\r\nX-metadata-token: {token}\r\nConnection: close\r\n\r\n"
    );
    let (answer, flags) = exchange(&mut stack, ours, theirs, &get);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("i-1234"),
        "{answer}"
    );
    assert_eq!(flags.last(), Some(&0x11), "FIN after the answer");
    // The guest acknowledges and closes too: the connection is gone.
    let ours = ours.wrapping_add(get.len() as u32);
    let theirs = theirs.wrapping_add(answer.len() as u32 + 1);
    assert!(stack.intercept(&segment(80, ours, theirs, 0x11, &[])));
    let last = replies(&mut stack);
    assert_eq!(last.len(), 1);
    assert_eq!(last[0].flags, 0x10);
    assert_eq!(stack.connections(), 0);
}

#[test]
fn v1_answers_a_large_value_in_segments() {
    let mmds = new_mmds();
    let big = "x".repeat(5000);
    mmds.store().put(json!({"big": big})).unwrap();
    mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V1, vec!["eth0".into()])));
    let mut stack = mmds.stack_for("eth0").unwrap();
    let (ours, theirs) = connect(&mut stack);
    let (answer, flags) = exchange(&mut stack, ours, theirs, "GET /big HTTP/1.1\r\n\r\n");
    assert!(answer.ends_with(&big), "{}", answer.len());
    assert!(flags.len() >= 4 && flags.iter().all(|f| f & 0x10 != 0));
    assert_eq!(stack.connections(), 1, "keep-alive");
}

#[test]
fn hostile_input_is_bounded() {
    let mmds = new_mmds();
    mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V1, vec!["eth0".into()])));
    let mut stack = mmds.stack_for("eth0").unwrap();
    // Data for no connection: reset. Another port: reset.
    assert!(stack.intercept(&segment(80, 5, 9, 0x10, b"GET")));
    assert!(stack.intercept(&segment(22, 5, 0, 0x02, &[])));
    let resets = replies(&mut stack);
    assert!(resets.len() == 2 && resets.iter().all(|r| r.flags & 0x04 != 0));
    // Too many connections: the one past the bound is reset.
    for port in 0..(tcp::MAX_CONNECTIONS as u16 + 3) {
        let mut frame = segment(80, 1, 0, 0x02, &[]);
        // A different source port per connection; the checksum is fixed up by hand.
        let tcp_at = ip::ETH_HEADER_LEN + ip::IPV4_HEADER_LEN;
        frame[tcp_at..tcp_at + 2].copy_from_slice(&(1000 + port).to_be_bytes());
        frame[tcp_at + 16..tcp_at + 18].copy_from_slice(&[0, 0]);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&GUEST_IP.octets());
        pseudo.extend_from_slice(&DEFAULT_IPV4.octets());
        pseudo.extend_from_slice(&[0, 6, 0, 20]);
        let sum = ip::checksum(&[&pseudo, &frame[tcp_at..]]);
        frame[tcp_at + 16..tcp_at + 18].copy_from_slice(&sum.to_be_bytes());
        assert!(stack.intercept(&frame));
    }
    assert_eq!(stack.connections(), tcp::MAX_CONNECTIONS);
    let _ = replies(&mut stack);
    // An over-long request: 400 and the connection closes.
    let mmds = new_mmds();
    mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V1, vec!["eth0".into()])));
    let mut stack = mmds.stack_for("eth0").unwrap();
    let (mut ours, theirs) = connect(&mut stack);
    let chunk = vec![b'a'; 1400];
    let mut answer = String::new();
    for _ in 0..8 {
        assert!(stack.intercept(&segment(80, ours, theirs, 0x10, &chunk)));
        ours = ours.wrapping_add(chunk.len() as u32);
        for reply in replies(&mut stack) {
            answer.push_str(&String::from_utf8_lossy(&reply.data));
        }
    }
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // Garbage and truncations of a valid frame never panic.
    let valid = segment(80, 1, 0, 0x02, &[]);
    for n in 0..valid.len() {
        let _ = stack.intercept(&valid[..n]);
    }
    for byte in 0..valid.len() {
        let mut bad = valid.clone();
        bad[byte] ^= 0xa5;
        let _ = stack.intercept(&bad);
    }
    assert!(stack.pending.len() <= MAX_PENDING_FRAMES);
}

#[test]
fn config_is_checked() {
    let mut config = MmdsConfig::new(MmdsVersion::V2, vec![]);
    assert_eq!(config.validate(), Err(ConfigError::NoInterfaces));
    config.network_interfaces.push("eth0".into());
    assert_eq!(config.validate(), Ok(()));
    config.ipv4_address = Ipv4Addr::new(10, 0, 0, 1);
    assert!(config.validate().is_err());
    let parsed: MmdsConfig =
        serde_json::from_value(json!({"network_interfaces": ["eth0"]})).unwrap();
    assert_eq!(
        (parsed.version, parsed.ipv4_address),
        (MmdsVersion::V1, DEFAULT_IPV4)
    );
}

#[test]
fn each_vm_has_its_own_mmds() {
    let first = new_mmds();
    first.store().set_limit(64);
    let second = new_mmds();
    first.store().put(json!({"vm": "first"})).unwrap();
    first.set_config(Some(MmdsConfig::new(MmdsVersion::V1, vec!["eth0".into()])));
    // Nothing of the first VM's store, limit or configuration shows in the second's.
    assert_eq!(second.store().data(), &json!({}));
    assert_eq!(second.store().limit(), DEFAULT_SIZE_LIMIT);
    assert!(second.stack_for("eth0").is_none());
    assert!(first.stack_for("eth0").is_some());
    let over = first.store().put(json!({"vm": "x".repeat(64)}));
    assert!(
        matches!(over, Err(DataStoreError::TooLarge { .. })),
        "{over:?}"
    );
    assert_eq!(first.store().data(), &json!({"vm": "first"}));
}
