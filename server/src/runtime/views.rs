//! What the admin API shows of a head: the running plan (`GET /admin/plan`), the cluster's
//! devices and candidates (`GET /admin/cluster`), and the outcome of each look at the plan.
//! Plain serialisable data, written by the ring (or a single node) and read by `http`: a
//! neutral home, so the HTTP room needs none of the ring's internals.

use scheduler::{Breakdown, DeviceProfile, DeviceSet, Plan, Prediction};
use serde::Serialize;

/// One ring member of the running plan.
#[derive(Debug, Clone, Serialize)]
pub struct MemberView {
    /// `head`, or the worker's address.
    pub name: String,
    /// Layers per window (w) and of them on the GPU (n), as the member placed them.
    pub window: usize,
    pub gpu_layers: usize,
    /// Of the GPU layers, those whose routed experts run from RAM (MoE models).
    pub experts_in_ram: usize,
    /// The plan's figures, where the member's own `--gpu-layers` / `--experts-in-ram`
    /// placed otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_gpu_layers: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_experts_in_ram: Option<usize>,
    /// Its layer windows, one per round: `[start, end)`.
    pub layers: Vec<[usize; 2]>,
    /// Threads the head chose for it, where it shares a machine with other members that
    /// compute at once; absent: its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// The cost model's view of it, when the plan came from the scheduler.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub set: Option<DeviceSet>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overloaded: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Breakdown>,
}

/// The outcome of one look at the cluster while idle (or of a forced re-plan).
#[derive(Debug, Clone, Serialize)]
pub struct CheckView {
    /// Unix seconds.
    pub at: u64,
    pub forced: bool,
    /// What moved since the profiles the running plan was judged on (empty: nothing).
    pub drift: Vec<String>,
    pub applied: bool,
    /// Why it was applied or not, in words.
    pub reason: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_tpot_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidate_tpot_ms: Option<f64>,
    /// The plan chosen waits for these workers to fetch their windows (progress in words);
    /// the head adopts it once they have them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetching: Option<String>,
}

impl CheckView {
    /// A look that applied nothing (yet), now.
    pub fn new(forced: bool, drift: Vec<String>, reason: String) -> CheckView {
        CheckView { at: crate::process::now_secs(), forced, drift, applied: false, reason, current_tpot_ms: None, candidate_tpot_ms: None, fetching: None }
    }
}

/// `GET /admin/plan`.
#[derive(Debug, Clone, Serialize)]
pub struct PlanView {
    /// `halda`, `memory`, `compute`, `even`; `windows` for a plan from `--windows`;
    /// `single` for a head without workers.
    pub source: String,
    /// Whether the head re-plans by itself when idle and a profile drifted.
    pub automatic: bool,
    pub n_layer: usize,
    /// k: rounds per token.
    pub rounds: usize,
    pub members: Vec<MemberView>,
    /// Workers the plan leaves out (they would slow the ring down).
    pub dropped: Vec<String>,
    pub predicted_tpot_ms: Option<f64>,
    /// Mean time of the last decode steps of a single token under this plan.
    pub measured_tpot_ms: Option<f64>,
    pub measured_steps: usize,
    /// Mean tokens in the KV cache during those steps.
    pub measured_context: Option<f64>,
    /// Mean time of one hop between members in those steps: each round trip less the
    /// workers' reported compute, over its hops (absent without workers).
    pub measured_hop_ms: Option<f64>,
    /// MoE models: the share of a non-resident layer's expert bytes the overloaded members
    /// read from disk per token in those steps (the cost model's `disk_share`, which
    /// otherwise assumes every expert a token uses misses the cache).
    pub measured_disk_share: Option<f64>,
    /// The cost model's TPOT for the running plan at that context (the plan itself is
    /// made for the full `--ctx-size`), with the measured hop in place of the profiles'
    /// control-call estimate: the figure to hold `measured_tpot_ms` against.
    pub predicted_tpot_ms_at_measured_context: Option<f64>,
    /// Micro-batches the ring holds in flight at once (1 on a single node).
    pub micro_batches: usize,
    /// What the running plan sustains with several requests or a long prompt: aggregate
    /// decode tokens/s for a few stream counts and the time to first token for a few
    /// prompt lengths, one micro-batch at a time and with `micro_batches` in flight.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forecast: Option<scheduler::Forecast>,
    /// Plans adopted after the first.
    pub replans: u64,
    /// Unix seconds when this plan started running.
    pub adopted_at: Option<u64>,
    pub last_check: Option<CheckView>,
}

