//! The web console in a real browser: headless Chromium driven through chromedriver's
//! WebDriver API (plain HTTP, the tests' own client), against a live ring of a head and two
//! workers. The page must load without a console error, ask for the API key, show the three
//! devices with their windows, show a worker killed with `kill -9` as lost and then back,
//! stream a chat answer equal to the API's greedy answer, refuse a re-plan without the
//! admin key and run it with the key, and keep its layout at a phone's width and a
//! desktop's (screenshots written for a person to look at).
//!
//! Skips with a message when Chromium or chromedriver is missing (Debian's `chromium` and
//! `chromium-driver`), unless `HEARTH_REQUIRE_BROWSER=1` (CI installs them).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{http, wait_for, Served};
use serde_json::{json, Value};

const KEY: &str = "console-key";
const ADMIN: &str = "console-admin";
/// WebDriver's keys: Control (held until RELEASE), Enter, and the release of every held key.
const CONTROL: char = '\u{E009}';
const ENTER: char = '\u{E007}';
const RELEASE: char = '\u{E000}';
/// The element reference key of the WebDriver protocol.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
const PROMPT: &str = "Name three things a home server is good for.";
const MAX_TOKENS: usize = 24;

struct Browser {
    driver: Child,
    addr: String,
    session: String,
}

/// One request to chromedriver, whose answers end at their Content-Length (it keeps the
/// connection open after `Connection: close`): `(status, body)`.
fn webdriver(addr: &str, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(120))).map_err(|e| e.to_string())?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    let status = line.get(9..12).and_then(|c| c.parse().ok()).ok_or_else(|| format!("not HTTP: {line:?}"))?;
    let mut length = 0;
    loop {
        line.clear();
        r.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().map_err(|e| format!("{e}: {line:?}"))?;
            }
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).map_err(|e| e.to_string())?;
    String::from_utf8(body).map(|b| (status, b)).map_err(|e| e.to_string())
}

