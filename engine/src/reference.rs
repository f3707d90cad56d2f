//! llama.cpp running the whole model through its own high-level API: the oracle every
//! engine test compares against and the baseline `hearth bench` measures hearth by.
//! Flash attention is forced on because hearth's graphs always use it (llama.cpp's
//! automatic choice picks it on CPU too).

use std::ffi::CString;
use std::path::Path;
use std::time::Instant;

use llama_cpp_sys_2 as sys;

use crate::op_profile::OpProfile;
use crate::{Error, Result};

/// A llama.cpp model, loaded through its C API (not `llama-cpp-2`'s wrapper, which has no
/// way to turn the extra buffer types off).
pub struct Reference {
    model: *mut sys::llama_model,
    threads: i32,
    n_vocab: usize,
    /// The KV cache types of every context it makes (`--cache-type-k/-v`).
    kv: crate::CacheTypes,
}

// SAFETY: the model is read-only after loading; each call makes its own context.
unsafe impl Send for Reference {}

impl Drop for Reference {
    fn drop(&mut self) {
        // SAFETY: loaded in `load_with`, freed once.
        unsafe { sys::llama_model_free(self.model) };
    }
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

/// One llama.cpp context, freed on drop.
struct Context {
    ctx: *mut sys::llama_context,
    n_vocab: usize,
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: made by llama_init_from_model, freed once.
        unsafe { sys::llama_free(self.ctx) };
    }
}

impl Context {
    fn decode(&mut self, tokens: &[i32], start: usize, all_logits: bool) -> Result<()> {
        let n = tokens.len();
        self.decode_rows(tokens, |i| ((start + i) as i32, 0, all_logits || i + 1 == n))
    }

    /// A prompt for sequence `seq`, its last row's logits wanted.
    fn decode_seq(&mut self, tokens: &[i32], start: usize, seq: i32) -> Result<()> {
        let n = tokens.len();
        self.decode_rows(tokens, |i| ((start + i) as i32, seq, i + 1 == n))
    }

    /// One (token, position) for each sequence 0..step.len(), every row's logits wanted.
    fn decode_step(&mut self, step: &[(i32, usize)]) -> Result<()> {
        let tokens: Vec<i32> = step.iter().map(|s| s.0).collect();
        self.decode_rows(&tokens, |i| (step[i].1 as i32, i as i32, true))
    }

    /// Decodes `tokens`, row i at (position, sequence, logits wanted) = `row(i)`.
    fn decode_rows(&mut self, tokens: &[i32], row: impl Fn(usize) -> (i32, i32, bool)) -> Result<()> {
        // SAFETY: the batch is sized for `tokens` with one sequence id per token; it is
        // filled within those bounds and freed after the call.
        unsafe {
            let mut batch = sys::llama_batch_init(tokens.len() as i32, 0, 1);
            for (i, &t) in tokens.iter().enumerate() {
                let (pos, seq, logits) = row(i);
                *batch.token.add(i) = t;
                *batch.pos.add(i) = pos;
                *batch.n_seq_id.add(i) = 1;
                *(*batch.seq_id.add(i)) = seq;
                *batch.logits.add(i) = i8::from(logits);
            }
            batch.n_tokens = tokens.len() as i32;
            let status = sys::llama_decode(self.ctx, batch);
            sys::llama_batch_free(batch);
            if status != 0 {
                return Err(llama_err("decode", format!("llama_decode returned {status}")));
            }
        }
        Ok(())
    }

    fn logits(&self, i: usize) -> &[f32] {
        // SAFETY: row i was requested in the last decode; llama.cpp keeps n_vocab floats
        // there until the next decode, which needs &mut self.
        unsafe {
            let p = sys::llama_get_logits_ith(self.ctx, i as i32);
            assert!(!p.is_null(), "llama.cpp has no logits for row {i}");
            std::slice::from_raw_parts(p, self.n_vocab)
        }
    }
}

