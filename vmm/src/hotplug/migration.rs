//! Hot-plugged passthrough devices in snapshots, through VFIO migration v2
//! (docs/gpu-snapshots.md).
//!
//! Saving, with the vCPUs and virtio devices already paused and before guest memory is
//! written: each device is stopped (so it writes no more RAM) and its migration data is
//! streamed into a file of its own in the snapshot directory, `device-<stamp>`, framed
//! as the state file is (gpuvm's magic, a version, CRC32, length). The state records
//! each device ([`MigratedGpu`]): its id, where it came from, its slot and model, the PCI
//! state gpuvm emulates for it (BARs, MSI-X), and its file. The devices run again once
//! the snapshot is written.
//!
//! Restoring, before any vCPU runs: each device is opened again from where it came from
//! (the vfio-user socket, with a fresh device process behind it, or the host BDF),
//! checked to be the same model, plugged into its old slot with its BARs where the guest
//! had put them, given its saved state and its emulated PCI state (MSI-X routes), made a
//! peer of the other passthrough devices again (crate::p2p: their BARs mapped for it, its
//! BARs for them), and left stopped. Guest RAM is DMA-mapped for it once the restore has filled that RAM
//! (with a lazy restore, once the loader is done: a device writing a page the loader
//! fills afterwards would lose its write), and only then does the device run. The guest
//! runs meanwhile; its requests to the device wait in the device.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use gpuvm_vfio::dma::ChunkReady;
use gpuvm_vfio::migration::MigrationState;
use gpuvm_vfio::pci::{VfioPciDevice, VfioPciState};
use serde::{Deserialize, Serialize};

use super::{HotDevice, PciHotplug};
use crate::action::GpuBody;
use crate::lock;
use crate::snapshot::SnapshotError;

/// Names of device-state files: this prefix and a decimal stamp.
pub const DEVICE_FILE_PREFIX: &str = "device-";
/// The device-state file's version field: not the state file's, so that neither is ever
/// read as the other.
const DEVICE_FILE_VERSION: u32 = 0x4456_0001;
const HEADER_LEN: usize = 24;
/// The most a device may give as its state (a GPU's memory is tens of GiB).
const MAX_DEVICE_STATE: u64 = 1 << 40;
/// How long a restored device waits for guest RAM to be DMA-mapped before it runs.
const RESUME_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A hot-plugged passthrough device whose internal state a snapshot holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigratedGpu {
    pub gpu_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_bdf: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfio_user_socket: Option<PathBuf>,
    /// The PCI segment it is on (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub segment: u16,
    /// Its slot on bus 0, or on its root port's secondary bus.
    pub slot: u8,
    /// The bus-0 slot of the root port for hot-plug it is in (absent: on bus 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u8>,
    /// Its path from bus 0 behind the ports of a host-mirroring layout (crate::pci_topology:
    /// root port, switch ports, then its own device number), where it was cold-plugged;
    /// empty otherwise (`slot` and `port` say where it is).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub path: Vec<u8>,
    pub vendor_id: u16,
    pub device_id: u16,
    /// The PCI state gpuvm emulates for it.
    pub pci: VfioPciState,
    /// The file in the snapshot directory with its migration data, and that data's size.
    pub state_file: String,
    pub state_bytes: u64,
}

fn is_zero(segment: &u16) -> bool {
    *segment == 0
}

impl MigratedGpu {
    fn source(&self) -> GpuBody {
        let mut body = GpuBody::new(
            self.gpu_id.clone(),
            self.host_bdf.clone(),
            self.vfio_user_socket.clone(),
        );
        body.pci_segment = (self.segment != 0).then_some(self.segment);
        body
    }
}

/// Whether `name` is one gpuvm gives device-state files.
pub(crate) fn is_device_file_name(name: &[u8]) -> bool {
    name.strip_prefix(DEVICE_FILE_PREFIX.as_bytes())
        .is_some_and(|stamp| !stamp.is_empty() && stamp.iter().all(u8::is_ascii_digit))
}

/// Why writing a device-state file failed.
#[derive(Debug, thiserror::Error)]
enum DeviceFileError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Device(#[from] gpuvm_vfio::VfioError),
}

