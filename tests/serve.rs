//! `hearth serve` as a user runs it: it loads the model, answers /health, on SIGTERM
//! lets running streams finish and exits cleanly, no crowd of slow or idle connections
//! or of console streams keeps other clients out, and the web guard's flags
//! (`--allowed-hosts`, `--cors-origins`) hold end to end.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{http, wait_for, Served};

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
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(["serve", "--model", "/nonexistent/model.gguf"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

/// A chat template that doubles a string forty times (a terabyte in a handful of steps)
/// is refused at start: the server renders a probe conversation under the render bounds in
/// its sandboxed renderer, and names the template it will not serve.
#[test]
fn a_chat_template_that_blows_its_bounds_is_refused_at_start() {
    let file = std::env::temp_dir().join(format!("hearth-bomb-{}.jinja", std::process::id()));
    std::fs::write(&file, "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}{{ ns.s | length }}").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(["serve", "--port", "0", "--threads", "1", "--chat-template"]).arg(&file).arg("--model").arg(common::default_model()).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(file.to_str().unwrap()) && err.contains("refused") && err.contains("memory bound"), "{err}");
}

#[test]
fn gpu_layers_without_an_accelerator_are_a_clear_error() {
    if !engine::accelerators().is_empty() {
        return;
    }
    for role in [&["serve"][..], &["worker", "--listen", "127.0.0.1:0"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(role).args(["--gpu-layers", "3", "--model"]).arg(common::default_model()).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--gpu-layers 3") && err.contains("no accelerator"), "{err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(["serve", "--gpu-layers", "many"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("`auto`"));
}

/// `--experts-in-ram N` (llama.cpp's `--n-cpu-moe`) asks for something only a
/// Mixture-of-Experts model has: on a dense model it is a clear error at start, in any build.
#[test]
fn experts_in_ram_on_a_dense_model_is_a_clear_error() {
    for (role, flag) in [(&["serve"][..], "--experts-in-ram"), (&["worker", "--listen", "127.0.0.1:0"][..], "--n-cpu-moe")] {
        let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(role).args([flag, "2", "--model"]).arg(common::default_model()).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--experts-in-ram 2") && err.contains("not a Mixture-of-Experts model"), "{role:?}: {err}");
    }
}

/// Reads until the server closes the connection; what it sent. Panics if it is still open
/// after `limit`.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> String {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is a close too (the server dropped a connection with unread input).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the connection is still open after {limit:?} ({e}); got {:?}", String::from_utf8_lossy(&got)),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn gauge(metrics: &str, name: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(f64::NAN)
}

/// 300 connections that never finish their headers, and some idle after a request, hold
/// far more than --max-connections: a real client still gets in at once (the connection
/// idle the longest makes room), long before the header timeout would free anything.
#[test]
fn slow_and_idle_connections_do_not_lock_out_a_client() {
    const CAP: usize = 64;
    const SLOW: usize = 300;
    const IDLE: usize = 20;
    let server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--max-connections", "64", "--header-timeout", "600"]);
    let mut held = Vec::new();
    for _ in 0..IDLE {
        let mut s = TcpStream::connect(&server.addr).unwrap();
        write!(s, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 512];
        assert!(s.read(&mut buf).unwrap() > 0);
        held.push(s);
    }
    for _ in 0..SLOW {
        // The server may close some at once; the client does not care.
        if let Ok(mut s) = TcpStream::connect(&server.addr) {
            let _ = write!(s, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n");
            held.push(s);
        }
    }
    let started = Instant::now();
    let resp = wait_for("a client gets an answer", Duration::from_secs(60), || http(&server.addr, "GET", "/health", "", "").ok());
    assert_eq!(resp.status, 200, "{}", resp.body);
    let metrics = http(&server.addr, "GET", "/metrics", "", "").unwrap().body;
    let open = gauge(&metrics, "hearth_http_connections");
    assert!(open <= CAP as f64, "{open} connections open, over the cap of {CAP}");
    assert!(gauge(&metrics, "hearth_http_connections_displaced_total") > 0.0, "{metrics}");
    println!("answered after {:?} with {} connections held", started.elapsed(), held.len());
    drop(held);
}

/// Connections that sent their headers and trickle a body (a byte now and then) hold every
/// slot: a real client still gets in (the connection sending a body the longest makes
/// room), though none of them is idle.
#[test]
fn connections_trickling_bodies_do_not_lock_out_a_client() {
    const CAP: usize = 32;
    let server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--max-connections", "32", "--header-timeout", "600"]);
    let mut held = Vec::new();
    for _ in 0..CAP + 8 {
        if let Ok(mut s) = TcpStream::connect(&server.addr) {
            let _ = write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{");
            held.push(s);
        }
    }
    // Every slot is taken by a connection whose request started.
    std::thread::sleep(Duration::from_millis(500));
    let resp = wait_for("a client gets an answer", Duration::from_secs(60), || http(&server.addr, "GET", "/health", "", "").ok());
    assert_eq!(resp.status, 200, "{}", resp.body);
    let metrics = http(&server.addr, "GET", "/metrics", "", "").unwrap().body;
    assert!(gauge(&metrics, "hearth_http_connections") <= CAP as f64, "{metrics}");
    assert!(gauge(&metrics, "hearth_http_connections_displaced_total") > 0.0, "{metrics}");
    drop(held);
}

/// A body that keeps coming, a byte every quarter second (never a pause the header timeout
/// would see), is refused once the grace is over: it is far below the least rate.
#[test]
fn a_body_that_arrives_too_slowly_is_refused_after_the_grace() {
    let server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--header-timeout", "2"]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n").unwrap();
    let mut trickle = s.try_clone().unwrap();
    let started = Instant::now();
    let writer = std::thread::spawn(move || {
        // Bounded: 400 bytes at most, then it stops whatever happened.
        for _ in 0..400 {
            if trickle.write_all(b" ").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    });
    let got = read_until_closed(&mut s, Duration::from_secs(60));
    let took = started.elapsed();
    assert!(got.is_empty() || got.starts_with("HTTP/1.1 400"), "{got}");
    assert!(got.is_empty() || got.contains("too slowly"), "{got}");
    assert!(took < Duration::from_secs(60), "open for {took:?}");
    println!("a trickling body was refused after {took:?}: {}", got.lines().last().unwrap_or(""));
    drop(s);
    writer.join().unwrap();
}

/// A connection that does not finish its headers, or sits idle after a request, or stops
/// sending its body, is closed after --header-timeout; a streamed answer that takes longer
/// than that is not cut.
#[test]
fn header_and_idle_timeouts_close_connections_but_streams_run_on() {
    let server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--header-timeout", "1"]);
    let limit = Duration::from_secs(30);
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    write!(slow, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n").unwrap();
    let got = read_until_closed(&mut slow, limit);
    assert!(got.is_empty() || got.starts_with("HTTP/1.1 408"), "{got}");

    let mut idle = TcpStream::connect(&server.addr).unwrap();
    write!(idle, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let got = read_until_closed(&mut idle, limit);
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");

    let mut stalled = TcpStream::connect(&server.addr).unwrap();
    write!(stalled, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\"").unwrap();
    let got = read_until_closed(&mut stalled, limit);
    assert!(!got.starts_with("HTTP/1.1 200"), "{got}");

    // Greedy and long: a few seconds of streaming, several header timeouts.
    let body = r#"{"model":"","messages":[{"role":"user","content":"Tell a long story."}],"max_tokens":300,"temperature":0,"stream":true}"#;
    let started = Instant::now();
    let mut s = request(&server.addr, "POST /v1/chat/completions", body);
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    assert!(all.starts_with("HTTP/1.1 200"), "{all}");
    assert!(all.contains("data: [DONE]"), "the stream was cut off: {all}");
    println!("stream of up to 300 tokens took {:?} under a 1 s header timeout", started.elapsed());
}

/// A model file truncated under a running server — what `cp new.gguf served.gguf` does
/// first — while it streams: the process lives (a read past the new end would be SIGBUS),
/// the stream ends with an error instead of tokens computed from the wrong bytes, the node
/// says it is degraded and why, and every later request gets that reason (503).
#[test]
fn a_model_file_truncated_while_served_is_an_error_not_a_crash() {
    let dir = std::env::temp_dir().join(format!("hearth-truncated-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("served.gguf");
    std::fs::copy(common::default_model(), &model).unwrap();
    let len = std::fs::metadata(&model).unwrap().len();
    let mut server = Served::start_model(&model, &["--threads", "1", "--ctx-size", "2048", "--parallel", "1"]);
    // Long and greedy, end-of-text banned: it streams until the file changes.
    let body = r#"{"model":"","prompt":"Once upon a time","max_tokens":1500,"temperature":0,"stream":true,"logit_bias":{"0":-100,"2":-100}}"#;
    let mut s = request(&server.addr, "POST /v1/completions", body);
    let mut first = [0u8; 2048];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&first[..n]));
    std::fs::OpenOptions::new().write(true).open(&model).unwrap().set_len(len / 3).unwrap();
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert!(server.child.try_wait().unwrap().is_none(), "hearth died: {rest}");
    assert!(rest.contains("\"error\"") && rest.contains("served.gguf"), "the stream did not end with the reason: {}", &rest[rest.len().saturating_sub(600)..]);
    let health = http(&server.addr, "GET", "/health", "", "").unwrap();
    assert!(health.body.contains("degraded") && health.body.contains("restart"), "{}", health.body);
    let after = http(&server.addr, "POST", "/v1/completions", "", r#"{"model":"","prompt":"Hi","max_tokens":4}"#).unwrap();
    assert_eq!(after.status, 503, "{}", after.body);
    assert!(after.body.contains("served.gguf"), "{}", after.body);
    server.terminate();
    let status = server.child.wait().unwrap();
    assert!(status.success(), "hearth exited with {status} after the file changed");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Opens a console stream (`GET /console/state` as server-sent events) and reads up to the
/// end of the answer's head: the connection, and what came so far (empty if it was closed).
fn console_stream(addr: &str) -> (TcpStream, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET /console/state HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    (s, String::from_utf8_lossy(&got).into_owned())
}

/// Console streams never end by themselves: more of them than --max-connections all get
/// their stream, and API clients are still served, because the streams are capped apart
/// and leave the API's count (before, the fifth stream was closed unanswered, and so was
/// every API client after it).
#[test]
fn console_streams_do_not_take_the_api_connections() {
    const CAP: usize = 4;
    let server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--max-connections", "4"]);
    let mut streams = Vec::new();
    for i in 0..CAP + 2 {
        let (s, head) = console_stream(&server.addr);
        assert!(head.starts_with("HTTP/1.1 200"), "console stream {i} beside {} others: {head:?}", streams.len());
        streams.push(s);
    }
    let models = http(&server.addr, "GET", "/v1/models", "", "").unwrap();
    assert_eq!(models.status, 200, "{}", models.body);
    let body = r#"{"model":"","messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"temperature":0}"#;
    let chat = http(&server.addr, "POST", "/v1/chat/completions", "", body).unwrap();
    assert_eq!(chat.status, 200, "{}", chat.body);
    let metrics = http(&server.addr, "GET", "/metrics", "", "").unwrap().body;
    assert!(gauge(&metrics, "hearth_http_connections") <= CAP as f64, "{metrics}");
    drop(streams);
}

/// Past --max-console-streams a new stream gets 503 with Retry-After (the console retries
/// by itself), API clients are still served, and a stream whose client left frees its slot.
#[test]
fn console_streams_past_their_cap_get_503_and_the_api_is_served() {
    let server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--max-connections", "4", "--max-console-streams", "2"]);
    let (first, head) = console_stream(&server.addr);
    assert!(head.starts_with("HTTP/1.1 200"), "{head:?}");
    let (second, head) = console_stream(&server.addr);
    assert!(head.starts_with("HTTP/1.1 200"), "{head:?}");
    let refused = http(&server.addr, "GET", "/console/state", "Accept: text/event-stream\r\n", "").unwrap();
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(refused.headers.contains("retry-after:"), "{}", refused.headers);
    assert!(refused.body.contains("too_many_streams") && refused.body.contains("--max-console-streams"), "{}", refused.body);
    for _ in 0..3 {
        let models = http(&server.addr, "GET", "/v1/models", "", "").unwrap();
        assert_eq!(models.status, 200, "{}", models.body);
    }
    drop(first);
    // The server sees the client gone at the stream's next write (a new snapshot, or the
    // keep-alive comment at the latest).
    let third = wait_for("a stream's slot freed", Duration::from_secs(90), || {
        let (s, head) = console_stream(&server.addr);
        head.starts_with("HTTP/1.1 200").then_some(s)
    });
    drop((second, third));
}

/// A console stream never ends by itself: on SIGTERM the server closes it and exits (a
/// graceful end waits for responses to finish, and this one never would).
#[test]
fn sigterm_closes_console_streams_and_exits() {
    let mut server = Served::start(&["--threads", "1", "--ctx-size", "512", "--parallel", "1"]);
    let (mut s, head) = console_stream(&server.addr);
    assert!(head.starts_with("HTTP/1.1 200"), "{head:?}");
    server.terminate();
    // The exit first: the stream's keep-alive comments would keep a read waiting for ever.
    let status = wait_for("hearth exits with a console stream open", Duration::from_secs(60), || server.child.try_wait().unwrap());
    assert!(status.success(), "hearth exited with {status}");
    read_until_closed(&mut s, Duration::from_secs(60));
}

/// Sends one raw request (its head lines given, `Connection: close` added) and reads the
/// whole answer.
fn exchange(addr: &str, head: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    read_until_closed(&mut s, Duration::from_secs(60))
}

/// The web guard through the real flags and environment: a foreign Host is refused and an
/// allowed name served, a `text/plain` body is refused with 415 and runs nothing, and only
/// the configured origins get a CORS grant.
#[test]
fn allowed_hosts_and_cors_origins_from_the_flags_and_the_environment() {
    let origins = std::ffi::OsString::from("http://app.example,http://localhost:3000");
    let server = Served::start_model_env(&common::default_model(), &["--threads", "1", "--ctx-size", "512", "--parallel", "1", "--allowed-hosts", "hearth.local"], &[("HEARTH_CORS_ORIGINS", &origins)]);
    let addr = &server.addr;
    let port = addr.rsplit(':').next().unwrap();
    let got = exchange(addr, &format!("GET /v1/models HTTP/1.1\r\nHost: evil.example:{port}"), "");
    assert!(got.starts_with("HTTP/1.1 403") && got.contains("host_not_allowed"), "{got}");
    let got = exchange(addr, &format!("GET /metrics HTTP/1.1\r\nHost: evil.example:{port}"), "");
    assert!(got.starts_with("HTTP/1.1 403"), "{got}");
    let got = exchange(addr, &format!("GET /v1/models HTTP/1.1\r\nHost: hearth.local:{port}"), "");
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let body = r#"{"model":"","messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#;
    let got = exchange(addr, &format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: text/plain"), body);
    assert!(got.starts_with("HTTP/1.1 415") && got.contains("unsupported_media_type"), "{got}");
    let got = exchange(addr, &format!("POST /api/generate HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded"), r#"{"model":"","prompt":"Hi"}"#);
    assert!(got.starts_with("HTTP/1.1 415"), "{got}");
    let metrics = http(addr, "GET", "/metrics", "", "").unwrap().body;
    assert_eq!(gauge(&metrics, "hearth_generated_tokens_total").max(0.0), 0.0, "a refused request generated: {metrics}");
    let got = exchange(addr, &format!("GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://localhost:3000"), "");
    assert!(got.contains("access-control-allow-origin: http://localhost:3000"), "{got}");
    let got = exchange(addr, &format!("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://app.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type"), "");
    assert!(got.starts_with("HTTP/1.1 200") && got.contains("access-control-allow-origin: http://app.example"), "{got}");
    let got = exchange(addr, &format!("GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://evil.example"), "");
    assert!(!got.contains("access-control-allow-origin"), "{got}");
}

/// Started as a new user starts it (no `--ctx-size`), the head sizes the context to the
/// memory up to the model's own, says so, and a first chat the size Codex's or Open
/// WebUI's (~6k tokens: a system prompt and tools) is answered, where the old fixed
/// 4,096-token default refused it. The "too long" refusal past it reads alike in every API.
#[test]
fn the_default_context_holds_a_clients_first_prompt_and_too_long_reads_alike() {
    let server = Served::start(&["--threads", "2", "--parallel", "1"]);
    // The default model was trained for 8,192 tokens; a machine that runs these tests
    // has far more than the 0.2 GiB its cache takes.
    server.wait_logged("the context said at start", Duration::from_secs(5), |l| l.contains("context per sequence: 8192 tokens (the model's own context"));
    let models: serde_json::Value = serde_json::from_str(&http(&server.addr, "GET", "/v1/models", "", "").unwrap().body).unwrap();
    assert_eq!(models["data"][0]["context_length"], 8192, "{models}");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let system: String = text.chars().take(15_000).collect();
    let body = serde_json::json!({"model": "", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}).to_string();
    let r = http(&server.addr, "POST", "/v1/chat/completions", "", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    eprintln!("a first prompt of {prompt} tokens");
    assert!(prompt > 4096, "a first prompt past the old default: {prompt} tokens");
    // Past the context: the same words and numbers in the OpenAI, Anthropic and Ollama envelopes.
    let long: String = text.chars().cycle().take(60_000).collect();
    let openai = http(&server.addr, "POST", "/v1/chat/completions", "", &serde_json::json!({"model": "", "messages": [{"role": "user", "content": long}]}).to_string()).unwrap();
    let anthropic = http(&server.addr, "POST", "/v1/messages", "", &serde_json::json!({"model": "claude-opus-4-5", "max_tokens": 8, "messages": [{"role": "user", "content": long}]}).to_string()).unwrap();
    let ollama = http(&server.addr, "POST", "/api/chat", "", &serde_json::json!({"model": "", "stream": false, "messages": [{"role": "user", "content": long}]}).to_string()).unwrap();
    let message = |r: &common::Response, pointer: &str| -> String {
        assert_eq!(r.status, 400, "{}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        v.pointer(pointer).and_then(|m| m.as_str()).unwrap_or_else(|| panic!("{}", r.body)).to_string()
    };
    for m in [message(&openai, "/error/message"), message(&anthropic, "/error/message"), message(&ollama, "/error")] {
        // Claude Code compacts on Anthropic's wording; OpenAI clients match theirs. Only
        // the prompt's count may differ (each API's own turn framing).
        let (head, rest) = m.split_once(" tokens > ").unwrap_or_else(|| panic!("{m}"));
        let counted: u64 = head.strip_prefix("prompt is too long: ").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{m}"));
        assert!(counted > 8191, "{m}");
        assert_eq!(rest, "8191 maximum; this model's maximum context length is 8192 tokens (hearth serve --ctx-size)");
    }
    let v: serde_json::Value = serde_json::from_str(&openai.body).unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
}

/// Under a memory limit (a container's, a small device's: here a cgroup of 2 GiB), the
/// default context is the largest whose cache fits beside the model and what the server
/// keeps for itself, not the model's own 8,192 tokens; said at start, served as said.
#[test]
fn under_a_memory_limit_the_default_context_is_what_the_memory_holds() {
    const LIMIT: u64 = 2 << 30;
    let (server, _cgroup) = match Served::start_in_memory_limit(LIMIT, &["--threads", "1", "--parallel", "4"]) {
        Ok(s) => s,
        Err(e) => {
            assert!(std::env::var("HEARTH_REQUIRE_CGROUPS").as_deref() != Ok("1"), "a memory cgroup is required here: {e}");
            eprintln!("skipped: {e}");
            return;
        }
    };
    let models: serde_json::Value = serde_json::from_str(&http(&server.addr, "GET", "/v1/models", "", "").unwrap().body).unwrap();
    let ctx = models["data"][0]["context_length"].as_u64().unwrap();
    // 2 GiB less 1 GiB spare, the prompt cache's eighth, the weights and the compute
    // buffer leave room for 4 sequences of a few thousand cells (23 KiB each).
    eprintln!("context per sequence under a 2 GiB limit: {ctx}");
    assert!((4096..8192).contains(&ctx) && ctx % 256 == 0, "context {ctx}");
    server.wait_logged("the bound said at start", Duration::from_secs(5), |l| l.contains(&format!("context per sequence: {ctx} tokens (the largest the memory holds")));
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let body = serde_json::json!({"model": "", "messages": [{"role": "user", "content": text.chars().take(4000).collect::<String>()}], "max_tokens": 4, "temperature": 0}).to_string();
    let r = http(&server.addr, "POST", "/v1/chat/completions", "", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
}
