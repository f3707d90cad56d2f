//! The ggml graph of one window of layers for one batch. It follows llama.cpp's own
//! graph of each architecture op for op (same norms, same RoPE call, K/V written with
//! `set_rows` into an F16 cache, flash attention with an F16 mask, the same `get_rows`
//! trim of the output rows, `build_moe_ffn`'s routing for MoE layers, sliding-window
//! masks) so hearth's output equals llama.cpp's.
//!
//! Sequences are attended separately: the batch is reordered so each sequence's tokens
//! are contiguous, and each sequence's queries attend only to its own slot of the cache
//! (sequences in neighbouring slots with as many rows each share one op, a slot each).

use std::ops::Range;

use llama_cpp_sys_2 as sys;

use crate::expert_reads::ExpertChoice;
use crate::kv_cache::{KvCache, RecurrentState};
use crate::model::{Arch, ModelSpec};
use crate::model::{Gating, Moe, MoeActivation};
use crate::weights::{DenseFfn, Ffn, GateUp, LinearAttnWeights, MoeWeights, Weights};

type T = *mut sys::ggml_tensor;

/// The share of the (reordered) batch one attention op takes: `n_seqs` sequences in
/// consecutive cache slots, `n_rows` rows each (llama.cpp's streams), usually one.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    pub row0: usize,
    /// Rows of each sequence.
    pub n_rows: usize,
    pub n_seqs: usize,
    /// Recurrent ops only: a sequence's rows before its draft tokens (its first row that
    /// wants logits and those before), after which its state is copied to the snapshot
    /// rows (`RecurrentState::snap_conv`); 0 when it has no drafts.
    pub split: usize,
    /// First cell of the first sequence's slot.
    pub cell0: usize,
    /// Cells attended in each slot: the longest sequence's length after this batch, padded
    /// like llama.cpp (a shorter sequence's mask hides the cells past its own).
    pub n_kv: usize,
    /// Sliding-window layers attend only from this cell, `n_kv_swa` cells: the window's
    /// start (aligned down to the padding, so shapes change every 256 positions, not every
    /// step) to the end. The cells skipped are ones the window masks anyway, so the result
    /// is the same and long contexts cost sliding layers only their window.
    pub cell0_swa: usize,
    pub n_kv_swa: usize,
}

pub struct GraphShape<'a> {
    pub layers: Range<usize>,
    /// The input is token ids (embedding lookup first), not hidden states.
    pub embed: bool,
    /// The window ends with output norm + LM head and returns logits.
    pub logits: bool,
    pub n_tokens: usize,
    pub groups: &'a [GroupPlan],
    /// The shares of the batch one recurrent (linear attention) op takes: sequences in
    /// consecutive slots with as many rows each, on any device (each sequence's state is
    /// computed alone inside the op, so sharing it changes no number).
    pub recurrent_groups: &'a [GroupPlan],
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
    /// Sliding-window masks, one per sequence, when the window has sliding layers.
    pub swa_masks: Vec<T>,
    pub out_ids: Option<T>,
    pub attn_scale: Option<T>,
    /// The Walsh-Hadamard matrices around a quantized K and V cache (see
    /// `CacheTypes::rotations`), one per size the window's layers use, to fill with
    /// `kv_cache::hadamard` of their size.
    pub rotations: Vec<T>,
    /// Hidden states `[n_embd, n_tokens]`, logits `[n_vocab, n_out]`, or none when the
    /// window ends the model and no logits are wanted (the batch only fills the cache).
    pub output: Option<T>,
    /// Each MoE layer's router choice and expert matrices, in layer order.
    pub expert_choices: Vec<ExpertChoice>,
    /// The RMS-norm node of every weighted norm inside a layer (attention, Q/K, FFN and
    /// post norms), with its layer: what llama.cpp names `norm` and pins to the layer's
    /// device for small batches (`Stage` does the same).
    pub layer_norms: Vec<(usize, T)>,
}

/// `cur` times the Walsh-Hadamard matrix `rot` in chunks of its size along rows, as
/// llama.cpp's `llama_mul_mat_hadamard` does (the hint lets the CPU run a fast transform).
///
/// SAFETY: live tensors of `ctx`; `cur`'s element count is a multiple of `rot`'s size.
unsafe fn rotate(ctx: *mut sys::ggml_context, cur: T, rot: T) -> T {
    let n = (*rot).ne[0];
    let rows = sys::ggml_nelements(cur) / n;
    let flat = if sys::ggml_is_contiguous(cur) { sys::ggml_reshape_2d(ctx, cur, n, rows) } else { sys::ggml_cont_2d(ctx, cur, n, rows) };
    let res = sys::ggml_mul_mat(ctx, rot, flat);
    sys::ggml_mul_mat_set_hint(res, sys::GGML_HINT_SRC0_IS_HADAMARD);
    sys::ggml_reshape_4d(ctx, res, (*cur).ne[0], (*cur).ne[1], (*cur).ne[2], (*cur).ne[3])
}

