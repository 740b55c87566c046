//! Wires virtio devices into a VM: builds each configured device, puts it behind a
//! virtio-pci transport on the PCI root bus (MSI-X vectors as GSI routes + irqfds, queue
//! notifications as KVM ioeventfds), and sets up the devices' I/O threads under the
//! `device` seccomp filter (one per device made up front, any other made on demand).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::{PciBdf, PciRoot};
use gpuvm_devices::Persist;
use gpuvm_virtio::balloon::{Balloon, BalloonConfig};
use gpuvm_virtio::block::{Block, BlockConfig};
use gpuvm_virtio::net::{Net, NetConfig, Tap};
use gpuvm_virtio::rng::{Rng, RngConfig};
use gpuvm_virtio::transport::{IoEventRegistrar, VirtioPciDevice, VirtioPciState};
use gpuvm_virtio::vhost_user::{
    FsConfig, VhostUserBlock, VhostUserBlockConfig, VhostUserConfig, VhostUserFs, VhostUserGeneric,
};
use gpuvm_virtio::vsock::{Vsock, VsockConfig};
use gpuvm_virtio::{GuestMemory, VirtioDevice};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::interrupts::{KvmIoEvents, MsiRouter};
use crate::lock;

/// Drives one VM may have (bus 0 has 31 slots, shared with GPUs and other devices).
pub const MAX_DRIVES: usize = 16;
/// Network interfaces one VM may have.
pub const MAX_NETS: usize = 8;
/// virtio-fs shares one VM may have.
pub const MAX_FS: usize = 8;
/// Generic vhost-user devices (`--vhost-user`) one VM may have.
pub const MAX_VHOST_USER: usize = 8;

/// The virtio devices of one VM, as configured (CLI, API, config file) and as a snapshot
/// records them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioOptions {
    #[serde(default)]
    pub drives: Vec<BlockConfig>,
    #[serde(default)]
    pub nets: Vec<NetConfig>,
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    #[serde(default)]
    pub rng: Option<RngConfig>,
    /// Drives served by a vhost-user backend (qemu-storage-daemon).
    #[serde(default)]
    pub vhost_user_drives: Vec<VhostUserBlockConfig>,
    /// virtio-fs shares served by virtiofsd.
    #[serde(default)]
    pub fs: Vec<FsConfig>,
    /// Devices of any other type a vhost-user backend implements (`--vhost-user`).
    #[serde(default)]
    pub vhost_user: Vec<VhostUserConfig>,
    /// The memory balloon (PUT /balloon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon: Option<BalloonConfig>,
    /// The PCI segment of each device not on segment 0, by device id (a drive or
    /// interface id, a share's tag, `vsock`, `rng`: [`VirtioDeviceConfig::id`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pci_segments: BTreeMap<String, u16>,
    /// Where a restore puts each device back, by device id: its slot on its segment's
    /// bus and its BAR's address, as the snapshot recorded them (hot-plugged devices are
    /// not in bus order). Never part of a configuration.
    #[serde(skip)]
    pub restored_places: BTreeMap<String, RestoredPlace>,
}

/// A restored device's place on its bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoredPlace {
    pub slot: u8,
    pub bar_address: u64,
    /// It was hot-plugged (so the guest may be asked to eject it).
    pub hot_plugged: bool,
}

impl VirtioOptions {
    pub fn is_empty(&self) -> bool {
        self.device_count() == 0
    }

    /// How many devices (and so I/O threads) these options make.
    pub fn device_count(&self) -> usize {
        self.drives.len()
            + self.vhost_user_drives.len()
            + self.fs.len()
            + self.vhost_user.len()
            + self.nets.len()
            + usize::from(self.vsock.is_some())
            + usize::from(self.rng.is_some())
            + usize::from(self.balloon.is_some())
    }

