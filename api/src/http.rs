//! A small, strict HTTP/1.1 request parser and response writer for the API socket.
//!
//! Only what the API needs: a request line, headers, and a body whose length is given by
//! Content-Length. Everything is bounded (line length, header block, header count, body
//! size), chunked bodies are refused, and every failure is an [`HttpError`] that maps to
//! a 4xx status, never a panic.

use std::io::{ErrorKind, Read, Write};

/// Longest request line or header line, in bytes.
pub const MAX_LINE: usize = 2048;
/// Largest request head (request line and all headers).
pub const MAX_HEAD: usize = 8192;
/// Most header fields in one request.
pub const MAX_HEADERS: usize = 32;
/// Largest request body.
pub const MAX_BODY: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Get,
    Put,
    Patch,
    Delete,
}

impl Method {
    pub fn as_str(&self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
            Method::Delete => "DELETE",
        }
    }
}

/// One parsed request.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    pub method: Method,
    /// The path, without any query string.
    pub path: String,
    pub body: Vec<u8>,
    /// The client asked to close the connection after this request (or spoke HTTP/1.0).
    pub close: bool,
}

/// Why a request could not be read. Each maps to one 4xx status.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HttpError {
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    #[error("method not supported by this server (use GET, PUT, PATCH or DELETE)")]
    UnknownMethod,
    #[error("only HTTP/1.0 and HTTP/1.1 are supported")]
    Version,
    #[error("request line or header line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("request head larger than {MAX_HEAD} bytes or more than {MAX_HEADERS} headers")]
    HeadTooLarge,
    #[error("request body larger than {MAX_BODY} bytes")]
    BodyTooLarge,
    #[error("a request body needs Content-Length; chunked transfer encoding is not supported")]
    LengthRequired,
    #[error("the request did not arrive complete in time")]
    Timeout,
}

impl HttpError {
    pub fn status(&self) -> u16 {
        match self {
            HttpError::Malformed(_) | HttpError::Version => 400,
            HttpError::UnknownMethod => 405,
            HttpError::LineTooLong | HttpError::HeadTooLarge => 431,
            HttpError::BodyTooLarge => 413,
            HttpError::LengthRequired => 411,
            HttpError::Timeout => 408,
        }
    }
}

/// What reading the next request on a connection gave.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    Request(Request),
    /// The client closed, or sent nothing before the read failed (an idle connection
    /// past its deadline), between requests.
    Closed,
    /// A bad request: answer with the error, then close the connection (its framing can
    /// no longer be trusted).
    Bad(HttpError),
}

/// Reads requests from one connection, keeping bytes that arrived after a request
/// (pipelining) for the next one.
pub struct RequestReader<R> {
    stream: R,
    buffer: Vec<u8>,
}

impl<R: Read> RequestReader<R> {
    pub fn new(stream: R) -> Self {
        RequestReader {
            stream,
            buffer: Vec::new(),
        }
    }

