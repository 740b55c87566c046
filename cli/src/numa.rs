//! `gpuvm run --numa auto` or `--numa node=N,cpus=LIST,mem_mib=MIB[,host_node=H]
//! [,pci_segments=LIST]` (repeated, one per guest node) and `--numa-pin-vcpus`: the guest's
//! NUMA nodes
//! (gpuvm_vmm::numa plans, checks and places them).

use clap::Args;
use gpuvm_vmm::numa::{NumaMode, NumaNodeSpec, NumaOptions};

/// Guest NUMA nodes (see docs/gpu-hosts.md, "NUMA").
#[derive(Args, Debug, Default)]
pub struct NumaArgs {
    /// Guest NUMA nodes: `auto` (one per host node that has a GPU of this VM, vCPUs and
    /// RAM split evenly), or one `node=N,cpus=LIST,mem_mib=MIB[,host_node=H]
    /// [,pci_segments=LIST]` per node (repeated); LIST is `A-B`, `A` or `[A-B,C]`. Every
    /// vCPU on one node, the nodes' memory adding up to --memory; each node's RAM bound to
    /// its host node; its PCI segments' host bridges (and their devices) on the node.
    #[arg(
        long,
        value_name = "auto|node=N,cpus=LIST,mem_mib=MIB[,host_node=H][,pci_segments=LIST]"
    )]
    pub numa: Vec<String>,
    /// Pin each vCPU thread to the host CPUs of its NUMA node's host node.
    #[arg(long, requires = "numa")]
    pub numa_pin_vcpus: bool,
}

impl NumaArgs {
    pub fn numa_options(&self) -> Result<NumaOptions, String> {
        Ok(NumaOptions {
            mode: parse_numa(&self.numa)?,
            pin_vcpus: self.numa_pin_vcpus,
            distances: None,
        })
    }
}

/// The `--numa` values: none, `auto` alone, or node descriptions.
pub fn parse_numa(values: &[String]) -> Result<NumaMode, String> {
    if values.is_empty() {
        return Ok(NumaMode::Off);
    }
    if values.iter().any(|v| v.trim() == "auto") {
        if values.len() > 1 {
            return Err("--numa auto cannot be combined with explicit nodes".into());
        }
        return Ok(NumaMode::Auto);
    }
    values
        .iter()
        .map(|value| parse_node(value))
        .collect::<Result<Vec<_>, _>>()
        .map(NumaMode::Nodes)
}

/// Splits `a=1,b=[2,3]` at the commas outside brackets.
fn split_options(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (index, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..index]);
                start = index + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn parse_node(value: &str) -> Result<NumaNodeSpec, String> {
    let bad = |why: String| format!("--numa {value}: {why}");
    let (mut node, mut cpus, mut mem_mib, mut host_node) = (None, None, None, None);
    let mut pci_segments: Option<Vec<u16>> = None;
    for option in split_options(value) {
        let (key, text) = option
            .split_once('=')
            .ok_or_else(|| bad(format!("'{option}' is not key=value")))?;
        let number = |what: &str| {
            text.trim()
                .parse::<u64>()
                .map_err(|_| bad(format!("{what} '{text}' is not a number")))
        };
        let duplicate = |set: bool| {
            if set {
                Err(bad(format!("{key} is given twice")))
            } else {
                Ok(())
            }
        };
        match key.trim() {
            "node" => {
                duplicate(node.is_some())?;
                node = Some(
                    u32::try_from(number("node")?).map_err(|_| bad("node is too large".into()))?,
                );
            }
            "cpus" => {
                duplicate(cpus.is_some())?;
                cpus = Some(parse_vcpus(text).map_err(bad)?);
            }
            "mem_mib" => {
                duplicate(mem_mib.is_some())?;
                mem_mib = Some(number("mem_mib")?);
            }
            "host_node" => {
                duplicate(host_node.is_some())?;
                host_node = Some(
                    u32::try_from(number("host_node")?)
                        .map_err(|_| bad("host_node is too large".into()))?,
                );
            }
            "pci_segments" => {
                duplicate(pci_segments.is_some())?;
                let ids = parse_ids("pci_segments", "PCI segment", text).map_err(bad)?;
                let ids = (ids.into_iter())
                    .map(|id| u16::try_from(id).map_err(|_| bad(format!("segment {id}"))))
                    .collect::<Result<_, _>>()?;
                pci_segments = Some(ids);
            }
            other => {
                return Err(bad(format!(
                    "unknown key '{other}' (node, cpus, mem_mib, host_node, pci_segments)"
                )))
            }
        }
    }
    let missing = |what: &str| bad(format!("{what}= is missing"));
    let mem_mib = mem_mib.ok_or_else(|| missing("mem_mib"))?;
    Ok(NumaNodeSpec {
        node: node.ok_or_else(|| missing("node"))?,
        cpus: cpus.ok_or_else(|| missing("cpus"))?,
        mem_size: mem_mib
            .checked_mul(1 << 20)
            .ok_or_else(|| bad("mem_mib is too large".into()))?,
        host_node,
        pci_segments: pci_segments.unwrap_or_default(),
    })
}

