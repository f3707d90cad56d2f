//! An embedding model: text in, one pooled vector per input out, for `/v1/embeddings`.
//!
//! The embedding model is never split across devices (it is small, and it lives on the
//! head beside the chat model), so it needs none of the engine's layer windows: llama.cpp
//! runs it whole through its own C API, which gives hearth every embedding architecture
//! llama.cpp knows (BERT and its descendants, nomic-bert, Qwen3-Embedding, Gemma
//! embedding, ...) with llama.cpp's exact numbers. hearth decides what llama.cpp is
//! asked: the pooling (the GGUF's, or the operator's choice), how many inputs go into one
//! decode, and the context each input may fill.

use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// How one input's token vectors become its embedding (the GGUF's `{arch}.pooling_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the input's tokens (BERT sentence-transformers, nomic-embed-text).
    Mean,
    /// The first token's vector, the `[CLS]` token (bge).
    Cls,
    /// The last token's vector (Qwen3-Embedding and other decoder-based embedders).
    Last,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }

    pub fn parse(s: &str) -> Option<Pooling> {
        match s {
            "mean" => Some(Pooling::Mean),
            "cls" => Some(Pooling::Cls),
            "last" => Some(Pooling::Last),
            _ => None,
        }
    }

    fn llama(self) -> sys::llama_pooling_type {
        match self {
            Pooling::Mean => sys::LLAMA_POOLING_TYPE_MEAN,
            Pooling::Cls => sys::LLAMA_POOLING_TYPE_CLS,
            Pooling::Last => sys::LLAMA_POOLING_TYPE_LAST,
        }
    }
}

/// How the embedding model is run.
#[derive(Debug, Clone)]
pub struct EmbedderConfig {
    pub threads: usize,
    /// Tokens one input may have, and tokens one decode holds (every input of a decode
    /// together); at most the model's training context. `None`: [`DEFAULT_MAX_CTX`].
    pub ctx_size: Option<usize>,
    /// Overrides the GGUF's pooling; required where the GGUF names none.
    pub pooling: Option<Pooling>,
}

/// The default context cap: OpenAI's embedding models take 8,192 tokens per input, and a
/// decode of that many tokens keeps the compute buffer of a small model in tens of MiB.
pub const DEFAULT_MAX_CTX: usize = 8192;

/// Inputs one decode holds at most; more queue for the next decode. Many short inputs
/// (a RAG ingest of sentences) share a decode up to this many.
pub const MAX_SEQS_PER_DECODE: usize = 64;

/// A loaded embedding model and its llama.cpp context.
pub struct Embedder {
    model: *mut sys::llama_model,
    ctx: *mut sys::llama_context,
    tokenizer: Arc<Tokenizer>,
    pooling: Pooling,
    n_ctx: usize,
    dims: usize,
    n_ctx_train: usize,
    arch: String,
}

// SAFETY: the model and the context are used only through `&mut self` (decodes) or read
// (sizes); llama.cpp does not tie them to the thread that made them.
unsafe impl Send for Embedder {}

impl Drop for Embedder {
    fn drop(&mut self) {
        // SAFETY: made in `load`, freed once, the context before its model.
        unsafe {
            sys::llama_free(self.ctx);
            sys::llama_model_free(self.model);
        }
    }
}

fn llama_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Llama(format!("{what}: {e}"))
}

