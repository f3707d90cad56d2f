//! A pipeline with no model behind it, for testing the batching loop in milliseconds: its
//! logits follow a script (the next token as a function of the sequence so far), it keeps
//! its own idea of every sequence's cache and records where the loop's batches disagree
//! with it, logs every call, and fails, recovers or reports maintenance when told to.
//! With a depth above 1 it holds micro-batches in flight like a ring (computed in the
//! order they start, finished in that order) and records any clear or truncation of a
//! sequence that still has one in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{BatchToken, Logits, SeqId};

use super::pipeline::Pipeline;
use crate::error::{Error, Result};

/// The next token of a sequence, given every token in its cache (the one just fed last).
pub type Script = Box<dyn Fn(&[i32]) -> i32 + Send>;

/// How a scripted step fails.
#[derive(Debug, Clone)]
pub enum Failure {
    /// A ring member is lost.
    Ring(String),
    /// This machine's engine failed.
    Local(String),
}

/// What the loop did to the pipeline, for the test to inspect.
#[derive(Debug, Default)]
pub struct Log {
    /// Every batch, as (sequence, position, wants logits, token).
    pub batches: Vec<Vec<(SeqId, u32, bool, i32)>>,
    pub truncates: Vec<(SeqId, usize)>,
    /// Every prefix copy, as (from, to, positions copied).
    pub copies: Vec<(SeqId, SeqId, usize)>,
    /// Every block of rows read for the prompt cache, as (sequence, at, positions).
    pub reads: Vec<(SeqId, usize, usize)>,
    /// Every block of rows written back, as (sequence, at, positions).
    pub writes: Vec<(SeqId, usize, usize)>,
    /// With a state: where each block read with the state ends, and each one written back.
    pub state_reads: Vec<usize>,
    pub state_writes: Vec<usize>,
    pub clears: Vec<SeqId>,
    /// Every state checkpoint, as (sequence, length).
    pub checkpoints: Vec<(SeqId, usize)>,
    pub recovers: usize,
    pub idles: usize,
    /// The most micro-batches that were in flight at once.
    pub max_in_flight: usize,
    /// Where a batch did not continue the cache the pipeline holds: must stay empty.
    pub violations: Vec<String>,
}

/// Knobs the test turns while the loop runs.
#[derive(Default)]
pub struct Controls {
    /// Failures for the next steps, in order (`None`: that step succeeds).
    pub failures: VecDeque<Option<Failure>>,
    /// How many `recover` calls fail before one succeeds.
    pub recover_failures: usize,
    /// The next `idle` call answers `Ok(true)` (every cache emptied).
    pub idle_empties: bool,
    /// Writes of rows at these positions fail (each once) as a ring member's missing part
    /// does: the sequence keeps its first `at` positions (none with a recurrent state).
    pub lost_rows: Vec<usize>,
}

pub struct Scripted {
    n_vocab: usize,
    n_ctx: usize,
    script: Script,
    delay: Duration,
    cache: HashMap<SeqId, Vec<i32>>,
    broken: bool,
    depth: usize,
    /// Fewest tokens in a prompt chunk when micro-batches fly (as the planner's floor).
    shortest_chunk: usize,
    /// Sequences a failed step left with a gap: micro-batches of them already in flight
    /// compute on anyway (as on a real ring) until the loop clears them.
    failed: std::collections::HashSet<SeqId>,
    /// Micro-batches in flight: ticket, their sequences, and their result.
    flying: VecDeque<(u64, Vec<SeqId>, Result<Logits>)>,
    /// Like a model with a recurrent state under speculation (Qwen3.5): per sequence, the
    /// length after the first row wanting logits of its last batch with drafts, the only
    /// point a truncation can go back to (else to nothing). None: truncation is exact.
    snapshots: Option<HashMap<SeqId, usize>>,
    /// Batches past this many rows are violations.
    max_batch: Option<usize>,
    /// Whether it reads and writes rows for the prompt cache: a row is its token's 4 bytes.
    rows: bool,
    /// Like a model keeping a recurrent state (Qwen3.5): per sequence, the lengths it was
    /// checkpointed at, the only points a truncation goes back to (else to nothing), and
    /// rows read with the state only where they end the sequence. None: truncation is exact.
    checkpoints: Option<HashMap<SeqId, Vec<usize>>>,
    /// With a state: sequences whose last block written back held rows alone, so their
    /// state is not where they end (computing on or reading one is a violation).
    stale: std::collections::HashSet<SeqId>,
    pub log: Arc<Mutex<Log>>,
    pub controls: Arc<Mutex<Controls>>,
}

