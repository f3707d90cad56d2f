//! Speculative decoding without a draft model (prompt lookup, `--spec-mode ngram`): the
//! tokens that followed the latest earlier occurrence of a sequence's last few tokens are
//! proposed as its next ones, and the batch verifies them all in one pass through the
//! pipeline (one trip round the ring). Code, quotes and answers that repeat their sources
//! accept long runs; a sequence whose drafts keep failing drafts fewer tokens.
//!
//! Exactness: the batcher samples each verified position in order with the sequence's own
//! sampler and keeps a draft token only when the sampled token equals it. A lookup draft
//! is deterministic (q is one token with probability 1), so keeping it with probability
//! p(token) and otherwise taking a sample from p without it — the standard speculative
//! sampling rule for such a q — is exactly "sample, compare": the output distribution is
//! the model's, greedy or not.

/// The longest suffix looked up, and the shortest: a 1-token match proposes too often to
/// be worth the batch space.
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;
/// Draft length a sequence starts with (grows when drafts are accepted whole).
const INITIAL_TOKENS: usize = 4;

/// One sequence's drafting: how many tokens to propose next, from how its last drafts did.
#[derive(Debug, Clone)]
pub struct Drafter {
    k: usize,
    max: usize,
}

impl Drafter {
    /// `max`: `--spec-tokens`, the most tokens proposed in one step.
    pub fn new(max: usize) -> Drafter {
        Drafter { k: INITIAL_TOKENS.min(max).max(1), max: max.max(1) }
    }

    /// Up to `limit` (and the current draft length) tokens to propose after `history`
    /// (every token of the sequence so far, the last one included); none when its tail
    /// did not occur before.
    pub fn draft(&self, history: &[i32], limit: usize) -> Vec<i32> {
        lookup(history, self.k.min(limit))
    }

    /// `accepted` of `proposed` draft tokens were kept: a whole accepted draft doubles the
    /// next one, a rejection shrinks it to what was accepted plus one.
    pub fn update(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.k = if accepted == proposed { (self.k * 2).min(self.max) } else { (accepted + 1).min(self.max) };
    }

    #[cfg(test)]
    fn tokens(&self) -> usize {
        self.k
    }
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
