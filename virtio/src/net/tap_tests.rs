//! Tests against real taps, in a network namespace of their own (`ip netns add
//! gpuvm-net-test-<pid>...`, removed again even when a test fails). They need root and
//! iproute2; without either they print why and skip.

use std::net::UdpSocket;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::sync::Arc;

use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::test_util::{active_queue, add_chain, descriptor, used};
use super::{recv_with_fds, MacAddr, Net, NetConfig, Tap, TapError, VNET_HDR_LEN};
use crate::device::{Activation, VirtioDevice};
use crate::test_util::{wait_for, RecordingInterrupt};
use crate::GuestMemory;

const GUEST_MAC: [u8; 6] = [0x06, 0, 0, 0, 0, 0x02];
const HOST_IP: [u8; 4] = [10, 77, 0, 1];
const GUEST_IP: [u8; 4] = [10, 77, 0, 2];
const RX_BUFFERS: u64 = 0x10_0000;
const RX_BUFFER_LEN: u64 = 0x800;
const TX_BUFFER: u64 = 0x18_0000;

/// A network namespace that is deleted when dropped (also while a failing test unwinds).
struct Netns {
    name: String,
}

impl Netns {
    /// `None` (with the reason printed) where the test cannot run.
    fn create(suffix: &str, test: &str) -> Option<Netns> {
        // SAFETY: geteuid has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped {test}: needs root (creates a network namespace and a tap)");
            return None;
        }
        let name = format!("gpuvm-net-test-{}{suffix}", std::process::id());
        match Command::new("ip").args(["netns", "add", &name]).output() {
            Err(error) => {
                eprintln!("skipped {test}: cannot run `ip` (is iproute2 installed?): {error}");
                None
            }
            Ok(output) if !output.status.success() => {
                eprintln!(
                    "skipped {test}: `ip netns add {name}` failed: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                );
                None
            }
            Ok(_) => Some(Netns { name }),
        }
    }

    /// Runs `ip ARGS` inside the namespace.
    fn ip(&self, args: &[&str]) {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.name, "ip"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "ip {args:?} in {}: {}",
            self.name,
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A file of the namespace's /sys/class/net (`ip netns exec` mounts its sysfs).
    fn sys_net(&self, path: &str) -> String {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.name, "cat"])
            .arg(format!("/sys/class/net/{path}"))
            .output()
            .unwrap();
        assert!(output.status.success(), "cat /sys/class/net/{path}");
        String::from_utf8(output.stdout).unwrap().trim().to_string()
    }

    /// Runs `work` on a thread that entered the namespace (setns affects only the calling
    /// thread); what it creates (taps, sockets) stays in the namespace.
    fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let namespace = OwnedFd::from(std::fs::File::open(&path).unwrap());
            // SAFETY: setns with a namespace fd we own; it changes this thread's network
            // namespace only, and the thread ends after `work`.
            let result = unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(result, 0, "setns: {}", std::io::Error::last_os_error());
            work()
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace takes its taps with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn arp_request(sender_mac: [u8; 6], sender_ip: [u8; 4], target_ip: [u8; 4]) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend([0xff; 6]);
    frame.extend(sender_mac);
    frame.extend([0x08, 0x06]);
    frame.extend([0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    frame.extend(sender_mac);
    frame.extend(sender_ip);
    frame.extend([0; 6]);
    frame.extend(target_ip);
    frame.resize(60, 0);
    frame
}

/// Frames in the RX used ring so far (chain `n` is the buffer at slot `n`).
fn received_frames(memory: &GuestMemory, rx: &MockSplitQueue<GuestMemory>) -> Vec<Vec<u8>> {
    used(rx)
        .into_iter()
        .map(|(head, len)| {
            let mut bytes = vec![0u8; len as usize];
            let addr = RX_BUFFERS + u64::from(head) * RX_BUFFER_LEN;
            memory.read_slice(&mut bytes, GuestAddress(addr)).unwrap();
            assert_eq!(
                u16::from_le_bytes([bytes[10], bytes[11]]),
                1,
                "num_buffers is 1 in every RX header"
            );
            bytes.split_off(VNET_HDR_LEN)
        })
        .collect()
}

struct Guest<'m> {
    memory: &'m GuestMemory,
    rx: MockSplitQueue<'m, GuestMemory>,
    tx: MockSplitQueue<'m, GuestMemory>,
    tx_kick: vmm_sys_util::eventfd::EventFd,
}

