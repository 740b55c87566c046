//! What the VMM's configuration says about a network interface, and MAC addresses.

use std::fmt;
use std::str::FromStr;

use crate::rate_limiter::RateLimiterConfig;

/// The most queue pairs a device accepts (each pair is one tap queue, two virtqueues and two
/// MSI-X vectors; 16 covers the vCPU counts gpuvm runs with).
pub const MAX_QUEUE_PAIRS: u16 = 16;
/// The largest virtqueue size accepted (split rings go up to 32768; bigger buys nothing for a
/// tap that queues 1000 frames itself).
pub const MAX_QUEUE_SIZE: u16 = 4096;
/// The smallest virtqueue size accepted.
pub const MIN_QUEUE_SIZE: u16 = 2;
/// The longest interface name Linux accepts (IFNAMSIZ less the terminating NUL).
pub const MAX_TAP_NAME_LEN: usize = libc::IFNAMSIZ - 1;
/// The longest `iface_id` accepted (it names the device in logs and metrics).
pub const MAX_IFACE_ID_LEN: usize = 64;

/// An Ethernet MAC address, written "aa:bb:cc:dd:ee:ff" in configurations and snapshots.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr([u8; 6]);

/// Why a MAC address string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MacAddrError {
    #[error("MAC address {0:?} is not six two-digit hex bytes separated by ':'")]
    Syntax(String),
    #[error("MAC address {0} is a multicast address; a guest NIC needs a unicast one")]
    Multicast(MacAddr),
    #[error("MAC address 00:00:00:00:00:00 is not a usable address")]
    Zero,
}

impl MacAddr {
    pub const LEN: usize = 6;

    /// A unicast address from its bytes, refusing multicast and all-zero ones.
    pub fn new(bytes: [u8; 6]) -> Result<Self, MacAddrError> {
        let mac = MacAddr(bytes);
        if bytes == [0; 6] {
            return Err(MacAddrError::Zero);
        }
        if bytes[0] & 0x01 != 0 {
            return Err(MacAddrError::Multicast(mac));
        }
        Ok(mac)
    }

    /// A locally administered unicast address derived from `seed` (the interface id), the
    /// same one every run, so a guest keeps its address (and its DHCP lease) across boots.
    pub fn derived_from(seed: &str) -> Self {
        // FNV-1a: stable across Rust releases, unlike std's DefaultHasher.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in seed.as_bytes() {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let h = hash.to_be_bytes();
        // Bit 1 of the first byte: locally administered; bit 0 clear: unicast. 0x06 keeps the
        // first byte away from 02:00:00 (often used by hand) while staying a valid LAA.
        MacAddr([0x06, h[0], h[1], h[2], h[3], h[4]])
    }

    pub fn bytes(&self) -> [u8; 6] {
        self.0
    }
}

impl FromStr for MacAddr {
    type Err = MacAddrError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let syntax = || MacAddrError::Syntax(text.chars().take(32).collect());
        let mut bytes = [0u8; 6];
        let mut parts = text.split(':');
        for byte in &mut bytes {
            let part = parts.next().ok_or_else(syntax)?;
            // from_str_radix alone would take "+f" or "f"; insist on exactly two hex digits.
            if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(syntax());
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| syntax())?;
        }
        if parts.next().is_some() {
            return Err(syntax());
        }
        MacAddr::new(bytes)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacAddr({self})")
    }
}

impl serde::Serialize for MacAddr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for MacAddr {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

fn default_queue_pairs() -> u16 {
    1
}

fn default_queue_size() -> u16 {
    256
}

/// One guest network interface backed by a tap.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Names the interface in the API, logs and metrics.
    pub iface_id: String,
    /// The tap to open by name; `None` when the taps come as file descriptors (passed over
    /// the API socket with SCM_RIGHTS, as Kata does for Cloud Hypervisor).
    #[serde(default)]
    pub host_dev_name: Option<String>,
    /// The guest's MAC; by default one derived from `iface_id` (see [`NetConfig::mac`]).
    #[serde(default)]
    pub guest_mac: Option<MacAddr>,
    /// RX/TX virtqueue pairs, one tap queue each; more than one offers VIRTIO_NET_F_MQ.
    #[serde(default = "default_queue_pairs")]
    pub num_queue_pairs: u16,
    /// The largest size of each RX and TX virtqueue (a power of two).
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// Limits what the device puts in the guest's RX queues (all pairs together).
    #[serde(default)]
    pub rx_rate_limiter: RateLimiterConfig,
    /// Limits what the device takes from the guest's TX queues (all pairs together).
    #[serde(default)]
    pub tx_rate_limiter: RateLimiterConfig,
}