impl PlanView {
    /// The view of `plan` run by `names` (ring order), with the cost model's prediction when
    /// there is one.
    pub fn of(source: &str, automatic: bool, plan: &Plan, names: &[String], prediction: Option<&Prediction>, dropped: Vec<String>) -> PlanView {
        let members = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let cost = prediction.and_then(|p| p.devices.get(i));
                MemberView {
                    name: name.clone(),
                    window: plan.devices[i].window,
                    gpu_layers: plan.devices[i].gpu_layers,
                    experts_in_ram: plan.devices[i].experts_in_ram,
                    planned_gpu_layers: None,
                    planned_experts_in_ram: None,
                    layers: plan.windows_of(i).iter().map(|r| [r.start, r.end]).collect(),
                    threads: Some(plan.devices[i].threads).filter(|&t| t > 0),
                    set: cost.map(|c| c.set),
                    overloaded: cost.map(|c| c.overloaded),
                    predicted: cost.map(|c| c.breakdown),
                }
            })
            .collect();
        PlanView {
            source: source.to_string(),
            automatic,
            n_layer: plan.n_layer,
            rounds: plan.rounds(),
            members,
            dropped,
            predicted_tpot_ms: prediction.map(|p| p.tpot_s * 1e3),
            measured_tpot_ms: None,
            measured_steps: 0,
            measured_context: None,
            measured_hop_ms: None,
            measured_disk_share: None,
            predicted_tpot_ms_at_measured_context: None,
            micro_batches: 1,
            forecast: None,
            replans: 0,
            adopted_at: None,
            last_check: None,
        }
    }
}

/// `GET /admin/cluster`.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ClusterView {
    /// The head first, then every configured worker, as last gathered; `comm_s` is the
    /// measured one-way hop latency.
    pub devices: Vec<DeviceProfile>,
    /// Unix seconds of that gathering.
    pub gathered_at: Option<u64>,
    /// Every candidate worker, configured or joined by discovery, live (the plan decides
    /// which it uses: `/admin/plan`).
    pub candidates: Vec<CandidateView>,
}

/// A candidate as `/admin/cluster` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateView {
    /// The worker's ring address (what the head dials).
    pub addr: String,
    /// The name it gave (`hearth worker --name`, default its host name); the address for a
    /// worker from `--workers`.
    pub name: String,
    /// `workers` (named on the command line) or `discovery`.
    pub origin: &'static str,
    /// `candidate`, or `left` (it said it leaves; planned with again once it joins again).
    pub state: &'static str,
    /// Unix seconds of its first join (discovered workers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub joined_at: Option<u64>,
    /// Seconds since the head last heard it (discovered workers answer every announcement).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_heard_s: Option<f64>,
}

/// What the scheduler would plan with other devices (`POST /admin/what-if`): a schedule
/// solved on the last gathered profiles with some devices left out or copied, not adopted.
#[derive(Debug, Clone)]
pub struct WhatIf {
    /// The devices it was solved on: the schedule's members and dropped index them.
    pub devices: Vec<DeviceProfile>,
    pub schedule: scheduler::Schedule,
    pub forecast: scheduler::Forecast,
    /// The running plan, to hold it against.
    pub current: PlanView,
}

/// The stream count plans are compared at in the console and "what if": a family's, an
/// agent's fan-out.
pub const FORECAST_STREAMS: usize = 8;

/// `forecast`'s aggregate tokens/s at [`FORECAST_STREAMS`] streams, pipelined.
pub fn streams_rate(forecast: Option<&scheduler::Forecast>) -> Option<f64> {
    forecast?.streams.iter().find(|s| s.streams == FORECAST_STREAMS).map(|s| s.pipelined_tokens_per_s)
}
