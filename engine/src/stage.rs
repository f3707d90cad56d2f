//! A stage: the layers one device runs, as one or more disjoint windows of the model,
//! each with its own KV cache. `forward` runs one window on one batch; the ring (or a
//! single-node loop) chains windows by handing the hidden states over by value.

use std::ops::Range;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::expert_reads::{self, ExpertReads};
use crate::ggml::{Accelerator, Device, F16_NEG_INF, F16_ZERO};
use crate::graph::{self, GraphShape, GroupPlan};
use crate::kv_cache::{KvCache, SeqId, KV_PAD};
use crate::model::ModelSpec;
use crate::model_file::ModelFile;
use crate::op_profile::{self, OpProfile};
use crate::weights::{LayerPlacement, WeightPlan, Weights};
use crate::{Error, Result};

/// One token of a batch: which sequence it belongs to, its position there, and whether
/// the caller wants its logits (only meaningful for the window that ends the model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchToken {
    pub seq: SeqId,
    pub pos: u32,
    pub logits: bool,
}

/// A window's input: token ids for the window that starts the model, otherwise the
/// previous window's hidden states, row-major `[n_tokens][hidden_width]`
/// (`ModelSpec::hidden_width`: `n_embd` but for Gemma 4 E2B/E4B).
#[derive(Debug, Clone, Copy)]
pub enum StageInput<'a> {
    Tokens(&'a [i32]),
    Hidden(&'a [f32]),
}

#[derive(Debug, Clone)]
pub enum StageOutput {
    /// Row-major `[n_tokens][hidden_width]`, in batch order.
    Hidden(Vec<f32>),
    Logits(Logits),
}

/// Logits of the tokens that asked for them, in batch order.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    /// Batch index of each row.
    pub rows: Vec<usize>,
    pub n_vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
}

#[derive(Debug, Clone)]
pub struct StageConfig {
    /// Disjoint layer ranges, in the order the ring visits them.
    pub windows: Vec<Range<usize>>,
    /// Sequences that may hold KV at once.
    pub n_seq: usize,
    /// Context cells per sequence.
    pub n_ctx_seq: usize,
    /// Most tokens one `forward` takes (prompts longer than this are fed in chunks).
    pub max_batch: usize,
    pub threads: usize,
    /// The first this-many layers of every window run on the accelerator; more than every
    /// window's layers puts the output layer (its norm and LM head) there too, when the
    /// stage owns it, as llama.cpp's `-ngl` counts it as the layer after the last.
    pub accel_layers: usize,
    /// Of those accelerator layers, the first this-many keep their routed experts in host
    /// memory (MoE models; what llama.cpp's `--n-cpu-moe` does): attention, norms, router
    /// and shared experts run on the accelerator, each token's chosen experts on the CPU,
    /// so a GPU too small for whole MoE layers still takes their every-token part.
    pub experts_in_ram: usize,
    /// A window that ends the model ends with the output norm and LM head and returns
    /// logits. Off on ring workers: the head owns the output layer (its window `L..L`).
    pub owns_output: bool,
    /// Compute every token as it would be computed alone, whatever the batch around it:
    /// ggml's reference CPU kernels. llama.cpp's defaults pick kernels by batch shape
    /// (tiled matmuls and llamafile's sgemm for 2+ rows, split-KV attention for one query
    /// past 512 cells), so a token verified in a batch of drafts got logits a rounding
    /// apart from decoding it alone, and greedy text diverged after ~20 tokens on a
    /// 1,100-token prompt. Speculative decoding turns this on to stay exact; off, the
    /// stage computes exactly what llama.cpp computes.
    pub batch_invariant: bool,
    /// Put the weights the CPU backend's extra buffer types take there (interleaved
    /// "repacked" layouts and their kernels), as llama.cpp does by default; this is what
    /// makes a K-quant or IQ model compute llama.cpp's exact numbers, and on AVX2 and ARM
    /// CPUs those kernels are much faster. Such weights are copied into process memory,
    /// so a stage whose windows must be paged from disk turns it off.
    pub repack: bool,
    /// The windows are paged from disk (they do not fit in memory): in MoE layers, read
    /// exactly the experts each step's router chose, as soon as it chose, and stop the OS
    /// reading around page faults in expert tensors (`expert_reads`). No effect on dense
    /// models; pointless (and off) for weights held in memory.
    pub read_chosen_experts: bool,
    /// The KV cache's element types (llama.cpp's `--cache-type-k/-v`).
    pub kv: crate::kv_cache::CacheTypes,
    /// A model with recurrent layers (Qwen3.5) keeps a second copy of each sequence's
    /// state, written where a batch's draft tokens begin (a sequence's rows after its
    /// first row that wants logits), so that `truncate_sequence` can take rejected drafts
    /// back: what speculative decoding needs. No effect on other models.
    pub draft_snapshots: bool,
}

impl StageConfig {
    /// The whole model as one window: a single-node engine.
    pub fn whole(spec: &ModelSpec) -> StageConfig {
        StageConfig { windows: std::iter::once(0..spec.n_layer).collect(), n_seq: 1, n_ctx_seq: 4096.min(spec.n_ctx_train), max_batch: 512, threads: default_threads(), accel_layers: 0, experts_in_ram: 0, owns_output: true, batch_invariant: false, repack: true, read_chosen_experts: false, kv: Default::default(), draft_snapshots: false }
    }
}

pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

struct Window {
    layers: Range<usize>,
    cache: KvCache,
}

impl Window {
    /// Records a computed batch's tokens in the cache.
    fn commit(&mut self, plan: &BatchPlan) {
        for s in &plan.seqs {
            self.cache.commit(s.seq, s.slot, s.new_len, s.snapshot);
        }
    }
}

pub struct Stage {
    file: Arc<ModelFile>,
    weights: Weights,
    windows: Vec<Window>,
    cpu: sys::ggml_backend_t,
    /// Owns the accelerator's backend, which the scheduler, the weights and the caches use
    /// until the stage drops.
    accel: Option<Accelerator>,
    /// Per model layer: whether it runs on the accelerator.
    on_accelerator: Vec<bool>,
    sched: sys::ggml_backend_sched_t,
    /// Backing store for graph metadata, reused by every step.
    meta: Vec<u8>,
    /// The last graph built, kept allocated: a step of the same shape (every decode step
    /// of a sequence until its KV length crosses the next 256 cells) reuses it as is and
    /// only uploads new inputs — no graph building, no scheduling, no allocation.
    cached: Option<CachedGraph>,
    graph_size: usize,
    max_batch: usize,
    owns_output: bool,
    /// With `read_chosen_experts` on a MoE model: the scheduler's callback state (boxed:
    /// the scheduler holds its address).
    expert_reads: Option<Box<ExpertReads>>,
}

// SAFETY: all ggml objects are owned by the stage and used only through &mut self.
unsafe impl Send for Stage {}

/// What decides a graph's topology; equal keys mean an identical graph.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShapeKey {
    window: usize,
    embed: bool,
    n_tokens: usize,
    /// (rows per sequence, sequences, first cell, attended cells, and the same for sliding
    /// layers) per attention op.
    groups: Vec<(usize, usize, usize, usize, usize, usize)>,
    /// (first row, rows per sequence, sequences, first cell, rows before drafts) per
    /// recurrent op.
    recurrent_groups: Vec<(usize, usize, usize, usize, usize)>,
    n_out: usize,
}

struct CachedGraph {
    key: ShapeKey,
    ctx: *mut sys::ggml_context,
    graph: graph::BuiltGraph,
}

impl Drop for Stage {
    fn drop(&mut self) {
        // SAFETY: created in `new`, freed once; the windows' caches and the weights are
        // dropped after (field order) and do not reference the scheduler.
        unsafe {
            self.drop_cached_graph();
            sys::ggml_backend_sched_free(self.sched);
            sys::ggml_backend_free(self.cpu);
        }
    }
}

