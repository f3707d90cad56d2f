//! The head node's runtime: the model loaded, its pipeline (every layer here, or a ring
//! with workers), the speculation proposer and the batching loop, behind `Runtime`.

use std::path::PathBuf;
use std::sync::Arc;

use engine::tokenizer::Tokenizer;
use engine::{LocalPipeline, ModelFile, Stage, StageConfig};

use super::gpu_layers::{GpuLayers, GpuPlacement};

use super::generation::{Batcher, BatcherConfig, DraftModel, GenerationRequest, Pipeline, PrefixCacheConfig, Proposer, SubmitError};
use super::ring::board::{PlanBoard, ReplanRequest};
use super::views::{ClusterView, PlanView};
use super::ring::head::RingConfig;
use super::ring::RingSetup;
use super::ring::planning::Planner;
use super::{ReplanReply, Runtime};
use crate::error::{ReplanError, Result};

/// Everything a head needs to start, decided by whoever starts it (the CLI, a test).
#[derive(Debug, Clone)]
pub struct HeadConfig {
    pub model: PathBuf,
    /// Sequences generated at once.
    pub parallel: usize,
    /// Requests that may wait for a slot.
    pub queue: usize,
    /// Tokens per step.
    pub max_batch: usize,
    /// Context cells per sequence; [`super::context::AUTO_CONTEXT`]: the largest the memory holds, up to
    /// the model's own.
    pub n_ctx_seq: usize,
    pub threads: usize,
    pub speculation: Option<Speculation>,
    /// Most draft tokens per sequence and step.
    pub spec_tokens: usize,
    /// Batch-invariant kernels even without speculation (`--batch-invariant`).
    pub batch_invariant: bool,
    /// Repack weights into the CPU kernels' preferred layouts (`--no-repack` turns it off).
    pub repack: bool,
    /// The KV cache's element types (`--cache-type-k/-v`), on every ring member.
    pub kv: engine::CacheTypes,
    /// Computed prompt prefixes kept beyond the slots (`--prompt-cache-*`).
    pub prompt_cache: PrefixCacheConfig,
    /// `None`: every layer on this machine.
    pub ring: Option<RingSetup>,
    /// Layers of each of this machine's windows on its accelerator, and of those with
    /// their experts in RAM.
    pub gpu_layers: GpuPlacement,
}

impl HeadConfig {
    /// Bytes of the head's memory kept outside the model's weights and cache: the prompt
    /// cache's RAM and a draft model's file.
    pub fn reserved_bytes(&self) -> f64 {
        let draft = match &self.speculation {
            Some(Speculation::Draft(path)) => std::fs::metadata(path).map_or(0, |m| m.len()),
            _ => 0,
        };
        (self.prompt_cache.ram_bytes + draft) as f64
    }
}

/// Where speculative drafts come from.
#[derive(Debug, Clone)]
pub enum Speculation {
    /// Continuations of n-grams already in the sequence.
    Ngram,
    /// A small model with the same vocabulary.
    Draft(PathBuf),
}


/// A running head: the batching loop and the plan board.
pub struct Head {
    batcher: Batcher,
    board: Arc<PlanBoard>,
    parallel: usize,
}

