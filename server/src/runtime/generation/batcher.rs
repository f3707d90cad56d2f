//! Continuous batching. One loop owns the engine: between steps it admits queued
//! requests into free sequence slots (reusing the KV of the longest cached prefix), and
//! each step runs a batch holding a decode token of every generating sequence plus
//! prompt chunks within the token budget, so a long prompt never stalls running streams.
//!
//! A pipeline whose devices can work on different batches at once (a ring) takes up to
//! `depth` micro-batches in flight: the generating sequences are split into that many
//! groups, each sent on as soon as its last tokens are sampled, and a prompt is cut into
//! chunks that follow one another through the devices. A sequence's slot is not reused,
//! cleared or truncated while any of its micro-batches is in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::sampler::Sampler;
use engine::tokenizer::{TextStream, Tokenizer};
use engine::BatchToken;

use super::logprobs::logprobs;
use super::pipeline::Pipeline;
use super::prefix_cache::{self, PrefixCache, PrefixCacheConfig, BLOCK_TOKENS, STATE_EVERY_BLOCKS};
use super::speculation::{DraftRequest, Drafter, Proposer};
use super::request::{Event, Finish, GenerationRequest, TokenInfo, TokenLogprob};
use super::stop::StopMatcher;
use crate::metrics as m;

#[derive(Debug, Clone)]
pub struct BatcherConfig {
    /// Sequences generated at once (`--parallel`).
    pub parallel: usize,
    /// Requests that may wait for a slot; more are refused (HTTP 429).
    pub queue: usize,
    /// Tokens per step (decode tokens + prompt chunks).
    pub max_batch: usize,
    /// Most draft tokens proposed per sequence and step (`--spec-tokens`).
    pub spec_tokens: usize,
    /// The model files this node computes from: once one changes under its mapping (see
    /// `engine::gguf::GgufFile::changed`), nothing computed from it is sent, and the node
    /// serves nothing more until it is restarted.
    pub files: Vec<Arc<engine::ModelFile>>,
    /// Computed prompt prefixes kept beyond the slots (`--prompt-cache-*`); used where the
    /// pipeline can read and write its rows.
    pub prompt_cache: PrefixCacheConfig,
    /// How this node computes rows, in words (what changes their rounding: kernels,
    /// accelerator layers): part of the prompt cache's namespace beside the model files'
    /// fingerprints and the rows' layout.
    pub compute: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    QueueFull,
    ShuttingDown,
    /// A ring member is lost; the message names it. New requests are refused until the
    /// ring is whole again.
    Unavailable(String),
}

pub struct Batcher {
    queue: Arc<Queue>,
    shutting_down: Arc<AtomicBool>,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
    degraded: Degraded,
    n_ctx: usize,
    parallel: usize,
}

/// Why the pipeline cannot serve (a ring member is lost), shared with the HTTP side.
type Degraded = Arc<Mutex<Option<String>>>;

/// Requests waiting for a slot. A request whose client went away leaves at once: when a
/// request arrives to a full queue, and every time the loop looks (each step, each idle
/// poll). Otherwise a crowd of clients that gave up would hold every place, and everyone
/// else would get 429 until slots had worked through them.
struct Queue {
    items: Mutex<QueueItems>,
    arrived: Condvar,
    capacity: usize,
}

struct QueueItems {
    waiting: VecDeque<GenerationRequest>,
    /// The loop ended: nothing queued will ever run.
    closed: bool,
}

impl Queue {
    fn new(capacity: usize) -> Queue {
        Queue { items: Mutex::new(QueueItems { waiting: VecDeque::new(), closed: false }), arrived: Condvar::new(), capacity: capacity.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueItems> {
        // Every change to the queue is one deque operation: a panic elsewhere while it
        // was held leaves it consistent.
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, req: GenerationRequest) -> Result<(), SubmitError> {
        let mut q = self.lock();
        if q.closed {
            return Err(SubmitError::ShuttingDown);
        }
        if q.waiting.len() >= self.capacity {
            drop_gone(&mut q.waiting);
            if q.waiting.len() >= self.capacity {
                return Err(SubmitError::QueueFull);
            }
        }
        q.waiting.push_back(req);
        m::queue_size(q.waiting.len());
        drop(q);
        self.arrived.notify_one();
        Ok(())
    }

    /// The oldest request whose client is still there, waiting up to `wait` for one.
    fn pop(&self, wait: Duration) -> Option<GenerationRequest> {
        let mut q = self.lock();
        if q.waiting.is_empty() && !wait.is_zero() {
            q = self.arrived.wait_timeout_while(q, wait, |q| q.waiting.is_empty()).unwrap_or_else(|e| e.into_inner()).0;
        }
        drop_gone(&mut q.waiting);
        let req = q.waiting.pop_front();
        m::queue_size(q.waiting.len());
        req
    }

    /// The oldest request whose client is still there, unless `hold` says it must wait: then
    /// it stays first in line and nothing is taken.
    fn pop_unless(&self, hold: impl Fn(&GenerationRequest) -> bool) -> Option<GenerationRequest> {
        let mut q = self.lock();
        drop_gone(&mut q.waiting);
        let req = if q.waiting.front().is_some_and(|r| !hold(r)) { q.waiting.pop_front() } else { None };
        m::queue_size(q.waiting.len());
        req
    }

    /// Drops requests of clients that went away; how many are still waiting.
    fn prune(&self) -> usize {
        let mut q = self.lock();
        drop_gone(&mut q.waiting);
        m::queue_size(q.waiting.len());
        q.waiting.len()
    }

    /// Their clients see the end of their event streams, as when the loop fails.
    fn close(&self) {
        let mut q = self.lock();
        q.closed = true;
        q.waiting.clear();
        m::queue_size(0);
    }
}

fn drop_gone(waiting: &mut VecDeque<GenerationRequest>) {
    waiting.retain(|r| {
        let gone = r.events.is_closed();
        if gone {
            tracing::info!(request = %r.id, "client went away while queued");
            m::cancelled();
        }
        !gone
    });
}

/// Weight of the latest step in the running mean of decode-step time.
const STEP_TIME_WEIGHT: f64 = 0.2;
/// How long the idle loop sleeps before looking at the shutdown flag again.
const IDLE_POLL: Duration = Duration::from_millis(100);
/// How often a broken ring is tried again: often enough that serving resumes about a
/// second after a worker comes back, rarely enough that a device that stays down costs
/// nothing (a refused connection returns at once).
const RECOVER_INTERVAL: Duration = Duration::from_secs(1);

impl Batcher {
    /// `proposer`: where speculative drafts come from; `None` turns speculation off.
    pub fn start(pipeline: Box<dyn Pipeline>, tokenizer: Arc<Tokenizer>, cfg: BatcherConfig, proposer: Option<Proposer>) -> Batcher {
        let queue = Arc::new(Queue::new(cfg.queue));
        let shutting_down = Arc::new(AtomicBool::new(false));
        let degraded: Degraded = Arc::new(Mutex::new(None));
        let n_ctx = pipeline.n_ctx_seq();
        let parallel = cfg.parallel;
        // What names the rows besides their layout: the model files, how they are computed.
        let identity = match PrefixCache::open(&cfg.prompt_cache) {
            Some(cache) => {
                let mut parts: Vec<String> = cfg.files.iter().map(|f| f.fingerprint()).collect();
                parts.push(cfg.compute.clone());
                Some((cache, parts))
            }
            None => None,
        };
        let (blocks, identity) = identity.map_or((None, Vec::new()), |(c, p)| (Some(c), p));
        let mut lp = Loop {
            pipeline,
            tokenizer,
            slots: (0..cfg.parallel).map(|i| Slot { seq: i as u64, cached: Vec::new(), exact: 0, save_to: None, active: None, in_flight: 0, clear_on_landing: false }).collect(),
            queue: queue.clone(),
            shutting_down: shutting_down.clone(),
            degraded: degraded.clone(),
            max_batch: cfg.max_batch,
            spec_tokens: if proposer.is_some() { cfg.spec_tokens } else { 0 },
            proposer,
            decode_step_s: 0.0,
            n_ctx,
            last_recovery: Instant::now(),
            idle_since: Instant::now(),
            flying: HashMap::new(),
            landed: VecDeque::new(),
            next_ticket: 0,
            files: cfg.files,
            file_changed: false,
            blocks,
            identity,
            prompt_rate: 0.0,
            unpriced: 0,
        };
        lp.rows_changed();
        let thread = std::thread::Builder::new().name("hearth-batcher".into()).spawn(move || lp.run()).expect("spawn the batching thread");
        Batcher { queue, shutting_down, thread: std::sync::Mutex::new(Some(thread)), degraded, n_ctx, parallel }
    }

    /// Context cells per sequence: prompt plus generated tokens must fit.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Why the pipeline cannot serve now (a ring member is lost); `None` when it can.
    /// Cleared when the ring is whole again.
    pub fn degraded(&self) -> Option<String> {
        self.degraded.lock().expect("degraded lock").clone()
    }

    pub fn parallel(&self) -> usize {
        self.parallel
    }

    pub fn submit(&self, req: GenerationRequest) -> Result<(), SubmitError> {
        self.accepting()?;
        self.queue.push(req)
    }

    /// Whether a request submitted now would be taken (it may still be refused when it is
    /// submitted, if others took the room meanwhile). Lets the API refuse a request before
    /// preparing it: under a crowd of retrying clients the refusals must cost next to
    /// nothing, or their CPU steals the engine's cores in the middle of its steps.
    pub fn has_room(&self) -> Result<(), SubmitError> {
        self.accepting()?;
        if self.queue.prune() >= self.queue.capacity {
            return Err(SubmitError::QueueFull);
        }
        Ok(())
    }

    fn accepting(&self) -> Result<(), SubmitError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        if let Some(why) = self.degraded() {
            return Err(SubmitError::Unavailable(why));
        }
        Ok(())
    }

    /// Stops admitting requests, lets running and queued ones finish, and waits for the
    /// loop to end.
    pub fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        if let Some(t) = self.thread.lock().expect("batcher thread lock").take() {
            let _ = t.join();
        }
    }
}

