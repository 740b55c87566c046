//! A minimal client for the API socket (one request per connection), used by
//! `gpuvm ctl`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Long enough for a snapshot of a large guest.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(600);
/// `GPUVM_CTL_TIMEOUT_S=<seconds>`: how long a request waits for its answer instead of
/// [`CLIENT_TIMEOUT`] (scripts that would rather fail than wait on a stuck VMM).
pub const CLIENT_TIMEOUT_VAR: &str = "GPUVM_CTL_TIMEOUT_S";

/// The answer timeout in effect.
fn client_timeout() -> Duration {
    std::env::var(CLIENT_TIMEOUT_VAR)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map_or(CLIENT_TIMEOUT, Duration::from_secs)
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the API socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("API socket I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the API answered something that is not HTTP")]
    BadResponse,
    #[error("the API closed the connection without answering (has gpuvm exited?)")]
    NoAnswer,
    #[error("gpuvm did not answer within {} s", .0.as_secs())]
    Timeout(Duration),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientResponse {
    pub status: u16,
    pub body: String,
}

impl ClientResponse {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The fault message of an error answer, else the whole body.
    pub fn message(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["fault_message"].as_str().map(String::from))
            .unwrap_or_else(|| self.body.clone())
    }
}

/// Sends one request and reads the answer.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<ClientResponse, ClientError> {
    let mut stream = loop {
        match UnixStream::connect(socket) {
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            connected => {
                break connected.map_err(|source| ClientError::Connect {
                    path: socket.to_path_buf(),
                    source,
                })?
            }
        }
    };
    let timeout = client_timeout();
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let body = body.unwrap_or("");
    let mut message =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if !body.is_empty() {
        message.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    message.push_str("\r\n");
    message.push_str(body);
    let timed_out = |error: std::io::Error| match error.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            ClientError::Timeout(timeout)
        }
        _ => ClientError::Io(error),
    };
    stream.write_all(message.as_bytes()).map_err(timed_out)?;
    let answer = read_answer(&mut stream).map_err(timed_out)?;
    if answer.is_empty() {
        return Err(ClientError::NoAnswer);
    }
    parse_response(&answer).ok_or(ClientError::BadResponse)
}

/// Reads one answer: up to the end of its body where the head says where that is
/// (Content-Length, or none for 1xx, 204 and 304), else to the end of the stream. A
/// server that keeps the connection open in spite of `Connection: close` (Cloud
/// Hypervisor's does) is not waited on.
fn read_answer(stream: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut answer = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        // A read on a socket with a timeout is not restarted after a signal, nor after the
        // process was stopped and continued (socket(7)): it fails with EINTR (seen in CI).
        let read = match stream.read(&mut chunk) {
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            read => read?,
        };
        if read == 0 {
            return Ok(answer);
        }
        answer.extend_from_slice(&chunk[..read]);
        if let Some(end) = answer_end(&answer) {
            if answer.len() >= end {
                answer.truncate(end);
                return Ok(answer);
            }
        }
    }
}

/// Where the answer in `answer` ends, once its head is complete and says.
fn answer_end(answer: &[u8]) -> Option<usize> {
    let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&answer[..head_end]).ok()?;
    let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
    if matches!(status, 100..=199 | 204 | 304) {
        return Some(head_end);
    }
    head.lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse::<usize>().ok())
        .map(|length| head_end.saturating_add(length))
}

fn parse_response(answer: &[u8]) -> Option<ClientResponse> {
    let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&answer[..head_end]).ok()?;
    let status_line = head.lines().next()?;
    let mut parts = status_line.split(' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let status: u16 = parts.next()?.parse().ok()?;
    let length = head
        .lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse::<usize>().ok())
        .unwrap_or(answer.len() - head_end - 4);
    let body = answer.get(head_end + 4..head_end + 4 + length)?;
    Some(ClientResponse {
        status,
        body: String::from_utf8_lossy(body).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_responses() {
        let response = parse_response(
            b"HTTP/1.1 400 Bad Request\r\nContent-Length: 22\r\n\r\n{\"fault_message\":\"x\"}\n",
        )
        .unwrap();
        assert_eq!(response.status, 400);
        assert_eq!(response.message(), "x");
        assert_eq!(
            parse_response(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap(),
            ClientResponse {
                status: 204,
                body: String::new()
            }
        );
        assert!(parse_response(b"garbage").is_none());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab").is_none());
    }

    /// A read interrupted (EINTR: a socket with a timeout after a stop and continue) is
    /// read again, not an error.
    #[test]
    fn an_interrupted_read_is_read_again() {
        struct Interrupting {
            interrupted: bool,
            answer: &'static [u8],
        }
        impl Read for Interrupting {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if !self.interrupted {
                    self.interrupted = true;
                    return Err(std::io::ErrorKind::Interrupted.into());
                }
                let n = self.answer.len().min(buf.len());
                buf[..n].copy_from_slice(&self.answer[..n]);
                self.answer = &self.answer[n..];
                Ok(n)
            }
        }
        let mut stream = Interrupting {
            interrupted: false,
            answer: b"HTTP/1.1 204 No Content\r\n\r\n",
        };
        let answer = read_answer(&mut stream).unwrap();
        assert_eq!(parse_response(&answer).unwrap().status, 204);
    }

    /// A server that answers and keeps the connection open (Cloud Hypervisor's ignores
    /// `Connection: close`): the answer is read by its length, not waited on to the end.
    #[test]
    fn an_answer_is_read_to_its_length_on_a_connection_kept_open() {
        let dir = std::env::temp_dir().join(format!("gpuvm-client-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("api.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            for answer in [
                &b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{\"build\": \"v\"}"[..],
                b"HTTP/1.1 204 No Content\r\n\r\n",
            ] {
                let (mut stream, _) = listener.accept().unwrap();
                let mut request = [0u8; 256];
                let _ = stream.read(&mut request);
                stream.write_all(answer).unwrap();
                // Held open until the client is done (or the test gives up).
                let _ = done_rx.recv_timeout(Duration::from_secs(10));
            }
        });
        let started = std::time::Instant::now();
        let answer = request(&socket, "GET", "/api/v1/vmm.ping", None).unwrap();
        assert_eq!(
            (answer.status, answer.body.as_str()),
            (200, "{\"build\": \"v\"}")
        );
        done_tx.send(()).unwrap();
        let answer = request(&socket, "PUT", "/api/v1/vm.boot", None).unwrap();
        assert_eq!(answer.status, 204);
        done_tx.send(()).unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        server.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_server_that_hangs_up_is_no_answer_not_bad_http() {
        let dir = std::env::temp_dir().join(format!("gpuvm-client-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("api.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            // Read the request, then close without a word, as a process killed mid-request does.
            let mut request = [0u8; 256];
            let _ = stream.read(&mut request);
        });
        let error = request(&socket, "GET", "/", None).unwrap_err();
        server.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(error, ClientError::NoAnswer), "{error}");
        assert!(error.to_string().contains("without answering"));
    }
}
