//! The command line's definition (clap): the subcommands and their flags, and the parsers
//! of sizes and memory backings.

use std::any::TypeId;
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use gpuvm_arch::x86_64::cpuid::CpuidMask;
use gpuvm_memory::Backing;
use gpuvm_vmm::machine::{AfterSnapshot, SnapshotPolicy};

use crate::{front_end, passthrough};

/// A KVM micro-VMM for GPU virtual machines.
#[derive(Parser, Debug)]
#[command(name = "gpuvm", version, about)]
pub struct Cli {
    /// Log output: text, or json (one object per line with ts, level, target, message).
    #[arg(long, global = true, default_value = "text", value_name = "text|json")]
    pub log_format: gpuvm_vmm::logging::LogFormat,
    /// Log level for every module: off, error, warn, info, debug, trace (default: the
    /// GPUVM_LOG environment variable, else warn).
    #[arg(long, global = true, value_name = "LEVEL")]
    pub log_level: Option<log::LevelFilter>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Boot a VM and run it until the guest ends. Without --kernel, boots the embedded
    /// test guest.
    Run(Box<RunArgs>),
    /// Restore a VM from a snapshot directory and run it until the guest ends.
    Restore(RestoreArgs),
    /// Ask a running gpuvm (started with --snapshot-dir) to snapshot itself now.
    Snapshot {
        /// Process id of the running gpuvm.
        #[arg(long)]
        pid: i32,
    },
    /// Hand a running VM to a new gpuvm binary without stopping it (live update).
    Update(UpdateArgs),
    /// The new gpuvm's side of a live update (started by `gpuvm update`).
    #[command(hide = true)]
    UpdateReceive(ReceiveArgs),
    /// Talk to a running gpuvm's API socket.
    Ctl(CtlArgs),
    /// Check that this host can pass GPUs through (KVM, IOMMU, vfio-pci binding, IOMMU
    /// groups, memlock, huge pages); each failing check says how to fix it.
    CheckHost(passthrough::CheckHostArgs),
    /// Write the embedded test guest (a PVH ELF) to a file, e.g. to boot it elsewhere.
    GuestImage {
        /// Where to write the image.
        #[arg(long, short)]
        output: PathBuf,
    },
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Kernel to boot: an ELF vmlinux (PVH or 64-bit entry) or a bzImage.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initial ramdisk.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line (for the test guest: the workload, default "hello").
    #[arg(long)]
    pub cmdline: Option<String>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u8,
    /// Guest memory size, e.g. 512M or 4G.
    #[arg(long, value_parser = parse_size, default_value = "128M")]
    pub memory: u64,
    /// What backs guest memory: memfd, hugetlb-2m or hugetlb-1g.
    #[arg(long, default_value = "memfd", value_parser = parse_backing)]
    pub memory_backing: Backing,
    /// Do not use huge pages on memfd backing: guest RAM is then a plain memfd with
    /// 4 KiB pages instead of a file on gpuvm's private huge-page tmpfs (the default).
    #[arg(long)]
    pub no_thp: bool,
    /// Populate all guest memory before boot, with several threads.
    #[arg(long)]
    pub prefault: bool,
    /// CPUID features to hide from the guest: names (popcnt, xsave, smap, ...) or
    /// LEAF[.SUBLEAF]:REG:BIT, comma-separated or repeated.
    #[arg(long, value_delimiter = ',')]
    pub cpuid_mask: Vec<CpuidMask>,
    /// Log dirty pages so that later snapshots into the same directory are diffs.
    #[arg(long)]
    pub track_dirty_pages: bool,
    /// Serve the control API on this Unix socket. Without --config-file, gpuvm waits for
    /// PUT /actions InstanceStart (or PUT /snapshot/load); the flags above are the
    /// initial configuration.
    #[arg(long)]
    pub api_sock: Option<PathBuf>,
    #[command(flatten)]
    pub jail: JailArgs,
    #[command(flatten)]
    pub seccomp: SeccompArgs,
    /// Start at once with this JSON configuration ({"machine-config": {...},
    /// "boot-source": {...}}, the bodies of the API's routes).
    #[arg(long)]
    pub config_file: Option<PathBuf>,
    #[command(flatten)]
    pub passthrough: passthrough::PassthroughArgs,
    #[command(flatten)]
    pub fabric: crate::fabric::FabricArgs,
    #[command(flatten)]
    pub numa: crate::numa::NumaArgs,
    #[command(flatten)]
    pub devices: crate::devices::DeviceArgs,
    #[command(flatten)]
    pub snapshot: SnapshotArgs,
    #[command(flatten)]
    pub report: ReportArgs,
}

