//! Speculative decoding: draft tokens proposed for each sequence, all verified by the
//! target in one pass through the pipeline (one trip round the ring).
//!
//! - `ngram` (prompt lookup): the tokens that followed the latest earlier occurrence of a
//!   sequence's last few tokens. Code, quotes and answers that repeat their sources accept
//!   long runs.
//! - `draft` (`--draft-model`): a small model with the same vocabulary, run whole on the
//!   head with its own KV cache, proposes its greedy continuation.
//!
//! A sequence whose drafts keep failing drafts fewer tokens ([`Drafter`]).
//!
//! Exactness: the batcher samples each verified position in order with the sequence's own
//! sampler and keeps a draft token only when the sampled token equals it. Both proposers
//! are deterministic given the sequence (q puts probability 1 on one token), so keeping
//! it with probability min(1, p/q) = p(token) and otherwise sampling the normalised
//! residual (p without that token) — the standard speculative sampling rule for such a q —
//! is exactly "sample, compare": the output distribution is the target's, greedy or not.

/// The longest suffix looked up, and the shortest: a 1-token match proposes too often to
/// be worth the batch space.
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;
/// Draft length a sequence starts with (grows when drafts are accepted whole).
const INITIAL_TOKENS: usize = 4;

/// A sequence's acceptance estimate before it has drafted: optimistic enough to try.
const INITIAL_ACCEPTANCE: f64 = 0.5;
/// Weight of the latest step in the acceptance estimate: a few failures are enough to
/// stop paying for drafts.
const ACCEPTANCE_WEIGHT: f64 = 0.5;
/// What verifying one more draft token adds to a step, as a share of the step: a batch
/// row is cheap next to a ring traversal, not free.
const VERIFY_COST: f64 = 0.05;
/// A sequence that stopped drafting (drafts cost more than they save) tries one draft
/// token again after this many steps, so a text that turns repetitive is noticed; each
/// probe that fails doubles the wait, up to `PROBE_MAX_GAP` (a probe is not free: the
/// draft model first catches up with every token since the last one).
const PROBE_EVERY: usize = 16;
const PROBE_MAX_GAP: usize = 256;

/// One sequence's drafting: how many tokens to propose next, from how its drafts did and
/// what a draft token costs.
#[derive(Debug, Clone)]
pub struct Drafter {
    /// Draft length for free drafts (lookup): doubles on a whole accepted draft.
    k: usize,
    max: usize,
    /// Estimated chance that a draft token is accepted once the ones before it were.
    acceptance: f64,
    /// Steps since this sequence last drafted, while drafting does not pay.
    paused: usize,
    /// Steps between probes now, and whether the draft being verified is one.
    probe_gap: usize,
    probing: bool,
}

impl Drafter {
    /// `max`: `--spec-tokens`, the most tokens proposed in one step.
    pub fn new(max: usize) -> Drafter {
        Drafter { k: INITIAL_TOKENS.min(max).max(1), max: max.max(1), acceptance: INITIAL_ACCEPTANCE, paused: 0, probe_gap: PROBE_EVERY, probing: false }
    }

    /// How many tokens to propose now, at most `limit`. `cost`: one draft token's time
    /// over one verification step's (0 for lookup drafts, which cost nothing to make).
    ///
    /// Free drafts follow the last outcome (double after a whole accepted draft, else what
    /// was accepted plus one): a rejected token only takes a batch row. Costly drafts take
    /// the length that maximises the expected tokens per unit of time,
    /// (1 + a + … + a^k) / (1 + k·(cost + VERIFY_COST)) for acceptance a, which is 0 when drafting does
    /// not pay; then the sequence drafts one token every `PROBE_EVERY` steps to notice when
    /// it would.
    pub fn want(&mut self, limit: usize, cost: f64) -> usize {
        let k = if cost <= 0.0 {
            self.k
        } else {
            let a = self.acceptance;
            let mut best = (0, 1.0);
            let mut expected = 1.0;
            for k in 1..=self.max {
                expected += a.powi(k as i32);
                let rate = expected / (1.0 + k as f64 * (cost + VERIFY_COST));
                if rate > best.1 {
                    best = (k, rate);
                }
            }
            if best.0 == 0 {
                self.paused += 1;
                if self.paused < self.probe_gap {
                    return 0;
                }
                self.probing = true;
                1
            } else {
                best.0
            }
        };
        self.paused = 0;
        k.min(limit)
    }