/// Fewest tokens in a prompt chunk when micro-batches fly.
const SHORTEST_CHUNK: usize = 4;
/// The logit of the scripted token; every other token gets 0.
const SCRIPTED_LOGIT: f32 = 10.0;

/// A scripted sequence's "state" after `tokens`: what a block read with the state carries,
/// checked when it is written back.
fn state_of(tokens: &[i32]) -> [u8; 8] {
    // FNV-1a: any change of a token changes it.
    tokens.iter().flat_map(|t| t.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)).to_le_bytes()
}

impl Scripted {
    pub fn new(n_vocab: usize, n_ctx: usize, script: Script) -> Scripted {
        Scripted { n_vocab, n_ctx, script, delay: Duration::ZERO, cache: HashMap::new(), broken: false, depth: 1, shortest_chunk: SHORTEST_CHUNK, failed: Default::default(), flying: VecDeque::new(), snapshots: None, max_batch: None, rows: false, checkpoints: None, stale: Default::default(), log: Arc::default(), controls: Arc::default() }
    }

    /// Truncates as a model keeping a recurrent state does under speculation: only back
    /// to where the last batch's drafts began (see `snapshots`).
    pub fn with_draft_snapshots(mut self) -> Scripted {
        self.snapshots = Some(HashMap::new());
        self
    }

    /// Keeps a state as a recurrent model does (see `checkpoints`).
    pub fn with_state(mut self) -> Scripted {
        self.checkpoints = Some(HashMap::new());
        self
    }

    /// Records a batch of more than `rows` rows as a violation.
    pub fn with_max_batch(mut self, rows: usize) -> Scripted {
        self.max_batch = Some(rows);
        self
    }

    /// Reads and writes rows for the prompt cache (a row is its token's bytes).
    pub fn with_rows(mut self) -> Scripted {
        self.rows = true;
        self
    }

    /// Holds up to `depth` micro-batches in flight.
    pub fn with_depth(mut self, depth: usize) -> Scripted {
        self.depth = depth;
        self
    }

    /// Cuts no prompt chunk shorter than `tokens` (a shorter prompt goes whole), as the
    /// planner's `MIN_PROMPT_CHUNK` does.
    pub fn with_shortest_chunk(mut self, tokens: usize) -> Scripted {
        self.shortest_chunk = tokens;
        self
    }

    /// A clear or truncation must wait until nothing of the sequence is in flight.
    fn touch(&self, seq: SeqId, what: &str) {
        if self.flying.iter().any(|(_, seqs, _)| seqs.contains(&seq)) {
            self.violation(format!("sequence {seq} {what} while a micro-batch of it was in flight"));
        }
    }

    /// Each step takes this long (so a test can act while sequences run).
    pub fn with_delay(mut self, delay: Duration) -> Scripted {
        self.delay = delay;
        self
    }

    fn violation(&self, v: String) {
        self.log.lock().unwrap().violations.push(v);
    }
}

