//! Snapshots of the running machine: pausing its vCPUs, completing lazily restored
//! memory, saving every component and the dirty pages, and resuming. How the files are
//! laid out and committed in the snapshot directory is [`crate::snapshot`]'s business.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpuvm_devices::Persist;
use gpuvm_memory::snapshot::{
    background_unsupported, RamMappings, WriteProtectedRam, WriteStats, MAX_BACKGROUND_PAGE_SIZE,
};

use super::{AfterSnapshot, GuestEnd, LazyMemory, Machine};
use crate::snapshot::{
    self, snapshot_pause, MachineState, MemoryChain, SavedMachineConfig, SnapshotError,
    SnapshotPause, SnapshotReport,
};
use crate::vcpu::{self, VcpuHandle};
use crate::vm_state::InKernelDevices;
use crate::Error;

/// Every component's state, saved with vCPUs and devices paused.
struct SavedComponents {
    vcpus: Vec<crate::vcpu::VcpuState>,
    vm: crate::vm_state::VmState,
    devices: crate::devices::DeviceStates,
}

/// How long a snapshot waits for lazily restored guest memory that is not loading (see
/// [`Machine::complete_lazy_memory`]).
pub(super) const SNAPSHOT_MEMORY_STALL: Duration = Duration::from_secs(10);

