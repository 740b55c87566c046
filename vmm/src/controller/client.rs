//! Clients that configure a VM as one document (Cloud Hypervisor's API): whether the VM
//! was created, the devices by the ids the client knows them by, ids made up for
//! devices given without one, and the choice between configuring a device (before
//! boot) and hot-plugging it (after). The front end only translates and formats; what a
//! request means, and whether it is allowed now, is decided here in one step.

use crate::action::{
    ActionError, AddDevice, ClientDevice, ClientRecord, PciSegmentsBody, VmmAction,
};

/// What the VM's clients configured as documents: whether a client created the VM as
/// one (CreateVm, or a restore), and the record of what they gave.
#[derive(Debug, Default)]
pub(super) struct ClientState {
    created: bool,
    record: ClientRecord,
    /// Counts the changes to `created` and `record`: the running machine's copy of the
    /// record ([`ClientState::saved`]) is brought up to date when it moved.
    revision: u64,
}

/// A device about to be added, its ids settled.
pub(super) struct SettledDevice {
    pub action: VmmAction,
    pub client_id: String,
    pub device_id: String,
}

impl ClientState {
    pub fn is_created(&self) -> bool {
        self.created
    }

    pub fn create(&mut self, record: ClientRecord) {
        self.created = true;
        self.record = record;
        self.revision += 1;
    }

    /// A VM that exists without a CreateVm (restored, or started through another front
    /// end) counts as created once a client adds to it.
    pub fn ensure_created(&mut self) {
        if !self.created {
            self.created = true;
            self.revision += 1;
        }
    }

    /// Takes the record a restored VM's snapshot (or live update) kept, in place of this
    /// one: the client finds its configuration and its devices under their ids again.
    pub fn restored(&mut self, record: ClientRecord) {
        self.record = record;
        self.revision += 1;
    }

    /// The record as a snapshot keeps it (in the machine's devices): None when no client
    /// created the VM nor recorded anything.
    pub fn saved(&self) -> Option<ClientRecord> {
        let record = &self.record;
        let empty = record.document.is_null() && record.devices.is_empty();
        (self.created || !empty).then(|| record.clone())
    }

    /// Which change of the record [`ClientState::saved`] shows (see `revision`).
    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub fn recorded(&self) -> &ClientRecord {
        &self.record
    }

    /// The record as GetInstanceInfo shows it (`client_record`), when there is one.
    pub fn json(&self) -> Option<serde_json::Value> {
        self.saved()
            .and_then(|record| serde_json::to_value(record).ok())
    }

    /// Keeps `entry`, replacing the entry of the same section and id (a second PUT).
    pub fn remember(&mut self, entry: ClientDevice) {
        let devices = &mut self.record.devices;
        devices.retain(|d| d.section != entry.section || d.client_id != entry.client_id);
        devices.push(entry);
        self.revision += 1;
    }

    /// The id gpuvm's actions know the client's device `id` by (a share's tag for its
    /// id, `vsock` for the vsock device's); any other id is its own.
    pub fn device_id(&self, id: &str) -> String {
        self.devices()
            .find(|d| d.client_id == id)
            .map_or_else(|| id.to_string(), |d| d.device_id.clone())
    }

    /// Drops the device named `id` (the client's id or gpuvm's) from the record.
    pub fn forget(&mut self, id: &str) {
        (self.record.devices).retain(|d| d.client_id != id && d.device_id != id);
        self.revision += 1;
    }

    fn devices(&self) -> impl Iterator<Item = &ClientDevice> {
        self.record.devices.iter()
    }

