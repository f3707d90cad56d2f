//! `hearth worker`: a ring member. It waits for a head to send it a plan (its windows and
//! its successor), then runs its window of every round on the hidden states its
//! predecessor sends and passes the result on.
//!
//! The ring loop — receive a frame, compute, send the result on — runs on one thread of
//! its own, outside the async runtime's workers: keep-alive pings and control calls are
//! answered by the runtime during long steps; it stays the same thread, so OpenMP keeps
//! one team; and a frame wakes it directly, with no hand-off to another thread and back
//! (each wake-up costs tens of microseconds per hop).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{BatchToken, ModelFile, Stage, StageConfig, StageInput, StageOutput};
use serde_json::{json, Value};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use transport::{Activations, ControlFailure, Frame, Link, LinkConfig, LinkServer};

use super::paging::WindowPager;
use super::shipping::{self, FetchRequest, FetchStatus, Shipper};
use super::{apply, WorkerPlan};
use crate::runtime::generation::{prompt_cache_namespace, BlockId, PrefixCache, PrefixCacheConfig};
use crate::error::{Error, Result};

/// A worker's settings (`hearth worker`).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The worker's own copy of the model; `None`: it fetches the head's.
    pub model: Option<std::path::PathBuf>,
    /// Where models fetched from a head go.
    pub model_dir: std::path::PathBuf,
    /// Most bytes the fetched models in `model_dir` may take (`None`: no limit).
    pub disk_budget: Option<u64>,
    /// Where the head and the previous ring member connect.
    pub listen: SocketAddr,
    pub secret: transport::ClusterSecret,
    pub threads: usize,
    /// Read the next window ahead while other devices compute.
    pub prefetch: bool,
    /// Repack weights into the CPU kernels' layouts (off with `--no-repack`; paged
    /// windows never are).
    pub repack: bool,
    /// Added to every frame this worker sends (benchmarks only).
    pub hop_delay: Duration,
    /// GPU layers per window: the head's plan, or the user's count.
    pub gpu_layers: crate::runtime::GpuPlacement,
    /// Where this worker keeps its windows' rows of the head's prompt-cache blocks.
    pub prompt_cache: PrefixCacheConfig,
    /// Find the head on the LAN and join it (`None`: wait to be named in `--workers`).
    pub discovery: Option<WorkerDiscovery>,
}

/// How a worker finds its head.
#[derive(Debug, Clone)]
pub struct WorkerDiscovery {
    /// The UDP port heads announce on.
    pub port: u16,
    /// `--head`: join this one directly (host[:port]), without waiting for announcements.
    pub head: Option<String>,
    /// The name this worker gives.
    pub name: String,
}

/// A worker's state, under two locks: `compute` is held for a whole step by the ring
/// thread, so control calls (health, profile, plans) never wait behind a step for what
/// `meta` holds, and take `compute` only off the async runtime.
struct Worker {
    /// The model this worker runs: its own file, or what it fetched from a head.
    model: Mutex<Option<LocalModel>>,
    shipper: Shipper,
    /// Off with `--no-prefetch`.
    prefetch: bool,
    repack: bool,
    gpu_layers: crate::runtime::GpuPlacement,
    meta: Mutex<Meta>,
    compute: Mutex<Compute>,
    /// This worker's rows of the head's prompt-cache blocks (keyed `Rows` frames), kept
    /// here so that a block's rows never cross the network; `None`: `--prompt-cache-ram 0`
    /// and no disk, and the head keeps no blocks of this ring.
    blocks: Mutex<Option<PrefixCache>>,
    /// RAM the blocks may take, left out of what this device offers the head's plan.
    blocks_ram: u64,
}

#[derive(Clone)]
struct LocalModel {
    file: Arc<ModelFile>,
    fingerprint: String,
    path: std::path::PathBuf,
    /// A file fetched from a head holds these layers only (verified); `None`: the whole file.
    layers: Option<Vec<(usize, usize)>>,
}

impl LocalModel {
    /// False once a worker's own file changed under it (see [`Compute::own_file`]); a
    /// fetched file's pieces were verified as they arrived.
    fn unchanged(&self) -> bool {
        self.layers.is_some() || self.file.gguf.changed().is_none()
    }

    fn holds(&self, windows: &[(usize, usize)]) -> bool {
        self.layers.as_ref().is_none_or(|have| windows.iter().all(|&(a, b)| (a..b).all(|l| have.iter().any(|&(x, y)| (x..y).contains(&l)))))
    }
}

