//! `gpuvm run --numa auto` or `--numa node=N,cpus=LIST,mem_mib=MIB[,host_node=H]` (repeated,
//! one per guest node) and `--numa-pin-vcpus`: the guest's NUMA nodes
//! (gpuvm_vmm::numa plans, checks and places them).

use clap::Args;
use gpuvm_vmm::numa::{NumaMode, NumaNodeSpec, NumaOptions};

/// Guest NUMA nodes (see docs/gpu-hosts.md, "NUMA").
#[derive(Args, Debug, Default)]
pub struct NumaArgs {
    /// Guest NUMA nodes: `auto` (one per host node that has a GPU of this VM, vCPUs and
    /// RAM split evenly), or one `node=N,cpus=LIST,mem_mib=MIB[,host_node=H]` per node
    /// (repeated); LIST is `A-B`, `A` or `[A-B,C]`. Every vCPU on one node, the nodes'
    /// memory adding up to --memory; each node's RAM bound to its host node.
    #[arg(long, value_name = "auto|node=N,cpus=LIST,mem_mib=MIB[,host_node=H]")]
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
            other => {
                return Err(bad(format!(
                    "unknown key '{other}' (node, cpus, mem_mib, host_node)"
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
    })
}

/// `0-3`, `5` or `[0-1,4]`: vCPU ids.
fn parse_vcpus(text: &str) -> Result<Vec<u8>, String> {
    let inner = text.trim();
    let inner = inner
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .unwrap_or(inner);
    let cpus = gpuvm_vmm::numa::parse_cpu_list(inner)
        .filter(|cpus| !cpus.is_empty())
        .ok_or_else(|| format!("cpus '{text}' is not a vCPU list (e.g. 0-3, 5 or [0-1,4])"))?;
    cpus.into_iter()
        .map(|cpu| u8::try_from(cpu).map_err(|_| format!("vCPU {cpu} is beyond 255")))
        .collect()
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
                },
                NumaNodeSpec {
                    node: 1,
                    cpus: vec![2, 3, 5, 6],
                    mem_size: 1 << 30,
                    host_node: None,
                },
            ])
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
