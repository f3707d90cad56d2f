//! Measures this device (engine::profiler) into the scheduler's `DeviceProfile`: for
//! `hearth profile`, for a ring head and for a worker. The result is cached per device and
//! reused until the hardware, the thread count or hearth itself changes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use engine::gguf::GgmlType;
use engine::profiler;
use scheduler::{DeviceProfile, GpuBackend, GpuProfile, Os, PerQuant};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How long each kernel runs: long enough for a stable rate, short enough that the whole
/// profile stays within a few seconds.
const KERNEL_TIME: Duration = Duration::from_millis(150);
const RANDOM_READ_TIME: Duration = Duration::from_millis(400);
/// One token's K and V of one layer when no model is given: 8 KV heads x 128 dims, F16.
const TYPICAL_KV_BYTES: usize = 2 * 8 * 128 * 2;
/// A typical hidden state when no model is given (an 8B model's 4,096).
const TYPICAL_EMBD: usize = 4096;
/// The leading entries of `formats`: the paper's, which every profile holds.
const PAPER_FORMATS: usize = 8;

#[derive(Serialize, Deserialize)]
struct Cached {
    key: String,
    profile: DeviceProfile,
}

/// This device's profile for `model` (its disk and KV size; without one, the models
/// folder and a typical KV size): from the cache unless `fresh` or stale, else measured
/// (and how long that took). Also the folder whose disk was measured.
pub fn device_profile(threads: usize, model: Option<(&std::path::Path, &engine::ModelFile)>, fresh: bool) -> Result<(DeviceProfile, Option<Duration>, PathBuf)> {
    let (disk_dir, kv_bytes, key) = target(threads, model, None)?;
    let cache = cache_path();
    // A profile calibrated by an older hearth lacks the small-batch steps: measured again.
    let cached = (!fresh).then(|| read_cache(&cache, &key)).flatten().filter(|p| model.is_none() || !p.row_steps.is_empty());
    let (profile, took) = match cached {
        Some(p) => (p, None),
        None => {
            let start = Instant::now();
            let mut p = measure(threads, &disk_dir, model, kv_bytes)?;
            if let Some((path, file)) = model {
                calibrate(&mut p, path, file, threads)?;
            }
            if let Some(path) = &cache {
                write_cache(path, &key, &p);
            }
            (p, Some(start.elapsed()))
        }
    };
    Ok((DeviceProfile { host: Some(super::host::host_share(threads)), ..profile }, took, disk_dir))
}

/// Reads the parts of a (cached) profile that change while the device runs: available
/// RAM and free swap. The online re-planning compares them between gatherings.
/// In a memory cgroup (a container, a systemd slice) the limit caps what is available:
/// the model's pages count against it as much as the process's own memory.
pub fn refresh_memory(p: &mut DeviceProfile) {
    let (_, ram_available, swap_available) = profiler::meminfo();
    let limit = engine::residency::memory_budget().filter(|b| b.source != engine::residency::MemorySource::MemAvailable).map_or(u64::MAX, |b| b.bytes);
    p.ram_available = ram_available.min(limit) as f64;
    p.swap_available = swap_available as f64;
}

fn measure(threads: usize, disk_dir: &std::path::Path, model: Option<(&std::path::Path, &engine::ModelFile)>, kv_bytes: usize) -> Result<DeviceProfile> {
    let rate = |ty| profiler::matvec_flops(ty, threads, KERNEL_TIME);
    let mut rates = Vec::new();
    for (i, ty) in formats(model.map(|(_, f)| f)).into_iter().enumerate() {
        match rate(ty) {
            Ok(r) => rates.push((ty, r)),
            // The paper's formats must be timed; every other format the model holds is
            // timed at its own kernels' rate (an IQ4_XS or MXFP4 model is not charged at a
            // neighbour's), and one ggml cannot time is left to the nearest.
            Err(e) if i < PAPER_FORMATS => return Err(e.into()),
            Err(e) => tracing::debug!("no kernel rate for {ty}: {e}"),
        }
    }
    let cpu_flops = per_quant(&rates);
    let (disk_seq_read, disk_rand_read) = profiler::disk_read(disk_dir, model.map(|(p, _)| p), RANDOM_READ_TIME)?;
    let (ram_total, _, _) = profiler::meminfo();
    let os = if std::path::Path::new("/system/build.prop").exists() {
        Os::Android
    } else if cfg!(target_os = "macos") {
        Os::Macos
    } else {
        Os::Linux
    };
    let mut profile = DeviceProfile {
        name: String::new(),
        os,
        head: false,
        cpu_flops,
        cpu_read_bw: profiler::memory_read_bw(threads),
        kv_copy_cpu_s: profiler::kv_copy_secs(kv_bytes),
        disk_seq_read,
        disk_rand_read,
        ram_total: ram_total as f64,
        ram_available: 0.0,
        swap_available: 0.0,
        // What Android may swap out of other apps is not measurable from here; 0 keeps
        // the plan on the safe side.
        bytes_can_swap: 0.0,
        // The first accelerator of a GPU build (none in the CPU-only build).
        gpu: gpu_profile(model, kv_bytes)?,
        // Measured by the head on the real ring links.
        comm_s: 0.0,
        prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
    };
    refresh_memory(&mut profile);
    Ok(profile)
}

