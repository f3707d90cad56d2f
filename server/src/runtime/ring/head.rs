//! The head's side of the ring: a `Pipeline` (the batching loop's) whose windows are partly
//! local (the head's own, plus the embedding `0..0` and the output layer `L..L`) and partly
//! on workers, reached over one authenticated link to the first worker and back from the
//! last. It puts three parts together: the micro-batches in flight (`flights`: launched,
//! advanced through the head's windows, landed, in the order they left), the links and
//! whether the ring is whole (`links`), and the plan it runs (chosen here at start, checked
//! and adopted again while the queue is idle).
//!
//! A failed hop breaks the ring: every step fails fast until `recover` forms the ring again
//! (plans re-sent, links re-opened, a probe frame sent all the way round). Workers start
//! from empty caches then, so the head empties its own.
//!
//! The plan comes from the scheduler (or `--windows`) at start, on profiles gathered from
//! every worker, and may change while the queue is idle: when fresh profiles drifted and a
//! new schedule predicts a real gain, when a member leaves or is lost, or when `POST
//! /admin/replan` asks (then the asked plan is adopted whenever it differs). Adopting a plan
//! rebuilds the head's stage and forms the ring again with the members it keeps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{BatchToken, Logits, ModelFile, SeqId, Stage, StageConfig, StageInput, StageOutput};
use scheduler::{DeviceProfile, Plan, Prediction, ReplanPolicy};
use transport::{Dtype, KvOp, LinkConfig, LinkServer, StageReport};

use super::adoption::{wanted, Ask, Cluster, LiveCluster, Replanning, Running, Verdict};
use super::board::{self, PlanBoard};
use super::flights::{ring_err, Flights, HeadWindows, Ring, RowsOp};
use super::links::{self, Formation, Links, TcpRing};
use super::paging::WindowPager;
use super::planning::{Planner, HEAD_NAME};
use super::shipping::{self, ManifestStore};
use super::RingSetup;
use crate::error::{Error, ReplanError, Result};
use crate::metrics::RingMeter;
use crate::runtime::generation::BlockId;
use crate::runtime::views::{CheckView, PlanView};

pub struct RingPipeline {
    rt: tokio::runtime::Runtime,
    file: Arc<ModelFile>,
    /// The head's own windows under the running plan.
    head: HeadStage,
    links: Links,
    /// The micro-batches in flight.
    flights: Flights,
    server: LinkServer,
    cfg: RingConfig,
    /// The running plan, and its members after the head in ring order (a subset of the
    /// planner's candidates).
    plan: Plan,
    members: Vec<String>,
    fingerprint: String,
    /// This head process's id, so workers can tell a second head from this one.
    id: String,
    link_config: LinkConfig,
    replan: Replanning,
    board: Arc<PlanBoard>,
    /// Per-device metrics of the running plan's members.
    meter: RingMeter,
    /// Micro-batches the running plan may hold in flight at once.
    depth: usize,
    /// The running plan's stage times, to cut prompts into chunks; `None` for a plan from
    /// `--windows` without profiles to judge it by.
    pipelining: Option<scheduler::Pipelining>,
}

/// The ticket `forward` gives its one micro-batch (the batching loop numbers its own from 0).
const FORWARD_TICKET: u64 = u64::MAX;

/// The ring's settings, fixed for the life of the head: what the user set, the stage's
/// shape every member builds, and the plan if the user pinned one.
pub struct RingConfig {
    pub setup: RingSetup,
    /// The plan pinned by `--windows` (the head and every candidate), or `None` to let the
    /// planner's strategy choose.
    pub pinned: Option<Plan>,
    pub n_seq: usize,
    pub n_ctx_seq: usize,
    pub max_batch: usize,
    pub threads: usize,
    /// Every member computes with batch-invariant kernels (speculation is on).
    pub batch_invariant: bool,
    /// Every member keeps draft snapshots of a recurrent model's state (speculation is on).
    pub draft_snapshots: bool,
    /// The head's own windows may be repacked (`--no-repack` off; paged windows never are).
    pub repack: bool,
    /// Every member's KV cache types.
    pub kv: engine::CacheTypes,
    /// The head's GPU layers per window: the plan's, or the user's count.
    pub gpu_layers: crate::runtime::GpuPlacement,
}

