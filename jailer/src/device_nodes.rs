//! The character devices a jail holds: the ones the VMM needs to start (KVM, TUN), made
//! with Linux's fixed numbers even where the host lacks them, and those the host has for
//! entropy, lazy restore and PCI passthrough, made with the host's numbers. The jail's
//! root cannot reach the host's /dev, so each is a node of its own, owned by the
//! unprivileged user.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::chroot::{chown, own_dir};
use crate::{c_path, JailerError};

/// Device nodes every jail gets, with the numbers Linux fixes for them (the jailer creates
/// them even when the host lacks the node: they must exist for the VMM to start).
const REQUIRED_NODES: [(&str, u32, u32); 2] = [("/dev/kvm", 10, 232), ("/dev/net/tun", 10, 200)];
/// Device nodes a jail gets where the host has them: entropy, lazy restore
/// (userfaultfd), PCI passthrough (every node under /dev/vfio).
const OPTIONAL_NODES: [&str; 2] = ["/dev/urandom", "/dev/userfaultfd"];
const VFIO_DIR: &str = "/dev/vfio";

/// A character device to create in the jail.
#[derive(Debug, Clone)]
pub(crate) struct DeviceNode {
    path: PathBuf,
    rdev: libc::dev_t,
    required: bool,
}

/// The device nodes to create: the required ones, and the optional ones the host has, with
/// the host's device numbers. Read before the chroot, while the host's /dev is visible.
pub(crate) fn host_nodes() -> Vec<DeviceNode> {
    let mut nodes: Vec<DeviceNode> = REQUIRED_NODES
        .iter()
        .map(|(path, major, minor)| DeviceNode {
            path: path.into(),
            rdev: libc::makedev(*major, *minor),
            required: true,
        })
        .collect();
    let mut optional: Vec<PathBuf> = OPTIONAL_NODES.iter().map(PathBuf::from).collect();
    if let Ok(entries) = fs::read_dir(VFIO_DIR) {
        let mut vfio: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        vfio.sort();
        optional.extend(vfio);
    }
    for path in optional {
        if let Ok(meta) = fs::metadata(&path) {
            if meta.file_type().is_char_device() {
                nodes.push(DeviceNode {
                    path,
                    rdev: meta.rdev(),
                    required: false,
                });
            }
        }
    }
    nodes
}

/// Creates `nodes` inside the jail (after the chroot), owned by `uid:gid`; a required node
/// that cannot be made fails the jail, an optional one only warns.
pub(crate) fn create(nodes: &[DeviceNode], uid: u32, gid: u32) -> Result<(), JailerError> {
    if nodes.iter().any(|n| n.path.starts_with(VFIO_DIR)) {
        own_dir(Path::new(VFIO_DIR), uid, gid)?;
    }
    for node in nodes {
        match make_node(node, uid, gid) {
            Ok(()) => {}
            Err(error) if node.required => return Err(error),
            Err(error) => eprintln!("gpuvm: jailer: warning: {error}"),
        }
    }
    Ok(())
}

fn make_node(node: &DeviceNode, uid: u32, gid: u32) -> Result<(), JailerError> {
    let path = c_path(&node.path)?;
    // SAFETY: mknod(2) reads a NUL-terminated path that outlives the call.
    let made = unsafe {
        libc::mknod(
            path.as_ptr(),
            libc::S_IFCHR | libc::S_IRUSR | libc::S_IWUSR,
            node.rdev,
        )
    };
    if made != 0 {
        return Err(JailerError::Io {
            what: "create device node",
            path: node.path.clone(),
            error: io::Error::last_os_error(),
        });
    }
    chown(&node.path, uid, gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_and_tun_are_always_planned_with_linux_numbers() {
        let nodes = host_nodes();
        let required: Vec<(PathBuf, libc::dev_t)> = nodes
            .iter()
            .filter(|n| n.required)
            .map(|n| (n.path.clone(), n.rdev))
            .collect();
        assert_eq!(
            required,
            vec![
                (PathBuf::from("/dev/kvm"), libc::makedev(10, 232)),
                (PathBuf::from("/dev/net/tun"), libc::makedev(10, 200)),
            ]
        );
        // Optional nodes are only those the host has, as character devices.
        for node in nodes.iter().filter(|n| !n.required) {
            let meta = fs::metadata(&node.path).unwrap();
            assert!(meta.file_type().is_char_device(), "{node:?}");
            assert_eq!(meta.rdev(), node.rdev);
        }
    }
}