struct Slot {
    seq: u64,
    /// Tokens whose K/V this slot holds (or will, once its micro-batches in flight land),
    /// in order: what a later request can reuse.
    cached: Vec<i32>,
    /// Leading rows of `cached` that equal what a cold prompt computes (prompt rows
    /// computed in whole tiles after rows that did): what the prompt cache may keep.
    /// Decode rows, and a short rest of a prompt, are computed one row at a time and round
    /// otherwise.
    exact: usize,
    /// Once this slot's prompt has landed, its rows up to here are exact: `exact` becomes
    /// this and their whole blocks go to the prompt cache.
    save_to: Option<usize>,
    active: Option<Active>,
    /// Micro-batches in flight holding tokens of this sequence.
    in_flight: usize,
    /// The sequence failed while some of its micro-batches were still in flight: clear it
    /// everywhere once they have landed (clearing earlier would race their writes).
    clear_on_landing: bool,
}

impl Slot {
    /// Free for a new request: nothing runs in it and nothing of it is in flight.
    fn free(&self) -> bool {
        self.active.is_none() && self.in_flight == 0
    }

    /// Leading rows of `cached` that a cold prompt computes alike once what is in flight
    /// has landed: `exact`, or up to `save_to` while a prompt computed in tiles after exact
    /// rows is on its way. Only these may be reused (kept in the slot, copied to another,
    /// waited for): a decode row or a short rest is computed one row at a time, and a row
    /// after a reused prefix that ends off a tile is grouped otherwise than a cold
    /// prompt's (ggml's repacked matmuls take rows in fours from a batch's first; its
    /// attention tiles 64 queries), so reusing any of them changes the answer.
    fn exact_bound(&self) -> usize {
        self.save_to.map_or(self.exact, |to| to.max(self.exact)).min(self.cached.len())
    }
}

struct Active {
    req: GenerationRequest,
    sampler: Sampler,
    /// Prompt tokens not yet fed.
    pending: VecDeque<i32>,
    /// The token sampled last step, fed this step.
    next: Option<i32>,
    generated: usize,
    text: TextStream,
    stop: StopMatcher,
    started: Option<Instant>,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// Speculation (`None`: off), and the draft tokens in this step's batch.
    drafter: Option<Drafter>,
    draft: Vec<i32>,
    /// Accepted draft tokens a recurrent model computes again, before `next`: its state
    /// went back to where the drafts began (see `verify`).
    replay: Vec<i32>,
    /// Prompt tokens per micro-batch (the pipeline's chunk for this prompt).
    chunk: usize,
    /// The cached length at which to checkpoint the recurrent state (models that keep
    /// one): prompt tokens stop there until everything before has landed.
    checkpoint_at: Option<usize>,
    /// A model that keeps a recurrent state: the ends of this prompt's blocks to keep with
    /// the state (every `STATE_EVERY_BLOCKS`th and the last a restore reaches) that the prompt cache
    /// lacks, with their ids. The state where a block ends exists only while the sequence is
    /// there, so prompt tokens stop at each until everything before has landed, and the
    /// block is kept then; the other blocks' rows alone are kept once the prompt has landed.
    save_at: VecDeque<(usize, prefix_cache::BlockId)>,
}

impl Active {
    /// Where this prompt's tokens stop next until what came before has landed.
    fn next_stop(&self) -> Option<usize> {
        [self.checkpoint_at, self.save_at.front().map(|&(at, _)| at)].into_iter().flatten().min()
    }
}

/// A model with a recurrent state restores blocks `first..e` as rows alone and block `e`
/// with the state where it ends (a state is had only every few blocks); returns the
/// furthest such `e` whose state the cache holds (`held` blocks' rows from `first` on are
/// held), that gains on the `keep` tokens the slot holds, and whose reads from disk take
/// less than computing what it gains. Decided before anything is read: a restore stopped
/// midway would end on rows alone, without a state.
fn restore_end_with_state(cache: &PrefixCache, ids: &[prefix_cache::BlockId], first: usize, held: usize, keep: usize, block_s: f64, read_rate: Option<f64>) -> Option<usize> {
    (first..(first + held + 1).min(ids.len())).rev().find(|&e| {
        let with_state = PrefixCache::with_state(&ids[e]);
        let gained = ((e + 1) * BLOCK_TOKENS).saturating_sub(keep);
        if gained == 0 || !cache.contains(&with_state) {
            return false;
        }
        let bytes = ids[first..e].iter().map(|id| cache.disk_bytes(id)).sum::<u64>() + cache.disk_bytes(&with_state);
        read_rate.is_none_or(|r| bytes as f64 / r <= block_s * gained as f64 / BLOCK_TOKENS as f64)
    })
}

/// Prompt rows a request saves by waiting for another prompt to compute them, for it to
/// wait (`Loop::prefix_being_computed`): a whole tile, what a copy takes at least. The wait
/// lasts until the shared rows have landed, not the other prompt's whole length.
const HOLD_GAIN: usize = scheduler::pipelining::MIN_PROMPT_CHUNK;

/// Tokens before a prompt's end where a recurrent model's state is checkpointed: the
/// next turn of a chat re-renders this turn's generation prompt (Qwen3.5's template drops
/// the thinking it opened), so the state at the very end would not be reusable.
pub(super) const CHECKPOINT_TAIL: usize = 16;

/// Whole tiles of `shared` leading tokens of `prompt`, ending at least a tile before its
/// end: rows taken from elsewhere (a copy, the prompt cache) stop there, so the rest is
/// computed in tiles as a cold prompt computes it.
fn tile_floor(prompt: &[i32], shared: usize) -> usize {
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    shared.min(prompt.len().saturating_sub(tile)) / tile * tile
}

