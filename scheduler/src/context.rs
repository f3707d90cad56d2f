//! The context the memory allows: how many cells per sequence a KV cache can have on the
//! devices that serve a model, counted the way Halda counts a device's memory (weights,
//! compute buffers, KV cache, recurrent state). `hearth serve` starts with this context
//! unless `--ctx-size` names one, as llama-server sizes its context to fit.

use crate::profile::ModelProfile;

/// Memory each device keeps free for its OS and the user's other programs (llama.cpp's
/// `--fit-target` keeps the same 1 GiB per device).
pub const SPARE_BYTES_PER_DEVICE: f64 = 1024.0 * 1024.0 * 1024.0;

/// The smallest context chosen for the user: below it the first message of the common
/// clients fails (Claude Code sends ~12k tokens, Codex and Open WebUI ~6k), so a
/// machine that cannot hold more gets this much and the OS pages (llama.cpp's
/// `--fit-ctx` floor is the same).
pub const MIN_CONTEXT: usize = 4096;

/// Contexts are whole multiples of the KV cache's padding (llama.cpp pads the attended
/// cells to 256): cells past the last multiple would be allocated and never attended.
pub const CONTEXT_STEP: usize = 256;

/// The context chosen and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextFit {
    /// Cells per sequence.
    pub cells: usize,
    /// What bounds it.
    pub bound: ContextBound,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextBound {
    /// The model's own (trained) context: the memory holds all of it.
    Model,
    /// The memory: a larger context would not fit beside the weights.
    Memory,
    /// Not even [`MIN_CONTEXT`] fits beside the weights (a model larger than the memory,
    /// paged from its file): it is taken anyway, and every cell more would page out
    /// weights that each token reads.
    Floor,
}

impl std::fmt::Display for ContextBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ContextBound::Model => "the model's own context",
            ContextBound::Memory => "the largest the memory holds",
            ContextBound::Floor => "the floor: the memory does not hold the weights and more",
        })
    }
}

