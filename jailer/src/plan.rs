//! Everything the jail needs, checked and resolved before anything is changed: the exec
//! file, the chroot base and the jail's path (not already taken), the netns, the cgroups'
//! hierarchies, the limits and the device nodes. A jail that cannot be built fails here,
//! leaving nothing behind.

use std::ffi::OsString;
use std::fs::{self, File};
use std::path::PathBuf;

use crate::args::JailerArgs;
use crate::cgroups::{self, CgroupPlan, PROC_MOUNTS};
use crate::device_nodes::{self, DeviceNode};
use crate::rlimits::Limits;
use crate::JailerError;

#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) args: JailerArgs,
    pub(crate) exec_source: PathBuf,
    pub(crate) exec_name: OsString,
    /// `<chroot-base>/<exec-name>/<id>`: what a failure before the chroot removes.
    pub(crate) instance_dir: PathBuf,
    pub(crate) chroot_dir: PathBuf,
    pub(crate) cgroups: Option<CgroupPlan>,
    pub(crate) nodes: Vec<DeviceNode>,
    pub(crate) limits: Limits,
}

pub(crate) fn plan(args: JailerArgs) -> Result<Plan, JailerError> {
    let exec_source = fs::canonicalize(&args.exec_file)
        .map_err(|e| JailerError::ExecFile(args.exec_file.clone(), e.to_string()))?;
    if !exec_source.is_file() {
        return Err(JailerError::ExecFile(
            args.exec_file.clone(),
            "not a regular file".into(),
        ));
    }
    // The name the jail is filed under is the one given (a `firecracker` symlink to
    // gpuvm gives `firecracker`, which is how gpuvm then knows to act as Firecracker).
    let exec_name = args
        .exec_file
        .file_name()
        .ok_or_else(|| JailerError::ExecFile(args.exec_file.clone(), "no file name".into()))?
        .to_owned();
    let base = fs::canonicalize(&args.chroot_base)
        .map_err(|e| JailerError::ChrootBase(args.chroot_base.clone(), e.to_string()))?;
    if !base.is_dir() {
        return Err(JailerError::ChrootBase(base, "not a directory".into()));
    }
    let instance_dir = base.join(&exec_name).join(&args.id);
    let chroot_dir = instance_dir.join("root");
    if fs::read_dir(&chroot_dir).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(JailerError::JailExists(chroot_dir));
    }
    if let Some(netns) = &args.netns {
        File::open(netns).map_err(|e| JailerError::Netns(netns.clone(), e))?;
    }
    let parent = args
        .parent_cgroup
        .clone()
        .unwrap_or_else(|| PathBuf::from(&exec_name));
    let cgroups = cgroups::plan_cgroups(
        &args,
        &parent,
        &fs::read_to_string(PROC_MOUNTS).unwrap_or_default(),
    )?;
    Ok(Plan {
        exec_source,
        exec_name,
        instance_dir,
        chroot_dir,
        cgroups,
        nodes: device_nodes::host_nodes(),
        limits: Limits::new(&args.resource_limits),
        args,
    })
}