impl Stage {
    pub fn new(file: Arc<ModelFile>, cfg: StageConfig) -> Result<Stage> {
        crate::backend::init();
        let spec = file.spec.clone();
        validate_windows(&cfg.windows, spec.n_layer)?;
        if cfg.max_batch == 0 || cfg.threads == 0 {
            return Err(Error::InvalidWindow("max_batch and threads must be at least 1".into()));
        }
        let accel = if cfg.accel_layers > 0 { Some(Accelerator::first()?) } else { None };
        let device_of = |w: &Range<usize>, il: usize| if il - w.start < cfg.accel_layers { Device::Accelerator } else { Device::Cpu };
        let placement = |w: &Range<usize>, il: usize| {
            let device = device_of(w, il);
            let experts = if il - w.start < cfg.experts_in_ram.min(cfg.accel_layers) { Device::Cpu } else { device };
            LayerPlacement { layer: il, device, experts }
        };
        let output = cfg.owns_output && cfg.windows.iter().any(|w| w.end == spec.n_layer);
        // Every token's decode step reads the whole LM head: on a GPU that holds every
        // layer, leaving it to the CPU made each step wait for the CPU's memory (a
        // vocabulary of 49k x 4096 is 113 MB of Q4_0 per token).
        let max_window = cfg.windows.iter().map(|w| w.len()).max().unwrap_or(0);
        let output_device = if accel.is_some() && output && cfg.accel_layers > max_window { Device::Accelerator } else { Device::Cpu };
        let plan = WeightPlan { layers: cfg.windows.iter().flat_map(|w| w.clone().map(move |il| placement(w, il))).collect(), embedding: cfg.windows.iter().any(|w| w.start == 0), output, output_device };
        // ggml's reference kernels (batch-invariant mode) know only the plain layouts.
        if !cfg.read_chosen_experts {
            // Windows held in memory (those paged from disk read their chosen experts
            // instead): mapped now, as llama.cpp maps its file, not fault by fault.
            for w in &cfg.windows {
                file.populate(&file.layer_byte_ranges(w.clone()));
            }
        }
        let weights = Weights::bind(file.clone(), &plan, accel.as_ref(), cfg.repack && !cfg.batch_invariant)?;
        let n_ctx_seq = cfg.n_ctx_seq.min(spec.n_ctx_train.max(1));
        let windows = cfg
            .windows
            .iter()
            .map(|w| {
                let layers: Vec<(usize, Device)> = w.clone().map(|il| (il, device_of(w, il))).collect();
                Ok(Window { layers: w.clone(), cache: KvCache::new(&spec, &layers, cfg.n_seq, n_ctx_seq, cfg.kv, accel.as_ref(), cfg.draft_snapshots)? })
            })
            .collect::<Result<Vec<_>>>()?;

        let max_layers = cfg.windows.iter().map(|w| w.len()).max().unwrap_or(0);
        let graph_size = graph::max_nodes(&spec, max_layers, cfg.n_seq.min(cfg.max_batch));
        // SAFETY: sizes are plain queries; the CPU backend is freed in Drop.
        let (cpu, meta_size) = unsafe {
            let cpu = sys::ggml_backend_cpu_init();
            if cpu.is_null() {
                return Err(Error::Ggml("could not start the CPU backend".into()));
            }
            sys::ggml_backend_cpu_set_n_threads(cpu, cfg.threads as i32);
            sys::ggml_backend_cpu_set_use_ref(cpu, cfg.batch_invariant);
            (cpu, sys::ggml_tensor_overhead() * graph_size + sys::ggml_graph_overhead_custom(graph_size, false))
        };
        let mut backends: Vec<sys::ggml_backend_t> = accel.iter().map(|a| a.backend).collect();
        backends.push(cpu);
        // With an accelerator, large batches' ops on CPU-resident weights (the LM head,
        // layers or experts kept in RAM) are offloaded to it, weights copied over per step,
        // as llama.cpp does by default (`op_offload`): faster prompts, and llama.cpp's
        // numbers.
        let op_offload = accel.is_some();
        // SAFETY: the backends outlive the scheduler (freed after it in Drop).
        let sched = unsafe { sys::ggml_backend_sched_new(backends.as_mut_ptr(), std::ptr::null_mut(), backends.len() as i32, graph_size, false, op_offload) };
        if sched.is_null() {
            // SAFETY: created above.
            unsafe { sys::ggml_backend_free(cpu) };
            return Err(Error::Ggml("could not create the ggml scheduler".into()));
        }
        let mut expert_reads = (cfg.read_chosen_experts && spec.moe.is_some()).then(Box::<ExpertReads>::default);
        if let Some(reads) = expert_reads.as_mut() {
            let matrices = weights.layers.values().filter_map(|l| l.ffn.experts().map(|m| m.matrices()));
            // SAFETY: the weights point into the file's mapping (or process memory, where
            // the advice is harmless); the callback's state is boxed and outlives the
            // scheduler (freed first in Drop).
            tracing::info!(layers = ?cfg.windows, "MoE windows paged from disk: reading only the experts each token's router chooses");
            unsafe {
                expert_reads::no_read_around(matrices.flatten().filter(|m| !m.is_null()));
                sys::ggml_backend_sched_set_eval_callback(sched, Some(expert_reads::on_node), (&mut **reads as *mut ExpertReads).cast());
            }
        }
        let mut on_accelerator = vec![false; spec.n_layer];
        for p in &plan.layers {
            on_accelerator[p.layer] = p.device == Device::Accelerator;
        }
        let mut stage = Stage { file, weights, windows, cpu, accel, on_accelerator, sched, meta: vec![0u8; meta_size], cached: None, graph_size, max_batch: cfg.max_batch, owns_output: cfg.owns_output, expert_reads };
        stage.reserve()?;
        Ok(stage)
    }

    /// Times every op of this stage's forwards in `profile` (`None`: stop, giving MoE
    /// expert reads their hook back). The caller keeps `profile` alive and untouched while
    /// it is set.
    pub(crate) fn set_op_profile(&mut self, profile: Option<*mut OpProfile>) {
        // SAFETY: both states outlive their use: the profile by the caller's promise, the
        // expert reads' box for the stage's life.
        unsafe {
            match (profile, self.expert_reads.as_mut()) {
                (Some(p), _) => sys::ggml_backend_sched_set_eval_callback(self.sched, Some(op_profile::on_node), p.cast()),
                (None, Some(reads)) => sys::ggml_backend_sched_set_eval_callback(self.sched, Some(expert_reads::on_node), (&mut **reads as *mut ExpertReads).cast()),
                (None, None) => sys::ggml_backend_sched_set_eval_callback(self.sched, None, std::ptr::null_mut()),
            }
        }
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.file.spec
    }

    /// llama.cpp pins every layer norm to its layer's device for batches under
    /// `PIN_NORMS_BELOW_TOKENS` tokens (left to itself, ggml's scheduler may run a layer's
    /// first norm on the device of the layer before): the same here, so that a layer on
    /// the accelerator beside CPU layers or CPU-resident experts computes exactly what
    /// llama.cpp computes, and no norm crosses devices needlessly.
    ///
    /// SAFETY: `graph` was built on this stage's weights and caches; call between
    /// `ggml_backend_sched_reset` and allocating the graph.
    unsafe fn pin_layer_norms(&self, graph: &graph::BuiltGraph, n_tokens: usize) {
        // llama.cpp's bound (`llama_context::graph_get_cb`): from it on, ops on CPU weights
        // go to the accelerator anyway (`op_offload`).
        const PIN_NORMS_BELOW_TOKENS: usize = 32;
        let Some(a) = self.accel.as_ref().filter(|_| n_tokens < PIN_NORMS_BELOW_TOKENS) else { return };
        for &(il, node) in &graph.layer_norms {
            let backend = if self.on_accelerator[il] { a.backend } else { self.cpu };
            if sys::ggml_backend_supports_op(backend, node) {
                sys::ggml_backend_sched_set_tensor_backend(self.sched, node, backend);
            }
        }
    }

