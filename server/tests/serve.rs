//! `hearth serve` as a user runs it: it loads the model, answers /health, and on SIGTERM
//! lets running streams finish and exits cleanly.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::Served;

fn request(addr: &str, head: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "{head} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    s
}

#[test]
fn serve_answers_health_and_stops_on_sigterm() {
    let mut server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1"]);
    let mut resp = String::new();
    request(&server.addr, "GET /health", "").read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"status\":\"ok\""), "{resp}");
    server.terminate();
    let status = server.child.wait().unwrap();
    assert!(status.success(), "hearth exited with {status}");
}

#[test]
fn sigterm_lets_a_running_stream_finish() {
    let mut server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1"]);
    // Greedy, so the answer is the same every run and runs past 60 tokens: a sampled one
    // may end early with `stop`, and this test is about the stream finishing, not sampling.
    let body = r#"{"model":"","messages":[{"role":"user","content":"Tell a long story."}],"max_tokens":60,"temperature":0,"stream":true}"#;
    let mut s = request(&server.addr, "POST /v1/chat/completions", body);
    let mut first = [0u8; 64];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    server.terminate();
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("data: [DONE]"), "the stream was cut off: {rest}");
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    let status = server.child.wait().unwrap();
    assert!(status.success(), "hearth exited with {status}");
}

#[test]
fn a_missing_model_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth")).args(["serve", "--model", "/nonexistent/model.gguf"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}
