//! The memory report taken when the VM ends (`--report-memory`): peak RSS against the
//! guest pages the process holds.

use super::Machine;
use crate::Error;

/// Memory figures taken when the VM ends (for `--report-memory`).
#[derive(Clone, Copy, Debug)]
pub struct MemoryReport {
    pub peak_rss: u64,
    pub guest_resident: u64,
}

impl MemoryReport {
    /// What gpuvm itself costs on top of the guest pages it holds.
    pub fn overhead(&self) -> u64 {
        self.peak_rss.saturating_sub(self.guest_resident)
    }
}

impl Machine {
    /// Peak RSS of this process against the guest pages it holds.
    pub fn memory_report(&self) -> Result<MemoryReport, Error> {
        Ok(MemoryReport {
            peak_rss: peak_rss_bytes().map_err(Error::ProcStatus)?,
            guest_resident: self.ram.resident_bytes()?,
        })
    }
}

/// VmHWM from /proc/self/status.
fn peak_rss_bytes() -> std::io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .ok_or_else(|| std::io::Error::other("no VmHWM in /proc/self/status"))
}