    pub fn windows(&self) -> Vec<Range<usize>> {
        self.windows.iter().map(|w| w.layers.clone()).collect()
    }

    /// Computes with `threads` CPU threads from the next step on (one at the least): ring
    /// members that share a machine split its cores while they compute at once.
    pub fn set_threads(&mut self, threads: usize) {
        // SAFETY: the CPU backend lives as long as the stage; ggml reads the count when it
        // plans each computation.
        unsafe { sys::ggml_backend_cpu_set_n_threads(self.cpu, threads.max(1) as i32) };
    }

    /// Cached positions of `seq` in window `window`.
    pub fn sequence_len(&self, window: usize, seq: SeqId) -> usize {
        self.windows.get(window).map_or(0, |w| w.cache.len(seq))
    }

    /// Bytes of chosen experts read ahead so far (`read_chosen_experts`); None when off.
    pub fn expert_bytes_read_ahead(&self) -> Option<u64> {
        self.expert_reads.as_ref().map(|r| r.advised_bytes)
    }

    /// Per-sequence context capacity.
    pub fn n_ctx_seq(&self) -> usize {
        self.windows.first().map_or(0, |w| w.cache.capacity)
    }

    /// Forgets a sequence in every window and frees its slot.
    pub fn clear_sequence(&mut self, seq: SeqId) {
        self.windows.iter_mut().for_each(|w| w.cache.clear(seq));
    }

    pub fn clear_all(&mut self) {
        self.windows.iter_mut().for_each(|w| w.cache.clear_all());
    }

    /// Keeps positions [0, len) of `seq` in every window (speculative rollback, reuse of
    /// a cached prompt prefix); returns the length kept: `len` or less, less for a model
    /// with recurrent layers, whose state goes back only to a checkpoint (or to nothing).
    pub fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> usize {
        let kept = self.windows.iter_mut().map(|w| w.cache.truncate(seq, len)).min().unwrap_or(0);
        // Every window keeps checkpoints at the same lengths, so they agree; a window that
        // kept more is brought down to the rest (never below a checkpoint it restored).
        for w in &mut self.windows {
            w.cache.truncate(seq, kept);
        }
        kept
    }

    /// Gives `to` the first `len` positions of `from` in every window (see
    /// `KvCache::copy_prefix`); returns the positions copied, the same in every window.
    pub fn copy_sequence(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        let each: Vec<usize> = self.windows.iter_mut().map(|w| w.cache.copy_prefix(from, to, len)).collect();
        let copied = each.iter().copied().min().unwrap_or(0);
        // Windows agree (one slot layout, one rule); were one to copy more, it is cut to the
        // rest. Where none copied, nothing was touched.
        if each.iter().any(|&c| c > copied) {
            for w in &mut self.windows {
                w.cache.truncate(to, copied);
            }
        }
        copied
    }

    /// What a block of this stage's rows holds (see `KvCache::row_layout`): each window's
    /// layers and layout. Blocks move only between stages whose layouts are equal.
    pub fn row_layout(&self) -> String {
        let parts: Vec<String> = self.windows.iter().map(|w| format!("{}..{}:{}", w.layers.start, w.layers.end, w.cache.row_layout())).collect();
        parts.join(";")
    }