/// The rows of a prompt piece to take now, `take` of a stretch of `stretch` rows (to the
/// prompt's end or its checkpoint), so that no piece after it is shorter than a `tile` of
/// query rows: a rest under a tile joins this piece where the batch has `room`, else the
/// piece gives the rest a tile of its rows. ggml's CPU attention computes a sequence's rows in tiles when a
/// batch holds a tile of them or more, and one row at a time otherwise, and the two round
/// differently: so every row of a prompt of a tile or more is computed the tiled way, and
/// the answer does not depend on how the prompt was cut (the single node's batches, the
/// chunks a ring's plan chose: measured on the default model, a 2,775-token prompt in
/// chunks of 100, 128, 192, 256 or 500 gives the logits of 512 bit for bit, chunks of 64
/// with their 23-row rest did not).
pub(super) fn no_short_rest(take: usize, stretch: usize, room: usize, tile: usize) -> usize {
    let rest = stretch.saturating_sub(take);
    if rest == 0 || rest >= tile || take < tile {
        return take;
    }
    if take + rest <= room {
        take + rest
    } else if take + rest >= 2 * tile {
        // Whole tiles, so that pieces start where another cut's pieces would (ggml's
        // repacked kernels take a batch's rows in fours from its first).
        (take + rest - tile) / tile * tile
    } else {
        take
    }
}

struct Loop {
    pipeline: Box<dyn Pipeline>,
    tokenizer: Arc<Tokenizer>,
    slots: Vec<Slot>,
    queue: Arc<Queue>,
    shutting_down: Arc<AtomicBool>,
    degraded: Degraded,
    max_batch: usize,
    spec_tokens: usize,
    proposer: Option<Proposer>,
    /// Seconds per step with decode tokens (a running mean): what a draft token's time is
    /// weighed against.
    decode_step_s: f64,
    n_ctx: usize,
    last_recovery: Instant,
    /// When the last step ended.
    idle_since: Instant,
    /// Micro-batches in flight (`depth` at most), by ticket.
    flying: HashMap<u64, MicroBatch>,
    /// Micro-batches that finished (or failed to start) before anyone asked.
    landed: VecDeque<(MicroBatch, crate::Result<engine::Logits>)>,
    next_ticket: u64,
    files: Vec<Arc<engine::ModelFile>>,
    /// A model file changed under this node: degraded for good (no recovery brings the
    /// old weights back).
    file_changed: bool,
    /// Prompt prefixes kept beyond the slots; `None`: off. Inactive while the pipeline
    /// gives no row layout (a model with a recurrent state, a ring not formed).
    blocks: Option<PrefixCache>,
    /// The model files' fingerprints and how rows are computed: with the pipeline's row
    /// layout, the prompt cache's namespace.
    identity: Vec<String>,
    /// Prompt rows computed per second (a running mean of steps with prompt rows): what
    /// reading a block from disk is weighed against.
    prompt_rate: f64,
    /// Tokens restored before any prompt was measured (right after a restart): the time
    /// they saved is counted once the rate is known.
    unpriced: usize,
}

/// One batch on its way through the pipeline, and what its rows belong to.
struct MicroBatch {
    batch: Vec<BatchToken>,
    ids: Vec<i32>,
    rows: Vec<Row>,
    /// Decode tokens (with their drafts) come first in the batch.
    n_decode: usize,
    /// Distinct slots with tokens in it.
    slots: Vec<usize>,
    started: Instant,
}

/// What a batch row belongs to.
struct Row {
    slot: usize,
    wants_logits: bool,
    /// A sequence's decode token: the draft tokens that follow it in the batch.
    drafts: usize,
    /// A draft token (not in the sequence until verified).
    is_draft: bool,
}

impl Loop {
    fn run(&mut self) {
        self.report_usage();
        loop {
            self.recover_if_due();
            let busy = self.slots.iter().any(|s| s.active.is_some()) || !self.flying.is_empty() || !self.landed.is_empty();
            if !busy {
                if self.shutting_down.load(Ordering::Acquire) && self.queue.prune() == 0 {
                    return;
                }
                match self.queue.pop(IDLE_POLL) {
                    Some(req) => self.admit(req),
                    None => {
                        self.idle();
                        continue;
                    }
                }
            }
            let queue = self.queue.clone();
            while self.slots.iter().any(Slot::free) {
                match queue.pop_unless(|r| self.prefix_being_computed(&r.prompt)) {
                    Some(req) => self.admit(req),
                    None => break,
                }
            }
            self.queue.prune();
            self.drop_cancelled();
            self.step();
            // After every step, not only those that ran a batch: one where every
            // sequence was cancelled runs none, and the loop then idles.
            self.report_usage();
            self.idle_since = Instant::now();
        }
    }

    /// Nothing runs and nothing waits: the pipeline may do its maintenance (a ring
    /// re-plans then).
    fn idle(&mut self) {
        if self.check_files().is_some() || self.degraded.lock().expect("degraded lock").is_some() {
            return;
        }
        match self.pipeline.idle(self.idle_since.elapsed()) {
            Ok(false) => {}
            Ok(true) => self.forget_caches(),
            Err(e) => {
                self.forget_caches();
                self.set_degraded(Some(e.to_string()));
                self.last_recovery = Instant::now();
            }
        }
    }

    /// Every cache of the pipeline was emptied: nothing cached is reusable any more. (A
    /// ring re-formed, perhaps with another plan: its rows' layout may have changed.)
    fn forget_caches(&mut self) {
        for s in &mut self.slots {
            s.cached.clear();
            s.exact = 0;
            s.save_to = None;
        }
        self.rows_changed();
    }

    /// The prompt cache's namespace for the pipeline's rows as they are laid out now.
    fn rows_changed(&mut self) {
        let Some(cache) = self.blocks.as_mut() else { return };
        let namespace = self.pipeline.row_layout().map(|layout| {
            let mut parts: Vec<&str> = self.identity.iter().map(String::as_str).collect();
            parts.push(&layout);
            prefix_cache::namespace(&parts)
        });
        cache.set_namespace(namespace);
    }

    fn set_degraded(&self, why: Option<String>) {
        *self.degraded.lock().expect("degraded lock") = why;
    }

    /// Why this node's model file can no longer be computed from, if it cannot; the first
    /// time, the node turns degraded for good and says so in the log.
    fn check_files(&mut self) -> Option<String> {
        let why = self.files.iter().find_map(|f| f.gguf.changed())?;
        let why = format!("{why}: this node serves nothing more until it is restarted (replace a served model by renaming a complete copy over it; see docs/ring.md)");
        if !self.file_changed {
            tracing::error!("{why}");
            self.file_changed = true;
            self.set_degraded(Some(why.clone()));
        }
        Some(why)
    }

    /// While degraded, tries to make the pipeline whole again every `RECOVER_INTERVAL`.
    fn recover_if_due(&mut self) {
        if self.file_changed || self.degraded.lock().expect("degraded lock").is_none() || self.last_recovery.elapsed() < RECOVER_INTERVAL {
            return;
        }
        self.last_recovery = Instant::now();
        match self.pipeline.recover() {
            Ok(reset) => {
                if reset {
                    self.forget_caches();
                }
                tracing::info!("serving again");
                self.set_degraded(None);
            }
            Err(e) => self.set_degraded(Some(e.to_string())),
        }
    }