/// The head's part of a plan: its stage's windows and how a step walks them. The head's
/// first window starts at layer 0 (it leads round 0), so it embeds the tokens itself; a
/// head without layers gets an embedding-only window `0..0`. The output layer is its own
/// window `L..L` unless the head's last window ends the model (every worker relays).
/// Fewer windows, fewer graphs per step: the stage rebuilds its graph when the window
/// changes, and a head running the whole model this way is as fast as a single node.
struct HeadStage {
    stage: Stage,
    /// Stage window index of the head's window in each round, if it has one.
    own: Vec<Option<usize>>,
    /// The embedding-only window, when the head has no layers.
    embed_window: Option<usize>,
    /// The output-only window, when the head's last window does not end the model.
    output_window: Option<usize>,
    /// Release and read-ahead of the head's own windows, as on workers; `None` when the
    /// head has no layers.
    pager: Option<WindowPager>,
    /// Whether workers hold layers (a plan may give them none).
    workers_compute: bool,
    /// The head's (GPU layers, of them with experts in RAM) per window, as placed.
    placed: (usize, usize),
}

impl HeadStage {
    fn build(file: &Arc<ModelFile>, plan: &Plan, cfg: &RingConfig) -> Result<HeadStage> {
        let n_layer = file.spec.n_layer;
        let own_windows = plan.windows_of(0);
        let mut windows = Vec::new();
        let embed_window = own_windows.is_empty().then(|| {
            windows.push(0..0);
            0
        });
        let first_own = windows.len();
        windows.extend(own_windows.iter().cloned());
        let output_window = (windows.last().map(|w| w.end) != Some(n_layer)).then(|| {
            windows.push(n_layer..n_layer);
            windows.len() - 1
        });
        let own = (0..plan.rounds()).map(|r| (!own_windows.is_empty()).then_some(first_own + r)).collect();
        let planned = plan.devices.first().map_or((0, 0), |d| (d.gpu_layers, d.experts_in_ram));
        let (accel_layers, experts_in_ram) = cfg.gpu_layers.resolve(planned.0, planned.1);
        let mut config = StageConfig {
            windows,
            n_seq: cfg.n_seq,
            n_ctx_seq: cfg.n_ctx_seq,
            max_batch: cfg.max_batch,
            threads: cfg.threads,
            accel_layers,
            experts_in_ram,
            owns_output: true,
            batch_invariant: cfg.batch_invariant,
            repack: cfg.repack,
            read_chosen_experts: false,
            kv: cfg.kv,
            draft_snapshots: cfg.draft_snapshots,
        };
        let paged = super::paging::pages_from_disk(&file, &own_windows, cfg.setup.release, &config);
        config.repack = cfg.repack && !paged;
        config.read_chosen_experts = paged;
        let stage = Stage::new(file.clone(), config)?;
        // Made after the stage, so the stage's own memory counts against the budget.
        let pager = (!own_windows.is_empty()).then(|| WindowPager::new(file.clone(), own_windows.clone(), cfg.setup.prefetch, cfg.setup.release));
        if let Some(p) = &pager {
            tracing::info!("head windows: {}", p.describe());
        }
        // A count above the window places the whole window.
        let window = plan.devices.first().map_or(0, |d| d.window);
        let placed = (accel_layers.min(window), experts_in_ram.min(accel_layers).min(window));
        Ok(HeadStage { stage, own, embed_window, output_window, pager, workers_compute: plan.devices[1..].iter().any(|d| d.window > 0), placed })
    }
}

impl HeadWindows for HeadStage {
    fn own(&self) -> &[Option<usize>] {
        &self.own
    }

    fn embed_window(&self) -> Option<usize> {
        self.embed_window
    }

    fn output_window(&self) -> Option<usize> {
        self.output_window
    }

    fn workers_compute(&self) -> bool {
        self.workers_compute
    }

    fn counts_reads(&self) -> bool {
        // Without a pager the head does not count its reads: then nothing is known.
        self.pager.is_some() || self.own.iter().all(Option::is_none)
    }

    fn forward(&mut self, window: usize, round: Option<(usize, Option<Duration>)>, batch: &[BatchToken], input: StageInput<'_>) -> (Result<StageOutput>, Option<StageReport>) {
        let pager = round.and_then(|r| self.pager.as_mut().map(|p| (p, r)));
        let Some((p, (round, waited))) = pager else {
            return (self.stage.forward(window, batch, input).map_err(Error::from), None);
        };
        p.before(round, waited);
        let out = self.stage.forward(window, batch, input).map_err(Error::from);
        p.after(round);
        (out, Some(p.report(round)))
    }

