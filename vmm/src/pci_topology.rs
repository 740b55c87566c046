//! Where cold-plugged passthrough devices sit in the guest's PCI hierarchy.
//!
//! `flat` puts every device on bus 0 (the layout from before topologies). `host` mirrors
//! the host: each device whose host place is known (a kernel VFIO device is its own host
//! address; a vfio-user device takes the place of its `topology_bdf`) gets a PCIe root
//! port of its own on bus 0, and devices behind one host PCIe switch sit behind one
//! virtual switch (root port → upstream port → a downstream port per device), so the
//! guest sees what `nvidia-smi topo -m` shows on the host (PIX within a switch, PHB
//! across root ports) and NCCL finds the shared switch. `host` is the default when any
//! device with a known host place sits behind a host PCIe switch (there is something to
//! mirror); a VM whose devices hang straight off host root ports stays flat unless asked,
//! which keeps single-device VMs and the guests that look for them on bus 0 as they were.
//!
//! Devices with no known host place stay on bus 0 under `host` too: there is nothing of
//! the host to mirror, a root port would only cost a bus and 1 MiB-granular windows, and
//! guests and tests that look for them on bus 0 keep working.
//!
//! Empty root ports for hot-plug (`--pcie-root-ports N`, Kata's `pcie_root_port`) come
//! after that layout: each has a bus and windows of its own and a PCIe native hot-plug
//! slot ([`add_hotplug_ports`]); crate::hotplug plugs devices into them.
//!
//! A snapshot keeps every port (its place, registers and, for a root port, its ranges of
//! the root's windows: [`SavedTopologyPort`], [`SavedHotplugPort`]); a restore checks
//! them against each other and the segment's windows ([`check_saved_ports`]) before any
//! is built, then rebuilds them in place before the devices behind them come back. The
//! cold-plugged vfio-user devices behind a host-mirroring layout's ports are saved through
//! VFIO migration as hot-plugged ones are, and restored at their paths.
//!
//! gpuvm acts as firmware: bus numbers are handed out depth first from 1, and each port's
//! windows are sized to hold exactly the BARs behind it (1 MiB granular, aligned to the
//! largest BAR), each root port's windows taken from the root's 32-bit and 64-bit BAR
//! windows; devices get their BARs inside. 64-bit prefetchable BARs go in the prefetchable
//! window above 4 GiB, all others in the memory window below (a bridge's non-prefetchable
//! window is 32-bit).

use std::sync::{Arc, Mutex};

use gpuvm_devices::pci::bridge::PciBridgeState;
use gpuvm_devices::pci::bridge::WINDOW_GRANULE;
use gpuvm_devices::pci::{
    intx_gsi, BarKind, BarSpec, BridgeSetup, MsiRouting, PciBdf, PciBridge, PciDevice, PciError,
    PciRoot, PciRootState, PortKind, SavedRange, Window,
};
use gpuvm_devices::Persist;
use gpuvm_vfio::topology::{HostTopology, TopologyError};

use crate::config::{PciOptions, PciTopology};

#[derive(Debug, thiserror::Error)]
pub enum PciTopologyError {
    #[error("--pci-topology host: cannot read the host's PCIe topology: {0}")]
    Host(#[from] TopologyError),
    #[error("--pci-topology host: the ports and devices need more than 255 PCI buses")]
    TooManyBuses,
    #[error("--pci-topology host: bus 0 has no free slot for another root port")]
    NoSlot,
    #[error("--pci-topology host: {0}")]
    Bus(#[from] PciError),
    #[error("--pcie-root-ports {0}: at most {MAX_HOTPLUG_PORTS} root ports for hot-plug")]
    TooManyHotplugPorts(u8),
    #[error("--pcie-root-ports: no MSI for a root port: {0}")]
    HotplugPortMsi(#[source] std::io::Error),
    #[error("the snapshot's root port {index} for hot-plug cannot be rebuilt: {reason}")]
    SavedPort { index: u8, reason: String },
    #[error("the snapshot's {port} cannot be restored: {reason}")]
    SavedLayout { port: String, reason: String },
    #[error("--pcie-root-ports: cannot add root port {index}: {source}")]
    HotplugPort {
        index: u8,
        #[source]
        source: PciError,
    },
}

/// Each empty root port's prefetchable (64-bit) window: room for one GPU's 64-bit BARs
/// (an H200's 256 GiB BAR1 and its 32 MiB BAR3 need the whole of it, rounded up as the
/// planner rounds a port's window). The address-space planner reserves it per port as it
/// reserves a cold-plugged device's BARs.
pub const HOTPLUG_PORT_PREFETCHABLE: u64 = 512 << 30;
/// Each empty root port's 32-bit memory window: a GPU's register BAR (16 MiB on current
/// NVIDIA GPUs) with room to spare, out of the root's 512 MiB 32-bit window.
pub const HOTPLUG_PORT_MEMORY: u64 = 32 << 20;
/// How many empty root ports a VM may ask for (they take bus-0 slots and 32-bit window).
pub const MAX_HOTPLUG_PORTS: u8 = 8;

/// An empty root port with a hot-plug slot (`--pcie-root-ports`), for PUT /gpus/{id}.
pub struct HotplugPort {
    /// Its slot on bus 0.
    pub slot: u8,
    pub bridge: Arc<Mutex<PciBridge>>,
    /// The ranges of the root's windows it was given (the guest may reprogram its
    /// registers; these stay its own).
    pub memory: Window,
    pub prefetchable: Window,
}

/// A root port for hot-plug as a snapshot keeps it: its bus-0 slot, the ranges of the
/// root's windows it holds, and its registers (bus numbers and windows as the guest left
/// them, the slot's control and status, its MSI). A restore rebuilds it in the same slot
/// ([`restore_hotplug_ports`]); the device in it, if any, comes back by its own state.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedHotplugPort {
    pub slot: u8,
    /// (base, size) of its 32-bit and 64-bit (prefetchable) windows.
    pub memory: (u64, u64),
    pub prefetchable: (u64, u64),
    pub registers: PciBridgeState,
}

impl HotplugPort {
    /// What a snapshot keeps of it.
    pub fn save(&self) -> SavedHotplugPort {
        let registers = self
            .bridge
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .registers();
        SavedHotplugPort {
            slot: self.slot,
            memory: (self.memory.base, self.memory.size),
            prefetchable: (self.prefetchable.base, self.prefetchable.size),
            registers,
        }
    }
}

/// A hot-plug port's MSI: its GSI, the irqfd that raises it, and the routing of the GSI.
type PortMsi = (u32, vmm_sys_util::eventfd::EventFd, Arc<dyn MsiRouting>);

/// A GSI of `router` and its irqfd for a root port's MSI.
fn port_msi(
    router: Option<&Arc<crate::interrupts::MsiRouter>>,
) -> Result<Option<PortMsi>, PciTopologyError> {
    let Some(router) = router else {
        return Ok(None);
    };
    let (gsi, trigger) = router
        .allocate(1)
        .map_err(PciTopologyError::HotplugPortMsi)?
        .pop()
        .ok_or_else(|| PciTopologyError::HotplugPortMsi(std::io::Error::other("no GSI")))?;
    let routing: Arc<dyn MsiRouting> = router.clone();
    Ok(Some((gsi, trigger, routing)))
}

/// Rebuilds the root ports for hot-plug a snapshot saved (`saved`, see
/// [`SavedHotplugPort`]) in `root`, restored from the same snapshot: each in its slot,
/// holding the same ranges of the root's windows (the restored allocators have them
/// taken already), with its registers as the guest left them and a new MSI of `router`
/// routed to the message the guest programmed.
pub fn restore_hotplug_ports(
    root: &Arc<PciRoot>,
    saved: &[SavedHotplugPort],
    router: Option<&Arc<crate::interrupts::MsiRouter>>,
) -> Result<Vec<HotplugPort>, PciTopologyError> {
    if saved.len() > usize::from(MAX_HOTPLUG_PORTS) {
        return Err(PciTopologyError::TooManyHotplugPorts(
            u8::try_from(saved.len()).unwrap_or(u8::MAX),
        ));
    }
    let config = root.config();
    let mut ports = Vec::new();
    for (index, port) in saved.iter().enumerate() {
        let index = index as u8;
        let bad = |reason: String| PciTopologyError::SavedPort { index, reason };
        let memory = Window {
            base: port.memory.0,
            size: port.memory.1,
        };
        let prefetchable = Window {
            base: port.prefetchable.0,
            size: port.prefetchable.1,
        };
        let inside = |window: Window, start: u64, end: u64| {
            window.size > 0
                && window.base >= start
                && window
                    .base
                    .checked_add(window.size)
                    .is_some_and(|e| e <= end)
        };
        let mmio64_end = config.mmio64_start.saturating_add(config.mmio64_size);
        if !inside(memory, config.mmio32_start, config.mmio32_end)
            || !inside(prefetchable, config.mmio64_start, mmio64_end)
        {
            return Err(bad(format!(
                "its windows {:#x}+{:#x} and {:#x}+{:#x} are not inside the root's",
                memory.base, memory.size, prefetchable.base, prefetchable.size
            )));
        }
        let bus = |offset: u16| port.registers.config.get(usize::from(offset)).copied();
        let (Some(secondary), Some(subordinate)) = (
            bus(gpuvm_devices::pci::bridge::regs::SECONDARY_BUS),
            bus(gpuvm_devices::pci::bridge::regs::SUBORDINATE_BUS),
        ) else {
            return Err(bad("its registers are cut short".into()));
        };
        let mut bridge = PciBridge::new(&BridgeSetup {
            kind: PortKind::RootPort,
            primary_bus: 0,
            secondary_bus: secondary,
            subordinate_bus: subordinate,
            memory,
            prefetchable,
            slot: u16::from(secondary),
            occupied: false,
        });
        // The hot-plug slot's writable bits and MSI first; the registers then say what
        // the guest made of them.
        bridge.make_hotplug_slot(port_msi(router)?);
        bridge
            .restore(&port.registers)
            .map_err(|e| bad(e.to_string()))?;
        if !bridge.is_hotplug_slot() {
            return Err(bad("its registers are not a hot-plug slot's".into()));
        }
        let bridge = Arc::new(Mutex::new(bridge));
        let windows = vec![
            (true, prefetchable.base, prefetchable.size),
            (false, memory.base, memory.size),
        ];
        root.add_port(port.slot, bridge.clone(), windows)
            .map_err(|e| bad(format!("slot {:#04x}: {e}", port.slot)))?;
        log::info!(
            "PCI 00:{:02x}.0: root port with a hot-plug slot restored (bus {secondary:02x})",
            port.slot
        );
        ports.push(HotplugPort {
            slot: port.slot,
            bridge,
            memory,
            prefetchable,
        });
    }
    Ok(ports)
}

/// A port of a host-mirroring layout as a snapshot keeps it: a root port on bus 0 or a
/// switch's upstream or downstream port behind one (built at boot by [`Placement`]),
/// with its registers as the guest left them (bus numbers, windows, enables). A restore
/// rebuilds every one in place ([`restore_topology_ports`]) before the devices behind
/// them come back.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedTopologyPort {
    /// Its path from bus 0 (see `PciRoot::add_behind`): a root port's is its bus-0 slot.
    pub path: Vec<u8>,
    /// The ranges of the root's windows a root port holds (taken out of the saved root's
    /// slots, which keep them taken in its windows' bookkeeping); none behind a root port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<SavedRange>,
    pub registers: PciBridgeState,
}

/// The ports of `root`'s host-mirroring layout for a snapshot, parents first: every
/// bridge that is not a root port for hot-plug (those are [`SavedHotplugPort`]s). The
/// root ports' slots leave `state` (the root's saved allocations) with their ranges,
/// which a restore gives back to them in [`restore_topology_ports`].
pub fn save_topology_ports(root: &PciRoot, state: &mut PciRootState) -> Vec<SavedTopologyPort> {
    fn registers_of(root: &PciRoot, path: &[u8]) -> Option<PciBridgeState> {
        let device = root.device_at(path)?;
        let device = device.lock().unwrap_or_else(|e| e.into_inner());
        let bridge = device.as_bridge()?;
        (!bridge.is_hotplug_slot()).then(|| bridge.registers())
    }
    fn walk(root: &PciRoot, path: &mut Vec<u8>, ports: &mut Vec<SavedTopologyPort>) {
        for number in 0..32u8 {
            path.push(number);
            if let Some(registers) = registers_of(root, path) {
                ports.push(SavedTopologyPort {
                    path: path.clone(),
                    ranges: Vec::new(),
                    registers,
                });
                walk(root, path, ports);
            }
            path.pop();
        }
    }
    let mut ports = Vec::new();
    for slot in 1..32u8 {
        let Some(registers) = registers_of(root, &[slot]) else {
            continue;
        };
        let ranges = match state.slots.iter().position(|saved| saved.slot == slot) {
            Some(at) => state.slots.remove(at).ranges,
            None => Vec::new(),
        };
        ports.push(SavedTopologyPort {
            path: vec![slot],
            ranges,
            registers,
        });
        walk(root, &mut vec![slot], &mut ports);
    }
    ports
}

/// The address windows of a PCI segment ports must lie in: [start, end) of its 32-bit
/// and of its 64-bit window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentWindows {
    pub mmio32: (u64, u64),
    pub mmio64: (u64, u64),
}

