//! The head's side of the ring: a `Pipeline` (the batching loop's) whose windows are partly local
//! (the head's own, plus the embedding `0..0` and the output layer `L..L`) and partly on
//! workers, reached over one authenticated link to the first worker and back from the
//! last. Several micro-batches travel the ring at once (by default one per member that
//! computes, `pace`); frames come back in the order they left, and the head takes each
//! through its own windows as it returns. One at a time (`--micro-batches 1`) is
//! prima.cpp's way, and what a ring paging its windows from disk runs.
//!
//! A failed hop breaks the ring: the links are dropped and every step fails fast until
//! `recover` forms the ring again (plans re-sent, links re-opened, a probe frame sent all
//! the way round). Workers start from empty caches then, so the head empties its own.
//!
//! The plan comes from the scheduler (or `--windows`) at start, on profiles gathered from
//! every worker, and may change while the queue is idle: when fresh profiles drifted and a
//! new schedule predicts a real gain, or when `POST /admin/replan` asks. Adopting a plan
//! rebuilds the head's stage and forms the ring again with the members it keeps.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{BatchToken, Logits, ModelFile, SeqId, Stage, StageConfig, StageInput, StageOutput};
use scheduler::{DeviceProfile, Plan, Prediction, ReplanPolicy, Strategy};
use transport::{Activations, ControlClient, Dtype, Frame, FrameSink, FrameStream, KvOp, Link, LinkConfig, LinkServer, TokenMeta};

use super::board::{self, PlanBoard};
use crate::runtime::views::CheckView;
use super::paging::WindowPager;
use super::planning::{addresses, Planner, HEAD_NAME};
use super::shipping::{self, FetchRequest, FetchStatus, ManifestStore};
use super::{RingSetup, WorkerPlan};
use crate::error::{Error, ReplanError, Result};
use crate::metrics::RingMeter;

pub struct RingPipeline {
    rt: tokio::runtime::Runtime,
    file: Arc<ModelFile>,
    stage: Stage,
    /// How a step walks the stage's windows under the running plan.
    layout: Layout,
    /// `None` while the ring is broken.
    links: Option<Links>,
    /// Why the ring is broken.
    broken: Option<String>,
    /// Since when (the first failed attempt to form it again).
    broken_since: Option<Instant>,
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
    /// KV operations for the workers, sent in-band ahead of the next step's activations
    /// instead of a round trip of their own.
    pending_kv: Vec<KvOp>,
    step: u64,
    n_embd: usize,
    dtype: Dtype,
    replan: Replanning,
    board: Arc<PlanBoard>,
    /// Per-device metrics of the running plan's members.
    meter: RingMeter,
    /// Micro-batches whose frames are in the ring, in the order they left (they come
    /// back in that order).
    in_ring: VecDeque<Flight>,
    /// Micro-batches done (logits or error), waiting for `finish`.
    done: VecDeque<(u64, Result<Logits>)>,
    /// Frames read from the ring while the head was sending, not yet taken.
    early: VecDeque<Result<Option<Frame>, String>>,
    /// Micro-batches the running plan may hold in flight at once.
    depth: usize,
    /// The running plan's stage times, to cut prompts into chunks; `None` for a plan from
    /// `--windows` without profiles to judge it by.
    pipelining: Option<scheduler::Pipelining>,
}

/// The ticket `forward` gives its one micro-batch (the batching loop numbers its own from 0).
const FORWARD_TICKET: u64 = u64::MAX;

/// One micro-batch on its way round the ring.
struct Flight {
    ticket: u64,
    /// The ring's step number, which its frames carry.
    step: u64,
    batch: Vec<BatchToken>,
    tokens: Vec<i32>,
    /// The token list that travels with its frames (taken while a frame is out).
    metas: Vec<TokenMeta>,
    /// The round its frame is on.
    round: usize,
    /// When its frame last left for the ring: the head's wait for it starts then.
    sent: Option<Instant>,
    started: Instant,
    /// No other micro-batch shared the ring with it: its round trips time the hops.
    alone: bool,
    /// The hops of its round trips (seconds), for the board.
    hops: Vec<f64>,
    /// Bytes each member (the head first) read from disk while computing it, and whether
    /// every round trip brought every report.
    reads: Vec<u64>,
    reads_known: bool,
}

/// What re-planning a running ring needs besides the planner.
struct Replanning {
    planner: Planner,
    /// Re-plan by itself after the queue has been idle this long; `None`: only when asked.
    idle_after: Option<Duration>,
    policy: ReplanPolicy,
    /// The profiles the running plan was last judged on: the head, then every candidate.
    devices: Vec<DeviceProfile>,
    /// Indices into `devices` of the running plan's members, in ring order.
    members: Vec<usize>,
    /// The running plan's strategy; `None` for a plan from `--windows`.
    strategy: Option<Strategy>,
    last_check: Instant,
    /// A plan chosen while some of its workers were still fetching their windows from
    /// this head: checked again at idle moments until they have them, as it was asked for.
    awaiting_fetch: Option<Ask>,
}

/// What a look at the plan was asked for: the strategy (`None`: the running one) and
/// whether an operator asked (then a plan that differs is applied whatever its gain) or
/// the head looked by itself (then it must predict a real gain).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ask {
    strategy: Option<Strategy>,
    trigger: scheduler::Trigger,
}