    fn apply(&mut self, op: &KvOp) {
        super::apply(&mut self.stage, std::slice::from_ref(op));
    }
}

/// Pause between attempts to form the ring at start, while workers are still starting.
const STARTUP_RETRY: Duration = Duration::from_secs(1);
/// How often the head asks workers fetching their windows how far they are.
const FETCH_POLL: Duration = Duration::from_secs(1);
const FETCH_LOG_EVERY: Duration = Duration::from_secs(5);

impl RingPipeline {
    /// Gathers every candidate's profile (waiting for workers still starting), takes the
    /// plan from `cfg.pinned` or the planner's strategy, and forms the ring.
    pub fn connect(file: Arc<ModelFile>, mut cfg: RingConfig, mut planner: Planner, board: Arc<PlanBoard>) -> Result<RingPipeline> {
        let rt = crate::process::ring_runtime()?;
        let devices = planner.gather(&rt, cfg.setup.startup_wait, None)?;
        board.gathered(devices.clone());
        if cfg.n_ctx_seq == crate::runtime::context::AUTO_CONTEXT {
            // The head's share already leaves out what it keeps for itself (`head_reserved`).
            let memories: Vec<f64> = devices.iter().map(|d| d.ram_available + d.gpu.as_ref().filter(|g| !g.uma).map_or(0.0, |g| g.memory_available)).collect();
            cfg.n_ctx_seq = crate::runtime::context::sized(&file, &memories, cfg.n_seq, cfg.kv, 0.0);
            planner.model = planner.model.at_context(cfg.n_ctx_seq);
        }
        let candidates = devices.len() - 1;
        let (plan, members, prediction, source) = match cfg.pinned.clone() {
            Some(plan) => {
                if plan.devices.len() != candidates + 1 {
                    return Err(Error::Plan(format!("the plan has {} devices but there are {} workers plus the head", plan.devices.len(), candidates)));
                }
                let prediction = scheduler::predict_ring(&devices, &planner.model, &plan, planner.options.disk_threshold);
                (plan, (0..=candidates).collect::<Vec<_>>(), prediction, "windows".to_string())
            }
            None => {
                let s = planner.schedule(&devices, planner.options.strategy)?;
                tracing::info!("{}", super::planning::table(&devices, &planner.model, &s, &[]));
                (s.plan, s.members, s.prediction, planner.options.strategy.to_string())
            }
        };
        let head = HeadStage::build(&file, &plan, &cfg)?;
        let link_config = LinkConfig { send_delay: cfg.setup.hop_delay, ..LinkConfig::default() };
        // The ring listener also ships the model to workers that lack it (only to peers that
        // proved the cluster secret, as everything on it).
        let manifest = ManifestStore::new(file.clone());
        let manifest_handler = move |method: String, _body: serde_json::Value| {
            let manifest = manifest.clone();
            async move {
                match method.as_str() {
                    shipping::MANIFEST => shipping::serve_manifest(&manifest),
                    other => Err(transport::ControlFailure::unknown_method(other)),
                }
            }
        };
        let shipped = file.clone();
        let range_handler = move |method: String, body: serde_json::Value| {
            let file = shipped.clone();
            async move {
                match method.as_str() {
                    shipping::RANGE => shipping::serve_range(file, body).await,
                    other => Err(transport::ControlFailure::unknown_method(other)),
                }
            }
        };
        let server = rt.block_on(LinkServer::bind_with_blobs(cfg.setup.listen, cfg.setup.secret.clone(), link_config.clone(), Some(Arc::new(manifest_handler)), Some(Arc::new(range_handler))))?;
        if let Some(port) = cfg.setup.discovery {
            let discovery = rt.block_on(async { transport::discovery::Discovery::bind(port, &cfg.setup.secret) })?;
            let name = crate::process::hostname().unwrap_or_else(|| HEAD_NAME.into());
            tracing::info!(port = discovery.port(), "announcing this head on the LAN: workers started without --head join it");
            rt.spawn(super::membership::serve_head(discovery, planner.membership.clone(), name));
        }
        board.set_membership(planner.membership.clone());
        let workers = super::planning::addresses(&devices, &members);
        let strategy = (source != "windows").then_some(planner.options.strategy);
        let dtype = if cfg.setup.f16 { Dtype::F16 } else { Dtype::F32 };
        let flights = Flights::new(file.spec.hidden_width(), dtype, cfg.setup.step_timeout);
        let meter = RingMeter::new(HEAD_NAME, &workers);
        let mut ring = RingPipeline {
            rt,
            head,
            links: Links::default(),
            flights,
            server,
            fingerprint: file.fingerprint(),
            file,
            id: uuid::Uuid::new_v4().to_string(),
            link_config,
            replan: Replanning { idle_after: cfg.setup.replan_idle, planner, policy: ReplanPolicy::default(), devices, members, strategy, last_check: Instant::now(), awaiting_fetch: None },
            board,
            meter,
            depth: 1,
            pipelining: None,
            cfg,
            plan,
            members: workers,
        };
        ring.pace(&prediction);
        ring.publish(&source, Some(&prediction), false);
        if !ring.members.is_empty() {
            // Workers may still be starting (one compose file per device, started in any
            // order): wait for unreachable ones, but fail at once on a definite refusal.
            let deadline = Instant::now() + ring.cfg.setup.startup_wait;
            // Workers without the model fetch their windows first, however long that takes.
            let mut logged = Instant::now();
            loop {
                let cluster = live(&ring.rt, &ring.cfg, &ring.link_config, &ring.server, &ring.fingerprint);
                match cluster.fetch(&wanted(&ring.plan, &ring.members)) {
                    Ok(None) => break,
                    Ok(Some(progress)) => {
                        if logged.elapsed() >= FETCH_LOG_EVERY {
                            tracing::info!("waiting for workers to fetch their windows: {progress}");
                            logged = Instant::now();
                        }
                        std::thread::sleep(FETCH_POLL);
                    }
                    Err(Error::RingBroken(e)) if Instant::now() < deadline => {
                        tracing::warn!("waiting for the ring: {e}");
                        std::thread::sleep(STARTUP_RETRY);
                    }
                    Err(e) => return Err(e),
                }
            }
            let link = loop {
                match ring.form() {
                    Ok(link) => break link,
                    Err(Error::RingBroken(e)) if Instant::now() < deadline => {
                        tracing::warn!("waiting for the ring: {e}");
                        std::thread::sleep(STARTUP_RETRY);
                    }
                    Err(e) => return Err(e),
                }
            };
            ring.links.set(Box::new(link));
            crate::metrics::ring_formed();
        }
        tracing::info!(workers = ?ring.members, rounds = ring.plan.rounds(), "ring formed");
        Ok(ring)
    }

