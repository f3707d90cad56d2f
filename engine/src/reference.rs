//! llama.cpp running the whole model through its own high-level API: the oracle every
//! engine test compares against and the baseline `hearth bench` measures hearth by.
//! Flash attention is forced on because hearth's graphs always use it (llama.cpp's
//! automatic choice picks it on CPU too).

use std::num::NonZeroU32;
use std::path::Path;
use std::time::Instant;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::{Error, Result};

pub struct Reference {
    model: LlamaModel,
    threads: i32,
}

/// Wall-clock seconds of one prompt pass and of a run of single-token decodes.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub gen_tokens: usize,
    pub gen_secs: f64,
}

impl Timing {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs
    }
    pub fn gen_tps(&self) -> f64 {
        self.gen_tokens as f64 / self.gen_secs
    }
}

fn llama_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Llama(format!("{what}: {e}"))
}

impl Reference {
    pub fn load(path: impl AsRef<Path>, threads: usize) -> Result<Reference> {
        let backend = crate::backend::init();
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::Io { path: path.to_path_buf(), source: std::io::Error::from(std::io::ErrorKind::NotFound) });
        }
        let model = LlamaModel::load_from_file(backend, path, &LlamaModelParams::default()).map_err(|e| llama_err("loading the reference model", e))?;
        Ok(Reference { model, threads: threads as i32 })
    }

    fn context(&self, n_ctx: usize, n_batch: usize) -> Result<LlamaContext<'_>> {
        let params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(n_ctx as u32))
            .with_n_batch(n_batch as u32)
            .with_n_ubatch(n_batch as u32)
            .with_n_threads(self.threads)
            .with_n_threads_batch(self.threads)
            .with_flash_attention_policy(llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED);
        self.model.new_context(crate::backend::init(), params).map_err(|e| llama_err("creating a context", e))
    }

    fn decode(ctx: &mut LlamaContext<'_>, tokens: &[i32], start: usize, all_logits: bool) -> Result<()> {
        let mut batch = LlamaBatch::new(tokens.len(), 1);
        for (i, &t) in tokens.iter().enumerate() {
            let want = all_logits || i + 1 == tokens.len();
            batch.add(LlamaToken(t), (start + i) as i32, &[0], want).map_err(|e| llama_err("batch", e))?;
        }
        ctx.decode(&mut batch).map_err(|e| llama_err("decode", e))
    }

    /// Logits of every position of `tokens`, fed as one batch.
    pub fn prompt_logits(&self, tokens: &[i32]) -> Result<Vec<Vec<f32>>> {
        let mut ctx = self.context(4096, tokens.len().max(1))?;
        Self::decode(&mut ctx, tokens, 0, true)?;
        Ok((0..tokens.len()).map(|i| ctx.get_logits_ith(i as i32).to_vec()).collect())
    }

    /// Greedy continuation of `prompt`: `n` tokens, the prompt fed as one batch.
    pub fn greedy(&self, prompt: &[i32], n: usize) -> Result<Vec<i32>> {
        let mut ctx = self.context(4096, prompt.len().max(1))?;
        Self::decode(&mut ctx, prompt, 0, false)?;
        let mut out = Vec::with_capacity(n);
        let mut logits_index = prompt.len() as i32 - 1;
        while out.len() < n {
            let next = argmax(ctx.get_logits_ith(logits_index));
            out.push(next);
            if out.len() < n {
                Self::decode(&mut ctx, &[next], prompt.len() + out.len() - 1, false)?;
                logits_index = 0;
            }
        }
        Ok(out)
    }

    /// One prompt pass of `prompt` then `n_gen` single-token decodes, timed.
    pub fn bench(&self, prompt: &[i32], n_gen: usize) -> Result<Timing> {
        let mut ctx = self.context(4096, prompt.len())?;
        let t0 = Instant::now();
        Self::decode(&mut ctx, prompt, 0, false)?;
        let prompt_secs = t0.elapsed().as_secs_f64();
        let mut tok = argmax(ctx.get_logits_ith(prompt.len() as i32 - 1));
        let t1 = Instant::now();
        for i in 0..n_gen {
            Self::decode(&mut ctx, &[tok], prompt.len() + i, false)?;
            tok = argmax(ctx.get_logits_ith(0));
        }
        Ok(Timing { prompt_tokens: prompt.len(), prompt_secs, gen_tokens: n_gen, gen_secs: t1.elapsed().as_secs_f64() })
    }
}

/// First index of the largest logit — llama.cpp's greedy sampler breaks ties the same way.
pub fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as i32
}
