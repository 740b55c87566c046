//! The host's PCIe topology as sysfs shows it: for each passthrough device, the root
//! complex (host bridge) it sits under and the chain of bridges between, from which the
//! PCIe switches it sits behind and its GPUDirect clique follow.
//!
//! `/sys/bus/pci/devices/<bdf>` links into `/sys/devices/pci0000:40/0000:40:01.0/...`:
//! the first component after `devices/` names the root complex, each later one a bridge,
//! the last the device itself. A switch is an upstream port followed by a downstream
//! port; the ports' PCIe capability (in their `config` file) says which is which, and
//! where a `config` file is missing or short (a fake tree in tests, a restricted host)
//! the chain's shape says it instead: root port, then (upstream, downstream) pairs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The environment variable that points discovery at a fake sysfs tree (tests).
pub const TEST_SYSFS_ROOT_ENV: &str = "GPUVM_TEST_SYSFS_ROOT";

/// The largest clique id the GPUDirect capability can carry (4 bits).
pub const MAX_CLIQUE: u8 = 15;

/// PCIe capability port types (PCIe base spec, capability register bits 7:4).
const PORT_TYPE_ROOT: u8 = 0x4;
const PORT_TYPE_UPSTREAM: u8 = 0x5;
const PORT_TYPE_DOWNSTREAM: u8 = 0x6;

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("PCI device {bdf} not found under {root}: {source}")]
    NotFound {
        bdf: String,
        root: PathBuf,
        source: std::io::Error,
    },
    #[error("PCI device {bdf}: {path} is not under a PCI root complex (pciDDDD:BB)")]
    NoRootComplex { bdf: String, path: PathBuf },
}

/// Where one device sits in the host's PCIe tree.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Place {
    /// The host bridge, e.g. "pci0000:40".
    root_complex: String,
    /// The port the device's chain starts at under the root complex (usually a root port),
    /// None for a device on the root complex's own bus.
    root_port: Option<String>,
    /// Upstream ports of the switches above the device, outermost first.
    switches: Vec<String>,
}

/// The places of a set of devices, and the cliques derived from them.
#[derive(Clone, Debug, Default)]
pub struct HostTopology {
    /// In the order discovery was given the devices (clique numbering follows it).
    order: Vec<String>,
    places: BTreeMap<String, Place>,
    cliques: BTreeMap<String, u8>,
}

impl HostTopology {
    /// Reads each device's place; a device not found under `sysfs_root` is an error naming it.
    pub fn discover(sysfs_root: &Path, bdfs: &[String]) -> Result<HostTopology, TopologyError> {
        let mut topology = HostTopology::default();
        for bdf in bdfs {
            let bdf = normalize_bdf(bdf);
            if topology.places.contains_key(&bdf) {
                continue;
            }
            let place = read_place(sysfs_root, &bdf)?;
            topology.order.push(bdf.clone());
            topology.places.insert(bdf, place);
        }
        topology.number_cliques();
        Ok(topology)
    }

    /// The sysfs root to use: $GPUVM_TEST_SYSFS_ROOT when set, else /sys.
    pub fn default_root() -> PathBuf {
        match std::env::var_os(TEST_SYSFS_ROOT_ENV) {
            Some(root) if !root.is_empty() => PathBuf::from(root),
            _ => PathBuf::from("/sys"),
        }
    }

    /// An id of the PCIe switch (its upstream port's BDF) the device sits behind, if any.
    /// With switches nested, the one nearest the device (the one `nvidia-smi topo` calls
    /// PIX for two devices on it).
    pub fn switch_of(&self, bdf: &str) -> Option<String> {
        self.places
            .get(&normalize_bdf(bdf))
            .and_then(|place| place.switches.last().cloned())
    }

    /// The root complex (host bridge, e.g. "pci0000:40") the device is under.
    pub fn root_complex_of(&self, bdf: &str) -> Option<String> {
        self.places
            .get(&normalize_bdf(bdf))
            .map(|place| place.root_complex.clone())
    }

