//! What hearth needs to know about a model before building graphs for it: the
//! architecture and its hyperparameters, read from GGUF metadata and checked against
//! the tensors, so a file that claims one shape and stores another fails at load time
//! with a message instead of inside a ggml assertion.

use crate::gguf::{GgufFile, TensorInfo};
use crate::{Error, Result};

/// The architectures whose graphs hearth builds. They share the llama block (RMSNorm,
/// GQA attention with RoPE, a gated FFN) and differ in named ways: biases, norms, MoE
/// FFNs, sliding windows.
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
    /// Qwen3 attention with a Mixture-of-Experts FFN: softmax router, top-k, the chosen
    /// experts' weights renormalised to sum to one.
    Qwen3Moe,
    /// Gemma 3: scaled embeddings, Q/K norms, norms after attention and after the FFN,
    /// GELU FFN, sliding-window layers (5 of 6) with their own RoPE base.
    Gemma3,
    /// gpt-oss (`gpt-oss` in GGUF, llama.cpp's `openai-moe`): attention sinks and biases,
    /// alternating sliding-window layers, a MoE FFN with biased experts, softmax over the
    /// chosen experts only, and the clamped SwiGLU.
    GptOss,
    /// GLM-4.5 / 4.6 (`glm4moe`): Q/K/V biases, partial RoPE, leading dense layers, then
    /// sigmoid-gated experts chosen with a per-expert bias, plus a shared expert; the
    /// multi-token-prediction layers at the end of the file are not run.
    Glm4Moe,
    /// Llama 4 (`llama4`): three of every four layers rotate (RoPE) and attend within
    /// chunks of 8,192 positions, with weightless RMS norms on Q and K after the rotation;
    /// the fourth has no RoPE, attends to everything, and scales its queries by position
    /// (attention temperature). MoE FFNs on every `interleave_moe_layer_step`-th layer
    /// (top-k of the raw router logits, each chosen expert's input scaled by the sigmoid
    /// of its logit, plus a shared expert), dense FFNs between.
    Llama4,
    /// Gemma 4 (`gemma4`, the 26B-A4B MoE and the dense 31B): Gemma 3's block with its
    /// own head size, KV heads and rotated dims on the sliding-window layers, "proportional"
    /// RoPE on the full ones (frequency factors that leave most dims unrotated), V
    /// normalised without a weight (and taken from K where a layer has no `attn_v`), no
    /// query scaling, a learned scale on each layer's output, and in the MoE model a dense
    /// FFN beside the routed GELU experts, each with its own norms, the router reading the
    /// normalised attention output.
    Gemma4,
    /// DeepSeek V2/V3/R1 and the models built on their design (`deepseek2`: GLM-4.7-Flash,
    /// Kimi K2, Kanana-2 …): multi-head latent attention, computed as llama.cpp computes it
    /// (queries absorbed into the compressed space, one cached row per token of the
    /// compressed K/V plus the rotated part, V read from that row and decompressed after
    /// attention), leading dense layers, then routed experts (softmax or sigmoid with a
    /// selection bias, optionally limited to the best groups) plus shared experts.
    DeepSeek2,
    /// Qwen3.5 (`qwen35`, dense 0.8B–27B) and its MoE form (`qwen35moe`, 35B-A3B,
    /// 122B-A10B): three of every four layers are gated-delta-net linear attention — a
    /// short causal convolution over the fused Q/K/V projection, then a recurrent state of
    /// `head × head` per value head that each token decays and updates (`ggml_gated_delta_net`),
    /// its output normalised and gated by a SiLU of its own projection — and the fourth is
    /// full attention whose query projection carries a sigmoid output gate, with Q/K norms
    /// and interleaved multi-section RoPE (text positions in three of its sections). The FFN
    /// input is normalised by `post_attention_norm`. The MoE form adds a shared expert
    /// scaled by the sigmoid of its own one-row router.
    Qwen35,
    Qwen35Moe,
}

impl Arch {
    pub fn from_gguf_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "mistral3" | "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gemma3" => Ok(Arch::Gemma3),
            "gpt-oss" => Ok(Arch::GptOss),
            "glm4moe" => Ok(Arch::Glm4Moe),
            "llama4" => Ok(Arch::Llama4),
            "gemma4" => Ok(Arch::Gemma4),
            "deepseek2" => Ok(Arch::DeepSeek2),
            "qwen35" => Ok(Arch::Qwen35),
            "qwen35moe" => Ok(Arch::Qwen35Moe),
            other => Err(Error::UnsupportedArchitecture(other.to_string())),
        }
    }

    /// ggml RoPE mode: llama-style models rotate adjacent pairs (mode 0), Qwen rotates
    /// halves (NEOX, mode 2) — as llama.cpp's `llama_model_rope_type` says.
    pub fn rope_mode(self) -> i32 {
        const ROPE_NORM: i32 = 0;
        const ROPE_NEOX: i32 = 2;
        // Interleaved multi-section RoPE (`GGML_ROPE_TYPE_IMROPE`), through `ggml_rope_multi`.
        const ROPE_IMROPE: i32 = 40;
        match self {
            Arch::Qwen35 | Arch::Qwen35Moe => ROPE_IMROPE,
            Arch::Llama | Arch::Mistral | Arch::Llama4 | Arch::DeepSeek2 => ROPE_NORM,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::GptOss | Arch::Glm4Moe | Arch::Gemma4 => ROPE_NEOX,
        }
    }

    /// The attention output and FFN down projections accumulate in f32, as llama.cpp asks
    /// for GLM-4 ("numerical issues with half-precision accumulators"). CPU kernels
    /// accumulate in f32 anyway; GPU backends (Vulkan, CUDA) otherwise use f16, so this is
    /// what keeps hearth's GPU numbers equal to llama.cpp's.
    pub fn f32_accumulators(self) -> bool {
        self == Arch::Glm4Moe
    }

    /// Per-head RMSNorm on Q and K before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Gemma4 | Arch::Qwen35 | Arch::Qwen35Moe)
    }

    /// Qwen3.5's family: hybrid linear/full attention (see [`ModelSpec::recurrent`]).
    pub fn qwen35(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Qwen35Moe)
    }

    /// The FFN input is normalised by `post_attention_norm` (there is no `ffn_norm`).
    pub fn ffn_norm_is_post_attention(self) -> bool {
        matches!(self, Arch::GptOss | Arch::Glm4Moe | Arch::Qwen35 | Arch::Qwen35Moe)
    }

    /// Gemma's block: scaled embeddings, norms after attention and after the FFN, GELU.
    pub fn gemma(self) -> bool {
        matches!(self, Arch::Gemma3 | Arch::Gemma4)
    }
}

