//! Stages on this machine chained in layer order: the single-node engine, and the
//! reference the distributed ring must equal. Each step runs every window from layer 0
//! to the last, handing hidden states over by value exactly as the ring does. (The
//! server's batching loop drives it through its own `Pipeline` trait, which a ring's head
//! implements too.)

use crate::kv_cache::SeqId;
use crate::op_profile::OpProfile;
use crate::reference::{argmax, Timing};
use crate::stage::{BatchToken, Logits, Stage, StageInput, StageOutput};
use crate::{Error, Result};

pub struct LocalPipeline {
    stages: Vec<Stage>,
    /// (stage, window) in layer order.
    route: Vec<(usize, usize)>,
}

impl LocalPipeline {
    /// The windows of `stages` together must cover the model's layers exactly once.
    pub fn new(stages: Vec<Stage>) -> Result<LocalPipeline> {
        let n_layer = stages.first().ok_or_else(|| Error::InvalidWindow("a pipeline needs a stage".into()))?.spec().n_layer;
        let mut route: Vec<(usize, usize, usize)> = Vec::new();
        for (si, s) in stages.iter().enumerate() {
            for (wi, w) in s.windows().iter().enumerate() {
                route.push((w.start, si, wi));
            }
        }
        route.sort_unstable();
        let mut next = 0;
        for &(start, si, wi) in &route {
            let w = &stages[si].windows()[wi];
            if start != next {
                return Err(Error::InvalidWindow(format!("windows leave layers {next}..{start} uncovered or overlap")));
            }
            next = w.end;
        }
        if next != n_layer {
            return Err(Error::InvalidWindow(format!("windows end at layer {next}, the model has {n_layer}")));
        }
        Ok(LocalPipeline { stages, route: route.into_iter().map(|(_, s, w)| (s, w)).collect() })
    }

    /// Context cells per sequence.
    pub fn n_ctx_seq(&self) -> usize {
        self.stages.first().map_or(0, |s| s.n_ctx_seq())
    }

    /// Runs `batch` (token ids in `tokens`) through every window; returns the logits of
    /// the tokens that asked for them.
    pub fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> Result<Logits> {
        let mut hidden: Option<Vec<f32>> = None;
        for &(s, w) in &self.route {
            let input = match &hidden {
                None => StageInput::Tokens(tokens),
                Some(h) => StageInput::Hidden(h),
            };
            match self.stages[s].forward(w, batch, input) {
                Ok(StageOutput::Hidden(h)) => hidden = Some(h),
                Ok(StageOutput::Logits(l)) => return Ok(l),
                Err(e) => {
                    // Windows before this one already cached the batch: undo that, so a
                    // failed step leaves every window as it was.
                    for seq in batch.iter().map(|t| t.seq) {
                        let len = batch.iter().filter(|t| t.seq == seq).map(|t| t.pos as usize).min().unwrap_or(0);
                        self.truncate_sequence(seq, len);
                    }
                    return Err(e);
                }
            }
        }
        Err(Error::InvalidWindow("the last window did not produce logits".into()))
    }

    pub fn clear_sequence(&mut self, seq: SeqId) {
        self.stages.iter_mut().for_each(|s| s.clear_sequence(seq));
    }

    /// Keeps positions [0, len) of `seq`; returns the length kept (less for a model with
    /// recurrent layers, see `Stage::truncate_sequence`).
    pub fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> usize {
        self.stages.iter_mut().map(|s| s.truncate_sequence(seq, len)).min().unwrap_or(0)
    }

    /// Gives `to` the first `len` positions of `from` (see `Stage::copy_sequence`);
    /// returns the positions copied.
    pub fn copy_sequence(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        let each: Vec<usize> = self.stages.iter_mut().map(|s| s.copy_sequence(from, to, len)).collect();
        let copied = each.iter().copied().min().unwrap_or(0);
        if each.iter().any(|&c| c > copied) {
            for s in &mut self.stages {
                s.truncate_sequence(to, copied);
            }
        }
        copied
    }

    /// What a block of rows holds (see `Stage::row_layout`), stage by stage in layer
    /// order.
    pub fn row_layout(&self) -> Option<String> {
        let parts: Vec<String> = self.stages.iter().map(Stage::row_layout).collect();
        Some(parts.join("|"))
    }