impl SegmentWindows {
    /// The windows a saved root's allocators cover.
    pub fn of_state(state: &PciRootState) -> Self {
        SegmentWindows {
            mmio32: (state.mmio32.start, state.mmio32.end),
            mmio64: (state.mmio64.start, state.mmio64.end),
        }
    }
}

/// Where a saved port or device sits, for the checks of [`check_saved_ports`].
struct PortView {
    name: String,
    kind: PortKind,
    path: Vec<u8>,
    primary: u8,
    secondary: u8,
    subordinate: u8,
    memory: Window,
    prefetchable: Window,
    /// Ranges of the root's windows it holds: (64-bit, window).
    ranges: Vec<(bool, Window)>,
}

/// A bridge of the saved kind with the saved registers, to read them as the guest left
/// them; an error says why they do not make one.
fn bridge_of(registers: &PciBridgeState) -> Result<PciBridge, String> {
    let mut bridge = PciBridge::new(&BridgeSetup {
        kind: registers.kind,
        primary_bus: 0,
        secondary_bus: 0,
        subordinate_bus: 0,
        memory: Window::default(),
        prefetchable: Window::default(),
        slot: 0,
        occupied: true,
    });
    bridge
        .restore(registers)
        .map_err(|e| format!("its registers: {e}"))?;
    Ok(bridge)
}

fn kind_name(kind: PortKind) -> &'static str {
    match kind {
        PortKind::RootPort => "root port",
        PortKind::SwitchUpstream => "switch upstream port",
        PortKind::SwitchDownstream => "switch downstream port",
    }
}

fn show(window: Window) -> String {
    format!(
        "{:#x}..{:#x}",
        window.base,
        window.base.saturating_add(window.size)
    )
}

fn overlap(a: Window, b: Window) -> bool {
    a.size > 0
        && b.size > 0
        && a.base < b.base.saturating_add(b.size)
        && b.base < a.base.saturating_add(a.size)
}

fn inside(inner: Window, (start, end): (u64, u64)) -> bool {
    inner.base >= start && inner.base.checked_add(inner.size).is_some_and(|e| e <= end)
}

