//! The `hearth` commands. This file is the command-line contract (see DESIGN.md: every
//! flag also reads `HEARTH_<FLAG>`); each command's module parses its flags into the
//! runtime's or the API's settings and calls them, and holds no serving logic of its own.

pub mod bench;
pub mod bench_serve;
pub mod make_model;
pub mod quantize;
pub mod plan;
pub mod profile;
pub mod pull;
pub mod serve;
pub mod worker;
pub mod worker_profile;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use crate::models as default_model;

/// `N|auto`: a count hearth chooses itself unless told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AutoCount(Option<usize>);

impl AutoCount {
    /// The count the user gave; `None` for `auto`.
    pub fn count(self) -> Option<usize> {
        self.0
    }
}

impl std::str::FromStr for AutoCount {
    type Err = String;

    fn from_str(s: &str) -> Result<AutoCount, String> {
        match s {
            "auto" => Ok(AutoCount(None)),
            n => match n.parse() {
                Ok(0) | Err(_) => Err(format!("expected a number above 0 or `auto`, got {n:?}")),
                Ok(n) => Ok(AutoCount(Some(n))),
            },
        }
    }
}

#[derive(Parser, Debug)]
#[command(name = "hearth", version, about = "Run big language models across the devices of a home, behind one OpenAI-compatible API")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start the head node: the HTTP API and this machine's share of the model.
    Serve(ServeArgs),
    /// Join a ring as a worker: wait for a head and run the layer windows it assigns.
    Worker(WorkerArgs),
    #[command(flatten)]
    Tool(Tool),
}

/// The commands besides the two roles, the same in `hearth` and `hearth-lab`.
#[derive(Subcommand, Debug)]
pub enum Tool {
    /// Benchmark hearth's engine against llama.cpp on the same GGUF, side by side.
    Bench(BenchArgs),
    /// Load-test the HTTP API: 1, 4 and 8 concurrent streaming clients against an
    /// in-process server; prints tokens/s, TTFT and TPOT.
    BenchServe(BenchServeArgs),
    /// Download the default model into the models folder (idempotent, SHA-256 checked).
    FetchModel(FetchArgs),
    /// Download a model from the Hugging Face hub by name: `owner/name` or
    /// `owner/name:QUANT` (e.g. `bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M`; every part of a
    /// split model), into the hub's cache; prints its path. Resumable, SHA-256 checked.
    Pull(PullArgs),
    /// List the models on this machine (the models folder and the hub cache): name, size,
    /// architecture, quantization, path; `--remove NAME` deletes a pulled one.
    Models(ModelsArgs),
    /// Measure this device for the scheduler (kernels per weight format, memory, disk,
    /// RAM); a table, or with --json a device profile for `hearth plan --devices`.
    Profile(ProfileArgs),
    /// Plan a ring offline: Halda (or a baseline) on device profiles (JSON) and a model
    /// (GGUF, or a model-profile JSON); prints the windows per device and the predicted TPOT.
    Plan(PlanArgs),
    /// Requantize a GGUF into another weight type with llama.cpp's own quantizer
    /// (e.g. `--type q4_k_m`), and/or write it as a split set (`--split-max-size 2G`).
    Quantize(QuantizeArgs),
    /// Print a new cluster secret (128 random bits) to give every node as --cluster-secret
    /// (or HEARTH_CLUSTER_SECRET).
    Secret,
    /// Internal: render a chat template for `hearth serve` in a memory-bounded child
    /// process (a JSON line protocol on stdin/stdout; engine::template_sandbox).
    #[command(hide = true)]
    RenderTemplate,
}

/// `hearth-lab`: the `hearth` commands with the settings experiments need and users do not
/// (emulated hop latency, released windows, a pinned prompt chunk), and the tools behind
/// the tests and benchmarks. The system tests run it; docs/benchmarks.md's commands use it.
#[derive(Parser, Debug)]
#[command(name = "hearth-lab", version, about = "hearth for tests and benchmarks: emulate a home cluster on one machine")]
pub struct LabCli {
    #[command(subcommand)]
    pub command: LabCommand,
}

#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum LabCommand {
    /// `hearth serve`, with the lab's settings.
    Serve(LabServeArgs),
    /// `hearth worker`, with the lab's settings.
    Worker(LabWorkerArgs),
    /// Write a random-weight GGUF of any supported architecture and size (for memory
    /// experiments and benchmarks).
    MakeModel(MakeModelArgs),
    /// Print a worker's per-window statistics (the `profile` control method) as JSON.
    WorkerProfile(WorkerProfileArgs),
    #[command(flatten)]
    Tool(Tool),
}

#[derive(Args, Debug)]
pub struct LabServeArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub lab: ServeLab,
}

#[derive(Args, Debug)]
pub struct LabWorkerArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    #[command(flatten)]
    pub lab: HopLab,
}

