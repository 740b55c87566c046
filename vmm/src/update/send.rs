//! The old process's side of a live update, on the VMM thread: refuse what the hand-over
//! does not carry yet, pause, save, send, and either commit or take the VM back.
//!
//! virtio devices are quiesced as a snapshot quiesces them (their I/O stops after the
//! request in flight, `RunningMachine::pause_devices`) whenever their state is saved, and
//! resumed if the VM is taken back. A virtio-blk drive's open image descriptor goes with
//! the offer, so the new process keeps its lock (flock locks belong to the open file
//! description); so do a network interface's tap queues (the tap stays attached, frames
//! queue in it while the vCPUs are paused); virtio-rng reopens /dev/urandom; the balloon
//! holds no descriptor (the pages it freed stay holes in the RAM file both share). A
//! vfio-user device's connection goes with the offer, its PCI state with the paused state
//! (`super::passthrough` for cold-plugged ones, crate::hotplug's hand-over for GPUs
//! hot-plugged at runtime, which stay hot-plugged in the new process); the device runs on
//! throughout.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use gpuvm_devices::Persist;

use super::protocol::{self, MessageKind, OfferMeta};
use super::{kernel_vfio, passthrough};
use super::{socket, UpdateError};
use crate::machine::RunningMachine;
use crate::snapshot::{MachineState, SavedMachineConfig};
use crate::virtio::VirtioDeviceConfig;
use crate::vm_state::InKernelDevices;

/// Test hook: the old process, started with this set, dies (abort) once the new one is
/// ready and before it commits, to check that the new one then runs the VM.
pub const OLD_DIES_HOOK: &str = "GPUVM_TEST_UPDATE_OLD_DIES";

/// What a hand-over that went through took.
#[derive(Clone, Debug)]
pub struct HandOverReport {
    /// The new process: the socket's listener as the kernel reports it, which its `Ready`
    /// confirmed.
    pub new_pid: Option<u32>,
    /// From the pause to the new process's `Ready` (the old side's share of the downtime).
    pub paused_to_ready: Duration,
    /// Bytes of machine state sent.
    pub state_bytes: usize,
}

