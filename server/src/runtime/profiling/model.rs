//! The model as the scheduler sees it (prima.cpp's `b`, `b_i`, `b_o`, `f^q`, ...), read
//! from a GGUF's tensor table: exact bytes and FLOPs per weight format of this file,
//! where the what-if fixtures (scheduler/tests/fixtures) estimate them from published
//! architectures with the same formulas.

use engine::gguf::GgmlType;
use engine::ModelFile;
use scheduler::{ModelProfile, MoeProfile, PerQuant};

/// Tokens per micro-batch the compute buffer is sized for (llama.cpp's default ubatch).
const UBATCH: usize = 512;

/// Bytes a memory-short device pages in per token for a MoE layer's experts, over the
/// bytes of the experts the token uses. Paged MoE windows read exactly the chosen experts'
/// slices (`engine::StageConfig::read_chosen_experts`), so 1.0: each used expert that is
/// not cached costs its own bytes. Left to the OS's read-around (8 MiB here) it was 3.0,
/// measured with `scripts/memory-experiment.sh` (docs/benchmarks.md, "MoE larger than
/// memory"). Routing that repeats experts from token to token reads less; the cost model
/// assumes none does.
const EXPERT_PAGE_AMPLIFICATION: f64 = 1.0;

/// Where a tensor's FLOPs go: the scheduler's named formats, or the tensor's own format
/// by ggml's name (charged at the device's measured rate for it).
pub(crate) fn format_slot(q: &mut PerQuant, ty: GgmlType) -> &mut f64 {
    use GgmlType::*;
    match ty {
        F32 => &mut q.f32,
        F16 => &mut q.f16,
        Q8_0 => &mut q.q8_0,
        Q6_K => &mut q.q6k,
        Q5_K => &mut q.q5k,
        Q4_K => &mut q.q4k,
        Q4_0 => &mut q.q4_0,
        Q4_1 => &mut q.q4_1,
        other => q.other.entry(other.name().to_string()).or_default(),
    }
}

/// The weight formats of a model outside the scheduler's named ones: those a device
/// measures its kernels for when it profiles for this model.
pub fn extra_formats(file: &ModelFile) -> Vec<GgmlType> {
    let mut probe = PerQuant::default();
    let mut out: Vec<GgmlType> = Vec::new();
    for t in file.gguf.meta().tensors() {
        if t.dims.len() >= 2 && t.dims[1] > 1 && !out.contains(&t.ty) {
            *format_slot(&mut probe, t.ty) += 1.0;
            if probe.other.contains_key(t.ty.name()) {
                out.push(t.ty);
            }
        }
    }
    out
}

