//! Reading a snapshot: the state file, its configuration, and the memory chain it names,
//! all checked before anything touches KVM.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpuvm_memory::snapshot::{
    is_plain_file_name, RamLayout, RawPageCrcs, SnapshotChain, SnapshotId,
};

use super::{MachineState, RawPageCrcsRecord, SnapshotError, MEMORY_FILE_PREFIX, STATE_FILE};
use crate::config::MachineConfig;

/// A snapshot read and validated before anything touches KVM.
pub struct LoadedSnapshot {
    pub dir: PathBuf,
    pub state: MachineState,
    pub config: MachineConfig,
    pub chain: Arc<SnapshotChain>,
}

/// Reads `dir/state`, checks its configuration, and opens and validates the memory
/// chain against the guest layout that configuration implies.
pub fn load(
    dir: &Path,
    regions: impl Fn(u64) -> Vec<gpuvm_memory::RamRegion>,
) -> Result<LoadedSnapshot, SnapshotError> {
    load_state(dir, regions)?.open_chain()
}

/// A snapshot's state file, read and checked, with the memory chain still to open.
pub struct LoadedState {
    pub dir: PathBuf,
    pub state: MachineState,
    pub config: MachineConfig,
    chain: ChainInputs,
}

/// What opening a snapshot's memory chain takes: its files, base first, and the guest
/// RAM layout they must match. Cheap to clone, to validate on another thread.
#[derive(Debug, Clone)]
pub struct ChainInputs {
    /// The snapshot directory, and the files in it, base first (each opened with
    /// `gpuvm_memory::snapshot::open_in_dir`: inside the directory, no link).
    dir: PathBuf,
    names: Vec<String>,
    layout: RamLayout,
    /// The newest file's id as the state records it (see [`MachineState::memory_file_id`]).
    head_id: Option<String>,
    /// The one file is a raw guest-RAM image (see [`MachineState::raw_memory`]), with the
    /// page CRC table the state names for it, if any.
    raw: Option<Option<RawPageCrcsRecord>>,
}

impl ChainInputs {
    /// Opens and validates the chain (headers, index CRCs, lengths, chain ids, layout),
    /// and checks that it is the one the state was written with.
    pub fn validate(&self) -> Result<SnapshotChain, SnapshotError> {
        if let Some(crcs) = &self.raw {
            // A raw image has no id of its own to check (its size is checked); it takes
            // the one its state records.
            let id = self
                .head_id
                .as_deref()
                .and_then(parse_snapshot_id)
                .unwrap_or(SnapshotId::NONE);
            let table = match crcs {
                Some(record) => Some(self.page_crcs(record)?),
                None => None,
            };
            return Ok(SnapshotChain::open_raw_in_dir(
                &self.dir,
                &self.names[0],
                &self.layout,
                id,
                table,
            )?);
        }
        let chain = SnapshotChain::open_in_dir(&self.dir, &self.names, &self.layout)?;
        if let Some(expected) = &self.head_id {
            let found = chain.head().id.to_string();
            if found != *expected {
                return Err(SnapshotError::ForeignMemoryFile {
                    path: chain.layers()[chain.layers().len() - 1]
                        .path()
                        .to_path_buf(),
                    expected: expected.clone(),
                    found,
                });
            }
        }
        Ok(chain)
    }
}

impl ChainInputs {
    /// The raw image's page CRC table `record` names, read and checked to be the one the
    /// state was written with.
    fn page_crcs(&self, record: &RawPageCrcsRecord) -> Result<RawPageCrcs, SnapshotError> {
        let table = RawPageCrcs::read_in_dir(&self.dir, &record.file, &self.layout)?;
        let found = table.digest();
        if found != record.crc {
            return Err(SnapshotError::ForeignPageCrcs {
                path: self.dir.join(&record.file),
                expected: record.crc,
                found,
            });
        }
        Ok(table)
    }
}

/// A snapshot id as its `Display` writes it (32 hex digits).
fn parse_snapshot_id(text: &str) -> Option<SnapshotId> {
    if text.len() != 32 || !text.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(SnapshotId(bytes))
}

impl LoadedState {
    /// Opens and validates the memory chain the state names (headers, index CRCs,
    /// lengths, chain ids, layout).
    pub fn open_chain(self) -> Result<LoadedSnapshot, SnapshotError> {
        let chain = self.validate_chain()?;
        Ok(self.with_chain(chain))
    }

    /// The chain validation alone (for running it on another thread).
    pub fn validate_chain(&self) -> Result<SnapshotChain, SnapshotError> {
        self.chain.validate()
    }

    /// What [`LoadedState::validate_chain`] works on, to validate on another thread
    /// without sharing the state.
    pub fn chain_inputs(&self) -> ChainInputs {
        self.chain.clone()
    }