/// How a Mixture-of-Experts FFN picks and weighs its experts (llama.cpp's
/// `build_moe_ffn` arguments for the arch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moe {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden size of one expert.
    pub n_ff_exp: usize,
    pub gating: Gating,
    /// Divide the chosen experts' weights by their sum.
    pub norm_weights: bool,
    /// Multiplies the experts' weights when not 0 or 1 (`expert_weights_scale`).
    pub weights_scale: f32,
    pub activation: MoeActivation,
    /// Shared experts run on every token beside the routed ones (one FFN of
    /// `n_shared * n_ff_exp`).
    pub n_shared: usize,
    /// The first this-many layers have a dense FFN instead (GLM: `leading_dense_block_count`).
    pub dense_lead: usize,
    /// Only every this-many-th layer routes experts, the others are dense (Llama 4:
    /// `interleave_moe_layer_step`); 1 for the archs whose every layer does.
    pub interleave: usize,
    /// DeepSeek V3's group-limited routing: the experts are cut into `.0` groups, each
    /// scored by the sum of its best two selection scores, and only the experts of the
    /// best `.1` groups may be chosen. None: all experts compete.
    pub groups: Option<(usize, usize)>,
    /// Hidden size of the shared experts' one FFN where the file names it
    /// (`expert_shared_feed_forward_length`, Qwen3.5); 0: `n_shared * n_ff_exp`.
    pub n_ff_shared: usize,
    /// The shared experts' output is scaled by the sigmoid of its own one-row router
    /// (`ffn_gate_inp_shexp`, Qwen3.5).
    pub shared_gate: bool,
}

impl Moe {
    /// Hidden size of the shared experts' FFN (0: none).
    pub fn shared_ff(&self) -> usize {
        if self.n_ff_shared > 0 {
            self.n_ff_shared
        } else {
            self.n_shared * self.n_ff_exp
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all router logits, then top-k of the probabilities.
    Softmax,
    /// Sigmoid of each logit; top-k of the probabilities plus a per-expert selection bias
    /// (`exp_probs_b`), weighted by the unbiased ones (GLM-4.5, DeepSeek V3).
    Sigmoid,
    /// Top-k of the raw logits, softmax over the k chosen (gpt-oss).
    SoftmaxWeight,
    /// Top-k of the raw logits; each chosen expert's input (not its output) is scaled by
    /// the sigmoid of its logit (Llama 4).
    SigmoidInput,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeActivation {
    Silu,
    /// GELU-gated experts (Gemma 4).
    Gelu,
    /// gpt-oss: `ggml_swiglu_oai` with alpha 1.702 and limit 7, as llama.cpp hard-codes.
    SwigluOai,
}

/// Layers that attend only to the last `n_swa` positions (llama.cpp's standard SWA:
/// a key `p0` is masked for a query `p1` when `p1 - p0 >= n_swa`), with their own RoPE.
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub n_swa: usize,
    /// Llama 4's chunked attention instead: a query at `p1` sees the keys of its own
    /// chunk of `n_swa` positions, `p0 >= p1 / n_swa * n_swa`.
    pub chunked: bool,
    /// `layers[il]`: layer il is a sliding-window layer.
    pub layers: Vec<bool>,
    pub freq_base: f32,
    pub freq_scale: f32,
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
    /// Added to the position first (Llama 4: 1, Mistral 3: 0).
    pub offset: f32,
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
    /// Mixture-of-Experts FFN in every layer (else a dense SwiGLU/GELU FFN).
    pub moe: Option<Moe>,
    pub swa: Option<SlidingWindow>,
    /// Token embeddings are multiplied by this (Gemma: sqrt(n_embd)).
    pub embed_scale: Option<f32>,
    /// Queries are multiplied by this before attention, which then scales by 1 (Gemma).
    pub q_scale: Option<f32>,
    /// `tanh(x / c) * c` on the logits (Gemma's `final_logit_softcapping`).
    pub logit_softcap: Option<f32>,
    /// Every this-many-th layer has no RoPE (Llama 4's NoPE layers, which alone take the
    /// attention temperature).
    pub nope_step: Option<usize>,
    /// Weightless RMS norms on Q and K after RoPE, in the rotating layers (Llama 4 but its
    /// 128-expert Maverick).
    pub qk_rms_after_rope: bool,
    /// The sliding-window layers' own head size and rotated dims, where they differ from
    /// the full layers' (Gemma 4: 256 against 512).
    pub swa_head: Option<SwaHead>,
    /// KV heads per layer where the file gives an array (Gemma 4: fewer in the full
    /// layers); empty: `n_head_kv` in every layer.
    pub n_head_kv_layers: Vec<usize>,
    /// Weightless RMS norm on V before it is cached (Gemma 4).
    pub v_norm: bool,
    /// Multi-head latent attention (DeepSeek 2/3): the cache holds one row per token of
    /// `kv_lora_rank + n_rot` (the compressed K/V, then the rotated key part); V is that
    /// row's first `kv_lora_rank` elements. `head_dim` is then the row's width and
    /// `n_head_kv` 1, what attention sees after the queries are absorbed.
    pub mla: Option<Mla>,
    /// Linear-attention layers with a recurrent state (Qwen3.5's gated delta net).
    pub recurrent: Option<Recurrent>,
    /// Multi-section RoPE's sections (Qwen3.5): rotated through `ggml_rope_multi`, each
    /// position given to the first three sections (text has no image rows or columns).
    pub rope_sections: Option<[i32; 4]>,
    /// The query projection is twice as wide, each head followed by its output gate, and
    /// the attention output is multiplied by the gate's sigmoid (Qwen3.5's full layers).
    pub gated_attention: bool,
    /// Gemma 4 E2B/E4B: every layer also takes an input of its own, this many values per
    /// token (`embedding_length_per_layer_input`), made once from the token ids and the
    /// embedding (see [`ModelSpec::hidden_width`]); 0: none.
    pub per_layer_embd: usize,
    /// Gemma 4 E2B/E4B: the layers from this one on keep no K/V of their own and attend
    /// with an earlier layer's ([`ModelSpec::kv_donor`]); None: every layer keeps its own.
    pub shared_kv_from: Option<usize>,
    /// FFN width per layer where the file gives an array (Gemma 4 E2B/E4B's shared-K/V
    /// layers are twice as wide); empty: `n_ff` in every layer.
    pub n_ff_layers: Vec<usize>,
}

/// Qwen3.5's gated delta net (llama.cpp's `ssm.*` keys): per layer, a causal
/// convolution of `conv_kernel` taps over the Q/K/V channels, then a recurrent state of
/// `head × head` per value head. Each sequence keeps, per recurrent layer, the last
/// `conv_kernel - 1` inputs of the convolution and that state: a fixed size whatever its
/// length, and the reason its past cannot be truncated (only restored from a copy).
#[derive(Debug, Clone, PartialEq)]
pub struct Recurrent {
    pub conv_kernel: usize,
    /// Key and value head size (`ssm.state_size`).
    pub head: usize,
    /// Key heads (`ssm.group_count`) and value heads (`ssm.time_step_rank`).
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// `layers[il]`: layer il is a recurrent (linear attention) layer.
    pub layers: Vec<bool>,
}

impl Recurrent {
    /// Channels the convolution runs over: Q and K (key heads) and V (value heads).
    pub fn conv_channels(&self) -> usize {
        self.head * (2 * self.n_k_heads + self.n_v_heads)
    }

    /// Values of the value projection (and of the layer's output before `ssm_out`).
    pub fn value_dim(&self) -> usize {
        self.head * self.n_v_heads
    }

    /// f32 values a sequence keeps per recurrent layer for the convolution.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels()
    }

    /// f32 values of a sequence's recurrent state per layer.
    pub fn ssm_state_len(&self) -> usize {
        self.head * self.head * self.n_v_heads
    }

    /// Bytes a sequence's state takes in one recurrent layer (both parts, f32 as llama.cpp keeps them).
    pub fn bytes_per_layer(&self) -> usize {
        4 * (self.conv_state_len() + self.ssm_state_len())
    }
}

/// See [`ModelSpec::mla`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mla {
    /// Rank of the low-rank query projection; 0: a plain `attn_q` (the Lite models).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    /// A query/key head before compression: its unrotated part plus `n_rot`.
    pub head_k: usize,
    /// A value head after decompression.
    pub head_v: usize,
    pub n_rot: usize,
}