/// The formats whose rates a profile holds: the paper's, then every other one the model has.
fn formats(model: Option<&engine::ModelFile>) -> Vec<GgmlType> {
    let mut out = vec![GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::F16, GgmlType::F32];
    out.extend(model.map(crate::runtime::profiling::model::extra_formats).unwrap_or_default());
    out
}

/// `PerQuant` from measured (format, FLOP/s) pairs: the paper's formats in their fields,
/// others by name.
fn per_quant(rates: &[(GgmlType, f64)]) -> PerQuant {
    let mut q = PerQuant::default();
    for &(ty, r) in rates {
        *crate::runtime::profiling::model::format_slot(&mut q, ty) = r;
    }
    q
}

/// The scheduler's backend for a ggml backend name; None for one it has no terms for.
fn gpu_backend(name: &str) -> Option<GpuBackend> {
    match name {
        "CUDA" => Some(GpuBackend::Cuda),
        "Metal" | "MTL" => Some(GpuBackend::Metal),
        "Vulkan" => Some(GpuBackend::Vulkan),
        _ => None,
    }
}

/// Measures this build's first accelerator (kernel rates per format, its memory's read
/// bandwidth, host<->device copies of one hidden state, a KV write): the paper's GPU terms.
/// None without one.
fn gpu_profile(model: Option<(&std::path::Path, &engine::ModelFile)>, kv_bytes: usize) -> Result<Option<GpuProfile>> {
    let Some(info) = engine::accelerators().into_iter().next() else { return Ok(None) };
    let Some(backend) = gpu_backend(&info.backend) else {
        tracing::warn!(device = %info.name, backend = %info.backend, "accelerator of a backend the scheduler has no terms for; planning without it");
        return Ok(None);
    };
    let acc = engine::Accelerator::open(info.index).map_err(|e| Error::Profile(format!("accelerator {}: {e}", info.name)))?;
    let hidden_bytes = 4 * model.map_or(TYPICAL_EMBD, |(_, f)| f.spec.hidden_width());
    let r = profiler::accelerator_rates(&acc, &formats(model.map(|(_, f)| f)), hidden_bytes, kv_bytes, KERNEL_TIME).map_err(|e| Error::Profile(format!("accelerator {}: {e}", info.name)))?;
    Ok(Some(GpuProfile {
        backend,
        flops: per_quant(&r.flops),
        read_bw: r.read_bw,
        memory_available: info.memory_free as f64,
        kv_copy_s: r.kv_copy_s,
        // An integrated GPU reads the host's memory: nothing is copied.
        ram_to_vram_s: if info.integrated { 0.0 } else { r.host_to_device_s },
        vram_to_ram_s: if info.integrated { 0.0 } else { r.device_to_host_s },
        uma: info.integrated,
    }))
}