/// Nodes per layer are ~30 plus ~8 per attended sequence, and a MoE FFN ~25 more plus
/// 2 per expert used; this bound leaves headroom.
pub fn max_nodes(spec: &ModelSpec, n_layers: usize, n_groups: usize) -> usize {
    // Gemma 4's dense FFN and norms beside the experts: ~20 more.
    let moe = spec.moe.map_or(0, |m| 32 + 2 * m.n_expert_used + if spec.arch == Arch::Gemma4 { 24 } else { 0 } + if m.groups.is_some() { 16 } else { 0 });
    // MLA's absorbed queries and decompressed outputs: ~20 more, 6 per attended group.
    let mla = if spec.mla.is_some() { 20 + 6 * n_groups } else { 0 };
    // Qwen3.5's linear attention: ~20 projections and gates, ~28 per piece it runs (two
    // for a sequence with draft tokens).
    let recurrent = if spec.recurrent.is_some() { 24 + 56 * n_groups } else { 0 };
    // Gemma 4 E2B/E4B: a layer's per-layer input ~10, the inputs made and the K/V
    // carried ~40 once.
    let per_layer = if spec.per_layer_embd > 0 || spec.shared_kv_from.is_some() { 12 } else { 0 };
    // 14 of a layer's: a pad and a view for each of its seven weight products; 12 for
    // the rotations around a quantized cache.
    n_layers * (74 + moe + mla + recurrent + per_layer + 10 * n_groups) + 64 + 4 * per_layer
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
    let n_head = spec.n_head as i64;
    let rope = spec.rope;
    let eps = spec.rms_eps;

    let gf = sys::ggml_new_graph_custom(ctx, graph_size, false);
    let input = |t: T| {
        sys::ggml_set_input(t);
        t
    };

    // Inputs no node reads are never allocated, so a window without layers has none.
    // Only RoPE reads positions: a window of Llama 4's NoPE layers alone has none, nor
    // one of Qwen3.5's recurrent layers alone (nor has it K/V cells).
    let attends = |il: usize| !spec.is_recurrent(il);
    // Multi-section RoPE takes four positions per token.
    let n_pos = if spec.rope_sections.is_some() { 4 * n_tok } else { n_tok };
    let pos_t = shape.layers.clone().any(|il| spec.ropes(il) && attends(il)).then(|| input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I32, n_pos)));
    let cells_t = shape.layers.clone().any(attends).then(|| input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I64, n_tok)));
    let (pos, cells) = (pos_t.unwrap_or(std::ptr::null_mut()), cells_t.unwrap_or(std::ptr::null_mut()));
    let width = spec.hidden_width() as i64;
    let n_pl = spec.per_layer_embd as i64;
    let f32_size = std::mem::size_of::<f32>();
    let (tokens, embd, mut x) = if first {
        let ids = input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I32, n_tok));
        let tok_embd = w.tok_embd.expect("the first window binds the embeddings");
        let mut x = sys::ggml_get_rows(ctx, tok_embd, ids);
        if let Some(s) = spec.embed_scale {
            x = sys::ggml_scale(ctx, x, s);
        }
        (Some(ids), None, x)
    } else {
        let e = input(sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, width, n_tok));
        // The residual stream leads each row; what follows it (per-layer inputs, carried
        // K/V) is read through views below.
        let x = if width == spec.n_embd as i64 { e } else { sys::ggml_cont(ctx, sys::ggml_view_2d(ctx, e, spec.n_embd as i64, n_tok, (*e).nb[1], 0)) };
        (None, Some(e), x)
    };
    // Gemma 4 E2B/E4B's per-layer inputs, `[n_pl * n_layer, n_tok]`: made by the window
    // that embeds as llama.cpp makes them (the lookup scaled by sqrt(n_pl), plus the
    // normalised projection of the scaled embedding, over sqrt(2)), else read from the
    // input. llama.cpp lays them out layer-major; the values are the same.
    let per_layer_inputs: Option<T> = (n_pl > 0).then(|| match embd {
        Some(e) => sys::ggml_view_2d(ctx, e, n_pl * spec.n_layer as i64, n_tok, (*e).nb[1], spec.n_embd * f32_size),
        None => {
            let pw = w.per_layer_inputs.as_ref().expect("the first window binds the per-layer inputs");
            let ids = tokens.expect("the first window takes token ids");
            let looked_up = sys::ggml_get_rows(ctx, pw.tok_embd, ids);
            let looked_up = sys::ggml_scale(ctx, sys::ggml_reshape_3d(ctx, looked_up, n_pl, spec.n_layer as i64, n_tok), (n_pl as f32).sqrt());
            sys::ggml_build_forward_expand(gf, looked_up);
            let proj = sys::ggml_scale(ctx, sys::ggml_mul_mat(ctx, pw.model_proj, x), 1.0 / (spec.n_embd as f32).sqrt());
            let proj = sys::ggml_reshape_3d(ctx, proj, n_pl, spec.n_layer as i64, n_tok);
            let proj = sys::ggml_mul(ctx, sys::ggml_rms_norm(ctx, proj, eps), pw.proj_norm);
            let sum = sys::ggml_scale(ctx, sys::ggml_add(ctx, proj, looked_up), 1.0 / 2f32.sqrt());
            sys::ggml_reshape_2d(ctx, sum, n_pl * spec.n_layer as i64, n_tok)
        }
    });
    // Copies of donor caches this window attends with but does not compute: written first
    // from the K/V the input carries (see `ModelSpec::hidden_width`).
    let carried_in = |donor: usize, part: usize| -> Option<T> {
        let e = embd?;
        let off = spec.carried_kv_offset(donor)?;
        let n = spec.n_embd_kv_of(donor);
        Some(sys::ggml_view_2d(ctx, e, n as i64, n_tok, (*e).nb[1], (off + part * n) * f32_size))
    };
    for (donor, sh) in &cache.shadows {
        if let (Some(k), Some(v)) = (carried_in(*donor, 0), carried_in(*donor, 1)) {
            sys::ggml_build_forward_expand(gf, sys::ggml_set_rows(ctx, sh.k, sys::ggml_cont(ctx, k), cells));
            sys::ggml_build_forward_expand(gf, sys::ggml_set_rows(ctx, sh.v, sys::ggml_cont(ctx, v), cells));
        }
    }
    // The K and V each donor layer of this window computed, for the hidden states.
    let mut carried_out: Vec<(usize, T, T)> = Vec::new();
    // Inputs no node reads are left unallocated by ggml (and setting one aborts), so a
    // mask exists only for a kind of layer (full or sliding) that attends in this graph:
    // the model's last layer attends only when some output is wanted.
    let attending = |il: usize| !(last && il + 1 == spec.n_layer && shape.n_out == 0) && attends(il);
    let new_masks = |wanted: bool, swa: bool| -> Vec<T> {
        if !wanted {
            return Vec::new();
        }
        shape.groups.iter().map(|g| input(sys::ggml_new_tensor_4d(ctx, sys::GGML_TYPE_F16, if swa { g.n_kv_swa } else { g.n_kv } as i64, g.n_rows as i64, 1, g.n_seqs as i64))).collect()
    };
    let masks = new_masks(shape.layers.clone().any(|il| attending(il) && !spec.is_swa(il)), false);
    let swa_masks = new_masks(shape.layers.clone().any(|il| attending(il) && spec.is_swa(il)), true);
    // gpt-oss keeps every row through its last layer and picks the output rows after
    // it (llama.cpp's `openai-moe` graph); the others pick them before the last FFN.
    // Gemma 4 too, as llama.cpp builds it by default (after the output norm there, which
    // is per row, so the same numbers).
    let trim_after_layers = matches!(spec.arch, Arch::GptOss | Arch::Gemma4 | Arch::Qwen35 | Arch::Qwen35Moe);
    let attn_scale = spec.attn_temperature.filter(|_| shape.layers.clone().any(|il| spec.tempers(il))).map(|_| input(sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, 1, 1, n_tok)));
    let out_ids = (last && shape.n_out > 0).then(|| input(sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_I32, shape.n_out as i64)));
    // One rotation input per size: Gemma 4's sliding and full layers differ in head size.
    let mut rotations: Vec<T> = Vec::new();
    let mut rotation = |n: usize| -> Option<T> {
        if n == 0 {
            return None;
        }
        if let Some(t) = rotations.iter().find(|t| (***t).ne[0] == n as i64) {
            return Some(*t);
        }
        let t = input(sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, n as i64, n as i64));
        rotations.push(t);
        Some(t)
    };
    let layer_rotations: Vec<(Option<T>, Option<T>)> = shape
        .layers
        .clone()
        .map(|il| {
            // MLA's cache is not rotated (llama.cpp's K-only attention input has none), and
            // a recurrent layer has no cache to rotate.
            let (k, v) = if spec.mla.is_some() || spec.is_recurrent(il) { (0, 0) } else { cache.types.rotations(spec.head_dim_of(il)) };
            (rotation(k), rotation(v))
        })
        .collect();

    let add_opt = |t: T, b: Option<T>| match b {
        Some(b) => sys::ggml_add(ctx, t, b),
        None => t,
    };
    let mut expert_choices = Vec::new();
    let mut layer_norms = Vec::new();

    for (i, il) in shape.layers.clone().enumerate() {
        let l = &w.layers[&il];
        let kv = &cache.layers[i];
        let (k_rot, v_rot) = layer_rotations[i];
        let (hd, n_head_kv) = (spec.head_dim_of(il) as i64, spec.n_head_kv_of(il) as i64);
        let n_embd_kv = hd * n_head_kv;
        let shared = spec.kv_donor(il).is_some();
        let inp_sa = x;
        let mut norm = |t: T, weight: T| {
            let n = sys::ggml_rms_norm(ctx, t, eps);
            layer_norms.push((il, n));
            sys::ggml_mul(ctx, n, weight)
        };
        let cur = norm(x, l.attn_norm);
        let is_model_last = last && il + 1 == spec.n_layer;
        let attn = if let (Some(lin), Some(st)) = (&l.linear, kv.state) {
            let out = linear_attention(ctx, gf, spec, lin, st, cur, shape.recurrent_groups, cache.slot_cells, &mut norm);
            if is_model_last && out_ids.is_none() {
                // The state is written; nothing downstream wants this batch's output.
                break;
            }
            out
        } else {
        let freqs = l.rope_freqs.unwrap_or(std::ptr::null_mut());
        let n_rot = spec.n_rot_of(il) as i32;
        let (freq_base, freq_scale) = spec.rope_of(il);
        let rope_it = |t: T| {
            if let Some(mut sections) = spec.rope_sections {
                return sys::ggml_rope_multi(
                    ctx,
                    t,
                    pos,
                    freqs,
                    n_rot,
                    sections.as_mut_ptr(),
                    spec.arch.rope_mode(),
                    rope.n_ctx_orig,
                    freq_base,
                    freq_scale,
                    rope.ext_factor,
                    rope.attn_factor,
                    rope.beta_fast,
                    rope.beta_slow,
                );
            }
            sys::ggml_rope_ext(
                ctx,
                t,
                pos,
                freqs,
                n_rot,
                spec.arch.rope_mode(),
                rope.n_ctx_orig,
                freq_base,
                freq_scale,
                rope.ext_factor,
                rope.attn_factor,
                rope.beta_fast,
                rope.beta_slow,
            )
        };
        // Q, K and V as attention reads them; V is None where it is part of K's cache row
        // (MLA), and then its width is `v_width` and `v_up` decompresses the output.
        // Qwen3.5's full layers: each head's output gate, from the query projection.
        let mut out_gate: Option<T> = None;
        let (mut q, k, v, v_width, v_up) = match (&l.mla, spec.mla) {
            (Some(m), Some(dims)) => {
                let (lora, rot) = (dims.kv_lora_rank as i64, dims.n_rot as i64);
                let nope = dims.head_k as i64 - rot;
                let q = match (m.q_a, m.q_a_norm, m.q_b) {
                    (Some(a), Some(a_norm), Some(b)) => {
                        let q = norm(sys::ggml_mul_mat(ctx, a, cur), a_norm);
                        sys::ggml_mul_mat(ctx, b, q)
                    }
                    _ => sys::ggml_mul_mat(ctx, l.wq.expect("bound where the query is not low-rank"), cur),
                };
                let q = sys::ggml_reshape_3d(ctx, q, dims.head_k as i64, n_head, n_tok);
                let kv_pe = sys::ggml_mul_mat(ctx, m.kv_a, cur);
                let row = sys::ggml_row_size((*kv_pe).type_, lora + rot);
                let kv_cmpr = sys::ggml_view_2d(ctx, kv_pe, lora, n_tok, row, 0);
                let k_pe = sys::ggml_view_3d(ctx, kv_pe, rot, 1, n_tok, row, row, sys::ggml_row_size((*kv_pe).type_, lora));
                let k_pe = rope_it(k_pe);
                let kv_cmpr = norm(kv_cmpr, m.kv_a_norm);
                let q_nope = sys::ggml_view_3d(ctx, q, nope, n_head, n_tok, (*q).nb[1], (*q).nb[2], 0);
                let q_pe = sys::ggml_view_3d(ctx, q, rot, n_head, n_tok, (*q).nb[1], (*q).nb[2], sys::ggml_row_size((*q).type_, nope));
                let q_pe = rope_it(q_pe);
                // The unrotated query part absorbed into the compressed space, head by head.
                let q_abs = sys::ggml_mul_mat(ctx, m.k_b, sys::ggml_permute(ctx, q_nope, 0, 2, 1, 3));
                let q = sys::ggml_concat(ctx, sys::ggml_permute(ctx, q_abs, 0, 2, 1, 3), q_pe, 0);
                let kv_cmpr = sys::ggml_reshape_3d(ctx, kv_cmpr, lora, 1, n_tok);
                let k = sys::ggml_concat(ctx, kv_cmpr, k_pe, 0);
                (q, k, None, lora, Some((m.v_b, kv_cmpr)))
            }
            // A layer attending with its donor's cache computes only its queries.
            _ if shared => {
                let mut q = sys::ggml_reshape_3d(ctx, add_opt(mul_mat_acc(ctx, l.wq.expect("bound for heads attention"), cur, false), l.bq), hd, n_head, n_tok);
                if let Some(qn) = l.q_norm {
                    q = norm(q, qn);
                }
                if spec.ropes(il) {
                    q = rope_it(q);
                }
                (q, std::ptr::null_mut(), None, hd, None)
            }
            _ => {
                let mut q = add_opt(mul_mat_acc(ctx, l.wq.expect("bound for heads attention"), cur, false), l.bq);
                let mut k = add_opt(mul_mat_acc(ctx, l.wk.expect("bound for heads attention"), cur, false), l.bk);
                // Gemma 4's full layers without a V projection take K's (before its norm).
                let v = match l.wv {
                    Some(wv) => add_opt(mul_mat_acc(ctx, wv, cur, false), l.bv),
                    None => k,
                };
                if spec.gated_attention {
                    // Each head's query, then its gate, side by side in one projection.
                    let full = q;
                    let es = sys::ggml_element_size(full);
                    q = sys::ggml_view_3d(ctx, full, hd, n_head, n_tok, es * hd as usize * 2, es * hd as usize * 2 * n_head as usize, 0);
                    let g = sys::ggml_view_3d(ctx, full, hd, n_head, n_tok, es * hd as usize * 2, es * hd as usize * 2 * n_head as usize, es * hd as usize);
                    out_gate = Some(sys::ggml_cont_2d(ctx, g, hd * n_head, n_tok));
                } else {
                    q = sys::ggml_reshape_3d(ctx, q, hd, n_head, n_tok);
                }
                k = sys::ggml_reshape_3d(ctx, k, hd, n_head_kv, n_tok);
                let mut v = sys::ggml_reshape_3d(ctx, v, hd, n_head_kv, n_tok);
                // Required by the archs that have them always (checked at load), optional in GLM.
                if let (Some(qn), Some(kn)) = (l.q_norm, l.k_norm) {
                    q = norm(q, qn);
                    k = norm(k, kn);
                }
                if spec.v_norm {
                    v = sys::ggml_rms_norm(ctx, v, eps);
                }
                let ropes = spec.ropes(il);
                if ropes {
                    q = rope_it(q);
                    k = rope_it(k);
                }
                (q, k, Some(v), hd, None)
            }
        };
        let mut k = k;
        // Llama 4: the temperature, then the weightless norms (llama.cpp's order).
        if let Some(scale) = attn_scale.filter(|_| spec.tempers(il)) {
            q = sys::ggml_mul(ctx, q, scale);
        }
        if l.mla.is_none() && spec.ropes(il) && spec.qk_rms_after_rope {
            q = sys::ggml_rms_norm(ctx, q, eps);
            k = sys::ggml_rms_norm(ctx, k, eps);
        }
        if let Some(s) = spec.q_scale {
            q = sys::ggml_scale(ctx, q, s);
        }
        // A quantized cache holds rotated K and V (llama.cpp's `build_attn`).
        if let Some(r) = k_rot {
            q = rotate(ctx, q, r);
            if !shared {
                k = rotate(ctx, k, r);
            }
        }
        let v = match (v, v_rot) {
            (Some(v), Some(r)) => Some(rotate(ctx, v, r)),
            (v, _) => v,
        };
        // Same expansion order as llama.cpp, so the node order (and thus any fusion the
        // CPU backend applies) is the same.
        sys::ggml_build_forward_expand(gf, q);
        if !shared {
            sys::ggml_build_forward_expand(gf, v.or(v_up.map(|(_, c)| c)).unwrap_or(k));
            sys::ggml_build_forward_expand(gf, k);
            let k2 = sys::ggml_view_2d(ctx, k, n_embd_kv, n_tok, (*k).nb[2], 0);
            sys::ggml_build_forward_expand(gf, sys::ggml_set_rows(ctx, kv.k, k2, cells));
            if let Some(v) = v {
                let v2 = sys::ggml_view_2d(ctx, v, n_embd_kv, n_tok, (*v).nb[2], 0);
                sys::ggml_build_forward_expand(gf, sys::ggml_set_rows(ctx, kv.v, v2, cells));
                if !last && spec.kv_donors().any(|d| d == il) {
                    carried_out.push((il, k2, v2));
                }
            }
        }

        if is_model_last && out_ids.is_none() {
            // Nothing downstream wants this batch's output: the K/V writes above were
            // all this layer had to do.
            break;
        }

        let swa = spec.is_swa(il);
        let layer_masks = if swa { &swa_masks } else { &masks };
        let kq_scale = if spec.q_scale.is_some() { 1.0 } else { spec.kq_scale };
        let mut attn: T = std::ptr::null_mut();
        for (g, mask) in shape.groups.iter().zip(layer_masks) {
            let (rows, seqs) = (g.n_rows as i64, g.n_seqs as i64);
            let qg = sys::ggml_view_4d(ctx, q, (*q).ne[0], n_head, rows, seqs, (*q).nb[1], (*q).nb[2], (*q).nb[2] * g.n_rows, (*q).nb[2] * g.row0);
            let qg = sys::ggml_permute(ctx, qg, 0, 2, 1, 3);
            let (cell0, n_kv) = if swa { (g.cell0_swa, g.n_kv_swa) } else { (g.cell0, g.n_kv) };
            // `width` of each head's `hd` cached elements (all of them but for MLA's V).
            let cache_view = |c: T, width: i64| {
                // The cache's own type (F16 by default, a quantized one on request).
                let row = |n: i64| sys::ggml_row_size((*c).type_, n);
                let view = sys::ggml_view_4d(ctx, c, width, n_head_kv, n_kv as i64, seqs, row(hd), row(n_embd_kv), row(n_embd_kv) * cache.slot_cells, row(n_embd_kv) * cell0);
                let view = sys::ggml_permute(ctx, view, 0, 2, 1, 3);
                // Flash attention takes F16 or quantized K and V: an F32 cache is cast,
                // as llama.cpp casts it.
                if (*c).type_ == sys::GGML_TYPE_F32 {
                    sys::ggml_cast(ctx, view, sys::GGML_TYPE_F16)
                } else {
                    view
                }
            };
            let fa = sys::ggml_flash_attn_ext(ctx, qg, cache_view(kv.k, hd), cache_view(kv.v, v_width), *mask, kq_scale, 0.0, 0.0);
            if let Some(sinks) = l.sinks {
                sys::ggml_flash_attn_ext_add_sinks(fa, sinks);
            }
            sys::ggml_prec_set_acc(fa, sys::GGML_PREC_F32);
            let out = match v_up {
                // Out of the compressed space into each head's value, tokens along rows
                // (llama.cpp's matrix-matrix form).
                Some((v_b, _)) => {
                    let o = sys::ggml_mul_mat(ctx, v_b, sys::ggml_permute(ctx, fa, 0, 2, 1, 3));
                    let o = sys::ggml_cont(ctx, sys::ggml_permute(ctx, o, 0, 2, 1, 3));
                    sys::ggml_reshape_2d(ctx, o, (*o).ne[0] * (*o).ne[1], (*o).ne[2] * (*o).ne[3])
                }
                None => sys::ggml_reshape_2d(ctx, fa, hd * n_head, rows * seqs),
            };
            attn = if attn.is_null() { out } else { sys::ggml_concat(ctx, attn, out, 1) };
        }
        if let Some(r) = v_rot {
            // Back from V's rotation.
            attn = rotate(ctx, attn, r);
        }
        if let Some(g) = out_gate {
            attn = sys::ggml_mul(ctx, attn, sys::ggml_sigmoid(ctx, g));
        }
        attn
        };
        let mut cur = add_opt(mul_mat_acc(ctx, l.wo, attn, spec.arch.f32_accumulators()), l.bo);
        let mut residual = inp_sa;
        if is_model_last && !trim_after_layers {
            let ids = out_ids.expect("checked above");
            cur = sys::ggml_get_rows(ctx, cur, ids);
            residual = sys::ggml_get_rows(ctx, residual, ids);
        }
        if let Some(n) = l.attn_post_norm {
            cur = norm(cur, n);
        }
        let ffn_inp = sys::ggml_add(ctx, cur, residual);
        let cur = norm(ffn_inp, l.ffn_norm);
        let gelu = spec.arch.gemma();
        let mut cur = match &l.ffn {
            Ffn::Dense(f) => dense_ffn(ctx, f, cur, gelu, spec.arch.f32_accumulators()),
            Ffn::Moe(m) => moe_ffn(ctx, gf, spec.moe.as_ref().expect("MoE weights come with MoE metadata"), m, cur, None, &mut expert_choices, spec.arch.f32_accumulators()),
            Ffn::DenseAndMoe(d) => {
                // Gemma 4: the dense FFN on the normalised input, the experts on their own
                // norm of it, routed by the plain RMS norm of it scaled by 1/sqrt(n_embd)
                // and a learned vector; each half normalised again, then summed.
                let dense = norm(dense_ffn(ctx, &d.dense, cur, true, false), d.dense_post_norm);
                let moe_in = norm(ffn_inp, d.moe_pre_norm);
                let router_in = sys::ggml_rms_norm(ctx, ffn_inp, eps);
                let router_in = sys::ggml_mul(ctx, sys::ggml_scale(ctx, router_in, 1.0 / (spec.n_embd as f32).sqrt()), d.router_scale);
                let logits = sys::ggml_mul_mat(ctx, d.moe.router, router_in);
                let experts = moe_ffn(ctx, gf, spec.moe.as_ref().expect("MoE weights come with MoE metadata"), &d.moe, moe_in, Some(logits), &mut expert_choices, false);
                sys::ggml_add(ctx, dense, norm(experts, d.moe_post_norm))
            }
        };
        if let Some(n) = l.ffn_post_norm {
            // llama.cpp builds Gemma 4's with no layer, so does not pin it to one.
            cur = if spec.arch == Arch::Gemma4 { sys::ggml_mul(ctx, sys::ggml_rms_norm(ctx, cur, eps), n) } else { norm(cur, n) };
        }
        x = sys::ggml_add(ctx, cur, ffn_inp);
        if let (Some(p), Some(inputs)) = (&l.per_layer, per_layer_inputs) {
            // Gemma 4 E2B/E4B: the layer's own input, gated by the residual stream.
            let gate = sys::ggml_gelu(ctx, sys::ggml_mul_mat(ctx, p.inp_gate, x));
            let mine = sys::ggml_cont(ctx, sys::ggml_view_2d(ctx, inputs, n_pl, n_tok, (*inputs).nb[1], il * n_pl as usize * f32_size));
            let cur = norm(sys::ggml_mul_mat(ctx, p.proj, sys::ggml_mul(ctx, gate, mine)), p.post_norm);
            x = sys::ggml_add(ctx, x, cur);
        }
        if let Some(s) = l.out_scale {
            x = sys::ggml_mul(ctx, x, s);
        }
    }

    let output = if last {
        out_ids.map(|ids| {
            if !has_layers || trim_after_layers {
                // The trim the last layer would have done before its FFN (or, for archs
                // that trim after the layers, does here).
                x = sys::ggml_get_rows(ctx, x, ids);
            }
            let normed = sys::ggml_mul(ctx, sys::ggml_rms_norm(ctx, x, eps), w.output_norm.expect("the last window binds output_norm"));
            let mut logits = add_opt(mul_mat_acc(ctx, w.output.expect("the last window binds the LM head"), normed, false), w.output_b);
            if let Some(c) = spec.logit_softcap {
                logits = sys::ggml_scale(ctx, sys::ggml_tanh(ctx, sys::ggml_scale(ctx, logits, 1.0 / c)), c);
            }
            logits
        })
    } else if width == spec.n_embd as i64 {
        Some(x)
    } else {
        // The residual stream, then what later windows read: the per-layer inputs and
        // the donors' K/V (computed here, passed on from the input, or zeros before the
        // donor is reached).
        let mut out = x;
        if let Some(p) = per_layer_inputs {
            out = sys::ggml_concat(ctx, out, p, 0);
        }
        for d in spec.kv_donors() {
            for part in 0..2 {
                let t = match (carried_out.iter().find(|c| c.0 == d), carried_in(d, part)) {
                    (Some(&(_, k, v)), _) => sys::ggml_cont(ctx, if part == 0 { k } else { v }),
                    (None, Some(t)) => t,
                    (None, None) => sys::ggml_fill(ctx, sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, spec.n_embd_kv_of(d) as i64, n_tok), 0.0),
                };
                out = sys::ggml_concat(ctx, out, t, 0);
            }
        }
        Some(out)
    };
    if let Some(o) = output {
        sys::ggml_set_output(o);
        sys::ggml_build_forward_expand(gf, o);
    }
    BuiltGraph { graph: gf, tokens, embd, pos: pos_t, cells: cells_t, masks, swa_masks, out_ids, attn_scale, rotations, output, expert_choices, layer_norms }
}

