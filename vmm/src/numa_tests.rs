use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::config::PassthroughTuning;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A fake sysfs tree, removed when dropped.
struct FakeSysfs {
    root: PathBuf,
}

impl FakeSysfs {
    /// Host nodes with `cpulist`s and a distance matrix (`distances[i]` is node i's row).
    fn new(cpulists: &[&str], distances: &[&[u32]]) -> FakeSysfs {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "gpuvm-numa-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        for (node, cpulist) in cpulists.iter().enumerate() {
            let dir = root.join(format!("devices/system/node/node{node}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cpulist"), format!("{cpulist}\n")).unwrap();
            let row: Vec<String> = distances[node].iter().map(u32::to_string).collect();
            std::fs::write(dir.join("distance"), format!("{}\n", row.join(" "))).unwrap();
        }
        FakeSysfs { root }
    }

    fn gpu(&self, bdf: &str, node: i32) {
        let dir = self.root.join(format!("bus/pci/devices/{bdf}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{node}\n")).unwrap();
    }

    fn host(&self) -> HostNuma {
        HostNuma::at(&self.root)
    }
}

impl Drop for FakeSysfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn two_sockets() -> FakeSysfs {
    FakeSysfs::new(&["0-55,112-167", "56-111,168-223"], &[&[10, 21], &[21, 10]])
}

/// Eight GPUs as on an HGX board: four under each socket.
fn eight_gpus(sysfs: &FakeSysfs) -> PciOptions {
    let bdfs = [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ];
    for (index, bdf) in bdfs.iter().enumerate() {
        sysfs.gpu(bdf, if index < 4 { 0 } else { 1 });
    }
    PciOptions {
        gpus: bdfs.iter().map(|b| b.to_string()).collect(),
        ..PciOptions::default()
    }
}

fn auto() -> NumaOptions {
    NumaOptions {
        mode: NumaMode::Auto,
        pin_vcpus: false,
        distances: None,
    }
}

#[test]
fn auto_on_a_two_socket_host_with_eight_gpus_gives_two_nodes() {
    let sysfs = two_sockets();
    let pci = eight_gpus(&sysfs);
    let plan = plan(
        &auto(),
        13,
        13,
        64 * GIB + 6 * MIB,
        4096,
        &pci,
        &sysfs.host(),
    )
    .unwrap()
    .expect("two nodes");
    assert_eq!(plan.nodes.len(), 2);
    assert_eq!(
        plan.nodes[0].cpus,
        (0..7).collect::<Vec<u8>>(),
        "remainder first"
    );
    assert_eq!(plan.nodes[1].cpus, (7..13).collect::<Vec<u8>>());
    assert_eq!(plan.nodes[0].mem_size, 32 * GIB + 4 * MIB);
    assert_eq!(plan.nodes[1].mem_size, 32 * GIB + 2 * MIB);
    assert_eq!(plan.nodes[0].host_node, Some(0));
    assert_eq!(plan.nodes[1].host_node, Some(1));
    assert_eq!(plan.distances, vec![vec![10, 21], vec![21, 10]]);
    for (index, bdf) in pci.gpus.iter().enumerate() {
        let expected = if index < 4 { 0 } else { 1 };
        assert_eq!(plan.device_nodes.get(bdf), Some(&expected), "{bdf}");
    }
}

#[test]
fn auto_counts_hot_pluggable_vcpus_and_uses_vfio_user_topology_bdfs() {
    let sysfs = two_sockets();
    sysfs.gpu("0000:18:00.0", 0);
    sysfs.gpu("0000:9a:00.0", 1);
    let mut pci = PciOptions {
        vfio_user: vec![
            "/run/a.sock".into(),
            "/run/b.sock".into(),
            "/run/c.sock".into(),
        ],
        ..PciOptions::default()
    };
    for (socket, bdf) in [
        ("/run/a.sock", "0000:18:00.0"),
        ("/run/b.sock", "0000:9a:00.0"),
    ] {
        pci.tuning.insert(
            socket.into(),
            PassthroughTuning {
                topology_bdf: Some(bdf.into()),
                ..PassthroughTuning::default()
            },
        );
    }
    let plan = plan(&auto(), 2, 4, 1024 * MIB, 4096, &pci, &sysfs.host())
        .unwrap()
        .unwrap();
    assert_eq!(plan.nodes[0].cpus, vec![0, 1]);
    assert_eq!(plan.nodes[1].cpus, vec![2, 3]);
    assert_eq!(plan.device_nodes.get("/run/a.sock"), Some(&0));
    assert_eq!(plan.device_nodes.get("/run/b.sock"), Some(&1));
    assert_eq!(
        plan.device_nodes.get("/run/c.sock"),
        None,
        "no topology_bdf"
    );
}