/// Confinement applied once /dev/kvm, guest memory and the devices are open, before the
/// guest runs (see the `jail` module).
#[derive(Args, Debug, Default)]
pub struct JailArgs {
    /// Change the root directory to DIR (snapshot paths are then inside DIR).
    #[arg(long, value_name = "DIR")]
    pub chroot: Option<PathBuf>,
    /// Run as this user id (with --gid; supplementary groups are dropped).
    #[arg(long, requires = "gid")]
    pub uid: Option<u32>,
    /// Run as this group id (with --uid).
    #[arg(long, requires = "uid")]
    pub gid: Option<u32>,
}

/// Seccomp filters (on by default; see the `seccomp` module).
#[derive(Args, Debug, Default)]
pub struct SeccompArgs {
    /// Run without seccomp filters (by default every vmm, vCPU and API thread runs under
    /// its own filter, and a system call outside it ends gpuvm with status 148).
    #[arg(long)]
    pub no_seccomp: bool,
    /// Accepted for compatibility: filters are on by default now.
    #[arg(long, hide = true, conflicts_with = "no_seccomp")]
    pub seccomp: bool,
}

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// Directory for snapshots; enables `gpuvm snapshot --pid` (SIGUSR1).
    #[arg(long)]
    pub snapshot_dir: Option<PathBuf>,
    /// Take a snapshot this many milliseconds after the vCPUs start.
    #[arg(long, requires = "snapshot_dir")]
    pub snapshot_after_ms: Option<u64>,
    /// After a snapshot: keep running, or end gpuvm.
    #[arg(long, value_enum, default_value = "resume", requires = "snapshot_dir")]
    pub snapshot_then: Then,
    /// How long a snapshot (any: signal, timer or API) pauses the vCPUs: `short` only
    /// while state is saved, memory then being written as the guest runs (where the host
    /// allows it), or `full` for the whole write.
    #[arg(long, value_enum, default_value = "short")]
    pub snapshot_pause: Pause,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum Pause {
    Short,
    Full,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// At exit, print peak RSS, guest-resident memory and gpuvm's overhead to stderr.
    #[arg(long)]
    pub report_memory: bool,
    /// At exit, print snapshot and restore figures to stderr.
    #[arg(long)]
    pub report_timing: bool,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum Then {
    Resume,
    Exit,
}

#[derive(Copy, Clone, Debug, ValueEnum, PartialEq, Eq)]
pub enum Mode {
    /// Read all memory, then run.
    Eager,
    /// Run at once, load memory on fault and in the background (userfaultfd).
    Lazy,
    /// Hand the userfaultfd to an external page-fault handler (--uffd-socket).
    External,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The snapshot directory.
    #[arg(long)]
    pub snapshot: PathBuf,
    #[arg(long, value_enum, default_value = "lazy")]
    pub restore_mode: Mode,
    /// Unix socket of the external page-fault handler (Firecracker's UFFD handshake).
    #[arg(long, required_if_eq("restore_mode", "external"))]
    pub uffd_socket: Option<PathBuf>,
    /// Lazy restores: write down which guest memory this restore's guest faulted on
    /// (`working-set` in the snapshot directory), so that later lazy restores of the same
    /// snapshot load it first.
    #[arg(long)]
    pub record_working_set: bool,
    #[command(flatten)]
    pub jail: JailArgs,
    #[command(flatten)]
    pub seccomp: SeccompArgs,
    #[command(flatten)]
    pub snapshot_args: SnapshotArgs,
    #[command(flatten)]
    pub report: ReportArgs,
}

/// Parses sizes like 4096, 512K, 128M, 4G (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let not_a_size = || format!("'{text}' is not a size (examples: 4096, 512M, 4G)");
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(not_a_size()),
    };
    let value: u64 = digits.parse().map_err(|_| not_a_size())?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{text}' is too large"))
}

