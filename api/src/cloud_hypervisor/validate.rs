//! Cloud Hypervisor's own rules for a VmConfig (its `VmConfig::validate` and the device
//! configs' `validate`, and the virtqueue sizes its devices accept), checked in one pass
//! before anything is translated: every value Cloud Hypervisor refuses is refused here
//! too, all of them named at once by their field paths (`cpus.max_vcpus`,
//! `disks[0].queue_size`), as 400s. A device added with vm.add-* is checked the same way,
//! as part of the configuration it joins (as Cloud Hypervisor does).
//!
//! What gpuvm does not model at all is refused afterwards by the translation
//! ([`super::config::check_other`]); the rules here are the ones Cloud Hypervisor itself
//! applies to values gpuvm accepts. One rule is left out on purpose: Cloud Hypervisor
//! wants `memory.shared` (or huge pages) for vhost-user devices and virtio-fs, because
//! its guest RAM is private otherwise; gpuvm's guest RAM is always a shared memfd.

use std::collections::BTreeMap;

use serde_json::Value;

use super::config::{Other, VmConfig};

/// The most vCPUs (Cloud Hypervisor's `u8` counts).
const MAX_VCPUS: u64 = 255;
/// Cloud Hypervisor refuses a disk queue of this size or smaller.
const MINIMUM_BLOCK_QUEUE_SIZE: u64 = 2;
/// The largest virtqueue (virtio 1.x: sizes are powers of two up to 32768).
const MAX_QUEUE_SIZE: u64 = 32768;
/// A virtio-fs tag's most bytes (the device's config space).
const FS_TAG_LEN: usize = 36;
/// A disk serial's most bytes (VIRTIO_BLK_ID_BYTES).
const SERIAL_LEN: usize = 20;
/// The smallest MTU virtio-net allows.
const MIN_MTU: u64 = 1280;

