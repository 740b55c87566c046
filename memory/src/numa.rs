//! Placing guest RAM on host NUMA nodes: `mbind` over the mappings of a range of the RAM
//! file, before any page of it is touched, prefaulted or pinned for DMA.
//!
//! Guest RAM is shmem (a memfd or a file on the private huge tmpfs). A memory policy set
//! with `mbind` on a shared shmem mapping is the file's own ("shared policy", kept per
//! file range in the inode), so it governs every page of that range whoever faults it in:
//! KVM, a vfio-user device process mapping the same fd, a VFIO pin. Each guest node's RAM
//! is one contiguous range of the file; binding that range is what a memfd per node
//! would give, while the snapshot, restore and DMA paths keep their one RAM file.

use std::io;

use crate::{ByteSize, GuestRam};

/// `mbind` modes (linux/mempolicy.h).
const MPOL_PREFERRED: libc::c_int = 1;
const MPOL_BIND: libc::c_int = 2;
/// Most host nodes a node mask here can name (the kernel's MAX_NUMNODES is at most 1024).
const MAX_NODES: usize = 1024;

/// How strictly a range is held to its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePolicy {
    /// Only that node's memory (allocation fails rather than spill elsewhere).
    Bind,
    /// That node first, others when it is full.
    Preferred,
}

impl NodePolicy {
    fn mode(self) -> libc::c_int {
        match self {
            NodePolicy::Bind => MPOL_BIND,
            NodePolicy::Preferred => MPOL_PREFERRED,
        }
    }

    /// The word /proc/PID/numa_maps shows for it.
    pub fn numa_maps_word(self) -> &'static str {
        match self {
            NodePolicy::Bind => "bind",
            NodePolicy::Preferred => "prefer",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NumaBindError {
    #[error("host NUMA node {node} is beyond the {MAX_NODES} nodes gpuvm can name")]
    NodeOutOfRange { node: u32 },
    #[error(
        "guest RAM range at file offset {offset:#x} ({}) is not inside guest RAM of {}",
        ByteSize(*size),
        ByteSize(*ram)
    )]
    OutsideRam { offset: u64, size: u64, ram: u64 },
    #[error(
        "cannot bind guest RAM {host_addr:#x}..{:#x} to host NUMA node {node} \
         (mbind {policy:?}): {source}",
        *host_addr as u64 + *len
    )]
    Mbind {
        host_addr: usize,
        len: u64,
        node: u32,
        policy: NodePolicy,
        source: io::Error,
    },
}

