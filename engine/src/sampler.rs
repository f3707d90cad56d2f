//! Token sampling with llama.cpp's sampler chain (temperature, top-k, top-p, min-p,
//! penalties, logit bias, seed, GBNF grammar), applied to logits hearth computed.

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Sampling settings of one sequence. The defaults are llama-server's.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or below) means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: i32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables.
    pub repeat_penalty: f32,
    pub repeat_last_n: i32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: u32,
    pub logit_bias: Vec<(i32, f32)>,
    /// GBNF grammar the output must follow (root rule `root`).
    pub grammar: Option<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
            grammar: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, ..SamplingParams::default() }
    }
}

pub struct Sampler {
    /// Logit bias and penalties: they change logits before the grammar judges them.
    adjust: Option<LlamaSampler>,
    grammar: Option<LlamaSampler>,
    /// What picks the token among the candidates left: greedy, or top-k, top-p, min-p,
    /// temperature and the seeded distribution.
    pick: LlamaSampler,
    n_vocab: usize,
    /// When the chain's first step is top-k (nothing before it reads the whole
    /// distribution, and at most a logit bias changes it), only the k best logits are
    /// handed to llama.cpp: the same result without copying and sorting the whole
    /// vocabulary every token.
    prefilter: Option<usize>,
    /// The logit bias, applied here before the prefilter (as llama.cpp's sampler adds it,
    /// entry by entry in f32) instead of by `adjust`; empty when there is no prefilter.
    biases: Vec<(usize, f32)>,
    /// The biased logits when there are too many biases to merge, kept between tokens.
    biased: Vec<f32>,
    /// With a grammar: which allowed candidates can decide the token. `None`: all of them
    /// (plain temperature sampling, or top-p without top-k), and the grammar must judge the
    /// whole vocabulary.
    decisive: Option<Decisive>,
    /// The whole vocabulary's candidates, kept between tokens rather than allocated for
    /// each (590 KB for 49,152 tokens).
    candidates: Vec<LlamaTokenData>,
}

/// The allowed candidates the pick can choose from, without judging all the others: the
/// best `count` (greedy: 1; top-k: k), or, when min-p cuts first, those within `min_p_cut`
/// of the best allowed logit; every candidate the grammar did not judge is below both.
#[derive(Debug, Clone, Copy)]
struct Decisive {
    count: Option<usize>,
    /// ln(min_p), when min-p comes before anything that reads the whole distribution
    /// (top-p): it drops every candidate whose logit is below the best one's plus this.
    min_p_cut: Option<f32>,
    /// No top-k sorts the candidates before the pick: it sees them in vocabulary order.
    id_order: bool,
}

/// Margin below min-p's cut, in logits, down to which the grammar judges candidates: the
/// cut is computed here as llama.cpp does (`logit + logf(p)` in f32), and the margin makes
/// a last-bit difference harmless (min-p itself drops the extra candidates).
const MIN_P_MARGIN: f32 = 1e-3;

// SAFETY: a llama sampler is plain heap state used by one thread at a time.
unsafe impl Send for Sampler {}

/// Candidates the grammar judges first on the bounded path (or top-k's k, if more). Enough
/// that an ordinary grammar state, where the model favours what the grammar allows, is
/// settled at once; few enough to cost little. Each later round judges `GRAMMAR_ROUND_GROWTH`
/// times as many: few rounds (each visits every grammar stack again) where allowed tokens
/// are rare.
const FIRST_GRAMMAR_ROUND: usize = 32;
const GRAMMAR_ROUND_GROWTH: usize = 4;