/// Hands the running VM to the gpuvm listening on `socket`. On success the VM belongs to
/// the new process: the caller must end the run without resuming anything. On failure
/// the VM runs on here as before (its vCPUs and devices resumed), and the error says why.
/// With `expected`, only that process may be the socket's listener. `api_listener`,
/// the API's listening socket (which has stopped accepting), goes with `Commit`: the new
/// process serves it from then on.
pub fn hand_over(
    running: &mut RunningMachine<'_>,
    socket: &Path,
    timeout: Duration,
    expected: ExpectedReceiver,
    api_listener: Option<BorrowedFd<'_>>,
    mmds: &gpuvm_mmds::Mmds,
) -> Result<HandOverReport, UpdateError> {
    // The passthrough devices' background DMA mappings of guest RAM finish first, within
    // half the update's time (the guest runs meanwhile): the new process takes over only
    // mappings that are complete, so an update asked for right after a device came would
    // otherwise be refused.
    let waited = (running.machine().devices())
        .finish_dma_mappings(timeout / 2)
        .map_err(UpdateError::NotReady)?;
    if let Some(waited) = waited {
        log::info!("live update: guest RAM is DMA-mapped for every device (waited {waited:?})");
    }
    check_supported(running)?;
    socket::check_path(socket)?;
    // A lazy restore still loading finishes first, within half the update's time (the
    // new process waits that long for this one): the new process maps guest RAM without
    // this one's userfaultfd, so every page must be in the RAM file.
    let waited = (running.machine())
        .finish_lazy_restore(timeout / 2)
        .map_err(UpdateError::NotReady)?;
    if let Some(waited) = waited {
        log::info!("live update: guest RAM of the lazy restore is all loaded (waited {waited:?})");
    }
    let stream = UnixStream::connect(socket).map_err(|source| UpdateError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    let receiver = check_receiver(socket::peer_credentials(&stream)?, &expected)?;
    let set_timeout = |source| UpdateError::Socket {
        what: "set the hand-over socket's timeout",
        source,
    };
    stream
        .set_read_timeout(Some(timeout))
        .map_err(set_timeout)?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(set_timeout)?;
    // The new process builds its VM while the guest runs here; only then is it paused.
    if let Err(error) = offer(running, &stream, mmds, expected.token) {
        let _ = protocol::send(&stream, MessageKind::Abort, b"", &[]);
        let error = explain_timeout(error, timeout);
        log::error!("live update refused before the pause; the VM runs on: {error}");
        return Err(error);
    }
    if let Err(error) = running.pause() {
        let _ = protocol::send(&stream, MessageKind::Abort, b"", &[]);
        return Err(UpdateError::Save(format!(
            "cannot pause the vCPUs: {error}"
        )));
    }
    running.pause_devices();
    let paused_at = Instant::now();
    match hand_paused_and_commit(running, &stream, receiver, api_listener, mmds) {
        Ok(state_bytes) => Ok(HandOverReport {
            // A receiver in another pid namespace has no pid here.
            new_pid: (receiver.pid != 0).then_some(receiver.pid),
            paused_to_ready: paused_at.elapsed(),
            state_bytes,
        }),
        Err(error) => {
            // Tell the new process it must not run the VM (best effort: it may be gone),
            // then run it here again.
            let _ = protocol::send(&stream, MessageKind::Abort, b"", &[]);
            // The new process may have given the vfio-user devices its interrupts.
            let devices = running.machine().devices();
            passthrough::rearm(&devices.handover);
            let ram = running.machine().dma_regions_of_all_ram();
            kernel_vfio::take_addresses_back(&devices.handover, &ram);
            if let Some(hotplug) = &devices.pci_hotplug {
                hotplug.handover_take_addresses_back(&ram);
                hotplug.handover_rearm();
            }
            running.resume_devices();
            if let Err(resume) = running.resume() {
                log::error!("live update failed and the vCPUs cannot be resumed: {resume}");
            }
            let error = explain_timeout(error, timeout);
            log::error!("live update failed; the VM runs on in this process: {error}");
            Err(error)
        }
    }
}

/// A socket timeout, said as the new process's silence.
fn explain_timeout(error: UpdateError, timeout: Duration) -> UpdateError {
    if error.is_timeout() {
        UpdateError::Protocol(format!("the new gpuvm did not answer within {timeout:?}"))
    } else {
        error
    }
}

/// Sends the offer (RAM, stdio and disk image descriptors) and the running machine's
/// configuration and device state, and waits until the new process has built its VM.
fn offer(
    running: &mut RunningMachine<'_>,
    stream: &UnixStream,
    mmds: &gpuvm_mmds::Mmds,
    handover_token: Option<String>,
) -> Result<(), UpdateError> {
    let vcpu_ids: Vec<u8> = running.vcpu_handles().iter().map(|h| h.id).collect();
    let (drives, images) = drive_images(running)?;
    let (interfaces, taps) = interface_taps(running)?;
    let devices = running.machine().devices();
    let (mut vfio_user, mut connections) = passthrough::offer(&devices.handover)?;
    // The hot-plugged GPUs after the cold-plugged devices, as in the paused state.
    if let Some(hotplug) = &devices.pci_hotplug {
        let (hot, fds) = hotplug.handover_offer().map_err(UpdateError::Save)?;
        vfio_user.extend(hot);
        connections.extend(fds);
    }
    let (kernel_vfio, kernel_fds) = kernel_vfio::offer(&devices.handover)?;
    let (hot_kernel_vfio, hot_kernel_fds) = match &devices.pci_hotplug {
        Some(hotplug) => hotplug.handover_offer_kernel()?,
        None => (Vec::new(), Vec::new()),
    };
    let (outputs, output_files) = crate::outputs::hand_over()
        .map_err(|source| UpdateError::Io {
            what: "duplicate the log and metrics outputs",
            source,
        })?
        .unzip();
    if connections.len() > protocol::MAX_VFIO_USER_FDS {
        return Err(UpdateError::unsupported(
            format!(
                "vfio-user devices with {} descriptors (connections and region files)",
                connections.len()
            ),
            Some(&format!(
                "at most {} are handed over",
                protocol::MAX_VFIO_USER_FDS
            )),
        ));
    }
    let vsock_listener = vsock_listener(running)?;
    let (vhost_user, vhost_user_sockets) = vhost_user_connections(running)?;
    let mut configuration = save_configuration(running)?;
    // The interfaces the new process builds answer MMDS from the start.
    configuration.devices.handed_over_mmds = mmds.save();
    let framed = frame_state(&configuration)?;
    let ram = running.machine().ram();
    let meta = OfferMeta {
        ram_size: ram.size(),
        huge_tmpfs: ram.huge_tmpfs(),
        vcpu_ids,
        old_pid: std::process::id(),
        handover_token,
        drives,
        interfaces,
        vfio_user,
        kernel_vfio,
        hot_kernel_vfio,
        outputs,
        vsock_listener: vsock_listener.is_some(),
        vhost_user,
    };
    let meta = serde_json::to_vec(&meta)
        .map_err(|e| UpdateError::Save(format!("cannot encode the offer: {e}")))?;
    let mut fds: Vec<RawFd> = vec![
        ram.memfd().as_raw_fd(),
        std::io::stdin().as_raw_fd(),
        std::io::stdout().as_raw_fd(),
        std::io::stderr().as_raw_fd(),
    ];
    debug_assert_eq!(fds.len(), protocol::OFFER_FDS);
    fds.extend(images.iter().map(AsRawFd::as_raw_fd));
    fds.extend(taps.iter().map(AsRawFd::as_raw_fd));
    fds.extend(connections.iter().map(AsRawFd::as_raw_fd));
    fds.extend(kernel_fds.iter().map(AsRawFd::as_raw_fd));
    fds.extend(hot_kernel_fds.iter().map(AsRawFd::as_raw_fd));
    fds.extend(output_files.iter().flatten().map(AsRawFd::as_raw_fd));
    fds.extend(vsock_listener.iter().map(AsRawFd::as_raw_fd));
    fds.extend(vhost_user_sockets.iter().map(AsRawFd::as_raw_fd));
    protocol::send(stream, MessageKind::Offer, &meta, &fds)?;
    // Ours are duplicates: the drives, interfaces and passthrough devices keep theirs.
    drop(images);
    drop(taps);
    drop(connections);
    drop(kernel_fds);
    drop(hot_kernel_fds);
    drop(output_files);
    drop(vsock_listener);
    drop(vhost_user_sockets);
    protocol::send(stream, MessageKind::State, &framed, &[])?;
    protocol::expect(stream, MessageKind::Built).map(drop)
}

/// A duplicate of the vsock device's listening socket, if the VM has one (a VM has at
/// most one vsock device).
fn vsock_listener(running: &RunningMachine<'_>) -> Result<Option<OwnedFd>, UpdateError> {
    let duplicated = (running.machine().devices().virtio.iter()).find_map(|handle| {
        handle.with_device(|vsock: &mut gpuvm_virtio::vsock::Vsock| vsock.listener_descriptor())
    });
    duplicated.transpose().map_err(|source| UpdateError::Io {
        what: "duplicate the vsock listener",
        source,
    })
}

/// The paused vsock device's connections and waiting host clients (a live update
/// carries them with their sockets), if the VM has a vsock device its driver started;
/// refused, for a retry, while more of them or of their buffered bytes than a hand-over
/// carries.
fn vsock_connections(
    running: &RunningMachine<'_>,
) -> Result<Option<(gpuvm_virtio::vsock::VsockLiveState, Vec<OwnedFd>)>, UpdateError> {
    let Some(handed) = (running.machine().devices().virtio.iter()).find_map(|handle| {
        handle.with_device(|vsock: &mut gpuvm_virtio::vsock::Vsock| vsock.hand_over())
    }) else {
        return Ok(None);
    };
    let Some((live, fds)) = handed.map_err(UpdateError::Save)? else {
        return Ok(None);
    };
    if live.descriptors() > protocol::MAX_VSOCK_SOCKETS {
        return Err(UpdateError::NotReady(format!(
            "vsock has {} connections and waiting host clients; at most {} are handed over",
            live.descriptors(),
            protocol::MAX_VSOCK_SOCKETS
        )));
    }
    if live.buffered() > protocol::MAX_VSOCK_BUFFERED {
        return Err(UpdateError::NotReady(format!(
            "vsock connections hold {} bytes their host sockets have not read; at most {} are \
             handed over",
            live.buffered(),
            protocol::MAX_VSOCK_BUFFERED
        )));
    }
    Ok(Some((live, fds)))
}

/// Each vhost-user device's id and what it negotiated and shows its guest, and a duplicate
/// of its connection's socket, in the order of the VM's devices.
fn vhost_user_connections(
    running: &RunningMachine<'_>,
) -> Result<(Vec<protocol::OfferedVhostUser>, Vec<OwnedFd>), UpdateError> {
    use gpuvm_virtio::vhost_user::{VhostUserBlock, VhostUserFs, VhostUserGeneric};
    let mut offered = Vec::new();
    let mut sockets = Vec::new();
    for handle in &running.machine().devices().virtio {
        let handed = match &handle.config {
            VirtioDeviceConfig::VhostUserBlock(_) => {
                handle.with_device(|device: &mut VhostUserBlock| device.hand_over())
            }
            VirtioDeviceConfig::Fs(_) => {
                handle.with_device(|device: &mut VhostUserFs| device.hand_over())
            }
            VirtioDeviceConfig::VhostUser(_) => {
                handle.with_device(|device: &mut VhostUserGeneric| device.hand_over())
            }
            _ => continue,
        };
        let id = handle.config.id().to_string();
        let (live, socket) = handed
            .ok_or_else(|| UpdateError::Save(format!("{id} is not a vhost-user device")))?
            .map_err(UpdateError::Save)?;
        offered.push(protocol::OfferedVhostUser { id, live });
        sockets.push(socket);
    }
    if offered.len() > protocol::MAX_VHOST_USER {
        return Err(UpdateError::unsupported(
            format!("a VM with {} vhost-user devices", offered.len()),
            Some(&format!(
                "at most {} are handed over",
                protocol::MAX_VHOST_USER
            )),
        ));
    }
    Ok((offered, sockets))
}

/// Each virtio-blk drive's ID and a duplicate of its open image descriptor, in the
/// order of the VM's devices.
fn drive_images(
    running: &RunningMachine<'_>,
) -> Result<(Vec<String>, Vec<std::fs::File>), UpdateError> {
    let mut drives = Vec::new();
    let mut images = Vec::new();
    for handle in &running.machine().devices().virtio {
        let VirtioDeviceConfig::Block(config) = &handle.config else {
            continue;
        };
        let image = handle
            .with_device(gpuvm_virtio::block::Block::image_descriptor)
            .ok_or_else(|| {
                UpdateError::Save(format!(
                    "drive {} is not a virtio-blk device",
                    config.drive_id
                ))
            })?
            .map_err(|e| UpdateError::Save(format!("drive {}: {e}", config.drive_id)))?;
        drives.push(config.drive_id.clone());
        images.push(image);
    }
    Ok((drives, images))
}

/// Each network interface (id and queue count) and duplicates of its tap queues' descriptors,
/// in the order of the VM's devices.
fn interface_taps(
    running: &RunningMachine<'_>,
) -> Result<(Vec<protocol::OfferedInterface>, Vec<std::os::fd::OwnedFd>), UpdateError> {
    let mut interfaces = Vec::new();
    let mut taps = Vec::new();
    for handle in &running.machine().devices().virtio {
        let VirtioDeviceConfig::Net(config) = &handle.config else {
            continue;
        };
        let queues = handle
            .with_device(gpuvm_virtio::net::Net::tap_descriptors)
            .ok_or_else(|| {
                UpdateError::Save(format!(
                    "interface {} is not a virtio-net device",
                    config.iface_id
                ))
            })?
            .map_err(|e| UpdateError::Save(e.to_string()))?;
        interfaces.push(protocol::OfferedInterface {
            iface_id: config.iface_id.clone(),
            queues: queues.len() as u16,
        });
        taps.extend(queues);
    }
    Ok((interfaces, taps))
}

/// What building the VM takes (configuration and devices), saved while the guest runs. A
/// virtio device's state can only be saved paused: a VM with them is paused (vCPUs, then
/// devices, as a snapshot) for as long as saving takes, and resumed.
fn save_configuration(running: &mut RunningMachine<'_>) -> Result<MachineState, UpdateError> {
    if running.machine().devices().virtio.is_empty() {
        return save_state(running, false);
    }
    running
        .pause()
        .map_err(|e| UpdateError::Save(format!("cannot pause the vCPUs: {e}")))?;
    running.pause_devices();
    let saved = save_state(running, false);
    running.resume_devices();
    running
        .resume()
        .map_err(|e| UpdateError::Save(format!("cannot resume the vCPUs: {e}")))?;
    saved
}

/// Who `gpuvm update` says must listen on the hand-over socket (PUT /vmm/update's
/// `receiver_pid`, `handover_token`).
#[derive(Clone, Debug, Default)]
pub struct ExpectedReceiver {
    /// Its pid, in this process's pid namespace.
    pub pid: Option<u32>,
    /// A receiver in another pid namespace (the new process of a gpuvm that is its own
    /// namespace's init), whose pid reads 0 here: the secret it was given, which goes with
    /// the offer (it takes no offer without it).
    pub token: Option<String>,
}

/// Checks a hand-over token's form: 32 to 128 hex digits.
pub fn check_token(token: &str) -> Result<(), String> {
    if (32..=128).contains(&token.len()) && token.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err("handover_token must be 32 to 128 hex digits".into())
    }
}