/// Checks the PCIe ports a snapshot holds before any is built: the root ports for
/// hot-plug (`hotplug`), the ports of a host-mirroring layout (`topology`) and the
/// devices placed behind them (`devices`: a name and the path of each). Every port's
/// registers must make a port of its kind; each port sits on the bus its parent forwards
/// to (a root port on bus 0, in a slot of its own and of no device in `bus0`, the slots
/// the saved root keeps); bus ranges nest inside the parent's and do not overlap a
/// sibling's; open windows lie inside the segment's (`windows`), inside the parent's,
/// and clear of the siblings'; the ranges root ports hold of the root's windows lie
/// inside those windows, clear of each other and of the devices' on bus 0; and each
/// device behind a port points to a port that leads to a slot. A damaged or hostile
/// state is refused naming the port and the numbers.
pub fn check_saved_ports(
    windows: SegmentWindows,
    bus0: &[gpuvm_devices::pci::SlotState],
    hotplug: &[SavedHotplugPort],
    topology: &[SavedTopologyPort],
    devices: &[(String, Vec<u8>)],
) -> Result<(), PciTopologyError> {
    let named = |path: &[u8], kind: PortKind, hot: bool| match path {
        [slot] if hot => format!("root port for hot-plug 00:{slot:02x}.0"),
        [slot] => format!("{} 00:{slot:02x}.0", kind_name(kind)),
        _ => format!("{} at {path:?} (path from bus 0)", kind_name(kind)),
    };
    let mut views = Vec::new();
    let inputs = (hotplug.iter())
        .map(|port| {
            let ranges = vec![
                (
                    true,
                    Window {
                        base: port.prefetchable.0,
                        size: port.prefetchable.1,
                    },
                ),
                (
                    false,
                    Window {
                        base: port.memory.0,
                        size: port.memory.1,
                    },
                ),
            ];
            (vec![port.slot], &port.registers, ranges, true)
        })
        .chain(topology.iter().map(|port| {
            let ranges = (port.ranges.iter())
                .map(|range| {
                    (
                        range.wide,
                        Window {
                            base: range.base,
                            size: range.size,
                        },
                    )
                })
                .collect();
            (port.path.clone(), &port.registers, ranges, false)
        }));
    for (path, registers, ranges, hot) in inputs {
        let name = named(&path, registers.kind, hot);
        let bad = |reason: String| PciTopologyError::SavedLayout {
            port: name.clone(),
            reason,
        };
        let bridge = bridge_of(registers).map_err(bad)?;
        if path.is_empty() || path.len() > 8 || path.iter().any(|&n| n >= 32) || path[0] == 0 {
            return Err(bad(format!(
                "its path from bus 0 {path:?} is no place for a port"
            )));
        }
        let root_port = registers.kind == PortKind::RootPort;
        if root_port != (path.len() == 1) {
            return Err(bad(format!(
                "a {} cannot sit at {path:?} (root ports go on bus 0, switch ports behind them)",
                kind_name(registers.kind)
            )));
        }
        if !hot && bridge.is_hotplug_slot() {
            return Err(bad("its registers are a hot-plug slot's".into()));
        }
        if !root_port && !ranges.is_empty() {
            return Err(bad(
                "it holds ranges of the root's windows behind a root port".into(),
            ));
        }
        let (secondary, subordinate) = bridge.buses();
        let primary = registers.config[usize::from(gpuvm_devices::pci::bridge::regs::PRIMARY_BUS)];
        views.push(PortView {
            name,
            kind: registers.kind,
            path,
            primary,
            secondary,
            subordinate,
            memory: bridge.memory_window(),
            prefetchable: bridge.prefetchable_window(),
            ranges,
        });
    }
    let segment = |wide: bool| {
        if wide {
            ("64-bit", windows.mmio64)
        } else {
            ("32-bit", windows.mmio32)
        }
    };
    for (index, port) in views.iter().enumerate() {
        let bad = |reason: String| PciTopologyError::SavedLayout {
            port: port.name.clone(),
            reason,
        };
        if views[..index].iter().any(|other| other.path == port.path) {
            return Err(bad(format!(
                "the snapshot has two ports at {:?}",
                port.path
            )));
        }
        if let [slot] = port.path[..] {
            if bus0.iter().any(|device| device.slot == slot) {
                return Err(bad(format!(
                    "the saved bus 0 has another function in slot {slot:#04x}"
                )));
            }
        }
        // The bus it sits on: bus 0, or the one its parent forwards to.
        let (parent_bus, parent_subordinate, parent) = match port.path.len() {
            1 => (0, 255, None),
            n => {
                let Some(parent) = views.iter().find(|p| p.path[..] == port.path[..n - 1]) else {
                    return Err(bad(format!(
                        "no saved port leads to it: there is none at {:?}",
                        &port.path[..n - 1]
                    )));
                };
                let allowed = match parent.kind {
                    PortKind::SwitchUpstream => port.kind == PortKind::SwitchDownstream,
                    _ => port.kind == PortKind::SwitchUpstream && port.path[n - 1] == 0,
                };
                if !allowed {
                    return Err(bad(format!(
                        "a {} cannot sit as device {} behind the {}",
                        kind_name(port.kind),
                        port.path[n - 1],
                        parent.name
                    )));
                }
                (parent.secondary, parent.subordinate, Some(parent))
            }
        };
        if port.primary != parent_bus {
            return Err(bad(format!(
                "its primary bus {:#04x} is not bus {parent_bus:#04x}, where it sits",
                port.primary
            )));
        }
        if port.secondary <= parent_bus
            || port.subordinate < port.secondary
            || port.subordinate > parent_subordinate
        {
            return Err(bad(format!(
                "its buses {:#04x}..={:#04x} do not lie behind bus {parent_bus:#04x} within \
                 {:#04x}..={parent_subordinate:#04x}",
                port.secondary,
                port.subordinate,
                parent_bus.saturating_add(1)
            )));
        }
        for (what, window) in [("memory", port.memory), ("prefetchable", port.prefetchable)] {
            if window.size == 0 {
                continue;
            }
            // A prefetchable window may lie below 4 GiB too.
            let fits = inside(window, windows.mmio32)
                || (what == "prefetchable" && inside(window, windows.mmio64));
            if !fits {
                return Err(bad(format!(
                    "its {what} window {} lies outside the segment's windows (32-bit {:#x}..{:#x}, \
                     64-bit {:#x}..{:#x})",
                    show(window),
                    windows.mmio32.0,
                    windows.mmio32.1,
                    windows.mmio64.0,
                    windows.mmio64.1
                )));
            }
            if let Some(parent) = parent {
                let outer = if what == "memory" {
                    parent.memory
                } else {
                    parent.prefetchable
                };
                if !(outer.size > 0 && inside(window, (outer.base, outer.end()))) {
                    return Err(bad(format!(
                        "its {what} window {} lies outside the {}'s, {}",
                        show(window),
                        parent.name,
                        show(outer)
                    )));
                }
            }
        }
        for &(wide, range) in &port.ranges {
            let (which, (start, end)) = segment(wide);
            if range.size == 0 || !inside(range, (start, end)) {
                return Err(bad(format!(
                    "the range {} of the {which} window it holds lies outside that window \
                     ({start:#x}..{end:#x})",
                    show(range)
                )));
            }
            let devices_ranges = bus0
                .iter()
                .flat_map(|device| device.ranges.iter().map(move |r| (device.slot, r)));
            for (slot, taken) in devices_ranges {
                let other = Window {
                    base: taken.base,
                    size: taken.size,
                };
                if taken.wide == wide && overlap(range, other) {
                    return Err(bad(format!(
                        "the range {} it holds overlaps {} of the function in slot {slot:#04x}",
                        show(range),
                        show(other)
                    )));
                }
            }
        }
        // Against the ports before it: siblings' buses and windows, and every root port's
        // ranges of the root's windows.
        for other in &views[..index] {
            for &(wide, range) in &port.ranges {
                if let Some(&(_, taken)) = (other.ranges.iter())
                    .find(|&&(other_wide, taken)| other_wide == wide && overlap(range, taken))
                {
                    return Err(bad(format!(
                        "the range {} it holds overlaps {} of the {}",
                        show(range),
                        show(taken),
                        other.name
                    )));
                }
            }
            let n = port.path.len();
            let sibling = other.path.len() == n && other.path[..n - 1] == port.path[..n - 1];
            if !sibling {
                continue;
            }
            if port.secondary <= other.subordinate && other.secondary <= port.subordinate {
                return Err(bad(format!(
                    "its buses {:#04x}..={:#04x} overlap the {}'s, {:#04x}..={:#04x}",
                    port.secondary,
                    port.subordinate,
                    other.name,
                    other.secondary,
                    other.subordinate
                )));
            }
            for mine in [port.memory, port.prefetchable] {
                for theirs in [other.memory, other.prefetchable] {
                    if overlap(mine, theirs) {
                        return Err(bad(format!(
                            "its window {} overlaps the {}'s {}",
                            show(mine),
                            other.name,
                            show(theirs)
                        )));
                    }
                }
            }
        }
    }
    for (device, path) in devices {
        let leads = path.len() >= 2
            && views.iter().any(|port| {
                port.path[..] == path[..path.len() - 1] && port.kind != PortKind::SwitchUpstream
            });
        if !leads {
            return Err(PciTopologyError::SavedLayout {
                port: format!("device {device}"),
                reason: format!(
                    "it sits at {path:?} (path from bus 0), behind no saved port that leads to a \
                     slot: its bus does not exist"
                ),
            });
        }
    }
    Ok(())
}

/// [`check_saved_ports`] on a snapshot's saved devices: its ports for hot-plug and of a
/// host-mirroring layout against its saved root's windows and bus-0 slots, with the
/// GPUs restored into root ports for hot-plug. Nothing to check without ports.
pub fn check_saved_state(saved: &crate::devices::DeviceStates) -> Result<(), PciTopologyError> {
    if saved.pcie_root_ports.is_empty() && saved.pci_topology_ports.is_empty() {
        return Ok(());
    }
    let Some(root) = &saved.pci_root else {
        return Err(PciTopologyError::SavedLayout {
            port: "PCIe ports".into(),
            reason: "the snapshot has no saved PCI allocations for them".into(),
        });
    };
    let devices: Vec<(String, Vec<u8>)> = (saved.migrated_gpus.iter())
        .filter_map(|gpu| Some((gpu.gpu_id.clone(), vec![gpu.port?, gpu.slot])))
        .collect();
    check_saved_ports(
        SegmentWindows::of_state(root),
        &root.slots,
        &saved.pcie_root_ports,
        &saved.pci_topology_ports,
        &devices,
    )
}

/// Rebuilds the ports of a host-mirroring layout a snapshot saved (`saved`, see
/// [`SavedTopologyPort`]; checked by [`check_saved_ports`]) in `root`, restored from the
/// same snapshot: each at its path, parents first, a root port holding its ranges of the
/// root's windows again, with its registers as the guest left them. The devices behind
/// them come back by their own state.
pub fn restore_topology_ports(
    root: &Arc<PciRoot>,
    saved: &[SavedTopologyPort],
) -> Result<(), PciTopologyError> {
    let mut order: Vec<&SavedTopologyPort> = saved.iter().collect();
    order.sort_by_key(|port| port.path.len());
    for port in order {
        let bad = |reason: String| PciTopologyError::SavedLayout {
            port: format!(
                "{} at {:?} (path from bus 0)",
                kind_name(port.registers.kind),
                port.path
            ),
            reason,
        };
        let bridge = bridge_of(&port.registers).map_err(bad)?;
        let (secondary, subordinate) = bridge.buses();
        let mut rebuilt = PciBridge::new(&BridgeSetup {
            kind: port.registers.kind,
            primary_bus: 0,
            secondary_bus: secondary,
            subordinate_bus: subordinate,
            memory: bridge.memory_window(),
            prefetchable: bridge.prefetchable_window(),
            slot: u16::from(secondary),
            occupied: true,
        });
        rebuilt
            .restore(&port.registers)
            .map_err(|e| bad(e.to_string()))?;
        let rebuilt = Arc::new(Mutex::new(rebuilt));
        let placed = match port.path[..] {
            [slot] => {
                let windows = (port.ranges.iter())
                    .map(|range| (range.wide, range.base, range.size))
                    .collect();
                root.add_port(slot, rebuilt, windows)
            }
            _ => root.add_behind(&port.path, rebuilt, &[], false),
        };
        let bdf = placed.map_err(|e| bad(e.to_string()))?;
        log::info!(
            "PCI {bdf}: {} restored (buses {secondary:02x}..{subordinate:02x})",
            kind_name(port.registers.kind)
        );
    }
    Ok(())
}

