//! prima.cpp's latency model for the layer-to-device assignment (LDA), §3 of
//! `papers/prima-extraction.md`: TPOT = Σ_m (T_m^comp + T_m^mem + T_m^disk + T_m^comm)
//! (eq 11), with the OS-dependent disk cases M1 (macOS without Metal), M2 (macOS with
//! Metal), M3 (Linux, Android) and M4 (enough RAM, or a slow disk).
//!
//! Two faces of the same model live here: [`predict`] evaluates any whole-rounds plan
//! term by term (eqs 12–20), and the per-device coefficients α, β, ξ and the constant κ
//! (eqs 22–37) feed the integer program in `halda`. For a plan whose sets agree with its
//! loads the two give the same number; the tests check it.

use serde::{Deserialize, Serialize};

use crate::plan::Plan;
use crate::profile::{DeviceProfile, GpuBackend, ModelProfile, Os};

/// A device's case in the model (§3.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceSet {
    /// macOS without Metal, RAM overloaded, fast disk: reloads the excess (random reads).
    M1,
    /// macOS with Metal, shared memory overloaded, fast disk: reloads all its weights.
    M2,
    /// Linux or Android, RAM (+ swap-out on Android) overloaded, fast disk: reloads the
    /// excess of its CPU layers (sequential reads).
    M3,
    /// Enough memory, or a slow disk (which Halda does not let overload).
    M4,
}

/// Seconds per token, split the way the paper splits them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// T^comp: layer FLOPs on CPU and GPU (and the output layer on the head).
    pub compute_s: f64,
    /// T^mem: KV-cache writes, RAM↔VRAM copies, and reading weights + KV into registers.
    pub memory_s: f64,
    /// T^disk: reloading what does not fit in memory (and the head's embedding row).
    pub disk_s: f64,
    /// T^comm: one hop of the hidden state per window.
    pub network_s: f64,
}

