//! GPU hot-plug and hot-unplug end to end: PUT /gpus/{id} and DELETE /gpus/{id} on a
//! running VM, through gpuvm's ACPI PCI hot-plug controller, with the emulated GPU
//! (`gpuvm-emu-gpu`, vfio-user) and the test guest's `pci-hotplug` workload, which polls
//! the controller's registers as the DSDT's AML would, runs the `pci` checks on each new
//! device (DMA into guest RAM included) and ejects it when asked.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::{
    api_boot, api_expect, api_load_lazy, gpu_body, spawn_api_vmm, thread_seccomp_modes,
    wait_for_api_socket, Scratch, SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn socket_path(name: &str) -> PathBuf {
    gpuvm_tests::socket_path("hotplug", name)
}

fn start_emu(socket: &Path) -> SpawnedProcess {
    gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[])
}

/// Until `check` accepts GET /'s answer (it is returned), or panics after `LIMIT`.
fn wait_for_info(
    api: &Path,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + LIMIT;
    loop {
        let info: serde_json::Value =
            serde_json::from_str(&api_expect(api, 200, "GET", "/", None)).expect("JSON");
        if check(&info) {
            return info;
        }
        assert!(Instant::now() < deadline, "never {what}: {info}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The state GET / gives hot-plugged device `id`, if it lists it.
fn gpu_state(info: &serde_json::Value, id: &str) -> Option<String> {
    info["hot_plugged_gpus"]
        .as_array()?
        .iter()
        .find(|gpu| gpu["id"] == id)
        .map(|gpu| gpu["state"].as_str().unwrap_or_default().to_string())
}

/// A running VM with the API on `api` and `workload` as its command line.
fn start_vm(name: &str, workload: &str, env: &[(&str, &str)]) -> (SpawnedProcess, PathBuf) {
    let api = socket_path(&format!("{name}-api"));
    let mut vmm = spawn_api_vmm(&api, None, env);
    api_boot(&api, workload);
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    (vmm, api)
}

/// PUT /gpus/{id} on the running VM; checks the answer and returns the guest BDF.
fn hot_plug(api: &Path, id: &str, socket: &Path) -> String {
    let body = api_expect(
        api,
        200,
        "PUT",
        &format!("/gpus/{id}"),
        Some(&gpu_body(id, socket)),
    );
    let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    assert_eq!(answer["id"], id, "{body}");
    let bdf = answer["bdf"].as_str().expect("bdf").to_string();
    assert!(
        bdf.len() == 12 && bdf.starts_with("0000:00:") && bdf.ends_with(".0"),
        "bdf {bdf:?} is 0000:00:XX.0"
    );
    bdf
}

fn ctl(api: &Path, args: &[&str]) -> gpuvm_tests::RunOutput {
    gpuvm_tests::gpuvm_ctl(api, args, LIMIT)
}

/// Two devices, one after the other, into one running VM: each is hot-plugged at a
/// 0000:00:XX.0 address, passes the guest's `pci` checks (MSI-X and the DMA data), is
/// ejected by the guest on DELETE, and the VM ends cleanly. Around them: bad requests
/// that must leave the VM alone.
#[test]
fn two_gpus_hot_plugged_and_unplugged_in_turn() {
    let first = socket_path("first");
    // Without VFIO migration: a plain snapshot of the VM is refused below.
    let emu_a = gpuvm_tests::start_emu_gpu(&emu_bin(), &first, &["--no-migration"]);
    let (mut vmm, api) = start_vm("turns", "pci-hotplug 2", &[]);

    // Bad requests before any device: unknown id, a socket nobody serves.
    let missing = api_expect(&api, 404, "DELETE", "/gpus/nothing", None);
    assert!(missing.contains("nothing"), "{missing}");
    let absent = socket_path("absent");
    let refused = api_expect(
        &api,
        400,
        "PUT",
        "/gpus/ghost",
        Some(&gpu_body("ghost", &absent)),
    );
    assert!(refused.contains("cannot hot-plug ghost"), "{refused}");

    let started = Instant::now();
    let bdf = hot_plug(&api, "gpu0", &first);
    let answered = started.elapsed();
    vmm.wait_for_stdout("hotplug: device 1 at", LIMIT);
    let out = vmm.stdout();
    assert!(
        out.contains(&format!("hotplug: device 1 arrived at {}", &bdf[5..])),
        "{out}"
    );
    assert!(out.contains("pci: msi-x interrupt received"), "{out}");
    assert!(out.contains("pci: dma verified 65536 bytes"), "{out}");
    eprintln!(
        "PUT /gpus answered in {answered:?}, first DMA verified after {:?}",
        started.elapsed()
    );

    // The same id again, while attached: 409. A snapshot: refused, the device cannot
    // save its state.
    let twice = api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &first)),
    );
    assert!(twice.contains("already attached"), "{twice}");
    let snapshot = std::env::temp_dir().join(format!("gpuvm-hotplug-snap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snapshot);
    ctl(
        &api,
        &["snapshot-create", "--dir", snapshot.to_str().unwrap()],
    )
    .assert_clean_error("offers no VFIO migration");
    assert!(!snapshot.exists());

    // DELETE through the CLI client: answered once the guest ejected it.
    ctl(&api, &["remove-gpu", "--id", "gpu0"]).assert_code(0);
    // The guest prints after its eject write, which is what completed the DELETE: the
    // line may come a moment after the answer.
    vmm.wait_for_stdout("hotplug: device 1 ejected", LIMIT);
    // The device was reset and its connection closed: the server ends.
    let emu_out = emu_a.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
    api_expect(&api, 404, "DELETE", "/gpus/gpu0", None);

    // A second device (a new server) takes the freed place.
    let second = socket_path("second");
    let emu_b = start_emu(&second);
    let again = hot_plug(&api, "gpu0", &second);
    assert_eq!(again, bdf, "the freed slot is reused");
    vmm.wait_for_stdout("hotplug: device 2 at", LIMIT);
    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("hotplug: device 2 ejected")
        .assert_stdout_has("hotplug: ok");
    emu_b.wait(Duration::from_secs(10));
}

/// A guest that never ejects: DELETE answers 504 after the eject timeout with a message
/// that says so, the device stays attached and the VM keeps running.
#[test]
fn a_guest_that_never_ejects_times_the_delete_out() {
    let socket = socket_path("keep");
    let emu = start_emu(&socket);
    let (mut vmm, api) = start_vm(
        "keep",
        "pci-hotplug 1 keep",
        &[("GPUVM_HOTPLUG_EJECT_TIMEOUT_MS", "1500")],
    );
    hot_plug(&api, "gpu0", &socket);
    vmm.wait_for_stdout("hotplug: keeping the device", LIMIT);
    let started = Instant::now();
    let error = api_expect(&api, 504, "DELETE", "/gpus/gpu0", None);
    assert!(started.elapsed() >= Duration::from_millis(1400));
    assert!(error.contains("did not eject gpu0"), "{error}");
    assert!(error.contains("stays attached"), "{error}");
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    // Still attached: the same id is taken.
    api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &socket)),
    );
    ctl(&api, &["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    emu.wait(Duration::from_secs(10));
}

/// The device process dies (kill -9) while the guest holds the device and waits for an
/// eject request: gpuvm notices the hang-up, asks the guest to eject it, the guest sees
/// it gone (all ones) and ejects it, the slot is freed, and a second emulated GPU is
/// plugged into it and passes the guest's checks. Seccomp is on (the default).
#[test]
fn a_backend_killed_while_attached_is_ejected_and_its_slot_reused() {
    let first = socket_path("dying");
    let mut emu_a = start_emu(&first);
    let (mut vmm, api) = start_vm("dying", "pci-hotplug 2", &[]);
    let bdf = hot_plug(&api, "gpu0", &first);
    vmm.wait_for_stdout("hotplug: device 1 at", LIMIT);
    let watched = thread_seccomp_modes(vmm.pid());
    assert!(
        watched
            .iter()
            .any(|(name, mode)| name == "vfio-user-watch" && *mode == 2),
        "a filtered hang-up watch: {watched:?}"
    );

    emu_a.signal(libc::SIGKILL);
    assert_eq!(emu_a.wait(LIMIT).code(), None, "killed by a signal");
    vmm.wait_for_stdout("hotplug: device 1 ejected", LIMIT);
    // The slot is freed once the VMM thread took the device down after the eject.
    wait_for_info(&api, "the gone device freed", |info| {
        gpu_state(info, "gpu0").is_none()
    });
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    api_expect(&api, 404, "DELETE", "/gpus/gpu0", None);

    let second = socket_path("after-death");
    let emu_b = start_emu(&second);
    let again = hot_plug(&api, "gpu1", &second);
    assert_eq!(again, bdf, "the dead device's slot is reused");
    vmm.wait_for_stdout("hotplug: device 2 at", LIMIT);
    api_expect(&api, 204, "DELETE", "/gpus/gpu1", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("hotplug: device 2 ejected")
        .assert_stdout_has("hotplug: ok");
    assert!(
        out.stderr.contains("hung up") && out.stderr.contains("gpu0"),
        "the log says which device went and why: {}",
        out.stderr
    );
    emu_b.wait(Duration::from_secs(10));
}

/// The device process dies while a guest that never ejects holds it: GET / and GET
/// /metrics describe it as gone with the reason, DELETE still works (answered when the
/// eject timeout frees the slot), and a new device can then be plugged into the slot.
#[test]
fn a_backend_killed_under_a_guest_that_keeps_it_is_freed_at_the_eject_timeout() {
    let first = socket_path("kept");
    let mut emu_a = start_emu(&first);
    let (mut vmm, api) = start_vm(
        "kept",
        "pci-hotplug 1 keep",
        &[("GPUVM_HOTPLUG_EJECT_TIMEOUT_MS", "1500")],
    );
    let bdf = hot_plug(&api, "gpu0", &first);
    vmm.wait_for_stdout("hotplug: keeping the device", LIMIT);
    let info = wait_for_info(&api, "attached", |i| gpu_state(i, "gpu0").is_some());
    assert_eq!(
        gpu_state(&info, "gpu0").as_deref(),
        Some("attached"),
        "{info}"
    );

    emu_a.signal(libc::SIGKILL);
    emu_a.wait(LIMIT);
    let info = wait_for_info(&api, "gone", |i| {
        gpu_state(i, "gpu0").as_deref() == Some("gone")
    });
    let gpu = &info["hot_plugged_gpus"][0];
    assert_eq!(gpu["bdf"], bdf.as_str(), "{info}");
    let error = gpu["error"].as_str().unwrap_or_default();
    assert!(error.contains("hung up"), "a clear reason: {info}");
    let metrics = api_expect(&api, 200, "GET", "/metrics", None);
    assert!(metrics.contains(r#""state":"gone""#), "{metrics}");

    // Taken, while gone: the id and the slot are not free yet.
    api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &first)),
    );
    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(!info.contains("gpu0"), "{info}");
    assert!(info.contains(r#""state":"Running""#), "{info}");

    let second = socket_path("kept-next");
    let emu_b = start_emu(&second);
    assert_eq!(
        hot_plug(&api, "gpu0", &second),
        bdf,
        "the slot is free again"
    );
    ctl(&api, &["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    emu_b.wait(Duration::from_secs(10));
}

/// The device process dies in the middle of a PUT, before it answered the connection:
/// the PUT fails with a clear error and the VM and the API stay up.
#[test]
fn a_backend_killed_during_the_put_fails_only_the_put() {
    let socket = socket_path("midput");
    let mut emu = start_emu(&socket);
    let (mut vmm, api) = start_vm("midput", "pci-hotplug 1", &[]);
    // Stopped: it accepts nothing, so the PUT waits for its answer.
    emu.signal(libc::SIGSTOP);
    let put = {
        let (api, body) = (api.clone(), gpu_body("gpu0", &socket));
        std::thread::spawn(move || {
            gpuvm_api::client::request(&api, "PUT", "/gpus/gpu0", Some(&body)).expect("answer")
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    emu.signal(libc::SIGKILL);
    emu.wait(LIMIT);
    let answer = put.join().expect("PUT thread");
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer.body.contains("cannot hot-plug gpu0"),
        "{}",
        answer.body
    );
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    assert!(!info.contains("hot_plugged_gpus"), "{info}");

    let again = socket_path("midput-next");
    let emu_b = start_emu(&again);
    hot_plug(&api, "gpu0", &again);
    vmm.wait_for_stdout("hotplug: device 1 at", LIMIT);
    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    vmm.wait(LIMIT)
        .assert_code(0)
        .assert_stdout_has("hotplug: ok");
    emu_b.wait(Duration::from_secs(10));
}

/// The warm-pool use case: a VM waiting for its GPU is snapshotted, restored lazily
/// into a new gpuvm through the API, and a GPU hot-plugged into the restored VM passes
/// the guest's checks (DMA included) and is ejected on DELETE.
#[test]
fn a_gpu_hot_plugged_into_a_restored_vm_passes_the_checks() {
    let scratch = Scratch::new("hotplug", "restored");
    let snapshot = scratch.path("snapshot");
    let (mut original, api) = start_vm("pool", "pci-hotplug 1", &[]);
    ctl(
        &api,
        &["snapshot-create", "--dir", snapshot.to_str().unwrap()],
    )
    .assert_code(0);
    original.signal(libc::SIGKILL);
    original.wait(LIMIT);

    let api = socket_path("restored-api");
    let mut vmm = spawn_api_vmm(&api, None, &[]);
    api_load_lazy(&api, &snapshot);
    let socket = socket_path("restored-gpu");
    let emu = start_emu(&socket);
    let bdf = hot_plug(&api, "gpu0", &socket);
    vmm.wait_for_stdout("hotplug: device 1 at", LIMIT);
    let out = vmm.stdout();
    assert!(
        out.contains(&format!("hotplug: device 1 arrived at {}", &bdf[5..])),
        "{out}"
    );
    assert!(out.contains("pci: dma verified 65536 bytes"), "{out}");
    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    vmm.wait(LIMIT)
        .assert_code(0)
        .assert_stdout_has("hotplug: device 1 ejected")
        .assert_stdout_has("hotplug: ok");
    emu.wait(Duration::from_secs(10));
}

/// A vfio-user "device" that accepts connections and never answers: each connection is
/// read until gpuvm ends it, and how many bytes it sent comes back on the channel.
fn start_silent_device(socket: &Path) -> std::sync::mpsc::Receiver<usize> {
    use std::io::Read;
    let _ = std::fs::remove_file(socket);
    let listener = std::os::unix::net::UnixListener::bind(socket).expect("bind");
    let (ended, connections) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().map_while(Result::ok) {
            let ended = ended.clone();
            std::thread::spawn(move || {
                let mut received = Vec::new();
                let _ = stream.read_to_end(&mut received);
                let _ = ended.send(received.len());
            });
        }
    });
    connections
}

/// A request on its own thread, so that a stuck VMM thread fails the test instead of
/// hanging it.
fn request_in_time(api: &Path, method: &str, path: &str, body: String) -> (u16, String) {
    let (api, method, path) = (api.to_path_buf(), method.to_string(), path.to_string());
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(gpuvm_api::client::request(
            &api,
            &method,
            &path,
            Some(&body),
        ));
    });
    let response = answer
        .recv_timeout(LIMIT)
        .expect("an answer: the VMM thread is not stuck on the silent device")
        .expect("request");
    (response.status, response.body)
}

/// A vfio-user socket whose listener accepts but never answers the version negotiation
/// (seccomp on, the default): PUT /gpus/{id} fails after GPUVM_VFIO_USER_TIMEOUT_MS with
/// an error naming the socket, the connection is shut down (no thread stays blocked on
/// it), the API keeps answering and the VM keeps running; Cloud Hypervisor's
/// vm.add-user-device on the same socket fails the same way.
#[test]
fn a_vfio_user_socket_that_never_answers_fails_only_the_put() {
    let silent = socket_path("silent-gpu");
    let connections = start_silent_device(&silent);
    let (mut vmm, api) = start_vm(
        "silent",
        "pci-hotplug 1",
        &[("GPUVM_VFIO_USER_TIMEOUT_MS", "500")],
    );

    let started = Instant::now();
    let (status, body) = request_in_time(&api, "PUT", "/gpus/gpu0", gpu_body("gpu0", &silent));
    eprintln!("PUT /gpus answered {status} after {:?}", started.elapsed());
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("cannot hot-plug gpu0"), "{body}");
    assert!(body.contains(silent.to_str().unwrap()), "{body}");
    assert!(
        body.contains("did not answer the version negotiation within 500 ms"),
        "{body}"
    );
    let sent = connections
        .recv_timeout(LIMIT)
        .expect("gpuvm shut the silent connection down");
    assert!(sent > 0, "gpuvm sent its version first");
    let threads = thread_seccomp_modes(vmm.pid());
    assert!(
        !threads
            .iter()
            .any(|(name, _)| name.starts_with("vfio-user-conn")),
        "no connecting thread left behind: {threads:?}"
    );

    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    assert!(!info.contains("hot_plugged_gpus"), "{info}");

    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    ctl(&api, &["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);

    // Cloud Hypervisor's vm.add-user-device, with the default timeout (5 s).
    use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch, vm_state};
    let scratch = Scratch::new("hotplug", "silent-ch");
    let kernel = guest_image(&scratch);
    let api = scratch.path("api.sock");
    let mut vmm = spawn_ch(&scratch, &["--api-socket", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": { "kernel": kernel, "cmdline": "pci-hotplug 1" },
        "memory": { "size": 268435456u64, "shared": true },
        "serial": { "mode": "Tty" },
        "console": { "mode": "Off" },
    })
    .to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    let started = Instant::now();
    let body = serde_json::json!({ "socket": silent, "id": "gpu0" }).to_string();
    let (status, answer) = request_in_time(&api, "PUT", "/api/v1/vm.add-user-device", body);
    eprintln!(
        "PUT /api/v1/vm.add-user-device answered {status} after {:?}: {answer}",
        started.elapsed()
    );
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains(silent.to_str().unwrap()), "{answer}");
    assert!(
        answer.contains("did not answer the version negotiation within 5 s"),
        "{answer}"
    );
    connections
        .recv_timeout(LIMIT)
        .expect("gpuvm shut the second silent connection down");
    assert_eq!(vm_state(&api), "Running");
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());
    let _ = std::fs::remove_file(&silent);
}