fn parse_backing(text: &str) -> Result<Backing, String> {
    text.parse()
        .map_err(|e: gpuvm_memory::RamError| e.to_string())
}

/// Sets how long this process's snapshots pause the vCPUs (`--snapshot-pause`).
pub fn set_snapshot_pause(args: &SnapshotArgs) {
    gpuvm_vmm::snapshot::set_snapshot_pause(match args.snapshot_pause {
        Pause::Short => gpuvm_vmm::snapshot::SnapshotPause::Short,
        Pause::Full => gpuvm_vmm::snapshot::SnapshotPause::Full,
    });
}

pub fn snapshot_policy(args: &SnapshotArgs) -> Option<SnapshotPolicy> {
    let dir = args.snapshot_dir.clone()?;
    Some(SnapshotPolicy {
        dir,
        after: args.snapshot_after_ms.map(Duration::from_millis),
        on_signal: true,
        then: match args.snapshot_then {
            Then::Resume => AfterSnapshot::Resume,
            Then::Exit => AfterSnapshot::Exit,
        },
    })
}

/// `gpuvm update`.
#[derive(Args, Debug)]
pub struct UpdateArgs {
    /// Process id of the running gpuvm (started with --api-sock).
    #[arg(long)]
    pub pid: i32,
    /// The gpuvm binary to hand the VM to (default: the binary the running gpuvm was
    /// started from, as it was then: /proc/PID/exe).
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// The running gpuvm's API socket (default: the one Unix socket it listens on with a
    /// path).
    #[arg(long)]
    pub api_sock: Option<PathBuf>,
    /// How long each side waits for the other at each step before the running gpuvm
    /// takes the VM back.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
}

/// `gpuvm update-receive` (started by `gpuvm update`; not for people).
#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// The hand-over socket, bound (this process listens on it), inherited as this
    /// descriptor.
    #[arg(long)]
    pub handover_fd: i32,
    /// The running gpuvm: the only process whose connection is accepted.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub old_pid: u32,
    /// A pidfd of the running gpuvm, inherited as this descriptor, when this process is
    /// in another pid namespace (its `--old-pid` is then `gpuvm update`'s view): watched
    /// for its exit. Needs `--token-fd`.
    #[arg(long, requires = "token_fd")]
    pub old_pidfd: Option<i32>,
    /// A pipe holding the hand-over token, inherited as this descriptor, with
    /// `--old-pidfd`: the running gpuvm's offer must bring it (its pid cannot be read from
    /// another pid namespace).
    #[arg(long, requires = "old_pidfd")]
    pub token_fd: Option<i32>,
    /// /dev/kvm, opened by `gpuvm update` and inherited as this descriptor: a jail need
    /// not hold the device node.
    #[arg(long)]
    pub kvm_fd: Option<i32>,
    /// The API socket to serve once the old gpuvm has gone (the same path).
    #[arg(long)]
    pub api_sock: PathBuf,
    /// How long to wait for the running gpuvm at each step.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
    /// The API the running gpuvm serves on its socket, which this one serves after it.
    #[arg(long, value_enum, default_value_t = ServedApi::Gpuvm)]
    pub api: ServedApi,
    /// Firecracker's instance id (`--api firecracker`), as the running gpuvm was given it.
    #[arg(long, default_value = crate::firecracker::DEFAULT_ID)]
    pub instance_id: String,
    #[command(flatten)]
    pub seccomp: SeccompArgs,
}