/// Activates `net` over two mock queues, with every RX buffer posted.
fn activate<'m>(net: &mut Net, memory: &'m GuestMemory) -> Guest<'m> {
    let rx = MockSplitQueue::create(memory, GuestAddress(0), 64);
    let tx = MockSplitQueue::create(memory, GuestAddress(0x8000), 64);
    for slot in 0..64u16 {
        add_chain(
            &rx,
            slot,
            &[descriptor(
                RX_BUFFERS + u64::from(slot) * RX_BUFFER_LEN,
                RX_BUFFER_LEN as u32,
                true,
            )],
        );
    }
    let tx_queue = active_queue(&tx);
    let tx_kick = tx_queue.kick.try_clone().unwrap();
    net.activate(Activation {
        memory: memory.clone(),
        acked_features: 0,
        queues: vec![Some(active_queue(&rx)), Some(tx_queue)],
        interrupt: Arc::new(RecordingInterrupt::default()),
    })
    .unwrap();
    Guest {
        memory,
        rx,
        tx,
        tx_kick,
    }
}

impl Guest<'_> {
    fn send(&self, slot: u16, frame: &[u8]) {
        let addr = TX_BUFFER + u64::from(slot) * 0x1000;
        self.memory
            .write_slice(&[0; VNET_HDR_LEN], GuestAddress(addr))
            .unwrap();
        self.memory
            .write_slice(frame, GuestAddress(addr + VNET_HDR_LEN as u64))
            .unwrap();
        add_chain(
            &self.tx,
            slot,
            &[descriptor(addr, (VNET_HDR_LEN + frame.len()) as u32, false)],
        );
        self.tx_kick.write(1).unwrap();
    }
}

#[test]
fn real_tap_carries_frames_both_ways() {
    let Some(netns) = Netns::create("", "real_tap_carries_frames_both_ways") else {
        return;
    };
    let tap = netns.run(|| Tap::open("gpvtap0", false).unwrap());
    assert_eq!(tap.name(), "gpvtap0");
    netns.ip(&["addr", "add", "10.77.0.1/24", "dev", "gpvtap0"]);
    netns.ip(&["link", "set", "gpvtap0", "up"]);
    let host_mac: MacAddr = netns.sys_net("gpvtap0/address").parse().unwrap();
    let udp = netns.run(|| UdpSocket::bind("10.77.0.1:0").unwrap());

    let memory = GuestMemory::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
    let mut config = NetConfig::new("eth0", Some("gpvtap0"));
    config.guest_mac = Some(MacAddr::new(GUEST_MAC).unwrap());
    let mut net = Net::new(config, vec![tap]).unwrap();
    let guest = activate(&mut net, &memory);

    // TX: an ARP request from the guest reaches the host's stack, which answers it: the
    // answer is an RX frame.
    guest.send(0, &arp_request(GUEST_MAC, GUEST_IP, HOST_IP));
    wait_for("the ARP request to go out", || {
        (used(&guest.tx).len() == 1).then_some(())
    });
    let reply = wait_for("the host's ARP reply", || {
        received_frames(&memory, &guest.rx)
            .into_iter()
            .find(|f| f.len() >= 42 && f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2])
    });
    assert_eq!(&reply[0..6], &GUEST_MAC, "to the guest");
    assert_eq!(&reply[6..12], &host_mac.bytes(), "from the tap");
    assert_eq!(&reply[22..28], &host_mac.bytes(), "sender hardware address");
    assert_eq!(&reply[28..32], &HOST_IP, "sender protocol address");

    // RX: a datagram from a socket in the namespace to the guest's address arrives as a
    // frame (the host learnt the guest's MAC from its request).
    let payload = b"hello from the host side";
    udp.send_to(payload, (std::net::Ipv4Addr::from(GUEST_IP), 9999))
        .unwrap();
    let datagram = wait_for("the UDP frame", || {
        received_frames(&memory, &guest.rx)
            .into_iter()
            .find(|f| f.len() >= 42 && f[12..14] == [0x08, 0x00] && f[23] == 17)
    });
    assert_eq!(&datagram[0..6], &GUEST_MAC);
    assert_eq!(&datagram[30..34], &GUEST_IP, "IPv4 destination");
    assert_eq!(
        &datagram[36..38],
        &9999u16.to_be_bytes(),
        "UDP destination port"
    );
    assert_eq!(&datagram[42..42 + payload.len()], payload);

    let stats = net.stats();
    assert_eq!(
        (stats.tx_packets, stats.tx_bytes, stats.tx_dropped),
        (1, 60, 0)
    );
    assert!(stats.rx_packets >= 2, "{stats:?}");
    net.reset();
}

