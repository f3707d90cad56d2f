//! What a ring sustains with several micro-batches in flight, beside the paper's latency
//! model (`cost`), which is about one token of one sequence going round alone.
//!
//! Each member's time for a micro-batch of `b` tokens, each attending `c` cells of its own
//! sequence's cache, is its weights' time for `b` rows plus each token's attention:
//! `t(b, c) = w·f(b) + b·a·c`, where `w` is the member's predicted decode time without a
//! cache, `f` the cost of `b` rows as a multiple of one (`RowCost`: measured for small
//! batches, then σ per row, `prompt_token_share`) and `a` what the cache adds to the
//! prediction per cell. Tokens of a batch share the weights but not their sequences'
//! caches, so a plan judged at a long context must not count its attention once per
//! batch. The hop to the next member adds to a micro-batch's way round (`R`), not to the
//! member's busy time. With `m` micro-batches in flight a member works on one while the
//! others travel, so:
//!
//! - a prompt of `n` tokens cut into `k` chunks of `b` (tokens attending `(n + b)/2` cells
//!   on average) reaches its first token after `R(b) + (k − 1)·max(B(b), R(b)/m)`, where
//!   `R` is the sum of the members' times and hops (one chunk all the way round) and `B` the
//!   slowest member's (the pipeline's beat); one micro-batch at a time it takes `k·R(b)`;
//! - `s` decoding streams at context `c` split into `m` groups of `g = ⌈s/m⌉` make `s`
//!   tokens every `max(R(g), m·B(g))` seconds; one micro-batch at a time, every `R(s)`.
//!
//! The head's output layer is charged only for the rows that want logits: every decode
//! token, a prompt's last token (so `R` and `B` of a prompt's chunks leave it out, and the
//! prompt pays it once). Sampling on the head is left out: it is the same in every shape.

use serde::{Deserialize, Serialize};

use crate::cost::{head_output_s, predict_ring, Prediction};
use crate::halda::DEFAULT_DISK_THRESHOLD;
use crate::plan::Plan;
use crate::profile::{DeviceProfile, ModelProfile};

/// σ for a device whose profile has none (an older profile): measured on this project's CI
/// machine kind (2 cores, AVX2, one thread) for the default model's Q4_1 layers, where a
/// token in a batch of 64 cost 0.38–0.54 of a decode step; models whose decode step is
/// mostly streaming weights measure lower.
pub const DEFAULT_PROMPT_TOKEN_SHARE: f64 = 0.45;

/// The cost of a batch of `b` rows through some weights, as a multiple of one row's:
/// the measured steps for small batches (`DeviceProfile::row_steps`), then the line
/// towards a prompt-sized batch, whose rows each cost σ of a step (`prompt_token_share`,
/// measured at `PROMPT_BATCH` rows), and σ per row past it. Without measured steps that is
/// the line `1 − σ + σ·b`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowCost {
    /// `steps[b − 1]`: a batch of `b` rows; empty when not measured.
    pub steps: Vec<f64>,
    pub share: f64,
}

/// The rows of the batch σ is measured at (the profiler's prompt-shaped batch).
pub const PROMPT_BATCH: usize = 64;

impl RowCost {
    /// The line through σ alone.
    pub fn linear(share: f64) -> RowCost {
        RowCost { steps: Vec::new(), share }
    }

    pub fn of(&self, b: usize) -> f64 {
        if b == 0 {
            return 0.0;
        }
        if let Some(&t) = self.steps.get(b - 1) {
            return t;
        }
        // Past the measured points: straight on to the prompt batch's cost (never below
        // the last point: a batch of more rows takes no less time), then σ per row.
        let (n, last) = (self.steps.len().max(1), self.steps.last().copied().unwrap_or(1.0));
        let prompt = (1.0 + self.share * (PROMPT_BATCH - 1) as f64).max(last);
        if b >= PROMPT_BATCH || n >= PROMPT_BATCH {
            return prompt + self.share * b.saturating_sub(PROMPT_BATCH) as f64;
        }
        last + (prompt - last) * (b - n) as f64 / (PROMPT_BATCH - n) as f64
    }
}

/// One member's time for a micro-batch of `b` tokens attending `c` cells each, `r` of
/// which want logits: its layers' weights for `b` rows, each token's attention, on the
/// head the output layer for `r` rows, and reading paged-out weights (once per batch).
/// The hop to the next member is latency: it adds to a micro-batch's way round, not to
/// the member's busy time (the links run beside the compute).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    pub name: String,
    /// One token's time through the member's layers without a cache.
    pub weights_s: f64,
    pub rows: RowCost,
    /// One token's attention per cell of its sequence's cache.
    pub per_cell_s: f64,
    /// Pages read from disk: weights, which the batch shares.
    pub disk_s: f64,
    pub hop_s: f64,
    /// The output layer (the head's only) for one row. Every decode token wants logits;
    /// of a prompt, only its last token does, so a prompt's chunks skip the output layer
    /// until the last one. On small models the output layer weighs several layers, so a
    /// plan balanced for decoding (a lighter head) is not balanced for prefill.
    pub output_s: f64,
    pub output_rows: RowCost,
    /// The machine this member shares with other members (an index into
    /// `Pipelining::hosts`); `None`: a machine of its own.
    #[serde(default)]
    pub host: Option<usize>,
    /// Threads the times above are for (0: unknown, and never changed).
    #[serde(default)]
    pub threads: usize,
    /// Cores the member's process may use (0: no limit beyond its machine's).
    #[serde(default)]
    pub quota: f64,
}

impl StageTime {
    fn at(&self, b: usize, cells: f64, logits: usize) -> f64 {
        self.disk_s + self.weights_s * self.rows.of(b) + self.per_cell_s * cells * b as f64 + self.output_s * self.output_rows.of(logits)
    }

    /// Whether the member computes (a relay without layers only forwards).
    fn computes(&self) -> bool {
        self.weights_s > 0.0 || self.output_s > 0.0
    }

    /// Cores the member keeps busy while it computes.
    fn busy_cores(&self) -> f64 {
        crate::profile::HostShare { threads: self.threads, quota: self.quota, ..Default::default() }.busy_cores()
    }

