//! The context a head serves per sequence when `--ctx-size` does not name one: the largest
//! whose KV cache fits the memory of the devices that serve the model, up to the model's
//! own (scheduler::largest_context counts it as Halda counts memory), said at start.

use engine::ModelFile;

/// `--ctx-size 0` (its default): size the context to the memory.
pub const AUTO_CONTEXT: usize = 0;

/// The context for `n_seq` sequences on devices that can give `memories` bytes each
/// (RAM available, a discrete GPU's free memory), with `reserved` bytes kept for other
/// uses (the prompt cache's RAM, a draft model).
pub fn sized(file: &ModelFile, memories: &[f64], n_seq: usize, kv: engine::CacheTypes, reserved: f64) -> usize {
    let model = super::profiling::model::from_gguf(file, "", 0, kv);
    let own = file.spec.n_ctx_train.max(16);
    let fit = scheduler::largest_context(memories, &model, n_seq, own, reserved);
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let cache = model.kv_bytes_per_token_layer() * model.n_layer as f64 * (fit.cells * n_seq.max(1)) as f64;
    match fit.bound {
        scheduler::ContextBound::Floor => tracing::warn!(
            ctx = fit.cells,
            model_ctx = own,
            memory_gib = %format!("{:.1}", gib(memories.iter().sum())),
            "context per sequence: {} tokens ({}); the memory does not hold the model's weights and this cache together, so the OS will page (--ctx-size sets it)",
            fit.cells,
            fit.bound
        ),
        _ => tracing::info!(
            ctx = fit.cells,
            model_ctx = own,
            sequences = n_seq,
            kv_cache_gib = %format!("{:.2}", gib(cache)),
            "context per sequence: {} tokens ({}; --ctx-size sets another)",
            fit.cells,
            fit.bound
        ),
    }
    fit.cells
}

/// What this machine can give a model's weights and cache: the RAM the OS (or its cgroup)
/// says is available, and a discrete accelerator's free memory (an integrated one's is the RAM).
pub fn local_memory() -> f64 {
    let ram = engine::residency::memory_budget().map_or(0.0, |b| b.bytes as f64);
    let accel = engine::accelerators().first().filter(|a| !a.integrated).map_or(0.0, |a| a.memory_free as f64);
    ram + accel
}
