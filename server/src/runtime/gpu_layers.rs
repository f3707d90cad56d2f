//! How many layers of each window run on this machine's accelerator (`--gpu-layers`).

use std::str::FromStr;

use engine::{AcceleratorInfo, ModelFile};

/// `--gpu-layers N|auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    /// The scheduler's choice: in a ring, the plan's GPU layers for this device (Halda's
    /// `n_m`); on a single node, as many as fit in the accelerator's free memory.
    #[default]
    Auto,
    /// The first N layers of each window (at most the window).
    Count(usize),
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

/// A single node's `auto`: as many of the model's layers (weights and their KV cache for
/// `n_seq` sequences of `n_ctx_seq` cells) as fit in the first accelerator's free memory,
/// after a reserve. 0 without one.
pub fn fitting_layers(file: &ModelFile, accel: Option<&AcceleratorInfo>, n_seq: usize, n_ctx_seq: usize) -> usize {
    let Some(a) = accel else { return 0 };
    let n_layer = file.spec.n_layer;
    let weights: u64 = file.layer_byte_ranges(0..n_layer).iter().map(|r| r.len() as u64).sum();
    let kv = 2 * file.spec.n_embd_kv() as u64 * 2 * (n_seq * n_ctx_seq) as u64;
    let per_layer = (weights / n_layer.max(1) as u64 + kv).max(1);
    (a.memory_free.saturating_sub(ACCEL_RESERVE_BYTES) / per_layer).min(n_layer as u64) as usize
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
        assert!(GpuLayers::Count(0).check().is_ok() && GpuLayers::Auto.check().is_ok());
        // The default build has no accelerator: a count is a clear error, not a CPU run.
        if engine::accelerators().is_empty() {
            let e = GpuLayers::Count(3).check().unwrap_err();
            assert!(e.contains("no accelerator"), "{e}");
        }
    }
}