/// Plugs `count` empty root ports with PCIe native hot-plug slots into `root`, each with
/// its own bus (the root's ECAM window covers them: LayoutRequest::buses) and windows of
/// [`HOTPLUG_PORT_PREFETCHABLE`] and [`HOTPLUG_PORT_MEMORY`], after the buses the
/// cold-plugged layout took; each port gets an MSI (a GSI of `router`) for its slot's
/// events where a router is given.
pub fn add_hotplug_ports(
    root: &Arc<PciRoot>,
    count: u8,
    router: Option<&Arc<crate::interrupts::MsiRouter>>,
) -> Result<Vec<HotplugPort>, PciTopologyError> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if count > MAX_HOTPLUG_PORTS {
        return Err(PciTopologyError::TooManyHotplugPorts(count));
    }
    let mut ports = Vec::new();
    for index in 0..count {
        let failed = |source| PciTopologyError::HotplugPort { index, source };
        let slot = (1..32u8)
            .find(|&slot| !root.has_device(slot))
            .ok_or(PciTopologyError::NoSlot)?;
        let bus = root
            .highest_bus()
            .checked_add(1)
            .ok_or(PciTopologyError::TooManyBuses)?;
        let prefetchable = root
            .allocate_window(true, HOTPLUG_PORT_PREFETCHABLE, HOTPLUG_PORT_PREFETCHABLE)
            .map_err(failed)?;
        let memory = match root.allocate_window(false, HOTPLUG_PORT_MEMORY, HOTPLUG_PORT_MEMORY) {
            Ok(base) => base,
            Err(error) => {
                root.release_window(true, prefetchable, HOTPLUG_PORT_PREFETCHABLE);
                return Err(failed(error));
            }
        };
        let taken = vec![
            (true, prefetchable, HOTPLUG_PORT_PREFETCHABLE),
            (false, memory, HOTPLUG_PORT_MEMORY),
        ];
        let memory_window = Window {
            base: memory,
            size: HOTPLUG_PORT_MEMORY,
        };
        let prefetchable_window = Window {
            base: prefetchable,
            size: HOTPLUG_PORT_PREFETCHABLE,
        };
        let mut bridge = PciBridge::new(&BridgeSetup {
            kind: PortKind::RootPort,
            primary_bus: 0,
            secondary_bus: bus,
            subordinate_bus: bus,
            memory: memory_window,
            prefetchable: prefetchable_window,
            slot: u16::from(bus),
            occupied: false,
        });
        let msi = match port_msi(router) {
            Ok(msi) => msi,
            Err(error) => {
                for (wide, base, size) in taken {
                    root.release_window(wide, base, size);
                }
                return Err(error);
            }
        };
        bridge.make_hotplug_slot(msi);
        bridge.enable_memory_decoding();
        let bridge = Arc::new(Mutex::new(bridge));
        if let Err(error) = root.add_port(slot, bridge.clone(), taken.clone()) {
            for (wide, base, size) in taken {
                root.release_window(wide, base, size);
            }
            return Err(failed(error));
        }
        log::info!(
            "PCI 00:{slot:02x}.0: root port with a hot-plug slot (bus {bus:02x}, windows \
             {memory:#x}+{HOTPLUG_PORT_MEMORY:#x}, {prefetchable:#x}+{HOTPLUG_PORT_PREFETCHABLE:#x})"
        );
        ports.push(HotplugPort {
            slot,
            bridge,
            memory: memory_window,
            prefetchable: prefetchable_window,
        });
    }
    Ok(ports)
}

/// The path from bus 0 (see `PciRoot::add_behind`) of the function at `bdf`, found
/// through the bridges' bus numbers as they are now; None for a function on bus 0 or one
/// no bridge leads to.
pub fn path_of(root: &PciRoot, bdf: PciBdf) -> Option<Vec<u8>> {
    if bdf.bus == 0 || bdf.segment != root.segment() {
        return None;
    }
    let mut path = Vec::new();
    // Each step goes one bridge down, so at most as many steps as buses.
    for _ in 0..=u8::MAX {
        let next = (0..32u8).find_map(|number| {
            path.push(number);
            let buses = root.device_at(&path).and_then(|device| {
                let device = device.lock().unwrap_or_else(|e| e.into_inner());
                device.as_bridge().map(|bridge| bridge.buses())
            });
            path.pop();
            let (secondary, subordinate) = buses?;
            (secondary != 0 && secondary <= bdf.bus && bdf.bus <= subordinate)
                .then_some((number, secondary))
        });
        let (number, secondary) = next?;
        path.push(number);
        if secondary == bdf.bus {
            path.push(bdf.device);
            return root.device_at(&path).map(|_| path);
        }
    }
    None
}

/// The bus-0 slots of `root` that hold a PCI bridge (the root ports of a host-mirroring
/// layout and of [`add_hotplug_ports`]): the ACPI tables leave them out of ACPI PCI
/// hot-plug, as their slots are PCIe native hot-plug's (or none).
pub fn bridge_slots(root: &PciRoot) -> Vec<u8> {
    (0..32u8)
        .filter(|&slot| {
            root.device_at(&[slot]).is_some_and(|device| {
                device
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_bridge()
                    .is_some()
            })
        })
        .collect()
}

/// Where a device with BARs `specs` goes in an empty port with windows `memory` and
/// `wide_window` (prefetchable): each BAR's index and address, laid out as a cold-plugged
/// device's behind its root port; an error says which window it does not fit.
pub fn bars_in_port(
    specs: &[BarSpec],
    memory: Window,
    wide_window: Window,
) -> Result<Vec<(u8, u64)>, String> {
    let [wide, narrow] = device_blocks(specs);
    for (block, window, what) in [
        (&wide, wide_window, "prefetchable"),
        (&narrow, memory, "memory"),
    ] {
        let fits =
            block.size == 0 || (window.size >= block.size && window.base % block.align.max(1) == 0);
        if !fits {
            return Err(format!(
                "its BARs need {:#x} bytes of the port's {what} window, which is {:#x} at {:#x}",
                block.size, window.size, window.base
            ));
        }
    }
    Ok(specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let (block, window) = if prefetchable(spec) {
                (&wide, wide_window)
            } else {
                (&narrow, memory)
            };
            (spec.index, window.base + block.offsets[i])
        })
        .collect())
}

/// One passthrough device to place: its host address (None: no known host place) and
/// its BARs.
#[derive(Clone, Debug)]
pub struct DeviceInput {
    pub host_bdf: Option<String>,
    pub specs: Vec<BarSpec>,
}

/// What the layout is decided from.
#[derive(Clone, Debug)]
pub struct LayoutRequest {
    /// PciOptions::pci_topology.
    pub choice: Option<PciTopology>,
    /// The passthrough devices, in plug order.
    pub devices: Vec<DeviceInput>,
    /// Empty root ports for hot-plug (PciOptions::pcie_root_ports).
    pub hotplug_ports: u8,
    /// What [`LayoutRequest::decide`] found, once asked.
    decided: std::sync::OnceLock<Option<(HostTopology, Vec<Group>)>>,
}

impl LayoutRequest {
    /// The request of `options`, with no devices yet.
    pub fn new(options: &PciOptions) -> Self {
        LayoutRequest {
            choice: options.pci_topology,
            devices: Vec::new(),
            hotplug_ports: options.pcie_root_ports,
            decided: std::sync::OnceLock::new(),
        }
    }
}

impl LayoutRequest {
    /// The request for one PCI segment: the devices `indices` (of this request, in plug
    /// order) and `hotplug_ports` empty root ports. Each segment's root lays out its own
    /// devices (a NUMA node's GPUs behind their switches on the node's segment).
    pub fn for_segment(&self, indices: &[usize], hotplug_ports: u8) -> LayoutRequest {
        LayoutRequest {
            choice: self.choice,
            devices: (indices.iter())
                .filter_map(|&i| self.devices.get(i).cloned())
                .collect(),
            hotplug_ports,
            decided: std::sync::OnceLock::new(),
        }
    }

    /// How many buses the layout numbers, bus 0 included: each root port, switch
    /// upstream and downstream port has a bus behind it (Placement::plug_group,
    /// add_hotplug_ports). The root's ECAM window covers them.
    pub fn buses(&self) -> Result<u16, PciTopologyError> {
        let mut buses = 1 + u16::from(self.hotplug_ports);
        if let Some((_, groups)) = self.decide()? {
            for group in &groups {
                let count = group.devices.len() as u16;
                buses += if group.switch.is_some() { 2 + count } else { 1 };
            }
        }
        if buses > 256 {
            return Err(PciTopologyError::TooManyBuses);
        }
        Ok(buses)
    }

    /// What the 32-bit BAR window must hold, for a segment whose window is sized from
    /// its devices (address_space::SegmentBars::mmio32): `flat` (each device's 32-bit
    /// BAR sizes, in plug order) where devices stay on bus 0; for each root port, one
    /// range the size of its memory window (non-prefetchable BARs) rounded up to a
    /// power of two.
    pub fn mmio32_needs(&self, flat: &[Vec<u64>]) -> Result<Vec<Vec<u64>>, PciTopologyError> {
        self.window_needs(flat, MEMORY_WINDOW)
    }

    /// The host's topology and the groups of devices that get a root port each, or None
    /// for the flat layout (the reason logged). Decided once; later calls repeat it.
    fn decide(&self) -> Result<Option<(HostTopology, Vec<Group>)>, PciTopologyError> {
        if let Some(decided) = self.decided.get() {
            return Ok(decided.clone());
        }
        let decided = self.decide_now()?;
        let _ = self.decided.set(decided.clone());
        Ok(decided)
    }

    fn decide_now(&self) -> Result<Option<(HostTopology, Vec<Group>)>, PciTopologyError> {
        let explicit = self.choice == Some(PciTopology::Host);
        if self.choice == Some(PciTopology::Flat) {
            return Ok(None);
        }
        let known: Vec<String> = (self.devices.iter())
            .filter_map(|d| d.host_bdf.clone())
            .collect();
        if known.is_empty() {
            // A segment with no devices at all (segment 0 beside a node's) has nothing to say.
            if explicit && !self.devices.is_empty() {
                log::info!("PCI topology: no device has a known host place: all on bus 0");
            }
            return Ok(None);
        }
        let host = match HostTopology::discover(&HostTopology::default_root(), &known) {
            Ok(host) => host,
            Err(error) if !explicit => {
                log::warn!("PCI topology: {error}; passthrough devices stay on bus 0");
                return Ok(None);
            }
            Err(error) => return Err(error.into()),
        };
        if !explicit && !known.iter().any(|bdf| host.switch_of(bdf).is_some()) {
            log::info!(
                "PCI topology: no device sits behind a host PCIe switch: all on bus 0 \
                 (--pci-topology host gives each a root port)"
            );
            return Ok(None);
        }
        let groups = group_by_switch(&self.devices, |bdf| host.switch_of(bdf));
        Ok(Some((host, groups)))
    }

