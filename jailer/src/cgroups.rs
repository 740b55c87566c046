//! The jail's cgroups, v1 or v2 (`--cgroup-version`): where each `--cgroup` value goes,
//! found in /proc/mounts before anything is created, then the cgroups created, filled and
//! entered.

use std::fs;
use std::path::{Path, PathBuf};

use crate::args::JailerArgs;
use crate::{io_error, JailerError};

pub(crate) const PROC_MOUNTS: &str = "/proc/mounts";

/// Where the cgroup values go, found before anything is created.
#[derive(Debug)]
pub(crate) enum CgroupPlan {
    /// Create each directory, write its values, then move this process into it (v1: one
    /// directory per hierarchy holding a controller; v2: one in the unified hierarchy).
    Create {
        version: u8,
        groups: Vec<CgroupGroup>,
    },
    /// cgroup v2 with no `--cgroup`: move into `--parent-cgroup` (default the exec file's
    /// name) if it exists, as Firecracker's jailer does.
    MoveInto(PathBuf),
}

/// One cgroup to create: in hierarchy `root`, the directory `dir` and the values for it.
#[derive(Debug)]
pub(crate) struct CgroupGroup {
    root: PathBuf,
    dir: PathBuf,
    /// `(file, value)`.
    values: Vec<(String, String)>,
}

/// The mount points in /proc/mounts of cgroup `version`, with their mount options.
fn cgroup_mounts(proc_mounts: &str, version: u8) -> Vec<(PathBuf, Vec<String>)> {
    let fs_type = if version == 1 { "cgroup" } else { "cgroup2" };
    proc_mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 4 && fields[2] == fs_type).then(|| {
                (
                    PathBuf::from(fields[1]),
                    fields[3].split(',').map(String::from).collect(),
                )
            })
        })
        .collect()
}

/// Where `--cgroup`'s values go: `<hierarchy>/<parent>/<id>` in each hierarchy holding
/// their controllers (`proc_mounts` is /proc/mounts' text); an error when a controller has
/// none, so nothing is created for a jail that cannot be built.
pub(crate) fn plan_cgroups(
    args: &JailerArgs,
    parent: &Path,
    proc_mounts: &str,
) -> Result<Option<CgroupPlan>, JailerError> {
    let version = args.cgroup_version;
    let missing = |controller: &str| JailerError::CgroupControllerMissing {
        version,
        controller: controller.into(),
    };
    if version == 2 {
        let Some((root, _)) = cgroup_mounts(proc_mounts, 2).into_iter().next() else {
            return if args.cgroups.is_empty() {
                Ok(None)
            } else {
                Err(missing("unified"))
            };
        };
        if args.cgroups.is_empty() {
            return Ok(Some(CgroupPlan::MoveInto(root.join(parent))));
        }
        let available = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        for (file, _) in &args.cgroups {
            let controller = controller_of(file);
            if !available.split_whitespace().any(|c| c == controller) {
                return Err(missing(controller));
            }
        }
        let dir = root.join(parent).join(&args.id);
        return Ok(Some(CgroupPlan::Create {
            version,
            groups: vec![CgroupGroup {
                root,
                dir,
                values: args.cgroups.clone(),
            }],
        }));
    }
    if args.cgroups.is_empty() {
        return Ok(None);
    }
    let mounts = cgroup_mounts(proc_mounts, 1);
    let mut groups: Vec<CgroupGroup> = Vec::new();
    for (file, value) in &args.cgroups {
        let controller = controller_of(file);
        let (root, _) = mounts
            .iter()
            .find(|(_, options)| options.iter().any(|o| o == controller))
            .ok_or_else(|| missing(controller))?;
        match groups.iter_mut().find(|group| &group.root == root) {
            Some(group) => group.values.push((file.clone(), value.clone())),
            None => groups.push(CgroupGroup {
                root: root.clone(),
                dir: root.join(parent).join(&args.id),
                values: vec![(file.clone(), value.clone())],
            }),
        }
    }
    Ok(Some(CgroupPlan::Create { version, groups }))
}

/// `cpu` of `cpu.max`.
fn controller_of(file: &str) -> &str {
    file.split_once('.')
        .map_or(file, |(controller, _)| controller)
}