/// Checks `config` as Cloud Hypervisor's validation does; the refusal lists every bad
/// value.
pub fn vm_config(config: &VmConfig) -> Result<(), String> {
    let mut refusals = Refusals::default();
    let boot_vcpus = cpus(config, &mut refusals);
    memory(config, &mut refusals);
    for (i, disk) in config.disks.iter().enumerate() {
        let at = format!("disks[{i}]");
        if disk.path.is_some() && disk.vhost_socket.is_some() {
            refusals.push(
                &at,
                "path and vhost_socket are both given (Disk path and vhost socket both provided)",
            );
        }
        if disk.vhost_user && disk.vhost_socket.is_none() {
            refusals.push(
                &format!("{at}.vhost_socket"),
                "vhost_user needs it (No socket provided when using vhost-user)",
            );
        }
        if let Some(serial) = &disk.serial {
            if serial.len() > SERIAL_LEN {
                refusals.push(
                    &format!("{at}.serial"),
                    &format!("{} bytes, at most {SERIAL_LEN}", serial.len()),
                );
            }
        }
        if let Some(size) = number(&disk.other, "queue_size") {
            match size {
                Ok(size) if size <= MINIMUM_BLOCK_QUEUE_SIZE => refusals.value(
                    &format!("{at}.queue_size"),
                    size,
                    &format!(
                        "Queue size is smaller than {}",
                        MINIMUM_BLOCK_QUEUE_SIZE + 1
                    ),
                ),
                Ok(size) => queue_size(&mut refusals, &format!("{at}.queue_size"), size),
                Err(value) => refusals.value(&format!("{at}.queue_size"), value, "not a u16"),
            }
        }
        if let Some(count) = number(&disk.other, "num_queues") {
            queues(
                &mut refusals,
                &format!("{at}.num_queues"),
                count,
                boot_vcpus,
            );
        }
    }
    for (i, net) in config.net.iter().enumerate() {
        let at = format!("net[{i}]");
        if let Some(count) = net.num_queues {
            let count = u64::from(count);
            if count < 2 {
                refusals.value(
                    &format!("{at}.num_queues"),
                    count,
                    "virtio-net needs at least 2 queues (Number of queues to virtio_net less than 2)",
                );
            } else if count / 2 > boot_vcpus {
                refusals.value(
                    &format!("{at}.num_queues"),
                    count,
                    &format!(
                        "{} queue pairs for {boot_vcpus} boot vCPU(s) (Number of vCPUs is insufficient for number of queues)",
                        count / 2
                    ),
                );
            }
        }
        if let Some(size) = net.queue_size {
            queue_size(&mut refusals, &format!("{at}.queue_size"), u64::from(size));
        }
        if let Some(mtu) = number(&net.other, "mtu") {
            match mtu {
                Ok(mtu) if mtu != 0 && mtu < MIN_MTU => refusals.value(
                    &format!("{at}.mtu"),
                    mtu,
                    &format!("lower than {MIN_MTU} (expected by the VIRTIO specification)"),
                ),
                Ok(_) => {}
                Err(value) => refusals.value(&format!("{at}.mtu"), value, "not a u16"),
            }
        }
    }
    for (i, fs) in config.fs.iter().enumerate() {
        let at = format!("fs[{i}]");
        if fs.tag.is_empty() || fs.tag.len() > FS_TAG_LEN {
            refusals.push(
                &format!("{at}.tag"),
                &format!("{} bytes: a tag is 1 to {FS_TAG_LEN}", fs.tag.len()),
            );
        }
        if let Some(count) = fs.num_queues {
            queues(
                &mut refusals,
                &format!("{at}.num_queues"),
                Ok(u64::from(count)),
                boot_vcpus,
            );
        }
        if let Some(size) = fs.queue_size {
            queue_size(&mut refusals, &format!("{at}.queue_size"), u64::from(size));
        }
    }
    if let Some(vsock) = &config.vsock {
        if vsock.cid > u64::from(u32::MAX) {
            refusals.value("vsock.cid", vsock.cid, "not a u32");
        } else if [0, 1, 2, u64::from(u32::MAX)].contains(&vsock.cid) {
            refusals.value(
                "vsock.cid",
                vsock.cid,
                "a special VSOCK CID, unsuitable for a VM",
            );
        }
    }
    if let (Some(balloon), Some(memory)) = (&config.balloon, &config.memory) {
        if balloon.size >= memory.size {
            refusals.value(
                "balloon.size",
                balloon.size,
                &format!(
                    "not less than memory.size = {} (Balloon size greater than RAM)",
                    memory.size
                ),
            );
        }
    }
    let mut paths: BTreeMap<&std::path::Path, usize> = BTreeMap::new();
    for (i, device) in config.devices.iter().enumerate() {
        if let Some(first) = paths.insert(&device.path, i) {
            refusals.push(
                &format!("devices[{i}].path"),
                &format!(
                    "{:?} is also devices[{first}]'s (Duplicated device path)",
                    device.path
                ),
            );
        }
    }
    identifiers(config, &mut refusals);
    refusals.into_result()
}

/// The refused values, in the order found.
#[derive(Default)]
struct Refusals(Vec<String>);

impl Refusals {
    fn push(&mut self, field: &str, why: &str) {
        self.0.push(format!("{field}: {why}"));
    }

    fn value(&mut self, field: &str, value: impl std::fmt::Display, why: &str) {
        self.0.push(format!("{field} = {value}: {why}"));
    }

    fn into_result(self) -> Result<(), String> {
        if self.0.is_empty() {
            return Ok(());
        }
        // The first field path leads (the cloud-hypervisor command line blames the
        // option by it).
        Err(format!(
            "{} (Cloud Hypervisor's validation refuses these too)",
            self.0.join("; ")
        ))
    }
}