    /// Positions `[at, at + n)` of `seq` in every window, one window's rows after another,
    /// each `with_state` or not (see `KvCache::read_rows`); `None` where a window cannot
    /// give them.
    pub fn read_rows(&self, seq: SeqId, at: usize, n: usize, with_state: bool) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        for w in &self.windows {
            out.extend_from_slice(&w.cache.read_rows(seq, at, n, with_state)?);
        }
        Some(out)
    }

    /// Bytes of a block of `n` positions of this stage (see [`Stage::read_rows`]).
    pub fn read_rows_len(&self, n: usize, with_state: bool) -> usize {
        self.windows.iter().map(|w| w.cache.block_bytes(n, with_state)).sum()
    }

    /// Puts a block read by [`Stage::read_rows`] (of `n` positions, with the state or not:
    /// its length tells) back as positions `[at, at + n)` of `seq` in every window; false
    /// where any window cannot take it (see `KvCache::write_rows`), and then `seq` keeps
    /// only its first `at` positions.
    pub fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, block: &[u8]) -> bool {
        let with_state = block.len() == self.read_rows_len(n, true);
        if !with_state && block.len() != self.read_rows_len(n, false) {
            return false;
        }
        let sizes: Vec<usize> = self.windows.iter().map(|w| w.cache.block_bytes(n, with_state)).collect();
        let mut offset = 0;
        for (w, size) in self.windows.iter_mut().zip(sizes) {
            if !w.cache.write_rows(seq, at, n, &block[offset..offset + size]) {
                self.truncate_sequence(seq, at);
                return false;
            }
            offset += size;
        }
        true
    }

    /// Copies `seq`'s recurrent state in every window at its current length, so that a
    /// later truncation can come back here (see `truncate_sequence`); the ring's members
    /// are told together, so all keep the same checkpoints. No effect without recurrent
    /// layers.
    pub fn checkpoint_sequence(&mut self, seq: SeqId) {
        self.windows.iter_mut().for_each(|w| w.cache.checkpoint(seq));
    }

    /// Runs window `window` on `batch`. Each sequence's tokens must continue its cache:
    /// positions len, len+1, ... in batch order. Nothing changes if an error is returned.
    pub fn forward(&mut self, window: usize, batch: &[BatchToken], input: StageInput) -> Result<StageOutput> {
        let file = self.file.clone();
        let spec = &file.spec;
        let win = self.windows.get(window).ok_or_else(|| Error::InvalidBatch(format!("this stage has no window {window}")))?;
        let layers = win.layers.clone();
        let n = batch.len();
        if n == 0 || n > self.max_batch {
            return Err(Error::InvalidBatch(format!("{n} tokens; a batch holds 1 to {}", self.max_batch)));
        }
        // A window at layer 0 embeds token ids; any window also takes hidden states (a ring
        // worker's first window gets them from the head, which did the embedding).
        let embed = match (layers.start == 0, input) {
            (true, StageInput::Tokens(t)) if t.len() == n => {
                if let Some(bad) = t.iter().find(|&&id| id < 0 || id as usize >= spec.n_vocab) {
                    return Err(Error::InvalidBatch(format!("token id {bad} is outside the vocabulary of {}", spec.n_vocab)));
                }
                true
            }
            (_, StageInput::Hidden(h)) if h.len() == n * spec.hidden_width() && layers != (0..0) => false,
            (true, StageInput::Tokens(_)) => return Err(Error::InvalidBatch(format!("window {layers:?} starts the model and takes {n} token ids"))),
            _ => return Err(Error::InvalidBatch(format!("window {layers:?} takes {n}x{} hidden-state values", spec.hidden_width()))),
        };
        let n_swa = spec.swa.as_ref().filter(|_| layers.clone().any(|il| spec.is_swa(il))).map(|s| AttnWindow { n: s.n_swa, chunked: s.chunked });
        let plan = plan_batch(&win.cache, batch, n_swa, self.accel.is_none())?;
        let last = self.owns_output && layers.end == spec.n_layer;
        let out_rows: Vec<usize> = if last { (0..n).filter(|&r| batch[plan.order[r]].logits).collect() } else { Vec::new() };
        if last && out_rows.is_empty() && layers.is_empty() {
            // The output-only window of a batch that wants no logits (a prompt chunk
            // before the last) has nothing to compute: its graph would read no input, and
            // ggml leaves unread inputs unallocated (setting one aborts the process).
            // It still follows the sequences' lengths, as every window does.
            self.windows[window].commit(&plan);
            return Ok(StageOutput::Logits(Logits { rows: Vec::new(), n_vocab: spec.n_vocab, data: Vec::new() }));
        }

        // A sequence starting from nothing starts from a zero recurrent state (its slot may
        // hold another's); harmless should the step fail, as its length stays 0.
        for s in plan.seqs.iter().filter(|s| s.start == 0) {
            self.windows[window].cache.reset_state(s.slot);
        }
        let key = ShapeKey {
            window,
            embed,
            n_tokens: n,
            groups: plan.groups.iter().map(|g| (g.n_rows, g.n_seqs, g.cell0, g.n_kv, g.cell0_swa, g.n_kv_swa)).collect(),
            recurrent_groups: plan.recurrent_groups.iter().map(|g| (g.row0, g.n_rows, g.n_seqs, g.cell0, g.split)).collect(),
            n_out: out_rows.len(),
        };
        // SAFETY: `meta` backs the one live no-alloc context (the cached graph's); every
        // tensor the graph references is owned by this stage; input sizes match the
        // tensors `graph::build` created for this shape.
        let output = unsafe {
            let reuse = self.cached.as_ref().is_some_and(|c| c.key == key);
            if !reuse {
                self.drop_cached_graph();
                let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: self.meta.len(), mem_buffer: self.meta.as_mut_ptr().cast(), no_alloc: true });
                if ctx.is_null() {
                    return Err(Error::Ggml("ggml_init failed".into()));
                }
                let shape = GraphShape { layers: layers.clone(), embed, logits: last, n_tokens: n, groups: &plan.groups, recurrent_groups: &plan.recurrent_groups, n_out: out_rows.len() };
                let graph = graph::build(ctx, spec, &self.weights, &self.windows[window].cache, &shape, self.graph_size);
                sys::ggml_backend_sched_reset(self.sched);
                self.pin_layer_norms(&graph, n);
                if !sys::ggml_backend_sched_alloc_graph(self.sched, graph.graph) {
                    sys::ggml_free(ctx);
                    return Err(Error::Ggml("could not allocate the compute graph".into()));
                }
                if let Some(reads) = self.expert_reads.as_mut() {
                    reads.choices = graph.expert_choices.clone();
                }
                self.cached = Some(CachedGraph { key, ctx, graph });
            }
            let g = &self.cached.as_ref().expect("built above").graph;
            run_graph(self.sched, g, spec, batch, input, &plan, &out_rows)?
        };

        self.windows[window].commit(&plan);
        Ok(match output {
            None => StageOutput::Logits(Logits { rows: Vec::new(), n_vocab: spec.n_vocab, data: Vec::new() }),
            Some(data) if last => {
                // Rows come out in reordered-batch order; hand them back in batch order.
                let mut idx: Vec<(usize, usize)> = out_rows.iter().enumerate().map(|(i, &r)| (plan.order[r], i)).collect();
                idx.sort_unstable();
                let nv = spec.n_vocab;
                let data = if idx.iter().enumerate().all(|(k, &(_, i))| k == i) {
                    data
                } else {
                    let mut sorted = Vec::with_capacity(data.len());
                    for &(_, i) in &idx {
                        sorted.extend_from_slice(&data[i * nv..(i + 1) * nv]);
                    }
                    sorted
                };
                StageOutput::Logits(Logits { rows: idx.iter().map(|p| p.0).collect(), n_vocab: nv, data })
            }
            Some(data) => {
                let e = spec.hidden_width();
                let mut hidden = vec![0f32; data.len()];
                for (r, &orig) in plan.order.iter().enumerate() {
                    hidden[orig * e..(orig + 1) * e].copy_from_slice(&data[r * e..(r + 1) * e]);
                }
                StageOutput::Hidden(hidden)
            }
        })
    }

    /// SAFETY: the cached graph's tensors must not be in use (no compute in flight).
    unsafe fn drop_cached_graph(&mut self) {
        if let Some(c) = self.cached.take() {
            sys::ggml_free(c.ctx);
        }
    }
    /// Sizes the compute buffers once for the largest batch, so steps do not reallocate.
    fn reserve(&mut self) -> Result<()> {
        // SAFETY: nothing is computing; the reservation below reuses `meta`.
        unsafe { self.drop_cached_graph() };
        let spec = self.file.spec.clone();
        let Some(widx) = (0..self.windows.len()).max_by_key(|&i| self.windows[i].layers.len()) else { return Ok(()) };
        let w = &self.windows[widx];
        let groups = [GroupPlan { row0: 0, n_rows: self.max_batch, n_seqs: 1, split: 0, cell0: 0, n_kv: w.cache.slot_cells, cell0_swa: 0, n_kv_swa: w.cache.slot_cells }];
        let shape = GraphShape {
            layers: w.layers.clone(),
            embed: w.layers.start == 0,
            logits: self.owns_output && w.layers.end == spec.n_layer,
            n_tokens: self.max_batch,
            groups: &groups,
            recurrent_groups: &groups,
            n_out: self.max_batch,
        };
        // SAFETY: as in `forward`; the graph is only measured, never computed.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: self.meta.len(), mem_buffer: self.meta.as_mut_ptr().cast(), no_alloc: true });
            if ctx.is_null() {
                return Err(Error::Ggml("ggml_init failed".into()));
            }
            let g = graph::build(ctx, &spec, &self.weights, &w.cache, &shape, self.graph_size);
            let ok = sys::ggml_backend_sched_reserve(self.sched, g.graph);
            sys::ggml_free(ctx);
            if !ok {
                return Err(Error::Ggml(format!("could not reserve compute buffers for a batch of {}", self.max_batch)));
            }
        }
        Ok(())
    }
}