    /// Joins the state with its validated chain.
    pub fn with_chain(self, chain: SnapshotChain) -> LoadedSnapshot {
        LoadedSnapshot {
            dir: self.dir,
            state: self.state,
            config: self.config,
            chain: Arc::new(chain),
        }
    }
}

/// Reads and checks `dir/state` and its configuration (the first half of [`load`]).
pub fn load_state(
    dir: &Path,
    regions: impl Fn(u64) -> Vec<gpuvm_memory::RamRegion>,
) -> Result<LoadedState, SnapshotError> {
    let invalid = |reason: String| SnapshotError::Invalid {
        dir: dir.to_path_buf(),
        reason,
    };
    if !dir.is_dir() {
        return Err(invalid("no such snapshot directory".into()));
    }
    let state: MachineState = crate::persist::read_state_file(&dir.join(STATE_FILE))?;
    let config = state.config.to_config(dir)?;
    if state.vcpus.len() != usize::from(config.vcpus) || config.vcpus == 0 {
        return Err(invalid(format!(
            "state has {} vCPU states for {} configured vCPUs",
            state.vcpus.len(),
            config.vcpus
        )));
    }
    if state
        .vcpus
        .iter()
        .enumerate()
        .any(|(i, v)| usize::from(v.id) != i)
    {
        return Err(invalid("vCPU states are not in id order".into()));
    }
    if state.memory_files.is_empty() {
        return Err(invalid("the state names no memory file".into()));
    }
    // Every file the state names is a plain name in this directory (opened later with
    // `open_in_dir`, which also refuses links): refused here, before anything is opened.
    if state
        .memory_files
        .iter()
        .any(|f| !f.starts_with(MEMORY_FILE_PREFIX) || !is_plain_file_name(f))
    {
        return Err(invalid(
            "the state names a memory file outside the snapshot directory".into(),
        ));
    }
    for gpu in &state.devices.migrated_gpus {
        if !is_plain_file_name(&gpu.state_file) {
            return Err(invalid(format!(
                "the state names a device state file outside the snapshot directory for {}: {:?}",
                gpu.gpu_id, gpu.state_file
            )));
        }
        crate::hotplug::migration::check_device_file(dir, gpu).map_err(invalid)?;
    }
    // The PCIe ports against each other and the segment's windows, before any is built.
    crate::pci_topology::check_saved_state(&state.devices).map_err(|e| invalid(e.to_string()))?;
    if let Some(record) = state.raw_memory.as_ref().and_then(|r| r.page_crcs.as_ref()) {
        if !is_plain_file_name(&record.file) {
            return Err(invalid(format!(
                "the state names a page CRC table outside the snapshot directory: {:?}",
                record.file
            )));
        }
    }
    if state.memory_file_id.is_none() {
        log::warn!(
            "{}: the state file records no memory-file id (written by an older gpuvm), so its \
             memory files cannot be checked to be this snapshot's",
            dir.join(STATE_FILE).display()
        );
    }
    let mut ram_regions = regions(config.memory_size);
    // RAM hot-plugged before the snapshot follows boot RAM in the memory file, in address
    // order (the file is checked by each region's address and size; its memfd offset here
    // only has to be page aligned: the restored RAM's own offsets are used to load it).
    if let Some(hotplug) = &state.devices.ram_hotplug {
        let mut plugged: Vec<_> = hotplug
            .block
            .slots
            .iter()
            .filter(|slot| slot.size != 0)
            .map(|slot| gpuvm_memory::RamRegion {
                guest_addr: slot.base,
                size: slot.size,
                file_offset: slot.base,
            })
            .collect();
        plugged.sort_by_key(|region| region.guest_addr);
        ram_regions.extend(plugged);
    }
    let layout = RamLayout::new(config.backing.page_size(), ram_regions)?;
    let (names, head_id, raw) = match &state.raw_memory {
        // Firecracker's layout: the newest memory file is the whole of guest RAM.
        Some(raw) => {
            if raw.size != layout.ram_size() {
                return Err(invalid(format!(
                    "the state records a raw memory image of {} bytes for {} bytes of guest RAM",
                    raw.size,
                    layout.ram_size()
                )));
            }
            let newest = &state.memory_files[state.memory_files.len() - 1];
            if raw.page_crcs.is_none() {
                log::warn!(
                    "{}: the state names no page CRC table for its raw memory image {newest} \
                     (an image gpuvm did not write, or a state written before gpuvm kept \
                     one): its pages load unchecked",
                    dir.join(STATE_FILE).display()
                );
            }
            (
                vec![newest.clone()],
                state.memory_file_id.clone(),
                Some(raw.page_crcs.clone()),
            )
        }
        None => (
            state.memory_files.clone(),
            state.memory_file_id.clone(),
            None,
        ),
    };
    Ok(LoadedState {
        dir: dir.to_path_buf(),
        state,
        config,
        chain: ChainInputs {
            dir: dir.to_path_buf(),
            names,
            layout,
            head_id,
            raw,
        },
    })
}
