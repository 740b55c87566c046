//! The controller's pre-boot device configuration: passthrough devices, drives, network
//! interfaces (by name or as passed tap descriptors), vsock, entropy and file-system
//! shares, each checked before it replaces what was configured.

use super::{ApiController, MAX_GPUS};
use crate::action::{absolute_path, ActionError, ActionResult, DriveBody, GpuBody, VmmData};
use crate::virtio::VirtioOptions;

impl ApiController {
    /// Adds or replaces (same id) a passthrough device before start.
    pub fn put_gpu(&mut self, body: GpuBody) -> ActionResult {
        body.validate(None)?;
        let count = self.gpus.len();
        match self.gpus.iter_mut().find(|g| g.gpu_id == body.gpu_id) {
            Some(existing) => *existing = body,
            None if count >= MAX_GPUS => {
                return Err(ActionError::bad_request(format!(
                    "at most {MAX_GPUS} passthrough devices per VM"
                )))
            }
            None => self.gpus.push(body),
        }
        Ok(VmmData::Empty)
    }

    /// Changes the virtio devices InstanceStart attaches; refused (and nothing changed)
    /// when the result is over a limit or reuses an id.
    pub(super) fn put_virtio(&mut self, change: impl FnOnce(&mut VirtioOptions)) -> ActionResult {
        let mut virtio = self.pci.virtio.clone();
        change(&mut virtio);
        virtio
            .validate()
            .map_err(|e| ActionError::bad_request(e.to_string()))?;
        self.pci.virtio = virtio;
        Ok(VmmData::Empty)
    }

    /// Adds or replaces (same id, either kind) a drive before start. A local image is
    /// checked now as the device will open it (it exists, is a regular file or a block
    /// device, opens in the drive's mode, is not locked by another process): a bad image
    /// is refused here, so that it never stays in the configuration to fail the start.
    pub(super) fn put_drive(&mut self, body: DriveBody) -> ActionResult {
        let id = body.drive_id().to_string();
        match &body {
            DriveBody::Local(config) => {
                absolute_path(&config.path, "path")?;
                gpuvm_virtio::block::check_image(config)
                    .map_err(|e| ActionError::bad_request(format!("drive {id}: {e}")))?;
            }
            DriveBody::VhostUser(config) => absolute_path(&config.socket, "socket")?,
        }
        self.put_virtio(|v| {
            let local = v.drives.iter().position(|d| d.drive_id == id);
            let remote = v.vhost_user_drives.iter().position(|d| d.drive_id == id);
            match body {
                DriveBody::Local(config) => {
                    if let Some(index) = remote {
                        v.vhost_user_drives.remove(index);
                    }
                    match local {
                        Some(index) => v.drives[index] = config,
                        None => v.drives.push(config),
                    }
                }
                DriveBody::VhostUser(config) => {
                    if let Some(index) = local {
                        v.drives.remove(index);
                    }
                    match remote {
                        Some(index) => v.vhost_user_drives[index] = config,
                        None => v.vhost_user_drives.push(config),
                    }
                }
            }
        })
    }

    /// Removes the device `id` configured before start, whatever its kind: a passthrough
    /// device, a drive (local or vhost-user), a network interface (and the taps passed
    /// for it), a virtio-fs share (by tag), a vhost-user device, the vsock device
    /// (`vsock` or its `vsock_id`) or the entropy device (`rng`). 404 when none has it.
    pub(super) fn remove_configured(&mut self, id: &str) -> ActionResult {
        if let Some(index) = self.gpus.iter().position(|g| g.gpu_id == id) {
            self.gpus.remove(index);
            return Ok(VmmData::Empty);
        }
        let v = &mut self.pci.virtio;
        let before = (
            v.drives.len() + v.vhost_user_drives.len() + v.nets.len(),
            v.fs.len() + v.vhost_user.len(),
        );
        v.drives.retain(|d| d.drive_id != id);
        v.vhost_user_drives.retain(|d| d.drive_id != id);
        v.nets.retain(|n| n.iface_id != id);
        v.fs.retain(|f| f.tag != id);
        v.vhost_user.retain(|u| u.id != id);
        let mut removed = before
            != (
                v.drives.len() + v.vhost_user_drives.len() + v.nets.len(),
                v.fs.len() + v.vhost_user.len(),
            );
        if v.vsock
            .as_ref()
            .is_some_and(|vsock| id == "vsock" || vsock.vsock_id.as_deref() == Some(id))
        {
            v.vsock = None;
            removed = true;
        }
        if id == "rng" && v.rng.take().is_some() {
            removed = true;
        }
        if !removed {
            return Err(ActionError {
                status: 404,
                message: format!("no device with id {id:?} is configured"),
            });
        }
        v.pci_segments.remove(id);
        // Taps passed for an interface of that id are closed.
        self.pci.device_resources.take(id);
        Ok(VmmData::Empty)
    }

    /// A network interface whose tap queues came as descriptors, one per queue pair. Each
    /// is checked (TUNGETIFF: an attached tap with IFF_TAP, IFF_NO_PI, IFF_VNET_HDR) and
    /// set up now, on this thread (the API thread's filter allows no tap ioctls; this
    /// thread takes its filter only when the VM runs), and kept until InstanceStart.
    pub(super) fn put_net_fds(
        &mut self,
        mut config: gpuvm_virtio::net::NetConfig,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> ActionResult {
        let id = config.iface_id.clone();
        let taps = taps_from_fds(&config, fds)?;
        // The descriptors are the taps: nothing is opened by name.
        config.host_dev_name = None;
        self.put_virtio(|v| replace_or_push(&mut v.nets, config, |n| n.iface_id.clone()))?;
        self.pci.device_resources.insert(&id, taps);
        Ok(VmmData::Empty)
    }
}

/// The tap queues passed for the interface `config` (one descriptor per queue pair, each
/// checked to be a tap).
pub(super) fn taps_from_fds(
    config: &gpuvm_virtio::net::NetConfig,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<Vec<gpuvm_virtio::net::Tap>, ActionError> {
    let id = &config.iface_id;
    let pairs = config.num_queue_pairs;
    if fds.len() != usize::from(pairs) {
        return Err(ActionError::bad_request(format!(
            "network interface {id}: {pairs} queue pair(s) take {pairs} tap descriptor(s), {} were passed",
            fds.len()
        )));
    }
    fds.into_iter()
        .map(gpuvm_virtio::net::Tap::from_fd)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ActionError::bad_request(format!("network interface {id}: {e}")))
}

/// Replaces the entry with `item`'s id, or appends it.
pub(super) fn replace_or_push<T>(items: &mut Vec<T>, item: T, id: impl Fn(&T) -> String) {
    let wanted = id(&item);
    match items.iter_mut().find(|existing| id(existing) == wanted) {
        Some(existing) => *existing = item,
        None => items.push(item),
    }
}