/// What the cached profile depends on: hearth's version, the CPU, the core and thread
/// counts, the installed memory and the disk the models are on.
/// What a profile is measured for: the folder whose disk is measured, one token's K and
/// V of one layer in bytes, and the cache key of the result.
/// The disk measured is the model's; without a model, `no_model_dir` (default: the
/// models folder), where models will be.
fn target(threads: usize, model: Option<(&std::path::Path, &engine::ModelFile)>, no_model_dir: Option<&std::path::Path>) -> Result<(PathBuf, usize, String)> {
    let (disk_dir, kv_bytes) = match model {
        Some((path, file)) => {
            let dir = path.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
            (dir, 2 * (file.spec.max_n_embd_kv() + file.spec.max_n_embd_v_cache()))
        }
        None => {
            let dir = no_model_dir.map_or_else(crate::models::models_dir, PathBuf::from);
            std::fs::create_dir_all(&dir).map_err(|e| Error::Profile(format!("cannot create {}: {e}", dir.display())))?;
            (dir, TYPICAL_KV_BYTES)
        }
    };
    let key = cache_key(threads, &disk_dir, kv_bytes, model.map(|(_, f)| f));
    Ok((disk_dir, kv_bytes, key))
}

/// Tokens decoded before timing (the first ones page the weights in) and timed.
const CALIBRATION_WARMUP: usize = 4;
const CALIBRATION_TOKENS: usize = 16;
/// Tokens of the prompt-shaped batch timed beside decode: the middle of the chunk sizes a
/// pipelined prompt uses, large enough that the per-token cost dominates.
const CALIBRATION_PROMPT: usize = scheduler::pipelining::PROMPT_BATCH;
/// Decode batches timed from one row up to this many: the groups micro-batches of a
/// family's streams carry (`scheduler::pipelining::auto_depth` weighs them), each timed
/// this many times (the fastest counts) after one that builds its graph.
const CALIBRATION_ROWS: usize = 8;
const CALIBRATION_ROW_REPS: usize = 5;
/// The timed window spans at least this many weight bytes (or the whole model), so it
/// streams from memory as a real step does instead of staying in the CPU's caches.
const CALIBRATION_BYTES: f64 = 256.0 * 1024.0 * 1024.0;