    /// Positions `[at, at + n)` of `seq`, every stage's rows one after another, each
    /// `with_state` or not (see `Stage::read_rows`): a block [`LocalPipeline::write_rows`]
    /// puts back, here or in a pipeline of the same [`LocalPipeline::row_layout`] (after a
    /// restart).
    pub fn read_rows(&self, seq: SeqId, at: usize, n: usize, with_state: bool) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        for s in &self.stages {
            out.extend_from_slice(&s.read_rows(seq, at, n, with_state)?);
        }
        Some(out)
    }

    /// Puts a block of `n` positions read by [`LocalPipeline::read_rows`] back as
    /// positions `[at, at + n)` of `seq`, which keeps its first `at` (a block of rows alone
    /// leaves a recurrent state behind: see `KvCache::write_rows`); false where it cannot,
    /// and then `seq` keeps only its first `at` positions.
    pub fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, block: &[u8]) -> bool {
        if self.sequence_len(seq) < at {
            return false;
        }
        let len = |with_state| self.stages.iter().map(|s| s.read_rows_len(n, with_state)).sum::<usize>();
        let with_state = block.len() == len(true);
        if !with_state && block.len() != len(false) {
            return false;
        }
        let sizes: Vec<usize> = self.stages.iter().map(|s| s.read_rows_len(n, with_state)).collect();
        let mut offset = 0;
        for i in 0..self.stages.len() {
            if !self.stages[i].write_rows(seq, at, n, &block[offset..offset + sizes[i]]) {
                self.truncate_sequence(seq, at);
                return false;
            }
            offset += sizes[i];
        }
        true
    }

    /// Whether the model keeps a recurrent state per sequence.
    pub fn keeps_state(&self) -> bool {
        self.stages.first().is_some_and(|s| s.spec().recurrent.is_some())
    }

    /// See `Stage::checkpoint_sequence`.
    pub fn checkpoint_sequence(&mut self, seq: SeqId) {
        self.stages.iter_mut().for_each(|s| s.checkpoint_sequence(seq));
    }

    /// Cached length of `seq` (the same in every window after a complete step).
    pub fn sequence_len(&self, seq: SeqId) -> usize {
        self.stages[self.route[0].0].sequence_len(self.route[0].1, seq)
    }

    /// Feeds `prompt` in chunks of at most `chunk` tokens and returns the logits of its
    /// last token.
    pub fn prefill(&mut self, seq: SeqId, prompt: &[i32], chunk: usize) -> Result<Vec<f32>> {
        let start = self.sequence_len(seq);
        let mut last = Vec::new();
        for (ci, part) in prompt.chunks(chunk.max(1)).enumerate() {
            let base = start + ci * chunk.max(1);
            let batch: Vec<BatchToken> = (0..part.len()).map(|i| BatchToken { seq, pos: (base + i) as u32, logits: i + 1 == part.len() }).collect();
            let logits = self.forward(&batch, part)?;
            last = logits.row(0).to_vec();
        }
        Ok(last)
    }

    /// Sequences decoding together, as a server's slots do — what
    /// [`crate::reference::Reference::decode_together`] runs in llama.cpp: prompt i goes
    /// alone into a fresh sequence i (chunks of at most `chunk`), then `n_gen - 1` greedy
    /// steps of one batch holding every sequence's next token. Returns each sequence's
    /// `n_gen` tokens and the timing (`gen_tokens` counts every sequence's decoded tokens).
    pub fn decode_together(&mut self, prompts: &[Vec<i32>], n_gen: usize, chunk: usize) -> Result<(Vec<Vec<i32>>, Timing)> {
        self.decode_together_with(prompts, n_gen, chunk, None)
    }

    /// [`Self::decode_together`], the decode steps' ops timed in `ops` (the prompts' not).
    pub fn decode_together_with(&mut self, prompts: &[Vec<i32>], n_gen: usize, chunk: usize, ops: Option<&mut OpProfile>) -> Result<(Vec<Vec<i32>>, Timing)> {
        let ops: Option<*mut OpProfile> = ops.map(|p| {
            p.record(true);
            p as *mut OpProfile
        });
        let result = self.decode_together_inner(prompts, n_gen, chunk, ops);
        self.stages.iter_mut().for_each(|s| s.set_op_profile(None));
        result
    }

    fn decode_together_inner(&mut self, prompts: &[Vec<i32>], n_gen: usize, chunk: usize, ops: Option<*mut OpProfile>) -> Result<(Vec<Vec<i32>>, Timing)> {
        let t0 = std::time::Instant::now();
        let mut out: Vec<Vec<i32>> = Vec::with_capacity(prompts.len());
        for (s, p) in prompts.iter().enumerate() {
            self.clear_sequence(s as SeqId);
            out.push(vec![argmax(&self.prefill(s as SeqId, p, chunk)?)]);
        }
        let prompt_secs = t0.elapsed().as_secs_f64();
        if ops.is_some() {
            self.stages.iter_mut().for_each(|s| s.set_op_profile(ops));
        }
        let t1 = std::time::Instant::now();
        let mut batch = Vec::with_capacity(prompts.len());
        let mut ids = Vec::with_capacity(prompts.len());
        for i in 1..n_gen {
            batch.clear();
            ids.clear();
            for (s, (o, p)) in out.iter().zip(prompts).enumerate() {
                batch.push(BatchToken { seq: s as SeqId, pos: (p.len() + i - 1) as u32, logits: true });
                ids.push(o[i - 1]);
            }
            let l = self.forward(&batch, &ids)?;
            for (s, o) in out.iter_mut().enumerate() {
                o.push(argmax(l.row(s)));
            }
        }
        let timing = Timing { prompt_tokens: prompts.iter().map(Vec::len).sum(), prompt_secs, gen_tokens: n_gen.saturating_sub(1) * prompts.len(), gen_secs: t1.elapsed().as_secs_f64() };
        Ok((out, timing))
    }

    /// Greedy continuation of `prompt` in a fresh sequence `seq`: `n` tokens.
    pub fn greedy(&mut self, seq: SeqId, prompt: &[i32], n: usize, chunk: usize) -> Result<Vec<i32>> {
        self.clear_sequence(seq);
        let mut logits = self.prefill(seq, prompt, chunk)?;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let next = argmax(&logits);
            out.push(next);
            if out.len() < n {
                let pos = (prompt.len() + out.len() - 1) as u32;
                logits = self.forward(&[BatchToken { seq, pos, logits: true }], &[next])?.row(0).to_vec();
            }
        }
        Ok(out)
    }
}
