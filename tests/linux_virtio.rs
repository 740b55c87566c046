//! gpuvm's virtio-pci devices under Linux's own drivers: a trimmed kernel with virtio-pci,
//! virtio-blk, virtio-net, vsock, virtio-fs and virtio-rng built in, made by
//! guest-images/linux/build-virtio-kernel.sh (`vmlinux-virtio`), boots with its 8 MiB ext4
//! image (`rootfs-virtio.ext4`) as a read-only virtio disk and mounts it as its root file system;
//! the same kernel brings eth0 up on a tap with kernel IP autoconfiguration (`ip=`) and answers
//! ping from the host, mounts a directory virtiofsd serves as its root, and mounts the ext4 image
//! served by qemu-storage-daemon as a vhost-user-blk disk.
//!
//! Linux's user space cannot run on hosts where guest ring 0 is emulated (see ENVIRONMENT.md),
//! so the tests read what the kernel's drivers print, and stop at the root mount (or at the
//! kernel's attempt to start init). Tests that need root (a network namespace, a tap) or a
//! backend that is not installed (virtiofsd, qemu-storage-daemon) say so on stderr and pass
//! without running.
//!
//! Each boot is CPU-bound in the host's instruction emulator: one at a time, each test here
//! took 46 to 60 s on the 2-core development host (205 s for the four); with cargo's default
//! two test threads on those two cores (and other builds running or not), each took 45 to
//! 205 s and the four 144 to 249 s.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::netns::Netns;
use gpuvm_tests::vhost_user_support::{backend_binary, start_virtiofsd, Backend};
use gpuvm_tests::{boot_until_marker, linux_guest_file, RunOutput, Scratch, SpawnedProcess};

/// Kernel arguments that get the kernel past what the nested emulator lacks; each test adds
/// where its root is.
const BASE_CMDLINE: &str = "console=ttyS0 noxsave mitigations=off \
    clearcpuid=popcnt,smap,ssse3 cryptomgr.notests \
    initcall_blacklist=init_kprobe_trace,ftrace_check_for_weak_functions panic=-1";

/// The virtio disk `vda` as a read-only ext4 root.
const EXT4_ROOT: &str = "root=/dev/vda ro rootfstype=ext4";

/// How long a boot may take to reach what a test waits for: about 35 to 60 s here, with room
/// for a much busier machine.
const BOOT_LIMIT: Duration = Duration::from_secs(480);

fn cmdline(root_and_more: &str) -> String {
    format!("{BASE_CMDLINE} {root_and_more}")
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

fn image(name: &str) -> PathBuf {
    linux_guest_file(
        name,
        "build the virtio kernel and its ext4 image with \
         guest-images/linux/build-virtio-kernel.sh (scripts/test.sh does)",
    )
}

/// `gpuvm run` arguments that boot vmlinux-virtio (256 MiB, an entropy device) with `cmdline`
/// and the devices in `devices`.
fn linux_args(cmdline: &str, devices: &[&str]) -> Vec<String> {
    let kernel = image("vmlinux-virtio");
    let mut args: Vec<String> = [
        "run",
        "--kernel",
        arg(&kernel),
        "--memory",
        "256M",
        "--cmdline",
        cmdline,
    ]
    .map(String::from)
    .to_vec();
    args.extend(devices.iter().map(|d| d.to_string()));
    args.push("--rng".into());
    args
}

/// Runs gpuvm with `args` until the console shows `marker` (a whole line).
fn boot_until(args: &[String], marker: &str, limit: Duration) -> RunOutput {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    boot_until_marker(&args, limit, marker)
}

/// The ext4 image as the drive `id=root` (made absolute: the API side wants absolute image
/// paths).
fn ext4_drive() -> String {
    let rootfs = std::fs::canonicalize(image("rootfs-virtio.ext4")).expect("rootfs path");
    format!("id=root,path={},ro", arg(&rootfs))
}

/// Boots vmlinux-virtio with the ext4 image as the read-only drive `root` and an entropy
/// device, until the console shows `marker`.
fn boot_virtio_until(marker: &str, limit: Duration) -> RunOutput {
    let drive = ext4_drive();
    boot_until(
        &linux_args(&cmdline(EXT4_ROOT), &["--drive", &drive]),
        marker,
        limit,
    )
}

fn assert_lines(out: &RunOutput, lines: &[&str]) {
    for line in lines {
        assert!(
            out.stdout.contains(line),
            "no {line:?} from the kernel\n--- stdout\n{}\n--- stderr\n{}",
            out.stdout,
            out.stderr
        );
    }
}

/// What the kernel prints when it probes one virtio disk of 8 MiB, mounts the ext4 image on
/// it read-only as its root and mounts devtmpfs on the image's /dev; no I/O or ext4 error, no
/// failed probe.
fn assert_ext4_root_on_virtio_blk(out: &RunOutput) {
    assert_lines(
        out,
        &[
            // virtio 1.x functions on the PCI bus: 1af4:1042 block, 1af4:1044 entropy.
            "[1af4:1042] type 00 class",
            "[1af4:1044] type 00 class",
            "Linux version 6.1.",
            "random: crng init done",
            "default/read/poll queues",
            "[vda] 16384 512-byte logical blocks (8.39 MB/8.00 MiB)",
            "EXT4-fs (vda): mounted filesystem with ordered data mode.",
            "VFS: Mounted root (ext4 filesystem) readonly on device",
        ],
    );
    // Both probe lines ("virtio_blk virtioN: ...") are virtio_blk's, for one virtio device.
    let blk_lines: Vec<(&str, &str)> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once("virtio_blk ")?.1.split_once(": "))
        .collect();
    assert!(
        blk_lines.len() == 2
            && blk_lines[0].0 == blk_lines[1].0
            && blk_lines[0].1.ends_with("default/read/poll queues")
            && blk_lines[1]
                .1
                .starts_with("[vda] 16384 512-byte logical blocks"),
        "virtio_blk did not probe exactly one disk: {blk_lines:?}\n--- stdout\n{}",
        out.stdout
    );
    assert_none_of(
        out,
        &[
            "I/O error",
            "EXT4-fs error",
            "EXT4-fs warning",
            "virtio_blk: probe of",
        ],
    );
}

