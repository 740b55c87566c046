//! Firecracker's jailer flags: their syntax, the instance id and the cgroup and limit
//! arguments, checked before anything is touched (the paths are checked by
//! [`crate::plan`]).

use std::path::{Component, PathBuf};

use crate::rlimits::Resource;
use crate::JailerError;

pub(crate) const USAGE: &str = "\
usage: jailer --id <id> --exec-file <file> --uid <uid> --gid <gid>
              [--chroot-base-dir <dir>] [--netns <path>] [--daemonize] [--new-pid-ns]
              [--cgroup <file>=<value>]... [--cgroup-version 1|2] [--parent-cgroup <path>]
              [--resource-limit fsize=<n>|no-file=<n>]... [-- <arguments for the exec file>]";
const DEFAULT_CHROOT_BASE: &str = "/srv/jailer";
const MAX_ID_LEN: usize = 64;

/// What the jailer's flags, as parsed, ask for.
#[derive(Debug, PartialEq)]
pub(crate) struct JailerArgs {
    pub(crate) id: String,
    pub(crate) exec_file: PathBuf,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) chroot_base: PathBuf,
    pub(crate) netns: Option<PathBuf>,
    pub(crate) daemonize: bool,
    pub(crate) new_pid_ns: bool,
    /// `(file, value)`, e.g. `("cpu.max", "50000 100000")`.
    pub(crate) cgroups: Vec<(String, String)>,
    pub(crate) cgroup_version: u8,
    pub(crate) parent_cgroup: Option<PathBuf>,
    pub(crate) resource_limits: Vec<(Resource, u64)>,
    /// Everything after `--`, for the exec file.
    pub(crate) extra: Vec<String>,
}

#[derive(Debug, PartialEq)]
pub(crate) enum Parsed {
    Help,
    Version,
    Run(Box<JailerArgs>),
}

fn set_once<T>(slot: &mut Option<T>, name: &'static str, value: T) -> Result<(), JailerError> {
    if slot.replace(value).is_some() {
        return Err(JailerError::Duplicate(name));
    }
    Ok(())
}

fn parse_number<T: std::str::FromStr>(flag: &'static str, value: &str) -> Result<T, JailerError> {
    value.parse().map_err(|_| JailerError::InvalidNumber {
        flag,
        value: value.into(),
    })
}

/// The flags' syntax and the id; the paths are checked by [`crate::plan`].
pub(crate) fn parse(args: &[String]) -> Result<Parsed, JailerError> {
    let skip = if args.get(1).map(String::as_str) == Some("jailer") {
        2
    } else {
        1
    };
    let mut rest = args.iter().skip(skip);
    let (mut id, mut exec_file, mut uid, mut gid) = (None, None, None, None);
    let (mut chroot_base, mut netns, mut version, mut parent) = (None, None, None, None);
    let (mut daemonize, mut new_pid_ns) = (false, false);
    let (mut cgroups, mut limits, mut extra) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(arg) = rest.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_string())),
            _ => (arg.as_str(), None),
        };
        macro_rules! value {
            ($flag:literal) => {
                match inline.clone().or_else(|| rest.next().cloned()) {
                    Some(value) => value,
                    None => return Err(JailerError::MissingValue($flag)),
                }
            };
        }
        match name {
            "--" => {
                extra.extend(rest.by_ref().cloned());
            }
            "--help" | "-h" => return Ok(Parsed::Help),
            "--version" => return Ok(Parsed::Version),
            "--id" => set_once(&mut id, "--id", value!("--id"))?,
            "--exec-file" => set_once(&mut exec_file, "--exec-file", value!("--exec-file"))?,
            "--uid" => set_once(&mut uid, "--uid", value!("--uid"))?,
            "--gid" => set_once(&mut gid, "--gid", value!("--gid"))?,
            "--chroot-base-dir" => set_once(
                &mut chroot_base,
                "--chroot-base-dir",
                value!("--chroot-base-dir"),
            )?,
            "--netns" => set_once(&mut netns, "--netns", value!("--netns"))?,
            "--cgroup-version" => {
                set_once(&mut version, "--cgroup-version", value!("--cgroup-version"))?
            }
            "--parent-cgroup" => {
                set_once(&mut parent, "--parent-cgroup", value!("--parent-cgroup"))?
            }
            "--daemonize" => daemonize = true,
            "--new-pid-ns" => new_pid_ns = true,
            "--cgroup" => cgroups.push(parse_cgroup(&value!("--cgroup"))?),
            "--resource-limit" => limits.push(parse_limit(&value!("--resource-limit"))?),
            _ => return Err(JailerError::UnknownArgument(arg.clone())),
        }
    }
    let id = id.ok_or(JailerError::Required("--id"))?;
    validate_id(&id)?;
    let exec_file = exec_file.ok_or(JailerError::Required("--exec-file"))?;
    let uid = parse_number("--uid", &uid.ok_or(JailerError::Required("--uid"))?)?;
    let gid = parse_number("--gid", &gid.ok_or(JailerError::Required("--gid"))?)?;
    let cgroup_version = match version.as_deref() {
        None | Some("1") => 1,
        Some("2") => 2,
        Some(other) => return Err(JailerError::CgroupVersion(other.into())),
    };
    let parent_cgroup = parent
        .map(|p| {
            let path = PathBuf::from(&p);
            let plain =
                !p.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)));
            plain.then_some(path).ok_or(JailerError::ParentCgroup(p))
        })
        .transpose()?;
    Ok(Parsed::Run(Box::new(JailerArgs {
        id,
        exec_file: exec_file.into(),
        uid,
        gid,
        chroot_base: chroot_base
            .unwrap_or_else(|| DEFAULT_CHROOT_BASE.into())
            .into(),
        netns: netns.map(PathBuf::from),
        daemonize,
        new_pid_ns,
        cgroups,
        cgroup_version,
        parent_cgroup,
        resource_limits: limits,
        extra,
    })))
}