/// See [`ModelSpec::swa_head`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwaHead {
    pub head_dim: usize,
    pub n_rot: usize,
}

impl ModelSpec {
    /// Head size of layer `il`'s queries, keys and values.
    pub fn head_dim_of(&self, il: usize) -> usize {
        match self.swa_head {
            Some(h) if self.is_swa(il) => h.head_dim,
            _ => self.head_dim,
        }
    }

    /// Dims RoPE rotates in layer `il`.
    pub fn n_rot_of(&self, il: usize) -> usize {
        match self.swa_head {
            Some(h) if self.is_swa(il) => h.n_rot,
            _ => self.rope.n_dims as usize,
        }
    }

    pub fn n_head_kv_of(&self, il: usize) -> usize {
        self.n_head_kv_layers.get(il).copied().unwrap_or(self.n_head_kv)
    }

    /// Width of layer `il`'s K (and V) cache rows.
    pub fn n_embd_kv_of(&self, il: usize) -> usize {
        if self.is_recurrent(il) || self.kv_donor(il).is_some() {
            // A recurrent layer caches no K/V (its state is apart: `state_bytes`), nor
            // does a layer that attends with another's.
            return 0;
        }
        self.head_dim_of(il) * self.n_head_kv_of(il)
    }

    /// Width of layer `il`'s V cache rows: 0 where V is read from the K row (MLA).
    pub fn n_embd_v_cache_of(&self, il: usize) -> usize {
        if self.mla.is_some() {
            0
        } else {
            self.n_embd_kv_of(il)
        }
    }

    /// The earlier layer whose K/V cache layer `il` attends with (Gemma 4 E2B/E4B's last
    /// layers): the last layer of the same kind (sliding or full) that keeps its own, as
    /// llama.cpp picks it.
    pub fn kv_donor(&self, il: usize) -> Option<usize> {
        self.shared_kv_from.filter(|&from| il >= from).map(|from| from - if self.is_swa(il) { 2 } else { 1 })
    }

    /// The layers other layers attend with, in order (none, or one sliding and one full).
    /// An iterator, not a collection: `hidden_width` asks on every step.
    pub fn kv_donors(&self) -> impl Iterator<Item = usize> {
        self.shared_kv_from.into_iter().flat_map(|from| [from - 2, from - 1])
    }

    /// FFN width of layer `il`.
    pub fn n_ff_of(&self, il: usize) -> usize {
        self.n_ff_layers.get(il).copied().unwrap_or(self.n_ff)
    }

    /// Values per token of the hidden states one window hands the next: the residual
    /// stream (`n_embd`), then, for Gemma 4 E2B/E4B, every layer's per-layer input and the
    /// K and V the donor layers computed for the batch (so that a window holding shared
    /// layers but not their donor writes them into its own copy of the donor's cache, and
    /// any cut between layers is allowed).
    pub fn hidden_width(&self) -> usize {
        self.n_embd + self.per_layer_embd * self.n_layer + self.kv_donors().map(|d| 2 * self.head_dim_of(d) * self.n_head_kv_of(d)).sum::<usize>()
    }

    /// Where donor layer `donor`'s K (then, `n_embd_kv` further, its V) lies in a hidden
    /// state row (see [`ModelSpec::hidden_width`]).
    pub fn carried_kv_offset(&self, donor: usize) -> Option<usize> {
        let mut off = self.n_embd + self.per_layer_embd * self.n_layer;
        for d in self.kv_donors() {
            if d == donor {
                return Some(off);
            }
            off += 2 * self.head_dim_of(d) * self.n_head_kv_of(d);
        }
        None
    }

    pub fn n_embd_q_of(&self, il: usize) -> usize {
        self.head_dim_of(il) * self.n_head
    }

    /// Whether every layer's K/V rows have one width (false for Gemma 4).
    pub fn uniform_kv(&self) -> bool {
        (0..self.n_layer).all(|il| self.n_embd_kv_of(il) == self.n_embd_kv_of(0))
    }

    /// The widest layer's K (and V) row: a bound for memory a window of any layers needs.
    pub fn max_n_embd_kv(&self) -> usize {
        (0..self.n_layer).map(|il| self.n_embd_kv_of(il)).max().unwrap_or(0)
    }

    /// As [`ModelSpec::max_n_embd_kv`] for the V cache (0 under MLA).
    pub fn max_n_embd_v_cache(&self) -> usize {
        (0..self.n_layer).map(|il| self.n_embd_v_cache_of(il)).max().unwrap_or(0)
    }

    /// K (and V) elements a cached token takes, averaged over the layers: what memory
    /// estimates multiply by the layer count.
    pub fn mean_n_embd_kv(&self) -> f64 {
        (0..self.n_layer).map(|il| self.n_embd_kv_of(il) as f64).sum::<f64>() / self.n_layer.max(1) as f64
    }

    /// Head size averaged over the layers (attention FLOPs per cached token).
    pub fn mean_head_dim(&self) -> f64 {
        (0..self.n_layer).map(|il| self.head_dim_of(il) as f64).sum::<f64>() / self.n_layer.max(1) as f64
    }

    /// Whether layer `il` is a recurrent (linear attention) layer: no KV cache, a state
    /// per sequence instead.
    pub fn is_recurrent(&self, il: usize) -> bool {
        self.recurrent.as_ref().is_some_and(|r| r.layers.get(il).copied().unwrap_or(false))
    }

    /// Bytes of recurrent state one sequence takes in the layers `layers`.
    pub fn state_bytes(&self, layers: std::ops::Range<usize>) -> usize {
        self.recurrent.as_ref().map_or(0, |r| layers.filter(|&il| self.is_recurrent(il)).count() * r.bytes_per_layer())
    }

    /// Whether layer `il` routes experts (else its FFN is dense).
    pub fn is_moe_layer(&self, il: usize) -> bool {
        self.moe.is_some_and(|m| il >= m.dense_lead && (il + 1) % m.interleave.max(1) == 0)
    }

    /// Whether layer `il` rotates Q and K (all but Llama 4's NoPE layers).
    pub fn ropes(&self, il: usize) -> bool {
        self.nope_step.is_none_or(|n| (il + 1) % n != 0)
    }