/// Creates and fills the planned cgroups and moves this process (and so the exec file)
/// into them, recording in `created` the directories it made for a failure to remove.
pub(crate) fn enter(plan: &CgroupPlan, created: &mut Vec<PathBuf>) -> Result<(), JailerError> {
    match plan {
        CgroupPlan::MoveInto(dir) if dir.is_dir() => {
            write_cgroup_file(&dir.join("cgroup.procs"), &std::process::id().to_string())?;
        }
        CgroupPlan::MoveInto(_) => {}
        CgroupPlan::Create { version, groups } => {
            for group in groups {
                create_cgroup(*version, group, created)?;
            }
            // Moving in comes last, once every value is written (cpuset needs its cpus
            // and mems before it takes a task).
            let tasks = if *version == 1 {
                "tasks"
            } else {
                "cgroup.procs"
            };
            for group in groups {
                write_cgroup_file(&group.dir.join(tasks), &std::process::id().to_string())?;
            }
        }
    }
    Ok(())
}

/// cgroup files take one line.
fn write_cgroup_file(path: &Path, value: &str) -> Result<(), JailerError> {
    fs::write(path, format!("{value}\n")).map_err(io_error("write", path))
}

/// Creates `dir` and the directories between it and `root`, recording those it created;
/// v2 enables the controllers on the way down, v1 cpuset copies its parent's cpus and
/// mems into each new level (a new cpuset is empty and takes no task).
fn create_cgroup(
    version: u8,
    group: &CgroupGroup,
    created: &mut Vec<PathBuf>,
) -> Result<(), JailerError> {
    let CgroupGroup { root, dir, values } = group;
    let relative = dir.strip_prefix(root).unwrap_or(dir);
    let mut level = root.to_path_buf();
    let controllers: Vec<&str> = {
        let mut list: Vec<&str> = values.iter().map(|(file, _)| controller_of(file)).collect();
        list.sort_unstable();
        list.dedup();
        list
    };
    for component in relative.components() {
        if version == 2 {
            for controller in &controllers {
                write_cgroup_file(
                    &level.join("cgroup.subtree_control"),
                    &format!("+{controller}"),
                )?;
            }
        }
        let parent = level.clone();
        level.push(component);
        if !level.exists() {
            fs::create_dir(&level).map_err(io_error("create cgroup", &level))?;
            created.push(level.clone());
        }
        if version == 1 && controllers.contains(&"cpuset") {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let own = fs::read_to_string(level.join(file)).unwrap_or_default();
                if own.trim().is_empty() {
                    let inherited = fs::read_to_string(parent.join(file))
                        .map_err(io_error("read", &parent.join(file)))?;
                    write_cgroup_file(&level.join(file), inherited.trim())?;
                }
            }
        }
    }
    for (file, value) in values {
        write_cgroup_file(&dir.join(file), value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::tests::run_args;

    #[test]
    fn cgroup_hierarchies_come_from_proc_mounts() {
        let mounts = "\
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";
        let mut parsed = run_args(&[
            "jailer",
            "--id",
            "vm1",
            "--exec-file",
            "/f",
            "--uid",
            "1",
            "--gid",
            "1",
            "--cgroup",
            "cpu.shares=10",
            "--cgroup",
            "memory.limit_in_bytes=1000000",
            "--cgroup",
            "cpuacct.x=1",
        ]);
        let Some(CgroupPlan::Create { version, groups }) =
            plan_cgroups(&parsed, Path::new("firecracker"), mounts).unwrap()
        else {
            panic!("no cgroups planned");
        };
        assert_eq!(version, 1);
        assert_eq!(groups.len(), 2, "{groups:?}");
        assert_eq!(
            groups[0].dir,
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/firecracker/vm1")
        );
        assert_eq!(groups[0].values.len(), 2);
        assert_eq!(
            groups[1].dir,
            PathBuf::from("/sys/fs/cgroup/memory/firecracker/vm1")
        );
        parsed.cgroups.push(("blkio.weight".into(), "10".into()));
        let missing = plan_cgroups(&parsed, Path::new("p"), mounts).unwrap_err();
        assert!(missing.to_string().contains("blkio"), "{missing}");
        parsed.cgroups.clear();
        parsed.cgroup_version = 2;
        assert!(matches!(
            plan_cgroups(&parsed, Path::new("p"), mounts).unwrap(),
            Some(CgroupPlan::MoveInto(dir)) if dir == Path::new("/sys/fs/cgroup/unified/p")
        ));
    }
}