/// Uploads this step's inputs into an allocated graph, computes it and reads its output.
///
/// SAFETY: `g` is allocated in `sched`; the input slices match the graph's shape.
unsafe fn run_graph(sched: sys::ggml_backend_sched_t, g: &graph::BuiltGraph, spec: &ModelSpec, batch: &[BatchToken], input: StageInput, plan: &BatchPlan, out_rows: &[usize]) -> Result<Option<Vec<f32>>> {
    let set = |t: *mut sys::ggml_tensor, bytes: &[u8]| sys::ggml_backend_tensor_set(t, bytes.as_ptr().cast(), 0, bytes.len());
    let e = spec.hidden_width();
    match input {
        StageInput::Tokens(ids) => {
            let v: Vec<i32> = plan.order.iter().map(|&o| ids[o]).collect();
            set(g.tokens.expect("first window"), as_bytes(&v));
        }
        StageInput::Hidden(h) => {
            let mut v = Vec::with_capacity(h.len());
            for &o in &plan.order {
                v.extend_from_slice(&h[o * e..(o + 1) * e]);
            }
            set(g.embd.expect("later window"), as_bytes(&v));
        }
    }
    let pos: Vec<i32> = plan.order.iter().map(|&o| batch[o].pos as i32).collect();
    if let Some(p) = g.pos {
        if spec.rope_sections.is_some() {
            // Multi-section RoPE reads four positions per token: a text token's position
            // in the first three sections, 0 in the fourth (as llama.cpp gives text).
            let mut four = Vec::with_capacity(4 * pos.len());
            for _ in 0..3 {
                four.extend_from_slice(&pos);
            }
            four.resize(4 * pos.len(), 0);
            set(p, as_bytes(&four));
        } else {
            set(p, as_bytes(&pos));
        }
    }
    if let Some(c) = g.cells {
        set(c, as_bytes(&plan.cells));
    }
    for (t, m) in g.masks.iter().zip(&plan.masks) {
        set(*t, as_bytes(m));
    }
    for (t, m) in g.swa_masks.iter().zip(&plan.swa_masks) {
        set(*t, as_bytes(m));
    }
    if let (Some(t), Some(temp)) = (g.attn_scale, spec.attn_temperature) {
        // Llama 4 / Mistral 3 attention temperature, as llama.cpp computes it.
        let v: Vec<f32> = pos.iter().map(|&p| (((p as f32 + temp.offset) / temp.floor).floor() + 1.0).ln() * temp.scale + 1.0).collect();
        set(t, as_bytes(&v));
    }
    if let Some(t) = g.out_ids {
        let v: Vec<i32> = out_rows.iter().map(|&r| r as i32).collect();
        set(t, as_bytes(&v));
    }
    for &t in &g.rotations {
        set(t, as_bytes(&crate::kv_cache::hadamard((*t).ne[0] as usize)[..]));
    }
    let status = sys::ggml_backend_sched_graph_compute(sched, g.graph);
    if status != sys::GGML_STATUS_SUCCESS {
        return Err(Error::Ggml(format!("graph compute failed with status {status}")));
    }
    Ok(g.output.map(|o| {
        let n = sys::ggml_nelements(o) as usize;
        let mut out = vec![0f32; n];
        sys::ggml_backend_tensor_get(o, out.as_mut_ptr().cast(), 0, n * 4);
        out
    }))
}