    /// Settles the ids of `add` against the ids in use (`in_use`: the VM's devices as
    /// gpuvm names them): the client's id, or `{prefix}{n}` with the first free n; a
    /// device whose id (either kind) is taken is refused.
    pub fn settle(&self, add: AddDevice, in_use: &[String]) -> Result<SettledDevice, ActionError> {
        let mut taken: Vec<String> = in_use.to_vec();
        taken.extend(
            self.devices()
                .flat_map(|d| [d.client_id.clone(), d.device_id.clone()]),
        );
        let client_id = match add.client_id {
            Some(id) if taken.contains(&id) => {
                return Err(ActionError::bad_request(format!(
                    "a device with id {id:?} already exists"
                )))
            }
            Some(id) => id,
            None => fresh_id(&taken, &add.id_prefix),
        };
        let mut action = *add.action;
        if add.named_by_client_id {
            action.set_device_id(&client_id);
        }
        let device_id = action
            .device_id()
            .ok_or_else(|| ActionError::bad_request("this action does not add a device"))?;
        if device_id != client_id && taken.contains(&device_id) {
            return Err(ActionError::bad_request(format!(
                "the VM has a device {device_id:?} already"
            )));
        }
        Ok(SettledDevice {
            action,
            client_id,
            device_id,
        })
    }

    /// Records a device added: the client's body under its section, with its id.
    pub fn record(
        &mut self,
        client_id: &str,
        device_id: &str,
        section: String,
        mut body: serde_json::Value,
    ) {
        if let serde_json::Value::Object(fields) = &mut body {
            if fields.get("id").is_none_or(serde_json::Value::is_null) {
                fields.insert("id".into(), client_id.into());
            }
        }
        self.ensure_created();
        self.record.devices.push(ClientDevice {
            client_id: client_id.to_string(),
            device_id: device_id.to_string(),
            section,
            body,
        });
        self.revision += 1;
    }
}

impl ClientState {
    /// Keeps every entry ([`VmmAction::Remember`]).
    pub fn remember_all(&mut self, entries: Vec<ClientDevice>) -> crate::action::VmmData {
        entries.into_iter().for_each(|entry| self.remember(entry));
        crate::action::VmmData::Empty
    }
}

/// The action inside a [`VmmAction::Recorded`] and the entry to keep once it succeeded;
/// any other action as it is.
pub(super) fn unwrap_recorded(action: VmmAction) -> (VmmAction, Option<ClientDevice>) {
    match action {
        VmmAction::Recorded { action, entry } => (*action, Some(entry)),
        other => (other, None),
    }
}

/// `prefix` followed by the first number that makes an id not `taken` (Cloud
/// Hypervisor's `_disk0`, `_net1`, ...).
pub(super) fn fresh_id(taken: &[String], prefix: &str) -> String {
    (0..)
        .map(|n| format!("{prefix}{n}"))
        .find(|id| !taken.iter().any(|t| t == id))
        .unwrap_or_default()
}

/// The action that puts device `id` on PCI segment `segment` (none for segment 0).
pub(super) fn segment_action(id: &str, segment: u16) -> Option<VmmAction> {
    (segment != 0).then(|| {
        VmmAction::PutPciSegments(PciSegmentsBody {
            num_pci_segments: None,
            devices: [(id.to_string(), segment)].into(),
        })
    })
}

