//! Prometheus metrics, all prefixed `hearth_` and described (docs/metrics.md lists them).
//! One recorder per process; every server in the process renders from it.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Latency buckets from 100 µs to 2 minutes: a hop on a home LAN is a few hundred µs, a
/// decode step on a phone-class device tens of ms, a long prompt on the ring a minute.
const SECONDS_BUCKETS: &[f64] = &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
const TOKEN_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0];

const UNLABELLED_COUNTERS: &[&str] = &[
    "hearth_prompt_tokens_total",
    "hearth_prompt_cached_tokens_total",
    "hearth_prompt_copied_tokens_total",
    "hearth_prompt_cache_restored_tokens_total",
    "hearth_prompt_cache_misses_total",
    "hearth_prompt_cache_written_bytes_total",
    "hearth_prompt_cache_saved_milliseconds_total",
    "hearth_generated_tokens_total",
    "hearth_cancelled_total",
    "hearth_ring_breaks_total",
    "hearth_ring_recoveries_total",
    "hearth_decode_sequence_steps_total",
    "hearth_spec_draft_tokens_total",
    "hearth_spec_accepted_tokens_total",
    "hearth_state_checkpoints_total",
    "hearth_http_connections_refused_total",
    "hearth_http_connections_displaced_total",
    "hearth_embedding_inputs_total",
    "hearth_embedding_tokens_total",
];

pub fn install() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_tokens".into()), TOKEN_BUCKETS))
            .expect("static buckets are valid")
            .install_recorder()
            .expect("one metrics recorder per process");
        describe();
        // Counters show at 0 from the first scrape: a counter that appears only at its
        // first event makes `rate` and `increase` miss that event, and a dashboard panel
        // about errors or breaks would show "no data" instead of 0.
        for name in UNLABELLED_COUNTERS {
            counter!(*name).increment(0);
        }
        handle
    })
}

pub fn render() -> String {
    install().render()
}