#[derive(Args, Debug, Clone)]
pub struct ProfileArgs {
    /// The model to profile for: the disk it is on, its KV size. Default: the models folder
    /// and a typical KV size.
    #[command(flatten)]
    pub model: OptionalModelArg,
    /// Compute threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    pub threads: Option<usize>,
    /// The device's name in the profile (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Mark the profile as the head's (the first device of `hearth plan --devices`).
    #[arg(long)]
    pub head: bool,
    /// Measure again instead of using the cached profile.
    #[arg(long)]
    pub fresh: bool,
    /// Print the device profile as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A model path that stays unset when not given (nothing is fetched).
#[derive(Args, Debug, Clone)]
pub struct OptionalModelArg {
    /// GGUF model file.
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// JSON list of device profiles, the head first (see docs/scheduler.md).
    #[arg(long)]
    pub devices: PathBuf,
    /// The model: a GGUF, or a model-profile JSON for what-if planning.
    #[command(flatten)]
    pub model: ModelArg,
    /// halda, or a baseline to compare: memory (exo-style), compute (Galaxy-style), even.
    #[arg(long, env = "HEARTH_PLAN_STRATEGY", default_value = "halda")]
    pub plan_strategy: String,
    /// Context (cached tokens) to plan for: KV-cache memory and attention time grow with it.
    #[arg(long, env = "HEARTH_CTX_SIZE", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Streams served at once, as `hearth serve --parallel`: above 1, Halda keeps a device
    /// that adds more to what many streams get together than it costs one token alone
    /// (1: one token's latency only).
    #[arg(long, env = "HEARTH_PARALLEL", default_value_t = 4)]
    pub parallel: usize,
    /// The KV cache types to plan for (a GGUF's; a model-profile JSON says its own).
    #[command(flatten)]
    pub kv: CacheTypeArgs,
    /// Print the whole schedule as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `--cache-type-k` / `--cache-type-v`, as `hearth serve` and `hearth plan` take them.
#[derive(Args, Debug, Clone)]
pub struct CacheTypeArgs {
    /// The element type of the KV cache's keys, on every ring member: f16 (default), bf16,
    /// f32, q8_0, q4_0, q4_1, q5_0, q5_1 or iq4_nl (llama.cpp's `--cache-type-k`). q8_0
    /// takes about half of f16's memory per token of context, q4_0 about a quarter, for a
    /// little precision; the planner counts the chosen type's bytes.
    #[arg(long, env = "HEARTH_CACHE_TYPE_K", default_value_t = engine::CacheType::F16)]
    pub cache_type_k: engine::CacheType,
    /// The element type of the KV cache's values (llama.cpp's `--cache-type-v`); the same
    /// choices as --cache-type-k.
    #[arg(long, env = "HEARTH_CACHE_TYPE_V", default_value_t = engine::CacheType::F16)]
    pub cache_type_v: engine::CacheType,
}

impl CacheTypeArgs {
    pub fn types(&self) -> engine::CacheTypes {
        engine::CacheTypes { k: self.cache_type_k, v: self.cache_type_v }
    }
}

#[derive(Args, Debug, Clone)]
pub struct MakeModelArgs {
    /// Architecture: llama, mistral3, qwen2, qwen3, qwen3moe, gemma3, gemma4, gpt-oss, glm4moe, llama4, deepseek2, qwen35 or qwen35moe (and the embedders bert, nomic-bert).
    #[arg(long, default_value = "llama")]
    pub arch: String,
    #[arg(long)]
    pub layers: u32,
    #[arg(long, default_value_t = 2048)]
    pub embd: u64,
    #[arg(long, default_value_t = 8192)]
    pub ff: u64,
    #[arg(long, default_value_t = 16)]
    pub heads: u32,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: u32,
    /// Size of one attention head (default: embd / heads).
    #[arg(long)]
    pub head_dim: Option<u64>,
    /// MoE archs: experts per layer.
    #[arg(long, default_value_t = 8)]
    pub experts: u32,
    /// MoE archs: experts each token uses.
    #[arg(long, default_value_t = 2)]
    pub experts_used: u32,
    /// MoE archs: one expert's hidden size (default: ff / experts-used).
    #[arg(long)]
    pub expert_ff: Option<u64>,
    /// Sliding-window archs (gemma3, gemma4, gpt-oss): the window in tokens.
    #[arg(long, default_value_t = 128)]
    pub window: u32,
    /// gemma4: every this-many-th layer (and the last) attends fully, with heads of twice
    /// --head-dim and V taken from K (Gemma 4's own models: 6). qwen35, qwen35moe: every
    /// this-many-th layer attends fully, the others are linear attention with a recurrent
    /// state (Qwen3.5's own models: 4).
    #[arg(long, default_value_t = 2)]
    pub full_every: u32,
    /// gemma4: KV heads of the full layers (default: half of --kv-heads).
    #[arg(long)]
    pub full_kv_heads: Option<u32>,
    /// gemma4: values per token of each layer's own input, as Gemma 4 E2B/E4B have (256).
    #[arg(long, default_value_t = 0)]
    pub per_layer_embd: u64,
    /// gemma4: the last this-many layers attend with the K/V of the last sliding and full
    /// layers before them and have twice the FFN width, as Gemma 4 E2B (20 of 35) and E4B
    /// (18 of 42) do.
    #[arg(long, default_value_t = 0)]
    pub shared_kv_layers: u32,
    /// Weight type of the matrices: q8_0, q4_0, f16, or q4_k_m (llama.cpp's mix of Q4_K
    /// and Q6_K); gpt-oss experts are always mxfp4.
    #[arg(long, default_value = "q8_0")]
    pub r#type: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The GGUF to write; with --split-max-size, the parts are OUT-00001-of-0000N.gguf
    /// and on (OUT without its .gguf).
    #[arg(long)]
    pub out: PathBuf,
    /// Write a split set whose parts hold at most this much tensor data each (`20G`).
    #[arg(long)]
    pub split_max_size: Option<String>,
    /// The context the model says it was trained for (`context_length`): the most cells
    /// a sequence gets.
    #[arg(long, default_value_t = 4096)]
    pub context_length: u32,
    /// The GGUF whose tokenizer the new model gets (default: the default model).
    #[command(flatten)]
    pub tokenizer_from: ModelArg,
}

#[derive(Args, Debug, Clone)]
pub struct QuantizeArgs {
    /// The GGUF to read (a split set: any of its parts).
    pub input: PathBuf,
    /// The GGUF to write; with --split-max-size, the parts are OUT-00001-of-0000N.gguf
    /// and on (OUT without its .gguf).
    pub output: PathBuf,
    /// Target type, as llama-quantize names them: f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q2_k, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, iq4_nl, iq4_xs,
    /// iq3_s, iq3_m, mxfp4_moe. Without it the weights are copied as they are (only split).
    #[arg(long = "type")]
    pub ty: Option<String>,
    /// Write a split set whose parts hold at most this much tensor data each, as
    /// llama.cpp's `gguf-split --split-max-size` does: `2G`, `500M` (powers of 1000).
    #[arg(long)]
    pub split_max_size: Option<String>,
    #[arg(long, env = "HEARTH_THREADS", default_value_t = 2)]
    pub threads: usize,
}

#[derive(Args, Debug, Clone)]
pub struct WorkerProfileArgs {
    /// The worker's --listen address.
    #[arg(long)]
    pub worker: String,
    #[arg(long, env = "HEARTH_CLUSTER_SECRET")]
    pub cluster_secret: Option<String>,
    #[arg(long, env = "HEARTH_INSECURE")]
    pub insecure: bool,
}

#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Engine threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    pub threads: Option<usize>,
    /// Concurrent clients per level.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub clients: Vec<usize>,
    /// Requests each client sends, one after another.
    #[arg(long, default_value_t = 3)]
    pub requests: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
}

#[derive(Args, Debug, Clone)]
pub struct PullArgs {
    /// `owner/name[:QUANT]` or `owner/name:FILE.gguf` (a leading `hf:` is fine). Without
    /// QUANT: Q4_K_M, else Q8_0, else the repo's first GGUF.
    pub model: String,
}

#[derive(Args, Debug, Clone)]
pub struct ModelsArgs {
    /// Delete this pulled model (`owner/name[:QUANT]`, as pulled) from the hub cache.
    #[arg(long)]
    pub remove: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct ModelArg {
    /// GGUF model file, or `hf:owner/name[:QUANT]` to pull it from the Hugging Face hub
    /// first (see `hearth pull`). Default: the default model, fetched on first use.
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
}

impl ModelArg {
    pub fn resolve(&self) -> crate::Result<PathBuf> {
        match &self.model {
            Some(p) if p.to_str().is_some_and(|s| s.starts_with(crate::hub::PREFIX)) => pull::resolve(p.to_str().expect("checked")),
            Some(p) => Ok(p.clone()),
            None => {
                let dir = default_model::models_dir();
                let path = dir.join(default_model::DEFAULT_MODEL_FILE);
                if !path.is_file() {
                    tracing::info!("fetching the default model into {}", dir.display());
                }
                default_model::ensure_default_model(&dir)
            }
        }
    }
}

/// A size in bytes: a number with an optional K, M, G or T suffix (powers of 1000; `Gi`
/// and the like for powers of 1024).
fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number.parse().map_err(|_| format!("{text:?} is not a size like 40G or 500M"))?;
    let scale = match unit.trim().trim_end_matches(['B', 'b']).to_ascii_uppercase().as_str() {
        "" => 1.0,
        "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "KI" => 1024.0,
        "MI" => 1024.0 * 1024.0,
        "GI" => 1024.0 * 1024.0 * 1024.0,
        "TI" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (K, M, G, T, Ki, Mi, Gi, Ti)")),
    };
    Ok((number * scale) as u64)
}

/// `worker --listen`'s default: loopback (a head on this machine); with discovery on,
/// every interface at the same port.
pub const DEFAULT_WORKER_LISTEN: &str = "127.0.0.1:9090";

/// `serve --ring-listen`'s default: loopback, for workers on this machine; with discovery
/// on, every interface instead (workers that join are on the LAN).
pub const DEFAULT_RING_LISTEN: &str = "127.0.0.1:0";

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[arg(long, env = "HEARTH_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "HEARTH_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Compute threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    pub threads: Option<usize>,
    /// Context cells (prompt and answer tokens) per sequence. 0, the default: the largest
    /// whose KV cache fits the memory beside the model (every ring device's), up to the
    /// model's own context; said at start.
    #[arg(long, env = "HEARTH_CTX_SIZE", default_value_t = 0)]
    pub ctx_size: usize,
    /// Most sequences generated at once.
    #[arg(long, env = "HEARTH_PARALLEL", default_value_t = 4)]
    pub parallel: usize,
    /// Requests that may wait for a free sequence; more get HTTP 429.
    #[arg(long, env = "HEARTH_QUEUE_SIZE", default_value_t = 64)]
    pub queue_size: usize,
    /// Tokens per engine step: decode tokens plus prompt chunks.
    #[arg(long, env = "HEARTH_MAX_BATCH", default_value_t = 512)]
    pub max_batch: usize,
    #[command(flatten)]
    pub prompt_cache: PromptCacheArgs,
    /// Largest request body in bytes; bigger ones get HTTP 413.
    #[arg(long, env = "HEARTH_BODY_LIMIT", default_value_t = 4 * 1024 * 1024)]
    pub body_limit: usize,
    /// Most open connections to the API port. Past it, the connection that has been idle
    /// the longest is closed to make room, else the one that has been sending a request
    /// body the longest; when every connection has a request being answered, the new one
    /// is closed at once. Keep it below the limit on open files (`ulimit -n`); hearth
    /// raises its soft limit to fit when it can.
    #[arg(long, env = "HEARTH_MAX_CONNECTIONS", default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a client may take to send a request's headers. Also the longest a kept-alive
    /// connection may sit idle, the longest pause while a request body is sent, and the
    /// grace after which a body must keep arriving at 8 KiB/s on average. Responses are
    /// never timed: a stream may last as long as it generates.
    #[arg(long, env = "HEARTH_HEADER_TIMEOUT", default_value_t = 30)]
    pub header_timeout: u64,
    /// Most live console streams at once (`GET /console/state` as server-sent events, one
    /// per open console tab). They are apart from --max-connections, so open consoles never
    /// take an API client's place; past the cap a new one gets 503 and the page retries.
    #[arg(long, env = "HEARTH_MAX_CONSOLE_STREAMS", default_value_t = crate::http::server::DEFAULT_MAX_STREAMS)]
    pub max_console_streams: usize,
    /// Bearer token clients must send to /v1/* (none: open).
    #[arg(long, env = "HEARTH_API_KEY")]
    pub api_key: Option<String>,
    /// Host names the API answers to beside IP addresses, localhost and this machine's
    /// name: a request naming any other host gets 403 (a guard against DNS rebinding, by
    /// which a web page would read the API as its own site). Comma-separated;
    /// `*.home.arpa` allows a domain's names, `*` turns the check off (behind a reverse
    /// proxy that checks names itself). E.g. `hearth.local,hearth` (mDNS, a compose service).
    #[arg(long, env = "HEARTH_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Origins whose web pages may call the API and read its answers (CORS), e.g.
    /// `http://localhost:3000`; `*` for any. Off by default: only the console, on the
    /// head's own origin, can.
    #[arg(long, env = "HEARTH_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    /// Name clients use for the model (default: the file name without .gguf).
    #[arg(long, env = "HEARTH_MODEL_ALIAS")]
    pub model_alias: Option<String>,
    /// Ring workers, in ring order (host:port of each `hearth worker --listen`). With a
    /// cluster secret, workers that find this head on the LAN join as well.
    #[arg(long, env = "HEARTH_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    /// Shared secret of the ring; required unless every address is loopback.
    #[arg(long, env = "HEARTH_CLUSTER_SECRET")]
    pub cluster_secret: Option<String>,
    /// How the scheduler chooses the windows and the workers to use, from every device's
    /// measured profile: halda, or a baseline (memory, compute, even). --windows overrides it.
    #[arg(long, env = "HEARTH_PLAN_STRATEGY", default_value = "halda")]
    pub plan_strategy: String,
    /// Layers per window for the head and each worker, e.g. 4,3,3 (repeated each round
    /// until all layers are placed), instead of the scheduler's choice.
    #[arg(long, env = "HEARTH_WINDOWS", value_delimiter = ',')]
    pub windows: Vec<usize>,
    /// Seconds the queue must be idle before the head looks at the cluster again and
    /// re-plans if a device's profile drifted and a new plan predicts a real gain; 0 turns
    /// it off. Off by default with --windows.
    #[arg(long, env = "HEARTH_REPLAN_IDLE", default_value_t = 60)]
    pub replan_idle: u64,
    /// Bearer token for /admin/* (plan, replan, cluster); without it they are off.
    #[arg(long, env = "HEARTH_ADMIN_KEY")]
    pub admin_key: Option<String>,
    /// Speculative decoding: `none`; `ngram` (prompt lookup: drafts copied from earlier
    /// tokens of the same sequence); `draft` (a small model's drafts, see --draft-model).
    /// Drafts are verified in one pass; the answer is the same as without. Default: `draft`
    /// when --draft-model is given, else `none`.
    #[arg(long, env = "HEARTH_SPEC_MODE", value_parser = ["none", "ngram", "draft"])]
    pub spec_mode: Option<String>,
    /// A small GGUF with the served model's vocabulary that runs whole on the head and
    /// proposes draft tokens.
    #[arg(long, env = "HEARTH_DRAFT_MODEL")]
    pub draft_model: Option<PathBuf>,
    /// The chat template: a Jinja file, or one of llama.cpp's built-in templates by name
    /// (chatml, llama3, mistral-v7, gemma, phi4, deepseek3, ...; an unknown name lists them).
    /// Default: the model's own (`tokenizer.chat_template`), and chatml for a GGUF without one.
    #[arg(long, env = "HEARTH_CHAT_TEMPLATE", value_name = "NAME|FILE")]
    pub chat_template: Option<String>,
    /// The program that renders Jinja chat templates in memory-bounded child processes
    /// (`PROGRAM render-template`). Default: this hearth binary. For tests that serve in
    /// process, where this binary is the test harness.
    #[arg(long, env = "HEARTH_TEMPLATE_RENDERER", hide = true)]
    pub template_renderer: Option<PathBuf>,
    /// A GGUF embedding model (nomic-embed-text, bge, all-MiniLM, Qwen3-Embedding, ...) to
    /// serve beside the chat model at /v1/embeddings and Ollama's /api/embed. It runs whole
    /// on this machine (never split across the ring), on the CPU, with --threads.
    #[arg(long, env = "HEARTH_EMBEDDING_MODEL")]
    pub embedding_model: Option<PathBuf>,
    /// Tokens one embedding input may have (and one decode of the embedding model holds), at
    /// most the embedding model's training context. Default: 8192, or that context if smaller.
    #[arg(long, env = "HEARTH_EMBEDDING_CTX_SIZE")]
    pub embedding_ctx_size: Option<usize>,
    /// How the embedding model pools token vectors into one: mean, cls or last. Default: what
    /// its GGUF says (required for a GGUF that says nothing, such as a chat model's).
    #[arg(long, env = "HEARTH_EMBEDDING_POOLING", value_parser = ["mean", "cls", "last"])]
    pub embedding_pooling: Option<String>,
    /// Most draft tokens per sequence and step; each sequence adapts below it to how often
    /// its drafts are accepted.
    #[arg(long, env = "HEARTH_SPEC_TOKENS", default_value_t = 8)]
    pub spec_tokens: usize,
    /// Compute each token as it would be computed alone, whatever else is in the batch
    /// (ggml's reference CPU kernels, on every ring member): a request's answer then does
    /// not depend on concurrent requests, drafts or thread counts. On whenever speculation
    /// is (that is what keeps it exact); off, the kernels are llama.cpp's own, faster on
    /// long batches.
    #[arg(long, env = "HEARTH_BATCH_INVARIANT")]
    pub batch_invariant: bool,
    #[command(flatten)]
    pub kv: CacheTypeArgs,
    /// Keep every weight in the model file's own layout, zero-copy in its mapping. By
    /// default the weights the CPU kernels prefer in an interleaved layout (Q4_0, Q4_K,
    /// IQ4_NL and others, depending on the CPU) are repacked into memory at load, as
    /// llama.cpp does: faster on most CPUs, and the same numbers as llama.cpp. Windows
    /// that must be paged from disk are never repacked.
    #[arg(long, env = "HEARTH_NO_REPACK")]
    pub no_repack: bool,
    /// Layers of each of this machine's windows to run on its GPU: a number, or `auto`
    /// (the scheduler's choice: in a ring the plan's GPU layers for the head, on a single
    /// node as many as fit in the GPU's free memory, and the output layer too when every
    /// layer fits). A number above every window's layers also puts the output layer (its
    /// norm and LM head) there, as llama.cpp's `-ngl` counts it: `99` is everything. A build
    /// without a GPU backend refuses a number above 0.
    #[arg(long, env = "HEARTH_GPU_LAYERS", default_value = "auto")]
    pub gpu_layers: crate::runtime::GpuLayers,
    /// Mixture-of-Experts models: of each window's GPU layers, how many keep their routed
    /// experts in RAM (run on the CPU) while attention, norms, router and shared experts
    /// stay on the GPU: a number, or `auto` (in a ring the plan's; on a single node the
    /// fewest that let every layer's GPU part fit). llama.cpp's `--n-cpu-moe`.
    #[arg(long, env = "HEARTH_EXPERTS_IN_RAM", default_value = "auto", alias = "n-cpu-moe")]
    pub experts_in_ram: crate::runtime::GpuLayers,
    /// Where the head listens for the last worker's link back (bind address).
    #[arg(long, env = "HEARTH_RING_LISTEN", default_value = DEFAULT_RING_LISTEN)]
    pub ring_listen: String,
    /// The address the last worker dials to reach --ring-listen, when that is not it: a
    /// head bound to 0.0.0.0, or behind Docker's port publishing, gives its LAN address.
    #[arg(long, env = "HEARTH_RING_ADVERTISE")]
    pub ring_advertise: Option<String>,
    /// Send activations between ring members as f16 (half the bytes, not bit-exact).
    #[arg(long, env = "HEARTH_F16_ACTIVATIONS")]
    pub f16_activations: bool,
    /// Seconds a step's frame may take to come round the ring before the ring counts as
    /// broken. A dead or frozen device is noticed sooner, by keep-alive pings (~15 s);
    /// this catches one that is alive but stuck. Allow for long prompt chunks on slow devices.
    #[arg(long, env = "HEARTH_RING_TIMEOUT", default_value_t = 120)]
    pub ring_timeout: u64,
    /// Seconds a broken ring waits for a lost member to come back before the head plans
    /// without it and serves with the devices it has (never with --windows: a pinned plan
    /// waits for its members). The lost device stays a candidate and is judged again when
    /// it returns.
    #[arg(long, env = "HEARTH_MEMBER_GRACE", default_value_t = 30)]
    pub member_grace: u64,
    /// Seconds to wait at start for workers that cannot be reached yet (started in any
    /// order); a worker that refuses (wrong secret, other model) fails the start at once.
    #[arg(long, env = "HEARTH_RING_WAIT", default_value_t = 60)]
    pub ring_wait: u64,
    /// Micro-batches travelling the ring at once: a number (1: one at a time, as
    /// prima.cpp), or `auto` (at least one per member that computes, so every device has
    /// work when several requests run or a long prompt is cut into chunks, and more where
    /// the members' measured small-batch steps forecast faster decoding of 8 streams; one
    /// when windows are paged from disk, where each would read them again).
    #[arg(long, env = "HEARTH_MICRO_BATCHES", default_value = "auto")]
    pub micro_batches: AutoCount,
    /// Do not read the head's next window ahead while the workers compute (for comparison).
    #[arg(long, env = "HEARTH_NO_PREFETCH")]
    pub no_prefetch: bool,
    /// Settings for experiments, not for users: only `hearth-lab serve` sets them.
    #[arg(skip)]
    pub lab: ServeLab,
}

/// `hearth-lab serve`'s settings beyond `hearth serve`'s: for tests and benchmarks that
/// emulate a home cluster on one machine. Not in the user's `hearth`.
#[derive(Args, Debug, Clone, Default)]
pub struct ServeLab {
    /// Tokens per prompt chunk with micro-batches in flight, instead of the chunk planned
    /// for each prompt. A chunk rounds as a batch of its size does: equal to `--max-batch`,
    /// prompts are fed exactly as the single node feeds them (and reach their first token
    /// later).
    #[arg(long, env = "HEARTH_PROMPT_CHUNK")]
    pub prompt_chunk: Option<usize>,
    #[command(flatten)]
    pub hop: HopLab,
    /// Every device releases each window after running it, as devices whose memory cannot
    /// hold their windows do (reads them from disk again).
    #[arg(long, env = "HEARTH_RELEASE_WINDOWS")]
    pub release_windows: bool,
}

/// A home network's link latency, emulated on one machine (`hearth-lab serve` and `worker`).
#[derive(Args, Debug, Clone, Default)]
pub struct HopLab {
    /// Delay every ring frame this node sends by this many milliseconds.
    #[arg(long, env = "HEARTH_EMULATE_HOP_MS", default_value_t = 0.0)]
    pub emulate_hop_ms: f64,
}

/// The prompt cache's room (`serve` and `worker`): on a ring each member keeps its own
/// windows' rows of every block, under the same three settings.
#[derive(Args, Debug, Clone)]
pub struct PromptCacheArgs {
    /// MiB of RAM for computed prompt prefixes kept beyond the slots (blocks of 64 tokens'
    /// K/V rows): a request that starts with a kept prefix (a system prompt and tools sent
    /// again, a conversation whose slot was reused) has those rows written back instead of
    /// computed, and answers as it would have cold. Default: an eighth of the memory this
    /// process may use (its cgroup's limit, else what is available), at most 1024. 0: none
    /// kept in RAM. On a ring every member keeps its own windows' rows of a block, and the
    /// head's plan leaves each member room for its share.
    #[arg(long, env = "HEARTH_PROMPT_CACHE_RAM")]
    pub prompt_cache_ram: Option<u64>,
    /// Directory where prompt-cache blocks are also written, to be read back after they
    /// leave RAM and after a restart (a subdirectory per model file, cache type and layout;
    /// a block of another one is never read). Default: $XDG_CACHE_HOME/hearth/prompt-cache
    /// (~/.cache/hearth/prompt-cache). `--prompt-cache-size 0`: nothing on disk.
    #[arg(long, env = "HEARTH_PROMPT_CACHE_DIR")]
    pub prompt_cache_dir: Option<PathBuf>,
    /// MiB of disk the prompt cache's directory may hold (every model's blocks together;
    /// the least recently used go first). 0: nothing on disk.
    #[arg(long, env = "HEARTH_PROMPT_CACHE_SIZE", default_value_t = 8192)]
    pub prompt_cache_size: u64,
}

impl PromptCacheArgs {
    pub fn config(&self) -> crate::runtime::generation::PrefixCacheConfig {
        const MIB: u64 = 1 << 20;
        let dir = self.prompt_cache_dir.clone().or_else(crate::runtime::generation::default_prompt_cache_dir);
        // A small device (a phone, a 1 GiB container) keeps a small cache beside its layers.
        const DEFAULT_RAM: u64 = 1024 * MIB;
        const SHARE_OF_MEMORY: u64 = 8;
        let ram_bytes = match self.prompt_cache_ram {
            Some(mib) => mib.saturating_mul(MIB),
            None => engine::residency::memory_budget().map_or(DEFAULT_RAM, |b| (b.bytes / SHARE_OF_MEMORY).min(DEFAULT_RAM)),
        };
        crate::runtime::generation::PrefixCacheConfig { ram_bytes, dir, disk_bytes: self.prompt_cache_size.saturating_mul(MIB) }
    }
}

/// Finding each other on the LAN (`serve` and `worker`): on whenever a cluster secret is
/// set, since every datagram is signed with it.
#[derive(Args, Debug, Clone)]
pub struct DiscoveryArgs {
    /// Neither announce nor look for a head on the LAN.
    #[arg(long, env = "HEARTH_NO_DISCOVERY")]
    pub no_discovery: bool,
    /// UDP port of the head's announcements and the workers' joins.
    #[arg(long, env = "HEARTH_DISCOVERY_PORT", default_value_t = transport::discovery::DEFAULT_PORT)]
    pub discovery_port: u16,
}

impl DiscoveryArgs {
    /// The discovery port, when discovery is on: a real cluster secret and no
    /// `--no-discovery` (the insecure mode's well-known secret would let anyone join).
    pub fn port(&self, secret: Option<&str>) -> Option<u16> {
        (!self.no_discovery && secret.is_some_and(|s| !s.is_empty())).then_some(self.discovery_port)
    }
}

#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// This device's own copy of the head's model (GGUF). Without it (or when it is
    /// another file than the head's) the worker fetches the head's model from the head:
    /// the file's header and the layers it is given, nothing else, into --model-dir.
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
    /// Where models fetched from a head are kept (sparse files: only the fetched layers
    /// take disk). Default: `shipped` in the models folder.
    #[arg(long, env = "HEARTH_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
    /// The most disk the models in --model-dir may take, e.g. `40G` or `500M`; older
    /// fetched models are removed to stay within it. Default: no limit.
    #[arg(long, env = "HEARTH_DISK_BUDGET", value_parser = parse_size)]
    pub disk_budget: Option<u64>,
    /// Address to listen on for the head and the previous ring member.
    /// With discovery on, the default is every interface (the head is on the LAN).
    #[arg(long, env = "HEARTH_LISTEN", default_value = DEFAULT_WORKER_LISTEN)]
    pub listen: String,
    /// Shared secret of the ring; required on non-loopback addresses.
    #[arg(long, env = "HEARTH_CLUSTER_SECRET")]
    pub cluster_secret: Option<String>,
    /// Accept unauthenticated heads on a non-loopback address.
    #[arg(long, env = "HEARTH_INSECURE")]
    pub insecure: bool,
    /// The head to join, host[:port] of its discovery port, for networks that drop
    /// multicast and broadcast. Without it, a worker with a cluster secret finds the head
    /// by its announcements on the LAN.
    #[arg(long, env = "HEARTH_HEAD")]
    pub head: Option<String>,
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    #[command(flatten)]
    pub prompt_cache: PromptCacheArgs,
    /// This device's name in the head's plans and dashboards (default: the host name).
    #[arg(long, env = "HEARTH_NAME")]
    pub name: Option<String>,
    /// Compute threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    pub threads: Option<usize>,
    /// Do not read the next window ahead while other devices compute (for comparison).
    #[arg(long, env = "HEARTH_NO_PREFETCH")]
    pub no_prefetch: bool,
    /// Keep every weight in the model file's own layout, zero-copy in its mapping. By
    /// default the weights the CPU kernels prefer in an interleaved layout (Q4_0, Q4_K,
    /// IQ4_NL and others, depending on the CPU) are repacked into memory at load, as
    /// llama.cpp does: faster on most CPUs, and the same numbers as llama.cpp. Windows
    /// that must be paged from disk are never repacked.
    #[arg(long, env = "HEARTH_NO_REPACK")]
    pub no_repack: bool,
    /// Layers of each window to run on this machine's GPU: a number, or `auto` (what the
    /// head's plan says). A build without a GPU backend refuses a number above 0.
    #[arg(long, env = "HEARTH_GPU_LAYERS", default_value = "auto")]
    pub gpu_layers: crate::runtime::GpuLayers,
    /// Mixture-of-Experts models: of each window's GPU layers, how many keep their routed
    /// experts in RAM: a number, or `auto` (what the head's plan says).
    #[arg(long, env = "HEARTH_EXPERTS_IN_RAM", default_value = "auto", alias = "n-cpu-moe")]
    pub experts_in_ram: crate::runtime::GpuLayers,
    /// Settings for experiments, not for users: only `hearth-lab worker` sets them.
    #[arg(skip)]
    pub lab: HopLab,
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Threads for both engines.
    #[arg(long, env = "HEARTH_THREADS", default_value_t = 2)]
    pub threads: usize,
    /// Prompt length for the prompt-processing test.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded one at a time for the generation test.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Rounds; each round runs llama.cpp and hearth back to back (alternating which goes
    /// first). Reported: the best round of each (the least disturbed by the rest of the
    /// machine) and the median of the per-round ratios.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Layers on the accelerator, in both engines (llama.cpp's `-ngl`: its last N layers;
    /// hearth's first N, as a ring window's; a GPU build only). More than the model's
    /// layers puts the output layer there too, in both.
    #[arg(long, default_value_t = 0)]
    pub gpu_layers: usize,
    /// MoE models: of those GPU layers, how many keep their routed experts in RAM, in both
    /// engines (llama.cpp's `--n-cpu-moe` for the same layers).
    #[arg(long, default_value_t = 0)]
    pub experts_in_ram: usize,
    /// Sequences decoding together in the batched decode test (llama-server's slots with
    /// as many streams; 0 or 1 leaves the test out).
    #[arg(long, default_value_t = 8)]
    pub sequences: usize,
    /// After the rounds, one more batched decode of each engine with every ggml op timed
    /// alone (ggml's eval callback; times are inflated by a wake-up per op, alike for
    /// both): where the two engines' steps differ.
    #[arg(long)]
    pub ops: bool,
    /// Both engines keep every weight in the file's mapping (llama.cpp's `--no-repack`),
    /// shared between them and with the page cache, instead of each repacking a copy into
    /// its own memory: what lets a model near the RAM's size be measured at all (a
    /// 15 GB Gemma-4-26B-shaped file repacked three times does not fit 24 GiB).
    #[arg(long)]
    pub no_repack: bool,
    /// A model keeping a recurrent state (Qwen3.5): after the rounds, time speculative
    /// verification with this many draft tokens per step, half of them accepted, the
    /// state taken back by hearth's in-graph snapshot against a host checkpoint taken
    /// before each step (both then compute the accepted drafts again). 0 leaves it out.
    #[arg(long, default_value_t = 0)]
    pub draft_state: usize,
}

#[derive(Args, Debug, Clone)]
pub struct FetchArgs {
    /// Folder to put the model in (default: $HEARTH_MODELS_DIR or ./models).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Runs the command the user asked for.
pub fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Worker(args) => worker::run(args),
        Command::Tool(tool) => run_tool(tool),
    }
}

