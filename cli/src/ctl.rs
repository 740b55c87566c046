//! `gpuvm ctl`: one request to a running gpuvm's API socket, from flags or raw.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::args::{CtlArgs, CtlCommand, Mode};
use crate::gpuvm_error;

/// `gpuvm ctl`: one request; prints the answer's body, exits 0 on success.
pub fn ctl(args: CtlArgs) -> ExitCode {
    use serde_json::json;
    let (method, path, body): (&str, &str, Option<serde_json::Value>) = match &args.command {
        CtlCommand::Info => ("GET", "/", None),
        CtlCommand::GetMachineConfig => ("GET", "/machine-config", None),
        CtlCommand::SetMachineConfig {
            vcpus,
            memory,
            memory_backing,
            no_thp,
            prefault,
            cpuid_mask,
            track_dirty_pages,
        } => (
            "PUT",
            "/machine-config",
            Some(json!({
                "vcpu_count": vcpus,
                "mem_size_mib": memory >> 20,
                "backing": memory_backing,
                "thp": !no_thp,
                "prefault": prefault,
                "cpuid_masks": cpuid_mask,
                "track_dirty_pages": track_dirty_pages,
            })),
        ),
        CtlCommand::SetBootSource {
            kernel,
            initrd,
            cmdline,
        } => (
            "PUT",
            "/boot-source",
            Some(json!({
                "kernel_image_path": kernel.as_ref().map(|p| absolute(p)),
                "initrd_path": initrd.as_ref().map(|p| absolute(p)),
                "boot_args": cmdline,
            })),
        ),
        CtlCommand::Start => (
            "PUT",
            "/actions",
            Some(json!({"action_type": "InstanceStart"})),
        ),
        CtlCommand::CtrlAltDel => (
            "PUT",
            "/actions",
            Some(json!({"action_type": "SendCtrlAltDel"})),
        ),
        CtlCommand::Pause => ("PATCH", "/vm", Some(json!({"state": "Paused"}))),
        CtlCommand::Resume => ("PATCH", "/vm", Some(json!({"state": "Resumed"}))),
        CtlCommand::SnapshotCreate { dir, diff } => (
            "PUT",
            "/snapshot/create",
            Some(json!({
                "snapshot_path": absolute(dir),
                "snapshot_type": if *diff { "Diff" } else { "Full" },
            })),
        ),
        CtlCommand::SnapshotLoad {
            dir,
            restore_mode,
            uffd_socket,
            resume,
            record_working_set,
        } => (
            "PUT",
            "/snapshot/load",
            Some(json!({
                "snapshot_path": absolute(dir),
                "restore_mode": match restore_mode {
                    Mode::Eager => "Eager",
                    Mode::Lazy => "Lazy",
                    Mode::External => "External",
                },
                "uffd_socket_path": uffd_socket.as_ref().map(|p| absolute(p)),
                "resume_vm": resume,
                "record_working_set": record_working_set,
            })),
        ),
        CtlCommand::Metrics => ("GET", "/metrics", None),
        CtlCommand::Raw { method, path, body } => {
            let body = body.as_deref().map(str::to_owned);
            return ctl_send(&args.api_sock, method, path, body.as_deref());
        }
        CtlCommand::RemoveGpu { id } => {
            return ctl_send(&args.api_sock, "DELETE", &format!("/gpus/{id}"), None);
        }
        CtlCommand::AddGpu {
            id,
            host_bdf,
            vfio_user_socket,
        } => {
            let body = json!({
                "gpu_id": id,
                "host_bdf": host_bdf,
                "vfio_user_socket": vfio_user_socket.as_ref().map(|p| absolute(p)),
            })
            .to_string();
            return ctl_send(&args.api_sock, "PUT", &format!("/gpus/{id}"), Some(&body));
        }
    };
    let body = body.map(|b| b.to_string());
    ctl_send(&args.api_sock, method, path, body.as_deref())
}

/// Paths go to the server as absolute paths: it does not share our working directory.
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn ctl_send(socket: &std::path::Path, method: &str, path: &str, body: Option<&str>) -> ExitCode {
    match gpuvm_api::client::request(socket, method, path, body) {
        Ok(response) if response.is_success() => {
            if !response.body.is_empty() {
                println!("{}", response.body);
            }
            ExitCode::SUCCESS
        }
        Ok(response) => {
            eprintln!("gpuvm: error: {} ({})", response.message(), response.status);
            gpuvm_error()
        }
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            gpuvm_error()
        }
    }
}