    /// How many micro-batches the running plan holds in flight, and the stage times that
    /// cut prompts into chunks: as many as the forecast decodes a family's streams fastest
    /// with, at least one per member that computes (`scheduler::pipelining::auto_depth`),
    /// unless `--micro-batches` says otherwise. A ring that pages
    /// windows from disk takes one at a time, as prima.cpp does: each micro-batch in flight
    /// would read every released window again.
    fn pace(&mut self, prediction: &Prediction) {
        let r = &self.replan;
        let profiles: Vec<DeviceProfile> = r.members.iter().map(|&m| r.devices[m].clone()).collect();
        let pages = self.cfg.setup.release == Some(true) || self.head.pager.as_ref().is_some_and(|p| p.release());
        self.pipelining = (profiles.len() == prediction.devices.len()).then(|| scheduler::Pipelining::of(&profiles, &r.planner.model, &self.plan));
        self.depth = match (self.cfg.setup.micro_batches, &self.pipelining) {
            _ if !self.head.workers_compute => 1,
            (Some(n), _) => n.max(1),
            (None, _) if pages => 1,
            (None, Some(p)) => scheduler::pipelining::auto_depth(&self.plan, prediction, p),
            // Profiles that do not match the plan's members: one per member that computes.
            (None, None) => scheduler::pipelining::computing_members(&self.plan),
        };
        // Members that share a machine split its cores while they compute at once (a
        // worker takes the count with its plan, at `form`).
        let threads = self.pipelining.as_ref().map(|p| p.threads(self.depth));
        for (i, d) in self.plan.devices.iter_mut().enumerate() {
            let own = profiles.get(i).and_then(|p| p.host.as_ref()).map_or(0, |h| h.threads);
            d.threads = threads.as_ref().and_then(|t| t.get(i).copied()).filter(|&t| t != own).unwrap_or(0);
        }
        let head_threads = self.plan.devices.first().map_or(0, |d| d.threads);
        self.head.stage.set_threads(if head_threads > 0 { head_threads } else { self.cfg.threads });
        tracing::info!(micro_batches = self.depth, pages, threads = ?self.plan.devices.iter().map(|d| d.threads).collect::<Vec<_>>(), "micro-batches in flight (threads per member; 0: its own)");
    }