struct Meta {
    next: Option<String>,
    planned: bool,
    /// Bumped by every plan: links formed under an older plan (a head that restarted, a
    /// second head) are closed instead of feeding the new stage.
    generation: u64,
    /// The head whose plan is loaded, and how many of its ring links are open: while one
    /// is, another head's plan is refused, so two heads never fight over a worker.
    head: Option<String>,
    live_links: usize,
    /// This device measured for the scheduler, on the first `profile` call, with the
    /// fingerprint of the model it was calibrated on.
    device: Option<(Option<String>, scheduler::DeviceProfile)>,
}

#[derive(Default)]
struct Compute {
    stage: Option<Stage>,
    /// Release/prefetch around each window, and the per-window statistics.
    pager: Option<WindowPager>,
    /// The plan gives this worker no layers: it passes activations on unchanged.
    relay: bool,
    /// The plan generation this stage belongs to: a link of another may not touch it.
    generation: u64,
    /// The worker's own `--model` file, checked after every step: written to or truncated
    /// under the stage (a new version copied over it), what the stage read since may be
    /// garbage. A file fetched from a head is not watched this way: this worker's shipper
    /// writes further windows into it while the stage serves, and pieces are verified
    /// against the head's hashes as they arrive; its truncation still shows as a fault.
    own_file: Option<Arc<ModelFile>>,
}

impl Worker {
    fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta.lock().expect("worker state")
    }

    fn compute(&self) -> std::sync::MutexGuard<'_, Compute> {
        self.compute.lock().expect("worker compute")
    }

    fn model(&self) -> Option<LocalModel> {
        self.model.lock().expect("worker model").clone()
    }
}

/// Counts a ring link of plan generation `.1` as open for as long as it lives.
struct LiveLink(Arc<Worker>, u64);

impl Drop for LiveLink {
    fn drop(&mut self) {
        let mut s = self.0.meta();
        // A newer plan started its own count.
        if s.generation == self.1 {
            s.live_links = s.live_links.saturating_sub(1);
        }
    }
}

/// What the ring thread needs besides the links it is handed.
struct RingContext {
    rt: tokio::runtime::Handle,
    worker: Arc<Worker>,
    secret: transport::ClusterSecret,
    config: LinkConfig,
}

/// Starts the ring thread. It serves one link at a time, the newest: a head that forms
/// the ring again opens a new link, and the old one has nothing more to say.
fn ring_thread(cx: RingContext) -> std::io::Result<UnboundedSender<Link>> {
    let (tx, mut links) = tokio::sync::mpsc::unbounded_channel::<Link>();
    std::thread::Builder::new().name("hearth-ring".into()).spawn(move || {
        let mut newer = None;
        loop {
            let link = match newer.take() {
                Some(link) => link,
                None => match cx.rt.block_on(links.recv()) {
                    Some(link) => link,
                    None => return,
                },
            };
            let peer = link.peer().to_string();
            match cx.rt.block_on(serve_link(link, &cx, &mut links)) {
                Ok(next) => newer = next,
                Err(e) => tracing::warn!(%peer, "ring link ended: {e}"),
            }
        }
    })?;
    Ok(tx)
}