/// Whom the hand-over socket connects this process to (`SO_PEERCRED`: the process that
/// listens, the new gpuvm) may take the VM: the `expected` one where given, else a process
/// of root or of this process's user, and not this one; one whose pid reads 0 (another
/// pid namespace) only when a token is given. The socket's private directory keeps anyone
/// else from listening there; this makes sure.
fn check_receiver(
    receiver: socket::PeerCredentials,
    expected: &ExpectedReceiver,
) -> Result<socket::PeerCredentials, UpdateError> {
    if let Some(pid) = expected.pid {
        if receiver.pid != pid {
            return Err(UpdateError::UntrustedPeer {
                pid: receiver.pid,
                uid: receiver.uid,
                expected: format!("process {pid} (receiver_pid)"),
            });
        }
    }
    let uid = socket::effective_uid();
    if receiver.pid == std::process::id() || (receiver.pid == 0 && expected.token.is_none()) {
        return Err(UpdateError::UntrustedPeer {
            pid: receiver.pid,
            uid: receiver.uid,
            expected: "another gpuvm process of this pid namespace".into(),
        });
    }
    if receiver.uid != 0 && receiver.uid != uid {
        return Err(UpdateError::UntrustedPeer {
            pid: receiver.pid,
            uid: receiver.uid,
            expected: format!("a process of root or of uid {uid}"),
        });
    }
    Ok(receiver)
}