/// Ids name directories and cgroups: ASCII letters, digits and `-`, 1 to 64 of them.
fn validate_id(id: &str) -> Result<(), JailerError> {
    let why = if id.is_empty() || id.len() > MAX_ID_LEN {
        format!("its length is {}, not 1 to {MAX_ID_LEN}", id.len())
    } else if let Some((position, c)) = id
        .chars()
        .enumerate()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '-'))
    {
        format!("character {c:?} at position {position}: only letters, digits and '-' are allowed")
    } else {
        return Ok(());
    };
    Err(JailerError::InvalidId { id: id.into(), why })
}

/// `<controller>.<file>=<value>`: the file is joined to the cgroup's directory, so it may
/// name neither another directory (`/`) nor a hidden or parent entry (leading `.`).
fn parse_cgroup(arg: &str) -> Result<(String, String), JailerError> {
    let bad = || JailerError::CgroupFormat(arg.into());
    let (file, value) = arg.split_once('=').ok_or_else(bad)?;
    let controller_ok = file
        .split_once('.')
        .is_some_and(|(controller, rest)| !controller.is_empty() && !rest.is_empty());
    if value.is_empty() || value.contains('=') || !controller_ok || file.contains('/') {
        return Err(bad());
    }
    if file == "." || file == ".." || file.starts_with('.') {
        return Err(bad());
    }
    Ok((file.into(), value.into()))
}

