//! `gpuvm`: the command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpuvm_memory::Backing;
use gpuvm_vmm::config::{MachineConfig, VmConfig};
use gpuvm_vmm::x86_64::boot::{BootSource, KernelSource};
use gpuvm_vmm::x86_64::cpuid::CpuidMask;

/// A KVM micro-VMM for GPU virtual machines.
#[derive(Parser, Debug)]
#[command(name = "gpuvm", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Boot a VM and run it until the guest ends. Without --kernel, boots the embedded
    /// test guest.
    Run(RunArgs),
    /// Write the embedded test guest (a PVH ELF) to a file, e.g. to boot it elsewhere.
    GuestImage {
        /// Where to write the image.
        #[arg(long, short)]
        output: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Kernel to boot: an ELF vmlinux (PVH or 64-bit entry) or a bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (for the test guest: the workload, default "hello").
    #[arg(long)]
    cmdline: Option<String>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Guest memory size, e.g. 512M or 4G.
    #[arg(long, value_parser = parse_size, default_value = "128M")]
    memory: u64,
    /// What backs guest memory.
    #[arg(long, default_value = "memfd", value_parser = parse_backing)]
    memory_backing: Backing,
    /// Do not ask for transparent huge pages on memfd backing.
    #[arg(long)]
    no_thp: bool,
    /// Populate all guest memory before boot, with several threads.
    #[arg(long)]
    prefault: bool,
    /// CPUID features to hide from the guest: names (popcnt, xsave, smap, ...) or
    /// LEAF[.SUBLEAF]:REG:BIT, comma-separated or repeated.
    #[arg(long, value_delimiter = ',')]
    cpuid_mask: Vec<CpuidMask>,
    /// At exit, print peak RSS, guest-resident memory and gpuvm's overhead to stderr.
    #[arg(long)]
    report_memory: bool,
}

/// Parses sizes like 4096, 512K, 128M, 4G (powers of 1024).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((index, unit)) if unit.is_ascii_alphabetic() => {
            let shift = match unit.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => {
                    return Err(format!(
                        "unknown size unit '{unit}' in '{text}' (use K, M, G or T)"
                    ))
                }
            };
            (&text[..index], shift)
        }
        _ => (text, 0),
    };
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a size (examples: 512M, 4G)"))?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{text}' is too large"))
}

fn parse_backing(text: &str) -> Result<Backing, String> {
    text.parse()
        .map_err(|e: gpuvm_memory::RamError| e.to_string())
}

fn run(args: RunArgs) -> Result<ExitCode, gpuvm_vmm::Error> {
    let kernel = match args.kernel {
        Some(path) => KernelSource::File(path),
        None => KernelSource::Embedded(gpuvm_guest_images::TEST_GUEST_ELF),
    };
    let is_test_guest = matches!(kernel, KernelSource::Embedded(_));
    let config = VmConfig {
        machine: MachineConfig {
            vcpus: args.vcpus,
            memory_size: args.memory,
            backing: args.memory_backing,
            thp: !args.no_thp,
            prefault: args.prefault,
            cpuid_masks: args.cpuid_mask,
        },
        boot: BootSource {
            kernel,
            initrd: args.initrd,
            cmdline: args.cmdline.unwrap_or_else(|| {
                if is_test_guest {
                    "hello".into()
                } else {
                    String::new()
                }
            }),
        },
    };
    let mut machine = gpuvm_vmm::builder::build(&config, Box::new(std::io::stdout()))?;
    let end = machine.run()?;
    if args.report_memory {
        let report = machine.memory_report()?;
        eprintln!(
            "gpuvm: memory rss_kib={} guest_resident_kib={} overhead_kib={}",
            report.peak_rss / 1024,
            report.guest_resident / 1024,
            report.overhead() / 1024
        );
    }
    log::info!("guest ended: {end:?}");
    Ok(ExitCode::from(end.exit_code() as u8))
}

fn write_guest_image(output: &std::path::Path) -> ExitCode {
    match std::fs::write(output, gpuvm_guest_images::TEST_GUEST_ELF) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpuvm: error: cannot write {}: {error}", output.display());
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("GPUVM_LOG", "warn"))
        .format_timestamp_micros()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::GuestImage { output } => return write_guest_image(&output),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("gpuvm: error: {error}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4g"), Ok(4 << 30));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("abc").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