/// Why a [`NetConfig`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum NetConfigError {
    #[error(
        "net: iface_id must be 1 to {MAX_IFACE_ID_LEN} characters of [A-Za-z0-9_.-], got {0:?}"
    )]
    IfaceId(String),
    #[error("net {iface_id}: host_dev_name {name:?} is not a Linux interface name (1 to {MAX_TAP_NAME_LEN} bytes, no '/', ':', whitespace or NUL)")]
    TapName { iface_id: String, name: String },
    #[error("net {iface_id}: num_queue_pairs {given} is outside 1..={MAX_QUEUE_PAIRS}")]
    QueuePairs { iface_id: String, given: u16 },
    #[error("net {iface_id}: queue_size {given} is not a power of two in {MIN_QUEUE_SIZE}..={MAX_QUEUE_SIZE}")]
    QueueSize { iface_id: String, given: u16 },
    #[error("net {iface_id}: {direction} rate limiter: {source}")]
    RateLimiter {
        iface_id: String,
        direction: &'static str,
        source: crate::rate_limiter::RateLimiterError,
    },
}

impl NetConfig {
    /// A configuration with the defaults for everything but the id and the tap name.
    pub fn new(iface_id: &str, host_dev_name: Option<&str>) -> Self {
        NetConfig {
            iface_id: iface_id.to_string(),
            host_dev_name: host_dev_name.map(str::to_string),
            guest_mac: None,
            num_queue_pairs: default_queue_pairs(),
            queue_size: default_queue_size(),
            rx_rate_limiter: RateLimiterConfig::default(),
            tx_rate_limiter: RateLimiterConfig::default(),
        }
    }

    /// The guest's MAC: the configured one, or one derived from `iface_id`.
    pub fn mac(&self) -> MacAddr {
        self.guest_mac
            .unwrap_or_else(|| MacAddr::derived_from(&self.iface_id))
    }

    /// Checks every field (the MAC was checked when it was parsed).
    pub fn validate(&self) -> Result<(), NetConfigError> {
        let id_ok = !self.iface_id.is_empty()
            && self.iface_id.len() <= MAX_IFACE_ID_LEN
            && self
                .iface_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !id_ok {
            return Err(NetConfigError::IfaceId(
                self.iface_id.chars().take(MAX_IFACE_ID_LEN + 1).collect(),
            ));
        }
        let iface_id = || self.iface_id.clone();
        if let Some(name) = &self.host_dev_name {
            if !is_valid_interface_name(name) {
                return Err(NetConfigError::TapName {
                    iface_id: iface_id(),
                    name: name.chars().take(MAX_TAP_NAME_LEN + 1).collect(),
                });
            }
        }
        if !(1..=MAX_QUEUE_PAIRS).contains(&self.num_queue_pairs) {
            return Err(NetConfigError::QueuePairs {
                iface_id: iface_id(),
                given: self.num_queue_pairs,
            });
        }
        if !(MIN_QUEUE_SIZE..=MAX_QUEUE_SIZE).contains(&self.queue_size)
            || !self.queue_size.is_power_of_two()
        {
            return Err(NetConfigError::QueueSize {
                iface_id: iface_id(),
                given: self.queue_size,
            });
        }
        for (direction, limiter) in [("rx", &self.rx_rate_limiter), ("tx", &self.tx_rate_limiter)] {
            limiter
                .validate()
                .map_err(|source| NetConfigError::RateLimiter {
                    iface_id: iface_id(),
                    direction,
                    source,
                })?;
        }
        Ok(())
    }
}

