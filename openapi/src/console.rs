//! The console's data (`GET /console/state`, hearth extension): one snapshot of the head —
//! the model, every device with what it holds and how it does, the plan, and the load — as
//! JSON, or as a stream of snapshots (server-sent events) each time one changes. The web
//! console on `GET /` draws it; other tools may read it too. Cumulative counters (bytes,
//! seconds, tokens since the head started) let a reader derive rates between two
//! snapshots, as the console's charts do.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One snapshot of the head (`GET /console/state`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleState {
    /// Unix seconds, with fractions, when the snapshot was taken.
    pub at: f64,
    /// `ok`, or `degraded` while a ring member is lost (requests get 503).
    #[schema(example = "ok")]
    pub status: String,
    /// Why the head is degraded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Whether the head was started with `--admin-key` (re-planning from the console).
    pub admin: bool,
    pub model: ConsoleModel,
    /// The head first, then the workers in ring order, then candidates the plan leaves out.
    pub devices: Vec<ConsoleDevice>,
    pub plan: ConsolePlan,
    pub load: ConsoleLoad,
    /// Models on the head's disk: GGUF files in its models folder (`HEARTH_MODELS_DIR`,
    /// else `./models`) and models pulled from the Hugging Face hub into its cache.
    pub local_models: Vec<ConsoleLocalModel>,
}

/// A model on the head's disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleLocalModel {
    /// What `hearth serve --model` takes to serve it: a file name in the models folder, or
    /// `hf:owner/name:path` for a model in the hub cache.
    #[schema(example = "SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub name: String,
    /// Bytes of its file (every part of a split set).
    pub bytes: u64,
    /// Whether it is the model being served.
    pub served: bool,
}

/// The model being served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleModel {
    #[schema(example = "SmolLM2-135M-Instruct")]
    pub id: String,
    /// The GGUF architecture.
    #[schema(example = "llama")]
    pub arch: String,
    /// llama-quantize's name of the file type (empty if unknown).
    #[schema(example = "Q4_1")]
    pub quantization: String,
    pub parameters: u64,
    pub weight_bytes: u64,
    /// Context tokens per sequence (`--ctx-size`).
    pub context_length: u64,
    /// Sequences served at once (`--parallel`).
    pub parallel: u64,
    /// The embedding model served beside it, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embedding_model: Option<String>,
}

/// A device: a ring member under the running plan, or a candidate it leaves out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleDevice {
    /// `head`, or the worker's ring address.
    #[schema(example = "head")]
    pub name: String,
    /// The name it gave (`hearth worker --name`), or its address.
    pub label: String,
    /// `ok` (a member of the running ring), `lost` (the member the head cannot reach),
    /// `degraded` (the other members while the ring is broken), `joining` (a candidate the
    /// running plan has not weighed yet: it is planned at the head's next idle moment),
    /// `fetching` (fetching its windows from the head for a plan chosen with it: see
    /// `progress`), `standby` (a candidate the plan leaves out), `left` (it said it leaves,
    /// or was lost past `--member-grace`).
    #[schema(example = "ok")]
    pub state: String,
    /// A fetching device's progress, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// Whether the running plan gives it layers (or it relays).
    pub member: bool,
    /// Its position in the ring (0: the head); absent for a candidate outside it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ring_index: Option<u64>,
    /// Layer windows, one per round, `[start, end)`.
    pub layers: Vec<[u64; 2]>,
    /// Layers per token it runs, of them on its GPU, and of those with routed experts in RAM.
    pub layer_count: u64,
    pub gpu_layers: u64,
    pub experts_in_ram: u64,
    /// Threads the head chose for it (members sharing a machine); absent: its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<u64>,
    /// Memory as last profiled (bytes); absent where no profile was gathered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ram_total_bytes: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ram_available_bytes: Option<f64>,
    /// Its GPU's free memory (bytes), where it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory_available_bytes: Option<f64>,
    /// The hop to it (one way, ms): measured by the ring where it has run, else the profile's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hop_ms: Option<f64>,
    /// The cost model's time per token of its part (ms): compute, memory, disk, network.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_ms: Option<ConsoleTimes>,
    /// Seconds its windows computed, and how many window steps, since the head started
    /// (the ring's reports): their ratio is its compute time per step.
    pub compute_seconds_total: f64,
    pub compute_steps_total: u64,
    /// Bytes it read from disk while computing and ahead of computing, since the start.
    pub disk_read_bytes_total: u64,
}