    /// Checks what can be checked before anything is opened: counts and unique ids.
    pub fn validate(&self) -> Result<(), VirtioSetupError> {
        if self.drives.len() + self.vhost_user_drives.len() > MAX_DRIVES {
            return Err(VirtioSetupError::TooMany {
                what: "drives",
                max: MAX_DRIVES,
            });
        }
        if self.nets.len() > MAX_NETS {
            return Err(VirtioSetupError::TooMany {
                what: "network interfaces",
                max: MAX_NETS,
            });
        }
        for drive in &self.drives {
            check_id("drive_id", &drive.drive_id)?;
            drive.validate().map_err(|source| VirtioSetupError::Block {
                id: drive.drive_id.clone(),
                source,
            })?;
            drive
                .rate_limiter
                .validate()
                .map_err(|e| VirtioSetupError::Invalid(format!("drive {}: {e}", drive.drive_id)))?;
        }
        for net in &self.nets {
            net.validate()
                .map_err(|e| VirtioSetupError::Invalid(e.to_string()))?;
        }
        if let Some(vsock) = &self.vsock {
            vsock
                .validate()
                .map_err(|e| VirtioSetupError::Vsock(e.to_string()))?;
        }
        if let Some(rng) = &self.rng {
            rng.rate_limiter
                .validate()
                .map_err(|e| VirtioSetupError::Invalid(format!("entropy device: {e}")))?;
        }
        for drive in &self.vhost_user_drives {
            check_id("drive_id", &drive.drive_id)?;
            drive
                .validate()
                .map_err(|e| VirtioSetupError::VhostUser(e.to_string()))?;
        }
        if self.fs.len() > MAX_FS {
            return Err(VirtioSetupError::TooMany {
                what: "virtio-fs shares",
                max: MAX_FS,
            });
        }
        for fs in &self.fs {
            fs.validate()
                .map_err(|e| VirtioSetupError::VhostUser(e.to_string()))?;
        }
        if self.vhost_user.len() > MAX_VHOST_USER {
            return Err(VirtioSetupError::TooMany {
                what: "generic vhost-user devices",
                max: MAX_VHOST_USER,
            });
        }
        for device in &self.vhost_user {
            check_id("vhost-user id", &device.id)?;
            device
                .validate()
                .map_err(|e| VirtioSetupError::VhostUser(e.to_string()))?;
        }
        let mut tags: Vec<&str> = self.fs.iter().map(|f| f.tag.as_str()).collect();
        tags.sort_unstable();
        if let Some(pair) = tags.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(VirtioSetupError::DuplicateId(pair[0].to_string()));
        }
        // A vhost-user backend serves one front end per socket: a second device on it
        // would wait for an answer that never comes.
        let mut sockets: Vec<(&std::path::Path, &str)> = self
            .vhost_user_drives
            .iter()
            .map(|d| (d.socket.as_path(), d.drive_id.as_str()))
            .collect();
        sockets.extend(self.fs.iter().map(|f| (f.socket.as_path(), f.tag.as_str())));
        sockets.extend(
            self.vhost_user
                .iter()
                .map(|d| (d.socket.as_path(), d.id.as_str())),
        );
        sockets.sort_unstable();
        if let Some(pair) = sockets.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(VirtioSetupError::VhostUser(format!(
                "{} and {} both name the vhost-user socket {}: a backend serves one device per socket",
                pair[0].1,
                pair[1].1,
                pair[0].0.display()
            )));
        }
        let mut ids: Vec<&str> = self.drives.iter().map(|d| d.drive_id.as_str()).collect();
        ids.extend(self.vhost_user_drives.iter().map(|d| d.drive_id.as_str()));
        ids.extend(self.nets.iter().map(|n| n.iface_id.as_str()));
        ids.extend(self.vhost_user.iter().map(|d| d.id.as_str()));
        ids.sort_unstable();
        if let Some(pair) = ids.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(VirtioSetupError::DuplicateId(pair[0].to_string()));
        }
        Ok(())
    }
}

/// What the devices the VMM builds are given besides their configuration: tap queues that
/// came as file descriptors, by interface id (Cloud Hypervisor's vm.add-net passes them
/// with SCM_RIGHTS, for interfaces whose configuration names no tap; a live update hands
/// over every interface's, which its device takes instead of opening the tap by name);
/// virtio-blk images a live update handed over, open and locked, by drive id; and the
/// VM's MMDS, which the controller adds ([`DeviceResources::with_mmds`]) for every
/// interface it builds (the MMDS configuration says which ones answer it). Clones share
/// the descriptors; building a device takes its own out (once: a failed start leaves the
/// interface without taps, and a drive opens its path).
#[derive(Clone, Default)]
pub struct DeviceResources {
    taps: Arc<Mutex<BTreeMap<String, Vec<Tap>>>>,
    images: Arc<Mutex<BTreeMap<String, std::fs::File>>>,
    /// The vsock device's listening socket a live update handed over (a VM has at most
    /// one vsock device).
    vsock_listener: Arc<Mutex<Option<std::os::unix::net::UnixListener>>>,
    /// The vhost-user devices' connections a live update handed over, by device id, with
    /// what they negotiated and showed the guest.
    vhost_user: Arc<Mutex<BTreeMap<String, HandedOverVhostUser>>>,
    mmds: Option<Arc<gpuvm_mmds::Mmds>>,
}

