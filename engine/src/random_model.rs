//! Random-weight GGUF models of every architecture the engine runs: tiny ones for the
//! oracle tests (llama.cpp loads them like any other file, and any wiring mistake — a
//! missing bias, a wrong RoPE mode, a norm in the wrong place, a wrong expert — changes
//! the logits), and files of many GiB for the memory experiments (`hearth make-model`).
//! The tokenizer is copied from a real GGUF so the model serves like any other; weights
//! are seeded noise scaled so activations stay finite through many layers. Tensors are
//! generated while they are written, so a file of many GiB needs only one tensor in
//! memory.

use std::path::Path;

use crate::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use crate::{Error, Result};

/// What to write. Sizes are GGUF's; `arch` is the GGUF architecture name.
#[derive(Debug, Clone)]
pub struct RandomModel {
    pub arch: String,
    pub n_layer: u32,
    pub n_embd: u64,
    /// Dense FFN hidden size (MoE archs: written as `feed_forward_length` only).
    pub n_ff: u64,
    pub n_head: u32,
    pub n_head_kv: u32,
    /// Size of one attention head (default n_embd / n_head).
    pub head_dim: Option<u64>,
    /// MoE archs: experts, experts per token, one expert's hidden size.
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_ff_exp: u64,
    /// Sliding-window archs: the window in tokens.
    pub n_swa: u32,
    /// Type of the matrices (norms and biases are F32; gpt-oss experts are MXFP4, as in
    /// every gpt-oss GGUF). Q4_K means llama.cpp's Q4_K_M mix: Q6_K for the output layer
    /// and for `attn_v` and `ffn_down` in the layers llama-quantize gives more bits.
    pub ty: GgmlType,
    pub tied_output: bool,
    /// Q/K/V biases (qwen2; gpt-oss always has them).
    pub qkv_bias: bool,
    pub context_length: u32,
    /// Extra `{arch}.` metadata, e.g. Mistral's attention temperature.
    pub extra: Vec<(String, Value)>,
    /// Gemma 4: every this-many-th layer (and the last) attends fully, with heads twice the
    /// sliding layers' size and V taken from K (the real models: 6). Qwen3.5: every
    /// this-many-th layer attends fully, the others are recurrent (the real models: 4).
    pub full_every: u32,
    /// Gemma 4: the full layers' KV heads (default: half the sliding layers').
    pub full_kv_heads: Option<u32>,
    /// DeepSeek 2: a plain `attn_q` instead of the low-rank query (the Lite models; llama.cpp
    /// tells them by 26 or 27 layers).
    pub mla_lite: bool,
    /// Gemma 4 E2B/E4B: values per token of each layer's own input (the real models: 256);
    /// 0: none.
    pub per_layer_embd: u64,
    /// Gemma 4 E2B/E4B: the last this-many layers attend with earlier layers' K/V and have
    /// twice the FFN width (the real models: 20 of 35, 18 of 42); 0: none.
    pub shared_kv_layers: u32,
    pub seed: u64,
}