struct Links {
    to_first: FrameSink,
    from_last: FrameStream,
}

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
    /// The head's own windows may be repacked (`--no-repack` off; paged windows never are).
    pub repack: bool,
    /// The head's GPU layers per window: the plan's, or the user's count.
    pub gpu_layers: crate::runtime::GpuPlacement,
}

/// The head's part of a plan: its stage's windows and how a step walks them. The head's
/// first window starts at layer 0 (it leads round 0), so it embeds the tokens itself; a
/// head without layers gets an embedding-only window `0..0`. The output layer is its own
/// window `L..L` unless the head's last window ends the model (every worker relays).
/// Fewer windows, fewer graphs per step: the stage rebuilds its graph when the window
/// changes, and a head running the whole model this way is as fast as a single node.
struct Layout {
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

impl Layout {
    fn build(file: &Arc<ModelFile>, plan: &Plan, cfg: &RingConfig) -> Result<(Stage, Layout)> {
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
        let paged = super::paging::pages_from_disk(&file, &own_windows, cfg.setup.release);
        let planned = plan.devices.first().map_or((0, 0), |d| (d.gpu_layers, d.experts_in_ram));
        let (accel_layers, experts_in_ram) = cfg.gpu_layers.resolve(planned.0, planned.1);
        let stage = Stage::new(
            file.clone(),
            StageConfig {
                windows,
                n_seq: cfg.n_seq,
                n_ctx_seq: cfg.n_ctx_seq,
                max_batch: cfg.max_batch,
                threads: cfg.threads,
                accel_layers,
                experts_in_ram,
                owns_output: true,
                batch_invariant: cfg.batch_invariant,
                repack: cfg.repack && !paged,
                read_chosen_experts: paged,
            },
        )?;
        // Made after the stage, so the stage's own memory counts against the budget.
        let pager = (!own_windows.is_empty()).then(|| WindowPager::new(file.clone(), own_windows.clone(), cfg.setup.prefetch, cfg.setup.release));
        if let Some(p) = &pager {
            tracing::info!("head windows: {}", p.describe());
        }
        // A count above the window places the whole window.
        let window = plan.devices.first().map_or(0, |d| d.window);
        let placed = (accel_layers.min(window), experts_in_ram.min(accel_layers).min(window));
        Ok((stage, Layout { own, embed_window, output_window, pager, workers_compute: plan.devices[1..].iter().any(|d| d.window > 0), placed }))
    }
}

/// A failure of the ring (not of this machine's engine): the batching loop reports the ring
/// broken and recovers it.
fn ring_err(e: impl std::fmt::Display) -> Error {
    Error::RingBroken(e.to_string())
}

/// How long forming the ring may wait for the last worker to dial back, in units of the
/// link handshake timeout: every worker in between opens its own link first.
const FORM_WAIT_HANDSHAKES: u32 = 4;
/// Pause between attempts to form the ring at start, while workers are still starting.
const STARTUP_RETRY: Duration = Duration::from_secs(1);
/// How often the head asks workers fetching their windows how far they are.
const FETCH_POLL: Duration = Duration::from_secs(1);
const FETCH_LOG_EVERY: Duration = Duration::from_secs(5);

impl RingPipeline {
    /// Gathers every candidate's profile (waiting for workers still starting), takes the
    /// plan from `cfg.pinned` or the planner's strategy, and forms the ring.
    pub fn connect(file: Arc<ModelFile>, cfg: RingConfig, planner: Planner, board: Arc<PlanBoard>) -> Result<RingPipeline> {
        let rt = crate::process::ring_runtime()?;
        let devices = planner.gather(&rt, cfg.setup.startup_wait, None)?;
        board.gathered(devices.clone());
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
        let (stage, layout) = Layout::build(&file, &plan, &cfg)?;
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
        let n_embd = file.spec.n_embd;
        let meter = RingMeter::new(HEAD_NAME, &workers);
        let mut ring = RingPipeline {
            rt,
            stage,
            layout,
            links: None,
            broken: None,
            broken_since: None,
            server,
            fingerprint: file.fingerprint(),
            file,
            id: uuid::Uuid::new_v4().to_string(),
            link_config,
            pending_kv: Vec::new(),
            step: 0,
            n_embd,
            dtype: if cfg.setup.f16 { Dtype::F16 } else { Dtype::F32 },
            replan: Replanning { idle_after: cfg.setup.replan_idle, planner, policy: ReplanPolicy::default(), devices, members, strategy, last_check: Instant::now(), awaiting_fetch: None },
            board,
            meter,
            in_ring: VecDeque::new(),
            done: VecDeque::new(),
            early: VecDeque::new(),
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
                let wanted = ring.wanted(&ring.plan, &ring.members);
                match ring.fetch_windows(&wanted) {
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
            ring.links = Some(loop {
                match ring.form() {
                    Ok(links) => break links,
                    Err(Error::RingBroken(e)) if Instant::now() < deadline => {
                        tracing::warn!("waiting for the ring: {e}");
                        std::thread::sleep(STARTUP_RETRY);
                    }
                    Err(e) => return Err(e),
                }
            });
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
        let pages = self.cfg.setup.release == Some(true) || self.layout.pager.as_ref().is_some_and(|p| p.release());
        self.pipelining = (profiles.len() == prediction.devices.len()).then(|| scheduler::Pipelining::of(&profiles, &r.planner.model, &self.plan));
        self.depth = match (self.cfg.setup.micro_batches, &self.pipelining) {
            _ if !self.layout.workers_compute => 1,
            (Some(n), _) => n.max(1),
            (None, _) if pages => 1,
            (None, Some(p)) => scheduler::pipelining::auto_depth(&self.plan, prediction, p),
            // Profiles that do not match the plan's members: one per member that computes.
            (None, None) => scheduler::pipelining::computing_members(&self.plan),
        };
        tracing::info!(micro_batches = self.depth, pages, "micro-batches in flight");
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
        };
        let mut view = board::view(source, r.idle_after.is_some(), &self.plan, &names, prediction, dropped);
        view.micro_batches = self.depth;
        view.forecast = self.pipelining.as_ref().map(|p| p.forecast(self.depth, self.cfg.max_batch));
        self.board.adopted(view, Some(judge), replan);
        self.board.placed(0, self.layout.placed.0, self.layout.placed.1);
    }

    /// Runs `plan` from now on, with `members` (indices into the gathered devices; 0 is
    /// the head) in ring order: rebuilds the head's stage and forms the ring again. Every
    /// cache starts empty. A ring that cannot be formed is left broken for `recover`.
    fn adopt(&mut self, plan: Plan, members: Vec<usize>, source: &str, prediction: &Prediction) -> Result<()> {
        self.links = None;
        self.pending_kv.clear();
        let (stage, layout) = Layout::build(&self.file, &plan, &self.cfg)?;
        self.stage = stage;
        self.layout = layout;
        self.members = super::planning::addresses(&self.replan.devices, &members);
        self.meter = RingMeter::new(HEAD_NAME, &self.members);
        self.plan = plan;
        self.replan.members = members;
        self.pace(prediction);
        self.publish(source, Some(prediction), true);
        tracing::info!(workers = ?self.members, rounds = &self.plan.rounds(), "adopting a new plan");
        if self.members.is_empty() {
            self.broken = None;
            return Ok(());
        }
        match self.form() {
            Ok(links) => {
                self.links = Some(links);
                self.broken = None;
                crate::metrics::ring_formed();
                Ok(())
            }
            Err(e) => {
                crate::metrics::ring_broke();
                self.broken = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// Gathers fresh profiles and, when they drifted (or `forced`), solves again over every
    /// candidate and adopts the new plan if it predicts a real gain — or, when an operator
    /// asked, whenever it differs from the running one. `Ok(true)`: a plan was adopted and
    /// every cache is empty.
    fn check_plan(&mut self, forced: bool, ask: Ask) -> Result<bool> {
        let strategy = ask.strategy;
        let r = &mut self.replan;
        r.last_check = Instant::now();
        let mut devices = r.planner.gather(&self.rt, Duration::ZERO, Some(&self.members))?;
        // The running members in the fresh list (workers outside the ring may have come or
        // gone); a member missing from it said it leaves: it is no candidate any more.
        let found: Vec<Option<usize>> = r.members.iter().map(|&m| devices.iter().position(|d| d.name == r.devices[m].name)).collect();
        let left: Vec<String> = r.members.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(&m, _)| r.devices[m].name.clone()).collect();
        if !left.is_empty() {
            return self.replan_without(devices, format!("{} left", left.join(", ")), forced);
        }
        let running: Vec<usize> = found.into_iter().flatten().collect();
        // Hops as the ring's traffic measured them, where it has run under this plan, and
        // how much of a MoE model's experts it read from disk: what the next plan is judged on.
        if let Some(hop) = self.board.measured_hop() {
            devices = board::with_measured_hop(&devices, &running, hop);
        }
        if let (Some(ds), Some(moe)) = (self.board.measured_disk_share(), r.planner.model.moe.as_mut()) {
            moe.disk_share = ds;
        }
        self.board.gathered(devices.clone());
        let drift = scheduler::drift(&r.devices, &devices, &r.policy);
        let mut check = CheckView::new(forced, drift.clone(), String::new());
        if !forced && drift.is_empty() {
            check.reason = "no profile drifted".into();
            self.board.checked(check);
            return Ok(false);
        }
        let strategy_now = strategy.or(r.strategy).unwrap_or(r.planner.options.strategy);
        let candidate = r.planner.schedule(&devices, strategy_now)?;
        let plan = &self.plan;
        let decision = scheduler::decide(&devices, &r.planner.model, scheduler::Current { members: &running, plan }, &candidate, &r.policy, r.planner.options.disk_threshold, ask.trigger);
        let apply = decision.apply;
        check.applied = apply;
        check.current_tpot_ms = Some(decision.current_tpot_s * 1e3);
        check.candidate_tpot_ms = Some(decision.candidate_tpot_s * 1e3);
        check.reason = match ask.trigger {
            scheduler::Trigger::Asked => format!("strategy {strategy_now} over {} candidate(s): {}", devices.len() - 1, decision.reason),
            scheduler::Trigger::Drift => decision.reason,
        };
        tracing::info!(drift = ?drift, applied = apply, "re-planning: {}", check.reason);
        // Later drift is measured from what this decision saw.
        r.devices = devices;
        r.members = running;
        self.board.checked(check);
        if !apply {
            self.replan.awaiting_fetch = None;
            return Ok(false);
        }
        // The new plan's workers fetch what they lack while the running plan serves on.
        let wanted = self.wanted(&candidate.plan, &addresses(&self.replan.devices, &candidate.members));
        if let Some(progress) = self.fetch_windows(&wanted)? {
            self.replan.awaiting_fetch = Some(ask);
            let mut check = CheckView::new(forced, Vec::new(), format!("the new plan waits for workers fetching their windows: {progress}"));
            check.fetching = Some(progress);
            check.candidate_tpot_ms = Some(candidate.prediction.tpot_s * 1e3);
            self.board.checked(check);
            return Ok(false);
        }
        self.replan.awaiting_fetch = None;
        self.replan.strategy = Some(strategy_now);
        tracing::info!("{}", super::planning::table(&self.replan.devices, &self.replan.planner.model, &candidate, &[]));
        self.adopt(candidate.plan, candidate.members, strategy_now.as_str(), &candidate.prediction)?;
        Ok(true)
    }

    /// A member is gone (it said it leaves, or stayed lost past the grace period): plans
    /// on `devices`, which lack it, with the running strategy and adopts that plan whatever
    /// the gain — the running plan cannot stay.
    fn replan_without(&mut self, devices: Vec<DeviceProfile>, reason: String, forced: bool) -> Result<bool> {
        let r = &mut self.replan;
        let strategy = r.strategy.unwrap_or(r.planner.options.strategy);
        let candidate = r.planner.schedule(&devices, strategy)?;
        r.awaiting_fetch = None;
        self.board.gathered(devices.clone());
        let mut check = CheckView::new(forced, vec![reason.clone()], format!("{reason}: planning with the devices there are"));
        check.applied = true;
        check.candidate_tpot_ms = Some(candidate.prediction.tpot_s * 1e3);
        self.board.checked(check);
        tracing::warn!("{reason}: planning with the devices there are");
        r.devices = devices;
        r.strategy = Some(strategy);
        tracing::info!("{}", super::planning::table(&self.replan.devices, &self.replan.planner.model, &candidate, &[]));
        self.adopt(candidate.plan, candidate.members, strategy.as_str(), &candidate.prediction)?;
        Ok(true)
    }

    /// The ring stayed broken past the grace period: the members that cannot be reached
    /// are planned without (and a discovered one must join again to be judged again).
    /// `Ok(false)`: every member answers, so there is nobody to plan without.
    fn replan_after_loss(&mut self) -> Result<bool> {
        let devices = self.replan.planner.gather(&self.rt, Duration::ZERO, Some(&[] as &[String]))?;
        let lost: Vec<String> = self.members.iter().filter(|m| !devices.iter().any(|d| d.name == **m)).cloned().collect();
        if lost.is_empty() {
            return Ok(false);
        }
        for m in &lost {
            if let Ok(addr) = m.parse() {
                self.replan.planner.membership.lost(addr);
            }
        }
        let grace = self.cfg.setup.member_grace.as_secs();
        self.replan_without(devices, format!("{} unreachable for over {grace} s", lost.join(", ")), false)
    }

    /// Each of `workers` with the windows `plan` gives it (the head is the plan's device 0).
    fn wanted(&self, plan: &Plan, workers: &[String]) -> Vec<(String, Vec<(usize, usize)>)> {
        workers.iter().enumerate().map(|(i, w)| (w.clone(), plan.windows_of(i + 1).iter().map(|r| (r.start, r.end)).collect())).collect()
    }

    /// Asks each worker to have what its windows need, fetching it from this head when it
    /// lacks the model (one that has it answers at once): then it runs the head's model.
    /// `Ok(None)`: every one is ready; `Ok(Some(progress))`: some are still fetching (in
    /// the background: ask again).
    fn fetch_windows(&self, wanted: &[(String, Vec<(usize, usize)>)]) -> Result<Option<String>> {
        Ok(self.connect_ready(wanted)?.1)
    }

    /// `fetch_windows`, also handing back the connection to each worker, in order.
    fn connect_ready(&self, wanted: &[(String, Vec<(usize, usize)>)]) -> Result<(Vec<ControlClient>, Option<String>)> {
        let (secret, config, listen, advertise, fingerprint) = (&self.cfg.setup.secret, &self.link_config, self.server.local_addr(), &self.cfg.setup.advertise, &self.fingerprint);
        self.rt.block_on(async {
            let mut waiting = Vec::new();
            let mut clients = Vec::with_capacity(wanted.len());
            // A relay (no windows) fetches the header only: its model's fingerprint.
            for (w, windows) in wanted {
                let client = ControlClient::connect(w, secret, config).await.map_err(|e| super::connecting(w, e))?;
                let source = match advertise {
                    Some(a) => a.clone(),
                    None => super::reachable_at(listen, w).await,
                };
                let request = FetchRequest { fingerprint: fingerprint.clone(), source, windows: windows.clone() };
                let body = serde_json::to_value(&request).map_err(|e| Error::RingRefused(e.to_string()))?;
                let answer = client.call(shipping::FETCH, &body).await.map_err(|e| super::connecting(w, e))?;
                let status: FetchStatus = serde_json::from_value(answer).map_err(|e| Error::RingRefused(format!("worker {w} answered fetch_model with {e}")))?;
                if status.needed_bytes > 0 {
                    crate::metrics::model_fetch(w, status.needed_bytes, status.verified_bytes, status.refused_pieces);
                }
                if let Some(e) = status.error {
                    return Err(Error::RingBroken(format!("worker {w} could not fetch its windows from the head: {e}")));
                }
                if !status.ready {
                    let share = status.verified_bytes as f64 / status.needed_bytes.max(1) as f64 * 100.0;
                    waiting.push(format!("{w} {share:.0}% of {:.1} MB", status.needed_bytes as f64 / 1e6));
                }
                clients.push(client);
            }
            Ok((clients, (!waiting.is_empty()).then(|| waiting.join(", "))))
        })
    }

    /// Sends every worker its plan, links head -> first worker, waits for the last worker
    /// to link back, and sends a probe frame round to prove the whole ring carries frames.
    fn form(&mut self) -> Result<Links, Error> {
        // Every worker answers and runs our model, its windows here, before any of them
        // (re)builds its stage: a ring that waits for one lost device must not make the
        // others reallocate their caches on every attempt. A worker that lost its copy (a
        // new machine at the same address) fetches again first.
        let (clients, fetching) = self.connect_ready(&self.wanted(&self.plan, &self.members))?;
        if let Some(progress) = fetching {
            return Err(Error::RingBroken(format!("workers are fetching their windows from the head: {progress}")));
        }
        self.step += 1;
        let probe = self.step;
        let (cfg, plan, workers, server, link_config, fingerprint, head_id, board) = (&self.cfg, &self.plan, &self.members, &mut self.server, &self.link_config, &self.fingerprint, &self.id, &self.board);
        self.rt.block_on(async {
            let back = match &cfg.setup.advertise {
                Some(a) => a.clone(),
                None => super::reachable_at(server.local_addr(), &workers[workers.len() - 1]).await,
            };
            for (i, (w, client)) in workers.iter().zip(&clients).enumerate() {
                let next = workers.get(i + 1).cloned().unwrap_or_else(|| back.clone());
                let wp = WorkerPlan {
                    fingerprint: fingerprint.clone(),
                    windows: plan.windows_of(i + 1).iter().map(|r| (r.start, r.end)).collect(),
                    gpu_layers: plan.devices.get(i + 1).map_or(0, |d| d.gpu_layers),
                    experts_in_ram: plan.devices.get(i + 1).map_or(0, |d| d.experts_in_ram),
                    next,
                    n_seq: cfg.n_seq,
                    n_ctx_seq: cfg.n_ctx_seq,
                    max_batch: cfg.max_batch,
                    release: cfg.setup.release,
                    batch_invariant: cfg.batch_invariant,
                    head: head_id.clone(),
                };
                let body = serde_json::to_value(&wp).map_err(|e| Error::RingRefused(e.to_string()))?;
                let reply = client.call(transport::methods::LOAD_PLAN, &body).await.map_err(|e| Error::RingRefused(format!("worker {w} refused the plan: {e}")))?;
                // A worker's own --gpu-layers / --experts-in-ram override the plan on that
                // worker: /admin/plan and the metrics show what it placed.
                let placed = |key: &str, planned: usize| reply[key].as_u64().map_or(planned, |p| p as usize);
                let (n, e) = (placed("gpu_layers", wp.gpu_layers), placed("experts_in_ram", wp.experts_in_ram));
                if (n, e) != (wp.gpu_layers, wp.experts_in_ram) {
                    tracing::warn!(worker = %w, planned_gpu_layers = wp.gpu_layers, gpu_layers = n, planned_experts_in_ram = wp.experts_in_ram, experts_in_ram = e, "the worker's own --gpu-layers/--experts-in-ram override the plan");
                }
                board.placed(i + 1, n, e);
            }
            // Links a half-formed earlier attempt left queued would carry nothing.
            while let Ok(Some(stale)) = tokio::time::timeout(Duration::ZERO, server.accept()).await {
                tracing::debug!(peer = %stale.peer(), "dropping a stale ring link");
            }
            // Connecting to the first worker makes each worker dial its successor; the
            // last one dials back here.
            let first = &workers[0];
            let mut to_first = Link::connect(first, &cfg.setup.secret, link_config).await.map_err(|e| super::connecting(first, e))?.sink;
            let mut from_last = tokio::time::timeout(link_config.handshake_timeout * FORM_WAIT_HANDSHAKES, server.accept())
                .await
                .map_err(|_| Error::RingRefused("the last worker did not connect back to the head (is --ring-listen reachable from it?)".into()))?
                .ok_or_else(|| Error::RingRefused("the head's ring listener closed".into()))?
                .stream;
            from_last.set_peer(workers.last().map_or("the last worker", String::as_str));
            to_first.send(&Frame::KvOps { step: probe, ops: Vec::new() }).await.map_err(|e| Error::RingBroken(e.to_string()))?;
            match from_last.recv_within(cfg.setup.step_timeout).await {
                Ok(Some(Frame::KvOps { step, .. })) if step == probe => Ok(Links { to_first, from_last }),
                Ok(Some(Frame::Error { message, .. })) => Err(Error::RingBroken(format!("a worker failed the ring probe: {message}"))),
                Ok(other) => Err(Error::RingBroken(format!("the ring probe came back as {}", other.map_or("the end of the stream", |f| f.kind_name())))),
                Err(e) => Err(Error::RingBroken(format!("the ring probe did not come round: {e}"))),
            }
        })
    }

    /// Starts a micro-batch: the head embeds it and runs its own first window, then sends
    /// it round the ring (or, when the head holds every layer, it is done at once). Where
    /// it ends up — in the ring, or done with its logits or its error — is recorded.
    fn launch(&mut self, ticket: u64, batch: &[BatchToken], tokens: &[i32]) {
        if self.layout.workers_compute && self.links.is_none() {
            let why = self.broken.clone().unwrap_or_else(|| "the ring is not formed".into());
            self.done.push_back((ticket, Err(ring_err(why))));
            return;
        }
        self.step += 1;
        let alone = self.in_ring.is_empty();
        for f in &mut self.in_ring {
            f.alone = false;
        }
        let flight = Flight {
            ticket,
            step: self.step,
            batch: batch.to_vec(),
            tokens: tokens.to_vec(),
            metas: batch.iter().map(|t| TokenMeta { seq: t.seq, pos: t.pos, wants_logits: t.logits }).collect(),
            round: 0,
            sent: None,
            started: Instant::now(),
            alone,
            hops: Vec::new(),
            reads: vec![0; self.members.len() + 1],
            reads_known: true,
        };
        // The hidden state so far; `None` until the tokens are embedded (by the head's
        // first window, or by the embedding-only window of a head without layers).
        let h = match self.layout.embed_window {
            Some(w) => match self.stage.forward(w, &flight.batch, StageInput::Tokens(&flight.tokens)) {
                Ok(StageOutput::Hidden(h)) => Some(h),
                Ok(StageOutput::Logits(_)) => return self.land(flight, Err(ring_err("the embedding window returned logits"))),
                Err(e) => return self.land(flight, Err(e.into())),
            },
            None => None,
        };
        self.advance(flight, h, 0);
    }

    /// Runs the head's windows of a micro-batch from round `from` on, until its frame
    /// leaves for the ring again or it is done.
    fn advance(&mut self, mut f: Flight, mut h: Option<Vec<f32>>, from: usize) {
        for round in from..self.layout.own.len() {
            if let Some(w) = self.layout.own[round] {
                if let Some(p) = self.layout.pager.as_mut() {
                    p.before(round, f.sent.map(|t| t.elapsed()));
                }
                let input = h.as_deref().map_or(StageInput::Tokens(&f.tokens), StageInput::Hidden);
                let out = self.stage.forward(w, &f.batch, input);
                if let Some(p) = self.layout.pager.as_mut() {
                    p.after(round);
                    let report = p.report(round);
                    self.meter.head_step(&report);
                    f.reads[0] += report.read_bytes;
                }
                match out {
                    Ok(StageOutput::Hidden(x)) => h = Some(x),
                    // Its window ends with the model's last layer (every worker relays): done.
                    Ok(StageOutput::Logits(l)) => return self.land(f, Ok(l)),
                    Err(e) => return self.land(f, Err(e.into())),
                }
            }
            if self.layout.workers_compute {
                let Some(hidden) = h.take() else { return self.land(f, Err(ring_err("no hidden state to send round the ring"))) };
                // The token list travels round and comes back: reuse it, no copy per round.
                let a = Activations { step: f.step, round: round as u32, n_embd: self.n_embd as u32, dtype: self.dtype, tokens: std::mem::take(&mut f.metas), hidden, reports: Vec::new() };
                f.round = round;
                f.sent = Some(Instant::now());
                match self.send(Frame::Activations(a)) {
                    Ok(()) => self.in_ring.push_back(f),
                    Err(why) => {
                        self.in_ring.push_back(f);
                        self.broke(why);
                    }
                }
                return;
            }
        }
        let result = match (self.layout.output_window, h) {
            (Some(w), Some(h)) => match self.stage.forward(w, &f.batch, StageInput::Hidden(&h)) {
                Ok(StageOutput::Logits(l)) => Ok(l),
                Ok(StageOutput::Hidden(_)) => Err(ring_err("the output window returned hidden states")),
                Err(e) => Err(e.into()),
            },
            _ => Err(ring_err("the plan leaves the output layer unreached")),
        };
        self.land(f, result);
    }

    /// A micro-batch is done: its result waits for `finish`. A failed one leaves no window
    /// holding any of it, unless a later micro-batch of the same sequence is still in the
    /// ring (the batching loop clears such a sequence once that one lands).
    fn land(&mut self, f: Flight, result: Result<Logits>) {
        // One token of one sequence, alone in the ring: the step the cost model predicts.
        if result.is_ok() && f.batch.len() == 1 && f.alone {
            let hop = (!f.hops.is_empty()).then(|| f.hops.iter().sum::<f64>() / f.hops.len() as f64);
            // Without a pager the head does not count its reads: then nothing is known.
            let known = f.reads_known && (self.layout.pager.is_some() || self.layout.own.iter().all(Option::is_none));
            let reads = known.then_some(f.reads.as_slice());
            self.board.decode_step(f.started.elapsed(), f.batch[0].pos as usize + 1, hop, reads);
        }
        if result.is_err() {
            let mut ops = Vec::new();
            for t in &f.batch {
                let still_flying = self.in_ring.iter().any(|g| g.batch.iter().any(|b| b.seq == t.seq));
                let len = f.batch.iter().filter(|b| b.seq == t.seq).map(|b| b.pos).min().unwrap_or(0);
                if !still_flying && !ops.contains(&KvOp::Truncate { seq: t.seq, len }) {
                    ops.push(KvOp::Truncate { seq: t.seq, len });
                }
            }
            self.kv(ops);
        }
        self.done.push_back((f.ticket, result));
    }

    /// Sends a frame to the first worker, after any pending KV operations. While it waits
    /// for room on the link, frames coming round are read into `early`: the last worker is
    /// never left waiting for the head to read while the head waits to send.
    fn send(&mut self, frame: Frame) -> Result<(), String> {
        let Some(links) = self.links.as_mut() else {
            return Err(self.broken.clone().unwrap_or_else(|| "the ring is not formed".into()));
        };
        let kv = (!self.pending_kv.is_empty()).then(|| Frame::KvOps { step: self.step, ops: std::mem::take(&mut self.pending_kv) });
        let Links { to_first, from_last } = links;
        let early = &mut self.early;
        let sent = self.rt.block_on(async {
            let send = async {
                if let Some(kv) = &kv {
                    to_first.send(kv).await?;
                }
                to_first.send(&frame).await
            };
            tokio::pin!(send);
            loop {
                tokio::select! {
                    biased;
                    r = &mut send => return r.map_err(|e| e.to_string()),
                    f = from_last.recv() => {
                        let end = !matches!(f, Ok(Some(_)));
                        early.push_back(f.map_err(|e| e.to_string()));
                        if end {
                            // The link back is gone: the send may never finish.
                            return Err(early.back().map(|r| match r { Err(e) => e.clone(), _ => format!("{} closed the ring link", from_last.peer()) }).unwrap_or_default());
                        }
                    }
                }
            }
        });
        if sent.is_ok() {
            // Sent means encoded: the frame coming back decodes into its buffers.
            from_last.recycle(frame);
        }
        sent
    }

    /// The next frame from the last worker: one read early, or a wait of at most the step
    /// timeout.
    fn receive(&mut self) -> Result<Frame, String> {
        if let Some(f) = self.early.pop_front() {
            return f.and_then(|f| f.ok_or_else(|| "the ring link closed".to_string()));
        }
        let Some(links) = self.links.as_mut() else {
            return Err(self.broken.clone().unwrap_or_else(|| "the ring is not formed".into()));
        };
        let timeout = self.cfg.setup.step_timeout;
        let from_last = &mut links.from_last;
        match self.rt.block_on(from_last.recv_within(timeout)) {
            Ok(Some(f)) => Ok(f),
            Ok(None) => Err(format!("{} closed the ring link", from_last.peer())),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Waits for the micro-batch at the front of the ring to come back and takes it on
    /// through the head's windows. Any failure breaks the ring: every micro-batch in it
    /// fails, and the links are gone until `recover`.
    fn take_back(&mut self) {
        let frame = loop {
            match self.receive() {
                // The KV operations sent ahead, coming back: every worker applied them.
                Ok(Frame::KvOps { .. }) => continue,
                Ok(Frame::Error { message, .. }) => break Err(format!("a worker failed: {message}")),
                Ok(Frame::Activations(a)) => break Ok(a),
                Ok(other) => break Err(format!("out-of-order {} frame from the ring", other.kind_name())),
                Err(e) => break Err(e),
            }
        };
        let back = frame.and_then(|a| match self.in_ring.front() {
            // Frames come back in the order they left.
            Some(f) if f.step == a.step && f.round as u32 == a.round => Ok(a),
            _ => Err(format!("out-of-order activations (step {}, round {}) from the ring", a.step, a.round)),
        });
        let back = match back {
            Ok(a) => a,
            Err(why) => return self.broke(why),
        };
        let mut f = self.in_ring.pop_front().expect("matched above");
        let rtt = f.sent.map_or(Duration::ZERO, |t| t.elapsed());
        // Every round trip records the workers' compute; its hops mean something only for a
        // micro-batch that had the ring to itself.
        if let Some(hop) = self.meter.round_trip(rtt, &back.reports) {
            if f.alone {
                f.hops.push(hop);
            }
        }
        if back.reports.len() + 1 == f.reads.len() {
            back.reports.iter().zip(&mut f.reads[1..]).for_each(|(r, total)| *total += r.read_bytes);
        } else {
            f.reads_known = false;
        }
        f.metas = back.tokens;
        self.advance(f, Some(back.hidden), back.round as usize + 1);
    }

    /// The ring is broken: the links are gone until `recover`, and why is kept for /health.
    fn break_ring(&mut self, why: String) -> Error {
        tracing::error!("ring broken: {why}");
        crate::metrics::ring_broke();
        self.links = None;
        self.early.clear();
        self.broken = Some(why.clone());
        ring_err(why)
    }

    /// The ring broke with micro-batches in it: every one of them fails.
    fn broke(&mut self, why: String) {
        let e = self.break_ring(why).to_string();
        while let Some(f) = self.in_ring.pop_front() {
            self.land(f, Err(ring_err(&e)));
        }
    }

    /// While idle nothing travels the ring, so a worker that died would go unnoticed until
    /// the next request. Any worker's death closes the link back to the head (each member
    /// ends its outgoing link when its incoming one ends, and keep-alive pings end a link
    /// to a frozen one), so a look at that link, without waiting, tells.
    fn watch_links(&mut self) -> Result<()> {
        let Some(links) = self.links.as_mut() else { return Ok(()) };
        if let Some(f) = self.early.pop_front() {
            let why = match f {
                Ok(Some(f)) => format!("an unexpected {} frame came round while idle", f.kind_name()),
                Ok(None) => format!("{} closed the ring link", links.from_last.peer()),
                Err(e) => e,
            };
            return Err(self.break_ring(format!("while idle: {why}")));
        }
        let lost = self.rt.block_on(async {
            match tokio::time::timeout(Duration::ZERO, links.from_last.recv()).await {
                Err(_) => None,
                Ok(Ok(None)) => Some(format!("{} closed the ring link", links.from_last.peer())),
                Ok(Ok(Some(f))) => Some(format!("an unexpected {} frame came round while idle", f.kind_name())),
                Ok(Err(e)) => Some(e.to_string()),
            }
        });
        match lost {
            None => Ok(()),
            Some(e) => Err(self.break_ring(format!("while idle: {e}"))),
        }
    }

    /// Applies KV operations here now and queues them for the workers' next frame.
    fn kv(&mut self, ops: impl IntoIterator<Item = KvOp>) {
        for op in ops {
            super::apply(&mut self.stage, std::slice::from_ref(&op));
            // A broken ring's workers start empty when it forms again.
            if self.layout.workers_compute && self.links.is_some() {
                self.pending_kv.push(op);
            }
        }
    }
}

impl crate::runtime::generation::Pipeline for RingPipeline {
    fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> Result<Logits> {
        self.launch(FORWARD_TICKET, batch, tokens);
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
        self.launch(ticket, batch, tokens);
        Ok(())
    }

    fn finish(&mut self) -> (u64, Result<Logits>) {
        loop {
            if let Some(done) = self.done.pop_front() {
                return done;
            }
            if self.in_ring.is_empty() {
                return (FORWARD_TICKET, Err(ring_err("no micro-batch is in flight")));
            }
            self.take_back();
        }
    }

    fn clear_sequence(&mut self, seq: SeqId) {
        self.kv([KvOp::Clear { seq }]);
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) {
        self.kv([KvOp::Truncate { seq, len: len as u32 }]);
    }

    fn n_ctx_seq(&self) -> usize {
        self.cfg.n_ctx_seq
    }

    fn idle(&mut self, idle_for: Duration) -> Result<bool> {
        // Before the early return below: a lost worker must show on /health while idle.
        if let Err(e) = self.watch_links() {
            for req in self.board.take_requests() {
                let _ = req.reply.send(Err(ReplanError::Broken(e.to_string())));
            }
            return Err(e);
        }
        let requests = self.board.take_requests();
        let r = &self.replan;
        let due = r.idle_after.is_some_and(|after| idle_for >= after && r.last_check.elapsed() >= after);
        let broken = self.layout.workers_compute && self.links.is_none();
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
            let why = self.broken.clone().unwrap_or_else(|| "the ring is not formed".into());
            for req in requests {
                let _ = req.reply.send(Err(ReplanError::Broken(why.clone())));
            }
            return Ok(false);
        }
        // An operator's request outranks a plan awaited from an earlier look.
        let ask = match (requests.is_empty(), awaited) {
            (false, _) => Ask { strategy: requests.iter().find_map(|q| q.strategy), trigger: scheduler::Trigger::Asked },
            (true, Some(a)) => a,
            (true, None) => Ask { strategy: None, trigger: scheduler::Trigger::Drift },
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
            Err(e) if self.layout.workers_compute && self.links.is_none() => Err(ring_err(e)),
            Err(_) => Ok(false),
        }
    }

    fn recover(&mut self) -> Result<bool> {
        if self.links.is_some() || !self.layout.workers_compute {
            return Ok(false);
        }
        let since = *self.broken_since.get_or_insert_with(Instant::now);
        match self.form() {
            Ok(links) => {
                for seq in 0..self.cfg.n_seq as SeqId {
                    self.stage.clear_sequence(seq);
                }
                self.pending_kv.clear();
                self.links = Some(links);
                self.broken = None;
                self.broken_since = None;
                tracing::info!(workers = ?self.members, "ring whole again");
                crate::metrics::ring_recovered();
                Ok(true)
            }
            // Past the grace period a plan the scheduler made goes on without the lost.
            Err(e) if since.elapsed() >= self.cfg.setup.member_grace && self.replan.strategy.is_some() => match self.replan_after_loss() {
                Ok(true) => {
                    self.broken_since = None;
                    crate::metrics::ring_recovered();
                    Ok(true)
                }
                Ok(false) => {
                    self.broken = Some(e.to_string());
                    Err(e)
                }
                Err(again) => {
                    tracing::warn!("planning without the lost members failed: {again}");
                    self.broken = Some(again.to_string());
                    Err(again)
                }
            },
            Err(e) => {
                tracing::debug!("ring not whole yet: {e}");
                self.broken = Some(e.to_string());
                Err(e)
            }
        }
    }
}