/// llama.cpp's `build_moe_ffn` for the archs hearth runs: router, gating, top-k experts
/// per token through `ggml_mul_mat_id`, weighted sum of the chosen experts' outputs.
///
/// SAFETY: as `build`.
/// `router_logits`: computed by the caller from another input than `cur` (Gemma 4).
unsafe fn moe_ffn(ctx: *mut sys::ggml_context, gf: *mut sys::ggml_cgraph, moe: &Moe, m: &MoeWeights, cur: T, router_logits: Option<T>, choices: &mut Vec<ExpertChoice>, f32_acc: bool) -> T {
    // Clamp of the weights' sum, as llama.cpp: the smallest normal F16.
    const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;
    // gpt-oss's clamped SwiGLU, constants as llama.cpp hard-codes them.
    const OAI_ALPHA: f32 = 1.702;
    const OAI_LIMIT: f32 = 7.0;
    let (n_embd, n_tok) = ((*cur).ne[0], (*cur).ne[1]);
    let (n_expert, k) = (moe.n_expert as i64, moe.n_expert_used as i64);
    let add_opt = |t: T, b: Option<T>| match b {
        Some(b) => sys::ggml_add(ctx, t, b),
        None => t,
    };
    let add_id = |t: T, b: Option<T>, ids: T| match b {
        Some(b) => sys::ggml_add_id(ctx, t, b, ids),
        None => t,
    };
    let logits = add_opt(router_logits.unwrap_or_else(|| sys::ggml_mul_mat(ctx, m.router, cur)), m.router_b);
    let probs = match moe.gating {
        Gating::Softmax => sys::ggml_soft_max(ctx, logits),
        Gating::Sigmoid | Gating::SigmoidInput => sys::ggml_sigmoid(ctx, logits),
        Gating::SoftmaxWeight => logits,
    };
    // The selection bias picks the experts; the weights stay the unbiased probabilities.
    let selection = match (m.selection_b, moe.gating) {
        (_, Gating::SigmoidInput) => logits,
        (Some(b), _) => sys::ggml_add(ctx, probs, b),
        (None, _) => probs,
    };
    // DeepSeek V3: only the experts of the best groups compete (a group scores the sum of
    // its best two), the others' scores masked to -inf, as llama.cpp's `build_moe_ffn`.
    let selection = match moe.groups {
        Some((n_groups, n_used)) if n_tok > 0 => {
            let (g, per) = (n_groups as i64, n_expert / n_groups as i64);
            let grouped = sys::ggml_reshape_3d(ctx, selection, per, g, n_tok);
            let best2 = sys::ggml_argsort_top_k(ctx, grouped, 2);
            let best2 = sys::ggml_get_rows(ctx, sys::ggml_reshape_4d(ctx, grouped, 1, per, g, n_tok), best2);
            let scores = sys::ggml_sum_rows(ctx, sys::ggml_reshape_3d(ctx, best2, 2, g, n_tok));
            let scores = sys::ggml_reshape_2d(ctx, scores, g, n_tok);
            let groups = sys::ggml_argsort_top_k(ctx, scores, n_used as i32);
            let kept = sys::ggml_get_rows(ctx, grouped, groups);
            let masked = sys::ggml_set_rows(ctx, sys::ggml_fill(ctx, grouped, f32::NEG_INFINITY), kept, groups);
            sys::ggml_reshape_2d(ctx, masked, n_expert, n_tok)
        }
        _ => selection,
    };
    let selected = sys::ggml_argsort_top_k(ctx, selection, k as i32);
    // The top-k is a view of the full argsort, the node that computes.
    choices.push(ExpertChoice { sorted: (*selected).view_src, k: k as usize, matrices: m.matrices() });
    let mut weights = sys::ggml_get_rows(ctx, sys::ggml_reshape_3d(ctx, probs, 1, n_expert, n_tok), selected);
    if moe.gating == Gating::SoftmaxWeight {
        weights = sys::ggml_reshape_3d(ctx, sys::ggml_soft_max(ctx, sys::ggml_reshape_2d(ctx, weights, k, n_tok)), 1, k, n_tok);
    }
    if moe.norm_weights {
        let w2 = sys::ggml_reshape_2d(ctx, weights, k, n_tok);
        let sum = sys::ggml_clamp(ctx, sys::ggml_sum_rows(ctx, w2), MIN_WEIGHT_SUM, f32::INFINITY);
        weights = sys::ggml_reshape_3d(ctx, sys::ggml_div(ctx, w2, sum), 1, k, n_tok);
    }
    if moe.weights_scale != 0.0 && moe.weights_scale != 1.0 {
        weights = sys::ggml_scale(ctx, weights, moe.weights_scale);
    }
    sys::ggml_build_forward_expand(gf, weights);
    // The 2-D input, for the shared experts.
    let input = cur;
    let mut cur = sys::ggml_reshape_3d(ctx, cur, n_embd, 1, n_tok);
    let weight_input = moe.gating == Gating::SigmoidInput;
    if weight_input {
        cur = sys::ggml_mul(ctx, sys::ggml_repeat_4d(ctx, cur, n_embd, k, n_tok, 1), weights);
    }
    let (gate, up) = match m.gate_up {
        GateUp::Split { gate, up } => {
            let up = add_id(sys::ggml_mul_mat_id(ctx, up, cur, selected), m.up_b, selected);
            (add_id(sys::ggml_mul_mat_id(ctx, gate, cur, selected), m.gate_b, selected), up)
        }
        GateUp::Fused(gu) => {
            // One product, then gate and up as views of its halves.
            let both = sys::ggml_mul_mat_id(ctx, gu, cur, selected);
            let n_ff = (*both).ne[0] / 2;
            let half = |i: i64| sys::ggml_view_3d(ctx, both, n_ff, (*both).ne[1], (*both).ne[2], (*both).nb[1], (*both).nb[2], (i * n_ff) as usize * (*both).nb[0]);
            (half(0), half(1))
        }
    };
    let act = match moe.activation {
        MoeActivation::Silu => sys::ggml_swiglu_split(ctx, gate, up),
        MoeActivation::Gelu => sys::ggml_geglu_split(ctx, gate, up),
        MoeActivation::SwigluOai => sys::ggml_swiglu_oai(ctx, gate, up, OAI_ALPHA, OAI_LIMIT),
    };
    let mut experts = sys::ggml_mul_mat_id(ctx, m.down, act, selected);
    if let Some(s) = m.down_s {
        // Each chosen expert's output times its scale (llama.cpp's `build_lora_mm_id`).
        let n_exp_s = (*s).ne[0];
        let scales = sys::ggml_repeat_4d(ctx, sys::ggml_reshape_3d(ctx, s, 1, n_exp_s, 1), 1, n_exp_s, n_tok, 1);
        experts = sys::ggml_mul(ctx, experts, sys::ggml_get_rows(ctx, scales, selected));
    }
    let experts = add_id(experts, m.down_b, selected);
    let experts = if weight_input { experts } else { sys::ggml_mul(ctx, experts, weights) };
    sys::ggml_build_forward_expand(gf, experts);
    // Views first, then the adds, in llama.cpp's order.
    let views: Vec<T> = (0..k)
        .map(|i| {
            let v = sys::ggml_view_2d(ctx, experts, n_embd, n_tok, (*experts).nb[2], i as usize * (*experts).nb[1]);
            sys::ggml_build_forward_expand(gf, v);
            v
        })
        .collect();
    let mut out = views[0];
    for v in &views[1..] {
        out = sys::ggml_add(ctx, out, *v);
        sys::ggml_build_forward_expand(gf, out);
    }
    if k == 1 {
        out = sys::ggml_cont(ctx, out);
    }
    match &m.shared {
        // Shared experts on the same input, a dense SwiGLU FFN (llama.cpp's build_ffn),
        // Qwen3.5's scaled by the sigmoid of their own router.
        Some(f) => {
            let mut shared = dense_ffn(ctx, f, input, false, f32_acc);
            if let Some(g) = m.shared_gate {
                shared = sys::ggml_mul(ctx, shared, sys::ggml_sigmoid(ctx, sys::ggml_mul_mat(ctx, g, input)));
            }
            sys::ggml_add(ctx, out, shared)
        }
        None => out,
    }
}

