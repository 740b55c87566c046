//! Cloud Hypervisor's bodies → gpuvm's actions. A VmConfig becomes the same pre-boot
//! actions gpuvm's own routes make (machine config, boot source, drives, fs, nets, vsock,
//! entropy, GPUs), carried out by the controller as one unit ([`VmmAction::Batch`]).

use serde_json::json;

use gpuvm_vmm::action::{
    BackingKind, BootSourceBody, DriveBody, GpuBody, MachineConfigBody, NumaBody, NumaNodeBody,
    PciSegmentsBody, VmmAction, MAX_GPUDIRECT_CLIQUE, MAX_PCI_SEGMENTS,
};

use super::config::{
    check_other, BalloonConfig, ConsoleConfig, CpusConfig, DeviceConfig, DiskConfig, FsConfig,
    MemoryConfig, NetConfig, NumaConfig, Other, RngConfig, VmConfig, VsockConfig,
};

/// A refused body: the 400 message.
pub type Refusal = String;

/// Builds a gpuvm body from JSON (its serde defaults fill the rest).
fn body<T: serde::de::DeserializeOwned>(
    what: &str,
    value: serde_json::Value,
) -> Result<T, Refusal> {
    serde_json::from_value(value).map_err(|e| format!("{what}: {e}"))
}

pub fn machine(
    cpus: Option<&CpusConfig>,
    memory: Option<&MemoryConfig>,
) -> Result<VmmAction, Refusal> {
    // Cloud Hypervisor's defaults: 1 vCPU, 512 MiB.
    let (boot, max) = cpus.map_or((1, 1), |c| (c.boot_vcpus, c.max_vcpus));
    if let Some(cpus) = cpus {
        check_other("cpus.", &cpus.other)?;
    }
    let vcpu_count = u8::try_from(boot)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("cpus.boot_vcpus = {boot}: gpuvm runs 1 to 255 vCPUs"))?;
    // vm.resize hot-plugs vCPUs up to max_vcpus (validate.rs checked it is at least
    // boot_vcpus). A maximum above what the MADT can hold is lowered to that, and the VMM
    // lowers one above the host's KVM limit: those vCPUs could never be added anyway, and
    // Kata asks for as many as the host has CPUs. (This runs on the API thread, whose
    // filter keeps it from asking KVM.)
    let max_vcpus = u8::try_from(max)
        .unwrap_or(u8::MAX)
        .min(gpuvm_vmm::action::MAX_VCPUS)
        .max(vcpu_count);
    let (size, mut backing, thp, prefault) = match memory {
        Some(m) => {
            check_other("memory.", &m.other)?;
            // memory.shared: gpuvm's guest RAM is always a shared memfd mapping (vhost-user
            // backends map it), so both values are honoured.
            (m.size, BackingKind::Memfd, m.thp, m.prefault)
        }
        None => (512 << 20, BackingKind::Memfd, true, false),
    };
    if let Some(m) = memory.filter(|m| m.hugepages) {
        backing = match m.hugepage_size.unwrap_or(2 << 20) {
            s if s == 2 << 20 => BackingKind::Hugetlb2M,
            s if s == 1 << 30 => BackingKind::Hugetlb1G,
            s => {
                return Err(format!(
                    "memory.hugepage_size = {s}: gpuvm backs guest RAM with 2 MiB or 1 GiB pages"
                ))
            }
        };
    }
    if size == 0 || size % (1 << 20) != 0 {
        return Err(format!(
            "memory.size = {size}: gpuvm needs a whole number of MiB"
        ));
    }
    let ram_hotplug_size = match memory {
        Some(m) => ram_hotplug_size(m)?,
        None => None,
    };
    Ok(VmmAction::PutMachineConfig(MachineConfigBody {
        vcpu_count,
        mem_size_mib: size >> 20,
        track_dirty_pages: false,
        backing,
        thp,
        prefault,
        cpuid_masks: Vec::new(),
        max_vcpus: (max_vcpus > vcpu_count).then_some(max_vcpus),
        ram_hotplug_size,
        numa: None,
        pcie_root_ports: None,
    }))
}