    /// The GPUDirect clique derived from the host: devices behind one switch, or under one
    /// root complex, share one; numbered 0.. in the order of `bdfs`.
    ///
    /// A device behind a switch shares its clique with the devices behind the same
    /// outermost switch (P2P then stays inside the switch tree); a device with no switch
    /// shares one with the other switchless devices of its root complex. None when the
    /// device is unknown or more groups than the capability's 16 ids exist.
    pub fn clique_of(&self, bdf: &str) -> Option<u8> {
        self.cliques.get(&normalize_bdf(bdf)).copied()
    }

    /// Short words for check-host, e.g. "switch 0000:40:01.0 (PIX with 0000:42:00.0),
    /// root complex pci0000:40, clique 0".
    pub fn describe(&self, bdf: &str) -> String {
        let bdf = normalize_bdf(bdf);
        let Some(place) = self.places.get(&bdf) else {
            return "not found in sysfs".to_string();
        };
        let mut words = Vec::new();
        match place.switches.last() {
            Some(switch) => {
                let peers = self.peers(&bdf, |other| other.switches.last() == Some(switch));
                words.push(format!("switch {switch}{}", with_peers("PIX", &peers)));
            }
            None => match &place.root_port {
                Some(port) => words.push(format!("no switch (port {port})")),
                None => words.push("no switch".to_string()),
            },
        }
        let peers = self.peers(&bdf, |other| {
            let same_switch =
                place.switches.last().is_some() && other.switches.last() == place.switches.last();
            other.root_complex == place.root_complex && !same_switch
        });
        words.push(format!(
            "root complex {}{}",
            place.root_complex,
            with_peers("PHB", &peers)
        ));
        match self.clique_of(&bdf) {
            Some(clique) => words.push(format!("clique {clique}")),
            None => words.push("no clique (more than 16 groups)".to_string()),
        }
        words.join(", ")
    }

    /// The other discovered devices whose place satisfies `same`, in discovery order.
    fn peers(&self, bdf: &str, same: impl Fn(&Place) -> bool) -> Vec<&str> {
        self.order
            .iter()
            .filter(|other| other.as_str() != bdf)
            .filter(|other| self.places.get(*other).is_some_and(&same))
            .map(String::as_str)
            .collect()
    }

    fn number_cliques(&mut self) {
        let mut ids: BTreeMap<String, u8> = BTreeMap::new();
        let mut next: u16 = 0;
        for bdf in &self.order {
            let place = &self.places[bdf];
            let key = match place.switches.first() {
                Some(switch) => format!("switch {switch}"),
                None => format!("root complex {}", place.root_complex),
            };
            let id = match ids.get(&key) {
                Some(id) => Some(*id),
                None if next <= u16::from(MAX_CLIQUE) => {
                    let id = next as u8;
                    next += 1;
                    ids.insert(key, id);
                    Some(id)
                }
                None => None,
            };
            if let Some(id) = id {
                self.cliques.insert(bdf.clone(), id);
            }
        }
    }
}

/// The GPUDirect cliques of one VM's devices as they are attached: an explicit clique
/// wins, else the clique is derived from the host device's place among the host devices
/// of every NVIDIA device attached before it, so a device added later (hot-plug) joins
/// the numbering of those before it instead of starting again at 0.
#[derive(Clone, Debug)]
pub struct CliqueAssigner {
    sysfs_root: PathBuf,
    /// Host devices that took part in derivation, in attach order.
    host_bdfs: Vec<String>,
}

impl Default for CliqueAssigner {
    fn default() -> Self {
        CliqueAssigner::new(HostTopology::default_root())
    }
}

impl CliqueAssigner {
    pub fn new(sysfs_root: PathBuf) -> Self {
        CliqueAssigner {
            sysfs_root,
            host_bdfs: Vec::new(),
        }
    }

