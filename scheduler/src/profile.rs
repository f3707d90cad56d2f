//! What Halda knows about the devices and the model: exactly the quantities of
//! prima.cpp's latency model (symbols of the paper's Table 5/6 and appendix A.3 in the
//! field docs). Plain serde values: the profiler fills them on a device, `hearth plan`
//! reads them from JSON, the scheduler never measures anything itself.
//!
//! Units: bytes, bytes per second, FLOP, FLOP per second, seconds. All `f64` so that
//! profiles may carry measured (fractional) figures.

use serde::{Deserialize, Serialize};

/// One figure per weight format: FLOPs of a layer (`f^q`, `f_out^q`) or a backend's
/// throughput (`s^{cpu,q}`, `s^{cuda,q}`, `s^{metal,q}`). The paper's set 𝒬 = {Q4_K, Q5_K,
/// Q6_K, Q8_0, F16, F32} plus Q4_0/Q4_1 (hearth's default model is Q4_1) are fields; every
/// other format a model holds (IQ4_XS, Q2_K, BF16, MXFP4, ...) is charged at its own rate
/// in `other`, by ggml's name. A throughput of 0 for Q4_0/Q4_1 (a profile that did not
/// measure them) means the Q4_K rate; a format missing from a device's `other` runs at
/// the rate of the field nearest to it in bits per weight.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PerQuant {
    pub q4_0: f64,
    pub q4_1: f64,
    pub q4k: f64,
    pub q5k: f64,
    pub q6k: f64,
    pub q8_0: f64,
    pub f16: f64,
    pub f32: f64,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub other: std::collections::BTreeMap<String, f64>,
}

/// The field whose kernels run a format not among the fields at about its speed: the
/// nearest in bits per weight within its family (index into `PerQuant::values`).
fn nearest_field(format: &str) -> usize {
    const Q4K: usize = 2;
    const Q5K: usize = 3;
    const Q6K: usize = 4;
    const Q8_0: usize = 5;
    const F16: usize = 6;
    const F32: usize = 7;
    match format.to_ascii_lowercase().as_str() {
        "f32" | "f64" | "i32" | "i64" => F32,
        "f16" | "bf16" | "i16" => F16,
        "q8_0" | "q8_1" | "q8_k" | "i8" => Q8_0,
        "q6_k" => Q6K,
        "q5_0" | "q5_1" | "q5_k" => Q5K,
        _ => Q4K,
    }
}

impl PerQuant {
    pub fn values(&self) -> [f64; 8] {
        [self.q4_0, self.q4_1, self.q4k, self.q5k, self.q6k, self.q8_0, self.f16, self.f32]
    }

    /// Every figure, mutable (to scale a profile's rates), `other` included.
    pub fn values_mut(&mut self) -> Vec<&mut f64> {
        let mut v: Vec<&mut f64> = vec![&mut self.q4_0, &mut self.q4_1, &mut self.q4k, &mut self.q5k, &mut self.q6k, &mut self.q8_0, &mut self.f16, &mut self.f32];
        v.extend(self.other.values_mut());
        v
    }

    pub fn total(&self) -> f64 {
        self.values().iter().sum::<f64>() + self.other.values().sum::<f64>()
    }

    /// As throughputs: an unmeasured Q4_0 or Q4_1 rate (0) is the Q4_K one.
    fn rates(&self) -> [f64; 8] {
        let mut v = self.values();
        for r in &mut v[..2] {
            if *r <= 0.0 {
                *r = self.q4k;
            }
        }
        v
    }

    /// The throughput for `format` (ggml's name): measured, else its nearest field's.
    pub fn rate_of(&self, format: &str) -> f64 {
        match self.other.get(format) {
            Some(&r) if r > 0.0 => r,
            _ => self.rates()[nearest_field(format)],
        }
    }

    /// `Σ_q f^q / s^q`: the time to run these FLOPs at these throughputs. A format with
    /// FLOPs but no throughput is infinitely slow (the caller validates profiles first).
    pub fn time_at(&self, rates: &PerQuant) -> f64 {
        let at = |f: f64, s: f64| if f <= 0.0 { 0.0 } else if s > 0.0 { f / s } else { f64::INFINITY };
        let named: f64 = self.values().iter().zip(rates.rates()).map(|(&f, s)| at(f, s)).sum();
        named + self.other.iter().map(|(name, &f)| at(f, rates.rate_of(name))).sum::<f64>()
    }
}