impl Reference {
    /// llama.cpp with its defaults (weights repacked where its CPU kernels want).
    pub fn load(path: impl AsRef<Path>, threads: usize) -> Result<Reference> {
        Self::load_with(path, threads, true)
    }

    /// `repack: false` is upstream's `--no-repack` (`use_extra_bufts = false`): every
    /// weight stays in the plain CPU layout.
    pub fn load_with(path: impl AsRef<Path>, threads: usize, repack: bool) -> Result<Reference> {
        Self::load_full(path, threads, repack, 0, 0..0)
    }

    /// llama.cpp with its last `gpu_layers` repeating layers (and their KV cache) on the
    /// build's accelerators and the output layer on the CPU, as hearth places them; 0 keeps
    /// everything on the CPU whatever the build. llama.cpp's `-ngl N` counts the output
    /// layer as the last of n_layer + 1 (`-ngl n_layer` leaves layer 0 on the CPU and puts
    /// the LM head on the device), and GLM's never-run multi-token-prediction blocks after
    /// the layers among them, so this is `-ngl N+1` (+ those blocks) with the output
    /// layer's tensors overridden to the CPU. More than the model's layers puts every layer
    /// and the output layer on the device, as hearth does then: plain `-ngl n_layer+1`.
    pub fn load_offloaded(path: impl AsRef<Path>, threads: usize, gpu_layers: usize) -> Result<Reference> {
        Self::load_full(path, threads, true, gpu_layers, 0..0)
    }

    /// [`Reference::load_offloaded`] with the routed experts of `experts_in_ram` layers
    /// kept in host memory: llama.cpp's `--n-cpu-moe` (a tensor buffer-type override of
    /// `blk.N.ffn_*_exps` to the CPU, per layer N).
    pub fn load_offloaded_moe(path: impl AsRef<Path>, threads: usize, gpu_layers: usize, experts_in_ram: std::ops::Range<usize>) -> Result<Reference> {
        Self::load_full(path, threads, true, gpu_layers, experts_in_ram)
    }

    /// [`Reference::load_offloaded_moe`], with repacking chosen (`hearth bench --no-repack`).
    pub fn load_placed(path: impl AsRef<Path>, threads: usize, repack: bool, gpu_layers: usize, experts_in_ram: std::ops::Range<usize>) -> Result<Reference> {
        Self::load_full(path, threads, repack, gpu_layers, experts_in_ram)
    }

