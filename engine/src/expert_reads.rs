//! Reading exactly the routed experts a step chose, for MoE windows paged from disk.
//!
//! A token of a MoE layer uses a few of its experts (4 of 64, say), so a device whose
//! window does not fit in memory should read only those. Left to the OS it reads far more:
//! each page fault in an expert's rows reads around the fault (`read_ahead_kb`, 8 MiB on
//! this VM's disk against 0.8 MB per expert matrix), so a token's expert reads cost about
//! 3x their bytes (docs/benchmarks.md, "MoE larger than memory"). Here the OS is told not
//! to read around faults in the expert tensors (`MADV_RANDOM`), and while the step runs,
//! as soon as a layer's router has chosen (ggml's scheduler stops after the argsort node
//! and calls back), the chosen experts' slices of that layer's gate, up and down matrices
//! are read ahead whole (`MADV_WILLNEED`): one request per expert slice, issued before the
//! expert matmuls touch them, and nothing else.
//!
//! Only for weights that live in the file's mapping (paged windows are never repacked).
//! Must not depend on anything above the engine.

use std::ffi::c_void;

use llama_cpp_sys_2 as sys;

/// Linux's base page: advice ranges are aligned to it.
const PAGE: usize = 4096;

/// Where one MoE layer's choice shows, and the stacked expert matrices it selects from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertChoice {
    /// The router's sorted expert ids `[n_expert, n_tokens]` (the argsort node; a token's
    /// chosen experts are the first `k` of its row).
    pub sorted: *mut sys::ggml_tensor,
    pub k: usize,
    /// Gate, up, down: `[.., .., n_expert]`, one expert per `nb[2]` bytes.
    /// Null past the last (stacked gate-and-up experts make two).
    pub matrices: [*mut sys::ggml_tensor; 3],
}

/// The choices of the graph being computed: the scheduler's callback reads them.
#[derive(Default)]
pub(crate) struct ExpertReads {
    pub choices: Vec<ExpertChoice>,
    /// Bytes advised since the stage started (`Stage::expert_bytes_read_ahead`).
    pub advised_bytes: u64,
    /// The router's sorted ids and the experts chosen, reused from layer to layer.
    ids: Vec<i32>,
    chosen: Vec<bool>,
}

/// `advice` on the pages covering `[ptr, ptr + len)`.
///
/// SAFETY: the range lies inside one mapping of this process.
unsafe fn advise(ptr: *const u8, len: usize, advice: i32) {
    if len == 0 {
        return;
    }
    let start = ptr as usize & !(PAGE - 1);
    let end = (ptr as usize + len).div_ceil(PAGE) * PAGE;
    libc::madvise(start as *mut c_void, end - start, advice);
}

/// Tells the OS not to read around faults in these expert matrices: a fault then reads its
/// page (the chosen experts come in whole by `on_node`'s advice).
///
/// SAFETY: the tensors' data lies in a mapping of this process.
pub(crate) unsafe fn no_read_around(matrices: impl IntoIterator<Item = *mut sys::ggml_tensor>) {
    for m in matrices {
        advise((*m).data as *const u8, sys::ggml_nbytes(m), libc::MADV_RANDOM);
    }
}

/// The scheduler's evaluation callback (`ggml_backend_sched_set_eval_callback`): asked
/// about every node, it wants only the routers' argsort nodes; once one is computed it
/// advises the chosen experts' slices and lets the step go on.
///
/// SAFETY: `user_data` is the stage's live `ExpertReads`, whose choices belong to the
/// graph being computed.
pub(crate) unsafe extern "C" fn on_node(t: *mut sys::ggml_tensor, ask: bool, user_data: *mut c_void) -> bool {
    let reads = &mut *(user_data as *mut ExpertReads);
    let Some(choice) = reads.choices.iter().find(|c| c.sorted == t).copied() else {
        // Not one of ours: not wanted (asked), or go on (told).
        return !ask;
    };
    if ask {
        return true;
    }
    let n_expert = (*t).ne[0] as usize;
    let n_tok = (*t).ne[1] as usize;
    let ExpertReads { ids, chosen, advised_bytes, .. } = reads;
    ids.resize(n_expert * n_tok, 0);
    sys::ggml_backend_tensor_get(t, ids.as_mut_ptr().cast(), 0, ids.len() * 4);
    chosen.clear();
    chosen.resize(n_expert, false);
    for row in ids.chunks_exact(n_expert) {
        for &e in &row[..choice.k.min(n_expert)] {
            if let Some(c) = chosen.get_mut(e as usize) {
                *c = true;
            }
        }
    }
    for m in choice.matrices.into_iter().filter(|m| !m.is_null()) {
        let per_expert = (*m).nb[2];
        let base = (*m).data as *const u8;
        // Runs of neighbouring experts in one request each.
        let mut e = 0;
        while e < n_expert {
            if !chosen[e] {
                e += 1;
                continue;
            }
            let first = e;
            while e < n_expert && chosen[e] {
                e += 1;
            }
            let len = (e - first) * per_expert;
            advise(base.add(first * per_expert), len, libc::MADV_WILLNEED);
            *advised_bytes += len as u64;
        }
    }
    true
}