fn describe() {
    describe_counter!("hearth_requests_total", "HTTP requests by endpoint and status code");
    describe_counter!("hearth_model_bytes_served_total", Unit::Bytes, "Bytes of the model file this head sent to workers fetching their windows");
    describe_gauge!("hearth_model_fetch_bytes", Unit::Bytes, "A worker's fetch of the model from the head: bytes its windows need (kind=needed) and bytes verified there (kind=verified)");
    describe_counter!("hearth_model_pull_bytes_total", Unit::Bytes, "Bytes downloaded from the Hugging Face hub (--model hf:...)");
    describe_gauge!("hearth_model_pull_remaining_bytes", Unit::Bytes, "Bytes of the model being pulled from the hub still to download (0 when done)");
    describe_gauge!("hearth_model_fetch_refused_pieces", "Pieces a worker refused (bytes that did not match the head's manifest) and fetched again, in its current fetch");
    describe_histogram!("hearth_request_duration_seconds", Unit::Seconds, "HTTP request duration by endpoint, until the response headers (a stream: until it starts)");
    describe_histogram!("hearth_queue_time_seconds", Unit::Seconds, "Time a sequence waited in the queue for a slot");
    describe_histogram!("hearth_time_to_first_token_seconds", Unit::Seconds, "From enqueue to the first sampled token");
    describe_histogram!("hearth_time_per_output_token_seconds", Unit::Seconds, "Time between consecutive tokens of one sequence");
    describe_counter!("hearth_prompt_tokens_total", "Prompt tokens computed (not counting reused cache)");
    describe_counter!("hearth_prompt_cached_tokens_total", "Prompt tokens whose KV was reused from an earlier request");
    describe_counter!("hearth_prompt_copied_tokens_total", "Prompt tokens whose KV was copied from another slot (a prefix shared with another conversation)");
    describe_counter!("hearth_prompt_cache_hits_total", "Prompt-cache blocks found, by tier (ram, disk), each of 256 positions' K/V rows (--prompt-cache-ram, --prompt-cache-dir)");
    describe_counter!("hearth_prompt_cache_misses_total", "Prompt-cache blocks a prompt could have restored but that were not kept (never computed, evicted, or of another model file, cache type or plan)");
    describe_counter!("hearth_prompt_cache_restored_tokens_total", "Prompt tokens whose K/V rows were restored from the prompt cache instead of computed (also counted as cached)");
    describe_counter!("hearth_prompt_cache_read_bytes_total", Unit::Bytes, "Bytes of prompt-cache blocks read, by tier (ram, disk)");
    describe_counter!("hearth_prompt_cache_written_bytes_total", Unit::Bytes, "Bytes of prompt-cache blocks written to disk");
    describe_counter!("hearth_prompt_cache_saved_milliseconds_total", Unit::Milliseconds, "Time the prompt cache saved: restored tokens at the measured prompt rate, less the time restoring them took");
    describe_gauge!("hearth_prompt_cache_blocks", "Prompt-cache blocks kept, by tier (ram, disk; disk counts every model's blocks in the directory)");
    describe_gauge!("hearth_prompt_cache_bytes", Unit::Bytes, "Bytes of prompt-cache blocks kept, by tier (ram, disk)");
    describe_counter!("hearth_generated_tokens_total", "Tokens generated");
    describe_counter!("hearth_cancelled_total", "Sequences cancelled because the client went away");
    describe_counter!("hearth_state_checkpoints_total", "Copies of a sequence's recurrent state taken near its prompt's end (models with recurrent layers, Qwen3.5), which a later prompt sharing that prefix starts from");
    describe_gauge!("hearth_queue_size", "Sequences waiting for a slot");
    describe_gauge!("hearth_http_connections", "Open connections to the API port (--max-connections caps them)");
    describe_counter!("hearth_http_connections_refused_total", "Connections closed unanswered because every one of --max-connections had a request in progress");
    describe_counter!("hearth_http_connections_displaced_total", "Idle connections closed to make room for a new one at --max-connections");
    describe_gauge!("hearth_running_sequences", "Sequences in a slot (prefilling or generating)");
    describe_histogram!("hearth_step_tokens", "Tokens in one engine step (decode tokens plus prompt chunks)");
    describe_histogram!("hearth_step_decode_tokens", "Decode tokens in one engine step (= sequences generating)");
    describe_histogram!("hearth_step_duration_seconds", Unit::Seconds, "Engine step duration by phase: decode (only decode tokens) or prefill (with prompt tokens)");
    describe_gauge!("hearth_kv_cache_usage_ratio", "Share of KV cache cells holding tokens (live and cached prefixes)");
    describe_histogram!("hearth_ring_round_trip_seconds", Unit::Seconds, "One round of one step around the ring: from sending the activations to the first worker until they are back (workers' compute plus every hop)");
    describe_histogram!("hearth_ring_hop_seconds", Unit::Seconds, "Mean time of one hop between ring members in a round trip: the round trip less every worker's reported compute, over the hops (transfer, (de)serialisation, queueing)");
    describe_histogram!("hearth_device_compute_seconds", Unit::Seconds, "Time a device's window computed for one frame, by device (head, or a worker's address)");
    describe_counter!("hearth_device_disk_read_bytes_total", Unit::Bytes, "Bytes a device read from disk by phase: compute (page faults while its window ran, on the critical path) or prefetch (read ahead while others computed)");
    describe_gauge!("hearth_ring_up", "1 while the ring is whole, 0 while a member is lost (requests get 503)");
    describe_counter!("hearth_ring_breaks_total", "Times the ring broke (a member died, froze or failed a step)");
    describe_counter!("hearth_ring_recoveries_total", "Times a broken ring was formed again");
    describe_gauge!("hearth_cluster_candidates", "Workers the head may plan with, by origin (workers: named with --workers; discovery: joined) and state (candidate, or left: it said it leaves, or was lost past --member-grace)");
    describe_counter!("hearth_cluster_membership_changes_total", "Workers that joined by discovery (event joined), said they leave (left), or were planned without after --member-grace (lost)");
    describe_counter!("hearth_embedding_inputs_total", "Inputs embedded by the embedding model (--embedding-model)");
    describe_counter!("hearth_embedding_tokens_total", "Tokens of the inputs embedded");
    describe_histogram!("hearth_embedding_round_seconds", Unit::Seconds, "One round of the embedding model: every input queued at the time, from every request, in as few decodes as fit");
    describe_counter!("hearth_decode_sequence_steps_total", "Steps in which a sequence generated (one trip through the pipeline each); hearth_generated_tokens_total over this is the tokens per ring traversal");
    describe_counter!("hearth_spec_draft_tokens_total", "Draft tokens proposed by speculative decoding (--spec-mode)");
    describe_counter!("hearth_spec_accepted_tokens_total", "Draft tokens the model's own samples confirmed");
    describe_gauge!("hearth_plan_predicted_tpot_seconds", Unit::Seconds, "TPOT the scheduler's cost model predicts for the running plan (NaN for a plan it did not judge, such as a head without workers)");
    describe_gauge!("hearth_plan_measured_tpot_seconds", Unit::Seconds, "Mean time of the last 64 single-token decode steps under the running plan");
    describe_gauge!("hearth_plan_rounds", "k: rounds each token makes around the ring under the running plan");
    describe_counter!("hearth_replans_total", "Plans adopted after the first (idle re-planning or POST /admin/replan)");
    describe_gauge!("hearth_device_layers", "Layers per token a device runs under the running plan (0: left out or relay)");
    describe_gauge!("hearth_device_gpu_layers", "Of hearth_device_layers, those on the device's GPU");
    describe_gauge!("hearth_device_experts_in_ram_layers", "Of hearth_device_gpu_layers, those whose routed experts run from the device's RAM (MoE models)");
}

