//! The guest's HTTP/1.1 requests to MMDS: a bounded parser over the bytes a TCP
//! connection received, and the answers (V1: GETs answered; V2: a session token first).

use crate::data_store::LookupError;
use crate::{Mmds, MmdsVersion};

/// The longest request taken, head and body together.
pub const MAX_REQUEST_LEN: usize = 8192;
/// The most header lines taken.
pub const MAX_HEADERS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without its query string.
    pub path: String,
    /// Names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// HTTP/1.0, or `Connection: close`.
    pub close: bool,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why bytes are not a request (answered 400, then the connection closes).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("the request is over {MAX_REQUEST_LEN} bytes")]
    TooLong,
    #[error("malformed request: {0}")]
    Malformed(&'static str),
}

/// Parses the first request in `bytes`: `Ok(None)` while it is incomplete, else the
/// request and how many bytes it took.
pub fn parse(bytes: &[u8]) -> Result<Option<(Request, usize)>, ParseError> {
    let Some(head_end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if bytes.len() > MAX_REQUEST_LEN {
            Err(ParseError::TooLong)
        } else {
            Ok(None)
        };
    };
    if head_end > MAX_REQUEST_LEN {
        return Err(ParseError::TooLong);
    }
    let head =
        std::str::from_utf8(&bytes[..head_end]).map_err(|_| ParseError::Malformed("not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let request_line = lines
        .next()
        .ok_or(ParseError::Malformed("no request line"))?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ParseError::Malformed("the request line"));
    };
    let close_by_default = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(ParseError::Malformed("the HTTP version")),
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ParseError::Malformed("the method"));
    }
    if !target.starts_with('/') {
        return Err(ParseError::Malformed("the request target"));
    }
    let path = target.split('?').next().unwrap_or("/").to_string();
    let mut headers = Vec::new();
    for line in lines {
        if headers.len() == MAX_HEADERS {
            return Err(ParseError::Malformed("too many headers"));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or(ParseError::Malformed("a header line"))?;
        if name.is_empty() || name.contains(' ') {
            return Err(ParseError::Malformed("a header name"));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    let find = |n: &str| {
        headers
            .iter()
            .find(|(name, _)| name == n)
            .map(|(_, v)| v.as_str())
    };
    if find("transfer-encoding").is_some() {
        return Err(ParseError::Malformed("chunked bodies are not taken"));
    }
    let body_len = match find("content-length") {
        None => 0,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| ParseError::Malformed("Content-Length"))?,
    };
    let total = head_end + 4 + body_len;
    if total > MAX_REQUEST_LEN {
        return Err(ParseError::TooLong);
    }
    if bytes.len() < total {
        return Ok(None);
    }
    let close = match find("connection").map(str::to_ascii_lowercase).as_deref() {
        Some("close") => true,
        Some("keep-alive") => false,
        _ => close_by_default,
    };
    Ok(Some((
        Request {
            method: method.to_string(),
            path,
            headers,
            body: bytes[head_end + 4..total].to_vec(),
            close,
        },
        total,
    )))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub close: bool,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response {
            status,
            content_type: "text/plain",
            body: body.into().into_bytes(),
            close: false,
        }
    }

    fn reason(&self) -> &'static str {
        match self.status {
            200 => "OK",
            400 => "Bad Request",
            401 => "Unauthorized",
            404 => "Not Found",
            405 => "Method Not Allowed",
            406 => "Not Acceptable",
            _ => "Internal Server Error",
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nServer: Firecracker MMDS\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}\r\n",
            self.status,
            self.reason(),
            self.content_type,
            self.body.len(),
            if self.close { "Connection: close\r\n" } else { "" },
        )
        .into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

const TOKEN_PATH: &str = "/latest/api/token";
const TTL_HEADER: &str = "x-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-metadata-token";

/// Answers one request from the guest.
pub fn respond(request: &Request, mmds: &Mmds) -> Response {
    let mut response = answer(request, mmds);
    response.close |= request.close;
    response
}

