//! Host facts that passthrough depends on.

use crate::{Result, VfioError};

use std::path::Path;

use crate::topology::HostTopology;

/// The soft RLIMIT_MEMLOCK of this process (u64::MAX when unlimited).
pub fn memlock_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(if limit.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        limit.rlim_cur
    })
}

/// Kernel VFIO pins every DMA-mapped page against RLIMIT_MEMLOCK: fails with the value to
/// raise it to when `ram_bytes` (plus a little for the device) does not fit.
pub fn check_memlock(ram_bytes: u64) -> Result<()> {
    let needed = ram_bytes.saturating_add(64 << 20);
    let current = memlock_limit()?;
    if current >= needed {
        return Ok(());
    }
    Err(VfioError::Memlock {
        current,
        needed,
        needed_kib: needed.div_ceil(1024),
    })
}

/// How one host check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckStatus {
    Ok,
    /// Works, but not as well as it could (e.g. no huge pages reserved).
    Warn,
    Fail,
}

/// One line of `gpuvm check-host`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub status: CheckStatus,
    pub detail: String,
    /// What to do about it, for Warn and Fail.
    pub fix: Option<String>,
}

impl Check {
    fn new(name: &str, status: CheckStatus, detail: String, fix: Option<String>) -> Self {
        Check {
            name: name.to_string(),
            status,
            detail,
            fix,
        }
    }
}

/// Where sysfs and /dev are (a test can point these at a fake tree).
#[derive(Clone, Debug)]
pub struct HostPaths {
    pub sys: std::path::PathBuf,
    pub dev: std::path::PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        HostPaths {
            sys: "/sys".into(),
            dev: "/dev".into(),
        }
    }
}

/// `0000:41:00.0` from `41:00.0` or `0000:41:00.0`; None if it is not a PCI address.
pub fn normalize_bdf(text: &str) -> Option<String> {
    let full = if text.matches(':').count() == 1 {
        format!("0000:{text}")
    } else {
        text.to_string()
    };
    let (domain, rest) = full.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str, n: usize| s.len() == n && s.chars().all(|c| c.is_ascii_hexdigit());
    (hex(domain, 4) && hex(bus, 2) && hex(device, 2) && hex(function, 1))
        .then(|| full.to_ascii_lowercase())
}

