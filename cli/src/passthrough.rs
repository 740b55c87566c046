//! The passthrough part of the `gpuvm` command line: `--gpu`, `--vfio-user`,
//! `--hide-hypervisor` on `gpuvm run`, and `gpuvm check-host`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use gpuvm_arch::x86_64::address_space::{plan, HostAddressWidth, PlanRequest};
use gpuvm_arch::x86_64::cpuid::{CpuidMask, CpuidReg};
use gpuvm_arch::x86_64::layout::ram_regions;
use gpuvm_vfio::host::{self, CheckStatus, HostPaths};
use gpuvm_vmm::config::{PassthroughTuning, PciOptions, PciTopology};

#[derive(Args, Debug)]
pub struct PassthroughArgs {
    /// Pass through the host PCI device at this address (bound to vfio-pci), e.g.
    /// 0000:41:00.0, with optional `,clique=N` (GPUDirect clique, default from the host's
    /// PCIe topology), `,p2p=off` (peers do not DMA into its BARs) and `,pci_segment=N`
    /// (the guest PCI segment it goes on; default 0, or its NUMA node's). Repeatable; with
    /// --api-sock, PUT /gpus/{id} can add more.
    #[arg(long = "gpu", value_name = "BDF[,OPTIONS]")]
    pub gpus: Vec<String>,
    /// Attach the vfio-user device served on this Unix socket, with the options of
    /// --gpu and `,topology_bdf=BDF` (the host GPU whose place in the host's PCIe
    /// topology it takes). Repeatable.
    #[arg(long = "vfio-user", value_name = "SOCKET[,OPTIONS]")]
    pub vfio_user: Vec<String>,
    /// Size of the 64-bit PCI MMIO window above RAM in GiB (default: planned from the
    /// devices' BARs, with room to hot-plug one more, at least 512 where the host's
    /// physical address width allows).
    #[arg(long, value_name = "GIB")]
    pub pci_mmio64_gib: Option<u64>,
    /// Hide the hypervisor from the guest: clear the CPUID hypervisor bit and the
    /// 0x40000000 signature leaf (some GPU drivers refuse to run in a VM).
    #[arg(long)]
    pub hide_hypervisor: bool,
    /// Where passthrough devices sit in the guest's PCI hierarchy: `flat` (all on bus 0)
    /// or `host` (a PCIe root port each, and a virtual switch for devices that share a
    /// switch on the host; the default where a device sits behind a host switch).
    #[arg(long, value_name = "flat|host", value_parser = ["flat", "host"])]
    pub pci_topology: Option<String>,
    /// Empty PCIe root ports with native hot-plug slots (Kata's `pcie_root_port`): PUT
    /// /gpus/{id} plugs into a free one instead of bus 0 (at most 8).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub pcie_root_ports: u8,
}

impl PassthroughArgs {
    pub fn pci_options(&self) -> Result<PciOptions, String> {
        let mut options = PciOptions {
            mmio64_size: self
                .pci_mmio64_gib
                .map_or(0, |gib| gib.saturating_mul(1 << 30)),
            pci_topology: self.pci_topology.as_deref().map(|choice| match choice {
                "flat" => PciTopology::Flat,
                _ => PciTopology::Host,
            }),
            pcie_root_ports: self.pcie_root_ports,
            ..PciOptions::default()
        };
        for value in &self.gpus {
            let (bdf, tuning) = device_value("--gpu", value, false)?;
            options.gpus.push(bdf.clone());
            options.tuning.insert(bdf, tuning);
        }
        for value in &self.vfio_user {
            let (socket, tuning) = device_value("--vfio-user", value, true)?;
            options.vfio_user.push(PathBuf::from(&socket));
            options.tuning.insert(socket, tuning);
        }
        Ok(options)
    }
}