/// The operating-system class that decides which disk-loading case applies (§3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Os {
    /// macOS: random-read disk throughput; Metal or not decides M1 vs M2.
    Macos,
    /// Linux (also HarmonyOS/Android under Termux when the swap behaviour is unknown):
    /// sequential-read disk throughput, set M3.
    Linux,
    /// Android: like Linux, but the OS swaps other apps out first (`d^swapout`).
    Android,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuBackend {
    Cuda,
    Metal,
    /// Any Vulkan device: a discrete GPU (own VRAM, like CUDA) or an integrated one (`uma`:
    /// its memory is the host's RAM, so its layers count against RAM).
    Vulkan,
}

/// A device's accelerator, if Halda may put layers on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuProfile {
    pub backend: GpuBackend,
    /// `s_m^{cuda,q}` / `s_m^{metal,q}`: FLOP/s per weight format at decode shapes.
    pub flops: PerQuant,
    /// `𝒯_m^{cuda}` / `𝒯_m^{metal}`: practical VRAM (or shared memory) → register bytes/s.
    pub read_bw: f64,
    /// `d_{m,cuda}^avail` (free private VRAM) or `d_{m,metal}^avail` (Metal's recommended
    /// maximum working set size), bytes.
    pub memory_available: f64,
    /// `t_m^{kv_cpy,gpu}`: seconds to write one token's K and V of one layer on the GPU.
    #[serde(default)]
    pub kv_copy_s: f64,
    /// `t_m^{ram-vram}`: seconds to copy the `4e`-byte hidden state host → device.
    #[serde(default)]
    pub ram_to_vram_s: f64,
    /// `t_m^{vram-ram}`: seconds to copy it back.
    #[serde(default)]
    pub vram_to_ram_s: f64,
    /// `𝕀_m^UMA`: host and device share memory (Apple silicon): no copies.
    #[serde(default)]
    pub uma: bool,
}

/// One device of the home cluster, as the profiler measured it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    pub name: String,
    pub os: Os,
    /// `𝕀_{m=1}`: the head (embedding, output layer, sampling). It must be the first
    /// device of the list; if no device says so, the first device is the head.
    #[serde(default)]
    pub head: bool,
    /// `s_m^{cpu,q}`: CPU FLOP/s per weight format at decode shapes (matrix × vector).
    pub cpu_flops: PerQuant,
    /// `𝒯_m^{cpu}`: practical RAM → register bytes/s.
    pub cpu_read_bw: f64,
    /// `t_m^{kv_cpy,cpu}`: seconds to write one token's K and V of one layer in RAM.
    #[serde(default)]
    pub kv_copy_cpu_s: f64,
    /// Sequential read bytes/s (`s_m^disk` on Linux/Android, where mmap reads sequentially).
    pub disk_seq_read: f64,
    /// Random read bytes/s (`s_m^disk` on macOS).
    pub disk_rand_read: f64,
    /// Installed RAM, bytes (informational: the model uses what is available).
    #[serde(default)]
    pub ram_total: f64,
    /// `d_m^avail`: the OS's mem_available, bytes.
    pub ram_available: f64,
    /// `d_m^{swap_avail}`: free swap, bytes (Android's swap-out term).
    #[serde(default)]
    pub swap_available: f64,
    /// `d_m^{bytes_can_swap}`: bytes of other apps' memory the OS may swap out (Android).
    #[serde(default)]
    pub bytes_can_swap: f64,
    #[serde(default)]
    pub gpu: Option<GpuProfile>,
    /// `t_m^comm`: seconds to send the `4e`-byte hidden state to the next device of the ring.
    pub comm_s: f64,
    /// What one more token in a prompt-sized batch costs, as a share of one decode step's
    /// time over the same layers (a step of b tokens takes `t₁·(1 − σ + σ·b)`): measured
    /// on the model's own layers; 0 when not measured (an older profile).
    #[serde(default)]
    pub prompt_token_share: f64,
    /// A step of `b` decode tokens (one of each of `b` sequences) as a multiple of one
    /// token's step over the same layers, for b = 1, 2, ... (the first is 1): measured on
    /// the model's own layers. Small batches do not cost in proportion: a matrix kernel
    /// takes rows in tiles, and a kernel for few rows can be slower per row than the one
    /// for a single row (a 2-core AVX2 host, one thread, the default model's Q8_0 output
    /// layer: 2 rows 2.8x one row's time, 8 rows 4.2x). Empty when not measured (an older
    /// profile): the line through σ stands in.
    #[serde(default)]
    pub row_steps: Vec<f64>,
    /// The same for the output layer alone, measured where it weighs (a model small enough
    /// to be timed whole); empty: `row_steps` stands in.
    #[serde(default)]
    pub output_row_steps: Vec<f64>,
    /// The machine the device runs on and the share of it the device computes with;
    /// `None` (an older profile, or a system that does not say): a machine of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostShare>,
}

