//! Command-line contract (see DESIGN.md): every flag also reads `HEARTH_<FLAG>`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use engine::default_model;

#[derive(Parser, Debug)]
#[command(name = "hearth", version, about = "Run big language models across the devices of a home, behind one OpenAI-compatible API")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start the head node: the HTTP API and this machine's share of the model.
    Serve(ServeArgs),
    /// Join a ring as a worker: wait for a head and run the layer windows it assigns.
    Worker(WorkerArgs),
    /// Benchmark hearth's engine against llama.cpp on the same GGUF, side by side.
    Bench(BenchArgs),
    /// Load-test the HTTP API: 1, 4 and 8 concurrent streaming clients against an
    /// in-process server; prints tokens/s, TTFT and TPOT.
    BenchServe(BenchServeArgs),
    /// Download the default model into the models folder (idempotent, SHA-256 checked).
    FetchModel(FetchArgs),
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
pub struct ModelArg {
    /// GGUF model file. Default: the default model, fetched on first use.
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
}

impl ModelArg {
    pub fn resolve(&self) -> Result<PathBuf, engine::Error> {
        match &self.model {
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
    /// Context cells per sequence.
    #[arg(long, env = "HEARTH_CTX_SIZE", default_value_t = 4096)]
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
    /// Largest request body in bytes; bigger ones get HTTP 413.
    #[arg(long, env = "HEARTH_BODY_LIMIT", default_value_t = 4 * 1024 * 1024)]
    pub body_limit: usize,
    /// Bearer token clients must send to /v1/* (none: open).
    #[arg(long, env = "HEARTH_API_KEY")]
    pub api_key: Option<String>,
    /// Name clients use for the model (default: the file name without .gguf).
    #[arg(long, env = "HEARTH_MODEL_ALIAS")]
    pub model_alias: Option<String>,
    /// Ring workers, in ring order (host:port of each `hearth worker --listen`).
    #[arg(long, env = "HEARTH_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Shared secret of the ring; required unless every address is loopback.
    #[arg(long, env = "HEARTH_CLUSTER_SECRET")]
    pub cluster_secret: Option<String>,
    /// Layers per window for the head and each worker, e.g. 4,3,3 (repeated each round
    /// until all layers are placed). Default: an even split in one round.
    #[arg(long, env = "HEARTH_WINDOWS", value_delimiter = ',')]
    pub windows: Vec<usize>,
    /// Where the last worker connects back to the head.
    #[arg(long, env = "HEARTH_RING_LISTEN", default_value = "127.0.0.1:0")]
    pub ring_listen: String,
    /// Send activations between ring members as f16 (half the bytes, not bit-exact).
    #[arg(long, env = "HEARTH_F16_ACTIVATIONS")]
    pub f16_activations: bool,
}

#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Address to listen on for the head and the previous ring member.
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:9090")]
    pub listen: String,
    /// Shared secret of the ring; required on non-loopback addresses.
    #[arg(long, env = "HEARTH_CLUSTER_SECRET")]
    pub cluster_secret: Option<String>,
    /// Accept unauthenticated heads on a non-loopback address.
    #[arg(long, env = "HEARTH_INSECURE")]
    pub insecure: bool,
    /// Compute threads (default: all cores).
    #[arg(long, env = "HEARTH_THREADS")]
    pub threads: Option<usize>,
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
}

#[derive(Args, Debug, Clone)]
pub struct FetchArgs {
    /// Folder to put the model in (default: $HEARTH_MODELS_DIR or ./models).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub fn fetch_model(args: FetchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let dir = args.dir.unwrap_or_else(default_model::models_dir);
    let path = default_model::ensure_default_model(&dir)?;
    println!("{}", path.display());
    Ok(())
}