/// The refusal for a device other than a GPU added to a running VM off segment 0.
pub(super) fn hot_plug_segment_refusal(id: &str, segment: u16) -> ActionError {
    ActionError::bad_request(format!(
        "{id}: gpuvm hot-plugs GPUs on any PCI segment, other devices on segment 0 only \
         (pci_segment = {segment})"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::GpuBody;

    fn gpu_add(id: Option<&str>) -> AddDevice {
        AddDevice {
            action: Box::new(VmmAction::PutGpu(GpuBody::new(
                "placeholder",
                Some("0000:41:00.0".into()),
                None,
            ))),
            client_id: id.map(String::from),
            id_prefix: "_vfio".into(),
            named_by_client_id: true,
            segment: 0,
            noun: "GPU".into(),
            section: "devices".into(),
            body: serde_json::json!({"path": "/sys/bus/pci/devices/0000:41:00.0"}),
        }
    }

    #[test]
    fn made_up_ids_skip_every_id_in_use_and_recorded() {
        let mut state = ClientState::default();
        let first = state.settle(gpu_add(None), &["_vfio0".into()]).unwrap();
        assert_eq!(first.client_id, "_vfio1");
        assert_eq!(first.action.device_id().as_deref(), Some("_vfio1"));
        let path = serde_json::json!({"path": "/x"});
        state.record(&first.client_id, &first.device_id, "devices".into(), path);
        let second = state.settle(gpu_add(None), &["_vfio0".into()]).unwrap();
        assert_eq!(second.client_id, "_vfio2");
        let record = state.json().unwrap();
        assert_eq!(record["devices"][0]["body"]["id"], "_vfio1");
    }

    #[test]
    fn a_given_id_in_use_is_refused_and_a_forgotten_one_is_free() {
        let mut state = ClientState::default();
        let device = state.settle(gpu_add(Some("gpu0")), &[]).unwrap();
        state.record(
            &device.client_id,
            &device.device_id,
            "devices".into(),
            serde_json::json!({}),
        );
        let error = state.settle(gpu_add(Some("gpu0")), &[]).err().unwrap();
        assert_eq!(error.status, 400);
        assert!(
            error.message.contains("already exists"),
            "{}",
            error.message
        );
        state.forget("gpu0");
        assert!(state.settle(gpu_add(Some("gpu0")), &[]).is_ok());
    }

    #[test]
    fn a_share_is_known_by_its_tag() {
        let mut state = ClientState::default();
        state.record(
            "fs0",
            "myfs",
            "fs".into(),
            serde_json::json!({"tag": "myfs"}),
        );
        assert_eq!(state.device_id("fs0"), "myfs");
        assert_eq!(state.device_id("other"), "other");
        state.forget("myfs");
        assert_eq!(state.device_id("fs0"), "fs0");
    }

    #[test]
    fn a_remembered_body_replaces_the_one_of_its_section_and_id() {
        let mut state = ClientState::default();
        assert!(state.json().is_none());
        let entry = |id: &str, size: u64| ClientDevice {
            client_id: id.into(),
            device_id: id.into(),
            section: "drives".into(),
            body: serde_json::json!({"drive_id": id, "size": size}),
        };
        state.remember(entry("a", 1));
        state.remember(entry("b", 2));
        state.remember(entry("a", 3));
        let record = state.json().unwrap();
        assert_eq!(record["devices"].as_array().unwrap().len(), 2);
        assert_eq!(record["devices"][1]["body"]["size"], 3);
        assert!(!state.is_created());
    }

    /// What a snapshot keeps of the record: nothing for a VM no client configured; the
    /// record as it stands (each change counted) once one did; and a restore's record
    /// replaces the one there was.
    #[test]
    fn the_saved_record_follows_each_change_and_a_restored_one_replaces_it() {
        let mut state = ClientState::default();
        assert_eq!(state.saved(), None);
        let mut revisions = vec![state.revision()];
        let document = serde_json::json!({"payload": {"kernel": "/k"}});
        state.create(ClientRecord {
            document: document.clone(),
            devices: Vec::new(),
        });
        revisions.push(state.revision());
        let device = state.settle(gpu_add(Some("gpu0")), &[]).unwrap();
        let body = serde_json::json!({"path": "/x"});
        state.record(&device.client_id, &device.device_id, "devices".into(), body);
        revisions.push(state.revision());
        let saved = state.saved().unwrap();
        assert_eq!(saved.document, document);
        assert_eq!(saved.devices[0].client_id, "gpu0");
        state.forget("gpu0");
        revisions.push(state.revision());
        assert!(state.saved().unwrap().devices.is_empty());
        let mut unique = revisions.clone();
        unique.dedup();
        assert_eq!(unique, revisions, "each change counts");

        let mut restored = ClientState::default();
        restored.restored(saved.clone());
        assert_ne!(restored.revision(), 0);
        assert_eq!(restored.saved(), Some(saved));
        assert_eq!(restored.device_id("gpu0"), "gpu0");
        assert!(restored.settle(gpu_add(Some("gpu0")), &[]).is_err());
    }

    #[test]
    fn a_device_other_than_a_gpu_is_hot_plugged_on_segment_zero_only() {
        let error = hot_plug_segment_refusal("d", 1);
        assert_eq!(error.status, 400);
        assert!(
            error.message.contains("other devices on segment 0 only")
                && error.message.contains("pci_segment = 1"),
            "{}",
            error.message
        );
    }
}