impl Head {
    /// Loads the model and starts the batching loop; with a ring, forms it first (waiting
    /// up to `startup_wait` for workers that cannot be reached yet).
    pub fn start(cfg: &HeadConfig, tokenizer: Arc<Tokenizer>) -> Result<Head> {
        let file = Arc::new(ModelFile::open(&cfg.model)?);
        let watched = file.clone();
        let spec = file.spec.clone();
        cfg.gpu_layers.check(spec.moe.is_some()).map_err(crate::Error::Config)?;
        let parallel = cfg.parallel.max(1);
        let max_batch = cfg.max_batch.max(parallel);
        // Speculation stays exact only if a verified draft computes as it would alone.
        let batch_invariant = cfg.batch_invariant || cfg.speculation.is_some();
        // ... and a recurrent model's rejected drafts are taken back to a snapshot.
        let draft_snapshots = cfg.speculation.is_some() && cfg.spec_tokens > 0;
        // The engine holds no more cells per sequence than the model was trained for; every
        // part of the server (admission, the ring's plan, the workers' caches) must count
        // the same cells, or a prompt that fits --ctx-size fails mid-answer in the ring.
        let n_ctx_seq = if cfg.n_ctx_seq == super::context::AUTO_CONTEXT {
            // A ring sizes it once it knows its devices' memory (`RingPipeline::connect`).
            if cfg.ring.is_some() { super::context::AUTO_CONTEXT } else { super::context::sized(&file, &[super::context::local_memory()], parallel, cfg.kv, cfg.reserved_bytes()) }
        } else {
            cfg.n_ctx_seq.max(16).min(spec.n_ctx_train.max(16))
        };
        if cfg.n_ctx_seq != super::context::AUTO_CONTEXT && n_ctx_seq < cfg.n_ctx_seq {
            tracing::warn!(asked = cfg.n_ctx_seq, model = spec.n_ctx_train, "--ctx-size is past the model's trained context: each sequence gets {n_ctx_seq} cells");
        }
        let stage = StageConfig { n_seq: parallel, n_ctx_seq, max_batch, threads: cfg.threads, batch_invariant, repack: cfg.repack, kv: cfg.kv, draft_snapshots, ..StageConfig::whole(&spec) };
        // How this node computes rows, for the prompt cache's namespace (a ring adds its
        // plan's layout: see its pipeline's `row_layout`).
        let mut compute = format!("batch_invariant={batch_invariant}");
        let (pipeline, board): (Box<dyn Pipeline>, Arc<PlanBoard>) = match &cfg.ring {
            Some(ring) => {
                let mut pinned = ring.windows.as_ref().map(|w| scheduler::Plan::from_windows(spec.n_layer, w)).transpose()?;
                // Pinned windows carry the head's own GPU layers, so the plan says where they run.
                if let Some(plan) = pinned.as_mut() {
                    let d = &mut plan.devices[0];
                    if let GpuLayers::Count(n) = cfg.gpu_layers.layers {
                        d.gpu_layers = n.min(d.window);
                    }
                    if let GpuLayers::Count(e) = cfg.gpu_layers.experts_in_ram {
                        d.experts_in_ram = e.min(d.gpu_layers);
                    }
                }
                // A plan the user pinned stays unless they ask for another.
                let setup = RingSetup { replan_idle: if pinned.is_some() { None } else { ring.replan_idle }, ..ring.clone() };
                let ring_cfg = RingConfig { setup, pinned, n_seq: stage.n_seq, n_ctx_seq: stage.n_ctx_seq, max_batch: stage.max_batch, threads: stage.threads, batch_invariant, draft_snapshots, repack: stage.repack, kv: stage.kv, gpu_layers: cfg.gpu_layers };
                // Device selection weighs the streams served at once only where their
                // micro-batches may fly together.
                let streams = if ring.micro_batches == Some(1) { 1 } else { stage.n_seq };
                let mut planner = Planner::new(file.clone(), cfg.model.clone(), super::ring::membership::Membership::new(ring.workers.clone()), ring.secret.clone(), stage.threads, stage.n_ctx_seq, stage.kv, ring.strategy, streams);
                planner.head_reserved = cfg.reserved_bytes();
                if draft_snapshots {
                    // A recurrent state kept twice per sequence (`StageConfig::draft_snapshots`).
                    planner.model.state_bytes *= 2.0;
                }
                let board = Arc::new(PlanBoard::ring());
                (Box::new(super::ring::RingPipeline::connect(file, ring_cfg, planner, board.clone())?), board)
            }
            None => {
                // A model larger than this machine's memory is served from the mapping, paged
                // by the OS; repacked copies would have to fit in memory instead.
                let paged = super::ring::paging::pages_from_disk(&file, &[0..spec.n_layer], None, &stage);
                let (fit, fit_experts) = super::gpu_layers::fitting_layers(&file, engine::accelerators().first(), stage.n_seq, stage.n_ctx_seq, stage.kv, cfg.gpu_layers.experts_in_ram);
                let (accel_layers, experts_in_ram) = cfg.gpu_layers.resolve(fit, fit_experts);
                // One beyond the layers: the output layer too (llama.cpp's count).
                let accel_layers = accel_layers.min(spec.n_layer + 1);
                let layers = accel_layers.min(spec.n_layer);
                if accel_layers > 0 {
                    tracing::info!(layers, of = spec.n_layer, experts_in_ram, output_layer = accel_layers > spec.n_layer, "layers on the accelerator (of them, with their routed experts in RAM; and the output layer)");
                }
                let whole = StageConfig { repack: stage.repack && !paged, read_chosen_experts: paged, accel_layers, experts_in_ram, ..stage.clone() };
                compute = format!("{compute} repack={} accel_layers={accel_layers} experts_in_ram={experts_in_ram} accel={:?}", whole.repack, engine::accelerators().first().filter(|_| accel_layers > 0).map(|a| &a.description));
                let board = Arc::new(PlanBoard::single(spec.n_layer));
                board.placed(0, layers, experts_in_ram);
                (Box::new(LocalPipeline::new(vec![Stage::new(file, whole)?])?), board)
            }
        };
        let proposer = match &cfg.speculation {
            None => None,
            Some(Speculation::Ngram) => Some(Proposer::Ngram),
            Some(Speculation::Draft(draft)) => {
                let model = DraftModel::load(draft, &tokenizer, parallel, pipeline.n_ctx_seq(), max_batch, stage.threads)?;
                tracing::info!(draft = %draft.display(), "speculative decoding with a draft model");
                Some(Proposer::Model(Box::new(model)))
            }
        };
        let pipeline_ctx = pipeline.n_ctx_seq();
        let batcher = Batcher::start(pipeline, tokenizer, BatcherConfig { parallel, queue: cfg.queue, max_batch, spec_tokens: cfg.spec_tokens, files: vec![watched], prompt_cache: cfg.prompt_cache.clone(), compute }, proposer);
        tracing::info!(model = %cfg.model.display(), layers = spec.n_layer, parallel, ctx = pipeline_ctx, cache = %stage.kv, "model loaded");
        Ok(Head { batcher, board, parallel })
    }
}

impl Runtime for Head {
    fn submit(&self, req: GenerationRequest) -> Result<(), SubmitError> {
        self.batcher.submit(req)
    }

    fn has_room(&self) -> Result<(), SubmitError> {
        self.batcher.has_room()
    }

    fn n_ctx(&self) -> usize {
        self.batcher.n_ctx()
    }

    fn parallel(&self) -> usize {
        self.parallel
    }

    fn degraded(&self) -> Option<String> {
        self.batcher.degraded()
    }

    fn plan(&self) -> PlanView {
        self.board.view()
    }

    fn cluster(&self) -> ClusterView {
        self.board.cluster()
    }

    fn replan(&self, strategy: Option<scheduler::Strategy>) -> Result<ReplanReply, ReplanError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.board.request(ReplanRequest { strategy, reply })?;
        Ok(answer)
    }

    fn what_if(&self, without: &[String], copies: &[String], strategy: Option<scheduler::Strategy>) -> Result<crate::runtime::views::WhatIf, ReplanError> {
        self.board.what_if(without, copies, strategy)
    }

    fn shutdown(&self) {
        self.batcher.shutdown()
    }
}
