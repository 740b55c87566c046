//! Which command line this process takes: gpuvm's own, or one of the peers' it stands in
//! for (Cloud Hypervisor's, Firecracker's, Firecracker's jailer's).
//!
//! The program name decides first: `cloud-hypervisor`, `firecracker` and `jailer` (argv[0]'s
//! file name, as a symlink or hard link gives it) are those front ends whatever follows.
//! Under any other name (`gpuvm`, or a link Kata resolved with `filepath.EvalSymlinks`
//! before starting it) the first argument decides:
//! - `ch` or `--ch-compat`, `firecracker` or `--fc-compat`, `jailer`: that front end;
//! - a word (a gpuvm subcommand: `run`, `restore`, `ctl`, `help`, ..., or a misspelt one
//!   that gpuvm's parser then names) or one of gpuvm's own top-level flags (`--help`,
//!   `--version`, `--log-level`, ...): gpuvm;
//! - otherwise the flags only one peer takes pick it (`--api-socket`, `--kernel`, `-v`:
//!   Cloud Hypervisor; `--api-sock`, `--config-file`, `--boot-timer`: Firecracker;
//!   `--exec-file`, `--uid`, `--chroot-base-dir`: the jailer). Flags of two peers, or only
//!   flags several share (`--id`), are an error that says how to choose.
//!
//! Everything here works on the arguments' bytes: an argument that is not UTF-8 never
//! decides anything and never stops the choice (the chosen front end reports it).

use std::ffi::OsString;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontEnd {
    Gpuvm,
    CloudHypervisor,
    Firecracker,
    Jailer,
}

impl FrontEnd {
    /// The program name that selects this front end.
    pub fn program(self) -> &'static str {
        match self {
            FrontEnd::Gpuvm => "gpuvm",
            FrontEnd::CloudHypervisor => "cloud-hypervisor",
            FrontEnd::Firecracker => "firecracker",
            FrontEnd::Jailer => "jailer",
        }
    }

    fn title(self) -> &'static str {
        match self {
            FrontEnd::Gpuvm => "gpuvm's own",
            FrontEnd::CloudHypervisor => "Cloud Hypervisor's",
            FrontEnd::Firecracker => "Firecracker's",
            FrontEnd::Jailer => "the jailer's",
        }
    }
}

const PEERS: [FrontEnd; 3] = [
    FrontEnd::CloudHypervisor,
    FrontEnd::Firecracker,
    FrontEnd::Jailer,
];

/// A flag of a peer's command line: its name, whether a value follows it (as the next
/// argument, unless written `--name=value`), and the front ends that take it.
struct Flag {
    name: &'static str,
    takes_value: bool,
    front_ends: &'static [FrontEnd],
}

const fn flag(name: &'static str, takes_value: bool, front_ends: &'static [FrontEnd]) -> Flag {
    Flag {
        name,
        takes_value,
        front_ends,
    }
}

const CH: &[FrontEnd] = &[FrontEnd::CloudHypervisor];
const FC: &[FrontEnd] = &[FrontEnd::Firecracker];
const JAILER: &[FrontEnd] = &[FrontEnd::Jailer];