    /// What the 64-bit BAR window must hold, for the address-space planner
    /// (crate::pci::plan_address_space): `flat` (each device's 64-bit BAR sizes, in plug
    /// order) where devices stay on bus 0; for each root port, one range the size of its
    /// prefetchable window rounded up to a power of two (the planner aligns each range to
    /// its size, as the window must be aligned to its largest BAR); then each empty root
    /// port's prefetchable window ([`HOTPLUG_PORT_PREFETCHABLE`]), placed after them.
    pub fn address_needs(&self, flat: &[Vec<u64>]) -> Result<Vec<Vec<u64>>, PciTopologyError> {
        let mut needs = self.window_needs(flat, PREFETCHABLE_WINDOW)?;
        needs.extend((0..self.hotplug_ports).map(|_| vec![HOTPLUG_PORT_PREFETCHABLE]));
        Ok(needs)
    }

    /// `flat` for the devices left on bus 0, then one power-of-two range per root port
    /// for its window of `kind` (PREFETCHABLE_WINDOW or MEMORY_WINDOW, see
    /// device_blocks).
    fn window_needs(
        &self,
        flat: &[Vec<u64>],
        kind: usize,
    ) -> Result<Vec<Vec<u64>>, PciTopologyError> {
        let Some((_, groups)) = self.decide()? else {
            return Ok(flat.to_vec());
        };
        let grouped: Vec<usize> = groups.iter().flat_map(|g| g.devices.clone()).collect();
        let mut needs: Vec<Vec<u64>> = (0..flat.len())
            .filter(|i| !grouped.contains(i))
            .map(|i| flat[i].clone())
            .collect();
        for group in &groups {
            let pieces: Vec<(u64, u64)> = (group.devices.iter())
                .map(|&i| {
                    let block = &device_blocks(&self.devices[i].specs)[kind];
                    (block.size, block.align)
                })
                .collect();
            let window = lay_out(&pieces).size;
            if window > 0 {
                needs.push(vec![window.next_power_of_two()]);
            }
        }
        Ok(needs)
    }
}

/// The host address whose place the device with backend `key` takes: a kernel VFIO
/// device's own (`kernel`), a vfio-user device's `topology_bdf`.
pub fn host_place(options: &PciOptions, key: &str, kernel: bool) -> Option<String> {
    if kernel {
        return Some(key.to_string());
    }
    options.tuning_of(key).topology_bdf
}

/// Which BARs go in a bridge's prefetchable (64-bit) window.
fn prefetchable(spec: &BarSpec) -> bool {
    matches!(spec.kind, BarKind::Memory64 { prefetchable: true })
}

/// A run of BARs or blocks laid out from offset 0: each at its alignment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Block {
    /// Bytes from the start to the end of the last piece, rounded up to 1 MiB (0: empty).
    size: u64,
    /// What the start must be aligned to: the largest piece's alignment, at least 1 MiB.
    align: u64,
    /// Offset of each piece, in the order given.
    offsets: Vec<u64>,
}

/// Lays out pieces (size, alignment) largest alignment first, which leaves no gaps between
/// power-of-two BARs.
fn lay_out(pieces: &[(u64, u64)]) -> Block {
    let mut order: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i].0 > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(pieces[i].1));
    let mut offsets = vec![0; pieces.len()];
    let mut end = 0u64;
    for i in order {
        let (size, align) = pieces[i];
        let at = end.next_multiple_of(align.max(1));
        offsets[i] = at;
        end = at + size;
    }
    let align = pieces
        .iter()
        .filter(|p| p.0 > 0)
        .map(|p| p.1)
        .max()
        .unwrap_or(0)
        .max(WINDOW_GRANULE);
    Block {
        size: end.next_multiple_of(WINDOW_GRANULE),
        align,
        offsets,
    }
}

/// The index of the prefetchable and of the memory block in device_blocks' answer.
const PREFETCHABLE_WINDOW: usize = 0;
const MEMORY_WINDOW: usize = 1;

/// One device's BARs in the two windows: (prefetchable block, memory block).
fn device_blocks(specs: &[BarSpec]) -> [Block; 2] {
    [true, false].map(|wide| {
        let pieces: Vec<(u64, u64)> = specs
            .iter()
            .map(|s| {
                if prefetchable(s) == wide {
                    (s.size, s.size)
                } else {
                    (0, 0)
                }
            })
            .collect();
        lay_out(&pieces)
    })
}

/// Where one device goes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DevicePlace {
    /// Its path from bus 0 (see PciRoot::add_behind).
    path: Vec<u8>,
    /// Its BARs: index and address.
    bars: Vec<(u8, u64)>,
}

/// The plugged layout: where each device (in plug order) goes.
pub struct Placement {
    root: Arc<PciRoot>,
    places: Vec<Option<DevicePlace>>,
}

impl Placement {
    /// The flat layout: everything on bus 0.
    pub fn flat(root: &Arc<PciRoot>, count: usize) -> Self {
        Placement {
            root: root.clone(),
            places: vec![None; count],
        }
    }

    /// Decides the layout for `devices` (in plug order) and plugs the ports it needs into
    /// `root`, with their windows taken from the root's.
    pub fn build(root: &Arc<PciRoot>, request: &LayoutRequest) -> Result<Self, PciTopologyError> {
        let devices = &request.devices;
        let mut placement = Self::flat(root, devices.len());
        let Some((host, groups)) = request.decide()? else {
            return Ok(placement);
        };
        let mut next_bus = 1u16;
        for group in &groups {
            next_bus = placement.plug_group(group, devices, next_bus, &host)?;
        }
        Ok(placement)
    }

    /// Plugs one root port (with a switch when the group has a host switch) holding the
    /// group's devices; returns the next free bus number.
    fn plug_group(
        &mut self,
        group: &Group,
        devices: &[DeviceInput],
        first_bus: u16,
        host: &HostTopology,
    ) -> Result<u16, PciTopologyError> {
        let slot = (1..32u8)
            .find(|&slot| !self.root.has_device(slot))
            .ok_or(PciTopologyError::NoSlot)?;
        let count = group.devices.len() as u16;
        let switched = group.switch.is_some();
        let last_bus = if switched {
            first_bus + 1 + count
        } else {
            first_bus
        };
        if last_bus > 255 {
            return Err(PciTopologyError::TooManyBuses);
        }
        let bus = |n: u16| n as u8;
        let blocks: Vec<[Block; 2]> = group
            .devices
            .iter()
            .map(|&i| device_blocks(&devices[i].specs))
            .collect();
        // Each window kind: the devices' blocks side by side, then one range from the root.
        let mut outer = [Window::default(); 2];
        let mut inner: Vec<[Window; 2]> = vec![[Window::default(); 2]; blocks.len()];
        let mut taken = Vec::new();
        for (kind, wide) in [true, false].into_iter().enumerate() {
            let pieces: Vec<(u64, u64)> = blocks
                .iter()
                .map(|b| (b[kind].size, b[kind].align))
                .collect();
            let hierarchy = lay_out(&pieces);
            if hierarchy.size == 0 {
                continue;
            }
            let base = self
                .root
                .allocate_window(wide, hierarchy.size, hierarchy.align)?;
            taken.push((wide, base, hierarchy.size));
            outer[kind] = Window {
                base,
                size: hierarchy.size,
            };
            for (i, offset) in hierarchy.offsets.iter().enumerate() {
                if blocks[i][kind].size > 0 {
                    inner[i][kind] = Window {
                        base: base + offset,
                        size: blocks[i][kind].size,
                    };
                }
            }
        }
        let setup = |kind, primary, secondary, subordinate, windows: [Window; 2]| BridgeSetup {
            kind,
            primary_bus: primary,
            secondary_bus: secondary,
            subordinate_bus: subordinate,
            prefetchable: windows[0],
            memory: windows[1],
            slot: u16::from(secondary),
            occupied: true,
        };
        let root_port = port(setup(
            PortKind::RootPort,
            0,
            bus(first_bus),
            bus(last_bus),
            outer,
        ));
        let give_back = taken.clone();
        let rp = match self.root.add_port(slot, root_port, taken) {
            Ok(bdf) => bdf,
            Err(error) => {
                for (wide, base, size) in give_back {
                    self.root.release_window(wide, base, size);
                }
                return Err(error.into());
            }
        };
        let mut parent = vec![slot];
        match &group.switch {
            Some(upstream) => {
                let up = setup(
                    PortKind::SwitchUpstream,
                    bus(first_bus),
                    bus(first_bus + 1),
                    bus(last_bus),
                    outer,
                );
                let up_bdf = self.root.add_behind(&[slot, 0], port(up), &[], true)?;
                log::info!(
                    "PCI {}: root port, {}: switch upstream port (host switch {upstream})",
                    rp.shown(),
                    up_bdf.shown()
                );
                parent.push(0);
            }
            None => log::info!("PCI {}: root port", rp.shown()),
        }
        for (n, &device) in group.devices.iter().enumerate() {
            let mut path = parent.clone();
            if switched {
                let secondary = bus(first_bus + 2 + n as u16);
                let down = setup(
                    PortKind::SwitchDownstream,
                    bus(first_bus + 1),
                    secondary,
                    secondary,
                    inner[n],
                );
                path.push(n as u8);
                let bdf = self.root.add_behind(&path, port(down), &[], true)?;
                log::info!("PCI {}: switch downstream port", bdf.shown());
            }
            path.push(0);
            let [wide_block, narrow_block] = &blocks[n];
            let specs = &devices[device].specs;
            let bars = specs
                .iter()
                .enumerate()
                .map(|(i, spec)| {
                    let (kind, block) = if prefetchable(spec) {
                        (0, wide_block)
                    } else {
                        (1, narrow_block)
                    };
                    (spec.index, inner[n][kind].base + block.offsets[i])
                })
                .collect();
            if let Some(bdf) = &devices[device].host_bdf {
                log::info!(
                    "PCI topology: device {device} at host {}",
                    host.describe(bdf)
                );
            }
            self.places[device] = Some(DevicePlace { path, bars });
        }
        Ok(last_bus + 1)
    }

