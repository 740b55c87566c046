//! What the front end's tests talk to: gpuvm's real controller before boot (on a thread
//! of its own, as the VMM thread), or a stand-in for a booted VM (a machine cannot be
//! built in a unit test), and files the controller opens (a kernel, a disk image).

use std::cell::{Cell, RefCell};
use std::path::PathBuf;

use gpuvm_vmm::action::{ActionError, ActionResult, ClientRecord, VmmAction, VmmData};
use gpuvm_vmm::action_channel::{action_channel, ActionSender};
use gpuvm_vmm::config::{MachineConfig, VmConfig};
use gpuvm_vmm::controller::{default_boot_source, ApiController};
use serde_json::json;

use super::handle;
use crate::http::{Method, Request, Response};

/// gpuvm's controller before boot. Its machine builder refuses (vm.boot answers
/// "cannot start the VM"); the thread ends when the sender is dropped.
pub fn controller() -> ActionSender {
    let (sender, end) = action_channel().unwrap();
    let config = VmConfig {
        machine: MachineConfig::default(),
        boot: default_boot_source(),
    };
    let mut controller = ApiController::new(
        end.requests,
        end.wake,
        config,
        Box::new(|| Box::new(std::io::sink())),
    );
    controller.set_builder(Box::new(|_, _, _| {
        Err(gpuvm_vmm::Error::EventFd(std::io::Error::other(
            "no machine is built in the front end's tests",
        )))
    }));
    std::thread::spawn(move || {
        controller.wait_for_start();
    });
    sender
}

/// Calls a route with no descriptors.
pub fn call(dispatch: super::routes::Dispatch, method: Method, path: &str, body: &str) -> Response {
    let request = Request {
        method,
        path: path.into(),
        body: body.as_bytes().to_vec(),
        close: false,
    };
    handle(&request, Vec::new(), dispatch)
}

pub fn json_of(response: &Response) -> serde_json::Value {
    serde_json::from_slice(&response.body).unwrap_or_default()
}

pub fn message(response: &Response) -> String {
    String::from_utf8_lossy(&response.body).into_owned()
}

/// Files a configuration may name (the controller opens a kernel and checks images),
/// in a directory removed when this is dropped.
pub struct Files {
    dir: PathBuf,
    pub kernel: PathBuf,
    pub image: PathBuf,
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn files() -> Files {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("gpuvm-ch-api-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kernel = dir.join("vmlinux");
    let image = dir.join("disk.img");
    std::fs::write(&kernel, b"not a kernel: only opened before boot").unwrap();
    std::fs::write(&image, vec![0u8; 4096]).unwrap();
    Files { dir, kernel, image }
}

/// A booted VM as the controller answers for it: its state, the client's record (as
/// vm.create left it), its vCPUs (a resize changes them) and hot-plugs that succeed.
pub struct Booted {
    pub record: RefCell<ClientRecord>,
    pub vcpus: Cell<u8>,
    pub max_vcpus: u8,
    pub mem_mib: u64,
    pub resizes: RefCell<Vec<(Option<u8>, Option<u64>)>>,
    pub seen: RefCell<Vec<String>>,
}

impl Booted {
    pub fn new(record: ClientRecord) -> Self {
        Booted {
            record: RefCell::new(record),
            vcpus: Cell::new(2),
            max_vcpus: 8,
            mem_mib: 2048,
            resizes: RefCell::new(Vec::new()),
            seen: RefCell::new(Vec::new()),
        }
    }

    pub fn act(&self, action: VmmAction) -> ActionResult {
        let name = format!("{action:?}");
        self.seen.borrow_mut().push(
            name.split([' ', '(', '{'])
                .next()
                .unwrap_or_default()
                .to_string(),
        );
        match action {
            VmmAction::GetInstanceInfo => Ok(VmmData::Json(json!({
                "state": "Running",
                "client_record": *self.record.borrow(),
                "pci_devices": [{"id": "_disk0", "bdf": "0000:00:04.0"}],
            }))),
            VmmAction::GetMachineConfig => Ok(VmmData::Json(json!({
                "vcpu_count": self.vcpus.get(),
                "max_vcpus": self.max_vcpus,
                "mem_size_mib": self.mem_mib,
            }))),
            VmmAction::BootCreated => Err(ActionError::wrong_state("the VM is already booted")),
            VmmAction::Pause | VmmAction::Resume => Ok(VmmData::Empty),
            VmmAction::AddDevice(request) => {
                let add = request.translate(&self.record.borrow())?;
                if add.segment != 0 {
                    return Err(ActionError::bad_request(
                        "gpuvm hot-plugs devices other than GPUs on PCI segment 0 only",
                    ));
                }
                let id = add
                    .client_id
                    .unwrap_or_else(|| format!("{}1", add.id_prefix));
                Ok(VmmData::Json(json!({"id": id, "bdf": "0000:00:06.0"})))
            }
            VmmAction::Resize {
                desired_vcpus,
                desired_ram,
            } => {
                self.resizes.borrow_mut().push((desired_vcpus, desired_ram));
                match (desired_vcpus, desired_ram) {
                    (Some(0), _) => Err(ActionError::bad_request("desired_vcpus = 0")),
                    (Some(n), _) if n > self.max_vcpus => {
                        Err(ActionError::bad_request("above max_vcpus"))
                    }
                    (_, Some(ram)) if ram != self.mem_mib << 20 => Err(ActionError::bad_request(
                        "no memory hot-plug (static_sandbox_resource_mgmt)",
                    )),
                    (vcpus, _) => {
                        if let Some(vcpus) = vcpus {
                            self.vcpus.set(vcpus);
                        }
                        Ok(VmmData::Empty)
                    }
                }
            }
            _ => Ok(VmmData::Empty),
        }
    }
}
