//! Translation and routing of Firecracker's requests, against a fake VMM.

use std::path::Path;

use serde_json::json;

use gpuvm_vmm::action::{BackingKind, RestoreModeBody, VmmAction, VmmData};

use super::translate;
use super::{handle, Session};
use crate::http::{Method, Request};

#[test]
fn machine_config_translates_firecracker_fields() {
    let body = json!({"vcpu_count": 2, "mem_size_mib": 256, "smt": false, "huge_pages": "2M",
        "cpu_template": "None", "track_dirty_pages": true});
    let config = translate::machine_config(&body).unwrap();
    assert_eq!((config.vcpu_count, config.mem_size_mib), (2, 256));
    assert_eq!(config.backing, BackingKind::Hugetlb2M);
    assert!(config.track_dirty_pages);
    let patch = translate::machine_config_patch(&json!({"vcpu_count": 4})).unwrap();
    let mut patched = config.clone();
    patch.apply(&mut patched);
    assert_eq!((patched.vcpu_count, patched.mem_size_mib), (4, 256));
    assert_eq!(patched.backing, BackingKind::Hugetlb2M);
    // PATCH is one action, carried to the VMM thread as it is (no GET before it).
    let seen = std::cell::RefCell::new(Vec::new());
    let dispatch = |action: VmmAction| {
        seen.borrow_mut().push(format!("{action:?}"));
        Ok(VmmData::Empty)
    };
    let response = handle(
        &request(Method::Patch, "/machine-config", r#"{"mem_size_mib": 512}"#),
        &Session::new("t"),
        &dispatch,
    );
    assert_eq!(response.status, 204);
    let seen = seen.borrow();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen[0].starts_with("PatchMachineConfig") && seen[0].contains("mem_size_mib: Some(512)"),
        "{seen:?}"
    );
    for (bad, needle) in [
        (
            json!({"vcpu_count": 1, "mem_size_mib": 64, "smt": true}),
            "smt",
        ),
        (
            json!({"vcpu_count": 1, "mem_size_mib": 64, "cpu_template": "C3"}),
            "C3",
        ),
        (
            json!({"vcpu_count": 1, "mem_size_mib": 64, "huge_pages": "1G"}),
            "huge_pages",
        ),
        (json!({"mem_size_mib": 64}), "vcpu_count"),
        (json!({"vcpu_count": 1, "mem_size_mib": 64, "x": 1}), "x"),
    ] {
        let error = translate::machine_config(&bad).unwrap_err();
        assert!(error.contains(needle), "{bad}: {error}");
    }
}

#[test]
fn paths_resolve_and_snapshots_take_two_files() {
    let cwd = Path::new("/srv/fc");
    let boot = translate::boot_source(&json!({"kernel_image_path": "vmlinux"}), cwd).unwrap();
    assert_eq!(
        boot.kernel_image_path.unwrap(),
        Path::new("/srv/fc/vmlinux")
    );
    let create = translate::snapshot_create(
        &json!({"snapshot_path": "s.state", "mem_file_path": "/m", "snapshot_type": "Diff"}),
        cwd,
    )
    .unwrap();
    assert_eq!(create.snapshot_path, Path::new("/srv/fc/s.state"));
    assert_eq!(create.mem_file_path.as_deref(), Some(Path::new("/m")));
    let (load, overrides) = translate::snapshot_load(
        &json!({"snapshot_path": "/s", "mem_backend": {"backend_type": "File", "backend_path": "/m"}, "resume_vm": true}),
        cwd,
    )
    .unwrap();
    assert_eq!(overrides, Default::default());
    assert_eq!(load.restore_mode, RestoreModeBody::Lazy);
    assert!(load.resume_vm && load.mem_file_path.is_some());
    let older =
        translate::snapshot_load(&json!({"snapshot_path": "/s", "mem_file_path": "/m"}), cwd)
            .unwrap()
            .0;
    assert_eq!(older.mem_file_path.as_deref(), Some(Path::new("/m")));
    let uffd = translate::snapshot_load(
        &json!({"snapshot_path": "/d/s", "mem_backend": {"backend_type": "Uffd", "backend_path": "/uffd.sock"}}),
        cwd,
    )
    .unwrap()
    .0;
    assert_eq!(uffd.restore_mode, RestoreModeBody::External);
    assert_eq!(uffd.snapshot_path, Path::new("/d/.s.gpuvm"));
    for (bad, needle) in [
        (json!({"snapshot_path": "/s"}), "mem_backend"),
        (
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "network_overrides": [{"iface_id": "a", "host_dev_name": "b"}, {"iface_id": "a", "host_dev_name": "c"}]}),
            "twice",
        ),
        (
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "network_overrides": [{"iface_id": "a"}]}),
            "host_dev_name",
        ),
        (
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "vsock_override": {"path": "/v"}}),
            "path",
        ),
        (
            json!({"snapshot_path": "/s", "mem_backend": {"backend_type": "Tape", "backend_path": "/m"}}),
            "Tape",
        ),
    ] {
        let error = translate::snapshot_load(&bad, cwd).unwrap_err();
        assert!(error.contains(needle), "{bad}: {error}");
    }
}