    /// Whether layer `il` scales its queries by the attention temperature: every layer
    /// of Mistral 3, the NoPE layers of Llama 4.
    pub fn tempers(&self, il: usize) -> bool {
        self.attn_temperature.is_some() && (self.nope_step.is_none() || !self.ropes(il))
    }

    /// Whether layer `il` attends through a sliding window.
    pub fn is_swa(&self, il: usize) -> bool {
        self.swa.as_ref().is_some_and(|s| s.layers.get(il).copied().unwrap_or(false))
    }

    /// RoPE frequency base and scale of layer `il` (sliding-window layers have their own).
    pub fn rope_of(&self, il: usize) -> (f32, f32) {
        match &self.swa {
            Some(s) if self.is_swa(il) => (s.freq_base, s.freq_scale),
            _ => (self.rope.freq_base, self.rope.freq_scale),
        }
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

        // Multi-token-prediction blocks (GLM's `nextn`) come last and are not part of the
        // model's forward pass.
        let n_layer = req_u("block_count")?.saturating_sub(if matches!(arch, Arch::Glm4Moe | Arch::DeepSeek2 | Arch::Qwen35 | Arch::Qwen35Moe) { opt_u("nextn_predict_layers").unwrap_or(0) } else { 0 });
        let n_embd = req_u("embedding_length")?;
        // Gemma 4 E2B/E4B write the FFN width per layer (their shared-K/V layers' is twice
        // the others').
        let n_ff_layers: Vec<usize> = match meta.get(&key("feed_forward_length")).and_then(|v| v.as_array()) {
            Some(items) => {
                let v: Vec<usize> = items.iter().take(n_layer).map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()).unwrap_or(0)).collect();
                if v.len() != n_layer || v.iter().any(|&f| f == 0 || f > MAX_DIMENSION) {
                    return Err(missing(&key("feed_forward_length"), &format!("one width in 1..={MAX_DIMENSION} per layer ({n_layer})")));
                }
                v
            }
            None => Vec::new(),
        };
        // Qwen3.5's MoE files may name only the experts' and the shared expert's sizes.
        let n_ff = match (arch, opt_u("feed_forward_length")) {
            _ if !n_ff_layers.is_empty() => n_ff_layers[0],
            (Arch::Qwen35Moe, None | Some(0)) => opt_u("expert_shared_feed_forward_length").or(opt_u("expert_feed_forward_length")).unwrap_or(0),
            _ => req_u("feed_forward_length")?,
        };
        let n_head = req_u("attention.head_count")?;
        // Gemma 4 writes the KV heads per layer (its full layers have fewer).
        let n_head_kv_layers: Vec<usize> = match meta.get(&key("attention.head_count_kv")).and_then(|v| v.as_array()) {
            Some(items) => {
                let v: Vec<usize> = items.iter().map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()).unwrap_or(0)).collect();
                if v.len() != n_layer || v.iter().any(|&h| h == 0 || h > MAX_DIMENSION || n_head % h != 0) {
                    return Err(missing(&key("attention.head_count_kv"), &format!("one divisor of head_count {n_head} per layer ({n_layer})")));
                }
                v
            }
            None => Vec::new(),
        };
        let n_head_kv = n_head_kv_layers.first().copied().unwrap_or_else(|| opt_u("attention.head_count_kv").unwrap_or(n_head));
        // Gemma 4 E2B/E4B: per-layer inputs, and last layers that attend with earlier
        // layers' K/V (llama.cpp reads both for Gemma 4 only).
        let (per_layer_embd, shared_kv_layers) = if arch == Arch::Gemma4 { (opt_u("embedding_length_per_layer_input").unwrap_or(0), opt_u("attention.shared_kv_layers").unwrap_or(0)) } else { (0, 0) };
        if per_layer_embd > MAX_DIMENSION || per_layer_embd.saturating_mul(n_layer) > MAX_DIMENSION * 16 {
            return Err(missing(&key("embedding_length_per_layer_input"), &format!("at most {MAX_DIMENSION} (and {} over all layers)", MAX_DIMENSION * 16)));
        }
        if shared_kv_layers > 0 && shared_kv_layers + 2 > n_layer {
            return Err(missing(&key("attention.shared_kv_layers"), &format!("fewer than the {n_layer} layers less the two it shares from")));
        }
        let shared_kv_from = (shared_kv_layers > 0).then(|| n_layer - shared_kv_layers);
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
        let n_rot = opt_u("rope.dimension_count").unwrap_or(head_dim);
        let mla = if arch == Arch::DeepSeek2 { Some(mla_params(meta, &arch_name, n_head, n_head_kv, head_dim, head_dim_v, n_rot)?) } else { None };
        if head_dim_v != head_dim && mla.is_none() {
            return Err(missing(&key("attention.value_length"), "equal to attention.key_length (hearth needs K and V heads of one size)"));
        }
        // GLM rotates part of each head (ggml's RoPE leaves the rest as is); the others
        // rotate all of it.
        let partial_ok = matches!(arch, Arch::Glm4Moe | Arch::Qwen35 | Arch::Qwen35Moe) && n_rot > 0 && n_rot <= head_dim && n_rot % 2 == 0;
        // Gemma 4's sliding-window layers: their own head size and rotated dims.
        let swa_head = if arch == Arch::Gemma4 {
            let hd = opt_u("attention.key_length_swa").unwrap_or(head_dim);
            if hd == 0 || hd > MAX_DIMENSION || opt_u("attention.value_length_swa").unwrap_or(hd) != hd {
                return Err(missing(&key("attention.key_length_swa"), &format!("a value in 1..={MAX_DIMENSION} equal to attention.value_length_swa")));
            }
            let rot = opt_u("rope.dimension_count_swa").unwrap_or(n_rot);
            if rot == 0 || rot > hd || rot % 2 != 0 {
                return Err(missing(&key("rope.dimension_count_swa"), &format!("an even count of at most the sliding layers' head size {hd}")));
            }
            Some(SwaHead { head_dim: hd, n_rot: rot })
        } else {
            None
        };
        if n_rot != head_dim && !partial_ok && mla.is_none() {
            return Err(missing(&key("rope.dimension_count"), &format!("equal to the head size {head_dim} (partial RoPE is not supported for {arch_name})")));
        }
        let rope_sections = if arch.qwen35() {
            // Text positions go to the first three sections alike, so only the sections'
            // sizes matter (they decide which dims each section's frequencies rotate).
            let v: Vec<i64> = meta.get(&key("rope.dimension_sections")).and_then(|v| v.as_array()).map(|a| a.iter().map(|x| x.as_u64().map_or(-1, |x| x as i64)).collect()).unwrap_or_default();
            if v.len() < 3 || v.len() > 4 || v.iter().any(|&x| !(0..=MAX_DIMENSION as i64).contains(&x)) {
                return Err(missing(&key("rope.dimension_sections"), "3 or 4 section sizes (Qwen3.5's multi-section RoPE)"));
            }
            let mut sections = [0i32; 4];
            for (d, x) in sections.iter_mut().zip(&v) {
                *d = *x as i32;
            }
            Some(sections)
        } else {
            if meta.get(&key("rope.dimension_sections")).and_then(|v| v.as_array()).is_some_and(|a| a.iter().take(2).all(|x| x.as_u64().unwrap_or(0) > 0)) {
                return Err(missing(&key("rope.dimension_sections"), "absent (multimodal M-RoPE is not supported)"));
            }
            None
        };
        let recurrent = if arch.qwen35() { Some(recurrent_params(meta, &arch_name, n_layer, n_embd)?) } else { None };

        let rope = rope_params(arch, &arch_name, meta, n_rot, n_ctx_train)?;
        let attn_temperature = match opt_f("attention.temperature_scale") {
            Some(scale) if scale != 0.0 => {
                // DeepSeek 2 (Mistral Large 3) names its floor; Mistral 3 takes the
                // original context.
                let floor = meta
                    .get_u64(&key(if arch == Arch::DeepSeek2 { "attention.temperature_length" } else { "rope.scaling.original_context_length" }))
                    .map(|v| v as f32)
                    .unwrap_or(n_ctx_train as f32);
                Some(AttnTemperature { scale, floor, offset: 0.0 })
            }
            // llama.cpp's fixed Llama 4 values (the GGUF carries none).
            _ if arch == Arch::Llama4 => Some(AttnTemperature { scale: LLAMA4_TEMP_SCALE, floor: LLAMA4_CHUNK as f32, offset: 1.0 }),
            _ => None,
        };
        let kq_scale = match (opt_f("attention.scale"), mla) {
            (_, Some(m)) => {
                // llama.cpp pre-scales DeepSeek's scores by YaRN's magnitude twice (its
                // kernel's own factor undone first): the queries' and the keys'.
                let f = 1.0 / rope.freq_scale;
                let attn_factor_org = rope.attn_factor * (1.0 + 0.1 * f.ln());
                let mscale = attn_factor_org * (1.0 + 0.1 * deepseek2_yarn_log_mul(meta, &arch_name) * f.ln());
                mscale * mscale / (m.head_k as f32).sqrt()
            }
            (Some(s), None) if s != 0.0 => s,
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let moe = match arch {
            Arch::Gemma4 if opt_u("expert_count").unwrap_or(0) == 0 => None,
            Arch::Qwen3Moe | Arch::GptOss | Arch::Glm4Moe | Arch::Llama4 | Arch::Gemma4 | Arch::DeepSeek2 | Arch::Qwen35Moe => {
                let n_expert = req_u("expert_count")?;
                let n_expert_used = req_u("expert_used_count")?;
                if n_expert == 0 || n_expert > MAX_EXPERTS || n_expert_used == 0 || n_expert_used > n_expert {
                    return Err(missing(&key("expert_used_count"), &format!("1..=expert_count experts used of 1..={MAX_EXPERTS}, found {n_expert_used} of {n_expert}")));
                }
                let n_ff_exp = opt_u("expert_feed_forward_length").unwrap_or(n_ff / n_expert_used);
                if n_ff_exp == 0 || n_ff_exp > MAX_DIMENSION {
                    return Err(missing(&key("expert_feed_forward_length"), &format!("a value in 1..={MAX_DIMENSION}, found {n_ff_exp}")));
                }
                let gpt_oss = arch == Arch::GptOss;
                // DeepSeek 2 reads its experts' settings as GLM does.
                let glm = matches!(arch, Arch::Glm4Moe | Arch::DeepSeek2);
                let llama4 = arch == Arch::Llama4;
                // llama.cpp's `expert_gating_func` codes: 1 softmax, 2 sigmoid (GLM's default).
                const GATING_SOFTMAX: u64 = 1;
                const GATING_SIGMOID: u64 = 2;
                let gating = match arch {
                    Arch::GptOss => Gating::SoftmaxWeight,
                    Arch::Glm4Moe if meta.get_u64(&key("expert_gating_func")) == Some(GATING_SOFTMAX) => Gating::Softmax,
                    Arch::Glm4Moe => Gating::Sigmoid,
                    Arch::DeepSeek2 => match meta.get_u64(&key("expert_gating_func")) {
                        Some(GATING_SIGMOID) => Gating::Sigmoid,
                        Some(GATING_SOFTMAX) => Gating::Softmax,
                        // llama.cpp's defaults for files without it: GLM-4.7 Lite (the
                        // vocabulary and layer count tell it) sigmoid, DeepSeek V2 softmax.
                        _ if matches!(n_layer, 47 | 48) && meta.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).is_some_and(|t| t.len() == GLM47_LITE_VOCAB) => Gating::Sigmoid,
                        _ => Gating::Softmax,
                    },
                    Arch::Llama4 => Gating::SigmoidInput,
                    _ => Gating::Softmax,
                };
                let dense_lead = if glm { opt_u("leading_dense_block_count").unwrap_or(0).min(n_layer) } else { 0 };
                Some(Moe {
                    n_expert,
                    n_expert_used,
                    n_ff_exp,
                    gating,
                    norm_weights: if glm { meta.get(&key("expert_weights_norm")).and_then(|v| v.as_bool()).unwrap_or(false) } else { !gpt_oss && !llama4 },
                    // llama.cpp reads `expert_weights_scale` only for archs that use it
                    // (GLM, deepseek2 and kin), not for qwen3moe and gpt-oss: a file that
                    // carries it anyway computes as if it did not.
                    weights_scale: if glm { opt_f("expert_weights_scale").unwrap_or(0.0) } else { 0.0 },
                    activation: match arch {
                        Arch::GptOss => MoeActivation::SwigluOai,
                        Arch::Gemma4 => MoeActivation::Gelu,
                        _ => MoeActivation::Silu,
                    },
                    // Llama 4: one shared expert of the routed experts' size in every MoE layer.
                    n_shared: if glm { opt_u("expert_shared_count").unwrap_or(0) } else if llama4 || arch == Arch::Qwen35Moe { 1 } else { 0 },
                    dense_lead,
                    interleave: if llama4 { req_u("interleave_moe_layer_step")?.max(1) } else { 1 },
                    // Qwen3.5: one shared expert of its own size in every layer, gated.
                    n_ff_shared: if arch == Arch::Qwen35Moe { opt_u("expert_shared_feed_forward_length").filter(|&v| v > 0 && v <= MAX_DIMENSION).unwrap_or(n_ff) } else { 0 },
                    shared_gate: arch == Arch::Qwen35Moe,
                    groups: match (opt_u("expert_group_count"), opt_u("expert_group_used_count")) {
                        (Some(g), Some(u)) if g > 1 => {
                            if n_expert % g != 0 || u == 0 || u > g || n_expert / g < 2 || u * (n_expert / g) < n_expert_used {
                                return Err(missing(&key("expert_group_used_count"), &format!("1..={g} groups of at least two experts each, holding {n_expert_used} chosen experts ({n_expert} experts in {g} groups, {u} used)")));
                            }
                            Some((g, u))
                        }
                        _ => None,
                    },
                })
            }
            _ => None,
        };
        let swa = sliding_window(arch, meta, &arch_name, n_layer, &rope)?;
        let (embed_scale, q_scale, logit_softcap, kq_scale) = match arch {
            // Gemma 4 scales neither queries nor scores (`f_attention_scale = 1`).
            Arch::Gemma4 => (Some((n_embd as f32).sqrt()), None, opt_f("final_logit_softcapping").filter(|c| *c != 0.0), 1.0),
            Arch::Gemma3 => {
                // llama.cpp: Gemma 3 27B (62 layers) scales queries by 1/sqrt(n_embd/n_head),
                // the others by 1/sqrt(head_dim); attention itself then scales by 1.
                let q = if n_layer == GEMMA3_27B_LAYERS { 1.0 / ((n_embd / n_head) as f32).sqrt() } else { 1.0 / (head_dim as f32).sqrt() };
                let cap = opt_f("final_logit_softcapping").filter(|c| *c != 0.0);
                (Some((n_embd as f32).sqrt()), Some(q), cap, 1.0)
            }
            // gpt-oss scales by 1/sqrt(n_rot) whatever `attention.scale` says.
            Arch::GptOss => (None, None, None, 1.0 / (n_rot as f32).sqrt()),
            _ => (None, None, None, kq_scale),
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
            moe,
            swa,
            embed_scale,
            q_scale,
            logit_softcap,
            nope_step: (arch == Arch::Llama4).then_some(LLAMA4_NOPE_STEP),
            // llama.cpp: all but the 128-expert model (Maverick).
            qk_rms_after_rope: arch == Arch::Llama4 && moe.is_some_and(|m| m.n_expert != LLAMA4_MAVERICK_EXPERTS),
            swa_head: None,
            n_head_kv_layers,
            v_norm: arch == Arch::Gemma4,
            mla,
            recurrent,
            rope_sections,
            gated_attention: arch.qwen35(),
            per_layer_embd,
            shared_kv_from,
            n_ff_layers,
        };
        // Only sliding layers take the SWA head, so it is set once the pattern is known;
        // equal to the full layers' it changes nothing.
        let spec = ModelSpec { swa_head: swa_head.filter(|h| spec.swa.is_some() && (h.head_dim != spec.head_dim || h.n_rot != n_rot)), ..spec };
        spec.check_shared_kv()?;
        spec.check_tensors(file)?;
        Ok(spec)
    }

    /// A layer attending with a donor's cache needs the donor to be the kind it is
    /// (llama.cpp takes the layer two before the first shared one as the sliding donor,
    /// the one before as the full one) and its head sizes.
    fn check_shared_kv(&self) -> Result<()> {
        let Some(from) = self.shared_kv_from else { return Ok(()) };
        let key = format!("{}.attention.shared_kv_layers", self.arch_name);
        if self.swa.is_none() || !self.is_swa(from - 2) || self.is_swa(from - 1) {
            return Err(missing(&key, &format!("a count that leaves a sliding layer ({}) then a full one ({}) before the shared layers", from - 2, from - 1)));
        }
        for il in from..self.n_layer {
            let d = self.kv_donor(il).expect("a shared layer");
            if self.head_dim_of(il) != self.head_dim_of(d) || self.n_head_kv_of(il) != self.n_head_kv_of(d) {
                return Err(missing(&key, &format!("shared layers with their donor's head size and KV heads (layer {il} differs from layer {d})")));
            }
        }
        Ok(())
    }

    /// Every tensor the graphs will touch must exist with the shape the metadata implies.
    fn check_tensors(&self, file: &GgufFile) -> Result<()> {
        let e = self.n_embd as u64;
        expect_shape(file, "token_embd.weight", &[e, self.n_vocab as u64])?;
        expect_shape(file, "output_norm.weight", &[e])?;
        if !self.tied_output {
            expect_shape(file, "output.weight", &[e, self.n_vocab as u64])?;
        }
        let gemma4 = self.arch == Arch::Gemma4;
        if gemma4 && file.meta().tensor("rope_freqs.weight").is_some() {
            expect_shape(file, "rope_freqs.weight", &[self.head_dim as u64 / 2])?;
        }
        let pl = self.per_layer_embd as u64;
        if pl > 0 {
            let all = pl * self.n_layer as u64;
            expect_shape(file, "per_layer_token_embd.weight", &[all, self.n_vocab as u64])?;
            expect_shape(file, "per_layer_model_proj.weight", &[e, all])?;
            expect_shape(file, "per_layer_proj_norm.weight", &[pl])?;
        }
        for il in 0..self.n_layer {
            let ff = self.n_ff_of(il) as u64;
            // A shared-K/V layer's K projection, where the file keeps it, is its donor's width.
            let (q, kv, hd) = (self.n_embd_q_of(il) as u64, (self.head_dim_of(il) * self.n_head_kv_of(il)) as u64, self.head_dim_of(il) as u64);
            let shared = self.kv_donor(il).is_some();
            let t = |n: &str| format!("blk.{il}.{n}.weight");
            expect_shape(file, &t("attn_norm"), &[e])?;
            if pl > 0 {
                expect_shape(file, &t("inp_gate"), &[e, pl])?;
                expect_shape(file, &t("proj"), &[pl, e])?;
                expect_shape(file, &t("post_norm"), &[e])?;
            }
            if let Some(r) = self.recurrent.as_ref().filter(|_| self.is_recurrent(il)) {
                let (ch, vd, nv) = (r.conv_channels() as u64, r.value_dim() as u64, r.n_v_heads as u64);
                expect_shape(file, &t("attn_qkv"), &[e, ch])?;
                expect_shape(file, &t("attn_gate"), &[e, vd])?;
                expect_shape(file, &t("ssm_conv1d"), &[r.conv_kernel as u64, ch])?;
                expect_shape(file, &format!("blk.{il}.ssm_dt.bias"), &[nv])?;
                expect_shape(file, &format!("blk.{il}.ssm_a"), &[nv])?;
                expect_shape(file, &t("ssm_beta"), &[e, nv])?;
                expect_shape(file, &t("ssm_alpha"), &[e, nv])?;
                expect_shape(file, &t("ssm_norm"), &[r.head as u64])?;
                expect_shape(file, &t("ssm_out"), &[vd, e])?;
            } else if self.gated_attention {
                // Each head's query followed by its gate.
                expect_shape(file, &t("attn_q"), &[e, 2 * q])?;
                expect_shape(file, &t("attn_k"), &[e, kv])?;
                expect_shape(file, &t("attn_v"), &[e, kv])?;
                expect_shape(file, &t("attn_output"), &[q, e])?;
            } else if let Some(m) = self.mla {
                let (n_head, head_k) = (self.n_head as u64, m.head_k as u64);
                let (lora, rot) = (m.kv_lora_rank as u64, m.n_rot as u64);
                if m.q_lora_rank > 0 {
                    let ql = m.q_lora_rank as u64;
                    expect_shape(file, &t("attn_q_a"), &[e, ql])?;
                    expect_shape(file, &t("attn_q_a_norm"), &[ql])?;
                    expect_shape(file, &t("attn_q_b"), &[ql, n_head * head_k])?;
                } else {
                    expect_shape(file, &t("attn_q"), &[e, n_head * head_k])?;
                }
                expect_shape(file, &t("attn_kv_a_mqa"), &[e, lora + rot])?;
                expect_shape(file, &t("attn_kv_a_norm"), &[lora])?;
                expect_shape(file, &t("attn_k_b"), &[head_k - rot, lora, n_head])?;
                expect_shape(file, &t("attn_v_b"), &[lora, m.head_v as u64, n_head])?;
                expect_shape(file, &t("attn_output"), &[n_head * m.head_v as u64, e])?;
            } else {
                expect_shape(file, &t("attn_q"), &[e, q])?;
                if !shared || file.meta().tensor(&t("attn_k")).is_some() {
                    expect_shape(file, &t("attn_k"), &[e, kv])?;
                }
                // Gemma 4's full layers may have no V projection: V is K.
                if !gemma4 || file.meta().tensor(&t("attn_v")).is_some() {
                    expect_shape(file, &t("attn_v"), &[e, kv])?;
                }
                expect_shape(file, &t("attn_output"), &[q, e])?;
            }
            if gemma4 {
                expect_shape(file, &t("post_attention_norm"), &[e])?;
                expect_shape(file, &t("post_ffw_norm"), &[e])?;
                if file.meta().tensor(&t("layer_output_scale")).is_some() {
                    expect_shape(file, &t("layer_output_scale"), &[1])?;
                }
            }
            // gpt-oss, GLM and Qwen3.5 normalise the FFN input with `post_attention_norm`.
            if self.arch.ffn_norm_is_post_attention() {
                expect_shape(file, &t("post_attention_norm"), &[e])?;
            } else {
                expect_shape(file, &t("ffn_norm"), &[e])?;
            }
            match &self.moe {
                Some(m) if self.is_moe_layer(il) => {
                    let (n_exp, ffe) = (m.n_expert as u64, m.n_ff_exp as u64);
                    expect_shape(file, &t("ffn_gate_inp"), &[e, n_exp])?;
                    if file.meta().tensor(&t("ffn_gate_up_exps")).is_some() {
                        expect_shape(file, &t("ffn_gate_up_exps"), &[e, 2 * ffe, n_exp])?;
                    } else {
                        expect_shape(file, &t("ffn_gate_exps"), &[e, ffe, n_exp])?;
                        expect_shape(file, &t("ffn_up_exps"), &[e, ffe, n_exp])?;
                    }
                    expect_shape(file, &t("ffn_down_exps"), &[ffe, e, n_exp])?;
                    if gemma4 {
                        // The dense FFN runs beside the experts, each with its own norms.
                        let s = format!("blk.{il}.ffn_gate_inp.scale");
                        expect_shape(file, &s, &[e])?;
                        for n in ["pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"] {
                            expect_shape(file, &t(n), &[e])?;
                        }
                        expect_shape(file, &t("ffn_gate"), &[e, ff])?;
                        expect_shape(file, &t("ffn_up"), &[e, ff])?;
                        expect_shape(file, &t("ffn_down"), &[ff, e])?;
                        let ds = format!("blk.{il}.ffn_down_exps.scale");
                        if file.meta().tensor(&ds).is_some() {
                            expect_shape(file, &ds, &[n_exp])?;
                        }
                    }
                    if m.shared_gate {
                        expect_shape(file, &t("ffn_gate_inp_shexp"), &[e])?;
                    }
                    if m.n_shared > 0 {
                        let sh = m.shared_ff() as u64;
                        expect_shape(file, &t("ffn_gate_shexp"), &[e, sh])?;
                        expect_shape(file, &t("ffn_up_shexp"), &[e, sh])?;
                        expect_shape(file, &t("ffn_down_shexp"), &[sh, e])?;
                    }
                }
                _ => {
                    expect_shape(file, &t("ffn_gate"), &[e, ff])?;
                    expect_shape(file, &t("ffn_up"), &[e, ff])?;
                    expect_shape(file, &t("ffn_down"), &[ff, e])?;
                }
            }
            if self.arch.qk_norm() && !self.is_recurrent(il) {
                expect_shape(file, &t("attn_q_norm"), &[hd])?;
                if !shared || file.meta().tensor(&t("attn_k_norm")).is_some() {
                    expect_shape(file, &t("attn_k_norm"), &[hd])?;
                }
            }
            if self.arch == Arch::Gemma3 {
                expect_shape(file, &t("post_attention_norm"), &[e])?;
                expect_shape(file, &t("post_ffw_norm"), &[e])?;
            }
            if self.arch == Arch::GptOss {
                expect_shape(file, &t("attn_sinks"), &[self.n_head as u64])?;
            }
        }
        Ok(())
    }
}