/// Serves as a ring member until SIGTERM or Ctrl-C.
pub fn run(cfg: WorkerConfig) -> Result<()> {
    let WorkerConfig { model: path, model_dir, disk_budget, listen: addr, secret, threads, prefetch, repack, hop_delay, gpu_layers, prompt_cache, discovery } = cfg;
    let model = match path {
        Some(path) => {
            let file = Arc::new(ModelFile::open(&path)?);
            gpu_layers.check(file.spec.moe.is_some()).map_err(Error::Config)?;
            let fingerprint = file.fingerprint();
            Some(LocalModel { file, fingerprint, path, layers: None })
        }
        None => {
            tracing::info!("no --model: this worker fetches the layers it is given from the head, into {}", model_dir.display());
            None
        }
    };
    let meta = Meta { next: None, planned: false, generation: 0, head: None, live_links: 0, device: None };
    let shipper = Shipper::new(model_dir, disk_budget, secret.clone());
    let blocks = Mutex::new(PrefixCache::open(&prompt_cache));
    let state = Arc::new(Worker { model: Mutex::new(model), shipper, prefetch, repack, gpu_layers, meta: Mutex::new(meta), compute: Mutex::default(), blocks, blocks_ram: prompt_cache.ram_bytes });
    let rt = crate::process::ring_runtime()?;
    let config = LinkConfig { send_delay: hop_delay, ..LinkConfig::default() };
    // Made here, on the main thread, so it has normal priority.
    let links = ring_thread(RingContext { rt: rt.handle().clone(), worker: state.clone(), secret: secret.clone(), config: config.clone() })?;
    let served: Result<()> = rt.block_on(async move {
        let handler_state = state.clone();
        let handler = move |method: String, body: Value| {
            let state = handler_state.clone();
            async move { control(&state, &method, body, threads).await }
        };
        let secret_for_discovery = secret.clone();
        let mut server = LinkServer::bind(addr, secret, config, Some(Arc::new(handler))).await?;
        // As a container's first process a worker gets no default action for SIGTERM:
        // without a handler `docker stop` would wait out its grace period and kill it.
        let stop = crate::process::shutdown_signal()?;
        tokio::pin!(stop);
        tracing::info!("hearth worker listening on {}", server.local_addr());
        let mut heads = match discovery {
            Some(d) => Some(super::membership::serve_worker(d, server.local_addr().port(), secret_for_discovery).await?),
            None => None,
        };
        // Set on SIGTERM while in a ring that a head can re-plan: serve on until the head
        // has planned without this worker (its ring links closed), or this long.
        let mut leaving: Option<Instant> = None;
        let mut poll = tokio::time::interval(LEAVE_POLL);
        loop {
            tokio::select! {
                why = async { heads.as_mut().expect("checked").refused().await }, if heads.is_some() => {
                    return Err(Error::Config(why));
                }
                _ = &mut stop, if leaving.is_none() => {
                    // The heads that know this worker hear it is going and plan without it
                    // at their next idle moment: a stream running through it completes.
                    // Otherwise nothing to drain: a head sees its links close and reports
                    // the ring broken.
                    if let Some(heads) = &heads {
                        heads.leave().await;
                        if state.meta().live_links > 0 {
                            tracing::info!("leaving: serving until the head plans without this worker (at most {} s)", LEAVE_WAIT.as_secs());
                            leaving = Some(Instant::now());
                            continue;
                        }
                    }
                    tracing::info!("worker stopping");
                    return Ok(());
                }
                _ = poll.tick(), if leaving.is_some() => {
                    let since = leaving.expect("checked");
                    if state.meta().live_links == 0 || since.elapsed() >= LEAVE_WAIT {
                        tracing::info!("worker stopping");
                        return Ok(());
                    }
                }
                link = server.accept() => {
                    let Some(link) = link else { return Ok(()) };
                    if links.send(link).is_err() {
                        return Err(Error::Io(std::io::Error::other("the ring thread stopped")));
                    }
                }
            }
        }
    });
    served
}