impl Breakdown {
    pub fn total(&self) -> f64 {
        self.compute_s + self.memory_s + self.disk_s + self.network_s
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceCost {
    pub name: String,
    pub set: DeviceSet,
    /// Its memory is overloaded (weights are reloaded from disk every token). Never true
    /// for a plan Halda returns on a slow-disk (M4) device.
    pub overloaded: bool,
    /// Layers it runs per token on the CPU (`l_m − l_m^gpu`) and on the GPU (`l_m^gpu`).
    pub cpu_layers: usize,
    pub gpu_layers: usize,
    /// Of the GPU layers, those whose routed experts run from RAM on the CPU.
    #[serde(default)]
    pub experts_in_ram: usize,
    pub breakdown: Breakdown,
}

/// Predicted time per output token of a plan, with its per-device breakdown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub tpot_s: f64,
    pub devices: Vec<DeviceCost>,
}

impl Prediction {
    pub fn total(&self) -> Breakdown {
        let mut t = Breakdown::default();
        for d in &self.devices {
            t.compute_s += d.breakdown.compute_s;
            t.memory_s += d.breakdown.memory_s;
            t.disk_s += d.breakdown.disk_s;
            t.network_s += d.breakdown.network_s;
        }
        t
    }
}

/// `b_m^cio = (b_i/V + b_o)·𝕀_{m=1} + c^cpu`.
pub(crate) fn cio(model: &ModelProfile, head: bool) -> f64 {
    let io = if head { model.lookup_bytes() + model.output_bytes } else { 0.0 };
    io + model.compute_buffer_cpu
}

/// Bytes of the device's memory left for layers (weights + KV) before it overloads:
/// `d^avail − b^cio` (macOS without Metal, Linux), `d_metal^avail − b^cio − c^gpu`
/// (macOS with Metal), `d^avail + d^swapout − b^cio` (Android).
pub(crate) fn ram_room(dev: &DeviceProfile, model: &ModelProfile, head: bool) -> f64 {
    let base = match (dev.os, dev.metal()) {
        (Os::Macos, Some(g)) => g.memory_available - model.compute_buffer_gpu,
        (Os::Android, _) => dev.ram_available + dev.swap_out_cap(),
        _ => dev.ram_available,
    };
    base - cio(model, head)
}

/// Largest count of memory-resident layers per window that does not overload the device
/// at `k` rounds: ⌊(W/(L b′))·room⌋ = ⌊room / (k b′)⌋ (may be negative: overloaded even
/// with no layers). "Overloaded" is the paper's strict `>`: counted layers > this.
pub fn ram_cap(dev: &DeviceProfile, model: &ModelProfile, head: bool, k: usize) -> i64 {
    floor_layers(ram_room(dev, model, head), k, model)
}

fn floor_layers(bytes: f64, k: usize, model: &ModelProfile) -> i64 {
    floor_per(bytes, k as f64 * model.layer_bytes_with_kv())
}

/// ⌊bytes / per⌋ as a count of layers.
fn floor_per(bytes: f64, per: f64) -> i64 {
    let x = bytes / per;
    // A hair of slack so that an exact fit computed in floating point stays a fit.
    (x + 1e-9).floor().clamp(-1e9, 1e9) as i64
}

/// Most GPU layers per window at `k` rounds (VRAM, or Metal's shared memory, which on the
/// head also holds the output layer): constraint (5) with ⌊·⌋ for integers.
pub fn gpu_cap(dev: &DeviceProfile, model: &ModelProfile, head: bool, k: usize) -> usize {
    if dev.gpu.is_none() {
        return 0;
    }
    floor_layers(gpu_room(dev, model, head), k, model).max(0) as usize
}

/// The device's GPU is discrete (its own memory, reached by copies): a MoE layer there may
/// keep its routed experts in the host's RAM. Pointless where the GPU shares the host's
/// memory (Metal, integrated GPUs: the experts would stay in the same memory).
pub fn experts_in_ram_possible(dev: &DeviceProfile, model: &ModelProfile) -> bool {
    model.moe.is_some() && dev.gpu.as_ref().is_some_and(|g| matches!(g.backend, GpuBackend::Cuda | GpuBackend::Vulkan) && !g.uma)
}

/// GPU memory left for layers at `k` rounds, bytes (what [`gpu_cap`] divides).
pub(crate) fn gpu_room(dev: &DeviceProfile, model: &ModelProfile, head: bool) -> f64 {
    let Some(g) = &dev.gpu else { return 0.0 };
    match g.backend {
        GpuBackend::Cuda | GpuBackend::Vulkan => g.memory_available - model.compute_buffer_gpu,
        GpuBackend::Metal => g.memory_available - model.compute_buffer_gpu - if head { model.output_bytes } else { 0.0 },
    }
}

/// Bytes of a MoE layer's routed experts (0 for a dense model).
fn expert_bytes(model: &ModelProfile) -> f64 {
    model.moe.as_ref().map_or(0.0, |m| m.expert_bytes)
}

/// Most GPU layers per window at `k` rounds when every one keeps its experts in RAM: the
/// dense parts and KV only. [`gpu_cap`] where that is not possible.
pub fn gpu_dense_cap(dev: &DeviceProfile, model: &ModelProfile, head: bool, k: usize) -> usize {
    if !experts_in_ram_possible(dev, model) {
        return gpu_cap(dev, model, head, k);
    }
    let per_layer = (model.layer_bytes_with_kv() - expert_bytes(model)).max(1.0);
    floor_per(gpu_room(dev, model, head), k as f64 * per_layer).max(0) as usize
}

/// `n` GPU layers per window, `e` of them with their experts in RAM, fit in its GPU memory.
pub fn gpu_fits(dev: &DeviceProfile, model: &ModelProfile, head: bool, k: usize, n: usize, e: usize) -> bool {
    if n == 0 {
        return true;
    }
    let e = if experts_in_ram_possible(dev, model) { e.min(n) } else { 0 };
    let need = k as f64 * (n as f64 * model.layer_bytes_with_kv() - e as f64 * expert_bytes(model));
    need <= gpu_room(dev, model, head) * (1.0 + 1e-12) + 1e-6
}

/// The layers of a window that count against RAM: all of them on macOS (Metal maps
/// even its GPU layers from the shared memory) and with an integrated GPU (its memory is
/// the host's), only the CPU ones beside a discrete GPU on Linux/Android.
pub(crate) fn counted_layers(dev: &DeviceProfile, w: usize, n: usize) -> usize {
    match dev.os {
        Os::Macos => w,
        Os::Linux | Os::Android if dev.gpu.as_ref().is_some_and(|g| g.uma) => w,
        Os::Linux | Os::Android => w - n.min(w),
    }
}

/// Bytes per window a device's RAM holds beyond its counted layers: the routed experts of
/// `e` GPU layers kept in RAM beside a discrete GPU.
fn ram_experts(dev: &DeviceProfile, model: &ModelProfile, n: usize, e: usize) -> f64 {
    if experts_in_ram_possible(dev, model) {
        e.min(n) as f64 * expert_bytes(model)
    } else {
        0.0
    }
}

pub(crate) fn overloaded(dev: &DeviceProfile, model: &ModelProfile, head: bool, w: usize, n: usize, e: usize, k: usize) -> bool {
    let cap = ram_cap(dev, model, head, k);
    let counted = counted_layers(dev, w, n) as i64;
    if ram_experts(dev, model, n, e) == 0.0 {
        return counted > cap;
    }
    // Experts in RAM are a fraction of a layer: compare bytes (with the same hair of slack).
    let held = k as f64 * (counted as f64 * model.layer_bytes_with_kv() + ram_experts(dev, model, n, e));
    held > ram_room(dev, model, head) + 1e-9 * k as f64 * model.layer_bytes_with_kv()
}

/// A disk at or above the threshold is fast (may overload); below it is slow (M4 only).
/// What counts is how fast a layer comes back: a MoE layer pages in only the experts its
/// tokens use, so a disk reloads it `1 / paged_share` times faster than its bytes.
pub(crate) fn fast_disk(dev: &DeviceProfile, model: &ModelProfile, disk_threshold: f64) -> bool {
    dev.disk_read() / model.paged_share() >= disk_threshold
}

/// The set an overloaded (or not) device falls in.
pub(crate) fn set_for(dev: &DeviceProfile, is_overloaded: bool, fast: bool) -> DeviceSet {
    if !is_overloaded || !fast {
        return DeviceSet::M4;
    }
    match (dev.os, dev.metal()) {
        (Os::Macos, Some(_)) => DeviceSet::M2,
        (Os::Macos, None) => DeviceSet::M1,
        (Os::Linux | Os::Android, _) => DeviceSet::M3,
    }
}

/// Per-layer costs of a device, split into compute and memory, on CPU and GPU.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerCosts {
    pub cpu_compute: f64,
    pub cpu_memory: f64,
    pub gpu_compute: f64,
    pub gpu_memory: f64,
    /// Per window: RAM↔VRAM copies (0 on UMA or without a GPU).
    pub copy: f64,
    /// One token's routed experts of one layer, computed and read on the CPU ...
    pub experts_cpu: f64,
    /// ... and on the GPU (0 for a dense model or without a GPU).
    pub experts_gpu: f64,
}