/// With the vCPUs paused: sends the whole state, waits for `Ready` from `receiver`,
/// commits (with `api_listener`, if any). Returns the state's size.
fn hand_paused_and_commit(
    running: &RunningMachine<'_>,
    stream: &UnixStream,
    receiver: socket::PeerCredentials,
    api_listener: Option<BorrowedFd<'_>>,
    mmds: &gpuvm_mmds::Mmds,
) -> Result<usize, UpdateError> {
    let paused_at_ns = protocol::monotonic_ns();
    let mut state = save_state(running, true)?;
    // A type1 container's mappings: their host addresses become the new process's to give.
    let machine = running.machine();
    let ram = machine.dma_regions_of_all_ram();
    if let Some(kernel) = state.devices.handed_over_kernel_vfio.as_mut() {
        kernel.type1_vaddr = kernel_vfio::move_addresses_away(&machine.devices().handover, &ram)?;
    }
    if let Some(hotplug) = &machine.devices().pci_hotplug {
        hotplug
            .handover_move_addresses_away(&mut state.devices.handed_over_hot_kernel_vfio, &ram)?;
    }
    // As the API last changed it, with the tokens the guest took since the offer.
    state.devices.handed_over_mmds = mmds.save();
    // The vsock connections go on in the new process: their state, sockets beside.
    let (vsock, vsock_sockets) = vsock_connections(running)?.unzip();
    state.devices.handed_over_vsock = vsock;
    let framed = frame_state(&state)?;
    let vsock_fds: Vec<RawFd> = vsock_sockets
        .iter()
        .flatten()
        .map(AsRawFd::as_raw_fd)
        .collect();
    protocol::send(
        stream,
        MessageKind::PausedState,
        &protocol::paused_state(paused_at_ns, &framed),
        &vsock_fds,
    )?;
    drop(vsock_sockets);
    let ready = protocol::expect(stream, MessageKind::Ready)?;
    if std::env::var_os(OLD_DIES_HOOK).is_some() {
        log::error!("{OLD_DIES_HOOK}: ending abruptly after the new gpuvm's Ready");
        std::process::abort();
    }
    let ready: protocol::ReadyBody = serde_json::from_slice(&ready.payload)
        .map_err(|e| UpdateError::Protocol(format!("a bad Ready: {e}")))?;
    // The process that says it is ready must be the one the kernel says listens: the VM
    // goes to no one else. (One in another pid namespace says its pid in its own.)
    if receiver.pid != 0 && ready.pid != receiver.pid {
        return Err(UpdateError::UntrustedPeer {
            pid: ready.pid,
            uid: receiver.uid,
            expected: format!("process {}, which listens on the socket", receiver.pid),
        });
    }
    // The point of no return: once `Commit` is out, the new process runs the VM. The API's
    // listening socket goes with it: the new process accepts the connections waiting in
    // its backlog (this one stopped accepting before the update began, and never will
    // again). A receiver that predates it closes it unused and binds the path again.
    let api_fds: Vec<RawFd> = api_listener.iter().map(AsRawFd::as_raw_fd).collect();
    protocol::send(stream, MessageKind::Commit, b"", &api_fds)?;
    // Its vfio-user connections are the new process's: nothing here may use them, nor
    // reset the devices or close the connections as this process's VM goes.
    // The vsock socket file is the new process's to remove now.
    crate::virtio::vsock_owns_socket_file(&running.machine().devices().virtio, false);
    let devices = running.machine().devices();
    passthrough::release(&devices.handover, receiver.pid);
    kernel_vfio::release(&devices.handover, receiver.pid);
    if let Some(hotplug) = &devices.pci_hotplug {
        hotplug.handover_release(&format!("gpuvm process {}", receiver.pid));
        hotplug.handover_release_kernel(receiver.pid);
    }
    Ok(framed.len())
}