    fn load_full(path: impl AsRef<Path>, threads: usize, repack: bool, gpu_layers: usize, experts_in_ram: std::ops::Range<usize>) -> Result<Reference> {
        crate::backend::init();
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::Io { path: path.to_path_buf(), source: std::io::Error::from(std::io::ErrorKind::NotFound) });
        }
        let c_path = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| llama_err("loading the reference model", "path has a NUL byte"))?;
        // The same patterns as llama.cpp's `--n-cpu-moe N` (common/arg.cpp), one per layer;
        // and the output layer (its norm and LM head, a tied one named as the embedding).
        let mut patterns: Vec<CString> = experts_in_ram.clone().map(|il| CString::new(format!("blk\\.{il}\\.ffn_(up|down|gate|gate_up)_(ch|)exps")).expect("no NUL")).collect();
        // Blocks after the model's layers (GLM's `nextn`), which llama.cpp counts as layers;
        // and whether the output layer goes to the device too (more GPU layers than layers).
        let (trailing_blocks, output_on_device) = if gpu_layers > 0 {
            let file = crate::ModelFile::open(path)?;
            let blocks = file.gguf.meta().get_u64(&format!("{}.block_count", file.spec.arch_name)).unwrap_or(0) as usize;
            (blocks.saturating_sub(file.spec.n_layer), gpu_layers > file.spec.n_layer)
        } else {
            (0, false)
        };
        let gpu_layers = if output_on_device { gpu_layers - 1 } else { gpu_layers };
        if gpu_layers > 0 && !output_on_device {
            patterns.push(CString::new("^(output|token_embd)").expect("no NUL"));
        }
        // SAFETY: default params from llama.cpp; the path, the patterns and the override
        // list (null-terminated) outlive the call, which is the only reader of them.
        let model = unsafe {
            let cpu = sys::ggml_backend_cpu_buffer_type();
            let mut overrides: Vec<sys::llama_model_tensor_buft_override> = patterns.iter().map(|p| sys::llama_model_tensor_buft_override { pattern: p.as_ptr(), buft: cpu }).collect();
            overrides.push(sys::llama_model_tensor_buft_override { pattern: std::ptr::null(), buft: std::ptr::null_mut() });
            let mut params = sys::llama_model_default_params();
            params.use_extra_bufts = repack;
            params.n_gpu_layers = if gpu_layers == 0 { 0 } else { i32::try_from(gpu_layers + 1 + trailing_blocks).unwrap_or(i32::MAX) };
            if !patterns.is_empty() {
                params.tensor_buft_overrides = overrides.as_ptr();
            }
            sys::llama_model_load_from_file(c_path.as_ptr(), params)
        };
        if model.is_null() {
            return Err(llama_err("loading the reference model", format!("llama.cpp could not load {}", path.display())));
        }
        // SAFETY: a loaded model.
        let n_vocab = unsafe { sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(model)) } as usize;
        Ok(Reference { model, threads: threads as i32, n_vocab, kv: crate::CacheTypes::default() })
    }

    /// Contexts made from now on cache K and V in these types, as llama.cpp's
    /// `--cache-type-k/-v` do.
    pub fn with_cache_types(mut self, kv: crate::CacheTypes) -> Reference {
        self.kv = kv;
        self
    }

    fn context(&self, n_ctx: usize, n_batch: usize) -> Result<Context> {
        self.context_with(n_ctx, n_batch, true)
    }

    /// A context; `swa_full: false` keeps sliding-window layers' K/V in a cache of
    /// `window + batch` cells (llama-server's default) instead of the whole context.
    fn context_with(&self, n_ctx: usize, n_batch: usize, swa_full: bool) -> Result<Context> {
        self.context_seqs(n_ctx, n_batch, swa_full, 1)
    }

    /// A context of `n_seq` sequences, each with its own stream of `n_ctx / n_seq` cells
    /// (llama.cpp's default, non-unified cache: what llama-server gives its slots).
    fn context_seqs(&self, n_ctx: usize, n_batch: usize, swa_full: bool, n_seq: usize) -> Result<Context> {
        self.context_profiled(n_ctx, n_batch, n_batch, swa_full, n_seq, None)
    }

    /// [`Self::context_seqs`] with every op timed in `ops` while it records (which must
    /// outlive the context).
    fn context_profiled(&self, n_ctx: usize, n_batch: usize, n_ubatch: usize, swa_full: bool, n_seq: usize, ops: Option<*mut OpProfile>) -> Result<Context> {
        // SAFETY: default params from llama.cpp, on a loaded model.
        let ctx = unsafe {
            let mut p = sys::llama_context_default_params();
            p.n_seq_max = n_seq as u32;
            p.swa_full = swa_full;
            p.n_ctx = n_ctx as u32;
            p.n_batch = n_batch as u32;
            p.n_ubatch = n_ubatch.min(n_batch) as u32;
            p.n_threads = self.threads;
            p.n_threads_batch = self.threads;
            p.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_ENABLED;
            p.type_k = self.kv.k.ggml_type();
            p.type_v = self.kv.v.ggml_type();
            if let Some(ops) = ops {
                p.cb_eval = Some(crate::op_profile::on_node);
                p.cb_eval_user_data = ops.cast();
            }
            sys::llama_init_from_model(self.model, p)
        };
        if ctx.is_null() {
            return Err(llama_err("creating a context", "llama_init_from_model failed"));
        }
        Ok(Context { ctx, n_vocab: self.n_vocab })
    }

    /// Logits of every position of `tokens`, fed as one batch.
    pub fn prompt_logits(&self, tokens: &[i32]) -> Result<Vec<Vec<f32>>> {
        let mut ctx = self.context(4096, tokens.len().max(1))?;
        ctx.decode(tokens, 0, true)?;
        Ok((0..tokens.len()).map(|i| ctx.logits(i).to_vec()).collect())
    }

    /// Each token's output vector as llama.cpp gives it with embeddings on and no pooling
    /// (the last layer's output after the model's final norm): what a test pools by hand
    /// to check an embedder's pooling. The tokens are one sequence, fed as one batch.
    pub fn token_embeddings(&self, tokens: &[i32]) -> Result<Vec<Vec<f32>>> {
        let n = tokens.len().max(1);
        // SAFETY: default params on a loaded model; the context is freed by `Context`.
        let ctx = unsafe {
            let mut p = sys::llama_context_default_params();
            p.embeddings = true;
            p.pooling_type = sys::LLAMA_POOLING_TYPE_NONE;
            p.n_ctx = n.max(256) as u32;
            p.n_batch = n as u32;
            p.n_ubatch = n as u32;
            p.n_threads = self.threads;
            p.n_threads_batch = self.threads;
            sys::llama_init_from_model(self.model, p)
        };
        if ctx.is_null() {
            return Err(llama_err("creating an embeddings context", "llama_init_from_model failed"));
        }
        let mut ctx = Context { ctx, n_vocab: self.n_vocab };
        ctx.decode(tokens, 0, true)?;
        // SAFETY: every row was requested; each holds n_embd_out floats until the next
        // decode.
        let dims = unsafe { sys::llama_model_n_embd_out(self.model) } as usize;
        (0..tokens.len())
            .map(|i| unsafe {
                let p = sys::llama_get_embeddings_ith(ctx.ctx, i as i32);
                if p.is_null() {
                    return Err(llama_err("token embeddings", format!("llama.cpp has no embedding for row {i}")));
                }
                Ok(std::slice::from_raw_parts(p, dims).to_vec())
            })
            .collect()
    }

    /// Greedy continuation of `prompt`: `n` tokens, the prompt fed as one batch.
    pub fn greedy(&self, prompt: &[i32], n: usize) -> Result<Vec<i32>> {
        self.greedy_in_ubatches(prompt, n, prompt.len().max(1))
    }

    /// The logits after the last of `prompt`, decoded by llama.cpp in micro-batches of
    /// `ubatch` in a context just large enough: for prompts past the 4,096 positions the
    /// other checks use (Llama 4's chunked attention begins its second chunk at 8,192).
    pub fn last_logits(&self, prompt: &[i32], ubatch: usize) -> Result<Vec<f32>> {
        const CTX_ROUND: usize = 256;
        let mut ctx = self.context_profiled(prompt.len().next_multiple_of(CTX_ROUND), prompt.len().max(1), ubatch.max(1), true, 1, None)?;
        ctx.decode(prompt, 0, false)?;
        Ok(ctx.logits(prompt.len() - 1).to_vec())
    }

    /// [`Self::greedy`] with the prompt cut into micro-batches of `ubatch` tokens by
    /// llama.cpp itself (`n_ubatch`, llama-server's `-ub`): the rows a kernel sees change
    /// which ggml path it takes, so the rounding follows the chunk size.
    pub fn greedy_in_ubatches(&self, prompt: &[i32], n: usize, ubatch: usize) -> Result<Vec<i32>> {
        let mut ctx = self.context_profiled(4096, prompt.len().max(1), ubatch.max(1), true, 1, None)?;
        ctx.decode(prompt, 0, false)?;
        let mut out = Vec::with_capacity(n);
        let mut logits_index = prompt.len() - 1;
        while out.len() < n {
            let next = argmax(ctx.logits(logits_index));
            out.push(next);
            if out.len() < n {
                ctx.decode(&[next], prompt.len() + out.len() - 1, false)?;
                logits_index = 0;
            }
        }
        Ok(out)
    }

    /// One prompt pass of `prompt` then `n_gen` single-token decodes, timed. As
    /// llama-server runs by default: sliding-window layers in their small cache (the
    /// oracle tests keep llama.cpp's library default, the full-size one, whose cells line
    /// up with hearth's).
    pub fn bench(&self, prompt: &[i32], n_gen: usize) -> Result<Timing> {
        let mut ctx = self.context_with(4096, prompt.len(), false)?;
        let t0 = Instant::now();
        ctx.decode(prompt, 0, false)?;
        // Reading the logits waits for the device: with the output layer on a GPU,
        // `llama_decode` returns once the graph is submitted.
        let mut tok = argmax(ctx.logits(prompt.len() - 1));
        let prompt_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for i in 0..n_gen {
            ctx.decode(&[tok], prompt.len() + i, false)?;
            tok = argmax(ctx.logits(0));
        }
        Ok(Timing { prompt_tokens: prompt.len(), prompt_secs, gen_tokens: n_gen, gen_secs: t1.elapsed().as_secs_f64() })
    }

    /// Sequences decoding together, as llama-server's slots do: each prompt is fed alone
    /// (one batch, sequence i), then `n_gen - 1` greedy steps of one batch holding every
    /// sequence's next token. Returns each sequence's `n_gen` tokens and the timing
    /// (`gen_tokens` counts every sequence's decoded tokens). `swa_full`: as in
    /// `context_with` (off is llama-server's default; the oracle tests keep it on, so the
    /// sliding layers' cells line up with hearth's).
    pub fn decode_together(&self, prompts: &[Vec<i32>], n_gen: usize, swa_full: bool) -> Result<(Vec<Vec<i32>>, Timing)> {
        self.decode_together_with(prompts, n_gen, swa_full, None)
    }

    /// [`Self::decode_together`], the decode steps' ops timed in `ops` (the prompts' not).
    pub fn decode_together_with(&self, prompts: &[Vec<i32>], n_gen: usize, swa_full: bool, ops: Option<&mut OpProfile>) -> Result<(Vec<Vec<i32>>, Timing)> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let per_seq = (longest + n_gen + 1).div_ceil(256) * 256;
        let ops: Option<*mut OpProfile> = ops.map(|p| p as *mut OpProfile);
        // SAFETY (both `record` calls): the context reads the profile only inside decode
        // calls, none of which runs at the same time.
        ops.inspect(|&p| unsafe { (*p).record(false) });
        let batch = longest.max(prompts.len()).max(1);
        let mut ctx = self.context_profiled(per_seq * prompts.len(), batch, batch, swa_full, prompts.len(), ops)?;
        let t0 = Instant::now();
        let mut out: Vec<Vec<i32>> = Vec::with_capacity(prompts.len());
        for (s, p) in prompts.iter().enumerate() {
            ctx.decode_seq(p, 0, s as i32)?;
            out.push(vec![argmax(ctx.logits(p.len() - 1))]);
        }
        let prompt_secs = t0.elapsed().as_secs_f64();
        ops.inspect(|&p| unsafe { (*p).record(true) });
        let t1 = Instant::now();
        for i in 1..n_gen {
            let step: Vec<(i32, usize)> = out.iter().zip(prompts).map(|(o, p)| (o[i - 1], p.len() + i - 1)).collect();
            ctx.decode_step(&step)?;
            for (s, o) in out.iter_mut().enumerate() {
                o.push(argmax(ctx.logits(s)));
            }
        }
        let timing = Timing { prompt_tokens: prompts.iter().map(Vec::len).sum(), prompt_secs, gen_tokens: n_gen.saturating_sub(1) * prompts.len(), gen_secs: t1.elapsed().as_secs_f64() };
        Ok((out, timing))
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