pub fn replanned() {
    counter!("hearth_replans_total").increment(1);
}

pub fn measured_tpot(seconds: f64) {
    gauge!("hearth_plan_measured_tpot_seconds").set(seconds);
}

/// The running plan: its predicted TPOT, k, and per device (by name) the layers per token
/// GPU layers per token, and of those with experts in RAM; devices left out show 0.
pub fn plan<'a>(predicted_s: Option<f64>, rounds: usize, members: impl Iterator<Item = (&'a str, usize, usize, usize)>, dropped: impl Iterator<Item = &'a str>) {
    match predicted_s {
        Some(t) => gauge!("hearth_plan_predicted_tpot_seconds").set(t),
        None => gauge!("hearth_plan_predicted_tpot_seconds").set(f64::NAN),
    }
    gauge!("hearth_plan_rounds").set(rounds as f64);
    // Registers the counter, so it shows (at 0) before the first re-plan.
    counter!("hearth_replans_total").increment(0);
    for (device, layers, gpu, experts) in members {
        gauge!("hearth_device_layers", "device" => device.to_string()).set(layers as f64);
        gauge!("hearth_device_gpu_layers", "device" => device.to_string()).set(gpu as f64);
        gauge!("hearth_device_experts_in_ram_layers", "device" => device.to_string()).set(experts as f64);
    }
    for device in dropped {
        gauge!("hearth_device_layers", "device" => device.to_string()).set(0.0);
        gauge!("hearth_device_gpu_layers", "device" => device.to_string()).set(0.0);
        gauge!("hearth_device_experts_in_ram_layers", "device" => device.to_string()).set(0.0);
    }
}

/// The ring's per-step metrics, registered once per plan (device names are labels):
/// recording a frame then costs no allocation and no registry lookup.
pub struct RingMeter {
    round_trip: Histogram,
    hop: Histogram,
    head: DeviceMeter,
    /// In ring order, matching the reports a frame brings back.
    workers: Vec<DeviceMeter>,
}

struct DeviceMeter {
    compute: Histogram,
    read: Counter,
    prefetch: Counter,
}

impl DeviceMeter {
    fn new(device: &str) -> DeviceMeter {
        DeviceMeter {
            compute: histogram!("hearth_device_compute_seconds", "device" => device.to_string()),
            read: counter!("hearth_device_disk_read_bytes_total", "device" => device.to_string(), "phase" => "compute"),
            prefetch: counter!("hearth_device_disk_read_bytes_total", "device" => device.to_string(), "phase" => "prefetch"),
        }
    }