/// `memory.hotplug_size` by ACPI memory hot-plug (`hotplug_method` "Acpi", the default),
/// rounded up to whole memory blocks: Kata sends its `default_maxmemory` (the host's RAM,
/// in MiB), which need not be one.
fn ram_hotplug_size(memory: &MemoryConfig) -> Result<Option<u64>, Refusal> {
    match memory.hotplug_method.as_deref() {
        None | Some("Acpi" | "acpi") => {}
        Some("VirtioMem" | "virtio-mem") => {
            return Err(
                "memory.hotplug_method = \"VirtioMem\" is not supported by gpuvm: \
                 it hot-plugs memory by ACPI only (hotplug_method \"Acpi\", the default)"
                    .into(),
            )
        }
        Some(other) => {
            return Err(format!(
                "memory.hotplug_method = {other:?}: expected \"Acpi\" or \"VirtioMem\""
            ))
        }
    }
    let Some(size) = memory.hotplug_size.filter(|&size| size > 0) else {
        return Ok(None);
    };
    let rounded = size
        .checked_next_multiple_of(gpuvm_vmm::action::MEMORY_BLOCK_SIZE)
        .filter(|&rounded| rounded <= gpuvm_vmm::action::MAX_MEM_SIZE_MIB << 20)
        .ok_or_else(|| format!("memory.hotplug_size = {size} is too large"))?;
    if rounded != size {
        log::info!(
            "memory.hotplug_size = {size} rounded up to {rounded} (whole {} MiB memory blocks)",
            gpuvm_vmm::action::MEMORY_BLOCK_SIZE >> 20
        );
    }
    Ok(Some(rounded))
}

pub fn disk(index: usize, disk: &DiskConfig) -> Result<(String, VmmAction), Refusal> {
    check_other(&format!("disks[{index}]."), &disk.other)?;
    let id = disk.id.clone().unwrap_or_else(|| format!("_disk{index}"));
    let drive = if disk.vhost_user {
        let socket = disk
            .vhost_socket
            .as_ref()
            .ok_or_else(|| format!("disks[{index}]: vhost_user needs vhost_socket"))?;
        DriveBody::VhostUser(body("disk", json!({"drive_id": id, "socket": socket}))?)
    } else {
        let path = disk
            .path
            .as_ref()
            .ok_or_else(|| format!("disks[{index}]: a disk needs a path (or vhost_user)"))?;
        DriveBody::Local(body(
            "disk",
            json!({"drive_id": id, "path": path, "read_only": disk.readonly,
                   "direct": disk.direct, "serial": disk.serial}),
        )?)
    };
    Ok((id, VmmAction::PutDrive(drive)))
}

/// A network interface; `tap_fds` says whether its taps came with the request (then
/// `tap` must be left out: the descriptors are the taps, one per queue pair).
pub fn net(
    index: usize,
    net: &NetConfig,
    tap_fds: bool,
) -> Result<(String, gpuvm_virtio::net::NetConfig), Refusal> {
    check_other(&format!("net[{index}]."), &net.other)?;
    let id = net.id.clone().unwrap_or_else(|| format!("_net{index}"));
    if net.tap.is_none() && !tap_fds {
        return Err(format!(
            "net[{index}]: no tap named: give `tap`, or pass the tap descriptors (SCM_RIGHTS) with vm.add-net"
        ));
    }
    if let (Some(tap), true) = (&net.tap, tap_fds) {
        return Err(format!(
            "net[{index}]: tap {tap:?} named and tap descriptors passed: give one or the other"
        ));
    }
    // Cloud Hypervisor counts queues (2 per RX/TX pair); gpuvm counts pairs.
    let pairs = net.num_queues.unwrap_or(2).div_ceil(2).max(1);
    let mut value = json!({"iface_id": id, "host_dev_name": net.tap, "num_queue_pairs": pairs});
    if let Some(mac) = &net.mac {
        value["guest_mac"] = json!(mac);
    }
    if let Some(size) = net.queue_size {
        value["queue_size"] = json!(size);
    }
    Ok((id, body("net", value)?))
}

pub fn fs(index: usize, fs: &FsConfig) -> Result<(String, VmmAction), Refusal> {
    check_other(&format!("fs[{index}]."), &fs.other)?;
    let mut value = json!({"tag": fs.tag, "socket": fs.socket});
    if let Some(n) = fs.num_queues {
        value["num_queues"] = json!(n);
    }
    if let Some(n) = fs.queue_size {
        value["queue_size"] = json!(n);
    }
    let id = fs.id.clone().unwrap_or_else(|| format!("_fs{index}"));
    Ok((id, VmmAction::PutFs(body("fs", value)?)))
}

