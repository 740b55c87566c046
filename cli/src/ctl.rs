//! `gpuvm ctl`: one request to a running gpuvm's API socket, from flags or raw.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::ExitCode;

use crate::args::{CtlArgs, CtlCommand, Mode};
use crate::gpuvm_error;

/// `gpuvm ctl`: one request; prints the answer's body, exits 0 on success.
pub fn ctl(args: CtlArgs) -> ExitCode {
    match request(&args) {
        Ok((method, path, body)) => ctl_send(&args.api_sock, &method, &path, body.as_deref()),
        Err(message) => {
            eprintln!("gpuvm: error: {message}");
            gpuvm_error()
        }
    }
}

/// The request the subcommand makes: method, path and body.
fn request(args: &CtlArgs) -> Result<(String, String, Option<String>), String> {
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
                "kernel_image_path": kernel.as_deref().map(|p| absolute(p, "--kernel")).transpose()?,
                "initrd_path": initrd.as_deref().map(|p| absolute(p, "--initrd")).transpose()?,
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
                "snapshot_path": absolute(dir, "--dir")?,
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
                "snapshot_path": absolute(dir, "--dir")?,
                "restore_mode": match restore_mode {
                    Mode::Eager => "Eager",
                    Mode::Lazy => "Lazy",
                    Mode::External => "External",
                },
                "uffd_socket_path": uffd_socket.as_deref().map(|p| absolute(p, "--uffd-socket")).transpose()?,
                "resume_vm": resume,
                "record_working_set": record_working_set,
            })),
        ),
        CtlCommand::Metrics => ("GET", "/metrics", None),
        CtlCommand::Raw { method, path, body } => {
            return Ok((method.clone(), path.clone(), body.clone()));
        }
        CtlCommand::RemoveGpu { id } => {
            return Ok(("DELETE".into(), format!("/gpus/{id}"), None));
        }
        CtlCommand::AddGpu {
            id,
            host_bdf,
            vfio_user_socket,
        } => {
            let body = json!({
                "gpu_id": id,
                "host_bdf": host_bdf,
                "vfio_user_socket": vfio_user_socket.as_deref().map(|p| absolute(p, "--vfio-user-socket")).transpose()?,
            })
            .to_string();
            return Ok(("PUT".into(), format!("/gpus/{id}"), Some(body)));
        }
    };
    Ok((method.into(), path.into(), body.map(|b| b.to_string())))
}

/// Paths go to the server as absolute paths: it does not share our working directory. The
/// API's JSON carries them as text: a path that is not UTF-8 is refused, naming `flag`.
fn absolute(path: &Path, flag: &str) -> Result<String, String> {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    absolute.into_os_string().into_string().map_err(|path| {
        format!(
            "{flag} \"{}\": the path is not valid UTF-8, and the API's JSON carries paths as text",
            path.as_bytes().escape_ascii()
        )
    })
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
