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
    let config = translate::machine_config(&body, None).unwrap();
    assert_eq!((config.vcpu_count, config.mem_size_mib), (2, 256));
    assert_eq!(config.backing, BackingKind::Hugetlb2M);
    assert!(config.track_dirty_pages);
    let patched = translate::machine_config(&json!({"vcpu_count": 4}), Some(&config)).unwrap();
    assert_eq!((patched.vcpu_count, patched.mem_size_mib), (4, 256));
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
        let error = translate::machine_config(&bad, None).unwrap_err();
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
    let load = translate::snapshot_load(
        &json!({"snapshot_path": "/s", "mem_backend": {"backend_type": "File", "backend_path": "/m"}, "resume_vm": true}),
        cwd,
    )
    .unwrap();
    assert_eq!(load.restore_mode, RestoreModeBody::Lazy);
    assert!(load.resume_vm && load.mem_file_path.is_some());
    let older =
        translate::snapshot_load(&json!({"snapshot_path": "/s", "mem_file_path": "/m"}), cwd)
            .unwrap();
    assert_eq!(older.mem_file_path.as_deref(), Some(Path::new("/m")));
    let uffd = translate::snapshot_load(
        &json!({"snapshot_path": "/d/s", "mem_backend": {"backend_type": "Uffd", "backend_path": "/uffd.sock"}}),
        cwd,
    )
    .unwrap();
    assert_eq!(uffd.restore_mode, RestoreModeBody::External);
    assert_eq!(uffd.snapshot_path, Path::new("/d/.s.gpuvm"));
    for (bad, needle) in [
        (json!({"snapshot_path": "/s"}), "mem_backend"),
        (
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "track_dirty_pages": true}),
            "track_dirty_pages",
        ),
        (
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "network_overrides": [{"iface_id": "a", "host_dev_name": "b"}]}),
            "network_overrides",
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
