//! Hot-plug of virtio devices into a running VM (Cloud Hypervisor's vm.add-disk,
//! vm.add-net and vm.add-vsock after vm.boot; Kata adds a container's block
//! rootfs so), through the same ACPI PCI hot-plug as passthrough devices:
//!
//! ```text
//! plug    open the device (image, taps, vhost-user backend), put it behind a virtio-pci
//!         transport in a free slot of bus 0 (MSI-X GSIs, ioeventfds; an idle I/O thread
//!         serves it once the driver starts it), set its PCIU bit and raise the GSI
//! eject   set its PCID bit; once the guest wrote B0EJ, the transport is dropped: its
//!         notifications unregistered, the device reset (its I/O thread goes back idle),
//!         its MSI routes released
//! ```
//!
//! The handles live with the other virtio devices (`MachineDevices::virtio`), so pause,
//! snapshots and restores treat them alike; a snapshot records their slots, and a restore
//! puts them back there, still ejectable.

use std::sync::Arc;

use gpuvm_devices::pci::PciBdf;
use gpuvm_virtio::transport::IoEventRegistrar;
use gpuvm_virtio::GuestMemory;

use super::{EjectState, HotplugError, PciHotplug};
use crate::lock;
use crate::virtio::{BusPlug, DeviceResources, VirtioDeviceConfig, VirtioHandle, VirtioOptions};

/// What PciHotplug keeps to build virtio devices at runtime.
pub(crate) struct VirtioPlugContext {
    pub memory: GuestMemory,
    pub ioevents: Arc<dyn IoEventRegistrar>,
    /// Ids of the hot-plugged virtio devices the guest was asked to eject.
    pub ejecting: std::collections::BTreeSet<String>,
}

/// The options `handles` were built from, plus `config`: what the limits and id checks
/// of [`VirtioOptions::validate`] see.
fn options_with(handles: &[VirtioHandle], config: &VirtioDeviceConfig) -> VirtioOptions {
    let mut options = VirtioOptions::default();
    for config in handles.iter().map(|h| &h.config).chain([config]) {
        match config.clone() {
            VirtioDeviceConfig::Block(c) => options.drives.push(c),
            VirtioDeviceConfig::Net(c) => options.nets.push(c),
            VirtioDeviceConfig::Vsock(c) => options.vsock = Some(c),
            VirtioDeviceConfig::Rng(c) => options.rng = Some(c),
            VirtioDeviceConfig::Balloon(c) => options.balloon = Some(c),
            VirtioDeviceConfig::VhostUserBlock(c) => options.vhost_user_drives.push(c),
            VirtioDeviceConfig::Fs(c) => options.fs.push(c),
            VirtioDeviceConfig::VhostUser(c) => options.vhost_user.push(c),
        }
    }
    options
}