/// The flags the peers' parsers take (cloud_hypervisor.rs, firecracker.rs, the jailer's
/// usage; `--node` is the old jailer's NUMA flag, which Kata still passes).
const FLAGS: &[Flag] = &[
    // Cloud Hypervisor.
    flag("--api-socket", true, CH),
    flag("--kernel", true, CH),
    flag("--cmdline", true, CH),
    flag("--initramfs", true, CH),
    flag("--cpus", true, CH),
    flag("--memory", true, CH),
    flag("--disk", true, CH),
    flag("--net", true, CH),
    flag("--fs", true, CH),
    flag("--vsock", true, CH),
    flag("--rng", true, CH),
    flag("--device", true, CH),
    flag("--user-device", true, CH),
    flag("--serial", true, CH),
    flag("--console", true, CH),
    flag("--restore", true, CH),
    flag("-v", false, CH),
    flag("-vv", false, CH),
    flag("-vvv", false, CH),
    flag("-vvvv", false, CH),
    flag("--seccomp", true, CH),
    flag("--event-monitor", true, CH),
    flag("--log-file", true, CH),
    // Firecracker.
    flag("--api-sock", true, FC),
    flag("--config-file", true, FC),
    flag("--no-api", false, FC),
    flag("--log-path", true, FC),
    flag("--level", true, FC),
    flag("--show-level", false, FC),
    flag("--show-log-origin", false, FC),
    flag("--metrics-path", true, FC),
    flag("--boot-timer", false, FC),
    flag("--seccomp-level", true, FC),
    flag("--no-seccomp", false, FC),
    flag("--start-time-us", true, FC),
    flag("--start-time-cpu-us", true, FC),
    flag("--parent-cpu-time-us", true, FC),
    // The jailer.
    flag("--exec-file", true, JAILER),
    flag("--uid", true, JAILER),
    flag("--gid", true, JAILER),
    flag("--chroot-base-dir", true, JAILER),
    flag("--netns", true, JAILER),
    flag("--daemonize", false, JAILER),
    flag("--new-pid-ns", false, JAILER),
    flag("--cgroup", true, JAILER),
    flag("--cgroup-version", true, JAILER),
    flag("--parent-cgroup", true, JAILER),
    flag("--resource-limit", true, JAILER),
    flag("--node", true, JAILER),
    // Shared: they select nothing.
    flag("--id", true, &[FrontEnd::Firecracker, FrontEnd::Jailer]),
    flag(
        "--version",
        false,
        &[
            FrontEnd::CloudHypervisor,
            FrontEnd::Firecracker,
            FrontEnd::Jailer,
        ],
    ),
    flag(
        "-V",
        false,
        &[FrontEnd::CloudHypervisor, FrontEnd::Firecracker],
    ),
];

/// gpuvm's own top-level flags (before a subcommand): as a first argument they keep the
/// command line gpuvm's (`gpuvm --version` is gpuvm's version).
pub(crate) const GPUVM_FLAGS: &[&str] = &[
    "-h",
    "--help",
    "-V",
    "--version",
    "--log-level",
    "--log-format",
];

/// Why no front end could be chosen.
#[derive(Debug, PartialEq, Eq)]
pub enum SelectError {
    /// Flags of two peers or more: each front end with the first of its flags found.
    Mixed(Vec<(FrontEnd, String)>),
    /// Only flags several peers share.
    Undecided(Vec<String>),
}

/// The flags only `front_end` takes.
fn own_flags(front_end: FrontEnd) -> impl Iterator<Item = &'static str> {
    FLAGS
        .iter()
        .filter(move |f| f.front_ends == [front_end])
        .map(|f| f.name)
}

impl fmt::Display for SelectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectError::Mixed(found) => {
                let parts: Vec<String> = found
                    .iter()
                    .map(|(front_end, flag)| {
                        format!(
                            "{flag} selects {} ({})",
                            front_end.title(),
                            front_end.program()
                        )
                    })
                    .collect();
                write!(
                    f,
                    "this command line mixes the flags of two front ends: {}",
                    parts.join(", ")
                )?;
            }
            SelectError::Undecided(flags) => {
                let parts: Vec<String> = flags
                    .iter()
                    .map(|name| {
                        let owners: Vec<&str> = FLAGS
                            .iter()
                            .find(|f| f.name == name)
                            .map(|f| f.front_ends.iter().map(|e| e.program()).collect())
                            .unwrap_or_default();
                        format!("{name} is taken by {}", owners.join(" and "))
                    })
                    .collect();
                write!(
                    f,
                    "this command line does not say which front end it is for: {}",
                    parts.join(", ")
                )?;
            }
        }
        writeln!(f)?;
        writeln!(
            f,
            "gpuvm takes its front end from its program name: cloud-hypervisor, firecracker or jailer (a symlink or hard link to gpuvm), else from the command line:"
        )?;
        writeln!(
            f,
            "  gpuvm's own: a subcommand first (run, restore, snapshot, ctl, check-host, guest-image, help) or --help, --version, --log-level, --log-format"
        )?;
        writeln!(
            f,
            "  the first argument `ch` or `--ch-compat`, `firecracker` or `--fc-compat`, `jailer`: that front end"
        )?;
        for peer in PEERS {
            writeln!(
                f,
                "  {} ({}): flags only it takes: {}",
                peer.title(),
                peer.program(),
                own_flags(peer).collect::<Vec<_>>().join(", ")
            )?;
        }
        write!(
            f,
            "  shared, selecting nothing by themselves: --id (firecracker, jailer), --version, -V"
        )
    }
}

