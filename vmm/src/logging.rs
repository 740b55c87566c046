//! Log output for the `gpuvm` binary (on top of `env_logger`): human-readable text, or
//! one JSON object per line for log collectors.
//!
//! The level comes from `--log-level` if given, else from `GPUVM_LOG` (which also takes
//! per-module directives such as `gpuvm_memory=debug`), else `warn`. Logs go to stderr,
//! coloured when it is a terminal at start.
//!
//! JSON lines carry `ts` (RFC 3339, UTC, microseconds), `level`, `target` (the module),
//! `thread` (its name, when it has one) and `message`:
//!
//! ```text
//! {"level":"INFO","message":"guest ended: ExitStatus(0)","target":"gpuvm","thread":"main","ts":"2026-01-01T10:00:00.000000Z"}
//! ```

use std::io::Write;

/// How log records are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// `[ts LEVEL target] message`, env_logger's format.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("unknown log format '{text}' (text or json)")),
        }
    }
}

/// The environment variable with the default level and per-module directives.
pub const LOG_ENV: &str = "GPUVM_LOG";

/// Installs the process's logger. `level` overrides `GPUVM_LOG` for every module.
pub fn init(format: LogFormat, level: Option<log::LevelFilter>) -> Result<(), log::SetLoggerError> {
    init_with(format, level, false)
}

/// As [`init`]; with `tee`, each record also goes to [`crate::outputs::LOG`] (Firecracker's
/// PUT /logger and `--log-path`).
pub fn init_with(
    format: LogFormat,
    level: Option<log::LevelFilter>,
    tee: bool,
) -> Result<(), log::SetLoggerError> {
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().filter_or(LOG_ENV, "warn"));
    if let Some(level) = level {
        builder.filter_level(level);
    }
    match format {
        LogFormat::Text => {
            builder.format_timestamp_micros();
        }
        LogFormat::Json => {
            builder.format(|buf, record| {
                let line = json_line(
                    &buf.timestamp_micros().to_string(),
                    record.level(),
                    record.target(),
                    std::thread::current().name(),
                    &record.args().to_string(),
                );
                writeln!(buf, "{line}")
            });
        }
    }
    if tee {
        builder.target(env_logger::Target::Pipe(Box::new(crate::outputs::TeeToLog)));
    } else {
        // Whether to colour is decided once, here, before any seccomp filter: env_logger's own
        // stderr target asks isatty(2) (an ioctl, TCGETS) on every record when stderr is a
        // terminal, which the vCPU and device threads' filters refuse. Through a pipe target it
        // only styles a buffer.
        builder.target(env_logger::Target::Pipe(Box::new(std::io::stderr())));
        builder.write_style(stderr_style());
        if let Ok(style) = std::env::var(STYLE_ENV) {
            builder.parse_write_style(&style);
        }
    }
    builder.try_init()
}

/// env_logger's variable for the colour choice (`always`, `never`; `auto` means never here).
const STYLE_ENV: &str = "RUST_LOG_STYLE";

/// Colours on a terminal unless NO_COLOR is set (<https://no-color.org>).
fn stderr_style() -> env_logger::WriteStyle {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none() {
        env_logger::WriteStyle::Always
    } else {
        env_logger::WriteStyle::Never
    }
}

/// One record as a JSON object.
pub fn json_line(
    ts: &str,
    level: log::Level,
    target: &str,
    thread: Option<&str>,
    message: &str,
) -> String {
    let mut object = serde_json::Map::new();
    object.insert("ts".into(), ts.into());
    object.insert("level".into(), level.as_str().into());
    object.insert("target".into(), target.into());
    if let Some(thread) = thread {
        object.insert("thread".into(), thread.into());
    }
    object.insert("message".into(), message.into());
    serde_json::Value::Object(object).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert!("xml".parse::<LogFormat>().is_err());
    }

    #[test]
    fn a_json_line_is_one_object_with_every_field() {
        let line = json_line(
            "2026-01-01T00:00:00.000000Z",
            log::Level::Warn,
            "gpuvm_vmm::vcpu",
            Some("vcpu0"),
            "a \"quoted\"\nmessage",
        );
        assert!(!line.contains('\n'));
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["level"], "WARN");
        assert_eq!(value["target"], "gpuvm_vmm::vcpu");
        assert_eq!(value["thread"], "vcpu0");
        assert_eq!(value["message"], "a \"quoted\"\nmessage");
        assert_eq!(value["ts"], "2026-01-01T00:00:00.000000Z");
    }
}