/// A vocabulary-only copy of the GGUF `from`: every metadata key (architecture,
/// hyper-parameters, tokenizer, chat template) and no tensors; its size in bytes. llama.cpp
/// loads it vocab-only as it loads the original, and [`RandomModel::write`] takes its
/// tokenizer from it: tests that need a real vocabulary and no weights carry such a file
/// (`testdata/`) instead of downloading a model.
pub fn write_vocabulary(from: &Path, out: &Path) -> Result<u64> {
    let real = GgufFile::open(from)?;
    GgufWriter::from_meta(real.meta()).write_to(out)?;
    Ok(std::fs::metadata(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?.len())
}

impl RandomModel {
    /// A model of `arch` with the given size and typical defaults for the rest.
    pub fn new(arch: &str, n_layer: u32, n_embd: u64, n_ff: u64, n_head: u32, n_head_kv: u32) -> RandomModel {
        let moe = matches!(arch, "qwen3moe" | "gpt-oss" | "glm4moe" | "llama4" | "gemma4" | "deepseek2" | "qwen35moe");
        RandomModel {
            arch: arch.to_string(),
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            // Qwen3.5's heads are twice n_embd / n_head (16 of 256 at 2,048).
            head_dim: if arch.starts_with("qwen35") { Some(2 * n_embd / n_head.max(1) as u64) } else { None },
            n_expert: if moe { 8 } else { 0 },
            // Llama 4 Scout and Maverick route each token to one expert.
            n_expert_used: if arch == "llama4" { 1 } else if moe { 2 } else { 0 },
            n_ff_exp: if moe { n_ff / 2 } else { 0 },
            n_swa: if matches!(arch, "gemma3" | "gpt-oss" | "gemma4") { 128 } else { 0 },
            ty: GgmlType::F16,
            // Gemma's LM head is its embedding matrix.
            tied_output: arch == "gemma4",
            qkv_bias: matches!(arch, "qwen2" | "gpt-oss" | "glm4moe"),
            context_length: 4096,
            extra: Vec::new(),
            full_every: GEMMA4_FULL_STEP as u32,
            full_kv_heads: None,
            mla_lite: false,
            per_layer_embd: 0,
            shared_kv_layers: 0,
            seed: 1,
        }
    }

    fn head_dim(&self) -> u64 {
        self.head_dim.unwrap_or(self.n_embd / self.n_head.max(1) as u64)
    }

    /// Checks the shape is one the engine and llama.cpp take, and that each matrix row
    /// fills whole blocks of the weight types.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidModel(m));
        let known = ["llama", "mistral3", "qwen2", "qwen3", "qwen3moe", "gemma3", "gemma4", "gpt-oss", "glm4moe", "llama4", "deepseek2", "qwen35", "qwen35moe", "bert", "nomic-bert"];
        if !known.contains(&self.arch.as_str()) {
            return bad(format!("architecture `{}`: use one of {}", self.arch, known.join(", ")));
        }
        if self.n_layer == 0 || self.n_head == 0 || self.n_head_kv == 0 || self.n_head % self.n_head_kv != 0 {
            return bad("need at least one layer and head, and kv heads dividing heads".into());
        }
        let block = self.ty.block_size().max(if self.arch == "gpt-oss" { GgmlType::MXFP4.block_size() } else { 1 });
        // Gemma 4's FFN rows fall back from a K-quant to a 32-block type (see `fitted`).
        let ff_block = if self.arch == "gemma4" { Self::fitted(self.ty, 32).block_size() } else { block };
        let hd = self.head_dim();
        for (what, v, block) in [("embd", self.n_embd, block), ("ff", self.n_ff, ff_block), ("head size x heads", hd * self.n_head as u64, block), ("expert ff", if self.is_moe() { self.n_ff_exp } else { block }, ff_block)] {
            if v == 0 || v % block != 0 {
                return bad(format!("{what} = {v} must be a positive multiple of {block} (the block of {})", self.ty));
            }
        }
        if self.is_moe() && (self.n_expert == 0 || self.n_expert_used == 0 || self.n_expert_used > self.n_expert) {
            return bad("a MoE model needs experts, and no more used per token than there are".into());
        }
        if (self.per_layer_embd > 0 || self.shared_kv_layers > 0) && self.arch != "gemma4" {
            return bad("per-layer inputs and shared K/V are Gemma 4's (E2B/E4B)".into());
        }
        if self.per_layer_embd % block != 0 {
            return bad(format!("per-layer inputs of {} must be a multiple of {block} (the block of {})", self.per_layer_embd, self.ty));
        }
        if let Some(from) = self.shared_kv_from() {
            // llama.cpp takes the layer two before the first shared one as the sliding
            // donor and the one before as the full one.
            if from < 2 || self.gemma4_full(from - 2) || !self.gemma4_full(from - 1) {
                return bad(format!("{} shared layers of {} leave no sliding then full layer before them (full layers every {})", self.shared_kv_layers, self.n_layer, self.full_every));
            }
        }
        Ok(())
    }

    fn is_moe(&self) -> bool {
        matches!(self.arch.as_str(), "qwen3moe" | "gpt-oss" | "glm4moe" | "llama4" | "deepseek2" | "qwen35moe") || (self.arch == "gemma4" && self.n_expert > 0)
    }

    /// Gemma 4 E2B/E4B: the first layer attending with an earlier layer's K/V.
    fn shared_kv_from(&self) -> Option<u32> {
        (self.shared_kv_layers > 0).then(|| self.n_layer.saturating_sub(self.shared_kv_layers))
    }

    /// FFN width of layer `il`: Gemma 4 E2B/E4B's shared-K/V layers are twice as wide.
    fn n_ff_of(&self, il: u32) -> u64 {
        if self.shared_kv_from().is_some_and(|from| il >= from) { 2 * self.n_ff } else { self.n_ff }
    }

    /// Gemma 4's layer kinds: every [`GEMMA4_FULL_STEP`]-th layer attends fully (and the
    /// last, as in the real models), with heads twice the sliding layers' size, half their
    /// KV heads and V taken from K.
    fn gemma4_full(&self, il: u32) -> bool {
        (il + 1) % self.full_every.max(1) == 0 || il + 1 == self.n_layer
    }

    /// Head size and KV heads of layer `il`.
    fn attn_shape(&self, il: u32) -> (u64, u64) {
        if self.arch == "gemma4" && self.gemma4_full(il) {
            (2 * self.head_dim(), self.full_kv_heads.map_or((self.n_head_kv as u64 / 2).max(1), u64::from))
        } else {
            (self.head_dim(), self.n_head_kv as u64)
        }
    }

    /// Whether layer `il` routes experts: GLM's after its dense lead, Llama 4's every
    /// [`LLAMA4_MOE_STEP`]-th, the other MoE archs' all.
    fn is_moe_layer(&self, il: u32) -> bool {
        self.is_moe()
            && match self.arch.as_str() {
                "glm4moe" | "deepseek2" => il as u64 >= GLM_DENSE_LEAD,
                "llama4" => (il as u64 + 1) % LLAMA4_MOE_STEP == 0,
                _ => true,
            }
    }

    /// A tiny embedding model of `arch` for tests: 3 layers, e = 64, 4 heads, context 512;
    /// `bert` and `nomic-bert` pool by mean as their GGUFs say, `qwen3` is given last-token
    /// pooling as Qwen3-Embedding's GGUFs have.
    pub fn tiny_embedder(arch: &str) -> RandomModel {
        let mut m = RandomModel::new(arch, 3, 64, 160, 4, if arch == "qwen3" { 2 } else { 4 });
        m.context_length = 512;
        m.seed = 7;
        if arch == "qwen3" {
            m.extra.push(("pooling_type".into(), Value::U32(3)));
        }
        m
    }

    /// [`RandomModel::tiny_embedder`] of `arch` written once per process (into the temp
    /// folder, with `tokenizer_from`'s vocabulary where the arch takes one): what tests of
    /// the embedding routes serve. Its path.
    pub fn tiny_embedder_file(arch: &str, tokenizer_from: &Path) -> Result<std::path::PathBuf> {
        static WRITTEN: std::sync::Mutex<Vec<(String, std::path::PathBuf)>> = std::sync::Mutex::new(Vec::new());
        let mut written = WRITTEN.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = written.iter().find(|(a, _)| a == arch) {
            return Ok(p.clone());
        }
        let dir = std::env::temp_dir().join(format!("hearth-embedding-models-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
        let path = dir.join(format!("tiny-embed-{arch}.gguf"));
        RandomModel::tiny_embedder(arch).write(tokenizer_from, &path)?;
        written.push((arch.to_string(), path.clone()));
        Ok(path)
    }

    /// The BERT family: bidirectional encoders that only make embeddings (`bert`: learned
    /// positions, separate Q/K/V with biases, GELU FFN; `nomic-bert`: RoPE, fused QKV,
    /// SwiGLU FFN). They carry their own WordPiece vocabulary (see `wordpiece_vocabulary`),
    /// not the tokenizer of `tokenizer_from`.
    pub fn is_encoder(&self) -> bool {
        matches!(self.arch.as_str(), "bert" | "nomic-bert")
    }

    /// Writes the model to `out`, with the tokenizer of `tokenizer_from`; returns the
    /// file's size in bytes.
    pub fn write(&self, tokenizer_from: &Path, out: &Path) -> Result<u64> {
        self.writer(tokenizer_from)?.write_streaming(out, self.filler())?;
        Ok(std::fs::metadata(out).map_err(|e| Error::Io { path: out.to_path_buf(), source: e })?.len())
    }

    /// Writes the model as a split set (`PREFIX-00001-of-0000N.gguf` …, parts of at most
    /// `max_bytes` of tensor data, as gguf-split writes them); returns the parts' paths.
    pub fn write_split(&self, tokenizer_from: &Path, prefix: &str, max_bytes: u64) -> Result<Vec<std::path::PathBuf>> {
        self.writer(tokenizer_from)?.write_split_streaming(prefix, max_bytes, self.filler())
    }

    /// The weights' noise, tensor by tensor, in write order.
    fn filler(&self) -> impl FnMut(&str, GgmlType, &[u64], &mut [u8]) {
        let mut rng = Rng(self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        move |name, ty, dims, buf| {
            if name == "rope_freqs.weight" && ty == GgmlType::F32 {
                // Gemma 4's proportional RoPE: the first quarter of the dims rotate, the
                // rest get a factor so large their angle is ~0 (as its converter writes).
                let n = buf.len() / 4;
                for (i, c) in buf.chunks_exact_mut(4).enumerate() {
                    c.copy_from_slice(&(if i < n.div_ceil(4) { 1.0f32 } else { 1e30 }).to_le_bytes());
                }
                return;
            }
            let (std, center) = spread(name, dims);
            fill(&mut rng, ty, buf, std, center);
        }
    }

    /// DeepSeek 2's latent attention sizes from the head size `hd`: (rotated dims, the
    /// unrotated query/key part, value head, compressed K/V rank, low-rank query rank), in
    /// the proportions of DeepSeek V3's (64, 128, 128, 512, 1536) at a quarter of the query
    /// rank.
    fn mla_dims(&self) -> (u64, u64, u64, u64, u64) {
        let hd = self.head_dim();
        (hd, 2 * hd, 2 * hd, 4 * hd, 3 * hd)
    }

    /// DeepSeek 2's blocks: latent attention, a dense first layer, then sigmoid-routed
    /// experts with a selection bias and a shared expert.
    fn deepseek2_layers(&self, mut w: GgufWriter, e: u64, n_exp: u64, ffe: u64) -> Result<GgufWriter> {
        let (ty, f32t) = (self.ty, GgmlType::F32);
        let (rot, nope, hv, lora, ql) = self.mla_dims();
        let n_head = self.n_head as u64;
        for il in 0..self.n_layer {
            let t = |n: &str| format!("blk.{il}.{n}");
            w.add_tensor_later(t("attn_norm.weight"), f32t, &[e])?;
            if !self.mla_lite {
                w.add_tensor_later(t("attn_q_a_norm.weight"), f32t, &[ql])?;
            }
            w.add_tensor_later(t("attn_kv_a_norm.weight"), f32t, &[lora])?;
            if self.mla_lite {
                w.add_tensor_later(t("attn_q.weight"), ty, &[e, n_head * (nope + rot)])?;
            } else {
                w.add_tensor_later(t("attn_q_a.weight"), ty, &[e, ql])?;
                w.add_tensor_later(t("attn_q_b.weight"), ty, &[ql, n_head * (nope + rot)])?;
            }
            w.add_tensor_later(t("attn_kv_a_mqa.weight"), ty, &[e, lora + rot])?;
            w.add_tensor_later(t("attn_k_b.weight"), ty, &[nope, lora, n_head])?;
            w.add_tensor_later(t("attn_v_b.weight"), ty, &[lora, hv, n_head])?;
            w.add_tensor_later(t("attn_output.weight"), ty, &[n_head * hv, e])?;
            w.add_tensor_later(t("ffn_norm.weight"), f32t, &[e])?;
            if self.is_moe_layer(il) {
                w.add_tensor_later(t("ffn_gate_inp.weight"), f32t, &[e, n_exp])?;
                w.add_tensor_later(t("exp_probs_b.bias"), f32t, &[n_exp])?;
                w.add_tensor_later(t("ffn_gate_exps.weight"), ty, &[e, ffe, n_exp])?;
                w.add_tensor_later(t("ffn_up_exps.weight"), ty, &[e, ffe, n_exp])?;
                w.add_tensor_later(t("ffn_down_exps.weight"), ty, &[ffe, e, n_exp])?;
                w.add_tensor_later(t("ffn_gate_shexp.weight"), ty, &[e, ffe])?;
                w.add_tensor_later(t("ffn_up_shexp.weight"), ty, &[e, ffe])?;
                w.add_tensor_later(t("ffn_down_shexp.weight"), ty, &[ffe, e])?;
            } else {
                w.add_tensor_later(t("ffn_gate.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_up.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_down.weight"), self.matrix_type("ffn_down.weight", il), &[self.n_ff, e])?;
            }
        }
        Ok(w)
    }

    /// Qwen3.5's linear attention sizes from the head size `hd`: (state size = key and value
    /// head, key heads, value heads), in the proportions of Qwen3.5-35B-A3B's (128, 16, 32)
    /// to its 16 attention heads of 256: heads of `hd / 2`, as many key heads as attention
    /// heads, twice as many value heads.
    fn qwen35_linear(&self) -> (u64, u64, u64) {
        let hd = self.head_dim();
        (hd / 2, self.n_head as u64, 2 * self.n_head as u64)
    }

    /// Qwen3.5's recurrent layers: all but every `full_every`-th.
    fn qwen35_recurrent(&self, il: u32) -> bool {
        (il + 1) % self.full_every.max(1) != 0
    }

    /// Qwen3.5's blocks (dense or MoE), in the order its converter writes them.
    fn qwen35_layers(&self, mut w: GgufWriter, e: u64, n_exp: u64, ffe: u64) -> Result<GgufWriter> {
        let (ty, f32t) = (self.ty, GgmlType::F32);
        let hd = self.head_dim();
        let (q, kv) = (hd * self.n_head as u64, hd * self.n_head_kv as u64);
        let (sh, nk, nv) = self.qwen35_linear();
        let (ch, vd) = (sh * (2 * nk + nv), sh * nv);
        for il in 0..self.n_layer {
            let t = |n: &str| format!("blk.{il}.{n}");
            w.add_tensor_later(t("attn_norm.weight"), f32t, &[e])?;
            if self.qwen35_recurrent(il) {
                w.add_tensor_later(t("attn_qkv.weight"), ty, &[e, ch])?;
                w.add_tensor_later(t("attn_gate.weight"), ty, &[e, vd])?;
                w.add_tensor_later(t("ssm_conv1d.weight"), f32t, &[QWEN35_CONV_KERNEL, ch])?;
                w.add_tensor_later(t("ssm_dt.bias"), f32t, &[nv])?;
                w.add_tensor_later(t("ssm_a"), f32t, &[nv])?;
                w.add_tensor_later(t("ssm_beta.weight"), ty, &[e, nv])?;
                w.add_tensor_later(t("ssm_alpha.weight"), ty, &[e, nv])?;
                w.add_tensor_later(t("ssm_norm.weight"), f32t, &[sh])?;
                w.add_tensor_later(t("ssm_out.weight"), ty, &[vd, e])?;
            } else {
                w.add_tensor_later(t("attn_q.weight"), ty, &[e, 2 * q])?;
                w.add_tensor_later(t("attn_k.weight"), ty, &[e, kv])?;
                w.add_tensor_later(t("attn_v.weight"), self.matrix_type("attn_v.weight", il), &[e, kv])?;
                w.add_tensor_later(t("attn_output.weight"), ty, &[q, e])?;
                w.add_tensor_later(t("attn_q_norm.weight"), f32t, &[hd])?;
                w.add_tensor_later(t("attn_k_norm.weight"), f32t, &[hd])?;
            }
            w.add_tensor_later(t("post_attention_norm.weight"), f32t, &[e])?;
            if self.is_moe() {
                w.add_tensor_later(t("ffn_gate_inp.weight"), f32t, &[e, n_exp])?;
                w.add_tensor_later(t("ffn_gate_exps.weight"), ty, &[e, ffe, n_exp])?;
                w.add_tensor_later(t("ffn_up_exps.weight"), ty, &[e, ffe, n_exp])?;
                w.add_tensor_later(t("ffn_down_exps.weight"), ty, &[ffe, e, n_exp])?;
                w.add_tensor_later(t("ffn_gate_inp_shexp.weight"), f32t, &[e])?;
                w.add_tensor_later(t("ffn_gate_shexp.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_up_shexp.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_down_shexp.weight"), self.matrix_type("ffn_down.weight", il), &[self.n_ff, e])?;
            } else {
                w.add_tensor_later(t("ffn_gate.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_up.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_down.weight"), self.matrix_type("ffn_down.weight", il), &[self.n_ff, e])?;
            }
        }
        Ok(w)
    }

    /// Gemma 4's blocks, in the order its converter writes them.
    fn gemma4_layers(&self, mut w: GgufWriter, e: u64, n_exp: u64, ffe: u64) -> Result<GgufWriter> {
        let (ty, f32t) = (self.ty, GgmlType::F32);
        for il in 0..self.n_layer {
            let t = |n: &str| format!("blk.{il}.{n}");
            let (hd, n_kv) = self.attn_shape(il);
            let (q, kv) = (hd * self.n_head as u64, hd * n_kv);
            w.add_tensor_later(t("attn_norm.weight"), f32t, &[e])?;
            // A layer attending with an earlier layer's K/V has no K or V of its own.
            let own_kv = self.shared_kv_from().is_none_or(|from| il < from);
            w.add_tensor_later(t("attn_q.weight"), ty, &[e, q])?;
            if own_kv {
                w.add_tensor_later(t("attn_k.weight"), ty, &[e, kv])?;
            }
            if own_kv && !self.gemma4_full(il) {
                w.add_tensor_later(t("attn_v.weight"), self.matrix_type("attn_v.weight", il), &[e, kv])?;
            }
            w.add_tensor_later(t("attn_output.weight"), Self::fitted(ty, q), &[q, e])?;
            w.add_tensor_later(t("attn_q_norm.weight"), f32t, &[hd])?;
            if own_kv {
                w.add_tensor_later(t("attn_k_norm.weight"), f32t, &[hd])?;
            }
            w.add_tensor_later(t("post_attention_norm.weight"), f32t, &[e])?;
            w.add_tensor_later(t("ffn_norm.weight"), f32t, &[e])?;
            let ff = self.n_ff_of(il);
            w.add_tensor_later(t("ffn_gate.weight"), ty, &[e, ff])?;
            w.add_tensor_later(t("ffn_up.weight"), ty, &[e, ff])?;
            w.add_tensor_later(t("ffn_down.weight"), Self::fitted(self.matrix_type("ffn_down.weight", il), ff), &[ff, e])?;
            w.add_tensor_later(t("post_ffw_norm.weight"), f32t, &[e])?;
            if self.per_layer_embd > 0 {
                let pl = self.per_layer_embd;
                w.add_tensor_later(t("inp_gate.weight"), ty, &[e, pl])?;
                w.add_tensor_later(t("proj.weight"), Self::fitted(ty, pl), &[pl, e])?;
                w.add_tensor_later(t("post_norm.weight"), f32t, &[e])?;
            }
            if self.is_moe() {
                w.add_tensor_later(t("ffn_gate_inp.weight"), f32t, &[e, n_exp])?;
                w.add_tensor_later(t("ffn_gate_inp.scale"), f32t, &[e])?;
                w.add_tensor_later(t("pre_ffw_norm_2.weight"), f32t, &[e])?;
                w.add_tensor_later(t("post_ffw_norm_1.weight"), f32t, &[e])?;
                w.add_tensor_later(t("post_ffw_norm_2.weight"), f32t, &[e])?;
                // Gate and up stacked in one matrix, as the converter writes Gemma 4's.
                w.add_tensor_later(t("ffn_gate_up_exps.weight"), ty, &[e, 2 * ffe, n_exp])?;
                w.add_tensor_later(t("ffn_down_exps.weight"), Self::fitted(ty, ffe), &[ffe, e, n_exp])?;
                w.add_tensor_later(t("ffn_down_exps.scale"), f32t, &[n_exp])?;
            }
            w.add_tensor_later(t("layer_output_scale.weight"), f32t, &[1])?;
        }
        Ok(w)
    }

    /// `ty` for a matrix whose rows hold `ne0` elements: a K-quant needs whole super-blocks
    /// of 256, and where a row is not, llama-quantize falls back (Q4_K to Q5_0, Q6_K to
    /// Q8_0), as it does for Gemma 4's 2,112- and 704-wide FFN rows.
    fn fitted(ty: GgmlType, ne0: u64) -> GgmlType {
        match ty {
            GgmlType::Q4_K if ne0 % 256 != 0 => GgmlType::Q5_0,
            GgmlType::Q6_K if ne0 % 256 != 0 => GgmlType::Q8_0,
            ty => ty,
        }
    }

    /// The type of the matrix `name` of layer `il` (see [`RandomModel::ty`]).
    fn matrix_type(&self, name: &str, il: u32) -> GgmlType {
        if self.ty != GgmlType::Q4_K {
            return self.ty;
        }
        // llama-quantize's `use_more_bits`: the first and last eighth, and every third
        // layer between.
        let n = self.n_layer;
        let more_bits = il < n / 8 || il >= 7 * n / 8 || (il - n / 8) % 3 == 2;
        match name {
            "output.weight" => GgmlType::Q6_K,
            "attn_v.weight" | "ffn_down.weight" if more_bits => GgmlType::Q6_K,
            _ => GgmlType::Q4_K,
        }
    }

    /// Everything but the weights' bytes: metadata, the tokenizer, the tensor list.
    fn writer(&self, tokenizer_from: &Path) -> Result<GgufWriter> {
        self.validate()?;
        if self.is_encoder() {
            return self.encoder_writer();
        }
        let real = GgufFile::open(tokenizer_from)?;
        // A vocabulary-only file (see `write_vocabulary`) has no embedding to size it by.
        let n_vocab = real
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .or_else(|| real.meta().get("tokenizer.ggml.tokens").and_then(Value::as_array).map(|t| t.len() as u64))
            .ok_or_else(|| Error::InvalidModel(format!("{} has neither token_embd.weight nor a token list to take the vocabulary size from", tokenizer_from.display())))?;
        let mut w = GgufWriter::new();
        for (k, v) in real.meta().metadata() {
            if k.starts_with("tokenizer.") {
                w.set(k.clone(), v.clone())?;
            }
        }
        let a = self.arch.as_str();
        let (e, hd) = (self.n_embd, self.head_dim());
        let (q, kv) = (hd * self.n_head as u64, hd * self.n_head_kv as u64);
        w.set("general.architecture", Value::from(a))?;
        w.set("general.name", Value::from(format!("random-{a}-{}x{e}-{}", self.n_layer, self.ty)))?;
        if self.ty == GgmlType::Q4_K {
            // LLAMA_FTYPE_MOSTLY_Q4_K_M: what the file is, as `hearth models` shows it.
            w.set("general.file_type", Value::U32(15))?;
        }
        let u32k = |w: &mut GgufWriter, k: &str, v: u64| w.set(format!("{a}.{k}"), Value::U32(v as u32));
        // GLM: one multi-token-prediction block after the layers, as GLM-4.5 files have;
        // its tensors are left out (llama.cpp then loads the trunk only, as hearth runs it).
        let glm = a == "glm4moe";
        u32k(&mut w, "block_count", self.n_layer as u64 + u64::from(glm))?;
        if glm {
            u32k(&mut w, "nextn_predict_layers", 1)?;
            u32k(&mut w, "leading_dense_block_count", GLM_DENSE_LEAD)?;
            u32k(&mut w, "expert_shared_count", 1)?;
            u32k(&mut w, "expert_gating_func", 2)?;
            w.set(format!("{a}.expert_weights_norm"), Value::Bool(true))?;
            w.set(format!("{a}.expert_weights_scale"), Value::F32(2.5))?;
        }
        u32k(&mut w, "context_length", self.context_length as u64)?;
        u32k(&mut w, "embedding_length", e)?;
        u32k(&mut w, "feed_forward_length", self.n_ff)?;
        u32k(&mut w, "attention.head_count", self.n_head as u64)?;
        u32k(&mut w, "attention.head_count_kv", self.n_head_kv as u64)?;
        u32k(&mut w, "attention.key_length", hd)?;
        u32k(&mut w, "attention.value_length", hd)?;
        // GLM rotates half of each head.
        u32k(&mut w, "rope.dimension_count", if glm { hd / 2 } else { hd })?;
        w.set(format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6))?;
        w.set(format!("{a}.rope.freq_base"), Value::F32(1_000_000.0))?;
        if a == "llama4" {
            u32k(&mut w, "interleave_moe_layer_step", LLAMA4_MOE_STEP)?;
        }
        if self.is_moe() {
            u32k(&mut w, "expert_count", self.n_expert as u64)?;
            u32k(&mut w, "expert_used_count", self.n_expert_used as u64)?;
            u32k(&mut w, "expert_feed_forward_length", self.n_ff_exp)?;
        }
        if self.n_swa > 0 && matches!(a, "gemma3" | "gpt-oss" | "gemma4") {
            u32k(&mut w, "attention.sliding_window", self.n_swa as u64)?;
        }
        if a == "gemma4" {
            let layers = 0..self.n_layer;
            let u32s = |v: Vec<u64>| Value::Array { elem: crate::gguf::ValueType::U32, items: v.into_iter().map(|x| Value::U32(x as u32)).collect() };
            w.set(format!("{a}.attention.head_count_kv"), u32s(layers.clone().map(|il| self.attn_shape(il).1).collect()))?;
            w.set(format!("{a}.attention.sliding_window_pattern"), Value::Array { elem: crate::gguf::ValueType::Bool, items: layers.map(|il| Value::Bool(!self.gemma4_full(il))).collect() })?;
            // The full layers' (twice the sliding ones'), then the sliding layers' own.
            u32k(&mut w, "attention.key_length", 2 * hd)?;
            u32k(&mut w, "attention.value_length", 2 * hd)?;
            u32k(&mut w, "rope.dimension_count", 2 * hd)?;
            u32k(&mut w, "attention.key_length_swa", hd)?;
            u32k(&mut w, "attention.value_length_swa", hd)?;
            u32k(&mut w, "rope.dimension_count_swa", hd)?;
            w.set(format!("{a}.rope.freq_base_swa"), Value::F32(10_000.0))?;
            w.set(format!("{a}.final_logit_softcapping"), Value::F32(30.0))?;
            u32k(&mut w, "attention.shared_kv_layers", self.shared_kv_layers as u64)?;
            u32k(&mut w, "embedding_length_per_layer_input", self.per_layer_embd)?;
            if self.shared_kv_layers > 0 {
                w.set(format!("{a}.feed_forward_length"), u32s((0..self.n_layer).map(|il| self.n_ff_of(il)).collect()))?;
            }
        }
        if a == "deepseek2" {
            // One cached row per token: the compressed K/V, then the rotated key part.
            let (rot, nope, hv, lora, ql) = self.mla_dims();
            u32k(&mut w, "attention.head_count_kv", 1)?;
            u32k(&mut w, "attention.key_length", lora + rot)?;
            u32k(&mut w, "attention.value_length", lora)?;
            u32k(&mut w, "attention.key_length_mla", nope + rot)?;
            u32k(&mut w, "attention.value_length_mla", hv)?;
            u32k(&mut w, "rope.dimension_count", rot)?;
            if !self.mla_lite {
                u32k(&mut w, "attention.q_lora_rank", ql)?;
            }
            u32k(&mut w, "attention.kv_lora_rank", lora)?;
            u32k(&mut w, "leading_dense_block_count", GLM_DENSE_LEAD)?;
            u32k(&mut w, "expert_shared_count", 1)?;
            u32k(&mut w, "expert_gating_func", 2)?;
            w.set(format!("{a}.expert_weights_norm"), Value::Bool(true))?;
            w.set(format!("{a}.expert_weights_scale"), Value::F32(2.5))?;
        }
        if matches!(a, "qwen35" | "qwen35moe") {
            let (sh, nk, nv) = self.qwen35_linear();
            // A quarter of each attention head rotates, in sections of 11, 11 and 10 of its
            // pairs as Qwen3.5's 64 rotated dims of 256 (scaled to the head).
            let rot = hd / 4;
            u32k(&mut w, "rope.dimension_count", rot)?;
            let pairs = rot / 2;
            let s0 = pairs * 11 / 32;
            let sections = [s0, s0, pairs - 2 * s0, 0];
            w.set(format!("{a}.rope.dimension_sections"), Value::Array { elem: crate::gguf::ValueType::I32, items: sections.iter().map(|&x| Value::I32(x as i32)).collect() })?;
            u32k(&mut w, "ssm.conv_kernel", QWEN35_CONV_KERNEL)?;
            u32k(&mut w, "ssm.state_size", sh)?;
            u32k(&mut w, "ssm.group_count", nk)?;
            u32k(&mut w, "ssm.time_step_rank", nv)?;
            u32k(&mut w, "ssm.inner_size", sh * nv)?;
            u32k(&mut w, "full_attention_interval", self.full_every.max(1) as u64)?;
            if a == "qwen35moe" {
                u32k(&mut w, "expert_shared_feed_forward_length", self.n_ff)?;
            }
        }
        for (k, v) in &self.extra {
            w.set(format!("{a}.{k}"), v.clone())?;
        }

        let ty = self.ty;
        let f32t = GgmlType::F32;
        // Tensors in the order llama.cpp's converters write them.
        w.add_tensor_later("token_embd.weight", ty, &[e, n_vocab])?;
        w.add_tensor_later("output_norm.weight", f32t, &[e])?;
        if !self.tied_output {
            w.add_tensor_later("output.weight", self.matrix_type("output.weight", 0), &[e, n_vocab])?;
        }
        let (n_exp, ffe) = (self.n_expert as u64, self.n_ff_exp);
        if a == "gemma4" {
            // "Proportional" RoPE of the full layers: frequency factors (see `filler`).
            w.add_tensor_later("rope_freqs.weight", f32t, &[hd])?;
            if self.per_layer_embd > 0 {
                let all = self.per_layer_embd * self.n_layer as u64;
                w.add_tensor_later("per_layer_token_embd.weight", ty, &[all, n_vocab])?;
                w.add_tensor_later("per_layer_model_proj.weight", ty, &[e, all])?;
                w.add_tensor_later("per_layer_proj_norm.weight", f32t, &[self.per_layer_embd])?;
            }
            return self.gemma4_layers(w, e, n_exp, ffe);
        }
        if a == "deepseek2" {
            return self.deepseek2_layers(w, e, n_exp, ffe);
        }
        if matches!(a, "qwen35" | "qwen35moe") {
            return self.qwen35_layers(w, e, n_exp, ffe);
        }
        for il in 0..self.n_layer {
            let t = |n: &str| format!("blk.{il}.{n}");
            w.add_tensor_later(t("attn_norm.weight"), f32t, &[e])?;
            w.add_tensor_later(t("attn_q.weight"), ty, &[e, q])?;
            w.add_tensor_later(t("attn_k.weight"), ty, &[e, kv])?;
            w.add_tensor_later(t("attn_v.weight"), self.matrix_type("attn_v.weight", il), &[e, kv])?;
            w.add_tensor_later(t("attn_output.weight"), ty, &[q, e])?;
            if self.qkv_bias {
                w.add_tensor_later(t("attn_q.bias"), f32t, &[q])?;
                w.add_tensor_later(t("attn_k.bias"), f32t, &[kv])?;
                w.add_tensor_later(t("attn_v.bias"), f32t, &[kv])?;
            }
            if matches!(a, "qwen3" | "qwen3moe" | "gemma3") {
                w.add_tensor_later(t("attn_q_norm.weight"), f32t, &[hd])?;
                w.add_tensor_later(t("attn_k_norm.weight"), f32t, &[hd])?;
            }
            match a {
                "gemma3" => {
                    w.add_tensor_later(t("post_attention_norm.weight"), f32t, &[e])?;
                    w.add_tensor_later(t("post_ffw_norm.weight"), f32t, &[e])?;
                }
                "gpt-oss" => {
                    w.add_tensor_later(t("attn_output.bias"), f32t, &[e])?;
                    w.add_tensor_later(t("attn_sinks.weight"), f32t, &[self.n_head as u64])?;
                    w.add_tensor_later(t("post_attention_norm.weight"), f32t, &[e])?;
                }
                "glm4moe" => w.add_tensor_later(t("post_attention_norm.weight"), f32t, &[e])?,
                _ => {}
            }
            if a != "gpt-oss" && !glm {
                w.add_tensor_later(t("ffn_norm.weight"), f32t, &[e])?;
            }
            if self.is_moe_layer(il) {
                // The router stays F32, as converters keep it.
                w.add_tensor_later(t("ffn_gate_inp.weight"), f32t, &[e, n_exp])?;
                let exp_ty = if a == "gpt-oss" { GgmlType::MXFP4 } else { ty };
                w.add_tensor_later(t("ffn_gate_exps.weight"), exp_ty, &[e, ffe, n_exp])?;
                w.add_tensor_later(t("ffn_up_exps.weight"), exp_ty, &[e, ffe, n_exp])?;
                w.add_tensor_later(t("ffn_down_exps.weight"), exp_ty, &[ffe, e, n_exp])?;
                if glm {
                    w.add_tensor_later(t("exp_probs_b.bias"), f32t, &[n_exp])?;
                }
                if glm || a == "llama4" {
                    w.add_tensor_later(t("ffn_gate_shexp.weight"), ty, &[e, ffe])?;
                    w.add_tensor_later(t("ffn_up_shexp.weight"), ty, &[e, ffe])?;
                    w.add_tensor_later(t("ffn_down_shexp.weight"), ty, &[ffe, e])?;
                }
                if a == "gpt-oss" {
                    w.add_tensor_later(t("ffn_gate_inp.bias"), f32t, &[n_exp])?;
                    w.add_tensor_later(t("ffn_gate_exps.bias"), f32t, &[ffe, n_exp])?;
                    w.add_tensor_later(t("ffn_up_exps.bias"), f32t, &[ffe, n_exp])?;
                    w.add_tensor_later(t("ffn_down_exps.bias"), f32t, &[e, n_exp])?;
                }
            } else {
                w.add_tensor_later(t("ffn_gate.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_up.weight"), ty, &[e, self.n_ff])?;
                w.add_tensor_later(t("ffn_down.weight"), self.matrix_type("ffn_down.weight", il), &[self.n_ff, e])?;
            }
        }
        Ok(w)
    }
}

impl RandomModel {
    /// `bert` and `nomic-bert`, tensor for tensor as llama.cpp's converter writes
    /// all-MiniLM / bge and nomic-embed-text: LayerNorm (weight and bias) after the
    /// embeddings and after each sub-layer, mean pooling, non-causal attention.
    fn encoder_writer(&self) -> Result<GgufWriter> {
        let a = self.arch.as_str();
        let nomic = a == "nomic-bert";
        let mut w = GgufWriter::new();
        let n_vocab = wordpiece_vocabulary(&mut w)?;
        let (e, hd) = (self.n_embd, self.head_dim());
        let kv = hd * self.n_head_kv as u64;
        w.set("general.architecture", Value::from(a))?;
        w.set("general.name", Value::from(format!("random-{a}-{}x{e}-{}", self.n_layer, self.ty)))?;
        let u32k = |w: &mut GgufWriter, k: &str, v: u64| w.set(format!("{a}.{k}"), Value::U32(v as u32));
        u32k(&mut w, "block_count", self.n_layer as u64)?;
        u32k(&mut w, "context_length", self.context_length as u64)?;
        u32k(&mut w, "embedding_length", e)?;
        u32k(&mut w, "feed_forward_length", self.n_ff)?;
        u32k(&mut w, "attention.head_count", self.n_head as u64)?;
        u32k(&mut w, "attention.head_count_kv", self.n_head_kv as u64)?;
        w.set(format!("{a}.attention.layer_norm_epsilon"), Value::F32(1e-12))?;
        w.set(format!("{a}.attention.causal"), Value::Bool(false))?;
        // 1 = mean, as both families' sentence-transformers configs pool.
        u32k(&mut w, "pooling_type", 1)?;
        if nomic {
            w.set(format!("{a}.rope.freq_base"), Value::F32(1000.0))?;
        }
        for (k, v) in &self.extra {
            w.set(format!("{a}.{k}"), v.clone())?;
        }
        let (ty, f32t) = (self.ty, GgmlType::F32);
        w.add_tensor_later("token_embd.weight", ty, &[e, n_vocab])?;
        w.add_tensor_later("token_types.weight", f32t, &[e, 2])?;
        if !nomic {
            w.add_tensor_later("position_embd.weight", f32t, &[e, self.context_length as u64])?;
        }
        w.add_tensor_later("token_embd_norm.weight", f32t, &[e])?;
        w.add_tensor_later("token_embd_norm.bias", f32t, &[e])?;
        for il in 0..self.n_layer {
            let t = |n: &str| format!("blk.{il}.{n}");
            if nomic {
                w.add_tensor_later(t("attn_qkv.weight"), ty, &[e, e + 2 * kv])?;
            } else {
                for (m, rows) in [("attn_q", e), ("attn_k", kv), ("attn_v", kv)] {
                    w.add_tensor_later(t(&format!("{m}.weight")), ty, &[e, rows])?;
                    w.add_tensor_later(t(&format!("{m}.bias")), f32t, &[rows])?;
                }
            }
            w.add_tensor_later(t("attn_output.weight"), ty, &[e, e])?;
            if !nomic {
                w.add_tensor_later(t("attn_output.bias"), f32t, &[e])?;
            }
            w.add_tensor_later(t("attn_output_norm.weight"), f32t, &[e])?;
            w.add_tensor_later(t("attn_output_norm.bias"), f32t, &[e])?;
            w.add_tensor_later(t("ffn_up.weight"), ty, &[e, self.n_ff])?;
            if nomic {
                w.add_tensor_later(t("ffn_gate.weight"), ty, &[e, self.n_ff])?;
            } else {
                w.add_tensor_later(t("ffn_up.bias"), f32t, &[self.n_ff])?;
            }
            w.add_tensor_later(t("ffn_down.weight"), ty, &[self.n_ff, e])?;
            if !nomic {
                w.add_tensor_later(t("ffn_down.bias"), f32t, &[e])?;
            }
            w.add_tensor_later(t("layer_output_norm.weight"), f32t, &[e])?;
            w.add_tensor_later(t("layer_output_norm.bias"), f32t, &[e])?;
        }
        Ok(w)
    }
}

/// Common English words for the WordPiece vocabulary: enough that real text tokenizes
/// mostly into whole words, as it does with a real BERT vocabulary.
const WORDPIECE_WORDS: &str = "the of and to a in is that for it as was with be by on not he this are or his from at which but have an they you were her she there one all we their been has would when if will more no who so can said its what do about into than them only other up some could time these two may then first any like my now over such our also new out most how very after made between many years way where before must because through those just both well each under much same even used people model models layer layers memory device devices token tokens cluster home network speed fast slow text data work system paper";

/// Word endings, written as WordPiece continuations.
const WORDPIECE_SUFFIXES: [&str; 12] = ["s", "ed", "ing", "er", "ly", "tion", "al", "es", "est", "ment", "ness", "able"];

/// Writes a BERT-style WordPiece vocabulary into `w` (llama.cpp's `bert` tokenizer: ids
/// 0 [PAD], 1-99 unused, 100 [UNK], 101 [CLS], 102 [SEP], 103 [MASK] as in BERT's own
/// vocabulary; then words and every printable ASCII character, word-initial ones with the
/// `▁` marker the converter writes for them, and continuations bare); returns its size.
fn wordpiece_vocabulary(w: &mut GgufWriter) -> Result<u64> {
    const CONTROL: i32 = 3;
    const NORMAL: i32 = 1;
    let mut tokens: Vec<String> = vec!["[PAD]".into()];
    tokens.extend((0..99).map(|i| format!("[unused{i}]")));
    tokens.extend(["[UNK]", "[CLS]", "[SEP]", "[MASK]"].map(String::from));
    let n_special = tokens.len();
    let chars = (0x21u8..0x7f).map(|c| (c as char).to_ascii_lowercase().to_string()).collect::<std::collections::BTreeSet<_>>();
    for c in &chars {
        tokens.push(format!("\u{2581}{c}"));
        tokens.push(c.clone());
    }
    tokens.extend(WORDPIECE_WORDS.split_whitespace().map(|wd| format!("\u{2581}{wd}")));
    tokens.extend(WORDPIECE_SUFFIXES.iter().filter(|s| s.len() > 1).map(|s| s.to_string()));
    // A token listed twice makes llama.cpp abort on load: keep each one's first place.
    let mut seen = std::collections::HashSet::new();
    tokens.retain(|t| seen.insert(t.clone()));
    let types = (0..tokens.len()).map(|i| Value::I32(if i < n_special { CONTROL } else { NORMAL })).collect();
    let n = tokens.len() as u64;
    w.set("tokenizer.ggml.model", Value::from("bert"))?;
    w.set("tokenizer.ggml.tokens", Value::Array { elem: crate::gguf::ValueType::String, items: tokens.into_iter().map(Value::String).collect() })?;
    w.set("tokenizer.ggml.token_type", Value::Array { elem: crate::gguf::ValueType::I32, items: types })?;
    w.set("tokenizer.ggml.token_type_count", Value::U32(2))?;
    w.set("tokenizer.ggml.cls_token_id", Value::U32(101))?;
    w.set("tokenizer.ggml.seperator_token_id", Value::U32(102))?;
    w.set("tokenizer.ggml.unknown_token_id", Value::U32(100))?;
    w.set("tokenizer.ggml.padding_token_id", Value::U32(0))?;
    w.set("tokenizer.ggml.mask_token_id", Value::U32(103))?;
    Ok(n)
}

/// Llama 4 random models: every second layer routes experts (as Maverick; Scout's every
/// layer does), so a tiny model has both kinds.
const LLAMA4_MOE_STEP: u64 = 2;

/// Every this-many-th layer of a random Gemma 4 attends fully by default (the real ones:
/// 6; tiny models need one within their 3 layers).
const GEMMA4_FULL_STEP: u64 = 2;

/// Qwen3.5's convolution taps (its `linear_conv_kernel_dim`).
const QWEN35_CONV_KERNEL: u64 = 4;

/// GLM random models: layers before this have a dense FFN.
const GLM_DENSE_LEAD: u64 = 1;

/// The spread and centre of a tensor's values: matrices 1/sqrt(fan-in) so each layer's
/// output stays near unit scale, embeddings unit rows, norms around 1, biases and sinks
/// around 0, the router wide enough that tokens pick different experts.
fn spread(name: &str, dims: &[u64]) -> (f32, f32) {
    let fan_in = dims.first().copied().unwrap_or(1).max(1) as f32;
    if name == "token_embd.weight" {
        (1.0, 0.0)
    } else if name.ends_with("norm.weight") || name.ends_with(".scale") || name.ends_with("layer_output_scale.weight") {
        (0.2, 1.0)
    } else if name.ends_with(".ssm_a") {
        // Qwen3.5's decay rate, -exp(A_log): negative, so the state decays.
        (0.3, -1.0)
    } else if name.ends_with(".bias") || name.ends_with("attn_sinks.weight") {
        (0.3, 0.0)
    } else if name.ends_with("ffn_gate_inp.weight") {
        (2.0 / fan_in.sqrt(), 0.0)
    } else {
        (1.0 / fan_in.sqrt(), 0.0)
    }
}

/// xorshift64*: fast, seeded, good enough for noise weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// f32 -> IEEE half (round toward zero; subnormals flush to zero): enough for weights.
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    if exp >= 31 {
        return sign | 0x7c00;
    }
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

/// Fills `buf` with a tensor of type `ty` whose values have about `std` spread around
/// `center` (F32 and F16; the quantized types are centred on 0).
fn fill(rng: &mut Rng, ty: GgmlType, buf: &mut [u8], std: f32, center: f32) {
    // Uniform in [-a, a) has std a/sqrt(3).
    let a = std * 3f32.sqrt();
    match ty {
        GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&(center + a * rng.unit()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&f16_bits(center + a * rng.unit()).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // Blocks of 32: an f16 scale d and 32 int8; uniform int8 has std ~73.9.
            let d = f16_bits(std / 73.9).to_le_bytes();
            for block in buf.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
                for c in block[2..].chunks_mut(8) {
                    let r = rng.next().to_le_bytes();
                    c.copy_from_slice(&r[..c.len()]);
                }
            }
        }
        GgmlType::Q4_0 => {
            // Blocks of 32: an f16 scale d and 16 bytes of nibbles q, value d*(q-8); std ~4.6.
            let d = f16_bits(std / 4.6).to_le_bytes();
            for block in buf.chunks_exact_mut(18) {
                block[..2].copy_from_slice(&d);
                block[2..10].copy_from_slice(&rng.next().to_le_bytes());
                block[10..18].copy_from_slice(&rng.next().to_le_bytes());
            }
        }
        GgmlType::Q5_0 => {
            // Blocks of 32: an f16 scale d, 4 bytes of high bits and 16 of low nibbles: a
            // 5-bit q, value d*(q-16); std ~9.2.
            let d = f16_bits(std / 9.2).to_le_bytes();
            for block in buf.chunks_exact_mut(22) {
                block[..2].copy_from_slice(&d);
                block[2..6].copy_from_slice(&rng.next().to_le_bytes()[..4]);
                block[6..14].copy_from_slice(&rng.next().to_le_bytes());
                block[14..22].copy_from_slice(&rng.next().to_le_bytes());
            }
        }
        GgmlType::MXFP4 => {
            // Blocks of 32: an E8M0 exponent e and 16 bytes of FP4 nibbles; ggml reads a
            // value as k * 2^(e-128) with k in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}, whose std
            // over uniform nibbles is ~5.5.
            let e = (128.0 + (std / 5.5).log2()).round().clamp(1.0, 254.0) as u8;
            for block in buf.chunks_exact_mut(17) {
                block[0] = e;
                block[1..9].copy_from_slice(&rng.next().to_le_bytes());
                block[9..17].copy_from_slice(&rng.next().to_le_bytes());
            }
        }
        GgmlType::Q4_K => {
            // Super-blocks of 256: f16 d and dmin, 12 bytes packing eight 6-bit scales and
            // eight 6-bit mins, 128 bytes of nibbles q; value d*sc*q - dmin*m. Every scale
            // and min is 32 (0xA0 carries the high bits of the last four), dmin = 7.5 d
            // centres the uniform nibbles (std 4.61) on 0.
            let d = std / (32.0 * 4.61);
            let (dd, dmin) = (f16_bits(d).to_le_bytes(), f16_bits(7.5 * d).to_le_bytes());
            const SCALES: [u8; 12] = [0xA0, 0xA0, 0xA0, 0xA0, 0xA0, 0xA0, 0xA0, 0xA0, 0, 0, 0, 0];
            for block in buf.chunks_exact_mut(144) {
                block[..2].copy_from_slice(&dd);
                block[2..4].copy_from_slice(&dmin);
                block[4..16].copy_from_slice(&SCALES);
                for c in block[16..].chunks_exact_mut(8) {
                    c.copy_from_slice(&rng.next().to_le_bytes());
                }
            }
        }
        GgmlType::Q6_K => {
            // Super-blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
            // int8 scales, f16 d; value d*scale*(q-32), q uniform in 0..64 (std 18.5).
            let d = f16_bits(std / (16.0 * 18.5)).to_le_bytes();
            for block in buf.chunks_exact_mut(210) {
                for c in block[..192].chunks_exact_mut(8) {
                    c.copy_from_slice(&rng.next().to_le_bytes());
                }
                block[192..208].fill(16);
                block[208..].copy_from_slice(&d);
            }
        }
        other => unreachable!("random models are written in f32, f16, q8_0, q4_0, q4_k (the Q4_K_M mix) and mxfp4, not {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_bits() {
        assert_eq!(f16_bits(1.0), 0x3c00);
        assert_eq!(f16_bits(-2.0), 0xc000);
        assert_eq!(f16_bits(0.0), 0);
        assert_eq!(f16_bits(1e-9), 0);
        assert_eq!(f16_bits(1e9), 0x7c00);
    }

    #[test]
    fn noise_is_centred_and_bounded() {
        let mut r = Rng(42);
        let xs: Vec<f32> = (0..10_000).map(|_| r.unit()).collect();
        assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        assert!(mean.abs() < 0.05, "{mean}");
    }

    #[test]
    fn shapes_that_do_not_fill_blocks_are_refused() {
        let mut m = RandomModel::new("qwen3moe", 2, 64, 128, 4, 2);
        assert!(m.validate().is_ok());
        m.ty = GgmlType::Q8_0;
        m.n_ff_exp = 48;
        assert!(m.validate().is_err());
        assert!(RandomModel::new("mamba", 2, 64, 128, 4, 2).validate().is_err());
    }
}