#[test]
fn auto_on_a_single_socket_host_or_with_gpus_on_one_node_gives_no_nodes() {
    let single = FakeSysfs::new(&["0-63"], &[&[10]]);
    let pci = eight_gpus(&single);
    assert_eq!(
        plan(&auto(), 8, 8, 8 * GIB, 4096, &pci, &single.host()).unwrap(),
        None
    );

    let sysfs = two_sockets();
    let mut pci = eight_gpus(&sysfs);
    for bdf in &pci.gpus {
        sysfs.gpu(bdf, 1);
    }
    assert_eq!(
        plan(&auto(), 8, 8, 8 * GIB, 4096, &pci, &sysfs.host()).unwrap(),
        None,
        "all GPUs on node 1"
    );
    pci.gpus.clear();
    assert_eq!(
        plan(&auto(), 8, 8, 8 * GIB, 4096, &pci, &sysfs.host()).unwrap(),
        None,
        "no GPU"
    );
}

#[test]
fn auto_refuses_too_few_vcpus_or_too_little_ram() {
    let sysfs = two_sockets();
    let pci = eight_gpus(&sysfs);
    let error = plan(&auto(), 1, 1, GIB, 4096, &pci, &sysfs.host()).unwrap_err();
    assert!(error.to_string().contains("at least 2 vCPUs"), "{error}");
    let error = plan(&auto(), 2, 2, 2 * MIB, 4096, &pci, &sysfs.host()).unwrap_err();
    assert!(error.to_string().contains("cannot be split"), "{error}");
}

#[test]
fn host_distances_that_a_guest_cannot_be_told_become_20() {
    let sysfs = FakeSysfs::new(&["0", "1", "2"], &[&[10, 10, 32], &[10, 10], &[32, 12, 10]]);
    let host = sysfs.host();
    assert_eq!(
        host_distances(&host, &[0, 1, 2]).unwrap(),
        vec![vec![10, 20, 32], vec![20, 10, 20], vec![32, 12, 10]]
    );
}

fn node(node: u32, cpus: &[u8], mib: u64, host_node: Option<u32>) -> NumaNodeSpec {
    NumaNodeSpec {
        node,
        cpus: cpus.to_vec(),
        mem_size: mib * MIB,
        host_node,
        pci_segments: Vec::new(),
    }
}

fn explicit(nodes: Vec<NumaNodeSpec>) -> NumaOptions {
    NumaOptions {
        mode: NumaMode::Nodes(nodes),
        pin_vcpus: true,
        distances: None,
    }
}