fn run_tool(tool: Tool) -> Result<(), Box<dyn std::error::Error>> {
    match tool {
        Tool::Bench(args) => bench::run(args),
        Tool::BenchServe(args) => bench_serve::run(args),
        Tool::FetchModel(args) => fetch_model(args),
        Tool::Pull(args) => pull::run(args),
        Tool::Models(args) => pull::models(args),
        Tool::Plan(args) => plan::run(args),
        Tool::Profile(args) => profile::run(args),
        Tool::Quantize(args) => quantize::run(args),
        Tool::Secret => {
            println!("{}", transport::ClusterSecret::generate());
            Ok(())
        }
        Tool::RenderTemplate => Ok(engine::template_sandbox::serve_child()?),
    }
}

/// Runs the `hearth-lab` command asked for.
pub fn run_lab(cli: LabCli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        LabCommand::Serve(LabServeArgs { serve, lab }) => serve::run(ServeArgs { lab, ..serve }),
        LabCommand::Worker(LabWorkerArgs { worker, lab }) => worker::run(WorkerArgs { lab, ..worker }),
        LabCommand::MakeModel(args) => make_model::run(args),
        LabCommand::WorkerProfile(args) => worker_profile::run(args),
        LabCommand::Tool(tool) => run_tool(tool),
    }
}

fn fetch_model(args: FetchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let dir = args.dir.unwrap_or_else(default_model::models_dir);
    let path = default_model::ensure_default_model(&dir)?;
    println!("{}", path.display());
    Ok(())
}

/// The `hearth` binary's whole body.
pub fn main() -> std::process::ExitCode {
    start(|| run(Cli::parse()))
}

/// The `hearth-lab` binary's whole body, and the system tests' server under test.
pub fn lab_main() -> std::process::ExitCode {
    start(|| run_lab(LabCli::parse()))
}

fn start(command: impl FnOnce() -> Result<(), Box<dyn std::error::Error>>) -> std::process::ExitCode {
    crate::process::settle_openmp_environment();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,llama-cpp-2=warn,llama_cpp_2=warn")))
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in log files or `docker logs`.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match command() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hearth: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("500"), Ok(500));
        assert_eq!(parse_size("40G"), Ok(40_000_000_000));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("2Gi"), Ok(2 << 30));
        assert_eq!(parse_size("500m"), Ok(500_000_000));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5X").is_err());
    }
}
