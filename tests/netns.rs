//! A network namespace of a test's own with one tap, for the tests that run gpuvm's
//! virtio-net against a real tap (tests/virtio_net.rs, tests/linux_virtio.rs,
//! tests/cloud_hypervisor.rs): created as root, removed when dropped (also while a failing
//! test unwinds); tests print why and skip where it cannot be made.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::SpawnedProcess;

/// The guest's UDP echo port (the test guest's `virtio-net` workload).
pub const ECHO_PORT: u16 = 7;
/// Tells the namespaces (and their 10.0.<n>.0/24 subnets) of one test process apart.
static NEXT_NETNS: AtomicU32 = AtomicU32::new(1);

/// A network namespace with one tap, `tap0`, at 10.0.<n>.1/24 and up; the namespace (and so
/// the tap) is deleted when dropped, also while a failing test unwinds.
pub struct Netns {
    pub name: String,
    pub n: u32,
}

impl Netns {
    /// `None` (with the reason printed) where the test cannot run: not root, no iproute2.
    pub fn create(test: &str) -> Option<Netns> {
        // SAFETY: geteuid has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped {test}: needs root (creates a network namespace and a tap)");
            return None;
        }
        let n = NEXT_NETNS.fetch_add(1, Ordering::SeqCst);
        assert!(n < 255, "too many namespaces for 10.0.<n>.0/24");
        let name = format!("gpuvm-vnet-{}-{n}", std::process::id());
        match Command::new("ip").args(["netns", "add", &name]).output() {
            Err(error) => {
                eprintln!("skipped {test}: cannot run `ip` (is iproute2 installed?): {error}");
                return None;
            }
            Ok(output) if !output.status.success() => {
                eprintln!(
                    "skipped {test}: `ip netns add {name}` failed: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                );
                return None;
            }
            Ok(_) => {}
        }
        let netns = Netns { name, n };
        netns.ip(&["tuntap", "add", "dev", "tap0", "mode", "tap"]);
        netns.ip(&[
            "addr",
            "add",
            &format!("{}/24", netns.host_ip()),
            "dev",
            "tap0",
        ]);
        netns.ip(&["link", "set", "tap0", "up"]);
        Some(netns)
    }

    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, self.n as u8, 1)
    }

    pub fn guest_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, self.n as u8, 2)
    }

    /// Runs `program ARGS` inside the namespace to completion.
    pub fn exec(&self, program: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec {} {program}: {e}", self.name))
    }

    /// Runs `ip ARGS` inside the namespace; it must succeed.
    pub fn ip(&self, args: &[&str]) -> String {
        let output = self.exec("ip", args);
        assert!(
            output.status.success(),
            "ip {args:?} in {}: {}",
            self.name,
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Starts `gpuvm ARGS` inside the namespace.
    pub fn spawn_gpuvm(&self, args: &[&str]) -> SpawnedProcess {
        let gpuvm = crate::gpuvm_bin();
        let mut full = vec![
            "netns",
            "exec",
            &self.name,
            gpuvm.to_str().expect("UTF-8 gpuvm path"),
        ];
        full.extend_from_slice(args);
        SpawnedProcess::spawn(Path::new("ip"), &full)
    }

    /// Runs `work` on a thread that entered the namespace (setns affects only the calling
    /// thread); the sockets it makes live in the namespace.
    pub fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
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

    /// Sends `payload` from 10.0.<n>.1 to the guest's UDP port 7 and returns what comes back
    /// (tries again while nothing does: the first datagram may wait on ARP).
    pub fn udp_echo(&self, payload: &[u8]) -> Vec<u8> {
        let (host, guest) = (self.host_ip(), self.guest_ip());
        let payload = payload.to_vec();
        self.run(move || {
            let socket = UdpSocket::bind((host, 0)).expect("bind in the namespace");
            socket
                .set_read_timeout(Some(Duration::from_secs(3)))
                .unwrap();
            let target = SocketAddr::from((guest, ECHO_PORT));
            let mut buffer = [0u8; 2048];
            for _ in 0..5 {
                socket.send_to(&payload, target).expect("send to the guest");
                match socket.recv_from(&mut buffer) {
                    Ok((len, from)) => {
                        assert_eq!(from, target, "the echo comes from the guest's port 7");
                        return buffer[..len].to_vec();
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => panic!("recv from the guest: {e}"),
                }
            }
            panic!("no UDP echo from {target} after 5 tries");
        })
    }

    /// The MAC the namespace's neighbour table holds for the guest, if any.
    pub fn guest_neighbour(&self) -> Option<String> {
        let guest = self.guest_ip().to_string();
        let table = self.ip(&["neigh", "show", &guest, "dev", "tap0"]);
        let mut words = table.split_whitespace();
        words.find(|w| *w == "lladdr")?;
        words.next().map(str::to_string)
    }

    /// Opens a queue of `tap0` as Kata does before passing it: /dev/net/tun, TUNSETIFF
    /// with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR.
    pub fn open_tap(&self) -> OwnedFd {
        self.run(|| {
            let tun = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/net/tun")
                .expect("/dev/net/tun");
            // SAFETY: ifreq is plain C data; all zero bytes is a valid value.
            let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
            for (slot, byte) in request.ifr_name.iter_mut().zip(b"tap0") {
                *slot = *byte as libc::c_char;
            }
            request.ifr_ifru.ifru_flags =
                (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
            // SAFETY: TUNSETIFF reads and writes one ifreq, which `request` is.
            let result = unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut request) };
            assert_eq!(result, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
            OwnedFd::from(tun)
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace takes its tap with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}