    /// The stream, e.g. to set a deadline before the next request.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.stream
    }

    /// Reads more bytes; Ok(false) on end of stream.
    fn fill(&mut self) -> Result<bool, std::io::Error> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(count) => {
                    self.buffer.extend_from_slice(&chunk[..count]);
                    return Ok(true);
                }
                Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
        }
    }

    pub fn next_request(&mut self) -> ReadOutcome {
        // Read until the end of the head, within the limits.
        let head_len = loop {
            if let Some(end) = find(&self.buffer, b"\r\n\r\n") {
                break end + 4;
            }
            if let Some(error) = check_partial_head(&self.buffer) {
                return ReadOutcome::Bad(error);
            }
            match self.fill() {
                Ok(true) => {}
                Ok(false) if self.buffer.is_empty() => return ReadOutcome::Closed,
                Ok(false) => return ReadOutcome::Bad(HttpError::Malformed("incomplete request")),
                Err(_) if self.buffer.is_empty() => return ReadOutcome::Closed,
                Err(_) => return ReadOutcome::Bad(HttpError::Timeout),
            }
        };
        if head_len > MAX_HEAD {
            return ReadOutcome::Bad(HttpError::HeadTooLarge);
        }
        let head = match parse_head(&self.buffer[..head_len - 4]) {
            Ok(head) => head,
            Err(error) => return ReadOutcome::Bad(error),
        };
        let total = head_len + head.content_length;
        while self.buffer.len() < total {
            match self.fill() {
                Ok(true) => {}
                Ok(false) => {
                    return ReadOutcome::Bad(HttpError::Malformed(
                        "body shorter than Content-Length",
                    ))
                }
                Err(_) => return ReadOutcome::Bad(HttpError::Timeout),
            }
        }
        let body = self.buffer[head_len..total].to_vec();
        self.buffer.drain(..total);
        ReadOutcome::Request(Request {
            method: head.method,
            path: head.path,
            body,
            close: head.close,
        })
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Limits that can be checked before the head is complete, so a client cannot make
/// the buffer grow without bound.
fn check_partial_head(buffer: &[u8]) -> Option<HttpError> {
    let last_line = buffer
        .rsplit(|&b| b == b'\n')
        .next()
        .map_or(0, |line| line.len());
    if last_line > MAX_LINE {
        return Some(HttpError::LineTooLong);
    }
    if buffer.len() > MAX_HEAD {
        return Some(HttpError::HeadTooLarge);
    }
    None
}

struct Head {
    method: Method,
    path: String,
    content_length: usize,
    close: bool,
}

/// Parses the request line and headers (without the final empty line).
fn parse_head(head: &[u8]) -> Result<Head, HttpError> {
    let text = std::str::from_utf8(head).map_err(|_| HttpError::Malformed("head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    if request_line.len() > MAX_LINE {
        return Err(HttpError::LineTooLong);
    }
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed(
            "request line must be METHOD SP TARGET SP VERSION",
        ));
    };
    let method = match method {
        "GET" => Method::Get,
        "PUT" => Method::Put,
        "PATCH" => Method::Patch,
        "DELETE" => Method::Delete,
        other if !other.is_empty() && other.bytes().all(|b| b.is_ascii_uppercase()) => {
            return Err(HttpError::UnknownMethod)
        }
        _ => return Err(HttpError::Malformed("invalid method")),
    };
    let mut close = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(HttpError::Version),
    };
    if !target.starts_with('/') || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(HttpError::Malformed(
            "request target must be an absolute path",
        ));
    }
    let path = target.split('?').next().unwrap_or(target).to_string();

    let mut content_length: Option<usize> = None;
    let mut count = 0;
    for line in lines {
        count += 1;
        if count > MAX_HEADERS {
            return Err(HttpError::HeadTooLarge);
        }
        if line.len() > MAX_LINE {
            return Err(HttpError::LineTooLong);
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(HttpError::Malformed("header line without ':'"));
        };
        if name.is_empty() || name.bytes().any(|b| !is_token_byte(b)) {
            return Err(HttpError::Malformed("invalid header name"));
        }
        let value = value.trim_matches([' ', '\t']);
        if value.bytes().any(|b| b < b' ' && b != b'\t' || b == 0x7f) {
            return Err(HttpError::Malformed("control character in a header value"));
        }
        if name.eq_ignore_ascii_case("content-length") {
            let length: usize = value
                .parse()
                .ok()
                .filter(|_| !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
                .ok_or(HttpError::Malformed("invalid Content-Length"))?;
            if content_length.is_some_and(|previous| previous != length) {
                return Err(HttpError::Malformed("conflicting Content-Length headers"));
            }
            content_length = Some(length);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::LengthRequired);
        } else if name.eq_ignore_ascii_case("connection") {
            let value = value.to_ascii_lowercase();
            if value.split(',').any(|token| token.trim() == "close") {
                close = true;
            } else if value.split(',').any(|token| token.trim() == "keep-alive") {
                close = false;
            }
        }
    }
    let content_length = content_length.unwrap_or(0);
    if content_length > MAX_BODY {
        return Err(HttpError::BodyTooLarge);
    }
    Ok(Head {
        method,
        path,
        content_length,
        close,
    })
}

/// RFC 9110 token characters (header names).
fn is_token_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

/// A response to write back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// JSON body; empty for 204.
    pub body: Vec<u8>,
    /// Methods for the Allow header of a 405.
    pub allow: Option<&'static str>,
    /// Seconds for a Retry-After header (a 503 while the server is full).
    pub retry_after: Option<u32>,
}

impl Response {
    pub fn no_content() -> Self {
        Response {
            status: 204,
            body: Vec::new(),
            allow: None,
            retry_after: None,
        }
    }

    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        Response {
            status,
            body: serde_json::to_vec(value).unwrap_or_default(),
            allow: None,
            retry_after: None,
        }
    }

    /// An error answer: `{"fault_message": "..."}`.
    pub fn fault(status: u16, message: impl Into<String>) -> Self {
        Response::json(
            status,
            &serde_json::json!({ "fault_message": message.into() }),
        )
    }

    pub fn write_to(&self, out: &mut impl Write, close: bool) -> std::io::Result<()> {
        self.write_with_reason(out, close, reason(self.status))
    }

    /// As [`Response::write_to`], with an empty reason phrase (`HTTP/1.1 200 \r\n`, which
    /// RFC 9112 allows): what Cloud Hypervisor's server sends and its client expects.
    pub fn write_without_reason_to(
        &self,
        out: &mut impl Write,
        close: bool,
    ) -> std::io::Result<()> {
        self.write_with_reason(out, close, "")
    }

    fn write_with_reason(
        &self,
        out: &mut impl Write,
        close: bool,
        reason: &str,
    ) -> std::io::Result<()> {
        let mut head = format!("HTTP/1.1 {} {reason}\r\nServer: gpuvm\r\n", self.status);
        if !self.body.is_empty() {
            head.push_str("Content-Type: application/json\r\n");
        }
        if self.status != 204 {
            head.push_str(&format!("Content-Length: {}\r\n", self.body.len()));
        }
        if let Some(allow) = self.allow {
            head.push_str(&format!("Allow: {allow}\r\n"));
        }
        if let Some(seconds) = self.retry_after {
            head.push_str(&format!("Retry-After: {seconds}\r\n"));
        }
        if close {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        out.write_all(head.as_bytes())?;
        out.write_all(&self.body)?;
        out.flush()
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests;
