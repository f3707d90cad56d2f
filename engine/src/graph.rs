//! The ggml graph of one window of layers for one batch. It follows llama.cpp's own
//! graph for the llama family op for op (same norms, same RoPE call, K/V written with
//! `set_rows` into an F16 cache, flash attention with an F16 mask, the same `get_rows`
//! trim before the last layer's FFN) so hearth's output equals llama.cpp's.
//!
//! Sequences are attended separately: the batch is reordered so each sequence's tokens
//! are contiguous, and each sequence's queries attend only to its own slot of the cache.

use std::ops::Range;

use llama_cpp_sys_2 as sys;

use crate::kv_cache::KvCache;
use crate::model::{Arch, ModelSpec};
use crate::weights::Weights;

type T = *mut sys::ggml_tensor;

/// One sequence's share of the (reordered) batch.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    pub row0: usize,
    pub n_rows: usize,
    /// First cell of the sequence's slot.
    pub cell0: usize,
    /// Cells attended: the sequence length after this batch, padded like llama.cpp.
    pub n_kv: usize,
}

pub struct GraphShape<'a> {
    pub layers: Range<usize>,
    /// The input is token ids (embedding lookup first), not hidden states.
    pub embed: bool,
    /// The window ends with output norm + LM head and returns logits.
    pub logits: bool,
    pub n_tokens: usize,
    pub groups: &'a [GroupPlan],
    /// Rows whose logits are wanted; only read when the window ends the model.
    pub n_out: usize,
}

/// The graph and the input tensors the caller fills before computing it.
pub struct BuiltGraph {
    pub graph: *mut sys::ggml_cgraph,
    pub tokens: Option<T>,
    pub embd: Option<T>,
    /// Positions and KV cells; absent in a window without layers.
    pub pos: Option<T>,
    pub cells: Option<T>,
    pub masks: Vec<T>,
    pub out_ids: Option<T>,
    pub attn_scale: Option<T>,
    /// Hidden states `[n_embd, n_tokens]`, logits `[n_vocab, n_out]`, or none when the
    /// window ends the model and no logits are wanted (the batch only fills the cache).
    pub output: Option<T>,
}

/// Nodes per layer are ~30 plus ~8 per attended sequence; this bound leaves headroom.
pub fn max_nodes(n_layers: usize, n_groups: usize) -> usize {
    n_layers * (48 + 10 * n_groups) + 64
}