/// DeepSeek 2's YaRN log multiplier as llama.cpp uses it: the file's divided by 0.1.
fn deepseek2_yarn_log_mul(meta: &crate::gguf::GgufMeta, arch: &str) -> f32 {
    meta.get_f32(&format!("{arch}.rope.scaling.yarn_log_multiplier")).map_or(0.0, |m| m / 0.1)
}

/// GLM-4.7 Lite's vocabulary size: how llama.cpp recognises it among `deepseek2` files
/// that name no gating function.
const GLM47_LITE_VOCAB: usize = 154_880;

/// The latent attention's sizes, checked against the cache row the file describes
/// (`key_length` = compressed rank + rotated dims, `value_length` = compressed rank).
fn mla_params(meta: &crate::gguf::GgufMeta, arch: &str, n_head: usize, n_head_kv: usize, head_dim: usize, head_dim_v: usize, n_rot: usize) -> Result<Mla> {
    let key = |k: &str| format!("{arch}.{k}");
    let get = |k: &str| meta.get_u64(&key(k)).and_then(|v| usize::try_from(v).ok()).filter(|&v| v > 0 && v <= MAX_DIMENSION);
    let (Some(head_k), Some(head_v)) = (get("attention.key_length_mla"), get("attention.value_length_mla")) else {
        return Err(missing(&key("attention.key_length_mla"), "present with attention.value_length_mla (a DeepSeek file converted before llama.cpp split `attn_kv_b` for MLA is not supported: convert it again with a current llama.cpp)"));
    };
    let kv_lora_rank = get("attention.kv_lora_rank").ok_or_else(|| missing(&key("attention.kv_lora_rank"), "a value in 1..=MAX_DIMENSION"))?;
    let q_lora_rank = meta.get_u64(&key("attention.q_lora_rank")).and_then(|v| usize::try_from(v).ok()).unwrap_or(0);
    if n_head_kv != 1 || head_dim != kv_lora_rank + n_rot || head_dim_v != kv_lora_rank || n_rot == 0 || n_rot % 2 != 0 || head_k <= n_rot || q_lora_rank > MAX_DIMENSION || n_head == 0 {
        return Err(missing(
            &key("attention.key_length"),
            &format!("one KV head of kv_lora_rank + rope dims ({kv_lora_rank} + {n_rot}) with value_length = kv_lora_rank, and key_length_mla above the rope dims (found {n_head_kv} KV heads, key_length {head_dim}, value_length {head_dim_v}, key_length_mla {head_k})"),
        ));
    }
    Ok(Mla { q_lora_rank, kv_lora_rank, head_k, head_v, n_rot })
}