    /// The member computing with `threads` threads instead: its kernels at the rate per
    /// thread it measured (an upper bound for the memory-bound part, which one thread
    /// streams at more than its share; `DeviceProfile::host`).
    fn with_threads(&self, threads: usize) -> StageTime {
        if self.threads == 0 || threads == 0 || threads == self.threads {
            return self.clone();
        }
        let slower = self.threads as f64 / threads as f64;
        StageTime { weights_s: self.weights_s * slower, per_cell_s: self.per_cell_s * slower, output_s: self.output_s * slower, threads, ..self.clone() }
    }
}

/// The members of a running plan as stages of a pipeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pipelining {
    pub stages: Vec<StageTime>,
    /// The cores of each machine that several members share (`StageTime::host`).
    #[serde(default)]
    pub hosts: Vec<f64>,
}

/// The smallest prompt chunk the head plans: ggml's CPU attention takes query rows of one
/// sequence in tiles of 64 (`GGML_FA_TILE_Q`, a GEMM-like kernel); fewer fall back to one
/// row at a time, which on long prompts costs several times more per token (measured: a
/// 2,178-token prompt in chunks of 40 spent 72% of a member's time in that kernel and took
/// 2.4x the CPU of the same prompt in chunks of 436). The linear model cannot see the step.
/// Chunks are also whole multiples of it: a part tile reads every cached cell's keys and
/// values as a whole tile does, for fewer rows (measured, a 2,178-token prompt through three
/// even members of the bigger random model: chunks of 83, 15.4 s to the first token; 128,
/// 12.1 s; 192, 13.2 s; 256, 13.0 s; 384, 14.6 s).
pub const MIN_PROMPT_CHUNK: usize = 64;

/// Micro-batches a plan keeps in flight when hearth chooses: of the depths from one per
/// member that computes (the head always does: it holds the output layer), so every
/// device has one to work on, up to one per stream of `BALANCE_STREAMS`, the one whose
/// forecast decodes those streams fastest (the smallest within `DEPTH_TIE`). More than
/// one per member pays where a small batch costs more per token than one alone
/// (`RowCost`): measured on the default model and three 0.6-core members, 8 streams
/// decoded at 95 tokens/s in 3 micro-batches of 2–3 and 172 in 8 of one. One when a
/// member is overloaded and pages its windows from disk, as prima.cpp runs (each
/// micro-batch in flight would read the released windows again).
pub fn auto_depth(plan: &Plan, prediction: &Prediction, pipelining: &Pipelining) -> usize {
    if prediction.devices.iter().any(|d| d.overloaded) {
        return 1;
    }
    let members = computing_members(plan);
    let rate = |m| pipelining.tokens_per_s(BALANCE_STREAMS, m, FORECAST_CONTEXT);
    let most = members.max(BALANCE_STREAMS);
    let per_member = rate(members);
    let depths = || (members..=most).filter(|&m| m == members || rate(m) > per_member * (1.0 + EXTRA_DEPTH_GAIN));
    let best = depths().map(rate).fold(0.0, f64::max);
    // One at a time where that is clearly faster: members that share a machine's cores
    // gain nothing by computing at once, and lose what smaller batches cost.
    if rate(1) > best * (1.0 + DEPTH_TIE) {
        return 1;
    }
    depths().find(|&m| rate(m) >= best * (1.0 - DEPTH_TIE)).unwrap_or(members)
}

/// How much faster than one micro-batch per member a deeper pipeline must forecast to be
/// kept. Each micro-batch costs every member a frame, a wake-up and a window's graph, and
/// the head its batching and sampling; none of that is in the row steps the forecast uses,
/// and with micro-batches waiting at a member it adds no latency the forecast would see.
/// Measured (docs/benchmarks.md, 2026-12-02): three emulated 0.66-core devices, the same
/// plan run side by side at 3 and 4 in flight, where the forecast put 4 ahead by 3–21%:
/// 3 was faster in six pairs of seven (by 2–12%), 4 in one (by 5%); at both depths the
/// workers' ggml time per 8 tokens was the same (143 ms), so the difference is per
/// micro-batch, outside the kernels. Where small batches cost several times one row (the
/// measured steps of `the_depth_follows_what_small_batches_cost`: 8 in flight forecast
/// 1.8x 3) the gain is well past it.
const EXTRA_DEPTH_GAIN: f64 = 0.25;

/// Members of `plan` that compute: the head always (it holds the output layer), and every
/// worker with layers (a relay without layers only forwards).
pub fn computing_members(plan: &Plan) -> usize {
    1 + plan.devices.iter().skip(1).filter(|d| d.window > 0).count()
}

/// Depths whose forecasts are this close decode alike: the smaller keeps fuller batches
/// (and fewer frames on the links).
const DEPTH_TIE: f64 = 0.02;

/// Streams the beat is balanced for: the forecast's largest count (a family, an agent's
/// fan-out).
const BALANCE_STREAMS: usize = 8;
/// How much longer one token may take for a shorter beat: rounding only. Between devices
/// of one speed a layer moved changes no sum; between a fast and a slow one it does, and
/// a single user's latency is what Halda's plan is for (and never worse than a
/// baseline's, which a looser slack broke: `scheduler/tests/properties.rs`).
const BALANCE_TPOT_SLACK: f64 = 1.0 + 1e-9;

/// `plan` with whole layers moved, one at a time, off the member that sets the beat of
/// decoding micro-batches in flight (`BALANCE_STREAMS` streams) onto another, while that
/// shortens the beat, overloads nobody and keeps the predicted TPOT (`predict_ring`)
/// within `BALANCE_TPOT_SLACK`. Halda's objective is one token's latency, which is
/// indifferent to where a layer runs among devices of one speed; the beat is not: with
/// even windows the head, which also holds the output layer, is the slowest member and
/// everyone else waits for it. A plan of one computing member, or one that pages windows
/// from disk (one micro-batch at a time whatever the beat), is returned as it is. GPU layers and experts stay where they are (only CPU layers move), and every
/// member keeps at least one layer (a head that relays only stays so).
pub fn balance_beat(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan) -> Plan {
    let predicted = predict_ring(devices, model, plan, DEFAULT_DISK_THRESHOLD);
    balance_beat_within(devices, model, plan, predicted.tpot_s * BALANCE_TPOT_SLACK)
}

/// The plan as stages of a pipeline and the depth `auto_depth` keeps for it.
pub fn depth_of(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan) -> (Pipelining, usize) {
    let pipelining = Pipelining::of(devices, model, plan);
    let depth = auto_depth(plan, &predict_ring(devices, model, plan, DEFAULT_DISK_THRESHOLD), &pipelining);
    (pipelining, depth)
}

