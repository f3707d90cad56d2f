//! The ring as real processes on loopback: a head and two workers give the single
//! node's greedy output for every window shape; a wrong secret is refused.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Served;
use serde_json::Value;

const PROMPT: &str = "Explain in detail how a bicycle works.";
const TOKENS: usize = 48;

fn chat(addr: &str, stream: bool) -> String {
    let body = format!(r#"{{"model":"","messages":[{{"role":"user","content":"{PROMPT}"}}],"max_tokens":{TOKENS},"temperature":0,"stream":{stream}}}"#);
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let body = &resp[resp.find("\r\n\r\n").unwrap() + 4..];
    if !stream {
        let v: Value = serde_json::from_str(body).unwrap();
        return v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    }
    body.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn the_ring_gives_the_single_node_output_for_every_window_shape() {
    let single = Served::start(&["--threads", "1", "--parallel", "2"]);
    let expected = chat(&single.addr, false);
    drop(single);
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    // k = 1, 2, 3, uneven, and a head that only embeds, samples and relays.
    for windows in ["10,10,10", "5,5,5", "4,3,3", "6,12,12", "0,15,15"] {
        let head = Served::start(&["--threads", "1", "--parallel", "2", "--workers", &workers, "--windows", windows]);
        assert_eq!(chat(&head.addr, false), expected, "windows {windows}");
        assert_eq!(chat(&head.addr, true), expected, "windows {windows}, streamed");
    }
    // f16 activations halve the bytes per hop; report how far they agree.
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "4,3,3", "--f16-activations"]);
    let f16 = chat(&head.addr, false);
    let same = f16.chars().zip(expected.chars()).take_while(|(a, b)| a == b).count();
    eprintln!("f16 activations: first {same} of {} characters identical to f32", expected.chars().count());
    assert!(same > 0, "f16 output diverged at once: {f16:?}");
}

#[test]
fn two_concurrent_streams_across_the_ring() {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let head = Served::start(&["--threads", "1", "--parallel", "2", "--workers", &format!("{},{}", w1.addr, w2.addr)]);
    let alone = chat(&head.addr, true);
    let addr = head.addr.clone();
    let other = std::thread::spawn(move || chat(&addr, true));
    let mine = chat(&head.addr, true);
    assert_eq!(mine, alone);
    assert_eq!(other.join().unwrap(), alone);
}

#[test]
fn a_wrong_cluster_secret_is_refused() {
    let w = Served::worker(&["--threads", "1", "--cluster-secret", "right-secret"]);
    let err = match Served::try_start(&["--threads", "1", "--workers", &w.addr, "--cluster-secret", "wrong-secret"]) {
        Ok(_) => panic!("a head with the wrong secret formed a ring"),
        Err(log) => log,
    };
    assert!(err.contains(&w.addr), "the error should name the worker: {err}");
}

fn raw(addr: &str, method_path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "{method_path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp[9..12].parse().unwrap();
    (status, resp[resp.find("\r\n\r\n").unwrap() + 4..].to_string())
}

#[test]
fn a_worker_killed_mid_request_gives_503_and_degraded_health() {
    let w1 = Served::worker(&["--threads", "1"]);
    let mut w2 = Served::worker(&["--threads", "1"]);
    let head = Served::start(&["--threads", "1", "--workers", &format!("{},{}", w1.addr, w2.addr)]);
    let addr = head.addr.clone();
    let long = r#"{"model":"","messages":[{"role":"user","content":"Write a very long story."}],"max_tokens":900,"temperature":0}"#;
    let pending = std::thread::spawn(move || raw(&addr, "POST /v1/chat/completions", long));
    std::thread::sleep(Duration::from_millis(800));
    w2.child.kill().unwrap(); // SIGKILL: no goodbye on the link
    let (status, body) = pending.join().unwrap();
    assert_eq!(status, 503, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "ring_unavailable", "{body}");
    let (status, body) = raw(&head.addr, "GET /health", "");
    assert_eq!(status, 200);
    assert!(body.contains("\"degraded\""), "{body}");
}