/// A vhost-user device's connection a live update handed over, and what goes with it.
pub type HandedOverVhostUser = (
    std::os::unix::net::UnixStream,
    gpuvm_virtio::vhost_user::VhostUserLive,
);

impl DeviceResources {
    /// Keeps `taps` for the interface `iface_id`, replacing (closing) any it had.
    pub fn insert(&self, iface_id: &str, taps: Vec<Tap>) {
        lock(&self.taps).insert(iface_id.to_string(), taps);
    }

    /// Takes the interface's taps out (None if none were passed, or they were taken).
    pub fn take(&self, iface_id: &str) -> Option<Vec<Tap>> {
        lock(&self.taps).remove(iface_id)
    }

    /// The interfaces that have taps waiting.
    pub fn ids(&self) -> Vec<String> {
        lock(&self.taps).keys().cloned().collect()
    }

    /// Keeps `image` (an open, locked image a live update handed over) for the drive
    /// `drive_id`, whose device then takes it instead of opening its path.
    pub fn insert_image(&self, drive_id: &str, image: std::fs::File) {
        lock(&self.images).insert(drive_id.to_string(), image);
    }

    /// Takes the drive's handed-over image out (None if there is none).
    pub fn take_image(&self, drive_id: &str) -> Option<std::fs::File> {
        lock(&self.images).remove(drive_id)
    }

    /// Keeps the vsock listener a live update handed over: the vsock device built next
    /// takes it instead of binding its `uds_path` (which the old process still listens on).
    pub fn insert_vsock_listener(&self, listener: std::os::unix::net::UnixListener) {
        *lock(&self.vsock_listener) = Some(listener);
    }

    /// Keeps the connection a live update handed over for the vhost-user device `id`,
    /// which its device then takes instead of connecting to the backend (which serves one
    /// frontend, the old process's connection).
    pub fn insert_vhost_user(&self, id: &str, connection: HandedOverVhostUser) {
        lock(&self.vhost_user).insert(id.to_string(), connection);
    }

    /// Takes the vhost-user device's handed-over connection out (None if there is none).
    pub fn take_vhost_user(&self, id: &str) -> Option<HandedOverVhostUser> {
        lock(&self.vhost_user).remove(id)
    }

    /// Takes the handed-over vsock listener out (None if there is none).
    pub fn take_vsock_listener(&self) -> Option<std::os::unix::net::UnixListener> {
        lock(&self.vsock_listener).take()
    }

    /// Closes the images, taps and vsock listener no device took; returns their drive and
    /// interface ids (`vsock` for the listener).
    pub fn forget_unused(&self) -> Vec<String> {
        let mut unused: Vec<String> = std::mem::take(&mut *lock(&self.images))
            .into_keys()
            .collect();
        unused.extend(std::mem::take(&mut *lock(&self.taps)).into_keys());
        unused.extend(std::mem::take(&mut *lock(&self.vhost_user)).into_keys());
        if self.take_vsock_listener().is_some() {
            unused.push("vsock".into());
        }
        unused
    }

    /// The same descriptors (shared), with `mmds` for the interfaces built from them.
    pub fn with_mmds(&self, mmds: &Arc<gpuvm_mmds::Mmds>) -> DeviceResources {
        DeviceResources {
            taps: self.taps.clone(),
            images: self.images.clone(),
            vsock_listener: self.vsock_listener.clone(),
            vhost_user: self.vhost_user.clone(),
            mmds: Some(mmds.clone()),
        }
    }

    /// The MMDS the interfaces built from this set get, if any.
    pub fn mmds(&self) -> Option<&Arc<gpuvm_mmds::Mmds>> {
        self.mmds.as_ref()
    }
}

impl std::fmt::Debug for DeviceResources {
    /// The interfaces with taps and the drives with images waiting, and whether MMDS is
    /// given (not the store).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceResources")
            .field("interfaces", &self.ids())
            .field("drives", &lock(&self.images).keys().collect::<Vec<_>>())
            .field("mmds", &self.mmds.is_some())
            .finish()
    }
}

impl PartialEq for DeviceResources {
    /// The same set, or sets for the same interfaces (descriptors are not compared).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.taps, &other.taps) || self.ids() == other.ids()
    }
}