fn validate_windows(windows: &[Range<usize>], n_layer: usize) -> Result<()> {
    if windows.is_empty() {
        return Err(Error::InvalidWindow("a stage needs at least one window".into()));
    }
    for (i, w) in windows.iter().enumerate() {
        // Empty windows exist only at the edges: 0..0 embeds, L..L is the output layer.
        let edge = w.is_empty() && (w.start == 0 || w.start == n_layer);
        if (w.start >= w.end && !edge) || w.end > n_layer {
            return Err(Error::InvalidWindow(format!("{w:?} is not a non-empty range inside the model's {n_layer} layers (or 0..0 / {n_layer}..{n_layer})")));
        }
        if let Some(o) = windows[..i].iter().find(|o| *o == w || (o.start < w.end && w.start < o.end)) {
            return Err(Error::InvalidWindow(format!("{w:?} overlaps {o:?}")));
        }
    }
    Ok(())
}

struct SeqPlan {
    seq: SeqId,
    slot: usize,
    /// Its cached length before this batch.
    start: usize,
    new_len: usize,
    /// The length at which this batch leaves the sequence's draft snapshot (see
    /// `GroupPlan::split`).
    snapshot: Option<usize>,
}

/// How a batch maps onto the cache: the reordering that makes each sequence's tokens
/// contiguous, and per sequence its cells and attention mask.
struct BatchPlan {
    /// `order[r]` is the batch index of reordered row r.
    order: Vec<usize>,
    cells: Vec<i64>,
    groups: Vec<GroupPlan>,
    /// See `GraphShape::recurrent_groups`.
    recurrent_groups: Vec<GroupPlan>,
    masks: Vec<Vec<u16>>,
    /// Per sequence, the mask of sliding-window layers (when the window has any).
    swa_masks: Vec<Vec<u16>>,
    seqs: Vec<SeqPlan>,
}

/// Sequences attended by one attention op at most rows each: ggml's CPU flash attention
/// switches to its tiled kernel at 64 queries per sequence (`GGML_FA_TILE_Q`), whose
/// result could depend on masked cells a shared op adds; below it each query row is
/// computed by the same loop over the cells it sees, alone or beside other sequences.
const SHARED_ATTENTION_ROWS: usize = 64;

/// One sequence of a batch, checked against the cache.
struct SeqRows {
    seq: SeqId,
    rows: Vec<usize>,
    slot: usize,
    new_len: usize,
}

/// A sliding or chunked attention window.
#[derive(Debug, Clone, Copy)]
struct AttnWindow {
    n: usize,
    chunked: bool,
}

impl AttnWindow {
    /// The first position a query at `pos` sees: llama.cpp's standard window hides key
    /// p0 from query p1 when p1 - p0 >= n; its chunked one (Llama 4) when p0 is in an
    /// earlier chunk of n.
    fn first_visible(self, pos: usize) -> usize {
        if self.chunked {
            pos / self.n * self.n
        } else {
            (pos + 1).saturating_sub(self.n)
        }
    }
}

