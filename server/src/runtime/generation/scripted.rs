//! A pipeline with no model behind it, for testing the batching loop in milliseconds: its
//! logits follow a script (the next token as a function of the sequence so far), it keeps
//! its own idea of every sequence's cache and records where the loop's batches disagree
//! with it, logs every call, and fails, recovers or reports maintenance when told to.

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
    pub clears: Vec<SeqId>,
    pub recovers: usize,
    pub idles: usize,
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
}

pub struct Scripted {
    n_vocab: usize,
    n_ctx: usize,
    script: Script,
    delay: Duration,
    cache: HashMap<SeqId, Vec<i32>>,
    broken: bool,
    pub log: Arc<Mutex<Log>>,
    pub controls: Arc<Mutex<Controls>>,
}

/// The logit of the scripted token; every other token gets 0.
const SCRIPTED_LOGIT: f32 = 10.0;

impl Scripted {
    pub fn new(n_vocab: usize, n_ctx: usize, script: Script) -> Scripted {
        Scripted { n_vocab, n_ctx, script, delay: Duration::ZERO, cache: HashMap::new(), broken: false, log: Arc::default(), controls: Arc::default() }
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
        if self.broken {
            return Err(Error::RingBroken("the ring is broken".into()));
        }
        match self.controls.lock().unwrap().failures.pop_front().flatten() {
            Some(Failure::Ring(why)) => {
                self.broken = true;
                return Err(Error::RingBroken(why));
            }
            Some(Failure::Local(why)) => return Err(Error::Engine(engine::Error::Ggml(why))),
            None => {}
        }
        let mut rows = Vec::new();
        let mut data = Vec::new();
        for (i, (t, &id)) in batch.iter().zip(tokens).enumerate() {
            let cache = self.cache.entry(t.seq).or_default();
            if t.pos as usize != cache.len() {
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

    fn clear_sequence(&mut self, seq: SeqId) {
        self.cache.remove(&seq);
        self.log.lock().unwrap().clears.push(seq);
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) {
        let cache = self.cache.entry(seq).or_default();
        if len > cache.len() {
            let v = format!("sequence {seq} truncated to {len} but holds {} tokens", cache.len());
            self.violation(v);
        }
        self.cache.entry(seq).or_default().truncate(len);
        self.log.lock().unwrap().truncates.push((seq, len));
    }

    fn n_ctx_seq(&self) -> usize {
        self.n_ctx
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
        Ok(true)
    }

    fn idle(&mut self, _: Duration) -> Result<bool> {
        self.log.lock().unwrap().idles += 1;
        let mut c = self.controls.lock().unwrap();
        if std::mem::take(&mut c.idle_empties) {
            self.cache.clear();
            return Ok(true);
        }
        Ok(false)
    }
}
