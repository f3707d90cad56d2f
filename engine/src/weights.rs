//! Model weights as ggml tensors. CPU weights are bound zero-copy to the GGUF mmap:
//! the whole mapping is wrapped as one ggml CPU buffer and each tensor points into it,
//! so the OS pages them in on first use and may reclaim them under memory pressure —
//! what lets a device hold windows of a model larger than its RAM. Layers placed on an
//! accelerator are copied into that device's memory once, at load.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::ggml::{self, Device, WeightOp};
use crate::gguf::TensorInfo;
use crate::model::{Arch, ModelSpec};
use crate::model_file::ModelFile;
use crate::{Error, Result};

/// One transformer block's tensors. Optional ones exist in some architectures only.
pub struct LayerWeights {
    pub attn_norm: *mut sys::ggml_tensor,
    /// Absent under MLA with a low-rank query (`mla.q_a`).
    pub wq: Option<*mut sys::ggml_tensor>,
    /// Absent under MLA.
    pub wk: Option<*mut sys::ggml_tensor>,
    /// Absent in Gemma 4's full layers that take V from K.
    pub wv: Option<*mut sys::ggml_tensor>,
    /// The token mixer's output projection: attention's `attn_output`, or a recurrent
    /// layer's `ssm_out`.
    pub wo: *mut sys::ggml_tensor,
    pub bq: Option<*mut sys::ggml_tensor>,
    pub bk: Option<*mut sys::ggml_tensor>,
    pub bv: Option<*mut sys::ggml_tensor>,
    pub bo: Option<*mut sys::ggml_tensor>,
    pub q_norm: Option<*mut sys::ggml_tensor>,
    pub k_norm: Option<*mut sys::ggml_tensor>,
    /// Gemma 3: RMSNorm of the attention output before the residual add.
    pub attn_post_norm: Option<*mut sys::ggml_tensor>,
    /// gpt-oss: per-head attention sinks.
    pub sinks: Option<*mut sys::ggml_tensor>,
    /// The FFN's input norm (gpt-oss stores it as `post_attention_norm`).
    pub ffn_norm: *mut sys::ggml_tensor,
    pub ffn: Ffn,
    /// Gemma 3: RMSNorm of the FFN output before the residual add.
    pub ffn_post_norm: Option<*mut sys::ggml_tensor>,
    pub rope_freqs: Option<*mut sys::ggml_tensor>,
    /// Gemma 4: a learned scalar the layer's output is multiplied by.
    pub out_scale: Option<*mut sys::ggml_tensor>,
    /// DeepSeek's latent attention (then `wk` and `wv` are absent).
    pub mla: Option<MlaWeights>,
    /// Qwen3.5's linear attention, in its recurrent layers (then `wq`, `wk` and `wv` are absent).
    pub linear: Option<LinearAttnWeights>,
    /// Gemma 4 E2B/E4B: how the layer adds its per-layer input (`ModelSpec::per_layer_embd`).
    pub per_layer: Option<PerLayerWeights>,
}

/// A layer's use of its per-layer input: `x += post_norm(proj · (gelu(inp_gate · x) * input))`.
pub struct PerLayerWeights {
    /// `[n_embd, per_layer_embd]`.
    pub inp_gate: *mut sys::ggml_tensor,
    /// `[per_layer_embd, n_embd]`.
    pub proj: *mut sys::ggml_tensor,
    pub post_norm: *mut sys::ggml_tensor,
}

/// What makes the per-layer inputs (Gemma 4 E2B/E4B), bound with the embedding.
pub struct PerLayerInputWeights {
    /// Every layer's input per token, `[per_layer_embd * n_layer, n_vocab]`.
    pub tok_embd: *mut sys::ggml_tensor,
    /// From the scaled embedding, `[n_embd, per_layer_embd * n_layer]`.
    pub model_proj: *mut sys::ggml_tensor,
    pub proj_norm: *mut sys::ggml_tensor,
}