/// Device ids name threads, log lines and API paths: 1 to 64 of [A-Za-z0-9_.-].
fn check_id(field: &str, id: &str) -> Result<(), VirtioSetupError> {
    let valid = (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(VirtioSetupError::Invalid(format!(
            "{field} must be 1 to 64 characters of [A-Za-z0-9_.-], got {id:?}"
        )))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VirtioSetupError {
    #[error("{0}")]
    Invalid(String),
    #[error("at most {max} {what} per VM")]
    TooMany { what: &'static str, max: usize },
    #[error("device id {0:?} is used twice")]
    DuplicateId(String),
    #[error("drive {id}: {source}")]
    Block {
        id: String,
        source: gpuvm_virtio::block::BlockError,
    },
    #[error("network interface {id}: {message}")]
    Net { id: String, message: String },
    #[error("vsock: {0}")]
    Vsock(String),
    #[error("entropy device: {0}")]
    Rng(gpuvm_virtio::rng::RngError),
    #[error("{0}")]
    VhostUser(String),
    #[error("{device}: {source}")]
    Transport {
        device: String,
        source: gpuvm_virtio::transport::TransportError,
    },
    #[error("cannot put {device} on the PCI bus: {source}")]
    Plug {
        device: String,
        source: gpuvm_devices::pci::PciError,
    },
    #[error("cannot create the virtio devices' I/O threads: {0}")]
    Threads(gpuvm_virtio::worker::WorkerError),
}

/// What kind of virtio device a handle is, with its configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VirtioDeviceConfig {
    Block(BlockConfig),
    Net(NetConfig),
    Vsock(VsockConfig),
    Rng(RngConfig),
    Balloon(BalloonConfig),
    VhostUserBlock(VhostUserBlockConfig),
    Fs(FsConfig),
    VhostUser(VhostUserConfig),
}

impl VirtioDeviceConfig {
    /// The device's id: the drive or interface id, or its kind for the singletons.
    pub fn id(&self) -> &str {
        match self {
            VirtioDeviceConfig::Block(config) => &config.drive_id,
            VirtioDeviceConfig::Net(config) => &config.iface_id,
            VirtioDeviceConfig::Vsock(_) => "vsock",
            VirtioDeviceConfig::Rng(_) => "rng",
            VirtioDeviceConfig::Balloon(_) => "balloon",
            VirtioDeviceConfig::VhostUserBlock(config) => &config.drive_id,
            VirtioDeviceConfig::Fs(config) => &config.tag,
            VirtioDeviceConfig::VhostUser(config) => &config.id,
        }
    }

    /// Why a snapshot of a VM with this device is refused, if it is: a vhost-user
    /// device's state lives in its backend, which gpuvm cannot save yet. (A network
    /// interface whose taps came as descriptors is saved; its restore takes new ones.)
    pub fn snapshot_refusal(&self) -> Option<String> {
        let (what, socket) = match self {
            VirtioDeviceConfig::VhostUserBlock(config) => ("vhost-user drive", &config.socket),
            VirtioDeviceConfig::Fs(config) => ("virtio-fs share", &config.socket),
            VirtioDeviceConfig::VhostUser(config) => ("vhost-user device", &config.socket),
            _ => return None,
        };
        Some(format!(
            "{what} {} (backend {}) keeps its state in the backend, which gpuvm cannot save yet",
            self.id(),
            socket.display()
        ))
    }
}

/// A virtio device on the VM's PCI bus.
pub struct VirtioHandle {
    pub config: VirtioDeviceConfig,
    pub bdf: PciBdf,
    pub transport: Arc<Mutex<VirtioPciDevice>>,
    /// Plugged while the VM ran (or restored so): the guest may be asked to eject it.
    pub hot_plugged: bool,
    /// Its MSI-X vectors' GSIs (released when it is unplugged).
    pub gsis: Vec<u32>,
}

impl VirtioHandle {
    /// Runs `work` on the device behind the transport (locked meanwhile) when it is a `T`;
    /// None when it is another kind of device.
    pub fn with_device<T: 'static, R>(&self, work: impl FnOnce(&mut T) -> R) -> Option<R> {
        let mut transport = lock(&self.transport);
        let device = transport
            .device_mut()
            .as_any_mut()
            .and_then(|any| any.downcast_mut::<T>())?;
        Some(work(device))
    }
}

/// One virtio device in a snapshot: how it was configured, the PCI segment it was on
/// (absent in older states: 0) and its transport's state (which holds the device's own).
#[derive(Debug, Serialize, Deserialize)]
pub struct VirtioDeviceState {
    pub config: VirtioDeviceConfig,
    #[serde(default)]
    pub pci_segment: u16,
    /// Its slot on the bus (absent in older states: the devices are rebuilt in bus
    /// order, which puts each where it was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u8>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hot_plugged: bool,
    pub transport: VirtioPciState,
}

/// Opens the device `config` describes. A drive takes its image from `passed` when a live
/// update handed it over, else opens its path; a network interface takes its queues from
/// `passed` when they came as descriptors, else opens the tap it names; and every network
/// interface gets the MMDS `passed` holds.
pub(crate) fn open_device(
    config: &VirtioDeviceConfig,
    passed: &DeviceResources,
) -> Result<Box<dyn VirtioDevice>, VirtioSetupError> {
    Ok(match config {
        VirtioDeviceConfig::Block(config) => {
            let block = match passed.take_image(&config.drive_id) {
                Some(image) => Block::adopt(config.clone(), image),
                None => Block::new(config.clone()),
            };
            Box::new(block.map_err(|source| VirtioSetupError::Block {
                id: config.drive_id.clone(),
                source,
            })?)
        }
        VirtioDeviceConfig::Net(config) => {
            let net_error = |message: String| VirtioSetupError::Net {
                id: config.iface_id.clone(),
                message,
            };
            let taps = match (passed.take(&config.iface_id), config.host_dev_name.as_deref()) {
                (Some(taps), _) => taps,
                (None, Some(name)) => Tap::open_queues(name, config.num_queue_pairs)
                    .map_err(|e| net_error(e.to_string()))?,
                (None, None) => return Err(net_error(
                    "no tap device named (host_dev_name), and no tap descriptors passed (or an earlier start took them: add the interface again; a snapshot's interface that came as descriptors takes new ones with Cloud Hypervisor's vm.restore `net_fds`)"
                        .into(),
                )),
            };
            let net = Net::new(config.clone(), taps).map_err(|e| net_error(e.to_string()))?;
            match passed.mmds() {
                Some(mmds) => Box::new(net.with_mmds(mmds.clone())),
                None => Box::new(net),
            }
        }
        VirtioDeviceConfig::Vsock(config) => {
            let vsock = match passed.take_vsock_listener() {
                Some(listener) => Vsock::adopting(config, listener),
                None => Vsock::new(config),
            };
            Box::new(vsock.map_err(|e| VirtioSetupError::Vsock(e.to_string()))?)
        }
        VirtioDeviceConfig::Rng(config) => {
            Box::new(Rng::new(config.clone()).map_err(VirtioSetupError::Rng)?)
        }
        VirtioDeviceConfig::Balloon(config) => Box::new(
            Balloon::new(config.clone()).map_err(|e| VirtioSetupError::Invalid(e.to_string()))?,
        ),
        // The connection errors name the socket, not the device: say which one it is.
        // A live update's device takes the old process's connection over instead.
        VirtioDeviceConfig::VhostUserBlock(config) => {
            let device = match passed.take_vhost_user(&config.drive_id) {
                Some((stream, live)) => VhostUserBlock::adopting(config.clone(), stream, &live),
                None => VhostUserBlock::new(config.clone()),
            };
            Box::new(device.map_err(|e| {
                VirtioSetupError::VhostUser(format!("vhost-user-blk {}: {e}", config.drive_id))
            })?)
        }
        VirtioDeviceConfig::Fs(config) => {
            let device = match passed.take_vhost_user(&config.tag) {
                Some((stream, live)) => VhostUserFs::adopting(config.clone(), stream, &live),
                None => VhostUserFs::new(config.clone()),
            };
            Box::new(device.map_err(|e| {
                VirtioSetupError::VhostUser(format!("vhost-user-fs {}: {e}", config.tag))
            })?)
        }
        VirtioDeviceConfig::VhostUser(config) => {
            let device = match passed.take_vhost_user(&config.id) {
                Some((stream, live)) => VhostUserGeneric::adopting(config.clone(), stream, &live),
                None => VhostUserGeneric::new(config.clone()),
            };
            Box::new(device.map_err(|e| {
                VirtioSetupError::VhostUser(format!("{}: {e}", config.describe_device()))
            })?)
        }
    })
}

/// The devices of `options`, in bus order: drives (local, then vhost-user), file-system
/// shares, generic vhost-user devices, network interfaces, vsock, entropy, balloon.
fn device_configs(options: &VirtioOptions) -> Vec<VirtioDeviceConfig> {
    let mut configs: Vec<VirtioDeviceConfig> = options
        .drives
        .iter()
        .cloned()
        .map(VirtioDeviceConfig::Block)
        .collect();
    configs.extend(
        options
            .vhost_user_drives
            .iter()
            .cloned()
            .map(VirtioDeviceConfig::VhostUserBlock),
    );
    configs.extend(options.fs.iter().cloned().map(VirtioDeviceConfig::Fs));
    configs.extend(
        options
            .vhost_user
            .iter()
            .cloned()
            .map(VirtioDeviceConfig::VhostUser),
    );
    configs.extend(options.nets.iter().cloned().map(VirtioDeviceConfig::Net));
    configs.extend(options.vsock.clone().map(VirtioDeviceConfig::Vsock));
    configs.extend(options.rng.clone().map(VirtioDeviceConfig::Rng));
    configs.extend(options.balloon.clone().map(VirtioDeviceConfig::Balloon));
    configs
}

/// Builds the devices of `options` and plugs each into the root of its PCI segment
/// (`roots[n]` is segment n's); network interfaces that name no tap take their queues
/// from `passed`.
pub fn attach(
    vm: VmFd,
    memory: &GuestMemory,
    roots: &[Arc<PciRoot>],
    router: &Arc<MsiRouter>,
    options: &VirtioOptions,
    passed: &DeviceResources,
) -> Result<Vec<VirtioHandle>, VirtioSetupError> {
    options.validate()?;
    let configs = device_configs(options);
    if let Some(id) = options
        .pci_segments
        .keys()
        .find(|id| !configs.iter().any(|c| c.id() == id.as_str()))
    {
        return Err(VirtioSetupError::Invalid(format!(
            "a PCI segment is given for device {id:?}, which is not configured"
        )));
    }
    let ioevents: Arc<dyn IoEventRegistrar> = Arc::new(KvmIoEvents::new(vm));
    let mut handles = Vec::new();
    for config in configs {
        let segment = options.pci_segments.get(config.id()).copied().unwrap_or(0);
        let root = roots.get(usize::from(segment)).ok_or_else(|| {
            VirtioSetupError::Invalid(format!(
                "device {} is on PCI segment {segment}, which this VM does not have",
                config.id()
            ))
        })?;
        let place = options.restored_places.get(config.id()).copied();
        let device = open_device(&config, passed)?;
        let plug = BusPlug {
            memory,
            root,
            router,
            ioevents: &ioevents,
        };
        handles.push(plug.plug(config, device, place)?);
    }
    Ok(handles)
}

/// Sets up the virtio devices' I/O threads (virtio/src/worker.rs). With filters on: one
/// thread per device of `options`, made now and waited for, under the device filter, for
/// its device's first activation; and the device-thread factory, which makes every other
/// one when a device needs it (hot-plug, a device started again), with no fixed number:
/// its filter is the device filter plus making threads, and each thread it makes stacks
/// the device filter on it. Both are made here, on the VMM thread before its own filter,
/// which allows no new thread with the device's system calls. With filters off: nothing
/// now, each worker gets a fresh thread.
pub fn start_io_threads(options: &VirtioOptions) -> Result<(), VirtioSetupError> {
    use crate::seccomp::{apply, apply_factory, enabled, ThreadKind};
    use gpuvm_virtio::worker::{IoThreads, ThreadSetup};
    let filtered = enabled();
    let factory: ThreadSetup =
        Arc::new(|| apply_factory().map_err(|e| std::io::Error::other(e.to_string())));
    gpuvm_virtio::worker::start(IoThreads {
        count: if filtered { options.device_count() } else { 0 },
        setup: Arc::new(|| {
            apply(ThreadKind::Device).map_err(|e| std::io::Error::other(e.to_string()))
        }),
        factory: filtered.then_some(factory),
    })
    .map_err(VirtioSetupError::Threads)
}

/// What puts a virtio device on a PCI bus: the guest memory it serves, the bus, the MSI
/// routes and the queue notifications.
pub(crate) struct BusPlug<'a> {
    pub memory: &'a GuestMemory,
    pub root: &'a Arc<PciRoot>,
    pub router: &'a Arc<MsiRouter>,
    pub ioevents: &'a Arc<dyn IoEventRegistrar>,
}