impl Sampler {
    pub fn new(tokenizer: &Tokenizer, p: &SamplingParams) -> Result<Sampler> {
        let n_vocab = tokenizer.n_vocab();
        let mut adjust = Vec::new();
        if let Some(bad) = p.logit_bias.iter().find(|(t, _)| *t < 0 || *t as usize >= n_vocab) {
            return Err(Error::Sampler(format!("logit_bias names token {} outside the vocabulary of {n_vocab}", bad.0)));
        }
        if !p.logit_bias.is_empty() {
            let biases: Vec<LlamaLogitBias> = p.logit_bias.iter().map(|&(t, b)| LlamaLogitBias::new(LlamaToken(t), b)).collect();
            adjust.push(LlamaSampler::logit_bias(n_vocab as i32, &biases));
        }
        if p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            adjust.push(LlamaSampler::penalties(n_vocab as i32, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty));
        }
        let grammar = match &p.grammar {
            Some(g) => Some(LlamaSampler::grammar(tokenizer.llama_model(), g, "root").map_err(|e| Error::Sampler(format!("invalid grammar: {e}")))?),
            None => None,
        };
        let mut pick = Vec::new();
        if p.temperature <= 0.0 {
            pick.push(LlamaSampler::greedy());
        } else {
            if p.top_k > 0 {
                pick.push(LlamaSampler::top_k(p.top_k));
            }
            if p.top_p < 1.0 {
                pick.push(LlamaSampler::top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                pick.push(LlamaSampler::min_p(p.min_p, 1));
            }
            pick.push(LlamaSampler::temp(p.temperature));
            pick.push(LlamaSampler::dist(p.seed));
        }
        let count = if p.temperature <= 0.0 {
            Some(1)
        } else if p.top_k > 0 {
            Some(p.top_k as usize)
        } else {
            None
        };
        let min_p_cut = (p.temperature > 0.0 && p.min_p > 0.0 && p.top_p >= 1.0).then(|| p.min_p.ln());
        let decisive = (count.is_some() || min_p_cut.is_some()).then_some(Decisive { count, min_p_cut, id_order: count.is_none() });
        // A bias moves single logits: top-k of the biased logits is what the chain's top-k
        // would see. Penalties read the history and a grammar judges candidates: not plain.
        let penalties = p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        let plain = !penalties && grammar.is_none();
        let prefilter = if plain { count } else { None };
        let biases = if prefilter.is_some() { p.logit_bias.iter().map(|&(t, b)| (t as usize, b)).collect() } else { Vec::new() };
        Ok(Sampler {
            adjust: (!adjust.is_empty()).then(|| LlamaSampler::chain_simple(adjust)),
            grammar,
            pick: LlamaSampler::chain_simple(pick),
            n_vocab,
            prefilter,
            biases,
            biased: Vec::new(),
            decisive,
            candidates: Vec::new(),
        })
    }

    /// Picks the next token from one row of logits and records it (penalties, grammar).
    pub fn sample(&mut self, logits: &[f32]) -> Result<i32> {
        self.check_len(logits)?;
        let tok = match (self.grammar.is_some(), self.decisive) {
            (true, Some(d)) => self.pick_constrained(logits, d)?,
            _ => self.pick_whole(logits, false)?,
        };
        self.accept(tok);
        Ok(tok.0)
    }

    /// `sample` with llama.cpp's whole chain on every token of the vocabulary (the
    /// grammar judging each, no prefilter): what the bounded paths must agree with (tests,
    /// benchmarks).
    #[doc(hidden)]
    pub fn sample_judging_every_token(&mut self, logits: &[f32]) -> Result<i32> {
        self.check_len(logits)?;
        let tok = self.pick_whole(logits, true)?;
        self.accept(tok);
        Ok(tok.0)
    }

    fn check_len(&self, logits: &[f32]) -> Result<()> {
        if logits.len() != self.n_vocab {
            return Err(Error::Sampler(format!("{} logits for a vocabulary of {}", logits.len(), self.n_vocab)));
        }
        Ok(())
    }

    fn accept(&mut self, tok: LlamaToken) {
        for s in [self.adjust.as_mut(), self.grammar.as_mut(), Some(&mut self.pick)].into_iter().flatten() {
            s.accept(tok);
        }
    }