    /// The clique for `device` (a name for logs): `explicit` when given, else derived
    /// from `host_bdf`'s place in the host's topology. None, logged with why, when there
    /// is no host device to derive from or sysfs does not know it.
    pub fn clique_for(
        &mut self,
        device: &str,
        explicit: Option<u8>,
        host_bdf: Option<&str>,
    ) -> Option<u8> {
        if let Some(clique) = explicit {
            return Some(clique);
        }
        let Some(host_bdf) = host_bdf else {
            log::info!(
                "{device}: no GPUDirect clique: none given and no host device to derive it from \
                 (a vfio-user device takes a host GPU's place with topology_bdf=)"
            );
            return None;
        };
        let host_bdf = normalize_bdf(host_bdf);
        let mut candidates = self.host_bdfs.clone();
        if !candidates.contains(&host_bdf) {
            candidates.push(host_bdf.clone());
        }
        match HostTopology::discover(&self.sysfs_root, &candidates) {
            Ok(topology) => {
                self.host_bdfs = candidates;
                let clique = topology.clique_of(&host_bdf);
                log::info!("{device}: host place {}", topology.describe(&host_bdf));
                clique
            }
            Err(error) => {
                log::warn!("{device}: no GPUDirect clique derived: {error}");
                None
            }
        }
    }

    /// Gives `device` the GPUDirect capability with the clique [`CliqueAssigner::clique_for`]
    /// picks, when it is an NVIDIA device (others neither get one nor take a number).
    /// Never fails the attach: a device the capability does not fit is logged and goes on
    /// without it.
    pub fn apply(
        &mut self,
        device: &mut crate::pci::VfioPciDevice,
        explicit: Option<u8>,
        host_bdf: Option<&str>,
    ) {
        let name = device.name().to_string();
        if device.pci_ids().0 != crate::pci::VENDOR_NVIDIA {
            if explicit.is_some() {
                log::warn!("{name}: not an NVIDIA device: the GPUDirect clique given is ignored");
            }
            return;
        }
        if let Some(clique) = self.clique_for(&name, explicit, host_bdf) {
            if let Err(error) = device.add_gpudirect_clique(clique) {
                log::warn!("{error}");
            }
        }
    }
}

fn with_peers(relation: &str, peers: &[&str]) -> String {
    if peers.is_empty() {
        String::new()
    } else {
        format!(" ({relation} with {})", peers.join(" "))
    }
}

/// "41:00.0" → "0000:41:00.0", lower case: sysfs names carry the domain.
pub fn normalize_bdf(bdf: &str) -> String {
    let bdf = bdf.trim().to_ascii_lowercase();
    if bdf.matches(':').count() == 1 {
        format!("0000:{bdf}")
    } else {
        bdf
    }
}

/// "DDDD:BB:DD.F" with hex digits.
fn is_bdf(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() == 12
        && bytes[4] == b':'
        && bytes[7] == b':'
        && bytes[10] == b'.'
        && bytes
            .iter()
            .enumerate()
            .filter(|(i, _)| ![4, 7, 10].contains(i))
            .all(|(_, b)| b.is_ascii_hexdigit())
}

/// "pciDDDD:BB": a host bridge's directory under /sys/devices.
fn is_root_complex(name: &str) -> bool {
    name.len() == 10
        && name.starts_with("pci")
        && name.as_bytes()[7] == b':'
        && name[3..7].bytes().all(|b| b.is_ascii_hexdigit())
        && name[8..].bytes().all(|b| b.is_ascii_hexdigit())
}

fn read_place(sysfs_root: &Path, bdf: &str) -> Result<Place, TopologyError> {
    let link = sysfs_root.join("bus/pci/devices").join(bdf);
    let path = std::fs::canonicalize(&link).map_err(|source| TopologyError::NotFound {
        bdf: bdf.to_string(),
        root: sysfs_root.to_path_buf(),
        source,
    })?;
    let names: Vec<&str> = path
        .components()
        .filter_map(|component| component.as_os_str().to_str())
        .collect();
    // The last host bridge on the path: a temporary directory's own name cannot fool it.
    let Some(host_bridge) = names.iter().rposition(|name| is_root_complex(name)) else {
        return Err(TopologyError::NoRootComplex {
            bdf: bdf.to_string(),
            path,
        });
    };
    // Bridge directories are the BDF-named components between the host bridge and the
    // device; the device's own directory is the last.
    let mut chain_dir = PathBuf::new();
    for name in &names[..=host_bridge] {
        chain_dir.push(name);
    }
    let mut bridges = Vec::new();
    let below = &names[host_bridge + 1..];
    for name in below.iter().take(below.len().saturating_sub(1)) {
        chain_dir.push(name);
        if is_bdf(name) {
            bridges.push((name.to_string(), port_type(&chain_dir)));
        }
    }
    let (root_port, switches) = classify(&bridges);
    Ok(Place {
        root_complex: names[host_bridge].to_string(),
        root_port,
        switches,
    })
}