    fn record(&self, r: &transport::StageReport) {
        self.compute.record(f64::from(r.compute_us) * 1e-6);
        self.read.increment(r.read_bytes);
        self.prefetch.increment(r.prefetch_bytes);
    }
}

impl RingMeter {
    pub fn new(head: &str, workers: &[String]) -> RingMeter {
        RingMeter {
            round_trip: histogram!("hearth_ring_round_trip_seconds"),
            hop: histogram!("hearth_ring_hop_seconds"),
            head: DeviceMeter::new(head),
            workers: workers.iter().map(|w| DeviceMeter::new(w)).collect(),
        }
    }

    /// The head ran one of its windows.
    pub fn head_step(&self, r: &transport::StageReport) {
        self.head.record(r);
    }

    /// One round trip of one step: its time, each worker's report and, from what the
    /// workers did not spend computing, the mean hop (returned, in seconds, when every
    /// worker reported).
    pub fn round_trip(&self, d: Duration, reports: &[transport::StageReport]) -> Option<f64> {
        let secs = d.as_secs_f64();
        self.round_trip.record(secs);
        let mut compute = 0.0;
        for (device, r) in self.workers.iter().zip(reports) {
            device.record(r);
            compute += f64::from(r.compute_us) * 1e-6;
        }
        // A frame that lost reports (a ring longer than a frame can report) says nothing of hops.
        if reports.len() != self.workers.len() {
            return None;
        }
        let hops = (self.workers.len() + 1) as f64;
        let hop = ((secs - compute) / hops).max(0.0);
        self.hop.record(hop);
        Some(hop)
    }
}

/// The ring was formed at start.
pub fn ring_formed() {
    gauge!("hearth_ring_up").set(1.0);
}

pub fn ring_broke() {
    gauge!("hearth_ring_up").set(0.0);
    counter!("hearth_ring_breaks_total").increment(1);
}

/// A worker joined, left or was lost (`event`), and the candidates by origin and state now.
pub fn cluster_membership(event: &'static str, candidates: &[(&'static str, &'static str, usize)]) {
    counter!("hearth_cluster_membership_changes_total", "event" => event).increment(1);
    for &(origin, state, n) in candidates {
        gauge!("hearth_cluster_candidates", "origin" => origin, "state" => state).set(n as f64);
    }
}

/// Bytes of the model file the head sent to workers that fetch it.
pub fn model_bytes_served(n: u64) {
    counter!("hearth_model_bytes_served_total").increment(n);
}

/// A worker's fetch of the model from the head, as its last answer said.
pub fn model_fetch(worker: &str, needed: u64, verified: u64, refused: u64) {
    gauge!("hearth_model_fetch_bytes", "worker" => worker.to_string(), "kind" => "needed").set(needed as f64);
    gauge!("hearth_model_fetch_bytes", "worker" => worker.to_string(), "kind" => "verified").set(verified as f64);
    gauge!("hearth_model_fetch_refused_pieces", "worker" => worker.to_string()).set(refused as f64);
}

pub fn ring_recovered() {
    gauge!("hearth_ring_up").set(1.0);
    counter!("hearth_ring_recoveries_total").increment(1);
}

pub fn request(endpoint: &'static str, status: u16, elapsed: Duration) {
    counter!("hearth_requests_total", "endpoint" => endpoint, "status" => status.to_string()).increment(1);
    histogram!("hearth_request_duration_seconds", "endpoint" => endpoint).record(elapsed.as_secs_f64());
}

pub fn queue_time(d: Duration) {
    histogram!("hearth_queue_time_seconds").record(d.as_secs_f64());
}

pub fn time_to_first_token(d: Duration) {
    histogram!("hearth_time_to_first_token_seconds").record(d.as_secs_f64());
}

pub fn time_per_output_token(d: Duration) {
    histogram!("hearth_time_per_output_token_seconds").record(d.as_secs_f64());
}