impl LayerCosts {
    pub fn of(dev: &DeviceProfile, model: &ModelProfile) -> LayerCosts {
        // What one token reads: a MoE layer's unused experts stay untouched.
        let bp = model.layer_read_bytes();
        let cpu_compute = model.layer_flops.time_at(&dev.cpu_flops);
        let cpu_memory = dev.kv_copy_cpu_s + bp / dev.cpu_read_bw;
        let (ef, eb) = (model.expert_flops(), model.expert_read_bytes());
        let experts_cpu = if model.moe.is_some() { ef.time_at(&dev.cpu_flops) + eb / dev.cpu_read_bw } else { 0.0 };
        match &dev.gpu {
            Some(g) => LayerCosts {
                cpu_compute,
                cpu_memory,
                gpu_compute: model.layer_flops.time_at(&g.flops),
                gpu_memory: g.kv_copy_s + bp / g.read_bw,
                copy: if g.uma { 0.0 } else { g.ram_to_vram_s + g.vram_to_ram_s },
                experts_cpu,
                experts_gpu: if model.moe.is_some() { ef.time_at(&g.flops) + eb / g.read_bw } else { 0.0 },
            },
            None => LayerCosts { cpu_compute, cpu_memory, gpu_compute: 0.0, gpu_memory: 0.0, copy: 0.0, experts_cpu, experts_gpu: 0.0 },
        }
    }

    /// α_m: one CPU layer (compute + KV write + memory read).
    pub fn alpha(&self) -> f64 {
        self.cpu_compute + self.cpu_memory
    }

    /// β_m: the change from moving one layer CPU → GPU (normally negative).
    pub fn beta(&self) -> f64 {
        self.gpu_compute + self.gpu_memory - self.alpha()
    }

    /// γ_m: the change from keeping one GPU layer's routed experts in RAM: its chosen
    /// experts run on the CPU, and the hidden state goes down to the host and back up
    /// (one copy each way, as a window boundary costs). Normally positive: what buys it
    /// is GPU memory (the ILP's VRAM row), not time.
    pub fn gamma(&self) -> f64 {
        self.experts_cpu + self.copy - self.experts_gpu
    }
}

/// ξ_m: per-window fixed cost (device copy + one network hop).
pub(crate) fn xi(dev: &DeviceProfile, model: &ModelProfile) -> f64 {
    LayerCosts::of(dev, model).copy + dev.comm_s
}

/// The head's fixed terms that do not depend on the set: output-layer compute and the
/// reads of the embedding row and the output layer. (Split into compute and memory.)
fn head_fixed(dev: &DeviceProfile, model: &ModelProfile) -> (f64, f64) {
    let compute = model.output_flops.time_at(&dev.cpu_flops);
    let memory = (model.lookup_bytes() + model.output_bytes) / dev.cpu_read_bw;
    (compute, memory)
}

/// The output layer's part of `head_fixed` for one token: all of it but the embedding
/// row's read (that row is the token's own, whatever the batch wants of the output).
pub(crate) fn head_output_s(dev: &DeviceProfile, model: &ModelProfile) -> f64 {
    let (compute, memory) = head_fixed(dev, model);
    compute + memory - model.lookup_bytes() / dev.cpu_read_bw
}