/// Splits a device's bridge chain into its root port and its switches' upstream ports.
/// Port types read from config space decide when every bridge has one; otherwise the
/// chain's shape does (root port first, then upstream/downstream pairs).
fn classify(bridges: &[(String, Option<u8>)]) -> (Option<String>, Vec<String>) {
    let Some((first, _)) = bridges.first() else {
        return (None, Vec::new());
    };
    let all_typed = bridges.iter().all(|(_, kind)| kind.is_some());
    let switches = if all_typed {
        bridges
            .windows(2)
            .filter(|pair| {
                pair[0].1 == Some(PORT_TYPE_UPSTREAM) && pair[1].1 == Some(PORT_TYPE_DOWNSTREAM)
            })
            .map(|pair| pair[0].0.clone())
            .collect()
    } else {
        // Shape: an upstream port sits at each odd position with a downstream port after it.
        bridges
            .iter()
            .enumerate()
            .skip(1)
            .step_by(2)
            .filter(|(position, _)| position + 1 < bridges.len())
            .map(|(_, (bdf, _))| bdf.clone())
            .collect()
    };
    let root_port = match bridges[0].1 {
        Some(PORT_TYPE_ROOT) | None => Some(first.clone()),
        // A chain that starts at a switch (a host bridge with a switch on its own bus).
        Some(_) if all_typed => None,
        Some(_) => Some(first.clone()),
    };
    (root_port, switches)
}

/// The most of a `config` file read: PCIe extended configuration space.
const CONFIG_SPACE_BYTES: usize = 4096;