/// `cpus`: the boot and most vCPUs and the topology. Returns the boot vCPUs (1 when
/// unusable, so that the queue checks still run).
fn cpus(config: &VmConfig, refusals: &mut Refusals) -> u64 {
    let Some(cpus) = &config.cpus else {
        return 1;
    };
    let (boot, max) = (u64::from(cpus.boot_vcpus), u64::from(cpus.max_vcpus));
    for (field, count) in [("cpus.boot_vcpus", boot), ("cpus.max_vcpus", max)] {
        if count == 0 || count > MAX_VCPUS {
            refusals.value(field, count, &format!("1 to {MAX_VCPUS} vCPUs"));
        }
    }
    if max < boot {
        refusals.value(
            "cpus.max_vcpus",
            max,
            &format!("lower than cpus.boot_vcpus = {boot} (Max CPUs lower than boot CPUs)"),
        );
    }
    if let Some(Value::Object(topology)) = cpus.other.get("topology") {
        const PARTS: [&str; 4] = [
            "threads_per_core",
            "cores_per_die",
            "dies_per_package",
            "packages",
        ];
        let mut product = Some(1u64);
        for part in PARTS {
            let field = format!("cpus.topology.{part}");
            match topology.get(part) {
                None | Some(Value::Null) => product = None,
                Some(value) => match value.as_u64().filter(|n| (1..=255).contains(n)) {
                    Some(n) => product = product.map(|p| p * n),
                    None => {
                        refusals.value(
                            &field,
                            value,
                            "1 to 255 (No part of the CPU topology can be zero)",
                        );
                        product = None;
                    }
                },
            }
        }
        if let Some(product) = product.filter(|&p| p != max) {
            refusals.value(
                "cpus.topology",
                product,
                &format!(
                    "its parts' product is not cpus.max_vcpus = {max} (Product of CPU topology parts does not match maximum vCPU)"
                ),
            );
        }
    }
    boot.clamp(1, MAX_VCPUS)
}

fn memory(config: &VmConfig, refusals: &mut Refusals) {
    let Some(memory) = &config.memory else {
        return;
    };
    if let Some(size) = memory.hugepage_size {
        if !memory.hugepages {
            refusals.value(
                "memory.hugepage_size",
                size,
                "memory.hugepages is false (Huge page size specified but huge pages not enabled)",
            );
        } else if !size.is_power_of_two() {
            refusals.value("memory.hugepage_size", size, "not a power of 2");
        }
    }
}

/// A virtqueue size: a power of two, at most 32768.
fn queue_size(refusals: &mut Refusals, field: &str, size: u64) {
    if size == 0 || !size.is_power_of_two() || size > MAX_QUEUE_SIZE {
        refusals.value(
            field,
            size,
            &format!("a virtqueue's size is a power of 2, at most {MAX_QUEUE_SIZE}"),
        );
    }
}

/// A device's queue count: at most one per boot vCPU.
fn queues(refusals: &mut Refusals, field: &str, count: Result<u64, &Value>, boot: u64) {
    match count {
        Ok(count) if count > boot => refusals.value(
            field,
            count,
            &format!(
                "more than the {boot} boot vCPU(s) (Number of vCPUs is insufficient for number of queues)"
            ),
        ),
        Ok(_) => {}
        Err(value) => refusals.value(field, value, "not a number of queues"),
    }
}

/// `other[name]` when given (not null): a u16, or the value that is not one.
fn number<'v>(other: &'v Other, name: &str) -> Option<Result<u64, &'v Value>> {
    let value = other.get(name).filter(|v| !v.is_null())?;
    Some(
        value
            .as_u64()
            .filter(|n| *n <= u64::from(u16::MAX))
            .ok_or(value),
    )
}