impl Machine {
    /// Makes every page of guest RAM present in the memfd before a snapshot scans it:
    /// pages a lazy restore has not loaded yet are holes, which the writer would record
    /// as zero. Bounded: whoever serves the pages (the external handler, or the loader's
    /// reads) may stop answering, and this thread must not wait on it forever; after
    /// [`SNAPSHOT_MEMORY_STALL`] without progress the snapshot fails, and the VM stays as
    /// it is.
    fn complete_lazy_memory(&self) -> Result<(), Error> {
        let waited = match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => {
                lazy.wait_progressing(SNAPSHOT_MEMORY_STALL).map(drop)
            }
            // The handler loads pages only on fault: they are faulted in, with system
            // calls, so that a handler dying meanwhile (guest RAM is then fenced) is an
            // error, not a SIGSEGV or a hang.
            Some(LazyMemory::External(watch)) => watch.fault_in(SNAPSHOT_MEMORY_STALL),
            None => Ok(()),
        };
        waited.map_err(|e| Error::Snapshot(SnapshotError::Uffd(e)))
    }

    /// Takes the snapshot the policy asked for; returns the run's outcome if it ends here.
    /// A snapshot that fails does not end a run that was to resume after it (a signal or
    /// timer asked for it; the guest did nothing wrong): it is logged and the VM runs on,
    /// unless guest memory can no longer be served (a failed lazy restore). A run that was
    /// to end with the snapshot (`--snapshot-then exit`) ends with the error instead of a
    /// success status: its caller would otherwise take a missing snapshot for a written one.
    pub(super) fn snapshot_requested(
        &mut self,
        handles: &[VcpuHandle],
    ) -> Option<Result<GuestEnd, Error>> {
        let policy = self.snapshot_policy.clone()?;
        let keep_running = policy.then == AfterSnapshot::Resume;
        // A VM the API paused stays paused after a timer or SIGUSR1 snapshot.
        let resume = keep_running && !self.paused;
        match self.take_snapshot(handles, &policy.dir, false, resume) {
            Ok(report) => {
                log::info!("snapshot written to {}: {report:?}", policy.dir.display());
                (!keep_running).then_some(Ok(GuestEnd::Snapshotted))
            }
            Err(error) if !keep_running || self.lazy_progress().is_err() => Some(Err(error)),
            Err(error) => {
                log::error!(
                    "snapshot into {} failed; the VM keeps running and the previous snapshot \
                     there is kept: {error}",
                    policy.dir.display()
                );
                None
            }
        }
    }

    /// Whether this machine's state can be saved: passthrough devices only if each was
    /// hot-plugged and can save its own state (VFIO migration); not with vhost-user
    /// devices, whose state lives in their backends.
    pub fn check_snapshottable(&mut self) -> Result<(), Error> {
        if let Some(reason) = self
            .devices
            .virtio
            .iter()
            .find_map(|handle| handle.config.snapshot_refusal())
        {
            return Err(SnapshotError::Unsnapshottable(reason).into());
        }
        let hot: Vec<String> = self
            .devices
            .pci_hotplug
            .iter()
            .flat_map(|hotplug| hotplug.labels())
            .collect();
        // Cold-plugged vfio-user devices behind the ports of a host-mirroring layout are
        // saved through VFIO migration as hot-plugged ones are; other cold ones are not.
        let behind_ports = self.behind_ports();
        let cold: Vec<String> = self
            .devices
            .passthrough
            .iter()
            .filter(|label| !hot.contains(label))
            .filter(|label| {
                !(behind_ports.iter())
                    .any(|(plugged, _)| label.starts_with(&format!("{} ", plugged.bdf.shown())))
            })
            .cloned()
            .collect();
        if !cold.is_empty() {
            return Err(SnapshotError::Passthrough { devices: cold }.into());
        }
        let mut refusals: Vec<String> = (behind_ports.iter())
            .filter_map(|(plugged, _)| {
                let info = crate::lock(&plugged.device).migration();
                let reason = match info {
                    None => {
                        "it offers no VFIO migration (no migration region on the vfio-user device)"
                    }
                    Some(info) if !info.stop_copy => "its VFIO migration has no STOP_COPY",
                    Some(_) => return None,
                };
                Some(format!(
                    "{} ({}): {reason}",
                    behind_ports_id(plugged),
                    plugged.socket.display()
                ))
            })
            .collect();
        refusals.extend(
            self.devices
                .pci_hotplug
                .as_mut()
                .map(|hotplug| hotplug.migration_refusals())
                .unwrap_or_default(),
        );
        if refusals.is_empty() {
            Ok(())
        } else {
            Err(SnapshotError::PassthroughNotMigratable { refusals }.into())
        }
    }

    /// Pauses every vCPU, saves every component and guest memory into `dir` (a full memory
    /// file when `full`, else a diff when dirty pages are tracked and the chain is in
    /// `dir`), and resumes if `resume`.
    ///
    /// A full memory file of a VM that resumes is written in the background where the
    /// host allows it ([`SnapshotPause::Short`]): the vCPUs are paused only while state is
    /// saved and guest RAM is write-protected, and the guest runs while RAM is written as
    /// it was at the pause (see `gpuvm_memory::snapshot::WriteProtectedRam`). This call
    /// returns when the snapshot is committed either way.
    ///
    /// A snapshot that fails changes nothing: the previous snapshot in `dir` stays intact
    /// with nothing added (see [`snapshot`]), no dirty page is forgotten, and vCPUs that
    /// were running run again. A directory another process is using, or whose `state`
    /// gpuvm did not write, is refused before any vCPU is paused.
    pub fn take_snapshot(
        &mut self,
        handles: &[VcpuHandle],
        dir: &std::path::Path,
        full: bool,
        resume: bool,
    ) -> Result<SnapshotReport, Error> {
        self.check_snapshottable()?;
        let dir_lock = snapshot::prepare_dir(dir)?;
        let was_running = !self.paused;
        let protected = if resume && was_running {
            self.protect_for_background(dir, full)?
        } else {
            None
        };
        let paused_at = Instant::now();
        let mut resumed_at = None;
        let written =
            self.write_snapshot(handles, dir, &dir_lock, full, protected, &mut resumed_at);
        drop(dir_lock);
        if resumed_at.is_none() && (resume || (written.is_err() && was_running)) {
            if let Err(error) = vcpu::resume_all(handles) {
                log::error!("cannot resume the vCPUs after a snapshot: {error}");
            }
        }
        let pause_to_resume = resumed_at.unwrap_or_else(Instant::now) - paused_at;
        let (memory_file, stats, memory_time) = written?;
        let report = SnapshotReport {
            dir: dir.to_path_buf(),
            memory_file,
            diff: stats.info.is_diff(),
            memory_bytes_written: stats.file_len,
            data_pages: stats.data_pages,
            zero_pages: stats.zero_pages,
            pause_to_resume,
            memory_time,
        };
        self.snapshots.push(report.clone());
        Ok(report)
    }

    /// Guest RAM write-protected for a background snapshot into `dir`, armed while the
    /// guest runs; `None` (the memory is then written paused) when the snapshot is to
    /// pause fully, the host cannot, or it would not help or not be consistent. Fails, with
    /// nothing paused, when lazily restored memory cannot be completed: the snapshot could
    /// not read it paused either.
    fn protect_for_background(
        &mut self,
        dir: &std::path::Path,
        full: bool,
    ) -> Result<Option<WriteProtectedRam>, Error> {
        if snapshot_pause() == SnapshotPause::Full {
            return Ok(None);
        }
        if let Some(reason) = background_unsupported() {
            static LOGGED: AtomicBool = AtomicBool::new(false);
            if !LOGGED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "snapshots keep the vCPUs paused while memory is written: this host \
                     cannot write-protect guest RAM ({reason})"
                );
            }
            return Ok(None);
        }
        // Passthrough devices write guest RAM by DMA, which write protection does not see.
        if !self.devices.passthrough.is_empty() {
            log::info!("snapshot memory written paused: the VM has passthrough devices");
            return Ok(None);
        }
        // A diff holds the pages dirtied since the last snapshot: small, written paused.
        let diff = !full
            && self.devices.virtio.is_empty()
            && self.config.track_dirty_pages
            && self
                .memory_chain
                .as_ref()
                .is_some_and(|chain| chain.dir == dir);
        if diff || self.ram.page_size() > MAX_BACKGROUND_PAGE_SIZE {
            return Ok(None);
        }
        if self.lazy.is_some() {
            self.complete_lazy_memory()?;
        }
        let armed = self.ram_mappings().and_then(|mappings| {
            WriteProtectedRam::arm(
                &mappings,
                crate::seccomp::thread_hook(crate::seccomp::ThreadKind::SnapshotFault),
            )
        });
        Ok(match armed {
            Ok(protected) => Some(protected),
            Err(error) => {
                log::warn!("snapshot memory written with the vCPUs paused: {error}");
                None
            }
        })
    }

    /// The part of [`Machine::take_snapshot`] that pauses the vCPUs and writes, under
    /// `dir_lock`: the new memory file's name, its figures and the time memory took. With
    /// `protected`, the vCPUs are resumed (and `resumed_at` set) before memory is written.
    fn write_snapshot(
        &mut self,
        handles: &[VcpuHandle],
        dir: &std::path::Path,
        dir_lock: &snapshot::SnapshotDirLock,
        full: bool,
        protected: Option<WriteProtectedRam>,
        resumed_at: &mut Option<Instant>,
    ) -> Result<(String, gpuvm_memory::snapshot::WriteStats, Duration), Error> {
        vcpu::pause_all(handles)?;
        // Devices stop after the request in flight: nothing writes guest memory or
        // changes a queue until the snapshot is written (or, in the background, until
        // guest RAM is write-protected).
        crate::virtio::pause_all(&self.devices.virtio);
        let saved = self.save_components(handles, dir, dir_lock);
        let Some(protected) = protected else {
            let written = saved.and_then(|saved| {
                let dirty = self.dirty_bitmaps()?;
                // KVM's dirty log sees only what vCPUs write: virtio devices write guest
                // memory from gpuvm's threads, so a VM with them always gets a full file;
                // so does one whose hot-plugged RAM changed since the chain's last file
                // (its layout is not the chain's).
                let chain = if full
                    || !self.devices.virtio.is_empty()
                    || !self.hotplug_layout_is_the_chains()
                {
                    None
                } else {
                    self.memory_chain.clone()
                };
                self.write_memory_and_commit(dir, saved, dirty, |mappings, dirty| {
                    snapshot::write_memory(dir, mappings, chain.as_ref(), dirty)
                })
            });
            self.resume_devices();
            return written;
        };
        // The snapshot instant: the dirty log restarts and RAM is frozen here.
        let frozen = saved.and_then(|saved| {
            let dirty = self.dirty_bitmaps()?;
            match protected.freeze() {
                Ok(_) => Ok((saved, dirty)),
                Err(error) => {
                    self.unsaved_dirty = dirty;
                    Err(SnapshotError::from(error).into())
                }
            }
        });
        self.resume_devices();
        let (saved, dirty) = match frozen {
            Ok(frozen) => frozen,
            Err(error) => {
                // Protection is lifted before the caller resumes the vCPUs.
                drop(protected);
                return Err(error);
            }
        };
        if let Err(error) = vcpu::resume_all(handles) {
            log::error!("cannot resume the vCPUs after a snapshot: {error}");
        }
        *resumed_at = Some(Instant::now());
        self.write_memory_and_commit(dir, saved, dirty, move |mappings, _| {
            snapshot::write_memory_background(dir, mappings, protected)
        })
    }

    /// The cold-plugged vfio-user devices behind the ports of a host-mirroring layout
    /// (crate::pci_topology), each with its path from bus 0.
    fn behind_ports(&self) -> Vec<(&crate::update::handed_over::PluggedVfioUser, Vec<u8>)> {
        let Some(plug) = &self.devices.handover.plug else {
            return Vec::new();
        };
        (self.devices.handover.vfio_user.iter())
            .filter_map(|plugged| {
                Some((
                    plugged,
                    crate::pci_topology::path_of(&plug.root, plugged.bdf)?,
                ))
            })
            .collect()
    }

    /// Lets the devices paused for a snapshot (or a live update) run again.
    pub(crate) fn resume_devices(&mut self) {
        crate::virtio::resume_all(&self.devices.virtio);
        // The cold-plugged devices a snapshot stopped (running ones stay as they are).
        for (plugged, _) in self.behind_ports() {
            let mut device = crate::lock(&plugged.device);
            if device.migration().is_some() {
                if let Err(error) =
                    device.set_migration_state(gpuvm_vfio::migration::MigrationState::Running)
                {
                    log::error!(
                        "{} does not run again after the snapshot: {error}",
                        behind_ports_id(plugged)
                    );
                }
            }
        }
        if let Some(hotplug) = self.devices.pci_hotplug.as_mut() {
            hotplug.resume_migrated();
        }
    }

    /// KVM's dirty bitmaps if dirty pages are tracked (see [`Machine::take_dirty_bitmaps`]).
    fn dirty_bitmaps(&mut self) -> Result<Option<Vec<Vec<u64>>>, Error> {
        if self.config.track_dirty_pages {
            self.take_dirty_bitmaps().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Saves every component's state, with vCPUs and devices paused.
    fn save_components(
        &mut self,
        handles: &[VcpuHandle],
        dir: &std::path::Path,
        dir_lock: &snapshot::SnapshotDirLock,
    ) -> Result<SavedComponents, Error> {
        self.complete_lazy_memory()?;
        // The working set of the snapshot this machine was restored from, before a snapshot
        // into another directory; one into the same directory replaces that snapshot (and
        // this lock would refuse the write).
        if let Some((target, _)) = &self.working_set_target {
            if dir_lock.is_for(target) {
                log::info!("no working set recorded: this snapshot replaces the one it was for");
                self.working_set_target = None;
            }
        }
        self.save_working_set();
        let mut vcpus = Vec::with_capacity(handles.len());
        for handle in handles {
            vcpus.push(handle.save_state()?);
        }
        let vm = InKernelDevices(&self.vm)
            .save()
            .map_err(SnapshotError::from)?;
        let mut devices = self.devices.save().map_err(SnapshotError::SaveDevices)?;
        devices.ram_hotplug = self
            .save_ram_hotplug()
            .map_err(SnapshotError::SaveDevices)?;
        // Passthrough devices stop (no more DMA into RAM) before RAM is written.
        if let Some(hotplug) = self.devices.pci_hotplug.as_mut() {
            devices.migrated_gpus = hotplug.save_migrated(dir)?;
        }
        for (plugged, path) in self.behind_ports() {
            let saved = crate::hotplug::migration::save_behind_ports(
                dir,
                behind_ports_id(plugged),
                &plugged.socket,
                (plugged.bdf, path),
                &plugged.device,
            );
            match saved {
                Ok(gpu) => devices.migrated_gpus.push(gpu),
                Err(error) => {
                    crate::hotplug::migration::remove_device_files(dir, &devices.migrated_gpus);
                    return Err(error.into());
                }
            }
        }
        Ok(SavedComponents { vcpus, vm, devices })
    }

    /// Writes guest memory with `write_memory` (given the dirty bitmaps taken at the
    /// snapshot instant) and commits the state beside it.
    fn write_memory_and_commit(
        &mut self,
        dir: &std::path::Path,
        saved: SavedComponents,
        dirty: Option<Vec<Vec<u64>>>,
        write_memory: impl FnOnce(
            &RamMappings<'_>,
            Option<&[Vec<u64>]>,
        ) -> Result<(String, WriteStats, Vec<String>), SnapshotError>,
    ) -> Result<(String, WriteStats, Duration), Error> {
        let device_files = saved.devices.migrated_gpus.clone();
        let numa = self.numa.saved();
        let memory_started = Instant::now();
        let written = self
            .ram_mappings()
            .map_err(SnapshotError::from)
            .and_then(|mappings| write_memory(&mappings, dirty.as_deref()))
            .and_then(|(memory_file, stats, files)| {
                let memory_time = memory_started.elapsed();
                let state = MachineState {
                    config: SavedMachineConfig::from_config(&self.config),
                    vm: saved.vm,
                    vcpus: saved.vcpus,
                    devices: saved.devices,
                    memory_files: files,
                    memory_file_id: Some(stats.info.id.to_string()),
                    raw_memory: None,
                    numa,
                };
                snapshot::commit(dir, &state, &memory_file)?;
                Ok((memory_file, stats, memory_time, state.memory_files))
            });
        let (memory_file, stats, memory_time, files) = match written {
            Ok(written) => written,
            Err(error) => {
                // Not saved after all: the next snapshot must still see these pages dirty.
                self.unsaved_dirty = dirty;
                crate::hotplug::migration::remove_device_files(dir, &device_files);
                return Err(error.into());
            }
        };
        self.set_memory_chain(MemoryChain {
            dir: dir.to_path_buf(),
            files,
            last: stats.info.clone(),
        });
        Ok((memory_file, stats, memory_time))
    }

    /// KVM's dirty bitmaps for every RAM region since the last call (which they reset),
    /// with the pages of snapshots that failed since the last one that did not: boot
    /// RAM's regions, then the hot-plugged ones (the memory file's order). A boot region
    /// registered as several slots has its slots' bitmaps joined: every slot but its last
    /// is a whole number of bitmap words long (one bit per 4 KiB page, u64 words, the
    /// lowest bit first), so the words follow each other as the pages do.
    fn take_dirty_bitmaps(&mut self) -> Result<Vec<Vec<u64>>, Error> {
        let regions = self.ram.regions();
        let slot_size = crate::builder::boot_ram_slot_size(regions)?;
        // Each region's (slot, size) list: slots count from 0 in boot RAM's slice order.
        let mut region_slots: Vec<Vec<(u32, u64)>> = vec![Vec::new(); regions.len()];
        for (slot, slice) in (0u32..).zip(gpuvm_memory::slot_slices(regions, slot_size)) {
            region_slots[slice.region].push((slot, slice.size));
        }
        region_slots.extend(self.hotplug_kvm_slots().into_iter().map(|slot| vec![slot]));
        let mut bitmaps = self.unsaved_dirty.take().unwrap_or_default();
        for (index, slots) in region_slots.into_iter().enumerate() {
            let mut fresh = Vec::new();
            for (slot, size) in slots {
                match self.vm.get_dirty_log(slot, size as usize) {
                    Ok(words) => fresh.extend(words),
                    Err(source) => {
                        // What was read so far is cleared in KVM: keep it for the next try.
                        merge_dirty(&mut bitmaps, index, &fresh);
                        self.unsaved_dirty = Some(bitmaps);
                        return Err(Error::Snapshot(SnapshotError::Kvm {
                            what: "read the dirty page log",
                            source,
                        }));
                    }
                }
            }
            merge_dirty(&mut bitmaps, index, &fresh);
        }
        Ok(bitmaps)
    }
}

/// ORs `fresh` into region `index`'s bitmap in `bitmaps`, which grows to hold it (a bitmap
/// kept from a failed read may be a region's first slots only).
fn merge_dirty(bitmaps: &mut Vec<Vec<u64>>, index: usize, fresh: &[u64]) {
    if bitmaps.len() <= index {
        bitmaps.resize_with(index + 1, Vec::new);
    }
    let bitmap = &mut bitmaps[index];
    if bitmap.len() < fresh.len() {
        bitmap.resize(fresh.len(), 0);
    }
    bitmap
        .iter_mut()
        .zip(fresh)
        .for_each(|(word, dirty)| *word |= dirty);
}

/// The id a cold-plugged vfio-user device behind a host-mirroring layout's ports is saved
/// (and restored, as a device of the hot-plug manager's) under: its address at boot.
fn behind_ports_id(plugged: &crate::update::handed_over::PluggedVfioUser) -> String {
    format!("vfio-user-{}", plugged.bdf)
}

#[cfg(test)]
mod tests {
    use super::merge_dirty;

    #[test]
    fn dirty_bitmaps_merge_and_grow_to_the_longest_read() {
        // A failed read kept region 1's first slot only; the next read has both its slots.
        let mut bitmaps = vec![vec![0b01], vec![0b10]];
        merge_dirty(&mut bitmaps, 0, &[0b100]);
        merge_dirty(&mut bitmaps, 1, &[0b01, 0b1000]);
        merge_dirty(&mut bitmaps, 2, &[7]);
        assert_eq!(bitmaps, [vec![0b101], vec![0b11, 0b1000], vec![7]]);
        // A shorter read leaves the rest as it was.
        merge_dirty(&mut bitmaps, 1, &[0b100]);
        assert_eq!(bitmaps[1], [0b111, 0b1000]);
    }
}
