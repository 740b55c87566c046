//! Process-wide counters, read by `GET /metrics`. Plain atomics: cheap to bump from any
//! thread, no locks on hot paths.

use std::sync::atomic::{AtomicU64, Ordering};

/// Routes the API counts requests for, in the order [`Metrics::api_requests`] indexes them.
pub const API_ROUTES: &[&str] = &[
    "/",
    "/machine-config",
    "/boot-source",
    "/actions",
    "/vm",
    "/snapshot/create",
    "/snapshot/load",
    "/metrics",
    "/gpus/{id}",
    "other",
];

/// vCPU exit reasons counted, in the order [`Metrics::vcpu_exits`] indexes them.
pub const VCPU_EXITS: &[&str] = &[
    "io_in",
    "io_out",
    "mmio_read",
    "mmio_write",
    "hlt",
    "shutdown",
    "system_event",
    "internal_error",
    "fail_entry",
    "intr",
    "kicked",
    "other",
    "error",
];

/// Status classes counted per route: 2xx, 4xx, 5xx.
const STATUS_CLASSES: [&str; 3] = ["2xx", "4xx", "5xx"];

pub struct Metrics {
    /// Bytes the guest wrote to its serial console.
    pub serial_bytes_out: AtomicU64,
    pub snapshots_created: AtomicU64,
    pub snapshot_bytes_written: AtomicU64,
    pub snapshots_loaded: AtomicU64,
    api_requests: [[AtomicU64; 3]; API_ROUTES.len()],
    vcpu_exits: [AtomicU64; VCPU_EXITS.len()],
}

#[allow(clippy::declare_interior_mutable_const)] // only used to initialise the static
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO_ROW: [AtomicU64; 3] = [ZERO, ZERO, ZERO];

/// The one set of counters of this process.
pub static METRICS: Metrics = Metrics {
    serial_bytes_out: ZERO,
    snapshots_created: ZERO,
    snapshot_bytes_written: ZERO,
    snapshots_loaded: ZERO,
    api_requests: [ZERO_ROW; API_ROUTES.len()],
    vcpu_exits: [ZERO; VCPU_EXITS.len()],
};

impl Metrics {
    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    /// Counts one API request to `path` answered with `status`.
    pub fn count_api_request(&self, path: &str, status: u16) {
        let path = if path.starts_with("/gpus/") {
            "/gpus/{id}"
        } else {
            path
        };
        let route = API_ROUTES
            .iter()
            .position(|r| *r == path)
            .unwrap_or(API_ROUTES.len() - 1);
        let class = match status {
            200..=399 => 0,
            400..=499 => 1,
            _ => 2,
        };
        self.api_requests[route][class].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one return from KVM_RUN by its reason (all vCPUs together).
    pub fn count_vcpu_exit(&self, exit: &Result<kvm_ioctls::VcpuExit<'_>, kvm_ioctls::Error>) {
        use kvm_ioctls::VcpuExit;
        let reason = match exit {
            Ok(VcpuExit::IoIn(..)) => "io_in",
            Ok(VcpuExit::IoOut(..)) => "io_out",
            Ok(VcpuExit::MmioRead(..)) => "mmio_read",
            Ok(VcpuExit::MmioWrite(..)) => "mmio_write",
            Ok(VcpuExit::Hlt) => "hlt",
            Ok(VcpuExit::Shutdown) => "shutdown",
            Ok(VcpuExit::SystemEvent(..)) => "system_event",
            Ok(VcpuExit::InternalError) => "internal_error",
            Ok(VcpuExit::FailEntry(..)) => "fail_entry",
            Ok(VcpuExit::Intr) => "intr",
            Ok(_) => "other",
            Err(error) if error.errno() == libc::EINTR || error.errno() == libc::EAGAIN => "kicked",
            Err(_) => "error",
        };
        if let Some(index) = VCPU_EXITS.iter().position(|r| *r == reason) {
            // SeqCst with the serial counter: an exit is counted before the device handles
            // it, so a reader that loads the serial count first never sees more serial
            // bytes than port writes (see `to_json`).
            self.vcpu_exits[index].fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The counters as JSON (without the per-machine figures the VMM adds).
    pub fn to_json(&self) -> serde_json::Value {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        // Serial bytes before vCPU exits, so the snapshot keeps bytes_out <= io_out.
        let serial_bytes_out = self.serial_bytes_out.load(Ordering::SeqCst);
        let mut api = serde_json::Map::new();
        for (route, counters) in API_ROUTES.iter().zip(&self.api_requests) {
            let mut by_class = serde_json::Map::new();
            for (class, counter) in STATUS_CLASSES.iter().zip(counters) {
                by_class.insert((*class).into(), load(counter).into());
            }
            api.insert((*route).into(), by_class.into());
        }
        let mut exits = serde_json::Map::new();
        for (reason, counter) in VCPU_EXITS.iter().zip(&self.vcpu_exits) {
            exits.insert((*reason).into(), counter.load(Ordering::SeqCst).into());
        }
        serde_json::json!({
            "vcpu_exits": exits,
            "serial": { "bytes_out": serial_bytes_out },
            "snapshot": {
                "created": load(&self.snapshots_created),
                "bytes_written": load(&self.snapshot_bytes_written),
                "loaded": load(&self.snapshots_loaded),
            },
            "api_requests": api,
        })
    }
}

/// A writer that counts the bytes going through it (the serial console's output).
pub struct CountingWriter<W> {
    inner: W,
    counter: &'static AtomicU64,
}

impl<W> CountingWriter<W> {
    pub fn new(inner: W, counter: &'static AtomicU64) -> Self {
        CountingWriter { inner, counter }
    }
}

impl<W: std::io::Write> std::io::Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf)?;
        self.counter.fetch_add(written as u64, Ordering::SeqCst);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn counts_requests_by_route_and_class() {
        let metrics = Metrics {
            serial_bytes_out: ZERO,
            snapshots_created: ZERO,
            snapshot_bytes_written: ZERO,
            snapshots_loaded: ZERO,
            api_requests: [ZERO_ROW; API_ROUTES.len()],
            vcpu_exits: [ZERO; VCPU_EXITS.len()],
        };
        metrics.count_api_request("/vm", 204);
        metrics.count_api_request("/vm", 409);
        metrics.count_api_request("/nope", 404);
        let json = metrics.to_json();
        assert_eq!(json["api_requests"]["/vm"]["2xx"], 1);
        assert_eq!(json["api_requests"]["/vm"]["4xx"], 1);
        assert_eq!(json["api_requests"]["other"]["4xx"], 1);
        assert_eq!(json["api_requests"]["/"]["2xx"], 0);
    }

    #[test]
    fn counting_writer_counts() {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut writer = CountingWriter::new(Vec::new(), &COUNTER);
        writer.write_all(b"hello").unwrap();
        assert_eq!(COUNTER.load(Ordering::Relaxed), 5);
    }
}