/// `DEVICE[,key=value...]` of --gpu or --vfio-user: the device, and its choices. A
/// vfio-user socket path may hold commas only where what follows is not `key=value`.
fn device_value(
    flag: &str,
    value: &str,
    vfio_user: bool,
) -> Result<(String, PassthroughTuning), String> {
    let mut parts: Vec<&str> = value.split(',').collect();
    let known = |part: &str| {
        part.split_once('=')
            .is_some_and(|(key, _)| ["clique", "p2p", "topology_bdf", "pci_segment"].contains(&key))
    };
    let first_option = (1..parts.len())
        .find(|&i| parts[i..].iter().all(|p| known(p)))
        .unwrap_or(parts.len());
    let options = parts.split_off(first_option);
    let device = parts.join(",");
    if device.is_empty() {
        return Err(format!("{flag} {value:?}: name the device first"));
    }
    let mut tuning = PassthroughTuning::default();
    for option in options {
        let (key, setting) = option.split_once('=').unwrap_or((option, ""));
        match key {
            "clique" => {
                let clique = setting
                    .parse::<u8>()
                    .ok()
                    .filter(|c| *c <= gpuvm_vmm::action::MAX_GPUDIRECT_CLIQUE);
                tuning.clique = Some(clique.ok_or_else(|| {
                    format!(
                        "{flag} {value:?}: clique={setting:?} is not a clique id (0 to {})",
                        gpuvm_vmm::action::MAX_GPUDIRECT_CLIQUE
                    )
                })?);
            }
            "p2p" => {
                tuning.p2p = match setting {
                    "on" => true,
                    "off" => false,
                    _ => return Err(format!("{flag} {value:?}: p2p={setting:?}: on or off")),
                }
            }
            "pci_segment" => {
                let segment = (setting.parse::<u16>().ok())
                    .filter(|s| *s < gpuvm_vmm::action::MAX_PCI_SEGMENTS);
                tuning.segment = Some(segment.ok_or_else(|| {
                    format!(
                        "{flag} {value:?}: pci_segment={setting:?} is not a segment (0 to {})",
                        gpuvm_vmm::action::MAX_PCI_SEGMENTS - 1
                    )
                })?);
            }
            "topology_bdf" if vfio_user => {
                gpuvm_vmm::action::parse_bdf(setting)
                    .map_err(|e| format!("{flag} {value:?}: {}", e.message))?;
                tuning.topology_bdf = Some(setting.to_string());
            }
            _ => return Err(format!("{flag} {value:?}: unknown option {option:?}")),
        }
    }
    Ok((device, tuning))
}

/// `masks` plus, when `hide` is set, every bit that tells the guest it runs under KVM.
pub fn with_hidden_hypervisor(mut masks: Vec<CpuidMask>, hide: bool) -> Vec<CpuidMask> {
    if !hide {
        return masks;
    }
    masks.push(CpuidMask {
        leaf: 1,
        subleaf: None,
        reg: CpuidReg::Ecx,
        bit: 31,
    });
    for reg in [CpuidReg::Eax, CpuidReg::Ebx, CpuidReg::Ecx, CpuidReg::Edx] {
        for bit in 0..32 {
            masks.push(CpuidMask {
                leaf: 0x4000_0000,
                subleaf: None,
                reg,
                bit,
            });
        }
    }
    masks
}

#[derive(Args, Debug)]
pub struct CheckHostArgs {
    /// A GPU to check (driver binding, IOMMU group). Repeatable.
    #[arg(long = "gpu", value_name = "BDF")]
    pub gpus: Vec<String>,
    /// Guest RAM to check the memlock limit and huge pages against, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 128)]
    pub memory_mib: u64,
}

/// Prints one line per check and exits 0 only when nothing failed.
pub fn check_host(args: &CheckHostArgs) -> ExitCode {
    let mut failed = false;
    let memory = args.memory_mib.saturating_mul(1 << 20);
    match gpuvm_vmm::host::open_kvm() {
        Ok(kvm) => {
            println!("ok    kvm: /dev/kvm opens (API {})", kvm.get_api_version());
            match gpuvm_vmm::pci::host_address_width(&kvm) {
                Ok(host) => {
                    println!("ok    address width: {host}");
                    let largest = args
                        .gpus
                        .iter()
                        .filter_map(|gpu| host::bar64_sizes(&HostPaths::default(), gpu))
                        .max_by_key(|bars| bars.iter().sum::<u64>());
                    let (fits, detail) = eight_gpus_fit(host, largest, memory);
                    println!("{}  8 GPUs: {detail}", if fits { "ok  " } else { "warn" });
                }
                Err(error) => println!("warn  address width: {error}"),
            }
        }
        Err(error) => {
            failed = true;
            println!("FAIL  kvm: {error}");
        }
    }
    // Each GPU's place in the host's PCIe topology (switch, root complex, clique).
    let topology_root = gpuvm_vfio::topology::HostTopology::default_root();
    let topology = host::topology_checks(&topology_root, &args.gpus);
    for check in host::check_host(&HostPaths::default(), &args.gpus, memory)
        .into_iter()
        .chain(topology)
        .chain(gpuvm_vfio::reset::reset_checks(
            &HostPaths::default().sys,
            &args.gpus,
        ))
    {
        let label = match check.status {
            CheckStatus::Ok => "ok  ",
            CheckStatus::Warn => "warn",
            CheckStatus::Fail => {
                failed = true;
                "FAIL"
            }
        };
        println!("{label}  {}: {}", check.name, check.detail);
        if let Some(fix) = check.fix {
            println!("      fix: {fix}");
        }
    }
    if failed {
        println!("check-host: some checks failed; GPU passthrough will not work until they pass");
        ExitCode::from(1)
    } else {
        println!("check-host: all checks passed");
        ExitCode::SUCCESS
    }
}

