//! Kata Containers' clh driver (src/runtime/virtcontainers/clh.go) replayed against gpuvm
//! as `cloud-hypervisor`, with the bytes Kata's generated Go client
//! (virtcontainers/pkg/cloud-hypervisor/client, openapi-generator 5.3.0) puts on the API
//! socket: the same request lines and headers, and the same JSON bodies. The models marshal
//! through a `map[string]interface{}`, so Go's encoding/json writes their keys sorted at
//! every level; each model's constructor (`NewVmConfig`, `NewDiskConfig`, ...) sets the
//! defaults that are always sent; `setBody` encodes with `json.Encoder`, which ends the
//! body with a newline. vm.add-net is the exception: Kata writes it itself
//! (`httputil.DumpRequest` of a `json.Marshal`ed NetConfig) in one sendmsg carrying the tap
//! descriptors (SCM_RIGHTS).
//!
//! The pod: 1 vCPU (max 4), 128 MiB, the test guest as kernel (its `kata-agent` workload as
//! the command line), a read-only rootfs disk, hybrid vsock, rng, serial Tty and console Off
//! (Kata's debug mode), two PCI segments, no shared filesystem (`shared_fs = "none"`: Kata
//! itself refuses virtio-fs for the VMs it snapshots, its templates, and gpuvm refuses
//! snapshots of VMs with vhost-user devices), and a tap made in a test-made network
//! namespace. The sequence, as Kata drives it: vmm.ping until it answers, vm.create,
//! vm.info (Created), vm.add-net with the tap, vm.boot, vm.info (Running), the vCPU threads
//! named `vcpu<N>`, the agent's `CONNECT 1024`; then what Kata's default configuration
//! (static_sandbox_resource_mgmt = false) sends for a pod of containers with limits:
//! vm.resize to the boot vCPU count and then to 2 vCPUs (the guest starts the new vCPU with
//! INIT/SIPI and it checks itself in ring 3; vm.info's boot_vcpus and the `vcpu<N>`
//! threads follow), vm.resize of RAM for a container's memory limit (hot-plugged under the
//! VM's virtio devices), a GPU hot-plugged (the emulated GPU through vm.add-user-device:
//! Kata's vm.add-device takes a sysfs path for kernel VFIO) and 8 disks hot-plugged back
//! to back (vm.add-disk, one per container, each image tagged after its magic), every one
//! on segment 0 in a slot of its own and checked by the guest where it arrived; all are
//! kept: vm.pause, vm.info (Paused), vm.snapshot (the GPU's state saved beside RAM through
//! VFIO migration), vm.resume, vmm.shutdown; then a fresh GPU process behind the same
//! socket and a new VMM restored from the snapshot (vm.restore with `net_fds` for the
//! passed tap, Cloud Hypervisor's way): vm.info (Paused) shows the grown RAM, 2 vCPUs,
//! every device in its `config` (the snapshot keeps the client's VmConfig) and in its
//! `device_tree` at the PCI address it had; vm.resume, the same `device_tree`, the
//! `vcpu0`/`vcpu1` threads, the agent's second connection, after which the guest uses the
//! kept devices (a DMA job on the GPU,
//! whose registers still hold what its checks wrote; each disk's magic, tag and the
//! pattern its checks wrote), `kata-agent: ok`, vmm.shutdown.
//!
//! gpuvm is started as Kata's configuration may name it: through a `cloud-hypervisor`
//! symlink; through that symlink resolved, as Kata resolves the configured path
//! (`filepath.EvalSymlinks`) before it runs it, so the program is gpuvm's own path and the
//! Cloud Hypervisor flags pick the front end; and (launch and shutdown only) through a
//! hard link named `cloud-hypervisor`.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::cloud_hypervisor_support::{guest_image, send_with_fds};
use gpuvm_tests::netns::Netns;
use gpuvm_tests::virtio_support::{
    assert_in_order, disk_image, pattern_is_on_disk, vsock_echo, BLK_MAGIC, SECTOR,
};
use gpuvm_tests::{PeerLaunch, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
/// Kata's `clhTimeout`: how long it polls vmm.ping after starting the VMM.
const PING_LIMIT: Duration = Duration::from_secs(10);
const MEMORY: u64 = 128 << 20;
/// `default_maxmemory = 512` in configuration-clh.toml: Kata's memory.hotplug_size.
const HOTPLUG_SIZE: u64 = 512 << 20;
/// RAM after Kata's ResizeMemory for a container with a 200 MiB limit.
const GROWN: u64 = MEMORY + (256 << 20);
/// Kata's `defaultGuestVSockCID`.
const GUEST_CID: u32 = 3;
/// The configuration's `default_maxvcpus`: Kata's cpus.max_vcpus and cores_per_die.
const MAX_VCPUS: u32 = 4;
/// vCPUs after Kata's ResizeVCPUs for a container with a CPU limit.
const VCPUS: u32 = 2;
/// The containers, each with a block device hot-plugged for its volume (the guest's
/// `kata-agent` workload expects as many).
const DISKS: usize = 8;
/// What the guest prints once the GPU and every disk passed its checks.
const DEVICES_IN_PLACE: &str = "kata-agent: the GPU and 8 disks are in place";
/// Where the `virtio-blk` checks write their pattern on each hot-plugged disk (sectors
/// 8..16), and with which seed (guest-images/testguest/src/virtio/blk.rs).
const BLK_TEST_SECTOR: u64 = 8;
const BLK_TEST_SECTORS: u64 = 8;
const BLK_PATTERN_SEED: u64 = 0xb10c;

/// One answer: the status and the body.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: String,
}