#[test]
fn explicit_nodes_are_checked_against_the_vm() {
    let sysfs = two_sockets();
    let host = sysfs.host();
    let pci = PciOptions::default();
    let good = explicit(vec![
        node(1, &[2, 3], 512, Some(1)),
        node(0, &[0, 1], 512, Some(0)),
    ]);
    let planned = plan(&good, 4, 4, GIB, 4096, &pci, &host).unwrap().unwrap();
    assert_eq!(planned.nodes[0].cpus, vec![0, 1], "sorted by node id");
    assert_eq!(planned.distances, vec![vec![10, 20], vec![20, 10]]);
    assert!(planned.pin_vcpus);

    let cases = [
        (
            vec![node(0, &[0, 1], 512, None), node(0, &[2, 3], 512, None)],
            "given twice",
        ),
        (
            vec![node(0, &[0, 1], 512, None), node(2, &[2, 3], 512, None)],
            "leaves a gap",
        ),
        (
            vec![node(0, &[0, 1], 512, None), node(1, &[1, 2, 3], 512, None)],
            "vCPU 1 is on node 0 and node 1",
        ),
        (
            vec![node(0, &[0, 1], 512, None), node(1, &[2], 512, None)],
            "vCPU 3 is on no node",
        ),
        (
            vec![node(0, &[0, 1], 512, None), node(1, &[2, 3, 4], 512, None)],
            "lists vCPU 4",
        ),
        (
            vec![node(0, &[0, 1], 512, None), node(1, &[2, 3], 256, None)],
            "adds up to 768 MiB",
        ),
        (
            vec![node(0, &[0, 1], 1024, None), node(1, &[2, 3], 0, None)],
            "positive multiple",
        ),
        (
            vec![node(0, &[0, 1, 2, 3], 1024, Some(2))],
            "host NUMA node 2 does not exist on this host (its nodes: 0, 1)",
        ),
        (vec![node(0, &[], 1024, None)], "no cpus"),
    ];
    for (nodes, expected) in cases {
        let error = plan(&explicit(nodes), 4, 4, GIB, 4096, &pci, &host).unwrap_err();
        assert!(error.to_string().contains(expected), "{error} / {expected}");
    }
    // Hot-pluggable vCPUs need a node too.
    let error = plan(&good, 4, 6, GIB, 4096, &pci, &host).unwrap_err();
    assert!(
        error.to_string().contains("vCPU 4 is on no node"),
        "{error}"
    );
    // Hugetlb 1 GiB pages: node sizes in whole pages.
    let error = plan(&good, 4, 4, GIB, GIB, &pci, &host).unwrap_err();
    assert!(error.to_string().contains("1 GiB page size"), "{error}");
}

/// A node's PCI segments (Cloud Hypervisor's numa[].pci_segments) must be segments the VM
/// has, each on one node; the SRAT's topology then gives each its node.
#[test]
fn nodes_pci_segments_are_checked_and_reach_the_topology() {
    let sysfs = two_sockets();
    let host = sysfs.host();
    let with_segments = |zero: &[u16], one: &[u16]| {
        let mut nodes = vec![node(0, &[0, 1], 512, None), node(1, &[2, 3], 512, None)];
        nodes[0].pci_segments = zero.to_vec();
        nodes[1].pci_segments = one.to_vec();
        explicit(nodes)
    };
    let pci = PciOptions {
        num_pci_segments: 3,
        ..PciOptions::default()
    };
    let planned = plan(&with_segments(&[0], &[1, 2]), 4, 4, GIB, 4096, &pci, &host)
        .unwrap()
        .unwrap();
    assert_eq!(planned.nodes[1].pci_segments, [1, 2]);
    let regions = gpuvm_arch::x86_64::layout::ram_regions(GIB);
    let topology = planned.topology_of(&regions, &[]);
    assert_eq!(topology.segment_domains, [(0, 0), (1, 1), (2, 1)]);
    for (zero, one, says) in [
        (
            &[0u16][..],
            &[3u16][..],
            "node 1 lists PCI segment 3, but the VM has segments 0 to 2",
        ),
        (&[1], &[1], "PCI segment 1 is on node 0 and node 1"),
    ] {
        let error = plan(&with_segments(zero, one), 4, 4, GIB, 4096, &pci, &host).unwrap_err();
        assert!(error.to_string().contains(says), "{error}");
    }
    // One segment by default: segment 1 is not the VM's.
    let error = plan(
        &with_segments(&[], &[1]),
        4,
        4,
        GIB,
        4096,
        &PciOptions::default(),
        &host,
    )
    .unwrap_err();
    assert!(error.to_string().contains("segments 0 to 0"), "{error}");
}