pub fn vsock(vsock: &VsockConfig) -> Result<(String, VmmAction), Refusal> {
    check_other("vsock.", &vsock.other)?;
    let id = vsock.id.clone().unwrap_or_else(|| "_vsock0".into());
    Ok((
        id.clone(),
        VmmAction::PutVsock(body(
            "vsock",
            json!({"vsock_id": id, "guest_cid": vsock.cid, "uds_path": vsock.socket}),
        )?),
    ))
}

pub fn rng(rng: &RngConfig) -> Result<VmmAction, Refusal> {
    check_other("rng.", &rng.other)?;
    Ok(VmmAction::PutEntropy(body(
        "rng",
        json!({"source": rng.src}),
    )?))
}

/// `balloon`: its size in whole MiB becomes the target; no statistics (Cloud Hypervisor
/// has none to ask for).
pub fn balloon(balloon: &BalloonConfig) -> Result<VmmAction, Refusal> {
    check_other("balloon.", &balloon.other)?;
    if balloon.free_page_reporting {
        return Err("balloon.free_page_reporting = true is not supported by gpuvm".into());
    }
    if !balloon.size.is_multiple_of(1 << 20) || balloon.size >> 20 > u64::from(u32::MAX) {
        return Err(format!(
            "balloon.size = {} is not a whole number of MiB gpuvm accepts",
            balloon.size
        ));
    }
    Ok(VmmAction::PutBalloon(
        gpuvm_virtio::balloon::BalloonConfig {
            amount_mib: (balloon.size >> 20) as u32,
            deflate_on_oom: balloon.deflate_on_oom,
            stats_polling_interval_s: 0,
        },
    ))
}

/// A host PCI device by its sysfs path, `/sys/bus/pci/devices/<BDF>`.
pub fn device(index: usize, device: &DeviceConfig) -> Result<GpuBody, Refusal> {
    check_other(&format!("devices[{index}]."), &device.other)?;
    let bdf = device
        .path
        .file_name()
        .and_then(|name| name.to_str())
        .filter(|_| device.path.starts_with("/sys/bus/pci/devices") || device.path.starts_with("/sys/devices"))
        .ok_or_else(|| {
            format!(
                "devices[{index}].path {:?} is not a PCI device's sysfs path (/sys/bus/pci/devices/<BDF>)",
                device.path
            )
        })?;
    let id = device.id.clone().unwrap_or_else(|| format!("_vfio{index}"));
    let mut gpu = GpuBody::new(id, Some(bdf.to_string()), None);
    let clique = device.x_nv_gpudirect_clique.as_ref();
    if let Some(clique) = clique.filter(|value| !value.is_null()) {
        gpu.gpudirect_clique = Some(
            (clique.as_u64())
                .and_then(|id| u8::try_from(id).ok())
                .filter(|id| *id <= MAX_GPUDIRECT_CLIQUE)
                .ok_or_else(|| {
                    format!(
                        "devices[{index}].x_nv_gpudirect_clique = {clique} is not a clique id (0 to {MAX_GPUDIRECT_CLIQUE})"
                    )
                })?,
        );
    }
    gpu.validate(None)
        .map_err(|e| format!("devices[{index}]: {}", e.message))?;
    Ok(gpu)
}

fn console(field: &str, console: Option<&ConsoleConfig>) -> Result<(), Refusal> {
    let Some(console) = console else {
        return Ok(());
    };
    check_other(&format!("{field}."), &console.other)?;
    match console.mode.as_str() {
        // gpuvm's one serial port writes to its stdout; there is no virtio-console.
        "Off" | "Null" | "Tty" => Ok(()),
        mode => Err(format!(
            "{field}.mode = {mode:?} is not supported by gpuvm (Off, Null or Tty: the serial port writes to gpuvm's stdout)"
        )),
    }
}

/// `platform.num_pci_segments` (absent: 1), checked.
pub fn num_pci_segments(config: &VmConfig) -> Result<u16, Refusal> {
    let value = config
        .other
        .get("platform")
        .and_then(|platform| platform.get("num_pci_segments"));
    match value {
        None | Some(serde_json::Value::Null) => Ok(1),
        Some(value) => value
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| (1..=MAX_PCI_SEGMENTS).contains(n))
            .ok_or_else(|| {
                format!(
                    "platform.num_pci_segments = {value}: gpuvm gives a VM 1 to {MAX_PCI_SEGMENTS} PCI segments"
                )
            }),
    }
}