/// Where a device computes: ring members on one machine (a worker per GPU, a desktop
/// lending its spare cores, every test and benchmark here) share its cores, so while
/// several of them compute at once each runs slower than it measured alone, and ggml
/// threads that spin at barriers while their peers wait for a core slow down many times
/// over (measured: three members of two threads each on a 2-core machine decoded 8
/// streams at 43.7 tokens/s with four micro-batches in flight, 162.9 one at a time).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostShare {
    /// The machine: one id per running kernel (Linux's boot id, which every process,
    /// container and network namespace under it shares); empty: unknown, a machine of
    /// its own.
    pub id: String,
    /// The machine's online cores: what its members share.
    pub cores: f64,
    /// Threads the device computes with: its rates were measured with them.
    pub threads: usize,
    /// Cores the device's process may use (a cgroup CPU quota, an affinity mask): at
    /// most `cores`.
    pub quota: f64,
    /// The device's available RAM is its own (a memory cgroup's limit: a container, an
    /// emulated device), not the machine's, which its co-located members also count.
    pub own_memory: bool,
}

impl HostShare {
    /// Cores the device keeps busy while it computes: its threads, within its quota.
    pub fn busy_cores(&self) -> f64 {
        let threads = self.threads.max(1) as f64;
        if self.quota > 0.0 {
            threads.min(self.quota)
        } else {
            threads
        }
    }
}

/// Members on one machine that each report the machine's available RAM (no memory limit
/// of their own) fill one RAM and one page cache: planned as reported, Halda would let
/// each hold what only all of them together may. Each gets a share of the machine's RAM
/// and swap in proportion to the cores it keeps busy (where its layers tend to go); the
/// least of their reports stands for the machine (they are read moments apart). Call it
/// once on freshly gathered profiles: it is not idempotent.
pub fn share_host_memory(devices: &mut [DeviceProfile]) {
    for group in shared_machines(devices, |h| !h.own_memory) {
        let least = |f: fn(&DeviceProfile) -> f64| group.iter().map(|&j| f(&devices[j])).fold(f64::INFINITY, f64::min);
        let (ram, swap) = (least(|d| d.ram_available), least(|d| d.swap_available));
        let weights: Vec<f64> = group.iter().map(|&j| devices[j].host.as_ref().map_or(1.0, HostShare::busy_cores)).collect();
        let total: f64 = weights.iter().sum();
        for (&j, w) in group.iter().zip(&weights) {
            devices[j].ram_available = ram * w / total;
            devices[j].swap_available = swap * w / total;
        }
    }
}

/// The devices that share a known machine with another (`HostShare::id`), of those whose
/// share `counted` admits: one group of indices per machine, in the order of its first
/// member. What the forecast splits cores by and [`share_host_memory`] RAM by.
pub(crate) fn shared_machines(devices: &[DeviceProfile], counted: impl Fn(&HostShare) -> bool) -> Vec<Vec<usize>> {
    fn id<'a>(d: &'a DeviceProfile, counted: &impl Fn(&HostShare) -> bool) -> Option<&'a str> {
        d.host.as_ref().filter(|h| !h.id.is_empty() && counted(h)).map(|h| h.id.as_str())
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let Some(me) = id(d, &counted) else { continue };
        match groups.iter_mut().find(|g| id(&devices[g[0]], &counted) == Some(me)) {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups.retain(|g| g.len() > 1);
    groups
}

impl DeviceProfile {
    /// `s_m^disk`: random read on macOS, sequential read elsewhere (§3.6).
    pub fn disk_read(&self) -> f64 {
        match self.os {
            Os::Macos => self.disk_rand_read,
            Os::Linux | Os::Android => self.disk_seq_read,
        }
    }