/// A gated-delta-net layer's tensors (see `ModelSpec::recurrent`); its output
/// projection is the layer's `wo`.
pub struct LinearAttnWeights {
    /// Q, K and V of every head in one projection, `[n_embd, conv_channels]`.
    pub qkv: *mut sys::ggml_tensor,
    /// The output gate's projection, `[n_embd, value_dim]`.
    pub gate: *mut sys::ggml_tensor,
    /// The causal convolution's taps, `[conv_kernel, conv_channels]`.
    pub conv: *mut sys::ggml_tensor,
    /// Per value head: the decay's bias and its (negative) rate, and the update strength's
    /// and decay's projections.
    pub dt_bias: *mut sys::ggml_tensor,
    pub a: *mut sys::ggml_tensor,
    pub beta: *mut sys::ggml_tensor,
    pub alpha: *mut sys::ggml_tensor,
    /// RMS norm of each head's output, `[head]`.
    pub norm: *mut sys::ggml_tensor,
}

/// Multi-head latent attention's projections (see `ModelSpec::mla`).
pub struct MlaWeights {
    /// The low-rank query: down, its norm, up (absent in the Lite models, which have `wq`).
    pub q_a: Option<*mut sys::ggml_tensor>,
    pub q_a_norm: Option<*mut sys::ggml_tensor>,
    pub q_b: Option<*mut sys::ggml_tensor>,
    /// To the compressed K/V and the rotated key part, `[n_embd, kv_lora_rank + n_rot]`.
    pub kv_a: *mut sys::ggml_tensor,
    pub kv_a_norm: *mut sys::ggml_tensor,
    /// Per head: the unrotated query part into the compressed space, and the compressed
    /// attention output out to a value head.
    pub k_b: *mut sys::ggml_tensor,
    pub v_b: *mut sys::ggml_tensor,
}

/// A block's feed-forward network: one dense gated FFN, or routed experts.
pub enum Ffn {
    Dense(DenseFfn),
    Moe(MoeWeights),
    /// Gemma 4's MoE layer: a dense FFN and the experts side by side on the same input.
    DenseAndMoe(Box<DenseAndMoe>),
}

/// See [`Ffn::DenseAndMoe`]. The dense half is normalised in by the layer's `ffn_norm`.
pub struct DenseAndMoe {
    pub dense: DenseFfn,
    /// `post_ffw_norm_1`: the dense half's output norm.
    pub dense_post_norm: *mut sys::ggml_tensor,
    pub moe: MoeWeights,
    /// `pre_ffw_norm_2` and `post_ffw_norm_2`: the experts' input and output norms.
    pub moe_pre_norm: *mut sys::ggml_tensor,
    pub moe_post_norm: *mut sys::ggml_tensor,
    /// `ffn_gate_inp.scale`: the router reads the RMS-normalised attention output times this.
    pub router_scale: *mut sys::ggml_tensor,
}

impl Ffn {
    /// The routed experts, where the layer has them.
    pub fn experts(&self) -> Option<&MoeWeights> {
        match self {
            Ffn::Dense(_) => None,
            Ffn::Moe(m) => Some(m),
            Ffn::DenseAndMoe(d) => Some(&d.moe),
        }
    }
}

/// A gated FFN: `down(act(gate x) * up x)`, with biases where the arch has them. Also a
/// MoE layer's shared experts.
pub struct DenseFfn {
    pub gate: *mut sys::ggml_tensor,
    pub up: *mut sys::ggml_tensor,
    pub down: *mut sys::ggml_tensor,
    pub gate_b: Option<*mut sys::ggml_tensor>,
    pub up_b: Option<*mut sys::ggml_tensor>,
    pub down_b: Option<*mut sys::ggml_tensor>,
}