#[test]
fn snapshot_load_overrides_translate() {
    let cwd = Path::new("/srv/fc");
    for key in ["track_dirty_pages", "enable_diff_snapshots"] {
        let (_, overrides) = translate::snapshot_load(
            &json!({"snapshot_path": "/s", "mem_file_path": "/m", key: true}),
            cwd,
        )
        .unwrap();
        assert!(overrides.track_dirty_pages, "{key}");
    }
    let (_, overrides) = translate::snapshot_load(
        &json!({"snapshot_path": "/s", "mem_file_path": "/m",
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap7"}],
            "vsock_override": {"uds_path": "v.sock"}}),
        cwd,
    )
    .unwrap();
    assert_eq!(overrides.network_overrides.len(), 1);
    assert_eq!(overrides.network_overrides[0].host_dev_name, "tap7");
    assert_eq!(
        overrides.vsock_uds_path.as_deref(),
        Some(Path::new("/srv/fc/v.sock"))
    );
    assert!(!overrides.track_dirty_pages);
    // The route carries them in one action.
    let request = request(
        Method::Put,
        "/snapshot/load",
        r#"{"snapshot_path": "/s", "mem_file_path": "/m", "track_dirty_pages": true}"#,
    );
    let seen = std::cell::RefCell::new(None);
    let dispatch = |action: VmmAction| {
        *seen.borrow_mut() = Some(format!("{action:?}"));
        Ok(VmmData::Empty)
    };
    let response = handle(&request, &Session::new("t"), &dispatch);
    assert_eq!(response.status, 204);
    let seen = seen.borrow().clone().unwrap();
    assert!(
        seen.starts_with("LoadSnapshotWith") && seen.contains("track_dirty_pages: true"),
        "{seen}"
    );
}

#[test]
fn config_file_sections_become_actions() {
    let actions = translate::config_file(
        &json!({"boot-source": {"kernel_image_path": "/k"}, "machine-config": {"vcpu_count": 1, "mem_size_mib": 64},
            "drives": [{"drive_id": "d", "path_on_host": "img", "is_root_device": false}],
            "logger": {"log_path": "/l"}, "metrics": {"metrics_path": "/m"}, "balloon": null}),
        Path::new("/w"),
    )
    .unwrap();
    assert!(matches!(actions[0], VmmAction::PutLogger(_)));
    assert!(matches!(actions[1], VmmAction::PutMetrics(_)));
    assert_eq!(actions.len(), 5);
    let error =
        translate::config_file(&json!({"balloon": {"amount_mib": 1}}), Path::new("/")).unwrap_err();
    assert!(error.contains("balloon"), "{error}");
    // mmds-config becomes the controller's action, after the interfaces it names; one
    // the file does not configure refuses the file before anything runs.
    let actions = translate::config_file(
        &json!({"mmds-config": {"version": "V2", "network_interfaces": ["eth0"]},
            "network-interfaces": [{"iface_id": "eth0", "host_dev_name": "tap0"}]}),
        Path::new("/"),
    )
    .unwrap();
    assert!(matches!(actions[0], VmmAction::PutNetworkInterface(_)));
    let VmmAction::PutMmdsConfig(config) = &actions[1] else {
        panic!("{actions:?}");
    };
    assert_eq!(config.version, gpuvm_mmds::MmdsVersion::V2);
    let error = translate::config_file(
        &json!({"mmds-config": {"network_interfaces": ["eth1"]},
            "network-interfaces": [{"iface_id": "eth0", "host_dev_name": "tap0"}]}),
        Path::new("/"),
    )
    .unwrap_err();
    assert!(
        error.contains("mmds-config.network_interfaces: no network interface [\"eth1\"]"),
        "{error}"
    );
}

fn request(method: Method, path: &str, body: &str) -> Request {
    Request {
        method,
        path: path.into(),
        body: body.as_bytes().to_vec(),
        close: false,
    }
}