/// Counts and checksums what goes through it.
struct CrcWriter<W> {
    inner: W,
    hasher: crc32fast::Hasher,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(data)?;
        self.hasher.update(&data[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn header(crc: u32, len: u64) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header[..8].copy_from_slice(crate::persist::STATE_MAGIC);
    header[8..12].copy_from_slice(&DEVICE_FILE_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&crc.to_le_bytes());
    header[16..].copy_from_slice(&len.to_le_bytes());
    header
}

/// Stops `device` and writes its state into a new file in `dir`; returns the file's
/// name and the state's size. The device is left stopped, even on error.
fn write_device_file(dir: &Path, device: &mut VfioPciDevice) -> Result<(String, u64), String> {
    let name = crate::snapshot::fresh_file_name(dir, DEVICE_FILE_PREFIX);
    let path = dir.join(&name);
    let written = gpuvm_memory::snapshot::write_atomically(&path, |file| {
        file.write_all(&[0u8; HEADER_LEN])?;
        let mut out = CrcWriter {
            // A second handle on the file (same offset): the header is rewritten
            // through the first once the length and CRC are known.
            inner: std::io::BufWriter::with_capacity(1 << 20, file.try_clone()?),
            hasher: crc32fast::Hasher::new(),
        };
        let len = device.save_device_state(&mut out, MAX_DEVICE_STATE)?;
        out.flush()?;
        let CrcWriter { inner, hasher } = out;
        inner.into_inner().map_err(|e| e.into_error())?;
        let crc = hasher.finalize();
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&header(crc, len))?;
        Ok::<u64, DeviceFileError>(len)
    });
    written
        .map(|len| (name, len))
        .map_err(|e| format!("cannot save its state: {e}"))
}

/// Checks, before anything touches KVM, that the device-state file `gpu` names is a
/// regular file inside the snapshot directory `dir` (no link) of the size the state
/// records; its content is checked when it is loaded.
pub(crate) fn check_device_file(dir: &Path, gpu: &MigratedGpu) -> Result<(), String> {
    let path = dir.join(&gpu.state_file);
    let expected = gpu.state_bytes.saturating_add(HEADER_LEN as u64);
    let (_, size) = gpuvm_memory::snapshot::open_in_dir(dir, &gpu.state_file, expected)
        .map_err(|e| format!("device state file {}: {e}", path.display()))?;
    if size != expected {
        return Err(format!(
            "device state file {} is {size} bytes; the snapshot's state says {expected}",
            path.display()
        ));
    }
    Ok(())
}

/// Checks the device-state file `name` of the snapshot directory `dir` (opened the one
/// way a snapshot's files are: inside `dir`, no link; then size, framing, CRC) and loads
/// it into `device`, which is left stopped.
fn load_device_file(
    dir: &Path,
    name: &str,
    len: u64,
    device: &mut VfioPciDevice,
) -> Result<(), String> {
    let path = dir.join(name);
    let shown = path.display();
    let (mut file, size) =
        gpuvm_memory::snapshot::open_in_dir(dir, name, MAX_DEVICE_STATE + HEADER_LEN as u64)
            .map_err(|e| format!("device state file {shown}: {e}"))?;
    if size != HEADER_LEN as u64 + len {
        return Err(format!(
            "device state file {shown} is {size} bytes; the snapshot's state says {}",
            HEADER_LEN as u64 + len
        ));
    }
    let mut found = [0u8; HEADER_LEN];
    file.read_exact(&mut found)
        .map_err(|e| format!("device state file {shown}: {e}"))?;
    let crc = u32::from_le_bytes([found[12], found[13], found[14], found[15]]);
    if found != header(crc, len) {
        return Err(format!(
            "device state file {shown} is not a gpuvm device state of {len} bytes"
        ));
    }
    // The whole file is checked before the device sees a byte of it.
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let want = buffer
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        file.read_exact(&mut buffer[..want])
            .map_err(|e| format!("device state file {shown}: {e}"))?;
        hasher.update(&buffer[..want]);
        left -= want as u64;
    }
    if hasher.finalize() != crc {
        return Err(format!(
            "device state file {shown} is damaged (its CRC does not match)"
        ));
    }
    file.seek(SeekFrom::Start(HEADER_LEN as u64))
        .map_err(|e| format!("device state file {shown}: {e}"))?;
    let mut data = std::io::BufReader::with_capacity(1 << 20, file.take(len));
    device
        .load_device_state(&mut data, len)
        .map_err(|e| format!("the device refused its saved state: {e}"))
}