/// `balance_beat` with the predicted TPOT kept under `limit` seconds instead.
fn balance_beat_within(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan, limit: f64) -> Plan {
    let pages = || predict_ring(devices, model, plan, DEFAULT_DISK_THRESHOLD).devices.iter().any(|d| d.overloaded);
    if devices.len() != plan.devices.len() || computing_members(plan) <= 1 || pages() {
        return plan.clone();
    }
    // The decode beat only: on small models (the output layer weighs several layers) a
    // lighter head costs prefill, where the output layer runs once per prompt, and the
    // forecast shows it. Measured on the default model, three equal members: decoding 8
    // streams 45.2 t/s and a 2,178-token prompt 54.2 s with the decode-balanced 5,12,13
    // against 35.7 t/s and 46.5 s with 10,10,10: the decode gain is the larger share.
    // The beat in flight, also where one at a time is faster as the plan stands: a
    // balanced plan may pipeline (`auto_depth` judges it afresh).
    // The beat, then every member's time slowest first: where two members tie at the beat
    // no single move shortens it, but a move off one of them is still progress (measured
    // profiles: the head with the output layer and a worker of 19 layers tied, the third
    // member kept 1 layer).
    let beat = |p: &Plan| {
        let (pipelining, depth) = depth_of(devices, model, p);
        let depth = if depth <= 1 { computing_members(p) } else { depth };
        let g = BALANCE_STREAMS.div_ceil(depth);
        let (p, cells) = (pipelining.at_depth(depth), FORECAST_CONTEXT as f64);
        let mut times: Vec<f64> = p.stages.iter().map(|s| s.at(g, cells, g)).collect();
        times.sort_by(|a, b| b.total_cmp(a));
        times.insert(0, p.beat_s(g, cells, g));
        times
    };
    // Lexicographically shorter, beyond rounding.
    let shorter = |a: &[f64], b: &[f64]| {
        for (x, y) in a.iter().zip(b) {
            if *x < y * (1.0 - 1e-9) {
                return true;
            }
            if *x > y * (1.0 + 1e-9) {
                return false;
            }
        }
        false
    };
    let mut best = plan.clone();
    let mut best_beat = beat(&best);
    // Each move takes a layer from somewhere, so there are at most as many as layers.
    for _ in 0..model.n_layer {
        let mut found: Option<(Plan, Vec<f64>)> = None;
        for from in 0..best.devices.len() {
            let d = &best.devices[from];
            if d.window <= d.gpu_layers || d.window <= 1 {
                continue;
            }
            for to in (0..best.devices.len()).filter(|&t| t != from) {
                let mut p = best.clone();
                p.devices[from].window -= 1;
                p.devices[to].window += 1;
                let cost = predict_ring(devices, model, &p, DEFAULT_DISK_THRESHOLD);
                if cost.tpot_s > limit || cost.devices.iter().any(|c| c.overloaded) {
                    continue;
                }
                let b = beat(&p);
                if shorter(&b, found.as_ref().map_or(&best_beat, |f| &f.1)) {
                    found = Some((p, b));
                }
            }
        }
        let Some((p, b)) = found else { break };
        best = p;
        best_beat = b;
    }
    best
}

/// How much longer one token alone may take in a plan chosen for several streams: a
/// quarter. Past that a single user (the common case at home, most of the day) pays too
/// much for what the others gain together.
const THROUGHPUT_TPOT_SLACK: f64 = 0.25;

/// The slacks on one token's time a plan for several streams is rebalanced within, each
/// tried: moving layers for the beat is greedy, so a loose limit can spend a token's time
/// on moves that gain the streams little, and a tight one stops before the move that
/// gains them most. The last is `THROUGHPUT_TPOT_SLACK`.
const THROUGHPUT_SLACK_STEPS: [f64; 3] = [0.02, 0.1, THROUGHPUT_TPOT_SLACK];

/// Device selection for `streams` streams at once (hearth's addition to Halda): of the
/// latency-best plan `chosen` and plans that keep more devices (`wider`: the set
/// iteration's solutions before device selection dropped some), each as it is and with its
/// layers rebalanced for the beat, the one with the most aggregate decode tokens/s
/// (forecast at `FORECAST_CONTEXT`, micro-batches as `auto_depth` keeps them) — taken only
/// where one token alone is at most `THROUGHPUT_TPOT_SLACK` slower and the aggregate gains
/// more, as a share, than that token loses. Halda drops a device that adds a hop for too
/// little compute, which is right for one user; with micro-batches in flight that device
/// works on another micro-batch while the rest do, so several users gain what one user
/// loses. Among devices of one speed Halda's latency is indifferent to where a layer runs,
/// and measured profiles differ by a percent or two: its plan may leave a device one layer
/// (a 0.66-core emulated device measured 1% slower got 1 of 30 layers, the others 10 and
/// 19: 90 tokens/s forecast for 8 streams against 132 balanced), which `balance_beat`'s
/// latency-exact moves cannot undo; the chosen plan is rebalanced here within the slack too.
/// Members are indices into `devices`; plans are in their ring order.
pub fn prefer_throughput(devices: &[DeviceProfile], model: &ModelProfile, streams: usize, chosen: (Vec<usize>, Plan), wider: Vec<(Vec<usize>, Plan)>) -> (Vec<usize>, Plan) {
    let judge = |members: &[usize], plan: &Plan| {
        let profs: Vec<DeviceProfile> = members.iter().map(|&i| devices[i].clone()).collect();
        let predicted = predict_ring(&profs, model, plan, DEFAULT_DISK_THRESHOLD);
        let pipelining = Pipelining::of(&profs, model, plan);
        let depth = auto_depth(plan, &predicted, &pipelining);
        let overloads = predicted.devices.iter().any(|d| d.overloaded);
        (predicted.tpot_s, pipelining.tokens_per_s(streams, depth, FORECAST_CONTEXT), overloads)
    };
    let (tpot, rate, _) = judge(&chosen.0, &chosen.1);
    let limit = tpot * (1.0 + THROUGHPUT_TPOT_SLACK);
    let mut best = (chosen.clone(), rate);
    // The chosen plan as it is was judged above: only its rebalanced forms are new.
    for (members, plan, as_is) in std::iter::once((chosen.0, chosen.1, false)).chain(wider.into_iter().map(|(m, p)| (m, p, true))) {
        if plan.check().is_err() {
            continue;
        }
        let profs: Vec<DeviceProfile> = members.iter().map(|&i| devices[i].clone()).collect();
        let rebalanced = THROUGHPUT_SLACK_STEPS.iter().map(|slack| balance_beat_within(&profs, model, &plan, tpot * (1.0 + slack)));
        for plan in as_is.then(|| plan.clone()).into_iter().chain(rebalanced) {
            let (t, r, overloads) = judge(&members, &plan);
            if t <= limit && !overloads && r / rate > t / tpot && r > best.1 {
                best = ((members.clone(), plan), r);
            }
        }
    }
    best.0
}