/// Writes `src` requantized to llama.cpp file type `ftype` (a `LLAMA_FTYPE_MOSTLY_*`) with
/// llama.cpp's own quantizer: how the tests get every weight type of one real model.
pub fn quantize(src: &Path, dst: &Path, ftype: u32, threads: usize) -> Result<()> {
    crate::backend::init();
    let c = |p: &Path| std::ffi::CString::new(p.to_string_lossy().as_bytes()).map_err(|_| llama_err("quantize", "path has a NUL byte"));
    let (src_c, dst_c) = (c(src)?, c(dst)?);
    // SAFETY: default params from llama.cpp, two valid C strings that outlive the call.
    let status = unsafe {
        let mut params = llama_cpp_sys_2::llama_model_quantize_default_params();
        params.ftype = ftype as _;
        params.nthread = threads as i32;
        params.allow_requantize = true;
        llama_cpp_sys_2::llama_model_quantize(src_c.as_ptr(), dst_c.as_ptr(), &params)
    };
    if status != 0 {
        return Err(llama_err("quantize", format!("llama_model_quantize returned {status} for file type {ftype}")));
    }
    Ok(())
}

/// llama-quantize's names for the file types it writes without an importance matrix.
pub const FILE_TYPES: &[(&str, u32)] = &[
    ("f16", sys::LLAMA_FTYPE_MOSTLY_F16 as u32),
    ("bf16", sys::LLAMA_FTYPE_MOSTLY_BF16 as u32),
    ("q8_0", sys::LLAMA_FTYPE_MOSTLY_Q8_0 as u32),
    ("q4_0", sys::LLAMA_FTYPE_MOSTLY_Q4_0 as u32),
    ("q4_1", sys::LLAMA_FTYPE_MOSTLY_Q4_1 as u32),
    ("q5_0", sys::LLAMA_FTYPE_MOSTLY_Q5_0 as u32),
    ("q5_1", sys::LLAMA_FTYPE_MOSTLY_Q5_1 as u32),
    ("q2_k", sys::LLAMA_FTYPE_MOSTLY_Q2_K as u32),
    ("q3_k_s", sys::LLAMA_FTYPE_MOSTLY_Q3_K_S as u32),
    ("q3_k_m", sys::LLAMA_FTYPE_MOSTLY_Q3_K_M as u32),
    ("q3_k_l", sys::LLAMA_FTYPE_MOSTLY_Q3_K_L as u32),
    ("q4_k_s", sys::LLAMA_FTYPE_MOSTLY_Q4_K_S as u32),
    ("q4_k_m", sys::LLAMA_FTYPE_MOSTLY_Q4_K_M as u32),
    ("q5_k_s", sys::LLAMA_FTYPE_MOSTLY_Q5_K_S as u32),
    ("q5_k_m", sys::LLAMA_FTYPE_MOSTLY_Q5_K_M as u32),
    ("q6_k", sys::LLAMA_FTYPE_MOSTLY_Q6_K as u32),
    ("iq4_nl", sys::LLAMA_FTYPE_MOSTLY_IQ4_NL as u32),
    ("iq4_xs", sys::LLAMA_FTYPE_MOSTLY_IQ4_XS as u32),
    ("iq3_s", sys::LLAMA_FTYPE_MOSTLY_IQ3_S as u32),
    ("iq3_m", sys::LLAMA_FTYPE_MOSTLY_IQ3_M as u32),
    ("mxfp4_moe", sys::LLAMA_FTYPE_MOSTLY_MXFP4_MOE as u32),
];

/// The `LLAMA_FTYPE_MOSTLY_*` llama-quantize calls `name`.
pub fn file_type(name: &str) -> Option<u32> {
    FILE_TYPES.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The llama-quantize name of a `general.file_type` (`q4_k_m`), if it is one of those.
pub fn file_type_name(t: u32) -> Option<&'static str> {
    FILE_TYPES.iter().find(|(_, x)| *x == t).map(|(n, _)| *n)
}