/// Router and stacked expert matrices (`[n_embd, n_ff_exp, n_expert]` and
/// `[n_ff_exp, n_embd, n_expert]`), with per-expert biases where the arch has them.
pub struct MoeWeights {
    pub router: *mut sys::ggml_tensor,
    pub router_b: Option<*mut sys::ggml_tensor>,
    /// Gate and up apart, or stacked in one matrix (`ffn_gate_up_exps`, `[n_embd,
    /// 2 n_ff_exp, n_expert]`, gate first) as Gemma 4's converter writes them.
    pub gate_up: GateUp,
    pub down: *mut sys::ggml_tensor,
    /// Per-expert scale of the down projection's output (Gemma 4's `ffn_down_exps.scale`).
    pub down_s: Option<*mut sys::ggml_tensor>,
    pub gate_b: Option<*mut sys::ggml_tensor>,
    pub up_b: Option<*mut sys::ggml_tensor>,
    pub down_b: Option<*mut sys::ggml_tensor>,
    /// Per-expert bias added to the probabilities for choosing experts only (`exp_probs_b`).
    pub selection_b: Option<*mut sys::ggml_tensor>,
    /// Shared experts, run on every token.
    pub shared: Option<DenseFfn>,
    /// The shared experts' one-row router: their output times its sigmoid (Qwen3.5).
    pub shared_gate: Option<*mut sys::ggml_tensor>,
}

#[derive(Clone, Copy)]
pub enum GateUp {
    Split { gate: *mut sys::ggml_tensor, up: *mut sys::ggml_tensor },
    Fused(*mut sys::ggml_tensor),
}

impl MoeWeights {
    /// The stacked expert matrices, each once (null past the last): what the expert-read
    /// advice walks.
    pub fn matrices(&self) -> [*mut sys::ggml_tensor; 3] {
        match self.gate_up {
            GateUp::Split { gate, up } => [gate, up, self.down],
            GateUp::Fused(gu) => [gu, self.down, std::ptr::null_mut()],
        }
    }
}