/// Stops a cold-plugged vfio-user device that sits behind the ports of a host-mirroring
/// layout (`path` from bus 0, at `bdf`; crate::pci_topology) and writes its state into a
/// new file in `dir`, as [`PciHotplug::save_migrated`] does for a hot-plugged one; a
/// restore plugs it back at `path` (it is then a device of the hot-plug manager's, under
/// `id`). The device is left stopped, even on error.
pub(crate) fn save_behind_ports(
    dir: &Path,
    id: String,
    socket: &Path,
    (bdf, path): (gpuvm_devices::pci::PciBdf, Vec<u8>),
    device: &std::sync::Mutex<VfioPciDevice>,
) -> Result<MigratedGpu, SnapshotError> {
    let mut device = lock(device);
    let failed = |reason: String| SnapshotError::PassthroughState {
        id: id.clone(),
        reason,
    };
    let pci = gpuvm_devices::Persist::save(&*device).map_err(|e| failed(e.to_string()))?;
    let (state_file, state_bytes) = write_device_file(dir, &mut device).map_err(failed)?;
    let (vendor_id, device_id) = device.pci_ids();
    log::info!("snapshot: {id} at {bdf} saved its state ({state_bytes} bytes, {state_file})");
    Ok(MigratedGpu {
        gpu_id: id,
        host_bdf: None,
        vfio_user_socket: Some(socket.to_path_buf()),
        segment: bdf.segment,
        slot: bdf.device,
        port: None,
        path,
        vendor_id,
        device_id,
        pci,
        state_file,
        state_bytes,
    })
}

/// Removes the device-state files `saved` names (a snapshot that failed).
pub(crate) fn remove_device_files(dir: &Path, saved: &[MigratedGpu]) {
    for gpu in saved {
        gpuvm_memory::snapshot::remove_logged(
            &dir.join(&gpu.state_file),
            "device state of a failed snapshot",
        );
    }
}

impl PciHotplug {
    /// Why each hot-plugged device cannot be saved into a snapshot now, one line each
    /// (empty when every one can).
    pub fn migration_refusals(&mut self) -> Vec<String> {
        let mut refusals = Vec::new();
        for (id, hot) in &self.devices {
            let reason = if hot.gone.is_some() {
                Some("its device process is gone".to_string())
            } else if hot.ejecting {
                Some("it is being hot-unplugged".to_string())
            } else if hot.held_for_dma.load(Ordering::Acquire) {
                Some(
                    "it was restored and waits for guest RAM to be DMA-mapped before it runs; \
                     retry once it runs"
                        .to_string(),
                )
            } else {
                match lock(&hot.device).migration() {
                    None => Some(
                        "it offers no VFIO migration (no VFIO_DEVICE_FEATURE_MIGRATION from its \
                         kernel driver, or no migration region on the vfio-user device)"
                            .to_string(),
                    ),
                    Some(info) if !info.stop_copy => {
                        Some("its VFIO migration has no STOP_COPY".to_string())
                    }
                    Some(_) => None,
                }
            };
            if let Some(reason) = reason {
                refusals.push(format!("{id} ({}): {reason}", hot.label));
            }
        }
        refusals
    }

    /// Stops every hot-plugged device and writes its state into `dir`. On error the
    /// files written so far are removed; the devices stay stopped until
    /// [`PciHotplug::resume_migrated`] either way.
    pub fn save_migrated(&mut self, dir: &Path) -> Result<Vec<MigratedGpu>, SnapshotError> {
        let mut saved = Vec::new();
        let port_slots: std::collections::BTreeMap<String, u8> = (self.port_of.iter())
            .filter_map(|(id, &i)| Some((id.clone(), self.ports.get(i)?.slot)))
            .collect();
        for (id, hot) in &mut self.devices {
            let mut device = lock(&hot.device);
            hot.stopped = true;
            let pci = match gpuvm_devices::Persist::save(&*device) {
                Ok(pci) => pci,
                Err(error) => {
                    remove_device_files(dir, &saved);
                    return Err(SnapshotError::PassthroughState {
                        id: id.clone(),
                        reason: error.to_string(),
                    });
                }
            };
            let (state_file, state_bytes) = match write_device_file(dir, &mut device) {
                Ok(written) => written,
                Err(reason) => {
                    remove_device_files(dir, &saved);
                    return Err(SnapshotError::PassthroughState {
                        id: id.clone(),
                        reason,
                    });
                }
            };
            let (vendor_id, device_id) = device.pci_ids();
            log::info!("snapshot: {id} saved its state ({state_bytes} bytes, {state_file})");
            saved.push(MigratedGpu {
                gpu_id: id.clone(),
                host_bdf: hot.source.host_bdf.clone(),
                vfio_user_socket: hot.source.vfio_user_socket.clone(),
                segment: hot.bdf.segment,
                slot: hot.bdf.device,
                port: port_slots.get(id).copied(),
                // Restored from behind a host-mirroring layout's ports: it goes back there.
                path: (!port_slots.contains_key(id))
                    .then(|| crate::pci_topology::path_of(&self.root, hot.bdf))
                    .flatten()
                    .unwrap_or_default(),
                vendor_id,
                device_id,
                pci,
                state_file,
                state_bytes,
            });
        }
        Ok(saved)
    }