    /// `min(d^{bytes_can_swap}, d^{swap_avail})` on Android, else 0: the most the OS will
    /// swap out for us. The paper's `d_m^swapout = min(max(0, excess), this)`, so an
    /// Android device reloads from disk only what exceeds `d^avail` + this.
    pub fn swap_out_cap(&self) -> f64 {
        match self.os {
            Os::Android => self.bytes_can_swap.min(self.swap_available).max(0.0),
            _ => 0.0,
        }
    }

    pub fn metal(&self) -> Option<&GpuProfile> {
        self.gpu.as_ref().filter(|g| g.backend == GpuBackend::Metal)
    }

    /// The memory budget that initialises Halda's windows (Algorithm 1 line 1):
    /// `d^avail` (macOS without Metal, Linux), `d_metal^avail` (macOS with Metal),
    /// `d^avail + d^swapout` (Android); CUDA VRAM is added where there is one.
    pub fn memory_budget(&self) -> f64 {
        let ram = match (self.os, self.metal()) {
            (Os::Macos, Some(g)) => g.memory_available,
            (Os::Android, _) => self.ram_available + self.swap_out_cap(),
            _ => self.ram_available,
        };
        let vram = match &self.gpu {
            Some(g) if matches!(g.backend, GpuBackend::Cuda | GpuBackend::Vulkan) && !g.uma => g.memory_available,
            _ => 0.0,
        };
        ram + vram
    }
}

/// A Mixture-of-Experts model's routed experts as the cost model charges them: memory
/// for all of them, compute and reads for the ones a token uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeProfile {
    /// Bytes of one layer's routed expert matrices (part of `layer_bytes`).
    pub expert_bytes: f64,
    /// Share of those bytes one token reads from memory: `expert_used_count / expert_count`.
    pub read_share: f64,
    /// Of the expert bytes a device cannot hold, the share one token pages in from disk:
    /// the experts the token uses that are not cached (hearth reads exactly those; the
    /// OS's read-around made it 3x that); experts no token asks for are never read
    /// (measured: docs/benchmarks.md, "MoE larger than memory"). The prior is
    /// `read_share` (every chosen expert a miss at the uncached share); the ring measures it.
    pub disk_share: f64,
    /// FLOPs one token spends in one layer's routed experts, per weight format (part of
    /// `layer_flops`): what moves to the CPU when a GPU layer keeps its experts in RAM.
    /// Empty in profiles written before it existed: then estimated from the bytes.
    #[serde(default)]
    pub expert_flops: PerQuant,
}

/// An F16 cache element's bytes: what a profile that does not say means.
fn f16_bytes() -> f64 {
    2.0
}

/// The model, as the model profiler reads it from the GGUF (or as computed from the
/// published architecture for what-if planning).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub name: String,
    /// `L`: repeating layers.
    pub n_layer: usize,
    /// `b`: weight bytes of one layer (average over layers).
    pub layer_bytes: f64,
    /// `b_i`: bytes of the input (token embedding) layer.
    pub input_bytes: f64,
    /// `b_o`: bytes of the output layer (output norm + lm_head).
    pub output_bytes: f64,
    /// `V`: vocabulary size.
    pub n_vocab: usize,
    /// `e`: embedding size (the hidden state is `4e` bytes of F32).
    pub n_embd: usize,
    /// `h_k`, `h_v`: attention heads for keys and values.
    pub n_head_k: usize,
    pub n_head_v: usize,
    /// `e_k`, `e_v`: embedding size per head for keys and values.
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// `n_kv`: tokens in the KV cache the plan is made for.
    pub n_kv: usize,
    /// Query heads (attention FLOPs grow with them per cached token); 0: as `n_head_k`.
    #[serde(default)]
    pub n_head: usize,
    /// Bytes per element of the K and of the V cache: 2 for F16 (the paper's `2` in
    /// `2(h_k e_k + h_v e_v) n_kv`), 34/32 for llama.cpp's q8_0, 18/32 for q4_0.
    #[serde(default = "f16_bytes")]
    pub kv_element_bytes_k: f64,
    #[serde(default = "f16_bytes")]
    pub kv_element_bytes_v: f64,
    /// `f^q`: FLOPs of one layer for one token, per weight format.
    pub layer_flops: PerQuant,
    /// `f_out^q`: FLOPs of the output layer for one token.
    pub output_flops: PerQuant,
    /// `c^cpu`: compute-buffer bytes on the CPU.
    pub compute_buffer_cpu: f64,
    /// `c^gpu`: compute-buffer bytes on the GPU.
    pub compute_buffer_gpu: f64,
    /// Routed experts, for a Mixture-of-Experts model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeProfile>,
    /// `s`: bytes of recurrent state one sequence keeps per layer, on average over the
    /// layers (Qwen3.5's linear attention keeps a fixed state instead of a K/V cache that
    /// grows): held and read like the KV cache, whatever the context.
    #[serde(default)]
    pub state_bytes: f64,
}