/// A device's `pci_segment` (absent: 0), which must be one of the VM's `count` segments;
/// `field` names the device in the refusal (`disks[0]`).
pub fn pci_segment(field: &str, other: &Other, count: u16) -> Result<u16, Refusal> {
    let Some(value) = other.get("pci_segment").filter(|v| !v.is_null()) else {
        return Ok(0);
    };
    value
        .as_u64()
        .and_then(|n| u16::try_from(n).ok())
        .filter(|&n| n < count)
        .ok_or_else(|| {
            format!(
                "{field}.pci_segment = {value}: the VM has {count} PCI segment(s) \
                 (platform.num_pci_segments), numbered from 0"
            )
        })
}

/// A passthrough device's `pci_segment` (one of the VM's `count`), None for 0: the
/// device goes there at boot, where its host bridge's node is the `numa[]` entry that lists
/// the segment, or by hot-plug into a running VM (that segment's ACPI hot-plug slots).
pub fn passthrough_segment(field: &str, other: &Other, count: u16) -> Result<Option<u16>, Refusal> {
    Ok(Some(pci_segment(field, other, count)?).filter(|&segment| segment != 0))
}

/// `value` as a whole number up to `max`, or a refusal naming `field`.
fn whole_number(field: &str, value: &serde_json::Value, max: u64) -> Result<u64, Refusal> {
    value
        .as_u64()
        .filter(|n| *n <= max)
        .ok_or_else(|| format!("{field} = {value}: expected a whole number from 0 to {max}"))
}

/// `numa`: guest node `guest_numa_id` with its `cpus`, `distances` (to nodes not
/// listed: 20) and `pci_segments` (of the VM's `segments`: their host bridges are the
/// node's, and so are the devices placed on them). gpuvm's guest RAM has no memory zones,
/// so the nodes share the RAM evenly (in whole pages of its backing, the remainder on the
/// first node listed); `memory_zones` is refused. The nodes are checked against the
/// machine when it is built (every vCPU on one node, ids 0 to N-1 once each).
pub fn numa(
    nodes: &[NumaConfig],
    machine: &MachineConfigBody,
    segments: u16,
) -> Result<NumaBody, Refusal> {
    let count = nodes.len() as u64;
    let mut ids = Vec::with_capacity(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        check_other(&format!("numa[{i}]."), &node.other)?;
        let field = format!("numa[{i}].guest_numa_id");
        let id = whole_number(&field, &node.guest_numa_id, count - 1)?;
        if ids.contains(&id) {
            return Err(format!("{field} = {id}: given to two nodes"));
        }
        ids.push(id);
        if node.memory_zones.as_ref().is_some_and(|z| !z.is_empty()) {
            return Err(format!(
                "numa[{i}].memory_zones is not supported by gpuvm: its guest RAM has no memory \
                 zones (leave memory_zones out and the RAM is split evenly across the nodes)"
            ));
        }
    }
    let page_mib = match machine.backing {
        BackingKind::Hugetlb1G => 1024,
        BackingKind::Hugetlb2M => 2,
        BackingKind::Memfd => 1,
    };
    let pages = machine.mem_size_mib / page_mib;
    if pages < count {
        return Err(format!(
            "numa: {count} nodes need at least {count} pages of {page_mib} MiB of RAM"
        ));
    }
    let mut distances = vec![vec![20u8; nodes.len()]; nodes.len()];
    let mut distances_given = false;
    let mut bodies = Vec::with_capacity(nodes.len());
    for (i, (node, id)) in nodes.iter().zip(&ids).enumerate() {
        let cpus = node.cpus.as_deref().unwrap_or_default();
        if cpus.is_empty() {
            return Err(format!(
                "numa[{i}].cpus: gpuvm's guest nodes each need at least one vCPU"
            ));
        }
        let cpus = cpus
            .iter()
            .enumerate()
            .map(|(c, cpu)| {
                whole_number(&format!("numa[{i}].cpus[{c}]"), cpu, 254).map(|c| c as u8)
            })
            .collect::<Result<Vec<u8>, Refusal>>()?;
        let mut node_pages = pages / count;
        if i == 0 {
            node_pages += pages % count;
        }
        let row = *id as usize;
        distances[row][row] = 10;
        for (d, distance) in node.distances.iter().flatten().enumerate() {
            let field = format!("numa[{i}].distances[{d}]");
            check_other(&format!("{field}."), &distance.other)?;
            let to = whole_number(
                &format!("{field}.destination"),
                &distance.destination,
                count - 1,
            )?;
            let value = whole_number(&format!("{field}.distance"), &distance.distance, 255)?;
            if to == *id && value != 10 || to != *id && value <= 10 {
                return Err(format!(
                    "{field}.distance = {value}: a node is 10 from itself and 11 to 255 from another"
                ));
            }
            distances[row][to as usize] = value as u8;
            distances_given = true;
        }
        let pci_segments = (node.pci_segments.iter().flatten().enumerate())
            .map(|(s, segment)| {
                let field = format!("numa[{i}].pci_segments[{s}]");
                let segment = whole_number(&field, segment, u64::from(u16::MAX))?;
                if segment >= u64::from(segments) {
                    return Err(format!(
                        "{field} = {segment}: the VM has {segments} PCI segment(s) \
                         (platform.num_pci_segments), numbered from 0"
                    ));
                }
                Ok(segment as u16)
            })
            .collect::<Result<Vec<u16>, Refusal>>()?;
        bodies.push(NumaNodeBody {
            node: *id as u32,
            cpus,
            mem_mib: node_pages * page_mib,
            host_node: None,
            pci_segments,
        });
    }
    Ok(NumaBody {
        auto: false,
        nodes: bodies,
        distances: distances_given.then_some(distances),
        pin_vcpus: false,
    })
}

