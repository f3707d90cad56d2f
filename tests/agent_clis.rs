//! The real agent CLIs, unchanged, driven non-interactively against a running `hearth serve`
//! on the default model: Claude Code (`claude -p`, the binary inside the `claude-agent-sdk`
//! PyPI package) and Codex CLI (`codex exec`, the binary inside `openai-codex`), as a user
//! points them at hearth (docs/api.md). Each runs two conversations with the same settings,
//! in new sessions; the second one's first request must start from the prefix the first
//! conversation left in hearth's cache (the CLI's own record of that request's usage, and
//! hearth's log line for the same request id).
//!
//! The default model, SmolLM2-135M-Instruct, has 8,192 tokens of context and no training
//! for tools, so the CLIs are set the way a user of a small local model sets them: a short
//! system prompt and one tool (Claude Code: `--bare --system-prompt ... --tools Bash`; Codex:
//! `model_instructions_file` and its features, skills and context sections turned off):
//! first prompts of about 530 and 1,050 tokens instead of the ~12,000 and ~6,000 of their
//! defaults (docs/api.md).
//!
//! Tools. Both CLIs send `tool_choice: auto`, and with it this model never calls a tool,
//! however plainly asked (it writes about the command instead), under greedy decoding too.
//! Claude Code lets a user add to its request body (`CLAUDE_CODE_EXTRA_BODY`): the test
//! sends `temperature: 0` and a `tool_choice` naming Bash there, so the call is made (hearth
//! constrains it to the tool's schema); Claude Code runs it (allowed by a permission rule
//! for that one command only; anything else the model asks for is denied), sends the result
//! back and hearth answers that request too. Forced on every turn, the conversation ends at
//! `--max-turns`. Codex offers no setting for `tool_choice` or `temperature`: its
//! conversations run with hearth's defaults (temperature 1), get a text answer, and a
//! sample that runs on to the end of the context (rare) is an incomplete response Codex
//! reports, after which the conversation is run again.
//!
//! Needs the PyPI packages scripts/setup.sh installs; fails, naming them, without them.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Served;
use serde_json::Value;

/// Enough context for either CLI's first prompt as set here (about 1,100 tokens for
/// Codex) and a short answer; a sample that runs on stops here instead of at 8,192.
const CTX: &str = "2048";
const KEY: &str = "agent-key";
/// What the tool prints: the model's call must name it, the CLI's tool result carry it.
const MARKER: &str = "hearth-roundtrip-42";
/// The longest one CLI run may take before it is killed (a few seconds normally).
const RUN_LIMIT: Duration = Duration::from_secs(240);

/// The directory of an installed Python package, or a failure naming what to install.
fn package_dir(module: &str, pip: &str) -> PathBuf {
    let out = Command::new("python3").args(["-c", &format!("import {module}, os; print(os.path.dirname({module}.__file__))")]).output();
    let dir = out.ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let dir = dir.unwrap_or_else(|| panic!("the `{pip}` Python package is missing: run scripts/setup.sh (or python3 -m pip install {pip})"));
    PathBuf::from(dir)
}

fn executable(path: PathBuf, pip: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let ok = std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    assert!(ok, "the `{pip}` package has no executable at {}: reinstall it (python3 -m pip install --force-reinstall {pip})", path.display());
    path
}

/// A fresh directory for one test's homes and working directory (left behind when the
/// test fails, for its session files).
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("agent-clis-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// A CLI run: exit status (None when killed at the limit), stdout, stderr.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn show(&self) -> String {
        format!("exit {:?}\nstdout:\n{}\nstderr:\n{}", self.code, self.stdout, self.stderr)
    }

    /// stdout's JSON lines.
    fn events(&self) -> Vec<Value> {
        self.stdout.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }
}

