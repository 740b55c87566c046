//! The VM's MMDS (Firecracker's microVM metadata service): the controller owns it (one
//! [`Mmds`] per VM), the API changes it through these actions, and every virtio-net
//! device the controller builds is given it (crate::virtio::DeviceResources::with_mmds), so
//! an interface the configuration names answers the guest's MMDS requests.

use gpuvm_mmds::{ConfigError, DataStoreError, Mmds, MmdsConfig};

use crate::action::{ActionError, ActionResult, VmmAction, VmmData};

/// The status of a store refused for its size (HTTP 413, Payload Too Large), which
/// Firecracker's front end answers as it is.
pub const TOO_LARGE: u16 = 413;

/// When an MMDS action comes.
pub(super) enum Stage<'a> {
    /// Before start, with the ids of the network interfaces configured so far.
    PreBoot { nets: &'a [&'a str] },
    /// Once the VM has started (or been loaded): the configuration is fixed.
    Started,
}

/// Carries out an MMDS action (PutMmds, PatchMmds, GetMmds, SetMmdsSizeLimit,
/// PutMmdsConfig): the data store's the same in every stage, the
/// configuration before start only (Firecracker's refusal after it).
pub(super) fn act(mmds: &Mmds, action: VmmAction, stage: Stage<'_>) -> ActionResult {
    match (action, stage) {
        (VmmAction::PutMmdsConfig(config), Stage::PreBoot { nets }) => {
            configure(mmds, config, nets)
        }
        (VmmAction::PutMmdsConfig(_), Stage::Started) => Err(ActionError::wrong_state(
            "The requested operation is not supported after starting the microVM.",
        )),
        (action, _) => store_action(mmds, action),
    }
}

/// The data store's actions: PutMmds, PatchMmds, GetMmds, SetMmdsSizeLimit.
fn store_action(mmds: &Mmds, action: VmmAction) -> ActionResult {
    let mut store = mmds.store();
    let changed = match action {
        VmmAction::PutMmds(value) => store.put(value),
        VmmAction::PatchMmds(patch) => store.patch(&patch),
        VmmAction::GetMmds => return Ok(VmmData::Json(store.data().clone())),
        VmmAction::SetMmdsSizeLimit(bytes) => {
            store.set_limit(bytes);
            Ok(())
        }
        _ => return Err(ActionError::bad_request("not an MMDS data store action")),
    };
    changed
        .map(|()| VmmData::Empty)
        .map_err(|error| match error {
            DataStoreError::TooLarge { .. } => ActionError {
                status: TOO_LARGE,
                message: error.to_string(),
            },
            DataStoreError::NotAnObject => ActionError::bad_request(error.to_string()),
        })
}

/// PUT /mmds/config before start: [`check`]ed against `configured` (the network
/// interfaces configured so far).
fn configure(mmds: &Mmds, config: MmdsConfig, configured: &[&str]) -> ActionResult {
    check(&config, configured)?;
    mmds.set_config(Some(config));
    Ok(VmmData::Empty)
}

/// Firecracker's checks of an MMDS configuration, each refusal naming its field: some
/// interfaces named, every one of them among `configured`, a link-local unicast address.
/// (A Firecracker config file is checked by it before anything runs too.)
pub fn check(config: &MmdsConfig, configured: &[&str]) -> Result<(), ActionError> {
    config.validate().map_err(|error| {
        let field = match error {
            ConfigError::NoInterfaces => "network_interfaces",
            ConfigError::NotLinkLocal(_) | ConfigError::Broadcast(_) => "ipv4_address",
        };
        ActionError::bad_request(format!("mmds-config.{field}: {error}"))
    })?;
    let unknown: Vec<&String> = config
        .network_interfaces
        .iter()
        .filter(|id| !configured.contains(&id.as_str()))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    Err(ActionError::bad_request(format!(
        "mmds-config.network_interfaces: no network interface {unknown:?} is configured (MMDS answers on configured interfaces only)"
    )))
}