/// Whether a VM with `memory` bytes of RAM and 8 GPUs whose 64-bit BARs are `bars` (the
/// largest GPU given; else an H200's, 256 GiB and 32 MiB) fits this host's guest address
/// width, with the plan or the refusal as gpuvm would give them.
fn eight_gpus_fit(host: HostAddressWidth, bars: Option<Vec<u64>>, memory: u64) -> (bool, String) {
    let (what, bars) = match bars {
        Some(bars) => ("of the largest GPU given", bars),
        None => ("of an H200 (256 GiB BAR1)", vec![256 << 30, 32 << 20]),
    };
    let devices = vec![bars; 8];
    let ram_top = ram_regions(memory.max(1 << 20))
        .iter()
        .map(|r| r.end())
        .max()
        .unwrap_or(0);
    let request = PlanRequest {
        host,
        ram_top,
        ram_hotplug_size: 0,
        devices: &devices,
        mmio64_size: 0,
        fixed_window: None,
        segments: 1,
        segment_bars: &[],
        segment_buses: &[],
    };
    match plan(&request) {
        Ok(plan) => (
            true,
            format!(
                "8 x the BARs {what} fit with {} MiB of RAM: {plan}",
                memory >> 20
            ),
        ),
        Err(error) => (false, format!("8 x the BARs {what} do not fit: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvm_arch::x86_64::address_space::CpuVendor;

    #[test]
    fn device_options_parse_and_refuse_what_they_do_not_know() {
        let (bdf, tuning) = device_value("--gpu", "0000:41:00.0,clique=3,p2p=off", false).unwrap();
        assert_eq!(bdf, "0000:41:00.0");
        assert_eq!(tuning.clique, Some(3));
        assert!(!tuning.p2p);
        let (socket, tuning) = device_value(
            "--vfio-user",
            "/run/a,b.sock,topology_bdf=0000:42:00.0",
            true,
        )
        .unwrap();
        assert_eq!(socket, "/run/a,b.sock");
        assert_eq!(tuning.topology_bdf.as_deref(), Some("0000:42:00.0"));
        assert!(tuning.p2p);
        let (_, tuning) = device_value("--vfio-user", "/run/gpu.sock,pci_segment=1", true).unwrap();
        assert_eq!(tuning.segment, Some(1));
        assert_eq!(
            device_value("--gpu", "0000:41:00.0", false).unwrap().1,
            PassthroughTuning::default()
        );
        for bad in [
            "0000:41:00.0,clique=16",
            "0000:41:00.0,pci_segment=16",
            "0000:41:00.0,pci_segment=-1",
            "0000:41:00.0,p2p=maybe",
            "0000:41:00.0,topology_bdf=0000:42:00.0",
            ",p2p=on",
        ] {
            let error = device_value("--gpu", bad, false).unwrap_err();
            assert!(error.contains("--gpu"), "{error}");
        }
        assert!(device_value("--vfio-user", "/s,topology_bdf=zz", true).is_err());
    }

    #[test]
    fn eight_gpus_fit_where_the_width_allows() {
        let h200 = || Some(vec![256u64 << 30, 32 << 20]);
        let (fits, detail) =
            eight_gpus_fit(HostAddressWidth::new(CpuVendor::Intel, 46), None, 512 << 30);
        assert!(fits, "{detail}");
        assert!(detail.contains("of an H200"), "{detail}");
        let (fits, detail) =
            eight_gpus_fit(HostAddressWidth::new(CpuVendor::Amd, 41), h200(), 1 << 30);
        assert!(!fits, "{detail}");
        assert!(
            detail.contains("41-bit physical address space (2 TiB)"),
            "{detail}"
        );
    }
    use gpuvm_arch::x86_64::cpuid::{normalize, Topology};
    use kvm_bindings::{kvm_cpuid_entry2, CpuId};

    #[test]
    fn hide_hypervisor_clears_the_bit_and_the_signature() {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ecx: 1 << 23,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0x4000_0000,
                eax: 0x4000_0001,
                ebx: u32::from_le_bytes(*b"KVMK"),
                ecx: u32::from_le_bytes(*b"VMKV"),
                edx: u32::from_le_bytes(*b"M\0\0\0"),
                ..Default::default()
            },
        ];
        let topology = Topology { vcpu_count: 1 };
        let mut shown = CpuId::from_entries(&entries).unwrap();
        normalize(
            &mut shown,
            0,
            topology,
            &with_hidden_hypervisor(Vec::new(), false),
        );
        assert_ne!(shown.as_slice()[0].ecx & 1 << 31, 0, "normally advertised");
        let mut hidden = CpuId::from_entries(&entries).unwrap();
        normalize(
            &mut hidden,
            0,
            topology,
            &with_hidden_hypervisor(Vec::new(), true),
        );
        let hidden = hidden.as_slice();
        assert_eq!(hidden[0].ecx, 1 << 23, "only the hypervisor bit goes");
        assert_eq!(
            (hidden[1].eax, hidden[1].ebx, hidden[1].ecx, hidden[1].edx),
            (0, 0, 0, 0)
        );
    }
}
