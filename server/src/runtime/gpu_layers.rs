//! How many layers of each window run on this machine's accelerator (`--gpu-layers`), and
//! of those how many keep their routed experts in RAM (`--experts-in-ram`, MoE models).

use std::str::FromStr;

use engine::{AcceleratorInfo, ModelFile};

/// `--gpu-layers N|auto` and `--experts-in-ram N|auto`: layers per window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    /// The scheduler's choice: in a ring, the plan's figure for this device (Halda's
    /// `n_m` and experts in RAM); on a single node, what fits in the accelerator's free
    /// memory.
    #[default]
    Auto,
    /// The first N layers of each window (at most the window).
    Count(usize),
}

/// This machine's accelerator placement: GPU layers per window, and of those, layers
/// whose routed experts stay in RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuPlacement {
    pub layers: GpuLayers,
    pub experts_in_ram: GpuLayers,
}

impl GpuPlacement {
    /// (GPU layers, of them with experts in RAM) per window when the plan says
    /// `(planned_layers, planned_experts)`; the experts never exceed the layers.
    pub fn resolve(self, planned_layers: usize, planned_experts: usize) -> (usize, usize) {
        let n = self.layers.resolve(planned_layers);
        (n, self.experts_in_ram.resolve(planned_experts).min(n))
    }

    /// Refuses what this build or model cannot honour, before anything is loaded.
    pub fn check(self, moe: bool) -> Result<(), String> {
        self.layers.check()?;
        match self.experts_in_ram {
            GpuLayers::Count(n) if n > 0 && !moe => Err(format!("--experts-in-ram {n}: the model has no routed experts (it is not a Mixture-of-Experts model)")),
            _ => Ok(()),
        }
    }
}

impl FromStr for GpuLayers {
    type Err = String;

    fn from_str(s: &str) -> Result<GpuLayers, String> {
        match s {
            "auto" => Ok(GpuLayers::Auto),
            n => n.parse().map(GpuLayers::Count).map_err(|_| format!("expected a number of layers or `auto`, got {n:?}")),
        }
    }
}

impl GpuLayers {
    /// This machine's GPU layers per window when the plan says `planned`.
    pub fn resolve(self, planned: usize) -> usize {
        match self {
            GpuLayers::Auto => planned,
            GpuLayers::Count(n) => n,
        }
    }

    /// Refuses a count this build cannot honour, before anything is loaded: without an
    /// accelerator, only 0 and auto.
    pub fn check(self) -> Result<(), String> {
        match self {
            GpuLayers::Count(n) if n > 0 && engine::accelerators().is_empty() => Err(format!(
                "--gpu-layers {n}: this hearth has no accelerator to put layers on (a CPU-only build, or no GPU the build's backend can see; build with --features cuda, metal or vulkan, and for a CPU-type Vulkan device such as lavapipe set GGML_VK_VISIBLE_DEVICES)"
            )),
            _ => Ok(()),
        }
    }
}

/// Bytes kept free on an accelerator beyond the layers: the compute buffers of a step and
/// the driver's own allocations.
const ACCEL_RESERVE_BYTES: u64 = 512 << 20;

/// A single node's `auto`: (GPU layers, of them with experts in RAM) that fit in the
/// first accelerator's free memory after a reserve, each layer with its KV cache for
/// `n_seq` sequences of `n_ctx_seq` cells. Whole layers first; for a MoE model whose
/// layers do not all fit, every layer whose dense part fits goes on the GPU and the
/// fewest of them keep their experts in RAM (what llama.cpp's `--fit` searches for).
/// Every layer whole with room to spare for the output layer: `n_layer + 1` (it goes there
/// too).
/// `experts`: the user's count of layers with experts in RAM, when given. (0, 0) without
/// an accelerator.
pub fn fitting_layers(file: &ModelFile, accel: Option<&AcceleratorInfo>, n_seq: usize, n_ctx_seq: usize, kv: engine::CacheTypes, experts: GpuLayers) -> (usize, usize) {
    let Some(a) = accel else { return (0, 0) };
    let n_layer = file.spec.n_layer.max(1);
    let ranges = |il: usize| file.layer_byte_ranges(il..il + 1);
    let weights: u64 = (0..n_layer).flat_map(ranges).map(|r| r.len() as u64).sum();
    let expert_bytes: u64 = file.gguf.meta().tensors().iter().filter(|t| t.name.starts_with("blk.") && t.name.contains("_exps.")).map(|t| t.n_bytes).sum();
    let kv = kv.bytes_per_token(file.spec.max_n_embd_kv(), file.spec.max_n_embd_v_cache()) as u64 * (n_seq * n_ctx_seq) as u64;
    let whole = (weights / n_layer as u64 + kv).max(1);
    let dense = whole.saturating_sub(expert_bytes / n_layer as u64).max(1);
    // The output layer's bytes as the scheduler counts them (a tied head is the embedding).
    let output = super::profiling::model::from_gguf(file, "", n_ctx_seq, engine::CacheTypes::default()).output_bytes as u64;
    let room = a.memory_free.saturating_sub(ACCEL_RESERVE_BYTES);
    with_output(room, n_layer, whole, output, fit(room, n_layer, whole, dense, experts))
}

/// Every layer whole and room left for the output layer's `output` bytes: it goes there
/// too (one more than the layers), so a decode step never waits for the CPU's LM head.
fn with_output(room: u64, n_layer: usize, whole: u64, output: u64, (n, e): (usize, usize)) -> (usize, usize) {
    let fits = n == n_layer && e == 0 && room.saturating_sub(n_layer as u64 * whole) >= output;
    (if fits { n_layer + 1 } else { n }, e)
}

