//! Paging a device's windows in and out around its compute (prima.cpp's piped ring with
//! prefetch): after running window r, a device optionally releases r (when its windows do
//! not fit its memory, so the read-ahead below cannot evict pages it is about to use) and
//! starts reading window r+1 on a background thread while the other devices compute.
//! It also keeps per-window statistics (compute time, time waiting for input, bytes read
//! from disk, residency) for the `profile` control method.
//!
//! Per step this costs two preads of /proc/self/io, one mincore over the window and, with
//! a read-ahead or release due, one thread spawn: tens of microseconds against steps of
//! milliseconds.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::residency::{self, MemoryBudget, Prefetch};
use engine::{ModelFile, StageConfig};
use serde_json::{json, Value};

/// Cumulative and last-step figures of one window.
#[derive(Debug, Default, Clone)]
pub struct WindowStats {
    pub steps: u64,
    pub compute: Duration,
    pub compute_last: Duration,
    /// From sending the previous output until this window's input arrived.
    pub wait: Duration,
    pub wait_last: Duration,
    /// Bytes read from disk by this process while this window computed (page faults,
    /// plus a read-ahead still running) ...
    pub read_compute: u64,
    pub read_compute_last: u64,
    /// ... and while it waited for this window's input (read-ahead overlapped with others).
    pub read_wait: u64,
    pub read_wait_last: u64,
    /// Bytes of the window resident when its compute started (mincore).
    pub resident_at_start_last: u64,
    pub resident_at_start_total: u64,
}

/// What decided whether windows are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReason {
    Plan,
    Memory,
    UnknownMemory,
    /// A MoE window: kept (its tokens read a few experts each; the page cache keeps them).
    Moe,
}

pub struct WindowPager {
    file: Arc<ModelFile>,
    layers: Vec<Range<usize>>,
    ranges: Vec<Vec<Range<usize>>>,
    /// What is read ahead of each window: all of it, or a MoE window's dense part.
    prefetch_ranges: Vec<Vec<Range<usize>>>,
    bytes: Vec<u64>,
    prefetch: bool,
    release: bool,
    reason: ReleaseReason,
    budget: Option<MemoryBudget>,
    reserved: u64,
    in_flight: Option<(usize, Prefetch)>,
    stats: Vec<WindowStats>,
    mincore: Vec<u8>,
    io: Option<residency::ProcessIo>,
    /// Compute start and the read counter then, of the window running now.
    started: Option<(Instant, u64)>,
    /// The read counter when the last window finished.
    read_at_end: Option<u64>,
}

/// Whether a stage with these windows will be paged from the file's mapping: when the
/// plan releases windows after use, or when they would not fit the memory this process
/// may use beside what the stage itself will allocate (`stage`). Such a stage is never
/// repacked (repacked copies are anonymous memory: a process past its limit is killed, not
/// paged) and, for a MoE model, reads only the experts its tokens chose
/// (`read_chosen_experts`).
pub fn pages_from_disk(file: &ModelFile, layers: &[Range<usize>], release: Option<bool>, stage: &StageConfig) -> bool {
    if release == Some(true) {
        return true;
    }
    let need: u64 = layers.iter().flat_map(|l| file.layer_byte_ranges(l.clone())).map(|r| r.len() as u64).sum();
    let n_layers = layers.iter().map(|l| l.len()).sum();
    match residency::memory_budget() {
        Some(b) => residency::overloaded(need, b.bytes, residency::anon_bytes().unwrap_or(0) + stage_anon_bytes(&file.spec, n_layers, stage)),
        None => false,
    }
}

/// Anonymous memory a stage allocates besides its weights, before it has: its KV cache
/// (the windows' layers, every sequence's cells, of the cache's types) and one batch's
/// intermediates (the FFN's hidden width twice and a few rows of the model's width, F32;
/// the logits when it owns the output). Without it, a 70B-shaped layer of 0.5 GB whose
/// repacked copy fit a 590 MiB limit left no room for its ~160 MB of buffers, and the
/// process was killed at its first prompt.
pub fn stage_anon_bytes(spec: &engine::ModelSpec, n_layers: usize, stage: &StageConfig) -> u64 {
    let cells = (stage.n_seq * stage.n_ctx_seq) as f64;
    let kv = n_layers as f64 * cells * (spec.max_n_embd_kv() as f64 * stage.kv.k.bytes_per_element() + spec.max_n_embd_v_cache() as f64 * stage.kv.v.bytes_per_element());
    let n_ff = spec.moe.map_or(spec.n_ff, |m| m.n_ff_exp * m.n_expert_used.max(1));
    let rows = stage.max_batch as f64;
    let batch = rows * 4.0 * (2 * n_ff + 4 * spec.n_embd) as f64 + if stage.owns_output { rows * 4.0 * spec.n_vocab as f64 } else { 0.0 };
    (kv + batch) as u64
}