/// A bridge's PCIe port type from its `config` file, None when the file is missing,
/// short, or shows no PCIe capability. A `config` that is not a readable regular file of
/// at most 4 KiB is warned about and treated as missing: the chain's shape decides then.
fn port_type(device_dir: &Path) -> Option<u8> {
    let config = match crate::sysfs::read_bytes(&device_dir.join("config"), CONFIG_SPACE_BYTES) {
        Ok(config) => config,
        Err(error) if error.is_not_found() => return None,
        Err(error) => {
            log::warn!("PCIe topology: {error}; the bridge chain's shape decides its port type");
            return None;
        }
    };
    let byte = |offset: usize| config.get(offset).copied();
    const STATUS_CAPABILITY_LIST: u8 = 0x10;
    const CAP_ID_PCIE: u8 = 0x10;
    if byte(0x06)? & STATUS_CAPABILITY_LIST == 0 {
        return None;
    }
    let mut pointer = byte(0x34)? & 0xfc;
    // A capability list has at most 48 entries in 256 bytes; the bound stops a loop.
    for _ in 0..48 {
        if pointer < 0x40 {
            return None;
        }
        let at = usize::from(pointer);
        if byte(at)? == CAP_ID_PCIE {
            return Some((byte(at + 2)? >> 4) & 0xf);
        }
        pointer = byte(at + 1)? & 0xfc;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs tree in a temporary directory, removed on drop.
    struct FakeSysfs {
        root: PathBuf,
    }

    impl FakeSysfs {
        fn new(name: &str) -> FakeSysfs {
            let root =
                std::env::temp_dir().join(format!("gpuvm-topology-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
            FakeSysfs { root }
        }

        /// Adds a device at `chain` ("pci0000:40/0000:40:01.0/.../BDF"), linked from
        /// bus/pci/devices by a relative symlink as the kernel does.
        fn device(&self, chain: &str) {
            let dir = self.root.join("devices").join(chain);
            std::fs::create_dir_all(&dir).unwrap();
            let bdf = chain.rsplit('/').next().unwrap();
            std::os::unix::fs::symlink(
                Path::new("../../../devices").join(chain),
                self.root.join("bus/pci/devices").join(bdf),
            )
            .unwrap();
        }

        /// Writes a bridge's config space with a PCIe capability of `port_type` at 0x40.
        fn port(&self, chain: &str, port_type: u8) {
            let dir = self.root.join("devices").join(chain);
            std::fs::create_dir_all(&dir).unwrap();
            let mut config = vec![0u8; 256];
            config[0x06] = 0x10;
            config[0x34] = 0x40;
            config[0x40] = 0x10;
            config[0x42] = (port_type << 4) | 0x2;
            std::fs::write(dir.join("config"), config).unwrap();
        }
    }

    impl Drop for FakeSysfs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    fn bdfs(list: &[&str]) -> Vec<String> {
        list.iter().map(|bdf| bdf.to_string()).collect()
    }

    /// Two switches under one root complex (each on its own root port), two GPUs behind each.
    fn two_switches(tree: &FakeSysfs) {
        tree.device("pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:00.0/0000:43:00.0");
        tree.device("pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:01.0/0000:44:00.0");
        tree.device("pci0000:40/0000:40:02.0/0000:51:00.0/0000:52:00.0/0000:53:00.0");
        tree.device("pci0000:40/0000:40:02.0/0000:51:00.0/0000:52:01.0/0000:54:00.0");
    }

    #[test]
    fn two_switches_by_shape() {
        let tree = FakeSysfs::new("shape");
        two_switches(&tree);
        let gpus = bdfs(&["0000:43:00.0", "0000:53:00.0", "0000:44:00.0", "54:00.0"]);
        let topology = HostTopology::discover(&tree.root, &gpus).unwrap();
        assert_eq!(
            topology.switch_of("0000:43:00.0").as_deref(),
            Some("0000:41:00.0")
        );
        assert_eq!(
            topology.switch_of("0000:44:00.0").as_deref(),
            Some("0000:41:00.0")
        );
        assert_eq!(
            topology.switch_of("0000:53:00.0").as_deref(),
            Some("0000:51:00.0")
        );
        assert_eq!(
            topology.switch_of("0000:54:00.0").as_deref(),
            Some("0000:51:00.0")
        );
        for gpu in &gpus {
            assert_eq!(topology.root_complex_of(gpu).as_deref(), Some("pci0000:40"));
        }
        // Numbered in the order given: 43 first, then 53's switch.
        assert_eq!(topology.clique_of("0000:43:00.0"), Some(0));
        assert_eq!(topology.clique_of("0000:53:00.0"), Some(1));
        assert_eq!(topology.clique_of("0000:44:00.0"), Some(0));
        assert_eq!(topology.clique_of("0000:54:00.0"), Some(1));
        assert_eq!(
            topology.describe("0000:43:00.0"),
            "switch 0000:41:00.0 (PIX with 0000:44:00.0), root complex pci0000:40 \
             (PHB with 0000:53:00.0 0000:54:00.0), clique 0"
        );
    }

    #[test]
    fn port_types_from_config_decide_over_shape() {
        let tree = FakeSysfs::new("typed");
        two_switches(&tree);
        // The first chain typed as a switch; the second chain has the same shape but its
        // bridges are PCI bridges, not switch ports, so no switch.
        tree.port("pci0000:40/0000:40:01.0", PORT_TYPE_ROOT);
        tree.port("pci0000:40/0000:40:01.0/0000:41:00.0", PORT_TYPE_UPSTREAM);
        tree.port(
            "pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:00.0",
            PORT_TYPE_DOWNSTREAM,
        );
        tree.port("pci0000:40/0000:40:02.0", PORT_TYPE_ROOT);
        // PCI Express to PCI bridge (0x7) twice: not a switch, whatever the shape says.
        tree.port("pci0000:40/0000:40:02.0/0000:51:00.0", 0x7);
        tree.port("pci0000:40/0000:40:02.0/0000:51:00.0/0000:52:00.0", 0x8);
        let gpus = bdfs(&["0000:43:00.0", "0000:53:00.0"]);
        let topology = HostTopology::discover(&tree.root, &gpus).unwrap();
        assert_eq!(
            topology.switch_of("0000:43:00.0").as_deref(),
            Some("0000:41:00.0")
        );
        assert_eq!(topology.switch_of("0000:53:00.0"), None);
        assert_eq!(topology.clique_of("0000:43:00.0"), Some(0));
        assert_eq!(topology.clique_of("0000:53:00.0"), Some(1));
    }

    #[test]
    fn root_ports_of_one_root_complex_share_a_clique() {
        let tree = FakeSysfs::new("rootports");
        for port in 1..=4 {
            tree.device(&format!("pci0000:00/0000:00:0{port}.0/0000:0{port}:00.0"));
        }
        let gpus = bdfs(&[
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:03:00.0",
            "0000:04:00.0",
        ]);
        let topology = HostTopology::discover(&tree.root, &gpus).unwrap();
        for gpu in &gpus {
            assert_eq!(topology.switch_of(gpu), None);
            assert_eq!(topology.root_complex_of(gpu).as_deref(), Some("pci0000:00"));
            assert_eq!(topology.clique_of(gpu), Some(0));
        }
        assert_eq!(
            topology.describe("0000:02:00.0"),
            "no switch (port 0000:00:02.0), root complex pci0000:00 \
             (PHB with 0000:01:00.0 0000:03:00.0 0000:04:00.0), clique 0"
        );
    }

    #[test]
    fn two_root_complexes_two_cliques() {
        let tree = FakeSysfs::new("complexes");
        tree.device("pci0000:00/0000:00:01.0/0000:01:00.0");
        tree.device("pci0000:80/0000:80:01.0/0000:81:00.0");
        tree.device("pci0000:00/0000:00:02.0/0000:02:00.0");
        // A device on the host bridge's own bus.
        tree.device("pci0000:80/0000:80:05.0");
        let gpus = bdfs(&[
            "0000:81:00.0",
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:80:05.0",
        ]);
        let topology = HostTopology::discover(&tree.root, &gpus).unwrap();
        assert_eq!(
            topology.root_complex_of("0000:01:00.0").as_deref(),
            Some("pci0000:00")
        );
        assert_eq!(
            topology.root_complex_of("0000:81:00.0").as_deref(),
            Some("pci0000:80")
        );
        assert_eq!(topology.clique_of("0000:81:00.0"), Some(0));
        assert_eq!(topology.clique_of("0000:01:00.0"), Some(1));
        assert_eq!(topology.clique_of("0000:02:00.0"), Some(1));
        assert_eq!(topology.clique_of("0000:80:05.0"), Some(0));
        assert_eq!(
            topology.describe("0000:80:05.0"),
            "no switch, root complex pci0000:80 (PHB with 0000:81:00.0), clique 0"
        );
    }

    #[test]
    fn nested_switches_share_the_outer_switch_clique() {
        let tree = FakeSysfs::new("nested");
        let outer = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0";
        tree.device(&format!("{outer}/0000:03:00.0/0000:04:00.0/0000:05:00.0"));
        tree.device(&format!("{outer}/0000:03:00.0/0000:04:01.0/0000:06:00.0"));
        tree.device("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:07:00.0");
        let gpus = bdfs(&["0000:05:00.0", "0000:06:00.0", "0000:07:00.0"]);
        let topology = HostTopology::discover(&tree.root, &gpus).unwrap();
        assert_eq!(
            topology.switch_of("0000:05:00.0").as_deref(),
            Some("0000:03:00.0")
        );
        assert_eq!(
            topology.switch_of("0000:07:00.0").as_deref(),
            Some("0000:01:00.0")
        );
        for gpu in &gpus {
            assert_eq!(topology.clique_of(gpu), Some(0));
        }
    }

    #[test]
    fn a_missing_device_is_an_error_naming_it() {
        let tree = FakeSysfs::new("missing");
        tree.device("pci0000:00/0000:00:01.0/0000:01:00.0");
        let error = HostTopology::discover(&tree.root, &bdfs(&["0000:01:00.0", "0000:09:00.0"]))
            .unwrap_err();
        assert!(matches!(error, TopologyError::NotFound { ref bdf, .. } if bdf == "0000:09:00.0"));
        assert!(error.to_string().contains("0000:09:00.0"), "{error}");
    }

    #[test]
    fn a_link_outside_any_root_complex_is_an_error() {
        let tree = FakeSysfs::new("noroot");
        std::fs::create_dir_all(tree.root.join("devices/platform/0000:01:00.0")).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/platform/0000:01:00.0",
            tree.root.join("bus/pci/devices/0000:01:00.0"),
        )
        .unwrap();
        let error = HostTopology::discover(&tree.root, &bdfs(&["0000:01:00.0"])).unwrap_err();
        assert!(
            matches!(error, TopologyError::NoRootComplex { .. }),
            "{error}"
        );
    }

    #[test]
    fn the_assigner_keeps_numbering_across_later_devices() {
        let tree = FakeSysfs::new("assigner");
        two_switches(&tree);
        let mut assigner = CliqueAssigner::new(tree.root.clone());
        assert_eq!(
            assigner.clique_for("a", None, Some("0000:53:00.0")),
            Some(0)
        );
        assert_eq!(assigner.clique_for("b", None, Some("43:00.0")), Some(1));
        // An explicit clique wins and takes no place in the numbering.
        assert_eq!(
            assigner.clique_for("c", Some(7), Some("0000:44:00.0")),
            Some(7)
        );
        assert_eq!(
            assigner.clique_for("d", None, Some("0000:44:00.0")),
            Some(1)
        );
        assert_eq!(
            assigner.clique_for("e", None, Some("0000:54:00.0")),
            Some(0)
        );
        // Unknown to sysfs, or nothing to derive from: no clique, and no harm to the rest.
        assert_eq!(assigner.clique_for("f", None, Some("0000:99:00.0")), None);
        assert_eq!(assigner.clique_for("g", None, None), None);
        assert_eq!(
            assigner.clique_for("h", None, Some("0000:53:00.0")),
            Some(0)
        );
    }

    #[test]
    fn more_groups_than_clique_ids_leave_the_rest_without() {
        let tree = FakeSysfs::new("many");
        let mut gpus = Vec::new();
        for complex in 0..17u8 {
            let bdf = format!("{complex:04x}:01:00.0");
            tree.device(&format!("pci{complex:04x}:00/{complex:04x}:00:01.0/{bdf}"));
            gpus.push(bdf);
        }
        let topology = HostTopology::discover(&tree.root, &gpus).unwrap();
        assert_eq!(topology.clique_of(&gpus[15]), Some(15));
        assert_eq!(topology.clique_of(&gpus[16]), None);
        assert!(topology.describe(&gpus[16]).contains("no clique"));
        assert_eq!(topology.describe("0000:99:00.0"), "not found in sysfs");
    }

    #[test]
    fn a_hostile_config_file_falls_back_to_the_shape_in_bounded_time() {
        use crate::sysfs::hostile::Hostile;
        for hostile in Hostile::ALL {
            let tree = FakeSysfs::new(&format!("hostile-{hostile:?}"));
            two_switches(&tree);
            // The root port is typed, the upstream port's config is hostile: the chain is
            // not fully typed, so its shape decides, and finds the switch as untyped.
            tree.port("pci0000:40/0000:40:01.0", PORT_TYPE_ROOT);
            let upstream = tree
                .root
                .join("devices/pci0000:40/0000:40:01.0/0000:41:00.0");
            hostile.create(&upstream.join("config")).unwrap();
            let started = std::time::Instant::now();
            let topology =
                HostTopology::discover(&tree.root, &bdfs(&["0000:43:00.0", "0000:53:00.0"]))
                    .unwrap();
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{hostile:?}"
            );
            assert_eq!(
                topology.switch_of("0000:43:00.0").as_deref(),
                Some("0000:41:00.0"),
                "{hostile:?}"
            );
            assert_eq!(topology.clique_of("0000:53:00.0"), Some(1), "{hostile:?}");
        }
    }

    #[test]
    fn a_device_link_in_a_loop_is_an_error_naming_the_device() {
        let tree = FakeSysfs::new("linkloop");
        let devices = tree.root.join("bus/pci/devices");
        std::os::unix::fs::symlink(devices.join("0000:02:00.0"), devices.join("0000:01:00.0"))
            .unwrap();
        std::os::unix::fs::symlink(devices.join("0000:01:00.0"), devices.join("0000:02:00.0"))
            .unwrap();
        let error = HostTopology::discover(&tree.root, &bdfs(&["0000:01:00.0"])).unwrap_err();
        assert!(matches!(error, TopologyError::NotFound { .. }), "{error}");
        assert!(error.to_string().contains("0000:01:00.0"), "{error}");
    }
}
