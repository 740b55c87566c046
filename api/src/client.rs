//! A minimal client for the API socket (one request per connection), used by
//! `gpuvm ctl`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Long enough for a snapshot of a large guest.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(600);

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
    let mut stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
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
    stream.write_all(message.as_bytes())?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    if answer.is_empty() {
        return Err(ClientError::NoAnswer);
    }
    parse_response(&answer).ok_or(ClientError::BadResponse)
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