/// Binds the RAM file's bytes `[offset, offset + size)` to host node `node`: every mapping
/// of `ram` that covers part of the range gets the policy for that part. Call it before
/// anything touches those pages (pages already there stay where they are).
pub fn bind_file_range(
    ram: &GuestRam,
    offset: u64,
    size: u64,
    node: u32,
    policy: NodePolicy,
) -> Result<(), NumaBindError> {
    if node as usize >= MAX_NODES {
        return Err(NumaBindError::NodeOutOfRange { node });
    }
    let end = offset
        .checked_add(size)
        .filter(|end| *end <= ram.size())
        .ok_or(NumaBindError::OutsideRam {
            offset,
            size,
            ram: ram.size(),
        })?;
    let mut mask = [0u64; MAX_NODES / 64];
    mask[node as usize / 64] |= 1 << (node % 64);
    for (region, host) in ram.host_regions() {
        let start = offset.max(region.file_offset);
        let stop = end.min(region.file_offset + region.size);
        if start >= stop {
            continue;
        }
        let host_addr = host as usize + (start - region.file_offset) as usize;
        let len = stop - start;
        // SAFETY: the range lies inside one live mapping owned by `ram`; mbind only
        // changes the memory policy of that range, and the mask outlives the call (the
        // kernel reads `maxnode` bits of it).
        let result = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                host_addr,
                len as usize,
                policy.mode(),
                mask.as_ptr(),
                MAX_NODES as libc::c_ulong,
                0 as libc::c_uint,
            )
        };
        if result != 0 {
            return Err(NumaBindError::Mbind {
                host_addr,
                len,
                node,
                policy,
                source: io::Error::last_os_error(),
            });
        }
        log::debug!(
            "guest RAM file {start:#x}..{stop:#x} (host {host_addr:#x}, {}) bound to host node {node} ({policy:?})",
            ByteSize(len)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GuestRamConfig, RamRegion};

    const MIB: u64 = 1 << 20;

    fn two_region_ram() -> GuestRam {
        let regions = [
            RamRegion {
                guest_addr: 0,
                size: 8 * MIB,
                file_offset: 0,
            },
            RamRegion {
                guest_addr: 64 * MIB,
                size: 8 * MIB,
                file_offset: 8 * MIB,
            },
        ];
        let mut config = GuestRamConfig::new(16 * MIB);
        config.thp = false;
        GuestRam::create(&config, &regions).unwrap()
    }

    /// The policy lines of this process's numa_maps for mappings starting in `ram`.
    fn policies(ram: &GuestRam) -> Vec<(usize, String)> {
        let maps = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
        let ranges: Vec<(usize, usize)> = ram
            .host_regions()
            .map(|(r, h)| (h as usize, h as usize + r.size as usize))
            .collect();
        maps.lines()
            .filter_map(|line| {
                let mut words = line.split_whitespace();
                let addr = usize::from_str_radix(words.next()?, 16).ok()?;
                let policy = words.next()?.to_string();
                ranges
                    .iter()
                    .any(|(s, e)| (*s..*e).contains(&addr))
                    .then_some((addr, policy))
            })
            .collect()
    }

    #[test]
    fn a_range_across_two_mappings_is_bound_in_both() {
        let ram = two_region_ram();
        // The second half of region 0 and the first half of region 1.
        bind_file_range(&ram, 4 * MIB, 8 * MIB, 0, NodePolicy::Bind).unwrap();
        let hosts: Vec<usize> = ram.host_regions().map(|(_, h)| h as usize).collect();
        let found = policies(&ram);
        let policy_at = |addr: usize| {
            found
                .iter()
                .find(|(a, _)| *a == addr)
                .map(|(_, p)| p.clone())
        };
        assert_eq!(policy_at(hosts[0]).as_deref(), Some("default"), "{found:?}");
        assert_eq!(
            policy_at(hosts[0] + 4 * MIB as usize).as_deref(),
            Some("bind:0"),
            "{found:?}"
        );
        assert_eq!(policy_at(hosts[1]).as_deref(), Some("bind:0"), "{found:?}");
        assert_eq!(
            policy_at(hosts[1] + 4 * MIB as usize).as_deref(),
            Some("default"),
            "{found:?}"
        );
    }

    #[test]
    fn preferred_shows_as_prefer() {
        let ram = two_region_ram();
        bind_file_range(&ram, 0, 16 * MIB, 0, NodePolicy::Preferred).unwrap();
        let found = policies(&ram);
        assert!(!found.is_empty());
        assert!(found.iter().all(|(_, p)| p == "prefer:0"), "{found:?}");
    }

    #[test]
    fn absent_nodes_and_ranges_outside_ram_are_errors() {
        let ram = two_region_ram();
        let error = bind_file_range(&ram, 0, MIB, 1000, NodePolicy::Bind).unwrap_err();
        assert!(
            matches!(error, NumaBindError::Mbind { node: 1000, .. }),
            "{error}"
        );
        assert!(error.to_string().contains("host NUMA node 1000"), "{error}");
        assert!(matches!(
            bind_file_range(&ram, 0, MIB, 5000, NodePolicy::Bind),
            Err(NumaBindError::NodeOutOfRange { node: 5000 })
        ));
        assert!(matches!(
            bind_file_range(&ram, 12 * MIB, 8 * MIB, 0, NodePolicy::Bind),
            Err(NumaBindError::OutsideRam { .. })
        ));
    }
}
