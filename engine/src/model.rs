//! What hearth needs to know about a model before building graphs for it: the
//! architecture and its hyperparameters, read from GGUF metadata and checked against
//! the tensors, so a file that claims one shape and stores another fails at load time
//! with a message instead of inside a ggml assertion.

use crate::gguf::{GgufFile, TensorInfo};
use crate::{Error, Result};

/// The architectures whose graphs hearth builds. They share the llama block
/// (RMSNorm, GQA attention with RoPE, SwiGLU FFN) and differ in small, named ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Mistral's own GGUF architecture (`mistral3`): the llama block plus optional
    /// Llama-4-style attention temperature scaling. Older Mistral 7B files say `llama`.
    Mistral,
    /// Q/K/V projections carry biases.
    Qwen2,
    /// Per-head RMSNorm on Q and K before RoPE.
    Qwen3,
}

impl Arch {
    pub fn from_gguf_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "mistral3" | "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(Error::UnsupportedArchitecture(other.to_string())),
        }
    }

    /// ggml RoPE mode: llama-style models rotate adjacent pairs (mode 0), Qwen rotates
    /// halves (NEOX, mode 2) — as llama.cpp's `llama_model_rope_type` says.
    pub fn rope_mode(self) -> i32 {
        const ROPE_NORM: i32 = 0;
        const ROPE_NEOX: i32 = 2;
        match self {
            Arch::Llama | Arch::Mistral => ROPE_NORM,
            Arch::Qwen2 | Arch::Qwen3 => ROPE_NEOX,
        }
    }
}

/// RoPE parameters as llama.cpp derives them from the model's training metadata
/// (see `llama_context` construction), so both compute the same rotations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub n_dims: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub n_ctx_orig: i32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Llama-4-style query scaling by position (`attention.temperature_scale`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnTemperature {
    pub scale: f32,
    pub floor: f32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub arch_name: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub kq_scale: f32,
    pub rope: Rope,
    pub attn_temperature: Option<AttnTemperature>,
    /// The LM head is the token embedding matrix (no `output.weight`).
    pub tied_output: bool,
}

impl ModelSpec {
    pub fn n_embd_kv(&self) -> usize {
        self.head_dim * self.n_head_kv
    }

    pub fn n_embd_q(&self) -> usize {
        self.head_dim * self.n_head
    }

    pub fn from_gguf(file: &GgufFile) -> Result<ModelSpec> {
        let meta = file.meta();
        let arch_name = meta
            .get_str("general.architecture")
            .ok_or_else(|| missing("general.architecture", "a string naming the architecture"))?
            .to_string();
        let arch = Arch::from_gguf_name(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req_u = |k: &str| -> Result<usize> {
            let full = key(k);
            let v = meta.get_u64(&full).ok_or_else(|| missing(&full, "an unsigned integer"))?;
            usize::try_from(v).map_err(|_| missing(&full, "a value that fits in memory"))
        };
        let opt_u = |k: &str| meta.get_u64(&key(k)).and_then(|v| usize::try_from(v).ok());
        let opt_f = |k: &str| meta.get_f32(&key(k));

        let n_layer = req_u("block_count")?;
        let n_embd = req_u("embedding_length")?;
        let n_ff = req_u("feed_forward_length")?;
        let n_head = req_u("attention.head_count")?;
        let n_head_kv = opt_u("attention.head_count_kv").unwrap_or(n_head);
        let n_ctx_train = req_u("context_length")?;
        let rms_eps = opt_f("attention.layer_norm_rms_epsilon")
            .ok_or_else(|| missing(&key("attention.layer_norm_rms_epsilon"), "a float"))?;
        for (name, v) in [("block_count", n_layer), ("embedding_length", n_embd), ("feed_forward_length", n_ff), ("attention.head_count", n_head), ("attention.head_count_kv", n_head_kv)] {
            if v == 0 || v > MAX_DIMENSION {
                return Err(missing(&key(name), &format!("a value in 1..={MAX_DIMENSION}, found {v}")));
            }
        }
        if n_head % n_head_kv != 0 {
            return Err(missing(&key("attention.head_count_kv"), &format!("a divisor of head_count {n_head}, found {n_head_kv}")));
        }
        let head_dim = opt_u("attention.key_length").unwrap_or(n_embd / n_head);
        let head_dim_v = opt_u("attention.value_length").unwrap_or(head_dim);
        // Bounded like the other sizes: head_dim * n_head must not overflow.
        if head_dim == 0 || head_dim > MAX_DIMENSION {
            return Err(missing(&key("attention.key_length"), &format!("a value in 1..={MAX_DIMENSION}, found {head_dim}")));
        }
        if head_dim_v != head_dim {
            return Err(missing(&key("attention.value_length"), "equal to attention.key_length (hearth needs K and V heads of one size)"));
        }
        let n_rot = opt_u("rope.dimension_count").unwrap_or(head_dim);
        if n_rot != head_dim {
            return Err(missing(&key("rope.dimension_count"), &format!("equal to the head size {head_dim} (partial RoPE is not supported)")));
        }

        let rope = rope_params(&arch_name, meta, n_rot, n_ctx_train)?;
        let attn_temperature = match opt_f("attention.temperature_scale") {
            Some(scale) if scale != 0.0 => {
                let floor = meta
                    .get_u64(&key("rope.scaling.original_context_length"))
                    .map(|v| v as f32)
                    .unwrap_or(n_ctx_train as f32);
                Some(AttnTemperature { scale, floor })
            }
            _ => None,
        };
        let kq_scale = match opt_f("attention.scale") {
            Some(s) if s != 0.0 => s,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };

        let embd = require_tensor(file, "token_embd.weight")?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let tied_output = file.meta().tensor("output.weight").is_none();
        let spec = ModelSpec {
            arch,
            arch_name,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            n_ctx_train,
            rms_eps,
            kq_scale,
            rope,
            attn_temperature,
            tied_output,
        };
        spec.check_tensors(file)?;
        Ok(spec)
    }

    /// Every tensor the graphs will touch must exist with the shape the metadata implies.
    fn check_tensors(&self, file: &GgufFile) -> Result<()> {
        let e = self.n_embd as u64;
        expect_shape(file, "token_embd.weight", &[e, self.n_vocab as u64])?;
        expect_shape(file, "output_norm.weight", &[e])?;
        if !self.tied_output {
            expect_shape(file, "output.weight", &[e, self.n_vocab as u64])?;
        }
        let (q, kv, ff) = (self.n_embd_q() as u64, self.n_embd_kv() as u64, self.n_ff as u64);
        for il in 0..self.n_layer {
            let t = |n: &str| format!("blk.{il}.{n}.weight");
            expect_shape(file, &t("attn_norm"), &[e])?;
            expect_shape(file, &t("attn_q"), &[e, q])?;
            expect_shape(file, &t("attn_k"), &[e, kv])?;
            expect_shape(file, &t("attn_v"), &[e, kv])?;
            expect_shape(file, &t("attn_output"), &[q, e])?;
            expect_shape(file, &t("ffn_norm"), &[e])?;
            expect_shape(file, &t("ffn_gate"), &[e, ff])?;
            expect_shape(file, &t("ffn_up"), &[e, ff])?;
            expect_shape(file, &t("ffn_down"), &[ff, e])?;
            if self.arch == Arch::Qwen3 {
                expect_shape(file, &t("attn_q_norm"), &[self.head_dim as u64])?;
                expect_shape(file, &t("attn_k_norm"), &[self.head_dim as u64])?;
            }
        }
        Ok(())
    }
}

/// Guards every size derived from metadata: no real transformer dimension is near it,
/// and it keeps products of two dimensions far from overflow.
const MAX_DIMENSION: usize = 1 << 20;

fn missing(key: &str, reason: &str) -> Error {
    Error::Metadata { key: key.to_string(), reason: format!("expected {reason}") }
}

fn require_tensor<'a>(file: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    file.meta()
        .tensor(name)
        .ok_or_else(|| Error::Tensor { name: name.to_string(), reason: "missing from the file".into() })
}

