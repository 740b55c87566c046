//! Shared by the tests that run gpuvm as `cloud-hypervisor`: the symlink, the test guest
//! as a kernel file, and vm.info's state.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{api_expect, gpuvm_bin, Scratch, SpawnedProcess};

/// The embedded test guest written to `scratch/guest.elf` (`gpuvm guest-image`), for
/// `--kernel` and `payload.kernel`.
pub fn guest_image(scratch: &Scratch) -> PathBuf {
    let kernel = scratch.path("guest.elf");
    let written = Command::new(gpuvm_bin())
        .args(["guest-image", "--output", kernel.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(written.success(), "gpuvm guest-image failed");
    kernel
}

/// `cloud-hypervisor ARGS` through a symlink named so in `scratch`.
pub fn spawn_ch(scratch: &Scratch, args: &[&str]) -> SpawnedProcess {
    let link = scratch.path("cloud-hypervisor");
    if !link.exists() {
        std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    }
    SpawnedProcess::spawn(&link, args)
}

/// `GET /api/v1/vm.info`, parsed.
pub fn vm_info(api: &Path) -> serde_json::Value {
    serde_json::from_str(&api_expect(api, 200, "GET", "/api/v1/vm.info", None)).unwrap()
}

/// The VM's state as vm.info gives it (Created, Running, Paused).
pub fn vm_state(api: &Path) -> String {
    vm_info(api)["state"].as_str().unwrap().to_string()
}

/// Waits until vm.info answers: a VM created by the command line (`--kernel`,
/// `--restore`) exists only once the start-up requests are through, a moment after the
/// API socket is up.
pub fn wait_for_vm(process: &mut SpawnedProcess, api: &Path, limit: std::time::Duration) {
    process.wait_until("the VM", limit, |_| {
        gpuvm_api::client::request(api, "GET", "/api/v1/vm.info", None)
            .is_ok_and(|r| r.status == 200)
    });
}

/// The ids of the disks in a vm.info answer's configuration, in its order.
pub fn disk_ids(info: &serde_json::Value) -> Vec<String> {
    info["config"]["disks"]
        .as_array()
        .map(|disks| {
            disks
                .iter()
                .filter_map(|d| d["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// `cloud-hypervisor` ([`spawn_ch`]) booting the test guest ([`guest_image`]) with `cmdline`
/// and `options` (`--cpus`, `--memory`, devices...) after [`test_guest_args`], once vm.info
/// answers (panics after `limit`).
pub fn boot_test_guest(
    scratch: &Scratch,
    api: &Path,
    cmdline: &str,
    options: &[&str],
    limit: Duration,
) -> SpawnedProcess {
    let kernel = guest_image(scratch);
    let mut args = test_guest_args(api, &kernel, cmdline);
    args.extend_from_slice(options);
    let mut vm = spawn_ch(scratch, &args);
    wait_for_vm(&mut vm, api, limit);
    vm
}

/// Connects to `api` and sends `request` in one sendmsg carrying `fds` (SCM_RIGHTS) when
/// there are any, as Kata's clh driver sends vm.add-net; returns the stream for the answer
/// (reads time out after 30 s).
pub fn send_with_fds(api: &Path, request: &[u8], fds: &[RawFd]) -> UnixStream {
    let mut stream =
        UnixStream::connect(api).unwrap_or_else(|e| panic!("connect to {}: {e}", api.display()));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let data_len = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: request.as_ptr() as *mut libc::c_void,
        iov_len: request.len(),
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
    // SAFETY: `message` points at `iov` (the request's bytes) and `control`, which outlive
    // the call; the descriptors are open (the kernel duplicates them).
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &message, 0) };
    assert!(sent > 0, "sendmsg: {}", std::io::Error::last_os_error());
    stream.write_all(&request[sent as usize..]).unwrap();
    stream
}

/// `PUT path` with `body` and `fds` passed with it (see [`send_with_fds`]); the status and
/// the body answered.
pub fn put_with_fds(api: &Path, path: &str, body: &str, fds: &[RawFd]) -> (u16, String) {
    let request = format!(
        "PUT {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = send_with_fds(api, request.as_bytes(), fds);
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

/// The command line every test-guest VM of a Cloud Hypervisor test starts from: the API
/// socket `api`, the test guest `kernel` running `cmdline`, the serial port on stdout and
/// no console. Callers add their `--cpus`, `--memory`, devices and `--seccomp`.
pub fn test_guest_args<'a>(api: &'a Path, kernel: &'a Path, cmdline: &'a str) -> Vec<&'a str> {
    vec![
        "--api-socket",
        api.to_str().unwrap(),
        "--kernel",
        kernel.to_str().unwrap(),
        "--cmdline",
        cmdline,
        "--serial",
        "tty",
        "--console",
        "off",
    ]
}