    /// `whole`: the whole vocabulary through the whole chain even where a prefilter would
    /// do.
    fn pick_whole(&mut self, logits: &[f32], whole: bool) -> Result<LlamaToken> {
        let prefilter = self.prefilter.filter(|&k| k < logits.len() && !whole);
        let mut arr = match prefilter {
            Some(k) => {
                let top = top_k_biased(logits, k, &self.biases, &mut self.biased);
                LlamaTokenDataArray::from_iter(top.into_iter().map(|(i, l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)), false)
            }
            None => self.whole_vocabulary(logits),
        };
        // A prefilter applied the bias already.
        let adjust = if prefilter.is_some() { None } else { self.adjust.as_mut() };
        for s in [adjust, self.grammar.as_mut(), Some(&mut self.pick)].into_iter().flatten() {
            s.apply(&mut arr);
        }
        let picked = arr.selected_token();
        if prefilter.is_none() {
            self.candidates = arr.data;
        }
        picked.ok_or_else(|| Error::Sampler("no token is allowed here (the grammar rejects every candidate)".into()))
    }

    /// Every token of the vocabulary as a candidate, in id order, in the kept buffer.
    fn whole_vocabulary(&mut self, logits: &[f32]) -> LlamaTokenDataArray {
        let mut data = std::mem::take(&mut self.candidates);
        data.clear();
        data.extend(logits.iter().enumerate().map(|(i, &l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)));
        LlamaTokenDataArray::new(data, false)
    }

    /// The grammar's cost bounded by what decides the token: the grammar judges the best
    /// candidates in rounds, best first, until the allowed ones that can decide the token
    /// are known (see `Decisive`); the pick runs on those. Judging the whole vocabulary
    /// costs the grammar's stacks times the vocabulary every token (seconds for an enum of
    /// thousands of values); a token's verdict does not depend on the other candidates, so
    /// this is the same choice: greedy takes the best allowed token; top-k (first in the
    /// pick) keeps the k best allowed, in the order its sort leaves them, with tokens the
    /// grammar rejected only ever in its tail at probability 0; min-p keeps those within
    /// its cut of the best, which are all here. (Two candidates with exactly equal logits
    /// at the k-th place may be ordered differently: llama.cpp's partial sort does not
    /// define their order either.)
    fn pick_constrained(&mut self, logits: &[f32], d: Decisive) -> Result<LlamaToken> {
        let mut arr = self.whole_vocabulary(logits);
        if let Some(adjust) = self.adjust.as_mut() {
            adjust.apply(&mut arr);
        }
        let grammar = self.grammar.as_mut().expect("a grammar on this path");
        let want = d.count.unwrap_or(usize::MAX);
        let mut allowed: Vec<LlamaTokenData> = Vec::new();
        let mut rest: &mut [LlamaTokenData] = &mut arr.data;
        let mut round = FIRST_GRAMMAR_ROUND.max(d.count.unwrap_or(0));
        while !rest.is_empty() {
            let n = round.min(rest.len());
            if n < rest.len() {
                rest.select_nth_unstable_by(n - 1, better);
            }
            let (best, tail) = rest.split_at_mut(n);
            best.sort_unstable_by(better);
            // A candidate at -inf cannot be picked; past the first one, none can.
            let live = best.iter().position(|c| c.logit() == f32::NEG_INFINITY).unwrap_or(n);
            let mut judged = LlamaTokenDataArray::new(best[..live].to_vec(), false);
            grammar.apply(&mut judged);
            allowed.extend(judged.data.into_iter().filter(|c| c.logit() != f32::NEG_INFINITY).take(want - allowed.len()));
            let lowest = best[live.saturating_sub(1)].logit();
            let below_cut = match (d.min_p_cut, allowed.first()) {
                (Some(cut), Some(top)) => lowest < top.logit() + cut - MIN_P_MARGIN,
                _ => false,
            };
            if live < n || allowed.len() >= want || below_cut {
                break;
            }
            rest = tail;
            round = round.saturating_mul(GRAMMAR_ROUND_GROWTH);
        }
        self.candidates = arr.data;
        if allowed.is_empty() {
            return Err(Error::Sampler("no token is allowed here (the grammar rejects every candidate)".into()));
        }
        let mut arr = if d.id_order {
            allowed.sort_unstable_by_key(|c| c.id().0);
            LlamaTokenDataArray::new(allowed, false)
        } else {
            // Best first, as top-k (or greedy's scan) would leave them.
            LlamaTokenDataArray::new(allowed, true)
        };
        self.pick.apply(&mut arr);
        arr.selected_token().ok_or_else(|| Error::Sampler("no token is allowed here (the grammar rejects every candidate)".into()))
    }
}