async fn control(state: &Arc<Worker>, method: &str, body: Value, threads: usize) -> Result<Value, ControlFailure> {
    match method {
        transport::methods::HEALTH => Ok(json!({"status": "ok", "fingerprint": state.model().map(|m| m.fingerprint), "planned": state.meta().planned})),
        shipping::FETCH => {
            let request: FetchRequest = serde_json::from_value(body).map_err(|e| ControlFailure::bad_request(format!("invalid fetch request: {e}")))?;
            // Its own file, if it is the head's, holds every layer. One that changed since
            // it was opened is no longer what its fingerprint says: the head's copy is
            // fetched instead, and the ring forms again without a restart.
            if state.model().is_some_and(|m| m.fingerprint == request.fingerprint && m.holds(&request.windows) && m.unchanged()) {
                return serde_json::to_value(FetchStatus { ready: true, ..FetchStatus::default() }).map_err(|e| ControlFailure::failed(e.to_string()));
            }
            let (status, file) = state.shipper.fetch(request.clone());
            if let Some(file) = file {
                let path = file.gguf.path().to_path_buf();
                *state.model.lock().expect("worker model") = Some(LocalModel { file, fingerprint: request.fingerprint, path, layers: Some(request.windows) });
            }
            serde_json::to_value(status).map_err(|e| ControlFailure::failed(e.to_string()))
        }
        transport::methods::PROFILE => {
            // The device is measured once (a few seconds, then cached on disk too), off the
            // runtime; the windows' figures are live.
            // Measured again once a model arrives: its layers calibrate the rates.
            let model = state.model();
            let cached = state.meta().device.clone().filter(|(fingerprint, _)| *fingerprint == model.as_ref().map(|m| m.fingerprint.clone()));
            let mut device = match cached {
                Some((_, d)) => d,
                None => {
                    let local = model.clone();
                    let dir = state.shipper.dir().to_path_buf();
                    let measured = tokio::task::spawn_blocking(move || {
                        crate::runtime::profiling::serving_profile(threads, local.as_ref().map(|m| (m.path.as_path(), &*m.file)), &dir)
                    })
                        .await
                        .map_err(|e| ControlFailure::failed(e.to_string()))?
                        .map_err(|e| ControlFailure::failed(e.to_string()))?;
                    state.meta().device = Some((model.map(|m| m.fingerprint), measured.clone()));
                    measured
                }
            };
            crate::runtime::profiling::refresh_memory(&mut device);
            device.ram_available = (device.ram_available - state.blocks_ram as f64).max(0.0);
            // The window figures wait for a step in progress: off the runtime.
            let worker = state.clone();
            let mut answer = tokio::task::spawn_blocking(move || match &worker.compute().pager {
                Some(p) => p.profile(),
                None => json!({"windows": [], "prefetch": worker.prefetch}),
            })
            .await
            .map_err(|e| ControlFailure::failed(e.to_string()))?;
            answer["device"] = serde_json::to_value(&device).map_err(|e| ControlFailure::failed(e.to_string()))?;
            Ok(answer)
        }
        transport::methods::LOAD_PLAN => {
            let plan: WorkerPlan = serde_json::from_value(body).map_err(|e| ControlFailure::bad_request(format!("invalid plan: {e}")))?;
            {
                let s = state.meta();
                if let Some(head) = s.head.as_ref().filter(|h| **h != plan.head && s.live_links > 0) {
                    return Err(ControlFailure::bad_request(format!("this worker is in the ring of another head ({head}); stop that head first")));
                }
            }
            let Some(model) = state.model() else {
                return Err(ControlFailure::bad_request("this worker has no model yet: the head fetches it first (fetch_model)"));
            };
            let (file, fingerprint, prefetch) = (model.file.clone(), &model.fingerprint, state.prefetch);
            if plan.fingerprint != *fingerprint {
                return Err(ControlFailure::bad_request(format!(
                    "this worker has a different model file (fingerprint {fingerprint}, the head's is {})",
                    plan.fingerprint
                )));
            }
            if !model.unchanged() {
                let why = model.file.gguf.changed().unwrap_or_default();
                return Err(ControlFailure::bad_request(format!("{why}: this worker fetches the head's copy at the next fetch_model")));
            }
            if !model.holds(&plan.windows) {
                return Err(ControlFailure::bad_request(format!("this worker has not fetched windows {:?} from the head yet (fetch_model first)", plan.windows)));
            }
            state.gpu_layers.check(file.spec.moe.is_some()).map_err(ControlFailure::bad_request)?;
            let (accel_layers, experts_in_ram) = state.gpu_layers.resolve(plan.gpu_layers, plan.experts_in_ram);
            let threads = if plan.threads > 0 { plan.threads.min(threads) } else { threads };
            let mut cfg = StageConfig {
                windows: plan.windows.iter().map(|&(a, b)| a..b).collect(),
                n_seq: plan.n_seq,
                n_ctx_seq: plan.n_ctx_seq,
                max_batch: plan.max_batch,
                threads,
                accel_layers,
                experts_in_ram,
                owns_output: false,
                batch_invariant: plan.batch_invariant,
                repack: state.repack,
                read_chosen_experts: false,
                kv: plan.kv,
                draft_snapshots: plan.draft_snapshots,
            };
            let paged = super::paging::pages_from_disk(&file, &cfg.windows, plan.release, &cfg);
            cfg.repack = state.repack && !paged;
            cfg.read_chosen_experts = paged;
            let layers = cfg.windows.clone();
            let own_file = model.layers.is_none().then(|| file.clone());
            let release = plan.release;
            let relay = layers.is_empty();
            let built = if relay {
                tracing::info!(next = %plan.next, "plan loaded: no layers here, relaying activations");
                None
            } else {
                let (stage, pager) = tokio::task::spawn_blocking(move || {
                    // The pager is made after the stage so the stage's own memory counts.
                    Stage::new(file.clone(), cfg).map(|stage| (stage, WindowPager::new(file, layers, prefetch, release)))
                })
                .await
                .map_err(|e| ControlFailure::failed(e.to_string()))?
                .map_err(|e| ControlFailure::bad_request(e.to_string()))?;
                tracing::info!(windows = ?plan.windows, next = %plan.next, cache = %plan.kv, threads, "plan loaded; {}", pager.describe());
                Some((stage, pager))
            };
            let generation;
            {
                // First: links of the older plan see the new generation and close.
                let mut s = state.meta();
                s.planned = true;
                s.next = Some(plan.next);
                s.generation += 1;
                generation = s.generation;
                s.head = Some(plan.head);
                // Links of the older plan close at their next frame.
                s.live_links = 0;
            }
            // The old stage may be mid-step: swap it off the runtime.
            let worker = state.clone();
            tokio::task::spawn_blocking(move || {
                let (stage, pager) = built.unzip();
                *worker.compute() = Compute { stage, pager, relay, generation, own_file };
            })
            .await
            .map_err(|e| ControlFailure::failed(e.to_string()))?;
            // What this worker placed where: its own --gpu-layers may override the plan's.
            // A count above the window places the whole window.
            let window = plan.windows.first().map_or(0, |&(a, b)| b - a);
            let (gpu_layers, experts_in_ram) = (accel_layers.min(window), experts_in_ram.min(window));
            Ok(json!({"status": "ok", "gpu_layers": gpu_layers, "experts_in_ram": experts_in_ram}))
        }
        other => Err(ControlFailure::unknown_method(other)),
    }
}

