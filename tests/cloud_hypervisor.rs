//! gpuvm as `cloud-hypervisor` (a symlink to the binary), driven the way Kata
//! Containers' clh driver drives Cloud Hypervisor: ping, vm.create with a Kata-shaped
//! VmConfig, vm.info until Created, vm.boot, vm.info until Running, pause/resume, the
//! agent's hybrid vsock (`CONNECT 1024`), vmm.shutdown; vm.add-net with the tap passed
//! as a descriptor (SCM_RIGHTS), as Kata passes the taps it made in the pod's network
//! namespace (as root: the test makes a namespace and a tap); and the errors.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gpuvm_tests::netns::Netns;
use gpuvm_tests::{api_expect, gpuvm_bin, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);

fn state(api: &Path) -> String {
    let info = api_expect(api, 200, "GET", "/api/v1/vm.info", None);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    info["state"].as_str().unwrap().to_string()
}

/// Starts `cloud-hypervisor --api-socket <api> -v --seccomp true` (a symlink to gpuvm).
fn start(scratch: &Scratch) -> (SpawnedProcess, std::path::PathBuf) {
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let api = scratch.path("clh-api.sock");
    let mut vmm = SpawnedProcess::spawn(
        &link,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "-v",
            "--seccomp",
            "true",
        ],
    );
    wait_for_api_socket(&mut vmm, &api);
    (vmm, api)
}

fn kata_config(kernel: &Path, vsock: &Path, extra: &str) -> String {
    format!(
        r#"{{"payload":{{"kernel":"{}","cmdline":"virtio-vsock 1"}},
            "cpus":{{"boot_vcpus":1,"max_vcpus":4,"kvm_hyperv":false,"nested":true}},
            "memory":{{"size":134217728,"mergeable":false,"hotplug_method":"Acpi","shared":true,
                       "hugepages":false,"prefault":false,"thp":true,"hotplug_size":536870912}},
            "rng":{{"src":"/dev/urandom","iommu":false}},
            "serial":{{"mode":"Tty","iommu":false}},"console":{{"mode":"Off","iommu":false}},
            "vsock":{{"cid":3,"socket":"{}","iommu":false}},
            "platform":{{"num_pci_segments":2,"tdx":false,"sev_snp":false}},
            "iommu":false,"watchdog":false,"pvpanic":false,"landlock_enable":false{extra}}}"#,
        kernel.display(),
        vsock.display()
    )
}

#[test]
fn kata_sequence_boots_and_talks_to_the_guest_over_hybrid_vsock() {
    let scratch = Scratch::new("cloud_hypervisor", "kata");
    let kernel = scratch.path("guest.elf");
    let written = std::process::Command::new(gpuvm_bin())
        .args(["guest-image", "--output", kernel.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(written.success());
    let vsock = scratch.path("clh.sock");
    let (mut vmm, api) = start(&scratch);

    let ping = api_expect(&api, 200, "GET", "/api/v1/vmm.ping", None);
    assert!(ping.contains("\"version\""), "{ping}");
    api_expect(&api, 404, "GET", "/api/v1/vm.info", None);
    api_expect(&api, 404, "PUT", "/api/v1/vm.boot", None);
    // Bad JSON, an unknown field away from its default: 400, and nothing created.
    api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some("{"));
    let unknown = kata_config(&kernel, &vsock, r#","frobnicate":true"#);
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some(&unknown));
    assert!(refused.contains("frobnicate"), "{refused}");
    api_expect(&api, 404, "GET", "/api/v1/vm.info", None);

    let config = kata_config(&kernel, &vsock, "");
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    api_expect(&api, 409, "PUT", "/api/v1/vm.create", Some(&config));
    assert_eq!(state(&api), "Created");
    api_expect(&api, 405, "PUT", "/api/v1/vm.pause", None);
    let started = Instant::now();
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    assert_eq!(state(&api), "Running");
    eprintln!("vm.boot answered in {:?}", started.elapsed());
    vmm.wait_for_stdout("virtio-vsock: listening", LIMIT);

    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    assert_eq!(state(&api), "Paused");
    api_expect(&api, 204, "PUT", "/api/v1/vm.resume", None);
    assert_eq!(state(&api), "Running");
    let counters = api_expect(&api, 200, "GET", "/api/v1/vm.counters", None);
    assert!(counters.starts_with('{'), "{counters}");
    let resize = api_expect(
        &api,
        400,
        "PUT",
        "/api/v1/vm.resize",
        Some(r#"{"desired_vcpus":2}"#),
    );
    assert!(resize.contains("static_sandbox_resource_mgmt"), "{resize}");

    // The agent's hybrid vsock: CONNECT 1024 → OK <port>, then an echo.
    let mut stream = UnixStream::connect(&vsock).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream.write_all(b"CONNECT 1024\n").unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("OK "), "{line:?}");
    stream.write_all(b"kata agent").unwrap();
    let mut echo = [0u8; 10];
    std::io::Read::read_exact(&mut reader, &mut echo).unwrap();
    assert_eq!(&echo, b"kata agent");
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    drop(reader);

    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());
}