/// Refuses network interfaces the hand-over cannot carry: more tap queues than an offer
/// brings. (An interface that answers MMDS goes over with the VM's MMDS.)
fn check_interfaces(running: &RunningMachine<'_>) -> Result<(), UpdateError> {
    let mut queues = 0;
    for handle in &running.machine().devices().virtio {
        let VirtioDeviceConfig::Net(config) = &handle.config else {
            continue;
        };
        queues += usize::from(config.num_queue_pairs);
    }
    if queues > protocol::MAX_TAP_QUEUES {
        return Err(UpdateError::unsupported(
            format!("a VM with {queues} tap queues"),
            Some(&format!(
                "at most {} are handed over",
                protocol::MAX_TAP_QUEUES
            )),
        ));
    }
    Ok(())
}

/// Refuses passthrough devices the hand-over does not carry, or cannot take over now:
/// cold-plugged kernel VFIO ([`kernel_vfio::refusal`]) and vfio-user devices
/// ([`passthrough::refusal`]), hot-plugged GPUs of either kind
/// (crate::hotplug::PciHotplug::handover_refusal).
fn check_passthrough(devices: &crate::devices::MachineDevices) -> Result<(), UpdateError> {
    let hotplug = devices.pci_hotplug.as_ref();
    // Hot-plugged GPUs (vfio-user or kernel VFIO) all go over, unless their own refusal
    // (PciHotplug::handover_refusal) says why not now.
    let hot_labels: Vec<String> = hotplug.map(|h| h.labels().collect()).unwrap_or_default();
    let carried = |label: &&String| {
        (devices.handover.vfio_user.iter())
            .any(|plugged| label.ends_with(plugged.connection.name()))
            || kernel_vfio::carries(&devices.handover, label)
            || hot_labels.contains(label)
    };
    let kernel: Vec<&str> = (devices.passthrough.iter())
        .filter(|label| !carried(label))
        .map(String::as_str)
        .collect();
    if let Some(reason) = kernel_vfio::refusal(&devices.handover) {
        return Err(UpdateError::unsupported(
            "a VM with these kernel VFIO devices",
            Some(&reason),
        ));
    }
    if !kernel.is_empty() {
        return Err(UpdateError::unsupported(
            format!("a VM with kernel VFIO devices ({})", kernel.join(", ")),
            Some(
                "kernel VFIO devices are handed over with their iommufd or type1 container; \
                 these have none this process can hand over",
            ),
        ));
    }
    if let Some(reason) = passthrough::refusal(&devices.handover) {
        return Err(UpdateError::unsupported(
            "a VM with these vfio-user devices",
            Some(&reason),
        ));
    }
    if let Some(reason) = hotplug.and_then(|h| h.handover_refusal()) {
        return Err(UpdateError::unsupported(
            "a VM with these hot-plugged GPUs",
            Some(&reason),
        ));
    }
    Ok(())
}