/// Which API a live update's new process serves: the one the old process served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ServedApi {
    /// gpuvm's own, which answers Cloud Hypervisor's routes under /api/v1/ too (gpuvm
    /// and `cloud-hypervisor` command lines).
    Gpuvm,
    /// Firecracker's (the `firecracker` command line), with its instance id.
    Firecracker,
}

/// `gpuvm ctl`: a client of a running gpuvm's API socket.
#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The API socket of the gpuvm to talk to.
    #[arg(long)]
    pub api_sock: PathBuf,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Subcommand, Debug)]
pub enum CtlCommand {
    /// GET /: instance information and state.
    Info,
    /// GET /machine-config.
    GetMachineConfig,
    /// PUT /machine-config.
    SetMachineConfig {
        #[arg(long)]
        vcpus: u8,
        #[arg(long, value_parser = parse_size)]
        memory: u64,
        #[arg(long, default_value = "memfd", value_parser = ["memfd", "hugetlb-2m", "hugetlb-1g"])]
        memory_backing: String,
        #[arg(long)]
        no_thp: bool,
        #[arg(long)]
        prefault: bool,
        #[arg(long, value_delimiter = ',')]
        cpuid_mask: Vec<String>,
        #[arg(long)]
        track_dirty_pages: bool,
    },
    /// PUT /boot-source (no --kernel: the embedded test guest).
    SetBootSource {
        #[arg(long)]
        kernel: Option<PathBuf>,
        #[arg(long)]
        initrd: Option<PathBuf>,
        #[arg(long)]
        cmdline: Option<String>,
    },
    /// PUT /actions InstanceStart.
    Start,
    /// PUT /actions SendCtrlAltDel (ends the run as a guest reset).
    CtrlAltDel,
    /// PATCH /vm Paused.
    Pause,
    /// PATCH /vm Resumed.
    Resume,
    /// PUT /snapshot/create.
    SnapshotCreate {
        /// Snapshot directory.
        #[arg(long)]
        dir: PathBuf,
        /// Write only pages dirtied since the last snapshot into DIR.
        #[arg(long)]
        diff: bool,
    },
    /// PUT /snapshot/load (only before start).
    SnapshotLoad {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, value_enum, default_value = "lazy")]
        restore_mode: Mode,
        #[arg(long, required_if_eq("restore_mode", "external"))]
        uffd_socket: Option<PathBuf>,
        /// Run at once instead of waiting for `resume`.
        #[arg(long)]
        resume: bool,
        /// Record the guest's working set for later lazy restores (lazy mode only).
        #[arg(long)]
        record_working_set: bool,
    },
    /// DELETE /gpus/{id}: hot-unplug a device (the guest ejects it first), or drop a
    /// configured one before start.
    RemoveGpu {
        #[arg(long)]
        id: String,
    },
    /// PUT /gpus/{id}: a passthrough device (before start: attached at start; after
    /// start: hot-plugged, answered with its PCI address).
    AddGpu {
        #[arg(long)]
        id: String,
        /// A host GPU bound to vfio-pci, e.g. 0000:41:00.0.
        #[arg(
            long,
            required_unless_present = "vfio_user_socket",
            conflicts_with = "vfio_user_socket"
        )]
        host_bdf: Option<String>,
        /// A vfio-user device's socket.
        #[arg(long)]
        vfio_user_socket: Option<PathBuf>,
    },
    /// GET /metrics.
    Metrics,
    /// Any request: METHOD PATH [JSON BODY].
    Raw {
        method: String,
        path: String,
        body: Option<String>,
    },
}

/// What clap's "invalid UTF-8" leaves out: which argument is not UTF-8. The values of
/// path flags may be any bytes, so an argument that is not UTF-8 elsewhere is the culprit
/// (all of them are named where none is outside a path flag).
pub fn not_utf8(argv: &[OsString]) -> String {
    let path_flags = path_flags();
    let culprits: Vec<usize> = (1..argv.len())
        .filter(|&i| argv[i].to_str().is_none())
        .collect();
    let text: Vec<usize> = culprits
        .iter()
        .copied()
        .filter(|&i| {
            front_end::flag_of_value(argv, i).is_none_or(|flag| !path_flags.contains(&flag))
        })
        .collect();
    let named = if text.is_empty() { culprits } else { text };
    let parts: Vec<String> = named
        .iter()
        .map(|&i| {
            format!(
                "{} is not valid UTF-8 (\"{}\")",
                front_end::describe_argument(argv, i),
                argv[i].as_bytes().escape_ascii()
            )
        })
        .collect();
    if parts.is_empty() {
        return "an argument is not valid UTF-8".into();
    }
    format!(
        "{}: gpuvm takes it as text (only file paths may be any bytes)",
        parts.join("; ")
    )
}