    /// Shows the running plan on the admin API and the metrics.
    fn publish(&self, source: &str, prediction: Option<&Prediction>, replan: bool) {
        let r = &self.replan;
        let names: Vec<String> = std::iter::once(HEAD_NAME.to_string()).chain(self.members.iter().cloned()).collect();
        let dropped = r.planner.membership.candidates().into_iter().filter(|w| !self.members.contains(w)).collect();
        let judge = board::Judge {
            members: r.members.iter().map(|&m| r.devices[m].clone()).collect(),
            model: r.planner.model.clone(),
            plan: self.plan.clone(),
            disk_threshold: r.planner.options.disk_threshold,
            options: scheduler::Options { strategy: r.strategy.unwrap_or(r.planner.options.strategy), ..r.planner.options.clone() },
        };
        let mut view = PlanView::of(source, r.idle_after.is_some(), &self.plan, &names, prediction, dropped);
        view.micro_batches = self.depth;
        view.forecast = self.pipelining.as_ref().map(|p| p.forecast(self.depth, self.cfg.max_batch));
        self.board.adopted(view, Some(judge), replan);
        self.board.placed(0, self.head.placed.0, self.head.placed.1);
    }

    /// Runs `plan` from now on, with `members` (indices into the gathered devices; 0 is
    /// the head) in ring order: rebuilds the head's stage and forms the ring again. Every
    /// cache starts empty. A ring that cannot be formed is left broken for `recover`.
    fn adopt(&mut self, plan: Plan, members: Vec<usize>, source: &str, prediction: &Prediction) -> Result<()> {
        self.links.clear();
        self.flights.forget_pending_kv();
        self.head = HeadStage::build(&self.file, &plan, &self.cfg)?;
        self.members = super::planning::addresses(&self.replan.devices, &members);
        self.meter = RingMeter::new(HEAD_NAME, &self.members);
        self.plan = plan;
        self.replan.members = members;
        self.pace(prediction);
        self.publish(source, Some(prediction), true);
        tracing::info!(workers = ?self.members, rounds = &self.plan.rounds(), "adopting a new plan");
        if self.members.is_empty() {
            return Ok(());
        }
        match self.form() {
            Ok(link) => {
                self.links.set(Box::new(link));
                crate::metrics::ring_formed();
                Ok(())
            }
            Err(e) => {
                crate::metrics::ring_broke();
                self.links.still_broken(e.to_string());
                Err(e)
            }
        }
    }

    /// Looks at the plan (see `adoption`) and carries out the verdict. `Ok(true)`: a plan
    /// was adopted and every cache is empty.
    fn check_plan(&mut self, forced: bool, ask: Ask) -> Result<bool> {
        let cluster = live(&self.rt, &self.cfg, &self.link_config, &self.server, &self.fingerprint);
        let verdict = self.replan.check(&cluster, &self.board, Running { plan: &self.plan, workers: &self.members }, forced, ask)?;
        self.carry_out(verdict)
    }

    fn carry_out(&mut self, verdict: Verdict) -> Result<bool> {
        match verdict {
            Verdict::Adopt(s, strategy) => {
                self.adopt(s.plan, s.members, strategy.as_str(), &s.prediction)?;
                Ok(true)
            }
            Verdict::Fetching(progress) => {
                tracing::info!("the new plan waits for workers fetching their windows: {progress}");
                Ok(false)
            }
            Verdict::Keep => Ok(false),
        }
    }

    /// Past the grace period, plans without the members that cannot be reached.
    /// `Ok(false)`: every member answers, so there is nobody to plan without.
    fn replan_after_loss(&mut self) -> Result<bool> {
        let cluster = live(&self.rt, &self.cfg, &self.link_config, &self.server, &self.fingerprint);
        let running = Running { plan: &self.plan, workers: &self.members };
        match self.replan.after_loss(&cluster, &self.board, running, self.cfg.setup.member_grace)? {
            Some(verdict) => self.carry_out(verdict),
            None => Ok(false),
        }
    }

