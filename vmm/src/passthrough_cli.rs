//! The passthrough part of the `gpuvm` command line: `--gpu`, `--vfio-user`,
//! `--hide-hypervisor` on `gpuvm run`, and `gpuvm check-host`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use gpuvm_vfio::host::{self, CheckStatus, HostPaths};
use gpuvm_vmm::pci::PciOptions;
use gpuvm_vmm::x86_64::cpuid::{CpuidMask, CpuidReg};

#[derive(Args, Debug)]
pub struct PassthroughArgs {
    /// Pass through the host PCI device at this address (bound to vfio-pci), e.g.
    /// 0000:41:00.0. Repeatable.
    #[arg(long = "gpu", value_name = "BDF")]
    pub gpus: Vec<String>,
    /// Attach the vfio-user device served on this Unix socket. Repeatable.
    #[arg(long = "vfio-user", value_name = "SOCKET")]
    pub vfio_user: Vec<PathBuf>,
    /// Size of the 64-bit PCI MMIO window above RAM in GiB (default 512: two 128 GiB BAR1s
    /// and more).
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
    match gpuvm_vmm::builder::open_kvm() {
        Ok(kvm) => println!("ok    kvm: /dev/kvm opens (API {})", kvm.get_api_version()),
        Err(error) => {
            failed = true;
            println!("FAIL  kvm: {error}");
        }
    }
    let memory = args.memory_mib.saturating_mul(1 << 20);
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