#[test]
fn vmm_shutdown_before_create_ends_the_process() {
    let scratch = Scratch::new("cloud_hypervisor", "shutdown");
    let (vmm, api) = start(&scratch);
    api_expect(&api, 404, "GET", "/api/v1/nope", None);
    api_expect(&api, 405, "GET", "/api/v1/vm.boot", None);
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vmm.wait(LIMIT).assert_code(0);
}

#[test]
fn gpuvm_routes_still_answer_beside_api_v1() {
    let scratch = Scratch::new("cloud_hypervisor", "both");
    let (vmm, api) = start(&scratch);
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains("gpuvm"), "{info}");
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vmm.wait(LIMIT).assert_code(0);
}

/// `PUT path` with `body`, the request's bytes sent in one sendmsg carrying `fds`
/// (SCM_RIGHTS), as Kata's clh driver sends vm.add-net; the status and the body answered.
fn put_with_fds(api: &Path, path: &str, body: &str, fds: &[RawFd]) -> (u16, String) {
    let mut stream = UnixStream::connect(api).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let request = format!(
        "PUT {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let bytes = request.as_bytes();
    let data_len = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain C data; all zero bytes is a valid value.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    if !fds.is_empty() {
        message.msg_control = control.as_mut_ptr().cast();
        message.msg_controllen = space as _;
        // SAFETY: the control buffer is `space` bytes, 8-aligned, room for one header and
        // `fds`; CMSG_FIRSTHDR and CMSG_DATA point inside it.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&message);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(data_len as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(header).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    // SAFETY: `message` points at `iov` (the request's bytes) and `control`, all of which
    // outlive the call; the descriptors are open (the kernel duplicates them).
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &message, 0) };
    assert!(sent > 0, "sendmsg: {}", std::io::Error::last_os_error());
    stream.write_all(&bytes[sent as usize..]).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

/// Kata's NIC: vm.add-net {mac, id} with the tap queue passed as a descriptor; then the
/// guest's `virtio-net` workload answers a UDP echo through that tap. Before that, what
/// is refused: no tap and no descriptor, a descriptor that is not a tap, two descriptors
/// for one queue pair, a named tap and a descriptor; and a snapshot of such a VM.
#[test]
fn add_net_with_a_passed_tap_descriptor() {
    let Some(netns) = Netns::create("add_net_with_a_passed_tap_descriptor") else {
        return;
    };
    let scratch = Scratch::new("cloud_hypervisor", "add_net_fds");
    let kernel = scratch.path("guest.elf");
    let written = Command::new(gpuvm_bin())
        .args(["guest-image", "--output", kernel.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(written.success());
    let (mut vmm, api) = start(&scratch);
    let config = format!(
        r#"{{"payload":{{"kernel":"{}","cmdline":"virtio-net {}"}},
            "cpus":{{"boot_vcpus":1,"max_vcpus":1}},"memory":{{"size":134217728}}}}"#,
        kernel.display(),
        netns.guest_ip()
    );
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));

    let add_net = "/api/v1/vm.add-net";
    let mac = format!("06:00:0a:00:{:02x}:02", netns.n);
    let body = format!(r#"{{"mac":"{mac}","id":"net0"}}"#);
    let refused = api_expect(&api, 400, "PUT", add_net, Some(&body));
    assert!(refused.contains("tap"), "{refused}");

    let (pipe, _writer) = std::io::pipe().unwrap();
    let (status, refused) = put_with_fds(&api, add_net, &body, &[pipe.as_raw_fd()]);
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused.contains("net0") && refused.contains("TUNGETIFF"),
        "{refused}"
    );

    let tap = netns.open_tap();
    let (status, refused) = put_with_fds(&api, add_net, &body, &[tap.as_raw_fd(), tap.as_raw_fd()]);
    assert_eq!(status, 400, "{refused}");
    assert!(refused.contains("1 queue pair"), "{refused}");

    let named = format!(r#"{{"mac":"{mac}","id":"net0","tap":"tap0"}}"#);
    let (status, refused) = put_with_fds(&api, add_net, &named, &[tap.as_raw_fd()]);
    assert_eq!(status, 400, "{refused}");

    let (status, answer) = put_with_fds(&api, add_net, &body, &[tap.as_raw_fd()]);
    assert_eq!(status, 204, "{answer}");
    // gpuvm holds its own copy: ours can go.
    drop(tap);
    let info = api_expect(&api, 200, "GET", "/api/v1/vm.info", None);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["config"]["net"][0]["id"], "net0", "{info}");

    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vmm.wait_for_stdout("virtio-net: sent gratuitous arp", LIMIT);
    assert!(
        vmm.stdout().contains(&format!("virtio-net: mac={mac}")),
        "{}",
        vmm.stdout()
    );
    // A restored VM could not reopen a passed tap: the snapshot is refused, naming it.
    let destination = format!(
        r#"{{"destination_url":"file://{}"}}"#,
        scratch.path("snap").display()
    );
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    assert!(refused.contains("net0"), "{refused}");

    let payload = b"through a passed tap".to_vec();
    assert_eq!(netns.udp_echo(&payload), payload);
    let out = vmm.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("virtio-net: ok");
    out.assert_stdout_has(&format!("virtio-net: echoed {} udp bytes", payload.len()));
}