/// Scales the CPU rates so that the cost model's time for the model's own layers (compute
/// at these rates plus reading weights and KV at the measured bandwidth) equals the
/// engine's measured decode time for them. The kernel benchmarks run on data in cache and
/// one format at a time; a real layer adds graph overhead, formats priced at a
/// neighbour's rate (Q5_0 as Q5_K, ...) and norms, RoPE and attention.
///
/// Also times a prompt-shaped batch over the same layers: what one more token in a batch
/// costs against a decode step (`prompt_token_share`), which cuts prompts into chunks for a
/// ring with micro-batches in flight.
fn calibrate(p: &mut DeviceProfile, path: &std::path::Path, file: &engine::ModelFile, threads: usize) -> Result<()> {
    use engine::{BatchToken, Stage, StageConfig, StageInput};
    let model = crate::runtime::profiling::model::from_gguf(file, "", CALIBRATION_WARMUP + CALIBRATION_TOKENS / 2, engine::CacheTypes::default());
    let n_layer = model.n_layer.max(1);
    let layers = ((CALIBRATION_BYTES / model.layer_bytes.max(1.0)).ceil() as usize).clamp(1, n_layer);
    // Its own mapping of the file: the caller's stays untouched.
    let file = std::sync::Arc::new(engine::ModelFile::open(path)?);
    let n_ctx = (CALIBRATION_WARMUP + CALIBRATION_TOKENS + 1).max(CALIBRATION_PROMPT);
    // A model small enough is timed whole, output layer included, as the head runs it.
    let whole = layers == n_layer;
    let cfg = StageConfig { windows: vec![0..layers], n_seq: 2, n_ctx_seq: n_ctx, max_batch: CALIBRATION_PROMPT, threads, accel_layers: 0, experts_in_ram: 0, owns_output: whole, batch_invariant: false, repack: true, read_chosen_experts: false, kv: Default::default(), draft_snapshots: false };
    let clock = StepClock::for_threads(threads);
    let mut stage = Stage::new(file.clone(), cfg.clone())?;
    let mut times = Vec::with_capacity(CALIBRATION_TOKENS);
    for pos in 0..CALIBRATION_WARMUP + CALIBRATION_TOKENS {
        let t = clock.start();
        stage.forward(0, &[BatchToken { seq: 0, pos: pos as u32, logits: whole }], StageInput::Tokens(&[1]))?;
        if pos >= CALIBRATION_WARMUP {
            times.push(clock.since(t));
        }
    }
    times.sort_by(f64::total_cmp);
    let measured = times[times.len() / 2];
    // The prompt batch on a sequence of its own, twice (the first builds its graph).
    let batch: Vec<BatchToken> = (0..CALIBRATION_PROMPT).map(|i| BatchToken { seq: 1, pos: i as u32, logits: whole && i + 1 == CALIBRATION_PROMPT }).collect();
    let ids = vec![1; CALIBRATION_PROMPT];
    let mut prompt_s = f64::INFINITY;
    for _ in 0..2 {
        stage.clear_sequence(1);
        let t = clock.start();
        stage.forward(0, &batch, StageInput::Tokens(&ids))?;
        prompt_s = prompt_s.min(clock.since(t));
    }
    p.prompt_token_share = ((prompt_s / measured - 1.0) / (CALIBRATION_PROMPT - 1) as f64).clamp(0.0, 1.0);
    drop(stage);
    // Small batches, through the layers alone and, where it weighs, the output layer alone
    // (the head's; its kernel's row tiles differ from the layers').
    let rows_cfg = |windows, owns_output| StageConfig { windows, n_seq: CALIBRATION_ROWS, n_ctx_seq: CALIBRATION_ROW_REPS + 1, max_batch: CALIBRATION_ROWS, owns_output, ..cfg.clone() };
    let ids = vec![1; CALIBRATION_ROWS];
    let mut layers_stage = Stage::new(file.clone(), rows_cfg(vec![0..layers], false))?;
    p.row_steps = row_steps(&mut layers_stage, |b| StageInput::Tokens(&ids[..b]), false, clock)?;
    drop(layers_stage);
    p.output_row_steps = if whole {
        // Hidden states of a plausible size (the output norm scales them anyway).
        let n_embd = file.spec.hidden_width();
        let hidden: Vec<f32> = (0..CALIBRATION_ROWS * n_embd).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect();
        let mut output_stage = Stage::new(file.clone(), rows_cfg(vec![n_layer..n_layer], true))?;
        row_steps(&mut output_stage, |b| StageInput::Hidden(&hidden[..b * n_embd]), true, clock)?
    } else {
        Vec::new()
    };
    let l = layers as f64;
    let mut compute = l * model.layer_flops.time_at(&p.cpu_flops);
    let mut memory = l * (p.kv_copy_cpu_s + model.layer_read_bytes() / p.cpu_read_bw);
    if whole {
        compute += model.output_flops.time_at(&p.cpu_flops);
        memory += (model.lookup_bytes() + model.output_bytes) / p.cpu_read_bw;
    }
    // Only the compute part is fitted; if reading alone explains the time, keep the rates.
    if measured > memory && compute > 0.0 {
        let scale = compute / (measured - memory);
        for rate in p.cpu_flops.values_mut() {
            *rate *= scale;
        }
        tracing::info!(layers, whole, measured_ms = measured * 1e3, scale, prompt_token_share = p.prompt_token_share, row_steps = ?p.row_steps, output_row_steps = ?p.output_row_steps, "CPU rates calibrated on the model's own layers");
    }
    Ok(())
}

/// How the calibration times a step. Wall time, where the process may run all its threads
/// at once. Under a CPU quota smaller than its threads (a cgroup, a container's `--cpus`,
/// an emulated device) wall time is mostly where the step fell in the quota's period: a
/// short step that fits in what is left of a period runs at a whole core's speed, a longer
/// one waits for the next period, so the fastest of a few repetitions flatters small
/// batches at random (measured, 0.66-core quota, one thread: two rows 1.31x one row in one
/// profile, 1.64x in the next; 1.32–1.35x without the quota). A busy ring member runs at
/// its quota's rate whatever the step, so there a step takes the process's CPU time over
/// the quota: the same for every repetition, and what the step costs when the member is
/// saturated, as micro-batches in flight keep it.
#[derive(Debug, Clone, Copy)]
enum StepClock {
    Wall,
    /// Process CPU time over the quota (in cores).
    QuotaCpu(f64),
}

/// A point on a `StepClock`.
enum StepStart {
    Wall(Instant),
    Cpu(f64),
}