impl Answer {
    /// Asserts the status Cloud Hypervisor answers. (Kata's generated client takes any
    /// status below 300 and turns the others into a GenericOpenAPIError with the body.)
    fn expect(self, status: u16, what: &str) -> Self {
        assert_eq!(self.status, status, "{what}: {self:?}");
        self
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

/// The request Kata's generated client sends through Go's http.Transport: request line,
/// Host, User-Agent (the generator's), Content-Length (PUT always has one, 0 without a
/// body), the model's header parameters in Go's sorted order, and the transport's
/// Accept-Encoding.
fn go_client_request(method: &str, route: &str, body: Option<&str>, accept_json: bool) -> String {
    let mut request = format!(
        "{method} /api/v1/{route} HTTP/1.1\r\nHost: localhost\r\n\
         User-Agent: OpenAPI-Generator/1.0.0/go\r\n"
    );
    if method == "PUT" {
        request += &format!("Content-Length: {}\r\n", body.map_or(0, str::len));
    }
    if accept_json {
        request += "Accept: application/json\r\n";
    }
    if body.is_some() {
        request += "Content-Type: application/json\r\n";
    }
    request += "Accept-Encoding: gzip\r\n\r\n";
    request + body.unwrap_or("")
}

/// A model's JSON as `json.NewEncoder(...).Encode` writes it: `compact` (keys already in
/// sorted order, as the test writes them) and a newline.
fn encoded(compact: String) -> String {
    let value: serde_json::Value = serde_json::from_str(&compact).expect("the test's JSON");
    assert_eq!(
        serde_json::to_string(&value).unwrap(),
        compact,
        "keys must be sorted and compact, as Go writes a map"
    );
    compact + "\n"
}

/// Sends `request` in one sendmsg, with `fds` as SCM_RIGHTS when there are any, and reads
/// one response (its Content-Length long).
fn exchange(api: &Path, request: &str, fds: &[RawFd]) -> Answer {
    let mut stream = send_with_fds(api, request.as_bytes(), fds);
    read_response(&mut stream)
}

fn read_response(stream: &mut UnixStream) -> Answer {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let count = stream.read(&mut chunk).expect("read the response");
        assert!(count > 0, "connection closed mid-response: {received:?}");
        received.extend_from_slice(&chunk[..count]);
    };
    let head = String::from_utf8_lossy(&received[..head_end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while received.len() < head_end + length {
        let count = stream.read(&mut chunk).expect("read the body");
        assert!(count > 0, "connection closed mid-body: {head}");
        received.extend_from_slice(&chunk[..count]);
    }
    Answer {
        status,
        body: String::from_utf8_lossy(&received[head_end..head_end + length]).to_string(),
    }
}

/// Kata's clhClient, one method per call its driver makes.
struct KataClient {
    api: PathBuf,
}

impl KataClient {
    fn get(&self, route: &str) -> Answer {
        exchange(&self.api, &go_client_request("GET", route, None, true), &[])
    }

    /// A PUT without a body (vm.boot, vm.pause, vm.resume, vmm.shutdown).
    fn put(&self, route: &str) -> Answer {
        exchange(
            &self.api,
            &go_client_request("PUT", route, None, false),
            &[],
        )
    }

    /// A PUT of a model; `accept_json` where the operation answers one (PciDeviceInfo).
    fn put_model(&self, route: &str, compact: String, accept_json: bool) -> Answer {
        let body = encoded(compact);
        exchange(
            &self.api,
            &go_client_request("PUT", route, Some(&body), accept_json),
            &[],
        )
    }

    /// `isClhRunning`: vmm.ping every 10 ms until it answers.
    fn wait_for_ping(&self, vmm: &mut SpawnedProcess) -> serde_json::Value {
        let started = Instant::now();
        loop {
            assert!(
                vmm.try_status().is_none(),
                "the VMM exited: {}",
                vmm.stderr()
            );
            if UnixStream::connect(&self.api).is_ok() {
                return self.get("vmm.ping").expect(200, "vmm.ping").json();
            }
            assert!(started.elapsed() < PING_LIMIT, "no API socket");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn state(&self) -> String {
        let info = self.get("vm.info").expect(200, "vm.info").json();
        info["state"].as_str().expect("state").to_string()
    }

    /// `vmAddNetPutRequest`: the DumpRequest bytes (no User-Agent, sorted headers, the
    /// json.Marshal body without newline) and the taps in one message.
    fn add_net(&self, compact: &str, taps: &[RawFd]) -> Answer {
        let request = format!(
            "PUT /api/v1/vm.add-net HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
             Content-Length: {}\r\nContent-Type: application/json\r\n\r\n{compact}",
            compact.len()
        );
        exchange(&self.api, &request, taps)
    }

    /// vm.restore with Cloud Hypervisor's `net_fds`: the taps ride on the request.
    fn restore(&self, compact: String, taps: &[RawFd]) -> Answer {
        let body = encoded(compact);
        let request = go_client_request("PUT", "vm.restore", Some(&body), false);
        exchange(&self.api, &request, taps)
    }
}

/// Kata's `clhPciInfoToPath` check on a PciDeviceInfo: `0000:00:<slot>.0`; the slot.
fn kata_pci_slot(info: &serde_json::Value) -> String {
    let bdf = info["bdf"].as_str().expect("bdf");
    let tokens: Vec<&str> = bdf.split(':').collect();
    assert!(
        tokens.len() == 3 && tokens[0] == "0000" && tokens[1] == "00",
        "Kata refuses {bdf}"
    );
    let (slot, function) = tokens[2].split_once('.').expect("slot.function");
    assert!(function == "0" && slot.len() == 2, "Kata refuses {bdf}");
    slot.to_string()
}

/// The VMM's threads named like Kata's `GetThreadIDs` wants them (`^vcpu\d+$`): their
/// numbers, sorted.
fn vcpu_threads(pid: i32) -> Vec<u32> {
    let mut numbers: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter_map(|comm| comm.trim().strip_prefix("vcpu")?.parse().ok())
        .collect();
    numbers.sort_unstable();
    numbers
}

/// Kata's `launchClh`: `cloud-hypervisor --api-socket S -v --seccomp true` (debug, log
/// level 1), then vmm.ping until it answers.
fn launch(program: &Path, api: &Path) -> (SpawnedProcess, KataClient) {
    let args = [
        "--api-socket",
        api.to_str().unwrap(),
        "-v",
        "--seccomp",
        "true",
    ];
    let mut vmm = SpawnedProcess::spawn(program, &args);
    let client = KataClient {
        api: api.to_path_buf(),
    };
    let ping = client.wait_for_ping(&mut vmm);
    assert!(ping["version"].is_string(), "{ping}");
    (vmm, client)
}

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

#[test]
fn kata_clh_driver_replay_from_create_to_restore() {
    replay(
        "kata_clh_driver_replay_from_create_to_restore",
        PeerLaunch::Symlink,
    );
}

/// What Kata really starts: the configured `cloud-hypervisor` symlink resolved, so gpuvm
/// runs as `.../gpuvm --api-socket ...` and takes the front end from the flags.
#[test]
fn kata_clh_driver_replay_through_the_resolved_symlink() {
    replay(
        "kata_clh_driver_replay_through_the_resolved_symlink",
        PeerLaunch::Resolved,
    );
}

/// gpuvm installed as a hard link (or a copy) named `cloud-hypervisor`: launched as Kata
/// launches it, it answers vmm.ping and vmm.shutdown as Cloud Hypervisor.
#[test]
fn kata_clh_launch_through_a_hard_link() {
    let scratch = Scratch::new("kata_cloud_hypervisor", "hard-link");
    let program = PeerLaunch::HardLink.path(&scratch, "cloud-hypervisor");
    let (vmm, kata) = launch(&program, &scratch.path("clh-api.sock"));
    assert_eq!(kata.get("vm.info").status, 404, "no VM before vm.create");
    kata.put("vmm.shutdown").expect(204, "vmm.shutdown");
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
}

/// The whole replay, gpuvm started as `program` says.
fn replay(test: &str, program: PeerLaunch) {
    let Some(netns) = Netns::create(test) else {
        return;
    };
    let scratch = Scratch::new("kata_cloud_hypervisor", &format!("replay-{program:?}"));
    let program = program.path(&scratch, "cloud-hypervisor");
    let kernel = guest_image(&scratch);
    let rootfs = scratch.path("rootfs.img");
    disk_image(&rootfs, b"KATAROOT", 1 << 20);
    let vsock = scratch.path("clh.sock");
    let snapshot = scratch.path("template");
    std::fs::create_dir(&snapshot).unwrap();
    let (mut vmm, kata) = launch(&program, &scratch.path("clh-api.sock"));

    // CreateVM: NewVmConfig (iommu, watchdog, pvpanic, landlock_enable false), NewCpusConfig
    // (kvm_hyperv false, nested true) with Kata's topology, NewMemoryConfig (shared false
    // without a shared filesystem and hugepages), NewDiskConfig for the rootfs (readonly,
    // Raw), NewRngConfig, NewConsoleConfig, NewVsockConfig, NewPlatformConfig.
    let create = format!(
        r#"{{"console":{{"iommu":false,"mode":"Off"}},"cpus":{{"boot_vcpus":1,"kvm_hyperv":false,"max_vcpus":{MAX_VCPUS},"nested":true,"topology":{{"cores_per_die":{MAX_VCPUS},"dies_per_package":1,"packages":1,"threads_per_core":1}}}},"disks":[{{"backing_files":false,"direct":false,"image_type":"Raw","iommu":false,"num_queues":1,"path":"{rootfs}","queue_size":128,"readonly":true,"sparse":true,"vhost_user":false}}],"iommu":false,"landlock_enable":false,"memory":{{"hotplug_method":"Acpi","hotplug_size":{HOTPLUG_SIZE},"hugepages":false,"mergeable":false,"prefault":false,"shared":false,"size":{MEMORY},"thp":true}},"payload":{{"cmdline":"kata-agent","kernel":"{kernel}"}},"platform":{{"num_pci_segments":2,"sev_snp":false,"tdx":false}},"pvpanic":false,"rng":{{"iommu":false,"src":"/dev/urandom"}},"serial":{{"iommu":false,"mode":"Tty"}},"vsock":{{"cid":{GUEST_CID},"iommu":false,"socket":"{vsock}"}},"watchdog":false}}"#,
        rootfs = rootfs.display(),
        kernel = kernel.display(),
        vsock = vsock.display(),
    );
    kata.put_model("vm.create", create, false)
        .expect(204, "vm.create");
    assert_eq!(kata.state(), "Created", "Kata checks clhStateCreated");

    // vm.add-net: NewNetConfig's defaults and the MAC, no id, one tap (one queue pair).
    let mac = format!("02:00:ca:fe:{:02x}:02", netns.n);
    let add_net = format!(
        r#"{{"iommu":false,"ip":"192.168.249.1","mac":"{mac}","mask":"255.255.255.0","num_queues":2,"offload_csum":true,"offload_tso":true,"offload_ufo":true,"queue_size":256,"vhost_mode":"Client","vhost_user":false}}"#
    );
    let tap = netns.open_tap();
    let added = kata.add_net(&add_net, &[tap.as_raw_fd()]);
    // Kata takes 200 or 204; before boot there is no PciDeviceInfo (an empty body is EOF).
    assert!(
        added.status == 204 && added.body.is_empty(),
        "vm.add-net: {added:?}"
    );
    drop(tap);
    let info = kata.get("vm.info").expect(200, "vm.info").json();
    let net_id = info["config"]["net"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("vm.info names the NIC: {info}"))
        .to_string();
    assert_eq!(info["config"]["net"][0]["mac"], mac.as_str(), "{info}");

    kata.put("vm.boot").expect(204, "vm.boot");
    assert_eq!(kata.state(), "Running", "Kata checks clhStateRunning");
    assert_eq!(vcpu_threads(vmm.pid()), [0], "GetThreadIDs: one vcpu0");

    // The agent: hybrid vsock CONNECT 1024, echoed.
    vmm.wait_for_stdout("kata-agent: agent listening", LIMIT);
    vsock_echo(&vsock, b"kata agent: CreateSandbox");
    vmm.wait_for_stdout("kata-agent: agent connection 1 done", LIMIT);

    // Kata's default configuration (static_sandbox_resource_mgmt = false): ResizeVCPUs
    // with the boot count when the sandbox starts, then with more for a container's CPU
    // limit (the guest brings the new vCPU online), and ResizeMemory for a container with a
    // memory limit (vm.info's size plus the growth in whole 128 MiB blocks), in this VM
    // with its virtio disk, NIC, entropy and vsock devices.
    kata.put_model("vm.resize", r#"{"desired_vcpus":1}"#.into(), false)
        .expect(204, "vm.resize to the boot vCPU count");
    assert_eq!(
        vcpu_threads(vmm.pid()),
        [0],
        "GetThreadIDs: still one vcpu0"
    );
    kata.put_model(
        "vm.resize",
        format!(r#"{{"desired_vcpus":{VCPUS}}}"#),
        false,
    )
    .expect(204, "vm.resize to more vCPUs");
    vmm.wait_for_stdout("kata-agent: cpu 1 online", LIMIT);
    let info = kata.get("vm.info").expect(200, "vm.info").json();
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], VCPUS, "{info}");
    assert_eq!(info["config"]["cpus"]["max_vcpus"], MAX_VCPUS, "{info}");
    assert_eq!(
        vcpu_threads(vmm.pid()),
        [0, 1],
        "GetThreadIDs after the resize"
    );
    kata.put_model("vm.resize", format!(r#"{{"desired_ram":{GROWN}}}"#), false)
        .expect(204, "vm.resize desired_ram");
    let info = kata.get("vm.info").expect(200, "vm.info").json();
    assert_eq!(info["config"]["memory"]["size"], GROWN, "{info}");

    // HotplugAddDevice(VfioDev) → the emulated GPU, kept: the snapshot takes its state
    // (VFIO migration).
    let gpu_socket = scratch.path("gpu.sock");
    let emu = gpuvm_tests::start_emu_gpu(&emu_bin(), &gpu_socket, &[]);
    let user_device = format!(r#"{{"socket":"{}"}}"#, gpu_socket.display());
    let gpu = kata
        .put_model("vm.add-user-device", user_device, true)
        .expect(200, "vm.add-user-device")
        .json();
    let gpu_slot = kata_pci_slot(&gpu);
    let gpu_id = gpu["id"].as_str().expect("PciDeviceInfo.id").to_string();

    // HotplugAddDevice(BlockDev) for each container, back to back: NewDiskConfig, Raw, not
    // vhost-user, one queue per vCPU of 1024, no id.
    let disks: Vec<HotPluggedDisk> = (0..DISKS)
        .map(|index| {
            let image = scratch.path(&format!("volume-{index}.img"));
            let tag = disk_tag(index);
            tagged_disk_image(&image, &tag);
            let add_disk = format!(
                r#"{{"backing_files":false,"direct":false,"image_type":"Raw","iommu":false,"num_queues":1,"path":"{}","queue_size":1024,"readonly":false,"sparse":true,"vhost_user":false}}"#,
                image.display()
            );
            let disk = kata
                .put_model("vm.add-disk", add_disk, true)
                .expect(200, "vm.add-disk after boot")
                .json();
            HotPluggedDisk {
                slot: kata_pci_slot(&disk),
                id: disk["id"].as_str().expect("PciDeviceInfo.id").to_string(),
                image,
                tag,
            }
        })
        .collect();
    let mut slots: Vec<&str> = disks.iter().map(|disk| disk.slot.as_str()).collect();
    slots.push(&gpu_slot);
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(
        slots.len(),
        DISKS + 1,
        "a slot each on segment 0: {slots:?}"
    );

    // The guest checks each device where it arrived (several may show in one PCIU read).
    vmm.wait_for_stdout(DEVICES_IN_PLACE, LIMIT);
    let booted = vmm.stdout();
    let mut expected = vec![format!(
        "kata-agent: GPU at 00:{gpu_slot}.0 passed the pci checks\n"
    )];
    for disk in &disks {
        expected.push(format!(
            "kata-agent: disk at 00:{}.0 passed the virtio-blk checks\n",
            disk.slot
        ));
        assert!(
            pattern_is_on_disk(
                &disk.image,
                BLK_TEST_SECTOR * SECTOR,
                BLK_TEST_SECTORS * SECTOR,
                BLK_PATTERN_SEED
            ),
            "the guest's pattern is on {}",
            disk.image.display()
        );
    }
    for line in &expected {
        assert!(booted.contains(line.as_str()), "{line:?} in\n{booted}");
    }
    let info = kata.get("vm.info").expect(200, "vm.info").json();
    configured_devices(&info, &disks);
    let placed = device_addresses(&info, (&gpu_id, &gpu_slot), &disks);
    vmm.wait_for_stdout("kata-agent: agent waiting for connection 2", LIMIT);

    // PauseVM, SaveVM (NewVmSnapshotConfig with a file:// URL), ResumeVM, StopVM.
    kata.put("vm.pause").expect(204, "vm.pause");
    assert_eq!(kata.state(), "Paused");
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snapshot.display());
    kata.put_model("vm.snapshot", destination, false)
        .expect(204, "vm.snapshot");
    let device_files = std::fs::read_dir(&snapshot)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("device-"))
        .count();
    assert_eq!(device_files, 1, "the GPU's state beside RAM");
    kata.put("vm.resume").expect(204, "vm.resume");
    assert_eq!(kata.state(), "Running");
    kata.put("vmm.shutdown").expect(204, "vmm.shutdown");
    let out = vmm.wait(LIMIT);
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert_in_order(
        &out.stdout,
        &[
            "kata-agent: agent listening cid=3 port=1024",
            "kata-agent: connection 1 from cid 2",
            "kata-agent: agent connection 1 done",
            "kata-agent: cpu 1 inserted",
            "kata-agent: cpu 1 online",
            DEVICES_IN_PLACE,
            "kata-agent: agent waiting for connection 2",
        ],
        "the booted pod",
    );
    // The device process ends with the VMM's connection.
    let _ = emu.wait(Duration::from_secs(10));

    // restoreVM: a fresh device process behind the GPU's socket, a new VMM, vm.restore
    // (with the tap again as net_fds), Paused, ResumeVM.
    let emu = gpuvm_tests::start_emu_gpu(&emu_bin(), &gpu_socket, &[]);
    let (mut restored, kata) = launch(&program, &scratch.path("clh-api-2.sock"));
    let restore = format!(
        r#"{{"net_fds":[{{"id":"{net_id}","num_fds":1}}],"source_url":"file://{}"}}"#,
        snapshot.display()
    );
    let tap = netns.open_tap();
    kata.restore(restore, &[tap.as_raw_fd()])
        .expect(204, "vm.restore with net_fds");
    drop(tap);
    assert_eq!(kata.state(), "Paused", "Kata expects Paused after restore");
    let info = kata.get("vm.info").expect(200, "vm.info").json();
    assert_eq!(
        info["config"]["memory"]["size"], GROWN,
        "the hot-plugged RAM is restored: {info}"
    );
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], VCPUS, "{info}");
    // Its `config` lists the devices Kata added (the snapshot keeps the client's
    // VmConfig), and its `device_tree` has them where they were, already while Paused.
    configured_devices(&info, &disks);
    assert_eq!(
        device_addresses(&info, (&gpu_id, &gpu_slot), &disks),
        placed,
        "the devices are listed where they were while Paused"
    );
    kata.put("vm.resume").expect(204, "vm.resume");
    let info = kata.get("vm.info").expect(200, "vm.info").json();
    assert_eq!(info["state"], "Running");
    assert_eq!(
        device_addresses(&info, (&gpu_id, &gpu_slot), &disks),
        placed,
        "the devices are restored where they were"
    );
    assert_eq!(
        vcpu_threads(restored.pid()),
        [0, 1],
        "GetThreadIDs after restore"
    );
    vsock_echo(&vsock, b"kata agent: after the template");
    restored.wait_for_stdout("kata-agent: ok", LIMIT);
    kata.put("vmm.shutdown").expect(204, "vmm.shutdown");
    let out = restored.wait(LIMIT);
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(
        !out.stdout.contains("kata-agent: agent listening"),
        "the guest started over: {}",
        out.stdout
    );
    let mut expected = vec![
        "kata-agent: transport reset".to_string(),
        "kata-agent: connection 2 from cid 2".into(),
        "kata-agent: agent connection 2 done".into(),
        format!("kata-agent: GPU at 00:{gpu_slot}.0 kept its registers, DMA verified"),
    ];
    for disk in &disks {
        expected.push(format!(
            "kata-agent: disk at 00:{}.0 kept its data, tag '{}'",
            disk.slot,
            String::from_utf8_lossy(&disk.tag)
        ));
    }
    expected.push("kata-agent: ok".into());
    let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    assert_in_order(&out.stdout, &expected, "the restored pod");
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

/// One of the containers' disks: where Kata got it, its id, its image and its tag.
struct HotPluggedDisk {
    slot: String,
    id: String,
    image: PathBuf,
    tag: [u8; 8],
}

/// The 8 bytes after the magic on disk `index`, which the guest prints back after the
/// restore (so a disk found in another disk's slot shows).
fn disk_tag(index: usize) -> [u8; 8] {
    let tag = format!("volume-{index}");
    tag.as_bytes().try_into().expect("an 8-byte tag")
}

/// A 1 MiB disk: [`BLK_MAGIC`] and then `tag` in sector 0.
fn tagged_disk_image(path: &Path, tag: &[u8; 8]) {
    use std::os::unix::fs::FileExt;
    disk_image(path, BLK_MAGIC, 1 << 20);
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(tag, BLK_MAGIC.len() as u64).unwrap();
}

/// vm.info's `config` lists the hot-plugged devices: each disk (after the rootfs disk) and
/// the GPU in their sections.
fn configured_devices(info: &serde_json::Value, disks: &[HotPluggedDisk]) {
    let configured = info["config"]["disks"].as_array().expect("config.disks");
    assert_eq!(
        configured.len(),
        1 + DISKS,
        "the rootfs and the disks: {info}"
    );
    for disk in disks {
        assert!(
            configured
                .iter()
                .any(|c| c["path"].as_str() == disk.image.to_str()),
            "{} in config.disks: {info}",
            disk.image.display()
        );
    }
    let users = info["config"]["user_devices"]
        .as_array()
        .expect("config.user_devices");
    assert_eq!(users.len(), 1, "the GPU: {info}");
}

/// Where vm.info's `device_tree` has the disks and the GPU: (id, PCI address), each at the
/// slot Kata was answered.
fn device_addresses(
    info: &serde_json::Value,
    gpu: (&str, &str),
    disks: &[HotPluggedDisk],
) -> Vec<(String, String)> {
    let devices = disks
        .iter()
        .map(|d| (d.id.as_str(), d.slot.as_str()))
        .chain([gpu]);
    devices
        .map(|(id, slot)| {
            let bdf = info["device_tree"][id]["pci_bdf"]
                .as_str()
                .unwrap_or_else(|| panic!("{id} in device_tree: {info}"));
            assert_eq!(bdf, format!("0000:00:{slot}.0"), "{id}: {info}");
            (id.to_string(), bdf.to_string())
        })
        .collect()
}