/// Opens a tap the way a container runtime would, with the given TUNSETIFF flags.
fn open_tap_raw(name: &str, flags: libc::c_int) -> OwnedFd {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .unwrap();
    // SAFETY: ifreq is plain C data; all zero bytes is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(name.bytes()) {
        *slot = byte as libc::c_char;
    }
    request.ifr_ifru.ifru_flags = flags as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes the one ifreq passed.
    let result = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut request) };
    assert_eq!(result, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
    OwnedFd::from(file)
}

#[test]
fn tap_fd_passed_over_a_unix_socket_backs_a_device() {
    let Some(netns) = Netns::create("-fd", "tap_fd_passed_over_a_unix_socket_backs_a_device")
    else {
        return;
    };
    let (good, plain) = netns.run(|| {
        (
            open_tap_raw(
                "gpvtapfd",
                libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR,
            ),
            open_tap_raw("gpvtapplain", libc::IFF_TAP | libc::IFF_NO_PI),
        )
    });
    netns.ip(&["link", "set", "gpvtapfd", "up"]);

    // What the API server does with the descriptors a runtime sends it.
    let (runtime, api) = UnixStream::pair().unwrap();
    runtime
        .send_with_fds(&[&b"add-net"[..]], &[good.as_raw_fd(), plain.as_raw_fd()])
        .unwrap();
    drop((good, plain));
    let mut buf = [0u8; 16];
    let (read, mut fds) = recv_with_fds(&api, &mut buf, 4).unwrap();
    assert_eq!(&buf[..read], b"add-net");
    assert_eq!(fds.len(), 2);

    let error = Tap::from_fd(fds.pop().unwrap()).unwrap_err();
    assert!(
        matches!(error, TapError::WrongFlags { ref name, .. } if name == "gpvtapplain"),
        "{error}"
    );

    let tap = Tap::from_fd(fds.pop().unwrap()).unwrap();
    assert_eq!(tap.name(), "gpvtapfd");
    let memory = GuestMemory::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
    let mut net = Net::new(NetConfig::new("eth1", None), vec![tap]).unwrap();
    let guest = activate(&mut net, &memory);
    let before: u64 = netns
        .sys_net("gpvtapfd/statistics/rx_packets")
        .parse()
        .unwrap();
    let guest_mac = net.mac().bytes();
    guest.send(0, &arp_request(guest_mac, GUEST_IP, HOST_IP));
    wait_for("the frame to go out", || {
        (used(&guest.tx).len() == 1).then_some(())
    });
    assert_eq!(net.stats().tx_packets, 1);
    let after: u64 = wait_for("the host to count the frame", || {
        let now: u64 = netns
            .sys_net("gpvtapfd/statistics/rx_packets")
            .parse()
            .unwrap();
        (now > before).then_some(now)
    });
    assert_eq!(
        after,
        before + 1,
        "the host got exactly the frame the guest sent"
    );
    net.reset();
}