#[test]
fn topology_splits_node_ram_at_the_32_bit_hole_and_names_devices() {
    let plan = NumaPlan {
        nodes: vec![
            NodePlan {
                cpus: vec![0, 2],
                mem_size: 2 * GIB,
                host_node: Some(0),
                pci_segments: Vec::new(),
            },
            NodePlan {
                cpus: vec![1, 3],
                mem_size: 2 * GIB,
                host_node: Some(1),
                pci_segments: Vec::new(),
            },
        ],
        distances: vec![vec![10, 21], vec![21, 10]],
        device_nodes: [("0000:9a:00.0".to_string(), 1)].into_iter().collect(),
        pin_vcpus: false,
    };
    let regions = gpuvm_arch::x86_64::layout::ram_regions(4 * GIB);
    let topology = plan.topology_of(
        &regions,
        &[
            ("0000:18:00.0".into(), (0, 0, 1, 0)),
            ("0000:9a:00.0".into(), (0, 0, 2, 0)),
        ],
    );
    assert_eq!(topology.cpu_domains, vec![0, 1, 0, 1]);
    let ranges: Vec<(u32, u64, u64)> = topology
        .memory
        .iter()
        .map(|m| (m.domain, m.base, m.size))
        .collect();
    assert_eq!(
        ranges,
        vec![(0, 0, 2 * GIB), (1, 2 * GIB, GIB), (1, 4 * GIB, GIB),],
        "node 1 is split around the 32-bit hole at 3 GiB"
    );
    assert_eq!(topology.initiators.len(), 1);
    assert_eq!(
        (topology.initiators[0].domain, topology.initiators[0].device),
        (1, 2)
    );
}

#[test]
fn host_facts_are_read_from_the_tree() {
    let sysfs = two_sockets();
    sysfs.gpu("0000:18:00.0", -1);
    let host = sysfs.host();
    assert_eq!(host.nodes().unwrap(), vec![0, 1]);
    assert_eq!(host.cpus_of(1).unwrap().len(), 112);
    assert_eq!(
        host.pci_device_node("18:00.0").unwrap(),
        None,
        "-1 is unknown"
    );
    assert_eq!(
        host.pci_device_node("0000:77:00.0").unwrap(),
        None,
        "absent"
    );
    assert_eq!(
        host.distances_from(0).unwrap(),
        [(0, 10), (1, 21)].into_iter().collect()
    );
    assert_eq!(parse_cpu_list("0-2,5,7-8"), Some(vec![0, 1, 2, 5, 7, 8]));
    assert_eq!(parse_cpu_list("3-1"), None);
    assert_eq!(parse_cpu_list("x"), None);
    assert_eq!(parse_label_bdf("00:1f.3 gpu0"), Some((0, 0, 0x1f, 3)));
    assert_eq!(
        parse_label_bdf("0001:03:00.0 vfio-user:/run/gpu4.sock"),
        Some((1, 3, 0, 0))
    );
    assert_eq!(parse_label_bdf("0001:03:00 gpu"), None);
    assert_eq!(parse_label_bdf("nonsense"), None);
}

#[test]
fn this_hosts_node_0_exists_and_its_ram_can_be_bound() {
    let host = HostNuma::at(Path::new("/sys"));
    host.check_node(0).unwrap();
    let error = host.check_node(4000).unwrap_err();
    assert!(error.to_string().contains("does not exist"), "{error}");
    let regions = gpuvm_arch::x86_64::layout::ram_regions(64 * MIB);
    let mut config = gpuvm_memory::GuestRamConfig::new(64 * MIB);
    config.thp = false;
    let ram = GuestRam::create(&config, &regions).unwrap();
    let plan = NumaPlan {
        nodes: vec![
            NodePlan {
                cpus: vec![0],
                mem_size: 32 * MIB,
                host_node: Some(0),
                pci_segments: Vec::new(),
            },
            NodePlan {
                cpus: vec![1],
                mem_size: 32 * MIB,
                host_node: Some(0),
                pci_segments: Vec::new(),
            },
        ],
        distances: vec![vec![10, 20], vec![20, 10]],
        device_nodes: BTreeMap::new(),
        pin_vcpus: false,
    };
    plan.place(Some(&ram), &host).unwrap();
}

