//! gpuvm as `cloud-hypervisor` (a symlink to the binary), driven the way Kata
//! Containers' clh driver drives Cloud Hypervisor: ping, vm.create with a Kata-shaped
//! VmConfig, vm.info until Created, vm.boot, vm.info until Running, pause/resume, the
//! agent's hybrid vsock (`CONNECT 1024`), vmm.shutdown; vm.add-net with the tap passed
//! as a descriptor (SCM_RIGHTS), as Kata passes the taps it made in the pod's network
//! namespace (as root: the test makes a namespace and a tap); and the errors.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gpuvm_tests::cloud_hypervisor_support::{
    guest_image, put_with_fds, spawn_ch, vm_info, vm_state as state, wait_for_vm,
};
use gpuvm_tests::netns::Netns;
use gpuvm_tests::snapshot_support::copy_dir;
use gpuvm_tests::virtio_support::{
    assert_in_order, blk_image, pattern_is_on_disk, vsock_echo, SECTOR,
};
use gpuvm_tests::{api_expect, gpuvm_bin, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);

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
        // Two connections: the test makes one, so the guest is still serving when the
        // test's vmm.shutdown comes (with one, the guest ends the VM itself and races it).
        r#"{{"payload":{{"kernel":"{}","cmdline":"virtio-vsock 2"}},
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
    let kernel = guest_image(&scratch);
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
    // Kata's resize at sandbox start, to the count the VM has; above max_vcpus is refused.
    api_expect(
        &api,
        204,
        "PUT",
        "/api/v1/vm.resize",
        Some(r#"{"desired_vcpus":1}"#),
    );
    let resize = api_expect(
        &api,
        400,
        "PUT",
        "/api/v1/vm.resize",
        Some(r#"{"desired_vcpus":5}"#),
    );
    assert!(resize.contains("max_vcpus = 4"), "{resize}");

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

/// Kata's NIC: vm.add-net {mac, id} with the tap queue passed as a descriptor; then the
/// guest's `virtio-net` workload answers a UDP echo through that tap. Before that, what
/// is refused: no tap and no descriptor, a descriptor that is not a tap, two descriptors
/// for one queue pair, a named tap and a descriptor. The VM is snapshotted, and restored
/// in a new process with a new tap descriptor (vm.restore's `net_fds`): without one, or
/// with fewer than `net_fds` says, the restore is refused.
#[test]
fn add_net_with_a_passed_tap_descriptor() {
    let Some(netns) = Netns::create("add_net_with_a_passed_tap_descriptor") else {
        return;
    };
    let scratch = Scratch::new("cloud_hypervisor", "add_net_fds");
    let kernel = guest_image(&scratch);
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
    // The VM is snapshotted with its passed tap; a restore gets a new one through
    // vm.restore's `net_fds`, as Cloud Hypervisor's does.
    let snap = scratch.path("snap");
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());

    let api = scratch.path("restore-api.sock");
    let mut vmm = spawn_ch(&scratch, &["--api-socket", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let restore = "/api/v1/vm.restore";
    let source = format!(r#"{{"source_url":"file://{}"}}"#, snap.display());
    let refused = api_expect(&api, 400, "PUT", restore, Some(&source));
    assert!(
        refused.contains("net0") && refused.contains("net_fds"),
        "{refused}"
    );
    let with_taps = format!(
        r#"{{"source_url":"file://{}","net_fds":[{{"id":"net0","num_fds":1}}]}}"#,
        snap.display()
    );
    let (status, refused) = put_with_fds(&api, restore, &with_taps, &[]);
    assert_eq!(status, 400, "{refused}");
    assert!(refused.contains("net_fds"), "{refused}");
    let tap = netns.open_tap();
    let (status, answer) = put_with_fds(&api, restore, &with_taps, &[tap.as_raw_fd()]);
    assert_eq!(status, 204, "{answer}");
    drop(tap);
    assert_eq!(vm_info(&api)["state"], "Paused");
    api_expect(&api, 204, "PUT", "/api/v1/vm.resume", None);

    let payload = b"through a passed tap".to_vec();
    assert_eq!(netns.udp_echo(&payload), payload);
    let out = vmm.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("virtio-net: ok");
    out.assert_stdout_has(&format!("virtio-net: echoed {} udp bytes", payload.len()));
}

/// Cloud Hypervisor's command line boots the VM at once: `--kernel` (the test guest
/// written to a file) with `--cpus boot=2 --memory size=256M --rng --serial tty
/// --console off`, a `--disk` and a `--vsock`. The guest's `virtio-devices` workload
/// shows each device working (it reads the disk's magic and entropy, echoes over vsock,
/// writes sector 16), and vm.info reports Running with the options as VmConfig fields.
/// Then vm.snapshot through the API, and `cloud-hypervisor --restore source_url=...` in
/// a new process: Paused (as in Cloud Hypervisor) until vm.resume, then the guest goes on
/// from where it was (a second vsock connection, sector 17); and again with
/// `resume=on` and no API socket, which runs on by itself.
#[test]
fn command_line_boots_then_restore_at_start_runs_on() {
    const PATTERN_SEED: u64 = 0xd5e7;
    let scratch = Scratch::new("cloud_hypervisor", "cli_boot");
    let kernel = guest_image(&scratch);
    let image = blk_image(&scratch, 1 << 20);
    let uds = scratch.path("v.sock");
    let api = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let disk = format!("path={},id=root", image.display());
    let vsock_option = format!("cid=3,socket={}", uds.display());
    let mut vm = spawn_ch(
        &scratch,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "virtio-devices 2",
            "--cpus",
            "boot=2",
            "--memory",
            "size=256M",
            "--rng",
            "src=/dev/urandom",
            "--serial",
            "tty",
            "--console",
            "off",
            "--disk",
            &disk,
            "--vsock",
            &vsock_option,
            "-v",
        ],
    );
    // The guest's serial output reaches stdout: the VM booted with no API request.
    vm.wait_for_stdout("virtio-devices: listening", LIMIT);
    let info = vm_info(&api);
    assert_eq!(info["state"], "Running", "{info}");
    let config = &info["config"];
    assert_eq!(
        config["payload"]["kernel"],
        kernel.to_str().unwrap(),
        "{info}"
    );
    assert_eq!(config["payload"]["cmdline"], "virtio-devices 2", "{info}");
    assert_eq!(config["cpus"]["boot_vcpus"], 2, "{info}");
    assert_eq!(config["memory"]["size"], 256u64 << 20, "{info}");
    assert_eq!(info["memory_actual_size"], 256u64 << 20, "{info}");
    assert_eq!(config["rng"]["src"], "/dev/urandom", "{info}");
    assert_eq!(config["serial"]["mode"], "Tty", "{info}");
    assert_eq!(config["console"]["mode"], "Off", "{info}");
    assert_eq!(
        config["disks"][0]["path"],
        image.to_str().unwrap(),
        "{info}"
    );
    assert_eq!(config["disks"][0]["id"], "root", "{info}");
    assert_eq!(config["vsock"]["cid"], 3, "{info}");
    // The command line's vm.create happened: a client's is the second one.
    api_expect(
        &api,
        409,
        "PUT",
        "/api/v1/vm.create",
        Some(r#"{"payload":{}}"#),
    );

    vsock_echo(&uds, b"through the command line's vsock");
    vm.wait_for_stdout("virtio-devices: wrote sector 16\n", LIMIT);
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());
    assert_in_order(
        &out.stdout,
        &[
            "virtio-devices: blk capacity=2048 sector0=475055564d424c4b",
            "virtio-devices: rng ok",
            "virtio-devices: connection 1 from cid 2",
            "virtio-devices: wrote sector 16",
        ],
        "the command line's VM",
    );
    assert!(pattern_is_on_disk(
        &image,
        16 * SECTOR,
        SECTOR,
        PATTERN_SEED
    ));
    let image_at_snapshot = std::fs::read(&image).unwrap();

    // --restore with an API socket: paused until vm.resume.
    let copy = scratch.path("snap-copy");
    copy_dir(&snap, &copy);
    let api2 = scratch.path("api2.sock");
    let source = format!("source_url=file://{}", snap.display());
    let mut restored = spawn_ch(
        &scratch,
        &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
    );
    wait_for_api_socket(&mut restored, &api2);
    wait_for_vm(&mut restored, &api2, LIMIT);
    assert_eq!(vm_info(&api2)["state"], "Paused");
    api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    assert_eq!(vm_info(&api2)["state"], "Running");
    restored.wait_for_stdout("virtio-devices: transport reset", LIMIT);
    vsock_echo(&uds, b"after --restore");
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    assert!(
        !out.stdout.contains("virtio-devices: listening"),
        "the guest started over: {}",
        out.describe()
    );
    assert_in_order(
        &out.stdout,
        &[
            "virtio-devices: connection 2 from cid 2",
            "virtio-devices: wrote sector 17",
            "virtio-devices: ok connections=2",
        ],
        "after --restore",
    );
    assert!(pattern_is_on_disk(
        &image,
        17 * SECTOR,
        SECTOR,
        PATTERN_SEED
    ));

    // --restore ...,resume=on with no API socket runs on by itself.
    std::fs::write(&image, &image_at_snapshot).unwrap();
    let source = format!("source_url=file://{},resume=on,prefault=on", copy.display());
    let mut resumed = spawn_ch(&scratch, &["--restore", &source]);
    resumed.wait_for_stdout("virtio-devices: transport reset", LIMIT);
    vsock_echo(&uds, b"after --restore resume=on");
    let out = resumed.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("virtio-devices: ok connections=2");
    assert!(pattern_is_on_disk(
        &image,
        17 * SECTOR,
        SECTOR,
        PATTERN_SEED
    ));
}

/// With a payload and no API socket the guest runs to its end, as `cloud-hypervisor
/// --kernel K` does; its exit status is gpuvm's.
#[test]
fn command_line_without_api_socket_runs_the_guest_to_its_end() {
    let scratch = Scratch::new("cloud_hypervisor", "cli_no_socket");
    let kernel = guest_image(&scratch);
    let out = Command::new(gpuvm_bin())
        .args([
            "ch",
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "hello",
        ])
        .args(["--cpus", "boot=1", "--memory", "size=128M,shared=on"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("testguest: hello from ring 3"), "{stdout}");
}

/// Options gpuvm cannot honour exit 125 before any guest runs, naming the option and the
/// key: syntax errors found by the command line's parser, and refusals of the API's
/// translation (the same messages vm.create answers), blamed on their option.
#[test]
fn bad_command_lines_exit_125_naming_the_option() {
    let scratch = Scratch::new("cloud_hypervisor", "cli_bad");
    let kernel = guest_image(&scratch);
    let kernel = kernel.to_str().unwrap();
    let image = blk_image(&scratch, 1 << 20);
    let queues = format!("path={},num_queues=4", image.display());
    let api = scratch.path("api.sock");
    let missing = scratch.path("no-such-snapshot");
    let restore = format!("source_url=file://{}", missing.display());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--kernel", kernel, "--disk", &queues],
            "--disk: disks[0].num_queues = 4",
        ),
        (
            vec!["--kernel", kernel, "--serial", "pty"],
            "--serial: serial.mode = \"Pty\"",
        ),
        (
            vec!["--kernel", kernel, "--cpus", "boot=0"],
            "--cpus: cpus.boot_vcpus = 0",
        ),
        (
            vec!["--kernel", kernel, "--memory", "size=1G,mergeable=on"],
            "--memory: memory.mergeable",
        ),
        (
            vec!["--kernel", kernel, "--cpus", "boot=2,frobnicate=1"],
            "--cpus frobnicate: unknown key",
        ),
        (
            vec!["--kernel", kernel, "--memory", "size=12X"],
            "--memory size=12X",
        ),
        (
            vec!["--kernel", kernel, "--disk", "path=/x,bw_size=1"],
            "--disk bw_size: not supported",
        ),
        (
            vec!["--kernel", kernel, "--pmem", "file=/x"],
            "--pmem: not supported",
        ),
        (
            vec![
                "--kernel",
                kernel,
                "--user-device",
                "socket=/nowhere,pci_device_id=3",
            ],
            "--user-device: pci_device_id = 3",
        ),
        (
            vec!["--api-socket", api.to_str().unwrap(), "--cpus", "boot=2"],
            "--cpus needs --kernel",
        ),
        (vec!["--restore", &restore], "--restore"),
        (
            vec!["--restore", "source_url=http://x/snap"],
            "--restore: source_url",
        ),
    ];
    for (args, needle) in cases {
        let started = Instant::now();
        let out = Command::new(gpuvm_bin())
            .arg("ch")
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?}: stderr lacks {needle:?}:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("testguest"),
            "{args:?}: a guest ran"
        );
        eprintln!("{args:?}: refused in {:?}", started.elapsed());
    }
}