/// `0-3`, `5` or `[0-1,4]`: vCPU ids.
fn parse_vcpus(text: &str) -> Result<Vec<u8>, String> {
    parse_ids("cpus", "vCPU", text)?
        .into_iter()
        .map(|cpu| u8::try_from(cpu).map_err(|_| format!("vCPU {cpu} is beyond 255")))
        .collect()
}

/// `0-3`, `5` or `[0-1,4]`: the ids `key` lists (`what`s, for the refusal).
fn parse_ids(key: &str, what: &str, text: &str) -> Result<Vec<usize>, String> {
    let inner = text.trim();
    let inner = inner
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(inner);
    gpuvm_vmm::numa::parse_cpu_list(inner)
        .filter(|ids| !ids.is_empty())
        .ok_or_else(|| format!("{key} '{text}' is not a {what} list (e.g. 0-3, 5 or [0-1,4])"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn auto_explicit_nodes_and_none() {
        assert_eq!(parse_numa(&[]).unwrap(), NumaMode::Off);
        assert_eq!(parse_numa(&values(&["auto"])).unwrap(), NumaMode::Auto);
        let mode = parse_numa(&values(&[
            "node=0,cpus=0-1,mem_mib=512,host_node=0",
            "node=1,cpus=[2,3,5-6],mem_mib=1024",
        ]))
        .unwrap();
        assert_eq!(
            mode,
            NumaMode::Nodes(vec![
                NumaNodeSpec {
                    node: 0,
                    cpus: vec![0, 1],
                    mem_size: 512 << 20,
                    host_node: Some(0),
                    pci_segments: Vec::new(),
                },
                NumaNodeSpec {
                    node: 1,
                    cpus: vec![2, 3, 5, 6],
                    mem_size: 1 << 30,
                    host_node: None,
                    pci_segments: Vec::new(),
                },
            ])
        );
    }

    #[test]
    fn a_node_takes_its_pci_segments() {
        let NumaMode::Nodes(nodes) = parse_numa(&values(&[
            "node=0,cpus=0,mem_mib=512,pci_segments=0",
            "node=1,cpus=1,mem_mib=512,pci_segments=[1-2,4]",
        ]))
        .unwrap() else {
            panic!("nodes expected");
        };
        assert_eq!(nodes[0].pci_segments, [0]);
        assert_eq!(nodes[1].pci_segments, [1, 2, 4]);
        let error = parse_numa(&values(&["node=0,cpus=0,mem_mib=512,pci_segments=x"])).unwrap_err();
        assert!(
            error.contains("pci_segments 'x' is not a PCI segment list"),
            "{error}"
        );
    }

    #[test]
    fn bad_values_say_what_is_wrong() {
        let cases = [
            (
                vec!["auto", "node=0,cpus=0,mem_mib=1"],
                "cannot be combined",
            ),
            (vec!["node=0,cpus=0"], "mem_mib= is missing"),
            (vec!["cpus=0,mem_mib=64"], "node= is missing"),
            (vec!["node=0,mem_mib=64"], "cpus= is missing"),
            (
                vec!["node=0,cpus=0,mem_mib=64,colour=red"],
                "unknown key 'colour'",
            ),
            (
                vec!["node=0,cpus=0,mem_mib=lots"],
                "mem_mib 'lots' is not a number",
            ),
            (vec!["node=0,cpus=3-1,mem_mib=64"], "not a vCPU list"),
            (vec!["node=0,cpus=256,mem_mib=64"], "beyond 255"),
            (
                vec!["node=0,node=1,cpus=0,mem_mib=64"],
                "node is given twice",
            ),
            (vec!["node=0,cpus"], "'cpus' is not key=value"),
            (vec!["node=0,cpus=0,mem_mib=99999999999999999"], "too large"),
        ];
        for (given, expected) in cases {
            let error = parse_numa(&values(&given)).unwrap_err();
            assert!(error.contains(expected), "{given:?}: {error}");
        }
    }
}
