//! vm.resize and vm.resize-zone: Cloud Hypervisor's body onto [`VmmAction::Resize`].
//! Kata's clh driver calls vm.resize at sandbox start (static_sandbox_resource_mgmt =
//! false, its default) with the vCPU count the sandbox should have, often the boot
//! count; vCPUs are hot-plugged up to `cpus.max_vcpus`, and RAM (`desired_ram`, Kata's
//! ResizeMemory: the new total, in whole memory blocks) up to `memory.size` plus
//! `memory.hotplug_size`.

use serde::Deserialize;

use gpuvm_vmm::action::{VmmAction, VmmData};

use super::super::config::Other;
use super::{fault, from_error, not_created, parse, state, Dispatch};
use crate::http::{Request, Response};

/// What Kata users can set to keep Kata from resizing the VM.
const KATA_STATIC: &str =
    "set static_sandbox_resource_mgmt = true in Kata's configuration-clh.toml";

/// Cloud Hypervisor's VmResize.
#[derive(Deserialize)]
struct VmResize {
    #[serde(default)]
    desired_vcpus: Option<u64>,
    #[serde(default)]
    desired_ram: Option<u64>,
    #[serde(default)]
    desired_balloon: Option<u64>,
    #[serde(flatten)]
    other: Other,
}

/// PUT vm.resize.
pub(super) fn resize(request: &Request, dispatch: Dispatch) -> Response {
    let body: VmResize = match parse(&request.body) {
        Ok(body) => body,
        Err(response) => return response,
    };
    if let Some(name) = body.other.keys().next() {
        return fault(400, format!("vm.resize: unknown field {name:?}"));
    }
    if body.desired_balloon.is_some() {
        return fault(
            400,
            "vm.resize desired_balloon is not supported by gpuvm: change the balloon's target with the balloon's own API",
        );
    }
    if body.desired_vcpus.is_none() && body.desired_ram.is_none() {
        return fault(400, "vm.resize needs desired_vcpus or desired_ram");
    }
    let desired_vcpus = match body.desired_vcpus.map(u8::try_from) {
        None => None,
        Some(Ok(vcpus)) => Some(vcpus),
        Some(Err(_)) => {
            return fault(
                400,
                format!(
                    "desired_vcpus = {}: gpuvm runs 1 to 255 vCPUs",
                    body.desired_vcpus.unwrap_or_default()
                ),
            )
        }
    };
    match state(dispatch) {
        Err(response) => return response,
        Ok(None) => return not_created(),
        Ok(Some(_)) => {}
    }
    let action = VmmAction::Resize {
        desired_vcpus,
        desired_ram: body.desired_ram,
    };
    match dispatch(action) {
        // vm.info shows the vCPUs and RAM the VM has now (the controller's machine
        // configuration), as Cloud Hypervisor's does after a resize.
        Ok(VmmData::Empty | VmmData::Json(_)) => Response::no_content(),
        Err(error) => from_error(error),
    }
}

/// PUT vm.resize-zone: gpuvm's guest RAM has no memory zones (refused whatever the body
/// holds; vm.resize grows the one RAM).
pub(super) fn resize_zone() -> Response {
    fault(
        400,
        format!(
            "vm.resize-zone is not supported by gpuvm: guest RAM has no memory zones (grow RAM with vm.resize desired_ram, or {KATA_STATIC})"
        ),
    )
}