/// Qwen3.5's gated delta net sizes and which layers are recurrent: the file's
/// `attention.recurrent_layers` where given, else all but every `full_attention_interval`-th
/// (default 4), as llama.cpp decides.
fn recurrent_params(meta: &crate::gguf::GgufMeta, arch: &str, n_layer: usize, n_embd: usize) -> Result<Recurrent> {
    let key = |k: &str| format!("{arch}.{k}");
    let get = |k: &str| -> Result<usize> {
        meta.get_u64(&key(k)).and_then(|v| usize::try_from(v).ok()).filter(|&v| v > 0 && v <= MAX_DIMENSION).ok_or_else(|| missing(&key(k), &format!("a value in 1..={MAX_DIMENSION}")))
    };
    let (conv_kernel, inner, head, n_v_heads, n_k_heads) = (get("ssm.conv_kernel")?, get("ssm.inner_size")?, get("ssm.state_size")?, get("ssm.time_step_rank")?, get("ssm.group_count")?);
    if conv_kernel < 2 || inner != head * n_v_heads || n_v_heads % n_k_heads != 0 || n_embd == 0 {
        return Err(missing(
            &key("ssm.inner_size"),
            &format!("value heads x state size (found inner {inner}, {n_v_heads} value heads of {head}), value heads a multiple of key heads ({n_k_heads}), a kernel of 2 or more taps ({conv_kernel})"),
        ));
    }
    let layers: Vec<bool> = match meta.get(&key("attention.recurrent_layers")).and_then(|v| v.as_array()) {
        Some(items) => {
            let v: Vec<bool> = items.iter().map(|x| x.as_bool().or_else(|| x.as_u64().map(|u| u != 0)).unwrap_or(false)).collect();
            if v.len() < n_layer {
                return Err(missing(&key("attention.recurrent_layers"), &format!("one flag per layer ({n_layer})")));
            }
            v[..n_layer].to_vec()
        }
        None => {
            let every = meta.get_u64(&key("full_attention_interval")).map_or(QWEN35_FULL_ATTENTION_INTERVAL, |v| v as usize).max(1);
            (0..n_layer).map(|il| (il + 1) % every != 0).collect()
        }
    };
    Ok(Recurrent { conv_kernel, head, n_k_heads, n_v_heads, layers })
}