#[test]
fn routes_answer_with_firecracker_codes_and_shapes() {
    let session = Session::new("vm-7");
    let dispatch = |action: VmmAction| match action {
        VmmAction::GetInstanceInfo => Ok(VmmData::Json(
            json!({"app_name": "gpuvm", "vmm_version": "0", "state": "NotStarted"}),
        )),
        VmmAction::CreateSnapshot(_) => Ok(VmmData::Json(json!({"snapshot_path": "/d"}))),
        _ => Ok(VmmData::Empty),
    };
    let info = handle(&request(Method::Get, "/", ""), &session, &dispatch);
    let info: serde_json::Value = serde_json::from_slice(&info.body).unwrap();
    assert_eq!(
        info,
        json!({"id": "vm-7", "state": "Not started", "vmm_version": "0", "app_name": "gpuvm"})
    );
    let put = |path: &str, body: &str| {
        handle(&request(Method::Put, path, body), &session, &dispatch).status
    };
    assert_eq!(
        put(
            "/snapshot/create",
            r#"{"snapshot_path": "/s", "mem_file_path": "/m"}"#
        ),
        204
    );
    assert_eq!(put("/actions", r#"{"action_type": "FlushMetrics"}"#), 204);
    assert_eq!(put("/balloon", "{}"), 400);
    assert_eq!(put("/nosuch", "{}"), 400);
    assert_eq!(
        handle(&request(Method::Get, "/version", ""), &session, &dispatch).status,
        200
    );
    let refused = |_: VmmAction| Err(gpuvm_vmm::action::ActionError::wrong_state("no"));
    assert_eq!(
        handle(
            &request(Method::Patch, "/vm", r#"{"state": "Paused"}"#),
            &session,
            &refused
        )
        .status,
        400
    );
}

#[test]
fn mmds_routes_become_the_controllers_actions() {
    let session = Session::new("t");
    // A fake controller: records each action; a PUT or PATCH with "big" in its body is
    // refused as the controller refuses a store over its limit.
    let seen = std::cell::RefCell::new(Vec::new());
    let dispatch = |action: VmmAction| {
        let text = format!("{action:?}");
        seen.borrow_mut().push(text.clone());
        match action {
            VmmAction::GetMmds => Ok(VmmData::Json(json!({"latest": {"id": "i-1"}}))),
            VmmAction::PutMmds(_) | VmmAction::PatchMmds(_) if text.contains("big") => {
                Err(gpuvm_vmm::action::ActionError {
                    status: gpuvm_vmm::controller::mmds::TOO_LARGE,
                    message: "the MMDS data store would be 60 bytes, over its limit of 40 bytes"
                        .into(),
                })
            }
            VmmAction::Recorded { action, .. }
                if matches!(*action, VmmAction::PutMmdsConfig(_)) && text.contains("eth9") =>
            {
                Err(gpuvm_vmm::action::ActionError::bad_request(
                    "mmds-config.network_interfaces: no network interface [\"eth9\"] is configured",
                ))
            }
            _ => Ok(VmmData::Empty),
        }
    };
    let go =
        |method, path: &str, body: &str| handle(&request(method, path, body), &session, &dispatch);
    let last = || seen.borrow().last().cloned().unwrap_or_default();

    assert_eq!(
        go(Method::Put, "/mmds", r#"{"latest": {"id": "i-1"}}"#).status,
        204
    );
    assert!(
        last().starts_with("PutMmds(") && last().contains("i-1"),
        "{}",
        last()
    );
    assert_eq!(
        go(Method::Patch, "/mmds", r#"{"latest": {"x": "y"}}"#).status,
        204
    );
    assert!(last().starts_with("PatchMmds("), "{}", last());
    let got = go(Method::Get, "/mmds", "");
    assert_eq!(got.status, 200);
    let value: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(value, json!({"latest": {"id": "i-1"}}));
    assert_eq!(last(), "GetMmds");
    // Not JSON: refused by the route, nothing sent.
    let before = seen.borrow().len();
    assert_eq!(go(Method::Put, "/mmds", "{").status, 400);
    assert_eq!(seen.borrow().len(), before);

    // Over the limit: 413 with Firecracker's fault_message, for PUT and PATCH.
    for method in [Method::Put, Method::Patch] {
        let refused = go(method, "/mmds", r#"{"big": "0123456789"}"#);
        assert_eq!(refused.status, 413);
        let message: serde_json::Value = serde_json::from_slice(&refused.body).unwrap();
        assert_eq!(
            message["fault_message"],
            "MMDS data store limit exceeded: the MMDS data store would be 60 bytes, over its limit of 40 bytes (--mmds-size-limit)"
        );
    }

    // PUT /mmds/config: the body parsed here, then one recorded action (the controller
    // checks it).
    let config = r#"{"version": "V2", "network_interfaces": ["eth0"]}"#;
    assert_eq!(go(Method::Put, "/mmds/config", config).status, 204);
    let sent = last();
    assert!(
        sent.starts_with("Recorded { action: PutMmdsConfig(")
            && sent.contains("V2")
            && sent.contains("section: \"mmds-config\""),
        "{sent}"
    );
    // The controller's refusals come back 400 with its message.
    let refused = go(
        Method::Put,
        "/mmds/config",
        r#"{"network_interfaces": ["eth9"]}"#,
    );
    assert_eq!(refused.status, 400);
    assert!(String::from_utf8_lossy(&refused.body).contains("eth9"));
    assert_eq!(go(Method::Delete, "/mmds", "").status, 400);
    assert_eq!(go(Method::Get, "/mmds/config", "").status, 400);
}

#[test]
fn hostile_bodies_are_400s_naming_the_field() {
    let session = Session::new("t");
    let dispatch = |action: VmmAction| match action {
        VmmAction::GetInstanceInfo => Ok(VmmData::Json(json!({"state": "NotStarted"}))),
        VmmAction::GetMachineConfig => Ok(VmmData::Json(
            json!({"vcpu_count": 1, "mem_size_mib": 128, "track_dirty_pages": false,
                   "backing": "memfd", "thp": false, "prefault": false, "cpuid_masks": []}),
        )),
        _ => Ok(VmmData::Empty),
    };
    let huge = "y".repeat(60_000);
    for (method, path, body, needle) in [
        (Method::Put, "/machine-config", r#"{"vcpu_count": 300, "mem_size_mib": 128}"#.to_string(), "machine-config.vcpu_count = 300"),
        (Method::Patch, "/machine-config", r#"{"vcpu_count": "2"}"#.into(), "machine-config.vcpu_count = \"2\""),
        (Method::Patch, "/machine-config", r#"{"mem_size_mib": -1}"#.into(), "machine-config.mem_size_mib = -1"),
        (Method::Put, "/boot-source", format!(r#"{{"kernel_image_path": "{huge}"}}"#), "boot-source.kernel_image_path: 60000 bytes"),
        (Method::Put, "/drives/d", r#"{"drive_id": "d", "path_on_host": null}"#.into(), "drive.path_on_host: null"),
        (Method::Put, "/drives/d", r#"{"drive_id": "d", "path_on_host": "/x", "rate_limiter": {"bandwidth": {"size": 1e9999}}}"#.into(), "invalid JSON"),
        (Method::Put, "/drives/d", r#"{"drive_id": "d", "path_on_host": "/x", "rate_limiter": {"bandwidth": {"size": 1.5, "refill_time": 1}}}"#.into(), "drive.rate_limiter.bandwidth.size = 1.5"),
        (Method::Put, "/network-interfaces/eth0", r#"{"iface_id": "eth0", "host_dev_name": "a-tap-name-too-long"}"#.into(), "network-interface.host_dev_name: 19 bytes"),
        (Method::Put, "/vsock", r#"{"guest_cid": 4294967295, "uds_path": "/v"}"#.into(), "vsock.guest_cid = 4294967295"),
        (Method::Put, "/balloon", r#"{"amount_mib": 1, "deflate_on_oom": 1}"#.into(), "balloon.deflate_on_oom = 1"),
        (Method::Put, "/entropy", r#"{"rate_limiter": [1]}"#.into(), "entropy.rate_limiter = a list"),
        (Method::Put, "/logger", r#"{"log_path": {"a": null}}"#.into(), "logger.log_path = an object"),
        (Method::Put, "/metrics", "{}".into(), "metrics.metrics_path: required"),
        (Method::Put, "/mmds/config", r#"{"network_interfaces": [null]}"#.into(), "mmds-config.network_interfaces[0] = null"),
        (Method::Put, "/snapshot/create", r#"{"snapshot_path": "/s", "mem_file_path": "/m", "snapshot_type": "Half"}"#.into(), "snapshot-create.snapshot_type = \"Half\""),
        (Method::Put, "/snapshot/load", r#"{"snapshot_path": "/s", "mem_backend": {"backend_type": "File", "backend_path": "/m", "x": 1}}"#.into(), "snapshot-load.mem_backend.x: unknown field"),
    ] {
        let response = handle(&request(method, path, &body), &session, &dispatch);
        let answer: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
        let message = answer["fault_message"].as_str().unwrap_or_default();
        assert_eq!(response.status, 400, "{path}: {message}");
        assert!(message.contains(needle), "{path}: {needle:?} in {message}");
        assert!(message.len() < 1024, "{path}: a short answer");
    }
}