/// What Linux's dev_valid_name() accepts.
pub(crate) fn is_valid_interface_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TAP_NAME_LEN
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate_limiter::TokenBucketConfig;

    #[test]
    fn parses_and_prints_mac_addresses() {
        let mac: MacAddr = "06:aB:cd:00:11:ff".parse().unwrap();
        assert_eq!(mac.bytes(), [0x06, 0xab, 0xcd, 0x00, 0x11, 0xff]);
        assert_eq!(mac.to_string(), "06:ab:cd:00:11:ff");
        assert_eq!(mac.to_string().parse::<MacAddr>().unwrap(), mac);
    }

    #[test]
    fn refuses_malformed_mac_addresses() {
        for bad in [
            "",
            "06:ab:cd:00:11",
            "06:ab:cd:00:11:ff:00",
            "06:ab:cd:00:11:f",
            "06:ab:cd:00:11:fff",
            "06-ab-cd-00-11-ff",
            "06:ab:cd:00:11:+f",
            "06:ab:cd:00:11:gg",
            "06:ab:cd:00:11:ff:",
            "06:ab:cd:00::11ff",
            "０6:ab:cd:00:11:ff",
        ] {
            assert!(
                matches!(bad.parse::<MacAddr>(), Err(MacAddrError::Syntax(_))),
                "{bad:?} was accepted"
            );
        }
        assert_eq!(
            "00:00:00:00:00:00".parse::<MacAddr>(),
            Err(MacAddrError::Zero)
        );
        assert!(matches!(
            "01:00:5e:00:00:01".parse::<MacAddr>(),
            Err(MacAddrError::Multicast(_))
        ));
        assert!(matches!(
            "ff:ff:ff:ff:ff:ff".parse::<MacAddr>(),
            Err(MacAddrError::Multicast(_))
        ));
    }

    #[test]
    fn derived_mac_is_stable_local_and_unicast() {
        let a = MacAddr::derived_from("eth0");
        assert_eq!(a, MacAddr::derived_from("eth0"));
        assert_ne!(a, MacAddr::derived_from("eth1"));
        let first = a.bytes()[0];
        assert_eq!(first & 0x01, 0, "unicast");
        assert_eq!(first & 0x02, 0x02, "locally administered");
        assert!(MacAddr::new(a.bytes()).is_ok());
        // FNV-1a is fixed: this value must not change between releases (guests keep leases).
        assert_eq!(MacAddr::derived_from("").to_string(), "06:cb:f2:9c:e4:84");
    }

    #[test]
    fn config_defaults_and_serde() {
        let config: NetConfig =
            serde_json::from_str(r#"{"iface_id": "eth0", "host_dev_name": "tap0"}"#).unwrap();
        assert_eq!(config, NetConfig::new("eth0", Some("tap0")));
        assert_eq!(config.num_queue_pairs, 1);
        assert_eq!(config.queue_size, 256);
        assert_eq!(config.mac(), MacAddr::derived_from("eth0"));
        config.validate().unwrap();

        let config: NetConfig = serde_json::from_str(
            r#"{"iface_id": "eth0", "guest_mac": "06:00:00:00:00:01", "num_queue_pairs": 2,
                "rx_rate_limiter": {"bandwidth": {"size": 1000, "refill_time_ms": 100}}}"#,
        )
        .unwrap();
        assert_eq!(config.mac().bytes(), [6, 0, 0, 0, 0, 1]);
        assert_eq!(
            config.rx_rate_limiter.bandwidth,
            Some(TokenBucketConfig {
                size: 1000,
                one_time_burst: 0,
                refill_time_ms: 100
            })
        );
        let back: NetConfig =
            serde_json::from_value(serde_json::to_value(&config).unwrap()).unwrap();
        assert_eq!(back, config);

        assert!(serde_json::from_str::<NetConfig>(r#"{"iface_id": "a", "bogus": 1}"#).is_err());
        assert!(serde_json::from_str::<NetConfig>(
            r#"{"iface_id": "a", "guest_mac": "01:00:00:00:00:00"}"#
        )
        .is_err());
    }

    #[test]
    fn validation_refuses_bad_fields() {
        let good = NetConfig::new("eth0", Some("tap0"));
        good.validate().unwrap();
        let with = |edit: fn(&mut NetConfig)| {
            let mut config = good.clone();
            edit(&mut config);
            config.validate()
        };
        assert!(matches!(
            with(|c| c.iface_id.clear()),
            Err(NetConfigError::IfaceId(_))
        ));
        assert!(matches!(
            with(|c| c.iface_id = "a b".into()),
            Err(NetConfigError::IfaceId(_))
        ));
        assert!(matches!(
            with(|c| c.host_dev_name = Some("sixteen-chars-xx".into())),
            Err(NetConfigError::TapName { .. })
        ));
        assert!(matches!(
            with(|c| c.host_dev_name = Some("../tap".into())),
            Err(NetConfigError::TapName { .. })
        ));
        with(|c| c.host_dev_name = Some("fifteen-chars-x".into())).unwrap();
        assert!(matches!(
            with(|c| c.num_queue_pairs = 0),
            Err(NetConfigError::QueuePairs { .. })
        ));
        assert!(matches!(
            with(|c| c.num_queue_pairs = MAX_QUEUE_PAIRS + 1),
            Err(NetConfigError::QueuePairs { .. })
        ));
        assert!(matches!(
            with(|c| c.queue_size = 100),
            Err(NetConfigError::QueueSize { .. })
        ));
        assert!(matches!(
            with(|c| c.queue_size = 8192),
            Err(NetConfigError::QueueSize { .. })
        ));
        assert!(matches!(
            with(|c| c.tx_rate_limiter.ops = Some(TokenBucketConfig {
                size: 0,
                one_time_burst: 0,
                refill_time_ms: 10
            })),
            Err(NetConfigError::RateLimiter {
                direction: "tx",
                ..
            })
        ));
    }
}