/// How long a worker that was told to stop waits for its head to plan without it: a
/// stream of a few hundred tokens on a slow ring finishes well within it.
const LEAVE_WAIT: Duration = Duration::from_secs(60);
/// How often a leaving worker looks whether its ring links have closed.
const LEAVE_POLL: Duration = Duration::from_millis(100);

/// Why a link ends when the head sent another plan meanwhile.
const REPLACED: &str = "a newer plan replaced this link";

/// Frames from the predecessor: compute what is ours, pass everything on in order. Runs
/// on the ring thread; returns a newer link if one arrives meanwhile.
async fn serve_link(mut link: Link, cx: &RingContext, links: &mut UnboundedReceiver<Link>) -> Result<Option<Link>> {
    let state = &cx.worker;
    let (next, generation) = {
        let mut s = state.meta();
        s.live_links += 1;
        (s.next.clone(), s.generation)
    };
    let _live = LiveLink(state.clone(), generation);
    let next = next.ok_or_else(|| Error::RingRefused("a head linked before sending a plan".into()))?;
    let mut out = Link::connect(&next, &cx.secret, &cx.config).await?;
    // When this worker last handed on its output: the wait for the next input starts then.
    let mut last_sent: Option<Instant> = None;
    loop {
        let frame = tokio::select! {
            biased;
            newer = links.recv() => return Ok(newer),
            frame = link.stream.recv() => frame?,
        };
        let Some(frame) = frame else { return Ok(None) };
        if state.meta().generation != generation {
            return Err(Error::RingBroken(REPLACED.into()));
        }
        let reply = match frame {
            Frame::Activations(activations) => {
                let waited = last_sent.map(|t| t.elapsed());
                // Blocking here is right: this is the ring thread, not a runtime worker.
                let reply = compute(state, activations, waited, generation);
                out.sink.send(&reply).await?;
                last_sent = Some(Instant::now());
                // Sent means encoded: its buffers, the size of the next input, decode that.
                link.stream.recycle(reply);
                continue;
            }
            Frame::KvOps { step, ops } => {
                let mut c = state.compute();
                if c.generation != generation {
                    return Err(Error::RingBroken(REPLACED.into()));
                }
                if let Some(stage) = c.stage.as_mut() {
                    apply(stage, &ops);
                }
                Frame::KvOps { step, ops }
            }
            Frame::Rows { step, seq, at, n, write, state: with_state, key, mut parts } => {
                let mut c = state.compute();
                if c.generation != generation {
                    return Err(Error::RingBroken(REPLACED.into()));
                }
                let rows = Rows { seq, at: at as usize, n: n as usize, write, with_state };
                let kept = kept_rows(state, &mut c, &rows, &key);
                parts.push(if kept { vec![1] } else { Vec::new() });
                Frame::Rows { step, seq, at, n, write, state: with_state, key, parts }
            }
            other => other,
        };
        out.sink.send(&reply).await?;
    }
}

