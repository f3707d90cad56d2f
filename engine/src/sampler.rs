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
    chain: LlamaSampler,
    n_vocab: usize,
    /// When the chain's first step is top-k (nothing before it reads the whole
    /// distribution), only the k best logits are handed to llama.cpp: the same result
    /// without copying and sorting the whole vocabulary every token.
    prefilter: Option<usize>,
}

// SAFETY: a llama sampler is plain heap state used by one thread at a time.
unsafe impl Send for Sampler {}

impl Sampler {
    pub fn new(tokenizer: &Tokenizer, p: &SamplingParams) -> Result<Sampler> {
        let n_vocab = tokenizer.n_vocab();
        let mut chain = Vec::new();
        if let Some(bad) = p.logit_bias.iter().find(|(t, _)| *t < 0 || *t as usize >= n_vocab) {
            return Err(Error::Sampler(format!("logit_bias names token {} outside the vocabulary of {n_vocab}", bad.0)));
        }
        if !p.logit_bias.is_empty() {
            let biases: Vec<LlamaLogitBias> = p.logit_bias.iter().map(|&(t, b)| LlamaLogitBias::new(LlamaToken(t), b)).collect();
            chain.push(LlamaSampler::logit_bias(n_vocab as i32, &biases));
        }
        if p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            chain.push(LlamaSampler::penalties(n_vocab as i32, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty));
        }
        if let Some(g) = &p.grammar {
            let s = LlamaSampler::grammar(tokenizer.llama_model(), g, "root").map_err(|e| Error::Sampler(format!("invalid grammar: {e}")))?;
            chain.push(s);
        }
        if p.temperature <= 0.0 {
            chain.push(LlamaSampler::greedy());
        } else {
            if p.top_k > 0 {
                chain.push(LlamaSampler::top_k(p.top_k));
            }
            if p.top_p < 1.0 {
                chain.push(LlamaSampler::top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                chain.push(LlamaSampler::min_p(p.min_p, 1));
            }
            chain.push(LlamaSampler::temp(p.temperature));
            chain.push(LlamaSampler::dist(p.seed));
        }
        let plain = p.logit_bias.is_empty() && p.grammar.is_none() && p.repeat_penalty == 1.0 && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0;
        let prefilter = if !plain {
            None
        } else if p.temperature <= 0.0 {
            Some(1)
        } else if p.top_k > 0 {
            Some(p.top_k as usize)
        } else {
            None
        };
        Ok(Sampler { chain: LlamaSampler::chain_simple(chain), n_vocab, prefilter })
    }

    /// Picks the next token from one row of logits and records it (penalties, grammar).
    pub fn sample(&mut self, logits: &[f32]) -> Result<i32> {
        if logits.len() != self.n_vocab {
            return Err(Error::Sampler(format!("{} logits for a vocabulary of {}", logits.len(), self.n_vocab)));
        }
        let mut arr = match self.prefilter {
            Some(k) if k < logits.len() => {
                let top = top_k(logits, k);
                LlamaTokenDataArray::from_iter(top.into_iter().map(|(i, l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)), false)
            }
            _ => LlamaTokenDataArray::from_iter(logits.iter().enumerate().map(|(i, &l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)), false),
        };
        self.chain.apply(&mut arr);
        let tok = arr.selected_token().ok_or_else(|| Error::Sampler("no token is allowed here (the grammar rejects every candidate)".into()))?;
        self.chain.accept(tok);
        Ok(tok.0)
    }
}

/// GBNF for JSON following `schema` (JSON Schema as text), by llama.cpp's converter.
pub fn json_schema_grammar(schema: &str) -> Result<String> {
    llama_cpp_2::json_schema_to_grammar(schema).map_err(|e| Error::Sampler(format!("cannot turn the JSON schema into a grammar: {e}")))
}

/// The `k` largest logits, best first; ties keep the lower token id first, as llama.cpp's
/// top-k (a stable sort by logit) does.
fn top_k(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut top: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if top.len() < k || l > top[top.len() - 1].1 {
            let at = top.partition_point(|&(_, x)| x >= l);
            top.insert(at, (i, l));
            top.truncate(k);
        }
    }
    top
}