#[test]
fn without_numa_nothing_of_the_host_is_read() {
    // A device whose numa_node file cannot be parsed would be an error in auto mode.
    let sysfs = two_sockets();
    let dir = sysfs.root.join("bus/pci/devices/0000:18:00.0");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("numa_node"), "garbage\n").unwrap();
    let pci = PciOptions {
        gpus: vec!["0000:18:00.0".into()],
        ..PciOptions::default()
    };
    let off = NumaOptions::default();
    assert_eq!(
        plan(&off, 2, 2, GIB, 4096, &pci, &sysfs.host()).unwrap(),
        None
    );
    let error = plan(&auto(), 2, 2, GIB, 4096, &pci, &sysfs.host()).unwrap_err();
    assert!(
        error.to_string().contains("cannot parse \"garbage\""),
        "{error}"
    );
}

#[test]
fn hot_pluggable_ram_is_a_hot_pluggable_range_of_the_last_node_above_boot_ram() {
    let plan = NumaPlan {
        nodes: vec![
            NodePlan {
                cpus: vec![0],
                mem_size: 256 * MIB,
                host_node: None,
                pci_segments: Vec::new(),
            },
            NodePlan {
                cpus: vec![1],
                mem_size: 256 * MIB,
                host_node: None,
                pci_segments: Vec::new(),
            },
        ],
        distances: vec![vec![10, 20], vec![20, 10]],
        device_nodes: BTreeMap::new(),
        pin_vcpus: false,
    };
    let regions = gpuvm_arch::x86_64::layout::ram_regions(512 * MIB);
    let labels = ["00:01.0 gpu".to_string()];
    let keys = ["/run/a.sock".to_string()];
    let without = plan.topology(&regions, 0, &keys, &labels, &BTreeMap::new());
    assert!(without.memory.iter().all(|m| !m.hotpluggable));
    assert!(
        without.initiators.is_empty(),
        "the device's node is unknown"
    );
    let with = plan.topology(&regions, 3 * GIB, &keys, &labels, &BTreeMap::new());
    let last = with.memory.last().unwrap();
    let (base, size) = gpuvm_arch::x86_64::layout::ram_hotplug_area(512 * MIB, 3 * GIB);
    assert_eq!((last.domain, last.base, last.size), (1, base, size));
    assert!(last.hotpluggable && base >= 4 * GIB);
    assert_eq!(
        with.memory.iter().filter(|m| m.hotpluggable).count(),
        1,
        "one hot-plug area"
    );
    assert_eq!(
        &with.memory[..with.memory.len() - 1],
        without.memory.as_slice(),
        "boot RAM unchanged"
    );
}

#[test]
fn the_hot_plug_area_goes_to_the_node_of_the_highest_boot_ram() {
    let node = |cpus: Vec<u8>, mem_size| NodePlan {
        cpus,
        mem_size,
        host_node: None,
        pci_segments: Vec::new(),
    };
    let distances = vec![vec![10, 20, 20], vec![20, 10, 20], vec![20, 20, 10]];
    // Three nodes over 6 GiB: node 2's RAM lies above the 32-bit hole, the highest.
    let plan = NumaPlan {
        nodes: vec![
            node(vec![0], 2 * GIB),
            node(vec![1], 2 * GIB),
            node(vec![2], 2 * GIB),
        ],
        distances: distances.clone(),
        device_nodes: BTreeMap::new(),
        pin_vcpus: false,
    };
    let regions = gpuvm_arch::x86_64::layout::ram_regions(6 * GIB);
    let topology = plan.topology(&regions, GIB, &[], &[], &BTreeMap::new());
    let area = topology.memory.last().unwrap();
    let top = regions.iter().map(RamRegion::end).max().unwrap();
    assert_eq!(top, 7 * GIB, "1 GiB below the hole moved above 4 GiB");
    assert_eq!((area.domain, area.base, area.size), (2, 7 * GIB, GIB));
    assert!(area.hotpluggable);
    // One node: the area is node 0's.
    let single = NumaPlan {
        nodes: vec![node(vec![0, 1], 512 * MIB)],
        distances: vec![vec![10]],
        device_nodes: BTreeMap::new(),
        pin_vcpus: false,
    };
    let regions = gpuvm_arch::x86_64::layout::ram_regions(512 * MIB);
    let topology = single.topology(&regions, GIB, &[], &[], &BTreeMap::new());
    assert_eq!(topology.memory.last().map(|m| m.domain), Some(0));
    // And the SRAT encodes it: enabled and hot-pluggable.
    let srat = gpuvm_arch::x86_64::acpi::numa::srat(&topology).unwrap();
    let last = srat.len() - 40;
    assert_eq!(srat[last], 1, "memory affinity");
    assert_eq!(
        u64::from_le_bytes(srat[last + 8..last + 16].try_into().unwrap()),
        4 * GIB
    );
    assert_eq!(
        u32::from_le_bytes(srat[last + 28..last + 32].try_into().unwrap()),
        3
    );
}