/// Qwen3.5: every fourth layer attends fully unless the file says otherwise (llama.cpp's default).
const QWEN35_FULL_ATTENTION_INTERVAL: usize = 4;

/// llama.cpp's `LLAMA_MAX_EXPERTS`.
const MAX_EXPERTS: usize = 512;

/// llama.cpp tells Gemma 3 27B, whose query scale differs, by its layer count.
const GEMMA3_27B_LAYERS: usize = 62;

/// Which layers slide, as llama.cpp's `load_swa_pattern` decides: an explicit per-layer
/// array, else every `pattern`-th layer (the last of each group) attends fully.
fn sliding_window(arch: Arch, meta: &crate::gguf::GgufMeta, arch_name: &str, n_layer: usize, rope: &Rope) -> Result<Option<SlidingWindow>> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let default_pattern = match arch {
        Arch::Gemma3 | Arch::Gemma4 => 6,
        Arch::GptOss => 2,
        Arch::Llama4 => LLAMA4_NOPE_STEP as u64,
        _ => return Ok(None),
    };
    let chunked = arch == Arch::Llama4;
    let n_swa = if chunked {
        // llama.cpp runs a Llama 4 whose file says 0 (no chunking) with an attention-
        // temperature input it never fills, and aborts: refuse it instead.
        if meta.get_u64(&key("attention.sliding_window")) == Some(0) {
            return Err(missing(&key("attention.sliding_window"), "absent or non-zero (a Llama 4 without chunked attention is not supported, as in llama.cpp)"));
        }
        LLAMA4_CHUNK
    } else {
        meta.get_u64(&key("attention.sliding_window")).unwrap_or(0) as usize
    };
    if n_swa == 0 {
        if arch == Arch::GptOss {
            return Err(missing(&key("attention.sliding_window"), "a window of at least one token"));
        }
        return Ok(None);
    }
    let pattern_value = meta.get(&key("attention.sliding_window_pattern"));
    let layers: Vec<bool> = match pattern_value.and_then(|v| v.as_array()) {
        Some(items) => {
            let v: Vec<bool> = items.iter().map(|v| v.as_bool().unwrap_or(false)).collect();
            if v.len() != n_layer {
                return Err(missing(&key("attention.sliding_window_pattern"), &format!("{n_layer} booleans, found {}", v.len())));
            }
            v
        }
        None => {
            let pattern = pattern_value.and_then(|v| v.as_u64()).unwrap_or(default_pattern) as usize;
            (0..n_layer).map(|il| pattern == 0 || il % pattern < pattern - 1).collect()
        }
    };
    // llama.cpp's defaults: gpt-oss slides with the model's own RoPE base and scale,
    // Gemma 3 with base 10,000 and no scaling.
    let (base_default, freq_scale) = if matches!(arch, Arch::GptOss | Arch::Llama4) { (rope.freq_base, rope.freq_scale) } else { (10_000.0, 1.0) };
    let freq_base = meta.get_f32(&key("rope.freq_base_swa")).unwrap_or(base_default);
    Ok(Some(SlidingWindow { n_swa, chunked, layers, freq_base, freq_scale }))
}

