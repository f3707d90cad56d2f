//! Halda's online part: when a running ring should change its plan. The head gathers
//! fresh profiles while its queue is idle; [`drift`] says whether they moved enough to be
//! worth solving again, and [`decide`] whether a new schedule predicts a gain large enough
//! to pay for re-forming the ring (the caches start empty after a change). An operator's
//! request is not a drift check: the plan asked for is applied whenever it differs.
//!
//! Pure, like the rest of the crate: profiles and plans in, a verdict out.

use serde::{Deserialize, Serialize};

use crate::cost::predict_ring;
use crate::halda::Schedule;
use crate::plan::Plan;
use crate::profile::{DeviceProfile, ModelProfile};

/// Thresholds of the online re-planning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReplanPolicy {
    /// A device's available memory (RAM, swap, GPU memory) moved by more than this share
    /// of its installed RAM: the memory terms of the model changed. 5% of a 16 GiB laptop
    /// is 0.8 GiB, about two layers of a 70B model.
    pub memory_share: f64,
    /// A hop's latency moved by more than this factor (up or down)...
    pub latency_factor: f64,
    /// ...and by more than this many seconds: jitter of a fast link is not drift.
    pub latency_floor_s: f64,
    /// A measured rate (FLOP/s, bytes/s) moved by more than this share.
    pub rate_share: f64,
    /// The new plan must predict at least this share less TPOT than the current plan on
    /// the same fresh profiles: re-forming the ring empties every cache.
    pub min_gain: f64,
}

impl Default for ReplanPolicy {
    fn default() -> Self {
        ReplanPolicy { memory_share: 0.05, latency_factor: 1.5, latency_floor_s: 0.5e-3, rate_share: 0.25, min_gain: 0.05 }
    }
}

/// What moved between two gatherings of the same devices, one line per change; empty
/// when nothing moved beyond the policy. Devices are matched by name; one that appeared
/// or vanished is a change.
pub fn drift(before: &[DeviceProfile], now: &[DeviceProfile], policy: &ReplanPolicy) -> Vec<String> {
    let mut out = Vec::new();
    for d in now {
        let Some(b) = before.iter().find(|b| b.name == d.name) else {
            out.push(format!("{}: new device", d.name));
            continue;
        };
        let installed = d.ram_total.max(b.ram_total).max(1.0);
        let mut memory = |what: &str, old: f64, new: f64| {
            if (new - old).abs() > policy.memory_share * installed {
                out.push(format!("{}: {what} {:.2} -> {:.2} GB", d.name, old / 1e9, new / 1e9));
            }
        };
        memory("available RAM", b.ram_available, d.ram_available);
        memory("free swap", b.swap_available, d.swap_available);
        let (old_gpu, new_gpu) = (b.gpu.as_ref().map_or(0.0, |g| g.memory_available), d.gpu.as_ref().map_or(0.0, |g| g.memory_available));
        memory("available GPU memory", old_gpu, new_gpu);
        let (old, new) = (b.comm_s, d.comm_s);
        if (new - old).abs() > policy.latency_floor_s && (new > old * policy.latency_factor || old > new * policy.latency_factor) {
            out.push(format!("{}: hop latency {:.2} -> {:.2} ms", d.name, old * 1e3, new * 1e3));
        }
        let rates = [("memory bandwidth", b.cpu_read_bw, d.cpu_read_bw), ("disk read", b.disk_read(), d.disk_read()), ("CPU Q4_K", b.cpu_flops.q4k, d.cpu_flops.q4k)];
        for (what, old, new) in rates {
            if old > 0.0 && ((new - old) / old).abs() > policy.rate_share {
                out.push(format!("{}: {what} {:.3e} -> {:.3e}/s", d.name, old, new));
            }
        }
    }
    for b in before.iter().filter(|b| !now.iter().any(|d| d.name == b.name)) {
        out.push(format!("{}: gone", b.name));
    }
    out
}

/// The ring as it runs: which input devices are members (ring order) and their plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Current<'a> {
    pub members: &'a [usize],
    pub plan: &'a Plan,
}

/// Why a candidate schedule is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The head looked by itself (profiles drifted, a worker joined): a new plan must
    /// predict a real gain, or the ring would be re-formed for the model's noise.
    Drift,
    /// An operator asked for a plan (`POST /admin/replan`): it is applied whenever it
    /// differs from the running one. A request is not a drift check — an answer that
    /// depends on a few percent of predicted TPOT would depend on the host's speed.
    Asked,
}

/// The verdict on a candidate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub apply: bool,
    /// The running plan's TPOT predicted on the fresh profiles.
    pub current_tpot_s: f64,
    pub candidate_tpot_s: f64,
    /// Why, in words (for logs and `/admin/plan`).
    pub reason: String,
}

/// Whether to replace the running plan with `candidate` (solved on `devices`, the fresh
/// profiles of every input device, the head first). Both plans are judged by the same
/// model on the same profiles, so only the plan differs.
pub fn decide(devices: &[DeviceProfile], model: &ModelProfile, current: Current<'_>, candidate: &Schedule, policy: &ReplanPolicy, disk_threshold: f64, trigger: Trigger) -> Decision {
    let members: Vec<DeviceProfile> = current.members.iter().map(|&m| devices[m].clone()).collect();
    let current_tpot_s = predict_ring(&members, model, current.plan, disk_threshold).tpot_s;
    let candidate_tpot_s = candidate.prediction.tpot_s;
    let same = candidate.members == current.members && candidate.plan.same_layers(current.plan);
    let gain = if current_tpot_s > 0.0 { 1.0 - candidate_tpot_s / current_tpot_s } else { 0.0 };
    let (apply, reason) = if same {
        (false, "the scheduler chose the running plan again".to_string())
    } else if trigger == Trigger::Asked {
        (true, format!("asked for: predicted TPOT {:.1} -> {:.1} ms", current_tpot_s * 1e3, candidate_tpot_s * 1e3))
    } else if let Some(why) = overflow(&members, model, current.plan) {
        // The model does not charge a GPU overflow (it assumes plans respect VRAM), so the
        // running plan's prediction is too kind: it must go whatever the figures say.
        (true, format!("the running plan no longer fits: {why}"))
    } else if gain >= policy.min_gain {
        (true, format!("predicted TPOT {:.1} -> {:.1} ms ({:.0}% less)", current_tpot_s * 1e3, candidate_tpot_s * 1e3, gain * 100.0))
    } else {
        (false, format!("a different plan predicts {:.1} ms against {:.1} ms now: below the {:.0}% gain worth re-forming the ring", candidate_tpot_s * 1e3, current_tpot_s * 1e3, policy.min_gain * 100.0))
    };
    Decision { apply, current_tpot_s, candidate_tpot_s, reason }
}

/// The first member whose GPU layers exceed what its GPU memory holds now, in words.
fn overflow(members: &[DeviceProfile], model: &ModelProfile, plan: &Plan) -> Option<String> {
    let k = plan.rounds();
    members.iter().zip(&plan.devices).enumerate().find_map(|(m, (dev, p))| {
        let cap = crate::cost::gpu_cap(dev, model, m == 0, k);
        let fits = crate::cost::gpu_fits(dev, model, m == 0, k, p.gpu_layers, p.experts_in_ram);
        (!fits).then(|| match p.experts_in_ram {
            0 => format!("{}'s GPU holds {cap} layers per window now, the plan puts {} there", dev.name, p.gpu_layers),
            e => format!("{}'s GPU holds {cap} whole layers per window now, the plan puts {} there ({e} with their experts in RAM)", dev.name, p.gpu_layers),
        })
    })
}