impl ModelProfile {
    /// Bytes one token reads from memory in one layer: the dense weights, the experts it
    /// uses and the KV cache.
    pub fn layer_read_bytes(&self) -> f64 {
        self.layer_bytes_with_kv() - self.moe.as_ref().map_or(0.0, |m| m.expert_bytes * (1.0 - m.read_share))
    }

    /// Of the bytes a device cannot hold, the share one token pages in from disk: 1 for a
    /// dense model (every weight is read); for a MoE model `disk_share`. Every token
    /// touches a MoE layer's dense part (attention, norms, router, shared experts), so the
    /// page cache keeps it and what does not fit is experts, of which a token reads only
    /// its own (`dense_excess` in the cost model covers a device too small for even the
    /// dense parts). Floored above zero: it divides disk speeds.
    pub fn paged_share(&self) -> f64 {
        const MIN_SHARE: f64 = 1e-9;
        match &self.moe {
            Some(m) if m.expert_bytes > 0.0 => m.disk_share.clamp(MIN_SHARE, 1.0),
            _ => 1.0,
        }
    }

    /// Bytes a layer that was let go whole (Metal's shared memory, eq 16) reads back per
    /// token: all of a dense layer; a MoE layer's dense part and `disk_share` of its experts.
    pub fn released_layer_bytes(&self) -> f64 {
        self.layer_bytes - self.moe.as_ref().map_or(0.0, |m| m.expert_bytes * (1.0 - self.paged_share()))
    }

    /// Bytes of one layer's routed experts a token reads (0 for a dense model).
    pub fn expert_read_bytes(&self) -> f64 {
        self.moe.as_ref().map_or(0.0, |m| m.expert_bytes * m.read_share)
    }

    /// FLOPs of one token in one layer's routed experts: the profile's figures, or for a
    /// profile without them the weight FLOPs in the experts' share of the bytes a token
    /// reads (FLOPs follow weights within a format). Empty for a dense model.
    pub fn expert_flops(&self) -> PerQuant {
        let Some(m) = &self.moe else { return PerQuant::default() };
        if m.expert_flops.total() > 0.0 {
            return m.expert_flops.clone();
        }
        let weights_read = self.layer_read_bytes() - self.kv_bytes_per_layer();
        let share = if weights_read > 0.0 { (self.expert_read_bytes() / weights_read).clamp(0.0, 1.0) } else { 0.0 };
        let mut f = self.layer_flops.clone();
        // Attention (F16 against the cache) and element-wise F32 work stay with the layer.
        f.f16 = 0.0;
        f.f32 = 0.0;
        for x in f.values_mut() {
            *x *= share;
        }
        f
    }

    /// `2(h_k e_k + h_v e_v) n_kv`: KV-cache bytes of one layer, with the cache types'
    /// bytes per element in place of F16's 2.
    pub fn kv_bytes_per_layer(&self) -> f64 {
        self.kv_bytes_per_token_layer() * self.n_kv as f64 + self.state_bytes
    }

    /// `h_k e_k + h_v e_v` in bytes: what one cached token adds to one layer's KV cache.
    pub fn kv_bytes_per_token_layer(&self) -> f64 {
        self.kv_element_bytes_k * (self.n_head_k * self.head_dim_k) as f64 + self.kv_element_bytes_v * (self.n_head_v * self.head_dim_v) as f64
    }

    /// `b′ = b + 2(h_k e_k + h_v e_v) n_kv`: a layer's weights and its KV cache.
    pub fn layer_bytes_with_kv(&self) -> f64 {
        self.layer_bytes + self.kv_bytes_per_layer()
    }