    fn admit(&mut self, req: GenerationRequest) {
        m::queue_time(req.enqueued.elapsed());
        if req.events.is_closed() {
            return;
        }
        let sampler = match Sampler::new(&self.tokenizer, &req.sampling) {
            Ok(s) => s,
            Err(e) => {
                let _ = req.events.send(Event::Failed(e.to_string()));
                return;
            }
        };
        // The free slot sharing the longest prefix with this prompt: its KV is reused. At
        // least one prompt token is always fed, to get logits for the first sample.
        let (idx, lcp) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.free())
            .map(|(i, s)| (i, common_prefix(&s.cached, &req.prompt)))
            .max_by_key(|&(i, l)| (l, std::cmp::Reverse(i)))
            .expect("admit is called with a free slot");
        let mut keep = lcp.min(req.prompt.len().saturating_sub(1));
        // Only rows a cold prompt computes alike are kept, as a copy takes them (whole
        // tiles, a tile before the prompt's end): the rest is then computed as a cold
        // prompt computes it, and the answer does not depend on what the slot held — not
        // on a conversation's generated rows, nor on one shared token (a BOS) that would
        // shift the grouping of every row after it. A prompt under two tiles keeps none.
        let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
        if !self.pipeline.keeps_state() {
            keep = self.copyable(&req.prompt, keep.min(self.slots[idx].exact_bound()));
        }
        let slot = &mut self.slots[idx];
        // A recurrent model keeps less: back to its last checkpoint at or before `keep`.
        let keep = self.pipeline.truncate_sequence(slot.seq, keep).min(keep);
        slot.cached.truncate(keep);
        slot.exact = slot.exact.min(keep);
        slot.save_to = None;
        let keep = self.copy_prefix_from_another_slot(idx, keep, &req.prompt);
        let keep = self.restore_blocks(idx, keep, &req.prompt);
        // The prompt's rows are exact when every row before them is and the rest is long
        // enough to be computed in tiles (see `no_short_rest`).
        if self.slots[idx].exact == keep && req.prompt.len() - keep >= tile {
            self.slots[idx].save_to = Some(req.prompt.len());
        }
        // A recurrent model's state is copied a few tokens before the prompt's end, where
        // the next turn of a conversation still agrees with this one (its template renders
        // this turn's generation prompt differently once answered).
        let checkpoint_at = (self.pipeline.keeps_state() && req.prompt.len() > keep + CHECKPOINT_TAIL).then(|| req.prompt.len() - CHECKPOINT_TAIL);
        let save_at = self.state_blocks_to_save(idx, keep, &req.prompt);
        let pending: VecDeque<i32> = req.prompt[keep..].iter().copied().collect();
        let chunk = self.pipeline.prompt_chunk(pending.len(), self.max_batch).clamp(1, self.max_batch);
        let stop = StopMatcher::new(req.stop.clone());
        self.slots[idx].active = Some(Active {
            prompt_tokens: req.prompt.len(),
            cached_tokens: keep,
            req,
            sampler,
            pending,
            next: None,
            generated: 0,
            text: TextStream::default(),
            stop,
            started: None,
            last_token: None,
            drafter: (self.spec_tokens > 0).then(|| Drafter::new(self.spec_tokens)),
            draft: Vec::new(),
            replay: Vec::new(),
            chunk,
            checkpoint_at,
            save_at,
        });
        m::prompt_tokens(keep, self.slots[idx].active.as_ref().map_or(0, |a| a.pending.len()));
    }

    /// Where another slot holds more of `prompt` than slot `idx` kept (`keep` tokens) — a
    /// system prompt several conversations share, a conversation continuing in another
    /// slot, the `n` choices of one request — its K/V rows are copied into `idx` instead of
    /// computed again; returns what `idx` holds then. The copy ends on a whole tile of
    /// query rows at least a tile before the prompt's end, so the rest is computed as a
    /// cold prompt computes those rows (ggml's tiled attention, row groups where a cold
    /// prompt's start) and the answer is the cold answer's. Only from a slot with nothing
    /// in flight: on a ring, a micro-batch in flight has not yet written every member's
    /// rows. Not for a model with a recurrent state, which holds a sequence's whole past
    /// rather than rows of it.
    fn copy_prefix_from_another_slot(&mut self, idx: usize, keep: usize, prompt: &[i32]) -> usize {
        let best = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, s)| *i != idx && s.in_flight == 0 && !s.clear_on_landing)
            .map(|(i, s)| (i, self.copyable(prompt, common_prefix(&s.cached, prompt).min(s.exact_bound()))))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)));
        let Some((src, n)) = best.filter(|&(_, n)| n > keep) else { return keep };
        let (from, to) = (self.slots[src].seq, self.slots[idx].seq);
        let copied = self.pipeline.copy_sequence(from, to, n).min(n);
        if copied <= keep {
            // Nothing gained: `to` is as it was, or emptied where some window could not
            // copy; what it holds now is what it keeps.
            let kept = self.pipeline.truncate_sequence(to, keep).min(keep);
            self.slots[idx].cached.truncate(kept);
            self.slots[idx].exact = self.slots[idx].exact.min(kept);
            return kept;
        }
        let cached = self.slots[src].cached[..copied].to_vec();
        self.slots[idx].cached = cached;
        // Every row copied is exact: the copy stopped at the source's exact rows.
        self.slots[idx].exact = copied;
        m::prefix_copied(copied);
        tracing::debug!(from, to, copied, "prompt prefix copied from another slot");
        copied
    }

    /// Where the prompt cache holds `prompt`'s blocks beyond what slot `idx` holds (`keep`
    /// tokens), their rows are written into the slot instead of computed; returns what the
    /// slot holds then. Blocks start where the slot's exact rows end (a block after rows
    /// that round otherwise would not be what a cold prompt computes) and end, as a copy
    /// does, at least a tile before the prompt's end, so the answer is the cold answer's. A
    /// block on disk is read only while reading it is faster than computing it (both rates
    /// as measured here). A model with a recurrent state gets blocks of rows alone and a
    /// last one with the state where it ends (see `restore_end_with_state`).
    fn restore_blocks(&mut self, idx: usize, keep: usize, prompt: &[i32]) -> usize {
        let limit = tile_floor(prompt, prompt.len());
        let keeps_state = self.pipeline.keeps_state();
        let Some(cache) = self.blocks.as_mut().filter(|c| c.active()) else { return keep };
        let first = self.slots[idx].exact.min(keep) / BLOCK_TOKENS;
        let last = limit / BLOCK_TOKENS;
        if last <= first || last * BLOCK_TOKENS <= keep {
            return keep;
        }
        let ids = cache.chain(&prompt[..last * BLOCK_TOKENS]);
        let compute_s = if self.prompt_rate > 0.0 { BLOCK_TOKENS as f64 / self.prompt_rate } else { f64::INFINITY };
        let read_rate = cache.disk_read_rate();
        let held = ids[first..].iter().take_while(|id| cache.contains(id)).count();
        m::prefix_cache_misses(last - (first + held).max(keep.div_ceil(BLOCK_TOKENS)).min(last));
        // The block after which no more are handed, and for a recurrent model the one
        // handed with the state.
        let (stop, state_at) = if keeps_state {
            match restore_end_with_state(cache, &ids, first, held, keep, compute_s, read_rate) {
                Some(e) => (e + 1, Some(e)),
                None => return keep,
            }
        } else {
            (first + held, None)
        };
        if stop * BLOCK_TOKENS <= keep {
            return keep;
        }
        let started = Instant::now();
        let seq = self.slots[idx].seq;
        let mut handed = 0usize;
        let mut block_bytes = 0usize;
        // Blocks go to the pipeline one at a time, read as it asks for them.
        let mut next = || {
            let i = first + handed;
            let at = i * BLOCK_TOKENS;
            if i >= stop {
                return None;
            }
            let id = if state_at == Some(i) { PrefixCache::with_state(&ids[i]) } else { ids[i] };
            // Past what the slot holds, a block on disk is read only where that beats
            // computing its rows (a recurrent model's restore was decided whole before).
            if state_at.is_none() && at >= keep && !cache.in_ram(&id) && read_rate.is_some_and(|r| block_bytes as f64 / r > compute_s) {
                return None;
            }
            let rows = cache.get(&id, &prompt[at..at + BLOCK_TOKENS])?;
            block_bytes = rows.len();
            handed += 1;
            Some((id, rows))
        };
        // The first block cuts the slot at its start; a failed one leaves it there or shorter.
        let written = self.pipeline.write_blocks(seq, first * BLOCK_TOKENS, BLOCK_TOKENS, &mut next);
        if handed == 0 {
            return keep;
        }
        let at = match written {
            // Rows alone without the state after them (a block file found damaged midway):
            // the state is not where the sequence ends.
            Ok(w) if keeps_state && first + w != stop => {
                tracing::warn!(seq, at = (first + w) * BLOCK_TOKENS, "a prompt-cache block could not be read midway through a recurrent model's restore: the prompt is computed whole");
                self.pipeline.clear_sequence(seq);
                0
            }
            Ok(w) => (first + w) * BLOCK_TOKENS,
            Err((w, kept)) => {
                tracing::warn!(seq, at = (first + w) * BLOCK_TOKENS, kept, "a prompt-cache block could not be written into the KV cache (a ring member no longer has its rows of it?): it and the blocks after it are computed and kept again");
                // A member that lost this block (restarted without its disk, evicted it)
                // lost those kept after it too.
                for id in &ids[first + w..stop.max(first + held)] {
                    cache.forget(id);
                    cache.forget(&PrefixCache::with_state(id));
                }
                m::prefix_cache_misses(stop.max(first + held) - first - w);
                if keeps_state {
                    // Rows alone before the failed block left the state behind them.
                    self.pipeline.clear_sequence(seq);
                    0
                } else {
                    ((first + w) * BLOCK_TOKENS).min(kept)
                }
            }
        };
        // The slot's tokens before `keep` are the prompt's: it holds the prompt's first `at`.
        let slot = &mut self.slots[idx];
        slot.cached = prompt[..at].to_vec();
        slot.exact = at;
        let gained = at.saturating_sub(keep);
        let saved_s = if self.prompt_rate > 0.0 {
            gained as f64 / self.prompt_rate - started.elapsed().as_secs_f64()
        } else {
            self.unpriced += gained;
            0.0
        };
        m::prefix_cache_restored(at.saturating_sub(first * BLOCK_TOKENS), saved_s);
        tracing::debug!(seq, from = first * BLOCK_TOKENS, to = at, kept = keep, "prompt prefix restored from the prompt cache");
        at
    }

    /// A model with a recurrent state: the blocks of `prompt` after the `keep` tokens slot
    /// `idx` holds to keep with the state where they end, every `STATE_EVERY_BLOCKS`th and
    /// the last whole one a restore of this prompt reaches (one ending a tile before its
    /// end: the same prompt sent again, and the conversation's next turn, whose template
    /// renders this turn's last tokens otherwise once answered, both get to it), that the
    /// prompt cache lacks (their ends and ids), kept as the prompt passes each end
    /// (`Active::save_at`). Only where the prompt's rows will be exact (`Slot::save_to`), as
    /// [`Loop::prompt_landed`] keeps the blocks' rows alone.
    fn state_blocks_to_save(&self, idx: usize, keep: usize, prompt: &[i32]) -> VecDeque<(usize, prefix_cache::BlockId)> {
        let Some(cache) = self.blocks.as_ref().filter(|c| c.active() && self.pipeline.keeps_state() && self.slots[idx].save_to.is_some()) else { return VecDeque::new() };
        let whole = prompt.len() / BLOCK_TOKENS;
        let reached = tile_floor(prompt, prompt.len()) / BLOCK_TOKENS;
        let ids = cache.chain(&prompt[..whole * BLOCK_TOKENS]);
        ids.iter()
            .enumerate()
            .filter(|&(b, _)| (b + 1) % STATE_EVERY_BLOCKS == 0 || b + 1 == reached)
            .map(|(b, id)| ((b + 1) * BLOCK_TOKENS, PrefixCache::with_state(id)))
            .filter(|(end, id)| *end > keep && !cache.contains(id))
            .collect()
    }

    /// Slot `i` of a model with a recurrent state has landed everything up to the end of
    /// its next block to keep with the state: the block's rows and the state there go to
    /// the prompt cache.
    fn keep_state_block(&mut self, i: usize) {
        let s = &mut self.slots[i];
        let Some(a) = s.active.as_mut() else { return };
        if s.in_flight > 0 || a.save_at.front().is_none_or(|&(at, _)| at != s.cached.len()) {
            return;
        }
        let (end, id) = a.save_at.pop_front().expect("looked at above");
        let (seq, tokens) = (s.seq, s.cached[end - BLOCK_TOKENS..end].to_vec());
        let Some(cache) = self.blocks.as_mut().filter(|c| c.active()) else { return };
        if cache.contains(&id) {
            return;
        }
        match self.pipeline.read_rows(seq, end - BLOCK_TOKENS, BLOCK_TOKENS, &id, true) {
            Some(rows) => cache.put(id, &tokens, rows),
            // Rows that cannot be read now (a ring member failed): the rest are skipped.
            None => a.save_at.clear(),
        }
    }

    /// Once slot `i`'s prompt has landed everywhere, its rows up to `save_to` are exact,
    /// and their whole blocks that the prompt cache lacks are read and kept there (a model
    /// with a recurrent state: their rows alone; some were kept with the state as the
    /// prompt passed their ends).
    fn prompt_landed(&mut self, i: usize) {
        let s = &mut self.slots[i];
        if s.in_flight > 0 || s.active.as_ref().is_some_and(|a| !a.pending.is_empty()) {
            return;
        }
        let Some(to) = s.save_to.take() else { return };
        s.exact = to.min(s.cached.len());
        let (seq, exact) = (s.seq, s.exact);
        let Some(cache) = self.blocks.as_mut().filter(|c| c.active()) else { return };
        let tokens = &self.slots[i].cached[..exact / BLOCK_TOKENS * BLOCK_TOKENS];
        for (b, id) in cache.chain(tokens).into_iter().enumerate() {
            if cache.contains(&id) {
                continue;
            }
            let Some(rows) = self.pipeline.read_rows(seq, b * BLOCK_TOKENS, BLOCK_TOKENS, &id, false) else { break };
            cache.put(id, &tokens[b * BLOCK_TOKENS..(b + 1) * BLOCK_TOKENS], rows);
        }
    }

    /// Whether a running prompt is computing more of `prompt`'s prefix than any slot holds
    /// now (`HOLD_GAIN` rows or more, in whole tiles as a copy takes them): the request then
    /// waits first in the queue until those rows have landed and copies them, instead of
    /// computing the same rows beside them — the `n` choices of one request, agents whose
    /// requests with one system prompt arrive together. The wait ends when the running
    /// prompt has fed the shared rows (or its request ends), so it is never longer than
    /// computing the prefix would have taken.
    fn prefix_being_computed(&self, prompt: &[i32]) -> bool {
        if self.copyable(prompt, prompt.len()) == 0 {
            return false;
        }
        let now = self.slots.iter().map(|s| self.copyable(prompt, common_prefix(&s.cached, prompt).min(s.exact_bound()))).max().unwrap_or(0);
        self.slots.iter().filter_map(|s| Some((s, s.active.as_ref()?))).filter(|(_, a)| !a.pending.is_empty()).any(|(s, a)| {
            let held = common_prefix(&s.cached, prompt);
            let coming = if held < s.cached.len() { held } else { held + a.pending.iter().zip(&prompt[held..]).take_while(|(x, y)| x == y).count() };
            // Rows of a prompt that will not be exact are no use to wait for.
            let exact = s.save_to.map_or(s.exact, |to| to.max(s.exact));
            self.copyable(prompt, coming.min(exact)) >= now + HOLD_GAIN
        })
    }

    /// How much of `shared` leading tokens of `prompt` a copy takes: whole tiles, ending at
    /// least a tile before the prompt's end (see `copy_prefix_from_another_slot`); nothing
    /// for a model with a recurrent state.
    fn copyable(&self, prompt: &[i32], shared: usize) -> usize {
        if self.pipeline.keeps_state() {
            return 0;
        }
        tile_floor(prompt, shared)
    }

    /// A client that went away frees its slot at once (its KV stays as prompt cache).
    fn drop_cancelled(&mut self) {
        for s in &mut self.slots {
            if s.active.as_ref().is_some_and(|a| a.req.events.is_closed()) {
                tracing::info!(request = %s.active.as_ref().map_or("", |a| a.req.id.as_str()), "client went away; generation cancelled");
                m::cancelled();
                s.active = None;
                s.save_to = None;
            }
        }
    }

    /// Sends micro-batches on their way while the pipeline has room for them, then lands
    /// the next one to finish. On a pipeline of depth 1 that is one whole batch per step.
    fn step(&mut self) {
        while self.flying.len() + self.landed.len() < self.pipeline.depth().max(1) {
            let Some(mb) = self.next_micro_batch() else { break };
            self.launch(mb);
            if self.pipeline.depth() <= 1 {
                break;
            }
        }
        if let Some((mb, result)) = self.next_landing() {
            self.land(mb, result);
        }
    }

    /// The next micro-batch from what is ready: a decode token of generating sequences
    /// whose last token was sampled (a share of them when several micro-batches fly: one
    /// group per place in flight), each followed by its draft tokens, then prompt tokens
    /// not yet sent, a chunk at most, within the batch's room. Its tokens join their
    /// sequences' `cached` now: positions follow on for the next micro-batch.
    fn next_micro_batch(&mut self) -> Option<MicroBatch> {
        let depth = self.pipeline.depth().max(1);
        let generating = self.slots.iter().filter(|s| s.active.as_ref().is_some_and(|a| a.pending.is_empty())).count();
        let share = generating.div_ceil(depth).max(1);
        // A sequence's decode token comes after the drafts it accepted last step when its
        // state went back to where they began (`Active::replay`): those rows count too.
        // Each sequence's rows fit (its drafts were bounded by a batch's room), but with
        // micro-batches in flight a share may gather sequences whose drafts came from
        // different batches: a sequence that would overflow waits for the next one.
        let mut rows = 0;
        let ready: Vec<usize> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.active.as_ref().filter(|a| a.next.is_some()).map(|a| (i, 1 + a.replay.len())))
            .filter(|&(_, need)| {
                let fits = rows + need <= self.max_batch;
                rows += if fits { need } else { 0 };
                fits
            })
            .map(|(i, _)| i)
            .take(share)
            .collect();
        self.propose_drafts(&ready);
        let mut mb = MicroBatch { batch: Vec::new(), ids: Vec::new(), rows: Vec::new(), n_decode: 0, slots: Vec::new(), started: Instant::now() };
        for &i in &ready {
            let s = &mut self.slots[i];
            let Some(a) = s.active.as_mut() else { continue };
            let Some(t) = a.next.take() else { continue };
            for r in a.replay.drain(..) {
                mb.batch.push(BatchToken { seq: s.seq, pos: s.cached.len() as u32, logits: false });
                mb.ids.push(r);
                mb.rows.push(Row { slot: i, wants_logits: false, drafts: 0, is_draft: false });
                s.cached.push(r);
            }
            let base = s.cached.len();
            mb.batch.push(BatchToken { seq: s.seq, pos: base as u32, logits: true });
            mb.ids.push(t);
            mb.rows.push(Row { slot: i, wants_logits: true, drafts: a.draft.len(), is_draft: false });
            for (j, &d) in a.draft.iter().enumerate() {
                mb.batch.push(BatchToken { seq: s.seq, pos: (base + 1 + j) as u32, logits: true });
                mb.ids.push(d);
                mb.rows.push(Row { slot: i, wants_logits: true, drafts: 0, is_draft: true });
            }
            // The draft joins the sequence only once verified.
            s.cached.push(t);
            mb.slots.push(i);
        }
        mb.n_decode = mb.batch.len();
        m::decode_sequence_steps(mb.slots.len());
        let mut budget = self.max_batch.saturating_sub(mb.n_decode);
        // Several prompts waiting at once (a family's questions arriving together) are cut
        // as one prompt of their total length would be, so that their pieces follow one
        // another through the ring instead of travelling as one batch that keeps every
        // other member waiting. Each sequence keeps its own chunk: a piece is never cut
        // shorter for this, the next sequence just waits for the next micro-batch.
        // (Planned only while prompts wait: most steps are decode alone.)
        let waiting: usize = if depth > 1 { self.slots.iter().filter_map(|s| s.active.as_ref()).map(|a| a.pending.len()).sum() } else { 0 };
        let mut prompt_room = if waiting > 0 { self.pipeline.prompt_chunk(waiting, self.max_batch).max(1) } else { usize::MAX };
        for (i, s) in self.slots.iter_mut().enumerate() {
            let Some(a) = s.active.as_mut() else { continue };
            if a.pending.is_empty() || budget == 0 || prompt_room == 0 {
                continue;
            }
            let mut take = a.pending.len().min(budget).min(a.chunk);
            // Rows up to where this stretch of the prompt ends: its end, or the checkpoint.
            let mut stretch = a.pending.len();
            if let Some(at) = a.next_stop() {
                // Up to the checkpoint or a block's end to keep, then nothing until it is
                // taken (on landing).
                stretch = stretch.min(at.saturating_sub(s.cached.len()));
                take = take.min(stretch);
                if take == 0 {
                    continue;
                }
            }
            // A piece cut short by the batch's room (decode rows took some) and not the
            // prompt's last: whole tiles of query rows, as a planned chunk is (ggml's
            // attention reads every cached cell for a part tile as for a whole one).
            let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
            if take < a.pending.len() && take < a.chunk && take > tile {
                take -= take % tile;
            }
            let take = no_short_rest(take, stretch, budget, tile);
            budget -= take;
            prompt_room = prompt_room.saturating_sub(take);
            for _ in 0..take {
                let t = a.pending.pop_front().expect("counted above");
                let last = a.pending.is_empty();
                mb.batch.push(BatchToken { seq: s.seq, pos: s.cached.len() as u32, logits: last });
                mb.ids.push(t);
                mb.rows.push(Row { slot: i, wants_logits: last, drafts: 0, is_draft: false });
                s.cached.push(t);
            }
            if !mb.slots.contains(&i) {
                mb.slots.push(i);
            }
        }
        if mb.batch.is_empty() {
            return None;
        }
        for &i in &mb.slots {
            self.slots[i].in_flight += 1;
        }
        Some(mb)
    }

    /// Hands a micro-batch to the pipeline: computed at once on a pipeline of depth 1,
    /// sent on its way otherwise.
    fn launch(&mut self, mb: MicroBatch) {
        if self.pipeline.depth() <= 1 {
            let result = self.pipeline.forward(&mb.batch, &mb.ids);
            self.landed.push_back((mb, result));
            return;
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        match self.pipeline.start(ticket, &mb.batch, &mb.ids) {
            Ok(()) => {
                self.flying.insert(ticket, mb);
            }
            Err(e) => self.landed.push_back((mb, Err(e))),
        }
    }

    /// The next micro-batch to finish, waiting for the pipeline if none has yet.
    fn next_landing(&mut self) -> Option<(MicroBatch, crate::Result<engine::Logits>)> {
        if let Some(l) = self.landed.pop_front() {
            return Some(l);
        }
        if self.flying.is_empty() {
            return None;
        }
        let (ticket, result) = self.pipeline.finish();
        match self.flying.remove(&ticket) {
            Some(mb) => Some((mb, result)),
            None => {
                // A pipeline that names a ticket it was never given has lost track of
                // what it holds: fail everything in flight rather than guess.
                tracing::error!(ticket, "the pipeline finished a micro-batch it was not given");
                let tickets: Vec<u64> = self.flying.keys().copied().collect();
                for t in tickets {
                    if let Some(mb) = self.flying.remove(&t) {
                        self.landed.push_back((mb, Err(crate::Error::Config("the pipeline lost track of a micro-batch".into()))));
                    }
                }
                self.landed.pop_front()
            }
        }
    }

    /// A micro-batch came back: its sequences' tokens are sampled (or, when it failed,
    /// its requests end with an error and their sequences are cleared).
    fn land(&mut self, mb: MicroBatch, result: crate::Result<engine::Logits>) {
        let took = mb.started.elapsed();
        m::step(took, mb.batch.len(), mb.n_decode);
        if mb.n_decode > 0 && result.is_ok() {
            let s = took.as_secs_f64();
            self.decode_step_s = if self.decode_step_s == 0.0 { s } else { self.decode_step_s + STEP_TIME_WEIGHT * (s - self.decode_step_s) };
        }
        // Only steps with a real prompt piece: a few rows cost as much per row as one.
        let prompt_rows = mb.batch.len() - mb.n_decode;
        if prompt_rows >= scheduler::pipelining::MIN_PROMPT_CHUNK && result.is_ok() {
            let rate = prompt_rows as f64 / took.as_secs_f64().max(1e-6);
            self.prompt_rate = if self.prompt_rate == 0.0 { rate } else { self.prompt_rate + STEP_TIME_WEIGHT * (rate - self.prompt_rate) };
            if self.unpriced > 0 {
                m::prefix_cache_restored(0, std::mem::take(&mut self.unpriced) as f64 / self.prompt_rate);
            }
        }
        for &i in &mb.slots {
            self.slots[i].in_flight -= 1;
        }
        // Logits computed from a file that changed under the step may be garbage: the
        // step's requests end unanswered rather than sample them.
        let result = match (result, self.check_files()) {
            (Ok(_), Some(why)) => Err(crate::Error::ModelChanged(why)),
            (result, _) => result,
        };
        if result.is_ok() {
            for &i in &mb.slots {
                let s = &mut self.slots[i];
                let Some(a) = s.active.as_mut() else { continue };
                if s.in_flight == 0 && a.checkpoint_at == Some(s.cached.len()) {
                    a.checkpoint_at = None;
                    self.pipeline.checkpoint_sequence(s.seq);
                    m::state_checkpoint();
                }
                self.keep_state_block(i);
            }
        }
        match result {
            Ok(logits) => {
                self.sample_landed(&mb, &logits);
                // After sampling: the first token is on its way before the rows are kept.
                for &i in &mb.slots {
                    self.prompt_landed(i);
                }
            }
            Err(e) => {
                tracing::error!("engine step failed: {e}");
                let unavailable = matches!(e, crate::Error::RingBroken(_) | crate::Error::ModelChanged(_));
                if matches!(e, crate::Error::RingBroken(_)) {
                    self.set_degraded(Some(e.to_string()));
                    self.last_recovery = Instant::now();
                }
                for &i in &mb.slots {
                    let s = &mut self.slots[i];
                    if let Some(a) = s.active.take() {
                        let event = if unavailable { Event::Unavailable(e.to_string()) } else { Event::Failed("the engine failed while generating".into()) };
                        let _ = a.req.events.send(event);
                    }
                    s.clear_on_landing = true;
                }
            }
        }
        for &i in &mb.slots {
            let s = &mut self.slots[i];
            if s.clear_on_landing && s.in_flight == 0 {
                s.clear_on_landing = false;
                self.pipeline.clear_sequence(s.seq);
                s.cached.clear();
                s.exact = 0;
                s.save_to = None;
            }
        }
    }

    /// Samples every row of a landed micro-batch that wanted logits.
    fn sample_landed(&mut self, mb: &MicroBatch, logits: &engine::Logits) {
        let mut k = 0;
        while k < logits.rows.len() {
            let row = &mb.rows[logits.rows[k]];
            debug_assert!(row.wants_logits && !row.is_draft);
            let (slot, drafts) = (row.slot, row.drafts);
            if drafts == 0 {
                self.sample(slot, logits.row(k));
            } else {
                self.verify(slot, logits, k, drafts);
            }
            k += 1 + drafts;
        }
    }

    /// Fills each speculating sequence's `draft` for this step, within the batch room left
    /// after every generating sequence's decode token, the context (the token sampled after
    /// the drafts needs a cell too) and the answer's `max_tokens`.
    fn propose_drafts(&mut self, decoding: &[usize]) {
        let Some(proposer) = self.proposer.as_mut() else { return };
        let cost = proposer.cost(self.decode_step_s);
        let replays: usize = decoding.iter().filter_map(|&i| self.slots[i].active.as_ref()).map(|a| a.replay.len()).sum();
        let mut room = self.max_batch.saturating_sub(decoding.len() + replays);
        let mut requests = Vec::new();
        for &i in decoding {
            let s = &mut self.slots[i];
            let Some(a) = s.active.as_mut() else { continue };
            a.draft.clear();
            let (Some(t), Some(d)) = (a.next, a.drafter.as_mut()) else { continue };
            let fed = s.cached.len() + a.replay.len();
            let limit = room.min(self.n_ctx.saturating_sub(fed + 2)).min(a.req.max_tokens.saturating_sub(a.generated + 1));
            let k = d.want(limit, cost);
            if k == 0 {
                continue;
            }
            room -= k;
            let mut history = Vec::with_capacity(fed + 1);
            history.extend_from_slice(&s.cached);
            history.extend_from_slice(&a.replay);
            history.push(t);
            requests.push(DraftRequest { slot: i, history, k });
        }
        if requests.is_empty() {
            return;
        }
        for (r, draft) in requests.iter().zip(proposer.propose(&requests)) {
            if let Some(a) = self.slots[r.slot].active.as_mut() {
                a.draft = draft;
            }
        }
    }

    /// Samples a speculating sequence at its decode token and each of its `n` draft
    /// tokens (logits rows `k..=k + n`), in order, keeping drafts while the sampled token
    /// equals them: the first mismatch is the sequence's next token and the rest of the
    /// draft leaves the cache.
    fn verify(&mut self, slot: usize, logits: &engine::Logits, k: usize, n: usize) {
        let draft = self.slots[slot].active.as_mut().map(|a| std::mem::take(&mut a.draft)).unwrap_or_default();
        let mut accepted = 0;
        for j in 0..=n {
            let Some(token) = self.sample(slot, logits.row(k + j)) else { break };
            if j == n || draft.get(j) != Some(&token) {
                break;
            }
            // Its K/V is in the cache already, computed in this step.
            let s = &mut self.slots[slot];
            s.cached.push(token);
            if let Some(a) = s.active.as_mut() {
                a.next = None;
            }
            accepted += 1;
        }
        let s = &mut self.slots[slot];
        if accepted < n {
            // A recurrent model's state goes back to where this step's drafts began (its
            // snapshot): the drafts it accepted are computed again before the next token.
            let kept = self.pipeline.truncate_sequence(s.seq, s.cached.len()).min(s.cached.len());
            let again = s.cached.split_off(kept);
            if let Some(a) = s.active.as_mut() {
                a.replay = again;
            }
        }
        if let Some(a) = s.active.as_mut() {
            if let Some(d) = a.drafter.as_mut() {
                d.update(n, accepted);
            }
        }
        m::speculation(n, accepted);
    }

    /// Samples the sequence's next token and sends it on; `Some(token)` when the sequence
    /// goes on (the token is its `next`), `None` when it ended or failed.
    fn sample(&mut self, slot: usize, logits: &[f32]) -> Option<i32> {
        let n_ctx = self.n_ctx;
        let tokenizer = self.tokenizer.clone();
        let s = &mut self.slots[slot];
        let a = s.active.as_mut()?;
        let now = Instant::now();
        if a.started.is_none() {
            a.started = Some(now);
            m::time_to_first_token(a.req.enqueued.elapsed());
            let _ = a.req.events.send(Event::Started { cached_tokens: a.cached_tokens });
        } else if let Some(prev) = a.last_token {
            m::time_per_output_token(now - prev);
        }
        a.last_token = Some(now);
        let token = match a.sampler.sample(logits) {
            Ok(t) => t,
            Err(e) => {
                let _ = a.req.events.send(Event::Failed(e.to_string()));
                s.active = None;
                return None;
            }
        };
        // (why it ends, whether held-back text is real output to flush)
        let end = if tokenizer.is_eog(token) {
            Some((Finish::Stop, true))
        } else {
            a.generated += 1;
            m::generated_token();
            let info = a.req.logprobs.map(|k| {
                let (lp, top) = logprobs(logits, token, k);
                let describe = |t: i32, logprob: f32| {
                    let bytes = tokenizer.token_bytes(t);
                    TokenLogprob { token: String::from_utf8_lossy(&bytes).into_owned(), bytes, logprob }
                };
                TokenInfo { logprob: describe(token, lp), top: top.into_iter().map(|(t, l)| describe(t, l)).collect() }
            });
            let piece = a.text.push(&tokenizer.token_bytes(token));
            let (text, hit) = a.stop.push(&piece);
            let _ = a.req.events.send(Event::Token { text, info });
            if hit {
                Some((a.stop.matched().map_or(Finish::Stop, Finish::StopString), false))
            } else if a.generated >= a.req.max_tokens || s.cached.len() + 1 >= n_ctx {
                Some((Finish::Length, true))
            } else {
                a.next = Some(token);
                None
            }
        };
        if end.is_none() {
            return Some(token);
        }
        if let Some((finish, flush)) = end {
            let mut a = s.active.take().expect("active above");
            if flush {
                // Text held back for a possible stop string is real output; the bytes of a
                // character that never completed are not (`TextStream::finish` drops them).
                let (mut tail, hit) = a.stop.push(&a.text.finish());
                if !hit {
                    tail.push_str(&a.stop.finish());
                }
                if !tail.is_empty() {
                    let _ = a.req.events.send(Event::Token { text: tail, info: None });
                }
            }
            let _ = a.req.events.send(Event::Done { finish, completion_tokens: a.generated });
            tracing::info!(
                request = %a.req.id,
                prompt_tokens = a.prompt_tokens,
                cached_tokens = a.cached_tokens,
                completion_tokens = a.generated,
                finish = ?finish,
                ttft_ms = a.started.map_or(0, |t| (t - a.req.enqueued).as_millis() as u64),
                total_ms = a.req.enqueued.elapsed().as_millis() as u64,
                "sequence done"
            );
        }
        None
    }

    fn report_usage(&self) {
        let running = self.slots.iter().filter(|s| s.active.is_some()).count();
        let cells: usize = self.slots.iter().map(|s| s.cached.len()).sum();
        m::running(running);
        m::kv_usage(cells as f64 / (self.slots.len() * self.n_ctx.max(1)) as f64);
    }
}

