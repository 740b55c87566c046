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

    /// A duplicate of the output's descriptor (the same open file), if it has one.
    fn duplicate(&self) -> std::io::Result<Option<File>> {
        crate::lock(&self.file)
            .as_ref()
            .map(File::try_clone)
            .transpose()
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

/// The outputs as a live update hands them to the new process: which of them come (their
/// descriptors follow, log first) and the log level in effect (PUT /logger may have set
/// it). The same open files go over, so a FIFO's reader, a file renamed or unlinked since
/// it was opened, or one outside the new process's jail all keep getting the lines.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandedOverOutputs {
    pub log: bool,
    pub metrics: bool,
    /// `log::LevelFilter`'s name ("Off", "Error", ... "Trace").
    pub log_level: String,
}

impl HandedOverOutputs {
    /// How many descriptors follow it.
    pub fn descriptor_count(&self) -> usize {
        usize::from(self.log) + usize::from(self.metrics)
    }
}

/// This process's outputs for a live update, with duplicates of their descriptors (log
/// first); None without any.
pub fn hand_over() -> std::io::Result<Option<(HandedOverOutputs, Vec<File>)>> {
    let log = LOG.duplicate()?;
    let metrics = METRICS_OUT.duplicate()?;
    if log.is_none() && metrics.is_none() {
        return Ok(None);
    }
    let outputs = HandedOverOutputs {
        log: log.is_some(),
        metrics: metrics.is_some(),
        log_level: log::max_level().to_string(),
    };
    Ok(Some((outputs, log.into_iter().chain(metrics).collect())))
}

/// Takes over the old process's outputs (`log` and `metrics`, as `outputs` says) and its
/// log level; the periodic metrics go on from here. Each must be a file this process can
/// write lines to: a regular file, a FIFO or a character device (what `open_nonblocking`
/// opens), else it is refused by name.
pub fn adopt(
    outputs: &HandedOverOutputs,
    log: Option<File>,
    metrics: Option<File>,
) -> Result<(), String> {
    let level: log::LevelFilter = outputs
        .log_level
        .parse()
        .map_err(|_| format!("the log level {:?} is none gpuvm knows", outputs.log_level))?;
    for (what, file) in [("log", &log), ("metrics", &metrics)] {
        if let Some(file) = file {
            check_output(file).map_err(|reason| format!("the {what} output: {reason}"))?;
        }
    }
    if let Some(file) = log {
        LOG.set(file);
    }
    log::set_max_level(level);
    if let Some(file) = metrics {
        METRICS_OUT.set(file);
        start_periodic_metrics();
    }
    Ok(())
}

/// Whether `file` is what an output may be: open for writing, and a regular file, a FIFO
/// or a character device.
fn check_output(file: &File) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let kind = file
        .metadata()
        .map_err(|e| format!("cannot inspect it: {e}"))?
        .file_type();
    if !(kind.is_file() || kind.is_fifo() || kind.is_char_device()) {
        return Err(format!("{kind:?} is not a file, FIFO or character device"));
    }
    // SAFETY: F_GETFL on a descriptor this File owns reads its status flags.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 || flags & libc::O_ACCMODE == libc::O_RDONLY {
        return Err("it is not open for writing".into());
    }
    Ok(())
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

    /// What goes over in a live update: the same open files, and the level; the new side
    /// takes only outputs it can write to.
    #[test]
    fn outputs_are_handed_over_as_the_same_open_files() {
        let dir = tempfile_dir().join("handover");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("log");
        let file = open_nonblocking(&path).unwrap();
        let sink = Sink::new();
        sink.set(file);
        let copy = sink.duplicate().unwrap().expect("a descriptor");
        // Renamed since it was opened: the duplicate still writes where the sink does.
        std::fs::rename(&path, dir.join("moved")).unwrap();
        let other = Sink::new();
        other.set(copy);
        other.write_line(b"after\n");
        assert_eq!(std::fs::read(dir.join("moved")).unwrap(), b"after\n");
        assert!(Sink::new().duplicate().unwrap().is_none());

        let outputs = HandedOverOutputs {
            log: false,
            metrics: true,
            log_level: "Warn".into(),
        };
        assert_eq!(outputs.descriptor_count(), 1);
        let read_only = File::open(dir.join("moved")).unwrap();
        let error = adopt(&outputs, None, Some(read_only)).unwrap_err();
        assert!(
            error.contains("metrics output") && error.contains("writing"),
            "{error}"
        );
        let directory = File::open(&dir).unwrap();
        let error = adopt(&outputs, None, Some(directory)).unwrap_err();
        assert!(error.contains("not a file"), "{error}");
        let bad_level = HandedOverOutputs {
            log_level: "Loud".into(),
            ..outputs
        };
        let error = adopt(&bad_level, None, None).unwrap_err();
        assert!(error.contains("Loud"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuvm-outputs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