/// Llama 4's attention chunk, and its temperature's position floor, as llama.cpp fixes
/// them (not in the GGUF).
const LLAMA4_CHUNK: usize = 8192;
/// Llama 4's attention temperature scale (llama.cpp's fixed value).
const LLAMA4_TEMP_SCALE: f32 = 0.1;
/// Every fourth Llama 4 layer has no RoPE (llama.cpp's `n_no_rope_layer_step`).
const LLAMA4_NOPE_STEP: usize = 4;
/// Llama 4 Maverick's expert count: the one Llama 4 without Q/K norms.
const LLAMA4_MAVERICK_EXPERTS: usize = 128;

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

fn rope_params(arch_kind: Arch, arch: &str, meta: &crate::gguf::GgufMeta, n_rot: usize, n_ctx_train: usize) -> Result<Rope> {
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
            let (log_mul, base) = if arch_kind == Arch::DeepSeek2 {
                // Its file carries the multiplier times 0.1, and its `mscale` is the
                // multiplier too unless that is 1 (llama.cpp's DeepSeek V2 special case).
                let log_mul = deepseek2_yarn_log_mul(meta, arch);
                let num = if log_mul != 1.0 { log_mul } else { 1.0 };
                (log_mul, mscale(num) / mscale(log_mul))
            } else {
                let log_mul = meta.get_f32(&key("rope.scaling.yarn_log_multiplier")).unwrap_or(0.0);
                (log_mul, mscale(1.0) / mscale(log_mul))
            };
            let base = if log_mul != 0.0 { base } else { mscale(1.0) };
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