/// The cost model's time parts of one token on one device, milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleTimes {
    pub compute: f64,
    pub memory: f64,
    pub disk: f64,
    pub network: f64,
}

/// The running plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsolePlan {
    /// `halda`, `memory`, `compute`, `even`; `windows` for `--windows`; `single` without workers.
    #[schema(example = "halda")]
    pub source: String,
    /// Whether the head re-plans by itself when idle.
    pub automatic: bool,
    pub n_layer: u64,
    /// k: rounds each token makes around the ring.
    pub rounds: u64,
    /// Micro-batches in flight at once.
    pub micro_batches: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_tpot_ms: Option<f64>,
    /// Mean of the last single-token decode steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_tpot_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_hop_ms: Option<f64>,
    /// Aggregate decode tokens/s the plan forecasts for 8 streams, pipelined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forecast_tokens_per_s: Option<f64>,
    /// Plans adopted after the first.
    pub replans: u64,
    /// Unix seconds when the running plan started running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adopted_at: Option<u64>,
    /// Candidates the plan leaves out.
    pub dropped: Vec<String>,
    /// The last look at the plan (idle check or re-plan), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_check: Option<ConsoleCheck>,
}

/// One look at the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleCheck {
    /// Unix seconds.
    pub at: u64,
    pub applied: bool,
    /// Why it was applied or not, in words.
    pub reason: String,
    /// What moved since the running plan was judged.
    pub drift: Vec<String>,
    /// Workers still fetching their windows for a chosen plan, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetching: Option<String>,
}

/// The load since the head started: gauges now, counters cumulative.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ConsoleLoad {
    /// Sequences in a slot now, and waiting for one.
    pub running: u64,
    pub queued: u64,
    pub requests_total: u64,
    /// Answers with a 4xx or 5xx status.
    pub errors_total: u64,
    pub generated_tokens_total: u64,
    /// Prompt tokens computed, and reused from caches.
    pub prompt_tokens_total: u64,
    pub cached_prompt_tokens_total: u64,
    /// Time to first token and time per output token: sums (seconds) and counts.
    pub ttft_seconds_sum: f64,
    pub ttft_count: u64,
    pub tpot_seconds_sum: f64,
    pub tpot_count: u64,
    /// Speculative decoding: draft tokens proposed and accepted.
    pub draft_tokens_total: u64,
    pub accepted_tokens_total: u64,
}

/// The body of `POST /admin/what-if`: devices to plan without and devices to plan with a
/// copy of (by `name` as `/console/state` lists them; a copy is another machine with that
/// device's profile), and the strategy (without it: the running one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(default)]
pub struct WhatIfRequest {
    #[schema(example = json!(["192.168.1.20:9090"]))]
    pub without: Vec<String>,
    #[schema(example = json!(["head"]))]
    pub copies: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "halda", pattern = "^(halda|memory|compute|even)$")]
    pub strategy: Option<String>,
}

/// What the scheduler would plan (`POST /admin/what-if`), beside the running plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WhatIfAnswer {
    #[schema(example = "halda")]
    pub strategy: String,
    /// In ring order, the head first.
    pub members: Vec<WhatIfMember>,
    /// Devices the plan would leave out.
    pub dropped: Vec<String>,
    /// k: rounds each token would make around the ring.
    pub rounds: u64,
    pub predicted_tpot_ms: f64,
    /// Micro-batches it would keep in flight.
    pub micro_batches: u64,
    /// Aggregate decode tokens/s it forecasts for 8 streams.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forecast_tokens_per_s: Option<f64>,
    /// The running plan's predicted TPOT and 8-stream forecast.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_predicted_tpot_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_forecast_tokens_per_s: Option<f64>,
}

/// A member of a "what if" plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WhatIfMember {
    pub name: String,
    /// Layers per token it would run, and of them on its GPU.
    pub layers: u64,
    pub gpu_layers: u64,
    /// Its layer windows, one per round, `[start, end)`.
    pub windows: Vec<[u64; 2]>,
}