impl BusPlug<'_> {
    /// Puts `device` (built from `config`) behind a virtio-pci transport into a free slot,
    /// or into the one `place` says (a restore).
    pub(crate) fn plug(
        &self,
        config: VirtioDeviceConfig,
        device: Box<dyn VirtioDevice>,
        place: Option<RestoredPlace>,
    ) -> Result<VirtioHandle, VirtioSetupError> {
        let name = device.name().to_string();
        let mut gsis = Vec::new();
        let mut allocate = |count| {
            let vectors = self.router.allocate(count)?;
            gsis.extend(vectors.iter().map(|(gsi, _)| *gsi));
            Ok(vectors)
        };
        let transport = VirtioPciDevice::new(
            device,
            self.memory.clone(),
            &mut allocate,
            self.router.clone(),
            self.ioevents.clone(),
        )
        .map_err(|source| {
            self.router.release(&gsis);
            VirtioSetupError::Transport {
                device: name.clone(),
                source,
            }
        })?;
        let transport = Arc::new(Mutex::new(transport));
        let placed = match place {
            Some(place) => self.root.add_device_at(
                place.slot,
                transport.clone(),
                &[(
                    gpuvm_virtio::transport::layout::BAR_INDEX,
                    place.bar_address,
                )],
            ),
            None => self.root.add_device(transport.clone()),
        };
        let bdf = placed.map_err(|source| {
            drop(transport.clone());
            self.router.release(&gsis);
            VirtioSetupError::Plug {
                device: name.clone(),
                source,
            }
        })?;
        log::info!("{name} at {}", bdf.full());
        Ok(VirtioHandle {
            config,
            bdf,
            transport,
            hot_plugged: place.is_some_and(|p| p.hot_plugged),
            gsis,
        })
    }
}

