//! Chat templates rendered in child processes, so that a render's memory is bounded too.
//!
//! Why a process and not a bound inside this one: fuel bounds a render's steps and the
//! output is counted as it is written ([`crate::chat_template::Bounds`]), but a value can
//! grow without either: `{% set s = s ~ s %}` forty times, list concatenation, `'x' * n`
//! (capped by minijinja at 100 MB per operation, then concatenated), `join`, `replace`,
//! `{% set %}` blocks and macro captures (which never reach the output) are each a handful
//! of steps and gigabytes. minijinja has no memory limit and no hook on its operators, and
//! Rust aborts the whole process when an allocation fails (an allocator cannot unwind).
//! Capping every growing filter and method would leave the operators, so one variation
//! escapes. A child process with an `RLIMIT_DATA` (heap and private mappings) fails the
//! allocation there instead: the child aborts, the request gets a clear error, a fresh child
//! replaces it, and the server never notices.
//!
//! The children are the server's own binary under a hidden subcommand ([`serve_child`]),
//! kept alive between renders (a chat request does not pay a process start), one per
//! concurrent render (the server renders on its few preparation threads, which bounds them).
//! Each holds the template compiled; a request is one JSON line in, one line out. A render
//! that answers nothing within [`SandboxConfig::timeout`] (a single very slow step fuel does
//! not see) has its child killed. On systems without `RLIMIT_DATA` enforcement (macOS) only
//! the fuel, output and time bounds hold.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::chat_template::{ChatTemplate, RenderInput, Variables};
use crate::{Error, Result};

/// The line protocol's name and version: a child of another build is refused, not misread.
const PROTOCOL: &str = "hearth-template-renderer/1";

/// Memory a child may hold whatever the request: the binary's own data, the compiled
/// template, and a render of an ordinary conversation with room to spare.
pub const MEMORY_BASE: u64 = 256 << 20;
/// More memory per byte of the largest request: the request's JSON is held as text, as
/// parsed JSON and as template values (twice: the plain and the marked render), each a
/// few times its size, and the outputs.
pub const MEMORY_PER_INPUT_BYTE: u64 = 32;

/// How long a render may take before its child is killed. Fuel ends a runaway loop long
/// before this; this catches a single step that is slow without looping (sorting or
/// joining a huge value built within the memory bound) on a slow, busy machine.
pub const RENDER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a new child may take to start and compile the template (a phone starting a
/// large binary under load).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Idle children kept: as many as the server renders at once.
const MAX_IDLE: usize = 8;

/// How to start a child and what it may use.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// The program (the server's own binary) and the arguments that make it
    /// [`serve_child`].
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// The child's `RLIMIT_DATA`.
    pub memory_bytes: u64,
    pub timeout: Duration,
}

impl SandboxConfig {
    /// The bounds for a server that takes requests of at most `max_input_bytes`.
    pub fn for_input(program: PathBuf, args: Vec<OsString>, max_input_bytes: usize) -> SandboxConfig {
        SandboxConfig { program, args, memory_bytes: MEMORY_BASE.saturating_add(MEMORY_PER_INPUT_BYTE.saturating_mul(max_input_bytes as u64)), timeout: RENDER_TIMEOUT }
    }
}

/// The first line a child reads.
#[derive(Serialize, Deserialize)]
struct Init {
    protocol: String,
    source: String,
    bos: String,
    eos: String,
    memory_bytes: u64,
}

/// One render's input as the child reads it.
#[derive(Deserialize)]
struct OwnedInput {
    messages: Vec<serde_json::Value>,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
    vars: Variables,
}

/// A child's answer line.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    /// Started, the template compiled; the protocol it speaks.
    Ready(String),
    /// The texts, one per input.
    Rendered(Vec<String>),
    /// A render passed a bound of its own (fuel, output).
    Limit(String),
    /// The template failed (its own exception, a type error, a parse error at start).
    Failed(String),
}