/// Fails if the kernel printed any of `bad`, or a virtio driver failed to probe (the driver
/// core's "DRIVER: probe of DEVICE failed with error N").
fn assert_none_of(out: &RunOutput, bad: &[&str]) {
    for bad in bad
        .iter()
        .chain(&["virtio-pci: probe of", "virtio_rng: probe of"])
    {
        assert!(
            !out.stdout.contains(bad),
            "the kernel printed {bad:?}\n--- stdout\n{}\n--- stderr\n{}",
            out.stdout,
            out.stderr
        );
    }
}

/// Linux's virtio-pci driver binds gpuvm's block and entropy functions; virtio_blk reads the
/// capacity from the device's configuration space (8 MiB: 16384 sectors of 512 bytes); ext4
/// reads its superblock and checksummed metadata through the device and mounts vda read-only
/// as the root file system, and the kernel then finds /dev on it to mount devtmpfs there.
///
/// virtio-rng prints nothing when it probes (drivers/char/hw_random/virtio-rng.c has no
/// message, nor does the hwrng core when a device registers). What shows that it works: it
/// registers as the best hwrng (quality 1000), the core's khwrngd reads from the device and
/// credits the entropy, and the kernel prints "random: crng init done" as the virtio drivers
/// probe. Without `--rng` this kernel had not printed it 140 s into its boot.
///
/// Measured on the 2-core development host under load (debug build, 256 MiB, 1 vCPU): banner
/// 8.8 s after gpuvm started (when the serial console comes up), virtio_blk's capacity line
/// at 29.6 s, the ext4 mount at 34.6 s; this test passed in 34.7 s. The limit leaves room for
/// a much busier machine.
#[test]
fn vmlinux_virtio_mounts_ext4_root_from_virtio_blk() {
    let out = boot_virtio_until("devtmpfs: mounted", BOOT_LIMIT);
    assert_ext4_root_on_virtio_blk(&out);
}

/// Asserts that stdout has a line holding each of `needles`, in this order (panics naming the
/// first one missing or out of order).
fn assert_in_order(out: &RunOutput, needles: &[&str]) {
    let mut lines = out.stdout.lines();
    for needle in needles {
        assert!(
            lines.any(|line| line.contains(needle)),
            "no {needle:?} (or not in this order: {needles:?})\n{}",
            out.describe()
        );
    }
}

/// Seconds the kernel waits before it mounts its root (`rootdelay=`) in the network test: the
/// guest sits idle after IP autoconfiguration, and the host pings it then.
const ROOT_DELAY_S: u32 = 10;