fn answer(request: &Request, mmds: &Mmds) -> Response {
    let path = request.path.as_str();
    let config = mmds.config();
    match request.method.as_str() {
        "PUT" if path.trim_end_matches('/') == TOKEN_PATH => {
            if request.header("x-forwarded-for").is_some() {
                return Response::text(
                    400,
                    "Invalid header. Reason: Unsupported header name. Key: X-Forwarded-For",
                );
            }
            let Some(ttl) = request.header(TTL_HEADER) else {
                return Response::text(400, "Token time to live value not found. Use `X-metadata-token-ttl-seconds` header to specify the token's lifetime.");
            };
            let Ok(ttl) = ttl.parse::<u64>() else {
                return Response::text(400, "Invalid time to live value provided for token.");
            };
            match mmds.tokens().generate(ttl) {
                Ok(token) => Response::text(200, token),
                Err(error) => Response::text(400, error.to_string()),
            }
        }
        "GET" => {
            let token = request.header(TOKEN_HEADER);
            match (config.as_ref().map(|c| c.version), token) {
                (Some(MmdsVersion::V2), None) => {
                    return Response::text(401, "No MMDS token provided. Use `X-metadata-token` header to specify the session token.")
                }
                (_, Some(token)) if !mmds.tokens().is_valid(token) => {
                    return Response::text(401, "MMDS token not valid.")
                }
                _ => {}
            }
            let imds_compat = config.as_ref().is_some_and(|c| c.imds_compat);
            let json = !imds_compat
                && request
                    .header("accept")
                    .is_some_and(|a| a.contains("application/json"));
            let store = mmds.store();
            if json {
                match store.lookup(path) {
                    Ok(value) => Response {
                        status: 200,
                        content_type: "application/json",
                        body: serde_json::to_vec(value).unwrap_or_default(),
                        close: false,
                    },
                    Err(error) => Response::text(404, error.to_string()),
                }
            } else {
                match store.lookup_text(path) {
                    Ok(text) => Response::text(200, text),
                    Err(error @ LookupError::NotFound(_)) => Response::text(404, error.to_string()),
                    Err(error) => Response::text(406, error.to_string()),
                }
            }
        }
        _ => Response::text(405, "Not allowed HTTP method."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MmdsConfig;
    use serde_json::json;

    fn req(text: &str) -> Request {
        parse(text.as_bytes()).unwrap().unwrap().0
    }

    #[test]
    fn parses_bounded_requests() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap(), None);
        let (request, used) =
            parse(b"PUT /a?x=1 HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhiGET")
                .unwrap()
                .unwrap();
        assert_eq!(
            (request.path.as_str(), &request.body[..]),
            ("/a", &b"hi"[..])
        );
        assert!(request.close);
        assert_eq!(used, 63);
        for bad in [
            &b"GET /\r\n\r\n"[..],
            b"GET / HTTP/2\r\n\r\n",
            b"get / HTTP/1.1\r\n\r\n",
            b"GET x HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nnocolon\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: z\r\n\r\n",
            b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: 99999\r\n\r\n",
            b"\xff\xfe / HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(
            parse(&vec![b'a'; MAX_REQUEST_LEN + 1]),
            Err(ParseError::TooLong)
        );
    }

    #[test]
    fn v1_and_v2_answers() {
        let mmds = Mmds::default();
        mmds.store()
            .put(json!({"latest": {"meta-data": {"id": "i-1"}}}))
            .unwrap();
        mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V1, vec!["eth0".into()])));
        let ok = respond(&req("GET /latest/meta-data HTTP/1.1\r\n\r\n"), &mmds);
        assert_eq!((ok.status, &ok.body[..]), (200, &b"id"[..]));
        let json = respond(
            &req("GET /latest HTTP/1.1\r\nAccept: application/json\r\n\r\n"),
            &mmds,
        );
        assert_eq!(json.body, br#"{"meta-data":{"id":"i-1"}}"#);
        assert_eq!(
            respond(&req("GET /nope HTTP/1.1\r\n\r\n"), &mmds).status,
            404
        );
        assert_eq!(respond(&req("POST / HTTP/1.1\r\n\r\n"), &mmds).status, 405);

        mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V2, vec!["eth0".into()])));
        let get = "GET /latest/meta-data/id HTTP/1.1\r\n";
        assert_eq!(respond(&req(&format!("{get}\r\n")), &mmds).status, 401);
        assert_eq!(
            respond(&req(&format!("{get}X-metadata-token: bad\r\n\r\n")), &mmds).status,
            401
        );
        assert_eq!(
            respond(&req("PUT /latest/api/token HTTP/1.1\r\n\r\n"), &mmds).status,
            400
        );
        let token = respond(
            &req("PUT /latest/api/token HTTP/1.1\r\nX-metadata-token-ttl-seconds: 60\r\n\r\n"),
            &mmds,
        );
        assert_eq!(token.status, 200);
        let token = String::from_utf8(token.body).unwrap();
        let got = respond(
            &req(&format!(
                "{get}X-metadata-token: {token}\r\nConnection: close\r\n\r\n"
            )),
            &mmds,
        );
        assert_eq!(
            (got.status, &got.body[..], got.close),
            (200, &b"i-1"[..], true)
        );
        let bytes = String::from_utf8(got.to_bytes()).unwrap();
        assert!(bytes.starts_with("HTTP/1.1 200 OK\r\n") && bytes.ends_with("\r\n\r\ni-1"));
    }
}