/// What a `Rows` frame asks of this worker.
struct Rows {
    seq: u64,
    at: usize,
    n: usize,
    write: bool,
    /// A read of the rows with the recurrent state where they end.
    with_state: bool,
}

/// A `Rows` frame on this worker: its windows' rows of positions `at..at + n` of
/// `seq` kept here as block `key` (read; with the state where they end if asked), or the
/// rows kept as `key` written back as those positions (write; with the state if it was
/// kept). False: nothing kept or written — no layers, no prompt cache, rows that cannot be
/// read, or (write) a block this worker no longer has (evicted, or lost with its RAM in a
/// restart); a write that fails leaves `seq` its first `at` positions, as the head's own
/// failed write does, and the head computes them instead.
fn kept_rows(state: &Worker, c: &mut Compute, rows: &Rows, key: &BlockId) -> bool {
    let &Rows { seq, at, n, write, with_state } = rows;
    let Some(stage) = c.stage.as_mut() else { return false };
    let mut blocks = state.blocks.lock().expect("worker blocks");
    let Some(cache) = blocks.as_mut() else {
        if write {
            stage.truncate_sequence(seq, at);
        }
        return false;
    };
    // Rows of another layout (windows, cache types) are never written here: the head's
    // keys name its plan too, and this is the belt to those braces.
    cache.set_namespace(Some(prompt_cache_namespace(&["ring worker's rows", &stage.row_layout()])));
    if write {
        // The key names every token before the block's end (a SHA-256 chain): no tokens to
        // check beside it.
        let written = cache.get(key, &[]).is_some_and(|rows| stage.write_rows(seq, at, n, &rows));
        if !written {
            stage.truncate_sequence(seq, at);
        }
        written
    } else {
        match stage.read_rows(seq, at, n, with_state) {
            Some(rows) => {
                cache.put(*key, &[], rows);
                true
            }
            None => false,
        }
    }
}

const MODEL_TRUNCATED: &str = "this worker's model file was truncated while it served (a new version copied over it?): restart the worker";

fn compute(state: &Worker, a: Activations, waited: Option<Duration>, generation: u64) -> Frame {
    let mut guard = state.compute();
    let s = &mut *guard;
    if s.generation != generation {
        return Frame::Error { step: a.step, message: REPLACED.into() };
    }
    let Some(stage) = s.stage.as_mut() else {
        if s.relay {
            // A report all the same: the head reads reports by ring position.
            let mut a = a;
            a.report(transport::StageReport::default());
            return Frame::Activations(a);
        }
        return Frame::Error { step: a.step, message: "worker has no plan".into() };
    };
    let batch: Vec<BatchToken> = a.tokens.iter().map(|t| BatchToken { seq: t.seq, pos: t.pos, logits: t.wants_logits }).collect();
    let round = a.round as usize;
    if let Some(p) = s.pager.as_mut() {
        p.before(round, waited);
    }
    let result = stage.forward(round, &batch, StageInput::Hidden(&a.hidden));
    if let Some(p) = s.pager.as_mut() {
        p.after(round);
    }
    // A model file truncated under this worker read as zeros instead of ending it with
    // SIGBUS (engine::gguf::faults), or its own file was written to: what it computed
    // since is not to be sent on.
    if let Some(why) = s.own_file.as_ref().and_then(|f| f.gguf.changed()) {
        let message = format!("{why}; this worker fetches the head's copy when the ring forms again");
        tracing::error!("{message}");
        return Frame::Error { step: a.step, message };
    }
    if engine::gguf::faults::faulted() {
        tracing::error!("{MODEL_TRUNCATED}");
        return Frame::Error { step: a.step, message: MODEL_TRUNCATED.into() };
    }
    match result {
        Ok(StageOutput::Hidden(hidden)) => {
            let mut a = Activations { hidden, ..a };
            a.report(s.pager.as_ref().map(|p| p.report(round)).unwrap_or_default());
            Frame::Activations(a)
        }
        Ok(StageOutput::Logits(_)) => Frame::Error { step: a.step, message: "worker produced logits".into() },
        Err(e) => Frame::Error { step: a.step, message: e.to_string() },
    }
}