/// Linux's virtio_net binds gpuvm's network function on a tap (`--net
/// id=eth0,tap=tap0,mac=06:00:0a:00:00:02`), reads the MAC from the device's configuration
/// space and sees the link up; kernel IP autoconfiguration (CONFIG_IP_PNP, `ip=` on the command
/// line: static address, no DHCP) opens eth0 from a late initcall, before the root mount, and
/// prints
///
/// ```text
/// IP-Config: Complete:
///      device=eth0, hwaddr=06:00:0a:00:00:02, ipaddr=10.0.<n>.2, mask=255.255.255.0, gw=10.0.<n>.1
/// ```
///
/// The kernel then answers ARP and ICMP echo itself (in softirq: no user space needed), but not
/// after it panics for want of an init (measured with `panic=0`, which keeps the panicked
/// kernel up: a ping sent after "Kernel panic - not syncing: No working init found" went
/// unanswered and the host's neighbour entry was FAILED). So
/// `rootdelay=10` holds the boot for 10 s of guest time after IP-Config ("Waiting 10 sec before
/// mounting root device..."), with the kernel idle; the host pings 10.0.<n>.2 from the
/// namespace then, and its neighbour table must hold the guest at 06:00:0a:00:00:02 (the
/// guest's ARP answer). The boot then goes on to mount the ext4 root from virtio-blk as in
/// [`vmlinux_virtio_mounts_ext4_root_from_virtio_blk`].
///
/// Measured on the 2-core development host under load (debug build, 256 MiB, 1 vCPU, tests
/// one at a time): the root delay's line 48.6 s after gpuvm started, the ping answered 0.08 s
/// later, devtmpfs mounted at 59.5 s (10 s of it the root delay).
#[test]
fn vmlinux_virtio_brings_eth0_up_with_its_mac_and_answers_ping() {
    let test = "vmlinux_virtio_brings_eth0_up_with_its_mac_and_answers_ping";
    let Some(netns) = Netns::create(test) else {
        return;
    };
    let mac = "06:00:0a:00:00:02";
    let (host, guest) = (netns.host_ip(), netns.guest_ip());
    let cmdline = cmdline(&format!(
        "{EXT4_ROOT} ip={guest}::{host}:255.255.255.0::eth0:off rootdelay={ROOT_DELAY_S}"
    ));
    let drive = ext4_drive();
    let net = format!("id=eth0,tap=tap0,mac={mac}");
    let started = Instant::now();
    let args = linux_args(&cmdline, &["--drive", &drive, "--net", &net]);
    let mut vm = netns.spawn_gpuvm(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let waiting = format!("Waiting {ROOT_DELAY_S} sec before mounting root device...");
    vm.wait_for_stdout(&waiting, BOOT_LIMIT);
    eprintln!("{waiting:?} after {:?}", started.elapsed());

    let ping = netns.exec("ping", &["-c", "1", "-W", "5", &guest.to_string()]);
    let ping_stdout = String::from_utf8_lossy(&ping.stdout).into_owned();
    eprintln!("ping returned {:?} after gpuvm started", started.elapsed());
    let neighbour = netns.guest_neighbour();

    let mounted = "devtmpfs: mounted";
    vm.wait_until(&format!("{mounted:?} on stdout"), BOOT_LIMIT, |p| {
        p.stdout()
            .split_once(mounted)
            .is_some_and(|(_, rest)| rest.contains('\n'))
    });
    eprintln!("{mounted:?} after {:?}", started.elapsed());
    vm.signal(libc::SIGKILL);
    let out = vm.wait(Duration::from_secs(10));

    assert!(
        ping.status.success() && ping_stdout.contains("1 received"),
        "ping {guest} during the root delay failed: {ping_stdout}{}\n{}",
        String::from_utf8_lossy(&ping.stderr),
        out.describe()
    );
    assert_eq!(
        neighbour.as_deref(),
        Some(mac),
        "the host's neighbour entry for {guest}\n{}",
        out.describe()
    );
    let config_line =
        format!("     device=eth0, hwaddr={mac}, ipaddr={guest}, mask=255.255.255.0, gw={host}");
    assert_in_order(
        &out,
        &[
            // virtio 1.x network function on the PCI bus: 1af4:1041.
            "[1af4:1041] type 00 class",
            "IP-Config: Complete:",
            &config_line,
            &waiting,
            "VFS: Mounted root (ext4 filesystem) readonly on device",
            mounted,
        ],
    );
    // The device line comes right after "IP-Config: Complete:" (the kernel's timestamps first).
    let complete_then_device = out
        .stdout
        .lines()
        .zip(out.stdout.lines().skip(1))
        .any(|(a, b)| a.ends_with("IP-Config: Complete:") && b.ends_with(&config_line));
    assert!(complete_then_device, "{}", out.describe());
    assert_none_of(
        &out,
        &[
            "virtio_net: probe of",
            "IP-Config: Device `eth0' not found",
            "IP-Config: No network devices available",
            "Waiting up to",
            "I/O error",
        ],
    );
}

/// Linux's virtio_fs binds gpuvm's virtio-fs function (1af4:105a), a vhost-user device served
/// by virtiofsd (`--fs tag=rootfs,socket=SOCK`), and the kernel mounts the tag as its root.
/// Linux 6.1 has this (`root=TAG rootfstype=virtiofs`: init/do_mounts.c mount_nodev_root, since
/// 5.15, for file system types that need no block device). The kernel prints nothing when
/// virtio_fs probes; what it prints is the mount, "VFS: Mounted root (virtiofs filesystem)
/// readonly on device 0:N.", then "devtmpfs: mounted" (a FUSE LOOKUP of /dev in the shared
/// directory). The directory also holds /sbin/init, mode 0755 and not an ELF file: the kernel
/// looks it up, opens it and reads its first bytes through FUSE, finds no binary format for
/// them and prints "Starting init: /sbin/init exists but couldn't execute it (error -8)"
/// (ENOEXEC; a file it could not read would fail differently, a missing one is skipped
/// silently), which is where the test stops.
///
/// Measured on the 2-core development host under load (debug build, tests one at a time): the
/// virtiofs root mounted at 33 s of guest time, the init line 49.9 s after gpuvm started.
#[test]
fn vmlinux_virtio_mounts_a_virtiofsd_directory_as_root() {
    let test = "vmlinux_virtio_mounts_a_virtiofsd_directory_as_root";
    let Some(virtiofsd) = backend_binary("virtiofsd", "linux_virtio", test) else {
        return;
    };
    let scratch = Scratch::new("linux_virtio", "virtiofs");
    let shared = scratch.path("shared");
    std::fs::create_dir_all(shared.join("dev")).unwrap();
    std::fs::create_dir_all(shared.join("sbin")).unwrap();
    std::fs::write(
        shared.join("hello"),
        "gpuvm-virtio: hello from the virtiofs root\n",
    )
    .unwrap();
    let init = shared.join("sbin/init");
    std::fs::write(
        &init,
        "not an executable format: the kernel reads this and gives up\n",
    )
    .unwrap();
    std::fs::set_permissions(&init, std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = scratch.path("virtiofsd.sock");
    let _backend = start_virtiofsd(&virtiofsd, &shared, &socket);
    let fs = format!("tag=rootfs,socket={}", arg(&socket));
    let init_failed = "Starting init: /sbin/init exists but couldn't execute it (error -8)";
    let out = boot_until(
        &linux_args(
            &cmdline("root=rootfs rootfstype=virtiofs ro"),
            &["--fs", &fs],
        ),
        init_failed,
        BOOT_LIMIT,
    );
    assert_in_order(
        &out,
        &[
            "Linux version 6.1.",
            // virtio 1.x file system function on the PCI bus: 1af4:105a (device ID 26).
            "[1af4:105a] type 00 class",
            "fuse: init (API version",
            "VFS: Mounted root (virtiofs filesystem) readonly on device 0:",
            "devtmpfs: mounted",
            "Run /sbin/init as init process",
            init_failed,
        ],
    );
    assert_none_of(
        &out,
        &[
            "virtio_fs: probe of",
            "virtio-fs: tag <rootfs> not found",
            "VFS: Cannot open root device",
            "devtmpfs: error mounting",
        ],
    );
}

/// The ext4 image served by qemu-storage-daemon as a read-only vhost-user-blk export (`--drive
/// id=root,vhost_user=SOCK`): Linux's virtio_blk probes it like gpuvm's own virtio-blk (the
/// same PCI function, 1af4:1042; capacity and features come from the backend through gpuvm),
/// and the kernel mounts the ext4 root from it with the same lines and no errors as in
/// [`vmlinux_virtio_mounts_ext4_root_from_virtio_blk`]. qemu-storage-daemon serves a copy of the
/// image (it takes its own lock on the file).
///
/// Measured on the 2-core development host under load (debug build, tests one at a time):
/// devtmpfs mounted 49.4 s after gpuvm started.
#[test]
fn vmlinux_virtio_mounts_ext4_root_from_vhost_user_blk() {
    let test = "vmlinux_virtio_mounts_ext4_root_from_vhost_user_blk";
    let Some(qsd) = backend_binary("qemu-storage-daemon", "linux_virtio", test) else {
        return;
    };
    let scratch = Scratch::new("linux_virtio", "vhost-user-blk");
    let rootfs = scratch.path("rootfs-virtio.ext4");
    std::fs::copy(image("rootfs-virtio.ext4"), &rootfs).expect("copy the ext4 image");
    let socket = scratch.path("qsd.sock");
    let _backend = Backend::start(
        "qemu-storage-daemon",
        &qsd,
        &[
            "--blockdev",
            &format!(
                "driver=file,node-name=file0,filename={},read-only=on",
                arg(&rootfs)
            ),
            "--blockdev",
            "driver=raw,node-name=disk0,file=file0,read-only=on",
            "--export",
            &format!(
                "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={},\
                 writable=off",
                arg(&socket)
            ),
        ],
        &socket,
    );
    let drive = format!("id=root,vhost_user={}", arg(&socket));
    let out = boot_until(
        &linux_args(&cmdline(EXT4_ROOT), &["--drive", &drive]),
        "devtmpfs: mounted",
        BOOT_LIMIT,
    );
    assert_ext4_root_on_virtio_blk(&out);
}

/// Linux finds a virtio disk on PCI segment 1: gpuvm as Cloud Hypervisor with
/// `platform.num_pci_segments: 2` and the ext4 image as a disk with `pci_segment: 1` (the
/// entropy device stays on segment 0). The kernel reads the MCFG's two ECAM windows and
/// the DSDT's two host bridges (`PNP0A08:01` with `_SEG` 1), enumerates bus 0001:00
/// through segment 1's ECAM, and mounts the disk as its root.
#[test]
fn vmlinux_virtio_finds_a_disk_on_pci_segment_1() {
    use gpuvm_tests::{api_expect, gpuvm_bin, wait_for_api_socket};

    let scratch = Scratch::new("linux_virtio", "pci_segment");
    let kernel = image("vmlinux-virtio");
    let rootfs = std::fs::canonicalize(image("rootfs-virtio.ext4")).expect("rootfs path");
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let api = scratch.path("api.sock");
    let mut vmm = SpawnedProcess::spawn(&link, &["--api-socket", arg(&api)]);
    wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": {"kernel": kernel, "cmdline": cmdline(EXT4_ROOT)},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 256u64 << 20},
        "disks": [{"path": rootfs, "readonly": true, "pci_segment": 1}],
        "rng": {"src": "/dev/urandom"},
        "serial": {"mode": "Tty"}, "console": {"mode": "Off"},
        "platform": {"num_pci_segments": 2},
    });
    api_expect(
        &api,
        204,
        "PUT",
        "/api/v1/vm.create",
        Some(&config.to_string()),
    );
    let started = Instant::now();
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    let marker = "VFS: Mounted root (ext4 filesystem) readonly on device";
    vmm.wait_for_stdout(marker, BOOT_LIMIT);
    eprintln!("{marker:?} after {:?}", started.elapsed());
    vmm.signal(libc::SIGKILL);
    let out = vmm.wait(Duration::from_secs(10));
    assert_lines(
        &out,
        &[
            "PCI: MMCONFIG for domain 0000 [bus 00-00] at [mem 0xe0000000-0xe00fffff]",
            "PCI: MMCONFIG for domain 0001 [bus 00-00] at [mem 0xe0100000-0xe01fffff]",
            "PCI host bridge to bus 0000:00",
            "PCI host bridge to bus 0001:00",
            // Segment 1: its host bridge and the disk; segment 0: the entropy device.
            "pci 0001:00:00.0: [1b36:0008] type 00 class",
            "pci 0001:00:01.0: [1af4:1042] type 00 class",
            "pci 0000:00:01.0: [1af4:1044] type 00 class",
            "[vda] 16384 512-byte logical blocks (8.39 MB/8.00 MiB)",
            "EXT4-fs (vda): mounted filesystem with ordered data mode.",
        ],
    );
    assert_none_of(
        &out,
        &[
            "pci 0000:00:02.0",
            "pci 0001:00:02.0",
            "I/O error",
            "EXT4-fs error",
        ],
    );
}