    /// Runs the devices a snapshot stopped again.
    pub fn resume_migrated(&mut self) {
        for (id, hot) in &mut self.devices {
            if !hot.stopped {
                continue;
            }
            match lock(&hot.device).set_migration_state(MigrationState::Running) {
                Ok(()) => hot.stopped = false,
                Err(error) => log::error!("{id} does not run again after the snapshot: {error}"),
            }
        }
    }

    /// Plugs the devices of a snapshot back (see the module's comment); `ready` says
    /// when restored RAM is filled. Before any vCPU runs; an error fails the restore.
    pub fn restore_migrated(
        &mut self,
        saved: &[MigratedGpu],
        dir: &Path,
        ready: Arc<dyn ChunkReady>,
    ) -> Result<(), SnapshotError> {
        for gpu in saved {
            self.restore_one(gpu, dir, ready.clone())
                .map_err(|reason| SnapshotError::PassthroughState {
                    id: gpu.gpu_id.clone(),
                    reason,
                })?;
        }
        Ok(())
    }

    fn restore_one(
        &mut self,
        gpu: &MigratedGpu,
        dir: &Path,
        ready: Arc<dyn ChunkReady>,
    ) -> Result<(), String> {
        let source = gpu.source();
        if self.devices.contains_key(&gpu.gpu_id) {
            return Err("the snapshot names it twice".into());
        }
        let opened = self
            .open_backend(&source)
            .map_err(|e| format!("cannot open its device again: {e}"))?;
        let port = match gpu.port {
            None => None,
            Some(slot) => Some(
                (self.ports.iter())
                    .position(|port| port.slot == slot)
                    .ok_or_else(|| {
                        format!("the snapshot has no root port for hot-plug in slot {slot:#04x}")
                    })?,
            ),
        };
        if self.root_of(gpu.segment).is_none() {
            return Err(format!(
                "it was on PCI segment {}, which this VM does not have",
                gpu.segment
            ));
        }
        let plug = self.plugger(gpu.segment);
        let progress = self.ram.progress(opened.mapper.name());
        let bars = gpu.pci.bars.as_slice();
        let plugged = match gpu.port {
            // Behind the ports of a host-mirroring layout (restored before it), where the
            // guest had its BARs.
            None if !gpu.path.is_empty() => {
                plug.open_with(opened.backend, &progress, |root, device| {
                    root.add_behind(&gpu.path, device, bars, false)
                })
            }
            None => plug.open_placed(opened.backend, &progress, Some((gpu.slot, bars))),
            // Behind its root port, with its BARs where the guest had them (inside the
            // port's windows); its own restored state says whether they decode.
            Some(port) => plug.open_with(opened.backend, &progress, |root, device| {
                root.add_behind(&[port, gpu.slot], device, bars, false)
            }),
        }
        .map_err(|e| match gpu.port {
            None if !gpu.path.is_empty() => {
                format!(
                    "cannot plug it back at {:?} (path from bus 0): {e}",
                    gpu.path
                )
            }
            None => format!("cannot plug it back into slot {:#04x}: {e}", gpu.slot),
            Some(port) => format!("cannot plug it back behind the root port in {port:#04x}: {e}"),
        })?;
        let loaded = {
            let mut device = lock(&plugged.device);
            let ids = device.pci_ids();
            if ids != (gpu.vendor_id, gpu.device_id) {
                Err(format!(
                    "the device there now is a {:04x}:{:04x}; the snapshot's was a {:04x}:{:04x}",
                    ids.0, ids.1, gpu.vendor_id, gpu.device_id
                ))
            } else {
                load_device_file(dir, &gpu.state_file, gpu.state_bytes, &mut device).and_then(
                    |()| {
                        gpuvm_devices::Persist::restore(&mut *device, &gpu.pci)
                            .map_err(|e| format!("its PCI state does not fit: {e}"))
                    },
                )
            }
        };
        let mapping = loaded.and_then(|()| {
            self.ram
                .start_when_ready(
                    progress.clone(),
                    opened.mapper,
                    self.hooks,
                    crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
                    ready,
                )
                .map_err(|e| format!("cannot DMA-map guest RAM for it: {e}"))
        });
        let mapping = match mapping {
            Ok(mapping) => mapping,
            Err(reason) => {
                self.off_the_bus(port, plugged.bdf);
                self.router.release(&plugged.gsis);
                return Err(reason);
            }
        };
        match port {
            // The port's restored registers show the card present already.
            Some(port) => {
                self.port_of.insert(gpu.gpu_id.clone(), port);
            }
            // Behind a switch port: no slot of the ACPI hot-plug controller's.
            None if !gpu.path.is_empty() => {}
            None => lock(self.controller_of(plugged.bdf)).device_restored(plugged.bdf.device),
        }
        // A peer again, with its BARs where the restored PCI state put them. The restore
        // may run on a thread without the VMM's filter: the p2p-map thread applies it.
        self.join_peers(
            &gpu.gpu_id,
            opened.peer,
            &plugged.device,
            crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm),
        );
        let kernel = self.kernel_context(
            opened.kernel_handle,
            opened.vfio.as_ref(),
            (plugged.bdf, &plugged.device),
            &progress,
        );
        let held_for_dma = Arc::new(AtomicBool::new(true));
        run_once_mapped(
            gpu.gpu_id.clone(),
            Arc::downgrade(&plugged.device),
            progress,
            held_for_dma.clone(),
        );
        log::info!(
            "restore: {} is back at {} with its saved state ({} bytes); it runs once guest \
             RAM is DMA-mapped for it",
            gpu.gpu_id,
            plugged.bdf.full(),
            gpu.state_bytes
        );
        self.devices.insert(
            gpu.gpu_id.clone(),
            HotDevice {
                bdf: plugged.bdf,
                label: plugged.label,
                mapping: Some(mapping),
                health: opened.health,
                _watch: opened.watch,
                gone: None,
                device: plugged.device,
                _vfio: opened.vfio,
                gsis: plugged.gsis,
                ejecting: false,
                source,
                stopped: false,
                held_for_dma,
                connection: opened.connection,
                kernel,
            },
        );
        Ok(())
    }
}