impl Browser {
    fn start() -> Option<Browser> {
        let chromium = ["chromium", "chromium-browser", "google-chrome"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()));
        let driver_ok = Command::new("chromedriver").arg("--version").output().is_ok_and(|o| o.status.success());
        let (Some(chromium), true) = (chromium, driver_ok) else {
            assert!(std::env::var_os("HEARTH_REQUIRE_BROWSER").is_none(), "HEARTH_REQUIRE_BROWSER is set but chromium or chromedriver is missing");
            eprintln!("SKIPPED: chromium and chromedriver are needed (apt-get install chromium chromium-driver)");
            return None;
        };
        let port = common::free_port();
        let driver = Command::new("chromedriver").arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start chromedriver");
        let addr = format!("127.0.0.1:{port}");
        wait_for("chromedriver to listen", Duration::from_secs(30), || webdriver(&addr, "GET", "/status", "").ok().filter(|r| r.0 == 200).map(|_| ()));
        let binary = String::from_utf8(Command::new("sh").args(["-c", &format!("command -v {chromium}")]).output().unwrap().stdout).unwrap().trim().to_string();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": binary, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,1000"]},
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let (_, body) = webdriver(&addr, "POST", "/session", &caps.to_string()).expect("new session");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        let session = v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {body}")).to_string();
        Some(Browser { driver, addr, session })
    }

    fn call(&self, method: &str, path: &str, body: Value) -> Value {
        let body = if body.is_null() { String::new() } else { body.to_string() };
        let (status, answer) = webdriver(&self.addr, method, &format!("/session/{}{path}", self.session), &body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let v: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{method} {path}: {e}: {answer}"));
        assert_eq!(status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    fn open(&self, url: &str) {
        self.call("POST", "/url", json!({"url": url}));
    }

    fn js(&self, script: &str) -> Value {
        self.call("POST", "/execute/sync", json!({"script": script, "args": []}))
    }

    fn element(&self, css: &str) -> String {
        let v = self.call("POST", "/element", json!({"using": "css selector", "value": css}));
        v[ELEMENT].as_str().unwrap().to_string()
    }

    fn click(&self, css: &str) {
        let e = self.element(css);
        self.call("POST", &format!("/element/{e}/click"), json!({}));
    }

    fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css);
        self.call("POST", &format!("/element/{e}/clear"), json!({}));
        self.call("POST", &format!("/element/{e}/value"), json!({"text": text}));
    }

    fn text(&self, css: &str) -> String {
        let css = serde_json::to_string(css).unwrap();
        self.js(&format!("const e = document.querySelector({css}); return e ? e.textContent : null;")).as_str().unwrap_or_default().to_string()
    }

    /// Polls a script until it returns something other than null/false.
    fn wait(&self, what: &str, limit: Duration, script: &str) -> Value {
        wait_for(what, limit, || Some(self.js(script)).filter(|v| !v.is_null() && v != &Value::Bool(false)))
    }

    /// The browser's console messages at warning level or worse since the last call.
    fn console_errors(&self) -> Vec<String> {
        let (status, body) = webdriver(&self.addr, "POST", &format!("/session/{}/se/log", self.session), &json!({"type": "browser"}).to_string()).unwrap();
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(status, 200, "the browser's log: {v}");
        v["value"].as_array().unwrap().iter().filter(|m| m["level"] == "SEVERE" || m["level"] == "WARNING").map(|m| m["message"].to_string()).collect()
    }

    fn screenshot(&self, width: u32, height: u32, name: &str) -> std::path::PathBuf {
        self.call("POST", "/window/rect", json!({"width": width, "height": height}));
        self.js("window.scrollTo(0, 0);");
        std::thread::sleep(Duration::from_millis(500));
        // The layout holds: nothing wider than the window (tables scroll inside their box).
        let overflow = self.js("return document.documentElement.scrollWidth - document.documentElement.clientWidth;");
        assert!(overflow.as_i64().unwrap() <= 0, "the page is wider than a {width}-px window by {overflow} px");
        let png = decode_base64(self.call("GET", "/screenshot", Value::Null).as_str().unwrap());
        let dir = std::env::var_os("HEARTH_CONSOLE_SCREENSHOTS").map(std::path::PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("hearth-console-screenshots"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, png).unwrap();
        eprintln!("screenshot at {width} px: {}", path.display());
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = webdriver(&self.addr, "DELETE", &format!("/session/{}", self.session), "");
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn decode_base64(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for v in s.bytes().filter_map(value) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// The API's own greedy answer to the console's request, and its generated tokens.
fn greedy_answer(addr: &str) -> (String, u64) {
    let body = json!({"model": "", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": MAX_TOKENS}).to_string();
    let r = http(addr, "POST", "/v1/chat/completions", &format!("Authorization: Bearer {KEY}\r\n"), &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    (common::chat_content(&r.body, false), v["usage"]["completion_tokens"].as_u64().unwrap())
}

fn rows(b: &Browser) -> Value {
    b.js("return [...document.querySelectorAll('#devices tbody tr')].map(r => [r.dataset.device, r.cells[0].textContent, r.cells[1].textContent, r.cells[2].textContent]);")
}

#[test]
fn the_console_shows_a_live_ring_chats_and_guards_the_admin_key_in_a_real_browser() {
    let Some(browser) = Browser::start() else { return };
    let w1 = Served::worker(&["--threads", "1"]);
    let mut w2 = Served::worker(&["--threads", "1"]);
    let w2_addr = w2.addr.clone();
    let workers = format!("{},{}", w1.addr, w2.addr);
    // The models folder is the default model's: the console lists it as served.
    let model = common::default_model();
    let folder = model.parent().unwrap().as_os_str().to_owned();
    let head = Served::start_model_env(&model, &["--threads", "1", "--parallel", "2", "--workers", &workers, "--plan-strategy", "even", "--api-key", KEY, "--admin-key", ADMIN], &[("HEARTH_MODELS_DIR", &folder)]);
    let (expected, generated) = greedy_answer(&head.addr);

    // The page is served without a key and asks for it; its data needs the key.
    let page = http(&head.addr, "GET", "/", "", "").unwrap();
    assert_eq!(page.status, 200);
    assert!(page.headers.contains("content-type: text/html"), "{}", page.headers);
    assert!(page.headers.contains("content-security-policy: default-src 'none'"), "{}", page.headers);
    assert!(!page.headers.contains("access-control-allow-origin"), "no other origin may read the console's answers: {}", page.headers);
    assert_eq!(http(&head.addr, "GET", "/console/state", "", "").unwrap().status, 401);
    browser.open(&format!("http://{}/", head.addr));
    browser.wait("the page to ask for the API key", Duration::from_secs(20), "return !document.getElementById('key-form').hidden;");
    browser.type_into("#api-key", KEY);
    browser.click("#key-form button");

    // Three devices, the head first, each with its windows (even: 10 layers each).
    let shown = browser.wait("three devices", Duration::from_secs(30), "const r = document.querySelectorAll('#devices tbody tr'); return r.length === 3 && r;");
    assert!(!shown.is_null());
    let table = rows(&browser);
    let names: Vec<&str> = table.as_array().unwrap().iter().map(|r| r[0].as_str().unwrap()).collect();
    assert_eq!(names, ["head", w1.addr.as_str(), w2.addr.as_str()], "{table}");
    let hops = browser.js("return [...document.querySelectorAll('#devices tbody tr')].map(r => r.cells[5].textContent);");
    assert!(hops.as_array().unwrap().iter().all(|h| h.as_str().unwrap().ends_with(" ms")), "every hop's latency: {hops}");
    for r in table.as_array().unwrap() {
        assert_eq!(r[2], "ok", "{table}");
        assert!(r[3].as_str().unwrap().starts_with("10 ("), "every member's 10 layers and their window: {table}");
    }
    assert_eq!(browser.text("#status"), "ok");
    assert_eq!(browser.js("return document.getElementById('key-form').offsetParent === null;"), true, "the key form is out of sight once connected");
    assert_eq!(browser.js("return document.getElementById('admin-form').offsetParent !== null;"), true, "re-planning is offered where the server has an admin key");
    let listed = browser.text("#local-models");
    assert!(listed.contains("SmolLM2-135M-Instruct.Q4_1.gguf · ") && listed.contains(" · served"), "the models on the head's disk: {listed}");
    let ring = browser.js("return document.querySelectorAll('#ring circle.node').length;");
    assert_eq!(ring, 3, "the ring is drawn with its three members");
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");

    // A chat message streams the API's greedy answer.
    browser.click("#chat-form details summary");
    browser.type_into("#temperature", "0");
    browser.type_into("#max-tokens", &MAX_TOKENS.to_string());
    browser.type_into("#prompt", PROMPT);
    browser.click("#send");
    browser.wait("the answer to finish", Duration::from_secs(120), "const m = document.querySelector('.msg.assistant'); return m && m.dataset.done === 'true';");
    let answer = browser.text(".msg.assistant .answer");
    assert_eq!(answer, expected, "the console's answer against the API's");
    let stats = browser.text("#chat-stats");
    assert!(stats.contains(&format!("{generated} generated tokens")) && stats.contains("tokens/s"), "{stats}");
    // The load shows what was generated.
    browser.wait("the load to count the answer", Duration::from_secs(10), &format!("return document.getElementById('load-facts').textContent.match(/tokens generated(\\d+)/)?.[1] >= {};", 2 * generated));

    // A second turn sent from the keyboard (Ctrl+Enter): the conversation goes on as the
    // API's would.
    let follow_up = "Which of them matters most?";
    let body = json!({"model": "", "messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": expected}, {"role": "user", "content": follow_up}], "temperature": 0, "max_tokens": MAX_TOKENS}).to_string();
    let r = http(&head.addr, "POST", "/v1/chat/completions", &format!("Authorization: Bearer {KEY}\r\n"), &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let second = common::chat_content(&r.body, false);
    browser.type_into("#prompt", &format!("{follow_up}{CONTROL}{ENTER}{RELEASE}"));
    browser.wait("the second answer", Duration::from_secs(120), "const m = document.querySelectorAll('.msg.assistant'); return m.length === 2 && m[1].dataset.done === 'true';");
    let answers = browser.js("return [...document.querySelectorAll('.msg.assistant .answer')].map(a => a.textContent);");
    assert_eq!(answers, json!([expected, second]), "the console's conversation against the API's");

    // Stop: a long answer stopped mid-stream ends as stopped, and the server lets go of it.
    browser.type_into("#max-tokens", "2000");
    browser.type_into("#prompt", "Write a long story about a lighthouse keeper.");
    browser.click("#send");
    browser.wait("the long answer to start", Duration::from_secs(60), "const a = document.querySelectorAll('.msg.assistant .answer'); return a.length === 3 && a[2].textContent.length > 0;");
    browser.click("#stop");
    browser.wait("the stop", Duration::from_secs(30), "return document.getElementById('chat-stats').textContent.includes('stopped');");
    wait_for("the stopped request to leave its slot", Duration::from_secs(30), || {
        let r = http(&head.addr, "GET", "/console/state", &format!("Authorization: Bearer {KEY}\r\n"), "").ok()?;
        let v: Value = serde_json::from_str(&r.body).ok()?;
        (v["load"]["running"] == 0).then_some(())
    });

    // Re-planning: refused without the admin key, run with it.
    browser.click("#replan");
    let refused = browser.wait("the refusal", Duration::from_secs(20), "const t = document.getElementById('replan-result').textContent; return t.startsWith('Refused') && t;");
    assert!(refused.as_str().unwrap().contains("401"), "{refused}");
    browser.type_into("#admin-key", ADMIN);
    browser.click("#replan");
    let done = browser.wait("the re-plan", Duration::from_secs(90), "const t = document.getElementById('replan-result').textContent; return (t.startsWith('Kept') || t.startsWith('Adopted')) && t;");
    eprintln!("re-plan from the console: {done}");

    // What if: the plan without the second worker, shown beside the running one, adopted
    // by nobody.
    browser.click(&format!("#what-if-without input[value='{}']", w2.addr));
    browser.click("#what-if");
    let shown = browser.wait("the what-if plan", Duration::from_secs(90), "const t = document.getElementById('what-if-result').textContent; return t.includes('devices in the ring') && t;");
    let shown = shown.as_str().unwrap();
    assert!(shown.starts_with("even: 2 devices in the ring"), "{shown}");
    let planned = browser.js("return [...document.querySelectorAll('#what-if-result tbody tr')].map(r => r.cells[0].textContent + ' ' + r.cells[1].textContent);");
    assert_eq!(planned, json!(["head 15 (0–14)", format!("{} 15 (15–29)", w1.addr)]), "{shown}");
    assert_eq!(rows(&browser).as_array().unwrap().len(), 3, "nothing adopted");
    let admin = format!("Authorization: Bearer {ADMIN}\r\n");
    for (body, code) in [(r#"{"without":["head"]}"#, 400), (r#"{"copies":["nowhere:1"]}"#, 400), (r#"{"strategy":"fastest"}"#, 400), ("[", 400)] {
        let r = http(&head.addr, "POST", "/admin/what-if", &admin, body).unwrap();
        assert_eq!(r.status, code, "{body}: {}", r.body);
    }
    assert_eq!(http(&head.addr, "POST", "/admin/what-if", &format!("Authorization: Bearer {KEY}\r\n"), "{}").unwrap().status, 401, "the API key is not the admin key");
    let r = http(&head.addr, "POST", "/admin/what-if", &admin, &json!({"copies": ["head"], "strategy": "halda"}).to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let layers: u64 = v["members"].as_array().unwrap().iter().map(|m| m["layers"].as_u64().unwrap()).sum();
    assert_eq!(layers, 30, "every layer planned once: {v}");
    assert_eq!(v["members"].as_array().unwrap().len() + v["dropped"].as_array().unwrap().len(), 4, "the head, two workers and the copy: {v}");

    // Screenshots at a desktop's and a phone's width.
    browser.screenshot(1440, 1300, "console-1440.png");
    browser.screenshot(390, 844, "console-390.png");
    browser.call("POST", "/window/rect", json!({"width": 1440, "height": 1000}));

    // kill -9 of a worker on an idle ring: shown lost within seconds (the link's end is
    // seen and the head names the worker it cannot reach); back once it returns.
    w2.child.kill().unwrap();
    let _ = w2.child.wait();
    let lost = format!("return [...document.querySelectorAll('#devices tbody tr')].some(r => r.dataset.device === '{w2_addr}' && r.cells[1].textContent === 'lost');");
    let killed = std::time::Instant::now();
    browser.wait("the killed worker shown lost", Duration::from_secs(30), &lost);
    eprintln!("the killed worker was shown lost after {:.1} s", killed.elapsed().as_secs_f64());
    assert!(browser.text("#status").starts_with("degraded"), "{}", browser.text("#status"));
    let _w2 = Served::worker_at(&w2_addr, &common::default_model(), &["--threads", "1"]).unwrap();
    let back = format!("return [...document.querySelectorAll('#devices tbody tr')].some(r => r.dataset.device === '{w2_addr}' && r.cells[1].textContent === 'ok');");
    browser.wait("the worker shown back", Duration::from_secs(90), &back);
    browser.wait("the head ok again", Duration::from_secs(30), "return document.getElementById('status').textContent === 'ok';");
    // The browser logs the refused re-plan (401) as a failed load; nothing else may show.
    let errors = browser.console_errors();
    assert!(errors.iter().all(|e| e.contains("/admin/replan") && e.contains("401")), "console errors: {errors:?}");
}

/// A model that thinks (a tiny random Qwen3.5 with its own chat template, whose generation
/// prompt opens `<think>`), on a single node without keys: the page connects at once, offers
/// no admin form, and shows the reasoning apart from the answer, each equal to what the API
/// returns in `reasoning_content` and `content` for the same greedy request.
#[test]
fn the_console_shows_a_thinking_models_reasoning_apart_from_its_answer() {
    let Some(browser) = Browser::start() else { return };
    let dir = std::env::temp_dir().join(format!("hearth-console-thinking-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = engine::random_model::RandomModel::new("qwen35moe", 6, 64, 128, 4, 2);
    m.n_ff_exp = 64;
    let model = dir.join("thinking.gguf");
    m.write(&common::default_model(), &model).unwrap();
    let template = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/qwen3.5-chat-template.jinja");
    let node = Served::start_model(&model, &["--threads", "1", "--ctx-size", "1024", "--chat-template", template]);
    let body = json!({"model": "", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 16}).to_string();
    let r = http(&node.addr, "POST", "/v1/chat/completions", "", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let reasoning = v["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or_default().to_string();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    assert!(!reasoning.is_empty(), "the template opens <think>: the answer starts as reasoning: {v}");

    browser.open(&format!("http://{}/", node.addr));
    browser.wait("one device", Duration::from_secs(30), "return document.querySelectorAll('#devices tbody tr').length === 1;");
    assert_eq!(browser.js("return document.getElementById('key-form').offsetParent === null && document.getElementById('admin-form').offsetParent === null;"), true, "no key asked for, no admin form");
    browser.click("#chat-form details summary");
    browser.type_into("#temperature", "0");
    browser.type_into("#max-tokens", "16");
    browser.type_into("#prompt", PROMPT);
    browser.click("#send");
    browser.wait("the answer to finish", Duration::from_secs(120), "const m = document.querySelector('.msg.assistant'); return m && m.dataset.done === 'true';");
    let shown = browser.js("const m = document.querySelector('.msg.assistant'); const d = m.querySelector('details.reasoning'); return [d ? [...d.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join('') : null, m.querySelector('.answer').textContent];");
    assert_eq!(shown, json!([reasoning, content]), "the page's reasoning and answer against the API's");
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    drop(node);
    std::fs::remove_dir_all(&dir).ok();
}
