//! Halda for a running head: the head measures itself, asks every worker for its device
//! profile, times a control round trip to each for the per-hop latency, profiles the model
//! from its GGUF, and lets the scheduler choose the windows — and which workers to leave
//! out. Done at ring formation (`serve --plan-strategy`, Halda by default) and again while
//! the queue is idle (`ring::board`), on fresh profiles.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::ModelFile;
use scheduler::{DeviceProfile, ModelProfile, Options, Schedule, Strategy};
use transport::{ClusterSecret, ControlClient, LinkConfig};

use super::membership::Membership;
use crate::error::{Error, Result};

const GB: f64 = 1e9;
/// The batch size a plan's forecast assumes for prompt chunks: `serve --max-batch`'s default.
const FORECAST_MAX_BATCH: usize = 512;
/// Round trips timed per worker; the fastest counts (the others met a busy machine).
const LATENCY_PROBES: usize = 3;
/// Pause between attempts to reach a worker that is still starting.
const RETRY: Duration = Duration::from_secs(1);
/// The name the head's own profile goes by in plans and `/admin/cluster`.
pub const HEAD_NAME: &str = "head";

/// Everything needed to plan the ring again: the candidates (every configured or joined worker, in
/// ring order, whether or not the current plan keeps them) and the model's profile.
pub struct Planner {
    pub membership: Arc<Membership>,
    pub model: ModelProfile,
    /// The scheduler's options; `options.strategy` is the one asked for at start.
    pub options: Options,
    secret: ClusterSecret,
    file: Arc<ModelFile>,
    path: PathBuf,
    threads: usize,
    /// Bytes of the head's RAM kept outside the plan (the prompt cache's RAM budget): the
    /// layers Halda gives the head must fit beside them.
    pub head_reserved: f64,
}

impl Planner {
    /// `streams`: sequences served at once with micro-batches in flight (1 when they go
    /// one at a time): what device selection weighs beside one token's latency.
    #[allow(clippy::too_many_arguments)]
    pub fn new(file: Arc<ModelFile>, path: PathBuf, membership: Arc<Membership>, secret: ClusterSecret, threads: usize, ctx: usize, kv: engine::CacheTypes, strategy: Strategy, streams: usize) -> Planner {
        let name = path.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        let model = crate::runtime::profiling::model::from_gguf(&file, &name, ctx, kv);
        Planner { membership, model, options: Options { strategy, streams: streams.max(1), ..Options::default() }, secret, file, path, threads, head_reserved: 0.0 }
    }

    /// Fresh profiles of the head and every candidate worker, in that order; a device's
    /// `name` is its address (`head` for the head). The measured parts come from each
    /// device's cache (a device is measured once, ~3 s); available memory and the hop
    /// latency are read live. Waits up to `wait` for workers that cannot be reached yet; a
    /// refusal fails at once. A candidate outside `needed` that cannot be reached or
    /// refuses is left out of the answer when `needed` is given (a worker the running plan
    /// does not use may come and go without stopping re-planning).
    pub fn gather(&self, rt: &tokio::runtime::Runtime, wait: Duration, needed: Option<&[String]>) -> Result<Vec<DeviceProfile>> {
        let mut head = crate::runtime::profiling::serving_profile(self.threads, Some((&self.path, &self.file)), &crate::models::models_dir())?;
        crate::runtime::profiling::refresh_memory(&mut head);
        head.name = HEAD_NAME.into();
        head.head = true;
        head.ram_available = (head.ram_available - self.head_reserved).max(0.0);
        let deadline = Instant::now() + wait;
        let config = LinkConfig::default();
        let mut devices = vec![head];
        for w in &self.membership.candidates() {
            let device = loop {
                match rt.block_on(worker_profile(w, &self.secret, &config)) {
                    Ok(d) => break Some(d),
                    Err(Error::RingBroken(e)) if Instant::now() < deadline => {
                        tracing::warn!("waiting for a worker to plan the ring: {e}");
                        std::thread::sleep(RETRY);
                    }
                    Err(e) if needed.is_some_and(|n| !n.contains(w)) => {
                        tracing::info!("leaving {w} out of this plan: {e}");
                        break None;
                    }
                    Err(e) => return Err(e),
                }
            };
            devices.extend(device);
        }
        // The head's own hop is the last one of the ring, back from a worker: as fast as the others.
        let workers = devices.len() - 1;
        devices[0].comm_s = devices[1..].iter().map(|d| d.comm_s).sum::<f64>() / workers.max(1) as f64;
        scheduler::share_host_memory(&mut devices);
        Ok(devices)
    }

    /// The scheduler's plan on `devices` (from `gather`) with `strategy`.
    pub fn schedule(&self, devices: &[DeviceProfile], strategy: Strategy) -> Result<Schedule> {
        let s = scheduler::schedule(devices, &self.model, &Options { strategy, ..self.options.clone() }).map_err(|e| Error::Plan(format!("the {strategy} plan: {e}")))?;
        if s.members.first() != Some(&0) {
            return Err(Error::Plan("the scheduler put another device first; the head must lead the ring".into()));
        }
        Ok(s)
    }

}

/// The workers (addresses) that `members`, indices into `devices` from `gather`, keep in
/// ring order after the head.
pub fn addresses(devices: &[DeviceProfile], members: &[usize]) -> Vec<String> {
    members[1..].iter().map(|&m| devices[m].name.clone()).collect()
}

