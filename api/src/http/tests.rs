use super::*;
use std::io::Cursor;

fn read_all(input: &[u8]) -> Vec<ReadOutcome> {
    let mut reader = RequestReader::new(Cursor::new(input.to_vec()));
    let mut outcomes = Vec::new();
    loop {
        let outcome = reader.next_request();
        let stop = !matches!(outcome, ReadOutcome::Request(_));
        outcomes.push(outcome);
        if stop || outcomes.len() > 64 {
            return outcomes;
        }
    }
}

fn first(input: &[u8]) -> ReadOutcome {
    read_all(input).remove(0)
}

#[test]
fn parses_a_request_with_a_body() {
    let outcome =
        first(b"PUT /machine-config?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}");
    assert_eq!(
        outcome,
        ReadOutcome::Request(Request {
            method: Method::Put,
            path: "/machine-config".into(),
            body: b"{}".to_vec(),
            close: false,
        })
    );
}

#[test]
fn pipelined_requests_are_kept_apart() {
    let outcomes = read_all(
        b"GET / HTTP/1.1\r\n\r\nPATCH /vm HTTP/1.1\r\ncontent-length: 3\r\nConnection: close\r\n\r\nabcGET",
    );
    assert!(matches!(&outcomes[0], ReadOutcome::Request(r) if r.path == "/" && r.body.is_empty()));
    assert!(
        matches!(&outcomes[1], ReadOutcome::Request(r) if r.method == Method::Patch && r.body == b"abc" && r.close)
    );
    // A truncated third request is a bad request, not a hang.
    assert!(matches!(outcomes[2], ReadOutcome::Bad(_)));
}

#[test]
fn limits_and_framing_errors_are_4xx() {
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (b"GET / HTTP/2.0\r\n\r\n".to_vec(), 400),
        (b"OPTIONS / HTTP/1.1\r\n\r\n".to_vec(), 405),
        (b"get / HTTP/1.1\r\n\r\n".to_vec(), 400),
        (b"GET  / HTTP/1.1\r\n\r\n".to_vec(), 400),
        (b"GET noslash HTTP/1.1\r\n\r\n".to_vec(), 400),
        (
            b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
            411,
        ),
        (
            b"PUT / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n".to_vec(),
            413,
        ),
        (
            b"PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n".to_vec(),
            400,
        ),
        (
            b"PUT / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n".to_vec(),
            400,
        ),
        (
            b"PUT / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab".to_vec(),
            400,
        ),
        (b"GET / HTTP/1.1\r\nNoColon\r\n\r\n".to_vec(), 400),
        (b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n".to_vec(), 400),
        ([b"GET /".as_slice(), &[b'a'; MAX_LINE + 10]].concat(), 431),
        (
            [
                b"GET / HTTP/1.1\r\n".as_slice(),
                &b"A: b\r\n".repeat(MAX_HEADERS + 1),
                b"\r\n",
            ]
            .concat(),
            431,
        ),
        (
            [
                b"GET / HTTP/1.1\r\n".as_slice(),
                &format!("A: {}\r\n", "b".repeat(1000))
                    .repeat(10)
                    .into_bytes(),
            ]
            .concat(),
            431,
        ),
        (b"GET / HTTP/1.1\r\n\xff: x\r\n\r\n".to_vec(), 400),
    ];
    for (input, status) in cases {
        match first(&input) {
            ReadOutcome::Bad(error) => assert_eq!(
                error.status(),
                status,
                "{:?} -> {error}",
                String::from_utf8_lossy(&input)
            ),
            other => panic!("{:?} -> {other:?}", String::from_utf8_lossy(&input)),
        }
    }
}

#[test]
fn empty_input_is_a_clean_close() {
    assert_eq!(first(b""), ReadOutcome::Closed);
}

/// xorshift64*: a fixed-seed generator, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const VALID: &[&[u8]] = &[
    b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    b"PUT /machine-config HTTP/1.1\r\nContent-Length: 36\r\n\r\n{\"vcpu_count\": 1, \"mem_size_mib\": 64}",
    b"PATCH /vm HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 18\r\n\r\n{\"state\":\"Paused\"}",
];

const PIECES: &[&[u8]] = &[
    b"\r\n",
    b"\r\n\r\n",
    b":",
    b" ",
    b"Content-Length: ",
    b"99999999999999999999",
    b"HTTP/1.1",
    b"Transfer-Encoding: chunked",
    b"\0",
    b"\xff\xfe",
    b"GET",
    b"/",
    b"\n",
    b"%",
    b"?a=b",
];

/// Property: for any input the reader ends (request, clean close or a 4xx error), never
/// panics, and every request it returns respects the limits.
#[test]
fn random_inputs_never_panic_and_fail_with_4xx() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut requests = 0;
    let mut errors = 0;
    for case in 0..20_000 {
        let mut input: Vec<u8> = match case % 3 {
            // Pure noise.
            0 => (0..rng.below(300)).map(|_| rng.next() as u8).collect(),
            // A valid request, mutated.
            1 => {
                let mut bytes = VALID[rng.below(VALID.len())].to_vec();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(bytes.len() + 1);
                    match rng.below(3) {
                        0 if at < bytes.len() => bytes[at] = rng.next() as u8,
                        1 if at < bytes.len() => {
                            bytes.remove(at);
                        }
                        _ => {
                            let piece = PIECES[rng.below(PIECES.len())];
                            bytes.splice(at..at, piece.iter().copied());
                        }
                    }
                }
                bytes
            }
            // Valid pieces glued at random.
            _ => (0..rng.below(20))
                .flat_map(|_| PIECES[rng.below(PIECES.len())].to_vec())
                .collect(),
        };
        if rng.below(10) == 0 {
            input.extend(std::iter::repeat_n(b'x', rng.below(3 * MAX_HEAD)));
        }
        for outcome in read_all(&input) {
            match outcome {
                ReadOutcome::Request(request) => {
                    requests += 1;
                    assert!(request.body.len() <= MAX_BODY);
                    assert!(request.path.starts_with('/'));
                }
                ReadOutcome::Bad(error) => {
                    errors += 1;
                    assert!((400..500).contains(&error.status()), "{error}");
                }
                ReadOutcome::Closed => {}
            }
        }
    }
    // The generator must reach both sides, or the property says nothing.
    assert!(requests > 100, "only {requests} inputs parsed as requests");
    assert!(errors > 1000, "only {errors} inputs were rejected");
}

#[test]
fn responses_are_framed() {
    let mut out = Vec::new();
    Response::fault(400, "nope")
        .write_to(&mut out, true)
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
    assert!(text.contains("Content-Length: 24\r\n"), "{text}");
    assert!(text.contains("Connection: close\r\n"), "{text}");
    assert!(
        text.ends_with("\r\n\r\n{\"fault_message\":\"nope\"}"),
        "{text}"
    );
    let mut out = Vec::new();
    Response::no_content().write_to(&mut out, false).unwrap();
    assert_eq!(out, b"HTTP/1.1 204 No Content\r\nServer: gpuvm\r\n\r\n");
    // Cloud Hypervisor's shape: no reason phrase, the status code alone before the CR
    // once trimmed (as its api_client reads it).
    let mut out = Vec::new();
    Response::fault(404, "x")
        .write_without_reason_to(&mut out, false)
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    let line = &text[..text.find('\r').unwrap()];
    assert_eq!(line, "HTTP/1.1 404 ");
    assert_eq!(line["HTTP/1.1 ".len()..].trim().parse::<u16>(), Ok(404));
}