    /// `b_i / V`: the one embedding row the head reads per token.
    pub fn lookup_bytes(&self) -> f64 {
        self.input_bytes / self.n_vocab.max(1) as f64
    }

    /// The same model with `n` tokens in the KV cache: KV bytes and the attention FLOPs
    /// (QKᵀ and AV against the F16 cache, softmax in F32) follow; the weights do not. A
    /// prediction for the context a request really had, where the plan is made for the
    /// largest.
    pub fn at_context(&self, n: usize) -> ModelProfile {
        let heads = if self.n_head > 0 { self.n_head } else { self.n_head_k } as f64;
        let delta = n as f64 - self.n_kv as f64;
        let mut m = self.clone();
        m.layer_flops.f16 = (m.layer_flops.f16 + delta * 4.0 * heads * self.head_dim_k as f64).max(0.0);
        m.layer_flops.f32 = (m.layer_flops.f32 + delta * 2.0 * heads).max(0.0);
        m.n_kv = n;
        m
    }

    /// Total weight bytes: `L b + b_i + b_o`.
    pub fn total_bytes(&self) -> f64 {
        self.n_layer as f64 * self.layer_bytes + self.input_bytes + self.output_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_formats_run_at_their_own_rate_or_their_nearest_fields() {
        let flops = PerQuant { q4k: 1e9, other: [("iq4_xs".to_string(), 2e9), ("q2_K".to_string(), 1e9)].into_iter().collect(), ..PerQuant::default() };
        let rates = PerQuant { q4k: 1e10, other: [("iq4_xs".to_string(), 4e10)].into_iter().collect(), ..PerQuant::default() };
        // Q4_K 0.1 s, IQ4_XS at its own 40 GFLOP/s 0.05 s, Q2_K (unmeasured) at Q4_K's 0.1 s.
        assert!((flops.time_at(&rates) - 0.25).abs() < 1e-12, "{}", flops.time_at(&rates));
        assert_eq!(rates.rate_of("bf16"), rates.f16);
        assert_eq!(rates.rate_of("q5_0"), rates.q5k);
        // A profile written before `other` existed still reads.
        let old: PerQuant = serde_json::from_str(r#"{"q4k": 1.0, "f32": 2.0}"#).unwrap();
        assert!(old.other.is_empty() && old.q4k == 1.0);
    }

    /// Three members on one machine (a head of two threads and two workers of one) share
    /// its 24 GB in proportion to their threads; one in a memory cgroup keeps its own
    /// figure, and so does a member alone on its machine or on an unknown one.
    #[test]
    fn members_on_one_machine_share_its_memory_once() {
        let mut devices: Vec<DeviceProfile> = (0..6).map(|_| crate::cost::tests::dev(Os::Linux, 24e9)).collect();
        for d in &mut devices {
            d.swap_available = 4e9;
        }
        let host = |id: &str, threads: usize, own_memory: bool| Some(HostShare { id: id.into(), cores: 4.0, threads, quota: 4.0, own_memory });
        devices[0].host = host("box", 2, false);
        devices[1].host = host("box", 1, false);
        devices[2].host = host("box", 1, false);
        devices[2].ram_available = 23e9;
        devices[3].host = host("box", 1, true);
        devices[4].host = host("other", 1, false);
        devices[5].host = host("", 1, false);
        share_host_memory(&mut devices);
        let ram: Vec<f64> = devices.iter().map(|d| d.ram_available).collect();
        assert_eq!(ram, vec![11.5e9, 5.75e9, 5.75e9, 24e9, 24e9, 24e9]);
        assert_eq!(devices[0].swap_available, 2e9);
        assert_eq!(devices[3].swap_available, 4e9);
    }

    /// A cached profile reads back to the same figures, to the last bit (serde_json's
    /// default float parser was a unit in the last place off for some values: a measured
    /// KV write time of 2.2055761549993707e-7 s came back as 2.205576154999371e-7).
    #[test]
    fn figures_survive_json_exactly() {
        for x in [2.2055761549993707e-7_f64, 0.1 + 0.2, 1.0 / 3.0, 9.007199254740993e15, 5e-324, 1.7976931348623157e308] {
            let back: f64 = serde_json::from_str(&serde_json::to_string(&x).unwrap()).unwrap();
            assert_eq!(back.to_bits(), x.to_bits(), "{x:e}");
        }
    }
}