/// A live child: its input, and its answer lines as a reader thread receives them (so that
/// waiting for one can time out).
struct Helper {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<std::io::Result<String>>,
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What became of one exchange with a child.
enum Exchange {
    Answer(Reply),
    /// No answer in time: the child was killed.
    TimedOut,
    /// The child ended (its status, as text).
    Died(String),
}

impl Helper {
    /// A child started and ready; a template that does not compile there is its
    /// [`Error::ChatTemplate`]. A program that cannot be started, or is not a renderer, is an
    /// [`Error::Io`] on it: the server's fault, not the request's.
    fn spawn(config: &SandboxConfig, init: &str) -> Result<Helper> {
        let unavailable = |e: std::io::Error| Error::Io { path: config.program.clone(), source: e };
        let not_started = |why: String| Error::Io { path: config.program.clone(), source: std::io::Error::other(format!("the template renderer did not start: {why}")) };
        let mut child = Command::new(&config.program).args(&config.args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().map_err(unavailable)?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let (Some(stdin), Some(stdout)) = (stdin, stdout) else {
            let _ = child.kill();
            return Err(not_started("no pipes".into()));
        };
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name("hearth-template-pipe".into())
            .spawn(move || {
                let mut reader = BufReader::new(stdout);
                loop {
                    let mut line = String::new();
                    match reader.read_line(&mut line) {
                        Ok(0) => break,
                        Ok(_) => {
                            if tx.send(Ok(line)).is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            break;
                        }
                    }
                }
            })
            .map_err(unavailable)?;
        let mut helper = Helper { child, stdin, lines };
        match helper.exchange(init, START_TIMEOUT) {
            Exchange::Answer(Reply::Ready(p)) if p == PROTOCOL => Ok(helper),
            Exchange::Answer(Reply::Failed(m)) => Err(Error::ChatTemplate(m)),
            Exchange::Answer(_) => Err(not_started(format!("not a hearth template renderer speaking {PROTOCOL}"))),
            Exchange::TimedOut => Err(not_started(format!("no answer within {} s", START_TIMEOUT.as_secs()))),
            Exchange::Died(status) => Err(not_started(status)),
        }
    }

    /// Sends one line and waits for the answer line.
    fn exchange(&mut self, line: &str, timeout: Duration) -> Exchange {
        let sent = self.stdin.write_all(line.as_bytes()).and_then(|()| self.stdin.write_all(b"\n")).and_then(|()| self.stdin.flush());
        if sent.is_ok() {
            match self.lines.recv_timeout(timeout) {
                Ok(Ok(answer)) => {
                    return match serde_json::from_str(&answer) {
                        Ok(reply) => Exchange::Answer(reply),
                        Err(e) => Exchange::Died(format!("an answer it could not have sent: {e}")),
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Exchange::TimedOut;
                }
                Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => {}
            }
        }
        // The pipe closed: the child ended (or is ending); its status says how.
        let status = self.child.wait();
        Exchange::Died(match status {
            Ok(s) => describe_exit(s),
            Err(e) => e.to_string(),
        })
    }
}

/// A child's end in words. Rust aborts (SIGABRT) when an allocation fails, which under the
/// memory rlimit is what a growing template causes.
fn describe_exit(status: std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        match status.signal() {
            Some(libc::SIGABRT) => return "it aborted: an allocation failed under its memory bound".into(),
            Some(libc::SIGKILL) => return "it was killed (the system was out of memory?)".into(),
            Some(sig) => return format!("it was ended by signal {sig}"),
            None => {}
        }
    }
    format!("it exited: {status}")
}

/// The children of one template.
pub struct Sandbox {
    config: SandboxConfig,
    /// The [`Init`] line every child reads first.
    init: String,
    idle: Mutex<Vec<Helper>>,
}

impl Sandbox {
    /// Starts the first child (which checks that the program is a renderer and that the
    /// template compiles) and keeps it.
    pub fn start(config: SandboxConfig, source: &str, bos: &str, eos: &str) -> Result<Sandbox> {
        let init = Init { protocol: PROTOCOL.into(), source: source.into(), bos: bos.into(), eos: eos.into(), memory_bytes: config.memory_bytes };
        let init = serde_json::to_string(&init).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let sandbox = Sandbox { config, init, idle: Mutex::new(Vec::new()) };
        let first = sandbox.take()?;
        sandbox.give_back(first);
        Ok(sandbox)
    }

    /// The memory bound of each child.
    pub fn memory_bytes(&self) -> u64 {
        self.config.memory_bytes
    }

    fn take(&self) -> Result<Helper> {
        if let Some(h) = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop() {
            return Ok(h);
        }
        Helper::spawn(&self.config, &self.init)
    }

    fn give_back(&self, h: Helper) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE {
            idle.push(h);
        }
    }