#[test]
fn given_distances_replace_gpuvms_and_are_checked() {
    let sysfs = two_sockets();
    let host = sysfs.host();
    let pci = PciOptions::default();
    let nodes = vec![node(0, &[0, 1], 512, None), node(1, &[2, 3], 512, None)];
    let mut options = explicit(nodes);
    options.distances = Some(vec![vec![10, 32], vec![17, 10]]);
    let planned = plan(&options, 4, 4, GIB, 4096, &pci, &host)
        .unwrap()
        .unwrap();
    assert_eq!(planned.distances, vec![vec![10, 32], vec![17, 10]]);

    for (distances, expected) in [
        (vec![vec![10, 20]], "2 rows of 2"),
        (vec![vec![10, 20], vec![20]], "2 rows of 2"),
        (vec![vec![11, 20], vec![20, 10]], "node 0 to node 0 is 11"),
        (vec![vec![10, 10], vec![20, 10]], "node 0 to node 1 is 10"),
    ] {
        options.distances = Some(distances);
        let error = plan(&options, 4, 4, GIB, 4096, &pci, &host)
            .unwrap_err()
            .to_string();
        assert!(error.contains(expected), "{error}");
    }
}

#[test]
fn hostile_host_files_are_clear_errors_in_bounded_time() {
    use gpuvm_vfio::sysfs::hostile::Hostile;
    for hostile in Hostile::ALL {
        for file in ["numa_node", "cpulist", "distance"] {
            let sysfs = two_sockets();
            let pci = eight_gpus(&sysfs);
            let path = match file {
                "numa_node" => sysfs.root.join("bus/pci/devices/0000:18:00.0/numa_node"),
                _ => sysfs.root.join(format!("devices/system/node/node0/{file}")),
            };
            hostile.create(&path).unwrap();
            let host = sysfs.host();
            let started = std::time::Instant::now();
            let result = match file {
                "cpulist" => host.cpus_of(0).map(|_| ()),
                "distance" => plan(&auto(), 8, 8, 4 * GIB, 4096, &pci, &host).map(|_| ()),
                _ => plan(&auto(), 8, 8, 4 * GIB, 4096, &pci, &host).map(|_| ()),
            };
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{hostile:?} {file}: {:?}",
                started.elapsed()
            );
            let error = result.expect_err(&format!("{hostile:?} {file} must be refused"));
            let message = error.to_string();
            assert!(
                message.starts_with("--numa: ") && message.contains(file),
                "{hostile:?} {file}: {message}"
            );
        }
    }
}

#[test]
fn a_cpu_list_without_bound_is_refused() {
    assert_eq!(parse_cpu_list("0-18446744073709551615"), None);
    assert_eq!(parse_cpu_list(&format!("{MAX_HOST_CPUS}")), None);
    let repeated = ["0-40000"; 4].join(",");
    assert_eq!(parse_cpu_list(&repeated), None, "the total is bounded too");
    let largest = MAX_HOST_CPUS - 1;
    assert_eq!(
        parse_cpu_list(&format!("0,{largest}")),
        Some(vec![0, largest])
    );
}

#[test]
fn auto_refuses_a_device_on_a_node_the_host_does_not_list() {
    let sysfs = two_sockets();
    let pci = eight_gpus(&sysfs);
    sysfs.gpu("0000:db:00.0", 7);
    let error = plan(&auto(), 8, 8, 4 * GIB, 4096, &pci, &sysfs.host()).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("0000:db:00.0") && message.contains("host node 7"),
        "{message}"
    );
    assert!(message.contains("the host's nodes: 0, 1"), "{message}");
}