/// Tells the vsock device among `handles`, if any, whether `uds_path`'s socket file is this
/// process's to remove when the device goes (a live update moves it from the old process to
/// the new one at Commit).
pub fn vsock_owns_socket_file(handles: &[VirtioHandle], owns: bool) {
    for handle in handles {
        handle.with_device(|vsock: &mut Vsock| vsock.own_socket_file(owns));
    }
}

/// Stops every device's I/O after the request in flight (for a snapshot).
pub fn pause_all(handles: &[VirtioHandle]) {
    for handle in handles {
        lock(&handle.transport).pause();
    }
}

/// Serves the queues again after [`pause_all`].
pub fn resume_all(handles: &[VirtioHandle]) {
    for handle in handles {
        let mut transport = lock(&handle.transport);
        if let Err(error) = transport.resume() {
            log::error!(
                "{}: cannot resume after a snapshot: {error}",
                transport.name()
            );
        }
    }
}

/// Saves every device (they are paused).
pub fn save_all(
    handles: &[VirtioHandle],
) -> Result<Vec<VirtioDeviceState>, gpuvm_virtio::transport::SnapshotError> {
    handles
        .iter()
        .map(|handle| {
            let mut transport = lock(&handle.transport);
            Ok(VirtioDeviceState {
                config: current_config(handle, &mut transport),
                pci_segment: handle.bdf.segment,
                slot: Some(handle.bdf.device),
                hot_plugged: handle.hot_plugged,
                transport: transport.save()?,
            })
        })
        .collect()
}