impl PciHotplug {
    /// Builds the device `config` describes (a network interface naming no tap takes its
    /// queues from `passed`), plugs it into a free slot of bus 0, tells the guest, and adds
    /// its handle to `handles`; returns its bus address.
    pub fn plug_virtio(
        &mut self,
        handles: &mut Vec<VirtioHandle>,
        config: VirtioDeviceConfig,
        passed: &DeviceResources,
    ) -> Result<PciBdf, HotplugError> {
        let id = config.id().to_string();
        let refuse =
            |message: String| HotplugError::Conflict(format!("cannot add {id}: {message}"));
        if matches!(
            config,
            VirtioDeviceConfig::Rng(_) | VirtioDeviceConfig::Balloon(_)
        ) {
            return Err(refuse(
                "entropy and balloon devices are configured before boot".into(),
            ));
        }
        // A vhost-user front end starts a thread of its own under the device filter, which
        // the VMM thread's filter cannot hand on.
        if matches!(
            config,
            VirtioDeviceConfig::VhostUserBlock(_)
                | VirtioDeviceConfig::Fs(_)
                | VirtioDeviceConfig::VhostUser(_)
        ) {
            return Err(refuse(
                "vhost-user devices (virtio-fs shares, vhost-user disks) are added before boot"
                    .into(),
            ));
        }
        if self.contains(&id) || handles.iter().any(|h| h.config.id() == id) {
            return Err(refuse("a device with this id is already attached".into()));
        }
        if matches!(config, VirtioDeviceConfig::Vsock(_))
            && handles
                .iter()
                .any(|h| matches!(h.config, VirtioDeviceConfig::Vsock(_)))
        {
            return Err(refuse("the VM already has a vsock device".into()));
        }
        options_with(handles, &config)
            .validate()
            .map_err(|e| refuse(e.to_string()))?;
        // No thread is taken here: the device's is made when the guest activates it
        // (crate::virtio::start_io_threads), so free slots are the only limit.
        let device =
            crate::virtio::open_device(&config, passed).map_err(|e| refuse(e.to_string()))?;
        let plug = BusPlug {
            memory: &self.virtio.memory,
            root: &self.root,
            router: &self.router,
            ioevents: &self.virtio.ioevents,
        };
        let mut handle = plug
            .plug(config, device, None)
            .map_err(|e| refuse(e.to_string()))?;
        handle.hot_plugged = true;
        let bdf = handle.bdf;
        lock(&self.controller).device_added(bdf.device);
        log::info!(
            "hot-plug: {id} is {} (0000:{bdf})",
            lock(&handle.transport).name()
        );
        handles.push(handle);
        Ok(bdf)
    }

    /// Marks the slots of restored hot-plugged virtio devices ejectable again.
    pub fn virtio_restored(&self, handles: &[VirtioHandle]) {
        let mut controller = lock(&self.controller);
        for handle in handles.iter().filter(|h| h.hot_plugged) {
            controller.device_restored(handle.bdf.device);
        }
    }

    /// Asks the guest to eject the hot-plugged virtio device `id`; None if no virtio
    /// device has that id.
    pub(super) fn request_virtio_eject(
        &mut self,
        handles: &[VirtioHandle],
        id: &str,
    ) -> Option<Result<PciBdf, HotplugError>> {
        let handle = handles.iter().find(|h| h.config.id() == id)?;
        if !handle.hot_plugged {
            return Some(Err(HotplugError::Conflict(format!(
                "{id} was attached before boot; only hot-plugged devices can be removed"
            ))));
        }
        if !self.virtio.ejecting.insert(id.to_string()) {
            return Some(Err(HotplugError::Conflict(format!(
                "{id} is already being removed"
            ))));
        }
        lock(&self.controller).request_eject(handle.bdf.device);
        log::info!(
            "hot-unplug: asked the guest to eject {id} (0000:{})",
            handle.bdf
        );
        Some(Ok(handle.bdf))
    }

    /// Takes the virtio device `id` down if the guest ejected it; None if no virtio
    /// device has that id.
    pub(super) fn poll_virtio_eject(
        &mut self,
        handles: &mut Vec<VirtioHandle>,
        id: &str,
    ) -> Option<EjectState> {
        let at = handles.iter().position(|h| h.config.id() == id)?;
        let slot = handles[at].bdf.device;
        if !lock(&self.controller).take_ejected(slot) {
            return Some(EjectState::Waiting);
        }
        let handle = handles.remove(at);
        self.virtio.ejecting.remove(id);
        lock(&self.controller).forget(slot);
        self.root.remove_device(handle.bdf);
        let label = format!("{} {id}", lock(&handle.transport).name());
        let gsis = handle.gsis.clone();
        // The transport's drop unregisters its notifications and resets the device,
        // which stops its I/O thread; then nothing signals the vectors any more.
        drop(handle);
        self.router.release(&gsis);
        log::info!("hot-unplug: {label} removed");
        Some(EjectState::Removed(label))
    }

    /// The guest did not eject the virtio device `id` in time: the request is withdrawn.
    pub(super) fn cancel_virtio_eject(&mut self, handles: &[VirtioHandle], id: &str) -> bool {
        let Some(handle) = handles.iter().find(|h| h.config.id() == id) else {
            return false;
        };
        self.virtio.ejecting.remove(id);
        lock(&self.controller).cancel_eject(handle.bdf.device);
        true
    }
}