/// The flags, in every subcommand, whose values are paths (any bytes): `--kernel`, `-o`.
fn path_flags() -> Vec<String> {
    fn collect(command: &clap::Command, flags: &mut Vec<String>) {
        for arg in command.get_arguments() {
            let parser = arg.get_value_parser().type_id();
            if parser == TypeId::of::<PathBuf>() || parser == TypeId::of::<OsString>() {
                flags.extend(arg.get_long().map(|l| format!("--{l}")));
                flags.extend(arg.get_short().map(|s| format!("-{s}")));
            }
        }
        for subcommand in command.get_subcommands() {
            collect(subcommand, flags);
        }
    }
    let mut flags = Vec::new();
    collect(&Cli::command(), &mut flags);
    flags
}

/// Walks another VMM's command line (Cloud Hypervisor's, Firecracker's): bare flags,
/// `--name value` and `--name=value`.
pub(crate) struct ForeignFlags<'a> {
    args: Box<dyn Iterator<Item = &'a String> + 'a>,
}

impl<'a> ForeignFlags<'a> {
    pub(crate) fn new(args: impl Iterator<Item = &'a String> + 'a) -> Self {
        ForeignFlags {
            args: Box::new(args),
        }
    }

    /// The next flag's name, and its value when written after an `=`.
    pub(crate) fn next_flag(&mut self) -> Option<(&'a str, Option<&'a str>)> {
        let arg = self.args.next()?;
        Some(match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value)),
            _ => (arg.as_str(), None),
        })
    }

    /// The value of flag `name`: the one after its `=`, else the next argument.
    pub(crate) fn value(&mut self, name: &str, inline: Option<&str>) -> Result<String, String> {
        inline
            .map(str::to_string)
            .or_else(|| self.args.next().cloned())
            .ok_or_else(|| format!("{name} needs a value"))
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

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn arguments_that_are_not_utf8_are_named() {
        use std::os::unix::ffi::OsStringExt;
        let bad = |bytes: &[u8]| OsString::from_vec(bytes.to_vec());
        let argv = |list: Vec<OsString>| {
            let mut argv = vec![OsString::from("gpuvm")];
            argv.extend(list);
            argv
        };
        let paths = path_flags();
        for flag in [
            "--kernel",
            "--initrd",
            "--api-sock",
            "--config-file",
            "-o",
            "--output",
        ] {
            assert!(paths.contains(&flag.to_string()), "{flag}: {paths:?}");
        }
        assert!(!paths.contains(&"--cmdline".to_string()));
        // The path's bytes are fine; the command line's are not.
        let line = argv(vec![
            "run".into(),
            "--kernel".into(),
            bad(b"/k\xff"),
            "--cmdline".into(),
            bad(b"hello \xff\xfe"),
        ]);
        assert_eq!(
            not_utf8(&line),
            "the value of --cmdline is not valid UTF-8 (\"hello \\xff\\xfe\"): gpuvm takes it as text (only file paths may be any bytes)"
        );
        let mut inline = OsString::from("--log-level=");
        inline.push(bad(b"\xff"));
        let message = not_utf8(&argv(vec![inline, "run".into()]));
        assert!(
            message.starts_with("the value of --log-level "),
            "{message}"
        );
        let message = not_utf8(&argv(vec!["ctl".into(), "raw".into(), bad(b"G\xffT")]));
        assert!(message.starts_with("argument 3 is not"), "{message}");
    }
}
