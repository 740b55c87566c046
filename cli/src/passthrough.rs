//! The passthrough part of the `gpuvm` command line: `--gpu`, `--vfio-user`,
//! `--hide-hypervisor` on `gpuvm run`, and `gpuvm check-host`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use gpuvm_arch::x86_64::address_space::{plan, HostAddressWidth, PlanRequest};
use gpuvm_arch::x86_64::cpuid::{CpuidMask, CpuidReg};
use gpuvm_arch::x86_64::layout::ram_regions;
use gpuvm_vfio::host::{self, CheckStatus, HostPaths};
use gpuvm_vmm::config::PciOptions;

#[derive(Args, Debug)]
pub struct PassthroughArgs {
    /// Pass through the host PCI device at this address (bound to vfio-pci), e.g.
    /// 0000:41:00.0. Repeatable; with --api-sock, PUT /gpus/{id} can add more.
    #[arg(long = "gpu", value_name = "BDF")]
    pub gpus: Vec<String>,
    /// Attach the vfio-user device served on this Unix socket. Repeatable.
    #[arg(long = "vfio-user", value_name = "SOCKET")]
    pub vfio_user: Vec<PathBuf>,
    /// Size of the 64-bit PCI MMIO window above RAM in GiB (default: planned from the
    /// devices' BARs, with room to hot-plug one more, at least 512 where the host's
    /// physical address width allows).
    #[arg(long, value_name = "GIB")]
    pub pci_mmio64_gib: Option<u64>,
    /// Hide the hypervisor from the guest: clear the CPUID hypervisor bit and the
    /// 0x40000000 signature leaf (some GPU drivers refuse to run in a VM).
    #[arg(long)]
    pub hide_hypervisor: bool,
}

impl PassthroughArgs {
    pub fn pci_options(&self) -> PciOptions {
        PciOptions {
            gpus: self.gpus.clone(),
            vfio_user: self.vfio_user.clone(),
            mmio64_size: self
                .pci_mmio64_gib
                .map_or(0, |gib| gib.saturating_mul(1 << 30)),
            ..PciOptions::default()
        }
    }
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
    for check in host::check_host(&HostPaths::default(), &args.gpus, memory) {
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