/// `n_kv`: the context the plan is made for (KV-cache bytes and attention FLOPs grow with
/// it), in a cache of element types `kv`.
pub fn from_gguf(file: &ModelFile, name: &str, n_kv: usize, kv: engine::CacheTypes) -> ModelProfile {
    let spec = &file.spec;
    let (e, v) = (spec.n_embd, spec.n_vocab);
    let mut layer_bytes = 0u64;
    let mut layer_flops = PerQuant::default();
    let (mut input_bytes, mut output_bytes) = (0u64, 0u64);
    let mut output_flops = PerQuant::default();
    let mut embd_ty = GgmlType::F32;
    let mut expert_bytes = 0u64;
    let mut expert_flops = PerQuant::default();
    // A token runs only the experts the router picks: of stacked expert matrices, the
    // FLOPs are charged for `expert_used_count / expert_count` of them, the bytes for all.
    let expert_share = spec.moe.map_or(1.0, |m| m.n_expert_used as f64 / m.n_expert as f64);
    for t in file.gguf.meta().tensors() {
        // A matrix-vector product: 2 FLOPs per weight; vectors (norms, biases) are
        // element-wise and counted with the F32 work below.
        let share = if t.name.contains("_exps.") { expert_share } else { 1.0 };
        let matrix_flops = if t.dims.len() >= 2 && t.dims[1] > 1 { 2.0 * t.n_elements() as f64 * share } else { 0.0 };
        let block = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        if block.is_some_and(|il| il >= spec.n_layer) {
            // Multi-token-prediction blocks after the model's layers are never run.
            continue;
        }
        if t.name.starts_with("blk.") {
            layer_bytes += t.n_bytes;
            if t.name.contains("_exps.") {
                expert_bytes += t.n_bytes;
                *format_slot(&mut expert_flops, t.ty) += matrix_flops;
            }
            *format_slot(&mut layer_flops, t.ty) += matrix_flops;
        } else if t.name == "token_embd.weight" {
            input_bytes += t.n_bytes;
            embd_ty = t.ty;
        } else if t.name.starts_with("per_layer_") {
            // Gemma 4 E2B/E4B's per-layer inputs are made where the embedding is.
            input_bytes += t.n_bytes;
        } else if t.name.starts_with("output") {
            output_bytes += t.n_bytes;
            *format_slot(&mut output_flops, t.ty) += matrix_flops;
        }
    }
    if spec.tied_output {
        // The output layer reads the embedding matrix.
        output_bytes += input_bytes;
        *format_slot(&mut output_flops, embd_ty) += 2.0 * (v * e) as f64;
    }
    let n_layer = spec.n_layer.max(1);
    let per_layer = |x: f64| x / n_layer as f64;
    let mut lf = layer_flops.clone();
    for f in lf.values_mut().into_iter().chain(expert_flops.values_mut()) {
        *f = per_layer(*f);
    }
    // Attention against an F16 cache: QK^T and AV, each 2 FLOPs per head dim per cached
    // token; softmax, norms, RoPE and the FFN activation in F32.
    // Only layers that attend do (Qwen3.5's recurrent layers do not).
    let attending = (0..spec.n_layer).filter(|&il| !spec.is_recurrent(il)).count() as f64 / n_layer as f64;
    lf.f16 += 2.0 * 2.0 * spec.n_head as f64 * spec.mean_head_dim() * n_kv as f64 * attending;
    // A recurrent layer's state, per token: decayed, read against the key, updated by an
    // outer product and read against the query (~6 FLOPs per state value), and the
    // convolution's taps over its channels; F32.
    if let Some(r) = &spec.recurrent {
        let recurrent = 1.0 - attending;
        lf.f32 += recurrent * (6.0 * r.ssm_state_len() as f64 + 2.0 * (r.conv_kernel * r.conv_channels()) as f64);
    }
    // The FFN's hidden width a token goes through: its experts' together under MoE.
    let n_ff = spec.moe.map_or(spec.n_ff, |m| m.n_ff_exp * m.n_expert_used);
    lf.f32 += (2 * spec.n_head * n_kv + 10 * e + 4 * n_ff) as f64;
    // One micro-batch of logits and FFN intermediates, F32.
    let buffer = (UBATCH * 4 * (v + 2 * n_ff)) as f64;
    let head_dim = spec.mean_head_dim().round().max(1.0) as usize;
    let kv_heads = (spec.mean_n_embd_kv() / head_dim as f64).round().max(1.0) as usize;
    // Whole heads of an average size round; the bytes a cached token takes must not, so
    // the remainder goes into the bytes per element (1 where every layer is alike).
    let kv_exact = spec.mean_n_embd_kv() / (kv_heads * head_dim) as f64;
    ModelProfile {
        name: name.to_string(),
        n_layer: spec.n_layer,
        layer_bytes: per_layer(layer_bytes as f64),
        input_bytes: input_bytes as f64,
        output_bytes: output_bytes as f64,
        n_vocab: v,
        n_embd: e,
        // Per layer on average (Gemma 4's sliding and full layers differ): heads x head
        // size is the K/V row the memory model counts.
        n_head_k: kv_heads,
        // Latent attention reads V from the K rows: no V cache.
        n_head_v: if spec.mla.is_some() { 0 } else { kv_heads },
        head_dim_k: head_dim,
        head_dim_v: head_dim,
        n_kv,
        n_head: spec.n_head,
        kv_element_bytes_k: kv.k.bytes_per_element() * kv_exact,
        kv_element_bytes_v: kv.v.bytes_per_element() * kv_exact,
        layer_flops: lf,
        output_flops,
        compute_buffer_cpu: buffer,
        compute_buffer_gpu: buffer,
        moe: spec.moe.map(|_| MoeProfile {
            expert_bytes: per_layer(expert_bytes as f64),
            read_share: expert_share,
            disk_share: (expert_share * EXPERT_PAGE_AMPLIFICATION).min(1.0),
            expert_flops,
        }),
        state_bytes: spec.state_bytes(0..spec.n_layer) as f64 / n_layer as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the memory model counts per cached token and layer is what llama.cpp caches:
    /// under DeepSeek's latent attention one row of the compressed K/V plus the rotated
    /// part and no V; under Gemma 4 each layer kind's own K and V widths, averaged; under
    /// Qwen3.5 K and V of its attention layers only, plus each recurrent layer's state (a
    /// fixed size per sequence: the convolution's last inputs and the delta net's state).
    #[test]
    fn kv_bytes_per_layer_follow_the_cache_each_architecture_keeps() {
        let vocab = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/smollm2-vocab.gguf"));
        let dir = std::env::temp_dir().join(format!("hearth-kv-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n_kv = 1000;
        // (arch, F16 K+V elements per token summed over the 4 layers, f32 state values per
        // sequence summed over them)
        for (arch, elements, state) in [
            // 4 x (kv_lora_rank 64 + rope 16); V none.
            ("deepseek2", 4 * (64 + 16), 0),
            // Sliding layers 0 and 2: 2 KV heads of 16; full layers 1 and 3: 1 of 32; K and V.
            ("gemma4", 2 * (2 * 2 * 16 + 2 * 32), 0),
            // Layers 1 and 3 attend: 2 KV heads of 32, K and V. Layers 0 and 2 recurrent:
            // 3 taps x 256 channels (2 x 4 key heads + 8 value heads of 16), and 8 value
            // heads of 16 x 16.
            ("qwen35", 2 * (2 * 2 * 32), 2 * (3 * 256 + 8 * 16 * 16)),
        ] {
            let m = engine::random_model::RandomModel::new(arch, 4, 64, 128, 4, 2);
            let path = dir.join(format!("{arch}.gguf"));
            m.write(vocab, &path).unwrap();
            let file = ModelFile::open(&path).unwrap();
            let p = from_gguf(&file, arch, n_kv, engine::CacheTypes::default());
            let want = 2.0 * elements as f64 / 4.0 * n_kv as f64 + 4.0 * state as f64 / 4.0;
            assert!((p.kv_bytes_per_layer() - want).abs() < 1e-6 * want, "{arch}: {} bytes per layer, expected {want}", p.kv_bytes_per_layer());
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