/// Candidate order: higher logit first; equal logits (-0 equal to +0, as llama.cpp's
/// comparisons have it) lower token id first, as greedy's first-maximum scan picks.
fn better(a: &LlamaTokenData, b: &LlamaTokenData) -> std::cmp::Ordering {
    (b.logit() + 0.0).total_cmp(&(a.logit() + 0.0)).then(a.id().0.cmp(&b.id().0))
}

/// GBNF for JSON following `schema` (JSON Schema as text), by llama.cpp's converter.
pub fn json_schema_grammar(schema: &str) -> Result<String> {
    llama_cpp_2::json_schema_to_grammar(schema).map_err(|e| Error::Sampler(format!("cannot turn the JSON schema into a grammar: {e}")))
}

/// Logits scanned per block by `top_k`: a block whose largest logit cannot enter the k
/// best is skipped after one vectorised max, so the scan costs a few microseconds instead
/// of a compare-and-branch per token of the vocabulary (measured: greedy with a logit
/// bias took 67 us per token of the default model's 49,152, 0.7% of a decode step).
const TOP_K_BLOCK: usize = 32;

/// The `k` largest logits, best first; ties keep the lower token id first, as llama.cpp's
/// top-k (a stable sort by logit) does.
fn top_k(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let mut top: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    let offer = |top: &mut Vec<(usize, f32)>, i: usize, l: f32| {
        if top.len() < k || l > top[top.len() - 1].1 {
            let at = top.partition_point(|&(_, x)| x >= l);
            top.insert(at, (i, l));
            top.truncate(k);
        }
    };
    let blocks = logits.chunks_exact(TOP_K_BLOCK);
    let tail = blocks.remainder();
    for (b, block) in blocks.enumerate() {
        if top.len() == k {
            // `>` as the offer compares (a NaN never enters a full top, nor lifts a max).
            let max = block.iter().fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
            if !(max > top[top.len() - 1].1) {
                continue;
            }
        }
        for (j, &l) in block.iter().enumerate() {
            offer(&mut top, b * TOP_K_BLOCK + j, l);
        }
    }
    let base = logits.len() - tail.len();
    for (j, &l) in tail.iter().enumerate() {
        offer(&mut top, base + j, l);
    }
    top
}

/// Most logit-bias entries merged into the prefilter's candidates; more than this (a
/// client suppressing a whole script, say) and the biased logits are copied whole.
const MAX_MERGED_BIASES: usize = 64;

/// `top_k` of the logits with `biases` added (entry by entry in f32, as llama.cpp's
/// logit-bias sampler adds them), without copying the logits: an unbiased token among the
/// k best is within the k + (biased tokens) best raw logits, and every biased token is a
/// candidate with its biased logit. `scratch` holds the whole biased copy when there are
/// too many biases for that.
fn top_k_biased(logits: &[f32], k: usize, biases: &[(usize, f32)], scratch: &mut Vec<f32>) -> Vec<(usize, f32)> {
    if biases.is_empty() {
        return top_k(logits, k);
    }
    if biases.len() > MAX_MERGED_BIASES {
        scratch.clear();
        scratch.extend_from_slice(logits);
        for &(t, b) in biases {
            scratch[t] += b;
        }
        return top_k(scratch, k);
    }
    let mut biased: Vec<(usize, f32)> = Vec::with_capacity(biases.len());
    for &(t, b) in biases {
        match biased.iter_mut().find(|(u, _)| *u == t) {
            Some((_, l)) => *l += b,
            None => biased.push((t, logits[t] + b)),
        }
    }
    let mut merged: Vec<(usize, f32)> = top_k(logits, k + biased.len()).into_iter().filter(|(i, _)| !biased.iter().any(|(t, _)| t == i)).collect();
    merged.extend_from_slice(&biased);
    // Best first, equal logits (-0 as +0, as the scan's comparisons have it) lower id first.
    merged.sort_by(|a, b| (b.1 + 0.0).total_cmp(&(a.1 + 0.0)).then(a.0.cmp(&b.0)));
    merged.truncate(k);
    merged
}