/// Qwen3.5's gated delta net over the batch, as llama.cpp's `build_layer_attn_linear`
/// computes it with its fused op: the Q/K/V projection through a causal convolution that
/// continues each sequence's last inputs, Q and K L2-normalised, the recurrent state
/// decayed and updated token by token (`ggml_gated_delta_net`), each head's output
/// RMS-normalised and gated by the SiLU of its own projection. Each group's sequences read
/// and write their slots' state rows (consecutive slots, as the KV cache's). Returns the
/// output before the layer's `ssm_out` projection, `[value_dim, n_tokens]`.
///
/// SAFETY: as `build`; `st` is the layer's state in `cache`, `slot_cells` its slot size;
/// `norm` is the layer's weighted RMS norm.
#[allow(clippy::too_many_arguments)]
unsafe fn linear_attention(ctx: *mut sys::ggml_context, gf: *mut sys::ggml_cgraph, spec: &ModelSpec, lin: &LinearAttnWeights, st: RecurrentState, cur: T, groups: &[GroupPlan], slot_cells: usize, norm: &mut impl FnMut(T, T) -> T) -> T {
    let r = spec.recurrent.as_ref().expect("a recurrent layer comes with its sizes");
    let (hd, nk, nv) = (r.head as i64, r.n_k_heads as i64, r.n_v_heads as i64);
    let (ch, taps) = (r.conv_channels() as i64, r.conv_kernel as i64);
    let f32_row = |n: i64| sys::ggml_row_size(sys::GGML_TYPE_F32, n);
    let qkv = mul_mat_acc(ctx, lin.qkv, cur, false);
    let z = mul_mat_acc(ctx, lin.gate, cur, false);
    let beta = sys::ggml_sigmoid(ctx, mul_mat_acc(ctx, lin.beta, cur, false));
    let alpha = mul_mat_acc(ctx, lin.alpha, cur, false);
    // The decay: -exp(A_log) (stored as `ssm_a`) times softplus(alpha + dt_bias).
    let decay = sys::ggml_mul(ctx, sys::ggml_softplus(ctx, sys::ggml_add(ctx, alpha, lin.dt_bias)), lin.a);
    let (conv_len, ssm_len) = (r.conv_state_len() as i64, r.ssm_state_len() as i64);
    // `seqs` sequences of `rows` rows each from `row0`, starting from the states in
    // `conv_in`/`ssm_in` (`[len, seqs]` rows) and leaving theirs in `conv_dst`/`ssm_dst`;
    // returns the output and the written states (the copies: reading them orders after).
    let mut piece = |row0: usize, rows: usize, seqs: i64, conv_in: T, ssm_in: T, conv_dst: T, ssm_dst: T| -> (T, T, T) {
        let n_rows = rows as i64;
        let x = sys::ggml_view_3d(ctx, qkv, ch, n_rows, seqs, (*qkv).nb[1], (*qkv).nb[1] * rows, (*qkv).nb[1] * row0);
        // The convolution's input: the sequence's last `taps - 1` inputs, then the batch's.
        let conv_states = sys::ggml_reshape_3d(ctx, conv_in, taps - 1, ch, seqs);
        let conv_input = sys::ggml_concat(ctx, conv_states, sys::ggml_transpose(ctx, x), 0);
        let last = sys::ggml_view_3d(ctx, conv_input, taps - 1, ch, seqs, (*conv_input).nb[1], (*conv_input).nb[2], sys::ggml_row_size((*conv_input).type_, n_rows));
        let conv_written = sys::ggml_cpy(ctx, last, conv_dst);
        sys::ggml_build_forward_expand(gf, conv_written);
        let conv = sys::ggml_silu(ctx, sys::ggml_ssm_conv(ctx, conv_input, lin.conv));
        let nb1 = sys::ggml_row_size((*conv).type_, ch);
        let part = |n_heads: i64, offset: i64| sys::ggml_view_4d(ctx, conv, hd, n_heads, n_rows, seqs, f32_row(hd), nb1, nb1 * rows, f32_row(offset));
        // L2 norms as llama.cpp writes them: an RMS norm with eps / n, scaled by 1/sqrt(n).
        let l2 = |t: T| sys::ggml_scale(ctx, sys::ggml_rms_norm(ctx, t, spec.rms_eps / hd as f32), 1.0 / (hd as f32).sqrt());
        let q = l2(part(nk, 0));
        let k = l2(part(nk, hd * nk));
        let v = part(nv, 2 * hd * nk);
        let per_head = |t: T| sys::ggml_view_4d(ctx, t, 1, nv, n_rows, seqs, f32_row(1), f32_row(nv), f32_row(nv * n_rows), f32_row(nv) * row0);
        let state = sys::ggml_reshape_4d(ctx, ssm_in, hd, hd, nv, seqs);
        let res = sys::ggml_gated_delta_net(ctx, q, k, v, per_head(decay), per_head(beta), state, 1);
        let o = sys::ggml_view_4d(ctx, res, hd, nv, n_rows, seqs, f32_row(hd), f32_row(hd * nv), f32_row(hd * nv * n_rows), 0);
        let new_state = sys::ggml_view_4d(ctx, res, hd, hd, nv, seqs, f32_row(hd), f32_row(hd * hd), f32_row(hd * hd * nv), f32_row(hd * nv * n_rows * seqs));
        let ssm_written = sys::ggml_cpy(ctx, new_state, ssm_dst);
        sys::ggml_build_forward_expand(gf, ssm_written);
        let zg = sys::ggml_view_4d(ctx, z, hd, nv, n_rows, seqs, (*z).nb[0] * hd as usize, (*z).nb[1], (*z).nb[1] * rows, (*z).nb[1] * row0);
        let gated = sys::ggml_mul(ctx, norm(o, lin.norm), sys::ggml_silu(ctx, zg));
        (sys::ggml_reshape_2d(ctx, gated, hd * nv, n_rows * seqs), conv_written, ssm_written)
    };
    let mut out: T = std::ptr::null_mut();
    let mut append = |flat: T| out = if out.is_null() { flat } else { sys::ggml_concat(ctx, out, flat, 1) };
    for g in groups {
        let seqs = g.n_seqs as i64;
        let slot0 = g.cell0 / slot_cells;
        let rows_of = |t: T, len: i64| sys::ggml_view_2d(ctx, t, len, seqs, (*t).nb[1], slot0 * (*t).nb[1]);
        let (conv, ssm) = (rows_of(st.conv, conv_len), rows_of(st.ssm, ssm_len));
        if g.split == 0 || g.split >= g.n_rows || !st.has_snapshots() {
            append(piece(g.row0, g.n_rows, seqs, conv, ssm, conv, ssm).0);
            continue;
        }
        // A sequence with draft tokens (one per group): its rows up to the drafts, whose
        // state goes to the snapshot rows, then the drafts from there (the delta net runs
        // token by token, so two ops compute what one would).
        let (snap_conv, snap_ssm) = (rows_of(st.snap_conv, conv_len), rows_of(st.snap_ssm, ssm_len));
        let (flat, conv_mid, ssm_mid) = piece(g.row0, g.split, seqs, conv, ssm, snap_conv, snap_ssm);
        append(flat);
        append(piece(g.row0 + g.split, g.n_rows - g.split, seqs, conv_mid, ssm_mid, conv, ssm).0);
    }
    out
}