/// The ILP's objective coefficients for one device in one set: `a_m` (per window layer),
/// `b_m` (per GPU layer), both per round; the caller multiplies by k (eq 6). The
/// coefficient of a GPU layer whose experts stay in RAM is [`LayerCosts::gamma`].
pub(crate) fn ilp_coefficients(dev: &DeviceProfile, model: &ModelProfile, set: DeviceSet) -> (f64, f64) {
    let lc = LayerCosts::of(dev, model);
    // A layer paged from disk: a MoE layer reads only the experts its tokens use.
    let s = dev.disk_read() / model.paged_share();
    let bp = model.layer_bytes_with_kv();
    let (alpha, beta) = (lc.alpha(), if dev.gpu.is_some() { lc.beta() } else { 0.0 });
    match set {
        DeviceSet::M1 => (alpha + bp / s, 0.0),
        DeviceSet::M2 => (alpha + model.released_layer_bytes() / dev.disk_read(), beta),
        DeviceSet::M3 => (alpha + bp / s, beta - bp / s),
        DeviceSet::M4 => (alpha, beta),
    }
}

/// The ILP's objective coefficient of a GPU layer whose experts stay in RAM, per round:
/// γ_m (`LayerCosts::gamma`), plus on an overloaded Linux/Android device (M3) the paging
/// of those expert bytes, which RAM then holds beyond its room. Other sets have none.
pub(crate) fn ilp_expert_coefficient(dev: &DeviceProfile, model: &ModelProfile, set: DeviceSet) -> f64 {
    let gamma = LayerCosts::of(dev, model).gamma();
    match set {
        DeviceSet::M4 => gamma,
        DeviceSet::M3 => gamma + expert_bytes(model) * model.paged_share() / dev.disk_read(),
        DeviceSet::M1 | DeviceSet::M2 => 0.0,
    }
}

/// κ plus Σ_m k ξ_m: everything in the objective that does not multiply a variable.
pub(crate) fn ilp_constant(devices: &[DeviceProfile], model: &ModelProfile, sets: &[DeviceSet], k: usize) -> f64 {
    let head = &devices[0];
    let (hc, hm) = head_fixed(head, model);
    let s1 = head.disk_read();
    let mut kappa = hc + hm + model.lookup_bytes() / s1;
    if sets[0] != DeviceSet::M4 {
        kappa += model.output_bytes / s1;
    }
    for (m, (dev, set)) in devices.iter().zip(sets).enumerate() {
        if matches!(set, DeviceSet::M1 | DeviceSet::M3) {
            // (c^cpu − d^avail − d^swapout) / s; the head's b_i/V + b_o are counted above.
            let room = ram_room(dev, model, m == 0) + cio(model, m == 0);
            kappa += (model.compute_buffer_cpu - room) * model.paged_share() / dev.disk_read();
        }
        kappa += k as f64 * xi(dev, model);
    }
    kappa
}

/// What a device's CPU layers (`l_cpu` per token), KV, compute buffer and the head's I/O
/// layers exceed its RAM by (eqs 15, 17): the bytes it cannot hold.
/// `ram_experts`: bytes of experts of GPU layers held in RAM per token (k × per window).
fn excess_bytes(dev: &DeviceProfile, model: &ModelProfile, head: bool, l_cpu: f64, ram_experts: f64) -> f64 {
    let io = if head { model.lookup_bytes() + model.output_bytes } else { 0.0 };
    let room = ram_room(dev, model, head) + cio(model, head);
    l_cpu * model.layer_bytes_with_kv() + ram_experts + io + model.compute_buffer_cpu - room
}

/// Of a MoE device's excess, the bytes of dense parts (attention, norms, router, shared
/// experts: what every token touches) that do not fit even with every expert let go.
/// Zero for a dense model (its excess is all paged at share 1) and for any device whose
/// dense parts fit, which is the usual case: they are a few percent of a MoE layer.
/// `excess`: the device's `excess_bytes` (at least 0); `ram_experts` as there.
fn dense_excess(model: &ModelProfile, excess: f64, l_cpu: f64, ram_experts: f64) -> f64 {
    model.moe.as_ref().map_or(0.0, |moe| (excess - l_cpu * moe.expert_bytes - ram_experts).clamp(0.0, excess))
}

/// Bytes an overloaded Linux/Android device pages in per token: a dense model its whole
/// excess; a MoE model the dense parts that do not fit, plus `disk_share` of the expert
/// bytes it cannot hold (`ModelProfile::paged_share`).
fn paged_bytes(dev: &DeviceProfile, model: &ModelProfile, head: bool, l_cpu: f64, ram_experts: f64) -> f64 {
    let excess = excess_bytes(dev, model, head, l_cpu, ram_experts).max(0.0);
    let dense = dense_excess(model, excess, l_cpu, ram_experts);
    dense + (excess - dense) * model.paged_share()
}