/// Sets a restored device running once guest RAM is DMA-mapped for it, on a thread of
/// its own (under the VMM's filter): the VMM thread and the guest go on meanwhile.
fn run_once_mapped(
    id: String,
    device: Weak<std::sync::Mutex<VfioPciDevice>>,
    progress: Arc<gpuvm_vfio::dma::DmaProgress>,
    held_for_dma: Arc<AtomicBool>,
) {
    let hook = crate::seccomp::thread_hook(crate::seccomp::ThreadKind::Vmm);
    let spawned = std::thread::Builder::new()
        .name("gpu-resume".into())
        .spawn(move || {
            if let Some(Err(error)) = hook.map(|apply| apply()) {
                log::error!("{id}: cannot confine the resume thread: {error}; it stays stopped");
                return;
            }
            if let Err(error) = progress.wait(RESUME_WAIT) {
                log::error!("{id} stays stopped: guest RAM was not DMA-mapped for it ({error})");
                return;
            }
            let Some(device) = device.upgrade() else {
                return;
            };
            let resumed = lock(&device).set_migration_state(MigrationState::Running);
            match resumed {
                Ok(()) => {
                    held_for_dma.store(false, Ordering::Release);
                    log::info!("{id}: guest RAM is DMA-mapped; the restored device runs");
                }
                Err(error) => log::error!("{id} does not run after its restore: {error}"),
            }
        });
    if let Err(error) = spawned {
        log::error!("cannot start the thread that runs a restored device: {error}");
    }
}