impl Embedder {
    pub fn load(path: impl AsRef<Path>, config: &EmbedderConfig) -> Result<Embedder> {
        crate::backend::init();
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::Io { path: path.to_path_buf(), source: std::io::Error::from(std::io::ErrorKind::NotFound) });
        }
        let tokenizer = Arc::new(Tokenizer::load(path)?);
        let c_path = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| llama_err("loading the embedding model", "path has a NUL byte"))?;
        // SAFETY: default params; the path outlives the call.
        let model = unsafe {
            let mut params = sys::llama_model_default_params();
            // Never on an accelerator: the chat model's layers own those.
            params.n_gpu_layers = 0;
            sys::llama_model_load_from_file(c_path.as_ptr(), params)
        };
        if model.is_null() {
            return Err(llama_err("loading the embedding model", format!("llama.cpp could not load {}", path.display())));
        }
        let free = |e: Error| {
            // SAFETY: loaded above, not yet owned by an Embedder.
            unsafe { sys::llama_model_free(model) };
            Err(e)
        };
        // SAFETY: a loaded model; the buffer is sized and NUL-terminated by llama.cpp.
        let (n_ctx_train, dims, has_encoder, arch) = unsafe {
            let mut buf = [0 as std::os::raw::c_char; 64];
            let key = CString::new("general.architecture").expect("no NUL");
            let n = sys::llama_model_meta_val_str(model, key.as_ptr(), buf.as_mut_ptr(), buf.len());
            let arch = if n > 0 { std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned() } else { String::new() };
            (sys::llama_model_n_ctx_train(model).max(1) as usize, sys::llama_model_n_embd_out(model).max(0) as usize, sys::llama_model_has_encoder(model), arch)
        };
        if has_encoder {
            // Encoder-decoder models (T5) embed through llama_encode and another output.
            return free(Error::InvalidModel(format!("{}: an encoder-decoder model ({arch}) is not an embedding model hearth serves", path.display())));
        }
        // Never past the training context: BERT's learned positions end there (a position
        // past them would read outside the table).
        let n_ctx = config.ctx_size.unwrap_or(DEFAULT_MAX_CTX).min(n_ctx_train).max(1);
        let pooling = match config.pooling {
            Some(p) => p,
            None => match model_pooling(model) {
                Ok(p) => p,
                Err(e) => return free(e),
            },
        };
        // SAFETY: default params on a loaded model.
        let ctx = unsafe {
            let mut p = sys::llama_context_default_params();
            p.embeddings = true;
            p.pooling_type = pooling.llama();
            p.n_ctx = n_ctx as u32;
            // A bidirectional model needs each input whole in one micro-batch, so the
            // batch, the micro-batch and the context are the same size.
            p.n_batch = n_ctx as u32;
            p.n_ubatch = n_ctx as u32;
            p.n_seq_max = MAX_SEQS_PER_DECODE as u32;
            // One cache shared by the decode's inputs (a causal embedder has one): each
            // input may fill the whole context when it is alone in a decode.
            p.kv_unified = true;
            p.n_threads = config.threads as i32;
            p.n_threads_batch = config.threads as i32;
            sys::llama_init_from_model(model, p)
        };
        if ctx.is_null() {
            return free(llama_err("creating the embedding context", "llama_init_from_model failed"));
        }
        Ok(Embedder { model, ctx, tokenizer, pooling, n_ctx, dims, n_ctx_train, arch })
    }

    /// Tokens of `text` as llama.cpp's embedding servers tokenize it: the model's special
    /// tokens added (`[CLS]`/`[SEP]` for BERT, the end-of-text token a last-token embedder
    /// pools on), control-token text parsed.
    pub fn tokenize(&self, text: &str) -> Vec<i32> {
        self.tokenizer.tokenize_with(text, true, true)
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The length of each embedding.
    pub fn dims(&self) -> usize {
        self.dims
    }

    /// Tokens one input may have.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn n_ctx_train(&self) -> usize {
        self.n_ctx_train
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The pooled (not normalised) embedding of each input, in order. Inputs are packed
    /// into as few decodes as the context and [`MAX_SEQS_PER_DECODE`] allow; each must be
    /// non-empty, at most [`Embedder::n_ctx`] tokens, and of the model's vocabulary (the
    /// caller checks; a violation is an error, never handed to llama.cpp).
    pub fn embed(&mut self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>> {
        let n_vocab = self.tokenizer.n_vocab() as i32;
        for (i, input) in inputs.iter().enumerate() {
            if input.is_empty() || input.len() > self.n_ctx {
                return Err(Error::InvalidRequest(format!("input {i} has {} tokens; an input takes 1 to {}", input.len(), self.n_ctx)));
            }
            if let Some(t) = input.iter().find(|&&t| t < 0 || t >= n_vocab) {
                return Err(Error::InvalidRequest(format!("input {i} holds token {t}, outside the vocabulary of {n_vocab}")));
            }
        }
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < inputs.len() && end - start < MAX_SEQS_PER_DECODE && tokens + inputs[end].len() <= self.n_ctx {
                tokens += inputs[end].len();
                end += 1;
            }
            out.extend(self.decode(&inputs[start..end])?);
            start = end;
        }
        Ok(out)
    }

    /// One decode of `inputs` (sequence i for input i), their pooled vectors.
    fn decode(&mut self, inputs: &[&[i32]]) -> Result<Vec<Vec<f32>>> {
        let n: usize = inputs.iter().map(|i| i.len()).sum();
        // SAFETY: the batch is sized for n tokens with one sequence id each and filled
        // within those bounds; it is freed after the call. The memory (absent for
        // encoders) is cleared so no input attends to an earlier decode's.
        unsafe {
            let mem = sys::llama_get_memory(self.ctx);
            if !mem.is_null() {
                sys::llama_memory_clear(mem, true);
            }
            let mut batch = sys::llama_batch_init(n as i32, 0, 1);
            let mut row = 0;
            for (seq, input) in inputs.iter().enumerate() {
                for (pos, &t) in input.iter().enumerate() {
                    *batch.token.add(row) = t;
                    *batch.pos.add(row) = pos as i32;
                    *batch.n_seq_id.add(row) = 1;
                    *(*batch.seq_id.add(row)) = seq as i32;
                    *batch.logits.add(row) = 1;
                    row += 1;
                }
            }
            batch.n_tokens = n as i32;
            let status = sys::llama_decode(self.ctx, batch);
            sys::llama_batch_free(batch);
            if status != 0 {
                return Err(llama_err("embedding", format!("llama_decode returned {status}")));
            }
            (0..inputs.len())
                .map(|seq| {
                    let p = sys::llama_get_embeddings_seq(self.ctx, seq as i32);
                    if p.is_null() {
                        return Err(llama_err("embedding", format!("llama.cpp has no pooled embedding for input {seq}")));
                    }
                    Ok(std::slice::from_raw_parts(p, self.dims).to_vec())
                })
                .collect()
        }
    }
}