/// The MoE `disk_share` under which the cost model pages in per token what the running
/// plan's devices measured (`measured[i]`: bytes device `i` read from disk per token; NaN
/// where unknown): over the overloaded Linux/Android devices, Σ excess × paged_share equals
/// Σ measured. How often a token's experts are already cached depends on how the model
/// routes real text (trained routers spread tokens over experts; random weights route
/// most tokens alike), which only running it shows. None for a dense model, or when no
/// device with a measurement is overloaded.
pub fn measured_disk_share(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan, measured: &[f64]) -> Option<f64> {
    model.moe.as_ref()?;
    let k = plan.rounds();
    let (mut experts_out, mut read) = (0.0, 0.0);
    for (m, ((dev, dp), &r)) in devices.iter().zip(&plan.devices).zip(measured).enumerate() {
        let (w, n, e) = (dp.window, dp.gpu_layers.min(dp.window), dp.experts_in_ram);
        if !r.is_finite() || dev.metal().is_some() && dev.os == Os::Macos || !overloaded(dev, model, m == 0, w, n, e, k) {
            continue;
        }
        let l_cpu = (k * (w - n)) as f64;
        let held = k as f64 * ram_experts(dev, model, n, e);
        let excess = excess_bytes(dev, model, m == 0, l_cpu, held).max(0.0);
        let dense = dense_excess(model, excess, l_cpu, held);
        experts_out += excess - dense;
        read += (r - dense).max(0.0);
    }
    (experts_out > 0.0).then(|| (read / experts_out).clamp(0.0, 1.0))
}

/// Predicted TPOT of a whole-rounds plan (Assumption 1: every device has k windows),
/// `devices[i]` running `plan.devices[i]`, device 0 the head. `disk_threshold` only
/// labels the sets (a slow-disk device is M4 even when the plan overloads it, and is then
/// charged its reloads all the same).
pub fn predict(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan, disk_threshold: f64) -> Prediction {
    assert_eq!(devices.len(), plan.devices.len(), "one profile per plan device");
    let k = plan.rounds();
    let kf = k as f64;
    let mut out = Vec::with_capacity(devices.len());
    for (m, (dev, dp)) in devices.iter().zip(&plan.devices).enumerate() {
        let head = m == 0;
        let (w, n) = (dp.window, dp.gpu_layers.min(dp.window));
        let e = if experts_in_ram_possible(dev, model) { dp.experts_in_ram.min(n) } else { 0 };
        let lc = LayerCosts::of(dev, model);
        let (l_cpu, l_gpu, l_exp) = (kf * (w - n) as f64, kf * n as f64, kf * e as f64);
        let mut b = Breakdown {
            compute_s: l_cpu * lc.cpu_compute + l_gpu * lc.gpu_compute,
            memory_s: l_cpu * lc.cpu_memory + l_gpu * lc.gpu_memory + kf * lc.copy,
            disk_s: 0.0,
            network_s: kf * dev.comm_s,
        };
        // Experts in RAM: their share of those GPU layers runs on the CPU instead, with a
        // copy down and up per layer (charged as memory time, like the window's copies).
        b.compute_s += l_exp * (lc.experts_cpu - lc.experts_gpu);
        b.memory_s += l_exp * lc.copy;
        if head {
            let (hc, hm) = head_fixed(dev, model);
            b.compute_s += hc;
            b.memory_s += hm;
        }
        let over = overloaded(dev, model, head, w, n, e, k);
        let held = kf * ram_experts(dev, model, n, e);
        let s = dev.disk_read();
        // Bytes the device cannot hold are paged in per token; of a MoE layer only the
        // experts its tokens use.
        let io = if head { model.lookup_bytes() + model.output_bytes } else { 0.0 };
        b.disk_s = if !over {
            if head { model.lookup_bytes() / s } else { 0.0 }
        } else if dev.metal().is_some() && dev.os == Os::Macos {
            // eq 16: Metal lets go of everything: all l_m b (+ the head's I/O layers).
            (kf * w as f64 * model.released_layer_bytes() + io) / s
        } else {
            // eqs 15, 17: the excess of CPU layers (+ KV, compute buffer, head I/O) over RAM.
            paged_bytes(dev, model, head, l_cpu, held) / s
        };
        out.push(DeviceCost {
            name: dev.name.clone(),
            set: set_for(dev, over, fast_disk(dev, model, disk_threshold)),
            overloaded: over,
            cpu_layers: k * (w - n),
            gpu_layers: k * n,
            experts_in_ram: k * e,
            breakdown: b,
        });
    }
    let tpot_s = out.iter().map(|d| d.breakdown.total()).sum();
    Prediction { tpot_s, devices: out }
}