impl WindowPager {
    /// `release`: Some to force it, None to release only when the windows overflow the
    /// memory this process may use (its cgroup limit, else MemAvailable) after its own
    /// anonymous memory (KV caches, buffers) is set aside.
    pub fn new(file: Arc<ModelFile>, layers: Vec<Range<usize>>, prefetch: bool, release: Option<bool>) -> WindowPager {
        let ranges: Vec<Vec<Range<usize>>> = layers.iter().map(|l| file.layer_byte_ranges(l.clone())).collect();
        let bytes: Vec<u64> = ranges.iter().map(|rs| rs.iter().map(|r| r.len() as u64).sum()).collect();
        let need: u64 = bytes.iter().sum();
        let budget = residency::memory_budget();
        let reserved = residency::anon_bytes().unwrap_or(0);
        let (release, reason) = match (release, budget) {
            (Some(r), _) => (r, ReleaseReason::Plan),
            // See below: the page cache keeps a MoE window's experts in use.
            (None, _) if file.spec.moe.is_some() => (false, ReleaseReason::Moe),
            // With one window there is no other window to make room for: the next step
            // runs the same window again, so releasing it could only add reads.
            (None, Some(_)) if layers.len() < 2 => (false, ReleaseReason::Memory),
            (None, Some(b)) => (residency::overloaded(need, b.bytes, reserved), ReleaseReason::Memory),
            (None, None) => (false, ReleaseReason::UnknownMemory),
        };
        // A MoE window is neither released nor read ahead whole (measured, docs/benchmarks.md,
        // "MoE larger than memory"): each token reads a few experts of each layer, so the
        // page cache keeps the ones in use; releasing drops them and reading every expert
        // ahead costs the disk ~15x what the tokens read. Only the dense part is read ahead.
        let moe = file.spec.moe.is_some();
        let prefetch_ranges: Vec<Vec<Range<usize>>> = if moe { layers.iter().map(|l| file.layer_byte_ranges_without_experts(l.clone())).collect() } else { ranges.clone() };
        let prefetch = prefetch && layers.len() > 1;
        let n = layers.len();
        WindowPager {
            file,
            layers,
            ranges,
            prefetch_ranges,
            bytes,
            prefetch,
            release,
            reason,
            budget,
            reserved,
            in_flight: None,
            stats: vec![WindowStats::default(); n],
            mincore: Vec::new(),
            io: residency::ProcessIo::open(),
            started: None,
            read_at_end: None,
        }
    }

    pub fn release(&self) -> bool {
        self.release
    }

    pub fn prefetch(&self) -> bool {
        self.prefetch
    }

    /// One line for the log at plan load.
    pub fn describe(&self) -> String {
        let need: u64 = self.bytes.iter().sum();
        let budget = match self.budget {
            Some(b) => format!("{} MiB ({:?})", b.bytes >> 20, b.source),
            None => "unknown".into(),
        };
        format!(
            "windows need {} MiB, memory budget {budget}, {} MiB already in use: release {} ({:?}), prefetch {}",
            need >> 20,
            self.reserved >> 20,
            if self.release { "on" } else { "off" },
            self.reason,
            if self.prefetch { "on" } else { "off" }
        )
    }

    /// Window `r`'s input arrived after `waited` (None for the first frame of a link).
    pub fn before(&mut self, r: usize, waited: Option<Duration>) {
        let Some(stats) = self.stats.get_mut(r) else { return };
        let now_read = self.io.as_ref().and_then(|io| io.read_bytes()).unwrap_or(0);
        if let Some(w) = waited {
            stats.wait += w;
            stats.wait_last = w;
        }
        let read_wait = self.read_at_end.map_or(0, |e| now_read.saturating_sub(e));
        stats.read_wait += read_wait;
        stats.read_wait_last = read_wait;
        let resident = self.file.resident_bytes_with(&self.ranges[r], &mut self.mincore) as u64;
        stats.resident_at_start_last = resident;
        stats.resident_at_start_total += resident;
        self.started = Some((Instant::now(), now_read));
    }