/// Device ids: unique in the VM, none starting with `__` (Cloud Hypervisor's own).
fn identifiers(config: &VmConfig, refusals: &mut Refusals) {
    let mut ids: Vec<(String, &str)> = Vec::new();
    fn add<'c>(ids: &mut Vec<(String, &'c str)>, field: String, id: &'c Option<String>) {
        if let Some(id) = id {
            ids.push((field, id.as_str()));
        }
    }
    for (i, d) in config.disks.iter().enumerate() {
        add(&mut ids, format!("disks[{i}].id"), &d.id);
    }
    for (i, n) in config.net.iter().enumerate() {
        add(&mut ids, format!("net[{i}].id"), &n.id);
    }
    for (i, f) in config.fs.iter().enumerate() {
        add(&mut ids, format!("fs[{i}].id"), &f.id);
    }
    for (i, d) in config.devices.iter().enumerate() {
        add(&mut ids, format!("devices[{i}].id"), &d.id);
    }
    if let Some(v) = &config.vsock {
        add(&mut ids, "vsock.id".into(), &v.id);
    }
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (field, id) in &ids {
        if id.starts_with("__") {
            refusals.value(
                field,
                format!("{id:?}"),
                "ids starting with __ are reserved",
            );
        }
        if let Some(first) = seen.insert(id, field) {
            refusals.value(
                field,
                format!("{id:?}"),
                &format!("{first} has it too (Identifier is not unique)"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn config(value: Value) -> VmConfig {
        serde_json::from_value(value).unwrap()
    }

    fn refused(value: Value) -> String {
        vm_config(&config(value)).unwrap_err()
    }

    #[test]
    fn every_refused_value_is_named_in_one_answer() {
        let message = refused(json!({
            "payload": {"kernel": "/k"},
            "cpus": {"boot_vcpus": 2, "max_vcpus": 1},
            "disks": [
                {"path": "/a", "queue_size": 0},
                {"path": "/b", "queue_size": 3},
                {"path": "/c", "queue_size": 65536},
                {"path": "/d", "queue_size": 2}
            ]
        }));
        for needle in [
            "cpus.max_vcpus = 1: lower than cpus.boot_vcpus = 2",
            "disks[0].queue_size = 0",
            "disks[1].queue_size = 3: a virtqueue's size is a power of 2",
            "disks[2].queue_size = 65536: not a u16",
            "disks[3].queue_size = 2: Queue size is smaller than 3",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        assert_eq!(message.matches("; ").count(), 4, "{message}");
        let message = refused(json!({
            "payload": {"kernel": "/k"},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 65535}
        }));
        assert!(
            message.contains("cpus.max_vcpus = 65535: 1 to 255 vCPUs"),
            "{message}"
        );
    }

    #[test]
    fn cloud_hypervisor_rules_beyond_cpus_and_disks() {
        let message = refused(json!({
            "payload": {"kernel": "/k"},
            "cpus": {"boot_vcpus": 1, "max_vcpus": 4,
                     "topology": {"threads_per_core": 1, "cores_per_die": 2,
                                  "dies_per_package": 1, "packages": 1}},
            "memory": {"size": 134217728, "hugepage_size": 2097152},
            "disks": [{"path": "/a", "vhost_socket": "/s", "id": "x"},
                      {"vhost_user": true, "id": "x", "num_queues": 2}],
            "net": [{"tap": "t", "num_queues": 1, "queue_size": 100}],
            "fs": [{"tag": "", "socket": "/s", "queue_size": 1000}],
            "vsock": {"cid": 2, "socket": "/v"},
            "balloon": {"size": 134217728},
            "devices": [{"path": "/sys/bus/pci/devices/0000:01:00.0"},
                        {"path": "/sys/bus/pci/devices/0000:01:00.0", "id": "__dev"}]
        }));
        for needle in [
            "cpus.topology = 2: its parts' product is not cpus.max_vcpus = 4",
            "memory.hugepage_size = 2097152: memory.hugepages is false",
            "disks[0]: path and vhost_socket are both given",
            "disks[1].vhost_socket: vhost_user needs it",
            "disks[1].num_queues = 2: more than the 1 boot vCPU(s)",
            "disks[1].id = \"x\": disks[0].id has it too",
            "net[0].num_queues = 1: virtio-net needs at least 2 queues",
            "net[0].queue_size = 100",
            "fs[0].tag: 0 bytes",
            "fs[0].queue_size = 1000",
            "vsock.cid = 2: a special VSOCK CID",
            "balloon.size = 134217728: not less than memory.size",
            "devices[1].path",
            "devices[1].id = \"__dev\": ids starting with __ are reserved",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
    }

    #[test]
    fn what_cloud_hypervisor_accepts_passes() {
        vm_config(&config(json!({
            "payload": {"kernel": "/k"},
            "cpus": {"boot_vcpus": 2, "max_vcpus": 8,
                     "topology": {"threads_per_core": 1, "cores_per_die": 8, "dies_per_package": 1}},
            "memory": {"size": 2147483648u64, "hugepages": true, "hugepage_size": 2097152},
            "disks": [{"path": "/a", "queue_size": 128, "num_queues": 1},
                      {"path": "/b", "queue_size": 1024, "id": "data"}],
            "net": [{"tap": "t", "num_queues": 4, "queue_size": 256}],
            "fs": [{"tag": "kataShared", "socket": "/s", "num_queues": 1, "queue_size": 1024}],
            "vsock": {"cid": 3, "socket": "/v"},
            "balloon": {"size": 0},
            "devices": [{"path": "/sys/bus/pci/devices/0000:01:00.0", "id": "gpu0"}]
        })))
        .unwrap();
    }
}