#[test]
fn a_long_garbage_file_is_quoted_short() {
    let sysfs = two_sockets();
    let path = sysfs.root.join("devices/system/node/node1/cpulist");
    std::fs::write(&path, "x".repeat(60_000)).unwrap();
    let error = sysfs.host().cpus_of(1).unwrap_err().to_string();
    assert!(error.contains("cannot parse \"xxxx"), "{error}");
    assert!(error.len() < 300, "{} bytes: {error:.300}", error.len());
}

/// A plan of `nodes` guest nodes (one vCPU, 1 GiB each) whose devices are on `device_nodes`.
fn plan_with_devices(nodes: usize, device_nodes: &[(&str, u32)]) -> NumaPlan {
    NumaPlan {
        nodes: (0..nodes)
            .map(|node| NodePlan {
                cpus: vec![node as u8],
                mem_size: GIB,
                host_node: Some(node as u32),
                pci_segments: Vec::new(),
            })
            .collect(),
        distances: vec![vec![10; nodes]; nodes],
        device_nodes: (device_nodes.iter())
            .map(|(key, node)| (key.to_string(), *node))
            .collect(),
        pin_vcpus: false,
    }
}

/// Each guest node other than 0 holding a passthrough device gets a PCI segment of its own
/// (after the VM's), shared by its devices; devices on node 0 or on no node stay on segment
/// 0, as do all devices when none is on another node.
#[test]
fn devices_of_each_node_other_than_0_get_a_segment_of_their_own() {
    let keys: Vec<String> = ["gpu0", "gpu1", "gpu2", "gpu3", "nic"]
        .iter()
        .map(|k| k.to_string())
        .collect();
    let plan = plan_with_devices(4, &[("gpu0", 0), ("gpu1", 3), ("gpu2", 1), ("gpu3", 3)]);
    let segments = plan.passthrough_segments(&keys, 2).unwrap();
    assert_eq!(
        segments,
        [("gpu1", 3), ("gpu2", 2), ("gpu3", 3)]
            .iter()
            .map(|(key, segment)| (key.to_string(), *segment))
            .collect::<BTreeMap<_, _>>(),
        "node 1's devices on segment 2, node 3's on segment 3; node 0's and the nic on 0"
    );
    // Devices not cold-plugged (not in the keys) take no segment.
    assert_eq!(
        plan.passthrough_segments(&keys[..1], 1).unwrap(),
        BTreeMap::new()
    );
    // All on node 0: nothing moves.
    let local = plan_with_devices(2, &[("gpu0", 0), ("gpu1", 0)]);
    assert!(local.passthrough_segments(&keys, 1).unwrap().is_empty());
    // All on node 1: they still need node 1's host bridge.
    let remote = plan_with_devices(2, &[("gpu0", 1), ("gpu1", 1)]);
    assert_eq!(
        remote
            .passthrough_segments(&keys, 1)
            .unwrap()
            .values()
            .collect::<Vec<_>>(),
        [&1, &1]
    );
    // No segment left: refused with the numbers.
    let error = plan
        .passthrough_segments(&keys, MAX_PCI_SEGMENTS - 1)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("guest node 3") && error.contains(&format!("at most {MAX_PCI_SEGMENTS}")),
        "{error}"
    );
}

/// The SRAT names a device moved to its node's segment there (the plugged device's label
/// has no segment).
#[test]
fn topology_names_a_device_on_its_segment() {
    let plan = plan_with_devices(2, &[("gpu0", 0), ("gpu1", 1)]);
    let keys = ["gpu0".to_string(), "gpu1".to_string()];
    let segments = plan.passthrough_segments(&keys, 1).unwrap();
    let regions = gpuvm_arch::x86_64::layout::ram_regions(2 * GIB);
    let labels = ["00:01.0 gpu0".to_string(), "00:01.0 gpu1".to_string()];
    let topology = plan.topology(&regions, 0, &keys, &labels, &segments);
    let placed: Vec<(u32, u16, u8)> = (topology.initiators.iter())
        .map(|i| (i.domain, i.segment, i.device))
        .collect();
    assert_eq!(placed, [(0, 0, 1), (1, 1, 1)]);
}
