//! Mutated JSON bodies (tests/fuzz_json.rs: wrong types, edge numbers, nulls, deep
//! nesting, unicode, huge arrays, broken text) sent to a real `hearth serve` on the
//! default model, over raw HTTP/1.1 as any client could. Fewer cases than openapi's
//! json_fuzz, which checks parsing and validation alone; this one checks what only the
//! whole server can get wrong: tokenizing and templating hostile text, sampling with
//! edge parameters, streaming, and staying up.
//!
//! Promises checked: no status but 200, 400, 404, 413, 429 and 503; every error is OpenAI's
//! envelope; a 200 is a completion (or an SSE stream of chunks ending in `[DONE]`) with no
//! server error inside it; `/health` answers after every case. Generation lengths are
//! clamped so a case takes a fraction of a second. `HEARTH_FUZZ_SECS=600` runs it for ten
//! minutes (see docs/robustness.md).

mod common;
#[path = "fuzz_driver.rs"]
mod fuzz;
#[path = "fuzz_json.rs"]
mod fuzz_json;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Served;
use fuzz::{Budget, Rng};
use fuzz_json::{Body, Endpoint};
use serde_json::Value;

/// Tokens a fuzzed request may generate: enough to exercise sampling and stop handling,
/// few enough that cases stay fast on a shared 2-core machine.
const MAX_GEN_TOKENS: u64 = 8;
/// One case, request to last byte; past this the server stalled.
const STALL: Duration = Duration::from_secs(120);
/// What a server may answer a body: success, the client's fault, an unknown model (404
/// `model_not_found`, as OpenAI), too large, busy, or a ring member down (docs/api.md).
const ALLOWED: [u16; 6] = [200, 400, 404, 413, 429, 503];
/// CI's run is this many times the driver's default: each case generates tokens.
const CI_SCALE: f64 = 3.0;

/// Clamps generation lengths in a body that still parses, so a mutant cannot ask for
/// thousands of tokens; values of the wrong type are left for the server to refuse.
fn clamp(mut body: Body) -> Body {
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(&body.text) else { return body };
    for key in ["max_tokens", "max_completion_tokens"] {
        match map.get(key) {
            Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v > MAX_GEN_TOKENS) => {
                map.insert(key.into(), MAX_GEN_TOKENS.into());
            }
            None if key == "max_tokens" => {
                map.insert(key.into(), MAX_GEN_TOKENS.into());
            }
            _ => {}
        }
    }
    body.text = serde_json::to_vec(&Value::Object(map)).unwrap_or(body.text);
    body
}

fn mutate(rng: &mut Rng, parent: &Body, donor: &Body) -> Body {
    clamp(fuzz_json::mutate(rng, parent, donor))
}

struct Answer {
    status: u16,
    headers: String,
    body: Vec<u8>,
}

/// Joins the chunks of a `Transfer-Encoding: chunked` body.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else { return out };
        let size = std::str::from_utf8(&raw[..eol]).ok().and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
        let Some(size) = size.filter(|&s| s > 0) else { return out };
        let start = eol + 2;
        let end = (start + size).min(raw.len());
        out.extend_from_slice(&raw[start..end]);
        raw = raw.get(end + 2..).unwrap_or_default();
    }
}

fn request(addr: &str, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut s = TcpStream::connect(addr).expect("connect to the server");
    s.set_read_timeout(Some(STALL)).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // The server may answer (413) and close before reading a large body: a write error then
    // is not a failure, the answer is what counts.
    let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| {
        panic!("no HTTP answer ({} bytes): {:?}", raw.len(), String::from_utf8_lossy(&raw[..raw.len().min(200)]))
    });
    let headers = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = headers.get(9..12).and_then(|c| c.parse().ok()).expect("a status line");
    let rest = &raw[split + 4..];
    let body = if headers.contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_vec() };
    Answer { status, headers, body }
}

/// OpenAI's envelope; a `server_error` only where the server says why it is unavailable
/// (503: shutting down, a ring member lost), never an internal failure.
fn assert_envelope(v: &Value, status: u16) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "no message: {v}");
    assert!(e["type"].is_string(), "no type: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "param and code must be present: {v}");
    assert!(e["type"] != "server_error" || status == 503, "a server error: {v}");
}

fn check_completion(v: &Value, endpoint: Endpoint) {
    let object = match endpoint {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    assert!(v["object"].as_str().is_some_and(|o| o.starts_with(object)), "object: {v}");
    assert!(v["choices"].is_array(), "no choices: {v}");
}

fn check(addr: &str, body: &Body) -> String {
    let answer = request(addr, "POST", body.endpoint.path(), &body.text);
    assert!(ALLOWED.contains(&answer.status), "status {}: {}", answer.status, String::from_utf8_lossy(&answer.body));
    let outcome = if answer.status != 200 {
        let v: Value = serde_json::from_slice(&answer.body)
            .unwrap_or_else(|e| panic!("error body is not JSON ({e}): {:?}", String::from_utf8_lossy(&answer.body)));
        assert_envelope(&v, answer.status);
        format!("{} {} {}", answer.status, v["error"]["code"], v["error"]["param"])
    } else if answer.headers.contains("text/event-stream") {
        let text = String::from_utf8(answer.body).expect("an SSE stream is UTF-8");
        let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
        assert_eq!(events.last().copied(), Some("[DONE]"), "a stream must end with [DONE]: {text:?}");
        let mut errors = 0;
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("a chunk is not JSON ({err}): {e}"));
            if v.get("error").is_some() {
                assert_envelope(&v, 200);
                errors += 1;
            } else {
                check_completion(&v, body.endpoint);
            }
        }
        format!("200 stream{}", if errors > 0 { " with error" } else { "" })
    } else {
        let v: Value = serde_json::from_slice(&answer.body).expect("a 200 body is JSON");
        check_completion(&v, body.endpoint);
        "200".into()
    };
    let health = request(addr, "GET", "/health", b"");
    assert_eq!(health.status, 200, "the server stopped answering: {}", String::from_utf8_lossy(&health.body));
    format!("{:?} {outcome}", body.endpoint)
}

#[test]
fn live_server_survives_hostile_json_bodies() {
    let served = Served::start(&["--threads", "1", "--ctx-size", "256", "--parallel", "2"]);
    let model = common::default_model();
    let model_id = model.file_stem().unwrap().to_string_lossy().into_owned();
    let seeds: Vec<Body> = fuzz_json::seeds(&model_id).into_iter().map(clamp).collect();
    for s in &seeds {
        let outcome = check(&served.addr, s);
        assert!(outcome.contains(" 200"), "a valid seed was refused: {outcome}: {}", String::from_utf8_lossy(&s.text));
    }
    let addr = served.addr.clone();
    let report = fuzz::run("http", &Budget::from_env(CI_SCALE), seeds, STALL, mutate, |b| check(&addr, b));
    assert!(report.cases > 10, "only {} cases ran", report.cases);
}