    /// The ring's links formed for the running plan: every worker answers and has its
    /// windows first (a worker that lost its copy fetches again), so a ring waiting for one
    /// lost device does not make the others reallocate their caches on every attempt.
    fn form(&mut self) -> Result<TcpRing> {
        let cluster = live(&self.rt, &self.cfg, &self.link_config, &self.server, &self.fingerprint);
        let (clients, fetching) = cluster.connect_ready(&wanted(&self.plan, &self.members))?;
        if let Some(progress) = fetching {
            return Err(Error::RingBroken(format!("workers are fetching their windows from the head: {progress}")));
        }
        let probe = self.flights.next_step();
        links::form(Formation {
            rt: &self.rt,
            cfg: &self.cfg,
            plan: &self.plan,
            workers: &self.members,
            clients,
            server: &mut self.server,
            link_config: &self.link_config,
            fingerprint: &self.fingerprint,
            head_id: &self.id,
            board: &self.board,
            probe,
        })
    }

    /// Whether every worker holding layers answered a `Rows` frame with a non-empty part
    /// (its rows kept or written).
    fn every_worker_did(&self, answers: &[Vec<u8>]) -> bool {
        answers.len() == self.members.len() && answers.iter().enumerate().all(|(i, p)| !p.is_empty() || self.plan.devices[i + 1].window == 0)
    }

    /// Every member keeps the first `at` positions of `seq` (a failed write's rule); what
    /// the sequence holds then.
    fn cut(&mut self, seq: SeqId, at: usize) -> usize {
        crate::runtime::generation::Pipeline::truncate_sequence(self, seq, at)
    }

    /// Rows from the prompt cache were being written from `at` when the ring broke: every
    /// member starts empty when it forms again, and the head keeps the first `at`. What
    /// the sequence holds then.
    fn ring_broke_while_writing(&mut self, seq: SeqId, at: usize, why: &str) -> usize {
        tracing::warn!("rows from the prompt cache not written: {why}");
        self.head.stage.truncate_sequence(seq, at);
        self.head.stage.sequence_len(0, seq)
    }

    /// The flights, and their view of the running ring.
    fn ring(&mut self) -> (&mut Flights, Ring<'_, HeadStage>) {
        let members = self.members.len() + 1;
        (&mut self.flights, Ring { head: &mut self.head, links: &mut self.links, meter: &self.meter, board: &self.board, members })
    }
}

/// A ring's block as the head keeps it: its own rows, then each worker's answer in ring
/// order (the workers keep their rows themselves), each as its length (u64) and bytes.
fn pack_parts(parts: impl Iterator<Item = Vec<u8>>) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(&p);
    }
    out
}

/// The parts of a block [`pack_parts`] made; `None` when it is not one.
fn unpack_parts(mut block: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut parts = Vec::new();
    while !block.is_empty() {
        let len = usize::try_from(u64::from_le_bytes(block.get(..8)?.try_into().ok()?)).ok()?;
        let part = block.get(8..8usize.checked_add(len)?)?;
        parts.push(part.to_vec());
        block = &block[8 + len..];
    }
    Some(parts)
}

/// The cluster as deciding and forming the ring reach it, from the head's parts.
fn live<'a>(rt: &'a tokio::runtime::Runtime, cfg: &'a RingConfig, link_config: &'a LinkConfig, server: &LinkServer, fingerprint: &'a str) -> LiveCluster<'a> {
    LiveCluster { rt, setup: &cfg.setup, link_config, listen: server.local_addr(), fingerprint }
}