impl StepClock {
    fn for_threads(threads: usize) -> StepClock {
        StepClock::for_share(&super::host::host_share(threads), process_cpu_s().is_some())
    }

    /// The clock for a process with `share` of its machine (`cpu_clock`: whether the
    /// process's CPU time can be read).
    fn for_share(share: &scheduler::HostShare, cpu_clock: bool) -> StepClock {
        if cpu_clock && share.quota > 0.0 && share.quota < share.threads.max(1) as f64 {
            StepClock::QuotaCpu(share.quota)
        } else {
            StepClock::Wall
        }
    }

    fn start(self) -> StepStart {
        match self {
            StepClock::QuotaCpu(_) => StepStart::Cpu(process_cpu_s().unwrap_or(0.0)),
            StepClock::Wall => StepStart::Wall(Instant::now()),
        }
    }

    /// Seconds since `start`.
    fn since(self, start: StepStart) -> f64 {
        let quota = match self {
            StepClock::QuotaCpu(q) => q,
            StepClock::Wall => 1.0,
        };
        match start {
            StepStart::Cpu(t) => (process_cpu_s().unwrap_or(t) - t) / quota,
            StepStart::Wall(t) => t.elapsed().as_secs_f64(),
        }
    }
}

/// CPU time of this process, all threads (ggml's included), in seconds.
fn process_cpu_s() -> Option<f64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which lives on this stack frame.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

/// `stage`'s window 0 on batches of 1 to `CALIBRATION_ROWS` decode tokens (one of each of
/// that many sequences, `input(b)` their input), each as a multiple of one token's time:
/// the fastest of `CALIBRATION_ROW_REPS` after one round that builds the graphs, never more
/// than a bigger batch's.
fn row_steps<'a>(stage: &mut engine::Stage, input: impl Fn(usize) -> engine::StageInput<'a>, logits: bool, clock: StepClock) -> Result<Vec<f64>> {
    let mut times = vec![f64::INFINITY; CALIBRATION_ROWS];
    // The sizes in turn, repetition after repetition: a neighbour's burst then slows one
    // repetition of several sizes, not every repetition of one (which made a size look
    // dearer than it is beside a busy process). Each time a fresh token at position 0.
    for rep in 0..=CALIBRATION_ROW_REPS {
        for b in 1..=CALIBRATION_ROWS {
            (0..b).for_each(|s| stage.clear_sequence(s as engine::SeqId));
            let batch: Vec<engine::BatchToken> = (0..b).map(|s| engine::BatchToken { seq: s as engine::SeqId, pos: 0, logits }).collect();
            let t = clock.start();
            stage.forward(0, &batch, input(b))?;
            if rep > 0 {
                times[b - 1] = times[b - 1].min(clock.since(t));
            }
        }
    }
    // More rows never cost less than fewer, and noise (a cold cache on the first batch, a
    // neighbour's burst) only ever adds time: where a batch measured slower than a bigger
    // one, the bigger one's time is the truer bound. Without this a noisy host's profile
    // once said two rows cost 0.79 of one.
    for i in (0..times.len().saturating_sub(1)).rev() {
        times[i] = times[i].min(times[i + 1]);
    }
    let one = times[0].max(f64::MIN_POSITIVE);
    Ok(times.iter().map(|t| t / one).collect())
}

fn cache_key(threads: usize, disk_dir: &std::path::Path, kv_bytes: usize, model: Option<&engine::ModelFile>) -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|v| v.trim_start_matches([' ', '\t', ':']).to_string()).unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let (ram, _, _) = profiler::meminfo();
    #[cfg(unix)]
    let disk = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(disk_dir).map_or(0, |m| m.dev())
    };
    #[cfg(not(unix))]
    let disk = 0;
    // Calibrated on a model's layers: the rates hold for that model's formats.
    let model = model.map_or_else(String::new, |f| format!(" | model {}", f.fingerprint()));
    // A GPU build (or a driver) that appears or goes changes the GPU terms.
    let accel: Vec<String> = engine::accelerators().into_iter().map(|a| a.description).collect();
    format!("hearth {} | {cpu} | {cores} cores | {threads} threads | {ram} bytes | disk {disk} | kv {kv_bytes}{model} | accelerators [{}]", env!("CARGO_PKG_VERSION"), accel.join(", "))
}