/// llama.cpp's `build_ffn` with parallel gate: up, gate, GELU or SiLU gating, down.
///
/// SAFETY: as `build`.
unsafe fn dense_ffn(ctx: *mut sys::ggml_context, f: &DenseFfn, x: T, gelu: bool, f32_acc: bool) -> T {
    let add_opt = |t: T, b: Option<T>| match b {
        Some(b) => sys::ggml_add(ctx, t, b),
        None => t,
    };
    let up = add_opt(mul_mat_acc(ctx, f.up, x, false), f.up_b);
    let gate = add_opt(mul_mat_acc(ctx, f.gate, x, false), f.gate_b);
    let act = if gelu { sys::ggml_geglu_split(ctx, gate, up) } else { sys::ggml_swiglu_split(ctx, gate, up) };
    add_opt(mul_mat_acc(ctx, f.down, act, f32_acc), f.down_b)
}

/// `ggml_mul_mat` of a weight matrix `w` and the batch's rows `x`, accumulating in f32 on
/// backends that would use f16 when `f32_acc` (see `Arch::f32_accumulators`).
///
/// An odd count of rows (3 or more) is padded with a zero row where the CPU would pay for
/// it (`pads_odd_rows`): ggml's llamafile sgemm (tinyBLAS) on AVX2 takes rows in tiles of
/// 2 and the one left over in a tile of 1, which costs more than a tile of 2 (measured,
/// the default model's 576 x 49,152 Q8_0 output layer, one thread: 3 rows 6.9x one row's
/// time, 4 rows 3.8x; 5 rows 6.4x, 6 rows 4.6x). Each result is accumulated in the same
/// order whatever its tile, so the rows kept are bit-identical to the unpadded product
/// (and to llama.cpp's); the zero row's results are never read.
///
/// SAFETY: as `build`.
unsafe fn mul_mat_acc(ctx: *mut sys::ggml_context, w: T, x: T, f32_acc: bool) -> T {
    let n = (*x).ne[1];
    let pad = n >= 3 && n % 2 == 1 && (*x).ne[2] == 1 && (*x).ne[3] == 1 && pads_odd_rows(w);
    let x = if pad { sys::ggml_pad(ctx, x, 0, 1, 0, 0) } else { x };
    let mm = sys::ggml_mul_mat(ctx, w, x);
    if f32_acc {
        sys::ggml_prec_set_acc(mm, sys::GGML_PREC_F32);
    }
    if pad {
        return sys::ggml_view_2d(ctx, mm, (*mm).ne[0], n, (*mm).nb[1], 0);
    }
    mm
}

/// Whether `w`'s product with an odd count of rows runs through tinyBLAS's tiles of 2 on
/// this CPU: an x86 build (AVX2; the AVX-512 build has tiles of 3 as well, where a pad
/// costs a little), a format ggml's CPU backend neither repacks on x86 nor hands to its
/// generic per-row kernels (Q8_0 and Q5_0: tinyBLAS's `Q0` kernels), in host memory.
///
/// SAFETY: `w` is a live, allocated tensor.
unsafe fn pads_odd_rows(w: T) -> bool {
    cfg!(target_arch = "x86_64") && matches!((*w).type_, sys::GGML_TYPE_Q8_0 | sys::GGML_TYPE_Q5_0) && !(*w).buffer.is_null() && sys::ggml_backend_buffer_is_host((*w).buffer)
}