/// `cloud-hypervisor ARGS` (as `gpuvm ch`) with `tap` as its descriptor 3, output to
/// `scratch/<name>.out` and `.err`.
fn spawn_with_tap_at_3(
    scratch: &Scratch,
    name: &str,
    args: &[&str],
    tap: &std::os::fd::OwnedFd,
) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let tap_fd = tap.as_raw_fd();
    let mut command = Command::new(gpuvm_bin());
    command
        .arg("ch")
        .args(args)
        .stdout(std::fs::File::create(scratch.path(&format!("{name}.out"))).unwrap())
        .stderr(std::fs::File::create(scratch.path(&format!("{name}.err"))).unwrap());
    // SAFETY: between fork and exec the closure only calls dup2 / fcntl, which are
    // async-signal-safe; it makes the tap the child's descriptor 3 without close-on-exec.
    unsafe {
        command.pre_exec(move || {
            let done = if tap_fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(tap_fd, 3)
            };
            if done < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn().unwrap()
}

/// Waits until `scratch/<name>.out` holds `line` (or the process ended, or LIMIT).
fn wait_for_output(scratch: &Scratch, child: &mut std::process::Child, name: &str, line: &str) {
    let output = |ext: &str| {
        std::fs::read_to_string(scratch.path(&format!("{name}.{ext}"))).unwrap_or_default()
    };
    let deadline = Instant::now() + LIMIT;
    while !output("out").contains(line) {
        let ended = child.try_wait().unwrap();
        if ended.is_some() || Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no {line:?} ({ended:?}):\n{}\n--- stderr\n{}",
                output("out"),
                output("err")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--net fd=3,mac=...`: a tap the process inherited as descriptor 3 (as a parent that
/// made it in the pod's network namespace hands it over) becomes the guest's interface,
/// through the same route as vm.add-net with a passed descriptor; the guest's
/// `virtio-net` workload has the given MAC. The VM is snapshotted through the API, and
/// `--restore ...,net_fds=[net0@[3]],resume=on` in a new process gives the restored
/// interface a tap inherited the same way: the guest answers a UDP echo through it. As
/// root only (a network namespace and a tap).
#[test]
fn command_line_net_fd_takes_an_inherited_tap() {
    let Some(netns) = Netns::create("command_line_net_fd_takes_an_inherited_tap") else {
        return;
    };
    let scratch = Scratch::new("cloud_hypervisor", "cli_net_fd");
    let kernel = guest_image(&scratch);
    let mac = format!("06:00:0a:00:{:02x}:02", netns.n);
    let api = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let tap = netns.open_tap();
    let cmdline = format!("virtio-net {}", netns.guest_ip());
    let net = format!("fd=3,mac={mac},id=net0");
    let mut booted = spawn_with_tap_at_3(
        &scratch,
        "booted",
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "--kernel",
            kernel.to_str().unwrap(),
            "--memory",
            "size=128M",
            "--cmdline",
            &cmdline,
            "--net",
            &net,
        ],
        &tap,
    );
    // gpuvm holds the tap now: ours can go.
    drop(tap);
    wait_for_output(
        &scratch,
        &mut booted,
        "booted",
        "virtio-net: sent gratuitous arp",
    );
    let out = std::fs::read_to_string(scratch.path("booted.out")).unwrap();
    assert!(out.contains(&format!("virtio-net: mac={mac}")), "{out}");
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    booted.wait().unwrap();

    let tap = netns.open_tap();
    let source = format!(
        "source_url=file://{},net_fds=[net0@[3]],resume=on",
        snap.display()
    );
    let mut restored = spawn_with_tap_at_3(&scratch, "restored", &["--restore", &source], &tap);
    drop(tap);
    let payload = b"through an inherited tap, restored".to_vec();
    assert_eq!(netns.udp_echo(&payload), payload);
    wait_for_output(&scratch, &mut restored, "restored", "virtio-net: ok");
    let status = restored.wait().unwrap();
    let out = std::fs::read_to_string(scratch.path("restored.out")).unwrap();
    assert_eq!(status.code(), Some(0), "{out}");
    assert!(
        !out.contains("virtio-net: sent gratuitous arp"),
        "the guest started over: {out}"
    );
}

/// Issue 31: vm.create refuses what Cloud Hypervisor's own validation refuses, every
/// refused value named by its field path in one answer, and creates nothing; a device
/// added later is checked the same way, as part of the configuration it joins.
#[test]
fn vm_create_refuses_what_cloud_hypervisor_refuses_naming_each_field() {
    let scratch = Scratch::new("cloud_hypervisor", "validate");
    let kernel = guest_image(&scratch);
    let vsock = scratch.path("clh.sock");
    let (_vmm, api) = start(&scratch);
    let image = blk_image(&scratch, 1 << 20);
    let disk = |queue_size: u64| {
        format!(
            r#"{{"path":"{}","readonly":true,"queue_size":{queue_size}}}"#,
            image.display()
        )
    };
    let bad = kata_config(
        &kernel,
        &vsock,
        &format!(r#","disks":[{},{},{}]"#, disk(0), disk(3), disk(65536)),
    )
    .replace(
        r#""boot_vcpus":1,"max_vcpus":4"#,
        r#""boot_vcpus":2,"max_vcpus":1"#,
    );
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some(&bad));
    for field in [
        "cpus.max_vcpus = 1",
        "disks[0].queue_size = 0",
        "disks[1].queue_size = 3",
        "disks[2].queue_size = 65536",
    ] {
        assert!(refused.contains(field), "{field}: {refused}");
    }
    let too_many =
        kata_config(&kernel, &vsock, "").replace(r#""max_vcpus":4"#, r#""max_vcpus":65535"#);
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some(&too_many));
    assert!(refused.contains("cpus.max_vcpus = 65535"), "{refused}");
    api_expect(&api, 404, "GET", "/api/v1/vm.info", None);

    let good = kata_config(&kernel, &vsock, &format!(r#","disks":[{}]"#, disk(128)));
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&good));
    for size in [0, 3, 65536] {
        let added = format!(
            r#"{{"path":"{}","readonly":true,"queue_size":{size},"id":"q{size}"}}"#,
            image.display()
        );
        let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.add-disk", Some(&added));
        assert!(refused.contains("disks[1].queue_size"), "{refused}");
    }
    let info = vm_info(&api);
    assert_eq!(
        info["config"]["disks"].as_array().unwrap().len(),
        1,
        "{info}"
    );
}

/// Issue 31: a disk added before boot is checked when it is added (/dev/zero, a FIFO, a
/// missing file: 400 at once, naming it), and anything added before boot can be removed
/// before boot; the VM then boots.
#[test]
fn devices_added_before_boot_are_checked_and_can_be_removed() {
    let scratch = Scratch::new("cloud_hypervisor", "pre-boot-devices");
    let kernel = guest_image(&scratch);
    let vsock = scratch.path("clh.sock");
    let (mut vmm, api) = start(&scratch);
    let config = kata_config(&kernel, &vsock, "");
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));

    let fifo = scratch.path("disk.fifo");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let missing = scratch.path("missing.img");
    // Issue 31, item 7: 1 to 511 bytes is not a disk image, here as everywhere; an empty
    // file is a placeholder disk of 0 sectors.
    let tiny = scratch.path("tiny.img");
    std::fs::write(&tiny, [1u8; 100]).unwrap();
    for (path, why) in [
        (Path::new("/dev/zero"), "character device"),
        (fifo.as_path(), "FIFO"),
        (missing.as_path(), "no such file"),
        (tiny.as_path(), "not a disk image"),
    ] {
        let body = format!(r#"{{"path":"{}","id":"bad"}}"#, path.display());
        let started = Instant::now();
        let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.add-disk", Some(&body));
        assert!(
            refused.contains(path.to_str().unwrap()) && refused.contains(why),
            "{refused}"
        );
        assert!(started.elapsed() < LIMIT / 2, "the check waited");
    }
    let disks = vm_info(&api)["config"]["disks"].clone();
    assert!(disks.is_null() || disks == serde_json::json!([]), "{disks}");

    // Added, then removed, before boot.
    let image = blk_image(&scratch, 1 << 20);
    let disk = format!(r#"{{"path":"{}","id":"data"}}"#, image.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.add-disk", Some(&disk));
    assert_eq!(vm_info(&api)["config"]["disks"][0]["id"], "data");
    api_expect(
        &api,
        204,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id":"data"}"#),
    );
    assert_eq!(vm_info(&api)["config"]["disks"], serde_json::json!([]));
    api_expect(
        &api,
        404,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id":"data"}"#),
    );
    let empty = scratch.path("placeholder.img");
    std::fs::write(&empty, []).unwrap();
    let placeholder = format!(r#"{{"path":"{}","id":"placeholder"}}"#, empty.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.add-disk", Some(&placeholder));
    api_expect(
        &api,
        204,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id":"placeholder"}"#),
    );
    // The same disk again, kept this time: the VM boots with it.
    api_expect(&api, 204, "PUT", "/api/v1/vm.add-disk", Some(&disk));
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    assert_eq!(state(&api), "Running");
    vmm.wait_for_stdout("virtio-vsock: listening", LIMIT);
}