/// Refuses, before anything is paused, a VM whose pieces the hand-over does not carry yet.
fn check_supported(running: &RunningMachine<'_>) -> Result<(), UpdateError> {
    let machine = running.machine();
    let devices = machine.devices();
    if running.is_paused() {
        return Err(UpdateError::unsupported(
            "a paused VM",
            Some("resume it first (PATCH /vm {\"state\": \"Resumed\"})"),
        ));
    }
    let not_carried: Vec<&str> = devices
        .virtio
        .iter()
        .filter(|h| {
            !matches!(
                h.config,
                VirtioDeviceConfig::Block(_)
                    | VirtioDeviceConfig::Rng(_)
                    | VirtioDeviceConfig::Net(_)
                    | VirtioDeviceConfig::Balloon(_)
                    | VirtioDeviceConfig::Vsock(_)
                    | VirtioDeviceConfig::VhostUserBlock(_)
                    | VirtioDeviceConfig::Fs(_)
                    | VirtioDeviceConfig::VhostUser(_)
            )
        })
        .map(|h| h.config.id())
        .collect();
    if !not_carried.is_empty() {
        return Err(UpdateError::unsupported(
            format!("a VM with virtio devices ({})", not_carried.join(", ")),
            Some(
                "virtio-blk, virtio-net, virtio-rng, vsock, the balloon and vhost-user \
                 devices are handed over",
            ),
        ));
    }
    check_interfaces(running)?;
    let drives = devices
        .virtio
        .iter()
        .filter(|h| matches!(h.config, VirtioDeviceConfig::Block(_)))
        .count();
    if drives > protocol::MAX_DRIVES {
        return Err(UpdateError::unsupported(
            format!("a VM with {drives} drives"),
            Some(&format!("at most {} are handed over", protocol::MAX_DRIVES)),
        ));
    }
    check_passthrough(devices)?;
    // vCPUs the guest ejected stay parked here; the new process makes none for them, only
    // spare threads (a later vm.resize makes them there). It builds vCPUs 0..N in order:
    // the VMM adds them in order and ejects the highest first, so a gap means the guest
    // ejected one on its own.
    let ids: Vec<u8> = running.vcpu_handles().iter().map(|h| h.id).collect();
    if ids
        .iter()
        .enumerate()
        .any(|(index, &id)| usize::from(id) != index)
    {
        return Err(UpdateError::unsupported(
            format!("a VM whose vCPUs are {ids:?}"),
            Some("vCPUs 0 to N are handed over: the guest ejected one below others"),
        ));
    }
    Ok(())
}