    /// Renders `inputs` in a child. A child that dies or overruns is dropped (the next
    /// render starts a fresh one) and the render is an [`Error::TemplateLimit`].
    pub fn render(&self, inputs: &[RenderInput]) -> Result<Vec<String>> {
        let line = serde_json::to_string(inputs).map_err(|e| Error::ChatTemplate(format!("cannot hand the messages to the renderer: {e}")))?;
        let mut helper = self.take()?;
        let mib = self.config.memory_bytes >> 20;
        match helper.exchange(&line, self.config.timeout) {
            Exchange::Answer(reply) => {
                self.give_back(helper);
                match reply {
                    Reply::Rendered(texts) if texts.len() == inputs.len() => Ok(texts),
                    Reply::Limit(m) => Err(Error::TemplateLimit(m)),
                    Reply::Failed(m) => Err(Error::ChatTemplate(m)),
                    Reply::Rendered(_) | Reply::Ready(_) => Err(Error::ChatTemplate("the template renderer answered out of turn".into())),
                }
            }
            Exchange::TimedOut => Err(Error::TemplateLimit(format!("rendering took longer than {} s and was stopped", self.config.timeout.as_secs()))),
            Exchange::Died(how) => Err(Error::TemplateLimit(format!("rendering passed its memory bound of {mib} MiB or crashed and was stopped ({how})"))),
        }
    }
}

/// The child's side: reads the [`Init`] line from stdin, bounds its own memory, compiles
/// the template, then answers render lines until stdin closes (the server ended).
pub fn serve_child() -> Result<()> {
    let io = |e: std::io::Error| Error::ChatTemplate(format!("template renderer: {e}"));
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut out = std::io::stdout().lock();
    let mut answer = |reply: &Reply| -> Result<()> {
        let mut line = serde_json::to_vec(reply).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        line.push(b'\n');
        out.write_all(&line).and_then(|()| out.flush()).map_err(io)
    };
    let mut line = String::new();
    if input.read_line(&mut line).map_err(io)? == 0 {
        return Ok(());
    }
    let init: Init = serde_json::from_str(&line).map_err(|e| Error::ChatTemplate(format!("template renderer: a bad first line: {e}")))?;
    if init.protocol != PROTOCOL {
        return answer(&Reply::Failed(format!("this renderer speaks {PROTOCOL}, not {}", init.protocol)));
    }
    limit_memory(init.memory_bytes);
    let template = match ChatTemplate::new(&init.source, &init.bos, &init.eos) {
        Ok(t) => t,
        Err(e) => return answer(&Reply::Failed(inner_message(e))),
    };
    answer(&Reply::Ready(PROTOCOL.into()))?;
    loop {
        line.clear();
        if input.read_line(&mut line).map_err(io)? == 0 {
            return Ok(());
        }
        let reply = match serde_json::from_str::<Vec<OwnedInput>>(&line) {
            Err(e) => Reply::Failed(format!("a bad request line: {e}")),
            Ok(owned) => {
                let inputs: Vec<RenderInput> = owned.iter().map(|o| RenderInput { messages: &o.messages, tools: o.tools.as_ref(), add_generation_prompt: o.add_generation_prompt, vars: &o.vars }).collect();
                match template.render_all(&inputs) {
                    Ok(texts) => Reply::Rendered(texts),
                    Err(Error::TemplateLimit(m)) => Reply::Limit(m),
                    Err(e) => Reply::Failed(inner_message(e)),
                }
            }
        };
        answer(&reply)?;
    }
}

/// An error's message without the `chat template: ` its display adds (the server adds it
/// again).
fn inner_message(e: Error) -> String {
    match e {
        Error::ChatTemplate(m) | Error::TemplateLimit(m) => m,
        other => other.to_string(),
    }
}

/// Bounds this process's heap and private mappings (`RLIMIT_DATA`, Linux 4.7 and later
/// count `mmap`ed memory too) so that a growing render fails an allocation here, and turns
/// off core dumps (an abort under the bound is expected, not worth a core file).
fn limit_memory(bytes: u64) {
    #[cfg(unix)]
    {
        let data = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: bytes as libc::rlim_t };
        let core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: setrlimit reads the struct it is given and nothing else.
        unsafe {
            libc::setrlimit(libc::RLIMIT_DATA, &data);
            libc::setrlimit(libc::RLIMIT_CORE, &core);
        }
    }
    #[cfg(not(unix))]
    let _ = bytes;
}