fn driver_of(paths: &HostPaths, bdf: &str) -> Option<String> {
    let link =
        std::fs::read_link(paths.sys.join("bus/pci/devices").join(bdf).join("driver")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// Drivers the kernel accepts next to vfio-pci in one IOMMU group.
const GROUP_DRIVERS_ALLOWED: &[&str] = &["vfio-pci", "pci-stub", "pcieport"];

/// IOMMU, VFIO, the GPUs' drivers and groups, memlock and huge pages. KVM is checked by
/// the caller (it owns the KVM handle).
pub fn check_host(paths: &HostPaths, gpus: &[String], memory: u64) -> Vec<Check> {
    use CheckStatus::*;
    let mut checks = Vec::new();
    let groups = std::fs::read_dir(paths.sys.join("kernel/iommu_groups"))
        .map(|dir| dir.count())
        .unwrap_or(0);
    checks.push(if groups > 0 {
        Check::new("iommu", Ok, format!("{groups} IOMMU groups"), None)
    } else {
        Check::new(
            "iommu",
            Fail,
            "no IOMMU groups in /sys/kernel/iommu_groups: the IOMMU is off".into(),
            Some("enable VT-d / AMD-Vi in firmware and boot with intel_iommu=on iommu=pt (Intel) or amd_iommu=on iommu=pt (AMD)".into()),
        )
    });
    let container = paths.dev.join("vfio/vfio");
    let iommufd = paths.dev.join("iommu");
    checks.push(if container.exists() || iommufd.exists() {
        Check::new(
            "vfio",
            Ok,
            format!(
                "{}{}",
                if container.exists() { "/dev/vfio/vfio " } else { "" },
                if iommufd.exists() { "/dev/iommu (iommufd)" } else { "" }
            ),
            None,
        )
    } else {
        Check::new(
            "vfio",
            Fail,
            "neither /dev/vfio/vfio nor /dev/iommu exists: VFIO is not loaded".into(),
            Some("modprobe vfio-pci (and vfio_iommu_type1), or build the kernel with CONFIG_VFIO_PCI".into()),
        )
    });
    for gpu in gpus {
        checks.extend(check_gpu(paths, gpu));
    }
    let needed = memory.saturating_add(64 << 20);
    match memlock_limit() {
        std::result::Result::Ok(limit) if limit >= needed => checks.push(Check::new(
            "memlock",
            Ok,
            format!("RLIMIT_MEMLOCK {} covers {} MiB of guest RAM", show_limit(limit), memory >> 20),
            None,
        )),
        std::result::Result::Ok(limit) => checks.push(Check::new(
            "memlock",
            if gpus.is_empty() { Warn } else { Fail },
            format!(
                "RLIMIT_MEMLOCK is {} but DMA-mapping {} MiB of guest RAM pins {} KiB",
                show_limit(limit),
                memory >> 20,
                needed.div_ceil(1024)
            ),
            Some(format!(
                "ulimit -l {} (as root), LimitMEMLOCK=infinity in the systemd unit, or a memlock line in /etc/security/limits.conf",
                needed.div_ceil(1024)
            )),
        )),
        Err(error) => checks.push(Check::new("memlock", Fail, error.to_string(), None)),
    }
    for (name, size) in [
        ("hugepages-2048kB", 2u64 << 20),
        ("hugepages-1048576kB", 1 << 30),
    ] {
        let dir = paths.sys.join("kernel/mm/hugepages").join(name);
        let free: u64 = crate::sysfs::read_text(&dir.join("free_hugepages"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let label = if size == 2 << 20 {
            "hugepages-2M"
        } else {
            "hugepages-1G"
        };
        checks.push(if free * size >= memory {
            Check::new(label, Ok, format!("{free} free ({} MiB)", (free * size) >> 20), None)
        } else {
            Check::new(
                label,
                Warn,
                format!("{free} free ({} MiB), guest RAM needs {} MiB for --memory-backing {}", (free * size) >> 20, memory >> 20, if size == 2 << 20 { "hugetlb-2m" } else { "hugetlb-1g" }),
                Some(format!(
                    "echo {} > /sys/kernel/mm/hugepages/{name}/nr_hugepages (or hugepages= on the kernel command line)",
                    memory.div_ceil(size)
                )),
            )
        });
    }
    checks
}

fn show_limit(limit: u64) -> String {
    if limit == u64::MAX {
        "unlimited".into()
    } else {
        format!("{} KiB", limit / 1024)
    }
}

/// Linux's resource flags (include/linux/ioport.h) in sysfs `resource` lines.
const IORESOURCE_MEM: u64 = 0x200;
const IORESOURCE_MEM_64: u64 = 0x0010_0000;

/// The memory BARs of host device `bdf` from sysfs (`resource`: one `start end flags` line
/// per BAR, then the ROM): (BAR index, size, 64-bit). None if the file cannot be read.
pub fn memory_bars(paths: &HostPaths, bdf: &str) -> Option<Vec<(u8, u64, bool)>> {
    let bdf = normalize_bdf(bdf)?;
    let text =
        crate::sysfs::read_text(&paths.sys.join("bus/pci/devices").join(bdf).join("resource"))
            .ok()?;
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    Some(
        text.lines()
            .take(6)
            .enumerate()
            .filter_map(|(index, line)| {
                let mut fields = line.split_whitespace().map(hex);
                let (start, end, flags) = (fields.next()??, fields.next()??, fields.next()??);
                (flags & IORESOURCE_MEM != 0 && end > start).then(|| {
                    let size = (end - start + 1).next_power_of_two();
                    (index as u8, size, flags & IORESOURCE_MEM_64 != 0)
                })
            })
            .collect(),
    )
}

/// The sizes of host device `bdf`'s 64-bit BARs (what it needs in a guest's 64-bit window).
pub fn bar64_sizes(paths: &HostPaths, bdf: &str) -> Option<Vec<u64>> {
    memory_bars(paths, bdf).map(|bars| bars.into_iter().filter(|b| b.2).map(|b| b.1).collect())
}

fn show_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b.is_multiple_of(1 << 30) => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b.is_multiple_of(1 << 20) => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b.div_ceil(1024)),
    }
}

fn check_gpu(paths: &HostPaths, gpu: &str) -> Vec<Check> {
    use CheckStatus::*;
    let name = format!("gpu {gpu}");
    let Some(bdf) = normalize_bdf(gpu) else {
        return vec![Check::new(
            &name,
            Fail,
            format!("'{gpu}' is not a PCI address"),
            Some("use the form 0000:41:00.0 (see lspci -D)".into()),
        )];
    };
    let device = paths.sys.join("bus/pci/devices").join(&bdf);
    if !device.exists() {
        return vec![Check::new(
            &name,
            Fail,
            format!("no PCI device {bdf}"),
            Some("check the address with lspci -D".into()),
        )];
    }
    let mut checks = Vec::new();
    if let Some(bars) = memory_bars(paths, &bdf).filter(|bars| !bars.is_empty()) {
        let list: Vec<String> = bars
            .iter()
            .map(|&(index, size, wide)| {
                format!(
                    "BAR{index} {} {}",
                    show_size(size),
                    if wide { "64-bit" } else { "32-bit" }
                )
            })
            .collect();
        checks.push(Check::new(
            &format!("{name} bars"),
            Ok,
            list.join(", "),
            None,
        ));
    }
    let driver = driver_of(paths, &bdf);
    checks.push(if driver.as_deref() == Some("vfio-pci") {
        Check::new(&name, Ok, "bound to vfio-pci".into(), None)
    } else {
        Check::new(
            &name,
            Fail,
            format!("bound to {}", driver.as_deref().unwrap_or("no driver")),
            Some(format!(
                "echo {bdf} > /sys/bus/pci/devices/{bdf}/driver/unbind; echo vfio-pci > /sys/bus/pci/devices/{bdf}/driver_override; echo {bdf} > /sys/bus/pci/drivers_probe"
            )),
        )
    });
    let group = std::fs::read_link(device.join("iommu_group"))
        .ok()
        .and_then(|link| link.file_name().map(|n| n.to_string_lossy().into_owned()));
    let Some(group) = group else {
        checks.push(Check::new(
            &format!("{name} iommu group"),
            Fail,
            "the device has no IOMMU group".into(),
            Some("enable the IOMMU (see the iommu check)".into()),
        ));
        return checks;
    };
    let members = std::fs::read_dir(
        paths
            .sys
            .join("kernel/iommu_groups")
            .join(&group)
            .join("devices"),
    )
    .map(|dir| {
        dir.flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
    })
    .unwrap_or_default();
    let blocking: Vec<String> = members
        .iter()
        .filter_map(|member| {
            let driver = driver_of(paths, member)?;
            (!GROUP_DRIVERS_ALLOWED.contains(&driver.as_str()))
                .then(|| format!("{member} ({driver})"))
        })
        .collect();
    checks.push(if blocking.is_empty() {
        Check::new(&format!("{name} iommu group"), Ok, format!("group {group}: {} device(s), all bound to vfio-pci or unbound", members.len()), None)
    } else {
        Check::new(
            &format!("{name} iommu group"),
            Fail,
            format!("group {group} also holds devices bound to host drivers: {}", blocking.join(", ")),
            Some("bind every device of the group to vfio-pci (e.g. the GPU's audio function), or move the GPU to a slot with its own group (ACS)".into()),
        )
    });
    let node = paths.dev.join("vfio").join(&group);
    checks.push(if node.exists() {
        Check::new(&format!("{name} /dev/vfio/{group}"), Ok, "present".into(), None)
    } else {
        Check::new(&format!("{name} /dev/vfio/{group}"), Fail, "missing".into(), Some("bind the device to vfio-pci; give this user access to /dev/vfio/<group> (udev rule or chown)".into()))
    });
    checks
}

/// The PCI base class of display controllers (GPUs, 3D controllers).
const CLASS_DISPLAY: u32 = 0x03;

/// The display-class devices bound to vfio-pci under `sys`, in address order: the GPUs
/// check-host describes when none is named.
pub fn vfio_gpus(sys: &Path) -> Vec<String> {
    let paths = HostPaths {
        sys: sys.to_path_buf(),
        dev: "/dev".into(),
    };
    let Ok(entries) = std::fs::read_dir(sys.join("bus/pci/devices")) else {
        return Vec::new();
    };
    let mut gpus: Vec<String> = entries
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|bdf| driver_of(&paths, bdf).as_deref() == Some("vfio-pci"))
        .filter(|bdf| {
            crate::sysfs::read_text(&sys.join("bus/pci/devices").join(bdf).join("class"))
                .ok()
                .and_then(|class| {
                    u32::from_str_radix(class.trim().trim_start_matches("0x"), 16).ok()
                })
                .is_some_and(|class| class >> 16 == CLASS_DISPLAY)
        })
        .collect();
    gpus.sort();
    gpus
}