    /// Window `r` finished: record it, release it if overloaded, read ahead the next one.
    pub fn after(&mut self, r: usize) {
        let k = self.layers.len();
        if r >= k {
            return;
        }
        let now_read = self.io.as_ref().and_then(|io| io.read_bytes()).unwrap_or(0);
        if let Some((t0, read0)) = self.started.take() {
            let stats = &mut self.stats[r];
            let took = t0.elapsed();
            stats.steps += 1;
            stats.compute += took;
            stats.compute_last = took;
            stats.read_compute_last = now_read.saturating_sub(read0);
            stats.read_compute += stats.read_compute_last;
        }
        self.read_at_end = Some(now_read);
        if self.release || self.prefetch {
            // The read-ahead of the window just run is stale: stop it before releasing.
            if let Some((_, p)) = self.in_flight.take() {
                p.cancel();
            }
            // Both on a background thread, release first, so the output goes on at once.
            let release = if self.release { self.ranges[r].clone() } else { Vec::new() };
            let next = (r + 1) % k;
            // A window that was wholly in memory when it last ran, on a device that is not
            // releasing, is still there: reading it again would only take a core from the
            // device computing now.
            let resident = !self.release && self.stats[next].steps > 0 && self.stats[next].resident_at_start_last >= self.bytes[next];
            let ahead = if self.prefetch && !resident { self.prefetch_ranges[next].clone() } else { Vec::new() };
            if !release.is_empty() || !ahead.is_empty() {
                self.in_flight = Some((next, Prefetch::start_after_release(self.file.clone(), release, ahead)));
            }
        }
        tracing::debug!(
            window = r,
            compute_ms = self.stats[r].compute_last.as_secs_f64() * 1e3,
            wait_ms = self.stats[r].wait_last.as_secs_f64() * 1e3,
            read_compute = self.stats[r].read_compute_last,
            read_wait = self.stats[r].read_wait_last,
            resident_at_start = self.stats[r].resident_at_start_last,
            "window done"
        );
    }

    /// Waits for the read-ahead in flight, if any (tests, and measuring it).
    pub fn wait_prefetch(&mut self) {
        if let Some((_, p)) = self.in_flight.take() {
            p.wait();
        }
    }

    /// Window `r`'s last step, as it travels to the head in the frame.
    pub fn report(&self, r: usize) -> transport::StageReport {
        let Some(s) = self.stats.get(r) else { return transport::StageReport::default() };
        transport::StageReport {
            compute_us: u32::try_from(s.compute_last.as_micros()).unwrap_or(u32::MAX),
            read_bytes: s.read_compute_last,
            prefetch_bytes: s.read_wait_last,
        }
    }

    pub fn stats(&self) -> &[WindowStats] {
        &self.stats
    }

    /// Resident bytes of window `r` now.
    pub fn resident_now(&self, r: usize) -> u64 {
        self.file.resident_bytes(&self.ranges[r]) as u64
    }

    /// The `profile` answer: settings, and per window its size, residency now and stats.
    pub fn profile(&self) -> Value {
        let secs = |d: Duration| d.as_secs_f64();
        let windows: Vec<Value> = (0..self.layers.len())
            .map(|r| {
                let s = &self.stats[r];
                json!({
                    "layers": [self.layers[r].start, self.layers[r].end],
                    "bytes": self.bytes[r],
                    "resident_bytes": self.resident_now(r),
                    "steps": s.steps,
                    "compute_s": secs(s.compute),
                    "compute_last_s": secs(s.compute_last),
                    "wait_s": secs(s.wait),
                    "wait_last_s": secs(s.wait_last),
                    "read_compute_bytes": s.read_compute,
                    "read_compute_last_bytes": s.read_compute_last,
                    "read_wait_bytes": s.read_wait,
                    "read_wait_last_bytes": s.read_wait_last,
                    "resident_at_start_last_bytes": s.resident_at_start_last,
                    "resident_at_start_mean_bytes": s.resident_at_start_total.checked_div(s.steps).unwrap_or(0),
                })
            })
            .collect();
        json!({
            "prefetch": self.prefetch,
            "release": self.release,
            "release_reason": format!("{:?}", self.reason),
            "memory_budget_bytes": self.budget.map(|b| b.bytes),
            "memory_source": self.budget.map(|b| format!("{:?}", b.source)),
            "reserved_bytes": self.reserved,
            "windows": windows,
        })
    }
}