/// The front end for the command line `argv` (argv[0] included).
pub fn select(argv: &[OsString]) -> Result<FrontEnd, SelectError> {
    let name = argv
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.as_bytes());
    for peer in PEERS {
        if name == Some(peer.program().as_bytes()) {
            return Ok(peer);
        }
    }
    let Some(first) = argv.get(1).map(|a| a.as_bytes()) else {
        return Ok(FrontEnd::Gpuvm);
    };
    match first {
        b"ch" | b"--ch-compat" => return Ok(FrontEnd::CloudHypervisor),
        b"firecracker" | b"--fc-compat" => return Ok(FrontEnd::Firecracker),
        b"jailer" => return Ok(FrontEnd::Jailer),
        _ => {}
    }
    if !first.starts_with(b"-") || GPUVM_FLAGS.iter().any(|f| flag_name(first) == f.as_bytes()) {
        return Ok(FrontEnd::Gpuvm);
    }
    // The first flag of each peer's own, and the shared ones seen.
    let mut own: Vec<(FrontEnd, String)> = Vec::new();
    let mut shared: Vec<String> = Vec::new();
    let mut rest = argv[1..].iter().map(|a| a.as_bytes());
    while let Some(arg) = rest.next() {
        if arg == b"--" {
            // The jailer's: what follows goes to the exec file.
            break;
        }
        let name = flag_name(arg);
        let Some(flag) = FLAGS.iter().find(|f| f.name.as_bytes() == name) else {
            continue;
        };
        if flag.takes_value && name.len() == arg.len() {
            rest.next();
        }
        match flag.front_ends {
            [front_end] => {
                if !own.iter().any(|(seen, _)| seen == front_end) {
                    own.push((*front_end, flag.name.to_string()));
                }
            }
            _ => {
                if !shared.iter().any(|s| s == flag.name) {
                    shared.push(flag.name.to_string());
                }
            }
        }
    }
    match own.as_slice() {
        [(front_end, _)] => Ok(*front_end),
        [] if shared.is_empty() => Ok(FrontEnd::Gpuvm),
        [] => Err(SelectError::Undecided(shared)),
        _ => Err(SelectError::Mixed(own)),
    }
}

/// A flag's name: `--name=value` without `=value`.
fn flag_name(arg: &[u8]) -> &[u8] {
    if arg.starts_with(b"--") {
        if let Some(at) = arg.iter().position(|&b| b == b'=') {
            return &arg[..at];
        }
    }
    arg
}

/// `argv` as text for the peers' parsers: an argument that is not UTF-8 is refused,
/// naming it (the flag whose value it is, where it follows one) and `front_end`.
pub fn utf8_args(argv: &[OsString], front_end: FrontEnd) -> Result<Vec<String>, String> {
    let mut texts = Vec::with_capacity(argv.len());
    for (index, arg) in argv.iter().enumerate() {
        match arg.to_str() {
            Some(text) => texts.push(text.to_string()),
            // Only the program's file name matters, and only when it is a peer's name.
            None if index == 0 => texts.push(arg.to_string_lossy().into_owned()),
            None => {
                return Err(format!(
                    "{} is not valid UTF-8 (\"{}\"): {} command line in gpuvm takes text arguments only",
                    describe_argument(argv, index),
                    arg.as_bytes().escape_ascii(),
                    front_end.title()
                ))
            }
        }
    }
    Ok(texts)
}

/// `the value of --kernel`, or `argument N` where no flag names it.
pub fn describe_argument(argv: &[OsString], index: usize) -> String {
    match flag_of_value(argv, index) {
        Some(flag) => format!("the value of {flag}"),
        None => format!("argument {index}"),
    }
}