/// The configuration to rebuild `handle`'s device from: a drive's current one (PATCH
/// /drives may have swapped its image since the VM was built).
fn current_config(handle: &VirtioHandle, transport: &mut VirtioPciDevice) -> VirtioDeviceConfig {
    let block = transport
        .device_mut()
        .as_any_mut()
        .and_then(|any| any.downcast_mut::<Block>());
    if let Some(block) = block {
        return VirtioDeviceConfig::Block(block.config().clone());
    }
    // The balloon's target and polling interval may have changed since the VM was built.
    let balloon = transport
        .device_mut()
        .as_any_mut()
        .and_then(|any| any.downcast_mut::<Balloon>());
    match balloon {
        Some(balloon) => VirtioDeviceConfig::Balloon(balloon.config().clone()),
        None => handle.config.clone(),
    }
}

/// Runs `work` on the VM's balloon, if it has one.
pub fn with_balloon<T>(
    handles: &[VirtioHandle],
    work: impl FnOnce(&mut Balloon) -> T,
) -> Option<T> {
    handles
        .iter()
        .find(|h| matches!(h.config, VirtioDeviceConfig::Balloon(_)))?
        .with_device(work)
}

/// Loads each saved state into the device built from the same configuration (matched by
/// id: hot-plugged devices were saved in the order they came, and rebuilt in bus order).
pub fn restore_all(
    handles: &[VirtioHandle],
    states: &[VirtioDeviceState],
) -> Result<(), gpuvm_virtio::transport::SnapshotError> {
    for state in states {
        let handle = handles
            .iter()
            .find(|h| h.config.id() == state.config.id())
            .ok_or_else(|| gpuvm_virtio::transport::SnapshotError::NotRebuilt {
                device: state.config.id().to_string(),
            })?;
        lock(&handle.transport).restore(&state.transport)?;
    }
    Ok(())
}