/// Builds the graph in `ctx` (a no-alloc context sized for `max_nodes`).
///
/// SAFETY: `ctx` is a live no-alloc ggml context; every weight and cache tensor referenced
/// by `w` and `cache` is alive and allocated.
pub unsafe fn build(ctx: *mut sys::ggml_context, spec: &ModelSpec, w: &Weights, cache: &KvCache, shape: &GraphShape, graph_size: usize) -> BuiltGraph {
    let n_tok = shape.n_tokens as i64;
    let first = shape.embed;
    let last = shape.logits;
    let has_layers = !shape.layers.is_empty();
    let (hd, n_head, n_head_kv) = (spec.head_dim as i64, spec.n_head as i64, spec.n_head_kv as i64);
    let n_embd_kv = spec.n_embd_kv() as i64;
    let rope = spec.rope;
    let eps = spec.rms_eps;

    let gf = sys::ggml_new_graph_custom(ctx, graph_size, false);
    let input = |t: T| {
        sys::ggml_set_input(t);
        t
    };

    // Inputs no node reads are never allocated, so a window without layers has none.
    let pos_t = has_layers.then(|| input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I32, n_tok)));
    let cells_t = has_layers.then(|| input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I64, n_tok)));
    let (pos, cells) = (pos_t.unwrap_or(std::ptr::null_mut()), cells_t.unwrap_or(std::ptr::null_mut()));
    let (tokens, embd, mut x) = if first {
        let ids = input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I32, n_tok));
        let tok_embd = w.tok_embd.expect("the first window binds the embeddings");
        (Some(ids), None, sys::ggml_get_rows(ctx, tok_embd, ids))
    } else {
        let e = input(sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, spec.n_embd as i64, n_tok));
        (None, Some(e), e)
    };
    let masks: Vec<T> = shape
        .groups
        .iter()
        .filter(|_| has_layers)
        .map(|g| input(sys::ggml_new_tensor_4d(ctx, sys::GGML_TYPE_F16, g.n_kv as i64, g.n_rows as i64, 1, 1)))
        .collect();
    let attn_scale = spec.attn_temperature.filter(|_| has_layers).map(|_| input(sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, 1, 1, n_tok)));
    let out_ids = (last && shape.n_out > 0).then(|| input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I32, shape.n_out as i64)));

    let norm = |t: T, weight: T| sys::ggml_mul(ctx, sys::ggml_rms_norm(ctx, t, eps), weight);
    let add_opt = |t: T, b: Option<T>| match b {
        Some(b) => sys::ggml_add(ctx, t, b),
        None => t,
    };
    let f16_row = |n: i64| sys::ggml_row_size(sys::GGML_TYPE_F16, n);

    for (i, il) in shape.layers.clone().enumerate() {
        let l = &w.layers[&il];
        let kv = &cache.layers[i];
        let inp_sa = x;
        let cur = norm(x, l.attn_norm);

        let mut q = add_opt(sys::ggml_mul_mat(ctx, l.wq, cur), l.bq);
        let mut k = add_opt(sys::ggml_mul_mat(ctx, l.wk, cur), l.bk);
        let v = add_opt(sys::ggml_mul_mat(ctx, l.wv, cur), l.bv);
        q = sys::ggml_reshape_3d(ctx, q, hd, n_head, n_tok);
        k = sys::ggml_reshape_3d(ctx, k, hd, n_head_kv, n_tok);
        let v = sys::ggml_reshape_3d(ctx, v, hd, n_head_kv, n_tok);
        if spec.arch == Arch::Qwen3 {
            q = norm(q, l.q_norm.expect("qwen3 has attn_q_norm"));
            k = norm(k, l.k_norm.expect("qwen3 has attn_k_norm"));
        }
        let freqs = l.rope_freqs.unwrap_or(std::ptr::null_mut());
        let rope_it = |t: T| {
            sys::ggml_rope_ext(
                ctx,
                t,
                pos,
                freqs,
                rope.n_dims,
                spec.arch.rope_mode(),
                rope.n_ctx_orig,
                rope.freq_base,
                rope.freq_scale,
                rope.ext_factor,
                rope.attn_factor,
                rope.beta_fast,
                rope.beta_slow,
            )
        };
        q = rope_it(q);
        k = rope_it(k);
        if let Some(scale) = attn_scale {
            q = sys::ggml_mul(ctx, q, scale);
        }
        // Same expansion order as llama.cpp, so the node order (and thus any fusion the
        // CPU backend applies) is the same.
        sys::ggml_build_forward_expand(gf, q);
        sys::ggml_build_forward_expand(gf, v);
        sys::ggml_build_forward_expand(gf, k);
        let k2 = sys::ggml_view_2d(ctx, k, n_embd_kv, n_tok, (*k).nb[2], 0);
        let v2 = sys::ggml_view_2d(ctx, v, n_embd_kv, n_tok, (*v).nb[2], 0);
        sys::ggml_build_forward_expand(gf, sys::ggml_set_rows(ctx, kv.k, k2, cells));
        sys::ggml_build_forward_expand(gf, sys::ggml_set_rows(ctx, kv.v, v2, cells));

        let is_model_last = last && il + 1 == spec.n_layer;
        if is_model_last && out_ids.is_none() {
            // Nothing downstream wants this batch's output: the K/V writes above were
            // all this layer had to do.
            break;
        }

        let mut attn: T = std::ptr::null_mut();
        for (g, mask) in shape.groups.iter().zip(&masks) {
            let qg = sys::ggml_view_3d(ctx, q, hd, n_head, g.n_rows as i64, (*q).nb[1], (*q).nb[2], (*q).nb[2] * g.row0);
            let qg = sys::ggml_permute(ctx, qg, 0, 2, 1, 3);
            let cache_view = |c: T| {
                let view = sys::ggml_view_3d(ctx, c, hd, n_head_kv, g.n_kv as i64, f16_row(hd), f16_row(n_embd_kv), f16_row(n_embd_kv) * g.cell0);
                sys::ggml_permute(ctx, view, 0, 2, 1, 3)
            };
            let fa = sys::ggml_flash_attn_ext(ctx, qg, cache_view(kv.k), cache_view(kv.v), *mask, spec.kq_scale, 0.0, 0.0);
            sys::ggml_prec_set_acc(fa, sys::GGML_PREC_F32);
            let out = sys::ggml_reshape_2d(ctx, fa, hd * n_head, g.n_rows as i64);
            attn = if attn.is_null() { out } else { sys::ggml_concat(ctx, attn, out, 1) };
        }
        let mut cur = add_opt(sys::ggml_mul_mat(ctx, l.wo, attn), l.bo);
        let mut residual = inp_sa;
        if is_model_last {
            let ids = out_ids.expect("checked above");
            cur = sys::ggml_get_rows(ctx, cur, ids);
            residual = sys::ggml_get_rows(ctx, residual, ids);
        }
        let ffn_inp = sys::ggml_add(ctx, cur, residual);
        let cur = norm(ffn_inp, l.ffn_norm);
        let up = add_opt(sys::ggml_mul_mat(ctx, l.ffn_up, cur), l.ffn_up_b);
        let gate = add_opt(sys::ggml_mul_mat(ctx, l.ffn_gate, cur), l.ffn_gate_b);
        let act = sys::ggml_swiglu_split(ctx, gate, up);
        let down = add_opt(sys::ggml_mul_mat(ctx, l.ffn_down, act), l.ffn_down_b);
        x = sys::ggml_add(ctx, down, ffn_inp);
    }

    let output = if last {
        out_ids.map(|ids| {
            if !has_layers {
                // The trim the last layer would have done before its FFN.
                x = sys::ggml_get_rows(ctx, x, ids);
            }
            let normed = norm(x, w.output_norm.expect("the last window binds output_norm"));
            add_opt(sys::ggml_mul_mat(ctx, w.output.expect("the last window binds the LM head"), normed), w.output_b)
        })
    } else {
        Some(x)
    };
    if let Some(o) = output {
        sys::ggml_set_output(o);
        sys::ggml_build_forward_expand(gf, o);
    }
    BuiltGraph { graph: gf, tokens, embd, pos: pos_t, cells: cells_t, masks, out_ids, attn_scale, output }
}