/// The flag whose value argument `index` holds: `--name=value`, or the argument after a
/// flag (`-o value`, `--name value`).
pub fn flag_of_value(argv: &[OsString], index: usize) -> Option<String> {
    let bytes = argv[index].as_bytes();
    let inline = flag_name(bytes);
    if inline.len() < bytes.len() {
        return Some(String::from_utf8_lossy(inline).into_owned());
    }
    let previous = argv[index.checked_sub(1).filter(|&i| i > 0)?].as_bytes();
    let is_flag = previous.starts_with(b"-") && previous.len() > 1 && previous != b"--";
    // A flag written with its value (`--name=value`) takes no other.
    (is_flag && previous.is_ascii() && flag_name(previous) == previous)
        .then(|| String::from_utf8_lossy(previous).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn argv(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    fn selected(list: &[&str]) -> FrontEnd {
        select(&argv(list)).unwrap_or_else(|e| panic!("{list:?}: {e}"))
    }

    fn refused(list: &[&str]) -> SelectError {
        select(&argv(list)).expect_err(&format!("{list:?} is ambiguous"))
    }

    #[test]
    fn the_program_name_wins() {
        for (name, front_end) in [
            ("cloud-hypervisor", FrontEnd::CloudHypervisor),
            ("/usr/bin/cloud-hypervisor", FrontEnd::CloudHypervisor),
            ("./firecracker", FrontEnd::Firecracker),
            ("/opt/kata/bin/firecracker", FrontEnd::Firecracker),
            ("jailer", FrontEnd::Jailer),
            ("/usr/local/bin/jailer", FrontEnd::Jailer),
        ] {
            assert_eq!(selected(&[name]), front_end, "{name}");
            // Whatever follows, even another front end's flags or a gpuvm subcommand.
            assert_eq!(selected(&[name, "--version"]), front_end, "{name}");
            assert_eq!(selected(&[name, "run", "--api-sock", "/s"]), front_end);
            assert_eq!(
                selected(&[name, "--api-socket", "/s", "--exec-file", "/f"]),
                front_end
            );
        }
        // Only the file name counts: a directory named like a peer does not.
        assert_eq!(
            selected(&["/opt/firecracker/gpuvm", "run"]),
            FrontEnd::Gpuvm
        );
        assert_eq!(selected(&["cloud-hypervisor-v40", "run"]), FrontEnd::Gpuvm);
    }

    #[test]
    fn gpuvm_subcommands_and_flags_stay_gpuvm() {
        for name in ["gpuvm", "/usr/bin/gpuvm", "gpuvm-0.1", "/proc/self/exe", ""] {
            for first in [
                "run",
                "restore",
                "snapshot",
                "ctl",
                "check-host",
                "guest-image",
                "help",
                "runn",
                "--help",
                "-h",
                "--version",
                "-V",
                "--log-level",
                "--log-level=debug",
                "--log-format",
                "--log-format=json",
            ] {
                assert_eq!(selected(&[name, first]), FrontEnd::Gpuvm, "{name} {first}");
            }
            assert_eq!(selected(&[name]), FrontEnd::Gpuvm);
            // The subcommand's flags are its own, even where a peer has the same name.
            assert_eq!(
                selected(&[
                    name,
                    "run",
                    "--api-sock",
                    "/s",
                    "--kernel",
                    "/k",
                    "--uid",
                    "1"
                ]),
                FrontEnd::Gpuvm
            );
            assert_eq!(
                selected(&[name, "--log-level", "debug", "run", "--api-sock", "/s"]),
                FrontEnd::Gpuvm
            );
            assert_eq!(
                selected(&[name, "--version", "--api-socket", "/s"]),
                FrontEnd::Gpuvm
            );
            // A word first is a subcommand, misspelt or not: gpuvm's parser names it.
            assert_eq!(
                selected(&[name, "boot", "--api-socket", "/s"]),
                FrontEnd::Gpuvm
            );
        }
        // No peer flag at all: gpuvm's parser refuses the unknown flag.
        assert_eq!(selected(&["gpuvm", "--frobnicate"]), FrontEnd::Gpuvm);
    }

    #[test]
    fn the_first_argument_names_a_front_end() {
        assert_eq!(selected(&["gpuvm", "ch"]), FrontEnd::CloudHypervisor);
        assert_eq!(
            selected(&["gpuvm", "--ch-compat", "--api-sock", "/s"]),
            FrontEnd::CloudHypervisor
        );
        assert_eq!(selected(&["gpuvm", "firecracker"]), FrontEnd::Firecracker);
        assert_eq!(
            selected(&["gpuvm", "--fc-compat", "--kernel", "/k"]),
            FrontEnd::Firecracker
        );
        assert_eq!(
            selected(&["gpuvm", "jailer", "--api-socket", "/s"]),
            FrontEnd::Jailer
        );
    }

    #[test]
    fn cloud_hypervisor_flags_select_cloud_hypervisor() {
        for line in [
            // Kata's launchClh.
            &[
                "/usr/bin/gpuvm",
                "--api-socket",
                "/run/clh.sock",
                "-v",
                "--seccomp",
                "true",
            ][..],
            &["gpuvm", "--api-socket=/s"],
            &["gpuvm", "--api-socket", "path=/s"],
            &["gpuvm", "-v", "--api-socket", "/s"],
            &["gpuvm", "-vvv"],
            &[
                "gpuvm",
                "--kernel",
                "/k",
                "--cmdline",
                "console=ttyS0 --api-sock x",
            ],
            &[
                "gpuvm", "--kernel", "/k", "--disk", "path=/a", "path=/b", "--net", "fd=3",
            ],
            &["gpuvm", "--restore", "source_url=file:///s", "--version"],
            &["gpuvm", "--seccomp", "false", "--api-socket", "/s"],
            &[
                "gpuvm",
                "--event-monitor",
                "path=/e",
                "--log-file",
                "/l",
                "--api-socket",
                "/s",
            ],
            // Unknown flags select nothing; Cloud Hypervisor's parser names them.
            &["gpuvm", "--balloon", "size=1G", "--kernel", "/k"],
        ] {
            assert_eq!(selected(line), FrontEnd::CloudHypervisor, "{line:?}");
        }
    }

    #[test]
    fn firecracker_flags_select_firecracker() {
        for line in [
            // Kata's fcInit, not jailed.
            &[
                "/usr/bin/gpuvm",
                "--api-sock",
                "/run/fc.sock",
                "--config-file",
                "/c.json",
            ][..],
            &["gpuvm", "--config-file=/c.json", "--no-api"],
            &["gpuvm", "--id", "vm1", "--boot-timer"],
            &[
                "gpuvm",
                "--api-sock",
                "/s",
                "--id",
                "vm1",
                "--log-path",
                "/l",
                "--level",
                "Info",
            ],
            &[
                "gpuvm",
                "--show-level",
                "--show-log-origin",
                "--metrics-path",
                "/m",
            ],
            &["gpuvm", "--seccomp-level", "0"],
            &["gpuvm", "--no-seccomp", "--api-sock", "/s"],
            // What the jailer execs when the exec file is gpuvm itself: `/gpuvm --id ...`.
            &[
                "/gpuvm",
                "--id",
                "vm1",
                "--start-time-us",
                "1",
                "--start-time-cpu-us",
                "2",
                "--parent-cpu-time-us",
                "3",
                "--config-file",
                "/fcConfig.json",
            ],
            // A value that looks like another front end's flag is a value.
            &["gpuvm", "--id", "--kernel", "--api-sock", "/s"],
        ] {
            assert_eq!(selected(line), FrontEnd::Firecracker, "{line:?}");
        }
    }

    #[test]
    fn jailer_flags_select_the_jailer() {
        for line in [
            // Kata's fcInit, jailed.
            &[
                "/usr/bin/gpuvm",
                "--id",
                "vm1",
                "--node",
                "0",
                "--exec-file",
                "/usr/bin/gpuvm",
                "--uid",
                "0",
                "--gid",
                "0",
                "--chroot-base-dir",
                "/run/vc",
                "--daemonize",
                "--netns",
                "/run/netns/x",
                "--",
                "--config-file",
                "/fcConfig.json",
            ][..],
            &["gpuvm", "--exec-file=/f", "--uid=1", "--gid=1", "--id=a"],
            &["gpuvm", "--uid", "1", "--gid", "1"],
            &[
                "gpuvm",
                "--cgroup",
                "cpu.max=1",
                "--cgroup-version",
                "2",
                "--new-pid-ns",
            ],
            &[
                "gpuvm",
                "--parent-cgroup",
                "p",
                "--resource-limit",
                "no-file=8",
            ],
            // After `--`: the exec file's arguments, Firecracker's or Cloud Hypervisor's.
            &[
                "gpuvm",
                "--exec-file",
                "/f",
                "--",
                "--api-sock",
                "/s",
                "--api-socket",
                "/t",
            ],
        ] {
            assert_eq!(selected(line), FrontEnd::Jailer, "{line:?}");
        }
    }

    #[test]
    fn mixed_and_undecided_command_lines_are_refused() {
        let mixed = refused(&["gpuvm", "--api-socket", "/s", "--api-sock", "/t"]);
        assert_eq!(
            mixed,
            SelectError::Mixed(vec![
                (FrontEnd::CloudHypervisor, "--api-socket".into()),
                (FrontEnd::Firecracker, "--api-sock".into()),
            ])
        );
        let message = mixed.to_string();
        for needle in [
            "--api-socket selects Cloud Hypervisor's (cloud-hypervisor)",
            "--api-sock selects Firecracker's (firecracker)",
            "symlink",
            "run, restore",
            "--exec-file",
            "--boot-timer",
            "--ch-compat",
        ] {
            assert!(message.contains(needle), "{message} lacks {needle:?}");
        }
        assert_eq!(
            refused(&["gpuvm", "-v", "--exec-file", "/f", "--config-file", "/c"]),
            SelectError::Mixed(vec![
                (FrontEnd::CloudHypervisor, "-v".into()),
                (FrontEnd::Jailer, "--exec-file".into()),
                (FrontEnd::Firecracker, "--config-file".into()),
            ])
        );
        assert!(matches!(
            refused(&["gpuvm", "--kernel=/k", "--uid=0"]),
            SelectError::Mixed(_)
        ));
        let undecided = refused(&["gpuvm", "--id", "vm1"]);
        assert_eq!(undecided, SelectError::Undecided(vec!["--id".into()]));
        assert!(
            undecided
                .to_string()
                .contains("--id is taken by firecracker and jailer"),
            "{undecided}"
        );
        assert!(matches!(
            refused(&["gpuvm", "--id=a", "--version"]),
            SelectError::Undecided(_)
        ));
    }

    #[test]
    fn bytes_that_are_not_utf8_decide_nothing() {
        let bad = OsString::from_vec(b"/tmp/\xff\xfe".to_vec());
        let mut line = argv(&["gpuvm", "--kernel"]);
        line.push(bad.clone());
        assert_eq!(select(&line), Ok(FrontEnd::CloudHypervisor));
        let mut line = vec![OsString::from_vec(b"/bin/\xffgpuvm".to_vec()), bad.clone()];
        assert_eq!(select(&line), Ok(FrontEnd::Gpuvm));
        line.push("--api-sock".into());
        assert_eq!(select(&line), Ok(FrontEnd::Gpuvm));
        let mut flags = vec![
            OsString::from("gpuvm"),
            OsString::from_vec(b"--\xff".to_vec()),
        ];
        flags.push("--config-file".into());
        flags.push(bad.clone());
        assert_eq!(select(&flags), Ok(FrontEnd::Firecracker));
        let mut name = OsString::from("/opt/");
        name.push(&bad);
        name.push("/firecracker");
        assert_eq!(select(&[name]), Ok(FrontEnd::Firecracker));
    }

    #[test]
    fn arguments_that_are_not_utf8_are_named() {
        let bad = || OsString::from_vec(b"/k\xff".to_vec());
        let line = vec!["gpuvm".into(), "--kernel".into(), bad()];
        let error = utf8_args(&line, FrontEnd::CloudHypervisor).unwrap_err();
        assert!(
            error.starts_with("the value of --kernel is not valid UTF-8 (\"/k\\xff\")"),
            "{error}"
        );
        assert!(error.contains("Cloud Hypervisor's"), "{error}");
        let mut inline = OsString::from("--config-file=");
        inline.push(bad());
        let error = utf8_args(&["firecracker".into(), inline], FrontEnd::Firecracker).unwrap_err();
        assert!(error.starts_with("the value of --config-file "), "{error}");
        let error = utf8_args(&["jailer".into(), bad()], FrontEnd::Jailer).unwrap_err();
        assert!(error.starts_with("argument 1 "), "{error}");
        // The program name is only looked at: it may be any bytes.
        assert_eq!(
            utf8_args(&[bad(), "-v".into()], FrontEnd::CloudHypervisor).unwrap(),
            ["/k\u{fffd}", "-v"]
        );
    }

    #[test]
    fn gpuvm_flags_match_its_parser() {
        use clap::CommandFactory;
        let mut command = crate::args::Cli::command();
        command.build();
        let mut flags: Vec<String> = Vec::new();
        for arg in command.get_arguments() {
            flags.extend(arg.get_long().map(|l| format!("--{l}")));
            flags.extend(arg.get_short().map(|s| format!("-{s}")));
        }
        flags.sort();
        let mut listed: Vec<String> = GPUVM_FLAGS.iter().map(|f| f.to_string()).collect();
        listed.sort();
        assert_eq!(flags, listed);
        // No subcommand of gpuvm starts with '-' or is one of the peers' selectors.
        for subcommand in command.get_subcommands() {
            let name = subcommand.get_name();
            assert!(!name.starts_with('-'));
            assert!(!["ch", "firecracker", "jailer"].contains(&name), "{name}");
        }
    }

    #[test]
    fn every_flag_is_listed_once() {
        for (i, flag) in FLAGS.iter().enumerate() {
            assert!(
                FLAGS[i + 1..].iter().all(|f| f.name != flag.name),
                "{} listed twice",
                flag.name
            );
            assert!(!flag.front_ends.is_empty());
        }
    }
}