impl Pipelining {
    /// The plan `plan` of `devices` (its members, in ring order) for `model`, predicted as
    /// the ring runs it: without a cache for the weights' part, and at the model's context
    /// for what attention adds per cell. Members without layers that only relay still
    /// count their hop.
    pub fn of(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan) -> Pipelining {
        // The disk threshold only labels the devices' sets: any will do for the times.
        let bare = predict_ring(devices, &model.at_context(0), plan, DEFAULT_DISK_THRESHOLD);
        let full = predict_ring(devices, model, plan, DEFAULT_DISK_THRESHOLD);
        let cells = model.n_kv.max(1) as f64;
        let stages = devices
            .iter()
            .zip(bare.devices.iter().zip(&full.devices))
            .enumerate()
            .map(|(m, (dev, (bare, full)))| {
                let (b, f) = (&bare.breakdown, &full.breakdown);
                let output = if m == 0 { head_output_s(dev, model) } else { 0.0 };
                let weights = b.compute_s + b.memory_s;
                let attention = (f.compute_s + f.memory_s - weights).max(0.0);
                let layers = (weights - output).max(0.0);
                let sigma = if dev.prompt_token_share > 0.0 { dev.prompt_token_share.min(1.0) } else { DEFAULT_PROMPT_TOKEN_SHARE };
                let rows = RowCost { steps: dev.row_steps.clone(), share: sigma };
                let output_rows = if dev.output_row_steps.is_empty() { rows.clone() } else { RowCost { steps: dev.output_row_steps.clone(), share: sigma } };
                let share = dev.host.clone().unwrap_or_default();
                StageTime { name: full.name.clone(), weights_s: layers, rows, per_cell_s: attention / cells, disk_s: f.disk_s, hop_s: f.network_s, output_s: output, output_rows, host: None, threads: share.threads, quota: share.quota }
            })
            .collect();
        let mut p = Pipelining { stages, hosts: Vec::new() };
        p.share_hosts(devices);
        p
    }

    /// Marks the members that share a machine with another member (by `DeviceProfile::host`).
    fn share_hosts(&mut self, devices: &[DeviceProfile]) {
        for group in crate::profile::shared_machines(devices, |_| true) {
            let cores = group.iter().filter_map(|&j| devices[j].host.as_ref()).map(|h| h.cores).fold(0.0, f64::max);
            for &j in &group {
                self.stages[j].host = Some(self.hosts.len());
            }
            self.hosts.push(cores.max(1.0));
        }
    }

    /// Threads per member with `depth` micro-batches in flight: each its own, except on a
    /// machine shared with other members that compute, where those that may compute at
    /// once (at most `depth`) split its cores, one thread each at the least. Threads past
    /// the cores that ggml's barriers spin for collapse a step; members of one thread
    /// each never wait at a barrier, so they may outnumber the cores (they take turns).
    pub fn threads(&self, depth: usize) -> Vec<usize> {
        self.stages.iter().map(|s| self.threads_of(s, depth)).collect()
    }

    fn threads_of(&self, s: &StageTime, depth: usize) -> usize {
        let Some(h) = s.host else { return s.threads };
        let sharing = self.stages.iter().filter(|o| o.host == Some(h) && o.computes()).count();
        let at_once = depth.max(1).min(sharing);
        if at_once <= 1 || s.threads == 0 {
            return s.threads;
        }
        let each = ((self.hosts[h] + 1e-9) / at_once as f64).floor().max(1.0) as usize;
        s.threads.min(each)
    }