pub fn prompt_tokens(cached: usize, computed: usize) {
    counter!("hearth_prompt_cached_tokens_total").increment(cached as u64);
    counter!("hearth_prompt_tokens_total").increment(computed as u64);
}

/// Tokens of a prompt prefix whose KV was copied from another slot (also counted as cached
/// by `prompt_tokens`).
pub fn prefix_copied(tokens: usize) {
    counter!("hearth_prompt_copied_tokens_total").increment(tokens as u64);
}

/// A prompt-cache block found in `tier` ("ram" or "disk"); `bytes` read from disk (0 for RAM).
pub fn prefix_cache_hit(tier: &'static str, bytes: usize) {
    counter!("hearth_prompt_cache_hits_total", "tier" => tier).increment(1);
    if bytes > 0 {
        counter!("hearth_prompt_cache_read_bytes_total", "tier" => tier).increment(bytes as u64);
    }
}

/// Blocks a prompt could have restored that the cache did not hold.
pub fn prefix_cache_misses(blocks: usize) {
    counter!("hearth_prompt_cache_misses_total").increment(blocks as u64);
}

pub fn prefix_cache_written(bytes: usize) {
    counter!("hearth_prompt_cache_written_bytes_total").increment(bytes as u64);
}

/// Tokens restored from the prompt cache, and the seconds that saved (never negative).
pub fn prefix_cache_restored(tokens: usize, saved_s: f64) {
    counter!("hearth_prompt_cache_restored_tokens_total").increment(tokens as u64);
    counter!("hearth_prompt_cache_saved_milliseconds_total").increment((saved_s.max(0.0) * 1e3).round() as u64);
}

pub fn prefix_cache_size(tier: &'static str, blocks: usize, bytes: u64) {
    gauge!("hearth_prompt_cache_blocks", "tier" => tier).set(blocks as f64);
    gauge!("hearth_prompt_cache_bytes", "tier" => tier).set(bytes as f64);
}

pub fn generated_token() {
    counter!("hearth_generated_tokens_total").increment(1);
}

pub fn state_checkpoint() {
    counter!("hearth_state_checkpoints_total").increment(1);
}

pub fn cancelled() {
    counter!("hearth_cancelled_total").increment(1);
}

pub fn connections(n: usize) {
    gauge!("hearth_http_connections").set(n as f64);
}

pub fn connection_refused() {
    counter!("hearth_http_connections_refused_total").increment(1);
}

pub fn connection_displaced() {
    counter!("hearth_http_connections_displaced_total").increment(1);
}

pub fn queue_size(n: usize) {
    gauge!("hearth_queue_size").set(n as f64);
}

pub fn running(n: usize) {
    gauge!("hearth_running_sequences").set(n as f64);
}

pub fn step(d: Duration, tokens: usize, decode_tokens: usize) {
    histogram!("hearth_step_tokens").record(tokens as f64);
    histogram!("hearth_step_decode_tokens").record(decode_tokens as f64);
    let phase = if tokens == decode_tokens { "decode" } else { "prefill" };
    histogram!("hearth_step_duration_seconds", "phase" => phase).record(d.as_secs_f64());
}

pub fn kv_usage(ratio: f64) {
    gauge!("hearth_kv_cache_usage_ratio").set(ratio);
}

pub fn decode_sequence_steps(n: usize) {
    counter!("hearth_decode_sequence_steps_total").increment(n as u64);
}

pub fn speculation(proposed: usize, accepted: usize) {
    counter!("hearth_spec_draft_tokens_total").increment(proposed as u64);
    counter!("hearth_spec_accepted_tokens_total").increment(accepted as u64);
}

/// A round of the embedding model: `inputs` inputs of `tokens` tokens in all.
pub fn embedded(inputs: usize, tokens: usize, took: std::time::Duration) {
    counter!("hearth_embedding_inputs_total").increment(inputs as u64);
    counter!("hearth_embedding_tokens_total").increment(tokens as u64);
    histogram!("hearth_embedding_round_seconds").record(took.as_secs_f64());
}