#[cfg(test)]
mod tests {
    use super::{Sampler, SamplingParams};
    use crate::tokenizer::Tokenizer;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::path::PathBuf;

    /// The default model's vocabulary, from the checked-in fixture (no download).
    fn tokenizer() -> Tokenizer {
        Tokenizer::load(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/smollm2-vocab.gguf")).unwrap()
    }

    /// An enum of `n` quoted values (many share prefixes), in a list: long enough to need
    /// many tokens and to pass through states where few tokens are allowed.
    fn enum_grammar(n: usize) -> String {
        let values: Vec<String> = (0..n).map(|i| format!("\"\\\"item-{i}-{}\\\"\"", ["red", "green", "blue", "über", "東京"][i % 5])).collect();
        format!("root ::= \"[\" value (\", \" value)* \"]\"\nvalue ::= {}\n", values.join(" | "))
    }

    /// Logits whose best tokens are often rejected by the grammar: random, with a few
    /// heavy favourites (what a model that ignores the grammar looks like) and, every
    /// other step, a boost for the tokens of the enum's text so both paths walk deep into
    /// the grammar.
    fn logits(rng: &mut StdRng, n_vocab: usize, boost: &[i32]) -> Vec<f32> {
        let mut l: Vec<f32> = (0..n_vocab).map(|_| rng.gen_range(-8.0..8.0)).collect();
        for _ in 0..20 {
            l[rng.gen_range(0..n_vocab)] += 12.0;
        }
        if rng.gen_bool(0.5) {
            for &t in boost {
                l[t as usize] += rng.gen_range(4.0..14.0);
            }
        }
        l
    }

    /// The bounded grammar path picks exactly what judging the whole vocabulary picks,
    /// greedy and seeded, with and without penalties and bias, over many steps.
    #[test]
    fn bounded_grammar_path_picks_what_the_whole_vocabulary_path_picks() {
        let tok = tokenizer();
        let n_vocab = tok.n_vocab();
        let grammar = enum_grammar(60);
        let boost: Vec<i32> = tok.tokenize("[\"item-17-red\", \"item-23-東京\", \"item-4-über\", \"item-59-blue\"]", false);
        let cases = [
            SamplingParams { grammar: Some(grammar.clone()), ..SamplingParams::greedy() },
            SamplingParams { grammar: Some(grammar.clone()), seed: 7, ..SamplingParams::default() },
            SamplingParams { grammar: Some(grammar.clone()), seed: 11, top_k: 200, top_p: 1.0, min_p: 0.0, temperature: 1.5, ..SamplingParams::default() },
            SamplingParams { grammar: Some(grammar.clone()), seed: 3, top_k: 5, repeat_penalty: 1.3, frequency_penalty: 0.5, logit_bias: vec![(boost[1], 3.0), (boost[2], -100.0)], ..SamplingParams::default() },
            SamplingParams { grammar: Some(grammar.clone()), repeat_penalty: 1.2, presence_penalty: 0.7, ..SamplingParams::greedy() },
            // hearth's defaults for OpenAI requests: top-k 40, then min-p cuts.
            SamplingParams { grammar: Some(grammar.clone()), seed: 5, temperature: 1.0, top_p: 1.0, ..SamplingParams::default() },
            SamplingParams { grammar: Some(grammar.clone()), seed: 9, temperature: 0.7, top_p: 1.0, min_p: 0.3, top_k: 3, ..SamplingParams::default() },
            // No top-k: min-p sees the candidates in vocabulary order.
            SamplingParams { grammar: Some(grammar.clone()), seed: 13, temperature: 1.2, top_k: 0, top_p: 1.0, min_p: 0.02, ..SamplingParams::default() },
        ];
        let mut rng = StdRng::seed_from_u64(42);
        for p in &cases {
            let (mut fast, mut whole) = (Sampler::new(&tok, p).unwrap(), Sampler::new(&tok, p).unwrap());
            let mut steps = 0;
            let mut ended = 0;
            while steps < 150 {
                let l = logits(&mut rng, n_vocab, &boost);
                let a = fast.sample(&l).unwrap();
                let b = whole.sample_judging_every_token(&l).unwrap();
                assert_eq!(a, b, "step {steps} of {p:?}");
                steps += 1;
                if tok.is_eog(a) {
                    // The list is complete: start another one.
                    ended += 1;
                    fast = Sampler::new(&tok, p).unwrap();
                    whole = Sampler::new(&tok, p).unwrap();
                }
            }
            assert!(ended > 0, "the grammar never completed; the test walks too little of it ({p:?})");
        }
    }

    /// Without a grammar, the prefiltered path (top-k of the logits, the logit bias added
    /// first) picks what llama.cpp's chain over the whole vocabulary picks: greedy and
    /// seeded top-k, biases that lift a token to the top, sink the best one, or tie it.
    #[test]
    fn prefiltered_sampling_with_a_logit_bias_picks_what_the_whole_chain_picks() {
        let tok = tokenizer();
        let n_vocab = tok.n_vocab();
        let mut rng = StdRng::seed_from_u64(5);
        let biases = vec![(7, 30.0), (11, -100.0), (13, 0.5), (13, 0.25), (n_vocab as i32 - 1, 12.0)];
        let cases = [
            SamplingParams { logit_bias: biases.clone(), ..SamplingParams::greedy() },
            SamplingParams { logit_bias: biases.clone(), seed: 3, ..SamplingParams::default() },
            SamplingParams { logit_bias: biases.clone(), seed: 4, temperature: 1.3, top_k: 5, top_p: 1.0, min_p: 0.0, ..SamplingParams::default() },
        ];
        for p in &cases {
            let (mut fast, mut whole) = (Sampler::new(&tok, p).unwrap(), Sampler::new(&tok, p).unwrap());
            let mut lifted = 0;
            for step in 0..300 {
                let mut l = logits(&mut rng, n_vocab, &[]);
                match step % 4 {
                    // The best logit biased away, and (greedy) one that the bias ties with
                    // the lifted one: the lower id wins. Sampling orders exact ties as
                    // llama.cpp's partial sort happens to leave them, so not there.
                    0 => {
                        l[11] = 40.0;
                        l[7] = 10.0;
                        l[13] = if p.temperature <= 0.0 { 39.25 } else { 39.0 };
                    }
                    1 => l[n_vocab - 1] = 9.0,
                    _ => {}
                }
                let a = fast.sample(&l).unwrap();
                assert_eq!(a, whole.sample_judging_every_token(&l).unwrap(), "step {step} of {p:?}");
                lifted += usize::from(a == 7 || a == n_vocab as i32 - 1);
            }
            assert!(lifted > 0, "no bias ever decided a token ({p:?})");
        }
    }

    /// The k best by (logit desc, id asc), -0 equal to +0: what `top_k` must return.
    fn sorted_top(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
        let mut all: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
        all.sort_by(|a, b| (b.1 + 0.0).total_cmp(&(a.1 + 0.0)).then(a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }

    /// The block-skipping scan and the bias merge against a plain sort, on vocabularies of
    /// many lengths (whole blocks or not) with ties, signed zeros and -inf, k from one
    /// (greedy) to more than the vocabulary, and biases that repeat a token, lift one to
    /// the top, sink the best one or tie it; more biases than are merged take the copy.
    #[test]
    fn top_k_with_and_without_biases_is_the_sorted_top() {
        let mut rng = StdRng::seed_from_u64(9);
        let mut scratch = Vec::new();
        for case in 0..400 {
            let n = [1, 31, 32, 33, 95, 1000, 4099][case % 7];
            // Few distinct values: ties everywhere.
            let mut l: Vec<f32> = (0..n).map(|_| rng.gen_range(-4..4) as f32 * 0.5).collect();
            for x in l.iter_mut().filter(|x| **x == 0.0).step_by(2) {
                *x = -0.0;
            }
            if case % 5 == 0 {
                l[rng.gen_range(0..n)] = f32::NEG_INFINITY;
            }
            let k = [1, 2, 5, 40, n + 3][case % 5].min(n + 3);
            assert_eq!(super::top_k(&l, k), sorted_top(&l, k), "n {n} k {k}");
            let n_bias = [1, 3, 70][case % 3];
            let biases: Vec<(usize, f32)> = (0..n_bias).map(|i| (if i % 4 == 1 { 0 } else { rng.gen_range(0..n) }, [2.0, -100.0, 0.5, 1.5][i % 4])).collect();
            let mut biased = l.clone();
            for &(t, b) in &biases {
                biased[t] += b;
            }
            assert_eq!(super::top_k_biased(&l, k, &biases, &mut scratch), sorted_top(&biased, k), "n {n} k {k} biases {biases:?}");
        }
    }

    /// Not a test: per-token time of a 20,000-value enum grammar on the bounded path and
    /// with the grammar judging every token. `cargo test --release --workspace --lib --
    /// --ignored grammar_cost --nocapture`
    #[test]
    #[ignore]
    fn grammar_cost() {
        let tok = tokenizer();
        let n_vocab = tok.n_vocab();
        let grammar = enum_grammar(20_000);
        let boost: Vec<i32> = tok.tokenize("[\"item-17-red\", \"item-19999-東京\"]", false);
        let mut rng = StdRng::seed_from_u64(1);
        // A model that follows the grammar (its text's tokens lead), and one that ignores it.
        let follows: Vec<Vec<f32>> = boost
            .iter()
            .map(|&t| {
                let mut l: Vec<f32> = (0..n_vocab).map(|_| rng.gen_range(-8.0..8.0)).collect();
                l[t as usize] += 20.0;
                l
            })
            .collect();
        let ignores: Vec<Vec<f32>> = (0..4).map(|_| (0..n_vocab).map(|_| rng.gen_range(-8.0..8.0)).collect()).collect();
        for (model, rows) in [("follows the grammar", &follows), ("ignores it", &ignores)] {
            let openai = SamplingParams { seed: 1, temperature: 1.0, top_p: 1.0, ..SamplingParams::default() };
            let top_p = SamplingParams { seed: 1, ..SamplingParams::default() };
            for (name, p) in [("greedy", SamplingParams::greedy()), ("top-k 40 + min-p 0.05", openai), ("top-k 40 + top-p 0.95", top_p)] {
                let p = SamplingParams { grammar: Some(grammar.clone()), ..p };
                let mut fast = Sampler::new(&tok, &p).unwrap();
                let mut whole = Sampler::new(&tok, &p).unwrap();
                let (mut bounded, mut every) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
                for l in rows.iter() {
                    let t = std::time::Instant::now();
                    let a = fast.sample(l).unwrap();
                    bounded += t.elapsed();
                    let t = std::time::Instant::now();
                    let b = whole.sample_judging_every_token(l).unwrap();
                    every += t.elapsed();
                    assert_eq!(a, b);
                }
                let n = rows.len() as u32;
                println!("model {model}, {name}: bounded {:?}/token, judging every token {:?}/token ({n} tokens)", bounded / n, every / n);
            }
        }
    }
}