    /// `accepted` of `proposed` draft tokens were kept (verification stops at the first
    /// rejection).
    pub fn update(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.k = if accepted == proposed { (self.k * 2).min(self.max) } else { (accepted + 1).min(self.max) };
        // Each kept token was a success, the rejection (if any) one failure.
        let observed = accepted as f64 / (accepted + usize::from(accepted < proposed)) as f64;
        self.acceptance += ACCEPTANCE_WEIGHT * (observed - self.acceptance);
        if std::mem::take(&mut self.probing) {
            self.probe_gap = if accepted == 0 { (self.probe_gap * 2).min(PROBE_MAX_GAP) } else { PROBE_EVERY };
        }
    }

    #[cfg(test)]
    fn tokens(&self) -> usize {
        self.k
    }
}

/// One sequence's ask: `k` tokens after `history` (every token of the sequence so far, the
/// last one included), for the sequence in batcher slot `slot`.
pub struct DraftRequest {
    pub slot: usize,
    pub history: Vec<i32>,
    pub k: usize,
}

/// Where drafts come from.
pub enum Proposer {
    Ngram,
    Model(Box<DraftModel>),
}

impl Proposer {
    /// One draft token's time over one verification step's (`step_s`): what `Drafter::want`
    /// weighs drafts against.
    pub fn cost(&self, step_s: f64) -> f64 {
        match self {
            Proposer::Ngram => 0.0,
            Proposer::Model(m) if step_s > 0.0 => m.token_s / step_s,
            Proposer::Model(_) => 0.0,
        }
    }

    /// Drafts for every request, in order (each at most its `k`, possibly empty). A draft
    /// model that fails proposes nothing this step: speculation only ever saves time.
    pub fn propose(&mut self, requests: &[DraftRequest]) -> Vec<Vec<i32>> {
        match self {
            Proposer::Ngram => requests.iter().map(|r| lookup(&r.history, r.k)).collect(),
            Proposer::Model(m) => m.propose_timed(requests).unwrap_or_else(|e| {
                tracing::warn!("the draft model failed, no drafts this step: {e}");
                m.forget();
                requests.iter().map(|_| Vec::new()).collect()
            }),
        }
    }
}

/// A draft model on the head: one stage with every layer, a cache per batcher slot, kept
/// in step with each sequence lazily (what it has seen is compared with the sequence's
/// history each time, and only the difference is fed).
pub struct DraftModel {
    stage: engine::Stage,
    /// Tokens whose K/V the draft cache holds, per slot.
    cached: Vec<Vec<i32>>,
    max_batch: usize,
    /// Seconds per proposed draft token (catching up included), a running mean.
    token_s: f64,
}

/// Weight of the latest step in the draft model's time per token.
const TIME_WEIGHT: f64 = 0.2;
/// Tokens a drafting sequence's cache is behind at each step: the decode token, and the
/// bonus token after a wholly accepted draft.
const STEADY_CATCH_UP: usize = 2;

impl DraftModel {
    /// Loads `path` for `n_seq` slots of `n_ctx` tokens. Refuses a model whose vocabulary
    /// differs from the target's (`target`): its token ids would mean other text.
    pub fn load(path: &std::path::Path, target: &engine::tokenizer::Tokenizer, n_seq: usize, n_ctx: usize, max_batch: usize, threads: usize) -> crate::Result<DraftModel> {
        use crate::Error;
        let file = engine::ModelFile::open(path).map_err(|e| Error::Config(format!("draft model {}: {e}", path.display())))?;
        let tokenizer = engine::tokenizer::Tokenizer::load(path).map_err(|e| Error::Config(format!("draft model {}: {e}", path.display())))?;
        let (n_draft, n_target) = (tokenizer.n_vocab(), target.n_vocab());
        if n_draft != n_target {
            return Err(Error::Config(format!("the draft model {} has a vocabulary of {n_draft} tokens, the served model {n_target}: they must share one", path.display())));
        }
        if let Some(t) = (0..n_target as i32).find(|&t| tokenizer.token_bytes(t) != target.token_bytes(t)) {
            return Err(Error::Config(format!("the draft model {} has another vocabulary: token {t} is {:?} there, {:?} in the served model", path.display(), String::from_utf8_lossy(&tokenizer.token_bytes(t)), String::from_utf8_lossy(&target.token_bytes(t)))));
        }
        let spec = file.spec.clone();
        let cfg = engine::StageConfig { n_seq, n_ctx_seq: n_ctx, max_batch, threads, ..engine::StageConfig::whole(&spec) };
        let stage = engine::Stage::new(std::sync::Arc::new(file), cfg).map_err(|e| Error::Config(format!("draft model {}: {e}", path.display())))?;
        Ok(DraftModel { stage, cached: vec![Vec::new(); n_seq], max_batch: max_batch.max(1), token_s: 0.0 })
    }