fn expect_shape(file: &GgufFile, name: &str, dims: &[u64]) -> Result<()> {
    let t = require_tensor(file, name)?;
    if t.dims.as_slice() != dims {
        return Err(Error::Tensor { name: name.to_string(), reason: format!("shape {:?}, expected {:?}", t.dims, dims) });
    }
    Ok(())
}

fn rope_params(arch: &str, meta: &crate::gguf::GgufMeta, n_rot: usize, n_ctx_train: usize) -> Result<Rope> {
    let key = |k: &str| format!("{arch}.{k}");
    let freq_base = meta.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
    let scaling = meta.get_str(&key("rope.scaling.type")).unwrap_or("linear");
    let factor = meta
        .get_f32(&key("rope.scaling.factor"))
        .or_else(|| meta.get_f32(&key("rope.scale_linear")))
        .unwrap_or(0.0);
    let trained_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
    let n_ctx_orig = meta
        .get_u64(&key("rope.scaling.original_context_length"))
        .map(|v| v as usize)
        .unwrap_or(n_ctx_train);
    let beta_fast = meta.get_f32(&key("rope.scaling.yarn_beta_fast")).unwrap_or(32.0);
    let beta_slow = meta.get_f32(&key("rope.scaling.yarn_beta_slow")).unwrap_or(1.0);
    let (freq_scale, ext_factor, attn_factor) = match scaling {
        "none" => (1.0, 0.0, 1.0),
        "linear" => (trained_scale, 0.0, 1.0),
        "yarn" => {
            // llama.cpp's YaRN magnitude correction, cancelled again by the factor the
            // ggml kernel applies itself (see llama_context's constructor).
            let f = 1.0 / trained_scale;
            let mscale = |m: f32| if f <= 1.0 { 1.0 } else { 0.1 * m * f.ln() + 1.0 };
            let log_mul = meta.get_f32(&key("rope.scaling.yarn_log_multiplier")).unwrap_or(0.0);
            let base = if log_mul != 0.0 { mscale(1.0) / mscale(log_mul) } else { mscale(1.0) };
            (trained_scale, 1.0, base / (1.0 + 0.1 * f.ln()))
        }
        other => {
            return Err(missing(&key("rope.scaling.type"), &format!("none, linear or yarn, found `{other}`")));
        }
    };
    Ok(Rope {
        n_dims: n_rot as i32,
        freq_base,
        freq_scale,
        n_ctx_orig: n_ctx_orig as i32,
        ext_factor,
        attn_factor,
        beta_fast,
        beta_slow,
    })
}