impl Pipeline for Scripted {
    fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> Result<Logits> {
        std::thread::sleep(self.delay);
        self.log.lock().unwrap().batches.push(batch.iter().zip(tokens).map(|(t, &id)| (t.seq, t.pos, t.logits, id)).collect());
        if batch.len() != tokens.len() {
            self.violation(format!("{} batch rows for {} tokens", batch.len(), tokens.len()));
        }
        if let Some(max) = self.max_batch.filter(|&m| batch.len() > m) {
            self.violation(format!("a batch of {} rows past the most, {max}", batch.len()));
        }
        if let Some(snaps) = self.snapshots.as_mut() {
            let mut seqs: Vec<SeqId> = batch.iter().map(|t| t.seq).collect();
            seqs.dedup();
            for seq in seqs {
                let wanting: Vec<u32> = batch.iter().filter(|t| t.seq == seq && t.logits).map(|t| t.pos).collect();
                if wanting.len() > 1 {
                    snaps.insert(seq, wanting[0] as usize + 1);
                }
            }
        }
        if self.broken {
            return Err(Error::RingBroken("the ring is broken".into()));
        }
        match self.controls.lock().unwrap().failures.pop_front().flatten() {
            Some(Failure::Ring(why)) => {
                self.broken = true;
                return Err(Error::RingBroken(why));
            }
            Some(Failure::Local(why)) => {
                self.failed.extend(batch.iter().map(|t| t.seq));
                return Err(Error::Engine(engine::Error::Ggml(why)));
            }
            None => {}
        }
        for seq in batch.iter().map(|t| t.seq).filter(|s| self.stale.contains(s)).collect::<std::collections::BTreeSet<_>>() {
            self.violation(format!("sequence {seq} computed on a state its rows written alone left behind"));
        }
        let mut rows = Vec::new();
        let mut data = Vec::new();
        for (i, (t, &id)) in batch.iter().zip(tokens).enumerate() {
            let cache = self.cache.entry(t.seq).or_default();
            if t.pos as usize != cache.len() && !self.failed.contains(&t.seq) {
                let v = format!("sequence {} fed position {} but holds {} tokens", t.seq, t.pos, cache.len());
                self.violation(v);
                let cache = self.cache.entry(t.seq).or_default();
                cache.truncate(t.pos as usize);
            }
            let cache = self.cache.entry(t.seq).or_default();
            cache.push(id);
            if cache.len() > self.n_ctx {
                let v = format!("sequence {} grew past the context ({} cells)", t.seq, self.n_ctx);
                self.violation(v);
            }
            if t.logits {
                let next = (self.script)(&self.cache[&t.seq]);
                let mut row = vec![0.0; self.n_vocab];
                row[next as usize] = SCRIPTED_LOGIT;
                rows.push(i);
                data.extend_from_slice(&row);
            }
        }
        Ok(Logits { rows, n_vocab: self.n_vocab, data })
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn prompt_chunk(&self, prompt: usize, max_batch: usize) -> usize {
        // Several chunks per long prompt when micro-batches fly, so they overlap; a short
        // prompt goes whole.
        if self.depth > 1 {
            prompt.div_ceil(self.depth * 2).max(self.shortest_chunk).min(max_batch)
        } else {
            max_batch
        }
    }

    fn start(&mut self, ticket: u64, batch: &[BatchToken], tokens: &[i32]) -> Result<()> {
        if self.flying.len() >= self.depth {
            self.violation(format!("{} micro-batches in flight on a pipeline of depth {}", self.flying.len() + 1, self.depth));
        }
        let seqs = batch.iter().map(|t| t.seq).collect();
        let result = self.forward(batch, tokens);
        self.flying.push_back((ticket, seqs, result));
        let mut log = self.log.lock().unwrap();
        log.max_in_flight = log.max_in_flight.max(self.flying.len());
        Ok(())
    }

    fn finish(&mut self) -> (u64, Result<Logits>) {
        match self.flying.pop_front() {
            Some((ticket, _, result)) => (ticket, result),
            None => {
                self.violation("finish with nothing in flight".into());
                (u64::MAX, Err(Error::Config("nothing in flight".into())))
            }
        }
    }

    fn clear_sequence(&mut self, seq: SeqId) {
        self.touch(seq, "cleared");
        self.failed.remove(&seq);
        self.cache.remove(&seq);
        self.stale.remove(&seq);
        if let Some(snaps) = self.snapshots.as_mut() {
            snaps.remove(&seq);
        }
        if let Some(cps) = self.checkpoints.as_mut() {
            cps.remove(&seq);
        }
        self.log.lock().unwrap().clears.push(seq);
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> usize {
        self.touch(seq, "truncated");
        let cache = self.cache.entry(seq).or_default();
        if len > cache.len() {
            let v = format!("sequence {seq} truncated to {len} but holds {} tokens", cache.len());
            self.violation(v);
        }
        let held = self.cache.get(&seq).map_or(0, Vec::len);
        let kept = match self.snapshots.as_mut() {
            Some(snaps) if len < held => {
                let at = snaps.get(&seq).copied().filter(|&at| at <= len).unwrap_or(0);
                if at == 0 {
                    snaps.remove(&seq);
                }
                at
            }
            _ => match self.checkpoints.as_mut() {
                Some(cps) if len < held => {
                    let list = cps.entry(seq).or_default();
                    list.retain(|&at| at <= len);
                    // Back to a checkpoint's state (or none): a state where it ends.
                    self.stale.remove(&seq);
                    list.last().copied().unwrap_or(0)
                }
                _ => len,
            },
        };
        self.cache.entry(seq).or_default().truncate(kept);
        self.log.lock().unwrap().truncates.push((seq, len));
        self.cache[&seq].len()
    }

    fn copy_sequence(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        self.touch(from, "copied from");
        self.touch(to, "copied to");
        // As the engine: nothing for a model with a recurrent state.
        if self.snapshots.is_some() {
            return 0;
        }
        let Some(src) = self.cache.get(&from) else { return 0 };
        let copied = len.min(src.len());
        let prefix = src[..copied].to_vec();
        self.cache.insert(to, prefix);
        self.failed.remove(&to);
        self.log.lock().unwrap().copies.push((from, to, copied));
        copied
    }

    fn row_layout(&self) -> Option<String> {
        self.rows.then(|| "scripted tokens".to_string())
    }

    fn read_rows(&mut self, seq: SeqId, at: usize, n: usize, _key: &super::prefix_cache::BlockId, with_state: bool) -> Option<Vec<u8>> {
        self.touch(seq, "read");
        let with_state = with_state && self.checkpoints.is_some();
        let held = self.cache.get(&seq)?;
        // As the engine: a model with a recurrent state has it only at the sequence's end.
        if !self.rows || at + n > held.len() || (with_state && (at + n != held.len() || self.stale.contains(&seq))) {
            self.violation(format!("rows {at}..{} of sequence {seq} read (with the state: {with_state}), which holds {}", at + n, held.len()));
            return None;
        }
        let mut block: Vec<u8> = held[at..at + n].iter().flat_map(|t| t.to_le_bytes()).collect();
        if with_state {
            block.extend_from_slice(&state_of(held));
        }
        let mut log = self.log.lock().unwrap();
        log.reads.push((seq, at, n));
        if with_state {
            log.state_reads.push(at + n);
        }
        Some(block)
    }

    fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, _key: &super::prefix_cache::BlockId, block: &[u8]) -> std::result::Result<(), usize> {
        self.touch(seq, "written");
        let stateful = self.checkpoints.is_some();
        let with_state = stateful && block.len() == 4 * n + 8;
        let cache = self.cache.entry(seq).or_default();
        if at > cache.len() || (block.len() != 4 * n && !with_state) {
            let (v, kept) = (format!("a block of {} bytes written as rows {at}..{} of sequence {seq}, which holds {}", block.len(), at + n, cache.len()), cache.len().min(at));
            self.violation(v);
            return Err(kept);
        }
        let mut controls = self.controls.lock().unwrap();
        if let Some(i) = controls.lost_rows.iter().position(|&p| p == at) {
            controls.lost_rows.remove(i);
            // As a ring does: a recurrent model's sequence starts over.
            let kept = if stateful { 0 } else { at };
            cache.truncate(kept);
            if stateful {
                self.stale.remove(&seq);
            }
            return Err(kept);
        }
        drop(controls);
        cache.truncate(at);
        cache.extend(block[..4 * n].chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes"))));
        if with_state {
            if block[4 * n..] != state_of(cache) {
                let v = format!("a state written at {} of sequence {seq} that is not the state of its tokens", at + n);
                self.violation(v);
            }
            self.stale.remove(&seq);
        } else if stateful {
            self.stale.insert(seq);
        }
        if let Some(list) = self.checkpoints.as_mut().and_then(|cps| cps.get_mut(&seq)) {
            list.retain(|&c| c <= at);
        }
        self.failed.remove(&seq);
        let mut log = self.log.lock().unwrap();
        log.writes.push((seq, at, n));
        if with_state {
            log.state_writes.push(at + n);
        }
        Ok(())
    }

    fn n_ctx_seq(&self) -> usize {
        self.n_ctx
    }

    fn keeps_state(&self) -> bool {
        self.checkpoints.is_some()
    }

    fn checkpoint_sequence(&mut self, seq: SeqId) {
        let len = self.cache.get(&seq).map_or(0, Vec::len);
        if let Some(cps) = self.checkpoints.as_mut() {
            let list = cps.entry(seq).or_default();
            list.retain(|&c| c < len);
            list.push(len);
        }
        self.log.lock().unwrap().checkpoints.push((seq, len));
    }

    fn recover(&mut self) -> Result<bool> {
        self.log.lock().unwrap().recovers += 1;
        if !self.broken {
            return Ok(false);
        }
        let mut c = self.controls.lock().unwrap();
        if c.recover_failures > 0 {
            c.recover_failures -= 1;
            return Err(Error::RingBroken("still unreachable".into()));
        }
        // A ring formed again starts from empty caches everywhere.
        self.broken = false;
        self.cache.clear();
        if let Some(cps) = self.checkpoints.as_mut() {
            cps.clear();
        }
        if let Some(snaps) = self.snapshots.as_mut() {
            snaps.clear();
        }
        Ok(true)
    }

    fn idle(&mut self, _: Duration) -> Result<bool> {
        self.log.lock().unwrap().idles += 1;
        let mut c = self.controls.lock().unwrap();
        if std::mem::take(&mut c.idle_empties) {
            self.cache.clear();
            if let Some(cps) = self.checkpoints.as_mut() {
                cps.clear();
            }
            return Ok(true);
        }
        Ok(false)
    }
}