    /// After a failure nothing cached can be trusted.
    fn forget(&mut self) {
        self.stage.clear_all();
        self.cached.iter_mut().for_each(Vec::clear);
    }

    fn propose_timed(&mut self, requests: &[DraftRequest]) -> engine::Result<Vec<Vec<i32>>> {
        let started = std::time::Instant::now();
        // A long catch-up (a new prompt, a sequence that paused drafting) is not what a
        // draft token costs while a sequence drafts step after step: not timed.
        let behind = requests.iter().map(|r| r.history.len() - common_prefix(&self.cached[r.slot], &r.history)).max().unwrap_or(0);
        let drafts = self.propose(requests)?;
        let tokens: usize = drafts.iter().map(Vec::len).sum();
        if tokens > 0 && behind <= STEADY_CATCH_UP {
            let per_token = started.elapsed().as_secs_f64() / tokens as f64;
            self.token_s = if self.token_s == 0.0 { per_token } else { self.token_s + TIME_WEIGHT * (per_token - self.token_s) };
        }
        Ok(drafts)
    }

    fn propose(&mut self, requests: &[DraftRequest]) -> engine::Result<Vec<Vec<i32>>> {
        use engine::{BatchToken, StageInput, StageOutput};
        let mut out: Vec<Vec<i32>> = requests.iter().map(|_| Vec::new()).collect();
        // Catch up with each sequence (one at a time: after its first step a sequence is
        // only a few tokens behind) and take the first draft token from its last logits.
        for (i, r) in requests.iter().enumerate() {
            if r.k == 0 || r.history.is_empty() {
                continue;
            }
            let seq = r.slot as engine::SeqId;
            let cached = &mut self.cached[r.slot];
            // Refeed at least the last token: its logits give the first draft. A draft
            // model with recurrent layers goes back only to its checkpoint (taken below).
            let keep = common_prefix(cached, &r.history).min(r.history.len() - 1);
            let keep = self.stage.truncate_sequence(seq, keep).min(keep);
            cached.truncate(keep);
            let todo = &r.history[keep..];
            for (c, chunk) in todo.chunks(self.max_batch).enumerate() {
                let start = keep + c * self.max_batch;
                let last_chunk = start + chunk.len() == r.history.len();
                let batch: Vec<BatchToken> = (0..chunk.len()).map(|j| BatchToken { seq, pos: (start + j) as u32, logits: last_chunk && j + 1 == chunk.len() }).collect();
                let result = self.stage.forward(0, &batch, StageInput::Tokens(chunk));
                cached.extend_from_slice(chunk);
                if let StageOutput::Logits(l) = result? {
                    if last_chunk {
                        out[i].push(engine::reference::argmax(l.row(0)));
                    }
                }
            }
            if self.stage.spec().recurrent.is_some() {
                // The sequence's state before its drafts: where the next step comes back to
                // (a recurrent state cannot be cut back to the tokens the target kept).
                self.stage.checkpoint_sequence(seq);
            }
        }
        // Then one batch per further draft token, every sequence that wants more in it.
        loop {
            let more: Vec<usize> = (0..requests.len()).filter(|&i| !out[i].is_empty() && out[i].len() < requests[i].k).collect();
            if more.is_empty() {
                return Ok(out);
            }
            let mut batch = Vec::with_capacity(more.len());
            let mut ids = Vec::with_capacity(more.len());
            for &i in &more {
                let r = &requests[i];
                let token = *out[i].last().expect("non-empty above");
                batch.push(BatchToken { seq: r.slot as engine::SeqId, pos: self.cached[r.slot].len() as u32, logits: true });
                ids.push(token);
                self.cached[r.slot].push(token);
            }
            match self.stage.forward(0, &batch, StageInput::Tokens(&ids))? {
                StageOutput::Logits(l) => {
                    for (row, &i) in more.iter().enumerate() {
                        out[i].push(engine::reference::argmax(l.row(row)));
                    }
                }
                StageOutput::Hidden(_) => return Err(engine::Error::InvalidWindow("the draft model returned hidden states".into())),
            }
        }
    }
}

fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The `k` tokens after the most recent earlier occurrence of the longest suffix of
/// `history` (NGRAM_MAX down to NGRAM_MIN tokens) that occurred before.
pub fn lookup(history: &[i32], k: usize) -> Vec<i32> {
    if k == 0 {
        return Vec::new();
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if history.len() <= n {
            continue;
        }
        let suffix = &history[history.len() - n..];
        // Latest start first; the occurrence must end before the suffix itself starts
        // something to copy (at least one token after it).
        let found = (0..history.len() - n).rev().find(|&i| &history[i..i + n] == suffix);
        if let Some(i) = found {
            let from = i + n;
            let to = (from + k).min(history.len());
            return history[from..to].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_occurrence_of_the_longest_suffix_is_continued() {
        // ... 1 2 3 [7 8 9] ... 2 3 [5 6] ... 1 2 3 -> the 3-token suffix "1 2 3" matched at 0.
        let h = [1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 1, 2, 3];
        assert_eq!(lookup(&h, 3), vec![7, 8, 9]);
        // Only "2 3" of the tail "4 2 3" occurred before: its latest occurrence (at 6).
        let h = [1, 2, 3, 7, 2, 3, 5, 6, 4, 2, 3];
        assert_eq!(lookup(&h, 2), vec![5, 6]);
        // A draft never runs past the history.
        let h = [5, 6, 5, 6];
        assert_eq!(lookup(&h, 8), vec![5, 6]);
    }

    #[test]
    fn nothing_is_proposed_without_an_earlier_match() {
        assert!(lookup(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup(&[1, 1], 4).is_empty(), "a single token of context is too little");
        assert!(lookup(&[1, 2, 1, 2], 0).is_empty());
    }

    #[test]
    fn costly_drafts_are_made_only_while_they_pay() {
        // Always accepted, a draft token at 10% of a step: draft the most.
        let mut d = Drafter::new(8);
        for _ in 0..5 {
            let k = d.want(100, 0.1);
            d.update(k, k);
        }
        assert_eq!(d.want(100, 0.1), 8);
        assert_eq!(d.want(3, 0.1), 3, "within the room given");
        // Never accepted and as costly as the step itself: stop, but probe now and then.
        let mut d = Drafter::new(8);
        for _ in 0..10 {
            let k = d.want(100, 1.0);
            d.update(k, 0);
        }
        // The probes come after 16, 32, 64, ... steps while they fail.
        let mut probes = Vec::new();
        for step in 0..200 {
            let k = d.want(100, 1.0);
            assert!(k <= 1);
            if k == 1 {
                probes.push(step);
                d.update(1, 0);
            }
        }
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] == (2 * g[0]).min(PROBE_MAX_GAP)), "{probes:?}");
        assert!(probes.len() >= 2 && probes.len() <= 4, "{probes:?}");
        // Free drafts are always worth a try.
        assert!(d.want(100, 0.0) >= 1);
    }

    #[test]
    fn the_draft_length_follows_acceptance() {
        let mut d = Drafter::new(16);
        assert_eq!(d.tokens(), 4);
        d.update(4, 4);
        assert_eq!(d.tokens(), 8);
        d.update(8, 8);
        d.update(16, 16);
        assert_eq!(d.tokens(), 16, "capped at --spec-tokens");
        d.update(16, 2);
        assert_eq!(d.tokens(), 3);
        d.update(3, 0);
        assert_eq!(d.tokens(), 1, "failing drafts cost one token a step");
        d.update(0, 0);
        assert_eq!(d.tokens(), 1, "a step without a draft changes nothing");
        assert_eq!(Drafter::new(2).tokens(), 2);
    }
}