/// Runs `cmd` in its own process group with stdin closed, killing the group (the CLI and
/// the commands it started) if it outlives [`RUN_LIMIT`].
fn run_bounded(mut cmd: Command) -> Run {
    use std::os::unix::process::CommandExt;
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).spawn().unwrap();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status.code().unwrap_or(-1));
        }
        if start.elapsed() > RUN_LIMIT {
            // SAFETY: kill(2) on the process group this test started.
            unsafe { kill(-(child.id() as i32), 9) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Run { code, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// hearth's `sequence done` line for request `id`: (prompt_tokens, cached_tokens).
fn logged_request(server: &Served, id: &str) -> (u64, u64) {
    let marker = format!("request={id} ");
    server.wait_logged(&format!("the sequence of request {id}"), Duration::from_secs(30), |l| l.contains("sequence done") && l.contains(&marker));
    let log = server.log.lock().unwrap().clone();
    let line = log.lines().find(|l| l.contains("sequence done") && l.contains(&marker)).unwrap().to_string();
    let field = |name: &str| -> u64 {
        let v = line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}="))).unwrap_or_else(|| panic!("no {name} in {line}"));
        v.parse().unwrap_or_else(|_| panic!("{name} in {line}"))
    };
    (field("prompt_tokens"), field("cached_tokens"))
}

fn model_id(server: &Served) -> String {
    let r = common::http(&server.addr, "GET", "/v1/models", &format!("Authorization: Bearer {KEY}\r\n"), "").unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    v["data"][0]["id"].as_str().unwrap().to_string()
}

fn start_hearth() -> Served {
    Served::start(&["--threads", "1", "--ctx-size", CTX, "--parallel", "2", "--api-key", KEY])
}

/// Claude Code as `claude -p`: a short system prompt, only the Bash tool, nothing loaded
/// from settings, plugins or MCP, no traffic but the API's; the request body gets
/// `temperature: 0` and a `tool_choice` naming Bash (see the module comment).
fn claude(bin: &Path, dir: &Path, server: &Served) -> Run {
    let (home, work) = (dir.join("home"), dir.join("work"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let mut cmd = Command::new(bin);
    cmd.current_dir(&work)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("ANTHROPIC_BASE_URL", format!("http://{}", server.addr))
        // --bare reads the key from ANTHROPIC_API_KEY only (sent as x-api-key).
        .env("ANTHROPIC_API_KEY", KEY)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "256")
        .env("CLAUDE_CODE_EXTRA_BODY", r#"{"temperature": 0, "tool_choice": {"type": "tool", "name": "Bash"}}"#)
        .args(["-p", &format!(r#"Call Bash with {{"command": "echo {MARKER}"}}"#)])
        .args(["--output-format", "stream-json", "--verbose", "--bare", "--no-session-persistence"])
        .args(["--system-prompt", "You run the user's shell command with the Bash tool, exactly as given."])
        .args(["--tools", "Bash", "--allowedTools", &format!("Bash(echo {MARKER})"), "--permission-prompts", "none"])
        .args(["--strict-mcp-config", "--setting-sources", "", "--max-turns", "2"]);
    run_bounded(cmd)
}

/// The ids and `cache_read_input_tokens` of the API requests of a `claude -p` stream, in
/// order (a message split into several events is one request).
fn claude_requests(events: &[Value]) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = Vec::new();
    for e in events.iter().filter(|e| e["type"] == "assistant") {
        let id = e["message"]["id"].as_str().unwrap_or_default().to_string();
        if out.last().is_none_or(|(last, _)| *last != id) {
            out.push((id, e["message"]["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0)));
        }
    }
    out
}

#[test]
fn claude_code_runs_a_tool_through_hearth_and_a_new_conversation_reuses_the_cached_prefix() {
    let bin = executable(package_dir("claude_agent_sdk", "claude-agent-sdk").join("_bundled").join("claude"), "claude-agent-sdk");
    let server = start_hearth();
    let dir = scratch("claude");

    // The first conversation: the model's call, Claude Code running it, the result back.
    let first = claude(&bin, &dir, &server);
    let events = first.events();
    let call = events
        .iter()
        .filter(|e| e["type"] == "assistant")
        .flat_map(|e| e["message"]["content"].as_array().cloned().unwrap_or_default())
        .find(|b| b["type"] == "tool_use")
        .unwrap_or_else(|| panic!("no tool call from the model: {}", first.show()));
    assert_eq!(call["name"], "Bash", "{}", first.show());
    assert_eq!(call["input"]["command"], format!("echo {MARKER}"), "{}", first.show());
    let result_at = events
        .iter()
        .position(|e| {
            e["type"] == "user"
                && e["message"]["content"].as_array().is_some_and(|c| c.iter().any(|b| b["type"] == "tool_result" && b["tool_use_id"] == call["id"] && b["is_error"] != true && b["content"].to_string().contains(MARKER)))
        })
        .unwrap_or_else(|| panic!("Claude Code did not run the call and get {MARKER}: {}", first.show()));
    // hearth answered the request that carried the result: a message after it.
    let requests = claude_requests(&events);
    assert!(events[result_at..].iter().any(|e| e["type"] == "assistant"), "no request with the tool result: {}", first.show());
    assert!(requests.len() >= 2, "{requests:?}\n{}", first.show());
    let (prompt_1, cached_1) = logged_request(&server, &requests[0].0);
    let (prompt_2, cached_2) = logged_request(&server, &requests[1].0);
    assert_eq!(cached_1, 0, "a fresh server had nothing cached");
    assert!(prompt_2 > prompt_1 && cached_2 > 0, "the second request ({prompt_2} tokens, {cached_2} cached) did not extend the first ({prompt_1})");
    // With the call forced on every turn the model never ends the turn: the run stops at
    // --max-turns, after hearth answered the turn that carried the result.
    let result = events.iter().rfind(|e| e["type"] == "result").unwrap_or_else(|| panic!("no result: {}", first.show()));
    assert!(result["subtype"] == "success" || result["subtype"] == "error_max_turns", "{}", first.show());
    assert!(result["api_error_status"].is_null(), "{}", first.show());

    // The second conversation, a new session with the same settings: its first request
    // starts from the system prompt and tools the first one computed.
    let second = claude(&bin, &dir, &server);
    let requests_2 = claude_requests(&second.events());
    let (id, reported) = requests_2.first().cloned().unwrap_or_else(|| panic!("no answer: {}", second.show()));
    let (prompt, cached) = logged_request(&server, &id);
    assert!(reported > 0 && cached == reported, "second conversation's first request: Claude Code got cache_read_input_tokens {reported}, hearth logged {cached} of {prompt}\n{}", second.show());
    eprintln!("claude code: tool call {} ran, {} requests; the second conversation's first request read {cached} of {prompt} prompt tokens from the cache", call["input"], requests.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The config.toml a user writes for hearth with a small model: the provider, and what
/// Codex adds to a prompt beyond a short instruction and its shell tools left out.
fn codex_config(server: &Served, model: &str, instructions: &Path) -> String {
    format!(
        r#"model = "{model}"
model_provider = "hearth"
model_context_window = {CTX}
model_instructions_file = "{instructions}"
model_reasoning_summary = "none"
approval_policy = "never"
sandbox_mode = "read-only"
web_search = "disabled"
include_environment_context = false
include_permissions_instructions = false
include_apps_instructions = false

[skills]
include_instructions = false
bundled.enabled = false

[features]
multi_agent = false
goals = false
view_image = false
apps = false
plugins = false
memories = false

[model_providers.hearth]
name = "hearth"
base_url = "http://{addr}/v1"
wire_api = "responses"
env_key = "HEARTH_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"#,
        instructions = instructions.display(),
        addr = server.addr
    )
}

/// One `codex exec` conversation in a new session, run again (up to 3 times) when the
/// sampled answer ran on to the end of the context. Its events and the ids and
/// `cached_input_tokens` of its requests, from the session's rollout file.
fn codex_conversation(bin: &Path, home: &Path, work: &Path) -> (Run, Vec<(String, u64)>) {
    for _ in 0..3 {
        let mut cmd = Command::new(bin);
        cmd.current_dir(work)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", home)
            .env("CODEX_HOME", home)
            .env("HEARTH_API_KEY", KEY)
            .args(["exec", "--json", "--strict-config", "--skip-git-repo-check", "-C"])
            .arg(work)
            .arg("Say hello.");
        let run = run_bounded(cmd);
        let events = run.events();
        if run.code != Some(0) && events.iter().any(|e| e["type"] == "turn.failed" && e["error"]["message"].as_str().is_some_and(|m| m.contains("Incomplete response"))) {
            eprintln!("codex: the sampled answer reached the end of the context; running the conversation again");
            continue;
        }
        assert_eq!(run.code, Some(0), "{}", run.show());
        // A sampled answer may be empty (the end of text drawn first): the turn's end is
        // what counts.
        assert!(events.iter().any(|e| e["type"] == "turn.completed"), "{}", run.show());
        let thread = events.iter().find(|e| e["type"] == "thread.started").and_then(|e| e["thread_id"].as_str()).unwrap_or_else(|| panic!("{}", run.show())).to_string();
        let requests = rollout_requests(&home.join("sessions"), &thread);
        assert!(!requests.is_empty(), "no usage recorded for thread {thread}: {}", run.show());
        return (run, requests);
    }
    panic!("three conversations in a row ran on to the end of the context");
}

/// The `token_usage_record`s of thread `thread`'s rollout file: (response id, cached tokens).
fn rollout_requests(sessions: &Path, thread: &str) -> Vec<(String, u64)> {
    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                files(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut all = Vec::new();
    files(sessions, &mut all);
    let file = all.into_iter().find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().contains(thread))).unwrap_or_else(|| panic!("no rollout file for thread {thread} under {}", sessions.display()));
    std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["type"] == "token_usage_record")
        .map(|v| (v["payload"]["response_id"].as_str().unwrap_or_default().to_string(), v["payload"]["usage"]["cached_input_tokens"].as_u64().unwrap_or(0)))
        .collect()
}

#[test]
fn codex_cli_completes_conversations_through_hearth_and_a_new_one_reuses_the_cached_prefix() {
    use std::os::unix::ffi::OsStrExt;
    let out = Command::new("python3").args(["-c", "import codex_cli_bin; print(codex_cli_bin.bundled_codex_path())"]).output();
    let path = out.ok().filter(|o| o.status.success()).map(|o| PathBuf::from(std::ffi::OsStr::from_bytes(o.stdout.trim_ascii())));
    let bin = executable(path.unwrap_or_else(|| panic!("the `openai-codex` Python package is missing: run scripts/setup.sh (or python3 -m pip install openai-codex)")), "openai-codex");
    let server = start_hearth();
    let dir = scratch("codex");
    let (home, work) = (dir.join("home"), dir.join("work"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let instructions = home.join("instructions.md");
    std::fs::write(&instructions, "You are a coding agent. Run shell commands with the exec_command tool.\n").unwrap();
    std::fs::write(home.join("config.toml"), codex_config(&server, &model_id(&server), &instructions)).unwrap();

    let (_, first) = codex_conversation(&bin, &home, &work);
    let (prompt_1, _) = logged_request(&server, &first[0].0);
    let (second_run, second) = codex_conversation(&bin, &home, &work);
    let (id, reported) = second[0].clone();
    let (prompt, cached) = logged_request(&server, &id);
    assert!(reported > 0 && cached == reported, "second conversation's first request: Codex recorded cached_input_tokens {reported}, hearth logged {cached} of {prompt}\n{}", second_run.show());
    eprintln!("codex: first prompt {prompt_1} tokens; the second conversation's first request read {cached} of {prompt} from the cache");
    let _ = std::fs::remove_dir_all(&dir);
}
