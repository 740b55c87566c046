//! Firecracker's microVM metadata service (MMDS), V1 and V2, for gpuvm's Firecracker front
//! end. One concern per module:
//!
//! - [`data_store`]: the JSON store (PUT, PATCH as a merge patch, GET by path), bounded.
//! - [`token`]: V2 session tokens (`PUT /latest/api/token`), bounded and expiring.
//! - [`http`]: the guest's HTTP/1.1 requests, parsed with bounds, and the answers.
//! - [`ip`]: Ethernet, ARP and IPv4: which guest frames are for MMDS, ARP replies.
//! - [`tcp`]: the minimal TCP responder on port 80, bounded connections.
//! - [`persist`]: what a live update carries of it.
//!
//! The store, the tokens and the configuration are one VM's [`Mmds`], which its VMM's
//! controller owns (as `Arc<Mmds>`): the API's routes change it through the controller,
//! and the controller hands it to each virtio-net device it builds. A device that MMDS is
//! configured for takes an [`MmdsStack`] from it ([`Mmds::stack_for`]) when the guest
//! activates it, asks the stack whether each guest frame is for MMDS
//! ([`MmdsStack::intercept`]) and puts its reply frames ([`MmdsStack::next_reply`]) into
//! the guest's RX queue. Nothing the guest sends can panic it: malformed frames are
//! dropped, malformed requests answered 400.

pub mod data_store;
pub mod http;
pub mod ip;
pub mod persist;
pub mod tcp;
pub mod token;

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};

pub use data_store::{DataStore, DataStoreError, DEFAULT_SIZE_LIMIT};
pub use persist::{MmdsState, MmdsStateError};
pub use token::TokenAuthority;

/// The default MMDS address.
pub const DEFAULT_IPV4: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// Reply frames waiting for guest RX buffers, at most; past it the oldest go (TCP
/// answers are sent once, so a guest that posts no buffers loses its answers).
pub const MAX_PENDING_FRAMES: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MmdsVersion {
    V1,
    V2,
}

/// PUT /mmds/config.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmdsConfig {
    #[serde(default = "default_version")]
    pub version: MmdsVersion,
    pub network_interfaces: Vec<String>,
    #[serde(default = "default_ipv4")]
    pub ipv4_address: Ipv4Addr,
    #[serde(default)]
    pub imds_compat: bool,
}

fn default_version() -> MmdsVersion {
    MmdsVersion::V1
}

fn default_ipv4() -> Ipv4Addr {
    DEFAULT_IPV4
}

/// Why an MMDS configuration was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("the list of network interface IDs that allow forwarding MMDS requests is empty")]
    NoInterfaces,
    #[error("the MMDS IPv4 address {0} is not link-local (169.254.0.0/16)")]
    NotLinkLocal(Ipv4Addr),
    #[error("the MMDS IPv4 address {0} is a broadcast address")]
    Broadcast(Ipv4Addr),
}

impl MmdsConfig {
    pub fn new(version: MmdsVersion, network_interfaces: Vec<String>) -> Self {
        MmdsConfig {
            version,
            network_interfaces,
            ipv4_address: DEFAULT_IPV4,
            imds_compat: false,
        }
    }

    /// Firecracker's checks: interfaces named, a link-local unicast address.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.network_interfaces.is_empty() {
            return Err(ConfigError::NoInterfaces);
        }
        if !self.ipv4_address.is_link_local() {
            return Err(ConfigError::NotLinkLocal(self.ipv4_address));
        }
        if self.ipv4_address.octets()[2..] == [255, 255] {
            return Err(ConfigError::Broadcast(self.ipv4_address));
        }
        Ok(())
    }
}

/// One VM's MMDS: the store, the tokens, the configuration. Shared (`Arc<Mmds>`) by the
/// VMM's controller and the VM's network interfaces.
#[derive(Debug, Default)]
pub struct Mmds {
    store: Mutex<DataStore>,
    tokens: Mutex<TokenAuthority>,
    config: Mutex<Option<MmdsConfig>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Mmds {
    pub fn store(&self) -> MutexGuard<'_, DataStore> {
        lock(&self.store)
    }

    pub fn tokens(&self) -> MutexGuard<'_, TokenAuthority> {
        lock(&self.tokens)
    }

    pub fn config(&self) -> Option<MmdsConfig> {
        lock(&self.config).clone()
    }

    pub fn set_config(&self, config: Option<MmdsConfig>) {
        *lock(&self.config) = config;
    }

    /// The stack for the interface `iface_id`, if MMDS is configured for it.
    pub fn stack_for(self: &Arc<Self>, iface_id: &str) -> Option<MmdsStack> {
        let config = self.config()?;
        config
            .network_interfaces
            .iter()
            .any(|id| id == iface_id)
            .then(|| MmdsStack::new(self.clone(), config.ipv4_address))
    }
}

/// MMDS on one network interface: the frames it took, the frames it answers with.
#[derive(Debug)]
pub struct MmdsStack {
    mmds: Arc<Mmds>,
    address: Ipv4Addr,
    responder: tcp::Responder,
    pending: VecDeque<Vec<u8>>,
}

impl MmdsStack {
    pub fn new(mmds: Arc<Mmds>, address: Ipv4Addr) -> Self {
        MmdsStack {
            mmds,
            address,
            responder: tcp::Responder::default(),
            pending: VecDeque::new(),
        }
    }

    /// Whether the guest's `frame` (Ethernet, no virtio header) is for MMDS; if it is,
    /// MMDS took it (answers, if any, wait in [`MmdsStack::next_reply`]) and it must not
    /// go to the tap.
    pub fn intercept(&mut self, frame: &[u8]) -> bool {
        let mut replies = Vec::new();
        let taken = match ip::classify(frame, self.address) {
            ip::Frame::Other => false,
            ip::Frame::Malformed => true,
            ip::Frame::ArpRequest { reply } => {
                replies.push(reply);
                true
            }
            ip::Frame::Ipv4(packet) => {
                if packet.protocol == ip::PROTO_TCP {
                    if let Some(segment) = tcp::parse(packet.payload, packet.src, packet.dst) {
                        let mut out = tcp::Out {
                            guest_mac: packet.guest_mac,
                            guest_ip: packet.src,
                            mmds_ip: self.address,
                            frames: &mut replies,
                        };
                        self.responder.handle(&segment, &self.mmds, &mut out);
                    }
                }
                true
            }
        };
        for reply in replies {
            if self.pending.len() == MAX_PENDING_FRAMES {
                self.pending.pop_front();
            }
            self.pending.push_back(reply);
        }
        taken
    }

    pub fn has_replies(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn next_reply(&mut self) -> Option<Vec<u8>> {
        self.pending.pop_front()
    }

    /// Puts a reply back in front (no guest buffer could take it yet).
    pub fn unget_reply(&mut self, frame: Vec<u8>) {
        self.pending.push_front(frame);
    }

    pub fn connections(&self) -> usize {
        self.responder.connections()
    }
}

#[cfg(test)]
mod tests;