/// One line per GPU (`gpus`, else every vfio-pci-bound GPU under `sys`) on its place in
/// the host's PCIe topology: the switch it sits behind, its root complex, and the
/// GPUDirect clique gpuvm derives for it when these GPUs go into one VM in this order.
pub fn topology_checks(sys: &Path, gpus: &[String]) -> Vec<Check> {
    use CheckStatus::*;
    let gpus: Vec<String> = if gpus.is_empty() {
        vfio_gpus(sys)
    } else {
        gpus.iter()
            .map(|gpu| normalize_bdf(gpu).unwrap_or_else(|| gpu.clone()))
            .collect()
    };
    if gpus.is_empty() {
        return vec![Check::new(
            "topology",
            Ok,
            "no vfio-pci-bound GPU found (name GPUs with --gpu)".into(),
            None,
        )];
    }
    let present: Vec<String> = gpus
        .iter()
        .filter(|bdf| sys.join("bus/pci/devices").join(bdf).exists())
        .cloned()
        .collect();
    let topology = HostTopology::discover(sys, &present);
    let mut checks = Vec::new();
    for bdf in &gpus {
        let name = format!("gpu {bdf} topology");
        checks.push(match &topology {
            _ if !present.contains(bdf) => Check::new(
                &name,
                Warn,
                "not in sysfs: no place in the host's topology, no GPUDirect clique".into(),
                None,
            ),
            std::result::Result::Ok(topology) => {
                Check::new(&name, Ok, topology.describe(bdf), None)
            }
            Err(error) => Check::new(&name, Warn, error.to_string(), None),
        });
        // Further per-GPU lines (e.g. the reset method) go here, after its topology.
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_error_names_the_value() {
        let current = memlock_limit().unwrap();
        if current == u64::MAX {
            assert!(check_memlock(u64::MAX - (64 << 20)).is_ok());
            return;
        }
        let error = check_memlock(current + (1 << 30)).unwrap_err().to_string();
        let kib = (current + (1 << 30) + (64 << 20)).div_ceil(1024);
        assert!(error.contains(&format!("ulimit -l {kib}")), "{error}");
        assert!(check_memlock(0).is_ok() || current < 64 << 20);
    }

    #[test]
    fn bdf_forms() {
        assert_eq!(normalize_bdf("41:00.0").as_deref(), Some("0000:41:00.0"));
        assert_eq!(
            normalize_bdf("0000:AB:1f.7").as_deref(),
            Some("0000:ab:1f.7")
        );
        assert_eq!(normalize_bdf("41:0.0"), None);
        assert_eq!(normalize_bdf("gpu0"), None);
    }

    #[test]
    fn fake_sysfs_with_a_gpu_and_a_blocking_group_member() {
        use std::os::unix::fs::symlink;
        let root = std::env::temp_dir().join(format!("gpuvm-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let sys = root.join("sys");
        let dev = root.join("dev");
        let devices = sys.join("bus/pci/devices");
        let group = sys.join("kernel/iommu_groups/7/devices");
        std::fs::create_dir_all(&group).unwrap();
        std::fs::create_dir_all(dev.join("vfio")).unwrap();
        std::fs::write(dev.join("vfio/vfio"), "").unwrap();
        for (bdf, driver) in [
            ("0000:41:00.0", "vfio-pci"),
            ("0000:41:00.1", "snd_hda_intel"),
        ] {
            let d = devices.join(bdf);
            std::fs::create_dir_all(&d).unwrap();
            symlink(
                format!("../../../../bus/pci/drivers/{driver}"),
                d.join("driver"),
            )
            .unwrap();
            symlink("../../../kernel/iommu_groups/7", d.join("iommu_group")).unwrap();
            std::fs::write(group.join(bdf), "").unwrap();
        }
        // An H200's BARs as sysfs lists them: BAR0 16 MiB 32-bit, BAR1 256 GiB and BAR3
        // 32 MiB 64-bit prefetchable (their upper halves empty), no I/O, the ROM last.
        std::fs::write(
            devices.join("0000:41:00.0/resource"),
            "0x00000000f8000000 0x00000000f8ffffff 0x0000000000040200\n\
             0x0000380000000000 0x0000383fffffffff 0x000000000014220c\n\
             0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
             0x0000384000000000 0x0000384001ffffff 0x000000000014220c\n\
             0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
             0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
             0x00000000f9000000 0x00000000f907ffff 0x0000000000046200\n",
        )
        .unwrap();
        let paths = HostPaths { sys, dev };
        let checks = check_host(&paths, &["41:00.0".into()], 1 << 20);
        let find = |name: &str| {
            checks
                .iter()
                .find(|c| c.name == name)
                .unwrap_or_else(|| panic!("{name}: {checks:?}"))
        };
        assert_eq!(find("iommu").status, CheckStatus::Ok);
        assert_eq!(find("vfio").status, CheckStatus::Ok);
        assert_eq!(find("gpu 41:00.0").status, CheckStatus::Ok);
        assert_eq!(
            find("gpu 41:00.0 bars").detail,
            "BAR0 16 MiB 32-bit, BAR1 256 GiB 64-bit, BAR3 32 MiB 64-bit"
        );
        assert_eq!(
            bar64_sizes(&paths, "41:00.0"),
            Some(vec![256 << 30, 32 << 20])
        );
        assert_eq!(bar64_sizes(&paths, "41:00.1"), None, "no resource file");
        let group_check = find("gpu 41:00.0 iommu group");
        assert_eq!(group_check.status, CheckStatus::Fail);
        assert!(
            group_check.detail.contains("0000:41:00.1 (snd_hda_intel)"),
            "{group_check:?}"
        );
        assert_eq!(find("gpu 41:00.0 /dev/vfio/7").status, CheckStatus::Fail);
        let missing = check_host(&paths, &["42:00.0".into()], 0);
        assert!(missing
            .iter()
            .any(|c| c.status == CheckStatus::Fail && c.detail.contains("no PCI device")));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn topology_lines_for_found_or_named_gpus() {
        use std::os::unix::fs::symlink;
        let root = std::env::temp_dir().join(format!("gpuvm-host-topo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let devices = root.join("bus/pci/devices");
        std::fs::create_dir_all(&devices).unwrap();
        // Two GPUs behind one switch, bound to vfio-pci; a NIC bound to vfio-pci; a GPU
        // bound to nvidia.
        for (chain, driver, class) in [
            (
                "pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:00.0/0000:43:00.0",
                "vfio-pci",
                "0x030200",
            ),
            (
                "pci0000:40/0000:40:01.0/0000:41:00.0/0000:42:01.0/0000:44:00.0",
                "vfio-pci",
                "0x030000",
            ),
            (
                "pci0000:40/0000:40:02.0/0000:45:00.0",
                "vfio-pci",
                "0x020000",
            ),
            ("pci0000:80/0000:80:01.0/0000:81:00.0", "nvidia", "0x030200"),
        ] {
            let dir = root.join("devices").join(chain);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("class"), format!("{class}\n")).unwrap();
            symlink(format!("/nonexistent/drivers/{driver}"), dir.join("driver")).unwrap();
            let bdf = chain.rsplit('/').next().unwrap();
            symlink(format!("../../../devices/{chain}"), devices.join(bdf)).unwrap();
        }
        assert_eq!(vfio_gpus(&root), ["0000:43:00.0", "0000:44:00.0"]);
        let checks = topology_checks(&root, &[]);
        assert_eq!(checks.len(), 2, "{checks:?}");
        assert_eq!(checks[0].name, "gpu 0000:43:00.0 topology");
        assert_eq!(
            checks[0].detail,
            "switch 0000:41:00.0 (PIX with 0000:44:00.0), root complex pci0000:40, clique 0"
        );
        // Named GPUs: in the order given, a missing one warned about.
        let checks = topology_checks(
            &root,
            &["81:00.0".into(), "43:00.0".into(), "99:00.0".into()],
        );
        assert!(
            checks[0]
                .detail
                .ends_with("root complex pci0000:80, clique 0"),
            "{checks:?}"
        );
        assert!(checks[1].detail.ends_with("clique 1"), "{checks:?}");
        assert_eq!(checks[2].status, CheckStatus::Warn);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