/// `fsize=<bytes>` or `no-file=<count>`, the two limits Firecracker's jailer takes.
fn parse_limit(arg: &str) -> Result<(Resource, u64), JailerError> {
    let bad = || JailerError::ResourceLimitFormat(arg.into());
    let (name, value) = arg.split_once('=').ok_or_else(bad)?;
    let resource = match name {
        "fsize" => Resource::FileSize,
        "no-file" => Resource::OpenFiles,
        _ => return Err(bad()),
    };
    Ok((resource, value.parse().map_err(|_| bad())?))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// The arguments of a command line that parses to a run (other modules' tests plan
    /// from them).
    pub(crate) fn run_args(list: &[&str]) -> JailerArgs {
        match parse(&args(list)).unwrap() {
            Parsed::Run(parsed) => *parsed,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn jailer_command_lines_parse() {
        let parsed = run_args(&[
            "/usr/bin/jailer",
            "--id",
            "551e7604-e35c-42b3",
            "--exec-file",
            "/usr/bin/firecracker",
            "--uid",
            "123",
            "--gid=100",
            "--cgroup",
            "cpuset.mems=0",
            "--cgroup",
            "cpu.max=50000 100000",
            "--cgroup-version",
            "2",
            "--parent-cgroup",
            "all/uvms",
            "--resource-limit",
            "no-file=1024",
            "--netns",
            "/var/run/netns/x",
            "--daemonize",
            "--new-pid-ns",
            "--",
            "--api-sock",
            "/run/api.sock",
            "--unknown-to-the-jailer",
        ]);
        assert_eq!(parsed.id, "551e7604-e35c-42b3");
        assert_eq!((parsed.uid, parsed.gid), (123, 100));
        assert_eq!(parsed.chroot_base, PathBuf::from(DEFAULT_CHROOT_BASE));
        assert_eq!(
            parsed.cgroups,
            vec![
                ("cpuset.mems".into(), "0".into()),
                ("cpu.max".into(), "50000 100000".into())
            ]
        );
        assert_eq!(parsed.cgroup_version, 2);
        assert_eq!(parsed.parent_cgroup, Some("all/uvms".into()));
        assert_eq!(parsed.resource_limits, vec![(Resource::OpenFiles, 1024)]);
        assert!(parsed.daemonize && parsed.new_pid_ns);
        assert_eq!(
            parsed.extra,
            args(&["--api-sock", "/run/api.sock", "--unknown-to-the-jailer"])
        );
        let plain = run_args(&[
            "gpuvm",
            "jailer",
            "--id",
            "a",
            "--exec-file",
            "f",
            "--uid",
            "0",
            "--gid",
            "0",
        ]);
        assert_eq!(plain.cgroup_version, 1);
    }

    #[test]
    fn bad_jailer_command_lines_are_refused_naming_the_problem() {
        let base = ["jailer", "--exec-file", "/f", "--uid", "1", "--gid", "1"];
        let refused = |extra: &[&str]| {
            let mut list: Vec<&str> = base.to_vec();
            list.extend_from_slice(extra);
            parse(&args(&list)).unwrap_err().to_string()
        };
        assert!(refused(&["--id", "../x"]).contains("'.'"));
        assert!(refused(&["--id", &"a".repeat(65)]).contains("length is 65"));
        assert!(refused(&["--id", ""]).contains("length is 0"));
        assert!(refused(&[]).contains("--id is required"));
        assert!(refused(&["--id", "a", "--bogus"]).contains("\"--bogus\""));
        assert!(refused(&["--id", "a", "--id", "b"]).contains("twice"));
        assert!(refused(&["--id", "a", "--cgroup", "cpu.max"]).contains("cpu.max"));
        assert!(refused(&["--id", "a", "--cgroup", "../x.y=1"]).contains("../x.y=1"));
        assert!(refused(&["--id", "a", "--cgroup", "nodot=1"]).contains("nodot"));
        assert!(refused(&["--id", "a", "--cgroup-version", "3"]).contains("\"3\""));
        assert!(refused(&["--id", "a", "--parent-cgroup", "../up"]).contains("../up"));
        assert!(refused(&["--id", "a", "--parent-cgroup", "/abs"]).contains("/abs"));
        assert!(refused(&["--id", "a", "--resource-limit", "cpu=1"]).contains("cpu=1"));
        assert!(refused(&["--id", "a", "--resource-limit", "fsize=x"]).contains("fsize=x"));
        assert!(refused(&["--id", "a", "--uid"]).contains("--uid needs a value"));
        let no_uid = parse(&args(&[
            "jailer",
            "--id",
            "a",
            "--exec-file",
            "/f",
            "--gid",
            "1",
        ]));
        assert!(no_uid
            .unwrap_err()
            .to_string()
            .contains("--uid is required"));
        let bad_uid = parse(&args(&[
            "jailer",
            "--id",
            "a",
            "--exec-file",
            "/f",
            "--uid",
            "-1",
            "--gid",
            "1",
        ]));
        assert!(bad_uid.unwrap_err().to_string().contains("--uid \"-1\""));
        assert_eq!(
            parse(&args(&["jailer", "--version"])).unwrap(),
            Parsed::Version
        );
    }
}