fn cache_path() -> Option<PathBuf> {
    Some(crate::process::cache_dir()?.join("device-profile.json"))
}

/// Profiles kept in the cache: one per thread count, model disk and KV size in use on this
/// device (a head and its workers on one machine often differ in threads).
const CACHED_PROFILES: usize = 16;

fn read_entries(path: &std::path::Path) -> Vec<Cached> {
    // A cache from an older hearth (one entry, or anything unreadable) is simply remeasured.
    std::fs::read_to_string(path).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default()
}

fn read_cache(path: &Option<PathBuf>, key: &str) -> Option<DeviceProfile> {
    read_entries(path.as_ref()?).into_iter().find(|c| c.key == key).map(|c| c.profile)
}

fn write_cache(path: &std::path::Path, key: &str, profile: &DeviceProfile) {
    let mut entries = read_entries(path);
    entries.retain(|c| c.key != key);
    entries.insert(0, Cached { key: key.to_string(), profile: profile.clone() });
    entries.truncate(CACHED_PROFILES);
    if let Err(e) = crate::process::write_atomically(path, serde_json::to_string_pretty(&entries).unwrap_or_default().as_bytes()) {
        tracing::warn!("could not cache the profile in {}: {e}", path.display());
    }
}

/// The profile of this device for a serving process (a ring head or a worker): from the
/// cache when it has one, else measured by a `hearth profile` child process. Measuring in
/// the serving process itself left its OpenMP threads sleeping between the ops of every
/// later step (measured: 27.9 against 10.4 ms per token on 2 threads), so the kernels run
/// in a process of their own.
///
/// Without a model (a worker that will fetch its layers), the disk measured is
/// `no_model_dir`, where the fetched layers go.
pub fn serving_profile(threads: usize, model: Option<(&std::path::Path, &engine::ModelFile)>, no_model_dir: &std::path::Path) -> Result<DeviceProfile> {
    let p = measured_or_cached(threads, model, no_model_dir)?;
    Ok(DeviceProfile { host: Some(super::host::host_share(threads)), ..p })
}

fn measured_or_cached(threads: usize, model: Option<(&std::path::Path, &engine::ModelFile)>, no_model_dir: &std::path::Path) -> Result<DeviceProfile> {
    let (disk_dir, _, key) = target(threads, model, Some(no_model_dir))?;
    if let Some(p) = read_cache(&cache_path(), &key) {
        return Ok(p);
    }
    let exe = std::env::current_exe().map_err(|e| Error::Profile(format!("cannot find the hearth binary to measure this device: {e}")))?;
    let mut command = std::process::Command::new(exe);
    command.args(["profile", "--json", "--threads", &threads.to_string()]);
    match model {
        Some((path, _)) => {
            command.arg("--model").arg(path);
        }
        // The child measures the same folder (and caches under the same key).
        None => {
            command.env("HEARTH_MODELS_DIR", &disk_dir);
        }
    }
    let out = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::Profile(format!("cannot run hearth profile: {e}")))?;
    if !out.status.success() {
        return Err(Error::Profile(format!("hearth profile failed ({})", out.status)));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| Error::Profile(format!("hearth profile printed no profile: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under a quota smaller than its threads a step is timed by CPU time over the quota;
    /// with cores enough, by the wall clock.
    #[test]
    fn steps_under_a_quota_are_timed_by_cpu_time() {
        let share = |threads, quota| scheduler::HostShare { id: String::new(), cores: 2.0, threads, quota, own_memory: false };
        assert!(matches!(StepClock::for_share(&share(1, 0.66), true), StepClock::QuotaCpu(q) if q == 0.66));
        assert!(matches!(StepClock::for_share(&share(4, 2.0), true), StepClock::QuotaCpu(q) if q == 2.0));
        assert!(matches!(StepClock::for_share(&share(1, 2.0), true), StepClock::Wall));
        assert!(matches!(StepClock::for_share(&share(2, 2.0), true), StepClock::Wall));
        assert!(matches!(StepClock::for_share(&share(1, 0.66), false), StepClock::Wall));
        // The process's CPU time advances while it computes (and only then: no bound on
        // how fast, which depends on the host).
        let clock = StepClock::QuotaCpu(0.5);
        let t = clock.start();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(clock.since(t) > 0.0);
    }
}
