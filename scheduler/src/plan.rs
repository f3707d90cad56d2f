//! A plan: the ring order of devices and, per device, its window size `w` and GPU layers
//! `n` (prima.cpp's w_m and n_m). With W = Σ w_m, one token step goes round the ring
//! k = L / W times; in round r, device m runs the w_m layers after those of the devices
//! before it in that round. Kept a plain value: the head builds it from `--windows` today
//! and Halda produces it later.

use std::ops::Range;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("a plan needs at least one device")]
    NoDevices,
    #[error("the windows add up to {window_sum} layers per round, which does not divide the model's {n_layer} layers into whole rounds")]
    NotWholeRounds { window_sum: usize, n_layer: usize },
    #[error("device {device} has {gpu} GPU layers but a window of only {window}")]
    GpuLayers { device: usize, gpu: usize, window: usize },
    #[error("device {device} keeps the experts of {experts} GPU layers in RAM but has only {gpu} GPU layers")]
    ExpertsInRam { device: usize, experts: usize, gpu: usize },
    #[error("{devices} devices cannot split {n_layer} layers")]
    TooManyDevices { devices: usize, n_layer: usize },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicePlan {
    /// Layers per window (w_m); 0 for a device that only relays.
    pub window: usize,
    /// Of each window, the first this many layers run on the device's GPU (n_m).
    pub gpu_layers: usize,
    /// Of those GPU layers, the first this many keep their routed experts in the host's
    /// RAM (MoE models; llama.cpp's `--n-cpu-moe` per window): attention, norms, router
    /// and shared experts on the GPU, each token's chosen experts on the CPU.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub experts_in_ram: usize,
    /// Threads the device computes with; 0: its own. Chosen with the micro-batches in
    /// flight for members that share a machine (`Pipelining::threads`), so they never keep
    /// more threads busy than it has cores.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub threads: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

impl DevicePlan {
    /// A window of `window` layers, `gpu_layers` of them on the GPU with their experts.
    pub fn new(window: usize, gpu_layers: usize) -> DevicePlan {
        DevicePlan { window, gpu_layers, experts_in_ram: 0, threads: 0 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub n_layer: usize,
    /// In ring order; device 0 is the head.
    pub devices: Vec<DevicePlan>,
}

impl Plan {
    /// Window sizes per device, in ring order, e.g. `[4, 3, 3]`.
    pub fn from_windows(n_layer: usize, windows: &[usize]) -> Result<Plan, PlanError> {
        let devices = windows.iter().map(|&w| DevicePlan::new(w, 0)).collect();
        let plan = Plan { n_layer, devices };
        plan.check()?;
        Ok(plan)
    }

    /// One round (k = 1), layers split as evenly as possible, earlier devices taking the
    /// remainder.
    pub fn even(n_layer: usize, n_devices: usize) -> Result<Plan, PlanError> {
        if n_devices == 0 {
            return Err(PlanError::NoDevices);
        }
        if n_devices > n_layer {
            return Err(PlanError::TooManyDevices { devices: n_devices, n_layer });
        }
        let windows: Vec<usize> = (0..n_devices).map(|i| n_layer / n_devices + usize::from(i < n_layer % n_devices)).collect();
        Plan::from_windows(n_layer, &windows)
    }

    /// Whether `other` puts the same layers in the same places (threads aside: they
    /// follow the micro-batches in flight, which are chosen after the plan).
    pub fn same_layers(&self, other: &Plan) -> bool {
        let placed = |p: &Plan| p.devices.iter().map(|d| (d.window, d.gpu_layers, d.experts_in_ram)).collect::<Vec<_>>();
        self.n_layer == other.n_layer && placed(self) == placed(other)
    }

    pub fn check(&self) -> Result<(), PlanError> {
        if self.devices.is_empty() {
            return Err(PlanError::NoDevices);
        }
        let window_sum = self.window_sum();
        if window_sum == 0 || !self.n_layer.is_multiple_of(window_sum) {
            return Err(PlanError::NotWholeRounds { window_sum, n_layer: self.n_layer });
        }
        for (i, d) in self.devices.iter().enumerate() {
            if d.gpu_layers > d.window {
                return Err(PlanError::GpuLayers { device: i, gpu: d.gpu_layers, window: d.window });
            }
            if d.experts_in_ram > d.gpu_layers {
                return Err(PlanError::ExpertsInRam { device: i, experts: d.experts_in_ram, gpu: d.gpu_layers });
            }
        }
        Ok(())
    }

    /// W: layers per round.
    pub fn window_sum(&self) -> usize {
        self.devices.iter().map(|d| d.window).sum()
    }

    /// k: rounds per token step.
    pub fn rounds(&self) -> usize {
        self.n_layer / self.window_sum().max(1)
    }

    /// Device `m`'s windows, one per round, in the order the ring visits them.
    pub fn windows_of(&self, m: usize) -> Vec<Range<usize>> {
        let w = self.window_sum();
        let before: usize = self.devices[..m].iter().map(|d| d.window).sum();
        let size = self.devices[m].window;
        if size == 0 {
            return Vec::new();
        }
        (0..self.rounds()).map(|r| r * w + before..r * w + before + size).collect()
    }

    /// The (device, window index) pairs in execution order: the route of one token step.
    pub fn route(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for r in 0..self.rounds() {
            for (m, d) in self.devices.iter().enumerate() {
                if d.window > 0 {
                    out.push((m, r));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_repeat_every_round_in_ring_order() {
        let p = Plan::from_windows(30, &[2, 2, 1]).unwrap();
        assert_eq!(p.rounds(), 6);
        assert_eq!(p.windows_of(0)[..2], [0..2, 5..7]);
        assert_eq!(p.windows_of(2)[..2], [4..5, 9..10]);
        // Every layer exactly once, in order along the route.
        let mut layers = Vec::new();
        for (m, r) in p.route() {
            layers.extend(p.windows_of(m)[r].clone());
        }
        assert_eq!(layers, (0..30).collect::<Vec<_>>());
    }

    #[test]
    fn even_splits_and_relays() {
        let p = Plan::even(30, 4).unwrap();
        assert_eq!(p.devices.iter().map(|d| d.window).collect::<Vec<_>>(), vec![8, 8, 7, 7]);
        assert_eq!(p.rounds(), 1);
        let relay = Plan::from_windows(30, &[0, 15, 15]).unwrap();
        assert!(relay.windows_of(0).is_empty());
        assert_eq!(relay.route(), vec![(1, 0), (2, 0)]);
    }

    #[test]
    fn bad_plans_say_why() {
        assert_eq!(Plan::from_windows(30, &[4, 3, 4]), Err(PlanError::NotWholeRounds { window_sum: 11, n_layer: 30 }));
        assert_eq!(Plan::from_windows(30, &[]), Err(PlanError::NoDevices));
        assert_eq!(Plan::even(3, 4), Err(PlanError::TooManyDevices { devices: 4, n_layer: 3 }));
        let mut p = Plan::even(30, 2).unwrap();
        p.devices[1].gpu_layers = 16;
        assert!(matches!(p.check(), Err(PlanError::GpuLayers { device: 1, .. })));
        p.devices[1].gpu_layers = 4;
        p.devices[1].experts_in_ram = 5;
        assert!(matches!(p.check(), Err(PlanError::ExpertsInRam { device: 1, experts: 5, gpu: 4 })));
        // Plans written before the field existed read back with none.
        let old: DevicePlan = serde_json::from_str(r#"{"window": 3, "gpu_layers": 1}"#).unwrap();
        assert_eq!(old, DevicePlan::new(3, 1));
        assert!(!serde_json::to_string(&old).unwrap().contains("experts_in_ram"));
    }
}