impl Drop for Loop {
    /// However the loop ends (shutdown, or a panic), requests stop being queued for it.
    fn drop(&mut self) {
        self.queue.close();
    }
}

fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::sampler::SamplingParams;
    use tokio::sync::mpsc;

    /// A model that always says the same token, a step taking a few milliseconds: its
    /// sequences run until their clients go away.
    struct Endless {
        n_vocab: usize,
        say: usize,
    }

    const STEP: Duration = Duration::from_millis(2);

    impl Pipeline for Endless {
        fn forward(&mut self, batch: &[BatchToken], _: &[i32]) -> crate::Result<engine::Logits> {
            std::thread::sleep(STEP);
            let rows: Vec<usize> = batch.iter().enumerate().filter(|(_, t)| t.logits).map(|(i, _)| i).collect();
            let mut data = vec![0.0; rows.len() * self.n_vocab];
            for r in 0..rows.len() {
                data[r * self.n_vocab + self.say] = 10.0;
            }
            Ok(engine::Logits { rows, n_vocab: self.n_vocab, data })
        }
        fn clear_sequence(&mut self, _: engine::SeqId) {}
        fn truncate_sequence(&mut self, _: engine::SeqId, len: usize) -> usize {
            len
        }
        fn n_ctx_seq(&self) -> usize {
            1 << 20
        }
    }

    /// The gauges are process-wide: one of these tests at a time.
    static GAUGES: Mutex<()> = Mutex::new(());

    fn batcher(parallel: usize, queue: usize) -> Batcher {
        crate::metrics::install();
        let tokenizer = Arc::new(Tokenizer::load(crate::models::vocabulary_fixture()).unwrap());
        let say = tokenizer.tokenize("a", false)[0] as usize;
        let pipeline = Box::new(Endless { n_vocab: tokenizer.n_vocab(), say });
        Batcher::start(pipeline, tokenizer, BatcherConfig { parallel, queue, max_batch: 64, spec_tokens: 0, files: Vec::new(), prompt_cache: super::prefix_cache::PrefixCacheConfig::off(), compute: String::new() }, None)
    }

    fn request() -> (GenerationRequest, mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = mpsc::unbounded_channel();
        let req = GenerationRequest {
            id: "test".into(),
            prompt: vec![1, 2, 3],
            sampling: SamplingParams::greedy(),
            max_tokens: usize::MAX,
            stop: Vec::new(),
            logprobs: None,
            events,
            enqueued: Instant::now(),
        };
        (req, rx)
    }

    fn started(rx: &mut mpsc::UnboundedReceiver<Event>) {
        loop {
            match rx.blocking_recv() {
                Some(Event::Started { .. }) => return,
                Some(_) => {}
                None => panic!("the sequence ended before it started"),
            }
        }
    }

    fn gauge(name: &str) -> f64 {
        let text = crate::metrics::render();
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(f64::NAN)
    }

    fn wait_for_gauge(name: &str, want: f64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while gauge(name) != want {
            assert!(Instant::now() < deadline, "{name} stayed at {}, expected {want}", gauge(name));
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_client_that_went_away_frees_its_queue_place_at_once() {
        let _one = GAUGES.lock().unwrap_or_else(|e| e.into_inner());
        let b = batcher(1, 2);
        let (a, mut a_rx) = request();
        b.submit(a).unwrap();
        started(&mut a_rx);
        let (q1, q1_rx) = request();
        let (q2, q2_rx) = request();
        b.submit(q1).unwrap();
        b.submit(q2).unwrap();
        assert_eq!(b.submit(request().0), Err(SubmitError::QueueFull));
        // Both waiting clients give up while the one slot is still busy.
        drop((q1_rx, q2_rx));
        let (c, mut c_rx) = request();
        b.submit(c).unwrap();
        let (d, d_rx) = request();
        b.submit(d).unwrap();
        drop(d_rx);
        // The loop looks too, without a request arriving to a full queue.
        wait_for_gauge("hearth_queue_size", 1.0);
        drop(a_rx);
        started(&mut c_rx);
        drop(c_rx);
        wait_for_gauge("hearth_running_sequences", 0.0);
        b.shutdown();
    }

    #[test]
    fn the_running_gauge_follows_cancellations() {
        let _one = GAUGES.lock().unwrap_or_else(|e| e.into_inner());
        let b = batcher(2, 4);
        let (x, mut x_rx) = request();
        let (y, mut y_rx) = request();
        b.submit(x).unwrap();
        b.submit(y).unwrap();
        started(&mut x_rx);
        started(&mut y_rx);
        wait_for_gauge("hearth_running_sequences", 2.0);
        // Both go at once: the step after finds nothing to run, and the loop idles.
        drop((x_rx, y_rx));
        wait_for_gauge("hearth_running_sequences", 0.0);
        b.shutdown();
    }
}