async fn worker_profile(w: &str, secret: &ClusterSecret, config: &LinkConfig) -> Result<DeviceProfile> {
    let client = ControlClient::connect(w, secret, config).await.map_err(|e| super::connecting(w, e))?;
    let mut best = Duration::MAX;
    for _ in 0..LATENCY_PROBES {
        let t = Instant::now();
        client.call(transport::methods::HEALTH, &serde_json::Value::Null).await.map_err(|e| super::connecting(w, e))?;
        best = best.min(t.elapsed());
    }
    let answer = client.call(transport::methods::PROFILE, &serde_json::Value::Null).await.map_err(|e| super::connecting(w, e))?;
    let mut d: DeviceProfile = serde_json::from_value(answer["device"].clone()).map_err(|e| Error::RingRefused(format!("worker {w} sent no device profile: {e}")))?;
    d.name = w.to_string();
    d.head = false;
    // One way of a round trip: the hop to this device.
    d.comm_s = best.as_secs_f64() / 2.0;
    Ok(d)
}

fn ms(s: f64) -> String {
    format!("{:.1}", s * 1e3)
}

/// The plan as a table: per device its set, window, GPU layers, memory and time parts;
/// then the predicted TPOT, the devices left out, and `others`' predictions.
/// What a schedule sustains with several requests or a long prompt, with as many
/// micro-batches in flight as `--micro-batches auto` keeps (see `scheduler::pipelining`).
pub fn forecast(devices: &[DeviceProfile], model: &ModelProfile, s: &Schedule) -> scheduler::Forecast {
    let profiles: Vec<DeviceProfile> = s.members.iter().map(|&m| devices[m].clone()).collect();
    let pipelining = scheduler::Pipelining::of(&profiles, model, &s.plan);
    pipelining.forecast(scheduler::pipelining::auto_depth(&s.plan, &s.prediction, &pipelining), FORECAST_MAX_BATCH)
}

pub fn table(devices: &[DeviceProfile], model: &ModelProfile, s: &Schedule, others: &[(Strategy, Result<f64, String>)]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {}: {} layers, {:.2} GB; strategy {}; k = {} rounds of W = {} layers",
        model.name,
        model.n_layer,
        model.total_bytes() / GB,
        s.strategy,
        s.rounds,
        s.plan.window_sum()
    );
    let _ = writeln!(out, "\n| device | set | window | GPU layers | layers/token | RAM needed / available | VRAM needed / available | compute ms | memory ms | disk ms | network ms |");
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, (&m, cost)) in s.members.iter().zip(&s.prediction.devices).enumerate() {
        let d = &devices[m];
        let p = &s.plan.devices[i];
        // Weights and KV of its layers (the head also holds the output layer); more than
        // is available means reloading from disk every token.
        // Experts of GPU layers kept in RAM move their bytes from VRAM to RAM.
        let experts = cost.experts_in_ram as f64 * model.moe.as_ref().map_or(0.0, |m| m.expert_bytes);
        let ram = cost.cpu_layers as f64 * model.layer_bytes_with_kv() + experts + if i == 0 { model.output_bytes } else { 0.0 };
        let vram = match &d.gpu {
            Some(g) => format!("{:.2} / {:.2} GB", (cost.gpu_layers as f64 * model.layer_bytes_with_kv() - experts) / GB, g.memory_available / GB),
            None => "-".into(),
        };
        let gpu_layers = match p.experts_in_ram {
            0 => p.gpu_layers.to_string(),
            e => format!("{} ({e} with experts in RAM)", p.gpu_layers),
        };
        let b = &cost.breakdown;
        let _ = writeln!(
            out,
            "| {} | {:?}{} | {} | {} | {} | {:.2} / {:.2} GB | {vram} | {} | {} | {} | {} |",
            d.name,
            cost.set,
            if cost.overloaded { " (overloaded)" } else { "" },
            p.window,
            gpu_layers,
            cost.cpu_layers + cost.gpu_layers,
            ram / GB,
            d.ram_available / GB,
            ms(b.compute_s),
            ms(b.memory_s),
            ms(b.disk_s),
            ms(b.network_s)
        );
    }
    let _ = writeln!(out, "\npredicted TPOT: {} ms", ms(s.prediction.tpot_s));
    let f = forecast(devices, model, s);
    let _ = writeln!(out, "micro-batches in flight: {}", f.micro_batches);
    for x in &f.streams {
        let _ = writeln!(out, "  {} streams at {} tokens of context: {:.1} tokens/s ({:.1} one micro-batch at a time)", x.streams, f.context, x.pipelined_tokens_per_s, x.one_at_a_time_tokens_per_s);
    }
    for x in &f.prompts {
        let _ = writeln!(out, "  a {}-token prompt: first token after {:.2} s in chunks of {} ({:.2} s one at a time)", x.tokens, x.pipelined_ttft_s, x.chunk, x.one_at_a_time_ttft_s);
    }
    if !s.dropped.is_empty() {
        let names: Vec<&str> = s.dropped.iter().map(|&i| devices[i].name.as_str()).collect();
        let _ = writeln!(out, "left out (they would slow the ring down): {}", names.join(", "));
    }
    for (strategy, r) in others {
        let _ = match r {
            Ok(t) => writeln!(out, "with --plan-strategy {strategy}: {} ms", ms(*t)),
            Err(e) => writeln!(out, "with --plan-strategy {strategy}: no plan ({e})"),
        };
    }
    out
}