/// The machine's state as a snapshot saves it, without memory files; with the vCPUs'
/// state if `paused` (only a paused vCPU can be saved), else only what building the VM
/// takes (configuration and devices).
fn save_state(running: &RunningMachine<'_>, paused: bool) -> Result<MachineState, UpdateError> {
    let machine = running.machine();
    let save =
        |what: &str, error: &dyn std::fmt::Display| UpdateError::Save(format!("{what}: {error}"));
    let vcpus = if paused {
        running
            .vcpu_handles()
            .iter()
            .map(|handle| handle.save_state())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| save("vCPU state", &e))?
    } else {
        Vec::new()
    };
    let vm = InKernelDevices(machine.vm_fd())
        .save()
        .map_err(|e| save("in-kernel irqchip, PIT and clock", &e))?;
    let mut devices = machine
        .devices()
        .save()
        .map_err(|e| save("device state", &e))?;
    // Hot-plugged RAM is in the RAM file handed over (after boot RAM); its slots say where.
    devices.ram_hotplug = machine
        .save_ram_hotplug()
        .map_err(|e| save("memory hot-plug", &e))?;
    devices.handed_over_vfio_user = passthrough::save(
        &machine.devices().handover,
        &crate::dma::RamChunks::regions_of(machine.ram()),
    )?;
    devices.handed_over_kernel_vfio = kernel_vfio::save(
        &machine.devices().handover,
        &crate::dma::RamChunks::regions_of(machine.ram()),
    )?;
    // The hot-plugged GPUs have the hot-plugged RAM mapped too.
    if let Some(hotplug) = &machine.devices().pci_hotplug {
        devices.handed_over_pci_segments = hotplug
            .save_segments()
            .map_err(|e| save("PCI segments", &e))?;
        let ram = machine.dma_regions_of_all_ram();
        let hot = hotplug.handover_save(&ram).map_err(UpdateError::Save)?;
        devices.handed_over_vfio_user.extend(hot);
        devices.handed_over_hot_kernel_vfio = hotplug.handover_save_kernel(&ram)?;
    }
    // The devices keep their peer mappings; the new process takes the table.
    if let Some(parts) = &machine.devices().handover.plug {
        for device in &mut devices.handed_over_vfio_user {
            device.p2p = parts
                .peers
                .shares_bars(&gpuvm_vfio::user::device_name(&device.socket));
        }
        devices.handed_over_peer_mappings = parts.peers.handed_over();
    }
    Ok(MachineState {
        config: SavedMachineConfig::from_config(machine.config()),
        vm,
        vcpus,
        devices,
        memory_files: Vec::new(),
        memory_file_id: None,
        raw_memory: None,
        numa: machine.numa.saved(),
    })
}