    /// The members as they compute with `depth` micro-batches in flight (`threads`).
    /// Borrowed, with nothing allocated, where no thread count changes (every machine its
    /// own member's): the head asks per micro-batch while prompts wait (`best_chunk`).
    pub fn at_depth(&self, depth: usize) -> std::borrow::Cow<'_, Pipelining> {
        if self.stages.iter().all(|s| self.threads_of(s, depth) == s.threads) {
            return std::borrow::Cow::Borrowed(self);
        }
        let stages = self.stages.iter().map(|s| s.with_threads(self.threads_of(s, depth))).collect();
        std::borrow::Cow::Owned(Pipelining { stages, hosts: self.hosts.clone() })
    }

    /// One micro-batch of `b` tokens attending `cells` cells each, `logits` of them
    /// wanting logits, all the way round.
    pub fn round_s(&self, b: usize, cells: f64, logits: usize) -> f64 {
        self.stages.iter().map(|s| s.at(b, cells, logits) + s.hop_s).sum()
    }

    /// The slowest member's busy time for that micro-batch: with enough in flight, one
    /// micro-batch leaves the ring every beat.
    /// Members that share a machine take turns on its cores: together they need their
    /// busy times times the cores each keeps busy, which the machine's cores serve.
    pub fn beat_s(&self, b: usize, cells: f64, logits: usize) -> f64 {
        let alone = self.stages.iter().map(|s| s.at(b, cells, logits)).fold(0.0, f64::max);
        let shared = (0..self.hosts.len()).map(|h| self.stages.iter().filter(|s| s.host == Some(h)).map(|s| s.at(b, cells, logits) * s.busy_cores()).sum::<f64>() / self.hosts[h]);
        shared.fold(alone, f64::max)
    }

    /// Time to first token of a prompt of `n` tokens in chunks of `chunk`, with up to
    /// `depth` micro-batches in flight.
    pub fn ttft_s(&self, n: usize, chunk: usize, depth: usize) -> f64 {
        self.at_depth(depth).ttft_with_threads(n, chunk, depth)
    }

    fn ttft_with_threads(&self, n: usize, chunk: usize, depth: usize) -> f64 {
        let n = n.max(1);
        let chunks = n.div_ceil(chunk.max(1));
        // Chunks of equal size: the batching loop's last one is smaller, the sum the same.
        let b = n.div_ceil(chunks);
        // Causal attention: a chunk's tokens attend the cells before them and each other;
        // over the prompt, `(n + b) / 2` each on average (late chunks cost more than early
        // ones, the sum is what counts).
        let cells = (n + b) as f64 / 2.0;
        // Only the last token wants logits: the output layer runs once, at the end.
        let round = self.round_s(b, cells, 0);
        let output = self.round_s(b, cells, 1) - round;
        if depth <= 1 {
            return chunks as f64 * round + output;
        }
        round + (chunks - 1) as f64 * self.beat_s(b, cells, 0).max(round / depth as f64) + output
    }

    /// The chunk (a multiple of `MIN_PROMPT_CHUNK`, or `max_batch` itself) that gives a
    /// prompt of `n` tokens its shortest time to first token; of chunks within 1% of it,
    /// the largest (fewer, fuller batches).
    pub fn best_chunk(&self, n: usize, max_batch: usize, depth: usize) -> usize {
        let max_batch = max_batch.max(1);
        if depth <= 1 || self.stages.is_empty() {
            return max_batch;
        }
        // Called per micro-batch while prompts wait: the sizes are an iterator, not a Vec.
        let sizes = || (1..=max_batch / MIN_PROMPT_CHUNK).map(|i| i * MIN_PROMPT_CHUNK).chain((max_batch % MIN_PROMPT_CHUNK != 0).then_some(max_batch));
        let p = self.at_depth(depth);
        let best = sizes().map(|b| p.ttft_with_threads(n, b, depth)).fold(f64::INFINITY, f64::min);
        sizes().rev().find(|&b| p.ttft_with_threads(n, b, depth) <= best * 1.01).unwrap_or(max_batch)
    }

    /// Aggregate decode tokens/s of `streams` sequences with `context` tokens in their
    /// caches, with up to `depth` micro-batches in flight (one group of sequences each).
    pub fn tokens_per_s(&self, streams: usize, depth: usize, context: usize) -> f64 {
        let streams = streams.max(1);
        let m = depth.clamp(1, streams);
        let g = streams.div_ceil(m);
        let cells = context as f64;
        let p = self.at_depth(m);
        let period = if m == 1 { p.round_s(streams, cells, streams) } else { p.round_s(g, cells, g).max(m as f64 * p.beat_s(g, cells, g)) };
        streams as f64 / period
    }

    /// The forecast `hearth plan` and `/admin/plan` show: decode throughput for a few
    /// stream counts and the time to first token for a few prompt lengths, one
    /// micro-batch at a time and with `depth` in flight.
    pub fn forecast(&self, depth: usize, max_batch: usize) -> Forecast {
        let c = FORECAST_CONTEXT;
        let streams = FORECAST_STREAMS
            .iter()
            .map(|&s| StreamsForecast { streams: s, one_at_a_time_tokens_per_s: self.tokens_per_s(s, 1, c), pipelined_tokens_per_s: self.tokens_per_s(s, depth, c) })
            .collect();
        let prompts = FORECAST_PROMPTS
            .iter()
            .map(|&n| {
                let chunk = self.best_chunk(n, max_batch, depth);
                PromptForecast { tokens: n, chunk, one_at_a_time_ttft_s: self.ttft_s(n, max_batch, 1), pipelined_ttft_s: self.ttft_s(n, chunk, depth) }
            })
            .collect();
        Forecast { micro_batches: depth, context: c, streams, prompts }
    }
}