    /// Plugs device `index` (in plug order) where the layout puts it.
    pub fn add(&self, index: usize, device: Arc<Mutex<dyn PciDevice>>) -> Result<PciBdf, PciError> {
        match self.places.get(index).and_then(Option::as_ref) {
            Some(place) => self.root.add_behind(&place.path, device, &place.bars, true),
            None => self.root.add_device(device),
        }
    }

    /// The GSI INTx pin `pin_index` (0 = INTA) of device `index` at `bdf` reaches: the
    /// pin swizzled through each bridge up to the root port's slot on bus 0, where the
    /// ACPI _PRT routes it (Linux swizzles the same way for bridges without a _PRT).
    pub fn intx_gsi(&self, index: usize, bdf: PciBdf, pin_index: u8) -> u32 {
        match self.places.get(index).and_then(Option::as_ref) {
            Some(place) => swizzled_gsi(&place.path, pin_index),
            None => intx_gsi(bdf.device, pin_index),
        }
    }
}

/// See [`Placement::intx_gsi`].
fn swizzled_gsi(path: &[u8], pin_index: u8) -> u32 {
    let pin = path[1..].iter().fold(u32::from(pin_index), |pin, &device| {
        (pin + u32::from(device)) % 4
    });
    intx_gsi(path[0], pin as u8)
}

/// A port as firmware leaves it: memory forwarding and bus mastering on.
fn port(setup: BridgeSetup) -> Arc<Mutex<PciBridge>> {
    let mut bridge = PciBridge::new(&setup);
    bridge.enable_memory_decoding();
    Arc::new(Mutex::new(bridge))
}

/// The devices under one root port: behind a host switch (its upstream port's address) or alone.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Group {
    switch: Option<String>,
    devices: Vec<usize>,
}