/// `state` framed as a snapshot's state file (crate::persist's layout), so that the new
/// binary reads it with its own version checks and migrations.
fn frame_state(state: &MachineState) -> Result<Vec<u8>, UpdateError> {
    let payload = serde_json::to_vec(state)
        .map_err(|e| UpdateError::Save(format!("cannot encode the state: {e}")))?;
    let mut framed = Vec::with_capacity(24 + payload.len());
    framed.extend_from_slice(crate::persist::STATE_MAGIC);
    framed.extend_from_slice(&crate::persist::STATE_FORMAT_VERSION.to_le_bytes());
    framed.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    framed.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    framed.extend_from_slice(&payload);
    Ok(framed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(pid: u32) -> socket::PeerCredentials {
        socket::PeerCredentials {
            pid,
            uid: socket::effective_uid(),
        }
    }

    fn by_pid(pid: u32) -> ExpectedReceiver {
        ExpectedReceiver {
            pid: Some(pid),
            token: None,
        }
    }

    #[test]
    fn only_the_named_receiver_is_trusted() {
        let other = std::process::id() + 1;
        assert_eq!(
            check_receiver(peer(other), &by_pid(other)).unwrap().pid,
            other
        );
        let error = check_receiver(peer(other), &by_pid(other + 1))
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.contains(&format!("process {} (receiver_pid)", other + 1)),
            "{error}"
        );
        // Without a pid, any other process of this user.
        let anyone = ExpectedReceiver::default();
        assert_eq!(check_receiver(peer(other), &anyone).unwrap().pid, other);
        assert!(check_receiver(peer(std::process::id()), &anyone).is_err());
        // A process of another pid namespace (pid 0) only with a token for it.
        assert!(check_receiver(peer(0), &anyone).is_err());
        let with_token = ExpectedReceiver {
            pid: None,
            token: Some("ab".repeat(16)),
        };
        assert_eq!(check_receiver(peer(0), &with_token).unwrap().pid, 0);
        // Of another user, not even then.
        let stranger = socket::PeerCredentials {
            pid: 0,
            uid: socket::effective_uid() + 1,
        };
        if socket::effective_uid() != 0 {
            assert!(check_receiver(stranger, &with_token).is_err());
        }
    }

    #[test]
    fn a_token_is_32_to_128_hex_digits() {
        assert!(check_token(&"0f".repeat(16)).is_ok());
        assert!(check_token(&"A9".repeat(64)).is_ok());
        assert!(check_token(&"0f".repeat(15)).is_err());
        assert!(check_token(&"0f".repeat(65)).is_err());
        assert!(check_token(&format!("{}zz", "0f".repeat(16))).is_err());
    }
}