impl crate::runtime::generation::Pipeline for RingPipeline {
    fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> Result<Logits> {
        self.start(FORWARD_TICKET, batch, tokens)?;
        loop {
            let (ticket, result) = self.finish();
            if ticket == FORWARD_TICKET {
                return result;
            }
        }
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn prompt_chunk(&self, prompt: usize, max_batch: usize) -> usize {
        if self.depth <= 1 {
            return max_batch;
        }
        if let Some(chunk) = self.cfg.setup.prompt_chunk {
            return chunk;
        }
        self.pipelining.as_ref().map_or(max_batch, |p| p.best_chunk(prompt, max_batch, self.depth))
    }

    fn start(&mut self, ticket: u64, batch: &[BatchToken], tokens: &[i32]) -> Result<()> {
        let (flights, mut ring) = self.ring();
        flights.launch(&mut ring, ticket, batch, tokens);
        Ok(())
    }

    fn finish(&mut self) -> (u64, Result<Logits>) {
        let (flights, mut ring) = self.ring();
        flights.finish(&mut ring, FORWARD_TICKET)
    }

    fn clear_sequence(&mut self, seq: SeqId) {
        let (flights, mut ring) = self.ring();
        flights.kv(&mut ring, [KvOp::Clear { seq }]);
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> usize {
        let (flights, mut ring) = self.ring();
        flights.kv(&mut ring, [KvOp::Truncate { seq, len: len as u32 }]);
        // Every member applies the same rule to the same checkpoints: the head's own
        // windows tell what all kept.
        self.head.stage.sequence_len(0, seq)
    }

    fn copy_sequence(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        let (flights, mut ring) = self.ring();
        flights.kv(&mut ring, [KvOp::Copy { seq: to, from, len: u32::try_from(len).unwrap_or(u32::MAX) }]);
        // Every member applies the same rule to the same slots: the head's own windows
        // tell what all copied.
        self.head.stage.sequence_len(0, to)
    }

    fn keeps_state(&self) -> bool {
        self.file.spec.recurrent.is_some()
    }

    fn row_layout(&self) -> Option<String> {
        if self.head.workers_compute && !self.links.formed() {
            return None;
        }
        // Each worker's rows follow from its windows, the cache types and where its layers
        // run; the head's from its stage. A plan that moves a layer is another layout.
        let workers: Vec<String> = (1..self.plan.devices.len()).map(|i| format!("{:?} gpu {}", self.plan.windows_of(i), self.plan.devices[i].gpu_layers)).collect();
        // The head's blocks hold its own rows; each worker keeps its own (keyed by the
        // block's id).
        Some(format!("ring, each member keeping its rows; head {} gpu {:?}; workers {}; kv {}; batch_invariant {}", self.head.stage.row_layout(), self.head.placed, workers.join(", "), self.cfg.kv, self.cfg.batch_invariant))
    }

    fn read_rows(&mut self, seq: SeqId, at: usize, n: usize, key: &BlockId, with_state: bool) -> Option<Vec<u8>> {
        let own = self.head.stage.read_rows(seq, at, n, with_state)?;
        let workers = self.members.len();
        let answers = if self.head.workers_compute {
            let (flights, mut ring) = self.ring();
            let answers = flights.rows(&mut ring, seq, at, n, if with_state { RowsOp::KeepWithState } else { RowsOp::Keep }, *key).map_err(|e| tracing::warn!("rows for the prompt cache not kept: {e}")).ok()?;
            // Every worker holding layers kept its rows.
            self.every_worker_did(&answers).then_some(answers)?
        } else {
            vec![Vec::new(); workers]
        };
        Some(pack_parts(std::iter::once(own).chain(answers)))
    }

    fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, key: &BlockId, block: &[u8]) -> std::result::Result<(), usize> {
        // One block is a restore of one.
        let mut one = Some((*key, Arc::new(block.to_vec())));
        self.write_blocks(seq, at, n, &mut || one.take()).map(drop).map_err(|(_, len)| len)
    }

    fn write_blocks(&mut self, seq: SeqId, at: usize, n: usize, next: &mut dyn FnMut() -> Option<(BlockId, Arc<Vec<u8>>)>) -> std::result::Result<usize, (usize, usize)> {
        // The head writes its rows of each block and sends the block's frame on at once:
        // while a worker reads its rows of one block from its disk, the head reads its own
        // of the next and the worker before it those of the next. The answers are waited
        // for at the end, together.
        let mut steps = Vec::new();
        let mut own_failed = false;
        while let Some((key, block)) = next() {
            let pos = at + steps.len() * n;
            let own = unpack_parts(&block).filter(|p| p.len() == self.members.len() + 1).map(|mut p| p.swap_remove(0));
            if !own.is_some_and(|own| self.head.stage.write_rows(seq, pos, n, &own)) {
                own_failed = true;
                break;
            }
            if !self.head.workers_compute {
                steps.push(0);
                continue;
            }
            let (flights, mut ring) = self.ring();
            match flights.send_rows(&mut ring, seq, pos, n, RowsOp::Write, key) {
                Ok(step) => steps.push(step),
                Err(e) => return Err((0, self.ring_broke_while_writing(seq, at, &e))),
            }
        }
        let answers = if self.head.workers_compute {
            let (flights, mut ring) = self.ring();
            match flights.rows_back(&mut ring, &steps) {
                Ok(answers) => answers,
                Err(e) => return Err((0, self.ring_broke_while_writing(seq, at, &e))),
            }
        } else {
            vec![vec![Vec::new(); self.members.len()]; steps.len()]
        };
        // The first block some member could not write (a worker that no longer has its rows
        // of it, or the head's own); every block before it stands on every member.
        let written = answers.iter().take_while(|a| self.every_worker_did(a)).count();
        if written == steps.len() && !own_failed {
            return Ok(written);
        }
        if self.file.spec.recurrent.is_some() && written < steps.len() {
            // Members that wrote later blocks hold a state from past the miss, and a state
            // cannot go back (no checkpoint there): every member starts the sequence over.
            crate::runtime::generation::Pipeline::clear_sequence(self, seq);
            return Err((written, 0));
        }
        Err((written, self.cut(seq, at + written * n)))
    }

    fn checkpoint_sequence(&mut self, seq: SeqId) {
        let (flights, mut ring) = self.ring();
        flights.kv(&mut ring, [KvOp::Checkpoint { seq }]);
    }

    fn n_ctx_seq(&self) -> usize {
        self.cfg.n_ctx_seq
    }

    fn idle(&mut self, idle_for: Duration) -> Result<bool> {
        // Before the early return below: a lost worker must show on /health while idle.
        if let Err(e) = self.links.watch() {
            for req in self.board.take_requests() {
                let _ = req.reply.send(Err(ReplanError::Broken(e.to_string())));
            }
            return Err(e);
        }
        let requests = self.board.take_requests();
        let r = &self.replan;
        let due = r.idle_after.is_some_and(|after| idle_for >= after && r.last_check.elapsed() >= after);
        let broken = self.head.workers_compute && !self.links.formed();
        // A worker that joined or leaves is judged at once (a plan the user pinned stays
        // pinned); a broken ring keeps the news for when it is whole.
        let members_changed = r.strategy.is_some() && !broken && r.planner.membership.take_changed();
        let fetch_check = r.awaiting_fetch.is_some() && !broken && r.last_check.elapsed() >= FETCH_POLL;
        let awaited = r.awaiting_fetch;
        let members_changed = members_changed || fetch_check;
        if requests.is_empty() && !due && !members_changed {
            return Ok(false);
        }
        if broken {
            let why = self.links.why();
            for req in requests {
                let _ = req.reply.send(Err(ReplanError::Broken(why.clone())));
            }
            return Ok(false);
        }
        // An operator's request outranks a plan awaited from an earlier look.
        let ask = match (requests.is_empty(), awaited) {
            (false, _) => Ask { strategy: requests.iter().find_map(|q| q.strategy), trigger: scheduler::Trigger::Asked },
            (true, Some(a)) => a,
            (true, None) => Ask::DRIFT,
        };
        let forced = !requests.is_empty() || members_changed;
        let result = self.check_plan(forced, ask);
        if let Err(e) = &result {
            tracing::warn!("re-planning failed: {e}");
            let reason = format!("re-planning failed: {e}");
            self.board.checked(CheckView::new(forced, Vec::new(), reason));
        }
        let view = self.board.view();
        for req in requests {
            let _ = req.reply.send(result.as_ref().map(|_| view.clone()).map_err(|e| ReplanError::Failed(e.to_string())));
        }
        match result {
            Ok(adopted) => Ok(adopted),
            // A new plan whose ring could not be formed: broken until `recover` forms it.
            Err(e) if self.head.workers_compute && !self.links.formed() => Err(ring_err(e)),
            Err(_) => Ok(false),
        }
    }

    fn recover(&mut self) -> Result<bool> {
        if self.links.formed() || !self.head.workers_compute {
            return Ok(false);
        }
        let broken_for = self.links.broken_for();
        match self.form() {
            Ok(link) => {
                // The workers start from empty caches: so does the head.
                for seq in 0..self.cfg.n_seq as SeqId {
                    self.head.stage.clear_sequence(seq);
                }
                self.flights.forget_pending_kv();
                self.links.set(Box::new(link));
                tracing::info!(workers = ?self.members, "ring whole again");
                crate::metrics::ring_recovered();
                Ok(true)
            }
            // Past the grace period a plan the scheduler made goes on without the lost.
            Err(e) if broken_for >= self.cfg.setup.member_grace && self.replan.strategy.is_some() => match self.replan_after_loss() {
                Ok(true) => {
                    crate::metrics::ring_recovered();
                    Ok(true)
                }
                Ok(false) => {
                    self.links.still_broken(e.to_string());
                    Err(e)
                }
                Err(again) => {
                    tracing::warn!("planning without the lost members failed: {again}");
                    self.links.still_broken(again.to_string());
                    Err(again)
                }
            },
            Err(e) => {
                tracing::debug!("ring not whole yet: {e}");
                self.links.still_broken(e.to_string());
                Err(e)
            }
        }
    }
}