/// How many bytes a Linux device whose single window (k = 1) exceeds its memory re-reads
/// per token, over the excess: the page cache's LRU scans the window cyclically, so pages
/// are evicted before their next use and far more than the excess comes back. Measured
/// (docs/benchmarks.md, "The memory experiment"): 2.09 GiB dense model, 10-layer windows of
/// 700 MB on 480 MiB devices re-read ~580 MB a token against a 300 MB excess; never more
/// than the whole window.
const LRU_RELOAD_FACTOR: f64 = 2.0;

/// Predicted TPOT of a plan as hearth's ring runs it: the paper's model (`predict`) where
/// every device holds its layers, with two corrections measured on memory-short rings
/// (docs/benchmarks.md, "The memory experiment"), for dense models on Linux and Android:
/// - k = 1: an overloaded device re-reads `LRU_RELOAD_FACTOR` × its excess (at most its
///   whole window) each token, not just the excess;
/// - k ≥ 2: the pager releases each window after use and reads the next one ahead while
///   the other devices work, so a device re-reads all its layers every token, but in the
///   shadow of the rest of the ring: a token takes the longer of everyone's work in series
///   and the slowest device's own work plus its reading.
///
/// MoE models keep the paper's term with the measured `disk_share` (their windows are not
/// released, their dense parts stay cached; a token reads only its uncached experts). Halda's programs optimise the paper's model
/// (`predict`, which they equal for consistent sets); Halda then chooses among their
/// solutions by this one, and this is what plans report.
pub fn predict_ring(devices: &[DeviceProfile], model: &ModelProfile, plan: &Plan, disk_threshold: f64) -> Prediction {
    let mut p = predict(devices, model, plan, disk_threshold);
    if model.moe.is_some() {
        return p;
    }
    let k = plan.rounds();
    let kf = k as f64;
    // Per device: bytes re-read per token, read ahead in the ring's shadow (k ≥ 2) or not.
    let mut shadow = vec![0.0; devices.len()];
    for (m, ((dev, dp), cost)) in devices.iter().zip(&plan.devices).zip(&mut p.devices).enumerate() {
        let macos_metal = dev.os == Os::Macos && dev.metal().is_some();
        if !cost.overloaded || macos_metal {
            continue;
        }
        let head = m == 0;
        let (w, n) = (dp.window, dp.gpu_layers.min(dp.window));
        let l_cpu = kf * (w - n) as f64;
        let s = dev.disk_read();
        let lookup = if head { model.lookup_bytes() / s } else { 0.0 };
        if k == 1 {
            let excess = excess_bytes(dev, model, head, l_cpu, 0.0).max(0.0);
            cost.breakdown.disk_s = (LRU_RELOAD_FACTOR * excess).min(l_cpu * model.layer_bytes) / s + lookup;
        } else {
            shadow[m] = l_cpu * model.layer_bytes / s;
            cost.breakdown.disk_s = lookup;
        }
    }
    let serial: f64 = p.devices.iter().map(|d| d.breakdown.total()).sum();
    // The device whose own work plus reading is longest, if it outlasts the ring.
    let bottleneck = (0..p.devices.len()).filter(|&m| shadow[m] > 0.0).map(|m| (m, p.devices[m].breakdown.total() + shadow[m])).max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((m, t)) = bottleneck.filter(|&(_, t)| t > serial) {
        p.devices[m].breakdown.disk_s += t - serial;
    }
    p.tpot_s = p.devices.iter().map(|d| d.breakdown.total()).sum();
    p
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::profile::PerQuant;

    pub(crate) fn dev(os: Os, ram: f64) -> DeviceProfile {
        let r = PerQuant { q4_0: 1e11, q4_1: 1e11, q4k: 1e11, q5k: 1e11, q6k: 1e11, q8_0: 1e11, f16: 1e11, f32: 1e11, other: Default::default() };
        DeviceProfile {
            name: "d".into(),
            os,
            head: false,
            cpu_flops: r,
            cpu_read_bw: 1e10,
            kv_copy_cpu_s: 0.0,
            disk_seq_read: 1e9,
            disk_rand_read: 5e8,
            ram_total: ram,
            ram_available: ram,
            swap_available: 2e9,
            bytes_can_swap: 1e9,
            gpu: None,
            comm_s: 1e-3,
            prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
        }
    }

    pub(crate) fn model() -> ModelProfile {
        ModelProfile {
            name: "m".into(),
            n_layer: 10,
            layer_bytes: 1e9,
            input_bytes: 1e9,
            output_bytes: 1e9,
            n_vocab: 1000,
            n_embd: 1000,
            n_head_k: 1,
            n_head_v: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            n_kv: 0,
            n_head: 0,
            kv_element_bytes_k: 2.0,
            kv_element_bytes_v: 2.0,
            layer_flops: PerQuant { q4k: 1e9, ..PerQuant::default() },
            output_flops: PerQuant { q6k: 1e9, ..PerQuant::default() },
            compute_buffer_cpu: 0.0,
            compute_buffer_gpu: 0.0,
            moe: None,
            state_bytes: 0.0,
        }
    }

    #[test]
    fn android_swap_out_is_extra_room_and_linux_reloads_the_excess() {
        let m = model();
        let plan = Plan::from_windows(10, &[0, 5, 5]).unwrap();
        let head = dev(Os::Linux, 8e9);
        // 5 layers of 1 GB each on 4 GB: Linux reloads 1 GB; Android swaps 1 GB out first.
        let p = predict(&[head.clone(), dev(Os::Linux, 4e9), dev(Os::Android, 4e9)], &m, &plan, 2e9);
        assert!((p.devices[1].breakdown.disk_s - 1.0).abs() < 1e-9);
        assert!(p.devices[1].overloaded && !p.devices[2].overloaded);
        assert_eq!(p.devices[1].set, DeviceSet::M4, "1 GB/s is below the 2 GB/s threshold: slow disk");
        let p = predict(&[head.clone(), dev(Os::Linux, 4e9), dev(Os::Android, 4e9)], &m, &plan, 1e9);
        assert_eq!((p.devices[1].set, p.devices[2].set), (DeviceSet::M3, DeviceSet::M4));
        // The relay head: no layers, but its hop, the output layer and one embedding row.
        let h = p.devices[0].breakdown;
        assert_eq!((p.devices[0].cpu_layers, h.network_s), (0, 1e-3));
        assert!((h.compute_s - 0.01).abs() < 1e-12 && (h.disk_s - 1e6 / 1e9).abs() < 1e-12);
        assert!((p.tpot_s - p.devices.iter().map(|d| d.breakdown.total()).sum::<f64>()).abs() < 1e-12);
    }

    #[test]
    fn macos_reads_randomly() {
        let m = model();
        let plan = Plan::from_windows(10, &[0, 10]).unwrap();
        let p = predict(&[dev(Os::Linux, 8e9), dev(Os::Macos, 8e9)], &m, &plan, 0.0);
        // 10 GB on 8 GB: 2 GB at the random-read 0.5 GB/s.
        assert!((p.devices[1].breakdown.disk_s - 4.0).abs() < 1e-9);
        assert_eq!(p.devices[1].set, DeviceSet::M1);
    }

    #[test]
    fn moe_layers_hold_every_expert_but_read_and_page_only_the_used_ones() {
        let dense = model();
        // 80% of each layer is experts, of which a token uses 1 in 8 (and pages in 1.5x that).
        let moe = ModelProfile { moe: Some(crate::MoeProfile { expert_bytes: 0.8e9, read_share: 0.125, disk_share: 0.1875, expert_flops: PerQuant::default() }), ..model() };
        let d = dev(Os::Linux, 4e9);
        // Memory: the same RAM cap (every expert must be somewhere).
        assert_eq!(ram_cap(&d, &dense, false, 1), ram_cap(&d, &moe, false, 1));
        // Reads per token: 0.2 GB dense part + 0.1 GB of experts.
        assert!((moe.layer_read_bytes() - 0.3e9).abs() < 1.0);
        let (ld, lm) = (LayerCosts::of(&d, &dense), LayerCosts::of(&d, &moe));
        assert!((ld.cpu_memory / lm.cpu_memory - 1.0 / 0.3).abs() < 1e-9);
        // Paging: 5 layers on 4 GB reload 1 GB dense; of MoE layers the dense parts (1 GB)
        // stay and the 1 GB that does not fit is experts, of which a token pages 0.1875.
        let plan = Plan::from_windows(10, &[5, 5]).unwrap();
        let head = dev(Os::Linux, 8e9);
        let pd = predict(&[head.clone(), d.clone()], &dense, &plan, 0.0);
        let pm = predict(&[head, d], &moe, &plan, 0.0);
        assert!((pd.devices[1].breakdown.disk_s - 1.0).abs() < 1e-9);
        assert!((pm.devices[1].breakdown.disk_s - 0.1875).abs() < 1e-9, "{}", pm.devices[1].breakdown.disk_s);
        assert!(pm.tpot_s < pd.tpot_s);
        // On 0.5 GB even the dense parts (1 GB) do not fit: 0.5 GB of them come back whole,
        // and 0.1875 of the 4 GB of experts.
        let small = dev(Os::Linux, 0.5e9);
        let p = predict(&[dev(Os::Linux, 8e9), small], &moe, &plan, 0.0);
        assert!((p.devices[1].breakdown.disk_s - 1.25).abs() < 1e-9, "{}", p.devices[1].breakdown.disk_s);
        // A 1 GB/s disk is slow for dense layers at a 2 GB/s threshold, but it brings a MoE
        // layer's missing experts back as fast as a 5.3 GB/s disk brings a dense layer: fast.
        let d = dev(Os::Linux, 4e9);
        assert!(!fast_disk(&d, &dense, 2e9) && fast_disk(&d, &moe, 2e9));
    }

    #[test]
    fn the_ring_model_rereads_overloaded_windows_and_hides_reads_behind_the_ring() {
        let m = model();
        let head = dev(Os::Linux, 20e9);
        // k = 1: 5 layers of 1 GB on 4 GB re-read 2 GB (twice the excess), not 1 GB.
        let plan = Plan::from_windows(10, &[5, 5]).unwrap();
        let devices = [head.clone(), dev(Os::Linux, 4e9)];
        let paper = predict(&devices, &m, &plan, 0.0);
        let ring = predict_ring(&devices, &m, &plan, 0.0);
        assert!((paper.devices[1].breakdown.disk_s - 1.0).abs() < 1e-9);
        assert!((ring.devices[1].breakdown.disk_s - 2.0).abs() < 1e-9, "{:?}", ring.devices[1]);
        // ... but never more than the window: 5 GB on 1 GB re-reads 5 GB, not 8.
        let devices = [head.clone(), dev(Os::Linux, 1e9)];
        assert!((predict_ring(&devices, &m, &plan, 0.0).devices[1].breakdown.disk_s - 5.0).abs() < 1e-9);
        // k = 5 (windows of 1 layer): each device re-reads its 5 layers (5 s at 1 GB/s) while
        // the other computes; the token takes the slowest device's work plus its reading.
        let plan = Plan::from_windows(10, &[1, 1]).unwrap();
        let devices = [head.clone(), dev(Os::Linux, 4e9)];
        let ring = predict_ring(&devices, &m, &plan, 0.0);
        let own = predict(&devices, &m, &plan, 0.0).devices[1].breakdown;
        let want = own.compute_s + own.memory_s + own.network_s + 5.0;
        assert!((ring.tpot_s - want).abs() < 1e-9, "{} vs {want}", ring.tpot_s);
        // Every device holding its layers: the paper's model unchanged; MoE: unchanged.
        let roomy = [head.clone(), dev(Os::Linux, 20e9)];
        assert_eq!(predict_ring(&roomy, &m, &plan, 0.0), predict(&roomy, &m, &plan, 0.0));
        let moe = ModelProfile { moe: Some(crate::MoeProfile { expert_bytes: 0.8e9, read_share: 0.125, disk_share: 0.125, expert_flops: PerQuant::default() }), ..model() };
        assert_eq!(predict_ring(&devices, &moe, &plan, 0.0), predict(&devices, &moe, &plan, 0.0));
    }

    #[test]
    fn the_measured_disk_share_reproduces_the_measured_reads() {
        let moe = ModelProfile { moe: Some(crate::MoeProfile { expert_bytes: 0.8e9, read_share: 0.125, disk_share: 0.125, expert_flops: PerQuant::default() }), ..model() };
        let plan = Plan::from_windows(10, &[2, 4, 4]).unwrap();
        // The head holds its 2 layers; the workers hold 3 of 4 (1 GB over each).
        let devices = [dev(Os::Linux, 8e9), dev(Os::Linux, 3e9), dev(Os::Linux, 3e9)];
        let before = predict(&devices, &moe, &plan, 0.0);
        // Measured: 0.05 GB and 0.03 GB a token (the head's reads do not count: it fits).
        let ds = measured_disk_share(&devices, &moe, &plan, &[5e9, 0.05e9, 0.03e9]).unwrap();
        let calibrated = ModelProfile { moe: Some(crate::MoeProfile { disk_share: ds, ..moe.moe.clone().unwrap() }), ..moe.clone() };
        let after = predict(&devices, &calibrated, &plan, 0.0);
        let paged = |p: &Prediction| p.devices[1..].iter().map(|d| d.breakdown.disk_s).sum::<f64>() * 1e9;
        assert!((paged(&after) - 0.08e9).abs() < 1.0, "{} bytes", paged(&after));
        assert!(paged(&before) > paged(&after) && ds < 0.125, "{ds}");
        // Unknown devices are skipped; a dense model or nothing overloaded gives none.
        assert_eq!(measured_disk_share(&devices, &moe, &plan, &[f64::NAN, 0.05e9, f64::NAN]).map(|d| (d * 1e6).round()), Some(0.05e6));
        assert_eq!(measured_disk_share(&devices, &model(), &plan, &[0.0, 0.05e9, 0.03e9]), None);
        let roomy = [dev(Os::Linux, 8e9), dev(Os::Linux, 8e9), dev(Os::Linux, 8e9)];
        assert_eq!(measured_disk_share(&roomy, &moe, &plan, &[0.0, 0.0, 0.0]), None);
    }
}
