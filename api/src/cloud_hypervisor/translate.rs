//! Cloud Hypervisor's bodies → gpuvm's actions. A VmConfig becomes the same pre-boot
//! actions gpuvm's own routes make (machine config, boot source, drives, fs, nets, vsock,
//! entropy, GPUs), carried out by the controller as one unit ([`VmmAction::Batch`]).

use serde_json::json;

use gpuvm_vmm::action::{
    BackingKind, BootSourceBody, DriveBody, GpuBody, MachineConfigBody, VmmAction,
};

use super::config::{
    check_other, ConsoleConfig, CpusConfig, DeviceConfig, DiskConfig, FsConfig, MemoryConfig,
    NetConfig, RngConfig, VmConfig, VsockConfig,
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
    if max > boot {
        log::info!(
            "Cloud Hypervisor API: cpus.max_vcpus {max} ignored (gpuvm has no vCPU hot-plug)"
        );
    }
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
    Ok(VmmAction::PutMachineConfig(MachineConfigBody {
        vcpu_count,
        mem_size_mib: size >> 20,
        track_dirty_pages: false,
        backing,
        thp,
        prefault,
        cpuid_masks: Vec::new(),
    }))
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
    let gpu = GpuBody {
        gpu_id: id,
        host_bdf: Some(bdf.to_string()),
        vfio_user_socket: None,
    };
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

/// The pre-boot actions a VmConfig stands for, in order.
pub fn vm_config(config: &VmConfig) -> Result<Vec<VmmAction>, Refusal> {
    check_other("", &config.other)?;
    check_other("payload.", &config.payload.other)?;
    console("serial", config.serial.as_ref())?;
    console("console", config.console.as_ref())?;
    let mut actions = vec![machine(config.cpus.as_ref(), config.memory.as_ref())?];
    if config.payload.kernel.is_none() {
        return Err("payload.kernel is required (gpuvm has no firmware boot)".into());
    }
    actions.push(VmmAction::PutBootSource(BootSourceBody {
        kernel_image_path: config.payload.kernel.clone(),
        initrd_path: config.payload.initramfs.clone(),
        boot_args: config.payload.cmdline.clone(),
    }));
    for (i, d) in config.disks.iter().enumerate() {
        actions.push(disk(i, d)?.1);
    }
    for (i, n) in config.net.iter().enumerate() {
        actions.push(VmmAction::PutNetworkInterface(net(i, n, false)?.1));
    }
    for (i, f) in config.fs.iter().enumerate() {
        actions.push(fs(i, f)?.1);
    }
    if let Some(v) = &config.vsock {
        actions.push(vsock(v)?.1);
    }
    if let Some(r) = &config.rng {
        actions.push(rng(r)?);
    }
    for (i, d) in config.devices.iter().enumerate() {
        actions.push(VmmAction::PutGpu(device(i, d)?));
    }
    Ok(actions)
}