/// The names (without `blk.N.`) of a block's tensors for `spec`'s architecture: those
/// it must have, and those it may have. The profiler, the prefetcher and the binding
/// all read the block through this one list.
pub fn block_tensor_names(spec: &ModelSpec, il: usize) -> (Vec<&'static str>, Vec<&'static str>) {
    if spec.arch == Arch::Gemma4 {
        return gemma4_block_tensor_names(spec, il);
    }
    let (mut required, mut optional) = if spec.is_recurrent(il) {
        (vec!["attn_norm.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight"], Vec::new())
    } else if spec.mla.is_some() {
        (
            vec!["attn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight"],
            vec!["attn_q.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"],
        )
    } else {
        (vec!["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"], vec!["attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"])
    };
    required.push(if spec.arch.ffn_norm_is_post_attention() { "post_attention_norm.weight" } else { "ffn_norm.weight" });
    if spec.is_moe_layer(il) {
        // Gate and up apart or stacked (`bind` checks one of the two is there).
        required.extend(["ffn_gate_inp.weight", "ffn_down_exps.weight"]);
        optional.extend(["ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight", "ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias", "exp_probs_b.bias"]);
        if spec.moe.is_some_and(|m| m.n_shared > 0) {
            required.extend(["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]);
        }
        if spec.moe.is_some_and(|m| m.shared_gate) {
            required.push("ffn_gate_inp_shexp.weight");
        }
    } else {
        required.extend(["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]);
        optional.extend(["ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"]);
    }
    if spec.arch.qk_norm() && !spec.is_recurrent(il) {
        required.extend(["attn_q_norm.weight", "attn_k_norm.weight"]);
    } else if spec.arch == Arch::Glm4Moe {
        // Only GLM-4.5 355B has them.
        optional.extend(["attn_q_norm.weight", "attn_k_norm.weight"]);
    }
    if spec.arch == Arch::Gemma3 {
        required.extend(["post_attention_norm.weight", "post_ffw_norm.weight"]);
    }
    if spec.arch == Arch::GptOss {
        required.push("attn_sinks.weight");
    }
    (required, optional)
}

fn gemma4_block_tensor_names(spec: &ModelSpec, il: usize) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut required = vec![
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_output.weight",
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "post_attention_norm.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
        "post_ffw_norm.weight",
    ];
    let mut optional = vec!["attn_v.weight", "layer_output_scale.weight"];
    if spec.kv_donor(il).is_some() {
        // It attends with its donor's cache: its own K (and V) projections, where the file
        // keeps them, are never used.
        required.retain(|n| !matches!(*n, "attn_k.weight" | "attn_k_norm.weight"));
        optional.retain(|n| *n != "attn_v.weight");
    }
    if spec.per_layer_embd > 0 {
        required.extend(["inp_gate.weight", "proj.weight", "post_norm.weight"]);
    }
    if spec.is_moe_layer(il) {
        required.extend(["ffn_gate_inp.weight", "ffn_gate_inp.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight", "ffn_down_exps.weight"]);
        optional.extend(["ffn_gate_up_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.scale"]);
    }
    (required, optional)
}

/// Weights of the layers one stage runs, plus the embedding (first window) and the
/// output head (last window) when the stage owns them.
pub struct Weights {
    /// Keeps the mapping the CPU tensors point into alive.
    _file: Arc<ModelFile>,
    pub tok_embd: Option<*mut sys::ggml_tensor>,
    pub output_norm: Option<*mut sys::ggml_tensor>,
    pub output: Option<*mut sys::ggml_tensor>,
    pub output_b: Option<*mut sys::ggml_tensor>,
    /// With the embedding, for a model with per-layer inputs.
    pub per_layer_inputs: Option<PerLayerInputWeights>,
    pub layers: BTreeMap<usize, LayerWeights>,
    /// Everything this value allocated in ggml, freed when it drops.
    alloc: crate::ggml::Allocations,
}

// SAFETY: the tensors and buffers are owned by this value alone and only used by the
// thread that holds it; ggml has no thread affinity for host memory.
unsafe impl Send for Weights {}

/// Where one layer's weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPlacement {
    pub layer: usize,
    /// Attention, norms, router, dense FFN and shared experts (and the layer's KV cache).
    pub device: Device,
    /// A MoE layer's routed expert tensors (`*_exps.*`); ignored for dense layers.
    pub experts: Device,
}

/// Which layers to bind and where each runs.
pub struct WeightPlan {
    pub layers: Vec<LayerPlacement>,
    pub embedding: bool,
    pub output: bool,
    /// Where the output layer runs (the embedding lookup stays on the CPU, as in llama.cpp).
    pub output_device: Device,
}

/// What the graph does with a weight, when a CPU extra buffer type could take it.
fn weight_op(name: &str, spec: &ModelSpec) -> Option<WeightOp> {
    const MATRICES: [&str; 24] = [
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
        "attn_q_a.weight",
        "attn_q_b.weight",
        "attn_kv_a_mqa.weight",
        "attn_k_b.weight",
        "attn_v_b.weight",
        "attn_qkv.weight",
        "attn_gate.weight",
        "ssm_beta.weight",
        "ssm_alpha.weight",
        "ssm_out.weight",
        "ffn_gate_inp_shexp.weight",
        // Gemma 4 E2B/E4B's per-layer inputs: `blk.N.inp_gate`, `blk.N.proj` and
        // `per_layer_model_proj`.
        "inp_gate.weight",
        "proj.weight",
    ];
    if name.ends_with("_exps.weight") {
        return spec.moe.map(|m| WeightOp::MulMatId(m.n_expert_used));
    }
    (name == "output.weight" || name == TIED_OUTPUT || MATRICES.iter().any(|m| name.ends_with(m))).then_some(WeightOp::MulMat)
}

/// The binding key of the LM head of a tied-output model: the embedding matrix a second
/// time, as llama.cpp loads it (`TENSOR_DUPLICATED`), so the lookup can read it from the
/// mapping while the LM head's copy is repacked.
const TIED_OUTPUT: &str = "token_embd.weight (output)";

impl Weights {
    /// `repack`: put the weights the CPU backend's extra buffer types take there, as
    /// llama.cpp does by default (copied out of the mapping into process memory, so such
    /// a weight is no longer paged by the OS); off, every CPU weight stays zero-copy.
    pub fn bind(file: Arc<ModelFile>, plan: &WeightPlan, accel: Option<&ggml::Accelerator>, repack: bool) -> Result<Weights> {
        let spec = file.spec.clone();
        let mut names: Vec<(String, Device, bool)> = Vec::new();
        if plan.embedding || (plan.output && spec.tied_output) {
            names.push(("token_embd.weight".into(), Device::Cpu, true));
        }
        if plan.embedding && spec.per_layer_embd > 0 {
            // llama.cpp: the lookup table with the input layer (CPU), the projection and
            // its norm with layer 0.
            let dev = plan.layers.iter().find(|p| p.layer == 0).map_or(Device::Cpu, |p| p.device);
            names.push(("per_layer_token_embd.weight".into(), Device::Cpu, true));
            names.push(("per_layer_model_proj.weight".into(), dev, true));
            names.push(("per_layer_proj_norm.weight".into(), dev, true));
        }
        if plan.output {
            names.push(("output_norm.weight".into(), plan.output_device, true));
            names.push(("output.weight".into(), plan.output_device, !spec.tied_output));
            names.push(("output.bias".into(), plan.output_device, false));
        }
        for p in &plan.layers {
            let il = p.layer;
            if il >= spec.n_layer {
                return Err(Error::InvalidWindow(format!("layer {il} is past the model's {} layers", spec.n_layer)));
            }
            let (required, optional) = block_tensor_names(&spec, il);
            // Routed experts' matrices and biases: `ffn_{gate,up,down}_exps.{weight,bias}`.
            let dev = |n: &str| if n.contains("_exps.") { p.experts } else { p.device };
            for n in required {
                names.push((format!("blk.{il}.{n}"), dev(n), true));
            }
            for n in optional {
                names.push((format!("blk.{il}.{n}"), dev(n), false));
            }
        }
        // llama 3 stores one rope-frequency tensor shared by all layers.
        let rope_freqs_present = file.gguf.meta().tensor("rope_freqs.weight").is_some();

        let mut weights = Weights {
            _file: file.clone(),
            tok_embd: None,
            output_norm: None,
            output: None,
            output_b: None,
            per_layer_inputs: None,
            layers: BTreeMap::new(),
            alloc: crate::ggml::Allocations::default(),
        };
        let meta = file.gguf.meta();
        let mut wanted: Vec<(String, Device)> = Vec::new();
        for (name, dev, required) in names {
            if meta.tensor(&name).is_none() {
                if required {
                    return Err(Error::Tensor { name, reason: "missing from the file".into() });
                }
                continue;
            }
            wanted.push((name, dev));
        }
        if rope_freqs_present && !plan.layers.is_empty() {
            wanted.push(("rope_freqs.weight".into(), Device::Cpu));
        }
        let extra = if repack { ggml::CpuExtraBuffers::get() } else { ggml::CpuExtraBuffers::none() };
        // With an accelerator, the weights kept in RAM go to its host buffer type (pinned
        // memory), not to the CPU's repacked layouts, as llama.cpp places them: a large
        // batch's ops on them then run on the accelerator, the weights copied over
        // (`op_offload`), which ggml does only from host memory. Measured on an H100 with
        // half of a Llama-8B-shaped model's layers in RAM: repacked, a 512-token prompt
        // ran at 82 tokens/s (the CPU's half computed by the CPU) against llama.cpp's 594.
        let host = if repack { accel.map(|a| a.host_buffer_type).filter(|b| !b.is_null()) } else { None };
        // The tied LM head is bound on its own on the accelerator, or where an extra
        // buffer type takes it.
        if plan.output && spec.tied_output {
            let info = meta.tensor("token_embd.weight").expect("checked above");
            if plan.output_device == Device::Accelerator || (host.is_none() && extra.pick(info.ty as u32, &info.dims, WeightOp::MulMat).is_some()) {
                wanted.push((TIED_OUTPUT.into(), plan.output_device));
            }
        }
        let n_tensors = wanted.len() + 1;
        let cpu_ctx = ggml::new_meta_context(n_tensors)?;
        weights.alloc.contexts.push(cpu_ctx);
        // Weights copied out of the mapping, per destination buffer type: the
        // accelerator's, or a CPU extra buffer type's.
        let mut copied: Vec<(sys::ggml_backend_buffer_type_t, *mut sys::ggml_context, Vec<(*mut sys::ggml_tensor, &TensorInfo)>)> = Vec::new();

        let mut bound: BTreeMap<String, *mut sys::ggml_tensor> = BTreeMap::new();
        let mut zero_copy: Vec<(*mut sys::ggml_tensor, &TensorInfo)> = Vec::new();
        for (key, dev) in &wanted {
            if bound.contains_key(key) {
                continue;
            }
            let name = if key == TIED_OUTPUT { "token_embd.weight" } else { key.as_str() };
            let info = meta.tensor(name).expect("checked above");
            let dest = match (dev, accel) {
                (Device::Accelerator, Some(a)) => Some(a.buffer_type),
                (Device::Accelerator, None) => {
                    return Err(Error::Ggml(format!("layer tensor `{name}` is placed on an accelerator, but none is available")));
                }
                (Device::Cpu, _) => host.or_else(|| weight_op(key, &spec).and_then(|op| extra.pick(info.ty as u32, &info.dims, op))),
            };
            let ctx = match dest {
                Some(buft) => match copied.iter().find(|c| c.0 == buft) {
                    Some(c) => c.1,
                    None => {
                        let c = ggml::new_meta_context(n_tensors)?;
                        weights.alloc.contexts.push(c);
                        copied.push((buft, c, Vec::new()));
                        c
                    }
                },
                None => cpu_ctx,
            };
            let t = ggml::new_tensor(ctx, info.ty as u32, &info.dims)?;
            let cname = CString::new(name).map_err(|_| Error::Tensor { name: name.to_string(), reason: "name has a NUL byte".into() })?;
            // SAFETY: t is a fresh tensor of ctx; ggml copies the name.
            unsafe { sys::ggml_set_name(t, cname.as_ptr()) };
            match dest {
                Some(buft) => {
                    let i = copied.iter().position(|c| c.0 == buft).expect("made above");
                    copied[i].2.push((t, info));
                }
                None => zero_copy.push((t, info)),
            }
            bound.insert(key.clone(), t);
        }

        // Zero-copy CPU binding: one buffer over the whole read-only mapping.
        let bytes = file.gguf.bytes();
        // SAFETY: the mapping outlives the buffer (Weights holds the Arc<ModelFile>), and
        // ggml only reads weight buffers.
        let cpu_buf = unsafe { sys::ggml_backend_cpu_buffer_from_ptr(bytes.as_ptr() as *mut _, bytes.len()) };
        if cpu_buf.is_null() {
            return Err(Error::Ggml("could not wrap the model mapping as a CPU buffer".into()));
        }
        weights.alloc.buffers.push(cpu_buf);
        // SAFETY: valid buffer from above.
        unsafe { sys::ggml_backend_buffer_set_usage(cpu_buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
        let data_offset = file.gguf.data_offset() as usize;
        for (t, info) in &zero_copy {
            let name = &info.name;
            let offset = data_offset + info.offset as usize;
            // SAFETY: the GGUF reader checked that [offset, offset + n_bytes) lies inside
            // the mapping, and ggml_nbytes(t) equals n_bytes for the same type and dims.
            unsafe {
                let addr = bytes.as_ptr().add(offset) as *mut std::ffi::c_void;
                if sys::ggml_nbytes(*t) as u64 != info.n_bytes {
                    return Err(Error::Tensor { name: name.clone(), reason: "size disagrees with ggml's".into() });
                }
                let status = sys::ggml_backend_tensor_alloc(cpu_buf, *t, addr);
                if status != sys::GGML_STATUS_SUCCESS {
                    return Err(Error::Ggml(format!("binding `{name}` failed with status {status}")));
                }
            }
        }

        for (buft, ctx, tensors) in &copied {
            // SAFETY: ctx holds only the tensors copied into this buffer type.
            let buf = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(*ctx, *buft) };
            if buf.is_null() {
                return Err(Error::Ggml("could not allocate memory for the weights copied out of the model file".into()));
            }
            weights.alloc.buffers.push(buf);
            // SAFETY: valid buffer; each t was allocated in it with exactly src.len()
            // bytes (an extra buffer type repacks while it copies).
            unsafe {
                sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
                for (t, info) in tensors {
                    let src = file.gguf.tensor_bytes(info);
                    if sys::ggml_nbytes(*t) as u64 != info.n_bytes || src.len() as u64 != info.n_bytes {
                        return Err(Error::Tensor { name: info.name.clone(), reason: "size disagrees with ggml's".into() });
                    }
                    sys::ggml_backend_tensor_set(*t, src.as_ptr() as *const _, 0, src.len());
                }
            }
        }

        let get = |n: &str| bound.get(n).copied();
        weights.tok_embd = get("token_embd.weight");
        if plan.output {
            weights.output_norm = get("output_norm.weight");
            weights.output = get("output.weight").or(get(TIED_OUTPUT)).or(weights.tok_embd);
            weights.output_b = get("output.bias");
        }
        if let (Some(tok_embd), Some(model_proj), Some(proj_norm)) = (get("per_layer_token_embd.weight"), get("per_layer_model_proj.weight"), get("per_layer_proj_norm.weight")) {
            weights.per_layer_inputs = Some(PerLayerInputWeights { tok_embd, model_proj, proj_norm });
        }
        let rope_freqs = get("rope_freqs.weight");
        for il in plan.layers.iter().map(|p| p.layer) {
            let w = |n: &str| get(&format!("blk.{il}.{n}"));
            let req = |n: &str| w(n).ok_or_else(|| Error::Tensor { name: format!("blk.{il}.{n}"), reason: "missing from the file".into() });
            let dense = || -> Result<DenseFfn> {
                Ok(DenseFfn { gate: req("ffn_gate.weight")?, up: req("ffn_up.weight")?, down: req("ffn_down.weight")?, gate_b: w("ffn_gate.bias"), up_b: w("ffn_up.bias"), down_b: w("ffn_down.bias") })
            };
            let experts = || -> Result<MoeWeights> {
                let gate_up = match w("ffn_gate_up_exps.weight") {
                    Some(gu) => GateUp::Fused(gu),
                    None => GateUp::Split { gate: req("ffn_gate_exps.weight")?, up: req("ffn_up_exps.weight")? },
                };
                Ok(MoeWeights {
                    router: req("ffn_gate_inp.weight")?,
                    router_b: w("ffn_gate_inp.bias"),
                    gate_up,
                    down: req("ffn_down_exps.weight")?,
                    down_s: w("ffn_down_exps.scale"),
                    gate_b: w("ffn_gate_exps.bias"),
                    up_b: w("ffn_up_exps.bias"),
                    down_b: w("ffn_down_exps.bias"),
                    selection_b: w("exp_probs_b.bias"),
                    shared: match (w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight"), w("ffn_down_shexp.weight")) {
                        (Some(gate), Some(up), Some(down)) => Some(DenseFfn { gate, up, down, gate_b: None, up_b: None, down_b: None }),
                        _ => None,
                    },
                    shared_gate: w("ffn_gate_inp_shexp.weight"),
                })
            };
            let ffn = match (spec.is_moe_layer(il), spec.arch) {
                (true, Arch::Gemma4) => Ffn::DenseAndMoe(Box::new(DenseAndMoe {
                    dense: dense()?,
                    dense_post_norm: req("post_ffw_norm_1.weight")?,
                    moe: experts()?,
                    moe_pre_norm: req("pre_ffw_norm_2.weight")?,
                    moe_post_norm: req("post_ffw_norm_2.weight")?,
                    router_scale: req("ffn_gate_inp.scale")?,
                })),
                (true, _) => Ffn::Moe(experts()?),
                (false, _) => Ffn::Dense(dense()?),
            };
            // gpt-oss, GLM and Qwen3.5 normalise the FFN input with `post_attention_norm`.
            let post_attention_ffn_norm = spec.arch.ffn_norm_is_post_attention();
            let recurrent = spec.is_recurrent(il);
            weights.layers.insert(
                il,
                LayerWeights {
                    attn_norm: req("attn_norm.weight")?,
                    wq: if spec.mla.is_some_and(|m| m.q_lora_rank > 0) || recurrent { None } else { Some(req("attn_q.weight")?) },
                    wk: if spec.mla.is_some() || recurrent || spec.kv_donor(il).is_some() { None } else { Some(req("attn_k.weight")?) },
                    wv: if spec.arch == Arch::Gemma4 || spec.mla.is_some() || recurrent { w("attn_v.weight") } else { Some(req("attn_v.weight")?) },
                    wo: if recurrent { req("ssm_out.weight")? } else { req("attn_output.weight")? },
                    bq: w("attn_q.bias"),
                    bk: w("attn_k.bias"),
                    bv: w("attn_v.bias"),
                    bo: w("attn_output.bias"),
                    q_norm: w("attn_q_norm.weight"),
                    k_norm: w("attn_k_norm.weight"),
                    attn_post_norm: if post_attention_ffn_norm { None } else { w("post_attention_norm.weight") },
                    sinks: w("attn_sinks.weight"),
                    ffn_norm: if post_attention_ffn_norm { req("post_attention_norm.weight")? } else { req("ffn_norm.weight")? },
                    ffn,
                    ffn_post_norm: w("post_ffw_norm.weight"),
                    // Gemma 4's frequency factors belong to its full layers only.
                    rope_freqs: rope_freqs.filter(|_| !(spec.arch == Arch::Gemma4 && spec.is_swa(il))),
                    out_scale: w("layer_output_scale.weight"),
                    mla: match spec.mla {
                        Some(m) => Some(MlaWeights {
                            q_a: if m.q_lora_rank > 0 { Some(req("attn_q_a.weight")?) } else { None },
                            q_a_norm: if m.q_lora_rank > 0 { Some(req("attn_q_a_norm.weight")?) } else { None },
                            q_b: if m.q_lora_rank > 0 { Some(req("attn_q_b.weight")?) } else { None },
                            kv_a: req("attn_kv_a_mqa.weight")?,
                            kv_a_norm: req("attn_kv_a_norm.weight")?,
                            k_b: req("attn_k_b.weight")?,
                            v_b: req("attn_v_b.weight")?,
                        }),
                        None => None,
                    },
                    linear: if recurrent {
                        Some(LinearAttnWeights {
                            qkv: req("attn_qkv.weight")?,
                            gate: req("attn_gate.weight")?,
                            conv: req("ssm_conv1d.weight")?,
                            dt_bias: req("ssm_dt.bias")?,
                            a: req("ssm_a")?,
                            beta: req("ssm_beta.weight")?,
                            alpha: req("ssm_alpha.weight")?,
                            norm: req("ssm_norm.weight")?,
                        })
                    } else {
                        None
                    },
                    per_layer: if spec.per_layer_embd > 0 { Some(PerLayerWeights { inp_gate: req("inp_gate.weight")?, proj: req("proj.weight")?, post_norm: req("post_norm.weight")? }) } else { None },
                },
            );
        }
        Ok(weights)
    }
}
