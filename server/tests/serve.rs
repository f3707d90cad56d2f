//! `hearth serve` as a user runs it: it loads the model, answers /health, and exits
//! cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

fn default_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    engine::default_model::ensure_default_model(&dir).expect("fetch the default model")
}

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn serve_answers_health_and_stops_on_sigterm() {
    let model = default_model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["serve", "--port", "0", "--threads", "1", "--ctx-size", "512", "--parallel", "1"])
        .arg("--model")
        .arg(&model)
        .env("HEARTH_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _reap = Reap(child.id());
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut addr = None;
    for line in stderr.lines() {
        let line = line.unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            addr = Some(rest.trim().to_string());
            break;
        }
    }
    let addr = addr.expect("the server printed its address");
    let resp = get(&addr, "/health");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"status\":\"ok\""), "{resp}");

    // SAFETY: plain kill(2) on our own child.
    let rc = unsafe { libc_kill(child.id() as i32, 15) };
    assert_eq!(rc, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "hearth exited with {status}");
}

#[test]
fn sigterm_lets_a_running_stream_finish() {
    let model = default_model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["serve", "--port", "0", "--threads", "1", "--ctx-size", "512", "--parallel", "1"])
        .arg("--model")
        .arg(&model)
        .env("HEARTH_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _reap = Reap(child.id());
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("server exited early").unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.trim().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = r#"{"model":"","messages":[{"role":"user","content":"Tell a long story."}],"max_tokens":60,"stream":true}"#;
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    // SAFETY: plain kill(2) on our own child.
    assert_eq!(unsafe { libc_kill(child.id() as i32, 15) }, 0);
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("data: [DONE]"), "the stream was cut off: {rest}");
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    let status = child.wait().unwrap();
    assert!(status.success(), "hearth exited with {status}");
}

#[test]
fn a_missing_model_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth")).args(["serve", "--model", "/nonexistent/model.gguf"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

/// Kills the server if a test fails before it stops it, so no process outlives the test.
struct Reap(u32);

impl Drop for Reap {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc_kill(self.0 as i32, 9) };
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