/// The pre-boot actions a VmConfig stands for, in order.
pub fn vm_config(config: &VmConfig) -> Result<Vec<VmmAction>, Refusal> {
    check_other("", &config.other)?;
    check_other("payload.", &config.payload.other)?;
    console("serial", config.serial.as_ref())?;
    console("console", config.console.as_ref())?;
    let mut machine_action = machine(config.cpus.as_ref(), config.memory.as_ref())?;
    if let (VmmAction::PutMachineConfig(body), Some(nodes)) = (
        &mut machine_action,
        config.numa.as_deref().filter(|n| !n.is_empty()),
    ) {
        body.numa = Some(numa(nodes, body, num_pci_segments(config)?)?);
    }
    let mut actions = vec![machine_action];
    if config.payload.kernel.is_none() {
        return Err("payload.kernel is required (gpuvm has no firmware boot)".into());
    }
    actions.push(VmmAction::PutBootSource(BootSourceBody {
        kernel_image_path: config.payload.kernel.clone(),
        initrd_path: config.payload.initramfs.clone(),
        boot_args: config.payload.cmdline.clone(),
    }));
    let count = num_pci_segments(config)?;
    let mut segments = std::collections::BTreeMap::new();
    let mut on_segment = |field: String, other: &Other, id: String| {
        let segment = pci_segment(&field, other, count)?;
        if segment != 0 {
            segments.insert(id, segment);
        }
        Ok::<(), Refusal>(())
    };
    for (i, d) in config.disks.iter().enumerate() {
        let (id, action) = disk(i, d)?;
        on_segment(format!("disks[{i}]"), &d.other, id)?;
        actions.push(action);
    }
    for (i, n) in config.net.iter().enumerate() {
        let (id, body) = net(i, n, false)?;
        on_segment(format!("net[{i}]"), &n.other, id)?;
        actions.push(VmmAction::PutNetworkInterface(body));
    }
    for (i, f) in config.fs.iter().enumerate() {
        on_segment(format!("fs[{i}]"), &f.other, f.tag.clone())?;
        actions.push(fs(i, f)?.1);
    }
    if let Some(v) = &config.vsock {
        on_segment("vsock".into(), &v.other, "vsock".into())?;
        actions.push(vsock(v)?.1);
    }
    if let Some(r) = &config.rng {
        on_segment("rng".into(), &r.other, "rng".into())?;
        actions.push(rng(r)?);
    }
    if let Some(b) = &config.balloon {
        // An empty balloon beside passthrough devices could never give memory back
        // (their DMA pins guest RAM): left out, as before gpuvm had a balloon.
        if b.size == 0 && !b.free_page_reporting && !config.devices.is_empty() {
            check_other("balloon.", &b.other)?;
            log::info!(
                "Cloud Hypervisor API: an empty balloon beside passthrough devices is left out"
            );
        } else {
            actions.push(balloon(b)?);
        }
    }
    for (i, d) in config.devices.iter().enumerate() {
        let mut gpu = device(i, d)?;
        gpu.pci_segment = passthrough_segment(&format!("devices[{i}]"), &d.other, count)?;
        actions.push(VmmAction::PutGpu(gpu));
    }
    actions.push(VmmAction::PutPciSegments(PciSegmentsBody {
        num_pci_segments: Some(count),
        devices: segments,
    }));
    Ok(actions)
}