/// The options that rebuild the devices a snapshot saved, in the same bus order.
pub fn options_of(states: &[VirtioDeviceState]) -> VirtioOptions {
    let mut options = VirtioOptions::default();
    for state in states {
        if state.pci_segment != 0 {
            options
                .pci_segments
                .insert(state.config.id().to_string(), state.pci_segment);
        }
        if let Some(slot) = state.slot {
            options.restored_places.insert(
                state.config.id().to_string(),
                RestoredPlace {
                    slot,
                    bar_address: state.transport.pci.bar_address,
                    hot_plugged: state.hot_plugged,
                },
            );
        }
        match &state.config {
            VirtioDeviceConfig::Block(config) => options.drives.push(config.clone()),
            VirtioDeviceConfig::Net(config) => options.nets.push(config.clone()),
            VirtioDeviceConfig::Vsock(config) => options.vsock = Some(config.clone()),
            VirtioDeviceConfig::Rng(config) => options.rng = Some(config.clone()),
            VirtioDeviceConfig::Balloon(config) => options.balloon = Some(config.clone()),
            VirtioDeviceConfig::VhostUserBlock(config) => {
                options.vhost_user_drives.push(config.clone())
            }
            VirtioDeviceConfig::Fs(config) => options.fs.push(config.clone()),
            VirtioDeviceConfig::VhostUser(config) => options.vhost_user.push(config.clone()),
        }
    }
    options
}

/// Why PATCH /drives/{id} failed.
#[derive(Debug, thiserror::Error)]
pub enum DriveUpdateError {
    #[error("no drive {0:?} in this VM")]
    NoSuchDrive(String),
    #[error("drive {id}: {source}")]
    Block {
        id: String,
        source: gpuvm_virtio::block::BlockError,
    },
}

/// Swaps the image under the running drive `id` and/or changes its rate limit. The new
/// image is opened and checked before anything changes; the guest is told the new size.
pub fn update_drive(
    handles: &[VirtioHandle],
    id: &str,
    path: Option<std::path::PathBuf>,
    rate_limiter: Option<gpuvm_virtio::rate_limiter::RateLimiterConfig>,
) -> Result<(), DriveUpdateError> {
    let handle = handles
        .iter()
        .find(|h| matches!(&h.config, VirtioDeviceConfig::Block(c) if c.drive_id == id))
        .ok_or_else(|| DriveUpdateError::NoSuchDrive(id.to_string()))?;
    let block_error = |source| DriveUpdateError::Block {
        id: id.to_string(),
        source,
    };
    handle
        .with_device(|block: &mut Block| {
            if let Some(path) = path {
                block.update_backing(path).map_err(block_error)?;
            }
            if let Some(config) = rate_limiter {
                block.update_rate_limiter(config).map_err(block_error)?;
            }
            Ok(())
        })
        .ok_or_else(|| DriveUpdateError::NoSuchDrive(id.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_net_without_a_tap_name_is_snapshotted_and_needs_taps_to_come_back() {
        let passed = VirtioDeviceConfig::Net(NetConfig::new("net0", None));
        assert_eq!(passed.snapshot_refusal(), None);
        let Err(error) = open_device(&passed, &DeviceResources::default()) else {
            panic!("a restore without taps for net0 opened it");
        };
        let message = error.to_string();
        assert!(
            message.contains("net0") && message.contains("net_fds"),
            "{message}"
        );
        let named = VirtioDeviceConfig::Net(NetConfig::new("net0", Some("tap0")));
        assert_eq!(named.snapshot_refusal(), None);
    }

    #[test]
    fn passed_taps_are_taken_once_and_shared_by_clones() {
        let taps = DeviceResources::default();
        let clone = taps.clone();
        taps.insert("net0", Vec::new());
        assert_eq!(clone.ids(), ["net0"]);
        assert_eq!(taps, clone);
        assert!(clone.take("net0").is_some());
        assert!(taps.take("net0").is_none());
        assert_eq!(taps, DeviceResources::default());
    }

    /// A live update's images and taps: each taken once, by its own id; what no device
    /// took is closed and named.
    #[test]
    fn handed_over_images_are_taken_once_and_the_unused_named() {
        let resources = DeviceResources::default();
        let built_from = resources.with_mmds(&Arc::new(gpuvm_mmds::Mmds::default()));
        resources.insert_image("disk0", std::fs::File::open("/dev/null").unwrap());
        resources.insert_image("disk1", std::fs::File::open("/dev/null").unwrap());
        resources.insert("net0", Vec::new());
        assert!(built_from.take_image("disk9").is_none());
        assert!(built_from.take_image("disk0").is_some());
        assert!(resources.take_image("disk0").is_none());
        assert_eq!(resources.forget_unused(), ["disk1", "net0"]);
        assert!(resources.take_image("disk1").is_none());
        assert!(resources.ids().is_empty());
    }
}