/// The largest context per sequence, a multiple of [`CONTEXT_STEP`] and at most
/// `model_context` (the model's trained context), whose KV cache for `sequences`
/// sequences fits in `memories` (bytes each device can give: RAM available, plus a
/// discrete GPU's free memory) beside the model's weights, each device's compute buffer,
/// the recurrent state, `reserved` bytes kept for other uses (the prompt cache's RAM, a
/// draft model) and [`SPARE_BYTES_PER_DEVICE`] each. A model whose weights leave no room
/// for [`MIN_CONTEXT`] gets that floor: its weights are paged from the file anyway, and a
/// larger cache would page out more of them.
pub fn largest_context(memories: &[f64], model: &ModelProfile, sequences: usize, model_context: usize, reserved: f64) -> ContextFit {
    let sequences = sequences.max(1) as f64;
    let model_context = model_context.max(1);
    let total: f64 = memories.iter().sum();
    let devices = memories.len().max(1) as f64;
    let weights = model.total_bytes();
    let layers = model.n_layer.max(1) as f64;
    let state = model.state_bytes * layers * sequences;
    let free = total - devices * (SPARE_BYTES_PER_DEVICE + model.compute_buffer_cpu) - weights - state - reserved;
    let per_cell = model.kv_bytes_per_token_layer() * layers * sequences;
    if per_cell <= 0.0 {
        // Nothing grows with the context (a recurrent model): the model's own.
        return ContextFit { cells: model_context, bound: ContextBound::Model };
    }
    let cells = if free > 0.0 { (free / per_cell).floor() as usize } else { 0 };
    if cells >= model_context {
        return ContextFit { cells: model_context, bound: ContextBound::Model };
    }
    let cells = cells / CONTEXT_STEP * CONTEXT_STEP;
    if cells < MIN_CONTEXT {
        return ContextFit { cells: MIN_CONTEXT.min(model_context), bound: ContextBound::Floor };
    }
    ContextFit { cells, bound: ContextBound::Memory }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

    /// A 70B-like model: 80 layers of 0.5 GiB (40 GiB of weights), 8 KV heads of 128, F16.
    fn model() -> ModelProfile {
        ModelProfile {
            name: "70b".into(),
            n_layer: 80,
            layer_bytes: 0.5 * GIB,
            input_bytes: 0.0,
            output_bytes: 0.0,
            n_vocab: 128_256,
            n_embd: 8192,
            n_head_k: 8,
            n_head_v: 8,
            head_dim_k: 128,
            head_dim_v: 128,
            n_kv: 4096,
            n_head: 64,
            kv_element_bytes_k: 2.0,
            kv_element_bytes_v: 2.0,
            layer_flops: Default::default(),
            output_flops: Default::default(),
            compute_buffer_cpu: 0.0,
            compute_buffer_gpu: 0.0,
            moe: None,
            state_bytes: 0.0,
        }
    }

    #[test]
    fn the_memory_left_beside_the_weights_sizes_the_context() {
        let m = model();
        // 320 KiB per cell per sequence over the 80 layers.
        let per_cell = 2.0 * 2.0 * 8.0 * 128.0 * 80.0;
        assert_eq!(per_cell, 327_680.0);
        // Three devices with 16 GiB each: 48 − 3 spare − 40 of weights = 5 GiB for 4
        // sequences: 4,096 cells each (5 GiB / 1.25 MiB).
        let fit = largest_context(&[16.0 * GIB; 3], &m, 4, 131_072, 0.0);
        assert_eq!(fit, ContextFit { cells: 4096, bound: ContextBound::Memory });
        // One sequence gets four times that.
        assert_eq!(largest_context(&[16.0 * GIB; 3], &m, 1, 131_072, 0.0).cells, 16_384);
        // The prompt cache's RAM comes out of it.
        assert_eq!(largest_context(&[16.0 * GIB; 3], &m, 1, 131_072, 2.5 * GIB).cells, 8192);
        // A multiple of 256 even when the memory is not.
        let odd = largest_context(&[16.0 * GIB, 16.0 * GIB, 16.0 * GIB + 1e6], &m, 1, 131_072, 0.0);
        assert_eq!(odd.cells % CONTEXT_STEP, 0);
        assert_eq!(odd.cells, 16_384);
        // Never past the model's own.
        assert_eq!(largest_context(&[64.0 * GIB; 4], &m, 4, 32_768, 0.0), ContextFit { cells: 32_768, bound: ContextBound::Model });
    }

    #[test]
    fn a_model_larger_than_the_memory_gets_the_floor() {
        let m = model();
        // 24 GiB for 40 GiB of weights: paged from the file; the cache takes the floor.
        let fit = largest_context(&[24.0 * GIB], &m, 4, 131_072, 0.0);
        assert_eq!(fit, ContextFit { cells: MIN_CONTEXT, bound: ContextBound::Floor });
        // So does one that fits with less room than the floor's cache (5 GiB would hold it).
        let fit = largest_context(&[45.0 * GIB], &m, 4, 131_072, 0.0);
        assert_eq!(fit, ContextFit { cells: MIN_CONTEXT, bound: ContextBound::Floor });
        let fit = largest_context(&[46.0 * GIB], &m, 4, 131_072, 0.0);
        assert_eq!(fit, ContextFit { cells: 4096, bound: ContextBound::Memory });
        // ... but never past a small model's own.
        assert_eq!(largest_context(&[1.0 * GIB], &m, 4, 2048, 0.0).cells, 2048);
    }

    #[test]
    fn a_model_whose_state_does_not_grow_gets_its_own_context() {
        let m = ModelProfile { n_head_k: 0, n_head_v: 0, state_bytes: 1e6, ..model() };
        assert_eq!(largest_context(&[8.0 * GIB], &m, 4, 65_536, 0.0), ContextFit { cells: 65_536, bound: ContextBound::Model });
    }
}