/// Devices with a known place grouped by host switch, in the order each group's first
/// device comes; a device behind no switch is a group of its own.
fn group_by_switch(
    devices: &[DeviceInput],
    switch_of: impl Fn(&str) -> Option<String>,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for (index, device) in devices.iter().enumerate() {
        let Some(bdf) = &device.host_bdf else {
            continue;
        };
        let switch = switch_of(bdf);
        match groups
            .iter_mut()
            .find(|g| switch.is_some() && g.switch == switch)
        {
            Some(group) => group.devices.push(index),
            None => groups.push(Group {
                switch,
                devices: vec![index],
            }),
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvm_devices::pci::{BarSet, PciBar, PciRootConfig};

    const MIB: u64 = 1 << 20;

    fn gpu_specs() -> Vec<BarSpec> {
        vec![
            BarSpec {
                index: 0,
                size: 16 * MIB,
                kind: BarKind::Memory32 {
                    prefetchable: false,
                },
            },
            BarSpec {
                index: 1,
                size: 256 * MIB,
                kind: BarKind::Memory64 { prefetchable: true },
            },
            BarSpec {
                index: 3,
                size: 32 * MIB,
                kind: BarKind::Memory64 { prefetchable: true },
            },
        ]
    }

    struct Gpu(BarSet);

    impl PciDevice for Gpu {
        fn config_read(&mut self, offset: u16, data: &mut [u8]) {
            if BarSet::handles(offset) {
                return self.0.read(offset, data);
            }
            data.fill(0);
        }
        fn config_write(&mut self, offset: u16, data: &[u8]) {
            if BarSet::handles(offset) {
                self.0.write(offset, data);
            }
        }
        fn active_bars(&self) -> Vec<PciBar> {
            self.0.active()
        }
        fn bar_specs(&self) -> Vec<BarSpec> {
            self.0.specs()
        }
        fn set_bar_address(&mut self, bar: u8, address: u64) {
            self.0.set_address(bar, address);
        }
        fn enable_memory_decoding(&mut self) {
            self.0.set_memory_enabled(true);
        }
        fn bar_read(&mut self, _: u8, _: u64, data: &mut [u8]) {
            data.fill(0);
        }
        fn bar_write(&mut self, _: u8, _: u64, _: &[u8]) {}
    }

    #[test]
    fn blocks_pack_bars_and_round_to_the_window_granule() {
        let [wide, narrow] = device_blocks(&gpu_specs());
        assert_eq!(wide.size, 288 * MIB);
        assert_eq!(wide.align, 256 * MIB);
        assert_eq!(wide.offsets, vec![0, 0, 256 * MIB]);
        assert_eq!((narrow.size, narrow.align), (16 * MIB, 16 * MIB));
        let tiny = lay_out(&[(4096, 4096)]);
        assert_eq!((tiny.size, tiny.align), (MIB, MIB));
        assert_eq!(lay_out(&[]).size, 0);
    }

    #[test]
    fn devices_group_by_host_switch_and_unknown_ones_stay_out() {
        let input = |bdf: Option<&str>| DeviceInput {
            host_bdf: bdf.map(str::to_string),
            specs: gpu_specs(),
        };
        let devices = [
            input(Some("a")),
            input(Some("b")),
            input(None),
            input(Some("c")),
            input(Some("d")),
            input(Some("e")),
        ];
        let groups = group_by_switch(&devices, |bdf| match bdf {
            "a" | "c" => Some("sw1".into()),
            "b" | "d" => Some("sw2".into()),
            _ => None,
        });
        let shape: Vec<(Option<&str>, Vec<usize>)> = groups
            .iter()
            .map(|g| (g.switch.as_deref(), g.devices.clone()))
            .collect();
        assert_eq!(
            shape,
            vec![
                (Some("sw1"), vec![0, 3]),
                (Some("sw2"), vec![1, 4]),
                (None, vec![5])
            ]
        );
    }

    #[test]
    fn the_planner_is_asked_for_each_root_ports_window() {
        const GIB: u64 = 1 << 30;
        let h200 = vec![
            BarSpec {
                index: 1,
                size: 256 * GIB,
                kind: BarKind::Memory64 { prefetchable: true },
            },
            BarSpec {
                index: 3,
                size: 32 * MIB,
                kind: BarKind::Memory64 { prefetchable: true },
            },
        ];
        let mut request = LayoutRequest::new(&PciOptions::default());
        request.devices = (0..3)
            .map(|_| DeviceInput {
                host_bdf: None,
                specs: h200.clone(),
            })
            .collect();
        let flat = vec![vec![256 * GIB, 32 * MIB]; 3];
        // Devices 0 and 2 behind one switch, device 1 on bus 0.
        let groups = vec![Group {
            switch: Some("sw".into()),
            devices: vec![0, 2],
        }];
        request
            .decided
            .set(Some((HostTopology::default(), groups)))
            .unwrap();
        let needs = request.address_needs(&flat).unwrap();
        // Two 256 GiB + 32 MiB blocks, the second at 512 GiB: 768 GiB + 32 MiB, as 1 TiB.
        assert_eq!(needs, vec![vec![256 * GIB, 32 * MIB], vec![1024 * GIB]]);
        let flat_request = LayoutRequest::new(&PciOptions {
            pci_topology: Some(PciTopology::Flat),
            ..PciOptions::default()
        });
        assert_eq!(flat_request.address_needs(&flat).unwrap(), flat);
    }

    /// A segment's request counts the buses its ports number (the ECAM window is placed
    /// for them) and asks for each port's memory window in the 32-bit space.
    #[test]
    fn a_segments_request_counts_its_buses_and_32_bit_windows() {
        let mut request = LayoutRequest::new(&PciOptions {
            pcie_root_ports: 2,
            ..PciOptions::default()
        });
        request.devices = (0..4)
            .map(|_| DeviceInput {
                host_bdf: None,
                specs: gpu_specs(),
            })
            .collect();
        // Devices 1 and 3 of segment "1" behind one switch, 2 behind a root port alone.
        let node = request.for_segment(&[1, 2, 3], 0);
        assert_eq!(node.devices.len(), 3);
        assert_eq!(node.hotplug_ports, 0);
        let groups = vec![
            Group {
                switch: Some("sw".into()),
                devices: vec![0, 2],
            },
            Group {
                switch: None,
                devices: vec![1],
            },
        ];
        node.decided
            .set(Some((HostTopology::default(), groups)))
            .unwrap();
        // Bus 0; root port, upstream port and two downstream ports; a root port.
        assert_eq!(node.buses().unwrap(), 1 + 4 + 1);
        let flat32 = vec![vec![16 * MIB]; 3];
        // The switch's two 16 MiB BAR0s in one 32 MiB window, the lone GPU's in 16 MiB.
        assert_eq!(
            node.mmio32_needs(&flat32).unwrap(),
            vec![vec![32 * MIB], vec![16 * MIB]]
        );
        // Segment 0 keeps the hot-plug ports: a bus each; no host place, no ports else.
        let zero = request.for_segment(&[0], 2);
        assert_eq!(zero.buses().unwrap(), 3);
        assert_eq!(
            zero.mmio32_needs(&flat32[..1]).unwrap(),
            vec![vec![16 * MIB]]
        );
    }

    /// A one-bus root with a 4 TiB 64-bit window at 1 TiB: room for root ports' windows.
    fn root_with_room_for_ports() -> Arc<PciRoot> {
        PciRoot::new(PciRootConfig {
            ecam_base: 0xe000_0000,
            buses: 1,
            mmio32_start: 0xc000_0000,
            mmio32_end: 0xe000_0000,
            mmio64_start: 1 << 40,
            mmio64_size: 4 << 40,
        })
        .unwrap()
    }

    #[test]
    fn empty_root_ports_get_windows_and_a_device_fits_inside() {
        let root = root_with_room_for_ports();
        assert!(matches!(
            add_hotplug_ports(&root, MAX_HOTPLUG_PORTS + 1, None),
            Err(PciTopologyError::TooManyHotplugPorts(_))
        ));
        let ports = add_hotplug_ports(&root, 2, None).unwrap();
        assert_eq!(ports.len(), 2);
        assert_eq!(root.highest_bus(), 2, "a bus each");
        let windows: Vec<(Window, Window)> = ports
            .iter()
            .map(|port| {
                let bridge = port.bridge.lock().unwrap();
                assert!(bridge.is_hotplug_slot() && !bridge.slot_occupied());
                (bridge.memory_window(), bridge.prefetchable_window())
            })
            .collect();
        assert_eq!(windows[0].1.size, HOTPLUG_PORT_PREFETCHABLE);
        assert_eq!(windows[0].0.size, HOTPLUG_PORT_MEMORY);
        assert!(windows[0].1.end() <= windows[1].1.base);
        let bars = bars_in_port(&gpu_specs(), windows[1].0, windows[1].1).unwrap();
        for (index, address) in bars {
            let spec = gpu_specs().into_iter().find(|s| s.index == index).unwrap();
            let window = if index == 0 {
                windows[1].0
            } else {
                windows[1].1
            };
            assert!(
                window.contains(address, spec.size),
                "BAR{index} at {address:#x}"
            );
        }
        // A BAR twice the window does not fit, and the error says which window.
        let huge = vec![BarSpec {
            index: 1,
            size: 2 * HOTPLUG_PORT_PREFETCHABLE,
            kind: BarKind::Memory64 { prefetchable: true },
        }];
        let why = bars_in_port(&huge, windows[1].0, windows[1].1).unwrap_err();
        assert!(why.contains("prefetchable window"), "{why}");
        // The planner is asked for each port's window after the devices' needs.
        let request = LayoutRequest::new(&PciOptions {
            pcie_root_ports: 2,
            ..PciOptions::default()
        });
        assert_eq!(
            request.address_needs(&[vec![MIB]]).unwrap(),
            vec![
                vec![MIB],
                vec![HOTPLUG_PORT_PREFETCHABLE],
                vec![HOTPLUG_PORT_PREFETCHABLE]
            ]
        );
    }

    #[test]
    fn a_guest_cannot_eject_a_root_port_through_acpi() {
        use gpuvm_devices::pci::hotplug::B0EJ;
        use gpuvm_devices::pci::HotplugController;
        use gpuvm_devices::BusDevice;
        let root = root_with_room_for_ports();
        let ports = add_hotplug_ports(&root, 2, None).unwrap();
        let slots: Vec<u8> = ports.iter().map(|p| p.slot).collect();
        assert_eq!(
            bridge_slots(&root),
            slots,
            "the ACPI tables leave these out"
        );
        let gpu = Arc::new(Mutex::new(Gpu(BarSet::new(&gpu_specs()))));
        let (memory, wide) = {
            let port = ports[0].bridge.lock().unwrap();
            (port.memory_window(), port.prefetchable_window())
        };
        let bars = bars_in_port(&gpu_specs(), memory, wide).unwrap();
        let behind = root.add_behind(&[slots[0], 0], gpu, &bars, false).unwrap();
        let mut controller = HotplugController::new(root.clone(), None);
        // A hostile guest writes B0EJ for every slot: neither port nor the device behind
        // one leaves the bus, and the VMM is told of no eject.
        controller.write(B0EJ, &u32::MAX.to_le_bytes());
        for slot in &slots {
            assert!(
                root.has_device(*slot),
                "root port in slot {slot} still there"
            );
            assert!(!controller.take_ejected(*slot));
        }
        let mut vendor = [0u8; 2];
        root.config_read(behind, 0, &mut vendor);
        assert_ne!(
            vendor, [0xff; 2],
            "the device behind the port still answers"
        );
        assert_eq!(root.highest_bus(), 2);
    }

    #[test]
    fn saved_root_ports_come_back_in_their_slots_with_their_windows_and_registers() {
        let config = PciRootConfig {
            ecam_base: 0xe000_0000,
            buses: 1,
            mmio32_start: 0xc000_0000,
            mmio32_end: 0xe000_0000,
            mmio64_start: 1 << 40,
            mmio64_size: 4 << 40,
        };
        let root = PciRoot::new(config).unwrap();
        let ports = add_hotplug_ports(&root, 2, None).unwrap();
        // The guest powers port 1's slot on (Slot Control at 0x40 + 0x18).
        ports[1]
            .bridge
            .lock()
            .unwrap()
            .config_write(0x58, &0u16.to_le_bytes());
        let saved: Vec<SavedHotplugPort> = ports.iter().map(HotplugPort::save).collect();
        let mut state = root.save().unwrap();
        state
            .slots
            .retain(|slot| !ports.iter().any(|port| port.slot == slot.slot));

        let mut again = PciRoot::new(config).unwrap();
        Arc::get_mut(&mut again).unwrap().restore(&state).unwrap();
        let back = restore_hotplug_ports(&again, &saved, None).unwrap();
        again.finish_restore().unwrap();
        assert_eq!(bridge_slots(&again), bridge_slots(&root));
        assert_eq!(again.highest_bus(), 2);
        for (port, before) in back.iter().zip(&ports) {
            assert_eq!(
                (port.slot, port.memory, port.prefetchable),
                (before.slot, before.memory, before.prefetchable)
            );
            let (now, was) = (port.bridge.lock().unwrap(), before.bridge.lock().unwrap());
            assert_eq!(now.registers(), was.registers());
            assert!(now.is_hotplug_slot());
        }
        assert!(back[1].bridge.lock().unwrap().slot_powered());
        assert!(!back[0].bridge.lock().unwrap().slot_powered());
        // The windows stay taken: a new range goes elsewhere.
        let wide = again
            .allocate_window(true, HOTPLUG_PORT_PREFETCHABLE, HOTPLUG_PORT_PREFETCHABLE)
            .unwrap();
        assert!(back
            .iter()
            .all(|port| wide >= port.prefetchable.end() || wide < port.prefetchable.base));

        // A saved port whose window lies outside the root's is refused.
        let mut outside = saved.clone();
        outside[0].prefetchable.0 = 1 << 50;
        let mut fresh = PciRoot::new(config).unwrap();
        Arc::get_mut(&mut fresh).unwrap().restore(&state).unwrap();
        assert!(matches!(
            restore_hotplug_ports(&fresh, &outside, None),
            Err(PciTopologyError::SavedPort { index: 0, .. })
        ));
    }

    /// A root with a switch of two GPUs behind root port 00:01.0 (buses 1..=4) and two
    /// root ports for hot-plug after it; the GPUs are plugged.
    fn topology_with_hotplug_ports(config: PciRootConfig) -> (Arc<PciRoot>, Vec<HotplugPort>) {
        let root = PciRoot::new(config).unwrap();
        let devices: Vec<DeviceInput> = (0..2)
            .map(|_| DeviceInput {
                host_bdf: Some("x".into()),
                specs: gpu_specs(),
            })
            .collect();
        let mut placement = Placement::flat(&root, 2);
        let group = Group {
            switch: Some("0000:40:01.0".into()),
            devices: vec![0, 1],
        };
        placement
            .plug_group(&group, &devices, 1, &HostTopology::default())
            .unwrap();
        for index in 0..2 {
            let gpu = Arc::new(Mutex::new(Gpu(BarSet::new(&gpu_specs()))));
            placement.add(index, gpu).unwrap();
        }
        let ports = add_hotplug_ports(&root, 2, None).unwrap();
        (root, ports)
    }

    fn config_with_room() -> PciRootConfig {
        PciRootConfig {
            ecam_base: 0xe000_0000,
            buses: 1,
            mmio32_start: 0xc000_0000,
            mmio32_end: 0xe000_0000,
            mmio64_start: 1 << 40,
            mmio64_size: 4 << 40,
        }
    }

    /// What a snapshot of `root` keeps: the root's allocations less the ports, the
    /// ports for hot-plug and the topology's ports.
    fn save_ports(
        root: &PciRoot,
        ports: &[HotplugPort],
    ) -> (PciRootState, Vec<SavedHotplugPort>, Vec<SavedTopologyPort>) {
        let mut state = root.save().unwrap();
        state
            .slots
            .retain(|slot| !ports.iter().any(|port| port.slot == slot.slot));
        let topology = save_topology_ports(root, &mut state);
        (
            state,
            ports.iter().map(HotplugPort::save).collect(),
            topology,
        )
    }

    #[test]
    fn topology_ports_come_back_in_place_with_their_buses_windows_and_registers() {
        let config = config_with_room();
        let (root, ports) = topology_with_hotplug_ports(config);
        // The guest turns bus mastering off on the second downstream port.
        let down = root.device_at(&[1, 0, 1]).unwrap();
        down.lock()
            .unwrap()
            .config_write(0x04, &0x0002u16.to_le_bytes());
        let (state, hotplug, topology) = save_ports(&root, &ports);
        let paths: Vec<&[u8]> = topology.iter().map(|p| p.path.as_slice()).collect();
        assert_eq!(paths, [&[1][..], &[1, 0], &[1, 0, 0], &[1, 0, 1]]);
        assert_eq!(topology[0].ranges.len(), 2, "both windows of the root's");
        assert!(topology[1..].iter().all(|p| p.ranges.is_empty()));
        assert!(
            !state.slots.iter().any(|slot| slot.slot == 1),
            "the root port's slot left the root's"
        );
        check_saved_ports(
            SegmentWindows::of_state(&state),
            &state.slots,
            &hotplug,
            &topology,
            &[("gpu".into(), vec![1, 0, 1, 0])],
        )
        .unwrap();

        let mut again = PciRoot::new(config).unwrap();
        Arc::get_mut(&mut again).unwrap().restore(&state).unwrap();
        restore_hotplug_ports(&again, &hotplug, None).unwrap();
        restore_topology_ports(&again, &topology).unwrap();
        for index in 0..2u8 {
            let gpu = Arc::new(Mutex::new(Gpu(BarSet::new(&gpu_specs()))));
            let was = root.device_at(&[1, 0, index, 0]).unwrap();
            let bars: Vec<(u8, u64)> = (was.lock().unwrap().active_bars().iter())
                .map(|bar| (bar.index, bar.address))
                .collect();
            let bdf = again
                .add_behind(&[1, 0, index, 0], gpu, &bars, false)
                .unwrap();
            assert_eq!(bdf.to_string(), format!("{:02x}:00.0", 3 + index));
            assert_eq!(path_of(&again, bdf), Some(vec![1, 0, index, 0]));
        }
        again.finish_restore().unwrap();
        assert_eq!(again.highest_bus(), root.highest_bus());
        assert_eq!(again.config(), root.config(), "ECAM and windows");
        assert_eq!(bridge_slots(&again), bridge_slots(&root));
        for port in &topology {
            let now = again.device_at(&port.path).unwrap();
            let now = now.lock().unwrap();
            let now = now.as_bridge().unwrap();
            assert_eq!(now.registers(), port.registers, "{:?}", port.path);
            assert!(!now.is_hotplug_slot());
        }
        // The root port's windows stay taken: a new range goes elsewhere.
        let taken = topology[0].ranges.iter().find(|r| r.wide).unwrap();
        let wide = again
            .allocate_window(true, taken.size, WINDOW_GRANULE)
            .unwrap();
        assert!(wide >= taken.base + taken.size || wide + taken.size <= taken.base);
    }

    #[test]
    fn damaged_saved_ports_are_refused_naming_the_port_and_the_numbers() {
        use gpuvm_devices::pci::bridge::regs;
        let (root, ports) = topology_with_hotplug_ports(config_with_room());
        let (state, hotplug, topology) = save_ports(&root, &ports);
        let check = |hotplug: &[SavedHotplugPort],
                     topology: &[SavedTopologyPort],
                     devices: &[(String, Vec<u8>)]| {
            match check_saved_ports(
                SegmentWindows::of_state(&state),
                &state.slots,
                hotplug,
                topology,
                devices,
            ) {
                Err(PciTopologyError::SavedLayout { port, reason }) => format!("{port}: {reason}"),
                other => panic!("not refused as a saved layout: {other:?}"),
            }
        };
        let set = |port: &mut SavedTopologyPort, offset: u16, bytes: &[u8]| {
            let at = usize::from(offset);
            port.registers.config[at..at + bytes.len()].copy_from_slice(bytes);
        };
        // The second downstream port takes the first one's bus.
        let mut buses = topology.clone();
        set(&mut buses[3], regs::SECONDARY_BUS, &[3, 3]);
        let why = check(&hotplug, &buses, &[]);
        assert!(why.contains("switch downstream port at [1, 0, 1]"), "{why}");
        assert!(why.contains("buses 0x03..=0x03 overlap"), "{why}");
        // A switch port whose buses leave its root port's range.
        let mut beyond = topology.clone();
        set(&mut beyond[3], regs::SECONDARY_BUS, &[9, 9]);
        let why = check(&hotplug, &beyond, &[]);
        assert!(why.contains("do not lie behind bus 0x02"), "{why}");
        // The root port's prefetchable window moved out of the segment's 64-bit window.
        let mut outside = topology.clone();
        set(
            &mut outside[0],
            regs::PREF_BASE_UPPER,
            &0x10_0000u32.to_le_bytes(),
        );
        set(
            &mut outside[0],
            regs::PREF_LIMIT_UPPER,
            &0x10_0000u32.to_le_bytes(),
        );
        let why = check(&hotplug, &outside, &[]);
        assert!(why.contains("root port 00:01.0"), "{why}");
        assert!(why.contains("prefetchable window 0x10000000"), "{why}");
        // A downstream port's window outside its upstream port's.
        let mut escaped = topology.clone();
        set(&mut escaped[2], regs::MEMORY_BASE, &0xdff0u16.to_le_bytes());
        set(
            &mut escaped[2],
            regs::MEMORY_LIMIT,
            &0xdff0u16.to_le_bytes(),
        );
        let why = check(&hotplug, &escaped, &[]);
        assert!(why.contains("outside the switch upstream port"), "{why}");
        // Two root ports holding the same range of the root's 64-bit window.
        let mut shared = hotplug.clone();
        let wide = topology[0].ranges.iter().find(|r| r.wide).unwrap();
        shared[0].prefetchable = (wide.base, wide.size);
        let why = check(&shared, &topology, &[]);
        assert!(why.contains("overlaps"), "{why}");
        assert!(why.contains(&format!("{:#x}", wide.base)), "{why}");
        // A switch port behind a root port the snapshot does not have.
        let orphan = topology[1..].to_vec();
        let why = check(&hotplug, &orphan, &[]);
        assert!(why.contains("no saved port leads to it"), "{why}");
        // A GPU behind a port that is not there.
        let why = check(&hotplug, &topology, &[("gpu0".into(), vec![1, 0, 5, 0])]);
        assert!(
            why.contains("device gpu0") && why.contains("[1, 0, 5, 0]"),
            "{why}"
        );
        // Two ports in one slot.
        let mut twice = topology.clone();
        twice[0].path = vec![hotplug[0].slot];
        let why = check(&hotplug, &twice, &[]);
        assert!(why.contains("two ports at"), "{why}");
        // Registers cut short.
        let mut short = topology.clone();
        short[1].registers.config.truncate(16);
        let why = check(&hotplug, &short, &[]);
        assert!(why.contains("its registers"), "{why}");
        // A restore of a port behind no root port fails cleanly.
        let mut fresh = PciRoot::new(config_with_room()).unwrap();
        Arc::get_mut(&mut fresh).unwrap().restore(&state).unwrap();
        assert!(restore_topology_ports(&fresh, &orphan).is_err());
    }

    #[test]
    fn intx_swizzles_up_to_the_root_port() {
        assert_eq!(swizzled_gsi(&[3, 0], 0), intx_gsi(3, 0));
        assert_eq!(swizzled_gsi(&[3, 0, 1, 0], 0), intx_gsi(3, 1));
        assert_eq!(swizzled_gsi(&[3, 0, 3, 0], 2), intx_gsi(3, 1));
    }

    #[test]
    fn a_switch_group_gets_nested_windows_holding_each_device() {
        let root = PciRoot::new(PciRootConfig {
            ecam_base: 0xe000_0000,
            buses: 1,
            mmio32_start: 0xc000_0000,
            mmio32_end: 0xe000_0000,
            mmio64_start: 1 << 40,
            mmio64_size: 1 << 40,
        })
        .unwrap();
        let devices: Vec<DeviceInput> = (0..2)
            .map(|_| DeviceInput {
                host_bdf: Some("x".into()),
                specs: gpu_specs(),
            })
            .collect();
        let mut placement = Placement::flat(&root, 2);
        let group = Group {
            switch: Some("0000:40:01.0".into()),
            devices: vec![0, 1],
        };
        let host = HostTopology::default();
        assert_eq!(placement.plug_group(&group, &devices, 1, &host).unwrap(), 5);
        let mut bdfs = Vec::new();
        for index in 0..2 {
            let gpu = Arc::new(Mutex::new(Gpu(BarSet::new(&gpu_specs()))));
            let bdf = placement.add(index, gpu.clone()).unwrap();
            bdfs.push(bdf.to_string());
            let bars = gpu.lock().unwrap().0.active();
            let down = root
                .device_at(&[1, 0, index as u8])
                .expect("downstream port");
            let down = down.lock().unwrap();
            let down = down.as_bridge().unwrap();
            let rp = root.device_at(&[1]).unwrap();
            let rp = rp.lock().unwrap();
            let rp = rp.as_bridge().unwrap();
            for bar in bars {
                let windows = if bar.index == 0 {
                    [down.memory_window(), rp.memory_window()]
                } else {
                    [down.prefetchable_window(), rp.prefetchable_window()]
                };
                for window in windows {
                    assert!(
                        window.contains(bar.address, bar.size),
                        "{bar:x?} {window:x?}"
                    );
                }
            }
        }
        assert_eq!(bdfs, ["03:00.0", "04:00.0"]);
        assert_eq!(root.highest_bus(), 4);
        assert_eq!(root.config().buses, 5, "the ECAM window covers buses 0..=4");
        // The two downstream windows do not overlap.
        let window = |i: u8| {
            let port = root.device_at(&[1, 0, i]).unwrap();
            let port = port.lock().unwrap();
            port.as_bridge().unwrap().prefetchable_window()
        };
        assert!(window(0).end() <= window(1).base || window(1).end() <= window(0).base);
    }
}