/// The placement rule of [`fitting_layers`] on plain numbers: `room` bytes, `whole` and
/// `dense` bytes per layer (equal for a dense model).
fn fit(room: u64, n_layer: usize, whole: u64, dense: u64, experts: GpuLayers) -> (usize, usize) {
    let whole_fit = (room / whole).min(n_layer as u64) as usize;
    let moe = dense < whole;
    match experts {
        _ if !moe => (whole_fit, 0),
        GpuLayers::Count(e) => {
            // e layers at `dense`, the rest at `whole`: the most layers that fit.
            let e_bytes = |n: usize| n.min(e) as u64 * dense + n.saturating_sub(e) as u64 * whole;
            let n = (0..=n_layer).rev().find(|&n| e_bytes(n) <= room).unwrap_or(0);
            (n, e.min(n))
        }
        GpuLayers::Auto if whole_fit == n_layer => (n_layer, 0),
        GpuLayers::Auto => {
            let n = (room / dense).min(n_layer as u64) as usize;
            // The fewest e with (n − e)·whole + e·dense ≤ room.
            let over = (n as u64 * whole).saturating_sub(room);
            let e = over.div_ceil(whole - dense) as usize;
            if n > whole_fit {
                (n, e.min(n))
            } else {
                (whole_fit, 0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts_and_auto_and_resolves_against_the_plan() {
        assert_eq!("auto".parse::<GpuLayers>(), Ok(GpuLayers::Auto));
        assert_eq!("12".parse::<GpuLayers>(), Ok(GpuLayers::Count(12)));
        assert!("-1".parse::<GpuLayers>().is_err() && "all".parse::<GpuLayers>().is_err());
        assert_eq!((GpuLayers::Auto.resolve(5), GpuLayers::Count(2).resolve(5)), (5, 2));
        let p = GpuPlacement { layers: GpuLayers::Count(3), experts_in_ram: GpuLayers::Auto };
        assert_eq!(p.resolve(5, 4), (3, 3), "experts never exceed the layers");
        assert_eq!(GpuPlacement::default().resolve(5, 2), (5, 2));
        let e = GpuPlacement { layers: GpuLayers::Auto, experts_in_ram: GpuLayers::Count(2) }.check(false).unwrap_err();
        assert!(e.contains("not a Mixture-of-Experts"), "{e}");
        assert!(GpuLayers::Count(0).check().is_ok() && GpuLayers::Auto.check().is_ok());
        // The default build has no accelerator: a count is a clear error, not a CPU run.
        if engine::accelerators().is_empty() {
            let e = GpuLayers::Count(3).check().unwrap_err();
            assert!(e.contains("no accelerator"), "{e}");
        }
    }

    #[test]
    fn fits_whole_layers_first_then_dense_parts_with_experts_in_ram() {
        // 48 MoE layers of 365 MB (20 MB dense + KV) on 8 GB: 21 whole layers, or all 48
        // with the experts of the fewest layers in RAM: 48·365 − 8000 = 9520 MB over, at
        // 345 MB a layer: 28 layers.
        let mb = 1_000_000u64;
        assert_eq!(fit(8000 * mb, 48, 365 * mb, 20 * mb, GpuLayers::Auto), (48, 28));
        let (n, e) = fit(8000 * mb, 48, 365 * mb, 20 * mb, GpuLayers::Auto);
        assert!((n - e) as u64 * 365 * mb + e as u64 * 20 * mb <= 8000 * mb);
        assert!((n - e + 1) as u64 * 365 * mb + (e - 1) as u64 * 20 * mb > 8000 * mb);
        // Room for the whole model: no experts in RAM.
        assert_eq!(fit(20_000 * mb, 48, 365 * mb, 20 * mb, GpuLayers::Auto), (48, 0));
        // Not even every dense part: as many layers as their dense parts allow.
        assert_eq!(fit(500 * mb, 48, 365 * mb, 20 * mb, GpuLayers::Auto), (25, 25));
        // The user's count of layers with experts in RAM: the most layers that fit with it.
        assert_eq!(fit(8000 * mb, 48, 365 * mb, 20 * mb, GpuLayers::Count(10)), (31, 10));
        // A dense model: whole layers only, whatever the count.
        assert_eq!(fit(8000 * mb, 48, 365 * mb, 365 * mb, GpuLayers::Auto), (21, 0));
        assert_eq!(fit(8000 * mb, 48, 365 * mb, 365 * mb, GpuLayers::Count(4)), (21, 0));
    }

    #[test]
    fn the_output_layer_joins_the_layers_only_when_all_of_them_fit_with_room_for_it() {
        let mb = 1_000_000u64;
        // 32 layers of 150 MB and a 300 MB LM head: 5,100 MB holds both, 4,900 the layers only.
        assert_eq!(with_output(5100 * mb, 32, 150 * mb, 300 * mb, fit(5100 * mb, 32, 150 * mb, 150 * mb, GpuLayers::Auto)), (33, 0));
        assert_eq!(with_output(4900 * mb, 32, 150 * mb, 300 * mb, fit(4900 * mb, 32, 150 * mb, 150 * mb, GpuLayers::Auto)), (32, 0));
        // Not every layer, or experts kept in RAM: the output layer stays on the CPU.
        assert_eq!(with_output(3000 * mb, 32, 150 * mb, 300 * mb, (20, 0)), (20, 0));
        assert_eq!(with_output(9000 * mb, 48, 365 * mb, 10 * mb, (48, 28)), (48, 28));
    }
}
