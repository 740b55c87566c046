//! Extra output files for log lines and metrics (Firecracker's `PUT /logger` and
//! `PUT /metrics`, `--log-path`, `--metrics-path`): a regular file or a FIFO, as Kata
//! passes them. Opened non-blocking (a FIFO with O_RDWR, so the open succeeds before a
//! reader comes); a write that would block is dropped and counted, so a FIFO nobody
//! reads never stalls gpuvm. Logs keep going to stderr too.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::action::{ActionError, ActionResult, LoggerConfig, MetricsConfig, VmmData};
use crate::metrics::METRICS;

/// One output file and what it lost.
pub struct Sink {
    file: Mutex<Option<File>>,
    /// Lines dropped because the file would have blocked (a full FIFO) or failed.
    pub dropped_lines: AtomicU64,
    pub written_lines: AtomicU64,
}

impl Sink {
    const fn new() -> Sink {
        Sink {
            file: Mutex::new(None),
            dropped_lines: AtomicU64::new(0),
            written_lines: AtomicU64::new(0),
        }
    }

    pub fn set(&self, file: File) {
        *crate::lock(&self.file) = Some(file);
    }

    pub fn is_set(&self) -> bool {
        crate::lock(&self.file).is_some()
    }

    /// Writes `line` (one whole line) or drops it; never blocks.
    pub fn write_line(&self, line: &[u8]) {
        let mut file = crate::lock(&self.file);
        let Some(file) = file.as_mut() else { return };
        match file.write(line) {
            Ok(n) if n == line.len() => {
                self.written_lines.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                self.dropped_lines.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Where log lines go besides stderr.
pub static LOG: Sink = Sink::new();
/// Where FlushMetrics writes the metrics, one JSON object per line.
pub static METRICS_OUT: Sink = Sink::new();

/// Opens `path` for appending without blocking: a FIFO read-write (so the open does not
/// wait for, or fail without, a reader), anything else write-only, created if missing.
pub fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    let fifo = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo());
    let mut options = std::fs::OpenOptions::new();
    options.custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC);
    if fifo {
        options.read(true).write(true);
    } else {
        options.append(true).create(true);
    }
    options.open(path)
}

fn open_error(path: &Path, error: std::io::Error) -> ActionError {
    ActionError::bad_request(format!("cannot open {}: {error}", path.display()))
}

/// Carries out PUT /logger.
pub fn put_logger(config: LoggerConfig) -> ActionResult {
    let file = open_nonblocking(&config.path).map_err(|e| open_error(&config.path, e))?;
    LOG.set(file);
    if let Some(level) = config.level {
        log::set_max_level(level);
    }
    Ok(VmmData::Empty)
}

/// How often the counters go to the metrics output on their own (Firecracker's period),
/// unless [`METRICS_PERIOD_VAR`] says otherwise.
pub const METRICS_PERIOD: Duration = Duration::from_secs(60);
/// `GPUVM_METRICS_PERIOD_MS=<ms>`: the period (tests shorten it).
pub const METRICS_PERIOD_VAR: &str = "GPUVM_METRICS_PERIOD_MS";

/// Carries out PUT /metrics: the output, and from then on a line every period
/// ([`start_periodic_metrics`]; FlushMetrics adds lines in between).
pub fn put_metrics(config: MetricsConfig) -> ActionResult {
    let file = open_nonblocking(&config.path).map_err(|e| open_error(&config.path, e))?;
    METRICS_OUT.set(file);
    start_periodic_metrics();
    Ok(VmmData::Empty)
}

/// Starts, once per process, the `metrics-flush` thread that writes a metrics line every
/// period while an output is set. Call it after `seccomp::enable`: the thread installs
/// the VMM filter itself.
pub fn start_periodic_metrics() {
    static PERIODIC: std::sync::Once = std::sync::Once::new();
    PERIODIC.call_once(|| {
        let period = std::env::var(METRICS_PERIOD_VAR)
            .ok()
            .and_then(|ms| ms.parse().ok())
            .filter(|ms| *ms > 0)
            .map_or(METRICS_PERIOD, Duration::from_millis);
        let spawned = std::thread::Builder::new()
            .name("metrics-flush".into())
            .spawn(move || {
                // Started before or after the filters exist: it installs its own.
                if let Err(error) = crate::seccomp::apply(crate::seccomp::ThreadKind::Vmm) {
                    log::error!("metrics-flush: {error}; no periodic metrics");
                    return;
                }
                loop {
                    std::thread::sleep(period);
                    if METRICS_OUT.is_set() {
                        let _ = flush_metrics();
                    }
                }
            });
        if let Err(error) = spawned {
            log::warn!("no periodic metrics ({error}); FlushMetrics still writes them");
        }
    });
}

/// Carries out FlushMetrics: one JSON line of the counters to the metrics output.
pub fn flush_metrics() -> ActionResult {
    if !METRICS_OUT.is_set() {
        return Err(ActionError::bad_request(
            "FlushMetrics needs a metrics output (PUT /metrics or --metrics-path first)",
        ));
    }
    let mut json = METRICS.to_json();
    json["log_lines_dropped"] = LOG.dropped_lines.load(Ordering::Relaxed).into();
    json["metrics_lines_dropped"] = METRICS_OUT.dropped_lines.load(Ordering::Relaxed).into();
    let mut line = json.to_string().into_bytes();
    line.push(b'\n');
    METRICS_OUT.write_line(&line);
    Ok(VmmData::Empty)
}

/// A writer for env_logger: each record to stderr and to [`LOG`].
pub struct TeeToLog;

impl Write for TeeToLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.write_line(buf);
        std::io::stderr().write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn an_unread_fifo_drops_lines_instead_of_blocking() {
        let dir = tempfile_dir();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let sink = Sink::new();
        sink.set(open_nonblocking(&fifo).unwrap());
        let line = vec![b'x'; 4095];
        for _ in 0..64 {
            sink.write_line(&line);
        }
        assert!(sink.dropped_lines.load(Ordering::Relaxed) > 0);
        assert!(sink.written_lines.load(Ordering::Relaxed) > 0);
        let file = dir.join("file");
        let sink = Sink::new();
        sink.set(open_nonblocking(&file).unwrap());
        sink.write_line(b"one\n");
        assert_eq!(std::fs::read(&file).unwrap(), b"one\n");
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuvm-outputs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