/// `n_swa`: the sliding window, when the batch's window has sliding layers.
/// `share`: sequences in consecutive cache slots with the same number of rows (every
/// sequence of a decode step) are attended by one attention op, as llama.cpp attends its
/// streams: one op per layer instead of one per sequence (and a concatenation each),
/// which on a CPU is a thread barrier per op and heads split unevenly across threads.
fn plan_batch(cache: &KvCache, batch: &[BatchToken], n_swa: Option<AttnWindow>, share: bool) -> Result<BatchPlan> {
    let mut seq_order: Vec<SeqId> = Vec::new();
    for t in batch {
        if !seq_order.contains(&t.seq) {
            seq_order.push(t.seq);
        }
    }
    let mut seqs: Vec<SeqRows> = Vec::with_capacity(seq_order.len());
    let mut taken: Vec<usize> = Vec::new();
    for seq in seq_order {
        let rows: Vec<usize> = (0..batch.len()).filter(|&i| batch[i].seq == seq).collect();
        let len = cache.len(seq);
        let slot = cache.slot_for(seq, &taken)?;
        taken.push(slot);
        for (j, &r) in rows.iter().enumerate() {
            let pos = batch[r].pos as usize;
            if pos >= cache.capacity {
                return Err(Error::SequenceFull { seq, pos: batch[r].pos, capacity: cache.capacity as u32 });
            }
            if pos != len + j {
                return Err(Error::InvalidBatch(format!("sequence {seq}: position {pos} does not follow its cached length {}", len + j)));
            }
        }
        let new_len = len + rows.len();
        seqs.push(SeqRows { seq, rows, slot, new_len });
    }
    if share {
        // Neighbouring slots next to each other in the batch, so they can share an op.
        seqs.sort_by_key(|s| s.slot);
    }
    let mut plan = BatchPlan { order: Vec::with_capacity(batch.len()), cells: Vec::with_capacity(batch.len()), groups: Vec::new(), recurrent_groups: Vec::new(), masks: Vec::new(), swa_masks: Vec::new(), seqs: Vec::new() };
    let padded = |len: usize| cache.slot_cells.min(len.div_ceil(KV_PAD).max(1) * KV_PAD);
    // A sequence's first query sees nothing before `swa_start`.
    let swa_start = |s: &SeqRows, w: AttnWindow| w.first_visible(s.new_len - s.rows.len()) / KV_PAD * KV_PAD;
    let mut i = 0;
    while i < seqs.len() {
        let n_rows = seqs[i].rows.len();
        let mut end = i + 1;
        while share && n_rows < SHARED_ATTENTION_ROWS && end < seqs.len() && seqs[end].slot == seqs[end - 1].slot + 1 && seqs[end].rows.len() == n_rows {
            end += 1;
        }
        let run = &seqs[i..end];
        // Every sequence of the op attends the same number of cells; the cells past a
        // sequence's own length are masked, and the kernel skips masked cells.
        let n_kv = run.iter().map(|s| padded(s.new_len)).max().expect("a run has a sequence");
        let cell0 = run[0].slot * cache.slot_cells;
        let mut mask = vec![F16_NEG_INF; n_kv * n_rows * run.len()];
        let lo = n_swa.map(|n| run.iter().map(|s| swa_start(s, n)).min().expect("a run has a sequence"));
        let n_kv_swa = n_kv - lo.unwrap_or(0);
        let mut swa = vec![F16_NEG_INF; if n_swa.is_some() { n_kv_swa * n_rows * run.len() } else { 0 }];
        let row0 = plan.order.len();
        for (k, s) in run.iter().enumerate() {
            let s_cell0 = s.slot * cache.slot_cells;
            for (j, &r) in s.rows.iter().enumerate() {
                let pos = batch[r].pos as usize;
                let at = (k * n_rows + j) * n_kv;
                mask[at..at + pos + 1].fill(F16_ZERO);
                if let (Some(n_swa), Some(lo)) = (n_swa, lo) {
                    let first = n_swa.first_visible(pos).max(lo);
                    let at = (k * n_rows + j) * n_kv_swa;
                    swa[at + (first - lo)..at + (pos + 1 - lo)].fill(F16_ZERO);
                }
                plan.cells.push((s_cell0 + pos) as i64);
            }
            // Recurrent ops share across sequences in consecutive slots, adjacent in the
            // batch, with as many rows, whatever the attention groups are. A sequence with
            // draft tokens (rows after its first that wants logits) has its own, which
            // leaves a snapshot of its state where the drafts begin.
            let (r0, rows) = (plan.order.len(), s.rows.len());
            let drafts_from = s.rows.iter().position(|&r| batch[r].logits).map(|j| j + 1).filter(|&c| cache.draft_snapshots && c < rows);
            let split = drafts_from.unwrap_or(0);
            match plan.recurrent_groups.last_mut() {
                _ if !cache.recurrent => {}
                Some(g) if split == 0 && g.split == 0 && g.n_rows == rows && g.row0 + g.n_rows * g.n_seqs == r0 && g.cell0 + g.n_seqs * cache.slot_cells == s.slot * cache.slot_cells => g.n_seqs += 1,
                _ => plan.recurrent_groups.push(GroupPlan { row0: r0, n_rows: rows, n_seqs: 1, split, cell0: s.slot * cache.slot_cells, n_kv: 0, cell0_swa: 0, n_kv_swa: 0 }),
            }
            plan.order.extend_from_slice(&s.rows);
            let start = s.new_len - s.rows.len();
            plan.seqs.push(SeqPlan { seq: s.seq, slot: s.slot, start, new_len: s.new_len, snapshot: (split > 0).then_some(start + split) });
        }
        if n_swa.is_some() {
            plan.swa_masks.push(swa);
        }
        plan.groups.push(GroupPlan { row0, n_rows, n_seqs: run.len(), split: 0, cell0, n_kv, cell0_swa: cell0 + lo.unwrap_or(0), n_kv_swa });
        plan.masks.push(mask);
        i = end;
    }
    Ok(plan)
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (i32, i64, u16, f32) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}
