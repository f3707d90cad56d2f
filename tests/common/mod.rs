//! Shared by the system tests: the default model, `hearth serve` started
//! as a child process on a free port, a plain HTTP/1.1 client and polling.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn default_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    hearth::models::ensure_default_model(&dir).expect("fetch the default model")
}

/// A running `hearth serve`; killed if the test fails before stopping it.
pub struct Served {
    pub child: Child,
    /// host:port
    pub addr: String,
    /// What it logged after starting (the first MiB).
    pub log: Arc<Mutex<String>>,
    /// Lines it logged after starting, all of them counted.
    pub log_lines: Arc<AtomicUsize>,
}

impl Served {
    /// Starts `hearth serve --port 0 ARGS --model <default>` and waits for its address.
    pub fn start(args: &[&str]) -> Served {
        Served::spawn(&["serve", "--port", "0"], args, &default_model(), "listening on http://").unwrap_or_else(|log| panic!("hearth serve exited before listening:\n{log}"))
    }

    /// Starts `hearth serve --port 0 ARGS --model MODEL`.
    pub fn start_model(model: &std::path::Path, args: &[&str]) -> Served {
        Served::start_model_env(model, args, &[])
    }

    /// [`Served::start_model`] with extra environment variables.
    pub fn start_model_env(model: &std::path::Path, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Served {
        Served::spawn_env(&["serve", "--port", "0"], args, model, "listening on http://", env).unwrap_or_else(|log| panic!("hearth serve exited before listening:\n{log}"))
    }

    /// `hearth worker --listen 127.0.0.1:0 ARGS --model MODEL` with extra environment variables.
    pub fn worker_env(model: &std::path::Path, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Served {
        Served::spawn_env(&["worker", "--listen", "127.0.0.1:0"], args, model, "worker listening on ", env).unwrap_or_else(|log| panic!("hearth worker exited before listening:\n{log}"))
    }

    /// Starts `hearth worker --listen 127.0.0.1:0 ARGS --model <default>`.
    pub fn worker(args: &[&str]) -> Served {
        Served::worker_at("127.0.0.1:0", &default_model(), args).unwrap_or_else(|log| panic!("hearth worker exited before listening:\n{log}"))
    }

    /// Starts `hearth worker --listen LISTEN ARGS --model MODEL`; the log if it fails.
    pub fn worker_at(listen: &str, model: &std::path::Path, args: &[&str]) -> Result<Served, String> {
        Served::spawn(&["worker", "--listen", listen], args, model, "worker listening on ")
    }

    /// `hearth worker --listen 127.0.0.1:0 ARGS` without a model: it fetches the windows
    /// its head gives it from the head (into `--model-dir`, which ARGS should set).
    pub fn worker_fetching(args: &[&str]) -> Served {
        Served::spawn_in(Command::new(env!("CARGO_BIN_EXE_hearth-under-test")), &["worker", "--listen", "127.0.0.1:0"], args, None, "worker listening on ", &[]).unwrap_or_else(|log| panic!("hearth worker exited before listening:\n{log}"))
    }

    /// Like `start`, but returns the server's log if it exits instead of listening.
    pub fn try_start(args: &[&str]) -> Result<Served, String> {
        Served::spawn(&["serve", "--port", "0"], args, &default_model(), "listening on http://")
    }

    fn spawn(role: &[&str], args: &[&str], model: &std::path::Path, marker: &str) -> Result<Served, String> {
        Served::spawn_env(role, args, model, marker, &[])
    }

    fn spawn_env(role: &[&str], args: &[&str], model: &std::path::Path, marker: &str, env: &[(&str, &std::ffi::OsStr)]) -> Result<Served, String> {
        Served::spawn_in(Command::new(env!("CARGO_BIN_EXE_hearth-under-test")), role, args, Some(model), marker, env)
    }

    /// `hearth serve --port 0 ARGS` on the default model in a memory cgroup of its own
    /// limited to `limit` bytes (what a container or a small device gives it), or why
    /// none could be made (not root, no cgroup v1 memory controller).
    pub fn start_in_memory_limit(limit: u64, args: &[&str]) -> Result<(Served, MemoryCgroup), String> {
        let cgroup = MemoryCgroup::new(limit)?;
        let mut cmd = Command::new("sh");
        // The shell joins the cgroup, then becomes the server (which stays in it).
        cmd.args(["-c", "echo $$ > \"$0\" && exec \"$@\""]).arg(cgroup.dir.join("cgroup.procs")).arg(env!("CARGO_BIN_EXE_hearth-under-test"));
        let served = Served::spawn_in(cmd, &["serve", "--port", "0"], args, Some(&default_model()), "listening on http://", &[]).map_err(|log| format!("hearth serve exited before listening:\n{log}"))?;
        Ok((served, cgroup))
    }

    /// `hearth ROLE ARGS --model MODEL` in the network namespace `ns` (see [`netns`]),
    /// waiting for `marker` in its log.
    pub fn spawn_in_netns(ns: &str, role: &[&str], args: &[&str], model: &std::path::Path, marker: &str, env: &[(&str, &std::ffi::OsStr)]) -> Result<Served, String> {
        Served::spawn_in_netns_with(ns, role, args, Some(model), marker, env)
    }

    /// [`Served::spawn_in_netns`]; `None`: without `--model` (a worker that fetches the
    /// head's model).
    pub fn spawn_in_netns_with(ns: &str, role: &[&str], args: &[&str], model: Option<&std::path::Path>, marker: &str, env: &[(&str, &std::ffi::OsStr)]) -> Result<Served, String> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_hearth-under-test")]);
        Served::spawn_in(cmd, role, args, model, marker, env)
    }

    fn spawn_in(mut cmd: Command, role: &[&str], args: &[&str], model: Option<&std::path::Path>, marker: &str, env: &[(&str, &std::ffi::OsStr)]) -> Result<Served, String> {
        cmd.args(role).args(args);
        if let Some(model) = model {
            cmd.arg("--model").arg(model);
        }
        let mut child = cmd
            // Tests run side by side with the same secrets: a head announcing itself on the
            // machine's network would gather other tests' workers (and that traffic must stay
            // inside what a test made). Discovery's own test turns it on in namespaces.
            .env("HEARTH_NO_DISCOVERY", "true")
            // Nor does one read the blocks others computed: each keeps its prompt cache in
            // RAM only, unless its test gives it a directory.
            .env("HEARTH_PROMPT_CACHE_SIZE", "0")
            .envs(env.iter().copied())
            .env("HEARTH_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut log = String::new();
        let addr = loop {
            let Some(line) = lines.next() else {
                let _ = child.wait();
                return Err(log);
            };
            let line = line.unwrap();
            if let Some(rest) = line.split(marker).nth(1) {
                break rest.trim().to_string();
            }
            log.push_str(&line);
            log.push('\n');
        };
        // Keep draining the log so the process never blocks on a full pipe; what it says
        // is kept for the test (the first MiB of it, what it said while starting too),
        // every line after starting counted.
        let kept = Arc::new(Mutex::new(log));
        let counted = Arc::new(AtomicUsize::new(0));
        let (k, c) = (kept.clone(), counted.clone());
        std::thread::spawn(move || {
            const KEPT_BYTES: usize = 1 << 20;
            for line in lines.map_while(Result::ok) {
                c.fetch_add(1, Ordering::Relaxed);
                let mut k = k.lock().unwrap_or_else(|e| e.into_inner());
                if k.len() + line.len() < KEPT_BYTES {
                    k.push_str(&line);
                    k.push('\n');
                }
            }
        });
        Ok(Served { child, addr, log: kept, log_lines: counted })
    }

    /// Waits until a line of the process's log satisfies `wanted`, and fails the test with
    /// the whole log if none does within `limit`. The log is read by another thread, so a
    /// line the process wrote before an answer the test just got may not be here yet: a test
    /// that checks the log reads it through this, never once.
    pub fn wait_logged(&self, what: &str, limit: Duration, wanted: impl Fn(&str) -> bool) {
        let start = Instant::now();
        loop {
            let log = self.log.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if log.lines().any(&wanted) {
                return;
            }
            assert!(start.elapsed() < limit, "{what}: not logged within {limit:?}:\n{log}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends SIGTERM (a user's Ctrl-C or `docker stop`).
    pub fn terminate(&self) {
        self.signal(SIGTERM);
    }

    /// Sends a signal (SIGSTOP freezes the process: a stalled device).
    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child.
        assert_eq!(unsafe { kill(self.child.id() as i32, sig) }, 0);
    }
}

/// A cgroup v1 memory cgroup made for one test, removed when dropped (after the processes
/// in it: drop their `Served` first).
pub struct MemoryCgroup {
    pub dir: PathBuf,
}

impl MemoryCgroup {
    pub fn new(limit: u64) -> Result<MemoryCgroup, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = PathBuf::from(format!("/sys/fs/cgroup/memory/hearth-test-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        let cgroup = MemoryCgroup { dir };
        std::fs::write(cgroup.dir.join("memory.limit_in_bytes"), limit.to_string()).map_err(|e| format!("cannot limit {}: {e}", cgroup.dir.display()))?;
        Ok(cgroup)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP answer: status, the header block lower-cased, body.
pub struct Response {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

/// One HTTP/1.1 request on a connection of its own. `headers`: extra header lines, each
/// ending in `\r\n`. Err when the connection fails (a server not up yet) or the answer is
/// not HTTP.
pub fn http(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> Result<Response, String> {
    http_within(addr, method, path, headers, body, HTTP_READ_TIMEOUT)
}

/// How long `http` waits for a whole answer: a stalled server fails the test instead of
/// hanging it. Long non-streamed answers (a 2,000-token prompt through a ring of 1-thread
/// members) take minutes on a host slowed to half a core.
const HTTP_READ_TIMEOUT: Duration = Duration::from_secs(600);

/// [`http`] with its own read timeout (a slow device answering a long request).
pub fn http_within(addr: &str, method: &str, path: &str, headers: &str, body: &str, read_timeout: Duration) -> Result<Response, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(read_timeout)).map_err(|e| e.to_string())?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).map_err(|e| e.to_string())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
    let (head, body) = resp.split_once("\r\n\r\n").ok_or_else(|| format!("not an HTTP response: {resp:?}"))?;
    let status = head.get(9..12).and_then(|c| c.parse().ok()).ok_or_else(|| format!("not an HTTP response: {resp:?}"))?;
    Ok(Response { status, headers: head.to_ascii_lowercase(), body: body.to_string() })
}

/// The text of a chat completion's 200 answer: the message's content, or a stream's
/// deltas joined.
pub fn chat_content(body: &str, stream: bool) -> String {
    use serde_json::Value;
    if !stream {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        return v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    }
    body.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect()
}

/// A greedy completion (24 tokens) of a prompt of real text over 1,000 tokens (prefilled
/// in several chunks, so sliding windows start past the first 256 cells).
pub fn complete_long(addr: &str) -> String {
    let v = complete_real_text(addr, 5000, 24);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 1000, "{}", v["usage"]);
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// A greedy completion of `max_tokens` of the first `chars` characters of real text
/// (docs/scheduler.md): the whole response.
pub fn complete_real_text(addr: &str, chars: usize, max_tokens: usize) -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let prompt: String = text.chars().take(chars).collect();
    let body = serde_json::json!({"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
    let r = http(addr, "POST", "/v1/completions", "", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// Polls `check` until it gives a value; panics naming `what` after `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A loopback port free now (for a process that must be told its port up front).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

pub const SIGTERM: i32 = 15;
pub const SIGSTOP: i32 = 19;
pub const SIGCONT: i32 = 18;

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// Network namespaces for tests of what a LAN carries (multicast, broadcast) that loopback
/// does not: each test makes its own and removes them, so its traffic stays inside.
pub mod netns {
    use std::process::Command;

    /// Linux's `CLONE_NEWNET`, for setns(2).
    const CLONE_NEWNET: i32 = 0x4000_0000;

    extern "C" {
        fn setns(fd: i32, nstype: i32) -> i32;
    }

    fn ip(args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// Whether this machine lets the test make namespaces (root and iproute2).
    pub fn available() -> Result<(), String> {
        static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let probe = format!("hearth-probe-{}-{}", std::process::id(), PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        ip(&["netns", "add", &probe])?;
        ip(&["netns", "del", &probe])
    }

    /// Two namespaces joined by a veth pair, as two devices on one LAN segment: `a` at
    /// `10.<x>.<y>.1/24`, `b` at `.2`, loopback up in both, multicast routed onto the link.
    pub struct Lan {
        pub a: String,
        pub b: String,
        pub a_ip: String,
        pub b_ip: String,
        /// `a`'s end of the link.
        pub a_dev: String,
    }

    impl Lan {
        pub fn new(tag: &str) -> Result<Lan, String> {
            let id = std::process::id();
            let (a, b) = (format!("hearth-{tag}-a-{id}"), format!("hearth-{tag}-b-{id}"));
            // Interface names are at most 15 bytes.
            let t = tag.chars().next().unwrap_or('x');
            let (va, vb) = (format!("hv{t}a{}", id % 1_000_000), format!("hv{t}b{}", id % 1_000_000));
            let net = format!("10.{}.{}", 100 + (id / 256) % 100, id % 256);
            let lan = Lan { a, b, a_ip: format!("{net}.1"), b_ip: format!("{net}.2"), a_dev: va.clone() };
            ip(&["netns", "add", &lan.a])?;
            ip(&["netns", "add", &lan.b])?;
            ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
            for (ns, dev, addr) in [(&lan.a, &va, &lan.a_ip), (&lan.b, &vb, &lan.b_ip)] {
                ip(&["link", "set", dev, "netns", ns])?;
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "broadcast", &format!("{net}.255"), "dev", dev])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
                ip(&["-n", ns, "route", "add", "224.0.0.0/4", "dev", dev])?;
            }
            Ok(lan)
        }
    }

    impl Lan {
        /// Gives `a`'s end of the link another address, `.<host>` of the LAN: a second
        /// device on `a`'s side (a stranger), without a namespace of its own.
        pub fn add_address_on_a(&self, host: u8) -> Result<String, String> {
            let net = self.a_ip.rsplit_once('.').map_or("", |(n, _)| n);
            let addr = format!("{net}.{host}");
            ip(&["-n", &self.a, "addr", "add", &format!("{addr}/24"), "dev", &self.a_dev])?;
            Ok(addr)
        }

        /// Limits what `a` sends to `b` to `rate` (tc's token bucket, e.g. `16mbit`): a
        /// slow link from the head to a device.
        pub fn throttle_a_to_b(&self, rate: &str) -> Result<(), String> {
            let out = Command::new("tc").args(["-n", &self.a, "qdisc", "add", "dev", &self.a_dev, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "500ms"]).output().map_err(|e| format!("tc: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!("tc: {}", String::from_utf8_lossy(&out.stderr).trim()))
            }
        }
    }

    impl Drop for Lan {
        fn drop(&mut self) {
            // Deleting a namespace deletes its end of the veth pair, and with it the other.
            let _ = ip(&["netns", "del", &self.a]);
            let _ = ip(&["netns", "del", &self.b]);
        }
    }

    /// Runs `f` on a thread inside namespace `ns` (its sockets are that namespace's).
    pub fn run_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let file = std::fs::File::open(format!("/var/run/netns/{ns}")).unwrap_or_else(|e| panic!("namespace {ns}: {e}"));
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns(2) on an open namespace file, for this thread only.
            assert_eq!(unsafe { setns(file.as_raw_fd(), CLONE_NEWNET) }, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap()
    }
}

/// A tiny random embedding model of `arch` (`bert`, `nomic-bert`, or `qwen3` with
/// last-token pooling), written once per process.
pub fn tiny_embedding_model(arch: &str) -> PathBuf {
    engine::random_model::RandomModel::tiny_embedder_file(arch, &default_model()).unwrap()
}

/// A model served with its family's own chat template (`template`, a file in `testdata/`):
/// a request that requires a tool call gets one, parsed into `tool_calls` with arguments
/// that follow the function's schema, streamed as a delta too; the call and its result go
/// back in and the model answers in text or reasoning, with no call. What a user bringing
/// a 2026 family with tools meets first. Random weights: the call is the grammar's, the
/// parsing and the template's rendering of calls and results are the family's.
pub fn own_template_makes_a_required_tool_call_and_takes_its_result(model: &std::path::Path, template: &str, extra: &[&str]) {
    use serde_json::{json, Value};
    let post = |addr: &str, body: &Value| -> Value {
        let r = http(addr, "POST", "/v1/chat/completions", "", &body.to_string()).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).unwrap()
    };
    let node = Served::start_model(model, &[&["--threads", "1", "--chat-template", template][..], extra].concat());
    // An enum: a random model given a free string never ends it.
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}}, "required": ["city"]}}}]);
    let ask = json!([{"role": "user", "content": "What is the weather in Oslo?"}]);
    let v = post(&node.addr, &json!({"model": "", "messages": ask, "tools": tools, "tool_choice": "required", "max_tokens": 200, "temperature": 0}));
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{template}: {v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{template}: {v}");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"] == "Oslo" || args["city"] == "Bergen", "{template}: {args}");
    let r = http(&node.addr, "POST", "/v1/chat/completions", "", &json!({"model": "", "messages": ask, "tools": tools, "tool_choice": "required", "max_tokens": 200, "temperature": 0, "stream": true}).to_string()).unwrap();
    assert!(r.body.contains("\"tool_calls\"") && r.body.contains("get_weather"), "{template}: {}", r.body);
    let messages = json!([
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}
    ]);
    let v = post(&node.addr, &json!({"model": "", "messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 24, "temperature": 0}));
    let m = &v["choices"][0]["message"];
    assert!(m.get("tool_calls").is_none_or(|t| t.is_null()), "{template}: {v}");
    // A random model may spend its tokens in the thinking a template opened: text or
    // reasoning, but something, and no call.
    let said = m["content"].as_str().unwrap_or("").len() + m["reasoning_content"].as_str().unwrap_or("").len();
    assert!(said > 0, "{template}: {v}");
}