/// The pooling the GGUF names; an error where it names none (a chat model: pick one with
/// the operator's flag) or a reranker's.
fn model_pooling(model: *mut sys::llama_model) -> Result<Pooling> {
    // SAFETY: a loaded model; the key and buffer outlive the call.
    let (arch, value) = unsafe {
        let mut buf = [0 as std::os::raw::c_char; 64];
        let key = CString::new("general.architecture").expect("no NUL");
        sys::llama_model_meta_val_str(model, key.as_ptr(), buf.as_mut_ptr(), buf.len());
        let arch = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
        let key = CString::new(format!("{arch}.pooling_type")).expect("no NUL");
        let n = sys::llama_model_meta_val_str(model, key.as_ptr(), buf.as_mut_ptr(), buf.len());
        (arch, (n > 0).then(|| std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()))
    };
    match value.as_deref().and_then(|v| v.trim().parse::<u32>().ok()) {
        Some(1) => Ok(Pooling::Mean),
        Some(2) => Ok(Pooling::Cls),
        Some(3) => Ok(Pooling::Last),
        Some(4) => Err(Error::InvalidModel(format!("the {arch} model is a reranker (rank pooling), not an embedding model"))),
        _ => Err(Error::InvalidModel(format!("the {arch} model names no pooling ({arch}.pooling_type): choose one with --embedding-pooling mean|cls|last"))),
    }
}

/// `v` scaled to unit Euclidean length (left as is when it is all zeros), as OpenAI's
/// embeddings are and llama-server's by default.
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    if norm > 0.0 {
        for x in v.iter_mut() {
            *x = (*x as f64 / norm) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_length_and_zero_vector_untouched() {
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        let mut z = vec![0.0; 3];
        normalize(&mut z);
        assert_eq!(z, vec![0.0; 3]);
    }

    #[test]
    fn pooling_names_round_trip() {
        for p in [Pooling::Mean, Pooling::Cls, Pooling::Last] {
            assert_eq!(Pooling::parse(p.name()), Some(p));
        }
        assert_eq!(Pooling::parse("rank"), None);
    }
}