/// Stream counts and prompt lengths a forecast covers: one user, a family, a fan-out; a
/// chat turn, a long document, a coding tool's context.
const FORECAST_STREAMS: &[usize] = &[1, 4, 8];
const FORECAST_PROMPTS: &[usize] = &[512, 2000, 8000];
/// Tokens in each stream's cache for the decode figures: a chat turn's question and
/// answer. Attention grows with it; the plan itself is judged at the full context.
pub const FORECAST_CONTEXT: usize = 512;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    /// Micro-batches the ring holds in flight at once.
    pub micro_batches: usize,
    /// Tokens in each stream's cache for the decode figures.
    pub context: usize,
    pub streams: Vec<StreamsForecast>,
    pub prompts: Vec<PromptForecast>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamsForecast {
    pub streams: usize,
    pub one_at_a_time_tokens_per_s: f64,
    pub pipelined_tokens_per_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptForecast {
    pub tokens: usize,
    /// Tokens per chunk with micro-batches in flight.
    pub chunk: usize,
    pub one_at_a_time_ttft_s: f64,
    pub pipelined_ttft_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member whose batch of `b` tokens takes `fixed + b·per_token` seconds.
    fn stage(name: String, fixed: f64, per_token: f64) -> StageTime {
        let w = fixed + per_token;
        StageTime { name, weights_s: w, rows: RowCost::linear(per_token / w), per_cell_s: 0.0, disk_s: 0.0, hop_s: 0.0, output_s: 0.0, output_rows: RowCost::linear(0.0), host: None, threads: 0, quota: 0.0 }
    }

    fn even(members: usize, fixed: f64, per_token: f64) -> Pipelining {
        Pipelining { stages: (0..members).map(|i| stage(format!("d{i}"), fixed, per_token)).collect(), hosts: Vec::new() }
    }

    #[test]
    fn one_micro_batch_at_a_time_is_the_sum_of_the_members() {
        let p = even(3, 0.004, 0.001);
        // 2,000 tokens in 4 chunks of 500: each goes round (3 × 0.504 s).
        assert!((p.ttft_s(2000, 512, 1) - 4.0 * 3.0 * 0.504).abs() < 1e-9);
        assert!((p.tokens_per_s(8, 1, 0) - 8.0 / (3.0 * 0.012)).abs() < 1e-6);
    }

    #[test]
    fn three_even_members_approach_three_times_the_throughput_of_one_at_a_time() {
        // Compute-bound members (a token in a batch costs most of a step): nearly 3x.
        let p = even(3, 0.001, 0.002);
        let one = p.tokens_per_s(8, 1, 0);
        let three = p.tokens_per_s(8, 3, 0);
        assert!(three / one > 2.0 && three / one < 3.0, "{one} vs {three}");
        // Members that mostly stream weights (a batch of 8 costs little more than one
        // token) gain less: the batch of 8 already shared the weights.
        let bandwidth_bound = even(3, 0.004, 0.0004);
        let gain = bandwidth_bound.tokens_per_s(8, 3, 0) / bandwidth_bound.tokens_per_s(8, 1, 0);
        assert!(gain > 1.2 && gain < three / one, "{gain}");
        // More places in flight than streams: no better than one per stream.
        assert_eq!(p.tokens_per_s(2, 3, 0), p.tokens_per_s(2, 2, 0));
    }

    #[test]
    fn the_best_chunk_cuts_a_long_prompt_into_several_and_keeps_a_short_one_whole() {
        let p = even(3, 0.004, 0.0005);
        let n = 2000;
        let chunk = p.best_chunk(n, 512, 3);
        assert!(chunk < 512 && chunk % MIN_PROMPT_CHUNK == 0, "chunk {chunk}");
        // A batch limit under one tile, or between tiles, is a chunk too.
        assert_eq!(p.best_chunk(n, 24, 3), 24);
        assert!([64, 100].contains(&p.best_chunk(n, 100, 3)));
        let pipelined = p.ttft_s(n, chunk, 3);
        let today = p.ttft_s(n, 512, 1);
        assert!(pipelined < 0.5 * today, "{pipelined} vs {today}");
        // Nothing is gained by cutting when there is one stage.
        assert_eq!(even(1, 0.004, 0.0005).best_chunk(n, 512, 3), 512);
        // Depth 1: the batch size, whatever the prompt.
        assert_eq!(p.best_chunk(n, 512, 1), 512);
    }

    #[test]
    fn a_slow_member_sets_the_beat() {
        let mut p = even(3, 0.004, 0.0005);
        p.stages[1] = stage("slow".into(), 0.004, 0.002);
        let b = 100;
        assert_eq!(p.beat_s(b, 0.0, 0), p.stages[1].at(b, 0.0, 0));
        let chunks = 20;
        let cells = (b * chunks + b) as f64 / 2.0;
        assert!((p.ttft_s(b * chunks, b, 3) - (p.round_s(b, cells, 0) + (chunks - 1) as f64 * p.stages[1].at(b, cells, 0))).abs() < 1e-9);
    }

    #[test]
    fn a_batch_costs_its_measured_steps_then_sigma_per_row() {
        let sigma = 0.02;
        let line = RowCost::linear(sigma);
        for b in [1, 2, 7, 64, 100] {
            assert!((line.of(b) - (1.0 - sigma + sigma * b as f64)).abs() < 1e-12, "{b}");
        }
        assert_eq!(line.of(0), 0.0);
        // Odd counts pay an extra pass over the weights (as measured on a 2-core host).
        let steps = vec![1.0, 1.6, 2.5, 1.9, 2.9, 2.2, 3.1, 1.9];
        let measured = RowCost { steps: steps.clone(), share: sigma };
        for (i, &t) in steps.iter().enumerate() {
            assert_eq!(measured.of(i + 1), t);
        }
        // Past the points: on towards the prompt batch, never back down, then σ per row.
        let prompt = 1.0 + sigma * (PROMPT_BATCH - 1) as f64;
        assert!((measured.of(PROMPT_BATCH) - prompt).abs() < 1e-12);
        assert!((measured.of(PROMPT_BATCH + 10) - prompt - 10.0 * sigma).abs() < 1e-12);
        let mut last = measured.of(8);
        for b in 9..PROMPT_BATCH {
            assert!(measured.of(b) >= last && measured.of(b) <= prompt, "{b}");
            last = measured.of(b);
        }
        // Measured steps above the prompt line (a σ measured low): the line starts there.
        let high = RowCost { steps: vec![1.0, 2.0, 3.0], share: 0.001 };
        assert_eq!(high.of(PROMPT_BATCH), 3.0);
        assert!(high.of(40) == 3.0 && high.of(PROMPT_BATCH + 1) > 3.0);
    }

    /// Three members of one speed and the default model's shape (a heavy output layer):
    /// the depth is about one per member while a batch costs what the line through σ says,
    /// one per stream where a few rows cost several times one row (the output layer's),
    /// and one per member where batches cost little more than one row (streaming weights).
    #[test]
    fn the_depth_follows_what_small_batches_cost() {
        let (m, mut devices) = heavy_output_on_equal_devices();
        let plan = Plan::from_windows(30, &[10, 10, 10]).unwrap();
        let depth = |devices: &[DeviceProfile]| {
            let (p, d) = depth_of(devices, &m, &plan);
            // The fastest forecast of one per member (3) to one per stream, or within the tie
            // of it, and no smaller depth is.
            let rate = |d| p.tokens_per_s(8, d, FORECAST_CONTEXT);
            // Deeper than one per member only on a clear gain over it.
            let kept = |d: usize| d == 3 || rate(d) > rate(3) * (1.0 + EXTRA_DEPTH_GAIN);
            let best = (3..=8).filter(|&d| kept(d)).map(rate).fold(0.0, f64::max);
            if rate(1) > best * (1.0 + DEPTH_TIE) {
                assert_eq!(d, 1, "one at a time is faster");
                return d;
            }
            assert!((3..=8).contains(&d) && kept(d) && rate(d) >= best * (1.0 - DEPTH_TIE), "{d}");
            assert!((3..d).all(|e| !kept(e) || rate(e) < best * (1.0 - DEPTH_TIE)), "{d}");
            d
        };
        // The line through σ: about one per member (the head, heavier, may take one more).
        let linear = depth(&devices);
        assert!(linear <= 4, "{linear}");
        // Measured on the default model (`hearth profile`, 1 thread, 2-core AVX2 host): the
        // layers' batch of b rows costs nearly b·σ more, the output layer's odd counts up to
        // 7x one row.
        for d in devices.iter_mut() {
            d.row_steps = vec![1.0, 1.66, 2.24, 2.79, 3.33, 4.59, 4.39, 4.97];
            d.output_row_steps = vec![1.0, 2.83, 6.86, 3.75, 6.42, 4.63, 7.22, 4.19];
        }
        assert_eq!(depth(&devices), 8);
        // Weights streamed from memory: a batch costs little more than one row. With even
        // windows the head (its layers and the output layer) sets the beat, and one batch
        // of eight at a time is faster than three in flight (the forecast: 88 against 77
        // tokens/s), so that is the depth; with the beat balanced off the head, they pipeline.
        for d in devices.iter_mut() {
            d.row_steps = (0..8).map(|i| 1.0 + 0.02 * i as f64).collect();
            d.output_row_steps = d.row_steps.clone();
        }
        assert_eq!(depth(&devices), 1);
        let balanced = balance_beat(&devices, &m, &plan);
        let (_, d) = depth_of(&devices, &m, &balanced);
        assert!(d >= 3, "{d}");
        // Paging windows from disk: one at a time, whatever the forecast.
        let (p, _) = depth_of(&devices, &m, &plan);
        let mut overloaded = predict_ring(&devices, &m, &plan, DEFAULT_DISK_THRESHOLD);
        overloaded.devices[1].overloaded = true;
        assert_eq!(auto_depth(&plan, &overloaded, &p), 1);
    }

    /// Three members on one 2-core machine, two threads each (measured on the default
    /// model: 8 streams at 162.9 tokens/s one micro-batch at a time, 43.7 with four in
    /// flight and six spinning threads): in flight they may keep only two threads busy, so
    /// one each, and one at a time is faster: that is what they run. The same members on
    /// machines of their own, or in quotas that leave the cores enough (emulated devices),
    /// pipeline as before.
    #[test]
    fn members_that_share_a_machine_split_its_cores_and_pipeline_only_where_that_pays() {
        use crate::profile::HostShare;
        let (m, mut devices) = heavy_output_on_equal_devices();
        let plan = Plan::from_windows(30, &[10, 10, 10]).unwrap();
        let on = |devices: &mut [DeviceProfile], id: &str, cores: f64, threads: usize, quota: f64| {
            for d in devices.iter_mut() {
                d.host = Some(HostShare { id: id.into(), cores, threads, quota, own_memory: false });
            }
        };
        on(&mut devices, "", 2.0, 2, 2.0);
        let (alone, alone_depth) = depth_of(&devices, &m, &plan);
        assert!(alone.hosts.is_empty() && alone_depth >= 3, "unknown machines are machines of their own: {alone_depth}");

        on(&mut devices, "box", 2.0, 2, 2.0);
        let (p, depth) = depth_of(&devices, &m, &plan);
        assert_eq!(p.hosts, vec![2.0]);
        assert_eq!(p.threads(1), vec![2, 2, 2]);
        for d in 2..=8 {
            assert_eq!(p.threads(d), vec![1, 1, 1], "depth {d}");
        }
        assert_eq!(depth, 1);
        let one = p.tokens_per_s(8, 1, FORECAST_CONTEXT);
        assert_eq!(one, alone.tokens_per_s(8, 1, FORECAST_CONTEXT), "one at a time, sharing costs nothing");
        for d in 2..=8 {
            let rate = p.tokens_per_s(8, d, FORECAST_CONTEXT);
            assert!(rate < one && rate < alone.tokens_per_s(8, d, FORECAST_CONTEXT), "depth {d}: {rate} vs {one}");
        }
        // A prompt too: the forecast's chunked prefill on shared cores is no faster than
        // the same chunks one at a time.
        assert!(p.ttft_s(2000, 128, 3) >= p.ttft_s(2000, 128, 1) * 0.999, "{} vs {}", p.ttft_s(2000, 128, 3), p.ttft_s(2000, 128, 1));

        // Two threads each on a 4-core machine: two may compute at once with theirs, three
        // split the cores.
        on(&mut devices, "big", 4.0, 2, 4.0);
        let big = Pipelining::of(&devices, &m, &plan);
        assert_eq!((big.threads(2), big.threads(3)), (vec![2, 2, 2], vec![1, 1, 1]));

        // Emulated devices: one thread each in a quota of 0.66 core on a 2-core machine. The
        // quotas fit the cores and nobody spins: they pipeline like separate machines.
        on(&mut devices, "box", 2.0, 1, 0.66);
        let (q, q_depth) = depth_of(&devices, &m, &plan);
        assert!(q_depth >= 3 && q.threads(q_depth) == vec![1, 1, 1], "{q_depth}");
        let mut separate = devices.clone();
        on(&mut separate, "", 2.0, 1, 0.66);
        let s = Pipelining::of(&separate, &m, &plan);
        assert!((q.tokens_per_s(8, q_depth, FORECAST_CONTEXT) - s.tokens_per_s(8, q_depth, FORECAST_CONTEXT)).abs() < 1e-9);
    }

    /// A model of 30 layers whose output layer weighs five of them (as small models' do),
    /// and three devices of one speed.
    fn heavy_output_on_equal_devices() -> (ModelProfile, Vec<DeviceProfile>) {
        use crate::cost::tests::{dev, model};
        use crate::profile::{Os, PerQuant};
        let mut m = ModelProfile { n_layer: 30, layer_bytes: 2e7, input_bytes: 1e8, output_bytes: 1e8, ..model() };
        m.layer_flops = PerQuant { q4k: 2e7, ..PerQuant::default() };
        m.output_flops = PerQuant { q6k: 1e8, ..PerQuant::default() };
        (m, vec![dev(Os::Linux, 8e9), dev(Os::Linux, 8e9), dev(Os::Linux, 8e9)])
    }

    /// Three devices of one speed, a model whose output layer weighs as much as a few
    /// layers: even windows leave the head (layers + output) setting the beat; balanced,
    /// it keeps fewer layers, the beat is shorter and one token takes no longer.
    #[test]
    fn the_beat_is_balanced_off_the_head_without_slowing_one_token() {
        let (m, devices) = heavy_output_on_equal_devices();
        let even = Plan::from_windows(30, &[10, 10, 10]).unwrap();
        let balanced = balance_beat(&devices, &m, &even);
        balanced.check().unwrap();
        let w: Vec<usize> = balanced.devices.iter().map(|d| d.window).collect();
        assert!(w[0] < 10 && w[1] >= 10 && w[2] >= 10, "{w:?}");
        let tpot = |p: &Plan| predict_ring(&devices, &m, p, 1e9).tpot_s;
        assert!(tpot(&balanced) <= tpot(&even) * BALANCE_TPOT_SLACK, "{} vs {}", tpot(&balanced), tpot(&even));
        let beat = |p: &Plan| Pipelining::of(&devices, &m, p).beat_s(3, 512.0, 3);
        assert!(beat(&balanced) < 0.9 * beat(&even), "{} vs {}", beat(&balanced), beat(&even));
        // A prompt pays for it: its chunks skip the output layer, so the workers' longer
        // windows set its beat (the forecast once charged the output layer per token and
        // predicted the opposite; measured, a 2,178-token prompt took 54 s, not 37.5).
        let ttft = |p: &Plan| {
            let pipe = Pipelining::of(&devices, &m, p);
            pipe.ttft_s(2000, pipe.best_chunk(2000, 512, 3), 3)
        };
        assert!(ttft(&balanced) > ttft(&even), "{} vs {}", ttft(&balanced), ttft(&even));
        // One member: nothing to balance.
        let alone = Plan::from_windows(30, &[30]).unwrap();
        assert_eq!(balance_beat(&devices[..1], &m, &alone), alone);
    }

    /// Devices of (nearly) one speed, one measured a percent slower: Halda's latency plan
    /// may leave it a single layer (one token alone does not care where a layer runs), and
    /// latency-exact moves cannot give it more. Planned for 8 streams, the plan gives it
    /// its share, for many more tokens/s at a token's time within the slack.
    #[test]
    fn a_device_left_one_layer_gets_its_share_when_many_streams_are_planned() {
        let (m, mut devices) = heavy_output_on_equal_devices();
        devices[1].cpu_flops.q4k *= 0.99;
        devices[1].cpu_read_bw *= 0.99;
        let latency = Plan::from_windows(30, &[10, 1, 19]).unwrap();
        let windows = |p: &Plan| p.devices.iter().map(|d| d.window).collect::<Vec<_>>();
        assert_eq!(windows(&balance_beat(&devices, &m, &latency))[1], 1, "moves that slow one token are not balance_beat's");
        let rate = |p: &Plan| {
            let pipe = Pipelining::of(&devices, &m, p);
            pipe.tokens_per_s(8, auto_depth(p, &predict_ring(&devices, &m, p, 1e9), &pipe), FORECAST_CONTEXT)
        };
        let tpot = |p: &Plan| predict_ring(&devices, &m, p, 1e9).tpot_s;
        let (members, plan) = prefer_throughput(&devices, &m, 8, ((0..3).collect(), latency.clone()), Vec::new());
        assert_eq!(members, vec![0, 1, 2]);
        plan.check().unwrap();
        let w = windows(&plan);
        assert!(w[1] >= 8, "{w:?}");
        assert!(rate(&plan) > 1.3 * rate(&latency), "{} vs {}", rate(&plan), rate(&latency));
        assert!(tpot(&plan) <= tpot(&latency) * (1.0 + THROUGHPUT_TPOT_SLACK), "{} vs {}", tpot(&plan), tpot(&latency));
    }

    /// The output layer runs for the rows that want logits: each decode token, a prompt's
    /// last. A prompt of many chunks pays it once, whatever the chunk size.
    #[test]
    fn a_prompt_pays_the_output_layer_once_and_each_decode_token_its_share() {
        let (m, devices) = heavy_output_on_equal_devices();
        let plan = Plan::from_windows(30, &[10, 10, 10]).unwrap();
        let p = Pipelining::of(&devices, &m, &plan);
        let head = &p.stages[0];
        let output = head.output_s;
        assert!(output > 0.0 && p.stages[1].output_s == 0.0);
        // One token decoding alone costs what the latency model predicts, output included.
        let tpot = predict_ring(&devices, &m.at_context(0), &plan, 1e9).tpot_s;
        assert!((p.round_s(1, 0.0, 1) - tpot).abs() < 1e-9 * tpot);
        // With even windows the head is the slowest member decoding, but not in prefill.
        assert!(p.beat_s(8, 0.0, 8) == head.at(8, 0.0, 8) && head.at(8, 0.0, 8) > p.stages[1].at(8, 0.0, 8));
        // (The head reads each token's embedding row besides.)
        let (h, w) = (head.at(256, 0.0, 0), p.stages[1].at(256, 0.0, 0));
        assert!(h >= w && h < 1.01 * w, "{h} vs {w}");
        // One at a time: every chunk goes round without the output layer, the prompt pays
        // it once at the end.
        for chunk in [100, 250, 500] {
            let n = 1000;
            let chunks = n / chunk;
            let cells = (n + chunk) as f64 / 2.0;
            let expected = chunks as f64 * p.round_s(chunk, cells, 0) + output;
            assert!((p.ttft_s(n, chunk, 1) - expected).abs() < 1e-9 * expected, "chunk {chunk}");
        }
    }

    /// A plan judged at a long context: one token there costs what the plan predicts, but
    /// the tokens of a batch share only the weights; each attends its own sequence's cache.
    #[test]
    fn the_tokens_of_a_batch_share_the_weights_but_not_their_attention() {
        use crate::cost::tests::{dev, model};
        use crate::profile::{Os, PerQuant};
        let n_kv = 4096;
        // Layers of 20 MB against 17 MB of cache each at 4,096 tokens.
        let (heads, dim) = (8, 128);
        let mut m = ModelProfile { n_kv, n_head_k: heads, n_head_v: heads, head_dim_k: dim, head_dim_v: dim, layer_bytes: 2e7, input_bytes: 1e7, output_bytes: 1e7, ..model() };
        m.layer_flops = PerQuant { q4k: 2e7, f16: (4 * heads * dim * n_kv) as f64, ..PerQuant::default() };
        m.output_flops = PerQuant { q6k: 1e7, ..PerQuant::default() };
        let devices = vec![dev(Os::Linux, 8e9), dev(Os::Linux, 8e9), dev(Os::Linux, 8e9)];
        let plan = Plan::from_windows(10, &[4, 3, 3]).unwrap();
        let p = Pipelining::of(&devices, &m, &plan);
        let full = predict_ring(&devices, &m, &plan, 1e9).tpot_s;
        let bare = predict_ring(&devices, &m.at_context(0), &plan, 1e9).tpot_s;
        assert!(full > 1.5 * bare, "the cache should weigh: {full} vs {bare}");
        let c = n_kv as f64;
        assert!((p.round_s(1, c, 1) - full).abs() < 1e-9 * full, "{} vs {full}", p.round_s(1, c, 1));
        assert!((p.round_s(1, 0.0, 1) - bare).abs() < 1e-9 * full);
        // Eight sequences at the plan's context: eight times one sequence's attention.
        let attention = |b| p.round_s(b, c, b) - p.round_s(b, 0.0, b);
        assert!((attention(8) - 8.0 * attention(1)).abs() < 1e-9 * full);
        // A short context decodes faster than the plan's.
        assert!(p.tokens_per_s(8, 3, 128) > 1.5 * p.tokens_per_s(8, 3, n_kv));
    }
}
